// The GPU op set (CUDA kernels behind src/cuda/gpu_ops.h).
//
// Numerics, as the CPU engine (src/runtime/cpu_ops.cpp, src/quant/reference.cpp):
// - Activation quantizers and weight decoders use explicit IEEE intrinsics (__fmul_rn, __fadd_rn,
//   __fdiv_rn, ...) wherever the CPU rounds an intermediate result, so nvcc's default contraction of
//   a*b+c into an FMA (and any future -fmad setting) cannot change them. No special flags are needed,
//   but this file must NOT be compiled with --use_fast_math (expf, division and sqrt would change).
// - Integer block dot products: every block's (or super-block's) integer sum is formed exactly (dp4a,
//   then an integer reduction across the lanes that share a block) before it is converted to float and
//   multiplied by d_w * d_a, exactly as quant::vec_dot_ref; only the float sum over blocks is in a
//   different order (lanes, then a warp reduction).
// - Attention: the K.Q scores are computed in the reference's canonical order (16 interleaved f32
//   lanes with fma, folded in halves), so they are bit-identical to cpu::attention's; softmax uses
//   CUDA's expf (<= 2 ulp, glibc's expf may differ in the last bit) and a double sum.
#include "cuda/gpu_ops.h"
#include "cuda/flash_attention.h"

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdlib>
#include <cmath>
#include <type_traits>
#include <string>
#include <utility>
#include <vector>

#include "cuda/blocks.cuh"
#include "cuda/sync.cuh"
#include "cuda/kernel_util.h"
#include "cuda/launch.cuh"
#include "runtime/error.h"

namespace fitmoe::gpu {
namespace {

// ================================ host-side helpers ===============================================

[[noreturn]] void fail(const std::string& what) { throw Error(what); }

void cuda_ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) fail(std::string("CUDA error in ") + what + ": " + cudaGetErrorString(e));
}
// After every launch: configuration errors (and earlier asynchronous faults) surface here.
void launched(const char* what) { cuda_ok(cudaGetLastError(), what); }

inline cudaStream_t cs(Stream s) { return static_cast<cudaStream_t>(s); }
inline unsigned blocks_for(int64_t n, int per) { return static_cast<unsigned>((n + per - 1) / per); }
inline size_t align256(size_t n) { return (n + 255) / 256 * 256; }
inline bool aligned(const void* p, size_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }

const char* tname(DType t) { return dtype_name(t); }

// Opt a kernel into more than 48 KiB of dynamic shared memory when it needs it (cuda/kernel_util.h).
template <class K>
void need_smem(K kernel, size_t bytes, const char* what) {
  need_dynamic_smem(reinterpret_cast<const void*>(kernel), bytes, what);
}

// Programmatic dependent launch (PDL; compute capability 9.0 and kernels built for it, else a plain
// launch): a decode step is a chain of ~12 dependent kernels per layer whose cost is latency, so each
// kernel is let start while the one before it finishes: its CTAs get resident, prefetch their weights
// into L2, and wait (griddepcontrol.wait) until the earlier kernel has finished and its writes are
// visible. The contract for every kernel launched through launch(): before pdl_enter() it reads only
// kernel arguments and memory that no kernel writes (weights, norm weights), and issues only L2
// prefetches otherwise (a prefetch cannot change what a later load sees). pdl_enter() is reached by at
// least one thread of the grid, so a kernel never finishes before the one it follows; that makes the
// ordering transitive along the stream. FITMOE_PDL=0 turns it off (for comparison).
std::atomic<bool> g_pdl_allowed{true};  // set_dependent_launch
std::atomic<bool> g_tc_attention{true};  // set_tensor_core_attention
bool pdl_supported() {
  static const bool ok = [] {
    const char* env = std::getenv("FITMOE_PDL");
    if (env && std::string(env) == "0") return false;
    int dev = 0, major = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) return false;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) return false;
    return major >= 9;
  }();
  return ok;
}
bool pdl_on() { return g_pdl_allowed.load(std::memory_order_relaxed) && pdl_supported(); }

// (Kernels go out through launch() of cuda/launch.cuh: with PDL where dependent_launch_active().)

// ================================ device-side helpers =============================================

// (pdl_enter, the acquire / release flags and counters, poll_pause and prefetch_l2 are in cuda/sync.cuh.)
// (The weight block decoders and the small load / conversion helpers are in cuda/blocks.cuh, shared with
// moe_gemm.cu.)

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
  return v;
}
__device__ __forceinline__ double warp_sum(double v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFull, v, o));
  return v;
}

// ================================ activation parts ================================================

struct APart {
  int a[8];
  float d, s;
  int bs0, bs1;
};

// Part p of block blk of an activation row (same 32 values as the weight part).
template <int Fam>
__device__ __forceinline__ void load_act(const uint8_t* row, int64_t blk, int p, APart& x) {
  if constexpr (Fam == kFamQ8_0) {
    const uint8_t* b = row + blk * 34;
    x.d = h2f(ld_u16(b));
#pragma unroll
    for (int i = 0; i < 8; ++i) x.a[i] = ld_i32<2>(b + 2 + 4 * i);
  } else if constexpr (Fam == kFamQ8_1) {
    const uint8_t* b = row + blk * 36;
    const uint32_t ds = ld_i32<4>(b);
    x.d = h2f(ds & 0xffffu);
    x.s = h2f(ds >> 16);
#pragma unroll
    for (int i = 0; i < 8; ++i) x.a[i] = ld_i32<4>(b + 4 + 4 * i);
  } else {
    const uint8_t* b = row + blk * 292;
    x.d = *reinterpret_cast<const float*>(b);
#pragma unroll
    for (int i = 0; i < 8; ++i) x.a[i] = ld_i32<4>(b + 4 + 32 * p + 4 * i);
    const uint32_t bs = ld_i32<4>(b + 260 + 4 * p);
    x.bs0 = static_cast<int16_t>(bs & 0xffffu);
    x.bs1 = static_cast<int16_t>(bs >> 16);
  }
}

// The mat-vec's part p of a weight block and of the activation block beside it: WT<T>::decode and
// load_act, except for Q6_K and Q4_K, whose mat-vec parts are their decode_mv layouts (Q6_K:
// positions l0..l0+7 of each of a half's four groups, the activation's same 32 values as four runs of
// 8 bytes; Q4_K: 16 positions of two sub-blocks, two runs of 16 bytes and their two block sums).
template <DType T>
__device__ __forceinline__ void mv_decode(const uint8_t* b, int p, WPart& w) {
  if constexpr (T == DType::Q6_K || T == DType::Q4_K) WT<T>::decode_mv(b, p, w);
  else WT<T>::decode(b, p, w);
}
template <DType T>
__device__ __forceinline__ void mv_load_act(const uint8_t* row, int64_t blk, int p, APart& x) {
  if constexpr (T == DType::Q6_K || T == DType::Q4_K) {  // Q8_K: d | qs[256] | bsums[16]
    const uint8_t* b = row + blk * 292;
    x.d = *reinterpret_cast<const float*>(b);
    if constexpr (T == DType::Q6_K) {
      const uint8_t* qs = b + 4 + 128 * (p >> 2) + 8 * (p & 3);
#pragma unroll
      for (int g = 0; g < 4; ++g) {
        x.a[2 * g] = ld_i32<4>(qs + 32 * g);
        x.a[2 * g + 1] = ld_i32<4>(qs + 32 * g + 4);
      }
    } else {
      const uint8_t* qs = b + 4 + 64 * (p >> 1) + 16 * (p & 1);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        x.a[i] = ld_i32<4>(qs + 4 * i);
        x.a[i + 4] = ld_i32<4>(qs + 32 + 4 * i);
      }
      const int16_t* bs = reinterpret_cast<const int16_t*>(b + 260) + 4 * (p >> 1) + (p & 1);
      x.bs0 = bs[0];
      x.bs1 = bs[2];
    }
  } else {
    load_act<WT<T>::kFam>(row, blk, p, x);
  }
}

// The reference's Q8_K scale of one 256-value block (a warp, 8 values per lane in v): -127 over the
// value of largest magnitude, the first one on ties (as its strict '>'); 0 for an all-zero block.
__device__ __forceinline__ float q8k_block_iscale(const float (&v)[8], int lane) {
  float amax = 0.0f, mx = 0.0f;
  int idx = INT_MAX;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const float ax = fabsf(v[j]);
    if (ax > amax) {
      amax = ax;
      mx = v[j];
      idx = 8 * lane + j;
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float oa = __shfl_xor_sync(kFull, amax, o);
    const float om = __shfl_xor_sync(kFull, mx, o);
    const int oi = __shfl_xor_sync(kFull, idx, o);
    if (oa > amax || (oa == amax && oi < idx)) {
      amax = oa;
      mx = om;
      idx = oi;
    }
  }
  return amax != 0.0f ? __fdiv_rn(-127.0f, mx) : 0.0f;
}

// Q8_K: one warp per 256-value block xb, 8 consecutive values per lane, into the 292-byte block blk.
__device__ __forceinline__ void quantize_q8k_block(const float* xb, uint8_t* blk, int lane) {
  xb += 8 * lane;
  float v[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) v[j] = xb[j];
  const float iscale = q8k_block_iscale(v, lane);
  uint32_t packed[2] = {0, 0};
  int s = 0;
  float d = 0.0f;
  if (iscale != 0.0f) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int q = min(__float2int_rn(__fmul_rn(iscale, v[j])), 127);
      s += q;
      packed[j / 4] |= (static_cast<uint32_t>(q) & 0xffu) << (8 * (j % 4));
    }
    d = __fdiv_rn(1.0f, iscale);
  }
  reinterpret_cast<uint32_t*>(blk + 4 + 8 * lane)[0] = packed[0];
  reinterpret_cast<uint32_t*>(blk + 4 + 8 * lane)[1] = packed[1];
  const int bs = s + __shfl_xor_sync(kFull, s, 1);
  if ((lane & 1) == 0) reinterpret_cast<int16_t*>(blk + 260)[lane / 2] = static_cast<int16_t>(bs);
  if (lane == 0) *reinterpret_cast<float*>(blk) = d;
}

// Adds one block's contribution (on the lane holding part 0 of the block) to acc. Lanes sharing a
// super-block first sum their integer partial sums exactly (all lanes of the warp must call this).
template <DType T>
__device__ __forceinline__ float block_dot(const WPart& w, const APart& x, int p, bool active, float acc) {
  using W = WT<T>;
  constexpr int P = W::kQK / 32;
  if constexpr (T == DType::Q6_K) {  // the decode_mv layout: unsigned codes, a scale per 8-value group
    int is = 0;
#pragma unroll
    for (int g = 0; g < 4; ++g) {
      const int s = __dp4a(w.q[2 * g + 1], x.a[2 * g + 1], __dp4a(w.q[2 * g], x.a[2 * g], 0));
      const int o = __dp4a(0x20202020, x.a[2 * g + 1], __dp4a(0x20202020, x.a[2 * g], 0));  // the codes' 32
      is += w.gs[g] * (s - o);
    }
#pragma unroll
    for (int o = P / 2; o > 0; o >>= 1) is += __shfl_xor_sync(kFull, is, o);
    if (active && p == 0) acc = __fmaf_rn(static_cast<float>(is), __fmul_rn(w.d, x.d), acc);
  } else if constexpr (W::kFam == kFamQ8_K) {
    int s0 = 0, s1 = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) s0 = __dp4a(w.q[i], x.a[i], s0);
#pragma unroll
    for (int i = 4; i < 8; ++i) s1 = __dp4a(w.q[i], x.a[i], s1);
    int is = w.sc0 * s0 + w.sc1 * s1;
    int ms = 0;
    if constexpr (W::kMin) ms = w.mn0 * x.bs0 + w.mn1 * x.bs1;
#pragma unroll
    for (int o = P / 2; o > 0; o >>= 1) {
      is += __shfl_xor_sync(kFull, is, o);
      if constexpr (W::kMin) ms += __shfl_xor_sync(kFull, ms, o);
    }
    if (active && p == 0) {
      acc = __fmaf_rn(static_cast<float>(is), __fmul_rn(w.d, x.d), acc);
      if constexpr (W::kMin) acc = __fmaf_rn(static_cast<float>(-ms), __fmul_rn(w.m, x.d), acc);
    }
  } else {
    static_assert(!W::kMin, "mins are a K-family feature");
    int s = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) s = __dp4a(w.q[i], x.a[i], s);
    if (active) {
      acc = __fmaf_rn(static_cast<float>(s), __fmul_rn(w.d, x.d), acc);
      if constexpr (W::kFam == kFamQ8_1) acc = __fmaf_rn(w.m, x.s, acc);
    }
  }
  return acc;
}

// ================================ routing (in registers) ==========================================

// The warp's largest (value, index) pair, the lower index on ties, in every lane. The routing's values
// are probabilities (>= +0, never -0 or NaN: expf() times a positive 1/sum, and the callers only take
// p > bv) or -1 with index INT_MAX for "none". From compute capability 8.0 two warp reductions do it
// (the bits of a non-negative float order like the float, +1 so that 0 means none; then the lowest
// index among the lanes holding the maximum), a butterfly of five shuffle rounds before.
__device__ __forceinline__ void warp_argmax(float& bv, int& bi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned key = bv >= 0.0f ? __float_as_uint(bv) + 1u : 0u;
  const unsigned m = __reduce_max_sync(kFull, key);
  bi = static_cast<int>(__reduce_min_sync(kFull, key == m ? static_cast<unsigned>(bi) : static_cast<unsigned>(INT_MAX)));
  bv = m ? __uint_as_float(m - 1u) : -1.0f;
#else
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(kFull, bv, o);
    const int oi = __shfl_xor_sync(kFull, bi, o);
    if (ov > bv || (ov == bv && oi < bi)) {
      bv = ov;
      bi = oi;
    }
  }
#endif
}

// The end of a token's routing: choice j sits in lane j % 32 (my_w, my_i); the chosen weights are
// summed in choice order (in double) and each lane writes its own choice, renormalised.
__device__ __forceinline__ void write_renormalised(float my_w, int my_i, int k, int32_t* ti, float* tw) {
  const int lane = threadIdx.x & 31;
  double ws = 0.0;
#pragma unroll 8
  for (int j = 0; j < k; ++j) ws += static_cast<double>(__shfl_sync(kFull, my_w, j));  // (the shuffles overlap)
  const float s = fmaxf(static_cast<float>(ws), 6.103515625e-5f);
  if (lane < k) {
    ti[lane] = my_i == INT_MAX ? -1 : my_i;  // (no choice, which NaN logits leave: -1, never an index)
    tw[lane] = __fdiv_rn(my_w, s);
  }
}

// Token t's routing by one warp, for up to 32 * VPL experts: lane l holds experts l, l + 32, ... in
// registers, so that the logits are loaded all at once and the softmax and the k rounds of the top-k
// touch no memory (route_topk_warp's shared-memory version, for more experts, is latency-bound: about 4 us).
// The same results as the shared-memory version: the same per-lane order of the double sum, strict '>'
// in ascending expert order per lane and the lower index on ties across lanes.
template <int VPL>
__device__ __forceinline__ void route_choose_regs(const float* l, int n_expert, int k, float& my_w, int& my_i) {
  const int lane = threadIdx.x & 31;
  float p[VPL];
#pragma unroll
  for (int i = 0; i < VPL; ++i) p[i] = lane + 32 * i < n_expert ? __ldcg(l + lane + 32 * i) : -INFINITY;
  float mx = -INFINITY;
#pragma unroll
  for (int i = 0; i < VPL; ++i)
    if (lane + 32 * i < n_expert) mx = fmaxf(mx, p[i]);
  mx = warp_max(mx);
  double sum = 0.0;
#pragma unroll
  for (int i = 0; i < VPL; ++i) {
    if (lane + 32 * i < n_expert) {
      p[i] = expf(__fsub_rn(p[i], mx));
      sum += static_cast<double>(p[i]);
    }
  }
  sum = warp_sum(sum);
  const float inv = static_cast<float>(__drcp_rn(sum));  // (= 1.0 / sum, correctly rounded)
#pragma unroll
  for (int i = 0; i < VPL; ++i) p[i] = lane + 32 * i < n_expert ? __fmul_rn(p[i], inv) : -3.0f;  // never chosen
  my_w = 0.0f;
  my_i = 0;
  for (int j = 0; j < k; ++j) {
    float bv = -1.0f;
    int bi = INT_MAX;
#pragma unroll
    for (int i = 0; i < VPL; ++i) {
      if (p[i] > bv) {
        bv = p[i];
        bi = lane + 32 * i;
      }
    }
    warp_argmax(bv, bi);
    if ((j & 31) == lane) my_w = bv, my_i = bi;
#pragma unroll
    for (int i = 0; i < VPL; ++i)
      if (lane + 32 * i == bi) p[i] = -2.0f;  // taken (NaN logits leave bi out of range: nothing taken)
  }
}
template <int VPL>
__device__ void route_topk_warp_regs(const float* logits, int n_expert, int k, int32_t* ids, float* weights, int t) {
  float my_w;
  int my_i;
  route_choose_regs<VPL>(logits + static_cast<int64_t>(t) * n_expert, n_expert, k, my_w, my_i);
  write_renormalised(my_w, my_i, k, ids + static_cast<int64_t>(t) * k, weights + static_cast<int64_t>(t) * k);
}
// One token's choices in the warp's registers, for up to 256 experts (the experts kernel that routes
// for itself; the callers check the count: 512 would cost that kernel registers).
__device__ __forceinline__ void route_choose(const float* l, int n_expert, int k, float& my_w, int& my_i) {
  if (n_expert <= 128) route_choose_regs<4>(l, n_expert, k, my_w, my_i);
  else route_choose_regs<8>(l, n_expert, k, my_w, my_i);
}

// ================================ mat-vec kernels =================================================

constexpr int kMaxMatvecs = 4;  // matvec_multi

struct MvArgs {
  const uint8_t* w;
  size_t row_bytes, mat_bytes;
  int64_t rows, cols, n_mats;
  const uint8_t* acts;
  size_t act_stride;
  int n_tokens;
  float* y;
  int64_t ld_y;
  const int32_t* ids;      // experts mode (blockIdx.y = slot) when not null
  const int32_t* slot_of;
  const int32_t* act_row;
  const uint8_t* w2;       // gated mode: the up matrices (same layout as w); y = silu(w x) * (w2 x)
  // Several matrices of one type and width on one input, in one launch (quantized kernel only):
  // segment i has its own weights, rows, output and ld_y, and the CTAs [seg_cta[i], seg_cta[i+1]).
  int n_seg;
  const uint8_t* seg_w[kMaxMatvecs];
  float* seg_y[kMaxMatvecs];
  int64_t seg_rows[kMaxMatvecs], seg_ld[kMaxMatvecs];
  size_t seg_row_bytes[kMaxMatvecs];
  bool seg_alt[kMaxMatvecs];  // segment of the kernel's second type
  unsigned seg_cta[kMaxMatvecs + 1];
  // Gated experts that route for themselves (mmvq_glu_routed_kernel: one token, ids null): each CTA
  // makes the routing's choices from the router's logits (route_n experts, route_k chosen) and takes
  // slot blockIdx.y's; CTA (0, 0) writes the choices and their weights to route_ids / route_wts.
  const float* route_logits;
  int route_n, route_k;
  int32_t* route_ids;
  float* route_wts;
};

constexpr int kMvWarps = 4;  // warps per CTA; each warp owns R rows

// Resolves the experts-mode slot; false when the slot's matrix is not on the device.
__device__ __forceinline__ bool mv_slot(const MvArgs& a, const uint8_t*& wm, const uint8_t*& acts, float*& y) {
  wm = a.w;
  acts = a.acts;
  y = a.y;
  if (a.ids) {
    const int j = blockIdx.y;
    const int e = a.ids[j];
    const int m = e < 0 ? -1 : a.slot_of ? a.slot_of[e] : e < a.n_mats ? e : -1;
    if (m < 0) return false;
    wm += static_cast<size_t>(m) * a.mat_bytes;
    acts += static_cast<size_t>(a.act_row[j]) * a.act_stride;
    y += static_cast<int64_t>(j) * a.ld_y;
  }
  return true;
}

// Quantized weights: one warp per R rows, lanes over the 32-value parts of the row; every weight part
// is decoded once and used for all NT (<= NT) tokens. GLU: the same rows of a second matrix (up) too,
// and the output is silu(gate) * up exactly as swiglu_kernel computes it.
template <DType T, int NT, int R, bool GLU>
__device__ __forceinline__ void mmvq_rows(const MvArgs& a, const uint8_t* wm, const uint8_t* wm2, size_t row_bytes,
                                          const uint8_t* acts, float* y, int64_t rows, int64_t ld_y, int64_t row0,
                                          int lane) {
  using W = WT<T>;
  constexpr int P = W::kQK / 32;
  const int nt = a.n_tokens;
  const int64_t nparts = a.cols / 32;
  float acc[R][NT], acc2[GLU ? R : 1][NT];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[r][t] = 0.0f;
#pragma unroll
  for (int r = 0; r < (GLU ? R : 1); ++r)
#pragma unroll
    for (int t = 0; t < NT; ++t) acc2[r][t] = 0.0f;

  // Two sweeps unrolled: a 2048-wide row is two sweeps, and their loads can then be in flight together.
  // (All four of a 4096-wide row measured no faster on the H200: 393.9 / 396.9 against 397.6 / 397.9.)
#pragma unroll 2
  for (int64_t base = 0; base < nparts; base += 32) {
    const int64_t part = base + lane;
    const bool active = part < nparts;
    const int64_t blk = part / P;
    const int p = static_cast<int>(part % P);
    WPart w[R], w2[GLU ? R : 1];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (active && row0 + r < rows) {
        mv_decode<T>(wm + (row0 + r) * row_bytes + blk * W::kBytes, p, w[r]);
        if constexpr (GLU) mv_decode<T>(wm2 + (row0 + r) * row_bytes + blk * W::kBytes, p, w2[r]);
      } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) w[r].q[i] = 0;
        w[r].d = w[r].m = 0.0f;
        w[r].sc0 = w[r].sc1 = w[r].mn0 = w[r].mn1 = 0;
#pragma unroll
        for (int g = 0; g < 4; ++g) w[r].gs[g] = 0;
        if constexpr (GLU) w2[r] = w[r];
      }
    }
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      if (t < nt) {
        APart x;
        if (active) {
          mv_load_act<T>(acts + t * a.act_stride, blk, p, x);
        } else {
#pragma unroll
          for (int i = 0; i < 8; ++i) x.a[i] = 0;
          x.d = x.s = 0.0f;
          x.bs0 = x.bs1 = 0;
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
          acc[r][t] = block_dot<T>(w[r], x, p, active, acc[r][t]);
          if constexpr (GLU) acc2[r][t] = block_dot<T>(w2[r], x, p, active, acc2[r][t]);
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      if (t < nt) {
        float v = warp_sum(acc[r][t]);
        if constexpr (GLU) {
          const float u = warp_sum(acc2[r][t]);
          v = __fmul_rn(__fdiv_rn(v, __fadd_rn(1.0f, expf(-v))), u);
        }
        if (lane == 0 && row0 + r < rows) y[t * ld_y + row0 + r] = v;
      }
    }
  }
}

// This CTA's segment of a matvec_multi launch (sg = -1 without segments), its CTA index within it, and
// the segment's rows and row size.
struct MvSegment {
  int sg;
  unsigned bx;
  int64_t rows;
  size_t row_bytes;
};
__device__ __forceinline__ MvSegment mv_segment(const MvArgs& a) {
  MvSegment m{-1, blockIdx.x, a.rows, a.row_bytes};
  if (a.n_seg) {
    m.sg = 0;
    while (m.sg + 1 < a.n_seg && m.bx >= a.seg_cta[m.sg + 1]) ++m.sg;
    m.bx -= a.seg_cta[m.sg];
    m.rows = a.seg_rows[m.sg];
    m.row_bytes = a.seg_row_bytes[m.sg];
  }
  return m;
}

// The kernel around mmvq_rows: resolves the segment (matvec_multi) or the expert slot. Segments flagged
// seg_alt hold type T2 (another type with the same activation format, e.g. Q6_K v beside Q4_K q and k).
template <DType T, int NT, int R, bool GLU = false, DType T2 = T>
__global__ void __launch_bounds__(kMvWarps * 32) mmvq_kernel(const MvArgs a) {
  const MvSegment seg = mv_segment(a);
  const int sg = seg.sg;
  const unsigned bx = seg.bx;
  const int64_t rows = seg.rows;
  const size_t row_bytes = seg.row_bytes;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t row0 = (static_cast<int64_t>(bx) * kMvWarps + warp) * R;
  if (!a.ids && row0 < rows)  // dense weights are known before the input is: fetch them meanwhile
    prefetch_l2((sg >= 0 ? a.seg_w[sg] : a.w) + row0 * row_bytes, (rows - row0 < R ? rows - row0 : R) * row_bytes, lane,
                32);
  pdl_enter();
  const uint8_t* wm;
  const uint8_t* acts;
  float* y;
  if (!mv_slot(a, wm, acts, y)) return;
  const uint8_t* wm2 = GLU ? a.w2 + (wm - a.w) : nullptr;
  int64_t ld_y = a.ld_y;
  if (sg >= 0) {
    wm = a.seg_w[sg];
    y = a.seg_y[sg];
    ld_y = a.seg_ld[sg];
  }
  if (row0 >= rows) return;
  if constexpr (T2 != T) {
    if (sg >= 0 && a.seg_alt[sg]) {
      mmvq_rows<T2, NT, R, GLU>(a, wm, wm2, row_bytes, acts, y, rows, ld_y, row0, lane);
      return;
    }
  }
  mmvq_rows<T, NT, R, GLU>(a, wm, wm2, row_bytes, acts, y, rows, ld_y, row0, lane);
}

// 16 bytes from global to shared memory, asynchronously from compute capability 8.0 (cp.async: no
// registers held until cp_async_wait), through registers before; a thread's copies are complete and
// visible to it after cp_async_wait, to its block after a barrier that follows.
__device__ __forceinline__ void cp_async_16(void* dst, const void* src) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(static_cast<unsigned>(__cvta_generic_to_shared(dst))),
               "l"(src)
               : "memory");
#else
  *static_cast<uint4*>(dst) = *static_cast<const uint4*>(src);
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}
__device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_all;" ::: "memory");
#endif
}
// Weight rows staged in shared memory: n16 16-byte words from src (global, final before the kernel's
// PDL wait) to dst (shared), the warp's lanes strided. Asynchronous from compute capability 8.0, so a
// kernel starts it before its wait and collects it after (stage_collect).
__device__ __forceinline__ void stage_rows(void* dst, const void* src, int n16, int lane) {
  for (int i = lane; i < n16; i += 32)
    cp_async_16(static_cast<uint8_t*>(dst) + 16 * i, static_cast<const uint8_t*>(src) + 16 * static_cast<size_t>(i));
  cp_async_commit();
}
// The warp's staged rows are in shared memory and visible to all its lanes.
__device__ __forceinline__ void stage_collect() {
  cp_async_wait();
  __syncwarp();
}

// Dense quantized weights, one token, R consecutive rows per warp (one; two for an output head),
// staged in shared memory before the PDL wait (stage_rows): after the wait only the activations are
// read from global memory (the rows come in whole 16-byte words whatever the block layout; they are
// decoded from shared memory as mmvq_kernel decodes them from global). Rows of a multiple of 16
// bytes at 16-byte aligned bases (the launcher checks); segments as mmvq_kernel.
template <DType T, DType T2 = T, int R = 1>
__global__ void __launch_bounds__(kMvWarps * 32) mmvq_staged_kernel(const MvArgs a, int stage_bytes) {
  extern __shared__ __align__(16) uint8_t wsm[];
  const MvSegment seg = mv_segment(a);
  const int sg = seg.sg;
  const int64_t rows = seg.rows;
  const size_t row_bytes = seg.row_bytes;
  const uint8_t* w = sg >= 0 ? a.seg_w[sg] : a.w;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t row = (static_cast<int64_t>(seg.bx) * kMvWarps + warp) * R;
  uint8_t* mine = wsm + static_cast<size_t>(warp) * stage_bytes * R;
  const int nr = static_cast<int>(rows - row < R ? rows - row : R);
  if (row < rows) stage_rows(mine, w + row * row_bytes, static_cast<int>(nr * row_bytes / 16), lane);
  pdl_enter();
  if (row >= rows) return;
  float* y = sg >= 0 ? a.seg_y[sg] : a.y;
  const int64_t ld_y = sg >= 0 ? a.seg_ld[sg] : a.ld_y;
  stage_collect();
  if constexpr (T2 != T) {
    if (sg >= 0 && a.seg_alt[sg]) {
      mmvq_rows<T2, 1, R, false>(a, mine, nullptr, row_bytes, a.acts, y + row, nr, ld_y, 0, lane);
      return;
    }
  }
  mmvq_rows<T, 1, R, false>(a, mine, nullptr, row_bytes, a.acts, y + row, nr, ld_y, 0, lane);
}

// Gated experts that route for themselves (see MvArgs::route_logits): one token, slot blockIdx.y, two
// rows per warp as mmvq_kernel's gated form. Warp 0 makes the choices (the other warps would take as
// long to make them too) and hands the slot's matrix over in shared memory. A kernel of its own, held
// to the gated form's 80 registers (six CTAs per SM: the 768 CTAs of a 768-row, 8-expert layer in one
// wave on the H200; 96 when left free). A choice out of range (NaN logits choose nothing) or on the
// host gets NaN rows, so that the failure shows instead of stale values.
template <DType T>
__global__ void __launch_bounds__(kMvWarps * 32, 6) mmvq_glu_routed_kernel(const MvArgs a) {
  pdl_enter();
  __shared__ int m_sh;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t row0 = (static_cast<int64_t>(blockIdx.x) * kMvWarps + warp) * 2;
  if (warp == 0) {
    const int j = blockIdx.y;
    float my_w;
    int my_i;
    route_choose(a.route_logits, a.route_n, a.route_k, my_w, my_i);
    if (blockIdx.x == 0 && j == 0) write_renormalised(my_w, my_i, a.route_k, a.route_ids, a.route_wts);
    const int e = __shfl_sync(kFull, my_i, j);
    if (lane == 0) m_sh = e >= 0 && e < a.route_n ? (a.slot_of ? a.slot_of[e] : e) : -1;
  }
  __syncthreads();
  const int m = m_sh;
  float* y = a.y + static_cast<int64_t>(blockIdx.y) * a.ld_y;
  if (m < 0) {
    if (lane < 2 && row0 + lane < a.rows) y[row0 + lane] = __int_as_float(0x7fc00000);
    return;
  }
  if (row0 >= a.rows) return;
  const uint8_t* wm = a.w + static_cast<size_t>(m) * a.mat_bytes;
  mmvq_rows<T, 1, 2, true>(a, wm, a.w2 + (wm - a.w), a.row_bytes, a.acts, y, a.rows, a.ld_y, row0, lane);
}

// Float weights (F32/F16/BF16 with activations of the same type): one warp per row, lanes over
// 16-byte vectors (VEC) or single elements.
template <typename E>
struct FloatElem;
template <>
struct FloatElem<float> {
  __device__ static __forceinline__ float at(const uint8_t* p, int64_t i) { return reinterpret_cast<const float*>(p)[i]; }
  __device__ static __forceinline__ void vec(const uint8_t* p, int64_t i, float* out) {
    const float4 v = reinterpret_cast<const float4*>(p)[i];
    out[0] = v.x, out[1] = v.y, out[2] = v.z, out[3] = v.w;
  }
  static constexpr int kVec = 4;
};
template <>
struct FloatElem<__half> {
  __device__ static __forceinline__ float at(const uint8_t* p, int64_t i) {
    return h2f(reinterpret_cast<const uint16_t*>(p)[i]);
  }
  __device__ static __forceinline__ void vec(const uint8_t* p, int64_t i, float* out) {
    const uint4 v = reinterpret_cast<const uint4*>(p)[i];
    const uint32_t u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      out[2 * k] = h2f(u[k] & 0xffffu);
      out[2 * k + 1] = h2f(u[k] >> 16);
    }
  }
  static constexpr int kVec = 8;
};
template <>
struct FloatElem<__nv_bfloat16> {
  __device__ static __forceinline__ float at(const uint8_t* p, int64_t i) {
    return bf2f(reinterpret_cast<const uint16_t*>(p)[i]);
  }
  __device__ static __forceinline__ void vec(const uint8_t* p, int64_t i, float* out) {
    const uint4 v = reinterpret_cast<const uint4*>(p)[i];
    const uint32_t u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      out[2 * k] = __uint_as_float(u[k] << 16);
      out[2 * k + 1] = __uint_as_float(u[k] & 0xffff0000u);
    }
  }
  static constexpr int kVec = 8;
};

// This thread's share of a float row's dot products with nt activation rows: elements first,
// first + stride, ... (16-byte vectors when VEC, then single elements), fma into acc[t].
template <typename E, int NT, bool VEC>
__device__ __forceinline__ void float_row_partial(const uint8_t* wr, const uint8_t* acts, size_t act_stride, int64_t n,
                                                  int nt, int first, int stride, float (&acc)[NT]) {
  using F = FloatElem<E>;
#pragma unroll
  for (int t = 0; t < NT; ++t) acc[t] = 0.0f;
  int64_t done = 0;
  if constexpr (VEC) {
    constexpr int V = F::kVec;
    const int64_t nv = n / V;
    // Unrolled so that several iterations' loads are in flight at once (the router's CTAs do four).
#pragma unroll 4
    for (int64_t i = first; i < nv; i += stride) {
      float wf[V];
      F::vec(wr, i, wf);
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        if (t < nt) {
          float af[V];
          F::vec(acts + t * act_stride, i, af);
#pragma unroll
          for (int k = 0; k < V; ++k) acc[t] = __fmaf_rn(wf[k], af[k], acc[t]);
        }
      }
    }
    done = nv * V;
  }
  for (int64_t i = done + first; i < n; i += stride) {
    const float wf = F::at(wr, i);
#pragma unroll
    for (int t = 0; t < NT; ++t)
      if (t < nt) acc[t] = __fmaf_rn(wf, F::at(acts + t * act_stride, i), acc[t]);
  }
}

template <typename E, int NT, bool VEC>
__global__ void __launch_bounds__(kMvWarps * 32) mv_float_kernel(const MvArgs a) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kMvWarps + warp;
  if (!a.ids && row < a.rows) prefetch_l2(a.w + row * a.row_bytes, a.row_bytes, lane, 32);
  pdl_enter();
  const uint8_t* wm;
  const uint8_t* acts;
  float* y;
  if (!mv_slot(a, wm, acts, y)) return;
  if (row >= a.rows) return;
  const int nt = a.n_tokens;
  const int64_t n = a.cols;
  const uint8_t* wr = wm + row * a.row_bytes;
  float acc[NT];
  float_row_partial<E, NT, VEC>(wr, acts, a.act_stride, n, nt, lane, 32, acc);
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    if (t < nt) {
      const float v = warp_sum(acc[t]);
      if (lane == 0) y[t * a.ld_y + row] = v;
    }
  }
}

// Float weights with few rows (e.g. a router: 128 rows): one CTA per row, its warps splitting the
// columns, so that the product spreads over enough of the GPU to reach its memory bandwidth.
template <typename E, int NT, bool VEC>
__device__ __forceinline__ void mv_float_split_body(const MvArgs& a) {
  __shared__ float part[kMvWarps][NT];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, tid = threadIdx.x;
  const int64_t row = blockIdx.x;
  if (!a.ids) prefetch_l2(a.w + row * a.row_bytes, a.row_bytes, tid, kMvWarps * 32);
  pdl_enter();
  const uint8_t* wm;
  const uint8_t* acts;
  float* y;
  if (!mv_slot(a, wm, acts, y)) return;
  const int nt = a.n_tokens;
  const int64_t n = a.cols;
  const uint8_t* wr = wm + row * a.row_bytes;
  float acc[NT];
  float_row_partial<E, NT, VEC>(wr, acts, a.act_stride, n, nt, tid, kMvWarps * 32, acc);
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const float v = warp_sum(acc[t]);
    if (lane == 0) part[warp][t] = v;
  }
  __syncthreads();
  if (tid < nt) {
    float v = part[0][tid];
#pragma unroll
    for (int w = 1; w < kMvWarps; ++w) v = __fadd_rn(v, part[w][tid]);
    y[tid * a.ld_y + row] = v;
  }
}
template <typename E, int NT, bool VEC>
__global__ void __launch_bounds__(kMvWarps * 32) mv_float_split_kernel(const MvArgs a) {
  mv_float_split_body<E, NT, VEC>(a);
}

// 1 / sqrt(mean of squares + eps) from the sum of squares, as the CPU reference rounds it.
__device__ __forceinline__ float rms_scale_of(double sum, int n, float eps) {
  const float ms = static_cast<float>(__dadd_rn(__ddiv_rn(sum, static_cast<double>(n)), static_cast<double>(eps)));
  return __fdiv_rn(1.0f, __fsqrt_rn(ms));
}

__device__ __forceinline__ float block_rms_scale(double s, int n, float eps, double* part) {
  const int tid = threadIdx.x;
  s = warp_sum(s);
  if ((tid & 31) == 0) part[tid >> 5] = s;
  __syncthreads();
  if (tid < 32) {
    double t = tid < static_cast<int>(blockDim.x >> 5) ? part[tid] : 0.0;
    t = warp_sum(t);
    if (tid == 0) part[0] = t;
  }
  __syncthreads();
  return rms_scale_of(part[0], n, eps);
}

// The FFN side of an all-GPU decode layer, in the router's launch: every CTA (one per router row, 128
// threads) forms xm = x + y (not stored: the FFN block's residual_norm adds y again as its y0), the
// norm xn = rms_norm(xm) * w in shared memory, and its row's logit, the F32 product of
// mv_float_split_body. The norm's sum is residual_norm's for 256 threads (each thread here holds two
// of them, tid and tid + 128; the warp sums then reduce in the same tree), so xn has the same bits, and
// CTA b < n / 256 writes Q8_K block b of it for the experts. One launch fewer than residual_norm +
// router per layer.
constexpr int kFoldMaxPerThread = 16;  // n <= 16 * 256
constexpr int kFoldRowVecs = kFoldMaxPerThread * 256 / 4 / (kMvWarps * 32);  // float4s of the row per thread
__global__ void __launch_bounds__(kMvWarps * 32) residual_norm_router_kernel(
    const float* x, const float* y, const float* __restrict__ w, int n, float eps, const uint8_t* __restrict__ router,
    size_t row_bytes, float* logits, uint8_t* xq) {
  __shared__ __align__(16) float xn_sh[kFoldMaxPerThread * 256];
  __shared__ double part[2 * kMvWarps];
  __shared__ float dot_part[kMvWarps];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, nb = n / 256;
  const int64_t row = blockIdx.x;
  const uint8_t* wr = router + row * row_bytes;
  // The row itself goes into registers before the wait (it is never written), in float_row_partial's
  // order: after the wait only the norm's loads are left. Measured on the H200, all-GPU decode: 426.2 /
  // 426.2 tok/s, against 420.4 / 422.5 with an L2 hint before the wait and the loads after the norm.
  float4 rw[kFoldRowVecs];
#pragma unroll
  for (int j = 0; j < kFoldRowVecs; ++j) {
    const int i = tid + kMvWarps * 32 * j;
    rw[j] = i < n / 4 ? reinterpret_cast<const float4*>(wr)[i] : make_float4(0.f, 0.f, 0.f, 0.f);
  }
  float wv[2][kFoldMaxPerThread];  // (norm weights: never written, fetched before the wait)
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int u = 0; u < kFoldMaxPerThread; ++u) wv[h][u] = u < nb ? w[tid + 128 * h + 256 * u] : 0.0f;
  pdl_enter();
  float v[2][kFoldMaxPerThread];
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int u = 0; u < kFoldMaxPerThread; ++u) {
      const int i = tid + 128 * h + 256 * u;
      v[h][u] = u < nb ? __fadd_rn(x[i], y[i]) : 0.0f;
    }
  double sq[2] = {0.0, 0.0};
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int u = 0; u < kFoldMaxPerThread; ++u)
      if (u < nb) sq[h] += static_cast<double>(__fmul_rn(v[h][u], v[h][u]));
  // residual_norm's warps 0-3 are this CTA's warps' first halves, its warps 4-7 their second halves.
  const double s0 = warp_sum(sq[0]), s1 = warp_sum(sq[1]);
  if (lane == 0) part[warp] = s0, part[warp + kMvWarps] = s1;
  __syncthreads();
  double tot = lane < 2 * kMvWarps ? part[lane] : 0.0;
  tot = warp_sum(tot);
  const float scale = rms_scale_of(tot, n, eps);
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int u = 0; u < kFoldMaxPerThread; ++u)
      if (u < nb) xn_sh[tid + 128 * h + 256 * u] = __fmul_rn(__fmul_rn(v[h][u], scale), wv[h][u]);
  __syncthreads();
  float acc = 0.0f;
#pragma unroll
  for (int j = 0; j < kFoldRowVecs; ++j) {
    const int i = tid + kMvWarps * 32 * j;
    if (i < n / 4) {
      const float4 a4 = reinterpret_cast<const float4*>(xn_sh)[i];
      acc = __fmaf_rn(rw[j].x, a4.x, acc);
      acc = __fmaf_rn(rw[j].y, a4.y, acc);
      acc = __fmaf_rn(rw[j].z, a4.z, acc);
      acc = __fmaf_rn(rw[j].w, a4.w, acc);
    }
  }
  const float d = warp_sum(acc);
  if (lane == 0) dot_part[warp] = d;
  if (row < nb && warp == kMvWarps - 1)
    quantize_q8k_block(xn_sh + 256 * row, xq + static_cast<size_t>(row) * 292, lane);
  __syncthreads();
  if (tid == 0) {
    float o = dot_part[0];
#pragma unroll
    for (int k = 1; k < kMvWarps; ++k) o = __fadd_rn(o, dot_part[k]);
    logits[row] = o;
  }
}

// Routed experts with their combination fused (decode, every chosen expert on the device): for token
// t = blockIdx.y and each row, the k slots' products v_j (each exactly as mmvq_kernel computes it,
// activation row = slot) are combined as moe_combine does, y[t][r] = sum_j wts[t*k+j] * v_j in j order.
// A CTA takes kCombineRows rows; warp j computes slot j's products for all of them (its loads in flight
// together, the k experts' loads side by side in the k warps), then one thread per row combines.
constexpr int kCombineRows = 4;
template <DType T, int MAXK>
__global__ void __launch_bounds__(MAXK * 32) mmvq_combine_kernel(const MvArgs a, const float* __restrict__ wts, int k) {
  __shared__ float v[MAXK][kCombineRows];
  __shared__ float wt_sh[MAXK];
  const int t = blockIdx.y, j = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kCombineRows;
  // In decode the choices come from two kernels back (the experts' gate+up; the activations' Q8_K
  // between), so they are final by the time this kernel starts. With the identity slot map (no
  // dependent lookup) each warp reads its choice (through L2) and hints its expert's rows into L2 while
  // the kernel before runs, and the choices and weights read here serve after the wait too. Measured on
  // the H200, all-GPU decode: the hint 404.4 / 404.3 tok/s against 398.5 / 399.6; the choices and
  // weights kept, with two more reads moved before the waits (the folded router's row, the q/k norm
  // weights), 425.0 / 430.0 against 420.4 / 422.5.
  int e_early = -1;
  if (!a.slot_of && threadIdx.x < k) wt_sh[threadIdx.x] = __ldcg(wts + t * k + threadIdx.x);
  if (!a.slot_of && j < k) {
    const int e = __ldcg(a.ids + t * k + j);
    e_early = e;
    if (e >= 0 && e < a.n_mats)
      prefetch_l2(a.w + static_cast<size_t>(e) * a.mat_bytes + row0 * a.row_bytes,
                  (a.rows - row0 < kCombineRows ? a.rows - row0 : kCombineRows) * a.row_bytes, lane, 32);
  }
  pdl_enter();
  if (j < k) {
    const int slot = t * k + j;
    const int e = a.slot_of ? a.ids[slot] : e_early;
    const int m = e < 0 ? -1 : a.slot_of ? a.slot_of[e] : e < a.n_mats ? e : -1;
    if (m < 0) {  // not on the device (or no choice: NaN logits): the caller broke the contract; make it loud
      if (lane < kCombineRows) v[j][lane] = __int_as_float(0x7fc00000);
    } else {
      const uint8_t* wm = a.w + static_cast<size_t>(m) * a.mat_bytes + row0 * a.row_bytes;
      const uint8_t* acts = a.acts + static_cast<size_t>(slot) * a.act_stride;
      mmvq_rows<T, 1, kCombineRows, false>(a, wm, nullptr, a.row_bytes, acts, v[j], a.rows - row0, 0, 0, lane);
    }
  }
  __syncthreads();
  const int r = threadIdx.x;
  if (r >= kCombineRows || row0 + r >= a.rows) return;
  const float* wt = a.slot_of ? wts + static_cast<int64_t>(t) * k : wt_sh;
  float o = __fmul_rn(v[0][r], wt[0]);
  for (int i = 1; i < k; ++i) o = __fadd_rn(o, __fmul_rn(v[i][r], wt[i]));
  a.y[t * a.ld_y + row0 + r] = o;
}

// The down + combine kernel with its rows staged (stage_rows): CTA of ROWS rows, warp j stages slot
// j's ROWS rows before the wait (the choices are final by then: see mmvq_combine_kernel), computes
// them four at a time after it, then one thread per row combines as mmvq_combine_kernel does. ROWS = 8
// halves the CTAs of kCombineRows, so that a 2048-row down fits in one wave at two CTAs per SM. Only
// without a slot map; ROWS rows of a multiple of 16 bytes at 16-byte aligned matrices.
template <DType T, int MAXK, int ROWS>
__global__ void __launch_bounds__(MAXK * 32, 2) mmvq_combine_staged_kernel(const MvArgs a, const float* __restrict__ wts,
                                                                           int k, int stage_bytes) {
  extern __shared__ __align__(16) uint8_t wsm[];
  __shared__ float v[MAXK][ROWS];
  __shared__ float wt_sh[MAXK];
  const int t = blockIdx.y, j = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * ROWS;
  uint8_t* mine = wsm + static_cast<size_t>(j) * stage_bytes;
  if (threadIdx.x < k) wt_sh[threadIdx.x] = __ldcg(wts + t * k + threadIdx.x);
  int e = -1;
  if (j < k) {
    e = __ldcg(a.ids + t * k + j);
    if (e >= 0 && e < a.n_mats)
      stage_rows(mine, a.w + static_cast<size_t>(e) * a.mat_bytes + row0 * a.row_bytes,
                 static_cast<int>(ROWS * a.row_bytes / 16), lane);
  }
  pdl_enter();
  if (j < k) {
    if (e < 0 || e >= a.n_mats) {  // no choice (NaN logits) or out of range: make it loud
      if (lane < ROWS) v[j][lane] = __int_as_float(0x7fc00000);
    } else {
      stage_collect();
      const uint8_t* acts = a.acts + static_cast<size_t>(t * k + j) * a.act_stride;
#pragma unroll 1
      for (int r0 = 0; r0 < ROWS; r0 += 4)
        mmvq_rows<T, 1, 4, false>(a, mine + r0 * a.row_bytes, nullptr, a.row_bytes, acts, v[j] + r0, 4, 0, 0, lane);
    }
  }
  __syncthreads();
  const int r = threadIdx.x;
  if (r >= ROWS) return;
  float o = __fmul_rn(v[0][r], wt_sh[0]);
  for (int i = 1; i < k; ++i) o = __fadd_rn(o, __fmul_rn(v[i][r], wt_sh[i]));
  a.y[t * a.ld_y + row0 + r] = o;
}

constexpr int64_t kManyRows = 65536;  // a one-token product's rows from which a warp takes two

// Shared memory a kernel may stage weight rows into: at most `cap` (the measured configuration), never
// more than the device gives one CTA (48 KiB on Pascal, 99 on Ada), less 1 KiB for the kernel's own
// arrays.
size_t staging_smem(size_t cap) { return std::min(cap, smem_per_block("staged weight rows") - 1024); }

// Dense rows that mmvq_staged_kernel can stage: one token, whole 16-byte words at aligned bases, a
// CTA's rows in at most 96 KiB of shared memory (less where the device allows less).
bool stageable(const MvArgs& a) {
  const size_t max_row = staging_smem(96 * 1024) / kMvWarps;
  if (a.ids || a.w2 || a.n_tokens != 1) return false;
  if (a.n_seg) {
    for (int i = 0; i < a.n_seg; ++i)
      if (a.seg_row_bytes[i] % 16 != 0 || a.seg_row_bytes[i] > max_row || !aligned(a.seg_w[i], 16)) return false;
    return true;
  }
  return a.row_bytes % 16 == 0 && a.row_bytes <= max_row && aligned(a.w, 16);
}

// The CTAs of a launch of rows_per_cta rows each: with segments (matvec_multi) each segment's first
// CTA goes into seg_cta.
unsigned place_segments(MvArgs& a, int rows_per_cta) {
  if (!a.n_seg) return blocks_for(a.rows, rows_per_cta);
  a.seg_cta[0] = 0;
  for (int i = 0; i < a.n_seg; ++i) a.seg_cta[i + 1] = a.seg_cta[i] + blocks_for(a.seg_rows[i], rows_per_cta);
  return a.seg_cta[a.n_seg];
}

template <DType T, int NT, DType T2 = T>
void launch_mvq_nt(const MvArgs& a0, unsigned n_slots, cudaStream_t s) {
  constexpr int R = NT == 1 ? 1 : 2;
  MvArgs a = a0;
  const unsigned ctas = place_segments(a, kMvWarps * R);
  launch(mmvq_kernel<T, NT, R, false, T2>, dim3(ctas, n_slots), kMvWarps * 32, 0, s, a);
}
template <DType T, DType T2 = T>
void launch_mvq(const MvArgs& a, unsigned n_slots, cudaStream_t s) {
  if (a.w2) {  // gated experts: one token per slot
    // Two rows per warp: their loads in flight together (measured on the H200: +1.6% decode over one).
    const dim3 grid(blocks_for(a.rows, kMvWarps * 2), n_slots);
    launch(mmvq_kernel<T, 1, 2, true>, grid, kMvWarps * 32, 0, s, a);
    return;
  }
  // One token: each warp's row staged in shared memory before the wait. Measured on the H200, all-GPU
  // decode tg128: 428.1 / 429.9 tok/s against 426.3 / 421.5 (the q,k,v and attention output products
  // gain; the output head, many waves long, neither gains nor loses: 426.7 / 425.9 with it alone).
  // Very many rows (an output head, many waves long): two rows per warp, the activation's loads shared
  // by both. Measured on the H200, all-GPU decode tg128: 459.0 / 457.9 / 456.7 tok/s against 456.3 /
  // 453.0 / 455.4 with one. Two rows for every staged product (q,k,v, the attention output) as well:
  // 458.7 / 460.0 / 460.4 against 458.6 / 456.5 / 459.1, within the noise, so those keep one.
  if (stageable(a)) {
    MvArgs b = a;
    size_t widest = b.n_seg ? 0 : b.row_bytes;
    for (int i = 0; i < b.n_seg; ++i) widest = std::max(widest, b.seg_row_bytes[i]);
    const bool many = !b.n_seg && b.rows > kManyRows && kMvWarps * 2 * widest <= staging_smem(96 * 1024);
    const int rows_per_warp = many ? 2 : 1;
    const unsigned ctas = place_segments(b, kMvWarps * rows_per_warp);
    const size_t smem = kMvWarps * rows_per_warp * widest;
    auto go = [&](auto kernel) {
      need_smem(kernel, smem, "matvec (staged rows)");
      launch(kernel, dim3(ctas, n_slots), kMvWarps * 32, smem, s, b, static_cast<int>(widest));
    };
    if (rows_per_warp == 2) go(mmvq_staged_kernel<T, T2, 2>);
    else go(mmvq_staged_kernel<T, T2, 1>);
    return;
  }
  if (a.n_tokens <= 1) launch_mvq_nt<T, 1, T2>(a, n_slots, s);
  else if (a.n_tokens <= 2) launch_mvq_nt<T, 2, T2>(a, n_slots, s);
  else if (a.n_tokens <= 4) launch_mvq_nt<T, 4, T2>(a, n_slots, s);
  else launch_mvq_nt<T, 8, T2>(a, n_slots, s);
}
template <typename E, bool VEC>
void launch_mvf_v(const MvArgs& a, unsigned n_slots, cudaStream_t s) {
  if (a.rows <= 512) {  // few rows: split the columns (one CTA per row)
    const dim3 grid(static_cast<unsigned>(a.rows), n_slots);
    if (a.n_tokens <= 1) launch(mv_float_split_kernel<E, 1, VEC>, grid, kMvWarps * 32, 0, s, a);
    else if (a.n_tokens <= 2) launch(mv_float_split_kernel<E, 2, VEC>, grid, kMvWarps * 32, 0, s, a);
    else if (a.n_tokens <= 4) launch(mv_float_split_kernel<E, 4, VEC>, grid, kMvWarps * 32, 0, s, a);
    else launch(mv_float_split_kernel<E, 8, VEC>, grid, kMvWarps * 32, 0, s, a);
    return;
  }
  const dim3 grid(blocks_for(a.rows, kMvWarps), n_slots);
  if (a.n_tokens <= 1) launch(mv_float_kernel<E, 1, VEC>, grid, kMvWarps * 32, 0, s, a);
  else if (a.n_tokens <= 2) launch(mv_float_kernel<E, 2, VEC>, grid, kMvWarps * 32, 0, s, a);
  else if (a.n_tokens <= 4) launch(mv_float_kernel<E, 4, VEC>, grid, kMvWarps * 32, 0, s, a);
  else launch(mv_float_kernel<E, 8, VEC>, grid, kMvWarps * 32, 0, s, a);
}
template <typename E>
void launch_mvf(const MvArgs& a, unsigned n_slots, bool vec, cudaStream_t s) {
  if (vec) launch_mvf_v<E, true>(a, n_slots, s);
  else launch_mvf_v<E, false>(a, n_slots, s);
}

// Natural alignment of the type's blocks (the decoders' widest loads).
int weight_align(DType t) {
  switch (t) {
    case DType::Q4_K: case DType::Q5_K:
      return 16;
    case DType::Q4_1: case DType::Q5_1: case DType::Q2_K: case DType::IQ4_XS:
      return 4;
    case DType::F32: return 4;
    default: return 2;
  }
}

void check_weight(const DevMatrix& w, const char* what) {
  const DTypeInfo* info = dtype_info(static_cast<uint32_t>(w.type));
  switch (w.type) {
    case DType::F32: case DType::F16: case DType::BF16: case DType::Q4_0: case DType::Q4_1: case DType::Q5_0:
    case DType::Q5_1: case DType::Q8_0: case DType::Q2_K: case DType::Q3_K: case DType::Q4_K: case DType::Q5_K:
    case DType::Q6_K: case DType::IQ4_NL: case DType::IQ4_XS:
      break;
    default:
      fail(std::string(what) + ": unsupported weight type " + (info ? info->name : "?"));
  }
  if (w.cols <= 0 || w.rows <= 0) fail(std::string(what) + ": empty matrix");
  if (w.cols % info->block_size != 0)
    fail(std::string(what) + ": row length " + std::to_string(w.cols) + " is not a multiple of the " + info->name +
         " block size");
  if (w.row_bytes != row_bytes(w.type, w.cols)) fail(std::string(what) + ": row_bytes does not match the type");
  const size_t al = static_cast<size_t>(weight_align(w.type));
  if (!aligned(w.data, al) || w.row_bytes % al != 0 || (w.n_mats > 1 && w.mat_bytes % al != 0))
    fail(std::string(what) + ": " + info->name + " weights must be " + std::to_string(al) + "-byte aligned");
}

// The arguments every mat-vec kernel takes, from the weight and its converted activations (checked).
MvArgs mv_args(const DevMatrix& w, const void* acts, int n_tokens, float* y, int64_t ld_y, const char* what) {
  check_weight(w, what);
  const DType act = dtype_info(w.type).act_type;
  const size_t act_al = (act == DType::Q8_1 || act == DType::Q8_K || act == DType::F32) ? 4 : 2;
  if (!aligned(acts, act_al)) fail(std::string(what) + ": activations must be " + std::to_string(act_al) + "-byte aligned");
  MvArgs a{};
  a.w = w.data;
  a.row_bytes = w.row_bytes;
  a.mat_bytes = w.mat_bytes;
  a.n_mats = w.n_mats;
  a.rows = w.rows;
  a.cols = w.cols;
  a.acts = static_cast<const uint8_t*>(acts);
  a.act_stride = row_bytes(act, w.cols);
  a.n_tokens = n_tokens;
  a.y = y;
  a.ld_y = ld_y;
  return a;
}

// Calls f(std::integral_constant<DType, T>) for the quantized weight type t.
template <class F>
void with_quant_type(DType t, const char* what, F&& f) {
  switch (t) {
    case DType::Q4_0: f(std::integral_constant<DType, DType::Q4_0>{}); break;
    case DType::Q4_1: f(std::integral_constant<DType, DType::Q4_1>{}); break;
    case DType::Q5_0: f(std::integral_constant<DType, DType::Q5_0>{}); break;
    case DType::Q5_1: f(std::integral_constant<DType, DType::Q5_1>{}); break;
    case DType::Q8_0: f(std::integral_constant<DType, DType::Q8_0>{}); break;
    case DType::Q2_K: f(std::integral_constant<DType, DType::Q2_K>{}); break;
    case DType::Q3_K: f(std::integral_constant<DType, DType::Q3_K>{}); break;
    case DType::Q4_K: f(std::integral_constant<DType, DType::Q4_K>{}); break;
    case DType::Q5_K: f(std::integral_constant<DType, DType::Q5_K>{}); break;
    case DType::Q6_K: f(std::integral_constant<DType, DType::Q6_K>{}); break;
    case DType::IQ4_NL: f(std::integral_constant<DType, DType::IQ4_NL>{}); break;
    case DType::IQ4_XS: f(std::integral_constant<DType, DType::IQ4_XS>{}); break;
    default: fail(std::string(what) + ": unsupported weight type " + tname(t));
  }
}

// Gate and up matrices one gated mat-vec can take together: quantized, of one type and shape.
bool gate_up_pair(const DevMatrix& gate, const DevMatrix& up) {
  return up.type == gate.type && up.rows == gate.rows && up.cols == gate.cols && up.mat_bytes == gate.mat_bytes &&
         up.n_mats == gate.n_mats && !is_float_type(gate.type);
}

void launch_matvec(const DevMatrix& w, const void* acts, int n_tokens, float* y, int64_t ld_y, const int32_t* ids,
                   const int32_t* slot_of, int n_slots, const int32_t* act_row, cudaStream_t s, const char* what,
                   const DevMatrix* up = nullptr) {
  MvArgs a = mv_args(w, acts, n_tokens, y, ld_y, what);
  a.ids = ids;
  a.slot_of = slot_of;
  a.act_row = act_row;
  if (up) {
    check_weight(*up, what);
    if (!gate_up_pair(w, *up) || !ids || n_tokens != 1)
      fail(std::string(what) + ": gate and up must be quantized matrices of one type and shape, in experts mode");
    a.w2 = up->data;
  }
  const unsigned slots = static_cast<unsigned>(n_slots);
  const bool vec = aligned(w.data, 16) && w.row_bytes % 16 == 0 && (ids == nullptr || w.mat_bytes % 16 == 0) &&
                   aligned(acts, 16) && a.act_stride % 16 == 0;
  switch (w.type) {
    case DType::F32: launch_mvf<float>(a, slots, vec, s); break;
    case DType::F16: launch_mvf<__half>(a, slots, vec, s); break;
    case DType::BF16: launch_mvf<__nv_bfloat16>(a, slots, vec, s); break;
    default: with_quant_type(w.type, what, [&](auto T) { launch_mvq<decltype(T)::value>(a, slots, s); });
  }
  launched(what);
}

// ================================ activation quantizers ===========================================

// Q8_0 / Q8_1: one thread per 32-value block, the reference's operations in the reference's order
// (activations are small; simplicity wins over speed here). The block is assembled in registers and
// stored as 16-bit words (blocks are 34 / 36 bytes, so 2-byte aligned): single-byte stores into these
// blocks came out wrong on sm_90 with nvcc 13 (bytes 0 and 2 of some blocks lost; the GPU tests caught it).
template <bool Q81>
__global__ void quant_q8_kernel(const float* __restrict__ x, int64_t n, int rows, int64_t ld_x, uint8_t* __restrict__ dst,
                                size_t stride) {
  pdl_enter();
  const int64_t nb = n / 32;
  const int64_t gb = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (gb >= nb * rows) return;
  const int64_t r = gb / nb, b = gb % nb;
  const float* xb = x + r * ld_x + b * 32;
  float amax = 0.0f;
  for (int j = 0; j < 32; ++j) amax = fmaxf(amax, fabsf(xb[j]));
  const float d = __fdiv_rn(amax, 127.0f);
  const float id = amax != 0.0f ? __fdiv_rn(127.0f, amax) : 0.0f;
  constexpr int kHead = Q81 ? 2 : 1;  // 16-bit words before the quants: d (and s)
  uint16_t w[kHead + 16];
  int sum = 0;
  for (int j = 0; j < 32; j += 2) {
    const int q0 = __float2int_rn(__fmul_rn(xb[j], id));
    const int q1 = __float2int_rn(__fmul_rn(xb[j + 1], id));
    sum += q0 + q1;
    w[kHead + j / 2] = static_cast<uint16_t>((q0 & 0xff) | ((q1 & 0xff) << 8));
  }
  w[0] = f2h_bits(d);
  if constexpr (Q81) w[1] = f2h_bits(__fmul_rn(d, static_cast<float>(sum)));
  uint16_t* out = reinterpret_cast<uint16_t*>(dst + r * stride + b * (Q81 ? 36 : 34));
#pragma unroll
  for (int i = 0; i < kHead + 16; ++i) out[i] = w[i];
}

__global__ void quant_q8k_kernel(const float* __restrict__ x, int64_t n, int rows, int64_t ld_x, uint8_t* __restrict__ dst,
                                 size_t stride) {
  pdl_enter();
  const int64_t nb = n / 256;
  const int64_t gb = static_cast<int64_t>(blockIdx.x) * 8 + (threadIdx.x >> 5);
  if (gb >= nb * rows) return;
  const int64_t r = gb / nb, b = gb % nb;
  quantize_q8k_block(x + r * ld_x + b * 256, dst + r * stride + b * 292, threadIdx.x & 31);
}

// F32 -> F16 / BF16 / F32 rows (mode 0: f16, 1: bf16, 2: f32 copy).
template <int Mode>
__global__ void convert_rows_kernel(const float* __restrict__ x, int64_t n, int rows, int64_t ld_x, void* __restrict__ dst,
                                    int64_t ld_dst) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int r = blockIdx.y;
  if (i >= n || r >= rows) return;
  const float v = x[r * ld_x + i];
  if constexpr (Mode == 0) {
    static_cast<uint16_t*>(dst)[r * ld_dst + i] = f2h_bits(v);
  } else if constexpr (Mode == 1) {
    static_cast<uint16_t*>(dst)[r * ld_dst + i] = f2bf_bits(v);
  } else {
    static_cast<float*>(dst)[r * ld_dst + i] = v;
  }
}

// The reference rounds the activations of a quantized weight's products to 8 bits per block (Q8_K:
// blocks of 256, Q8_0 / Q8_1: blocks of 32) before its integer dot products. Prefill's tensor-core
// products take the same rounded values, q * d (then rounded to Out), so that they differ from the
// reference by the f16 rounding of q * d only, not by the whole 8-bit rounding (which moved a Gemma
// model's logits by 3%). The scales and codes are quant_q8k_kernel's / quant_q8_kernel's.
__device__ __forceinline__ void store_as(float* p, float v) { *p = v; }
__device__ __forceinline__ void store_as(__half* p, float v) { *p = __float2half_rn(v); }

template <typename Out>
__global__ void round_q8k_rows_kernel(const float* __restrict__ x, int64_t n, int rows, int64_t ld_x, Out* __restrict__ y,
                                      int64_t ld_y) {
  const int64_t nb = n / 256;
  const int64_t gb = static_cast<int64_t>(blockIdx.x) * 8 + (threadIdx.x >> 5);  // one warp per block
  if (gb >= nb * rows) return;
  const int lane = threadIdx.x & 31;
  const int64_t r = gb / nb, b = gb % nb;
  const float* xb = x + r * ld_x + b * 256 + 8 * lane;
  float v[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) v[j] = xb[j];
  const float iscale = q8k_block_iscale(v, lane);
  const float d = iscale != 0.0f ? __fdiv_rn(1.0f, iscale) : 0.0f;
  Out* yb = y + r * ld_y + b * 256 + 8 * lane;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int q = iscale != 0.0f ? min(__float2int_rn(__fmul_rn(iscale, v[j])), 127) : 0;
    store_as(yb + j, __fmul_rn(d, static_cast<float>(q)));
  }
}

template <typename Out>
__global__ void round_q8_rows_kernel(const float* __restrict__ x, int64_t n, int rows, int64_t ld_x, Out* __restrict__ y,
                                     int64_t ld_y) {
  const int64_t nb = n / 32;
  const int64_t gb = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;  // one thread per block
  if (gb >= nb * rows) return;
  const int64_t r = gb / nb, b = gb % nb;
  const float* xb = x + r * ld_x + b * 32;
  float amax = 0.0f;
  for (int j = 0; j < 32; ++j) amax = fmaxf(amax, fabsf(xb[j]));
  const float d = __half2float(__float2half_rn(__fdiv_rn(amax, 127.0f)));  // stored as f16
  const float id = amax != 0.0f ? __fdiv_rn(127.0f, amax) : 0.0f;
  Out* yb = y + r * ld_y + b * 32;
  for (int j = 0; j < 32; ++j) store_as(yb + j, __fmul_rn(d, static_cast<float>(__float2int_rn(__fmul_rn(xb[j], id)))));
}

template <typename Out>
void launch_round_acts(DType act, const float* x, int64_t n, int rows, int64_t ld_x, Out* y, int64_t ld_y,
                       cudaStream_t s) {
  if (act == DType::Q8_K) {
    if (n % 256 != 0) fail("round_acts: Q8_K rows of whole 256-value blocks only, not " + std::to_string(n));
    round_q8k_rows_kernel<Out><<<blocks_for(n / 256 * rows, 8), 256, 0, s>>>(x, n, rows, ld_x, y, ld_y);
  } else {
    if (n % 32 != 0) fail("round_acts: rows of whole 32-value blocks only, not " + std::to_string(n));
    round_q8_rows_kernel<Out><<<blocks_for(n / 32 * rows, 128), 128, 0, s>>>(x, n, rows, ld_x, y, ld_y);
  }
}

template <int Mode>
void launch_convert(const float* x, int64_t n, int rows, int64_t ld_x, void* dst, int64_t ld_dst, cudaStream_t s) {
  // rows go in grid.y (<= 65535 per launch)
  for (int r0 = 0; r0 < rows; r0 += 65535) {
    const int nr = std::min(65535, rows - r0);
    void* d = Mode == 2 ? static_cast<void*>(static_cast<float*>(dst) + r0 * ld_dst)
                        : static_cast<void*>(static_cast<uint16_t*>(dst) + r0 * ld_dst);
    convert_rows_kernel<Mode><<<dim3(blocks_for(n, 256), nr), 256, 0, s>>>(x + r0 * ld_x, n, nr, ld_x, d, ld_dst);
  }
}

// ================================ dequantization (embeddings, prefill) ============================

// Rows [0, n_rows) of the output from table rows ids[r] (or r): one thread per 32-value part.
template <DType T, typename Out>
__global__ void dequant_kernel(const uint8_t* __restrict__ base, size_t row_bytes, int64_t n_rows, int64_t cols,
                               const int32_t* __restrict__ ids, int64_t table_rows, Out* __restrict__ out, int64_t ld_out) {
  using W = WT<T>;
  constexpr int P = W::kQK / 32;
  const int64_t nparts = cols / 32;
  const int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (g >= n_rows * nparts) return;
  const int64_t r = g / nparts, part = g % nparts;
  int64_t src = r;
  if (ids) {
    src = ids[r];
    if (src < 0 || src >= table_rows) return;
  }
  WPart w;
  W::decode(base + src * row_bytes + (part / P) * W::kBytes, static_cast<int>(part % P), w);
  float v[32];
  deq_part<T>(w, v);
  Out* o = out + r * ld_out + part * 32;
  if constexpr (sizeof(Out) == 2) {
    // f16 scratch of our own (16-byte aligned rows): four 16-byte stores
    uint32_t h[16];
#pragma unroll
    for (int k = 0; k < 16; ++k) h[k] = f2h_bits(v[2 * k]) | (static_cast<uint32_t>(f2h_bits(v[2 * k + 1])) << 16);
    uint4* o4 = reinterpret_cast<uint4*>(o);
#pragma unroll
    for (int k = 0; k < 4; ++k) o4[k] = make_uint4(h[4 * k], h[4 * k + 1], h[4 * k + 2], h[4 * k + 3]);
  } else {
#pragma unroll
    for (int k = 0; k < 32; ++k) o[k] = v[k];
  }
}

template <typename E>
__global__ void embed_float_kernel(const uint8_t* __restrict__ base, size_t row_bytes, int64_t cols,
                                   const int32_t* __restrict__ ids, int64_t table_rows, float* __restrict__ out) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int r = blockIdx.y;
  if (i >= cols) return;
  const int64_t src = ids[r];
  if (src < 0 || src >= table_rows) return;
  out[r * cols + i] = FloatElem<E>::at(base + src * row_bytes, i);
}

template <DType T, typename Out>
void launch_dequant_t(const uint8_t* base, size_t rb, int64_t n_rows, int64_t cols, const int32_t* ids, int64_t table_rows,
                      Out* out, int64_t ld_out, cudaStream_t s) {
  const int64_t threads = n_rows * (cols / 32);
  dequant_kernel<T, Out><<<blocks_for(threads, 256), 256, 0, s>>>(base, rb, n_rows, cols, ids, table_rows, out, ld_out);
}
template <typename Out>
void launch_dequant(DType t, const uint8_t* base, size_t rb, int64_t n_rows, int64_t cols, const int32_t* ids,
                    int64_t table_rows, Out* out, int64_t ld_out, cudaStream_t s) {
  switch (t) {
#define FITMOE_DQ(X) \
  case DType::X: launch_dequant_t<DType::X, Out>(base, rb, n_rows, cols, ids, table_rows, out, ld_out, s); break;
    FITMOE_DQ(Q4_0) FITMOE_DQ(Q4_1) FITMOE_DQ(Q5_0) FITMOE_DQ(Q5_1) FITMOE_DQ(Q8_0) FITMOE_DQ(Q2_K) FITMOE_DQ(Q3_K)
    FITMOE_DQ(Q4_K) FITMOE_DQ(Q5_K) FITMOE_DQ(Q6_K) FITMOE_DQ(IQ4_NL) FITMOE_DQ(IQ4_XS)
#undef FITMOE_DQ
    default: fail(std::string("dequantize: unsupported type ") + tname(t));
  }
}


// ================================ cuBLAS ==========================================================

// One handle per host thread, created on first use and deliberately never destroyed (destroying it at
// thread or process exit can race the CUDA runtime's own teardown).
cublasHandle_t blas_handle() {
  thread_local cublasHandle_t h = nullptr;
  if (!h) {
    if (cublasCreate(&h) != CUBLAS_STATUS_SUCCESS) fail("cublasCreate failed");
    cublasSetMathMode(h, CUBLAS_DEFAULT_MATH);
  }
  return h;
}
void blas_ok(cublasStatus_t st, const char* what) {
  if (st != CUBLAS_STATUS_SUCCESS) fail(std::string("cuBLAS error in ") + what + ": " + cublasGetStatusString(st));
}

// Rows of the dequantized f16 weight tile: whole matrices up to 64 MiB, larger ones in row tiles.
constexpr size_t kDequantTileBytes = size_t(64) << 20;
int64_t tile_rows(const DevMatrix& w) {
  const int64_t per_row = w.cols * 2;
  return std::max<int64_t>(1, std::min<int64_t>(w.rows, static_cast<int64_t>(kDequantTileBytes) / per_row));
}

// ================================ norms, elementwise ==============================================

// RMSNorm's scale 1 / sqrt(mean(x^2) + eps) from each thread's partial sum of squares (thread tid
// summed elements tid, tid + blockDim.x, ...). Every kernel that norms a row goes through this, so
// fused and unfused norms give the same bits. Ends with a barrier; `part` is 32 doubles of shared memory.
constexpr int kNormThreads = 256;  // every row norm runs with this many threads (same partial sums)

// Row norms read their elements U strides at a time, so that the loads are in flight together rather
// than one latency per element; each thread still sums its elements tid, tid + blockDim.x, ... in order.
constexpr int kNormUnroll = 4;

__global__ void rms_norm_kernel(const float* x, const float* __restrict__ w, float* y, int n, float eps, int64_t ld_x,
                                int64_t ld_y) {
  pdl_enter();
  __shared__ double part[32];
  const int r = blockIdx.x, tid = threadIdx.x, nth = blockDim.x;
  const float* xr = x + r * ld_x;
  float* yr = y + r * ld_y;
  double s = 0;
  for (int i0 = tid; i0 < n; i0 += kNormUnroll * nth) {
    float v[kNormUnroll];
#pragma unroll
    for (int u = 0; u < kNormUnroll; ++u) v[u] = i0 + u * nth < n ? xr[i0 + u * nth] : 0.0f;
#pragma unroll
    for (int u = 0; u < kNormUnroll; ++u)
      if (i0 + u * nth < n) s += static_cast<double>(__fmul_rn(v[u], v[u]));
  }
  const float scale = block_rms_scale(s, n, eps, part);
  for (int i = tid; i < n; i += nth) {
    const float v = __fmul_rn(xr[i], scale);
    yr[i] = w ? __fmul_rn(v, w[i]) : v;
  }
}

// The end of a block, fused: x += y (or x += the routed experts' combination of ey with wts, as
// moe_combine_kernel; or neither: x as it is), then xn = rms_norm(x) * w when xn is given, and xn in
// Q8_K when xq is given (the next mat-vec's input, as quant_q8k_kernel makes it). One CTA of
// kNormThreads per row. With y0 (and y, no ey): x = (x + y0) + y, an add a kernel before deferred here
// (residual_norm_router leaves x as it is).
template <int MAXK>
__global__ void residual_norm_kernel(float* x, const float* __restrict__ y0, const float* __restrict__ y,
                                     const float* __restrict__ ey, const float* __restrict__ wts, int k,
                                     const float* __restrict__ w, float* __restrict__ xn, uint8_t* __restrict__ xq,
                                     int n, float eps) {
  __shared__ double part[32];
  __shared__ const float* src[MAXK > 0 ? MAXK : 1];  // the experts' output rows of this token
  __shared__ float wt[MAXK > 0 ? MAXK : 1];
  const int r = blockIdx.x, tid = threadIdx.x, nth = blockDim.x;
  float* xr = x + static_cast<int64_t>(r) * n;
  // Rows of up to kKeep * blockDim.x values stay in registers between the sum and the scaling, and
  // the norm weights are fetched at the start, so that the loads overlap the reduction's latency.
  constexpr int kKeep = 16;
  const bool keep = n <= kKeep * nth;
  float wv[kKeep], xs[kKeep];
  if (keep && w && xn) {
#pragma unroll
    for (int u = 0; u < kKeep; ++u) wv[u] = tid + u * nth < n ? w[tid + u * nth] : 0.0f;
  }
  pdl_enter();  // (the norm weights above are never written)
  if constexpr (MAXK > 0) {
    if (tid < k) {  // the row of each slot (slot j's row is row j of ey)
      const int64_t j = static_cast<int64_t>(r) * k + tid;
      src[tid] = ey + j * n;
      wt[tid] = wts[j];
    }
    __syncthreads();
  }
  constexpr int U = MAXK > 8 ? 1 : kNormUnroll;
  double s = 0;
  for (int i0 = tid, c = 0; i0 < n; i0 += U * nth, c += U) {
    float o[U], o0[U], xv[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int i = i0 + u * nth;
      const bool in = i < n;
      xv[u] = in ? xr[i] : 0.0f;
      if constexpr (MAXK > 0) {
        float v[MAXK];
#pragma unroll
        for (int j = 0; j < MAXK; ++j) v[j] = in && j < k ? src[j][i] : 0.0f;
        o[u] = __fmul_rn(v[0], wt[0]);
#pragma unroll
        for (int j = 1; j < MAXK; ++j)
          if (j < k) o[u] = __fadd_rn(o[u], __fmul_rn(v[j], wt[j]));
      } else {
        o[u] = in && y ? y[static_cast<int64_t>(r) * n + i] : 0.0f;
        o0[u] = in && y0 ? y0[static_cast<int64_t>(r) * n + i] : 0.0f;
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int i = i0 + u * nth;
      if (i < n) {
        // (Neither y nor ey: x stays as it is, the sign of a zero included, and is only normed.)
        const bool add = MAXK > 0 || y;
        const float x0 = MAXK == 0 && y0 ? __fadd_rn(xv[u], o0[u]) : xv[u];
        const float v = add ? __fadd_rn(x0, o[u]) : x0;
        if (add) xr[i] = v;
        s += static_cast<double>(__fmul_rn(v, v));
#pragma unroll
        for (int q = 0; q < kKeep; ++q)
          if (q == c + u) xs[q] = v;  // a constant index per q, so xs stays in registers
      }
    }
  }
  if (!xn) return;
  const float scale = block_rms_scale(s, n, eps, part);
  float* yr = xn + static_cast<int64_t>(r) * n;
  if (keep) {
#pragma unroll
    for (int u = 0; u < kKeep; ++u) {
      const int i = tid + u * nth;
      if (i < n) {
        const float v = __fmul_rn(xs[u], scale);
        yr[i] = w ? __fmul_rn(v, wv[u]) : v;
      }
    }
  } else {
    for (int i = tid; i < n; i += nth) {  // the thread reads back only what it wrote itself
      const float v = __fmul_rn(xr[i], scale);
      yr[i] = w ? __fmul_rn(v, w[i]) : v;
    }
  }
  if (!xq) return;
  __syncthreads();  // the row of xn, written by the whole CTA, is visible to all its threads
  const size_t stride = static_cast<size_t>(n / 256) * 292;
  for (int b = tid >> 5; b < n / 256; b += nth >> 5)
    quantize_q8k_block(yr + 256 * b, xq + r * stride + static_cast<size_t>(b) * 292, tid & 31);
}

__global__ void add_kernel(float* x, const float* __restrict__ y, int64_t n) {
  pdl_enter();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) x[i] = __fadd_rn(x[i], y[i]);
}

__global__ void swiglu_kernel(const float* gate, const float* up, float* out, int64_t n) {
  pdl_enter();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float g = gate[i];
  out[i] = __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))), up[i]);
}

// The RoPE parameters as a kernel takes them (runtime/rope.h has the math): theta_scale made on the
// host with the CPU's float pow, the magnitude too, so both sides start from the same bits.
struct RopeArgs {
  float theta_scale, freq_scale, ext_factor, corr_lo, corr_hi, mscale;
};

RopeArgs rope_args(const RopeParams& r, int n_rot) {
  RopeArgs a;
  a.theta_scale = std::pow(r.base, -2.0f / static_cast<float>(n_rot));  // as cpu::rope_neox
  a.freq_scale = r.freq_scale;
  a.ext_factor = r.ext_factor;
  a.corr_lo = r.corr_lo;
  a.corr_hi = r.corr_hi;
  a.mscale = r.mscale();
  return a;
}

// The NeoX rotation table of position p: cos of pair i in tab[i], sin in tab[half + i] (angles as the
// CPU's rope: p * theta_scale^i by repeated products in float, then freq_scale and the YaRN ramp in
// float with explicit roundings (no contractions, as the CPU computes them), sincos in double, times
// mscale; an mscale of 1 and ext_factor 0 leave the plain bits). Called by the whole CTA; ends with a
// barrier.
__device__ __forceinline__ void rope_table(float* tab, int p, int half, const RopeArgs& r) {
  if (threadIdx.x == 0) {  // the serial chain only; the rest is per pair, spread over the CTA
    float theta = static_cast<float>(p);
    for (int i = 0; i < half; ++i) {
      tab[i] = theta;
      theta = __fmul_rn(theta, r.theta_scale);
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < half; i += blockDim.x) {
    const float extrap = tab[i];
    float th = __fmul_rn(r.freq_scale, extrap);
    if (r.ext_factor != 0.0f) {
      const float y = __fdiv_rn(__fsub_rn(static_cast<float>(i), r.corr_lo), fmaxf(0.001f, __fsub_rn(r.corr_hi, r.corr_lo)));
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

// One CTA per token: the rotation table (rope_table: the cos/sin in double are correctly rounded to
// float in all but astronomically rare cases, like glibc), then every head's pairs.
__global__ void rope_neox_kernel(float* x, int n_heads, int head_dim, int64_t ld, int n_rot, const int32_t* pos,
                                 RopeArgs rope) {
  extern __shared__ float tab[];  // [half] cos, [half] sin
  const int t = blockIdx.x, half = n_rot / 2;
  rope_table(tab, pos[t], half, rope);
  float* xt = x + t * ld;
  for (int k = threadIdx.x; k < n_heads * half; k += blockDim.x) {
    const int h = k / half, i = k % half;
    float* v = xt + static_cast<int64_t>(h) * head_dim;
    const float x0 = v[i], x1 = v[i + half];
    const float c = tab[i], s = tab[half + i];
    v[i] = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));
    v[i + half] = __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c));
  }
}

// Hybrid decode, the hand-over from the CPU's experts with their combination and the residual, spread
// over the row (CTAs over column pieces, grid.y = token): thread 0 of each CTA waits for the host's
// flag; then x[t][i] += sum_j wts[t*k+j] * row_j[i], added in slot order exactly as
// residual_norm_kernel does (so the same bits), row_j read from ey (a device-resident expert), ey_host
// (a slot the GPU computed from pinned weights) or straight from the pinned host rows (the CPU's).
template <int MAXK>
__global__ void handover_combine_kernel(const unsigned* flag, const unsigned* epoch, const float* host_rows,
                                        const float* __restrict__ ey, const float* __restrict__ ey_host,
                                        const int32_t* __restrict__ ids, const int32_t* __restrict__ slot_of,
                                        int n_expert, const int32_t* __restrict__ gpu_slots,
                                        const float* __restrict__ wts, int k, float* __restrict__ x, int width,
                                        unsigned long long* stamp) {
  pdl_enter();
  __shared__ const float* src[MAXK];
  __shared__ bool pinned[MAXK];
  __shared__ float wt[MAXK];
  const int t = blockIdx.y, tid = threadIdx.x;
  if (tid == 0) {
    const unsigned want = *epoch;
    uint64_t t0, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    while (load_acquire_sys(flag) != want) {
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
      if (now - t0 > 30ull * 1000000000ull) __trap();  // 30 s (the host sets flags even when it fails)
      poll_pause(100);
    }
    if (stamp && blockIdx.x == 0 && blockIdx.y == 0) {
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
      *stamp = now;
    }
  }
  if (tid < k) {
    const int64_t j = static_cast<int64_t>(t) * k + tid;
    const int32_t e = ids[j];
    // (A choice out of range, from NaN logits, reads its device row: the host rejects it anyway.)
    const bool host = e >= 0 && e < n_expert && slot_of[e] < 0;
    const bool by_gpu = host && gpu_slots && gpu_slots[j] >= 0;
    src[tid] = (!host ? ey : by_gpu ? ey_host : host_rows) + j * width;
    pinned[tid] = host && !by_gpu;
    wt[tid] = wts[j];
  }
  __syncthreads();  // (after thread 0's acquire of the flag: the host's rows are visible to the CTA)
  const int i = blockIdx.x * blockDim.x + tid;
  if (i >= width) return;
  float v[MAXK];
#pragma unroll
  for (int j = 0; j < MAXK; ++j)
    v[j] = j < k ? (pinned[j] ? __ldcv(src[j] + i) : src[j][i]) : 0.0f;
  float o = __fmul_rn(v[0], wt[0]);
#pragma unroll
  for (int j = 1; j < MAXK; ++j)
    if (j < k) o = __fadd_rn(o, __fmul_rn(v[j], wt[j]));
  float* xr = x + static_cast<int64_t>(t) * width + i;
  *xr = __fadd_rn(*xr, o);
}

__global__ void copy_rows_kernel(const float* __restrict__ src, int64_t ld_src, const int32_t* __restrict__ src_rows,
                                 float* __restrict__ dst, int64_t ld_dst, const int32_t* __restrict__ dst_rows, int width) {
  const int i = blockIdx.y;
  const int64_t sr = src_rows ? src_rows[i] : i, dr = dst_rows ? dst_rows[i] : i;
  for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < width; c += gridDim.x * blockDim.x)
    dst[dr * ld_dst + c] = src[sr * ld_src + c];
}

// ================================ KV cache ========================================================

template <typename T>
__device__ __forceinline__ T to_cache(float v);
template <>
__device__ __forceinline__ __half to_cache<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ float to_cache<float>(float v) { return v; }
__device__ __forceinline__ float from_cache(__half v) { return __half2float(v); }
__device__ __forceinline__ float from_cache(float v) { return v; }
// Rounds a float to the cache type and back (the reference's "Q / P in the cache type").
template <typename T>
__device__ __forceinline__ float round_cache(float v) { return from_cache(to_cache<T>(v)); }

template <typename T>
__global__ void kv_store_k_kernel(T* __restrict__ k, const int32_t* __restrict__ pos, const float* __restrict__ src,
                                  int64_t ld, int width) {
  const int t = blockIdx.y;
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= width) return;
  k[static_cast<int64_t>(pos[t]) * width + i] = to_cache<T>(src[t * ld + i]);
}
// V transposed: threads along tokens so that consecutive positions are written together.
template <typename T>
__global__ void kv_store_v_kernel(T* __restrict__ v, const int32_t* __restrict__ pos, const float* __restrict__ src,
                                  int64_t ld, int width, int n_tokens, int n_ctx) {
  const int t = blockIdx.x * 32 + threadIdx.x;
  const int i = blockIdx.y * 8 + threadIdx.y;
  if (t >= n_tokens || i >= width) return;
  v[static_cast<int64_t>(i) * n_ctx + pos[t]] = to_cache<T>(src[t * ld + i]);
}

// The attention prologue of a micro-batch, fused: per token (grid.y) and head (grid.x: the n_head
// query heads, then the n_head_kv key heads, then the n_head_kv value heads), RMSNorm of the head with
// its weight and NeoX RoPE for q and k (q in place, k into the cache), and v into the cache. The same
// arithmetic as rms_norm_kernel + rope_neox_kernel + kv_store_*_kernel, so the bits are the same.
// hv = rms_norm(src) * w over hd values with the block's threads (rms_norm_kernel's sums).
__device__ __forceinline__ void qk_norm_into(const float* src, const float* w, float* hv, int hd, float eps,
                                             double* part) {
  const int tid = threadIdx.x;
  double s = 0;
  for (int i = tid; i < hd; i += blockDim.x) {
    const float x = src[i];
    s += static_cast<double>(__fmul_rn(x, x));
  }
  const float scale = block_rms_scale(s, hd, eps, part);
  for (int i = tid; i < hd; i += blockDim.x) {
    const float x = __fmul_rn(src[i], scale);
    hv[i] = w ? __fmul_rn(x, w[i]) : x;
  }
}

template <typename T>
__global__ void qk_norm_rope_store_kernel(float* q, int64_t ld_q, const float* __restrict__ k, int64_t ld_k,
                                          const float* __restrict__ v, int64_t ld_v, const float* __restrict__ q_norm,
                                          const float* __restrict__ k_norm, T* __restrict__ kc, T* __restrict__ vc,
                                          int n_ctx, const int32_t* __restrict__ pos, int n_head, int n_head_kv, int hd,
                                          int hdv, int n_rot, RopeArgs rope, float eps, float* k_out) {
  extern __shared__ float sh[];  // [hd] normed head, [n_rot] cos / sin table
  __shared__ double part[32];
  const int h = blockIdx.x, t = blockIdx.y, tid = threadIdx.x;
  const int p = pos[t];  // (the positions are copied before the step's first kernel)
  float* hv = sh;
  float* tab = sh + hd;
  const int half = n_rot / 2;
  // The rotation table depends only on the position: made while the kernel before finishes (a serial
  // chain of products and a double-precision sincos per pair, 1.6% of all-GPU decode when it came after
  // the wait: 405.2 against 410.9 tok/s on the H200).
  if (h < n_head + n_head_kv) rope_table(tab, p, half, rope);
  // The head's norm weight is fetched before the wait too, and each element loaded once (heads of up to
  // blockDim.x values).
  const bool one_each = hd <= static_cast<int>(blockDim.x), is_q = h < n_head;
  const float* w = is_q ? q_norm : k_norm;
  const float wpre = one_each && h < n_head + n_head_kv && w && tid < hd ? w[tid] : 1.0f;
  pdl_enter();
  if (h >= n_head + n_head_kv) {  // a value head: straight into the transposed cache
    const int g = h - n_head - n_head_kv;
    for (int i = tid; i < hdv; i += blockDim.x)
      vc[static_cast<int64_t>(g * hdv + i) * n_ctx + p] = to_cache<T>(v[t * ld_v + static_cast<int64_t>(g) * hdv + i]);
    return;
  }
  const int g = is_q ? h : h - n_head;
  const float* src = is_q ? q + t * ld_q + static_cast<int64_t>(g) * hd : k + t * ld_k + static_cast<int64_t>(g) * hd;
  if (one_each) {
    const float x = tid < hd ? src[tid] : 0.0f;
    const float scale = block_rms_scale(tid < hd ? static_cast<double>(__fmul_rn(x, x)) : 0.0, hd, eps, part);
    if (tid < hd) {
      const float xs = __fmul_rn(x, scale);
      hv[tid] = w ? __fmul_rn(xs, wpre) : xs;
    }
  } else {
    qk_norm_into(src, w, hv, hd, eps, part);
  }
  __syncthreads();  // (hv, and the table)
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
    if (is_q) q[t * ld_q + static_cast<int64_t>(g) * hd + i] = o;
    else if (k_out) k_out[t * ld_k + static_cast<int64_t>(g) * hd + i] = o;  // (flash caches: stored after)
    else kc[static_cast<int64_t>(p) * n_head_kv * hd + static_cast<int64_t>(g) * hd + i] = to_cache<T>(o);
  }
}

// ================================ attention =======================================================

struct AttnArgs {
  const float* q;
  int64_t ld_q;
  const uint8_t* k;
  const uint8_t* v;
  int n_ctx;
  int pos0;
  const int32_t* pos_dev;
  int n_tokens, n_head, n_head_kv, group, hd, hdp, hdv;
  float scale;
  float* out;
  int64_t ld_out;
  // decode only (keys_max for both variants; the rest for split-K)
  int keys_max;
  int L_max;      // longest split the launch allows for (shared memory sizing)
  int n_splits;   // splits launched (grid.x) and the stride of st_m / st_l / opart
  float* S;       // [n_tokens][n_head][keys_max] scaled scores
  float* st_m;    // [n_tokens][n_head][n_splits] split maxima
  double* st_l;   // [n_tokens][n_head][n_splits] sum of exp(s - split max)
  float* opart;   // [n_tokens][n_head][n_splits][hdv] unnormalised-free partial outputs (P already final)
  bool v_vec;     // V rows can be read in 16-byte vectors
  unsigned* counters;  // short decode: a zero-initialised counter per (token, kv head)
  uint8_t* out_q;      // short decode: the output also in Q8_K (rows of n_head * hdv values), or null
  int chunk_min;       // short decode: keys per chunk at least (a multiple of 8, at most kChunkMax)
};

constexpr int kDecodeMaxTokens = 8;    // attention with at most this many queries uses a decode kernel
constexpr int kMaxSplits = 128;
constexpr int kDecThreads = 128;

__device__ __forceinline__ int attn_pos0(const AttnArgs& a) { return a.pos_dev ? a.pos_dev[0] : a.pos0; }

// Keys per split for n_keys keys: at most kMaxSplits splits of at least 64 keys (a multiple of 32).
__host__ __device__ __forceinline__ int split_len(int n_keys) {
  const int per = (n_keys + kMaxSplits - 1) / kMaxSplits;
  const int l = (per + 31) / 32 * 32;
  return l > 64 ? l : 64;
}
// The split length of a decode launch, from the real number of keys (graph-captured launches are sized
// for n_kv_max but split what is actually there).
__device__ __forceinline__ int dec_split_len(const AttnArgs& a) {
  return split_len(min(attn_pos0(a) + a.n_tokens, a.keys_max));
}

template <typename T>
__device__ __forceinline__ float2 ld_pair(const T* p);
template <>
__device__ __forceinline__ float2 ld_pair<__half>(const __half* p) {
  return __half22float2(*reinterpret_cast<const __half2*>(p));
}
template <>
__device__ __forceinline__ float2 ld_pair<float>(const float* p) {
  return *reinterpret_cast<const float2*>(p);
}

// 16 bytes of cache elements to floats, in registers.
__device__ __forceinline__ void unpack16(const uint4 raw, float (&out)[8]) {
  const uint32_t u[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    out[2 * k] = h2f(u[k] & 0xffffu);
    out[2 * k + 1] = h2f(u[k] >> 16);
  }
}
__device__ __forceinline__ void unpack16(const uint4 raw, float (&out)[4]) {
  out[0] = __uint_as_float(raw.x), out[1] = __uint_as_float(raw.y), out[2] = __uint_as_float(raw.z),
  out[3] = __uint_as_float(raw.w);
}

// The scores' canonical dot product (the reference's f16/f32 dot: 16 lanes, lane i takes elements
// i, i+16, ..., with fma, then folded 16 -> 8 -> 4 -> 2 -> 1), split over the four threads of a quad:
// thread c holds the lanes 2c, 2c+1, 2c+8, 2c+9. load_key_quad fetches the thread's part of key row kr
// (nm chunks of 16 elements, zeros past hd or for an invalid key); dot_key_quad takes q (already
// rounded to the cache type, offset by 2c) and returns the full dot product on every thread of the quad.
template <typename T, int MAXM>
__device__ __forceinline__ void load_key_quad(const T* kr, int c, int nm, int hd, bool valid, float2 (&kv)[MAXM][2]) {
#pragma unroll
  for (int m = 0; m < MAXM; ++m) {
    const int e0 = 16 * m + 2 * c, e1 = e0 + 8;
    kv[m][0] = (m < nm && valid && e0 < hd) ? ld_pair<T>(kr + e0) : make_float2(0.0f, 0.0f);
    kv[m][1] = (m < nm && valid && e1 < hd) ? ld_pair<T>(kr + e1) : make_float2(0.0f, 0.0f);
  }
}
template <int MAXM>
__device__ __forceinline__ float dot_key_quad(const float2 (&kv)[MAXM][2], const float* qh, int nm) {
  float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
#pragma unroll
  for (int m = 0; m < MAXM; ++m) {
    if (m < nm) {
      const float2 q0 = *reinterpret_cast<const float2*>(qh + 16 * m);
      const float2 q1 = *reinterpret_cast<const float2*>(qh + 16 * m + 8);
      a0 = __fmaf_rn(kv[m][0].x, q0.x, a0);
      a1 = __fmaf_rn(kv[m][0].y, q0.y, a1);
      a2 = __fmaf_rn(kv[m][1].x, q1.x, a2);
      a3 = __fmaf_rn(kv[m][1].y, q1.y, a3);
    }
  }
  float u0 = __fadd_rn(a0, a2), u1 = __fadd_rn(a1, a3);  // 16 -> 8
  u0 = __fadd_rn(u0, __shfl_xor_sync(kFull, u0, 2));      // 8 -> 4
  u1 = __fadd_rn(u1, __shfl_xor_sync(kFull, u1, 2));
  u0 = __fadd_rn(u0, __shfl_xor_sync(kFull, u0, 1));      // 4 -> 2
  u1 = __fadd_rn(u1, __shfl_xor_sync(kFull, u1, 1));
  return __fadd_rn(u0, u1);                               // 2 -> 1
}

// Decode pass 1: scores of the group's query heads against the split's keys, in the canonical order
// (load_key_quad / dot_key_quad), then the split's max and sum of exp(s - max) per head.
template <typename T, int MAXM>
__global__ void __launch_bounds__(kDecThreads) attn_dec_scores_kernel(const AttnArgs a) {
  pdl_enter();
  extern __shared__ float qs[];  // [group][hdp]
  const int sp = blockIdx.x, g = blockIdx.y, t = blockIdx.z, tid = threadIdx.x;
  const int nvis = min(attn_pos0(a) + t + 1, a.keys_max);
  const int L = dec_split_len(a);
  const int k0 = sp * L, k1 = min(k0 + L, nvis);
  const int hb = g * a.group;
  const size_t st0 = (static_cast<size_t>(t) * a.n_head + hb) * a.n_splits + sp;
  if (k0 >= nvis) {
    for (int h = tid; h < a.group; h += blockDim.x) {
      a.st_m[st0 + static_cast<size_t>(h) * a.n_splits] = -INFINITY;
      a.st_l[st0 + static_cast<size_t>(h) * a.n_splits] = 0.0;
    }
    return;
  }
  for (int idx = tid; idx < a.group * a.hdp; idx += blockDim.x) {
    const int h = idx / a.hdp, e = idx % a.hdp;
    qs[idx] = e < a.hd ? round_cache<T>(a.q[t * a.ld_q + static_cast<int64_t>(hb + h) * a.hd + e]) : 0.0f;
  }
  __syncthreads();
  const int c = tid & 3, kq = tid >> 2;
  const int nm = a.hdp / 16;
  const size_t krow = static_cast<size_t>(a.n_head_kv) * a.hd;
  const T* kbase = reinterpret_cast<const T*>(a.k) + static_cast<size_t>(g) * a.hd;
  float* srow = a.S + (static_cast<size_t>(t) * a.n_head + hb) * a.keys_max;
  const int nk = k1 - k0, nk32 = (nk + 31) & ~31;
  for (int jj = kq; jj < nk32; jj += kDecThreads / 4) {
    const int j = k0 + jj;
    const bool valid = jj < nk;
    float2 kv[MAXM][2];
    load_key_quad<T, MAXM>(kbase + static_cast<size_t>(valid ? j : k0) * krow, c, nm, a.hd, valid, kv);
    for (int h = 0; h < a.group; ++h) {
      const float s = __fmul_rn(dot_key_quad<MAXM>(kv, qs + h * a.hdp + 2 * c, nm), a.scale);
      if (valid && c == 0) srow[static_cast<size_t>(h) * a.keys_max + j] = s;
    }
  }
  __syncthreads();
  const int warp = tid >> 5, lane = tid & 31;
  for (int h = warp; h < a.group; h += kDecThreads / 32) {
    const float* s = srow + static_cast<size_t>(h) * a.keys_max;
    float mx = -INFINITY;
    for (int i = k0 + lane; i < k1; i += 32) mx = fmaxf(mx, s[i]);
    mx = warp_max(mx);
    double l = 0.0;
    for (int i = k0 + lane; i < k1; i += 32) l += static_cast<double>(expf(__fsub_rn(s[i], mx)));
    l = warp_sum(l);
    if (lane == 0) {
      a.st_m[st0 + static_cast<size_t>(h) * a.n_splits] = mx;
      a.st_l[st0 + static_cast<size_t>(h) * a.n_splits] = l;
    }
  }
}

// Decode pass 2: the global max and sum from the splits' statistics, P = cache_type(exp(s - max) / sum)
// for the split's keys, and the split's partial V^T.P (or the output itself with one split).
template <typename T>
__global__ void __launch_bounds__(kDecThreads) attn_dec_pv_kernel(const AttnArgs a) {
  pdl_enter();
  extern __shared__ float P[];  // [group][L]
  const int sp = blockIdx.x, g = blockIdx.y, t = blockIdx.z, tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31;
  const int nvis = min(attn_pos0(a) + t + 1, a.keys_max);
  const int L = dec_split_len(a);
  const int k0 = sp * L, k1 = min(k0 + L, nvis);
  if (k0 >= nvis) return;
  const int n_act = min((nvis + L - 1) / L, a.n_splits);
  const int hb = g * a.group;
  for (int h = warp; h < a.group; h += kDecThreads / 32) {
    const size_t sb = (static_cast<size_t>(t) * a.n_head + hb + h) * a.n_splits;
    float M = -INFINITY;
    for (int i = lane; i < n_act; i += 32) M = fmaxf(M, a.st_m[sb + i]);
    M = warp_max(M);
    double tot = 0.0;
    for (int i = lane; i < n_act; i += 32) {
      const double l = a.st_l[sb + i];
      if (l > 0.0) tot += l * exp(static_cast<double>(a.st_m[sb + i]) - static_cast<double>(M));
    }
    tot = warp_sum(tot);
    const float inv = static_cast<float>(1.0 / tot);
    const float* s = a.S + (static_cast<size_t>(t) * a.n_head + hb + h) * a.keys_max;
    for (int i = lane; i < L; i += 32) {
      const int j = k0 + i;
      P[h * L + i] = j < k1 ? round_cache<T>(__fmul_rn(expf(__fsub_rn(s[j], M)), inv)) : 0.0f;
    }
  }
  __syncthreads();
  constexpr int E = 16 / sizeof(T);
  const int len = k1 - k0;
  const T* vbase = reinterpret_cast<const T*>(a.v) + static_cast<size_t>(g) * a.hdv * a.n_ctx + k0;
  // lpr lanes share a row of V^T (enough to cover the split in one sweep of E-element vectors); each
  // lane takes 4 rows (their loads in flight together) and 4 heads at a time.
  int lpr = 1;
  while (lpr < 32 && lpr * E < L) lpr <<= 1;
  const int sub = lane / lpr, li = lane % lpr;
  const int rows_per_warp = (32 / lpr) * 4;
  for (int d0 = warp * rows_per_warp; d0 < a.hdv; d0 += rows_per_warp * (kDecThreads / 32)) {
    const int dr = d0 + sub * 4;  // this lane's first row
    for (int hc = 0; hc < a.group; hc += 4) {
      float acc[4][4];
#pragma unroll
      for (int r = 0; r < 4; ++r)
#pragma unroll
        for (int h = 0; h < 4; ++h) acc[r][h] = 0.0f;
      for (int i0 = li * E; i0 < len; i0 += lpr * E) {
        float vv[4][E];
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int d = dr + r;
          const T* vr = vbase + static_cast<size_t>(d < a.hdv ? d : 0) * a.n_ctx + i0;
          if (d < a.hdv && a.v_vec && i0 + E <= len) {
            unpack16(*reinterpret_cast<const uint4*>(vr), vv[r]);
          } else {
#pragma unroll
            for (int k = 0; k < E; ++k) vv[r][k] = (d < a.hdv && i0 + k < len) ? from_cache(vr[k]) : 0.0f;
          }
        }
#pragma unroll
        for (int h = 0; h < 4; ++h) {
          if (hc + h < a.group) {
            const float* ph = P + (hc + h) * L + i0;
#pragma unroll
            for (int k = 0; k < E; ++k) {
              const float pk = ph[k];
#pragma unroll
              for (int r = 0; r < 4; ++r) acc[r][h] = __fmaf_rn(vv[r][k], pk, acc[r][h]);
            }
          }
        }
      }
#pragma unroll
      for (int r = 0; r < 4; ++r) {
#pragma unroll
        for (int h = 0; h < 4; ++h) {
          float v = acc[r][h];
          for (int o = lpr / 2; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
          const int d = dr + r, head = hb + hc + h;
          if (li == 0 && d < a.hdv && hc + h < a.group) {
            if (n_act == 1) {
              a.out[t * a.ld_out + static_cast<int64_t>(head) * a.hdv + d] = v;
            } else {
              a.opart[((static_cast<size_t>(t) * a.n_head + head) * a.n_splits + sp) * a.hdv + d] = v;
            }
          }
        }
      }
    }
  }
}

// Decode pass 3: out = sum of the active splits' partial outputs, in split order.
__global__ void attn_dec_combine_kernel(const AttnArgs a) {
  pdl_enter();
  const int h = blockIdx.x, t = blockIdx.y;
  const int nvis = min(attn_pos0(a) + t + 1, a.keys_max);
  const int L = dec_split_len(a);
  const int n_act = min((nvis + L - 1) / L, a.n_splits);
  if (n_act == 1) return;  // pass 2 wrote the output itself
  const float* src = a.opart + (static_cast<size_t>(t) * a.n_head + h) * a.n_splits * a.hdv;
  for (int d = threadIdx.x; d < a.hdv; d += blockDim.x) {
    float o = 0.0f;
    for (int i = 0; i < n_act; ++i) o = __fadd_rn(o, src[static_cast<size_t>(i) * a.hdv + d]);
    a.out[t * a.ld_out + static_cast<int64_t>(h) * a.hdv + d] = o;
  }
}


// Decode with a short cache (at most kShortKeys visible keys), in one launch: up to kGroupChunks CTAs
// per (kv head, token), each owning a chunk of the keys (group_chunk_len) for all the query heads of the
// group, so every cached key and value is read once per group and the work spreads over the GPU. The
// reference's formulas (those of the three split-K passes): canonical scores; the max over all keys;
// the sum of exp(s - max) in double; P = cache_type(exp(s - max) / sum); O = V^T P. The chunks agree on
// the max and the sum through two barriers on a counter per (kv head, token), so all kGroupChunks CTAs
// of a group must be resident at once: the launch checks that the whole grid fits on the GPU. The last
// chunk to finish adds the partial outputs in chunk order (and, with out_q, writes the group's span of
// the output in Q8_K for the next mat-vec). The counters start at zero (the caller zero-fills the
// scratch once) and the last chunk resets its counter.
constexpr int kShortKeys = 2048;
constexpr int kGroupChunks = 16;
constexpr int kChunkMax = kShortKeys / kGroupChunks;  // keys per chunk at most (a multiple of 8)
constexpr int kGroupThreads = 256;

// Keys per chunk for nvis visible keys: at least chunk_min (a chunk's share of the barrier costs more
// than a few keys), a multiple of 8 (aligned V vectors), at most kChunkMax.
__device__ __forceinline__ int group_chunk_len(int nvis, int chunk_min) {
  const int per = ((nvis + kGroupChunks - 1) / kGroupChunks + 7) / 8 * 8;
  return per > chunk_min ? per : chunk_min;
}

struct GroupSmem {  // dynamic shared memory of attn_dec_group_kernel, in floats
  int qs, S, red, total;
  __host__ __device__ GroupSmem(int group, int hdp, int hdv) {
    qs = 0;
    S = group * hdp;
    red = S + group * (kChunkMax > hdv ? kChunkMax : hdv);
    total = red + group * kGroupThreads + 4 * group;  // partial outputs, then max / 1/sum per head
  }
};

// Arrive at the group's counter and wait until `target` CTAs have (thread 0 spins; the block waits at
// the barrier): the CTAs' global writes before it are visible to each other after it.
__device__ __forceinline__ void group_barrier(unsigned* cnt, unsigned target) {
  __syncthreads();
  if (threadIdx.x == 0) {
    arrive_acq_rel(cnt);
    while (load_acquire_gpu(cnt) < target) poll_pause(20);
  }
  __syncthreads();
}

// Which part of a group's work CTA `cta` (blockIdx.x) does: the keys split into n_act chunks and the
// group's heads into hs subsets (powers of two, as many as the spare CTAs allow: a short cache has
// few chunks and would leave the GPU idle), CTA = (subset, chunk). With out_q each subset's span of the
// output must be whole Q8_K blocks.
struct GroupMap {
  int Lc, n_act, hs, sub, ch, G, j0, nk;
  bool active;
};
__device__ __forceinline__ GroupMap group_map(const AttnArgs& a, int nvis, int cta) {
  GroupMap m;
  m.Lc = group_chunk_len(nvis, a.chunk_min);
  m.n_act = (nvis + m.Lc - 1) / m.Lc;
  m.hs = 1;
  for (int h2 = 2; a.group % h2 == 0 && h2 * m.n_act <= kGroupChunks; h2 *= 2) {
    if (a.out_q && ((a.group / h2) * a.hdv) % 256 != 0) break;
    m.hs = h2;
  }
  m.sub = cta / m.n_act;
  m.ch = cta % m.n_act;
  m.active = m.sub < m.hs;
  m.G = a.group / m.hs;
  m.j0 = m.ch * m.Lc;
  m.nk = min(m.j0 + m.Lc, nvis) - m.j0;
  return m;
}

template <typename T, int MAXM, int MAXG>
__global__ void __launch_bounds__(kGroupThreads) attn_dec_group_kernel(const AttnArgs a) {
  extern __shared__ __align__(16) float sm[];
  const int g = blockIdx.y, t = blockIdx.z, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int nkv = a.n_head_kv;
  const size_t key_bytes = static_cast<size_t>(a.hd) * sizeof(T), krow_bytes = static_cast<size_t>(nkv) * key_bytes;
  const int nvis = min(attn_pos0(a) + t + 1, a.keys_max);  // (the position: copied before the step's first kernel)
  const GroupMap gm = group_map(a, nvis, blockIdx.x);
  if (gm.active && nvis <= kShortKeys) {
    // While the kernel before finishes, this chunk's cached keys and values (written by earlier steps)
    // go into L2.
    const int lk = static_cast<int>((key_bytes + 127) / 128), lv = (gm.nk * static_cast<int>(sizeof(T)) + 127) / 128;
    const uint8_t* kb = a.k + static_cast<size_t>(gm.j0) * krow_bytes + static_cast<size_t>(g) * key_bytes;
    const uint8_t* vb = a.v + (static_cast<size_t>(g) * a.hdv * a.n_ctx + gm.j0) * sizeof(T);
    for (int i = tid; i < gm.nk * lk; i += kGroupThreads)
      prefetch_l2(kb + static_cast<size_t>(i / lk) * krow_bytes + (i % lk) * 128, 1, 0, 1);
    for (int i = tid; i < a.hdv * lv; i += kGroupThreads)
      prefetch_l2(vb + static_cast<size_t>(i / lv) * a.n_ctx * sizeof(T) + (i % lv) * 128, 1, 0, 1);
  }
  pdl_enter();
  if (nvis > kShortKeys) {  // the caller chose the wrong variant: say so loudly, never silently
    float* out = a.out + t * a.ld_out + static_cast<int64_t>(g) * a.group * a.hdv;
    if (blockIdx.x == 0) {
      for (int e = tid; e < a.group * a.hdv; e += kGroupThreads) out[e] = __int_as_float(0x7fc00000);
      if (a.out_q) {  // (the Q8_K copy too: a NaN scale per block)
        const size_t qstride = static_cast<size_t>(a.n_head) * a.hdv / 256 * 292;
        const int b0 = g * a.group * a.hdv / 256;
        for (int b = tid; b < a.group * a.hdv / 256; b += kGroupThreads)
          *reinterpret_cast<float*>(a.out_q + t * qstride + static_cast<size_t>(b0 + b) * 292) = __int_as_float(0x7fc00000);
      }
    }
    return;
  }
  if (!gm.active) return;  // (uniform per group: these CTAs take no part in its barriers)
  const int G = gm.G, c = gm.ch, n_act = gm.n_act, j0 = gm.j0, nk = gm.nk;  // this CTA's heads and keys
  const bool alone = n_act == 1;  // one chunk: no barriers, no partial outputs
  const GroupSmem L(G, a.hdp, a.hdv);
  float* qs = sm + L.qs;    // [G][hdp] the heads' queries, rounded to the cache type
  float* S = sm + L.S;      // [G][kChunkMax] scores, then P
  float* red = sm + L.red;  // [P parts][G][hdv] partial outputs
  float* Mh = red + G * kGroupThreads;  // [G] max over all keys
  float* inv = Mh + G;                  // [G] 1 / sum
  const int row0 = g * a.group + gm.sub * G;  // first query head of the CTA
  float* out = a.out + t * a.ld_out + static_cast<int64_t>(row0) * a.hdv;
  const size_t slot = (static_cast<size_t>(t) * nkv + g) * gm.hs + gm.sub;  // this (token, kv head, subset)
  // (The counter by head index, not by slot: tokens of one launch may split their groups differently.)
  unsigned* cnt = a.counters + (static_cast<size_t>(t) * nkv + g) * a.group + gm.sub;
  float* st_m = a.st_m + slot * kGroupChunks * G;    // [chunk][G]
  double* st_l = a.st_l + slot * kGroupChunks * G;   // [chunk][G]
  float* opart = a.opart + slot * kGroupChunks * G * a.hdv;  // [chunk][G][hdv]
  // This thread's V vectors (part p, row d: the chunk's 8-key vectors p, p + P, ...), loaded now so
  // that their latency overlaps the softmax and its barrier.
  const int P = kGroupThreads / a.hdv;
  const int d = tid % a.hdv, p = tid / a.hdv;
  constexpr int E = 8, kVRegs = 8;
  const T* vr = reinterpret_cast<const T*>(a.v) + (static_cast<size_t>(g) * a.hdv + d) * a.n_ctx + j0;
  const bool vfull = a.v_vec && p < P;
  uint4 vraw[kVRegs][sizeof(T) == 2 ? 1 : 2];
#pragma unroll
  for (int r = 0; r < kVRegs; ++r) {
    const int v0 = (p + r * P) * E;
    if (vfull && v0 + E <= nk) {
      vraw[r][0] = *reinterpret_cast<const uint4*>(vr + v0);
      if constexpr (sizeof(T) == 4) vraw[r][1] = *reinterpret_cast<const uint4*>(vr + v0 + 4);
    }
  }

  for (int e = tid; e < G * a.hdp; e += kGroupThreads) {
    const int i = e / a.hdp, x = e % a.hdp;
    qs[e] = x < a.hd ? round_cache<T>(a.q[t * a.ld_q + static_cast<int64_t>(row0 + i) * a.hd + x]) : 0.0f;
  }
  __syncthreads();
  // Scores: a quad per key, each key's quarter in registers for the G dot products.
  {
    const int cq = tid & 3, kq = tid >> 2, nm = a.hdp / 16;
    const T* kbase = reinterpret_cast<const T*>(a.k) + static_cast<size_t>(g) * a.hd;
    const size_t krow = static_cast<size_t>(nkv) * a.hd;
    for (int jj0 = 0; jj0 < nk; jj0 += kGroupThreads / 4) {
      const int jj = jj0 + kq;
      const bool valid = jj < nk;
      float2 kv[MAXM][2];
      load_key_quad<T, MAXM>(kbase + static_cast<size_t>(valid ? j0 + jj : 0) * krow, cq, nm, a.hd, valid, kv);
      for (int i = 0; i < G; ++i) {
        const float sc = __fmul_rn(dot_key_quad<MAXM>(kv, qs + i * a.hdp + 2 * cq, nm), a.scale);
        if (valid && cq == 0) S[i * kChunkMax + jj] = sc;
      }
    }
  }
  __syncthreads();
  // The chunk's max and sum of exp(s - chunk max) per head; with several chunks, one barrier, then the
  // max over all keys and the total sum (each chunk's sum rescaled in double).
  for (int i = warp; i < G; i += kGroupThreads / 32) {
    float m = -INFINITY;
    for (int j = lane; j < nk; j += 32) m = fmaxf(m, S[i * kChunkMax + j]);
    m = warp_max(m);
    double l = 0.0;
    for (int j = lane; j < nk; j += 32) l += static_cast<double>(expf(__fsub_rn(S[i * kChunkMax + j], m)));
    l = warp_sum(l);
    if (lane == 0) {
      if (alone) {
        Mh[i] = m;
        inv[i] = static_cast<float>(1.0 / l);
      } else {
        st_m[c * G + i] = m;
        st_l[c * G + i] = l;
      }
    }
  }
  if (!alone) {
    group_barrier(cnt, n_act);
    for (int i = warp; i < G; i += kGroupThreads / 32) {
      const float mc = lane < n_act ? __ldcg(st_m + lane * G + i) : -INFINITY;
      const double lc = lane < n_act ? __ldcg(st_l + lane * G + i) : 0.0;
      const float m = warp_max(mc);
      const double lr = lane < n_act ? lc * exp(static_cast<double>(mc) - static_cast<double>(m)) : 0.0;
      double l = 0.0;
      for (int k = 0; k < n_act; ++k) l += __shfl_sync(kFull, lr, k);  // in chunk order
      if (lane == 0) {
        Mh[i] = m;
        inv[i] = static_cast<float>(1.0 / l);
      }
    }
  }
  __syncthreads();
  for (int e = tid; e < G * nk; e += kGroupThreads) {
    const int i = e / nk, j = e % nk;
    float* sp = S + i * kChunkMax + j;
    *sp = round_cache<T>(__fmul_rn(expf(__fsub_rn(*sp, Mh[i])), inv[i]));
  }
  __syncthreads();
  // V^T.P over the chunk for every head of the group (each value loaded once, used G times); the
  // parts are added in order.
  {
    float acc[MAXG];
#pragma unroll
    for (int i = 0; i < MAXG; ++i) acc[i] = 0.0f;
    if (p < P) {
      for (int r = 0, v0 = p * E; v0 < nk; ++r, v0 += P * E) {
        float vv[E];
        if (vfull && v0 + E <= nk) {
          uint4 raw[sizeof(T) == 2 ? 1 : 2];
          if (r < kVRegs) {
#pragma unroll
            for (int q = 0; q < kVRegs; ++q)  // (constant indices keep vraw in registers)
              if (q == r) {
                raw[0] = vraw[q][0];
                if constexpr (sizeof(T) == 4) raw[1] = vraw[q][1];
              }
          } else {
            raw[0] = *reinterpret_cast<const uint4*>(vr + v0);
            if constexpr (sizeof(T) == 4) raw[1] = *reinterpret_cast<const uint4*>(vr + v0 + 4);
          }
          if constexpr (sizeof(T) == 2) {
            unpack16(raw[0], vv);
          } else {
            float lo[4], hi[4];
            unpack16(raw[0], lo);
            unpack16(raw[1], hi);
#pragma unroll
            for (int k = 0; k < 4; ++k) vv[k] = lo[k], vv[k + 4] = hi[k];
          }
        } else {
#pragma unroll
          for (int k = 0; k < E; ++k) vv[k] = v0 + k < nk ? from_cache(vr[v0 + k]) : 0.0f;
        }
#pragma unroll
        for (int i = 0; i < MAXG; ++i) {
          if (i < G) {
            const float* pi = S + i * kChunkMax + v0;
#pragma unroll
            for (int k = 0; k < E; ++k)
              if (v0 + k < nk) acc[i] = __fmaf_rn(vv[k], pi[k], acc[i]);
          }
        }
      }
#pragma unroll
      for (int i = 0; i < MAXG; ++i)
        if (i < G) red[(p * G + i) * a.hdv + d] = acc[i];
    }
  }
  __syncthreads();
  float* ob = S;  // [G * hdv] the group's output (fits: S holds G * max(kChunkMax, hdv) floats)
  if (alone) {
    for (int e = tid; e < G * a.hdv; e += kGroupThreads) {
      float o = red[e];
      for (int p = 1; p < P; ++p) o = __fadd_rn(o, red[p * G * a.hdv + e]);
      out[e] = o;
      ob[e] = o;
    }
  } else {
    for (int e = tid; e < G * a.hdv; e += kGroupThreads) {
      float o = red[e];
      for (int p = 1; p < P; ++p) o = __fadd_rn(o, red[p * G * a.hdv + e]);
      opart[static_cast<size_t>(c) * G * a.hdv + e] = o;
    }
    __shared__ bool last;
    __syncthreads();
    if (tid == 0) last = arrive_acq_rel(cnt) == 2 * n_act - 1;
    __syncthreads();
    if (!last) return;
    // The last chunk: the group's output, the partials added in chunk order.
    for (int e = tid; e < G * a.hdv; e += kGroupThreads) {
      float o = __ldcg(opart + e);
      for (int k = 1; k < n_act; ++k) o = __fadd_rn(o, __ldcg(opart + static_cast<size_t>(k) * G * a.hdv + e));
      out[e] = o;
      ob[e] = o;
    }
    if (tid == 0) *cnt = 0;
  }
  if (!a.out_q) return;
  // The group's span of the output row in Q8_K (the caller checked that it is whole 256-value blocks).
  __syncthreads();
  const int span = G * a.hdv, b0 = row0 * a.hdv / 256;
  const size_t qstride = static_cast<size_t>(a.n_head) * a.hdv / 256 * 292;
  for (int b = warp; b < span / 256; b += kGroupThreads / 32)
    quantize_q8k_block(ob + 256 * b, a.out_q + t * qstride + static_cast<size_t>(b0 + b) * 292, lane);
}

// Prefill: one CTA per (32 query rows, kv head); query rows are (token, head of the group) pairs.
// Pass 1 streams the keys once for the rows' max and sum (online, the sum in double); pass 2 streams
// them again for P = cache_type(exp(s - max) / sum) and O += P V. Scores use the canonical order:
// the Q and K tiles sit in shared memory permuted so that thread c of a quad reads the lanes c, c+4,
// c+8, c+12 of 16 consecutive elements as one float4.
constexpr int kPTQ = 32, kPTK = 32, kPThreads = 256;
constexpr int kPST = kPTK + 4;  // P and V^T tile row stride (floats)

__device__ __forceinline__ int perm16(int e) { return (e & ~15) | ((e & 3) << 2) | ((e >> 2) & 3); }

struct PrefillSmem {
  int qst, kv_floats;
  __host__ __device__ static size_t floats_for(int hdp, int hdv, int* qst_out, int* kv_out) {
    const int qst = hdp + 4;
    const int kvf = kPTK * qst > hdv * kPST ? kPTK * qst : hdv * kPST;
    if (qst_out) *qst_out = qst;
    if (kv_out) *kv_out = kvf;
    // Q, K/V, P, max, inv, (pad), sum (double)
    return static_cast<size_t>(kPTQ) * qst + kvf + kPTQ * kPST + 2 * kPTQ + 2 * kPTQ + 2;
  }
};

template <typename T, int MAXND>
__global__ void __launch_bounds__(kPThreads, 2) attn_prefill_kernel(const AttnArgs a) {
  extern __shared__ float sm[];
  int QST, KVF;
  PrefillSmem::floats_for(a.hdp, a.hdv, &QST, &KVF);
  float* Qs = sm;
  float* KV = Qs + kPTQ * QST;
  float* Ps = KV + KVF;
  float* Mr = Ps + kPTQ * kPST;
  float* Ir = Mr + kPTQ;
  double* Lr = reinterpret_cast<double*>(Ir + kPTQ + ((reinterpret_cast<uintptr_t>(Ir + kPTQ) & 7) ? 1 : 0));

  const int g = blockIdx.y, r0 = blockIdx.x * kPTQ, tid = threadIdx.x;
  const int R = a.n_tokens * a.group;
  const int p0 = attn_pos0(a);
  const int r_last = min(r0 + kPTQ, R) - 1;
  const int kend = p0 + r_last / a.group + 1;  // keys the tile's last row sees
  const int hd = a.hd, hdp = a.hdp, hdv = a.hdv;
  const size_t krow = static_cast<size_t>(a.n_head_kv) * hd;
  const T* kbase = reinterpret_cast<const T*>(a.k) + static_cast<size_t>(g) * hd;
  const T* vbase = reinterpret_cast<const T*>(a.v) + static_cast<size_t>(g) * hdv * a.n_ctx;

  for (int idx = tid; idx < kPTQ * hdp; idx += kPThreads) {
    const int r = idx / hdp, e = idx % hdp;
    const int rr = r0 + r;
    float v = 0.0f;
    if (rr < R && e < hd) {
      const int t = rr / a.group, h = g * a.group + rr % a.group;
      v = round_cache<T>(a.q[t * a.ld_q + static_cast<int64_t>(h) * hd + e]);
    }
    Qs[r * QST + perm16(e)] = v;
  }
  if (tid < kPTQ) {
    Mr[tid] = -INFINITY;
    Lr[tid] = 0.0;
  }

  // score micro-tile of this thread: rows 4*qg.., keys 4*kg.., lanes quad c
  const int c = tid & 3, warp = tid >> 5, lg = (tid >> 2) & 7;
  const int qg = 2 * (warp >> 1) + (lg >> 2), kg = 4 * (warp & 1) + (lg & 3);
  const int nm = hdp / 16;

  auto load_k_tile = [&](int kt0) {
    for (int idx = tid; idx < kPTK * hdp; idx += kPThreads) {
      const int kk = idx / hdp, e = idx % hdp;
      const int j = kt0 + kk;
      KV[kk * QST + perm16(e)] = (j < kend && e < hd) ? from_cache(kbase[static_cast<size_t>(j) * krow + e]) : 0.0f;
    }
  };
  // The 4x4 scores (already * scale) of the micro-tile; identical in the four threads of the quad.
  auto scores = [&](float (&sc)[4][4]) {
    float acc[4][4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int s = 0; s < 4; ++s) acc[i][j][s] = 0.0f;
    for (int m = 0; m < nm; ++m) {
      float4 qv[4], kv[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) qv[i] = *reinterpret_cast<const float4*>(Qs + (4 * qg + i) * QST + 16 * m + 4 * c);
#pragma unroll
      for (int j = 0; j < 4; ++j) kv[j] = *reinterpret_cast<const float4*>(KV + (4 * kg + j) * QST + 16 * m + 4 * c);
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          acc[i][j][0] = __fmaf_rn(kv[j].x, qv[i].x, acc[i][j][0]);
          acc[i][j][1] = __fmaf_rn(kv[j].y, qv[i].y, acc[i][j][1]);
          acc[i][j][2] = __fmaf_rn(kv[j].z, qv[i].z, acc[i][j][2]);
          acc[i][j][3] = __fmaf_rn(kv[j].w, qv[i].w, acc[i][j][3]);
        }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        // acc[s] is canonical lane c + 4s: 16 -> 8 -> 4 in registers, 4 -> 2 -> 1 across the quad
        float v = __fadd_rn(__fadd_rn(acc[i][j][0], acc[i][j][2]), __fadd_rn(acc[i][j][1], acc[i][j][3]));
        v = __fadd_rn(v, __shfl_xor_sync(kFull, v, 2));
        v = __fadd_rn(v, __shfl_xor_sync(kFull, v, 1));
        sc[i][j] = __fmul_rn(v, a.scale);
      }
  };
  auto visible = [&](int r, int j) {
    const int rr = r0 + r;
    return rr < R && j < kend && j <= p0 + rr / a.group;
  };
  auto row_c = [&](const float (&sc)[4][4], int j) {
    return c == 0 ? sc[0][j] : c == 1 ? sc[1][j] : c == 2 ? sc[2][j] : sc[3][j];
  };
  __syncthreads();

  // ---- pass 1: row max and sum ----
  for (int kt0 = 0; kt0 < kend; kt0 += kPTK) {
    load_k_tile(kt0);
    __syncthreads();
    float sc[4][4];
    scores(sc);
    {
      const int r = 4 * qg + c;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int kk = 4 * kg + j;
        Ps[r * kPST + kk] = visible(r, kt0 + kk) ? row_c(sc, j) : -INFINITY;
      }
    }
    __syncthreads();
    for (int i = 0; i < 4; ++i) {
      const int r = 4 * warp + i;
      const int lane = tid & 31;
      const float s = Ps[r * kPST + lane];
      const float mold = Mr[r];
      const float mnew = fmaxf(mold, warp_max(s));
      if (mnew == -INFINITY) continue;
      const double e = s == -INFINITY ? 0.0 : static_cast<double>(expf(__fsub_rn(s, mnew)));
      const double ls = warp_sum(e);
      if (lane == 0) {
        Lr[r] = (mold == -INFINITY ? 0.0 : Lr[r] * exp(static_cast<double>(mold) - static_cast<double>(mnew))) + ls;
        Mr[r] = mnew;
      }
    }
    __syncthreads();
  }
  if (tid < kPTQ) Ir[tid] = Lr[tid] > 0.0 ? static_cast<float>(1.0 / Lr[tid]) : 0.0f;
  __syncthreads();

  // ---- pass 2: P and O ----
  const int rg = tid & 7, dl = tid >> 3;  // O rows rg + 8*i, columns dl + 32*n
  float O[4][MAXND];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int n = 0; n < MAXND; ++n) O[i][n] = 0.0f;
  for (int kt0 = 0; kt0 < kend; kt0 += kPTK) {
    load_k_tile(kt0);
    __syncthreads();
    float sc[4][4];
    scores(sc);
    {
      const int r = 4 * qg + c;
      const float M = Mr[r], inv = Ir[r];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int kk = 4 * kg + j;
        Ps[r * kPST + kk] = visible(r, kt0 + kk) ? round_cache<T>(__fmul_rn(expf(__fsub_rn(row_c(sc, j), M)), inv)) : 0.0f;
      }
    }
    __syncthreads();
    for (int idx = tid; idx < hdv * kPTK; idx += kPThreads) {
      const int d = idx / kPTK, kk = idx % kPTK;
      const int j = kt0 + kk;
      KV[d * kPST + kk] = j < kend ? from_cache(vbase[static_cast<size_t>(d) * a.n_ctx + j]) : 0.0f;
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kPTK; kk += 4) {
      float4 pv[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) pv[i] = *reinterpret_cast<const float4*>(Ps + (rg + 8 * i) * kPST + kk);
#pragma unroll
      for (int n = 0; n < MAXND; ++n) {
        const int d = dl + 32 * n;
        if (d < hdv) {
          const float4 vv = *reinterpret_cast<const float4*>(KV + d * kPST + kk);
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            O[i][n] = __fmaf_rn(pv[i].x, vv.x, O[i][n]);
            O[i][n] = __fmaf_rn(pv[i].y, vv.y, O[i][n]);
            O[i][n] = __fmaf_rn(pv[i].z, vv.z, O[i][n]);
            O[i][n] = __fmaf_rn(pv[i].w, vv.w, O[i][n]);
          }
        }
      }
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int rr = r0 + rg + 8 * i;
    if (rr >= R) continue;
    const int t = rr / a.group, h = g * a.group + rr % a.group;
    float* o = a.out + t * a.ld_out + static_cast<int64_t>(h) * hdv;
#pragma unroll
    for (int n = 0; n < MAXND; ++n) {
      const int d = dl + 32 * n;
      if (d < hdv) o[d] = O[i][n];
    }
  }
}


// ---- prefill attention on tensor cores (f16 cache, sm_70+) ----
// The same two passes as attn_prefill_kernel (exact row max and sum first, then P normalised and
// rounded to f16 before P.V, as the reference's non-flash path), with Q.K^T and P.V as wmma
// 16x16x16 f16 products accumulated in f32: only the order of the dot products' sums differs.
// A CTA takes 64 query rows of one KV head (4 warps x 16 rows); keys go in tiles of 64.
constexpr int kTQ = 64, kTK = 64, kTThreads = 128, kTMaxD = 128;
constexpr int kTLdP = kTK + 8;  // P and V^T tiles: halves per row
constexpr int kTLdS = kTK + 4;  // score tile: floats per row

struct TcAttnSmem {
  int ldq;  // Q and K tiles: halves per row (hdp + 8)
  size_t q, kv, sc, p, stats, total;
  __host__ __device__ TcAttnSmem(int hdp, int hdv) {
    ldq = hdp + 8;
    auto al = [](size_t b) { return (b + 127) / 128 * 128; };
    q = 0;
    kv = al(static_cast<size_t>(kTQ) * ldq * 2);
    const size_t kbytes = static_cast<size_t>(kTK) * ldq * 2, vbytes = static_cast<size_t>(hdv) * kTLdP * 2;
    sc = kv + al(kbytes > vbytes ? kbytes : vbytes);
    p = sc + al(static_cast<size_t>(kTQ) * kTLdS * 4);
    stats = p + al(static_cast<size_t>(kTQ) * kTLdP * 2);
    total = stats + kTQ * (4 + 4 + 8);
  }
};

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 700
__device__ __forceinline__ void attn_tc_body(const AttnArgs& a) {
  namespace wmma = nvcuda::wmma;
  extern __shared__ __align__(128) uint8_t smem[];
  const int hd = a.hd, hdp = a.hdp, hdv = a.hdv;
  const TcAttnSmem L(hdp, hdv);
  const int ldq = L.ldq;
  __half* Qs = reinterpret_cast<__half*>(smem + L.q);
  __half* Ks = reinterpret_cast<__half*>(smem + L.kv);
  __half* Vs = Ks;  // V^T tile [d][key] takes the K tile's place in pass 2
  float* Ss = reinterpret_cast<float*>(smem + L.sc);
  __half* Ps = reinterpret_cast<__half*>(smem + L.p);
  float* Mr = reinterpret_cast<float*>(smem + L.stats);
  float* Ir = Mr + kTQ;
  double* Lr = reinterpret_cast<double*>(Ir + kTQ);

  const int g = blockIdx.y, r0 = blockIdx.x * kTQ, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int R = a.n_tokens * a.group;
  const int p0 = attn_pos0(a);
  const int r_last = min(r0 + kTQ, R) - 1;
  const int kend = p0 + r_last / a.group + 1;
  const size_t krow = static_cast<size_t>(a.n_head_kv) * hd;
  const __half* kbase = reinterpret_cast<const __half*>(a.k) + static_cast<size_t>(g) * hd;
  const __half* vbase = reinterpret_cast<const __half*>(a.v) + static_cast<size_t>(g) * hdv * a.n_ctx;

  for (int idx = tid; idx < kTQ * hdp; idx += kTThreads) {
    const int r = idx / hdp, e = idx % hdp, rr = r0 + r;
    float v = 0.0f;
    if (rr < R && e < hd) {
      const int t = rr / a.group, h = g * a.group + rr % a.group;
      v = a.q[t * a.ld_q + static_cast<int64_t>(h) * hd + e];
    }
    Qs[r * ldq + e] = __float2half_rn(v);  // Q rounded to the cache type
  }
  if (tid < kTQ) {
    Mr[tid] = -INFINITY;
    Lr[tid] = 0.0;
  }
  // K tile rows kt0..kt0+63 (zero past kend and past hd), 8 halves per load (hd % 8 == 0).
  auto load_k = [&](int kt0) {
    const int vpr = hdp / 8;
    for (int idx = tid; idx < kTK * vpr; idx += kTThreads) {
      const int kk = idx / vpr, e = (idx % vpr) * 8, j = kt0 + kk;
      uint4 v = make_uint4(0, 0, 0, 0);
      if (j < kend && e < hd) v = *reinterpret_cast<const uint4*>(kbase + static_cast<size_t>(j) * krow + e);
      *reinterpret_cast<uint4*>(Ks + kk * ldq + e) = v;
    }
  };
  // This warp's 16 x 64 scores (unscaled) into Ss.
  auto scores = [&]() {
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[kTK / 16];
#pragma unroll
    for (int n = 0; n < kTK / 16; ++n) wmma::fill_fragment(acc[n], 0.0f);
    for (int kk = 0; kk < hdp; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> qa;
      wmma::load_matrix_sync(qa, Qs + warp * 16 * ldq + kk, ldq);
#pragma unroll
      for (int n = 0; n < kTK / 16; ++n) {
        wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major> kb;
        wmma::load_matrix_sync(kb, Ks + n * 16 * ldq + kk, ldq);
        wmma::mma_sync(acc[n], qa, kb, acc[n]);
      }
    }
#pragma unroll
    for (int n = 0; n < kTK / 16; ++n)
      wmma::store_matrix_sync(Ss + warp * 16 * kTLdS + n * 16, acc[n], kTLdS, wmma::mem_row_major);
    __syncwarp();
  };
  auto visible = [&](int r, int j) {
    const int rr = r0 + r;
    return rr < R && j < kend && j <= p0 + rr / a.group;
  };
  __syncthreads();

  // ---- pass 1: row max and sum (each warp its own 16 rows) ----
  for (int kt0 = 0; kt0 < kend; kt0 += kTK) {
    __syncthreads();
    load_k(kt0);
    __syncthreads();
    scores();
    for (int i = 0; i < 16; ++i) {
      const int r = warp * 16 + i;
      float sv[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int kk = lane + 32 * h;
        sv[h] = visible(r, kt0 + kk) ? __fmul_rn(Ss[r * kTLdS + kk], a.scale) : -INFINITY;
      }
      const float mold = Mr[r];
      const float mnew = fmaxf(mold, warp_max(fmaxf(sv[0], sv[1])));
      if (mnew == -INFINITY) continue;
      double e = 0.0;
#pragma unroll
      for (int h = 0; h < 2; ++h) e += sv[h] == -INFINITY ? 0.0 : static_cast<double>(expf(__fsub_rn(sv[h], mnew)));
      const double ls = warp_sum(e);
      if (lane == 0) {
        Lr[r] = (mold == -INFINITY ? 0.0 : Lr[r] * exp(static_cast<double>(mold) - static_cast<double>(mnew))) + ls;
        Mr[r] = mnew;
      }
      __syncwarp();
    }
  }
  __syncthreads();
  if (tid < kTQ) Ir[tid] = Lr[tid] > 0.0 ? static_cast<float>(1.0 / Lr[tid]) : 0.0f;
  __syncthreads();

  // ---- pass 2: P (normalised, rounded to f16) and O = P.V ----
  const int nv = hdv / 16;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> o[kTMaxD / 16];
#pragma unroll
  for (int n = 0; n < kTMaxD / 16; ++n) wmma::fill_fragment(o[n], 0.0f);
  for (int kt0 = 0; kt0 < kend; kt0 += kTK) {
    __syncthreads();  // the previous tile's P.V is done with Vs
    load_k(kt0);
    __syncthreads();
    scores();
    for (int i = 0; i < 16; ++i) {
      const int r = warp * 16 + i;
      const float M = Mr[r], inv = Ir[r];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int kk = lane + 32 * h;
        const float s = __fmul_rn(Ss[r * kTLdS + kk], a.scale);
        Ps[r * kTLdP + kk] = __float2half_rn(visible(r, kt0 + kk) ? __fmul_rn(expf(__fsub_rn(s, M)), inv) : 0.0f);
      }
    }
    __syncthreads();  // every warp is done with Ks: V^T takes its place
    for (int idx = tid; idx < hdv * kTK; idx += kTThreads) {
      const int d = idx / kTK, kk = idx % kTK, j = kt0 + kk;
      Vs[d * kTLdP + kk] = j < kend ? vbase[static_cast<size_t>(d) * a.n_ctx + j] : __float2half_rn(0.0f);
    }
    __syncthreads();
#pragma unroll
    for (int kb = 0; kb < kTK / 16; ++kb) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> pa;
      wmma::load_matrix_sync(pa, Ps + warp * 16 * kTLdP + kb * 16, kTLdP);
#pragma unroll
      for (int n = 0; n < kTMaxD / 16; ++n) {
        if (n < nv) {
          wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major> vb;
          wmma::load_matrix_sync(vb, Vs + n * 16 * kTLdP + kb * 16, kTLdP);
          wmma::mma_sync(o[n], pa, vb, o[n]);
        }
      }
    }
  }
  __syncthreads();
  // O through shared memory (the Q / K region) to the rows' (token, head) places.
  float* Os = reinterpret_cast<float*>(smem);
  const int ldo = hdv + 4;
#pragma unroll
  for (int n = 0; n < kTMaxD / 16; ++n)
    if (n < nv) wmma::store_matrix_sync(Os + warp * 16 * ldo + n * 16, o[n], ldo, wmma::mem_row_major);
  __syncthreads();
  for (int idx = tid; idx < kTQ * hdv; idx += kTThreads) {
    const int r = idx / hdv, d = idx % hdv, rr = r0 + r;
    if (rr >= R) continue;
    const int t = rr / a.group, h = g * a.group + rr % a.group;
    a.out[t * a.ld_out + static_cast<int64_t>(h) * hdv + d] = Os[r * ldo + d];
  }
}
#endif

__global__ void __launch_bounds__(kTThreads) attn_prefill_tc_kernel(const AttnArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
  attn_tc_body(a);
#else
  __trap();  // the host launches this only where the device runs sm_70+ code (see tc_attention_ok)
#endif
}

// The tensor-core kernel runs where the code the device executes was built for sm_70 or later and the
// heads fit its tiles; else the CUDA-core kernel (Pascal, f32 caches, heads over 128).
bool tc_attention_ok(const AttnArgs& a) {
  if (a.hdp > kTMaxD || a.hdv > kTMaxD || a.hdv % 16 != 0 || a.hdp % 16 != 0 || a.hd % 8 != 0) return false;
  if (kernel_ptx_version(reinterpret_cast<const void*>(attn_prefill_tc_kernel), "attention") < 70) return false;
  // The staging of O at the end reuses the Q and K/V regions.
  const TcAttnSmem L(a.hdp, a.hdv);
  return static_cast<size_t>(kTQ) * (a.hdv + 4) * 4 <= L.sc;
}

// Decode scratch: the short kernel's counters (zero-filled by the caller once, left zero) first, then
// either kernel's arrays (never both in one call, so they share the space).
struct DecodeLayout {
  int keys_max, L_max, n_splits;
  size_t off_s, off_m, off_l, off_o, total;  // split-K
  size_t g_m, g_l, g_o;                // short (group) kernel
};
DecodeLayout decode_layout(int n_tokens, int keys_max, int n_head, int hdv) {
  DecodeLayout d{};
  d.keys_max = std::max(keys_max, 1);
  d.L_max = split_len(d.keys_max);
  // enough splits for any real key count <= keys_max (its split length may be as short as 64)
  d.n_splits = std::min(kMaxSplits, (d.keys_max + 63) / 64);
  const size_t rows = static_cast<size_t>(n_tokens) * n_head;
  // Counters: one per (token, head) for the most tokens a decode call takes, whatever this call's token
  // count, so that they stay where they are (and zero) from call to call.
  const size_t base = align256(static_cast<size_t>(kDecodeMaxTokens) * n_head * sizeof(unsigned));
  d.off_s = base;
  d.off_m = base + align256(rows * d.keys_max * sizeof(float));
  d.off_l = d.off_m + align256(rows * kMaxSplits * sizeof(float));
  d.off_o = d.off_l + align256(rows * kMaxSplits * sizeof(double));
  d.total = d.off_o + align256(rows * kMaxSplits * static_cast<size_t>(hdv) * sizeof(float));
  d.g_m = base;
  d.g_l = d.g_m + align256(rows * kGroupChunks * sizeof(float));
  d.g_o = d.g_l + align256(rows * kGroupChunks * sizeof(double));
  d.total = std::max(d.total, d.g_o + align256(rows * kGroupChunks * static_cast<size_t>(hdv) * sizeof(float)));
  return d;
}

// The one-launch short-cache kernel for these shapes, when its CTAs all fit on the GPU at once (they
// wait for each other); null otherwise (split-K then).
using AttnKernel = void (*)(AttnArgs);

template <typename T>
AttnKernel group_kernel(const AttnArgs& a, size_t* smem) {
  if (a.n_tokens > kDecodeMaxTokens || a.pos0 + a.n_tokens > kShortKeys || a.hdp > 256 || a.group > 16) return nullptr;
  *smem = static_cast<size_t>(GroupSmem(a.group, a.hdp, a.hdv).total) * sizeof(float);
  const AttnKernel k = a.hdp <= 128 ? (a.group <= 8 ? attn_dec_group_kernel<T, 8, 8> : attn_dec_group_kernel<T, 8, 16>)
                                    : (a.group <= 8 ? attn_dec_group_kernel<T, 16, 8> : attn_dec_group_kernel<T, 16, 16>);
  need_smem(k, *smem, "attention");
  const int ctas = kGroupChunks * a.n_head_kv * a.n_tokens;
  return resident_ctas(reinterpret_cast<const void*>(k), kGroupThreads, *smem, "attention") >= ctas ? k : nullptr;
}

// Returns whether the output was also written in Q8_K (a.out_q: only by the short-cache kernel, and only
// when each group's span of the output is whole 256-value blocks).
template <typename T>
bool launch_attention(AttnArgs& a, void* scratch, size_t scratch_bytes, cudaStream_t s) {
  size_t gsmem = 0;
  if (const AttnKernel gk = group_kernel<T>(a, &gsmem)) {
    const DecodeLayout d = decode_layout(a.n_tokens, a.keys_max, a.n_head, a.hdv);
    if (!scratch || scratch_bytes < d.total)
      fail("attention: scratch of " + std::to_string(scratch_bytes) + " bytes, needs " + std::to_string(d.total));
    uint8_t* base = static_cast<uint8_t*>(scratch);
    a.counters = reinterpret_cast<unsigned*>(base);
    a.st_m = reinterpret_cast<float*>(base + d.g_m);
    a.st_l = reinterpret_cast<double*>(base + d.g_l);
    a.opart = reinterpret_cast<float*>(base + d.g_o);
    a.v_vec = aligned(a.v, 16) && (a.n_ctx * sizeof(T)) % 16 == 0;
    if ((a.group * a.hdv) % 256 != 0) a.out_q = nullptr;
    // Keys per chunk at least: a chunk's barrier costs more than a few keys (measured on the H200:
    // 32 beat 16, 24, 64 and 128; docs/performance.md).
    a.chunk_min = 32;
    const dim3 grid(kGroupChunks, a.n_head_kv, a.n_tokens);
    launch(gk, grid, kGroupThreads, gsmem, s, a);
    launched("attention (decode, short cache)");
    return a.out_q != nullptr;
  } else if (a.n_tokens <= kDecodeMaxTokens) {
    const DecodeLayout d = decode_layout(a.n_tokens, a.keys_max, a.n_head, a.hdv);
    if (!scratch || scratch_bytes < d.total)
      fail("attention: scratch of " + std::to_string(scratch_bytes) + " bytes, needs " + std::to_string(d.total));
    uint8_t* base = static_cast<uint8_t*>(scratch);
    a.L_max = d.L_max;
    a.n_splits = d.n_splits;
    a.S = reinterpret_cast<float*>(base + d.off_s);
    a.st_m = reinterpret_cast<float*>(base + d.off_m);
    a.st_l = reinterpret_cast<double*>(base + d.off_l);
    a.opart = reinterpret_cast<float*>(base + d.off_o);
    a.v_vec = aligned(a.v, 16) && (a.n_ctx * sizeof(T)) % 16 == 0;
    const dim3 grid(d.n_splits, a.n_head_kv, a.n_tokens);
    const size_t smem1 = static_cast<size_t>(a.group) * a.hdp * sizeof(float);
    if (a.hdp <= 128) {
      need_smem(attn_dec_scores_kernel<T, 8>, smem1, "attention");
      launch(attn_dec_scores_kernel<T, 8>, grid, kDecThreads, smem1, s, a);
    } else {
      need_smem(attn_dec_scores_kernel<T, 16>, smem1, "attention");
      launch(attn_dec_scores_kernel<T, 16>, grid, kDecThreads, smem1, s, a);
    }
    launched("attention (scores)");
    const size_t smem2 = static_cast<size_t>(a.group) * d.L_max * sizeof(float);
    need_smem(attn_dec_pv_kernel<T>, smem2, "attention");
    launch(attn_dec_pv_kernel<T>, grid, kDecThreads, smem2, s, a);
    launched("attention (P.V)");
    if (d.n_splits > 1) {
      launch(attn_dec_combine_kernel, dim3(a.n_head, a.n_tokens), 128, 0, s, a);
      launched("attention (combine)");
    }
  } else if (std::is_same_v<T, __half> && g_tc_attention && tc_attention_ok(a)) {
    // (set_tensor_core_attention(false) keeps the CUDA-core kernel: tests hold both to the reference.)
    const TcAttnSmem L(a.hdp, a.hdv);
    need_smem(attn_prefill_tc_kernel, L.total, "attention");
    const dim3 grid(blocks_for(static_cast<int64_t>(a.n_tokens) * a.group, kTQ), a.n_head_kv);
    attn_prefill_tc_kernel<<<grid, kTThreads, L.total, s>>>(a);
    launched("attention (prefill, tensor cores)");
  } else {
    const size_t smem = PrefillSmem::floats_for(a.hdp, a.hdv, nullptr, nullptr) * sizeof(float);
    const dim3 grid(blocks_for(static_cast<int64_t>(a.n_tokens) * a.group, kPTQ), a.n_head_kv);
    if (a.hdv <= 128) {
      need_smem(attn_prefill_kernel<T, 4>, smem, "attention");
      attn_prefill_kernel<T, 4><<<grid, kPThreads, smem, s>>>(a);
    } else {
      need_smem(attn_prefill_kernel<T, 8>, smem, "attention");
      attn_prefill_kernel<T, 8><<<grid, kPThreads, smem, s>>>(a);
    }
    launched("attention (prefill)");
  }
  return false;
}

// ================================ routing =========================================================

// Token t's routing by one warp (p: n_expert floats of shared memory, used beyond 512 experts). The
// logits are read through L2 (__ldcg): in the fused router they were just written by other CTAs.
__device__ void route_topk_warp(const float* logits, int n_expert, int k, int32_t* ids, float* weights, int t, float* p) {
  if (n_expert <= 128) return route_topk_warp_regs<4>(logits, n_expert, k, ids, weights, t);
  if (n_expert <= 256) return route_topk_warp_regs<8>(logits, n_expert, k, ids, weights, t);
  if (n_expert <= 512) return route_topk_warp_regs<16>(logits, n_expert, k, ids, weights, t);
  const int lane = threadIdx.x & 31;
  const float* l = logits + static_cast<int64_t>(t) * n_expert;
  float mx = -INFINITY;
  for (int e = lane; e < n_expert; e += 32) mx = fmaxf(mx, __ldcg(l + e));
  mx = warp_max(mx);
  double sum = 0.0;
  for (int e = lane; e < n_expert; e += 32) {
    const float v = expf(__fsub_rn(__ldcg(l + e), mx));
    p[e] = v;
    sum += static_cast<double>(v);
  }
  sum = warp_sum(sum);
  const float inv = static_cast<float>(__drcp_rn(sum));  // (= 1.0 / sum, correctly rounded)
  for (int e = lane; e < n_expert; e += 32) p[e] = __fmul_rn(p[e], inv);
  __syncwarp();
  int32_t* ti = ids + static_cast<int64_t>(t) * k;
  float* tw = weights + static_cast<int64_t>(t) * k;
  float my_w = 0.0f;
  int my_i = 0;
  for (int j = 0; j < k; ++j) {
    float bv = -1.0f;
    int bi = INT_MAX;
    for (int e = lane; e < n_expert; e += 32) {
      if (p[e] > bv) {  // ascending e per lane: strict '>' keeps the lowest index on ties
        bv = p[e];
        bi = e;
      }
    }
    warp_argmax(bv, bi);
    if ((j & 31) == lane) my_w = bv, my_i = bi;  // choice j stays in a register of lane j % 32
    if (lane == 0 && bi < n_expert) p[bi] = -2.0f;  // taken (NaN logits leave bi out of range)
    __syncwarp();
  }
  write_renormalised(my_w, my_i, k, ti, tw);
}

__global__ void route_topk_kernel(const float* __restrict__ logits, int n_expert, int k, int32_t* __restrict__ ids,
                                  float* __restrict__ weights) {
  pdl_enter();
  extern __shared__ float p[];  // [n_expert]
  route_topk_warp(logits, n_expert, k, ids, weights, blockIdx.x, p);
}

// The routing handed to the CPU through pinned memory (hybrid decode): the choices and the normed
// input written straight into the host's buffers, then (after a system-scope fence, so the CPU that
// sees the flag sees them too) the step's epoch into the layer's flag. Called by one whole CTA.
__device__ void publish_route(const RoutePublish& pub, const int32_t* ids, int n_ids, const float* x, int64_t n_x) {
  for (int i = threadIdx.x; i < n_ids; i += blockDim.x) pub.ids[i] = ids[i];
  if (pub.gpu_share > 0) {
    for (int t = threadIdx.x; t < n_ids / pub.k; t += blockDim.x) {
      const int32_t* it = ids + t * pub.k;
      int h = 0;
      // (A choice out of range, from NaN logits, counts as device-resident here; the host rejects it.)
      auto host = [&](int32_t e) { return e >= 0 && e < pub.n_expert && pub.slot_of[e] < 0; };
      for (int j = 0; j < pub.k; ++j) h += host(it[j]);
      int take = static_cast<int>(__fadd_rn(__fmul_rn(static_cast<float>(h), pub.gpu_share), 0.25f));
      for (int j = pub.k - 1; j >= 0; --j) {
        const bool gpu = take > 0 && host(it[j]);
        take -= gpu;
        pub.gpu_slots[t * pub.k + j] = pub.host_gpu_slots[t * pub.k + j] = gpu ? it[j] : -1;
      }
    }
  }
  if (pub.x)
    for (int64_t i = threadIdx.x; i < n_x; i += blockDim.x) pub.x[i] = x[i];
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned e = *pub.epoch;
    if (pub.stamp) {
      unsigned long long now;
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
      *pub.stamp = now;
    }
    store_release_sys(pub.flag, e);
  }
}

// publish_route on its own, after a routing that did not go through router_topk.
__global__ void publish_route_kernel(const RoutePublish pub, const int32_t* ids, int n_ids, const float* x, int64_t n_x) {
  pdl_enter();
  publish_route(pub, ids, n_ids, x, n_x);
}

// The router's product (F32 weights, one CTA per expert row as mv_float_split_kernel) with the
// routing fused: the last CTA to finish (counted in *done, which it resets) routes every token,
// a warp per token, exactly as route_topk_kernel.
template <int NT, bool VEC>
__global__ void __launch_bounds__(kMvWarps * 32) router_topk_kernel(const MvArgs a, int k, int32_t* __restrict__ ids,
                                                                    float* __restrict__ weights, unsigned* done,
                                                                    const RoutePublish pub) {
  extern __shared__ float p[];  // [kMvWarps][rows]
  __shared__ bool last;
  mv_float_split_body<float, NT, VEC>(a);
  __syncthreads();  // (then thread 0's release publishes this CTA's logits)
  if (threadIdx.x == 0) last = arrive_acq_rel(done) == gridDim.x - 1;
  __syncthreads();
  if (!last) return;
  const int warp = threadIdx.x >> 5;
  for (int t = warp; t < a.n_tokens; t += kMvWarps)
    route_topk_warp(a.y, static_cast<int>(a.rows), k, ids, weights, t, p + warp * a.rows);
  if (threadIdx.x == 0) *done = 0;
  if (pub.flag) {
    __syncthreads();  // the choices, written by the routing warps, are visible to the whole CTA
    publish_route(pub, ids, a.n_tokens * k, reinterpret_cast<const float*>(a.acts), a.n_tokens * a.cols);
  }
}

__global__ void moe_combine_kernel(const float* __restrict__ y, const float* __restrict__ w, int k, int n,
                                   float* __restrict__ out) {
  pdl_enter();
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  const int t = blockIdx.y;
  if (i >= n) return;
  const float* yt = y + static_cast<int64_t>(t) * k * n + i;
  const float* wt = w + static_cast<int64_t>(t) * k;
  float o = __fmul_rn(yt[0], wt[0]);
  for (int j = 1; j < k; ++j) o = __fadd_rn(o, __fmul_rn(yt[static_cast<int64_t>(j) * n], wt[j]));
  out[static_cast<int64_t>(t) * n + i] = o;
}

}  // namespace

// ================================ public API ======================================================

void set_dependent_launch(bool allowed) { g_pdl_allowed = allowed; }
void set_tensor_core_attention(bool allowed) { g_tc_attention = allowed; }
bool dependent_launch_active() { return pdl_on(); }

namespace {
__global__ void busy_wait_kernel(long long cycles) {
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) {
  }
}
}  // namespace

void busy_wait(int microseconds, Stream s) {
  int khz = 0, dev = 0;
  cuda_ok(cudaGetDevice(&dev), "busy_wait");
  cuda_ok(cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, dev), "busy_wait");
  busy_wait_kernel<<<1, 1, 0, cs(s)>>>(static_cast<long long>(khz) * microseconds / 1000);
  launched("busy_wait");
}

void embed_rows(const DevMatrix& table, const int32_t* ids, int n, float* out, Stream s) {
  if (n <= 0) return;
  check_weight(table, "embed_rows");
  const cudaStream_t st = cs(s);
  if (is_float_type(table.type)) {
    if (n > 65535) fail("embed_rows: too many rows in one call");
    const dim3 grid(blocks_for(table.cols, 256), static_cast<unsigned>(n));
    if (table.type == DType::F32) embed_float_kernel<float><<<grid, 256, 0, st>>>(table.data, table.row_bytes, table.cols, ids, table.rows, out);
    else if (table.type == DType::F16) embed_float_kernel<__half><<<grid, 256, 0, st>>>(table.data, table.row_bytes, table.cols, ids, table.rows, out);
    else embed_float_kernel<__nv_bfloat16><<<grid, 256, 0, st>>>(table.data, table.row_bytes, table.cols, ids, table.rows, out);
  } else {
    launch_dequant<float>(table.type, table.data, table.row_bytes, n, table.cols, ids, table.rows, out, table.cols, st);
  }
  launched("embed_rows");
}

void rms_norm(const float* x, const float* w, float* y, int n, int rows, float eps, int64_t ld_x, int64_t ld_y,
              Stream s) {
  if (rows <= 0) return;
  launch(rms_norm_kernel, rows, kNormThreads, 0, cs(s), x, w, y, n, eps, ld_x, ld_y);
  launched("rms_norm");
}

void residual_norm(float* x, const float* y, const float* ey, const float* wts, int k, const float* w, float* xn,
                   int n, int rows, float eps, Stream s, void* xq, const float* y0) {
  if (rows <= 0 || n <= 0) return;
  if (y && ey) fail("residual_norm: give at most one of y and ey");
  if (y0 && !y) fail("residual_norm: y0 comes with y");
  if (!y && !ey && !xn) fail("residual_norm: nothing to do");
  if (ey && (!wts || k <= 0)) fail("residual_norm: the experts' combination needs weights and k > 0");
  if (ey && k > 32) fail("residual_norm: at most 32 experts per token");
  if (xq && (!xn || n % 256 != 0 || !aligned(xq, 4)))
    fail("residual_norm: the Q8_K copy needs xn, rows a multiple of 256 values and 4-byte alignment");
  const cudaStream_t st = cs(s);
  uint8_t* q = static_cast<uint8_t*>(xq);
  if (!ey) launch(residual_norm_kernel<0>, rows, kNormThreads, 0, st, x, y0, y, ey, wts, k, w, xn, q, n, eps);
  else if (k <= 8) launch(residual_norm_kernel<8>, rows, kNormThreads, 0, st, x, y0, y, ey, wts, k, w, xn, q, n, eps);
  else launch(residual_norm_kernel<32>, rows, kNormThreads, 0, st, x, y0, y, ey, wts, k, w, xn, q, n, eps);
  launched("residual_norm");
}

void residual_norm_router(const float* x, const float* y, const float* w, int n, float eps, const DevMatrix& router,
                          float* logits, void* xq, Stream s) {
  if (!x || !y || !w || !logits || !xq) fail("residual_norm_router: x, y, w, logits and xq are required");
  if (n <= 0 || n % 256 != 0 || n > kFoldMaxPerThread * 256)
    fail("residual_norm_router: rows of 256 to " + std::to_string(kFoldMaxPerThread * 256) +
         " values in whole Q8_K blocks only, not " + std::to_string(n));
  check_weight(router, "residual_norm_router");
  if (router.type != DType::F32 || router.cols != n || router.n_mats != 1 || !aligned(router.data, 16) ||
      router.row_bytes % 16 != 0)
    fail("residual_norm_router: an aligned F32 router of the rows' width only");
  if (router.rows < n / 256) fail("residual_norm_router: fewer router rows than Q8_K blocks to write");
  if (!aligned(xq, 4)) fail("residual_norm_router: the Q8_K rows must be 4-byte aligned");
  launch(residual_norm_router_kernel, static_cast<unsigned>(router.rows), kMvWarps * 32, 0, cs(s), x, y, w, n, eps,
         router.data, router.row_bytes, logits, static_cast<uint8_t*>(xq));
  launched("residual_norm_router");
}

void add(float* x, const float* y, int64_t n, Stream s) {
  if (n <= 0) return;
  launch(add_kernel, blocks_for(n, 256), 256, 0, cs(s), x, y, n);
  launched("add");
}

void swiglu(const float* gate, const float* up, float* out, int64_t n, Stream s) {
  if (n <= 0) return;
  launch(swiglu_kernel, blocks_for(n, 256), 256, 0, cs(s), gate, up, out, n);
  launched("swiglu");
}

void rope_neox(float* x, int n_tokens, int n_heads, int head_dim, int64_t ld, int n_rot, const int32_t* pos,
               const RopeParams& rope, Stream s) {
  if (n_tokens <= 0) return;
  if (n_rot <= 0 || n_rot % 2 != 0 || n_rot > head_dim) fail("rope_neox: bad n_rot " + std::to_string(n_rot));
  const size_t smem = static_cast<size_t>(n_rot) * sizeof(float);
  rope_neox_kernel<<<n_tokens, 128, smem, cs(s)>>>(x, n_heads, head_dim, ld, n_rot, pos, rope_args(rope, n_rot));
  launched("rope_neox");
}

size_t act_bytes(DType act, int64_t n, int rows) { return row_bytes(act, n) * static_cast<size_t>(rows); }

void quantize_acts(DType act, const float* x, int64_t n, int rows, int64_t ld_x, void* dst, Stream s) {
  if (rows <= 0) return;
  const cudaStream_t st = cs(s);
  const size_t stride = row_bytes(act, n);
  uint8_t* d = static_cast<uint8_t*>(dst);
  switch (act) {
    case DType::Q8_0:
    case DType::Q8_1: {
      if (n % 32 != 0) fail("quantize_acts: row length not a multiple of 32");
      const int64_t blocks = n / 32 * rows;
      if (act == DType::Q8_0) launch(quant_q8_kernel<false>, blocks_for(blocks, 128), 128, 0, st, x, n, rows, ld_x, d, stride);
      else launch(quant_q8_kernel<true>, blocks_for(blocks, 128), 128, 0, st, x, n, rows, ld_x, d, stride);
      break;
    }
    case DType::Q8_K: {
      if (n % 256 != 0) fail("quantize_acts: row length not a multiple of 256");
      if (!aligned(dst, 4)) fail("quantize_acts: Q8_K destination must be 4-byte aligned");
      const int64_t blocks = n / 256 * rows;
      launch(quant_q8k_kernel, blocks_for(blocks, 8), 256, 0, st, x, n, rows, ld_x, d, stride);
      break;
    }
    case DType::F16: launch_convert<0>(x, n, rows, ld_x, dst, n, st); break;
    case DType::BF16: launch_convert<1>(x, n, rows, ld_x, dst, n, st); break;
    case DType::F32: launch_convert<2>(x, n, rows, ld_x, dst, n, st); break;
    default: fail(std::string("quantize_acts: unsupported activation type ") + tname(act));
  }
  launched("quantize_acts");
}

bool rounds_acts(DType act) { return act == DType::Q8_K || act == DType::Q8_0 || act == DType::Q8_1; }

void round_acts(DType act, const float* x, int64_t n, int rows, int64_t ld_x, float* y, int64_t ld_y, Stream s) {
  if (rows <= 0) return;
  if (!rounds_acts(act)) fail(std::string("round_acts: ") + tname(act) + " is not an 8-bit activation format");
  launch_round_acts(act, x, n, rows, ld_x, y, ld_y, cs(s));
  launched("round_acts");
}

void matvec(const DevMatrix& w, const void* acts, int n_tokens, float* y, int64_t ld_y, Stream s) {
  if (n_tokens <= 0) return;
  if (n_tokens > kMaxVecTokens)
    fail("matvec: " + std::to_string(n_tokens) + " tokens, at most " + std::to_string(kMaxVecTokens));
  launch_matvec(w, acts, n_tokens, y, ld_y, nullptr, nullptr, 1, nullptr, cs(s), "matvec");
}

void matvec_multi(const DevMatrix* const* ws, float* const* ys, const int64_t* ld_ys, int n, const void* acts,
                  int n_tokens, Stream s) {
  if (n <= 0 || n_tokens <= 0) return;
  for (int i = 0; i < n; ++i) {
    check_weight(*ws[i], "matvec_multi");
    if (dtype_info(ws[i]->type).act_type != dtype_info(ws[0]->type).act_type || ws[i]->cols != ws[0]->cols ||
        ws[i]->n_mats != 1)
      fail("matvec_multi: the matrices must be single matrices of one width and activation format");
  }
  std::vector<DType> types;  // distinct, in order of appearance
  for (int i = 0; i < n; ++i)
    if (std::find(types.begin(), types.end(), ws[i]->type) == types.end()) types.push_back(ws[i]->type);
  // Pairs with a mixed kernel (the K-quant mixes of the _M / _S files).
  auto pair = [&](DType a, DType b) {
    return types.size() == 2 && ((types[0] == a && types[1] == b) || (types[0] == b && types[1] == a));
  };
  const bool mixed = pair(DType::Q4_K, DType::Q6_K) || pair(DType::Q5_K, DType::Q6_K) ||
                     pair(DType::Q3_K, DType::Q4_K) || pair(DType::Q3_K, DType::Q5_K);
  if (types.size() > 1 && (!mixed || n > kMaxMatvecs)) {  // one call per type
    for (DType t : types) {
      std::vector<const DevMatrix*> w1;
      std::vector<float*> y1;
      std::vector<int64_t> l1;
      for (int j = 0; j < n; ++j)
        if (ws[j]->type == t) w1.push_back(ws[j]), y1.push_back(ys[j]), l1.push_back(ld_ys[j]);
      matvec_multi(w1.data(), y1.data(), l1.data(), static_cast<int>(w1.size()), acts, n_tokens, s);
    }
    return;
  }
  if (n == 1 || is_float_type(types[0]) || n > kMaxMatvecs) {  // one launch per matrix
    for (int i = 0; i < n; ++i) matvec(*ws[i], acts, n_tokens, ys[i], ld_ys[i], s);
    return;
  }
  DType t1 = types[0], t2 = types.back();  // t2: the kernel's alternative type (t1 when one type)
  if (n_tokens > kMaxVecTokens) fail("matvec_multi: at most kMaxVecTokens tokens");
  if (t1 > t2) std::swap(t1, t2);  // the instantiated order
  MvArgs a = mv_args(*ws[0], acts, n_tokens, ys[0], ld_ys[0], "matvec_multi");
  a.n_seg = n;
  for (int i = 0; i < n; ++i) {
    a.seg_w[i] = ws[i]->data;
    a.seg_y[i] = ys[i];
    a.seg_rows[i] = ws[i]->rows;
    a.seg_ld[i] = ld_ys[i];
    a.seg_row_bytes[i] = ws[i]->row_bytes;
    a.seg_alt[i] = ws[i]->type != t1;
  }
  const cudaStream_t st = cs(s);
  if (t2 == t1) {
    with_quant_type(t1, "matvec_multi", [&](auto T) { launch_mvq<decltype(T)::value>(a, 1, st); });
  } else if (t1 == DType::Q4_K && t2 == DType::Q6_K) {
    launch_mvq<DType::Q4_K, DType::Q6_K>(a, 1, st);
  } else if (t1 == DType::Q5_K && t2 == DType::Q6_K) {
    launch_mvq<DType::Q5_K, DType::Q6_K>(a, 1, st);
  } else if (t1 == DType::Q3_K && t2 == DType::Q4_K) {
    launch_mvq<DType::Q3_K, DType::Q4_K>(a, 1, st);
  } else {
    launch_mvq<DType::Q3_K, DType::Q5_K>(a, 1, st);
  }
  launched("matvec_multi");
}

void matvec_experts_glu(const DevMatrix& gate, const DevMatrix& up, const int32_t* ids, const int32_t* slot_of,
                        int n_slots, const void* acts, const int32_t* act_row, float* y, int64_t ld_y, Stream s) {
  if (n_slots <= 0) return;
  if (n_slots > 65535) fail("matvec_experts_glu: too many slots");
  if (!ids || !act_row) fail("matvec_experts_glu: ids and act_row are required");
  launch_matvec(gate, acts, 1, y, ld_y, ids, slot_of, n_slots, act_row, cs(s), "matvec_experts_glu", &up);
}

void matvec_experts_glu_routed(const DevMatrix& gate, const DevMatrix& up, const float* logits, int n_expert, int k,
                               int32_t* ids, float* weights, const int32_t* slot_of, const void* acts, float* y,
                               int64_t ld_y, Stream s) {
  if (n_expert <= 0 || n_expert > kRouteInExpertsMax || k <= 0 || k > 32 || k > n_expert)
    fail("matvec_experts_glu_routed: 1 to 32 of at most " + std::to_string(kRouteInExpertsMax) + " experts");
  if (!logits || !ids || !weights) fail("matvec_experts_glu_routed: logits, ids and weights are required");
  MvArgs a = mv_args(gate, acts, 1, y, ld_y, "matvec_experts_glu_routed");
  check_weight(up, "matvec_experts_glu_routed");
  if (!gate_up_pair(gate, up))
    fail("matvec_experts_glu_routed: gate and up must be quantized matrices of one type and shape");
  if (!slot_of && gate.n_mats < n_expert) fail("matvec_experts_glu_routed: fewer matrices than experts, and no slot_of");
  a.w2 = up.data;
  a.slot_of = slot_of;
  a.route_logits = logits;
  a.route_n = n_expert;
  a.route_k = k;
  a.route_ids = ids;
  a.route_wts = weights;
  const dim3 grid(blocks_for(gate.rows, kMvWarps * 2), static_cast<unsigned>(k));
  const cudaStream_t st = cs(s);
  with_quant_type(gate.type, "matvec_experts_glu_routed",
                  [&](auto T) { launch(mmvq_glu_routed_kernel<decltype(T)::value>, grid, kMvWarps * 32, 0, st, a); });
  launched("matvec_experts_glu_routed");
}

void matvec_experts(const DevMatrix& w, const int32_t* ids, const int32_t* slot_of, int n_slots, const void* acts,
                    const int32_t* act_row, float* y, int64_t ld_y, Stream s) {
  if (n_slots <= 0) return;
  if (n_slots > 65535) fail("matvec_experts: too many slots");
  if (!ids || !act_row) fail("matvec_experts: ids and act_row are required");
  launch_matvec(w, acts, 1, y, ld_y, ids, slot_of, n_slots, act_row, cs(s), "matvec_experts");
}

void matvec_experts_combine(const DevMatrix& w, const int32_t* ids, const int32_t* slot_of, int n_tokens, int k,
                            const void* acts, const float* wts, float* y, int64_t ld_y, Stream s) {
  if (n_tokens <= 0) return;
  if (n_tokens > kMaxVecTokens || k <= 0 || k > 8) fail("matvec_experts_combine: at most 8 tokens and 8 experts each");
  if (!ids || !wts) fail("matvec_experts_combine: ids and wts are required");
  if (is_float_type(w.type)) fail("matvec_experts_combine: quantized experts only");
  MvArgs a = mv_args(w, acts, 1, y, ld_y, "matvec_experts_combine");
  a.ids = ids;
  a.slot_of = slot_of;
  const cudaStream_t st = cs(s);
  // Without a slot map (every expert on the GPU in id order) the chosen rows are staged in shared
  // memory before the wait: the choices are final then, and the rows arrive while the kernel before
  // (g's Q8_K) runs. Measured on the H200, all-GPU decode tg128: 438.4 / 438.6 tok/s against 426.3 /
  // 421.5 (the L2 hint of mmvq_combine_kernel), and with the dense rows staged too 440.7 / 441.8
  // against 424.5 / 427.4.
  constexpr int kStagedRows = 8;
  if (!slot_of && w.rows % kStagedRows == 0 && (kStagedRows * w.row_bytes) % 16 == 0 && w.mat_bytes % 16 == 0 &&
      aligned(w.data, 16) && 8 * kStagedRows * w.row_bytes <= staging_smem(160 * 1024)) {
    const dim3 grid(static_cast<unsigned>(w.rows / kStagedRows), static_cast<unsigned>(n_tokens));
    const size_t stage = kStagedRows * w.row_bytes, smem = 8 * stage;
    with_quant_type(w.type, "matvec_experts_combine", [&](auto T) {
      auto kern = mmvq_combine_staged_kernel<decltype(T)::value, 8, kStagedRows>;
      need_smem(kern, smem, "matvec_experts_combine (staged rows)");
      launch(kern, grid, 8 * 32, smem, st, a, wts, k, static_cast<int>(stage));
    });
    launched("matvec_experts_combine");
    return;
  }
  const dim3 grid(blocks_for(w.rows, kCombineRows), static_cast<unsigned>(n_tokens));
  with_quant_type(w.type, "matvec_experts_combine", [&](auto T) {
    launch(mmvq_combine_kernel<decltype(T)::value, 8>, grid, 8 * 32, 0, st, a, wts, k);
  });
  launched("matvec_experts_combine");
}

void handover_combine(const unsigned* host_flag, const unsigned* epoch, const float* host_rows, const float* ey,
                      const float* ey_host, const int32_t* ids, const int32_t* slot_of, int n_expert,
                      const int32_t* gpu_slots, const float* wts, int k, float* x, int n_tokens, int width, Stream s,
                      unsigned long long* stamp) {
  if (n_tokens <= 0 || width <= 0) return;
  if (n_tokens > 65535) fail("handover_combine: too many tokens");
  if (k <= 0 || k > 32) fail("handover_combine: at most 32 experts per token");
  if (gpu_slots && !ey_host) fail("handover_combine: the GPU's share of the host experts needs ey_host");
  const dim3 grid(blocks_for(width, 256), static_cast<unsigned>(n_tokens));
  const cudaStream_t st = cs(s);
  if (k <= 8)
    launch(handover_combine_kernel<8>, grid, 256, 0, st, host_flag, epoch, host_rows, ey, ey_host, ids, slot_of,
           n_expert, gpu_slots, wts, k, x, width, stamp);
  else
    launch(handover_combine_kernel<32>, grid, 256, 0, st, host_flag, epoch, host_rows, ey, ey_host, ids, slot_of,
           n_expert, gpu_slots, wts, k, x, width, stamp);
  launched("handover_combine");
}

void copy_rows(const float* src, int64_t ld_src, const int32_t* src_rows, float* dst, int64_t ld_dst,
               const int32_t* dst_rows, int n, int width, Stream s) {
  if (n <= 0 || width <= 0) return;
  const cudaStream_t st = cs(s);
  for (int i0 = 0; i0 < n; i0 += 65535) {
    const int ni = std::min(65535, n - i0);
    const dim3 grid(std::min<unsigned>(blocks_for(width, 256), 64u), static_cast<unsigned>(ni));
    copy_rows_kernel<<<grid, 256, 0, st>>>(src_rows ? src : src + i0 * ld_src, ld_src, src_rows ? src_rows + i0 : nullptr,
                                           dst_rows ? dst : dst + i0 * ld_dst, ld_dst, dst_rows ? dst_rows + i0 : nullptr,
                                           width);
  }
  launched("copy_rows");
}

// Scratch of matmul: an f16 (bf16) copy of up to 64 MiB of the matrix's rows -- the space holds the
// dequantized weight tile and the converted activations, in whatever split fits (see plan below).
size_t dequant_scratch_bytes(const DevMatrix& w) {
  if (w.type == DType::F32) return 0;
  const size_t row_b = static_cast<size_t>(w.cols) * 2;
  return align256(static_cast<size_t>(tile_rows(w)) * row_b) + align256(row_b);  // + room for one token
}

size_t matmul_scratch_bytes(const DevMatrix& w, int n_tokens) {
  if (w.type == DType::F32) return 0;
  const size_t row_b = static_cast<size_t>(w.cols) * 2;
  const size_t acts = align256(static_cast<size_t>(std::max(n_tokens, 1)) * row_b);
  if (is_float_type(w.type)) return acts;  // F16 / BF16 weights are used in place
  return acts + static_cast<size_t>(tile_rows(w)) * row_b;
}

void matmul(const DevMatrix& w, int64_t mat, const float* x, int64_t ld_x, int n_tokens, float* y, int64_t ld_y,
            void* scratch, Stream s) {
  matmul(w, mat, x, ld_x, n_tokens, y, ld_y, scratch, dequant_scratch_bytes(w), s);
}

void matmul(const DevMatrix& w, int64_t mat, const float* x, int64_t ld_x, int n_tokens, float* y, int64_t ld_y,
            void* scratch, size_t scratch_bytes, Stream s) {
  if (n_tokens <= 0) return;
  check_weight(w, "matmul");
  if (mat < 0 || mat >= w.n_mats) fail("matmul: matrix index out of range");
  const cudaStream_t st = cs(s);
  cublasHandle_t h = blas_handle();
  blas_ok(cublasSetStream(h, st), "cublasSetStream");
  const uint8_t* base = w.data + static_cast<size_t>(mat) * w.mat_bytes;
  const int64_t rows = w.rows;
  const int k = static_cast<int>(w.cols);
  const float one = 1.0f, zero = 0.0f;
  if (w.type == DType::F32) {
    // SGEMM in f32 (pedantic: no TF32, no reduced-precision tricks)
    blas_ok(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(rows), n_tokens, k, &one, base, CUDA_R_32F, k, x,
                         CUDA_R_32F, static_cast<int>(ld_x), &zero, y, CUDA_R_32F, static_cast<int>(ld_y),
                         CUBLAS_COMPUTE_32F_PEDANTIC, CUBLAS_GEMM_DEFAULT),
            "matmul (f32)");
    launched("matmul");
    return;
  }
  if (!scratch || !aligned(scratch, 16)) fail("matmul: a 16-byte aligned scratch is required");
  uint8_t* sc = static_cast<uint8_t*>(scratch);
  const size_t row_b = static_cast<size_t>(k) * 2;
  const bool bf = w.type == DType::BF16;
  const cudaDataType_t ab_type = bf ? CUDA_R_16BF : CUDA_R_16F;
  const DType act = dtype_info(w.type).act_type;  // the reference's rounding of the activations
  auto convert = [&](int t0, int nc) {
    if (rounds_acts(act)) launch_round_acts(act, x + t0 * ld_x, k, nc, ld_x, reinterpret_cast<__half*>(sc), k, st);
    else if (bf) launch_convert<1>(x + t0 * ld_x, k, nc, ld_x, sc, k, st);
    else launch_convert<0>(x + t0 * ld_x, k, nc, ld_x, sc, k, st);
    launched("matmul (convert)");
  };
  auto gemm = [&](const void* a, int64_t nr, int t0, int nc, int64_t r0) {
    blas_ok(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(nr), nc, k, &one, a, ab_type, k, sc, ab_type, k,
                         &zero, y + t0 * ld_y + r0, CUDA_R_32F, static_cast<int>(ld_y), CUBLAS_COMPUTE_32F,
                         CUBLAS_GEMM_DEFAULT),
            "matmul (gemm)");
  };
  if (is_float_type(w.type)) {
    // F16 / BF16 weights in place; the activations, converted, in token chunks that fit the scratch.
    const int tc = static_cast<int>(std::min<size_t>(n_tokens, scratch_bytes / row_b));
    if (tc < 1) fail("matmul: scratch of " + std::to_string(scratch_bytes) + " bytes is too small");
    for (int t0 = 0; t0 < n_tokens; t0 += tc) {
      const int nc = std::min(tc, n_tokens - t0);
      convert(t0, nc);
      gemm(base, rows, t0, nc, 0);
    }
    launched("matmul");
    return;
  }
  // Quantized: [activations, tc tokens][weight tile, tr rows]. All tokens with the whole matrix (up to
  // 64 MiB) when that fits, else all tokens with as many rows as fit (at least 256), else half-and-half.
  const int64_t rows_t = std::min(rows, tile_rows(w));
  auto rows_fitting = [&](int tc) -> int64_t {
    const size_t a = align256(static_cast<size_t>(tc) * row_b);
    return scratch_bytes > a ? static_cast<int64_t>((scratch_bytes - a) / row_b) : 0;
  };
  int tc = n_tokens;
  if (rows_fitting(tc) < std::min<int64_t>(rows_t, 256)) {
    const int64_t total = static_cast<int64_t>(scratch_bytes / row_b);
    tc = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(n_tokens, total / 2 - 1)));
    if (rows_fitting(tc) < 1) tc = 1;
  }
  const int64_t tr = std::min(rows_t, rows_fitting(tc));
  if (tr < 1) fail("matmul: scratch of " + std::to_string(scratch_bytes) + " bytes is too small");
  __half* wt = reinterpret_cast<__half*>(sc + align256(static_cast<size_t>(tc) * row_b));
  const bool all_tokens = tc >= n_tokens;
  if (all_tokens) convert(0, n_tokens);
  for (int64_t r0 = 0; r0 < rows; r0 += tr) {
    const int64_t nr = std::min(tr, rows - r0);
    launch_dequant<__half>(w.type, base + static_cast<size_t>(r0) * w.row_bytes, w.row_bytes, nr, w.cols, nullptr, 0, wt,
                           w.cols, st);
    launched("matmul (dequantize)");
    for (int t0 = 0; t0 < n_tokens; t0 += tc) {
      const int nc = std::min(tc, n_tokens - t0);
      if (!all_tokens) convert(t0, nc);
      gemm(wt, nr, t0, nc, r0);
    }
  }
  launched("matmul");
}

void qk_norm_rope_store(float* q, int64_t ld_q, const float* k, int64_t ld_k, const float* v, int64_t ld_v,
                        const float* q_norm, const float* k_norm, const DevKv& kv, const int32_t* pos, int n_tokens,
                        int n_head, int n_head_kv, int head_dim, int head_dim_v, int n_rot,
                        const RopeParams& rope_p, float eps, Stream s) {
  if (n_tokens <= 0) return;
  if (n_tokens > 65535) fail("qk_norm_rope_store: too many tokens in one call");
  if (n_rot <= 0 || n_rot % 2 != 0 || n_rot > head_dim) fail("qk_norm_rope_store: bad n_rot " + std::to_string(n_rot));
  const RopeArgs rope = rope_args(rope_p, n_rot);  // as rope_neox
  const size_t smem = static_cast<size_t>(head_dim + n_rot) * sizeof(float);
  const cudaStream_t st = cs(s);
  if (kv.flash) {
    // k normed and roped in place (each CTA reads its head before it writes it), then the store
    // rotates and quantizes both rows.
    const dim3 grid(static_cast<unsigned>(n_head + n_head_kv), static_cast<unsigned>(n_tokens));
    launch(qk_norm_rope_store_kernel<float>, grid, kNormThreads, smem, st, q, ld_q, k, ld_k, v, ld_v, q_norm, k_norm,
           static_cast<float*>(nullptr), static_cast<float*>(nullptr), kv.n_ctx, pos, n_head, n_head_kv, head_dim,
           head_dim_v, n_rot, rope, eps, const_cast<float*>(k));
    launched("qk_norm_rope_store");
    flash_kv_store(kv, false, pos, n_tokens, k, ld_k, v, ld_v, n_head_kv, head_dim, head_dim_v, s);
    return;
  }
  const dim3 grid(static_cast<unsigned>(n_head + 2 * n_head_kv), static_cast<unsigned>(n_tokens));
  if (kv.type == DType::F16)
    launch(qk_norm_rope_store_kernel<__half>, grid, kNormThreads, smem, st,
        q, ld_q, k, ld_k, v, ld_v, q_norm, k_norm, reinterpret_cast<__half*>(kv.k), reinterpret_cast<__half*>(kv.v),
        kv.n_ctx, pos, n_head, n_head_kv, head_dim, head_dim_v, n_rot, rope, eps, static_cast<float*>(nullptr));
  else if (kv.type == DType::F32)
    launch(qk_norm_rope_store_kernel<float>, grid, kNormThreads, smem, st,
        q, ld_q, k, ld_k, v, ld_v, q_norm, k_norm, reinterpret_cast<float*>(kv.k), reinterpret_cast<float*>(kv.v),
        kv.n_ctx, pos, n_head, n_head_kv, head_dim, head_dim_v, n_rot, rope, eps, static_cast<float*>(nullptr));
  else
    fail(std::string("qk_norm_rope_store: unsupported cache type ") + tname(kv.type));
  launched("qk_norm_rope_store");
}

void kv_store(const DevKv& kv, const int32_t* pos, int n_tokens, const float* k, int64_t ld_k, const float* v,
              int64_t ld_v, int n_head_kv, int head_dim, int head_dim_v, Stream s) {
  if (n_tokens <= 0) return;
  if (kv.flash) return flash_kv_store(kv, false, pos, n_tokens, k, ld_k, v, ld_v, n_head_kv, head_dim, head_dim_v, s);
  if (n_tokens > 65535) fail("kv_store: too many tokens in one call");
  const cudaStream_t st = cs(s);
  const int kw = n_head_kv * head_dim, vw = n_head_kv * head_dim_v;
  const dim3 gk(blocks_for(kw, 256), n_tokens);
  const dim3 gv(blocks_for(n_tokens, 32), blocks_for(vw, 8));
  const dim3 bv(32, 8);
  if (kv.type == DType::F16) {
    kv_store_k_kernel<__half><<<gk, 256, 0, st>>>(reinterpret_cast<__half*>(kv.k), pos, k, ld_k, kw);
    kv_store_v_kernel<__half><<<gv, bv, 0, st>>>(reinterpret_cast<__half*>(kv.v), pos, v, ld_v, vw, n_tokens, kv.n_ctx);
  } else if (kv.type == DType::F32) {
    kv_store_k_kernel<float><<<gk, 256, 0, st>>>(reinterpret_cast<float*>(kv.k), pos, k, ld_k, kw);
    kv_store_v_kernel<float><<<gv, bv, 0, st>>>(reinterpret_cast<float*>(kv.v), pos, v, ld_v, vw, n_tokens, kv.n_ctx);
  } else {
    fail(std::string("kv_store: unsupported cache type ") + tname(kv.type));
  }
  launched("kv_store");
}

int attention_decode_variant(int n_keys) { return n_keys <= kShortKeys ? 0 : 1; }

// Enough for any call with up to n_tokens queries: only calls of <= kDecodeMaxTokens use scratch (both
// decode kernels), and its size grows with the token count.

size_t attention_scratch_bytes(int n_tokens, int n_kv_max, int n_head, int head_dim_v) {
  if (n_tokens <= 0) return 0;
  return decode_layout(std::min(n_tokens, kDecodeMaxTokens), n_kv_max, n_head, head_dim_v).total;
}

bool attention(const float* q, int64_t ld_q, const DevKv& kv, int pos0, const int32_t* pos_dev, int n_tokens,
               int n_kv_max, int n_head, int n_head_kv, int head_dim, int head_dim_v, float scale, float* out,
               int64_t ld_out, void* scratch, size_t scratch_bytes, Stream s, void* out_q) {
  if (n_tokens <= 0) return false;
  if (kv.flash) {
    if (!pos_dev) fail("attention: a flash-attention cache needs the positions on the device");
    flash_attention(q, ld_q, kv, false, 0, pos_dev, n_tokens, n_kv_max, n_head, n_head_kv, head_dim, head_dim_v, scale,
                    out, ld_out, scratch, scratch_bytes, s);
    return false;
  }
  if (n_head_kv <= 0 || n_head % n_head_kv != 0) fail("attention: n_head must be a multiple of n_head_kv");
  if (head_dim % 8 != 0 || head_dim > 256 || head_dim_v <= 0 || head_dim_v > 256)
    fail("attention: head sizes must be multiples of 8 up to 256 (K: " + std::to_string(head_dim) +
         ", V: " + std::to_string(head_dim_v) + ")");
  if (kv.type != DType::F16 && kv.type != DType::F32)
    fail(std::string("attention: unsupported cache type ") + tname(kv.type));
  if (n_tokens > kDecodeMaxTokens && n_tokens * (n_head / n_head_kv) > 65535 * kPTQ) fail("attention: batch too large");
  AttnArgs a{};
  a.q = q;
  a.ld_q = ld_q;
  a.k = kv.k;
  a.v = kv.v;
  a.n_ctx = kv.n_ctx;
  a.pos0 = pos0;
  a.pos_dev = pos_dev;
  a.n_tokens = n_tokens;
  a.n_head = n_head;
  a.n_head_kv = n_head_kv;
  a.group = n_head / n_head_kv;
  a.hd = head_dim;
  a.hdp = (head_dim + 15) / 16 * 16;
  a.hdv = head_dim_v;
  a.scale = scale;
  a.out = out;
  a.ld_out = ld_out;
  // Keys: up to pos0 + n_tokens; a graph-captured call (pos_dev) sizes itself by n_kv_max.
  a.keys_max = pos_dev ? n_kv_max : pos0 + n_tokens;
  if (a.keys_max <= 0) fail("attention: n_kv_max must be positive when positions come from the device");
  if (a.keys_max > kv.n_ctx) fail("attention: more keys than the cache holds");
  a.out_q = static_cast<uint8_t*>(out_q);
  const cudaStream_t st = cs(s);
  if (kv.type == DType::F16) return launch_attention<__half>(a, scratch, scratch_bytes, st);
  return launch_attention<float>(a, scratch, scratch_bytes, st);
}

void route_topk(const float* logits, int n_tokens, int n_expert, int k, int32_t* ids, float* weights, Stream s) {
  if (n_tokens <= 0) return;
  if (k <= 0 || k > n_expert || k > 32) fail("route_topk: bad k (at most 32 experts per token)");
  const size_t smem = static_cast<size_t>(n_expert) * sizeof(float);
  if (smem > 48 * 1024) fail("route_topk: too many experts");
  launch(route_topk_kernel, n_tokens, 32, smem, cs(s), logits, n_expert, k, ids, weights);
  launched("route_topk");
}

bool router_topk(const DevMatrix& router, const float* x, int n_tokens, float* logits, int k, int32_t* ids,
                 float* weights, unsigned* done, Stream s, const RoutePublish& pub) {
  if (router.type != DType::F32 || router.n_mats != 1 || router.rows > 512 || n_tokens < 1 ||
      n_tokens > kMaxVecTokens)
    return false;
  if (k <= 0 || k > router.rows || k > 32) fail("router_topk: bad k (at most 32 experts per token)");
  const MvArgs a = mv_args(router, x, n_tokens, logits, router.rows, "router_topk");
  const bool vec = aligned(router.data, 16) && router.row_bytes % 16 == 0 && aligned(x, 16) && a.act_stride % 16 == 0;
  const size_t smem = static_cast<size_t>(kMvWarps) * router.rows * sizeof(float);
  const dim3 grid(static_cast<unsigned>(router.rows));
  const cudaStream_t st = cs(s);
  if (pub.flag && (!pub.ids || !pub.epoch)) fail("router_topk: a publication needs ids, flag and epoch");
  if (pub.flag && pub.gpu_share > 0 &&
      (pub.k != k || pub.n_expert != router.rows || !pub.slot_of || !pub.gpu_slots || !pub.host_gpu_slots))
    fail("router_topk: a GPU share needs k, slot_of and both slot tables");
  auto go = [&](auto kernel) { launch(kernel, grid, kMvWarps * 32, smem, st, a, k, ids, weights, done, pub); };
  if (n_tokens <= 1) vec ? go(router_topk_kernel<1, true>) : go(router_topk_kernel<1, false>);
  else if (n_tokens <= 2) vec ? go(router_topk_kernel<2, true>) : go(router_topk_kernel<2, false>);
  else if (n_tokens <= 4) vec ? go(router_topk_kernel<4, true>) : go(router_topk_kernel<4, false>);
  else vec ? go(router_topk_kernel<8, true>) : go(router_topk_kernel<8, false>);
  launched("router_topk");
  return true;
}

bool matvec_weight_ok(const DevMatrix& w) {
  try {
    check_weight(w, "matvec_weight_ok");
    return true;
  } catch (const Error&) {
    return false;
  }
}

void publish_route(const RoutePublish& pub, const int32_t* ids, int n_ids, const float* x, int64_t n_x, Stream s) {
  if (!pub.flag || !pub.ids || !pub.x || !pub.epoch) fail("publish_route: ids, x, flag and epoch are required");
  if (pub.gpu_share > 0 &&
      (pub.k <= 0 || n_ids % pub.k || pub.n_expert <= 0 || !pub.slot_of || !pub.gpu_slots || !pub.host_gpu_slots))
    fail("publish_route: a GPU share needs k, slot_of and both slot tables");
  launch(publish_route_kernel, dim3(1), 256, 0, cs(s), pub, ids, n_ids, x, n_x);
  launched("publish_route");
}

void moe_combine(const float* y, const float* weights, int n_tokens, int k, int n, float* out, Stream s) {
  if (n_tokens <= 0 || n <= 0) return;
  if (n_tokens > 65535) fail("moe_combine: too many tokens");
  launch(moe_combine_kernel, dim3(blocks_for(n, 256), n_tokens), 256, 0, cs(s), y, weights, k, n, out);
  launched("moe_combine");
}

}  // namespace fitmoe::gpu
