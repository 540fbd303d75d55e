#include "runtime/cpu_deltanet.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "quant/kernels.h"
#include "runtime/cpu_ops.h"
#define FITMOE_DELTA_HEAD delta_head_baseline
#include "runtime/cpu_deltanet_head.inc"
#undef FITMOE_DELTA_HEAD

namespace fitmoe::cpu {

void rope_multi(float* x, int n_tokens, int n_heads, int head_dim, int64_t ld, int n_rot, const int sections[4],
                int pos0, const RopeParams& rope) {
  const int sect_dims = sections[0] + sections[1] + sections[2] + sections[3];
  if (sect_dims == 0) return rope_neox(x, n_tokens, n_heads, head_dim, ld, n_rot, pos0, rope);
  const float theta_scale = std::pow(rope.base, -2.0f / static_cast<float>(n_rot));
  const int half = n_rot / 2;
  const float mscale = rope.mscale();
  // Which axis each pair turns with (0..2 = t, h, w: the position; 3 = e: position 0), as the
  // reference's interleaved section rule.
  std::vector<uint8_t> axis(static_cast<size_t>(half));
  for (int i = 0; i < half; ++i) {
    const int s = i % sect_dims;
    if (s % 3 == 1 && s < 3 * sections[1]) axis[i] = 1;
    else if (s % 3 == 2 && s < 3 * sections[2]) axis[i] = 2;
    else if (s % 3 == 0 && s < 3 * sections[0]) axis[i] = 0;
    else axis[i] = 3;
  }
  std::vector<float> cs(static_cast<size_t>(n_rot));
  for (int t = 0; t < n_tokens; ++t) {
    // Every text axis starts from the same position and advances by the same factor, so one angle
    // serves them all; the e axis starts (and stays) at 0.
    float theta_p = static_cast<float>(pos0 + t), theta_e = 0.0f;
    for (int i = 0; i < half; ++i) {
      const float theta_extrap = axis[i] == 3 ? theta_e : theta_p;
      float th = rope.freq_scale * theta_extrap;
      if (rope.ext_factor != 0.0f) {
        const float mix = rope_yarn_ramp(rope.corr_lo, rope.corr_hi, i) * rope.ext_factor;
        th = th * (1.0f - mix) + theta_extrap * mix;
      }
      cs[2 * i] = std::cos(th) * mscale;
      cs[2 * i + 1] = std::sin(th) * mscale;
      theta_p *= theta_scale;
      theta_e *= theta_scale;
    }
    for (int h = 0; h < n_heads; ++h) {
      float* v = x + t * ld + static_cast<int64_t>(h) * head_dim;
      for (int i = 0; i < half; ++i) {
        const float x0 = v[i], x1 = v[i + half];
        v[i] = x0 * cs[2 * i] - x1 * cs[2 * i + 1];
        v[i + half] = x0 * cs[2 * i + 1] + x1 * cs[2 * i];
      }
    }
  }
}

void conv1d_silu(ThreadPool& pool, const float* x, int64_t ld_x, int n_tokens, int channels, const float* w, int K,
                 float* state, float* out, int64_t ld_out) {
  const int keep = K - 1;
  // Channels are independent: blocks of them per thread, each channel through a window of its
  // kept inputs followed by this batch's.
  const int64_t block = 64;
  pool.parallel_for((channels + block - 1) / block, 1, [&](int64_t b, int64_t e, int) {
    std::vector<float> win(static_cast<size_t>(keep + n_tokens));
    for (int64_t c = b * block; c < std::min<int64_t>(e * block, channels); ++c) {
      float* st = state + c * keep;
      const float* wc = w + c * K;
      std::memcpy(win.data(), st, sizeof(float) * keep);
      for (int t = 0; t < n_tokens; ++t) win[keep + t] = x[t * ld_x + c];
      for (int t = 0; t < n_tokens; ++t) {
        float sum = 0.0f;
        for (int j = 0; j < K; ++j) sum += win[t + j] * wc[j];
        out[t * ld_out + c] = silu(sum);
      }
      std::memcpy(st, win.data() + n_tokens, sizeof(float) * keep);
    }
  });
}

void l2_norm(float* x, int n, int n_rows, int64_t ld, float eps) {
  for (int r = 0; r < n_rows; ++r) {
    float* xr = x + r * ld;
    double sum = 0;
    for (int i = 0; i < n; ++i) sum += static_cast<double>(xr[i] * xr[i]);
    const float scale = 1.0f / std::max(std::sqrt(static_cast<float>(sum)), eps);
    for (int i = 0; i < n; ++i) xr[i] *= scale;
  }
}

namespace detail {
// The AVX2 + FMA build of delta_head (cpu_deltanet_avx2.cpp).
void delta_head_avx2(float* S, int dk, int dv, int n_tokens, const float* q, const float* k, int64_t ld_qk,
                     const float* v, int64_t ld_v, const float* g, const float* beta, int64_t ld_gb, float* out,
                     int64_t ld_out, float scale);
}  // namespace detail

void gated_delta_net(ThreadPool& pool, const DeltaSpec& d, int n_tokens, const float* q, const float* k, int64_t ld_qk,
                     const float* v, int64_t ld_v, const float* g, const float* beta, float* state, float* out,
                     int64_t ld_out) {
  const int dk = d.head_k_dim, dv = d.head_v_dim, Hv = d.n_v_heads, Hk = d.n_k_heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(dk));
  // The same source for both; FITMOE_ISA=scalar takes the baseline build.
  static const auto head = quant::best_isa() == quant::Isa::Scalar ? delta_head_baseline : detail::delta_head_avx2;
  pool.parallel_for(Hv, 1, [&](int64_t b, int64_t e, int) {
    for (int64_t h = b; h < e; ++h) {
      const int64_t kh = h % Hk;
      head(state + h * dv * dk, dk, dv, n_tokens, q + kh * dk, k + kh * dk, ld_qk, v + h * dv, ld_v, g + h, beta + h, Hv,
           out + h * dv, ld_out, scale);
    }
  });
}

void gated_rms_norm(const float* x, const float* w, const float* z, float* y, int n, int n_rows, float eps) {
  rms_norm(x, w, y, n, n_rows, eps, n, n);
  const int64_t total = static_cast<int64_t>(n) * n_rows;
  for (int64_t i = 0; i < total; ++i) y[i] *= silu(z[i]);
}

void mul_sigmoid(float* x, const float* gate, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] *= sigmoid(gate[i]);
}

}  // namespace fitmoe::cpu
