// Qwen3.5 / Qwen3.6: qwen35 (dense FFN) and qwen35moe (routed + shared experts), the forward pass on
// the CPU, and the MTP (nextn) head.
//
// A hybrid stack. Every layer: RMSNorm(attn_norm) -> a mixer -> residual; RMSNorm(post_attention_norm)
// -> FFN -> residual. The mixer is one of
//  - gated full attention (every full_attention_interval-th layer): attn_q gives [q | gate] per head;
//    RMSNorm of q and k per head; multi-section RoPE (IMRoPE) over the first n_rot dims; causal GQA
//    attention over the KV cache (scale 1/sqrt(head_dim)); output * sigmoid(gate); attn_output.
//  - a Gated DeltaNet: attn_qkv -> causal depthwise conv1d (kernel 4, its last inputs carried as
//    state) -> SiLU -> q | k | v; q and k L2-normalised per head; beta = sigmoid(ssm_beta x);
//    g = softplus(ssm_alpha x + ssm_dt.bias) * ssm_a; the delta rule over a per-head state matrix;
//    RMSNorm(ssm_norm) of each head's output times SiLU(attn_gate x); ssm_out.
// The FFN: router softmax -> top-k renormalised -> SwiGLU experts, plus a shared SwiGLU expert scaled
// by sigmoid(ffn_gate_inp_shexp . x) (qwen35moe); or one SwiGLU FFN (qwen35). Final RMSNorm and the
// output head. The MTP block (blk.<n_layer_trunk>, the last of n_layer) is not part of this pass; see qwen35_mtp_forward.
#include "model/qwen35.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <sstream>

#include "model/architectures.h"
#include "model/gpu_runner.h"  // Model's destructor needs the complete type
#include "runtime/cpu_deltanet.h"
#include "runtime/cpu_ops.h"
#include "runtime/error.h"

namespace fitmoe {

std::vector<LayerSpec> qwen35_layer_specs(const ModelConfig& c) {
  std::vector<LayerSpec> out;
  for (int l = 0; l < c.n_layer_trunk(); ++l) {
    LayerSpec s;
    if (c.recurrent_layers[l]) {
      s.mixer = DeltaSpec{c.ssm_n_k_heads, c.ssm_n_v_heads, c.ssm_head_k_dim, c.ssm_head_v_dim, c.ssm_conv_kernel};
    } else {
      s.mixer = qwen35_mtp_layer_spec(c).mixer;
    }
    if (c.n_expert) s.moe = MoeSpec{c.n_expert, c.n_expert_used, c.n_ff_exp, c.n_ff_shexp};
    else s.dense = DenseSpec{c.n_ff};
    out.push_back(s);
  }
  return out;
}

LayerSpec qwen35_mtp_layer_spec(const ModelConfig& c) {
  AttnSpec a;
  a.n_head = c.n_head;
  a.n_head_kv = c.n_head_kv;
  a.head_dim = c.head_dim;
  a.head_dim_v = c.head_dim_v;
  a.n_rot = c.n_rot;
  std::copy(c.rope_sections, c.rope_sections + 4, a.rope_sections);
  a.q_gate = true;
  a.scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  LayerSpec s;
  s.mixer = a;
  if (c.n_expert) s.moe = MoeSpec{c.n_expert, c.n_expert_used, c.n_ff_exp, c.n_ff_shexp};
  else s.dense = DenseSpec{c.n_ff};
  return s;
}

std::string qwen35_layer_pattern(const ModelConfig& c) {
  std::ostringstream o;
  int n_full = 0;
  std::string full;
  for (int l = 0; l < c.n_layer_trunk(); ++l)
    if (!c.recurrent_layers[l]) full += (n_full++ ? ", " : "") + std::to_string(l);
  o << c.n_layer_trunk() - n_full << " Gated DeltaNet + " << n_full << " gated full attention";
  if (c.full_attention_interval) o << " (one in " << c.full_attention_interval << ")";
  o << "; full attention at " << (full.empty() ? std::string("none") : full);
  return o.str();
}

namespace {

// Per-sequence state: a KV cache for each full-attention layer, a conv + delta state for each
// DeltaNet layer (one block of floats, so that a checkpoint is one copy), and the checkpoints.
class Qwen35State final : public ModelState {
 public:
  Qwen35State(const std::vector<LayerSpec>& specs, const StateOptions& opt, bool mtp)
      : mtp(mtp), cache_(specs, opt.n_ctx, opt.kv), max_cps_(std::max(0, opt.max_checkpoints)) {
    n_ctx_ = opt.n_ctx;
    const size_t L = specs.size();
    conv_off_.assign(L, -1);
    delta_off_.assign(L, -1);
    int64_t rec = 0;
    for (size_t l = 0; l < L; ++l) {
      if (!specs[l].is_attention()) {
        const DeltaSpec& d = specs[l].delta();
        conv_off_[l] = rec;
        rec += d.conv_state_floats();
        delta_off_[l] = rec;
        rec += d.delta_state_floats();
      }
    }
    rec_.assign(static_cast<size_t>(rec), 0.0f);
  }

  size_t bytes() const override {
    size_t b = rec_.size() * sizeof(float) + cache_.bytes();
    for (const Checkpoint& c : cps_) b += c.rec.size() * sizeof(float);
    return b;
  }
  cpu::KvView view(int l) { return cache_.view(l); }
  float* conv(int l) { return rec_.data() + conv_off_[l]; }
  float* delta(int l) { return rec_.data() + delta_off_[l]; }

  bool recurrent() const override { return !rec_.empty(); }
  void checkpoint() override {
    if (rec_.empty() || n_past_ == 0 || max_cps_ == 0) return;  // position 0 is the zero state
    if (!cps_.empty() && cps_.back().pos == n_past_) {
      cps_.back().rec = rec_;
      return;
    }
    cps_.push_back({n_past_, rec_});
    if (static_cast<int>(cps_.size()) > max_cps_) cps_.erase(cps_.begin());
  }
  void truncate(int n) override {
    if (n >= n_past_) return;
    n = std::max(n, 0);
    if (rec_.empty()) {
      n_past_ = n;
      return;
    }
    // Checkpoints are taken at increasing positions (those above a rewind are dropped by it), so the
    // last one at or below n is the nearest. The KV caches of the attention layers stay valid below
    // any position, so only the recurrent state moves back.
    while (!cps_.empty() && cps_.back().pos > n) cps_.pop_back();
    if (cps_.empty()) {
      std::fill(rec_.begin(), rec_.end(), 0.0f);
      n_past_ = 0;
    } else {
      rec_ = cps_.back().rec;
      n_past_ = cps_.back().pos;
    }
  }
  int n_checkpoints() const { return static_cast<int>(cps_.size()); }
  void advance_by(int n) { advance(n); }

  const bool mtp;               // the MTP head's state (its one attention layer), not the trunk's
  float* hidden_out = nullptr;  // qwen35_forward_hidden: where this forward writes its hidden rows
  cpu::Scratch scratch;

 private:
  struct Checkpoint {
    int pos;
    std::vector<float> rec;
  };
  cpu::KvCache cache_;                           // the attention layers' KV
  int max_cps_;
  std::vector<int64_t> conv_off_, delta_off_;    // per layer into rec_; -1 for attention layers
  std::vector<float> rec_;
  std::vector<Checkpoint> cps_;
};

// Products that read the same input: one conversion of it per activation format, one parallel step
// per format.
void project(ThreadPool& pool, cpu::Scratch& scratch, const float* x, int64_t n, int T, std::vector<cpu::MatmulJob> jobs) {
  size_t slot = 40;
  while (!jobs.empty()) {
    const DType act = dtype_info(jobs[0].w->type).act_type;
    std::vector<cpu::MatmulJob> same, rest;
    for (const cpu::MatmulJob& j : jobs) (dtype_info(j.w->type).act_type == act ? same : rest).push_back(j);
    uint8_t* buf = scratch.bytes(slot++, cpu::quantized_acts_bytes(act, n, T));
    const cpu::QuantizedActs xa = cpu::quantize_acts(pool, act, x, n, n, T, buf);
    cpu::matmul_many(pool, same, xa);
    jobs = std::move(rest);
  }
}

class Qwen35Model final : public Model {
 public:
  Qwen35Model(std::shared_ptr<gguf::File> file, const LoadOptions& opt) {
    file_ = std::move(file);
    parse_config();
    specs_ = qwen35_layer_specs(cfg_);
    load_weights();
  }

  std::unique_ptr<ModelState> new_state(const StateOptions& opt) const override {
    if (gpu_) return gpu_->new_state(opt);
    return std::make_unique<Qwen35State>(specs_, opt, false);
  }

  void visit_weights(const std::function<void(const Weight&)>& f) const override {
    for (const Weight* w : {&w_.tok_embd, &w_.output_norm, &w_.output})
      if (*w) f(*w);
    auto layer = [&](const Qwen35Layer& L) {
      for (const Weight* w : {&L.attn_norm, &L.post_norm, &L.wq, &L.wk, &L.wv, &L.wo, &L.q_norm, &L.k_norm, &L.wqkv,
                              &L.wgate, &L.conv1d, &L.dt_bias, &L.ssm_a, &L.w_beta, &L.w_alpha, &L.ssm_norm,
                              &L.ssm_out, &L.router, &L.experts.gate, &L.experts.up, &L.experts.down,
                              &L.shexp_gate_inp, &L.shexp_gate, &L.shexp_up, &L.shexp_down, &L.ffn_gate, &L.ffn_up,
                              &L.ffn_down, &L.eh_proj, &L.enorm, &L.hnorm, &L.head_norm, &L.embed_tokens, &L.head})
        if (*w) f(*w);
    };
    for (const Qwen35Layer& L : w_.layers) layer(L);
    for (const Qwen35Layer& L : w_.mtp) layer(L);
  }

  // The trunk's reads for one token (the MTP block is extra, read only when drafting).
  double bytes_per_token() const override {
    double b = static_cast<double>(w_.output.matrix_bytes());
    for (const Qwen35Layer& L : w_.layers) {
      for (const Weight* w : {&L.wq, &L.wk, &L.wv, &L.wo, &L.wqkv, &L.wgate, &L.w_beta, &L.w_alpha, &L.ssm_out,
                              &L.router, &L.shexp_gate_inp, &L.shexp_gate, &L.shexp_up, &L.shexp_down, &L.ffn_gate,
                              &L.ffn_up, &L.ffn_down})
        if (*w) b += static_cast<double>(w->matrix_bytes());
      if (L.experts.gate)
        b += static_cast<double>(L.experts.gate.matrix_bytes() + L.experts.up.matrix_bytes() +
                                 L.experts.down.matrix_bytes()) * cfg_.n_expert_used;
    }
    return b;
  }

  bool has_mtp() const { return !w_.mtp.empty(); }

  std::unique_ptr<ModelState> new_mtp_state(const StateOptions& opt) const {
    if (!has_mtp()) throw Error(file_->path() + ": the file has no MTP (nextn) block");
    return std::make_unique<Qwen35State>(std::vector<LayerSpec>{w_.mtp[0].spec}, opt, true);
  }

  void mtp_forward(ModelState& st, ThreadPool& pool, std::span<const int32_t> tokens, const float* h, float* logits,
                   float* h_out) const {
    if (!has_mtp()) throw Error(file_->path() + ": the file has no MTP (nextn) block");
    auto* Sp = dynamic_cast<Qwen35State*>(&st);
    if (!Sp || !Sp->mtp) throw Error("qwen35_mtp_forward: the state is not an MTP state (qwen35_new_mtp_state makes one)");
    Qwen35State& S = *Sp;
    if (tokens.empty()) return;
    const int T = static_cast<int>(tokens.size());
    const int pos0 = S.n_past();
    if (pos0 + T > S.n_ctx())
      throw Error("context is full: " + std::to_string(pos0) + " + " + std::to_string(T) +
                  " tokens exceed the MTP context of " + std::to_string(S.n_ctx()));
    for (int32_t t : tokens)
      if (t < 0 || t >= cfg_.n_vocab) throw Error("token id " + std::to_string(t) + " is outside the vocabulary");
    const Qwen35Layer& L = w_.mtp[0];
    const int E = cfg_.n_embd;
    auto& scratch = S.scratch;
    float* e = scratch.floats(26, static_cast<size_t>(T) * E);
    float* cat = scratch.floats(25, static_cast<size_t>(T) * 2 * E);
    float* x = scratch.floats(0, static_cast<size_t>(T) * E);
    float* xn = scratch.floats(1, static_cast<size_t>(T) * E);
    float* y = scratch.floats(2, static_cast<size_t>(T) * E);
    // cur = eh_proj [RMSNorm(embedding) * enorm | RMSNorm(h) * hnorm].
    cpu::embed(pool, L.embed_tokens ? L.embed_tokens : w_.tok_embd, tokens, e);
    cpu::rms_norm(e, L.enorm.f32(), cat, E, T, cfg_.rms_eps, E, 2 * E);
    cpu::rms_norm(h, L.hnorm.f32(), cat + E, E, T, cfg_.rms_eps, E, 2 * E);
    cpu::matmul(pool, L.eh_proj, cat, 2 * E, T, x, E, scratch, 41);
    const BatchSeq one{&S, tokens, 0};
    run_layer(scratch, pool, L, 0, x, xn, y, BatchRows(std::span<const BatchSeq>(&one, 1)));
    // The head: its own norm (else output_norm) and its own matrix (else the trunk's output head).
    float* hn = h_out ? h_out : xn;
    cpu::rms_norm(x, (L.head_norm ? L.head_norm : w_.output_norm).f32(), hn, E, T, cfg_.rms_eps, E, E);
    if (logits) cpu::matmul(pool, L.head ? L.head : w_.output, hn, E, T, logits, cfg_.n_vocab, scratch, 49);
    S.advance_by(T);
  }

 protected:
  void forward_impl(ThreadPool& pool, const BatchRows& batch, float* logits) const override {
    if (gpu_) return gpu_->forward(pool, batch, logits);
    for (const BatchPart& p : batch.parts) {
      auto* Sp = dynamic_cast<Qwen35State*>(p.state);
      if (!Sp || Sp->mtp) throw Error("forward: the state is not a " + cfg_.arch + " trunk state");
      if (Sp->hidden_out && batch.parts.size() > 1) throw Error("forward: hidden rows are for a batch of one sequence");
    }
    Qwen35State& S0 = static_cast<Qwen35State&>(*batch.parts[0].state);
    const ModelConfig& c = cfg_;
    const int T = batch.n_rows();
    const int E = c.n_embd;
    auto& scratch = S0.scratch;
    float* x = scratch.floats(0, static_cast<size_t>(T) * E);   // residual stream
    float* xn = scratch.floats(1, static_cast<size_t>(T) * E);  // normed input of a block
    float* y = scratch.floats(2, static_cast<size_t>(T) * E);   // block output before the residual add

    cpu::embed(pool, w_.tok_embd, batch.tokens, x);
    for (int l = 0; l < c.n_layer_trunk(); ++l) run_layer(scratch, pool, w_.layers[l], l, x, xn, y, batch);

    if (float* hidden = S0.hidden_out) {  // (MTP: every row's hidden state after output_norm, then the head)
      const int n_logits = batch.parts[0].n_logits;
      cpu::rms_norm(x, w_.output_norm.f32(), hidden, E, T, c.rms_eps, E, E);
      if (n_logits)
        cpu::matmul(pool, w_.output, hidden + static_cast<int64_t>(T - n_logits) * E, E, n_logits, logits, c.n_vocab,
                    scratch, 49);
      return;
    }
    norm_logit_rows(batch, x, xn, E, c.rms_eps, w_.output_norm.f32());
    if (const int n = batch.n_logits()) cpu::matmul(pool, w_.output, xn, E, n, logits, c.n_vocab, scratch, 49);
  }

  bool has_gpu_forward() const override { return true; }
  bool init_gpu(const LoadOptions& opt) override {
#if FITMOE_CUDA
    gpu_ = make_qwen35_gpu(w_, cfg_, plan_, opt);
    return true;
#else
    (void)opt;
    return false;
#endif
  }

 private:
  // One layer, in place on the residual stream x: mixer block, then FFN block. `sl` is the layer's
  // index in the states (their KV caches or recurrent states).
  void run_layer(cpu::Scratch& scratch, ThreadPool& pool, const Qwen35Layer& L, int sl, float* x, float* xn, float* y,
                 const BatchRows& b) const {
    const int E = cfg_.n_embd, T = b.n_rows();
    const int64_t n = static_cast<int64_t>(T) * E;
    cpu::rms_norm(x, L.attn_norm.f32(), xn, E, T, cfg_.rms_eps, E, E);
    if (L.spec.is_attention()) attention_block(scratch, pool, L, sl, xn, b, y);
    else delta_block(scratch, pool, L, sl, xn, b, y);
    for (int64_t i = 0; i < n; ++i) x[i] += y[i];
    cpu::rms_norm(x, L.post_norm.f32(), xn, E, T, cfg_.rms_eps, E, E);
    ffn_block(scratch, pool, L, xn, T, y);
    for (int64_t i = 0; i < n; ++i) x[i] += y[i];
  }

  static Qwen35State& state(const BatchPart& p) { return static_cast<Qwen35State&>(*p.state); }

  // Gated full attention.
  void attention_block(cpu::Scratch& scratch, ThreadPool& pool, const Qwen35Layer& L, int sl, const float* xn,
                       const BatchRows& b, float* y) const {
    const AttnSpec& a = L.spec.attn();
    const int T = b.n_rows();
    const int E = cfg_.n_embd, hd = a.head_dim, hdv = a.head_dim_v;
    const int qw = a.n_head * hd, kw = a.n_head_kv * hd, vw = a.n_head_kv * hdv, ow = a.n_head * hdv;
    float* qg = scratch.floats(3, static_cast<size_t>(T) * 2 * qw);  // [q_h | gate_h] per head
    float* q = scratch.floats(4, static_cast<size_t>(T) * qw);
    float* gate = scratch.floats(5, static_cast<size_t>(T) * qw);
    float* k = scratch.floats(6, static_cast<size_t>(T) * kw);
    float* v = scratch.floats(7, static_cast<size_t>(T) * vw);
    float* att = scratch.floats(8, static_cast<size_t>(T) * ow);
    project(pool, scratch, xn, E, T, {{&L.wq, qg, 2 * qw}, {&L.wk, k, kw}, {&L.wv, v, vw}});
    // Head r (token r / n_head) starts at r * 2 hd: its query half is normed into q, its gate copied.
    const int rows = T * a.n_head;
    cpu::rms_norm(qg, L.q_norm.f32(), q, hd, rows, cfg_.rms_eps, 2 * hd, hd);
    for (int r = 0; r < rows; ++r)
      std::memcpy(gate + static_cast<int64_t>(r) * hd, qg + static_cast<int64_t>(r) * 2 * hd + hd, sizeof(float) * hd);
    cpu::rms_norm(k, L.k_norm.f32(), k, hd, T * a.n_head_kv, cfg_.rms_eps, hd, hd);
    const RopeParams rope = rope_params(cfg_);
    for (const BatchPart& p : b.parts) {
      float *qp = q + static_cast<int64_t>(p.row0) * qw, *kp = k + static_cast<int64_t>(p.row0) * kw;
      cpu::rope_multi(qp, p.n, a.n_head, hd, qw, a.n_rot, a.rope_sections, p.pos0, rope);
      cpu::rope_multi(kp, p.n, a.n_head_kv, hd, kw, a.n_rot, a.rope_sections, p.pos0, rope);
      const cpu::KvView kv = state(p).view(sl);
      cpu::kv_store(kv, p.pos0, p.n, kp, kw, v + static_cast<int64_t>(p.row0) * vw, vw, kw, vw);
      cpu::attention(pool, qp, qw, kv, p.pos0, p.n, a.n_head, a.n_head_kv, hd, hdv, a.scale,
                     att + static_cast<int64_t>(p.row0) * ow, ow, scratch, 46);
    }
    cpu::mul_sigmoid(att, gate, static_cast<int64_t>(T) * ow);
    cpu::matmul(pool, L.wo, att, ow, T, y, E, scratch, 47);
  }

  // Gated DeltaNet.
  void delta_block(cpu::Scratch& scratch, ThreadPool& pool, const Qwen35Layer& L, int sl, const float* xn,
                   const BatchRows& b, float* y) const {
    const DeltaSpec& d = L.spec.delta();
    const int T = b.n_rows();
    const int E = cfg_.n_embd, ch = d.conv_channels(), kd = d.key_dim(), vd = d.value_dim(), Hv = d.n_v_heads;
    float* qkv = scratch.floats(3, static_cast<size_t>(T) * ch);
    float* co = scratch.floats(4, static_cast<size_t>(T) * ch);
    float* z = scratch.floats(5, static_cast<size_t>(T) * vd);
    float* beta = scratch.floats(6, static_cast<size_t>(T) * Hv);
    float* g = scratch.floats(7, static_cast<size_t>(T) * Hv);
    float* o = scratch.floats(8, static_cast<size_t>(T) * vd);
    project(pool, scratch, xn, E, T, {{&L.wqkv, qkv, ch}, {&L.wgate, z, vd}, {&L.w_beta, beta, Hv}, {&L.w_alpha, g, Hv}});
    const float* dt = L.dt_bias.f32();
    const float* A = L.ssm_a.f32();
    for (int t = 0; t < T; ++t)
      for (int h = 0; h < Hv; ++h) {
        const int64_t i = static_cast<int64_t>(t) * Hv + h;
        beta[i] = cpu::sigmoid(beta[i]);
        g[i] = cpu::softplus(g[i] + dt[h]) * A[h];  // ssm_a is -exp(A_log): g <= 0, a decay
      }
    for (const BatchPart& p : b.parts) {
      const int64_t r = p.row0;
      cpu::conv1d_silu(pool, qkv + r * ch, ch, p.n, ch, L.conv1d.f32(), d.conv_kernel, state(p).conv(sl), co + r * ch, ch);
    }
    for (int t = 0; t < T; ++t) {
      float* row = co + static_cast<int64_t>(t) * ch;
      cpu::l2_norm(row, d.head_k_dim, d.n_k_heads, d.head_k_dim, cfg_.rms_eps);       // q
      cpu::l2_norm(row + kd, d.head_k_dim, d.n_k_heads, d.head_k_dim, cfg_.rms_eps);  // k
    }
    for (const BatchPart& p : b.parts) {
      const int64_t r = p.row0;
      float* c0 = co + r * ch;
      cpu::gated_delta_net(pool, d, p.n, c0, c0 + kd, ch, c0 + 2 * kd, ch, g + r * Hv, beta + r * Hv,
                           state(p).delta(sl), o + r * vd, vd);
    }
    cpu::gated_rms_norm(o, L.ssm_norm.f32(), z, o, d.head_v_dim, T * Hv, cfg_.rms_eps);
    cpu::matmul(pool, L.ssm_out, o, vd, T, y, E, scratch, 47);
  }

  void ffn_block(cpu::Scratch& scratch, ThreadPool& pool, const Qwen35Layer& L, const float* xn, int T, float* y) const {
    const int E = cfg_.n_embd;
    if (!L.spec.moe) return cpu::dense_ffn(pool, L.ffn_gate, L.ffn_up, L.ffn_down, xn, T, y, scratch);
    const MoeSpec& m = *L.spec.moe;
    float* router = scratch.floats(3, static_cast<size_t>(T) * m.n_expert);
    std::vector<int32_t> chosen(static_cast<size_t>(T) * m.n_expert_used);
    std::vector<float> chosen_w(chosen.size());
    cpu::matmul(pool, L.router, xn, E, T, router, m.n_expert, scratch, 48);
    for (int t = 0; t < T; ++t)
      cpu::route_softmax_topk(router + static_cast<int64_t>(t) * m.n_expert, m.n_expert, m.n_expert_used, true,
                              chosen.data() + t * m.n_expert_used, chosen_w.data() + t * m.n_expert_used);
    cpu::moe_ffn(pool, L.experts, xn, T, E, chosen.data(), chosen_w.data(), m.n_expert_used, y, scratch);
    if (!m.n_ff_shexp) return;
    float* ys = scratch.floats(4, static_cast<size_t>(T) * E);
    float* sg = scratch.floats(5, static_cast<size_t>(T));
    cpu::dense_ffn(pool, L.shexp_gate, L.shexp_up, L.shexp_down, xn, T, ys, scratch);
    cpu::matmul(pool, L.shexp_gate_inp, xn, E, T, sg, 1, scratch, 49);
    for (int t = 0; t < T; ++t) {
      const float s = cpu::sigmoid(sg[t]);
      for (int i = 0; i < E; ++i) y[static_cast<int64_t>(t) * E + i] += ys[static_cast<int64_t>(t) * E + i] * s;
    }
  }

  [[noreturn]] void bad(const std::string& what) const { throw Error(file_->path() + ": " + cfg_.arch + ": " + what); }

  void parse_config() {
    const gguf::File& f = *file_;
    ModelConfig& c = cfg_;
    c.arch = std::string(f.get_string("general.architecture"));
    c.name = std::string(f.opt_string("general.name").value_or(""));
    const std::string a = c.arch + ".";
    const bool moe = c.arch == "qwen35moe";
    const uint64_t n_all = f.get_uint(a + "block_count");
    const uint64_t n_mtp = f.opt_uint(a + "nextn_predict_layers").value_or(0);
    if (n_all == 0 || n_all > 1024) bad("block_count out of range");
    if (n_mtp >= n_all) bad("nextn_predict_layers (" + std::to_string(n_mtp) + ") must be below block_count (" + std::to_string(n_all) + ")");
    if (n_mtp > 1) bad("nextn_predict_layers " + std::to_string(n_mtp) + ": fitmoe runs at most one MTP block");
    c.n_layer_mtp = static_cast<int>(n_mtp);
    c.n_layer = static_cast<int>(n_all);
    const int trunk = c.n_layer_trunk();
    c.n_embd = static_cast<int>(f.get_uint(a + "embedding_length"));
    c.n_head = static_cast<int>(f.get_uint(a + "attention.head_count"));
    c.n_head_kv = static_cast<int>(f.opt_uint(a + "attention.head_count_kv").value_or(c.n_head));
    c.head_dim = static_cast<int>(f.opt_uint(a + "attention.key_length").value_or(c.n_head ? c.n_embd / c.n_head : 0));
    c.head_dim_v = static_cast<int>(f.opt_uint(a + "attention.value_length").value_or(c.head_dim));
    c.n_ctx_train = static_cast<int>(f.opt_uint(a + "context_length").value_or(4096));
    c.rms_eps = static_cast<float>(f.get_float(a + "attention.layer_norm_rms_epsilon"));
    c.rope_base = static_cast<float>(f.opt_float(a + "rope.freq_base").value_or(10000.0));
    c.n_rot = static_cast<int>(f.opt_uint(a + "rope.dimension_count").value_or(c.head_dim));
    c.rope_n_ctx_orig = c.n_ctx_train;
    if (f.find(a + "rope.dimension_sections")) {
      const std::vector<int64_t> s = f.get_int_array(a + "rope.dimension_sections");
      if (s.size() > 4) bad("rope.dimension_sections has " + std::to_string(s.size()) + " entries (at most 4)");
      for (size_t i = 0; i < s.size(); ++i) {
        if (s[i] < 0 || s[i] > 4096) bad("rope.dimension_sections out of range");
        c.rope_sections[i] = static_cast<int>(s[i]);
      }
    }
    // RoPE scaling: the released checkpoints have none; refuse rather than run it unscaled.
    const std::string scaling(f.opt_string(a + "rope.scaling.type").value_or("none"));
    const double factor = f.opt_float(a + "rope.scaling.factor").value_or(0.0);
    if (scaling != "none" || (factor != 0.0 && factor != 1.0))
      bad("rope scaling ('" + scaling + "') is not supported for " + c.arch + " yet");
    // Gated DeltaNet sizes, as the reference reads them: heads of keys = group_count, of values =
    // time_step_rank, key width = state_size, value width = inner_size / value heads.
    c.ssm_conv_kernel = static_cast<int>(f.get_uint(a + "ssm.conv_kernel"));
    c.ssm_head_k_dim = static_cast<int>(f.get_uint(a + "ssm.state_size"));
    c.ssm_n_k_heads = static_cast<int>(f.get_uint(a + "ssm.group_count"));
    c.ssm_n_v_heads = static_cast<int>(f.get_uint(a + "ssm.time_step_rank"));
    const uint64_t inner = f.get_uint(a + "ssm.inner_size");
    if (c.ssm_n_v_heads <= 0 || c.ssm_n_k_heads <= 0) bad("ssm.group_count and ssm.time_step_rank must be positive");
    if (inner % c.ssm_n_v_heads) bad("ssm.inner_size (" + std::to_string(inner) + ") is not a multiple of ssm.time_step_rank (" + std::to_string(c.ssm_n_v_heads) + ")");
    c.ssm_head_v_dim = static_cast<int>(inner / c.ssm_n_v_heads);
    if (moe) {
      c.n_expert = static_cast<int>(f.get_uint(a + "expert_count"));
      c.n_expert_used = static_cast<int>(f.get_uint(a + "expert_used_count"));
      c.n_ff_exp = static_cast<int>(f.get_uint(a + "expert_feed_forward_length"));
      c.n_ff_shexp = static_cast<int>(f.opt_uint(a + "expert_shared_feed_forward_length").value_or(0));
      if (auto s = f.opt_float(a + "expert_weights_scale"); s && *s != 0.0 && *s != 1.0)
        bad("expert_weights_scale " + std::to_string(*s) + " is not supported");
    } else {
      c.n_ff = static_cast<int>(f.get_uint(a + "feed_forward_length"));
    }
    // The layer pattern: an explicit list, or every full_attention_interval-th layer is full attention.
    c.recurrent_layers.assign(c.n_layer, false);
    if (const gguf::Value* v = f.find(a + "attention.recurrent_layers")) {
      if (!v->is_array() || (v->count != n_all && v->count != static_cast<uint64_t>(trunk)))
        bad("attention.recurrent_layers must list " + std::to_string(n_all) + " layers");
      std::vector<bool> rec(v->count);
      if (v->elem_type == gguf::ValueType::BOOL) {
        for (uint64_t i = 0; i < v->count; ++i) rec[i] = v->raw[i] != 0;
      } else {
        const std::vector<int64_t> ints = f.get_int_array(a + "attention.recurrent_layers");
        for (uint64_t i = 0; i < v->count; ++i) rec[i] = ints[i] != 0;
      }
      for (int l = 0; l < trunk; ++l) c.recurrent_layers[l] = rec[l];
      for (uint64_t l = trunk; l < v->count; ++l)
        if (rec[l]) bad("attention.recurrent_layers marks MTP layer " + std::to_string(l) + " recurrent");
    } else {
      const uint64_t every = f.opt_uint(a + "full_attention_interval").value_or(4);
      if (every == 0 || every > 1024) bad("full_attention_interval out of range");
      c.full_attention_interval = static_cast<int>(every);
      for (int l = 0; l < trunk; ++l) c.recurrent_layers[l] = (l + 1) % every != 0;
    }
    validate_config();
  }

  void validate_config() const {
    const ModelConfig& c = cfg_;
    if (c.n_embd <= 0 || c.n_head <= 0 || c.n_head_kv <= 0 || c.head_dim <= 0 || c.head_dim_v <= 0)
      bad("attention sizes must be positive");
    if (c.n_head % c.n_head_kv) bad("head_count (" + std::to_string(c.n_head) + ") must be a multiple of head_count_kv (" + std::to_string(c.n_head_kv) + ")");
    if (c.head_dim != c.head_dim_v) bad("key_length and value_length must agree (the gate multiplies the attention output per head)");
    if (c.n_rot <= 0 || c.n_rot > c.head_dim || c.n_rot % 2) bad("rope.dimension_count out of range");
    const int sect = c.rope_sections[0] + c.rope_sections[1] + c.rope_sections[2] + c.rope_sections[3];
    if (sect > c.head_dim) bad("rope.dimension_sections add up to more than the head width");
    if (!std::isfinite(c.rope_base) || !(c.rope_base > 0.0f)) bad("rope.freq_base must be a positive number");
    if (c.ssm_conv_kernel < 2 || c.ssm_conv_kernel > 64) bad("ssm.conv_kernel out of range");
    if (c.ssm_n_v_heads % c.ssm_n_k_heads)
      bad("DeltaNet value heads (ssm.time_step_rank " + std::to_string(c.ssm_n_v_heads) +
          ") must be a multiple of key heads (ssm.group_count " + std::to_string(c.ssm_n_k_heads) + ")");
    if (c.ssm_head_k_dim <= 0 || c.ssm_head_k_dim != c.ssm_head_v_dim)
      bad("DeltaNet key width (ssm.state_size " + std::to_string(c.ssm_head_k_dim) + ") must equal the value width (" +
          std::to_string(c.ssm_head_v_dim) + ")");
    if (c.arch == "qwen35moe" && (c.n_expert <= 0 || c.n_expert_used <= 0 || c.n_expert_used > c.n_expert ||
                                  c.n_ff_exp <= 0 || c.n_ff_shexp < 0))
      bad("expert counts out of range");
    if (c.arch == "qwen35" && c.n_ff <= 0) bad("feed_forward_length must be positive");
  }

  void require_f32(const Weight& w) const {
    if (w && w.type != DType::F32)
      throw Error(file_->path() + ": tensor " + w.info->name + " must be f32, found " + dtype_name(w.type));
  }

  // The FFN and norms every layer has; `p` is "blk.N.".
  void load_ffn(Qwen35Layer& L, const std::string& p) {
    const ModelConfig& c = cfg_;
    const int64_t E = c.n_embd;
    L.attn_norm = tensor(p + "attn_norm.weight", {E});
    L.post_norm = tensor(p + "post_attention_norm.weight", {E});
    if (L.spec.moe) {
      L.router = tensor(p + "ffn_gate_inp.weight", {E, c.n_expert});
      L.experts.gate = tensor(p + "ffn_gate_exps.weight", {E, c.n_ff_exp, c.n_expert});
      L.experts.up = tensor(p + "ffn_up_exps.weight", {E, c.n_ff_exp, c.n_expert});
      L.experts.down = tensor(p + "ffn_down_exps.weight", {c.n_ff_exp, E, c.n_expert});
      if (c.n_ff_shexp) {
        L.shexp_gate_inp = tensor(p + "ffn_gate_inp_shexp.weight", {E});
        L.shexp_gate = tensor(p + "ffn_gate_shexp.weight", {E, c.n_ff_shexp});
        L.shexp_up = tensor(p + "ffn_up_shexp.weight", {E, c.n_ff_shexp});
        L.shexp_down = tensor(p + "ffn_down_shexp.weight", {c.n_ff_shexp, E});
      } else if (file_->find_tensor(p + "ffn_gate_shexp.weight")) {
        bad("layer " + p.substr(4, p.size() - 5) + " has a shared expert but expert_shared_feed_forward_length is missing");
      }
    } else {
      L.ffn_gate = tensor(p + "ffn_gate.weight", {E, c.n_ff});
      L.ffn_up = tensor(p + "ffn_up.weight", {E, c.n_ff});
      L.ffn_down = tensor(p + "ffn_down.weight", {c.n_ff, E});
    }
    for (const Weight* w : {&L.attn_norm, &L.post_norm, &L.router}) require_f32(*w);
  }

  void load_attention(Qwen35Layer& L, const std::string& p) {
    const AttnSpec& a = L.spec.attn();
    const int64_t E = cfg_.n_embd, hd = a.head_dim, hdv = a.head_dim_v;
    L.wq = tensor(p + "attn_q.weight", {E, 2 * hd * a.n_head});
    L.wk = tensor(p + "attn_k.weight", {E, hd * a.n_head_kv});
    L.wv = tensor(p + "attn_v.weight", {E, hdv * a.n_head_kv});
    L.wo = tensor(p + "attn_output.weight", {hdv * a.n_head, E});
    L.q_norm = tensor(p + "attn_q_norm.weight", {hd});
    L.k_norm = tensor(p + "attn_k_norm.weight", {hd});
    for (const Weight* w : {&L.q_norm, &L.k_norm}) require_f32(*w);
  }

  void load_delta(Qwen35Layer& L, const std::string& p) {
    const DeltaSpec& d = L.spec.delta();
    const int64_t E = cfg_.n_embd;
    L.wqkv = tensor(p + "attn_qkv.weight", {E, d.conv_channels()});
    L.wgate = tensor(p + "attn_gate.weight", {E, d.value_dim()});
    L.conv1d = tensor(p + "ssm_conv1d.weight", {d.conv_kernel, d.conv_channels()});
    L.dt_bias = tensor(p + "ssm_dt.bias", {d.n_v_heads});
    L.ssm_a = tensor(p + "ssm_a", {d.n_v_heads});
    L.w_beta = tensor(p + "ssm_beta.weight", {E, d.n_v_heads});
    L.w_alpha = tensor(p + "ssm_alpha.weight", {E, d.n_v_heads});
    L.ssm_norm = tensor(p + "ssm_norm.weight", {d.head_v_dim});
    L.ssm_out = tensor(p + "ssm_out.weight", {d.value_dim(), E});
    for (const Weight* w : {&L.conv1d, &L.dt_bias, &L.ssm_a, &L.ssm_norm}) require_f32(*w);
  }

  void load_weights() {
    const gguf::File& f = *file_;
    ModelConfig& c = cfg_;
    const int64_t E = c.n_embd;
    // The vocabulary size is the embedding's row count (tokenizer arrays may be padded differently).
    if (const gguf::TensorInfo* te = f.find_tensor("token_embd.weight")) c.n_vocab = static_cast<int>(te->ne[1]);
    w_.tok_embd = tensor("token_embd.weight", {E, c.n_vocab});
    w_.output_norm = tensor("output_norm.weight", {E});
    w_.output = tensor("output.weight", {E, c.n_vocab}, /*optional=*/true);
    c.tied_output = !w_.output;
    if (!w_.output) w_.output = w_.tok_embd;
    require_f32(w_.output_norm);
    const std::string pattern = c.full_attention_interval
                                    ? "full_attention_interval " + std::to_string(c.full_attention_interval)
                                    : std::string("attention.recurrent_layers");
    w_.layers.resize(c.n_layer_trunk());
    for (int l = 0; l < c.n_layer_trunk(); ++l) {
      Qwen35Layer& L = w_.layers[l];
      L.spec = specs_[l];
      const std::string p = "blk." + std::to_string(l) + ".";
      // A layer whose tensors are of the other kind than the pattern says: name both.
      const bool has_delta = f.find_tensor(p + "attn_qkv.weight") || f.find_tensor(p + "ssm_conv1d.weight");
      const bool has_attn = f.find_tensor(p + "attn_q.weight") != nullptr;
      if (L.spec.is_delta() && has_attn && !has_delta)
        bad("layer " + std::to_string(l) + " has full-attention tensors, but the layer pattern (" + pattern + ") makes it a DeltaNet layer");
      if (L.spec.is_attention() && has_delta && !has_attn)
        bad("layer " + std::to_string(l) + " has DeltaNet tensors, but the layer pattern (" + pattern + ") makes it a full-attention layer");
      if (L.spec.is_attention()) load_attention(L, p);
      else load_delta(L, p);
      load_ffn(L, p);
    }
    if (c.n_layer_mtp) {
      Qwen35Layer L;
      L.spec = qwen35_mtp_layer_spec(c);
      const std::string p = "blk." + std::to_string(c.n_layer_trunk()) + ".";
      load_attention(L, p);
      load_ffn(L, p);
      L.eh_proj = tensor(p + "nextn.eh_proj.weight", {2 * E, E});
      L.enorm = tensor(p + "nextn.enorm.weight", {E});
      L.hnorm = tensor(p + "nextn.hnorm.weight", {E});
      L.head_norm = tensor(p + "nextn.shared_head_norm.weight", {E}, true);
      L.embed_tokens = tensor(p + "nextn.embed_tokens.weight", {E, c.n_vocab}, true);
      L.head = tensor(p + "nextn.shared_head_head.weight", {E, c.n_vocab}, true);
      for (const Weight* w : {&L.enorm, &L.hnorm, &L.head_norm}) require_f32(*w);
      w_.mtp.push_back(L);
    }
  }

  std::vector<LayerSpec> specs_;
  Qwen35Weights w_;
};

const Qwen35Model& as_qwen35(const Model& m) {
  const auto* q = dynamic_cast<const Qwen35Model*>(&m);
  if (!q) throw Error("the model is " + m.config().arch + ", not qwen35/qwen35moe");
  return *q;
}

}  // namespace

bool qwen35_has_mtp(const Model& m) {
  const auto* q = dynamic_cast<const Qwen35Model*>(&m);
  return q && q->has_mtp();
}

void qwen35_forward_hidden(const Model& m, ModelState& state, ThreadPool& pool, std::span<const int32_t> tokens,
                           int n_logits, float* logits, float* hidden) {
  as_qwen35(m);
  if (m.on_gpu())
    throw Error("the trunk's hidden rows for the MTP head come from the CPU forward pass only (load with --gpu none)");
  auto* S = dynamic_cast<Qwen35State*>(&state);
  if (!S || S->mtp) throw Error("qwen35_forward_hidden: the state is not a qwen35 trunk state");
  S->hidden_out = hidden;
  try {
    m.forward(state, pool, tokens, n_logits, logits);
  } catch (...) {
    S->hidden_out = nullptr;
    throw;
  }
  S->hidden_out = nullptr;
}

std::unique_ptr<ModelState> qwen35_new_mtp_state(const Model& m, const StateOptions& opt) {
  return as_qwen35(m).new_mtp_state(opt);
}

void qwen35_mtp_forward(const Model& m, ModelState& mtp_state, ThreadPool& pool, std::span<const int32_t> tokens,
                        const float* h, float* logits, float* h_out) {
  as_qwen35(m).mtp_forward(mtp_state, pool, tokens, h, logits, h_out);
}

std::unique_ptr<Model> make_qwen35_model(std::shared_ptr<gguf::File> file, const LoadOptions& opt) {
  return std::make_unique<Qwen35Model>(std::move(file), opt);
}

}  // namespace fitmoe
