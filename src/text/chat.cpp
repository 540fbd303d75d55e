#include "text/chat.h"

#include "runtime/error.h"
#include "text/jinja.h"
#include "text/tokenizer.h"

namespace fitmoe {

const std::string& chatml_template() {
  static const std::string t =
      "{%- for message in messages -%}\n"
      "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}\n"
      "{%- endfor -%}\n"
      "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}";
  return t;
}

std::string render_chat(const std::string& tmpl, const std::vector<ChatMessage>& msgs, bool add_generation_prompt,
                        const nlohmann::ordered_json& extra_context) {
  nlohmann::ordered_json ctx = nlohmann::ordered_json::object();
  nlohmann::ordered_json messages = nlohmann::ordered_json::array();
  for (const auto& m : msgs) {
    nlohmann::ordered_json j = nlohmann::ordered_json::object();
    j["role"] = m.role;
    j["content"] = m.content;
    if (m.extra.is_object()) {
      for (const auto& [k, v] : m.extra.items()) j[k] = v;
    } else if (!m.extra.is_null()) {
      throw Error("chat message extra fields must be a JSON object");
    }
    messages.push_back(std::move(j));
  }
  ctx["messages"] = std::move(messages);
  ctx["add_generation_prompt"] = add_generation_prompt;
  if (extra_context.is_object()) {
    for (const auto& [k, v] : extra_context.items()) ctx[k] = v;
  } else if (!extra_context.is_null()) {
    throw Error("chat template context must be a JSON object");
  }
  jinja::Template t(tmpl);
  return t.render(ctx);
}

std::string apply_chat_template(const Tokenizer& tok, const std::vector<ChatMessage>& msgs, bool add_generation_prompt,
                                const nlohmann::ordered_json& extra_context) {
  std::string tmpl = tok.chat_template();
  if (tmpl.empty()) tmpl = chatml_template();
  const std::string bos = tok.bos() >= 0 ? tok.token_piece(tok.bos()) : std::string();
  const std::string eos = tok.eos() >= 0 ? tok.token_piece(tok.eos()) : std::string();
  nlohmann::ordered_json ctx = nlohmann::ordered_json::object();
  ctx["bos_token"] = bos;
  ctx["eos_token"] = eos;
  ctx["enable_thinking"] = true;
  if (extra_context.is_object()) {
    for (const auto& [k, v] : extra_context.items()) ctx[k] = v;
  } else if (!extra_context.is_null()) {
    throw Error("chat template context must be a JSON object");
  }
  std::string out = render_chat(tmpl, msgs, add_generation_prompt, ctx);
  if (tok.add_bos() && !bos.empty() && out.compare(0, bos.size(), bos) == 0) out.erase(0, bos.size());
  if (tok.add_eos() && !eos.empty() && out.size() >= eos.size() &&
      out.compare(out.size() - eos.size(), eos.size(), eos) == 0)
    out.erase(out.size() - eos.size());
  return out;
}

}  // namespace fitmoe
