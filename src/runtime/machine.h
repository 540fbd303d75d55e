// Measuring the machine for the planner's cost model: host RAM read bandwidth with all threads, and
// (CUDA builds, with a GPU) the GPU's free memory, memory bandwidth, matrix rate and pinned PCIe
// upload speed. Measured once (about a second) and cached in ~/.cache/fitmoe/machine.json, keyed by
// CPU, thread count and GPU; flags can override every figure.
#pragma once
#include "runtime/plan.h"

namespace fitmoe {

// use_gpu=false skips the GPU probes (and reports no GPU).
MachineProfile probe_machine(int n_threads, bool use_gpu, bool use_cache = true);

// A typical consumer machine of the kind fitmoe targets (GTX 1080 + DDR4 desktop), for planning on a
// machine without a GPU: `fitmoe plan --vram 8G` there answers "what would happen on such a card".
MachineProfile reference_consumer_machine(uint64_t vram);

// How many bytes of [p, p + n) the kernel backs with transparent huge pages (the AnonHugePages of the
// mappings in /proc/self/smaps that overlap it, at most their overlap), or -1 where that cannot be read.
// The CPU streams host-resident experts from such memory: 4 KiB pages cost it a TLB miss and a stop of
// the hardware prefetchers every 4 KiB.
int64_t huge_page_bytes(const void* p, uint64_t n);
// The kernel's transparent huge page policy ("enabled" and "defrag", the chosen words), for messages.
std::string huge_page_policy();

}  // namespace fitmoe
