// Does hybrid decode's prefetch of guessed experts pay on this machine? cpu::expert_ffn for one token
// and 5 experts of the Qwen3-30B-A3B shape (gate/up Q4_K 2048 -> 768, down Q6_K), picked at random from
// a pool larger than the last-level cache, timed after each thread has spent up to WAIT_US fetching its
// slices (cpu::expert_slice) of some of them, as decode does while it waits for the GPU's routing:
//   none     nothing fetched (every byte comes from RAM during the product)
//   read-all the slices of all 5 read in turn (cpu::prefetch_expert_slices: a load per line) until the
//            time is up
//   read-2   the same for 2 of the 5 (the others stay cold)
//   pf-all   software prefetch instructions (T1, into L2) instead of the loads
//   sliced   nothing fetched, but the product split by slices as after a fetch of all 5
//   hot      the product run twice on the same experts, the second timed: the speed of the kernels on
//            data already in the caches, the most a fetch ahead could give
// Prints, per mode, the product's time and the bytes the fetch covered.
//   fitmoe_expert_prefetch [threads (default: cores - 1)] [wait_us (40)] [reps (200)]
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "expert_stack.h"
#include "quant/dtype.h"
#include "quant/kernels.h"
#include "runtime/cpu_ops.h"
#include "runtime/thread_pool.h"

using namespace fitmoe;

namespace {

constexpr int kExperts = 384, kEmbd = 2048, kFf = 768, kUsed = 5;

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  const int hw = static_cast<int>(std::thread::hardware_concurrency());
  const int threads = argc > 1 ? std::atoi(argv[1]) : std::max(1, hw - 1);
  const double wait_s = (argc > 2 ? std::atof(argv[2]) : 40.0) * 1e-6;
  const int reps = argc > 3 ? std::atoi(argv[3]) : 200;
  std::vector<uint8_t> mg, mu, md;
  cpu::ExpertWeights w;
  w.gate = bench::random_expert_stack(DType::Q4_K, kEmbd, kFf, kExperts, mg, 1);
  w.up = bench::random_expert_stack(DType::Q4_K, kEmbd, kFf, kExperts, mu, 2);
  w.down = bench::random_expert_stack(DType::Q6_K, kFf, kEmbd, kExperts, md, 3);
  const double per_expert = static_cast<double>(w.gate.matrix_bytes() + w.up.matrix_bytes() + w.down.matrix_bytes());
  std::printf("pool: %d experts, %.2f GB; %d threads; fetch time %.0f us; %d reps per mode\n", kExperts,
              per_expert * kExperts / 1e9, threads, wait_s * 1e6, reps);
  ThreadPool pool(threads);
  cpu::Scratch scratch;
  std::mt19937 rng(11);
  std::normal_distribution<float> nd;
  std::vector<float> x(kEmbd), out(static_cast<size_t>(kUsed) * kEmbd);
  for (auto& v : x) v = nd(rng);
  std::vector<int32_t> tok(kUsed, 0);
  const char* modes[] = {"none", "read-all", "read-2", "pf-all", "sliced", "hot"};
  constexpr int kModes = 6;
  double t_sum[kModes] = {}, fetched[kModes] = {};
  for (int rep = 0; rep < reps; ++rep) {
    for (int m = 0; m < kModes; ++m) {  // modes interleaved, each with fresh experts
      std::vector<int32_t> ids;
      while (static_cast<int>(ids.size()) < kUsed) {
        const int32_t e = static_cast<int32_t>(rng() % kExperts);
        if (std::find(ids.begin(), ids.end(), e) == ids.end()) ids.push_back(e);
      }
      std::vector<int32_t> guessed = m == 0 || m == 5 ? std::vector<int32_t>{}
                                     : m == 2   ? std::vector<int32_t>(ids.begin(), ids.begin() + 2)
                                                : ids;
      std::vector<size_t> per_thread(static_cast<size_t>(pool.size()), 0);
      const auto t0 = std::chrono::steady_clock::now();
      pool.run([&](int tid, int nth) {
        auto stop = [&] { return seconds_since(t0) > wait_s; };
        if (m == 3) {
          for (const int32_t e : guessed)
            for (const Weight* mat : {&w.gate, &w.up, &w.down}) {
              const auto [r0, r1] = cpu::expert_slice(mat->rows(), tid, nth);
              const Weight me = mat->expert(e);
              const uint8_t* p = me.row(r0);
              const size_t n = static_cast<size_t>(r1 - r0) * me.row_bytes;
              for (size_t off = 0; off < n; off += 64) {
                if ((off & 4095) == 0 && stop()) return;
                _mm_prefetch(reinterpret_cast<const char*>(p + off), _MM_HINT_T1);
                per_thread[tid] += 64;
              }
            }
        } else if (m > 0 && m < 4) {
          per_thread[tid] = cpu::prefetch_expert_slices(w, guessed, tid, nth, stop);
        }
        while (!stop()) {
        }  // the rest of the wait (the routing has not come yet)
      });
      if (m == 5)
        cpu::expert_ffn(pool, w, x.data(), 1, kEmbd, tok.data(), ids.data(), kUsed, out.data(), scratch, nullptr, {});
      const auto t1 = std::chrono::steady_clock::now();
      cpu::expert_ffn(pool, w, x.data(), 1, kEmbd, tok.data(), ids.data(), kUsed, out.data(), scratch, nullptr,
                      guessed);
      t_sum[m] += seconds_since(t1);
      for (const size_t b : per_thread) fetched[m] += static_cast<double>(b);
    }
  }
  for (int m = 0; m < kModes; ++m) {
    const double t = t_sum[m] / reps;
    std::printf("%-9s product %7.1f us (%5.1f GB/s of the %.2f MB), fetched before it %.2f MB\n", modes[m], t * 1e6,
                per_expert * kUsed / t / 1e9, per_expert * kUsed / 1e6, fetched[m] / reps / 1e6);
  }
  return 0;
}
