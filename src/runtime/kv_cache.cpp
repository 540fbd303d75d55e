#include "runtime/kv_cache.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "quant/kernels.h"
#include "quant/turboquant.h"
#include "runtime/error.h"

namespace fitmoe {

namespace {

constexpr DType kKvTypes[] = {DType::F32, DType::F16, DType::BF16, DType::Q8_0, DType::Q4_0, DType::TQ4, DType::TQ3, DType::TQ2};

bool stored(DType t) { return std::find(std::begin(kKvTypes), std::end(kKvTypes), t) != std::end(kKvTypes); }

// The reference's quantize_row_q4_0_ref: per 32 values d = (the value of largest magnitude) / -8,
// codes min(15, (int8)(x / d + 8.5)), the first 16 values in the low nibbles.
void quantize_q4_0(const float* x, uint8_t* dst, int64_t n) {
  for (int64_t b = 0; b < n / 32; ++b, x += 32, dst += 18) {
    float amax = 0.0f, max = 0.0f;
    for (int j = 0; j < 32; ++j)
      if (amax < std::fabs(x[j])) amax = std::fabs(x[j]), max = x[j];
    const float d = max / -8.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    const uint16_t dh = f32_to_f16(d);
    std::memcpy(dst, &dh, 2);
    for (int j = 0; j < 16; ++j) {
      const float x0 = x[j] * id, x1 = x[16 + j] * id;
      const uint8_t q0 = static_cast<uint8_t>(std::min<int>(15, static_cast<int8_t>(x0 + 8.5f)));
      const uint8_t q1 = static_cast<uint8_t>(std::min<int>(15, static_cast<int8_t>(x1 + 8.5f)));
      dst[2 + j] = static_cast<uint8_t>(q0 | (q1 << 4));
    }
  }
}

int largest_pow2_divisor(int n) { return n & -n; }

}  // namespace

bool KvCacheType::quantized() const {
  return kv_type_is_quantized(k) || kv_type_is_quantized(v) || kv_type_is_tq(k) || kv_type_is_tq(v);
}

bool KvCacheType::flash_on() const {
  return flash == FlashAttn::On || (flash == FlashAttn::Auto && (quantized() || k != v));
}

std::string KvCacheType::name() const {
  if (automatic) return "auto";
  std::string n = k == v ? dtype_name(k) : std::string(dtype_name(k)) + "/" + dtype_name(v);
  if (flash_on()) n += " (flash)";
  return n;
}

bool kv_type_from_name(const std::string& name, DType* out) {
  DType t;
  if (!dtype_from_name(name, &t) || !stored(t)) return false;
  *out = t;
  return true;
}

const char* kv_type_names() { return "f32, f16, bf16, q8_0, q4_0, tq4, tq3, tq2"; }

bool kv_type_is_quantized(DType t) { return t == DType::Q8_0 || t == DType::Q4_0; }
bool kv_type_is_tq(DType t) { return t == DType::TQ4 || t == DType::TQ3 || t == DType::TQ2; }
int tq_bits(DType t) { return t == DType::TQ4 ? 4 : t == DType::TQ3 ? 3 : 2; }
int tq_block(int head_dim) { return std::min(128, largest_pow2_divisor(head_dim)); }

uint64_t kv_row_bytes(DType t, int head_dim) {
  if (!kv_type_is_tq(t)) return row_bytes(t, head_dim);
  const int b = tq_block(head_dim);
  return static_cast<uint64_t>(head_dim / b) * tq::block_bytes(b, tq_bits(t));
}

FlashAttn flash_attn_from_name(const std::string& s) {
  if (s == "on" || s == "1" || s == "true") return FlashAttn::On;
  if (s == "off" || s == "0" || s == "false") return FlashAttn::Off;
  if (s == "auto" || s.empty()) return FlashAttn::Auto;
  throw Error("flash attention: '" + s + "' is not on, off or auto");
}

void check_kv_cache_type(const KvCacheType& t, const std::vector<int>& head_dims_k, const std::vector<int>& head_dims_v) {
  for (const auto& [type, which] : {std::pair{t.k, "K"}, std::pair{t.v, "V"}})
    if (!stored(type))
      throw Error(std::string(which) + " cache type " + dtype_name(type) + " is not one fitmoe stores (" + kv_type_names() +
                  ")");
  if (t.flash == FlashAttn::Off && t.quantized())
    throw Error("a " + t.name() + " KV cache needs flash attention (-fa on or auto), as in the reference");
  if (t.flash == FlashAttn::Off && t.k != t.v)
    throw Error("K and V caches of different types (" + t.name() + ") need flash attention (-fa on or auto)");
  auto check_dims = [](DType type, const std::vector<int>& dims, const char* which) {
    const int bs = kv_type_is_tq(type) ? 32 : dtype_info(type).block_size;  // (tq: a power of two of at least 32)
    for (const int d : dims)
      if (d % bs != 0)
        throw Error(std::string(which) + " cache type " + dtype_name(type) + " stores blocks of " + std::to_string(bs) +
                    " values; this model has heads of " + std::to_string(d));
  };
  check_dims(t.k, head_dims_k, "K");
  check_dims(t.v, head_dims_v, "V");
}

KvRotation kv_rotation(const KvCacheType& t, const std::vector<int>& head_dims_k, const std::vector<int>& head_dims_v) {
  KvRotation r;
  auto uniform = [](const std::vector<int>& d) {
    return !d.empty() && std::all_of(d.begin(), d.end(), [&](int x) { return x == d[0]; }) && d[0] % 64 == 0;
  };
  if (kv_type_is_quantized(t.k) && uniform(head_dims_k)) r.k = largest_pow2_divisor(head_dims_k[0]);
  if (kv_type_is_quantized(t.v) && uniform(head_dims_v)) r.v = 64;
  return r;
}

namespace cpu {

void hadamard_blocks(float* x, int64_t count, int n) {
  for (int64_t b = 0; b + n <= count; b += n) tq::walsh_hadamard(x + b, n);
}

void kv_quantize_row(DType t, const float* x, uint8_t* dst, int64_t n, int tq_block) {
  if (kv_type_is_tq(t)) {
    const size_t bb = tq::block_bytes(tq_block, tq_bits(t));
    for (int64_t i = 0; i < n; i += tq_block, dst += bb) tq::encode_block(x + i, tq_block, tq_bits(t), dst, tq::Scale::LeastSquares);
    return;
  }
  switch (t) {
    case DType::Q4_0: quantize_q4_0(x, dst, n); return;
    case DType::Q8_0:
    case DType::F16:
    case DType::BF16:
    case DType::F32: quant::quantize_act_fn(t)(x, dst, n); return;
    default: throw Error(std::string("kv_quantize_row: ") + dtype_name(t) + " is not a KV cache type");
  }
}

void kv_dequantize_row(DType t, const uint8_t* src, float* dst, int64_t n, int tq_block) {
  if (kv_type_is_tq(t)) {
    const size_t bb = tq::block_bytes(tq_block, tq_bits(t));
    for (int64_t i = 0; i < n; i += tq_block, src += bb) tq::decode_block(src, tq_block, tq_bits(t), dst + i);
    return;
  }
  quant::dequantize_row_ref(t, src, dst, n);
}

}  // namespace cpu

}  // namespace fitmoe
