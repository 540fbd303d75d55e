#include "cuda/profile.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "cuda/device.h"
#include "cuda/gpu_ops.h"

namespace fitmoe::gpu {

OpProfile::OpProfile() : on_(std::getenv("FITMOE_PROFILE") != nullptr) {}

OpProfile::~OpProfile() {
  if (decode_.steps > 0) report("decode", decode_);
  if (prefill_table_.steps > 0) report("prefill", prefill_table_);
  for (void* e : events_) gpu::destroy_event(e);
}

void OpProfile::begin(void* stream, int n_tokens) {
  if (!on_) return;
  prefill_ = n_tokens > gpu::kMaxVecTokens;
  Table& t = prefill_ ? prefill_table_ : decode_;
  t.max_tokens = std::max(t.max_tokens, n_tokens);
  gpu::busy_wait(kBusyMs * 1000, stream);  // longer than the host needs to queue a step
  t_begin_ = std::chrono::steady_clock::now();
  n_ = 0;
  names_.clear();
  active_ = true;
  mark("", stream);
}

void OpProfile::record(const char* name, void* stream) {
  if (n_ == events_.size()) events_.push_back(gpu::create_timing_event());
  gpu::record_event(events_[n_++], stream);
  names_.push_back(name);
}

void OpProfile::end(void* stream) {
  if (!active_) return;
  active_ = false;
  queue_ms_ = std::max(queue_ms_, std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t_begin_).count());
  gpu::sync_stream(stream);
  Table& t = prefill_ ? prefill_table_ : decode_;
  for (size_t i = 1; i < n_; ++i) {
    auto& [ms, calls] = t.totals[names_[i]];
    ms += gpu::elapsed_ms(events_[i - 1], events_[i]);
    ++calls;
  }
  ++t.steps;
}

void OpProfile::report(const char* what, const Table& t) const {
  double total = 0;
  for (const auto& [name, v] : t.totals) total += v.first;
  std::vector<std::pair<double, std::string>> rows;
  for (const auto& [name, v] : t.totals) rows.emplace_back(v.first, name);
  std::sort(rows.rbegin(), rows.rend());
  const int steps_ = t.steps;
  std::fprintf(stderr, "\nGPU op profile (%s), %d steps of up to %d tokens (FITMOE_PROFILE): %.1f us per step\n", what,
               steps_, t.max_tokens, 1000.0 * total / steps_);
  std::fprintf(stderr, "  (the host queued a step in at most %.1f ms; over %d ms the times include launch gaps)\n", queue_ms_,
               kBusyMs);
  std::fprintf(stderr, "  %-34s %10s %8s %7s\n", "op", "us/step", "calls", "share");
  for (const auto& [ms, name] : rows)
    std::fprintf(stderr, "  %-34s %10.1f %8.1f %6.1f%%\n", name.c_str(), 1000.0 * ms / steps_,
                 static_cast<double>(t.totals.at(name).second) / steps_, 100.0 * ms / total);
}

HostProfile::HostProfile() : on(std::getenv("FITMOE_HOST_PROFILE") != nullptr) {}

void HostProfile::add(std::chrono::steady_clock::duration wait, std::chrono::steady_clock::duration experts, double b) {
  wait_s += std::chrono::duration<double>(wait).count();
  experts_s += std::chrono::duration<double>(experts).count();
  bytes += b;
  ++layers;
}

void HostProfile::add_step(const unsigned long long* stamps, const std::vector<int>& hybrid_layers) {
  for (size_t i = 0; i + 1 < hybrid_layers.size(); ++i) {
    const int a = hybrid_layers[i], b = hybrid_layers[i + 1];
    const double seen_a = static_cast<double>(stamps[2 * a]), pub_b = static_cast<double>(stamps[2 * b + 1]),
                 seen_b = static_cast<double>(stamps[2 * b]);
    if (!(seen_a > 0 && pub_b >= seen_a && seen_b >= pub_b)) continue;  // (a stamp this step did not write)
    gpu_ns += pub_b - seen_a;
    period_ns += seen_b - seen_a;
    ++gpu_n;
  }
}

void HostProfile::report() const {
  if (!on || !layers) return;
  std::fprintf(stderr,
               "\nhost experts (FITMOE_HOST_PROFILE): %ld hybrid layer steps; per layer %.1f us waiting for the GPU's "
               "routing, %.1f us in the experts (%.2f MB: %.1f GB/s)\n",
               layers, 1e6 * wait_s / layers, 1e6 * experts_s / layers, bytes / layers / 1e6,
               experts_s > 0 ? bytes / experts_s / 1e9 : 0.0);
  if (gpu_n)
    std::fprintf(stderr,
                 "GPU clock: %.1f us per hybrid layer, of which %.1f us from the hand-over to the next routing "
                 "published, %.1f us from that to the next hand-over (routing to the CPU, its experts, rows back)\n",
                 period_ns / gpu_n / 1e3, gpu_ns / gpu_n / 1e3, (period_ns - gpu_ns) / gpu_n / 1e3);
}

}  // namespace fitmoe::gpu
