// The delta rule's state sweep built for AVX2 + FMA (this file's name gives it those flags; the
// caller picks it at run time when the CPU has them). The source is cpu_deltanet_head.inc.
#include <cmath>

#define FITMOE_DELTA_HEAD delta_head_impl
#include "runtime/cpu_deltanet_head.inc"
#undef FITMOE_DELTA_HEAD

namespace fitmoe::cpu::detail {

void delta_head_avx2(float* S, int dk, int dv, int n_tokens, const float* q, const float* k, int64_t ld_qk,
                     const float* v, int64_t ld_v, const float* g, const float* beta, int64_t ld_gb, float* out,
                     int64_t ld_out, float scale) {
  delta_head_impl(S, dk, dv, n_tokens, q, k, ld_qk, v, ld_v, g, beta, ld_gb, out, ld_out, scale);
}

}  // namespace fitmoe::cpu::detail
