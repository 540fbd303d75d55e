#include "cli/common.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <sstream>

#include "runtime/error.h"
#include "runtime/machine.h"
#include "runtime/plan.h"

namespace fitmoe::cli {

namespace {
// The value as a number, or an error message for CLI11 to print after the option's name.
bool as_number(const std::string& in, double* v, std::string* err) {
  char* end = nullptr;
  errno = 0;
  *v = std::strtod(in.c_str(), &end);
  if (in.empty() || end == in.c_str() || *end != '\0' || errno == ERANGE || !std::isfinite(*v)) {
    *err = "not a number: '" + in + "'";
    return false;
  }
  return true;
}

std::string number_text(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.15g", v);
  return buf;
}
}  // namespace

CLI::Validator at_least(double lo) {
  return CLI::Validator(
      [lo](std::string& in) -> std::string {
        double v = 0;
        std::string err;
        if (!as_number(in, &v, &err)) return err;
        return v < lo ? "must be at least " + number_text(lo) + " (got " + in + ")" : std::string();
      },
      ">=" + number_text(lo));
}

CLI::Validator between(double lo, double hi) {
  return CLI::Validator(
      [lo, hi](std::string& in) -> std::string {
        double v = 0;
        std::string err;
        if (!as_number(in, &v, &err)) return err;
        return v < lo || v > hi ? "must be between " + number_text(lo) + " and " + number_text(hi) + " (got " + in + ")"
                                : std::string();
      },
      number_text(lo) + ".." + number_text(hi));
}

namespace {
CLI::Validator greater_than(double lo) {
  return CLI::Validator(
      [lo](std::string& in) -> std::string {
        double v = 0;
        std::string err;
        if (!as_number(in, &v, &err)) return err;
        return v <= lo ? "must be greater than " + number_text(lo) + " (got " + in + ")" : std::string();
      },
      ">" + number_text(lo));
}

CLI::Validator size_check() {
  return CLI::Validator(
      [](std::string& in) -> std::string {
        try {
          parse_size(in);
        } catch (const Error& e) {
          return e.what();
        }
        return {};
      },
      "SIZE");
}
}  // namespace

void add_model_options(CLI::App& app, ModelOptions& o, bool with_ctx) {
  app.add_option("-m,--model", o.model_path, "GGUF model file")->required();
  app.add_option("-t,--threads", o.threads, "CPU threads (0: all cores; all but one with a GPU)")->check(at_least(0));
  app.add_flag("--mmap", o.mmap, "compute from the file mapping instead of loading the weights into memory");
  app.add_option("--vram", o.vram, "GPU memory budget for the whole process, e.g. 8G (default: the card's free memory minus a margin)")
      ->check(size_check());
  app.add_option("--gpu", o.gpu, "GPU to use: auto, 0, or none (CPU only)")->check(CLI::IsMember({"auto", "none", "0", "cuda0"}));
  app.add_option("--n-cpu-moe,--ncmoe", o.n_cpu_moe, "keep the routed experts of the first N layers in host memory")
      ->check(at_least(0));
  app.add_flag("--cpu-moe,--cmoe", o.cpu_moe, "keep all routed experts in host memory");
  app.add_option("--override-tensor,--ot", o.overrides, "REGEX=cpu|cuda0: place matching tensors (first match wins)");
  app.add_option("--prefill-experts", o.prefill_experts,
                 "host-resident experts in prefill: auto (cost model), upload (to the GPU) or cpu")
      ->check(CLI::IsMember({"auto", "upload", "cpu"}));
  app.add_option("--host-experts-gpu-share", o.gpu_share,
                 "decode: the part of the chosen host-resident experts the GPU computes, reading their weights "
                 "over PCIe while the CPU computes the rest (0: the CPU does all; -1: from the bandwidths)")
      ->check(CLI::IsMember({"-1"}) | between(0.0, 1.0));
  // For profilers and comparisons: the defaults are what measurements chose (docs/performance.md).
  app.add_flag("--no-decode-graphs", o.no_decode_graphs,
               "decode without CUDA graphs (the same kernels launched one by one, e.g. for a kernel profiler)");
  app.add_flag("--no-routing-guess", o.no_routing_guess,
               "hybrid decode: no guess of the next layer's routing and no read-ahead of its host experts");
  // llama.cpp's spellings (main() turns -ngl / -fa / -ub into these long names).
  app.add_option("--n-gpu-layers,--gpu-layers", o.n_gpu_layers,
                 "llama.cpp's -ngl: 0 runs on the CPU (as --gpu none); otherwise placement is automatic within --vram")
      ->check(at_least(-1));
  // KV cache (runtime/kv_cache.h). main() turns -ctk / -ctv / -fa into these long names.
  auto kv_type_check = CLI::Validator(
      [](std::string& s) {
        DType t;
        return s == "auto" || kv_type_from_name(s, &t)
                   ? std::string()
                   : "'" + s + "' is not a KV cache type (auto, " + kv_type_names() + ")";
      },
      "TYPE");
  app.add_option("--cache-type-k", o.cache_type_k, std::string("K cache type (-ctk): auto (the plan chooses, and says why), ") + kv_type_names())
      ->check(kv_type_check)
      ->capture_default_str();
  app.add_option("--cache-type-v", o.cache_type_v, std::string("V cache type (-ctv): auto, ") + kv_type_names())
      ->check(kv_type_check)
      ->capture_default_str();
  app.add_option("--flash-attn", o.flash_attn,
                 "flash attention (-fa): on, off, or auto (on where the cache types need it: q8_0, q4_0, or K and V "
                 "of different types)")
      ->expected(0, 1)
      ->default_str("auto")
      ->check(CLI::IsMember({"on", "off", "auto", "1", "0", "true", "false", ""}));
  if (with_ctx) {
    app.add_option("-c,--ctx,--ctx-size", o.ctx, "context size in tokens")->check(between(1, 1 << 30));
    app.add_option("-b,--batch,--ubatch-size", o.batch,
                   "prompt tokens per forward batch / GPU micro-batch (llama.cpp's -b and -ub; 0: automatic)")
        ->check(at_least(0));
  } else {
    app.add_option("--ubatch-size", o.batch, "GPU micro-batch (llama.cpp's -ub; as -b)")->check(at_least(0));
  }
}

KvCacheType kv_cache_type(const ModelOptions& o) {
  KvCacheType t;
  // Both automatic: the plan chooses; one given: the other is f16, as the reference's default.
  t.automatic = o.cache_type_k == "auto" && o.cache_type_v == "auto";
  if (o.cache_type_k != "auto" && !kv_type_from_name(o.cache_type_k, &t.k))
    throw Error("-ctk: '" + o.cache_type_k + "' is not a KV cache type");
  if (o.cache_type_v != "auto" && !kv_type_from_name(o.cache_type_v, &t.v))
    throw Error("-ctv: '" + o.cache_type_v + "' is not a KV cache type");
  // A bare -fa (the reference's older flag form) means on.
  t.flash = flash_attn_from_name(o.flash_attn.empty() ? "on" : o.flash_attn);
  return t;
}

SessionOptions session_options(const ModelOptions& o) {
  SessionOptions s;
  s.n_threads = o.threads;
  s.n_ctx = o.ctx;
  s.kv = kv_cache_type(o);
  s.n_batch = o.batch;
  return s;
}

LoadOptions load_options(const ModelOptions& o) {
  LoadOptions lo;
  lo.use_mmap = o.mmap;
  lo.plan.use_gpu = o.gpu != "none" && o.n_gpu_layers != 0;
  lo.plan.vram_budget = o.vram.empty() ? 0 : parse_size(o.vram);
  lo.plan.n_ctx = o.ctx;
  lo.plan.n_seq = o.n_seq;
  lo.plan.kv = kv_cache_type(o);
  lo.plan.n_ubatch = o.batch;
  lo.plan.n_cpu_moe = o.n_cpu_moe;
  lo.plan.cpu_moe = o.cpu_moe;
  lo.plan.overrides = parse_overrides(o.overrides);
  lo.plan.prefill_host_experts = o.prefill_experts;
  lo.plan.host_experts_gpu_share = o.gpu_share;
  lo.plan.decode_graphs = !o.no_decode_graphs;
  lo.plan.routing_guess = !o.no_routing_guess;
  return lo;
}

std::unique_ptr<Model> load_model(const ModelOptions& o, const std::function<void(const Model&)>& check) {
  LoadOptions lo = load_options(o);
  if (o.n_gpu_layers == 0 && o.gpu != "none") std::fprintf(stderr, "note: -ngl 0: running on the CPU (as --gpu none)\n");
  if (o.n_gpu_layers > 0)
    std::fprintf(stderr, "note: -ngl %d: fitmoe places every tensor itself within --vram (fitmoe plan shows where)\n",
                 o.n_gpu_layers);
  lo.before_weights = [&](const Model& m) {
    const ModelConfig& c = m.config();
    // Asked for more context than the model was trained on: allowed (rope scaling may extend it), but said.
    if (o.ctx > c.n_ctx_train && c.n_ctx_train > 0)
      std::fprintf(stderr, "warning: -c %d is above the model's trained context of %d tokens (%s.context_length); "
                   "output quality may degrade past %d tokens\n", o.ctx, c.n_ctx_train, c.arch.c_str(), c.n_ctx_train);
    if ((o.gpu == "0" || o.gpu == "cuda0") && !m.plan().use_gpu)
      std::fprintf(stderr, "note: --gpu %s: %s; running on the CPU\n", o.gpu.c_str(),
#if FITMOE_CUDA
                   "no CUDA GPU found"
#else
                   "this build has no CUDA backend"
#endif
      );
    if (check) check(m);
  };
  Progress progress("loading " + o.model_path);
  lo.progress = [&](const std::string& what, uint64_t d, uint64_t t) {
    progress.relabel(what);
    progress.update(d, t);
  };
  auto m = Model::load(o.model_path, lo);
  progress.finish();
  if (m->plan().use_gpu || !o.vram.empty()) {
    std::fprintf(stderr, "%s\n", m->plan().summary_line().c_str());
    const uint64_t bytes = m->file().data_bytes();
    const int64_t huge = huge_page_bytes(m->file().data_begin(), bytes);
    const std::string pages = huge < 0 ? "" : ", " + std::to_string(static_cast<int>(100.0 * huge / std::max<uint64_t>(bytes, 1))) +
                                           "% in 2 MiB pages";
    std::fprintf(stderr, "pinned: %s of host memory hold the weights%s (the CPU computes its experts from them, prefill "
                 "streams them to the GPU)\n", human_bytes(static_cast<double>(bytes)).c_str(), pages.c_str());
    // The CPU's experts read 4 KiB pages markedly slower; say why it happened and what helps.
    if (huge >= 0 && huge < static_cast<int64_t>(bytes / 2) && m->plan().use_gpu)
      std::fprintf(stderr, "note: the kernel gave few 2 MiB pages (transparent huge pages: %s); host-resident experts "
                   "read slower. 'madvise' or 'always' in /sys/kernel/mm/transparent_hugepage/enabled, and free memory "
                   "(dropping the page cache: sync; echo 1 > /proc/sys/vm/drop_caches), let it give more.\n",
                   huge_page_policy().c_str());
  }
  return m;
}

void add_sampler_options(CLI::App& app, SamplerParams& p) {
  app.add_option("--temp", p.temperature, "temperature (0: greedy)")->check(at_least(0));
  app.add_option("--top-k", p.top_k, "top-k (0: off)")->check(at_least(0));
  app.add_option("--top-p", p.top_p, "top-p (1: off)")->check(between(0, 1));
  app.add_option("--min-p", p.min_p, "min-p (0: off)")->check(between(0, 1));
  app.add_option("--repeat-penalty", p.repeat_penalty, "repetition penalty (1: off)")->check(greater_than(0));
  app.add_option("--repeat-last-n", p.repeat_last_n, "tokens the penalty looks back over (-1: all)")->check(at_least(-1));
  // The seed as given (-1: draw one), resolved and printed once the command's flags are parsed.
  auto seed = std::make_shared<int64_t>(-1);
  app.add_option("-s,--seed", *seed, "sampling seed (-1: a random one, printed so that the run can be repeated)")
      ->check(at_least(-1));
  app.parse_complete_callback([seed, &p] {
    p.seed = *seed >= 0 ? static_cast<uint64_t>(*seed) : (static_cast<uint64_t>(std::random_device{}()) << 20 ^
                                                          static_cast<uint64_t>(std::random_device{}())) & ((1ull << 52) - 1);
  });
}

std::vector<int32_t> parse_token_list(const std::string& s) {
  // Brackets and spaces as separators, so that the JSON array `tokenize` prints works as it is.
  std::string norm = s;
  size_t b = norm.find_first_not_of(" \t\r\n"), e = norm.find_last_not_of(" \t\r\n");
  norm = b == std::string::npos ? std::string() : norm.substr(b, e - b + 1);
  if (!norm.empty() && norm.front() == '[') {
    if (norm.back() != ']') throw Error("bad token list '" + s + "': a JSON array must end with ']'");
    norm = norm.substr(1, norm.size() - 2);
  }
  std::vector<int32_t> out;
  std::string item;
  bool comma_pending = false;  // "1,,2" and "1," are errors, "1 2" and "1, 2" are not
  auto flush = [&] {
    if (item.empty()) return;
    char* end = nullptr;
    errno = 0;
    long long v = std::strtoll(item.c_str(), &end, 10);
    if (*end != '\0' || errno == ERANGE || v < 0 || v > INT32_MAX)
      throw Error("bad token id '" + item + "' in token list (ids are integers from 0)");
    out.push_back(static_cast<int32_t>(v));
    item.clear();
    comma_pending = false;
  };
  for (char c : norm) {
    if (c == ',') {
      if (item.empty() && (out.empty() || comma_pending)) throw Error("bad token list '" + s + "': empty item");
      flush();
      comma_pending = true;
    } else if (c == ' ' || c == '\t' || c == '\n' || c == '\r') {
      flush();
    } else {
      item += c;
    }
  }
  flush();
  if (comma_pending) throw Error("bad token list '" + s + "': empty item");
  if (out.empty()) throw Error("empty token list");
  return out;
}

std::string join_tokens(const std::vector<int32_t>& ids) {
  std::string s;
  for (size_t i = 0; i < ids.size(); ++i) s += (i ? "," : "") + std::to_string(ids[i]);
  return s;
}

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void Progress::update(uint64_t done, uint64_t total) {
  if (start_ < 0) start_ = now_seconds();
  if (total < (64u << 20)) return;  // small jobs finish before a bar would help
  shown_ = true;
  int permille = total ? static_cast<int>(done * 1000 / total) : 1000;
  static const bool tty = isatty(STDERR_FILENO);
  if (tty ? permille == last_permille_ : permille / 100 == last_permille_ / 100) return;
  last_permille_ = permille;
  double el = now_seconds() - start_;
  double rate = el > 0 ? done / el : 0;
  if (tty) {
    int bar = permille * 30 / 1000;
    std::fprintf(stderr, "\r%s [%.*s%*s] %5.1f%% %s/%s %s/s  ", label_.c_str(), bar,
                 "==============================", 30 - bar, "", permille / 10.0, human_bytes(done).c_str(),
                 human_bytes(total).c_str(), human_bytes(rate).c_str());
  } else {
    std::fprintf(stderr, "%s %5.1f%% %s/%s %s/s\n", label_.c_str(), permille / 10.0, human_bytes(done).c_str(),
                 human_bytes(total).c_str(), human_bytes(rate).c_str());
  }
  std::fflush(stderr);
}

void Progress::finish() {
  if (shown_ && isatty(STDERR_FILENO)) std::fprintf(stderr, "\n");
}

void Progress::relabel(const std::string& label) {
  if (label == label_) return;
  finish();
  label_ = label;
  last_permille_ = -1;
  start_ = -1;
  shown_ = false;
}

std::string read_text_file(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) throw Error(path + ": is a directory, not a file");
  errno = 0;
  std::ifstream f(path, std::ios::binary);
  if (!f) throw Error(path + ": cannot open: " + std::strerror(errno ? errno : ENOENT));
  std::string s((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  if (f.bad()) throw Error(path + ": cannot read: " + std::strerror(errno ? errno : EIO));
  return s;
}

void check_output_path(const std::string& path) {
  namespace fs = std::filesystem;
  if (path.empty()) throw Error("empty output path");
  std::error_code ec;
  if (fs::is_directory(path, ec)) throw Error(path + ": is a directory (give a file name)");
  fs::path dir = fs::path(path).parent_path();
  if (dir.empty()) dir = ".";
  if (!fs::is_directory(dir, ec)) throw Error(path + ": folder " + dir.string() + " does not exist");
  if (::access(dir.c_str(), W_OK) != 0) throw Error(path + ": cannot write in " + dir.string() + ": " + std::strerror(errno));
  if (fs::exists(path, ec) && ::access(path.c_str(), W_OK) != 0)
    throw Error(path + ": cannot replace: " + std::strerror(errno));
}

void write_file_atomically(const std::string& path, const void* data, size_t bytes) {
  const std::string tmp = path + ".partial";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw Error(path + ": cannot create " + tmp + ": " + std::strerror(errno));
  const auto* p = static_cast<const uint8_t*>(data);
  size_t done = 0;
  std::string failure;
  while (done < bytes && failure.empty()) {
    const ssize_t w = ::write(fd, p + done, bytes - done);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) failure = std::string("write failed: ") + std::strerror(w < 0 ? errno : ENOSPC);
    else done += static_cast<size_t>(w);
  }
  if (::close(fd) != 0 && failure.empty()) failure = std::string("close failed: ") + std::strerror(errno);
  if (failure.empty() && std::rename(tmp.c_str(), path.c_str()) != 0)
    failure = std::string("rename failed: ") + std::strerror(errno);
  if (!failure.empty()) {
    ::unlink(tmp.c_str());
    throw Error(path + ": " + failure);
  }
}

namespace {
volatile std::sig_atomic_t g_interrupts = 0;
void on_interrupt(int) {
  if (g_interrupts > 0) std::_Exit(130);  // a second Ctrl-C: the command did not get to a stopping point
  g_interrupts = 1;
}
}  // namespace

void install_interrupt_handler() {
  struct sigaction sa {};
  sa.sa_handler = on_interrupt;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, nullptr);
}

bool interrupted() { return g_interrupts > 0; }

std::string unknown_command_message(const CLI::App& app, const std::string& word) {
  // Levenshtein distance: the nearest command within two edits is suggested.
  auto distance = [](const std::string& a, const std::string& b) {
    std::vector<size_t> row(b.size() + 1);
    for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
    for (size_t i = 1; i <= a.size(); ++i) {
      size_t diag = row[0];
      row[0] = i;
      for (size_t j = 1; j <= b.size(); ++j) {
        const size_t up = row[j];
        row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] != b[j - 1])});
        diag = up;
      }
    }
    return row[b.size()];
  };
  std::string list, best;
  size_t best_d = 3;
  for (const auto* sub : app.get_subcommands([](const CLI::App*) { return true; })) {
    const std::string& name = sub->get_name();
    list += (list.empty() ? "" : ", ") + name;
    const size_t d = distance(word, name);
    if (d < best_d || (word.size() >= 3 && name.rfind(word, 0) == 0 && best.empty())) best_d = d, best = name;
  }
  std::string msg = "error: unknown command '" + word + "'";
  if (!best.empty()) msg += "; did you mean '" + best + "'?";
  msg += "\ncommands: " + list + ", help\n(fitmoe help COMMAND, or fitmoe COMMAND --help, shows a command's options)";
  return msg;
}

std::string human_bytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (b >= 1024 && u < 4) {
    b /= 1024;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, u ? "%.2f %s" : "%.0f %s", b, units[u]);
  return buf;
}

}  // namespace fitmoe::cli
