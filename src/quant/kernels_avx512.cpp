// AVX-512 (F + BW + VL + DQ) + VNNI kernels. Compiled with -mavx512f/bw/vl/dq/vnni (CMake:
// *_avx512.cpp) and only reached through the dispatcher after cpuid + XGETBV said yes.
//
// Structurally parallel to kernels_avx2.cpp: the same tiles (R rows x C columns, pair k = c*R + r),
// the same exact integer block sums reduced by a transpose-add tree, the same float epilogue (one fma
// per block per tile, 8 pair lanes) - hence bit-identical results to the reference and to AVX2.
// What changes is the inner product: one zmm covers 64 values, pmaddubsw + vpdpwssd (scaled
// sub-blocks of the K-quants) or a single vpdpbusd (32-value blocks, two blocks per zmm) replace the
// AVX2 pmaddubsw/pmaddwd/add chains, and the float types run 16 lanes per zmm.
// GCC 12's AVX-512 intrinsic headers pass an "undefined" vector as the masked-off source of many
// unmasked intrinsics and then warn about it (false positive).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#include "quant/kernels_isa.h"
#include "quant/simd_common.h"

namespace fitmoe::quant {
namespace {

FM_INLINE __m512i ld512(const uint8_t* p) { return _mm512_loadu_si512(p); }
FM_INLINE __m512i bcast256(const uint8_t* p) { return _mm512_broadcast_i64x4(ld256(p)); }
FM_INLINE __m512i zext(__m256i v) { return _mm512_zextsi256_si512(v); }

// acc + v as a sequential chain (see acc_add in simd_common.h).
FM_INLINE __m512i acc_add512(__m512i acc, __m512i v) {
  acc = _mm512_add_epi32(acc, v);
  __asm__("" : "+v"(acc));
  return acc;
}
// Pins a loaded vector in a register (see keep() in simd_common.h).
FM_INLINE __m512 keep512(__m512 v) {
  __asm__("" : "+v"(v));
  return v;
}
FM_INLINE __m512i dpwssd(__m512i acc, __m512i a, __m512i b) {
  acc = _mm512_dpwssd_epi32(acc, a, b);
  __asm__("" : "+v"(acc));
  return acc;
}

// Per-128-bit-lane 16-bit shift counts: lanes (c0, c1, c2, c3).
FM_INLINE __m512i lane_counts(int c0, int c1, int c2, int c3) {
  return _mm512_inserti64x4(
      _mm512_castsi256_si512(_mm256_setr_m128i(_mm_set1_epi16(static_cast<short>(c0)), _mm_set1_epi16(static_cast<short>(c1)))),
      _mm256_setr_m128i(_mm_set1_epi16(static_cast<short>(c2)), _mm_set1_epi16(static_cast<short>(c3))), 1);
}
// Per-128-bit-lane byte constants.
FM_INLINE __m512i lane_bytes(int c0, int c1, int c2, int c3) {
  return _mm512_inserti64x4(
      _mm512_castsi256_si512(_mm256_setr_m128i(_mm_set1_epi8(static_cast<char>(c0)), _mm_set1_epi8(static_cast<char>(c1)))),
      _mm256_setr_m128i(_mm_set1_epi8(static_cast<char>(c2)), _mm_set1_epi8(static_cast<char>(c3))), 1);
}
// pshufb control: 128-bit lane L broadcasts int16 word w[L] of that lane.
FM_INLINE __m512i word_select(int w0, int w1, int w2, int w3) {
  auto sel = [](int w) { return _mm_set1_epi16(static_cast<short>((2 * w) | ((2 * w + 1) << 8))); };
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_setr_m128i(sel(w0), sel(w1))),
                            _mm256_setr_m128i(sel(w2), sel(w3)), 1);
}

// Tree over 8 zmm vectors. S lanes (128-bit): [v0..3 lower half, v0..3 upper half, v4..7 lower, v4..7 upper].
FM_INLINE __m512i tree8_stage(const __m512i* v) {
  __m512i t[4];
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i)
    t[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]));
  const __m512i u0 = _mm512_add_epi32(_mm512_unpacklo_epi64(t[0], t[1]), _mm512_unpackhi_epi64(t[0], t[1]));
  const __m512i u1 = _mm512_add_epi32(_mm512_unpacklo_epi64(t[2], t[3]), _mm512_unpackhi_epi64(t[2], t[3]));
  const __m512i a = _mm512_shuffle_i64x2(u0, u1, _MM_SHUFFLE(2, 0, 2, 0));
  const __m512i b = _mm512_shuffle_i64x2(u0, u1, _MM_SHUFFLE(3, 1, 3, 1));
  return _mm512_add_epi32(a, b);
}
// Lane k = sum of all 16 lanes of v[k].
FM_INLINE __m256i reduce8_512(const __m512i* v) {
  const __m512i s = _mm512_shuffle_i64x2(tree8_stage(v), tree8_stage(v), _MM_SHUFFLE(3, 1, 2, 0));
  return _mm256_add_epi32(_mm512_castsi512_si256(s), _mm512_extracti64x4_epi64(s, 1));
}
// Lane k = sum of the lower 8 lanes of v[k]; lane 8 + k = sum of its upper 8 lanes.
FM_INLINE __m512i reduce8_halves(const __m512i* v) {
  const __m512i s = tree8_stage(v);
  return _mm512_shuffle_i64x2(s, s, _MM_SHUFFLE(3, 1, 2, 0));
}

// ================================== Q8_0-activation family =========================================
// Two 32-value blocks per zmm: bytes 0..31 block b, 32..63 block b+1. codes2() returns unsigned
// codes u with value = u - kOffset; the activation side starts each pair at -kOffset * sum(a), so a
// single vpdpbusd per pair yields the exact block sums.
FM_INLINE __m512i nibbles64(const uint8_t* p0, const uint8_t* p1) {
  const __m256i x = _mm256_inserti128_si256(_mm256_castsi128_si256(ld128(p0)), ld128(p1), 1);
  const __m512i z = _mm512_castsi256_si512(x);
  const __m512i d = _mm512_shuffle_i64x2(z, z, _MM_SHUFFLE(1, 1, 0, 0));
  return _mm512_and_si512(_mm512_srlv_epi16(d, lane_counts(0, 4, 0, 4)), _mm512_set1_epi8(15));
}
FM_INLINE __m512i iq4_table512(int bias) {
  return _mm512_add_epi8(_mm512_broadcast_i32x4(ld128(reinterpret_cast<const uint8_t*>(kIQ4Values))),
                         _mm512_set1_epi8(static_cast<char>(bias)));
}

struct V5Q4_0 {
  static constexpr int kBytes = 18, kOffset = 8;
  static FM_INLINE __m512i codes2(const uint8_t* b0, const uint8_t* b1) { return nibbles64(b0 + 2, b1 + 2); }
};
struct V5Q5_0 {
  static constexpr int kBytes = 22, kOffset = 16;
  static FM_INLINE __m512i codes2(const uint8_t* b0, const uint8_t* b1) {
    const __mmask64 hb = _cvtu64_mask64(static_cast<uint64_t>(ld_u32(b0 + 2)) | (static_cast<uint64_t>(ld_u32(b1 + 2)) << 32));
    const __m512i q = nibbles64(b0 + 6, b1 + 6);
    return _mm512_mask_add_epi8(q, hb, q, _mm512_set1_epi8(16));
  }
};
struct V5Q8_0 {
  static constexpr int kBytes = 34, kOffset = 128;
  static FM_INLINE __m512i codes2(const uint8_t* b0, const uint8_t* b1) {
    const __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(ld256(b0 + 2)), ld256(b1 + 2), 1);
    return _mm512_xor_si512(q, _mm512_set1_epi8(static_cast<char>(0x80)));
  }
};
struct V5IQ4_NL {
  static constexpr int kBytes = 18, kOffset = 128;
  static FM_INLINE __m512i codes2(const uint8_t* b0, const uint8_t* b1) {
    return _mm512_shuffle_epi8(iq4_table512(128), nibbles64(b0 + 2, b1 + 2));
  }
};

// Activation qs of blocks b and b+1 of a Q8_0 (34 B) or Q8_1 (36 B) row; `two` = false: block b+1 is zero.
template <int kBlock, int kQsOff>
FM_INLINE __m512i act2(const uint8_t* a, size_t ao, bool two) {
  const __m256i lo = ld256(a + ao + kQsOff);
  const __m256i hi = two ? ld256(a + ao + kBlock + kQsOff) : _mm256_setzero_si256();
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

template <class Wt, int R, int C>
void tile_q8_0(const Tile& t) {
  const int64_t nb = t.n / 32;
  const size_t pstep = prefetch_step(t, nb);
  const uint8_t* wr[R];
  const uint8_t* ac[C];
  for (int r = 0; r < R; ++r) wr[r] = t.w + r * t.ws;
  for (int c = 0; c < C; ++c) ac[c] = t.a + c * t.as;
  const __m512i off = _mm512_set1_epi8(static_cast<char>(Wt::kOffset));
  __m256 acc = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; b += 2) {
    const bool two = b + 1 < nb;
    const size_t wo = static_cast<size_t>(b) * Wt::kBytes, ao = static_cast<size_t>(b) * kQ8_0Bytes;
    prefetch_next(t, pstep, b);
    prefetch_next(t, pstep, b + 1);
    __m512i A[C], init[C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      A[c] = act2<kQ8_0Bytes, 2>(ac[c], ao, two);
      init[c] = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(_mm512_setzero_si512(), off, A[c]));
    }
    __m512i s[8];
#pragma GCC unroll 8
    for (int k = 0; k < 8; ++k) s[k] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      // for a single last block, point "block b+1" at block b: its codes meet zero activations
      const __m512i q = Wt::codes2(wr[r] + wo, wr[r] + wo + (two ? Wt::kBytes : 0));
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) s[c * R + r] = _mm512_dpbusd_epi32(init[c], q, A[c]);
    }
    const __m512 sums = _mm512_cvtepi32_ps(reduce8_halves(s));
    const __m256 dd0 = _mm256_mul_ps(spread_rows<R, C>(halves<R>(wr, wo)), spread_cols<R, C>(halves<C>(ac, ao)));
    acc = _mm256_fmadd_ps(_mm512_castps512_ps256(sums), dd0, acc);
    if (two) {
      const __m256 dd1 = _mm256_mul_ps(spread_rows<R, C>(halves<R>(wr, wo + Wt::kBytes)),
                                       spread_cols<R, C>(halves<C>(ac, ao + kQ8_0Bytes)));
      acc = _mm256_fmadd_ps(_mm512_extractf32x8_ps(sums, 1), dd1, acc);
    }
  }
  store_tile<R, C>(acc, t);
}

// ================================== Q8_1-activation family =========================================
struct V5Q4_1 {
  static constexpr int kBytes = 20;
  static FM_INLINE __m512i codes2(const uint8_t* b0, const uint8_t* b1) { return nibbles64(b0 + 4, b1 + 4); }
};
struct V5Q5_1 {
  static constexpr int kBytes = 24;
  static FM_INLINE __m512i codes2(const uint8_t* b0, const uint8_t* b1) {
    const __mmask64 hb = _cvtu64_mask64(static_cast<uint64_t>(ld_u32(b0 + 4)) | (static_cast<uint64_t>(ld_u32(b1 + 4)) << 32));
    const __m512i q = nibbles64(b0 + 8, b1 + 8);
    return _mm512_mask_add_epi8(q, hb, q, _mm512_set1_epi8(16));
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
  __m256 acc = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; b += 2) {
    const bool two = b + 1 < nb;
    const size_t wo = static_cast<size_t>(b) * Wt::kBytes, ao = static_cast<size_t>(b) * kQ8_1Bytes;
    prefetch_next(t, pstep, b);
    prefetch_next(t, pstep, b + 1);
    __m512i A[C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) A[c] = act2<kQ8_1Bytes, 4>(ac[c], ao, two);
    __m512i s[8];
#pragma GCC unroll 8
    for (int k = 0; k < 8; ++k) s[k] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512i q = Wt::codes2(wr[r] + wo, wr[r] + wo + (two ? Wt::kBytes : 0));
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) s[c * R + r] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q, A[c]);
    }
    const __m512 sums = _mm512_cvtepi32_ps(reduce8_halves(s));
    for (int h = 0; h < (two ? 2 : 1); ++h) {
      const size_t wb = wo + h * Wt::kBytes, abo = ao + h * kQ8_1Bytes;
      const __m256 dd = _mm256_mul_ps(spread_rows<R, C>(halves<R>(wr, wb)), spread_cols<R, C>(halves<C>(ac, abo)));
      acc = _mm256_fmadd_ps(h ? _mm512_extractf32x8_ps(sums, 1) : _mm512_castps512_ps256(sums), dd, acc);
      acc = _mm256_fmadd_ps(spread_rows<R, C>(halves<R>(wr, wb + 2)), spread_cols<R, C>(halves<C>(ac, abo + 2)), acc);
    }
  }
  store_tile<R, C>(acc, t);
}

// ================================== Q8_K-activation family =========================================
// block<R, C>() adds for pair k a zmm of 16 int32 whose lane sum is the pair's integer super-block sum
// (isum[k]) and, for types with mins, a ymm whose lane sum is the min sum (msum[k]).
FM_INLINE __m512i a_qs512(const uint8_t* a, int off) { return ld512(a + kQ8K_Qs + off); }

// 128-bit-lane broadcast of 8 int16 scales; pattern(v, w0..w3) picks word w[L] in lane L.
FM_INLINE __m512i scales512(__m128i s16) { return _mm512_broadcast_i32x4(s16); }

struct KQ4 {
  static constexpr int kBytes = kQ4K_Bytes, kD = kQ4K_D, kDmin = kQ4K_Dmin;
  static constexpr bool kHasMin = true;
  template <int R, int C>
  static FM_INLINE void block(const uint8_t* const* wb, const uint8_t* const* ab, __m512i* isum, __m256i* msum) {
    const __m512i m4 = _mm512_set1_epi8(15), cnt = lane_counts(0, 0, 4, 4);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const uint8_t* w = wb[r];
      uint64_t sc, mn;
      k4_scales(w + kQ4K_Scales, &sc, &mn);
      const __m512i scv = scales512(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<long long>(sc))));
      const __m128i m8 = _mm_cvtsi64_si128(static_cast<long long>(mn));
      const __m256i mnv = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m8, m8));
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) msum[c * R + r] = _mm256_madd_epi16(mnv, ld256(ab[c] + kQ8K_Bsums));
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        // values 64j..64j+31 = low nibbles of qs[32j..], 64j+32.. = high nibbles
        const __m512i q = _mm512_and_si512(_mm512_srlv_epi16(bcast256(w + kQ4K_Qs + 32 * j), cnt), m4);
        const __m512i sp = _mm512_shuffle_epi8(scv, word_select(2 * j, 2 * j, 2 * j + 1, 2 * j + 1));
#pragma GCC unroll 4
        for (int c = 0; c < C; ++c)
          isum[c * R + r] = dpwssd(isum[c * R + r], _mm512_maddubs_epi16(q, a_qs512(ab[c], 64 * j)), sp);
      }
    }
  }
};

struct KQ5 {
  static constexpr int kBytes = kQ5K_Bytes, kD = kQ5K_D, kDmin = kQ5K_Dmin;
  static constexpr bool kHasMin = true;
  template <int R, int C>
  static FM_INLINE void block(const uint8_t* const* wb, const uint8_t* const* ab, __m512i* isum, __m256i* msum) {
    const __m512i m4 = _mm512_set1_epi8(15), cnt = lane_counts(0, 0, 4, 4), sixteen = _mm512_set1_epi8(16);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const uint8_t* w = wb[r];
      uint64_t sc, mn;
      k4_scales(w + kQ5K_Scales, &sc, &mn);
      const __m512i scv = scales512(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<long long>(sc))));
      const __m128i m8 = _mm_cvtsi64_si128(static_cast<long long>(mn));
      const __m256i mnv = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m8, m8));
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) msum[c * R + r] = _mm256_madd_epi16(mnv, ld256(ab[c] + kQ8K_Bsums));
      const __m512i qh = bcast256(w + kQ5K_Qh);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        __m512i q = _mm512_and_si512(_mm512_srlv_epi16(bcast256(w + kQ5K_Qs + 32 * j), cnt), m4);
        const __mmask64 hb = _mm512_test_epi8_mask(qh, lane_bytes(1 << (2 * j), 1 << (2 * j), 2 << (2 * j), 2 << (2 * j)));
        q = _mm512_mask_add_epi8(q, hb, q, sixteen);
        const __m512i sp = _mm512_shuffle_epi8(scv, word_select(2 * j, 2 * j, 2 * j + 1, 2 * j + 1));
#pragma GCC unroll 4
        for (int c = 0; c < C; ++c)
          isum[c * R + r] = dpwssd(isum[c * R + r], _mm512_maddubs_epi16(q, a_qs512(ab[c], 64 * j)), sp);
      }
    }
  }
};

struct KQ6 {
  static constexpr int kBytes = kQ6K_Bytes, kD = kQ6K_D, kDmin = 0;
  static constexpr bool kHasMin = false;
  template <int R, int C>
  static FM_INLINE void block(const uint8_t* const* wb, const uint8_t* const* ab, __m512i* isum, __m256i*) {
    const __m512i m4 = _mm512_set1_epi8(15), m30 = _mm512_set1_epi8(0x30);
    const __m512i up_a = lane_counts(4, 4, 2, 2), down_b = lane_counts(0, 0, 2, 2);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const uint8_t* w = wb[r];
      const __m128i sc8 = ld128(w + kQ6K_Scales);
      const __m256i sc16 = _mm256_cvtepi8_epi16(sc8);
      // codes are q6 in 0..63 (value q6 - 32): start at -32 * sum_g scale_g * bsum_g
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c)
        isum[c * R + r] = _mm512_sub_epi32(
            isum[c * R + r], zext(_mm256_slli_epi32(_mm256_madd_epi16(sc16, ld256(ab[c] + kQ8K_Bsums)), 5)));
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const __m512i sv = scales512(_mm_cvtepi8_epi16(h ? _mm_unpackhi_epi64(sc8, sc8) : sc8));
        const __m512i ql = ld512(w + kQ6K_Ql + 64 * h);  // [ql0 | ql1]
        const __m512i qh = bcast256(w + kQ6K_Qh + 32 * h);
        __m512i v[2];
        v[0] = _mm512_or_si512(_mm512_and_si512(ql, m4), _mm512_and_si512(_mm512_sllv_epi16(qh, up_a), m30));
        v[1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), m4),
                               _mm512_and_si512(_mm512_srlv_epi16(qh, down_b), m30));
#pragma GCC unroll 2
        for (int e = 0; e < 2; ++e) {
          const __m512i sp = _mm512_shuffle_epi8(sv, word_select(4 * e, 4 * e + 1, 4 * e + 2, 4 * e + 3));
#pragma GCC unroll 4
          for (int c = 0; c < C; ++c)
            isum[c * R + r] = dpwssd(isum[c * R + r], _mm512_maddubs_epi16(v[e], a_qs512(ab[c], 128 * h + 64 * e)), sp);
        }
      }
    }
  }
};

struct KQ3 {
  static constexpr int kBytes = kQ3K_Bytes, kD = kQ3K_D, kDmin = 0;
  static constexpr bool kHasMin = false;
  template <int R, int C>
  static FM_INLINE void block(const uint8_t* const* wb, const uint8_t* const* ab, __m512i* isum, __m256i*) {
    const __m512i m3 = _mm512_set1_epi8(3), four = _mm512_set1_epi8(4);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const uint8_t* w = wb[r];
      const __m128i sc8 = q3k_scales(w + kQ3K_Scales);
      const __m256i sc16 = _mm256_cvtepi8_epi16(sc8);
      // codes are value + 4 in 0..7: start at -4 * sum_g scale_g * bsum_g
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c)
        isum[c * R + r] = _mm512_sub_epi32(
            isum[c * R + r], zext(_mm256_slli_epi32(_mm256_madd_epi16(sc16, ld256(ab[c] + kQ8K_Bsums)), 2)));
      const __m512i hm = bcast256(w + kQ3K_Hmask);
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const __m512i sv = scales512(_mm_cvtepi8_epi16(h ? _mm_unpackhi_epi64(sc8, sc8) : sc8));
        const __m512i q = bcast256(w + kQ3K_Qs + 32 * h);
#pragma GCC unroll 2
        for (int e = 0; e < 2; ++e) {
          // 64 values: shift groups 2e (lower half) and 2e+1 (upper half)
          const int g0 = 2 * e, g1 = 2 * e + 1;
          __m512i u = _mm512_and_si512(_mm512_srlv_epi16(q, lane_counts(2 * g0, 2 * g0, 2 * g1, 2 * g1)), m3);
          const __mmask64 hb = _mm512_test_epi8_mask(
              hm, lane_bytes(1 << (4 * h + g0), 1 << (4 * h + g0), 1 << (4 * h + g1), 1 << (4 * h + g1)));
          u = _mm512_mask_add_epi8(u, hb, u, four);
          const __m512i sp = _mm512_shuffle_epi8(sv, word_select(4 * e, 4 * e + 1, 4 * e + 2, 4 * e + 3));
#pragma GCC unroll 4
          for (int c = 0; c < C; ++c)
            isum[c * R + r] = dpwssd(isum[c * R + r], _mm512_maddubs_epi16(u, a_qs512(ab[c], 128 * h + 64 * e)), sp);
        }
      }
    }
  }
};

struct KQ2 {
  static constexpr int kBytes = kQ2K_Bytes, kD = kQ2K_D, kDmin = kQ2K_Dmin;
  static constexpr bool kHasMin = true;
  template <int R, int C>
  static FM_INLINE void block(const uint8_t* const* wb, const uint8_t* const* ab, __m512i* isum, __m256i* msum) {
    const __m512i m3 = _mm512_set1_epi8(3);
    const __m128i m4 = _mm_set1_epi8(15);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const uint8_t* w = wb[r];
      const __m128i s8 = ld128(w + kQ2K_Scales);
      const __m128i sc8 = _mm_and_si128(s8, m4);
      const __m256i mn16 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(s8, 4), m4));
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) msum[c * R + r] = _mm256_madd_epi16(mn16, ld256(ab[c] + kQ8K_Bsums));
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const __m512i sv = scales512(_mm_cvtepu8_epi16(h ? _mm_unpackhi_epi64(sc8, sc8) : sc8));
        const __m512i q = bcast256(w + kQ2K_Qs + 32 * h);
#pragma GCC unroll 2
        for (int e = 0; e < 2; ++e) {
          const int g0 = 2 * e, g1 = 2 * e + 1;
          const __m512i u = _mm512_and_si512(_mm512_srlv_epi16(q, lane_counts(2 * g0, 2 * g0, 2 * g1, 2 * g1)), m3);
          const __m512i sp = _mm512_shuffle_epi8(sv, word_select(4 * e, 4 * e + 1, 4 * e + 2, 4 * e + 3));
#pragma GCC unroll 4
          for (int c = 0; c < C; ++c)
            isum[c * R + r] = dpwssd(isum[c * R + r], _mm512_maddubs_epi16(u, a_qs512(ab[c], 128 * h + 64 * e)), sp);
        }
      }
    }
  }
};

struct KIQ4XS {
  static constexpr int kBytes = kIQ4XS_Bytes, kD = kIQ4XS_D, kDmin = 0;
  static constexpr bool kHasMin = false;
  template <int R, int C>
  static FM_INLINE void block(const uint8_t* const* wb, const uint8_t* const* ab, __m512i* isum, __m256i*) {
    const __m512i tab = iq4_table512(0);
    const __m512i abs_tab = _mm512_abs_epi8(tab);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const uint8_t* w = wb[r];
      const __m512i scv = scales512(_mm_cvtepi8_epi16(iq4xs_scales(w)));
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        // sub-blocks 2j (qs bytes 0..15) and 2j+1 (16..31) -> values [lo(2j), hi(2j), lo(2j+1), hi(2j+1)]
        const uint8_t* q = w + kIQ4XS_Qs + 32 * j;
        const __m512i idx = nibbles64(q, q + 16);
        const __m512i av = _mm512_shuffle_epi8(abs_tab, idx);
        const __mmask64 neg = _mm512_movepi8_mask(_mm512_shuffle_epi8(tab, idx));
        const __m512i sp = _mm512_shuffle_epi8(scv, word_select(2 * j, 2 * j, 2 * j + 1, 2 * j + 1));
#pragma GCC unroll 4
        for (int c = 0; c < C; ++c) {
          const __m512i a = a_qs512(ab[c], 64 * j);
          const __m512i sa = _mm512_mask_sub_epi8(a, neg, _mm512_setzero_si512(), a);
          isum[c * R + r] = dpwssd(isum[c * R + r], _mm512_maddubs_epi16(av, sa), sp);
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
    __m512i isum[8];
    __m256i msum[8];
#pragma GCC unroll 8
    for (int k = 0; k < 8; ++k) isum[k] = _mm512_setzero_si512(), msum[k] = _mm256_setzero_si256();
    K::template block<R, C>(wb, ab, isum, msum);
    const __m256 da = spread_cols<R, C>(floats<C>(ab, kQ8K_D));
    const __m256 dd = _mm256_mul_ps(spread_rows<R, C>(halves<R>(wb, K::kD)), da);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(reduce8_512(isum)), dd, acc);
    if constexpr (K::kHasMin) {
      const __m256 dm = _mm256_mul_ps(spread_rows<R, C>(halves<R>(wb, K::kDmin)), da);
      const __m256i neg = _mm256_sub_epi32(_mm256_setzero_si256(), reduce8(msum));
      acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(neg), dm, acc);
    }
  }
  store_tile<R, C>(acc, t);
}

// ======================================== float types ==============================================
// 16 canonical lanes per pair = one zmm accumulator.
struct G32 {
  static constexpr int kSize = 4;
  static FM_INLINE __m512 load(const uint8_t* p) { return _mm512_loadu_ps(p); }
  static FM_INLINE __m512 load_part(const uint8_t* p, int cnt) {
    return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << cnt) - 1), p);
  }
};
struct G16 {
  static constexpr int kSize = 2;
  static FM_INLINE __m512 load(const uint8_t* p) { return _mm512_cvtph_ps(ld256(p)); }
  static FM_INLINE __m512 load_part(const uint8_t* p, int cnt) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << cnt) - 1), p));
  }
};
struct GBF16 {
  static constexpr int kSize = 2;
  static FM_INLINE __m512 widen(__m256i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16)); }
  static FM_INLINE __m512 load(const uint8_t* p) { return widen(ld256(p)); }
  static FM_INLINE __m512 load_part(const uint8_t* p, int cnt) {
    return widen(_mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << cnt) - 1), p));
  }
};

template <class F, int R, int C>
void tile_float(const Tile& t) {
  const uint8_t* wr[R];
  const uint8_t* ac[C];
  for (int r = 0; r < R; ++r) wr[r] = t.w + r * t.ws;
  for (int c = 0; c < C; ++c) ac[c] = t.a + c * t.as;
  __m512 acc[R * C];
#pragma GCC unroll 16
  for (int k = 0; k < R * C; ++k) acc[k] = _mm512_setzero_ps();
  const int64_t full = t.n / 16 * 16;
  const size_t pstep = prefetch_step(t, t.n / 16);
  for (int64_t i = 0; i < full; i += 16) {
    prefetch_next(t, pstep, i / 16);
    const size_t off = static_cast<size_t>(i) * F::kSize;
    __m512 A[C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) A[c] = keep512(F::load(ac[c] + off));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 W = F::load(wr[r] + off);
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) acc[c * R + r] = _mm512_fmadd_ps(W, A[c], acc[c * R + r]);
    }
  }
  if (full < t.n) {  // masked (zero-filled) tail, as the canonical order pads with zeros
    const int cnt = static_cast<int>(t.n - full);
    const size_t off = static_cast<size_t>(full) * F::kSize;
    __m512 A[C];
    for (int c = 0; c < C; ++c) A[c] = F::load_part(ac[c] + off, cnt);
    for (int r = 0; r < R; ++r) {
      const __m512 W = F::load_part(wr[r] + off, cnt);
      for (int c = 0; c < C; ++c) acc[c * R + r] = _mm512_fmadd_ps(W, A[c], acc[c * R + r]);
    }
  }
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) {
      const __m512 v = acc[c * R + r];
      t.out[c * t.os + r] = fold16(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
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
  static constexpr int rows_for(int c) { return c == 1 ? 8 : 4; }
  static constexpr int kRowBlock = 8;
};

// ===================================== activation quantizers =======================================
void quantize_f16_512(const float* x, void* dst, int64_t n) {
  uint8_t* y = static_cast<uint8_t*>(dst);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + 2 * i), _mm512_cvtps_ph(_mm512_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
  if (i < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1);
    _mm256_mask_storeu_epi16(y + 2 * i, m, _mm512_cvtps_ph(_mm512_maskz_loadu_ps(m, x + i), _MM_FROUND_TO_NEAREST_INT));
  }
}

void quantize_bf16_512(const float* x, void* dst, int64_t n) {
  uint8_t* y = static_cast<uint8_t*>(dst);
  const __m512i lsb = _mm512_set1_epi32(1), bias = _mm512_set1_epi32(0x7fff), quiet = _mm512_set1_epi32(0x40);
  const __m512i absmask = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512i u = _mm512_castps_si512(_mm512_maskz_loadu_ps(m, x + i));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(bias, _mm512_and_si512(_mm512_srli_epi32(u, 16), lsb))), 16);
    const __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, absmask), inf);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), quiet));
    _mm256_mask_storeu_epi16(y + 2 * i, m, _mm512_cvtepi32_epi16(r));
  }
}

}  // namespace

namespace detail {

MatmulTileFn avx512_matmul(DType w) {
  switch (w) {
    case DType::F32: return matmul<FamFloat<G32>>;
    case DType::F16: return matmul<FamFloat<G16>>;
    case DType::BF16: return matmul<FamFloat<GBF16>>;
    case DType::Q4_0: return matmul<FamQ8_0<V5Q4_0>>;
    case DType::Q5_0: return matmul<FamQ8_0<V5Q5_0>>;
    case DType::Q8_0: return matmul<FamQ8_0<V5Q8_0>>;
    case DType::IQ4_NL: return matmul<FamQ8_0<V5IQ4_NL>>;
    case DType::Q4_1: return matmul<FamQ8_1<V5Q4_1>>;
    case DType::Q5_1: return matmul<FamQ8_1<V5Q5_1>>;
    case DType::Q2_K: return matmul<FamQ8_K<KQ2>>;
    case DType::Q3_K: return matmul<FamQ8_K<KQ3>>;
    case DType::Q4_K: return matmul<FamQ8_K<KQ4>>;
    case DType::Q5_K: return matmul<FamQ8_K<KQ5>>;
    case DType::Q6_K: return matmul<FamQ8_K<KQ6>>;
    case DType::IQ4_XS: return matmul<FamQ8_K<KIQ4XS>>;
    default: return nullptr;
  }
}

// Q8_0 / Q8_1 / Q8_K / F32 fall back to the AVX2 quantizers (the dispatcher does that on nullptr).
QuantizeActFn avx512_quantize_act(DType act) {
  switch (act) {
    case DType::F16: return quantize_f16_512;
    case DType::BF16: return quantize_bf16_512;
    default: return nullptr;
  }
}

}  // namespace detail
}  // namespace fitmoe::quant
