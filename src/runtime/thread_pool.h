// A persistent pool of worker threads for the hundreds of small parallel steps of one decoded token.
//
// Workers spin briefly on a generation counter between jobs (a decode step's ops come microseconds
// apart, so sleeping would cost more than the work) and then block on the counter with a futex
// (std::atomic::wait) so an idle engine uses no CPU. The calling thread takes part as thread 0.
#pragma once
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

namespace fitmoe {

// A barrier for the threads of one ThreadPool::run() job, between phases of a few tens of microseconds
// (hybrid decode's experts): it spins, because a futex wake would cost as much as a phase. Reusable:
// every thread of the job calls arrive_and_wait() the same number of times.
class SpinBarrier {
 public:
  explicit SpinBarrier(int n_threads) : n_(n_threads) {}
  void arrive_and_wait();

 private:
  const int n_;
  alignas(64) std::atomic<int> arrived_{0};
  alignas(64) std::atomic<uint32_t> phase_{0};
};

class ThreadPool {
 public:
  explicit ThreadPool(int n_threads);  // total threads including the caller; <= 0 means all cores
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return n_threads_; }

  // Calls fn(thread_index, n_threads) once on every thread and returns when all have finished.
  template <typename F>
  void run(F&& fn) {
    if (n_threads_ == 1) {
      fn(0, 1);
      return;
    }
    job_ = &invoke<std::remove_reference_t<F>>;
    job_ctx_ = const_cast<void*>(static_cast<const void*>(&fn));
    dispatch();
  }

  // Splits [0, n) into chunks of about `grain` items taken dynamically by the threads:
  // fn(begin, end, thread_index). Dynamic so that uneven chunks (experts with more tokens, say)
  // still balance.
  template <typename F>
  void parallel_for(int64_t n, int64_t grain, F&& fn) {
    if (n <= 0) return;
    if (grain < 1) grain = 1;
    if (n_threads_ == 1 || n <= grain) {
      fn(int64_t(0), n, 0);
      return;
    }
    std::atomic<int64_t> next{0};
    run([&](int tid, int) {
      for (;;) {
        int64_t b = next.fetch_add(grain, std::memory_order_relaxed);
        if (b >= n) break;
        fn(b, std::min(n, b + grain), tid);
      }
    });
  }

  // Static split of [0, n) into one contiguous range per thread: fn(begin, end, thread_index).
  template <typename F>
  void parallel_ranges(int64_t n, F&& fn) {
    run([&](int tid, int nth) {
      int64_t b = n * tid / nth, e = n * (tid + 1) / nth;
      if (b < e) fn(b, e, tid);
    });
  }

 private:
  template <typename F>
  static void invoke(void* ctx, int tid, int nth) { (*static_cast<F*>(ctx))(tid, nth); }
  void dispatch();
  void worker(int tid);

  int n_threads_;
  std::vector<std::thread> threads_;
  void (*job_)(void*, int, int) = nullptr;
  void* job_ctx_ = nullptr;
  alignas(64) std::atomic<uint32_t> generation_{0};
  alignas(64) std::atomic<int> pending_{0};
  alignas(64) std::atomic<int> sleeping_{0};
  std::atomic<bool> stop_{false};
};

}  // namespace fitmoe
