// RoPE angle parameters shared by the CPU op (cpu::rope_neox) and the GPU kernels (gpu::rope_neox,
// gpu::qk_norm_rope_store), so both sides derive the per-pair angle and magnitude from the same values.
// Plain C++17 (the .cu files include it).
//
// The math is the reference's (ggml's rope with YaRN): for pair i of n_rot/2 at position p,
//   theta_extrap = p * base^(-2i/n_rot)                 (the power by repeated float products)
//   theta_interp = freq_scale * theta_extrap
//   ramp         = 1 - clamp((i - corr_lo) / max(0.001, corr_hi - corr_lo), 0, 1)
//   theta        = theta_interp * (1 - ramp * ext) + theta_extrap * ramp * ext   (ext != 0 only)
//   cos/sin      = cos/sin(theta) * mscale, mscale = attn_factor * (1 + 0.1 ln(1/freq_scale)) when
//                  ext != 0, attn_factor otherwise.
// With freq_scale 1, ext_factor 0 and attn_factor 1 this is plain RoPE, bit for bit.
#pragma once
#include <algorithm>
#include <cmath>

namespace fitmoe {

struct RopeParams {
  float base = 10000.0f;
  float freq_scale = 1.0f;   // 1/factor for linear and YaRN scaling
  float ext_factor = 0.0f;   // YaRN: how much of the ramp takes the unscaled angle; 0 turns YaRN off
  float attn_factor = 1.0f;  // magnitude of cos/sin before YaRN's own correction
  float corr_lo = 0.0f;      // YaRN correction dims (pair indices): below lo the angle is extrapolated,
  float corr_hi = 0.0f;      // above hi interpolated, linear in between

  bool yarn() const { return ext_factor != 0.0f; }
  // The factor every cos and sin is multiplied by (computed once, on the host, so the CPU and the GPU
  // use the same bits). YaRN's 1 + 0.1 ln(s) is the attention temperature correction of the YaRN paper,
  // applied to q and k alike as the reference does.
  float mscale() const {
    float m = attn_factor;
    if (yarn()) m *= 1.0f + 0.1f * std::log(1.0f / freq_scale);
    return m;
  }
};

// Where a pair making beta rotations over n_ctx_orig positions sits, as a (fractional) pair index:
// solving n_ctx_orig / (2 pi base^(2i/n_dims)) = beta for i. Float arithmetic in the reference's order.
inline float rope_yarn_corr_dim(int n_dims, int n_ctx_orig, float beta, float base) {
  const float pi = 3.14159265358979323846f;
  return static_cast<float>(n_dims) * std::log(static_cast<float>(n_ctx_orig) / (beta * 2.0f * pi)) /
         (2.0f * std::log(base));
}

// The ramp's ends: pairs that turn faster than beta_fast rotations keep their angle, slower than
// beta_slow are interpolated; floor / ceil and clamped to [0, n_dims - 1] as the reference does.
inline void rope_yarn_corr_dims(int n_dims, int n_ctx_orig, float base, float beta_fast, float beta_slow,
                                float* lo, float* hi) {
  const float start = std::floor(rope_yarn_corr_dim(n_dims, n_ctx_orig, beta_fast, base));
  const float end = std::ceil(rope_yarn_corr_dim(n_dims, n_ctx_orig, beta_slow, base));
  *lo = std::max(0.0f, start);
  *hi = std::min(static_cast<float>(n_dims - 1), end);
}

inline RopeParams make_rope_params(int n_rot, float base, float freq_scale, float ext_factor, float attn_factor,
                                   float beta_fast, float beta_slow, int n_ctx_orig) {
  RopeParams r;
  r.base = base;
  r.freq_scale = freq_scale;
  r.ext_factor = ext_factor;
  r.attn_factor = attn_factor;
  if (ext_factor != 0.0f) rope_yarn_corr_dims(n_rot, n_ctx_orig, base, beta_fast, beta_slow, &r.corr_lo, &r.corr_hi);
  return r;
}

// The ramp's weight for pair i (1 below corr_lo, 0 above corr_hi). Used by the CPU op; the GPU kernel
// repeats this arithmetic with explicitly rounded operations.
inline float rope_yarn_ramp(float lo, float hi, int i) {
  const float y = (static_cast<float>(i) - lo) / std::max(0.001f, hi - lo);
  return 1.0f - std::min(1.0f, std::max(0.0f, y));
}

}  // namespace fitmoe
