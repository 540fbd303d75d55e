// The one kernel launch of the kernel files that chain dependent kernels (gpu_ops.cu, deltanet.cu):
// kernel<<<grid, block, smem, s>>>(args...), with programmatic dependent launch (PDL) where
// dependent_launch_active() says the device and the switch allow it (gpu_ops.h) and the kernel's code
// has pdl_enter() compiled in (PTX 9.0 and up: sync.cuh). Errors surface at the caller's check of
// cudaGetLastError(). The contract for every kernel launched this way is gpu_ops.cu's (before
// pdl_enter() it reads only kernel arguments and memory no kernel writes).
#pragma once
#include <cuda_runtime.h>

#include <utility>

#include "cuda/kernel_util.h"

namespace fitmoe::gpu {

bool dependent_launch_active();  // (gpu_ops.h)

template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t s, Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cudaLaunchAttribute attr[1];
  if (dependent_launch_active() && kernel_ptx_version(reinterpret_cast<const void*>(kernel), "kernel launch") >= 90) {
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
  }
  (void)cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

}  // namespace fitmoe::gpu
