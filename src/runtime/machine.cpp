#include "runtime/machine.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cmath>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <nlohmann/json.hpp>

#include "quant/kernels.h"
#include "runtime/cpu_ops.h"
#include "runtime/plan.h"
#include "runtime/thread_pool.h"

#if FITMOE_CUDA
#include "cuda/device.h"
#include "cuda/process_memory.h"
#endif

namespace fitmoe {

namespace {

std::string cpu_model() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  return "unknown cpu";
}

// Streams a 512 MiB buffer with every thread, best of 3 passes.
double measure_host_bw(ThreadPool& pool) {
  const size_t n = 512u << 20;
  void* p = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return 0;
  madvise(p, n, MADV_HUGEPAGE);
  auto* buf = static_cast<uint64_t*>(p);
  const size_t words = n / 8;
  pool.parallel_ranges(static_cast<int64_t>(words), [&](int64_t b, int64_t e, int) {
    for (int64_t i = b; i < e; ++i) buf[i] = static_cast<uint64_t>(i);
  });
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {
    std::vector<uint64_t> sums(pool.size() * 8, 0);
    auto t0 = std::chrono::steady_clock::now();
    pool.parallel_ranges(static_cast<int64_t>(words), [&](int64_t b, int64_t e, int tid) {
      uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
      for (int64_t i = b; i + 4 <= e; i += 4) {
        s0 += buf[i];
        s1 ^= buf[i + 1];
        s2 += buf[i + 2];
        s3 ^= buf[i + 3];
      }
      sums[tid * 8] = s0 + s1 + s2 + s3;
    });
    double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, n / dt);
  }
  munmap(p, n);
  return best;
}

// The CPU's own kernels (src/quant) on this machine, with every thread of the pool: a one-token product
// over a Q4_K matrix far larger than any cache (decode: bytes/s, RAM and kernel together), and products
// of 1, 8 and 64 tokens over a cache-sized one (prefill, whose MoE gives each expert a few tokens of the
// batch: int8 FLOP/s at each width). Q4_K because it is most of a Q4_K_M file's bytes.
void measure_cpu_kernels(ThreadPool& pool, MachineProfile& m) {
  const int64_t cols = 2048;
  const size_t rb = row_bytes(DType::Q4_K, cols);
  const auto& kern = quant::kernels_for(DType::Q4_K);
  const DType act = kern.act_type;
  const size_t act_stride = row_bytes(act, cols);
  std::vector<float> x(64 * cols);
  for (size_t i = 0; i < x.size(); ++i) x[i] = std::sin(0.37f * static_cast<float>(i));
  std::vector<uint8_t> acts(64 * act_stride);
  auto quantize = quant::quantize_act_fn(act);
  for (int t = 0; t < 64; ++t) quantize(x.data() + t * cols, acts.data() + t * act_stride, cols);
  // (Prefill: rows per work item as the forward's tiling gives one thread at a time, cpu_ops.cpp: 64.)
  auto run = [&](const uint8_t* w, int64_t rows, int nc, float* out) {
    pool.parallel_for((rows + 63) / 64, 1, [&](int64_t b, int64_t e, int) {
      for (int64_t blk = b; blk < e; ++blk) {
        const int64_t r0 = blk * 64;
        const int nr = static_cast<int>(std::min<int64_t>(64, rows - r0));
        kern.matmul_tile(cols, w + r0 * rb, rb, nr, acts.data(), act_stride, nc, out + r0, static_cast<size_t>(rows));
      }
    });
  };
  {
    // Decode as the MoE runs it: 512 MiB of expert-sized matrices (768 rows of 2048: one expert's
    // gate, up or down of a 30B-A3B model), far larger than any cache (the 16-core Xeon hosts hold a
    // 64 MiB matrix in L3 and read it at 150 GB/s); per step 24 of them (8 experts x 3), each thread
    // the same slice of each (cpu::expert_slice), one parallel step per layer, steps walking the buffer.
    const int64_t rows = 768, mats = (512 << 20) / (rows * static_cast<int64_t>(rb));
    const size_t mat_bytes = static_cast<size_t>(rows) * rb, n = static_cast<size_t>(mats) * mat_bytes;
    void* p = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return;
    madvise(p, n, MADV_HUGEPAGE);  // as the weights' copy (model.cpp)
    auto* base = static_cast<uint8_t*>(p);
    pool.parallel_for(mats, 1, [&](int64_t b, int64_t e, int) {
      for (int64_t i = b; i < e; ++i) quant::fill_random_rows(DType::Q4_K, base + i * mat_bytes, rows, cols, 0.02f, 1 + i);
    });
    std::vector<float> out(static_cast<size_t>(rows) * 24);
    const int64_t steps = mats / 24;
    double best = 1e30;
    for (int rep = 0; rep < 3; ++rep) {
      auto t0 = std::chrono::steady_clock::now();
      for (int64_t st = 0; st < steps; ++st) {
        pool.run([&](int tid, int nth) {
          const auto [r0, r1] = cpu::expert_slice(rows, tid, nth);
          if (r1 <= r0) return;
          for (int j = 0; j < 24; ++j)
            kern.matmul_tile(cols, base + (st * 24 + j) * mat_bytes + r0 * rb, rb, static_cast<int>(r1 - r0), acts.data(),
                             act_stride, 1, out.data() + j * rows + r0, static_cast<size_t>(rows));
        });
      }
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    munmap(p, n);
    m.cpu_decode_bw = static_cast<double>(steps * 24) * mat_bytes / best;
  }
  {
    // Eight 64-row work items per thread (at least 512 rows, about one expert's matrix of a 30B-A3B
    // model): the MoE's prefill hands the pool every used expert's tiles of a layer at once, so each
    // thread is busy. (A single 512-row matrix left half of a 16-thread pool idle: the plan predicted
    // 81 tok/s where bench measured 144, H200 host, 2026-12-02.)
    const int64_t rows = std::max<int64_t>(512, 64 * 8 * static_cast<int64_t>(pool.size()));
    std::vector<uint8_t> w(static_cast<size_t>(rows) * rb);
    quant::fill_random_rows(DType::Q4_K, w.data(), rows, cols, 0.02f, 2);
    std::vector<float> out(static_cast<size_t>(64) * rows);
    const int widths[3] = {1, 8, 64};
    for (int i = 0; i < 3; ++i) {
      const int nc = widths[i];
      const int reps = std::max(4, 512 / nc);
      double best = 1e30;
      for (int pass = 0; pass < 3; ++pass) {
        auto t0 = std::chrono::steady_clock::now();
        for (int r = 0; r < reps; ++r) run(w.data(), rows, nc, out.data());
        best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / reps);
      }
      m.cpu_matmul_flops[i] = 2.0 * static_cast<double>(rows) * cols * nc / best;
    }
    m.cpu_int8_flops = m.cpu_matmul_flops[2];
  }
}

std::string cache_path() {
  const char* home = std::getenv("XDG_CACHE_HOME");
  std::string base = home && *home ? home : (std::getenv("HOME") ? std::string(std::getenv("HOME")) + "/.cache" : "/tmp");
  return base + "/fitmoe/machine.json";
}

}  // namespace

MachineProfile reference_consumer_machine(uint64_t vram) {
  MachineProfile m;
  m.gpu_name = "hypothetical GTX 1080-class GPU";
  m.gpu_free_bytes = vram;
  m.gpu_mem_bw = 320e9;
  m.gpu_flops = 9e12;
  m.pcie_bw = 12e9;
  m.host_mem_bw = 30e9;
  m.cpu_int8_flops = 4 * 60e9;
  m.cpu_threads = 4;
  m.source = "assumed consumer machine (no GPU here)";
  return m;
}

MachineProfile probe_machine(int n_threads, bool use_gpu, bool use_cache) {
  ThreadPool pool(n_threads);
  MachineProfile m;
  m.cpu_threads = pool.size();
  std::string gpu_key = "none";
#if FITMOE_CUDA
  gpu::DeviceInfo di;
  const bool have_gpu = use_gpu && gpu::query_device(&di);
  if (have_gpu) gpu_key = di.name + "/" + std::to_string(di.total_bytes);
#else
  (void)use_gpu;
#endif
  // A profile holds for one machine as this build measures it: the version part retires profiles of
  // builds whose measurement differed, and the CPU, its threads and instruction set, the RAM's size and
  // the GPU tell machines (and a container moved to another host) apart; anything else is re-measured.
  const std::string key = "v5|" + cpu_model() + "|" + std::to_string(m.cpu_threads) + " threads|" +
                          quant::isa_name(quant::best_isa()) + "|" + std::to_string(host_memory_total() >> 30) +
                          " GiB|" + gpu_key;
  const std::string path = cache_path();
  nlohmann::json cache = nlohmann::json::object();
  if (use_cache) {
    std::ifstream f(path);
    if (f) {
      try {
        cache = nlohmann::json::parse(f);
      } catch (...) {
        cache = nlohmann::json::object();
      }
    }
    if (cache.contains(key)) {
      const auto& c = cache[key];
      m.host_mem_bw = c.value("host_mem_bw", 0.0);
      m.gpu_mem_bw = c.value("gpu_mem_bw", 0.0);
      m.gpu_flops = c.value("gpu_flops", 0.0);
      m.pcie_bw = c.value("pcie_bw", 0.0);
      m.cpu_int8_flops = c.value("cpu_int8_flops", 0.0);
      m.cpu_decode_bw = c.value("cpu_decode_bw", 0.0);
      const auto flops = c.value("cpu_matmul_flops", std::vector<double>{});
      for (size_t i = 0; i < 3 && i < flops.size(); ++i) m.cpu_matmul_flops[i] = flops[i];
      m.source = "measured " + c.value("measured_at", std::string("earlier")) + ", cached in " + path;
    }
  }
  if (m.host_mem_bw <= 0) {
    m.host_mem_bw = measure_host_bw(pool);
    measure_cpu_kernels(pool, m);
    // The plain streaming loop falls short of what RAM gives on few threads (one thread here read
    // 9.3 GB/s where the Q4_K kernel streamed 12): RAM delivers at least what a kernel read from it
    // (out of 512 MiB, so not from a cache).
    m.host_mem_bw = std::max(m.host_mem_bw, m.cpu_decode_bw);
#if FITMOE_CUDA
    if (have_gpu) gpu::measure_device(&m);
#endif
    m.source = "measured now";
    if (use_cache) {
      char when[32];
      const std::time_t now = std::time(nullptr);
      std::strftime(when, sizeof when, "%Y-%m-%d %H:%M UTC", std::gmtime(&now));
      cache[key] = {{"host_mem_bw", m.host_mem_bw}, {"gpu_mem_bw", m.gpu_mem_bw}, {"gpu_flops", m.gpu_flops},
                    {"pcie_bw", m.pcie_bw}, {"cpu_int8_flops", m.cpu_int8_flops}, {"cpu_decode_bw", m.cpu_decode_bw},
                    {"cpu_matmul_flops", std::vector<double>(m.cpu_matmul_flops, m.cpu_matmul_flops + 3)},
                    {"measured_at", when}};
      std::error_code ec;
      std::filesystem::create_directories(std::filesystem::path(path).parent_path(), ec);
      std::ofstream f(path + ".partial");
      if (f << cache.dump(2)) {
        f.close();
        std::rename((path + ".partial").c_str(), path.c_str());
      }
    }
  }
#if FITMOE_CUDA
  if (have_gpu) {
    m.gpu_name = di.name;
    m.gpu_runtime_bytes = gpu::measure_runtime_bytes();
    gpu::DeviceInfo now;
    m.gpu_free_bytes = gpu::query_device(&now) ? now.free_bytes : di.free_bytes;  // read fresh, runtime up
  } else {
    m.gpu_name = "none";
  }
#else
  m.gpu_name = "none";
#endif
  return m;
}


int64_t huge_page_bytes(const void* p, uint64_t n) {
  std::ifstream in("/proc/self/smaps");
  if (!in) return -1;
  const uint64_t lo = reinterpret_cast<uintptr_t>(p), hi = lo + n;
  uint64_t overlap = 0, total = 0;
  bool seen = false;
  for (std::string line; std::getline(in, line);) {
    unsigned long long a = 0, b = 0;
    if (std::sscanf(line.c_str(), "%llx-%llx ", &a, &b) == 2 && line.find(' ') != std::string::npos &&
        line.find(':') > line.find(' ')) {  // a mapping's header ("start-end perms ...")
      overlap = std::min<uint64_t>(b, hi) > std::max<uint64_t>(a, lo) ? std::min<uint64_t>(b, hi) - std::max<uint64_t>(a, lo) : 0;
      continue;
    }
    unsigned long long kb = 0;
    if (overlap && std::sscanf(line.c_str(), "AnonHugePages: %llu kB", &kb) == 1) {
      total += std::min<uint64_t>(kb * 1024, overlap);
      seen = true;
    }
  }
  return seen ? static_cast<int64_t>(total) : -1;
}

std::string huge_page_policy() {
  auto chosen = [](const char* path) {
    std::ifstream in(path);
    std::string all((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const size_t a = all.find('['), b = all.find(']');
    return a != std::string::npos && b > a ? all.substr(a + 1, b - a - 1) : std::string("?");
  };
  return "enabled=" + chosen("/sys/kernel/mm/transparent_hugepage/enabled") +
         " defrag=" + chosen("/sys/kernel/mm/transparent_hugepage/defrag");
}

}  // namespace fitmoe
