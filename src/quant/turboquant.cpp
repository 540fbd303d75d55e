#include "quant/turboquant.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <mutex>
#include <string>

#include "quant/dtype.h"
#include "runtime/error.h"

namespace fitmoe::tq {

namespace {

void check_block(int n, int bits) {
  if (n < 32 || n > 128 || (n & (n - 1)) != 0)
    throw Error("tq: block of " + std::to_string(n) + " values (a power of two from 32 to 128)");
  if (bits < 2 || bits > 4) throw Error("tq: " + std::to_string(bits) + " bits (2, 3 or 4)");
}

// Lloyd's iteration on a fine grid of the coordinate density; prefix sums make each step O(K log M).
struct Lloyd {
  std::vector<float> centroids;
  double dmse = 0;
};

Lloyd solve(int n, int bits) {
  constexpr int M = 1 << 18;
  const int K = 1 << bits;
  std::vector<double> z(M), w(M), pw(M + 1, 0.0), pwz(M + 1, 0.0), pwzz(M + 1, 0.0);
  const double e = (n - 3) / 2.0;
  double total = 0;
  for (int i = 0; i < M; ++i) {
    z[i] = -1.0 + (i + 0.5) * 2.0 / M;
    w[i] = std::exp(e * std::log1p(-z[i] * z[i]));
    total += w[i];
  }
  for (int i = 0; i < M; ++i) {
    w[i] /= total;
    pw[i + 1] = pw[i] + w[i];
    pwz[i + 1] = pwz[i] + w[i] * z[i];
    pwzz[i + 1] = pwzz[i] + w[i] * z[i] * z[i];
  }
  // Start at the quantile midpoints of K equal-probability cells.
  std::vector<double> c(K);
  for (int k = 0; k < K; ++k) {
    const double q = (k + 0.5) / K;
    c[k] = z[std::lower_bound(pw.begin(), pw.end(), q) - pw.begin() - 1];
  }
  auto cell = [&](double b) { return static_cast<int>(std::lower_bound(z.begin(), z.end(), b) - z.begin()); };
  for (int it = 0; it < 2000; ++it) {
    double moved = 0;
    int lo = 0;
    for (int k = 0; k < K; ++k) {
      const int hi = k + 1 < K ? cell(0.5 * (c[k] + c[k + 1])) : M;
      const double m = pw[hi] - pw[lo];
      const double nc = m > 0 ? (pwz[hi] - pwz[lo]) / m : c[k];
      moved = std::max(moved, std::fabs(nc - c[k]));
      c[k] = nc;
      lo = hi;
    }
    if (moved < 1e-12) break;
  }
  // Symmetrise (the density is even; the grid nearly so) and measure the error.
  for (int k = 0; k < K / 2; ++k) {
    const double a = 0.5 * (c[K - 1 - k] - c[k]);
    c[k] = -a, c[K - 1 - k] = a;
  }
  double mse = 0;
  int lo = 0;
  for (int k = 0; k < K; ++k) {
    const int hi = k + 1 < K ? cell(0.5 * (c[k] + c[k + 1])) : M;
    mse += (pwzz[hi] - pwzz[lo]) - 2 * c[k] * (pwz[hi] - pwz[lo]) + c[k] * c[k] * (pw[hi] - pw[lo]);
    lo = hi;
  }
  Lloyd r;
  for (double v : c) r.centroids.push_back(static_cast<float>(v));
  r.dmse = mse * n;
  return r;
}

const Lloyd& cached(int n, int bits) {
  check_block(n, bits);
  static std::mutex mu;
  static std::map<std::pair<int, int>, Lloyd> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find({n, bits});
  if (it == cache.end()) it = cache.emplace(std::make_pair(n, bits), solve(n, bits)).first;
  return it->second;
}

// The fixed signs of a block size: splitmix64 from a constant seed, one bit per value.
const std::vector<float>& signs(int n, int which) {
  static std::mutex mu;
  static std::map<std::pair<int, int>, std::vector<float>> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto& v = cache[{n, which}];
  if (v.empty()) {
    uint64_t s = 0x7471756e74ULL + static_cast<uint64_t>(n) * 2 + static_cast<uint64_t>(which);
    for (int i = 0; i < n; ++i) {
      uint64_t zz = (s += 0x9e3779b97f4a7c15ULL);
      zz = (zz ^ (zz >> 30)) * 0xbf58476d1ce4e5b9ULL;
      zz = (zz ^ (zz >> 27)) * 0x94d049bb133111ebULL;
      zz ^= zz >> 31;
      v.push_back((zz & 1) ? -1.0f : 1.0f);
    }
  }
  return v;
}

void put_codes(const std::vector<int>& idx, int n, int bits, uint8_t* d) {
  if (bits == 4) {
    for (int i = 0; i < n / 2; ++i) d[i] = static_cast<uint8_t>(idx[2 * i] | (idx[2 * i + 1] << 4));
  } else if (bits == 2) {
    for (int i = 0; i < n / 4; ++i)
      d[i] = static_cast<uint8_t>(idx[4 * i] | (idx[4 * i + 1] << 2) | (idx[4 * i + 2] << 4) | (idx[4 * i + 3] << 6));
  } else {
    for (int i = 0; i < n / 4; ++i)
      d[i] = static_cast<uint8_t>((idx[4 * i] & 3) | ((idx[4 * i + 1] & 3) << 2) | ((idx[4 * i + 2] & 3) << 4) |
                                  ((idx[4 * i + 3] & 3) << 6));
    uint8_t* h = d + n / 4;
    for (int i = 0; i < n / 8; ++i) {
      uint8_t b = 0;
      for (int j = 0; j < 8; ++j) b |= static_cast<uint8_t>(((idx[8 * i + j] >> 2) & 1) << j);
      h[i] = b;
    }
  }
}

// A sum over the n values of a block in a GPU warp's order: lane l folds values l, l + 32, ... with
// `step` (a fused multiply-add), then the lanes are summed by the xor butterfly (offsets 16 .. 1).
template <typename Step>
double warp_sum(int n, Step step) {
  double lane[32];
  for (int l = 0; l < 32; ++l) {
    lane[l] = 0.0;
    for (int i = l; i < n; i += 32) lane[l] = step(i, lane[l]);
  }
  for (int o = 16; o > 0; o >>= 1) {
    double next[32];
    for (int l = 0; l < 32; ++l) next[l] = lane[l] + lane[l ^ o];
    std::copy(next, next + 32, lane);
  }
  return lane[0];
}

int get_code(const uint8_t* d, int n, int bits, int i) {
  if (bits == 4) return (d[i / 2] >> (4 * (i % 2))) & 15;
  if (bits == 2) return (d[i / 4] >> (2 * (i % 4))) & 3;
  return ((d[i / 4] >> (2 * (i % 4))) & 3) | (((d[n / 4 + i / 8] >> (i % 8)) & 1) << 2);
}

}  // namespace

void walsh_hadamard(float* x, int n) {
  const float s = 1.0f / std::sqrt(static_cast<float>(n));
  for (int i = 0; i < n; ++i) x[i] *= s;
  for (int len = 1; len < n; len <<= 1)
    for (int i = 0; i < n; i += 2 * len)
      for (int j = i; j < i + len; ++j) {
        const float a = x[j], b = x[j + len];
        x[j] = a + b;
        x[j + len] = a - b;
      }
}

const std::vector<float>& lloyd_max_codebook(int n, int bits) { return cached(n, bits).centroids; }
double lloyd_max_dmse(int n, int bits) { return cached(n, bits).dmse; }

void rotate(float* x, int n) {
  const auto &s1 = signs(n, 1), &s2 = signs(n, 2);
  for (int i = 0; i < n; ++i) x[i] *= s1[i];
  walsh_hadamard(x, n);
  for (int i = 0; i < n; ++i) x[i] *= s2[i];
}

std::vector<float> rotation_signs(int n, int which) {
  check_block(n, 2);
  if (which != 1 && which != 2) throw Error("tq: sign vector " + std::to_string(which) + " (1 or 2)");
  return signs(n, which);
}

void unrotate(float* x, int n) {
  const auto &s1 = signs(n, 1), &s2 = signs(n, 2);
  for (int i = 0; i < n; ++i) x[i] *= s2[i];
  walsh_hadamard(x, n);
  for (int i = 0; i < n; ++i) x[i] *= s1[i];
}

size_t block_bytes(int n, int bits) {
  check_block(n, bits);
  return 2 + static_cast<size_t>(n) * bits / 8;
}

void encode_block(const float* x, int n, int bits, uint8_t* dst, Scale scale, const std::vector<float>* codebook) {
  check_block(n, bits);
  const std::vector<float>& cb = codebook ? *codebook : lloyd_max_codebook(n, bits);
  const int K = 1 << bits;
  if (static_cast<int>(cb.size()) != K) throw Error("tq: a codebook of " + std::to_string(cb.size()) + " centroids");
  std::vector<float> y(x, x + n);
  for (int i = 0; i < n; ++i)
    if (!std::isfinite(y[i])) throw Error("tq: value " + std::to_string(i) + " of a block is not finite");
  rotate(y.data(), n);
  const double nn = warp_sum(n, [&](int i, double acc) { return std::fma(static_cast<double>(y[i]), static_cast<double>(y[i]), acc); });
  const double norm = std::sqrt(nn);
  std::vector<int> idx(n);
  std::vector<double> z(n);
  for (int i = 0; i < n; ++i) {
    const double zi = norm > 0 ? y[i] / norm : 0.0;
    int k = 0;
    while (k + 1 < K && zi > 0.5 * (static_cast<double>(cb[k]) + cb[k + 1])) ++k;
    idx[i] = k;
    z[i] = zi;
  }
  const double zc = warp_sum(n, [&](int i, double acc) { return std::fma(z[i], static_cast<double>(cb[idx[i]]), acc); });
  const double cc = warp_sum(n, [&](int i, double acc) {
    return std::fma(static_cast<double>(cb[idx[i]]), static_cast<double>(cb[idx[i]]), acc);
  });
  double gamma = 0;
  if (norm > 0 && cc > 0 && zc > 0) {
    switch (scale) {
      case Scale::Unbiased: gamma = norm / zc; break;
      case Scale::LeastSquares: gamma = norm * zc / cc; break;
      case Scale::NormCorrected: gamma = norm / std::sqrt(cc); break;
    }
  }
  const uint16_t g = f32_to_f16(static_cast<float>(gamma));
  if ((g & 0x7c00u) == 0x7c00u)
    throw Error("tq: a block's scale " + std::to_string(gamma) + " does not fit an f16 (values too large for the cache)");
  std::memcpy(dst, &g, 2);
  put_codes(idx, n, bits, dst + 2);
}

void decode_block_rotated(const uint8_t* src, int n, int bits, float* out, const std::vector<float>* codebook) {
  check_block(n, bits);
  const std::vector<float>& cb = codebook ? *codebook : lloyd_max_codebook(n, bits);
  uint16_t g;
  std::memcpy(&g, src, 2);
  const float gamma = f16_to_f32(g);
  for (int i = 0; i < n; ++i) out[i] = gamma * cb[get_code(src + 2, n, bits, i)];
}

void decode_block(const uint8_t* src, int n, int bits, float* out, const std::vector<float>* codebook) {
  decode_block_rotated(src, n, bits, out, codebook);
  unrotate(out, n);
}

}  // namespace fitmoe::tq
