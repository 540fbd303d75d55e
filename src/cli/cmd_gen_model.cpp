// fitmoe gen-model: write a full-shape synthetic model (random weights, real shapes and type mix).
#include <cstdio>

#include "cli/common.h"
#include "model/synthetic.h"
#include "runtime/thread_pool.h"

namespace fitmoe::cli {

void register_gen_model(CLI::App& app) {
  auto* cmd = app.add_subcommand("gen-model", "write a synthetic model with real shapes and quantization mix");
  auto spec = std::make_shared<SyntheticSpec>();
  auto out = std::make_shared<std::string>();
  auto threads = std::make_shared<int>(0);
  cmd->add_option("--arch", spec->arch, "architecture: qwen3moe, qwen3, qwen35moe, qwen35 or gemma4");
  cmd->add_option("--preset", spec->preset, "shape: qwen3moe 30b-a3b|tiny|tiny-wide, qwen3 0.6b|tiny, qwen35moe 35b-a3b|tiny|tiny-mtp, qwen35 tiny, gemma4 26b-a4b|tiny");
  cmd->add_option("--type", spec->type, "type mix: q4_k_m, q6_k, q8_0, q4_0, f16, bf16, f32");
  cmd->add_option("--layers", spec->layers, "keep only the first N layers (full width; 0: the preset's all)")->check(at_least(0));
  auto skew = std::make_shared<std::string>();
  auto* skew_opt = cmd->add_option("--router-skew", *skew, "give experts Zipf-like popularity; optional exponent (default 1)")
                       ->expected(0, 1)
                       ->check(at_least(0));
  cmd->add_option("--seed", spec->seed, "random seed");
  cmd->add_option("-t,--threads", *threads, "threads generating data (0: all cores)")->check(at_least(0));
  cmd->add_option("-o,--output", *out, "output GGUF path")->required();
  cmd->callback([spec, out, threads, skew, skew_opt] {
    if (skew_opt->count() > 0) spec->router_skew = skew->empty() ? 1.0f : static_cast<float>(std::strtod(skew->c_str(), nullptr));
    check_output_path(*out);
    ThreadPool pool(*threads);
    install_interrupt_handler();  // Ctrl-C stops at the next chunk; the writer then removes its .partial file
    Progress progress("writing " + *out);
    double t0 = now_seconds();
    auto sum = write_synthetic_model(*spec, *out, pool, [&](uint64_t d, uint64_t t) {
      if (interrupted()) throw Interrupted();
      progress.update(d, t);
    });
    progress.finish();
    double dt = now_seconds() - t0;
    std::printf("%s", sum.description.c_str());
    std::printf("wrote %s: %d tensors, %s in %.1f s (%s/s)\n", out->c_str(), sum.n_tensors,
                human_bytes(static_cast<double>(sum.bytes)).c_str(), dt, human_bytes(sum.bytes / dt).c_str());
  });
}

}  // namespace fitmoe::cli
