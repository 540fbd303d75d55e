// Weights as the GPU forward passes see them, and their upload at load: every tensor the plan put on
// the GPU gets a device copy through the accountant; the rest stays host-resident (computed on the
// CPU, or read over the bus). Routed experts: the device-resident ones packed into a stack by slot
// with an expert -> slot table, the host-resident ones in chunks for prefill streaming, and (decode's
// GPU share of the host experts) views of the pinned host copy.
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

#include "cuda/engine.h"
#include "cuda/gpu_ops.h"
#include "runtime/cpu_ops.h"

namespace fitmoe::gpu {

// A weight as the GPU pass uses it: a device copy, or (placed on the host) the host Weight.
struct GWeight {
  DevMatrix dev;          // dev.data == nullptr: host-resident
  const Weight* host = nullptr;
  bool on_gpu() const { return dev.data != nullptr; }
};

// A chunk of up to PlanOptions::prefill_chunk_experts host-resident experts of one layer, streamed to the GPU as a
// unit during prefill; slot_of_dev maps expert -> position in the chunk (-1: not in it).
struct HostChunk {
  std::vector<int> experts;
  int32_t* slot_of_dev = nullptr;
};

struct GExperts {
  DevMatrix gate, up, down;        // the device-resident experts, packed by slot
  std::vector<int32_t> slot_of;    // expert -> slot, -1 = host
  int32_t* slot_of_dev = nullptr;
  bool identity = false;           // every expert on the device, slot = expert id
  // The slot map the decode kernels take: none when it is the identity, which saves each of them a
  // dependent read (expert id -> slot) before its weights (and lets the down kernel hint its rows
  // early). Measured on the H200, all-GPU decode: with the map 394.5 / 396.8 tok/s, without it (and
  // without the hint) 398.5 / 399.6.
  const int32_t* decode_slot_of() const { return identity ? nullptr : slot_of_dev; }
  int n_dev = 0;
  const cpu::ExpertWeights* host = nullptr;
  std::vector<HostChunk> chunks;   // the host-resident experts, in id order
  // Decode's GPU share of the host experts: all of them as the GPU sees the pinned host copy (data
  // null: no share for this layer).
  DevMatrix host_gate, host_up, host_down;
  bool gpu_share() const { return host_gate.data != nullptr; }
  // Bytes of one expert's three matrices (as the host holds them).
  size_t expert_bytes() const {
    return host->gate.matrix_bytes() + host->up.matrix_bytes() + host->down.matrix_bytes();
  }
};

DevMatrix matrix_view(const Weight& w, const uint8_t* data);

// Uploads what the plan put on the GPU, queued on e.stream (the caller syncs before the host sources
// may change). place: a matrix (host-resident when the plan says so); upload_norm: a 1-D f32 tensor
// (always uploaded; null for an absent one); upload_experts: a layer's routed experts as above, with
// `tick` told the bytes of each packed matrix (load progress).
GWeight place(Engine& e, const Weight& w);
const float* upload_norm(Engine& e, const Weight& w);
void upload_experts(Engine& e, const cpu::ExpertWeights& host, GExperts& X, const std::function<void(uint64_t)>& tick);

}  // namespace fitmoe::gpu
