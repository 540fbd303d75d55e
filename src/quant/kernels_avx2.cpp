// AVX2 + FMA + F16C kernels. Compiled with -mavx2 -mfma -mf16c -mbmi2 (CMake: *_avx2.cpp) and only
// reached through the dispatcher after cpuid said yes. No STL in here (see quant/blocks.h for why).
//
// Shape of every quantized kernel: a tile of R weight rows x C activation columns (R*C <= 8 "pairs").
// Per block (32 values) or super-block (256 values) each pair gets one vector of 8 int32 partial
// sums (pmaddubsw + pmaddwd, exact); the 8 pair vectors are reduced together by one transpose-add
// tree into a single vector whose lane k is pair k's exact block sum; the float work is then one
// fma per block for the whole tile. Lane k <-> (row k % R, column k / R). This reproduces the
// reference's canonical order bit for bit (see reference.cpp), independent of R and C.
// Decode (one column) uses R = 8 rows sharing each activation load and prefetches the next tile's rows
// in address order; prefill uses 2x4 / 4x2 tiles so that every unpacked weight register serves
// several columns, over blocks of 16 rows that stay cache-resident while all columns pass.
// Float types keep the reference's 16 lanes per pair (two ymm); their prefill runs k-slices of 512
// values with one ymm per pair per half-slice (2x4 tiles), see matmul_float_blocked.
#include "quant/kernels_isa.h"
#include "quant/simd_common.h"

namespace fitmoe::quant {
namespace {

// =================================== Q8_0-activation family ========================================
// codes(): 32 weight codes; kSigned: codes are signed int8 (sign trick), else unsigned with an offset
// subtracted through the activation (code - kOffset is the value).
struct WQ4_0 {
  static constexpr int kBytes = 18, kOffset = 8;
  static constexpr bool kSigned = false;
  static FM_INLINE __m256i codes(const uint8_t* b) { return nibbles32(b + 2); }
};
struct WQ5_0 {
  static constexpr int kBytes = 22, kOffset = 16;
  static constexpr bool kSigned = false;
  static FM_INLINE __m256i codes(const uint8_t* b) {
    return _mm256_or_si256(nibbles32(b + 6), bit4_from_bits(ld_u32(b + 2)));
  }
};
struct WQ8_0 {
  static constexpr int kBytes = 34, kOffset = 0;
  static constexpr bool kSigned = true;
  static FM_INLINE __m256i codes(const uint8_t* b) { return ld256(b + 2); }
};
struct WIQ4_NL {
  static constexpr int kBytes = 18, kOffset = 0;
  static constexpr bool kSigned = true;
  static FM_INLINE __m256i codes(const uint8_t* b) { return _mm256_shuffle_epi8(iq4_table(), nibbles32(b + 2)); }
};

template <class Wt, int R, int C>
void tile_q8_0(const Tile& t) {
  const int64_t nb = t.n / 32;
  const size_t pstep = prefetch_step(t, nb);
  const uint8_t* wr[R];
  const uint8_t* ac[C];
  for (int r = 0; r < R; ++r) wr[r] = t.w + r * t.ws;
  for (int c = 0; c < C; ++c) ac[c] = t.a + c * t.as;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const size_t wo = static_cast<size_t>(b) * Wt::kBytes, ao = static_cast<size_t>(b) * kQ8_0Bytes;
    prefetch_next(t, pstep, b);
    __m256i s[8];
#pragma GCC unroll 8
    for (int k = 0; k < 8; ++k) s[k] = _mm256_setzero_si256();
    if constexpr (Wt::kSigned) {
      __m256i A[C];
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) A[c] = ld256(ac[c] + ao + 2);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256i q = Wt::codes(wr[r] + wo);
        const __m256i aq = _mm256_abs_epi8(q);
#pragma GCC unroll 4
        for (int c = 0; c < C; ++c)
          s[c * R + r] = _mm256_madd_epi16(_mm256_maddubs_epi16(aq, _mm256_sign_epi8(A[c], q)), ones);
      }
    } else {
      __m256i corr[C];
      const __m256i off = _mm256_set1_epi8(Wt::kOffset);
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) corr[c] = _mm256_maddubs_epi16(off, ld256(ac[c] + ao + 2));
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256i q = Wt::codes(wr[r] + wo);
#pragma GCC unroll 4
        for (int c = 0; c < C; ++c) {
          const __m256i p = _mm256_sub_epi16(_mm256_maddubs_epi16(q, ld256(ac[c] + ao + 2)), corr[c]);
          s[c * R + r] = _mm256_madd_epi16(p, ones);
        }
      }
    }
    const __m256 dd = _mm256_mul_ps(spread_rows<R, C>(halves<R>(wr, wo)), spread_cols<R, C>(halves<C>(ac, ao)));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(reduce8(s)), dd, acc);
  }
  store_tile<R, C>(acc, t);
}

// =================================== Q8_1-activation family ========================================
struct WQ4_1 {
  static constexpr int kBytes = 20;
  static FM_INLINE __m256i codes(const uint8_t* b) { return nibbles32(b + 4); }
};
struct WQ5_1 {
  static constexpr int kBytes = 24;
  static FM_INLINE __m256i codes(const uint8_t* b) {
    return _mm256_or_si256(nibbles32(b + 8), bit4_from_bits(ld_u32(b + 4)));
  }
};

template <class Wt, int R, int C>
void tile_q8_1(const Tile& t) {
  const int64_t nb = t.n / 32;
  const size_t pstep = prefetch_step(t, nb);
  const uint8_t* wr[R];
  const uint8_t* ac[C];
  for (int r = 0; r < R; ++r) wr[r] = t.w + r * t.ws;
  for (int c = 0; c < C; ++c) ac[c] = t.a + c * t.as;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const size_t wo = static_cast<size_t>(b) * Wt::kBytes, ao = static_cast<size_t>(b) * kQ8_1Bytes;
    prefetch_next(t, pstep, b);
    __m256i s[8];
#pragma GCC unroll 8
    for (int k = 0; k < 8; ++k) s[k] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256i q = Wt::codes(wr[r] + wo);
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c)
        s[c * R + r] = _mm256_madd_epi16(_mm256_maddubs_epi16(q, ld256(ac[c] + ao + 4)), ones);
    }
    const __m256 da = spread_cols<R, C>(halves<C>(ac, ao));
    const __m256 dd = _mm256_mul_ps(spread_rows<R, C>(halves<R>(wr, wo)), da);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(reduce8(s)), dd, acc);
    const __m256 m = spread_rows<R, C>(halves<R>(wr, wo + 2));
    const __m256 sa = spread_cols<R, C>(halves<C>(ac, ao + 2));
    acc = _mm256_fmadd_ps(m, sa, acc);
  }
  store_tile<R, C>(acc, t);
}

// ===================================== Q8_K-activation family ======================================
// Each type's block<R, C>() adds, for pair k = c*R + r, an int32x8 vector whose lane sum is the pair's
// integer super-block sum (isum[k]) and, for types with mins, the min sum (msum[k]).
FM_INLINE __m256i a_qs(const uint8_t* a, int off) { return ld256(a + kQ8K_Qs + off); }
FM_INLINE __m256i a_bsums(const uint8_t* a) { return ld256(a + kQ8K_Bsums); }

struct KQ4 {
  static constexpr int kBytes = kQ4K_Bytes, kD = kQ4K_D, kDmin = kQ4K_Dmin;
  static constexpr bool kHasMin = true;
  template <int R, int C>
  static FM_INLINE void block(const uint8_t* const* wb, const uint8_t* const* ab, __m256i* isum, __m256i* msum) {
    const __m256i m4 = _mm256_set1_epi8(15);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const uint8_t* w = wb[r];
      uint64_t sc, mn;
      k4_scales(w + kQ4K_Scales, &sc, &mn);
      const __m256i scv = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<long long>(sc))));
      const __m128i m8 = _mm_cvtsi64_si128(static_cast<long long>(mn));
      const __m256i mnv = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m8, m8));
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) msum[c * R + r] = _mm256_madd_epi16(mnv, a_bsums(ab[c]));
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const __m256i q = ld256(w + kQ4K_Qs + 32 * j);
        const __m256i lo = _mm256_and_si256(q, m4);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
        const __m256i s0 = bcast16(scv, 2 * j), s1 = bcast16(scv, 2 * j + 1);
#pragma GCC unroll 4
        for (int c = 0; c < C; ++c) {
          const __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, a_qs(ab[c], 64 * j)), s0);
          const __m256i p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, a_qs(ab[c], 64 * j + 32)), s1);
          isum[c * R + r] = acc_add(isum[c * R + r], _mm256_add_epi32(p0, p1));
        }
      }
    }
  }
};

// bit s of every byte of v, moved to bit position `to` (other bits cleared)
template <int to>
FM_INLINE __m256i bit_to(__m256i v, int s) {
  const __m256i mask = _mm256_set1_epi8(static_cast<char>(1 << to));
  if (s < to) return _mm256_and_si256(_mm256_slli_epi16(v, to - s), mask);
  if (s > to) return _mm256_and_si256(_mm256_srli_epi16(v, s - to), mask);
  return _mm256_and_si256(v, mask);
}

struct KQ5 {
  static constexpr int kBytes = kQ5K_Bytes, kD = kQ5K_D, kDmin = kQ5K_Dmin;
  static constexpr bool kHasMin = true;
  template <int R, int C>
  static FM_INLINE void block(const uint8_t* const* wb, const uint8_t* const* ab, __m256i* isum, __m256i* msum) {
    const __m256i m4 = _mm256_set1_epi8(15);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const uint8_t* w = wb[r];
      uint64_t sc, mn;
      k4_scales(w + kQ5K_Scales, &sc, &mn);
      const __m256i scv = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<long long>(sc))));
      const __m128i m8 = _mm_cvtsi64_si128(static_cast<long long>(mn));
      const __m256i mnv = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m8, m8));
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) msum[c * R + r] = _mm256_madd_epi16(mnv, a_bsums(ab[c]));
      const __m256i qh = ld256(w + kQ5K_Qh);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const __m256i q = ld256(w + kQ5K_Qs + 32 * j);
        const __m256i lo = _mm256_or_si256(_mm256_and_si256(q, m4), bit_to<4>(qh, 2 * j));
        const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q, 4), m4), bit_to<4>(qh, 2 * j + 1));
        const __m256i s0 = bcast16(scv, 2 * j), s1 = bcast16(scv, 2 * j + 1);
#pragma GCC unroll 4
        for (int c = 0; c < C; ++c) {
          const __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, a_qs(ab[c], 64 * j)), s0);
          const __m256i p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, a_qs(ab[c], 64 * j + 32)), s1);
          isum[c * R + r] = acc_add(isum[c * R + r], _mm256_add_epi32(p0, p1));
        }
      }
    }
  }
};

struct KQ6 {
  static constexpr int kBytes = kQ6K_Bytes, kD = kQ6K_D, kDmin = 0;
  static constexpr bool kHasMin = false;
  template <int R, int C>
  static FM_INLINE void block(const uint8_t* const* wb, const uint8_t* const* ab, __m256i* isum, __m256i*) {
    const __m256i m4 = _mm256_set1_epi8(15), m30 = _mm256_set1_epi8(0x30);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const uint8_t* w = wb[r];
      const __m256i sc16 = _mm256_cvtepi8_epi16(ld128(w + kQ6K_Scales));
      // codes are q6 in 0..63, the value is q6 - 32: subtract 32 * sum_g scale_g * bsum_g
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c)
        isum[c * R + r] = _mm256_sub_epi32(isum[c * R + r], _mm256_slli_epi32(_mm256_madd_epi16(sc16, a_bsums(ab[c])), 5));
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const __m256i sv = _mm256_permute2x128_si256(sc16, sc16, h ? 0x11 : 0x00);
        const __m256i ql0 = ld256(w + kQ6K_Ql + 64 * h), ql1 = ld256(w + kQ6K_Ql + 64 * h + 32);
        const __m256i qh = ld256(w + kQ6K_Qh + 32 * h);
        __m256i v[4];
        v[0] = _mm256_or_si256(_mm256_and_si256(ql0, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30));
        v[1] = _mm256_or_si256(_mm256_and_si256(ql1, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30));
        v[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4), _mm256_and_si256(qh, m30));
        v[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                               _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30));
#pragma GCC unroll 4
        for (int g = 0; g < 4; ++g) {
          const __m256i sp = pair16(sv, g);
#pragma GCC unroll 4
          for (int c = 0; c < C; ++c) {
            const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(v[g], a_qs(ab[c], 128 * h + 32 * g)), sp);
            isum[c * R + r] = acc_add(isum[c * R + r], p);
          }
        }
      }
    }
  }
};

struct KQ3 {
  static constexpr int kBytes = kQ3K_Bytes, kD = kQ3K_D, kDmin = 0;
  static constexpr bool kHasMin = false;
  template <int R, int C>
  static FM_INLINE void block(const uint8_t* const* wb, const uint8_t* const* ab, __m256i* isum, __m256i*) {
    const __m256i m3 = _mm256_set1_epi8(3);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const uint8_t* w = wb[r];
      const __m128i sc8 = q3k_scales(w + kQ3K_Scales);
      const __m256i sc16 = _mm256_cvtepi8_epi16(sc8);
      // codes are (value + 4) in 0..7: subtract 4 * sum_g scale_g * bsum_g
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c)
        isum[c * R + r] = _mm256_sub_epi32(isum[c * R + r], _mm256_slli_epi32(_mm256_madd_epi16(sc16, a_bsums(ab[c])), 2));
      const __m256i hm = ld256(w + kQ3K_Hmask);
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const __m256i sv = _mm256_permute2x128_si256(sc16, sc16, h ? 0x11 : 0x00);
        const __m256i q = ld256(w + kQ3K_Qs + 32 * h);
#pragma GCC unroll 4
        for (int g = 0; g < 4; ++g) {
          const __m256i u = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q, 2 * g), m3), bit_to<2>(hm, 4 * h + g));
          const __m256i spat = pair16(sv, g);
#pragma GCC unroll 4
          for (int c = 0; c < C; ++c) {
            const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(u, a_qs(ab[c], 128 * h + 32 * g)), spat);
            isum[c * R + r] = acc_add(isum[c * R + r], p);
          }
        }
      }
    }
  }
};

struct KQ2 {
  static constexpr int kBytes = kQ2K_Bytes, kD = kQ2K_D, kDmin = kQ2K_Dmin;
  static constexpr bool kHasMin = true;
  template <int R, int C>
  static FM_INLINE void block(const uint8_t* const* wb, const uint8_t* const* ab, __m256i* isum, __m256i* msum) {
    const __m256i m3 = _mm256_set1_epi8(3);
    const __m128i m4 = _mm_set1_epi8(15);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const uint8_t* w = wb[r];
      const __m128i s8 = ld128(w + kQ2K_Scales);
      const __m256i sc16 = _mm256_cvtepu8_epi16(_mm_and_si128(s8, m4));
      const __m256i mn16 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(s8, 4), m4));
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) msum[c * R + r] = _mm256_madd_epi16(mn16, a_bsums(ab[c]));
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const __m256i sv = _mm256_permute2x128_si256(sc16, sc16, h ? 0x11 : 0x00);
        const __m256i q = ld256(w + kQ2K_Qs + 32 * h);
#pragma GCC unroll 4
        for (int g = 0; g < 4; ++g) {
          const __m256i u = _mm256_and_si256(_mm256_srli_epi16(q, 2 * g), m3);
          const __m256i spat = pair16(sv, g);
#pragma GCC unroll 4
          for (int c = 0; c < C; ++c) {
            const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(u, a_qs(ab[c], 128 * h + 32 * g)), spat);
            isum[c * R + r] = acc_add(isum[c * R + r], p);
          }
        }
      }
    }
  }
};

struct KIQ4XS {
  static constexpr int kBytes = kIQ4XS_Bytes, kD = kIQ4XS_D, kDmin = 0;
  static constexpr bool kHasMin = false;
  template <int R, int C>
  static FM_INLINE void block(const uint8_t* const* wb, const uint8_t* const* ab, __m256i* isum, __m256i*) {
    const __m256i m4 = _mm256_set1_epi8(15);
    const __m256i tab = iq4_table();
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const uint8_t* w = wb[r];
      const __m128i s8 = iq4xs_scales(w);
      const __m256i scv = _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(s8));
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const __m256i q = ld256(w + kIQ4XS_Qs + 32 * j);  // sub-blocks 2j (bytes 0..15) and 2j+1
        const __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
#pragma GCC unroll 2
        for (int e = 0; e < 2; ++e) {
          const __m256i idx = _mm256_permute2x128_si256(lo, hi, e ? 0x31 : 0x20);
          const __m256i v = _mm256_shuffle_epi8(tab, idx);
          const __m256i av = _mm256_abs_epi8(v);
          const __m256i sb = bcast16(scv, 2 * j + e);
#pragma GCC unroll 4
          for (int c = 0; c < C; ++c) {
            const __m256i p = _mm256_maddubs_epi16(av, _mm256_sign_epi8(a_qs(ab[c], 64 * j + 32 * e), v));
            isum[c * R + r] = acc_add(isum[c * R + r], _mm256_madd_epi16(p, sb));
          }
        }
      }
    }
  }
};

template <class K, int R, int C>
void tile_q8_k(const Tile& t) {
  const int64_t nb = t.n / 256;
  const size_t pstep = prefetch_step(t, nb);
  __m256 acc = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* wb[R];
    const uint8_t* ab[C];
    for (int r = 0; r < R; ++r) wb[r] = t.w + r * t.ws + static_cast<size_t>(b) * K::kBytes;
    for (int c = 0; c < C; ++c) ab[c] = t.a + c * t.as + static_cast<size_t>(b) * kQ8K_Bytes;
    prefetch_next(t, pstep, b);
    __m256i isum[8], msum[8];
#pragma GCC unroll 8
    for (int k = 0; k < 8; ++k) isum[k] = msum[k] = _mm256_setzero_si256();
    K::template block<R, C>(wb, ab, isum, msum);
    const __m256 da = spread_cols<R, C>(floats<C>(ab, kQ8K_D));
    const __m256 dd = _mm256_mul_ps(spread_rows<R, C>(halves<R>(wb, K::kD)), da);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(reduce8(isum)), dd, acc);
    if constexpr (K::kHasMin) {
      const __m256 dm = _mm256_mul_ps(spread_rows<R, C>(halves<R>(wb, K::kDmin)), da);
      const __m256i neg = _mm256_sub_epi32(_mm256_setzero_si256(), reduce8(msum));
      acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(neg), dm, acc);
    }
  }
  store_tile<R, C>(acc, t);
}

// ======================================== float types ==============================================
struct FF32 {
  static constexpr int kSize = 4;
  static FM_INLINE __m256 load(const uint8_t* p) { return _mm256_loadu_ps(reinterpret_cast<const float*>(p)); }
};
struct FF16 {
  static constexpr int kSize = 2;
  static FM_INLINE __m256 load(const uint8_t* p) { return _mm256_cvtph_ps(ld128(p)); }
};
struct FBF16 {
  static constexpr int kSize = 2;
  static FM_INLINE __m256 load(const uint8_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(ld128(p)), 16));
  }
};

// 16 canonical lanes per pair: acc[k][0] holds lanes 0..7, acc[k][1] lanes 8..15.
template <class F, int R, int C>
FM_INLINE void float_chunk(const uint8_t* const* wr, size_t wstep, const uint8_t* const* ac, size_t astep,
                           __m256 (*acc)[2]) {
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h) {
    __m256 A[C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) A[c] = keep(F::load(ac[c] + astep + 8 * h * F::kSize));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 W = F::load(wr[r] + wstep + 8 * h * F::kSize);
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) acc[c * R + r][h] = _mm256_fmadd_ps(W, A[c], acc[c * R + r][h]);
    }
  }
}


// Elements [full, end) (fewer than 16), zero-padded to a whole chunk as the canonical order does.
template <class F, int R, int C>
FM_INLINE void float_tail(const uint8_t* const* wr, const uint8_t* const* ac, int64_t full, int64_t end,
                          __m256 (*acc)[2]) {
  if (full >= end) return;
  const size_t bytes = static_cast<size_t>(end - full) * F::kSize;
  alignas(32) uint8_t wbuf[R][64], abuf[C][64];
  const uint8_t* wp[R];
  const uint8_t* ap[C];
  for (int r = 0; r < R; ++r) {
    std::memset(wbuf[r], 0, 64);
    std::memcpy(wbuf[r], wr[r] + full * F::kSize, bytes);
    wp[r] = wbuf[r];
  }
  for (int c = 0; c < C; ++c) {
    std::memset(abuf[c], 0, 64);
    std::memcpy(abuf[c], ac[c] + full * F::kSize, bytes);
    ap[c] = abuf[c];
  }
  float_chunk<F, R, C>(wp, 0, ap, 0, acc);
}

// Decode tile (and small n): the whole row in one pass, accumulators in registers.
template <class F, int R, int C>
void tile_float(const Tile& t) {
  const uint8_t* wr[R];
  const uint8_t* ac[C];
  for (int r = 0; r < R; ++r) wr[r] = t.w + r * t.ws;
  for (int c = 0; c < C; ++c) ac[c] = t.a + c * t.as;
  __m256 acc[R * C][2];
#pragma GCC unroll 8
  for (int k = 0; k < R * C; ++k) acc[k][0] = acc[k][1] = _mm256_setzero_ps();
  const int64_t full = t.n / 16 * 16;
  const size_t pstep = prefetch_step(t, t.n / 16);
  for (int64_t i = 0; i < full; i += 16) {
    prefetch_next(t, pstep, i / 16);
    float_chunk<F, R, C>(wr, static_cast<size_t>(i) * F::kSize, ac, static_cast<size_t>(i) * F::kSize, acc);
  }
  float_tail<F, R, C>(wr, ac, full, t.n, acc);
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) t.out[c * t.os + r] = fold16(acc[c * R + r][0], acc[c * R + r][1]);
}

// Prefill tile over the k range [k0, k1) (L1-resident, see matmul_float_blocked): the 16 lanes of pair
// (r, c) live in acc + (c * ld + r) * 16 between slices. Lanes 0..7 and 8..15 are independent
// accumulators, so the slice is run twice, once per half: one register per pair allows 2x4 tiles
// (0.75 loads per fma instead of 1.5). The order of the fmas per lane is unchanged.
template <class F, int R, int C>
void slice_float(const Tile& t, int64_t k0, int64_t k1, float* acc_mem, size_t ld) {
  const uint8_t* wr[R];
  const uint8_t* ac[C];
  for (int r = 0; r < R; ++r) wr[r] = t.w + r * t.ws;
  for (int c = 0; c < C; ++c) ac[c] = t.a + c * t.as;
  const int64_t full = k0 + (k1 - k0) / 16 * 16;
  // zero-padded copy of a final partial chunk
  alignas(32) uint8_t wbuf[R][64], abuf[C][64];
  const bool tail = full < k1;
  if (tail) {
    const size_t bytes = static_cast<size_t>(k1 - full) * F::kSize;
    for (int r = 0; r < R; ++r) std::memset(wbuf[r], 0, 64), std::memcpy(wbuf[r], wr[r] + full * F::kSize, bytes);
    for (int c = 0; c < C; ++c) std::memset(abuf[c], 0, 64), std::memcpy(abuf[c], ac[c] + full * F::kSize, bytes);
  }
#pragma GCC unroll 1
  for (int h = 0; h < 2; ++h) {
    __m256 acc[R * C];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c)
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[c * R + r] = _mm256_load_ps(acc_mem + (c * ld + r) * 16 + 8 * h);
    const size_t hoff = static_cast<size_t>(8 * h) * F::kSize;
    for (int64_t i = k0; i < full; i += 16) {
      const size_t off = static_cast<size_t>(i) * F::kSize + hoff;
      __m256 A[C];
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) A[c] = keep(F::load(ac[c] + off));
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256 W = F::load(wr[r] + off);
#pragma GCC unroll 4
        for (int c = 0; c < C; ++c) acc[c * R + r] = _mm256_fmadd_ps(W, A[c], acc[c * R + r]);
      }
    }
    if (tail) {
      __m256 A[C];
      for (int c = 0; c < C; ++c) A[c] = F::load(abuf[c] + hoff);
      for (int r = 0; r < R; ++r) {
        const __m256 W = F::load(wbuf[r] + hoff);
        for (int c = 0; c < C; ++c) acc[c * R + r] = _mm256_fmadd_ps(W, A[c], acc[c * R + r]);
      }
    }
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c)
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) _mm256_store_ps(acc_mem + (c * ld + r) * 16 + 8 * h, acc[c * R + r]);
  }
}

// ========================================= families =================================================

template <class Wt>
struct FamQ8_0 {
  static constexpr size_t row_bytes(int64_t n) { return static_cast<size_t>(n / 32) * Wt::kBytes; }
  template <int R, int C>
  static void tile(const Tile& t) { tile_q8_0<Wt, R, C>(t); }
  static constexpr int rows_for(int c) { return c == 1 ? 8 : c == 2 ? 4 : 2; }
  static constexpr int kRowBlock = 16;
  static constexpr bool kPrefetch = true;
};
template <class Wt>
struct FamQ8_1 {
  static constexpr size_t row_bytes(int64_t n) { return static_cast<size_t>(n / 32) * Wt::kBytes; }
  template <int R, int C>
  static void tile(const Tile& t) { tile_q8_1<Wt, R, C>(t); }
  static constexpr int rows_for(int c) { return c == 1 ? 8 : c == 2 ? 4 : 2; }
  static constexpr int kRowBlock = 16;
  static constexpr bool kPrefetch = true;
};
template <class K>
struct FamQ8_K {
  static constexpr size_t row_bytes(int64_t n) { return static_cast<size_t>(n / 256) * K::kBytes; }
  template <int R, int C>
  static void tile(const Tile& t) { tile_q8_k<K, R, C>(t); }
  static constexpr int rows_for(int c) { return c == 1 ? 8 : c == 2 ? 4 : 2; }
  static constexpr int kRowBlock = 16;
  static constexpr bool kPrefetch = true;
};
template <class F>
struct FamFloat {
  static constexpr bool kPrefetch = false;  // long rows: the hardware prefetcher does better alone
  static constexpr size_t row_bytes(int64_t n) { return static_cast<size_t>(n) * F::kSize; }
  template <int R, int C>
  static void tile(const Tile& t) { tile_float<F, R, C>(t); }
  template <int R, int C>
  static void slice(const Tile& t, int64_t k0, int64_t k1, float* acc, size_t ld) { slice_float<F, R, C>(t, k0, k1, acc, ld); }
  static constexpr int64_t kSlice = 512;   // k elements per pass: the row block's slice stays in L1
  static constexpr int kColGroup = 32;     // columns sharing one accumulator buffer
  static constexpr int rows_for(int c) { return c == 1 ? 4 : c == 2 ? 4 : 2; }
  static constexpr int kRowBlock = 8;
};

// ===================================== activation quantizers =======================================
FM_INLINE float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// 4 x 8 int32 (values within int8 range) -> 32 int8 in order.
FM_INLINE __m256i pack32(__m256i i0, __m256i i1, __m256i i2, __m256i i3) {
  const __m256i a = _mm256_packs_epi32(i0, i1), b = _mm256_packs_epi32(i2, i3);
  return _mm256_permutevar8x32_epi32(_mm256_packs_epi16(a, b), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

template <bool kQ81>
void quantize_q8_x(const float* x, void* dst, int64_t n) {
  uint8_t* y = static_cast<uint8_t*>(dst);
  const int bytes = kQ81 ? kQ8_1Bytes : kQ8_0Bytes;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t i = 0; i < n / 32; ++i, x += 32, y += bytes) {
    __m256 v[4];
    for (int j = 0; j < 4; ++j) v[j] = _mm256_loadu_ps(x + 8 * j);
    __m256 am = _mm256_andnot_ps(sign, v[0]);
    for (int j = 1; j < 4; ++j) am = _mm256_max_ps(am, _mm256_andnot_ps(sign, v[j]));
    const float amax = hmax8(am);
    const float d = amax / 127.0f;
    const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
    const __m256 mul = _mm256_set1_ps(id);
    __m256i q[4];
    for (int j = 0; j < 4; ++j) q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], mul));
    const uint16_t hd = static_cast<uint16_t>(_cvtss_sh(d, 0));
    std::memcpy(y, &hd, 2);
    if constexpr (kQ81) {
      __m256i s = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
      __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
      s4 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 1));
      const uint16_t hs = static_cast<uint16_t>(_cvtss_sh(d * static_cast<float>(_mm_cvtsi128_si32(s4)), 0));
      std::memcpy(y + 2, &hs, 2);
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + (kQ81 ? 4 : 2)), pack32(q[0], q[1], q[2], q[3]));
  }
}

void quantize_q8_k(const float* x, void* dst, int64_t n) {
  uint8_t* y = static_cast<uint8_t*>(dst);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t i = 0; i < n / 256; ++i, x += 256, y += kQ8K_Bytes) {
    __m256 am = _mm256_setzero_ps();
    for (int j = 0; j < 32; ++j) am = _mm256_max_ps(am, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + 8 * j)));
    const float amax = hmax8(am);
    if (amax == 0.0f) {
      std::memset(y, 0, kQ8K_Bytes);
      continue;
    }
    // the first element of largest magnitude gives the sign of the scale
    const __m256 amv = _mm256_set1_ps(amax);
    int first = 0;
    for (int j = 0; j < 32; ++j) {
      const int m = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + 8 * j)), amv, _CMP_EQ_OQ));
      if (m) {
        first = 8 * j + __builtin_ctz(static_cast<unsigned>(m));
        break;
      }
    }
    const float iscale = -127.0f / x[first];
    const __m256 is = _mm256_set1_ps(iscale);
    const __m256i lim = _mm256_set1_epi32(127);
    const __m256i ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
    int16_t bs[16];
    for (int j = 0; j < 8; ++j) {
      __m256i q[4];
      for (int k = 0; k < 4; ++k)
        q[k] = _mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(is, _mm256_loadu_ps(x + 32 * j + 8 * k))), lim);
      const __m256i p = pack32(q[0], q[1], q[2], q[3]);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + kQ8K_Qs + 32 * j), p);
      __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, p), ones16);  // sums of 4
      s = _mm256_hadd_epi32(s, s);
      s = _mm256_hadd_epi32(s, s);
      bs[2 * j] = static_cast<int16_t>(_mm256_extract_epi32(s, 0));
      bs[2 * j + 1] = static_cast<int16_t>(_mm256_extract_epi32(s, 4));
    }
    const float d = 1.0f / iscale;
    std::memcpy(y + kQ8K_D, &d, 4);
    std::memcpy(y + kQ8K_Bsums, bs, sizeof bs);
  }
}

void quantize_f16(const float* x, void* dst, int64_t n) {
  uint8_t* y = static_cast<uint8_t*>(dst);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(y + 2 * i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
  for (; i < n; ++i) {
    const uint16_t h = f32_to_f16(x[i]);
    std::memcpy(y + 2 * i, &h, 2);
  }
}

void quantize_bf16(const float* x, void* dst, int64_t n) {
  uint8_t* y = static_cast<uint8_t*>(dst);
  int64_t i = 0;
  const __m256i lsb = _mm256_set1_epi32(1), bias = _mm256_set1_epi32(0x7fff), abs = _mm256_set1_epi32(0x7fffffff);
  const __m256i inf = _mm256_set1_epi32(0x7f800000), quiet = _mm256_set1_epi32(0x40);
  for (; i + 16 <= n; i += 16) {
    __m256i r[2];
    for (int h = 0; h < 2; ++h) {
      const __m256i u = _mm256_castps_si256(_mm256_loadu_ps(x + i + 8 * h));
      const __m256i rounded =
          _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(bias, _mm256_and_si256(_mm256_srli_epi32(u, 16), lsb))), 16);
      const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, abs), inf);
      const __m256i qnan = _mm256_or_si256(_mm256_srli_epi32(u, 16), quiet);
      r[h] = _mm256_blendv_epi8(rounded, qnan, nan);
    }
    const __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(r[0], r[1]), 0xd8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + 2 * i), p);
  }
  for (; i < n; ++i) {
    const uint16_t h = f32_to_bf16(x[i]);
    std::memcpy(y + 2 * i, &h, 2);
  }
}

void quantize_f32(const float* x, void* dst, int64_t n) { std::memcpy(dst, x, static_cast<size_t>(n) * 4); }

}  // namespace

namespace detail {

MatmulTileFn avx2_matmul(DType w) {
  switch (w) {
    case DType::F32: return matmul_float_blocked<FamFloat<FF32>>;
    case DType::F16: return matmul_float_blocked<FamFloat<FF16>>;
    case DType::BF16: return matmul_float_blocked<FamFloat<FBF16>>;
    case DType::Q4_0: return matmul<FamQ8_0<WQ4_0>>;
    case DType::Q5_0: return matmul<FamQ8_0<WQ5_0>>;
    case DType::Q8_0: return matmul<FamQ8_0<WQ8_0>>;
    case DType::IQ4_NL: return matmul<FamQ8_0<WIQ4_NL>>;
    case DType::Q4_1: return matmul<FamQ8_1<WQ4_1>>;
    case DType::Q5_1: return matmul<FamQ8_1<WQ5_1>>;
    case DType::Q2_K: return matmul<FamQ8_K<KQ2>>;
    case DType::Q3_K: return matmul<FamQ8_K<KQ3>>;
    case DType::Q4_K: return matmul<FamQ8_K<KQ4>>;
    case DType::Q5_K: return matmul<FamQ8_K<KQ5>>;
    case DType::Q6_K: return matmul<FamQ8_K<KQ6>>;
    case DType::IQ4_XS: return matmul<FamQ8_K<KIQ4XS>>;
    default: return nullptr;
  }
}

QuantizeActFn avx2_quantize_act(DType act) {
  switch (act) {
    case DType::Q8_0: return quantize_q8_x<false>;
    case DType::Q8_1: return quantize_q8_x<true>;
    case DType::Q8_K: return quantize_q8_k;
    case DType::F16: return quantize_f16;
    case DType::BF16: return quantize_bf16;
    case DType::F32: return quantize_f32;
    default: return nullptr;
  }
}

}  // namespace detail
}  // namespace fitmoe::quant
