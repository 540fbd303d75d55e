// Scalar reference: the definition of every block format (decoders bit-exact with ggml's to_float),
// the activation quantizers (byte-exact with the reference's x86 CPU backend) and one dot product per
// weight type.
//
// The dot products fix ONE summation order that every fast kernel reproduces ("canonical order"), so
// that all ISAs give bit-identical results:
//  * quantized types: per block (32 values) or super-block (256 values) an exact integer sum isum,
//    then   acc = fma(float(isum), d_w * d_a, acc)          (d_w * d_a rounded to f32 first)
//    plus   acc = fma(float(-msum), dmin_w * d_a, acc)      (Q2_K/Q4_K/Q5_K: the min term, exact int)
//    or     acc = fma(m_w, s_a, acc)                         (Q4_1/Q5_1: m times the Q8_1 s field)
//    with one f32 accumulator running over the blocks in order.
//  * F32/F16/BF16: 16 f32 lanes, lane i accumulating elements i, i+16, ... with fma (the row zero-
//    padded to a multiple of 16), then folded in halves: 16 -> 8 -> 4 -> 2 -> 1.
// The dequantizers are plain multiply/subtract without contraction, exactly as ggml's.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include <cmath>
#include <cstring>

#include "quant/blocks.h"
#include "quant/kernels.h"
#include "runtime/error.h"

namespace fitmoe::quant {
namespace {

inline float h2f(const uint8_t* p) { return f16_to_f32(ld_u16(p)); }

[[noreturn]] void bad_type(const char* what, DType t) {
  throw Error(std::string(what) + ": unsupported type " + dtype_name(t));
}

// ================================ dequantization ==================================================

void deq_q4_0(const uint8_t* b, float* y) {
  const float d = h2f(b);
  for (int j = 0; j < 16; ++j) {
    const int lo = (b[2 + j] & 15) - 8, hi = (b[2 + j] >> 4) - 8;
    y[j] = static_cast<float>(lo) * d;
    y[j + 16] = static_cast<float>(hi) * d;
  }
}
void deq_q4_1(const uint8_t* b, float* y) {
  const float d = h2f(b), m = h2f(b + 2);
  for (int j = 0; j < 16; ++j) {
    y[j] = static_cast<float>(b[4 + j] & 15) * d + m;
    y[j + 16] = static_cast<float>(b[4 + j] >> 4) * d + m;
  }
}
void deq_q5_0(const uint8_t* b, float* y) {
  const float d = h2f(b);
  const uint32_t qh = ld_u32(b + 2);
  for (int j = 0; j < 16; ++j) {
    const int lo = ((b[6 + j] & 15) | (((qh >> j) & 1) << 4)) - 16;
    const int hi = ((b[6 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16;
    y[j] = static_cast<float>(lo) * d;
    y[j + 16] = static_cast<float>(hi) * d;
  }
}
void deq_q5_1(const uint8_t* b, float* y) {
  const float d = h2f(b), m = h2f(b + 2);
  const uint32_t qh = ld_u32(b + 4);
  for (int j = 0; j < 16; ++j) {
    const int lo = (b[8 + j] & 15) | (((qh >> j) & 1) << 4);
    const int hi = (b[8 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
    y[j] = static_cast<float>(lo) * d + m;
    y[j + 16] = static_cast<float>(hi) * d + m;
  }
}
void deq_q8_0(const uint8_t* b, float* y) {
  const float d = h2f(b);
  for (int j = 0; j < 32; ++j) y[j] = static_cast<float>(static_cast<int8_t>(b[2 + j])) * d;
}
void deq_q8_1(const uint8_t* b, float* y) {
  const float d = h2f(b);
  for (int j = 0; j < 32; ++j) y[j] = static_cast<float>(static_cast<int8_t>(b[4 + j])) * d;
}
void deq_iq4_nl(const uint8_t* b, float* y) {
  const float d = h2f(b);
  for (int j = 0; j < 16; ++j) {
    y[j] = d * static_cast<float>(kIQ4Values[b[2 + j] & 15]);
    y[j + 16] = d * static_cast<float>(kIQ4Values[b[2 + j] >> 4]);
  }
}

// K-quants: value k of the 256 lives in 16-value group k/16 (Q2_K/Q3_K/Q6_K scales) or 32-value
// sub-block k/32 (Q4_K/Q5_K/IQ4_XS scales).
void deq_q2_k(const uint8_t* b, float* y) {
  const float d = h2f(b + kQ2K_D), dmin = h2f(b + kQ2K_Dmin);
  for (int k = 0; k < 256; ++k) {
    const int half = k / 128, shift = 2 * ((k % 128) / 32), l = k % 32;
    const uint8_t sc = b[kQ2K_Scales + k / 16];
    const float dl = d * static_cast<float>(sc & 15), ml = dmin * static_cast<float>(sc >> 4);
    const int q = (b[kQ2K_Qs + 32 * half + l] >> shift) & 3;
    y[k] = dl * static_cast<float>(q) - ml;
  }
}
void deq_q3_k(const uint8_t* b, float* y) {
  const float d = h2f(b + kQ3K_D);
  int8_t sc[16];
  unpack_q3k_scales(b + kQ3K_Scales, sc);
  for (int k = 0; k < 256; ++k) {
    const int half = k / 128, shift = 2 * ((k % 128) / 32), l = k % 32;
    const int lo = (b[kQ3K_Qs + 32 * half + l] >> shift) & 3;
    const bool high = (b[kQ3K_Hmask + l] >> (k / 32)) & 1;
    const float dl = d * static_cast<float>(sc[k / 16]);
    y[k] = dl * static_cast<float>(lo - (high ? 0 : 4));
  }
}
void deq_q4_k(const uint8_t* b, float* y) {
  const float d = h2f(b + kQ4K_D), dmin = h2f(b + kQ4K_Dmin);
  uint8_t sc[8], mn[8];
  unpack_k4_scales(b + kQ4K_Scales, sc, mn);
  for (int s = 0; s < 8; ++s) {
    const float ds = d * static_cast<float>(sc[s]), ms = dmin * static_cast<float>(mn[s]);
    const uint8_t* q = b + kQ4K_Qs + 32 * (s / 2);
    const int shift = 4 * (s % 2);
    for (int l = 0; l < 32; ++l) y[32 * s + l] = ds * static_cast<float>((q[l] >> shift) & 15) - ms;
  }
}
void deq_q5_k(const uint8_t* b, float* y) {
  const float d = h2f(b + kQ5K_D), dmin = h2f(b + kQ5K_Dmin);
  uint8_t sc[8], mn[8];
  unpack_k4_scales(b + kQ5K_Scales, sc, mn);
  for (int s = 0; s < 8; ++s) {
    const float ds = d * static_cast<float>(sc[s]), ms = dmin * static_cast<float>(mn[s]);
    const uint8_t* q = b + kQ5K_Qs + 32 * (s / 2);
    const int shift = 4 * (s % 2);
    for (int l = 0; l < 32; ++l) {
      const int v = ((q[l] >> shift) & 15) | (((b[kQ5K_Qh + l] >> s) & 1) << 4);
      y[32 * s + l] = ds * static_cast<float>(v) - ms;
    }
  }
}
void deq_q6_k(const uint8_t* b, float* y) {
  const float d = h2f(b + kQ6K_D);
  for (int k = 0; k < 256; ++k) {
    const int half = k / 128, g = (k % 128) / 32, l = k % 32;
    const uint8_t ql = b[kQ6K_Ql + 64 * half + 32 * (g % 2) + l];
    const int lo = (g < 2) ? (ql & 15) : (ql >> 4);
    const int hi = (b[kQ6K_Qh + 32 * half + l] >> (2 * g)) & 3;
    const int q = (lo | (hi << 4)) - 32;
    const int sc = static_cast<int8_t>(b[kQ6K_Scales + k / 16]);
    y[k] = d * static_cast<float>(sc) * static_cast<float>(q);
  }
}
void deq_iq4_xs(const uint8_t* b, float* y) {
  const float d = h2f(b + kIQ4XS_D);
  for (int ib = 0; ib < 8; ++ib) {
    const float dl = d * static_cast<float>(iq4xs_scale(b, ib));
    const uint8_t* q = b + kIQ4XS_Qs + 16 * ib;
    for (int j = 0; j < 16; ++j) {
      y[32 * ib + j] = dl * static_cast<float>(kIQ4Values[q[j] & 15]);
      y[32 * ib + j + 16] = dl * static_cast<float>(kIQ4Values[q[j] >> 4]);
    }
  }
}
void deq_q8_k(const uint8_t* b, float* y) {
  const float d = ld_f32(b + kQ8K_D);
  for (int j = 0; j < 256; ++j) y[j] = d * static_cast<float>(static_cast<int8_t>(b[kQ8K_Qs + j]));
}

using DeqBlockFn = void (*)(const uint8_t*, float*);

DeqBlockFn deq_block_fn(DType t) {
  switch (t) {
    case DType::Q4_0: return deq_q4_0;
    case DType::Q4_1: return deq_q4_1;
    case DType::Q5_0: return deq_q5_0;
    case DType::Q5_1: return deq_q5_1;
    case DType::Q8_0: return deq_q8_0;
    case DType::Q8_1: return deq_q8_1;
    case DType::Q2_K: return deq_q2_k;
    case DType::Q3_K: return deq_q3_k;
    case DType::Q4_K: return deq_q4_k;
    case DType::Q5_K: return deq_q5_k;
    case DType::Q6_K: return deq_q6_k;
    case DType::Q8_K: return deq_q8_k;
    case DType::IQ4_NL: return deq_iq4_nl;
    case DType::IQ4_XS: return deq_iq4_xs;
    default: return nullptr;
  }
}

// ============================ activation quantization =============================================

// Round half to even (the default rounding mode), as vroundps / cvtps2dq do.
inline int round_even(float x) { return static_cast<int>(std::nearbyint(x)); }

// Q8_0 / Q8_1 as the reference's AVX2 code: d = amax/127, values multiplied by 127/amax.
inline float q8_block(const float* x, int8_t* q, int* sum) {
  float amax = 0.0f;
  for (int j = 0; j < 32; ++j) amax = std::fmax(amax, std::fabs(x[j]));
  const float d = amax / 127.0f;
  const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
  int s = 0;
  for (int j = 0; j < 32; ++j) {
    const int v = round_even(x[j] * id);
    q[j] = static_cast<int8_t>(v);
    s += v;
  }
  *sum = s;
  return d;
}

void quantize_q8_0(const float* x, uint8_t* y, int64_t n) {
  for (int64_t i = 0; i < n / 32; ++i, x += 32, y += kQ8_0Bytes) {
    int sum;
    const float d = q8_block(x, reinterpret_cast<int8_t*>(y + 2), &sum);
    const uint16_t hd = f32_to_f16(d);
    std::memcpy(y, &hd, 2);
  }
}

void quantize_q8_1(const float* x, uint8_t* y, int64_t n) {
  for (int64_t i = 0; i < n / 32; ++i, x += 32, y += kQ8_1Bytes) {
    int sum;
    const float d = q8_block(x, reinterpret_cast<int8_t*>(y + 4), &sum);
    const uint16_t hd = f32_to_f16(d), hs = f32_to_f16(d * static_cast<float>(sum));
    std::memcpy(y, &hd, 2);
    std::memcpy(y + 2, &hs, 2);
  }
}

// Q8_K: the scale comes from the signed value of largest magnitude (first one on ties), mapped to
// -127; q = round-half-even(x * iscale) clamped at 127; d = 1/iscale; bsums = sums of 16.
void quantize_q8_k(const float* x, uint8_t* y, int64_t n) {
  for (int64_t i = 0; i < n / 256; ++i, x += 256, y += kQ8K_Bytes) {
    float amax = 0.0f, max = 0.0f;
    for (int j = 0; j < 256; ++j) {
      const float ax = std::fabs(x[j]);
      if (ax > amax) {
        amax = ax;
        max = x[j];
      }
    }
    int8_t* q = reinterpret_cast<int8_t*>(y + kQ8K_Qs);
    int16_t bs[16];
    float d = 0.0f;
    if (amax == 0.0f) {
      std::memset(q, 0, 256);
      std::memset(bs, 0, sizeof bs);
    } else {
      const float iscale = -127.0f / max;
      for (int j = 0; j < 256; ++j) {
        const int v = round_even(iscale * x[j]);
        q[j] = static_cast<int8_t>(v < 127 ? v : 127);
      }
      for (int g = 0; g < 16; ++g) {
        int s = 0;
        for (int j = 0; j < 16; ++j) s += q[16 * g + j];
        bs[g] = static_cast<int16_t>(s);
      }
      d = 1.0f / iscale;
    }
    std::memcpy(y + kQ8K_D, &d, 4);
    std::memcpy(y + kQ8K_Bsums, bs, sizeof bs);
  }
}

// ================================== dot products ==================================================

inline int8_t s8(const uint8_t* p, int i) { return static_cast<int8_t>(p[i]); }

// Q8_0-activation family: the weight's 32 integer codes of one block (as ints) and its scale.
template <class Decode>
float dot_q8_0_family(int64_t n, const uint8_t* w, int wbytes, const uint8_t* a, Decode decode) {
  float acc = 0.0f;
  int q[32];
  for (int64_t b = 0; b < n / 32; ++b, w += wbytes, a += kQ8_0Bytes) {
    decode(w, q);
    int isum = 0;
    for (int j = 0; j < 32; ++j) isum += q[j] * s8(a + 2, j);
    acc = std::fma(static_cast<float>(isum), h2f(w) * h2f(a), acc);
  }
  return acc;
}

// Q8_1-activation family (Q4_1/Q5_1): unsigned codes, min m times the activation's s field.
template <class Decode>
float dot_q8_1_family(int64_t n, const uint8_t* w, int wbytes, const uint8_t* a, Decode decode) {
  float acc = 0.0f;
  int q[32];
  for (int64_t b = 0; b < n / 32; ++b, w += wbytes, a += kQ8_1Bytes) {
    decode(w, q);
    int isum = 0;
    for (int j = 0; j < 32; ++j) isum += q[j] * s8(a + 4, j);
    acc = std::fma(static_cast<float>(isum), h2f(w) * h2f(a), acc);
    acc = std::fma(h2f(w + 2), h2f(a + 2), acc);
  }
  return acc;
}

void codes_q4_0(const uint8_t* b, int* q) {
  for (int j = 0; j < 16; ++j) q[j] = (b[2 + j] & 15) - 8, q[j + 16] = (b[2 + j] >> 4) - 8;
}
void codes_q5_0(const uint8_t* b, int* q) {
  const uint32_t qh = ld_u32(b + 2);
  for (int j = 0; j < 16; ++j) {
    q[j] = ((b[6 + j] & 15) | (((qh >> j) & 1) << 4)) - 16;
    q[j + 16] = ((b[6 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16;
  }
}
void codes_q8_0(const uint8_t* b, int* q) {
  for (int j = 0; j < 32; ++j) q[j] = s8(b + 2, j);
}
void codes_iq4_nl(const uint8_t* b, int* q) {
  for (int j = 0; j < 16; ++j) q[j] = kIQ4Values[b[2 + j] & 15], q[j + 16] = kIQ4Values[b[2 + j] >> 4];
}
void codes_q4_1(const uint8_t* b, int* q) {
  for (int j = 0; j < 16; ++j) q[j] = b[4 + j] & 15, q[j + 16] = b[4 + j] >> 4;
}
void codes_q5_1(const uint8_t* b, int* q) {
  const uint32_t qh = ld_u32(b + 4);
  for (int j = 0; j < 16; ++j) {
    q[j] = (b[8 + j] & 15) | (((qh >> j) & 1) << 4);
    q[j + 16] = (b[8 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
  }
}

// Q8_K family: sum over 256 values; `codes` gives the 256 integer weight codes (without scales),
// `scale16` the integer scale of each 16-value group, `mins16` (optional) the integer min of each group.
struct KBlock {
  int q[256];
  int scale[16];
  int min[16];
  bool has_min = false;
  float d = 0, dmin = 0;
};

void kblock_q2_k(const uint8_t* b, KBlock& k) {
  for (int i = 0; i < 256; ++i) {
    const int half = i / 128, shift = 2 * ((i % 128) / 32), l = i % 32;
    k.q[i] = (b[kQ2K_Qs + 32 * half + l] >> shift) & 3;
  }
  for (int g = 0; g < 16; ++g) k.scale[g] = b[kQ2K_Scales + g] & 15, k.min[g] = b[kQ2K_Scales + g] >> 4;
  k.has_min = true;
  k.d = h2f(b + kQ2K_D);
  k.dmin = h2f(b + kQ2K_Dmin);
}
void kblock_q3_k(const uint8_t* b, KBlock& k) {
  for (int i = 0; i < 256; ++i) {
    const int half = i / 128, shift = 2 * ((i % 128) / 32), l = i % 32;
    const int lo = (b[kQ3K_Qs + 32 * half + l] >> shift) & 3;
    const bool high = (b[kQ3K_Hmask + l] >> (i / 32)) & 1;
    k.q[i] = lo - (high ? 0 : 4);
  }
  int8_t sc[16];
  unpack_q3k_scales(b + kQ3K_Scales, sc);
  for (int g = 0; g < 16; ++g) k.scale[g] = sc[g];
  k.d = h2f(b + kQ3K_D);
}
void kblock_q4_k(const uint8_t* b, KBlock& k) {
  uint8_t sc[8], mn[8];
  unpack_k4_scales(b + kQ4K_Scales, sc, mn);
  for (int i = 0; i < 256; ++i) {
    const int s = i / 32;
    k.q[i] = (b[kQ4K_Qs + 32 * (s / 2) + i % 32] >> (4 * (s % 2))) & 15;
  }
  for (int g = 0; g < 16; ++g) k.scale[g] = sc[g / 2], k.min[g] = mn[g / 2];
  k.has_min = true;
  k.d = h2f(b + kQ4K_D);
  k.dmin = h2f(b + kQ4K_Dmin);
}
void kblock_q5_k(const uint8_t* b, KBlock& k) {
  uint8_t sc[8], mn[8];
  unpack_k4_scales(b + kQ5K_Scales, sc, mn);
  for (int i = 0; i < 256; ++i) {
    const int s = i / 32, l = i % 32;
    k.q[i] = ((b[kQ5K_Qs + 32 * (s / 2) + l] >> (4 * (s % 2))) & 15) | (((b[kQ5K_Qh + l] >> s) & 1) << 4);
  }
  for (int g = 0; g < 16; ++g) k.scale[g] = sc[g / 2], k.min[g] = mn[g / 2];
  k.has_min = true;
  k.d = h2f(b + kQ5K_D);
  k.dmin = h2f(b + kQ5K_Dmin);
}
void kblock_q6_k(const uint8_t* b, KBlock& k) {
  for (int i = 0; i < 256; ++i) {
    const int half = i / 128, g = (i % 128) / 32, l = i % 32;
    const uint8_t ql = b[kQ6K_Ql + 64 * half + 32 * (g % 2) + l];
    const int lo = (g < 2) ? (ql & 15) : (ql >> 4);
    const int hi = (b[kQ6K_Qh + 32 * half + l] >> (2 * g)) & 3;
    k.q[i] = (lo | (hi << 4)) - 32;
  }
  for (int g = 0; g < 16; ++g) k.scale[g] = s8(b + kQ6K_Scales, g);
  k.d = h2f(b + kQ6K_D);
}
void kblock_iq4_xs(const uint8_t* b, KBlock& k) {
  for (int ib = 0; ib < 8; ++ib) {
    const uint8_t* q = b + kIQ4XS_Qs + 16 * ib;
    for (int j = 0; j < 16; ++j) {
      k.q[32 * ib + j] = kIQ4Values[q[j] & 15];
      k.q[32 * ib + j + 16] = kIQ4Values[q[j] >> 4];
    }
    k.scale[2 * ib] = k.scale[2 * ib + 1] = iq4xs_scale(b, ib);
  }
  k.d = h2f(b + kIQ4XS_D);
}

template <class Decode>
float dot_q8_k_family(int64_t n, const uint8_t* w, int wbytes, const uint8_t* a, Decode decode) {
  float acc = 0.0f;
  KBlock k;
  for (int64_t b = 0; b < n / 256; ++b, w += wbytes, a += kQ8K_Bytes) {
    decode(w, k);
    const float da = ld_f32(a + kQ8K_D);
    int isum = 0, msum = 0;
    for (int g = 0; g < 16; ++g) {
      int gsum = 0;
      for (int j = 0; j < 16; ++j) gsum += k.q[16 * g + j] * s8(a + kQ8K_Qs, 16 * g + j);
      isum += k.scale[g] * gsum;
      if (k.has_min) {
        int16_t bsum;
        std::memcpy(&bsum, a + kQ8K_Bsums + 2 * g, 2);
        msum += k.min[g] * bsum;
      }
    }
    acc = std::fma(static_cast<float>(isum), k.d * da, acc);
    if (k.has_min) acc = std::fma(static_cast<float>(-msum), k.dmin * da, acc);
  }
  return acc;
}

// Float types: 16 lanes, zero padding, folded in halves.
template <class LoadW, class LoadA>
float dot_float(int64_t n, LoadW load_w, LoadA load_a) {
  float lane[16] = {};
  const int64_t padded = (n + 15) / 16 * 16;
  for (int64_t i = 0; i < padded; ++i) {
    const float w = i < n ? load_w(i) : 0.0f, a = i < n ? load_a(i) : 0.0f;
    lane[i % 16] = std::fma(w, a, lane[i % 16]);
  }
  for (int width = 8; width >= 1; width /= 2)
    for (int i = 0; i < width; ++i) lane[i] = lane[i] + lane[i + width];
  return lane[0];
}

}  // namespace

void dequantize_row_ref(DType t, const void* src, float* dst, int64_t n) {
  const uint8_t* s = static_cast<const uint8_t*>(src);
  switch (t) {
    case DType::F32: std::memcpy(dst, src, static_cast<size_t>(n) * 4); return;
    case DType::F16:
      for (int64_t i = 0; i < n; ++i) dst[i] = f16_to_f32(ld_u16(s + 2 * i));
      return;
    case DType::BF16:
      for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(ld_u16(s + 2 * i));
      return;
    default: break;
  }
  const DeqBlockFn fn = deq_block_fn(t);
  if (!fn) bad_type("dequantize_row_ref", t);
  const DTypeInfo& info = dtype_info(t);
  for (int64_t b = 0; b < n / info.block_size; ++b) fn(s + b * info.block_bytes, dst + b * info.block_size);
}

void quantize_act_row_ref(DType act, const float* x, void* dst, int64_t n) {
  uint8_t* y = static_cast<uint8_t*>(dst);
  switch (act) {
    case DType::Q8_0: quantize_q8_0(x, y, n); return;
    case DType::Q8_1: quantize_q8_1(x, y, n); return;
    case DType::Q8_K: quantize_q8_k(x, y, n); return;
    case DType::F32: std::memcpy(dst, x, static_cast<size_t>(n) * 4); return;
    case DType::F16:
      for (int64_t i = 0; i < n; ++i) {
        const uint16_t h = f32_to_f16(x[i]);
        std::memcpy(y + 2 * i, &h, 2);
      }
      return;
    case DType::BF16:
      for (int64_t i = 0; i < n; ++i) {
        const uint16_t h = f32_to_bf16(x[i]);
        std::memcpy(y + 2 * i, &h, 2);
      }
      return;
    default: bad_type("quantize_act_row_ref", act);
  }
}

float vec_dot_ref(DType w, int64_t n, const void* w_row, const void* act_row) {
  const uint8_t* x = static_cast<const uint8_t*>(w_row);
  const uint8_t* a = static_cast<const uint8_t*>(act_row);
  switch (w) {
    case DType::F32:
      return dot_float(n, [x](int64_t i) { return ld_f32(x + 4 * i); },
                       [a](int64_t i) { return ld_f32(a + 4 * i); });
    case DType::F16:
      return dot_float(n, [x](int64_t i) { return f16_to_f32(ld_u16(x + 2 * i)); },
                       [a](int64_t i) { return f16_to_f32(ld_u16(a + 2 * i)); });
    case DType::BF16:
      return dot_float(n, [x](int64_t i) { return bf16_to_f32(ld_u16(x + 2 * i)); },
                       [a](int64_t i) { return bf16_to_f32(ld_u16(a + 2 * i)); });
    case DType::Q4_0: return dot_q8_0_family(n, x, kQ4_0Bytes, a, codes_q4_0);
    case DType::Q5_0: return dot_q8_0_family(n, x, kQ5_0Bytes, a, codes_q5_0);
    case DType::Q8_0: return dot_q8_0_family(n, x, kQ8_0Bytes, a, codes_q8_0);
    case DType::IQ4_NL: return dot_q8_0_family(n, x, kQ4_0Bytes, a, codes_iq4_nl);
    case DType::Q4_1: return dot_q8_1_family(n, x, kQ4_1Bytes, a, codes_q4_1);
    case DType::Q5_1: return dot_q8_1_family(n, x, kQ5_1Bytes, a, codes_q5_1);
    case DType::Q2_K: return dot_q8_k_family(n, x, kQ2K_Bytes, a, kblock_q2_k);
    case DType::Q3_K: return dot_q8_k_family(n, x, kQ3K_Bytes, a, kblock_q3_k);
    case DType::Q4_K: return dot_q8_k_family(n, x, kQ4K_Bytes, a, kblock_q4_k);
    case DType::Q5_K: return dot_q8_k_family(n, x, kQ5K_Bytes, a, kblock_q5_k);
    case DType::Q6_K: return dot_q8_k_family(n, x, kQ6K_Bytes, a, kblock_q6_k);
    case DType::IQ4_XS: return dot_q8_k_family(n, x, kIQ4XS_Bytes, a, kblock_iq4_xs);
    default: bad_type("vec_dot_ref", w);
  }
}

}  // namespace fitmoe::quant
