// fitmoe's public C++ API: load a GGUF model under a memory budget (the plan places every tensor), read
// the plan, open sequences, evaluate and generate with callbacks. This header is the whole contract: it
// includes only the standard library, and everything behind it may change.
//
//   auto engine = fitmoe::Engine::load({.model_path = "Qwen3.6-35B-A3B-Q4_K_M.gguf", .vram_budget = 8ull << 30,
//                                       .n_ctx = 32768});
//   std::cout << engine->plan_report();
//   auto seq = engine->new_sequence();
//   auto prompt = engine->tokenize(engine->apply_chat_template({{"user", "Hello"}}, true), true);
//   seq->generate(prompt, {.max_tokens = 128, .temperature = 0}, [](const std::string& text) {
//     std::cout << text << std::flush;
//     return true;  // false stops
//   });
//
// Errors (a corrupt file, an unknown architecture, a budget too small, a bad argument) throw
// fitmoe::ApiError with one line naming the problem.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace fitmoe {

struct ApiError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct LoadConfig {
  std::string model_path;
  uint64_t vram_budget = 0;       // bytes for the whole process on the GPU; 0: the card's free memory
  int n_ctx = 4096;               // the context the plan reserves a KV cache for
  bool use_gpu = true;            // false: the CPU only
  std::string cache_type_k = "auto", cache_type_v = "auto";  // f16, q8_0, tq3, ... (auto: the plan picks)
  int n_threads = 0;              // 0: all cores (all but one with a GPU)
};

struct Message {
  std::string role;     // system, user, assistant, tool
  std::string content;
};

struct GenerateOptions {
  int max_tokens = 256;
  float temperature = 0.8f;  // <= 0: greedy
  int top_k = 40;
  float top_p = 0.95f;
  float min_p = 0.05f;
  uint64_t seed = 0xF17F00Du;
  std::vector<std::string> stop;  // stop strings (not included in the text)
};

struct GenerateResult {
  std::string text;
  int n_prompt = 0, n_generated = 0, n_reused = 0;  // n_reused: prompt tokens the sequence held already
  bool stopped_at_end = false;                      // an end-of-turn token or a stop string ended it
  double prompt_tokens_per_second = 0, decode_tokens_per_second = 0;
};

class Sequence;

class Engine {
 public:
  static std::unique_ptr<Engine> load(const LoadConfig& config);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  std::string plan_report() const;  // where every tensor lives and why, the predicted speed
  std::string architecture() const;
  int n_vocab() const;
  bool on_gpu() const;

  std::vector<int32_t> tokenize(std::string_view text, bool add_special) const;
  std::string detokenize(std::span<const int32_t> tokens) const;
  // The GGUF's chat template (ChatML when it has none) applied to a conversation.
  std::string apply_chat_template(const std::vector<Message>& messages, bool add_generation_prompt) const;

  // A sequence with its own KV cache of n_ctx positions (0: the configured context).
  std::unique_ptr<Sequence> new_sequence(int n_ctx = 0) const;

  struct Impl;

 private:
  explicit Engine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

class Sequence {
 public:
  ~Sequence();
  Sequence(const Sequence&) = delete;
  Sequence& operator=(const Sequence&) = delete;

  int n_past() const;
  int n_ctx() const;
  // Evaluates tokens after what the sequence holds; returns the logits of the last n_logits positions.
  std::vector<float> eval(std::span<const int32_t> tokens, int n_logits = 1);
  // Forgets positions from n on.
  void truncate(int n);
  // Generation from a prompt: the part of the prompt the sequence holds already is not evaluated again.
  // on_text gets each piece of text as it becomes final (valid UTF-8); false from it stops.
  GenerateResult generate(std::span<const int32_t> prompt, const GenerateOptions& options,
                          const std::function<bool(const std::string&)>& on_text = nullptr);

  struct Impl;

 private:
  friend class Engine;
  explicit Sequence(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace fitmoe
