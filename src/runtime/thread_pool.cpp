#include "runtime/thread_pool.h"

#include <immintrin.h>

#include <thread>

namespace fitmoe {

namespace {
// About 50-100 microseconds of spinning before a worker sleeps: longer than the gap between two ops
// of a decode step, far shorter than the gap between two user requests.
constexpr int kSpinIterations = 20000;

inline void cpu_relax() { _mm_pause(); }
}  // namespace

void SpinBarrier::arrive_and_wait() {
  const uint32_t phase = phase_.load(std::memory_order_acquire);
  if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == n_) {
    arrived_.store(0, std::memory_order_relaxed);  // before the release below: the next phase sees it
    phase_.fetch_add(1, std::memory_order_release);
    return;
  }
  // As in dispatch(): yield the core after a while, in case the thread awaited needs it.
  for (int spins = 0; phase_.load(std::memory_order_acquire) == phase; ++spins) {
    if (spins < kSpinIterations / 10) cpu_relax();
    else std::this_thread::yield();
  }
}

ThreadPool::ThreadPool(int n_threads) {
  if (n_threads <= 0) n_threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  n_threads_ = n_threads;
  for (int t = 1; t < n_threads_; ++t) threads_.emplace_back([this, t] { worker(t); });
}

ThreadPool::~ThreadPool() {
  stop_.store(true);
  generation_.fetch_add(1, std::memory_order_release);
  generation_.notify_all();
  for (auto& t : threads_) t.join();
}

void ThreadPool::dispatch() {
  pending_.store(n_threads_ - 1, std::memory_order_relaxed);
  generation_.fetch_add(1, std::memory_order_seq_cst);
  // Only pay for the futex wake when a worker actually went to sleep (seq_cst pairs with the
  // worker's increment of sleeping_ before it waits on generation_).
  if (sleeping_.load(std::memory_order_seq_cst) > 0) generation_.notify_all();
  job_(job_ctx_, 0, n_threads_);
  // Spin for the stragglers, but yield the core if they take long: on an oversubscribed machine the
  // thread we wait for may need this very core to finish.
  for (int spins = 0; pending_.load(std::memory_order_acquire) != 0; ++spins) {
    if (spins < kSpinIterations / 10) cpu_relax();
    else std::this_thread::yield();
  }
}

void ThreadPool::worker(int tid) {
  // Generation 0 is the constructor's; reading the live counter here instead would lose a job
  // dispatched before this thread got scheduled.
  uint32_t seen = 0;
  for (;;) {
    uint32_t g;
    int spins = 0;
    while ((g = generation_.load(std::memory_order_acquire)) == seen) {
      if (++spins < kSpinIterations) {
        cpu_relax();
      } else {
        sleeping_.fetch_add(1, std::memory_order_seq_cst);
        generation_.wait(seen, std::memory_order_seq_cst);
        sleeping_.fetch_sub(1, std::memory_order_seq_cst);
      }
    }
    seen = g;
    if (stop_.load(std::memory_order_acquire)) return;
    job_(job_ctx_, tid, n_threads_);
    pending_.fetch_sub(1, std::memory_order_acq_rel);
  }
}

}  // namespace fitmoe
