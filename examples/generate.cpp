// An example program that uses only fitmoe's public API (include/fitmoe/fitmoe.h): loads a model under a
// VRAM budget, prints the plan, and streams a chat answer.
//   fitmoe_example MODEL.gguf "your message" [VRAM_GiB]
#include <fitmoe/fitmoe.h>

#include <cstdio>
#include <cstdlib>
#include <string>

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s MODEL.gguf \"message\" [VRAM_GiB]\n", argv[0]);
    return 2;
  }
  try {
    fitmoe::LoadConfig config;
    config.model_path = argv[1];
    config.n_ctx = 4096;
    if (argc > 3) config.vram_budget = static_cast<uint64_t>(std::atof(argv[3]) * (1ull << 30));
    auto engine = fitmoe::Engine::load(config);
    std::fprintf(stderr, "%s", engine->plan_report().c_str());
    auto seq = engine->new_sequence();
    const auto prompt = engine->tokenize(engine->apply_chat_template({{"user", argv[2]}}, true), true);
    fitmoe::GenerateOptions opts;
    opts.max_tokens = 128;
    const auto r = seq->generate(prompt, opts, [](const std::string& text) {
      std::fputs(text.c_str(), stdout);
      std::fflush(stdout);
      return true;
    });
    std::fprintf(stderr, "\n[%d prompt tokens, %d generated at %.1f tok/s]\n", r.n_prompt, r.n_generated,
                 r.decode_tokens_per_second);
    return 0;
  } catch (const fitmoe::ApiError& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
