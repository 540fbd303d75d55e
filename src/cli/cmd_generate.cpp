// fitmoe run / generate / logits: the token-level contract commands.
//   run:      generate with sampling, streaming ids, then speed and bandwidth.
//   generate: greedy by default (--temp 0); the ids, comma separated, are the last stdout line.
//   logits:   one batch, logits of every position to a raw f32 file [n_tokens][n_vocab].
#include <algorithm>
#include <cstdio>

#include "cli/common.h"
#include "model/qwen35.h"
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

void print_speed(const Model& model, const GenerationStats& st, int n_ctx, const SamplerParams& sp) {
  const double bpt = model.bytes_per_token();
  std::fprintf(stderr, "prompt:     %d tokens in %.3f s, %.2f tok/s\n", st.n_prompt, st.prompt_seconds, st.prompt_tps());
  // -n N reports N tokens; the speed is over the decode steps (the first token comes from the prompt).
  std::fprintf(stderr, "generation: %d tokens; %d decode steps in %.3f s, %.2f tok/s, %s of weights per token -> %.1f GB/s\n",
               st.n_generated, st.n_decoded, st.generate_seconds, st.generate_tps(), human_bytes(bpt).c_str(),
               bpt * st.generate_tps() / 1e9);
  if (sp.temperature > 0) std::fprintf(stderr, "seed:       %llu (--seed repeats this run)\n", static_cast<unsigned long long>(sp.seed));
  if (st.context_full)
    std::fprintf(stderr, "stopped: the context of %d tokens is full (-c sets it)\n", n_ctx);
}

// Before any weight is read: every id inside the vocabulary, the prompt inside the context.
void check_prompt(const Model& m, const std::vector<int32_t>& prompt, int n_ctx) {
  const int n_vocab = m.config().n_vocab;
  for (int32_t t : prompt)
    if (t >= n_vocab)
      throw Error("token id " + std::to_string(t) + " is outside the vocabulary (0.." + std::to_string(n_vocab - 1) + ")");
  if (static_cast<int>(prompt.size()) > n_ctx)
    throw Error("the prompt is " + std::to_string(prompt.size()) + " tokens, longer than the context of " +
                std::to_string(n_ctx) + " tokens (-c sets it)");
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
  cmd->add_option("-n,--n-predict", a->n_predict, "tokens to generate")->check(at_least(0));
  add_sampler_options(*cmd, a->sampler);
  cmd->callback([a] {
    if (a->tokens.empty() && a->prompt.empty() && a->prompt_file.empty())
      throw Error("run needs a prompt: -p TEXT, -f FILE or --tokens IDS");
    std::vector<int32_t> prompt;
    std::string text = a->prompt;
    if (!a->tokens.empty()) prompt = parse_token_list(a->tokens);
    if (!a->prompt_file.empty()) text = read_text_file(a->prompt_file);
    if (a->tokens.empty() && text.empty())
      throw Error(a->prompt_file.empty() ? "the prompt is empty" : a->prompt_file + ": the file is empty");
    std::unique_ptr<Tokenizer> tok;
    auto model = load_model(a->model, [&](const Model& m) {
      if (a->tokens.empty()) {
        tok = Tokenizer::from_gguf(m.file());
        prompt = tok->encode(text, /*add_special=*/true);
        if (prompt.empty()) throw Error("the prompt tokenizes to nothing");
      }
      check_prompt(m, prompt, a->model.ctx);
    });
    Session s(*model, session_options(a->model));
    Sampler sampler(a->sampler);
    GenerationStats st;
    install_interrupt_handler();
    if (!tok) {
      // Token-level mode: ids in, ids out.
      bool first = true;
      s.generate(prompt, a->n_predict, sampler, [&](int32_t t) {
        std::printf(first ? "%d" : ",%d", t);
        first = false;
        std::fflush(stdout);
        return !interrupted();
      }, {}, &st);
    } else {
      StreamDecoder out(*tok);
      std::printf("%s", text.c_str());
      const auto eog = tok->eog_tokens();
      s.generate(prompt, a->n_predict, sampler, [&](int32_t t) {
        if (!tok->is_eog(t)) std::printf("%s", out.push(t).c_str());
        std::fflush(stdout);
        return !interrupted();
      }, eog, &st);
      std::printf("%s", out.flush().c_str());
    }
    std::printf("\n");
    std::fflush(stdout);  // the text before the speed lines (stderr), also when both go to one pipe
    print_speed(*model, st, s.n_ctx(), a->sampler);
    if (interrupted()) {
      std::fprintf(stderr, "interrupted\n");
      throw Interrupted();
    }
  });
}

void register_generate(CLI::App& app) {
  auto* cmd = app.add_subcommand("generate", "generate token ids (greedy by default); last line = ids");
  auto a = std::make_shared<GenArgs>();
  a->sampler.temperature = 0;
  add_model_options(*cmd, a->model);
  cmd->add_option("--tokens", a->tokens, "prompt as token ids, comma separated")->required();
  cmd->add_option("-n,--n-predict", a->n_predict, "tokens to generate")->check(at_least(0));
  add_sampler_options(*cmd, a->sampler);
  cmd->callback([a] {
    const auto prompt = parse_token_list(a->tokens);
    auto model = load_model(a->model, [&](const Model& m) { check_prompt(m, prompt, a->model.ctx); });
    Session s(*model, session_options(a->model));
    Sampler sampler(a->sampler);
    GenerationStats st;
    install_interrupt_handler();
    auto out = s.generate(prompt, a->n_predict, sampler, [](int32_t) { return !interrupted(); }, {}, &st);
    print_speed(*model, st, s.n_ctx(), a->sampler);
    // The ids so far, also after Ctrl-C (then exit code 130).
    std::printf("%s\n", join_tokens(out).c_str());
    if (interrupted()) {
      std::fprintf(stderr, "interrupted\n");
      throw Interrupted();
    }
  });
}

void register_logits(CLI::App& app) {
  auto* cmd = app.add_subcommand("logits", "evaluate tokens in one batch; write every position's logits (raw f32)");
  auto a = std::make_shared<GenArgs>();
  auto out_path = std::make_shared<std::string>();
  add_model_options(*cmd, a->model);
  cmd->add_option("--tokens", a->tokens, "token ids, comma separated")->required();
  cmd->add_option("-o,--output", *out_path, "output file: little-endian f32 [n_tokens][n_vocab]")->required();
  auto mtp_path = std::make_shared<std::string>();
  cmd->add_option("--mtp-output", *mtp_path,
                  "also the MTP (nextn) head's logits, teacher-forced: row r on token r with the trunk's hidden "
                  "state of position r - 1 (zeros for row 0), f32 [n_tokens][n_vocab] (qwen35 files with an MTP block)");
  cmd->callback([a, out_path, mtp_path] {
    check_output_path(*out_path);  // before the work, not after it
    if (!mtp_path->empty()) check_output_path(*mtp_path);
    auto tokens = parse_token_list(a->tokens);
    // The MTP head runs on the CPU only (it reads the trunk's hidden rows there): the whole pass does.
    if (!mtp_path->empty() && a->model.gpu != "none") {
      std::fprintf(stderr, "note: --mtp-output runs the model on the CPU (the MTP head has no GPU pass yet)\n");
      a->model.gpu = "none";
    }
    auto model = load_model(a->model, [&](const Model& m) {
      check_prompt(m, tokens, std::max<int>(a->model.ctx, static_cast<int>(tokens.size())));
    });
    SessionOptions so = session_options(a->model);
    so.n_batch = static_cast<int>(tokens.size());  // one batch, as the contract says
    so.n_ctx = std::max<int>(so.n_ctx, static_cast<int>(tokens.size()));
    Session s(*model, so);
    if (!mtp_path->empty()) {
      // The trunk's pass that also gives the hidden rows, then the MTP head over the same tokens with
      // the rows shifted by one: the layout of the reference's mtp-*.logits.f32 dumps.
      if (!qwen35_has_mtp(*model)) throw Error(a->model.model_path + ": --mtp-output: the model has no MTP (nextn) block");
      const int n = static_cast<int>(tokens.size()), E = model->config().n_embd, V = model->config().n_vocab;
      std::vector<float> logits(static_cast<size_t>(n) * V), hidden(static_cast<size_t>(n + 1) * E, 0.0f);
      qwen35_forward_hidden(*model, s.state(), s.pool(), tokens, n, logits.data(), hidden.data() + E);
      StateOptions mo;
      mo.n_ctx = so.n_ctx;
      mo.kv = so.kv.automatic ? model->plan().options.kv : so.kv;
      auto mst = qwen35_new_mtp_state(*model, mo);
      std::vector<float> mtp(static_cast<size_t>(n) * V);
      qwen35_mtp_forward(*model, *mst, s.pool(), tokens, hidden.data(), mtp.data(), nullptr);
      write_file_atomically(*out_path, logits.data(), logits.size() * sizeof(float));
      write_file_atomically(*mtp_path, mtp.data(), mtp.size() * sizeof(float));
      std::printf("wrote %d x %d logits to %s and the MTP head's to %s\n", n, V, out_path->c_str(), mtp_path->c_str());
      return;
    }
    auto logits = s.eval(tokens, static_cast<int>(tokens.size()));
    write_file_atomically(*out_path, logits.data(), logits.size() * sizeof(float));
    std::printf("wrote %zu x %d logits to %s\n", tokens.size(), model->config().n_vocab, out_path->c_str());
  });
}

}  // namespace fitmoe::cli
