// Hyperparameters of a model as the forward passes and the planner see them.
#pragma once
#include <string>
#include <vector>

#include "runtime/rope.h"

namespace fitmoe {

// The RoPE scaling types the reference knows for qwen3 / qwen3moe.
enum class RopeScaling { None, Linear, Yarn };

struct ModelConfig {
  std::string arch;        // general.architecture
  std::string name;        // general.name (may be empty)
  int n_vocab = 0;
  int n_embd = 0;
  int n_layer = 0;
  int n_head = 0;
  int n_head_kv = 0;
  int head_dim = 0;        // key/query head width
  int head_dim_v = 0;      // value head width
  int n_ctx_train = 0;
  int n_ff = 0;            // dense FFN width (0 for pure MoE)
  int n_expert = 0;        // routed experts per layer (0 for dense)
  int n_expert_used = 0;
  int n_ff_exp = 0;        // width of one routed expert
  float rms_eps = 1e-6f;
  float rope_base = 10000.0f;
  // RoPE scaling, resolved at load the way the reference resolves it (llama_context's cparams), so the
  // kernels take these values as they are: freq_scale = 1/factor (1 for none), ext_factor 1 for yarn
  // and 0 otherwise unless the file says, attn_factor with YaRN's magnitude correction folded in.
  RopeScaling rope_scaling = RopeScaling::None;
  float rope_freq_scale = 1.0f;
  float rope_ext_factor = 0.0f;    // YaRN: weight of the extrapolated angle in the ramp (0: plain)
  float rope_attn_factor = 1.0f;   // YaRN: magnitude factor on cos/sin (before ggml's own mscale)
  float rope_beta_fast = 32.0f;    // YaRN: correction range, in rotations over n_ctx_orig
  float rope_beta_slow = 1.0f;
  int rope_n_ctx_orig = 0;         // YaRN: original_context_length (n_ctx_train when absent)
  int n_rot = 0;           // rotated dims per head
  bool tied_output = false;

  // qwen35 / qwen35moe (hybrid: Gated DeltaNet layers and gated full-attention layers). Zero or empty
  // for the other architectures, which never read them. n_layer counts every block of the file, as
  // the plan sees them; the last n_layer_mtp of them are MTP (nextn) blocks, which the trunk's
  // forward pass does not run.
  std::vector<bool> recurrent_layers;  // per layer: true = DeltaNet, false = full attention (MTP: false)
  int full_attention_interval = 0;     // from the file (0 when it gave an explicit layer list)
  int ssm_conv_kernel = 0;             // causal depthwise conv1d width
  int ssm_n_k_heads = 0;               // DeltaNet query/key heads (ssm.group_count)
  int ssm_n_v_heads = 0;               // DeltaNet value heads (ssm.time_step_rank)
  int ssm_head_k_dim = 0;              // per-head key width (ssm.state_size)
  int ssm_head_v_dim = 0;              // per-head value width (ssm.inner_size / value heads)
  int rope_sections[4] = {0, 0, 0, 0}; // multi-section RoPE (IMRoPE): pairs per section t, h, w, e
  int n_ff_shexp = 0;                  // shared expert width (0: none)
  int n_layer_mtp = 0;                 // nextn_predict_layers
  int n_layer_trunk() const { return n_layer - n_layer_mtp; }

  // gemma4 (sliding-window and global attention layers; src/model/gemma4.cpp). Empty or zero for the
  // other architectures. head_dim, head_dim_v, n_rot, rope_base and n_head_kv describe the global
  // layers (n_head_kv: the first global layer's); the sliding ones have their own below.
  std::vector<bool> swa_layers;        // per layer: true = sliding window, false = global
  std::vector<int> n_head_kv_layers;   // per layer (attention.head_count_kv may be an array)
  std::vector<bool> k_eq_v_layers;     // per layer: no attn_v, V = the raw K projection (from the tensors)
  int sliding_window = 0;
  int head_dim_swa = 0;                // key = value width of the sliding layers
  int n_rot_swa = 0;
  float rope_base_swa = 10000.0f;
  int shared_kv_layers = 0;            // the last this many layers reuse earlier layers' KV
  float final_logit_softcap = 0;       // 0: none
  int n_layer_kv() const { return n_layer - shared_kv_layers; }  // layers with a KV cache of their own
};

// The RoPE parameters of the model's attention, as the kernels take them.
inline RopeParams rope_params(const ModelConfig& c) {
  return make_rope_params(c.n_rot, c.rope_base, c.rope_freq_scale, c.rope_ext_factor, c.rope_attn_factor,
                          c.rope_beta_fast, c.rope_beta_slow, c.rope_n_ctx_orig);
}

}  // namespace fitmoe
