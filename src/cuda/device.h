// The CUDA device as the rest of fitmoe sees it: discovery, measurement, and the memory accountant
// through which every device allocation goes, so that a VRAM budget is a hard limit.
// Plain C++ interface (no CUDA headers), compiled only with FITMOE_CUDA.
#pragma once
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>

#include "runtime/plan.h"

namespace fitmoe::gpu {

struct DeviceInfo {
  std::string name;
  uint64_t free_bytes = 0, total_bytes = 0;
  int cc_major = 0, cc_minor = 0;
  int sm_count = 0;
};

// False when no usable CUDA device (or driver) is present; never throws.
bool query_device(DeviceInfo* out);
// Fills the GPU figures of a profile: device memory bandwidth, f16 matrix rate, pinned upload speed.
void measure_device(MachineProfile* m);

// Every cudaMalloc of fitmoe goes through one of these. alloc() throws fitmoe::Error naming what
// asked, how much, and what is in use, when the budget would be exceeded.
class DeviceMemory {
 public:
  explicit DeviceMemory(uint64_t budget);
  ~DeviceMemory();
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;

  void* alloc(size_t bytes, const std::string& what);
  void free(void* p);
  uint64_t used() const { return used_; }
  uint64_t peak() const { return peak_; }
  uint64_t budget() const { return budget_; }
  std::string usage_report() const;  // bytes per purpose

 private:
  uint64_t budget_, used_ = 0, peak_ = 0;
  std::map<void*, std::pair<size_t, std::string>> live_;
  std::map<std::string, uint64_t> by_what_;
  mutable std::mutex mu_;
};

// Throws fitmoe::Error with the CUDA error text when code != 0.
void check(int code, const char* what);

// Thin wrappers so host code needs no CUDA headers.
void* create_stream();
void destroy_stream(void* s);
void* create_event();  // timing disabled, for ordering
void* create_timing_event();  // for gpu::elapsed_ms (the op profiler)
float elapsed_ms(void* from, void* to);
void destroy_event(void* e);
void record_event(void* e, void* stream);
void wait_event(void* stream, void* e);      // GPU-side wait
void sync_event(void* e);                     // host waits
void sync_stream(void* s);
bool check_stream(void* s);  // whether the stream's work is all done; throws if it failed (never waits)
void copy_h2d(void* dst, const void* src, size_t bytes, void* stream);
void copy_d2h(void* dst, const void* src, size_t bytes, void* stream);
void copy_d2d(void* dst, const void* src, size_t bytes, void* stream);
void memset_async(void* dst, int value, size_t bytes, void* stream);
// Page-locks an existing host range (cudaHostRegister) so uploads run at full PCIe speed.
void pin_host(const void* p, size_t bytes);
void unpin_host(const void* p);
void* alloc_pinned(size_t bytes);  // cudaMallocHost
void free_pinned(void* p);
// Page-locked memory in 2 MiB pages where the kernel gives them (transparent huge pages): for the
// weights, which the CPU streams when it computes host-resident experts (4 KiB pages stop the
// hardware prefetchers at every page and miss the TLB every 4 KiB). Falls back to alloc_pinned.
void* alloc_pinned_huge(size_t bytes);
void free_pinned_huge(void* p);
// The address kernels use for pinned host memory (they read it over the bus; the same address under
// unified addressing).
void* device_view(void* pinned);

// CUDA graphs of a stream's work.
void begin_capture(void* stream);
void* end_capture(void* stream);      // returns an executable graph
void launch_graph(void* graph_exec, void* stream);
void destroy_graph(void* graph_exec);

}  // namespace fitmoe::gpu
