// Thinking models' output split into reasoning and answer, piece by piece (the server's
// reasoning_content): text inside <think> ... </think> is reasoning, the rest is content. Fed the
// answer's text as it streams, it never emits a partial tag; whitespace between the thinking and the
// answer (and a newline after <think>) is dropped, as llama-server does.
#pragma once
#include <functional>
#include <string>

namespace fitmoe::server {

class ThinkSplitter {
 public:
  using Sink = std::function<bool(const std::string&)>;  // false: stop (client gone)
  // in_thinking: the prompt already opened <think> (templates whose generation prompt does).
  ThinkSplitter(Sink reasoning, Sink content, bool in_thinking = false)
      : reasoning_(std::move(reasoning)), content_(std::move(content)), state_(in_thinking ? Reasoning : Undecided),
        trim_(in_thinking) {}

  bool feed(const std::string& piece);
  bool finish();  // whatever is held back, as what it would have been

 private:
  enum State { Undecided, Reasoning, Content };
  bool emit(bool reasoning, const std::string& text);
  Sink reasoning_, content_;
  State state_;
  bool trim_;  // drop leading newlines of what comes next (after <think>, after </think>)
  std::string buf_;
};

}  // namespace fitmoe::server
