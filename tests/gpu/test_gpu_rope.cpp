// RoPE scaling on the GPU: gpu::rope_neox and the fused qk_norm_rope_store with linear and YaRN
// parameters against cpu::rope_neox (which tests/test_rope.cpp holds against the scalar formula), the
// fused kernel against the unfused GPU ops bit for bit, and a YaRN model on the GPU against the CPU.
// Skips without a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <string>
#include <vector>
#include <unistd.h>

#include "cuda/device.h"
#include "gguf_copy.h"
#include "gpu/gpu_test_util.h"
#include "model/model.h"
#include "runtime/cpu_ops.h"
#include "runtime/session.h"
#include "testdata.h"

using namespace fitmoe;
using namespace fitmoe::gpu;
using namespace fitmoe::gpu::test;

namespace {

class GpuRope : public GpuTest {};

struct Case {
  const char* name;
  RopeParams rp;
};

std::vector<Case> cases(int n_rot) {
  return {
      {"none", RopeParams{1e6f}},
      {"linear x4", make_rope_params(n_rot, 1e6f, 0.25f, 0.0f, 1.0f, 32, 1, 4096)},
      {"yarn x4", make_rope_params(n_rot, 1e6f, 0.25f, 1.0f, 1.0f, 32, 1, 4096)},
      {"yarn x4 ext 0.5 attn 0.9", make_rope_params(n_rot, 1e6f, 0.25f, 0.5f, 0.9f, 32, 1, 32768)},
      {"yarn x16 base 1e4", make_rope_params(n_rot, 1e4f, 1.0f / 16, 1.0f, 1.0f, 16, 2, 2048)},
  };
}

TEST_F(GpuRope, RopeNeoxMatchesTheCpu) {
  const int n_heads = 4;
  const std::vector<int32_t> pos = {0, 1, 7, 1000, 4095, 4096, 31999, 131071};
  const int nt = static_cast<int>(pos.size());
  auto d_pos = upload(pos);
  for (int head_dim : {128, 64})
    for (int n_rot : {head_dim, head_dim / 2})
      for (const Case& c : cases(n_rot)) {
        const int64_t ld = n_heads * head_dim + 8;
        std::vector<float> x = randn(static_cast<size_t>(ld) * nt, 51 + n_rot);
        auto dx = upload(x);
        rope_neox(dx->as<float>(), nt, n_heads, head_dim, ld, n_rot, d_pos->as<int32_t>(), c.rp, s());
        sync();
        auto got = dx->down<float>(static_cast<size_t>(ld) * nt);
        std::vector<float> ref = x;
        for (int t = 0; t < nt; ++t) cpu::rope_neox(ref.data() + t * ld, 1, n_heads, head_dim, ld, n_rot, pos[t], c.rp);
        const int half = n_rot / 2;
        const double ms = c.rp.mscale();
        int bad = 0;
        for (int t = 0; t < nt; ++t)
          for (int h = 0; h < n_heads; ++h)
            for (int i = 0; i < head_dim; ++i) {
              const int64_t k = t * ld + h * head_dim + i;
              const float* v = x.data() + t * ld + h * head_dim;
              // The cos/sin of the same float angle: rounding of the double sincos against the CPU's
              // float ones (a few 1e-7 of the pair's size).
              double mag = std::fabs(x[k]);
              if (i < n_rot) mag = (std::fabs(v[i % half]) + std::fabs(v[i % half + half])) * ms;
              if (!(std::fabs(got[k] - ref[k]) <= 1e-6 * mag + 1e-30) && bad++ < 5)
                ADD_FAILURE() << c.name << " hd " << head_dim << " n_rot " << n_rot << " pos " << pos[t] << " h " << h
                              << " i " << i << ": got " << got[k] << " want " << ref[k];
            }
      }
}

// The fused attention prologue with YaRN against rms_norm + rope_neox + kv_store on the GPU: the same
// bits in q and in both caches.
TEST_F(GpuRope, QkNormRopeStoreWithYarnEqualsTheUnfusedOps) {
  const int n_head = 8, n_head_kv = 2, n_ctx = 64, hd = 128, hdv = 128;
  const std::vector<int32_t> pos = {0, 3, 31, 32, 63};
  const int nt = static_cast<int>(pos.size());
  auto d_pos = upload(pos);
  for (int n_rot : {hd, hd / 2})
    for (const Case& c : cases(n_rot)) {
      const int qw = n_head * hd, kw = n_head_kv * hd, vw = n_head_kv * hdv;
      const float eps = 1e-6f;
      std::vector<float> q = randn(static_cast<size_t>(qw) * nt, 411 + n_rot, 2.0f);
      std::vector<float> kk = randn(static_cast<size_t>(kw) * nt, 412), v = randn(static_cast<size_t>(vw) * nt, 413);
      std::vector<float> qn = randn(hd, 414), kn = randn(hd, 415);
      auto dq_f = upload(q), dq_r = upload(q), dk = upload(kk), dk_r = upload(kk), dv = upload(v);
      auto dqn = upload(qn), dkn = upload(kn);
      const size_t es = 2;
      Dev kc_f(static_cast<size_t>(n_ctx) * kw * es), vc_f(static_cast<size_t>(n_ctx) * vw * es);
      Dev kc_r(static_cast<size_t>(n_ctx) * kw * es), vc_r(static_cast<size_t>(n_ctx) * vw * es);
      DevKv kv_f{DType::F16, kc_f.bytes(), vc_f.bytes(), n_ctx}, kv_r{DType::F16, kc_r.bytes(), vc_r.bytes(), n_ctx};
      qk_norm_rope_store(dq_f->as<float>(), qw, dk->as<float>(), kw, dv->as<float>(), vw, dqn->as<float>(),
                         dkn->as<float>(), kv_f, d_pos->as<int32_t>(), nt, n_head, n_head_kv, hd, hdv, n_rot, c.rp, eps,
                         s());
      rms_norm(dq_r->as<float>(), dqn->as<float>(), dq_r->as<float>(), hd, nt * n_head, eps, hd, hd, s());
      rms_norm(dk_r->as<float>(), dkn->as<float>(), dk_r->as<float>(), hd, nt * n_head_kv, eps, hd, hd, s());
      rope_neox(dq_r->as<float>(), nt, n_head, hd, qw, n_rot, d_pos->as<int32_t>(), c.rp, s());
      rope_neox(dk_r->as<float>(), nt, n_head_kv, hd, kw, n_rot, d_pos->as<int32_t>(), c.rp, s());
      kv_store(kv_r, d_pos->as<int32_t>(), nt, dk_r->as<float>(), kw, dv->as<float>(), vw, n_head_kv, hd, hdv, s());
      sync();
      const std::string what = std::string(c.name) + " n_rot " + std::to_string(n_rot);
      auto gq = dq_f->down<float>(q.size()), rq = dq_r->down<float>(q.size());
      for (size_t i = 0; i < q.size(); ++i) ASSERT_EQ(bits(gq[i]), bits(rq[i])) << what << " q at " << i;
      ASSERT_EQ(kc_f.down<uint8_t>(kc_f.size()), kc_r.down<uint8_t>(kc_r.size())) << what << ": K cache differs";
      ASSERT_EQ(vc_f.down<uint8_t>(vc_f.size()), vc_r.down<uint8_t>(vc_r.size())) << what << ": V cache differs";
      // And q against the CPU's norm + rope (the values, within the sincos rounding).
      std::vector<float> cq = q;
      cpu::rms_norm(cq.data(), qn.data(), cq.data(), hd, nt * n_head, eps, hd, hd);
      for (int t = 0; t < nt; ++t) cpu::rope_neox(cq.data() + t * qw, 1, n_head, hd, qw, n_rot, pos[t], c.rp);
      double worst = 0;
      for (size_t i = 0; i < q.size(); ++i) worst = std::max(worst, std::fabs(static_cast<double>(gq[i]) - cq[i]));
      EXPECT_LT(worst, 1e-5) << what;
    }
}

// The qwen3moe fixture with YaRN metadata, on the GPU (prefill and decode) against the CPU forward pass.
TEST(GpuRopeModel, YarnModelOnTheGpuMatchesTheCpu) {
  gpu::DeviceInfo di;
  if (!gpu::query_device(&di)) GTEST_SKIP() << "no CUDA GPU";
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("fitmoe-gpu-rope-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const std::string path = (dir / "yarn.gguf").string();
  const std::string a = "qwen3moe.";
  fitmoe::test::write_with(fitmoe::test::testdata("qwen3moe-tiny") + "/qwen3moe-tiny-f32.gguf", path,
                           {{a + "rope.scaling.type", "s", "yarn"},
                            {a + "rope.scaling.factor", "f", "", 4.0},
                            {a + "rope.scaling.original_context_length", "u", "", 32}});
  LoadOptions cpu_lo;
  cpu_lo.plan.use_gpu = false;
  auto cpu_m = Model::load(path, cpu_lo);
  LoadOptions gpu_lo;
  gpu_lo.plan.n_ctx = 256;
  auto gpu_m = Model::load(path, gpu_lo);
  ASSERT_TRUE(gpu_m->on_gpu());
  const int n = cpu_m->config().n_vocab;
  auto run = [&](const Model& m) {
    SessionOptions so;
    so.n_threads = 2;
    so.n_ctx = 128;
    Session s(m, so);
    std::vector<int32_t> prompt(72);
    for (int i = 0; i < 72; ++i) prompt[i] = (i * 37 + 11) % 1000;
    std::vector<float> out = s.eval(prompt, 72);
    for (int step = 0; step < 8; ++step) {  // decode steps beyond the original context
      const std::vector<int32_t> one{(step * 53 + 5) % 1000};
      const auto& l = s.eval(one, 1);
      out.insert(out.end(), l.begin(), l.end());
    }
    return out;
  };
  const auto lc = run(*cpu_m), lg = run(*gpu_m);
  ASSERT_EQ(lc.size(), lg.size());
  for (size_t r = 0; r < lc.size() / n; ++r) {
    double num = 0, den = 0;
    for (int i = 0; i < n; ++i) {
      const double d = static_cast<double>(lg[r * n + i]) - lc[r * n + i];
      num += d * d;
      den += static_cast<double>(lc[r * n + i]) * lc[r * n + i];
    }
    EXPECT_LT(std::sqrt(num / den), 2e-3) << "row " << r;  // the f32 file's GPU tolerance (tests/gpu/test_gpu_models.cpp)
  }
  fs::remove_all(dir);
}

}  // namespace
