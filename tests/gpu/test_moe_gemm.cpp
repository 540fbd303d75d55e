// Grouped expert products (gpu::moe_matmul, gpu::moe_matmul_swiglu; src/cuda/moe_gemm.cu) against a
// double-precision product of the operands as the GPU multiplies them: weights decoded by
// quant::dequantize_row_ref and rounded to f16 (bf16 / f32 for BF16 / F32 weights), activations rounded
// the same way. Every kernel variant (tensor-core tiles of 64 and 128 tokens, the CUDA-core kernel,
// the automatic choice), experts with no tokens, experts in host memory (slot_of -1), gathered and
// direct activation rows, strided x and y. Outputs are poisoned (NaN bytes) first: rows of skipped
// experts, slots outside every expert's range and columns past the matrix rows must stay untouched.
// Skipped (not failed) when the machine has no CUDA device. A DISABLED_ benchmark at the end times
// Qwen3-30B-A3B-shaped layers (--gtest_also_run_disabled_tests --gtest_filter=*MoeGemmBench*).
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "cuda/gpu_ops.h"
#include "gpu/gpu_test_util.h"
#include "quant/dtype.h"
#include "quant/kernels.h"
#include "runtime/error.h"

namespace fitmoe::gpu {
namespace {

using namespace test;

class MoeGemm : public GpuTest {};

// The operands as the GPU multiplies them.
float round_op(DType t, float v) {
  if (t == DType::F32) return v;
  if (t == DType::BF16) return bf16_to_f32(f32_to_bf16(v));
  return f16_to_f32(f32_to_f16(v));
}

// Matrix m decoded and rounded: rows x cols floats.
std::vector<float> decoded(const HostMatrix& h, int64_t m) {
  std::vector<float> out(static_cast<size_t>(h.rows * h.cols));
  for (int64_t r = 0; r < h.rows; ++r) {
    float* o = out.data() + r * h.cols;
    quant::dequantize_row_ref(h.type, h.data.data() + (m * h.rows + r) * h.rb, o, h.cols);
    for (int64_t i = 0; i < h.cols; ++i) o[i] = round_op(h.type, o[i]);
  }
  return out;
}

// One grouped product: experts, their slot counts and placement, the activation layout.
struct Problem {
  DType type = DType::Q4_K;
  int64_t rows = 100, cols = 512;
  int n_mats = 4;                  // device matrices
  std::vector<int32_t> slot_of;    // expert -> matrix (-1: host); empty: no slot_of (matrix = expert)
  std::vector<int> counts;         // slots per expert
  int first_slot = 0;              // offsets[0]
  int extra_slots = 0;             // slots (y rows) past offsets[n_experts]
  int grid_slots = -1;             // n_slots_max passed (>= the slots of the experts that run); -1: all
  bool gather = true;              // x rows through `rows` (random tokens), else slot i reads x row i
  bool scatter = false;            // outputs through `y_rows` (a random permutation of the slots)
  int n_tokens = 64;               // x rows when gathering
  int64_t ld_x_pad = 4, ld_y_pad = 3;
  int row_stride = 1;              // check every row_stride-th row (plus the first and last 32)
  uint64_t seed = 1;
};

struct Expected {
  std::vector<int> expert_of;    // slot -> expert, -1 outside every range
  std::vector<char> computed;    // slot has a device matrix
  std::vector<double> v, tol;    // [slot][row] (checked rows only)
};

bool row_checked(const Problem& p, int64_t r) {
  return r % p.row_stride == 0 || r < 32 || r >= p.rows - 32;
}

void run_problem(MoeGemm* fx, const Problem& p, bool fused, const std::vector<int>& tiles) {
  SCOPED_TRACE(std::string(dtype_name(p.type)) + (fused ? " swiglu" : "") + " rows=" + std::to_string(p.rows) +
               " cols=" + std::to_string(p.cols));
  const int n_experts = static_cast<int>(p.counts.size());
  std::vector<int32_t> offsets(n_experts + 1);
  offsets[0] = p.first_slot;
  for (int e = 0; e < n_experts; ++e) offsets[e + 1] = offsets[e] + p.counts[e];
  const int n_slots_max = offsets[n_experts] + p.extra_slots;  // y rows
  const int n_slots_arg = p.grid_slots >= 0 ? p.grid_slots : n_slots_max;
  const int n_x = p.gather ? p.n_tokens : n_slots_max;
  const int64_t ld_x = p.cols + p.ld_x_pad, ld_y = p.rows + p.ld_y_pad;

  HostMatrix g = random_matrix(p.type, p.rows, p.cols, p.n_mats, p.seed);
  HostMatrix u = fused ? random_matrix(p.type, p.rows, p.cols, p.n_mats, p.seed + 77) : HostMatrix{};
  std::vector<float> x = randn(static_cast<size_t>(ld_x) * n_x, p.seed + 1);
  std::vector<int32_t> rows(static_cast<size_t>(std::max(n_slots_max, 1)), 0);
  std::mt19937 rng(static_cast<uint32_t>(p.seed + 2));
  for (auto& r : rows) r = static_cast<int32_t>(rng() % static_cast<uint32_t>(n_x));
  // y_rows: output row of each slot; out_slot: its inverse
  std::vector<int32_t> y_rows(static_cast<size_t>(std::max(n_slots_max, 1)));
  for (int i = 0; i < n_slots_max; ++i) y_rows[i] = i;
  if (p.scatter) std::shuffle(y_rows.begin(), y_rows.begin() + n_slots_max, rng);
  std::vector<int> out_slot(static_cast<size_t>(n_slots_max));
  for (int i = 0; i < n_slots_max; ++i) out_slot[y_rows[i]] = i;

  // Expected values, once for all kernel variants.
  Expected ex;
  ex.expert_of.assign(n_slots_max, -1);
  ex.computed.assign(n_slots_max, 0);
  ex.v.assign(static_cast<size_t>(n_slots_max) * p.rows, 0.0);
  ex.tol.assign(static_cast<size_t>(n_slots_max) * p.rows, 0.0);
  const double rel = p.type == DType::F32 ? 1e-5 : 2e-4;
  std::vector<float> xr(static_cast<size_t>(p.cols));
  for (int e = 0; e < n_experts; ++e) {
    const int m = p.slot_of.empty() ? e : p.slot_of[e];
    for (int i = offsets[e]; i < offsets[e + 1]; ++i) ex.expert_of[i] = e;
    if (m < 0 || p.counts[e] == 0) continue;
    const std::vector<float> wg = decoded(g, m);
    const std::vector<float> wu = fused ? decoded(u, m) : std::vector<float>();
    for (int i = offsets[e]; i < offsets[e + 1]; ++i) {
      ex.computed[i] = 1;
      const float* xs = x.data() + static_cast<int64_t>(p.gather ? rows[i] : i) * ld_x;
      for (int64_t k = 0; k < p.cols; ++k) xr[k] = round_op(p.type, xs[k]);
      for (int64_t r = 0; r < p.rows; ++r) {
        if (!row_checked(p, r)) continue;
        double dg = 0, sg = 0, du = 0, su = 0;
        const float* a = wg.data() + r * p.cols;
        for (int64_t k = 0; k < p.cols; ++k) {
          const double t = static_cast<double>(a[k]) * xr[k];
          dg += t;
          sg += std::fabs(t);
        }
        const size_t o = static_cast<size_t>(i) * p.rows + r;
        if (!fused) {
          ex.v[o] = dg;
          ex.tol[o] = rel * sg + 1e-30;
          continue;
        }
        const float* b = wu.data() + r * p.cols;
        for (int64_t k = 0; k < p.cols; ++k) {
          const double t = static_cast<double>(b[k]) * xr[k];
          du += t;
          su += std::fabs(t);
        }
        const double silu = dg / (1.0 + std::exp(-dg));
        const double tg = rel * sg, tu = rel * su;
        ex.v[o] = silu * du;
        // |d silu / dg| <= 1.1; expf and the f32 division and product: a few ulps of the result
        ex.tol[o] = 1.1 * std::fabs(du) * tg + std::fabs(silu) * tu + 1.1 * tg * tu + 1e-6 * std::fabs(ex.v[o]) + 1e-30;
      }
    }
  }

  Dev dg(g.data.size()), du(fused ? u.data.size() : 1);
  dg.up(g.data.data(), g.data.size());
  if (fused) du.up(u.data.data(), u.data.size());
  auto dx = upload(x);
  auto drows = upload(rows);
  auto doff = upload(offsets);
  auto dslot = upload(p.slot_of);
  auto dyrows = upload(y_rows);
  Dev dy(static_cast<size_t>(ld_y) * n_slots_max * sizeof(float));
  const DevMatrix mg = dev_matrix(g, dg);
  const DevMatrix mu = fused ? dev_matrix(u, du) : DevMatrix{};
  const int32_t* slot_dev = p.slot_of.empty() ? nullptr : dslot->as<int32_t>();
  const int32_t* yrows_dev = p.scatter ? dyrows->as<int32_t>() : nullptr;

  for (int tile : tiles) {
    SCOPED_TRACE("tile " + std::to_string(tile));
    dy.poison();
    if (fused)
      moe_matmul_swiglu(mg, mu, doff->as<int32_t>(), n_experts, slot_dev, dx->as<float>(), ld_x,
                        p.gather ? drows->as<int32_t>() : nullptr, n_slots_arg, dy.as<float>(), ld_y, fx->s(), yrows_dev,
                        tile);
    else
      moe_matmul(mg, doff->as<int32_t>(), n_experts, slot_dev, dx->as<float>(), ld_x,
                 p.gather ? drows->as<int32_t>() : nullptr, n_slots_arg, dy.as<float>(), ld_y, fx->s(), yrows_dev, tile);
    fx->sync();
    if (::testing::Test::HasFatalFailure()) return;
    const std::vector<float> y = dy.down<float>(static_cast<size_t>(ld_y) * n_slots_max);
    int bad = 0;
    for (int o = 0; o < n_slots_max && bad < 8; ++o) {
      const int i = out_slot[o];
      for (int64_t r = 0; r < ld_y && bad < 8; ++r) {
        const float got = y[static_cast<size_t>(o) * ld_y + r];
        if (!ex.computed[i] || r >= p.rows) {
          if (!is_poison(got)) {
            ++bad;
            ADD_FAILURE() << "slot " << i << " (expert " << ex.expert_of[i] << ") row " << r << " was written";
          }
          continue;
        }
        if (!row_checked(p, r)) continue;
        const size_t o = static_cast<size_t>(i) * p.rows + r;
        if (!(std::fabs(got - ex.v[o]) <= ex.tol[o])) {
          ++bad;
          ADD_FAILURE() << "slot " << i << " (expert " << ex.expert_of[i] << ", output row " << o << ") row " << r
                        << ": got " << got
                        << ", want " << ex.v[o] << " +- " << ex.tol[o];
        }
      }
    }
  }
}

const std::vector<int> kTiles = {0, 64, 128, -1};

// Nine experts over six device matrices: empty experts, host experts (one with tokens), a single token,
// exactly one and two full 64-token tiles, tiles with a ragged end, 300 tokens.
Problem mixed_problem(DType t, uint64_t seed) {
  Problem p;
  p.type = t;
  p.rows = 100;  // a partial row tile (and, fused, one full 64-row tile plus a partial one)
  p.cols = 512;
  p.n_mats = 6;
  p.slot_of = {2, -1, 0, 5, -1, 1, 3, 4, -1};
  p.counts = {1, 5, 0, 130, 7, 0, 64, 300, 0};
  p.first_slot = 3;
  p.extra_slots = 11;
  p.n_tokens = 200;
  p.scatter = seed % 20 >= 10;  // outputs scattered for every other type
  p.seed = seed;
  return p;
}

TEST_F(MoeGemm, EveryTypeMixedExperts) {
  for (DType t : kWeightTypes) {
    Problem p = mixed_problem(t, 100 + static_cast<uint64_t>(t) * 15);
    run_problem(this, p, false, kTiles);
    if (HasFatalFailure()) return;
  }
}

TEST_F(MoeGemm, SwigluEveryTypeMixedExperts) {
  for (DType t : kWeightTypes) {
    Problem p = mixed_problem(t, 300 + static_cast<uint64_t>(t) * 15);
    run_problem(this, p, true, kTiles);
    if (HasFatalFailure()) return;
  }
}

// No slot_of, no gather (slot i reads x row i), x rows not float4-aligned (ld_x odd), one expert.
TEST_F(MoeGemm, DirectRowsUnalignedActivations) {
  for (DType t : {DType::Q4_K, DType::Q6_K, DType::Q8_0, DType::F16, DType::BF16, DType::F32}) {
    Problem p;
    p.type = t;
    p.rows = 64;
    p.cols = 256;
    p.n_mats = 1;
    p.counts = {17};
    p.gather = false;
    p.ld_x_pad = 1;
    p.ld_y_pad = 0;
    p.seed = 500 + static_cast<uint64_t>(t);
    run_problem(this, p, false, kTiles);
    run_problem(this, p, true, kTiles);
    if (HasFatalFailure()) return;
  }
}

// As moe() runs a chunk of uploaded host experts: all experts' offsets, slot_of mapping only the chunk
// (a few experts with few slots among many with many), the grid sized by the chunk's slots alone.
TEST_F(MoeGemm, GridSizedByRunningSlots) {
  for (DType t : {DType::Q4_K, DType::Q8_0, DType::F32}) {
    Problem p;
    p.type = t;
    p.rows = 128;
    p.cols = 256;
    p.n_mats = 3;
    p.slot_of = {-1, -1, 0, -1, -1, 1, -1, 2, -1, -1};
    p.counts = {300, 200, 3, 0, 150, 70, 100, 1, 129, 64};
    p.grid_slots = 3 + 70 + 1;
    p.n_tokens = 300;
    p.scatter = true;
    p.seed = 800 + static_cast<uint64_t>(t);
    run_problem(this, p, true, kTiles);
    run_problem(this, p, false, kTiles);
    if (HasFatalFailure()) return;
  }
}

// Experts used directly as matrix indices; 16 experts of which several are empty; token counts 1..300.
TEST_F(MoeGemm, SixteenExpertsNoSlotOf) {
  for (DType t : {DType::Q4_K, DType::Q5_0, DType::IQ4_XS}) {
    Problem p;
    p.type = t;
    p.rows = 256;
    p.cols = 512;
    p.n_mats = 16;
    p.counts = {3, 0, 0, 65, 1, 128, 0, 129, 31, 2, 0, 0, 63, 300, 9, 0};
    p.n_tokens = 333;
    p.seed = 700 + static_cast<uint64_t>(t);
    run_problem(this, p, false, {0, 64, 128});
    if (HasFatalFailure()) return;
  }
}

// Qwen3-30B-A3B expert shapes: gate/up 768 x 2048 (fused), down 2048 x 768. Rows sampled.
TEST_F(MoeGemm, Qwen3MoeShapes) {
  for (DType t : {DType::Q4_K, DType::Q6_K}) {
    Problem p;
    p.type = t;
    p.n_mats = 6;
    p.slot_of = {0, 1, -1, 2, 3, -1, 4, 5};
    p.counts = {0, 1, 40, 200, 33, 0, 129, 64};
    p.n_tokens = 256;
    p.row_stride = 7;
    p.seed = 900 + static_cast<uint64_t>(t);
    p.rows = 768;
    p.cols = 2048;
    run_problem(this, p, true, {0, 64, 128});
    if (HasFatalFailure()) return;
    // as moe() uses it: the down product reads h in sorted slot order and scatters to the router's order
    p.rows = 2048;
    p.cols = 768;
    p.ld_x_pad = 0;
    p.gather = false;
    p.scatter = true;
    run_problem(this, p, false, {0, 64, 128});
    if (HasFatalFailure()) return;
  }
}

TEST_F(MoeGemm, NothingToDo) {
  HostMatrix h = random_matrix(DType::Q4_0, 64, 256, 2, 5);
  Dev dw(h.data.size());
  dw.up(h.data.data(), h.data.size());
  const DevMatrix m = dev_matrix(h, dw);
  // every expert on the host, or no tokens at all: nothing written
  const std::vector<int32_t> offsets = {0, 4, 9}, slot_of = {-1, -1};
  auto doff = upload(offsets);
  auto dslot = upload(slot_of);
  Dev dx(9 * 256 * sizeof(float)), dy(9 * 64 * sizeof(float));
  cudaMemset(dx.as(), 0, 9 * 256 * sizeof(float));
  dy.poison();
  moe_matmul(m, doff->as<int32_t>(), 2, dslot->as<int32_t>(), dx.as<float>(), 256, nullptr, 9, dy.as<float>(), 64, s());
  moe_matmul(m, doff->as<int32_t>(), 2, nullptr, dx.as<float>(), 256, nullptr, 0, dy.as<float>(), 64, s());
  moe_matmul(m, doff->as<int32_t>(), 0, nullptr, dx.as<float>(), 256, nullptr, 9, dy.as<float>(), 64, s());
  sync();
  for (float v : dy.down<float>(9 * 64)) ASSERT_TRUE(is_poison(v));
}

TEST_F(MoeGemm, RejectsBadInput) {
  HostMatrix h = random_matrix(DType::Q4_K, 64, 256, 2, 6);
  Dev dw(h.data.size()), dx(4096), dy(4096), doff(64);
  dw.up(h.data.data(), h.data.size());
  const DevMatrix m = dev_matrix(h, dw);
  auto call = [&](const DevMatrix& w) {
    moe_matmul(w, doff.as<int32_t>(), 1, nullptr, dx.as<float>(), w.cols, nullptr, 4, dy.as<float>(), w.rows, s());
  };
  DevMatrix bad = m;
  bad.type = DType::Q8_K;  // an activation type
  bad.row_bytes = row_bytes(DType::Q8_K, 256);
  EXPECT_THROW(call(bad), Error);
  DevMatrix f16 = m;  // a row length that is not a multiple of 32
  f16.type = DType::F16;
  f16.cols = 40;
  f16.row_bytes = 80;
  EXPECT_THROW(call(f16), Error);
  EXPECT_THROW(moe_matmul(m, doff.as<int32_t>(), 1, nullptr, dx.as<float>(), 256, nullptr, 4, dy.as<float>(), 63, s()),
               Error);  // ld_y < rows
  EXPECT_THROW(
      moe_matmul(m, doff.as<int32_t>(), 1, nullptr, dx.as<float>(), 256, nullptr, 4, dy.as<float>(), 64, s(), nullptr, 32),
      Error);  // no such tile
  HostMatrix h6 = random_matrix(DType::Q6_K, 64, 256, 2, 7);
  Dev dw6(h6.data.size());
  EXPECT_THROW(moe_matmul_swiglu(m, dev_matrix(h6, dw6), doff.as<int32_t>(), 1, nullptr, dx.as<float>(), 256, nullptr, 4,
                                 dy.as<float>(), 64, s()),
               Error);  // gate and up of different types
}

// ================================ benchmark (disabled) ============================================

// One Qwen3-30B-A3B MoE layer's routed experts for a micro-batch: 128 experts, n_embd 2048, n_ff_exp
// 768, 8 experts per token, Q4_K gate/up (fused) and Q6_K down, random routing. Prints the time and
// effective TFLOP/s (2 * slots * rows * cols per matrix) of each kernel variant.
TEST_F(MoeGemm, DISABLED_MoeGemmBench) {
  const int n_expert = 128, k = 8, E = 2048, F = 768;
  // 8 distinct random experts, replicated (quantizing 128 full experts on the CPU is slow)
  auto stack = [&](DType t, int64_t rows, int64_t cols, uint64_t seed) {
    HostMatrix h = random_matrix(t, rows, cols, 8, seed);
    const size_t mb = h.rb * rows;
    h.data.resize(mb * n_expert);
    for (int e = 8; e < n_expert; ++e) std::memcpy(h.data.data() + mb * e, h.data.data() + mb * (e % 8), mb);
    h.n_mats = n_expert;
    return h;
  };
  HostMatrix hg = stack(DType::Q4_K, F, E, 1), hu = stack(DType::Q4_K, F, E, 2), hd = stack(DType::Q6_K, E, F, 3);
  Dev dg(hg.data.size()), du(hu.data.size()), dd(hd.data.size());
  dg.up(hg.data.data(), hg.data.size());
  du.up(hu.data.data(), hu.data.size());
  dd.up(hd.data.data(), hd.data.size());
  const DevMatrix mg = dev_matrix(hg, dg), mu = dev_matrix(hu, du), md = dev_matrix(hd, dd);
  for (int nt : {512, 2048}) {
    const int n_slots = nt * k;
    // routing: k distinct experts per token, skewed (as real routers are)
    std::mt19937 rng(static_cast<uint32_t>(nt));
    std::vector<std::vector<int32_t>> by_e(n_expert);
    std::gamma_distribution<double> gd(0.7, 1.0);
    std::vector<double> pop(n_expert);
    for (auto& v : pop) v = gd(rng);
    std::discrete_distribution<int> pick(pop.begin(), pop.end());
    for (int t = 0; t < nt; ++t) {
      std::vector<int> chosen;
      while (static_cast<int>(chosen.size()) < k) {
        const int e = pick(rng);
        if (std::find(chosen.begin(), chosen.end(), e) == chosen.end()) chosen.push_back(e);
      }
      for (int e : chosen) by_e[e].push_back(t);
    }
    std::vector<int32_t> offsets(n_expert + 1, 0), rows;
    for (int e = 0; e < n_expert; ++e) {
      offsets[e + 1] = offsets[e] + static_cast<int32_t>(by_e[e].size());
      rows.insert(rows.end(), by_e[e].begin(), by_e[e].end());
    }
    auto doff = upload(offsets);
    auto drows = upload(rows);
    auto dx = upload(randn(static_cast<size_t>(nt) * E, 11));
    Dev dh(static_cast<size_t>(n_slots) * F * sizeof(float)), dy(static_cast<size_t>(n_slots) * E * sizeof(float));
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    for (int tile : {0, 64, 128}) {
      auto run = [&] {
        moe_matmul_swiglu(mg, mu, doff->as<int32_t>(), n_expert, nullptr, dx->as<float>(), E, drows->as<int32_t>(),
                          n_slots, dh.as<float>(), F, s(), nullptr, tile);
        moe_matmul(md, doff->as<int32_t>(), n_expert, nullptr, dh.as<float>(), F, nullptr, n_slots, dy.as<float>(), E,
                   s(), nullptr, tile);
      };
      run();
      sync();
      const int reps = 20;
      float ms_up = 0, ms_down = 0;
      for (int r = 0; r < reps; ++r) {
        float a = 0, b = 0;
        cudaEventRecord(e0, stream_);
        moe_matmul_swiglu(mg, mu, doff->as<int32_t>(), n_expert, nullptr, dx->as<float>(), E, drows->as<int32_t>(),
                          n_slots, dh.as<float>(), F, s(), nullptr, tile);
        cudaEventRecord(e1, stream_);
        cudaEventSynchronize(e1);
        cudaEventElapsedTime(&a, e0, e1);
        cudaEventRecord(e0, stream_);
        moe_matmul(md, doff->as<int32_t>(), n_expert, nullptr, dh.as<float>(), F, nullptr, n_slots, dy.as<float>(), E,
                   s(), nullptr, tile);
        cudaEventRecord(e1, stream_);
        cudaEventSynchronize(e1);
        cudaEventElapsedTime(&b, e0, e1);
        ms_up += a;
        ms_down += b;
      }
      ms_up /= reps;
      ms_down /= reps;
      const double fl_up = 2.0 * 2.0 * n_slots * F * E, fl_down = 2.0 * n_slots * E * F;
      std::printf("tokens %5d tile %3d: gate+up+swiglu %.3f ms (%.1f TFLOP/s), down %.3f ms (%.1f TFLOP/s), layer %.3f ms "
                  "(%.1f TFLOP/s)\n",
                  nt, tile, ms_up, fl_up / ms_up * 1e-9, ms_down, fl_down / ms_down * 1e-9, ms_up + ms_down,
                  (fl_up + fl_down) / (ms_up + ms_down) * 1e-9);
    }
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
  }
}

}  // namespace
}  // namespace fitmoe::gpu
