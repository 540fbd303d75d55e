// fitmoe bench: prompt processing (ppN) and generation (tgN) speed like llama-bench, with the weight
// bytes each generated token reads and the bandwidth that implies. Its flags (-p, -n, -r, -t lists,
// -o md|json|jsonl|csv) and its JSON/CSV field names follow llama-bench's, so that scripts written for
// llama-bench read fitmoe's results; fitmoe's own figures (bytes per token, the bound) are extra keys.
#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>

#include "cli/common.h"
#include "format/gguf.h"
#include "quant/kernels.h"
#include "runtime/error.h"
#include "runtime/machine.h"
#if FITMOE_CUDA
#include "cuda/process_memory.h"
#endif

namespace fitmoe::cli {

namespace {

using ojson = nlohmann::ordered_json;  // keys in llama-bench's order, fitmoe's after them

// Bounds of the lengths: a context beyond this would be no benchmark anyone runs, and it keeps
// p + 1 and the KV cache's size far from overflow.
constexpr int kMaxTokens = 1 << 20;

struct BenchArgs {
  ModelOptions model;
  std::vector<int> prompt = {512};
  std::vector<int> gen = {128};
  std::vector<int> depth = {0};  // -d: tokens already in the cache when a test starts
  std::vector<int> threads;  // empty: the session's default (all cores; all but one with a GPU)
  std::vector<int> parallel = {1};  // --parallel: sequences decoding together in each tgN (aggregate tok/s)
  int reps = 5;
  int batch = 0;             // -b, copied to the model options when given
  std::string output = "md";
  bool json = false;
  CLI::Option* batch_opt = nullptr;
  CLI::Option* output_opt = nullptr;
};

// One test at one thread count: the nanoseconds of each repetition.
struct Result {
  std::string test;
  int n_prompt = 0, n_gen = 0, n_threads = 0, n_depth = 0;
  int n_parallel = 1;  // sequences decoding together (n_gen counts all of their tokens)
  double kv_bytes_per_token = 0;  // generation at depth: the cache read per token besides the weights
  std::string test_time;
  std::vector<uint64_t> ns;
  double bound = 0;  // generation's physical bound at this thread count (tok/s; 0: unknown)
  double predicted = 0;  // the plan's cost model for this test at this thread count (tok/s)

  int n_tokens() const { return n_prompt + n_gen; }
  std::vector<double> tps() const {
    std::vector<double> v;
    for (uint64_t t : ns) v.push_back(t ? n_tokens() * 1e9 / static_cast<double>(t) : 0.0);
    return v;
  }
};

Result new_result(std::string test, int n_prompt, int n_gen) {
  Result r;
  r.test = std::move(test);
  r.n_prompt = n_prompt;
  r.n_gen = n_gen;
  return r;
}

double mean(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return v.empty() ? 0 : s / static_cast<double>(v.size());
}

// Sample standard deviation (n - 1), as llama-bench reports it; 0 for a single sample.
double stddev(const std::vector<double>& v) {
  if (v.size() < 2) return 0;
  const double m = mean(v);
  double s = 0;
  for (double x : v) s += (x - m) * (x - m);
  return std::sqrt(s / static_cast<double>(v.size() - 1));
}

std::vector<int32_t> random_tokens(int n, int n_vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int32_t> d(0, n_vocab - 1);
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (auto& x : t) x = d(rng);
  return t;
}

uint64_t now_ns() {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count());
}

std::string utc_now_iso8601() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

std::string upper(std::string s) {
  for (char& c : s) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return s;
}

// general.file_type as the reference numbers and names it (its llama_ftype), so that the model column
// reads as llama-bench's does. Empty for a number it does not know.
std::string llama_ftype_name(uint64_t ft) {
  static const std::map<uint64_t, const char*> names = {
      {0, "all F32"},          {1, "F16"},
      {2, "Q4_0"},             {3, "Q4_1"},
      {7, "Q8_0"},             {8, "Q5_0"},
      {9, "Q5_1"},             {10, "Q2_K - Medium"},
      {11, "Q3_K - Small"},    {12, "Q3_K - Medium"},
      {13, "Q3_K - Large"},    {14, "Q4_K - Small"},
      {15, "Q4_K - Medium"},   {16, "Q5_K - Small"},
      {17, "Q5_K - Medium"},   {18, "Q6_K"},
      {19, "IQ2_XXS - 2.0625 bpw"}, {20, "IQ2_XS - 2.3125 bpw"},
      {21, "Q2_K - Small"},    {22, "IQ3_XS - 3.3 bpw"},
      {23, "IQ3_XXS - 3.0625 bpw"}, {24, "IQ1_S - 1.5625 bpw"},
      {25, "IQ4_NL - 4.5 bpw"}, {26, "IQ3_S - 3.4375 bpw"},
      {27, "IQ3_S mix - 3.66 bpw"}, {28, "IQ2_S - 2.5 bpw"},
      {29, "IQ2_M - 2.7 bpw"}, {30, "IQ4_XS - 4.25 bpw"},
      {31, "IQ1_M - 1.75 bpw"}, {32, "BF16"},
      {36, "TQ1_0 - 1.69 bpw ternary"}, {37, "TQ2_0 - 2.06 bpw ternary"},
      {38, "MXFP4 MoE"},
  };
  constexpr uint64_t kGuessed = 1024;  // the reference's flag: the quantizer guessed the type
  auto it = names.find(ft & ~kGuessed);
  if (it == names.end()) return {};
  return std::string(it->second) + (ft & kGuessed ? " (guessed)" : "");
}

// The type that holds most of the tensor bytes, for files without general.file_type (many converters
// and quantizers leave it out); says so, since a mix such as Q4_K_M cannot be told apart from it.
std::string dominant_type(const gguf::File& f) {
  std::map<DType, uint64_t> bytes;
  for (const auto& t : f.tensors()) bytes[t.type] += t.nbytes;
  if (bytes.empty()) return "no tensors";
  auto best = std::max_element(bytes.begin(), bytes.end(), [](auto& a, auto& b) { return a.second < b.second; });
  return upper(dtype_name(best->first)) + " (most bytes)";
}

std::string quant_type(const gguf::File& f) {
  const gguf::Value* v = f.find("general.file_type");
  if (v && v->is_integer() && v->i >= 0) {
    std::string name = llama_ftype_name(static_cast<uint64_t>(v->i));
    if (!name.empty()) return name;
  }
  return dominant_type(f);
}

// "30B", "3.3B", "2.5M": two significant figures at most, rounded down so that a 30.5B model reads as
// the 30B its makers call it.
std::string count_label(double n) {
  const char* unit = "K";
  double v = n / 1e3;
  if (n >= 1e9) unit = "B", v = n / 1e9;
  else if (n >= 1e6) unit = "M", v = n / 1e6;
  char buf[32];
  if (v >= 10) std::snprintf(buf, sizeof buf, "%.0f%s", std::floor(v), unit);
  else {
    const double d = std::floor(v * 10) / 10;
    std::snprintf(buf, sizeof buf, d == std::floor(d) ? "%.0f%s" : "%.1f%s", d, unit);
  }
  return buf;
}

// The model's size class: general.size_label where the file has one ("30B-A3B" is written "30B.A3B" as
// llama-bench does), else counted: total and, for a MoE, active parameters per token.
std::string size_label(const gguf::File& f, const ModelConfig& cfg) {
  if (const gguf::Value* v = f.find("general.size_label"); v && v->type == gguf::ValueType::STRING && !v->str.empty()) {
    std::string s(v->str);
    std::replace(s.begin(), s.end(), '-', '.');
    return s;
  }
  double total = 0, experts = 0;
  for (const auto& t : f.tensors()) {
    total += static_cast<double>(t.n_elements());
    if (t.name.find("_exps") != std::string::npos) experts += static_cast<double>(t.n_elements());
  }
  if (cfg.n_expert <= 0 || experts <= 0) return count_label(total);
  const double active = total - experts + experts * cfg.n_expert_used / cfg.n_expert;
  return count_label(total) + ".A" + count_label(active);
}

std::string cpu_info() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("model name", 0) == 0 && line.find(':') != std::string::npos) {
      auto s = line.substr(line.find(':') + 1);
      s.erase(0, s.find_first_not_of(" \t"));
      return s;
    }
  return "unknown";
}

// A CSV field as llama-bench writes every one: in double quotes, inner quotes doubled, booleans as 0 / 1.
std::string csv_field(const ojson& v) {
  std::string s = v.is_string() ? v.get<std::string>() : v.is_boolean() ? (v.get<bool>() ? "1" : "0") : v.dump();
  std::string out = "\"";
  for (char c : s) out += c == '"' ? std::string("\"\"") : std::string(1, c);
  return out + "\"";
}

// The CSV columns of one result: every scalar field; an object's fields as parent_child; arrays (the
// samples) left out, as llama-bench leaves them out of its CSV.
void flatten(const ojson& obj, const std::string& prefix, std::vector<std::pair<std::string, ojson>>& out) {
  for (auto it = obj.begin(); it != obj.end(); ++it) {
    if (it.value().is_array()) continue;
    if (it.value().is_object()) flatten(it.value(), prefix + it.key() + "_", out);
    else out.emplace_back(prefix + it.key(), it.value());
  }
}

// The checks of the flags that CLI11 cannot phrase well for lists; run before the model loads, so a
// typo costs nothing. A usage error (exit code 2) whose message names the flag and the value.
void check_args(const BenchArgs& a) {
  auto fail = [](const std::string& msg) { throw CLI::ValidationError("bench: " + msg); };
  if (a.reps < 1) fail("-r must be at least 1 (got " + std::to_string(a.reps) + ")");
  auto lengths = [&](const char* flag, const std::vector<int>& v) {
    for (int x : v) {
      if (x < 0) fail(std::string(flag) + " values must be at least 0 (got " + std::to_string(x) + "; 0 skips the test)");
      if (x > kMaxTokens)
        fail(std::string(flag) + " values must be at most " + std::to_string(kMaxTokens) + " (got " + std::to_string(x) + ")");
    }
  };
  lengths("-p", a.prompt);
  lengths("-n", a.gen);
  lengths("-d", a.depth);
  for (int t : a.threads)
    if (t < 1) fail("-t values must be at least 1 (got " + std::to_string(t) + ")");
  for (int p : a.parallel)
    if (p < 1 || p > 256) fail("--parallel values must be from 1 to 256 (got " + std::to_string(p) + ")");
  if (a.batch_opt && a.batch_opt->count() && a.batch < 1) fail("-b must be at least 1 (got " + std::to_string(a.batch) + ")");
  static const std::vector<std::string> formats = {"md", "json", "jsonl", "csv"};
  if (std::find(formats.begin(), formats.end(), a.output) == formats.end())
    fail("-o must be md, json, jsonl or csv (got '" + a.output + "')");
  if (a.json && a.output_opt && a.output_opt->count() && a.output != "json")
    fail("--json is -o json, which contradicts -o " + a.output);
  const bool any = std::any_of(a.prompt.begin(), a.prompt.end(), [](int x) { return x > 0; }) ||
                   std::any_of(a.gen.begin(), a.gen.end(), [](int x) { return x > 0; });
  if (!any) fail("nothing to measure: every -p and -n value is 0");
}

}  // namespace

void register_bench(CLI::App& app) {
  auto* cmd = app.add_subcommand("bench", "measure prompt (ppN) and generation (tgN) speed, llama-bench style");
  auto a = std::make_shared<BenchArgs>();
  add_model_options(*cmd, a->model, /*with_ctx=*/false);
  // Bench takes a list of thread counts (one result row each, as llama-bench), not the single count
  // the other commands share.
  if (CLI::Option* t = cmd->get_option_no_throw("--threads")) cmd->remove_option(t);
  cmd->add_option("-t,--threads", a->threads,
                  "CPU thread counts to test, e.g. 1,2,4: one row per count (default: all cores; all but one with a GPU)")
      ->delimiter(',');
  cmd->add_option("-p,--n-prompt", a->prompt, "prompt lengths to test: ppN times one batch of N tokens (0: none)")
      ->delimiter(',');
  cmd->add_option("-n,--n-gen", a->gen,
                  "generation lengths to test: tgN times N decode steps of one token each, so N generated tokens (0: none)")
      ->delimiter(',');
  cmd->add_option("-d,--n-depth", a->depth,
                  "cache depths to test, e.g. 0,32768: each test starts with that many tokens already in the KV cache "
                  "(filled before the timer starts, as llama-bench's -d)")
      ->delimiter(',');
  cmd->add_option("-r,--repetitions", a->reps, "repetitions per test (after one warm-up run)");
  cmd->add_option("--parallel", a->parallel,
                  "sequences decoding together, e.g. 1,4,16: each tgN runs N steps of one batch holding one token of every "
                  "sequence (what serve --parallel does), reported as aggregate tok/s")
      ->delimiter(',');
  a->batch_opt = cmd->add_option("-b,--batch", a->batch,
                                 "GPU micro-batch (prompt tokens per forward pass; default: automatic)");
  a->output_opt = cmd->add_option("-o,--output", a->output, "output format: md (default), json, jsonl or csv");
  cmd->add_flag("--json", a->json, "the same as -o json");
  cmd->callback([a] {
    check_args(*a);
    if (a->batch_opt->count()) a->model.batch = a->batch;
    const std::string format = a->json ? "json" : a->output;
    int max_ctx = 16, max_depth = 0;
    for (int d : a->depth) max_depth = std::max(max_depth, d);
    for (int p : a->prompt) max_ctx = std::max(max_ctx, max_depth + p + 1);
    for (int g : a->gen) max_ctx = std::max(max_ctx, max_depth + g + 1);
    // The plan's context is what the deepest test holds (its KV cache, and the automatic cache type),
    // for as many sequences as the widest --parallel test.
    a->model.ctx = max_ctx;
    a->model.n_seq = *std::max_element(a->parallel.begin(), a->parallel.end());
    auto model = load_model(a->model);
    const auto& cfg = model->config();
    const std::vector<int> thread_counts = a->threads.empty() ? std::vector<int>{0} : a->threads;
    const double bpt = model->bytes_per_token();
    const Plan& plan = model->plan();

    // The physical bound of generation: bytes read per token over the bandwidth of where they live
    // (as measured by the machine probe, or given to it).
    // At depth, each generated token also reads the cache of every attention layer (kv_bytes).
    auto tg_bound = [&](int n_threads, double kv_bytes) {
      if (model->on_gpu()) {
        const double gpu_bytes = bpt - plan.host_expert_bytes_per_token + kv_bytes;
        const double t = plan.host_expert_bytes_per_token / std::max(1.0, plan.machine.host_mem_bw) +
                         gpu_bytes / std::max(1.0, plan.machine.gpu_mem_bw);
        return t > 0 ? 1.0 / t : 0.0;
      }
      if (bpt <= 0) return 0.0;
      // A CPU-only load does not probe the machine; bench does (once per thread count, then cached),
      // with the threads it measures, since the bandwidth a CPU reaches grows with them.
      const double host_bw = probe_machine(n_threads, false).host_mem_bw;
      return host_bw > 0 ? host_bw / (bpt + kv_bytes) : 0.0;
    };

    std::vector<Result> results;
    int n_batch = 0;
    for (int nt : thread_counts) {
      SessionOptions so = session_options(a->model);
      so.n_threads = nt;
      so.n_ctx = max_ctx;
      so.n_batch = max_ctx;  // each ppN is one batch (the GPU splits it into micro-batches of -b)
      const KvCacheType kv = so.kv;
      n_batch = so.n_batch;
      // One session at a time: each has its own thread pool and KV cache, and on a GPU the plan
      // budgeted memory for one cache.
      Session s(*model, so);
      const int threads = s.pool().size();
      const std::string tag = thread_counts.size() > 1 ? " (" + std::to_string(threads) + " threads)" : "";
      // The cache filled to `depth` before a repetition: once per test where the state can be cut
      // back to it (a plain KV cache), else (recurrent layers, wrapped rings) filled again each time.
      int filled = -1;
      const std::vector<int32_t> context = random_tokens(std::max(1, max_depth), cfg.n_vocab, 99);
      auto at_depth = [&](int depth) {
        if (depth == 0) {
          s.state().reset();
          return;
        }
        if (filled == depth && !s.state().recurrent() && s.n_past() >= depth) {
          s.state().truncate(depth);
          return;
        }
        s.state().reset();
        s.eval(std::span<const int32_t>(context.data(), depth), 1);
        filled = depth;
      };
      // The plan's prediction for a test: on the CPU with the profile of the threads this row runs.
      auto predict = [&](const Result& r) {
        Plan q = plan;
        if (!model->on_gpu()) q.machine = probe_machine(threads, false);
        predict_speed(model->file(), cfg, q, std::max(1, r.n_prompt));
        return r.n_gen ? q.predicted_tg : q.predicted_pp;
      };
      auto measure = [&](Result r, int depth, const std::vector<int32_t>& toks, auto&& run,
                         const std::function<void()>& prepare = nullptr) {
        r.n_threads = threads;
        r.n_depth = depth;
        if (depth > 0) r.test += " @ d" + std::to_string(depth);
        r.kv_bytes_per_token = r.n_gen ? static_cast<double>(kv_cache_bytes(cfg, depth, kv) - kv_cache_bytes(cfg, 0, kv)) : 0.0;
        r.bound = r.n_parallel > 1 ? 0.0 : tg_bound(threads, r.kv_bytes_per_token);
        r.predicted = r.n_parallel > 1 ? 0.0 : predict(r);
        r.test_time = utc_now_iso8601();
        for (int rep = -1; rep < a->reps; ++rep) {  // rep -1 is the warm-up
          if (prepare) prepare();
          else at_depth(depth);
          const uint64_t t0 = now_ns();
          const int n = run(rep < 0, toks);
          const uint64_t dt = std::max<uint64_t>(1, now_ns() - t0);
          if (rep >= 0) r.ns.push_back(dt);
          std::fprintf(stderr, "\r%s%s: run %d/%d  %.2f tok/s   ", r.test.c_str(), tag.c_str(), rep + 1, a->reps,
                       n * 1e9 / static_cast<double>(dt));
        }
        std::fprintf(stderr, "\n");
        results.push_back(std::move(r));
      };
      for (int depth : a->depth) {
        for (int p : a->prompt) {
          if (p <= 0) continue;
          measure(new_result("pp" + std::to_string(p), p, 0), depth, random_tokens(p, cfg.n_vocab, 42),
                  [&](bool, const std::vector<int32_t>& toks) {
                    s.eval(toks, 1);
                    return p;
                  });
        }
        for (int g : a->gen) {
          if (g <= 0) continue;
          for (int P : a->parallel) {
            if (P <= 1) continue;
            // P sequences sharing the pool; each step one batch of one token of every sequence. Each
            // starts at `depth` (filled before the timer) and reads its own stretch of the tokens.
            std::vector<std::unique_ptr<Session>> extra;
            for (int i = 1; i < P; ++i) extra.push_back(std::make_unique<Session>(*model, so, &s.pool()));
            std::vector<Session*> seqs = {&s};
            for (auto& e : extra) seqs.push_back(e.get());
            Result r = new_result("tg" + std::to_string(g) + " x" + std::to_string(P), 0, g * P);
            r.n_parallel = P;
            const std::vector<int32_t> toks = random_tokens(g + P, cfg.n_vocab, 7);
            measure(std::move(r), depth, toks,
                    [&, P, g](bool warmup, const std::vector<int32_t>& t) {
                      const int n = warmup ? std::min(g, 4) : g;
                      std::vector<Session::Part> parts(static_cast<size_t>(P));
                      std::vector<float> logits(static_cast<size_t>(P) * cfg.n_vocab);
                      for (int i = 0; i < n; ++i) {
                        for (int j = 0; j < P; ++j) parts[j] = {seqs[j], std::span<const int32_t>(&t[i + j], 1), 1};
                        Session::eval_batch(s.pool(), parts, logits.data());
                      }
                      return n * P;
                    },
                    [&] {
                      for (Session* q : seqs) {
                        q->truncate(0);
                        if (depth > 0) q->eval(std::span<const int32_t>(context.data(), depth), 1);
                      }
                    });
          }
          if (std::find(a->parallel.begin(), a->parallel.end(), 1) == a->parallel.end()) continue;
          // tgN: N decode steps of one token each, so N generated tokens (the warm-up runs a few).
          measure(new_result("tg" + std::to_string(g), 0, g), depth, random_tokens(g, cfg.n_vocab, 7),
                  [&](bool warmup, const std::vector<int32_t>& toks) {
                    const int n = warmup ? std::min(g, 4) : g;
                    for (int i = 0; i < n; ++i) s.eval(std::span<const int32_t>(&toks[i], 1), 1);
                    return n;
                  });
        }
      }
    }

    uint64_t size = 0, params = 0;
    for (auto& t : model->file().tensors()) {
      size += t.nbytes;
      params += static_cast<uint64_t>(t.n_elements());
    }
    const std::string backend = model->on_gpu()
        ? "CUDA " + plan.machine.gpu_name + (plan.host_experts ? " + CPU experts" : "")
        : std::string("CPU (") + quant::isa_name(quant::best_isa()) + ")";
    const std::string name = cfg.name.empty() ? cfg.arch : cfg.name;
    const std::string qtype = quant_type(model->file());
    const std::string model_type = cfg.arch + " " + size_label(model->file(), cfg) + " " + qtype;
    // Hybrid decode guesses each layer's routing to prefetch host experts while it waits for the GPU.
    const RoutingGuessStats gs = model->routing_guess_stats();
    const double guess_rate = gs.guessed ? static_cast<double>(gs.chosen) / gs.guessed : 0.0;
    const double prefetch_per_layer = gs.layer_steps ? gs.prefetched_bytes / gs.layer_steps : 0.0;
    if (gs.guessed)
      std::fprintf(stderr,
                   "routing guesses: %.2f host experts guessed per hybrid layer step, %.0f%% of them chosen; "
                   "%s prefetched per step while waiting for the GPU\n",
                   static_cast<double>(gs.guessed) / gs.layer_steps, 100.0 * guess_rate,
                   human_bytes(prefetch_per_layer).c_str());

    // A --vram budget is for the whole process: what the driver counts for it after every test ran
    // (weights, KV, scratch, graphs, the runtime), next to the budget.
    int64_t process_gpu = -1;
#if FITMOE_CUDA
    if (model->on_gpu()) process_gpu = gpu::process_device_bytes();
    if (process_gpu > 0)
      std::fprintf(stderr, "GPU memory of this process as the driver counts it: %lld MiB (budget %llu MiB)\n",
                   static_cast<long long>(process_gpu >> 20), static_cast<unsigned long long>(plan.budget >> 20));
#endif
    if (format != "md") {
      std::string overrides;
      for (auto& o : a->model.overrides) overrides += (overrides.empty() ? "" : ";") + o;
      const std::string cpu = cpu_info();
      // What the build knows of its source: CMake may define FITMOE_BUILD_COMMIT; there is no build counter.
#ifdef FITMOE_BUILD_COMMIT
      const std::string commit = FITMOE_BUILD_COMMIT;
#else
      const std::string commit = "unknown";
#endif
      std::vector<ojson> rows;
      for (auto& r : results) {
        const std::vector<double> ns(r.ns.begin(), r.ns.end());
        const std::vector<double> ts = r.tps();
        const double avg_ts = mean(ts);
        ojson o;
        // llama-bench's fields, in its order.
        o["build_commit"] = commit;
        o["build_number"] = 0;
        o["cpu_info"] = cpu;
        o["gpu_info"] = model->on_gpu() ? plan.machine.gpu_name : "";
        o["backends"] = model->on_gpu() ? "CUDA" : "CPU";
        o["model_filename"] = a->model.model_path;
        o["model_type"] = model_type;
        o["model_size"] = size;
        o["model_n_params"] = params;
        o["n_batch"] = n_batch;
        o["n_ubatch"] = model->on_gpu() ? plan.options.n_ubatch : n_batch;  // the CPU runs a ppN as one pass
        o["n_threads"] = r.n_threads;
        const KvCacheType kv = plan.options.kv;  // (the plan resolves -ctk / -ctv auto)
        o["type_k"] = dtype_name(kv.k);
        o["type_v"] = dtype_name(kv.v);
        o["flash_attn"] = kv.flash_on();
        // Every layer (and the output head) runs on the GPU when there is one; the plan decides
        // where the experts live, which n_cpu_moe and the plan line say.
        o["n_gpu_layers"] = model->on_gpu() ? cfg.n_layer + 1 : 0;
        o["n_cpu_moe"] = a->model.cpu_moe ? cfg.n_layer : a->model.n_cpu_moe;
        o["devices"] = model->on_gpu() ? "CUDA0" : "none";
        o["tensor_buft_overrides"] = overrides.empty() ? "none" : overrides;
        o["use_mmap"] = a->model.mmap;
        o["n_prompt"] = r.n_prompt;
        o["n_gen"] = r.n_gen;
        o["n_parallel"] = r.n_parallel;
        o["n_depth"] = r.n_depth;
        o["kv_bytes_per_token"] = r.kv_bytes_per_token;
        o["test_time"] = r.test_time;
        o["avg_ns"] = static_cast<uint64_t>(std::llround(mean(ns)));
        o["stddev_ns"] = static_cast<uint64_t>(std::llround(stddev(ns)));
        o["avg_ts"] = avg_ts;
        o["stddev_ts"] = stddev(ts);
        o["samples_ns"] = r.ns;
        o["samples_ts"] = ts;
        // fitmoe's own (the first six are the names its earlier output had, which scripts read).
        o["model"] = name;
        o["arch"] = cfg.arch;
        o["quant_type"] = qtype;
        o["size"] = size;
        o["params"] = params;
        o["backend"] = backend;
        o["test"] = r.test;
        o["weight_bytes_per_token"] = r.n_gen ? bpt : 0.0;
        o["weight_gbps"] = r.n_gen ? bpt * avg_ts / 1e9 : 0.0;
        o["host_expert_bytes_per_token"] = plan.host_expert_bytes_per_token;
        o["tg_bound"] = r.bound;
        o["plan"] = plan.summary_line();
        o["routing_guesses_chosen"] = guess_rate;
        o["prefetched_bytes_per_layer_step"] = prefetch_per_layer;
        // The plan's prediction for this kind of test (prompt: at the plan's batch), to hold it to the measurement.
        o["predicted_ts"] = r.predicted;
        o["machine"] = {{"host_mem_bw", plan.machine.host_mem_bw}, {"pcie_bw", plan.machine.pcie_bw},
                        {"gpu_mem_bw", plan.machine.gpu_mem_bw}, {"cpu_int8_flops", plan.machine.cpu_int8_flops},
                        {"cpu_decode_bw", plan.machine.cpu_decode_bw}, {"source", plan.machine.source}};
        if (process_gpu > 0) o["gpu_process_mib"] = process_gpu >> 20;  // the driver's count, after all tests
        if (model->on_gpu()) o["gpu_budget_mib"] = plan.budget >> 20;
        rows.push_back(std::move(o));
      }
      if (format == "json") {
        std::printf("%s\n", ojson(rows).dump(2).c_str());
      } else if (format == "jsonl") {
        for (auto& o : rows) std::printf("%s\n", o.dump().c_str());
      } else {  // csv: a header, then a row per result
        for (size_t i = 0; i < rows.size(); ++i) {
          std::vector<std::pair<std::string, ojson>> cols;
          flatten(rows[i], "", cols);
          std::string line;
          if (i == 0) {
            for (auto& [k, v] : cols) line += (line.empty() ? "" : ",") + k;
            std::printf("%s\n", line.c_str());
            line.clear();
          }
          for (size_t c = 0; c < cols.size(); ++c) line += (c ? "," : "") + csv_field(cols[c].second);
          std::printf("%s\n", line.c_str());
        }
      }
      return;
    }
    // The model column is llama-bench's: architecture, size class, quantization type. The device scripts
    // read the test, t/s and bound cells by position (awk -F'|' $7, $8, $11): new columns go at the end.
    std::printf("| model | size | params | backend | threads | test | t/s | weights/token | GB/s | bound t/s (reached) |\n");
    std::printf("| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |\n");
    for (auto& r : results) {
      const std::vector<double> ts = r.tps();
      const double m = mean(ts);
      std::string bytes = r.n_gen ? human_bytes(bpt) : "-";
      char gbps[32] = "-", bnd[48] = "-";
      // (Several sequences share each step's weight reads: no per-token figure for them.)
      if (r.n_gen && r.n_parallel == 1) std::snprintf(gbps, sizeof gbps, "%.1f", (bpt + r.kv_bytes_per_token) * m / 1e9);
      if (r.n_gen && r.bound > 0) std::snprintf(bnd, sizeof bnd, "%.1f (%.0f%%)", r.bound, 100.0 * m / r.bound);
      std::printf("| %s | %s | %.2f B | %s | %d | %s | %.2f ± %.2f | %s | %s | %s |\n", model_type.c_str(),
                  human_bytes(static_cast<double>(size)).c_str(), params / 1e9, backend.c_str(), r.n_threads,
                  r.test.c_str(), m, stddev(ts), bytes.c_str(), gbps, bnd);
    }
  });
}

}  // namespace fitmoe::cli
