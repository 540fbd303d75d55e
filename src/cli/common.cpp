#include "cli/common.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "runtime/error.h"
#include "runtime/machine.h"
#include "runtime/plan.h"

namespace fitmoe::cli {

void add_model_options(CLI::App& app, ModelOptions& o, bool with_ctx) {
  app.add_option("-m,--model", o.model_path, "GGUF model file")->required();
  app.add_option("-t,--threads", o.threads, "CPU threads (0: all cores; all but one with a GPU)")->check(CLI::NonNegativeNumber);
  app.add_flag("--mmap", o.mmap, "compute from the file mapping instead of loading the weights into memory");
  app.add_option("--vram", o.vram, "GPU memory budget, e.g. 8G (default: the card's free memory minus a margin)");
  app.add_option("--gpu", o.gpu, "GPU to use: auto, 0, or none (CPU only)")->check(CLI::IsMember({"auto", "none", "0", "cuda0"}));
  app.add_option("--n-cpu-moe,--ncmoe", o.n_cpu_moe, "keep the routed experts of the first N layers in host memory")
      ->check(CLI::NonNegativeNumber);
  app.add_flag("--cpu-moe,--cmoe", o.cpu_moe, "keep all routed experts in host memory");
  app.add_option("--override-tensor,--ot", o.overrides, "REGEX=cpu|cuda0: place matching tensors (first match wins)");
  app.add_option("--prefill-experts", o.prefill_experts,
                 "host-resident experts in prefill: auto (cost model), upload (to the GPU) or cpu")
      ->check(CLI::IsMember({"auto", "upload", "cpu"}));
  app.add_option("--host-experts-gpu-share", o.gpu_share,
                 "decode: the part of the chosen host-resident experts the GPU computes, reading their weights "
                 "over PCIe while the CPU computes the rest (0: the CPU does all; default: from the bandwidths)")
      ->check(CLI::Range(0.0, 1.0));
  if (with_ctx) {
    app.add_option("-c,--ctx", o.ctx, "context size in tokens")->check(CLI::PositiveNumber);
    app.add_option("--kv-type", o.kv_type, "KV cache type: f16 (default) or f32")->check(CLI::IsMember({"f16", "f32"}));
    app.add_option("-b,--batch", o.batch, "prompt tokens per forward batch (default: automatic)")->check(CLI::PositiveNumber);
  }
}

SessionOptions session_options(const ModelOptions& o) {
  SessionOptions s;
  s.n_threads = o.threads;
  s.n_ctx = o.ctx;
  s.kv_type = o.kv_type == "f32" ? DType::F32 : DType::F16;
  s.n_batch = o.batch;
  return s;
}

LoadOptions load_options(const ModelOptions& o) {
  LoadOptions lo;
  lo.use_mmap = o.mmap;
  lo.plan.use_gpu = o.gpu != "none";
  lo.plan.vram_budget = o.vram.empty() ? 0 : parse_size(o.vram);
  lo.plan.n_ctx = o.ctx;
  lo.plan.kv_type = o.kv_type == "f32" ? DType::F32 : DType::F16;
  lo.plan.n_ubatch = o.batch;
  lo.plan.n_cpu_moe = o.n_cpu_moe;
  lo.plan.cpu_moe = o.cpu_moe;
  lo.plan.overrides = parse_overrides(o.overrides);
  lo.plan.prefill_host_experts = o.prefill_experts;
  lo.plan.host_experts_gpu_share = o.gpu_share;
  return lo;
}

std::unique_ptr<Model> load_model(const ModelOptions& o) {
  LoadOptions lo = load_options(o);
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
  app.add_option("--temp", p.temperature, "temperature (0: greedy)");
  app.add_option("--top-k", p.top_k, "top-k (0: off)");
  app.add_option("--top-p", p.top_p, "top-p (1: off)");
  app.add_option("--min-p", p.min_p, "min-p (0: off)");
  app.add_option("--repeat-penalty", p.repeat_penalty, "repetition penalty (1: off)");
  app.add_option("--repeat-last-n", p.repeat_last_n, "tokens the penalty looks back over (-1: all)");
  app.add_option("-s,--seed", p.seed, "sampling seed");
}

std::vector<int32_t> parse_token_list(const std::string& s) {
  std::vector<int32_t> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    size_t b = item.find_first_not_of(" \t"), e = item.find_last_not_of(" \t");
    if (b == std::string::npos) throw Error("bad token list '" + s + "': empty item");
    item = item.substr(b, e - b + 1);
    char* end = nullptr;
    long v = std::strtol(item.c_str(), &end, 10);
    if (*end != '\0' || v < 0 || v > INT32_MAX) throw Error("bad token id '" + item + "' in token list");
    out.push_back(static_cast<int32_t>(v));
  }
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
  std::ifstream f(path, std::ios::binary);
  if (!f) throw Error(path + ": cannot open");
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
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
