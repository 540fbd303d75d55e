// Grouped expert products for prefill (gpu::moe_matmul, gpu::moe_matmul_swiglu in gpu_ops.h): every
// routed expert of a layer in one launch per weight matrix (one for gate+up with the SwiGLU fused).
//
// Work decomposition. The slots of the micro-batch are sorted by expert (offsets[e] .. offsets[e+1]).
// The grid is (weight row tiles) x (work items); work item j is the j-th (expert, token tile) pair of
// the device-resident experts in expert order. Every CTA finds its pair itself from `offsets` (it loads
// 256 experts' offsets at once, warp 0 scans their tile counts in shared memory), so no host round trip
// and no scratch are needed and the launch can be captured in a CUDA graph. The grid's y extent is an upper bound
// (ceil(n_slots_max / BN) + min(n_experts, n_slots_max)); CTAs past the last item exit at once.
// blockIdx.x (row tiles) varies fastest, so the CTAs sharing one token tile run together and read its
// activations from L2.
//
// Tensor-core kernel (moe_tc_kernel, sm_70+; bf16 weights sm_80+): a CTA of 8 warps computes a tile of
// 128 weight rows x BN tokens (BN = 64 or 128) over K steps of 64 values:
//   - each thread decodes one 32-value part of the weight tile per step with the same block decoders
//     as gpu::matmul's dequantize kernel (blocks.cuh: WT<T>::decode + deq_part, bit-exact with
//     quant::dequantize_row_ref) and rounds it to f16 (round to nearest) into shared memory; F16 / BF16
//     weights are copied as they are;
//   - the tokens' activation rows (gathered through `rows`) are rounded to f16 (bf16 for BF16 weights)
//     into shared memory;
//   - nvcuda::wmma 16x16x16 products, f32 accumulation. Shared tiles are double-buffered, one barrier
//     per step: before step k's products each thread issues its loads for step k+1, decodes its weight
//     part into registers and converts its activations into the other buffer; after the products it
//     expands the weight part to f16 into the other buffer. Latency is hidden mostly by the other
//     CTAs on the SM (BN = 128: 2 CTAs of <= 128 registers, ~78 KiB shared memory each; BN = 64: 3 CTAs
//     of <= 80 registers, ~59 KiB each, on sm_80 / sm_90 class parts).
//   - warp layout: 4 (rows) x 2 (tokens); warp (wm, wn) owns tile rows [16wm, 16wm+16) and
//     [64+16wm, 64+16wm+16) and tokens [wn*BN/2, (wn+1)*BN/2). Token fragments past the tile's valid
//     tokens are skipped.
//   - fused SwiGLU: the 128-row weight tile is 64 gate rows over the same 64 up rows, so each warp
//     holds the gate and the up accumulators of the same outputs in fragments of the same type and
//     forms silu(g) * u element by element, exactly as swiglu_kernel does (expf, IEEE division).
// CUDA-core kernel (moe_simt_kernel): the same work decomposition with f32 shared tiles and f32 FMAs;
// used for F32 weights (exact f32 products, as matmul's pedantic SGEMM), for BF16 weights below sm_80
// and for everything below sm_70. The operands are rounded exactly as on the tensor-core path.
//
// Which kernel a device runs is decided from the PTX version the loaded kernel was compiled for
// (cudaFuncGetAttributes), not from the device's compute capability: a binary without a matching cubin
// JIT-compiles an older PTX whose tensor-core body may be compiled out.
//
// Numerics: as gpu::matmul (weights dequantized exactly, rounded to f16; activations rounded to f16,
// bf16 for BF16 weights, f32 for F32 weights; f32 accumulation); only the summation order differs.
// Like gpu_ops.cu this file must NOT be compiled with --use_fast_math.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <algorithm>
#include <string>
#include <type_traits>

#include "cuda/blocks.cuh"
#include "cuda/kernel_util.h"
#include "cuda/gpu_ops.h"
#include "runtime/error.h"

namespace fitmoe::gpu {
namespace {

// ================================ host-side helpers ===============================================

[[noreturn]] void moe_fail(const std::string& what) { throw Error(what); }

void moe_cuda_ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) moe_fail(std::string("CUDA error in ") + what + ": " + cudaGetErrorString(e));
}

bool moe_aligned(const void* p, size_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }

// ================================ shared pieces ===================================================

constexpr int kThreads = 256;  // 8 warps per CTA, both kernels
constexpr int kBM = 128;       // weight rows per tile (fused: 64 gate rows over 64 up rows)

struct MoeArgs {
  const uint8_t* w0;  // the matrix stack (fused: gate)
  const uint8_t* w1;  // fused: up (same geometry as w0)
  size_t row_bytes, mat_bytes;
  int64_t rows, cols, n_mats;
  const int32_t* offsets;
  int n_experts;
  const int32_t* slot_of;
  const float* x;
  int64_t ld_x;
  const int32_t* xrows;
  float* y;
  int64_t ld_y;
  const int32_t* yrows;  // output row of slot i (null: i)
  int y_base;     // work item of blockIdx.y == 0 (grids taller than 65535 go in several launches)
  bool x_vec;     // x rows may be read as float4 (x 16-byte aligned, ld_x % 4 == 0)
  bool w_vec;     // F16 / BF16 / F32 rows may be read as uint4 (data, row and matrix strides 16-aligned)
};

struct Work {
  int mat;  // device matrix, -1: no work
  int i0;   // first slot of the token tile
  int nv;   // valid tokens in the tile (1..BN)
};

// The (matrix, token tile) of this CTA's work item. The CTA reads the experts' offsets 256 at a time
// (one load each, all in flight together); warp 0 scans their tile counts (only experts with a device
// matrix count) from shared memory. Every thread gets the answer.
template <int BN>
__device__ __forceinline__ Work find_work(const MoeArgs& a) {
  __shared__ Work s_work;
  __shared__ int s_cnt[kThreads], s_m[kThreads], s_beg[kThreads];
  __shared__ int s_done;
  const int tid = threadIdx.x, lane = tid & 31;
  const int j = a.y_base + static_cast<int>(blockIdx.y);
  if (tid == 0) {
    s_work.mat = -1;
    s_done = 0;
  }
  int base = 0;  // (warp 0) tiles of the experts before the current 32
  for (int e0 = 0; e0 < a.n_experts; e0 += kThreads) {
    const int e = e0 + tid;
    int m = -1, beg = 0, cnt = 0;
    if (e < a.n_experts) {
      m = a.slot_of ? a.slot_of[e] : e;
      beg = a.offsets[e];
      cnt = a.offsets[e + 1] - beg;
      if (m < 0 || m >= a.n_mats || cnt < 0) cnt = 0;
    }
    s_cnt[tid] = cnt;
    s_m[tid] = m;
    s_beg[tid] = beg;
    __syncthreads();
    if (tid < 32) {
      for (int c = 0; c < kThreads / 32; ++c) {
        const int q = 32 * c + lane;
        const int t = (s_cnt[q] + BN - 1) / BN;
        int incl = t;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
          const int v = __shfl_up_sync(kFull, incl, o);
          if (lane >= o) incl += v;
        }
        const int excl = incl - t;
        const bool mine = t > 0 && j >= base + excl && j < base + incl;
        if (__ballot_sync(kFull, mine)) {
          if (mine) {
            const int tile = j - base - excl;
            s_work.mat = s_m[q];
            s_work.i0 = s_beg[q] + tile * BN;
            s_work.nv = min(BN, s_cnt[q] - tile * BN);
            s_done = 1;
          }
          break;
        }
        base += __shfl_sync(kFull, incl, 31);
      }
    }
    __syncthreads();
    if (s_done) break;
  }
  __syncthreads();  // (also when there are no experts at all)
  return s_work;
}

// Weight row `r` of tile row `tr` (fused: tile rows 0..63 gate, 64..127 up), nullptr past the matrix.
template <bool FUSED>
__device__ __forceinline__ const uint8_t* tile_row(const MoeArgs& a, int mat, int tr) {
  int64_t r;
  const uint8_t* base;
  if constexpr (FUSED) {
    r = static_cast<int64_t>(blockIdx.x) * (kBM / 2) + (tr & (kBM / 2 - 1));
    base = tr < kBM / 2 ? a.w0 : a.w1;
  } else {
    r = static_cast<int64_t>(blockIdx.x) * kBM + tr;
    base = a.w0;
  }
  if (r >= a.rows) return nullptr;
  return base + static_cast<size_t>(mat) * a.mat_bytes + static_cast<size_t>(r) * a.row_bytes;
}

// As swiglu_kernel: silu(g) * u with expf and IEEE division.
__device__ __forceinline__ float silu_mul(float g, float u) {
  return __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))), u);
}

__device__ __forceinline__ float round_f16(float v) { return __half2float(__float2half_rn(v)); }
__device__ __forceinline__ float round_bf16(float v) { return bf2f(f2bf_bits(v)); }

template <DType T>
constexpr bool is_quant() {
  return T != DType::F32 && T != DType::F16 && T != DType::BF16;
}

// ================================ tensor-core kernel ==============================================

constexpr int kTcBK = 64;            // values of K per step
constexpr int kTcBKP = kTcBK + 8;    // padded shared row (halves): conflict-free fragment loads

template <int BN>
constexpr size_t tc_smem_bytes() {
  return (2 * static_cast<size_t>(kBM) * kTcBKP + 2 * static_cast<size_t>(BN) * kTcBKP) * 2 + 2 * BN * sizeof(int);
}

// The tensor-core path needs sm_70 (f16) / sm_80 (bf16); below that the kernel is never launched.
template <DType T>
constexpr int tc_min_arch() {
  return T == DType::BF16 ? 800 : 700;
}

// One 32-value part of weights, between its load and its store to shared memory.
template <DType T>
struct WFetch {
  WPart p;  // quantized: the decoded part (codes and scales)
};
template <>
struct WFetch<DType::F16> {
  uint4 v[4];
};
template <>
struct WFetch<DType::BF16> {
  uint4 v[4];
};

// Loads part (row, value k) -- row == nullptr or k past the row: anything (store() writes zeros).
template <DType T>
__device__ __forceinline__ void w_fetch(const MoeArgs& a, const uint8_t* row, int64_t k, bool ok, WFetch<T>& f) {
  if constexpr (is_quant<T>()) {
    using W = WT<T>;
    constexpr int P = W::kQK / 32;
    // Branch-free: a part that is not there decodes row 0's first block of the stack (always valid)
    // and is zeroed when stored.
    const uint8_t* b = ok ? row + (k / W::kQK) * W::kBytes : a.w0;
    W::decode(b, ok ? static_cast<int>((k / 32) % P) : 0, f.p);
  } else {
    const uint8_t* p = ok ? row + k * 2 : a.w0;
    if (a.w_vec) {
      const uint4* q = reinterpret_cast<const uint4*>(p);
#pragma unroll
      for (int i = 0; i < 4; ++i) f.v[i] = __ldg(q + i);
    } else {
      uint32_t u[16];
#pragma unroll
      for (int i = 0; i < 16; ++i) u[i] = ld_u16(p + 4 * i) | (ld_u16(p + 4 * i + 2) << 16);
#pragma unroll
      for (int i = 0; i < 4; ++i) f.v[i] = make_uint4(u[4 * i], u[4 * i + 1], u[4 * i + 2], u[4 * i + 3]);
    }
  }
}

// Stores the part as 32 f16 (bf16) values at dst (16-byte aligned), zeros when !ok.
template <DType T>
__device__ __forceinline__ void w_store(const WFetch<T>& f, bool ok, uint8_t* dst) {
  uint4 out[4];
  if constexpr (is_quant<T>()) {
    float v[32];
    deq_part<T>(f.p, v);
    uint32_t h[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) h[i] = f2h_bits(v[2 * i]) | (static_cast<uint32_t>(f2h_bits(v[2 * i + 1])) << 16);
#pragma unroll
    for (int i = 0; i < 4; ++i) out[i] = make_uint4(h[4 * i], h[4 * i + 1], h[4 * i + 2], h[4 * i + 3]);
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) out[i] = f.v[i];
  }
  uint4* d = reinterpret_cast<uint4*>(dst);
#pragma unroll
  for (int i = 0; i < 4; ++i) d[i] = ok ? out[i] : make_uint4(0, 0, 0, 0);
}

// Four activations -> four f16 (bf16) values packed in a uint2.
template <bool BF>
__device__ __forceinline__ uint2 pack4(float4 v) {
  if constexpr (BF) {
    return make_uint2(f2bf_bits(v.x) | (static_cast<uint32_t>(f2bf_bits(v.y)) << 16),
                      f2bf_bits(v.z) | (static_cast<uint32_t>(f2bf_bits(v.w)) << 16));
  } else {
    return make_uint2(f2h_bits(v.x) | (static_cast<uint32_t>(f2h_bits(v.y)) << 16),
                      f2h_bits(v.z) | (static_cast<uint32_t>(f2h_bits(v.w)) << 16));
  }
}

// (wmma exists from sm_70 on; the host compilation pass sees every declaration.)
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 700
template <DType T, int BN, bool FUSED>
__device__ __forceinline__ void tc_body(const MoeArgs& a) {
  namespace wmma = nvcuda::wmma;
  using E = std::conditional_t<T == DType::BF16, __nv_bfloat16, __half>;
  constexpr bool kBF = T == DType::BF16;
  constexpr int BK = kTcBK, BKP = kTcBKP;
  constexpr int NJ = BN / 32;              // token fragments per warp
  constexpr int NXV = BN * BK / 4 / kThreads;  // float4 activation loads per thread per step
  static_assert(kBM * BK / 32 == kThreads, "one weight part per thread and step");
  static_assert(NXV * kThreads * 4 == BN * BK, "activation tile split");

  const Work wk = find_work<BN>(a);
  if (wk.mat < 0) return;

  extern __shared__ __align__(128) uint8_t smem[];
  E* Ws = reinterpret_cast<E*>(smem);          // [2][kBM][BKP]
  E* Xs = Ws + 2 * kBM * BKP;                  // [2][BN][BKP]
  int* s_src = reinterpret_cast<int*>(Xs + 2 * BN * BKP);  // [BN] activation row, -1: none
  int* s_dst = s_src + BN;                                  // [BN] output row

  const int tid = threadIdx.x;
  for (int n = tid; n < BN; n += kThreads) {
    int src = -1, dst = 0;
    if (n < wk.nv) {
      src = a.xrows ? a.xrows[wk.i0 + n] : wk.i0 + n;
      dst = a.yrows ? a.yrows[wk.i0 + n] : wk.i0 + n;
    }
    s_src[n] = src;
    s_dst[n] = dst;
  }
  __syncthreads();

  // This thread's weight part: tile row tid / 2, values [32 * (tid % 2), +32) of every step.
  const int wtr = tid >> 1, wq = tid & 1;
  const uint8_t* wrow = tile_row<FUSED>(a, wk.mat, wtr);
  uint8_t* wdst0 = reinterpret_cast<uint8_t*>(Ws + wtr * BKP + 32 * wq);
  constexpr int kWBuf = kBM * BKP * 2;  // bytes per weight buffer

  // This thread's activation vectors: token (tid + 256 s) / 16, values 4 * ((tid + 256 s) % 16).
  const int64_t cols = a.cols;
  const int nsteps = static_cast<int>((cols + BK - 1) / BK);

  float4 xv[NXV];
  auto x_fetch = [&](int step) {
#pragma unroll
    for (int s = 0; s < NXV; ++s) {
      const int idx = tid + kThreads * s;
      const int n = idx >> 4;
      const int64_t k = static_cast<int64_t>(step) * BK + 4 * (idx & 15);
      const int src = s_src[n];
      const bool ok = src >= 0 && k < cols;
      const float* p = a.x + static_cast<int64_t>(ok ? src : 0) * a.ld_x + (ok ? k : 0);
      if (a.x_vec) {
        xv[s] = ok ? __ldg(reinterpret_cast<const float4*>(p)) : make_float4(0.f, 0.f, 0.f, 0.f);
      } else {
        xv[s] = ok ? make_float4(__ldg(p), __ldg(p + 1), __ldg(p + 2), __ldg(p + 3)) : make_float4(0.f, 0.f, 0.f, 0.f);
      }
    }
  };
  auto x_store = [&](int buf) {
#pragma unroll
    for (int s = 0; s < NXV; ++s) {
      const int idx = tid + kThreads * s;
      const int n = idx >> 4, c = idx & 15;
      *reinterpret_cast<uint2*>(Xs + buf * BN * BKP + n * BKP + 4 * c) = pack4<kBF>(xv[s]);
    }
  };

  WFetch<T> wf;
  bool wok = false;
  auto w_load = [&](int step) {
    const int64_t k = static_cast<int64_t>(step) * BK + 32 * wq;
    wok = wrow != nullptr && k < cols;
    w_fetch<T>(a, wrow, k, wok, wf);
  };

  const int warp = tid >> 5, wm = warp & 3, wn = warp >> 2;
  const int n_warp0 = wn * (BN / 2);
  // Token fragments of this warp holding at least one valid token.
  const int nj_act = min(NJ, max(0, (wk.nv - n_warp0 + 15) / 16));

  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][NJ];
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < NJ; ++j) wmma::fill_fragment(acc[i][j], 0.0f);

  // Prologue: step 0 into buffer 0.
  x_fetch(0);
  w_load(0);
  w_store<T>(wf, wok, wdst0);
  x_store(0);
  __syncthreads();

  for (int step = 0; step < nsteps; ++step) {
    const int buf = step & 1;
    const bool more = step + 1 < nsteps;
    // The next step's operands: loads issued together, the weight parts decoded (codes and scales held
    // in registers), the activations converted into the other buffer (that frees their registers
    // before the products) ...
    if (more) {
      x_fetch(step + 1);
      w_load(step + 1);
      x_store(buf ^ 1);
    }
    if (nj_act > 0) {
      const E* Wb = Ws + buf * kBM * BKP;
      const E* Xb = Xs + buf * BN * BKP;
#pragma unroll
      for (int kk = 0; kk < BK / 16; ++kk) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, E, wmma::row_major> a0, a1;
        wmma::load_matrix_sync(a0, Wb + (wm * 16) * BKP + kk * 16, BKP);
        wmma::load_matrix_sync(a1, Wb + (kBM / 2 + wm * 16) * BKP + kk * 16, BKP);
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
          if (j < nj_act) {
            wmma::fragment<wmma::matrix_b, 16, 16, 16, E, wmma::col_major> bf;
            wmma::load_matrix_sync(bf, Xb + (n_warp0 + 16 * j) * BKP + kk * 16, BKP);
            wmma::mma_sync(acc[0][j], a0, bf, acc[0][j]);
            wmma::mma_sync(acc[1][j], a1, bf, acc[1][j]);
          }
        }
      }
    }
    // ... and the weights expanded to f16 into the other buffer after them.
    if (more) w_store<T>(wf, wok, wdst0 + (buf ^ 1) * kWBuf);
    __syncthreads();
  }

  // Epilogue: each warp stages one 16x16 fragment at a time (column-major: token-major, as y) in its
  // own 1 KiB of the (now idle) weight buffers and writes it out with row bounds.
  if (nj_act == 0) return;
  float* stage = reinterpret_cast<float*>(smem) + warp * 256;
  const int lane = tid & 31, m = lane & 15, nn0 = lane >> 4;
  auto write_frag = [&](int64_t row0, int nbase) {
    __syncwarp();
    const int64_t r = row0 + m;
    if (r < a.rows) {
      for (int nn = nn0; nn < 16; nn += 2) {
        const int n = nbase + nn;
        if (n < wk.nv) a.y[static_cast<int64_t>(s_dst[n]) * a.ld_y + r] = stage[nn * 16 + m];
      }
    }
    __syncwarp();
  };
#pragma unroll
  for (int j = 0; j < NJ; ++j) {
    if (j >= nj_act) continue;
    const int nbase = n_warp0 + 16 * j;
    if constexpr (FUSED) {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> h;
#pragma unroll
      for (int e = 0; e < h.num_elements; ++e) h.x[e] = silu_mul(acc[0][j].x[e], acc[1][j].x[e]);
      wmma::store_matrix_sync(stage, h, 16, wmma::mem_col_major);
      write_frag(static_cast<int64_t>(blockIdx.x) * (kBM / 2) + wm * 16, nbase);
    } else {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        wmma::store_matrix_sync(stage, acc[i][j], 16, wmma::mem_col_major);
        write_frag(static_cast<int64_t>(blockIdx.x) * kBM + i * (kBM / 2) + wm * 16, nbase);
      }
    }
  }
}
#endif

// CTAs per SM the 128-token kernel is compiled for: 2 caps it at 128 registers (a few dozen bytes of
// spills), 1 lets it use ~170 registers without spills but leaves one CTA per SM to hide latencies.
// A tuning knob for the benchmark (tests/gpu/test_moe_gemm.cpp, DISABLED_MoeGemmBench).
#ifndef FITMOE_MOE_TC128_CTAS
#define FITMOE_MOE_TC128_CTAS 2
#endif

// The body only where the tensor cores take the type; elsewhere the host never launches this kernel
// (it checks the PTX version, see launch_typed) and the stub traps.
template <DType T, int BN, bool FUSED>
__global__ void __launch_bounds__(kThreads, BN == 128 ? FITMOE_MOE_TC128_CTAS : 3) moe_tc_kernel(const MoeArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  tc_body<T, BN, FUSED>(a);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
  if constexpr (T == DType::BF16) __trap();
  else tc_body<T, BN, FUSED>(a);
#else
  __trap();
#endif
}

// ================================ CUDA-core kernel ================================================

constexpr int kSBN = 64;  // tokens per tile
constexpr int kSBK = 32;  // values of K per step (one part)

template <DType T>
__device__ __forceinline__ float s_round_act(float v) {
  if constexpr (T == DType::F32) return v;
  else if constexpr (T == DType::BF16) return round_bf16(v);
  else return round_f16(v);
}

// Thread (tr = lane, tt = warp) owns tile rows tr + 32 i (i < 4) and tokens tt + 8 j (j < 8).
template <DType T, bool FUSED>
__global__ void __launch_bounds__(kThreads) moe_simt_kernel(const MoeArgs a) {
  __shared__ float Ws[kBM][kSBK + 1];
  __shared__ float Xs[kSBN][kSBK + 1];
  __shared__ int s_src[kSBN];

  const Work wk = find_work<kSBN>(a);
  if (wk.mat < 0) return;
  const int tid = threadIdx.x;
  if (tid < kSBN) s_src[tid] = tid < wk.nv ? (a.xrows ? a.xrows[wk.i0 + tid] : wk.i0 + tid) : -1;

  const uint8_t* wrow = tid < kBM ? tile_row<FUSED>(a, wk.mat, tid) : nullptr;
  const int tr = tid & 31, tt = tid >> 5;
  float acc[4][8];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[i][j] = 0.0f;

  for (int64_t k0 = 0; k0 < a.cols; k0 += kSBK) {
    __syncthreads();  // s_src ready (first step); the previous step's products done (later steps)
    if (tid < kBM) {
      float v[32];
      if (wrow) {
        if constexpr (is_quant<T>()) {
          using W = WT<T>;
          WPart p;
          W::decode(wrow + (k0 / W::kQK) * W::kBytes, static_cast<int>((k0 / 32) % (W::kQK / 32)), p);
          deq_part<T>(p, v);
#pragma unroll
          for (int i = 0; i < 32; ++i) v[i] = round_f16(v[i]);
        } else if constexpr (T == DType::F32) {
          const float* p = reinterpret_cast<const float*>(wrow) + k0;
          if (a.w_vec) {
#pragma unroll
            for (int i = 0; i < 8; ++i) {
              const float4 q = __ldg(reinterpret_cast<const float4*>(p) + i);
              v[4 * i] = q.x, v[4 * i + 1] = q.y, v[4 * i + 2] = q.z, v[4 * i + 3] = q.w;
            }
          } else {
#pragma unroll
            for (int i = 0; i < 32; ++i) v[i] = __ldg(p + i);
          }
        } else {
          const uint8_t* p = wrow + k0 * 2;
#pragma unroll
          for (int i = 0; i < 32; ++i) v[i] = T == DType::BF16 ? bf2f(ld_u16(p + 2 * i)) : h2f(ld_u16(p + 2 * i));
        }
      } else {
#pragma unroll
        for (int i = 0; i < 32; ++i) v[i] = 0.0f;
      }
#pragma unroll
      for (int i = 0; i < 32; ++i) Ws[tid][i] = v[i];
    }
#pragma unroll
    for (int s = 0; s < kSBN * kSBK / kThreads; ++s) {
      const int idx = tid + kThreads * s;
      const int n = idx / kSBK, c = idx % kSBK;
      const int src = s_src[n];
      Xs[n][c] = src >= 0 ? s_round_act<T>(a.x[static_cast<int64_t>(src) * a.ld_x + k0 + c]) : 0.0f;
    }
    __syncthreads();
#pragma unroll 4
    for (int c = 0; c < kSBK; ++c) {
      float wv[4], xv[8];
#pragma unroll
      for (int i = 0; i < 4; ++i) wv[i] = Ws[tr + 32 * i][c];
#pragma unroll
      for (int j = 0; j < 8; ++j) xv[j] = Xs[tt + 8 * j][c];
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][j] = __fmaf_rn(wv[i], xv[j], acc[i][j]);
    }
  }

#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int n = tt + 8 * j;
    if (n >= wk.nv) continue;
    float* yrow = a.y + static_cast<int64_t>(a.yrows ? a.yrows[wk.i0 + n] : wk.i0 + n) * a.ld_y;
    if constexpr (FUSED) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int64_t r = static_cast<int64_t>(blockIdx.x) * (kBM / 2) + tr + 32 * i;
        if (r < a.rows) yrow[r] = silu_mul(acc[i][j], acc[i + 2][j]);
      }
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int64_t r = static_cast<int64_t>(blockIdx.x) * kBM + tr + 32 * i;
        if (r < a.rows) yrow[r] = acc[i][j];
      }
    }
  }
}

// ================================ launch ==========================================================

using KernelFn = void (*)(MoeArgs);

// Natural alignment of the type's blocks (the decoders' widest loads), as gpu_ops.cu's weight_align.
int moe_weight_align(DType t) {
  switch (t) {
    case DType::Q4_K: case DType::Q5_K:
      return 16;
    case DType::Q4_1: case DType::Q5_1: case DType::Q2_K: case DType::IQ4_XS: case DType::F32:
      return 4;
    default:
      return 2;
  }
}

void check_moe_weight(const DevMatrix& w, const char* what) {
  switch (w.type) {
    case DType::F32: case DType::F16: case DType::BF16: case DType::Q4_0: case DType::Q4_1: case DType::Q5_0:
    case DType::Q5_1: case DType::Q8_0: case DType::Q2_K: case DType::Q3_K: case DType::Q4_K: case DType::Q5_K:
    case DType::Q6_K: case DType::IQ4_NL: case DType::IQ4_XS:
      break;
    default: {
      const DTypeInfo* info = dtype_info(static_cast<uint32_t>(w.type));
      moe_fail(std::string(what) + ": unsupported weight type " + (info ? info->name : "?"));
    }
  }
  const DTypeInfo& info = dtype_info(w.type);
  if (w.cols <= 0 || w.rows <= 0 || w.n_mats <= 0) moe_fail(std::string(what) + ": empty matrix");
  if (w.cols % 32 != 0 || w.cols % info.block_size != 0)
    moe_fail(std::string(what) + ": row length " + std::to_string(w.cols) + " is not a multiple of 32 and of the " +
             info.name + " block size");
  if (w.row_bytes != row_bytes(w.type, w.cols)) moe_fail(std::string(what) + ": row_bytes does not match the type");
  if (w.n_mats > 1 && w.mat_bytes < w.row_bytes * static_cast<size_t>(w.rows))
    moe_fail(std::string(what) + ": mat_bytes smaller than a matrix");
  if (!w.data) moe_fail(std::string(what) + ": no weight data");
  const size_t al = static_cast<size_t>(moe_weight_align(w.type));
  if (!moe_aligned(w.data, al) || w.row_bytes % al != 0 || (w.n_mats > 1 && w.mat_bytes % al != 0))
    moe_fail(std::string(what) + ": " + info.name + " weights must be " + std::to_string(al) + "-byte aligned");
}

template <DType T, bool FUSED>
KernelFn tc_kernel(int bn) {
  if constexpr (T == DType::F32) {
    return nullptr;
  } else {
    return bn == 128 ? moe_tc_kernel<T, 128, FUSED> : moe_tc_kernel<T, 64, FUSED>;
  }
}

template <DType T, bool FUSED>
void launch_typed(const MoeArgs& base, int n_slots_max, int tile, cudaStream_t st, const char* what) {
  const int64_t out_rows_per_tile = FUSED ? kBM / 2 : kBM;
  const int64_t gx = (base.rows + out_rows_per_tile - 1) / out_rows_per_tile;
  if (gx > 0x7fffffff) moe_fail(std::string(what) + ": too many rows");

  // Kernel choice: the tensor-core kernel when its PTX (the code the device actually runs) has the
  // instructions, else the CUDA-core kernel.
  KernelFn fn = nullptr;
  int bn = kSBN;
  size_t smem = 0;
  if (T != DType::F32 && tile != -1) {
    bn = tile == 64 || tile == 128 ? tile : 0;
    if (bn == 0) {
      // Larger token tiles halve the weight decoding per token but waste more on partial tiles and need
      // ~74 KiB of shared memory (two CTAs per SM only on sm_80 / sm_90 class parts).
      const int64_t avg = static_cast<int64_t>(n_slots_max) / std::max(1, std::min(base.n_experts, n_slots_max));
      // (+ find_work's ~3 KiB of static shared memory and the 1 KiB the system reserves per CTA)
      bn = avg >= 96 && smem_per_sm(what) >= 2 * (tc_smem_bytes<128>() + 5 * 1024) ? 128 : 64;
    }
    KernelFn k = tc_kernel<T, FUSED>(bn);
    if (kernel_ptx_version(reinterpret_cast<const void*>(k), what) * 10 >= tc_min_arch<T>()) {
      fn = k;
      smem = bn == 128 ? tc_smem_bytes<128>() : tc_smem_bytes<64>();
      need_dynamic_smem(reinterpret_cast<const void*>(k), smem, what);
    }
  }
  if (!fn) {
    fn = moe_simt_kernel<T, FUSED>;
    bn = kSBN;
  }
  // Work items: at most one partial tile per expert that has tokens.
  const int64_t items = (static_cast<int64_t>(n_slots_max) + bn - 1) / bn + std::min(base.n_experts, n_slots_max);
  for (int64_t y0 = 0; y0 < items; y0 += 65535) {
    MoeArgs a = base;
    a.y_base = static_cast<int>(y0);
    const dim3 grid(static_cast<unsigned>(gx), static_cast<unsigned>(std::min<int64_t>(65535, items - y0)));
    fn<<<grid, kThreads, smem, st>>>(a);
  }
  moe_cuda_ok(cudaGetLastError(), what);
}

template <bool FUSED>
void launch_moe(const DevMatrix& w0, const DevMatrix* w1, const int32_t* offsets, int n_experts, const int32_t* slot_of,
                const float* x, int64_t ld_x, const int32_t* rows, int n_slots_max, float* y, int64_t ld_y,
                const int32_t* y_rows, Stream s, int tile, const char* what) {
  if (n_experts <= 0 || n_slots_max <= 0) return;
  check_moe_weight(w0, what);
  if (FUSED) {
    check_moe_weight(*w1, what);
    if (w1->type != w0.type || w1->cols != w0.cols || w1->rows != w0.rows || w1->n_mats != w0.n_mats ||
        w1->row_bytes != w0.row_bytes || (w0.n_mats > 1 && w1->mat_bytes != w0.mat_bytes))
      moe_fail(std::string(what) + ": gate and up must have the same type and shape");
  }
  if (!offsets || !x || !y) moe_fail(std::string(what) + ": offsets, x and y are required");
  if (tile != 0 && tile != 64 && tile != 128 && tile != -1) moe_fail(std::string(what) + ": tile must be 0, 64, 128 or -1");
  if (ld_x < w0.cols) moe_fail(std::string(what) + ": ld_x smaller than the row length");
  const int64_t out_w = w0.rows;
  if (ld_y < out_w) moe_fail(std::string(what) + ": ld_y smaller than the output width");
  if (!moe_aligned(x, 4) || !moe_aligned(y, 4)) moe_fail(std::string(what) + ": x and y must be float-aligned");

  MoeArgs a{};
  a.w0 = w0.data;
  a.w1 = FUSED ? w1->data : w0.data;
  a.row_bytes = w0.row_bytes;
  a.mat_bytes = w0.n_mats > 1 ? w0.mat_bytes : w0.row_bytes * static_cast<size_t>(w0.rows);
  a.rows = w0.rows;
  a.cols = w0.cols;
  a.n_mats = w0.n_mats;
  a.offsets = offsets;
  a.n_experts = n_experts;
  a.slot_of = slot_of;
  a.x = x;
  a.ld_x = ld_x;
  a.xrows = rows;
  a.y = y;
  a.ld_y = ld_y;
  a.yrows = y_rows;
  a.x_vec = moe_aligned(x, 16) && ld_x % 4 == 0;
  auto vec16 = [&](const DevMatrix& w) {
    return moe_aligned(w.data, 16) && w.row_bytes % 16 == 0 && (w.n_mats <= 1 || w.mat_bytes % 16 == 0);
  };
  a.w_vec = vec16(w0) && (!FUSED || vec16(*w1));

  const cudaStream_t st = static_cast<cudaStream_t>(s);
  switch (w0.type) {
#define FITMOE_MOE(X) \
  case DType::X: launch_typed<DType::X, FUSED>(a, n_slots_max, tile, st, what); break;
    FITMOE_MOE(F32) FITMOE_MOE(F16) FITMOE_MOE(BF16) FITMOE_MOE(Q4_0) FITMOE_MOE(Q4_1) FITMOE_MOE(Q5_0)
    FITMOE_MOE(Q5_1) FITMOE_MOE(Q8_0) FITMOE_MOE(Q2_K) FITMOE_MOE(Q3_K) FITMOE_MOE(Q4_K) FITMOE_MOE(Q5_K)
    FITMOE_MOE(Q6_K) FITMOE_MOE(IQ4_NL) FITMOE_MOE(IQ4_XS)
#undef FITMOE_MOE
    default: moe_fail(std::string(what) + ": unsupported weight type " + dtype_name(w0.type));
  }
}

}  // namespace

// ================================ public API ======================================================

void moe_matmul(const DevMatrix& w, const int32_t* offsets, int n_experts, const int32_t* slot_of, const float* x,
                int64_t ld_x, const int32_t* rows, int n_slots_max, float* y, int64_t ld_y, Stream s,
                const int32_t* y_rows, int tile) {
  launch_moe<false>(w, nullptr, offsets, n_experts, slot_of, x, ld_x, rows, n_slots_max, y, ld_y, y_rows, s, tile,
                    "moe_matmul");
}

void moe_matmul_swiglu(const DevMatrix& gate, const DevMatrix& up, const int32_t* offsets, int n_experts,
                       const int32_t* slot_of, const float* x, int64_t ld_x, const int32_t* rows, int n_slots_max,
                       float* h, int64_t ld_h, Stream s, const int32_t* h_rows, int tile) {
  launch_moe<true>(gate, &up, offsets, n_experts, slot_of, x, ld_x, rows, n_slots_max, h, ld_h, h_rows, s, tile,
                   "moe_matmul_swiglu");
}

}  // namespace fitmoe::gpu
