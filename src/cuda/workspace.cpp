#include "cuda/workspace.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "cuda/flash_attention.h"
#include "runtime/error.h"

namespace fitmoe::gpu {

KvRotation check_gpu_kv_type(const KvCacheType& t, const std::vector<int>& head_dims_k, const std::vector<int>& head_dims_v) {
  check_kv_cache_type(t, head_dims_k, head_dims_v);
  if (!t.flash_on() && t.k != DType::F16 && t.k != DType::F32)
    throw Error("KV cache " + t.name() + ": without flash attention the GPU engine stores f16 or f32 caches (use -fa on)");
  return kv_rotation(t, head_dims_k, head_dims_v);
}

DevKv alloc_dev_kv(DeviceMemory& mem, const KvCacheType& t, const KvRotation& rot, int n_pos, int n_head_kv,
                   int head_dim, int head_dim_v, size_t* bytes, void* stream) {
  DevKv kv{t.k, nullptr, nullptr, n_pos};
  kv.flash = t.flash_on();
  kv.v_type = kv.flash ? t.v : t.k;
  kv.k_row_bytes = static_cast<int64_t>(n_head_kv) * static_cast<int64_t>(kv_row_bytes(kv.type, head_dim));
  kv.v_row_bytes = static_cast<int64_t>(n_head_kv) * static_cast<int64_t>(kv_row_bytes(kv.v_type, head_dim_v));
  kv.rot_k = kv.flash ? rot.k : 0;
  kv.rot_v = kv.flash ? rot.v : 0;
  kv.tq_block_k = tq_block(head_dim);
  kv.tq_block_v = tq_block(head_dim_v);
  const size_t kb = static_cast<size_t>(kv.k_row_bytes) * n_pos, vb = static_cast<size_t>(kv.v_row_bytes) * n_pos;
  kv.k = static_cast<uint8_t*>(mem.alloc(kb, "KV cache"));
  kv.v = static_cast<uint8_t*>(mem.alloc(vb, "KV cache"));
  gpu::memset_async(kv.k, 0, kb, stream);
  gpu::memset_async(kv.v, 0, vb, stream);
  if (kv.flash) flash_init_tables();
  *bytes += kb + vb;
  return kv;
}

KvCache::KvCache(DeviceMemory& mem, const ModelConfig& c, int n_ctx, const KvCacheType& kv_type,
                 const std::vector<LayerSpec>* specs)
    : type(kv_type), mem_(mem) {
  std::vector<int> dk, dv;
  if (specs) {
    for (const LayerSpec& l : *specs)
      if (l.is_attention()) dk.push_back(l.attn().head_dim), dv.push_back(l.attn().head_dim_v);
  } else {
    dk.assign(1, c.head_dim), dv.assign(1, c.head_dim_v);
  }
  const KvRotation rot = check_gpu_kv_type(type, dk, dv);
  const int n_layers = specs ? static_cast<int>(specs->size()) : c.n_layer;
  for (int l = 0; l < n_layers; ++l) {
    int nkv = c.n_head_kv, hd = c.head_dim, hdv = c.head_dim_v;
    if (specs) {
      if (!(*specs)[l].is_attention()) {
        layers.push_back({type.k, nullptr, nullptr, n_ctx});
        continue;
      }
      const AttnSpec& a = (*specs)[l].attn();
      nkv = a.n_head_kv, hd = a.head_dim, hdv = a.head_dim_v;
    }
    layers.push_back(alloc_dev_kv(mem, type, rot, n_ctx, nkv, hd, hdv, &total_bytes, nullptr));
  }
  gpu::sync_stream(nullptr);  // the zeroing ran on the default stream; finish it before any use
}

KvCache::~KvCache() {
  for (auto& k : layers) {
    if (k.k) mem_.free(k.k);
    if (k.v) mem_.free(k.v);
  }
}

Workspace::~Workspace() {
  for (void* p : owned_) mem_->free(p);
  for (void* p : pinned_) gpu::free_pinned(p);
  for (int i = 0; i < kPrefillStageSlots; ++i)
    for (void* e : {ev_free[i], ev_filled[i]})
      if (e) gpu::destroy_event(e);
  if (copy_stream) gpu::destroy_stream(copy_stream);
}

void* Workspace::dev_bytes(size_t n, const char* what) {
  if (!mem_) {  // (device_bytes: counting as the accountant does)
    counted_ += n ? n : 1;
    return nullptr;
  }
  void* p = mem_->alloc(n, what);
  owned_.push_back(p);
  return p;
}

void* Workspace::host_bytes(size_t bytes) {
  void* p = gpu::alloc_pinned(std::max<size_t>(bytes, 64));
  pinned_.push_back(p);
  return p;
}

void DecodeGraphs::clear() {
  for (void* g : graphs)
    if (g) gpu::destroy_graph(g);
  graphs.clear();
}

GpuState::GpuState(Engine& e, const StateOptions& opt, const std::vector<LayerSpec>* specs)
    : kv(e.mem, e.c, opt.n_ctx, opt.kv, specs) {
  n_ctx_ = opt.n_ctx;
}

Workspace& Engine::workspace(const WorkspaceShape& shape, const StateOptions& opt, bool* fresh) {
  *fresh = !ws;
  if (ws) {
    if (opt.n_ctx > ws_n_ctx)
      throw Error("a sequence of " + std::to_string(opt.n_ctx) + " positions does not fit the engine's workspace (" +
                  std::to_string(ws_n_ctx) + "): plan the larger context");
    if (opt.kv.flash_on() != ws_flash)
      throw Error("every sequence of one engine needs the same kind of KV cache (flash attention " +
                  std::string(ws_flash ? "on" : "off") + ")");
    return *ws;
  }
  WorkspaceShape s = shape;
  s.n_ctx = std::max(opt.n_ctx, plan.options.n_ctx);
  s.flash_kv = opt.kv.flash_on();
  ws = std::make_unique<Workspace>(&mem);
  ws->allocate(*this, s);
  ws_n_ctx = s.n_ctx;
  ws_flash = s.flash_kv;
  return *ws;
}

// Every device buffer, in the order allocate() has always taken them (the accountant's figures and the
// buffers' addresses follow from it), sized for the shape; nothing else. The plan's gpu_scratch_bytes
// (src/runtime/plan.cpp) mirrors these sizes.
void Workspace::reserve_device(const ModelConfig& c, const WorkspaceShape& shape, int chunk_experts) {
  ub = shape.ubatch;
  const int U = ub, E = std::max(c.n_expert, 1), k = std::max(c.n_expert_used, 1);
  const int64_t n = c.n_embd, qw = static_cast<int64_t>(c.n_head) * c.head_dim,
                kw = static_cast<int64_t>(c.n_head_kv) * c.head_dim, vw = static_cast<int64_t>(c.n_head_kv) * c.head_dim_v,
                aw = static_cast<int64_t>(c.n_head) * c.head_dim_v;
  const int64_t ff = std::max<int64_t>({c.n_ff_exp, c.n_ff, 1});
  const int64_t slots = c.n_expert ? static_cast<int64_t>(U) * k : U;
  x = dev_floats(U * n, "activations");
  xn = dev_floats(U * n, "activations");
  q = dev_floats(U * qw, "activations");
  this->k = dev_floats(U * kw, "activations");
  v = dev_floats(U * vw, "activations");
  att = dev_floats(U * aw, "activations");
  y = dev_floats(U * n, "activations");
  y_attn = dev_floats(U * n, "activations");
  rlogits = dev_floats(U * E, "activations");
  wts = dev_floats(slots, "activations");
  g = dev_floats(slots * ff, "activations");
  u = dev_floats(slots * ff, "activations");
  ey = dev_floats(slots * n, "activations");
  logits = dev_floats(static_cast<size_t>(std::min(U, 64)) * c.n_vocab, "logits");
  ids = static_cast<int32_t*>(dev_bytes(sizeof(int32_t) * slots, "activations"));
  pos = static_cast<int32_t*>(dev_bytes(sizeof(int32_t) * U, "activations"));
  tokens = static_cast<int32_t*>(dev_bytes(sizeof(int32_t) * U, "activations"));
  idx_a = static_cast<int32_t*>(dev_bytes(sizeof(int32_t) * slots, "activations"));
  idx_b = static_cast<int32_t*>(dev_bytes(sizeof(int32_t) * slots, "activations"));
  act_row = static_cast<int32_t*>(dev_bytes(sizeof(int32_t) * slots, "activations"));
  ey_host = dev_floats(std::min<int64_t>(slots, static_cast<int64_t>(gpu::kMaxVecTokens) * k) * n, "activations");
  ident = static_cast<int32_t*>(dev_bytes(sizeof(int32_t) * slots, "activations"));
  route_done = static_cast<unsigned*>(dev_bytes(sizeof(unsigned), "activations"));
  // Activations in the weights' formats, for the matrix-vector path only (micro-batches of at most
  // kMaxVecTokens tokens); the widest row set is the experts' slots.
  const int64_t vec_tokens = std::min<int64_t>(U, gpu::kMaxVecTokens);
  const int64_t vec_rows = c.n_expert ? vec_tokens * k : vec_tokens;
  int64_t widest = std::max<int64_t>({n, qw, aw, ff, shape.act_width, shape.shared_ff});
  acts_bytes = gpu::act_bytes(DType::F32, widest, static_cast<int>(vec_rows));
  acts = dev_bytes(acts_bytes, "activations");
  if (n % 256 == 0) xn_q = dev_bytes(row_bytes(DType::Q8_K, n) * vec_tokens, "activations");
  dequant_bytes = 64u << 20;
  dequant = dev_bytes(dequant_bytes, "dequantized weight tiles");
  attn_scratch_bytes = shape.flash_kv ? gpu::flash_scratch_bytes(c.n_head, c.head_dim_v)
                                      : gpu::attention_scratch_bytes(U, shape.n_ctx, c.n_head, c.head_dim_v);
  attn_scratch = dev_bytes(attn_scratch_bytes, "attention scratch");
  if ((static_cast<int64_t>(c.n_head) * c.head_dim_v) % 256 == 0)
    att_q = dev_bytes(row_bytes(DType::Q8_K, aw) * vec_tokens, "activations");
  // The upload ring for host experts streamed during prefill (sized as the plan assumed).
  if (c.n_expert) {
    stage_bytes = shape.expert_bytes * chunk_experts;
    if (shape.host_experts)
      for (int b = 0; b < kPrefillStageSlots; ++b) stage[b] = dev_bytes(stage_bytes, "expert upload staging");
    offsets = static_cast<int32_t*>(dev_bytes(sizeof(int32_t) * (E + 1), "routing tables"));
  }
  epoch_dev = static_cast<unsigned*>(dev_bytes(sizeof(unsigned), "activations"));
  gpu_slots = static_cast<int32_t*>(dev_bytes(sizeof(int32_t) * vec_rows, "routing tables"));
  if (c.n_expert) {
    xp = dev_floats(n, "activations");
    plogits = dev_floats(E, "activations");
    pwts = dev_floats(k, "activations");
    pids = static_cast<int32_t*>(dev_bytes(sizeof(int32_t) * k, "activations"));
    pred_done = static_cast<unsigned*>(dev_bytes(sizeof(unsigned), "activations"));
  }
  if (shape.shared_ff > 0) {
    sh_g = dev_floats(U * shape.shared_ff, "activations");
    sh_u = dev_floats(U * shape.shared_ff, "activations");
    sh_y = dev_floats(U * n, "activations");
    sh_logit = dev_floats(U, "activations");
  }
}

uint64_t Workspace::device_bytes(const ModelConfig& c, const WorkspaceShape& shape, int chunk_experts) {
  Workspace counter(nullptr);
  counter.reserve_device(c, shape, chunk_experts);
  return counter.counted_;
}

void Workspace::allocate(Engine& eng, const WorkspaceShape& shape) {
  const ModelConfig& c = eng.c;
  void* const stream = eng.stream;
  reserve_device(c, shape, eng.chunk_experts);
  const int U = ub, E = std::max(c.n_expert, 1), k = std::max(c.n_expert_used, 1);
  const int64_t n = c.n_embd, qw = static_cast<int64_t>(c.n_head) * c.head_dim,
                aw = static_cast<int64_t>(c.n_head) * c.head_dim_v;
  const int64_t ff = std::max<int64_t>({c.n_ff_exp, c.n_ff, 1});
  const int64_t slots = c.n_expert ? static_cast<int64_t>(U) * k : U;
  const int64_t vec_tokens = std::min<int64_t>(U, gpu::kMaxVecTokens);
  const int64_t vec_rows = c.n_expert ? vec_tokens * k : vec_tokens;
  // act_row[j] = j / k (slot -> token) and ident[j] = j, constant.
  std::vector<int32_t> rows(static_cast<size_t>(slots)), identity(static_cast<size_t>(slots));
  for (int64_t j = 0; j < slots; ++j) rows[j] = static_cast<int32_t>(j / k), identity[j] = static_cast<int32_t>(j);
  gpu::memset_async(route_done, 0, sizeof(unsigned), stream);
  gpu::copy_h2d(act_row, rows.data(), sizeof(int32_t) * slots, stream);
  gpu::copy_h2d(ident, identity.data(), sizeof(int32_t) * slots, stream);
  gpu::memset_async(attn_scratch, 0, attn_scratch_bytes, stream);  // its counters start at zero
  if (c.n_expert) {
    if (shape.host_experts)
      for (int b = 0; b < kPrefillStageSlots; ++b) {
        ev_free[b] = gpu::create_event();
        ev_filled[b] = gpu::create_event();
        gpu::record_event(ev_free[b], stream);  // every buffer starts free
      }
    copy_stream = gpu::create_stream();
  }
  h_x = host<float>(static_cast<size_t>(U) * n);
  h_xn = host<float>(static_cast<size_t>(U) * std::max<int64_t>(n, shape.act_width));  // (also a host product's input)
  h_ids = host<int32_t>(slots);
  h_ey = host<float>(static_cast<size_t>(slots) * n);
  h_ey_slots = host<float>(static_cast<size_t>(vec_rows) * n);
  h_pos = host<int32_t>(U);
  h_idx = host<int32_t>(2 * slots + E + 2);
  // Host-side products (weights the plan left on the host): logits come in slices of 64 rows.
  h_out = host<float>(std::max<size_t>(static_cast<size_t>(64) * c.n_vocab,
                                       static_cast<size_t>(U) * std::max<int64_t>({qw, aw, n, ff, E, shape.act_width})));
  h_flags = host<unsigned>(c.n_layer);
  std::memset(h_flags, 0, sizeof(unsigned) * c.n_layer);
  flags_dev = static_cast<const unsigned*>(gpu::device_view(h_flags));
  ey_slots_dev = static_cast<const float*>(gpu::device_view(h_ey_slots));
  h_epoch = host<unsigned>(1);
  h_route_flags = host<unsigned>(c.n_layer);
  std::memset(h_route_flags, 0, sizeof(unsigned) * c.n_layer);
  route_flags_dev = static_cast<unsigned*>(gpu::device_view(h_route_flags));
  route_pub.ids = static_cast<int32_t*>(gpu::device_view(h_ids));
  route_pub.x = static_cast<float*>(gpu::device_view(h_xn));
  route_pub.epoch = epoch_dev;
  h_gpu_slots = host<int32_t>(vec_rows);
  route_pub.gpu_slots = gpu_slots;
  route_pub.host_gpu_slots = static_cast<int32_t*>(gpu::device_view(h_gpu_slots));
  route_pub.k = c.n_expert_used;
  route_pub.n_expert = c.n_expert;
  if (c.n_expert) {
    gpu::memset_async(pred_done, 0, sizeof(unsigned), stream);
    h_pred_ids = host<int32_t>(static_cast<size_t>(c.n_layer) * k);
    h_pred_flags = host<unsigned>(c.n_layer);
    std::memset(h_pred_flags, 0, sizeof(unsigned) * c.n_layer);
    pred_pub.ids = static_cast<int32_t*>(gpu::device_view(h_pred_ids));
    pred_pub.flag = static_cast<unsigned*>(gpu::device_view(h_pred_flags));
    pred_pub.epoch = epoch_dev;
  }
  if (eng.host_prof.on) {
    h_stamps = host<unsigned long long>(2 * static_cast<size_t>(c.n_layer));
    std::memset(h_stamps, 0, sizeof(unsigned long long) * 2 * c.n_layer);
    stamps_dev = static_cast<unsigned long long*>(gpu::device_view(h_stamps));
  }
  gpu::sync_stream(stream);
}

}  // namespace fitmoe::gpu
