// CPU ops of the qwen35 family (Qwen3.5 / Qwen3.6): gated full attention's pieces (multi-section RoPE,
// the sigmoid output gate) and the Gated DeltaNet (causal depthwise conv1d with its state, L2 norms,
// the delta-rule recurrence, the gated RMSNorm). Each follows the reference's CPU numerics (noted per
// op); tests/test_cpu_deltanet.cpp checks each against a plain scalar reference.
#pragma once
#include <cmath>
#include <cstdint>

#include "model/layer_spec.h"
#include "runtime/rope.h"
#include "runtime/thread_pool.h"

namespace fitmoe::cpu {

// As the reference's CPU ops: expf-based, in f32.
inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }
inline float silu(float x) { return x / (1.0f + std::exp(-x)); }
// log(1 + e^x), taken as x above 20 where the two agree in f32 (the reference's threshold).
inline float softplus(float x) { return x > 20.0f ? x : std::log(1.0f + std::exp(x)); }

// Multi-section RoPE for text tokens, NeoX pairs (i, i + n_rot/2) over the first n_rot dims of each
// head; the rest of the head is left as it is (partial rotary). Pair i belongs to a section by
// sections = {t, h, w, e} (IMRoPE: interleaved, pair i's sector i % sum(sections) goes to h when
// sector % 3 == 1 and sector < 3 h, to w when % 3 == 2 and < 3 w, to t when % 3 == 0 and < 3 t, else
// e). A text token has position p on the t, h and w axes and 0 on e, as the reference feeds it, so
// every pair not in e turns exactly as plain NeoX RoPE (same angle recurrence) and e pairs do not
// turn (cos 1, sin 0, times the magnitude). Sections all zero: plain NeoX.
void rope_multi(float* x, int n_tokens, int n_heads, int head_dim, int64_t ld, int n_rot, const int sections[4],
                int pos0, const RopeParams& rope);

// out[t][c] = silu(sum_{j < K} in[t + j][c] * w[c][j]) where in is the conv state (the last K - 1
// inputs before this batch, oldest first) followed by x; the state then holds the last K - 1 inputs.
// Layouts: x [n_tokens][channels] (row stride ld_x), w [channels][K], state [channels][K - 1],
// out [n_tokens][channels] (row stride ld_out). The sum runs in f32 over j in order, as the reference's
// ssm_conv; SiLU as ggml_silu.
void conv1d_silu(ThreadPool& pool, const float* x, int64_t ld_x, int n_tokens, int channels, const float* w, int K,
                 float* state, float* out, int64_t ld_out);

// x /= max(||x||, eps) per row of n values (sum of squares in double, as the reference's l2_norm).
void l2_norm(float* x, int n, int n_rows, int64_t ld, float eps);

// The gated delta rule, one token after another (what the reference's fused CPU op computes for a
// prefill batch as well as for one token). Per value head h (query/key head h % n_k_heads) with state
// S (head_v_dim rows of head_k_dim), per token t:
//   S *= exp(g[t][h]);  d_j = (v_j - S_j . k) * beta[t][h];  S_j += d_j k;  o_j = (S_j . q) / sqrt(d_k)
// q, k: [n_tokens][n_k_heads * head_k_dim] (row stride ld_qk), L2-normalised by the caller; v:
// [n_tokens][n_v_heads * head_v_dim] (ld_v); g, beta: [n_tokens][n_v_heads]; state:
// [n_v_heads][head_v_dim][head_k_dim], updated in place; out: [n_tokens][n_v_heads * head_v_dim].
// Heads run in parallel; each row of S is scaled, read, updated and read again in one pass (the same
// float operations per element as three passes).
void gated_delta_net(ThreadPool& pool, const DeltaSpec& d, int n_tokens, const float* q, const float* k, int64_t ld_qk,
                     const float* v, int64_t ld_v, const float* g, const float* beta, float* state, float* out,
                     int64_t ld_out);

// y = rms_norm(x) * w * silu(z) per row of n values (the DeltaNet's output norm, gated by z); x, z and
// y are [n_rows][n] contiguous; y may alias x.
void gated_rms_norm(const float* x, const float* w, const float* z, float* y, int n, int n_rows, float eps);

// x[i] *= sigmoid(gate[i]) (gated attention's output).
void mul_sigmoid(float* x, const float* gate, int64_t n);

}  // namespace fitmoe::cpu
