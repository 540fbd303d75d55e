#include "runtime/cpu_ops.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "quant/kernels.h"
#include "runtime/cpu_gemma4.h"
#include "runtime/error.h"
#include "runtime/kv_cache.h"

namespace fitmoe::cpu {

// ---- norms, embedding ---------------------------------------------------------------------------

void rms_norm(const float* x, const float* w, float* y, int n, int n_rows, float eps, int64_t ld_x,
              int64_t ld_y) {
  for (int r = 0; r < n_rows; ++r) {
    const float* xr = x + r * ld_x;
    float* yr = y + r * ld_y;
    double sum = 0;
    for (int i = 0; i < n; ++i) sum += static_cast<double>(xr[i] * xr[i]);
    const float scale = 1.0f / std::sqrt(static_cast<float>(sum / n + eps));
    if (w) {
      for (int i = 0; i < n; ++i) yr[i] = (xr[i] * scale) * w[i];
    } else {
      for (int i = 0; i < n; ++i) yr[i] = xr[i] * scale;
    }
  }
}

void embed(ThreadPool& pool, const Weight& table, std::span<const int32_t> tokens, float* out) {
  const int64_t n = table.cols();
  for (size_t t = 0; t < tokens.size(); ++t) {
    if (tokens[t] < 0 || tokens[t] >= table.rows())
      throw Error("token id " + std::to_string(tokens[t]) + " is outside the vocabulary (0.." +
                  std::to_string(table.rows() - 1) + ")");
  }
  pool.parallel_for(static_cast<int64_t>(tokens.size()), 1, [&](int64_t b, int64_t e, int) {
    for (int64_t t = b; t < e; ++t) quant::dequantize_row_ref(table.type, table.row(tokens[t]), out + t * n, n);
  });
}

// ---- matmul -------------------------------------------------------------------------------------

size_t quantized_acts_bytes(DType act_type, int64_t n, int n_rows) {
  return row_bytes(act_type, n) * static_cast<size_t>(n_rows);
}

QuantizedActs quantize_acts(ThreadPool& pool, DType act_type, const float* x, int64_t ld_x, int64_t n,
                            int n_rows, uint8_t* buf) {
  QuantizedActs q;
  q.type = act_type;
  q.n = n;
  q.stride = row_bytes(act_type, n);
  q.n_rows = n_rows;
  q.data = buf;
  auto fn = quant::quantize_act_fn(act_type);
  // One row is a microsecond of work: only batches are worth spreading over threads.
  if (n_rows < 4) {
    for (int r = 0; r < n_rows; ++r) fn(x + r * ld_x, buf + r * q.stride, n);
  } else {
    pool.parallel_for(n_rows, 1, [&](int64_t b, int64_t e, int) {
      for (int64_t r = b; r < e; ++r) fn(x + r * ld_x, buf + r * q.stride, n);
    });
  }
  return q;
}

namespace {

// Work split of a (rows x tokens) product: row blocks sized so each thread gets several items
// (dynamic balancing) while keeping each block long enough to stream weights efficiently, and token
// blocks that keep the activations of one item in L2.
struct Tiling {
  int64_t row_block, tok_block, n_row_blocks, n_tok_blocks;
};

Tiling plan_tiles(int64_t rows, int64_t tokens, int n_threads) {
  Tiling t;
  t.tok_block = std::min<int64_t>(tokens, 64);
  t.n_tok_blocks = (tokens + t.tok_block - 1) / t.tok_block;
  int64_t want_items = static_cast<int64_t>(n_threads) * 4;
  int64_t rb = (rows * t.n_tok_blocks + want_items - 1) / want_items;
  rb = std::max<int64_t>(16, (rb + 15) / 16 * 16);
  t.row_block = std::min(rows, rb);
  t.n_row_blocks = (rows + t.row_block - 1) / t.row_block;
  return t;
}

}  // namespace

void matmul_many(ThreadPool& pool, std::span<const MatmulJob> jobs, const QuantizedActs& x) {
  // Item list over all jobs: (job, row block, token block), tiled as one matrix of all their rows.
  int64_t total_rows = 0;
  for (auto& j : jobs) total_rows += j.w->rows();
  const Tiling t = plan_tiles(total_rows, x.n_rows, pool.size());
  struct Span { int64_t first_item, n_row_blocks; };
  std::vector<Span> spans;
  int64_t n_items = 0;
  for (auto& j : jobs) {
    const int64_t nrb = (j.w->rows() + t.row_block - 1) / t.row_block;
    spans.push_back({n_items, nrb});
    n_items += nrb * t.n_tok_blocks;
  }
  pool.parallel_for(n_items, 1, [&](int64_t b, int64_t e, int) {
    size_t ji = 0;
    for (int64_t item = b; item < e; ++item) {
      while (ji + 1 < spans.size() && item >= spans[ji + 1].first_item) ++ji;
      while (item < spans[ji].first_item) --ji;
      const MatmulJob& job = jobs[ji];
      const auto& k = quant::kernels_for(job.w->type);
      const int64_t local = item - spans[ji].first_item;
      const int64_t rb = local / t.n_tok_blocks, tb = local % t.n_tok_blocks;
      const int64_t r0 = rb * t.row_block, t0 = tb * t.tok_block;
      const int nr = static_cast<int>(std::min(t.row_block, job.w->rows() - r0));
      const int nc = static_cast<int>(std::min<int64_t>(t.tok_block, x.n_rows - t0));
      k.matmul_tile(job.w->cols(), job.w->row(r0), job.w->row_bytes, nr, x.data + t0 * x.stride, x.stride, nc,
                    job.y + t0 * job.ld_y + r0, static_cast<size_t>(job.ld_y));
    }
  });
}

void matmul(ThreadPool& pool, const Weight& w, const QuantizedActs& x, float* y, int64_t ld_y) {
  const MatmulJob job{&w, y, ld_y};
  matmul_many(pool, std::span<const MatmulJob>(&job, 1), x);
}

void matmul(ThreadPool& pool, const Weight& w, const float* x, int64_t ld_x, int n_tokens, float* y,
            int64_t ld_y, Scratch& scratch, size_t slot) {
  DType act = dtype_info(w.type).act_type;
  uint8_t* buf = scratch.bytes(slot, quantized_acts_bytes(act, w.cols(), n_tokens));
  QuantizedActs q = quantize_acts(pool, act, x, ld_x, w.cols(), n_tokens, buf);
  matmul(pool, w, q, y, ld_y);
}

// ---- rope ---------------------------------------------------------------------------------------

void rope_neox(float* x, int n_tokens, int n_heads, int head_dim, int64_t ld, int n_rot, int pos0,
               const RopeParams& rope, const float* freq_factors) {
  const float theta_scale = std::pow(rope.base, -2.0f / static_cast<float>(n_rot));
  const int half = n_rot / 2;
  const float freq_scale = rope.freq_scale, ext = rope.ext_factor;
  // Multiplying by an mscale of exactly 1 changes no bits, so the unscaled path stays the plain one.
  const float mscale = rope.mscale();
  // The YaRN ramp depends on the pair only: once per call.
  std::vector<float> mix(ext != 0.0f ? static_cast<size_t>(half) : 0);
  for (int i = 0; i < static_cast<int>(mix.size()); ++i) mix[i] = rope_yarn_ramp(rope.corr_lo, rope.corr_hi, i) * ext;
  std::vector<float> cs(static_cast<size_t>(n_rot));
  for (int t = 0; t < n_tokens; ++t) {
    // cos/sin table for this position, angles advanced by repeated multiplication as the reference.
    float theta = static_cast<float>(pos0 + t);
    for (int i = 0; i < half; ++i) {
      // The reference divides the unscaled angle by the pair's factor, then scales (YaRN) from there.
      const float te = freq_factors ? theta / freq_factors[i] : theta;
      float th = freq_scale * te;
      if (ext != 0.0f) th = th * (1.0f - mix[i]) + te * mix[i];
      cs[2 * i] = std::cos(th) * mscale;
      cs[2 * i + 1] = std::sin(th) * mscale;
      theta *= theta_scale;
    }
    for (int h = 0; h < n_heads; ++h) {
      float* v = x + t * ld + static_cast<int64_t>(h) * head_dim;
      for (int i = 0; i < half; ++i) {
        const float x0 = v[i], x1 = v[i + half];
        v[i] = x0 * cs[2 * i] - x1 * cs[2 * i + 1];
        v[i + half] = x0 * cs[2 * i + 1] + x1 * cs[2 * i];
      }
    }
  }
}

// ---- attention ----------------------------------------------------------------------------------

namespace {

size_t elem_bytes(DType t) { return t == DType::F32 ? 4 : 2; }

// The non-flash path (f16 / f32 / bf16 caches, V transposed): see attention() in cpu_ops.h.
void attention_plain(ThreadPool& pool, const float* q, int64_t ld_q, const KvView& kv, int pos0, int n_tokens,
                     int n_head, int n_head_kv, int head_dim, int head_dim_v, float scale, float* out,
                     int64_t ld_out, Scratch& scratch, size_t slot, int window) {
  const int group = n_head / n_head_kv;
  const size_t es = elem_bytes(kv.type);
  const auto& kern = quant::kernels_for(kv.type);
  auto to_cache_type = quant::quantize_act_fn(kv.type);  // f32 -> f16 rounding (or a copy for f32)
  // Work items: (kv head, block of tokens). Each item's query heads share the kv head's K and V, so
  // the group's queries are the activation columns of one K.Q product and one V^T.P product.
  const int want_items = pool.size() * 2;
  int tok_block = std::max(1, (n_tokens * n_head_kv + want_items - 1) / want_items);
  tok_block = std::min(tok_block, 64);
  const int n_tb = (n_tokens + tok_block - 1) / tok_block;
  const int max_cols = tok_block * group;
  // A block's keys: positions lo .. pos0 + t0 + nt - 1, lo = 0 without a window.
  const int max_keys = window > 0 ? std::min(pos0 + n_tokens, window - 1 + tok_block) : pos0 + n_tokens;
  if (kv.ring && window > 0 && std::min(pos0 + n_tokens, window - 1 + n_tokens) > kv.n_ctx)
    throw Error("attention: a ring cache of " + std::to_string(kv.n_ctx) + " positions cannot hold a window of " +
                std::to_string(window) + " for " + std::to_string(n_tokens) + " queries");
  const size_t per_thread = static_cast<size_t>(max_cols) * (head_dim + max_keys) * es +   // Q, P in cache type
                            static_cast<size_t>(max_cols) * (max_keys + head_dim_v) * sizeof(float) +  // S, O
                            (kv.ring ? static_cast<size_t>(max_cols) * head_dim_v * sizeof(float) : 0);  // O of a wrapped run
  uint8_t* base = scratch.bytes(slot, per_thread * pool.size());

  pool.parallel_for(static_cast<int64_t>(n_head_kv) * n_tb, 1, [&](int64_t b, int64_t e, int tid) {
    uint8_t* qc = base + per_thread * tid;
    uint8_t* pc = qc + static_cast<size_t>(max_cols) * head_dim * es;
    float* sc = reinterpret_cast<float*>(pc + static_cast<size_t>(max_cols) * max_keys * es);
    float* oc = sc + static_cast<size_t>(max_cols) * max_keys;
    for (int64_t item = b; item < e; ++item) {
      const int g = static_cast<int>(item / n_tb);
      const int t0 = static_cast<int>(item % n_tb) * tok_block;
      const int nt = std::min(tok_block, n_tokens - t0);
      const int cols = nt * group;
      const int hi = pos0 + t0 + nt;  // one past the block's last query's position
      const int lo = window > 0 ? std::max(0, pos0 + t0 - window + 1) : 0;  // the first query's oldest key
      const int n_keys = hi - lo;
      // Column c = (token t0 + c / group, head g * group + c % group).
      for (int c = 0; c < cols; ++c) {
        const float* qh = q + (t0 + c / group) * ld_q + static_cast<int64_t>(g * group + c % group) * head_dim;
        to_cache_type(qh, qc + static_cast<size_t>(c) * head_dim * es, head_dim);
      }
      // Keys lo .. hi - 1 in position order: one run of slots, or two where a ring wraps.
      const int s0 = kv.slot(lo);
      const int run1 = std::min(n_keys, kv.n_ctx - s0), run2 = n_keys - run1;
      const uint8_t* kg = kv.k + static_cast<size_t>(g) * head_dim * es;
      kern.matmul_tile(head_dim, kg + s0 * kv.k_row_bytes, kv.k_row_bytes, run1, qc, head_dim * es, cols, sc, n_keys);
      if (run2 > 0)
        kern.matmul_tile(head_dim, kg, kv.k_row_bytes, run2, qc, head_dim * es, cols, sc + run1, n_keys);
      for (int c = 0; c < cols; ++c) {
        float* s = sc + static_cast<size_t>(c) * n_keys;
        const int visible = pos0 + t0 + c / group + 1 - lo;  // causal
        // The window's oldest key for this query (masked keys are -inf in the reference: exactly 0 here).
        const int first = window > 0 ? std::max(0, visible - window) : 0;
        for (int j = 0; j < first; ++j) s[j] = 0.0f;
        float mx = -INFINITY;
        for (int j = first; j < visible; ++j) {
          s[j] *= scale;
          mx = std::max(mx, s[j]);
        }
        double sum = 0;
        for (int j = first; j < visible; ++j) {
          s[j] = std::exp(s[j] - mx);
          sum += s[j];
        }
        const float inv = static_cast<float>(1.0 / sum);
        for (int j = first; j < visible; ++j) s[j] *= inv;
        for (int j = visible; j < n_keys; ++j) s[j] = 0.0f;
        to_cache_type(s, pc + static_cast<size_t>(c) * n_keys * es, n_keys);
      }
      const uint8_t* vg = kv.v + static_cast<size_t>(g) * head_dim_v * kv.n_ctx * es;
      kern.matmul_tile(run1, vg + static_cast<size_t>(s0) * es, static_cast<size_t>(kv.n_ctx) * es, head_dim_v, pc,
                       n_keys * es, cols, oc, head_dim_v);
      if (run2 > 0) {
        // The wrapped keys' share, added to the first run's (one more f32 rounding per output).
        float* o2 = oc + static_cast<size_t>(max_cols) * head_dim_v;
        kern.matmul_tile(run2, vg, static_cast<size_t>(kv.n_ctx) * es, head_dim_v, pc + static_cast<size_t>(run1) * es,
                         n_keys * es, cols, o2, head_dim_v);
        for (int i = 0; i < cols * head_dim_v; ++i) oc[i] += o2[i];
      }
      for (int c = 0; c < cols; ++c)
        std::memcpy(out + (t0 + c / group) * ld_out + static_cast<int64_t>(g * group + c % group) * head_dim_v,
                    oc + static_cast<size_t>(c) * head_dim_v, sizeof(float) * head_dim_v);
    }
  });
}

// The accumulator updates of flash attention, as ggml's vec_mad / vec_scale: y = fma(x, v, y) and
// y = y * v, in f32 or with f16 rounding after each (F16C where the CPU has it: the reference's
// AVX2 path, same bits; a portable fallback with the exact conversions otherwise). This file is
// built without -mfma, so the fused forms come from functions compiled for AVX2 + FMA + F16C.
#if defined(__x86_64__)
bool has_avx2() { return quant::cpu_isa() != quant::Isa::Scalar; }

__attribute__((target("avx2,fma,f16c"))) void mad_f32_avx2(float* y, const float* x, float v, int n) {
  const __m256 vv = _mm256_set1_ps(v);
  int i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(_mm256_loadu_ps(x + i), vv, _mm256_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] = __builtin_fmaf(x[i], v, y[i]);
}
__attribute__((target("avx2,fma,f16c"))) void mad_f16_avx2(uint16_t* y, const uint16_t* x, float v, int n) {
  const __m256 vv = _mm256_set1_ps(v);
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 a = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(y + i)));
    const __m256 b = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(y + i), _mm256_cvtps_ph(_mm256_fmadd_ps(b, vv, a), _MM_FROUND_TO_NEAREST_INT));
  }
  for (; i < n; ++i) y[i] = f32_to_f16(__builtin_fmaf(f16_to_f32(x[i]), v, f16_to_f32(y[i])));
}
__attribute__((target("avx2,fma,f16c"))) void scale_f16_avx2(uint16_t* y, float v, int n) {
  const __m256 vv = _mm256_set1_ps(v);
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 a = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(y + i)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(y + i), _mm256_cvtps_ph(_mm256_mul_ps(a, vv), _MM_FROUND_TO_NEAREST_INT));
  }
  for (; i < n; ++i) y[i] = f32_to_f16(f16_to_f32(y[i]) * v);
}

#else
bool has_avx2() { return false; }
void mad_f32_avx2(float*, const float*, float, int) {}
void mad_f16_avx2(uint16_t*, const uint16_t*, float, int) {}
void scale_f16_avx2(uint16_t*, float, int) {}
#endif

void mad_f32(float* y, const float* x, float v, int n) {
  if (has_avx2()) return mad_f32_avx2(y, x, v, n);
  for (int i = 0; i < n; ++i) y[i] = std::fma(x[i], v, y[i]);
}
void mad_f16(uint16_t* y, const uint16_t* x, float v, int n) {
  if (has_avx2()) return mad_f16_avx2(y, x, v, n);
  for (int i = 0; i < n; ++i) y[i] = f32_to_f16(std::fma(f16_to_f32(x[i]), v, f16_to_f32(y[i])));
}
void scale_f16(uint16_t* y, float v, int n) {
  if (has_avx2()) return scale_f16_avx2(y, v, n);
  for (int i = 0; i < n; ++i) y[i] = f32_to_f16(f16_to_f32(y[i]) * v);
}

// Flash attention (KvView::flash): see cpu_ops.h. Work items are (kv head, block of tokens) as in the
// plain path; each item walks its keys in chunks of kKeyChunk positions: the chunk's scores for all of
// the item's query columns in one tile product, its V rows decoded once (f32 accumulation), then per
// column the online softmax over the chunk's keys in position order.
constexpr int kKeyChunk = 256;

void attention_flash(ThreadPool& pool, const float* q, int64_t ld_q, const KvView& kv, int pos0, int n_tokens,
                     int n_head, int n_head_kv, int head_dim, int head_dim_v, float scale, float* out,
                     int64_t ld_out, Scratch& scratch, size_t slot, int window) {
  const int group = n_head / n_head_kv;
  // The reference's tiled kernel (f16 K and V, a batch of at least 64 queries) computes in f32; tq K
  // is decoded to f32 as well (a reference path: no kernel reads tq blocks directly yet).
  const bool ref_tiled = kv.type == DType::F16 && kv.v_type == DType::F16 && n_tokens >= 64;
  const bool tiled = ref_tiled || kv_type_is_tq(kv.type);
  const DType k_dot = tiled ? DType::F32 : kv.type;  // the type the scores' product reads K as
  const auto& kern = quant::kernels_for(k_dot);
  const DType q_type = kern.act_type;
  auto to_q = quant::quantize_act_fn(q_type);
  const bool f16_acc = !ref_tiled && kv.v_type == DType::F16;  // V accumulated in f16, rounded at every key
  const size_t k_head_bytes = kv_row_bytes(kv.type, head_dim), v_head_bytes = kv_row_bytes(kv.v_type, head_dim_v);
  const size_t q_bytes = row_bytes(q_type, head_dim);
  const int want_items = pool.size() * 2;
  int tok_block = std::max(1, (n_tokens * n_head_kv + want_items - 1) / want_items);
  tok_block = std::min(tok_block, 64);
  const int n_tb = (n_tokens + tok_block - 1) / tok_block;
  const int max_cols = tok_block * group;
  if (kv.ring && window > 0 && std::min(pos0 + n_tokens, window - 1 + n_tokens) > kv.n_ctx)
    throw Error("attention: a ring cache of " + std::to_string(kv.n_ctx) + " positions cannot hold a window of " +
                std::to_string(window) + " for " + std::to_string(n_tokens) + " queries");
  // Per thread: Q in its dot format, the chunk's scores, K (tiled: f32) and V of the chunk in f32,
  // and per column the softmax state and accumulator.
  const size_t per_thread = static_cast<size_t>(max_cols) * q_bytes + 64 +
                            static_cast<size_t>(max_cols) * kKeyChunk * sizeof(float) +
                            static_cast<size_t>(kKeyChunk) * (tiled ? head_dim : 0) * sizeof(float) +
                            static_cast<size_t>(kKeyChunk) * head_dim_v * sizeof(float) +
                            static_cast<size_t>(max_cols) * (2 + head_dim_v) * sizeof(float) +
                            static_cast<size_t>(max_cols) * head_dim_v * sizeof(uint16_t) + 64;
  uint8_t* base = scratch.bytes(slot, per_thread * pool.size());

  pool.parallel_for(static_cast<int64_t>(n_head_kv) * n_tb, 1, [&](int64_t b, int64_t e, int tid) {
    uint8_t* qc = base + per_thread * tid;
    float* sc = reinterpret_cast<float*>(qc + ((static_cast<size_t>(max_cols) * q_bytes + 63) & ~size_t{63}));
    float* k32 = sc + static_cast<size_t>(max_cols) * kKeyChunk;
    float* v32 = k32 + static_cast<size_t>(kKeyChunk) * (tiled ? head_dim : 0);
    float* m_run = v32 + static_cast<size_t>(kKeyChunk) * head_dim_v;  // [cols] running maximum
    float* s_run = m_run + max_cols;                                     // [cols] running sum
    float* acc = s_run + max_cols;                                       // [cols][head_dim_v] f32 accumulators
    uint16_t* acc16 = reinterpret_cast<uint16_t*>(acc + static_cast<size_t>(max_cols) * head_dim_v);
    for (int64_t item = b; item < e; ++item) {
      const int g = static_cast<int>(item / n_tb);
      const int t0 = static_cast<int>(item % n_tb) * tok_block;
      const int nt = std::min(tok_block, n_tokens - t0);
      const int cols = nt * group;
      const int hi = pos0 + t0 + nt;
      const int lo = window > 0 ? std::max(0, pos0 + t0 - window + 1) : 0;
      for (int c = 0; c < cols; ++c) {
        const float* qh = q + (t0 + c / group) * ld_q + static_cast<int64_t>(g * group + c % group) * head_dim;
        to_q(qh, qc + static_cast<size_t>(c) * q_bytes, head_dim);
        m_run[c] = -INFINITY;
        s_run[c] = 0.0f;
      }
      std::fill(acc, acc + static_cast<size_t>(cols) * head_dim_v, 0.0f);
      std::fill(acc16, acc16 + static_cast<size_t>(cols) * head_dim_v, uint16_t{0});
      const uint8_t* kg = kv.k + static_cast<size_t>(g) * k_head_bytes;
      const uint8_t* vg = kv.v + static_cast<size_t>(g) * v_head_bytes;
      for (int p0 = lo; p0 < hi; p0 += kKeyChunk) {
        const int nk = std::min(kKeyChunk, hi - p0);
        // The chunk's scores [c][j], one run of slots or two where a ring wraps.
        for (int j0 = 0; j0 < nk;) {
          const int s0 = kv.slot(p0 + j0);
          const int run = std::min(nk - j0, kv.n_ctx - s0);
          if (tiled) {
            for (int j = 0; j < run; ++j)
              kv_dequantize_row(kv.type, kg + static_cast<size_t>(s0 + j) * kv.k_row_bytes, k32 + static_cast<size_t>(j) * head_dim,
                                head_dim, kv.tq_block_k);
            kern.matmul_tile(head_dim, k32, head_dim * sizeof(float), run, qc, q_bytes, cols, sc + j0, kKeyChunk);
          } else {
            kern.matmul_tile(head_dim, kg + static_cast<size_t>(s0) * kv.k_row_bytes, kv.k_row_bytes, run, qc, q_bytes,
                             cols, sc + j0, kKeyChunk);
          }
          j0 += run;
        }
        if (!f16_acc)
          for (int j = 0; j < nk; ++j)
            kv_dequantize_row(kv.v_type, vg + static_cast<size_t>(kv.slot(p0 + j)) * kv.v_row_bytes,
                              v32 + static_cast<size_t>(j) * head_dim_v, head_dim_v, kv.tq_block_v);
        for (int c = 0; c < cols; ++c) {
          const int p = pos0 + t0 + c / group;  // the query's position: keys p - window + 1 .. p
          const int first = window > 0 ? std::max(p0, p - window + 1) : p0;
          const int last = std::min(p0 + nk, p + 1);
          const float* srow = sc + static_cast<size_t>(c) * kKeyChunk;
          float M = m_run[c], S = s_run[c];
          float* a32 = acc + static_cast<size_t>(c) * head_dim_v;
          uint16_t* a16 = acc16 + static_cast<size_t>(c) * head_dim_v;
          for (int kp = first; kp < last; ++kp) {
            const float s = srow[kp - p0] * scale;
            float ms = 1.0f, vs = 1.0f;
            if (s > M) {
              const float m_old = M;
              M = s;
              ms = std::exp(m_old - M);
              if (f16_acc) {
                scale_f16(a16, ms, head_dim_v);
              } else {
                for (int d = 0; d < head_dim_v; ++d) a32[d] *= ms;
              }
            } else {
              vs = std::exp(s - M);
            }
            if (f16_acc)
              mad_f16(a16, reinterpret_cast<const uint16_t*>(vg + static_cast<size_t>(kv.slot(kp)) * kv.v_row_bytes), vs,
                      head_dim_v);
            else
              mad_f32(a32, v32 + static_cast<size_t>(kp - p0) * head_dim_v, vs, head_dim_v);
            S = S * ms + vs;
          }
          m_run[c] = M;
          s_run[c] = S;
        }
      }
      for (int c = 0; c < cols; ++c) {
        float* o = out + (t0 + c / group) * ld_out + static_cast<int64_t>(g * group + c % group) * head_dim_v;
        const float inv = s_run[c] == 0.0f ? 0.0f : 1.0f / s_run[c];
        const float* a32 = acc + static_cast<size_t>(c) * head_dim_v;
        const uint16_t* a16 = acc16 + static_cast<size_t>(c) * head_dim_v;
        for (int d = 0; d < head_dim_v; ++d) o[d] = (f16_acc ? f16_to_f32(a16[d]) : a32[d]) * inv;
      }
    }
  });
}

}  // namespace

void attention(ThreadPool& pool, const float* q, int64_t ld_q, const KvView& kv, int pos0, int n_tokens,
               int n_head, int n_head_kv, int head_dim, int head_dim_v, float scale, float* out,
               int64_t ld_out, Scratch& scratch, size_t slot, int window) {
  if (!kv.flash) {
    attention_plain(pool, q, ld_q, kv, pos0, n_tokens, n_head, n_head_kv, head_dim, head_dim_v, scale, out, ld_out,
                    scratch, slot, window);
    return;
  }
  if (kv.rot_k > 0) {
    // Q rotated as K was (the scratch slot after this op's own).
    const int64_t qw = static_cast<int64_t>(n_head) * head_dim;
    float* qr = scratch.floats(slot + 1, static_cast<size_t>(n_tokens) * qw);
    for (int t = 0; t < n_tokens; ++t) {
      std::memcpy(qr + t * qw, q + t * ld_q, sizeof(float) * qw);
      hadamard_blocks(qr + t * qw, qw, kv.rot_k);
    }
    q = qr;
    ld_q = qw;
  }
  attention_flash(pool, q, ld_q, kv, pos0, n_tokens, n_head, n_head_kv, head_dim, head_dim_v, scale, out, ld_out,
                  scratch, slot, window);
  if (kv.rot_v > 0)
    for (int t = 0; t < n_tokens; ++t) hadamard_blocks(out + t * ld_out, static_cast<int64_t>(n_head) * head_dim_v, kv.rot_v);
}

void kv_store(const KvView& kv, int pos0, int n_tokens, const float* k, int64_t ld_k, const float* v,
              int64_t ld_v, int k_width, int v_width) {
  // Rotated caches (flash attention only) rotate a copy of each row before it is stored.
  std::vector<float> rot(kv.rot_k > 0 || kv.rot_v > 0 ? std::max(k_width, v_width) : 0);
  std::vector<uint8_t> vrow;
  for (int t = 0; t < n_tokens; ++t) {
    const int s = kv.slot(pos0 + t);
    const float* kr = k + t * ld_k;
    const float* vr = v + t * ld_v;
    if (!kv.flash) {
      const size_t es = elem_bytes(kv.type);
      uint8_t* krow = kv.k + s * kv.k_row_bytes;
      kv_quantize_row(kv.type, kr, krow, k_width);
      // V transposed: the row converted once, then each value's bytes to its column.
      vrow.resize(static_cast<size_t>(v_width) * es);
      kv_quantize_row(kv.type, vr, vrow.data(), v_width);
      for (int i = 0; i < v_width; ++i)
        std::memcpy(kv.v + (static_cast<size_t>(i) * kv.n_ctx + s) * es, vrow.data() + static_cast<size_t>(i) * es, es);
      continue;
    }
    if (kv.rot_k > 0) {
      std::memcpy(rot.data(), kr, sizeof(float) * k_width);
      hadamard_blocks(rot.data(), k_width, kv.rot_k);
      kr = rot.data();
    }
    kv_quantize_row(kv.type, kr, kv.k + s * kv.k_row_bytes, k_width, kv.tq_block_k);
    if (kv.rot_v > 0) {
      std::memcpy(rot.data(), vr, sizeof(float) * v_width);
      hadamard_blocks(rot.data(), v_width, kv.rot_v);
      vr = rot.data();
    }
    kv_quantize_row(kv.v_type, vr, kv.v + s * kv.v_row_bytes, v_width, kv.tq_block_v);
  }
}

KvCache::KvCache(const std::vector<LayerSpec>& specs, int n_ctx, const KvCacheType& type) {
  std::vector<int> dk, dv;
  for (const LayerSpec& l : specs)
    if (l.is_attention()) dk.push_back(l.attn().head_dim), dv.push_back(l.attn().head_dim_v);
  check_kv_cache_type(type, dk, dv);
  const KvRotation rot = kv_rotation(type, dk, dv);
  const bool flash = type.flash_on();
  const size_t L = specs.size();
  views_.assign(L, KvView{type.k, nullptr, nullptr, 0, 0});
  src_.assign(L, 0);
  k_.resize(L);
  v_.resize(L);
  for (size_t l = 0; l < L; ++l) {
    src_[l] = static_cast<int>(l);
    if (!specs[l].is_attention()) continue;
    const AttnSpec& a = specs[l].attn();
    if (a.kv_from >= 0) {
      src_[l] = a.kv_from;
      continue;
    }
    KvView& v = views_[l];
    v.n_ctx = static_cast<int>(a.kv_positions(n_ctx));
    v.ring = a.window > 0;
    if (v.ring && v.n_ctx < n_ctx) window_ = std::max(window_, a.window);
    v.k_row_bytes = static_cast<int64_t>(a.n_head_kv) * static_cast<int64_t>(kv_row_bytes(type.k, a.head_dim));
    v.flash = flash;
    v.v_type = flash ? type.v : type.k;
    v.v_row_bytes = static_cast<int64_t>(a.n_head_kv) * static_cast<int64_t>(kv_row_bytes(v.v_type, a.head_dim_v));
    v.tq_block_k = tq_block(a.head_dim);
    v.tq_block_v = tq_block(a.head_dim_v);
    v.rot_k = flash ? rot.k : 0;
    v.rot_v = flash ? rot.v : 0;
    k_[l].assign(static_cast<size_t>(v.k_row_bytes) * v.n_ctx, 0);
    v_[l].assign(static_cast<size_t>(v.v_row_bytes) * v.n_ctx, 0);
    v.k = k_[l].data();
    v.v = v_[l].data();
  }
}

size_t KvCache::bytes() const {
  size_t b = 0;
  for (size_t l = 0; l < k_.size(); ++l) b += k_[l].size() + v_[l].size();
  return b;
}

// ---- FFN ----------------------------------------------------------------------------------------

void swiglu(const float* gate, const float* up, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    out[i] = g / (1.0f + std::exp(-g)) * up[i];
  }
}

void glu(Activation act, const float* gate, const float* up, float* out, int64_t n) {
  if (act == Activation::GeluTanh) geglu(gate, up, out, n);
  else swiglu(gate, up, out, n);
}

void route_softmax_topk(const float* logits, int n_expert, int k, bool renormalise, int32_t* experts,
                        float* weights) {
  float mx = -INFINITY;
  for (int e = 0; e < n_expert; ++e) mx = std::max(mx, logits[e]);
  std::vector<float> p(static_cast<size_t>(n_expert));
  double sum = 0;
  for (int e = 0; e < n_expert; ++e) {
    p[e] = std::exp(logits[e] - mx);
    sum += p[e];
  }
  const float inv = static_cast<float>(1.0 / sum);
  for (int e = 0; e < n_expert; ++e) p[e] *= inv;
  std::vector<int32_t> idx(static_cast<size_t>(n_expert));
  std::iota(idx.begin(), idx.end(), 0);
  std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), [&](int32_t a, int32_t b) {
    return p[a] > p[b] || (p[a] == p[b] && a < b);
  });
  double wsum = 0;
  for (int j = 0; j < k; ++j) {
    experts[j] = idx[j];
    weights[j] = p[idx[j]];
    wsum += weights[j];
  }
  if (renormalise) {
    const float s = std::max(static_cast<float>(wsum), 6.103515625e-5f);
    for (int j = 0; j < k; ++j) weights[j] /= s;
  }
}

void fetch_lines(const uint8_t* p, size_t n) {
  if (n == 0) return;
  // A byte of every 64-byte line that [p, p + n) touches: p itself, then each line start after it.
  // Four sums, so that the loads are independent and in flight together, and kept by the compiler.
  const uint8_t* const end = p + n;
  const uint8_t* line = p + (64 - (reinterpret_cast<uintptr_t>(p) & 63));
  unsigned s0 = *p, s1 = 0, s2 = 0, s3 = 0;
  for (; line + 3 * 64 < end; line += 4 * 64) s0 += line[0], s1 += line[64], s2 += line[128], s3 += line[192];
  for (; line < end; line += 64) s0 += *line;
  const unsigned s = s0 + s1 + s2 + s3;
  __asm__ volatile("" ::"r"(s));
}

void expert_ffn(ThreadPool& pool, const ExpertWeights& w, const float* x, int n_tokens, int n_embd,
                const int32_t* token_of_slot, const int32_t* experts, int n_assign, float* out, Scratch& scratch,
                const int32_t* out_rows, std::span<const int32_t> sliced, Activation act) {
  const int n_expert = static_cast<int>(w.n_expert());
  const int64_t n_ff = w.n_ff();
  // Fused gate_up: the gate and up rows are the two halves of one matrix per expert.
  const Weight& wg = w.fused() ? w.gate_up : w.gate;
  const Weight& wu = w.fused() ? w.gate_up : w.up;
  const int64_t up_row0 = w.fused() ? n_ff : 0;

  // Group the (token, slot) assignments by expert: expert e owns rows [offset[e], offset[e+1]) of the
  // grouped buffers, tokens in ascending order, so each expert's weights are read once per batch.
  std::vector<int> offset(static_cast<size_t>(n_expert) + 1, 0);
  for (int a = 0; a < n_assign; ++a) {
    if (experts[a] < 0 || experts[a] >= n_expert) throw Error("router chose an expert out of range");
    offset[experts[a] + 1]++;
  }
  for (int e = 0; e < n_expert; ++e) offset[e + 1] += offset[e];
  std::vector<int> grouped(static_cast<size_t>(n_assign));  // grouped row -> assignment (slot) index
  {
    std::vector<int> fill(offset.begin(), offset.end() - 1);
    for (int a = 0; a < n_assign; ++a) grouped[fill[experts[a]]++] = a;
  }
  std::vector<int> active;
  for (int e = 0; e < n_expert; ++e)
    if (offset[e + 1] > offset[e]) active.push_back(e);

  // Inputs in the gate/up activation format, gathered per expert.
  const DType act_in = dtype_info(wg.type).act_type;
  if (dtype_info(wu.type).act_type != act_in) throw Error("ffn_gate_exps and ffn_up_exps types need the same activation format");
  const size_t in_stride = row_bytes(act_in, n_embd);
  uint8_t* xq = scratch.bytes(10, in_stride * n_tokens);
  QuantizedActs xa = quantize_acts(pool, act_in, x, n_embd, n_embd, n_tokens, xq);
  uint8_t* xg = scratch.bytes(11, in_stride * n_assign);
  for (int r = 0; r < n_assign; ++r) {
    const int t = token_of_slot[grouped[r]];
    if (t < 0 || t >= n_tokens) throw Error("expert_ffn: token index out of range");
    std::memcpy(xg + r * in_stride, xa.data + static_cast<size_t>(t) * in_stride, in_stride);
  }

  float* g = scratch.floats(12, static_cast<size_t>(n_assign) * n_ff);
  float* u = scratch.floats(13, static_cast<size_t>(n_assign) * n_ff);
  const DType act_mid = dtype_info(w.down.type).act_type;
  const size_t mid_stride = row_bytes(act_mid, n_ff);
  uint8_t* hq = scratch.bytes(14, mid_stride * n_assign);
  float* d = scratch.floats(15, static_cast<size_t>(n_assign) * n_embd);

  const auto& kern_gate = quant::kernels_for(wg.type);
  const auto& kern_up = quant::kernels_for(wu.type);
  const auto& kern_down = quant::kernels_for(w.down.type);
  auto qmid = quant::quantize_act_fn(act_mid);
  // Rows [r0, r0 + nr) of expert e's gate and up (or down) products for all of its grouped slots.
  auto gate_up_rows = [&](int e, int64_t r0, int nr) {
    const int a0 = offset[e], nc = offset[e + 1] - offset[e];
    const Weight mg = wg.expert(e), mu = wu.expert(e);
    kern_gate.matmul_tile(mg.cols(), mg.row(r0), mg.row_bytes, nr, xg + a0 * in_stride, in_stride, nc,
                          g + static_cast<int64_t>(a0) * n_ff + r0, static_cast<size_t>(n_ff));
    kern_up.matmul_tile(mu.cols(), mu.row(up_row0 + r0), mu.row_bytes, nr, xg + a0 * in_stride, in_stride, nc,
                        u + static_cast<int64_t>(a0) * n_ff + r0, static_cast<size_t>(n_ff));
  };
  // The down rows go straight to their place in out (one slot), or through d and a copy of this
  // thread's columns (several slots of one expert are not evenly spaced in out): no serial copy after.
  auto out_row = [&](int i) { return out + static_cast<int64_t>(out_rows ? out_rows[grouped[i]] : grouped[i]) * n_embd; };
  auto down_rows = [&](int e, int64_t r0, int nr) {
    const int a0 = offset[e], nc = offset[e + 1] - offset[e];
    const Weight md = w.down.expert(e);
    if (nc == 1) {
      kern_down.matmul_tile(md.cols(), md.row(r0), md.row_bytes, nr, hq + a0 * mid_stride, mid_stride, 1,
                            out_row(a0) + r0, static_cast<size_t>(n_embd));
      return;
    }
    kern_down.matmul_tile(md.cols(), md.row(r0), md.row_bytes, nr, hq + a0 * mid_stride, mid_stride, nc,
                          d + static_cast<int64_t>(a0) * n_embd + r0, static_cast<size_t>(n_embd));
    for (int i = a0; i < a0 + nc; ++i)
      std::memcpy(out_row(i) + r0, d + static_cast<int64_t>(i) * n_embd + r0, sizeof(float) * nr);
  };
  auto swiglu_quant = [&](int64_t r) {
    float* gr = g + r * n_ff;
    glu(act, gr, u + r * n_ff, gr, n_ff);
    qmid(gr, hq + r * mid_stride, n_ff);
  };

  if (n_tokens <= kExpertFfnStaticTokens) {
    // Decode: a few slots per expert, so every row costs about the same (its weight bytes). One job:
    // each thread takes an equal contiguous share of the (active expert, row) space, phases separated
    // by spinning barriers. Equal shares finish together, where dynamic blocks of a few hundred rows
    // left a tail of one block on some threads, and one dispatch replaces three.
    // The sliced experts (those a thread may hold its slice of already, see expert_slice) first, each
    // thread its own slice of each; then the rest.
    std::vector<int> by_slice, shared;
    for (const int e : active)
      (std::find(sliced.begin(), sliced.end(), e) != sliced.end() ? by_slice : shared).push_back(e);
    const int64_t n_act = static_cast<int64_t>(shared.size());
    SpinBarrier barrier(pool.size());
    // Thread tid's share of n_act * rows rows of the other experts, in multiples of 16 rows (the
    // kernels' row blocking).
    auto share = [&](int64_t rows, int tid, int nth, auto&& fn) {
      for (const int e : by_slice) {
        const auto [r0, r1] = expert_slice(rows, tid, nth);
        if (r1 > r0) fn(e, r0, static_cast<int>(r1 - r0));
      }
      const int64_t total = n_act * rows;
      int64_t lo = total * tid / nth / 16 * 16, hi = tid + 1 == nth ? total : total * (tid + 1) / nth / 16 * 16;
      while (lo < hi) {
        const int64_t e_idx = lo / rows, r0 = lo % rows, nr = std::min(hi, (e_idx + 1) * rows) - lo;
        fn(shared[e_idx], r0, static_cast<int>(nr));
        lo += nr;
      }
    };
    pool.run([&](int tid, int nth) {
      share(n_ff, tid, nth, gate_up_rows);
      barrier.arrive_and_wait();
      for (int64_t r = tid; r < n_assign; r += nth) swiglu_quant(r);
      barrier.arrive_and_wait();
      share(n_embd, tid, nth, down_rows);
    });
  } else {
    // Prefill: items = (active expert, row block), row blocks sized for about 4 items per thread, taken
    // dynamically (experts with more tokens cost more).
    auto run_items = [&](int64_t rows, auto&& fn) {
      const int64_t want = static_cast<int64_t>(pool.size()) * 4;
      int64_t rb = (rows * static_cast<int64_t>(active.size()) + want - 1) / want;
      rb = std::min(rows, std::max<int64_t>(16, (rb + 15) / 16 * 16));
      const int64_t n_rb = (rows + rb - 1) / rb;
      pool.parallel_for(static_cast<int64_t>(active.size()) * n_rb, 1, [&](int64_t b, int64_t e_, int) {
        for (int64_t item = b; item < e_; ++item) {
          const int64_t r0 = (item % n_rb) * rb;
          fn(active[item / n_rb], r0, static_cast<int>(std::min(rb, rows - r0)));
        }
      });
    };
    run_items(n_ff, gate_up_rows);
    pool.parallel_for(n_assign, 1, [&](int64_t b, int64_t e, int) {
      for (int64_t r = b; r < e; ++r) swiglu_quant(r);
    });
    run_items(n_embd, down_rows);
  }
}

void moe_ffn(ThreadPool& pool, const ExpertWeights& w, const float* x, int n_tokens, int n_embd,
             const int32_t* experts, const float* weights, int k, float* out, Scratch& scratch, Activation act) {
  const int n_assign = n_tokens * k;
  std::vector<int32_t> token_of(static_cast<size_t>(n_assign));
  for (int a = 0; a < n_assign; ++a) token_of[a] = a / k;
  float* y = scratch.floats(16, static_cast<size_t>(n_assign) * n_embd);
  expert_ffn(pool, w, x, n_tokens, n_embd, token_of.data(), experts, n_assign, y, scratch, nullptr, {}, act);
  moe_combine(y, weights, n_tokens, k, n_embd, out);
}

void moe_combine(const float* y, const float* weights, int n_tokens, int k, int n_embd, float* out) {
  for (int t = 0; t < n_tokens; ++t) {
    float* o = out + static_cast<int64_t>(t) * n_embd;
    for (int j = 0; j < k; ++j) {
      const float wj = weights[t * k + j];
      const float* dr = y + static_cast<int64_t>(t * k + j) * n_embd;
      if (j == 0) {
        for (int i = 0; i < n_embd; ++i) o[i] = dr[i] * wj;
      } else {
        for (int i = 0; i < n_embd; ++i) o[i] += dr[i] * wj;
      }
    }
  }
}

void dense_ffn(ThreadPool& pool, const Weight& gate, const Weight& up, const Weight& down, const float* x,
               int n_tokens, float* out, Scratch& scratch, Activation glu_act) {
  const int64_t n_embd = gate.cols(), n_ff = gate.rows();
  float* g = scratch.floats(20, static_cast<size_t>(n_tokens) * n_ff);
  float* u = scratch.floats(21, static_cast<size_t>(n_tokens) * n_ff);
  DType act = dtype_info(gate.type).act_type;
  uint8_t* buf = scratch.bytes(22, quantized_acts_bytes(act, n_embd, n_tokens));
  QuantizedActs xa = quantize_acts(pool, act, x, n_embd, n_embd, n_tokens, buf);
  matmul(pool, gate, xa, g, n_ff);
  if (dtype_info(up.type).act_type == act) {
    matmul(pool, up, xa, u, n_ff);
  } else {
    matmul(pool, up, x, n_embd, n_tokens, u, n_ff, scratch, 23);
  }
  for (int64_t i = 0; i < n_tokens * n_ff; i += n_ff) glu(glu_act, g + i, u + i, g + i, n_ff);
  matmul(pool, down, g, n_ff, n_tokens, out, down.rows(), scratch, 24);
}

int32_t argmax(const float* x, int n) {
  int32_t best = 0;
  for (int i = 1; i < n; ++i)
    if (x[i] > x[best]) best = i;
  return best;
}

}  // namespace fitmoe::cpu
