// fitmoe run / generate / logits: the token-level contract commands.
//   run:      generate with sampling, streaming ids, then speed and bandwidth.
//   generate: greedy by default (--temp 0); the ids, comma separated, are the last stdout line.
//   logits:   one batch, logits of every position to a raw f32 file [n_tokens][n_vocab].
#include <cstdio>
#include <fstream>

#include "cli/common.h"
#include "runtime/error.h"
#include "text/tokenizer.h"

namespace fitmoe::cli {

namespace {

struct GenArgs {
  ModelOptions model;
  std::string tokens;
  std::string prompt, prompt_file;
  int n_predict = 32;
  SamplerParams sampler;
};

void print_speed(const Model& model, const GenerationStats& st) {
  const double bpt = model.bytes_per_token();
  std::fprintf(stderr, "prompt:     %d tokens in %.3f s, %.2f tok/s\n", st.n_prompt, st.prompt_seconds, st.prompt_tps());
  std::fprintf(stderr, "generation: %d tokens in %.3f s, %.2f tok/s, %s of weights per token -> %.1f GB/s\n",
               st.n_generated, st.generate_seconds, st.generate_tps(), human_bytes(bpt).c_str(),
               bpt * st.generate_tps() / 1e9);
}

}  // namespace

void register_run(CLI::App& app) {
  auto* cmd = app.add_subcommand("run", "generate from a prompt, streaming the output, then print speed");
  auto a = std::make_shared<GenArgs>();
  add_model_options(*cmd, a->model);
  auto* p_opt = cmd->add_option("-p,--prompt", a->prompt, "prompt text (tokenized with the model's tokenizer)");
  auto* f_opt = cmd->add_option("-f,--file", a->prompt_file, "read the prompt text from a file");
  auto* t_opt = cmd->add_option("--tokens", a->tokens, "prompt as token ids, comma separated (prints ids)");
  p_opt->excludes(t_opt)->excludes(f_opt);
  t_opt->excludes(f_opt);
  cmd->add_option("-n,--n-predict", a->n_predict, "tokens to generate")->check(CLI::NonNegativeNumber);
  add_sampler_options(*cmd, a->sampler);
  cmd->callback([a] {
    if (a->tokens.empty() && a->prompt.empty() && a->prompt_file.empty())
      throw Error("run needs a prompt: -p TEXT, -f FILE or --tokens IDS");
    auto model = load_model(a->model);
    Session s(*model, session_options(a->model));
    Sampler sampler(a->sampler);
    GenerationStats st;
    if (!a->tokens.empty()) {
      // Token-level mode: ids in, ids out.
      auto prompt = parse_token_list(a->tokens);
      bool first = true;
      s.generate(prompt, a->n_predict, sampler, [&](int32_t t) {
        std::printf(first ? "%d" : ",%d", t);
        first = false;
        std::fflush(stdout);
        return true;
      }, {}, &st);
    } else {
      std::string text = a->prompt;
      if (!a->prompt_file.empty()) text = read_text_file(a->prompt_file);
      auto tok = Tokenizer::from_gguf(model->file());
      auto prompt = tok->encode(text, /*add_special=*/true);
      if (prompt.empty()) throw Error("the prompt tokenizes to nothing");
      StreamDecoder out(*tok);
      std::printf("%s", text.c_str());
      const auto eog = tok->eog_tokens();
      s.generate(prompt, a->n_predict, sampler, [&](int32_t t) {
        if (!tok->is_eog(t)) std::printf("%s", out.push(t).c_str());
        std::fflush(stdout);
        return true;
      }, eog, &st);
      std::printf("%s", out.flush().c_str());
    }
    std::printf("\n");
    std::fflush(stdout);  // the text before the speed lines (stderr), also when both go to one pipe
    print_speed(*model, st);
  });
}

void register_generate(CLI::App& app) {
  auto* cmd = app.add_subcommand("generate", "generate token ids (greedy by default); last line = ids");
  auto a = std::make_shared<GenArgs>();
  a->sampler.temperature = 0;
  add_model_options(*cmd, a->model);
  cmd->add_option("--tokens", a->tokens, "prompt as token ids, comma separated")->required();
  cmd->add_option("-n,--n-predict", a->n_predict, "tokens to generate")->check(CLI::NonNegativeNumber);
  add_sampler_options(*cmd, a->sampler);
  cmd->callback([a] {
    auto model = load_model(a->model);
    Session s(*model, session_options(a->model));
    auto prompt = parse_token_list(a->tokens);
    Sampler sampler(a->sampler);
    GenerationStats st;
    auto out = s.generate(prompt, a->n_predict, sampler, nullptr, {}, &st);
    print_speed(*model, st);
    std::printf("%s\n", join_tokens(out).c_str());
  });
}

void register_logits(CLI::App& app) {
  auto* cmd = app.add_subcommand("logits", "evaluate tokens in one batch; write every position's logits (raw f32)");
  auto a = std::make_shared<GenArgs>();
  auto out_path = std::make_shared<std::string>();
  add_model_options(*cmd, a->model);
  cmd->add_option("--tokens", a->tokens, "token ids, comma separated")->required();
  cmd->add_option("-o,--output", *out_path, "output file: little-endian f32 [n_tokens][n_vocab]")->required();
  cmd->callback([a, out_path] {
    auto model = load_model(a->model);
    auto tokens = parse_token_list(a->tokens);
    SessionOptions so = session_options(a->model);
    so.n_batch = static_cast<int>(tokens.size());  // one batch, as the contract says
    so.n_ctx = std::max<int>(so.n_ctx, static_cast<int>(tokens.size()));
    Session s(*model, so);
    auto logits = s.eval(tokens, static_cast<int>(tokens.size()));
    // Written beside the target and renamed, so a failure never leaves a partial file.
    std::string tmp = *out_path + ".partial";
    {
      std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
      if (!f) throw Error(*out_path + ": cannot create");
      f.write(reinterpret_cast<const char*>(logits.data()), static_cast<std::streamsize>(logits.size() * sizeof(float)));
      if (!f) {
        std::remove(tmp.c_str());
        throw Error(*out_path + ": write failed");
      }
    }
    if (std::rename(tmp.c_str(), out_path->c_str()) != 0) throw Error(*out_path + ": rename failed");
    std::printf("wrote %zu x %d logits to %s\n", tokens.size(), model->config().n_vocab, out_path->c_str());
  });
}

}  // namespace fitmoe::cli
