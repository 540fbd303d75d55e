// The MoE executor of the GPU forward passes, for decode-sized micro-batches (up to
// gpu::kMaxVecTokens tokens); prefill's grouped experts are in moe_prefill.h.
//
// Per MoE layer:
//   GPU: router -> top-k, whose last CTA writes the choices and the normed input into pinned host
//        memory and raises the layer's route flag (hybrid layers: some experts on the host) -> guesses
//        the next hybrid layer's routing -> runs the chosen device-resident experts (and its share of
//        the host-resident ones, read over the bus);
//   CPU: meanwhile reads the guessed host experts ahead, spins on the route flag and runs the chosen
//        host-resident experts with all threads, writes their outputs to pinned memory and raises the
//        layer's hand-over flag;
//   GPU: a kernel waiting on that flag reads the rows; all experts' outputs are combined in the
//        reference's order into the residual.
// What differs between architectures comes in as MoeLayer (per layer, fixed at load) and MoeIo (per
// call). Implemented today: the router's input equal to the experts' input, SiLU (SwiGLU) experts,
// with or without a sigmoid-gated shared expert (qwen35moe), the combined output added into the
// residual; the others are refused at load.
#pragma once
#include <vector>

#include "cuda/residency.h"
#include "cuda/workspace.h"

namespace fitmoe::gpu {

enum class Activation { SiLU, GeLU };  // the experts' gate activation (GeLU: Gemma 4, not yet)
enum class MoeOutput {
  Residual,  // added into the residual x (and the next norm fused in)
  Buffer,    // written to a buffer, for post-norms before the residual (Gemma 4, not yet)
};

// A shared expert run beside the routed ones (a SwiGLU FFN on the experts' input), its output scaled
// by sigmoid(gate_inp . x) and added to the routed experts' combination before the residual, in the
// reference's order: x += (routed + shared * sigmoid(gate)) (qwen35moe). gate_inp is [n_embd] (one row).
struct SharedExpert {
  GWeight gate, up, down, gate_inp;
};

// One layer as the executor sees it (router null: the layer has no routed experts).
struct MoeLayer {
  const GWeight* router = nullptr;
  GExperts* experts = nullptr;
  // The norm that the routing guess applies to x to guess this layer's routing a layer early, and the
  // one that the router's launch may apply itself (with the attention block's residual add, see
  // MoeExecutor::folds_norm); null: neither. qwen3: the layer's ffn_norm for both.
  const float* guess_norm = nullptr;
  const float* fold_norm = nullptr;
  Activation act = Activation::SiLU;
  const SharedExpert* shared = nullptr;
  MoeOutput out = MoeOutput::Residual;
};

// Where a call reads: the router's input and the experts' input ([nt][n_embd] f32 each).
struct MoeIo {
  const float* router_in;
  const float* expert_in;
};

class MoeExecutor {
 public:
  // layers: one per model layer. Throws for what is not implemented yet.
  MoeExecutor(Engine& e, std::vector<MoeLayer> layers);

  const MoeLayer& layer(int l) const { return layers_[l]; }
  const std::vector<MoeLayer>& layers() const { return layers_; }
  bool moe(int l) const { return layers_[l].router != nullptr; }
  // Some of layer l's routed experts are on the host.
  bool hybrid(int l) const { return moe(l) && layers_[l].experts->n_dev < e_.c.n_expert; }

  // One token with every expert on the GPU: the gate+up kernel makes the routing itself from the
  // router's logits (one step fewer on the critical path than router_topk's last CTA; measured on the
  // H200, all-GPU decode: 397.6 / 397.9 tok/s against 387.3 / 388.9 with router_topk).
  bool routes_in_experts(int l, int nt) const;
  // The attention block's residual add and the FFN norm done in the router's launch
  // (gpu::residual_norm_router), the add itself deferred to the FFN block's end: one launch fewer per
  // layer. Measured on the H200, all-GPU decode: 421.2 / 423.0 tok/s with it, 410.6 / 410.7 without.
  // Then the architecture's attention block leaves its output in ws.y_attn and skips its residual
  // norm; gpu_part reads x + y_attn.
  bool folds_norm(int l, int nt) const;

  // GPU side of layer l's MoE block: the routing (published for the CPU in a hybrid layer), the guess
  // of the next layer's routing, the device-resident experts and the GPU's share of the host ones,
  // then the shared expert (shared_part) where the layer has one. Outputs per slot in ws.ey /
  // ws.ey_host, or (every expert on the GPU) combined in ws.y (ws.ffn_out_combined).
  void gpu_part(Step& s, int l, int nt, const MoeIo& io);
  // Layer l's shared expert on input x ([nt][n_embd], the experts' input; x must still hold it at
  // combine): its output into ws.sh_y (and its gate's logits into ws.sh_logit where the gate is not an
  // f32 weight on the GPU). gpu_part calls it; a prefill micro-batch (ExpertStreamer::run) calls it
  // after the routed experts.
  void shared_part(Step& s, int l, int nt, const float* x);
  // CPU side of hybrid layer l (micro-batches of at most kMaxVecTokens): wait for the routing, run the
  // chosen host-resident experts on the CPU threads, put their outputs in ws.h_ey_slots (slot order)
  // and publish them with the layer's flag; the GPU, already queued up to the next layer's routing,
  // waits for that flag in combine (gpu::handover_combine) and reads the rows itself.
  void host_part(Step& s, int l, int nt);
  // End of layer l's MoE block: the experts' outputs combined and added to the residual ws.x, then
  // next_norm (null: none) applied into xn, also in Q8_K into xq where not null. host_rows: the host
  // experts' outputs are in pinned memory (from host_part), not in ws.ey.
  void combine(Step& s, int l, int nt, bool host_rows, const float* next_norm, float* xn, void* xq);

  // Whether decode guesses hybrid layer l's routing one layer early (see predict_next_route): layer
  // l - 1 must be hybrid too, and layer l's router one that router_topk takes.
  bool guesses_route(int l) const;

 private:
  void routed_part(Step& s, int l, int nt, const MoeIo& io);
  void combine_shared(Step& s, int l, int nt, bool host_rows, const float* next_norm, float* xn, void* xq);
  void predict_next_route(Step& s, int l, int nt);
  void wait_route(Step& s, int l);
  std::vector<int32_t> read_guessed_ahead(Step& s, int l, size_t* bytes);

  Engine& e_;
  std::vector<MoeLayer> layers_;
  const float* shared_in_ = nullptr;  // the shared expert's input of the layer in flight (its gate reads it at combine)
};

}  // namespace fitmoe::gpu
