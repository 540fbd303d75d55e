// gemma4 on the GPU (src/cuda/gemma4.h kernels, src/cuda/gemma4_gpu.cpp): each new kernel against the
// CPU op on random inputs (GeGLU through the f16 GELU table, RoPE with rope_freqs factors, the KV
// store + windowed attention over plain and ring caches, softcap, the router input, the per-expert
// scale); gemma4-tiny / gemma4moe-tiny against the reference's logits and greedy tokens within the
// README's Gemma tolerances, fully on the GPU and (MoE) with experts on the host; the GPU pass against
// the CPU pass past the sliding window on a wrapping ring. Skips without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "cuda/device.h"
#include "cuda/gemma4.h"
#include "gguf_copy.h"
#include "gpu/gpu_test_util.h"
#include "model/model.h"
#include "quant/dtype.h"
#include "reference_check.h"
#include "runtime/cpu_gemma4.h"
#include "runtime/cpu_ops.h"
#include "runtime/error.h"
#include "runtime/session.h"
#include "runtime/thread_pool.h"

using namespace fitmoe;
using gpu::test::Dev;
using gpu::test::GpuTest;
using gpu::test::randn;
using gpu::test::upload;

namespace {

bool have_gpu() {
  gpu::DeviceInfo di;
  return gpu::query_device(&di);
}

double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, static_cast<double>(std::fabs(a[i] - b[i])));
  return m;
}

// ---- kernels against the CPU ops ------------------------------------------------------------------

class GpuGemma4Ops : public GpuTest {};

TEST_F(GpuGemma4Ops, GegluMatchesTheCpuTableBitForBit) {
  const int64_t n = 70000;
  std::vector<float> g = randn(n, 1, 4.0f), u = randn(n, 2);
  g[0] = -10.0f, g[1] = 10.0f, g[2] = -12.0f, g[3] = 15.0f, g[4] = 0.0f, g[5] = -0.0f, g[6] = 9.999f;
  std::vector<float> want(n);
  cpu::geglu(g.data(), u.data(), want.data(), n);
  auto dg = upload(g), du = upload(u);
  Dev out(sizeof(float) * n);
  gpu::gemma4_geglu(dg->as<float>(), du->as<float>(), out.as<float>(), n, s());
  sync();
  const auto got = out.down<float>(n);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(gpu::test::bits(got[i]), gpu::test::bits(want[i])) << i << " gate " << g[i];
  // In place (out = gate).
  gpu::gemma4_geglu(dg->as<float>(), du->as<float>(), dg->as<float>(), n, s());
  sync();
  EXPECT_EQ(dg->down<float>(n), want);
}

TEST_F(GpuGemma4Ops, RopeWithFreqFactorsMatchesTheCpu) {
  const int T = 5, H = 3, hd = 128, n_rot = 128;
  const int64_t ld = static_cast<int64_t>(H) * hd + 16;
  std::vector<float> x = randn(static_cast<size_t>(T) * ld, 3);
  std::vector<float> ff(n_rot / 2);
  for (int i = 0; i < n_rot / 2; ++i) ff[i] = i < n_rot / 4 ? 1.0f : 1e30f;  // proportional: half the pairs still
  for (const bool with_ff : {false, true})
    for (const int pos0 : {0, 37, 5000}) {
      const RopeParams rp = make_rope_params(n_rot, 1e6f, 1.0f, 0.0f, 1.0f, 32, 1, 8192);
      std::vector<float> want = x;
      cpu::rope_neox(want.data(), T, H, hd, ld, n_rot, pos0, rp, with_ff ? ff.data() : nullptr);
      std::vector<int32_t> pos(T);
      for (int t = 0; t < T; ++t) pos[t] = pos0 + t;
      auto dx = upload(x), dp = upload(pos), dff = upload(ff);
      gpu::gemma4_rope(dx->as<float>(), T, H, hd, ld, n_rot, dp->as<int32_t>(), rp, with_ff ? dff->as<float>() : nullptr,
                       s());
      sync();
      const auto got = dx->down<float>(x.size());
      // (cos / sin: a double-precision sincos rounded against the CPU's float cosf / sinf: an ulp.)
      EXPECT_LE(max_abs_diff(got, want), 2e-5 * (1 + pos0 / 1000)) << "ff " << with_ff << " pos0 " << pos0;
    }
}

// KV store + attention against cpu::kv_store + cpu::attention, f16 and f32 caches, plain and ring,
// with and without a window; the ring's other slots poisoned (never read).
TEST_F(GpuGemma4Ops, WindowedAttentionOverRingMatchesTheCpu) {
  const int H = 4, Hkv = 2, hd = 64;
  const int64_t qw = H * hd, kw = Hkv * hd;
  ThreadPool pool(2);
  cpu::Scratch scratch;
  struct C {
    DType type;
    bool ring;
    int window, cap, pos0, T;
  };
  for (const C c : {C{DType::F16, false, 0, 64, 0, 20}, C{DType::F16, false, 8, 64, 0, 20}, C{DType::F32, false, 8, 64, 30, 3},
                    C{DType::F16, true, 8, 8 + 12, 0, 12}, C{DType::F16, true, 8, 8 + 12, 50, 12},
                    C{DType::F32, true, 8, 8 + 12, 77, 1}, C{DType::F16, true, 16, 16 + 12, 1000, 5}}) {
    const std::string label = std::string(dtype_name(c.type)) + (c.ring ? " ring" : " plain") + " window " +
                              std::to_string(c.window) + " pos0 " + std::to_string(c.pos0) + " T " + std::to_string(c.T);
    const size_t es = c.type == DType::F16 ? 2 : 4;
    // History: positions [max(0, pos0 - cap + T) .. pos0) stored one batch before (as earlier steps would).
    const int hist0 = c.ring ? std::max(0, c.pos0 - (c.cap - c.T)) : 0;
    const int n_hist = c.pos0 - hist0;
    std::vector<uint8_t> kc(static_cast<size_t>(c.cap) * kw * es, 0xff), vc(static_cast<size_t>(c.cap) * kw * es, 0xff);
    ASSERT_TRUE(c.ring || c.pos0 + c.T <= c.cap) << label << ": bad case";
    cpu::KvView view{c.type, kc.data(), vc.data(), c.cap, static_cast<int64_t>(kw * es), c.ring};
    std::vector<float> hk = randn(static_cast<size_t>(std::max(n_hist, 1)) * kw, 10 + c.pos0),
                       hv = randn(static_cast<size_t>(std::max(n_hist, 1)) * kw, 20 + c.pos0);
    if (n_hist > 0) cpu::kv_store(view, hist0, n_hist, hk.data(), kw, hv.data(), kw, kw, kw);
    // The device cache starts as the CPU's does now (history in, the rest poisoned).
    Dev dk(kc.size()), dv(vc.size());
    dk.up(kc.data(), kc.size());
    dv.up(vc.data(), vc.size());
    std::vector<float> k = randn(static_cast<size_t>(c.T) * kw, 30), v = randn(static_cast<size_t>(c.T) * kw, 40),
                       q = randn(static_cast<size_t>(c.T) * qw, 50);
    cpu::kv_store(view, c.pos0, c.T, k.data(), kw, v.data(), kw, kw, kw);
    std::vector<float> want(static_cast<size_t>(c.T) * qw);
    cpu::attention(pool, q.data(), qw, view, c.pos0, c.T, H, Hkv, hd, hd, 1.0f, want.data(), qw, scratch, 0, c.window);
    std::vector<int32_t> pos(c.T);
    for (int t = 0; t < c.T; ++t) pos[t] = c.pos0 + t;
    auto dq = upload(q), dkk = upload(k), dvv = upload(v), dp = upload(pos);
    const gpu::DevKv kv{c.type, dk.bytes(), dv.bytes(), c.cap};
    gpu::gemma4_kv_store(kv, c.ring, dp->as<int32_t>(), c.T, dkk->as<float>(), kw, dvv->as<float>(), kw, Hkv, hd, s());
    Dev out(sizeof(float) * want.size());
    gpu::gemma4_attention(dq->as<float>(), qw, kv, c.ring, dp->as<int32_t>(), c.T, H, Hkv, hd, 1.0f, c.window,
                          out.as<float>(), qw, s());
    sync();
    // The cache bytes equal the CPU's (the store), the outputs within f32 summation order.
    EXPECT_EQ(dk.down<uint8_t>(kc.size()), kc) << label;
    EXPECT_EQ(dv.down<uint8_t>(vc.size()), vc) << label;
    const auto got = out.down<float>(want.size());
    for (float f : got) ASSERT_FALSE(std::isnan(f)) << label;
    EXPECT_LE(max_abs_diff(got, want), 2e-3) << label;
  }
}

TEST_F(GpuGemma4Ops, SoftcapScalesRouterInputAndExpertScale) {
  const int n = 256, rows = 3;
  std::vector<float> x = randn(static_cast<size_t>(n) * rows, 7, 40.0f);
  {
    std::vector<float> want = x;
    cpu::softcap(want.data(), static_cast<int64_t>(want.size()), 30.0f);
    auto d = upload(x);
    gpu::gemma4_softcap(d->as<float>(), static_cast<int64_t>(x.size()), 30.0f, s());
    sync();
    EXPECT_LE(max_abs_diff(d->down<float>(x.size()), want), 1e-5);
  }
  {
    std::vector<float> want = x;
    for (float& f : want) f *= 16.0f;
    auto d = upload(x);
    gpu::gemma4_scale(d->as<float>(), static_cast<int64_t>(x.size()), 16.0f, s());
    sync();
    EXPECT_EQ(d->down<float>(x.size()), want);
    const std::vector<float> f{0.125f};
    auto df = upload(f);
    for (float& w : want) w *= 0.125f;
    gpu::gemma4_scale_by(d->as<float>(), static_cast<int64_t>(x.size()), df->as<float>(), s());
    sync();
    EXPECT_EQ(d->down<float>(x.size()), want);
  }
  {
    const std::vector<float> w = randn(n, 8);
    std::vector<float> want(x.size());
    cpu::rms_norm(x.data(), nullptr, want.data(), n, rows, 1e-6f, n, n);
    const float inv = 1.0f / std::sqrt(static_cast<float>(n));
    for (int r = 0; r < rows; ++r)
      for (int i = 0; i < n; ++i) {
        float& v = want[static_cast<size_t>(r) * n + i];
        v = v * inv * w[i];
      }
    auto d = upload(x), dw = upload(w);
    Dev out(sizeof(float) * x.size());
    gpu::gemma4_router_input(d->as<float>(), dw->as<float>(), out.as<float>(), n, rows, 1e-6f, inv, s());
    sync();
    EXPECT_LE(max_abs_diff(out.down<float>(x.size()), want), 1e-5);
  }
  {
    const std::vector<int32_t> ids{3, 0, 7, -1, 5};
    std::vector<float> wts = {0.5f, 0.25f, 0.125f, 1.0f, 0.75f}, scale = randn(8, 9);
    std::vector<float> want = wts;
    for (size_t j = 0; j < ids.size(); ++j)
      if (ids[j] >= 0) want[j] *= scale[ids[j]];
    auto dw = upload(wts), di = upload(ids), ds = upload(scale);
    gpu::gemma4_expert_scale(dw->as<float>(), di->as<int32_t>(), ds->as<float>(), static_cast<int>(ids.size()), s());
    sync();
    EXPECT_EQ(dw->down<float>(wts.size()), want);
  }
}

// ---- models against the reference --------------------------------------------------------------------

// The README's Gemma tolerances (as tests/test_model_gemma4.cpp).
fitmoe::test::Tolerance gemma_tolerance(const std::string& folder, const std::string& type) {
  const bool moe = folder == "gemma4moe-tiny";
  if (type == "f32")
    return moe ? fitmoe::test::Tolerance{1e-2, -1, 0, 0.03, 0.05} : fitmoe::test::Tolerance{5e-3, -1, 0, 0.02, 0.05};
  return moe ? fitmoe::test::Tolerance{0.3, 0.12, 0.80, -1, 0.5} : fitmoe::test::Tolerance{0.2, 0.08, 0.85, -1, 0.5};
}

struct G4Case {
  std::string folder, type, mode;  // mode: gpu | gpu/nographs | cpu_moe | n_cpu_moe1
};

std::unique_ptr<Model> load_g4(const std::string& path, const std::string& mode) {
  LoadOptions lo;
  lo.plan.n_ctx = 512;
  lo.plan.n_ubatch = 256;
  if (mode.find("/nographs") != std::string::npos) lo.plan.decode_graphs = false;
  if (mode.rfind("cpu_moe", 0) == 0) lo.plan.cpu_moe = true;
  if (mode.rfind("n_cpu_moe1", 0) == 0) lo.plan.n_cpu_moe = 1;
  auto m = Model::load(path, lo);
  EXPECT_TRUE(m->on_gpu()) << mode;
  return m;
}

class GpuGemma4Reference : public ::testing::TestWithParam<G4Case> {};

TEST_P(GpuGemma4Reference, LogitsAndGreedyMatch) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU";
  const G4Case& c = GetParam();
  const std::string dir = fitmoe::test::testdata(c.folder);
  if (!std::filesystem::exists(dir + "/manifest.json")) GTEST_SKIP() << dir << " is not here";
  const std::string file = dir + "/" + c.folder + "-" + c.type + ".gguf";
  if (!std::filesystem::exists(file)) GTEST_SKIP() << file << " is not here";
  auto manifest = fitmoe::test::read_json(dir + "/manifest.json");
  auto model = load_g4(file, c.mode);
  int on = 0, total = 0;
  for (auto& t : model->plan().tensors)
    if (t.is_experts) {
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
  const auto tol = gemma_tolerance(c.folder, c.type);
  for (const char* p : {"p7", "p33", "p200"}) {
    const auto& ref = manifest["files"][c.type]["refs"][p];
    auto prompt = manifest["prompts"][p]["ids"].get<std::vector<int32_t>>();
    const int row0 = ref["logits_rows"][0].get<int>();
    const std::string label = c.folder + "-" + c.type + " " + c.mode + " " + p;
    auto logits = fitmoe::test::read_f32(dir + "/" + ref["logits"].get<std::string>());
    std::printf("  %s\n", fitmoe::test::check_logits(*model, prompt, row0, logits, tol, label).c_str());
    if (ref.contains("logits_kv_f32")) {
      auto kv = fitmoe::test::read_f32(dir + "/" + ref["logits_kv_f32"].get<std::string>());
      std::printf("  %s\n",
                  fitmoe::test::check_logits(*model, prompt, row0, kv, tol, label + " kvf32", KvCacheType{DType::F32, DType::F32}).c_str());
    }
    fitmoe::test::check_greedy(*model, fitmoe::test::read_json(dir + "/" + ref["greedy"].get<std::string>()), tol,
                               label);
  }
}

std::vector<G4Case> cases() {
  std::vector<G4Case> out;
  for (const char* t : {"f32", "q4_k_m"}) {
    for (const char* m : {"gpu", "gpu/nographs"}) out.push_back({"gemma4-tiny", t, m});
    for (const char* m : {"gpu", "gpu/nographs", "cpu_moe", "n_cpu_moe1"}) out.push_back({"gemma4moe-tiny", t, m});
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Files, GpuGemma4Reference, ::testing::ValuesIn(cases()), [](const auto& info) {
  std::string n = info.param.folder + "_" + info.param.type + "_" + info.param.mode;
  for (auto& ch : n)
    if (!isalnum(static_cast<unsigned char>(ch))) ch = '_';
  return n;
});

// Past the sliding window on a wrapping ring (a copy with a window of 4, as tests/test_model_gemma4.cpp):
// the GPU pass's logits equal the CPU pass's, prefill in one call (pieces of kSlidingMicroBatch) and
// then token by token, fully on the GPU and with every expert on the host.
TEST(GpuGemma4, MatchesTheCpuPastTheWindow) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU";
  const std::string src = fitmoe::test::testdata("gemma4moe-tiny") + "/gemma4moe-tiny-f32.gguf";
  if (!std::filesystem::exists(src)) GTEST_SKIP() << src << " is not here";
  const std::string dst = (std::filesystem::temp_directory_path() / "fitmoe-gpu-gemma4-window4.gguf").string();
  fitmoe::test::write_with(src, dst, {{"gemma4.attention.sliding_window", "u", "", 4}});
  LoadOptions cpu_lo;
  cpu_lo.plan.use_gpu = false;
  auto cpu = Model::load(dst, cpu_lo);
  const int V = cpu->config().n_vocab, N = 600;
  std::vector<int32_t> toks(N);
  for (int i = 0; i < N; ++i) toks[i] = (i * 37 + 11) % V;
  toks[0] = 2;
  ThreadPool pool(2);
  StateOptions so;
  so.n_ctx = 1200;
  // f32 caches on both sides: with f16 ones, 600 positions of slightly different rounded keys (the
  // GPU's products sum in another order) drift to ~2.6e-3 (measured), which hides nothing about the
  // window but would need a loose bound.
  so.kv = {DType::F32, DType::F32};
  for (const char* mode : {"gpu", "cpu_moe"}) {
    LoadOptions lo;
    lo.plan.n_ctx = 1200;
    if (std::string(mode) == "cpu_moe") lo.plan.cpu_moe = true;
    auto gpu_model = Model::load(dst, lo);
    ASSERT_TRUE(gpu_model->on_gpu());
    auto sc = cpu->new_state(so), sg = gpu_model->new_state(so);
    const int P = 540;  // prefill (two pieces), then decode steps past the first wrap of the ring
    std::vector<float> lc(static_cast<size_t>(P) * V), lg(static_cast<size_t>(P) * V);
    cpu->forward(*sc, pool, std::span<const int32_t>(toks.data(), P), P, lc.data());
    gpu_model->forward(*sg, pool, std::span<const int32_t>(toks.data(), P), P, lg.data());
    double worst = 0;
    for (int r = 0; r < P; ++r)
      worst = std::max(worst, fitmoe::test::rel_l2(lg.data() + static_cast<size_t>(r) * V,
                                                   lc.data() + static_cast<size_t>(r) * V, V));
    std::vector<float> a(V), b(V);
    for (int i = P; i < N; ++i) {
      cpu->forward(*sc, pool, std::span<const int32_t>(&toks[i], 1), 1, a.data());
      gpu_model->forward(*sg, pool, std::span<const int32_t>(&toks[i], 1), 1, b.data());
      worst = std::max(worst, fitmoe::test::rel_l2(b.data(), a.data(), V));
    }
    std::printf("  %s: GPU vs CPU over %d positions, window 4: worst row %.2e\n", mode, N, worst);
    EXPECT_LT(worst, 1e-3) << mode;
  }
  std::filesystem::remove(dst);
}

}  // namespace
