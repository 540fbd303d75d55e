// The GPU engine's measuring aids (not on any result's path):
// - OpProfile (FITMOE_PROFILE=1): where a step's GPU time goes, per op (decode and prefill apart);
// - HostProfile (FITMOE_HOST_PROFILE=1): the CPU side of hybrid decode and the GPU's clock stamps.
#pragma once
#include <chrono>
#include <map>
#include <string>
#include <vector>

namespace fitmoe::gpu {

// Where a step's GPU time goes (FITMOE_PROFILE=1): graphs are off, each profiled step is queued behind
// a busy-wait so the GPU runs it back to back, and an event after every op gives the op's own time.
// Printed per op name (mean per step) to stderr when the model is unloaded, decode-sized steps (up to
// gpu::kMaxVecTokens tokens) and prefill micro-batches in two tables. A prefill step that syncs with
// the host (host experts) counts the host's part in the op that waited.
class OpProfile {
 public:
  OpProfile();
  ~OpProfile();
  bool on() const { return on_; }
  void begin(void* stream, int n_tokens);
  // The op that just ended on `stream` (the time since the previous mark).
  void mark(const char* name, void* stream) {
    if (active_) record(name, stream);
  }
  void end(void* stream);

 private:
  void record(const char* name, void* stream);
  struct Table {
    int steps = 0, max_tokens = 0;
    std::map<std::string, std::pair<double, int>> totals;
  };
  void report(const char* what, const Table& t) const;
  static constexpr int kBusyMs = 30;
  bool on_, active_ = false;
  bool prefill_ = false;
  std::chrono::steady_clock::time_point t_begin_;
  double queue_ms_ = 0;
  std::vector<void*> events_;
  std::vector<const char*> names_;
  size_t n_ = 0;
  Table decode_, prefill_table_;
};

// FITMOE_HOST_PROFILE=1: the CPU side of hybrid decode (graphs stay on): per hybrid layer, the time
// spent waiting for the GPU's routing and in the experts, and the bandwidth the experts reached.
// With it, the GPU also stamps (with its own clock) when it sees each hybrid layer's hand-over and
// when it publishes each routing: from one hybrid layer's hand-over to the next one's routing is the
// GPU's part of the critical path; the rest of the period is the routing's way to the CPU, the CPU's
// experts and their rows' way back.
struct HostProfile {
  HostProfile();
  bool on;
  double wait_s = 0, experts_s = 0, bytes = 0;
  long layers = 0;
  double gpu_ns = 0, period_ns = 0;
  long gpu_n = 0;
  void add(std::chrono::steady_clock::duration wait, std::chrono::steady_clock::duration experts, double b);
  // After a decode step: stamps[2l] (hand-over of layer l seen), stamps[2l+1] (routing of l published).
  void add_step(const unsigned long long* stamps, const std::vector<int>& hybrid_layers);
  void report() const;
};

}  // namespace fitmoe::gpu
