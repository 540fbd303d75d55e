// The qwen35 CPU ops (src/runtime/cpu_deltanet) against plain scalar references in double on fresh
// random inputs, and the properties the forward pass relies on (a batch split in two carries the
// same state; IMRoPE without e pairs is NeoX RoPE bit for bit).
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "runtime/cpu_deltanet.h"
#include "runtime/cpu_ops.h"
#include "runtime/thread_pool.h"

using namespace fitmoe;

namespace {

std::vector<float> randn(size_t n, uint64_t seed, float sd = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, sd);
  std::vector<float> v(n);
  for (auto& x : v) x = nd(rng);
  return v;
}

double max_abs_diff(const std::vector<float>& a, const std::vector<double>& b) {
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::abs(static_cast<double>(a[i]) - b[i]));
  return m;
}

// The section rule written out per pair; positions t = h = w = p, e = 0.
TEST(Qwen35CpuOps, RopeMultiMatchesScalarReference) {
  const int T = 5, H = 3, hd = 32, n_rot = 16, pos0 = 7;
  const float base = 1e7f;
  for (auto sec : {std::vector<int>{3, 3, 2, 0}, std::vector<int>{2, 1, 1, 2}, std::vector<int>{1, 0, 0, 3}}) {
    auto x = randn(static_cast<size_t>(T) * H * hd, 11);
    std::vector<double> ref(x.begin(), x.end());
    const int S = sec[0] + sec[1] + sec[2] + sec[3];
    for (int t = 0; t < T; ++t)
      for (int h = 0; h < H; ++h)
        for (int i = 0; i < n_rot / 2; ++i) {
          const int s = i % S;
          const bool e = !((s % 3 == 1 && s < 3 * sec[1]) || (s % 3 == 2 && s < 3 * sec[2]) || (s % 3 == 0 && s < 3 * sec[0]));
          const double p = e ? 0.0 : pos0 + t;
          const double th = p * std::pow(static_cast<double>(base), -2.0 * i / n_rot);
          double* v = ref.data() + (static_cast<size_t>(t) * H + h) * hd;
          const double x0 = v[i], x1 = v[i + n_rot / 2];
          v[i] = x0 * std::cos(th) - x1 * std::sin(th);
          v[i + n_rot / 2] = x0 * std::sin(th) + x1 * std::cos(th);
        }
    const int sections[4] = {sec[0], sec[1], sec[2], sec[3]};
    RopeParams rp;
    rp.base = base;
    cpu::rope_multi(x.data(), T, H, hd, H * hd, n_rot, sections, pos0, rp);
    EXPECT_LE(max_abs_diff(x, ref), 2e-5) << sec[0] << sec[1] << sec[2] << sec[3];
  }
}

TEST(Qwen35CpuOps, RopeMultiWithoutEPairsIsNeoxBitForBit) {
  const int T = 4, H = 2, hd = 64, n_rot = 16;
  auto a = randn(static_cast<size_t>(T) * H * hd, 12);
  auto b = a;
  const int sections[4] = {3, 3, 2, 0};  // the tiny fixture's: no pair falls in e
  RopeParams rp;
  rp.base = 1e7f;
  cpu::rope_multi(a.data(), T, H, hd, H * hd, n_rot, sections, 3, rp);
  cpu::rope_neox(b.data(), T, H, hd, H * hd, n_rot, 3, rp);
  EXPECT_EQ(a, b);
}

TEST(Qwen35CpuOps, Conv1dSiluMatchesScalarAndCarriesState) {
  ThreadPool pool(2);
  const int T = 7, C = 150, K = 4;
  auto x = randn(static_cast<size_t>(T) * C, 21), w = randn(static_cast<size_t>(C) * K, 22, 0.5f);
  auto st0 = randn(static_cast<size_t>(C) * (K - 1), 23);
  std::vector<double> ref(static_cast<size_t>(T) * C);
  for (int c = 0; c < C; ++c)
    for (int t = 0; t < T; ++t) {
      double s = 0;
      for (int j = 0; j < K; ++j) {
        const int src = t + j - (K - 1);  // < 0: from the state
        const double in = src < 0 ? st0[static_cast<size_t>(c) * (K - 1) + (K - 1 + src)] : x[static_cast<size_t>(src) * C + c];
        s += in * w[static_cast<size_t>(c) * K + j];
      }
      ref[static_cast<size_t>(t) * C + c] = s / (1.0 + std::exp(-s));
    }
  auto st = st0;
  std::vector<float> out(static_cast<size_t>(T) * C);
  cpu::conv1d_silu(pool, x.data(), C, T, C, w.data(), K, st.data(), out.data(), C);
  EXPECT_LE(max_abs_diff(out, ref), 1e-5);
  for (int c = 0; c < C; ++c)
    for (int j = 0; j < K - 1; ++j) EXPECT_EQ(st[static_cast<size_t>(c) * (K - 1) + j], x[static_cast<size_t>(T - (K - 1) + j) * C + c]);
  // The same inputs in two batches (3 + 4 tokens): the state carries over, the bits agree.
  auto st2 = st0;
  std::vector<float> out2(out.size());
  cpu::conv1d_silu(pool, x.data(), C, 3, C, w.data(), K, st2.data(), out2.data(), C);
  cpu::conv1d_silu(pool, x.data() + 3 * C, C, T - 3, C, w.data(), K, st2.data(), out2.data() + 3 * C, C);
  EXPECT_EQ(out, out2);
  EXPECT_EQ(st, st2);
}

TEST(Qwen35CpuOps, L2NormMatchesScalar) {
  const int n = 64, rows = 5;
  auto x = randn(static_cast<size_t>(n) * rows, 31, 3.0f);
  std::vector<double> ref(x.size());
  for (int r = 0; r < rows; ++r) {
    double s = 0;
    for (int i = 0; i < n; ++i) s += static_cast<double>(x[r * n + i]) * x[r * n + i];
    for (int i = 0; i < n; ++i) ref[r * n + i] = x[r * n + i] / std::sqrt(s);
  }
  cpu::l2_norm(x.data(), n, rows, n, 1e-6f);
  EXPECT_LE(max_abs_diff(x, ref), 1e-6);
  std::vector<float> z(8, 0.0f);
  cpu::l2_norm(z.data(), 8, 1, 8, 1e-6f);  // max(norm, eps): zeros stay zeros, no NaN
  for (float v : z) EXPECT_EQ(v, 0.0f);
}

TEST(Qwen35CpuOps, GatedDeltaNetMatchesScalarRecurrence) {
  ThreadPool pool(3);
  DeltaSpec d{2, 6, 16, 16, 4};  // 3 value heads per key head; value head h uses key head h % 2
  const int T = 9, kd = d.key_dim(), vd = d.value_dim(), Hv = d.n_v_heads, dk = d.head_k_dim, dv = d.head_v_dim;
  auto q = randn(static_cast<size_t>(T) * kd, 41), k = randn(static_cast<size_t>(T) * kd, 42), v = randn(static_cast<size_t>(T) * vd, 43);
  for (int t = 0; t < T; ++t) {  // L2-normalised, as the layer feeds them
    cpu::l2_norm(q.data() + t * kd, dk, d.n_k_heads, dk, 1e-6f);
    cpu::l2_norm(k.data() + t * kd, dk, d.n_k_heads, dk, 1e-6f);
  }
  auto graw = randn(static_cast<size_t>(T) * Hv, 44), braw = randn(static_cast<size_t>(T) * Hv, 45);
  std::vector<float> g(graw.size()), beta(braw.size());
  for (size_t i = 0; i < g.size(); ++i) {
    g[i] = -cpu::softplus(graw[i]);
    beta[i] = cpu::sigmoid(braw[i]);
  }
  auto s0 = randn(static_cast<size_t>(d.delta_state_floats()), 46, 0.1f);
  // Reference in double: S_h = exp(g) S_h + beta (v - exp(g) S_h k) k^T ; o = S_h q / sqrt(dk).
  std::vector<double> S(s0.begin(), s0.end()), ref(static_cast<size_t>(T) * vd);
  for (int t = 0; t < T; ++t)
    for (int h = 0; h < Hv; ++h) {
      const int kh = h % d.n_k_heads;
      double* Sh = S.data() + static_cast<size_t>(h) * dv * dk;
      const float* qq = q.data() + t * kd + kh * dk;
      const float* kk = k.data() + t * kd + kh * dk;
      for (int j = 0; j < dv; ++j) {
        double sk = 0;
        for (int i = 0; i < dk; ++i) {
          Sh[j * dk + i] *= std::exp(static_cast<double>(g[t * Hv + h]));
          sk += Sh[j * dk + i] * kk[i];
        }
        const double delta = (v[t * vd + h * dv + j] - sk) * beta[t * Hv + h];
        double o = 0;
        for (int i = 0; i < dk; ++i) {
          Sh[j * dk + i] += kk[i] * delta;
          o += Sh[j * dk + i] * qq[i];
        }
        ref[t * vd + h * dv + j] = o / std::sqrt(static_cast<double>(dk));
      }
    }
  auto st = s0;
  std::vector<float> out(static_cast<size_t>(T) * vd);
  cpu::gated_delta_net(pool, d, T, q.data(), k.data(), kd, v.data(), vd, g.data(), beta.data(), st.data(), out.data(), vd);
  EXPECT_LE(max_abs_diff(out, ref), 1e-5);
  EXPECT_LE(max_abs_diff(st, S), 1e-5);
  // Token by token (decode) gives the same bits as the batch (prefill).
  auto st1 = s0;
  std::vector<float> out1(out.size());
  for (int t = 0; t < T; ++t)
    cpu::gated_delta_net(pool, d, 1, q.data() + t * kd, k.data() + t * kd, kd, v.data() + t * vd, vd, g.data() + t * Hv,
                         beta.data() + t * Hv, st1.data(), out1.data() + t * vd, vd);
  EXPECT_EQ(out, out1);
  EXPECT_EQ(st, st1);
}

TEST(Qwen35CpuOps, GatedRmsNormMatchesScalar) {
  const int n = 32, rows = 6;
  auto x = randn(static_cast<size_t>(n) * rows, 51), z = randn(x.size(), 52), w = randn(n, 53);
  std::vector<double> ref(x.size());
  for (int r = 0; r < rows; ++r) {
    double s = 0;
    for (int i = 0; i < n; ++i) s += static_cast<double>(x[r * n + i]) * x[r * n + i];
    const double sc = 1.0 / std::sqrt(s / n + 1e-6);
    for (int i = 0; i < n; ++i) {
      const double zz = z[r * n + i];
      ref[r * n + i] = x[r * n + i] * sc * w[i] * zz / (1.0 + std::exp(-zz));
    }
  }
  std::vector<float> y(x.size());
  cpu::gated_rms_norm(x.data(), w.data(), z.data(), y.data(), n, rows, 1e-6f);
  EXPECT_LE(max_abs_diff(y, ref), 1e-5);
  cpu::gated_rms_norm(x.data(), w.data(), z.data(), x.data(), n, rows, 1e-6f);  // in place
  EXPECT_EQ(x, y);
}

TEST(Qwen35CpuOps, ActivationsMatchScalar) {
  for (float v : {-30.0f, -5.0f, -0.5f, 0.0f, 0.7f, 19.0f, 21.0f, 60.0f}) {
    EXPECT_NEAR(cpu::sigmoid(v), 1.0 / (1.0 + std::exp(-static_cast<double>(v))), 1e-7);
    EXPECT_NEAR(cpu::softplus(v), std::log1p(std::exp(static_cast<double>(v))), 2e-6 * std::max(1.0f, std::abs(v)));
  }
  std::vector<float> x = {1, 2, -3}, gate = {0, 10, -2};
  cpu::mul_sigmoid(x.data(), gate.data(), 3);
  EXPECT_FLOAT_EQ(x[0], 0.5f);
  EXPECT_NEAR(x[1], 2.0 / (1.0 + std::exp(-10.0)), 1e-6);
  EXPECT_NEAR(x[2], -3.0 / (1.0 + std::exp(2.0)), 1e-6);
}

}  // namespace
