#include "runtime/session.h"

#include <algorithm>
#include <thread>

#include "model/layer_spec.h"
#include "runtime/error.h"
#include "runtime/plan.h"

namespace fitmoe {

// Threads when the caller leaves it to us: every core on the CPU; with a GPU every core but one, which
// is left to the CUDA driver and the OS (on the H200 host, hybrid decode ran at 71 tok/s on 15 of 16
// cores and 61 +- 3 on all 16: a preempted pool thread stalls every layer).
int default_threads(const Model& model, int requested) {
  if (requested > 0) return requested;
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return model.on_gpu() ? std::max(1, cores - 1) : cores;
}

Session::Session(const Model& model, const SessionOptions& opt, ThreadPool* pool)
    : model_(model),
      opt_(opt),
      own_pool_(pool ? nullptr : std::make_unique<ThreadPool>(default_threads(model, opt.n_threads))),
      pool_(pool ? pool : own_pool_.get()) {
  if (opt.n_ctx <= 0) throw Error("context size must be positive");
  if (opt_.kv.automatic) opt_.kv = model.plan().options.kv;  // the plan's choice
  // A CPU run keeps the KV cache (and any recurrent state with its checkpoints) in host memory: fail
  // with the figures, not with the OOM killer. Per layer kind: qwen35's DeltaNet layers hold no KV.
  if (!model.on_gpu())
    check_host_memory(sequence_memory_bytes(model.config(), opt.n_ctx, opt_.kv, StateOptions{}.max_checkpoints, false),
                      "the KV cache of " + std::to_string(opt.n_ctx) + " tokens");
  // Automatic batch: the plan's GPU micro-batch (larger when prefill streams host experts), else 512.
  if (opt_.n_batch <= 0) opt_.n_batch = std::max(512, model.plan().options.n_ubatch);
  StateOptions so;
  so.n_ctx = opt.n_ctx;
  so.kv = opt_.kv;
  state_ = model.new_state(so);
}

const std::vector<float>& Session::eval(std::span<const int32_t> tokens, int n_logits) {
  const int n = static_cast<int>(tokens.size());
  const int n_vocab = model_.config().n_vocab;
  n_logits = std::clamp(n_logits, 0, n);
  std::vector<float>& logits = logits_;
  logits.resize(static_cast<size_t>(n_logits) * n_vocab);  // (every row is written below)
  for (int b = 0; b < n; b += opt_.n_batch) {
    const int len = std::min(opt_.n_batch, n - b);
    // Rows of this batch that fall among the last n_logits positions.
    const int first_wanted = n - n_logits;
    const int want = std::max(0, b + len - std::max(first_wanted, b));
    float* dst = want ? logits.data() + static_cast<size_t>(b + len - want - first_wanted) * n_vocab : nullptr;
    model_.forward(*state_, *pool_, tokens.subspan(b, len), want, dst);
  }
  history_.insert(history_.end(), tokens.begin(), tokens.end());
  // A recurrent state cannot be rewound, only restored: keep one at the end of each prompt-sized
  // batch (a chat turn's prompt, a generation's prompt), so that rewinding into what came after it
  // re-evaluates from here instead of from the start. Decode steps take none (for the 35B shape a
  // copy is 63 MiB).
  if (n > 1) state_->checkpoint();
  return logits;
}

void Session::truncate(int n) {
  n = std::clamp(n, 0, static_cast<int>(history_.size()));
  state_->truncate(n);
  history_.resize(static_cast<size_t>(n));
  // A recurrent state lands at its nearest checkpoint at or below n: feed the tokens between it and n
  // again (no logits needed), then keep a checkpoint at n for the next rewind.
  const int at = state_->n_past();
  if (at < n) {
    for (int b = at; b < n; b += opt_.n_batch) {
      const int len = std::min(opt_.n_batch, n - b);
      model_.forward(*state_, *pool_, std::span<const int32_t>(history_.data() + b, static_cast<size_t>(len)), 0, nullptr);
    }
    state_->checkpoint();
  }
}

void Session::checkpoint() { state_->checkpoint(); }

void Session::eval_batch(ThreadPool& pool, std::span<const Part> parts, float* logits) {
  if (parts.empty()) return;
  std::vector<BatchSeq> seqs;
  for (const Part& p : parts) seqs.push_back({p.session->state_.get(), p.tokens, p.n_logits});
  parts[0].session->model_.forward_batch(pool, seqs, logits);
  for (const Part& p : parts) p.session->history_.insert(p.session->history_.end(), p.tokens.begin(), p.tokens.end());
}

std::vector<int32_t> Session::generate(std::span<const int32_t> prompt, int n_predict, Sampler& sampler,
                                       const std::function<bool(int32_t)>& on_token,
                                       std::span<const int32_t> stop_tokens, GenerationStats* stats) {
  using clock = std::chrono::steady_clock;
  std::vector<int32_t> out;
  if (prompt.empty()) throw Error("generate needs at least one prompt token");
  // Checked before any of it is computed.
  if (static_cast<int>(prompt.size()) > n_ctx() - n_past())
    throw Error("the prompt is " + std::to_string(prompt.size()) + " tokens, longer than the " +
                (n_past() ? "room left in the context (" + std::to_string(n_ctx() - n_past()) + " of " : std::string("context (")) +
                std::to_string(n_ctx()) + " tokens; -c sets it)");
  const int n_vocab = model_.config().n_vocab;
  auto t0 = clock::now();
  const std::vector<float>* logits = &eval(prompt, 1);
  auto t1 = clock::now();
  double gen_seconds = 0;
  bool context_full = false;
  for (int i = 0; i < n_predict; ++i) {
    int32_t tok = sampler.sample(logits->data(), n_vocab, history_);
    out.push_back(tok);
    bool go_on = on_token ? on_token(tok) : true;
    if (std::find(stop_tokens.begin(), stop_tokens.end(), tok) != stop_tokens.end()) break;
    if (!go_on || i + 1 == n_predict) break;
    if (n_past() >= n_ctx()) {
      context_full = true;
      break;
    }
    auto s = clock::now();
    logits = &eval(std::span<const int32_t>(&tok, 1), 1);
    gen_seconds += std::chrono::duration<double>(clock::now() - s).count();
  }
  if (stats) {
    stats->n_prompt = static_cast<int>(prompt.size());
    stats->prompt_seconds = std::chrono::duration<double>(t1 - t0).count();
    stats->n_generated = static_cast<int>(out.size());
    stats->n_decoded = std::max(0, stats->n_generated - 1);
    stats->context_full = context_full;
    stats->generate_seconds = gen_seconds;
  }
  return out;
}

}  // namespace fitmoe
