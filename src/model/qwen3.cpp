// Qwen3 (dense) and Qwen3-MoE: the forward pass on the CPU.
//
// Per layer: RMSNorm -> Q, K, V -> per-head RMSNorm of Q and K -> NeoX RoPE -> causal GQA attention
// (scale 1/sqrt(head_dim)) -> output projection -> residual; RMSNorm -> FFN (SwiGLU, or router softmax
// -> top-k renormalised -> SwiGLU experts) -> residual. Final RMSNorm and the output head (or the tied
// embedding).
#include <cmath>
#include <cstring>
#include <optional>

#include "model/architectures.h"
#include "model/qwen3.h"
#include "runtime/cpu_ops.h"
#include "runtime/error.h"

namespace fitmoe {

namespace {

class Qwen3State final : public ModelState {
 public:
  Qwen3State(const ModelConfig& c, const StateOptions& opt) : cache(layer_specs(c), opt.n_ctx, opt.kv) {
    n_ctx_ = opt.n_ctx;
  }
  size_t bytes() const override { return cache.bytes(); }
  cpu::KvView view(int l) { return cache.view(l); }

  cpu::KvCache cache;
  cpu::Scratch scratch;
};

class Qwen3Model final : public Model {
 public:
  Qwen3Model(std::shared_ptr<gguf::File> file, const LoadOptions& opt) {
    file_ = std::move(file);
    const gguf::File& f = *file_;
    ModelConfig& c = cfg_;
    c.arch = std::string(f.get_string("general.architecture"));
    c.name = std::string(f.opt_string("general.name").value_or(""));
    const std::string a = c.arch + ".";
    const bool moe = c.arch == "qwen3moe";
    c.n_layer = static_cast<int>(f.get_uint(a + "block_count"));
    c.n_embd = static_cast<int>(f.get_uint(a + "embedding_length"));
    c.n_head = static_cast<int>(f.get_uint(a + "attention.head_count"));
    c.n_head_kv = static_cast<int>(f.opt_uint(a + "attention.head_count_kv").value_or(c.n_head));
    c.head_dim = static_cast<int>(f.opt_uint(a + "attention.key_length").value_or(c.n_head ? c.n_embd / c.n_head : 0));
    c.head_dim_v = static_cast<int>(f.opt_uint(a + "attention.value_length").value_or(c.head_dim));
    c.n_ctx_train = static_cast<int>(f.opt_uint(a + "context_length").value_or(4096));
    c.rms_eps = static_cast<float>(f.get_float(a + "attention.layer_norm_rms_epsilon"));
    c.rope_base = static_cast<float>(f.opt_float(a + "rope.freq_base").value_or(10000.0));
    c.n_rot = static_cast<int>(f.opt_uint(a + "rope.dimension_count").value_or(c.head_dim));
    parse_rope_scaling(a);
    if (moe) {
      c.n_expert = static_cast<int>(f.get_uint(a + "expert_count"));
      c.n_expert_used = static_cast<int>(f.get_uint(a + "expert_used_count"));
      c.n_ff_exp = static_cast<int>(f.get_uint(a + "expert_feed_forward_length"));
    } else {
      c.n_ff = static_cast<int>(f.get_uint(a + "feed_forward_length"));
    }
    validate_config();

    const int64_t E = c.n_embd, hd = c.head_dim, hdv = c.head_dim_v;
    // The vocabulary size is the embedding's row count (tokenizer arrays may be padded differently).
    if (const gguf::TensorInfo* te = f.find_tensor("token_embd.weight")) c.n_vocab = static_cast<int>(te->ne[1]);
    w_.tok_embd = tensor("token_embd.weight", {E, c.n_vocab});
    w_.output_norm = tensor("output_norm.weight", {E});
    w_.output = tensor("output.weight", {E, c.n_vocab}, /*optional=*/true);
    c.tied_output = !w_.output;
    if (!w_.output) w_.output = w_.tok_embd;
    w_.layers.resize(c.n_layer);
    for (int l = 0; l < c.n_layer; ++l) {
      Qwen3Layer& L = w_.layers[l];
      const std::string p = "blk." + std::to_string(l) + ".";
      L.attn_norm = tensor(p + "attn_norm.weight", {E});
      L.wq = tensor(p + "attn_q.weight", {E, hd * c.n_head});
      L.wk = tensor(p + "attn_k.weight", {E, hd * c.n_head_kv});
      L.wv = tensor(p + "attn_v.weight", {E, hdv * c.n_head_kv});
      L.wo = tensor(p + "attn_output.weight", {hdv * c.n_head, E});
      L.q_norm = tensor(p + "attn_q_norm.weight", {hd});
      L.k_norm = tensor(p + "attn_k_norm.weight", {hd});
      L.ffn_norm = tensor(p + "ffn_norm.weight", {E});
      if (moe) {
        L.router = tensor(p + "ffn_gate_inp.weight", {E, c.n_expert});
        L.experts.gate = tensor(p + "ffn_gate_exps.weight", {E, c.n_ff_exp, c.n_expert});
        L.experts.up = tensor(p + "ffn_up_exps.weight", {E, c.n_ff_exp, c.n_expert});
        L.experts.down = tensor(p + "ffn_down_exps.weight", {c.n_ff_exp, E, c.n_expert});
      } else {
        L.ffn_gate = tensor(p + "ffn_gate.weight", {E, c.n_ff});
        L.ffn_up = tensor(p + "ffn_up.weight", {E, c.n_ff});
        L.ffn_down = tensor(p + "ffn_down.weight", {c.n_ff, E});
      }
    }
    for (const Weight* w : {&w_.output_norm}) require_f32(*w);
    for (auto& L : w_.layers)
      for (const Weight* w : {&L.attn_norm, &L.q_norm, &L.k_norm, &L.ffn_norm, &L.router})
        if (*w) require_f32(*w);
  }

  std::unique_ptr<ModelState> new_state(const StateOptions& opt) const override {
    if (gpu_) return gpu_->new_state(opt);
    return std::make_unique<Qwen3State>(cfg_, opt);
  }

  void visit_weights(const std::function<void(const Weight&)>& f) const override {
    for (const Weight* w : {&w_.tok_embd, &w_.output_norm, &w_.output})
      if (*w) f(*w);
    for (const Qwen3Layer& L : w_.layers)
      for (const Weight* w : {&L.attn_norm, &L.wq, &L.wk, &L.wv, &L.wo, &L.q_norm, &L.k_norm, &L.ffn_norm, &L.ffn_gate,
                              &L.ffn_up, &L.ffn_down, &L.router, &L.experts.gate, &L.experts.up, &L.experts.down})
        if (*w) f(*w);
  }

  double bytes_per_token() const override {
    double b = static_cast<double>(w_.output.matrix_bytes());
    for (auto& L : w_.layers) {
      for (const Weight* w : {&L.wq, &L.wk, &L.wv, &L.wo, &L.ffn_gate, &L.ffn_up, &L.ffn_down, &L.router})
        if (*w) b += static_cast<double>(w->matrix_bytes());
      if (L.experts.gate) {
        double per_expert = static_cast<double>(L.experts.gate.matrix_bytes() + L.experts.up.matrix_bytes() +
                                                L.experts.down.matrix_bytes());
        b += per_expert * cfg_.n_expert_used;
      }
    }
    return b;
  }

 protected:
  void forward_impl(ThreadPool& pool, const BatchRows& batch, float* logits) const override {
    if (gpu_) return gpu_->forward(pool, batch, logits);
    // The products run over every row of the batch; RoPE, the KV store and attention per sequence.
    for (const BatchPart& p : batch.parts)
      if (!dynamic_cast<Qwen3State*>(p.state)) throw Error("forward: the state is not a " + cfg_.arch + " state");
    auto& scratch = static_cast<Qwen3State&>(*batch.parts[0].state).scratch;
    const ModelConfig& c = cfg_;
    const std::span<const int32_t> tokens(batch.tokens);
    const int T = batch.n_rows();
    const int E = c.n_embd, hd = c.head_dim, hdv = c.head_dim_v;
    const int q_w = c.n_head * hd, k_w = c.n_head_kv * hd, v_w = c.n_head_kv * hdv;

    float* x = scratch.floats(0, static_cast<size_t>(T) * E);     // residual stream
    float* xn = scratch.floats(1, static_cast<size_t>(T) * E);    // normed input of a block
    float* q = scratch.floats(2, static_cast<size_t>(T) * q_w);
    float* k = scratch.floats(3, static_cast<size_t>(T) * k_w);
    float* v = scratch.floats(4, static_cast<size_t>(T) * v_w);
    float* att = scratch.floats(5, static_cast<size_t>(T) * c.n_head * hdv);
    float* y = scratch.floats(6, static_cast<size_t>(T) * E);     // block output before the residual add
    float* router = scratch.floats(7, static_cast<size_t>(T) * std::max(c.n_expert, 1));
    std::vector<int32_t> chosen(static_cast<size_t>(T) * std::max(c.n_expert_used, 1));
    std::vector<float> chosen_w(chosen.size());

    const RopeParams rope = rope_params(c);
    cpu::embed(pool, w_.tok_embd, tokens, x);
    for (int l = 0; l < c.n_layer; ++l) {
      const Qwen3Layer& L = w_.layers[l];
      // Attention block.
      cpu::rms_norm(x, L.attn_norm.f32(), xn, E, T, c.rms_eps, E, E);
      {
        DType act = dtype_info(L.wq.type).act_type;
        uint8_t* buf = scratch.bytes(30, cpu::quantized_acts_bytes(act, E, T));
        cpu::QuantizedActs xa = cpu::quantize_acts(pool, act, xn, E, E, T, buf);
        // Q, K and V read the same input: one parallel step when their activation formats agree.
        std::vector<cpu::MatmulJob> jobs = {{&L.wq, q, q_w}};
        auto project = [&](const Weight& w, float* out, int ld) {
          if (dtype_info(w.type).act_type == act) jobs.push_back({&w, out, ld});
          else cpu::matmul(pool, w, xn, E, T, out, ld, scratch, 31);
        };
        project(L.wk, k, k_w);
        project(L.wv, v, v_w);
        cpu::matmul_many(pool, jobs, xa);
      }
      cpu::rms_norm(q, L.q_norm.f32(), q, hd, T * c.n_head, c.rms_eps, hd, hd);
      cpu::rms_norm(k, L.k_norm.f32(), k, hd, T * c.n_head_kv, c.rms_eps, hd, hd);
      for (const BatchPart& p : batch.parts) {
        float *qp = q + static_cast<int64_t>(p.row0) * q_w, *kp = k + static_cast<int64_t>(p.row0) * k_w,
              *vp = v + static_cast<int64_t>(p.row0) * v_w;
        cpu::rope_neox(qp, p.n, c.n_head, hd, q_w, c.n_rot, p.pos0, rope);
        cpu::rope_neox(kp, p.n, c.n_head_kv, hd, k_w, c.n_rot, p.pos0, rope);
        cpu::KvView kv = static_cast<Qwen3State&>(*p.state).view(l);
        cpu::kv_store(kv, p.pos0, p.n, kp, k_w, vp, v_w, k_w, v_w);
        cpu::attention(pool, qp, q_w, kv, p.pos0, p.n, c.n_head, c.n_head_kv, hd, hdv,
                       1.0f / std::sqrt(static_cast<float>(hd)), att + static_cast<int64_t>(p.row0) * c.n_head * hdv,
                       c.n_head * hdv, scratch, 32);
      }
      cpu::matmul(pool, L.wo, att, c.n_head * hdv, T, y, E, scratch, 33);
      for (int64_t i = 0; i < static_cast<int64_t>(T) * E; ++i) x[i] += y[i];

      // FFN block.
      cpu::rms_norm(x, L.ffn_norm.f32(), xn, E, T, c.rms_eps, E, E);
      if (L.router) {
        cpu::matmul(pool, L.router, xn, E, T, router, c.n_expert, scratch, 34);
        for (int t = 0; t < T; ++t)
          cpu::route_softmax_topk(router + static_cast<int64_t>(t) * c.n_expert, c.n_expert, c.n_expert_used, true,
                                  chosen.data() + t * c.n_expert_used, chosen_w.data() + t * c.n_expert_used);
        cpu::moe_ffn(pool, L.experts, xn, T, E, chosen.data(), chosen_w.data(), c.n_expert_used, y, scratch);
      } else {
        cpu::dense_ffn(pool, L.ffn_gate, L.ffn_up, L.ffn_down, xn, T, y, scratch);
      }
      for (int64_t i = 0; i < static_cast<int64_t>(T) * E; ++i) x[i] += y[i];
    }
    norm_logit_rows(batch, x, xn, E, c.rms_eps, w_.output_norm.f32());
    if (const int n = batch.n_logits()) cpu::matmul(pool, w_.output, xn, E, n, logits, c.n_vocab, scratch, 35);
  }

 protected:
  bool has_gpu_forward() const override { return true; }
  bool init_gpu(const LoadOptions& opt) override {
#if FITMOE_CUDA
    gpu_ = make_qwen3_gpu(w_, cfg_, plan_, opt);
    return true;
#else
    (void)opt;
    return false;
#endif
  }

 private:
  void validate_config() {
    const ModelConfig& c = cfg_;
    auto bad = [&](const std::string& what) { throw Error(file_->path() + ": " + c.arch + ": " + what); };
    if (c.n_layer <= 0 || c.n_layer > 1024) bad("block_count out of range");
    if (c.n_embd <= 0 || c.n_head <= 0 || c.n_head_kv <= 0 || c.head_dim <= 0 || c.head_dim_v <= 0)
      bad("attention sizes must be positive");
    if (c.n_head % c.n_head_kv != 0) bad("head_count must be a multiple of head_count_kv");
    if (c.n_rot <= 0 || c.n_rot > c.head_dim || c.n_rot % 2) bad("rope dimension count out of range");
    if (!std::isfinite(c.rope_base) || !(c.rope_base > 0.0f)) bad("rope.freq_base must be a positive number");
    if (c.arch == "qwen3moe" && (c.n_expert <= 0 || c.n_expert_used <= 0 || c.n_expert_used > c.n_expert || c.n_ff_exp <= 0))
      bad("expert counts out of range");
    if (c.arch == "qwen3" && c.n_ff <= 0) bad("feed_forward_length must be positive");
  }
  // RoPE scaling as the reference resolves it (llama_model's hparams, then llama_context's cparams), so
  // that the kernels take the values as they are.
  void parse_rope_scaling(const std::string& a) {
    const gguf::File& f = *file_;
    ModelConfig& c = cfg_;
    auto bad = [&](const std::string& what) { throw Error(f.path() + ": " + c.arch + ": " + what); };
    // A float key that must be finite (and positive unless zero is allowed); nullopt when absent.
    auto num = [&](const char* key, bool positive) -> std::optional<float> {
      auto v = f.opt_float(a + key);
      if (!v) return std::nullopt;
      const float x = static_cast<float>(*v);
      if (!std::isfinite(x) || (positive && !(x > 0.0f)))
        bad(std::string(key) + " must be a " + (positive ? "positive" : "finite") + " number, found " + std::to_string(*v));
      return x;
    };
    // factor 0 means "not set" to the reference (scale 1); the old key name is its fallback.
    std::optional<float> factor = f.find(a + "rope.scaling.factor") ? num("rope.scaling.factor", false)
                                                                    : num("rope.scale_linear", false);
    if (factor && *factor < 0.0f) bad("rope.scaling.factor must not be negative, found " + std::to_string(*factor));
    // The reference reads a missing type as linear, so that a bare factor scales linearly; without a
    // factor that is no scaling at all, so call it none.
    const bool has_factor = factor && *factor != 0.0f;
    const std::string type(f.opt_string(a + "rope.scaling.type").value_or(has_factor ? "linear" : "none"));
    if (type == "none") c.rope_scaling = RopeScaling::None;
    else if (type == "linear") c.rope_scaling = RopeScaling::Linear;
    else if (type == "yarn") c.rope_scaling = RopeScaling::Yarn;
    else bad("rope scaling type '" + type + "' is not supported (none, linear, yarn)");
    const bool yarn = c.rope_scaling == RopeScaling::Yarn;

    c.rope_freq_scale = has_factor ? 1.0f / *factor : 1.0f;
    if (c.rope_scaling == RopeScaling::None) c.rope_freq_scale = 1.0f;  // the reference never scales then
    if (!std::isfinite(c.rope_freq_scale) || !(c.rope_freq_scale > 0.0f)) bad("rope.scaling.factor is out of range");

    const uint64_t n_orig = f.opt_uint(a + "rope.scaling.original_context_length").value_or(c.n_ctx_train);
    if (n_orig == 0 || n_orig > (1u << 30)) bad("rope.scaling.original_context_length out of range");
    c.rope_n_ctx_orig = static_cast<int>(n_orig);

    // YaRN's knobs; a negative ext_factor is the reference's "not set".
    const float ext = num("rope.scaling.yarn_ext_factor", false).value_or(-1.0f);
    const float yarn_attn = num("rope.scaling.yarn_attn_factor", true).value_or(1.0f);
    c.rope_beta_fast = num("rope.scaling.yarn_beta_fast", true).value_or(32.0f);
    c.rope_beta_slow = num("rope.scaling.yarn_beta_slow", true).value_or(1.0f);
    if (c.rope_beta_fast < c.rope_beta_slow) bad("rope.scaling.yarn_beta_fast must not be below yarn_beta_slow");
    const float log_mul = num("rope.scaling.yarn_log_multiplier", false).value_or(0.0f);
    const float rope_attn = num("rope.scaling.attn_factor", true).value_or(1.0f);
    c.rope_ext_factor = ext >= 0.0f ? ext : (yarn ? 1.0f : 0.0f);

    // The magnitude: with YaRN on, the reference sets attn_factor to HF's mscale and divides out the
    // 1 + 0.1 ln(s) ggml multiplies in again per pair, so the net magnitude is HF's. Float arithmetic in
    // the reference's order so that the bits agree.
    float attn = yarn_attn;
    if (c.rope_ext_factor != 0.0f) {
      const float s = 1.0f / c.rope_freq_scale;
      auto hf_mscale = [](float scale, float m) { return scale <= 1.0f ? 1.0f : 0.1f * m * std::log(scale) + 1.0f; };
      attn = log_mul != 0.0f ? hf_mscale(s, 1.0f) / hf_mscale(s, log_mul) : hf_mscale(s, 1.0f);
      attn *= 1.0f / (1.0f + 0.1f * std::log(s));
    }
    c.rope_attn_factor = attn * rope_attn;
    if (!std::isfinite(c.rope_attn_factor) || !(c.rope_attn_factor > 0.0f)) bad("rope attention factor out of range");
    if (c.rope_ext_factor != 0.0f && !(c.rope_base > 1.0f))
      bad("YaRN needs rope.freq_base above 1, found " + std::to_string(c.rope_base));
  }

  void require_f32(const Weight& w) const {
    if (w.type != DType::F32)
      throw Error(file_->path() + ": tensor " + w.info->name + " must be f32, found " + dtype_name(w.type));
  }

  Qwen3Weights w_;
};

}  // namespace

std::unique_ptr<Model> make_qwen3_model(std::shared_ptr<gguf::File> file, const LoadOptions& opt) {
  return std::make_unique<Qwen3Model>(std::move(file), opt);
}

}  // namespace fitmoe
