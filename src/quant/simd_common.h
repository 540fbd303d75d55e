// Internal to src/quant: the pieces the per-ISA kernel files share (needs AVX2 + FMA + F16C at least;
// include only from *_avx2.cpp / *_avx512.cpp). Everything is in an unnamed namespace: each ISA file
// gets its own copy compiled with its own flags (see quant/blocks.h).
//
// Tiles: a kernel computes R weight rows x C activation columns; pair k = c*R + r. The driver
// (matmul<Fam>) walks the output in tiles and hands each one its next tile's address for prefetching.
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <utility>

#include "quant/blocks.h"
#include "quant/kernels.h"

namespace fitmoe::quant {
namespace {

#define FM_INLINE inline __attribute__((always_inline))

struct Tile {
  int64_t n;
  const uint8_t* w;
  size_t ws;
  const uint8_t* a;
  size_t as;
  float* out;
  size_t os;
  const uint8_t* pf;  // first byte of the weights of the next tile to prefetch, or nullptr
  size_t pf_span;      // bytes from pf to the end of that tile's last row
};

// The hardware prefetcher does not follow R interleaved short row streams well, so each block
// iteration pulls an equal, sequential slice of the next tile's weights into L1 (in address order,
// which also lets the hardware stream prefetcher take over). step = prefetch_step(t, nb) once per tile.
FM_INLINE size_t prefetch_step(const Tile& t, int64_t nb) {
  return t.pf && nb > 0 ? ((t.pf_span + nb - 1) / static_cast<size_t>(nb) + 63) & ~size_t{63} : 0;
}
FM_INLINE void prefetch_next(const Tile& t, size_t step, int64_t b) {
  if (!t.pf) return;
  const size_t begin = static_cast<size_t>(b) * step;
  const size_t end = begin + step < t.pf_span ? begin + step : t.pf_span;
  for (size_t off = begin; off < end; off += 64) _mm_prefetch(reinterpret_cast<const char*>(t.pf + off), _MM_HINT_T0);
}

FM_INLINE __m256i ld256(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
FM_INLINE __m128i ld128(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }

// isum += v, kept as a sequential chain: without the empty asm GCC re-associates the unrolled sums into
// a wide tree of temporaries and spills most of them to the stack.
FM_INLINE __m256i acc_add(__m256i acc, __m256i v) {
  acc = _mm256_add_epi32(acc, v);
  __asm__("" : "+x"(acc));
  return acc;
}

// Pins a loaded vector in a register: GCC otherwise re-reads it from memory as an operand of every
// fma that uses it, turning a register-blocked tile into a load-bound one.
FM_INLINE __m256 keep(__m256 v) {
  __asm__("" : "+x"(v));
  return v;
}

// ---- constants -------------------------------------------------------------------------------------
// pshufb controls that broadcast int16 lane s (0..7) of a 128-bit-duplicated vector to all 16 lanes.
struct BcastTable {
  alignas(32) uint8_t b[8][32];
};
constexpr BcastTable make_bcast() {
  BcastTable t{};
  for (int s = 0; s < 8; ++s)
    for (int i = 0; i < 32; i += 2) t.b[s][i] = static_cast<uint8_t>(2 * s), t.b[s][i + 1] = static_cast<uint8_t>(2 * s + 1);
  return t;
}
alignas(32) constexpr BcastTable kBcast = make_bcast();

// For 16-value scale groups: chunk g (32 values = groups 2g, 2g+1 of a 128-bit-duplicated vector of 8
// int16 scales): low 128-bit lane gets scale 2g, high lane gets scale 2g+1.
struct PairTable {
  alignas(32) uint8_t b[4][32];
};
constexpr PairTable make_pair() {
  PairTable t{};
  for (int g = 0; g < 4; ++g)
    for (int i = 0; i < 16; i += 2) {
      t.b[g][i] = static_cast<uint8_t>(4 * g), t.b[g][i + 1] = static_cast<uint8_t>(4 * g + 1);
      t.b[g][16 + i] = static_cast<uint8_t>(4 * g + 2), t.b[g][16 + i + 1] = static_cast<uint8_t>(4 * g + 3);
    }
  return t;
}
alignas(32) constexpr PairTable kPair = make_pair();

FM_INLINE __m256i bcast16(__m256i v, int s) { return _mm256_shuffle_epi8(v, ld256(kBcast.b[s])); }
FM_INLINE __m256i pair16(__m256i v, int g) { return _mm256_shuffle_epi8(v, ld256(kPair.b[g])); }

// ---- reductions / lane layout ---------------------------------------------------------------------
// Lane k of the result = sum of the 8 int32 lanes of v[k] (exact).
FM_INLINE __m256i reduce8(const __m256i* v) {
  const __m256i t0 = _mm256_add_epi32(_mm256_unpacklo_epi32(v[0], v[1]), _mm256_unpackhi_epi32(v[0], v[1]));
  const __m256i t1 = _mm256_add_epi32(_mm256_unpacklo_epi32(v[2], v[3]), _mm256_unpackhi_epi32(v[2], v[3]));
  const __m256i t2 = _mm256_add_epi32(_mm256_unpacklo_epi32(v[4], v[5]), _mm256_unpackhi_epi32(v[4], v[5]));
  const __m256i t3 = _mm256_add_epi32(_mm256_unpacklo_epi32(v[6], v[7]), _mm256_unpackhi_epi32(v[6], v[7]));
  const __m256i u0 = _mm256_add_epi32(_mm256_unpacklo_epi64(t0, t1), _mm256_unpackhi_epi64(t0, t1));
  const __m256i u1 = _mm256_add_epi32(_mm256_unpacklo_epi64(t2, t3), _mm256_unpackhi_epi64(t2, t3));
  return _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20), _mm256_permute2x128_si256(u0, u1, 0x31));
}

// N halves at p[i] + off (N <= 8) -> floats in lanes 0..N-1 (others 0).
template <int N>
FM_INLINE __m256 halves(const uint8_t* const* p, size_t off) {
  uint64_t lo = 0, hi = 0;
#pragma GCC unroll 8
  for (int i = 0; i < N; ++i) {
    const uint64_t h = ld_u16(p[i] + off);
    if (i < 4) lo |= h << (16 * i);
    else hi |= h << (16 * (i - 4));
  }
  return _mm256_cvtph_ps(_mm_set_epi64x(static_cast<long long>(hi), static_cast<long long>(lo)));
}

// N floats at p[i] + off -> lanes 0..N-1.
template <int N>
FM_INLINE __m256 floats(const uint8_t* const* p, size_t off) {
  float v[8] = {};
#pragma GCC unroll 8
  for (int i = 0; i < N; ++i) v[i] = ld_f32(p[i] + off);
  return _mm256_setr_ps(v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7]);
}

// Per-row values (lanes 0..R-1) spread to pair lanes k -> k % R; per-column values to k -> k / R.
template <int R, int C>
FM_INLINE __m256 spread_rows(__m256 v) {
  if constexpr (R == 8) {
    return v;
  } else {
    constexpr auto I = [](int k) { return k < R * C ? k % R : 0; };
    return _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(I(0), I(1), I(2), I(3), I(4), I(5), I(6), I(7)));
  }
}
template <int R, int C>
FM_INLINE __m256 spread_cols(__m256 v) {
  if constexpr (C == 1) {
    return _mm256_broadcastss_ps(_mm256_castps256_ps128(v));
  } else {
    constexpr auto I = [](int k) { return k < R * C ? k / R : 0; };
    return _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(I(0), I(1), I(2), I(3), I(4), I(5), I(6), I(7)));
  }
}

template <int R, int C>
FM_INLINE void store_tile(__m256 acc, const Tile& t) {
  if constexpr (C == 1 && R == 8) {
    _mm256_storeu_ps(t.out, acc);
  } else {
    alignas(32) float v[8];
    _mm256_store_ps(v, acc);
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c)
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) t.out[c * t.os + r] = v[c * R + r];
  }
}

// ---- weight code unpacking helpers -----------------------------------------------------------------
// 16 bytes of nibbles -> 32 bytes: low nibbles (values 0..15) then high nibbles (values 16..31).
FM_INLINE __m256i nibbles32(const uint8_t* p) {
  const __m128i q = ld128(p);
  const __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(q), _mm_srli_epi16(q, 4), 1);
  return _mm256_and_si256(v, _mm256_set1_epi8(15));
}
// 32 bits -> 32 bytes, byte i = 0x10 if bit i is set else 0.
FM_INLINE __m256i bit4_from_bits(uint32_t bits) {
  const __m256i sel = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3,
                                       3, 3, 3, 3, 3, 3, 3);
  const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
  const __m256i v = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)), sel), bit);
  return _mm256_and_si256(_mm256_cmpeq_epi8(v, bit), _mm256_set1_epi8(0x10));
}
FM_INLINE __m256i iq4_table() {
  return _mm256_broadcastsi128_si256(ld128(reinterpret_cast<const uint8_t*>(kIQ4Values)));
}


// K-quant (Q4_K / Q5_K) 6-bit scales and mins as 8 bytes each.
FM_INLINE void k4_scales(const uint8_t* p, uint64_t* sc, uint64_t* mn) {
  const uint32_t a = ld_u32(p), b = ld_u32(p + 4), c = ld_u32(p + 8);
  const uint32_t s_lo = a & 0x3f3f3f3fu, m_lo = b & 0x3f3f3f3fu;
  const uint32_t s_hi = (c & 0x0f0f0f0fu) | (((a >> 6) & 0x03030303u) << 4);
  const uint32_t m_hi = ((c >> 4) & 0x0f0f0f0fu) | (((b >> 6) & 0x03030303u) << 4);
  *sc = s_lo | (static_cast<uint64_t>(s_hi) << 32);
  *mn = m_lo | (static_cast<uint64_t>(m_hi) << 32);
}

// Q3_K: the sixteen signed 6-bit scales as 16 bytes.
FM_INLINE __m128i q3k_scales(const uint8_t* p) {
  const uint32_t a = ld_u32(p), b = ld_u32(p + 4), c = ld_u32(p + 8);
  return _mm_sub_epi8(_mm_setr_epi32(static_cast<int>((a & 0x0f0f0f0fu) | ((c & 0x03030303u) << 4)),
                                     static_cast<int>((b & 0x0f0f0f0fu) | (((c >> 2) & 0x03030303u) << 4)),
                                     static_cast<int>(((a >> 4) & 0x0f0f0f0fu) | (((c >> 4) & 0x03030303u) << 4)),
                                     static_cast<int>(((b >> 4) & 0x0f0f0f0fu) | (((c >> 6) & 0x03030303u) << 4))),
                      _mm_set1_epi8(32));
}

// IQ4_XS: the eight signed 6-bit sub-block scales as 8 bytes.
FM_INLINE __m128i iq4xs_scales(const uint8_t* w) {
  const uint32_t sl = ld_u32(w + kIQ4XS_ScalesL), sh = ld_u16(w + kIQ4XS_ScalesH);
  uint64_t packed = 0;
#pragma GCC unroll 8
  for (int ib = 0; ib < 8; ++ib) {
    const uint32_t ls = ((sl >> (4 * ib)) & 15) | (((sh >> (2 * ib)) & 3) << 4);
    packed |= static_cast<uint64_t>(ls) << (8 * ib);
  }
  return _mm_sub_epi8(_mm_cvtsi64_si128(static_cast<long long>(packed)), _mm_set1_epi8(32));
}

// The canonical 16-lane float fold: lanes i + i+8, then + i+4, + i+2, + i+1 (lo holds lanes 0..7).
FM_INLINE float fold16(__m256 lo, __m256 hi) {
  const __m256 s8 = _mm256_add_ps(lo, hi);                                              // 16 -> 8
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));  // 8 -> 4
  s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));                                         // 4 -> 2
  s4 = _mm_add_ss(s4, _mm_shuffle_ps(s4, s4, 1));                                     // 2 -> 1
  return _mm_cvtss_f32(s4);
}

// ========================================= tile driver =============================================
using TileFn = void (*)(const Tile&);

template <class Fam>
constexpr int max_cols() {
  if constexpr (requires { Fam::kMaxCols; }) return Fam::kMaxCols;
  else return 4;
}

template <class Fam, int R, int C>
constexpr TileFn tile_entry() {
  if constexpr (R >= 1 && C >= 1 && C <= max_cols<Fam>() && R <= Fam::rows_for(C)) return &Fam::template tile<R, C>;
  else return nullptr;
}

template <class Fam>
struct TileTable {
  TileFn f[9][5];
};
template <class Fam, int... I>
constexpr TileTable<Fam> make_table(std::integer_sequence<int, I...>) {
  TileTable<Fam> t{};
  ((t.f[I / 5][I % 5] = tile_entry<Fam, I / 5, I % 5>()), ...);
  return t;
}

template <class Fam>
void matmul(int64_t n, const void* w, size_t ws, int nr, const void* act, size_t as, int nc, float* out, size_t os) {
  static constexpr TileTable<Fam> table = make_table<Fam>(std::make_integer_sequence<int, 45>{});
  const uint8_t* wb = static_cast<const uint8_t*>(w);
  const uint8_t* ab = static_cast<const uint8_t*>(act);
  const size_t rb = Fam::row_bytes(n);
  // bytes covered by a tile of `rows` rows (for prefetching; only when the rows are contiguous, else
  // the slices would cover the gaps between rows too)
  auto span = [&](int rows) -> size_t { return static_cast<size_t>(rows - 1) * ws + rb; };
  const bool prefetch = Fam::kPrefetch && ws == rb;
  constexpr int kC = max_cols<Fam>();
  if (nc == 1) {
    constexpr int R = Fam::rows_for(1);
    for (int r = 0; r < nr; r += R) {
      const int rr = nr - r < R ? nr - r : R;
      const int nxt = nr - (r + R) < R ? nr - (r + R) : R;
      Tile t{n, wb + r * ws, ws, ab, as, out + r, os, nullptr, 0};
      if (prefetch && nxt > 0) t.pf = wb + (r + R) * ws, t.pf_span = span(nxt);
      table.f[rr][1](t);
    }
    return;
  }
  // Prefill: blocks of kRowBlock rows stay cache-resident while every column tile passes over them;
  // the first column pass prefetches the next row tile.
  for (int r0 = 0; r0 < nr; r0 += Fam::kRowBlock) {
    const int rend = nr - r0 < Fam::kRowBlock ? nr : r0 + Fam::kRowBlock;
    for (int c = 0; c < nc;) {
      const int cc = nc - c < kC ? nc - c : kC;
      const int R = Fam::rows_for(cc);
      for (int r = r0; r < rend; r += R) {
        const int rr = rend - r < R ? rend - r : R;
        Tile t{n, wb + r * ws, ws, ab + c * as, as, out + c * os + r, os, nullptr, 0};
        if (prefetch && c == 0 && r + rr < nr) {
          const int nxt = nr - (r + rr) < R ? nr - (r + rr) : R;
          t.pf = wb + (r + rr) * ws, t.pf_span = span(nxt);
        }
        table.f[rr][cc](t);
      }
      c += cc;
    }
  }
}

// Float types with several columns: their rows are long (4 or 2 bytes a value), so the k dimension is
// cut into slices of Fam::kSlice values. For a block of kRowBlock rows and up to kColGroup columns,
// each slice of the block's weights is loaded into L1 once and used by every column tile, while the
// activations stream from L2; the 16 lanes per pair are parked in a buffer between slices. The order
// of the operations per lane is the same as in one pass (canonical order kept).
using SliceFn = void (*)(const Tile&, int64_t, int64_t, float*, size_t);
template <class Fam, int R, int C>
constexpr SliceFn slice_entry() {
  if constexpr (R >= 1 && C >= 1 && C <= max_cols<Fam>() && R <= Fam::rows_for(C)) return &Fam::template slice<R, C>;
  else return nullptr;
}
template <class Fam>
struct SliceTable {
  SliceFn f[9][5];
};
template <class Fam, int... I>
constexpr SliceTable<Fam> make_slice_table(std::integer_sequence<int, I...>) {
  SliceTable<Fam> t{};
  ((t.f[I / 5][I % 5] = slice_entry<Fam, I / 5, I % 5>()), ...);
  return t;
}

template <class Fam>
void matmul_float_blocked(int64_t n, const void* w, size_t ws, int nr, const void* act, size_t as, int nc, float* out,
                          size_t os) {
  if (nc == 1) {
    matmul<Fam>(n, w, ws, nr, act, as, nc, out, os);
    return;
  }
  static constexpr SliceTable<Fam> table = make_slice_table<Fam>(std::make_integer_sequence<int, 45>{});
  constexpr int RB = Fam::kRowBlock, CG = Fam::kColGroup, kC = max_cols<Fam>();
  alignas(64) float acc[CG * RB * 16];
  const uint8_t* wb = static_cast<const uint8_t*>(w);
  const uint8_t* ab = static_cast<const uint8_t*>(act);
  for (int r0 = 0; r0 < nr; r0 += RB) {
    const int rn = nr - r0 < RB ? nr - r0 : RB;
    for (int c0 = 0; c0 < nc; c0 += CG) {
      const int cn = nc - c0 < CG ? nc - c0 : CG;
      std::memset(acc, 0, sizeof acc);
      for (int64_t k0 = 0; k0 < n; k0 += Fam::kSlice) {
        const int64_t k1 = n - k0 < Fam::kSlice ? n : k0 + Fam::kSlice;
        for (int c = 0; c < cn;) {
          const int cc = cn - c < kC ? cn - c : kC;
          const int R = Fam::rows_for(cc);
          for (int r = 0; r < rn; r += R) {
            const int rr = rn - r < R ? rn - r : R;
            const Tile t{n, wb + (r0 + r) * ws, ws, ab + (c0 + c) * as, as, nullptr, 0, nullptr, 0};
            table.f[rr][cc](t, k0, k1, acc + (c * RB + r) * 16, RB);
          }
          c += cc;
        }
      }
      for (int c = 0; c < cn; ++c)
        for (int r = 0; r < rn; ++r) {
          const float* a = acc + (c * RB + r) * 16;
          out[(c0 + c) * os + r0 + r] = fold16(_mm256_load_ps(a), _mm256_load_ps(a + 8));
        }
    }
  }
}

}  // namespace
}  // namespace fitmoe::quant
