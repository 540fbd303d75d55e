#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "runtime/thread_pool.h"

using fitmoe::ThreadPool;

TEST(ThreadPool, RunsEveryThreadOnce) {
  ThreadPool pool(4);
  for (int rep = 0; rep < 1000; ++rep) {
    std::vector<std::atomic<int>> hits(4);
    pool.run([&](int tid, int nth) {
      ASSERT_EQ(nth, 4);
      hits[tid]++;
    });
    for (auto& h : hits) ASSERT_EQ(h.load(), 1);
  }
}

TEST(ThreadPool, ParallelForCoversRangeExactlyOnce) {
  ThreadPool pool(3);
  for (int64_t n : {0, 1, 5, 64, 1000, 4097}) {
    std::vector<std::atomic<int>> seen(static_cast<size_t>(n));
    pool.parallel_for(n, 7, [&](int64_t b, int64_t e, int) {
      for (int64_t i = b; i < e; ++i) seen[i]++;
    });
    for (auto& s : seen) ASSERT_EQ(s.load(), 1);
    std::vector<std::atomic<int>> seen2(static_cast<size_t>(n));
    pool.parallel_ranges(n, [&](int64_t b, int64_t e, int) {
      for (int64_t i = b; i < e; ++i) seen2[i]++;
    });
    for (auto& s : seen2) ASSERT_EQ(s.load(), 1);
  }
}

TEST(ThreadPool, WakesAfterSleeping) {
  ThreadPool pool(2);
  std::atomic<int> count{0};
  pool.run([&](int, int) { count++; });
  // Long enough for the workers to stop spinning and block on the futex.
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  pool.run([&](int, int) { count++; });
  EXPECT_EQ(count.load(), 4);
}
