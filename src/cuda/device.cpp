#include "cuda/device.h"

#include <cuda_runtime.h>
#include <sys/mman.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "cuda/kernel_util.h"
#include "runtime/error.h"

namespace fitmoe::gpu {

void check(int code, const char* what) {
  if (code != cudaSuccess)
    throw Error(std::string("CUDA error in ") + what + ": " + cudaGetErrorString(static_cast<cudaError_t>(code)));
}

namespace {
int current_device(const char* what) {
  int dev = 0;
  check(cudaGetDevice(&dev), what);
  return dev;
}
std::mutex g_kernel_mu;
std::map<std::pair<const void*, int>, int> g_ptx;       // PTX version the kernel was compiled for
std::map<std::pair<const void*, int>, size_t> g_smem;   // dynamic shared memory opted into
std::map<int, size_t> g_smem_sm;                        // shared memory per multiprocessor
std::map<int, size_t> g_smem_block;                     // shared memory per CTA, opted in
std::map<std::tuple<const void*, int, int, size_t>, int> g_resident;  // CTAs resident on the whole GPU
}  // namespace

int resident_ctas(const void* kernel, int threads, size_t smem, const char* what) {
  const int dev = current_device(what);
  std::lock_guard<std::mutex> lock(g_kernel_mu);
  auto key = std::make_tuple(kernel, dev, threads, smem);
  auto it = g_resident.find(key);
  if (it != g_resident.end()) return it->second;
  int per_sm = 0, sms = 0;
  check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem), what);
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), what);
  return g_resident[key] = per_sm * sms;
}

int kernel_ptx_version(const void* kernel, const char* what) {
  const int dev = current_device(what);
  std::lock_guard<std::mutex> lock(g_kernel_mu);
  auto it = g_ptx.find({kernel, dev});
  if (it != g_ptx.end()) return it->second;
  cudaFuncAttributes attr{};
  check(cudaFuncGetAttributes(&attr, kernel), what);
  return g_ptx[{kernel, dev}] = attr.ptxVersion;
}

size_t smem_per_sm(const char* what) {
  const int dev = current_device(what);
  std::lock_guard<std::mutex> lock(g_kernel_mu);
  auto it = g_smem_sm.find(dev);
  if (it != g_smem_sm.end()) return it->second;
  int v = 0;
  check(cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev), what);
  return g_smem_sm[dev] = static_cast<size_t>(v);
}

size_t smem_per_block(const char* what) {
  const int dev = current_device(what);
  std::lock_guard<std::mutex> lock(g_kernel_mu);
  auto it = g_smem_block.find(dev);
  if (it != g_smem_block.end()) return it->second;
  int v = 0;
  check(cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev), what);
  return g_smem_block[dev] = static_cast<size_t>(v);
}

void need_dynamic_smem(const void* kernel, size_t bytes, const char* what) {
  if (bytes <= 48 * 1024) return;
  const size_t optin = smem_per_block(what);
  const int dev = current_device(what);
  std::lock_guard<std::mutex> lock(g_kernel_mu);
  size_t& done = g_smem[{kernel, dev}];
  if (done >= bytes) return;
  if (bytes > optin)
    throw Error(std::string(what) + ": needs " + std::to_string(bytes) + " bytes of shared memory per block, the device allows " +
                std::to_string(optin));
  check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)), what);
  done = bytes;
}

bool query_device(DeviceInfo* out) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    cudaGetLastError();
    return false;
  }
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) return false;
  size_t free_b = 0, total_b = 0;
  if (cudaSetDevice(0) != cudaSuccess || cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) return false;
  out->name = prop.name;
  out->free_bytes = free_b;
  out->total_bytes = total_b;
  out->cc_major = prop.major;
  out->cc_minor = prop.minor;
  out->sm_count = prop.multiProcessorCount;
  return true;
}

void measure_device(MachineProfile* m) {
  const size_t n = 256u << 20;
  void *a = nullptr, *b = nullptr, *h = nullptr;
  check(cudaMalloc(&a, n), "cudaMalloc (probe)");
  check(cudaMalloc(&b, n), "cudaMalloc (probe)");
  check(cudaMallocHost(&h, n), "cudaMallocHost (probe)");
  std::memset(h, 1, n);
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  auto time_it = [&](auto&& fn) {
    fn();  // warm-up
    float best = 1e30f;
    for (int rep = 0; rep < 3; ++rep) {
      cudaEventRecord(e0);
      fn();
      cudaEventRecord(e1);
      cudaEventSynchronize(e1);
      float ms = 0;
      cudaEventElapsedTime(&ms, e0, e1);
      best = std::min(best, ms);
    }
    return best / 1e3;
  };
  // Device copy moves 2n bytes (read + write).
  m->gpu_mem_bw = 2.0 * n / time_it([&] { cudaMemcpy(b, a, n, cudaMemcpyDeviceToDevice); });
  m->pcie_bw = n / time_it([&] { cudaMemcpy(a, h, n, cudaMemcpyHostToDevice); });
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  // f16 tensor-core rate estimate: SMs x clock x (1024 FLOP/clk/SM on Volta..Ada, 2048 on Hopper),
  // x 0.6 achievable. Pascal has no tensor cores: 2 x FP32 rate.
  double clock_hz = 1.5e9;
  int clock_khz = 0;
  if (cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0) == cudaSuccess && clock_khz > 0) clock_hz = clock_khz * 1e3;
  // Dense f16 rate per SM and clock (tensor cores from sm_70; CUDA-core FMAs before), times the share
  // fitmoe's prefill reaches: 10% of the tensor-core peak (measured on the H200: about 50 TFLOP/s of
  // 535 for pp512, wmma products with dequantization), 40% of the CUDA-core peak.
  const double per_sm = prop.major >= 9 ? 2048 : prop.major >= 7 ? 1024 : 256;
  m->gpu_flops = prop.multiProcessorCount * clock_hz * per_sm * (prop.major >= 7 ? 0.10 : 0.40);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaFree(a);
  cudaFree(b);
  cudaFreeHost(h);
  cudaGetLastError();
}

DeviceMemory::DeviceMemory(uint64_t budget) : budget_(budget) {}

DeviceMemory::~DeviceMemory() {
  for (auto& [p, info] : live_) cudaFree(p);
}

void* DeviceMemory::alloc(size_t bytes, const std::string& what) {
  std::lock_guard<std::mutex> lock(mu_);
  if (bytes == 0) bytes = 1;
  if (used_ + bytes > budget_) {
    std::ostringstream s;
    s << "VRAM budget exceeded: " << what << " needs " << (bytes >> 20) << " MiB but " << (used_ >> 20) << " of "
      << (budget_ >> 20) << " MiB are in use (" << usage_report() << ")";
    throw Error(s.str());
  }
  void* p = nullptr;
  cudaError_t e = cudaMalloc(&p, bytes);
  if (e != cudaSuccess) {
    cudaGetLastError();
    throw Error("cudaMalloc of " + std::to_string(bytes >> 20) + " MiB for " + what + " failed: " + cudaGetErrorString(e));
  }
  used_ += bytes;
  peak_ = std::max(peak_, used_);
  live_[p] = {bytes, what};
  by_what_[what] += bytes;
  return p;
}

void DeviceMemory::free(void* p) {
  if (!p) return;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = live_.find(p);
  if (it == live_.end()) return;
  used_ -= it->second.first;
  by_what_[it->second.second] -= it->second.first;
  live_.erase(it);
  cudaFree(p);
}

std::string DeviceMemory::usage_report() const {
  std::ostringstream s;
  bool first = true;
  for (auto& [what, b] : by_what_) {
    if (!b) continue;
    s << (first ? "" : ", ") << what << " " << (b >> 20) << " MiB";
    first = false;
  }
  return s.str();
}

void* create_stream() {
  cudaStream_t s;
  check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
  return s;
}
void destroy_stream(void* s) { cudaStreamDestroy(static_cast<cudaStream_t>(s)); }
void* create_event() {
  cudaEvent_t e;
  check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
  return e;
}
void* create_timing_event() {
  cudaEvent_t e;
  check(cudaEventCreate(&e), "cudaEventCreate");
  return e;
}
float elapsed_ms(void* from, void* to) {
  float ms = 0.0f;
  check(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(from), static_cast<cudaEvent_t>(to)), "cudaEventElapsedTime");
  return ms;
}
void destroy_event(void* e) { cudaEventDestroy(static_cast<cudaEvent_t>(e)); }
// External: inside a stream capture the record becomes a graph node that the host can wait for
// (a plain record would only order work within the graph).
void record_event(void* e, void* s) {
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  check(cudaStreamIsCapturing(static_cast<cudaStream_t>(s), &st), "cudaStreamIsCapturing");
  if (st == cudaStreamCaptureStatusActive)
    check(cudaEventRecordWithFlags(static_cast<cudaEvent_t>(e), static_cast<cudaStream_t>(s), cudaEventRecordExternal),
          "cudaEventRecord");
  else
    check(cudaEventRecord(static_cast<cudaEvent_t>(e), static_cast<cudaStream_t>(s)), "cudaEventRecord");
}
void wait_event(void* s, void* e) {
  check(cudaStreamWaitEvent(static_cast<cudaStream_t>(s), static_cast<cudaEvent_t>(e), 0), "cudaStreamWaitEvent");
}
bool check_stream(void* s) {
  const cudaError_t e = cudaStreamQuery(static_cast<cudaStream_t>(s));
  if (e == cudaErrorNotReady) return false;
  check(e, "the GPU stream");
  return true;
}
void sync_event(void* e) { check(cudaEventSynchronize(static_cast<cudaEvent_t>(e)), "cudaEventSynchronize"); }
void sync_stream(void* s) { check(cudaStreamSynchronize(static_cast<cudaStream_t>(s)), "cudaStreamSynchronize"); }
void copy_h2d(void* d, const void* h, size_t n, void* s) {
  check(cudaMemcpyAsync(d, h, n, cudaMemcpyHostToDevice, static_cast<cudaStream_t>(s)), "cudaMemcpyAsync H2D");
}
void copy_d2h(void* h, const void* d, size_t n, void* s) {
  check(cudaMemcpyAsync(h, d, n, cudaMemcpyDeviceToHost, static_cast<cudaStream_t>(s)), "cudaMemcpyAsync D2H");
}
void copy_d2d(void* d, const void* src, size_t n, void* s) {
  check(cudaMemcpyAsync(d, src, n, cudaMemcpyDeviceToDevice, static_cast<cudaStream_t>(s)), "cudaMemcpyAsync D2D");
}
void memset_async(void* d, int v, size_t n, void* s) {
  check(cudaMemsetAsync(d, v, n, static_cast<cudaStream_t>(s)), "cudaMemsetAsync");
}
void pin_host(const void* p, size_t n) {
  cudaError_t e = cudaHostRegister(const_cast<void*>(p), n, cudaHostRegisterDefault);
  if (e != cudaSuccess) {
    cudaGetLastError();
    throw Error(std::string("cannot pin ") + std::to_string(n >> 20) + " MiB of host memory for fast uploads: " +
                cudaGetErrorString(e) + " (raise the locked-memory limit, or use --no-pin)");
  }
}
void unpin_host(const void* p) {
  cudaHostUnregister(const_cast<void*>(p));
  cudaGetLastError();
}
void* alloc_pinned(size_t n) {
  void* p = nullptr;
  check(cudaMallocHost(&p, n), "cudaMallocHost");
  return p;
}
void free_pinned(void* p) { cudaFreeHost(p); }

namespace {
std::mutex g_huge_mu;
std::map<void*, size_t> g_huge;  // alloc_pinned_huge's mappings and their sizes
}  // namespace
void* alloc_pinned_huge(size_t n) {
  constexpr size_t kHuge = 2u << 20;
  const size_t bytes = (n + kHuge - 1) / kHuge * kHuge;
  void* raw = mmap(nullptr, bytes + kHuge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) return alloc_pinned(n);
  // 2 MiB aligned, the slack given back, huge pages asked for before the first touch (the pinning
  // below faults every page in).
  const uintptr_t a = (reinterpret_cast<uintptr_t>(raw) + kHuge - 1) & ~(kHuge - 1);
  const size_t head = a - reinterpret_cast<uintptr_t>(raw);
  if (head) munmap(raw, head);
  if (kHuge - head) munmap(reinterpret_cast<uint8_t*>(a) + bytes, kHuge - head);
  void* p = reinterpret_cast<void*>(a);
  madvise(p, bytes, MADV_HUGEPAGE);
  if (cudaHostRegister(p, bytes, cudaHostRegisterPortable | cudaHostRegisterMapped) != cudaSuccess) {
    cudaGetLastError();
    munmap(p, bytes);
    return alloc_pinned(n);
  }
  std::lock_guard<std::mutex> lock(g_huge_mu);
  g_huge[p] = bytes;
  return p;
}
void free_pinned_huge(void* p) {
  size_t bytes = 0;
  {
    std::lock_guard<std::mutex> lock(g_huge_mu);
    auto it = g_huge.find(p);
    if (it == g_huge.end()) return free_pinned(p);  // (alloc_pinned_huge fell back to cudaMallocHost)
    bytes = it->second;
    g_huge.erase(it);
  }
  cudaHostUnregister(p);
  cudaGetLastError();
  munmap(p, bytes);
}
void* device_view(void* pinned) {
  void* d = nullptr;
  check(cudaHostGetDevicePointer(&d, pinned, 0), "cudaHostGetDevicePointer");
  return d;
}

// A measuring aid: FITMOE_SKIP_KERNELS=name1,name2 disables, in every captured graph, the kernel nodes
// whose (mangled) function name contains one of the names. Outputs are then wrong; the point is the
// time a step takes without them, which is each kernel's cost on the critical path of a decode step
// (kernels overlap under programmatic dependent launch, so their own durations do not add up).
// FITMOE_SKIP_KERNELS=list prints the kernel names of each graph instead.
namespace {
void skip_kernels_for_timing(cudaGraph_t g, cudaGraphExec_t ex) {
  static const char* env = std::getenv("FITMOE_SKIP_KERNELS");
  if (!env || !*env) return;
#if CUDART_VERSION >= 12030
  std::vector<std::string> names;
  std::stringstream list(env);
  for (std::string name; std::getline(list, name, ',');)
    if (!name.empty()) names.push_back(name);
  size_t n = 0;
  check(cudaGraphGetNodes(g, nullptr, &n), "cudaGraphGetNodes");
  std::vector<cudaGraphNode_t> nodes(n);
  std::map<std::string, int> counts;  // FITMOE_SKIP_KERNELS=list: the kernels of each graph, by name
  check(cudaGraphGetNodes(g, nodes.data(), &n), "cudaGraphGetNodes");
  for (cudaGraphNode_t node : nodes) {
    cudaGraphNodeType type;
    cudaKernelNodeParams params;
    const char* fname = nullptr;
    if (cudaGraphNodeGetType(node, &type) != cudaSuccess || type != cudaGraphNodeTypeKernel) continue;
    if (cudaGraphKernelNodeGetParams(node, &params) != cudaSuccess) continue;
    if (cudaFuncGetName(&fname, params.func) != cudaSuccess || !fname) continue;
    if (names.size() == 1 && names[0] == "list") {
      ++counts[fname];
      continue;
    }
    for (const std::string& name : names)
      if (std::strstr(fname, name.c_str())) check(cudaGraphNodeSetEnabled(ex, node, 0), "cudaGraphNodeSetEnabled");
  }
  for (const auto& [name, count] : counts) std::fprintf(stderr, "graph kernel %d %s\n", count, name.c_str());
#else
  (void)g, (void)ex;
#endif
}
}  // namespace

void begin_capture(void* s) {
  check(cudaStreamBeginCapture(static_cast<cudaStream_t>(s), cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
}
void* end_capture(void* s) {
  cudaGraph_t g;
  check(cudaStreamEndCapture(static_cast<cudaStream_t>(s), &g), "cudaStreamEndCapture");
  cudaGraphExec_t ex;
  check(cudaGraphInstantiate(&ex, g, 0), "cudaGraphInstantiate");
  skip_kernels_for_timing(g, ex);
  cudaGraphDestroy(g);
  return ex;
}
void launch_graph(void* ex, void* s) {
  check(cudaGraphLaunch(static_cast<cudaGraphExec_t>(ex), static_cast<cudaStream_t>(s)), "cudaGraphLaunch");
}
void destroy_graph(void* ex) { cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(ex)); }

}  // namespace fitmoe::gpu
