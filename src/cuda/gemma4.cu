// Kernels of gemma4's GPU ops (gemma4.h says what each computes). Plain launches, written to mirror
// the CPU ops op for op; compute capability 6.1 and up.
#include "cuda/gemma4.h"

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <mutex>
#include <string>
#include <vector>

#include "runtime/cpu_gemma4.h"
#include "quant/dtype.h"
#include "runtime/error.h"

namespace fitmoe::gpu {
namespace {

void g4_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw Error(std::string("CUDA error in ") + what + ": " + cudaGetErrorString(e));
}
void g4_launched(const char* what) { g4_check(cudaGetLastError(), what); }

inline cudaStream_t cs(Stream s) { return static_cast<cudaStream_t>(s); }
inline unsigned blocks_for(int64_t n, int threads) { return static_cast<unsigned>((n + threads - 1) / threads); }

__device__ __forceinline__ float round_to_cache(float v, bool f16) { return f16 ? __half2float(__float2half_rn(v)) : v; }

__device__ __forceinline__ float load_cache(const uint8_t* p, int64_t i, bool f16) {
  return f16 ? __half2float(reinterpret_cast<const __half*>(p)[i]) : reinterpret_cast<const float*>(p)[i];
}

// ---- elementwise --------------------------------------------------------------------------------

__global__ void geglu_kernel(const float* __restrict__ gate, const float* __restrict__ up, float* out, int64_t n,
                             const float* __restrict__ table) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float g = gate[i], u = up[i];
    float r;
    if (g <= -10.0f) r = 0.0f;
    else if (g >= 10.0f) r = g * u;
    else r = table[__half_as_ushort(__float2half_rn(g))] * u;
    out[i] = r;
  }
}

__global__ void softcap_kernel(float* x, int64_t n, float inv, float cap) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    x[i] = tanhf(x[i] * inv) * cap;
}

__global__ void scale_kernel(float* x, int64_t n, float f, const float* fp) {
  const float s = fp ? *fp : f;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    x[i] *= s;
}

__global__ void router_scale_kernel(float* x, const float* __restrict__ w, int n, int64_t total, float inv_sqrt) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float v = x[i];
    x[i] = v * inv_sqrt * w[i % n];
  }
}

__global__ void expert_scale_kernel(float* wts, const int32_t* ids, const float* scale, int n) {
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j < n && ids[j] >= 0) wts[j] *= scale[ids[j]];
}

// ---- RoPE with frequency factors ------------------------------------------------------------------

// One CTA per token: the angles of its position (the CPU's loop, by one thread: each angle is the
// previous one times theta_scale, a chain of float products that must round as the CPU's does), then
// their cos/sin by all threads (the double-precision sincos, serial in one thread, was most of the
// kernel's time), then every head rotated.
__global__ void rope_kernel(float* x, int n_heads, int head_dim, int64_t ld, int n_rot, const int32_t* pos,
                            float theta_scale, float freq_scale, float ext, float corr_lo, float corr_hi,
                            float mscale, const float* freq_factors) {
  extern __shared__ float cs_tab[];  // [n_rot]: cos, sin per pair; then [n_rot / 2] angles
  const int t = blockIdx.x, half = n_rot / 2;
  float* angles = cs_tab + n_rot;
  if (threadIdx.x == 0) {
    float theta = static_cast<float>(pos[t]);
    for (int i = 0; i < half; ++i) {
      const float te = freq_factors ? __fdiv_rn(theta, freq_factors[i]) : theta;
      float th = __fmul_rn(freq_scale, te);
      if (ext != 0.0f) {
        const float y = __fdiv_rn(__fsub_rn(static_cast<float>(i), corr_lo), fmaxf(0.001f, __fsub_rn(corr_hi, corr_lo)));
        const float mix = __fmul_rn(1.0f - fminf(1.0f, fmaxf(0.0f, y)), ext);
        th = __fadd_rn(__fmul_rn(th, __fsub_rn(1.0f, mix)), __fmul_rn(te, mix));
      }
      angles[i] = th;
      theta = __fmul_rn(theta, theta_scale);
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < half; i += blockDim.x) {
    double sd, cd;
    sincos(static_cast<double>(angles[i]), &sd, &cd);
    cs_tab[2 * i] = __fmul_rn(static_cast<float>(cd), mscale);
    cs_tab[2 * i + 1] = __fmul_rn(static_cast<float>(sd), mscale);
  }
  __syncthreads();
  float* row = x + static_cast<int64_t>(t) * ld;
  for (int e = threadIdx.x; e < n_heads * half; e += blockDim.x) {
    const int h = e / half, i = e % half;
    float* v = row + static_cast<int64_t>(h) * head_dim;
    const float x0 = v[i], x1 = v[i + half];
    const float c = cs_tab[2 * i], sn = cs_tab[2 * i + 1];
    v[i] = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, sn));
    v[i + half] = __fadd_rn(__fmul_rn(x0, sn), __fmul_rn(x1, c));
  }
}

// ---- KV store -------------------------------------------------------------------------------------

__global__ void kv_store_kernel(uint8_t* kc, uint8_t* vc, bool f16, int cap, bool ring, const int32_t* pos,
                                const float* k, int64_t ld_k, const float* v, int64_t ld_v, int width) {
  const int t = blockIdx.y;
  const int p = pos[t];
  const int slot = ring ? p % cap : p;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < width; i += gridDim.x * blockDim.x) {
    const float kv = k[static_cast<int64_t>(t) * ld_k + i], vv = v[static_cast<int64_t>(t) * ld_v + i];
    const int64_t ki = static_cast<int64_t>(slot) * width + i;     // K rows [slot][width]
    const int64_t vi = static_cast<int64_t>(i) * cap + slot;       // V^T [width][cap]
    if (f16) {
      reinterpret_cast<__half*>(kc)[ki] = __float2half_rn(kv);
      reinterpret_cast<__half*>(vc)[vi] = __float2half_rn(vv);
    } else {
      reinterpret_cast<float*>(kc)[ki] = kv;
      reinterpret_cast<float*>(vc)[vi] = vv;
    }
  }
}

// ---- attention ------------------------------------------------------------------------------------

constexpr int kAttnThreads = 256;

__device__ float block_max(float v, float* red) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int w = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();
  if (lane == 0) red[w] = v;
  __syncthreads();
  float r = -INFINITY;
  for (int i = 0; i < kAttnThreads / 32; ++i) r = fmaxf(r, red[i]);
  return r;
}

__device__ double block_sum_d(double v, double* red) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int w = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();
  if (lane == 0) red[w] = v;
  __syncthreads();
  double r = 0;
  for (int i = 0; i < kAttnThreads / 32; ++i) r += red[i];
  return r;
}

// One CTA per (token, head). Shared: the query rounded to the cache type [head_dim], a tile of
// probabilities [kAttnThreads], reductions.
__global__ void __launch_bounds__(kAttnThreads) attention_kernel(
    const float* q, int64_t ld_q, const uint8_t* kc, const uint8_t* vc, bool f16, int cap, bool ring,
    const int32_t* pos, int n_head, int n_head_kv, int hd, float scale, int window, float* out, int64_t ld_out) {
  extern __shared__ float smem[];
  float* qs = smem;                      // [hd]
  float* ps = qs + hd;                   // [kAttnThreads]
  __shared__ double red_d[kAttnThreads / 32];
  __shared__ float red_f[kAttnThreads / 32];
  const int t = blockIdx.x, h = blockIdx.y;
  const int g = h / (n_head / n_head_kv);
  const int p = pos[t];
  const int lo = window > 0 ? max(0, p - window + 1) : 0;
  const int n_keys = p - lo + 1;
  const int width = n_head_kv * hd;
  for (int d = threadIdx.x; d < hd; d += blockDim.x)
    qs[d] = round_to_cache(q[static_cast<int64_t>(t) * ld_q + static_cast<int64_t>(h) * hd + d], f16);
  __syncthreads();
  auto score = [&](int j) {  // key lo + j
    const int kp = lo + j;
    const int slot = ring ? kp % cap : kp;
    const int64_t base = static_cast<int64_t>(slot) * width + static_cast<int64_t>(g) * hd;
    float acc = 0.0f;
    for (int d = 0; d < hd; ++d) acc += qs[d] * load_cache(kc, base + d, f16);
    return acc * scale;
  };
  // Pass 1: the maximum.
  float mx = -INFINITY;
  for (int j = threadIdx.x; j < n_keys; j += blockDim.x) mx = fmaxf(mx, score(j));
  mx = block_max(mx, red_f);
  // Pass 2: the sum of exp(s - max), in double.
  double sum = 0;
  for (int j = threadIdx.x; j < n_keys; j += blockDim.x) sum += static_cast<double>(expf(score(j) - mx));
  sum = block_sum_d(sum, red_d);
  const float inv = static_cast<float>(1.0 / sum);
  // Pass 3: P (rounded to the cache type) tile by tile, then V^T P.
  float acc[1024 / kAttnThreads];
  const int n_d = (hd + kAttnThreads - 1) / kAttnThreads;
  for (int i = 0; i < 1024 / kAttnThreads; ++i) acc[i] = 0.0f;
  for (int j0 = 0; j0 < n_keys; j0 += kAttnThreads) {
    const int nj = min(kAttnThreads, n_keys - j0);
    __syncthreads();
    if (static_cast<int>(threadIdx.x) < nj) ps[threadIdx.x] = round_to_cache(expf(score(j0 + threadIdx.x) - mx) * inv, f16);
    __syncthreads();
    for (int i = 0; i < n_d; ++i) {
      const int d = threadIdx.x + i * kAttnThreads;
      if (d >= hd) break;
      const int64_t vrow = (static_cast<int64_t>(g) * hd + d) * cap;
      float a = acc[i];
      for (int jj = 0; jj < nj; ++jj) {
        const int kp = lo + j0 + jj;
        const int slot = ring ? kp % cap : kp;
        a += ps[jj] * load_cache(vc, vrow + slot, f16);
      }
      acc[i] = a;
    }
  }
  for (int i = 0; i < n_d; ++i) {
    const int d = threadIdx.x + i * kAttnThreads;
    if (d < hd) out[static_cast<int64_t>(t) * ld_out + static_cast<int64_t>(h) * hd + d] = acc[i];
  }
}

// The same attention with every score computed once: a warp per key (lanes across the head, so the
// K row is read in coalesced pieces; the partial sums meet in a shuffle tree), the scores and then
// the probabilities kept in shared memory [n_keys]. For caches whose visible keys fit there
// (kSmemKeys); the kernel above takes the others. Same rounding points (Q and P to the cache type,
// the sum in double); only the order of each score's summation differs.
constexpr int kSmemBytes = 48 * 1024;  // what every supported GPU gives a block without opting in
__global__ void __launch_bounds__(kAttnThreads) attention_smem_kernel(
    const float* q, int64_t ld_q, const uint8_t* kc, const uint8_t* vc, bool f16, int cap, bool ring,
    const int32_t* pos, int n_head, int n_head_kv, int hd, float scale, int window, float* out, int64_t ld_out) {
  extern __shared__ float smem[];
  float* qs = smem;        // [hd]
  float* ps = qs + hd;     // [n_keys]: scores, then probabilities
  __shared__ double red_d[kAttnThreads / 32];
  __shared__ float red_f[kAttnThreads / 32];
  const int t = blockIdx.x, h = blockIdx.y;
  const int g = h / (n_head / n_head_kv);
  const int p = pos[t];
  const int lo = window > 0 ? max(0, p - window + 1) : 0;
  const int n_keys = p - lo + 1;
  const int width = n_head_kv * hd;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, n_warps = kAttnThreads / 32;
  for (int d = threadIdx.x; d < hd; d += blockDim.x)
    qs[d] = round_to_cache(q[static_cast<int64_t>(t) * ld_q + static_cast<int64_t>(h) * hd + d], f16);
  __syncthreads();
  float mx = -INFINITY;
  for (int j = warp; j < n_keys; j += n_warps) {
    const int kp = lo + j;
    const int slot = ring ? kp % cap : kp;
    const int64_t base = static_cast<int64_t>(slot) * width + static_cast<int64_t>(g) * hd;
    float acc = 0.0f;
    for (int d = lane; d < hd; d += 32) acc += qs[d] * load_cache(kc, base + d, f16);
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    const float sc = acc * scale;
    if (lane == 0) ps[j] = sc;
    mx = fmaxf(mx, sc);
  }
  mx = block_max(mx, red_f);  // (its first barrier also publishes the scores)
  double sum = 0;
  for (int j = threadIdx.x; j < n_keys; j += blockDim.x) sum += static_cast<double>(expf(ps[j] - mx));
  sum = block_sum_d(sum, red_d);
  const float inv = static_cast<float>(1.0 / sum);
  for (int j = threadIdx.x; j < n_keys; j += blockDim.x) ps[j] = round_to_cache(expf(ps[j] - mx) * inv, f16);
  __syncthreads();
  for (int d = threadIdx.x; d < hd; d += blockDim.x) {
    const int64_t vrow = (static_cast<int64_t>(g) * hd + d) * cap;
    float a = 0.0f;
    for (int j = 0; j < n_keys; ++j) {
      const int kp = lo + j;
      a += ps[j] * load_cache(vc, vrow + (ring ? kp % cap : kp), f16);
    }
    out[static_cast<int64_t>(t) * ld_out + static_cast<int64_t>(h) * hd + d] = a;
  }
}

}  // namespace

const float* gemma4_gelu_table() {
  static std::mutex mu;
  static float* table = nullptr;
  std::lock_guard<std::mutex> lock(mu);
  if (table) return table;
  std::vector<float> host(65536);
  for (uint32_t i = 0; i < 65536; ++i)
    host[i] = f16_to_f32(f32_to_f16(cpu::gelu_tanh(f16_to_f32(static_cast<uint16_t>(i)))));
  float* d = nullptr;
  g4_check(cudaMalloc(&d, sizeof(float) * host.size()), "gemma4_gelu_table");
  g4_check(cudaMemcpy(d, host.data(), sizeof(float) * host.size(), cudaMemcpyHostToDevice), "gemma4_gelu_table");
  table = d;
  return table;
}

void gemma4_geglu(const float* gate, const float* up, float* out, int64_t n, Stream s) {
  if (n <= 0) return;
  const float* table = gemma4_gelu_table();
  const unsigned nb = std::min<unsigned>(blocks_for(n, 256), 65535u);
  geglu_kernel<<<nb, 256, 0, cs(s)>>>(gate, up, out, n, table);
  g4_launched("gemma4_geglu");
}

void gemma4_rope(float* x, int n_tokens, int n_heads, int head_dim, int64_t ld, int n_rot, const int32_t* pos,
                 const RopeParams& rope, const float* freq_factors, Stream s) {
  if (n_tokens <= 0) return;
  // (std::pow on the host, as the CPU op computes it.)
  const float theta_scale = std::pow(rope.base, -2.0f / static_cast<float>(n_rot));
  rope_kernel<<<n_tokens, 128, sizeof(float) * (n_rot + n_rot / 2), cs(s)>>>(x, n_heads, head_dim, ld, n_rot, pos, theta_scale,
                                                              rope.freq_scale, rope.ext_factor, rope.corr_lo,
                                                              rope.corr_hi, rope.mscale(), freq_factors);
  g4_launched("gemma4_rope");
}

void gemma4_kv_store(const DevKv& kv, bool ring, const int32_t* pos, int n_tokens, const float* k, int64_t ld_k,
                     const float* v, int64_t ld_v, int n_head_kv, int head_dim, Stream s) {
  if (n_tokens <= 0) return;
  const int width = n_head_kv * head_dim;
  const dim3 grid(blocks_for(width, 256), static_cast<unsigned>(n_tokens));
  kv_store_kernel<<<grid, 256, 0, cs(s)>>>(kv.k, kv.v, kv.type == DType::F16, kv.n_ctx, ring, pos, k, ld_k, v, ld_v,
                                           width);
  g4_launched("gemma4_kv_store");
}

void gemma4_attention(const float* q, int64_t ld_q, const DevKv& kv, bool ring, const int32_t* pos, int n_tokens,
                      int n_head, int n_head_kv, int head_dim, float scale, int window, float* out, int64_t ld_out,
                      Stream s) {
  if (n_tokens <= 0) return;
  if (head_dim > 1024) throw Error("gemma4_attention: head_dim " + std::to_string(head_dim) + " over 1024");
  if (kv.type != DType::F16 && kv.type != DType::F32) throw Error("gemma4_attention: the cache must be f16 or f32");
  const dim3 grid(static_cast<unsigned>(n_tokens), static_cast<unsigned>(n_head));
  // The most keys a query can see: the window, or the cache's capacity (a bound that holds for every
  // position, so a captured graph stays valid as the sequence grows).
  const int64_t max_keys = window > 0 ? std::min(window, kv.n_ctx) : kv.n_ctx;
  const size_t smem_all = sizeof(float) * (static_cast<size_t>(head_dim) + static_cast<size_t>(max_keys));
  if (smem_all <= static_cast<size_t>(kSmemBytes)) {
    attention_smem_kernel<<<grid, kAttnThreads, smem_all, cs(s)>>>(q, ld_q, kv.k, kv.v, kv.type == DType::F16, kv.n_ctx,
                                                                   ring, pos, n_head, n_head_kv, head_dim, scale,
                                                                   window, out, ld_out);
  } else {
    const size_t smem = sizeof(float) * (static_cast<size_t>(head_dim) + kAttnThreads);
    attention_kernel<<<grid, kAttnThreads, smem, cs(s)>>>(q, ld_q, kv.k, kv.v, kv.type == DType::F16, kv.n_ctx, ring,
                                                          pos, n_head, n_head_kv, head_dim, scale, window, out, ld_out);
  }
  g4_launched("gemma4_attention");
}

void gemma4_softcap(float* x, int64_t n, float cap, Stream s) {
  if (n <= 0) return;
  const unsigned nb = std::min<unsigned>(blocks_for(n, 256), 65535u);
  softcap_kernel<<<nb, 256, 0, cs(s)>>>(x, n, 1.0f / cap, cap);
  g4_launched("gemma4_softcap");
}

void gemma4_scale(float* x, int64_t n, float f, Stream s) {
  if (n <= 0) return;
  const unsigned nb = std::min<unsigned>(blocks_for(n, 256), 65535u);
  scale_kernel<<<nb, 256, 0, cs(s)>>>(x, n, f, nullptr);
  g4_launched("gemma4_scale");
}

void gemma4_scale_by(float* x, int64_t n, const float* f, Stream s) {
  if (n <= 0) return;
  const unsigned nb = std::min<unsigned>(blocks_for(n, 256), 65535u);
  scale_kernel<<<nb, 256, 0, cs(s)>>>(x, n, 1.0f, f);
  g4_launched("gemma4_scale_by");
}

void gemma4_router_input(const float* x, const float* w, float* out, int n, int rows, float eps, float inv_sqrt,
                         Stream s) {
  if (rows <= 0) return;
  rms_norm(x, nullptr, out, n, rows, eps, n, n, s);
  const int64_t total = static_cast<int64_t>(n) * rows;
  const unsigned nb = std::min<unsigned>(blocks_for(total, 256), 65535u);
  router_scale_kernel<<<nb, 256, 0, cs(s)>>>(out, w, n, total, inv_sqrt);
  g4_launched("gemma4_router_input");
}

void gemma4_expert_scale(float* wts, const int32_t* ids, const float* scale, int n, Stream s) {
  if (n <= 0) return;
  expert_scale_kernel<<<blocks_for(n, 128), 128, 0, cs(s)>>>(wts, ids, scale, n);
  g4_launched("gemma4_expert_scale");
}

}  // namespace fitmoe::gpu
