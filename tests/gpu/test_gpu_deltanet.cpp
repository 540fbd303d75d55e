// The qwen35 GPU ops (src/cuda/deltanet.h) against the CPU ops (src/runtime/cpu_deltanet) on fresh
// random inputs, at the qwen35moe-tiny shape (DeltaNet: 2 key / 4 value heads x 64, conv 4; attention
// 4 / 1 heads x 64, 16 rotated dims, sections [3, 3, 2, 0]) and the 35B-A3B shape (16 / 32 x 128,
// conv 4; attention 16 / 2 x 256, 64 rotated dims, sections [11, 11, 10, 0]): the conv and its state,
// the L2 norms, the delta rule (fused gates and norms or not; its state to f32 reordering, and a wrong
// decay must be caught), the gated RMSNorm, the attention prologue with its cache store, the output
// gate and the shared expert's gate. A prefill batch of n tokens must give the very bits of n one-token
// calls. Output buffers are poisoned (NaN) first. Skipped without a CUDA device.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "cuda/deltanet.h"
#include "cuda/gpu_ops.h"
#include "gpu/gpu_test_util.h"
#include "model/layer_spec.h"
#include "quant/dtype.h"
#include "runtime/cpu_deltanet.h"
#include "runtime/cpu_ops.h"
#include "runtime/rope.h"
#include "runtime/thread_pool.h"

namespace fitmoe::gpu {
namespace {

using namespace test;

class GpuDeltaNet : public GpuTest {
 protected:
  ThreadPool pool{2};
};

struct DeltaShape {
  const char* name;
  DeltaSpec d;
};
const DeltaShape kDeltaShapes[] = {
    {"tiny", DeltaSpec{2, 4, 64, 64, 4}},
    {"35b", DeltaSpec{16, 32, 128, 128, 4}},
};

struct AttnShape {
  const char* name;
  AttnSpec a;
  float base;
};
AttnSpec attn_spec(int nh, int nkv, int hd, int n_rot, std::initializer_list<int> sec) {
  AttnSpec a;
  a.n_head = nh;
  a.n_head_kv = nkv;
  a.head_dim = hd;
  a.head_dim_v = hd;
  a.n_rot = n_rot;
  int i = 0;
  for (int s : sec) a.rope_sections[i++] = s;
  a.q_gate = true;
  a.scale = 1.0f / std::sqrt(static_cast<float>(hd));
  return a;
}

constexpr float kEps = 1e-6f;

// Worst |got - want| over max |want| (NaN anywhere: infinity).
double rel_err(const float* got, const float* want, size_t n) {
  double m = 0, e = 0;
  for (size_t i = 0; i < n; ++i) {
    if (!std::isfinite(got[i]) || !std::isfinite(want[i])) return INFINITY;
    m = std::max(m, static_cast<double>(std::fabs(want[i])));
    e = std::max(e, static_cast<double>(std::fabs(got[i] - want[i])));
  }
  return m > 0 ? e / m : e;
}
double rel_err(const std::vector<float>& got, const std::vector<float>& want) {
  EXPECT_EQ(got.size(), want.size());
  return rel_err(got.data(), want.data(), std::min(got.size(), want.size()));
}
// The worst of rel_err per block of `block` values (e.g. per head's state, each at its own scale).
double rel_err_blocks(const std::vector<float>& got, const std::vector<float>& want, size_t block) {
  double w = 0;
  for (size_t b = 0; b + block <= want.size(); b += block) w = std::max(w, rel_err(got.data() + b, want.data() + b, block));
  return w;
}
// Worst elementwise |got - want| / (|want| + floor).
double elem_err(const std::vector<float>& got, const std::vector<float>& want, double floor) {
  double e = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (!std::isfinite(got[i])) return INFINITY;
    e = std::max(e, std::fabs(static_cast<double>(got[i]) - want[i]) / (std::fabs(want[i]) + floor));
  }
  return e;
}
// The delta rule's outputs [T][Hv][dv]: per value head, the worst |got - want| over that head's largest
// |want| across all tokens. (One token's outputs S_j . q can be small beside the state they come from,
// where the state's f32 reordering, ~1e-7 of it, is a larger part of them; the head's scale over the
// batch is the state's.)
double out_err(const std::vector<float>& got, const std::vector<float>& want, int Hv, int dv) {
  if (got.size() != want.size()) return INFINITY;
  const size_t T = want.size() / (static_cast<size_t>(Hv) * dv);
  double worst = 0;
  for (int h = 0; h < Hv; ++h) {
    double m = 0, e = 0;
    for (size_t t = 0; t < T; ++t)
      for (int j = 0; j < dv; ++j) {
        const size_t i = (t * Hv + h) * dv + j;
        if (!std::isfinite(got[i])) return INFINITY;
        m = std::max(m, static_cast<double>(std::fabs(want[i])));
        e = std::max(e, static_cast<double>(std::fabs(got[i] - want[i])));
      }
    worst = std::max(worst, m > 0 ? e / m : e);
  }
  return worst;
}
bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// ---- conv1d + SiLU ---------------------------------------------------------------------------------

TEST_F(GpuDeltaNet, Conv1dSiluMatchesTheCpu) {
  for (const DeltaShape& sh : kDeltaShapes) {
    const int ch = sh.d.conv_channels(), K = sh.d.conv_kernel, keep = K - 1;
    for (int T : {1, 2, 5, 64, 65, 130}) {
      const int64_t ld_x = ch + 3, ld_o = ch + 5;
      auto x = randn(static_cast<size_t>(T) * ld_x, 100 + T);
      auto w = randn(static_cast<size_t>(ch) * K, 7, 0.5f);
      auto st = randn(static_cast<size_t>(ch) * keep, 9 + T);
      auto dx = upload(x), dw = upload(w), dst = upload(st);
      Dev dout(static_cast<size_t>(T) * ld_o * 4);
      delta_conv1d_silu(dx->as<float>(), ld_x, T, ch, dw->as<float>(), K, dst->as<float>(), dout.as<float>(), ld_o, s());
      sync();
      auto got = dout.down<float>(static_cast<size_t>(T) * ld_o);
      auto got_st = dst->down<float>(st.size());
      std::vector<float> ref(static_cast<size_t>(T) * ld_o, 0.0f), ref_st = st;
      cpu::conv1d_silu(pool, x.data(), ld_x, T, ch, w.data(), K, ref_st.data(), ref.data(), ld_o);
      std::vector<float> g2, r2;  // the written columns only (the gaps stay poisoned)
      int poisoned = 0;
      for (int t = 0; t < T; ++t) {
        for (int c = 0; c < ch; ++c) {
          g2.push_back(got[t * ld_o + c]);
          r2.push_back(ref[t * ld_o + c]);
        }
        for (int c = ch; c < ld_o; ++c) poisoned += is_poison(got[t * ld_o + c]);
      }
      EXPECT_EQ(poisoned, T * (ld_o - ch)) << sh.name << " T " << T << ": wrote outside the rows";
      // The same sum term by term; only SiLU's expf may differ by an ulp or two.
      EXPECT_LE(elem_err(g2, r2, 1e-6), 1e-6) << sh.name << " T " << T;
      EXPECT_TRUE(same_bits(got_st, ref_st)) << sh.name << " T " << T << ": conv state";
    }
  }
}

TEST_F(GpuDeltaNet, Conv1dPrefillEqualsDecodeSteps) {
  const DeltaSpec d = kDeltaShapes[1].d;
  const int ch = d.conv_channels(), K = d.conv_kernel, T = 130;
  auto x = randn(static_cast<size_t>(T) * ch, 21);
  auto w = randn(static_cast<size_t>(ch) * K, 22, 0.5f);
  auto st = randn(static_cast<size_t>(ch) * (K - 1), 23);
  auto dx = upload(x), dw = upload(w), dst1 = upload(st), dst2 = upload(st);
  Dev o1(static_cast<size_t>(T) * ch * 4), o2(static_cast<size_t>(T) * ch * 4);
  delta_conv1d_silu(dx->as<float>(), ch, T, ch, dw->as<float>(), K, dst1->as<float>(), o1.as<float>(), ch, s());
  for (int t = 0; t < T; ++t)
    delta_conv1d_silu(dx->as<float>() + static_cast<int64_t>(t) * ch, ch, 1, ch, dw->as<float>(), K, dst2->as<float>(),
                      o2.as<float>() + static_cast<int64_t>(t) * ch, ch, s());
  sync();
  EXPECT_TRUE(same_bits(o1.down<float>(static_cast<size_t>(T) * ch), o2.down<float>(static_cast<size_t>(T) * ch)));
  EXPECT_TRUE(same_bits(dst1->down<float>(st.size()), dst2->down<float>(st.size())));
}

// ---- L2 norm, gated RMSNorm, sigmoid gate, shared expert --------------------------------------------

TEST_F(GpuDeltaNet, L2NormMatchesTheCpu) {
  for (const DeltaShape& sh : kDeltaShapes) {
    const int ch = sh.d.conv_channels(), dk = sh.d.head_k_dim, nh = 2 * sh.d.n_k_heads;
    for (int T : {1, 9}) {
      auto x = randn(static_cast<size_t>(T) * ch, 31 + T, 3.0f);
      auto dx = upload(x);
      delta_l2_norm(dx->as<float>(), ch, T, nh, dk, kEps, s());
      sync();
      auto got = dx->down<float>(x.size());
      auto ref = x;
      for (int t = 0; t < T; ++t) cpu::l2_norm(ref.data() + static_cast<int64_t>(t) * ch, dk, nh, dk, kEps);
      EXPECT_LE(elem_err(got, ref, 1e-30), 1e-6) << sh.name << " T " << T;
      // The v part is untouched.
      for (int t = 0; t < T; ++t)
        for (int c = nh * dk; c < ch; ++c) ASSERT_EQ(bits(got[t * ch + c]), bits(x[t * ch + c]));
    }
  }
}

TEST_F(GpuDeltaNet, GatedRmsNormMatchesTheCpu) {
  for (const DeltaShape& sh : kDeltaShapes) {
    const int n = sh.d.head_v_dim, Hv = sh.d.n_v_heads;
    for (int T : {1, 7}) {
      const int rows = T * Hv;
      auto x = randn(static_cast<size_t>(rows) * n, 41 + T, 2.0f);
      auto z = randn(x.size(), 42 + T, 2.0f);
      auto w = randn(static_cast<size_t>(n), 43, 0.3f);
      for (auto& v : w) v += 1.0f;
      std::vector<float> ref(x.size());
      cpu::gated_rms_norm(x.data(), w.data(), z.data(), ref.data(), n, rows, kEps);
      auto dx = upload(x), dz = upload(z), dw = upload(w);
      Dev dy(x.size() * 4);
      delta_gated_rms_norm(dx->as<float>(), dw->as<float>(), dz->as<float>(), dy.as<float>(), n, rows, kEps, s());
      delta_gated_rms_norm(dx->as<float>(), dw->as<float>(), dz->as<float>(), dx->as<float>(), n, rows, kEps, s());  // in place
      sync();
      EXPECT_LE(elem_err(dy.down<float>(x.size()), ref, 1e-6), 1e-6) << sh.name << " T " << T;
      EXPECT_TRUE(same_bits(dx->down<float>(x.size()), dy.down<float>(x.size()))) << sh.name << " in place";
    }
  }
}

TEST_F(GpuDeltaNet, MulSigmoidMatchesTheCpu) {
  const int64_t n = 3 * 16 * 256 + 17;
  auto x = randn(n, 51, 2.0f), g = randn(n, 52, 4.0f);
  auto dx = upload(x), dg = upload(g);
  delta_mul_sigmoid(dx->as<float>(), dg->as<float>(), n, s());
  sync();
  auto ref = x;
  cpu::mul_sigmoid(ref.data(), g.data(), n);
  EXPECT_LE(elem_err(dx->down<float>(n), ref, 1e-6), 1e-6);
}

TEST_F(GpuDeltaNet, SharedExpertGateMatchesTheCpu) {
  for (int E : {256, 2048}) {
    const int T = 5;
    auto y = randn(static_cast<size_t>(T) * E, 61), ys = randn(y.size(), 62);
    auto xn = randn(y.size(), 63), w = randn(static_cast<size_t>(E), 64, 1.0f / std::sqrt(static_cast<float>(E)));
    std::vector<float> logit(T), ref = y;
    for (int t = 0; t < T; ++t) {
      double dot = 0;
      for (int i = 0; i < E; ++i) dot += static_cast<double>(w[i]) * xn[static_cast<size_t>(t) * E + i];
      logit[t] = static_cast<float>(dot);
      const float sg = cpu::sigmoid(logit[t]);
      for (int i = 0; i < E; ++i) ref[static_cast<size_t>(t) * E + i] += ys[static_cast<size_t>(t) * E + i] * sg;
    }
    auto dy = upload(y), dy2 = upload(y), dys = upload(ys), dxn = upload(xn), dw = upload(w), dl = upload(logit);
    shared_expert_gate_add(dy->as<float>(), dys->as<float>(), dw->as<float>(), dxn->as<float>(), nullptr, E, T, s());
    shared_expert_gate_add(dy2->as<float>(), dys->as<float>(), nullptr, nullptr, dl->as<float>(), E, T, s());
    sync();
    // The gate's f32 dot product against a double one: a few ulps of the logit.
    EXPECT_LE(rel_err(dy->down<float>(y.size()), ref), 2e-6) << "E " << E;
    EXPECT_LE(rel_err(dy2->down<float>(y.size()), ref), 1e-6) << "E " << E << " (logits given)";
  }
}

// ---- the gated delta rule --------------------------------------------------------------------------

struct DeltaInputs {
  int T;
  std::vector<float> co;          // [T][ch]: raw q | k | v (q, k not normalised)
  std::vector<float> co_n;        // the same with q, k L2-normalised (cpu::l2_norm)
  std::vector<float> a, b;        // raw gate projections [T][Hv]
  std::vector<float> dt, A;       // [Hv]
  std::vector<float> g, beta;     // the gates as the CPU forward pass forms them
  std::vector<float> state;       // [Hv][dv][dk]
};
DeltaInputs delta_inputs(const DeltaSpec& d, int T, uint64_t seed) {
  DeltaInputs in;
  in.T = T;
  const int ch = d.conv_channels(), Hv = d.n_v_heads, kd = d.key_dim();
  in.co = randn(static_cast<size_t>(T) * ch, seed);
  in.co_n = in.co;
  for (int t = 0; t < T; ++t) {
    float* row = in.co_n.data() + static_cast<int64_t>(t) * ch;
    cpu::l2_norm(row, d.head_k_dim, d.n_k_heads, d.head_k_dim, kEps);
    cpu::l2_norm(row + kd, d.head_k_dim, d.n_k_heads, d.head_k_dim, kEps);
  }
  in.a = randn(static_cast<size_t>(T) * Hv, seed + 1);
  in.b = randn(static_cast<size_t>(T) * Hv, seed + 2, 2.0f);
  in.dt = randn(Hv, seed + 3, 0.5f);
  in.A = randn(Hv, seed + 4, 0.5f);
  for (auto& v : in.A) v = -std::exp(v);
  in.g.resize(in.a.size());
  in.beta.resize(in.b.size());
  for (int t = 0; t < T; ++t)
    for (int h = 0; h < Hv; ++h) {
      const size_t i = static_cast<size_t>(t) * Hv + h;
      in.beta[i] = cpu::sigmoid(in.b[i]);
      in.g[i] = cpu::softplus(in.a[i] + in.dt[h]) * in.A[h];
    }
  in.state = randn(static_cast<size_t>(d.delta_state_floats()), seed + 5, 0.3f);
  return in;
}

// The CPU's result: out [T][vd] and the state after.
void delta_ref(ThreadPool& pool, const DeltaSpec& d, const DeltaInputs& in, const std::vector<float>& g,
               std::vector<float>& out, std::vector<float>& state) {
  const int ch = d.conv_channels(), kd = d.key_dim();
  out.assign(static_cast<size_t>(in.T) * d.value_dim(), 0.0f);
  state = in.state;
  const float* co = in.co_n.data();
  cpu::gated_delta_net(pool, d, in.T, co, co + kd, ch, co + 2 * kd, ch, g.data(), in.beta.data(), state.data(),
                       out.data(), d.value_dim());
}

// The GPU's: the whole batch in one call (or token by token), with the gates formed in the kernel
// (raw) or given, q / k normalised in the kernel (l2) or before.
void delta_gpu(const DeltaSpec& d, const DeltaInputs& in, bool raw, bool l2, bool steps, Stream s,
               std::vector<float>& out, std::vector<float>& state) {
  const int ch = d.conv_channels(), kd = d.key_dim(), vd = d.value_dim(), Hv = d.n_v_heads;
  auto dco = upload(l2 ? in.co : in.co_n);
  auto dg = upload(raw ? in.a : in.g), db = upload(raw ? in.b : in.beta);
  auto ddt = upload(in.dt), dA = upload(in.A), dst = upload(in.state);
  const int64_t ld_out = vd + 4;
  Dev dout(static_cast<size_t>(in.T) * ld_out * 4);
  const float* co = dco->as<float>();
  auto call = [&](int t0, int n) {
    const int64_t o = static_cast<int64_t>(t0) * ch;
    gated_delta_rule(d, n, co + o, co + o + kd, ch, co + o + 2 * kd, ch, dg->as<float>() + t0 * Hv,
                     db->as<float>() + t0 * Hv, Hv, raw ? ddt->as<float>() : nullptr, raw ? dA->as<float>() : nullptr,
                     l2, kEps, dst->as<float>(), dout.as<float>() + t0 * ld_out, ld_out, s);
  };
  if (steps) {
    for (int t = 0; t < in.T; ++t) call(t, 1);
  } else {
    call(0, in.T);
  }
  ASSERT_EQ(cudaStreamSynchronize(static_cast<cudaStream_t>(s)), cudaSuccess);
  auto o = dout.down<float>(static_cast<size_t>(in.T) * ld_out);
  out.clear();
  for (int t = 0; t < in.T; ++t) {
    out.insert(out.end(), o.begin() + t * ld_out, o.begin() + t * ld_out + vd);
    for (int i = vd; i < ld_out; ++i) ASSERT_TRUE(is_poison(o[t * ld_out + i])) << "wrote outside the rows";
  }
  state = dst->down<float>(in.state.size());
  // The input rows are left as they were (the kernel's L2 norms are its own).
  ASSERT_TRUE(same_bits(dco->down<float>(in.co.size()), l2 ? in.co : in.co_n));
}

constexpr double kStateTol = 1e-5, kOutTol = 1e-5;

TEST_F(GpuDeltaNet, DeltaRuleMatchesTheCpu) {
  for (const DeltaShape& sh : kDeltaShapes) {
    const DeltaSpec& d = sh.d;
    const size_t head = static_cast<size_t>(d.head_v_dim) * d.head_k_dim;
    for (int T : {1, 3, 70}) {
      DeltaInputs in = delta_inputs(d, T, 1000 + T);
      std::vector<float> ref_o, ref_s;
      delta_ref(pool, d, in, in.g, ref_o, ref_s);
      for (int variant = 0; variant < 4; ++variant) {
        const bool raw = variant & 1, l2 = variant & 2;
        std::vector<float> o, st;
        delta_gpu(d, in, raw, l2, false, s(), o, st);
        const double es = rel_err_blocks(st, ref_s, head), eo = out_err(o, ref_o, d.n_v_heads, d.head_v_dim);
        EXPECT_LE(es, kStateTol) << sh.name << " T " << T << " raw " << raw << " l2 " << l2 << ": state";
        EXPECT_LE(eo, kOutTol) << sh.name << " T " << T << " raw " << raw << " l2 " << l2 << ": out";
        if (T == 70 && variant == 3)
          std::printf("  [%s T %d] worst state error %.2e, out %.2e (of the head's largest); per token and head %.2e\n", sh.name, T, es, eo, rel_err_blocks(o, ref_o, d.head_v_dim));
      }
      // The comparison can fail: a decay off by 1% (g + 0.01) is far outside the tolerance.
      std::vector<float> g_wrong = in.g, bad_o, bad_s;
      for (auto& v : g_wrong) v += 0.01f;
      delta_ref(pool, d, in, g_wrong, bad_o, bad_s);
      std::vector<float> o, st;
      delta_gpu(d, in, true, true, false, s(), o, st);
      EXPECT_GT(rel_err_blocks(st, bad_s, head), 100 * kStateTol) << sh.name << " T " << T << ": a wrong decay passes";
    }
  }
}

// A value head reads key head h % n_k_heads (not h / (n_v / n_k)): with the other mapping's inputs
// the result must differ. Shown by swapping key heads so that only the CPU's mapping stays intact.
TEST_F(GpuDeltaNet, DeltaRuleKeyHeadMapping) {
  const DeltaSpec d = kDeltaShapes[0].d;  // 2 key heads, 4 value heads: h % 2 = 0 1 0 1, h / 2 = 0 0 1 1
  DeltaInputs in = delta_inputs(d, 4, 77);
  std::vector<float> ref_o, ref_s, o, st;
  delta_ref(pool, d, in, in.g, ref_o, ref_s);
  delta_gpu(d, in, false, false, false, s(), o, st);
  EXPECT_LE(out_err(o, ref_o, d.n_v_heads, d.head_v_dim), kOutTol);
  // Value head 1 under the CPU's mapping reads key head 1; its output differs from a run where the key
  // heads are swapped, so a kernel reading key head 0 for value head 1 would have failed above.
  DeltaInputs sw = in;
  const int ch = d.conv_channels(), dk = d.head_k_dim, kd = d.key_dim();
  for (int t = 0; t < in.T; ++t)
    for (int part = 0; part < 2; ++part)
      for (int i = 0; i < dk; ++i)
        std::swap(sw.co_n[t * ch + part * kd + i], sw.co_n[t * ch + part * kd + dk + i]);
  std::vector<float> sw_o, sw_s;
  delta_ref(pool, d, sw, sw.g, sw_o, sw_s);
  EXPECT_GT(out_err(o, sw_o, d.n_v_heads, d.head_v_dim), 100 * kOutTol);
}

TEST_F(GpuDeltaNet, DeltaRulePrefillEqualsDecodeSteps) {
  for (const DeltaShape& sh : kDeltaShapes) {
    DeltaInputs in = delta_inputs(sh.d, 40, 555);
    for (int variant = 0; variant < 4; ++variant) {
      const bool raw = variant & 1, l2 = variant & 2;
      std::vector<float> o1, s1, o2, s2;
      delta_gpu(sh.d, in, raw, l2, false, s(), o1, s1);
      delta_gpu(sh.d, in, raw, l2, true, s(), o2, s2);
      EXPECT_TRUE(same_bits(o1, o2)) << sh.name << " variant " << variant << ": outputs";
      EXPECT_TRUE(same_bits(s1, s2)) << sh.name << " variant " << variant << ": state";
    }
  }
}

// A decode layer end to end on the DeltaNet side (conv -> delta rule with fused norms and gates ->
// gated RMSNorm) against the CPU's sequence of ops, over a prefill of 9 tokens then 3 decode steps.
TEST_F(GpuDeltaNet, DeltaNetChainMatchesTheCpu) {
  for (const DeltaShape& sh : kDeltaShapes) {
    const DeltaSpec& d = sh.d;
    const int ch = d.conv_channels(), kd = d.key_dim(), vd = d.value_dim(), Hv = d.n_v_heads, K = d.conv_kernel;
    const int n_total = 12;
    auto qkv = randn(static_cast<size_t>(n_total) * ch, 901);
    auto z = randn(static_cast<size_t>(n_total) * vd, 902);
    auto a = randn(static_cast<size_t>(n_total) * Hv, 903), b = randn(static_cast<size_t>(n_total) * Hv, 904);
    auto w = randn(static_cast<size_t>(ch) * K, 905, 0.5f), dt = randn(Hv, 906, 0.5f), A = randn(Hv, 907, 0.5f);
    for (auto& v : A) v = -std::exp(v);
    auto nw = randn(d.head_v_dim, 908, 0.2f);
    for (auto& v : nw) v += 1.0f;
    std::vector<float> conv_st(static_cast<size_t>(d.conv_state_floats()), 0.0f);
    std::vector<float> dst(static_cast<size_t>(d.delta_state_floats()), 0.0f);
    auto dqkv = upload(qkv), dz = upload(z), da = upload(a), db = upload(b), dw = upload(w), ddt = upload(dt),
         dA = upload(A), dnw = upload(nw), dcs = upload(conv_st), dds = upload(dst);
    Dev dco(static_cast<size_t>(n_total) * ch * 4), dout(static_cast<size_t>(n_total) * vd * 4);
    // CPU state
    std::vector<float> c_cs = conv_st, c_ds = dst, ref_out(static_cast<size_t>(n_total) * vd);
    int t0 = 0;
    for (int T : {9, 1, 1, 1}) {
      // GPU
      const float* x = dqkv->as<float>() + static_cast<int64_t>(t0) * ch;
      float* co = dco.as<float>() + static_cast<int64_t>(t0) * ch;
      float* o = dout.as<float>() + static_cast<int64_t>(t0) * vd;
      delta_conv1d_silu(x, ch, T, ch, dw->as<float>(), K, dcs->as<float>(), co, ch, s());
      gated_delta_rule(d, T, co, co + kd, ch, co + 2 * kd, ch, da->as<float>() + t0 * Hv, db->as<float>() + t0 * Hv, Hv,
                       ddt->as<float>(), dA->as<float>(), true, kEps, dds->as<float>(), o, vd, s());
      delta_gated_rms_norm(o, dnw->as<float>(), dz->as<float>() + static_cast<int64_t>(t0) * vd, o, d.head_v_dim, T * Hv,
                           kEps, s());
      // CPU, as Qwen35's delta_block
      std::vector<float> cco(static_cast<size_t>(T) * ch), g(static_cast<size_t>(T) * Hv), beta(g.size());
      for (int t = 0; t < T; ++t)
        for (int h = 0; h < Hv; ++h) {
          const size_t i = static_cast<size_t>(t) * Hv + h, j = static_cast<size_t>(t0 + t) * Hv + h;
          beta[i] = cpu::sigmoid(b[j]);
          g[i] = cpu::softplus(a[j] + dt[h]) * A[h];
        }
      cpu::conv1d_silu(pool, qkv.data() + static_cast<int64_t>(t0) * ch, ch, T, ch, w.data(), K, c_cs.data(), cco.data(), ch);
      for (int t = 0; t < T; ++t) {
        float* row = cco.data() + static_cast<int64_t>(t) * ch;
        cpu::l2_norm(row, d.head_k_dim, d.n_k_heads, d.head_k_dim, kEps);
        cpu::l2_norm(row + kd, d.head_k_dim, d.n_k_heads, d.head_k_dim, kEps);
      }
      float* ro = ref_out.data() + static_cast<int64_t>(t0) * vd;
      cpu::gated_delta_net(pool, d, T, cco.data(), cco.data() + kd, ch, cco.data() + 2 * kd, ch, g.data(), beta.data(),
                           c_ds.data(), ro, vd);
      cpu::gated_rms_norm(ro, nw.data(), z.data() + static_cast<int64_t>(t0) * vd, ro, d.head_v_dim, T * Hv, kEps);
      t0 += T;
    }
    sync();
    EXPECT_LE(rel_err_blocks(dout.down<float>(ref_out.size()), ref_out, d.head_v_dim), 1e-5) << sh.name << ": outputs";
    EXPECT_LE(rel_err_blocks(dds->down<float>(c_ds.size()), c_ds, static_cast<size_t>(d.head_v_dim) * d.head_k_dim), kStateTol)
        << sh.name << ": delta state";
    EXPECT_TRUE(same_bits(dcs->down<float>(c_cs.size()), c_cs)) << sh.name << ": conv state";
  }
}

// ---- gated attention prologue ----------------------------------------------------------------------

void prologue_case(GpuDeltaNet& fx, const char* name, const AttnSpec& a, const RopeParams& rp, int T, int pos0,
                   DType cache, bool expect_e_pairs) {
  SCOPED_TRACE(std::string(name) + " T " + std::to_string(T) + " pos0 " + std::to_string(pos0) + " " + dtype_name(cache));
  const int hd = a.head_dim, qw = a.n_head * hd, kw = a.n_head_kv * hd, vw = a.n_head_kv * a.head_dim_v;
  const int64_t ld_qg = 2 * qw + 2, ld_k = kw + 1, ld_v = vw + 3;
  auto qg = randn(static_cast<size_t>(T) * ld_qg, 300 + T, 2.0f);
  auto k = randn(static_cast<size_t>(T) * ld_k, 301 + T, 2.0f);
  auto v = randn(static_cast<size_t>(T) * ld_v, 302 + T);
  auto qn = randn(hd, 303, 0.2f), kn = randn(hd, 304, 0.2f);
  for (auto& x : qn) x += 1.0f;
  for (auto& x : kn) x += 1.0f;
  std::vector<int32_t> pos(T);
  for (int t = 0; t < T; ++t) pos[t] = pos0 + t;
  const int n_ctx = pos0 + T + 4;
  const size_t es = cache == DType::F16 ? 2 : 4;
  auto dqg = upload(qg), dk = upload(k), dv = upload(v), dqn = upload(qn), dkn = upload(kn), dpos = upload(pos);
  Dev dq(static_cast<size_t>(T) * qw * 4), dgate(static_cast<size_t>(T) * qw * 4);
  Dev kc(static_cast<size_t>(n_ctx) * kw * es), vc(static_cast<size_t>(vw) * n_ctx * es);
  DevKv kv{cache, kc.bytes(), vc.bytes(), n_ctx};
  gated_attn_prologue(a, T, dqg->as<float>(), ld_qg, dq.as<float>(), qw, dgate.as<float>(), qw, dk->as<float>(), ld_k,
                      dv->as<float>(), ld_v, dqn->as<float>(), dkn->as<float>(), &kv, dpos->as<int32_t>(), rp, kEps,
                      fx.s());
  fx.sync();
  auto got_q = dq.down<float>(static_cast<size_t>(T) * qw), got_gate = dgate.down<float>(static_cast<size_t>(T) * qw);
  auto got_k = dk->down<float>(k.size());
  // The CPU, as Qwen35's attention_block.
  std::vector<float> q(static_cast<size_t>(T) * qw), gate(q.size()), kr = k;
  const int rows = T * a.n_head;
  std::vector<float> qg_packed(static_cast<size_t>(T) * 2 * qw);
  for (int t = 0; t < T; ++t) std::memcpy(qg_packed.data() + t * 2 * qw, qg.data() + t * ld_qg, sizeof(float) * 2 * qw);
  cpu::rms_norm(qg_packed.data(), qn.data(), q.data(), hd, rows, kEps, 2 * hd, hd);
  for (int r = 0; r < rows; ++r)
    std::memcpy(gate.data() + static_cast<int64_t>(r) * hd, qg_packed.data() + static_cast<int64_t>(r) * 2 * hd + hd,
                sizeof(float) * hd);
  for (int t = 0; t < T; ++t) cpu::rms_norm(kr.data() + t * ld_k, kn.data(), kr.data() + t * ld_k, hd, a.n_head_kv, kEps, hd, hd);
  auto q_plain = q;  // normed, not roped yet (for the section check below)
  auto kr_plain = kr;
  cpu::rope_multi(q.data(), T, a.n_head, hd, qw, a.n_rot, a.rope_sections, pos0, rp);
  cpu::rope_multi(kr.data(), T, a.n_head_kv, hd, ld_k, a.n_rot, a.rope_sections, pos0, rp);
  EXPECT_TRUE(same_bits(got_gate, gate)) << "gate";
  // The norms' double sums agree to the bit but for rare roundings; the cos / sin are the double
  // sincos rounded against the CPU's float ones (a few 1e-7 of the pair's size).
  EXPECT_LE(rel_err_blocks(got_q, q, hd), 2e-6) << "q";
  std::vector<float> gk, rk;
  for (int t = 0; t < T; ++t) {
    gk.insert(gk.end(), got_k.begin() + t * ld_k, got_k.begin() + t * ld_k + kw);
    rk.insert(rk.end(), kr.begin() + t * ld_k, kr.begin() + t * ld_k + kw);
    ASSERT_EQ(bits(got_k[t * ld_k + kw]), bits(k[t * ld_k + kw])) << "k's row gap";
  }
  EXPECT_LE(rel_err_blocks(gk, rk, hd), 2e-6) << "k";
  if (expect_e_pairs) {
    // The e section's pairs must not turn: the CPU with plain NeoX (sections all zero) differs.
    std::vector<float> q_neox = q_plain;
    const int none[4] = {0, 0, 0, 0};
    cpu::rope_multi(q_neox.data(), T, a.n_head, hd, qw, a.n_rot, none, pos0, rp);
    EXPECT_GT(rel_err_blocks(got_q, q_neox, hd), 1e-3) << "sections ignored?";
  }
  // The cache: k as the kernel wrote it and v, rounded to the cache type, at pos0 .. pos0 + T - 1; the
  // other positions untouched.
  auto kb = kc.down<uint8_t>(kc.size()), vb = vc.down<uint8_t>(vc.size());
  auto want_bits = [&](float f, uint8_t* out) {
    if (cache == DType::F16) {
      const uint16_t h = f32_to_f16(f);
      std::memcpy(out, &h, 2);
    } else {
      std::memcpy(out, &f, 4);
    }
  };
  int bad = 0;
  uint8_t w[4];
  for (int p = 0; p < n_ctx; ++p) {
    const bool written = p >= pos0 && p < pos0 + T;
    const int t = p - pos0;
    for (int i = 0; i < kw; ++i) {
      const uint8_t* got = kb.data() + (static_cast<size_t>(p) * kw + i) * es;
      if (written) want_bits(got_k[t * ld_k + i], w);
      else std::memset(w, kPoison, 4);
      if (std::memcmp(got, w, es) != 0 && bad++ < 5) ADD_FAILURE() << "K cache pos " << p << " i " << i;
    }
    for (int i = 0; i < vw; ++i) {
      const uint8_t* got = vb.data() + (static_cast<size_t>(i) * n_ctx + p) * es;
      if (written) want_bits(v[t * ld_v + i], w);
      else std::memset(w, kPoison, 4);
      if (std::memcmp(got, w, es) != 0 && bad++ < 5) ADD_FAILURE() << "V cache pos " << p << " i " << i;
    }
  }
  // Without a cache: the same q, gate and k.
  auto dk2 = upload(k);
  Dev dq2(static_cast<size_t>(T) * qw * 4), dgate2(static_cast<size_t>(T) * qw * 4);
  gated_attn_prologue(a, T, dqg->as<float>(), ld_qg, dq2.as<float>(), qw, dgate2.as<float>(), qw, dk2->as<float>(),
                      ld_k, nullptr, 0, dqn->as<float>(), dkn->as<float>(), nullptr, dpos->as<int32_t>(), rp, kEps, fx.s());
  fx.sync();
  EXPECT_TRUE(same_bits(dq2.down<float>(got_q.size()), got_q));
  EXPECT_TRUE(same_bits(dk2->down<float>(k.size()), got_k));
  EXPECT_TRUE(same_bits(dgate2.down<float>(got_gate.size()), got_gate));
}

TEST_F(GpuDeltaNet, GatedAttentionPrologueMatchesTheCpu) {
  RopeParams r7;
  r7.base = 1e7f;
  const RopeParams yarn = make_rope_params(16, 1e7f, 0.25f, 1.0f, 1.0f, 32, 1, 4096);
  const AttnSpec tiny = attn_spec(4, 1, 64, 16, {3, 3, 2, 0});
  const AttnSpec big = attn_spec(16, 2, 256, 64, {11, 11, 10, 0});
  const AttnSpec tiny_e = attn_spec(4, 1, 64, 16, {2, 1, 1, 3});  // pairs in the e section
  const AttnSpec tiny_neox = attn_spec(4, 1, 64, 16, {0, 0, 0, 0});
  for (DType cache : {DType::F16, DType::F32}) {
    for (int T : {1, 6}) {
      prologue_case(*this, "tiny", tiny, r7, T, T == 1 ? 1000 : 3, cache, false);
      prologue_case(*this, "35b", big, r7, T, T == 1 ? 31999 : 0, cache, false);
      prologue_case(*this, "tiny e pairs", tiny_e, r7, T, 40, cache, true);
      prologue_case(*this, "tiny neox", tiny_neox, r7, T, 7, cache, false);
      prologue_case(*this, "tiny yarn", tiny, yarn, T, 2000, cache, false);
    }
  }
}

}  // namespace
}  // namespace fitmoe::gpu
