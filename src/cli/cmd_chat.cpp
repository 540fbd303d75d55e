// fitmoe chat: an interactive conversation in the terminal with the GGUF's chat template. The KV
// cache is kept between turns: each turn appends only the new text (the earlier turns are not processed
// again). Ctrl-C stops the current answer; /reset starts over; /exit (or end of input) quits.
#include <csignal>
#include <cstdio>
#include <iostream>

#include "cli/common.h"
#include "runtime/error.h"
#include "text/chat.h"
#include "text/tokenizer.h"

namespace fitmoe::cli {

namespace {

volatile std::sig_atomic_t g_generating = 0;
volatile std::sig_atomic_t g_interrupted = 0;

void on_sigint(int) {
  if (g_generating) {
    g_interrupted = 1;  // stop this answer, keep the program
  } else {
    std::_Exit(130);  // at the prompt, Ctrl-C quits as in any shell program
  }
}

size_t common_prefix(const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
  size_t n = 0;
  while (n < a.size() && n < b.size() && a[n] == b[n]) ++n;
  return n;
}

struct ChatArgs {
  ModelOptions model;
  SamplerParams sampler;
  std::string system;
  int n_predict = 2048;
  bool no_think = false;
};

}  // namespace

void register_chat(CLI::App& app) {
  auto* cmd = app.add_subcommand("chat", "interactive multi-turn chat with the model's chat template");
  auto a = std::make_shared<ChatArgs>();
  add_model_options(*cmd, a->model);
  add_sampler_options(*cmd, a->sampler);
  cmd->add_option("--system", a->system, "system prompt");
  cmd->add_option("-n,--n-predict", a->n_predict, "most tokens per answer");
  cmd->add_flag("--no-think", a->no_think, "ask templates that support it to skip the thinking part");
  cmd->callback([a] {
    auto model = load_model(a->model);
    auto tok = Tokenizer::from_gguf(model->file());
    Session s(*model, session_options(a->model));
    Sampler sampler(a->sampler);
    nlohmann::ordered_json extra = nlohmann::ordered_json::object();
    if (a->no_think) extra["enable_thinking"] = false;

    std::vector<ChatMessage> msgs;
    if (!a->system.empty()) msgs.push_back({"system", a->system, nullptr});
    // The rendered conversation text that the cache holds exactly (through the last end-of-turn token);
    // empty when the cache holds something else (an interrupted answer), which forces a full re-render.
    std::string cached_text;
    std::signal(SIGINT, on_sigint);
    std::fprintf(stderr, "chat with %s (%d-token context). /reset starts over, /exit quits, Ctrl-C stops an answer.\n",
                 model->config().name.c_str(), s.n_ctx());
    std::string line;
    while (true) {
      std::fprintf(stdout, "\n> ");
      std::fflush(stdout);
      if (!std::getline(std::cin, line)) break;
      if (line == "/exit" || line == "/quit") break;
      if (line == "/reset") {
        msgs.erase(std::remove_if(msgs.begin(), msgs.end(), [](auto& m) { return m.role != "system"; }), msgs.end());
        s.truncate(0);
        cached_text.clear();
        std::fprintf(stderr, "(conversation reset)\n");
        continue;
      }
      if (line.empty()) continue;
      msgs.push_back({"user", line, nullptr});
      const std::string full = apply_chat_template(*tok, msgs, true, extra);
      std::vector<int32_t> tokens;
      if (!cached_text.empty() && full.compare(0, cached_text.size(), cached_text) == 0) {
        tokens = s.history();
        auto delta = tok->encode(full.substr(cached_text.size()), /*add_special=*/false);
        tokens.insert(tokens.end(), delta.begin(), delta.end());
      } else {
        tokens = tok->encode(full, /*add_special=*/true);
      }
      // Keep what the cache already holds; evaluate only the rest (at least one token for the logits).
      size_t keep = common_prefix(tokens, s.history());
      if (keep == tokens.size()) --keep;
      s.truncate(static_cast<int>(keep));
      if (static_cast<int>(tokens.size()) + a->n_predict > s.n_ctx())
        throw Error("the conversation no longer fits the context of " + std::to_string(s.n_ctx()) + " tokens (use -c)");
      std::vector<int32_t> fresh(tokens.begin() + static_cast<long>(keep), tokens.end());

      StreamDecoder out(*tok);
      std::string answer;
      int32_t last = -1;
      g_interrupted = 0;
      g_generating = 1;
      GenerationStats st;
      s.generate(fresh, a->n_predict, sampler, [&](int32_t t) {
        last = t;
        if (tok->is_eog(t)) return false;
        std::string piece = out.push(t);
        answer += piece;
        std::fputs(piece.c_str(), stdout);
        std::fflush(stdout);
        return !g_interrupted;
      }, tok->eog_tokens(), &st);
      g_generating = 0;
      std::string tail = out.flush();
      answer += tail;
      std::fputs(tail.c_str(), stdout);
      std::fprintf(stdout, "\n");
      std::fprintf(stderr, "[%d prompt tokens at %.1f tok/s, %d generated at %.1f tok/s%s]\n", st.n_prompt, st.prompt_tps(),
                   st.n_generated, st.generate_tps(), g_interrupted ? ", stopped" : "");
      msgs.push_back({"assistant", answer, nullptr});
      cached_text.clear();
      if (last >= 0 && tok->is_eog(last)) {
        // Put the end-of-turn token into the cache too, so the next turn continues from the template's
        // own text of this one.
        s.eval(std::span<const int32_t>(&last, 1), 0);
        const std::string rendered = apply_chat_template(*tok, msgs, false, extra);
        const std::string eot = tok->token_piece(last);
        const size_t at = rendered.rfind(eot);
        if (at != std::string::npos) cached_text = rendered.substr(0, at + eot.size());
      }
    }
  });
}

}  // namespace fitmoe::cli
