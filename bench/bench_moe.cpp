// The host side of hybrid decode: cpu::expert_ffn for one token and the experts the router chose, on
// the Qwen3-30B-A3B expert shape (2048 -> 768 -> 2048; gate/up Q4_K, down Q6_K as in Q4_K_M). A pool of
// 128 experts (392 MB, larger than the last-level cache) is sampled at random, so every step reads its
// experts from RAM, as decode does. Counter GB/s = expert bytes read per step / time: compare with the
// machine's RAM bandwidth (docs/performance.md).
//   fitmoe_microbench --benchmark_filter=ExpertFfn --benchmark_min_time=1
#include <benchmark/benchmark.h>

#include <random>
#include <vector>

#include "expert_stack.h"
#include "quant/dtype.h"
#include "quant/kernels.h"
#include "runtime/cpu_ops.h"
#include "runtime/thread_pool.h"

namespace fitmoe {
namespace {

constexpr int kExperts = 128, kEmbd = 2048, kFf = 768;

struct ExpertPool {
  std::vector<uint8_t> gate, up, down;
  cpu::ExpertWeights w;
  size_t bytes_per_expert = 0;
};

const ExpertPool& experts() {
  static ExpertPool p = [] {
    ExpertPool e;
    e.w.gate = bench::random_expert_stack(DType::Q4_K, kEmbd, kFf, kExperts, e.gate, 1);
    e.w.up = bench::random_expert_stack(DType::Q4_K, kEmbd, kFf, kExperts, e.up, 2);
    e.w.down = bench::random_expert_stack(DType::Q6_K, kFf, kEmbd, kExperts, e.down, 3);
    e.bytes_per_expert = e.w.gate.matrix_bytes() + e.w.up.matrix_bytes() + e.w.down.matrix_bytes();
    return e;
  }();
  return p;
}

// range(0): experts per step (8 = all of a token's choices on the CPU; 5 = two thirds, as with
// --vram 8G on the 30B shape).
void BM_ExpertFfnDecode(benchmark::State& state) {
  const ExpertPool& e = experts();
  const int n = static_cast<int>(state.range(0));
  ThreadPool pool(static_cast<int>(state.range(1)));
  cpu::Scratch scratch;
  std::mt19937 rng(7);
  std::normal_distribution<float> nd;
  std::vector<float> x(kEmbd), out(static_cast<size_t>(n) * kEmbd);
  for (auto& v : x) v = nd(rng);
  std::vector<int32_t> tok(n, 0), ids(n);
  for (auto _ : state) {
    for (int i = 0; i < n; ++i) ids[i] = static_cast<int32_t>((rng() % (kExperts / n)) * n + i);  // distinct
    cpu::expert_ffn(pool, e.w, x.data(), 1, kEmbd, tok.data(), ids.data(), n, out.data(), scratch);
    benchmark::DoNotOptimize(out.data());
  }
  state.counters["GB/s"] = benchmark::Counter(static_cast<double>(e.bytes_per_expert) * n,
                                              benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_ExpertFfnDecode)->Args({8, 1})->Args({8, 2})->Args({5, 2})->Args({8, 15})->Unit(benchmark::kMicrosecond)->UseRealTime();

}  // namespace
}  // namespace fitmoe
