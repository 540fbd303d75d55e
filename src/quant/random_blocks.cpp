// Synthetic weights: random but well-formed blocks at memory speed.
//
// Every byte of a row is first filled with a splitmix64 stream (so all codes, sub-block scales and
// mins are uniform), then each block's f16 super-scale(s) are overwritten: d = base * (0.5 + u) with u
// uniform in [0, 1) and base chosen from the second moment of the decoded value for unit d, so that
// the decoded standard deviation is about `stddev`. For the types with a min (Q4_1, Q5_1, Q2_K,
// Q4_K, Q5_K) the min is set to centre the values on zero. Float types draw from a 65536-entry table of
// normal samples (scaled, converted once per call).
#include <cmath>
#include <cstring>
#include <vector>

#include "quant/blocks.h"
#include "quant/kernels.h"
#include "runtime/error.h"

namespace fitmoe::quant {
namespace {

struct SplitMix {
  uint64_t s;
  uint64_t next() {
    uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  float uniform() { return static_cast<float>(next() >> 40) * (1.0f / 16777216.0f); }  // [0, 1)
};

void fill_bytes(SplitMix& rng, uint8_t* p, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const uint64_t v = rng.next();
    std::memcpy(p + i, &v, 8);
  }
  if (i < n) {
    const uint64_t v = rng.next();
    std::memcpy(p + i, &v, n - i);
  }
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

// 65536 samples of a unit normal (Box-Muller on a fixed stream), built once.
const std::vector<float>& normal_table() {
  static const std::vector<float> table = [] {
    std::vector<float> t(65536);
    SplitMix rng{0x243f6a8885a308d3ull};
    for (size_t i = 0; i < t.size(); i += 2) {
      const double u1 = (static_cast<double>(rng.next() >> 11) + 1.0) * (1.0 / 9007199254740992.0);
      const double u2 = static_cast<double>(rng.next() >> 11) * (1.0 / 9007199254740992.0);
      const double r = std::sqrt(-2.0 * std::log(u1));
      t[i] = static_cast<float>(r * std::cos(6.283185307179586 * u2));
      t[i + 1] = static_cast<float>(r * std::sin(6.283185307179586 * u2));
    }
    return t;
  }();
  return table;
}

void fill_float(DType t, uint8_t* dst, size_t count, float stddev, SplitMix& rng) {
  const std::vector<float>& unit = normal_table();
  if (t == DType::F32) {
    float* y = reinterpret_cast<float*>(dst);
    size_t i = 0;
    for (; i + 4 <= count; i += 4) {
      const uint64_t v = rng.next();
      for (int k = 0; k < 4; ++k) {
        const float f = unit[(v >> (16 * k)) & 0xffff] * stddev;
        std::memcpy(y + i + k, &f, 4);
      }
    }
    for (; i < count; ++i) {
      const float f = unit[rng.next() & 0xffff] * stddev;
      std::memcpy(y + i, &f, 4);
    }
    return;
  }
  std::vector<uint16_t> table(65536);
  for (size_t i = 0; i < table.size(); ++i)
    table[i] = t == DType::F16 ? f32_to_f16(unit[i] * stddev) : f32_to_bf16(unit[i] * stddev);
  size_t i = 0;
  for (; i + 4 <= count; i += 4) {
    const uint64_t v = rng.next();
    const uint64_t packed = static_cast<uint64_t>(table[v & 0xffff]) | static_cast<uint64_t>(table[(v >> 16) & 0xffff]) << 16 |
                            static_cast<uint64_t>(table[(v >> 32) & 0xffff]) << 32 |
                            static_cast<uint64_t>(table[v >> 48]) << 48;
    std::memcpy(dst + 2 * i, &packed, 8);
  }
  for (; i < count; ++i) put_f16(dst + 2 * i, table[rng.next() & 0xffff]);
}

}  // namespace

void fill_random_rows(DType t, void* dst, int64_t nrows, int64_t ncols, float stddev, uint64_t seed) {
  const DTypeInfo& info = dtype_info(t);
  if (!info.weight_type) throw Error(std::string("fill_random_rows: not a weight type: ") + info.name);
  if (ncols % info.block_size != 0) throw Error("fill_random_rows: row length not a multiple of the block size");
  SplitMix rng{seed ^ 0x6a09e667f3bcc909ull};
  uint8_t* y = static_cast<uint8_t*>(dst);
  const size_t total = static_cast<size_t>(nrows) * row_bytes(t, ncols);
  if (t == DType::F32 || t == DType::F16 || t == DType::BF16) {
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
  // Process in chunks so the scale fix-up touches cache-hot bytes.
  constexpr size_t kChunkBlocks = 256;
  for (size_t b0 = 0; b0 < nblocks; b0 += kChunkBlocks) {
    const size_t nb = nblocks - b0 < kChunkBlocks ? nblocks - b0 : kChunkBlocks;
    uint8_t* p = y + b0 * bb;
    fill_bytes(rng, p, nb * bb);
    for (size_t i = 0; i < nb; ++i, p += bb) {
      const uint16_t hd = pos_f16(base * (0.5f + rng.uniform()));
      put_f16(p + d_off, hd);
      if (min_off >= 0) {
        const float m = static_cast<float>(mo.min_ratio) * f16_to_f32(hd);
        const uint16_t hm = pos_f16(m);
        put_f16(p + min_off, min_negative ? static_cast<uint16_t>(hm | 0x8000u) : hm);
      }
    }
  }
}

}  // namespace fitmoe::quant
