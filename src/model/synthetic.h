// Full-shape synthetic models: real architectures, shapes and quantization mixes with random weights,
// written straight in quantized form (no f32 master) at disk speed. Used for benchmarks and demos,
// since real weights cannot be downloaded everywhere fitmoe is developed.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace fitmoe {

class ThreadPool;

struct SyntheticSpec {
  std::string arch = "qwen3moe";   // qwen3moe | qwen3 | qwen35moe | qwen35
  std::string preset = "tiny";     // qwen3moe: 30b-a3b | tiny | tiny-wide; qwen3: 0.6b | tiny;
                                   // qwen35moe: 35b-a3b | tiny | tiny-mtp; qwen35: tiny
  std::string type = "q4_k_m";     // q4_k_m | q6_k | q8_0 | q4_0 | f16 | bf16 | f32
  int layers = 0;                  // 0: the preset's; else cut to this many layers (full width kept)
  float router_skew = 0.0f;        // 0: uniform routing; > 0: Zipf-like expert popularity
  uint64_t seed = 1;
};

struct SyntheticSummary {
  uint64_t bytes = 0;
  int n_tensors = 0;
  std::string description;         // one line per notable fact (shape, mix, routing popularity)
};

// Names of the presets per architecture, for --help and errors.
std::vector<std::string> synthetic_presets(const std::string& arch);

// Writes the model; progress(done_bytes, total_bytes). Throws fitmoe::Error on a bad spec or I/O error.
SyntheticSummary write_synthetic_model(const SyntheticSpec& spec, const std::string& path, ThreadPool& pool,
                                       const std::function<void(uint64_t, uint64_t)>& progress = nullptr);

}  // namespace fitmoe
