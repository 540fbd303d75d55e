// Gemma 4 (gemma4): the dense models and the 26B-A4B MoE, the forward pass on the CPU.
//
// x = embedding * sqrt(n_embd). Every layer (testdata README, "Gemma 4 MoE"):
//   a   = x + RMSNorm(attention(RMSNorm(x) * attn_norm)) * post_attention_norm
//   ffn = GeGLU(RMSNorm(a) * ffn_norm)                                              (dense layers)
//   ffn = RMSNorm(GeGLU(RMSNorm(a) * ffn_norm)) * post_ffw_norm_1
//       + RMSNorm(experts(RMSNorm(a) * pre_ffw_norm_2)) * post_ffw_norm_2            (MoE layers)
//   out = (a + RMSNorm(ffn) * post_ffw_norm) * layer_output_scale
// Attention: Q/K RMSNorm per head, V a weightless RMSNorm per head (V = the raw K projection where
// the layer has no attn_v), NeoX RoPE with the layer kind's base (global layers: angles divided by
// rope_freqs, the proportional partial rotation), scale 1; sliding layers see the last `window`
// positions only and keep only those (plus a micro-batch) in a ring; the last shared_kv_layers layers
// read an earlier layer's cache. The router takes RMSNorm(a) / sqrt(n_embd) * ffn_gate_inp.scale:
// softmax, top-k, renormalised, each chosen expert's weight times ffn_down_exps.scale[e]. Final
// RMSNorm, the tied head, tanh softcap.
#include "model/gemma4.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <sstream>

#include "model/architectures.h"
#include "model/gpu_runner.h"  // Model's destructor needs the complete type
#include "runtime/cpu_gemma4.h"
#include "runtime/cpu_ops.h"
#include "runtime/error.h"

namespace fitmoe {

std::vector<LayerSpec> gemma4_layer_specs(const ModelConfig& c) {
  std::vector<LayerSpec> out;
  for (int l = 0; l < c.n_layer; ++l) {
    const bool swa = c.swa_layers[l];
    AttnSpec a;
    a.n_head = c.n_head;
    a.n_head_kv = c.n_head_kv_layers[l];
    a.head_dim = a.head_dim_v = swa ? c.head_dim_swa : c.head_dim;
    a.n_rot = swa ? c.n_rot_swa : c.n_rot;
    a.rope_base = swa ? c.rope_base_swa : c.rope_base;
    a.rope_freqs = !swa;
    a.window = swa ? c.sliding_window : 0;
    a.scale = 1.0f;  // Gemma 4 folds the scale into the Q/K norms
    a.v_norm = true;
    a.k_eq_v = l < static_cast<int>(c.k_eq_v_layers.size()) && c.k_eq_v_layers[l];
    if (l >= c.n_layer_kv()) a.kv_from = c.n_layer_kv() - (swa ? 2 : 1);
    LayerSpec s;
    s.mixer = a;
    s.dense = DenseSpec{c.n_ff, Activation::GeluTanh};
    if (c.n_expert) s.moe = MoeSpec{c.n_expert, c.n_expert_used, c.n_ff_exp, 0, Activation::GeluTanh};
    out.push_back(s);
  }
  return out;
}

std::string gemma4_layer_pattern(const ModelConfig& c) {
  std::ostringstream o;
  std::string global;
  int n_global = 0;
  for (int l = 0; l < c.n_layer; ++l)
    if (!c.swa_layers[l]) global += (n_global++ ? ", " : "") + std::to_string(l);
  o << c.n_layer - n_global << " sliding (window " << c.sliding_window << ", heads of " << c.head_dim_swa << ") + "
    << n_global << " global (heads of " << c.head_dim << ") at " << (global.empty() ? std::string("none") : global);
  int n_kv_eq = 0;
  for (bool b : c.k_eq_v_layers) n_kv_eq += b;
  if (n_kv_eq) o << "; K = V on " << n_kv_eq << " layer" << (n_kv_eq > 1 ? "s" : "");
  if (c.shared_kv_layers) {
    const auto specs = gemma4_layer_specs(c);
    o << "; shared KV: layers " << c.n_layer_kv() << ".." << c.n_layer - 1 << " read layer";
    std::string from;
    int last = -2;
    for (int l = c.n_layer_kv(); l < c.n_layer; ++l) {
      const int f = specs[l].attn().kv_from;
      if (f != last) from += (from.empty() ? " " : ", ") + std::to_string(f);
      last = f;
    }
    o << (from.find(',') != std::string::npos ? "s" : "") << from << " (sliding / global)";
  } else {
    o << "; no shared KV";
  }
  return o.str();
}

namespace {

// Per-sequence state: a KV cache per layer with KV of its own (a ring of the window plus a
// micro-batch on sliding layers), none for shared-KV layers, which read their source's.
class Gemma4State final : public ModelState {
 public:
  Gemma4State(const std::vector<LayerSpec>& specs, const StateOptions& opt) : cache_(specs, opt.n_ctx, opt.kv) {
    n_ctx_ = opt.n_ctx;
    window_ = cache_.wrapping_window();
  }

  size_t bytes() const override { return cache_.bytes(); }
  // Layer l's cache: its own, or the one it shares.
  cpu::KvView view(int l) { return cache_.view(l); }

  // A ring that has wrapped lost the positions it overwrote: a rewind is exact while every position
  // the next queries' windows reach is still held, else the state starts again from 0 (the caller
  // feeds the tokens again, as for a recurrent state).
  bool recurrent() const override { return window_ > 0; }
  void truncate(int n) override {
    if (n >= n_past_) return;
    n = std::max(n, 0);
    if (window_ > 0 && n_past_ - n > kSlidingMicroBatch + 1) n = 0;
    n_past_ = n;
  }

  cpu::Scratch scratch;

 private:
  cpu::KvCache cache_;
  int window_ = 0;  // the largest window among rings smaller than the context (0: none wraps)
};

class Gemma4Model final : public Model {
 public:
  Gemma4Model(std::shared_ptr<gguf::File> file, const LoadOptions&) {
    file_ = std::move(file);
    parse_config();
    load_weights();
  }

  std::unique_ptr<ModelState> new_state(const StateOptions& opt) const override {
    if (gpu_) return gpu_->new_state(opt);
    return std::make_unique<Gemma4State>(specs_, opt);
  }

  void visit_weights(const std::function<void(const Weight&)>& f) const override {
    for (const Weight* w : {&w_.tok_embd, &w_.output_norm, &w_.rope_freqs})
      if (*w) f(*w);
    if (!cfg_.tied_output) f(w_.output);
    for (const Gemma4Layer& L : w_.layers)
      for (const Weight* w : {&L.attn_norm, &L.wq, &L.wk, &L.wv, &L.wo, &L.q_norm, &L.k_norm, &L.post_attn_norm,
                              &L.ffn_norm, &L.ffn_gate, &L.ffn_up, &L.ffn_down, &L.post_ffw_norm_1, &L.pre_ffw_norm_2,
                              &L.router, &L.router_scale, &L.expert_scale, &L.post_ffw_norm_2, &L.experts.gate,
                              &L.experts.up, &L.experts.gate_up, &L.experts.down, &L.post_ffw_norm, &L.out_scale})
        if (*w) f(*w);
  }

  double bytes_per_token() const override {
    double b = static_cast<double>(w_.output.matrix_bytes());
    for (const Gemma4Layer& L : w_.layers) {
      for (const Weight* w : {&L.wq, &L.wk, &L.wv, &L.wo, &L.ffn_gate, &L.ffn_up, &L.ffn_down, &L.router})
        if (*w) b += static_cast<double>(w->matrix_bytes());
      double per_expert = 0;
      for (const Weight* w : {&L.experts.gate, &L.experts.up, &L.experts.gate_up, &L.experts.down})
        if (*w) per_expert += static_cast<double>(w->matrix_bytes());
      b += per_expert * cfg_.n_expert_used;
    }
    return b;
  }

 protected:
  void forward_impl(ThreadPool& pool, const BatchRows& batch, float* logits) const override {
    if (gpu_) return gpu_->forward(pool, batch, logits);
    for (const BatchPart& p : batch.parts)
      if (!dynamic_cast<Gemma4State*>(p.state)) throw Error("forward: the state is not a gemma4 state");
    // Pieces of at most kSlidingMicroBatch tokens of each sequence: a sliding layer's ring holds its
    // window plus that many. Each piece is the same computation per token as one batch (products and
    // attention are per row), so only the logits' rows are gathered: piece r takes tokens
    // [r * kSlidingMicroBatch, ..) of every sequence that has them.
    int longest = 0;
    for (const BatchPart& p : batch.parts) longest = std::max(longest, p.n);
    std::vector<int> logit_base;  // where each part's logit rows start in `logits`
    for (int i = 0, r = 0; i < static_cast<int>(batch.parts.size()); r += batch.parts[i++].n_logits) logit_base.push_back(r);
    for (int t0 = 0; t0 < longest; t0 += kSlidingMicroBatch) {
      BatchRows piece;
      std::vector<float*> dst;
      for (size_t i = 0; i < batch.parts.size(); ++i) {
        const BatchPart& p = batch.parts[i];
        if (t0 >= p.n) continue;
        const int n = std::min(kSlidingMicroBatch, p.n - t0);
        const int first_row = p.n - p.n_logits;  // the part's first row that wants logits
        const int lo = std::max(t0, first_row), nl = std::max(0, t0 + n - lo);
        piece.parts.push_back({p.state, piece.n_rows(), n, p.pos0 + t0, nl});
        piece.tokens.insert(piece.tokens.end(), batch.tokens.begin() + p.row0 + t0, batch.tokens.begin() + p.row0 + t0 + n);
        dst.push_back(nl ? logits + static_cast<int64_t>(logit_base[i] + lo - first_row) * cfg_.n_vocab : nullptr);
      }
      forward_piece(pool, piece, dst);
    }
  }

  bool has_gpu_forward() const override { return true; }
  bool init_gpu(const LoadOptions& opt) override {
#if FITMOE_CUDA
    gpu_ = make_gemma4_gpu(w_, cfg_, plan_, opt);
    return true;
#else
    (void)opt;
    return false;
#endif
  }

 private:
  // One piece (every part at most kSlidingMicroBatch tokens); part i's logit rows go to dst[i].
  void forward_piece(ThreadPool& pool, const BatchRows& b, std::span<float* const> dst) const {
    const ModelConfig& c = cfg_;
    const int T = b.n_rows();
    const int E = c.n_embd;
    const int64_t n = static_cast<int64_t>(T) * E;
    auto& scratch = static_cast<Gemma4State&>(*b.parts[0].state).scratch;
    float* x = scratch.floats(0, static_cast<size_t>(n));   // residual stream
    float* xn = scratch.floats(1, static_cast<size_t>(n));  // normed input of a block
    float* y = scratch.floats(2, static_cast<size_t>(n));   // block output

    cpu::embed(pool, w_.tok_embd, b.tokens, x);
    const float emb_scale = std::sqrt(static_cast<float>(E));
    for (int64_t i = 0; i < n; ++i) x[i] *= emb_scale;
    for (int l = 0; l < c.n_layer; ++l) {
      const Gemma4Layer& L = w_.layers[l];
      cpu::rms_norm(x, L.attn_norm.f32(), xn, E, T, c.rms_eps, E, E);
      attention_block(scratch, pool, L, l, xn, b, y);
      cpu::rms_norm(y, L.post_attn_norm.f32(), y, E, T, c.rms_eps, E, E);
      for (int64_t i = 0; i < n; ++i) x[i] += y[i];
      ffn_block(scratch, pool, L, x, xn, T, y);
      cpu::rms_norm(y, L.post_ffw_norm.f32(), y, E, T, c.rms_eps, E, E);
      for (int64_t i = 0; i < n; ++i) x[i] += y[i];
      if (L.out_scale) {
        const float s = L.out_scale.f32()[0];
        for (int64_t i = 0; i < n; ++i) x[i] *= s;
      }
    }
    const int n_logits = b.n_logits();
    if (n_logits == 0) return;
    norm_logit_rows(b, x, xn, E, c.rms_eps, w_.output_norm.f32());
    // Straight into the caller's rows when they follow each other (one piece), else through scratch.
    bool contiguous = true;
    float* first = nullptr;
    for (size_t i = 0, r = 0; i < b.parts.size(); r += b.parts[i++].n_logits)
      if (b.parts[i].n_logits) {
        if (!first) first = dst[i] - r * c.n_vocab;
        contiguous = contiguous && dst[i] == first + r * c.n_vocab;
      }
    float* out = contiguous ? first : scratch.floats(10, static_cast<size_t>(n_logits) * c.n_vocab);
    cpu::matmul(pool, w_.output, xn, E, n_logits, out, c.n_vocab, scratch, 49);
    if (c.final_logit_softcap > 0) cpu::softcap(out, static_cast<int64_t>(n_logits) * c.n_vocab, c.final_logit_softcap);
    if (contiguous) return;
    for (size_t i = 0, r = 0; i < b.parts.size(); r += b.parts[i++].n_logits)
      if (b.parts[i].n_logits)
        std::memcpy(dst[i], out + r * c.n_vocab, sizeof(float) * b.parts[i].n_logits * c.n_vocab);
  }

  void attention_block(cpu::Scratch& scratch, ThreadPool& pool, const Gemma4Layer& L, int l, const float* xn,
                       const BatchRows& b, float* y) const {
    const AttnSpec& a = L.spec.attn();
    const int T = b.n_rows();
    const int E = cfg_.n_embd, hd = a.head_dim;
    const int qw = a.n_head * hd, kw = a.n_head_kv * hd;
    float* q = scratch.floats(3, static_cast<size_t>(T) * qw);
    float* att = scratch.floats(8, static_cast<size_t>(T) * qw);
    cpu::matmul(pool, L.wq, xn, E, T, q, qw, scratch, 40);
    cpu::rms_norm(q, L.q_norm.f32(), q, hd, T * a.n_head, cfg_.rms_eps, hd, hd);
    const RopeParams rope = make_rope_params(a.n_rot, a.rope_base, 1.0f, 0.0f, 1.0f, 32.0f, 1.0f, cfg_.n_ctx_train);
    const float* ff = a.rope_freqs && w_.rope_freqs ? w_.rope_freqs.f32() : nullptr;
    float* k = nullptr;
    float* v = nullptr;
    if (a.kv_from < 0) {
      k = scratch.floats(6, static_cast<size_t>(T) * kw);
      v = scratch.floats(7, static_cast<size_t>(T) * kw);
      cpu::matmul(pool, L.wk, xn, E, T, k, kw, scratch, 41);
      if (L.wv) cpu::matmul(pool, L.wv, xn, E, T, v, kw, scratch, 42);
      else std::memcpy(v, k, sizeof(float) * static_cast<size_t>(T) * kw);  // K = V: the raw projection
      cpu::rms_norm(k, L.k_norm.f32(), k, hd, T * a.n_head_kv, cfg_.rms_eps, hd, hd);
      cpu::rms_norm(v, nullptr, v, hd, T * a.n_head_kv, cfg_.rms_eps, hd, hd);
    }
    for (const BatchPart& p : b.parts) {
      const int64_t r = p.row0;
      const cpu::KvView kv = static_cast<Gemma4State&>(*p.state).view(l);
      cpu::rope_neox(q + r * qw, p.n, a.n_head, hd, qw, a.n_rot, p.pos0, rope, ff);
      if (a.kv_from < 0) {
        cpu::rope_neox(k + r * kw, p.n, a.n_head_kv, hd, kw, a.n_rot, p.pos0, rope, ff);
        cpu::kv_store(kv, p.pos0, p.n, k + r * kw, kw, v + r * kw, kw, kw, kw);
      }
      cpu::attention(pool, q + r * qw, qw, kv, p.pos0, p.n, a.n_head, a.n_head_kv, hd, hd, a.scale, att + r * qw, qw,
                     scratch, 46, a.window);
    }
    cpu::matmul(pool, L.wo, att, qw, T, y, E, scratch, 47);
  }

  // The FFN of a layer from the residual stream x (after attention) into y, before post_ffw_norm.
  void ffn_block(cpu::Scratch& scratch, ThreadPool& pool, const Gemma4Layer& L, const float* x, float* xn, int T,
                 float* y) const {
    const ModelConfig& c = cfg_;
    const int E = c.n_embd;
    const int64_t n = static_cast<int64_t>(T) * E;
    cpu::rms_norm(x, L.ffn_norm.f32(), xn, E, T, c.rms_eps, E, E);
    cpu::dense_ffn(pool, L.ffn_gate, L.ffn_up, L.ffn_down, xn, T, y, scratch, Activation::GeluTanh);
    if (!L.spec.moe) return;
    const MoeSpec& m = *L.spec.moe;
    cpu::rms_norm(y, L.post_ffw_norm_1.f32(), y, E, T, c.rms_eps, E, E);
    // Router: on RMSNorm(x) / sqrt(n_embd) * its scale, not on the experts' input.
    float* rin = scratch.floats(4, static_cast<size_t>(n));
    cpu::rms_norm(x, nullptr, rin, E, T, c.rms_eps, E, E);
    const float inv_sqrt = 1.0f / std::sqrt(static_cast<float>(E));
    const float* rs = L.router_scale.f32();
    for (int t = 0; t < T; ++t)
      for (int i = 0; i < E; ++i) {
        float& v = rin[static_cast<int64_t>(t) * E + i];
        v = v * inv_sqrt * rs[i];
      }
    float* router = scratch.floats(5, static_cast<size_t>(T) * m.n_expert);
    cpu::matmul(pool, L.router, rin, E, T, router, m.n_expert, scratch, 48);
    std::vector<int32_t> chosen(static_cast<size_t>(T) * m.n_expert_used);
    std::vector<float> chosen_w(chosen.size());
    for (int t = 0; t < T; ++t)
      cpu::route_softmax_topk(router + static_cast<int64_t>(t) * m.n_expert, m.n_expert, m.n_expert_used, true,
                              chosen.data() + t * m.n_expert_used, chosen_w.data() + t * m.n_expert_used);
    if (L.expert_scale) {
      const float* es = L.expert_scale.f32();
      for (size_t j = 0; j < chosen.size(); ++j) chosen_w[j] *= es[chosen[j]];
    }
    cpu::rms_norm(x, L.pre_ffw_norm_2.f32(), xn, E, T, c.rms_eps, E, E);
    float* ym = scratch.floats(9, static_cast<size_t>(n));
    cpu::moe_ffn(pool, L.experts, xn, T, E, chosen.data(), chosen_w.data(), m.n_expert_used, ym, scratch,
                 Activation::GeluTanh);
    cpu::rms_norm(ym, L.post_ffw_norm_2.f32(), ym, E, T, c.rms_eps, E, E);
    for (int64_t i = 0; i < n; ++i) y[i] += ym[i];
  }

  [[noreturn]] void bad(const std::string& what) const { throw Error(file_->path() + ": " + cfg_.arch + ": " + what); }

  // A per-layer array of integers (or one value for every layer).
  std::vector<int> per_layer_ints(const std::string& key, int n_layer) const {
    const gguf::Value* v = file_->find(key);
    if (!v) bad("missing " + key);
    if (!v->is_array()) return std::vector<int>(n_layer, static_cast<int>(file_->get_uint(key)));
    if (v->count != static_cast<uint64_t>(n_layer))
      bad(key + " has " + std::to_string(v->count) + " entries, but block_count is " + std::to_string(n_layer));
    std::vector<int> out;
    for (int64_t x : file_->get_int_array(key)) {
      if (x < 0 || x > 65536) bad(key + " has an entry out of range (" + std::to_string(x) + ")");
      out.push_back(static_cast<int>(x));
    }
    return out;
  }

  void parse_config() {
    const gguf::File& f = *file_;
    ModelConfig& c = cfg_;
    c.arch = std::string(f.get_string("general.architecture"));
    c.name = std::string(f.opt_string("general.name").value_or(""));
    const std::string a = c.arch + ".";
    const uint64_t n_layer = f.get_uint(a + "block_count");
    if (n_layer == 0 || n_layer > 1024) bad("block_count out of range");
    c.n_layer = static_cast<int>(n_layer);
    c.n_embd = static_cast<int>(f.get_uint(a + "embedding_length"));
    if (f.opt_uint(a + "embedding_length_per_layer_input").value_or(0) != 0)
      bad("per-layer input embeddings (embedding_length_per_layer_input, Gemma 4 E2B / E4B) are not supported yet");
    {
      const std::vector<int> heads = per_layer_ints(a + "attention.head_count", c.n_layer);
      for (int h : heads)
        if (h != heads[0]) bad("attention.head_count differs between layers, which fitmoe does not run");
      c.n_head = heads[0];
    }
    c.n_head_kv_layers = per_layer_ints(a + "attention.head_count_kv", c.n_layer);
    c.head_dim = static_cast<int>(f.get_uint(a + "attention.key_length"));
    c.head_dim_v = static_cast<int>(f.opt_uint(a + "attention.value_length").value_or(c.head_dim));
    c.head_dim_swa = static_cast<int>(f.opt_uint(a + "attention.key_length_swa").value_or(c.head_dim));
    const int hdv_swa = static_cast<int>(f.opt_uint(a + "attention.value_length_swa").value_or(c.head_dim_swa));
    if (c.head_dim != c.head_dim_v || c.head_dim_swa != hdv_swa)
      bad("key_length and value_length must agree (global " + std::to_string(c.head_dim) + " / " +
          std::to_string(c.head_dim_v) + ", sliding " + std::to_string(c.head_dim_swa) + " / " + std::to_string(hdv_swa) + ")");
    c.n_ctx_train = static_cast<int>(f.opt_uint(a + "context_length").value_or(8192));
    c.rope_n_ctx_orig = c.n_ctx_train;
    c.rms_eps = static_cast<float>(f.get_float(a + "attention.layer_norm_rms_epsilon"));
    c.rope_base = static_cast<float>(f.opt_float(a + "rope.freq_base").value_or(1000000.0));
    c.rope_base_swa = static_cast<float>(f.opt_float(a + "rope.freq_base_swa").value_or(10000.0));
    c.n_rot = static_cast<int>(f.opt_uint(a + "rope.dimension_count").value_or(c.head_dim));
    c.n_rot_swa = static_cast<int>(f.opt_uint(a + "rope.dimension_count_swa").value_or(c.head_dim_swa));
    const std::string scaling(f.opt_string(a + "rope.scaling.type").value_or("none"));
    const double factor = f.opt_float(a + "rope.scaling.factor").value_or(0.0);
    if (scaling != "none" || (factor != 0.0 && factor != 1.0))
      bad("rope scaling ('" + scaling + "') is not supported for " + c.arch + " yet");
    c.sliding_window = static_cast<int>(f.get_uint(a + "attention.sliding_window"));
    c.shared_kv_layers = static_cast<int>(f.opt_uint(a + "attention.shared_kv_layers").value_or(0));
    c.final_logit_softcap = static_cast<float>(f.opt_float(a + "final_logit_softcapping").value_or(0.0));
    // The layer pattern: a bool per layer (true = sliding window).
    const gguf::Value* pat = f.find(a + "attention.sliding_window_pattern");
    if (!pat) bad("missing attention.sliding_window_pattern");
    if (!pat->is_array() || pat->count != n_layer)
      bad("attention.sliding_window_pattern must list " + std::to_string(n_layer) + " layers (has " +
          std::to_string(pat->is_array() ? pat->count : 1) + ")");
    c.swa_layers.assign(c.n_layer, false);
    if (pat->elem_type == gguf::ValueType::BOOL) {
      for (uint64_t i = 0; i < n_layer; ++i) c.swa_layers[i] = pat->raw[i] != 0;
    } else {
      const std::vector<int64_t> ints = f.get_int_array(a + "attention.sliding_window_pattern");
      for (uint64_t i = 0; i < n_layer; ++i) c.swa_layers[i] = ints[i] != 0;
    }
    c.n_ff = static_cast<int>(f.get_uint(a + "feed_forward_length"));
    c.n_expert = static_cast<int>(f.opt_uint(a + "expert_count").value_or(0));
    if (c.n_expert) {
      c.n_expert_used = static_cast<int>(f.get_uint(a + "expert_used_count"));
      c.n_ff_exp = static_cast<int>(f.get_uint(a + "expert_feed_forward_length"));
    }
    // The first global layer's KV heads stand for the model in summaries; the layers keep their own.
    c.n_head_kv = c.n_head_kv_layers[0];
    for (int l = 0; l < c.n_layer; ++l)
      if (!c.swa_layers[l]) {
        c.n_head_kv = c.n_head_kv_layers[l];
        break;
      }
    validate_config();
  }

  void validate_config() const {
    const ModelConfig& c = cfg_;
    if (c.n_embd <= 0 || c.n_head <= 0 || c.head_dim <= 0 || c.head_dim_swa <= 0) bad("attention sizes must be positive");
    for (int l = 0; l < c.n_layer; ++l) {
      const int kv = c.n_head_kv_layers[l];
      if (kv <= 0 || c.n_head % kv)
        bad("layer " + std::to_string(l) + ": head_count (" + std::to_string(c.n_head) +
            ") must be a positive multiple of its head_count_kv (" + std::to_string(kv) + ")");
    }
    if (c.n_rot <= 0 || c.n_rot > c.head_dim || c.n_rot % 2) bad("rope.dimension_count out of range");
    if (c.n_rot_swa <= 0 || c.n_rot_swa > c.head_dim_swa || c.n_rot_swa % 2) bad("rope.dimension_count_swa out of range");
    for (float b : {c.rope_base, c.rope_base_swa})
      if (!std::isfinite(b) || !(b > 0.0f)) bad("rope.freq_base / freq_base_swa must be positive numbers");
    if (!(c.rms_eps > 0.0f)) bad("attention.layer_norm_rms_epsilon must be positive");
    if (!std::isfinite(c.final_logit_softcap) || c.final_logit_softcap < 0) bad("final_logit_softcapping must be >= 0");
    bool any_swa = false;
    for (bool s : c.swa_layers) any_swa |= s;
    if (any_swa && c.sliding_window <= 0) bad("attention.sliding_window must be positive");
    if (c.n_ff <= 0) bad("feed_forward_length must be positive");
    if (c.n_expert && (c.n_expert_used <= 0 || c.n_expert_used > c.n_expert || c.n_ff_exp <= 0))
      bad("expert counts out of range (expert_count " + std::to_string(c.n_expert) + ", expert_used_count " +
          std::to_string(c.n_expert_used) + ", expert_feed_forward_length " + std::to_string(c.n_ff_exp) + ")");
    if (c.shared_kv_layers < 0 || c.shared_kv_layers >= c.n_layer)
      bad("attention.shared_kv_layers (" + std::to_string(c.shared_kv_layers) + ") must be below block_count (" +
          std::to_string(c.n_layer) + ")");
    if (c.shared_kv_layers) {
      // The reference's rule takes layer n_kv - 2 for sliding and n_kv - 1 for global shared layers:
      // those must exist and be of the reader's kind (same head width, KV heads and window).
      const int n_kv = c.n_layer_kv();
      for (int l = n_kv; l < c.n_layer; ++l) {
        const int src = n_kv - (c.swa_layers[l] ? 2 : 1);
        if (src < 0 || c.swa_layers[src] != c.swa_layers[l] || c.n_head_kv_layers[src] != c.n_head_kv_layers[l])
          bad("shared-KV layer " + std::to_string(l) + " (" + (c.swa_layers[l] ? "sliding" : "global") +
              ") would read layer " + std::to_string(src) + "'s KV, which is not a layer of the same kind and KV heads");
      }
    }
  }

  void require_f32(const Weight& w) const {
    if (w && w.type != DType::F32)
      throw Error(file_->path() + ": tensor " + w.info->name + " must be f32, found " + dtype_name(w.type));
  }

  void load_weights() {
    const gguf::File& f = *file_;
    ModelConfig& c = cfg_;
    const int64_t E = c.n_embd;
    if (const gguf::TensorInfo* te = f.find_tensor("token_embd.weight")) c.n_vocab = static_cast<int>(te->ne[1]);
    w_.tok_embd = tensor("token_embd.weight", {E, c.n_vocab});
    w_.output_norm = tensor("output_norm.weight", {E});
    w_.output = tensor("output.weight", {E, c.n_vocab}, /*optional=*/true);
    c.tied_output = !w_.output;
    if (!w_.output) w_.output = w_.tok_embd;
    w_.rope_freqs = tensor("rope_freqs.weight", {c.n_rot / 2}, /*optional=*/true);
    require_f32(w_.output_norm);
    require_f32(w_.rope_freqs);
    // K = V is known from the tensors only: a layer with its own KV and no attn_v.
    c.k_eq_v_layers.assign(c.n_layer, false);
    for (int l = 0; l < c.n_layer_kv(); ++l)
      c.k_eq_v_layers[l] = !f.find_tensor("blk." + std::to_string(l) + ".attn_v.weight");
    specs_ = gemma4_layer_specs(c);
    w_.layers.resize(c.n_layer);
    for (int l = 0; l < c.n_layer; ++l) {
      Gemma4Layer& L = w_.layers[l];
      L.spec = specs_[l];
      const AttnSpec& a = L.spec.attn();
      const std::string p = "blk." + std::to_string(l) + ".";
      const int64_t hd = a.head_dim, qw = static_cast<int64_t>(a.n_head) * hd, kw = static_cast<int64_t>(a.n_head_kv) * hd;
      // The layer kind from the pattern against the width of its query: name both when they disagree.
      if (const gguf::TensorInfo* tq = f.find_tensor(p + "attn_q.weight"); tq && tq->ne[1] != qw) {
        const int64_t other = static_cast<int64_t>(a.n_head) * (c.swa_layers[l] ? c.head_dim : c.head_dim_swa);
        if (tq->ne[1] == other)
          bad("layer " + std::to_string(l) + " has the attention of a " + (c.swa_layers[l] ? "global" : "sliding") +
              " layer, but attention.sliding_window_pattern makes it " + (c.swa_layers[l] ? "sliding" : "global"));
      }
      L.attn_norm = tensor(p + "attn_norm.weight", {E});
      L.wq = tensor(p + "attn_q.weight", {E, qw});
      L.q_norm = tensor(p + "attn_q_norm.weight", {hd});
      if (a.kv_from < 0) {
        L.wk = tensor(p + "attn_k.weight", {E, kw});
        L.wv = tensor(p + "attn_v.weight", {E, kw}, /*optional=*/true);
        L.k_norm = tensor(p + "attn_k_norm.weight", {hd});
      }
      L.wo = tensor(p + "attn_output.weight", {qw, E});
      L.post_attn_norm = tensor(p + "post_attention_norm.weight", {E});
      L.ffn_norm = tensor(p + "ffn_norm.weight", {E});
      L.ffn_gate = tensor(p + "ffn_gate.weight", {E, c.n_ff});
      L.ffn_up = tensor(p + "ffn_up.weight", {E, c.n_ff});
      L.ffn_down = tensor(p + "ffn_down.weight", {c.n_ff, E});
      L.post_ffw_norm = tensor(p + "post_ffw_norm.weight", {E});
      L.out_scale = tensor(p + "layer_output_scale.weight", {1}, /*optional=*/true);
      if (L.spec.moe) {
        const int64_t nx = c.n_expert, nf = c.n_ff_exp;
        L.post_ffw_norm_1 = tensor(p + "post_ffw_norm_1.weight", {E});
        L.pre_ffw_norm_2 = tensor(p + "pre_ffw_norm_2.weight", {E});
        L.post_ffw_norm_2 = tensor(p + "post_ffw_norm_2.weight", {E});
        L.router = tensor(p + "ffn_gate_inp.weight", {E, nx});
        L.router_scale = tensor(p + "ffn_gate_inp.scale", {E});
        L.expert_scale = tensor(p + "ffn_down_exps.scale", {nx}, /*optional=*/true);
        if (f.find_tensor(p + "ffn_gate_up_exps.weight")) {
          L.experts.gate_up = tensor(p + "ffn_gate_up_exps.weight", {E, 2 * nf, nx});
        } else {
          L.experts.gate = tensor(p + "ffn_gate_exps.weight", {E, nf, nx});
          L.experts.up = tensor(p + "ffn_up_exps.weight", {E, nf, nx});
        }
        L.experts.down = tensor(p + "ffn_down_exps.weight", {nf, E, nx});
      } else if (f.find_tensor(p + "ffn_gate_inp.weight")) {
        bad("layer " + std::to_string(l) + " has a router (ffn_gate_inp) but expert_count is missing");
      }
      for (const Weight* w : {&L.attn_norm, &L.q_norm, &L.k_norm, &L.post_attn_norm, &L.ffn_norm, &L.post_ffw_norm,
                              &L.out_scale, &L.post_ffw_norm_1, &L.pre_ffw_norm_2, &L.post_ffw_norm_2, &L.router,
                              &L.router_scale, &L.expert_scale})
        require_f32(*w);
    }
  }

  std::vector<LayerSpec> specs_;
  Gemma4Weights w_;
};

}  // namespace

std::unique_ptr<Model> make_gemma4_model(std::shared_ptr<gguf::File> file, const LoadOptions& opt) {
  return std::make_unique<Gemma4Model>(std::move(file), opt);
}

}  // namespace fitmoe
