// Host-side facts about kernels that the kernel files (gpu_ops.cu, moe_gemm.cu) share, each looked up
// once per (kernel, device) and cached, so that later calls (e.g. while a CUDA graph is being captured)
// make no CUDA calls. Kernels are passed as `const void*` (reinterpret_cast of the __global__ function).
#pragma once
#include <cstddef>

namespace fitmoe::gpu {

// The PTX version (e.g. 90 for sm_90) of the code the current device runs for this kernel: whether it
// was built for an architecture with the instructions its fast path needs.
int kernel_ptx_version(const void* kernel, const char* what);
// Shared memory per multiprocessor of the current device.
size_t smem_per_sm(const char* what);
// The most shared memory one CTA of the current device may have (static and dynamic, opted in): 48 KiB
// on Pascal, 99 KiB on Ada, 227 KiB on Hopper.
size_t smem_per_block(const char* what);
// How many CTAs of `threads` threads and `smem` bytes of dynamic shared memory the whole device holds at
// once (kernels whose CTAs wait for each other must not launch more).
int resident_ctas(const void* kernel, int threads, size_t smem, const char* what);
// Opts the kernel into `bytes` of dynamic shared memory when that is over 48 KiB; throws Error naming
// `what` when the device allows less.
void need_dynamic_smem(const void* kernel, size_t bytes, const char* what);

}  // namespace fitmoe::gpu
