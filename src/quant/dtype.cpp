// Element-type table and the exact half / bfloat16 conversions.
#include "quant/dtype.h"

#include <array>
#include <cctype>

#include "runtime/error.h"

namespace fitmoe {
namespace {

constexpr DTypeInfo kTypes[] = {
    // type          name      block bytes weight act_type
    {DType::F32, "f32", 1, 4, true, DType::F32},
    {DType::F16, "f16", 1, 2, true, DType::F16},
    {DType::Q4_0, "q4_0", 32, 18, true, DType::Q8_0},
    {DType::Q4_1, "q4_1", 32, 20, true, DType::Q8_1},
    {DType::Q5_0, "q5_0", 32, 22, true, DType::Q8_0},
    {DType::Q5_1, "q5_1", 32, 24, true, DType::Q8_1},
    {DType::Q8_0, "q8_0", 32, 34, true, DType::Q8_0},
    {DType::Q8_1, "q8_1", 32, 36, false, DType::Q8_1},
    {DType::Q2_K, "q2_k", 256, 84, true, DType::Q8_K},
    {DType::Q3_K, "q3_k", 256, 110, true, DType::Q8_K},
    {DType::Q4_K, "q4_k", 256, 144, true, DType::Q8_K},
    {DType::Q5_K, "q5_k", 256, 176, true, DType::Q8_K},
    {DType::Q6_K, "q6_k", 256, 210, true, DType::Q8_K},
    {DType::Q8_K, "q8_k", 256, 292, false, DType::Q8_K},
    {DType::IQ4_NL, "iq4_nl", 32, 18, true, DType::Q8_0},
    {DType::IQ4_XS, "iq4_xs", 256, 136, true, DType::Q8_K},
    {DType::BF16, "bf16", 1, 2, true, DType::BF16},
    // (Geometry of a 128-value block; a KV row of narrower heads uses blocks of its head: kv_row_bytes.)
    {DType::TQ4, "tq4", 128, 66, false, DType::F32},
    {DType::TQ3, "tq3", 128, 50, false, DType::F32},
    {DType::TQ2, "tq2", 128, 34, false, DType::F32},
};

constexpr uint32_t kMaxId = 203;

// Lookup by numeric id; built once from kTypes.
const std::array<const DTypeInfo*, kMaxId>& by_id() {
  static const std::array<const DTypeInfo*, kMaxId> table = [] {
    std::array<const DTypeInfo*, kMaxId> t{};
    for (const DTypeInfo& i : kTypes) t[static_cast<uint32_t>(i.type)] = &i;
    return t;
  }();
  return table;
}

inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace

const DTypeInfo* dtype_info(uint32_t id) {
  if (id >= kMaxId) return nullptr;
  return by_id()[id];
}

const DTypeInfo& dtype_info(DType t) {
  const DTypeInfo* i = dtype_info(static_cast<uint32_t>(t));
  if (!i) throw Error("unknown tensor type id " + std::to_string(static_cast<uint32_t>(t)));
  return *i;
}

bool dtype_from_name(const std::string& name, DType* out) {
  std::string low;
  low.reserve(name.size());
  for (char c : name) low.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(c))));
  for (const DTypeInfo& i : kTypes) {
    if (low == i.name) {
      if (out) *out = i.type;
      return true;
    }
  }
  return false;
}

// Half -> float. Every half value is exactly representable as a float, so this is a pure bit
// re-arrangement; subnormal halves are scaled by an exact power of two.
float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return float_of(sign | 0x7f800000u | (mant << 13));  // inf / nan (payload kept)
  if (exp != 0) return float_of(sign | ((exp + 112u) << 23) | (mant << 13));
  // zero or subnormal: mant * 2^-24, exact in float
  const float mag = static_cast<float>(mant) * 5.9604644775390625e-08f;
  return float_of(sign | bits_of(mag));
}

// Float -> half, round to nearest even, as the F16C instruction (vcvtps2ph, imm 0) does:
// overflow gives infinity, NaN stays NaN with the quiet bit set and the top payload bits kept.
uint16_t f32_to_f16(float f) {
  const uint32_t u = bits_of(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((a >> 13) & 0x3ffu));  // NaN
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to >= 65520: inf
  if (a >= 0x38800000u) {
    // normal half range: drop 13 mantissa bits with round-to-nearest-even; a carry into the
    // exponent is the correct result (it can reach at most 0x7bff + 1 below the inf threshold).
    const uint32_t rounded = a + 0x0fffu + ((a >> 13) & 1u);
    return static_cast<uint16_t>(sign | ((rounded - 0x38000000u) >> 13));
  }
  // subnormal half (or zero): value = m * 2^-24 with m = round(|f| * 2^24). The float sum below
  // performs exactly that rounding (to nearest even) in the float unit.
  const float mag = float_of(a);
  const float shifted = mag + 0.5f;  // 0.5 = 2^-1: ulp at this magnitude is 2^-24
  return static_cast<uint16_t>(sign | (bits_of(shifted) - bits_of(0.5f)));
}

uint16_t f32_to_bf16(float f) {
  const uint32_t u = bits_of(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

}  // namespace fitmoe
