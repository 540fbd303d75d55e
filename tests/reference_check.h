// Comparing fitmoe's logits and greedy tokens with the reference's (../shared/testdata), using the
// tolerances its README suggests per file type. Shared by every architecture's model tests.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "model/model.h"
#include "runtime/cpu_ops.h"
#include "runtime/session.h"
#include "testdata.h"

namespace fitmoe::test {

struct Tolerance {
  // Either every row <= max_row (float files) or p95/max bounds with a top-1 agreement (quantized).
  double max_row;
  double p95_row;           // < 0: not used
  double min_top1;          // fraction of rows whose argmax equals the reference's
  double argmax_margin;     // float files: argmax must match on rows whose ref margin exceeds this
  double greedy_margin;     // greedy tokens must match up to the first step with a margin below this
};

inline Tolerance tolerance_for(const std::string& type, const std::string& arch = "qwen3moe") {
  if (type == "f32") return {1e-3, -1, 0, 0.02, 0.05};
  if (type == "f16") return {3e-3, -1, 0, 0.02, 0.05};
  if (type == "bf16") return {1e-2, -1, 0, 0.05, 0.1};
  if (type == "q8_0") return {0.06, 0.03, 0.90, -1, 0.5};
  return {0.2, 0.05, 0.85, -1, 0.5};
}

inline double rel_l2(const float* a, const float* ref, int n) {
  double num = 0, den = 0;
  for (int i = 0; i < n; ++i) {
    double d = static_cast<double>(a[i]) - ref[i];
    num += d * d;
    den += static_cast<double>(ref[i]) * ref[i];
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

inline double margin(const float* x, int n) {
  float a = -INFINITY, b = -INFINITY;
  for (int i = 0; i < n; ++i) {
    if (x[i] > a) { b = a; a = x[i]; }
    else if (x[i] > b) b = x[i];
  }
  return a - b;
}

// The cache types of a flash-attention reference file's manifest key, "fa-kv<K>-<V>" (flash on).
inline KvCacheType fa_kv_type(const std::string& key) {
  const std::string kvs = key.substr(5);
  const size_t dash = kvs.find('-');
  KvCacheType kv{DType::F16, DType::F16, FlashAttn::On};
  EXPECT_TRUE(dash != std::string::npos && kv_type_from_name(kvs.substr(0, dash), &kv.k) &&
              kv_type_from_name(kvs.substr(dash + 1), &kv.v))
      << key;
  return kv;
}

// Evaluates the prompt in one batch and compares the stored rows; returns a summary string for logs.
inline std::string check_logits(const Model& model, const std::vector<int32_t>& prompt, int row0,
                                const std::vector<float>& ref, const Tolerance& tol, const std::string& label,
                                const KvCacheType& kv = {}) {
  const int n_vocab = model.config().n_vocab;
  const int rows = static_cast<int>(ref.size() / n_vocab);
  EXPECT_EQ(static_cast<size_t>(rows) * n_vocab, ref.size()) << label;
  SessionOptions so;
  so.n_threads = 2;
  so.n_ctx = static_cast<int>(prompt.size()) + 8;
  so.n_batch = static_cast<int>(prompt.size());
  so.kv = kv;
  Session s(model, so);
  auto logits = s.eval(prompt, static_cast<int>(prompt.size()));
  std::vector<double> errs;
  int top1 = 0;
  for (int r = 0; r < rows; ++r) {
    const float* mine = logits.data() + static_cast<size_t>(row0 + r) * n_vocab;
    const float* theirs = ref.data() + static_cast<size_t>(r) * n_vocab;
    errs.push_back(rel_l2(mine, theirs, n_vocab));
    const bool same = cpu::argmax(mine, n_vocab) == cpu::argmax(theirs, n_vocab);
    top1 += same;
    if (tol.argmax_margin > 0 && margin(theirs, n_vocab) > tol.argmax_margin) {
      EXPECT_TRUE(same) << label << ": argmax differs at row " << row0 + r;
    }
  }
  std::vector<double> sorted = errs;
  std::sort(sorted.begin(), sorted.end());
  const double worst = sorted.back();
  const double p95 = sorted[std::min(sorted.size() - 1, static_cast<size_t>(std::ceil(0.95 * sorted.size())) - 1)];
  EXPECT_LE(worst, tol.max_row) << label << ": worst row rel L2";
  if (tol.p95_row > 0) {
    EXPECT_LE(p95, tol.p95_row) << label << ": p95 row rel L2";
  }
  if (tol.min_top1 > 0) {
    EXPECT_GE(static_cast<double>(top1) / rows, tol.min_top1) << label << ": top-1 agreement";
  }
  char buf[160];
  std::snprintf(buf, sizeof buf, "%s: rows %d, median %.2e, p95 %.2e, worst %.2e, top1 %d/%d", label.c_str(), rows,
                sorted[sorted.size() / 2], p95, worst, top1, rows);
  return buf;
}

// Greedy generation: tokens must equal the reference's up to the first fragile step (margin below
// tol.greedy_margin), after which the reference itself is not reproducible.
inline void check_greedy(const Model& model, const nlohmann::json& g, const Tolerance& tol, const std::string& label) {
  std::vector<int32_t> prompt = g["prompt_ids"].get<std::vector<int32_t>>();
  std::vector<int32_t> want = g["tokens"].get<std::vector<int32_t>>();
  std::vector<double> margins = g["top1_minus_top2"].get<std::vector<double>>();
  SessionOptions so;
  so.n_threads = 2;
  so.n_ctx = static_cast<int>(prompt.size() + want.size()) + 8;
  so.n_batch = static_cast<int>(prompt.size());
  Session s(model, so);
  SamplerParams sp;
  sp.temperature = 0;
  Sampler sampler(sp);
  auto got = s.generate(prompt, static_cast<int>(want.size()), sampler);
  ASSERT_EQ(got.size(), want.size()) << label;
  size_t checked = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (margins[i] < tol.greedy_margin) break;
    EXPECT_EQ(got[i], want[i]) << label << ": greedy token " << i;
    if (got[i] != want[i]) break;
    ++checked;
  }
  ::testing::Test::RecordProperty(label + "_greedy_checked", static_cast<int>(checked));
}

}  // namespace fitmoe::test
