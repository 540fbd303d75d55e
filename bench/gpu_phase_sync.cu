// What a dependency between two phases of a decode step costs on the GPU, measured two ways:
//   chain:      one kernel per phase, captured in a CUDA graph; with programmatic dependent launch (PDL,
//               compute capability 9.0) each kernel prefetches its weights into L2 and then waits for
//               the one before it, as fitmoe's decode kernels do;
//   persistent: one kernel for all phases, its CTAs resident for the whole run (a cooperative launch),
//               a grid barrier between phases (three kinds, see grid_barrier); optionally each CTA
//               hints its share of the next phase's weights into L2 before it arrives.
// Every phase streams its own `bytes` of "weights" (16-byte loads, summed; a mat-vec is latency-bound at
// these sizes) and reads the previous phase's result, so the phases form one dependent chain like the
// ~10 kernels of a decode layer. The question it answers: would a persistent decode kernel, with grid
// barriers where launch boundaries are now, shorten the step, and by how much per boundary?
//   fitmoe_gpu_phase_sync [phases=480] [reps=20]
#include <cuda_runtime.h>

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
// counter sits in its own 128-byte line). Thread 0 of each CTA arrives with one acquire-release atomic
// after a __syncthreads, so its release carries the CTA's writes; the CTA passes once it has acquired
// the generation.
//   kCount: everyone spins on the one counter the atomics go to;
//   kFlag:  the last to arrive raises a flag in another line, which the others spin on (reads only);
//   kTree:  groups of kTreeFan CTAs arrive at their own counter, the last of each group at the top
//           one, the last there raises the flag (fewer atomics serialized on one line).
enum Barrier { kCount = 0, kFlag = 1, kTree = 2 };
constexpr int kTreeFan = 12;
constexpr int kLine = 32;  // unsigneds per 128-byte line

// ctr: [0] the counter (kCount) / top counter, [kLine] the flag, [2 * kLine + group * kLine] the groups'.
__device__ __forceinline__ void grid_barrier(unsigned* ctr, unsigned gen, Barrier kind) {
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned n = gridDim.x;
    unsigned* flag = ctr + kLine;
    if (kind == kCount) {
      arrive_acq_rel(ctr);
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

__global__ void __launch_bounds__(kThreads) persistent_kernel(const uint4* w, size_t n16, float* io, int phases,
                                                              unsigned* ctr, int prefetch, int kind) {
  for (int p = 0; p < phases; ++p) {
    phase_body(w + static_cast<size_t>(p) * n16, n16, io, p);
    if (prefetch && p + 1 < phases) prefetch_share(w + static_cast<size_t>(p + 1) * n16, n16);
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
  std::printf("device: %s, %d SMs, %d phases, %d reps, %d threads per CTA, one CTA per SM\n", prop.name, sms, phases,
              reps, kThreads);
  cudaStream_t s;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaEvent_t ea, eb;
  CHECK(cudaEventCreate(&ea));
  CHECK(cudaEventCreate(&eb));
  float* io;
  unsigned* ctr;
  const size_t ctr_bytes = (2 + (sms + kTreeFan - 1) / kTreeFan) * kLine * sizeof(unsigned);
  CHECK(cudaMalloc(&io, static_cast<size_t>(phases + 1) * sms * sizeof(float)));
  CHECK(cudaMemset(io, 0, static_cast<size_t>(phases + 1) * sms * sizeof(float)));
  CHECK(cudaMalloc(&ctr, ctr_bytes));

  // persistent: barrier kind, then with (+pf) the next phase's weights hinted into L2 before arriving.
  std::printf("%9s %8s %7s %9s %10s %7s %10s %6s %9s %6s %9s   (us per phase)\n", "bytes", "bw-floor", "chain",
              "chain+PDL", "PDL,128t", "count", "count+pf", "flag", "flag+pf", "tree", "tree+pf");
  for (size_t bytes : {size_t{0}, size_t{256} << 10, size_t{2} << 20, size_t{6} << 20}) {
    const size_t n16 = bytes / 16;
    uint4* w = nullptr;
    CHECK(cudaMalloc(&w, (bytes ? bytes : 16) * phases));
    CHECK(cudaMemset(w, 0x3c, (bytes ? bytes : 16) * phases));
    const dim3 grid(sms), block(kThreads);

    // (small: 128-thread CTAs, each thread 8 words, as many CTAs as that takes, like fitmoe's mat-vecs)
    auto chain_graph = [&](bool pdl, bool small) {
      const dim3 g = small ? dim3(static_cast<unsigned>(n16 ? (n16 + 1023) / 1024 : sms)) : grid;
      const dim3 b = small ? dim3(128) : block;
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
    cudaGraphExec_t plain = chain_graph(false, false);
    cudaGraphExec_t pdl = major >= 9 ? chain_graph(true, false) : nullptr;
    cudaGraphExec_t pdl_small = major >= 9 ? chain_graph(true, true) : nullptr;
    const float t_chain = time_ms(s, ea, eb, reps, [&] { CHECK(cudaGraphLaunch(plain, s)); });
    const float t_pdl = pdl ? time_ms(s, ea, eb, reps, [&] { CHECK(cudaGraphLaunch(pdl, s)); }) : 0.0f;
    const float t_small = pdl ? time_ms(s, ea, eb, reps, [&] { CHECK(cudaGraphLaunch(pdl_small, s)); }) : 0.0f;
    float t_pers[3][2] = {};
    for (int kind = 0; kind < 3 && coop; ++kind) {
      for (int pf = 0; pf < 2; ++pf) {
        t_pers[kind][pf] = time_ms(s, ea, eb, reps, [&] {
          CHECK(cudaMemsetAsync(ctr, 0, ctr_bytes, s));
          const uint4* wp = w;
          size_t n = n16;
          int ph = phases, pfi = pf, k = kind;
          void* args[] = {&wp, &n, &io, &ph, &ctr, &pfi, &k};
          CHECK(cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(persistent_kernel), grid, block, args, 0, s));
        });
      }
    }
    const double floor_us = bytes / 4.25e12 * 1e6;  // the H200's measured copy bandwidth
    const double per = 1e3 / phases;
    std::printf("%9zu %8.2f %7.2f %9.2f %10.2f %7.2f %10.2f %6.2f %9.2f %6.2f %9.2f\n", bytes, floor_us, per * t_chain,
                per * t_pdl, per * t_small, per * t_pers[0][0], per * t_pers[0][1], per * t_pers[1][0], per * t_pers[1][1],
                per * t_pers[2][0], per * t_pers[2][1]);
    CHECK(cudaGraphExecDestroy(plain));
    if (pdl) CHECK(cudaGraphExecDestroy(pdl));
    if (pdl_small) CHECK(cudaGraphExecDestroy(pdl_small));
    CHECK(cudaFree(w));
  }
  return 0;
}
