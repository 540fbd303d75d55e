// What a dependency between two phases of a decode step costs on the GPU, measured two ways:
//   chain:      one kernel per phase, captured in a CUDA graph; with programmatic dependent launch (PDL,
//               compute capability 9.0) each kernel prefetches its weights into L2 and then waits for
//               the one before it, as fitmoe's decode kernels do;
//   persistent: one kernel for all phases, its CTAs resident for the whole run (a cooperative launch),
//               a grid barrier between phases (four kinds, see grid_barrier); optionally each CTA
//               hints its share of the next phase's weights into L2 (after its share of the phase, or
//               before it).
// Every phase streams its own `bytes` of "weights" (16-byte loads, summed; a mat-vec is latency-bound at
// these sizes) and reads the previous phase's result, so the phases form one dependent chain like the
// ~10 kernels of a decode layer. The question it answers: would a persistent decode kernel, with grid
// barriers where launch boundaries are now, shorten the step, and by how much per boundary?
//   fitmoe_gpu_phase_sync [phases=480] [reps=20] [copy GB/s for the floor column=4250, the H200's]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "cuda/sync.cuh"

#define CHECK(x)                                                                             \
  do {                                                                                       \
    cudaError_t e_ = (x);                                                                    \
    if (e_ != cudaSuccess) {                                                                 \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                          \
    }                                                                                        \
  } while (0)

namespace fitmoe::gpu {
namespace {

constexpr int kThreads = 512;

// A phase's weights into L2, the grid's threads together (thread g of the grid: 128-byte lines g,
// g + threads in the grid, ...).
__device__ __forceinline__ void prefetch_share(const uint4* w, size_t n16) {
  prefetch_l2(w, n16 * 16, static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x), static_cast<int>(gridDim.x * blockDim.x));
}

// This CTA's share of one phase: the sum of its 16-byte words (as floats) plus a value another CTA wrote
// in the previous phase, stored in this CTA's own slot (io: [phase][CTA]; no atomics, as a mat-vec
// writes its own rows).
__device__ __forceinline__ void phase_body(const uint4* w, size_t n16, float* io, int phase) {
  __shared__ float part[kThreads / 32];
  const unsigned next = (blockIdx.x + 1) % gridDim.x;
  const float prev = *reinterpret_cast<volatile float*>(io + static_cast<size_t>(phase) * gridDim.x + next);
  float s = 0.0f;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
#pragma unroll 4
  for (; i < n16; i += stride) {
    const uint4 v = w[i];
    s += __uint_as_float(v.x & 0x3f800000u) + __uint_as_float(v.y & 0x3f800000u) +
         __uint_as_float(v.z & 0x3f800000u) + __uint_as_float(v.w & 0x3f800000u);
  }
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = s;
  __syncthreads();
  if (threadIdx.x == 0) {
    float t = 0.0f;
    for (int k = 0; k < static_cast<int>(blockDim.x / 32); ++k) t += part[k];
    io[static_cast<size_t>(phase + 1) * gridDim.x + blockIdx.x] = t * 1e-9f + prev;
  }
}

__global__ void __launch_bounds__(kThreads) phase_kernel(const uint4* w, size_t n16, float* io, int phase, int prefetch) {
  if (prefetch) prefetch_share(w, n16);
  pdl_enter();
  phase_body(w, n16, io, phase);
}

// Grid barriers, generation `gen` (= phases done so far, counters never reset within a run; each
// counter sits in its own 128-byte line). Thread 0 of each CTA arrives after a __syncthreads, so its
// release carries the CTA's writes; the CTA passes once it has acquired the generation.
//   kCount:    an acquire-release atomic add; everyone spins on that counter;
//   kCountRed: the same with a release reduction (red: no value comes back, so no round trip);
//   kFlag:     the last to arrive raises a flag in another line, which the others spin on (reads only);
//   kTree:     groups of kTreeFan CTAs arrive at their own counter, the last of each group at the top
//              one, the last there raises the flag (fewer atomics serialized on one line).
enum Barrier { kCount = 0, kCountRed = 1, kFlag = 2, kTree = 3 };
constexpr int kTreeFan = 12;
constexpr int kLine = 32;  // unsigneds per 128-byte line

__device__ __forceinline__ void arrive_release_red(unsigned* p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
  asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(p) : "memory");
#else
  __threadfence();
  atomicAdd(p, 1u);
#endif
}

// ctr: [0] the counter / top counter, [kLine] the flag, [2 * kLine + group * kLine] the groups'.
__device__ __forceinline__ void grid_barrier(unsigned* ctr, unsigned gen, Barrier kind) {
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned n = gridDim.x;
    unsigned* flag = ctr + kLine;
    if (kind == kCount || kind == kCountRed) {
      if (kind == kCount) arrive_acq_rel(ctr);
      else arrive_release_red(ctr);
      while (load_acquire_gpu(ctr) < gen * n) {
      }
    } else if (kind == kFlag) {
      if (arrive_acq_rel(ctr) == gen * n - 1) store_release_gpu(flag, gen);
      else
        while (load_acquire_gpu(flag) < gen) {
        }
    } else {
      const unsigned grp = blockIdx.x / kTreeFan, ngrp = (n + kTreeFan - 1) / kTreeFan;
      const unsigned size = min(static_cast<unsigned>(kTreeFan), n - grp * kTreeFan);
      if (arrive_acq_rel(ctr + 2 * kLine + grp * kLine) == gen * size - 1 && arrive_acq_rel(ctr) == gen * ngrp - 1)
        store_release_gpu(flag, gen);
      else
        while (load_acquire_gpu(flag) < gen) {
        }
    }
  }
  __syncthreads();
}

// prefetch: 0 none; 1 the next phase's weights hinted into L2 after this phase's body, before arriving;
// 2 at the start of this phase, before its body (as early as a persistent kernel can).
__global__ void __launch_bounds__(kThreads) persistent_kernel(const uint4* w, size_t n16, float* io, int phases,
                                                              unsigned* ctr, int prefetch, int kind) {
  for (int p = 0; p < phases; ++p) {
    if (prefetch == 2 && p + 1 < phases) prefetch_share(w + static_cast<size_t>(p + 1) * n16, n16);
    phase_body(w + static_cast<size_t>(p) * n16, n16, io, p);
    if (prefetch == 1 && p + 1 < phases) prefetch_share(w + static_cast<size_t>(p + 1) * n16, n16);
    grid_barrier(ctr, static_cast<unsigned>(p + 1), static_cast<Barrier>(kind));
  }
}

template <class Body>
float time_ms(cudaStream_t s, cudaEvent_t a, cudaEvent_t b, int reps, const Body& body) {
  body();  // warm-up
  CHECK(cudaStreamSynchronize(s));
  CHECK(cudaEventRecord(a, s));
  for (int r = 0; r < reps; ++r) body();
  CHECK(cudaEventRecord(b, s));
  CHECK(cudaEventSynchronize(b));
  float ms = 0.0f;
  CHECK(cudaEventElapsedTime(&ms, a, b));
  return ms / reps;
}

}  // namespace
}  // namespace fitmoe::gpu

int main(int argc, char** argv) {
  using namespace fitmoe::gpu;
  const int phases = argc > 1 ? std::atoi(argv[1]) : 480;
  const int reps = argc > 2 ? std::atoi(argv[2]) : 20;
  int dev = 0, sms = 0, major = 0, coop = 0;
  CHECK(cudaGetDevice(&dev));
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  CHECK(cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, dev));
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, dev));
  std::printf("device: %s, %d SMs, %d phases, %d reps; one %d-thread CTA per SM (PDL,small: 128-thread CTAs of 4 KiB)\n",
              prop.name, sms, phases, reps, kThreads);
  cudaStream_t s;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaEvent_t ea, eb;
  CHECK(cudaEventCreate(&ea));
  CHECK(cudaEventCreate(&eb));
  const double copy_gbps = argc > 3 ? std::atof(argv[3]) : 4250.0;
  const size_t sizes[] = {0, size_t{256} << 10, size_t{2} << 20, size_t{6} << 20};
  // Small CTAs: 128 threads, 2 words each (4 KiB per CTA, about what one of fitmoe's mat-vec CTAs reads).
  constexpr unsigned kSmallThreads = 128, kSmallWords = 256;
  auto small_grid = [&](size_t n16) { return static_cast<unsigned>(n16 ? (n16 + kSmallWords - 1) / kSmallWords : sms); };
  unsigned max_grid = static_cast<unsigned>(sms);
  for (size_t b : sizes) max_grid = std::max(max_grid, small_grid(b / 16));
  // io: [phase][CTA] for the largest grid any variant launches.
  const size_t io_floats = static_cast<size_t>(phases + 1) * max_grid;
  float* io;
  unsigned* ctr;
  const size_t ctr_bytes = (2 + (sms + kTreeFan - 1) / kTreeFan) * kLine * sizeof(unsigned);
  CHECK(cudaMalloc(&io, io_floats * sizeof(float)));
  CHECK(cudaMemset(io, 0, io_floats * sizeof(float)));
  CHECK(cudaMalloc(&ctr, ctr_bytes));

  struct Variant {
    const char* name;
    int kind, prefetch;  // persistent: barrier kind and prefetch mode; kind < 0: a chain
  };
  // (chains: -1 plain, -2 PDL, -3 PDL with small CTAs)
  const Variant variants[] = {{"chain", -1, 0},          {"chain+PDL", -2, 1},     {"PDL,small", -3, 1},
                              {"count", kCount, 0},      {"count+pf", kCount, 1},  {"count+pfE", kCount, 2},
                              {"red+pfE", kCountRed, 2}, {"flag+pfE", kFlag, 2},   {"tree+pfE", kTree, 2}};
  std::printf("us per phase; floor = bytes at %.0f GB/s; pf: next phase hinted into L2 after the body, pfE: before it\n",
              copy_gbps);
  std::printf("%9s %7s", "bytes", "floor");
  for (const Variant& v : variants) std::printf(" %10s", v.name);
  std::printf("\n");
  for (size_t bytes : sizes) {
    const size_t n16 = bytes / 16;
    uint4* w = nullptr;
    CHECK(cudaMalloc(&w, (bytes ? bytes : 16) * phases));
    CHECK(cudaMemset(w, 0x3c, (bytes ? bytes : 16) * phases));
    const dim3 grid(sms), block(kThreads);
    auto chain_graph = [&](bool pdl, bool small) {
      const dim3 g = small ? dim3(small_grid(n16)) : grid;
      const dim3 b = small ? dim3(kSmallThreads) : block;
      cudaGraph_t gr;
      cudaGraphExec_t ge;
      CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
      for (int p = 0; p < phases; ++p) {
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = g;
        cfg.blockDim = b;
        cfg.stream = s;
        cudaLaunchAttribute attr[1];
        if (pdl) {
          attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
          attr[0].val.programmaticStreamSerializationAllowed = 1;
          cfg.attrs = attr;
          cfg.numAttrs = 1;
        }
        CHECK(cudaLaunchKernelEx(&cfg, phase_kernel, static_cast<const uint4*>(w + p * n16), n16, io, p,
                                 static_cast<int>(pdl)));
      }
      CHECK(cudaStreamEndCapture(s, &gr));
      CHECK(cudaGraphInstantiate(&ge, gr, 0));
      CHECK(cudaGraphDestroy(gr));
      return ge;
    };
    std::printf("%9zu %7.2f", bytes, bytes / (copy_gbps * 1e9) * 1e6);
    for (const Variant& v : variants) {
      float ms = -1.0f;  // not run here
      if (v.kind < 0 && (v.kind == -1 || major >= 9)) {  // (PDL from compute capability 9.0)
        cudaGraphExec_t ge = chain_graph(v.kind != -1, v.kind == -3);
        ms = time_ms(s, ea, eb, reps, [&] { CHECK(cudaGraphLaunch(ge, s)); });
        CHECK(cudaGraphExecDestroy(ge));
      } else if (v.kind >= 0 && coop) {
        ms = time_ms(s, ea, eb, reps, [&] {
          CHECK(cudaMemsetAsync(ctr, 0, ctr_bytes, s));
          const uint4* wp = w;
          size_t n = n16;
          int ph = phases, pfi = v.prefetch, k = v.kind;
          void* args[] = {&wp, &n, &io, &ph, &ctr, &pfi, &k};
          CHECK(cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(persistent_kernel), grid, block, args, 0, s));
        });
      }
      if (ms < 0) std::printf(" %10s", "n/a");
      else std::printf(" %10.2f", 1e3 * ms / phases);
    }
    std::printf("\n");
    CHECK(cudaFree(w));
  }
  return 0;
}
