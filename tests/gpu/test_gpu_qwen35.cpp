// qwen35moe on the GPU (src/cuda/qwen35_gpu.cpp) against the reference's logits and greedy tokens
// (../shared/testdata qwen35moe-tiny, f32 and q4_k_m; qwen35moe-mtp-tiny's trunk where present): fully
// on the GPU and in hybrid placements (every expert on the host, layer 0's on the host), with both
// prefill treatments of host experts; the recurrent state's checkpoints and rewinds on the GPU state;
// decode graphs giving the bits of the launches one by one. Skips without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>

#include "cuda/device.h"
#include "reference_check.h"
#include "runtime/error.h"
#include "runtime/session.h"
#include "runtime/thread_pool.h"

using namespace fitmoe;

namespace {

bool have_gpu() {
  gpu::DeviceInfo di;
  return gpu::query_device(&di);
}

struct Q35Case {
  std::string folder, type, mode;  // mode: gpu | cpu_moe | n_cpu_moe1, + /cpu | /upload, + /nographs
};

std::unique_ptr<Model> load_q35(const std::string& path, const std::string& mode) {
  LoadOptions lo;
  lo.plan.n_ctx = 512;
  lo.plan.n_ubatch = 256;
  const std::string base = mode.substr(0, mode.find('/'));
  if (mode.find("/cpu") != std::string::npos) lo.plan.prefill_host_experts = "cpu";
  else if (mode.find("/upload") != std::string::npos) lo.plan.prefill_host_experts = "upload";
  if (mode.find("/nographs") != std::string::npos) lo.plan.decode_graphs = false;
  if (base == "cpu_moe") lo.plan.cpu_moe = true;
  if (base == "n_cpu_moe1") lo.plan.n_cpu_moe = 1;
  auto m = Model::load(path, lo);
  EXPECT_TRUE(m->on_gpu()) << mode;
  return m;
}

class GpuQwen35Reference : public ::testing::TestWithParam<Q35Case> {};

TEST_P(GpuQwen35Reference, LogitsAndGreedyMatch) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU";
  const Q35Case& c = GetParam();
  const std::string dir = test::testdata(c.folder);
  if (!std::filesystem::exists(dir + "/manifest.json")) GTEST_SKIP() << dir << " is not here";
  const std::string file = dir + "/" + c.folder + "-" + c.type + ".gguf";
  if (!std::filesystem::exists(file)) GTEST_SKIP() << file << " is not here";
  auto manifest = test::read_json(dir + "/manifest.json");
  auto model = load_q35(file, c.mode);
  const Plan& plan = model->plan();
  int on = 0, total = 0;
  for (auto& t : plan.tensors)
    if (t.is_experts && t.layer < model->config().n_layer_trunk()) {
      total += static_cast<int>(t.expert_on_gpu.size());
      on += static_cast<int>(std::count(t.expert_on_gpu.begin(), t.expert_on_gpu.end(), true));
    }
  if (c.mode.rfind("gpu", 0) == 0) {
    EXPECT_EQ(on, total);
  }
  if (c.mode.rfind("cpu_moe", 0) == 0) {
    EXPECT_EQ(on, 0);
  }
  if (c.mode.rfind("n_cpu_moe1", 0) == 0) {
    EXPECT_GT(on, 0);
    EXPECT_LT(on, total);
  }
  std::printf("  %s %s %s: %d of %d expert matrices on the GPU; %s\n", c.folder.c_str(), c.type.c_str(),
              c.mode.c_str(), on, total, model->gpu_memory_report().c_str());
  const auto tol = test::tolerance_for(c.type);
  for (const char* p : {"p7", "p33", "p200"}) {
    const auto& ref = manifest["files"][c.type]["refs"][p];
    auto prompt = manifest["prompts"][p]["ids"].get<std::vector<int32_t>>();
    const int row0 = ref["logits_rows"][0].get<int>();
    auto logits = test::read_f32(dir + "/" + ref["logits"].get<std::string>());
    const std::string label = c.folder + "-" + c.type + " " + c.mode + " " + p;
    std::printf("  %s\n", test::check_logits(*model, prompt, row0, logits, tol, label).c_str());
    if (ref.contains("logits_fa_kv") && ref["logits_fa_kv"].contains("fa-kvf16-f16")) {
      auto fa = test::read_f32(dir + "/" + ref["logits_fa_kv"]["fa-kvf16-f16"].get<std::string>());
      std::printf("  %s\n", test::check_logits(*model, prompt, row0, fa, tol, label + " fa-kvf16-f16").c_str());
    }
    test::check_greedy(*model, test::read_json(dir + "/" + ref["greedy"].get<std::string>()), tol, label);
  }
}

std::vector<Q35Case> cases() {
  std::vector<Q35Case> out;
  for (const char* t : {"f32", "q4_k_m"})
    for (const char* m : {"gpu", "gpu/nographs", "cpu_moe/upload", "cpu_moe/cpu", "n_cpu_moe1/upload", "n_cpu_moe1/cpu"})
      out.push_back({"qwen35moe-tiny", t, m});
  for (const char* t : {"f32", "q4_k_m"}) out.push_back({"qwen35moe-mtp-tiny", t, "gpu"});
  return out;
}

INSTANTIATE_TEST_SUITE_P(Files, GpuQwen35Reference, ::testing::ValuesIn(cases()), [](const auto& info) {
  std::string n = info.param.folder + "_" + info.param.type + "_" + info.param.mode;
  for (auto& ch : n)
    if (!isalnum(static_cast<unsigned char>(ch))) ch = '_';
  return n;
});

// Greedy decoding: the prompt in one batch, then `steps` single-token steps feeding back the argmax;
// the tokens chosen.
std::vector<int32_t> greedy(Session& s, const std::vector<int32_t>& prompt, int steps, int n_vocab) {
  std::vector<int32_t> out;
  std::vector<float> l = s.eval(prompt, 1);
  for (int i = 0; i < steps; ++i) {
    const int32_t t = static_cast<int32_t>(std::max_element(l.begin(), l.end()) - l.begin());
    out.push_back(t);
    l = s.eval(std::span<const int32_t>(&t, 1), 1);
    EXPECT_EQ(static_cast<int>(l.size()), n_vocab);
  }
  return out;
}

// The GPU state's checkpoints have the CPU state's semantics: a rewind lands at the nearest checkpoint
// at or below the position asked for (or 0), Session::truncate feeds the tokens up to it again, and
// the logits and greedy tokens after it equal a fresh run's; fully on the GPU and hybrid.
TEST(GpuQwen35State, CheckpointRewindGivesTheSameTokensAsAFreshRun) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU";
  const std::string dir = test::testdata("qwen35moe-tiny");
  auto manifest = test::read_json(dir + "/manifest.json");
  auto p = manifest["prompts"]["p33"]["ids"].get<std::vector<int32_t>>();
  const std::vector<int32_t> a(p.begin(), p.begin() + 20), extra(p.begin() + 20, p.begin() + 26),
      b(p.begin() + 26, p.end());
  for (const char* type : {"f32", "q4_k_m"})
    for (const char* mode : {"gpu", "cpu_moe/cpu"}) {
      const std::string label = std::string(type) + " " + mode;
      auto model = load_q35(dir + "/qwen35moe-tiny-" + type + ".gguf", mode);
      const int V = model->config().n_vocab;
      SessionOptions so;
      so.n_threads = 2;
      so.n_ctx = 128;

      // Fresh: a, the first two tokens of extra, then b, then greedy tokens.
      Session fresh(*model, so);
      std::vector<int32_t> all = a;
      all.insert(all.end(), extra.begin(), extra.begin() + 2);
      fresh.eval(all, 0);
      const std::vector<int32_t> want = greedy(fresh, b, 12, V);

      // Rewound: a (a checkpoint at 20), extra token by token (no checkpoints), back to 22 (from the
      // checkpoint at 20, feeding two tokens again), then b.
      Session s(*model, so);
      s.eval(a, 0);
      for (int32_t t : extra) s.eval(std::span<const int32_t>(&t, 1), 1);
      ASSERT_EQ(s.n_past(), 26) << label;
      s.truncate(22);
      EXPECT_EQ(s.n_past(), 22) << label;
      EXPECT_EQ(greedy(s, b, 12, V), want) << label;

      // And logits: a rewind below every checkpoint re-evaluates from 0 (Session::truncate feeds the
      // first 3 tokens again as one batch): a fresh run's logits with the same batches, so the same
      // kernels (3 tokens take the mat-vec path, 30 the dequantize + cuBLAS one, whose roundings
      // differ by ~1e-3 on quantized files; a stale recurrent state would be ~1e-1 off).
      Session f2(*model, so);
      f2.eval(std::vector<int32_t>(p.begin(), p.begin() + 3), 0);
      const std::vector<float> l_fresh = f2.eval(std::vector<int32_t>(p.begin() + 3, p.end()), 1);
      s.truncate(3);
      ASSERT_EQ(s.n_past(), 3) << label;
      const std::vector<float> l_rew = s.eval(std::vector<int32_t>(p.begin() + 3, p.end()), 1);
      EXPECT_LE(test::rel_l2(l_rew.data(), l_fresh.data(), V), 1e-6) << label;

      // At the state level.
      auto st = model->new_state({128, KvCacheType{}, 4});
      ThreadPool pool(2);
      EXPECT_TRUE(st->recurrent());
      model->forward(*st, pool, a, 0, nullptr);
      st->checkpoint();
      model->forward(*st, pool, extra, 0, nullptr);
      st->truncate(24);
      EXPECT_EQ(st->n_past(), 20) << label;
      st->truncate(10);
      EXPECT_EQ(st->n_past(), 0) << label;
    }
}

// Against the CPU forward pass on the same file: prefill logits of every position (a micro-batch
// path of 7 tokens and a prefill one of 33) and greedy decode steps (f32), all on the GPU and hybrid.
TEST(GpuQwen35, MatchesTheCpuForwardPass) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU";
  const std::string dir = test::testdata("qwen35moe-tiny");
  auto manifest = test::read_json(dir + "/manifest.json");
  for (const char* type : {"f32", "q4_k_m"}) {
    LoadOptions cpu_lo;
    cpu_lo.plan.use_gpu = false;
    const std::string path = dir + "/qwen35moe-tiny-" + type + ".gguf";
    auto cpu = Model::load(path, cpu_lo);
    const int V = cpu->config().n_vocab;
    SessionOptions so;
    so.n_threads = 2;
    so.n_ctx = 256;
    for (const char* mode : {"gpu", "n_cpu_moe1/cpu"}) {
      auto gpu_model = load_q35(path, mode);
      for (const char* pr : {"p7", "p33"}) {
        auto prompt = manifest["prompts"][pr]["ids"].get<std::vector<int32_t>>();
        Session sc(*cpu, so), sg(*gpu_model, so);
        const std::vector<float> lc = sc.eval(prompt, static_cast<int>(prompt.size()));
        const std::vector<float> lg = sg.eval(prompt, static_cast<int>(prompt.size()));
        ASSERT_EQ(lc.size(), lg.size());
        double worst = 0;
        for (size_t r = 0; r < prompt.size(); ++r)
          worst = std::max(worst, test::rel_l2(lg.data() + r * V, lc.data() + r * V, V));
        std::printf("  %s %s %s: prefill worst row vs CPU %.2e\n", type, mode, pr, worst);
        const bool f32 = std::string(type) == "f32";
        EXPECT_LE(worst, f32 ? 1e-4 : 5e-2) << type << " " << mode << " " << pr;
        // (Quantized files: an activation-rounding flip may turn a close greedy step; f32 only.)
        const std::vector<int32_t> tc = greedy(sc, {prompt.back()}, 8, V), tg = greedy(sg, {prompt.back()}, 8, V);
        if (f32) {
          EXPECT_EQ(tc, tg) << type << " " << mode << " " << pr;
        }
      }
    }
  }
}

// Decode graphs replay the same kernels as the launches one by one: the same logits, bit for bit.
TEST(GpuQwen35, DecodeGraphsGiveTheSameBits) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU";
  const std::string dir = test::testdata("qwen35moe-tiny");
  for (const char* mode : {"gpu", "cpu_moe/cpu"}) {
    auto run = [&](bool graphs) {
      auto model = load_q35(dir + "/qwen35moe-tiny-q4_k_m.gguf", std::string(mode) + (graphs ? "" : "/nographs"));
      SessionOptions so;
      so.n_threads = 2;
      so.n_ctx = 128;
      Session s(*model, so);
      std::vector<int32_t> prompt(20);
      for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int32_t>((i * 7919 + 3) % 1024);
      std::vector<float> all = s.eval(prompt, 1);
      for (int i = 0; i < 16; ++i) {
        const int32_t t = static_cast<int32_t>(std::max_element(all.end() - 1024, all.end()) - (all.end() - 1024));
        const std::vector<float>& l = s.eval(std::span<const int32_t>(&t, 1), 1);
        all.insert(all.end(), l.begin(), l.end());
      }
      return all;
    };
    const std::vector<float> with = run(true), without = run(false);
    ASSERT_EQ(with.size(), without.size());
    for (size_t i = 0; i < with.size(); ++i) {
      ASSERT_FALSE(std::isnan(with[i])) << mode << ": NaN logit " << i;
      ASSERT_EQ(with[i], without[i]) << mode << ": logit " << i;
    }
  }
}

}  // namespace
