// KV cache types (runtime/kv_cache.h) and flash attention (cpu::attention over a flash-layout cache):
// the cache quantizers against the reference's bytes, the Walsh-Hadamard rotation against its matrix,
// flash attention against a plain scalar attention over the same (decoded) cache on fresh random
// inputs, the models against the reference's flash-attention logits for every K/V type it dumped,
// and the errors for combinations fitmoe does not run.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <fstream>
#include <random>

#include "cli_util.h"
#include "quant/kernels.h"
#include "reference_check.h"
#include "runtime/cpu_ops.h"
#include "runtime/error.h"
#include "runtime/kv_cache.h"
#include "runtime/thread_pool.h"

using namespace fitmoe;

namespace {

std::vector<float> random_floats(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

TEST(KvCacheQuant, Q4_0RowsAreTheReferenceQuantizers) {
  // quant-vectors' q4_0 weights are ggml_quantize_chunk = quantize_row_q4_0_ref, which is also what
  // the reference's CPU backend stores into a q4_0 cache (from_float of its q4_0 traits).
  const auto in = test::read_f32(test::testdata("quant-vectors/input.f32"));
  const auto want = test::read_bytes(test::testdata("quant-vectors/q4_0/q4_0.weights.bin"));
  ASSERT_EQ(in.size(), 8u * 1024);
  std::vector<uint8_t> got(row_bytes(DType::Q4_0, 1024) * 8);
  for (int r = 0; r < 8; ++r) cpu::kv_quantize_row(DType::Q4_0, in.data() + r * 1024, got.data() + r * row_bytes(DType::Q4_0, 1024), 1024);
  EXPECT_EQ(got, want);
}

TEST(KvCacheQuant, Q8_0RowsAreTheCpuActivationQuantizer) {
  // A q8_0 cache is filled by the CPU traits' from_float (the AVX2 quantizer, ties to even), the
  // same bytes as the reference's quantized activations.
  const auto act = test::read_f32(test::testdata("quant-vectors/activation.f32"));
  const auto want = test::read_bytes(test::testdata("quant-vectors/q8_0/q8_0.act.q8_0.bin"));
  std::vector<uint8_t> got(row_bytes(DType::Q8_0, static_cast<int64_t>(act.size())));
  cpu::kv_quantize_row(DType::Q8_0, act.data(), got.data(), static_cast<int64_t>(act.size()));
  EXPECT_EQ(got, want);
}

TEST(KvCacheQuant, RowsRoundTripWithinTheirStep) {
  const auto x = random_floats(256, 7);
  for (DType t : {DType::F32, DType::F16, DType::BF16, DType::Q8_0, DType::Q4_0}) {
    std::vector<uint8_t> q(row_bytes(t, 256));
    std::vector<float> y(256);
    cpu::kv_quantize_row(t, x.data(), q.data(), 256);
    cpu::kv_dequantize_row(t, q.data(), y.data(), 256);
    double err = 0, ref = 0;
    for (int i = 0; i < 256; ++i) err += (x[i] - y[i]) * (x[i] - y[i]), ref += x[i] * x[i];
    const double rel = std::sqrt(err / ref);
    const double bound = t == DType::F32 ? 0 : t == DType::F16 ? 1e-3 : t == DType::BF16 ? 5e-3 : t == DType::Q8_0 ? 1e-2 : 0.15;
    EXPECT_LE(rel, bound) << dtype_name(t);
  }
}

TEST(KvCacheRotation, HadamardIsTheOrthonormalSylvesterMatrix) {
  for (int n : {64, 128, 256}) {
    const auto x = random_floats(static_cast<size_t>(2 * n), static_cast<uint32_t>(n));
    std::vector<float> y = x;
    cpu::hadamard_blocks(y.data(), 2 * n, n);
    for (int b = 0; b < 2; ++b)
      for (int i = 0; i < n; ++i) {
        double want = 0;
        for (int j = 0; j < n; ++j) want += (std::popcount(static_cast<unsigned>(i & j)) % 2 ? -1.0 : 1.0) * x[b * n + j];
        want /= std::sqrt(static_cast<double>(n));
        ASSERT_NEAR(y[b * n + i], want, 1e-5) << "n " << n << " i " << i;
      }
    // Its own inverse: the round trip within 1e-6 of the input.
    cpu::hadamard_blocks(y.data(), 2 * n, n);
    for (int i = 0; i < 2 * n; ++i) ASSERT_NEAR(y[i], x[i], 1e-6 * (1 + std::fabs(x[i]))) << "n " << n;
  }
}

TEST(KvCacheRotation, FollowsTheReferencesRule) {
  const KvCacheType q8{DType::Q8_0, DType::Q8_0}, f16{};
  const std::vector<int> hd64 = {64, 64}, hd32 = {32, 32}, mixed = {256, 512}, hd128 = {128}, hd192 = {192};
  EXPECT_EQ(kv_rotation(q8, hd64, hd64).k, 64);
  EXPECT_EQ(kv_rotation(q8, hd64, hd64).v, 64);
  EXPECT_EQ(kv_rotation(q8, hd128, hd128).k, 128);
  EXPECT_EQ(kv_rotation(q8, hd192, hd192).k, 64);  // the largest power of two dividing 192
  EXPECT_EQ(kv_rotation(q8, hd32, hd32).k, 0);     // 32 % 64 != 0 (qwen3moe-tiny)
  EXPECT_EQ(kv_rotation(q8, mixed, mixed).k, 0);   // differing head widths (gemma4)
  EXPECT_EQ(kv_rotation(f16, hd64, hd64).k, 0);    // only quantized caches
  const KvCacheType kq{DType::Q4_0, DType::F16};
  EXPECT_EQ(kv_rotation(kq, hd64, hd64).k, 64);
  EXPECT_EQ(kv_rotation(kq, hd64, hd64).v, 0);
}

TEST(KvCacheType, CombinationsFitmoeCannotRunAreErrorsNamingThem) {
  const std::vector<int> hd = {64}, odd = {48};
  auto message = [&](const KvCacheType& t, const std::vector<int>& d) {
    try {
      check_kv_cache_type(t, d, d);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_EQ(message({DType::Q8_0, DType::Q4_0, FlashAttn::Auto}, hd), "");
  EXPECT_NE(message({DType::Q8_0, DType::Q8_0, FlashAttn::Off}, hd).find("needs flash attention"), std::string::npos);
  EXPECT_NE(message({DType::F16, DType::F32, FlashAttn::Off}, hd).find("different types"), std::string::npos);
  EXPECT_NE(message({DType::Q5_1, DType::F16, FlashAttn::On}, hd).find("q5_1"), std::string::npos);
  EXPECT_NE(message({DType::Q4_0, DType::Q4_0, FlashAttn::On}, odd).find("heads of 48"), std::string::npos);
  DType t;
  EXPECT_TRUE(kv_type_from_name("q4_0", &t));
  EXPECT_FALSE(kv_type_from_name("q4_k", &t));
  EXPECT_THROW(flash_attn_from_name("maybe"), Error);
  EXPECT_TRUE((KvCacheType{DType::F16, DType::F16, FlashAttn::Auto}).flash_on() == false);
  EXPECT_TRUE((KvCacheType{DType::F16, DType::Q8_0, FlashAttn::Auto}).flash_on());
}

// ---- flash attention against a plain scalar attention ----------------------------------------

struct AttnCase {
  DType k, v;
  int n_head, n_head_kv, hd, pos0, n_tokens, window;
  bool ring, rotate;
};

// The attention the cache holds, in double: each query's scores against the decoded (and, for a
// rotated cache, rotated-back) keys, an exact softmax, the decoded values.
void scalar_attention(const AttnCase& c, const std::vector<float>& q, const std::vector<float>& kd,
                      const std::vector<float>& vd, float scale, std::vector<float>& out) {
  const int kw = c.n_head_kv * c.hd, qw = c.n_head * c.hd, group = c.n_head / c.n_head_kv;
  for (int t = 0; t < c.n_tokens; ++t) {
    const int p = c.pos0 + t, lo = c.window > 0 ? std::max(0, p - c.window + 1) : 0;
    for (int h = 0; h < c.n_head; ++h) {
      const int g = h / group;
      std::vector<double> s;
      double mx = -1e300;
      for (int j = lo; j <= p; ++j) {
        double d = 0;
        for (int i = 0; i < c.hd; ++i) d += static_cast<double>(q[t * qw + h * c.hd + i]) * kd[static_cast<size_t>(j) * kw + g * c.hd + i];
        s.push_back(d * scale);
        mx = std::max(mx, s.back());
      }
      double sum = 0;
      for (double& x : s) sum += (x = std::exp(x - mx));
      for (int i = 0; i < c.hd; ++i) {
        double o = 0;
        for (int j = lo; j <= p; ++j) o += s[j - lo] * vd[static_cast<size_t>(j) * kw + g * c.hd + i];
        out[t * qw + h * c.hd + i] = static_cast<float>(o / sum);
      }
    }
  }
}

class FlashAttention : public ::testing::TestWithParam<AttnCase> {};

TEST_P(FlashAttention, MatchesScalarAttentionOverTheSameCache) {
  const AttnCase& c = GetParam();
  const int kw = c.n_head_kv * c.hd, qw = c.n_head * c.hd, total = c.pos0 + c.n_tokens;
  const int cap = c.ring ? c.window - 1 + c.n_tokens + 3 : total;
  cpu::KvView kv{c.k, nullptr, nullptr, cap, static_cast<int64_t>(kv_row_bytes(c.k, c.hd)) * c.n_head_kv, c.ring};
  kv.flash = true;
  kv.v_type = c.v;
  kv.v_row_bytes = static_cast<int64_t>(kv_row_bytes(c.v, c.hd)) * c.n_head_kv;
  kv.tq_block_k = kv.tq_block_v = tq_block(c.hd);
  if (c.rotate) kv.rot_k = c.hd & -c.hd, kv.rot_v = 64;
  std::vector<uint8_t> kb(static_cast<size_t>(kv.k_row_bytes) * cap), vb(static_cast<size_t>(kv.v_row_bytes) * cap);
  kv.k = kb.data();
  kv.v = vb.data();
  const auto k = random_floats(static_cast<size_t>(total) * kw, 11), v = random_floats(static_cast<size_t>(total) * kw, 12);
  const auto q = random_floats(static_cast<size_t>(c.n_tokens) * qw, 13);
  ThreadPool pool(2);
  cpu::Scratch scratch;
  // History first (a ring overwrites old slots as it goes), then the batch.
  for (int p0 = 0; p0 < c.pos0; p0 += 16) {
    const int n = std::min(16, c.pos0 - p0);
    cpu::kv_store(kv, p0, n, k.data() + static_cast<size_t>(p0) * kw, kw, v.data() + static_cast<size_t>(p0) * kw, kw, kw, kw);
  }
  cpu::kv_store(kv, c.pos0, c.n_tokens, k.data() + static_cast<size_t>(c.pos0) * kw, kw,
                v.data() + static_cast<size_t>(c.pos0) * kw, kw, kw, kw);
  const float scale = 1.0f / std::sqrt(static_cast<float>(c.hd));
  std::vector<float> out(static_cast<size_t>(c.n_tokens) * qw);
  cpu::attention(pool, q.data(), qw, kv, c.pos0, c.n_tokens, c.n_head, c.n_head_kv, c.hd, c.hd, scale, out.data(), qw,
                 scratch, 0, c.window);
  // The reference: what the cache holds, decoded (and rotated back), every position still held.
  std::vector<float> kd(static_cast<size_t>(total) * kw), vd(kd.size());
  const int first_held = c.ring ? std::max(0, total - cap) : 0;
  for (int p = first_held; p < total; ++p) {
    cpu::kv_dequantize_row(c.k, kb.data() + static_cast<size_t>(kv.slot(p)) * kv.k_row_bytes, kd.data() + static_cast<size_t>(p) * kw, kw,
                           kv.tq_block_k);
    cpu::kv_dequantize_row(c.v, vb.data() + static_cast<size_t>(kv.slot(p)) * kv.v_row_bytes, vd.data() + static_cast<size_t>(p) * kw, kw,
                           kv.tq_block_v);
    if (kv.rot_k) cpu::hadamard_blocks(kd.data() + static_cast<size_t>(p) * kw, kw, kv.rot_k);
    if (kv.rot_v) cpu::hadamard_blocks(vd.data() + static_cast<size_t>(p) * kw, kw, kv.rot_v);
  }
  // Q is rounded to K's dot format (f16, or q8_0 for the 4/8-bit caches; f32 in the tiled numerics)
  // and an f16 V accumulates in f16 (one rounding per key: a looser bound).
  const bool ref_tiled = c.k == DType::F16 && c.v == DType::F16 && c.n_tokens >= 64;
  const bool tiled = ref_tiled || kv_type_is_tq(c.k);  // (tq K is decoded to f32: Q stays f32)
  std::vector<float> qr = q;
  const DType qt = tiled ? DType::F32 : quant::kernels_for(c.k).act_type;
  if (qt != DType::F32) {
    std::vector<float> rot = q;
    if (kv.rot_k)
      for (int t = 0; t < c.n_tokens; ++t) cpu::hadamard_blocks(rot.data() + t * qw, qw, kv.rot_k);
    std::vector<uint8_t> qq(row_bytes(qt, qw));
    for (int t = 0; t < c.n_tokens; ++t) {
      quant::quantize_act_row_ref(qt, rot.data() + t * qw, qq.data(), qw);
      quant::dequantize_row_ref(qt, qq.data(), qr.data() + t * qw, qw);
      if (kv.rot_k) cpu::hadamard_blocks(qr.data() + t * qw, qw, kv.rot_k);
    }
  }
  std::vector<float> want(out.size());
  scalar_attention(c, qr, kd, vd, scale, want);
  const double tol = c.v == DType::F16 && !ref_tiled ? 1e-2 : 2e-5;
  double worst = 0;
  for (size_t i = 0; i < out.size(); ++i) worst = std::max(worst, std::fabs(static_cast<double>(out[i]) - want[i]));
  EXPECT_LE(worst, tol) << dtype_name(c.k) << "/" << dtype_name(c.v);
}

INSTANTIATE_TEST_SUITE_P(
    Types, FlashAttention,
    ::testing::Values(AttnCase{DType::F32, DType::F32, 4, 2, 64, 37, 5, 0, false, false},
                      AttnCase{DType::F16, DType::F16, 4, 2, 64, 37, 5, 0, false, false},    // f16 accumulation
                      AttnCase{DType::F16, DType::F16, 4, 2, 64, 10, 70, 0, false, false},   // the tiled numerics
                      AttnCase{DType::BF16, DType::F32, 4, 1, 64, 300, 1, 0, false, false},  // more keys than a chunk
                      AttnCase{DType::Q8_0, DType::Q8_0, 4, 2, 64, 37, 5, 0, false, false},
                      AttnCase{DType::Q8_0, DType::Q8_0, 8, 2, 128, 37, 9, 0, false, true},  // rotated
                      AttnCase{DType::Q4_0, DType::Q4_0, 4, 2, 64, 37, 5, 0, false, true},
                      AttnCase{DType::Q4_0, DType::F16, 4, 4, 32, 20, 3, 0, false, false},
                      AttnCase{DType::Q8_0, DType::Q4_0, 4, 2, 64, 600, 2, 16, true, false},  // window over a ring
                      AttnCase{DType::TQ3, DType::TQ3, 8, 2, 128, 37, 5, 0, false, false},
                      AttnCase{DType::TQ4, DType::TQ2, 4, 2, 64, 300, 3, 0, false, false},
                      AttnCase{DType::TQ3, DType::F16, 4, 4, 32, 20, 3, 0, false, false},
                      AttnCase{DType::TQ4, DType::TQ4, 4, 2, 256, 40, 2, 24, true, false}));  // heads of 256: two blocks

// ---- the models against the reference's flash-attention logits --------------------------------

struct ModelCase {
  std::string folder, type;
};
class FlashAttentionReference : public ::testing::TestWithParam<ModelCase> {};

TEST_P(FlashAttentionReference, LogitsMatchForEveryCacheType) {
  const ModelCase& c = GetParam();
  const std::string dir = test::testdata(c.folder);
  auto manifest = test::read_json(dir + "/manifest.json");
  auto model = Model::load(dir + "/" + c.folder + "-" + c.type + ".gguf");
  const auto tol = test::tolerance_for(c.type);
  for (const char* p : {"p7", "p33", "p200"}) {
    const auto& ref = manifest["files"][c.type]["refs"][p];
    ASSERT_TRUE(ref.contains("logits_fa_kv")) << p;
    auto prompt = manifest["prompts"][p]["ids"].get<std::vector<int32_t>>();
    const int row0 = ref["logits_rows"][0].get<int>();
    for (const auto& [key, file] : ref["logits_fa_kv"].items()) {
      const KvCacheType kv = test::fa_kv_type(key);
      auto logits = test::read_f32(dir + "/" + file.get<std::string>());
      std::printf("  %s\n",
                  test::check_logits(*model, prompt, row0, logits, tol, c.folder + "-" + c.type + " " + p + " " + key, kv).c_str());
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllFiles, FlashAttentionReference,
                         ::testing::Values(ModelCase{"qwen3moe-tiny", "f32"}, ModelCase{"qwen3moe-tiny", "q4_k_m"},
                                           ModelCase{"qwen35moe-tiny", "f32"}),
                         [](const auto& info) {
                           std::string n = info.param.folder + "_" + info.param.type;
                           for (char& ch : n)
                             if (ch == '-') ch = '_';
                           return n;
                         });

// ---- the CLI --------------------------------------------------------------------------------------

TEST(KvCacheCli, CacheTypeFlagsRunAndBadOnesAreNamed) {
  const std::string m = test::testdata("qwen3moe-tiny/qwen3moe-tiny-f32.gguf");
  auto ok = test::run_fitmoe("generate -m " + m + " --gpu none --tokens 1,2,3 -n 2 -ctk q8_0 -ctv q4_0");
  EXPECT_EQ(ok.code, 0) << ok.err;
  auto bad = test::run_fitmoe("generate -m " + m + " --gpu none --tokens 1,2,3 -n 2 -ctk q5_k");
  EXPECT_NE(bad.code, 0);
  EXPECT_NE(bad.err.find("q5_k"), std::string::npos) << bad.err;
  auto off = test::run_fitmoe("generate -m " + m + " --gpu none --tokens 1,2,3 -n 2 -ctv q8_0 -fa off");
  EXPECT_NE(off.code, 0);
  EXPECT_NE(off.err.find("flash attention"), std::string::npos) << off.err;
}

}  // namespace

namespace {

// What each type costs the plan: bytes per position in the blocks' ratio (q8_0: 34 B per 32 values
// against f16's 64), and the plan shows every type's figure at its context.
TEST(KvCachePlan, BytesFollowTheTypeAndThePlanShowsThem) {
  auto model = Model::load(test::testdata("qwen3moe-tiny/qwen3moe-tiny-f32.gguf"));
  const ModelConfig& c = model->config();
  const uint64_t f16 = kv_cache_bytes(c, 1000, KvCacheType{}), q8 = kv_cache_bytes(c, 1000, {DType::Q8_0, DType::Q8_0}),
                 q4 = kv_cache_bytes(c, 1000, {DType::Q4_0, DType::Q4_0}), mixed = kv_cache_bytes(c, 1000, {DType::Q8_0, DType::Q4_0});
  EXPECT_EQ(q8 * 64, f16 * 34);
  EXPECT_EQ(q4 * 64, f16 * 18);
  EXPECT_EQ(mixed * 2, q8 + q4);
  // A state allocates what the plan charges.
  StateOptions so;
  so.n_ctx = 1000;
  so.kv = {DType::Q8_0, DType::Q4_0};
  EXPECT_EQ(model->new_state(so)->bytes(), mixed);
  const std::string report = model->plan().report();
  EXPECT_NE(report.find("KV cache at"), std::string::npos) << report;
  EXPECT_NE(report.find("q4_0"), std::string::npos);
}

}  // namespace

namespace {

// `fitmoe perplexity`: windows scored, a base saved and compared with itself (KL 0, the same top token
// everywhere), a quantized cache against it (KL above 0), and bases or texts that do not fit refused.
TEST(Perplexity, SavesABaseAndMeasuresKlAgainstIt) {
  const std::string m = test::testdata("qwen3moe-tiny/qwen3moe-tiny-f32.gguf");
  const std::string text = test::temp_path("ppl", "text.txt"), short_text = test::temp_path("ppl", "short.txt"),
                    base = test::temp_path("ppl", "base.kl");
  {
    std::ofstream f(text);
    for (int i = 0; i < 200; ++i) f << "The quick brown fox " << i << " jumps over the lazy dog, again and again. ";
    std::ofstream g(short_text);
    g << "Too short.";
  }
  const std::string common = "perplexity -m " + m + " --gpu none -c 64 -f ";
  auto saved = test::run_fitmoe(common + text + " --save-logits " + base);
  ASSERT_EQ(saved.code, 0) << saved.err;
  EXPECT_NE(saved.out.find("perplexity: "), std::string::npos) << saved.out;
  auto self = test::run_fitmoe(common + text + " --kl-base " + base);
  ASSERT_EQ(self.code, 0) << self.err;
  EXPECT_NE(self.out.find("mean 0.000000"), std::string::npos) << self.out;
  EXPECT_NE(self.out.find("same top token 100.00%"), std::string::npos) << self.out;
  auto q4 = test::run_fitmoe(common + text + " --kl-base " + base + " -ctk q4_0 -ctv q4_0");
  ASSERT_EQ(q4.code, 0) << q4.err;
  EXPECT_EQ(q4.out.find("mean 0.000000"), std::string::npos) << q4.out;
  auto other = test::run_fitmoe("perplexity -m " + m + " --gpu none -c 32 -f " + text + " --kl-base " + base);
  EXPECT_EQ(other.code, 1);
  EXPECT_NE(other.err.find("another text or --ctx"), std::string::npos) << other.err;
  auto tiny = test::run_fitmoe(common + short_text);
  EXPECT_EQ(tiny.code, 1);
  EXPECT_NE(tiny.err.find("at least two windows"), std::string::npos) << tiny.err;
}

}  // namespace
