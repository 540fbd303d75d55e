// The GPU side of a model: an architecture with a CUDA forward pass implements this (in src/cuda/),
// and its Model delegates to it when the plan puts the model on the GPU.
#pragma once
#include <memory>
#include <span>

#include "model/model.h"

namespace fitmoe {

class GpuRunner {
 public:
  virtual ~GpuRunner() = default;
  virtual std::unique_ptr<ModelState> new_state(const StateOptions& opt) = 0;
  virtual void forward(ModelState& state, ThreadPool& pool, std::span<const int32_t> tokens, int n_logits,
                       float* logits) = 0;
  virtual std::string memory_report() const = 0;
  virtual RoutingGuessStats routing_guess_stats() const { return {}; }
};

}  // namespace fitmoe
