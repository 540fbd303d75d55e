// Qwen3 / Qwen3-MoE on the GPU, with hybrid CPU/GPU experts: the weights and the layer program. The
// machinery every architecture shares is in the files engine.h lists (the MoE executor, the prefill
// expert streamer, the step driver, the workspace, the linear products).
//
// The forward pass mirrors the CPU one (src/model/qwen3.cpp) op for op, on gpu_ops (a few neighbouring
// ops run as one fused kernel with the same arithmetic, e.g. residual add + RMSNorm). What the plan put
// in host memory runs on the CPU: the routed experts of an MoE layer may be split, some on each side.
// A layer is two halves for the step driver: front (the attention block, the FFN norm, the FFN or the
// MoE block up to the routing and the GPU's own experts) and back (after the hand-over of the CPU's
// experts: the combination into the residual and the next layer's attention norm).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "cuda/linear.h"
#include "cuda/step_driver.h"
#include "model/qwen3.h"
#include "runtime/error.h"
#include "runtime/thread_pool.h"

namespace fitmoe {

namespace {

using gpu::DevMatrix;
using gpu::GWeight;
using gpu::Step;

struct GLayer {
  const float *attn_norm = nullptr, *q_norm = nullptr, *k_norm = nullptr, *ffn_norm = nullptr;
  GWeight wq, wk, wv, wo, router, ffn_gate, ffn_up, ffn_down;
  gpu::GExperts experts;
  bool moe = false;
};

class Qwen3Gpu final : public GpuRunner, private gpu::LayerProgram {
 public:
  Qwen3Gpu(const Qwen3Weights& w, const ModelConfig& c, const Plan& plan, const LoadOptions& opt)
      : w_(w), c_(c), rope_(rope_params(c)), e_(c, plan) {
    upload_all(opt);
    // Decode graphs need every op of a step on the GPU (a host-resident non-expert weight makes its
    // product synchronise with the host); --no-decode-graphs (PlanOptions::decode_graphs) turns them off for comparison.
    bool host_products = !output_.on_gpu();
    for (auto& G : layers_)
      for (const GWeight* w : {&G.wq, &G.wk, &G.wv, &G.wo, &G.router, &G.ffn_gate, &G.ffn_up, &G.ffn_down})
        if (w->host && *w->host && !w->on_gpu()) host_products = true;
    const bool graphs_ok = !host_products && e_.sw.graphs && !e_.prof.on();
    std::vector<gpu::MoeLayer> moe(c_.n_layer);
    for (int l = 0; l < c_.n_layer; ++l) {
      GLayer& G = layers_[l];
      if (!G.moe) continue;
      moe[l].router = &G.router;
      moe[l].experts = &G.experts;
      moe[l].guess_norm = G.ffn_norm;  // (the router reads ffn_norm(x), as do the experts)
      moe[l].fold_norm = G.ffn_norm;
    }
    moe_ = std::make_unique<gpu::MoeExecutor>(e_, std::move(moe));
    streamer_ = std::make_unique<gpu::ExpertStreamer>(e_, *moe_);
    driver_ = std::make_unique<gpu::StepDriver>(e_, static_cast<gpu::LayerProgram&>(*this), *moe_, *streamer_, graphs_ok, host_products);
  }

  std::unique_ptr<ModelState> new_state(const StateOptions& opt) override {
    gpu::WorkspaceShape shape;
    shape.ubatch = e_.ubatch;
    if (c_.n_expert) {
      // The upload ring for host experts streamed during prefill (sized as the plan assumed).
      for (const auto& L : w_.layers)
        shape.expert_bytes = std::max(shape.expert_bytes, L.experts.gate.matrix_bytes() + L.experts.up.matrix_bytes() +
                                                              L.experts.down.matrix_bytes());
      shape.host_experts = streamer_->has_host_experts();
    }
    bool fresh;
    e_.workspace(shape, opt, &fresh);
    return std::make_unique<gpu::GpuState>(e_, opt);
  }

  std::string memory_report() const override { return e_.mem.usage_report(); }
  uint64_t memory_used() const override { return e_.mem.used(); }
  RoutingGuessStats routing_guess_stats() const override { return e_.guess_stats; }

  void forward(ThreadPool& pool, const BatchRows& batch, float* logits) override {
    for (const BatchPart& p : batch.parts)
      if (!dynamic_cast<gpu::GpuState*>(p.state)) throw Error("forward: the state is not a " + c_.arch + " GPU state");
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
    if (w_.output) {
      output_ = gpu::place(e_, w_.output);
      tick(w_.output.matrix_bytes());
    }
    output_norm_ = gpu::upload_norm(e_, w_.output_norm);
    if (w_.tok_embd.info == w_.output.info && output_.on_gpu()) embed_dev_ = output_.dev;
    layers_.resize(c_.n_layer);
    for (int l = 0; l < c_.n_layer; ++l) {
      const Qwen3Layer& L = w_.layers[l];
      GLayer& G = layers_[l];
      G.attn_norm = gpu::upload_norm(e_, L.attn_norm);
      G.q_norm = gpu::upload_norm(e_, L.q_norm);
      G.k_norm = gpu::upload_norm(e_, L.k_norm);
      G.ffn_norm = gpu::upload_norm(e_, L.ffn_norm);
      G.wq = gpu::place(e_, L.wq);
      G.wk = gpu::place(e_, L.wk);
      G.wv = gpu::place(e_, L.wv);
      G.wo = gpu::place(e_, L.wo);
      tick(L.wq.matrix_bytes() + L.wk.matrix_bytes() + L.wv.matrix_bytes() + L.wo.matrix_bytes());
      G.moe = static_cast<bool>(L.router);
      if (G.moe) {
        G.router = gpu::place(e_, L.router);
        gpu::upload_experts(e_, L.experts, G.experts, tick);
      } else {
        G.ffn_gate = gpu::place(e_, L.ffn_gate);
        G.ffn_up = gpu::place(e_, L.ffn_up);
        G.ffn_down = gpu::place(e_, L.ffn_down);
      }
      gpu::sync_stream(e_.stream);  // host sources of this layer may be reused by the caller
    }
  }

  // ---- the layer program (gpu::LayerProgram) ---------------------------------------------------
  void embed_host(Step& s, std::span<const int32_t> tokens) override {
    if (embed_dev_.data) std::memcpy(s.ws.h_idx, tokens.data(), sizeof(int32_t) * tokens.size());
    else cpu::embed(s.pool, w_.tok_embd, tokens, s.ws.h_x);
  }

  // The embedding rows (looked up on the host unless the table is on the GPU as the tied output head),
  // and xn = attn_norm of layer 0 (x); later layers get theirs from the previous back().
  void inputs(Step& s, int nt) override {
    gpu::Workspace& ws = s.ws;
    void* const stream = e_.stream;
    if (embed_dev_.data) {
      gpu::copy_h2d(ws.tokens, ws.h_idx, sizeof(int32_t) * nt, stream);
      gpu::embed_rows(embed_dev_, ws.tokens, nt, ws.x, stream);
    } else {
      gpu::copy_h2d(ws.x, ws.h_x, sizeof(float) * nt * c_.n_embd, stream);
    }
    ws.xn_q_valid = false;
    gpu::rms_norm(ws.x, layers_[0].attn_norm, ws.xn, c_.n_embd, nt, c_.rms_eps, c_.n_embd, c_.n_embd, stream);
  }

  void front(Step& s, int l, int nt) override {
    attention_block(s, l, nt);
    const gpu::MoeIo io{s.ws.xn, s.ws.xn};
    if (layers_[l].moe && nt > gpu::kMaxVecTokens) streamer_->run(s, l, nt, io);
    else if (layers_[l].moe) moe_->gpu_part(s, l, nt, io);
    else dense_ffn(s, l, nt);
  }

  // End of the FFN block: add the FFN output (for MoE the experts' outputs combined) to the residual,
  // and norm the result for the next layer's attention (the last layer leaves that to the head).
  void back(Step& s, int l, int nt, bool host_rows) override {
    const bool last = l + 1 == c_.n_layer;
    gpu::finish_layer(s, moe_.get(), layers_[l].moe, l, nt, host_rows, last ? nullptr : layers_[l + 1].attn_norm,
                      last ? nullptr : &layers_[l + 1].wq, c_.n_embd, c_.rms_eps);
  }

  // Final norm and output head for the last n_out rows (at most 64) into pinned ws.h_out.
  void head(Step& s, int nt, int n_out, int r0) override {
    gpu::output_head(s, output_norm_, output_, c_.n_embd, c_.n_vocab, c_.rms_eps, nt, n_out, r0);
  }

  // Attention block of layer l and the FFN norm: x -> x + attn(xn), xn = ffn_norm(x). On entry xn
  // holds attn_norm(x) (from inputs or the previous layer's back). With folds_norm the block ends at
  // the attention output (in y_attn); the router's launch does the rest.
  void attention_block(Step& s, int l, int nt) {
    const ModelConfig& c = c_;
    gpu::Workspace& st = s.ws;
    void* const stream = e_.stream;
    gpu::OpProfile& prof = e_.prof;
    GLayer& G = layers_[l];
    const int E = c.n_embd, hd = c.head_dim, hdv = c.head_dim_v;
    const int qw = c.n_head * hd, kw = c.n_head_kv * hd, vw = c.n_head_kv * hdv, aw = c.n_head * hdv;
    gpu::linear_shared(s, {{&G.wq, st.q, qw}, {&G.wk, st.k, kw}, {&G.wv, st.v, vw}}, st.xn, nt);
    prof.mark("attn q,k,v", stream);
    // Per sequence: its rows' norms, RoPE and store into its cache, then attention over it. The
    // decode kernel can hand wo its input in Q8_K (one quantize launch fewer) when one sequence fills
    // the micro-batch.
    void* att_q = st.att_q && nt <= gpu::kMaxVecTokens && s.seqs.size() == 1 && G.wo.on_gpu() &&
                          dtype_info(G.wo.dev.type).act_type == DType::Q8_K
                      ? st.att_q
                      : nullptr;
    st.att_q_valid = att_q != nullptr;
    for (const gpu::SeqRows& q : s.seqs) {
      const gpu::DevKv& kv = q.st->kv.layers[l];
      const int64_t r = q.row0;
      gpu::qk_norm_rope_store(st.q + r * qw, qw, st.k + r * kw, kw, st.v + r * vw, vw, G.q_norm, G.k_norm, kv,
                              st.pos + r, q.n, c.n_head, c.n_head_kv, hd, hdv, c.n_rot, rope_, c.rms_eps, stream);
      prof.mark("q/k norm + rope + kv store", stream);
      const bool q8 = gpu::attention(st.q + r * qw, qw, kv, q.pos0, st.pos + r, q.n, q.st->n_ctx(), c.n_head,
                                     c.n_head_kv, hd, hdv, 1.0f / std::sqrt(static_cast<float>(hd)), st.att + r * aw, aw,
                                     st.attn_scratch, st.attn_scratch_bytes, stream, att_q);
      st.att_q_valid = st.att_q_valid && q8;
    }
    prof.mark("attention", stream);
    const bool fold = moe_->folds_norm(l, nt);
    gpu::linear(s, G.wo, st.att, nt, fold ? st.y_attn : st.y, E);
    st.att_q_valid = false;
    prof.mark("attn output", stream);
    if (fold) return;
    const GWeight& next = G.moe ? GWeight{G.experts.gate, nullptr} : G.ffn_gate;
    gpu::residual_norm(st.x, st.y, nullptr, nullptr, 0, G.ffn_norm, st.xn, E, nt, c.rms_eps, stream,
                       gpu::xn_q_for(s, next, nt));
    prof.mark("residual + ffn norm", stream);
  }

  // The dense FFN (SwiGLU): output in ws.y.
  void dense_ffn(Step& s, int l, int nt) {
    gpu::Workspace& st = s.ws;
    GLayer& G = layers_[l];
    const int64_t ff = c_.n_ff;
    gpu::linear(s, G.ffn_gate, st.xn, nt, st.g, ff);
    gpu::linear(s, G.ffn_up, st.xn, nt, st.u, ff);
    gpu::swiglu(st.g, st.u, st.g, static_cast<int64_t>(nt) * ff, e_.stream);
    gpu::linear(s, G.ffn_down, st.g, nt, st.y, c_.n_embd);
  }

  const Qwen3Weights& w_;
  const ModelConfig& c_;
  const RopeParams rope_;  // derived once from c_ (YaRN's correction dims, the magnitude)
  gpu::Engine e_;
  GWeight output_;
  const float* output_norm_ = nullptr;
  DevMatrix embed_dev_;
  std::vector<GLayer> layers_;
  std::unique_ptr<gpu::MoeExecutor> moe_;
  std::unique_ptr<gpu::ExpertStreamer> streamer_;
  std::unique_ptr<gpu::StepDriver> driver_;
};

}  // namespace

std::unique_ptr<GpuRunner> make_qwen3_gpu(const Qwen3Weights& w, const ModelConfig& c, const Plan& plan,
                                          const LoadOptions& opt) {
  return std::make_unique<Qwen3Gpu>(w, c, plan, opt);
}

}  // namespace fitmoe
