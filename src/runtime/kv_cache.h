// KV cache formats: the element types -ctk / -ctv choose (independently for K and V), whether
// attention runs as flash attention (-fa), the bytes each takes, the Walsh-Hadamard rotation the
// reference gives quantized caches, and the CPU's conversions into and out of the cache.
//
// Layouts (cpu::KvView): K rows [position][n_head_kv * head_dim] in the K type, each head's values
// its own blocks. Without flash attention V is transposed [n_head_kv * head_dim_v][n_ctx] (the
// reference's layout for its non-flash products: f16, f32 or bf16 only); with flash attention V rows
// are [position][n_head_kv * head_dim_v] in the V type, as K.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "quant/dtype.h"

namespace fitmoe {

enum class FlashAttn { Auto, On, Off };

struct KvCacheType {
  DType k = DType::F16, v = DType::F16;
  FlashAttn flash = FlashAttn::Auto;
  // The plan chooses k and v (runtime/plan.h make_plan: f16 where the context fits beside a useful
  // share of the experts, else the type of least quality loss that does) and resolves this to false.
  bool automatic = false;
  // Auto: flash attention where the types need it (q8_0 and q4_0 caches: the reference allows a
  // quantized V only with flash attention; K and V of different types), otherwise the reference's
  // non-flash numerics, which every f16 fixture in ../shared/testdata was made with.
  bool flash_on() const;
  bool quantized() const;
  std::string name() const;  // "f16", or "q8_0/q4_0" where K and V differ; " (flash)" appended when on
  // (C++17: the .cu files include this header.)
  bool operator==(const KvCacheType& o) const {
    return k == o.k && v == o.v && flash == o.flash && automatic == o.automatic;
  }
};

// The cache types fitmoe stores: f32, f16, bf16, q8_0, q4_0, and the rotated low-bit tq4, tq3, tq2
// (quant/turboquant.h: blocks of a head's width up to 128 values, so heads of 32..512 waste nothing).
bool kv_type_from_name(const std::string& name, DType* out);
const char* kv_type_names();  // "f32, f16, bf16, q8_0, q4_0, tq4, tq3, tq2" (for messages and --help)
bool kv_type_is_quantized(DType t);  // q8_0, q4_0 (the reference's quantized cache types)
bool kv_type_is_tq(DType t);         // tq4, tq3, tq2
int tq_bits(DType t);
// The tq block for heads of `head_dim` values: the largest power of two dividing it, at most 128.
int tq_block(int head_dim);
// Throws Error naming the problem: a type fitmoe does not store, a quantized type with flash
// attention off, or a head width that is not a whole number of the type's blocks.
void check_kv_cache_type(const KvCacheType& t, const std::vector<int>& head_dims_k, const std::vector<int>& head_dims_v);
// Bytes of one head's row of head_dim values of type t.
uint64_t kv_row_bytes(DType t, int head_dim);
// -fa's values: on|off|auto (and 1|0|true|false as the reference accepts).
FlashAttn flash_attn_from_name(const std::string& s);

// The reference's rotation of quantized caches (llama-kv-cache.cpp): where the K (V) type is
// quantized, every attention layer has the same head width and that width is a multiple of 64, Q and
// K are multiplied per head by the orthonormal Walsh-Hadamard matrix of the largest power of two
// (>= 64) dividing the width, and V by the 64 x 64 one before it is stored (the attention output by
// the same matrix afterwards). 0: no rotation.
struct KvRotation {
  int k = 0, v = 0;
};
KvRotation kv_rotation(const KvCacheType& t, const std::vector<int>& head_dims_k, const std::vector<int>& head_dims_v);

namespace cpu {
// x := H x / sqrt(n) for each block of n values of x[0 .. count) (tq::walsh_hadamard).
void hadamard_blocks(float* x, int64_t count, int n);
// One row of n values into / out of the cache type (f32, f16, bf16: rounding; q8_0 as the
// reference's x86 quantizer for activations, q4_0 as its quantize_row_q4_0_ref; tq in blocks of
// tq_block values, decoded back to the unrotated values).
void kv_quantize_row(DType t, const float* x, uint8_t* dst, int64_t n, int tq_block = 128);
void kv_dequantize_row(DType t, const uint8_t* src, float* dst, int64_t n, int tq_block = 128);
}  // namespace cpu

}  // namespace fitmoe
