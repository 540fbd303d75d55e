// gemma4's CPU ops against scalar references on random inputs: the f16-table GeGLU, the softcap, RoPE
// with freq factors, windowed attention over a plain and a ring cache (positions outside the window
// are never read), and the fused gate_up experts with GeGLU.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "quant/dtype.h"
#include "runtime/cpu_gemma4.h"
#include "runtime/cpu_ops.h"
#include "runtime/thread_pool.h"

using namespace fitmoe;

namespace {

// The reference's GeGLU, element by element, without a table: f16(gelu(f16(x))) * up.
float geglu_scalar(float g, float u) {
  if (g <= -10.0f) return 0.0f;
  if (g >= 10.0f) return g * u;
  const float gh = f16_to_f32(f32_to_f16(g));
  return f16_to_f32(f32_to_f16(cpu::gelu_tanh(gh))) * u;
}

TEST(Gemma4Ops, GegluIsTheF16TableOfGeluTanh) {
  std::mt19937 rng(1);
  std::normal_distribution<float> nd(0.0f, 4.0f);
  std::vector<float> g(4096), u(4096), out(4096);
  for (size_t i = 0; i < g.size(); ++i) g[i] = nd(rng), u[i] = nd(rng);
  g[0] = -10.0f, g[1] = 10.0f, g[2] = -9.999f, g[3] = 12.0f, g[4] = 0.0f;
  cpu::geglu(g.data(), u.data(), out.data(), static_cast<int64_t>(g.size()));
  for (size_t i = 0; i < g.size(); ++i) EXPECT_EQ(out[i], geglu_scalar(g[i], u[i])) << "at " << g[i];
  // The table's f16 step: within f16 precision of the exact gelu.
  for (size_t i = 0; i < g.size(); ++i) {
    const double x = g[i], exact = 0.5 * x * (1 + std::tanh(std::sqrt(2 / M_PI) * (x + 0.044715 * x * x * x))) * u[i];
    EXPECT_NEAR(out[i], exact, 2e-3 * std::abs(u[i]) * (1 + std::abs(x))) << x;
  }
  // In place, as the FFN ops call it.
  std::vector<float> g2 = g;
  cpu::glu(Activation::GeluTanh, g2.data(), u.data(), g2.data(), static_cast<int64_t>(g2.size()));
  EXPECT_EQ(g2, out);
}

TEST(Gemma4Ops, Softcap) {
  std::vector<float> x = {0.0f, 1.0f, -5.0f, 29.0f, 100.0f, -1000.0f};
  std::vector<float> y = x;
  cpu::softcap(y.data(), static_cast<int64_t>(y.size()), 30.0f);
  for (size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(y[i], std::tanh(x[i] / 30.0) * 30.0, 1e-5);
  EXPECT_LT(y[4], 30.0f);
}

TEST(Gemma4Ops, RopeWithFreqFactorsDividesTheAngle) {
  const int n_rot = 32, hd = 32, heads = 2, T = 5, pos0 = 7;
  std::vector<float> ff(n_rot / 2);
  for (int i = 0; i < n_rot / 2; ++i) ff[i] = i < 4 ? 1.0f : (i < 8 ? 2.5f : 1e30f);
  std::mt19937 rng(2);
  std::normal_distribution<float> nd;
  std::vector<float> x(static_cast<size_t>(T) * heads * hd);
  for (float& v : x) v = nd(rng);
  std::vector<float> y = x;
  const RopeParams rp = make_rope_params(n_rot, 1e6f, 1.0f, 0.0f, 1.0f, 32.0f, 1.0f, 4096);
  cpu::rope_neox(y.data(), T, heads, hd, heads * hd, n_rot, pos0, rp, ff.data());
  for (int t = 0; t < T; ++t)
    for (int h = 0; h < heads; ++h)
      for (int i = 0; i < n_rot / 2; ++i) {
        const double th = (pos0 + t) * std::pow(1e6, -2.0 * i / n_rot) / ff[i];
        const float* a = x.data() + (t * heads + h) * hd;
        const float* b = y.data() + (t * heads + h) * hd;
        EXPECT_NEAR(b[i], a[i] * std::cos(th) - a[i + n_rot / 2] * std::sin(th), 2e-5);
        EXPECT_NEAR(b[i + n_rot / 2], a[i] * std::sin(th) + a[i + n_rot / 2] * std::cos(th), 2e-5);
        if (ff[i] > 1e29f) {
          EXPECT_EQ(b[i], a[i]);  // unrotated pairs
        }
      }
}

// Windowed causal attention, in double, over every position's K and V.
std::vector<float> attention_scalar(const std::vector<float>& q, const std::vector<float>& K, const std::vector<float>& V,
                                    int pos0, int T, int n_head, int n_kv, int hd, int window) {
  std::vector<float> out(static_cast<size_t>(T) * n_head * hd);
  const int group = n_head / n_kv;
  for (int t = 0; t < T; ++t)
    for (int h = 0; h < n_head; ++h) {
      const int p = pos0 + t, g = h / group;
      const int lo = window > 0 ? std::max(0, p - window + 1) : 0;
      std::vector<double> s;
      double mx = -1e300;
      for (int j = lo; j <= p; ++j) {
        double d = 0;
        for (int i = 0; i < hd; ++i) d += double(q[(t * n_head + h) * hd + i]) * K[(j * n_kv + g) * hd + i];
        s.push_back(d);
        mx = std::max(mx, d);
      }
      double sum = 0;
      for (double& v : s) sum += (v = std::exp(v - mx));
      for (int i = 0; i < hd; ++i) {
        double o = 0;
        for (int j = lo; j <= p; ++j) o += s[j - lo] / sum * V[(j * n_kv + g) * hd + i];
        out[(t * n_head + h) * hd + i] = static_cast<float>(o);
      }
    }
  return out;
}

TEST(Gemma4Ops, WindowedAttentionOverPlainAndRingCaches) {
  const int n_head = 4, n_kv = 2, hd = 16, window = 5, kw = n_kv * hd;
  const std::vector<int> chunks = {3, 1, 1, 7, 1, 2, 6, 1, 1, 4, 7, 1, 1, 1};
  int total = 0, max_chunk = 0;
  for (int c : chunks) total += c, max_chunk = std::max(max_chunk, c);
  const int ring_cap = window - 1 + max_chunk;  // the least a ring may hold
  ThreadPool pool(3);
  cpu::Scratch scratch;
  std::vector<uint8_t> lk(static_cast<size_t>(total) * kw * 4), lv(lk.size());
  std::vector<uint8_t> rk(static_cast<size_t>(ring_cap) * kw * 4), rv(rk.size());
  const cpu::KvView plain{DType::F32, lk.data(), lv.data(), total, kw * 4, false};
  const cpu::KvView ring{DType::F32, rk.data(), rv.data(), ring_cap, kw * 4, true};
  std::mt19937 rng(3);
  std::normal_distribution<float> nd;
  std::vector<float> K, V;
  int pos0 = 0;
  for (int T : chunks) {
    std::vector<float> q(static_cast<size_t>(T) * n_head * hd), k(static_cast<size_t>(T) * kw), v(k.size());
    for (float& x : q) x = nd(rng);
    for (float& x : k) x = nd(rng);
    for (float& x : v) x = nd(rng);
    K.insert(K.end(), k.begin(), k.end());
    V.insert(V.end(), v.begin(), v.end());
    cpu::kv_store(plain, pos0, T, k.data(), kw, v.data(), kw, kw, kw);
    cpu::kv_store(ring, pos0, T, k.data(), kw, v.data(), kw, kw, kw);
    // Positions no query of this chunk may see are poisoned in the plain cache: a read would give NaN.
    const float nan = std::nanf("");
    for (int p = 0; p < pos0 - window + 1; ++p)
      for (int i = 0; i < kw; ++i) {
        std::memcpy(lk.data() + (static_cast<size_t>(p) * kw + i) * 4, &nan, 4);
        std::memcpy(lv.data() + (static_cast<size_t>(i) * total + p) * 4, &nan, 4);
      }
    const auto want = attention_scalar(q, K, V, pos0, T, n_head, n_kv, hd, window);
    for (const cpu::KvView* kv : {&plain, &ring}) {
      std::vector<float> got(want.size());
      cpu::attention(pool, q.data(), n_head * hd, *kv, pos0, T, n_head, n_kv, hd, hd, 1.0f, got.data(), n_head * hd,
                     scratch, 0, window);
      for (size_t i = 0; i < want.size(); ++i)
        ASSERT_NEAR(got[i], want[i], 1e-4) << (kv->ring ? "ring" : "plain") << " pos0 " << pos0 << " i " << i;
    }
    pos0 += T;
  }
  // A ring too small for a chunk's windows is refused, not read wrongly.
  std::vector<float> q(static_cast<size_t>(max_chunk + 1) * n_head * hd), out(q.size());
  const cpu::KvView small{DType::F32, rk.data(), rv.data(), ring_cap - 1, kw * 4, true};
  EXPECT_THROW(cpu::attention(pool, q.data(), n_head * hd, small, pos0, max_chunk, n_head, n_kv, hd, hd, 1.0f,
                              out.data(), n_head * hd, scratch, 0, window),
               std::exception);
}

Weight f32_weight(std::vector<float>& mem, int64_t cols, int64_t rows, int64_t experts) {
  Weight w;
  w.type = DType::F32;
  w.ne[0] = cols, w.ne[1] = rows, w.ne[2] = experts;
  w.row_bytes = static_cast<size_t>(cols) * 4;
  w.host = reinterpret_cast<const uint8_t*>(mem.data());
  return w;
}

TEST(Gemma4Ops, FusedGateUpGegluExpertsMatchScalar) {
  const int E = 64, F = 24, X = 4, k = 2, T = 5;
  std::mt19937 rng(4);
  std::normal_distribution<float> nd(0.0f, 0.3f);
  std::vector<float> gu(static_cast<size_t>(X) * 2 * F * E), down(static_cast<size_t>(X) * E * F), x(static_cast<size_t>(T) * E);
  for (float& v : gu) v = nd(rng);
  for (float& v : down) v = nd(rng);
  for (float& v : x) v = 3 * nd(rng);
  // The same matrices split into gate and up stacks.
  std::vector<float> g(static_cast<size_t>(X) * F * E), u(g.size());
  for (int e = 0; e < X; ++e)
    for (int r = 0; r < F; ++r)
      for (int c = 0; c < E; ++c) {
        g[(static_cast<size_t>(e) * F + r) * E + c] = gu[(static_cast<size_t>(e) * 2 * F + r) * E + c];
        u[(static_cast<size_t>(e) * F + r) * E + c] = gu[(static_cast<size_t>(e) * 2 * F + F + r) * E + c];
      }
  cpu::ExpertWeights fused, split;
  fused.gate_up = f32_weight(gu, E, 2 * F, X);
  fused.down = split.down = f32_weight(down, F, E, X);
  split.gate = f32_weight(g, E, F, X);
  split.up = f32_weight(u, E, F, X);
  const std::vector<int32_t> experts = {0, 3, 1, 3, 2, 0, 3, 1, 0, 2};
  const std::vector<float> weights = {0.7f, 0.3f, 0.5f, 0.5f, 0.9f, 0.1f, 0.6f, 0.4f, 0.2f, 0.8f};
  ThreadPool pool(2);
  cpu::Scratch s1, s2;
  std::vector<float> a(static_cast<size_t>(T) * E), b(a.size());
  cpu::moe_ffn(pool, fused, x.data(), T, E, experts.data(), weights.data(), k, a.data(), s1, Activation::GeluTanh);
  cpu::moe_ffn(pool, split, x.data(), T, E, experts.data(), weights.data(), k, b.data(), s2, Activation::GeluTanh);
  EXPECT_EQ(a, b);
  for (int t = 0; t < T; ++t)
    for (int o = 0; o < E; ++o) {
      double want = 0;
      for (int j = 0; j < k; ++j) {
        const int e = experts[t * k + j];
        double d = 0;
        for (int r = 0; r < F; ++r) {
          double gs = 0, us = 0;
          for (int c = 0; c < E; ++c) {
            gs += double(g[(static_cast<size_t>(e) * F + r) * E + c]) * x[t * E + c];
            us += double(u[(static_cast<size_t>(e) * F + r) * E + c]) * x[t * E + c];
          }
          d += double(down[(static_cast<size_t>(e) * E + o) * F + r]) * geglu_scalar(float(gs), float(us));
        }
        want += weights[t * k + j] * d;
      }
      EXPECT_NEAR(a[t * E + o], want, 1e-3 * (1 + std::abs(want))) << t << " " << o;
    }
}

}  // namespace
