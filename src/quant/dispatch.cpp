// Run-time choice of the kernel set: cpuid + XGETBV (the OS must save the wider registers), the
// FITMOE_ISA override, and the scalar fallbacks built on the reference.
#include <cpuid.h>

#include <cstdlib>
#include <cstring>
#include <string>

#include "quant/kernels.h"
#include "quant/kernels_isa.h"
#include "runtime/error.h"

namespace fitmoe::quant {
namespace {

uint64_t read_xcr0() {
  uint32_t lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<uint64_t>(hi) << 32) | lo;
}

Isa detect_cpu() {
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return Isa::Scalar;
  const bool osxsave = c & (1u << 27), avx = c & (1u << 28), fma = c & (1u << 12), f16c = c & (1u << 29);
  if (!(osxsave && avx && fma && f16c)) return Isa::Scalar;
  const uint64_t xcr0 = read_xcr0();
  if ((xcr0 & 0x6) != 0x6) return Isa::Scalar;  // XMM and YMM state
  if (__get_cpuid_max(0, nullptr) < 7) return Isa::Scalar;
  __cpuid_count(7, 0, a, b, c, d);
  const bool avx2 = b & (1u << 5), bmi2 = b & (1u << 8);
  if (!(avx2 && bmi2)) return Isa::Scalar;
  const bool avx512f = b & (1u << 16), avx512dq = b & (1u << 17), avx512bw = b & (1u << 30),
             avx512vl = b & (1u << 31), vnni = c & (1u << 11);
  const bool zmm_state = (xcr0 & 0xe0) == 0xe0;  // opmask, ZMM_Hi256, Hi16_ZMM
  if (avx512f && avx512dq && avx512bw && avx512vl && vnni && zmm_state) return Isa::AVX512;
  return Isa::AVX2;
}

Isa compute_best() {
  Isa isa = cpu_isa();
  if (const char* env = std::getenv("FITMOE_ISA"); env && *env) {
    const std::string v(env);
    Isa want;
    if (v == "scalar") want = Isa::Scalar;
    else if (v == "avx2") want = Isa::AVX2;
    else if (v == "avx512") want = Isa::AVX512;
    else throw Error("FITMOE_ISA must be scalar, avx2 or avx512 (got '" + v + "')");
    if (static_cast<int>(want) < static_cast<int>(isa)) isa = want;  // can only lower
  }
  return isa;
}

// ---- scalar kernels: loops over the reference dot product -----------------------------------------
template <DType W>
void matmul_scalar(int64_t n, const void* w, size_t w_stride, int nr, const void* act, size_t act_stride,
                   int nc, float* out, size_t out_stride) {
  const uint8_t* wb = static_cast<const uint8_t*>(w);
  const uint8_t* ab = static_cast<const uint8_t*>(act);
  for (int c = 0; c < nc; ++c)
    for (int r = 0; r < nr; ++r) out[c * out_stride + r] = vec_dot_ref(W, n, wb + r * w_stride, ab + c * act_stride);
}

template <DType A>
void quantize_scalar(const float* x, void* dst, int64_t n) {
  quantize_act_row_ref(A, x, dst, n);
}

MatmulTileFn scalar_matmul(DType w) {
  switch (w) {
#define FITMOE_CASE(T) \
  case DType::T: return matmul_scalar<DType::T>;
    FITMOE_CASE(F32) FITMOE_CASE(F16) FITMOE_CASE(BF16) FITMOE_CASE(Q4_0) FITMOE_CASE(Q4_1)
    FITMOE_CASE(Q5_0) FITMOE_CASE(Q5_1) FITMOE_CASE(Q8_0) FITMOE_CASE(Q2_K) FITMOE_CASE(Q3_K)
    FITMOE_CASE(Q4_K) FITMOE_CASE(Q5_K) FITMOE_CASE(Q6_K) FITMOE_CASE(IQ4_NL) FITMOE_CASE(IQ4_XS)
#undef FITMOE_CASE
    default: return nullptr;
  }
}

QuantizeActFn scalar_quantize_act(DType act) {
  switch (act) {
    case DType::Q8_0: return quantize_scalar<DType::Q8_0>;
    case DType::Q8_1: return quantize_scalar<DType::Q8_1>;
    case DType::Q8_K: return quantize_scalar<DType::Q8_K>;
    case DType::F16: return quantize_scalar<DType::F16>;
    case DType::BF16: return quantize_scalar<DType::BF16>;
    case DType::F32: return quantize_scalar<DType::F32>;
    default: return nullptr;
  }
}

constexpr int kNumIsa = 3;
constexpr uint32_t kMaxId = 31;

struct Tables {
  TypeKernels kernels[kNumIsa][kMaxId];
  QuantizeActFn quant[kNumIsa][kMaxId];
};

const Tables& tables() {
  static const Tables t = [] {
    Tables t{};
    for (uint32_t id = 0; id < kMaxId; ++id) {
      const DTypeInfo* info = dtype_info(id);
      if (!info) continue;
      const DType ty = info->type;
      MatmulTileFn m[kNumIsa] = {scalar_matmul(ty), detail::avx2_matmul(ty), detail::avx512_matmul(ty)};
      QuantizeActFn q[kNumIsa] = {scalar_quantize_act(ty), detail::avx2_quantize_act(ty),
                                  detail::avx512_quantize_act(ty)};
      for (int i = 1; i < kNumIsa; ++i) {  // fall back to the best lower ISA
        if (!m[i]) m[i] = m[i - 1];
        if (!q[i]) q[i] = q[i - 1];
      }
      for (int i = 0; i < kNumIsa; ++i) {
        t.kernels[i][id] = TypeKernels{info->act_type, info->weight_type ? m[i] : nullptr};
        t.quant[i][id] = q[i];
      }
    }
    return t;
  }();
  return t;
}

}  // namespace

Isa cpu_isa() {
  static const Isa isa = detect_cpu();
  return isa;
}

Isa best_isa() {
  static const Isa isa = compute_best();
  return isa;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::Scalar: return "scalar";
    case Isa::AVX2: return "avx2";
    case Isa::AVX512: return "avx512";
  }
  return "?";
}

const TypeKernels& kernels_for(DType w, Isa isa) {
  const DTypeInfo& info = dtype_info(w);
  if (!info.weight_type) throw Error(std::string("no matmul kernel for activation-only type ") + info.name);
  if (static_cast<int>(isa) > static_cast<int>(cpu_isa())) isa = cpu_isa();
  return tables().kernels[static_cast<int>(isa)][static_cast<uint32_t>(w)];
}

QuantizeActFn quantize_act_fn(DType act, Isa isa) {
  if (static_cast<int>(isa) > static_cast<int>(cpu_isa())) isa = cpu_isa();
  QuantizeActFn f = tables().quant[static_cast<int>(isa)][static_cast<uint32_t>(dtype_info(act).type)];
  if (!f) throw Error(std::string("no activation quantizer for type ") + dtype_name(act));
  return f;
}

}  // namespace fitmoe::quant
