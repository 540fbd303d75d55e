// Qwen3 / Qwen3-MoE on the GPU, with hybrid CPU/GPU experts.
//
// The forward pass mirrors the CPU one (src/model/qwen3.cpp) op for op, on gpu_ops (a few neighbouring
// ops run as one fused kernel with the same arithmetic, e.g. residual add + RMSNorm). What the plan put
// in host memory runs on the CPU: the routed experts of an MoE layer may be split, some on each side.
// Decode (micro-batches of up to gpu::kMaxVecTokens tokens), per MoE layer:
//   GPU: router -> top-k, whose last CTA writes the choices and the normed input into pinned host
//        memory and raises the layer's route flag -> runs the chosen device-resident experts;
//   CPU: meanwhile spins on the route flag and runs the chosen host-resident experts with all threads,
//        writes their outputs to pinned memory and raises the layer's hand-over flag;
//   GPU: a kernel waiting on that flag copies the rows up; all experts' outputs are combined in the
//        reference's order.
// Prefill (larger micro-batches): tokens are grouped by expert and every device-resident expert of a
// layer runs in one grouped tensor-core launch per matrix. For the host-resident experts, the cost model
// picks per layer, before the micro-batch starts, between the CPU and streaming them over PCIe. Streamed
// layers' experts go up in chunks through a ring of staging buffers on a second stream, in the order
// the layers will use them, so the copies of later layers run while earlier layers compute. A copy
// issued once its layer's routing is known carries only the experts the micro-batch uses; one issued
// before it carries the whole chunk, which keeps the PCIe link busy: a micro-batch worth streaming
// uses nearly every expert (a layer expected to use fewer than PlanOptions::prefill_prefetch_min_used
// of them waits for its routing instead).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <immintrin.h>
#include <map>
#include <numeric>
#include <string>

#include "cuda/device.h"
#include "cuda/gpu_ops.h"
#include "model/qwen3.h"
#include "runtime/cpu_ops.h"
#include "runtime/error.h"
#include "runtime/thread_pool.h"

namespace fitmoe {

namespace {

using gpu::DevMatrix;

// A weight as the GPU pass uses it: a device copy, or (placed on the host) the host Weight.
struct GWeight {
  DevMatrix dev;          // dev.data == nullptr: host-resident
  const Weight* host = nullptr;
  bool on_gpu() const { return dev.data != nullptr; }
};

// A chunk of up to PlanOptions::prefill_chunk_experts host-resident experts of one layer, streamed to the GPU as a
// unit during prefill; slot_of_dev maps expert -> position in the chunk (-1: not in it).
struct HostChunk {
  std::vector<int> experts;
  int32_t* slot_of_dev = nullptr;
};

struct GExperts {
  DevMatrix gate, up, down;        // the device-resident experts, packed by slot
  std::vector<int32_t> slot_of;    // expert -> slot, -1 = host
  int32_t* slot_of_dev = nullptr;
  bool identity = false;           // every expert on the device, slot = expert id
  // The slot map the decode kernels take: none when it is the identity, which saves each of them a
  // dependent read (expert id -> slot) before its weights (and lets the down kernel hint its rows
  // early). Measured on the H200, all-GPU decode: with the map 394.5 / 396.8 tok/s, without it (and
  // without the hint) 398.5 / 399.6.
  const int32_t* decode_slot_of() const { return identity ? nullptr : slot_of_dev; }
  int n_dev = 0;
  const cpu::ExpertWeights* host = nullptr;
  std::vector<HostChunk> chunks;   // the host-resident experts, in id order
  // Decode's GPU share of the host experts: all of them as the GPU sees the pinned host copy (data
  // null: no share for this layer).
  DevMatrix host_gate, host_up, host_down;
  bool gpu_share() const { return host_gate.data != nullptr; }
};

struct GLayer {
  const float *attn_norm = nullptr, *q_norm = nullptr, *k_norm = nullptr, *ffn_norm = nullptr;
  GWeight wq, wk, wv, wo, router, ffn_gate, ffn_up, ffn_down;
  GExperts experts;
  bool moe = false;
};

DevMatrix matrix_view(const Weight& w, const uint8_t* data) {
  DevMatrix m;
  m.type = w.type;
  m.cols = w.ne[0];
  m.rows = w.ne[1];
  m.n_mats = w.ne[2];
  m.row_bytes = w.row_bytes;
  m.mat_bytes = w.row_bytes * static_cast<size_t>(w.ne[1]);
  m.data = data;
  return m;
}

// Per-sequence GPU state: the KV cache and every scratch buffer, sized for one micro-batch.
class GpuState final : public ModelState {
 public:
  GpuState(gpu::DeviceMemory& mem, const ModelConfig& c, const StateOptions& opt, int ubatch) : mem_(mem) {
    n_ctx_ = opt.n_ctx;
    kv_type = opt.kv_type;
    if (kv_type != DType::F16 && kv_type != DType::F32)
      throw Error(std::string("KV cache type ") + dtype_name(kv_type) + " is not supported (use f16 or f32)");
    const size_t es = kv_type == DType::F16 ? 2 : 4;
    k_bytes = static_cast<size_t>(n_ctx_) * c.n_head_kv * c.head_dim * es;
    v_bytes = static_cast<size_t>(n_ctx_) * c.n_head_kv * c.head_dim_v * es;
    for (int l = 0; l < c.n_layer; ++l) {
      auto* k = static_cast<uint8_t*>(mem.alloc(k_bytes, "KV cache"));
      auto* v = static_cast<uint8_t*>(mem.alloc(v_bytes, "KV cache"));
      gpu::memset_async(k, 0, k_bytes, nullptr);
      gpu::memset_async(v, 0, v_bytes, nullptr);
      kv.push_back({kv_type, k, v, n_ctx_});
    }
    ub = ubatch;
    gpu::sync_stream(nullptr);  // the zeroing ran on the default stream; finish it before any use
  }
  ~GpuState() override {
    for (void* p : owned) mem_.free(p);
    for (auto& k : kv) {
      mem_.free(k.k);
      mem_.free(k.v);
    }
    for (void* p : pinned) gpu::free_pinned(p);
    for (void* g : graphs)
      if (g) gpu::destroy_graph(g);
    for (int i = 0; i < kPrefillStageSlots; ++i)
      for (void* e : {ev_free[i], ev_filled[i]})
        if (e) gpu::destroy_event(e);
    if (copy_stream) gpu::destroy_stream(copy_stream);
  }
  size_t bytes() const override { return (k_bytes + v_bytes) * kv.size(); }

  float* dev_floats(size_t n, const char* what) { return static_cast<float*>(dev_bytes(n * sizeof(float), what)); }
  void* dev_bytes(size_t n, const char* what) {
    void* p = mem_.alloc(n, what);
    owned.push_back(p);
    return p;
  }
  template <typename T>
  T* host(size_t n) {
    void* p = gpu::alloc_pinned(std::max<size_t>(n * sizeof(T), 64));
    pinned.push_back(p);
    return static_cast<T*>(p);
  }

  DType kv_type;
  size_t k_bytes = 0, v_bytes = 0;
  std::vector<gpu::DevKv> kv;
  int ub = 0;
  bool buffers_ready = false;
  std::vector<void*> graphs;  // decode CUDA graphs (see Qwen3Gpu::Segments)
  int graphs_variant = -1;    // gpu::attention_decode_variant the graphs were captured with
  // Device scratch.
  float *x = nullptr, *xn = nullptr, *q = nullptr, *k = nullptr, *v = nullptr, *att = nullptr, *y = nullptr;
  float* y_attn = nullptr;  // the attention output when its residual add is deferred (folds_norm below)
  float *rlogits = nullptr, *wts = nullptr, *g = nullptr, *u = nullptr, *ey = nullptr, *logits = nullptr;
  float *xg = nullptr;
  int32_t *ids = nullptr, *pos = nullptr, *tokens = nullptr, *act_row = nullptr, *ident = nullptr, *idx_a = nullptr,
          *idx_b = nullptr;
  void *acts = nullptr, *dequant = nullptr, *attn_scratch = nullptr;
  unsigned* route_done = nullptr;  // gpu::router_topk's counter
  void* xn_q = nullptr;  // xn in Q8_K, written by residual_norm for the next mat-vecs (decode)
  void* att_q = nullptr;  // the attention output in Q8_K, written by the decode attention kernel for wo
  bool att_q_valid = false;
  bool xn_q_valid = false;
  bool ffn_out_combined = false;  // this layer's MoE output is already combined in y (not per slot in ey)
  size_t acts_bytes = 0, dequant_bytes = 0, attn_scratch_bytes = 0, stage_bytes = 0;
  // Pinned host exchange buffers.
  float *h_x = nullptr, *h_xn = nullptr, *h_wts = nullptr, *h_ey = nullptr, *h_out = nullptr;
  float* h_ey_slots = nullptr;  // the CPU's expert outputs in slot order (decode), read by gpu::handover_combine
  float* ey_host = nullptr;     // rows of the host experts the GPU computes itself (its share, decode)
  int32_t *h_ids = nullptr, *h_pos = nullptr, *h_idx = nullptr;
  // The hand-over from the CPU's experts (decode): per layer a flag the host sets to this micro-batch's
  // epoch once its rows are in h_ey_slots; the epoch counts micro-batches (never reused, unlike a
  // position) and goes up with the positions.
  unsigned* h_flags = nullptr;
  const unsigned* flags_dev = nullptr;    // (device views of h_flags and h_ey_slots)
  const float* ey_slots_dev = nullptr;
  unsigned* h_epoch = nullptr;
  unsigned* epoch_dev = nullptr;
  unsigned epoch = 0;
  // The other way (decode): the GPU writes a hybrid layer's choices and normed input straight into
  // h_ids / h_xn and then the epoch into the layer's route flag (gpu::RoutePublish).
  unsigned* h_route_flags = nullptr;
  unsigned* route_flags_dev = nullptr;
  gpu::RoutePublish route_pub;  // h_ids and h_xn as the GPU sees them (flag: per layer, set at use)
  // Hybrid decode's routing guess: right after hybrid layer l's routing the GPU routes layer l + 1 (when
  // that is hybrid too) from x (before that layer's attention, and layer l's experts, have run) and
  // publishes the guess into h_pred_ids (k per layer, most likely first) and the layer's h_pred_flags;
  // the CPU reads those experts' weights into its caches while it waits for the real routing.
  float *xp = nullptr, *plogits = nullptr, *pwts = nullptr;
  int32_t* pids = nullptr;
  unsigned* pred_done = nullptr;  // (router_topk's counter for the prediction)
  int32_t* h_pred_ids = nullptr;
  unsigned* h_pred_flags = nullptr;
  gpu::RoutePublish pred_pub;  // h_pred_ids / h_pred_flags as the GPU sees them (per layer, set at use)
  // FITMOE_HOST_PROFILE: per layer, the GPU's clock when it saw the hand-over flag and when it raised
  // the route flag (pinned; device view in stamps_dev).
  unsigned long long* h_stamps = nullptr;
  unsigned long long* stamps_dev = nullptr;
  int32_t* gpu_slots = nullptr;    // per slot: the host expert the GPU computes itself, or -1
  int32_t* h_gpu_slots = nullptr;  // (pinned copy, for the CPU)
  int32_t* offsets = nullptr;               // grouped-expert offsets [n_expert + 1]
  // The prefill upload ring: chunk i of a micro-batch's stream goes to buffer i % kPrefillStageSlots.
  void* copy_stream = nullptr;
  void* stage[kPrefillStageSlots] = {};
  void* ev_free[kPrefillStageSlots] = {};    // compute is done with buffer b
  void* ev_filled[kPrefillStageSlots] = {};  // the upload into buffer b is done
  std::vector<std::pair<int, int>> stream_seq;  // (layer, chunk) in upload order
  size_t stream_copied = 0, stream_used = 0;    // chunks issued to the copy stream / consumed
  std::vector<char> layer_streams;              // per layer: host experts streamed (1) or CPU (0)
  std::vector<char> layer_waits;                // per streamed layer: its copies wait for its routing
  int routed_layer = -1;                        // the layer whose routing is known, and the experts
  std::vector<char> expert_used;                // it uses: later copies of its chunks carry only those
  cpu::Scratch cpu_scratch;

 private:
  gpu::DeviceMemory& mem_;
  std::vector<void*> owned, pinned;
};

// FITMOE_ROUTE_IN_EXPERTS=0 routes with router_topk even where the gate+up kernel could route itself
// (for A/B measurements; on the H200 all-GPU decode went from 387.3 / 388.9 to 397.6 / 397.9 tok/s
// with the self-routing kernel).
bool route_in_experts() {
  static const bool on = [] {
    const char* e = std::getenv("FITMOE_ROUTE_IN_EXPERTS");
    return !(e && std::string(e) == "0");
  }();
  return on;
}

// What the host says when the GPU's routing hands over no valid expert: -1 is what NaN router logits
// leave (the softmax has no maximum), which comes from NaN or infinite weights or activations.
std::string no_expert_message(int32_t e) {
  if (e == -1) return "the router chose no expert: its logits are NaN (NaN or infinite weights or activations)";
  return "router chose an expert out of range (" + std::to_string(e) + ")";
}

// Where a decode step's GPU time goes (FITMOE_PROFILE=1): graphs are off, each profiled step is queued
// behind a busy-wait so the GPU runs it back to back, and an event after every op gives the op's own
// time. Printed per op name (mean per step) to stderr when the model is unloaded.
class OpProfile {
 public:
  OpProfile() : on_(std::getenv("FITMOE_PROFILE") != nullptr) {}
  ~OpProfile() {
    if (steps_ > 0) report();
    for (void* e : events_) gpu::destroy_event(e);
  }
  bool on() const { return on_; }
  void begin(void* stream) {
    if (!on_) return;
    gpu::busy_wait(kBusyMs * 1000, stream);  // longer than the host needs to queue a step
    t_begin_ = std::chrono::steady_clock::now();
    n_ = 0;
    names_.clear();
    active_ = true;
    mark("", stream);
  }
  // The op that just ended on `stream` (the time since the previous mark).
  void mark(const char* name, void* stream) {
    if (!active_) return;
    if (n_ == events_.size()) events_.push_back(gpu::create_timing_event());
    gpu::record_event(events_[n_++], stream);
    names_.push_back(name);
  }
  void end(void* stream) {
    if (!active_) return;
    active_ = false;
    queue_ms_ = std::max(queue_ms_, std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t_begin_).count());
    gpu::sync_stream(stream);
    for (size_t i = 1; i < n_; ++i) {
      auto& [ms, calls] = totals_[names_[i]];
      ms += gpu::elapsed_ms(events_[i - 1], events_[i]);
      ++calls;
    }
    ++steps_;
  }

 private:
  void report() const {
    double total = 0;
    for (const auto& [name, v] : totals_) total += v.first;
    std::vector<std::pair<double, std::string>> rows;
    for (const auto& [name, v] : totals_) rows.emplace_back(v.first, name);
    std::sort(rows.rbegin(), rows.rend());
    std::fprintf(stderr, "\nGPU op profile, %d steps of up to %d tokens (FITMOE_PROFILE): %.1f us per step\n", steps_,
                 gpu::kMaxVecTokens, 1000.0 * total / steps_);
    std::fprintf(stderr, "  (the host queued a step in at most %.1f ms; over %d ms the times include launch gaps)\n", queue_ms_,
                 kBusyMs);
    std::fprintf(stderr, "  %-34s %10s %8s %7s\n", "op", "us/step", "calls", "share");
    for (const auto& [ms, name] : rows)
      std::fprintf(stderr, "  %-34s %10.1f %8.1f %6.1f%%\n", name.c_str(), 1000.0 * ms / steps_,
                   static_cast<double>(totals_.at(name).second) / steps_, 100.0 * ms / total);
  }
  static constexpr int kBusyMs = 30;
  bool on_, active_ = false;
  std::chrono::steady_clock::time_point t_begin_;
  double queue_ms_ = 0;
  std::vector<void*> events_;
  std::vector<const char*> names_;
  size_t n_ = 0;
  int steps_ = 0;
  std::map<std::string, std::pair<double, int>> totals_;
};

class Qwen3Gpu final : public GpuRunner {
 public:
  Qwen3Gpu(const Qwen3Weights& w, const ModelConfig& c, const Plan& plan, const LoadOptions& opt)
      : w_(w), c_(c), rope_(rope_params(c)), plan_(plan), mem_(plan.budget - plan.reserve), ubatch_(std::max(1, plan.options.n_ubatch)),
        chunk_experts_(std::max(1, plan.options.prefill_chunk_experts)) {
    if (c.n_expert_used > 32)
      throw Error("the GPU engine routes at most 32 experts per token; this model uses " +
                  std::to_string(c.n_expert_used) + " (use --gpu none)");
    stream_ = gpu::create_stream();
    upload_all(opt);
  }
  ~Qwen3Gpu() override {
    gpu::sync_stream(stream_);
    gpu::destroy_stream(stream_);
    host_prof_.report();
  }

  std::unique_ptr<ModelState> new_state(const StateOptions& opt) override {
    auto st = std::make_unique<GpuState>(mem_, c_, opt, ubatch_);
    allocate_scratch(*st);
    return st;
  }

  std::string memory_report() const override { return mem_.usage_report(); }
  RoutingGuessStats routing_guess_stats() const override { return guess_stats_; }

  void forward(ModelState& st_, ThreadPool& pool, std::span<const int32_t> tokens, int n_logits,
               float* logits) override {
    auto& st = static_cast<GpuState&>(st_);
    const int T = static_cast<int>(tokens.size());
    const int first_logit = T - n_logits;
    for (int t0 = 0; t0 < T; t0 += st.ub) {
      const int nt = std::min(st.ub, T - t0);
      const int want_from = std::max(first_logit, t0);
      const int n_out = std::max(0, t0 + nt - want_from);
      micro_batch(st, pool, tokens.subspan(t0, nt), st.n_past() + t0, n_out,
                  n_out ? logits + static_cast<size_t>(want_from - first_logit) * c_.n_vocab : nullptr);
    }
  }

 private:
  // ---- loading --------------------------------------------------------------------------------
  uint8_t* upload(const void* src, size_t bytes, const std::string& what) {
    auto* d = static_cast<uint8_t*>(mem_.alloc(bytes, what));
    gpu::copy_h2d(d, src, bytes, stream_);
    return d;
  }

  GWeight place(const Weight& w) {
    GWeight g;
    g.host = &w;
    if (!w) return g;
    const TensorPlacement* tp = plan_.find(w.info->name);
    if (tp && tp->on_gpu) g.dev = matrix_view(w, upload(w.host, w.matrix_bytes() * w.ne[2], "weights"));
    return g;
  }
  const float* norm(const Weight& w) {
    return w ? reinterpret_cast<const float*>(upload(w.host, w.matrix_bytes(), "weights")) : nullptr;
  }

  void upload_all(const LoadOptions& opt) {
    uint64_t total = plan_.gpu_weights + plan_.gpu_experts, done = 0;
    auto tick = [&](uint64_t b) {
      done += b;
      if (opt.progress) opt.progress("uploading weights to the GPU", done, total);
    };
    if (w_.output) {
      output_ = place(w_.output);
      tick(w_.output.matrix_bytes());
    }
    output_norm_ = norm(w_.output_norm);
    if (w_.tok_embd.info == w_.output.info && output_.on_gpu()) embed_dev_ = output_.dev;
    layers_.resize(c_.n_layer);
    for (int l = 0; l < c_.n_layer; ++l) {
      const Qwen3Layer& L = w_.layers[l];
      GLayer& G = layers_[l];
      G.attn_norm = norm(L.attn_norm);
      G.q_norm = norm(L.q_norm);
      G.k_norm = norm(L.k_norm);
      G.ffn_norm = norm(L.ffn_norm);
      G.wq = place(L.wq);
      G.wk = place(L.wk);
      G.wv = place(L.wv);
      G.wo = place(L.wo);
      tick(L.wq.matrix_bytes() + L.wk.matrix_bytes() + L.wv.matrix_bytes() + L.wo.matrix_bytes());
      G.moe = static_cast<bool>(L.router);
      if (G.moe) {
        G.router = place(L.router);
        GExperts& X = G.experts;
        X.host = &L.experts;
        const TensorPlacement* tp = plan_.find(L.experts.gate.info->name);
        const int E = c_.n_expert;
        X.slot_of.assign(E, -1);
        for (int e = 0; e < E; ++e)
          if (tp && !tp->expert_on_gpu.empty() && tp->expert_on_gpu[e]) X.slot_of[e] = X.n_dev++;
        auto pack = [&](const Weight& w3) {
          DevMatrix m = matrix_view(w3, nullptr);
          m.n_mats = X.n_dev;
          if (X.n_dev == 0) return m;
          auto* d = static_cast<uint8_t*>(mem_.alloc(m.mat_bytes * X.n_dev, "routed experts"));
          // Runs of consecutive experts in consecutive slots go up as one copy (the plan keeps a
          // layer's device experts together, so usually one copy per matrix).
          for (int e = 0; e < E;) {
            if (X.slot_of[e] < 0) {
              ++e;
              continue;
            }
            int run = 1;
            while (e + run < E && X.slot_of[e + run] == X.slot_of[e] + run) ++run;
            gpu::copy_h2d(d + m.mat_bytes * X.slot_of[e], w3.expert(e).host, m.mat_bytes * run, stream_);
            e += run;
          }
          m.data = d;
          tick(m.mat_bytes * X.n_dev);
          return m;
        };
        X.gate = pack(L.experts.gate);
        X.up = pack(L.experts.up);
        X.down = pack(L.experts.down);
        X.slot_of_dev = reinterpret_cast<int32_t*>(upload(X.slot_of.data(), sizeof(int32_t) * E, "routing tables"));
        X.identity = true;
        for (int e = 0; e < E; ++e) X.identity = X.identity && X.slot_of[e] == e;
        // The GPU's share of decode's host experts reads them in place (the weights are in pinned memory),
        // where a token is expected to give the GPU at least one expert (see gpu::RoutePublish) and the
        // kernels take the weights as they lie.
        const Weight &hg = L.experts.gate, &hu = L.experts.up, &hd = L.experts.down;
        if (host_experts_share_taken(plan_.host_experts_gpu_share, c_.n_expert_used, E - X.n_dev, E) > 0 &&
            hg.type == hu.type && !is_float_type(hg.type) && !is_float_type(hd.type)) {
          auto view = [](const Weight& w) {
            return matrix_view(w, static_cast<const uint8_t*>(gpu::device_view(const_cast<uint8_t*>(w.host))));
          };
          const DevMatrix vg = view(hg), vu = view(hu), vd = view(hd);
          if (gpu::matvec_weight_ok(vg) && gpu::matvec_weight_ok(vu) && gpu::matvec_weight_ok(vd)) {
            X.host_gate = vg;
            X.host_up = vu;
            X.host_down = vd;
          }
        }
        // Host experts in chunks for prefill streaming, each with its expert -> position table.
        std::vector<int> host_ids;
        for (int e = 0; e < E; ++e)
          if (X.slot_of[e] < 0) host_ids.push_back(e);
        for (size_t i = 0; i < host_ids.size(); i += chunk_experts_) {
          HostChunk ch;
          ch.experts.assign(host_ids.begin() + static_cast<long>(i),
                            host_ids.begin() + static_cast<long>(std::min(host_ids.size(), i + chunk_experts_)));
          std::vector<int32_t> pos(E, -1);
          for (size_t p = 0; p < ch.experts.size(); ++p) pos[ch.experts[p]] = static_cast<int32_t>(p);
          ch.slot_of_dev = reinterpret_cast<int32_t*>(upload(pos.data(), sizeof(int32_t) * E, "routing tables"));
          X.chunks.push_back(std::move(ch));
        }
      } else {
        G.ffn_gate = place(L.ffn_gate);
        G.ffn_up = place(L.ffn_up);
        G.ffn_down = place(L.ffn_down);
      }
      gpu::sync_stream(stream_);  // host sources of this layer may be reused by the caller
    }
    // Decode graphs need every op of a step on the GPU (a host-resident non-expert weight makes its
    // product synchronise with the host); FITMOE_NO_GRAPHS=1 turns them off for comparison.
    host_products_ = !output_.on_gpu();
    for (auto& G : layers_)
      for (const GWeight* w : {&G.wq, &G.wk, &G.wv, &G.wo, &G.router, &G.ffn_gate, &G.ffn_up, &G.ffn_down})
        if (w->host && *w->host && !w->on_gpu()) host_products_ = true;
    graphs_ok_ = !host_products_ && !std::getenv("FITMOE_NO_GRAPHS") && !prof_.on();
  }

  void allocate_scratch(GpuState& st) {
    const int U = st.ub, E = std::max(c_.n_expert, 1), k = std::max(c_.n_expert_used, 1);
    const int64_t n = c_.n_embd, qw = static_cast<int64_t>(c_.n_head) * c_.head_dim,
                  kw = static_cast<int64_t>(c_.n_head_kv) * c_.head_dim, vw = static_cast<int64_t>(c_.n_head_kv) * c_.head_dim_v,
                  aw = static_cast<int64_t>(c_.n_head) * c_.head_dim_v;
    const int64_t ff = std::max<int64_t>({c_.n_ff_exp, c_.n_ff, 1});
    const int64_t slots = c_.n_expert ? static_cast<int64_t>(U) * k : U;
    st.x = st.dev_floats(U * n, "activations");
    st.xn = st.dev_floats(U * n, "activations");
    st.q = st.dev_floats(U * qw, "activations");
    st.k = st.dev_floats(U * kw, "activations");
    st.v = st.dev_floats(U * vw, "activations");
    st.att = st.dev_floats(U * aw, "activations");
    st.y = st.dev_floats(U * n, "activations");
    st.y_attn = st.dev_floats(U * n, "activations");
    st.rlogits = st.dev_floats(U * E, "activations");
    st.wts = st.dev_floats(slots, "activations");
    st.g = st.dev_floats(slots * ff, "activations");
    st.u = st.dev_floats(slots * ff, "activations");
    st.ey = st.dev_floats(slots * n, "activations");
    st.xg = st.dev_floats(U * n, "activations");
    st.logits = st.dev_floats(static_cast<size_t>(std::min(U, 64)) * c_.n_vocab, "logits");
    st.ids = static_cast<int32_t*>(st.dev_bytes(sizeof(int32_t) * slots, "activations"));
    st.pos = static_cast<int32_t*>(st.dev_bytes(sizeof(int32_t) * U, "activations"));
    st.tokens = static_cast<int32_t*>(st.dev_bytes(sizeof(int32_t) * U, "activations"));
    st.idx_a = static_cast<int32_t*>(st.dev_bytes(sizeof(int32_t) * slots, "activations"));
    st.idx_b = static_cast<int32_t*>(st.dev_bytes(sizeof(int32_t) * slots, "activations"));
    // act_row[j] = j / k (slot -> token) and ident[j] = j, constant.
    std::vector<int32_t> rows(static_cast<size_t>(slots)), ident(static_cast<size_t>(slots));
    for (int64_t j = 0; j < slots; ++j) rows[j] = static_cast<int32_t>(j / k), ident[j] = static_cast<int32_t>(j);
    st.act_row = static_cast<int32_t*>(st.dev_bytes(sizeof(int32_t) * slots, "activations"));
    st.ey_host = st.dev_floats(std::min<int64_t>(slots, static_cast<int64_t>(gpu::kMaxVecTokens) * k) * n, "activations");
    st.ident = static_cast<int32_t*>(st.dev_bytes(sizeof(int32_t) * slots, "activations"));
    st.route_done = static_cast<unsigned*>(st.dev_bytes(sizeof(unsigned), "activations"));
    gpu::memset_async(st.route_done, 0, sizeof(unsigned), stream_);
    gpu::copy_h2d(st.act_row, rows.data(), sizeof(int32_t) * slots, stream_);
    gpu::copy_h2d(st.ident, ident.data(), sizeof(int32_t) * slots, stream_);
    // Activations in the weights' formats, for the matrix-vector path only (micro-batches of at most
    // kMaxVecTokens tokens); the widest row set is the experts' slots.
    const int64_t vec_tokens = std::min<int64_t>(U, gpu::kMaxVecTokens);
    const int64_t vec_rows = c_.n_expert ? vec_tokens * k : vec_tokens;
    int64_t widest = std::max<int64_t>({n, qw, aw, ff});
    st.acts_bytes = gpu::act_bytes(DType::F32, widest, static_cast<int>(vec_rows));
    st.acts = st.dev_bytes(st.acts_bytes, "activations");
    if (n % 256 == 0) st.xn_q = st.dev_bytes(row_bytes(DType::Q8_K, n) * vec_tokens, "activations");
    st.dequant_bytes = 64u << 20;
    st.dequant = st.dev_bytes(st.dequant_bytes, "dequantized weight tiles");
    st.attn_scratch_bytes = gpu::attention_scratch_bytes(U, st.n_ctx(), c_.n_head, c_.head_dim_v);
    st.attn_scratch = st.dev_bytes(st.attn_scratch_bytes, "attention scratch");
    gpu::memset_async(st.attn_scratch, 0, st.attn_scratch_bytes, stream_);  // its counters start at zero
    if ((static_cast<int64_t>(c_.n_head) * c_.head_dim_v) % 256 == 0)
      st.att_q = st.dev_bytes(row_bytes(DType::Q8_K, aw) * vec_tokens, "activations");
    // The upload ring for host experts streamed during prefill (sized as the plan assumed).
    if (c_.n_expert) {
      size_t per_expert = 0;
      for (const auto& L : w_.layers)
        per_expert = std::max(per_expert, L.experts.gate.matrix_bytes() + L.experts.up.matrix_bytes() +
                                              L.experts.down.matrix_bytes());
      st.stage_bytes = per_expert * chunk_experts_;
      if (has_host_experts())
        for (int b = 0; b < kPrefillStageSlots; ++b) {
          st.stage[b] = st.dev_bytes(st.stage_bytes, "expert upload staging");
          st.ev_free[b] = gpu::create_event();
          st.ev_filled[b] = gpu::create_event();
          gpu::record_event(st.ev_free[b], stream_);  // every buffer starts free
        }
      st.offsets = static_cast<int32_t*>(st.dev_bytes(sizeof(int32_t) * (E + 1), "routing tables"));
      st.copy_stream = gpu::create_stream();
    }
    st.h_x = st.host<float>(static_cast<size_t>(U) * n);
    st.h_xn = st.host<float>(static_cast<size_t>(U) * n);
    st.h_wts = st.host<float>(slots);
    st.h_ids = st.host<int32_t>(slots);
    st.h_ey = st.host<float>(static_cast<size_t>(slots) * n);
    st.h_ey_slots = st.host<float>(static_cast<size_t>(vec_rows) * n);
    st.h_pos = st.host<int32_t>(U);
    st.h_idx = st.host<int32_t>(2 * slots + E + 2);
    // Host-side products (weights the plan left on the host): logits come in slices of 64 rows.
    st.h_out = st.host<float>(std::max<size_t>(static_cast<size_t>(64) * c_.n_vocab,
                                               static_cast<size_t>(U) * std::max<int64_t>({qw, aw, n, ff, E})));
    st.h_flags = st.host<unsigned>(c_.n_layer);
    std::memset(st.h_flags, 0, sizeof(unsigned) * c_.n_layer);
    st.flags_dev = static_cast<const unsigned*>(gpu::device_view(st.h_flags));
    st.ey_slots_dev = static_cast<const float*>(gpu::device_view(st.h_ey_slots));
    st.h_epoch = st.host<unsigned>(1);
    st.epoch_dev = static_cast<unsigned*>(st.dev_bytes(sizeof(unsigned), "activations"));
    st.h_route_flags = st.host<unsigned>(c_.n_layer);
    std::memset(st.h_route_flags, 0, sizeof(unsigned) * c_.n_layer);
    st.route_flags_dev = static_cast<unsigned*>(gpu::device_view(st.h_route_flags));
    st.route_pub.ids = static_cast<int32_t*>(gpu::device_view(st.h_ids));
    st.route_pub.x = static_cast<float*>(gpu::device_view(st.h_xn));
    st.route_pub.epoch = st.epoch_dev;
    st.gpu_slots = static_cast<int32_t*>(st.dev_bytes(sizeof(int32_t) * vec_rows, "routing tables"));
    st.h_gpu_slots = st.host<int32_t>(vec_rows);
    st.route_pub.gpu_slots = st.gpu_slots;
    st.route_pub.host_gpu_slots = static_cast<int32_t*>(gpu::device_view(st.h_gpu_slots));
    st.route_pub.k = c_.n_expert_used;
    st.route_pub.n_expert = c_.n_expert;
    if (c_.n_expert) {
      st.xp = st.dev_floats(n, "activations");
      st.plogits = st.dev_floats(E, "activations");
      st.pwts = st.dev_floats(k, "activations");
      st.pids = static_cast<int32_t*>(st.dev_bytes(sizeof(int32_t) * k, "activations"));
      st.pred_done = static_cast<unsigned*>(st.dev_bytes(sizeof(unsigned), "activations"));
      gpu::memset_async(st.pred_done, 0, sizeof(unsigned), stream_);
      st.h_pred_ids = st.host<int32_t>(static_cast<size_t>(c_.n_layer) * k);
      st.h_pred_flags = st.host<unsigned>(c_.n_layer);
      std::memset(st.h_pred_flags, 0, sizeof(unsigned) * c_.n_layer);
      st.pred_pub.ids = static_cast<int32_t*>(gpu::device_view(st.h_pred_ids));
      st.pred_pub.flag = static_cast<unsigned*>(gpu::device_view(st.h_pred_flags));
      st.pred_pub.epoch = st.epoch_dev;
    }
    if (host_prof_.on) {
      st.h_stamps = st.host<unsigned long long>(2 * static_cast<size_t>(c_.n_layer));
      std::memset(st.h_stamps, 0, sizeof(unsigned long long) * 2 * c_.n_layer);
      st.stamps_dev = static_cast<unsigned long long*>(gpu::device_view(st.h_stamps));
    }
    gpu::sync_stream(stream_);
  }

  // ---- ops ------------------------------------------------------------------------------------
  // y[t] = W x[t] for nt tokens (ld_x = W.cols, ld_y given), on the GPU when W is there, else on the
  // CPU through pinned buffers.
  void linear(GpuState& st, ThreadPool& pool, const GWeight& w, const float* x, int nt, float* y, int64_t ld_y) {
    const Weight& hw = *w.host;
    if (!w.on_gpu()) {
      gpu::copy_d2h(st.h_xn, x, sizeof(float) * nt * hw.cols(), stream_);
      gpu::sync_stream(stream_);
      cpu::matmul(pool, hw, st.h_xn, hw.cols(), nt, st.h_out, ld_y, st.cpu_scratch, 40);
      gpu::copy_h2d(y, st.h_out, sizeof(float) * ((nt - 1) * ld_y + hw.rows()), stream_);
      gpu::sync_stream(stream_);  // h_out is reused by the next host matmul
      return;
    }
    const DevMatrix& m = w.dev;
    if (nt <= gpu::kMaxVecTokens) {
      gpu::matvec(m, vec_acts(st, m.type, x, nt, m.cols), nt, y, ld_y, stream_);
      return;
    }
    matmul_chunked(st, m, 0, x, m.cols, nt, y, ld_y);
  }

  // The input of the matrix-vector kernels for weights of type `type`: x itself for F32 weights (their
  // activation format is plain f32 rows), else x converted into st.acts.
  const void* vec_acts(GpuState& st, DType type, const float* x, int nt, int64_t cols) {
    const DType act = dtype_info(type).act_type;
    if (act == DType::F32) return x;
    if (act == DType::Q8_K && x == st.xn && st.xn_q_valid && cols == c_.n_embd) return st.xn_q;
    if (act == DType::Q8_K && x == st.att && st.att_q_valid) return st.att_q;
    gpu::quantize_acts(act, x, cols, nt, cols, st.acts, stream_);
    prof_.mark("quantize activations", stream_);
    return st.acts;
  }

  // Where residual_norm should also write xn in Q8_K: when the next consumer of xn is a mat-vec on the
  // GPU that takes Q8_K activations (then vec_acts hands it out instead of quantizing again).
  void* xn_q_for(GpuState& st, const GWeight& consumer, int nt) {
    st.xn_q_valid = st.xn_q && nt <= gpu::kMaxVecTokens && consumer.on_gpu() &&
                    dtype_info(consumer.dev.type).act_type == DType::Q8_K;
    return st.xn_q_valid ? st.xn_q : nullptr;
  }

  // Several products of one input (q, k, v): on the matrix-vector path the input is converted once
  // per activation format, not once per product.
  struct Product {
    const GWeight* w;
    float* y;
    int64_t ld_y;
  };
  void linear_shared(GpuState& st, ThreadPool& pool, std::initializer_list<Product> products, const float* x, int nt) {
    bool vec = nt <= gpu::kMaxVecTokens;
    for (const Product& p : products) vec = vec && p.w->on_gpu();
    if (!vec) {
      for (const Product& p : products) linear(st, pool, *p.w, x, nt, p.y, p.ld_y);
      return;
    }
    std::vector<const Product*> todo;
    for (const Product& p : products) todo.push_back(&p);
    while (!todo.empty()) {
      const DType act = dtype_info(todo.front()->w->dev.type).act_type;
      const void* acts = vec_acts(st, todo.front()->w->dev.type, x, nt, todo.front()->w->dev.cols);
      std::vector<const Product*> rest, same;
      for (const Product* p : todo) {
        if (dtype_info(p->w->dev.type).act_type == act && p->w->dev.cols == todo.front()->w->dev.cols)
          same.push_back(p);
        else
          rest.push_back(p);
      }
      // One call: one launch for quantized matrices of one type (or a pair of types gpu::matvec_multi
      // mixes, such as Q4_K q and k with a Q6_K v).
      std::vector<const gpu::DevMatrix*> ws;
      std::vector<float*> ys;
      std::vector<int64_t> lds;
      for (const Product* p : same) {
        ws.push_back(&p->w->dev);
        ys.push_back(p->y);
        lds.push_back(p->ld_y);
      }
      gpu::matvec_multi(ws.data(), ys.data(), lds.data(), static_cast<int>(ws.size()), acts, nt, stream_);
      todo.swap(rest);
    }
  }

  // Large products through dequantize + cuBLAS (gpu::matmul tiles rows and tokens to the scratch).
  void matmul_chunked(GpuState& st, const DevMatrix& m, int64_t mat, const float* x, int64_t ld_x, int nt, float* y,
                      int64_t ld_y) {
    gpu::matmul(m, mat, x, ld_x, nt, y, ld_y, st.dequant, st.dequant_bytes, stream_);
  }

  // ---- the forward pass, in pieces that can be captured into CUDA graphs --------------------------
  // One token with every expert on the GPU: the gate+up kernel makes the routing itself from the
  // router's logits (one step fewer on the critical path than router_topk's last CTA).
  bool routes_in_experts(const GLayer& G, int nt) const {
    const GExperts& X = G.experts;
    return G.moe && nt == 1 && X.n_dev == c_.n_expert && !X.gpu_share() && route_in_experts() && G.router.on_gpu() &&
           c_.n_expert <= gpu::kRouteInExpertsMax && c_.n_expert_used <= 32 && X.gate.type == X.up.type &&
           !is_float_type(X.gate.type);
  }
  // The attention block's residual add and the FFN norm done in the router's launch
  // (gpu::residual_norm_router), the add itself deferred to the FFN block's end: one launch fewer per
  // layer. Measured on the H200, all-GPU decode: 421.2 / 423.0 tok/s with it, 410.6 / 410.7 without.
  bool folds_norm(const GLayer& G, int nt) const {
    return routes_in_experts(G, nt) && G.router.dev.type == DType::F32 &&
           G.router.dev.cols == c_.n_embd && c_.n_embd % 256 == 0 && c_.n_embd <= 4096 && G.ffn_norm &&
           dtype_info(G.experts.gate.type).act_type == DType::Q8_K && c_.n_expert_used <= 8 &&
           !is_float_type(G.experts.down.type);  // (the down kernel then combines into y: residual_norm's y0 path)
  }

  // Attention block of layer l and the FFN norm: x -> x + attn(xn), xn = ffn_norm(x). On entry xn
  // holds attn_norm(x) (from input_norm or the previous layer's ffn_finish). With folds_norm the block
  // ends at the attention output (in y_attn); the router's launch does the rest.
  void attention_block(GpuState& st, ThreadPool& pool, int l, int nt, int pos0) {
    const ModelConfig& c = c_;
    GLayer& G = layers_[l];
    const int E = c.n_embd, hd = c.head_dim, hdv = c.head_dim_v;
    const int qw = c.n_head * hd, kw = c.n_head_kv * hd, vw = c.n_head_kv * hdv, aw = c.n_head * hdv;
    linear_shared(st, pool, {{&G.wq, st.q, qw}, {&G.wk, st.k, kw}, {&G.wv, st.v, vw}}, st.xn, nt);
    prof_.mark("attn q,k,v", stream_);
    gpu::qk_norm_rope_store(st.q, qw, st.k, kw, st.v, vw, G.q_norm, G.k_norm, st.kv[l], st.pos, nt, c.n_head,
                            c.n_head_kv, hd, hdv, c.n_rot, rope_, c.rms_eps, stream_);
    prof_.mark("q/k norm + rope + kv store", stream_);
    // The decode kernel can hand wo its input in Q8_K (one quantize launch fewer).
    void* att_q = st.att_q && nt <= gpu::kMaxVecTokens && G.wo.on_gpu() &&
                          dtype_info(G.wo.dev.type).act_type == DType::Q8_K
                      ? st.att_q
                      : nullptr;
    st.att_q_valid = gpu::attention(st.q, qw, st.kv[l], pos0, st.pos, nt, st.n_ctx(), c.n_head, c.n_head_kv, hd, hdv,
                                    1.0f / std::sqrt(static_cast<float>(hd)), st.att, aw, st.attn_scratch,
                                    st.attn_scratch_bytes, stream_, att_q);
    prof_.mark("attention", stream_);
    const bool fold = folds_norm(G, nt);
    linear(st, pool, G.wo, st.att, nt, fold ? st.y_attn : st.y, E);
    st.att_q_valid = false;
    prof_.mark("attn output", stream_);
    if (fold) return;
    const GWeight& next = G.moe ? GWeight{G.experts.gate, nullptr} : G.ffn_gate;
    gpu::residual_norm(st.x, st.y, nullptr, nullptr, 0, G.ffn_norm, st.xn, E, nt, c.rms_eps, stream_,
                       xn_q_for(st, next, nt));
    prof_.mark("residual + ffn norm", stream_);
  }

  // xn = attn_norm of layer 0 (x); later layers get theirs from the previous ffn_finish.
  void input_norm(GpuState& st, int nt) {
    st.xn_q_valid = false;
    gpu::rms_norm(st.x, layers_[0].attn_norm, st.xn, c_.n_embd, nt, c_.rms_eps, c_.n_embd, c_.n_embd, stream_);
  }

  // FFN block, GPU side: the dense FFN, or the router and the device-resident experts (with the
  // routing copied out first when the CPU has experts to run). Output in st.ey / st.y.
  void ffn_gpu(GpuState& st, ThreadPool& pool, int l, int nt) {
    const ModelConfig& c = c_;
    GLayer& G = layers_[l];
    const int E = c.n_embd;
    if (!G.moe) {
      const int64_t ff = c.n_ff;
      linear(st, pool, G.ffn_gate, st.xn, nt, st.g, ff);
      linear(st, pool, G.ffn_up, st.xn, nt, st.u, ff);
      gpu::swiglu(st.g, st.u, st.g, static_cast<int64_t>(nt) * ff, stream_);
      linear(st, pool, G.ffn_down, st.g, nt, st.y, E);
      return;
    }
    const int k = c.n_expert_used, n_slots = nt * k;
    const int64_t ff = c.n_ff_exp;
    GExperts& X = G.experts;
    st.ffn_out_combined = false;
    // The CPU needs the choices and the normed input of a hybrid layer: the routing kernel writes them
    // into pinned memory and raises the layer's flag, so the CPU starts while the GPU runs its own experts.
    gpu::RoutePublish pub;
    const bool share = X.gpu_share();  // the GPU computes part of the host experts too
    if (X.n_dev < c.n_expert) {
      pub = st.route_pub;
      pub.flag = st.route_flags_dev + l;
      pub.slot_of = X.slot_of_dev;
      pub.gpu_share = share ? static_cast<float>(plan_.host_experts_gpu_share) : 0.0f;
      if (st.stamps_dev) pub.stamp = st.stamps_dev + 2 * l + 1;
    }
    const bool routed_by_experts = routes_in_experts(G, nt);
    if (folds_norm(G, nt)) {
      gpu::residual_norm_router(st.x, st.y_attn, G.ffn_norm, E, c.rms_eps, G.router.dev, st.rlogits, st.xn_q, stream_);
      st.xn_q_valid = true;
      prof_.mark("residual + ffn norm + router", stream_);
    } else if (routed_by_experts) {
      linear(st, pool, G.router, st.xn, nt, st.rlogits, c.n_expert);
      prof_.mark("router", stream_);
    } else if (G.router.on_gpu() &&
        gpu::router_topk(G.router.dev, st.xn, nt, st.rlogits, k, st.ids, st.wts, st.route_done, stream_, pub)) {
      prof_.mark("router + top-k", stream_);
    } else {
      linear(st, pool, G.router, st.xn, nt, st.rlogits, c.n_expert);
      prof_.mark("router", stream_);
      gpu::route_topk(st.rlogits, nt, c.n_expert, k, st.ids, st.wts, stream_);
      if (pub.flag) gpu::publish_route(pub, st.ids, n_slots, st.xn, static_cast<int64_t>(nt) * E, stream_);
      prof_.mark("top-k", stream_);
    }
    predict_next_route(st, l, nt);
    // The device-resident experts, and the GPU's share of the host-resident ones read from pinned
    // memory (their rows of g are other slots', and their outputs go where the CPU's would: ey_host).
    if (X.n_dev == 0 && !share) return;
    const DevMatrix& gate = X.n_dev > 0 ? X.gate : X.host_gate;
    const void* acts = vec_acts(st, gate.type, st.xn, nt, E);
    if (X.n_dev > 0) {
      if (routed_by_experts) {
        gpu::matvec_experts_glu_routed(X.gate, X.up, st.rlogits, c.n_expert, k, st.ids, st.wts, X.decode_slot_of(), acts,
                                       st.g, ff, stream_);
      } else if (X.gate.type == X.up.type && !is_float_type(X.gate.type)) {
        gpu::matvec_experts_glu(X.gate, X.up, st.ids, X.decode_slot_of(), n_slots, acts, st.act_row, st.g, ff, stream_);
      } else {
        gpu::matvec_experts(X.gate, st.ids, X.slot_of_dev, n_slots, acts, st.act_row, st.g, ff, stream_);
        const void* acts_up = dtype_info(X.up.type).act_type != dtype_info(X.gate.type).act_type
                                  ? vec_acts(st, X.up.type, st.xn, nt, E)
                                  : acts;
        gpu::matvec_experts(X.up, st.ids, X.slot_of_dev, n_slots, acts_up, st.act_row, st.u, ff, stream_);
        gpu::swiglu(st.g, st.u, st.g, n_slots * ff, stream_);
      }
    }
    if (share) {
      if (X.n_dev > 0 && dtype_info(X.host_gate.type).act_type != dtype_info(gate.type).act_type)
        acts = vec_acts(st, X.host_gate.type, st.xn, nt, E);
      gpu::matvec_experts_glu(X.host_gate, X.host_up, st.gpu_slots, nullptr, n_slots, acts, st.act_row, st.g, ff,
                              stream_);
    }
    prof_.mark("experts gate+up", stream_);
    const DevMatrix& down = X.n_dev > 0 ? X.down : X.host_down;
    acts = vec_acts(st, down.type, st.g, n_slots, ff);
    if (X.n_dev == c.n_expert && k <= 8 && !is_float_type(X.down.type)) {
      // Every expert on the GPU: the down products combine straight into st.y.
      gpu::matvec_experts_combine(X.down, st.ids, X.decode_slot_of(), nt, k, acts, st.wts, st.y, E, stream_);
      st.ffn_out_combined = true;
    } else if (X.n_dev > 0) {
      gpu::matvec_experts(X.down, st.ids, X.slot_of_dev, n_slots, acts, st.ident, st.ey, E, stream_);
    }
    if (share) {
      if (X.n_dev > 0 && dtype_info(X.host_down.type).act_type != dtype_info(down.type).act_type)
        acts = vec_acts(st, X.host_down.type, st.g, n_slots, ff);
      gpu::matvec_experts(X.host_down, st.gpu_slots, nullptr, n_slots, acts, st.ident, st.ey_host, E, stream_);
    }
    prof_.mark("experts down", stream_);
  }

  // Right after hybrid layer l's routing (one token), when layer l + 1 is hybrid too: guess layer
  // l + 1's routing from x as it is now (the attention block's output is in it, layer l's experts not
  // yet), normed with layer l + 1's FFN norm, and publish the guess for the CPU (see
  // GpuState::pred_pub). It costs the GPU two small launches while the CPU runs layer l's host experts,
  // and comes first so that the GPU's own experts (or its share of the host's) never delay it. Measured
  // on the dev machine with the CPU engine (8-layer synthetic 30B-A3B shape, 273 layer steps), the
  // guess's i-th choice is among the real ones 92, 90, 89, 84, 76, 68, 59, 48% of the time for i = 1..8
  // (74% in all; 76% with layer l's GPU-side experts added to x, 86% with all of them).
  void predict_next_route(GpuState& st, int l, int nt) {
    if (nt != 1 || !guesses_route(l + 1)) return;
    const GLayer& N = layers_[l + 1];
    const int k = c_.n_expert_used;
    gpu::rms_norm(st.x, N.ffn_norm, st.xp, c_.n_embd, 1, c_.rms_eps, c_.n_embd, c_.n_embd, stream_);
    gpu::RoutePublish pub = st.pred_pub;
    pub.ids += static_cast<ptrdiff_t>(l + 1) * k;
    pub.flag += l + 1;
    if (!gpu::router_topk(N.router.dev, st.xp, 1, st.plogits, k, st.pids, st.pwts, st.pred_done, stream_, pub))
      throw Error("internal: the routing guess of layer " + std::to_string(l + 1) + " was refused");
    prof_.mark("next layer's routing guessed", stream_);
  }
  // Whether decode guesses hybrid layer l's routing one layer early (see predict_next_route): layer
  // l - 1 must be hybrid too, and layer l's router one that router_topk takes.
  bool guesses_route(int l) const {
    if (!predict_ || l < 1 || l >= c_.n_layer || !hybrid(l) || !hybrid(l - 1)) return false;
    const DevMatrix& r = layers_[l].router.dev;
    return layers_[l].router.on_gpu() && r.type == DType::F32 && r.n_mats == 1 && r.rows <= 512;
  }

  bool hybrid(int l) const { return layers_[l].moe && layers_[l].experts.n_dev < c_.n_expert; }

  // Waits (spinning: it comes within tens of microseconds) until the GPU has published layer l's
  // routing of this micro-batch. A failed stream or a minute without it is an error, not a hang.
  void wait_route(GpuState& st, int l) {
    const std::atomic_ref<unsigned> flag(st.h_route_flags[l]);
    const auto t0 = std::chrono::steady_clock::now();
    for (unsigned spins = 0; flag.load(std::memory_order_acquire) != st.epoch; ++spins) {
      _mm_pause();
      if ((spins & 0xfffu) == 0xfffu) {
        if (gpu::check_stream(stream_) && flag.load(std::memory_order_acquire) != st.epoch)
          throw Error("internal: the GPU finished without handing over the routing of layer " + std::to_string(l));
        if (std::chrono::steady_clock::now() - t0 > std::chrono::seconds(60))
          throw Error("the GPU did not hand over the routing of layer " + std::to_string(l) + " within 60 s");
      }
    }
  }

  // FFN block, CPU side (hybrid MoE layers, micro-batches of at most kMaxVecTokens): wait for the
  // routing, run the chosen host-resident experts on the CPU threads, put their outputs in h_ey_slots
  // (slot order) and publish them with the layer's flag; the GPU, already queued up to the next layer's
  // routing, waits for that flag in ffn_finish (gpu::handover_combine) and reads the rows itself.
  void ffn_host(GpuState& st, ThreadPool& pool, int l, int nt) {
    const int E = c_.n_embd, k = c_.n_expert_used, n_slots = nt * k;
    GExperts& X = layers_[l].experts;
    const auto t0 = std::chrono::steady_clock::now();
    size_t prefetched = 0;
    const std::vector<int32_t> guessed = nt == 1 ? read_guessed_ahead(st, pool, l, &prefetched) : std::vector<int32_t>{};
    wait_route(st, l);
    const auto t1 = std::chrono::steady_clock::now();
    std::vector<int32_t> tok, exp, slot;
    for (int j = 0; j < n_slots; ++j) {
      const int32_t e = st.h_ids[j];
      if (e < 0 || e >= c_.n_expert) throw Error(no_expert_message(e));
      // Host-resident, and not one the GPU computes itself.
      if (X.slot_of[e] < 0 && !(X.gpu_share() && st.h_gpu_slots[j] >= 0))
        tok.push_back(j / k), exp.push_back(e), slot.push_back(j);
    }
    if (!tok.empty()) {
      // Each output straight into its slot's row of h_ey_slots.
      cpu::expert_ffn(pool, *X.host, st.h_xn, nt, E, tok.data(), exp.data(), static_cast<int>(tok.size()),
                      st.h_ey_slots, st.cpu_scratch, slot.data(), guessed);
    }
    // The rows before the flag (x86 keeps stores in order; the release keeps the compiler from moving them).
    std::atomic_ref<unsigned>(st.h_flags[l]).store(st.epoch, std::memory_order_release);
    if (nt == 1) {
      ++guess_stats_.layer_steps;
      guess_stats_.guessed += static_cast<long>(guessed.size());
      // (Right when the routing chose it, whichever side then computed it.)
      for (const int32_t e : guessed) guess_stats_.chosen += std::find(st.h_ids, st.h_ids + n_slots, e) != st.h_ids + n_slots;
      guess_stats_.prefetched_bytes += static_cast<double>(prefetched);
      if (host_prof_.on) {
        std::vector<int32_t> distinct = exp;
        std::sort(distinct.begin(), distinct.end());
        distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
        const double per_expert = static_cast<double>(X.host->gate.matrix_bytes() + X.host->up.matrix_bytes() +
                                                      X.host->down.matrix_bytes());
        host_prof_.add(t1 - t0, std::chrono::steady_clock::now() - t1, per_expert * static_cast<double>(distinct.size()));
      }
    }
  }

  // While the GPU runs hybrid layer l's attention block and routing (one token), the host's memory
  // would sit idle: when the GPU guessed this layer's routing (see predict_next_route), every thread
  // reads its slices of the guessed host-resident experts (most likely first) into its caches until
  // the real routing arrives. Returns the experts read for, which the threads then compute by the same
  // slices (cpu::expert_ffn's `sliced`); *bytes: what was read.
  std::vector<int32_t> read_guessed_ahead(GpuState& st, ThreadPool& pool, int l, size_t* bytes) {
    const int k = c_.n_expert_used;
    const GExperts& X = layers_[l].experts;
    std::vector<int32_t> guessed;
    if (!st.h_pred_flags || !guesses_route(l)) return guessed;
    const std::atomic_ref<unsigned> route(st.h_route_flags[l]), pred(st.h_pred_flags[l]);
    // The guess comes a little before the routing (right after the previous layer's routing, as two
    // small launches); if the routing comes first, there is no time to read ahead anyway.
    for (unsigned spins = 0; pred.load(std::memory_order_acquire) != st.epoch; ++spins) {
      if (route.load(std::memory_order_acquire) == st.epoch || spins > (1u << 24)) return guessed;
      _mm_pause();
    }
    for (int j = 0; j < k; ++j) {
      const int32_t e = st.h_pred_ids[static_cast<size_t>(l) * k + j];
      if (e >= 0 && e < c_.n_expert && X.slot_of[e] < 0) guessed.push_back(e);
    }
    // The GPU's share takes the last host-resident slots of a token (gpu::RoutePublish's rule, mirrored
    // here), and the routing lists a token's choices most likely first, as the guess does: leave out those.
    if (X.gpu_share()) {
      const float share = static_cast<float>(plan_.host_experts_gpu_share);
      const int take = static_cast<int>(static_cast<float>(guessed.size()) * share + 0.25f);
      guessed.resize(guessed.size() - std::min<size_t>(guessed.size(), static_cast<size_t>(std::max(take, 0))));
    }
    std::vector<size_t> per_thread(static_cast<size_t>(pool.size()), 0);
    pool.run([&](int tid, int nth) {
      per_thread[tid] = cpu::prefetch_expert_slices(*X.host, guessed, tid, nth, [&] {
        return route.load(std::memory_order_acquire) == st.epoch;
      });
    });
    for (const size_t b : per_thread) *bytes += b;
    return guessed;
  }

  // End of the FFN block: add the FFN output (for MoE the experts' outputs combined) to the residual,
  // and norm the result for the next layer's attention (the last layer leaves that to the head).
  // host_rows: the host experts' outputs are in st.ey_host (from ffn_host), not in st.ey.
  void ffn_finish(GpuState& st, int l, int nt, bool host_rows) {
    const bool last = l + 1 == c_.n_layer;
    const float* next_norm = last ? nullptr : layers_[l + 1].attn_norm;
    float* xn = last ? nullptr : st.xn;
    const GExperts& X = layers_[l].experts;
    void* xq = last ? nullptr : xn_q_for(st, layers_[l + 1].wq, nt);
    if (host_rows) {
      // The CPU's rows come straight from pinned memory into the combination, spread over the row;
      // then only the norm is left.
      gpu::handover_combine(st.flags_dev + l, st.epoch_dev, st.ey_slots_dev, st.ey, st.ey_host, st.ids, X.slot_of_dev,
                            c_.n_expert, X.gpu_share() ? st.gpu_slots : nullptr, st.wts, c_.n_expert_used, st.x, nt,
                            c_.n_embd, stream_, st.stamps_dev ? st.stamps_dev + 2 * l : nullptr);
      prof_.mark("host experts (GPU waits) + combine + residual", stream_);
      if (xn)
        gpu::residual_norm(st.x, nullptr, nullptr, nullptr, 0, next_norm, xn, c_.n_embd, nt, c_.rms_eps, stream_, xq);
    } else if (layers_[l].moe && !st.ffn_out_combined)
      gpu::residual_norm(st.x, nullptr, st.ey, st.wts, c_.n_expert_used, next_norm, xn, c_.n_embd, nt, c_.rms_eps,
                         stream_, xq);
    else
      gpu::residual_norm(st.x, st.y, nullptr, nullptr, 0, next_norm, xn, c_.n_embd, nt, c_.rms_eps, stream_, xq,
                         folds_norm(layers_[l], nt) ? st.y_attn : nullptr);
    prof_.mark("combine + residual + norm", stream_);
  }

  // Final norm and output head for the last n_out rows (at most 64) into pinned st.h_out.
  void head(GpuState& st, ThreadPool& pool, int nt, int n_out, int r0) {
    const int E = c_.n_embd;
    const float* last = st.x + static_cast<int64_t>(nt - n_out + r0) * E;
    const int nr = std::min(64, n_out - r0);
    st.xn_q_valid = false;
    gpu::rms_norm(last, output_norm_, st.xn, E, nr, c_.rms_eps, E, E, stream_);
    linear(st, pool, output_, st.xn, nr, st.logits, c_.n_vocab);
    gpu::copy_d2h(st.h_out, st.logits, sizeof(float) * nr * c_.n_vocab, stream_);
    prof_.mark("output head", stream_);
  }

  // Inputs of a micro-batch: positions, and the embedding rows (looked up on the host unless the table
  // is on the GPU as the tied output head). Host work first, then capturable uploads.
  void prepare_inputs(GpuState& st, ThreadPool& pool, std::span<const int32_t> tokens, int pos0) {
    const int nt = static_cast<int>(tokens.size());
    gpu::sync_stream(stream_);  // the pinned inputs may still be read by the previous micro-batch
    for (int t = 0; t < nt; ++t) st.h_pos[t] = pos0 + t;
    *st.h_epoch = ++st.epoch;
    if (embed_dev_.data) std::memcpy(st.h_idx, tokens.data(), sizeof(int32_t) * nt);
    else cpu::embed(pool, w_.tok_embd, tokens, st.h_x);
  }
  void upload_inputs(GpuState& st, int nt) {
    gpu::copy_h2d(st.pos, st.h_pos, sizeof(int32_t) * nt, stream_);
    gpu::copy_h2d(st.epoch_dev, st.h_epoch, sizeof(unsigned), stream_);
    if (embed_dev_.data) {
      gpu::copy_h2d(st.tokens, st.h_idx, sizeof(int32_t) * nt, stream_);
      gpu::embed_rows(embed_dev_, st.tokens, nt, st.x, stream_);
    } else {
      gpu::copy_h2d(st.x, st.h_x, sizeof(float) * nt * c_.n_embd, stream_);
    }
  }

  // Sets every layer's hand-over flag to the current epoch when a step is left by an exception, so
  // that no kernel is left waiting for a flag the host will never set (the rows are then garbage, but
  // the error is already on its way to the caller).
  class FlagGuard {
   public:
    FlagGuard(GpuState& st, int n_layer) : st_(st), n_(n_layer), exceptions_(std::uncaught_exceptions()) {}
    ~FlagGuard() {
      if (std::uncaught_exceptions() > exceptions_)
        for (int l = 0; l < n_; ++l) std::atomic_ref<unsigned>(st_.h_flags[l]).store(st_.epoch, std::memory_order_release);
    }

   private:
    GpuState& st_;
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

  void decode_step_graphs(GpuState& st, ThreadPool& pool, int32_t token, int pos0, float* logits) {
    const int L = c_.n_layer;
    prepare_inputs(st, pool, std::span<const int32_t>(&token, 1), pos0);
    // The attention kernel a graph holds depends on the cache length: capture again when it changes.
    const int variant = gpu::attention_decode_variant(pos0 + 1);
    if (variant != st.graphs_variant) {
      for (void* g : st.graphs)
        if (g) gpu::destroy_graph(g);
      st.graphs.clear();
      st.graphs_variant = variant;
    }
    const FlagGuard guard(st, c_.n_layer);
    Segments seg(st.graphs, stream_);
    seg.begin();
    if (seg.recording()) {
      upload_inputs(st, 1);
      input_norm(st, 1);
      attention_block(st, pool, 0, 1, pos0);
      ffn_gpu(st, pool, 0, 1);
    }
    // A hybrid layer ends a graph; the CPU runs its experts only once the next graph (which waits for
    // them, then goes on to the next hybrid layer's routing) is queued, so the GPU never waits for a
    // launch.
    int host_layer = -1;  // a hybrid layer whose CPU experts are still to run
    for (int l = 0; l < L; ++l) {
      if (hybrid(l)) {
        seg.end();
        if (host_layer >= 0) ffn_host(st, pool, host_layer, 1);
        host_layer = l;
        seg.begin();
      }
      if (!seg.recording()) continue;
      ffn_finish(st, l, 1, hybrid(l));
      if (l + 1 < L) {
        attention_block(st, pool, l + 1, 1, pos0);
        ffn_gpu(st, pool, l + 1, 1);
      } else if (logits) {
        head(st, pool, 1, 1, 0);
      }
    }
    seg.end();
    if (host_layer >= 0) ffn_host(st, pool, host_layer, 1);
    gpu::sync_stream(stream_);
    if (logits) std::memcpy(logits, st.h_out, sizeof(float) * c_.n_vocab);
    if (st.h_stamps) {
      std::vector<int> hyb;
      for (int l = 0; l < L; ++l)
        if (hybrid(l)) hyb.push_back(l);
      host_prof_.add_step(st.h_stamps, hyb);
      std::memset(st.h_stamps, 0, sizeof(unsigned long long) * 2 * L);  // (the stream is idle here)
    }
  }

  void micro_batch(GpuState& st, ThreadPool& pool, std::span<const int32_t> tokens, int pos0, int n_out, float* logits) {
    const int nt = static_cast<int>(tokens.size());
    // Graphs are captured with the output head, so only steps that want logits replay them.
    if (nt == 1 && n_out == 1 && graphs_ok_) return decode_step_graphs(st, pool, tokens[0], pos0, logits);
    prepare_inputs(st, pool, tokens, pos0);
    if (nt <= gpu::kMaxVecTokens) prof_.begin(stream_);
    upload_inputs(st, nt);
    input_norm(st, nt);
    prof_.mark("inputs + first norm", stream_);
    if (nt > gpu::kMaxVecTokens) start_expert_stream(st, nt);
    // Decode-sized micro-batches queue the GPU work up to the next hybrid layer's routing before the
    // CPU runs a hybrid layer's experts (as the graphs do); prefill runs layer by layer. If anything
    // throws while the GPU may be waiting for a flag, the flags are set so that it can finish.
    const FlagGuard guard(st, c_.n_layer);
    int host_layer = -1;
    for (int l = 0; l < c_.n_layer; ++l) {
      attention_block(st, pool, l, nt, pos0);
      if (layers_[l].moe && nt > gpu::kMaxVecTokens) {
        moe_prefill(st, pool, l, nt);
        ffn_finish(st, l, nt, false);
        continue;
      }
      ffn_gpu(st, pool, l, nt);
      if (hybrid(l)) {
        if (host_layer >= 0) ffn_host(st, pool, host_layer, nt);
        host_layer = l;
        // A product on the host waits for the stream, which would wait for this layer's flag: no
        // queueing ahead then.
        if (host_products_) ffn_host(st, pool, l, nt), host_layer = -1;
      }
      ffn_finish(st, l, nt, hybrid(l));
    }
    if (host_layer >= 0) ffn_host(st, pool, host_layer, nt);
    for (int r0 = 0; r0 < n_out; r0 += 64) {
      head(st, pool, nt, n_out, r0);
      gpu::sync_stream(stream_);
      std::memcpy(logits + static_cast<size_t>(r0) * c_.n_vocab, st.h_out,
                  sizeof(float) * std::min(64, n_out - r0) * c_.n_vocab);
    }
    prof_.end(stream_);
    gpu::sync_stream(stream_);
  }

  // Routed experts of one layer for a prefill micro-batch: input st.xn [nt][E], output st.ey, one row
  // per router slot [nt * k][E].
  // Slots are grouped by expert on the host; every device-resident expert then runs in one grouped
  // launch per matrix (gate+up with SwiGLU fused, then down, scattered back to the slots' rows). The
  // host-resident experts run from the upload ring (start_expert_stream) or, for the layers the cost
  // model gave to the CPU, on the CPU threads.
  void moe_prefill(GpuState& st, ThreadPool& pool, int l, int nt) {
    const ModelConfig& c = c_;
    GLayer& G = layers_[l];
    const int E = c.n_embd, k = c.n_expert_used, n_slots = nt * k, NE = c.n_expert;
    const int64_t ff = c.n_ff_exp;
    GExperts& X = G.experts;
    st.ffn_out_combined = false;
    linear(st, pool, G.router, st.xn, nt, st.rlogits, NE);
    gpu::route_topk(st.rlogits, nt, NE, k, st.ids, st.wts, stream_);
    gpu::copy_d2h(st.h_ids, st.ids, sizeof(int32_t) * n_slots, stream_);
    gpu::sync_stream(stream_);

    // Group by expert: offsets, the token of each grouped slot, and the router slot it came from.
    std::vector<int32_t> count(NE + 1, 0);
    for (int j = 0; j < n_slots; ++j) {
      const int e = st.h_ids[j];
      if (e < 0 || e >= NE) throw Error(no_expert_message(e));
      count[e + 1]++;
    }
    int32_t* h_off = st.h_idx;                 // [NE + 1]
    int32_t* h_rows = st.h_idx + NE + 1;       // [n_slots]
    int32_t* h_dst = h_rows + n_slots;         // [n_slots]
    h_off[0] = 0;
    for (int e = 0; e < NE; ++e) h_off[e + 1] = h_off[e] + count[e + 1];
    {
      std::vector<int32_t> fill(h_off, h_off + NE);
      for (int j = 0; j < n_slots; ++j) {
        const int i = fill[st.h_ids[j]]++;
        h_rows[i] = j / k;
        h_dst[i] = j;
      }
    }
    // From now on, copies of this layer's chunks carry only the experts used.
    st.routed_layer = l;
    st.expert_used.assign(NE, 0);
    for (int e = 0; e < NE; ++e) st.expert_used[e] = count[e + 1] > 0;
    gpu::copy_h2d(st.offsets, h_off, sizeof(int32_t) * (NE + 1), stream_);
    gpu::copy_h2d(st.idx_a, h_rows, sizeof(int32_t) * n_slots, stream_);
    gpu::copy_h2d(st.idx_b, h_dst, sizeof(int32_t) * n_slots, stream_);

    if (X.n_dev > 0) {
      // (Mixed gate/up types: the elementwise SwiGLU then runs over all slots; host experts' rows are
      // recomputed from scratch below, so that is harmless.)
      gate_up(st, X.gate, X.up, X.slot_of_dev, n_slots, 0, n_slots);
      gpu::moe_matmul(X.down, st.offsets, NE, X.slot_of_dev, st.g, ff, nullptr, n_slots, st.ey, E, stream_, st.idx_b);
    }

    // Host-resident experts: streamed chunks (already on their way), or the CPU for the ones used.
    if (!X.chunks.empty()) {
      if (st.layer_streams[l]) {
        run_streamed_chunks(st, X, l, h_off);
      } else {
        std::vector<int> host_used;
        for (int e = 0; e < NE; ++e)
          if (X.slot_of[e] < 0 && count[e + 1] > 0) host_used.push_back(e);
        if (!host_used.empty()) host_experts_on_cpu(st, pool, X, host_used, h_off, h_rows, h_dst, nt);
      }
    }
    // No sync here: the pinned routing tables are rewritten only after the next layer's routing sync.
    // The outputs stay per slot in st.ey; ffn_finish combines them.
  }

  // h = silu(gate x) * (up x) for the grouped slots of the experts `slot_of` selects. One fused
  // launch when gate and up share a type; else two products and an elementwise SwiGLU over the rows
  // [row0, row0 + n_rows) that these experts own.
  void gate_up(GpuState& st, const DevMatrix& g3, const DevMatrix& u3, const int32_t* slot_of, int n_slots, int row0,
               int n_rows) {
    const int NE = c_.n_expert, E = c_.n_embd;
    const int64_t ff = c_.n_ff_exp;
    if (g3.type == u3.type) {
      gpu::moe_matmul_swiglu(g3, u3, st.offsets, NE, slot_of, st.xn, E, st.idx_a, n_slots, st.g, ff, stream_);
      return;
    }
    gpu::moe_matmul(g3, st.offsets, NE, slot_of, st.xn, E, st.idx_a, n_slots, st.g, ff, stream_);
    gpu::moe_matmul(u3, st.offsets, NE, slot_of, st.xn, E, st.idx_a, n_slots, st.u, ff, stream_);
    gpu::swiglu(st.g + static_cast<int64_t>(row0) * ff, st.u + static_cast<int64_t>(row0) * ff,
                st.g + static_cast<int64_t>(row0) * ff, static_cast<int64_t>(n_rows) * ff, stream_);
  }

  void host_experts_on_cpu(GpuState& st, ThreadPool& pool, GExperts& X, const std::vector<int>& used,
                           const int32_t* h_off, const int32_t* h_rows, const int32_t* h_dst, int nt) {
    const int E = c_.n_embd;
    gpu::copy_d2h(st.h_xn, st.xn, sizeof(float) * nt * E, stream_);
    gpu::sync_stream(stream_);
    std::vector<int32_t> tok, exp, slot;
    for (int e : used)
      for (int i = h_off[e]; i < h_off[e + 1]; ++i) tok.push_back(h_rows[i]), exp.push_back(e), slot.push_back(h_dst[i]);
    cpu::expert_ffn(pool, *X.host, st.h_xn, nt, E, tok.data(), exp.data(), static_cast<int>(tok.size()), st.h_ey,
                    st.cpu_scratch);
    for (size_t i = 0; i < slot.size(); ++i)
      gpu::copy_h2d(st.ey + static_cast<int64_t>(slot[i]) * E, st.h_ey + i * E, sizeof(float) * E, stream_);
  }

  bool has_host_experts() const {
    for (const auto& G : layers_)
      if (!G.experts.chunks.empty()) return true;
    return false;
  }

  // Before a prefill micro-batch of nt tokens: per MoE layer with host experts, the cost model picks
  // streaming them over PCIe or running the ones used on the CPU, and for a streamed layer whether its
  // copies may start before its routing is known (then they carry whole chunks; see the top of the
  // file). The first chunks of the stream go out at once; each chunk consumed releases the next.
  void start_expert_stream(GpuState& st, int nt) {
    st.layer_streams.assign(c_.n_layer, 0);
    st.layer_waits.assign(c_.n_layer, 0);
    st.routed_layer = -1;
    st.stream_seq.clear();
    st.stream_copied = st.stream_used = 0;
    for (int l = 0; l < c_.n_layer; ++l) {
      const GExperts& X = layers_[l].experts;
      if (!layers_[l].moe || X.chunks.empty()) continue;
      const double per_expert = static_cast<double>(X.host->gate.matrix_bytes() + X.host->up.matrix_bytes() +
                                                    X.host->down.matrix_bytes());
      const HostExpertsCost cost = prefill_host_experts_cost(plan_.options, plan_.machine, nt, c_.n_expert_used,
                                                             c_.n_expert, c_.n_expert - X.n_dev, per_expert);
      if (!cost.stream) continue;
      st.layer_streams[l] = 1;
      st.layer_waits[l] = cost.after_routing;
      for (size_t ci = 0; ci < X.chunks.size(); ++ci) st.stream_seq.emplace_back(l, static_cast<int>(ci));
    }
    issue_chunk_copies(st);
  }

  // Issues the stream's next copies while the ring has a free buffer (chunk i reuses the buffer of
  // chunk i - kPrefillStageSlots, so that one must have been consumed) and the next chunk's layer does
  // not wait for a routing still unknown.
  void issue_chunk_copies(GpuState& st) {
    while (st.stream_copied < st.stream_seq.size() &&
           st.stream_copied < st.stream_used + static_cast<size_t>(kPrefillStageSlots)) {
      const int l = st.stream_seq[st.stream_copied].first;
      if (st.layer_waits[l] && st.routed_layer != l) return;
      issue_chunk_copy(st);
    }
  }

  // Uploads the next chunk of the stream into its ring buffer, once the products that last read that
  // buffer are done: every expert of the chunk, or once the layer's routing is known only the used
  // ones (each at its place in the chunk, so the chunk's expert -> position table still holds). The
  // plan keeps a layer's host experts contiguous, so a chunk is usually one run of consecutive
  // experts: one copy per matrix.
  void issue_chunk_copy(GpuState& st) {
    const size_t i = st.stream_copied++;
    const int b = static_cast<int>(i % kPrefillStageSlots);
    const auto [l, ci] = st.stream_seq[i];
    const GExperts& X = layers_[l].experts;
    const HostChunk& ch = X.chunks[ci];
    const Weight &hg = X.host->gate, &hu = X.host->up, &hd = X.host->down;
    const size_t bg = hg.matrix_bytes(), bu = hu.matrix_bytes(), bd = hd.matrix_bytes();
    auto* base = static_cast<uint8_t*>(st.stage[b]);
    gpu::wait_event(st.copy_stream, st.ev_free[b]);
    const int cnt = static_cast<int>(ch.experts.size());
    const bool routed = st.routed_layer == l;
    auto wanted = [&](int p) { return !routed || st.expert_used[ch.experts[p]]; };
    for (int p = 0; p < cnt;) {
      if (!wanted(p)) {
        ++p;
        continue;
      }
      int run = 1;
      while (p + run < cnt && ch.experts[p + run] == ch.experts[p] + run && wanted(p + run)) ++run;
      const int e = ch.experts[p];
      gpu::copy_h2d(base + bg * p, hg.expert(e).host, bg * run, st.copy_stream);
      gpu::copy_h2d(base + bg * chunk_experts_ + bu * p, hu.expert(e).host, bu * run, st.copy_stream);
      gpu::copy_h2d(base + (bg + bu) * chunk_experts_ + bd * p, hd.expert(e).host, bd * run, st.copy_stream);
      p += run;
    }
    gpu::record_event(st.ev_filled[b], st.copy_stream);
  }

  // The streamed chunks of layer l, in order: wait for a chunk's upload, run its experts' grouped
  // products (skipped when the batch routed nothing to them), free the buffer, release the next copy.
  void run_streamed_chunks(GpuState& st, GExperts& X, int l, const int32_t* h_off) {
    const int NE = c_.n_expert, E = c_.n_embd;
    const int64_t ff = c_.n_ff_exp;
    const Weight &hg = X.host->gate, &hu = X.host->up, &hd = X.host->down;
    const size_t bg = hg.matrix_bytes(), bu = hu.matrix_bytes();
    issue_chunk_copies(st);  // a layer that waited for its routing starts its copies now
    for (size_t ci = 0; ci < X.chunks.size(); ++ci) {
      const size_t i = st.stream_used++;
      if (i >= st.stream_seq.size() || st.stream_seq[i] != std::make_pair(l, static_cast<int>(ci)))
        throw Error("internal: the prefill expert stream is out of order");
      if (i >= st.stream_copied) throw Error("internal: the prefill expert stream stalled");
      const int b = static_cast<int>(i % kPrefillStageSlots);
      const HostChunk& ch = X.chunks[ci];
      int chunk_slots = 0, lo = INT32_MAX, hi = 0;
      for (int e : ch.experts) {
        chunk_slots += h_off[e + 1] - h_off[e];
        if (h_off[e + 1] > h_off[e]) lo = std::min(lo, h_off[e]), hi = std::max(hi, h_off[e + 1]);
      }
      gpu::wait_event(stream_, st.ev_filled[b]);
      if (chunk_slots > 0) {
        auto* base = static_cast<uint8_t*>(st.stage[b]);
        DevMatrix g3 = matrix_view(hg, base), u3 = matrix_view(hu, base + bg * chunk_experts_),
                  d3 = matrix_view(hd, base + (bg + bu) * chunk_experts_);
        g3.n_mats = u3.n_mats = d3.n_mats = static_cast<int>(ch.experts.size());
        // (With mixed gate/up types, SwiGLU covers the grouped rows from the chunk's first used expert
        // to its last.)
        gate_up(st, g3, u3, ch.slot_of_dev, chunk_slots, lo, hi - lo);
        gpu::moe_matmul(d3, st.offsets, NE, ch.slot_of_dev, st.g, ff, nullptr, chunk_slots, st.ey, E, stream_, st.idx_b);
      }
      gpu::record_event(st.ev_free[b], stream_);
      issue_chunk_copies(st);
    }
  }

  const Qwen3Weights& w_;
  const ModelConfig& c_;
  const RopeParams rope_;  // derived once from c_ (YaRN's correction dims, the magnitude)
  const Plan& plan_;
  gpu::DeviceMemory mem_;
  int ubatch_;
  void* stream_ = nullptr;
  GWeight output_;
  const float* output_norm_ = nullptr;
  DevMatrix embed_dev_;
  std::vector<GLayer> layers_;
  bool graphs_ok_ = false;
  bool host_products_ = false;  // a non-expert product runs on the host (it waits for the stream)
  OpProfile prof_;
  // FITMOE_HOST_PROFILE=1: the CPU side of hybrid decode (graphs stay on): per hybrid layer, the time
  // spent waiting for the GPU's routing and in the experts, and the bandwidth the experts reached.
  // With it, the GPU also stamps (with its own clock) when it sees each hybrid layer's hand-over and
  // when it publishes each routing: from one hybrid layer's hand-over to the next one's routing is the
  // GPU's part of the critical path; the rest of the period is the routing's way to the CPU, the CPU's
  // experts and their rows' way back.
  struct HostProfile {
    bool on = std::getenv("FITMOE_HOST_PROFILE") != nullptr;
    double wait_s = 0, experts_s = 0, bytes = 0;
    long layers = 0;
    double gpu_ns = 0, period_ns = 0;
    long gpu_n = 0;
    void add(std::chrono::steady_clock::duration wait, std::chrono::steady_clock::duration experts, double b) {
      wait_s += std::chrono::duration<double>(wait).count();
      experts_s += std::chrono::duration<double>(experts).count();
      bytes += b;
      ++layers;
    }
    // After a decode step: stamps[2l] (hand-over of layer l seen), stamps[2l+1] (routing of l published).
    void add_step(const unsigned long long* stamps, const std::vector<int>& hybrid_layers) {
      for (size_t i = 0; i + 1 < hybrid_layers.size(); ++i) {
        const int a = hybrid_layers[i], b = hybrid_layers[i + 1];
        const double seen_a = static_cast<double>(stamps[2 * a]), pub_b = static_cast<double>(stamps[2 * b + 1]),
                     seen_b = static_cast<double>(stamps[2 * b]);
        if (!(seen_a > 0 && pub_b >= seen_a && seen_b >= pub_b)) continue;  // (a stamp this step did not write)
        gpu_ns += pub_b - seen_a;
        period_ns += seen_b - seen_a;
        ++gpu_n;
      }
    }
    void report() const {
      if (!on || !layers) return;
      std::fprintf(stderr,
                   "\nhost experts (FITMOE_HOST_PROFILE): %ld hybrid layer steps; per layer %.1f us waiting for the GPU's "
                   "routing, %.1f us in the experts (%.2f MB: %.1f GB/s)\n",
                   layers, 1e6 * wait_s / layers, 1e6 * experts_s / layers, bytes / layers / 1e6,
                   experts_s > 0 ? bytes / experts_s / 1e9 : 0.0);
      if (gpu_n)
        std::fprintf(stderr,
                     "GPU clock: %.1f us per hybrid layer, of which %.1f us from the hand-over to the next routing "
                     "published, %.1f us from that to the next hand-over (routing to the CPU, its experts, rows back)\n",
                     period_ns / gpu_n / 1e3, gpu_ns / gpu_n / 1e3, (period_ns - gpu_ns) / gpu_n / 1e3);
    }
  } host_prof_;
  RoutingGuessStats guess_stats_;
  // FITMOE_PREDICT=0 turns the routing guess and the prefetch off (for A/B measurements).
  const bool predict_ = [] {
    const char* e = std::getenv("FITMOE_PREDICT");
    return !(e && std::string(e) == "0");
  }();
  const int chunk_experts_;  // host experts per streamed prefill chunk
};

}  // namespace

std::unique_ptr<GpuRunner> make_qwen3_gpu(const Qwen3Weights& w, const ModelConfig& c, const Plan& plan,
                                          const LoadOptions& opt) {
  return std::make_unique<Qwen3Gpu>(w, c, plan, opt);
}

}  // namespace fitmoe
