// Micro-benchmarks of the quantized CPU kernels (Google Benchmark).
//
//   GEMV (decode):  n = 2048, 6144 rows (8 experts x 768), one column; counter GB/s = weight bytes read.
//                   "hot": one matrix (fits in L3), "cold": a pool of matrices larger than L3.
//   GEMM (prefill): n = 2048, 768 rows, nc = 4 / 8 / 16 columns; counter GFLOP/s = 2*n*rows*nc.
//   Baseline:       the same kernel called once per (row, column) pair, i.e. a plain vec_dot loop the
//                   way a non-repacking backend runs a matmul (BM_Pairwise), and the scalar reference.
//   Threads(2):     the rows split between two threads (aggregate throughput of this 2-core box).
// Run e.g.:  fitmoe_microbench --benchmark_filter='Gemv|Gemm' --benchmark_min_time=0.3
// (on a shared machine add --benchmark_repetitions=5 and read the max: the mean suffers from neighbours)
#include <benchmark/benchmark.h>

#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "quant/dtype.h"
#include "quant/kernels.h"

namespace fitmoe::quant {
namespace {

constexpr int64_t kN = 2048;

struct Mats {
  DType w;
  int64_t n;
  int nr;
  int copies;
  std::vector<uint8_t> weights;  // copies x nr rows
  std::vector<uint8_t> acts;     // 16 columns
  size_t wrow, arow;
};

Mats make(DType w, int64_t n, int nr, int copies) {
  Mats m{w, n, nr, copies, {}, {}, row_bytes(w, n), row_bytes(dtype_info(w).act_type, n)};
  m.weights.resize(m.wrow * nr * copies);
  fill_random_rows(w, m.weights.data(), static_cast<int64_t>(nr) * copies, n, 0.02f, 1);
  std::mt19937 rng(3);
  std::normal_distribution<float> nd;
  std::vector<float> x(n);
  m.acts.resize(m.arow * 16);
  for (int c = 0; c < 16; ++c) {
    for (auto& v : x) v = nd(rng);
    quantize_act_row_ref(dtype_info(w).act_type, x.data(), m.acts.data() + c * m.arow, n);
  }
  return m;
}

// Matrices are built once per (type, shape) and shared by the benchmark threads.
const Mats& get_mats(DType w, int nr, int copies) {
  static std::mutex mu;
  static std::map<std::tuple<int, int, int>, std::unique_ptr<Mats>> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto& slot = cache[{static_cast<int>(w), nr, copies}];
  if (!slot) slot = std::make_unique<Mats>(make(w, kN, nr, copies));
  return *slot;
}

// Splits `nr` rows between the benchmark's threads (multiples of 16 rows).
void thread_rows(const benchmark::State& st, int nr, int* r0, int* r1) {
  const int t = st.threads(), i = st.thread_index();
  const int per = (nr / t + 15) / 16 * 16;
  *r0 = i * per < nr ? i * per : nr;
  *r1 = (i + 1) * per < nr ? (i + 1) * per : nr;
}

void BM_Gemv(benchmark::State& st, DType w, int copies) {
  const Mats* m = &get_mats(w, 768 * 8, copies);
  const MatmulTileFn f = kernels_for(w, Isa(st.range(0))).matmul_tile;
  int r0, r1;
  thread_rows(st, m->nr, &r0, &r1);
  std::vector<float> out(m->nr);
  int k = 0;
  for (auto _ : st) {
    const uint8_t* base = m->weights.data() + static_cast<size_t>(k) * m->nr * m->wrow;
    f(kN, base + r0 * m->wrow, m->wrow, r1 - r0, m->acts.data(), m->arow, 1, out.data() + r0, m->nr);
    benchmark::DoNotOptimize(out.data());
    k = (k + 1) % m->copies;
  }
  st.SetBytesProcessed(static_cast<int64_t>(st.iterations()) * (r1 - r0) * m->wrow);
  st.SetLabel(isa_name(Isa(st.range(0))));
}

void BM_Gemm(benchmark::State& st, DType w) {
  const Mats* m = &get_mats(w, 768, 1);
  const int nc = static_cast<int>(st.range(1));
  const MatmulTileFn f = kernels_for(w, Isa(st.range(0))).matmul_tile;
  int r0, r1;
  thread_rows(st, m->nr, &r0, &r1);
  std::vector<float> out(static_cast<size_t>(m->nr) * nc);
  for (auto _ : st) {
    f(kN, m->weights.data() + r0 * m->wrow, m->wrow, r1 - r0, m->acts.data(), m->arow, nc, out.data() + r0, m->nr);
    benchmark::DoNotOptimize(out.data());
  }
  st.counters["GFLOP/s"] = benchmark::Counter(2.0 * kN * (r1 - r0) * nc * static_cast<double>(st.iterations()) * 1e-9,
                                              benchmark::Counter::kIsRate);
  st.SetLabel(isa_name(Isa(st.range(0))));
}

// Baseline: one kernel call per (row, column), i.e. a vec_dot per output (no tiling, no sharing).
void BM_Pairwise(benchmark::State& st, DType w) {
  const Mats* m = &get_mats(w, 768, 1);
  const int nc = static_cast<int>(st.range(1));
  const MatmulTileFn f = kernels_for(w, Isa(st.range(0))).matmul_tile;
  std::vector<float> out(static_cast<size_t>(m->nr) * nc);
  for (auto _ : st) {
    for (int c = 0; c < nc; ++c)
      for (int r = 0; r < m->nr; ++r)
        f(kN, m->weights.data() + r * m->wrow, m->wrow, 1, m->acts.data() + c * m->arow, m->arow, 1,
          out.data() + c * m->nr + r, m->nr);
    benchmark::DoNotOptimize(out.data());
  }
  st.counters["GFLOP/s"] = benchmark::Counter(2.0 * kN * m->nr * nc * static_cast<double>(st.iterations()) * 1e-9,
                                              benchmark::Counter::kIsRate);
  st.SetBytesProcessed(static_cast<int64_t>(st.iterations()) * m->nr * m->wrow * nc);
  st.SetLabel(isa_name(Isa(st.range(0))));
}

void BM_QuantizeAct(benchmark::State& st, DType act) {
  std::vector<float> x(kN * 8);
  std::mt19937 rng(5);
  std::normal_distribution<float> nd;
  for (auto& v : x) v = nd(rng);
  std::vector<uint8_t> y(row_bytes(act, static_cast<int64_t>(x.size())));
  const QuantizeActFn f = quantize_act_fn(act, Isa(st.range(0)));
  for (auto _ : st) {
    f(x.data(), y.data(), static_cast<int64_t>(x.size()));
    benchmark::DoNotOptimize(y.data());
  }
  st.SetBytesProcessed(static_cast<int64_t>(st.iterations()) * x.size() * 4);
  st.SetLabel(isa_name(Isa(st.range(0))));
}

void BM_FillRandom(benchmark::State& st, DType w) {
  const int64_t rows = 512;
  std::vector<uint8_t> buf(row_bytes(w, kN) * rows);
  uint64_t seed = 0;
  for (auto _ : st) {
    fill_random_rows(w, buf.data(), rows, kN, 0.02f, seed++);
    benchmark::DoNotOptimize(buf.data());
  }
  st.SetBytesProcessed(static_cast<int64_t>(st.iterations()) * buf.size());
}

const DType kAll[] = {DType::Q4_K, DType::Q6_K, DType::Q5_K, DType::Q8_0, DType::Q5_0, DType::Q4_0, DType::F32,
                      DType::F16,  DType::BF16, DType::Q4_1, DType::Q5_1, DType::Q2_K, DType::Q3_K, DType::IQ4_NL,
                      DType::IQ4_XS};

int register_all() {
  const int isas[] = {static_cast<int>(Isa::AVX2), static_cast<int>(Isa::AVX512)};
  for (DType w : kAll) {
    const std::string t = dtype_name(w);
    for (int isa : isas) {
      if (isa > static_cast<int>(cpu_isa())) continue;
      benchmark::RegisterBenchmark(("Gemv/hot/" + t).c_str(), BM_Gemv, w, 1)->Arg(isa)->Threads(1)->Threads(2)->UseRealTime();
      benchmark::RegisterBenchmark(("Gemv/cold/" + t).c_str(), BM_Gemv, w, 8)->Arg(isa)->Threads(1)->Threads(2)->UseRealTime();
      for (int nc : {4, 8, 16})
        benchmark::RegisterBenchmark(("Gemm/" + t).c_str(), BM_Gemm, w)->Args({isa, nc})->Threads(1)->Threads(2)->UseRealTime();
      for (int nc : {1, 8})
        benchmark::RegisterBenchmark(("Baseline/pairwise/" + t).c_str(), BM_Pairwise, w)->Args({isa, nc});
    }
    benchmark::RegisterBenchmark(("Baseline/scalar/" + t).c_str(), BM_Pairwise, w)->Args({static_cast<int>(Isa::Scalar), 1});
    benchmark::RegisterBenchmark(("FillRandom/" + t).c_str(), BM_FillRandom, w);
  }
  for (DType a : {DType::Q8_0, DType::Q8_1, DType::Q8_K, DType::F16, DType::BF16})
    for (int isa : {0, 1, 2})
      if (isa <= static_cast<int>(cpu_isa()))
        benchmark::RegisterBenchmark((std::string("QuantizeAct/") + dtype_name(a)).c_str(), BM_QuantizeAct, a)->Arg(isa);
  return 0;
}
const int kRegistered = register_all();

}  // namespace
}  // namespace fitmoe::quant
