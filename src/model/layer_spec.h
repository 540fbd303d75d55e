// Per-layer descriptions as plain data: what a layer's mixer is (full attention or a Gated DeltaNet),
// what its FFN is (routed experts, with or without a shared expert, or dense), and the memory each
// kind needs per sequence. A forward pass, the state allocation and (later) the plan all derive from
// these instead of re-deriving the layer pattern from the hyperparameters each on their own.
#pragma once
#include <cstdint>
#include <optional>
#include <variant>
#include <vector>

#include "quant/dtype.h"

namespace fitmoe {

// Causal softmax attention over a KV cache.
struct AttnSpec {
  int n_head = 0, n_head_kv = 0, head_dim = 0, head_dim_v = 0;
  int n_rot = 0;                        // rotated dims per head (partial RoPE when < head_dim)
  int rope_sections[4] = {0, 0, 0, 0};  // all zero: plain NeoX RoPE; else multi-section (IMRoPE)
  bool q_gate = false;                  // attn_q is [q, gate] per head; output *= sigmoid(gate)
  float scale = 0;                      // on Q.K (1/sqrt(head_dim))
};

// Gated DeltaNet: a linear-attention layer with a fixed-size recurrent state per sequence.
struct DeltaSpec {
  int n_k_heads = 0, n_v_heads = 0;     // value head h uses query/key head h % n_k_heads
  int head_k_dim = 0, head_v_dim = 0;
  int conv_kernel = 0;                  // causal depthwise conv1d over [q | k | v]
  int key_dim() const { return n_k_heads * head_k_dim; }
  int value_dim() const { return n_v_heads * head_v_dim; }
  int conv_channels() const { return 2 * key_dim() + value_dim(); }
  // Floats of per-sequence state: the conv's last (kernel - 1) inputs, and per value head a
  // head_v_dim x head_k_dim matrix.
  int64_t conv_state_floats() const { return static_cast<int64_t>(conv_kernel - 1) * conv_channels(); }
  int64_t delta_state_floats() const { return static_cast<int64_t>(n_v_heads) * head_v_dim * head_k_dim; }
};

// Routed experts (softmax, top-k, renormalised) and optionally one shared expert scaled by
// sigmoid(ffn_gate_inp_shexp . x).
struct MoeSpec {
  int n_expert = 0, n_expert_used = 0, n_ff_exp = 0;
  int n_ff_shexp = 0;  // 0: no shared expert
};

struct DenseSpec {
  int n_ff = 0;
};

struct LayerSpec {
  std::variant<AttnSpec, DeltaSpec> mixer;
  std::optional<MoeSpec> moe;      // exactly one of moe and dense is set
  std::optional<DenseSpec> dense;
  bool is_attention() const { return std::holds_alternative<AttnSpec>(mixer); }
  bool is_delta() const { return std::holds_alternative<DeltaSpec>(mixer); }
  const AttnSpec& attn() const { return std::get<AttnSpec>(mixer); }
  const DeltaSpec& delta() const { return std::get<DeltaSpec>(mixer); }
};

// What one layer keeps per sequence: KV bytes per cached position (attention) or a fixed state
// (DeltaNet, f32). The CPU state allocates exactly this (a test holds them equal); the plan should
// charge it (sequence_memory_bytes below).
struct LayerMemory {
  uint64_t kv_bytes_per_pos = 0;
  uint64_t state_bytes = 0;
};
inline LayerMemory layer_memory(const LayerSpec& l, DType kv_type) {
  LayerMemory m;
  if (l.is_attention()) {
    const AttnSpec& a = l.attn();
    const uint64_t es = kv_type == DType::F16 ? 2 : 4;
    m.kv_bytes_per_pos = static_cast<uint64_t>(a.n_head_kv) * (a.head_dim + a.head_dim_v) * es;
  } else {
    const DeltaSpec& d = l.delta();
    m.state_bytes = static_cast<uint64_t>(d.conv_state_floats() + d.delta_state_floats()) * sizeof(float);
  }
  return m;
}

struct ModelConfig;
// Every layer of a model as the plan and the states should size it, for any architecture fitmoe
// runs: qwen35 / qwen35moe by their layer pattern (with_mtp: the MTP block too, an attention layer
// whose KV cache lives in the drafter's own state), the others all attention. src/model/layer_spec.cpp.
std::vector<LayerSpec> layer_specs(const ModelConfig& c, bool with_mtp = true);
// Per-sequence bytes for n_ctx positions: KV caches of the attention layers plus the recurrent states,
// each of which is kept 1 + n_checkpoints times (the live one and its checkpoints).
uint64_t sequence_memory_bytes(const ModelConfig& c, int64_t n_ctx, DType kv_type, int n_checkpoints, bool with_mtp = true);

}  // namespace fitmoe
