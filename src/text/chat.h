// Chat prompts: a model's chat template (tokenizer.chat_template, Jinja) applied to a conversation.
//
//   std::vector<ChatMessage> msgs = {{"system", "You are helpful."}, {"user", "Hi"}};
//   std::string prompt = apply_chat_template(tok, msgs, /*add_generation_prompt=*/true);
//   auto ids = tok.encode(prompt, /*add_special=*/true, /*parse_special=*/true);
//
// The templates of Qwen3, Qwen3.5/3.6, Gemma 3 and Gemma 4 render as Hugging Face transformers renders
// them (see text/jinja.h for the supported Jinja subset). Tools can be passed in extra_context["tools"];
// templates that describe tools render them, nothing here parses tool calls.
#pragma once
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace fitmoe {

class Tokenizer;

struct ChatMessage {
  std::string role;     // "system", "user", "assistant", "tool"
  std::string content;
  // Further message fields the template may read (reasoning_content, tool_calls, name, tool_call_id, or
  // "content" as a list of parts, which replaces the string content). Must be an object or null.
  nlohmann::ordered_json extra = nullptr;
};

// Renders a Jinja chat template. Variables: messages (role/content/extra of each message),
// add_generation_prompt, and every key of extra_context (e.g. bos_token, eos_token, enable_thinking,
// tools). nlohmann::json converts implicitly (its keys then come sorted). Throws fitmoe::Error on template
// errors, unsupported constructs and raise_exception() calls.
std::string render_chat(const std::string& tmpl, const std::vector<ChatMessage>& msgs, bool add_generation_prompt,
                        const nlohmann::ordered_json& extra_context = nullptr);

// What llama.cpp does with a model's template: the GGUF's tokenizer.chat_template (ChatML when it has
// none), bos_token / eos_token set to the text of the tokenizer's BOS / EOS tokens, enable_thinking true
// unless extra_context says otherwise, and, when the tokenizer adds BOS (EOS) itself, a BOS text at the
// start (EOS text at the end) of the result removed so that encode(result, add_special = true) has
// exactly one. extra_context entries override the defaults.
std::string apply_chat_template(const Tokenizer& tok, const std::vector<ChatMessage>& msgs, bool add_generation_prompt,
                                const nlohmann::ordered_json& extra_context = nullptr);

// The template used when a GGUF has none (ChatML, as llama.cpp).
const std::string& chatml_template();

}  // namespace fitmoe
