// fitmoe's public C++ API: load a GGUF model under a memory budget (the plan places every tensor), read
// the plan, open sequences, evaluate and generate with callbacks. This header is the whole contract: it
// includes only the standard library, and everything behind it may change.
//
//   auto engine = fitmoe::Engine::load({.model_path = "Qwen3.6-35B-A3B-Q4_K_M.gguf", .vram_budget = 8ull << 30,
//                                       .n_ctx = 32768});
//   std::cout << engine->plan_report();
//   auto seq = engine->new_sequence();   // one sequence driven by the caller, or several requests at once:
//   //   fitmoe::Scheduler sched(*engine, {.n_parallel = 4});  auto job = sched.submit(prompt, {}); job->wait();
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
#include <utility>
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
  int n_seq = 1;                  // sequences held at once (a Scheduler's n_parallel + n_cached): the plan
                                  // reserves a KV cache of n_ctx for each
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
  float repeat_penalty = 1.0f;    // 1: off
  float presence_penalty = 0.0f, frequency_penalty = 0.0f;  // OpenAI's, over the last 64 tokens
  std::vector<std::string> stop;  // stop strings (not included in the text)
  int top_logprobs = -1;          // >= 0: each token's log-probability and that many alternatives (<= 20)
};

// A generated token's log-probability (of the model's distribution, before sampling's cut-offs) and
// the most likely alternatives.
struct TokenLogprob {
  int32_t id = 0;
  std::string text;  // the token's bytes (may be part of a UTF-8 character)
  float logprob = 0;
  std::vector<std::pair<int32_t, float>> top;  // (id, logprob), most likely first
};

struct GenerateResult {
  std::string text;
  int n_prompt = 0, n_generated = 0, n_reused = 0;  // n_reused: prompt tokens the sequence held already
  bool stopped_at_end = false;                      // an end-of-turn token or a stop string ended it
  std::string stop_string;                          // the stop string that ended it, if one did
  bool cancelled = false;                           // the callback or Job::cancel stopped it
  double prompt_tokens_per_second = 0, decode_tokens_per_second = 0;
  double seconds_to_first_token = 0;
  std::vector<TokenLogprob> logprobs;               // per generated token, when top_logprobs >= 0
};

// submit() on a full queue.
struct QueueFull : ApiError {
  using ApiError::ApiError;
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
  // The same from JSON: messages as OpenAI's list of objects (role, content as a string or a list of
  // parts, and any further fields the template reads: tool_calls, name, tool_call_id,
  // reasoning_content), context as an object of further template variables (tools, enable_thinking,
  // ...). Bad JSON or a template error throws ApiError.
  std::string apply_chat_template_json(std::string_view messages_json, std::string_view context_json,
                                       bool add_generation_prompt) const;
  std::string chat_template() const;  // the template's source
  int n_ctx() const;                  // the configured context of a sequence
  uint64_t gpu_bytes_used() const;    // the engine's GPU allocations (0 on the CPU)

  // A sequence with its own KV cache of n_ctx positions (0: the configured context).
  std::unique_ptr<Sequence> new_sequence(int n_ctx = 0) const;

  struct Impl;

 private:
  friend struct EngineAccess;
  friend class Scheduler;
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

// Several generations at once on one engine (what `fitmoe serve --parallel N` runs): continuous
// batching. Each step of its worker thread evaluates one token of every running request and, in
// chunks of at most prefill_chunk tokens, the prompt of one that is starting, in one batch; a queued
// request starts at the next step a sequence is free, a finished one leaves. A request whose prompt
// begins with what a sequence already evaluated (running before, or kept after it finished) continues
// from there: the next turn of a conversation costs only its new tokens, for KV caches and for
// recurrent and sliding-window state (checkpoints at the end of each prompt and each answer).
// Generations, Sequences and Schedulers of one engine take turns on it, one step at a time.
struct SchedulerConfig {
  int n_parallel = 1;       // requests decoded together (each has its sequence)
  int n_cached = 0;         // further sequences that only keep finished conversations for reuse
  int max_queue = 64;       // requests waiting beyond the running ones; submit() refuses more
  int prefill_chunk = 256;  // prompt tokens per step while other requests decode (alone: the engine's batch)
};

class Job {
 public:
  // Blocks until the generation has ended; its error, if any, is thrown as ApiError.
  GenerateResult wait();
  bool done() const;
  // Stops the generation at its next step (what a client that disconnects needs).
  void cancel();

  struct Impl;
  explicit Job(std::shared_ptr<Impl> impl);

 private:
  std::shared_ptr<Impl> impl_;
};

class Scheduler {
 public:
  Scheduler(Engine& engine, const SchedulerConfig& config);
  ~Scheduler();  // cancels what runs and what waits, then stops its thread
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  // Queues a generation (the prompt is checked here: empty, too long for the context or with ids
  // outside the vocabulary is an ApiError; a full queue is QueueFull). on_text runs on the
  // scheduler's thread with each piece of final text (keep it short); false from it cancels.
  std::shared_ptr<Job> submit(std::vector<int32_t> prompt, const GenerateOptions& options,
                              std::function<bool(const std::string&)> on_text = nullptr);

  struct Stats {
    int running = 0, waiting = 0, sequences = 0;
    uint64_t requests = 0, prompt_tokens = 0, reused_tokens = 0, generated_tokens = 0, steps = 0;
    double prompt_tokens_per_second = 0, decode_tokens_per_second = 0;  // of the last second's steps, all requests
    uint64_t state_bytes = 0;  // the sequences' KV caches and state
  };
  Stats stats() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace fitmoe
