// fitmoe::Scheduler: continuous batching over one engine (include/fitmoe/fitmoe.h says what it promises).
//
// One worker thread. Each step, under the engine's forward lock: admit queued requests onto free
// sequences (the one whose history shares the longest prefix with the prompt, else a new or the least
// recently used one), then one Model::forward_batch over every running request: the next token of each
// decoding one and a chunk of the prompt of prefilling ones (at most prefill_chunk prompt tokens in all
// while anything decodes, so no stream stalls behind a long prompt; alone, the engine's batch size);
// then sample each row that wants logits, feed its text through the request's TextStream, and retire
// what finished (end of turn, stop string, max_tokens, a full context, cancel). A finished request's
// sequence keeps its conversation (and a checkpoint of recurrent state at its end), so the next turn
// reuses it.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include "api/internal.h"
#include "runtime/error.h"

namespace fitmoe {

using Clock = std::chrono::steady_clock;

struct Job::Impl {
  std::vector<int32_t> prompt;
  GenerateOptions options;
  std::function<bool(const std::string&)> on_text;
  std::atomic<bool> cancel{false};
  mutable std::mutex mu;
  std::condition_variable cv;
  bool finished = false;
  std::string error;
  GenerateResult result;
  Clock::time_point submitted = Clock::now();
};

Job::Job(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}

GenerateResult Job::wait() {
  std::unique_lock<std::mutex> lock(impl_->mu);
  impl_->cv.wait(lock, [&] { return impl_->finished; });
  if (!impl_->error.empty()) throw ApiError(impl_->error);
  return impl_->result;
}

bool Job::done() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->finished;
}

void Job::cancel() { impl_->cancel = true; }

struct Scheduler::Impl {
  Engine::Impl& e;
  SchedulerConfig cfg;

  struct Slot {
    std::unique_ptr<Session> session;  // null until first used (or after an error)
    uint64_t last_used = 0;
    bool busy = false;
  };
  // A running request.
  struct Active {
    std::shared_ptr<Job::Impl> job;
    Slot* slot = nullptr;
    std::vector<int32_t> pending;  // prompt tokens still to evaluate
    std::unique_ptr<TextStream> text;
    std::unique_ptr<Sampler> sampler;
    int32_t next = -1;  // the sampled token the next step feeds
    int budget = 0;     // tokens it may generate
    Clock::time_point started, first_token;
    bool done = false;
  };

  std::vector<Slot> slots;
  std::vector<std::unique_ptr<Active>> running;
  std::deque<std::shared_ptr<Job::Impl>> queue;
  mutable std::mutex mu;  // queue, stop, stats
  std::condition_variable cv;
  bool stop = false;
  uint64_t tick = 0;
  Stats stats;
  // Tokens of the steps of the last second, for the aggregate speeds.
  struct StepRecord {
    Clock::time_point at;
    int prompt, generated;
  };
  std::deque<StepRecord> recent;
  std::thread worker;

  Impl(Engine::Impl& engine, const SchedulerConfig& c)
      : e(engine), cfg(c), batch_(e.session.n_batch > 0 ? e.session.n_batch : std::max(512, e.model->plan().options.n_ubatch)) {
    slots.resize(static_cast<size_t>(cfg.n_parallel + cfg.n_cached));
    worker = std::thread([this] { run(); });
  }

  ~Impl() {
    {
      std::lock_guard<std::mutex> lock(mu);
      stop = true;
    }
    cv.notify_all();
    worker.join();
  }

  static size_t common_prefix(const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
    size_t n = 0;
    while (n < a.size() && n < b.size() && a[n] == b[n]) ++n;
    return n;
  }

  // A free sequence for the prompt: the longest shared prefix, else an unused one, else the least
  // recently used (its cached conversation goes).
  Slot* pick_slot(const std::vector<int32_t>& prompt) {
    Slot* best = nullptr;
    size_t best_len = 0;
    for (Slot& s : slots) {
      if (s.busy || !s.session) continue;
      const size_t n = common_prefix(prompt, s.session->history());
      if (n > best_len || (n == best_len && best && n > 0 && s.last_used < best->last_used)) best = &s, best_len = n;
    }
    if (best && best_len > 0) return best;
    for (Slot& s : slots)
      if (!s.busy && !s.session) return &s;
    for (Slot& s : slots)
      if (!s.busy && (!best || s.last_used < best->last_used)) best = &s;
    return best;
  }

  void finish(Active& a, const std::string& error = {}) {
    a.done = true;
    Job::Impl& j = *a.job;
    GenerateResult r;
    if (a.text) {
      a.text->finish();
      r = a.text->result();
    }
    if (a.slot) {
      if (!error.empty()) a.slot->session.reset();  // (its state may be half-written)
      else if (a.slot->session) a.slot->session->checkpoint();  // (the next turn continues from here)
      a.slot->busy = false;
      a.slot->last_used = ++tick;
    }
    const auto now = Clock::now();
    if (a.first_token != Clock::time_point{}) {
      r.seconds_to_first_token = std::chrono::duration<double>(a.first_token - j.submitted).count();
      const double prompt_s = std::chrono::duration<double>(a.first_token - a.started).count();
      const double decode_s = std::chrono::duration<double>(now - a.first_token).count();
      const int evaluated = r.n_prompt - r.n_reused;
      r.prompt_tokens_per_second = prompt_s > 0 ? evaluated / prompt_s : 0;
      r.decode_tokens_per_second = decode_s > 0 && r.n_generated > 1 ? (r.n_generated - 1) / decode_s : 0;
    }
    {
      std::lock_guard<std::mutex> lock(mu);
      stats.requests++;
      stats.generated_tokens += static_cast<uint64_t>(r.n_generated);
    }
    std::lock_guard<std::mutex> lock(j.mu);
    j.result = std::move(r);
    j.error = error;
    j.finished = true;
    j.cv.notify_all();
  }

  // Queued requests onto free sequences (under the forward lock: a rewind may evaluate).
  void admit() {
    while (static_cast<int>(running.size()) < cfg.n_parallel) {
      std::shared_ptr<Job::Impl> job;
      {
        std::lock_guard<std::mutex> lock(mu);
        if (queue.empty()) return;
        job = std::move(queue.front());
        queue.pop_front();
        stats.waiting = static_cast<int>(queue.size());
      }
      auto a = std::make_unique<Active>();
      a->job = job;
      a->started = Clock::now();
      if (job->cancel) {
        a->text = std::make_unique<TextStream>(*e.tok, job->options, nullptr);
        a->text->result().cancelled = true;
        finish(*a);
        continue;
      }
      try {
        Slot* slot = pick_slot(job->prompt);
        slot->busy = true;
        a->slot = slot;
        if (!slot->session) slot->session = std::make_unique<Session>(*e.model, e.session, e.pool.get());
        Session& s = *slot->session;
        const size_t keep = reuse_prefix(s, job->prompt);
        a->pending.assign(job->prompt.begin() + static_cast<long>(keep), job->prompt.end());
        a->text = std::make_unique<TextStream>(*e.tok, job->options, job->on_text);
        a->text->result().n_prompt = static_cast<int>(job->prompt.size());
        a->text->result().n_reused = static_cast<int>(keep);
        a->sampler = std::make_unique<Sampler>(sampler_params(job->options));
        a->budget = std::min(job->options.max_tokens, s.n_ctx() - static_cast<int>(job->prompt.size()));
        {
          std::lock_guard<std::mutex> lock(mu);
          stats.prompt_tokens += job->prompt.size();
          stats.reused_tokens += keep;
        }
        running.push_back(std::move(a));
      } catch (const std::exception& ex) {
        finish(*a, ex.what());
      }
    }
  }

  void step() {
    std::lock_guard<std::mutex> forward_lock(e.forward_mu);
    admit();
    for (auto& a : running)
      if (a->job->cancel) {
        a->text->result().cancelled = true;
        finish(*a);
      }
    std::erase_if(running, [](const std::unique_ptr<Active>& a) { return a->done; });
    if (running.empty()) return;
    // The batch: every decoding request's token, and prompt chunks within the step's budget.
    bool decoding = false;
    for (auto& a : running) decoding = decoding || a->pending.empty();
    int prefill_budget = decoding ? cfg.prefill_chunk : std::max(cfg.prefill_chunk, batch_);
    std::vector<Session::Part> parts;
    std::vector<Active*> who;
    std::vector<int> chunk;  // per part: prompt tokens it takes (0: a decode token)
    int n_prompt_tokens = 0;
    for (auto& a : running) {
      if (a->pending.empty()) {
        parts.push_back({a->slot->session.get(), std::span<const int32_t>(&a->next, 1), 1});
        chunk.push_back(0);
      } else {
        const int n = std::min(prefill_budget, static_cast<int>(a->pending.size()));
        if (n == 0) continue;
        prefill_budget -= n;
        const bool last = n == static_cast<int>(a->pending.size());
        parts.push_back({a->slot->session.get(), std::span<const int32_t>(a->pending.data(), static_cast<size_t>(n)), last ? 1 : 0});
        chunk.push_back(n);
        n_prompt_tokens += n;
      }
      who.push_back(a.get());
    }
    const int n_vocab = e.model->config().n_vocab;
    int n_rows = 0;
    for (const auto& p : parts) n_rows += p.n_logits;
    logits_.resize(static_cast<size_t>(n_rows) * n_vocab);
    try {
      Session::eval_batch(*e.pool, parts, logits_.data());
    } catch (const std::exception& ex) {
      for (Active* a : who) finish(*a, ex.what());
      std::erase_if(running, [](const std::unique_ptr<Active>& a) { return a->done; });
      return;
    }
    int row = 0;
    int n_generated = 0;
    for (size_t i = 0; i < parts.size(); ++i) {
      Active& a = *who[i];
      Session& s = *a.slot->session;
      if (chunk[i] > 0) a.pending.erase(a.pending.begin(), a.pending.begin() + chunk[i]);
      if (!parts[i].n_logits) continue;
      const float* l = logits_.data() + static_cast<size_t>(row++) * n_vocab;
      if (a.first_token == Clock::time_point{}) {
        a.first_token = Clock::now();
        s.checkpoint();  // (the end of the prompt: recurrent state kept for the next turn)
      }
      try {
        const int32_t t = a.sampler->sample(l, n_vocab, s.history());
        ++n_generated;
        const bool go_on = a.text->push(t, l, n_vocab);
        const GenerateResult& r = a.text->result();
        if (!go_on || r.n_generated >= a.budget || s.n_past() + 1 > s.n_ctx()) finish(a);
        else a.next = t;
      } catch (const std::exception& ex) {
        finish(a, ex.what());
      }
    }
    std::erase_if(running, [](const std::unique_ptr<Active>& a) { return a->done; });
    std::lock_guard<std::mutex> lock(mu);
    stats.steps++;
    const auto now = Clock::now();
    recent.push_back({now, n_prompt_tokens, n_generated});
    while (!recent.empty() && now - recent.front().at > std::chrono::seconds(1)) recent.pop_front();
  }

  void run() {
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [&] { return stop || !queue.empty() || !running.empty(); });
        if (stop) break;
      }
      step();
    }
    // Stopping: everything running or waiting ends as cancelled.
    std::lock_guard<std::mutex> forward_lock(e.forward_mu);
    for (auto& a : running) {
      a->text->result().cancelled = true;
      finish(*a);
    }
    running.clear();
    std::deque<std::shared_ptr<Job::Impl>> left;
    {
      std::lock_guard<std::mutex> lock(mu);
      left.swap(queue);
    }
    for (auto& j : left) {
      Active a;
      a.job = j;
      a.text = std::make_unique<TextStream>(*e.tok, j->options, nullptr);
      a.text->result().cancelled = true;
      finish(a);
    }
  }

  std::vector<float> logits_;
  const int batch_;  // prompt tokens of a step when nothing decodes
};

Scheduler::Scheduler(Engine& engine, const SchedulerConfig& c) {
  if (c.n_parallel < 1 || c.n_parallel > 1024) throw ApiError("n_parallel must be from 1 to 1024 (got " + std::to_string(c.n_parallel) + ")");
  if (c.n_cached < 0 || c.n_cached > 1024) throw ApiError("n_cached must be from 0 to 1024 (got " + std::to_string(c.n_cached) + ")");
  if (c.max_queue < 0) throw ApiError("max_queue must not be negative");
  if (c.prefill_chunk < 1) throw ApiError("prefill_chunk must be at least 1");
  impl_ = std::make_unique<Impl>(*engine.impl_, c);
}

Scheduler::~Scheduler() = default;

std::shared_ptr<Job> Scheduler::submit(std::vector<int32_t> prompt, const GenerateOptions& options,
                                       std::function<bool(const std::string&)> on_text) {
  Impl& s = *impl_;
  check_generation(options, prompt, s.e.session.n_ctx, s.e.model->config().n_vocab);
  auto j = std::make_shared<Job::Impl>();
  j->prompt = std::move(prompt);
  j->options = options;
  j->on_text = std::move(on_text);
  {
    std::lock_guard<std::mutex> lock(s.mu);
    if (s.stop) throw ApiError("the scheduler is stopping");
    if (static_cast<int>(s.queue.size()) >= s.cfg.max_queue)
      throw QueueFull("the server is busy: " + std::to_string(s.cfg.max_queue) + " requests are waiting");
    s.queue.push_back(j);
    s.stats.waiting = static_cast<int>(s.queue.size());
  }
  s.cv.notify_all();
  return std::make_shared<Job>(j);
}

Scheduler::Stats Scheduler::stats() const {
  Impl& s = *impl_;
  std::lock_guard<std::mutex> forward_lock(s.e.forward_mu);  // (the sequences' bytes; the worker's order: forward, then mu)
  std::lock_guard<std::mutex> lock(s.mu);
  Stats st = s.stats;
  st.waiting = static_cast<int>(s.queue.size());
  st.running = 0;
  st.sequences = 0;
  st.state_bytes = 0;
  for (const auto& slot : s.slots) {
    st.running += slot.busy;
    if (slot.session) {
      ++st.sequences;
      st.state_bytes += slot.session->state().bytes();
    }
  }
  if (s.recent.size() >= 2) {
    const double span = std::chrono::duration<double>(s.recent.back().at - s.recent.front().at).count();
    int p = 0, g = 0;
    for (size_t i = 1; i < s.recent.size(); ++i) p += s.recent[i].prompt, g += s.recent[i].generated;
    if (span > 0) st.prompt_tokens_per_second = p / span, st.decode_tokens_per_second = g / span;
  }
  return st;
}

}  // namespace fitmoe
