// Kernels of the qwen35 family's GPU ops (deltanet.h says what each computes and how a layer calls
// them). Written for compute capability 6.1 and up: warp shuffles and plain loads, no tensor cores, no
// Hopper-only features (programmatic dependent launch is used only where gpu_ops uses it, 9.0 and up).
//
// Decode cost of the delta rule (memory-bound minimum): each value head's head_v_dim x head_k_dim f32
// state is read once and written once per call: 35B shape 32 heads x 128 x 128 x 4 B = 2 MiB read +
// 2 MiB written per DeltaNet layer and token (30 layers: 120 MiB per token, ~30 us at 4 TB/s); the
// conv state (3 x 8192 floats) and the activations are small beside it.
// Measured on one H200 (tests/gpu/test_gpu_deltanet.cpp Times35b, back-to-back launches, 35B shape):
// one token 3.3 us (q/k normed before) / 3.8 us (normed in the kernel), i.e. launch-bound, not
// bandwidth-bound; a prefill batch 0.59 us/token at 512 tokens and 0.73 at 2048 with delta_l2_norm
// first (5.5 / 17.5 us), 0.97 / 1.09 us/token with the norms in the kernel; the conv 22 / 49 us. The
// recurrence is latency-bound per token (two warp reductions on the chain); a chunked form would be
// the next step for long prefills (about 1.5 ms per layer at 2048 tokens today).
#include "cuda/deltanet.h"
#include "cuda/flash_attention.h"

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>

#include "cuda/kernel_util.h"
#include "cuda/launch.cuh"
#include "cuda/sync.cuh"
#include "runtime/error.h"

namespace fitmoe::gpu {
namespace {

// ================================ host-side helpers ===============================================

[[noreturn]] void dn_fail(const std::string& what) { throw Error(what); }

void dn_launched(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) dn_fail(std::string("CUDA error in ") + what + ": " + cudaGetErrorString(e));
}

// launch() of cuda/launch.cuh for this file's Stream handles. Every kernel here calls pdl_enter() before
// it reads anything but weights and kernel arguments.
template <typename... Params, typename... Args>
void dn_launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, Stream s, Args&&... args) {
  launch(kernel, grid, block, smem, static_cast<cudaStream_t>(s), std::forward<Args>(args)...);
}

inline unsigned dn_blocks(int64_t n, int64_t per) { return static_cast<unsigned>((n + per - 1) / per); }

// ================================ device-side helpers =============================================

constexpr unsigned kDnFull = 0xffffffffu;

__device__ __forceinline__ float dn_warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kDnFull, v, o);
  return v;
}
__device__ __forceinline__ double dn_warp_sum(double v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kDnFull, v, o);
  return v;
}
// Sum over the CTA (blockDim.x a multiple of 32, at most 1024); every thread gets it. part: 32 slots.
template <typename T>
__device__ __forceinline__ T dn_block_sum(T v, T* part) {
  const int tid = threadIdx.x;
  v = dn_warp_sum(v);
  __syncthreads();  // (part may still be read from an earlier call)
  if ((tid & 31) == 0) part[tid >> 5] = v;
  __syncthreads();
  if (tid < 32) {
    T t = tid < static_cast<int>(blockDim.x >> 5) ? part[tid] : T(0);
    t = dn_warp_sum(t);
    if (tid == 0) part[0] = t;
  }
  __syncthreads();
  return part[0];
}

// As the CPU: expf-based, explicitly rounded (no contractions).
__device__ __forceinline__ float dn_sigmoid(float x) { return __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-x))); }
__device__ __forceinline__ float dn_silu(float x) { return __fdiv_rn(x, __fadd_rn(1.0f, expf(-x))); }
__device__ __forceinline__ float dn_softplus(float x) { return x > 20.0f ? x : logf(__fadd_rn(1.0f, expf(x))); }

// cpu::rms_norm's scale from the double sum of squares: 1 / sqrt(float(sum / n + eps)).
__device__ __forceinline__ float dn_rms_scale(double sum, int n, float eps) {
  const float ms = static_cast<float>(__dadd_rn(__ddiv_rn(sum, static_cast<double>(n)), static_cast<double>(eps)));
  return __fdiv_rn(1.0f, __fsqrt_rn(ms));
}
// cpu::l2_norm's scale: 1 / max(sqrt(float(sum)), eps).
__device__ __forceinline__ float dn_l2_scale(double sum, float eps) {
  return __fdiv_rn(1.0f, fmaxf(__fsqrt_rn(static_cast<float>(sum)), eps));
}

// ================================ conv1d + SiLU ===================================================

// One thread per channel and chunk of kConvTok tokens (grid.y), a window of the K - 1 inputs before
// the token in registers. Only tokens t < K - 1 read the old state and they are all in chunk 0, whose
// threads also write the new state (after having read the old), so the chunks do not race.
constexpr int kConvThreads = 128, kConvTok = 64;
template <int K>
__global__ void __launch_bounds__(kConvThreads) conv1d_silu_kernel(const float* __restrict__ x, int64_t ld_x,
                                                                   int n_tokens, int channels,
                                                                   const float* __restrict__ w, float* state,
                                                                   float* __restrict__ out, int64_t ld_out) {
  constexpr int keep = K - 1;
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  const int t0 = blockIdx.y * kConvTok, t1 = min(n_tokens, t0 + kConvTok);
  float wc[K];
#pragma unroll
  for (int j = 0; j < K; ++j) wc[j] = c < channels ? w[static_cast<int64_t>(c) * K + j] : 0.0f;
  pdl_enter();
  if (c >= channels) return;
  float* st = state + static_cast<int64_t>(c) * keep;
  float win[keep];  // inputs t - keep .. t - 1
#pragma unroll
  for (int j = 0; j < keep; ++j) {
    const int tt = t0 - keep + j;
    win[j] = tt >= 0 ? x[static_cast<int64_t>(tt) * ld_x + c] : st[keep + tt];
  }
  for (int t = t0; t < t1; ++t) {
    const float cur = x[static_cast<int64_t>(t) * ld_x + c];
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < keep; ++j) sum = __fadd_rn(sum, __fmul_rn(win[j], wc[j]));
    sum = __fadd_rn(sum, __fmul_rn(cur, wc[keep]));
    out[static_cast<int64_t>(t) * ld_out + c] = dn_silu(sum);
#pragma unroll
    for (int j = 0; j + 1 < keep; ++j) win[j] = win[j + 1];
    win[keep - 1] = cur;
  }
  if (blockIdx.y != 0) return;
  if (t1 == n_tokens) {  // one chunk: the window is the new state (old entries included when n < keep)
#pragma unroll
    for (int j = 0; j < keep; ++j) st[j] = win[j];
  } else {  // n_tokens > kConvTok >= keep: the last keep inputs of this batch
#pragma unroll
    for (int j = 0; j < keep; ++j) st[j] = x[static_cast<int64_t>(n_tokens - keep + j) * ld_x + c];
  }
}

// ================================ L2 norm, gated RMSNorm, sigmoid gate ============================

constexpr int kRowWarps = 8;  // rows (one per warp) per CTA of the row kernels

__global__ void __launch_bounds__(kRowWarps * 32) l2_norm_kernel(float* x, int64_t ld, int n_tokens, int n_heads,
                                                                 int hd, float eps) {
  pdl_enter();
  const int lane = threadIdx.x & 31;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kRowWarps + (threadIdx.x >> 5);
  if (r >= static_cast<int64_t>(n_tokens) * n_heads) return;
  float* xr = x + (r / n_heads) * ld + (r % n_heads) * hd;
  double s = 0;
  for (int i = lane; i < hd; i += 32) s += static_cast<double>(__fmul_rn(xr[i], xr[i]));
  const float scale = dn_l2_scale(dn_warp_sum(s), eps);
  for (int i = lane; i < hd; i += 32) xr[i] = __fmul_rn(xr[i], scale);
}

__global__ void __launch_bounds__(kRowWarps * 32) gated_rms_norm_kernel(const float* x, const float* __restrict__ w,
                                                                        const float* z, float* y, int n, int n_rows,
                                                                        float eps) {
  pdl_enter();
  const int lane = threadIdx.x & 31;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kRowWarps + (threadIdx.x >> 5);
  if (r >= n_rows) return;
  const float* xr = x + r * n;
  const float* zr = z + r * n;
  float* yr = y + r * n;
  double s = 0;
  for (int i = lane; i < n; i += 32) s += static_cast<double>(__fmul_rn(xr[i], xr[i]));
  const float scale = dn_rms_scale(dn_warp_sum(s), n, eps);
  __syncwarp();  // (every lane has read its x before any writes y, which may alias it)
  for (int i = lane; i < n; i += 32) {
    const float v = __fmul_rn(__fmul_rn(xr[i], scale), w[i]);
    yr[i] = __fmul_rn(v, dn_silu(zr[i]));
  }
}

__global__ void mul_sigmoid_kernel(float* x, const float* __restrict__ gate, int64_t n) {
  pdl_enter();
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    x[i] = __fmul_rn(x[i], dn_sigmoid(gate[i]));
}

// One CTA per token: the gate's dot product (f32, a CTA tree), then y += ys * s.
constexpr int kShexpThreads = 256;
__global__ void __launch_bounds__(kShexpThreads) shared_expert_gate_add_kernel(float* y, const float* __restrict__ ys,
                                                                               const float* __restrict__ w,
                                                                               const float* __restrict__ xn,
                                                                               const float* __restrict__ logits, int n) {
  __shared__ float part[32];
  pdl_enter();
  const int t = blockIdx.x, tid = threadIdx.x;
  float logit;
  if (w) {
    float p = 0.0f;
    for (int i = tid; i < n; i += blockDim.x) p = fmaf(w[i], xn[static_cast<int64_t>(t) * n + i], p);
    logit = dn_block_sum(p, part);
  } else {
    logit = logits[t];
  }
  const float s = dn_sigmoid(logit);
  float* yr = y + static_cast<int64_t>(t) * n;
  const float* sr = ys + static_cast<int64_t>(t) * n;
  for (int i = tid; i < n; i += blockDim.x) yr[i] = __fadd_rn(yr[i], __fmul_rn(sr[i], s));
}

// ================================ the gated delta rule ============================================

// CTA = kDeltaWarps warps over kDeltaRows consecutive state rows each of one value head (grid.x = head,
// grid.y = group of rows). A warp keeps its rows in registers (element i of a row in lane i % 32, slot
// i / 32) for the whole batch and walks the tokens in order; rows are independent given q, k, v and
// the gates, so no CTA-wide synchronisation is needed, and the next token's inputs are loaded while
// the current one is computed. Per token and row: decay (stored), S_j . k (lane sums, a butterfly: every
// lane gets the same bits, so all update with the same d_j), the rank-1 update S_j += d_j k (per
// element as the CPU: product rounded, then the add), S_j . q.
constexpr int kDeltaWarps = 4, kDeltaRows = 4;

struct DeltaArgs {
  const float* q;
  const float* k;
  int64_t ld_qk;
  const float* v;
  int64_t ld_v;
  const float* g;
  const float* beta;
  int64_t ld_gb;
  const float* dt_bias;
  const float* ssm_a;
  float* state;
  float* out;
  int64_t ld_out;
  int n_tokens, n_k_heads, dv;
  float scale, eps;
};

// L2: q and k normalised here; RAW: g and beta formed here (both compile-time, so a token's step is one
// branch-free block).
template <int M, bool L2, bool RAW>  // head_k_dim = 32 M
__global__ void __launch_bounds__(kDeltaWarps * 32) gated_delta_kernel(DeltaArgs a) {
  constexpr int R = kDeltaRows, dk = 32 * M;
  const int h = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int j0 = (blockIdx.y * kDeltaWarps + warp) * R;
  const float dt = RAW ? a.dt_bias[h] : 0.0f, A = RAW ? a.ssm_a[h] : 0.0f;
  pdl_enter();
  if (j0 >= a.dv) return;
  const int kh = h % a.n_k_heads;
  const int nr = min(R, a.dv - j0);  // valid rows of this warp
  float S[R][M];
  float* st = a.state + (static_cast<int64_t>(h) * a.dv + j0) * dk + lane;
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int m = 0; m < M; ++m) S[r][m] = r < nr ? st[r * dk + 32 * m] : 0.0f;
  const float* qp = a.q + static_cast<int64_t>(kh) * dk + lane;
  const float* kp = a.k + static_cast<int64_t>(kh) * dk + lane;
  const float* vp = a.v + static_cast<int64_t>(h) * a.dv + j0;
  float* op = a.out + static_cast<int64_t>(h) * a.dv + j0;
  // A two-stage pipeline, branch-free so that the compiler can interleave it with the state's chain:
  // the raw inputs of token t + 2 are loaded (stage A) while those of token t + 1, loaded an iteration
  // earlier, are made ready (stage B: the L2 norms, the decay and beta), while token t updates the
  // state. Past the last token the loads repeat it (clamped index) and are not used.
  float qa[M], ka[M], va[R], ga, ba;
  float qb[M], kb[M], vb[R], decay_b, beta_b;
  auto load = [&](int t) {
    t = min(t, a.n_tokens - 1);
#pragma unroll
    for (int m = 0; m < M; ++m) {
      qa[m] = qp[t * a.ld_qk + 32 * m];
      ka[m] = kp[t * a.ld_qk + 32 * m];
    }
#pragma unroll
    for (int r = 0; r < R; ++r) va[r] = r < nr ? vp[t * a.ld_v + r] : 0.0f;
    ga = a.g[t * a.ld_gb + h];
    ba = a.beta[t * a.ld_gb + h];
  };
  auto prepare = [&]() {
#pragma unroll
    for (int m = 0; m < M; ++m) {
      qb[m] = qa[m];
      kb[m] = ka[m];
    }
    if (L2) {  // delta_l2_norm's arithmetic, redone by each warp
      double sq = 0, sk = 0;
#pragma unroll
      for (int m = 0; m < M; ++m) {
        sq += static_cast<double>(__fmul_rn(qb[m], qb[m]));
        sk += static_cast<double>(__fmul_rn(kb[m], kb[m]));
      }
      const float fq = dn_l2_scale(dn_warp_sum(sq), a.eps), fk = dn_l2_scale(dn_warp_sum(sk), a.eps);
#pragma unroll
      for (int m = 0; m < M; ++m) {
        qb[m] = __fmul_rn(qb[m], fq);
        kb[m] = __fmul_rn(kb[m], fk);
      }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) vb[r] = va[r];
    if (RAW) {
      decay_b = expf(__fmul_rn(dn_softplus(__fadd_rn(ga, dt)), A));
      beta_b = dn_sigmoid(ba);
    } else {
      decay_b = expf(ga);
      beta_b = ba;
    }
  };
  if (a.n_tokens > 0) {
    load(0);
    prepare();
    load(1);
  }
  for (int t = 0; t < a.n_tokens; ++t) {
    float qv[M], kv[M], vv[R];
#pragma unroll
    for (int m = 0; m < M; ++m) {
      qv[m] = qb[m];
      kv[m] = kb[m];
    }
#pragma unroll
    for (int r = 0; r < R; ++r) vv[r] = vb[r];
    const float decay = decay_b, bt = beta_b;
    prepare();    // token t + 1 (from what load fetched last iteration)
    load(t + 2);  // token t + 2
    float sk[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float p = 0.0f;
#pragma unroll
      for (int m = 0; m < M; ++m) {
        S[r][m] = __fmul_rn(S[r][m], decay);
        p = fmaf(S[r][m], kv[m], p);
      }
      sk[r] = p;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
#pragma unroll
      for (int r = 0; r < R; ++r) sk[r] += __shfl_xor_sync(kDnFull, sk[r], o);
    float sq[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const float d = __fmul_rn(__fsub_rn(vv[r], sk[r]), bt);
      float p = 0.0f;
#pragma unroll
      for (int m = 0; m < M; ++m) {
        S[r][m] = __fadd_rn(S[r][m], __fmul_rn(kv[m], d));
        p = fmaf(S[r][m], qv[m], p);
      }
      sq[r] = p;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
#pragma unroll
      for (int r = 0; r < R; ++r) sq[r] += __shfl_xor_sync(kDnFull, sq[r], o);
#pragma unroll
    for (int r = 0; r < R; ++r)
      if (lane == r && r < nr) op[t * a.ld_out + r] = __fmul_rn(sq[r], a.scale);
  }
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int m = 0; m < M; ++m)
      if (r < nr) st[r * dk + 32 * m] = S[r][m];
}

// ================================ gated attention prologue ========================================

struct MropeArgs {
  float theta_scale, freq_scale, ext_factor, corr_lo, corr_hi, mscale;
  int sections[4];
  int sect_dims;
};

// Whether pair i turns with the position (text tokens: the t, h and w axes) or not (the e axis), by
// cpu::rope_multi's interleaved section rule.
__device__ __forceinline__ bool mrope_turns(int i, const MropeArgs& r) {
  if (r.sect_dims == 0) return true;
  const int s = i % r.sect_dims;
  return (s % 3 == 1 && s < 3 * r.sections[1]) || (s % 3 == 2 && s < 3 * r.sections[2]) ||
         (s % 3 == 0 && s < 3 * r.sections[0]);
}

// The rotation table of position p (cos of pair i in tab[i], sin in tab[half + i]) as gpu_ops'
// rope_table makes it (float products for the angle chain, the YaRN ramp with explicit roundings,
// sincos in double rounded to float, times mscale), an e pair's angle being 0 (cpu::rope_multi's
// theta_e). Called by the whole CTA; ends with a barrier.
__device__ __forceinline__ void mrope_table(float* tab, int p, int half, const MropeArgs& r) {
  if (threadIdx.x == 0) {
    float theta = static_cast<float>(p), theta_e = 0.0f;
    for (int i = 0; i < half; ++i) {
      tab[i] = mrope_turns(i, r) ? theta : theta_e;
      theta = __fmul_rn(theta, r.theta_scale);
      theta_e = __fmul_rn(theta_e, r.theta_scale);
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < half; i += blockDim.x) {
    const float extrap = tab[i];
    float th = __fmul_rn(r.freq_scale, extrap);
    if (r.ext_factor != 0.0f) {
      const float y =
          __fdiv_rn(__fsub_rn(static_cast<float>(i), r.corr_lo), fmaxf(0.001f, __fsub_rn(r.corr_hi, r.corr_lo)));
      const float mix = __fmul_rn(__fsub_rn(1.0f, fminf(1.0f, fmaxf(0.0f, y))), r.ext_factor);
      th = __fadd_rn(__fmul_rn(th, __fsub_rn(1.0f, mix)), __fmul_rn(extrap, mix));
    }
    double sn, cn;
    sincos(static_cast<double>(th), &sn, &cn);
    tab[i] = __fmul_rn(static_cast<float>(cn), r.mscale);
    tab[half + i] = __fmul_rn(static_cast<float>(sn), r.mscale);
  }
  __syncthreads();
}

template <typename T>
__device__ __forceinline__ T dn_to_cache(float v);
template <>
__device__ __forceinline__ __half dn_to_cache<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ float dn_to_cache<float>(float v) { return v; }

// grid.x: the n_head query heads, then the n_head_kv key heads, then (with a cache) the n_head_kv value
// heads; grid.y: token.
constexpr int kPrologThreads = 128;
template <typename T>
__global__ void __launch_bounds__(kPrologThreads) gated_attn_prologue_kernel(
    const float* __restrict__ qg, int64_t ld_qg, float* __restrict__ q, int64_t ld_q, float* __restrict__ gate,
    int64_t ld_gate, float* k, int64_t ld_k, const float* __restrict__ v, int64_t ld_v,
    const float* __restrict__ q_norm, const float* __restrict__ k_norm, T* __restrict__ kc, T* __restrict__ vc,
    int n_ctx, const int32_t* __restrict__ pos, int n_head, int n_head_kv, int hd, int hdv, int n_rot, MropeArgs rope,
    float eps) {
  extern __shared__ float sh[];  // [hd] the normed head, [n_rot] cos / sin
  __shared__ double part[32];
  const int h = blockIdx.x, t = blockIdx.y, tid = threadIdx.x, half = n_rot / 2;
  float* hv = sh;
  float* tab = sh + hd;
  pdl_enter();
  const int p = pos[t];
  if (h >= n_head + n_head_kv) {  // a value head: into the transposed cache
    const int g = h - n_head - n_head_kv;
    for (int i = tid; i < hdv; i += blockDim.x)
      vc[static_cast<int64_t>(g * hdv + i) * n_ctx + p] =
          dn_to_cache<T>(v[t * ld_v + static_cast<int64_t>(g) * hdv + i]);
    return;
  }
  mrope_table(tab, p, half, rope);
  const bool is_q = h < n_head;
  const int g = is_q ? h : h - n_head;
  const float* src = is_q ? qg + t * ld_qg + static_cast<int64_t>(g) * 2 * hd : k + t * ld_k + static_cast<int64_t>(g) * hd;
  const float* w = is_q ? q_norm : k_norm;
  if (is_q)
    for (int i = tid; i < hd; i += blockDim.x) gate[t * ld_gate + static_cast<int64_t>(g) * hd + i] = src[hd + i];
  double s = 0;
  for (int i = tid; i < hd; i += blockDim.x) s += static_cast<double>(__fmul_rn(src[i], src[i]));
  const float scale = dn_rms_scale(dn_block_sum(s, part), hd, eps);
  for (int i = tid; i < hd; i += blockDim.x) {
    const float x = __fmul_rn(src[i], scale);
    hv[i] = w ? __fmul_rn(x, w[i]) : x;
  }
  __syncthreads();  // (hv complete; every read of src, which k overwrites, done)
  for (int i = tid; i < hd; i += blockDim.x) {
    float o;
    if (i < half) {
      o = __fsub_rn(__fmul_rn(hv[i], tab[i]), __fmul_rn(hv[i + half], tab[half + i]));
    } else if (i < n_rot) {
      const int j = i - half;
      o = __fadd_rn(__fmul_rn(hv[j], tab[half + j]), __fmul_rn(hv[i], tab[j]));
    } else {
      o = hv[i];
    }
    if (is_q) {
      q[t * ld_q + static_cast<int64_t>(g) * hd + i] = o;
    } else {
      k[t * ld_k + static_cast<int64_t>(g) * hd + i] = o;
      if (kc) kc[static_cast<int64_t>(p) * n_head_kv * hd + static_cast<int64_t>(g) * hd + i] = dn_to_cache<T>(o);
    }
  }
}

template <int M>
void launch_delta(bool l2, bool raw, dim3 grid, Stream s, const DeltaArgs& a) {
  const dim3 block(kDeltaWarps * 32);
  if (l2 && raw) dn_launch(gated_delta_kernel<M, true, true>, grid, block, 0, s, a);
  else if (l2) dn_launch(gated_delta_kernel<M, true, false>, grid, block, 0, s, a);
  else if (raw) dn_launch(gated_delta_kernel<M, false, true>, grid, block, 0, s, a);
  else dn_launch(gated_delta_kernel<M, false, false>, grid, block, 0, s, a);
}

}  // namespace

// ================================ host API ========================================================

void delta_conv1d_silu(const float* x, int64_t ld_x, int n_tokens, int channels, const float* w, int K, float* state,
                       float* out, int64_t ld_out, Stream s) {
  if (n_tokens <= 0 || channels <= 0) return;
  if (static_cast<int64_t>(n_tokens) > 65535LL * kConvTok) dn_fail("delta_conv1d_silu: too many tokens in one call");
  const dim3 grid(dn_blocks(channels, kConvThreads), dn_blocks(n_tokens, kConvTok));
  switch (K) {
#define FITMOE_CONV_K(KK)                                                                                     \
  case KK:                                                                                                    \
    dn_launch(conv1d_silu_kernel<KK>, grid, kConvThreads, 0, s, x, ld_x, n_tokens, channels, w, state, out, \
              ld_out);                                                                                        \
    break;
    FITMOE_CONV_K(2)
    FITMOE_CONV_K(3)
    FITMOE_CONV_K(4)
    FITMOE_CONV_K(5)
    FITMOE_CONV_K(6)
    FITMOE_CONV_K(7)
    FITMOE_CONV_K(8)
#undef FITMOE_CONV_K
    default:
      dn_fail("delta_conv1d_silu: conv kernel size " + std::to_string(K) + " (2 to 8 supported)");
  }
  dn_launched("delta_conv1d_silu");
}

void delta_l2_norm(float* x, int64_t ld, int n_tokens, int n_heads, int head_dim, float eps, Stream s) {
  const int64_t rows = static_cast<int64_t>(n_tokens) * n_heads;
  if (rows <= 0) return;
  dn_launch(l2_norm_kernel, dim3(dn_blocks(rows, kRowWarps)), kRowWarps * 32, 0, s, x, ld, n_tokens, n_heads, head_dim,
            eps);
  dn_launched("delta_l2_norm");
}

void gated_delta_rule(const DeltaSpec& d, int n_tokens, const float* q, const float* k, int64_t ld_qk, const float* v,
                      int64_t ld_v, const float* g, const float* beta, int64_t ld_gb, const float* dt_bias,
                      const float* ssm_a, bool l2_qk, float eps, float* state, float* out, int64_t ld_out, Stream s) {
  if (n_tokens < 0) dn_fail("gated_delta_rule: negative token count");
  if (d.n_k_heads <= 0 || d.n_v_heads <= 0 || d.head_v_dim <= 0)
    dn_fail("gated_delta_rule: bad head counts / dims");
  if ((dt_bias == nullptr) != (ssm_a == nullptr)) dn_fail("gated_delta_rule: dt_bias and ssm_a go together");
  DeltaArgs a;
  a.q = q;
  a.k = k;
  a.ld_qk = ld_qk;
  a.v = v;
  a.ld_v = ld_v;
  a.g = g;
  a.beta = beta;
  a.ld_gb = ld_gb;
  a.dt_bias = dt_bias;
  a.ssm_a = ssm_a;
  a.state = state;
  a.out = out;
  a.ld_out = ld_out;
  a.n_tokens = n_tokens;
  a.n_k_heads = d.n_k_heads;
  a.dv = d.head_v_dim;
  a.scale = 1.0f / std::sqrt(static_cast<float>(d.head_k_dim));  // as cpu::gated_delta_net
  a.eps = eps;
  const int rows_per_cta = kDeltaWarps * kDeltaRows;
  const dim3 grid(static_cast<unsigned>(d.n_v_heads), dn_blocks(d.head_v_dim, rows_per_cta));
  const bool raw = dt_bias != nullptr;
  const int dk = d.head_k_dim;
  if (dk == 32) launch_delta<1>(l2_qk, raw, grid, s, a);
  else if (dk == 64) launch_delta<2>(l2_qk, raw, grid, s, a);
  else if (dk == 128) launch_delta<4>(l2_qk, raw, grid, s, a);
  else if (dk == 256) launch_delta<8>(l2_qk, raw, grid, s, a);
  else dn_fail("gated_delta_rule: head_k_dim " + std::to_string(dk) + " (32, 64, 128 or 256 supported)");
  dn_launched("gated_delta_rule");
}

void delta_gated_rms_norm(const float* x, const float* w, const float* z, float* y, int n, int n_rows, float eps,
                          Stream s) {
  if (n_rows <= 0) return;
  dn_launch(gated_rms_norm_kernel, dim3(dn_blocks(n_rows, kRowWarps)), kRowWarps * 32, 0, s, x, w, z, y, n, n_rows,
            eps);
  dn_launched("delta_gated_rms_norm");
}

void gated_attn_prologue(const AttnSpec& a, int n_tokens, const float* qg, int64_t ld_qg, float* q, int64_t ld_q,
                         float* gate, int64_t ld_gate, float* k, int64_t ld_k, const float* v, int64_t ld_v,
                         const float* q_norm, const float* k_norm, const DevKv* kv, const int32_t* pos,
                         const RopeParams& rope, float eps, Stream s) {
  if (n_tokens <= 0) return;
  if (kv && kv->flash) {  // k roped in place, then the flash store rotates and quantizes k and v
    gated_attn_prologue(a, n_tokens, qg, ld_qg, q, ld_q, gate, ld_gate, k, ld_k, v, ld_v, q_norm, k_norm, nullptr, pos,
                        rope, eps, s);
    flash_kv_store(*kv, false, pos, n_tokens, k, ld_k, v, ld_v, a.n_head_kv, a.head_dim, a.head_dim_v, s);
    return;
  }
  if (n_tokens > 65535) dn_fail("gated_attn_prologue: too many tokens in one call");
  if (a.n_rot <= 0 || a.n_rot % 2 != 0 || a.n_rot > a.head_dim)
    dn_fail("gated_attn_prologue: bad n_rot " + std::to_string(a.n_rot));
  MropeArgs r;
  r.theta_scale = std::pow(rope.base, -2.0f / static_cast<float>(a.n_rot));  // as cpu::rope_multi
  r.freq_scale = rope.freq_scale;
  r.ext_factor = rope.ext_factor;
  r.corr_lo = rope.corr_lo;
  r.corr_hi = rope.corr_hi;
  r.mscale = rope.mscale();
  r.sect_dims = 0;
  for (int i = 0; i < 4; ++i) {
    r.sections[i] = a.rope_sections[i];
    r.sect_dims += a.rope_sections[i];
  }
  const dim3 grid(static_cast<unsigned>(a.n_head + a.n_head_kv * (kv ? 2 : 1)), static_cast<unsigned>(n_tokens));
  const size_t smem = sizeof(float) * (a.head_dim + a.n_rot);
  if (!kv || kv->type == DType::F32) {
    float* kc = kv ? reinterpret_cast<float*>(kv->k) : nullptr;
    float* vc = kv ? reinterpret_cast<float*>(kv->v) : nullptr;
    dn_launch(gated_attn_prologue_kernel<float>, grid, kPrologThreads, smem, s, qg, ld_qg, q, ld_q, gate, ld_gate, k,
              ld_k, v, ld_v, q_norm, k_norm, kc, vc, kv ? kv->n_ctx : 0, pos, a.n_head, a.n_head_kv, a.head_dim,
              a.head_dim_v, a.n_rot, r, eps);
  } else if (kv->type == DType::F16) {
    dn_launch(gated_attn_prologue_kernel<__half>, grid, kPrologThreads, smem, s, qg, ld_qg, q, ld_q, gate, ld_gate, k,
              ld_k, v, ld_v, q_norm, k_norm, reinterpret_cast<__half*>(kv->k), reinterpret_cast<__half*>(kv->v),
              kv->n_ctx, pos, a.n_head, a.n_head_kv, a.head_dim, a.head_dim_v, a.n_rot, r, eps);
  } else {
    dn_fail(std::string("gated_attn_prologue: unsupported cache type ") + dtype_name(kv->type));
  }
  dn_launched("gated_attn_prologue");
}

void delta_mul_sigmoid(float* x, const float* gate, int64_t n, Stream s) {
  if (n <= 0) return;
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(dn_blocks(n, 256), 4096));
  dn_launch(mul_sigmoid_kernel, dim3(blocks), 256, 0, s, x, gate, n);
  dn_launched("delta_mul_sigmoid");
}

void shared_expert_gate_add(float* y, const float* ys, const float* w_gate, const float* xn, const float* gate_logits,
                            int n, int n_tokens, Stream s) {
  if (n_tokens <= 0) return;
  if (!w_gate && !gate_logits) dn_fail("shared_expert_gate_add: neither a gate weight nor gate logits");
  dn_launch(shared_expert_gate_add_kernel, dim3(static_cast<unsigned>(n_tokens)), kShexpThreads, 0, s, y, ys, w_gate,
            xn, gate_logits, n);
  dn_launched("shared_expert_gate_add");
}

}  // namespace fitmoe::gpu
