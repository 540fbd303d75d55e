#include "cuda/moe_decode.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <immintrin.h>
#include <string>

#include "cuda/deltanet.h"
#include "cuda/linear.h"
#include "runtime/error.h"
#include "runtime/thread_pool.h"

namespace fitmoe::gpu {

MoeExecutor::MoeExecutor(Engine& e, std::vector<MoeLayer> layers) : e_(e), layers_(std::move(layers)) {
  for (size_t l = 0; l < layers_.size(); ++l) {
    const MoeLayer& L = layers_[l];
    if (!L.router) continue;
    const std::string where = "layer " + std::to_string(l) + ": ";
    if (L.act != Activation::SiLU) throw Error(where + "the GPU engine's experts take SiLU only (for now)");
    if (L.shared && (!L.shared->gate.host || !L.shared->up.host || !L.shared->down.host || !L.shared->gate_inp.host))
      throw Error(where + "internal: the shared expert lacks a matrix");
    if (L.out != MoeOutput::Residual) throw Error(where + "the GPU engine adds the experts' output into the residual only (for now)");
  }
}

bool MoeExecutor::routes_in_experts(int l, int nt) const {
  if (!moe(l)) return false;
  const MoeLayer& L = layers_[l];
  const GExperts& X = *L.experts;
  const ModelConfig& c = e_.c;
  return nt == 1 && X.n_dev == c.n_expert && !X.gpu_share() && L.router->on_gpu() &&
         c.n_expert <= gpu::kRouteInExpertsMax && c.n_expert_used <= 32 && X.gate.type == X.up.type &&
         !is_float_type(X.gate.type);
}

bool MoeExecutor::folds_norm(int l, int nt) const {
  if (!routes_in_experts(l, nt)) return false;
  const MoeLayer& L = layers_[l];
  const ModelConfig& c = e_.c;
  // (A shared expert reads the FFN's normed input in f32, which the folded norm does not write.)
  return !L.shared && L.router->dev.type == DType::F32 && L.router->dev.cols == c.n_embd && c.n_embd % 256 == 0 &&
         c.n_embd <= 4096 && L.fold_norm && dtype_info(L.experts->gate.type).act_type == DType::Q8_K &&
         c.n_expert_used <= 8 &&
         !is_float_type(L.experts->down.type);  // (the down kernel then combines into y: residual_norm's y0 path)
}

void MoeExecutor::gpu_part(Step& s, int l, int nt, const MoeIo& io) {
  routed_part(s, l, nt, io);
  if (layers_[l].shared) shared_part(s, l, nt, io.expert_in);
}

// The shared expert: ys = down(silu(gate x) * (up x)), and its gate's logit per token unless combine
// computes it itself (an f32 gate on the GPU: gpu::shared_expert_gate_add reads x then). On the
// stream after the routed experts, so that in a hybrid layer the GPU computes it while the CPU runs
// its experts.
void MoeExecutor::shared_part(Step& s, int l, int nt, const float* x) {
  const SharedExpert& S = *layers_[l].shared;
  Workspace& st = s.ws;
  void* const stream = e_.stream;
  const int64_t ff = S.gate.host->rows();
  linear_shared(s, {{&S.gate, st.sh_g, ff}, {&S.up, st.sh_u, ff}}, x, nt);
  gpu::swiglu(st.sh_g, st.sh_u, st.sh_g, static_cast<int64_t>(nt) * ff, stream);
  linear(s, S.down, st.sh_g, nt, st.sh_y, e_.c.n_embd);
  if (!(S.gate_inp.on_gpu() && S.gate_inp.dev.type == DType::F32)) linear(s, S.gate_inp, x, nt, st.sh_logit, 1);
  shared_in_ = x;
  e_.prof.mark("shared expert", stream);
}

void MoeExecutor::routed_part(Step& s, int l, int nt, const MoeIo& io) {
  const ModelConfig& c = e_.c;
  Workspace& st = s.ws;
  void* const stream = e_.stream;
  OpProfile& prof = e_.prof;
  const MoeLayer& L = layers_[l];
  // (The routing kernels publish their own input for the host's experts, and the folded norm writes
  // the experts' input: both need the router to read what the experts read.)
  if (io.router_in != io.expert_in) throw Error("internal: the GPU engine's router reads the experts' input (for now)");
  const GWeight& router = *L.router;
  const int E = c.n_embd;
  const int k = c.n_expert_used, n_slots = nt * k;
  const int64_t ff = c.n_ff_exp;
  GExperts& X = *L.experts;
  st.ffn_out_combined = false;
  // The CPU needs the choices and the normed input of a hybrid layer: the routing kernel writes them
  // into pinned memory and raises the layer's flag, so the CPU starts while the GPU runs its own experts.
  gpu::RoutePublish pub;
  const bool share = X.gpu_share();  // the GPU computes part of the host experts too
  if (X.n_dev < c.n_expert) {
    pub = st.route_pub;
    pub.flag = st.route_flags_dev + l;
    pub.slot_of = X.slot_of_dev;
    pub.gpu_share = share ? static_cast<float>(e_.plan.host_experts_gpu_share) : 0.0f;
    if (st.stamps_dev) pub.stamp = st.stamps_dev + 2 * l + 1;
  }
  const bool routed_by_experts = routes_in_experts(l, nt);
  if (folds_norm(l, nt)) {
    gpu::residual_norm_router(st.x, st.y_attn, L.fold_norm, E, c.rms_eps, router.dev, st.rlogits, st.xn_q, stream);
    st.xn_q_valid = true;
    prof.mark("residual + ffn norm + router", stream);
  } else if (routed_by_experts) {
    linear(s, router, io.router_in, nt, st.rlogits, c.n_expert);
    prof.mark("router", stream);
  } else if (router.on_gpu() &&
             gpu::router_topk(router.dev, io.router_in, nt, st.rlogits, k, st.ids, st.wts, st.route_done, stream, pub)) {
    prof.mark("router + top-k", stream);
  } else {
    linear(s, router, io.router_in, nt, st.rlogits, c.n_expert);
    prof.mark("router", stream);
    gpu::route_topk(st.rlogits, nt, c.n_expert, k, st.ids, st.wts, stream);
    if (pub.flag) gpu::publish_route(pub, st.ids, n_slots, io.expert_in, static_cast<int64_t>(nt) * E, stream);
    prof.mark("top-k", stream);
  }
  predict_next_route(s, l, nt);
  // The device-resident experts, and the GPU's share of the host-resident ones read from pinned
  // memory (their rows of g are other slots', and their outputs go where the CPU's would: ey_host).
  if (X.n_dev == 0 && !share) return;
  const DevMatrix& gate = X.n_dev > 0 ? X.gate : X.host_gate;
  const void* acts = vec_acts(s, gate.type, io.expert_in, nt, E);
  if (X.n_dev > 0) {
    if (routed_by_experts) {
      gpu::matvec_experts_glu_routed(X.gate, X.up, st.rlogits, c.n_expert, k, st.ids, st.wts, X.decode_slot_of(), acts,
                                     st.g, ff, stream);
    } else if (X.gate.type == X.up.type && !is_float_type(X.gate.type)) {
      gpu::matvec_experts_glu(X.gate, X.up, st.ids, X.decode_slot_of(), n_slots, acts, st.act_row, st.g, ff, stream);
    } else {
      gpu::matvec_experts(X.gate, st.ids, X.slot_of_dev, n_slots, acts, st.act_row, st.g, ff, stream);
      const void* acts_up = dtype_info(X.up.type).act_type != dtype_info(X.gate.type).act_type
                                ? vec_acts(s, X.up.type, io.expert_in, nt, E)
                                : acts;
      gpu::matvec_experts(X.up, st.ids, X.slot_of_dev, n_slots, acts_up, st.act_row, st.u, ff, stream);
      gpu::swiglu(st.g, st.u, st.g, n_slots * ff, stream);
    }
  }
  if (share) {
    if (X.n_dev > 0 && dtype_info(X.host_gate.type).act_type != dtype_info(gate.type).act_type)
      acts = vec_acts(s, X.host_gate.type, io.expert_in, nt, E);
    gpu::matvec_experts_glu(X.host_gate, X.host_up, st.gpu_slots, nullptr, n_slots, acts, st.act_row, st.g, ff,
                            stream);
  }
  prof.mark("experts gate+up", stream);
  const DevMatrix& down = X.n_dev > 0 ? X.down : X.host_down;
  acts = vec_acts(s, down.type, st.g, n_slots, ff);
  if (X.n_dev == c.n_expert && k <= 8 && !is_float_type(X.down.type)) {
    // Every expert on the GPU: the down products combine straight into st.y.
    gpu::matvec_experts_combine(X.down, st.ids, X.decode_slot_of(), nt, k, acts, st.wts, st.y, E, stream);
    st.ffn_out_combined = true;
  } else if (X.n_dev > 0) {
    gpu::matvec_experts(X.down, st.ids, X.slot_of_dev, n_slots, acts, st.ident, st.ey, E, stream);
  }
  if (share) {
    if (X.n_dev > 0 && dtype_info(X.host_down.type).act_type != dtype_info(down.type).act_type)
      acts = vec_acts(s, X.host_down.type, st.g, n_slots, ff);
    gpu::matvec_experts(X.host_down, st.gpu_slots, nullptr, n_slots, acts, st.ident, st.ey_host, E, stream);
  }
  prof.mark("experts down", stream);
}

// Right after hybrid layer l's routing (one token), when layer l + 1 is hybrid too: guess layer
// l + 1's routing from x as it is now (the attention block's output is in it, layer l's experts not
// yet), normed with layer l + 1's guess norm (qwen3: its FFN norm), and publish the guess for the CPU
// (see Workspace::pred_pub). It costs the GPU two small launches while the CPU runs layer l's host
// experts, and comes first so that the GPU's own experts (or its share of the host's) never delay it.
// Measured on the dev machine with the CPU engine (8-layer synthetic 30B-A3B shape, 273 layer steps),
// the guess's i-th choice is among the real ones 92, 90, 89, 84, 76, 68, 59, 48% of the time for
// i = 1..8 (74% in all; 76% with layer l's GPU-side experts added to x, 86% with all of them).
void MoeExecutor::predict_next_route(Step& s, int l, int nt) {
  if (nt != 1 || !guesses_route(l + 1)) return;
  Workspace& st = s.ws;
  const MoeLayer& N = layers_[l + 1];
  const ModelConfig& c = e_.c;
  const int k = c.n_expert_used;
  gpu::rms_norm(st.x, N.guess_norm, st.xp, c.n_embd, 1, c.rms_eps, c.n_embd, c.n_embd, e_.stream);
  gpu::RoutePublish pub = st.pred_pub;
  pub.ids += static_cast<ptrdiff_t>(l + 1) * k;
  pub.flag += l + 1;
  if (!gpu::router_topk(N.router->dev, st.xp, 1, st.plogits, k, st.pids, st.pwts, st.pred_done, e_.stream, pub))
    throw Error("internal: the routing guess of layer " + std::to_string(l + 1) + " was refused");
  e_.prof.mark("next layer's routing guessed", e_.stream);
}

bool MoeExecutor::guesses_route(int l) const {
  if (!e_.sw.predict || l < 1 || l >= e_.c.n_layer || !hybrid(l) || !hybrid(l - 1)) return false;
  const MoeLayer& L = layers_[l];
  const DevMatrix& r = L.router->dev;
  return L.guess_norm && L.router->on_gpu() && r.type == DType::F32 && r.n_mats == 1 && r.rows <= 512;
}

// Waits (spinning: it comes within tens of microseconds) until the GPU has published layer l's
// routing of this micro-batch. A failed stream or a minute without it is an error, not a hang.
void MoeExecutor::wait_route(Step& s, int l) {
  Workspace& st = s.ws;
  const std::atomic_ref<unsigned> flag(st.h_route_flags[l]);
  const auto t0 = std::chrono::steady_clock::now();
  for (unsigned spins = 0; flag.load(std::memory_order_acquire) != st.epoch; ++spins) {
    _mm_pause();
    if ((spins & 0xfffu) == 0xfffu) {
      if (gpu::check_stream(e_.stream) && flag.load(std::memory_order_acquire) != st.epoch)
        throw Error("internal: the GPU finished without handing over the routing of layer " + std::to_string(l));
      if (std::chrono::steady_clock::now() - t0 > std::chrono::seconds(60))
        throw Error("the GPU did not hand over the routing of layer " + std::to_string(l) + " within 60 s");
    }
  }
}

void MoeExecutor::host_part(Step& s, int l, int nt) {
  Workspace& st = s.ws;
  ThreadPool& pool = s.pool;
  const ModelConfig& c = e_.c;
  const int E = c.n_embd, k = c.n_expert_used, n_slots = nt * k;
  GExperts& X = *layers_[l].experts;
  const auto t0 = std::chrono::steady_clock::now();
  size_t prefetched = 0;
  const std::vector<int32_t> guessed = nt == 1 ? read_guessed_ahead(s, l, &prefetched) : std::vector<int32_t>{};
  wait_route(s, l);
  const auto t1 = std::chrono::steady_clock::now();
  std::vector<int32_t> tok, exp, slot;
  for (int j = 0; j < n_slots; ++j) {
    const int32_t e = st.h_ids[j];
    if (e < 0 || e >= c.n_expert) throw Error(no_expert_message(e));
    // Host-resident, and not one the GPU computes itself.
    if (X.slot_of[e] < 0 && !(X.gpu_share() && st.h_gpu_slots[j] >= 0))
      tok.push_back(j / k), exp.push_back(e), slot.push_back(j);
  }
  if (!tok.empty()) {
    // Each output straight into its slot's row of h_ey_slots.
    cpu::expert_ffn(pool, *X.host, st.h_xn, nt, E, tok.data(), exp.data(), static_cast<int>(tok.size()),
                    st.h_ey_slots, st.cpu_scratch, slot.data(), guessed);
  }
  // The rows before the flag (x86 keeps stores in order; the release keeps the compiler from moving them).
  std::atomic_ref<unsigned>(st.h_flags[l]).store(st.epoch, std::memory_order_release);
  if (nt == 1) {
    RoutingGuessStats& gs = e_.guess_stats;
    ++gs.layer_steps;
    gs.guessed += static_cast<long>(guessed.size());
    // (Right when the routing chose it, whichever side then computed it.)
    for (const int32_t e : guessed) gs.chosen += std::find(st.h_ids, st.h_ids + n_slots, e) != st.h_ids + n_slots;
    gs.prefetched_bytes += static_cast<double>(prefetched);
    if (e_.host_prof.on) {
      std::vector<int32_t> distinct = exp;
      std::sort(distinct.begin(), distinct.end());
      distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
      const double per_expert = static_cast<double>(X.host->gate.matrix_bytes() + X.host->up.matrix_bytes() +
                                                    X.host->down.matrix_bytes());
      e_.host_prof.add(t1 - t0, std::chrono::steady_clock::now() - t1, per_expert * static_cast<double>(distinct.size()));
    }
  }
}

// While the GPU runs hybrid layer l's attention block and routing (one token), the host's memory
// would sit idle: when the GPU guessed this layer's routing (see predict_next_route), every thread
// reads its slices of the guessed host-resident experts (most likely first) into its caches until
// the real routing arrives. Returns the experts read for, which the threads then compute by the same
// slices (cpu::expert_ffn's `sliced`); *bytes: what was read.
std::vector<int32_t> MoeExecutor::read_guessed_ahead(Step& s, int l, size_t* bytes) {
  Workspace& st = s.ws;
  ThreadPool& pool = s.pool;
  const ModelConfig& c = e_.c;
  const int k = c.n_expert_used;
  const GExperts& X = *layers_[l].experts;
  std::vector<int32_t> guessed;
  if (!st.h_pred_flags || !guesses_route(l)) return guessed;
  const std::atomic_ref<unsigned> route(st.h_route_flags[l]), pred(st.h_pred_flags[l]);
  // The guess comes a little before the routing (right after the previous layer's routing, as two
  // small launches); if the routing comes first, there is no time to read ahead anyway.
  for (unsigned spins = 0; pred.load(std::memory_order_acquire) != st.epoch; ++spins) {
    if (route.load(std::memory_order_acquire) == st.epoch || spins > (1u << 24)) return guessed;
    _mm_pause();
  }
  for (int j = 0; j < k; ++j) {
    const int32_t e = st.h_pred_ids[static_cast<size_t>(l) * k + j];
    if (e >= 0 && e < c.n_expert && X.slot_of[e] < 0) guessed.push_back(e);
  }
  // The GPU's share takes the last host-resident slots of a token (gpu::RoutePublish's rule, mirrored
  // here), and the routing lists a token's choices most likely first, as the guess does: leave out those.
  if (X.gpu_share()) {
    const float share = static_cast<float>(e_.plan.host_experts_gpu_share);
    const int take = static_cast<int>(static_cast<float>(guessed.size()) * share + 0.25f);
    guessed.resize(guessed.size() - std::min<size_t>(guessed.size(), static_cast<size_t>(std::max(take, 0))));
  }
  std::vector<size_t> per_thread(static_cast<size_t>(pool.size()), 0);
  pool.run([&](int tid, int nth) {
    per_thread[tid] = cpu::prefetch_expert_slices(*X.host, guessed, tid, nth, [&] {
      return route.load(std::memory_order_acquire) == st.epoch;
    });
  });
  for (const size_t b : per_thread) *bytes += b;
  return guessed;
}

void MoeExecutor::combine(Step& s, int l, int nt, bool host_rows, const float* next_norm, float* xn, void* xq) {
  if (layers_[l].shared) return combine_shared(s, l, nt, host_rows, next_norm, xn, xq);
  Workspace& st = s.ws;
  const ModelConfig& c = e_.c;
  void* const stream = e_.stream;
  const GExperts& X = *layers_[l].experts;
  if (host_rows) {
    // The CPU's rows come straight from pinned memory into the combination, spread over the row;
    // then only the norm is left.
    gpu::handover_combine(st.flags_dev + l, st.epoch_dev, st.ey_slots_dev, st.ey, st.ey_host, st.ids, X.slot_of_dev,
                          c.n_expert, X.gpu_share() ? st.gpu_slots : nullptr, st.wts, c.n_expert_used, st.x, nt,
                          c.n_embd, stream, st.stamps_dev ? st.stamps_dev + 2 * l : nullptr);
    e_.prof.mark("host experts (GPU waits) + combine + residual", stream);
    if (xn) gpu::residual_norm(st.x, nullptr, nullptr, nullptr, 0, next_norm, xn, c.n_embd, nt, c.rms_eps, stream, xq);
  } else if (!st.ffn_out_combined) {
    gpu::residual_norm(st.x, nullptr, st.ey, st.wts, c.n_expert_used, next_norm, xn, c.n_embd, nt, c.rms_eps, stream,
                       xq);
  } else {
    gpu::residual_norm(st.x, st.y, nullptr, nullptr, 0, next_norm, xn, c.n_embd, nt, c.rms_eps, stream, xq,
                       folds_norm(l, nt) ? st.y_attn : nullptr);
  }
}

// With a shared expert, in the reference's order: y = the routed experts' combination (the same
// kernels as above, into a zeroed y instead of x where they add into x), y += ys * sigmoid(gate . x),
// then x += y and the next norm.
void MoeExecutor::combine_shared(Step& s, int l, int nt, bool host_rows, const float* next_norm, float* xn, void* xq) {
  Workspace& st = s.ws;
  const ModelConfig& c = e_.c;
  void* const stream = e_.stream;
  const MoeLayer& L = layers_[l];
  const GExperts& X = *L.experts;
  const int E = c.n_embd;
  const size_t row_bytes = sizeof(float) * static_cast<size_t>(nt) * E;
  if (host_rows) {
    gpu::memset_async(st.y, 0, row_bytes, stream);
    gpu::handover_combine(st.flags_dev + l, st.epoch_dev, st.ey_slots_dev, st.ey, st.ey_host, st.ids, X.slot_of_dev,
                          c.n_expert, X.gpu_share() ? st.gpu_slots : nullptr, st.wts, c.n_expert_used, st.y, nt, E,
                          stream, st.stamps_dev ? st.stamps_dev + 2 * l : nullptr);
    e_.prof.mark("host experts (GPU waits) + combine", stream);
  } else if (!st.ffn_out_combined) {
    gpu::memset_async(st.y, 0, row_bytes, stream);
    gpu::residual_norm(st.y, nullptr, st.ey, st.wts, c.n_expert_used, nullptr, nullptr, E, nt, c.rms_eps, stream);
  }
  const SharedExpert& S = *L.shared;
  const bool fused_gate = S.gate_inp.on_gpu() && S.gate_inp.dev.type == DType::F32;
  gpu::shared_expert_gate_add(st.y, st.sh_y, fused_gate ? reinterpret_cast<const float*>(S.gate_inp.dev.data) : nullptr,
                              fused_gate ? shared_in_ : nullptr, fused_gate ? nullptr : st.sh_logit, E, nt, stream);
  gpu::residual_norm(st.x, st.y, nullptr, nullptr, 0, next_norm, xn, E, nt, c.rms_eps, stream, xq);
  e_.prof.mark("shared expert gate + residual + norm", stream);
}

}  // namespace fitmoe::gpu
