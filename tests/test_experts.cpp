// cpu::expert_ffn (the routed experts on the CPU: CPU-only MoE layers and hybrid decode's host experts)
// against a plain scalar reference built from the format definitions, on fresh random weights: both
// of its work splits (static shares for decode-sized batches, dynamic blocks above), several thread
// counts, experts chosen once or by several tokens.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <random>
#include <span>
#include <vector>

#include "quant/dtype.h"
#include "quant/kernels.h"
#include "runtime/cpu_ops.h"
#include "runtime/thread_pool.h"

namespace fitmoe {
namespace {

constexpr int kExperts = 16, kEmbd = 512, kFf = 512;

struct Stack {
  std::vector<uint8_t> mem;
  Weight w;
};

Stack random_stack(DType t, int64_t cols, int64_t rows, uint64_t seed) {
  Stack s;
  s.w.type = t;
  s.w.ne[0] = cols;
  s.w.ne[1] = rows;
  s.w.ne[2] = kExperts;
  s.w.row_bytes = row_bytes(t, cols);
  s.mem.resize(s.w.row_bytes * rows * kExperts);
  quant::fill_random_rows(t, s.mem.data(), rows * kExperts, cols, 0.05f, seed);
  s.w.host = s.mem.data();
  return s;
}

// y[r] = dot(row r of expert e, x in the weight's activation format), by the scalar reference.
std::vector<float> ref_matvec(const Weight& w3, int e, const float* x) {
  const Weight m = w3.expert(e);
  const DType act = dtype_info(m.type).act_type;
  std::vector<uint8_t> xq(row_bytes(act, m.cols()));
  quant::quantize_act_row_ref(act, x, xq.data(), m.cols());
  std::vector<float> y(static_cast<size_t>(m.rows()));
  for (int64_t r = 0; r < m.rows(); ++r) y[r] = quant::vec_dot_ref(m.type, m.cols(), m.row(r), xq.data());
  return y;
}

class ExpertFfn : public ::testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(ExpertFfn, MatchesScalarReference) {
  const auto [n_tokens, n_threads] = GetParam();
  const int k = 4;
  std::mt19937 rng(1000 + n_tokens * 31 + n_threads);
  const uint64_t seed = rng();
  const Stack gate = random_stack(DType::Q4_K, kEmbd, kFf, seed), up = random_stack(DType::Q4_K, kEmbd, kFf, seed + 1),
              down = random_stack(DType::Q6_K, kFf, kEmbd, seed + 2);
  const cpu::ExpertWeights w{gate.w, up.w, down.w, {}};
  std::normal_distribution<float> nd;
  std::vector<float> x(static_cast<size_t>(n_tokens) * kEmbd);
  for (float& v : x) v = nd(rng);
  // k distinct experts per token out of 16, so that tokens share experts.
  std::vector<int32_t> tok, exp;
  for (int t = 0; t < n_tokens; ++t) {
    std::vector<int> pick(kExperts);
    for (int e = 0; e < kExperts; ++e) pick[e] = e;
    std::shuffle(pick.begin(), pick.end(), rng);
    for (int j = 0; j < k; ++j) tok.push_back(t), exp.push_back(pick[j]);
  }
  const int n_assign = static_cast<int>(tok.size());
  std::vector<float> out(static_cast<size_t>(n_assign) * kEmbd, NAN);
  ThreadPool pool(n_threads);
  cpu::Scratch scratch;
  cpu::expert_ffn(pool, w, x.data(), n_tokens, kEmbd, tok.data(), exp.data(), n_assign, out.data(), scratch);
  // The same with each slot's output sent to another row (reversed, one spare row left untouched).
  std::vector<int32_t> rows(n_assign);
  for (int a = 0; a < n_assign; ++a) rows[a] = n_assign - a;
  std::vector<float> moved(static_cast<size_t>(n_assign + 1) * kEmbd, NAN);
  cpu::expert_ffn(pool, w, x.data(), n_tokens, kEmbd, tok.data(), exp.data(), n_assign, moved.data(), scratch,
                  rows.data());
  for (int i = 0; i < kEmbd; ++i) ASSERT_TRUE(std::isnan(moved[i])) << "row 0 was written";
  for (int a = 0; a < n_assign; ++a)
    ASSERT_EQ(std::memcmp(&moved[static_cast<size_t>(rows[a]) * kEmbd], &out[static_cast<size_t>(a) * kEmbd],
                          sizeof(float) * kEmbd), 0)
        << "slot " << a << " differs when sent to row " << rows[a];

  // Decode-sized batches with some experts split by slice (as after a prefetch of guessed experts):
  // guessed ones the slots use, one they do not, an out-of-range id; the same bits, only other threads.
  if (n_tokens <= cpu::kExpertFfnStaticTokens) {
    const std::vector<int32_t> guessed = {exp[0], exp[n_assign - 1], (exp[0] + 1) % kExperts, -1, kExperts};
    for (size_t n_guessed : {size_t{1}, guessed.size()}) {
      std::vector<float> sliced(out.size(), NAN);
      cpu::expert_ffn(pool, w, x.data(), n_tokens, kEmbd, tok.data(), exp.data(), n_assign, sliced.data(), scratch,
                      nullptr, std::span<const int32_t>(guessed.data(), n_guessed));
      ASSERT_EQ(std::memcmp(sliced.data(), out.data(), sizeof(float) * out.size()), 0)
          << n_guessed << " guessed experts change the outputs";
    }
  }

  // The fast kernels are bit-exact with the reference dot products, so the whole chain is too.
  int64_t differ = 0;
  for (int a = 0; a < n_assign; ++a) {
    const float* xt = x.data() + static_cast<size_t>(tok[a]) * kEmbd;
    std::vector<float> g = ref_matvec(w.gate, exp[a], xt), u = ref_matvec(w.up, exp[a], xt);
    std::vector<float> h(kFf);
    cpu::swiglu(g.data(), u.data(), h.data(), kFf);
    const std::vector<float> y = ref_matvec(w.down, exp[a], h.data());
    for (int i = 0; i < kEmbd; ++i) differ += std::memcmp(&y[i], &out[static_cast<size_t>(a) * kEmbd + i], 4) != 0;
  }
  EXPECT_EQ(differ, 0) << "of " << n_assign * kEmbd << " outputs (" << n_tokens << " tokens, " << n_threads
                       << " threads)";
}

// 1-8 tokens take the static split, 12 and 40 the dynamic one; thread counts that do and do not divide
// the rows, and more threads than 16-row shares of one expert.
INSTANTIATE_TEST_SUITE_P(SplitsAndThreads, ExpertFfn,
                         ::testing::Combine(::testing::Values(1, 3, cpu::kExpertFfnStaticTokens, 12, 40),
                                            ::testing::Values(1, 3, 7, 40)));

// The sliced split gives every row to exactly one thread, whatever the count of threads.
TEST(ExpertSlice, CoversEveryRowOnce) {
  for (int64_t rows : {1, 7, 16, 768, 2048})
    for (int nth : {1, 2, 3, 15, 16, 40}) {
      int64_t next = 0;
      for (int t = 0; t < nth; ++t) {
        const auto [r0, r1] = cpu::expert_slice(rows, t, nth);
        ASSERT_EQ(r0, next) << rows << " rows, " << nth << " threads, thread " << t;
        ASSERT_LE(r0, r1);
        ASSERT_LE(r1 - r0, (rows + nth - 1) / nth);
        next = r1;
      }
      EXPECT_EQ(next, rows) << rows << " rows, " << nth << " threads";
    }
}

// The threads' prefetches together cover each guessed expert's three matrices (ids out of range are
// skipped), and a stop asked for at once prefetches nothing.
TEST(ExpertSlice, PrefetchCoversTheGuessedExpertsAndStops) {
  const Stack gate = random_stack(DType::Q4_K, kEmbd, kFf, 1), up = random_stack(DType::Q4_K, kEmbd, kFf, 2),
              down = random_stack(DType::Q6_K, kFf, kEmbd, 3);
  const cpu::ExpertWeights w{gate.w, up.w, down.w, {}};
  const std::vector<int32_t> guessed = {3, -1, 9, kExperts};
  const size_t per_expert = gate.w.matrix_bytes() + up.w.matrix_bytes() + down.w.matrix_bytes();
  for (int nth : {1, 3, 7}) {
    size_t total = 0;
    for (int t = 0; t < nth; ++t) total += cpu::prefetch_expert_slices(w, guessed, t, nth, [] { return false; });
    EXPECT_EQ(total, 2 * per_expert) << nth << " threads";
    EXPECT_EQ(cpu::prefetch_expert_slices(w, guessed, 0, nth, [] { return true; }), 0u);
  }
  int asked = 0;  // stops after the first 4 KiB
  EXPECT_EQ(cpu::prefetch_expert_slices(w, guessed, 0, 1, [&] { return asked++ > 0; }), 4096u);
  // Expert 0 starts the allocation: its first line is read, and nothing before it (no fault; the
  // sanitizer builds would see a read outside the vector).
  const std::vector<int32_t> first = {0};
  EXPECT_EQ(cpu::prefetch_expert_slices(w, first, 0, 1, [] { return false; }), per_expert);
}

TEST(SpinBarrier, NoThreadPassesBeforeAllArrive) {
  ThreadPool pool(5);
  SpinBarrier barrier(pool.size());
  std::vector<std::atomic<int>> reached(50);
  std::atomic<int> early{0};
  pool.run([&](int, int nth) {
    for (int phase = 0; phase < 50; ++phase) {
      reached[phase]++;
      barrier.arrive_and_wait();
      if (reached[phase].load() != nth) early++;
    }
  });
  EXPECT_EQ(early.load(), 0);
}

}  // namespace
}  // namespace fitmoe
