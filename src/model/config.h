// Hyperparameters of a model as the forward passes and the planner see them.
#pragma once
#include <string>

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
};

// The RoPE parameters of the model's attention, as the kernels take them.
inline RopeParams rope_params(const ModelConfig& c) {
  return make_rope_params(c.n_rot, c.rope_base, c.rope_freq_scale, c.rope_ext_factor, c.rope_attn_factor,
                          c.rope_beta_fast, c.rope_beta_slow, c.rope_n_ctx_orig);
}

}  // namespace fitmoe
