#include "runtime/cpu_gemma4.h"

#include <cmath>
#include <cstring>
#include <vector>

#include "quant/dtype.h"

namespace fitmoe::cpu {

float gelu_tanh(float x) {
  // The constants and the order of operations of ggml's ggml_gelu_f32, so the table below holds the
  // same f16 values as the reference's.
  constexpr float kA = 0.044715f;
  constexpr float kSqrt2OverPi = 0.79788456080286535587989211986876f;
  return 0.5f * x * (1.0f + std::tanh(kSqrt2OverPi * x * (1.0f + kA * x * x)));
}

namespace {
// gelu_tanh of every f16 value, rounded to f16 and widened back to f32 (a float table: the values are
// the same as an f16 table's, and the lookup saves a conversion per element).
const std::vector<float>& gelu_table() {
  static const std::vector<float> t = [] {
    std::vector<float> v(65536);
    for (uint32_t i = 0; i < 65536; ++i) v[i] = f16_to_f32(f32_to_f16(gelu_tanh(f16_to_f32(static_cast<uint16_t>(i)))));
    return v;
  }();
  return t;
}
}  // namespace

void geglu(const float* gate, const float* up, float* out, int64_t n) {
  const float* t = gelu_table().data();
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    if (g <= -10.0f) out[i] = 0.0f;
    else if (g >= 10.0f) out[i] = g * up[i];
    else out[i] = t[f32_to_f16(g)] * up[i];
  }
}

void softcap(float* x, int64_t n, float cap) {
  const float inv = 1.0f / cap;
  for (int64_t i = 0; i < n; ++i) x[i] = std::tanh(x[i] * inv) * cap;
}

}  // namespace fitmoe::cpu
