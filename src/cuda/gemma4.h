// GPU ops that only Gemma 4 (gemma4) needs, mirroring src/runtime/cpu_gemma4.h and the gemma4 parts
// of cpu_ops (rope_freqs, the windowed attention over a ring cache). Plain C++ header (no CUDA types)
// like gpu_ops.h; every function enqueues work on the given stream and returns at once. Written to
// mirror the CPU ops' arithmetic, simply (plain launches, no dependent launch, no tensor cores): the
// speed work comes after they are checked on a GPU.
//
// How gemma4_gpu.cpp calls them per layer (the CPU's order, src/model/gemma4.cpp):
//   q = wq xn; rms_norm per q head (gpu::rms_norm); gemma4_rope(q)
//   own KV: k = wk xn; v = wv xn (or a copy of k: K = V); rms_norm per k head with k_norm, per v head
//     without weight; gemma4_rope(k); gemma4_kv_store (ring slots on sliding layers)
//   gemma4_attention (window > 0: the last `window` positions only); wo
//   dense: gemma4_geglu between gate/up and down; MoE: gemma4_router_input for the router's input,
//     gemma4_expert_scale on the routing weights
//   layer end: gemma4_scale_by (layer_output_scale); head: gemma4_softcap on the logits.
#pragma once
#include <cstddef>
#include <cstdint>

#include "cuda/gpu_ops.h"
#include "runtime/rope.h"

namespace fitmoe::gpu {

// The reference's GELU table (cpu_gemma4's: gelu_tanh of every f16 value, rounded to f16, as floats),
// uploaded once per process through cudaMalloc (256 KiB, outside the accountant: a constant of the
// code, like the kernels). Thread-safe; throws Error on a CUDA failure.
const float* gemma4_gelu_table();
// out = gelu(gate) * up as cpu::geglu: gate <= -10 gives 0, gate >= 10 gives gate * up, else
// table[f16(gate)] * up. out may alias gate or up.
void gemma4_geglu(const float* gate, const float* up, float* out, int64_t n, Stream s);

// NeoX RoPE in place as cpu::rope_neox with freq_factors (null: none), for tokens at positions pos[t]
// (device array): angles by repeated float products, the unscaled angle divided by the pair's factor,
// then (YaRN) scaled; cos / sin of the float angle (double-precision sincos rounded to float).
void gemma4_rope(float* x, int n_tokens, int n_heads, int head_dim, int64_t ld, int n_rot, const int32_t* pos,
                 const RopeParams& rope, const float* freq_factors, Stream s);

// Stores k / v rows of n_tokens tokens (n_head_kv * head_dim values each) into kv at positions pos[t],
// slot pos % kv.n_ctx when ring (as cpu::kv_store over a KvView with ring), rounded to the cache type.
void gemma4_kv_store(const DevKv& kv, bool ring, const int32_t* pos, int n_tokens, const float* k, int64_t ld_k,
                     const float* v, int64_t ld_v, int n_head_kv, int head_dim, Stream s);

// Causal attention of n_tokens queries at positions pos[t] (device) as cpu::attention: Q rounded to
// the cache type, scores K.Q * scale, softmax in f32 (sum in double), P rounded to the cache type,
// V^T P accumulated in f32; window > 0: a query at p sees p - window + 1 .. p only; ring: position p
// at slot p % kv.n_ctx. One CTA per (token, head), three passes over the visible keys (max, sum,
// output): simple, no scratch; head_dim <= 1024.
void gemma4_attention(const float* q, int64_t ld_q, const DevKv& kv, bool ring, const int32_t* pos, int n_tokens,
                      int n_head, int n_head_kv, int head_dim, float scale, int window, float* out, int64_t ld_out,
                      Stream s);

// x = tanh(x / cap) * cap (cpu::softcap's three steps).
void gemma4_softcap(float* x, int64_t n, float cap, Stream s);
// x *= f (a host scalar), n values.
void gemma4_scale(float* x, int64_t n, float f, Stream s);
// x *= *f (a device scalar: layer_output_scale), n values.
void gemma4_scale_by(float* x, int64_t n, const float* f, Stream s);
// The router's input: out[t][i] = rms_norm(x[t])[i] * inv_sqrt * w[i] (cpu: (v * inv_sqrt) * w[i]),
// rows of n values; out may alias x.
void gemma4_router_input(const float* x, const float* w, float* out, int n, int rows, float eps, float inv_sqrt,
                         Stream s);
// wts[j] *= scale[ids[j]] for j < n (the per-expert output scale on the routing weights; ids < 0 are
// left as they are).
void gemma4_expert_scale(float* wts, const int32_t* ids, const float* scale, int n, Stream s);

}  // namespace fitmoe::gpu
