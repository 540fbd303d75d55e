// The plan: the single owner of "what lives where". Given a model file, a VRAM budget, a context size
// and the machine's bandwidths, it decides for every tensor whether it lives in GPU memory or in
// (pinned) host memory -- for the routed experts of an MoE, expert by expert -- sizes the KV cache and
// scratch, predicts prompt and generation speed from a cost model, and says why.
//
// Order of placement: everything that is not a routed expert (attention, router, norms, shared
// experts, output head) and the KV cache of the requested context first, then as many routed experts
// as fit, spread evenly over the layers (with uniform routing any expert is as hot as any other; the
// even spread lets every layer run some experts on the GPU while the CPU runs the others). Manual
// overrides (--n-cpu-moe, --cpu-moe, --override-tensor) are applied on top and always win.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "format/gguf.h"
#include "model/config.h"
#include "quant/dtype.h"
#include "runtime/kv_cache.h"

namespace fitmoe {

// What the planner knows of the machine. Bandwidths in bytes/s, compute in FLOP/s.
struct MachineProfile {
  std::string gpu_name = "none";
  uint64_t gpu_free_bytes = 0;      // what the card has free (0: no GPU)
  // What this process holds on the GPU once the CUDA runtime is up, before any allocation of its own,
  // as the driver (nvidia-smi) counts it; read fresh (0: unknown, the plan assumes a fixed reserve).
  uint64_t gpu_runtime_bytes = 0;
  double gpu_mem_bw = 0;            // device memory bandwidth
  double gpu_flops = 0;             // dense f16 matrix rate (for prefill)
  double pcie_bw = 0;               // host->device from pinned memory
  double host_mem_bw = 0;           // host RAM read with all threads
  double cpu_int8_flops = 0;        // CPU int8 matrix rate (prefill of host experts)
  int cpu_threads = 1;
  // The CPU's own kernels, measured on this machine with cpu_threads threads: bytes per second of a
  // one-token product over weights in RAM (decode), and int8 FLOP/s of a many-token product (prefill).
  double cpu_decode_bw = 0;
  double cpu_matmul_flops[3] = {0, 0, 0};  // int8 FLOP/s of products of 1, 8 and 64 tokens (cache-resident weights)
  uint64_t host_available_bytes = 0;  // MemAvailable, read fresh (0: unknown)
  std::string source = "defaults";  // "measured", "cached", "flags", "defaults"
};

// A regex -> device rule, as the reference's --override-tensor.
struct TensorOverride {
  std::string pattern;   // ECMAScript regex searched in the tensor name
  bool to_gpu = false;   // false: host ("cpu"), true: "cuda0"
};

struct PlanOptions {
  bool use_gpu = true;                // false: --gpu none
  bool use_mmap = false;              // weights computed from the file mapping (CPU runs): not copied
  uint64_t vram_budget = 0;           // 0: the card's free memory minus a margin
  int n_ctx = 4096;
  // Sequences held at once, each with its own KV cache (and recurrent state) of n_ctx positions: the
  // server's --parallel plus its cached conversations. The scratch is the engine's, held once.
  int n_seq = 1;
  KvCacheType kv;
  int n_ubatch = 0;                   // prefill micro-batch on the GPU; 0: automatic (see make_plan)
  int n_cpu_moe = 0;                  // experts of the first N layers on the host
  bool cpu_moe = false;               // all routed experts on the host
  std::vector<TensorOverride> overrides;
  // How prefill treats host-resident experts a micro-batch uses: "auto" (the cost model picks per
  // layer), "upload" (copy them to the GPU) or "cpu" (compute them on the CPU).
  std::string prefill_host_experts = "auto";
  // Host experts per streamed chunk: 16 makes each copy large enough for full PCIe speed (tests use
  // smaller chunks to exercise the ring).
  int prefill_chunk_experts = 16;
  // A streamed layer's host experts are copied ahead of its routing (so the link never waits for it)
  // when the micro-batch is expected to use at least this fraction of them; below it the copies wait
  // for the routing and carry only the experts used. Copies issued after the routing carry only the
  // used experts either way. (Tests set it above 1 to make every layer wait.)
  double prefill_prefetch_min_used = 0.9;
  // Hybrid decode: the part of each token's chosen host-resident experts the GPU computes, reading
  // their weights from pinned host memory over PCIe while the CPU computes the rest (-1: from the
  // bandwidths, so that both sides finish together; 0: the CPU computes them all).
  double host_experts_gpu_share = -1;
  // GPU engine switches that tests compare against the defaults (measurements chose the defaults,
  // docs/performance.md): decode through CUDA graphs between host points (false: the same kernels
  // launched one by one), and hybrid decode's routing guess with its read-ahead of host experts.
  bool decode_graphs = true;
  bool routing_guess = true;
};

struct TensorPlacement {
  std::string name;
  uint64_t bytes = 0;
  bool on_gpu = false;
  bool is_experts = false;            // a 3-D routed-expert tensor
  int layer = -1;
  std::vector<bool> expert_on_gpu;    // per expert, for is_experts tensors
  std::string reason;
};

struct Plan {
  bool use_gpu = false;
  MachineProfile machine;
  PlanOptions options;
  // Memory map (bytes).
  uint64_t budget = 0;
  uint64_t reserve = 0;               // CUDA context, cuBLAS workspace, fragmentation
  uint64_t gpu_weights = 0, gpu_experts = 0, gpu_kv = 0, gpu_scratch = 0;
  uint64_t state_bytes = 0;           // of the sequence state (gpu_kv / host_kv): the recurrent part, fixed in size
  uint64_t host_weights = 0, host_experts = 0;
  // What the process allocates in host memory: the weights' copy (the whole file's tensor data, pinned
  // for a GPU run; none with --mmap on the CPU), the KV cache on a CPU run, and the CPU's scratch.
  uint64_t host_weight_copy = 0, host_kv = 0, host_scratch = 0;
  uint64_t host_total() const { return host_weight_copy + host_kv + host_scratch; }
  // The sequence state at n_ctx for each cache type (K and V alike), so that the plan can show what a
  // smaller cache would free: (type, bytes).
  std::vector<std::pair<DType, uint64_t>> kv_by_type;
  int experts_per_layer_gpu = 0;      // uniform spread (per layer counts may differ after overrides)
  std::vector<TensorPlacement> tensors;
  // Per decode token.
  double host_expert_bytes_per_token = 0;
  double gpu_bytes_per_token = 0;
  double predicted_tg = 0, predicted_pp = 0;
  double host_experts_gpu_share = 0;  // resolved PlanOptions::host_experts_gpu_share (0 without host experts)
  std::vector<std::string> notes;     // every choice, in order, in words

  uint64_t gpu_total() const { return gpu_weights + gpu_experts + gpu_kv + gpu_scratch + reserve; }
  const TensorPlacement* find(const std::string& name) const;
  std::string summary_line() const;   // the one line `run` prints
  std::string report() const;         // what `fitmoe plan` prints
};

// Prefill streams host-resident experts to the GPU through a ring of this many staging buffers of
// PlanOptions::prefill_chunk_experts experts each (src/cuda/moe_prefill.cpp); the plan reserves them.
constexpr int kPrefillStageSlots = 6;

// Decode's GPU share of one layer's host-resident experts (n_host of n_expert, k chosen per token): a
// token with h host slots gives the GPU floor(h * share + 1/4) of them (gpu::RoutePublish); this is the
// fraction of the host slots it takes for the expected h = k * n_host / n_expert (0: the share takes
// nothing there, and the engine leaves the layer's host experts to the CPU).
double host_experts_share_taken(double share, int k, int n_host, int n_expert);

// The GPU reads weights from pinned host memory inside its kernels (decode's GPU share of the host
// experts) at about this fraction of the copy bandwidth the machine profile measured (pcie_bw): on
// the H200 machine about 27 of 54 GB/s, less once the CPU reads host RAM beside it (docs/performance.md).
constexpr double kZeroCopyEfficiency = 0.4;

// Prefill, one layer whose routed experts are partly in host memory (n_host of n_expert; expert_bytes:
// one expert's gate + up + down), micro-batch of n_tokens choosing k experts each: the fraction of the
// host experts it is expected to use (uniform routing), whether their upload waits for the routing (see
// PlanOptions::prefill_prefetch_min_used), the time to stream them over PCIe (all of them, or the used
// ones when it waits), the time to compute the used ones on the CPU, and the choice (the options'
// prefill_host_experts, or the cheaper one for "auto"). The plan predicts with it; the GPU engine decides.
struct HostExpertsCost {
  double used_fraction = 1, upload_s = 0, cpu_s = 0;
  bool after_routing = false;
  bool stream = false;
};
HostExpertsCost prefill_host_experts_cost(const PlanOptions& opt, const MachineProfile& m, int n_tokens, int k,
                                          int n_expert, int n_host, double expert_bytes);

// GPU scratch of one model state: activations for a micro-batch of n_ubatch tokens, attention
// partials for a context of n_ctx, and the upload ring (expert_bytes: one expert's gate+up+down).
uint64_t gpu_scratch_bytes(const ModelConfig& cfg, int n_ubatch, int n_ctx, uint64_t expert_bytes, int chunk_experts,
                           bool flash_kv = false);

// Bytes of one sequence's state for n_ctx positions: the KV cache of every attention layer (K and V rows
// of the cache type kv) plus the fixed recurrent state of every DeltaNet layer with kStateCheckpoints copies of it
// (src/model/layer_spec.h: the same figures the states allocate).
constexpr int kStateCheckpoints = 4;  // StateOptions::max_checkpoints' default
uint64_t kv_cache_bytes(const ModelConfig& cfg, int64_t n_ctx, const KvCacheType& kv);

// MemAvailable / MemTotal from /proc/meminfo (0 where it cannot be read).
uint64_t host_memory_available();
uint64_t host_memory_total();

// The CPU's int8 product rate (FLOP/s) at `tokens` columns per weight matrix, interpolated between the
// profile's measured widths (cpu_int8_flops where the profile has none).
double cpu_matmul_rate(const MachineProfile& m, double tokens);

// Throws Error when `bytes` more host memory (for `what`) would not fit in what the machine has free,
// naming both figures; a check before a large allocation, so that it fails with a message instead of
// the out-of-memory killer.
void check_host_memory(uint64_t bytes, const std::string& what);

// Builds the plan from the file alone (no weights are read). Throws Error when the budget cannot hold
// the non-expert weights plus a minimal KV cache, saying how much is needed.
Plan make_plan(const gguf::File& file, const ModelConfig& cfg, const PlanOptions& opt, const MachineProfile& m);

// The cost model: sets p.predicted_tg, and p.predicted_pp for a prompt of n_prompt tokens, from the
// placement in p and p.machine (make_plan predicts one micro-batch on the GPU, a 512-token batch on
// the CPU; bench asks for each ppN with the profile of the threads it runs).
void predict_speed(const gguf::File& file, const ModelConfig& cfg, Plan& p, int n_prompt);

// "8G", "7.5GiB", "8192M", "500MB" -> bytes (G, M, K are binary; a bare number is bytes). Throws Error.
uint64_t parse_size(const std::string& s);
std::vector<TensorOverride> parse_overrides(const std::vector<std::string>& args);  // "REGEX=cpu|cuda0"

}  // namespace fitmoe
