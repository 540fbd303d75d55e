// libFuzzer target for the chat-template interpreter (text/jinja.cpp): the input is template text,
// rendered with a fixed small conversation. Parsing or rendering must either succeed or throw
// fitmoe::Error; crashes, sanitizer reports, leaks, other exceptions, and runs past libFuzzer's time or
// memory limits are failures. The render runs under small jinja::Limits so that each input is quick; the
// limits' logic is the same as with the defaults.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include <nlohmann/json.hpp>

#include "runtime/error.h"
#include "text/jinja.h"

namespace {

const nlohmann::ordered_json& context() {
  static const nlohmann::ordered_json c = nlohmann::ordered_json::parse(R"({
    "messages": [
      {"role": "system", "content": "You are helpful."},
      {"role": "user", "content": "Hi <b>there</b>\n  how are you?"},
      {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nFine.", "reasoning_content": "hmm",
       "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"x": 1, "y": [1.5, null, true]}}}]},
      {"role": "tool", "content": [{"type": "text", "text": "42"}, {"type": "image"}]},
      {"role": "user", "content": "ünïcödé 日本語 😀"}
    ],
    "tools": [{"type": "function", "function": {"name": "f", "description": "d",
               "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}],
    "add_generation_prompt": true, "enable_thinking": false, "bos_token": "<s>", "eos_token": "</s>",
    "n": 3, "f": 2.5, "big": 9223372036854775807, "none": null
  })");
  return c;
}

fitmoe::jinja::Limits limits() {
  fitmoe::jinja::Limits l;
  l.max_steps = 200'000;
  l.max_bytes = 64u << 20;
  l.max_output = 1u << 20;
  l.max_string = 1u << 20;
  l.max_items = 1u << 16;
  return l;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const fitmoe::jinja::Limits lim = limits();
  try {
    fitmoe::jinja::Template t(std::string_view(reinterpret_cast<const char*>(data), size));
    (void)t.render(context(), lim);
  } catch (const fitmoe::Error&) {
  }
  return 0;
}
