// Per-layer descriptions as plain data: what a layer's mixer is (full attention or a Gated DeltaNet),
// what its FFN is (routed experts, with or without a shared expert, or dense), and the memory each
// kind needs per sequence. A forward pass, the state allocation and (later) the plan all derive from
// these instead of re-deriving the layer pattern from the hyperparameters each on their own.
#pragma once
#include <algorithm>
#include <cstdint>
#include <optional>
#include <variant>
#include <vector>

#include "quant/dtype.h"
#include "runtime/kv_cache.h"

namespace fitmoe {

// How many positions a sliding-window layer's cache holds beyond its window: the tokens of one
// micro-batch, whose queries need the window before the first of them. Gemma's forward pass feeds a
// longer batch in pieces of at most this many tokens.
constexpr int kSlidingMicroBatch = 512;

// Causal softmax attention over a KV cache.
struct AttnSpec {
  int n_head = 0, n_head_kv = 0, head_dim = 0, head_dim_v = 0;
  int n_rot = 0;                        // rotated dims per head (partial RoPE when < head_dim)
  int rope_sections[4] = {0, 0, 0, 0};  // all zero: plain NeoX RoPE; else multi-section (IMRoPE)
  bool q_gate = false;                  // attn_q is [q, gate] per head; output *= sigmoid(gate)
  float scale = 0;                      // on Q.K (1/sqrt(head_dim))
  // gemma4. window > 0: a sliding-window layer; a query at p sees positions p - window + 1 .. p, and
  // its cache is a ring of window + kSlidingMicroBatch positions (kv_positions below).
  int window = 0;
  // >= 0: the layer has no K/V of its own and attends over layer kv_from's cache (Gemma's shared-KV
  // layers): it allocates nothing.
  int kv_from = -1;
  float rope_base = 0;                  // 0: the model's rope base (gemma4: per kind of layer)
  bool rope_freqs = false;              // RoPE angles divided by the rope_freqs tensor (proportional RoPE)
  bool k_eq_v = false;                  // no attn_v: V is the raw K projection
  bool v_norm = false;                  // weightless RMSNorm of each V head
  // Cached positions a state keeps for a context of n_ctx.
  int64_t kv_positions(int64_t n_ctx) const {
    return window > 0 ? std::min<int64_t>(n_ctx, static_cast<int64_t>(window) + kSlidingMicroBatch) : n_ctx;
  }
};

// The FFN's gating nonlinearity: SwiGLU (silu(gate) * up) or Gemma's GeGLU (gelu_tanh(gate) * up,
// through the reference's f16 table: runtime/cpu_gemma4.h).
enum class Activation { SiLU, GeluTanh };

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
  Activation act = Activation::SiLU;
};

struct DenseSpec {
  int n_ff = 0;
  Activation act = Activation::SiLU;
};

struct LayerSpec {
  std::variant<AttnSpec, DeltaSpec> mixer;
  // At least one of moe and dense is set; both (gemma4 MoE layers): the dense FFN runs in parallel
  // with the routed experts and the two are added.
  std::optional<MoeSpec> moe;
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
  int64_t kv_max_positions = 0;  // > 0: the cache holds at most this many positions (a sliding window's ring)
  uint64_t state_bytes = 0;
  uint64_t kv_bytes(int64_t n_ctx) const {
    const int64_t pos = kv_max_positions > 0 ? std::min(n_ctx, kv_max_positions) : n_ctx;
    return kv_bytes_per_pos * static_cast<uint64_t>(pos);
  }
};
inline LayerMemory layer_memory(const LayerSpec& l, const KvCacheType& kv) {
  LayerMemory m;
  if (l.is_attention()) {
    const AttnSpec& a = l.attn();
    // (Without flash attention V takes K's type: KvCache stores both as kv.k then.)
    const DType vt = kv.flash_on() ? kv.v : kv.k;
    if (a.kv_from < 0)
      m.kv_bytes_per_pos = static_cast<uint64_t>(a.n_head_kv) * (kv_row_bytes(kv.k, a.head_dim) + kv_row_bytes(vt, a.head_dim_v));
    m.kv_max_positions = a.window > 0 ? static_cast<int64_t>(a.window) + kSlidingMicroBatch : 0;
  } else {
    const DeltaSpec& d = l.delta();
    m.state_bytes = static_cast<uint64_t>(d.conv_state_floats() + d.delta_state_floats()) * sizeof(float);
  }
  return m;
}

struct ModelConfig;
// Every layer of a model as the plan and the states should size it, for any architecture fitmoe
// runs: qwen35 / qwen35moe by their layer pattern (with_mtp: the MTP block too, an attention layer
// whose KV cache lives in the drafter's own state), gemma4 by its sliding / global / shared-KV
// pattern, the others all attention. src/model/layer_spec.cpp.
std::vector<LayerSpec> layer_specs(const ModelConfig& c, bool with_mtp = true);
// Per-sequence bytes for n_ctx positions: KV caches of the attention layers plus the recurrent states,
// each of which is kept 1 + n_checkpoints times (the live one and its checkpoints).
uint64_t sequence_memory_bytes(const ModelConfig& c, int64_t n_ctx, const KvCacheType& kv, int n_checkpoints,
                               bool with_mtp = true);

}  // namespace fitmoe
