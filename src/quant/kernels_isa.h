// Internal to src/quant: how the dispatcher reaches the per-ISA kernel files. Each ISA file exports
// two lookups; a nullptr answer means "not implemented on this ISA" and the dispatcher falls back.
#pragma once
#include "quant/kernels.h"

namespace fitmoe::quant::detail {

MatmulTileFn avx2_matmul(DType w);
QuantizeActFn avx2_quantize_act(DType act);
MatmulTileFn avx512_matmul(DType w);
QuantizeActFn avx512_quantize_act(DType act);

}  // namespace fitmoe::quant::detail
