// Qwen3 / Qwen3-MoE weights, shared by the CPU forward pass (qwen3.cpp) and the GPU one
// (src/cuda/qwen3_gpu.cpp).
#pragma once
#include <memory>
#include <vector>

#include "model/gpu_runner.h"
#include "model/model.h"
#include "runtime/cpu_ops.h"

namespace fitmoe {

struct Qwen3Layer {
  Weight attn_norm, wq, wk, wv, wo, q_norm, k_norm, ffn_norm;
  Weight ffn_gate, ffn_up, ffn_down;               // dense
  Weight router;                                   // MoE: ffn_gate_inp, F32 [n_embd, n_expert]
  cpu::ExpertWeights experts;
};

struct Qwen3Weights {
  Weight tok_embd, output_norm, output;
  std::vector<Qwen3Layer> layers;
};

#if FITMOE_CUDA
std::unique_ptr<GpuRunner> make_qwen3_gpu(const Qwen3Weights& w, const ModelConfig& c, const Plan& plan,
                                          const LoadOptions& opt);
#endif

}  // namespace fitmoe
