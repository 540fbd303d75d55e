// CPU ops that only Gemma (gemma4) needs: the reference's GELU (tanh approximation, through its f16
// table) for the GeGLU FFNs and the final logit softcap. The FFN ops of cpu_ops take the activation
// as a parameter (Activation::GeluTanh) and call geglu from here.
#pragma once
#include <cstdint>

namespace fitmoe::cpu {

// ggml's gelu_tanh in f32: 0.5 x (1 + tanh(sqrt(2/pi) x (1 + 0.044715 x^2))).
float gelu_tanh(float x);

// out = gelu(gate) * up, elementwise, as the reference's CPU GeGLU computes it: gate rounded to f16,
// gelu of that f16 value looked up in a table stored as f16 (65536 entries, built from gelu_tanh),
// gate <= -10 gives 0 and gate >= 10 gives gate itself. So every GELU output carries an f16 rounding;
// an exact gelu would leave gemma4's f32 logits about 2e-3 away from the reference (testdata README).
// out may alias gate or up.
void geglu(const float* gate, const float* up, float* out, int64_t n);

// x = tanh(x / cap) * cap, in the reference's three steps (scale by 1/cap, tanh, scale by cap).
void softcap(float* x, int64_t n, float cap);

}  // namespace fitmoe::cpu
