// Hyperparameters of a model as the forward passes and the planner see them.
#pragma once
#include <string>

namespace fitmoe {

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
  float rope_freq_scale = 1.0f;
  int n_rot = 0;           // rotated dims per head
  bool tied_output = false;
};

}  // namespace fitmoe
