#include "cuda/residency.h"

#include <algorithm>

namespace fitmoe::gpu {

DevMatrix matrix_view(const Weight& w, const uint8_t* data) {
  DevMatrix m;
  m.type = w.type;
  m.cols = w.ne[0];
  m.rows = w.ne[1];
  m.n_mats = w.ne[2];
  m.row_bytes = w.row_bytes;
  m.mat_bytes = w.row_bytes * static_cast<size_t>(w.ne[1]);
  m.data = data;
  return m;
}

GWeight place(Engine& e, const Weight& w) {
  GWeight g;
  g.host = &w;
  if (!w) return g;
  const TensorPlacement* tp = e.plan.find(w.info->name);
  if (tp && tp->on_gpu) g.dev = matrix_view(w, e.upload(w.host, w.matrix_bytes() * w.ne[2], "weights"));
  return g;
}

const float* upload_norm(Engine& e, const Weight& w) {
  return w ? reinterpret_cast<const float*>(e.upload(w.host, w.matrix_bytes(), "weights")) : nullptr;
}

void upload_experts(Engine& eng, const cpu::ExpertWeights& host, GExperts& X, const std::function<void(uint64_t)>& tick) {
  const ModelConfig& c = eng.c;
  X.host = &host;
  const TensorPlacement* tp = eng.plan.find(host.gate.info->name);
  const int E = c.n_expert;
  X.slot_of.assign(E, -1);
  for (int e = 0; e < E; ++e)
    if (tp && !tp->expert_on_gpu.empty() && tp->expert_on_gpu[e]) X.slot_of[e] = X.n_dev++;
  auto pack = [&](const Weight& w3) {
    DevMatrix m = matrix_view(w3, nullptr);
    m.n_mats = X.n_dev;
    if (X.n_dev == 0) return m;
    auto* d = static_cast<uint8_t*>(eng.mem.alloc(m.mat_bytes * X.n_dev, "routed experts"));
    // Runs of consecutive experts in consecutive slots go up as one copy (the plan keeps a
    // layer's device experts together, so usually one copy per matrix).
    for (int e = 0; e < E;) {
      if (X.slot_of[e] < 0) {
        ++e;
        continue;
      }
      int run = 1;
      while (e + run < E && X.slot_of[e + run] == X.slot_of[e] + run) ++run;
      gpu::copy_h2d(d + m.mat_bytes * X.slot_of[e], w3.expert(e).host, m.mat_bytes * run, eng.stream);
      e += run;
    }
    m.data = d;
    tick(m.mat_bytes * X.n_dev);
    return m;
  };
  X.gate = pack(host.gate);
  X.up = pack(host.up);
  X.down = pack(host.down);
  X.slot_of_dev = reinterpret_cast<int32_t*>(eng.upload(X.slot_of.data(), sizeof(int32_t) * E, "routing tables"));
  X.identity = true;
  for (int e = 0; e < E; ++e) X.identity = X.identity && X.slot_of[e] == e;
  // The GPU's share of decode's host experts reads them in place (the weights are in pinned memory),
  // where a token is expected to give the GPU at least one expert (see gpu::RoutePublish) and the
  // kernels take the weights as they lie.
  const Weight &hg = host.gate, &hu = host.up, &hd = host.down;
  if (host_experts_share_taken(eng.plan.host_experts_gpu_share, c.n_expert_used, E - X.n_dev, E) > 0 &&
      hg.type == hu.type && !is_float_type(hg.type) && !is_float_type(hd.type)) {
    auto view = [](const Weight& w) {
      return matrix_view(w, static_cast<const uint8_t*>(gpu::device_view(const_cast<uint8_t*>(w.host))));
    };
    const DevMatrix vg = view(hg), vu = view(hu), vd = view(hd);
    if (gpu::matvec_weight_ok(vg) && gpu::matvec_weight_ok(vu) && gpu::matvec_weight_ok(vd)) {
      X.host_gate = vg;
      X.host_up = vu;
      X.host_down = vd;
    }
  }
  // Host experts in chunks for prefill streaming, each with its expert -> position table.
  const size_t chunk_experts = static_cast<size_t>(eng.chunk_experts);
  std::vector<int> host_ids;
  for (int e = 0; e < E; ++e)
    if (X.slot_of[e] < 0) host_ids.push_back(e);
  for (size_t i = 0; i < host_ids.size(); i += chunk_experts) {
    HostChunk ch;
    ch.experts.assign(host_ids.begin() + static_cast<long>(i),
                      host_ids.begin() + static_cast<long>(std::min(host_ids.size(), i + chunk_experts)));
    std::vector<int32_t> pos(E, -1);
    for (size_t p = 0; p < ch.experts.size(); ++p) pos[ch.experts[p]] = static_cast<int32_t>(p);
    ch.slot_of_dev = reinterpret_cast<int32_t*>(eng.upload(pos.data(), sizeof(int32_t) * E, "routing tables"));
    X.chunks.push_back(std::move(ch));
  }
}

}  // namespace fitmoe::gpu
