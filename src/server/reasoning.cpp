#include "server/reasoning.h"

#include "text/held_prefix.h"

namespace fitmoe::server {

namespace {
const std::string kOpen = "<think>", kClose = "</think>";
}  // namespace

bool ThinkSplitter::emit(bool reasoning, const std::string& text) {
  std::string t = text;
  if (trim_) {
    const size_t first = t.find_first_not_of("\n\r ");
    if (first == std::string::npos) return true;  // (still only whitespace: keep trimming)
    t.erase(0, first);
    trim_ = false;
  }
  if (t.empty()) return true;
  return reasoning ? reasoning_(t) : content_(t);
}

bool ThinkSplitter::feed(const std::string& piece) {
  buf_ += piece;
  if (state_ == Undecided) {
    const size_t first = buf_.find_first_not_of("\n\r \t");
    if (first == std::string::npos) return true;
    const std::string rest = buf_.substr(first);
    if (rest.compare(0, kOpen.size(), kOpen) == 0) {
      state_ = Reasoning;
      trim_ = true;
      buf_ = rest.substr(kOpen.size());
    } else if (kOpen.compare(0, rest.size(), rest) == 0) {
      return true;  // could still become <think>
    } else {
      state_ = Content;
    }
  }
  if (state_ == Reasoning) {
    const size_t at = buf_.find(kClose);
    if (at == std::string::npos) {
      const size_t keep = held_prefix(buf_, kClose);
      const std::string out = buf_.substr(0, buf_.size() - keep);
      buf_.erase(0, buf_.size() - keep);
      return emit(true, out);
    }
    const std::string thought = buf_.substr(0, at);
    buf_.erase(0, at + kClose.size());
    state_ = Content;
    if (!emit(true, thought)) return false;
    trim_ = true;
  }
  const std::string out = buf_;
  buf_.clear();
  return emit(false, out);
}

bool ThinkSplitter::finish() {
  const std::string rest = buf_;
  buf_.clear();
  return emit(state_ == Reasoning, rest);
}

}  // namespace fitmoe::server
