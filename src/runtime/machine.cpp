#include "runtime/machine.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <nlohmann/json.hpp>

#include "quant/kernels.h"
#include "runtime/thread_pool.h"

#if FITMOE_CUDA
#include "cuda/device.h"
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
  // The version part retires profiles written by builds whose measurement or calibration differed.
  const std::string key = "v2|" + cpu_model() + "|" + std::to_string(m.cpu_threads) + "|" + gpu_key;
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
      m.source = "cached in " + path;
    }
  }
  if (m.host_mem_bw <= 0) {
    m.host_mem_bw = measure_host_bw(pool);
    // Our int8 kernels run at about 100 GFLOP/s per core (AVX2 or AVX-512, docs/performance.md).
    m.cpu_int8_flops = m.cpu_threads * (quant::best_isa() == quant::Isa::Scalar ? 5e9 : 90e9);
#if FITMOE_CUDA
    if (have_gpu) gpu::measure_device(&m);
#endif
    m.source = "measured";
    if (use_cache) {
      cache[key] = {{"host_mem_bw", m.host_mem_bw}, {"gpu_mem_bw", m.gpu_mem_bw}, {"gpu_flops", m.gpu_flops},
                    {"pcie_bw", m.pcie_bw}, {"cpu_int8_flops", m.cpu_int8_flops}};
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
    m.gpu_free_bytes = di.free_bytes;  // free memory is always read fresh
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
