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

void StepDriver::forward(ThreadPool& pool, const BatchRows& batch, float* logits) {
  Workspace& ws = *e_.ws;
  const int T = batch.n_rows();
  // Several sequences with a few rows each (decode steps of a batch): micro-batches of at most
  // kMaxVecTokens rows, so that each runs the decode-sized kernels (mat-vec products that read every
  // weight once for all their rows) instead of dequantizing every weight for a thin GEMM.
  const int ub = batch.parts.size() > 1 && T <= 8 * kMaxVecTokens ? std::min(ws.ub, kMaxVecTokens) : ws.ub;
  // The rows that want logits, in row order (= the order of `logits`).
  std::vector<int> want;
  for (const BatchPart& p : batch.parts)
    for (int r = p.row0 + p.n - p.n_logits; r < p.row0 + p.n; ++r) want.push_back(r);
  size_t w = 0;
  std::vector<SeqRows> seqs;
  for (int t0 = 0; t0 < T; t0 += ub) {
    const int nt = std::min(ub, T - t0);
    seqs.clear();
    for (const BatchPart& p : batch.parts) {
      const int lo = std::max(p.row0, t0), hi = std::min(p.row0 + p.n, t0 + nt);
      if (lo < hi) seqs.push_back({static_cast<GpuState*>(p.state), lo - t0, hi - lo, p.pos0 + (lo - p.row0)});
    }
    std::vector<int> rows;  // this micro-batch's rows that want logits
    const size_t w0 = w;
    while (w < want.size() && want[w] < t0 + nt) rows.push_back(want[w++] - t0);
    Step s{e_, ws, pool, seqs};
    micro_batch(s, std::span<const int32_t>(batch.tokens).subspan(t0, nt), rows,
                rows.empty() ? nullptr : logits + w0 * e_.c.n_vocab);
  }
}

// Inputs of a micro-batch: positions, the epoch, and the embedding rows (the program's). Host work
// first, then capturable uploads.
void StepDriver::prepare_inputs(Step& s, std::span<const int32_t> tokens) {
  Workspace& ws = s.ws;
  gpu::sync_stream(e_.stream);  // the pinned inputs may still be read by the previous micro-batch
  for (const SeqRows& q : s.seqs)
    for (int t = 0; t < q.n; ++t) ws.h_pos[q.row0 + t] = q.pos0 + t;
  *ws.h_epoch = ++ws.epoch;
  prog_.embed_host(s, tokens);
}

// Rows of the last layer's output that want logits but are not the micro-batch's last ones (several
// sequences: each one's last row) are copied there, in order, through ws.y (free after the last layer).
void StepDriver::gather_logit_rows(Step& s, int nt, int n_out, std::span<const int> want_rows) {
  Workspace& ws = s.ws;
  const size_t row = sizeof(float) * e_.c.n_embd;
  for (int i = 0; i < n_out; ++i)
    gpu::copy_d2d(reinterpret_cast<char*>(ws.y) + i * row, reinterpret_cast<const char*>(ws.x) + want_rows[i] * row, row,
                  e_.stream);
  gpu::copy_d2d(reinterpret_cast<char*>(ws.x) + (nt - n_out) * row, ws.y, n_out * row, e_.stream);
}

void StepDriver::upload_inputs(Step& s, int nt) {
  Workspace& ws = s.ws;
  gpu::copy_h2d(ws.pos, ws.h_pos, sizeof(int32_t) * nt, e_.stream);
  gpu::copy_h2d(ws.epoch_dev, ws.h_epoch, sizeof(unsigned), e_.stream);
  prog_.inputs(s, nt);
}

void StepDriver::decode_step_graphs(Step& s, int32_t token, float* logits) {
  Workspace& ws = s.ws;
  DecodeGraphs& dg = s.seqs[0].st->graphs;
  const int L = e_.c.n_layer;
  const int pos0 = s.seqs[0].pos0;
  prepare_inputs(s, std::span<const int32_t>(&token, 1));
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
    prog_.front(s, 0, 1);
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
      prog_.front(s, l + 1, 1);
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

void StepDriver::micro_batch(Step& s, std::span<const int32_t> tokens, std::span<const int> want_rows, float* logits) {
  Workspace& ws = s.ws;
  const int nt = static_cast<int>(tokens.size());
  const int n_out = static_cast<int>(want_rows.size());
  bool tail = true;  // the rows that want logits are the last n_out (the head reads those)
  for (int i = 0; i < n_out; ++i) tail = tail && want_rows[i] == nt - n_out + i;
  const int L = e_.c.n_layer;
  // Graphs are captured with the output head, so only steps that want logits replay them; they belong
  // to one sequence's state (its KV cache's addresses).
  if (nt == 1 && n_out == 1 && graphs_ok_) return decode_step_graphs(s, tokens[0], logits);
  prepare_inputs(s, tokens);
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
    prog_.front(s, l, nt);
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
  if (!tail) gather_logit_rows(s, nt, n_out, want_rows);
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
