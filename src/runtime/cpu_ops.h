// The CPU op set the forward passes are written in. Each op is plain C++ over float rows plus the
// quantized kernels of src/quant; each reproduces the reference's numerics (noted per op) so that
// fitmoe's logits match llama.cpp's within the testdata tolerances.
#pragma once
#include <algorithm>
#include <cstdint>
#include <utility>
#include <span>
#include <vector>

#include "model/layer_spec.h"
#include "model/model.h"
#include "runtime/kv_cache.h"
#include "runtime/rope.h"
#include "runtime/thread_pool.h"

namespace fitmoe::cpu {

// Growable scratch memory owned by a model state, reused across ops and steps so that decode
// allocates nothing.
class Scratch {
 public:
  uint8_t* bytes(size_t slot, size_t n) {
    if (slot >= bufs_.size()) bufs_.resize(slot + 1);
    if (bufs_[slot].size() < n) bufs_[slot].resize(n + n / 4 + 64);
    return bufs_[slot].data();
  }
  float* floats(size_t slot, size_t n) { return reinterpret_cast<float*>(bytes(slot, n * sizeof(float))); }

 private:
  std::vector<std::vector<uint8_t>> bufs_;
};

// y = x / sqrt(mean(x^2) + eps) * w for each of n_rows rows of n values (w may be null: no weight).
// Like ggml: the sum of squares accumulates in double, the scale is a float.
void rms_norm(const float* x, const float* w, float* y, int n, int n_rows, float eps, int64_t ld_x,
              int64_t ld_y);

// Embedding rows (any weight type) to f32: out[t] = decode(table row tokens[t]).
void embed(ThreadPool& pool, const Weight& table, std::span<const int32_t> tokens, float* out);

// Activations converted to a weight type's activation format, one row per token.
struct QuantizedActs {
  DType type = DType::F32;
  int64_t n = 0;          // values per row
  size_t stride = 0;      // bytes per row
  int n_rows = 0;
  const uint8_t* data = nullptr;
};
QuantizedActs quantize_acts(ThreadPool& pool, DType act_type, const float* x, int64_t ld_x, int64_t n,
                            int n_rows, uint8_t* buf);
size_t quantized_acts_bytes(DType act_type, int64_t n, int n_rows);

// y[t * ld_y + r] = W[r] . x[t] for r < W.rows(), t < n_tokens. Activations already converted with
// quantize_acts to W's activation format. Splits rows (and tokens, for batches) across threads.
void matmul(ThreadPool& pool, const Weight& w, const QuantizedActs& x, float* y, int64_t ld_y);
// Several products sharing one input (Q, K and V): one parallel step instead of three.
struct MatmulJob {
  const Weight* w;
  float* y;
  int64_t ld_y;
};
void matmul_many(ThreadPool& pool, std::span<const MatmulJob> jobs, const QuantizedActs& x);
// Convenience: converts x itself (using scratch slot `slot`).
void matmul(ThreadPool& pool, const Weight& w, const float* x, int64_t ld_x, int n_tokens, float* y,
            int64_t ld_y, Scratch& scratch, size_t slot);

// Rotary position embedding, NeoX layout (dims i and i + n_rot/2 form a pair), in place on
// n_tokens x n_heads heads of head_dim values (row stride ld), positions pos0, pos0+1, ...
// Angles as ggml: theta_i = p * base^(-2i/n_rot) computed by repeated multiplication in f32, then
// linear / YaRN scaling and the magnitude as runtime/rope.h describes (unscaled: the plain bits).
// freq_factors (n_rot/2 values, gemma4's rope_freqs): pair i's angle is divided by freq_factors[i]
// before scaling, as the reference's rope_ext with freq factors (a huge factor leaves a pair unrotated).
void rope_neox(float* x, int n_tokens, int n_heads, int head_dim, int64_t ld, int n_rot, int pos0,
               const RopeParams& rope, const float* freq_factors = nullptr);

// Causal softmax attention of n_tokens queries at positions pos0.. over the cached keys 0..pos.
// Two numerics, as the reference's two paths (the cache's layout says which, KvView::flash):
// - without flash attention (f16, f32, bf16 caches): Q is rounded to the cache type, scores =
//   K.Q * scale, softmax in f32 (sum in double), probabilities rounded to the cache type, then V^T.P
//   with f32 accumulation; both products on the matmul tile kernels of the cache type. V is stored
//   transposed, [n_head_kv * head_dim_v] rows of n_ctx positions, so V^T.P reads rows like a weight.
// - flash attention (every KV type, K and V independent; V rows untransposed): per query an online
//   softmax over the keys in position order, as ggml's one-row CPU kernel: Q converted to K's dot
//   format (f16 for f16 K, q8_0 for q8_0 / q4_0 K), each score K.Q * scale, the running maximum
//   rescaling the accumulator; an f16 V accumulated in f16 (rounded at every key), any other V
//   decoded to f32 and accumulated in f32. With f16 K and V and at least 64 queries the reference
//   switches to its tiled kernel (Q, K, V in f32), and so does this one.
// K rows are [pos][n_head_kv * head_dim] either way. ring (sliding-window layers): the cache holds
// the last n_ctx positions, position p in slot p % n_ctx, so that a layer with a window keeps only
// the window (plus a micro-batch). rot_k / rot_v (quantized caches, runtime/kv_cache.h): kv_store
// rotates K and V before storing them, attention rotates Q alike and the output back.
struct KvView {
  DType type;       // K's type (and V's without flash attention)
  uint8_t* k;
  uint8_t* v;
  int n_ctx;        // positions (capacity)
  int64_t k_row_bytes;  // bytes per position of K
  bool ring = false;
  bool flash = false;   // V rows [slot][v_row_bytes] of v_type; flash-attention numerics
  DType v_type = DType::F16;
  int64_t v_row_bytes = 0;
  int rot_k = 0, rot_v = 0;  // Walsh-Hadamard block sizes (0: none)
  int tq_block_k = 128, tq_block_v = 128;  // tq caches: values per block (runtime/kv_cache.h tq_block)
  int slot(int pos) const { return ring ? pos % n_ctx : pos; }
  DType value_type() const { return flash ? v_type : type; }
};
void kv_store(const KvView& kv, int pos0, int n_tokens, const float* k, int64_t ld_k, const float* v,
              int64_t ld_v, int k_width, int v_width);

// The CPU states' KV caches, one per attention layer with KV of its own (none for DeltaNet layers;
// a shared-KV layer reads its source's; a sliding-window layer's is a ring of its window plus a
// micro-batch), in the layout and with the rotation the cache type asks for. Checks the type
// against the layers (check_kv_cache_type) and allocates exactly layer_memory()'s bytes.
class KvCache {
 public:
  KvCache(const std::vector<LayerSpec>& specs, int n_ctx, const KvCacheType& type);
  KvView view(int l) const { return views_[src_[l]]; }
  size_t bytes() const;
  // The largest window among rings smaller than the context (0: no cache wraps).
  int wrapping_window() const { return window_; }

 private:
  std::vector<KvView> views_;
  std::vector<int> src_;
  std::vector<std::vector<uint8_t>> k_, v_;
  int window_ = 0;
};
// window > 0 (sliding-window layers): a query at p sees positions p - window + 1 .. p only, and only
// those are read; a ring cache must hold every position a batch's queries see (window - 1 + n_tokens
// <= n_ctx). The keys a block of queries sees are in position order either way, so the products and
// the softmax run in the same order as over a plain cache. Uses scratch slots `slot` and slot + 1.
void attention(ThreadPool& pool, const float* q, int64_t ld_q, const KvView& kv, int pos0, int n_tokens,
               int n_head, int n_head_kv, int head_dim, int head_dim_v, float scale, float* out,
               int64_t ld_out, Scratch& scratch, size_t slot, int window = 0);

// out = silu(gate) * up, elementwise.
void swiglu(const float* gate, const float* up, float* out, int64_t n);
// out = act(gate) * up: swiglu, or cpu::geglu (runtime/cpu_gemma4.h) for Activation::GeluTanh.
void glu(Activation act, const float* gate, const float* up, float* out, int64_t n);

// Router: softmax over n_expert logits, top-k (larger first, lower index on ties), weights
// renormalised to sum 1 with the sum clamped from below at 6.1e-5 (as the reference).
void route_softmax_topk(const float* logits, int n_expert, int k, bool renormalise, int32_t* experts,
                        float* weights);

// Routed SwiGLU experts for a batch: out[t] = sum_j weights[t][j] * down_e(silu(gate_e x) * up_e x)
// with e = experts[t][j], summed in j order. x are the normed inputs [n_tokens][n_embd].
// gate_up (gemma4's fused ffn_gate_up_exps, [n_embd, 2 n_ff_exp, n_expert]): when set, gate and up are
// empty and expert e's gate rows are rows 0..n_ff_exp-1 of its matrix, its up rows the rest.
struct ExpertWeights {
  Weight gate, up, down;  // 3-D: [n_embd, n_ff_exp, n_expert] (down: [n_ff_exp, n_embd, n_expert])
  Weight gate_up;
  // By the bytes, not the tensor info: tests and synthetic stacks build weights without one.
  bool fused() const { return gate_up.host != nullptr; }
  int64_t n_ff() const { return fused() ? gate_up.rows() / 2 : gate.rows(); }
  int64_t n_expert() const { return down.ne[2]; }
};
void moe_ffn(ThreadPool& pool, const ExpertWeights& w, const float* x, int n_tokens, int n_embd,
             const int32_t* experts, const float* weights, int k, float* out, Scratch& scratch,
             Activation act = Activation::SiLU);
// The unweighted outputs of a list of (token, expert) slots: out[a] = down_e(silu(gate_e x_t) * up_e x_t)
// with t = token_of_slot[a], e = experts[a]; each chosen expert's weights are read once. Used by
// moe_ffn and by the GPU engine for the experts that live in host memory. out_rows (optional): slot a's
// output goes to row out_rows[a] of out instead of row a (the threads write it as they compute it).
// Up to this many tokens (decode), expert_ffn splits the rows statically and evenly over the threads in
// one job; above it, in dynamically taken blocks.
constexpr int kExpertFfnStaticTokens = 8;
// sliced (decode only): experts whose rows are split by expert_slice instead, so that thread t computes
// the same rows of each of them that prefetch_expert_slices fetched into its cache beforehand (hybrid
// decode prefetches the experts it predicts while it waits for the GPU's routing). The outputs are the
// same bits either way: only which thread computes a row changes.
void expert_ffn(ThreadPool& pool, const ExpertWeights& w, const float* x, int n_tokens, int n_embd,
                const int32_t* token_of_slot, const int32_t* experts, int n_slots, float* out, Scratch& scratch,
                const int32_t* out_rows = nullptr, std::span<const int32_t> sliced = {},
                Activation act = Activation::SiLU);
// Rows [first, second) of a `rows`-row matrix that thread t of nth takes in the sliced split. Not in
// multiples of the kernels' 16-row blocking, unlike the shared split: rounded, 768 rows over 15
// threads would give some threads 64 rows of every sliced expert and others 48.
inline std::pair<int64_t, int64_t> expert_slice(int64_t rows, int t, int nth) {
  return {rows * t / nth, rows * (t + 1) / nth};
}
// Brings [p, p + n) into this core's caches: one plain load per 64-byte line. Loads rather than
// prefetch instructions, which the core may drop or leave queued: measured on the dev machine, 40 us
// of T1 prefetches "covered" 2.2 MB, more than its RAM can deliver in that time, and made the product
// after them no faster (bench/expert_prefetch.cpp).
void fetch_lines(const uint8_t* p, size_t n);
// Reads into the calling core's caches its expert_slice (thread t of nth) of the gate, up and down
// matrices of each expert of `experts` in turn (ids outside [0, n_expert) are skipped), until all are
// read or stop() returns true; stop() is asked every 4 KiB. Returns the bytes read. Changes no result.
template <typename Stop>
size_t prefetch_expert_slices(const ExpertWeights& w, std::span<const int32_t> experts, int t, int nth, Stop&& stop) {
  const int64_t n_expert = w.n_expert();
  size_t done = 0;
  for (const int32_t e : experts) {
    if (e < 0 || e >= n_expert) continue;
    for (const Weight* m : {&w.gate, &w.up, &w.gate_up, &w.down}) {
      if (!m->host) continue;
      const auto [r0, r1] = expert_slice(m->rows(), t, nth);
      const Weight me = m->expert(e);
      const uint8_t* p = me.row(r0);
      const size_t n = static_cast<size_t>(r1 - r0) * me.row_bytes;
      for (size_t off = 0; off < n; off += 4096) {
        if (stop()) return done;
        const size_t end = std::min(n, off + 4096);
        fetch_lines(p + off, end - off);
        done += end - off;
      }
    }
  }
  return done;
}
// out[t] = sum_j weights[t][j] * y[t * k + j], summed in j order (the reference's order).
void moe_combine(const float* y, const float* weights, int n_tokens, int k, int n_embd, float* out);

// Dense SwiGLU FFN: out = down(silu(gate x) * up x).
void dense_ffn(ThreadPool& pool, const Weight& gate, const Weight& up, const Weight& down, const float* x,
               int n_tokens, float* out, Scratch& scratch, Activation act = Activation::SiLU);

// Index of the largest value, lowest index on ties (the contract's greedy rule).
int32_t argmax(const float* x, int n);

}  // namespace fitmoe::cpu
