// Device-side weight block decoders shared by the CUDA kernels: one 32-value "part" of a weight row
// of any quantized type fitmoe supports -> 32 signed 8-bit codes plus scales (WT<T>::decode), and those
// -> 32 floats bit-exact with quant::dequantize_row_ref (deq_part<T>).
//
// Used by src/cuda/gpu_ops.cu (mat-vec, dequantization) and src/cuda/moe_gemm.cu (grouped products).
// Everything lives in an anonymous namespace inside fitmoe::gpu: each .cu file gets its own copy of
// these inline device functions. Include only from .cu files (nvcc), before opening fitmoe::gpu.
#pragma once
#include <cuda_fp16.h>

#include <cstdint>

#include "quant/dtype.h"

namespace fitmoe::gpu {
namespace {

constexpr unsigned kFull = 0xffffffffu;

__device__ __forceinline__ uint32_t ld_u16(const uint8_t* p) { return *reinterpret_cast<const uint16_t*>(p); }
// A 32-bit word at an address aligned to A bytes (2 or 4).
template <int A>
__device__ __forceinline__ int ld_i32(const uint8_t* p) {
  if constexpr (A >= 4) {
    return *reinterpret_cast<const int*>(p);
  } else {
    return static_cast<int>(__byte_perm(ld_u16(p), ld_u16(p + 2), 0x5410));
  }
}
// 32 bytes at a 16-byte aligned address (Q4_K / Q5_K blocks are multiples of 16 bytes).
__device__ __forceinline__ void ld_32b(const uint8_t* p, uint32_t* u) {
  const uint4 a = reinterpret_cast<const uint4*>(p)[0], b = reinterpret_cast<const uint4*>(p)[1];
  u[0] = a.x, u[1] = a.y, u[2] = a.z, u[3] = a.w, u[4] = b.x, u[5] = b.y, u[6] = b.z, u[7] = b.w;
}
__device__ __forceinline__ float h2f(uint32_t h) { return __half2float(__ushort_as_half(static_cast<unsigned short>(h))); }
__device__ __forceinline__ uint16_t f2h_bits(float f) { return __half_as_ushort(__float2half_rn(f)); }
__device__ __forceinline__ float bf2f(uint32_t b) { return __uint_as_float(b << 16); }
// As fitmoe::f32_to_bf16: round to nearest even, NaN kept quiet.
__device__ __forceinline__ uint16_t f2bf_bits(float f) {
  const uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
// Bytes b (each < 128) minus k (k <= 128), per byte, as signed int8 results.
__device__ __forceinline__ int sub_bytes(uint32_t v, uint32_t k) {
  return static_cast<int>(((v | 0x80808080u) - k * 0x01010101u) ^ 0x80808080u);
}
// Bits 0..3 of x to bit 4 of bytes 0..3 (Q5_0/Q5_1 high bits).
__device__ __forceinline__ uint32_t spread_bits(uint32_t x) {
  return ((x << 4) & 0x10u) | ((x << 11) & 0x1000u) | ((x << 18) & 0x100000u) | ((x << 25) & 0x10000000u);
}
// Four 4-bit indices (one per byte, values 0..15) -> the IQ4 code book values, as int8 bytes.
__device__ __forceinline__ int iq4_lookup(uint32_t x) {
  // kIQ4Values = {-127,-104,-83,-65,-49,-35,-22,-10, 1,13,25,38,53,69,89,113}
  const uint32_t t0 = 0xBFAD9881u, t1 = 0xF6EADDCFu, t2 = 0x26190D01u, t3 = 0x71594535u;
  const uint32_t idx = x & 0x07070707u;
  const uint32_t sel = ((idx | (idx >> 4)) & 0xffu) | ((((idx >> 16) | (idx >> 20)) & 0xffu) << 8);
  const uint32_t lo = __byte_perm(t0, t1, sel), hi = __byte_perm(t2, t3, sel);
  const uint32_t mask = ((x >> 3) & 0x01010101u) * 0xffu;
  return static_cast<int>((lo & ~mask) | (hi & mask));
}

//
// Every quantized type is processed in "parts" of 32 consecutive values (a 32-value block is one part,
// a 256-value super-block eight). decode() turns part p of a block into 32 signed 8-bit codes (packed
// four per int: value i of the part in byte i%4 of word i/4) plus the scales that turn integer sums
// into floats, such that the block's contribution is exactly the reference's.

struct WPart {
  int q[8];
  float d;       // block scale (super-block scale for the K types)
  float m;       // Q4_1/Q5_1: the min; K types with mins: dmin
  int sc0, sc1;  // K types: the integer scales of the part's two 16-value groups
  int mn0, mn1;  // K types with mins: the integer mins of those groups
  int gs[4];     // Q6_K in the mat-vec layout (decode_mv): the scales of the part's four 8-value groups
};

enum Fam { kFamQ8_0 = 0, kFamQ8_1 = 1, kFamQ8_K = 2 };  // activation format
// How a decoded code becomes a float (bit-exact with the reference's dequantizers):
//   kDeqMul: code * d;  kDeqMulAdd: code * d + m;  kDeqScaleMin: (d*sc) * code - (dmin*mn);
//   kDeqScale: (d*sc) * code
enum Deq { kDeqMul = 0, kDeqMulAdd = 1, kDeqScaleMin = 2, kDeqScale = 3 };

template <DType T>
struct WT;

template <>
struct WT<DType::Q4_0> {
  static constexpr int kQK = 32, kBytes = 18, kFam = kFamQ8_0, kDeq = kDeqMul;
  static constexpr bool kMin = false;
  __device__ static __forceinline__ void decode(const uint8_t* b, int, WPart& w) {
    w.d = h2f(ld_u16(b));
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t v = ld_i32<2>(b + 2 + 4 * i);
      w.q[i] = sub_bytes(v & 0x0f0f0f0fu, 8);
      w.q[i + 4] = sub_bytes((v >> 4) & 0x0f0f0f0fu, 8);
    }
  }
};
template <>
struct WT<DType::Q4_1> {
  static constexpr int kQK = 32, kBytes = 20, kFam = kFamQ8_1, kDeq = kDeqMulAdd;
  static constexpr bool kMin = false;
  __device__ static __forceinline__ void decode(const uint8_t* b, int, WPart& w) {
    const uint32_t dm = ld_i32<4>(b);
    w.d = h2f(dm & 0xffffu);
    w.m = h2f(dm >> 16);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t v = ld_i32<4>(b + 4 + 4 * i);
      w.q[i] = static_cast<int>(v & 0x0f0f0f0fu);
      w.q[i + 4] = static_cast<int>((v >> 4) & 0x0f0f0f0fu);
    }
  }
};
template <>
struct WT<DType::Q5_0> {
  static constexpr int kQK = 32, kBytes = 22, kFam = kFamQ8_0, kDeq = kDeqMul;
  static constexpr bool kMin = false;
  __device__ static __forceinline__ void decode(const uint8_t* b, int, WPart& w) {
    w.d = h2f(ld_u16(b));
    const uint32_t qh = ld_i32<2>(b + 2);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t v = ld_i32<2>(b + 6 + 4 * i);
      w.q[i] = sub_bytes((v & 0x0f0f0f0fu) | spread_bits(qh >> (4 * i)), 16);
      w.q[i + 4] = sub_bytes(((v >> 4) & 0x0f0f0f0fu) | spread_bits(qh >> (16 + 4 * i)), 16);
    }
  }
};
template <>
struct WT<DType::Q5_1> {
  static constexpr int kQK = 32, kBytes = 24, kFam = kFamQ8_1, kDeq = kDeqMulAdd;
  static constexpr bool kMin = false;
  __device__ static __forceinline__ void decode(const uint8_t* b, int, WPart& w) {
    const uint32_t dm = ld_i32<4>(b);
    w.d = h2f(dm & 0xffffu);
    w.m = h2f(dm >> 16);
    const uint32_t qh = ld_i32<4>(b + 4);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t v = ld_i32<4>(b + 8 + 4 * i);
      w.q[i] = static_cast<int>((v & 0x0f0f0f0fu) | spread_bits(qh >> (4 * i)));
      w.q[i + 4] = static_cast<int>(((v >> 4) & 0x0f0f0f0fu) | spread_bits(qh >> (16 + 4 * i)));
    }
  }
};
template <>
struct WT<DType::Q8_0> {
  static constexpr int kQK = 32, kBytes = 34, kFam = kFamQ8_0, kDeq = kDeqMul;
  static constexpr bool kMin = false;
  __device__ static __forceinline__ void decode(const uint8_t* b, int, WPart& w) {
    w.d = h2f(ld_u16(b));
#pragma unroll
    for (int i = 0; i < 8; ++i) w.q[i] = ld_i32<2>(b + 2 + 4 * i);
  }
};
template <>
struct WT<DType::IQ4_NL> {
  static constexpr int kQK = 32, kBytes = 18, kFam = kFamQ8_0, kDeq = kDeqMul;
  static constexpr bool kMin = false;
  __device__ static __forceinline__ void decode(const uint8_t* b, int, WPart& w) {
    w.d = h2f(ld_u16(b));
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t v = ld_i32<2>(b + 2 + 4 * i);
      w.q[i] = iq4_lookup(v & 0x0f0f0f0fu);
      w.q[i + 4] = iq4_lookup((v >> 4) & 0x0f0f0f0fu);
    }
  }
};
// Q2_K: scales[16] | qs[64] | d | dmin. Part p: half p/4, 2-bit field p%4 of qs[32*half + l].
template <>
struct WT<DType::Q2_K> {
  static constexpr int kQK = 256, kBytes = 84, kFam = kFamQ8_K, kDeq = kDeqScaleMin;
  static constexpr bool kMin = true;
  __device__ static __forceinline__ void decode(const uint8_t* b, int p, WPart& w) {
    const uint32_t dd = ld_i32<4>(b + 80);
    w.d = h2f(dd & 0xffffu);
    w.m = h2f(dd >> 16);
    const uint32_t sc = ld_u16(b + 2 * p);
    w.sc0 = sc & 15;
    w.mn0 = (sc >> 4) & 15;
    w.sc1 = (sc >> 8) & 15;
    w.mn1 = (sc >> 12) & 15;
    const uint8_t* qs = b + 16 + 32 * (p >> 2);
    const int sh = 2 * (p & 3);
#pragma unroll
    for (int i = 0; i < 8; ++i) w.q[i] = static_cast<int>((static_cast<uint32_t>(ld_i32<4>(qs + 4 * i)) >> sh) & 0x03030303u);
  }
};
// Q3_K: hmask[32] | qs[64] | scales[12] | d. Part p: low 2 bits as Q2_K, high bit p of hmask[l]
// (clear: minus 4).
template <>
struct WT<DType::Q3_K> {
  static constexpr int kQK = 256, kBytes = 110, kFam = kFamQ8_K, kDeq = kDeqScale;
  static constexpr bool kMin = false;
  __device__ static __forceinline__ void decode(const uint8_t* b, int p, WPart& w) {
    w.d = h2f(ld_u16(b + 108));
    // Scale s (0..15): low nibble from byte s (s < 8) or the high nibble of byte s-8; top two bits
    // from byte 8 + s%4, bit pair s/4. This part's scales are s = 2p, 2p+1.
    const uint32_t lo = ld_u16(b + 96 + ((2 * p) & 7));
    const uint32_t hi = ld_u16(b + 96 + 8 + ((2 * p) & 3));
    const int sl = p >= 4 ? 4 : 0, shh = 2 * (p >> 1);
    w.sc0 = static_cast<int>(((lo >> sl) & 15u) | (((hi >> shh) & 3u) << 4)) - 32;
    w.sc1 = static_cast<int>(((lo >> (8 + sl)) & 15u) | (((hi >> (8 + shh)) & 3u) << 4)) - 32;
    const uint8_t* qs = b + 32 + 32 * (p >> 2);
    const int sh = 2 * (p & 3);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const uint32_t v = (static_cast<uint32_t>(ld_i32<2>(qs + 4 * i)) >> sh) & 0x03030303u;
      const uint32_t h = (static_cast<uint32_t>(ld_i32<2>(b + 4 * i)) >> p) & 0x01010101u;
      w.q[i] = sub_bytes(v | (h << 2), 4);
    }
  }
};
// Q4_K / Q5_K six-bit scales and mins of sub-block p (0..7) from the 12 scale bytes.
__device__ __forceinline__ void k4_scale_min(const uint8_t* s, int p, int& sc, int& mn) {
  if (p < 4) {
    sc = s[p] & 63;
    mn = s[p + 4] & 63;
  } else {
    sc = (s[p + 4] & 15) | ((s[p - 4] >> 6) << 4);
    mn = (s[p + 4] >> 4) | ((s[p] >> 6) << 4);
  }
}
template <>
struct WT<DType::Q4_K> {
  static constexpr int kQK = 256, kBytes = 144, kFam = kFamQ8_K, kDeq = kDeqScaleMin;
  static constexpr bool kMin = true;
  __device__ static __forceinline__ void decode(const uint8_t* b, int p, WPart& w) {
    const uint32_t dd = ld_i32<4>(b);
    w.d = h2f(dd & 0xffffu);
    w.m = h2f(dd >> 16);
    k4_scale_min(b + 4, p, w.sc0, w.mn0);
    w.sc1 = w.sc0;
    w.mn1 = w.mn0;
    uint32_t u[8];
    ld_32b(b + 16 + 32 * (p >> 1), u);
    const int sh = 4 * (p & 1);
#pragma unroll
    for (int i = 0; i < 8; ++i) w.q[i] = static_cast<int>((u[i] >> sh) & 0x0f0f0f0fu);
  }
  // The mat-vec's layout (mmvq_rows in gpu_ops.cu; the activation side is mv_load_act): part p takes
  // the 16 bytes 16p..16p+15 of qs, whose low nibbles are 16 values of sub-block 2j (j = p / 2) and
  // whose high nibbles the same 16 positions of sub-block 2j + 1. So a part reads one 16-byte word of
  // its own where decode reads two that two parts share. w.q[0..3]: the low nibbles (scale sc0, min
  // mn0), w.q[4..7]: the high ones (sc1, mn1). Measured on the H200, all-GPU decode tg128 (every
  // expert product, q, k, the attention output): 456.3 / 453.0 / 455.4 tok/s against 448.1 / 448.8 /
  // 452.4 with decode.
  __device__ static __forceinline__ void decode_mv(const uint8_t* b, int p, WPart& w) {
    const uint32_t dd = ld_i32<4>(b);
    w.d = h2f(dd & 0xffffu);
    w.m = h2f(dd >> 16);
    const int j = p >> 1;
    // Sub-blocks 2j and 2j + 1 from the 12 scale bytes s: below 4, sc = s[q] & 63, mn = s[q + 4] & 63;
    // from 4, sc = (s[q + 4] & 15) | (s[q - 4] >> 6) << 4, mn = (s[q + 4] >> 4) | (s[q] >> 6) << 4.
    // Both of the pair at once, one per byte.
    const uint32_t* sw = reinterpret_cast<const uint32_t*>(b + 4);
    const int sh = 16 * (j & 1);
    const uint32_t s0 = sw[0] >> sh, s1 = sw[1] >> sh, s2 = sw[2] >> sh;
    const uint32_t scp = j < 2 ? s0 & 0x3f3fu : (s2 & 0x0f0fu) | ((s0 >> 2) & 0x3030u);
    const uint32_t mnp = j < 2 ? s1 & 0x3f3fu : ((s2 >> 4) & 0x0f0fu) | ((s1 >> 2) & 0x3030u);
    w.sc0 = static_cast<int>(scp & 0xffu);
    w.sc1 = static_cast<int>(scp >> 8 & 0xffu);
    w.mn0 = static_cast<int>(mnp & 0xffu);
    w.mn1 = static_cast<int>(mnp >> 8 & 0xffu);
    const uint4 u = *reinterpret_cast<const uint4*>(b + 16 + 16 * p);
    const uint32_t v[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      w.q[i] = static_cast<int>(v[i] & 0x0f0f0f0fu);
      w.q[i + 4] = static_cast<int>((v[i] >> 4) & 0x0f0f0f0fu);
    }
  }
};
template <>
struct WT<DType::Q5_K> {
  static constexpr int kQK = 256, kBytes = 176, kFam = kFamQ8_K, kDeq = kDeqScaleMin;
  static constexpr bool kMin = true;
  __device__ static __forceinline__ void decode(const uint8_t* b, int p, WPart& w) {
    const uint32_t dd = ld_i32<4>(b);
    w.d = h2f(dd & 0xffffu);
    w.m = h2f(dd >> 16);
    k4_scale_min(b + 4, p, w.sc0, w.mn0);
    w.sc1 = w.sc0;
    w.mn1 = w.mn0;
    uint32_t u[8], hb[8];
    ld_32b(b + 48 + 32 * (p >> 1), u);
    ld_32b(b + 16, hb);
    const int sh = 4 * (p & 1);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const uint32_t v = (u[i] >> sh) & 0x0f0f0f0fu;
      const uint32_t h = (hb[i] >> p) & 0x01010101u;
      w.q[i] = static_cast<int>(v | (h << 4));
    }
  }
};
// Q6_K: ql[128] | qh[64] | int8 scales[16] | d. Part p: half p/4, group g = p%4 of the half.
template <>
struct WT<DType::Q6_K> {
  static constexpr int kQK = 256, kBytes = 210, kFam = kFamQ8_K, kDeq = kDeqScale;
  static constexpr bool kMin = false;
  __device__ static __forceinline__ void decode(const uint8_t* b, int p, WPart& w) {
    w.d = h2f(ld_u16(b + 208));
    const uint32_t sc = ld_u16(b + 192 + 2 * p);
    w.sc0 = static_cast<int8_t>(sc & 0xffu);
    w.sc1 = static_cast<int8_t>(sc >> 8);
    const int half = p >> 2, g = p & 3;
    const uint8_t* ql = b + 64 * half + 32 * (g & 1);
    const uint8_t* qh = b + 128 + 32 * half;
    const int shl = 4 * (g >> 1), shh = 2 * g;
    // Blocks are 210 bytes, so ql and qh sit 2 bytes off a word boundary in every other block: read
    // the nine aligned words around each and shift (18 loads, not 32 half-word ones: the decode was
    // bound by load instructions). The ninth word lies inside the block (qh ends at byte 192).
    const unsigned off = static_cast<unsigned>(reinterpret_cast<uintptr_t>(ql) & 3u);
    const uint32_t* wl = reinterpret_cast<const uint32_t*>(ql - off);
    const uint32_t* wh = reinterpret_cast<const uint32_t*>(qh - off);
    const unsigned sel = off ? 0x5432u : 0x3210u;
    uint32_t l[9], h[9];
#pragma unroll
    for (int i = 0; i < 9; ++i) l[i] = wl[i], h[i] = wh[i];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const uint32_t lo = (__byte_perm(l[i], l[i + 1], sel) >> shl) & 0x0f0f0f0fu;
      const uint32_t hi = (__byte_perm(h[i], h[i + 1], sel) >> shh) & 0x03030303u;
      w.q[i] = sub_bytes(lo | (hi << 4), 32);
    }
  }
  // The mat-vec's layout (mmvq_rows in gpu_ops.cu; the activation side is mv_load_act): the eight parts of a
  // block split it by position rather than into 32 consecutive values. Part p takes, in half p/4,
  // positions l0..l0+7 (l0 = 8 * (p % 4)) of each of the half's four 32-value groups g: those values'
  // low bits are 8 contiguous bytes of ql (ql[l] for groups 0 and 2, ql[32 + l] for 1 and 3, low and
  // high nibbles) and their high bits 8 contiguous bytes of qh (bit pair g). So a part reads 9 aligned
  // words, each byte for no other part, where decode reads 18 words that four parts share; and one
  // 16-value scale covers each group's eight values. w.q[2g], w.q[2g + 1]: group g's codes unsigned
  // (0..63: the 32 is taken off in the dot product); w.gs[g]: its scale. Measured on the H200,
  // all-GPU decode tg128 (the output head, the Q6_K down and v products): 451.5 / 449.8 tok/s against
  // 444.4 / 442.6 with decode.
  __device__ static __forceinline__ void decode_mv(const uint8_t* b, int p, WPart& w) {
    w.d = h2f(ld_u16(b + 208));
    const int half = p >> 2, l0 = 8 * (p & 3);
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192 + 8 * half + (l0 >> 4));
#pragma unroll
    for (int g = 0; g < 4; ++g) w.gs[g] = sc[2 * g];
    // Blocks are 210 bytes, so every other one is 2 bytes off a word boundary (every offset added here
    // is a multiple of 4): three aligned words around each 8-byte run, shifted into place. The third
    // word of the last run (qh) ends at byte 196, inside the block.
    const unsigned off = static_cast<unsigned>(reinterpret_cast<uintptr_t>(b) & 3u);
    const unsigned sel = off ? 0x5432u : 0x3210u;
    const uint32_t* wa = reinterpret_cast<const uint32_t*>(b - off + 64 * half + l0);
    const uint32_t* wb = wa + 8;  // ql[32 + l]
    const uint32_t* wh = reinterpret_cast<const uint32_t*>(b - off + 128 + 32 * half + l0);
    const uint32_t a0 = wa[0], a1 = wa[1], a2 = wa[2], b0 = wb[0], b1 = wb[1], b2 = wb[2];
    const uint32_t h0 = wh[0], h1 = wh[1], h2 = wh[2];
    const uint32_t A[2] = {__byte_perm(a0, a1, sel), __byte_perm(a1, a2, sel)};
    const uint32_t B[2] = {__byte_perm(b0, b1, sel), __byte_perm(b1, b2, sel)};
    const uint32_t H[2] = {__byte_perm(h0, h1, sel), __byte_perm(h1, h2, sel)};
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      w.q[0 + i] = static_cast<int>((A[i] & 0x0f0f0f0fu) | ((H[i] << 4) & 0x30303030u));
      w.q[2 + i] = static_cast<int>((B[i] & 0x0f0f0f0fu) | ((H[i] << 2) & 0x30303030u));
      w.q[4 + i] = static_cast<int>(((A[i] >> 4) & 0x0f0f0f0fu) | (H[i] & 0x30303030u));
      w.q[6 + i] = static_cast<int>(((B[i] >> 4) & 0x0f0f0f0fu) | ((H[i] >> 2) & 0x30303030u));
    }
  }
};
// IQ4_XS: d | scales_h (u16) | scales_l[4] | qs[128]. Part p = sub-block ib.
template <>
struct WT<DType::IQ4_XS> {
  static constexpr int kQK = 256, kBytes = 136, kFam = kFamQ8_K, kDeq = kDeqScale;
  static constexpr bool kMin = false;
  __device__ static __forceinline__ void decode(const uint8_t* b, int p, WPart& w) {
    const uint32_t dh = ld_i32<4>(b);
    w.d = h2f(dh & 0xffffu);
    const int lo = (b[4 + p / 2] >> (4 * (p % 2))) & 15;
    const int hi = ((dh >> 16) >> (2 * p)) & 3;
    w.sc0 = w.sc1 = (lo | (hi << 4)) - 32;
    const uint8_t* qs = b + 8 + 16 * p;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t v = ld_i32<4>(qs + 4 * i);
      w.q[i] = iq4_lookup(v & 0x0f0f0f0fu);
      w.q[i + 4] = iq4_lookup((v >> 4) & 0x0f0f0f0fu);
    }
  }
};

// The 32 floats of a decoded part, bit-exact with quant::dequantize_row_ref.
template <DType T>
__device__ __forceinline__ void deq_part(const WPart& w, float* y) {
  constexpr int kind = WT<T>::kDeq;
  float s0 = 0, s1 = 0, m0 = 0, m1 = 0;
  if constexpr (kind == kDeqScaleMin) {
    s0 = __fmul_rn(w.d, static_cast<float>(w.sc0));
    s1 = __fmul_rn(w.d, static_cast<float>(w.sc1));
    m0 = __fmul_rn(w.m, static_cast<float>(w.mn0));
    m1 = __fmul_rn(w.m, static_cast<float>(w.mn1));
  } else if constexpr (kind == kDeqScale) {
    s0 = __fmul_rn(w.d, static_cast<float>(w.sc0));
    s1 = __fmul_rn(w.d, static_cast<float>(w.sc1));
  }
#pragma unroll
  for (int i = 0; i < 32; ++i) {
    const float c = static_cast<float>(static_cast<int8_t>((w.q[i / 4] >> (8 * (i % 4))) & 0xff));
    if constexpr (kind == kDeqMul) {
      y[i] = __fmul_rn(c, w.d);
    } else if constexpr (kind == kDeqMulAdd) {
      y[i] = __fadd_rn(__fmul_rn(c, w.d), w.m);
    } else if constexpr (kind == kDeqScaleMin) {
      y[i] = __fsub_rn(__fmul_rn(i < 16 ? s0 : s1, c), i < 16 ? m0 : m1);
    } else {
      y[i] = __fmul_rn(i < 16 ? s0 : s1, c);
    }
  }
}

}  // namespace
}  // namespace fitmoe::gpu
