// Synthetic weights: random but well-formed blocks at memory speed.
//
// Every byte of a row is first filled with a xoshiro256++ stream (so all codes, sub-block scales and
// mins are uniform), then each block's f16 super-scale(s) are overwritten: d = base * (0.5 + u) with u
// uniform in [0, 1) and base chosen from the second moment of the decoded value for unit d, so that
// the decoded standard deviation is about `stddev`. For the types with a min (Q4_1, Q5_1, Q2_K,
// Q4_K, Q5_K) the min is set to centre the values on zero. Float types draw from a 4096-entry table of
// normal samples (f32; 256 quantiles of it for f16/bf16), scaled and converted once per call.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "quant/blocks.h"
#include "quant/kernels.h"
#include "runtime/error.h"

namespace fitmoe::quant {
namespace {

// xoshiro256++ (seeded through splitmix64): a few adds, shifts and rotates per 64-bit word.
struct Rng {
  uint64_t s[4];
  explicit Rng(uint64_t seed) {
    for (uint64_t& x : s) {
      uint64_t z = (seed += 0x9e3779b97f4a7c15ull);
      z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
      z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
      x = z ^ (z >> 31);
    }
  }
  static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  uint64_t next() {
    const uint64_t result = rotl(s[0] + s[3], 23) + s[0];
    const uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return result;
  }
};

// (Generators are used through a local copy: writes through the uint8_t output pointer may alias
// anything, which would otherwise force the state through memory on every word.)
void fill_bytes(Rng& state, uint8_t* p, size_t n) {
  Rng rng = state;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const uint64_t v = rng.next();
    std::memcpy(p + i, &v, 8);
  }
  if (i < n) {
    const uint64_t v = rng.next();
    std::memcpy(p + i, &v, n - i);
  }
  state = rng;
}

// Mean of x^2 over the integers lo..hi.
double msq(int lo, int hi) {
  double s = 0;
  for (int x = lo; x <= hi; ++x) s += static_cast<double>(x) * x;
  return s / (hi - lo + 1);
}
double mean(int lo, int hi) { return 0.5 * (lo + hi); }
// E[(s*q - ratio*m)^2] for independent uniform s, m in 0..smax and q in 0..qmax, ratio = E[q].
double scale_min_m2(int smax, int qmax) {
  const double ratio = mean(0, qmax), es = mean(0, smax), es2 = msq(0, smax);
  return es2 * msq(0, qmax) - 2 * ratio * es * mean(0, qmax) * es + ratio * ratio * es2;
}
double iq4_m2() {
  double s = 0;
  for (int8_t v : kIQ4Values) s += static_cast<double>(v) * v;
  return s / 16;
}

// Second moment of the decoded value with unit super-scale, and the min/scale ratio (0: no min).
struct Moments {
  double m2;
  double min_ratio;
};
Moments unit_moments(DType t) {
  switch (t) {
    case DType::Q4_0: return {msq(-8, 7), 0};
    case DType::Q4_1: return {msq(0, 15) - 7.5 * 7.5, 7.5};
    case DType::Q5_0: return {msq(-16, 15), 0};
    case DType::Q5_1: return {msq(0, 31) - 15.5 * 15.5, 15.5};
    case DType::Q8_0: return {msq(-128, 127), 0};
    case DType::Q2_K: return {scale_min_m2(15, 3), 1.5};
    case DType::Q3_K: return {msq(-32, 31) * msq(-4, 3), 0};
    case DType::Q4_K: return {scale_min_m2(63, 15), 7.5};
    case DType::Q5_K: return {scale_min_m2(63, 31), 15.5};
    case DType::Q6_K: return {msq(-128, 127) * msq(-32, 31), 0};
    case DType::IQ4_NL: return {iq4_m2(), 0};
    case DType::IQ4_XS: return {msq(-32, 31) * iq4_m2(), 0};
    default: return {0, 0};
  }
}

// Positive finite f16 close to v (subnormal halves are allowed: real Q6_K / IQ4_XS files with small
// weights have them too; below the smallest subnormal the scale is clamped).
uint16_t pos_f16(float v) {
  uint16_t h = f32_to_f16(v > 65504.0f ? 65504.0f : v);
  if (!(v > 0) || h == 0) h = 1;  // smallest positive subnormal
  return h;
}

void put_f16(uint8_t* p, uint16_t h) { std::memcpy(p, &h, 2); }

// 4096 samples of a normal distribution (Box-Muller on a fixed stream, rescaled to exactly zero mean and
// unit variance), built once; small enough to stay in L1 while filling.
constexpr int kTableBits = 12;
constexpr uint64_t kTableMask = (1u << kTableBits) - 1;
const std::vector<float>& normal_table() {
  static const std::vector<float> table = [] {
    std::vector<float> t(size_t{1} << kTableBits);
    Rng rng(0x243f6a8885a308d3ull);
    for (size_t i = 0; i < t.size(); i += 2) {
      const double u1 = (static_cast<double>(rng.next() >> 11) + 1.0) * (1.0 / 9007199254740992.0);
      const double u2 = static_cast<double>(rng.next() >> 11) * (1.0 / 9007199254740992.0);
      const double r = std::sqrt(-2.0 * std::log(u1));
      t[i] = static_cast<float>(r * std::cos(6.283185307179586 * u2));
      t[i + 1] = static_cast<float>(r * std::sin(6.283185307179586 * u2));
    }
    double s1 = 0, s2 = 0;
    for (float v : t) s1 += v, s2 += static_cast<double>(v) * v;
    const double mean = s1 / t.size(), sd = std::sqrt(s2 / t.size() - mean * mean);
    for (float& v : t) v = static_cast<float>((v - mean) / sd);
    return t;
  }();
  return table;
}

// f32: four table indices (12 of each 16 bits) per 64-bit random word.
void fill_float(DType t, uint8_t* dst, size_t count, float stddev, Rng state) {
  Rng rng = state;
  const std::vector<float>& unit = normal_table();
  size_t i = 0;
  if (t == DType::F32) {
    alignas(64) float tab[size_t{1} << kTableBits];
    for (size_t k = 0; k < unit.size(); ++k) tab[k] = unit[k] * stddev;
    for (; i + 4 <= count; i += 4) {
      const uint64_t v = rng.next();
      const float q[4] = {tab[v & kTableMask], tab[(v >> 16) & kTableMask], tab[(v >> 32) & kTableMask],
                          tab[(v >> 48) & kTableMask]};
      std::memcpy(dst + 4 * i, q, 16);
    }
    for (; i < count; ++i) std::memcpy(dst + 4 * i, &tab[rng.next() & kTableMask], 4);
    return;
  }
  // halves: 256 levels (every 16th sample of the sorted table, i.e. normal quantiles), one random
  // byte per value: 16 bytes of output per random word
  static const std::vector<float> sorted = [&] {
    std::vector<float> v(unit);
    std::sort(v.begin(), v.end());
    return v;
  }();
  alignas(64) uint16_t tab[256];
  for (size_t k = 0; k < 256; ++k) {
    const float v = sorted[16 * k + 8] * stddev;
    tab[k] = t == DType::F16 ? f32_to_f16(v) : f32_to_bf16(v);
  }
  for (; i + 8 <= count; i += 8) {
    const uint64_t v = rng.next();
    uint64_t lo = 0, hi = 0;  // composed in registers (separate small stores would stall the reload)
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) {
      lo |= static_cast<uint64_t>(tab[(v >> (8 * k)) & 0xff]) << (16 * k);
      hi |= static_cast<uint64_t>(tab[(v >> (8 * k + 32)) & 0xff]) << (16 * k);
    }
    std::memcpy(dst + 2 * i, &lo, 8);
    std::memcpy(dst + 2 * i + 8, &hi, 8);
  }
  for (; i < count; ++i) std::memcpy(dst + 2 * i, &tab[rng.next() & 0xff], 2);
}

}  // namespace

void fill_random_rows(DType t, void* dst, int64_t nrows, int64_t ncols, float stddev, uint64_t seed) {
  const DTypeInfo& info = dtype_info(t);
  if (!info.weight_type) throw Error(std::string("fill_random_rows: not a weight type: ") + info.name);
  if (ncols % info.block_size != 0) throw Error("fill_random_rows: row length not a multiple of the block size");
  Rng rng(seed ^ 0x6a09e667f3bcc909ull);
  uint8_t* y = static_cast<uint8_t*>(dst);
  const size_t total = static_cast<size_t>(nrows) * row_bytes(t, ncols);
  if (is_float_type(t)) {
    fill_float(t, y, static_cast<size_t>(nrows * ncols), stddev, rng);
    return;
  }
  const Moments mo = unit_moments(t);
  // E[(0.5 + u)^2] = 13/12 for u uniform in [0, 1)
  const float base = static_cast<float>(stddev / std::sqrt(mo.m2 * 13.0 / 12.0));
  const size_t nblocks = total / info.block_bytes;
  const size_t bb = info.block_bytes;
  // Offsets of the super-scale and of the min field (-1 if none) inside a block.
  int d_off = 0, min_off = -1;
  switch (t) {
    case DType::Q4_1: case DType::Q5_1: min_off = 2; break;
    case DType::Q2_K: d_off = kQ2K_D; min_off = kQ2K_Dmin; break;
    case DType::Q3_K: d_off = kQ3K_D; break;
    case DType::Q4_K: d_off = kQ4K_D; min_off = kQ4K_Dmin; break;
    case DType::Q5_K: d_off = kQ5K_D; min_off = kQ5K_Dmin; break;
    case DType::Q6_K: d_off = kQ6K_D; break;
    case DType::IQ4_XS: d_off = kIQ4XS_D; break;
    default: break;
  }
  const bool min_negative = t == DType::Q4_1 || t == DType::Q5_1;  // q*d + m: m = -ratio*d
  // 256 possible super-scales (and matching mins), picked per block by one random byte.
  uint16_t dtab[256], mtab[256];
  for (int i = 0; i < 256; ++i) {
    dtab[i] = pos_f16(base * (0.5f + (static_cast<float>(i) + 0.5f) / 256.0f));
    const uint16_t hm = pos_f16(static_cast<float>(mo.min_ratio) * f16_to_f32(dtab[i]));
    mtab[i] = min_negative ? static_cast<uint16_t>(hm | 0x8000u) : hm;
  }
  // Process in chunks so the scale fix-up touches cache-hot bytes.
  constexpr size_t kChunkBlocks = 256;
  for (size_t b0 = 0; b0 < nblocks; b0 += kChunkBlocks) {
    const size_t nb = nblocks - b0 < kChunkBlocks ? nblocks - b0 : kChunkBlocks;
    uint8_t* p = y + b0 * bb;
    fill_bytes(rng, p, nb * bb);
    uint64_t pick = 0;
    for (size_t i = 0; i < nb; ++i, p += bb) {
      if (i % 8 == 0) pick = rng.next();
      const int k = static_cast<int>(pick & 0xff);
      pick >>= 8;
      put_f16(p + d_off, dtab[k]);
      if (min_off >= 0) put_f16(p + min_off, mtab[k]);
    }
  }
}

}  // namespace fitmoe::quant
