// What the process holds on the GPU as the driver counts it (nvidia-smi's per-process figure), beyond
// what fitmoe's accountant (device.h) allocates: the CUDA context, loaded kernels, cuBLAS's library
// and workspaces. A --vram budget is for the whole process, so the plan reserves what this measures.
// Plain C++ interface, compiled only with FITMOE_CUDA.
#pragma once
#include <cstdint>

namespace fitmoe::gpu {

// Bytes this process holds on device 0, from NVML (libnvidia-ml, part of the driver, opened at run
// time); -1 when NVML or this process's entry cannot be found (e.g. a container whose process ids
// differ from the host's).
int64_t process_device_bytes();

// Brings up what every GPU run has before its first allocation (the context and a cuBLAS handle) and
// returns what the process then holds: the runtime's share of the budget. 0 when it cannot be read.
uint64_t measure_runtime_bytes();

}  // namespace fitmoe::gpu
