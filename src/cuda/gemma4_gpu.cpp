// Gemma 4 (gemma4: dense and MoE) on the GPU: the weights, the per-sequence state (a KV cache per
// layer with KV of its own, a ring of window + kSlidingMicroBatch positions on sliding layers, none on
// shared-KV layers) and the layer program the step driver runs. Mirrors the CPU pass
// (src/model/gemma4.cpp) op for op; the ops only gemma4 needs are in gemma4.h.
//
// A layer for the step driver: front = the attention block (into x, with its post norm), the FFN
// norm, the dense GeGLU FFN and (MoE layers) the routed GeGLU experts, each branch normed and summed
// into ws.y; back = post_ffw_norm, the residual, layer_output_scale and the next layer's attn_norm.
//
// The routed experts run in this file, not through MoeExecutor (first version, simple and
// conservative): the router (on RMSNorm(x) / sqrt(n_embd) * its scale) and route_topk on the GPU, the
// per-expert scale on the weights, the device-resident experts by matvec_experts on views of the
// packed stacks (the fused ffn_gate_up_exps: gate and up are two views of one stack) and
// gemma4_geglu, in pieces of kMaxVecTokens tokens for prefill; host-resident experts on the CPU
// threads synchronously (the rows copied up one by one); then moe_combine. So no decode graphs when a
// layer has host experts, no routing guess, no GPU share, no prefill streaming yet.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "cuda/flash_attention.h"
#include "cuda/gemma4.h"
#include "cuda/linear.h"
#include "cuda/step_driver.h"
#include "model/gemma4.h"
#include "model/gpu_runner.h"
#include "runtime/error.h"
#include "runtime/thread_pool.h"

namespace fitmoe {

namespace {

using gpu::DevMatrix;
using gpu::GWeight;
using gpu::Step;

// A layer's routed experts as this file runs them: gate / up views (two of one stack when fused),
// down, the expert -> slot table.
struct G4Experts {
  DevMatrix gate, up, down;
  std::vector<int32_t> slot_of;
  int32_t* slot_of_dev = nullptr;
  int n_dev = 0;
  const cpu::ExpertWeights* host = nullptr;
};

struct GLayer {
  LayerSpec spec;
  const float *attn_norm = nullptr, *q_norm = nullptr, *k_norm = nullptr, *post_attn_norm = nullptr;
  const float *ffn_norm = nullptr, *post_ffw_norm_1 = nullptr, *pre_ffw_norm_2 = nullptr, *post_ffw_norm_2 = nullptr;
  const float *router_scale = nullptr, *expert_scale = nullptr, *post_ffw_norm = nullptr, *out_scale = nullptr;
  GWeight wq, wk, wv, wo, ffn_gate, ffn_up, ffn_down, router;
  G4Experts experts;
  bool moe = false;
};

// Per-sequence state: a GpuState (its own KV cache left empty: the specs it is given have no attention
// layer; its decode graphs) and gemma4's caches (rings on sliding layers, none on shared-KV layers).
class Gemma4GpuState final : public gpu::GpuState {
 public:
  Gemma4GpuState(gpu::Engine& e, const StateOptions& opt, const std::vector<LayerSpec>& specs,
                 const std::vector<LayerSpec>& no_kv)
      : GpuState(e, opt, &no_kv), e_(e) {
    const int L = static_cast<int>(specs.size());
    std::vector<int> dk, dv;
    for (const LayerSpec& l : specs) dk.push_back(l.attn().head_dim), dv.push_back(l.attn().head_dim_v);
    const KvRotation rot = gpu::check_gpu_kv_type(opt.kv, dk, dv);
    kv_.assign(L, gpu::DevKv{opt.kv.k, nullptr, nullptr, 0});
    ring_.assign(L, false);
    for (int l = 0; l < L; ++l) {
      const AttnSpec& a = specs[l].attn();
      if (a.kv_from >= 0) continue;
      const int cap = static_cast<int>(a.kv_positions(opt.n_ctx));
      ring_[l] = a.window > 0;
      if (ring_[l] && cap < opt.n_ctx) window_ = std::max(window_, a.window);
      kv_[l] = gpu::alloc_dev_kv(e.mem, opt.kv, rot, cap, a.n_head_kv, a.head_dim, a.head_dim_v, &kv_bytes_, e.stream);
      owned_.push_back(kv_[l].k);
      owned_.push_back(kv_[l].v);
    }
    for (int l = 0; l < L; ++l) {
      const AttnSpec& a = specs[l].attn();
      if (a.kv_from >= 0) kv_[l] = kv_[a.kv_from], ring_[l] = ring_[a.kv_from];
    }
    gpu::sync_stream(e.stream);
  }
  ~Gemma4GpuState() override {
    gpu::sync_stream(e_.stream);
    for (void* p : owned_) e_.mem.free(p);
  }

  size_t bytes() const override { return kv_bytes_; }
  // As the CPU state: a ring that has wrapped lost the positions it overwrote.
  bool recurrent() const override { return window_ > 0; }
  void truncate(int n) override {
    if (n >= n_past_) return;
    n = std::max(n, 0);
    if (window_ > 0 && n_past_ - n > kSlidingMicroBatch + 1) n = 0;
    n_past_ = n;
  }

  const gpu::DevKv& kv(int l) const { return kv_[l]; }
  bool ring(int l) const { return ring_[l]; }

 private:
  gpu::Engine& e_;
  int window_ = 0;
  size_t kv_bytes_ = 0;
  std::vector<gpu::DevKv> kv_;
  std::vector<bool> ring_;
  std::vector<void*> owned_;
};

class Gemma4Gpu final : public GpuRunner, private gpu::LayerProgram {
 public:
  Gemma4Gpu(const Gemma4Weights& w, const ModelConfig& c, const Plan& plan, const LoadOptions& opt)
      : w_(w), c_(c), e_(c_, plan) {
    for (const Gemma4Layer& L : w_.layers) specs_.push_back(L.spec);
    no_kv_.resize(specs_.size());
    for (LayerSpec& s : no_kv_) s.mixer = DeltaSpec{};
    upload_all(opt);
    gpu::gemma4_gelu_table();  // (its upload is a synchronous copy: never inside a graph capture)
    bool host_products = !output_.on_gpu();
    bool host_experts = false;
    for (const GLayer& G : layers_) {
      for (const GWeight* g : {&G.wq, &G.wk, &G.wv, &G.wo, &G.ffn_gate, &G.ffn_up, &G.ffn_down, &G.router})
        if (g->host && *g->host && !g->on_gpu()) host_products = true;
      if (G.moe && G.experts.n_dev < c_.n_expert) host_experts = true;
    }
    // (Host experts run synchronously inside front: no graphs then.)
    const bool graphs_ok = !host_products && !host_experts && e_.sw.graphs && !e_.prof.on();
    moe_ = std::make_unique<gpu::MoeExecutor>(e_, std::vector<gpu::MoeLayer>(c_.n_layer));
    streamer_ = std::make_unique<gpu::ExpertStreamer>(e_, *moe_);
    driver_ = std::make_unique<gpu::StepDriver>(e_, static_cast<gpu::LayerProgram&>(*this), *moe_, *streamer_,
                                                graphs_ok, host_products || host_experts);
  }

  std::unique_ptr<ModelState> new_state(const StateOptions& opt) override {
    gpu::WorkspaceShape shape;
    // A sliding layer's ring holds its window plus kSlidingMicroBatch positions: micro-batches of at
    // most that many tokens.
    shape.ubatch = std::min(e_.ubatch, kSlidingMicroBatch);
    for (const LayerSpec& sp : specs_) {
      const AttnSpec& a = sp.attn();
      shape.act_width = std::max<int64_t>({shape.act_width, static_cast<int64_t>(a.n_head) * a.head_dim,
                                           static_cast<int64_t>(a.n_head_kv) * a.head_dim, c_.n_ff, c_.n_ff_exp});
    }
    bool fresh;
    gpu::Workspace& ws = e_.workspace(shape, opt, &fresh);
    if (fresh) alloc_scratch(ws);
    return std::make_unique<Gemma4GpuState>(e_, opt, specs_, no_kv_);
  }

  std::string memory_report() const override { return e_.mem.usage_report(); }
  uint64_t memory_used() const override { return e_.mem.used(); }

  void forward(ThreadPool& pool, const BatchRows& batch, float* logits) override {
    for (const BatchPart& p : batch.parts)
      if (!dynamic_cast<Gemma4GpuState*>(p.state)) throw Error("forward: the state is not a " + c_.arch + " GPU state");
    driver_->forward(pool, batch, logits);
  }

 private:
  // ---- loading --------------------------------------------------------------------------------
  void upload_all(const LoadOptions& opt) {
    const Plan& plan = e_.plan;
    uint64_t total = plan.gpu_weights + plan.gpu_experts, done = 0;
    auto tick = [&](uint64_t b) {
      done += b;
      if (opt.progress) opt.progress("uploading weights to the GPU", done, total);
    };
    auto place = [&](const Weight& w) {
      GWeight g = gpu::place(e_, w);
      if (w) tick(w.matrix_bytes());
      return g;
    };
    auto norm = [&](const Weight& w) { return gpu::upload_norm(e_, w); };
    if (w_.output) output_ = place(w_.output);
    output_norm_ = norm(w_.output_norm);
    rope_freqs_ = norm(w_.rope_freqs);
    if (w_.tok_embd.info == w_.output.info && output_.on_gpu()) embed_dev_ = output_.dev;
    layers_.resize(c_.n_layer);
    for (int l = 0; l < c_.n_layer; ++l) {
      const Gemma4Layer& L = w_.layers[l];
      GLayer& G = layers_[l];
      G.spec = L.spec;
      G.attn_norm = norm(L.attn_norm);
      G.q_norm = norm(L.q_norm);
      G.k_norm = norm(L.k_norm);
      G.post_attn_norm = norm(L.post_attn_norm);
      G.ffn_norm = norm(L.ffn_norm);
      G.post_ffw_norm = norm(L.post_ffw_norm);
      G.out_scale = norm(L.out_scale);
      G.wq = place(L.wq);
      G.wk = place(L.wk);
      G.wv = place(L.wv);
      G.wo = place(L.wo);
      G.ffn_gate = place(L.ffn_gate);
      G.ffn_up = place(L.ffn_up);
      G.ffn_down = place(L.ffn_down);
      G.moe = L.spec.moe.has_value();
      if (G.moe) {
        G.post_ffw_norm_1 = norm(L.post_ffw_norm_1);
        G.pre_ffw_norm_2 = norm(L.pre_ffw_norm_2);
        G.post_ffw_norm_2 = norm(L.post_ffw_norm_2);
        G.router_scale = norm(L.router_scale);
        G.expert_scale = norm(L.expert_scale);
        G.router = place(L.router);
        upload_experts(L.experts, G.experts, tick);
      }
      gpu::sync_stream(e_.stream);
    }
  }

  // A layer's routed experts: the device-resident ones (as the plan marks the gate / gate_up tensor)
  // packed by slot, each of the three (or two, fused) stacks one allocation.
  void upload_experts(const cpu::ExpertWeights& host, G4Experts& X, const std::function<void(uint64_t)>& tick) {
    const int NE = c_.n_expert;
    X.host = &host;
    const Weight& first = host.fused() ? host.gate_up : host.gate;
    const TensorPlacement* tp = e_.plan.find(first.info->name);
    X.slot_of.assign(NE, -1);
    for (int e = 0; e < NE; ++e)
      if (tp && !tp->expert_on_gpu.empty() && tp->expert_on_gpu[e]) X.slot_of[e] = X.n_dev++;
    auto pack = [&](const Weight& w3) {
      DevMatrix m = gpu::matrix_view(w3, nullptr);
      m.n_mats = X.n_dev;
      if (X.n_dev == 0) return m;
      auto* d = static_cast<uint8_t*>(e_.mem.alloc(m.mat_bytes * X.n_dev, "routed experts"));
      for (int e = 0; e < NE; ++e)
        if (X.slot_of[e] >= 0) gpu::copy_h2d(d + m.mat_bytes * X.slot_of[e], w3.expert(e).host, m.mat_bytes, e_.stream);
      m.data = d;
      tick(m.mat_bytes * X.n_dev);
      return m;
    };
    if (host.fused()) {
      // ffn_gate_up_exps: per expert 2 * n_ff rows, gate then up. Both views step by the whole matrix.
      const DevMatrix gu = pack(host.gate_up);
      const int64_t nf = gu.rows / 2;
      X.gate = gu;
      X.gate.rows = nf;
      X.up = X.gate;
      X.up.data = gu.data ? gu.data + static_cast<size_t>(nf) * gu.row_bytes : nullptr;
    } else {
      X.gate = pack(host.gate);
      X.up = pack(host.up);
    }
    X.down = pack(host.down);
    X.slot_of_dev = reinterpret_cast<int32_t*>(e_.upload(X.slot_of.data(), sizeof(int32_t) * NE, "routing tables"));
  }

  static Gemma4GpuState& state(const gpu::SeqRows& q) { return static_cast<Gemma4GpuState&>(*q.st); }

  // gemma4's scratch beyond the workspace's (allocated from it once, shared by every sequence).
  struct Scratch {
    float *q = nullptr, *k = nullptr, *v = nullptr, *att = nullptr, *y2 = nullptr, *rin = nullptr, *xe = nullptr;
    float *dg = nullptr, *du = nullptr, *eg = nullptr, *eu = nullptr, *ey = nullptr, *rlog = nullptr, *wts = nullptr;
    int32_t* ids = nullptr;
    int32_t* h_ids = nullptr;
    float *h_xe = nullptr, *h_ey = nullptr;
  } S_;
  void alloc_scratch(gpu::Workspace& ws) {
    int64_t qw = 1, kw = 1;
    for (const LayerSpec& sp : specs_) {
      qw = std::max<int64_t>(qw, static_cast<int64_t>(sp.attn().n_head) * sp.attn().head_dim);
      kw = std::max<int64_t>(kw, static_cast<int64_t>(sp.attn().n_head_kv) * sp.attn().head_dim);
    }
    const ModelConfig& c = c_;
    Scratch& S = S_;
    const int64_t U = ws.ub, E = c.n_embd;
    S.q = ws.dev_floats(U * qw, "activations");
    S.k = ws.dev_floats(U * kw, "activations");
    S.v = ws.dev_floats(U * kw, "activations");
    S.att = ws.dev_floats(U * qw, "activations");
    S.y2 = ws.dev_floats(U * E, "activations");
    S.rin = ws.dev_floats(U * E, "activations");
    S.xe = ws.dev_floats(U * E, "activations");
    S.dg = ws.dev_floats(U * std::max(c.n_ff, 1), "activations");
    S.du = ws.dev_floats(U * std::max(c.n_ff, 1), "activations");
    if (c.n_expert) {
      const int64_t slots = static_cast<int64_t>(gpu::kMaxVecTokens) * c.n_expert_used;
      S.eg = ws.dev_floats(slots * c.n_ff_exp, "activations");
      S.eu = ws.dev_floats(slots * c.n_ff_exp, "activations");
      S.ey = ws.dev_floats(U * c.n_expert_used * E, "activations");
      S.rlog = ws.dev_floats(U * c.n_expert, "activations");
      S.ids = static_cast<int32_t*>(ws.dev_bytes(sizeof(int32_t) * U * c.n_expert_used, "activations"));
      S.wts = ws.dev_floats(U * c.n_expert_used, "activations");
      S.h_ids = ws.host<int32_t>(static_cast<size_t>(U) * c.n_expert_used);
      S.h_xe = ws.host<float>(static_cast<size_t>(U) * E);
      S.h_ey = ws.host<float>(static_cast<size_t>(U) * c.n_expert_used * E);
    }
    gpu::sync_stream(e_.stream);
  }

  // ---- the layer program ------------------------------------------------------------------------
  void embed_host(Step& s, std::span<const int32_t> tokens) override {
    if (embed_dev_.data) std::memcpy(s.ws.h_idx, tokens.data(), sizeof(int32_t) * tokens.size());
    else cpu::embed(s.pool, w_.tok_embd, tokens, s.ws.h_x);
  }

  void inputs(Step& s, int nt) override {
    gpu::Workspace& ws = s.ws;
    void* const stream = e_.stream;
    const int E = c_.n_embd;
    if (embed_dev_.data) {
      gpu::copy_h2d(ws.tokens, ws.h_idx, sizeof(int32_t) * nt, stream);
      gpu::embed_rows(embed_dev_, ws.tokens, nt, ws.x, stream);
    } else {
      gpu::copy_h2d(ws.x, ws.h_x, sizeof(float) * nt * E, stream);
    }
    gpu::gemma4_scale(ws.x, static_cast<int64_t>(nt) * E, std::sqrt(static_cast<float>(E)), stream);
    gpu::rms_norm(ws.x, layers_[0].attn_norm, ws.xn, E, nt, c_.rms_eps, E, E, stream);
    ws.xn_q_valid = false;
  }

  // On entry ws.xn = attn_norm(x). Leaves the FFN's output (before post_ffw_norm) in ws.y.
  void front(Step& s, int l, int nt) override {
    gpu::Workspace& ws = s.ws;
    Scratch& S = S_;
    void* const stream = e_.stream;
    GLayer& G = layers_[l];
    const int E = c_.n_embd;
    const float eps = c_.rms_eps;
    ws.xn_q_valid = false;
    ws.att_q_valid = false;
    attention_block(s, l, nt);
    // x += post_attention_norm(y); xn = ffn_norm(x).
    gpu::rms_norm(ws.y, G.post_attn_norm, ws.y, E, nt, eps, E, E, stream);
    gpu::residual_norm(ws.x, ws.y, nullptr, nullptr, 0, G.ffn_norm, ws.xn, E, nt, eps, stream);
    ws.xn_q_valid = false;
    e_.prof.mark("wo, post norm, residual, ffn norm", stream);
    // The dense GeGLU FFN into y.
    const int64_t ff = c_.n_ff;
    gpu::linear_shared(s, {{&G.ffn_gate, S.dg, ff}, {&G.ffn_up, S.du, ff}}, ws.xn, nt);
    gpu::gemma4_geglu(S.dg, S.du, S.dg, static_cast<int64_t>(nt) * ff, stream);
    gpu::linear(s, G.ffn_down, S.dg, nt, ws.y, E);
    e_.prof.mark("dense ffn", stream);
    if (!G.moe) return;
    gpu::rms_norm(ws.y, G.post_ffw_norm_1, ws.y, E, nt, eps, E, E, stream);
    moe_block(s, l, nt);  // into S.y2
    gpu::rms_norm(S.y2, G.post_ffw_norm_2, S.y2, E, nt, eps, E, E, stream);
    gpu::add(ws.y, S.y2, static_cast<int64_t>(nt) * E, stream);
    e_.prof.mark("host experts, combine, norms", stream);
  }

  // y = post_ffw_norm(y); x += y; x *= layer_output_scale; xn = next attn_norm(x).
  void back(Step& s, int l, int nt, bool) override {
    gpu::Workspace& ws = s.ws;
    void* const stream = e_.stream;
    const GLayer& G = layers_[l];
    const int E = c_.n_embd;
    const int64_t n = static_cast<int64_t>(nt) * E;
    gpu::rms_norm(ws.y, G.post_ffw_norm, ws.y, E, nt, c_.rms_eps, E, E, stream);
    gpu::add(ws.x, ws.y, n, stream);
    if (G.out_scale) gpu::gemma4_scale_by(ws.x, n, G.out_scale, stream);
    if (l + 1 < c_.n_layer) gpu::rms_norm(ws.x, layers_[l + 1].attn_norm, ws.xn, E, nt, c_.rms_eps, E, E, stream);
    ws.xn_q_valid = false;
    e_.prof.mark("layer end", stream);
  }

  // gpu::output_head with the softcap between the product and the copy out.
  void head(Step& s, int nt, int n_out, int r0) override {
    gpu::Workspace& ws = s.ws;
    void* const stream = e_.stream;
    const int E = c_.n_embd;
    const float* last = ws.x + static_cast<int64_t>(nt - n_out + r0) * E;
    const int nr = std::min(64, n_out - r0);
    ws.xn_q_valid = false;
    gpu::rms_norm(last, output_norm_, ws.xn, E, nr, c_.rms_eps, E, E, stream);
    gpu::linear(s, output_, ws.xn, nr, ws.logits, c_.n_vocab);
    if (c_.final_logit_softcap > 0)
      gpu::gemma4_softcap(ws.logits, static_cast<int64_t>(nr) * c_.n_vocab, c_.final_logit_softcap, stream);
    gpu::copy_d2h(ws.h_out, ws.logits, sizeof(float) * nr * c_.n_vocab, stream);
    e_.prof.mark("output head", stream);
  }

  // The CPU's attention_block: q (norm, RoPE); own KV: k, v (= k where K = V), norms, RoPE of k,
  // the store; attention over the layer's (or its source's) cache; wo into ws.y.
  void attention_block(Step& s, int l, int nt) {
    gpu::Workspace& ws = s.ws;
    Scratch& S = S_;
    void* const stream = e_.stream;
    GLayer& G = layers_[l];
    const AttnSpec& a = G.spec.attn();
    const int hd = a.head_dim;
    const int64_t qw = static_cast<int64_t>(a.n_head) * hd, kw = static_cast<int64_t>(a.n_head_kv) * hd;
    const float eps = c_.rms_eps;
    const RopeParams rope = make_rope_params(a.n_rot, a.rope_base, 1.0f, 0.0f, 1.0f, 32.0f, 1.0f, c_.n_ctx_train);
    const float* ff = a.rope_freqs ? rope_freqs_ : nullptr;
    if (a.kv_from < 0) {
      if (G.wv.host && *G.wv.host)
        gpu::linear_shared(s, {{&G.wq, S.q, qw}, {&G.wk, S.k, kw}, {&G.wv, S.v, kw}}, ws.xn, nt);
      else
        gpu::linear_shared(s, {{&G.wq, S.q, qw}, {&G.wk, S.k, kw}}, ws.xn, nt);
    } else {
      gpu::linear(s, G.wq, ws.xn, nt, S.q, qw);
    }
    gpu::rms_norm(S.q, G.q_norm, S.q, hd, nt * a.n_head, eps, hd, hd, stream);
    gpu::gemma4_rope(S.q, nt, a.n_head, hd, qw, a.n_rot, ws.pos, rope, ff, stream);
    if (a.kv_from < 0) {
      if (!(G.wv.host && *G.wv.host))  // K = V: V is the raw K projection
        gpu::copy_d2d(S.v, S.k, sizeof(float) * static_cast<size_t>(nt) * kw, stream);
      gpu::rms_norm(S.k, G.k_norm, S.k, hd, nt * a.n_head_kv, eps, hd, hd, stream);
      gpu::rms_norm(S.v, nullptr, S.v, hd, nt * a.n_head_kv, eps, hd, hd, stream);
      gpu::gemma4_rope(S.k, nt, a.n_head_kv, hd, kw, a.n_rot, ws.pos, rope, ff, stream);
    }
    // Per sequence: the store into its cache (ring), attention over it.
    for (const gpu::SeqRows& sq : s.seqs) {
      const Gemma4GpuState& st = state(sq);
      const gpu::DevKv& kv = st.kv(l);
      const int64_t r = sq.row0;
      if (a.kv_from < 0) {
        if (kv.flash)
          gpu::flash_kv_store(kv, st.ring(l), ws.pos + r, sq.n, S.k + r * kw, kw, S.v + r * kw, kw, a.n_head_kv, hd, hd,
                              stream);
        else
          gpu::gemma4_kv_store(kv, st.ring(l), ws.pos + r, sq.n, S.k + r * kw, kw, S.v + r * kw, kw, a.n_head_kv, hd,
                               stream);
      }
      e_.prof.mark(a.window > 0 ? "q/k/v, norms, rope, store (sliding)" : "q/k/v, norms, rope, store (global)", stream);
      if (kv.flash)  // (the most keys a query sees: the window, or the cache's capacity, as gemma4_attention)
        gpu::flash_attention(S.q + r * qw, qw, kv, st.ring(l), a.window, ws.pos + r, sq.n,
                             a.window > 0 ? std::min(a.window, kv.n_ctx) : kv.n_ctx, a.n_head, a.n_head_kv, hd, hd,
                             a.scale, S.att + r * qw, qw, ws.attn_scratch, ws.attn_scratch_bytes, stream);
      else
        gpu::gemma4_attention(S.q + r * qw, qw, kv, st.ring(l), ws.pos + r, sq.n, a.n_head, a.n_head_kv, hd, a.scale,
                              a.window, S.att + r * qw, qw, stream);
      e_.prof.mark(a.window > 0 ? "attention (sliding)" : "attention (global)", stream);
    }
    gpu::linear(s, G.wo, S.att, nt, ws.y, c_.n_embd);
  }

  // The routed experts of layer l from the residual x (after attention) into S.y2 (before
  // post_ffw_norm_2), as the CPU's ffn_block.
  void moe_block(Step& s, int l, int nt) {
    gpu::Workspace& ws = s.ws;
    Scratch& S = S_;
    void* const stream = e_.stream;
    GLayer& G = layers_[l];
    G4Experts& X = G.experts;
    const int E = c_.n_embd, NE = c_.n_expert, k = c_.n_expert_used;
    const int64_t nf = c_.n_ff_exp;
    const float eps = c_.rms_eps;
    // Router: on RMSNorm(x) / sqrt(n_embd) * its scale; softmax, top-k, renormalised; * expert scale.
    gpu::gemma4_router_input(ws.x, G.router_scale, S.rin, E, nt, eps, 1.0f / std::sqrt(static_cast<float>(E)), stream);
    gpu::linear(s, G.router, S.rin, nt, S.rlog, NE);
    gpu::route_topk(S.rlog, nt, NE, k, S.ids, S.wts, stream);
    if (G.expert_scale) gpu::gemma4_expert_scale(S.wts, S.ids, G.expert_scale, nt * k, stream);
    // The experts' input.
    gpu::rms_norm(ws.x, G.pre_ffw_norm_2, S.xe, E, nt, eps, E, E, stream);
    e_.prof.mark("router, top-k, expert input norm", stream);
    // Prefill micro-batches: every device-resident expert of the layer in one grouped product per
    // matrix (gpu::moe_matmul), as ExpertStreamer::run does for the other architectures.
    if (X.n_dev > 0 && nt > gpu::kMaxVecTokens) grouped_experts(s, l, nt);
    // Decode-sized micro-batches: per slot gate and up rows, GeGLU, down (mat-vec products).
    if (X.n_dev > 0 && nt <= gpu::kMaxVecTokens) {
      for (int t0 = 0; t0 < nt; t0 += gpu::kMaxVecTokens) {
        const int n = std::min(gpu::kMaxVecTokens, nt - t0), n_slots = n * k;
        const int32_t* ids = S.ids + static_cast<int64_t>(t0) * k;
        const float* xin = S.xe + static_cast<int64_t>(t0) * E;
        const void* acts = gpu::vec_acts(s, X.gate.type, xin, n, E);
        gpu::matvec_experts(X.gate, ids, X.slot_of_dev, n_slots, acts, ws.act_row, S.eg, nf, stream);
        if (dtype_info(X.up.type).act_type != dtype_info(X.gate.type).act_type) acts = gpu::vec_acts(s, X.up.type, xin, n, E);
        gpu::matvec_experts(X.up, ids, X.slot_of_dev, n_slots, acts, ws.act_row, S.eu, nf, stream);
        gpu::gemma4_geglu(S.eg, S.eu, S.eg, static_cast<int64_t>(n_slots) * nf, stream);
        acts = gpu::vec_acts(s, X.down.type, S.eg, n_slots, nf);
        gpu::matvec_experts(X.down, ids, X.slot_of_dev, n_slots, acts, ws.ident,
                            S.ey + static_cast<int64_t>(t0) * k * E, E, stream);
      }
    }
    e_.prof.mark("device experts", stream);
    // Host-resident experts on the CPU threads, synchronously.
    if (X.n_dev < NE) {
      const int n_slots = nt * k;
      gpu::copy_d2h(S.h_ids, S.ids, sizeof(int32_t) * n_slots, stream);
      gpu::copy_d2h(S.h_xe, S.xe, sizeof(float) * static_cast<size_t>(nt) * E, stream);
      gpu::sync_stream(stream);
      std::vector<int32_t> tok, exp, slot;
      for (int j = 0; j < n_slots; ++j) {
        const int32_t e = S.h_ids[j];
        if (e < 0 || e >= NE) throw Error(gpu::no_expert_message(e));
        if (X.slot_of[e] < 0) tok.push_back(j / k), exp.push_back(e), slot.push_back(j);
      }
      if (!tok.empty()) {
        cpu::expert_ffn(s.pool, *X.host, S.h_xe, nt, E, tok.data(), exp.data(), static_cast<int>(tok.size()), S.h_ey,
                        ws.cpu_scratch, slot.data(), {}, Activation::GeluTanh);
        for (const int32_t j : slot)
          gpu::copy_h2d(S.ey + static_cast<int64_t>(j) * E, S.h_ey + static_cast<int64_t>(j) * E, sizeof(float) * E,
                        stream);
        gpu::sync_stream(stream);  // (h_ey is rewritten by the next layer)
      }
    }
    gpu::moe_combine(S.ey, S.wts, nt, k, E, S.y2, stream);
  }

  // The device-resident routed experts of layer l for a prefill micro-batch of nt tokens: the slots
  // grouped by expert on the host (offsets, each grouped slot's token and router slot), then gate and
  // up over the grouped rows into ws.g / ws.u, GeGLU, and down scattered back to router-slot order
  // in S.ey. Inputs rounded as the reference's integer products see them (gpu::round_acts), in the
  // dequantization scratch, which the grouped products do not use.
  void grouped_experts(Step& s, int l, int nt) {
    gpu::Workspace& ws = s.ws;
    Scratch& S = S_;
    void* const stream = e_.stream;
    G4Experts& X = layers_[l].experts;
    const int E = c_.n_embd, NE = c_.n_expert, k = c_.n_expert_used, n_slots = nt * k;
    const int64_t nf = c_.n_ff_exp;
    gpu::copy_d2h(S.h_ids, S.ids, sizeof(int32_t) * n_slots, stream);
    gpu::sync_stream(stream);
    int32_t* h_off = ws.h_idx;            // [NE + 1]
    int32_t* h_rows = h_off + NE + 1;     // [n_slots]: the token of each grouped slot
    int32_t* h_dst = h_rows + n_slots;    // [n_slots]: its router slot
    std::fill(h_off, h_off + NE + 1, 0);
    for (int j = 0; j < n_slots; ++j) {
      const int32_t e = S.h_ids[j];
      if (e < 0 || e >= NE) throw Error(gpu::no_expert_message(e));
      ++h_off[e + 1];
    }
    for (int e = 0; e < NE; ++e) h_off[e + 1] += h_off[e];
    std::vector<int32_t> fill(h_off, h_off + NE);
    for (int j = 0; j < n_slots; ++j) {
      const int i = fill[S.h_ids[j]]++;
      h_rows[i] = j / k;
      h_dst[i] = j;
    }
    gpu::copy_h2d(ws.offsets, h_off, sizeof(int32_t) * (NE + 1), stream);
    gpu::copy_h2d(ws.idx_a, h_rows, sizeof(int32_t) * n_slots, stream);
    gpu::copy_h2d(ws.idx_b, h_dst, sizeof(int32_t) * n_slots, stream);
    auto rounded = [&](DType weight_type) -> const float* {
      const DType act = dtype_info(weight_type).act_type;
      if (!gpu::rounds_acts(act)) return S.xe;
      if (static_cast<size_t>(nt) * E * sizeof(float) > ws.dequant_bytes)
        throw Error("internal: the dequantization scratch cannot hold the experts' rounded input");
      auto* xr = static_cast<float*>(ws.dequant);
      gpu::round_acts(act, S.xe, E, nt, E, xr, E, stream);
      return xr;
    };
    const float* xr = rounded(X.gate.type);
    gpu::moe_matmul(X.gate, ws.offsets, NE, X.slot_of_dev, xr, E, ws.idx_a, n_slots, ws.g, nf, stream);
    if (dtype_info(X.up.type).act_type != dtype_info(X.gate.type).act_type) xr = rounded(X.up.type);
    gpu::moe_matmul(X.up, ws.offsets, NE, X.slot_of_dev, xr, E, ws.idx_a, n_slots, ws.u, nf, stream);
    gpu::gemma4_geglu(ws.g, ws.u, ws.g, static_cast<int64_t>(n_slots) * nf, stream);
    const DType down_act = dtype_info(X.down.type).act_type;
    if (gpu::rounds_acts(down_act)) gpu::round_acts(down_act, ws.g, nf, n_slots, nf, ws.g, nf, stream);
    gpu::moe_matmul(X.down, ws.offsets, NE, X.slot_of_dev, ws.g, nf, nullptr, n_slots, S.ey, E, stream, ws.idx_b);
    // (The host tables are rewritten by the next layer only after its routing's sync.)
  }

  const Gemma4Weights& w_;
  const ModelConfig c_;
  gpu::Engine e_;
  std::vector<LayerSpec> specs_, no_kv_;
  GWeight output_;
  const float *output_norm_ = nullptr, *rope_freqs_ = nullptr;
  DevMatrix embed_dev_;
  std::vector<GLayer> layers_;
  std::unique_ptr<gpu::MoeExecutor> moe_;
  std::unique_ptr<gpu::ExpertStreamer> streamer_;
  std::unique_ptr<gpu::StepDriver> driver_;
};

}  // namespace

std::unique_ptr<GpuRunner> make_gemma4_gpu(const Gemma4Weights& w, const ModelConfig& c, const Plan& plan,
                                           const LoadOptions& opt) {
  return std::make_unique<Gemma4Gpu>(w, c, plan, opt);
}

}  // namespace fitmoe
