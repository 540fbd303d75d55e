// Flash attention over every KV cache type: flash_attention.h says what each function computes.
// Compute capability 6.1 and up (the prefill kernel's tensor cores from 7.0).
#include "cuda/flash_attention.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <algorithm>
#include <cmath>
#include <mutex>
#include <string>
#include <vector>

#include "cuda/launch.cuh"
#include "cuda/sync.cuh"
#include "quant/turboquant.h"
#include "runtime/error.h"
#include "runtime/kv_cache.h"

namespace fitmoe::gpu {
namespace {

void fa_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw Error(std::string("CUDA error in ") + what + ": " + cudaGetErrorString(e));
}
[[noreturn]] void fa_fail(const std::string& m) { throw Error(m); }
inline cudaStream_t cs(Stream s) { return static_cast<cudaStream_t>(s); }

// The cache types as the kernels name them.
enum Kind : int { kF32, kF16, kBF16, kQ8, kQ4, kTQ4, kTQ3, kTQ2 };
int kind_of(DType t) {
  switch (t) {
    case DType::F32: return kF32;
    case DType::F16: return kF16;
    case DType::BF16: return kBF16;
    case DType::Q8_0: return kQ8;
    case DType::Q4_0: return kQ4;
    case DType::TQ4: return kTQ4;
    case DType::TQ3: return kTQ3;
    case DType::TQ2: return kTQ2;
    default: fa_fail(std::string("flash attention: ") + dtype_name(t) + " is not a KV cache type");
  }
}
__host__ __device__ inline bool is_tq(int k) { return k >= kTQ4; }
__host__ __device__ inline int tq_bits_of(int k) { return k == kTQ4 ? 4 : k == kTQ3 ? 3 : 2; }
// Index of a tq block size (32, 64, 128) in the tables.
__host__ __device__ inline int tq_size_index(int n) { return n == 32 ? 0 : n == 64 ? 1 : 2; }

// The tq tables: Lloyd-Max codebooks [block size][bits - 2][16] and the rotation's sign vectors as
// bitmasks [block size][s1, s2][4 words] (bit i set: value i is negated).
__constant__ float c_codebook[3][3][16];
__constant__ uint32_t c_signs[3][2][4];

std::mutex g_tables_mu;
std::vector<bool> g_tables_done;

// ---- decoding one head's row ----------------------------------------------------------------------

__device__ __forceinline__ float h2f(uint16_t b) { return __half2float(__ushort_as_half(b)); }
__device__ __forceinline__ float bf2f(uint16_t b) { return __uint_as_float(static_cast<uint32_t>(b) << 16); }
__device__ __forceinline__ uint16_t ld16(const uint8_t* p) { return *reinterpret_cast<const uint16_t*>(p); }
__device__ __forceinline__ int tq_block_bytes(int kind, int n) { return 2 + n * tq_bits_of(kind) / 8; }

// Values [32c + 8s, 32c + 8s + 8) of one head's row (tq: in the rotated domain, gamma * centroid). The
// decode kernel's scores take a key in four of these, which keeps two keys' values in few registers.
__device__ __forceinline__ void decode8(int kind, const uint8_t* row, int c, int s, int tqb, const float* cb, float* o) {
  const int e0 = 32 * c + 8 * s;
  switch (kind) {
    case kF32: {
      const float4* p = reinterpret_cast<const float4*>(row) + e0 / 4;
      const float4 u = p[0], v = p[1];
      o[0] = u.x, o[1] = u.y, o[2] = u.z, o[3] = u.w, o[4] = v.x, o[5] = v.y, o[6] = v.z, o[7] = v.w;
      break;
    }
    case kF16:
    case kBF16: {
      const uint4 u = *reinterpret_cast<const uint4*>(row + e0 * 2);
      const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint16_t lo = static_cast<uint16_t>(w[j] & 0xffff), hi = static_cast<uint16_t>(w[j] >> 16);
        o[2 * j] = kind == kF16 ? h2f(lo) : bf2f(lo);
        o[2 * j + 1] = kind == kF16 ? h2f(hi) : bf2f(hi);
      }
      break;
    }
    case kQ8: {
      const uint8_t* b = row + c * 34;
      const float d = h2f(ld16(b));
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const uint16_t w = ld16(b + 2 + 8 * s + 2 * i);
        o[2 * i] = d * static_cast<float>(static_cast<int8_t>(w & 0xff));
        o[2 * i + 1] = d * static_cast<float>(static_cast<int8_t>(w >> 8));
      }
      break;
    }
    case kQ4: {
      const uint8_t* b = row + c * 18;
      const float d = h2f(ld16(b));
      const int shift = s >= 2 ? 4 : 0;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const uint16_t w = ld16(b + 2 + 8 * (s & 1) + 2 * i);
        o[2 * i] = d * static_cast<float>(((w >> shift) & 15) - 8);
        o[2 * i + 1] = d * static_cast<float>(((w >> (8 + shift)) & 15) - 8);
      }
      break;
    }
    default: {  // tq
      const int i0 = e0 & (tqb - 1);
      const uint8_t* b = row + (e0 / tqb) * tq_block_bytes(kind, tqb);
      const float g = h2f(ld16(b));
      if (kind == kTQ4) {
        const uint32_t w = static_cast<uint32_t>(ld16(b + 2 + i0 / 2)) | (static_cast<uint32_t>(ld16(b + 4 + i0 / 2)) << 16);
#pragma unroll
        for (int j = 0; j < 8; ++j) o[j] = g * cb[(w >> (4 * j)) & 15];
      } else if (kind == kTQ2) {
        const uint16_t w = ld16(b + 2 + i0 / 4);
#pragma unroll
        for (int j = 0; j < 8; ++j) o[j] = g * cb[(w >> (2 * j)) & 3];
      } else {
        const uint16_t w = ld16(b + 2 + i0 / 4);
        const uint32_t h = b[2 + tqb / 4 + i0 / 8];
#pragma unroll
        for (int j = 0; j < 8; ++j) o[j] = g * cb[((w >> (2 * j)) & 3) | (((h >> j) & 1) << 2)];
      }
    }
  }
}

// Values [32c, 32c + 32) of one head's row (the prefill kernel's tile loader).
__device__ __forceinline__ void decode32(int kind, const uint8_t* row, int c, int tqb, const float* cb, float* o) {
#pragma unroll
  for (int s = 0; s < 4; ++s) decode8(kind, row, c, s, tqb, cb, o + 8 * s);
}

// Value d of one head's row.
__device__ __forceinline__ float decode1(int kind, const uint8_t* row, int d, int tqb, const float* cb) {
  switch (kind) {
    case kF32: return reinterpret_cast<const float*>(row)[d];
    case kF16: return h2f(reinterpret_cast<const uint16_t*>(row)[d]);
    case kBF16: return bf2f(reinterpret_cast<const uint16_t*>(row)[d]);
    case kQ8: {
      const uint8_t* b = row + (d >> 5) * 34;
      return h2f(ld16(b)) * static_cast<float>(static_cast<int8_t>(b[2 + (d & 31)]));
    }
    case kQ4: {
      const uint8_t* b = row + (d >> 5) * 18;
      const int j = d & 31;
      const int q = j < 16 ? (b[2 + j] & 15) : (b[2 + j - 16] >> 4);
      return h2f(ld16(b)) * static_cast<float>(q - 8);
    }
    default: {
      const int i = d & (tqb - 1);
      const uint8_t* b = row + (d / tqb) * tq_block_bytes(kind, tqb);
      int code;
      if (kind == kTQ4) code = (b[2 + i / 2] >> (4 * (i & 1))) & 15;
      else if (kind == kTQ2) code = (b[2 + i / 4] >> (2 * (i & 3))) & 3;
      else code = ((b[2 + i / 4] >> (2 * (i & 3))) & 3) | (((b[2 + tqb / 4 + i / 8] >> (i & 7)) & 1) << 2);
      return h2f(ld16(b)) * cb[code];
    }
  }
}

// ---- rotations in shared memory (the whole CTA) ---------------------------------------------------

// x(i) for i < count: Walsh-Hadamard transform in blocks of n, as tq::walsh_hadamard (the scale first,
// then the butterflies, each a + b and a - b in f32: the CPU's bits).
template <typename At>
__device__ void wht_smem(At x, int count, int n, float scale) {
  for (int i = threadIdx.x; i < count; i += blockDim.x) x(i) = __fmul_rn(x(i), scale);
  __syncthreads();
  for (int len = 1; len < n; len <<= 1) {
    for (int p = threadIdx.x; p < count / 2; p += blockDim.x) {
      const int j = (p / len) * 2 * len + (p % len);
      const float a = x(j), b = x(j + len);
      x(j) = __fadd_rn(a, b);
      x(j + len) = __fsub_rn(a, b);
    }
    __syncthreads();
  }
}
// x(i) *= the sign `which` (0: s1, 1: s2) of value i % n of tq blocks of n values.
template <typename At>
__device__ void tq_signs_smem(At x, int count, int n, int which) {
  const int si = tq_size_index(n);
  for (int i = threadIdx.x; i < count; i += blockDim.x) {
    const int e = i & (n - 1);
    if ((c_signs[si][which][e >> 5] >> (e & 31)) & 1u) x(i) = -x(i);
  }
  __syncthreads();
}
// The tq rotation (s1, H / sqrt(n), s2) and its inverse, per block of n.
template <typename At>
__device__ void tq_rotate_smem(At x, int count, int n, float scale) {
  tq_signs_smem(x, count, n, 0);
  wht_smem(x, count, n, scale);
  tq_signs_smem(x, count, n, 1);
}
template <typename At>
__device__ void tq_unrotate_smem(At x, int count, int n, float scale) {
  tq_signs_smem(x, count, n, 1);
  wht_smem(x, count, n, scale);
  tq_signs_smem(x, count, n, 0);
}

// ---- the store ------------------------------------------------------------------------------------

struct StoreArgs {
  uint8_t *k, *v;
  int64_t k_row, v_row;
  int n_ctx;
  bool ring;
  const int32_t* pos;
  const float *xk, *xv;
  int64_t ld_k, ld_v;
  int n_head_kv, hd, hdv;
  int kt, vt, rot_k, rot_v, tqb_k, tqb_v;
  float rot_scale_k, rot_scale_v, tq_scale_k, tq_scale_v;  // 1 / sqrt(n) of each transform, from the host
};

// ---- one head's row in a warp: value l + 32 j in lane l's x[j], j < n / 32 (n <= 512) ---------------

constexpr int kMaxPer = 16;

// Walsh-Hadamard transform in blocks of n (n >= 32, a power of two dividing the row): the scale
// first, then the butterflies len = 1, 2, ..: across lanes below 32 (xor shuffles), between a lane's
// values above. Each output is a + b or a - b of the same two values as in tq::walsh_hadamard, so the
// bits agree with the CPU's.
__device__ __forceinline__ void wht_warp(float* x, int per, int n, float scale) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int j = 0; j < kMaxPer; ++j)
    if (j < per) x[j] = __fmul_rn(x[j], scale);
  for (int len = 1; len < 32 && len < n; len <<= 1) {
    const bool hi = lane & len;
#pragma unroll
    for (int j = 0; j < kMaxPer; ++j)
      if (j < per) {  // (per is the same in every lane)
        const float o = __shfl_xor_sync(0xffffffffu, x[j], len);
        x[j] = hi ? __fsub_rn(o, x[j]) : __fadd_rn(x[j], o);
      }
  }
#pragma unroll
  for (int sb = 1; sb < kMaxPer; sb <<= 1) {  // len = 32 sb
    if (32 * sb >= n) break;
#pragma unroll
    for (int j = 0; j < kMaxPer; ++j)
      if (!(j & sb) && j + sb < per) {
        const float lo = x[j], hi = x[j + sb];
        x[j] = __fadd_rn(lo, hi);
        x[j + sb] = __fsub_rn(lo, hi);
      }
  }
}
// x[j] *= tq sign `which` (0: s1, 1: s2) of its value's place in its block of n.
__device__ __forceinline__ void tq_signs_warp(float* x, int per, int n, int which) {
  const int lane = threadIdx.x & 31, si = tq_size_index(n);
#pragma unroll
  for (int j = 0; j < kMaxPer; ++j)
    if (j < per && ((c_signs[si][which][j & (n / 32 - 1)] >> lane) & 1u)) x[j] = -x[j];
}
__device__ __forceinline__ void tq_rotate_warp(float* x, int per, int n, float scale) {
  tq_signs_warp(x, per, n, 0);
  wht_warp(x, per, n, scale);
  tq_signs_warp(x, per, n, 1);
}
__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// One tq block of n values (n / 32 per lane: value l + 32 j) in the least-squares scale, with the
// CPU's encoder's arithmetic (tq::encode_block: per-lane double fma chains, then xor-butterfly sums).
__device__ void tq_encode_warp(const float* y, int n, int kind, const float* cb, uint8_t* codes, uint8_t* dst) {
  const int lane = threadIdx.x & 31, per = n / 32, bits = tq_bits_of(kind), K = 1 << bits;
  double nn = 0;
  bool finite = true;
  for (int j = 0; j < per; ++j) {
    const double v = y[lane + 32 * j];
    finite = finite && isfinite(v);
    nn = __fma_rn(v, v, nn);
  }
  for (int o = 16; o > 0; o >>= 1) nn = __dadd_rn(nn, __shfl_xor_sync(0xffffffffu, nn, o));
  finite = __all_sync(0xffffffffu, finite);
  const double norm = sqrt(nn);
  double zc = 0, cc = 0;
  for (int j = 0; j < per; ++j) {
    const double zi = norm > 0 ? __ddiv_rn(static_cast<double>(y[lane + 32 * j]), norm) : 0.0;
    int k = 0;
    while (k + 1 < K && zi > 0.5 * (static_cast<double>(cb[k]) + static_cast<double>(cb[k + 1]))) ++k;
    codes[lane + 32 * j] = static_cast<uint8_t>(k);
    zc = __fma_rn(zi, static_cast<double>(cb[k]), zc);
    cc = __fma_rn(static_cast<double>(cb[k]), static_cast<double>(cb[k]), cc);
  }
  for (int o = 16; o > 0; o >>= 1) {
    zc = __dadd_rn(zc, __shfl_xor_sync(0xffffffffu, zc, o));
    cc = __dadd_rn(cc, __shfl_xor_sync(0xffffffffu, cc, o));
  }
  double gamma = 0;
  if (norm > 0 && cc > 0 && zc > 0) gamma = __ddiv_rn(__dmul_rn(norm, zc), cc);
  __syncwarp();
  if (lane == 0) {
    const float g = finite ? __double2float_rn(gamma) : __int_as_float(0x7fc00000);
    *reinterpret_cast<uint16_t*>(dst) = __half_as_ushort(__float2half_rn(g));
  }
  // The codes, packed as tq::put_codes.
  uint8_t* q = dst + 2;
  if (bits == 4) {
    for (int i = lane; i < n / 2; i += 32) q[i] = static_cast<uint8_t>(codes[2 * i] | (codes[2 * i + 1] << 4));
  } else {
    for (int i = lane; i < n / 4; i += 32)
      q[i] = static_cast<uint8_t>((codes[4 * i] & 3) | ((codes[4 * i + 1] & 3) << 2) | ((codes[4 * i + 2] & 3) << 4) |
                                  ((codes[4 * i + 3] & 3) << 6));
    if (bits == 3)
      for (int i = lane; i < n / 8; i += 32) {
        uint8_t b = 0;
        for (int j = 0; j < 8; ++j) b |= static_cast<uint8_t>(((codes[8 * i + j] >> 2) & 1) << j);
        q[n / 4 + i] = b;
      }
  }
}

// grid (n_head_kv, n_tokens, 2: K then V), one warp each: one head's row into the cache.
__global__ void __launch_bounds__(32) flash_store_kernel(StoreArgs a) {
  __shared__ float y[512];
  __shared__ uint8_t codes[512];
  pdl_enter();
  const int g = blockIdx.x, t = blockIdx.y, is_v = blockIdx.z, lane = threadIdx.x;
  const int n = is_v ? a.hdv : a.hd, kind = is_v ? a.vt : a.kt, per = n / 32;
  const int rot = is_v ? a.rot_v : a.rot_k, tqb = is_v ? a.tqb_v : a.tqb_k;
  const float* src = (is_v ? a.xv + t * a.ld_v : a.xk + t * a.ld_k) + static_cast<int64_t>(g) * n;
  const int p = a.pos[t];
  const int slot = a.ring ? p % a.n_ctx : p;
  uint8_t* dst = (is_v ? a.v + slot * a.v_row : a.k + slot * a.k_row);
  float x[kMaxPer];
#pragma unroll
  for (int j = 0; j < kMaxPer; ++j)
    if (j < per) x[j] = src[lane + 32 * j];
  if (rot > 0) wht_warp(x, per, rot, is_v ? a.rot_scale_v : a.rot_scale_k);
  if (is_tq(kind)) tq_rotate_warp(x, per, tqb, is_v ? a.tq_scale_v : a.tq_scale_k);
  switch (kind) {
    case kF32: {
      float* o = reinterpret_cast<float*>(dst) + static_cast<int64_t>(g) * n;
#pragma unroll
      for (int j = 0; j < kMaxPer; ++j)
        if (j < per) o[lane + 32 * j] = x[j];
      break;
    }
    case kF16:
    case kBF16: {
      uint16_t* o = reinterpret_cast<uint16_t*>(dst) + static_cast<int64_t>(g) * n;
#pragma unroll
      for (int j = 0; j < kMaxPer; ++j)
        if (j < per)
          o[lane + 32 * j] =
              kind == kF16 ? __half_as_ushort(__float2half_rn(x[j])) : __bfloat16_as_ushort(__float2bfloat16_rn(x[j]));
      break;
    }
    case kQ8: {  // as quant_q8_kernel (the CPU's activation quantizer): a block of 32 per j
      dst += static_cast<int64_t>(g) * per * 34;
#pragma unroll
      for (int j = 0; j < kMaxPer; ++j) {
        if (j >= per) break;
        const float amax = warp_max(fabsf(x[j]));
        const float d = __fdiv_rn(amax, 127.0f);
        const float id = amax != 0.0f ? __fdiv_rn(127.0f, amax) : 0.0f;
        const int q = __float2int_rn(__fmul_rn(x[j], id));
        const int q1 = __shfl_down_sync(0xffffffffu, q, 1);
        uint16_t* o = reinterpret_cast<uint16_t*>(dst + 34 * j);
        if (!(lane & 1)) o[1 + lane / 2] = static_cast<uint16_t>((q & 0xff) | ((q1 & 0xff) << 8));
        if (lane == 0) o[0] = __half_as_ushort(__float2half_rn(d));
      }
      break;
    }
    case kQ4: {  // as the reference's quantize_row_q4_0_ref: d from the first value of largest magnitude
      dst += static_cast<int64_t>(g) * per * 18;
#pragma unroll
      for (int j = 0; j < kMaxPer; ++j) {
        if (j >= per) break;
        float best = fabsf(x[j]);
        int at = lane;
        for (int o = 16; o > 0; o >>= 1) {
          const float ob = __shfl_xor_sync(0xffffffffu, best, o);
          const int oa = __shfl_xor_sync(0xffffffffu, at, o);
          if (ob > best || (ob == best && oa < at)) best = ob, at = oa;
        }
        const float mx = __shfl_sync(0xffffffffu, x[j], at);
        const float d = __fdiv_rn(mx, -8.0f);
        const float id = d != 0.0f ? __fdiv_rn(1.0f, d) : 0.0f;
        const int q = min(15, static_cast<int>(static_cast<int8_t>(__fadd_rn(__fmul_rn(x[j], id), 8.5f))));
        const int b = q | (__shfl_down_sync(0xffffffffu, q, 16) << 4);  // (lanes < 16: byte `lane`)
        const int b1 = __shfl_down_sync(0xffffffffu, b, 1);
        uint16_t* o = reinterpret_cast<uint16_t*>(dst + 18 * j);
        if (lane < 16 && !(lane & 1)) o[1 + lane / 2] = static_cast<uint16_t>((b & 0xff) | ((b1 & 0xff) << 8));
        if (lane == 0) o[0] = __half_as_ushort(__float2half_rn(d));
      }
      break;
    }
    default: {  // tq: the warp codes each block of tqb values
      const int bb = tq_block_bytes(kind, tqb);
      dst += static_cast<int64_t>(g) * (n / tqb) * bb;
      const float* cb = c_codebook[tq_size_index(tqb)][tq_bits_of(kind) - 2];
#pragma unroll
      for (int j = 0; j < kMaxPer; ++j)
        if (j < per) y[lane + 32 * j] = x[j];
      __syncwarp();
      for (int b = 0; b < n / tqb; ++b) tq_encode_warp(y + b * tqb, tqb, kind, cb, codes + b * tqb, dst + b * bb);
    }
  }
}

// ---- decode: split-K over the cache ---------------------------------------------------------------

struct FlashArgs {
  const float* q;
  int64_t ld_q;
  const uint8_t *k, *v;
  int64_t k_row, v_row, k_head, v_head;  // bytes per position (all heads) and per head
  int n_ctx;
  bool ring;
  int window;
  const int32_t* pos;
  int n_tokens, n_head, n_head_kv, group, hd, hdv;
  float scale_log2;  // the softmax scale times log2(e): scores are exponentiated with exp2
  int kt, vt, tqb_k, tqb_v, rot_k, rot_v;
  float rot_scale_k, rot_scale_v, tq_scale_k, tq_scale_v;
  int n_splits;
  // decode: the tile's K and V bytes staged in shared memory (rows of k_stride / v_stride bytes),
  // copied in the widest words (2 .. 16 bytes) the rows' alignment allows
  bool stage;
  int k_stride, v_stride;
  int k_align, v_align;
  float *part_o, *part_ml;
  float* out;
  int64_t ld_out;
};

constexpr int kDecThreads = 128, kTK = 64, kMaxSplitTokens = 256;  // (splits x queries of the scratch)
constexpr int kDecodeMaxTokens = kMaxVecTokens;  // more queries: the prefill kernel

__device__ __forceinline__ int slot_of(const FlashArgs& a, int p) { return a.ring ? p % a.n_ctx : p; }

// Q of heads h0 .. h0 + rows (query t) into dst(r, e), rotated as K was and scaled by scale_log2.
template <typename At>
__device__ void load_queries(const FlashArgs& a, At dst, int rows, int hd, int q_count, const int* row_tok,
                             const int* row_head) {
  for (int i = threadIdx.x; i < q_count; i += blockDim.x) {
    const int r = i / hd, e = i % hd, t = row_tok[r];
    dst(i) = t >= 0 ? a.q[t * a.ld_q + static_cast<int64_t>(row_head[r]) * hd + e] : 0.0f;
  }
  __syncthreads();
  if (a.rot_k > 0) wht_smem(dst, q_count, a.rot_k, a.rot_scale_k);
  if (is_tq(a.kt)) tq_rotate_smem(dst, q_count, a.tqb_k, a.tq_scale_k);
  // Q in K's dot format, as the reference's kernels take it: rounded to f16 for an f16 K; q8_0 (the
  // activation quantizer's bits, decoded back) for q8_0 and q4_0 K.
  if (a.kt == kF16) {
    for (int i = threadIdx.x; i < q_count; i += blockDim.x) dst(i) = __half2float(__float2half_rn(dst(i)));
    __syncthreads();
  } else if (a.kt == kQ8 || a.kt == kQ4) {
    for (int b = threadIdx.x; b < q_count / 32; b += blockDim.x) {
      float amax = 0.0f;
      for (int j = 0; j < 32; ++j) amax = fmaxf(amax, fabsf(dst(32 * b + j)));
      const float d = __half2float(__float2half_rn(__fdiv_rn(amax, 127.0f)));
      const float id = amax != 0.0f ? __fdiv_rn(127.0f, amax) : 0.0f;
      for (int j = 0; j < 32; ++j) dst(32 * b + j) = static_cast<float>(__float2int_rn(__fmul_rn(dst(32 * b + j), id))) * d;
    }
    __syncthreads();
  }
  for (int i = threadIdx.x; i < q_count; i += blockDim.x) dst(i) = dst(i) * a.scale_log2;
  __syncthreads();
  (void)rows;
}

// One query head in a warp's registers (as wht_warp's layout): rotated as K was, in K's dot format
// (load_queries' rules), scaled by scale_log2.
__device__ __forceinline__ void query_format_warp(const FlashArgs& a, float* x, int per) {
  if (a.rot_k > 0) wht_warp(x, per, a.rot_k, a.rot_scale_k);
  if (is_tq(a.kt)) tq_rotate_warp(x, per, a.tqb_k, a.tq_scale_k);
#pragma unroll
  for (int j = 0; j < kMaxPer; ++j) {
    if (j >= per) break;
    if (a.kt == kF16) {
      x[j] = __half2float(__float2half_rn(x[j]));
    } else if (a.kt == kQ8 || a.kt == kQ4) {
      const float amax = warp_max(fabsf(x[j]));
      const float d = __half2float(__float2half_rn(__fdiv_rn(amax, 127.0f)));
      const float id = amax != 0.0f ? __fdiv_rn(127.0f, amax) : 0.0f;
      x[j] = static_cast<float>(__float2int_rn(__fmul_rn(x[j], id))) * d;
    }
    x[j] *= a.scale_log2;
  }
}

// grid (n_splits, n_head_kv * group / HB, n_tokens); HB query heads of one kv head per CTA; DPT value
// dims per thread (head_dim_v / 128, or 1 with 128 / head_dim_v key streams for narrower heads).
template <int HB, int DPT>
__global__ void __launch_bounds__(kDecThreads, 3) flash_decode_kernel(FlashArgs a) {  // (3 CTAs per SM: 168 registers)
  extern __shared__ float sm[];
  const int hd = a.hd, hdv = a.hdv, LPK = hd / 32, QS = LPK * 36;
  float* q_s = sm;                 // [HB][QS]: chunk c of a head at c * 36 (banks differ per chunk)
  float* s_s = q_s + HB * QS;      // [HB][kTK] scores, then probabilities
  float* al_s = s_s + HB * kTK;    // [HB] the tile's rescaling
  float* cbk = al_s + HB;          // [16] K's codebook
  float* cbv = cbk + 16;           // [16] V's codebook
  float* red = cbv + 16;           // [KS - 1][HB][hdv] (narrow V heads)
  const int KS_ = hdv >= 128 ? 1 : 128 / hdv;
  uint8_t* kst = reinterpret_cast<uint8_t*>(sm) + ((sizeof(float) * (HB * QS + HB * kTK + HB + 32 + (KS_ - 1) * HB * hdv) + 15) & ~size_t{15});
  uint8_t* vst = kst + kTK * a.k_stride;  // [kTK][v_stride]
  const int split = blockIdx.x, hbk = blockIdx.y, t = blockIdx.z;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int blocks_per_kv = a.group / HB;
  const int g_kv = hbk / blocks_per_kv, h0 = g_kv * a.group + (hbk % blocks_per_kv) * HB;
  if (tid < 16) {
    cbk[tid] = is_tq(a.kt) ? c_codebook[tq_size_index(a.tqb_k)][tq_bits_of(a.kt) - 2][tid] : 0.0f;
    cbv[tid] = is_tq(a.vt) ? c_codebook[tq_size_index(a.tqb_v)][tq_bits_of(a.vt) - 2][tid] : 0.0f;
  }
  pdl_enter();
  const int p = a.pos[t];
  const int lo = a.window > 0 ? max(0, p - a.window + 1) : 0, hi = p + 1;
  const int per = (hi - lo + a.n_splits - 1) / a.n_splits;
  const int k0 = lo + split * per, k1 = min(hi, k0 + per);
  __syncthreads();
  // Q: a warp per query head, its values in registers (chunk j of 32 values at j * 36 in q_s).
#pragma unroll
  for (int gi = 0; gi < 2; ++gi) {
    const int g = warp + 4 * gi;
    if (g >= HB) break;
    float x[kMaxPer];
    const int per = hd / 32;
    const float* qr = a.q + t * a.ld_q + static_cast<int64_t>(h0 + g) * hd;
#pragma unroll
    for (int j = 0; j < kMaxPer; ++j)
      if (j < per) x[j] = qr[lane + 32 * j];
    query_format_warp(a, x, per);
#pragma unroll
    for (int j = 0; j < kMaxPer; ++j)
      if (j < per) q_s[g * QS + j * 36 + lane] = x[j];
  }
  __syncthreads();

  const int KS = hdv >= 128 ? 1 : 128 / hdv;
  const int sub = hdv >= 128 ? 0 : tid / hdv, d0 = hdv >= 128 ? tid : tid % hdv;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f};
  float acc[HB][DPT];
#pragma unroll
  for (int g = 0; g < HB; ++g)
#pragma unroll
    for (int i = 0; i < DPT; ++i) acc[g][i] = 0.0f;
  const uint8_t* kbase = a.k + g_kv * a.k_head;
  const uint8_t* vbase = a.v + g_kv * a.v_head;
  const int kpw = 32 / LPK, c = lane % LPK;
  // A tile's rows into shared memory in words of W bytes, sixteen loads in flight per thread before any
  // store (the loop's stores could alias its loads otherwise, and one load at a time leaves the
  // memory system idle).
  auto copy_words = [&](auto word, uint8_t* to, int stride, const uint8_t* from, int64_t row, int64_t head, int kb, int nk) {
    using W = decltype(word);
    const int words = static_cast<int>(head / sizeof(W)), total = nk * words;
    constexpr int B = 8;
    for (int i0 = tid; i0 < total; i0 += B * kDecThreads) {
      W w[B];
#pragma unroll
      for (int u = 0; u < B; ++u) {
        const int i = i0 + u * kDecThreads, j = i / words;
        if (i < total) w[u] = reinterpret_cast<const W*>(from + slot_of(a, kb + j) * row)[i - j * words];
      }
#pragma unroll
      for (int u = 0; u < B; ++u) {
        const int i = i0 + u * kDecThreads, j = i / words;
        if (i < total) reinterpret_cast<W*>(to + j * stride)[i - j * words] = w[u];
      }
    }
  };
  auto copy_rows = [&](uint8_t* to, int stride, const uint8_t* from, int64_t row, int64_t head, int align, int kb, int nk) {
    if (align >= 16) copy_words(uint4{}, to, stride, from, row, head, kb, nk);
    else if (align >= 8) copy_words(uint2{}, to, stride, from, row, head, kb, nk);
    else if (align >= 4) copy_words(uint32_t{}, to, stride, from, row, head, kb, nk);
    else copy_words(uint16_t{}, to, stride, from, row, head, kb, nk);
  };
  for (int kb = k0; kb < k1; kb += kTK) {
    const int nk = min(kTK, k1 - kb);
    // The tile's bytes in shared memory: every thread's loads in flight at once.
    if (a.stage) {
      copy_rows(kst, a.k_stride, kbase, a.k_row, a.k_head, a.k_align, kb, nk);
      copy_rows(vst, a.v_stride, vbase, a.v_row, a.v_head, a.v_align, kb, nk);
      __syncthreads();
    }
    // Scores: LPK lanes per key, 32 dims each, two keys per lane (each Q read serves both), eight
    // values of each at a time.
    for (int j0 = warp * 2 * kpw; j0 < kTK; j0 += 8 * kpw) {
      const int ja = j0 + lane / LPK, jb = ja + kpw;
      const uint8_t* ra = a.stage ? kst + ja * a.k_stride : kbase + slot_of(a, kb + min(ja, nk - 1)) * a.k_row;
      const uint8_t* rb = a.stage ? kst + jb * a.k_stride : kbase + slot_of(a, kb + min(jb, nk - 1)) * a.k_row;
      float pa[HB], pb[HB];
#pragma unroll
      for (int g = 0; g < HB; ++g) pa[g] = pb[g] = 0.0f;
#pragma unroll
      for (int sub8 = 0; sub8 < 4; ++sub8) {
        float ka[8], kb2[8];
        decode8(a.kt, ra, c, sub8, a.tqb_k, cbk, ka);
        decode8(a.kt, rb, c, sub8, a.tqb_k, cbk, kb2);
#pragma unroll
        for (int g = 0; g < HB; ++g) {
          const float4* qq = reinterpret_cast<const float4*>(q_s + g * QS + c * 36 + 8 * sub8);
          const float4 x0 = qq[0], x1 = qq[1];
          const float xs[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            pa[g] = fmaf(xs[i], ka[i], pa[g]);
            pb[g] = fmaf(xs[i], kb2[i], pb[g]);
          }
        }
      }
      for (int o = LPK / 2; o > 0; o >>= 1)
#pragma unroll
        for (int g = 0; g < HB; ++g) {
          pa[g] += __shfl_xor_sync(0xffffffffu, pa[g], o);
          pb[g] += __shfl_xor_sync(0xffffffffu, pb[g], o);
        }
      if (c == 0)
#pragma unroll
        for (int g = 0; g < HB; ++g) {
          s_s[g * kTK + ja] = ja < nk ? pa[g] : -INFINITY;
          s_s[g * kTK + jb] = jb < nk ? pb[g] : -INFINITY;
        }
    }
    __syncthreads();
    // Online softmax: a warp per query head.
#pragma unroll
    for (int gi = 0; gi < 2; ++gi) {
      const int g = warp + 4 * gi;
      if (g >= HB) break;
      const float s0 = s_s[g * kTK + lane], s1 = s_s[g * kTK + lane + 32];
      float mx = fmaxf(s0, s1);
      for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
      const float m_new = fmaxf(m_run[gi], mx);
      const float alpha = m_new == -INFINITY ? 1.0f : exp2f(m_run[gi] - m_new);
      const float p0 = m_new == -INFINITY ? 0.0f : exp2f(s0 - m_new);
      const float p1 = m_new == -INFINITY ? 0.0f : exp2f(s1 - m_new);
      float sum = p0 + p1;
      for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
      l_run[gi] = l_run[gi] * alpha + sum;
      m_run[gi] = m_new;
      s_s[g * kTK + lane] = p0;
      s_s[g * kTK + lane + 32] = p1;
      if (lane == 0) al_s[g] = alpha;
    }
    __syncthreads();
    // P V: V decoded straight from its bytes, one value per thread and dim.
#pragma unroll
    for (int g = 0; g < HB; ++g)
#pragma unroll
      for (int i = 0; i < DPT; ++i) acc[g][i] *= al_s[g];
    const int j_lo = sub * (kTK / KS), j_hi = min(nk, j_lo + kTK / KS);
    auto vrow = [&](int j) { return a.stage ? vst + j * a.v_stride : vbase + slot_of(a, kb + j) * a.v_row; };
    int j = j_lo;
    for (; j + 4 <= j_hi; j += 4) {  // four keys at a time: their probabilities in one float4 per head
      float v[4][DPT];
#pragma unroll
      for (int u = 0; u < 4; ++u)
#pragma unroll
        for (int i = 0; i < DPT; ++i) v[u][i] = decode1(a.vt, vrow(j + u), d0 + 128 * i, a.tqb_v, cbv);
#pragma unroll
      for (int g = 0; g < HB; ++g) {
        const float4 p = *reinterpret_cast<const float4*>(s_s + g * kTK + j);
#pragma unroll
        for (int i = 0; i < DPT; ++i) {
          float t = fmaf(p.x, v[0][i], acc[g][i]);
          t = fmaf(p.y, v[1][i], t);
          t = fmaf(p.z, v[2][i], t);
          acc[g][i] = fmaf(p.w, v[3][i], t);
        }
      }
    }
    for (; j < j_hi; ++j)
#pragma unroll
      for (int i = 0; i < DPT; ++i) {
        const float v = decode1(a.vt, vrow(j), d0 + 128 * i, a.tqb_v, cbv);
#pragma unroll
        for (int g = 0; g < HB; ++g) acc[g][i] = fmaf(s_s[g * kTK + j], v, acc[g][i]);
      }
    __syncthreads();
  }
  if (KS > 1) {
    if (sub > 0)
#pragma unroll
      for (int g = 0; g < HB; ++g) red[((sub - 1) * HB + g) * hdv + d0] = acc[g][0];
    __syncthreads();
    if (sub == 0)
      for (int s2 = 1; s2 < KS; ++s2)
#pragma unroll
        for (int g = 0; g < HB; ++g) acc[g][0] += red[((s2 - 1) * HB + g) * hdv + d0];
  }
  const int64_t base = static_cast<int64_t>(t) * a.n_head + h0;  // (head h0 + g of token t)
  if (sub == 0)
#pragma unroll
    for (int g = 0; g < HB; ++g)
#pragma unroll
      for (int i = 0; i < DPT; ++i)
        a.part_o[((base + g) * a.n_splits + split) * hdv + d0 + 128 * i] = acc[g][i];
#pragma unroll
  for (int gi = 0; gi < 2; ++gi) {
    const int g = warp + 4 * gi;
    if (g < HB && lane == 0) {
      a.part_ml[((base + g) * a.n_splits + split) * 2] = m_run[gi];
      a.part_ml[((base + g) * a.n_splits + split) * 2 + 1] = l_run[gi];
    }
  }
}

// grid (n_head, n_tokens): the splits merged, normalised, V's rotation undone, into out.
__global__ void __launch_bounds__(kDecThreads) flash_combine_kernel(FlashArgs a) {
  extern __shared__ float sm[];
  float* o_s = sm;                // [hdv]
  float* w_s = o_s + a.hdv;       // [n_splits]
  __shared__ float inv_l;
  pdl_enter();
  const int h = blockIdx.x, t = blockIdx.y, tid = threadIdx.x;
  const int64_t r = static_cast<int64_t>(t) * a.n_head + h;
  const float* ml = a.part_ml + r * a.n_splits * 2;
  float M = -INFINITY;
  for (int s = 0; s < a.n_splits; ++s) M = fmaxf(M, ml[2 * s]);
  for (int s = tid; s < a.n_splits; s += blockDim.x) w_s[s] = ml[2 * s] == -INFINITY ? 0.0f : exp2f(ml[2 * s] - M);
  __syncthreads();
  if (tid == 0) {
    float L = 0.0f;
    for (int s = 0; s < a.n_splits; ++s) L += ml[2 * s + 1] * w_s[s];
    inv_l = L > 0.0f ? 1.0f / L : 0.0f;
  }
  __syncthreads();
  const float* po = a.part_o + r * a.n_splits * a.hdv;
  for (int d = tid; d < a.hdv; d += blockDim.x) {
    float o = 0.0f;
    for (int s = 0; s < a.n_splits; ++s) o = fmaf(po[s * a.hdv + d], w_s[s], o);
    o_s[d] = o * inv_l;
  }
  __syncthreads();
  auto at = [o_s](int i) -> float& { return o_s[i]; };
  if (is_tq(a.vt)) tq_unrotate_smem(at, a.hdv, a.tqb_v, a.tq_scale_v);
  if (a.rot_v > 0) wht_smem(at, a.hdv, a.rot_v, a.rot_scale_v);
  for (int d = tid; d < a.hdv; d += blockDim.x) a.out[t * a.ld_out + static_cast<int64_t>(h) * a.hdv + d] = o_s[d];
}

// ---- prefill: tensor cores ------------------------------------------------------------------------

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 700
#define FITMOE_FA_WMMA 1
#endif

constexpr int kPreThreads = 128, kPrefillMinTokens = 64;

template <int BQ, int NK, int D>
struct PrefillLayout {
  static constexpr int QLD = D + 8;      // halves
  static constexpr int SLD = NK + 4;     // floats (P: halves, 2 * SLD)
  static constexpr int OLD = D + 4;      // floats
  static constexpr size_t q_bytes = sizeof(__half) * BQ * QLD;
  static constexpr size_t kv_bytes = sizeof(__half) * NK * QLD;
  static constexpr size_t s_bytes = sizeof(float) * BQ * SLD;
  static constexpr size_t o_bytes = sizeof(float) * BQ * OLD;
  static constexpr size_t bytes = q_bytes + kv_bytes + s_bytes + o_bytes + sizeof(float) * 4 * BQ + sizeof(int) * 2 * BQ + 2 * 16 * sizeof(float);
};

// grid (ceil(n_tokens / (BQ / HPC)), n_head / HPC): BQ query rows = BQ / HPC tokens x HPC heads of one kv head.
template <int BQ, int NK, int D>
__global__ void __launch_bounds__(kPreThreads) flash_prefill_kernel(FlashArgs a, int hpc) {
#ifdef FITMOE_FA_WMMA
  using namespace nvcuda;
  using L = PrefillLayout<BQ, NK, D>;
  extern __shared__ __align__(16) uint8_t smem[];
  __half* q_h = reinterpret_cast<__half*>(smem);
  __half* kv_h = reinterpret_cast<__half*>(smem + L::q_bytes);
  float* s_f = reinterpret_cast<float*>(smem + L::q_bytes + L::kv_bytes);
  float* o_f = reinterpret_cast<float*>(smem + L::q_bytes + L::kv_bytes + L::s_bytes);
  float* m_s = o_f + BQ * L::OLD;
  float* l_s = m_s + BQ;
  float* al_s = l_s + BQ;
  float* cbk = al_s + 2 * BQ;
  float* cbv = cbk + 16;
  int* row_tok = reinterpret_cast<int*>(cbv + 16);
  int* row_head = row_tok + BQ;
  __shared__ int row_pos[BQ];
  __shared__ int range[2];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int bt = BQ / hpc, t0 = blockIdx.x * bt, h0 = blockIdx.y * hpc, g_kv = h0 / a.group;
  if (tid < 16) {
    cbk[tid] = is_tq(a.kt) ? c_codebook[tq_size_index(a.tqb_k)][tq_bits_of(a.kt) - 2][tid] : 0.0f;
    cbv[tid] = is_tq(a.vt) ? c_codebook[tq_size_index(a.tqb_v)][tq_bits_of(a.vt) - 2][tid] : 0.0f;
  }
  pdl_enter();
  for (int r = tid; r < BQ; r += blockDim.x) {
    const int t = t0 + r / hpc;
    row_tok[r] = t < a.n_tokens ? t : -1;
    row_head[r] = h0 + r % hpc;
    row_pos[r] = t < a.n_tokens ? a.pos[t] : -1;
    m_s[r] = -INFINITY;
    l_s[r] = 0.0f;
  }
  __syncthreads();
  if (tid == 0) {
    const int t_last = min(a.n_tokens, t0 + bt) - 1;
    const int p_first = a.pos[t0], p_last = a.pos[t_last];
    range[0] = a.window > 0 ? max(0, p_first - a.window + 1) : 0;
    range[1] = p_last + 1;
  }
  // Q (f32 in o_f for the rotation), then f16 into q_h.
  load_queries(a, [o_f](int i) -> float& { return o_f[(i / D) * L::OLD + (i % D)]; }, BQ, D, BQ * D, row_tok, row_head);
  for (int i = tid; i < BQ * D; i += blockDim.x) {
    const int r = i / D, e = i % D;
    q_h[r * L::QLD + e] = __float2half_rn(o_f[r * L::OLD + e]);
    o_f[r * L::OLD + e] = 0.0f;
  }
  __syncthreads();
  const int lo = range[0], hi = range[1];
  const uint8_t* kbase = a.k + g_kv * a.k_head;
  const uint8_t* vbase = a.v + g_kv * a.v_head;
  // A tile of NK rows (K or V) decoded to f16: thread per (key, 32-value chunk).
  auto load_tile = [&](const uint8_t* base, int64_t row_bytes, int kind, int tqb, const float* cb, int kb, int nk) {
    for (int i = tid; i < NK * (D / 32); i += blockDim.x) {
      const int j = i / (D / 32), c = i % (D / 32);
      uint4* dst = reinterpret_cast<uint4*>(kv_h + j * L::QLD + c * 32);
      if (j < nk) {
        float v[32];
        decode32(kind, base + slot_of(a, kb + j) * row_bytes, c, tqb, cb, v);
#pragma unroll
        for (int w = 0; w < 4; ++w) {
          __half2 hh[4];
#pragma unroll
          for (int e = 0; e < 4; ++e) hh[e] = __floats2half2_rn(v[8 * w + 2 * e], v[8 * w + 2 * e + 1]);
          dst[w] = *reinterpret_cast<const uint4*>(hh);
        }
      } else {
        for (int w = 0; w < 4; ++w) dst[w] = make_uint4(0, 0, 0, 0);
      }
    }
  };
  for (int kb = lo; kb < hi; kb += NK) {
    const int nk = min(NK, hi - kb);
    load_tile(kbase, a.k_row, a.kt, a.tqb_k, cbk, kb, nk);
    __syncthreads();
    // S = Q K^T.
    for (int f = warp; f < (BQ / 16) * (NK / 16); f += 4) {
      const int rt = f / (NK / 16), ct = f % (NK / 16);
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
      wmma::fill_fragment(acc, 0.0f);
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> fa;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major> fb;
        wmma::load_matrix_sync(fa, q_h + rt * 16 * L::QLD + kk * 16, L::QLD);
        wmma::load_matrix_sync(fb, kv_h + ct * 16 * L::QLD + kk * 16, L::QLD);
        wmma::mma_sync(acc, fa, fb, acc);
      }
      wmma::store_matrix_sync(s_f + rt * 16 * L::SLD + ct * 16, acc, L::SLD, wmma::mem_row_major);
    }
    __syncthreads();
    // Softmax per row (a warp per row), P as f16 in place of the row's scores, O rescaled; then V.
    for (int r = warp; r < BQ; r += 4) {
      const int p = row_pos[r];
      float sv[NK / 32];
      float mx = -INFINITY;
#pragma unroll
      for (int i = 0; i < NK / 32; ++i) {
        const int j = lane + 32 * i, kp = kb + j;
        const bool ok = j < nk && kp <= p && (a.window <= 0 || kp > p - a.window);
        sv[i] = ok ? s_f[r * L::SLD + j] : -INFINITY;
        mx = fmaxf(mx, sv[i]);
      }
      for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
      const float m_old = m_s[r], m_new = fmaxf(m_old, mx);
      const float alpha = m_new == -INFINITY ? 1.0f : exp2f(m_old - m_new);
      float sum = 0.0f;
#pragma unroll
      for (int i = 0; i < NK / 32; ++i) {
        sv[i] = m_new == -INFINITY ? 0.0f : exp2f(sv[i] - m_new);
        sum += sv[i];
      }
      for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
      __syncwarp();
      __half* prow = reinterpret_cast<__half*>(s_f + r * L::SLD);
#pragma unroll
      for (int i = 0; i < NK / 32; ++i) prow[lane + 32 * i] = __float2half_rn(sv[i]);
      if (lane == 0) m_s[r] = m_new, l_s[r] = l_s[r] * alpha + sum;
      for (int e = lane; e < D; e += 32) o_f[r * L::OLD + e] *= alpha;
    }
    load_tile(vbase, a.v_row, a.vt, a.tqb_v, cbv, kb, nk);
    __syncthreads();
    // O += P V.
    for (int f = warp; f < (BQ / 16) * (D / 16); f += 4) {
      const int rt = f / (D / 16), ct = f % (D / 16);
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
      wmma::load_matrix_sync(acc, o_f + rt * 16 * L::OLD + ct * 16, L::OLD, wmma::mem_row_major);
#pragma unroll
      for (int kk = 0; kk < NK / 16; ++kk) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> fa;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::row_major> fb;
        wmma::load_matrix_sync(fa, reinterpret_cast<const __half*>(s_f) + rt * 16 * 2 * L::SLD + kk * 16, 2 * L::SLD);
        wmma::load_matrix_sync(fb, kv_h + kk * 16 * L::QLD + ct * 16, L::QLD);
        wmma::mma_sync(acc, fa, fb, acc);
      }
      wmma::store_matrix_sync(o_f + rt * 16 * L::OLD + ct * 16, acc, L::OLD, wmma::mem_row_major);
    }
    __syncthreads();
  }
  // Normalise, undo V's rotation, write.
  for (int i = tid; i < BQ * D; i += blockDim.x) {
    const int r = i / D, e = i % D;
    const float l = l_s[r];
    o_f[r * L::OLD + e] = l > 0.0f ? o_f[r * L::OLD + e] / l : 0.0f;
  }
  __syncthreads();
  auto at = [o_f](int i) -> float& { return o_f[(i / D) * L::OLD + (i % D)]; };
  if (is_tq(a.vt)) tq_unrotate_smem(at, BQ * D, a.tqb_v, a.tq_scale_v);
  if (a.rot_v > 0) wht_smem(at, BQ * D, a.rot_v, a.rot_scale_v);
  for (int i = tid; i < BQ * D; i += blockDim.x) {
    const int r = i / D, e = i % D, t = row_tok[r];
    if (t >= 0) a.out[t * a.ld_out + static_cast<int64_t>(row_head[r]) * D + e] = o_f[r * L::OLD + e];
  }
  (void)lane;
#endif
}

// ---- host side ------------------------------------------------------------------------------------

int sm_count() {
  static std::mutex mu;
  static std::vector<int> counts;
  int dev = 0;
  fa_check(cudaGetDevice(&dev), "flash attention");
  std::lock_guard<std::mutex> lock(mu);
  if (static_cast<int>(counts.size()) <= dev) counts.resize(dev + 1, 0);
  if (!counts[dev]) fa_check(cudaDeviceGetAttribute(&counts[dev], cudaDevAttrMultiProcessorCount, dev), "flash attention");
  return counts[dev];
}

int compute_capability() {
  static std::mutex mu;
  static std::vector<int> ccs;
  int dev = 0;
  fa_check(cudaGetDevice(&dev), "flash attention");
  std::lock_guard<std::mutex> lock(mu);
  if (static_cast<int>(ccs.size()) <= dev) ccs.resize(dev + 1, 0);
  if (!ccs[dev]) {
    int ma = 0, mi = 0;
    fa_check(cudaDeviceGetAttribute(&ma, cudaDevAttrComputeCapabilityMajor, dev), "flash attention");
    fa_check(cudaDeviceGetAttribute(&mi, cudaDevAttrComputeCapabilityMinor, dev), "flash attention");
    ccs[dev] = 10 * ma + mi;
  }
  return ccs[dev];
}

float inv_sqrt_f(int n) { return 1.0f / std::sqrt(static_cast<float>(n)); }  // (as tq::walsh_hadamard)

void check_head(DType t, int n, const char* which) {
  if (n < 32 || n > 512 || n % 32 != 0)
    fa_fail(std::string("flash attention: ") + which + " heads of " + std::to_string(n) +
            " values (multiples of 32 up to 512)");
  if (kv_type_is_tq(t) && tq_block(n) < 32)
    fa_fail(std::string("flash attention: ") + which + " heads of " + std::to_string(n) + " cannot hold tq blocks");
}

template <int HB, int DPT>
void launch_decode(FlashArgs a, cudaStream_t st) {
  const int QS = a.hd / 32 * 36, KS = a.hdv >= 128 ? 1 : 128 / a.hdv;
  const size_t base = (sizeof(float) * (HB * QS + HB * kTK + HB + 32 + static_cast<size_t>(KS - 1) * HB * a.hdv) + 15) & ~size_t{15};
  // Staging where a tile's rows fit in 64 KiB (and the device allows it): wider heads of wide types read
  // the cache directly.
  a.k_stride = static_cast<int>((a.k_head + 15) / 16 * 16);
  a.v_stride = static_cast<int>((a.v_head + 15) / 16 * 16);
  const size_t staged = static_cast<size_t>(kTK) * (a.k_stride + a.v_stride);
  a.stage = staged <= 64 * 1024 && base + staged <= smem_per_block("flash attention (decode)");
  auto align = [](int64_t head, int64_t row) {
    int w = 16;
    while (w > 2 && (head % w != 0 || row % w != 0)) w /= 2;
    return w;
  };
  a.k_align = align(a.k_head, a.k_row);
  a.v_align = align(a.v_head, a.v_row);
  const size_t smem = base + (a.stage ? staged : 0);
  const dim3 grid(static_cast<unsigned>(a.n_splits), static_cast<unsigned>(a.n_head_kv * (a.group / HB)),
                  static_cast<unsigned>(a.n_tokens));
  need_dynamic_smem(reinterpret_cast<const void*>(flash_decode_kernel<HB, DPT>), smem, "flash attention (decode)");
  launch(flash_decode_kernel<HB, DPT>, grid, kDecThreads, smem, st, a);
}

template <int HB>
void launch_decode_hb(const FlashArgs& a, cudaStream_t st) {
  if (a.hdv <= 128) launch_decode<HB, 1>(a, st);
  else if (a.hdv == 256) launch_decode<HB, 2>(a, st);
  else launch_decode<HB, 4>(a, st);
}

void run_decode(FlashArgs a, void* scratch, size_t scratch_bytes, int keys_max, cudaStream_t st) {
  if (a.hdv > 128 && a.hdv != 256 && a.hdv != 512)
    fa_fail("flash attention: V heads of " + std::to_string(a.hdv) + " values (32, 64, 128, 256 or 512)");
  if (a.hdv < 128 && 128 % a.hdv != 0)
    fa_fail("flash attention: V heads of " + std::to_string(a.hdv) + " values (32, 64, 128, 256 or 512)");
  const int hb = a.group % 8 == 0 ? 8 : a.group % 4 == 0 ? 4 : a.group % 2 == 0 ? 2 : 1;
  const int ctas = a.n_head_kv * (a.group / hb) * a.n_tokens;
  // About eight CTAs per multiprocessor (their loads hide each other's latency), a tile of keys at least each.
  int splits = std::max(1, 8 * sm_count() / std::max(ctas, 1));
  splits = std::min(splits, std::max(1, (keys_max + kTK - 1) / kTK));
  splits = std::min(splits, std::max(1, kMaxSplitTokens / a.n_tokens));
  const size_t per_split = static_cast<size_t>(a.n_tokens) * a.n_head * (a.hdv + 2) * sizeof(float);
  splits = std::min<int>(splits, static_cast<int>(scratch_bytes / per_split));
  if (splits < 1) fa_fail("flash attention: the attention scratch is too small");
  a.n_splits = splits;
  a.part_o = static_cast<float*>(scratch);
  a.part_ml = a.part_o + static_cast<size_t>(a.n_tokens) * a.n_head * splits * a.hdv;
  if (hb == 8) launch_decode_hb<8>(a, st);
  else if (hb == 4) launch_decode_hb<4>(a, st);
  else if (hb == 2) launch_decode_hb<2>(a, st);
  else launch_decode_hb<1>(a, st);
  fa_check(cudaGetLastError(), "flash attention (decode)");
  const size_t smem = sizeof(float) * (a.hdv + splits);
  launch(flash_combine_kernel, dim3(static_cast<unsigned>(a.n_head), static_cast<unsigned>(a.n_tokens)), kDecThreads,
         smem, st, a);
  fa_check(cudaGetLastError(), "flash attention (combine)");
}

template <int BQ, int NK, int D>
bool try_prefill(const FlashArgs& a, cudaStream_t st) {
  using L = PrefillLayout<BQ, NK, D>;
  if (L::bytes > smem_per_block("flash attention (prefill)")) return false;
  const int hpc = a.group <= BQ && BQ % a.group == 0 ? a.group : 1;
  const int bt = BQ / hpc;
  const dim3 grid(static_cast<unsigned>((a.n_tokens + bt - 1) / bt), static_cast<unsigned>(a.n_head / hpc));
  need_dynamic_smem(reinterpret_cast<const void*>(flash_prefill_kernel<BQ, NK, D>), L::bytes, "flash attention (prefill)");
  launch(flash_prefill_kernel<BQ, NK, D>, grid, kPreThreads, L::bytes, st, a, hpc);
  fa_check(cudaGetLastError(), "flash attention (prefill)");
  return true;
}

// The tensor-core kernel for this head width on this device, largest tile first; false: none fits.
bool run_prefill(const FlashArgs& a, cudaStream_t st) {
  if (compute_capability() < 70 || a.hd != a.hdv) return false;
  switch (a.hd) {
    case 32: return try_prefill<64, 64, 32>(a, st);
    case 64: return try_prefill<64, 64, 64>(a, st);
    case 128: return try_prefill<64, 64, 128>(a, st) || try_prefill<32, 64, 128>(a, st);
    case 256: return try_prefill<64, 64, 256>(a, st) || try_prefill<32, 64, 256>(a, st) || try_prefill<16, 64, 256>(a, st);
    case 512: return try_prefill<16, 32, 512>(a, st);
    default: return false;
  }
}

}  // namespace

void flash_init_tables() {
  int dev = 0;
  fa_check(cudaGetDevice(&dev), "flash attention tables");
  std::lock_guard<std::mutex> lock(g_tables_mu);
  if (static_cast<int>(g_tables_done.size()) > dev && g_tables_done[dev]) return;
  float cb[3][3][16] = {};
  uint32_t signs[3][2][4] = {};
  for (int si = 0; si < 3; ++si) {
    const int n = 32 << si;
    for (int bits = 2; bits <= 4; ++bits) {
      const auto& c = tq::lloyd_max_codebook(n, bits);
      for (size_t i = 0; i < c.size(); ++i) cb[si][bits - 2][i] = c[i];
    }
    for (int w = 0; w < 2; ++w) {
      const std::vector<float> s = tq::rotation_signs(n, w + 1);
      for (int i = 0; i < n; ++i)
        if (s[i] < 0) signs[si][w][i / 32] |= 1u << (i % 32);
    }
  }
  fa_check(cudaMemcpyToSymbol(c_codebook, cb, sizeof(cb)), "flash attention tables");
  fa_check(cudaMemcpyToSymbol(c_signs, signs, sizeof(signs)), "flash attention tables");
  if (static_cast<int>(g_tables_done.size()) <= dev) g_tables_done.resize(dev + 1, false);
  g_tables_done[dev] = true;
}

void flash_kv_store(const DevKv& kv, bool ring, const int32_t* pos, int n_tokens, const float* k, int64_t ld_k,
                    const float* v, int64_t ld_v, int n_head_kv, int head_dim, int head_dim_v, Stream s) {
  if (n_tokens <= 0) return;
  if (!kv.flash) fa_fail("flash_kv_store: the cache is not a flash-attention cache");
  if (n_tokens > 65535) fa_fail("flash_kv_store: too many tokens in one call");
  check_head(kv.type, head_dim, "K");
  check_head(kv.v_type, head_dim_v, "V");
  flash_init_tables();
  StoreArgs a{};
  a.k = kv.k, a.v = kv.v, a.k_row = kv.k_row_bytes, a.v_row = kv.v_row_bytes, a.n_ctx = kv.n_ctx, a.ring = ring;
  a.pos = pos, a.xk = k, a.xv = v, a.ld_k = ld_k, a.ld_v = ld_v;
  a.n_head_kv = n_head_kv, a.hd = head_dim, a.hdv = head_dim_v;
  a.kt = kind_of(kv.type), a.vt = kind_of(kv.v_type), a.rot_k = kv.rot_k, a.rot_v = kv.rot_v;
  a.tqb_k = kv.tq_block_k, a.tqb_v = kv.tq_block_v;
  a.rot_scale_k = kv.rot_k ? inv_sqrt_f(kv.rot_k) : 1.0f;
  a.rot_scale_v = kv.rot_v ? inv_sqrt_f(kv.rot_v) : 1.0f;
  a.tq_scale_k = inv_sqrt_f(kv.tq_block_k);
  a.tq_scale_v = inv_sqrt_f(kv.tq_block_v);
  const dim3 grid(static_cast<unsigned>(n_head_kv), static_cast<unsigned>(n_tokens), 2);
  launch(flash_store_kernel, grid, 32, 0, cs(s), a);
  fa_check(cudaGetLastError(), "flash_kv_store");
}

size_t flash_scratch_bytes(int n_head, int head_dim_v) {
  return static_cast<size_t>(kMaxSplitTokens) * n_head * (head_dim_v + 2) * sizeof(float);
}

void flash_attention(const float* q, int64_t ld_q, const DevKv& kv, bool ring, int window, const int32_t* pos,
                     int n_tokens, int keys_max, int n_head, int n_head_kv, int head_dim, int head_dim_v, float scale,
                     float* out, int64_t ld_out, void* scratch, size_t scratch_bytes, Stream s, int kernel) {
  if (n_tokens <= 0) return;
  if (!kv.flash) fa_fail("flash_attention: the cache is not a flash-attention cache");
  if (n_head_kv <= 0 || n_head % n_head_kv != 0) fa_fail("flash_attention: n_head must be a multiple of n_head_kv");
  if (n_tokens > 65535) fa_fail("flash_attention: too many tokens in one call");
  check_head(kv.type, head_dim, "K");
  check_head(kv.v_type, head_dim_v, "V");
  if (keys_max <= 0) fa_fail("flash_attention: keys_max must be positive");
  if (!ring && keys_max > kv.n_ctx) fa_fail("flash_attention: more keys than the cache holds");
  flash_init_tables();
  FlashArgs a{};
  a.q = q, a.ld_q = ld_q, a.k = kv.k, a.v = kv.v, a.k_row = kv.k_row_bytes, a.v_row = kv.v_row_bytes;
  a.k_head = static_cast<int64_t>(kv_row_bytes(kv.type, head_dim));
  a.v_head = static_cast<int64_t>(kv_row_bytes(kv.v_type, head_dim_v));
  a.n_ctx = kv.n_ctx, a.ring = ring, a.window = window, a.pos = pos;
  a.n_tokens = n_tokens, a.n_head = n_head, a.n_head_kv = n_head_kv, a.group = n_head / n_head_kv;
  a.hd = head_dim, a.hdv = head_dim_v;
  a.scale_log2 = scale * 1.4426950408889634f;
  a.kt = kind_of(kv.type), a.vt = kind_of(kv.v_type), a.tqb_k = kv.tq_block_k, a.tqb_v = kv.tq_block_v;
  a.rot_k = kv.rot_k, a.rot_v = kv.rot_v;
  a.rot_scale_k = kv.rot_k ? inv_sqrt_f(kv.rot_k) : 1.0f;
  a.rot_scale_v = kv.rot_v ? inv_sqrt_f(kv.rot_v) : 1.0f;
  a.tq_scale_k = inv_sqrt_f(kv.tq_block_k);
  a.tq_scale_v = inv_sqrt_f(kv.tq_block_v);
  a.out = out, a.ld_out = ld_out;
  const cudaStream_t st = cs(s);
  // Batches under 64 queries take the decode kernel too (f32 arithmetic, as the reference's one-row
  // kernel, which it uses below 64 rows); larger ones the tensor cores where the device has them.
  if (n_tokens >= kPrefillMinTokens && kernel != 1 && run_prefill(a, st)) return;
  // The decode kernel, in batches of up to kDecodeMaxTokens queries.
  for (int t0 = 0; t0 < n_tokens; t0 += kDecodeMaxTokens) {
    FlashArgs b = a;
    b.n_tokens = std::min(kDecodeMaxTokens, n_tokens - t0);
    b.q = q + t0 * ld_q;
    b.pos = pos + t0;
    b.out = out + t0 * ld_out;
    run_decode(b, scratch, scratch_bytes, keys_max, st);
  }
}

}  // namespace fitmoe::gpu
