// The GPU ops of the qwen35 family (Qwen3.5 / Qwen3.6), mirroring src/runtime/cpu_deltanet.h: the Gated
// DeltaNet (causal depthwise conv1d with its state + SiLU, L2 norms of q and k, the gated delta rule,
// the gated RMSNorm), gated full attention's prologue (the split of the double-width Q into q and its
// gate, Q/K RMSNorm, multi-section RoPE over a partial rotary dimension, the KV-cache store) and its
// sigmoid output gate, and the sigmoid-gated shared expert's combination. Kernels in deltanet.cu;
// tests/gpu/test_gpu_deltanet.cpp holds each against the CPU op on random inputs.
//
// Plain C++ header like gpu_ops.h: every function enqueues work on the given stream (cudaStream_t as
// void*) and returns at once; all pointers are device pointers; sizes are in elements. Each kernel goes
// out with programmatic dependent launch where gpu_ops' launches do (dependent_launch_active()) and
// reads nothing a kernel before it writes until it has waited (griddepcontrol.wait), so it can sit
// anywhere in a chain of gpu_ops kernels and in a CUDA graph.
//
// Numerics: the CPU op's order of float operations wherever it is cheap (the conv's sum over taps, the
// norms' double sums, the state's decay and rank-1 update element by element, softplus / sigmoid /
// SiLU as the CPU writes them); the dot products inside the delta rule are summed in another order
// (per-lane partial sums and a warp tree), so state and outputs agree to f32 reordering (~1e-6
// relative), not bit for bit. A prefill batch of n tokens gives the same bits as n one-token calls.
//
// A DeltaNet layer on the GPU, one micro-batch of T tokens (co = [q | k | v] rows of conv_channels):
//   matvec/matmul: qkv = W_qkv xn, z = W_gate xn, b = W_beta xn, a = W_alpha xn
//   delta_conv1d_silu(qkv -> co, conv_state)
//   gated_delta_rule(q = co, k = co + key_dim, v = co + 2 key_dim, g = a, beta = b, with dt_bias and
//                    ssm_a (the gates formed in the kernel) and l2_qk = true (q, k L2-normalised in the
//                    kernel): o, delta_state)
//     [prefill: delta_l2_norm(co, 2 n_k_heads heads) first and l2_qk = false: the fused norms are
//     redone by every warp for every token, in double, which is cheap for one token but slow over a
//     long batch on GPUs with little FP64 throughput (GeForce: 1/64 rate)]
//   delta_gated_rms_norm(o, ssm_norm, z -> o)
//   matvec/matmul: y = W_ssm_out o
// A gated attention layer: qg = W_q xn ([q_h | gate_h] per head), k = W_k xn, v = W_v xn;
//   gated_attn_prologue(qg -> q, gate; k normed + roped in place; k, v into the cache at pos);
//   gpu::attention(q -> att) (without its Q8_K output: the gate comes first); delta_mul_sigmoid(att,
//   gate); then the output projection (quantize_acts + matvec, or matmul).
// The FFN: y = moe_combine(...) of the routed experts, ys = the shared expert's SwiGLU FFN, then
//   shared_expert_gate_add(y, ys, ffn_gate_inp_shexp, xn), then residual_norm(x, y, ...).
#pragma once
#include <cstdint>

#include "cuda/gpu_ops.h"
#include "model/layer_spec.h"
#include "runtime/rope.h"

namespace fitmoe::gpu {

// out[t][c] = silu(sum_{j < K} in[t + j][c] * w[c][j]) with in = the conv state (the last K - 1 inputs
// before this batch, oldest first) followed by x, as cpu::conv1d_silu (the same sum, term by term);
// the state then holds the last K - 1 inputs. x [n_tokens][channels] (row stride ld_x), w
// [channels][K], state [channels][K - 1], out [n_tokens][channels] (ld_out); out must not overlap x
// or the state. K from 2 to 8.
void delta_conv1d_silu(const float* x, int64_t ld_x, int n_tokens, int channels, const float* w, int K, float* state,
                       float* out, int64_t ld_out, Stream s);

// x /= max(||x||, eps) for each of n_heads rows of head_dim values per token (row h of token t at
// x + t * ld + h * head_dim), as cpu::l2_norm (sum of squares in double). For q and k of a DeltaNet
// at once: x = co, n_heads = 2 * n_k_heads.
void delta_l2_norm(float* x, int64_t ld, int n_tokens, int n_heads, int head_dim, float eps, Stream s);

// The gated delta rule over n_tokens tokens one after another, as cpu::gated_delta_net: per value head
// h (query / key head h % n_k_heads) with state S (head_v_dim rows of head_k_dim), per token t:
//   S *= exp(g);  d_j = (v_j - S_j . k) * beta;  S_j += d_j k;  o_j = (S_j . q) / sqrt(head_k_dim)
// Layouts as the CPU op: q, k [n_tokens][n_k_heads * head_k_dim] (ld_qk), v [n_tokens][value_dim]
// (ld_v), g and beta [n_tokens][n_v_heads] (row stride ld_gb), state [n_v_heads][head_v_dim]
// [head_k_dim] f32 (updated in place), out [n_tokens][value_dim] (ld_out).
// With dt_bias and ssm_a (both [n_v_heads]) g and beta are the raw projections ssm_alpha x and
// ssm_beta x, and the kernel forms beta = sigmoid(beta), g = softplus(g + dt_bias[h]) * ssm_a[h] as
// the CPU's forward pass does; without them (null) g and beta are used as they are. With l2_qk the
// kernel L2-normalises q and k per head first (delta_l2_norm's arithmetic; q and k in memory are not
// changed), else they must be normalised already. head_k_dim 32, 64, 128 or 256.
// Cost: one pass over the state per batch (read once, written once: for the 35B shape 32 x 128 x 128
// floats = 2 MiB read + 2 MiB written per layer, whatever the batch size), plus q, k, v, g, beta.
void gated_delta_rule(const DeltaSpec& d, int n_tokens, const float* q, const float* k, int64_t ld_qk, const float* v,
                      int64_t ld_v, const float* g, const float* beta, int64_t ld_gb, const float* dt_bias,
                      const float* ssm_a, bool l2_qk, float eps, float* state, float* out, int64_t ld_out, Stream s);

// y = rms_norm(x) * w * silu(z) per row of n values, as cpu::gated_rms_norm; x, z, y [n_rows][n]
// contiguous; y may alias x.
void delta_gated_rms_norm(const float* x, const float* w, const float* z, float* y, int n, int n_rows, float eps,
                          Stream s);

// Gated full attention's prologue, one launch: per token t (position pos[t], a device array) and head,
//   q head h  = rope(rms_norm(qg[t][h][0, hd)) * q_norm)   -> q    [t * ld_q + h * hd]
//   gate h    = qg[t][h][hd, 2 hd)                         -> gate [t * ld_gate + h * hd]
//   k head g  = rope(rms_norm(k[t][g]) * k_norm)            -> k, in place
// where qg rows hold [q_h | gate_h] per head (2 * head_dim each; row stride ld_qg) and rope is
// cpu::rope_multi: NeoX pairs (i, i + n_rot / 2) over the first n_rot dims with a.rope_sections
// (IMRoPE for text tokens: the e section's pairs do not turn; all zero: plain NeoX), the angles as
// gpu::rope_neox makes them (float products, sincos in double). With kv (not null) k and v (v rows
// [t * ld_v + g * head_dim_v]) are also stored into the cache at pos[t] as gpu::kv_store does. The
// norms' arithmetic is gpu::rms_norm's. q and gate must not overlap qg.
void gated_attn_prologue(const AttnSpec& a, int n_tokens, const float* qg, int64_t ld_qg, float* q, int64_t ld_q,
                         float* gate, int64_t ld_gate, float* k, int64_t ld_k, const float* v, int64_t ld_v,
                         const float* q_norm, const float* k_norm, const DevKv* kv, const int32_t* pos,
                         const RopeParams& rope, float eps, Stream s);

// x[i] *= sigmoid(gate[i]) for i < n, as cpu::mul_sigmoid (gated attention's output).
void delta_mul_sigmoid(float* x, const float* gate, int64_t n, Stream s);

// The sigmoid-gated shared expert: per token t < n_tokens, s = sigmoid(w_gate . xn[t]) (w_gate f32,
// n values: ffn_gate_inp_shexp), y[t][i] += ys[t][i] * s, as the CPU's forward pass adds it to the
// routed experts' output before the residual. Rows of n floats, contiguous. With w_gate null the
// logits w_gate . xn[t] are read from gate_logits[t] instead (a weight of another type, through a
// mat-vec).
void shared_expert_gate_add(float* y, const float* ys, const float* w_gate, const float* xn, const float* gate_logits,
                            int n, int n_tokens, Stream s);

}  // namespace fitmoe::gpu
