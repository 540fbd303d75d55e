#include "model/synthetic.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <map>
#include <numeric>
#include <random>
#include <sstream>
#include <unordered_set>

#include "format/gguf.h"
#include "quant/kernels.h"
#include "runtime/error.h"
#include "runtime/thread_pool.h"

namespace fitmoe {

namespace {

struct Shape {
  int n_layer, n_embd, n_head, n_head_kv, head_dim, n_vocab, n_ctx;
  int n_ff;                      // dense FFN (qwen3) or the unused feed_forward_length (qwen3moe)
  int n_expert, n_expert_used, n_ff_exp;
  float rope_base;
  bool tied;
  // qwen35 / qwen35moe only: every full_attn_every-th layer is gated full attention, the others Gated
  // DeltaNets of ssm_k_heads key and ssm_v_heads value heads of width ssm_head with a conv of width
  // conv; a shared expert of width n_ff_shexp; n_rot rotated dims in IMRoPE sections; n_mtp MTP blocks.
  int full_attn_every = 0, ssm_k_heads = 0, ssm_v_heads = 0, ssm_head = 0, conv = 0, n_ff_shexp = 0, n_rot = 0,
      n_mtp = 0;
  std::array<int, 4> sections{};
  // gemma4 only: every g4_global_every-th layer is global (head_dim, n_head_kv, K = V, rope_freqs),
  // the others sliding (window g4_window, heads of g4_hd_swa, g4_kv_swa KV heads, RoPE base 1e4).
  int g4_global_every = 0, g4_window = 0, g4_hd_swa = 0, g4_kv_swa = 0;
};

// Real shapes from the models' published configs (docs/models in the shared facts).
const std::map<std::string, std::map<std::string, Shape>>& presets() {
  static const std::map<std::string, std::map<std::string, Shape>> p = {
      {"qwen3moe",
       {{"30b-a3b", {48, 2048, 32, 4, 128, 151936, 40960, 6144, 128, 8, 768, 1e6f, false}},
        {"tiny", {2, 256, 8, 2, 32, 1024, 4096, 768, 8, 2, 256, 1e6f, false}},
        // Many small experts: a short micro-batch leaves most of them unused (tests of prefill uploads).
        {"tiny-wide", {2, 256, 8, 2, 32, 1024, 4096, 768, 64, 2, 256, 1e6f, false}}}},
      {"qwen3",
       {{"0.6b", {28, 1024, 16, 8, 128, 151936, 40960, 3072, 0, 0, 0, 1e6f, true}},
        {"tiny", {2, 256, 4, 2, 32, 1024, 4096, 256, 0, 0, 0, 1e6f, false}}}},
      // Qwen3.5/3.6-35B-A3B (docs/models.md): 40 layers, every 4th gated full attention (16/2 heads x 256,
      // a quarter rotated, IMRoPE [11, 11, 10, 0], theta 1e7), DeltaNets of 16 key / 32 value heads x 128
      // with a conv of 4, 256 experts (8 active) of 512 plus a shared one of 512, one MTP block.
      // tiny: the shape of ../shared/testdata qwen35moe-tiny (no MTP), tiny-mtp with one MTP block.
      {"qwen35moe",
       {{"35b-a3b", {40, 2048, 16, 2, 256, 248320, 262144, 0, 256, 8, 512, 1e7f, false, 4, 16, 32, 128, 4, 512, 64, 1, {11, 11, 10, 0}}},
        {"tiny", {2, 256, 4, 1, 64, 1024, 4096, 0, 4, 2, 64, 1e7f, false, 2, 2, 4, 64, 4, 64, 16, 0, {3, 3, 2, 0}}},
        {"tiny-mtp", {2, 256, 4, 1, 64, 1024, 4096, 0, 4, 2, 64, 1e7f, false, 2, 2, 4, 64, 4, 64, 16, 1, {3, 3, 2, 0}}}}},
      // Dense Qwen3.5: the tiny MoE shape with one SwiGLU FFN of 256 instead of the experts.
      {"qwen35", {{"tiny", {2, 256, 4, 1, 64, 1024, 4096, 256, 0, 0, 0, 1e7f, false, 2, 2, 4, 64, 4, 0, 16, 0, {3, 3, 2, 0}}}}},
      // Gemma 4 26B-A4B (docs/models.md): 30 layers, every 6th global (16/2 heads x 512, K = V, a quarter
      // rotated through rope_freqs, theta 1e6), the others sliding (window 1024, 16/8 heads x 256,
      // theta 1e4); 128 experts (8 active) of 704 in parallel with a dense GeGLU of 2112; tied 262,144
      // vocabulary. tiny: the shape of ../shared/testdata gemma4moe-tiny.
      {"gemma4",
       {{"26b-a4b", {30, 2816, 16, 2, 512, 262144, 262144, 2112, 128, 8, 704, 1e6f, true, 0, 0, 0, 0, 0, 0, 512, 0, {}, 6, 1024, 256, 8}},
        {"tiny", {3, 256, 4, 1, 128, 1024, 4096, 96, 8, 2, 32, 1e6f, true, 0, 0, 0, 0, 0, 0, 128, 0, {}, 3, 32, 64, 2}}}},
  };
  return p;
}

// The reference's "more bits" layers for attn_v and ffn_down in the _M mixes.
bool use_more_bits(int i, int n) { return i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2; }

// K-quants need rows that are a multiple of 256; the reference then falls back to a 32-block type.
DType fallback(DType t, int64_t ncols) {
  if (ncols % 256 == 0) return t;
  switch (t) {
    case DType::Q4_K: return DType::Q5_0;
    case DType::Q5_K: return DType::Q5_1;
    case DType::Q6_K: return DType::Q8_0;
    case DType::Q2_K: case DType::Q3_K: case DType::IQ4_XS: return DType::IQ4_NL;
    default: return t;
  }
}

// Const: a 1-D f32 tensor of one value (norms 1; DeltaNet ssm_a, dt bias); F32: a random f32 matrix.
enum class Role { Norm, Router, Embedding, Output, AttnQ, AttnK, AttnV, AttnOut, FfnGate, FfnUp, FfnDown, Const, F32 };

struct FileType {
  const char* name;
  uint32_t llama_ftype;  // general.file_type as the reference numbers it
  DType base;
};
const FileType kFileTypes[] = {
    {"q4_k_m", 15, DType::Q4_K}, {"q6_k", 18, DType::Q6_K}, {"q8_0", 7, DType::Q8_0},
    {"q4_0", 2, DType::Q4_0},    {"f16", 1, DType::F16},    {"bf16", 32, DType::BF16},
    {"f32", 0, DType::F32},
};

// many_experts: the reference's rules for models of 8 or more experts (gemma4's Q4_K_M: attn_k and
// attn_v Q8_0, attn_output Q5_K; testdata README, "Gemma 4 MoE").
DType pick_type(const FileType& ft, Role role, int layer, int n_layer, int64_t ncols, bool tied, bool many_experts = false) {
  if (role == Role::Norm || role == Role::Router || role == Role::Const || role == Role::F32) return DType::F32;
  const std::string name = ft.name;
  DType t = ft.base;
  if (name == "q4_k_m" && many_experts && (role == Role::AttnK || role == Role::AttnV)) {
    t = DType::Q8_0;
  } else if (name == "q4_k_m" && many_experts && role == Role::AttnOut) {
    t = DType::Q5_K;
  } else if (name == "q4_k_m") {
    if (role == Role::Output || (role == Role::Embedding && tied)) t = DType::Q6_K;
    else if ((role == Role::AttnV || role == Role::FfnDown) && use_more_bits(layer, n_layer)) t = DType::Q6_K;
  } else if (name == "q4_0" || name == "q6_k") {
    if (role == Role::Output || (role == Role::Embedding && tied)) t = DType::Q6_K;
  }
  return fallback(t, ncols);
}

struct PlannedTensor {
  std::string name;
  DType type;
  std::vector<int64_t> ne;
  Role role;
  float stddev;
  std::vector<float> row_scale;  // router skew: per-row (expert) multiplier
  float value = 1.0f;            // Norm / Const: every element
};

uint64_t mix(uint64_t a, uint64_t b) {
  uint64_t z = a ^ (b + 0x9E3779B97F4A7C15ull + (a << 6) + (a >> 2));
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}


// ---- synthetic tokenizer ------------------------------------------------------------------------
// A byte-level BPE vocabulary grown by random merges (weighted towards letters so that decoded
// output reads like pseudo-words), with ChatML special tokens. It is a real, self-consistent BPE
// tokenizer (every token but the bytes and specials is produced by exactly one merge), so text
// prompts, chat and other engines' loaders all work on synthetic models.

// GPT-2's byte-to-code-point map: printable bytes map to themselves, the others to 256 + k.
std::string byte_token(int b) {
  int cp;
  if ((b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255)) {
    cp = b;
  } else {
    int k = 0;
    for (int x = 0; x < b; ++x)
      if (!((x >= 33 && x <= 126) || (x >= 161 && x <= 172) || (x >= 174 && x <= 255))) ++k;
    cp = 256 + k;
  }
  std::string out;
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return out;
}

struct SyntheticVocab {
  std::vector<std::string> tokens, merges;
  std::vector<int32_t> types;  // 1 normal, 3 control
  int32_t bos, eos, im_start;
};

SyntheticVocab make_vocab(int n_vocab, uint64_t seed) {
  SyntheticVocab v;
  const char* specials[] = {"<|endoftext|>", "<|im_start|>", "<|im_end|>"};
  const int n_regular = n_vocab - 3;
  for (int b = 0; b < 256; ++b) v.tokens.push_back(byte_token(b));
  std::unordered_set<std::string> seen(v.tokens.begin(), v.tokens.end());
  std::mt19937_64 rng(seed);
  const std::string space = byte_token(' ');
  // Letters and the space marker seed the merges; later merges combine earlier tokens.
  std::vector<int> pool;
  for (char c = 'a'; c <= 'z'; ++c) pool.push_back(static_cast<unsigned char>(c));
  for (int i = 0; i < 8; ++i) pool.push_back(' ');
  while (static_cast<int>(v.tokens.size()) < n_regular) {
    const int a = pool[rng() % pool.size()];
    const int b = static_cast<int>(v.tokens.size()) > 300 && rng() % 2 ? static_cast<int>(256 + rng() % (v.tokens.size() - 256))
                                                                       : pool[rng() % pool.size()];
    if (v.tokens[b] == space) continue;  // spaces lead words, never follow
    std::string t = v.tokens[a] + v.tokens[b];
    if (t.size() > 24 || !seen.insert(t).second) continue;
    v.merges.push_back(v.tokens[a] + " " + v.tokens[b]);
    v.tokens.push_back(t);
    if (t.size() <= 8) pool.push_back(static_cast<int>(v.tokens.size()) - 1);
  }
  v.types.assign(v.tokens.size(), 1);
  for (const char* sp : specials) {
    v.tokens.push_back(sp);
    v.types.push_back(3);
  }
  v.bos = n_regular;
  v.im_start = n_regular + 1;
  v.eos = n_regular + 2;
  return v;
}

const char* kChatMLTemplate =
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

// The tensors of qwen35 / qwen35moe, as the reference's converter writes them: per layer attn_norm and
// post_attention_norm, the mixer (gated attention: attn_q of [q | gate] per head, attn_k, attn_v,
// attn_output, q/k norms; DeltaNet: attn_qkv, attn_gate, ssm_conv1d, ssm_dt.bias, ssm_a, ssm_beta,
// ssm_alpha, ssm_norm, ssm_out), then the FFN; the MTP block after the trunk.
template <typename Add>
void plan_qwen35(const Shape& s, std::vector<PlannedTensor>& plan, Add&& add, std::mt19937_64& rng, float router_skew) {
  const int64_t E = s.n_embd, hd = s.head_dim;
  const float in_sd = 1.0f / std::sqrt(static_cast<float>(E));
  const int64_t key_dim = static_cast<int64_t>(s.ssm_k_heads) * s.ssm_head, value_dim = static_cast<int64_t>(s.ssm_v_heads) * s.ssm_head;
  const int n_blocks = s.n_layer + s.n_mtp;
  // The "more bits" rule for attn_v counts attention layers (the MTP block's included).
  int n_attn = s.n_mtp, i_attn = 0;
  for (int l = 0; l < s.n_layer; ++l) n_attn += (l + 1) % s.full_attn_every == 0;
  auto attention = [&](const std::string& p, int l) {
    add(p + "attn_q.weight", Role::AttnQ, l, {E, 2 * hd * s.n_head}, in_sd);
    add(p + "attn_k.weight", Role::AttnK, l, {E, hd * s.n_head_kv}, in_sd);
    add(p + "attn_v.weight", Role::AttnV, i_attn++, {E, hd * s.n_head_kv}, in_sd, n_attn);
    add(p + "attn_output.weight", Role::AttnOut, l, {hd * s.n_head, E}, 1.0f / std::sqrt(static_cast<float>(hd * s.n_head)));
    add(p + "attn_q_norm.weight", Role::Norm, l, {hd}, 0);
    add(p + "attn_k_norm.weight", Role::Norm, l, {hd}, 0);
  };
  auto ffn = [&](const std::string& p, int l) {
    if (s.n_expert) {
      add(p + "ffn_gate_inp.weight", Role::Router, l, {E, s.n_expert}, in_sd);
      if (router_skew > 0) {
        std::vector<int> rank(static_cast<size_t>(s.n_expert));
        std::iota(rank.begin(), rank.end(), 0);
        std::shuffle(rank.begin(), rank.end(), rng);
        auto& rs = plan.back().row_scale;
        rs.resize(static_cast<size_t>(s.n_expert));
        for (int e = 0; e < s.n_expert; ++e) rs[e] = 3.0f * std::pow(1.0f + rank[e], -router_skew);
      }
      add(p + "ffn_gate_exps.weight", Role::FfnGate, l, {E, s.n_ff_exp, s.n_expert}, in_sd);
      add(p + "ffn_up_exps.weight", Role::FfnUp, l, {E, s.n_ff_exp, s.n_expert}, in_sd);
      add(p + "ffn_down_exps.weight", Role::FfnDown, l, {s.n_ff_exp, E, s.n_expert}, 1.0f / std::sqrt(static_cast<float>(s.n_ff_exp)));
      if (s.n_ff_shexp) {
        add(p + "ffn_gate_inp_shexp.weight", Role::F32, l, {E, 1}, in_sd);
        add(p + "ffn_gate_shexp.weight", Role::FfnGate, l, {E, s.n_ff_shexp}, in_sd);
        add(p + "ffn_up_shexp.weight", Role::FfnUp, l, {E, s.n_ff_shexp}, in_sd);
        add(p + "ffn_down_shexp.weight", Role::FfnDown, l, {s.n_ff_shexp, E}, 1.0f / std::sqrt(static_cast<float>(s.n_ff_shexp)));
      }
    } else {
      add(p + "ffn_gate.weight", Role::FfnGate, l, {E, s.n_ff}, in_sd);
      add(p + "ffn_up.weight", Role::FfnUp, l, {E, s.n_ff}, in_sd);
      add(p + "ffn_down.weight", Role::FfnDown, l, {s.n_ff, E}, 1.0f / std::sqrt(static_cast<float>(s.n_ff)));
    }
  };
  for (int l = 0; l < n_blocks; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    add(p + "attn_norm.weight", Role::Norm, l, {E}, 0);
    add(p + "post_attention_norm.weight", Role::Norm, l, {E}, 0);
    if (l >= s.n_layer) {  // the MTP block: its projection of [embedding | hidden], its norms
      add(p + "nextn.eh_proj.weight", Role::AttnQ, l, {2 * E, E}, 1.0f / std::sqrt(static_cast<float>(2 * E)));
      add(p + "nextn.enorm.weight", Role::Norm, l, {E}, 0);
      add(p + "nextn.hnorm.weight", Role::Norm, l, {E}, 0);
      add(p + "nextn.shared_head_norm.weight", Role::Norm, l, {E}, 0);
      attention(p, l);
    } else if ((l + 1) % s.full_attn_every == 0) {
      attention(p, l);
    } else {
      add(p + "attn_qkv.weight", Role::AttnQ, l, {E, 2 * key_dim + value_dim}, in_sd);
      add(p + "attn_gate.weight", Role::AttnQ, l, {E, value_dim}, in_sd);
      add(p + "ssm_conv1d.weight", Role::F32, l, {s.conv, 2 * key_dim + value_dim}, 0.5f);
      add(p + "ssm_dt.bias", Role::Const, l, {s.ssm_v_heads}, 0);
      plan.back().value = 0.0f;
      add(p + "ssm_a", Role::Const, l, {s.ssm_v_heads}, 0);
      plan.back().value = -1.0f;  // -exp(A_log) with A_log 0: a decay of about exp(-softplus(alpha))
      add(p + "ssm_beta.weight", Role::AttnQ, l, {E, s.ssm_v_heads}, in_sd);
      add(p + "ssm_alpha.weight", Role::AttnQ, l, {E, s.ssm_v_heads}, in_sd);
      add(p + "ssm_norm.weight", Role::Norm, l, {s.ssm_head}, 0);
      add(p + "ssm_out.weight", Role::AttnOut, l, {value_dim, E}, 1.0f / std::sqrt(static_cast<float>(value_dim)));
    }
    ffn(p, l);
  }
}

// The tensors of gemma4 as the reference's converter writes them (testdata README, "Gemma 4 MoE"):
// sliding layers with attn_v, global ones without (K = V); the dense GeGLU branch and, with experts,
// the router, its scale, the fused ffn_gate_up_exps, ffn_down_exps and its per-expert scale, and the
// branch norms; post norms and the layer output scale; rope_freqs once.
template <typename Add>
void plan_gemma4(const Shape& s, std::vector<PlannedTensor>& plan, Add&& add) {
  const int64_t E = s.n_embd;
  const float in_sd = 1.0f / std::sqrt(static_cast<float>(E));
  add("rope_freqs.weight", Role::Const, 0, {s.n_rot / 2}, 0);
  for (int l = 0; l < s.n_layer; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    const bool global = (l + 1) % s.g4_global_every == 0;
    const int64_t hd = global ? s.head_dim : s.g4_hd_swa, kv = global ? s.n_head_kv : s.g4_kv_swa;
    add(p + "attn_norm.weight", Role::Norm, l, {E}, 0);
    add(p + "attn_q.weight", Role::AttnQ, l, {E, hd * s.n_head}, in_sd);
    add(p + "attn_k.weight", Role::AttnK, l, {E, hd * kv}, in_sd);
    if (!global) add(p + "attn_v.weight", Role::AttnV, l, {E, hd * kv}, in_sd);
    add(p + "attn_output.weight", Role::AttnOut, l, {hd * s.n_head, E}, 1.0f / std::sqrt(static_cast<float>(hd * s.n_head)));
    // Q/K norms of head_dim^-0.25 each: attention's scale is 1, so the scores keep a softmax-friendly spread.
    add(p + "attn_q_norm.weight", Role::Norm, l, {hd}, 0);
    plan.back().value = std::pow(static_cast<float>(hd), -0.25f);
    add(p + "attn_k_norm.weight", Role::Norm, l, {hd}, 0);
    plan.back().value = std::pow(static_cast<float>(hd), -0.25f);
    add(p + "post_attention_norm.weight", Role::Norm, l, {E}, 0);
    add(p + "ffn_norm.weight", Role::Norm, l, {E}, 0);
    add(p + "ffn_gate.weight", Role::FfnGate, l, {E, s.n_ff}, in_sd);
    add(p + "ffn_up.weight", Role::FfnUp, l, {E, s.n_ff}, in_sd);
    add(p + "ffn_down.weight", Role::FfnDown, l, {s.n_ff, E}, 1.0f / std::sqrt(static_cast<float>(s.n_ff)));
    if (s.n_expert) {
      add(p + "post_ffw_norm_1.weight", Role::Norm, l, {E}, 0);
      add(p + "pre_ffw_norm_2.weight", Role::Norm, l, {E}, 0);
      add(p + "ffn_gate_inp.weight", Role::Router, l, {E, s.n_expert}, 1.0f);  // on RMSNorm(x) / sqrt(n_embd)
      add(p + "ffn_gate_inp.scale", Role::Norm, l, {E}, 0);
      add(p + "ffn_gate_up_exps.weight", Role::FfnGate, l, {E, 2 * s.n_ff_exp, s.n_expert}, in_sd);
      add(p + "ffn_down_exps.weight", Role::FfnDown, l, {s.n_ff_exp, E, s.n_expert}, 1.0f / std::sqrt(static_cast<float>(s.n_ff_exp)));
      add(p + "ffn_down_exps.scale", Role::Norm, l, {s.n_expert}, 0);
      add(p + "post_ffw_norm_2.weight", Role::Norm, l, {E}, 0);
    }
    add(p + "post_ffw_norm.weight", Role::Norm, l, {E}, 0);
    add(p + "layer_output_scale.weight", Role::Norm, l, {1}, 0);
  }
}

}  // namespace

std::vector<std::string> synthetic_presets(const std::string& arch) {
  std::vector<std::string> out;
  auto it = presets().find(arch);
  if (it != presets().end())
    for (auto& [k, v] : it->second) out.push_back(k);
  return out;
}

SyntheticSummary write_synthetic_model(const SyntheticSpec& spec, const std::string& path, ThreadPool& pool,
                                       const std::function<void(uint64_t, uint64_t)>& progress) {
  auto arch_it = presets().find(spec.arch);
  if (arch_it == presets().end()) throw Error("gen-model: unknown architecture '" + spec.arch + "' (qwen3moe, qwen3, qwen35moe, qwen35, gemma4)");
  auto pre_it = arch_it->second.find(spec.preset);
  if (pre_it == arch_it->second.end()) {
    std::string list;
    for (auto& p : synthetic_presets(spec.arch)) list += (list.empty() ? "" : ", ") + p;
    throw Error("gen-model: unknown preset '" + spec.preset + "' for " + spec.arch + " (" + list + ")");
  }
  const FileType* ft = nullptr;
  for (const auto& f : kFileTypes)
    if (spec.type == f.name) ft = &f;
  if (!ft) throw Error("gen-model: unknown type '" + spec.type + "' (q4_k_m, q6_k, q8_0, q4_0, f16, bf16, f32)");
  Shape s = pre_it->second;
  if (spec.layers < 0 || spec.layers > 1024) throw Error("gen-model: --layers out of range");
  const int full_layers = s.n_layer;
  if (spec.layers > full_layers)
    throw Error("gen-model: --layers " + std::to_string(spec.layers) + " is more than the " + spec.preset + " preset's " +
                std::to_string(full_layers) + " layers");
  if (spec.layers > 0) s.n_layer = spec.layers;
  const bool q35 = spec.arch == "qwen35moe" || spec.arch == "qwen35";
  const bool g4 = spec.arch == "gemma4";
  const bool moe = spec.arch == "qwen3moe" || spec.arch == "qwen35moe" || (g4 && s.n_expert > 0);
  if (spec.router_skew != 0 && !moe) throw Error("gen-model: --router-skew needs an MoE architecture");
  if (spec.router_skew < 0) throw Error("gen-model: --router-skew must be >= 0");

  gguf::Writer w;
  const std::string a = spec.arch + ".";
  w.set_string("general.architecture", spec.arch);
  w.set_string("general.name", "fitmoe-synthetic-" + spec.arch + "-" + spec.preset +
                                   (spec.layers ? "-" + std::to_string(spec.layers) + "l" : "") + "-" + ft->name);
  w.set_u32("general.file_type", ft->llama_ftype);
  w.set_u32("general.quantization_version", 2);
  w.set_bool("fitmoe.synthetic", true);
  w.set_u64("fitmoe.synthetic.seed", spec.seed);
  w.set_f32("fitmoe.synthetic.router_skew", spec.router_skew);
  w.set_u32(a + "block_count", s.n_layer + s.n_mtp);
  w.set_u32(a + "context_length", s.n_ctx);
  w.set_u32(a + "embedding_length", s.n_embd);
  if (s.n_ff) w.set_u32(a + "feed_forward_length", s.n_ff);
  w.set_u32(a + "attention.head_count", s.n_head);
  if (g4) {
    std::vector<int32_t> kv;
    std::vector<bool> swa;
    for (int l = 0; l < s.n_layer; ++l) {
      const bool global = (l + 1) % s.g4_global_every == 0;
      kv.push_back(global ? s.n_head_kv : s.g4_kv_swa);
      swa.push_back(!global);
    }
    w.set_i32_array(a + "attention.head_count_kv", kv);
    w.set_bool_array(a + "attention.sliding_window_pattern", swa);
    w.set_u32(a + "attention.sliding_window", s.g4_window);
    w.set_u32(a + "attention.key_length_swa", s.g4_hd_swa);
    w.set_u32(a + "attention.value_length_swa", s.g4_hd_swa);
    w.set_u32(a + "rope.dimension_count", s.n_rot);
    w.set_u32(a + "rope.dimension_count_swa", s.g4_hd_swa);
    w.set_f32(a + "rope.freq_base_swa", 10000.0f);
    w.set_f32(a + "final_logit_softcapping", 30.0f);
    w.set_u32(a + "attention.shared_kv_layers", 0);
    // The reference's loader requires the per-layer-input width (0: none, as in the 26B-A4B).
    w.set_u32(a + "embedding_length_per_layer_input", 0);
  } else {
    w.set_u32(a + "attention.head_count_kv", s.n_head_kv);
  }
  w.set_u32(a + "attention.key_length", s.head_dim);
  w.set_u32(a + "attention.value_length", s.head_dim);
  w.set_f32(a + "rope.freq_base", s.rope_base);
  w.set_f32(a + "attention.layer_norm_rms_epsilon", 1e-6f);
  {
    SyntheticVocab v = make_vocab(s.n_vocab, spec.seed);
    w.set_string("tokenizer.ggml.model", "gpt2");
    w.set_string("tokenizer.ggml.pre", "qwen2");
    w.set_string_array("tokenizer.ggml.tokens", v.tokens);
    w.set_i32_array("tokenizer.ggml.token_type", v.types);
    w.set_string_array("tokenizer.ggml.merges", v.merges);
    w.set_u32("tokenizer.ggml.bos_token_id", static_cast<uint32_t>(v.bos));
    w.set_u32("tokenizer.ggml.eos_token_id", static_cast<uint32_t>(v.eos));
    w.set_u32("tokenizer.ggml.padding_token_id", static_cast<uint32_t>(v.bos));
    w.set_bool("tokenizer.ggml.add_bos_token", false);
    w.set_string("tokenizer.chat_template", kChatMLTemplate);
  }
  if (q35) {
    // As the reference's converter names them: key heads = group_count, value heads = time_step_rank,
    // key width = state_size, value width = inner_size / value heads.
    w.set_u32(a + "rope.dimension_count", s.n_rot);
    w.set_i32_array(a + "rope.dimension_sections", std::vector<int32_t>(s.sections.begin(), s.sections.end()));
    w.set_u32(a + "ssm.conv_kernel", s.conv);
    w.set_u32(a + "ssm.state_size", s.ssm_head);
    w.set_u32(a + "ssm.group_count", s.ssm_k_heads);
    w.set_u32(a + "ssm.time_step_rank", s.ssm_v_heads);
    w.set_u32(a + "ssm.inner_size", s.ssm_v_heads * s.ssm_head);
    w.set_u32(a + "full_attention_interval", s.full_attn_every);
    if (s.n_ff_shexp) w.set_u32(a + "expert_shared_feed_forward_length", s.n_ff_shexp);
    if (s.n_mtp) w.set_u32(a + "nextn_predict_layers", s.n_mtp);
  }
  if (moe) {
    w.set_u32(a + "expert_count", s.n_expert);
    w.set_u32(a + "expert_used_count", s.n_expert_used);
    w.set_u32(a + "expert_feed_forward_length", s.n_ff_exp);
  }

  // Plan every tensor: name, type by the mix rules, shape, and the spread of its random values.
  std::vector<PlannedTensor> plan;
  // rule_n: the count the "more bits" rule divides by (default the layers; qwen35's attn_v counts the
  // attention layers only, as the reference's quantizer does).
  auto add = [&](const std::string& name, Role role, int layer, std::vector<int64_t> ne, float sd, int rule_n = -1) {
    DType t = pick_type(*ft, role, layer, rule_n >= 0 ? rule_n : s.n_layer + s.n_mtp, ne[0], s.tied, g4 && s.n_expert >= 8);
    if (ne.size() == 1) t = DType::F32;
    plan.push_back({name, t, std::move(ne), role, sd, {}});
  };
  const int64_t E = s.n_embd, hd = s.head_dim;
  const float in_sd = 1.0f / std::sqrt(static_cast<float>(E));
  add("token_embd.weight", Role::Embedding, 0, {E, s.n_vocab}, 1.0f);
  std::mt19937_64 rng(spec.seed);
  std::ostringstream popularity;
  if (q35) {
    plan_qwen35(s, plan, add, rng, spec.router_skew);
  } else if (g4) {
    plan_gemma4(s, plan, add);
  } else for (int l = 0; l < s.n_layer; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    add(p + "attn_norm.weight", Role::Norm, l, {E}, 0);
    add(p + "attn_q.weight", Role::AttnQ, l, {E, hd * s.n_head}, in_sd);
    add(p + "attn_k.weight", Role::AttnK, l, {E, hd * s.n_head_kv}, in_sd);
    add(p + "attn_v.weight", Role::AttnV, l, {E, hd * s.n_head_kv}, in_sd);
    add(p + "attn_output.weight", Role::AttnOut, l, {hd * s.n_head, E}, 1.0f / std::sqrt(static_cast<float>(hd * s.n_head)));
    add(p + "attn_q_norm.weight", Role::Norm, l, {hd}, 0);
    add(p + "attn_k_norm.weight", Role::Norm, l, {hd}, 0);
    add(p + "ffn_norm.weight", Role::Norm, l, {E}, 0);
    if (moe) {
      add(p + "ffn_gate_inp.weight", Role::Router, l, {E, s.n_expert}, in_sd);
      if (spec.router_skew > 0) {
        // Popular experts get larger router rows: their logits spread wider and win the top-k more
        // often. Ranks are a random permutation per layer.
        std::vector<int> rank(static_cast<size_t>(s.n_expert));
        std::iota(rank.begin(), rank.end(), 0);
        std::shuffle(rank.begin(), rank.end(), rng);
        auto& rs = plan.back().row_scale;
        rs.resize(static_cast<size_t>(s.n_expert));
        for (int e = 0; e < s.n_expert; ++e) rs[e] = 3.0f * std::pow(1.0f + rank[e], -spec.router_skew);
      }
      add(p + "ffn_gate_exps.weight", Role::FfnGate, l, {E, s.n_ff_exp, s.n_expert}, in_sd);
      add(p + "ffn_up_exps.weight", Role::FfnUp, l, {E, s.n_ff_exp, s.n_expert}, in_sd);
      add(p + "ffn_down_exps.weight", Role::FfnDown, l, {s.n_ff_exp, E, s.n_expert}, 1.0f / std::sqrt(static_cast<float>(s.n_ff_exp)));
    } else {
      add(p + "ffn_gate.weight", Role::FfnGate, l, {E, s.n_ff}, in_sd);
      add(p + "ffn_up.weight", Role::FfnUp, l, {E, s.n_ff}, in_sd);
      add(p + "ffn_down.weight", Role::FfnDown, l, {s.n_ff, E}, 1.0f / std::sqrt(static_cast<float>(s.n_ff)));
    }
  }
  add("output_norm.weight", Role::Norm, 0, {E}, 0);
  if (!s.tied) add("output.weight", Role::Output, 0, {E, s.n_vocab}, in_sd);
  for (auto& t : plan) w.add_tensor(t.name, t.type, t.ne);

  // Expected routing popularity of the skewed router, by sampling logits ~ N(0, scale_e^2): what share
  // of routing hits the most popular 10% of experts receive (uniform routing gives 10%).
  SyntheticSummary sum;
  if (moe && spec.router_skew > 0) {
    const auto* router = &plan[0];
    for (auto& t : plan)
      if (t.role == Role::Router) { router = &t; break; }
    std::vector<double> hits(static_cast<size_t>(s.n_expert), 0);
    std::normal_distribution<float> nd;
    std::vector<std::pair<float, int>> lg(static_cast<size_t>(s.n_expert));
    for (int it = 0; it < 20000; ++it) {
      for (int e = 0; e < s.n_expert; ++e) lg[e] = {nd(rng) * router->row_scale[e], e};
      std::partial_sort(lg.begin(), lg.begin() + s.n_expert_used, lg.end(), std::greater<>());
      for (int j = 0; j < s.n_expert_used; ++j) hits[lg[j].second] += 1;
    }
    std::sort(hits.begin(), hits.end(), std::greater<>());
    const int top = std::max(1, s.n_expert / 10);
    double share = std::accumulate(hits.begin(), hits.begin() + top, 0.0) / std::accumulate(hits.begin(), hits.end(), 0.0);
    popularity << "router skew " << spec.router_skew << ": the top " << top << " of " << s.n_expert
               << " experts receive about " << static_cast<int>(share * 100 + 0.5) << "% of routing hits\n";
  }

  // Data: rows are generated in groups of 64 with a seed per (tensor, group), so the bytes do not
  // depend on how the writer chunks the file.
  constexpr int64_t kGroup = 64;
  std::vector<uint8_t> tmp;
  auto fill = [&](size_t ti, uint64_t off, uint8_t* buf, size_t len) {
    const PlannedTensor& t = plan[ti];
    const size_t rb = row_bytes(t.type, t.ne[0]);
    if (t.name == "rope_freqs.weight") {
      // Proportional RoPE: the first quarter of the global head's pairs rotate, the rest do not.
      const int64_t n = t.ne[0];
      for (size_t i = 0; i < len; i += 4) {
        const int64_t e = static_cast<int64_t>((off + i) / 4);
        const float val = e < n / 4 ? 1.0f : 1e30f;
        std::memcpy(buf + i, &val, std::min<size_t>(4, len - i));
      }
      return;
    }
    if (t.role == Role::Norm || t.role == Role::Const) {
      // Norm weights are ones (constants their value): the bytes of a 1-D f32 tensor of that value.
      for (size_t i = 0; i < len; i += 4) {
        const float val = t.value;
        std::memcpy(buf + i, &val, std::min<size_t>(4, len - i));
      }
      return;
    }
    const int64_t g0 = static_cast<int64_t>(off / rb) / kGroup;
    const int64_t g1 = static_cast<int64_t>((off + len + rb - 1) / rb + kGroup - 1) / kGroup;
    int64_t n_rows_total = 1;
    for (size_t d = 1; d < t.ne.size(); ++d) n_rows_total *= t.ne[d];
    const size_t span_bytes = static_cast<size_t>((g1 - g0) * kGroup) * rb;
    if (tmp.size() < span_bytes) tmp.resize(span_bytes);
    pool.parallel_for(g1 - g0, 1, [&](int64_t b, int64_t e, int) {
      for (int64_t g = g0 + b; g < g0 + e; ++g) {
        const int64_t r0 = g * kGroup;
        const int64_t nr = std::min(kGroup, n_rows_total - r0);
        if (nr <= 0) continue;
        uint8_t* dst = tmp.data() + static_cast<size_t>(r0 - g0 * kGroup) * rb;
        quant::fill_random_rows(t.type, dst, nr, t.ne[0], t.stddev, mix(mix(spec.seed, ti), g));
        if (!t.row_scale.empty()) {
          // Router rows are f32: scale each expert's row.
          for (int64_t r = 0; r < nr; ++r) {
            float* row = reinterpret_cast<float*>(dst + r * rb);
            const float sc = t.row_scale[(r0 + r) % t.row_scale.size()];
            for (int64_t i = 0; i < t.ne[0]; ++i) row[i] *= sc;
          }
        }
      }
    });
    std::memcpy(buf, tmp.data() + (off - static_cast<uint64_t>(g0 * kGroup) * rb), len);
  };
  w.write(path, fill, progress);

  sum.bytes = w.total_tensor_bytes();
  sum.n_tensors = static_cast<int>(plan.size());
  std::map<std::string, uint64_t> by_type;
  for (size_t i = 0; i < plan.size(); ++i) by_type[dtype_name(plan[i].type)] += w.tensor_bytes(i);
  std::ostringstream d;
  d << spec.arch << " " << spec.preset << " shape, " << s.n_layer << (s.n_layer != full_layers ? " of " + std::to_string(full_layers) : "")
    << " layers, n_embd " << s.n_embd << ", vocab " << s.n_vocab;
  if (moe) d << ", " << s.n_expert << " experts (" << s.n_expert_used << " active) of width " << s.n_ff_exp;
  if (s.n_ff_shexp) d << " + a shared expert of " << s.n_ff_shexp;
  if (g4) {
    int n_global = 0;
    for (int l = 0; l < s.n_layer; ++l) n_global += (l + 1) % s.g4_global_every == 0;
    d << ", dense GeGLU of " << s.n_ff << "\nlayers: " << s.n_layer - n_global << " sliding (window " << s.g4_window
      << ", " << s.n_head << "/" << s.g4_kv_swa << " heads x " << s.g4_hd_swa << ") + " << n_global << " global ("
      << s.n_head << "/" << s.n_head_kv << " x " << s.head_dim << ", K = V)";
  }
  if (q35) {
    int n_full = 0;
    for (int l = 0; l < s.n_layer; ++l) n_full += (l + 1) % s.full_attn_every == 0;
    d << "\nlayers: " << s.n_layer - n_full << " Gated DeltaNet + " << n_full << " gated full attention (one in "
      << s.full_attn_every << ")" << (s.n_mtp ? ", + 1 MTP block" : "");
  }
  d << "\ntype mix " << ft->name << ":";
  for (auto& [name, b] : by_type) d << " " << name << " " << (b >> 20) << " MiB;";
  d << "\n" << popularity.str();
  sum.description = d.str();
  return sum;
}

}  // namespace fitmoe
