// What a model is to the rest of fitmoe: hyperparameters, weights (each with where it lives), and a
// forward pass that turns a batch of tokens into logits while updating its per-sequence state.
//
// One file per architecture family under src/model/ implements Model. Everything an architecture
// needs to evaluate a batch (KV cache, recurrent state, scratch) lives in its ModelState, created by
// the model itself, so the session and the CLI never depend on one architecture's layout.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "format/gguf.h"
#include "model/config.h"
#include "runtime/plan.h"
#include "quant/dtype.h"

namespace fitmoe {

class ThreadPool;
class Model;

// Where a tensor's bytes are. Today every weight is in host memory (the file mapping or a host copy);
// the GPU backend adds device-resident weights and the plan decides per tensor.
enum class Residence { Host, Device };

// One weight as the forward pass sees it. 3-D expert tensors are sliced with expert(e).
struct Weight {
  const gguf::TensorInfo* info = nullptr;
  DType type = DType::F32;
  int64_t ne[4] = {1, 1, 1, 1};   // ne[0] = row length (inputs), ne[1] = rows (outputs), ne[2] = experts
  size_t row_bytes = 0;
  const uint8_t* host = nullptr;
  Residence residence = Residence::Host;

  explicit operator bool() const { return info != nullptr; }
  int64_t cols() const { return ne[0]; }
  int64_t rows() const { return ne[1]; }
  const uint8_t* row(int64_t r) const { return host + static_cast<size_t>(r) * row_bytes; }
  // The 2-D matrix of expert e of a 3-D expert tensor.
  Weight expert(int64_t e) const {
    Weight w = *this;
    w.ne[2] = 1;
    w.host = host + static_cast<size_t>(e) * row_bytes * static_cast<size_t>(ne[1]);
    return w;
  }
  size_t matrix_bytes() const { return row_bytes * static_cast<size_t>(ne[1]); }
  // Host copy of a 1-D f32 tensor (norm weights) for ops that want floats.
  const float* f32() const { return reinterpret_cast<const float*>(host); }
};

struct LoadOptions {
  // false (default): copy the weights into memory (huge pages) at load; true: compute straight from
  // the file mapping (instant start, but 4 KiB pages the OS may evict).
  bool use_mmap = false;
  // Placement: GPU use, VRAM budget, context, manual overrides. plan_only: stop after planning (no
  // weights are read, no GPU memory is taken): `fitmoe plan`.
  PlanOptions plan;
  bool plan_only = false;
  const MachineProfile* machine = nullptr;  // null: measure (or read the cached measurement)
  std::function<void(const std::string& what, uint64_t done, uint64_t total)> progress;
  // Called once the model is planned and validated but before any weight is read: checks of what the
  // caller will ask (token ids against the vocabulary, a prompt against the context) fail here, not
  // after a long load.
  std::function<void(const Model&)> before_weights;
};

// Per-sequence state: KV cache (and later recurrent state), sized for n_ctx positions.
class ModelState {
 public:
  virtual ~ModelState() = default;
  int n_ctx() const { return n_ctx_; }
  int n_past() const { return n_past_; }
  // Forget positions >= n (n <= n_past): used by chat to rewind and by speculative decoding. A KV cache
  // is indexed by position, so it lands exactly at n. A recurrent state (qwen35's DeltaNet layers)
  // cannot be rewound: it lands at the nearest checkpoint at or below n (position 0 always works),
  // n_past() says where, and the caller feeds the tokens from there to n again (Session::truncate
  // does). It never continues silently from a state that has seen tokens >= n.
  virtual void truncate(int n) { n_past_ = n < n_past_ ? n : n_past_; }
  void reset() { truncate(0); }
  // Keeps what a later truncate() to the current position needs: nothing for a KV cache, a copy of
  // the recurrent state otherwise (the last few are kept, see StateOptions::max_checkpoints).
  virtual void checkpoint() {}
  // True when the state holds recurrent layers, i.e. truncate() may land below the position asked for.
  virtual bool recurrent() const { return false; }
  virtual size_t bytes() const = 0;

 protected:
  int n_ctx_ = 0;
  int n_past_ = 0;
  friend class Model;
  void advance(int n) { n_past_ += n; }
};

struct StateOptions {
  int n_ctx = 4096;
  KvCacheType kv;  // f16 by default, as the reference (runtime/kv_cache.h)
  int max_checkpoints = kStateCheckpoints;  // recurrent states: the newest this many checkpoints are kept (4)
};

// Hybrid decode's routing guesses (GPU runs with host-resident experts): hybrid layer steps decoded,
// host-resident experts guessed before their routing was known, how many of those the routing then
// chose, and the bytes of them the CPU prefetched while it waited.
struct RoutingGuessStats {
  long layer_steps = 0, guessed = 0, chosen = 0;
  double prefetched_bytes = 0;
};

// One sequence's part of a batch: its tokens, at positions state->n_past() .., and how many of its last
// positions want logits. Several sequences share a batch (continuous batching in the server); each
// state appears at most once.
struct BatchSeq {
  ModelState* state = nullptr;
  std::span<const int32_t> tokens;
  int n_logits = 0;
};

// A batch as the forward passes see it: the sequences' tokens concatenated, each sequence a range of
// rows with its first position. Products run over every row at once; what reads or writes a
// sequence's own state (RoPE positions, the KV store, attention, recurrent state) runs per part.
struct BatchPart {
  ModelState* state;
  int row0, n, pos0, n_logits;
};
struct BatchRows {
  BatchRows() = default;
  explicit BatchRows(std::span<const BatchSeq> seqs);
  std::vector<int32_t> tokens;
  std::vector<BatchPart> parts;
  int n_rows() const { return static_cast<int>(tokens.size()); }
  int n_logits() const;  // the rows that want logits, in part order
};
// The CPU forward passes' last step before the output head: the rows that want logits (each part's
// last n_logits) of the residual x ([rows][n]) RMS-normed with w, packed in part order into out.
void norm_logit_rows(const BatchRows& batch, const float* x, float* out, int n, float eps, const float* w);

class Model {
 public:
  virtual ~Model();
  // Opens, validates and maps a GGUF; throws fitmoe::Error naming the problem (unknown architecture,
  // missing tensor, shape that disagrees with the hyperparameters, ...).
  static std::unique_ptr<Model> load(const std::string& path, const LoadOptions& opt = {});
  static std::vector<std::string> supported_architectures();

  const ModelConfig& config() const { return cfg_; }
  const Plan& plan() const { return plan_; }
  bool on_gpu() const { return gpu_ != nullptr; }
  std::string gpu_memory_report() const;
  uint64_t gpu_bytes_used() const;  // what the GPU engine's accountant holds (0 without a GPU)
  RoutingGuessStats routing_guess_stats() const;  // zeros without a GPU
  const gguf::File& file() const { return *file_; }
  std::shared_ptr<gguf::File> file_ptr() const { return file_; }

  virtual std::unique_ptr<ModelState> new_state(const StateOptions& opt) const = 0;

  // Evaluates tokens at positions state.n_past() .. n_past()+n-1 as one batch and advances the state.
  // Logits of the last `n_logits` positions (1 = the last one only, n = all) are written to logits,
  // row-major [n_logits][n_vocab]; logits may be null when n_logits is 0.
  void forward(ModelState& state, ThreadPool& pool, std::span<const int32_t> tokens, int n_logits,
               float* logits) const;
  // One batch of several sequences (see BatchSeq), each state advanced by its tokens; the logits of
  // every sequence's last n_logits positions, in sequence order: [sum of n_logits][n_vocab].
  void forward_batch(ThreadPool& pool, std::span<const BatchSeq> seqs, float* logits) const;

  // Calls f on every weight the forward pass reads.
  virtual void visit_weights(const std::function<void(const Weight&)>& f) const = 0;

  // Bytes of weights a decode step reads for one token (routed experts counted as n_expert_used of
  // n_expert), used to state achieved bandwidth.
  virtual double bytes_per_token() const = 0;

 protected:
  // The batch's rows in order; logits [batch.n_logits()][n_vocab]. Every part is validated (room in its
  // context, token ids, n_logits <= n) and the states are distinct.
  virtual void forward_impl(ThreadPool& pool, const BatchRows& batch, float* logits) const = 0;
  // Looks up a tensor and checks its type is computable and its shape is exactly `ne` (1s may be
  // omitted). Throws Error naming the tensor when it is missing (unless optional) or misshapen.
  Weight tensor(const std::string& name, std::vector<int64_t> ne, bool optional = false) const;

  // Called by load() after planning: an architecture with a GPU path uploads its device-resident
  // weights here. The default refuses, so an architecture without one falls back to the CPU.
  virtual bool init_gpu(const LoadOptions& opt) { return false; }
  // Whether the architecture has a GPU forward pass (in a CUDA build): the plan of one without is for the
  // CPU; a build without CUDA still plans GPU placements (`fitmoe plan --vram 8G` for another machine).
  virtual bool has_gpu_forward() const { return false; }

  std::shared_ptr<gguf::File> file_;
  ModelConfig cfg_;
  Plan plan_;
  std::unique_ptr<class GpuRunner> gpu_;  // set by init_gpu when the plan uses the GPU
};

}  // namespace fitmoe
