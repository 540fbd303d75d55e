#include "runtime/plan.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <optional>
#include <regex>
#include <sstream>

#include "model/layer_spec.h"
#include "runtime/error.h"

namespace fitmoe {

namespace {

constexpr uint64_t MiB = 1ull << 20;
constexpr uint64_t GiB = 1ull << 30;

std::string gib(double b) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f GiB", b / GiB);
  return buf;
}

// For messages: MiB below a GiB, so that small figures do not read 0.00 GiB.
std::string mem(double b) {
  char buf[32];
  if (b < GiB) std::snprintf(buf, sizeof buf, "%.1f MiB", b / MiB);
  else std::snprintf(buf, sizeof buf, "%.2f GiB", b / GiB);
  return buf;
}

// blk.N.ffn_{gate,up,down,gate_up}_exps.weight -> layer N; else -1.
int expert_layer(const std::string& name) {
  static const std::regex re(R"(^blk\.(\d+)\.ffn_(gate|up|down|gate_up)_exps\.weight$)");
  std::smatch m;
  if (std::regex_match(name, m, re)) return std::stoi(m[1]);
  return -1;
}

int tensor_layer(const std::string& name) {
  static const std::regex re(R"(^blk\.(\d+)\.)");
  std::smatch m;
  if (std::regex_search(name, m, re)) return std::stoi(m[1]);
  return -1;
}


}  // namespace

uint64_t parse_size(const std::string& s) {
  size_t pos = 0;
  double v = 0;
  try {
    v = std::stod(s, &pos);
  } catch (...) {
    throw Error("bad size '" + s + "' (examples: 8G, 7.5GiB, 6144M)");
  }
  std::string unit = s.substr(pos);
  for (auto& c : unit) c = static_cast<char>(std::tolower(c));
  double mult = 1;
  if (unit == "" || unit == "b") mult = 1;
  else if (unit == "k" || unit == "kb" || unit == "kib") mult = 1024.0;
  else if (unit == "m" || unit == "mb" || unit == "mib") mult = static_cast<double>(MiB);
  else if (unit == "g" || unit == "gb" || unit == "gib") mult = static_cast<double>(GiB);
  else if (unit == "t" || unit == "tb" || unit == "tib") mult = static_cast<double>(GiB) * 1024;
  else throw Error("bad size unit in '" + s + "' (use K, M, G)");
  if (!(v > 0) || v * mult > 1e15) throw Error("size out of range: '" + s + "'");
  return static_cast<uint64_t>(v * mult);
}

std::vector<TensorOverride> parse_overrides(const std::vector<std::string>& args) {
  std::vector<TensorOverride> out;
  for (const auto& a : args) {
    // The reference accepts "REGEX=BUF" and comma-separated lists of them.
    std::stringstream ss(a);
    std::string item;
    while (std::getline(ss, item, ',')) {
      size_t eq = item.rfind('=');
      if (eq == std::string::npos || eq == 0) throw Error("bad --override-tensor '" + item + "' (want REGEX=cpu or REGEX=cuda0)");
      std::string dev = item.substr(eq + 1);
      for (auto& c : dev) c = static_cast<char>(std::tolower(c));
      TensorOverride o;
      o.pattern = item.substr(0, eq);
      if (dev == "cpu") o.to_gpu = false;
      else if (dev == "cuda0" || dev == "gpu" || dev == "cuda") o.to_gpu = true;
      else throw Error("bad --override-tensor device '" + dev + "' (cpu or cuda0)");
      try {
        std::regex check(o.pattern);
      } catch (const std::regex_error& e) {
        throw Error("bad --override-tensor regex '" + o.pattern + "': " + e.what());
      }
      out.push_back(o);
    }
  }
  return out;
}

const TensorPlacement* Plan::find(const std::string& name) const {
  for (auto& t : tensors)
    if (t.name == name) return &t;
  return nullptr;
}

double host_experts_share_taken(double share, int k, int n_host, int n_expert) {
  if (share <= 0 || k <= 0 || n_host <= 0 || n_expert <= 0) return 0;
  const double h = static_cast<double>(k) * n_host / n_expert;
  const double take = std::floor(h * static_cast<float>(share) + 0.25);  // the kernel's float share
  return std::min(1.0, take / h);
}

HostExpertsCost prefill_host_experts_cost(const PlanOptions& opt, const MachineProfile& m, int n_tokens, int k,
                                          int n_expert, int n_host, double expert_bytes) {
  HostExpertsCost c;
  c.used_fraction = 1.0 - std::pow(1.0 - static_cast<double>(k) / std::max(1, n_expert), std::max(0, n_tokens));
  c.after_routing = c.used_fraction < opt.prefill_prefetch_min_used;
  c.upload_s = m.pcie_bw > 0 ? n_host * expert_bytes * (c.after_routing ? c.used_fraction : 1.0) / m.pcie_bw : 1e9;
  const double slots = static_cast<double>(n_tokens) * k * n_host / std::max(1, n_expert);
  // ~bytes / 0.6 parameters at about 4.8 bits per weight, two FLOPs each
  c.cpu_s = m.cpu_int8_flops > 0 ? slots * 2.0 * expert_bytes / 0.6 / m.cpu_int8_flops : 1e9;
  c.stream = opt.prefill_host_experts == "upload" || (opt.prefill_host_experts == "auto" && c.upload_s <= c.cpu_s);
  return c;
}

uint64_t gpu_scratch_bytes(const ModelConfig& cfg, int n_ubatch, int n_ctx, uint64_t expert_bytes, int chunk_experts,
                           bool flash_kv) {
  // Mirrors the GPU engine's Workspace (src/cuda/workspace.cpp, whose Workspace::device_bytes a test holds this to): each buffer, rounded up to the
  // accountant's 256-byte alignment, then 5% for what the estimate does not see.
  const uint64_t U = static_cast<uint64_t>(std::max(1, n_ubatch));
  const uint64_t E = static_cast<uint64_t>(std::max(cfg.n_expert, 1)), k = static_cast<uint64_t>(std::max(cfg.n_expert_used, 1));
  const uint64_t n = cfg.n_embd, qw = static_cast<uint64_t>(cfg.n_head) * cfg.head_dim,
                 kw = static_cast<uint64_t>(cfg.n_head_kv) * cfg.head_dim, vw = static_cast<uint64_t>(cfg.n_head_kv) * cfg.head_dim_v,
                 aw = static_cast<uint64_t>(cfg.n_head) * cfg.head_dim_v;
  const uint64_t ff = static_cast<uint64_t>(std::max<int64_t>({cfg.n_ff_exp, cfg.n_ff, 1}));
  const uint64_t slots = cfg.n_expert ? U * k : U;
  uint64_t total = 0;
  auto buf = [&](uint64_t bytes) { total += (bytes + 255) / 256 * 256; };
  for (uint64_t w : {n, n, qw, kw, vw, aw, n, E, n}) buf(U * w * 4);  // x xn q k v att y rlogits xg
  buf(slots * 4);                                                      // router weights
  buf(slots * ff * 4), buf(slots * ff * 4), buf(slots * n * 4);        // g u ey
  buf(std::min<uint64_t>(U, 64) * static_cast<uint64_t>(cfg.n_vocab) * 4);
  for (int i = 0; i < 5; ++i) buf(slots * 4);                          // ids, index tables
  buf(U * 4), buf(U * 4);                                              // positions, tokens
  const uint64_t vec_tokens = std::min<uint64_t>(U, 8);               // gpu::kMaxVecTokens
  buf(std::max<uint64_t>({n, qw, aw, ff}) * (cfg.n_expert ? vec_tokens * k : vec_tokens) * 4);  // matvec activations
  if (n % 256 == 0) buf(n / 256 * 292 * vec_tokens);  // the normed input in Q8_K (residual_norm writes it)
  buf(4);  // router_topk's completion counter
  buf((cfg.n_expert ? vec_tokens * k : vec_tokens) * n * 4);                                   // CPU experts' rows
  buf(64 * MiB);                                                       // dequantized weight tiles
  // Attention: only the split-K decode path (<= 8 queries) keeps per-split partials; with a flash
  // cache, the flash decode kernel's partials (gpu::flash_scratch_bytes: 256 query-splits per head).
  const uint64_t rows = std::min<uint64_t>(U, 8) * cfg.n_head;
  if (flash_kv)
    buf(256ull * cfg.n_head * (static_cast<uint64_t>(cfg.head_dim_v) + 2) * 4);
  else
    buf(rows * static_cast<uint64_t>(std::max(n_ctx, 1)) * 4), buf(rows * 128 * 4), buf(rows * 128 * 8),
        buf(rows * 128 * static_cast<uint64_t>(cfg.head_dim_v) * 4);
  if (cfg.n_expert) {
    buf(static_cast<uint64_t>(kPrefillStageSlots) * std::max(1, chunk_experts) * expert_bytes);  // upload ring
    buf((E + 1) * 4);
  }
  // Recurrent architectures (qwen35, src/cuda/qwen35_gpu.cpp): the DeltaNet's projections and conv
  // output (qkv, co), its gate and output (z, o), beta and alpha, gated attention's [q | gate] rows and
  // gate; the shared expert's gate and up; and rows of the widest of these where the workspace's
  // products take them (its activation buffers, counted here three times).
  if (!cfg.recurrent_layers.empty()) {
    uint64_t ch = 0, vd = 0, hv = 0, qgw = 0;
    for (const LayerSpec& l : layer_specs(cfg, false)) {
      if (l.is_attention()) {
        qgw = std::max<uint64_t>(qgw, static_cast<uint64_t>(l.attn().n_head) * l.attn().head_dim);
      } else {
        ch = std::max<uint64_t>(ch, l.delta().conv_channels());
        vd = std::max<uint64_t>(vd, l.delta().value_dim());
        hv = std::max<uint64_t>(hv, l.delta().n_v_heads);
      }
    }
    for (uint64_t w : {ch, ch, vd, vd, hv, hv, 2 * qgw, qgw}) buf(U * w * 4);
    const uint64_t shff = static_cast<uint64_t>(std::max(cfg.n_ff_shexp, 0));
    if (shff) buf(U * shff * 4), buf(U * shff * 4);
    for (int i = 0; i < 3; ++i) buf(U * std::max({ch, vd, 2 * qgw, shff}) * 4);
  }
  // gemma4 (src/cuda/gemma4_gpu.cpp, Gemma4GpuState): micro-batches of at most kSlidingMicroBatch
  // tokens; q / att and k / v at the widest layer's heads, the second residual, the router's and the
  // experts' inputs, the dense branch's gate and up, and the routed experts' rows.
  if (cfg.arch == "gemma4") {
    const uint64_t G = std::min<uint64_t>(U, kSlidingMicroBatch);
    uint64_t gq = 1, gk = 1;
    for (const LayerSpec& l : layer_specs(cfg, false))
      gq = std::max<uint64_t>(gq, static_cast<uint64_t>(l.attn().n_head) * l.attn().head_dim),
      gk = std::max<uint64_t>(gk, static_cast<uint64_t>(l.attn().n_head_kv) * l.attn().head_dim);
    const uint64_t dff = static_cast<uint64_t>(std::max<int64_t>(cfg.n_ff, 1));
    for (uint64_t w : {gq, gk, gk, gq, n, n, n, dff, dff}) buf(G * w * 4);
    if (cfg.n_expert) {
      const uint64_t eff = static_cast<uint64_t>(std::max<int64_t>(cfg.n_ff_exp, 1));
      buf(vec_tokens * k * eff * 4), buf(vec_tokens * k * eff * 4), buf(G * k * n * 4), buf(G * E * 4),
          buf(G * k * 4), buf(G * k * 4);
    }
  }
  return total * 21 / 20;
}

uint64_t kv_cache_bytes(const ModelConfig& cfg, int64_t n_ctx, const KvCacheType& kv) {
  // The states allocate from the same layer descriptions (src/model/layer_spec.h); the MTP block's KV
  // lives in the drafter's own state.
  return sequence_memory_bytes(cfg, std::max<int64_t>(n_ctx, 0), kv, kStateCheckpoints, /*with_mtp=*/false);
}

namespace {
uint64_t meminfo(const std::string& field) {
  std::ifstream f("/proc/meminfo");
  std::string key;
  uint64_t kb = 0;
  std::string unit;
  while (f >> key >> kb >> unit)
    if (key == field) return kb * 1024;
  return 0;
}
}  // namespace

uint64_t host_memory_available() { return meminfo("MemAvailable:"); }
uint64_t host_memory_total() { return meminfo("MemTotal:"); }

double cpu_matmul_rate(const MachineProfile& m, double tokens) {
  const double* f = m.cpu_matmul_flops;
  if (f[0] <= 0 || f[1] <= 0 || f[2] <= 0) return std::max(1.0, m.cpu_int8_flops);
  // Log-linear between the measured widths 1, 8 and 64 (each step is 3 in log2); flat beyond 64.
  const double lt = std::log2(std::clamp(tokens, 1.0, 64.0));
  const double a = lt <= 3 ? std::log2(f[0]) : std::log2(f[1]), b = lt <= 3 ? std::log2(f[1]) : std::log2(f[2]);
  const double u = (lt <= 3 ? lt : lt - 3) / 3;
  return std::exp2(a + (b - a) * u);
}

void check_host_memory(uint64_t bytes, const std::string& what) {
  const uint64_t avail = host_memory_available();
  if (avail && bytes > avail)
    throw Error("not enough host memory: " + what + " needs " + mem(static_cast<double>(bytes)) + ", the machine has " +
                mem(static_cast<double>(avail)) + " available");
}

namespace {
// The largest context whose fixed GPU part (non-expert weights, KV cache, scratch, reserve) fits the
// budget, whatever context was asked for (the scratch grows with the context too); 0 if none does.
int64_t max_gpu_context(const ModelConfig& cfg, const PlanOptions& opt, uint64_t weights, uint64_t reserve,
                        uint64_t expert_bytes, uint64_t budget) {
  auto fits = [&](int64_t ctx) {
    const uint64_t need = weights + std::max(opt.n_seq, 1) * kv_cache_bytes(cfg, ctx, opt.kv) + reserve +
                          gpu_scratch_bytes(cfg, opt.n_ubatch, static_cast<int>(ctx), expert_bytes, opt.prefill_chunk_experts,
                                            opt.kv.flash_on());
    return need <= budget;
  };
  if (!fits(1)) return 0;
  int64_t lo = 1, hi = 1 << 30;  // fits(lo), and the flags cap a context at 2^30
  if (fits(hi)) return hi;
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    (fits(mid) ? lo : hi) = mid;
  }
  return lo;
}
}  // namespace

// The cost model: fills p.predicted_tg and p.predicted_pp (for a prompt of n_prompt tokens) from the
// placement in p and its machine profile, and notes how prefill treats host experts.
void predict_speed(const gguf::File& file, const ModelConfig& cfg, Plan& p, int n_prompt_tokens) {
  const PlanOptions& opt = p.options;
  const MachineProfile& m = p.machine;
  const int E = cfg.n_expert, k = cfg.n_expert_used;
  const bool tied = cfg.tied_output;
  const double n_prompt = std::max(1, n_prompt_tokens);
  const uint64_t kv_per_token = kv_cache_bytes(cfg, 1, opt.kv) - kv_cache_bytes(cfg, 0, opt.kv);
  // Non-expert bytes per token (the embedding reads one row).
  double non_expert_tok = 0;
  for (auto& t : p.tensors)
    if (!t.is_experts && t.layer < cfg.n_layer_trunk() && !(t.name == "token_embd.weight" && !tied)) non_expert_tok += static_cast<double>(t.bytes);

  // Cost model, mirroring how the GPU engine runs (src/cuda/step_driver.cpp, moe_decode.cpp, moe_prefill.cpp) and calibrated on the H200
  // measurements in docs/performance.md.
  // Decode, per layer one after the other: the GPU's kernels (9 dependent kernels on the H200 with
  // programmatic dependent launch, ~3.92 us each, in a layer whose experts are all on the GPU, where
  // the router's launch does the FFN norm, the experts' kernel routes for itself and weight rows are
  // staged before the waits, Q4_K / Q6_K decoded by position: about 457 tok/s measured 2026-12-02 at
  // b87625c; about 10 of ~4.5 us in a hybrid layer;
  // the weights and KV at device memory speed), then
  // in a hybrid layer the CPU's share of the chosen experts at host RAM speed plus a synchronisation
  // (the GPU's own experts run meanwhile).
  const double L = cfg.n_layer_trunk();
  // Per token: the KV of a typical depth, and a recurrent layer's state read and written once (the
  // live copy: kv_cache_bytes(cfg, 0) holds it and its checkpoints).
  const double kv_read = static_cast<double>(kv_per_token) * std::min(opt.n_ctx, 1024) +
                         2.0 * static_cast<double>(kv_cache_bytes(cfg, 0, opt.kv)) / (1 + kStateCheckpoints);
  if (p.use_gpu) {
    constexpr double kLayerLaunches = 9 * 3.92e-6, kHybridLayerLaunches = 10 * 4.5e-6, kHybridSync = 15e-6;
    int hybrid_layers = 0;
    std::vector<double> host_bytes_of_layer(cfg.n_layer, 0.0), expert_bytes_of_layer(cfg.n_layer, 0.0);
    std::vector<int> host_experts_of_layer(cfg.n_layer, 0);
    for (const auto& t : p.tensors) {
      if (!t.is_experts || t.layer < 0 || t.layer >= cfg.n_layer) continue;
      const int n_host = static_cast<int>(std::count(t.expert_on_gpu.begin(), t.expert_on_gpu.end(), false));
      host_experts_of_layer[t.layer] = n_host;
      host_bytes_of_layer[t.layer] += static_cast<double>(t.bytes) / E * n_host;
      expert_bytes_of_layer[t.layer] += static_cast<double>(t.bytes) / E;
    }
    for (int l = 0; l < cfg.n_layer_trunk(); ++l) hybrid_layers += host_experts_of_layer[l] > 0;
    const double t_gpu = (non_expert_tok + p.gpu_bytes_per_token + kv_read) / m.gpu_mem_bw +
                         (L - hybrid_layers) * kLayerLaunches + hybrid_layers * kHybridLayerLaunches;
    // The host experts' bytes are read by the CPU (host RAM speed) and, for the GPU's share, by the GPU
    // over PCIe; by default the share makes both take the same time.
    // The engine takes the share where a token is expected to give the GPU an expert and the kernels
    // take the expert types (quantized, gate and up of one type).
    const double hb = p.host_expert_bytes_per_token, zc_bw = kZeroCopyEfficiency * m.pcie_bw;
    double share = opt.host_experts_gpu_share;
    if (share < 0) share = zc_bw > 0 && m.host_mem_bw > 0 ? zc_bw / (zc_bw + m.host_mem_bw) : 0;
    share = std::clamp(share, 0.0, 1.0);
    std::vector<DType> gate_type(cfg.n_layer, DType::F32), up_type(cfg.n_layer, DType::F32), down_type(cfg.n_layer, DType::F32);
    for (const auto& t : p.tensors) {
      if (!t.is_experts || t.layer < 0 || t.layer >= cfg.n_layer) continue;
      const gguf::TensorInfo* ti = file.find_tensor(t.name);
      if (!ti) continue;
      const DType ty = ti->type;
      if (t.name.find("ffn_gate_exps") != std::string::npos) gate_type[t.layer] = ty;
      else if (t.name.find("ffn_up_exps") != std::string::npos) up_type[t.layer] = ty;
      else if (t.name.find("ffn_down_exps") != std::string::npos) down_type[t.layer] = ty;
    }
    double gpu_part = 0;  // host-expert bytes per token the GPU reads over the bus
    for (int l = 0; l < cfg.n_layer_trunk(); ++l) {
      if (!host_experts_of_layer[l] || gate_type[l] != up_type[l] || is_float_type(gate_type[l]) ||
          is_float_type(down_type[l]))
        continue;
      gpu_part += k * expert_bytes_of_layer[l] * host_experts_of_layer[l] / E *
                  host_experts_share_taken(share, k, host_experts_of_layer[l], E);
    }
    p.host_experts_gpu_share = gpu_part > 0 ? share : 0;
    // The CPU's part: its bytes at host RAM speed, but no faster than its kernels run on data already
    // in the caches (kCpuDecodeBytesPerThread per thread: 112 GB/s on 15 threads of the H200 host,
    // 2026-12-02, bench/expert_prefetch.cpp). While the GPU runs a hybrid layer's attention block
    // (about its launches' time) the CPU reads the experts the GPU guessed for it, kGuessChosen of them
    // chosen in the end (74-75% on the H200 host): in every hybrid layer whose layer before is hybrid
    // too (the guess comes from there) those bytes then cost only the kernels' time. (The same benchmark: 15.3 MB of experts in 202 us cold, 137 us
    // cached, 186 us with 4 MB of them read ahead: the parts add up.)
    constexpr double kCpuDecodeBytesPerThread = 7.5e9, kGuessChosen = 0.75;
    const double cpu_bytes = hb - gpu_part;
    const double cpu_bw = std::max(1, m.cpu_threads) * kCpuDecodeBytesPerThread;
    int guessed_layers = 0;
    for (int l = 1; l < cfg.n_layer; ++l) guessed_layers += host_experts_of_layer[l] > 0 && host_experts_of_layer[l - 1] > 0;
    const double read_ahead =
        hybrid_layers > 0 ? std::min(cpu_bytes * guessed_layers / hybrid_layers,
                                     guessed_layers * kGuessChosen * kHybridLayerLaunches * m.host_mem_bw)
                          : 0.0;
    const double t_cpu_experts = (cpu_bytes - read_ahead) / std::min(m.host_mem_bw, cpu_bw) + read_ahead / cpu_bw;
    const double t_host = std::max(t_cpu_experts, zc_bw > 0 ? gpu_part / zc_bw : 0.0) + hybrid_layers * kHybridSync;
    if (gpu_part > 0) {
      char buf[340];
      std::snprintf(buf, sizeof buf,
                    "decode: the GPU computes part of each token's chosen host-resident experts (share %.2f: about "
                    "%.0f%% of their bytes), reading their weights over PCIe (~%.0f GB/s), while the CPU computes the "
                    "rest (~%.0f GB/s) (--host-experts-gpu-share overrides)",
                    share, 100 * gpu_part / hb, zc_bw / 1e9, m.host_mem_bw / 1e9);
      p.notes.push_back(buf);
    }
    p.predicted_tg = 1.0 / (t_gpu + t_host);
    // Prefill of one micro-batch of B tokens: the GPU's products, and per layer with host experts the
    // engine's choice between streaming all of them over PCIe (overlapped with the products by the
    // upload ring) and computing the ones used on the CPU (not overlapped).
    // A prompt of n_prompt tokens runs in micro-batches of at most n_ubatch.
    const double B = std::min(n_prompt, static_cast<double>(std::max(1, opt.n_ubatch)));
    const double n_batches = std::ceil(n_prompt / B);
    double params_tok = non_expert_tok / 0.6;  // ~bytes / 0.6 at about 4.8 bits per weight
    for (int l = 0; l < cfg.n_layer_trunk(); ++l) params_tok += expert_bytes_of_layer[l] * k / 0.6;
    const double t_compute = B * 2.0 * params_tok / m.gpu_flops + L * 60e-6;
    double t_stream = 0, t_cpu = 0, streamed_bytes = 0;
    int n_stream = 0, n_cpu = 0;
    for (int l = 0; l < cfg.n_layer_trunk(); ++l) {
      if (!host_experts_of_layer[l]) continue;
      const HostExpertsCost c = prefill_host_experts_cost(opt, m, static_cast<int>(B), k, E, host_experts_of_layer[l],
                                                          expert_bytes_of_layer[l]);
      if (c.stream) {
        // (Copies that wait for the layer's routing are counted as not overlapped.)
        (c.after_routing ? t_cpu : t_stream) += c.upload_s;
        streamed_bytes += host_bytes_of_layer[l] * (c.after_routing ? c.used_fraction : 1.0);  // used ones only when it waits
        ++n_stream;
      } else {
        t_cpu += c.cpu_s;
        ++n_cpu;
      }
    }
    p.predicted_pp = n_prompt / (n_batches * (std::max(t_compute, t_stream) + t_cpu));
    if (n_stream || n_cpu) {
      char buf[400];
      std::snprintf(buf, sizeof buf,
                    "prefill, per %d-token micro-batch: %d layers stream their host experts to the GPU (%s, %.0f ms "
                    "over PCIe, overlapped with about %.0f ms of GPU products), %d layers compute theirs on the CPU "
                    "(%.0f ms); the cost model picks per layer (--prefill-experts overrides)",
                    static_cast<int>(B), n_stream, gib(streamed_bytes).c_str(), t_stream * 1e3, t_compute * 1e3, n_cpu,
                    t_cpu * 1e3);
      p.notes.push_back(buf);
    }
  } else {
    // CPU only, from the CPU kernels' own rates on this machine (probe_machine). Decode: every byte a
    // token reads (non-expert weights, k experts per layer, the KV of a typical depth) at the rate of the
    // one-token kernel over weights in RAM, plus each layer's fixed cost (about ten parallel steps of
    // the thread pool and the small ops between them).
    constexpr double kCpuLayerFixed = 30e-6;
    const double bw = m.cpu_decode_bw > 0 ? m.cpu_decode_bw : 0.9 * m.host_mem_bw;
    p.predicted_tg = 1.0 / ((non_expert_tok + p.host_expert_bytes_per_token + kv_read) / bw + L * kCpuLayerFixed);
    // Prefill of one batch of n_prompt tokens (512 for the plan: what a session evaluates at once): each product at the kernel's
    // rate for the tokens it multiplies (the batch for attention and dense weights, batch * k / E for a
    // routed expert), the output head for the last token only, every weight read from RAM once per
    // batch, and attention's dot products over the causal context (f32, about half the int8 rate).
    const double B = n_prompt;  // (the CPU runs a prompt as one batch)
    const std::string head = tied ? "token_embd.weight" : "output.weight";
    double dense_params = 0, expert_params = 0, head_params = 0, batch_bytes = 0;
    for (const auto& t : p.tensors) {
      const gguf::TensorInfo* ti = file.find_tensor(t.name);
      if (!ti || ti->n_dims < 2 || t.layer >= cfg.n_layer_trunk()) continue;
      const double n = static_cast<double>(ti->n_elements());
      if (t.name == head) {
        head_params = n;
      } else if (t.is_experts) {
        expert_params += n / E;  // one expert's
        batch_bytes += static_cast<double>(t.bytes) * (1 - std::pow(1 - static_cast<double>(k) / E, B));
      } else if (t.name != "token_embd.weight") {
        dense_params += n;
        batch_bytes += static_cast<double>(t.bytes);
      }
    }
    const double per_expert_tokens = E > 0 ? B * k / E : B;
    // Per token: attention's dot products over half the batch on average; a DeltaNet's state update
    // (decay, two products with the state and the rank-one update: about 6 FLOP per state value).
    double attn_flops = 0;
    for (const LayerSpec& l : layer_specs(cfg, false))
      attn_flops += l.is_attention() ? 4.0 * l.attn().n_head * l.attn().head_dim *
                                           (l.attn().window > 0 ? std::min(B / 2, static_cast<double>(l.attn().window)) : B / 2)
                                     : 6.0 * static_cast<double>(l.delta().delta_state_floats());
    const double t_batch = B * (2 * dense_params / cpu_matmul_rate(m, B) +
                                2 * k * expert_params / cpu_matmul_rate(m, per_expert_tokens) +
                                attn_flops / (0.5 * cpu_matmul_rate(m, B))) +
                           2 * head_params / cpu_matmul_rate(m, 1) + batch_bytes / std::max(1.0, m.host_mem_bw);
    p.predicted_pp = B / t_batch;
  }
}


// -ctk / -ctv auto: the first cache type in order of quality loss (f16, q8_0, tq4, tq3, tq2; on
// gemma4 K stays q8_0 below that, its keys being the more sensitive) whose cache takes at most half
// of what the GPU has left beside the non-expert weights, scratch and reserve (so that a useful share
// of the experts fits beside it), or for which every expert fits anyway; if none does, the smallest
// that fits at all. A CPU run keeps f16. The plan says which and why.
Plan plan_kv_type(const gguf::File& file, const ModelConfig& cfg, const PlanOptions& opt_in, const MachineProfile& m) {
  PlanOptions o = opt_in;
  o.kv = KvCacheType{};
  o.kv.flash = opt_in.kv.flash;
  if (!opt_in.use_gpu || m.gpu_free_bytes == 0 || opt_in.kv.flash == FlashAttn::Off) return make_plan(file, cfg, o, m);
  const bool k_q8 = cfg.arch == "gemma4";
  std::vector<KvCacheType> candidates;
  for (DType t : {DType::F16, DType::Q8_0, DType::TQ4, DType::TQ3, DType::TQ2}) {
    KvCacheType c = o.kv;
    c.k = k_q8 && kv_type_is_tq(t) ? DType::Q8_0 : t;
    c.v = t;
    candidates.push_back(c);
  }
  std::optional<Plan> smallest;
  std::string last_error;
  std::vector<std::string> rejected;  // why each better type was not taken
  auto why_not = [&] {
    std::string w;
    for (const std::string& r : rejected) w += (w.empty() ? "" : "; ") + r;
    return w;
  };
  for (const KvCacheType& c : candidates) {
    o.kv = c;
    Plan p;
    try {
      p = make_plan(file, cfg, o, m);
    } catch (const Error& e) {
      last_error = e.what();
      rejected.push_back(c.name() + " does not fit");
      continue;
    }
    if (!p.use_gpu) return p;
    const uint64_t room = p.budget - std::min(p.budget, p.gpu_weights + p.gpu_scratch + p.reserve);
    const bool all_experts = p.host_experts == 0;
    smallest = p;
    if (all_experts || p.gpu_kv <= room / 2) {
      std::string why = all_experts ? "every expert fits beside it"
                                    : "it takes " + gib(p.gpu_kv) + " of the " + gib(room) + " beside the non-expert weights";
      if (!rejected.empty()) why += "; " + why_not();
      p.notes.push_back("KV cache type (automatic): " + c.name() + " for " + std::to_string(o.n_ctx) + " tokens, " +
                        gib(p.gpu_kv) + ": " + why + " (-ctk / -ctv choose one)");
      return p;
    }
    rejected.push_back(c.name() + " would take " + gib(p.gpu_kv) + ", more than half of the " + gib(room) +
                       " beside the non-expert weights");
  }
  if (!smallest) throw Error(last_error);
  smallest->notes.push_back("KV cache type (automatic): " + smallest->options.kv.name() + " for " + std::to_string(o.n_ctx) +
                            " tokens, " + gib(smallest->gpu_kv) + ": the smallest that fits (" + why_not() + ")");
  return *smallest;
}

Plan make_plan(const gguf::File& file, const ModelConfig& cfg, const PlanOptions& opt_in, const MachineProfile& m) {
  if (opt_in.kv.automatic) return plan_kv_type(file, cfg, opt_in, m);
  if (opt_in.n_ubatch <= 0) {
    // Automatic micro-batch on the GPU: 2048 tokens, unless 512 would keep every expert on the GPU and
    // 2048 would not. Larger micro-batches give each expert's grouped product more tokens (fuller
    // tensor-core tiles), and with host experts every micro-batch streams them over PCIe once, so a
    // larger one spreads that over four times the tokens (the reference's best setting too).
    PlanOptions o = opt_in;
    o.n_ubatch = 512;
    Plan small = make_plan(file, cfg, o, m);
    if (!small.use_gpu) return small;
    o.n_ubatch = 2048;
    try {
      Plan big = make_plan(file, cfg, o, m);
      if (big.host_experts > 0 && small.host_experts == 0) return small;
      big.notes.push_back("prefill micro-batch 2048 (automatic): fuller expert products" +
                          std::string(big.host_experts ? ", and each micro-batch streams the host experts over PCIe once" : "") +
                          "; its scratch costs " + gib(static_cast<double>(big.gpu_scratch) - small.gpu_scratch) +
                          " more than a 512-token one (-b sets it)");
      return big;
    } catch (const Error&) {
      return small;
    }
  }
  const PlanOptions& opt = opt_in;
  Plan p;
  p.options = opt;
  p.machine = m;
  p.use_gpu = opt.use_gpu && m.gpu_free_bytes > 0;
  const int E = cfg.n_expert, k = cfg.n_expert_used;

  // KV cache and scratch first: they are needed whatever else fits.
  const uint64_t state_fixed = kv_cache_bytes(cfg, 0, opt.kv);  // recurrent state and its checkpoints
  const uint64_t kv_per_token = kv_cache_bytes(cfg, 1, opt.kv) - state_fixed;
  const uint64_t n_seq = static_cast<uint64_t>(std::max(opt.n_seq, 1));
  p.gpu_kv = n_seq * kv_cache_bytes(cfg, opt.n_ctx, opt.kv);
  p.state_bytes = n_seq * state_fixed;
  uint64_t per_expert = 0;  // one expert's gate + up + down bytes, largest over the layers
  {
    if (E) {
      std::vector<uint64_t> per_layer(cfg.n_layer, 0);
      for (const auto& t : file.tensors()) {
        const int l = expert_layer(t.name);
        if (l >= 0 && l < cfg.n_layer) per_layer[l] += t.nbytes / E;
      }
      for (uint64_t b : per_layer) per_expert = std::max(per_expert, b);
    }
    p.gpu_scratch = gpu_scratch_bytes(cfg, opt.n_ubatch, opt.n_ctx, per_expert, opt.prefill_chunk_experts, opt.kv.flash_on());
  }
  // What the process holds on the GPU beyond the accountant's allocations: the CUDA runtime as measured
  // at start-up (context, loaded kernels, cuBLAS; MachineProfile::gpu_runtime_bytes) plus what comes
  // later (cuBLAS workspaces on first use, instantiated decode graphs, kernels loaded lazily: at most
  // kRuntimeLater on the H200, docs/performance.md), or a fixed estimate where it cannot be measured.
  constexpr uint64_t kRuntimeLater = 160 * MiB;
  p.reserve = m.gpu_runtime_bytes ? m.gpu_runtime_bytes + kRuntimeLater : 640 * MiB;

  // Classify tensors.
  std::vector<size_t> expert_idx;
  uint64_t expert_bytes_total = 0;
  for (const auto& t : file.tensors()) {
    TensorPlacement tp;
    tp.name = t.name;
    tp.bytes = t.nbytes;
    tp.layer = tensor_layer(t.name);
    tp.is_experts = E > 0 && expert_layer(t.name) >= 0 && t.ne[2] == E;
    if (tp.is_experts) {
      expert_idx.push_back(p.tensors.size());
      expert_bytes_total += t.nbytes;
    }
    p.tensors.push_back(tp);
  }
  const bool tied = cfg.tied_output;

  if (!p.use_gpu) {
    for (auto& t : p.tensors) {
      t.on_gpu = false;
      t.reason = "no GPU in use";
      if (t.is_experts) t.expert_on_gpu.assign(E, false);
      (t.is_experts ? p.host_experts : p.host_weights) += t.bytes;
    }
    p.gpu_kv = p.gpu_scratch = p.reserve = 0;
    p.notes.push_back(opt.use_gpu ? "no CUDA GPU found: everything runs on the CPU" : "--gpu none: everything runs on the CPU");
  } else {
    p.budget = opt.vram_budget ? opt.vram_budget : (m.gpu_free_bytes > 1 * GiB ? m.gpu_free_bytes - 512 * MiB : m.gpu_free_bytes);
    if (opt.vram_budget && opt.vram_budget > m.gpu_free_bytes)
      p.notes.push_back("the budget " + gib(opt.vram_budget) + " exceeds the card's free " + gib(m.gpu_free_bytes) +
                        ": the card's free memory caps it");
    if (opt.vram_budget) p.budget = std::min<uint64_t>(opt.vram_budget, m.gpu_free_bytes);
    // The card's free memory was read with the runtime already up: where it sets the budget, the
    // runtime's start-up share is outside it already.
    if (m.gpu_runtime_bytes && (!opt.vram_budget || opt.vram_budget >= m.gpu_free_bytes)) p.reserve = kRuntimeLater;

    // 1. Non-expert tensors on the GPU (token embedding: host, only its rows are read, unless it is also
    //    the output head).
    for (auto& t : p.tensors) {
      if (t.is_experts) continue;
      if (t.name == "token_embd.weight" && !tied) {
        t.on_gpu = false;
        t.reason = "embedding rows are looked up on the host and uploaded per batch";
        p.host_weights += t.bytes;
      } else {
        t.on_gpu = true;
        t.reason = "non-expert weight: read by every token";
        p.gpu_weights += t.bytes;
      }
    }
    // Overrides can move non-expert tensors too.
    for (auto& t : p.tensors) {
      if (t.is_experts) continue;
      for (const auto& o : opt.overrides) {
        if (std::regex_search(t.name, std::regex(o.pattern))) {
          if (t.on_gpu != o.to_gpu) {
            (t.on_gpu ? p.gpu_weights : p.host_weights) -= t.bytes;
            (o.to_gpu ? p.gpu_weights : p.host_weights) += t.bytes;
          }
          t.on_gpu = o.to_gpu;
          t.reason = "--override-tensor " + o.pattern + "=" + (o.to_gpu ? "cuda0" : "cpu");
          break;
        }
      }
    }
    const uint64_t fixed = p.gpu_weights + p.gpu_kv + p.gpu_scratch + p.reserve;
    if (fixed > p.budget) {
      std::ostringstream s;
      s << "VRAM budget " << gib(p.budget) << " is too small: the non-expert weights need " << gib(p.gpu_weights)
        << ", the KV cache of " << opt.n_ctx << " tokens" << (n_seq > 1 ? " x " + std::to_string(n_seq) + " sequences" : "")
        << " " << gib(p.gpu_kv) << ", scratch " << gib(p.gpu_scratch)
        << " and the CUDA reserve " << gib(p.reserve) << " (total " << gib(fixed) << ")";
      // The advice is the same whatever context was asked for: the largest one that fits.
      const int64_t max_ctx = max_gpu_context(cfg, opt, p.gpu_weights, p.reserve, per_expert, p.budget);
      if (max_ctx >= 512) {
        s << "; a context of at most " << max_ctx << " tokens would fit";
      } else {
        const uint64_t min_need = p.gpu_weights + n_seq * kv_cache_bytes(cfg, 512, opt.kv) + p.reserve +
                                  gpu_scratch_bytes(cfg, opt.n_ubatch, 512, per_expert, opt.prefill_chunk_experts, opt.kv.flash_on());
        s << "; at least " << gib(static_cast<double>(min_need)) << " is needed even with a 512-token context";
      }
      throw Error(s.str());
    }
    p.notes.push_back("non-expert weights " + gib(p.gpu_weights) + " and the KV cache (" + std::to_string(opt.n_ctx) +
                      " tokens, " + opt.kv.name() + (n_seq > 1 ? ", " + std::to_string(n_seq) + " sequences" : "") + ") " +
                      gib(p.gpu_kv) + " go to the GPU first");

    // 2. Routed experts: as many as fit, spread evenly over the layers, after the manual rules.
    if (E > 0 && !expert_idx.empty()) {
      const int L = cfg.n_layer;
      // Bytes of one expert across its layer's expert tensors.
      std::vector<uint64_t> expert_bytes(L, 0);
      for (size_t i : expert_idx)
        if (p.tensors[i].layer >= 0 && p.tensors[i].layer < L) expert_bytes[p.tensors[i].layer] += p.tensors[i].bytes / E;
      // Manual rules: forced host / forced GPU per layer.
      std::vector<int> forced(L, 0);  // 0 free, -1 host, +1 gpu
      for (int l = 0; l < L; ++l) {
        if (opt.cpu_moe || l < opt.n_cpu_moe) forced[l] = -1;
        for (size_t i : expert_idx) {
          if (p.tensors[i].layer != l) continue;
          for (const auto& o : opt.overrides)
            if (std::regex_search(p.tensors[i].name, std::regex(o.pattern))) {
              forced[l] = o.to_gpu ? 1 : -1;
              break;
            }
        }
      }
      uint64_t room = p.budget - fixed;
      std::vector<int> on_gpu(L, 0);
      // Forced-GPU layers take all their experts first (if room allows).
      for (int l = 0; l < L; ++l)
        if (forced[l] == 1) {
          uint64_t need = expert_bytes[l] * E;
          if (need > room) throw Error("--override-tensor puts layer " + std::to_string(l) + "'s experts on the GPU, but they do not fit the budget");
          on_gpu[l] = E;
          room -= need;
        }
      // Then round-robin one expert per free layer while room remains: an even spread.
      bool progress = true;
      while (progress) {
        progress = false;
        for (int l = 0; l < L; ++l) {
          if (forced[l] != 0 || on_gpu[l] >= E || expert_bytes[l] > room) continue;
          on_gpu[l]++;
          room -= expert_bytes[l];
          progress = true;
        }
      }
      int n_free = 0, sum_free = 0;
      for (int l = 0; l < L; ++l)
        if (forced[l] == 0) { n_free++; sum_free += on_gpu[l]; }
      p.experts_per_layer_gpu = n_free ? sum_free / n_free : 0;
      for (size_t i : expert_idx) {
        auto& t = p.tensors[i];
        const int l = t.layer;
        t.expert_on_gpu.assign(E, false);
        // Which experts: with uniform routing any; take the first on_gpu[l] (a routing-statistics
        // driven choice replaces this once frequencies are known).
        for (int e = 0; e < on_gpu[l]; ++e) t.expert_on_gpu[e] = true;
        const uint64_t dev = t.bytes / E * on_gpu[l];
        p.gpu_experts += dev;
        p.host_experts += t.bytes - dev;
        t.on_gpu = on_gpu[l] == E;
        t.reason = forced[l] == -1 ? (opt.cpu_moe ? "--cpu-moe" : (l < opt.n_cpu_moe ? "--n-cpu-moe" : "--override-tensor"))
                                   : forced[l] == 1 ? "--override-tensor" : "experts fill the remaining budget";
      }
      int total_gpu = 0;
      for (int l = 0; l < L; ++l) total_gpu += on_gpu[l];
      std::ostringstream s;
      s << "routed experts: " << total_gpu << " of " << L * E << " (" << gib(static_cast<double>(p.gpu_experts))
        << ") fit in the remaining " << gib(static_cast<double>(p.budget - fixed)) << "; "
        << (total_gpu == L * E ? "all on the GPU" : "the rest stay in pinned host memory and run on the CPU during decode");
      p.notes.push_back(s.str());
      if (opt.n_cpu_moe || opt.cpu_moe) p.notes.push_back("manual rule applied on top: " + std::string(opt.cpu_moe ? "--cpu-moe" : "--n-cpu-moe " + std::to_string(opt.n_cpu_moe)));

      // Bytes per decode token.
      for (int l = 0; l < cfg.n_layer_trunk(); ++l) {  // (an MTP block is read only when drafting)
        const double host_frac = static_cast<double>(E - on_gpu[l]) / E;
        p.host_expert_bytes_per_token += k * expert_bytes[l] * host_frac;
        p.gpu_bytes_per_token += k * expert_bytes[l] * (1 - host_frac);
      }
    }
  }
  // Host memory, planned like VRAM: the weights' copy (pinned for a GPU run), the KV cache of a CPU run
  // and the CPU's activations for a 512-token batch, against what the machine has available.
  p.host_weight_copy = p.use_gpu || !opt.use_mmap ? file.data_bytes() : 0;
  p.host_kv = p.use_gpu ? 0 : n_seq * kv_cache_bytes(cfg, opt.n_ctx, opt.kv);
  for (DType t : {DType::F16, DType::Q8_0, DType::Q4_0, DType::TQ4, DType::TQ3, DType::TQ2})
    p.kv_by_type.emplace_back(t, kv_cache_bytes(cfg, opt.n_ctx, KvCacheType{t, t}));
  {
    const uint64_t ff = static_cast<uint64_t>(std::max<int64_t>({cfg.n_ff_exp, cfg.n_ff, 1})) * std::max(1, cfg.n_expert_used);
    p.host_scratch = 512ull * 4 * (8ull * cfg.n_embd + 3 * ff + static_cast<uint64_t>(cfg.n_head) * cfg.head_dim * 3) +
                     4ull * cfg.n_vocab * 64;
  }
  if (m.host_available_bytes && p.host_total() > m.host_available_bytes) {
    std::ostringstream s;
    s << "not enough host memory: this run needs " << mem(static_cast<double>(p.host_total())) << " (";
    if (p.host_weight_copy) s << "weights " << mem(static_cast<double>(p.host_weight_copy)) << (p.use_gpu ? " pinned" : "") << ", ";
    if (p.host_kv) s << "KV cache of " << opt.n_ctx << " tokens " << mem(static_cast<double>(p.host_kv)) << ", ";
    s << "scratch " << mem(static_cast<double>(p.host_scratch)) << "), the machine has "
      << mem(static_cast<double>(m.host_available_bytes)) << " available";
    const uint64_t other = p.host_weight_copy + p.host_scratch;
    if (p.host_kv && other < m.host_available_bytes) {
      const uint64_t max_ctx = m.host_available_bytes - other > state_fixed
                                   ? (m.host_available_bytes - other - state_fixed) / std::max<uint64_t>(kv_per_token, 1)
                                   : 0;
      s << "; a context of at most " << std::min<uint64_t>(max_ctx, 1u << 30) << " tokens would fit";
    }
    if (p.host_weight_copy && !p.use_gpu) s << " (--mmap computes from the file mapping without a copy)";
    throw Error(s.str());
  }
  if (!p.use_gpu && E > 0) {
    for (auto& t : p.tensors)
      if (t.is_experts && t.layer < cfg.n_layer_trunk()) p.host_expert_bytes_per_token += static_cast<double>(t.bytes) / E * k;
  }
  predict_speed(file, cfg, p, p.use_gpu ? opt.n_ubatch : 512);
  return p;
}

std::string Plan::summary_line() const {
  std::ostringstream s;
  if (!use_gpu) {
    s << "plan: CPU only (" << options.n_ctx << "-token context); predicted " << static_cast<int>(predicted_tg) << " tok/s generation";
    return s.str();
  }
  int on = 0, total = 0;
  for (auto& t : tensors)
    if (t.is_experts) {
      total += static_cast<int>(t.expert_on_gpu.size());
      on += static_cast<int>(std::count(t.expert_on_gpu.begin(), t.expert_on_gpu.end(), true));
    }
  s << "plan: " << machine.gpu_name << ", budget " << gib(static_cast<double>(budget)) << ": non-expert weights "
    << gib(static_cast<double>(gpu_weights)) << " + KV " << gib(static_cast<double>(gpu_kv));
  if (total) s << " + experts " << on / 3 << "/" << total / 3 << " on the GPU (" << gib(static_cast<double>(gpu_experts)) << ")";
  s << "; predicted " << static_cast<int>(predicted_pp) << " tok/s prompt, " << static_cast<int>(predicted_tg) << " tok/s generation";
  return s.str();
}

std::string Plan::report() const {
  std::ostringstream s;
  // The sequence state of a model with recurrent layers: the KV of its attention layers and the fixed
  // recurrent state with its checkpoints.
  auto state_note = [&] {
    return state_bytes ? "; of which recurrent state " + mem(static_cast<double>(state_bytes)) + " with " +
                             std::to_string(kStateCheckpoints) + " checkpoints, KV for the attention layers only"
                       : std::string();
  };
  auto seq_note = [&] {
    return options.n_seq > 1 ? " each, " + std::to_string(options.n_seq) + " sequences" : std::string();
  };
  s << "machine: " << (machine.gpu_name.empty() ? "no GPU" : machine.gpu_name) << ", GPU memory "
    << gib(static_cast<double>(machine.gpu_free_bytes)) << " free, GPU " << machine.gpu_mem_bw / 1e9 << " GB/s, PCIe "
    << machine.pcie_bw / 1e9 << " GB/s (pinned), host RAM " << machine.host_mem_bw / 1e9 << " GB/s, "
    << machine.cpu_threads << " CPU threads";
  if (machine.cpu_decode_bw > 0)
    s << " (their kernels: decode " << std::lround(machine.cpu_decode_bw / 1e9) << " GB/s, products of 1 / 8 / 64 tokens "
      << std::lround(machine.cpu_matmul_flops[0] / 1e9) << " / " << std::lround(machine.cpu_matmul_flops[1] / 1e9) << " / "
      << std::lround(machine.cpu_matmul_flops[2] / 1e9) << " GFLOP/s)";
  s << " [" << machine.source << "]\n";
  if (use_gpu) {
    s << "\nGPU memory map (budget " << gib(static_cast<double>(budget)) << "):\n";
    s << "  non-expert weights  " << gib(static_cast<double>(gpu_weights)) << "\n";
    s << "  routed experts      " << gib(static_cast<double>(gpu_experts)) << "\n";
    s << (state_bytes ? "  KV + state          " : "  KV cache            ") << gib(static_cast<double>(gpu_kv)) << "  ("
      << options.n_ctx << " tokens, " << options.kv.name() << seq_note() << state_note() << ")\n";
    s << "  scratch             " << gib(static_cast<double>(gpu_scratch)) << "  (micro-batch " << options.n_ubatch << ")\n";
    s << "  CUDA runtime        " << gib(static_cast<double>(reserve))
      << (machine.gpu_runtime_bytes ? "  (context, kernels, cuBLAS: " + gib(static_cast<double>(machine.gpu_runtime_bytes)) +
                                          " measured at start-up, plus workspaces and graphs)"
                                    : std::string("  (estimated: the driver's per-process figure could not be read)"))
      << "\n";
    s << "  total               " << gib(static_cast<double>(gpu_total())) << "\n";
  }
  s << "\nhost memory map (" << gib(static_cast<double>(machine.host_available_bytes)) << " available):\n";
  s << "  weights' copy       " << gib(static_cast<double>(host_weight_copy))
    << (host_weight_copy == 0 ? "  (--mmap: computed from the file mapping)" : use_gpu ? "  (pinned; the CPU computes its experts from it)" : "")
    << "\n";
  s << "    of which read by the CPU: " << gib(static_cast<double>(host_weights)) << " weights + "
    << gib(static_cast<double>(host_experts)) << " routed experts\n";
  if (!use_gpu)
    s << (state_bytes ? "  KV + state          " : "  KV cache            ") << gib(static_cast<double>(host_kv)) << "  ("
      << options.n_ctx << " tokens, " << options.kv.name() << seq_note() << state_note() << ")\n";
  s << "  scratch             " << gib(static_cast<double>(host_scratch)) << "\n";
  s << "  total               " << gib(static_cast<double>(host_total())) << "\n";
  if (!kv_by_type.empty()) {
    s << "\nKV cache at " << options.n_ctx << " tokens by type (-ctk/-ctv):";
    for (size_t i = 0; i < kv_by_type.size(); ++i)
      s << (i ? ", " : " ") << dtype_name(kv_by_type[i].first) << " " << gib(static_cast<double>(kv_by_type[i].second));
    s << "\n";
  }
  s << "\nplacement by tensor class:\n";
  // Group: per class name (strip blk.N.), count on GPU / host.
  struct Agg { uint64_t gpu = 0, host = 0; int n = 0; std::string reason; };
  std::vector<std::pair<std::string, Agg>> classes;
  for (auto& t : tensors) {
    std::string cls = t.name;
    if (t.layer >= 0) cls = "blk.*." + t.name.substr(t.name.find('.', 4) + 1);
    auto it = std::find_if(classes.begin(), classes.end(), [&](auto& c) { return c.first == cls; });
    if (it == classes.end()) { classes.push_back({cls, {}}); it = classes.end() - 1; }
    it->second.n++;
    if (t.is_experts) {
      const double frac = t.expert_on_gpu.empty() ? 0 : static_cast<double>(std::count(t.expert_on_gpu.begin(), t.expert_on_gpu.end(), true)) / t.expert_on_gpu.size();
      it->second.gpu += static_cast<uint64_t>(t.bytes * frac);
      it->second.host += t.bytes - static_cast<uint64_t>(t.bytes * frac);
    } else {
      (t.on_gpu ? it->second.gpu : it->second.host) += t.bytes;
    }
    it->second.reason = t.reason;
  }
  for (auto& [cls, a] : classes) {
    char line[256];
    std::snprintf(line, sizeof line, "  %-36s x%-3d GPU %10s  host %10s  %s\n", cls.c_str(), a.n,
                  gib(static_cast<double>(a.gpu)).c_str(), gib(static_cast<double>(a.host)).c_str(), a.reason.c_str());
    s << line;
  }
  s << "\nwhy:\n";
  for (auto& n : notes) s << "  - " << n << "\n";
  char pred[320];
  if (host_expert_bytes_per_token > 0)
    std::snprintf(pred, sizeof pred,
                  "\npredicted: prompt %.0f tok/s (micro-batch %d), generation %.1f tok/s\n"
                  "  per generated token: %.3f GB of host-resident experts (bound %.1f tok/s at host RAM speed), "
                  "%.3f GB of experts read on the GPU\n",
                  predicted_pp, options.n_ubatch, predicted_tg, host_expert_bytes_per_token / 1e9,
                  machine.host_mem_bw / host_expert_bytes_per_token, gpu_bytes_per_token / 1e9);
  else
    std::snprintf(pred, sizeof pred,
                  "\npredicted: prompt %.0f tok/s (micro-batch %d), generation %.1f tok/s\n"
                  "  per generated token: %.3f GB of experts, all read on the GPU\n",
                  predicted_pp, options.n_ubatch, predicted_tg, gpu_bytes_per_token / 1e9);
  s << pred;
  return s.str();
}

}  // namespace fitmoe
