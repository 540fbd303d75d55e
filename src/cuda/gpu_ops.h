// The GPU op set (CUDA), mirroring src/runtime/cpu_ops.h: the GPU forward passes are written in these.
// Plain C++ header (no CUDA types leak out) so host code compiled by g++ can call it; every function
// enqueues work on the given stream (a cudaStream_t passed as void*) and returns at once.
//
// Numerics follow the CPU engine, which reproduces the reference:
// - Decode and small batches (n_tokens <= kMaxVecTokens): the activations are converted on the GPU to
//   the weight type's activation format (dtype_info(w).act_type: Q8_K, Q8_0, Q8_1, F16, BF16, F32),
//   byte-identical to quant::quantize_act_row_ref, and integer block dot products give the same
//   per-block values as quant::vec_dot_ref (only the float summation order differs).
// - Larger batches (prefill): weights are dequantized to f16 (F32 weights: f32) tile by tile and
//   multiplied with cuBLAS (f32 accumulation); activations are rounded to f16 for those, for quantized
//   weights after the reference's 8-bit rounding (round_acts).
// - Attention emulates the reference's non-flash path with an f16 (or f32) cache exactly as
//   cpu::attention does: Q rounded to the cache type, softmax in f32, P rounded to the cache type.
// All pointers are device pointers unless named host_*. Sizes are in elements unless named *_bytes.
#pragma once
#include <cstddef>
#include <cstdint>

#include "quant/dtype.h"
#include "runtime/rope.h"

namespace fitmoe::gpu {

using Stream = void*;  // cudaStream_t

// Programmatic dependent launch (compute capability 9.0 and up; gpu_ops.cu says how the kernels use
// it): on wherever supported unless FITMOE_PDL=0. set_dependent_launch(false) turns it off for later
// launches and graph captures (tests compare the two).
void set_dependent_launch(bool allowed);
// Prefill attention over f16 caches runs on tensor cores where the head sizes allow (sm_70+);
// set_tensor_core_attention(false) makes later launches use the CUDA-core kernel (for tests).
void set_tensor_core_attention(bool allowed);
bool dependent_launch_active();

// Largest batch the integer mat-vec kernels take; larger batches go through dequantize + cuBLAS.
constexpr int kMaxVecTokens = 8;

// A weight matrix (or a stack of experts) in device memory.
struct DevMatrix {
  DType type = DType::F32;
  int64_t cols = 0;            // values per row (the input width)
  int64_t rows = 0;            // output rows per matrix
  int64_t n_mats = 1;          // experts stacked (3-D tensors); matrix e starts at data + e * mat_bytes
  size_t row_bytes = 0;
  size_t mat_bytes = 0;
  const uint8_t* data = nullptr;
};

// ---- elementwise and norms ------------------------------------------------------------------------
// out[t] = decode(table row ids[t]) for t < n (table rows of any weight type).
void embed_rows(const DevMatrix& table, const int32_t* ids, int n, float* out, Stream s);
// y = x / sqrt(mean(x^2) + eps) * w, per row of n values (w may be null). In place allowed.
void rms_norm(const float* x, const float* w, float* y, int n, int rows, float eps, int64_t ld_x, int64_t ld_y,
              Stream s);
// x += y (n values)
void add(float* x, const float* y, int64_t n, Stream s);
// The end of a block for `rows` rows of n values: x += y, or (y null) x += moe_combine(ey, wts, k), or
// (both null) x as it is; then, when xn is given, xn = rms_norm(x) * w. The same bits as add /
// moe_combine + rms_norm. With xq, xn is also written as Q8_K rows (the bytes quantize_acts(Q8_K)
// gives; n a multiple of 256), sparing the next mat-vec's quantization. With y0 (and y): x = (x + y0) + y,
// the add residual_norm_router defers.
void residual_norm(float* x, const float* y, const float* ey, const float* wts, int k, const float* w, float* xn,
                   int n, int rows, float eps, Stream s, void* xq = nullptr, const float* y0 = nullptr);
// The FFN side of an all-GPU decode layer (one token) in one launch: xn = rms_norm(x + y) * w, the bits
// of residual_norm, into xq as Q8_K only, and logits = router xn for an F32 router (rows >= n / 256, of
// width n <= 4096, a multiple of 256). x itself is left as it is: the caller adds y later, through the
// y0 of the FFN block's residual_norm.
void residual_norm_router(const float* x, const float* y, const float* w, int n, float eps, const DevMatrix& router,
                          float* logits, void* xq, Stream s);
// out = silu(gate) * up
void swiglu(const float* gate, const float* up, float* out, int64_t n, Stream s);
// NeoX RoPE in place for tokens at positions pos[t] (device array), as cpu::rope_neox (linear and
// YaRN scaling included; the cos/sin from a double-precision sincos rounded to float).
void rope_neox(float* x, int n_tokens, int n_heads, int head_dim, int64_t ld, int n_rot, const int32_t* pos,
               const RopeParams& rope, Stream s);

// ---- matrix products ------------------------------------------------------------------------------
// Bytes of x converted to act type for `rows` rows of n values; conversion as quantize_act_row_ref.
size_t act_bytes(DType act, int64_t n, int rows);
void quantize_acts(DType act, const float* x, int64_t n, int rows, int64_t ld_x, void* dst, Stream s);
// y = x's rows rounded through act's 8-bit blocks and back (act Q8_K, Q8_0 or Q8_1): each value q * d
// exactly as dequantizing quantize_act_row_ref's output gives it. The reference's integer products see
// these values; prefill's floating-point products are given them (matmul does this itself).
void round_acts(DType act, const float* x, int64_t n, int rows, int64_t ld_x, float* y, int64_t ld_y, Stream s);
// Whether round_acts takes act (the 8-bit activation formats).
bool rounds_acts(DType act);

// y[t * ld_y + r] = W[r] . x[t] for t < n_tokens <= kMaxVecTokens, acts already converted to
// dtype_info(w.type).act_type (rows act_bytes(act, w.cols, 1) apart).
void matvec(const DevMatrix& w, const void* acts, int n_tokens, float* y, int64_t ld_y, Stream s);
// Several matrices of one type and width on the same activations (e.g. the q, k and v projections):
// y_i = W_i x for i < n (at most 4 quantized ones, in one launch; float ones one launch each), each
// output with its own ld. The same per-row results as n calls of matvec.
void matvec_multi(const DevMatrix* const* ws, float* const* ys, const int64_t* ld_ys, int n, const void* acts,
                  int n_tokens, Stream s);

// Routed experts, decode style: for slot j < n_slots, with m = slot_of ? slot_of[ids[j]] : ids[j],
// matrix m of w times activation row act_row[j] (index into acts, rows act_bytes(act, cols, 1) apart)
// -> y[j * ld_y + r]. m < 0 (an expert that lives in host memory) leaves row j of y untouched. All
// index arrays are on the device, so the call can be captured in a CUDA graph.
void matvec_experts(const DevMatrix& w, const int32_t* ids, const int32_t* slot_of, int n_slots, const void* acts,
                    const int32_t* act_row, float* y, int64_t ld_y, Stream s);
// Routed experts and their combination at once (decode, every chosen expert on the device): for each
// token t < n_tokens (at most 8) with k <= 8 slots t*k + j, y[t * ld_y + r] = moe_combine of the slots'
// products (activation row = slot), the very bits of matvec_experts (act_row = slot) + moe_combine.
// Quantized experts only.
void matvec_experts_combine(const DevMatrix& w, const int32_t* ids, const int32_t* slot_of, int n_tokens, int k,
                            const void* acts, const float* wts, float* y, int64_t ld_y, Stream s);
// The same for gate and up experts at once (quantized, one type and shape): y = silu(gate x) * (up x),
// the very bits of two matvec_experts calls and swiglu. (Hinting the chosen down matrices into L2
// meanwhile was measured slower on the H200: 370 vs 376 tok/s.)
void matvec_experts_glu(const DevMatrix& gate, const DevMatrix& up, const int32_t* ids, const int32_t* slot_of,
                        int n_slots, const void* acts, const int32_t* act_row, float* y, int64_t ld_y, Stream s);
// The same for one token whose routing the kernel makes itself from the router's logits (n_expert of
// them, at most kRouteInExpertsMax; k chosen): the choices and weights of route_topk (written to ids /
// weights for the kernels after) and the outputs of matvec_experts_glu with them (slot j in row j of y).
// Saves the routing's own step on the decode's critical path. An expert that slot_of places on the
// host (or a choice NaN logits leave out of range) gets NaN rows.
constexpr int kRouteInExpertsMax = 256;
void matvec_experts_glu_routed(const DevMatrix& gate, const DevMatrix& up, const float* logits, int n_expert, int k,
                               int32_t* ids, float* weights, const int32_t* slot_of, const void* acts, float* y,
                               int64_t ld_y, Stream s);
// dst[dst_rows ? dst_rows[i] : i] = src[src_rows ? src_rows[i] : i] for i < n rows of `width` floats.
// Hybrid decode, the GPU side of the hand-over from the CPU's experts, with their combination: waits
// until *host_flag (pinned host memory, device view) equals *epoch (device), then for each token
// t < n_tokens adds the combination of its k slots to its row of x (width floats):
//   x[t] += sum_j wts[t*k+j] * row_j   (in slot order: the bits of residual_norm's combination)
// where slot j's row (rows of `width` floats, j = t*k + jj) comes from ey when its expert is
// device-resident (slot_of[ids[j]] >= 0), from ey_host when the GPU computed it itself from pinned
// weights (gpu_slots[j] >= 0, when given; see RoutePublish), and otherwise straight from host_rows
// (pinned, device view; the CPU's outputs). The host writes the rows first and the flag last. Lets the
// GPU work after the hand-over be queued before the CPU has finished; residual_norm with neither y
// nor ey then norms x.
void handover_combine(const unsigned* host_flag, const unsigned* epoch, const float* host_rows, const float* ey,
                      const float* ey_host, const int32_t* ids, const int32_t* slot_of, int n_expert,
                      const int32_t* gpu_slots, const float* wts, int k, float* x, int n_tokens, int width, Stream s,
                      unsigned long long* stamp = nullptr);
// (stamp, for FITMOE_HOST_PROFILE: the GPU's clock (%globaltimer, ns) when the flag was seen.)
void copy_rows(const float* src, int64_t ld_src, const int32_t* src_rows, float* dst, int64_t ld_dst,
               const int32_t* dst_rows, int n, int width, Stream s);

// Prefill: y[t * ld_y + r] = W[r] . x[t] for any n_tokens, x in f32 (row stride ld_x). Uses a
// dequantized f16 copy of W in `scratch` (at least dequant_scratch_bytes(w) bytes) and cuBLAS.
size_t dequant_scratch_bytes(const DevMatrix& w);
void matmul(const DevMatrix& w, int64_t mat, const float* x, int64_t ld_x, int n_tokens, float* y, int64_t ld_y,
            void* scratch, Stream s);
// (added by the kernels) The scratch holds the dequantized f16 weights and the activations converted to
// f16 (bf16 for BF16 weights; for quantized weights first rounded as round_acts does), 16-byte aligned. matmul works with any size from dequant_scratch_bytes(w)
// (an f16 copy of up to 64 MiB of the rows; 0 for F32): it tiles weight rows and chunks tokens to fit.
// The overload with scratch_bytes uses all of a larger scratch; matmul_scratch_bytes(w, n_tokens) is the
// size for one dequantization of the whole matrix (up to 64 MiB of it) and one GEMM over all the tokens.
size_t matmul_scratch_bytes(const DevMatrix& w, int n_tokens);
void matmul(const DevMatrix& w, int64_t mat, const float* x, int64_t ld_x, int n_tokens, float* y, int64_t ld_y,
            void* scratch, size_t scratch_bytes, Stream s);

// ---- attention ------------------------------------------------------------------------------------
// Cache of one layer, as cpu::KvView: K rows [pos][n_head_kv * head_dim], V transposed
// [n_head_kv * head_dim_v][n_ctx], element type F16 or F32; or, with flash set, K and V rows of any
// cache type each (cuda/flash_attention.h), read only by flash_attention.
struct DevKv {
  DType type;  // K's type (and V's without flash)
  uint8_t* k;
  uint8_t* v;
  int n_ctx;
  bool flash = false;
  DType v_type = DType::F16;
  int64_t k_row_bytes = 0, v_row_bytes = 0;  // (flash) bytes per position, all heads
  int rot_k = 0, rot_v = 0;                  // Walsh-Hadamard block sizes (0: none)
  int tq_block_k = 128, tq_block_v = 128;    // tq caches: values per block
};
void kv_store(const DevKv& kv, const int32_t* pos, int n_tokens, const float* k, int64_t ld_k, const float* v,
              int64_t ld_v, int n_head_kv, int head_dim, int head_dim_v, Stream s);
// The attention prologue in one launch: RMSNorm of every q and k head (weights q_norm / k_norm), NeoX
// RoPE of both (as rope_neox), q in place, k and v stored into the cache at pos[t] (as kv_store). The
// same bits as rms_norm + rope_neox + kv_store; st.k is not written. pos is read before the launch
// waits for the kernel before it (the rotation table is made meanwhile): write it before that kernel.
void qk_norm_rope_store(float* q, int64_t ld_q, const float* k, int64_t ld_k, const float* v, int64_t ld_v,
                        const float* q_norm, const float* k_norm, const DevKv& kv, const int32_t* pos, int n_tokens,
                        int n_head, int n_head_kv, int head_dim, int head_dim_v, int n_rot,
                        const RopeParams& rope, float eps, Stream s);
// Causal attention of n_tokens queries at positions pos0 .. pos0 + n_tokens - 1 (pos0 on the host so
// the launch can size itself; a graph-captured decode passes n_kv_max and reads the real position
// from pos_dev[0]). Decode (n_tokens <= 8) needs `scratch` of attention_scratch_bytes, zero-filled once
// when allocated (it holds counters that every call leaves at zero). out_q (optional): where the
// one-launch decode kernel also writes the output as Q8_K rows of n_head * head_dim_v values (the next
// mat-vec's input); returns whether it did (it does when each group of query heads spans whole
// 256-value blocks).
bool attention(const float* q, int64_t ld_q, const DevKv& kv, int pos0, const int32_t* pos_dev, int n_tokens,
               int n_kv_max, int n_head, int n_head_kv, int head_dim, int head_dim_v, float scale, float* out,
               int64_t ld_out, void* scratch, size_t scratch_bytes, Stream s, void* out_q = nullptr);
size_t attention_scratch_bytes(int n_tokens, int n_kv_max, int n_head, int head_dim_v);
// Decode attention has two kernels: one launch for up to 2048 visible keys, split-K beyond.
// A launch captured in a CUDA graph keeps its variant, so a graph captured when n_keys (pos0 + n_tokens)
// had one variant must be captured again when it changes.
int attention_decode_variant(int n_keys);

// Keeps the stream busy for about `microseconds` (the op profiler queues a step's work behind it, so
// the times between its events are the kernels' own, not the host's launch rate).
void busy_wait(int microseconds, Stream s);

// ---- routing --------------------------------------------------------------------------------------
// Per token: softmax over n_expert logits, top-k (larger first, lower index on ties), weights
// renormalised with the sum clamped at 6.1e-5, as cpu::route_softmax_topk. ids/weights [n_tokens][k].
// (k at most 32, as for residual_norm's combination.)
void route_topk(const float* logits, int n_tokens, int n_expert, int k, int32_t* ids, float* weights, Stream s);
// Hybrid decode hands the routing to the CPU through pinned host memory (device views of it): the
// choices [n_tokens * k] into ids, the router's input rows into x, then the step's epoch (read from
// device memory) into *flag, after a fence that makes the rows visible to a CPU that sees the flag.
// With gpu_share > 0 it also splits each token's host-resident choices (slot_of[e] < 0) between the
// CPU and the GPU, which reads the weights of its part from pinned memory over the bus: of a token's h
// host slots the last floor(h * gpu_share + 1/4) in slot order go to the GPU (rounding leans to the CPU:
// an expert too many on the bus delays the layer more than one too few). gpu_slots[j] (device) and
// host_gpu_slots[j] (pinned) get the expert of each slot the GPU takes, -1 for every other slot.
struct RoutePublish {
  int32_t* ids = nullptr;
  float* x = nullptr;
  unsigned* flag = nullptr;
  const unsigned* epoch = nullptr;
  float gpu_share = 0;
  int k = 0, n_expert = 0;
  const int32_t* slot_of = nullptr;
  int32_t* gpu_slots = nullptr;
  int32_t* host_gpu_slots = nullptr;
  // FITMOE_HOST_PROFILE: the GPU's clock (%globaltimer, ns) just before the flag is raised, or null.
  unsigned long long* stamp = nullptr;
};
// The router's product and route_topk in one launch, for an F32 router of at most 512 experts and at
// most kMaxVecTokens tokens (x: f32 rows of router.cols values; logits [n_tokens][router.rows]); the
// same bits as matvec + route_topk. `done` is a device counter that starts at 0 and is left at 0 (one
// per stream of use). Returns false, having done nothing, where it does not apply.
bool router_topk(const DevMatrix& router, const float* x, int n_tokens, float* logits, int k, int32_t* ids,
                 float* weights, unsigned* done, Stream s,
                 const RoutePublish& pub = {});
// (pub.flag set: the routing is also published as RoutePublish says, by the kernel's last CTA; with
// pub.x null, only the choices.)
// The same publication after a routing made otherwise (a launch of one CTA; n_x floats of x).
void publish_route(const RoutePublish& pub, const int32_t* ids, int n_ids, const float* x, int64_t n_x, Stream s);
// Whether the mat-vec kernels take this weight (type, shape, alignment), without throwing.
bool matvec_weight_ok(const DevMatrix& w);
// out[t] = sum_j weights[t][j] * y[row(t, j)] in j order; rows of y are n wide, row(t,j) = t*k + j.
void moe_combine(const float* y, const float* weights, int n_tokens, int k, int n, float* out, Stream s);

}  // namespace fitmoe::gpu

// ==== grouped expert products (src/cuda/moe_gemm.cu) =============================================
namespace fitmoe::gpu {

// Grouped expert products for prefill: every expert of a layer in ONE launch. The slots of a micro-batch
// are sorted by expert: expert e owns slot range [offsets[e], offsets[e+1]) of n_experts+1 offsets
// (device, non-decreasing). n_slots_max only sizes the grid: it must be at least the number of slots
// of the experts that run (m >= 0 below), e.g. n_slots, or a chunk's slot count when slot_of maps only
// that chunk's experts (tiles beyond the grid would be silently dropped). For each expert e with
// matrix m = slot_of ? slot_of[e] : e (skipped when m < 0 or m >= w.n_mats: y rows of its slots are
// left untouched) and each slot i in its range:
//   y[o * ld_y + r] = W_m[r] . x[rows ? rows[i] : i]   for r < w.rows, o = y_rows ? y_rows[i] : i
// (x rows are ld_x floats apart; y_rows scatters the outputs, e.g. back to the router's slot order).
// W: DevMatrix of stacked experts (any weight type matmul takes; cols a multiple of 32). Activations are
// rounded to f16 (bf16 for BF16 weights, f32 for F32 weights), weights dequantized exactly then rounded
// to f16, f32 accumulation: the same numerics as gpu::matmul, only the summation order differs.
// All arrays are on the device and n_slots_max only sizes the grid, so the call can be captured in a
// CUDA graph. No scratch. Tensor cores (wmma) from sm_70 (BF16 weights: sm_80), CUDA cores otherwise
// and for F32 weights.
// `tile` is a testing / tuning knob: 0 picks the kernel, 64 / 128 force the tensor-core kernel with
// that many tokens per tile (where the device runs it), -1 forces the CUDA-core kernel.
void moe_matmul(const DevMatrix& w, const int32_t* offsets, int n_experts, const int32_t* slot_of, const float* x,
                int64_t ld_x, const int32_t* rows, int n_slots_max, float* y, int64_t ld_y, Stream s,
                const int32_t* y_rows = nullptr, int tile = 0);
// The same for gate and up (same type and shape) with the SwiGLU fused:
//   h[o * ld_h + r] = silu(Gate_m[r] . x_i) * (Up_m[r] . x_i)   (silu(g) * u exactly as gpu::swiglu)
void moe_matmul_swiglu(const DevMatrix& gate, const DevMatrix& up, const int32_t* offsets, int n_experts,
                       const int32_t* slot_of, const float* x, int64_t ld_x, const int32_t* rows, int n_slots_max,
                       float* h, int64_t ld_h, Stream s, const int32_t* h_rows = nullptr, int tile = 0);

}  // namespace fitmoe::gpu
