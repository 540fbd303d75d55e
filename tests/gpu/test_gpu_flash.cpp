// Flash attention on the GPU (cuda/flash_attention.h) for every KV cache type: the store writes the
// CPU's bytes (cpu::kv_store; tq blocks included), and the attention (decode kernel, tensor-core
// prefill kernel, and the decode kernel forced for a batch) against a double-precision softmax over the
// cache's decoded values, on fresh random inputs; then the models against the reference's
// flash-attention logits and against the CPU's flash attention. Skips without a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cuda/device.h"
#include "cuda/flash_attention.h"
#include "gpu_test_util.h"
#include "quant/turboquant.h"
#include "reference_check.h"
#include "runtime/cpu_ops.h"
#include "runtime/kv_cache.h"
#include "runtime/session.h"

using namespace fitmoe;
using namespace fitmoe::gpu;
namespace gt = fitmoe::gpu::test;
using gt::Dev;
using gt::randn;
using gt::upload;
using gt::has_device;

namespace {

struct FlashCase {
  DType k, v;
  int n_head, n_head_kv, hd, hdv;
  int pos0, n_tokens;
  int window;   // > 0: sliding window over a ring of window + n_tokens positions
  bool rotate;  // the reference's Walsh-Hadamard rotation (quantized types, heads multiple of 64)
};

std::string name(const FlashCase& c) {
  return std::string(dtype_name(c.k)) + "/" + dtype_name(c.v) + " heads " + std::to_string(c.n_head) + "/" +
         std::to_string(c.n_head_kv) + " dims " + std::to_string(c.hd) + "/" + std::to_string(c.hdv) + " pos0 " +
         std::to_string(c.pos0) + " tokens " + std::to_string(c.n_tokens) + " window " + std::to_string(c.window) +
         (c.rotate ? " rotated" : "");
}

// The host cache of a case (cpu::KvView, flash layout) with every position 0 .. pos0 + n_tokens stored by
// cpu::kv_store, and its GPU twin; K/V inputs random.
struct Caches {
  cpu::KvView view{};
  DevKv dev{};
  std::vector<uint8_t> hk, hv;
  std::unique_ptr<Dev> dk, dv;
  std::vector<float> kin, vin;
  int n_ctx = 0;
};

void make_caches(const FlashCase& c, uint64_t seed, Caches* C, bool gpu_stores_new) {
  const int n_keys = c.pos0 + c.n_tokens;
  C->n_ctx = c.window > 0 ? c.window + c.n_tokens : n_keys + 16;
  KvCacheType t{c.k, c.v, FlashAttn::On};
  const KvRotation rot = kv_rotation(t, {c.hd}, {c.hdv});
  cpu::KvView& v = C->view;
  v.type = c.k;
  v.n_ctx = C->n_ctx;
  v.k_row_bytes = static_cast<int64_t>(c.n_head_kv) * kv_row_bytes(c.k, c.hd);
  v.ring = c.window > 0;
  v.flash = true;
  v.v_type = c.v;
  v.v_row_bytes = static_cast<int64_t>(c.n_head_kv) * kv_row_bytes(c.v, c.hdv);
  v.rot_k = c.rotate ? rot.k : 0;
  v.rot_v = c.rotate ? rot.v : 0;
  v.tq_block_k = tq_block(c.hd);
  v.tq_block_v = tq_block(c.hdv);
  C->hk.assign(static_cast<size_t>(v.k_row_bytes) * C->n_ctx, 0);
  C->hv.assign(static_cast<size_t>(v.v_row_bytes) * C->n_ctx, 0);
  v.k = C->hk.data();
  v.v = C->hv.data();
  const int kw = c.n_head_kv * c.hd, vw = c.n_head_kv * c.hdv;
  C->kin = randn(static_cast<size_t>(n_keys) * kw, seed, 1.0f);
  C->vin = randn(static_cast<size_t>(n_keys) * vw, seed + 1, 1.0f);
  C->dk = std::make_unique<Dev>(C->hk.size());
  C->dv = std::make_unique<Dev>(C->hv.size());
  DevKv& d = C->dev;
  d = DevKv{c.k, C->dk->bytes(), C->dv->bytes(), C->n_ctx};
  d.flash = true;
  d.v_type = c.v;
  d.k_row_bytes = v.k_row_bytes;
  d.v_row_bytes = v.v_row_bytes;
  d.rot_k = v.rot_k;
  d.rot_v = v.rot_v;
  d.tq_block_k = v.tq_block_k;
  d.tq_block_v = v.tq_block_v;
  // History on the host (a ring keeps only what the batch sees), uploaded; the new tokens by the GPU's
  // store or uploaded too.
  const int first = c.window > 0 ? std::max(0, c.pos0 - c.window) : 0;
  const int hist_end = gpu_stores_new ? c.pos0 : n_keys;
  for (int p = first; p < hist_end; ++p)
    cpu::kv_store(v, p, 1, C->kin.data() + static_cast<size_t>(p) * kw, kw, C->vin.data() + static_cast<size_t>(p) * vw,
                  vw, kw, vw);
  C->dk->up(C->hk.data(), C->hk.size());
  C->dv->up(C->hv.data(), C->hv.size());
}

class GpuFlashStore : public ::testing::TestWithParam<FlashCase> {};

TEST_P(GpuFlashStore, WritesTheCpuBytes) {
  if (!has_device()) GTEST_SKIP() << "no CUDA GPU";
  const FlashCase& c = GetParam();
  SCOPED_TRACE(name(c));
  Caches C;
  make_caches(c, 11, &C, true);
  const int kw = c.n_head_kv * c.hd, vw = c.n_head_kv * c.hdv;
  std::vector<int32_t> pos(c.n_tokens);
  for (int t = 0; t < c.n_tokens; ++t) pos[t] = c.pos0 + t;
  auto d_pos = upload(pos);
  auto d_k = upload(std::vector<float>(C.kin.begin() + static_cast<size_t>(c.pos0) * kw, C.kin.end()));
  auto d_v = upload(std::vector<float>(C.vin.begin() + static_cast<size_t>(c.pos0) * vw, C.vin.end()));
  flash_kv_store(C.dev, c.window > 0, d_pos->as<int32_t>(), c.n_tokens, d_k->as<float>(), kw, d_v->as<float>(), vw,
                 c.n_head_kv, c.hd, c.hdv, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  cpu::kv_store(C.view, c.pos0, c.n_tokens, C.kin.data() + static_cast<size_t>(c.pos0) * kw, kw,
                C.vin.data() + static_cast<size_t>(c.pos0) * vw, vw, kw, vw);
  auto gk = C.dk->down<uint8_t>(C.hk.size()), gv = C.dv->down<uint8_t>(C.hv.size());
  for (int t = 0; t < c.n_tokens; ++t) {
    const int s = C.view.slot(c.pos0 + t);
    for (int64_t i = 0; i < C.view.k_row_bytes; ++i)
      ASSERT_EQ(gk[s * C.view.k_row_bytes + i], C.hk[s * C.view.k_row_bytes + i]) << "K of token " << t << " byte " << i;
    for (int64_t i = 0; i < C.view.v_row_bytes; ++i)
      ASSERT_EQ(gv[s * C.view.v_row_bytes + i], C.hv[s * C.view.v_row_bytes + i]) << "V of token " << t << " byte " << i;
  }
}

// kernel: 0 as the engine picks, 1 the decode kernel forced.
void run_flash_case(const FlashCase& c, uint64_t seed, int kernel, double rel_tol) {
  Caches C;
  make_caches(c, seed, &C, false);
  const int n_keys = c.pos0 + c.n_tokens;
  const int64_t ld_q = static_cast<int64_t>(c.n_head) * c.hd + 8, ld_out = static_cast<int64_t>(c.n_head) * c.hdv + 4;
  std::vector<float> q = randn(static_cast<size_t>(ld_q) * c.n_tokens, seed + 2, 1.0f);
  std::vector<int32_t> pos(c.n_tokens);
  for (int t = 0; t < c.n_tokens; ++t) pos[t] = c.pos0 + t;
  auto d_pos = upload(pos);
  auto dq = upload(q);
  Dev dout(static_cast<size_t>(ld_out) * c.n_tokens * sizeof(float));
  Dev scratch(flash_scratch_bytes(c.n_head, c.hdv));
  const float scale = 1.0f / std::sqrt(static_cast<float>(c.hd));
  const int keys_max = c.window > 0 ? std::min(c.window, n_keys) : n_keys;
  flash_attention(dq->as<float>(), ld_q, C.dev, c.window > 0, c.window, d_pos->as<int32_t>(), c.n_tokens, keys_max,
                  c.n_head, c.n_head_kv, c.hd, c.hdv, scale, dout.as<float>(), ld_out, scratch.as(), scratch.size(),
                  nullptr, kernel);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  auto got = dout.down<float>(static_cast<size_t>(ld_out) * c.n_tokens);

  // The reference: scores in K's stored domain (Q rotated as K, then in K's dot format as the
  // reference's kernels take it: f16 for f16 K, q8_0 for q8_0 / q4_0 K), V decoded back to its
  // unrotated values, a softmax in double.
  const cpu::KvView& v = C.view;
  const int group = c.n_head / c.n_head_kv;
  std::vector<float> kd(c.hd), vd(c.hdv), qs(c.hd);
  std::vector<uint8_t> qq(row_bytes(DType::Q8_0, c.hd));
  std::vector<double> sc;
  int bad = 0;
  for (int t = 0; t < c.n_tokens; ++t) {
    const int p = c.pos0 + t, lo = c.window > 0 ? std::max(0, p - c.window + 1) : 0;
    for (int h = 0; h < c.n_head; ++h) {
      const int g = h / group;
      std::copy(q.begin() + t * ld_q + h * c.hd, q.begin() + t * ld_q + (h + 1) * c.hd, qs.begin());
      if (v.rot_k) cpu::hadamard_blocks(qs.data(), c.hd, v.rot_k);
      if (kv_type_is_tq(c.k))
        for (int b = 0; b < c.hd; b += v.tq_block_k) tq::rotate(qs.data() + b, v.tq_block_k);
      if (c.k == DType::F16)
        for (float& x : qs) x = f16_to_f32(f32_to_f16(x));
      if (c.k == DType::Q8_0 || c.k == DType::Q4_0) {
        cpu::kv_quantize_row(DType::Q8_0, qs.data(), qq.data(), c.hd);
        cpu::kv_dequantize_row(DType::Q8_0, qq.data(), qs.data(), c.hd);
      }
      sc.assign(p + 1 - lo, 0.0);
      double mx = -1e300;
      for (int j = lo; j <= p; ++j) {
        const uint8_t* kr = v.k + v.slot(j) * v.k_row_bytes + g * kv_row_bytes(c.k, c.hd);
        if (kv_type_is_tq(c.k)) {
          const size_t bb = tq::block_bytes(v.tq_block_k, tq_bits(c.k));
          for (int b = 0; b < c.hd; b += v.tq_block_k)
            tq::decode_block_rotated(kr + b / v.tq_block_k * bb, v.tq_block_k, tq_bits(c.k), kd.data() + b);
        } else {
          cpu::kv_dequantize_row(c.k, kr, kd.data(), c.hd);  // (the stored, rotated domain)
        }
        double d = 0;
        for (int e = 0; e < c.hd; ++e) d += static_cast<double>(qs[e]) * kd[e];
        sc[j - lo] = d * scale;
        mx = std::max(mx, sc[j - lo]);
      }
      double sum = 0;
      for (double& s : sc) sum += (s = std::exp(s - mx));
      std::vector<double> o(c.hdv, 0.0), mag(c.hdv, 0.0);
      for (int j = lo; j <= p; ++j) {
        cpu::kv_dequantize_row(c.v, v.v + v.slot(j) * v.v_row_bytes + g * kv_row_bytes(c.v, c.hdv), vd.data(), c.hdv,
                               v.tq_block_v);
        if (v.rot_v) cpu::hadamard_blocks(vd.data(), c.hdv, v.rot_v);
        for (int d = 0; d < c.hdv; ++d) {
          o[d] += sc[j - lo] / sum * vd[d];
          mag[d] += sc[j - lo] / sum * std::fabs(vd[d]);
        }
      }
      for (int d = 0; d < c.hdv; ++d) {
        const double gv = got[t * ld_out + h * c.hdv + d];
        const double tol = rel_tol * (mag[d] + 0.05);
        if (!(std::fabs(gv - o[d]) <= tol) && bad++ < 5)
          ADD_FAILURE() << "token " << t << " head " << h << " dim " << d << ": got " << gv << " want " << o[d]
                        << " (tol " << tol << ")";
      }
    }
  }
  EXPECT_EQ(bad, 0);
}

class GpuFlashAttention : public ::testing::TestWithParam<FlashCase> {};

TEST_P(GpuFlashAttention, MatchesTheDecodedCache) {
  if (!has_device()) GTEST_SKIP() << "no CUDA GPU";
  const FlashCase& c = GetParam();
  SCOPED_TRACE(name(c));
  // The decode kernel computes in f32 on the decoded values (tolerance: f32 rounding of the rotations
  // and sums); the tensor-core kernel rounds Q, K, V and P to f16.
  const bool tensor_cores = c.n_tokens >= 64;  // (flash_attention: smaller batches take the decode kernel)
  run_flash_case(c, 5, 0, tensor_cores ? 1e-2 : 2e-4);
  if (tensor_cores) {
    SCOPED_TRACE("decode kernel forced");
    run_flash_case(c, 6, 1, 2e-4);
  }
}

// Every type as K and as V, decode and prefill, the head widths of the target models (32 .. 512), GQA
// groups of 1 .. 16, rotations, sliding windows over rings, and depths over several splits.
std::vector<FlashCase> attention_cases() {
  const DType all[] = {DType::F32, DType::F16, DType::BF16, DType::Q8_0, DType::Q4_0, DType::TQ4, DType::TQ3, DType::TQ2};
  std::vector<FlashCase> v;
  for (DType k : all)
    for (DType val : all) v.push_back({k, val, 8, 2, 64, 64, 150, 1, 0, false});
  for (DType t : {DType::F16, DType::Q8_0, DType::Q4_0, DType::TQ3, DType::TQ4}) {
    v.push_back({t, t, 32, 4, 128, 128, 3000, 1, 0, true});    // qwen3-30b-a3b: group 8, many splits
    v.push_back({t, t, 32, 4, 128, 128, 700, 4, 0, true});     // a few drafted tokens
    v.push_back({t, t, 32, 4, 128, 128, 300, 100, 0, true});   // prefill at depth
    v.push_back({t, t, 16, 2, 256, 256, 500, 3, 0, true});     // qwen35moe full attention
    v.push_back({t, t, 16, 2, 256, 256, 200, 80, 0, true});
    v.push_back({t, t, 16, 2, 256, 256, 100, 20, 0, true});    // a batch under 64: the decode kernel
    v.push_back({t, t, 16, 2, 512, 512, 300, 2, 0, false});    // gemma4 global layers
    v.push_back({t, t, 16, 2, 512, 512, 100, 64, 0, false});
    v.push_back({t, t, 16, 8, 256, 256, 900, 1, 64, false});   // gemma4 sliding layers: a window over a ring
    v.push_back({t, t, 16, 8, 256, 256, 900, 70, 64, false});
    v.push_back({t, t, 8, 2, 32, 32, 90, 70, 0, false});       // qwen3moe-tiny's heads
    v.push_back({t, t, 16, 1, 64, 64, 50, 96, 0, true});       // group of 16
    v.push_back({t, t, 6, 2, 64, 64, 80, 2, 0, false});        // group of 3
  }
  return v;
}

INSTANTIATE_TEST_SUITE_P(Cases, GpuFlashAttention, ::testing::ValuesIn(attention_cases()));

std::vector<FlashCase> store_cases() {
  std::vector<FlashCase> v;
  const DType all[] = {DType::F32, DType::F16, DType::BF16, DType::Q8_0, DType::Q4_0, DType::TQ4, DType::TQ3, DType::TQ2};
  for (DType k : all) {
    v.push_back({k, k, 8, 2, 32, 32, 5, 7, 0, false});
    v.push_back({k, k, 8, 2, 64, 64, 5, 7, 0, true});
    v.push_back({k, k, 8, 4, 128, 128, 0, 3, 0, true});
    v.push_back({k, k, 8, 2, 256, 256, 40, 5, 16, true});
    v.push_back({k, k, 8, 2, 512, 512, 3, 2, 0, false});
    v.push_back({k, DType::TQ3, 8, 2, 96, 96, 3, 2, 0, false});  // tq blocks of 32 in a head of 96
  }
  return v;
}
INSTANTIATE_TEST_SUITE_P(Cases, GpuFlashStore, ::testing::ValuesIn(store_cases()));

// ---- the models ---------------------------------------------------------------------------------

std::unique_ptr<Model> load_gpu(const std::string& path) {
  LoadOptions lo;
  lo.plan.n_ctx = 512;
  lo.plan.n_ubatch = 256;
  auto m = Model::load(path, lo);
  EXPECT_TRUE(m->on_gpu());
  return m;
}

bool have_gpu() {
  DeviceInfo di;
  return query_device(&di);
}

struct ModelCase {
  std::string folder, type;
};
class GpuFlashReference : public ::testing::TestWithParam<ModelCase> {};

// The reference's flash-attention logits (f16, q8_0, q4_0 caches): the prompt in one batch (decode
// kernel for p7, tensor cores beyond), and p33 token by token through the decode graphs.
TEST_P(GpuFlashReference, LogitsMatchForEveryCacheType) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU";
  const ModelCase& c = GetParam();
  const std::string dir = fitmoe::test::testdata(c.folder);
  auto manifest = fitmoe::test::read_json(dir + "/manifest.json");
  auto model = load_gpu(dir + "/" + c.folder + "-" + c.type + ".gguf");
  const auto tol = fitmoe::test::tolerance_for(c.type);
  const int n_vocab = model->config().n_vocab;
  for (const char* p : {"p7", "p33", "p200"}) {
    const auto& ref = manifest["files"][c.type]["refs"][p];
    ASSERT_TRUE(ref.contains("logits_fa_kv")) << p;
    auto prompt = manifest["prompts"][p]["ids"].get<std::vector<int32_t>>();
    const int row0 = ref["logits_rows"][0].get<int>();
    for (const auto& [key, file] : ref["logits_fa_kv"].items()) {
      const KvCacheType kv = fitmoe::test::fa_kv_type(key);
      auto logits = fitmoe::test::read_f32(dir + "/" + file.get<std::string>());
      const std::string label = c.folder + "-" + c.type + " gpu " + p + " " + key;
      std::printf("  %s\n", fitmoe::test::check_logits(*model, prompt, row0, logits, tol, label, kv).c_str());
      if (std::string(p) != "p33") continue;
      // Token by token: each step's logits against the stored row of its position.
      SessionOptions so;
      so.n_threads = 2;
      so.n_ctx = static_cast<int>(prompt.size()) + 8;
      so.kv = kv;
      Session s(*model, so);
      const int rows = static_cast<int>(logits.size() / n_vocab);
      double worst = 0;
      for (size_t i = 0; i < prompt.size(); ++i) {
        const std::vector<int32_t> one{prompt[i]};
        const std::vector<float>& l = s.eval(one, 1);
        const int r = static_cast<int>(i) - row0;
        if (r >= 0 && r < rows) worst = std::max(worst, fitmoe::test::rel_l2(l.data(), logits.data() + static_cast<size_t>(r) * n_vocab, n_vocab));
      }
      EXPECT_LE(worst, tol.max_row) << label << " token by token";
      std::printf("  %s token by token: worst %.2e\n", label.c_str(), worst);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllFiles, GpuFlashReference,
                         ::testing::Values(ModelCase{"qwen3moe-tiny", "f32"}, ModelCase{"qwen3moe-tiny", "q4_k_m"},
                                           ModelCase{"qwen35moe-tiny", "f32"}),
                         [](const auto& info) {
                           std::string n = info.param.folder + "_" + info.param.type;
                           for (char& ch : n)
                             if (ch == '-') ch = '_';
                           return n;
                         });

// Every cache type on every architecture (gemma4's sliding rings and shared KV too): the GPU's logits
// against the CPU's with the same cache type, token by token past gemma4's window (the decode kernels
// of both compute in f32; the tensor-core kernel's f16 rounding can flip the tiny MoE models' routing,
// and is held to the decoded cache in GpuFlashAttention instead).
class GpuFlashVsCpu : public ::testing::TestWithParam<std::string> {};

TEST_P(GpuFlashVsCpu, EveryCacheTypeAgreesWithTheCpu) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU";
  const std::string folder = GetParam();
  const std::string dir = fitmoe::test::testdata(folder);
  const std::string path = dir + "/" + folder + "-f32.gguf";
  auto gpu_model = load_gpu(path);
  LoadOptions lo;
  lo.plan.use_gpu = false;
  auto cpu_model = Model::load(path, lo);
  const int n_vocab = gpu_model->config().n_vocab;
  std::vector<int32_t> prompt(40);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int32_t>((i * 7919 + 13) % n_vocab);
  for (DType t : {DType::F16, DType::Q8_0, DType::Q4_0, DType::TQ4, DType::TQ3, DType::TQ2}) {
    KvCacheType kv{t, t, FlashAttn::On};
    if (t == DType::TQ2) kv.k = DType::Q8_0;  // (a mixed pair)
    auto run = [&](Model& m) {
      SessionOptions so;
      so.n_threads = 2;
      so.n_ctx = 128;
      so.kv = kv;
      Session s(m, so);
      std::vector<float> all;
      for (size_t i = 0; i < prompt.size(); ++i) {
        const std::vector<int32_t> one{prompt[i]};
        const std::vector<float>& l = s.eval(one, 1);
        all.insert(all.end(), l.begin(), l.end());
      }
      return all;
    };
    const std::vector<float> g = run(*gpu_model), r = run(*cpu_model);
    ASSERT_EQ(g.size(), r.size());
    double worst = 0;
    for (size_t row = 0; row < g.size() / n_vocab; ++row)
      worst = std::max(worst, fitmoe::test::rel_l2(g.data() + row * n_vocab, r.data() + row * n_vocab, n_vocab));
    std::printf("  %s %s: worst row rel L2 GPU vs CPU %.2e\n", folder.c_str(), kv.name().c_str(), worst);
    EXPECT_LE(worst, 2e-2) << folder << " " << kv.name();
  }
}

INSTANTIATE_TEST_SUITE_P(Models, GpuFlashVsCpu,
                         ::testing::Values("qwen3moe-tiny", "qwen35moe-tiny", "gemma4-tiny", "gemma4moe-tiny"),
                         [](const auto& info) {
                           std::string n = info.param;
                           for (char& ch : n)
                             if (ch == '-') ch = '_';
                           return n;
                         });

}  // namespace
