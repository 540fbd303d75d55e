// Batches of several sequences (Model::forward_batch, what the server's continuous batching runs): every
// sequence's logits are those it gets alone, for every architecture, on the CPU bit for bit (the
// products and attention are per row) and on the GPU within a tolerance (its kernels differ by batch
// size), with sequences of different lengths, one joining while the others decode, and repeated
// steps.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <random>
#include <vector>

#include "model/model.h"
#include "runtime/thread_pool.h"
#include "testdata.h"

namespace fitmoe {
namespace {

struct Case {
  const char* name;
  const char* file;
  bool gpu;
};

std::string PrintTo(const Case& c) { return c.name; }

class Batch : public ::testing::TestWithParam<Case> {};

int argmax(const float* v, int n) { return static_cast<int>(std::max_element(v, v + n) - v); }

// Greedy decoding of `steps` tokens after a prompt, the logits of each step concatenated.
std::vector<float> alone(const Model& m, ThreadPool& pool, const std::vector<int32_t>& prompt, int steps, int start_step,
                         const StateOptions& so) {
  const int V = m.config().n_vocab;
  auto st = m.new_state(so);
  std::vector<float> out, logits(V);
  (void)start_step;
  m.forward(*st, pool, prompt, 1, logits.data());
  out.insert(out.end(), logits.begin(), logits.end());
  for (int s = 0; s < steps; ++s) {
    const int32_t t = argmax(logits.data(), V);
    m.forward(*st, pool, std::vector<int32_t>{t}, 1, logits.data());
    out.insert(out.end(), logits.begin(), logits.end());
  }
  return out;
}

TEST_P(Batch, EverySequenceGetsWhatItGetsAlone) {
  const Case& c = GetParam();
  LoadOptions lo;
  lo.plan.use_gpu = c.gpu;
  lo.plan.n_ctx = 256;
  std::unique_ptr<Model> m;
  try {
    m = Model::load(test::testdata(c.file), lo);
  } catch (const std::exception& e) {
    FAIL() << e.what();
  }
  if (c.gpu && !m->on_gpu()) GTEST_SKIP() << "no GPU";
  const int V = m->config().n_vocab;
  ThreadPool pool(4);
  StateOptions so;
  so.n_ctx = 256;
  so.kv = m->plan().options.kv;
  std::mt19937 rng(7);
  std::uniform_int_distribution<int32_t> tok(3, std::min(V, 4000) - 1);
  // Sequence 2 joins at step 2 with a long prompt (a prefill among decodes); lengths differ.
  const std::vector<int> lens = {5, 17, 40, 1};
  const std::vector<int> join = {0, 0, 2, 1};
  const int steps = 6;
  std::vector<std::vector<int32_t>> prompts;
  for (int n : lens) {
    std::vector<int32_t> p(n);
    for (int32_t& t : p) t = tok(rng);
    prompts.push_back(p);
  }
  std::vector<std::vector<float>> want;
  for (size_t i = 0; i < prompts.size(); ++i) want.push_back(alone(*m, pool, prompts[i], steps, join[i], so));

  std::vector<std::unique_ptr<ModelState>> states;
  for (size_t i = 0; i < prompts.size(); ++i) states.push_back(m->new_state(so));
  std::vector<std::vector<float>> got(prompts.size());
  std::vector<int32_t> next(prompts.size());
  for (int step = 0; step < steps + 3; ++step) {
    std::vector<BatchSeq> batch;
    std::vector<size_t> who;
    for (size_t i = 0; i < prompts.size(); ++i) {
      if (step < join[i] || static_cast<int>(got[i].size()) >= (steps + 1) * V) continue;
      if (step == join[i]) batch.push_back({states[i].get(), prompts[i], 1});
      else batch.push_back({states[i].get(), std::span<const int32_t>(&next[i], 1), 1});
      who.push_back(i);
    }
    if (batch.empty()) continue;
    std::vector<float> logits(batch.size() * V);
    m->forward_batch(pool, batch, logits.data());
    for (size_t j = 0; j < who.size(); ++j) {
      const float* l = logits.data() + j * V;
      got[who[j]].insert(got[who[j]].end(), l, l + V);
      next[who[j]] = argmax(l, V);
    }
  }
  // On the GPU, where it differs: each step's largest difference from the CPU's logits (bit-exact with
  // the sequence alone there), batched and alone.
  std::string where;
  if (c.gpu) {
    LoadOptions cl;
    cl.plan.use_gpu = false;
    cl.plan.n_ctx = 256;
    auto cpu = Model::load(test::testdata(c.file), cl);
    StateOptions cso = so;
    cso.kv = cpu->plan().options.kv;
    for (size_t i = 0; i < prompts.size(); ++i) {
      const std::vector<float> ref = alone(*cpu, pool, prompts[i], steps, join[i], cso);
      where += "\n  sequence " + std::to_string(i) + " |batched - cpu| / |alone - cpu| per step:";
      for (int st = 0; st <= steps && static_cast<size_t>((st + 1) * V) <= got[i].size(); ++st) {
        double db = 0, da = 0;
        for (int j = 0; j < V; ++j) {
          db = std::max(db, static_cast<double>(std::fabs(got[i][st * V + j] - ref[st * V + j])));
          da = std::max(da, static_cast<double>(std::fabs(want[i][st * V + j] - ref[st * V + j])));
        }
        char buf[64];
        std::snprintf(buf, sizeof buf, " %.3g/%.3g", db, da);
        where += buf;
      }
    }
  }
  for (size_t i = 0; i < prompts.size(); ++i) {
    ASSERT_EQ(got[i].size(), want[i].size()) << "sequence " << i;
    double max_diff = 0, scale = 0;
    for (size_t j = 0; j < want[i].size(); ++j) {
      max_diff = std::max(max_diff, static_cast<double>(std::fabs(got[i][j] - want[i][j])));
      scale = std::max(scale, static_cast<double>(std::fabs(want[i][j])));
    }
    if (c.gpu) EXPECT_LE(max_diff, 2e-2 * std::max(1.0, scale)) << "sequence " << i << where;
    else EXPECT_EQ(max_diff, 0.0) << "sequence " << i << ": batched logits differ from the sequence alone";
    for (int s = 0; s <= steps; ++s)
      EXPECT_EQ(argmax(got[i].data() + s * V, V), argmax(want[i].data() + s * V, V)) << "sequence " << i << " step " << s;
  }
  // States advanced by exactly their tokens.
  for (size_t i = 0; i < prompts.size(); ++i) EXPECT_EQ(states[i]->n_past(), lens[i] + steps);
}

TEST(BatchApi, RefusesAStateTwiceAndAFullContext) {
  LoadOptions lo;
  lo.plan.use_gpu = false;
  auto m = Model::load(test::testdata("qwen3moe-tiny/qwen3moe-tiny-q4_k_m.gguf"), lo);
  ThreadPool pool(2);
  StateOptions so;
  so.n_ctx = 8;
  auto a = m->new_state(so);
  const std::vector<int32_t> t = {5, 6, 7};
  std::vector<float> logits(2 * m->config().n_vocab);
  const std::vector<BatchSeq> twice = {{a.get(), t, 1}, {a.get(), t, 1}};
  EXPECT_THROW(m->forward_batch(pool, twice, logits.data()), std::exception);
  const std::vector<int32_t> long_prompt(9, 5);
  const std::vector<BatchSeq> full = {{a.get(), long_prompt, 1}};
  EXPECT_THROW(m->forward_batch(pool, full, logits.data()), std::exception);
  EXPECT_EQ(a->n_past(), 0);  // nothing evaluated
}

INSTANTIATE_TEST_SUITE_P(AllArchitectures, Batch,
                         ::testing::Values(Case{"qwen3moe_cpu", "qwen3moe-tiny/qwen3moe-tiny-q4_k_m.gguf", false},
                                           Case{"qwen35moe_cpu", "qwen35moe-tiny/qwen35moe-tiny-q4_k_m.gguf", false},
                                           Case{"gemma4moe_cpu", "gemma4moe-tiny/gemma4moe-tiny-q4_k_m.gguf", false},
                                           Case{"gemma4_cpu", "gemma4-tiny/gemma4-tiny-q4_k_m.gguf", false},
                                           Case{"qwen3moe_gpu", "qwen3moe-tiny/qwen3moe-tiny-q4_k_m.gguf", true},
                                           Case{"qwen35moe_gpu", "qwen35moe-tiny/qwen35moe-tiny-q4_k_m.gguf", true},
                                           Case{"gemma4moe_gpu", "gemma4moe-tiny/gemma4moe-tiny-q4_k_m.gguf", true},
                                           Case{"gemma4_gpu", "gemma4-tiny/gemma4-tiny-q4_k_m.gguf", true}),
                         [](const ::testing::TestParamInfo<Case>& i) { return std::string(i.param.name); });

}  // namespace
}  // namespace fitmoe
