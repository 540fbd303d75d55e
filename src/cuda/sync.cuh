// Device-side synchronisation helpers shared by the CUDA kernels and the GPU micro-benchmark
// (bench/gpu_phase_sync.cu): programmatic dependent launch, acquire / release flags and counters
// between CTAs and with the CPU, polling pauses and L2 hints. Each works from compute capability 6.1
// (Pascal) up: the acquire / release forms from 7.0, full fences around plain accesses before.
//
// Everything lives in an anonymous namespace inside fitmoe::gpu, as in cuda/blocks.cuh. Include only
// from .cu files (nvcc), before opening fitmoe::gpu.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>

namespace fitmoe::gpu {
namespace {

// PDL (see launch() in gpu_ops.cu): wait until the kernel before this one has finished, then let the next one start.
__device__ __forceinline__ void pdl_enter() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// The flags the CPU and the GPU exchange through pinned memory: system-scope acquire / release from
// compute capability 7.0 (Volta), a volatile access and a system fence before it (Pascal).
__device__ __forceinline__ unsigned load_acquire_sys(const unsigned* p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
  unsigned v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
#else
  const unsigned v = *reinterpret_cast<const volatile unsigned*>(p);
  __threadfence_system();
  return v;
#endif
}
__device__ __forceinline__ void store_release_sys(unsigned* p, unsigned v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
#else
  __threadfence_system();
  *reinterpret_cast<volatile unsigned*>(p) = v;
#endif
}
// CTAs counting each other across the GPU (the attention's chunks, the router's last CTA): thread 0
// arrives after a __syncthreads, so its release publishes the whole CTA's writes, and the CTA that sees
// the count complete acquires everyone's (then a __syncthreads hands that on to its threads). From
// compute capability 7.0 these are one acquire-release atomic / acquire load, not a full fence on each
// side; Pascal gets the fences.
__device__ __forceinline__ unsigned arrive_acq_rel(unsigned* p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
  unsigned old;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(old) : "l"(p) : "memory");
  return old;
#else
  __threadfence();
  const unsigned old = atomicAdd(p, 1u);
  __threadfence();
  return old;
#endif
}
__device__ __forceinline__ unsigned load_acquire_gpu(const unsigned* p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
#else
  const unsigned v = *reinterpret_cast<const volatile unsigned*>(p);
  __threadfence();
  return v;
#endif
}
// A short pause in a polling loop (__nanosleep exists from compute capability 7.0; Pascal just polls).
__device__ __forceinline__ void poll_pause(unsigned ns) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
  __nanosleep(ns);
#else
  (void)ns;
#endif
}

// Hints bytes [p, p + n) into L2, 128-byte lines first, first + stride, ... (a hint: never a fault, and
// never a change to what a later load returns).
__device__ __forceinline__ void prefetch_l2(const void* p, size_t n, int first, int stride) {
  const char* c = static_cast<const char*>(p);
  for (size_t off = static_cast<size_t>(first) * 128; off < n; off += static_cast<size_t>(stride) * 128)
    asm volatile("prefetch.global.L2 [%0];" ::"l"(c + off));
}
// A flag raised for the other CTAs of the GPU (they read it with load_acquire_gpu).
__device__ __forceinline__ void store_release_gpu(unsigned* p, unsigned v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
  asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
#else
  __threadfence();
  *reinterpret_cast<volatile unsigned*>(p) = v;
#endif
}

}  // namespace
}  // namespace fitmoe::gpu
