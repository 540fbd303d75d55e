#include "text/sampling.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <unordered_map>

#include "runtime/error.h"

namespace fitmoe {

int32_t Sampler::sample(const float* logits, int n_vocab, std::span<const int32_t> history) {
  cand_.resize(static_cast<size_t>(n_vocab));
  int n_nan = 0;
  for (int i = 0; i < n_vocab; ++i) {
    cand_[i] = {logits[i], i};
    n_nan += std::isnan(logits[i]);
  }
  // NaN logits come from NaN or infinite weights or activations: any token drawn from them would be
  // garbage, so say so instead.
  if (n_nan > 0)
    throw Error("the model produced " + std::to_string(n_nan) + " NaN logits of " + std::to_string(n_vocab) +
                " (its weights, or the activations computed from them, hold NaN or infinite values)");

  const bool penalties = p_.repeat_penalty != 1.0f || p_.presence_penalty != 0.0f || p_.frequency_penalty != 0.0f;
  if (penalties && p_.repeat_last_n != 0) {
    size_t n = p_.repeat_last_n < 0 ? history.size() : std::min<size_t>(history.size(), p_.repeat_last_n);
    std::unordered_map<int32_t, int> count;
    for (auto it = history.end() - static_cast<std::ptrdiff_t>(n); it != history.end(); ++it) ++count[*it];
    for (const auto& [t, c] : count) {
      if (t < 0 || t >= n_vocab) continue;
      float& l = cand_[t].first;
      if (p_.repeat_penalty != 1.0f) l = l > 0 ? l / p_.repeat_penalty : l * p_.repeat_penalty;
      l -= p_.presence_penalty + p_.frequency_penalty * static_cast<float>(c);
    }
  }

  auto greater = [](const auto& a, const auto& b) { return a.first > b.first || (a.first == b.first && a.second < b.second); };
  if (p_.temperature <= 0.0f) return std::min_element(cand_.begin(), cand_.end(), greater)->second;

  size_t n = cand_.size();
  if (p_.top_k > 0 && static_cast<size_t>(p_.top_k) < n) n = static_cast<size_t>(p_.top_k);
  std::partial_sort(cand_.begin(), cand_.begin() + n, cand_.end(), greater);
  cand_.resize(n);

  // Softmax of the survivors (at temperature 1 for the p cut-offs, as the reference orders them).
  std::vector<double> prob(n);
  const double mx = cand_[0].first;
  double sum = 0;
  for (size_t i = 0; i < n; ++i) sum += prob[i] = std::exp(cand_[i].first - mx);
  for (auto& p : prob) p /= sum;
  if (p_.top_p < 1.0f) {
    double cum = 0;
    size_t keep = n;
    for (size_t i = 0; i < n; ++i) {
      cum += prob[i];
      if (cum >= p_.top_p) { keep = i + 1; break; }
    }
    n = keep;
  }
  if (p_.min_p > 0.0f) {
    size_t keep = 1;
    while (keep < n && prob[keep] >= p_.min_p * prob[0]) ++keep;
    n = keep;
  }
  // Temperature, then draw.
  std::vector<double> w(n);
  double wsum = 0;
  for (size_t i = 0; i < n; ++i) wsum += w[i] = std::exp((cand_[i].first - mx) / p_.temperature);
  std::uniform_real_distribution<double> u(0.0, wsum);
  double r = u(rng_);
  for (size_t i = 0; i < n; ++i) {
    if ((r -= w[i]) <= 0) return cand_[i].second;
  }
  return cand_[n - 1].second;
}

}  // namespace fitmoe
