// Gemma 4 (gemma4: the dense models and the 26B-A4B MoE): weights and layer descriptions. The CPU
// forward pass is in gemma4.cpp.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "model/layer_spec.h"
#include "model/model.h"
#include "runtime/cpu_ops.h"

namespace fitmoe {

struct Gemma4Layer {
  LayerSpec spec;
  Weight attn_norm, wq, wk, wv, wo, q_norm, k_norm, post_attn_norm;  // wv empty when K = V; wk, wv, k_norm empty on shared-KV layers
  // The dense GeGLU FFN (every layer) and its norms: ffn_norm before it; post_ffw_norm_1 after it on
  // MoE layers, where it is one of two branches.
  Weight ffn_norm, ffn_gate, ffn_up, ffn_down, post_ffw_norm_1;
  // MoE layers: router on RMSNorm(x) / sqrt(n_embd) * router_scale, GeGLU experts (gate_up fused or
  // gate and up), per-expert output scale, the branch's norms.
  Weight pre_ffw_norm_2, router, router_scale, expert_scale, post_ffw_norm_2;
  cpu::ExpertWeights experts;
  Weight post_ffw_norm, out_scale;  // after the FFN (both branches summed); the layer's output scalar
};

struct Gemma4Weights {
  Weight tok_embd, output_norm, output, rope_freqs;  // output = tok_embd when tied; rope_freqs optional
  std::vector<Gemma4Layer> layers;
};

// Every layer as the config describes it: sliding (window, the sliding head width, KV heads and RoPE
// base) or global (rope_freqs, K = V where the file has no attn_v), and for the last
// shared_kv_layers layers the layer whose KV they read (the reference's rule: the last layer with its
// own KV, minus one more for a sliding layer, i.e. the last own-KV layer of each kind when those end
// [sliding, global]).
std::vector<LayerSpec> gemma4_layer_specs(const ModelConfig& c);
// "25 sliding (window 1024) + 5 global at 5, 11, ...; shared KV: ..." for `fitmoe info`.
std::string gemma4_layer_pattern(const ModelConfig& c);

#if FITMOE_CUDA
// The GPU forward pass (src/cuda/gemma4_gpu.cpp).
class GpuRunner;
std::unique_ptr<GpuRunner> make_gemma4_gpu(const Gemma4Weights& w, const ModelConfig& c, const Plan& plan,
                                           const LoadOptions& opt);
#endif

}  // namespace fitmoe
