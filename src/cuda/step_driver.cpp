#include "cuda/step_driver.h"

#include "cuda/linear.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <exception>
#include <vector>

namespace fitmoe::gpu {

void finish_layer(Step& s, MoeExecutor* moe, bool moe_layer, int l, int nt, bool host_rows, const float* next_norm,
                  const GWeight* next_input, int n_embd, float eps) {
  Workspace& ws = s.ws;
  float* xn = next_norm ? ws.xn : nullptr;
  void* xq = next_norm ? xn_q_for(s, *next_input, nt) : nullptr;
  if (moe_layer)
    moe->combine(s, l, nt, host_rows, next_norm, xn, xq);
  else
    residual_norm(ws.x, ws.y, nullptr, nullptr, 0, next_norm, xn, n_embd, nt, eps, s.e.stream, xq, nullptr);
  s.e.prof.mark("combine + residual + norm", s.e.stream);
}

void output_head(Step& s, const float* output_norm, const GWeight& output, int n_embd, int n_vocab, float eps, int nt,
                 int n_out, int r0) {
  Workspace& ws = s.ws;
  void* const stream = s.e.stream;
  const float* last = ws.x + static_cast<int64_t>(nt - n_out + r0) * n_embd;
  const int nr = std::min(64, n_out - r0);
  ws.xn_q_valid = false;
  rms_norm(last, output_norm, ws.xn, n_embd, nr, eps, n_embd, n_embd, stream);
  linear(s, output, ws.xn, nr, ws.logits, n_vocab);
  copy_d2h(ws.h_out, ws.logits, sizeof(float) * nr * n_vocab, stream);
  s.e.prof.mark("output head", stream);
}

namespace {

// Sets every layer's hand-over flag to the current epoch when a step is left by an exception, so
// that no kernel is left waiting for a flag the host will never set (the rows are then garbage, but
// the error is already on its way to the caller).
class FlagGuard {
 public:
  FlagGuard(Workspace& ws, int n_layer) : ws_(ws), n_(n_layer), exceptions_(std::uncaught_exceptions()) {}
  ~FlagGuard() {
    if (std::uncaught_exceptions() > exceptions_)
      for (int l = 0; l < n_; ++l) std::atomic_ref<unsigned>(ws_.h_flags[l]).store(ws_.epoch, std::memory_order_release);
  }

 private:
  Workspace& ws_;
  int n_, exceptions_;
};

// Decode steps replay CUDA graphs: one per stretch of GPU work between two points where the CPU
// must act (the host experts of a hybrid layer). Captured at the first step of a state, and again
// when the decode attention variant changes with the cache length; positions, tokens and expert
// choices live in device memory, so the same graphs serve every step in between.
class Segments {
 public:
  Segments(std::vector<void*>& graphs, void* stream) : graphs_(graphs), stream_(stream) {}
  void begin() {
    replay_ = idx_ < graphs_.size() && graphs_[idx_];
    if (!replay_) gpu::begin_capture(stream_);
  }
  void end() {
    if (!replay_) {
      if (graphs_.size() <= idx_) graphs_.resize(idx_ + 1, nullptr);
      graphs_[idx_] = gpu::end_capture(stream_);
    }
    gpu::launch_graph(graphs_[idx_], stream_);
    ++idx_;
  }
  bool recording() const { return !replay_; }

 private:
  std::vector<void*>& graphs_;
  void* stream_;
  size_t idx_ = 0;
  bool replay_ = false;
};

}  // namespace

void StepDriver::forward(GpuState& st, ThreadPool& pool, std::span<const int32_t> tokens, int n_logits, float* logits) {
  Step s{e_, st, st.ws, pool};
  const int T = static_cast<int>(tokens.size());
  const int first_logit = T - n_logits;
  for (int t0 = 0; t0 < T; t0 += st.ws.ub) {
    const int nt = std::min(st.ws.ub, T - t0);
    const int want_from = std::max(first_logit, t0);
    const int n_out = std::max(0, t0 + nt - want_from);
    micro_batch(s, tokens.subspan(t0, nt), st.n_past() + t0, n_out,
                n_out ? logits + static_cast<size_t>(want_from - first_logit) * e_.c.n_vocab : nullptr);
  }
}

// Inputs of a micro-batch: positions, the epoch, and the embedding rows (the program's). Host work
// first, then capturable uploads.
void StepDriver::prepare_inputs(Step& s, std::span<const int32_t> tokens, int pos0) {
  Workspace& ws = s.ws;
  const int nt = static_cast<int>(tokens.size());
  gpu::sync_stream(e_.stream);  // the pinned inputs may still be read by the previous micro-batch
  for (int t = 0; t < nt; ++t) ws.h_pos[t] = pos0 + t;
  *ws.h_epoch = ++ws.epoch;
  prog_.embed_host(s, tokens);
}

void StepDriver::upload_inputs(Step& s, int nt) {
  Workspace& ws = s.ws;
  gpu::copy_h2d(ws.pos, ws.h_pos, sizeof(int32_t) * nt, e_.stream);
  gpu::copy_h2d(ws.epoch_dev, ws.h_epoch, sizeof(unsigned), e_.stream);
  prog_.inputs(s, nt);
}

void StepDriver::decode_step_graphs(Step& s, int32_t token, int pos0, float* logits) {
  Workspace& ws = s.ws;
  DecodeGraphs& dg = s.st.graphs;
  const int L = e_.c.n_layer;
  prepare_inputs(s, std::span<const int32_t>(&token, 1), pos0);
  // The attention kernel a graph holds depends on the cache length: capture again when it changes.
  const int variant = gpu::attention_decode_variant(pos0 + 1);
  if (variant != dg.variant) {
    dg.clear();
    dg.variant = variant;
  }
  const FlagGuard guard(ws, L);
  Segments seg(dg.graphs, e_.stream);
  seg.begin();
  if (seg.recording()) {
    upload_inputs(s, 1);
    prog_.front(s, 0, 1, pos0);
  }
  // A hybrid layer ends a graph; the CPU runs its experts only once the next graph (which waits for
  // them, then goes on to the next hybrid layer's routing) is queued, so the GPU never waits for a
  // launch.
  int host_layer = -1;  // a hybrid layer whose CPU experts are still to run
  for (int l = 0; l < L; ++l) {
    if (moe_.hybrid(l)) {
      seg.end();
      if (host_layer >= 0) moe_.host_part(s, host_layer, 1);
      host_layer = l;
      seg.begin();
    }
    if (!seg.recording()) continue;
    prog_.back(s, l, 1, moe_.hybrid(l));
    if (l + 1 < L) {
      prog_.front(s, l + 1, 1, pos0);
    } else if (logits) {
      prog_.head(s, 1, 1, 0);
    }
  }
  seg.end();
  if (host_layer >= 0) moe_.host_part(s, host_layer, 1);
  gpu::sync_stream(e_.stream);
  if (logits) std::memcpy(logits, ws.h_out, sizeof(float) * e_.c.n_vocab);
  if (ws.h_stamps) {
    std::vector<int> hyb;
    for (int l = 0; l < L; ++l)
      if (moe_.hybrid(l)) hyb.push_back(l);
    e_.host_prof.add_step(ws.h_stamps, hyb);
    std::memset(ws.h_stamps, 0, sizeof(unsigned long long) * 2 * L);  // (the stream is idle here)
  }
}

void StepDriver::micro_batch(Step& s, std::span<const int32_t> tokens, int pos0, int n_out, float* logits) {
  Workspace& ws = s.ws;
  const int nt = static_cast<int>(tokens.size());
  const int L = e_.c.n_layer;
  // Graphs are captured with the output head, so only steps that want logits replay them.
  if (nt == 1 && n_out == 1 && graphs_ok_) return decode_step_graphs(s, tokens[0], pos0, logits);
  prepare_inputs(s, tokens, pos0);
  e_.prof.begin(e_.stream, nt);
  upload_inputs(s, nt);
  e_.prof.mark("inputs + first norm", e_.stream);
  if (nt > gpu::kMaxVecTokens) streamer_.start(s, nt);
  // Decode-sized micro-batches queue the GPU work up to the next hybrid layer's routing before the
  // CPU runs a hybrid layer's experts (as the graphs do); prefill runs layer by layer. If anything
  // throws while the GPU may be waiting for a flag, the flags are set so that it can finish.
  const FlagGuard guard(ws, L);
  int host_layer = -1;
  for (int l = 0; l < L; ++l) {
    prog_.front(s, l, nt, pos0);
    // (Prefill's MoE layers run their host experts inside front: no host point.)
    const bool host_point = nt <= gpu::kMaxVecTokens && moe_.hybrid(l);
    if (host_point) {
      if (host_layer >= 0) moe_.host_part(s, host_layer, nt);
      host_layer = l;
      // A product on the host waits for the stream, which would wait for this layer's flag: no
      // queueing ahead then.
      if (host_products_) moe_.host_part(s, l, nt), host_layer = -1;
    }
    prog_.back(s, l, nt, host_point);
  }
  if (host_layer >= 0) moe_.host_part(s, host_layer, nt);
  for (int r0 = 0; r0 < n_out; r0 += 64) {
    prog_.head(s, nt, n_out, r0);
    gpu::sync_stream(e_.stream);
    std::memcpy(logits + static_cast<size_t>(r0) * e_.c.n_vocab, ws.h_out,
                sizeof(float) * std::min(64, n_out - r0) * e_.c.n_vocab);
  }
  e_.prof.end(e_.stream);
  gpu::sync_stream(e_.stream);
}

}  // namespace fitmoe::gpu
