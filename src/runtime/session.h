// A session is what a caller drives: one model, one sequence state, a thread pool. It evaluates
// batches (prefill), single tokens (decode) and runs generation loops with a sampler.
#pragma once
#include <chrono>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "model/model.h"
#include "runtime/thread_pool.h"
#include "text/sampling.h"

namespace fitmoe {

struct SessionOptions {
  int n_threads = 0;       // 0: all cores (all but one when the model runs on a GPU)
  int n_ctx = 4096;
  KvCacheType kv;          // -ctk / -ctv / -fa
  int n_batch = 512;       // prompt tokens per forward batch
};

// n_generated counts every token generate() produced (the first one comes from the prompt's logits);
// decode speed counts the forward passes of generated tokens, n_decoded = n_generated - 1 of them.
struct GenerationStats {
  int n_prompt = 0, n_generated = 0, n_decoded = 0;
  double prompt_seconds = 0, generate_seconds = 0;
  bool context_full = false;  // generation stopped because the context had no room left
  double prompt_tps() const { return prompt_seconds > 0 ? n_prompt / prompt_seconds : 0; }
  double generate_tps() const { return generate_seconds > 0 ? n_decoded / generate_seconds : 0; }
};

// The threads of a pool when the caller leaves it to us (requested <= 0): every core on the CPU, all
// but one with a GPU.
int default_threads(const Model& model, int requested);

class Session {
 public:
  // pool: a thread pool shared by several sessions of one model (null: the session makes its own, of
  // opt.n_threads). Sessions sharing one pool must not evaluate at the same time.
  Session(const Model& model, const SessionOptions& opt, ThreadPool* pool = nullptr);

  const Model& model() const { return model_; }
  ModelState& state() { return *state_; }
  ThreadPool& pool() { return *pool_; }
  int n_past() const { return state_->n_past(); }
  int n_ctx() const { return state_->n_ctx(); }

  // Evaluates tokens in batches of at most n_batch; returns the logits of the last `n_logits`
  // positions ([n_logits][n_vocab]). n_logits may exceed one batch. The vector is the session's own,
  // overwritten by the next eval (copy it to keep it): a decode step then neither allocates nor clears
  // a vocabulary-sized row.
  const std::vector<float>& eval(std::span<const int32_t> tokens, int n_logits = 1);

  // Tokens whose K/V the state holds, in order (what eval() and generate() fed).
  const std::vector<int32_t>& history() const { return history_; }
  // The last row of logits eval() returned (in generate()'s callback: the row its token was drawn from).
  const float* last_logits() const { return logits_.empty() ? nullptr : logits_.data() + logits_.size() - model_.config().n_vocab; }
  // Forgets every position from n on (chat rewinds to the part of a conversation that is unchanged).
  // With recurrent layers (qwen35) the state is restored from its nearest checkpoint at or below n and
  // the history from there to n is evaluated again, so afterwards n_past() == n either way.
  void truncate(int n);
  // Keeps a checkpoint of the state at the current position (recurrent layers; a no-op for a KV cache),
  // so that a later truncate() to here needs no re-evaluation. eval() keeps one after every batch of
  // more than one token; chat should call this at the end of each answer.
  void checkpoint();

  // One forward pass over several sessions of one model (Model::forward_batch): each evaluates its
  // tokens (appended to its history) and the logits of its last n_logits positions go to `logits` in
  // order. The caller keeps each part within its context and, for recurrent states, checkpoints where
  // it wants.
  struct Part {
    Session* session;
    std::span<const int32_t> tokens;
    int n_logits;
  };
  static void eval_batch(ThreadPool& pool, std::span<const Part> parts, float* logits);

  // Prompt in batches, then one token per step until n_predict tokens, a stop token or a callback
  // returning false. on_token sees each generated id.
  std::vector<int32_t> generate(std::span<const int32_t> prompt, int n_predict, Sampler& sampler,
                                const std::function<bool(int32_t)>& on_token = nullptr,
                                std::span<const int32_t> stop_tokens = {}, GenerationStats* stats = nullptr);

 private:
  const Model& model_;
  SessionOptions opt_;
  std::unique_ptr<ThreadPool> own_pool_;
  ThreadPool* pool_;
  std::unique_ptr<ModelState> state_;
  std::vector<int32_t> history_;
  std::vector<float> logits_;  // what eval returns
};

}  // namespace fitmoe
