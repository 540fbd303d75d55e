// Tool calls in a model's answer, parsed as it streams (the server's tool_calls): Qwen3's JSON in tags,
//   <tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>
// Qwen3.5/3.6's XML,
//   <tool_call>\n<function=f>\n<parameter=x>\nvalue\n</parameter>\n</function>\n</tool_call>
// and Gemma 4's own notation (bare keys, strings between <|"|> marks),
//   <|tool_call>call:f{x:<|"|>text<|"|>,n:3,o:{a:[1,2]}}<tool_call|>
// Text outside the tags is content (a partial "<tool_call>" at the end is held back); a call is handed
// over whole when its closing tag arrives, so every streamed chunk carries valid JSON arguments. A call
// that does not parse is handed back as content, never dropped.
#pragma once
#include <functional>
#include <string>

namespace fitmoe::server {

struct ToolCall {
  std::string name;
  std::string arguments;  // a JSON object, as text (OpenAI's function.arguments)
};

// Which tags mark a call: Qwen's <tool_call>...</tool_call> (JSON or XML inside) or Gemma 4's
// <|tool_call>...<tool_call|>. The server picks by the chat template.
enum class ToolSyntax { Qwen, Gemma4 };

class ToolCallParser {
 public:
  using Text = std::function<bool(const std::string&)>;
  using Call = std::function<bool(const ToolCall&)>;
  ToolCallParser(Text content, Call call, ToolSyntax syntax = ToolSyntax::Qwen);
  bool feed(const std::string& piece);
  bool finish();
  int calls() const { return n_calls_; }

 private:
  bool close_call();
  Text content_;
  Call call_;
  ToolSyntax syntax_;
  std::string open_, close_;
  bool inside_ = false;
  std::string buf_;
  int n_calls_ = 0;
};

// One call's body (between the tags) in Qwen's JSON or XML format; false if it is neither.
bool parse_tool_call(const std::string& body, ToolCall* out);
// One call's body in Gemma 4's notation (call:name{...}); false if it does not parse.
bool parse_gemma4_tool_call(const std::string& body, ToolCall* out);

}  // namespace fitmoe::server
