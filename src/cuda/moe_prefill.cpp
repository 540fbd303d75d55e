#include "cuda/moe_prefill.h"

#include <algorithm>
#include <climits>

#include "cuda/linear.h"
#include "runtime/error.h"
#include "runtime/thread_pool.h"

namespace fitmoe::gpu {

bool ExpertStreamer::has_host_experts() const {
  for (const MoeLayer& L : moe_.layers())
    if (L.experts && !L.experts->chunks.empty()) return true;
  return false;
}

void ExpertStreamer::start(Step& s, int nt) {
  Workspace& st = s.ws;
  const ModelConfig& c = e_.c;
  st.layer_streams.assign(c.n_layer, 0);
  st.layer_waits.assign(c.n_layer, 0);
  st.routed_layer = -1;
  st.stream_seq.clear();
  st.stream_copied = st.stream_used = 0;
  for (int l = 0; l < c.n_layer; ++l) {
    if (!moe_.moe(l) || moe_.layer(l).experts->chunks.empty()) continue;
    const GExperts& X = *moe_.layer(l).experts;
    const double per_expert = static_cast<double>(X.host->gate.matrix_bytes() + X.host->up.matrix_bytes() +
                                                  X.host->down.matrix_bytes());
    const HostExpertsCost cost = prefill_host_experts_cost(e_.plan.options, e_.plan.machine, nt, c.n_expert_used,
                                                           c.n_expert, c.n_expert - X.n_dev, per_expert);
    if (!cost.stream) continue;
    st.layer_streams[l] = 1;
    st.layer_waits[l] = cost.after_routing;
    for (size_t ci = 0; ci < X.chunks.size(); ++ci) st.stream_seq.emplace_back(l, static_cast<int>(ci));
  }
  issue_chunk_copies(s);
}

// Slots are grouped by expert on the host; every device-resident expert then runs in one grouped
// launch per matrix (gate+up with SwiGLU fused, then down, scattered back to the slots' rows). The
// host-resident experts run from the upload ring (start) or, for the layers the cost model gave to the
// CPU, on the CPU threads.
void ExpertStreamer::run(Step& s, int l, int nt, const MoeIo& io) {
  Workspace& st = s.ws;
  void* const stream = e_.stream;
  const ModelConfig& c = e_.c;
  const MoeLayer& L = moe_.layer(l);
  const int E = c.n_embd, k = c.n_expert_used, n_slots = nt * k, NE = c.n_expert;
  const int64_t ff = c.n_ff_exp;
  GExperts& X = *L.experts;
  st.ffn_out_combined = false;
  linear(s, *L.router, io.router_in, nt, st.rlogits, NE);
  gpu::route_topk(st.rlogits, nt, NE, k, st.ids, st.wts, stream);
  gpu::copy_d2h(st.h_ids, st.ids, sizeof(int32_t) * n_slots, stream);
  gpu::sync_stream(stream);

  // Group by expert: offsets, the token of each grouped slot, and the router slot it came from.
  std::vector<int32_t> count(NE + 1, 0);
  for (int j = 0; j < n_slots; ++j) {
    const int e = st.h_ids[j];
    if (e < 0 || e >= NE) throw Error(no_expert_message(e));
    count[e + 1]++;
  }
  int32_t* h_off = st.h_idx;                 // [NE + 1]
  int32_t* h_rows = st.h_idx + NE + 1;       // [n_slots]
  int32_t* h_dst = h_rows + n_slots;         // [n_slots]
  h_off[0] = 0;
  for (int e = 0; e < NE; ++e) h_off[e + 1] = h_off[e] + count[e + 1];
  {
    std::vector<int32_t> fill(h_off, h_off + NE);
    for (int j = 0; j < n_slots; ++j) {
      const int i = fill[st.h_ids[j]]++;
      h_rows[i] = j / k;
      h_dst[i] = j;
    }
  }
  // From now on, copies of this layer's chunks carry only the experts used.
  st.routed_layer = l;
  st.expert_used.assign(NE, 0);
  for (int e = 0; e < NE; ++e) st.expert_used[e] = count[e + 1] > 0;
  gpu::copy_h2d(st.offsets, h_off, sizeof(int32_t) * (NE + 1), stream);
  gpu::copy_h2d(st.idx_a, h_rows, sizeof(int32_t) * n_slots, stream);
  gpu::copy_h2d(st.idx_b, h_dst, sizeof(int32_t) * n_slots, stream);

  const float* xr = rounded_input(s, io.expert_in, nt, X.gate.type);
  if (X.n_dev > 0) {
    // (Mixed gate/up types: the elementwise SwiGLU then runs over all slots; host experts' rows are
    // recomputed from scratch below, so that is harmless.)
    gate_up(s, io.expert_in, xr, nt, X.gate, X.up, X.slot_of_dev, n_slots, 0, n_slots);
    round_rows(st.g, 0, n_slots, X.down.type);
    gpu::moe_matmul(X.down, st.offsets, NE, X.slot_of_dev, st.g, ff, nullptr, n_slots, st.ey, E, stream, st.idx_b);
  }

  // Host-resident experts: streamed chunks (already on their way), or the CPU for the ones used.
  if (!X.chunks.empty()) {
    if (st.layer_streams[l]) {
      run_streamed_chunks(s, io.expert_in, xr, nt, X, l, h_off);
    } else {
      std::vector<int> host_used;
      for (int e = 0; e < NE; ++e)
        if (X.slot_of[e] < 0 && count[e + 1] > 0) host_used.push_back(e);
      if (!host_used.empty()) host_experts_on_cpu(s, io.expert_in, X, host_used, h_off, h_rows, h_dst, nt);
    }
  }
  // No sync here: the pinned routing tables are rewritten only after the next layer's routing sync.
  // The outputs stay per slot in st.ey; MoeExecutor::combine combines them.
}

// x's nt rows rounded for a weight type's products (gpu::round_acts: the reference's 8-bit rounding
// of the activations that its integer products see; the grouped products round them to f16 after
// that, as gpu::matmul does), in the dequantization scratch, which no grouped product uses. x itself
// for weights whose activations are not 8-bit.
const float* ExpertStreamer::rounded_input(Step& s, const float* x, int nt, DType weight_type) {
  Workspace& st = s.ws;
  const DType act = dtype_info(weight_type).act_type;
  if (!gpu::rounds_acts(act)) return x;
  const int E = e_.c.n_embd;
  if (static_cast<size_t>(nt) * E * sizeof(float) > st.dequant_bytes)
    throw Error("internal: the dequantization scratch cannot hold the experts' rounded input");
  auto* xr = static_cast<float*>(st.dequant);
  gpu::round_acts(act, x, E, nt, E, xr, E, e_.stream);
  return xr;
}

// Rows [row0, row0 + n_rows) of the experts' hidden rows h (n_ff_exp wide) rounded in place for the
// down products of weight_type (they are read by those only).
void ExpertStreamer::round_rows(float* h, int row0, int n_rows, DType weight_type) {
  const DType act = dtype_info(weight_type).act_type;
  if (n_rows <= 0 || !gpu::rounds_acts(act)) return;
  const int64_t ff = e_.c.n_ff_exp;
  float* rows = h + static_cast<int64_t>(row0) * ff;
  gpu::round_acts(act, rows, ff, n_rows, ff, rows, ff, e_.stream);
}

// h = silu(gate x) * (up x) for the grouped slots of the experts `slot_of` selects, from xr (x rounded
// for the gate's type). One fused launch when gate and up share a type; else two products and an
// elementwise SwiGLU over the rows [row0, row0 + n_rows) that these experts own.
void ExpertStreamer::gate_up(Step& s, const float* x, const float* xr, int nt, const DevMatrix& g3,
                             const DevMatrix& u3, const int32_t* slot_of, int n_slots, int row0, int n_rows) {
  Workspace& st = s.ws;
  void* const stream = e_.stream;
  const int NE = e_.c.n_expert, E = e_.c.n_embd;
  const int64_t ff = e_.c.n_ff_exp;
  if (g3.type == u3.type) {
    gpu::moe_matmul_swiglu(g3, u3, st.offsets, NE, slot_of, xr, E, st.idx_a, n_slots, st.g, ff, stream);
    return;
  }
  gpu::moe_matmul(g3, st.offsets, NE, slot_of, xr, E, st.idx_a, n_slots, st.g, ff, stream);
  if (dtype_info(u3.type).act_type == dtype_info(g3.type).act_type) {
    gpu::moe_matmul(u3, st.offsets, NE, slot_of, xr, E, st.idx_a, n_slots, st.u, ff, stream);
  } else {  // (the scratch is rounded for up, then again for the gate's next chunk: stream order)
    gpu::moe_matmul(u3, st.offsets, NE, slot_of, rounded_input(s, x, nt, u3.type), E, st.idx_a, n_slots, st.u, ff,
                    stream);
    rounded_input(s, x, nt, g3.type);
  }
  gpu::swiglu(st.g + static_cast<int64_t>(row0) * ff, st.u + static_cast<int64_t>(row0) * ff,
              st.g + static_cast<int64_t>(row0) * ff, static_cast<int64_t>(n_rows) * ff, stream);
}

void ExpertStreamer::host_experts_on_cpu(Step& s, const float* x, GExperts& X, const std::vector<int>& used,
                                         const int32_t* h_off, const int32_t* h_rows, const int32_t* h_dst, int nt) {
  Workspace& st = s.ws;
  void* const stream = e_.stream;
  const int E = e_.c.n_embd;
  gpu::copy_d2h(st.h_xn, x, sizeof(float) * nt * E, stream);
  gpu::sync_stream(stream);
  std::vector<int32_t> tok, exp, slot;
  for (int e : used)
    for (int i = h_off[e]; i < h_off[e + 1]; ++i) tok.push_back(h_rows[i]), exp.push_back(e), slot.push_back(h_dst[i]);
  cpu::expert_ffn(s.pool, *X.host, st.h_xn, nt, E, tok.data(), exp.data(), static_cast<int>(tok.size()), st.h_ey,
                  st.cpu_scratch);
  for (size_t i = 0; i < slot.size(); ++i)
    gpu::copy_h2d(st.ey + static_cast<int64_t>(slot[i]) * E, st.h_ey + i * E, sizeof(float) * E, stream);
}

// Issues the stream's next copies while the ring has a free buffer (chunk i reuses the buffer of
// chunk i - kPrefillStageSlots, so that one must have been consumed) and the next chunk's layer does
// not wait for a routing still unknown.
void ExpertStreamer::issue_chunk_copies(Step& s) {
  Workspace& st = s.ws;
  while (st.stream_copied < st.stream_seq.size() &&
         st.stream_copied < st.stream_used + static_cast<size_t>(kPrefillStageSlots)) {
    const int l = st.stream_seq[st.stream_copied].first;
    if (st.layer_waits[l] && st.routed_layer != l) return;
    issue_chunk_copy(s);
  }
}

// Uploads the next chunk of the stream into its ring buffer, once the products that last read that
// buffer are done: every expert of the chunk, or once the layer's routing is known only the used
// ones (each at its place in the chunk, so the chunk's expert -> position table still holds). The
// plan keeps a layer's host experts contiguous, so a chunk is usually one run of consecutive
// experts: one copy per matrix.
void ExpertStreamer::issue_chunk_copy(Step& s) {
  Workspace& st = s.ws;
  const int chunk_experts = e_.chunk_experts;
  const size_t i = st.stream_copied++;
  const int b = static_cast<int>(i % kPrefillStageSlots);
  const auto [l, ci] = st.stream_seq[i];
  const GExperts& X = *moe_.layer(l).experts;
  const HostChunk& ch = X.chunks[ci];
  const Weight &hg = X.host->gate, &hu = X.host->up, &hd = X.host->down;
  const size_t bg = hg.matrix_bytes(), bu = hu.matrix_bytes(), bd = hd.matrix_bytes();
  auto* base = static_cast<uint8_t*>(st.stage[b]);
  gpu::wait_event(st.copy_stream, st.ev_free[b]);
  const int cnt = static_cast<int>(ch.experts.size());
  const bool routed = st.routed_layer == l;
  auto wanted = [&](int p) { return !routed || st.expert_used[ch.experts[p]]; };
  for (int p = 0; p < cnt;) {
    if (!wanted(p)) {
      ++p;
      continue;
    }
    int run = 1;
    while (p + run < cnt && ch.experts[p + run] == ch.experts[p] + run && wanted(p + run)) ++run;
    const int e = ch.experts[p];
    gpu::copy_h2d(base + bg * p, hg.expert(e).host, bg * run, st.copy_stream);
    gpu::copy_h2d(base + bg * chunk_experts + bu * p, hu.expert(e).host, bu * run, st.copy_stream);
    gpu::copy_h2d(base + (bg + bu) * chunk_experts + bd * p, hd.expert(e).host, bd * run, st.copy_stream);
    p += run;
  }
  gpu::record_event(st.ev_filled[b], st.copy_stream);
}

// The streamed chunks of layer l, in order: wait for a chunk's upload, run its experts' grouped
// products (skipped when the batch routed nothing to them), free the buffer, release the next copy.
void ExpertStreamer::run_streamed_chunks(Step& s, const float* x, const float* xr, int nt, GExperts& X, int l,
                                         const int32_t* h_off) {
  Workspace& st = s.ws;
  void* const stream = e_.stream;
  const int chunk_experts = e_.chunk_experts;
  const int NE = e_.c.n_expert, E = e_.c.n_embd;
  const int64_t ff = e_.c.n_ff_exp;
  const Weight &hg = X.host->gate, &hu = X.host->up, &hd = X.host->down;
  const size_t bg = hg.matrix_bytes(), bu = hu.matrix_bytes();
  issue_chunk_copies(s);  // a layer that waited for its routing starts its copies now
  for (size_t ci = 0; ci < X.chunks.size(); ++ci) {
    const size_t i = st.stream_used++;
    if (i >= st.stream_seq.size() || st.stream_seq[i] != std::make_pair(l, static_cast<int>(ci)))
      throw Error("internal: the prefill expert stream is out of order");
    if (i >= st.stream_copied) throw Error("internal: the prefill expert stream stalled");
    const int b = static_cast<int>(i % kPrefillStageSlots);
    const HostChunk& ch = X.chunks[ci];
    int chunk_slots = 0, lo = INT32_MAX, hi = 0;
    for (int e : ch.experts) {
      chunk_slots += h_off[e + 1] - h_off[e];
      if (h_off[e + 1] > h_off[e]) lo = std::min(lo, h_off[e]), hi = std::max(hi, h_off[e + 1]);
    }
    gpu::wait_event(stream, st.ev_filled[b]);
    if (chunk_slots > 0) {
      auto* base = static_cast<uint8_t*>(st.stage[b]);
      DevMatrix g3 = matrix_view(hg, base), u3 = matrix_view(hu, base + bg * chunk_experts),
                d3 = matrix_view(hd, base + (bg + bu) * chunk_experts);
      g3.n_mats = u3.n_mats = d3.n_mats = static_cast<int>(ch.experts.size());
      // (With mixed gate/up types, SwiGLU covers the grouped rows from the chunk's first used expert
      // to its last.)
      gate_up(s, x, xr, nt, g3, u3, ch.slot_of_dev, chunk_slots, lo, hi - lo);
      round_rows(st.g, lo, hi - lo, d3.type);
      gpu::moe_matmul(d3, st.offsets, NE, ch.slot_of_dev, st.g, ff, nullptr, chunk_slots, st.ey, E, stream, st.idx_b);
    }
    gpu::record_event(st.ev_free[b], stream);
    issue_chunk_copies(s);
  }
}

}  // namespace fitmoe::gpu
