// Internal to src/quant: byte layouts of the weight block formats and small helpers shared by the
// scalar reference and the per-ISA kernel files.
//
// Everything here is in an unnamed namespace on purpose: the *_avx2.cpp / *_avx512.cpp files include
// this header with extra -m flags, and an inline function with external linkage compiled there could
// be picked by the linker for the portable files too (and then execute AVX2 code on any CPU).
#pragma once
#include <cstdint>
#include <cstring>

#include "quant/dtype.h"

namespace fitmoe::quant {
namespace {

// ---- field access (blocks are byte arrays; rows need not be aligned) ----------------------------
inline uint16_t ld_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}
inline uint32_t ld_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
inline float ld_f32(const uint8_t* p) {
  float v;
  std::memcpy(&v, p, 4);
  return v;
}

// ---- block geometry: bytes per block and field offsets ------------------------------------------
// Q4_0 / IQ4_NL: f16 d | 16 B nibbles (low nibble = value j, high nibble = value j+16)
constexpr int kQ4_0Bytes = 18;
// Q4_1: f16 d | f16 m | 16 B nibbles
constexpr int kQ4_1Bytes = 20;
// Q5_0: f16 d | u32 high bits | 16 B nibbles
constexpr int kQ5_0Bytes = 22;
// Q5_1: f16 d | f16 m | u32 high bits | 16 B nibbles
constexpr int kQ5_1Bytes = 24;
// Q8_0: f16 d | 32 x i8
constexpr int kQ8_0Bytes = 34;
// Q8_1: f16 d | f16 s | 32 x i8
constexpr int kQ8_1Bytes = 36;

// Q2_K: scales[16] (lo nibble scale, hi nibble min) | qs[64] | f16 d | f16 dmin
constexpr int kQ2K_Bytes = 84, kQ2K_Scales = 0, kQ2K_Qs = 16, kQ2K_D = 80, kQ2K_Dmin = 82;
// Q3_K: hmask[32] | qs[64] | scales[12] | f16 d
constexpr int kQ3K_Bytes = 110, kQ3K_Hmask = 0, kQ3K_Qs = 32, kQ3K_Scales = 96, kQ3K_D = 108;
// Q4_K: f16 d | f16 dmin | scales[12] | qs[128]
constexpr int kQ4K_Bytes = 144, kQ4K_D = 0, kQ4K_Dmin = 2, kQ4K_Scales = 4, kQ4K_Qs = 16;
// Q5_K: f16 d | f16 dmin | scales[12] | qh[32] | qs[128]
constexpr int kQ5K_Bytes = 176, kQ5K_D = 0, kQ5K_Dmin = 2, kQ5K_Scales = 4, kQ5K_Qh = 16, kQ5K_Qs = 48;
// Q6_K: ql[128] | qh[64] | i8 scales[16] | f16 d
constexpr int kQ6K_Bytes = 210, kQ6K_Ql = 0, kQ6K_Qh = 128, kQ6K_Scales = 192, kQ6K_D = 208;
// Q8_K: f32 d | i8 qs[256] | i16 bsums[16]
constexpr int kQ8K_Bytes = 292, kQ8K_D = 0, kQ8K_Qs = 4, kQ8K_Bsums = 260;
// IQ4_XS: f16 d | u16 scales_h | scales_l[4] | qs[128]
constexpr int kIQ4XS_Bytes = 136, kIQ4XS_D = 0, kIQ4XS_ScalesH = 2, kIQ4XS_ScalesL = 4, kIQ4XS_Qs = 8;

// The non-linear 4-bit code book of IQ4_NL / IQ4_XS.
alignas(16) constexpr int8_t kIQ4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                               1,    13,   25,  38,  53,  69,  89,  113};

// ---- K-quant scale unpacking ---------------------------------------------------------------------
// Q4_K / Q5_K: 12 bytes hold eight 6-bit scales and eight 6-bit mins. Entries 0..3 sit in the low six
// bits of bytes 0..3 (scales) and 4..7 (mins); entries 4..7 take their low four bits from the
// nibbles of bytes 8..11 and their top two bits from the spare top bits of bytes 0..3 / 4..7.
inline void unpack_k4_scales(const uint8_t* p, uint8_t sc[8], uint8_t mn[8]) {
  const uint32_t a = ld_u32(p), b = ld_u32(p + 4), c = ld_u32(p + 8);
  const uint32_t s_lo = a & 0x3f3f3f3fu;
  const uint32_t m_lo = b & 0x3f3f3f3fu;
  const uint32_t s_hi = (c & 0x0f0f0f0fu) | (((a >> 6) & 0x03030303u) << 4);
  const uint32_t m_hi = ((c >> 4) & 0x0f0f0f0fu) | (((b >> 6) & 0x03030303u) << 4);
  std::memcpy(sc, &s_lo, 4);
  std::memcpy(sc + 4, &s_hi, 4);
  std::memcpy(mn, &m_lo, 4);
  std::memcpy(mn + 4, &m_hi, 4);
}

// Q3_K: 12 bytes hold sixteen 6-bit scales (stored with +32 offset). Scale s takes its low nibble
// from byte s (s < 8, low nibble) or byte s-8 (high nibble), and its top two bits from byte
// 8 + s%4, bit pair s/4. Returns the signed scales (value - 32).
inline void unpack_q3k_scales(const uint8_t* p, int8_t out[16]) {
  const uint32_t a = ld_u32(p), b = ld_u32(p + 4), c = ld_u32(p + 8);
  const uint32_t w0 = (a & 0x0f0f0f0fu) | ((c & 0x03030303u) << 4);
  const uint32_t w1 = (b & 0x0f0f0f0fu) | (((c >> 2) & 0x03030303u) << 4);
  const uint32_t w2 = ((a >> 4) & 0x0f0f0f0fu) | (((c >> 4) & 0x03030303u) << 4);
  const uint32_t w3 = ((b >> 4) & 0x0f0f0f0fu) | (((c >> 6) & 0x03030303u) << 4);
  uint8_t u[16];
  std::memcpy(u, &w0, 4);
  std::memcpy(u + 4, &w1, 4);
  std::memcpy(u + 8, &w2, 4);
  std::memcpy(u + 12, &w3, 4);
  for (int i = 0; i < 16; ++i) out[i] = static_cast<int8_t>(u[i] - 32);
}

// IQ4_XS: the 6-bit scale of sub-block ib (0..7), signed (value - 32).
inline int iq4xs_scale(const uint8_t* blk, int ib) {
  const int lo = (blk[kIQ4XS_ScalesL + ib / 2] >> (4 * (ib % 2))) & 15;
  const int hi = (ld_u16(blk + kIQ4XS_ScalesH) >> (2 * ib)) & 3;
  return (lo | (hi << 4)) - 32;
}

}  // namespace
}  // namespace fitmoe::quant
