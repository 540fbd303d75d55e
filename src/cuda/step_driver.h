// The step driver of the GPU forward passes: splits a forward call into micro-batches and runs each
// through an architecture's layer program, deciding alone where the CPU acts (the host points: the
// host-resident experts of a hybrid MoE layer) and, for decode steps, which stretches of GPU work
// between two host points are captured into CUDA graphs and replayed.
#pragma once
#include <span>
#include <vector>

#include "cuda/moe_decode.h"
#include "cuda/moe_prefill.h"

namespace fitmoe::gpu {

// An architecture's GPU forward pass as the driver runs it. The driver calls, per micro-batch:
// embed_host, (the positions and the epoch go up), inputs, then per layer front, [the CPU's experts of
// a hybrid layer], back, and head for the rows that want logits. Everything but embed_host is queued on
// the engine's stream without synchronising (so that it can be captured), unless a weight is
// host-resident (then the driver captures nothing).
class LayerProgram {
 public:
  virtual ~LayerProgram() = default;
  // The host part of a micro-batch's inputs (the embedding rows looked up on the host, or the token
  // ids copied for a lookup on the GPU), into the workspace's pinned buffers.
  virtual void embed_host(Step& s, std::span<const int32_t> tokens) = 0;
  // The inputs' upload (capturable) and the first layer's input norm: ws.x and ws.xn.
  virtual void inputs(Step& s, int nt) = 0;
  // Layer l up to the routing and the GPU's own experts (decode-sized micro-batches) or the whole MoE
  // block (prefill): attention block, FFN norm, the MoE executor's gpu_part (or the streamer's run).
  // The positions, and which rows are whose, are s.seqs.
  virtual void front(Step& s, int l, int nt) = 0;
  // Layer l after the hand-over (host_rows: the CPU's experts' rows come from pinned memory): the
  // combination into the residual and the next layer's input norm.
  virtual void back(Step& s, int l, int nt, bool host_rows) = 0;
  // The final norm and the output head for rows [r0, r0 + min(64, n_out - r0)) of the last n_out
  // tokens, into ws.h_out (copied out on the stream).
  virtual void head(Step& s, int nt, int n_out, int r0) = 0;
};

// The two ends every layer program shares (written once; an architecture with post-norms or a logit
// softcap adds its step before or after them):
// after layer l's FFN, the MoE executor's combination (moe null or a dense layer: ws.y) into the
// residual ws.x and the next layer's input norm into ws.xn (and its quantized form for next_input's
// product); after the last layer (next_norm null) only the residual.
void finish_layer(Step& s, MoeExecutor* moe, bool moe_layer, int l, int nt, bool host_rows, const float* next_norm,
                  const GWeight* next_input, int n_embd, float eps);
// The final norm and the output head for rows [r0, r0 + min(64, n_out - r0)) of the last n_out of nt
// tokens, into ws.logits and (copied out on the stream) ws.h_out.
void output_head(Step& s, const float* output_norm, const GWeight& output, int n_embd, int n_vocab, float eps, int nt,
                 int n_out, int r0);

class StepDriver {
 public:
  // graphs_ok: every product of a step is on the GPU and nothing forbids graphs (switch, op profile).
  // host_products: a non-expert product runs on the host (it waits for the stream).
  StepDriver(Engine& e, LayerProgram& prog, MoeExecutor& moe, ExpertStreamer& streamer, bool graphs_ok,
             bool host_products)
      : e_(e), prog_(prog), moe_(moe), streamer_(streamer), graphs_ok_(graphs_ok), host_products_(host_products) {}

  // A batch of one or more sequences (every state a GpuState of this engine), cut into micro-batches of
  // at most the workspace's rows; logits as Model::forward_batch.
  void forward(ThreadPool& pool, const BatchRows& batch, float* logits);

 private:
  // want_rows: the micro-batch's rows that want logits, in order (logits gets them in that order).
  void micro_batch(Step& s, std::span<const int32_t> tokens, std::span<const int> want_rows, float* logits);
  void decode_step_graphs(Step& s, int32_t token, float* logits);
  void prepare_inputs(Step& s, std::span<const int32_t> tokens);
  void gather_logit_rows(Step& s, int nt, int n_out, std::span<const int> want_rows);
  void upload_inputs(Step& s, int nt);

  Engine& e_;
  LayerProgram& prog_;
  MoeExecutor& moe_;
  ExpertStreamer& streamer_;
  const bool graphs_ok_, host_products_;
};

}  // namespace fitmoe::gpu
