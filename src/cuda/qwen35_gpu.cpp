// Qwen3.5 / Qwen3.6 (qwen35 dense, qwen35moe) on the GPU, with hybrid CPU/GPU experts: the weights,
// the per-sequence state (KV caches for the full-attention layers, conv + delta state for the Gated
// DeltaNet layers, and checkpoints of the latter) and the layer program. The machinery every
// architecture shares is in the files engine.h lists; the qwen35 kernels are in deltanet.h, whose
// header gives the order in which a layer calls them.
//
// The forward pass mirrors the CPU one (src/model/qwen35.cpp) op for op. A layer is two halves for the
// step driver: front (the mixer block, gated attention or DeltaNet, its residual add and the FFN norm,
// then the FFN or the MoE block up to the routing, the GPU's own experts and the shared expert) and
// back (after the hand-over of the CPU's experts: the combination, the shared expert's gated add, the
// residual and the next layer's input norm). The MTP (nextn) block is not run here: the engine runs
// the trunk (its config below counts the trunk's layers only); qwen35_mtp_forward stays on the CPU.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "cuda/deltanet.h"
#include "cuda/linear.h"
#include "cuda/step_driver.h"
#include "model/gpu_runner.h"
#include "model/qwen35.h"
#include "runtime/error.h"
#include "runtime/thread_pool.h"

namespace fitmoe {

namespace {

using gpu::DevMatrix;
using gpu::GWeight;
using gpu::Step;

struct GLayer {
  LayerSpec spec;
  const float *attn_norm = nullptr, *post_norm = nullptr, *q_norm = nullptr, *k_norm = nullptr;
  const float *conv1d = nullptr, *dt_bias = nullptr, *ssm_a = nullptr, *ssm_norm = nullptr;
  GWeight wq, wk, wv, wo;                               // gated attention (wq: [q | gate] per head)
  GWeight wqkv, wgate, w_beta, w_alpha, ssm_out;        // Gated DeltaNet
  GWeight router, ffn_gate, ffn_up, ffn_down;
  gpu::GExperts experts;
  gpu::SharedExpert shared;
  bool moe = false, has_shared = false;
  // The first product of the layer (its input is the layer's attn_norm output): for xn_q_for.
  const GWeight& first() const { return spec.is_attention() ? wq : wqkv; }
};

// The trunk as the engine sees it: the MTP block's layer is not part of the GPU pass.
ModelConfig trunk_config(const ModelConfig& c) {
  ModelConfig t = c;
  t.n_layer = c.n_layer_trunk();
  t.n_layer_mtp = 0;
  t.recurrent_layers.resize(static_cast<size_t>(t.n_layer));
  return t;
}

// Per-sequence state on the GPU: GpuState (KV caches of the attention layers, graphs), the DeltaNet
// layers' conv + delta state in one device block (so that a checkpoint is one copy) and the
// checkpoints (allocated with the state, as the plan charges them).
// checkpoint / truncate have the CPU state's semantics (src/model/qwen35.cpp): a checkpoint copies the
// recurrent block at n_past (position 0 is the zero state); truncate(n) lands at the nearest
// checkpoint at or below n (or 0) and the caller feeds the tokens up to n again. Every copy is queued
// on the engine's stream, in order with the forward passes.
class Qwen35GpuState final : public gpu::GpuState {
 public:
  Qwen35GpuState(gpu::Engine& e, const StateOptions& opt, const std::vector<LayerSpec>& specs)
      : GpuState(e, opt, &specs), e_(e), max_cps_(std::max(0, opt.max_checkpoints)) {
    const int L = static_cast<int>(specs.size());
    conv_off_.assign(L, -1);
    delta_off_.assign(L, -1);
    int64_t rec = 0;
    for (int l = 0; l < L; ++l) {
      if (specs[l].is_attention()) continue;
      const DeltaSpec& d = specs[l].delta();
      conv_off_[l] = rec;
      rec += d.conv_state_floats();
      delta_off_[l] = rec;
      rec += d.delta_state_floats();
    }
    rec_floats_ = rec;
    if (rec_floats_ > 0) {
      rec_ = static_cast<float*>(e.mem.alloc(rec_bytes(), "DeltaNet state"));
      gpu::memset_async(rec_, 0, rec_bytes(), e.stream);
      for (int i = 0; i < max_cps_; ++i) free_.push_back(e.mem.alloc(rec_bytes(), "DeltaNet state checkpoints"));
    }
    gpu::sync_stream(e.stream);
  }
  ~Qwen35GpuState() override {
    gpu::sync_stream(e_.stream);
    for (const Checkpoint& c : cps_) free_.push_back(c.buf);
    for (void* p : free_) e_.mem.free(p);
    if (rec_) e_.mem.free(rec_);
  }

  size_t bytes() const override { return kv.bytes() + rec_bytes() * (1 + static_cast<size_t>(max_cps_)); }
  bool recurrent() const override { return rec_floats_ > 0; }

  void checkpoint() override {
    if (rec_floats_ == 0 || n_past_ == 0 || max_cps_ == 0) return;  // position 0 is the zero state
    if (!cps_.empty() && cps_.back().pos == n_past_) {
      gpu::copy_d2d(cps_.back().buf, rec_, rec_bytes(), e_.stream);
      return;
    }
    void* buf;
    if (static_cast<int>(cps_.size()) >= max_cps_) {  // the oldest one goes
      buf = cps_.front().buf;
      cps_.erase(cps_.begin());
    } else {
      buf = free_.back();
      free_.pop_back();
    }
    gpu::copy_d2d(buf, rec_, rec_bytes(), e_.stream);
    cps_.push_back({n_past_, buf});
  }

  void truncate(int n) override {
    if (n >= n_past_) return;
    n = std::max(n, 0);
    if (rec_floats_ == 0) {
      n_past_ = n;
      return;
    }
    // (As the CPU state: checkpoints are at increasing positions, the KV caches stay valid below any
    // position, only the recurrent state moves back.)
    while (!cps_.empty() && cps_.back().pos > n) {
      free_.push_back(cps_.back().buf);
      cps_.pop_back();
    }
    if (cps_.empty()) {
      gpu::memset_async(rec_, 0, rec_bytes(), e_.stream);
      n_past_ = 0;
    } else {
      gpu::copy_d2d(rec_, cps_.back().buf, rec_bytes(), e_.stream);
      n_past_ = cps_.back().pos;
    }
  }

  float* conv(int l) { return rec_ + conv_off_[l]; }
  float* delta(int l) { return rec_ + delta_off_[l]; }

 private:
  struct Checkpoint {
    int pos;
    void* buf;
  };
  size_t rec_bytes() const { return static_cast<size_t>(rec_floats_) * sizeof(float); }
  gpu::Engine& e_;
  const int max_cps_;
  int64_t rec_floats_ = 0;
  float* rec_ = nullptr;
  std::vector<int64_t> conv_off_, delta_off_;
  std::vector<Checkpoint> cps_;
  std::vector<void*> free_;
};

class Qwen35Gpu final : public GpuRunner, private gpu::LayerProgram {
 public:
  Qwen35Gpu(const Qwen35Weights& w, const ModelConfig& c, const Plan& plan, const LoadOptions& opt)
      : w_(w), ct_(trunk_config(c)), rope_(rope_params(c)), e_(ct_, plan) {
    for (const Qwen35Layer& L : w_.layers) specs_.push_back(L.spec);
    upload_all(opt);
    // Decode graphs need every op of a step on the GPU (see qwen3_gpu.cpp).
    bool host_products = !output_.on_gpu();
    for (auto& G : layers_)
      for (const GWeight* w : {&G.wq, &G.wk, &G.wv, &G.wo, &G.wqkv, &G.wgate, &G.w_beta, &G.w_alpha, &G.ssm_out,
                               &G.router, &G.ffn_gate, &G.ffn_up, &G.ffn_down, &G.shared.gate, &G.shared.up,
                               &G.shared.down, &G.shared.gate_inp})
        if (w->host && *w->host && !w->on_gpu()) host_products = true;
    const bool graphs_ok = !host_products && e_.sw.graphs && !e_.prof.on();
    std::vector<gpu::MoeLayer> moe(ct_.n_layer);
    for (int l = 0; l < ct_.n_layer; ++l) {
      GLayer& G = layers_[l];
      if (!G.moe) continue;
      moe[l].router = &G.router;
      moe[l].experts = &G.experts;
      moe[l].guess_norm = G.post_norm;  // (the router reads post_attention_norm(x), as do the experts)
      moe[l].fold_norm = G.post_norm;
      if (G.has_shared) moe[l].shared = &G.shared;
    }
    moe_ = std::make_unique<gpu::MoeExecutor>(e_, std::move(moe));
    streamer_ = std::make_unique<gpu::ExpertStreamer>(e_, *moe_);
    driver_ = std::make_unique<gpu::StepDriver>(e_, static_cast<gpu::LayerProgram&>(*this), *moe_, *streamer_,
                                                graphs_ok, host_products);
  }

  std::unique_ptr<ModelState> new_state(const StateOptions& opt) override {
    gpu::WorkspaceShape shape;
    shape.ubatch = e_.ubatch;
    if (ct_.n_expert) {
      for (const auto& L : w_.layers)
        shape.expert_bytes = std::max(shape.expert_bytes, L.experts.gate.matrix_bytes() + L.experts.up.matrix_bytes() +
                                                              L.experts.down.matrix_bytes());
      shape.host_experts = streamer_->has_host_experts();
      shape.shared_ff = ct_.n_ff_shexp;
    }
    // The widest row a product reads or writes beyond qwen3's widths: [q | gate], the DeltaNet's
    // projections and its output.
    for (const LayerSpec& sp : specs_) {
      if (sp.is_attention()) {
        shape.act_width = std::max<int64_t>(shape.act_width, 2 * static_cast<int64_t>(sp.attn().n_head) * sp.attn().head_dim);
      } else {
        shape.act_width = std::max<int64_t>({shape.act_width, sp.delta().conv_channels(), sp.delta().value_dim()});
      }
    }
    bool fresh;
    gpu::Workspace& ws = e_.workspace(shape, opt, &fresh);
    if (fresh) alloc_scratch(ws);
    return std::make_unique<Qwen35GpuState>(e_, opt, specs_);
  }

  std::string memory_report() const override { return e_.mem.usage_report(); }
  uint64_t memory_used() const override { return e_.mem.used(); }
  RoutingGuessStats routing_guess_stats() const override { return e_.guess_stats; }

  void forward(ThreadPool& pool, const BatchRows& batch, float* logits) override {
    for (const BatchPart& p : batch.parts)
      if (!dynamic_cast<Qwen35GpuState*>(p.state)) throw Error("forward: the state is not a " + ct_.arch + " GPU state");
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
    if (w_.output) output_ = place(w_.output);
    output_norm_ = gpu::upload_norm(e_, w_.output_norm);
    if (w_.tok_embd.info == w_.output.info && output_.on_gpu()) embed_dev_ = output_.dev;
    layers_.resize(ct_.n_layer);  // (never resized again: the executor points into it)
    for (int l = 0; l < ct_.n_layer; ++l) {
      const Qwen35Layer& L = w_.layers[l];
      GLayer& G = layers_[l];
      G.spec = L.spec;
      G.attn_norm = gpu::upload_norm(e_, L.attn_norm);
      G.post_norm = gpu::upload_norm(e_, L.post_norm);
      if (L.spec.is_attention()) {
        G.q_norm = gpu::upload_norm(e_, L.q_norm);
        G.k_norm = gpu::upload_norm(e_, L.k_norm);
        G.wq = place(L.wq);
        G.wk = place(L.wk);
        G.wv = place(L.wv);
        G.wo = place(L.wo);
      } else {
        // (conv1d is [channels][kernel] f32, the others 1-D f32: uploaded as they lie.)
        G.conv1d = gpu::upload_norm(e_, L.conv1d);
        G.dt_bias = gpu::upload_norm(e_, L.dt_bias);
        G.ssm_a = gpu::upload_norm(e_, L.ssm_a);
        G.ssm_norm = gpu::upload_norm(e_, L.ssm_norm);
        G.wqkv = place(L.wqkv);
        G.wgate = place(L.wgate);
        G.w_beta = place(L.w_beta);
        G.w_alpha = place(L.w_alpha);
        G.ssm_out = place(L.ssm_out);
      }
      G.moe = L.spec.moe.has_value();
      if (G.moe) {
        G.router = place(L.router);
        gpu::upload_experts(e_, L.experts, G.experts, tick);
        G.has_shared = static_cast<bool>(L.shexp_gate);
        if (G.has_shared) {
          G.shared.gate = place(L.shexp_gate);
          G.shared.up = place(L.shexp_up);
          G.shared.down = place(L.shexp_down);
          G.shared.gate_inp = place(L.shexp_gate_inp);
        }
      } else {
        G.ffn_gate = place(L.ffn_gate);
        G.ffn_up = place(L.ffn_up);
        G.ffn_down = place(L.ffn_down);
      }
      gpu::sync_stream(e_.stream);  // host sources of this layer may be reused by the caller
    }
  }

  static Qwen35GpuState& state(const gpu::SeqRows& q) { return static_cast<Qwen35GpuState&>(*q.st); }

  // qwen35's scratch beyond the workspace's (allocated from it once, shared by every sequence): the
  // DeltaNet's projections, conv output, gates and output; gated attention's [q | gate] rows and its gate.
  void alloc_scratch(gpu::Workspace& ws) {
    int64_t ch = 1, vd = 1, hv = 1, qw = 1;
    for (const LayerSpec& sp : specs_) {
      if (sp.is_attention()) {
        qw = std::max<int64_t>(qw, static_cast<int64_t>(sp.attn().n_head) * sp.attn().head_dim);
        continue;
      }
      const DeltaSpec& d = sp.delta();
      ch = std::max<int64_t>(ch, d.conv_channels());
      vd = std::max<int64_t>(vd, d.value_dim());
      hv = std::max<int64_t>(hv, d.n_v_heads);
    }
    const int64_t U = ws.ub;
    S.qkv = ws.dev_floats(U * ch, "activations");
    S.co = ws.dev_floats(U * ch, "activations");
    S.z = ws.dev_floats(U * vd, "activations");
    S.beta = ws.dev_floats(U * hv, "activations");
    S.alpha = ws.dev_floats(U * hv, "activations");
    S.o = ws.dev_floats(U * vd, "activations");
    S.qg = ws.dev_floats(U * 2 * qw, "activations");
    S.gate = ws.dev_floats(U * qw, "activations");
    gpu::sync_stream(e_.stream);
  }
  struct Scratch {
    float *qkv = nullptr, *co = nullptr, *z = nullptr, *beta = nullptr, *alpha = nullptr, *o = nullptr;
    float *qg = nullptr, *gate = nullptr;
  } S;

  // ---- the layer program (gpu::LayerProgram) ---------------------------------------------------
  void embed_host(Step& s, std::span<const int32_t> tokens) override {
    if (embed_dev_.data) std::memcpy(s.ws.h_idx, tokens.data(), sizeof(int32_t) * tokens.size());
    else cpu::embed(s.pool, w_.tok_embd, tokens, s.ws.h_x);
  }

  void inputs(Step& s, int nt) override {
    gpu::Workspace& ws = s.ws;
    void* const stream = e_.stream;
    if (embed_dev_.data) {
      gpu::copy_h2d(ws.tokens, ws.h_idx, sizeof(int32_t) * nt, stream);
      gpu::embed_rows(embed_dev_, ws.tokens, nt, ws.x, stream);
    } else {
      gpu::copy_h2d(ws.x, ws.h_x, sizeof(float) * nt * ct_.n_embd, stream);
    }
    const int E = ct_.n_embd;
    gpu::rms_norm(ws.x, layers_[0].attn_norm, ws.xn, E, nt, ct_.rms_eps, E, E, stream);
    ws.xn_q_valid = false;
  }

  // The mixer block (x -> x + mixer(xn), xn = post_attention_norm(x)), then the FFN up to the
  // hand-over. On entry xn holds attn_norm(x). With folds_norm (no shared expert, every expert on the
  // GPU, one token) the block ends at the mixer's output in y_attn and the router's launch does the rest.
  void front(Step& s, int l, int nt) override {
    gpu::Workspace& ws = s.ws;
    GLayer& G = layers_[l];
    const int E = ct_.n_embd;
    const bool fold = moe_->folds_norm(l, nt);
    float* out = fold ? ws.y_attn : ws.y;
    if (G.spec.is_attention()) attention_block(s, l, nt, out);
    else delta_block(s, l, nt, out);
    if (!fold) {
      const GWeight& next = G.moe ? GWeight{G.experts.gate, nullptr} : G.ffn_gate;
      gpu::residual_norm(ws.x, ws.y, nullptr, nullptr, 0, G.post_norm, ws.xn, E, nt, ct_.rms_eps, e_.stream,
                         gpu::xn_q_for(s, next, nt));
      e_.prof.mark("residual + ffn norm", e_.stream);
    }
    const gpu::MoeIo io{ws.xn, ws.xn};
    if (G.moe && nt > gpu::kMaxVecTokens) {
      streamer_->run(s, l, nt, io);
      if (G.has_shared) moe_->shared_part(s, l, nt, io.expert_in);
    } else if (G.moe) {
      moe_->gpu_part(s, l, nt, io);
    } else {
      dense_ffn(s, l, nt);
    }
  }

  void back(Step& s, int l, int nt, bool host_rows) override {
    const bool last = l + 1 == ct_.n_layer;
    gpu::finish_layer(s, moe_.get(), layers_[l].moe, l, nt, host_rows, last ? nullptr : layers_[l + 1].attn_norm,
                      last ? nullptr : &layers_[l + 1].first(), ct_.n_embd, ct_.rms_eps);
  }

  void head(Step& s, int nt, int n_out, int r0) override {
    gpu::output_head(s, output_norm_, output_, ct_.n_embd, ct_.n_vocab, ct_.rms_eps, nt, n_out, r0);
  }

  // Gated full attention (deltanet.h's order): [q | gate], k, v from one input; the prologue (q, k
  // RMSNorm, multi-section RoPE, the cache store, the gate split off); attention; * sigmoid(gate); wo.
  void attention_block(Step& s, int l, int nt, float* out) {
    gpu::Workspace& ws = s.ws;
    void* const stream = e_.stream;
    GLayer& G = layers_[l];
    const AttnSpec& a = G.spec.attn();
    const int hd = a.head_dim, hdv = a.head_dim_v;
    const int64_t qw = static_cast<int64_t>(a.n_head) * hd, kw = static_cast<int64_t>(a.n_head_kv) * hd,
                  vw = static_cast<int64_t>(a.n_head_kv) * hdv, aw = static_cast<int64_t>(a.n_head) * hdv;
    gpu::linear_shared(s, {{&G.wq, S.qg, 2 * qw}, {&G.wk, ws.k, kw}, {&G.wv, ws.v, vw}}, ws.xn, nt);
    e_.prof.mark("attn q+gate,k,v", stream);
    for (const gpu::SeqRows& q : s.seqs) {  // (each sequence's rows into its own cache)
      const gpu::DevKv& kv = q.st->kv.layers[l];
      const int64_t r = q.row0;
      gpu::gated_attn_prologue(a, q.n, S.qg + r * 2 * qw, 2 * qw, ws.q + r * qw, qw, S.gate + r * qw, qw, ws.k + r * kw,
                               kw, ws.v + r * vw, vw, G.q_norm, G.k_norm, &kv, ws.pos + r, rope_, ct_.rms_eps, stream);
      e_.prof.mark("q/k norm + rope + kv store", stream);
      gpu::attention(ws.q + r * qw, qw, kv, q.pos0, ws.pos + r, q.n, q.st->n_ctx(), a.n_head, a.n_head_kv, hd, hdv,
                     a.scale, ws.att + r * aw, aw, ws.attn_scratch, ws.attn_scratch_bytes, stream, nullptr);
    }
    ws.att_q_valid = false;  // (the gate comes first)
    e_.prof.mark("attention", stream);
    gpu::delta_mul_sigmoid(ws.att, S.gate, nt * aw, stream);
    gpu::linear(s, G.wo, ws.att, nt, out, ct_.n_embd);
    e_.prof.mark("attn gate + output", stream);
  }

  // Gated DeltaNet (deltanet.h's order): qkv, z, beta, alpha from one input; conv1d + SiLU with its
  // state; the delta rule (the gates formed in the kernel; q and k L2-normalised in it for decode,
  // by delta_l2_norm first for prefill); the gated RMSNorm; ssm_out. Conv and rule per sequence (its
  // own state), the rest over every row.
  void delta_block(Step& s, int l, int nt, float* out) {
    gpu::Workspace& ws = s.ws;
    void* const stream = e_.stream;
    GLayer& G = layers_[l];
    const DeltaSpec& d = G.spec.delta();
    const int64_t ch = d.conv_channels(), kd = d.key_dim(), vd = d.value_dim(), hv = d.n_v_heads;
    gpu::linear_shared(s, {{&G.wqkv, S.qkv, ch}, {&G.wgate, S.z, vd}, {&G.w_beta, S.beta, hv}, {&G.w_alpha, S.alpha, hv}},
                       ws.xn, nt);
    e_.prof.mark("deltanet qkv,z,beta,alpha", stream);
    for (const gpu::SeqRows& q : s.seqs)
      gpu::delta_conv1d_silu(S.qkv + q.row0 * ch, ch, q.n, static_cast<int>(ch), G.conv1d, d.conv_kernel,
                             state(q).conv(l), S.co + q.row0 * ch, ch, stream);
    const bool prefill = nt > gpu::kMaxVecTokens;
    if (prefill) gpu::delta_l2_norm(S.co, ch, nt, 2 * d.n_k_heads, d.head_k_dim, ct_.rms_eps, stream);
    for (const gpu::SeqRows& q : s.seqs) {
      const int64_t r = q.row0;
      float* c0 = S.co + r * ch;
      gpu::gated_delta_rule(d, q.n, c0, c0 + kd, ch, c0 + 2 * kd, ch, S.alpha + r * hv, S.beta + r * hv, hv, G.dt_bias,
                            G.ssm_a, !prefill, ct_.rms_eps, state(q).delta(l), S.o + r * vd, vd, stream);
    }
    gpu::delta_gated_rms_norm(S.o, G.ssm_norm, S.z, S.o, d.head_v_dim, nt * d.n_v_heads, ct_.rms_eps, stream);
    e_.prof.mark("deltanet conv + rule + norm", stream);
    gpu::linear(s, G.ssm_out, S.o, nt, out, ct_.n_embd);
    e_.prof.mark("deltanet output", stream);
  }

  // The dense FFN (qwen35, SwiGLU): output in ws.y.
  void dense_ffn(Step& s, int l, int nt) {
    gpu::Workspace& ws = s.ws;
    GLayer& G = layers_[l];
    const int64_t ff = ct_.n_ff;
    gpu::linear_shared(s, {{&G.ffn_gate, ws.g, ff}, {&G.ffn_up, ws.u, ff}}, ws.xn, nt);
    gpu::swiglu(ws.g, ws.u, ws.g, static_cast<int64_t>(nt) * ff, e_.stream);
    gpu::linear(s, G.ffn_down, ws.g, nt, ws.y, ct_.n_embd);
    e_.prof.mark("ffn", e_.stream);
  }

  const Qwen35Weights& w_;
  const ModelConfig ct_;   // the trunk's config (what the engine runs)
  const RopeParams rope_;
  gpu::Engine e_;
  std::vector<LayerSpec> specs_;  // the trunk's layers
  GWeight output_;
  const float* output_norm_ = nullptr;
  DevMatrix embed_dev_;
  std::vector<GLayer> layers_;
  std::unique_ptr<gpu::MoeExecutor> moe_;
  std::unique_ptr<gpu::ExpertStreamer> streamer_;
  std::unique_ptr<gpu::StepDriver> driver_;
};

}  // namespace

std::unique_ptr<GpuRunner> make_qwen35_gpu(const Qwen35Weights& w, const ModelConfig& c, const Plan& plan,
                                           const LoadOptions& opt) {
  return std::make_unique<Qwen35Gpu>(w, c, plan, opt);
}

}  // namespace fitmoe
