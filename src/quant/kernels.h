// CPU compute kernels for every weight type: the scalar reference (the definition of each format,
// bit-exact with ggml's decoders) and fast versions per instruction set, chosen at run time.
//
// A matrix product in fitmoe is always "weight rows x activation columns": the activations are first
// converted to the weight type's activation format (dtype_info(w).act_type: Q8_K for K-quants and
// IQ4_XS, Q8_0 for Q4_0/Q5_0/Q8_0/IQ4_NL, Q8_1 for Q4_1/Q5_1, F16/BF16/F32 for the float types),
// exactly as llama.cpp's CPU backend does, so that results reproduce the reference.
#pragma once
#include <cstddef>
#include <cstdint>

#include "quant/dtype.h"

namespace fitmoe::quant {

// ---- scalar reference -------------------------------------------------------------------------
// Decodes n values (a multiple of the block size) of type t. Bit-exact with ggml's to_float.
void dequantize_row_ref(DType t, const void* src, float* dst, int64_t n);
// Converts n floats to an activation format (Q8_0, Q8_1, Q8_K, F16, BF16, F32), byte-exact with the
// reference's x86 CPU backend (Q8_0/Q8_1: scale 127/amax, round half to even; Q8_K: ggml's scalar code).
void quantize_act_row_ref(DType act, const float* x, void* dst, int64_t n);
// Dot product of one weight row of type w with one activation row in dtype_info(w).act_type.
float vec_dot_ref(DType w, int64_t n, const void* w_row, const void* act_row);

// ---- fast kernels -----------------------------------------------------------------------------
enum class Isa { Scalar, AVX2, AVX512 };  // AVX512 = F+BW+VL+VNNI
Isa best_isa();                          // what this CPU supports (cpuid), honouring FITMOE_ISA=scalar|avx2|avx512
Isa cpu_isa();                           // what this CPU supports, ignoring FITMOE_ISA
const char* isa_name(Isa);

// out[c * out_stride + r] = dot(weight row r, activation column c) for r < nr, c < nc.
// w: nr rows of n values of the weight type, w_stride bytes apart; act: nc rows in the activation
// format, act_stride bytes apart. The kernel blocks rows x columns internally so that one decoded
// weight block serves several activation columns (prefill) and loads stay sequential (decode).
using MatmulTileFn = void (*)(int64_t n, const void* w, size_t w_stride, int nr,
                              const void* act, size_t act_stride, int nc,
                              float* out, size_t out_stride);
using QuantizeActFn = void (*)(const float* x, void* dst, int64_t n);

struct TypeKernels {
  DType act_type;
  MatmulTileFn matmul_tile;
};

// Kernels for weight type w on the given ISA (falls back to the best lower ISA the type has; an ISA
// above cpu_isa() is lowered to cpu_isa(), so asking never yields code this CPU cannot run).
const TypeKernels& kernels_for(DType w, Isa isa);
inline const TypeKernels& kernels_for(DType w) { return kernels_for(w, best_isa()); }
// Fast activation quantizer into act (same bytes as quantize_act_row_ref).
QuantizeActFn quantize_act_fn(DType act, Isa isa);
inline QuantizeActFn quantize_act_fn(DType act) { return quantize_act_fn(act, best_isa()); }

// ---- synthetic weights ------------------------------------------------------------------------
// Fills nrows rows of ncols values of type t with random, well-formed blocks whose decoded values have
// roughly the given standard deviation (scales finite and positive, codes uniform). Fast: used by
// gen-model to write multi-GB files at disk speed. Deterministic in seed.
void fill_random_rows(DType t, void* dst, int64_t nrows, int64_t ncols, float stddev, uint64_t seed);

}  // namespace fitmoe::quant
