// Tensor element types as GGUF numbers them, with their block geometry.
// The numeric ids are the file format's (ggml's) and must never change.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

namespace fitmoe {

enum class DType : uint32_t {
  F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q8_1 = 9,
  Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, Q8_K = 15,
  IQ4_NL = 20, IQ4_XS = 23, BF16 = 30,
  // fitmoe's own KV cache types (quant/turboquant.h), outside the file format's ids: never in a file.
  TQ4 = 200, TQ3 = 201, TQ2 = 202,
};

struct DTypeInfo {
  DType type;
  const char* name;       // lower-case, as llama.cpp prints it ("q4_K" style is normalised to "q4_k")
  int block_size;         // values per block
  int block_bytes;        // bytes per block
  bool weight_type;       // fitmoe can compute with tensors of this type
  DType act_type;         // activation format the dot product consumes (ggml's vec_dot_type)
};

// nullptr for an id fitmoe does not know (an unknown or unsupported type in a file).
const DTypeInfo* dtype_info(uint32_t id);
const DTypeInfo& dtype_info(DType t);
inline const char* dtype_name(DType t) { return dtype_info(t).name; }
// F32, F16, BF16: plain floats, one value per block.
inline bool is_float_type(DType t) { return t == DType::F32 || t == DType::F16 || t == DType::BF16; }
// Parses "q4_k", "Q4_K", "f16", ... ; returns false when unknown.
bool dtype_from_name(const std::string& name, DType* out);

// Bytes of a row of n values (n must be a multiple of the block size).
inline size_t row_bytes(DType t, int64_t n) {
  const DTypeInfo& i = dtype_info(t);
  return static_cast<size_t>(n / i.block_size) * static_cast<size_t>(i.block_bytes);
}

// IEEE half and bfloat16 conversions, exact and round-to-nearest-even as F16C / ggml do.
float f16_to_f32(uint16_t h);
uint16_t f32_to_f16(float f);
inline float bf16_to_f32(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
uint16_t f32_to_bf16(float f);  // round to nearest even, NaN kept quiet (as ggml)

// Block layouts of the activation types (the weight layouts live in quant/reference.cpp).
constexpr int QK8_0 = 32;
constexpr int QK_K = 256;
struct BlockQ8_0 { uint16_t d; int8_t qs[32]; };                // 34 B
struct BlockQ8_1 { uint16_t d; uint16_t s; int8_t qs[32]; };    // 36 B: s = d * sum(qs)
struct BlockQ8_K { float d; int8_t qs[256]; int16_t bsums[16]; };  // 292 B
static_assert(sizeof(BlockQ8_0) == 34 && sizeof(BlockQ8_1) == 36 && sizeof(BlockQ8_K) == 292);

}  // namespace fitmoe
