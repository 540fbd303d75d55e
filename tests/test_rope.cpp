// RoPE scaling (none, linear, YaRN): cpu::rope_neox against a double-precision scalar YaRN written here,
// the YaRN correction dims against hand-computed values, the metadata parsing (with its errors), and the
// qwen3moe fixture with YaRN metadata added against the unscaled file.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <random>
#include <unistd.h>
#include <string>
#include <vector>

#include "format/gguf.h"
#include "model/model.h"
#include "runtime/cpu_ops.h"
#include "runtime/error.h"
#include "runtime/session.h"
#include "gguf_copy.h"
#include "testdata.h"

using namespace fitmoe;

namespace {

std::vector<float> randn(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = nd(rng);
  return v;
}

struct Yarn {
  double base, freq_scale, ext_factor, attn_factor, lo, hi;
};

// The rotation of one NeoX pair by the YaRN formula (runtime/rope.h), in double. The only float step
// kept is the unscaled angle p * theta_scale^i: the reference defines it by repeated float products (and
// at position 1e5 that product is off by more than a float ulp of the angle from the exact power, so a
// double power would test float rounding, not the formula). Everything after it is double.
void yarn_pair(const Yarn& y, int n_rot, int p, int i, double x0, double x1, double* o0, double* o1, double* th_out) {
  const float theta_scale = std::pow(static_cast<float>(y.base), -2.0f / static_cast<float>(n_rot));
  float t = static_cast<float>(p);
  for (int j = 0; j < i; ++j) t *= theta_scale;
  const double extrap = t;
  const double interp = y.freq_scale * extrap;
  double theta = interp, mscale = y.attn_factor;
  if (y.ext_factor != 0) {
    const double r = 1.0 - std::min(1.0, std::max(0.0, (i - y.lo) / std::max(0.001, y.hi - y.lo)));
    const double mix = r * y.ext_factor;
    theta = interp * (1 - mix) + extrap * mix;
    mscale *= 1.0 + 0.1 * std::log(1.0 / y.freq_scale);
  }
  const double c = std::cos(theta) * mscale, s = std::sin(theta) * mscale;
  *o0 = x0 * c - x1 * s;
  *o1 = x0 * s + x1 * c;
  *th_out = theta;
}

// cpu::rope_neox on random heads at the given positions against yarn_pair. The tolerance is 1e-5 of the
// pair's size plus what the float angle's own rounding allows (a few ulps of theta, which at position
// 1e5 is about 0.01 rad: the reference computes the angle in float too).
void check_rope(const RopeParams& rp, int n_rot, int head_dim, const std::vector<int>& positions, uint64_t seed,
                const std::string& what) {
  const int n_heads = 3;
  const int64_t ld = n_heads * head_dim + 5;
  const Yarn y{rp.base, rp.freq_scale, rp.ext_factor, rp.attn_factor, rp.corr_lo, rp.corr_hi};
  int bad = 0;
  for (int p : positions) {
    std::vector<float> x = randn(static_cast<size_t>(ld), seed + p);
    std::vector<float> out = x;
    cpu::rope_neox(out.data(), 1, n_heads, head_dim, ld, n_rot, p, rp);
    const int half = n_rot / 2;
    for (int h = 0; h < n_heads; ++h) {
      const float* xv = x.data() + h * head_dim;
      const float* ov = out.data() + h * head_dim;
      for (int i = 0; i < half; ++i) {
        double r0, r1, th;
        yarn_pair(y, n_rot, p, i, xv[i], xv[i + half], &r0, &r1, &th);
        const double mag = std::hypot(static_cast<double>(xv[i]), static_cast<double>(xv[i + half])) *
                           (1.0 + 0.1 * std::log(1.0 / y.freq_scale)) * y.attn_factor;
        const double tol = mag * (1e-5 + 4.0 * std::fabs(th) * std::ldexp(1.0, -23));
        if ((std::fabs(ov[i] - r0) > tol || std::fabs(ov[i + half] - r1) > tol) && bad++ < 5)
          ADD_FAILURE() << what << ": p " << p << " h " << h << " pair " << i << ": got " << ov[i] << ", "
                        << ov[i + half] << " want " << r0 << ", " << r1 << " (tol " << tol << ")";
      }
      for (int i = n_rot; i < head_dim; ++i) ASSERT_EQ(ov[i], xv[i]) << what << ": unrotated dim " << i << " changed";
    }
  }
}

const std::vector<int> kPositions = {0, 1, 2, 17, 255, 4095, 4096, 4097, 30000, 131071};

TEST(Rope, YarnCorrDimsMatchHandComputedValues) {
  // Computed by hand (double): n_dims * ln(n_ctx_orig / (2 pi beta)) / (2 ln base), floor / ceil, clamped.
  struct C { int n_dims, n_ctx_orig; float base; float lo, hi; };
  for (const C& c : {C{128, 32768, 1e6f, 23, 40},   // 23.596, 39.651
                     C{128, 4096, 1e6f, 13, 31},    // 13.963, 30.018
                     C{64, 2048, 1e4f, 8, 21},      // 8.064, 20.105
                     C{32, 32, 1e6f, 0, 2}}) {      // -2.128 (clamped to 0), 1.885
    float lo = -1, hi = -1;
    rope_yarn_corr_dims(c.n_dims, c.n_ctx_orig, c.base, 32.0f, 1.0f, &lo, &hi);
    EXPECT_EQ(lo, c.lo) << c.n_dims << " " << c.n_ctx_orig;
    EXPECT_EQ(hi, c.hi) << c.n_dims << " " << c.n_ctx_orig;
  }
  // The upper end is clamped to n_dims - 1: a huge original context.
  float lo, hi;
  rope_yarn_corr_dims(16, 1 << 30, 10.0f, 32.0f, 1.0f, &lo, &hi);
  EXPECT_EQ(hi, 15.0f);
  // The ramp: 1 at and below lo, 0 at and above hi, linear between.
  EXPECT_EQ(rope_yarn_ramp(13, 31, 0), 1.0f);
  EXPECT_EQ(rope_yarn_ramp(13, 31, 13), 1.0f);
  EXPECT_NEAR(rope_yarn_ramp(13, 31, 22), 0.5f, 1e-6f);
  EXPECT_EQ(rope_yarn_ramp(13, 31, 31), 0.0f);
  EXPECT_EQ(rope_yarn_ramp(13, 31, 63), 0.0f);
}

TEST(Rope, UnscaledKeepsThePlainBits) {
  // The plain NeoX rotation as it was before scaling existed: cos/sin of the float angle, nothing else.
  const int head_dim = 64, n_rot = 64, half = 32;
  const float base = 1e6f;
  const float theta_scale = std::pow(base, -2.0f / n_rot);
  for (int p : kPositions) {
    std::vector<float> x = randn(head_dim, 7 + p), out = x;
    cpu::rope_neox(out.data(), 1, 1, head_dim, head_dim, n_rot, p, RopeParams{base});
    float theta = static_cast<float>(p);
    for (int i = 0; i < half; ++i) {
      const float th = 1.0f * theta;
      const float c = std::cos(th), s = std::sin(th);
      const float r0 = x[i] * c - x[i + half] * s, r1 = x[i] * s + x[i + half] * c;
      ASSERT_EQ(std::memcmp(&out[i], &r0, 4), 0) << p << " " << i;
      ASSERT_EQ(std::memcmp(&out[i + half], &r1, 4), 0) << p << " " << i;
      theta *= theta_scale;
    }
  }
}

TEST(Rope, NoneLinearAndYarnMatchTheScalarFormula) {
  for (int head_dim : {128, 64}) {
    for (int n_rot : {head_dim, head_dim / 2}) {
      const std::string shape = " hd " + std::to_string(head_dim) + " n_rot " + std::to_string(n_rot);
      check_rope(RopeParams{1e6f}, n_rot, head_dim, kPositions, 1, "none" + shape);
      check_rope(make_rope_params(n_rot, 1e6f, 0.25f, 0.0f, 1.0f, 32, 1, 4096), n_rot, head_dim, kPositions, 2,
                 "linear x4" + shape);
      // YaRN with the magnitude the model loader derives for factor 4 (about 1) and with others.
      for (float ext : {1.0f, 0.5f, 0.0f})
        for (float attn : {1.0f, 0.9f})
          for (int n_ctx_orig : {4096, 32768}) {
            RopeParams rp = make_rope_params(n_rot, 1e6f, 0.25f, ext, attn, 32, 1, n_ctx_orig);
            if (ext != 0) {
              EXPECT_GT(rp.corr_hi, rp.corr_lo);
              EXPECT_NEAR(rp.mscale(), attn * (1 + 0.1 * std::log(4.0)), 1e-6);
            }
            check_rope(rp, n_rot, head_dim, kPositions, 3,
                       "yarn x4 ext " + std::to_string(ext) + " attn " + std::to_string(attn) + " orig " +
                           std::to_string(n_ctx_orig) + shape);
          }
      // A larger factor and other betas, base 1e4.
      check_rope(make_rope_params(n_rot, 1e4f, 1.0f / 16, 1.0f, 1.0f, 16, 2, 2048), n_rot, head_dim, kPositions, 4,
                 "yarn x16" + shape);
    }
  }
}

// Several tokens in one call take consecutive positions from pos0, as one call per token does.
TEST(Rope, BatchesAreConsecutivePositions) {
  const int head_dim = 64, n_rot = 64, n_heads = 2, T = 5;
  const int64_t ld = n_heads * head_dim;
  const RopeParams rp = make_rope_params(n_rot, 1e6f, 0.25f, 1.0f, 1.0f, 32, 1, 4096);
  std::vector<float> x = randn(static_cast<size_t>(ld) * T, 9), batch = x, single = x;
  cpu::rope_neox(batch.data(), T, n_heads, head_dim, ld, n_rot, 5000, rp);
  for (int t = 0; t < T; ++t) cpu::rope_neox(single.data() + t * ld, 1, n_heads, head_dim, ld, n_rot, 5000 + t, rp);
  EXPECT_EQ(batch, single);
}

// ---- the model level ------------------------------------------------------------------------------

namespace fs = std::filesystem;
using test::Kv;
using test::write_with;

class RopeModel : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("fitmoe-rope-" + std::to_string(::getpid()) + "-" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  static std::string src() { return test::testdata("qwen3moe-tiny") + "/qwen3moe-tiny-f32.gguf"; }
  std::string with(const std::string& name, const std::vector<Kv>& extra) {
    const std::string p = (dir_ / (name + ".gguf")).string();
    write_with(src(), p, extra);
    return p;
  }
  static std::unique_ptr<Model> load(const std::string& path) {
    LoadOptions lo;
    lo.plan.use_gpu = false;  // the CPU forward pass here; tests/gpu/test_gpu_rope.cpp has the GPU's
    return Model::load(path, lo);
  }
  // Logits of every position of a 72-token prompt.
  static std::vector<float> logits(const Model& m) {
    std::vector<int32_t> prompt(72);
    for (int i = 0; i < 72; ++i) prompt[i] = (i * 37 + 11) % 1000;
    SessionOptions so;
    so.n_threads = 2;
    so.n_ctx = 80;
    so.n_batch = 72;
    Session s(m, so);
    return s.eval(prompt, 72);
  }
  static double row_diff(const std::vector<float>& a, const std::vector<float>& b, int row, int n) {
    double d = 0, r = 0;
    for (int i = 0; i < n; ++i) {
      d = std::max(d, std::fabs(static_cast<double>(a[row * n + i]) - b[row * n + i]));
      r = std::max(r, std::fabs(static_cast<double>(b[row * n + i])));
    }
    return d / std::max(r, 1e-30);
  }
  fs::path dir_;
};

const std::string A = "qwen3moe.";

TEST_F(RopeModel, YarnLoadsResolvesTheReferencesParametersAndChangesTheLogits) {
  auto plain = load(src());
  auto yarn = load(with("yarn", {{A + "rope.scaling.type", "s", "yarn"},
                                 {A + "rope.scaling.factor", "f", "", 4.0},
                                 {A + "rope.scaling.original_context_length", "u", "", 32}}));
  const ModelConfig& c = yarn->config();
  EXPECT_EQ(c.rope_scaling, RopeScaling::Yarn);
  EXPECT_EQ(c.rope_freq_scale, 0.25f);
  EXPECT_EQ(c.rope_ext_factor, 1.0f);  // the reference's default for YaRN
  EXPECT_EQ(c.rope_beta_fast, 32.0f);
  EXPECT_EQ(c.rope_beta_slow, 1.0f);
  EXPECT_EQ(c.rope_n_ctx_orig, 32);
  // HF's mscale divided by the 1 + 0.1 ln(s) ggml multiplies in again: about 1.
  EXPECT_NEAR(c.rope_attn_factor, 1.0f, 1e-6f);
  EXPECT_NEAR(rope_params(c).mscale(), 1.0 + 0.1 * std::log(4.0), 1e-6);
  EXPECT_EQ(plain->config().rope_scaling, RopeScaling::None);

  const int n = c.n_vocab;
  auto lp = logits(*plain), ly = logits(*yarn);
  // Position 0 attends to itself only: neither the rotation (angle 0) nor the magnitude changes its
  // output, so its logits agree; every later position differs, most of all beyond the original context.
  EXPECT_LT(row_diff(ly, lp, 0, n), 1e-5);
  for (int row : {1, 8, 31, 32, 40, 71}) EXPECT_GT(row_diff(ly, lp, row, n), 1e-3) << "row " << row;
}

TEST_F(RopeModel, WhereTheMathSaysSoScaledFilesGiveTheSameLogits) {
  auto plain = load(src());
  const int n = plain->config().n_vocab;
  const auto lp = logits(*plain);
  // Factor 1 and no extrapolation mix: exactly the unscaled rotation.
  auto y1 = load(with("yarn1", {{A + "rope.scaling.type", "s", "yarn"},
                                {A + "rope.scaling.factor", "f", "", 1.0},
                                {A + "rope.scaling.yarn_ext_factor", "f", "", 0.0}}));
  EXPECT_EQ(logits(*y1), lp);
  // Type none ignores the factor, as the reference does.
  auto none = load(with("none", {{A + "rope.scaling.type", "s", "none"}, {A + "rope.scaling.factor", "f", "", 4.0}}));
  EXPECT_EQ(none->config().rope_freq_scale, 1.0f);
  EXPECT_EQ(logits(*none), lp);
  // Factor 1 with the default mix: the same angles up to the mix's float rounding, magnitude 1.
  auto y1e = load(with("yarn1e", {{A + "rope.scaling.type", "s", "yarn"}, {A + "rope.scaling.factor", "f", "", 1.0}}));
  EXPECT_EQ(y1e->config().rope_ext_factor, 1.0f);
  const auto l1e = logits(*y1e);
  for (int row = 0; row < 72; ++row) ASSERT_LT(row_diff(l1e, lp, row, n), 1e-4) << row;
  // YaRN with ext_factor 0 is linear scaling, bit for bit; and linear does change the logits.
  auto lin = load(with("linear", {{A + "rope.scaling.type", "s", "linear"}, {A + "rope.scaling.factor", "f", "", 4.0}}));
  auto y0 = load(with("yarn0", {{A + "rope.scaling.type", "s", "yarn"},
                                {A + "rope.scaling.factor", "f", "", 4.0},
                                {A + "rope.scaling.yarn_ext_factor", "f", "", 0.0}}));
  const auto ll = logits(*lin);
  EXPECT_EQ(logits(*y0), ll);
  EXPECT_GT(row_diff(ll, lp, 40, n), 1e-3);
  // A bare factor without a type scales linearly (the reference's default type).
  auto bare = load(with("bare", {{A + "rope.scaling.factor", "f", "", 4.0}}));
  EXPECT_EQ(bare->config().rope_scaling, RopeScaling::Linear);
  EXPECT_EQ(logits(*bare), ll);
}

TEST_F(RopeModel, ExplicitYarnKnobsAreRead) {
  auto m = load(with("knobs", {{A + "rope.scaling.type", "s", "yarn"},
                               {A + "rope.scaling.factor", "f", "", 8.0},
                               {A + "rope.scaling.yarn_ext_factor", "f", "", 0.5},
                               {A + "rope.scaling.yarn_beta_fast", "f", "", 16.0},
                               {A + "rope.scaling.yarn_beta_slow", "f", "", 2.0},
                               {A + "rope.scaling.attn_factor", "f", "", 2.0}}));
  const ModelConfig& c = m->config();
  EXPECT_EQ(c.rope_ext_factor, 0.5f);
  EXPECT_EQ(c.rope_beta_fast, 16.0f);
  EXPECT_EQ(c.rope_beta_slow, 2.0f);
  EXPECT_EQ(c.rope_n_ctx_orig, 4096);  // context_length when original_context_length is absent
  EXPECT_NEAR(c.rope_attn_factor, 2.0f, 1e-6f);
  const RopeParams rp = rope_params(c);
  float lo, hi;
  rope_yarn_corr_dims(c.n_rot, 4096, c.rope_base, 16.0f, 2.0f, &lo, &hi);
  EXPECT_EQ(rp.corr_lo, lo);
  EXPECT_EQ(rp.corr_hi, hi);
}

TEST_F(RopeModel, UnsupportedOrNonsensicalScalingIsAOneLineError) {
  auto expect_error = [&](const std::string& name, const std::vector<Kv>& kv, const std::string& needle) {
    const std::string p = with(name, kv);
    try {
      load(p);
      ADD_FAILURE() << name << ": loaded";
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find(needle), std::string::npos) << name << ": " << msg;
      EXPECT_EQ(msg.find('\n'), std::string::npos) << name << ": " << msg;
    }
  };
  expect_error("longrope", {{A + "rope.scaling.type", "s", "longrope"}}, "'longrope' is not supported");
  expect_error("bogus", {{A + "rope.scaling.type", "s", "ntk-by-parts"}}, "'ntk-by-parts'");
  expect_error("negfactor", {{A + "rope.scaling.type", "s", "yarn"}, {A + "rope.scaling.factor", "f", "", -2.0}},
               "rope.scaling.factor");
  expect_error("nanfactor", {{A + "rope.scaling.type", "s", "linear"}, {A + "rope.scaling.factor", "f", "", NAN}},
               "rope.scaling.factor");
  expect_error("beta0", {{A + "rope.scaling.type", "s", "yarn"}, {A + "rope.scaling.factor", "f", "", 4.0},
                         {A + "rope.scaling.yarn_beta_fast", "f", "", 0.0}}, "yarn_beta_fast");
  expect_error("betas", {{A + "rope.scaling.type", "s", "yarn"}, {A + "rope.scaling.factor", "f", "", 4.0},
                         {A + "rope.scaling.yarn_beta_fast", "f", "", 1.0},
                         {A + "rope.scaling.yarn_beta_slow", "f", "", 32.0}}, "yarn_beta_fast");
  expect_error("orig0", {{A + "rope.scaling.type", "s", "yarn"}, {A + "rope.scaling.factor", "f", "", 4.0},
                         {A + "rope.scaling.original_context_length", "u", "", 0}}, "original_context_length");
  expect_error("attn", {{A + "rope.scaling.type", "s", "yarn"}, {A + "rope.scaling.factor", "f", "", 4.0},
                        {A + "rope.scaling.attn_factor", "f", "", -1.0}}, "attn_factor");
}

}  // namespace
