// `fitmoe perplexity`: perplexity over a text in windows, as llama-perplexity does (the text tokenized
// once, cut into windows of --ctx tokens, each evaluated from an empty cache, the second half of each
// window scored against the next token), and the KL divergence of every scored position's distribution
// against a saved base run (--save-logits, then --kl-base with another build, type or cache).
//
// The base file (fitmoe's own format, written by --save-logits): "FMKL" magic, u32 version 1, u32
// n_vocab, u32 n_positions, u32 n_tokens and the token ids (so that a base from another text is an
// error), then per scored position n_vocab log-probabilities as f16.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "cli/common.h"
#include "runtime/error.h"
#include "text/tokenizer.h"

namespace fitmoe::cli {

namespace {

struct PerplexityArgs {
  ModelOptions model;
  std::string file, save, kl_base;
};

constexpr char kMagic[4] = {'F', 'M', 'K', 'L'};

void log_softmax(const float* x, int n, std::vector<double>& out) {
  out.resize(n);
  double mx = -INFINITY;
  for (int i = 0; i < n; ++i) mx = std::max(mx, static_cast<double>(x[i]));
  double sum = 0;
  for (int i = 0; i < n; ++i) sum += std::exp(x[i] - mx);
  const double lz = mx + std::log(sum);
  for (int i = 0; i < n; ++i) out[i] = x[i] - lz;
}

struct Base {
  uint32_t n_vocab = 0, n_positions = 0;
  std::vector<int32_t> tokens;
  std::ifstream in;
};

void read_exact(std::ifstream& in, void* p, size_t n, const std::string& path) {
  in.read(static_cast<char*>(p), static_cast<std::streamsize>(n));
  if (static_cast<size_t>(in.gcount()) != n) throw Error(path + ": the KL base is truncated");
}

std::unique_ptr<Base> open_base(const std::string& path) {
  auto b = std::make_unique<Base>();
  b->in.open(path, std::ios::binary);
  if (!b->in) throw Error(path + ": cannot open the KL base (" + std::strerror(errno) + ")");
  char magic[4];
  uint32_t version = 0, n_tokens = 0;
  read_exact(b->in, magic, 4, path);
  if (std::memcmp(magic, kMagic, 4) != 0) throw Error(path + ": not a fitmoe --save-logits file");
  read_exact(b->in, &version, 4, path);
  if (version != 1) throw Error(path + ": KL base version " + std::to_string(version) + " (this build reads 1)");
  read_exact(b->in, &b->n_vocab, 4, path);
  read_exact(b->in, &b->n_positions, 4, path);
  read_exact(b->in, &n_tokens, 4, path);
  if (n_tokens > (1u << 28)) throw Error(path + ": implausible token count " + std::to_string(n_tokens));
  b->tokens.resize(n_tokens);
  read_exact(b->in, b->tokens.data(), sizeof(int32_t) * n_tokens, path);
  return b;
}

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * static_cast<double>(v.size() - 1) + 0.5))];
}

}  // namespace

void register_perplexity(CLI::App& app) {
  auto* cmd = app.add_subcommand("perplexity", "perplexity of a text in windows of --ctx tokens; KL divergence against a saved base run");
  auto a = std::make_shared<PerplexityArgs>();
  a->model.ctx = 512;  // llama-perplexity's default window
  add_model_options(*cmd, a->model);
  cmd->add_option("-f,--file", a->file, "the text")->required();
  cmd->add_option("--save-logits", a->save, "write every scored position's log-probabilities to this file (a KL base)");
  cmd->add_option("--kl-base", a->kl_base, "a file from --save-logits over the same text: KL divergence against it");
  cmd->callback([a] {
    if (!a->save.empty()) check_output_path(a->save);
    const std::string text = read_text_file(a->file);
    if (text.empty()) throw Error(a->file + ": the file is empty");
    std::vector<int32_t> tokens;
    const int ctx = a->model.ctx;
    if (ctx < 16) throw Error("perplexity: --ctx must be at least 16 (got " + std::to_string(ctx) + ")");
    auto model = load_model(a->model, [&](const Model& m) {
      tokens = Tokenizer::from_gguf(m.file())->encode(text, /*add_special=*/true);
      if (static_cast<int>(tokens.size()) < 2 * ctx)
        throw Error(a->file + ": " + std::to_string(tokens.size()) + " tokens; perplexity needs at least two windows of " +
                    std::to_string(ctx) + " (" + std::to_string(2 * ctx) + "); give a longer text or a smaller --ctx");
    });
    const int V = model->config().n_vocab;
    const int n_windows = static_cast<int>(tokens.size()) / ctx;
    const int first = ctx / 2;  // scored positions per window: first .. ctx - 2 predict tokens first+1 .. ctx-1
    const uint32_t n_positions = static_cast<uint32_t>(n_windows) * static_cast<uint32_t>(ctx - 1 - first);
    std::vector<int32_t> used(tokens.begin(), tokens.begin() + static_cast<size_t>(n_windows) * ctx);
    std::unique_ptr<Base> base;
    if (!a->kl_base.empty()) {
      base = open_base(a->kl_base);
      if (base->n_vocab != static_cast<uint32_t>(V))
        throw Error(a->kl_base + ": a base of " + std::to_string(base->n_vocab) + " tokens' vocabulary; this model has " +
                    std::to_string(V));
      if (base->tokens != used || base->n_positions != n_positions)
        throw Error(a->kl_base + ": the base was made over another text or --ctx (" + std::to_string(base->tokens.size()) +
                    " tokens, " + std::to_string(base->n_positions) + " positions; here " + std::to_string(used.size()) +
                    " and " + std::to_string(n_positions) + ")");
    }
    std::vector<uint16_t> saved;
    if (!a->save.empty()) saved.reserve(static_cast<size_t>(n_positions) * V);

    SessionOptions so = session_options(a->model);
    so.n_ctx = ctx;
    so.n_batch = ctx;
    Session s(*model, so);
    install_interrupt_handler();
    Progress progress("perplexity");
    double nll = 0;
    long scored = 0;
    std::vector<double> kls, lp, lb(V);
    std::vector<uint16_t> row16(V);
    long same_top = 0;
    for (int w = 0; w < n_windows; ++w) {
      if (interrupted()) throw Interrupted();
      s.state().reset();
      const std::span<const int32_t> win(used.data() + static_cast<size_t>(w) * ctx, ctx);
      const std::vector<float>& logits = s.eval(win, ctx);
      for (int i = first; i < ctx - 1; ++i) {
        log_softmax(logits.data() + static_cast<size_t>(i) * V, V, lp);
        nll -= lp[win[i + 1]];
        ++scored;
        if (!a->save.empty())
          for (int v = 0; v < V; ++v) saved.push_back(f32_to_f16(static_cast<float>(lp[v])));
        if (base) {
          read_exact(base->in, row16.data(), sizeof(uint16_t) * V, a->kl_base);
          double kl = 0;
          int top_b = 0, top_m = 0;
          // This run's log-probabilities rounded as the base's were (f16), so that a run against its own
          // base gives exactly 0 and the same top tokens.
          for (int v = 0; v < V; ++v) {
            lb[v] = f16_to_f32(row16[v]);
            const double m = f16_to_f32(f32_to_f16(static_cast<float>(lp[v])));
            kl += std::exp(lb[v]) * (lb[v] - m);
            lp[v] = m;
            if (lb[v] > lb[top_b]) top_b = v;
            if (lp[v] > lp[top_m]) top_m = v;
          }
          kls.push_back(std::max(0.0, kl));
          same_top += top_b == top_m;
        }
      }
      progress.update(static_cast<uint64_t>(w + 1), static_cast<uint64_t>(n_windows));
    }
    progress.finish();
    const double ppl = std::exp(nll / static_cast<double>(scored));
    std::printf("perplexity: %.4f over %ld scored tokens (%d windows of %d, the second half of each scored; KV %s)\n", ppl,
                scored, n_windows, ctx, so.kv.name().c_str());
    if (base) {
      double mean = 0;
      for (double k : kls) mean += k;
      mean /= static_cast<double>(kls.size());
      std::printf("KL divergence against %s: mean %.6f, median %.6f, p99 %.6f, max %.6f; same top token %.2f%%\n",
                  a->kl_base.c_str(), mean, percentile(kls, 0.5), percentile(kls, 0.99), percentile(kls, 1.0),
                  100.0 * static_cast<double>(same_top) / static_cast<double>(kls.size()));
    }
    if (!a->save.empty()) {
      std::vector<uint8_t> out;
      auto put = [&](const void* p, size_t n) {
        const auto* b = static_cast<const uint8_t*>(p);
        out.insert(out.end(), b, b + n);
      };
      const uint32_t version = 1, nv = static_cast<uint32_t>(V), nt = static_cast<uint32_t>(used.size());
      put(kMagic, 4);
      put(&version, 4);
      put(&nv, 4);
      put(&n_positions, 4);
      put(&nt, 4);
      put(used.data(), sizeof(int32_t) * used.size());
      put(saved.data(), sizeof(uint16_t) * saved.size());
      write_file_atomically(a->save, out.data(), out.size());
      std::printf("saved %u positions' log-probabilities to %s\n", n_positions, a->save.c_str());
    }
  });
}

}  // namespace fitmoe::cli
