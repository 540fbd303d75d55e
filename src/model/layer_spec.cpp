#include "model/layer_spec.h"

#include <cmath>

#include "model/config.h"
#include "model/gemma4.h"
#include "model/qwen35.h"

namespace fitmoe {

std::vector<LayerSpec> layer_specs(const ModelConfig& c, bool with_mtp) {
  if (!c.swa_layers.empty()) return gemma4_layer_specs(c);
  if (!c.recurrent_layers.empty()) {
    std::vector<LayerSpec> s = qwen35_layer_specs(c);
    if (with_mtp)
      for (int i = 0; i < c.n_layer_mtp; ++i) s.push_back(qwen35_mtp_layer_spec(c));
    return s;
  }
  // qwen3 / qwen3moe: every layer is plain attention over the whole head.
  LayerSpec l;
  AttnSpec a;
  a.n_head = c.n_head;
  a.n_head_kv = c.n_head_kv;
  a.head_dim = c.head_dim;
  a.head_dim_v = c.head_dim_v;
  a.n_rot = c.n_rot;
  a.scale = c.head_dim > 0 ? 1.0f / std::sqrt(static_cast<float>(c.head_dim)) : 0.0f;
  l.mixer = a;
  if (c.n_expert) l.moe = MoeSpec{c.n_expert, c.n_expert_used, c.n_ff_exp, 0};
  else l.dense = DenseSpec{c.n_ff};
  return std::vector<LayerSpec>(static_cast<size_t>(c.n_layer), l);
}

uint64_t sequence_memory_bytes(const ModelConfig& c, int64_t n_ctx, const KvCacheType& kv, int n_checkpoints, bool with_mtp) {
  uint64_t b = 0;
  for (const LayerSpec& l : layer_specs(c, with_mtp)) {
    const LayerMemory m = layer_memory(l, kv);
    b += m.kv_bytes(n_ctx) + m.state_bytes * static_cast<uint64_t>(1 + n_checkpoints);
  }
  return b;
}

}  // namespace fitmoe
