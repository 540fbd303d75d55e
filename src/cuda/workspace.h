// The GPU forward passes' memory:
// - KvCache: the per-sequence part (a K and V per attention layer, of the cache's types);
// - Workspace: every scratch buffer, sized for one micro-batch, and the pinned buffers and flags through
//   which the GPU and the CPU hand work to each other: one per engine (Engine::workspace), shared by
//   every sequence, whose rows a micro-batch may mix; its epoch counts the engine's micro-batches;
// - GpuState: the ModelState of a GPU run, holding the KV cache and the decode graphs captured over it
//   and the engine's workspace (both addresses stay fixed, so a sequence's graphs stay valid).
#pragma once
#include <cstdint>
#include <utility>
#include <vector>

#include "cuda/engine.h"
#include "cuda/gpu_ops.h"
#include "model/layer_spec.h"
#include "runtime/cpu_ops.h"

namespace fitmoe::gpu {

// One layer's cache of n_pos positions for heads of head_dim / head_dim_v, laid out as the type asks
// (f16 / f32 without flash attention: V transposed; with it, K and V rows of their types and the
// rotation `rot`), zeroed on `stream`; *bytes += what it took. The caller frees k and v.
DevKv alloc_dev_kv(DeviceMemory& mem, const KvCacheType& t, const KvRotation& rot, int n_pos, int n_head_kv,
                   int head_dim, int head_dim_v, size_t* bytes, void* stream);
// Checks the type against the heads (check_kv_cache_type) and that the GPU runs it: without flash
// attention only f16 and f32 (K and V alike); every type with it. The rotation it gets.
KvRotation check_gpu_kv_type(const KvCacheType& t, const std::vector<int>& head_dims_k, const std::vector<int>& head_dims_v);

struct KvCache {
  // One K and V per layer of c (c.n_layer); with specs, only for its attention layers (sized from
  // their AttnSpec; the others get an empty DevKv).
  KvCache(DeviceMemory& mem, const ModelConfig& c, int n_ctx, const KvCacheType& type,
          const std::vector<LayerSpec>* specs = nullptr);
  ~KvCache();
  KvCache(const KvCache&) = delete;
  KvCache& operator=(const KvCache&) = delete;
  size_t bytes() const { return total_bytes; }

  KvCacheType type;
  size_t total_bytes = 0;
  std::vector<DevKv> layers;

 private:
  DeviceMemory& mem_;
};

// What sizes the workspace besides the config: the micro-batch, the context (attention scratch), the
// largest routed expert's bytes (the prefill upload ring) and whether any layer has host experts.
struct WorkspaceShape {
  int ubatch = 1;
  int n_ctx = 0;
  size_t expert_bytes = 0;
  bool host_experts = false;
  // Other architectures (qwen35): the widest input or output row of a product beyond qwen3's widths
  // (0: none), and a shared expert's width (0: none; then MoeExecutor's sh_* buffers are allocated).
  int64_t act_width = 0;
  int64_t shared_ff = 0;
  // A flash-attention cache (DevKv::flash): the attention scratch is the flash decode kernel's.
  bool flash_kv = false;
};

struct Workspace {
  explicit Workspace(DeviceMemory* mem) : mem_(mem) {}
  ~Workspace();
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;

  // Allocates (through the accountant) and initialises every buffer below, on e.stream, and waits.
  void allocate(Engine& e, const WorkspaceShape& shape);
  // The device bytes allocate() takes from the accountant for this shape (the same code, counting): what
  // the plan's estimate of the GPU scratch (gpu_scratch_bytes in src/runtime/plan.cpp) should be.
  static uint64_t device_bytes(const ModelConfig& c, const WorkspaceShape& shape, int chunk_experts);

  float* dev_floats(size_t n, const char* what) { return static_cast<float*>(dev_bytes(n * sizeof(float), what)); }
  void* dev_bytes(size_t n, const char* what);
  template <typename T>
  T* host(size_t n) {
    return static_cast<T*>(host_bytes(n * sizeof(T)));
  }
  void* host_bytes(size_t bytes);

  int ub = 0;
  // Device scratch.
  float *x = nullptr, *xn = nullptr, *q = nullptr, *k = nullptr, *v = nullptr, *att = nullptr, *y = nullptr;
  float* y_attn = nullptr;  // the attention output when its residual add is deferred (MoeExecutor::folds_norm)
  float *rlogits = nullptr, *wts = nullptr, *g = nullptr, *u = nullptr, *ey = nullptr, *logits = nullptr;
  // The shared expert (WorkspaceShape::shared_ff): gate / up rows, its output, its gate's logits.
  float *sh_g = nullptr, *sh_u = nullptr, *sh_y = nullptr, *sh_logit = nullptr;
  int32_t *ids = nullptr, *pos = nullptr, *tokens = nullptr, *act_row = nullptr, *ident = nullptr, *idx_a = nullptr,
          *idx_b = nullptr;
  void *acts = nullptr, *dequant = nullptr, *attn_scratch = nullptr;
  unsigned* route_done = nullptr;  // gpu::router_topk's counter
  void* xn_q = nullptr;  // xn in Q8_K, written by residual_norm for the next mat-vecs (decode)
  void* att_q = nullptr;  // the attention output in Q8_K, written by the decode attention kernel for wo
  bool att_q_valid = false;
  bool xn_q_valid = false;
  bool ffn_out_combined = false;  // this layer's MoE output is already combined in y (not per slot in ey)
  size_t acts_bytes = 0, dequant_bytes = 0, attn_scratch_bytes = 0, stage_bytes = 0;
  // Pinned host exchange buffers.
  float *h_x = nullptr, *h_xn = nullptr, *h_ey = nullptr, *h_out = nullptr;
  float* h_ey_slots = nullptr;  // the CPU's expert outputs in slot order (decode), read by gpu::handover_combine
  float* ey_host = nullptr;     // rows of the host experts the GPU computes itself (its share, decode)
  int32_t *h_ids = nullptr, *h_pos = nullptr, *h_idx = nullptr;
  // The hand-over from the CPU's experts (decode): per layer a flag the host sets to this micro-batch's
  // epoch once its rows are in h_ey_slots; the epoch counts micro-batches (never reused, unlike a
  // position) and goes up with the positions.
  unsigned* h_flags = nullptr;
  const unsigned* flags_dev = nullptr;    // (device views of h_flags and h_ey_slots)
  const float* ey_slots_dev = nullptr;
  unsigned* h_epoch = nullptr;
  unsigned* epoch_dev = nullptr;
  unsigned epoch = 0;
  // The other way (decode): the GPU writes a hybrid layer's choices and normed input straight into
  // h_ids / h_xn and then the epoch into the layer's route flag (gpu::RoutePublish).
  unsigned* h_route_flags = nullptr;
  unsigned* route_flags_dev = nullptr;
  gpu::RoutePublish route_pub;  // h_ids and h_xn as the GPU sees them (flag: per layer, set at use)
  // Hybrid decode's routing guess: right after hybrid layer l's routing the GPU routes layer l + 1 (when
  // that is hybrid too) from x (before that layer's attention, and layer l's experts, have run) and
  // publishes the guess into h_pred_ids (k per layer, most likely first) and the layer's h_pred_flags;
  // the CPU reads those experts' weights into its caches while it waits for the real routing.
  float *xp = nullptr, *plogits = nullptr, *pwts = nullptr;
  int32_t* pids = nullptr;
  unsigned* pred_done = nullptr;  // (router_topk's counter for the prediction)
  int32_t* h_pred_ids = nullptr;
  unsigned* h_pred_flags = nullptr;
  gpu::RoutePublish pred_pub;  // h_pred_ids / h_pred_flags as the GPU sees them (per layer, set at use)
  // FITMOE_HOST_PROFILE: per layer, the GPU's clock when it saw the hand-over flag and when it raised
  // the route flag (pinned; device view in stamps_dev).
  unsigned long long* h_stamps = nullptr;
  unsigned long long* stamps_dev = nullptr;
  int32_t* gpu_slots = nullptr;    // per slot: the host expert the GPU computes itself, or -1
  int32_t* h_gpu_slots = nullptr;  // (pinned copy, for the CPU)
  int32_t* offsets = nullptr;               // grouped-expert offsets [n_expert + 1]
  // The prefill upload ring (ExpertStreamer): chunk i of a micro-batch's stream goes to buffer
  // i % kPrefillStageSlots.
  void* copy_stream = nullptr;
  void* stage[kPrefillStageSlots] = {};
  void* ev_free[kPrefillStageSlots] = {};    // compute is done with buffer b
  void* ev_filled[kPrefillStageSlots] = {};  // the upload into buffer b is done
  std::vector<std::pair<int, int>> stream_seq;  // (layer, chunk) in upload order
  size_t stream_copied = 0, stream_used = 0;    // chunks issued to the copy stream / consumed
  std::vector<char> layer_streams;              // per layer: host experts streamed (1) or CPU (0)
  std::vector<char> layer_waits;                // per streamed layer: its copies wait for its routing
  int routed_layer = -1;                        // the layer whose routing is known, and the experts
  std::vector<char> expert_used;                // it uses: later copies of its chunks carry only those
  cpu::Scratch cpu_scratch;

 private:
  void reserve_device(const ModelConfig& c, const WorkspaceShape& shape, int chunk_experts);
  DeviceMemory* mem_;  // null: only counting (device_bytes)
  uint64_t counted_ = 0;
  std::vector<void*> owned_, pinned_;
};

// The decode graphs of a state: one per stretch of GPU work between two host points (StepDriver).
struct DecodeGraphs {
  DecodeGraphs() = default;
  ~DecodeGraphs() { clear(); }
  DecodeGraphs(const DecodeGraphs&) = delete;
  DecodeGraphs& operator=(const DecodeGraphs&) = delete;
  void clear();
  std::vector<void*> graphs;
  int variant = -1;  // gpu::attention_decode_variant the graphs were captured with
};

// Per-sequence GPU state: the KV cache and the decode graphs. An architecture with more per-sequence
// state (qwen35's recurrent state and checkpoints, gemma4's rings) derives from it.
class GpuState : public ModelState {
 public:
  // specs: as for KvCache (null: every layer of e.c has a KV cache).
  GpuState(Engine& e, const StateOptions& opt, const std::vector<LayerSpec>* specs = nullptr);
  size_t bytes() const override { return kv.bytes(); }

  KvCache kv;
  DecodeGraphs graphs;
};

}  // namespace fitmoe::gpu
