// The sampler: greedy picks the largest logit (the lowest id on ties), a draw stays inside top-k, and
// NaN logits are an error rather than a token drawn from garbage.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "runtime/error.h"
#include "text/sampling.h"

namespace fitmoe {
namespace {

TEST(Sampler, GreedyTakesTheLargestLowestIdOnTies) {
  SamplerParams p;
  p.temperature = 0;
  Sampler s(p);
  const std::vector<float> logits = {0.5f, 2.0f, -1.0f, 2.0f, 1.5f};
  EXPECT_EQ(s.sample(logits.data(), static_cast<int>(logits.size()), {}), 1);
}

TEST(Sampler, DrawStaysInsideTopK) {
  SamplerParams p;
  p.temperature = 1.5f;
  p.top_k = 2;
  p.top_p = 1.0f;
  p.min_p = 0.0f;
  Sampler s(p);
  const std::vector<float> logits = {0.0f, 3.0f, 0.1f, 2.9f, 0.2f};
  for (int i = 0; i < 200; ++i) {
    const int32_t t = s.sample(logits.data(), static_cast<int>(logits.size()), {});
    ASSERT_TRUE(t == 1 || t == 3) << "drew " << t;
  }
}

TEST(Sampler, NanLogitsAreAnError) {
  for (float temperature : {0.0f, 0.8f}) {
    SamplerParams p;
    p.temperature = temperature;
    Sampler s(p);
    std::vector<float> logits = {0.5f, 2.0f, -1.0f, 2.0f};
    logits[2] = std::numeric_limits<float>::quiet_NaN();
    try {
      s.sample(logits.data(), static_cast<int>(logits.size()), {});
      FAIL() << "no error at temperature " << temperature;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("NaN logits"), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace fitmoe
