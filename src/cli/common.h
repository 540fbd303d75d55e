// Helpers shared by the subcommands: option groups, token lists, progress display, output files.
#pragma once
#include <CLI/CLI.hpp>

#include <cstdint>
#include <functional>
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
  int n_seq = 1;  // sequences the plan holds at once (serve: --parallel + --cache)
  std::string cache_type_k = "auto", cache_type_v = "auto";  // -ctk / -ctv
  std::string flash_attn = "auto";                          // -fa on|off|auto
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
  bool no_decode_graphs = false, no_routing_guess = false;
  // llama.cpp's -ngl, accepted so that its users' habits work: 0 means --gpu none; any other value
  // only gets a note that fitmoe places tensors itself.
  int n_gpu_layers = -1;
};
// -ctk / -ctv / -fa as a cache type (the names are checked when parsed).
KvCacheType kv_cache_type(const ModelOptions& o);
void add_model_options(CLI::App& app, ModelOptions& o, bool with_ctx = true);
SessionOptions session_options(const ModelOptions& o);
LoadOptions load_options(const ModelOptions& o);
// Loads the model (printing the plan's one-line summary); `check` runs once the file is validated and
// planned but before any weight is read, for checks of the command's own input (token ids, lengths).
std::unique_ptr<Model> load_model(const ModelOptions& o, const std::function<void(const Model&)>& check = {});

// Sampling flags with their ranges. The seed: --seed N, or -1 (the default) for a random one; the seed
// in use is printed by the command with its summary when sampling is random, so that a run can be repeated.
void add_sampler_options(CLI::App& app, SamplerParams& p);

// Range checks whose message names the bound and the value ("must be at least 1 (got 0)").
CLI::Validator at_least(double lo);
CLI::Validator between(double lo, double hi);

// Token ids as `tokenize` prints them ("[1, 2, 3]") or comma / space separated ("1,2,3"); throws Error
// on anything else.
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
// A file's raw bytes; throws Error naming the file and the system's reason (also for a directory).
std::string read_text_file(const std::string& path);
// Throws Error (with the reason) unless `path` can be created or replaced as a regular file: not a
// directory, its folder exists and is writable. Checked before any work, so no work is lost.
void check_output_path(const std::string& path);
// Writes bytes to PATH.partial and renames it to PATH; on any failure the partial file is removed and
// the Error gives the system's reason.
void write_file_atomically(const std::string& path, const void* data, size_t bytes);
double now_seconds();

// Ctrl-C. After install_interrupt_handler(), the first SIGINT only sets interrupted(): a command polls it
// at its next step, reports what it has and throws Interrupted (exit code 130); a second SIGINT ends the
// process at once (a command busy in a long prefill).
void install_interrupt_handler();
bool interrupted();
struct Interrupted : std::exception {
  const char* what() const noexcept override { return "interrupted"; }
};

// "unknown command 'X'", the commands there are, and the nearest one.
std::string unknown_command_message(const CLI::App& app, const std::string& word);

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
void register_perplexity(CLI::App& app);
void register_serve(CLI::App& app);

}  // namespace fitmoe::cli
