// Prefill's routed experts (micro-batches of more than gpu::kMaxVecTokens tokens): slots grouped by
// expert on the host, every device-resident expert of a layer in one grouped tensor-core launch per
// matrix. For the host-resident experts the cost model picks per layer, before the micro-batch
// starts, between the CPU and streaming them over PCIe. Streamed layers' experts go up in chunks
// through a ring of staging buffers on a second stream, in the order the layers will use them, so the
// copies of later layers run while earlier layers compute. A copy issued once its layer's routing is
// known carries only the experts the micro-batch uses; one issued before it carries the whole chunk,
// which keeps the PCIe link busy: a micro-batch worth streaming uses nearly every expert (a layer
// expected to use fewer than PlanOptions::prefill_prefetch_min_used of them waits for its routing
// instead).
#pragma once
#include <vector>

#include "cuda/moe_decode.h"

namespace fitmoe::gpu {

class ExpertStreamer {
 public:
  // The layers are the executor's (MoeExecutor::layers).
  ExpertStreamer(Engine& e, const MoeExecutor& moe) : e_(e), moe_(moe) {}

  // Whether any layer has host-resident experts (then the workspace holds the upload ring).
  bool has_host_experts() const;
  // Before a prefill micro-batch of nt tokens: per MoE layer with host experts, the cost model picks
  // streaming them over PCIe or running the ones used on the CPU, and for a streamed layer whether its
  // copies may start before its routing is known (then they carry whole chunks). The first chunks of
  // the stream go out at once; each chunk consumed releases the next.
  void start(Step& s, int nt);
  // Routed experts of layer l for a prefill micro-batch: input io [nt][n_embd], output ws.ey, one row
  // per router slot [nt * k][n_embd] (combined by MoeExecutor::combine).
  void run(Step& s, int l, int nt, const MoeIo& io);

 private:
  // The products' inputs rounded as the reference's integer products see them (gpu::round_acts).
  const float* rounded_input(Step& s, const float* x, int nt, DType weight_type);
  void round_rows(float* h, int row0, int n_rows, DType weight_type);
  void gate_up(Step& s, const float* x, const float* xr, int nt, const DevMatrix& g3, const DevMatrix& u3,
               const int32_t* slot_of, int n_slots, int row0, int n_rows);
  void host_experts_on_cpu(Step& s, const float* x, GExperts& X, const std::vector<int>& used, const int32_t* h_off,
                           const int32_t* h_rows, const int32_t* h_dst, int nt);
  void issue_chunk_copies(Step& s);
  void issue_chunk_copy(Step& s);
  void run_streamed_chunks(Step& s, const float* x, const float* xr, int nt, GExperts& X, int l, const int32_t* h_off);

  Engine& e_;
  const MoeExecutor& moe_;
};

}  // namespace fitmoe::gpu
