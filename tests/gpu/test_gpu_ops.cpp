// The CUDA op set (src/cuda/gpu_ops.h) against the CPU reference on fresh random inputs: activation
// quantizers byte for byte, integer mat-vec products against quant::vec_dot_ref, prefill matmul
// against a double-precision product of the f16-rounded operands, the elementwise ops, routing and
// attention against src/runtime/cpu_ops. Every output buffer is poisoned (NaN bytes) before a run so
// that a value the kernel forgot to write, or a read of memory it must not touch, shows up.
// Skipped (not failed) when the machine has no CUDA device.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cuda/device.h"
#include "cuda/gpu_ops.h"
#include "gpu/gpu_test_util.h"
#include "quant/dtype.h"
#include "quant/kernels.h"
#include "runtime/cpu_ops.h"
#include "runtime/error.h"
#include "runtime/thread_pool.h"

namespace fitmoe::gpu {
namespace {

using namespace test;

class GpuOps : public GpuTest {
 protected:
  void residual_norm_case(int k, int n);
};

// Activation rows in the weight's activation format, converted on the host by the reference.
std::vector<uint8_t> host_acts(DType act, const std::vector<float>& x, int64_t n, int rows) {
  const size_t stride = row_bytes(act, n);
  std::vector<uint8_t> a(stride * rows);
  for (int r = 0; r < rows; ++r) quant::quantize_act_row_ref(act, x.data() + r * n, a.data() + r * stride, n);
  return a;
}

// sum_j |w_j * a_j| of the decoded operands: the scale of a dot product's rounding error.
double sum_abs_product(DType w, const void* wrow, DType act, const void* arow, int64_t n) {
  std::vector<float> wf(n), af(n);
  quant::dequantize_row_ref(w, wrow, wf.data(), n);
  quant::dequantize_row_ref(act, arow, af.data(), n);
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += std::fabs(static_cast<double>(wf[i]) * af[i]);
  return s;
}

// ================================ activation quantizers ===========================================

TEST_F(GpuOps, QuantizeActsByteExact) {
  const DType acts[] = {DType::Q8_0, DType::Q8_1, DType::Q8_K, DType::F16, DType::BF16, DType::F32};
  for (DType act : acts) {
    for (int64_t n : {256, 4096}) {
      const int rows = 5;
      const int64_t ld = n + 32;
      std::vector<float> x = randn(static_cast<size_t>(ld) * rows, 1000 + n + static_cast<int>(act));
      // special rows: an all-zero block, exact ties of |max| with both signs, huge and tiny values,
      // values on rounding midpoints of the f16 / bf16 grids
      for (int i = 0; i < 256; ++i) x[1 * ld + i] = 0.0f;
      x[2 * ld + 3] = -9.5f, x[2 * ld + 7] = 9.5f, x[2 * ld + 40] = -9.5f;
      x[2 * ld + 300 % n] = 1e-30f;
      x[3 * ld + 5] = 3e4f, x[3 * ld + 6] = -7e-6f, x[3 * ld + 9] = 1.0f + 1.0f / 2048.0f;  // f16 midpoint
      x[3 * ld + 10] = 1.0f + 1.0f / 256.0f;                                                // bf16 midpoint
      // amax 127: scale 1, so these land exactly on rounding midpoints
      x[4 * ld + 0] = 127.0f, x[4 * ld + 1] = 63.5f, x[4 * ld + 2] = -62.5f, x[4 * ld + 3] = 0.5f, x[4 * ld + 4] = -1.5f;
      std::vector<uint8_t> ref(act_bytes(act, n, rows));
      const size_t stride = row_bytes(act, n);
      for (int r = 0; r < rows; ++r) quant::quantize_act_row_ref(act, x.data() + r * ld, ref.data() + r * stride, n);
      auto dx = upload(x);
      Dev out(act_bytes(act, n, rows));
      quantize_acts(act, dx->as<float>(), n, rows, ld, out.as(), s());
      sync();
      auto got = out.down<uint8_t>(ref.size());
      size_t first_bad = ref.size();
      for (size_t i = 0; i < ref.size(); ++i)
        if (got[i] != ref[i]) {
          first_bad = i;
          break;
        }
      EXPECT_EQ(first_bad, ref.size()) << dtype_name(act) << " n=" << n << ": first differing byte " << first_bad
                                       << " (row " << first_bad / stride << ")";
      if (first_bad != ref.size()) {
        const size_t b0 = first_bad / 34 * 34;  // dump the neighbourhood for diagnosis
        std::string dump = "  want:";
        for (size_t i = b0; i < std::min(ref.size(), b0 + 12); ++i) dump += " " + std::to_string(ref[i]);
        dump += "\n  got: ";
        for (size_t i = b0; i < std::min(ref.size(), b0 + 12); ++i) dump += " " + std::to_string(got[i]);
        std::printf("%s\n  x[0..3] = %g %g %g %g\n", dump.c_str(), x[0], x[1], x[2], x[3]);
      }
    }
  }
}

// The reference's 8-bit rounding of activations, for prefill's floating-point products: bit for bit
// what dequantizing quantize_act_row_ref's blocks gives, in place too.
TEST_F(GpuOps, RoundActsEqualsQuantizeThenDequantize) {
  for (DType act : {DType::Q8_0, DType::Q8_1, DType::Q8_K}) {
    const int64_t n = 512, ld = n + 32;
    const int rows = 4;
    std::vector<float> x = randn(static_cast<size_t>(ld) * rows, 40 + static_cast<int>(act));
    for (int i = 0; i < 256; ++i) x[1 * ld + i] = 0.0f;                             // an all-zero block
    x[2 * ld + 3] = -9.5f, x[2 * ld + 7] = 9.5f, x[2 * ld + 40] = -9.5f;            // ties of |max|
    x[3 * ld + 0] = 127.0f, x[3 * ld + 1] = 63.5f, x[3 * ld + 2] = -62.5f;          // rounding midpoints
    std::vector<float> want(static_cast<size_t>(n) * rows);
    std::vector<uint8_t> blk(row_bytes(act, n));
    for (int r = 0; r < rows; ++r) {
      quant::quantize_act_row_ref(act, x.data() + r * ld, blk.data(), n);
      quant::dequantize_row_ref(act, blk.data(), want.data() + r * n, n);
    }
    auto dx = upload(x);
    Dev out(want.size() * sizeof(float));
    round_acts(act, dx->as<float>(), n, rows, ld, out.as<float>(), n, s());
    round_acts(act, dx->as<float>(), n, rows, ld, dx->as<float>(), ld, s());  // in place
    sync();
    auto got = out.down<float>(want.size());
    auto inplace = dx->down<float>(x.size());
    int bad = 0;
    for (int r = 0; r < rows; ++r)
      for (int64_t i = 0; i < n; ++i) {
        const float w = want[r * n + i];
        if ((got[r * n + i] != w || inplace[r * ld + i] != w) && bad++ < 5)
          ADD_FAILURE() << dtype_name(act) << " row " << r << " value " << i << ": got " << got[r * n + i] << " / "
                        << inplace[r * ld + i] << " want " << w << " (x " << x[r * ld + i] << ")";
      }
  }
}

// ================================ mat-vec =========================================================

struct MvShape {
  int64_t n, rows;
  std::vector<int> tokens;
};

void run_matvec_case(Stream s, DType t, int64_t n, int64_t rows, int nt, uint64_t seed,
                     std::function<void()> sync) {
  const DType act = dtype_info(t).act_type;
  HostMatrix hw = random_matrix(t, rows, n, 1, seed);
  Dev dw(hw.data.size());
  dw.up(hw.data.data(), hw.data.size());
  std::vector<float> x = randn(static_cast<size_t>(n) * nt, seed * 7 + 1);
  std::vector<uint8_t> ha = host_acts(act, x, n, nt);
  auto da = upload(ha);
  const int64_t ld_y = rows + 5;
  Dev dy(static_cast<size_t>(ld_y) * nt * sizeof(float));
  matvec(dev_matrix(hw, dw), da->as(), nt, dy.as<float>(), ld_y, s);
  sync();
  auto y = dy.down<float>(static_cast<size_t>(ld_y) * nt);
  const size_t astride = row_bytes(act, n);
  int bad = 0;
  for (int tk = 0; tk < nt; ++tk) {
    for (int64_t r = 0; r < ld_y; ++r) {
      const float got = y[tk * ld_y + r];
      if (r >= rows) {
        if (!is_poison(got) && bad++ < 5) ADD_FAILURE() << dtype_name(t) << ": wrote past the rows at " << r;
        continue;
      }
      const uint8_t* arow = ha.data() + tk * astride;
      const float ref = quant::vec_dot_ref(t, n, hw.row(0, r), arow);
      const double scale = sum_abs_product(t, hw.row(0, r), act, arow, n);
      if (!(std::fabs(got - ref) <= 1e-5 * scale + 1e-30) && bad++ < 5)
        ADD_FAILURE() << dtype_name(t) << " n=" << n << " rows=" << rows << " tokens=" << nt << ": row " << r << " token "
                      << tk << " got " << got << " want " << ref << " (scale " << scale << ")";
    }
  }
}

TEST_F(GpuOps, MatvecEveryTypeMatchesVecDotRef) {
  for (DType t : kWeightTypes) {
    const int bs = dtype_info(t).block_size;
    std::vector<MvShape> shapes = {{256, 3, {1, 8}}, {2304, 37, {1, 2, 3}}, {4096, 67, {1, 2, 3, 4, 5, 6, 7, 8}}};
    if (bs <= 32) shapes.push_back({160, 129, {1, 4}});           // a partial warp of blocks, odd rows
    if (bs == 1) shapes.push_back({100, 9, {1, 3}});              // float types: the unaligned tail path
    if (bs == 1) shapes.push_back({256, 600, {1, 3}});            // float types, many rows: a warp per row
    uint64_t seed = 17 + static_cast<uint64_t>(t) * 1000;
    for (const auto& sh : shapes)
      for (int nt : sh.tokens) run_matvec_case(s(), t, sh.n, sh.rows, nt, seed++, [this] { sync(); });
  }
}

// Very many rows for one token (the shape of an output head): the launch takes another form there.
TEST_F(GpuOps, MatvecManyRowsMatchesVecDotRef) {
  for (DType t : {DType::Q6_K, DType::Q4_K}) run_matvec_case(s(), t, 256, 70001, 1, 31, [this] { sync(); });
}

// One token's products stage their rows in shared memory where the rows are whole 16-byte words (most
// quantized types at these widths); two tokens take the unstaged kernel. Both make each row's sum in
// the same order, so one token's outputs must have the very bits of either token of a two-token call
// on the same activation row twice, for every type, staged or not.
TEST_F(GpuOps, MatvecOneTokenEqualsEachTokenOfTwo) {
  for (DType t : kWeightTypes) {
    if (is_float_type(t)) continue;
    const DType act = dtype_info(t).act_type;
    for (int64_t n : {256, 2304, 4096}) {
      if (n % dtype_info(t).block_size != 0) continue;
      const int64_t rows = 67;
      HostMatrix hw = random_matrix(t, rows, n, 1, 41 + n);
      Dev dw(hw.data.size());
      dw.up(hw.data.data(), hw.data.size());
      std::vector<float> x = randn(static_cast<size_t>(n), 42 + n);
      std::vector<float> x2 = x;
      x2.insert(x2.end(), x.begin(), x.end());
      auto a1 = upload(host_acts(act, x, n, 1)), a2 = upload(host_acts(act, x2, n, 2));
      Dev y1(rows * 4), y2(2 * rows * 4);
      matvec(dev_matrix(hw, dw), a1->as(), 1, y1.as<float>(), rows, s());
      matvec(dev_matrix(hw, dw), a2->as(), 2, y2.as<float>(), rows, s());
      sync();
      auto g1 = y1.down<float>(rows), g2 = y2.down<float>(2 * rows);
      for (int64_t r = 0; r < rows; ++r) {
        ASSERT_EQ(bits(g1[r]), bits(g2[r])) << dtype_name(t) << " n " << n << " row " << r;
        ASSERT_EQ(bits(g1[r]), bits(g2[rows + r])) << dtype_name(t) << " n " << n << " row " << r << " (token 1)";
      }
    }
  }
}

TEST_F(GpuOps, MatvecExpertsSelectsMatricesAndSkipsHostExperts) {
  for (DType t : kWeightTypes) {
    const DType act = dtype_info(t).act_type;
    const int64_t n = 512, rows = 33, n_mats = 5;
    HostMatrix hw = random_matrix(t, rows, n, n_mats, 99 + static_cast<uint64_t>(t));
    Dev dw(hw.data.size());
    dw.up(hw.data.data(), hw.data.size());
    const int n_act = 3;
    std::vector<float> x = randn(static_cast<size_t>(n) * n_act, 5 + static_cast<uint64_t>(t));
    std::vector<uint8_t> ha = host_acts(act, x, n, n_act);
    auto da = upload(ha);
    const size_t astride = row_bytes(act, n);
    // 6 experts, expert e in device matrix slot_of[e] (-1: in host memory)
    const std::vector<int32_t> slot_of = {2, -1, 0, 4, 1, 3};
    const std::vector<int32_t> ids = {5, 1, 0, 3, 5, 2, 4, -1};  // (-1: no choice; its row is left alone)
    const std::vector<int32_t> act_row = {0, 1, 1, 2, 0, 2, 1, 0};
    const int n_slots = static_cast<int>(ids.size());
    auto d_slot = upload(slot_of);
    auto d_ids = upload(ids);
    auto d_row = upload(act_row);
    for (bool use_slot_of : {true, false}) {
      std::vector<int32_t> ids_direct = {4, 0, 2, 3, 1, 4, 0, -1};  // without slot_of: ids are matrix indices
      auto d_ids_direct = upload(ids_direct);
      const int64_t ld_y = rows + 3;
      Dev dy(static_cast<size_t>(ld_y) * n_slots * sizeof(float));
      matvec_experts(dev_matrix(hw, dw), use_slot_of ? d_ids->as<int32_t>() : d_ids_direct->as<int32_t>(),
                     use_slot_of ? d_slot->as<int32_t>() : nullptr, n_slots, da->as(), d_row->as<int32_t>(),
                     dy.as<float>(), ld_y, s());
      sync();
      auto y = dy.down<float>(static_cast<size_t>(ld_y) * n_slots);
      int bad = 0;
      for (int j = 0; j < n_slots; ++j) {
        const int m = ids[j] < 0 ? -1 : use_slot_of ? slot_of[ids[j]] : ids_direct[j];
        for (int64_t r = 0; r < ld_y; ++r) {
          const float got = y[j * ld_y + r];
          if (m < 0 || r >= rows) {
            if (!is_poison(got) && bad++ < 5) ADD_FAILURE() << dtype_name(t) << ": slot " << j << " row " << r << " written";
            continue;
          }
          const uint8_t* arow = ha.data() + act_row[j] * astride;
          const float ref = quant::vec_dot_ref(t, n, hw.row(m, r), arow);
          const double scale = sum_abs_product(t, hw.row(m, r), act, arow, n);
          if (!(std::fabs(got - ref) <= 1e-5 * scale + 1e-30) && bad++ < 5)
            ADD_FAILURE() << dtype_name(t) << ": slot " << j << " row " << r << " got " << got << " want " << ref;
        }
      }
    }
  }
}

// Gate and up with SwiGLU in one launch: the bits of two matvec_experts calls and swiglu, host slots
// left untouched, every quantized type.
TEST_F(GpuOps, MatvecExpertsGluEqualsGateUpAndSwiglu) {
  const int64_t cols = 512, rows = 96;
  const int n_mats = 5, n_tok = 3, k = 4, n_slots = n_tok * k;
  std::vector<int32_t> ids(n_slots), act_row(n_slots);
  for (int j = 0; j < n_slots; ++j) ids[j] = (j * 3 + 1) % 6, act_row[j] = j / k;
  const std::vector<int32_t> slot_of = {0, 1, -1, 2, 3, -1};  // experts 2 and 5 live on the host
  auto d_ids = upload(ids), d_rows = upload(act_row), d_slot = upload(slot_of);
  std::vector<float> x = randn(static_cast<size_t>(cols) * n_tok, 401, 0.5f);
  for (DType t : kWeightTypes) {
    if (t == DType::F32 || t == DType::F16 || t == DType::BF16) continue;
    HostMatrix g = random_matrix(t, rows, cols, n_mats, 402), u = random_matrix(t, rows, cols, n_mats, 403);
    auto dg = upload(g.data), du = upload(u.data);
    DevMatrix mg = dev_matrix(g, *dg), mu = dev_matrix(u, *du);
    auto acts = upload(host_acts(dtype_info(t).act_type, x, cols, n_tok));
    Dev y_fused(static_cast<size_t>(n_slots) * rows * 4), y_g(static_cast<size_t>(n_slots) * rows * 4),
        y_u(static_cast<size_t>(n_slots) * rows * 4);
    matvec_experts_glu(mg, mu, d_ids->as<int32_t>(), d_slot->as<int32_t>(), n_slots, acts->bytes(), d_rows->as<int32_t>(),
                       y_fused.as<float>(), rows, s());
    matvec_experts(mg, d_ids->as<int32_t>(), d_slot->as<int32_t>(), n_slots, acts->bytes(), d_rows->as<int32_t>(),
                   y_g.as<float>(), rows, s());
    matvec_experts(mu, d_ids->as<int32_t>(), d_slot->as<int32_t>(), n_slots, acts->bytes(), d_rows->as<int32_t>(),
                   y_u.as<float>(), rows, s());
    swiglu(y_g.as<float>(), y_u.as<float>(), y_g.as<float>(), static_cast<int64_t>(n_slots) * rows, s());
    sync();
    auto a = y_fused.down<float>(static_cast<size_t>(n_slots) * rows), b = y_g.down<float>(static_cast<size_t>(n_slots) * rows);
    for (int j = 0; j < n_slots; ++j)
      for (int64_t r = 0; r < rows; ++r) {
        const float got = a[j * rows + r];
        if (slot_of[ids[j]] < 0) ASSERT_TRUE(is_poison(got)) << dtype_name(t) << ": host slot " << j << " written";
        else ASSERT_EQ(bits(got), bits(b[j * rows + r])) << dtype_name(t) << " slot " << j << " row " << r;
      }
  }
  HostMatrix f = random_matrix(DType::F16, rows, cols, n_mats, 404);
  auto df = upload(f.data);
  DevMatrix mf = dev_matrix(f, *df);
  Dev y(static_cast<size_t>(n_slots) * rows * 4), a16(static_cast<size_t>(n_tok) * cols * 2);
  EXPECT_THROW(matvec_experts_glu(mf, mf, d_ids->as<int32_t>(), d_slot->as<int32_t>(), n_slots, a16.bytes(),
                                  d_rows->as<int32_t>(), y.as<float>(), rows, s()),
               Error);
}

// Gate and up that route for themselves (one token): the choices, weights and outputs of route_topk
// followed by matvec_experts_glu, bit for bit, for expert counts up to the limit, ties (the lower
// index first), experts on the host (NaN rows: the caller must not route them here) and NaN logits
// (nothing chosen: NaN rows, no read out of range). Two weight types (the kernel is one per type; the
// products are mmvq_kernel's, tested for every type above).
TEST_F(GpuOps, MatvecExpertsGluRoutedEqualsRouteTopkThenGlu) {
  const int64_t cols = 512, rows = 40;  // (40 rows: the last CTA has warps past the end)
  for (DType t : {DType::Q4_K, DType::Q6_K}) {
    for (int n_expert : {60, 128, 200, 256}) {
      HostMatrix g = random_matrix(t, rows, cols, n_expert, 421 + n_expert), u = random_matrix(t, rows, cols, n_expert, 422);
      auto dg = upload(g.data), du = upload(u.data);
      DevMatrix mg = dev_matrix(g, *dg), mu = dev_matrix(u, *du);
      std::vector<float> x = randn(cols, 423, 0.5f);
      auto acts = upload(host_acts(dtype_info(t).act_type, x, cols, 1));
      std::vector<int32_t> slot_of(n_expert);
      for (int e = 0; e < n_expert; ++e) slot_of[e] = e;
      auto d_slot = upload(slot_of);
      for (int k : {1, 8}) {
        for (int variant = 0; variant < 3; ++variant) {  // plain, ties, NaN logits
          SCOPED_TRACE(std::string(dtype_name(t)) + " experts " + std::to_string(n_expert) + " k " + std::to_string(k) +
                       " variant " + std::to_string(variant));
          std::vector<float> logits = randn(n_expert, 424 + n_expert + k + variant, 2.0f);
          if (variant == 1)
            for (int e = 3; e < n_expert; e += 5) logits[e] = 4.0f;  // many tied leaders
          if (variant == 2) logits[n_expert / 2] = std::numeric_limits<float>::quiet_NaN();
          auto dl = upload(logits);
          Dev i1(k * 4), w1(k * 4), i2(k * 4), w2(k * 4);
          Dev y1(static_cast<size_t>(k) * rows * 4), y2(static_cast<size_t>(k) * rows * 4);
          matvec_experts_glu_routed(mg, mu, dl->as<float>(), n_expert, k, i1.as<int32_t>(), w1.as<float>(),
                                    d_slot->as<int32_t>(), acts->bytes(), y1.as<float>(), rows, s());
          route_topk(dl->as<float>(), 1, n_expert, k, i2.as<int32_t>(), w2.as<float>(), s());
          sync();
          auto ia = i1.down<int32_t>(k), ib = i2.down<int32_t>(k);
          auto wa = w1.down<float>(k), wb = w2.down<float>(k);
          for (int j = 0; j < k; ++j) {
            ASSERT_EQ(ia[j], ib[j]) << "choice " << j;
            ASSERT_EQ(bits(wa[j]), bits(wb[j])) << "weight " << j;
          }
          auto ya = y1.down<float>(static_cast<size_t>(k) * rows);
          if (variant == 2) {
            for (float v : ya) ASSERT_TRUE(std::isnan(v) && !is_poison(v)) << "NaN logits: every row NaN";
            for (int j = 0; j < k; ++j) ASSERT_EQ(ia[j], -1) << "NaN logits: no choice is -1, choice " << j;
            continue;
          }
          std::vector<int32_t> act_row(k, 0);
          auto d_rows = upload(act_row);
          matvec_experts_glu(mg, mu, i2.as<int32_t>(), d_slot->as<int32_t>(), k, acts->bytes(), d_rows->as<int32_t>(),
                             y2.as<float>(), rows, s());
          sync();
          auto yb = y2.down<float>(static_cast<size_t>(k) * rows);
          for (size_t i = 0; i < ya.size(); ++i) ASSERT_EQ(bits(ya[i]), bits(yb[i])) << "output " << i;
        }
      }
      // Experts the caller placed on the host: their slots' rows are NaN, the others as before.
      std::vector<int32_t> half = slot_of;
      for (int e = 0; e < n_expert; e += 2) half[e] = -1;
      auto d_half = upload(half);
      std::vector<float> logits = randn(n_expert, 425, 2.0f);
      auto dl = upload(logits);
      const int k = 8;
      Dev ids(k * 4), wts(k * 4), y(static_cast<size_t>(k) * rows * 4);
      matvec_experts_glu_routed(mg, mu, dl->as<float>(), n_expert, k, ids.as<int32_t>(), wts.as<float>(),
                                d_half->as<int32_t>(), acts->bytes(), y.as<float>(), rows, s());
      sync();
      auto id = ids.down<int32_t>(k);
      auto yv = y.down<float>(static_cast<size_t>(k) * rows);
      for (int j = 0; j < k; ++j)
        for (int64_t r = 0; r < rows; ++r) {
          const float v = yv[j * rows + r];
          if (half[id[j]] < 0) ASSERT_TRUE(std::isnan(v) && !is_poison(v)) << "host slot " << j << " row " << r;
          else ASSERT_FALSE(std::isnan(v)) << "slot " << j << " row " << r;
        }
    }
  }
  HostMatrix g = random_matrix(DType::Q4_K, rows, cols, 1, 426);
  auto dg = upload(g.data);
  DevMatrix mg = dev_matrix(g, *dg);
  Dev buf(1 << 16);
  EXPECT_THROW(matvec_experts_glu_routed(mg, mg, buf.as<float>(), kRouteInExpertsMax + 1, 8, buf.as<int32_t>(),
                                         buf.as<float>(), buf.as<int32_t>(), buf.bytes(), buf.as<float>(), rows, s()),
               Error);
  EXPECT_THROW(matvec_experts_glu_routed(mg, mg, buf.as<float>(), 128, 8, buf.as<int32_t>(), buf.as<float>(), nullptr,
                                         buf.bytes(), buf.as<float>(), rows, s()),
               Error);  // one matrix, 128 experts, no slot_of
}

// Several matrices in one launch: the same bits as one matvec each, and nothing written past each
// output's rows (outputs have their own ld, with a gap that stays poisoned). Each weight type alone,
// the pairs of types one launch mixes (q and k of one type, v of another), and three types.
TEST_F(GpuOps, MatvecMultiEqualsSeparateMatvecs) {
  const int64_t cols = 512;
  const int64_t rows[3] = {96, 20, 33};
  std::vector<std::array<DType, 3>> combos;
  for (DType t : kWeightTypes) combos.push_back({t, t, t});
  combos.push_back({DType::Q4_K, DType::Q4_K, DType::Q6_K});
  combos.push_back({DType::Q6_K, DType::Q5_K, DType::Q6_K});
  combos.push_back({DType::Q4_K, DType::Q3_K, DType::Q3_K});
  combos.push_back({DType::Q3_K, DType::Q5_K, DType::Q5_K});
  combos.push_back({DType::Q3_K, DType::Q4_K, DType::Q6_K});
  combos.push_back({DType::Q2_K, DType::Q2_K, DType::Q6_K});
  for (const auto& types : combos) {
    for (int nt : {1, 3}) {
      SCOPED_TRACE(std::string(dtype_name(types[0])) + "/" + dtype_name(types[1]) + "/" + dtype_name(types[2]) +
                   " tokens " + std::to_string(nt));
      std::vector<float> x = randn(static_cast<size_t>(cols) * nt, 451, 0.5f);
      auto acts = upload(host_acts(dtype_info(types[0]).act_type, x, cols, nt));
      std::vector<HostMatrix> hm;
      std::vector<std::unique_ptr<Dev>> dm;
      std::vector<DevMatrix> m;
      for (int i = 0; i < 3; ++i) {
        hm.push_back(random_matrix(types[i], rows[i], cols, 1, 452 + i));
        dm.push_back(upload(hm.back().data));
      }
      for (int i = 0; i < 3; ++i) m.push_back(dev_matrix(hm[i], *dm[i]));
      std::vector<std::unique_ptr<Dev>> y_multi, y_one;
      float* ys[3];
      int64_t lds[3];
      for (int i = 0; i < 3; ++i) {
        lds[i] = rows[i] + 5;
        y_multi.push_back(std::make_unique<Dev>(static_cast<size_t>(lds[i]) * nt * 4));
        y_one.push_back(std::make_unique<Dev>(static_cast<size_t>(lds[i]) * nt * 4));
        ys[i] = y_multi.back()->as<float>();
        matvec(m[i], acts->bytes(), nt, y_one.back()->as<float>(), lds[i], s());
      }
      const DevMatrix* ws[3] = {&m[0], &m[1], &m[2]};
      matvec_multi(ws, ys, lds, 3, acts->bytes(), nt, s());
      sync();
      for (int i = 0; i < 3; ++i) {
        auto a = y_multi[i]->down<float>(static_cast<size_t>(lds[i]) * nt), b = y_one[i]->down<float>(static_cast<size_t>(lds[i]) * nt);
        for (int tk = 0; tk < nt; ++tk)
          for (int64_t r = 0; r < lds[i]; ++r) {
            const float got = a[tk * lds[i] + r];
            if (r >= rows[i]) ASSERT_TRUE(is_poison(got)) << "matrix " << i << " wrote past its rows";
            else ASSERT_EQ(bits(got), bits(b[tk * lds[i] + r])) << "matrix " << i << " token " << tk << " row " << r;
          }
      }
    }
  }
  // Matrices that take different activation formats cannot share one input: refused.
  HostMatrix k4 = random_matrix(DType::Q4_K, 32, cols, 1, 460), q8 = random_matrix(DType::Q8_0, 32, cols, 1, 461);
  auto dk4 = upload(k4.data), dq8 = upload(q8.data);
  DevMatrix mk4 = dev_matrix(k4, *dk4), mq8 = dev_matrix(q8, *dq8);
  const DevMatrix* mixed[2] = {&mk4, &mq8};
  Dev y0(32 * 4), y1(32 * 4);
  float* ys2[2] = {y0.as<float>(), y1.as<float>()};
  const int64_t lds2[2] = {32, 32};
  auto a8 = upload(host_acts(DType::Q8_K, randn(static_cast<size_t>(cols), 462, 0.5f), cols, 1));
  EXPECT_THROW(matvec_multi(mixed, ys2, lds2, 2, a8->bytes(), 1, s()), Error);
}

// The router's product with the routing fused: the same logits, choices and weights as matvec +
// route_topk, twice in a row (the completion counter must come back to 0), and a refusal (false)
// where it does not apply.
TEST_F(GpuOps, RouterTopkEqualsMatvecAndRouteTopk) {
  // The fused router (product, then routing in its last CTA) against the product and route_topk in two
  // launches: the same logits, choices and weights for every expert count the fused router takes, ties
  // (duplicated router rows give equal probabilities: the lower index first) and NaN inputs included.
  // (RouteTopkEveryExpertCount holds the routing itself against the CPU's.)
  const int64_t cols = 512;
  Dev done(sizeof(unsigned));
  cudaMemset(done.as(), 0, sizeof(unsigned));
  for (int n_expert : {60, 128, 256, 500}) {
    HostMatrix r = random_matrix(DType::F32, n_expert, cols, 1, 611 + n_expert);
    for (int e = 1; e < n_expert; e += 7)  // row e copies row e - 1
      std::copy_n(r.data.begin() + (e - 1) * cols * 4, cols * 4, r.data.begin() + e * cols * 4);
    auto dr = upload(r.data);
    DevMatrix m = dev_matrix(r, *dr);
    for (int k : {1, 8, 32}) {
      for (int nt : {1, 5}) {
        SCOPED_TRACE("experts " + std::to_string(n_expert) + " k " + std::to_string(k) + " tokens " + std::to_string(nt));
        std::vector<float> xh = randn(static_cast<size_t>(cols) * nt, 612 + k + nt, 1.0f);
        if (nt == 5) xh[3 * cols + 7] = std::numeric_limits<float>::quiet_NaN();  // token 3: NaN logits
        auto x = upload(xh);
        Dev l1(static_cast<size_t>(nt) * n_expert * 4), l2(static_cast<size_t>(nt) * n_expert * 4);
        Dev i1(static_cast<size_t>(nt) * k * 4), i2(static_cast<size_t>(nt) * k * 4);
        Dev w1(static_cast<size_t>(nt) * k * 4), w2(static_cast<size_t>(nt) * k * 4);
        ASSERT_TRUE(router_topk(m, x->as<float>(), nt, l1.as<float>(), k, i1.as<int32_t>(), w1.as<float>(),
                                done.as<unsigned>(), s()));
        matvec(m, x->as<float>(), nt, l2.as<float>(), n_expert, s());
        route_topk(l2.as<float>(), nt, n_expert, k, i2.as<int32_t>(), w2.as<float>(), s());
        sync();
        auto a = l1.down<float>(static_cast<size_t>(nt) * n_expert), b = l2.down<float>(static_cast<size_t>(nt) * n_expert);
        for (size_t i = 0; i < a.size(); ++i) ASSERT_EQ(bits(a[i]), bits(b[i])) << "logit " << i;
        auto ia = i1.down<int32_t>(static_cast<size_t>(nt) * k), ib = i2.down<int32_t>(static_cast<size_t>(nt) * k);
        auto wa = w1.down<float>(static_cast<size_t>(nt) * k), wb = w2.down<float>(static_cast<size_t>(nt) * k);
        for (size_t i = 0; i < ia.size(); ++i) {
          ASSERT_EQ(ia[i], ib[i]) << "choice " << i;
          ASSERT_EQ(bits(wa[i]), bits(wb[i])) << "weight " << i;
        }
        ASSERT_EQ(done.down<unsigned>(1)[0], 0u) << "the counter was not reset";
      }
    }
  }
  const int n_expert = 128, k = 8;
  HostMatrix q = random_matrix(DType::Q8_0, n_expert, cols, 1, 613);
  auto dq = upload(q.data);
  Dev out(4096);
  EXPECT_FALSE(router_topk(dev_matrix(q, *dq), nullptr, 1, out.as<float>(), k, out.as<int32_t>(), out.as<float>(),
                           done.as<unsigned>(), s()));
}

// The routing handed to the CPU through pinned memory: router_topk's last CTA (and publish_route on its
// own) writes the choices and the input rows into host buffers and then the epoch into the flag.
TEST_F(GpuOps, RoutingIsPublishedToPinnedMemory) {
  const int64_t cols = 512;
  const int n_expert = 128, k = 8, nt = 3;
  HostMatrix r = random_matrix(DType::F32, n_expert, cols, 1, 631);
  auto dr = upload(r.data);
  DevMatrix m = dev_matrix(r, *dr);
  Dev done(sizeof(unsigned)), logits(static_cast<size_t>(nt) * n_expert * 4), ids(static_cast<size_t>(nt) * k * 4),
      wts(static_cast<size_t>(nt) * k * 4), epoch(sizeof(unsigned));
  cudaMemset(done.as(), 0, sizeof(unsigned));
  const std::vector<float> xh = randn(static_cast<size_t>(cols) * nt, 632, 1.0f);
  auto x = upload(xh);
  auto* h_ids = static_cast<int32_t*>(alloc_pinned(sizeof(int32_t) * nt * k));
  auto* h_x = static_cast<float*>(alloc_pinned(sizeof(float) * nt * cols));
  auto* h_flag = static_cast<unsigned*>(alloc_pinned(sizeof(unsigned)));
  RoutePublish pub;
  pub.ids = static_cast<int32_t*>(device_view(h_ids));
  pub.x = static_cast<float*>(device_view(h_x));
  pub.flag = static_cast<unsigned*>(device_view(h_flag));
  pub.epoch = epoch.as<unsigned>();
  for (unsigned e : {7u, 8u}) {
    SCOPED_TRACE(e == 7 ? "router_topk" : "publish_route");
    std::memset(h_ids, 0xff, sizeof(int32_t) * nt * k);
    std::memset(h_x, 0xff, sizeof(float) * nt * cols);
    *h_flag = 0;
    cudaMemcpy(epoch.as(), &e, sizeof e, cudaMemcpyHostToDevice);
    if (e == 7) {
      ASSERT_TRUE(router_topk(m, x->as<float>(), nt, logits.as<float>(), k, ids.as<int32_t>(), wts.as<float>(),
                              done.as<unsigned>(), s(), pub));
    } else {
      publish_route(pub, ids.as<int32_t>(), nt * k, x->as<float>(), static_cast<int64_t>(nt) * cols, s());
    }
    sync();
    ASSERT_EQ(*h_flag, e) << "the flag does not carry the epoch";
    const auto want = ids.down<int32_t>(static_cast<size_t>(nt) * k);
    for (int i = 0; i < nt * k; ++i) ASSERT_EQ(h_ids[i], want[i]) << "choice " << i;
    for (size_t i = 0; i < xh.size(); ++i) ASSERT_EQ(bits(h_x[i]), bits(xh[i])) << "input " << i;
  }
  // A GPU share of one half: of each token's host slots (odd experts here) the last floor(h / 2 + 1/4)
  // in slot order go to the GPU, in both tables; the others read -1.
  std::vector<int32_t> slot_of(n_expert);
  for (int e = 0; e < n_expert; ++e) slot_of[e] = e % 2 ? -1 : e / 2;
  auto d_slot = upload(slot_of);
  Dev gpu_slots(static_cast<size_t>(nt) * k * 4);
  auto* h_gpu_slots = static_cast<int32_t*>(alloc_pinned(sizeof(int32_t) * nt * k));
  pub.gpu_share = 0.5f;
  pub.k = k;
  pub.n_expert = n_expert;
  pub.slot_of = d_slot->as<int32_t>();
  pub.gpu_slots = gpu_slots.as<int32_t>();
  pub.host_gpu_slots = static_cast<int32_t*>(device_view(h_gpu_slots));
  ASSERT_TRUE(router_topk(m, x->as<float>(), nt, logits.as<float>(), k, ids.as<int32_t>(), wts.as<float>(),
                          done.as<unsigned>(), s(), pub));
  sync();
  const auto chosen = ids.down<int32_t>(static_cast<size_t>(nt) * k), got = gpu_slots.down<int32_t>(static_cast<size_t>(nt) * k);
  int taken = 0;
  for (int t = 0; t < nt; ++t) {
    int h = 0;
    for (int j = 0; j < k; ++j) h += slot_of[chosen[t * k + j]] < 0;
    int take = static_cast<int>(h * 0.5f + 0.25f);
    for (int j = k - 1; j >= 0; --j) {
      const int e = chosen[t * k + j];
      const bool gpu = take > 0 && slot_of[e] < 0;
      take -= gpu;
      taken += gpu;
      ASSERT_EQ(got[t * k + j], gpu ? e : -1) << "token " << t << " slot " << j;
      ASSERT_EQ(h_gpu_slots[t * k + j], got[t * k + j]) << "pinned copy, token " << t << " slot " << j;
    }
  }
  EXPECT_GT(taken, 0);
  // A routing guess (hybrid decode) publishes the choices and the flag only: no x, which stays as it is.
  pub = RoutePublish{};
  pub.ids = static_cast<int32_t*>(device_view(h_ids));
  pub.flag = static_cast<unsigned*>(device_view(h_flag));
  pub.epoch = epoch.as<unsigned>();
  std::memset(h_ids, 0xff, sizeof(int32_t) * nt * k);
  std::memset(h_x, 0x7f, sizeof(float) * nt * cols);
  *h_flag = 0;
  ASSERT_TRUE(router_topk(m, x->as<float>(), 1, logits.as<float>(), k, ids.as<int32_t>(), wts.as<float>(),
                          done.as<unsigned>(), s(), pub));
  sync();
  ASSERT_EQ(*h_flag, 8u);
  const auto one = ids.down<int32_t>(k);
  for (int i = 0; i < k; ++i) ASSERT_EQ(h_ids[i], one[i]) << "guessed choice " << i;
  for (int64_t i = 0; i < nt * cols; ++i) ASSERT_EQ(bits(h_x[i]), 0x7f7f7f7fu) << "x written at " << i;
  free_pinned(h_gpu_slots);
  free_pinned(h_ids);
  free_pinned(h_x);
  free_pinned(h_flag);
}

// Down products with the combination fused: the same bits as matvec_experts (one row per slot) and
// moe_combine, for k = 8 and a k below the kernel's maximum.
TEST_F(GpuOps, MatvecExpertsCombineEqualsExpertsAndCombine) {
  const int64_t cols = 768, rows = 200;
  const int n_mats = 10;
  for (DType t : kWeightTypes) {
    if (is_float_type(t) || cols % dtype_info(t).block_size != 0) continue;
    for (int nt : {1, 3}) {
      for (int k : {8, 3}) {
        SCOPED_TRACE(std::string(dtype_name(t)) + " tokens " + std::to_string(nt) + " k " + std::to_string(k));
        const int n_slots = nt * k;
        std::vector<int32_t> ids(n_slots), ident(n_slots);
        for (int j = 0; j < n_slots; ++j) ids[j] = (j * 7 + 2) % 9, ident[j] = j;
        std::vector<int32_t> slot_of(9);
        for (int e = 0; e < 9; ++e) slot_of[e] = (e * 4 + 1) % n_mats;
        auto d_ids = upload(ids), d_ident = upload(ident), d_slot = upload(slot_of);
        auto wts = upload(randn(static_cast<size_t>(n_slots), 721 + k, 0.4f));
        std::vector<float> g = randn(static_cast<size_t>(cols) * n_slots, 722, 0.5f);
        auto acts = upload(host_acts(dtype_info(t).act_type, g, cols, n_slots));
        HostMatrix w = random_matrix(t, rows, cols, n_mats, 723);
        auto dw = upload(w.data);
        DevMatrix m = dev_matrix(w, *dw);
        const int64_t ld = rows + 3;
        Dev y(static_cast<size_t>(ld) * nt * 4), ey(static_cast<size_t>(n_slots) * rows * 4),
            ref(static_cast<size_t>(nt) * rows * 4);
        matvec_experts_combine(m, d_ids->as<int32_t>(), d_slot->as<int32_t>(), nt, k, acts->bytes(), wts->as<float>(),
                               y.as<float>(), ld, s());
        matvec_experts(m, d_ids->as<int32_t>(), d_slot->as<int32_t>(), n_slots, acts->bytes(), d_ident->as<int32_t>(),
                       ey.as<float>(), rows, s());
        moe_combine(ey.as<float>(), wts->as<float>(), nt, k, rows, ref.as<float>(), s());
        sync();
        auto a = y.down<float>(static_cast<size_t>(ld) * nt), b = ref.down<float>(static_cast<size_t>(nt) * rows);
        for (int tk = 0; tk < nt; ++tk)
          for (int64_t r = 0; r < ld; ++r) {
            if (r >= rows) ASSERT_TRUE(is_poison(a[tk * ld + r])) << "wrote past the rows";
            else ASSERT_EQ(bits(a[tk * ld + r]), bits(b[tk * rows + r])) << "token " << tk << " row " << r;
          }
        // No slot map (every expert on the device in id order; the kernel then also hints its rows into
        // L2 before its wait): matrix = expert id, the bits of an identity map. A choice out of range
        // (what NaN logits leave) gives its token NaN rows instead of a read past the matrices.
        std::vector<int32_t> identity(9);
        for (int e = 0; e < 9; ++e) identity[e] = e;
        std::vector<int32_t> bad_ids = ids;
        bad_ids[1] = std::numeric_limits<int32_t>::max();  // token 0's slot 1
        auto d_idm = upload(identity), d_bad = upload(bad_ids);
        Dev y_none(static_cast<size_t>(ld) * nt * 4), y_idm(static_cast<size_t>(ld) * nt * 4),
            y_bad(static_cast<size_t>(ld) * nt * 4);
        matvec_experts_combine(m, d_ids->as<int32_t>(), nullptr, nt, k, acts->bytes(), wts->as<float>(),
                               y_none.as<float>(), ld, s());
        matvec_experts_combine(m, d_ids->as<int32_t>(), d_idm->as<int32_t>(), nt, k, acts->bytes(), wts->as<float>(),
                               y_idm.as<float>(), ld, s());
        matvec_experts_combine(m, d_bad->as<int32_t>(), nullptr, nt, k, acts->bytes(), wts->as<float>(),
                               y_bad.as<float>(), ld, s());
        sync();
        auto yn = y_none.down<float>(static_cast<size_t>(ld) * nt), yi = y_idm.down<float>(static_cast<size_t>(ld) * nt),
             yb = y_bad.down<float>(static_cast<size_t>(ld) * nt);
        // With a slot map, "no choice" (-1, what the routing writes for NaN logits) gives NaN rows too,
        // without reading the map.
        std::vector<int32_t> none_ids = ids;
        none_ids[1] = -1;
        auto d_none = upload(none_ids);
        Dev y_map_none(static_cast<size_t>(ld) * nt * 4);
        matvec_experts_combine(m, d_none->as<int32_t>(), d_slot->as<int32_t>(), nt, k, acts->bytes(), wts->as<float>(),
                               y_map_none.as<float>(), ld, s());
        sync();
        auto ymn = y_map_none.down<float>(static_cast<size_t>(ld) * nt);
        for (int64_t r = 0; r < rows; ++r)
          ASSERT_TRUE(std::isnan(ymn[r]) && !is_poison(ymn[r])) << "no choice with a map: row " << r;
        for (int tk = 0; tk < nt; ++tk)
          for (int64_t r = 0; r < rows; ++r) {
            ASSERT_EQ(bits(yn[tk * ld + r]), bits(yi[tk * ld + r])) << "no map: token " << tk << " row " << r;
            if (tk == 0) ASSERT_TRUE(std::isnan(yb[r]) && !is_poison(yb[r])) << "out of range: row " << r;
            else ASSERT_EQ(bits(yb[tk * ld + r]), bits(yn[tk * ld + r])) << "out of range: token " << tk << " row " << r;
          }
      }
    }
  }
}

// The hand-over from the CPU's experts: the kernel waits for the flag to reach the epoch (here set by
// the host while the kernel is already waiting), then copies exactly the host slots' rows; device
// slots' rows stay untouched. A second round with a new epoch must wait again (the old flag value
// does not count) and see the new rows.
// The hand-over with the combination: it waits for the flag, then adds to x the slots' rows in slot
// order, device-resident experts' rows from ey, the GPU's share from ey_host and the CPU's straight
// from pinned memory: the very bits of residual_norm's combination over one buffer holding every row.
// Rows that must not be read (the other sources' copies of a slot) are NaN.
TEST_F(GpuOps, HandoverCombineWaitsForTheFlagAndAddsEverySlot) {
  const int width = 2048 + 4, nt = 2, k = 4, n_slots = nt * k, n_expert = 8;  // (a width with a partial piece)
  const std::vector<int32_t> ids = {3, 0, 5, 1, 2, 4, 6, 7};
  const std::vector<int32_t> slot_of = {0, -1, 1, -1, -1, 2, 3, -1};  // experts 1, 3, 4, 7 on the host
  const std::vector<int32_t> gpu_slots = {3, -1, -1, -1, -1, -1, -1, 7};  // the GPU computed 3 and 7
  const std::vector<float> all = randn(static_cast<size_t>(n_slots) * width, 501), x0 = randn(static_cast<size_t>(nt) * width, 502, 2.0f),
                           wts = randn(n_slots, 503, 0.3f);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> ey(all.size(), nan), ey_host(all.size(), nan);
  for (int j = 0; j < n_slots; ++j) {
    const bool host = slot_of[ids[j]] < 0, by_gpu = gpu_slots[j] >= 0;
    std::vector<float>& dst = !host ? ey : ey_host;
    if (!host || by_gpu) std::copy_n(all.begin() + static_cast<size_t>(j) * width, width, dst.begin() + static_cast<size_t>(j) * width);
  }
  auto d_ids = upload(ids), d_slot = upload(slot_of), d_gpu = upload(gpu_slots), d_ey = upload(ey),
       d_ey_host = upload(ey_host), d_wts = upload(wts), d_all = upload(all);
  float* rows = nullptr;
  unsigned* flag = nullptr;
  ASSERT_EQ(cudaMallocHost(&rows, sizeof(float) * n_slots * width), cudaSuccess);
  ASSERT_EQ(cudaMallocHost(&flag, sizeof(unsigned)), cudaSuccess);
  *flag = 0;
  Dev epoch(sizeof(unsigned));
  void *d_rows = nullptr, *d_flag = nullptr;
  ASSERT_EQ(cudaHostGetDevicePointer(&d_rows, rows, 0), cudaSuccess);
  ASSERT_EQ(cudaHostGetDevicePointer(&d_flag, flag, 0), cudaSuccess);
  for (unsigned round = 1; round <= 2; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    epoch.up(&round, sizeof(unsigned));
    for (int i = 0; i < n_slots * width; ++i) rows[i] = nan;  // not yet the outputs
    auto dx = upload(x0), dx_ref = upload(x0);
    handover_combine(static_cast<const unsigned*>(d_flag), epoch.as<unsigned>(), static_cast<const float*>(d_rows),
                     d_ey->as<float>(), d_ey_host->as<float>(), d_ids->as<int32_t>(), d_slot->as<int32_t>(), n_expert,
                     d_gpu->as<int32_t>(), d_wts->as<float>(), k, dx->as<float>(), nt, width, s());
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    EXPECT_EQ(cudaStreamQuery(static_cast<cudaStream_t>(s())), cudaErrorNotReady) << "did not wait for the flag";
    for (int j = 0; j < n_slots; ++j)  // the CPU's rows (only its slots: the others stay NaN)
      if (slot_of[ids[j]] < 0 && gpu_slots[j] < 0)
        std::copy_n(all.begin() + static_cast<size_t>(j) * width, width, rows + static_cast<size_t>(j) * width);
    std::atomic_ref<unsigned>(*flag).store(round, std::memory_order_release);
    residual_norm(dx_ref->as<float>(), nullptr, d_all->as<float>(), d_wts->as<float>(), k, nullptr, nullptr, width, nt,
                  1e-6f, s());
    sync();
    auto got = dx->down<float>(x0.size()), want = dx_ref->down<float>(x0.size());
    for (size_t i = 0; i < x0.size(); ++i) ASSERT_EQ(bits(got[i]), bits(want[i])) << "x at " << i;
  }
  cudaFreeHost(rows);
  cudaFreeHost(flag);
}

TEST_F(GpuOps, MatvecRejectsBadInput) {
  HostMatrix hw = random_matrix(DType::Q4_K, 4, 256, 1, 1);
  Dev dw(hw.data.size());
  Dev da(4096), dy(4096);
  DevMatrix m = dev_matrix(hw, dw);
  EXPECT_THROW(matvec(m, da.as(), kMaxVecTokens + 1, dy.as<float>(), 4, s()), Error);
  DevMatrix bad = m;
  bad.type = DType::Q8_K;  // an activation type, not a weight type
  bad.row_bytes = row_bytes(DType::Q8_K, 256);
  EXPECT_THROW(matvec(bad, da.as(), 1, dy.as<float>(), 4, s()), Error);
}

// ================================ prefill matmul ==================================================

float round_f16(float v) { return f16_to_f32(f32_to_f16(v)); }
float round_bf16(float v) { return bf16_to_f32(f32_to_bf16(v)); }

// Scratch given to matmul: the header's minimum (dequant_scratch_bytes, through the overload without a
// size), the size for one GEMM (matmul_scratch_bytes), or a tight one that forces row tiles and token chunks.
enum class ScratchMode { Minimum, Full, Tight };

void check_matmul(Stream s, std::function<void()> sync, DType t, int64_t n, int64_t rows, int64_t n_mats,
                  int64_t mat, int nt, uint64_t seed, ScratchMode mode = ScratchMode::Minimum) {
  HostMatrix hw = random_matrix(t, rows, n, n_mats, seed);
  Dev dw(hw.data.size());
  dw.up(hw.data.data(), hw.data.size());
  const int64_t ld_x = n + 4, ld_y = rows + 3;
  std::vector<float> x = randn(static_cast<size_t>(ld_x) * nt, seed + 3);
  auto dx = upload(x);
  Dev dy(static_cast<size_t>(ld_y) * nt * sizeof(float));
  DevMatrix m = dev_matrix(hw, dw);
  const size_t sb = mode == ScratchMode::Minimum ? dequant_scratch_bytes(m)
                    : mode == ScratchMode::Full  ? matmul_scratch_bytes(m, nt)
                                                 : static_cast<size_t>(n) * 2 * 12;
  Dev scratch(sb);
  if (mode == ScratchMode::Minimum) matmul(m, mat, dx->as<float>(), ld_x, nt, dy.as<float>(), ld_y, scratch.as(), s);
  else matmul(m, mat, dx->as<float>(), ld_x, nt, dy.as<float>(), ld_y, scratch.as(), sb, s);
  sync();
  auto y = dy.down<float>(static_cast<size_t>(ld_y) * nt);
  // operands as the GPU multiplies them: quantized weights' activations rounded as the reference's
  // (its 8-bit activation blocks), then to f16
  auto rnd = [&](float v) { return t == DType::F32 ? v : t == DType::BF16 ? round_bf16(v) : round_f16(v); };
  const DType act = dtype_info(t).act_type;
  const bool q8 = rounds_acts(act);
  std::vector<float> xr(static_cast<size_t>(n) * nt);
  std::vector<uint8_t> blk(row_bytes(act, n));
  for (int tk = 0; tk < nt; ++tk) {
    if (q8) {
      quant::quantize_act_row_ref(act, x.data() + tk * ld_x, blk.data(), n);
      quant::dequantize_row_ref(act, blk.data(), xr.data() + tk * n, n);
    } else {
      std::copy(x.begin() + tk * ld_x, x.begin() + tk * ld_x + n, xr.begin() + tk * n);
    }
    for (int64_t i = 0; i < n; ++i) xr[tk * n + i] = rnd(xr[tk * n + i]);
  }
  std::vector<float> wf(n);
  const double rel = t == DType::F32 ? 1e-5 : 1e-4;
  int bad = 0;
  for (int64_t r = 0; r < rows; ++r) {
    quant::dequantize_row_ref(t, hw.row(mat, r), wf.data(), n);
    for (int tk = 0; tk < nt; ++tk) {
      double exact = 0, exact_f32 = 0, scale = 0;
      for (int64_t i = 0; i < n; ++i) {
        exact += static_cast<double>(rnd(wf[i])) * xr[tk * n + i];
        exact_f32 += static_cast<double>(wf[i]) * x[tk * ld_x + i];
        scale += std::fabs(static_cast<double>(wf[i]) * x[tk * ld_x + i]);
      }
      const float got = y[tk * ld_y + r];
      if (!(std::fabs(got - exact) <= rel * scale + 1e-30) && bad++ < 5)
        ADD_FAILURE() << dtype_name(t) << " rows=" << rows << " tokens=" << nt << ": row " << r << " token " << tk
                      << " got " << got << " want " << exact << " (scale " << scale << ")";
      if (!(std::fabs(got - exact_f32) <= (q8 ? 1e-2 : 2e-3) * scale + 1e-30) && bad++ < 5)
        ADD_FAILURE() << dtype_name(t) << ": row " << r << " token " << tk << " far from the f32 product";
    }
  }
  for (int tk = 0; tk < nt; ++tk)
    for (int64_t r = rows; r < ld_y; ++r)
      if (!is_poison(y[tk * ld_y + r]) && bad++ < 5) ADD_FAILURE() << dtype_name(t) << ": wrote past the rows";
}

TEST_F(GpuOps, MatmulEveryTypeMatchesRoundedProduct) {
  for (DType t : kWeightTypes) {
    uint64_t seed = 500 + static_cast<uint64_t>(t) * 10;
    check_matmul(s(), [this] { sync(); }, t, 512, 100, 1, 0, 9, seed);
    check_matmul(s(), [this] { sync(); }, t, 512, 37, 3, 2, 70, seed + 1);  // third matrix of a stack
    check_matmul(s(), [this] { sync(); }, t, 512, 100, 1, 0, 70, seed + 2, ScratchMode::Full);
    check_matmul(s(), [this] { sync(); }, t, 512, 100, 2, 1, 70, seed + 3, ScratchMode::Tight);
  }
}

TEST_F(GpuOps, MatmulTilesLargeMatrices) {
  // 8200 x 4096 dequantizes to 67 MB of f16: more than one 64 MiB tile.
  check_matmul(s(), [this] { sync(); }, DType::Q4_0, 4096, 8200, 1, 0, 9, 4242);
}

// ================================ embeddings ======================================================

TEST_F(GpuOps, EmbedRowsBitExact) {
  for (DType t : kWeightTypes) {
    const int64_t n = 512, rows = 50;
    HostMatrix hw = random_matrix(t, rows, n, 1, 31 + static_cast<uint64_t>(t));
    Dev dw(hw.data.size());
    dw.up(hw.data.data(), hw.data.size());
    const std::vector<int32_t> ids = {3, 0, 49, 17, 3};
    auto d_ids = upload(ids);
    Dev out(ids.size() * n * sizeof(float));
    embed_rows(dev_matrix(hw, dw), d_ids->as<int32_t>(), static_cast<int>(ids.size()), out.as<float>(), s());
    sync();
    auto got = out.down<float>(ids.size() * n);
    std::vector<float> ref(n);
    int bad = 0;
    for (size_t k = 0; k < ids.size(); ++k) {
      quant::dequantize_row_ref(t, hw.row(0, ids[k]), ref.data(), n);
      for (int64_t i = 0; i < n; ++i)
        if (bits(got[k * n + i]) != bits(ref[i]) && bad++ < 5)
          ADD_FAILURE() << dtype_name(t) << ": row " << k << " value " << i << " got " << got[k * n + i] << " want "
                        << ref[i];
    }
  }
}

// ================================ elementwise =====================================================

// Within `ulps` units in the last place (both finite).
bool near_ulps(float a, float b, int ulps) {
  if (a == b) return true;
  if (!std::isfinite(a) || !std::isfinite(b) || (a < 0) != (b < 0)) return false;
  return std::abs(static_cast<int64_t>(bits(a)) - static_cast<int64_t>(bits(b))) <= ulps;
}

TEST_F(GpuOps, RmsNorm) {
  const int n = 2048, rows = 5;
  const int64_t ld_x = n + 8, ld_y = n + 16;
  std::vector<float> x = randn(static_cast<size_t>(ld_x) * rows, 11, 3.0f);
  std::vector<float> w = randn(n, 12);
  auto dx = upload(x);
  auto dw = upload(w);
  for (bool with_w : {true, false}) {
    Dev dy(static_cast<size_t>(ld_y) * rows * sizeof(float));
    rms_norm(dx->as<float>(), with_w ? dw->as<float>() : nullptr, dy.as<float>(), n, rows, 1e-6f, ld_x, ld_y, s());
    sync();
    auto got = dy.down<float>(static_cast<size_t>(ld_y) * rows);
    std::vector<float> ref(static_cast<size_t>(ld_y) * rows, 0.0f);
    cpu::rms_norm(x.data(), with_w ? w.data() : nullptr, ref.data(), n, rows, 1e-6f, ld_x, ld_y);
    int bad = 0;
    for (int r = 0; r < rows; ++r)
      for (int i = 0; i < n; ++i)
        if (!near_ulps(got[r * ld_y + i], ref[r * ld_y + i], 1) && bad++ < 5)
          ADD_FAILURE() << "row " << r << " i " << i << " got " << got[r * ld_y + i] << " want " << ref[r * ld_y + i];
  }
  // in place
  std::vector<float> xin = randn(static_cast<size_t>(n) * 2, 13);
  auto dxin = upload(xin);
  rms_norm(dxin->as<float>(), dw->as<float>(), dxin->as<float>(), n, 2, 1e-5f, n, n, s());
  sync();
  auto got = dxin->down<float>(static_cast<size_t>(n) * 2);
  std::vector<float> ref(static_cast<size_t>(n) * 2);
  cpu::rms_norm(xin.data(), w.data(), ref.data(), n, 2, 1e-5f, n, n);
  for (int i = 0; i < 2 * n; ++i) ASSERT_TRUE(near_ulps(got[i], ref[i], 1)) << i;
}

TEST_F(GpuOps, AddAndSwiglu) {
  const int64_t n = 10007;
  std::vector<float> a = randn(n, 21, 4.0f), b = randn(n, 22, 2.0f);
  auto da = upload(a);
  auto db = upload(b);
  Dev out(n * sizeof(float));
  swiglu(da->as<float>(), db->as<float>(), out.as<float>(), n, s());
  sync();
  auto got = out.down<float>(n);
  std::vector<float> ref(n);
  cpu::swiglu(a.data(), b.data(), ref.data(), n);
  for (int64_t i = 0; i < n; ++i)
    ASSERT_LE(std::fabs(got[i] - ref[i]), 6e-7 * std::fabs(ref[i]) + 1e-30) << i << " " << got[i] << " " << ref[i];
  add(da->as<float>(), db->as<float>(), n, s());
  sync();
  auto sum = da->down<float>(n);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(bits(sum[i]), bits(a[i] + b[i])) << i;
}

TEST_F(GpuOps, RopeNeox) {
  const int n_heads = 4;
  const std::vector<int32_t> pos = {0, 1, 7, 1000, 31999};
  const int nt = static_cast<int>(pos.size());
  auto d_pos = upload(pos);
  for (int head_dim : {128, 64}) {
    for (int n_rot : {head_dim, head_dim / 2}) {
      const int64_t ld = n_heads * head_dim + 8;
      std::vector<float> x = randn(static_cast<size_t>(ld) * nt, 41 + n_rot);
      auto dx = upload(x);
      rope_neox(dx->as<float>(), nt, n_heads, head_dim, ld, n_rot, d_pos->as<int32_t>(), RopeParams{1000000.0f}, s());
      sync();
      auto got = dx->down<float>(static_cast<size_t>(ld) * nt);
      std::vector<float> ref = x;
      for (int t = 0; t < nt; ++t) cpu::rope_neox(ref.data() + t * ld, 1, n_heads, head_dim, ld, n_rot, pos[t], RopeParams{1000000.0f});
      int bad = 0;
      for (int t = 0; t < nt; ++t)
        for (int h = 0; h < n_heads; ++h)
          for (int i = 0; i < head_dim; ++i) {
            const int64_t k = t * ld + h * head_dim + i;
            const int half = n_rot / 2;
            double mag = std::fabs(x[k]);
            if (i < n_rot) mag = std::fabs(x[t * ld + h * head_dim + (i % half)]) + std::fabs(x[t * ld + h * head_dim + (i % half) + half]);
            if (!(std::fabs(got[k] - ref[k]) <= 1e-6 * mag) && bad++ < 5)
              ADD_FAILURE() << "hd " << head_dim << " n_rot " << n_rot << " t " << t << " h " << h << " i " << i << ": got "
                            << got[k] << " want " << ref[k];
          }
    }
  }
}

// The fused block end must give the very bits of the unfused ops (add / moe_combine, then rms_norm),
// which the tests above hold against the CPU reference.
TEST_F(GpuOps, ResidualNormEqualsAddCombineAndNorm) {
  // n = 2560: rows that end part way through the kernel's batched loads. k = 8 and the generic path.
  for (int k : {8, 10}) residual_norm_case(k, 2560);
  residual_norm_case(8, 5120);  // wider than the rows kept in registers (4096 values)
}

void GpuOps::residual_norm_case(int k, int n) {
  SCOPED_TRACE("k " + std::to_string(k) + " n " + std::to_string(n));
  const int rows = 3;
  std::vector<float> x = randn(static_cast<size_t>(n) * rows, 301, 2.0f), y = randn(static_cast<size_t>(n) * rows, 302);
  std::vector<float> ey = randn(static_cast<size_t>(n) * rows * k, 303), wts = randn(static_cast<size_t>(rows) * k, 304, 0.3f);
  std::vector<float> w = randn(n, 305);
  auto dy = upload(y);
  auto dey = upload(ey);
  auto dwts = upload(wts);
  auto dw = upload(w);
  for (int combine = 0; combine < 2; ++combine)
    for (int variant = 0; variant < 3; ++variant) {  // with weight, without weight, no norm at all
      auto dx_fused = upload(x), dx_ref = upload(x);
      Dev xn_fused(x.size() * 4), xn_ref(x.size() * 4), tmp(x.size() * 4);
      const float* wp = variant == 0 ? dw->as<float>() : nullptr;
      float* xnp = variant == 2 ? nullptr : xn_fused.as<float>();
      residual_norm(dx_fused->as<float>(), combine ? nullptr : dy->as<float>(), combine ? dey->as<float>() : nullptr,
                    combine ? dwts->as<float>() : nullptr, combine ? k : 0, wp, xnp, n, rows, 1e-6f, s());
      if (combine) {
        moe_combine(dey->as<float>(), dwts->as<float>(), rows, k, n, tmp.as<float>(), s());
        add(dx_ref->as<float>(), tmp.as<float>(), static_cast<int64_t>(n) * rows, s());
      } else {
        add(dx_ref->as<float>(), dy->as<float>(), static_cast<int64_t>(n) * rows, s());
      }
      if (variant != 2) rms_norm(dx_ref->as<float>(), wp, xn_ref.as<float>(), n, rows, 1e-6f, n, n, s());
      // Variant 0 also asks for xn in Q8_K: the bytes quantize_acts gives.
      const size_t qbytes = row_bytes(DType::Q8_K, n) * rows;
      Dev xq_fused(qbytes), xq_ref(qbytes);
      if (variant == 0) {
        auto dx_q = upload(x);
        residual_norm(dx_q->as<float>(), combine ? nullptr : dy->as<float>(), combine ? dey->as<float>() : nullptr,
                      combine ? dwts->as<float>() : nullptr, combine ? k : 0, wp, tmp.as<float>(), n, rows, 1e-6f, s(),
                      xq_fused.as());
        quantize_acts(DType::Q8_K, xn_ref.as<float>(), n, rows, n, xq_ref.as(), s());
      }
      sync();
      if (variant == 0) {
        auto a = xq_fused.down<uint8_t>(qbytes), b = xq_ref.down<uint8_t>(qbytes);
        for (size_t i = 0; i < qbytes; ++i) ASSERT_EQ(a[i], b[i]) << "Q8_K copy of xn, combine " << combine << " byte " << i;
      }
      auto gx = dx_fused->down<float>(x.size()), rx = dx_ref->down<float>(x.size());
      auto gn = xn_fused.down<float>(x.size()), rn = xn_ref.down<float>(x.size());
      for (size_t i = 0; i < x.size(); ++i) {
        ASSERT_EQ(bits(gx[i]), bits(rx[i])) << "x, combine " << combine << " variant " << variant << " at " << i;
        if (variant == 2) ASSERT_TRUE(is_poison(gn[i])) << "xn written without a norm, at " << i;
        else ASSERT_EQ(bits(gn[i]), bits(rn[i])) << "xn, combine " << combine << " variant " << variant << " at " << i;
      }
    }
  EXPECT_THROW(residual_norm(nullptr, nullptr, nullptr, nullptr, 0, nullptr, nullptr, n, 1, 1e-6f, s()), Error);

  // Neither y nor ey: x is only normed (and left as it is, bit for bit).
  auto dx_only = upload(x);
  Dev xn_only(x.size() * 4), xn_ref2(x.size() * 4);
  residual_norm(dx_only->as<float>(), nullptr, nullptr, nullptr, 0, dw->as<float>(), xn_only.as<float>(), n, rows, 1e-6f,
                s());
  auto dx_ref2 = upload(x);
  rms_norm(dx_ref2->as<float>(), dw->as<float>(), xn_ref2.as<float>(), n, rows, 1e-6f, n, n, s());
  sync();
  auto xo = dx_only->down<float>(x.size()), no = xn_only.down<float>(x.size()), nr = xn_ref2.down<float>(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    ASSERT_EQ(bits(xo[i]), bits(x[i])) << "x changed at " << i;
    ASSERT_EQ(bits(no[i]), bits(nr[i])) << "norm only, at " << i;
  }
}

// A deferred add: residual_norm with y0 gives x = (x + y0) + y, the bits of add(x, y0) then
// residual_norm(x, y), and the same xn and Q8_K copy.
TEST_F(GpuOps, ResidualNormWithDeferredAddEqualsAddThenResidualNorm) {
  for (int n : {2048, 2560, 5120}) {
    SCOPED_TRACE("n " + std::to_string(n));
    const int rows = 2;
    std::vector<float> x = randn(static_cast<size_t>(n) * rows, 311, 2.0f);
    auto dy0 = upload(randn(x.size(), 312)), dy = upload(randn(x.size(), 313)), dw = upload(randn(n, 314));
    auto dx_a = upload(x), dx_b = upload(x);
    const size_t qbytes = row_bytes(DType::Q8_K, n) * rows;
    Dev xn_a(x.size() * 4), xn_b(x.size() * 4), xq_a(qbytes), xq_b(qbytes);
    residual_norm(dx_a->as<float>(), dy->as<float>(), nullptr, nullptr, 0, dw->as<float>(), xn_a.as<float>(), n, rows,
                  1e-6f, s(), xq_a.as(), dy0->as<float>());
    add(dx_b->as<float>(), dy0->as<float>(), static_cast<int64_t>(x.size()), s());
    residual_norm(dx_b->as<float>(), dy->as<float>(), nullptr, nullptr, 0, dw->as<float>(), xn_b.as<float>(), n, rows,
                  1e-6f, s(), xq_b.as());
    sync();
    auto xa = dx_a->down<float>(x.size()), xb = dx_b->down<float>(x.size());
    auto na = xn_a.down<float>(x.size()), nb = xn_b.down<float>(x.size());
    for (size_t i = 0; i < x.size(); ++i) {
      ASSERT_EQ(bits(xa[i]), bits(xb[i])) << "x at " << i;
      ASSERT_EQ(bits(na[i]), bits(nb[i])) << "xn at " << i;
    }
    auto qa = xq_a.down<uint8_t>(qbytes), qb = xq_b.down<uint8_t>(qbytes);
    for (size_t i = 0; i < qbytes; ++i) ASSERT_EQ(qa[i], qb[i]) << "Q8_K byte " << i;
  }
  Dev buf(4096);
  EXPECT_THROW(residual_norm(buf.as<float>(), nullptr, nullptr, nullptr, 0, nullptr, buf.as<float>(), 256, 1, 1e-6f, s(),
                             nullptr, buf.as<float>()),
               Error);  // y0 without y
}

// The router's launch doing the residual add and the FFN norm: the logits of residual_norm + matvec,
// the Q8_K bytes residual_norm writes, x untouched; widths from one Q8_K block to the limit, a
// router with more rows than blocks and one with exactly as many.
TEST_F(GpuOps, ResidualNormRouterEqualsResidualNormAndMatvec) {
  for (int n : {256, 2048, 4096}) {
    for (int n_expert : {128, n / 256}) {
      SCOPED_TRACE("n " + std::to_string(n) + " experts " + std::to_string(n_expert));
      std::vector<float> x = randn(n, 321 + n, 2.0f);
      auto dy = upload(randn(n, 322)), dw = upload(randn(n, 323));
      HostMatrix r = random_matrix(DType::F32, n_expert, n, 1, 324);
      auto dr = upload(r.data);
      DevMatrix m = dev_matrix(r, *dr);
      auto dx_a = upload(x), dx_b = upload(x);
      const size_t qbytes = row_bytes(DType::Q8_K, n);
      Dev la(static_cast<size_t>(n_expert) * 4), lb(static_cast<size_t>(n_expert) * 4), qa(qbytes), qb(qbytes),
          xn(static_cast<size_t>(n) * 4);
      residual_norm_router(dx_a->as<float>(), dy->as<float>(), dw->as<float>(), n, 1e-6f, m, la.as<float>(), qa.as(), s());
      residual_norm(dx_b->as<float>(), dy->as<float>(), nullptr, nullptr, 0, dw->as<float>(), xn.as<float>(), n, 1,
                    1e-6f, s(), qb.as());
      matvec(m, xn.as(), 1, lb.as<float>(), n_expert, s());
      sync();
      auto a = la.down<float>(n_expert), b = lb.down<float>(n_expert);
      for (int e = 0; e < n_expert; ++e) ASSERT_EQ(bits(a[e]), bits(b[e])) << "logit " << e;
      auto ba = qa.down<uint8_t>(qbytes), bb = qb.down<uint8_t>(qbytes);
      for (size_t i = 0; i < qbytes; ++i) ASSERT_EQ(ba[i], bb[i]) << "Q8_K byte " << i;
      auto xa = dx_a->down<float>(n);
      for (int i = 0; i < n; ++i) ASSERT_EQ(bits(xa[i]), bits(x[i])) << "x changed at " << i;
    }
  }
  HostMatrix q = random_matrix(DType::Q4_K, 128, 2048, 1, 325);
  auto dq = upload(q.data);
  Dev buf(1 << 16);
  EXPECT_THROW(residual_norm_router(buf.as<float>(), buf.as<float>(), buf.as<float>(), 2048, 1e-6f, dev_matrix(q, *dq),
                                    buf.as<float>(), buf.as(), s()),
               Error);  // not an F32 router
  HostMatrix wide = random_matrix(DType::F32, 8, 4352, 1, 326);
  auto dwide = upload(wide.data);
  EXPECT_THROW(residual_norm_router(buf.as<float>(), buf.as<float>(), buf.as<float>(), 4352, 1e-6f,
                                    dev_matrix(wide, *dwide), buf.as<float>(), buf.as(), s()),
               Error);  // wider than 4096
}

// The fused attention prologue against rms_norm + rope_neox + kv_store on copies: the same bits in q
// and in both caches, nothing else of the cache written.
TEST_F(GpuOps, QkNormRopeStoreEqualsTheUnfusedOps) {
  const int n_head = 8, n_head_kv = 2, n_ctx = 64;
  const std::vector<int32_t> pos = {3, 4, 5, 40, 63};
  const int nt = static_cast<int>(pos.size());
  auto d_pos = upload(pos);
  for (DType cache : {DType::F16, DType::F32})
    for (int hd : {128, 64})
      for (int n_rot : {hd, hd / 2}) {
        const int hdv = hd, qw = n_head * hd, kw = n_head_kv * hd, vw = n_head_kv * hdv;
        const float base = 1000000.0f, eps = 1e-6f;
        std::vector<float> q = randn(static_cast<size_t>(qw) * nt, 311 + hd + n_rot, 2.0f);
        std::vector<float> kk = randn(static_cast<size_t>(kw) * nt, 312 + hd), v = randn(static_cast<size_t>(vw) * nt, 313);
        std::vector<float> qn = randn(hd, 314), kn = randn(hd, 315);
        auto dq_f = upload(q), dq_r = upload(q), dk = upload(kk), dk_r = upload(kk), dv = upload(v);
        auto dqn = upload(qn), dkn = upload(kn);
        const size_t es = cache == DType::F16 ? 2 : 4;
        Dev kc_f(static_cast<size_t>(n_ctx) * kw * es), vc_f(static_cast<size_t>(n_ctx) * vw * es);
        Dev kc_r(static_cast<size_t>(n_ctx) * kw * es), vc_r(static_cast<size_t>(n_ctx) * vw * es);
        DevKv kv_f{cache, kc_f.bytes(), vc_f.bytes(), n_ctx}, kv_r{cache, kc_r.bytes(), vc_r.bytes(), n_ctx};
        qk_norm_rope_store(dq_f->as<float>(), qw, dk->as<float>(), kw, dv->as<float>(), vw, dqn->as<float>(),
                           dkn->as<float>(), kv_f, d_pos->as<int32_t>(), nt, n_head, n_head_kv, hd, hdv, n_rot,
                           RopeParams{base}, eps, s());
        rms_norm(dq_r->as<float>(), dqn->as<float>(), dq_r->as<float>(), hd, nt * n_head, eps, hd, hd, s());
        rms_norm(dk_r->as<float>(), dkn->as<float>(), dk_r->as<float>(), hd, nt * n_head_kv, eps, hd, hd, s());
        rope_neox(dq_r->as<float>(), nt, n_head, hd, qw, n_rot, d_pos->as<int32_t>(), RopeParams{base}, s());
        rope_neox(dk_r->as<float>(), nt, n_head_kv, hd, kw, n_rot, d_pos->as<int32_t>(), RopeParams{base}, s());
        kv_store(kv_r, d_pos->as<int32_t>(), nt, dk_r->as<float>(), kw, dv->as<float>(), vw, n_head_kv, hd, hdv, s());
        sync();
        const std::string what = std::string(cache == DType::F16 ? "f16" : "f32") + " hd " + std::to_string(hd) +
                                  " n_rot " + std::to_string(n_rot);
        auto gq = dq_f->down<float>(q.size()), rq = dq_r->down<float>(q.size());
        for (size_t i = 0; i < q.size(); ++i) ASSERT_EQ(bits(gq[i]), bits(rq[i])) << what << " q at " << i;
        auto gk = kc_f.down<uint8_t>(kc_f.size()), rk = kc_r.down<uint8_t>(kc_r.size());
        auto gv = vc_f.down<uint8_t>(vc_f.size()), rv = vc_r.down<uint8_t>(vc_r.size());
        ASSERT_EQ(gk, rk) << what << ": K cache differs";  // includes the untouched (poisoned) rows
        ASSERT_EQ(gv, rv) << what << ": V cache differs";
      }
}

// The weights' page-locked memory in huge pages: uploads and the GPU's reads over the bus (device_view)
// see what the host wrote, and a size that is not a multiple of the page works.
TEST_F(GpuOps, HugePinnedMemoryUploadsAndMaps) {
  const size_t n = (5u << 20) + 12;
  auto* h = static_cast<uint8_t*>(alloc_pinned_huge(n));
  ASSERT_NE(h, nullptr);
  for (size_t i = 0; i < n; ++i) h[i] = static_cast<uint8_t>(i * 131 + 7);
  Dev d(n);
  copy_h2d(d.as(), h, n, s());
  sync();
  auto got = d.down<uint8_t>(n);
  for (size_t i = 0; i < n; i += 4099) ASSERT_EQ(got[i], h[i]) << "uploaded byte " << i;
  ASSERT_EQ(got[n - 1], h[n - 1]);
  // Through the mapping: a device-to-device copy from the device view reads the host's bytes.
  Dev d2(n);
  copy_d2d(d2.as(), device_view(h), n, s());
  sync();
  auto got2 = d2.down<uint8_t>(n);
  for (size_t i = 0; i < n; i += 4099) ASSERT_EQ(got2[i], h[i]) << "mapped byte " << i;
  free_pinned_huge(h);
}

TEST_F(GpuOps, CopyRows) {
  const int width = 300, n_src = 6;
  const int64_t ld_src = 320, ld_dst = 310;
  std::vector<float> src = randn(static_cast<size_t>(ld_src) * n_src, 51);
  auto dsrc = upload(src);
  const std::vector<int32_t> src_rows = {5, 0, 3}, dst_rows = {1, 4, 2};
  auto dsr = upload(src_rows);
  auto ddr = upload(dst_rows);
  for (int mode = 0; mode < 3; ++mode) {
    Dev dst(static_cast<size_t>(ld_dst) * 6 * sizeof(float));
    const int32_t* sr = mode == 1 ? nullptr : dsr->as<int32_t>();
    const int32_t* dr = mode == 2 ? nullptr : ddr->as<int32_t>();
    copy_rows(dsrc->as<float>(), ld_src, sr, dst.as<float>(), ld_dst, dr, 3, width, s());
    sync();
    auto got = dst.down<float>(static_cast<size_t>(ld_dst) * 6);
    for (int row = 0; row < 6; ++row) {
      int i = -1;
      for (int k = 0; k < 3; ++k)
        if ((dr ? dst_rows[k] : k) == row) i = k;
      for (int c = 0; c < ld_dst; ++c) {
        const float g = got[row * ld_dst + c];
        if (i < 0 || c >= width) {
          ASSERT_TRUE(is_poison(g)) << "mode " << mode << " row " << row << " col " << c;
        } else {
          const int s_row = sr ? src_rows[i] : i;
          ASSERT_EQ(bits(g), bits(src[s_row * ld_src + c])) << "mode " << mode << " row " << row << " col " << c;
        }
      }
    }
  }
}

// ================================ routing =========================================================

// GPU routing (ids, weights: [nt][k]) against cpu::route_softmax_topk on the same logits: the same
// choices, the weights within 1e-6.
void expect_routing_as_cpu(const std::vector<float>& logits, int nt, int n_expert, int k,
                           const std::vector<int32_t>& ids, const std::vector<float>& w) {
  std::vector<int32_t> rid(k);
  std::vector<float> rw(k);
  for (int t = 0; t < nt; ++t) {
    cpu::route_softmax_topk(logits.data() + static_cast<size_t>(t) * n_expert, n_expert, k, true, rid.data(), rw.data());
    for (int j = 0; j < k; ++j) {
      ASSERT_EQ(ids[t * k + j], rid[j]) << "token " << t << " slot " << j;
      ASSERT_LE(std::fabs(w[t * k + j] - rw[j]), 1e-6 * std::fabs(rw[j]) + 1e-30) << "token " << t << " slot " << j;
    }
  }
}

// The routing alone for expert counts on each side of the register kernels' sizes (128, 256, 512 per
// warp) and beyond them (shared memory), against the CPU's.
TEST_F(GpuOps, RouteTopkEveryExpertCount) {
  const int nt = 3;
  for (int n_expert : {60, 128, 200, 256, 512, 700}) {
    for (int k : {1, 8, 32}) {
      SCOPED_TRACE("experts " + std::to_string(n_expert) + " k " + std::to_string(k));
      std::vector<float> logits = randn(static_cast<size_t>(nt) * n_expert, 71 + n_expert + k, 2.0f);
      for (int e = 0; e < n_expert; e += 7) logits[2 * n_expert + e] = 1.5f;  // ties
      auto dl = upload(logits);
      Dev d_ids(static_cast<size_t>(nt) * k * 4), d_w(static_cast<size_t>(nt) * k * 4);
      route_topk(dl->as<float>(), nt, n_expert, k, d_ids.as<int32_t>(), d_w.as<float>(), s());
      sync();
      expect_routing_as_cpu(logits, nt, n_expert, k, d_ids.down<int32_t>(static_cast<size_t>(nt) * k),
                            d_w.down<float>(static_cast<size_t>(nt) * k));
    }
  }
}

TEST_F(GpuOps, RouteTopkAndCombine) {
  const int nt = 7, n_expert = 128, k = 8;
  std::vector<float> logits = randn(static_cast<size_t>(nt) * n_expert, 61, 2.0f);
  for (int e = 0; e < n_expert; ++e) logits[1 * n_expert + e] = 0.25f;        // all equal: lowest indices win
  for (int e = 0; e < 10; ++e) logits[2 * n_expert + 10 * e + 3] = 9.0f;     // ties among the leaders
  logits[3 * n_expert + 77] = 60.0f;                                          // one dominant expert
  auto dl = upload(logits);
  Dev d_ids(static_cast<size_t>(nt) * k * 4), d_w(static_cast<size_t>(nt) * k * 4);
  route_topk(dl->as<float>(), nt, n_expert, k, d_ids.as<int32_t>(), d_w.as<float>(), s());
  sync();
  const auto w = d_w.down<float>(static_cast<size_t>(nt) * k);
  expect_routing_as_cpu(logits, nt, n_expert, k, d_ids.down<int32_t>(static_cast<size_t>(nt) * k), w);

  // combine: out[t] = sum_j w[t][j] * y[t*k + j], in j order
  const int n = 1000;
  std::vector<float> y = randn(static_cast<size_t>(nt) * k * n, 62);
  auto dy = upload(y);
  Dev out(static_cast<size_t>(nt) * n * 4);
  moe_combine(dy->as<float>(), d_w.as<float>(), nt, k, n, out.as<float>(), s());
  sync();
  auto got = out.down<float>(static_cast<size_t>(nt) * n);
  for (int t = 0; t < nt; ++t)
    for (int i = 0; i < n; ++i) {
      float o = 0;
      double scale = 0;
      for (int j = 0; j < k; ++j) {
        const float term = y[(static_cast<size_t>(t) * k + j) * n + i] * w[t * k + j];
        o = j == 0 ? term : o + term;
        scale += std::fabs(static_cast<double>(term));
      }
      ASSERT_LE(std::fabs(got[t * n + i] - o), 1e-6 * scale + 1e-30) << t << " " << i;
    }
}

// ================================ KV cache and attention ==========================================

struct AttnCase {
  int n_head, n_head_kv, head_dim, head_dim_v;
  DType cache;
  int pos0, n_tokens;
  bool graph;  // positions from the device, sized by n_kv_max
};

size_t esize(DType t) { return t == DType::F16 ? 2 : 4; }

// shared: a scratch kept across calls (zeroed once by the caller), as the engine keeps one per state.
void run_attention_case(Stream s, std::function<void()> sync, const AttnCase& c, uint64_t seed, Dev* shared = nullptr) {
  SCOPED_TRACE("heads " + std::to_string(c.n_head) + "/" + std::to_string(c.n_head_kv) + " dims " +
               std::to_string(c.head_dim) + "/" + std::to_string(c.head_dim_v) + " " + dtype_name(c.cache) + " pos0 " +
               std::to_string(c.pos0) + " tokens " + std::to_string(c.n_tokens) + (c.graph ? " (graph)" : ""));
  const int n_keys = c.pos0 + c.n_tokens;
  const int n_ctx = (n_keys + 64) / 64 * 64 + 64;  // room beyond the keys: poisoned on the device
  const int kw = c.n_head_kv * c.head_dim, vw = c.n_head_kv * c.head_dim_v;
  const size_t es = esize(c.cache);
  // host cache, filled through cpu::kv_store
  std::vector<uint8_t> hk(static_cast<size_t>(n_ctx) * kw * es, 0), hv(static_cast<size_t>(vw) * n_ctx * es, 0);
  cpu::KvView view{c.cache, hk.data(), hv.data(), n_ctx, static_cast<int64_t>(kw * es)};
  std::vector<float> kin = randn(static_cast<size_t>(n_keys) * kw, seed, 1.0f);
  std::vector<float> vin = randn(static_cast<size_t>(n_keys) * vw, seed + 1, 1.0f);
  // the cache's history (positions < pos0) stored on the host; the new tokens' K/V through the GPU's kv_store
  if (c.pos0 > 0) cpu::kv_store(view, 0, c.pos0, kin.data(), kw, vin.data(), vw, kw, vw);
  Dev dk(hk.size()), dv(hv.size());  // poisoned: positions >= n_keys stay NaN
  if (c.pos0 > 0) {
    dk.up(hk.data(), static_cast<size_t>(c.pos0) * kw * es);
    for (int i = 0; i < vw; ++i) dv.up(hv.data() + static_cast<size_t>(i) * n_ctx * es, static_cast<size_t>(c.pos0) * es, static_cast<size_t>(i) * n_ctx * es);
  }
  cpu::kv_store(view, c.pos0, c.n_tokens, kin.data() + static_cast<size_t>(c.pos0) * kw, kw,
                vin.data() + static_cast<size_t>(c.pos0) * vw, vw, kw, vw);
  std::vector<int32_t> pos(c.n_tokens);
  for (int t = 0; t < c.n_tokens; ++t) pos[t] = c.pos0 + t;
  auto d_pos = upload(pos);
  auto d_knew = upload(std::vector<float>(kin.begin() + static_cast<size_t>(c.pos0) * kw, kin.end()));
  auto d_vnew = upload(std::vector<float>(vin.begin() + static_cast<size_t>(c.pos0) * vw, vin.end()));
  DevKv kv{c.cache, dk.bytes(), dv.bytes(), n_ctx};
  kv_store(kv, d_pos->as<int32_t>(), c.n_tokens, d_knew->as<float>(), kw, d_vnew->as<float>(), vw, c.n_head_kv,
           c.head_dim, c.head_dim_v, s);
  sync();
  {  // the GPU-written part of the cache is byte-identical to cpu::kv_store's
    auto gk = dk.down<uint8_t>(hk.size());
    auto gv = dv.down<uint8_t>(hv.size());
    for (size_t i = static_cast<size_t>(c.pos0) * kw * es; i < static_cast<size_t>(n_keys) * kw * es; ++i)
      ASSERT_EQ(gk[i], hk[i]) << "K byte " << i;
    for (int r = 0; r < vw; ++r)
      for (size_t i = static_cast<size_t>(c.pos0) * es; i < static_cast<size_t>(n_keys) * es; ++i)
        ASSERT_EQ(gv[r * n_ctx * es + i], hv[r * n_ctx * es + i]) << "V row " << r << " byte " << i;
  }

  const int64_t ld_q = static_cast<int64_t>(c.n_head) * c.head_dim + 16;
  const int64_t ld_out = static_cast<int64_t>(c.n_head) * c.head_dim_v + 8;
  std::vector<float> q = randn(static_cast<size_t>(ld_q) * c.n_tokens, seed + 2, 1.0f);
  const float scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  auto dq = upload(q);
  Dev dout(static_cast<size_t>(ld_out) * c.n_tokens * sizeof(float));
  const int n_kv_max = c.graph ? n_ctx : n_keys;
  Dev own(shared ? 1 : attention_scratch_bytes(c.n_tokens, n_kv_max, c.n_head, c.head_dim_v));
  if (!shared) cudaMemset(own.as(), 0, own.size());  // the contract: zero-filled once (decode kernels keep counters there)
  Dev& scratch = shared ? *shared : own;
  const size_t sb = scratch.size();
  ASSERT_GE(sb, attention_scratch_bytes(c.n_tokens, n_kv_max, c.n_head, c.head_dim_v));
  // Decode: also the Q8_K copy of the output where the one-launch kernel writes it.
  const int64_t aw = static_cast<int64_t>(c.n_head) * c.head_dim_v;
  const size_t qrow = aw % 256 == 0 ? row_bytes(DType::Q8_K, aw) : 0;
  Dev oq(qrow * c.n_tokens);
  bool wrote_q = false;
  for (int call = 0; call < 2; ++call) {  // twice: the counters must come back to zero
    wrote_q = attention(dq->as<float>(), ld_q, kv, c.pos0, c.graph ? d_pos->as<int32_t>() : nullptr, c.n_tokens, n_kv_max,
                        c.n_head, c.n_head_kv, c.head_dim, c.head_dim_v, scale, dout.as<float>(), ld_out,
                        sb ? scratch.as() : nullptr, sb, s, qrow ? oq.as() : nullptr);
  }
  sync();
  auto got = dout.down<float>(static_cast<size_t>(ld_out) * c.n_tokens);
  if (c.n_tokens == 1 && c.pos0 < 2048 && aw % 256 == 0 && c.n_head / c.n_head_kv <= 16 &&
      (c.n_head / c.n_head_kv * c.head_dim_v) % 256 == 0) {
    EXPECT_TRUE(wrote_q) << "the short-cache kernel should write the Q8_K output";
  }
  if (wrote_q) {  // byte for byte what quantize_acts makes of the float output
    Dev want(qrow * c.n_tokens);
    quantize_acts(DType::Q8_K, dout.as<float>(), aw, c.n_tokens, ld_out, want.as(), s);
    sync();
    auto a = oq.down<uint8_t>(qrow * c.n_tokens), b = want.down<uint8_t>(qrow * c.n_tokens);
    for (size_t i = 0; i < a.size(); ++i) ASSERT_EQ(a[i], b[i]) << "Q8_K output byte " << i;
  }

  ThreadPool pool(4);
  cpu::Scratch cs;
  std::vector<float> ref(static_cast<size_t>(ld_out) * c.n_tokens, 0.0f);
  cpu::attention(pool, q.data(), ld_q, view, c.pos0, c.n_tokens, c.n_head, c.n_head_kv, c.head_dim, c.head_dim_v, scale,
                 ref.data(), ld_out, cs, 0);

  // Error scale per output: sum_j p_j |v_j| (the softmax in double over the cache-rounded operands),
  // plus one f16 ulp of the largest term: the GPU's expf and glibc's may differ in the last bit, which
  // can flip the f16 rounding of one probability (never happens for an f32 cache).
  const int group = c.n_head / c.n_head_kv;
  auto cached = [&](const uint8_t* p) {  // one element of the cache, as a float
    if (c.cache == DType::F16) {
      uint16_t h;
      std::memcpy(&h, p, 2);
      return f16_to_f32(h);
    }
    float f;
    std::memcpy(&f, p, 4);
    return f;
  };
  auto kval = [&](int j, int e) { return cached(hk.data() + (static_cast<size_t>(j) * kw + e) * es); };
  auto vval = [&](int row, int j) { return cached(hv.data() + (static_cast<size_t>(row) * n_ctx + j) * es); };
  int bad = 0;
  std::vector<double> sc(n_keys);
  for (int t = 0; t < c.n_tokens; ++t) {
    const int visible = c.pos0 + t + 1;
    for (int h = 0; h < c.n_head; ++h) {
      const int g = h / group;
      double mx = -1e300;
      for (int j = 0; j < visible; ++j) {
        double d = 0;
        for (int e = 0; e < c.head_dim; ++e) {
          const float qe = q[t * ld_q + h * c.head_dim + e];
          d += static_cast<double>(c.cache == DType::F16 ? round_f16(qe) : qe) * kval(j, g * c.head_dim + e);
        }
        sc[j] = d * scale;
        mx = std::max(mx, sc[j]);
      }
      double sum = 0;
      for (int j = 0; j < visible; ++j) sum += (sc[j] = std::exp(sc[j] - mx));
      for (int d = 0; d < c.head_dim_v; ++d) {
        double s1 = 0, mterm = 0;
        for (int j = 0; j < visible; ++j) {
          const double term = sc[j] / sum * std::fabs(vval(g * c.head_dim_v + d, j));
          s1 += term;
          mterm = std::max(mterm, term);
        }
        const double tol = 1e-5 * s1 + (c.cache == DType::F16 ? 1.0 / 1024 : 0.0) * mterm + 1e-30;
        const float gv = got[t * ld_out + h * c.head_dim_v + d], rv = ref[t * ld_out + h * c.head_dim_v + d];
        if (!(std::fabs(gv - rv) <= tol) && bad++ < 5)
          ADD_FAILURE() << "token " << t << " head " << h << " dim " << d << ": got " << gv << " want " << rv
                        << " (tol " << tol << ")";
      }
    }
    for (int64_t i = static_cast<int64_t>(c.n_head) * c.head_dim_v; i < ld_out; ++i)
      if (!is_poison(got[t * ld_out + i]) && bad++ < 5) ADD_FAILURE() << "wrote past the heads";
  }
}

TEST_F(GpuOps, AttentionDecode) {
  uint64_t seed = 700;
  for (int ctx : {1, 100, 5000}) {
    run_attention_case(s(), [this] { sync(); }, {16, 4, 128, 128, DType::F16, ctx - 1, 1, false}, seed++);
    run_attention_case(s(), [this] { sync(); }, {16, 4, 128, 128, DType::F16, ctx - 1, 1, true}, seed++);
  }
  run_attention_case(s(), [this] { sync(); }, {8, 8, 64, 64, DType::F16, 999, 1, false}, seed++);     // MHA, dim 64
  run_attention_case(s(), [this] { sync(); }, {32, 4, 256, 256, DType::F16, 300, 1, false}, seed++);  // dim 256
  run_attention_case(s(), [this] { sync(); }, {16, 4, 128, 128, DType::F32, 2000, 1, false}, seed++); // f32 cache
  run_attention_case(s(), [this] { sync(); }, {16, 4, 128, 128, DType::F16, 100, 3, false}, seed++);  // small batch
  run_attention_case(s(), [this] { sync(); }, {16, 2, 72, 72, DType::F16, 40, 8, true}, seed++);      // dim 72 (padded)
  // Groups of 8 heads split into subsets while the cache is short (one chunk, then a few).
  run_attention_case(s(), [this] { sync(); }, {32, 4, 128, 128, DType::F16, 20, 1, true}, seed++);
  run_attention_case(s(), [this] { sync(); }, {32, 4, 128, 128, DType::F16, 199, 1, false}, seed++);
  run_attention_case(s(), [this] { sync(); }, {32, 4, 128, 128, DType::F16, 1500, 2, true}, seed++);
  // Caches past the one-launch kernel's 2048 keys take the split-K kernels: the same shapes there.
  run_attention_case(s(), [this] { sync(); }, {8, 8, 64, 64, DType::F16, 2100, 1, false}, seed++);    // MHA, dim 64
  run_attention_case(s(), [this] { sync(); }, {32, 4, 256, 256, DType::F16, 2500, 1, true}, seed++);  // dim 256
  run_attention_case(s(), [this] { sync(); }, {16, 4, 128, 128, DType::F32, 3000, 1, false}, seed++); // f32 cache
  run_attention_case(s(), [this] { sync(); }, {16, 4, 128, 128, DType::F16, 2046, 3, false}, seed++); // 2049 keys
  run_attention_case(s(), [this] { sync(); }, {16, 2, 72, 72, DType::F16, 2200, 8, true}, seed++);    // dim 72, 8 tokens
}

// One scratch for a sequence of decode calls of different token counts and cache lengths (the
// counters must stay put and come back to zero), including batches whose tokens split their head
// groups differently (visible keys across 64/65, 128/129 and 256/257).
TEST_F(GpuOps, AttentionDecodeKeepsItsScratchAcrossCalls) {
  Dev scratch(attention_scratch_bytes(8, 4096, 32, 128));
  cudaMemset(scratch.as(), 0, scratch.size());
  uint64_t seed = 760;
  for (const AttnCase& c : std::vector<AttnCase>{{32, 4, 128, 128, DType::F16, 10, 1, false},
                                                 {32, 4, 128, 128, DType::F16, 62, 4, false},
                                                 {32, 4, 128, 128, DType::F16, 30, 1, true},
                                                 {32, 4, 128, 128, DType::F16, 126, 4, true},
                                                 {32, 4, 128, 128, DType::F16, 254, 3, false},
                                                 {32, 4, 128, 128, DType::F16, 1000, 8, false},
                                                 {32, 4, 128, 128, DType::F16, 61, 5, false},
                                                 {32, 4, 128, 128, DType::F16, 5, 1, false}})
    run_attention_case(s(), [this] { sync(); }, c, seed++, &scratch);
}

TEST_F(GpuOps, AttentionPrefill) {
  // f16 caches with heads up to 128 run on tensor cores (sm_70+); set_tensor_core_attention(false) forces the
  // CUDA-core kernel, which every other case uses anyway. Both must hold.
  for (bool cuda_cores : {false, true}) {
    SCOPED_TRACE(cuda_cores ? "CUDA-core kernel" : "default kernel");
    gpu::set_tensor_core_attention(!cuda_cores);
    uint64_t seed = 800;
    for (int pos0 : {0, 50})
      for (int nt : {7, 64, 300}) run_attention_case(s(), [this] { sync(); }, {16, 4, 128, 128, DType::F16, pos0, nt, false}, seed++);
    run_attention_case(s(), [this] { sync(); }, {8, 8, 64, 64, DType::F16, 10, 33, false}, seed++);  // MHA
    run_attention_case(s(), [this] { sync(); }, {8, 2, 128, 128, DType::F16, 1000, 130, false}, seed++);  // deep cache
    gpu::set_tensor_core_attention(true);
  }
  uint64_t seed = 810;
  run_attention_case(s(), [this] { sync(); }, {16, 4, 128, 128, DType::F32, 20, 40, false}, seed++); // f32 cache
  run_attention_case(s(), [this] { sync(); }, {16, 2, 72, 72, DType::F16, 5, 20, false}, seed++);    // dim 72
  run_attention_case(s(), [this] { sync(); }, {32, 4, 256, 256, DType::F16, 3, 17, false}, seed++);  // dim 256
}

}  // namespace
}  // namespace fitmoe::gpu
