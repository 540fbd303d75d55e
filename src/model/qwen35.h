// Qwen3.5 / Qwen3.6 (qwen35 dense, qwen35moe): weights, layer descriptions and the library calls of
// the MTP (nextn) head. The CPU forward pass is in qwen35.cpp.
#pragma once
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "model/layer_spec.h"
#include "model/model.h"
#include "runtime/cpu_ops.h"

namespace fitmoe {

struct Qwen35Layer {
  LayerSpec spec;
  Weight attn_norm, post_norm;                     // post_attention_norm: the FFN's input norm
  // Gated full attention: wq is [q | gate] per head.
  Weight wq, wk, wv, wo, q_norm, k_norm;
  // Gated DeltaNet.
  Weight wqkv, wgate, conv1d, dt_bias, ssm_a, w_beta, w_alpha, ssm_norm, ssm_out;
  // FFN: routed experts + shared expert (qwen35moe), or dense (qwen35).
  Weight router;
  cpu::ExpertWeights experts;
  Weight shexp_gate_inp, shexp_gate, shexp_up, shexp_down;
  Weight ffn_gate, ffn_up, ffn_down;
  // MTP block only.
  Weight eh_proj, enorm, hnorm, head_norm, embed_tokens, head;
};

struct Qwen35Weights {
  Weight tok_embd, output_norm, output;
  std::vector<Qwen35Layer> layers;  // the trunk
  std::vector<Qwen35Layer> mtp;     // nextn blocks after the trunk (0 or 1)
};

// The trunk's layers as the config describes them, and the MTP block's (a full-attention layer with
// the trunk's FFN kind).
std::vector<LayerSpec> qwen35_layer_specs(const ModelConfig& c);
LayerSpec qwen35_mtp_layer_spec(const ModelConfig& c);
// "A A A F ..." style summary for `fitmoe info`: counts, which layers are full attention.
std::string qwen35_layer_pattern(const ModelConfig& c);

#if FITMOE_CUDA
// The GPU forward pass of the trunk (src/cuda/qwen35_gpu.cpp); the MTP head stays on the CPU.
class GpuRunner;
std::unique_ptr<GpuRunner> make_qwen35_gpu(const Qwen35Weights& w, const ModelConfig& c, const Plan& plan,
                                           const LoadOptions& opt);
#endif

// ---- the MTP head (what speculative decoding uses) ---------------------------------------------
bool qwen35_has_mtp(const Model& m);  // false for other architectures
// The trunk's forward pass that also writes, for every token of the batch, the hidden state after
// output_norm ([n][n_embd]): the MTP head's input. Otherwise as Model::forward.
void qwen35_forward_hidden(const Model& m, ModelState& state, ThreadPool& pool, std::span<const int32_t> tokens,
                           int n_logits, float* logits, float* hidden);
// The MTP block's own state (a KV cache for its one attention layer).
std::unique_ptr<ModelState> qwen35_new_mtp_state(const Model& m, const StateOptions& opt);
// Evaluates the MTP head for tokens at positions mtp_state.n_past().. as one batch: row r takes token
// tokens[r] and hidden row h[r] (the trunk's hidden state of the position before it; zeros where there
// is none) and gives the logits of the token after next ([n][n_vocab]) and h_out ([n][n_embd]), the
// hidden input of a chained draft. logits or h_out may be null.
void qwen35_mtp_forward(const Model& m, ModelState& mtp_state, ThreadPool& pool, std::span<const int32_t> tokens,
                        const float* h, float* logits, float* h_out);

}  // namespace fitmoe
