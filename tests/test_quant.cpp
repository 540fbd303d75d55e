// Block formats and CPU kernels: the reference against ggml's own test vectors, every ISA's kernels
// against the reference on fresh random data, the activation quantizers, the synthetic-weight filler.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "quant/dtype.h"
#include "quant/kernels.h"
#include "testdata.h"

namespace fitmoe::quant {
namespace {

using test::read_bytes;
using test::read_f32;
using test::read_json;
using test::testdata;

const DType kWeightTypes[] = {DType::F32,  DType::F16,  DType::BF16, DType::Q4_0, DType::Q4_1,
                              DType::Q5_0, DType::Q5_1, DType::Q8_0, DType::Q2_K, DType::Q3_K,
                              DType::Q4_K, DType::Q5_K, DType::Q6_K, DType::IQ4_NL, DType::IQ4_XS};
const DType kActTypes[] = {DType::Q8_0, DType::Q8_1, DType::Q8_K, DType::F16, DType::BF16, DType::F32};
const Isa kIsas[] = {Isa::Scalar, Isa::AVX2, Isa::AVX512};

bool isa_available(Isa isa) { return static_cast<int>(isa) <= static_cast<int>(cpu_isa()); }

uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// sum_j |w_j * a_j| of the decoded operands (the scale of a dot product's rounding error).
double sum_abs_product(DType w, const void* wrow, const void* arow, int64_t n) {
  std::vector<float> wf(n), af(n);
  dequantize_row_ref(w, wrow, wf.data(), n);
  dequantize_row_ref(dtype_info(w).act_type, arow, af.data(), n);
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += std::fabs(static_cast<double>(wf[i]) * af[i]);
  return s;
}
// ============================================ dtype table ==========================================

TEST(QuantDType, TableMatchesManifest) {
  const auto m = read_json(testdata("quant-vectors/manifest.json"));
  for (const auto& [key, t] : m["types"].items()) {
    const DTypeInfo* info = dtype_info(t["ggml_type_id"].get<uint32_t>());
    ASSERT_NE(info, nullptr) << key;
    EXPECT_EQ(info->name, key);
    EXPECT_EQ(info->block_size, t["block_size"].get<int>()) << key;
    EXPECT_EQ(info->block_bytes, t["bytes_per_block"].get<int>()) << key;
    EXPECT_EQ(static_cast<uint32_t>(info->act_type), t["vec_dot_type_id"].get<uint32_t>()) << key;
    EXPECT_TRUE(info->weight_type) << key;
    EXPECT_EQ(row_bytes(info->type, 1024), t["row_bytes"].get<size_t>()) << key;
  }
}

TEST(QuantDType, ActivationTypesAndNames) {
  EXPECT_FALSE(dtype_info(DType::Q8_1).weight_type);
  EXPECT_FALSE(dtype_info(DType::Q8_K).weight_type);
  EXPECT_EQ(dtype_info(DType::Q8_K).block_bytes, 292);
  EXPECT_EQ(dtype_info(DType::Q8_1).block_bytes, 36);
  EXPECT_EQ(dtype_info(DType::F32).act_type, DType::F32);
  EXPECT_EQ(dtype_info(DType::F32).block_bytes, 4);
  EXPECT_EQ(dtype_info(4u), nullptr);    // removed Q4_2
  EXPECT_EQ(dtype_info(16u), nullptr);   // IQ2_XXS: not supported
  EXPECT_EQ(dtype_info(999u), nullptr);
  DType t;
  ASSERT_TRUE(dtype_from_name("Q4_K", &t));
  EXPECT_EQ(t, DType::Q4_K);
  ASSERT_TRUE(dtype_from_name("iq4_xs", &t));
  EXPECT_EQ(t, DType::IQ4_XS);
  ASSERT_TRUE(dtype_from_name("BF16", &t));
  EXPECT_EQ(t, DType::BF16);
  EXPECT_FALSE(dtype_from_name("q4_2", &t));
  EXPECT_FALSE(dtype_from_name("", &t));
  for (DType w : kWeightTypes) {
    ASSERT_TRUE(dtype_from_name(dtype_name(w), &t));
    EXPECT_EQ(t, w);
  }
}

// ======================================== f16 / bf16 ===============================================

// Independent f16 decoder: sign * 2^(e-15) * (1 + m/1024), or subnormal, in double.
double f16_value(uint16_t h) {
  const int s = h >> 15, e = (h >> 10) & 31, m = h & 1023;
  double v = e == 0 ? std::ldexp(m, -24) : std::ldexp(1024 + m, e - 25);
  return s ? -v : v;
}

TEST(QuantF16, DecodeAllHalves) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = f16_to_f32(static_cast<uint16_t>(h));
    if (((h >> 10) & 31) == 31) {
      if (h & 1023) EXPECT_TRUE(std::isnan(f)) << h;
      else EXPECT_TRUE(std::isinf(f)) << h;
      continue;
    }
    ASSERT_EQ(static_cast<double>(f), f16_value(static_cast<uint16_t>(h))) << h;
    EXPECT_EQ(std::signbit(f), (h >> 15) != 0) << h;
    ASSERT_EQ(f32_to_f16(f), h) << h;  // round trip
  }
}

// Independent encoder: nearest half by bisection over the ordered finite halves, ties to even.
uint16_t f16_nearest(float f) {
  if (std::isnan(f)) return 0x7e00;
  const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  const double a = std::fabs(static_cast<double>(f));
  if (a >= 65520.0) return sign | 0x7c00;
  uint32_t lo = 0, hi = 0x7bff;  // largest h with value <= a
  while (lo < hi) {
    const uint32_t mid = (lo + hi + 1) / 2;
    if (f16_value(static_cast<uint16_t>(mid)) <= a) lo = mid;
    else hi = mid - 1;
  }
  if (lo == 0x7bff) return sign | 0x7bff;
  const double below = f16_value(static_cast<uint16_t>(lo)), above = f16_value(static_cast<uint16_t>(lo + 1));
  uint32_t r = lo;
  if (a - below > above - a || (a - below == above - a && (lo & 1))) r = lo + 1;
  return static_cast<uint16_t>(sign | r);
}

TEST(QuantF16, EncodeRoundsToNearestEven) {
  std::mt19937 rng(1234);
  std::vector<float> cases = {0.0f, -0.0f, 1.0f, 65504.0f, 65519.99f, 65520.0f, 1e9f, -1e9f,
                              6.103515625e-05f, 6.0e-05f, 5.96e-08f, 2.98e-08f, 2.9802322387695312e-08f,
                              2.98023259e-08f, 1e-30f, INFINITY, -INFINITY};
  for (int i = 0; i < 200000; ++i) {
    // exponents spread over the whole half range and a bit beyond
    const uint32_t e = 100 + rng() % 60, m = rng() & 0x7fffff, s = rng() & 1;
    cases.push_back(from_bits((s << 31) | (e << 23) | m));
  }
  for (uint32_t h = 0; h < 0x7c00; h += 7) {  // exact ties: halfway between consecutive halves
    const double mid = 0.5 * (f16_value(static_cast<uint16_t>(h)) + f16_value(static_cast<uint16_t>(h + 1)));
    cases.push_back(static_cast<float>(mid));
  }
  for (float f : cases) ASSERT_EQ(f32_to_f16(f), f16_nearest(f)) << f << " bits " << std::hex << bits(f);
  EXPECT_TRUE(std::isnan(f16_to_f32(f32_to_f16(NAN))));
}

TEST(QuantF16, BFloat16) {
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(f32_to_bf16(from_bits(0x3f808000u)), 0x3f80);  // tie -> even
  EXPECT_EQ(f32_to_bf16(from_bits(0x3f818000u)), 0x3f82);  // tie -> even (up)
  EXPECT_EQ(f32_to_bf16(from_bits(0x3f808001u)), 0x3f81);
  EXPECT_EQ(f32_to_bf16(from_bits(0x7f7fffffu)), 0x7f80);  // overflow to inf
  EXPECT_EQ(f32_to_bf16(from_bits(0x7f800001u)), 0x7fc0);  // signalling NaN made quiet
  EXPECT_EQ(f32_to_bf16(-0.0f), 0x8000);
  EXPECT_EQ(bf16_to_f32(0xc040), -3.0f);
}

// ====================================== ggml test vectors ==========================================

struct Fixture {
  std::string key;
  DType type;
  DType act;
  std::vector<uint8_t> weights, act_bytes;
  std::vector<float> dequant, dots;
  size_t row_bytes;
};

std::vector<Fixture> load_fixtures() {
  const auto m = read_json(testdata("quant-vectors/manifest.json"));
  std::vector<Fixture> out;
  for (const auto& [key, t] : m["types"].items()) {
    Fixture f;
    f.key = key;
    f.type = static_cast<DType>(t["ggml_type_id"].get<uint32_t>());
    f.act = static_cast<DType>(t["vec_dot_type_id"].get<uint32_t>());
    const auto& files = t["files"];
    f.weights = read_bytes(testdata("quant-vectors/" + files["quantized"].get<std::string>()));
    f.dequant = read_f32(testdata("quant-vectors/" + files["dequantized"].get<std::string>()));
    f.act_bytes = read_bytes(testdata("quant-vectors/" + files["activation_quantized"].get<std::string>()));
    f.dots = read_f32(testdata("quant-vectors/" + files["dot"].get<std::string>()));
    f.row_bytes = t["row_bytes"].get<size_t>();
    out.push_back(std::move(f));
  }
  return out;
}

const std::vector<Fixture>& fixtures() {
  static const std::vector<Fixture> f = load_fixtures();
  return f;
}

TEST(QuantVectors, AllTypesPresent) { EXPECT_EQ(fixtures().size(), 14u); }

TEST(QuantVectors, DequantizeBitExact) {
  for (const Fixture& f : fixtures()) {
    ASSERT_EQ(f.weights.size(), 8 * f.row_bytes) << f.key;
    std::vector<float> y(8 * 1024);
    for (int r = 0; r < 8; ++r) dequantize_row_ref(f.type, f.weights.data() + r * f.row_bytes, y.data() + r * 1024, 1024);
    int bad = 0;
    for (size_t i = 0; i < y.size(); ++i)
      if (bits(y[i]) != bits(f.dequant[i]) && bad++ < 5)
        ADD_FAILURE() << f.key << " value " << i << ": " << y[i] << " != " << f.dequant[i];
    EXPECT_EQ(bad, 0) << f.key;
  }
}

TEST(QuantVectors, ActivationQuantizationByteExact) {
  const std::vector<float> act = read_f32(testdata("quant-vectors/activation.f32"));
  ASSERT_EQ(act.size(), 1024u);
  for (const Fixture& f : fixtures()) {
    std::vector<uint8_t> y(row_bytes(f.act, 1024));
    ASSERT_EQ(y.size(), f.act_bytes.size()) << f.key;
    quantize_act_row_ref(f.act, act.data(), y.data(), 1024);
    EXPECT_EQ(y, f.act_bytes) << f.key << " (reference quantizer)";
    for (Isa isa : kIsas) {
      if (!isa_available(isa)) continue;
      std::fill(y.begin(), y.end(), 0xAA);
      quantize_act_fn(f.act, isa)(act.data(), y.data(), 1024);
      EXPECT_EQ(y, f.act_bytes) << f.key << " (" << isa_name(isa) << " quantizer)";
    }
  }
}

TEST(QuantVectors, ScalarReferenceQuantizerDiffers) {
  // The scalar_ref files (ggml's other rounding) must NOT match: proves the tie block is exercised.
  const std::vector<float> act = read_f32(testdata("quant-vectors/activation.f32"));
  for (const char* key : {"q4_0", "q4_1"}) {
    const Fixture* f = nullptr;
    for (const Fixture& x : fixtures())
      if (x.key == key) f = &x;
    ASSERT_NE(f, nullptr);
    const char* suffix = f->act == DType::Q8_0 ? ".act.q8_0.scalar_ref.bin" : ".act.q8_1.scalar_ref.bin";
    const auto other = read_bytes(testdata("quant-vectors/" + std::string(key) + "/" + key + suffix));
    std::vector<uint8_t> y(other.size());
    quantize_act_row_ref(f->act, act.data(), y.data(), 1024);
    EXPECT_NE(y, other) << key;
  }
}

TEST(QuantVectors, ReferenceDotMatchesGgml) {
  for (const Fixture& f : fixtures()) {
    for (int r = 0; r < 8; ++r) {
      const uint8_t* w = f.weights.data() + r * f.row_bytes;
      const float got = vec_dot_ref(f.type, 1024, w, f.act_bytes.data());
      const double scale = sum_abs_product(f.type, w, f.act_bytes.data(), 1024);
      EXPECT_LE(std::fabs(static_cast<double>(got) - f.dots[r]), 5e-7 * scale + 1e-30)
          << f.key << " row " << r << ": " << got << " vs ggml " << f.dots[r];
    }
  }
}

TEST(QuantVectors, EveryIsaMatmulMatchesGgml) {
  for (Isa isa : kIsas) {
    if (!isa_available(isa)) continue;
    for (const Fixture& f : fixtures()) {
      for (int nc : {1, 3}) {  // the same activation in several columns (decode and prefill paths)
        std::vector<uint8_t> acts;
        for (int c = 0; c < nc; ++c) acts.insert(acts.end(), f.act_bytes.begin(), f.act_bytes.end());
        std::vector<float> out(8 * nc, NAN);
        kernels_for(f.type, isa).matmul_tile(1024, f.weights.data(), f.row_bytes, 8, acts.data(), f.act_bytes.size(), nc,
                                             out.data(), 8);
        for (int c = 0; c < nc; ++c)
          for (int r = 0; r < 8; ++r) {
            const double scale = sum_abs_product(f.type, f.weights.data() + r * f.row_bytes, f.act_bytes.data(), 1024);
            EXPECT_LE(std::fabs(static_cast<double>(out[c * 8 + r]) - f.dots[r]), 5e-7 * scale + 1e-30)
                << isa_name(isa) << " " << f.key << " row " << r << " col " << c;
          }
      }
    }
  }
}

// ===================================== random-data kernels =========================================

std::vector<float> random_activations(int64_t n, std::mt19937_64& rng, int variant) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> x(n);
  for (auto& v : x) v = nd(rng);
  if (variant % 3 == 1 && n >= 64) {  // outliers and an all-zero block
    x[rng() % n] = 40.0f;
    x[rng() % n] = -55.0f;
    std::fill(x.begin() + 32, x.begin() + 64, 0.0f);
  }
  if (variant % 3 == 2) {  // large dynamic range between blocks
    for (int64_t i = 0; i < n; ++i) x[i] *= std::pow(10.0f, static_cast<float>((i / 32) % 7) - 3.0f);
  }
  return x;
}

std::vector<int64_t> sizes_for(DType w) {
  const int bs = dtype_info(w).block_size;
  if (bs == 256) return {256, 512, 2048};
  if (bs == 32) return {32, 96, 256, 2048};
  return {1, 7, 16, 33, 256, 1000, 2048};
}

struct MatmulCase {
  int64_t n;
  int nr, nc;
};

// Runs the kernel of `isa` on fresh random data and compares every output with vec_dot_ref.
void check_matmul(DType w, Isa isa, const MatmulCase& mc, uint64_t seed, int* exact, int* total) {
  const int64_t n = mc.n;
  const DType at = dtype_info(w).act_type;
  const size_t wrow = row_bytes(w, n), arow = row_bytes(at, n);
  // odd seeds: strides with padding, to catch kernels that assume packed rows; even seeds: packed rows
  // (the layout the engine uses, with the kernels' prefetching enabled)
  const bool padded = seed % 2 == 1;
  const size_t ws = wrow + (padded ? 64 : 0), as = arow + (padded ? 32 : 0), os = static_cast<size_t>(mc.nr) + 3;
  // exact sizes (no slack after the last row), so that an address sanitizer build catches over-reads
  std::vector<uint8_t> wbuf(ws * (mc.nr - 1) + wrow), abuf(as * (mc.nc - 1) + arow);
  std::vector<uint8_t> rows(wrow * mc.nr);
  fill_random_rows(w, rows.data(), mc.nr, n, 0.05f, seed);
  for (int r = 0; r < mc.nr; ++r) std::memcpy(wbuf.data() + r * ws, rows.data() + r * wrow, wrow);
  std::mt19937_64 rng(seed * 7 + 1);
  for (int c = 0; c < mc.nc; ++c) {
    const std::vector<float> x = random_activations(n, rng, c);
    quantize_act_row_ref(at, x.data(), abuf.data() + c * as, n);
  }
  std::vector<float> out(os * mc.nc, NAN);
  kernels_for(w, isa).matmul_tile(n, wbuf.data(), ws, mc.nr, abuf.data(), as, mc.nc, out.data(), os);
  for (int c = 0; c < mc.nc; ++c)
    for (int r = 0; r < mc.nr; ++r) {
      const void* wr = wbuf.data() + r * ws;
      const void* ar = abuf.data() + c * as;
      const float ref = vec_dot_ref(w, n, wr, ar);
      const float got = out[c * os + r];
      const double scale = sum_abs_product(w, wr, ar, n);
      ++*total;
      if (bits(got) == bits(ref) || got == ref) ++*exact;
      ASSERT_LE(std::fabs(static_cast<double>(got) - ref), 1e-6 * scale + 1e-30)
          << dtype_name(w) << " " << isa_name(isa) << " n=" << n << " nr=" << mc.nr << " nc=" << mc.nc << " r=" << r
          << " c=" << c << ": " << got << " vs ref " << ref << " (seed " << seed << ")";
    }
  // padding between output columns untouched
  for (int c = 0; c < mc.nc; ++c)
    for (size_t r = mc.nr; r < os; ++r) ASSERT_TRUE(std::isnan(out[c * os + r])) << "wrote outside the tile";
}

class QuantKernels : public ::testing::TestWithParam<std::tuple<DType, Isa>> {};

TEST_P(QuantKernels, MatchesReferenceOnRandomData) {
  const auto [w, isa] = GetParam();
  if (!isa_available(isa)) GTEST_SKIP() << "CPU lacks " << isa_name(isa) << " (best: " << isa_name(cpu_isa()) << ")";
  std::random_device rd;
  const uint64_t seed0 = (static_cast<uint64_t>(rd()) << 32) | rd();
  int exact = 0, total = 0;
  const int dims[] = {1, 2, 3, 5, 8, 17};
  uint64_t seed = seed0;
  for (int64_t n : sizes_for(w))
    for (int nr : dims)
      for (int nc : dims) {
        if (n >= 2048 && nr * nc > 40) continue;  // keep the reference side quick
        check_matmul(w, isa, {n, nr, nc}, seed++, &exact, &total);
        if (HasFatalFailure()) return;
      }
  // The kernels follow the reference's summation order: expect bit-identical results.
  EXPECT_EQ(exact, total) << "outputs not bit-identical to vec_dot_ref (seed " << seed0 << ")";
}

TEST_P(QuantKernels, LargeTiles) {
  const auto [w, isa] = GetParam();
  if (!isa_available(isa)) GTEST_SKIP() << "CPU lacks " << isa_name(isa);
  int exact = 0, total = 0;
  check_matmul(w, isa, {dtype_info(w).block_size == 1 ? 2050 : 2048, 37, 9}, 99, &exact, &total);
  check_matmul(w, isa, {768, 64, 1}, 100, &exact, &total);
  EXPECT_EQ(exact, total);
}

std::string param_name(const ::testing::TestParamInfo<std::tuple<DType, Isa>>& info) {
  return std::string(dtype_name(std::get<0>(info.param))) + "_" + isa_name(std::get<1>(info.param));
}

INSTANTIATE_TEST_SUITE_P(AllTypes, QuantKernels,
                         ::testing::Combine(::testing::ValuesIn(kWeightTypes), ::testing::ValuesIn(kIsas)), param_name);

// ===================================== activation quantizers =======================================

std::vector<float> tricky_activations(int64_t n, std::mt19937_64& rng) {
  std::vector<float> x = random_activations(n, rng, 0);
  for (int64_t b = 0; b < n / 32; ++b) {
    float* p = x.data() + 32 * b;
    switch (b % 8) {
      case 0: std::fill(p, p + 32, 0.0f); break;  // all zero
      case 1:                                      // exact .5 ties for the Q8_0 scale (127/amax = 32)
        for (int j = 0; j < 32; ++j) p[j] = ((j % 2) ? -1.0f : 1.0f) * (3.5f * (j % 31) + 0.5f) / 32.0f;
        p[5] = 127.0f / 32.0f;
        break;
      case 2:                                      // integers / 32
        for (int j = 0; j < 32; ++j) p[j] = static_cast<float>(static_cast<int>(rng() % 255) - 127) / 32.0f;
        break;
      case 3: std::fill(p, p + 32, -0.0f); p[7] = 1e-30f; break;  // tiny / negative zeros
      case 4: for (int j = 0; j < 32; ++j) p[j] *= 1e4f; break;  // large
      case 5: std::fill(p, p + 32, 0.37f); break;                 // constant
      case 6: p[3] = -p[3] - 100.0f; p[20] = 100.0f - p[3]; break;  // equal magnitudes, both signs
      default: break;
    }
  }
  return x;
}

class QuantActivation : public ::testing::TestWithParam<std::tuple<DType, Isa>> {};

TEST_P(QuantActivation, FastMatchesReference) {
  const auto [at, isa] = GetParam();
  if (!isa_available(isa)) GTEST_SKIP() << "CPU lacks " << isa_name(isa);
  std::mt19937_64 rng(std::random_device{}());
  for (int64_t n : {256, 512, 4096}) {
    for (int rep = 0; rep < 4; ++rep) {
      std::vector<float> x = tricky_activations(n, rng);
      if (rep == 3 && dtype_info(at).block_size == 256) {  // one Q8_K block: max magnitude tie +-m
        std::fill(x.begin(), x.begin() + 256, 0.5f);
        x[10] = -3.0f;
        x[200] = 3.0f;
      }
      if (rep == 2) std::fill(x.begin(), x.begin() + 256, 0.0f);  // an all-zero 256-block
      const size_t bytes = row_bytes(at, n);
      std::vector<uint8_t> ref(bytes, 0x55), got(bytes, 0xAA);
      quantize_act_row_ref(at, x.data(), ref.data(), n);
      quantize_act_fn(at, isa)(x.data(), got.data(), n);
      ASSERT_EQ(got, ref) << dtype_name(at) << " " << isa_name(isa) << " n=" << n << " rep " << rep;
    }
  }
  if (dtype_info(at).block_size == 1) {  // odd lengths for the element types
    for (int64_t n : {1, 7, 15, 17, 33}) {
      std::vector<float> x = random_activations(n, rng, 0);
      std::vector<uint8_t> ref(row_bytes(at, n)), got(row_bytes(at, n), 0xAA);
      quantize_act_row_ref(at, x.data(), ref.data(), n);
      quantize_act_fn(at, isa)(x.data(), got.data(), n);
      ASSERT_EQ(got, ref) << dtype_name(at) << " n=" << n;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllActs, QuantActivation,
                         ::testing::Combine(::testing::ValuesIn(kActTypes), ::testing::ValuesIn(kIsas)), param_name);

TEST(QuantActivation, Q8KSemantics) {
  // Independent check of the Q8_K definition on one block: scale from the signed max, -127 at the max.
  std::vector<float> x(256);
  for (int i = 0; i < 256; ++i) x[i] = 0.01f * static_cast<float>(i - 100);
  x[77] = -2.54f;
  std::vector<uint8_t> y(292);
  quantize_act_row_ref(DType::Q8_K, x.data(), y.data(), 256);
  float d;
  std::memcpy(&d, y.data(), 4);
  EXPECT_FLOAT_EQ(d, 2.54f / 127.0f);
  EXPECT_EQ(static_cast<int8_t>(y[4 + 77]), -127);  // the max always maps to -127 (iscale = -127/max)
  EXPECT_EQ(static_cast<int8_t>(y[4 + 100]), 0);
  int16_t bs0;
  std::memcpy(&bs0, y.data() + 260, 2);
  int s = 0;
  for (int j = 0; j < 16; ++j) s += static_cast<int8_t>(y[4 + j]);
  EXPECT_EQ(bs0, s);
}

// ====================================== synthetic weights ==========================================

TEST(QuantRandom, FillRandomRowsStatistics) {
  for (DType w : kWeightTypes) {
    for (float sd : {0.002f, 0.02f, 1.0f}) {
      const int64_t nrows = 16, ncols = 4096;
      std::vector<uint8_t> buf(row_bytes(w, ncols) * nrows);
      fill_random_rows(w, buf.data(), nrows, ncols, sd, 42);
      std::vector<float> y(ncols);
      double s2 = 0, s1 = 0;
      for (int64_t r = 0; r < nrows; ++r) {
        dequantize_row_ref(w, buf.data() + r * row_bytes(w, ncols), y.data(), ncols);
        for (float v : y) {
          ASSERT_TRUE(std::isfinite(v)) << dtype_name(w);
          s1 += v;
          s2 += static_cast<double>(v) * v;
        }
      }
      const double cnt = static_cast<double>(nrows * ncols), mean = s1 / cnt;
      const double std = std::sqrt(s2 / cnt - mean * mean);
      EXPECT_GT(std, sd / 2) << dtype_name(w) << " sd " << sd;
      EXPECT_LT(std, sd * 2) << dtype_name(w) << " sd " << sd;
      EXPECT_LT(std::fabs(mean), 0.25 * sd) << dtype_name(w);
      // deterministic in the seed, different across seeds
      std::vector<uint8_t> again(buf.size()), other(buf.size());
      fill_random_rows(w, again.data(), nrows, ncols, sd, 42);
      fill_random_rows(w, other.data(), nrows, ncols, sd, 43);
      EXPECT_EQ(again, buf) << dtype_name(w);
      EXPECT_NE(other, buf) << dtype_name(w);
    }
  }
}

TEST(QuantRandom, ScalesPositiveFinite) {
  // Decode each block's super-scale field through a known-layout probe: a block whose codes are all
  // the maximum must decode to finite values, and every d must be a positive finite half.
  struct Probe {
    DType t;
    int d_off;
  };
  const Probe probes[] = {{DType::Q4_0, 0}, {DType::Q8_0, 0}, {DType::Q2_K, 80}, {DType::Q3_K, 108},
                          {DType::Q4_K, 0}, {DType::Q5_K, 0}, {DType::Q6_K, 208}, {DType::IQ4_XS, 0}};
  for (const Probe& p : probes) {
    std::vector<uint8_t> buf(row_bytes(p.t, 2048) * 4);
    fill_random_rows(p.t, buf.data(), 4, 2048, 1e-3f, 7);
    const int bb = dtype_info(p.t).block_bytes;
    for (size_t off = 0; off < buf.size(); off += bb) {
      uint16_t h;
      std::memcpy(&h, buf.data() + off + p.d_off, 2);
      const float d = f16_to_f32(h);
      ASSERT_TRUE(std::isfinite(d) && d > 0) << dtype_name(p.t) << " d=" << d;
    }
  }
}

// ========================================== dispatch ===============================================

TEST(QuantDispatch, FallbackAndClamping) {
  EXPECT_STREQ(isa_name(Isa::Scalar), "scalar");
  EXPECT_STREQ(isa_name(Isa::AVX2), "avx2");
  EXPECT_STREQ(isa_name(Isa::AVX512), "avx512");
  EXPECT_LE(static_cast<int>(best_isa()), static_cast<int>(cpu_isa()));
  for (DType w : kWeightTypes) {
    for (Isa isa : kIsas) {
      const TypeKernels& k = kernels_for(w, isa);
      EXPECT_EQ(k.act_type, dtype_info(w).act_type);
      ASSERT_NE(k.matmul_tile, nullptr);
      if (!isa_available(isa)) {
        EXPECT_EQ(k.matmul_tile, kernels_for(w, cpu_isa()).matmul_tile);
      }
    }
  }
  for (DType a : kActTypes) {
    for (Isa isa : kIsas) EXPECT_NE(quantize_act_fn(a, isa), nullptr);
  }
  EXPECT_ANY_THROW(kernels_for(DType::Q8_K, Isa::Scalar));
  EXPECT_ANY_THROW(quantize_act_fn(DType::Q4_K, Isa::Scalar));
}

}  // namespace
}  // namespace fitmoe::quant
