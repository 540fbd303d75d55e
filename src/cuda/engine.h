// Per-engine resources of the GPU forward passes, shared by every piece of them and by every sequence
// (state) of one loaded model: the memory accountant, the stream, the profilers, the routing guess's
// counters, the switches tests and measurements flip. Also `Step`, what one forward call hands the
// pieces: the engine, the sequence's state and its workspace, the thread pool.
//
// The pieces (all in src/cuda/, one concern each):
//   residency    weights as the GPU sees them (device copies or host-resident), experts packed by slot
//   workspace    the engine's scratch and pinned exchange buffers; GpuState = KV cache + decode graphs
//   linear       weight x activation products (mat-vec for decode, dequantize + cuBLAS for prefill)
//   moe_decode   the MoE executor for decode-sized micro-batches: routing and its publication to the
//                host, the routing guess and read-ahead, device experts, the GPU's share of host
//                experts, host experts on the CPU, the hand-over and the combination
//   moe_prefill  prefill's grouped experts and the upload ring that streams host experts over PCIe
//   step_driver  micro-batches, decode graphs between host points (capture and replay), the flag guard
//   qwen3_gpu    qwen3 / qwen3moe: its weights and its layer program (the only architecture file)
#pragma once
#include <memory>
#include <span>
#include <string>

#include "cuda/device.h"
#include "cuda/profile.h"
#include "model/model.h"

namespace fitmoe {
class ThreadPool;
}

namespace fitmoe::gpu {

// Switches for tests (PlanOptions::decode_graphs / routing_guess), fixed when a model is loaded.
struct Switches {
  bool graphs = true;   // false: decode without CUDA graphs (the same kernels one by one)
  bool predict = true;  // false: no routing guess / read-ahead in hybrid decode
  static Switches from(const PlanOptions& o) { return {o.decode_graphs, o.routing_guess}; }
};

class GpuState;
struct Workspace;
struct WorkspaceShape;

struct Engine {
  // Throws (before creating anything on the device) when the model routes more experts per token than
  // the kernels take.
  Engine(const ModelConfig& c, const Plan& plan);
  ~Engine();  // waits for the stream, destroys it, prints the host profile
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // A device copy of `bytes` from host memory, through the accountant (queued on the stream).
  uint8_t* upload(const void* src, size_t bytes, const std::string& what);
  // The one workspace every sequence of the engine shares (src/cuda/workspace.h), allocated when the
  // first state is made, for the larger of its context and the plan's (the attention scratch grows with
  // it); *fresh says it was allocated now (the architecture then adds its own scratch). A later state
  // must fit it: a larger context or another kind of cache (flash or not) is an error.
  Workspace& workspace(const WorkspaceShape& shape, const StateOptions& opt, bool* fresh);

  const ModelConfig& c;
  const Plan& plan;
  DeviceMemory mem;
  const int ubatch;         // tokens per micro-batch
  const int chunk_experts;  // host experts per streamed prefill chunk
  void* stream = nullptr;
  OpProfile prof;
  HostProfile host_prof;
  RoutingGuessStats guess_stats;
  const Switches sw;
  std::unique_ptr<Workspace> ws;
  int ws_n_ctx = 0;
  bool ws_flash = false;
};

// A sequence's rows of a micro-batch: its state, rows [row0, row0 + n) of the micro-batch, the first
// one's position (the rest follow).
struct SeqRows {
  GpuState* st;
  int row0, n, pos0;
};

// One micro-batch's context, as every piece takes it: the engine, its workspace, the thread pool and
// the sequences whose rows the micro-batch holds (what reads or writes a sequence's own state, its KV
// cache or recurrent state, runs per sequence; every product runs over all rows at once).
struct Step {
  Engine& e;
  Workspace& ws;
  ThreadPool& pool;
  std::span<const SeqRows> seqs;
};

// What the host says when the GPU's routing hands over no valid expert: -1 is what NaN router logits
// leave (the softmax has no maximum), which comes from NaN or infinite weights or activations.
std::string no_expert_message(int32_t e);

}  // namespace fitmoe::gpu
