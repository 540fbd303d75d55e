#include "cuda/process_memory.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <unistd.h>

#include <vector>

namespace fitmoe::gpu {

namespace {

// The few NVML entry points used, declared as the driver's documented C ABI (nvml.h is not part of
// the toolkit packages everywhere; the library is part of every driver).
using nvmlReturn_t = int;
using nvmlDevice_t = void*;
struct NvmlProcessInfo {  // nvmlProcessInfo_t of the _v3 query
  unsigned int pid;
  unsigned long long usedGpuMemory;
  unsigned int gpuInstanceId;
  unsigned int computeInstanceId;
};

struct Nvml {
  nvmlReturn_t (*init)() = nullptr;
  nvmlReturn_t (*by_pci)(const char*, nvmlDevice_t*) = nullptr;
  nvmlReturn_t (*processes)(nvmlDevice_t, unsigned int*, NvmlProcessInfo*) = nullptr;
  bool ok = false;

  Nvml() {
    void* lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) return;
    init = reinterpret_cast<decltype(init)>(dlsym(lib, "nvmlInit_v2"));
    by_pci = reinterpret_cast<decltype(by_pci)>(dlsym(lib, "nvmlDeviceGetHandleByPciBusId_v2"));
    processes = reinterpret_cast<decltype(processes)>(dlsym(lib, "nvmlDeviceGetComputeRunningProcesses_v3"));
    ok = init && by_pci && processes && init() == 0;
  }
};

const Nvml& nvml() {
  static const Nvml n;
  return n;
}

}  // namespace

int64_t process_device_bytes() {
  const Nvml& n = nvml();
  if (!n.ok) return -1;
  int dev = 0;
  char bus[32] = {};
  if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetPCIBusId(bus, sizeof bus, dev) != cudaSuccess) {
    cudaGetLastError();
    return -1;
  }
  nvmlDevice_t h = nullptr;
  if (n.by_pci(bus, &h) != 0) return -1;
  std::vector<NvmlProcessInfo> list(64);
  unsigned int count = static_cast<unsigned int>(list.size());
  if (n.processes(h, &count, list.data()) != 0) return -1;
  const unsigned int self = static_cast<unsigned int>(getpid());
  for (unsigned int i = 0; i < count; ++i)
    if (list[i].pid == self) return static_cast<int64_t>(list[i].usedGpuMemory);
  // In a container NVML lists the host's process ids. This process holds a context, so it is listed:
  // when it is the only compute process, that entry is this one.
  if (count == 1) return static_cast<int64_t>(list[0].usedGpuMemory);
  return -1;
}

uint64_t measure_runtime_bytes() {
  if (cudaFree(nullptr) != cudaSuccess) {  // creates the context
    cudaGetLastError();
    return 0;
  }
  cublasHandle_t h = nullptr;
  if (cublasCreate(&h) == CUBLAS_STATUS_SUCCESS) cublasDestroy(h);  // loads the library's kernels
  const int64_t b = process_device_bytes();
  return b > 0 ? static_cast<uint64_t>(b) : 0;
}

}  // namespace fitmoe::gpu
