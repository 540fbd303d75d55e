// qwen3moe / qwen3 on the GPU against the reference's logits and greedy tokens: fully on the GPU, and
// in hybrid mode with experts forced to the host (all of them, one layer's, and half of every
// layer's by a tight budget), with both prefill treatments of host experts (streamed in chunks, also
// with one expert per chunk so that the upload ring wraps, and on the CPU). Skips without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "cuda/device.h"
#include "cuda/gpu_ops.h"
#include "reference_check.h"
#include "runtime/error.h"
#include "runtime/machine.h"
#include "runtime/session.h"
#include "runtime/thread_pool.h"
#include "model/synthetic.h"

using namespace fitmoe;

namespace {

bool have_gpu() {
  gpu::DeviceInfo di;
  return gpu::query_device(&di);
}

struct GpuCase {
  std::string folder, type, mode;  // mode: gpu | cpu_moe | n_cpu_moe1 | half_budget ; + "/cpu" for CPU prefill of host experts
};

std::unique_ptr<Model> load_gpu(const std::string& path, const std::string& mode) {
  LoadOptions lo;
  lo.plan.n_ctx = 512;
  lo.plan.n_ubatch = 256;
  const std::string base = mode.substr(0, mode.find('/'));
  if (mode.find("/cpu") != std::string::npos) lo.plan.prefill_host_experts = "cpu";
  else if (mode.find("/upload") != std::string::npos) lo.plan.prefill_host_experts = "upload";
  // One expert per streamed chunk: more chunks than the upload ring has buffers, so it wraps.
  if (mode.find("/chunk1") != std::string::npos) lo.plan.prefill_chunk_experts = 1;
  // Every streamed layer's copies wait for its routing (and carry only the experts used).
  if (mode.find("/wait") != std::string::npos) lo.plan.prefill_prefetch_min_used = 2.0;
  // Decode's GPU share of the host experts (read over the bus): none, half, all.
  if (mode.find("/share0") != std::string::npos) lo.plan.host_experts_gpu_share = 0;
  if (mode.find("/share05") != std::string::npos) lo.plan.host_experts_gpu_share = 0.5;
  if (mode.find("/share1") != std::string::npos) lo.plan.host_experts_gpu_share = 1;
  if (mode.find("/nographs") != std::string::npos) lo.plan.decode_graphs = false;
  if (mode.find("/noguess") != std::string::npos) lo.plan.routing_guess = false;
  if (base == "cpu_moe") lo.plan.cpu_moe = true;
  if (base == "n_cpu_moe1") lo.plan.n_cpu_moe = 1;
  // A dense product on the host as well (no decode graphs; its host step waits for the stream, which
  // the hybrid hand-over must not leave waiting for a flag).
  if (mode.find("/wo_host") != std::string::npos) lo.plan.overrides = parse_overrides({"blk\\.1\\.attn_output\\.weight=cpu"});
  if (base == "half_budget") {
    // First plan with the whole card, then a budget that leaves room for half of the experts.
    LoadOptions probe = lo;
    probe.plan_only = true;
    auto p = Model::load(path, probe);
    const Plan& full = p->plan();
    // (A budget from the card's free memory leaves the CUDA runtime's start-up share out of the reserve,
    // as free memory was read with it up; an explicit budget reserves it too.)
    lo.plan.vram_budget = full.gpu_weights + full.gpu_kv + full.gpu_scratch + full.reserve +
                          full.machine.gpu_runtime_bytes + full.gpu_experts / 2;
  }
  auto m = Model::load(path, lo);
  EXPECT_TRUE(m->on_gpu()) << mode;
  return m;
}

// Greedy decoding from a made-up prompt of n_prompt tokens ((i * 7919 + salt) % n_vocab): the prompt's
// last logits, then `steps` single-token steps, each feeding back the argmax; every step's logits, in
// order.
std::vector<float> greedy_logits(Model& model, int n_ctx, int n_threads, int n_prompt, int salt, int steps) {
  SessionOptions so;
  so.n_threads = n_threads;
  so.n_ctx = n_ctx;
  Session s(model, so);
  const int n_vocab = model.config().n_vocab;
  std::vector<int32_t> prompt(static_cast<size_t>(n_prompt));
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int32_t>((i * 7919 + salt) % n_vocab);
  std::vector<float> all = s.eval(prompt, 1);
  for (int i = 0; i < steps; ++i) {
    const auto last = all.end() - n_vocab;
    const std::vector<int32_t> one{static_cast<int32_t>(std::max_element(last, all.end()) - last)};
    const std::vector<float>& l = s.eval(one, 1);
    all.insert(all.end(), l.begin(), l.end());
  }
  return all;
}

class GpuReference : public ::testing::TestWithParam<GpuCase> {};

TEST_P(GpuReference, LogitsAndGreedyMatch) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU";
  const GpuCase& c = GetParam();
  const std::string dir = test::testdata(c.folder);
  auto manifest = test::read_json(dir + "/manifest.json");
  auto model = load_gpu(dir + "/" + c.folder + "-" + c.type + ".gguf", c.mode);
  const Plan& plan = model->plan();
  int on = 0, total = 0;
  for (auto& t : plan.tensors)
    if (t.is_experts) {
      total += static_cast<int>(t.expert_on_gpu.size());
      on += static_cast<int>(std::count(t.expert_on_gpu.begin(), t.expert_on_gpu.end(), true));
    }
  if (c.mode == "gpu") {
    EXPECT_EQ(on, total);
  }
  if (c.mode.rfind("cpu_moe", 0) == 0) {
    EXPECT_EQ(on, 0);
  }
  if (c.mode.rfind("half_budget", 0) == 0 || c.mode.rfind("n_cpu_moe1", 0) == 0) {
    EXPECT_GT(on, 0);
    EXPECT_LT(on, total);
  }
  std::printf("  %s %s: %d of %d expert matrices on the GPU; %s\n", c.type.c_str(), c.mode.c_str(), on, total,
              model->gpu_memory_report().c_str());
  const auto tol = test::tolerance_for(c.type);
  for (const char* p : {"p7", "p33", "p200"}) {
    const auto& ref = manifest["files"][c.type]["refs"][p];
    auto prompt = manifest["prompts"][p]["ids"].get<std::vector<int32_t>>();
    auto logits = test::read_f32(dir + "/" + ref["logits"].get<std::string>());
    std::string label = c.folder + "-" + c.type + " " + c.mode + " " + p;
    std::printf("  %s\n", test::check_logits(*model, prompt, ref["logits_rows"][0].get<int>(), logits, tol, label).c_str());
    test::check_greedy(*model, test::read_json(dir + "/" + ref["greedy"].get<std::string>()), tol, label);
  }
}

std::vector<GpuCase> cases() {
  std::vector<GpuCase> out;
  for (const char* t : {"f32", "f16", "bf16", "q8_0", "q6_k", "q5_k_m", "q4_k_m", "q5_1", "q4_0", "iq4_xs", "q3_k_m"})
    out.push_back({"qwen3moe-tiny", t, "gpu"});
  for (const char* t : {"f32", "q4_k_m"})
    for (const char* m : {"cpu_moe/upload", "cpu_moe/upload/chunk1", "cpu_moe/cpu", "n_cpu_moe1/upload",
                          "half_budget/upload", "half_budget/upload/chunk1", "half_budget/cpu", "n_cpu_moe1/cpu/wo_host",
                          "cpu_moe/upload/chunk1/wait", "half_budget/upload/wait", "cpu_moe/cpu/share0",
                          "cpu_moe/cpu/share05", "cpu_moe/cpu/share1", "half_budget/cpu/share05", "half_budget/cpu/share1"})
      out.push_back({"qwen3moe-tiny", t, m});
  for (const char* t : {"f32", "q8_0"}) out.push_back({"qwen3-draft", t, "gpu"});
  return out;
}

INSTANTIATE_TEST_SUITE_P(Files, GpuReference, ::testing::ValuesIn(cases()), [](const auto& info) {
  std::string n = info.param.folder + "_" + info.param.type + "_" + info.param.mode;
  for (auto& ch : n)
    if (!isalnum(static_cast<unsigned char>(ch))) ch = '_';
  return n;
});

// Decode graphs hold the attention kernel chosen for the cache length at capture; past the short-cache
// kernel's limit (gpu::attention_decode_variant) they must be captured again. Greedy decoding across
// that point with graphs gives the same logits, bit for bit, as without graphs (the same kernels,
// launched one by one): a stale graph would write NaNs.
TEST(GpuDecode, GraphsFollowTheCacheLength) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU";
  const std::string dir = test::testdata("qwen3moe-tiny");
  const std::string path = dir + "/qwen3moe-tiny-q8_0.gguf";
  int boundary = 1;
  while (gpu::attention_decode_variant(boundary + 1) == gpu::attention_decode_variant(1)) ++boundary;
  auto run = [&](bool graphs) {
    LoadOptions lo;
    lo.plan.n_ctx = boundary + 64;
    lo.plan.decode_graphs = graphs;
    auto model = Model::load(path, lo);
    EXPECT_TRUE(model->on_gpu());
    return greedy_logits(*model, boundary + 64, 2, boundary - 8, 0, 16);  // (crosses the boundary half way)
  };
  const std::vector<float> with = run(true), without = run(false);
  ASSERT_EQ(with.size(), without.size());
  for (size_t i = 0; i < with.size(); ++i) {
    ASSERT_FALSE(std::isnan(with[i])) << "NaN logit " << i << " (graphs)";
    ASSERT_EQ(with[i], without[i]) << "logit " << i;
  }
}

// Programmatic dependent launch lets each kernel start before the one it follows has finished; a
// kernel that read its input before waiting would see the previous step's or layer's values. Greedy
// decoding (graphs, every expert on the GPU and half of them on the host) gives the same logits, bit
// for bit, with it as without it.
TEST(GpuDecode, DependentLaunchGivesTheSameBits) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU";
  if (!gpu::dependent_launch_active()) GTEST_SKIP() << "no programmatic dependent launch on this GPU / build";
  const std::string dir = test::testdata("qwen3moe-tiny");
  for (const char* type : {"q4_k_m", "f32"}) {
    for (const char* mode : {"gpu", "half_budget"}) {
      auto run = [&](bool pdl) {
        gpu::set_dependent_launch(pdl);
        auto model = load_gpu(dir + "/qwen3moe-tiny-" + std::string(type) + ".gguf", mode);
        std::vector<float> all = greedy_logits(*model, 512, 2, 40, 13, 24);
        gpu::set_dependent_launch(true);
        return all;
      };
      const std::vector<float> off = run(false), on = run(true);
      ASSERT_EQ(off.size(), on.size());
      for (size_t i = 0; i < on.size(); ++i) {
        ASSERT_FALSE(std::isnan(on[i])) << type << " " << mode << ": NaN logit " << i;
        ASSERT_EQ(on[i], off[i]) << type << " " << mode << ": logit " << i;
      }
    }
  }
}

// Hybrid decode guesses each hybrid layer's routing from the layer before and reads the guessed host
// experts ahead, which the CPU then computes in slices by thread: the same logits, bit for bit, as
// without guesses (PlanOptions::routing_guess), with decode graphs and without (the micro-batch path); and the
// guesses are made (qwen3moe-tiny has two layers, both hybrid here: layer 1 is guessed from layer 0),
// published and mostly right.
TEST(GpuDecode, RoutingGuessesChangeNoBits) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU";
  const std::string dir = test::testdata("qwen3moe-tiny");
  for (const char* mode : {"half_budget", "cpu_moe", "cpu_moe/nographs"}) {
    RoutingGuessStats stats;
    auto run = [&](bool guess) {
      auto model = load_gpu(dir + "/qwen3moe-tiny-q4_k_m.gguf", std::string(mode) + (guess ? "" : "/noguess"));
      std::vector<float> all = greedy_logits(*model, 512, 3, 20, 5, 24);
      if (guess) stats = model->routing_guess_stats();
      return all;
    };
    const std::vector<float> off = run(false), on = run(true);
    ASSERT_EQ(off.size(), on.size());
    for (size_t i = 0; i < on.size(); ++i)
      ASSERT_EQ(std::bit_cast<uint32_t>(on[i]), std::bit_cast<uint32_t>(off[i])) << mode << ": logit " << i;
    EXPECT_GT(stats.layer_steps, 0) << mode;
    EXPECT_GT(stats.guessed, 0) << mode << ": no routing guess reached the CPU";
    EXPECT_GE(stats.chosen * 2, stats.guessed) << mode << ": most guesses should be chosen";
    std::printf("  %s: %ld hybrid layer steps, %ld host experts guessed, %ld chosen, %.0f bytes prefetched\n", mode,
                stats.layer_steps, stats.guessed, stats.chosen, stats.prefetched_bytes);
  }
}

// Prefill copies that wait for a layer's routing carry only the experts the micro-batch uses. The
// fixtures' model has 4 experts, all of them used by any micro-batch; a synthetic one with 64 experts
// (2 per token) leaves most of them unused by a 12-token micro-batch, so the upload ring then holds
// gaps (or a previous chunk's experts) where the unused ones would be, which the grouped products must
// never read. Every streamed layer waits for its routing here; the logits of all 12 positions agree
// with every expert on the GPU (the same grouped kernels on the same slots).
TEST(GpuPrefill, UploadsOfOnlyTheUsedExpertsGiveTheSameLogits) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU";
  const std::string path = ::testing::TempDir() + "/fitmoe-qwen3moe-tiny-wide-q4_k_m.gguf";
  {
    ThreadPool pool(2);
    SyntheticSpec spec;
    spec.preset = "tiny-wide";
    spec.seed = 7;
    write_synthetic_model(spec, path, pool);
  }
  std::vector<int32_t> prompt(12);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int32_t>((i * 389 + 5) % 1024);
  auto run = [&](const std::string& mode) {
    auto model = load_gpu(path, mode);
    SessionOptions so;
    so.n_threads = 2;
    so.n_ctx = 512;
    Session s(*model, so);
    return s.eval(prompt, static_cast<int>(prompt.size()));
  };
  const std::vector<float> all = run("gpu"), streamed = run("cpu_moe/upload/wait"),
                           chunk1 = run("cpu_moe/upload/chunk1/wait");
  ASSERT_EQ(all.size(), streamed.size());
  ASSERT_EQ(all.size(), chunk1.size());
  float scale = 0;
  for (float v : all) scale = std::max(scale, std::fabs(v));
  ASSERT_GT(scale, 0.0f);
  for (size_t i = 0; i < all.size(); ++i) {
    ASSERT_FALSE(std::isnan(streamed[i]) || std::isnan(chunk1[i])) << "logit " << i;
    ASSERT_LE(std::fabs(streamed[i] - all[i]), 1e-4f * scale) << "streamed, logit " << i;
    ASSERT_LE(std::fabs(chunk1[i] - all[i]), 1e-4f * scale) << "one expert per chunk, logit " << i;
  }
  std::remove(path.c_str());
}

TEST(GpuPlan, BudgetTooSmallIsAClearErrorBeforeLoading) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU";
  LoadOptions lo;
  lo.plan.vram_budget = 64ull << 20;  // 64 MiB: below the CUDA reserve alone
  try {
    Model::load(test::testdata("qwen3moe-tiny/qwen3moe-tiny-f32.gguf"), lo);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("too small"), std::string::npos) << e.what();
  }
}

TEST(GpuPlan, AccountantEnforcesTheBudget) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU";
  gpu::DeviceMemory mem(10u << 20);
  void* a = mem.alloc(6u << 20, "first");
  EXPECT_THROW(mem.alloc(6u << 20, "second"), Error);
  mem.free(a);
  void* b = mem.alloc(6u << 20, "third");
  EXPECT_EQ(mem.used(), 6u << 20);
  mem.free(b);
}

}  // namespace
