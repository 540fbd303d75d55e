#include "cuda/engine.h"
#include "cuda/workspace.h"

#include <algorithm>
#include <cstdlib>

#include "runtime/error.h"

namespace fitmoe::gpu {

Engine::Engine(const ModelConfig& c_, const Plan& plan_)
    : c(c_), plan(plan_), mem(plan_.budget - plan_.reserve), ubatch(std::max(1, plan_.options.n_ubatch)),
      chunk_experts(std::max(1, plan_.options.prefill_chunk_experts)), sw(Switches::from(plan_.options)) {
  if (c.n_expert_used > 32)
    throw Error("the GPU engine routes at most 32 experts per token; this model uses " +
                std::to_string(c.n_expert_used) + " (use --gpu none)");
  stream = gpu::create_stream();
}

Engine::~Engine() {
  gpu::sync_stream(stream);
  ws.reset();
  gpu::destroy_stream(stream);
  host_prof.report();
}

uint8_t* Engine::upload(const void* src, size_t bytes, const std::string& what) {
  auto* d = static_cast<uint8_t*>(mem.alloc(bytes, what));
  gpu::copy_h2d(d, src, bytes, stream);
  return d;
}

std::string no_expert_message(int32_t e) {
  if (e == -1) return "the router chose no expert: its logits are NaN (NaN or infinite weights or activations)";
  return "router chose an expert out of range (" + std::to_string(e) + ")";
}

}  // namespace fitmoe::gpu
