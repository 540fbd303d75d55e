// fitmoe bench: prompt processing (ppN) and generation (tgN) speed like llama-bench, with the weight
// bytes each generated token reads and the bandwidth that implies.
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <random>

#include "cli/common.h"
#include "quant/kernels.h"
#include "runtime/error.h"
#include "runtime/machine.h"

namespace fitmoe::cli {

namespace {

struct BenchArgs {
  ModelOptions model;
  std::vector<int> prompt = {512};
  std::vector<int> gen = {128};
  int reps = 5;
  bool json = false;
};

struct Result {
  std::string test;
  int n_prompt = 0, n_gen = 0;
  std::vector<double> tps;
  double mean() const {
    double s = 0;
    for (double v : tps) s += v;
    return tps.empty() ? 0 : s / tps.size();
  }
  double sd() const {
    if (tps.size() < 2) return 0;
    double m = mean(), s = 0;
    for (double v : tps) s += (v - m) * (v - m);
    return std::sqrt(s / (tps.size() - 1));
  }
};

std::vector<int32_t> random_tokens(int n, int n_vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int32_t> d(0, n_vocab - 1);
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (auto& x : t) x = d(rng);
  return t;
}

}  // namespace

void register_bench(CLI::App& app) {
  auto* cmd = app.add_subcommand("bench", "measure prompt (ppN) and generation (tgN) speed, llama-bench style");
  auto a = std::make_shared<BenchArgs>();
  add_model_options(*cmd, a->model, /*with_ctx=*/false);
  cmd->add_option("-p,--n-prompt", a->prompt, "prompt lengths to test (0 or empty: none)")->delimiter(',');
  cmd->add_option("-n,--n-gen", a->gen, "generation lengths to test (0: none)")->delimiter(',');
  cmd->add_option("-r,--repetitions", a->reps, "repetitions per test")->check(CLI::PositiveNumber);
  cmd->add_option("--kv-type", a->model.kv_type, "KV cache type: f16 or f32")->check(CLI::IsMember({"f16", "f32"}));
  cmd->add_option("-b,--batch", a->model.batch, "GPU micro-batch (prompt tokens per forward pass; default: automatic)")->check(CLI::PositiveNumber);
  cmd->add_flag("--json", a->json, "print JSON instead of a markdown table");
  cmd->callback([a] {
    auto model = load_model(a->model);
    const auto& cfg = model->config();
    int max_ctx = 16;
    for (int p : a->prompt) max_ctx = std::max(max_ctx, p + 1);
    for (int g : a->gen) max_ctx = std::max(max_ctx, g + 1);
    SessionOptions so = session_options(a->model);
    so.n_ctx = max_ctx;
    so.n_batch = max_ctx;  // each ppN is one batch (the GPU splits it into micro-batches of -b)
    Session s(*model, so);

    std::vector<Result> results;
    for (int p : a->prompt) {
      if (p <= 0) continue;
      Result r{"pp" + std::to_string(p), p, 0, {}};
      auto toks = random_tokens(p, cfg.n_vocab, 42);
      for (int rep = -1; rep < a->reps; ++rep) {  // rep -1 is the warm-up
        s.state().reset();
        double t0 = now_seconds();
        s.eval(toks, 1);
        double dt = now_seconds() - t0;
        if (rep >= 0) r.tps.push_back(p / dt);
        std::fprintf(stderr, "\r%s: run %d/%d  %.2f tok/s   ", r.test.c_str(), rep + 1, a->reps, p / dt);
      }
      std::fprintf(stderr, "\n");
      results.push_back(r);
    }
    for (int g : a->gen) {
      if (g <= 0) continue;
      Result r{"tg" + std::to_string(g), 0, g, {}};
      auto toks = random_tokens(g, cfg.n_vocab, 7);
      for (int rep = -1; rep < a->reps; ++rep) {
        s.state().reset();
        const int n = rep < 0 ? std::min(g, 4) : g;
        double t0 = now_seconds();
        for (int i = 0; i < n; ++i) s.eval(std::span<const int32_t>(&toks[i], 1), 1);
        double dt = now_seconds() - t0;
        if (rep >= 0) r.tps.push_back(n / dt);
        std::fprintf(stderr, "\r%s: run %d/%d  %.2f tok/s   ", r.test.c_str(), rep + 1, a->reps, n / dt);
      }
      std::fprintf(stderr, "\n");
      results.push_back(r);
    }

    uint64_t size = 0, params = 0;
    for (auto& t : model->file().tensors()) {
      size += t.nbytes;
      params += static_cast<uint64_t>(t.n_elements());
    }
    const double bpt = model->bytes_per_token();
    const Plan& plan = model->plan();
    const std::string backend = model->on_gpu()
        ? "CUDA " + plan.machine.gpu_name + (plan.host_experts ? " + CPU experts" : "")
        : std::string("CPU (") + quant::isa_name(quant::best_isa()) + ")";
    // The physical bound of generation: bytes read per token over the bandwidth of where they live
    // (as measured by the machine probe, or given to it).
    double bound = 0;
    if (model->on_gpu()) {
      const double gpu_bytes = bpt - plan.host_expert_bytes_per_token;
      const double t = plan.host_expert_bytes_per_token / std::max(1.0, plan.machine.host_mem_bw) +
                       gpu_bytes / std::max(1.0, plan.machine.gpu_mem_bw);
      bound = t > 0 ? 1.0 / t : 0;
    } else if (bpt > 0) {
      // A CPU-only load does not probe the machine; bench does (once, then cached), with its threads.
      const double host_bw = plan.machine.host_mem_bw > 0 ? plan.machine.host_mem_bw
                                                          : probe_machine(s.pool().size(), false).host_mem_bw;
      bound = host_bw > 0 ? host_bw / bpt : 0;
    }
    const std::string name = cfg.name.empty() ? cfg.arch : cfg.name;
    // Hybrid decode guesses each layer's routing to prefetch host experts while it waits for the GPU.
    const RoutingGuessStats gs = model->routing_guess_stats();
    const double guess_rate = gs.guessed ? static_cast<double>(gs.chosen) / gs.guessed : 0.0;
    const double prefetch_per_layer = gs.layer_steps ? gs.prefetched_bytes / gs.layer_steps : 0.0;
    if (gs.guessed)
      std::fprintf(stderr,
                   "routing guesses: %.2f host experts guessed per hybrid layer step, %.0f%% of them chosen; "
                   "%s prefetched per step while waiting for the GPU\n",
                   static_cast<double>(gs.guessed) / gs.layer_steps, 100.0 * guess_rate,
                   human_bytes(prefetch_per_layer).c_str());
    if (a->json) {
      nlohmann::json out = nlohmann::json::array();
      for (auto& r : results) {
        out.push_back({{"model", name}, {"arch", cfg.arch}, {"size", size}, {"params", params},
                       {"backend", backend}, {"n_threads", s.pool().size()}, {"test", r.test},
                       {"n_prompt", r.n_prompt}, {"n_gen", r.n_gen}, {"avg_ts", r.mean()},
                       {"stddev_ts", r.sd()}, {"samples_ts", r.tps},
                       {"weight_bytes_per_token", r.n_gen ? bpt : 0.0},
                       {"weight_gbps", r.n_gen ? bpt * r.mean() / 1e9 : 0.0},
                       {"host_expert_bytes_per_token", plan.host_expert_bytes_per_token},
                       {"tg_bound", bound}, {"plan", plan.summary_line()},
                       {"routing_guesses_chosen", guess_rate}, {"prefetched_bytes_per_layer_step", prefetch_per_layer},
                       {"machine", {{"host_mem_bw", plan.machine.host_mem_bw}, {"pcie_bw", plan.machine.pcie_bw},
                                    {"gpu_mem_bw", plan.machine.gpu_mem_bw}, {"cpu_int8_flops", plan.machine.cpu_int8_flops}}}});
      }
      std::printf("%s\n", out.dump(2).c_str());
      return;
    }
    std::printf("| model | size | params | backend | threads | test | t/s | weights/token | GB/s | bound t/s (reached) |\n");
    std::printf("| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |\n");
    for (auto& r : results) {
      std::string bytes = r.n_gen ? human_bytes(bpt) : "-";
      char gbps[32] = "-", bnd[48] = "-";
      if (r.n_gen) std::snprintf(gbps, sizeof gbps, "%.1f", bpt * r.mean() / 1e9);
      if (r.n_gen && bound > 0) std::snprintf(bnd, sizeof bnd, "%.1f (%.0f%%)", bound, 100.0 * r.mean() / bound);
      std::printf("| %s | %s | %.2f B | %s | %d | %s | %.2f ± %.2f | %s | %s | %s |\n", name.c_str(),
                  human_bytes(static_cast<double>(size)).c_str(), params / 1e9, backend.c_str(), s.pool().size(),
                  r.test.c_str(), r.mean(), r.sd(), bytes.c_str(), gbps, bnd);
    }
  });
}

}  // namespace fitmoe::cli
