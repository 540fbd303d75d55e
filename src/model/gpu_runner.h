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
  // Model::forward_impl's contract (a batch of one or more sequences' rows).
  virtual void forward(ThreadPool& pool, const BatchRows& batch, float* logits) = 0;
  virtual std::string memory_report() const = 0;
  virtual uint64_t memory_used() const = 0;
  virtual RoutingGuessStats routing_guess_stats() const { return {}; }
};

}  // namespace fitmoe
