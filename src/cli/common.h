// Helpers shared by the subcommands: option groups, token lists, progress display, output files.
#pragma once
#include <CLI/CLI.hpp>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "model/model.h"
#include "runtime/session.h"
#include "text/sampling.h"

namespace fitmoe::cli {

// Options most commands share.
struct ModelOptions {
  std::string model_path;
  int threads = 0;
  int ctx = 4096;
  std::string kv_type = "f16";
  int batch = 0;  // 0: automatic (512; 2048 on the GPU when prefill streams host experts)
  bool mmap = false;
  // Placement (see runtime/plan.h).
  std::string vram;            // "8G"; empty: the card's free memory minus a margin
  std::string gpu = "auto";    // auto | none | 0
  int n_cpu_moe = 0;
  bool cpu_moe = false;
  std::vector<std::string> overrides;
  std::string prefill_experts = "auto";
  double gpu_share = -1;  // --host-experts-gpu-share (-1: automatic)
};
void add_model_options(CLI::App& app, ModelOptions& o, bool with_ctx = true);
SessionOptions session_options(const ModelOptions& o);
LoadOptions load_options(const ModelOptions& o);
std::unique_ptr<Model> load_model(const ModelOptions& o);  // prints the plan's one-line summary

void add_sampler_options(CLI::App& app, SamplerParams& p);

// "1,2,3" -> {1, 2, 3}; throws Error on anything else.
std::vector<int32_t> parse_token_list(const std::string& s);
std::string join_tokens(const std::vector<int32_t>& ids);

// A one-line progress bar on stderr (only when stderr is a terminal, else a line every 10%).
class Progress {
 public:
  explicit Progress(std::string label) : label_(std::move(label)) {}
  void update(uint64_t done, uint64_t total);
  void finish();
  // A new phase with its own label (finishes the current bar first).
  void relabel(const std::string& label);

 private:
  std::string label_;
  int last_permille_ = -1;
  double start_ = -1;
  bool shown_ = false;
};

std::string human_bytes(double bytes);
std::string read_text_file(const std::string& path);  // raw bytes; throws Error naming the file
double now_seconds();

// Registration of each subcommand (one file each in src/cli/).
void register_info(CLI::App& app);
void register_run(CLI::App& app);
void register_generate(CLI::App& app);
void register_logits(CLI::App& app);
void register_bench(CLI::App& app);
void register_gen_model(CLI::App& app);
void register_plan(CLI::App& app);
void register_tokenize(CLI::App& app);
void register_detokenize(CLI::App& app);
void register_chat(CLI::App& app);

}  // namespace fitmoe::cli
