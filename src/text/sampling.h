// Choosing the next token from logits: greedy, or temperature with top-k / top-p / min-p and a
// repetition penalty, in llama.cpp's order (penalties, top-k, top-p, min-p, temperature, draw).
#pragma once
#include <cstdint>
#include <random>
#include <span>
#include <vector>

namespace fitmoe {

struct SamplerParams {
  float temperature = 0.8f;   // <= 0: greedy (argmax, lowest id on ties)
  int top_k = 40;             // <= 0: off
  float top_p = 0.95f;        // >= 1: off
  float min_p = 0.05f;        // <= 0: off
  float repeat_penalty = 1.0f;  // 1: off; divides positive / multiplies negative logits of recent tokens
  int repeat_last_n = 64;       // the window of the three penalties (-1: all of the history)
  // OpenAI's penalties over the same window: logit -= presence * [count > 0] + frequency * count.
  float presence_penalty = 0.0f, frequency_penalty = 0.0f;
  uint64_t seed = 0xF17F00Du;
};

class Sampler {
 public:
  explicit Sampler(const SamplerParams& p) : p_(p), rng_(p.seed) {}
  // history: tokens seen so far (prompt and generated), for the repetition penalty. Throws Error when
  // any logit is NaN.
  int32_t sample(const float* logits, int n_vocab, std::span<const int32_t> history);
  const SamplerParams& params() const { return p_; }

 private:
  SamplerParams p_;
  std::mt19937_64 rng_;
  std::vector<std::pair<float, int32_t>> cand_;
};

}  // namespace fitmoe
