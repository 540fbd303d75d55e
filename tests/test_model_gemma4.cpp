// gemma4 against the reference's logits and greedy tokens (../shared/testdata gemma4-tiny and
// gemma4moe-tiny, f32 and q4_k_m), decode past the sliding window on a ring cache, the layer
// descriptions' memory, and files whose per-layer arrays or shapes disagree.
#include <gtest/gtest.h>

#include <filesystem>

#include "gguf_copy.h"
#include "model/gemma4.h"
#include "model/layer_spec.h"
#include "reference_check.h"
#include "runtime/error.h"
#include "runtime/thread_pool.h"

using namespace fitmoe;

namespace {

struct Case {
  std::string folder, type;
};

// The README's Gemma tolerances: f32 <= 5e-3 (gemma4) / 1e-2 (gemma4moe, argmax where the margin
// exceeds 0.03); q4_k_m p95 <= 0.08 / max 0.2 (gemma4), p95 <= 0.12 / max 0.3 / top-1 80 % (gemma4moe).
test::Tolerance gemma_tolerance(const std::string& folder, const std::string& type) {
  const bool moe = folder == "gemma4moe-tiny";
  if (type == "f32") return moe ? test::Tolerance{1e-2, -1, 0, 0.03, 0.05} : test::Tolerance{5e-3, -1, 0, 0.02, 0.05};
  return moe ? test::Tolerance{0.3, 0.12, 0.80, -1, 0.5} : test::Tolerance{0.2, 0.08, 0.85, -1, 0.5};
}

class Gemma4Reference : public ::testing::TestWithParam<Case> {};

TEST_P(Gemma4Reference, LogitsAndGreedyMatch) {
  const Case& c = GetParam();
  const std::string dir = test::testdata(c.folder);
  auto manifest = test::read_json(dir + "/manifest.json");
  auto model = Model::load(dir + "/" + c.folder + "-" + c.type + ".gguf");
  const auto tol = gemma_tolerance(c.folder, c.type);
  for (const char* p : {"p7", "p33", "p200"}) {
    const auto& ref = manifest["files"][c.type]["refs"][p];
    auto prompt = manifest["prompts"][p]["ids"].get<std::vector<int32_t>>();
    const int row0 = ref["logits_rows"][0].get<int>();
    const std::string label = c.folder + "-" + c.type + " " + p;
    auto logits = test::read_f32(dir + "/" + ref["logits"].get<std::string>());
    std::printf("  %s\n", test::check_logits(*model, prompt, row0, logits, tol, label).c_str());
    if (ref.contains("logits_no_repack")) {
      auto nr = test::read_f32(dir + "/" + ref["logits_no_repack"].get<std::string>());
      std::printf("  %s\n", test::check_logits(*model, prompt, row0, nr, tol, label + " norepack").c_str());
    }
    if (ref.contains("logits_kv_f32")) {
      auto kv = test::read_f32(dir + "/" + ref["logits_kv_f32"].get<std::string>());
      std::printf("  %s\n", test::check_logits(*model, prompt, row0, kv, tol, label + " kvf32", KvCacheType{DType::F32, DType::F32}).c_str());
    }
    test::check_greedy(*model, test::read_json(dir + "/" + ref["greedy"].get<std::string>()), tol, label);
  }
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (const char* f : {"gemma4-tiny", "gemma4moe-tiny"})
    for (const char* t : {"f32", "q4_k_m"}) out.push_back({f, t});
  return out;
}

INSTANTIATE_TEST_SUITE_P(AllFiles, Gemma4Reference, ::testing::ValuesIn(cases()), [](const auto& info) {
  std::string n = info.param.folder + "_" + info.param.type;
  std::replace(n.begin(), n.end(), '-', '_');
  return n;
});

}  // namespace

namespace {

std::string tmp_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() / ("fitmoe-gemma4-" + name + ".gguf")).string();
}

// Decode past the sliding window on a ring that wraps: a copy with a window of 4, so the ring of
// 4 + kSlidingMicroBatch positions wraps inside a 1200-token context. Token-by-token decode (one
// position per step, the ring wrapping at every slot) equals evaluating the same tokens in batches
// (pieces of kSlidingMicroBatch, the wrap inside a piece), and after a rewind past what the ring
// holds the state starts again from 0.
TEST(Gemma4Window, DecodePastTheWindowOnAWrappingRing) {
  const std::string src = test::testdata("gemma4moe-tiny") + "/gemma4moe-tiny-f32.gguf";
  const std::string dst = tmp_path("window4");
  test::write_with(src, dst, {{"gemma4.attention.sliding_window", "u", "", 4}});
  auto model = Model::load(dst);
  const int N = 700, V = model->config().n_vocab;
  std::vector<int32_t> toks(N);
  for (int i = 0; i < N; ++i) toks[i] = (i * 37 + 11) % V;
  toks[0] = 2;
  ThreadPool pool(2);
  StateOptions so;
  so.n_ctx = 1200;
  auto a = model->new_state(so);
  auto b = model->new_state(so);
  // The ring is smaller than the context: the sliding layers hold window + micro-batch positions.
  EXPECT_EQ(a->bytes(), sequence_memory_bytes(model->config(), 1200, KvCacheType{}, 0));
  std::vector<float> la(V), lb(static_cast<size_t>(N) * V);
  model->forward(*b, pool, toks, N, lb.data());
  double worst = 0;
  for (int i = 0; i < N; ++i) {
    model->forward(*a, pool, std::span<const int32_t>(&toks[i], 1), 1, la.data());
    worst = std::max(worst, test::rel_l2(la.data(), lb.data() + static_cast<size_t>(i) * V, V));
  }
  std::printf("  decode vs batch over %d positions, window 4: worst row %.2e\n", N, worst);
  EXPECT_LT(worst, 1e-4);
  // A rewind within the micro-batch is exact; one past what the ring still holds starts again.
  a->truncate(N - 10);
  EXPECT_EQ(a->n_past(), N - 10);
  model->forward(*a, pool, std::span<const int32_t>(&toks[N - 10], 1), 1, la.data());
  EXPECT_LT(test::rel_l2(la.data(), lb.data() + static_cast<size_t>(N - 10) * V, V), 1e-4);
  a->truncate(N - 600);
  EXPECT_EQ(a->n_past(), 0);
  EXPECT_TRUE(a->recurrent());
  std::filesystem::remove(dst);
}

// The layer descriptions: kinds, widths, windows, and the bytes a state takes.
TEST(Gemma4Layers, SpecsAndMemory) {
  auto model = Model::load(test::testdata("gemma4moe-tiny") + "/gemma4moe-tiny-f32.gguf");
  const auto specs = layer_specs(model->config());
  ASSERT_EQ(specs.size(), 3u);
  EXPECT_EQ(specs[0].attn().window, 32);
  EXPECT_EQ(specs[0].attn().head_dim, 64);
  EXPECT_EQ(specs[0].attn().n_head_kv, 2);
  EXPECT_FALSE(specs[0].attn().k_eq_v);
  EXPECT_EQ(specs[2].attn().window, 0);
  EXPECT_EQ(specs[2].attn().head_dim, 128);
  EXPECT_EQ(specs[2].attn().n_head_kv, 1);
  EXPECT_TRUE(specs[2].attn().k_eq_v);
  EXPECT_TRUE(specs[2].moe && specs[2].dense);
  EXPECT_EQ(specs[2].moe->act, Activation::GeluTanh);
  // f16 KV at 8192 positions: two sliding layers of 2 x (64 + 64) x 2 bytes per position over
  // 32 + 512 positions, one global of (128 + 128) x 2 over all 8192.
  const uint64_t want = 2ull * 512 * (32 + kSlidingMicroBatch) + 512ull * 8192;
  EXPECT_EQ(sequence_memory_bytes(model->config(), 8192, KvCacheType{}, 4), want);
  StateOptions so;
  so.n_ctx = 8192;
  EXPECT_EQ(model->new_state(so)->bytes(), want);
  EXPECT_NE(gemma4_layer_pattern(model->config()).find("2 sliding (window 32"), std::string::npos);
}

// Shared KV on the layer descriptions of a config (no fixture has shared-KV layers; the refused
// case, a reader whose source is of the other kind, is in Gemma4BadFiles).
TEST(Gemma4Layers, SharedKvLayersReadTheLastOwnLayerOfTheirKind) {
  ModelConfig c;
  c.arch = "gemma4";
  c.n_layer = 6;
  c.n_head = 4;
  c.head_dim = c.head_dim_v = 128;
  c.head_dim_swa = 64;
  c.n_rot = 128;
  c.n_rot_swa = 64;
  c.sliding_window = 16;
  c.swa_layers = {true, true, false, true, true, false};
  c.n_head_kv_layers = {2, 2, 1, 2, 2, 1};
  c.shared_kv_layers = 3;  // layers 3, 4, 5 share; own KV: 0, 1, 2
  c.n_ff = 64;
  const auto s = gemma4_layer_specs(c);
  EXPECT_EQ(s[3].attn().kv_from, 1);
  EXPECT_EQ(s[4].attn().kv_from, 1);
  EXPECT_EQ(s[5].attn().kv_from, 2);
  EXPECT_EQ(layer_memory(s[4], KvCacheType{}).kv_bytes_per_pos, 0u);
  EXPECT_NE(gemma4_layer_pattern(c).find("shared KV: layers 3..5 read layers 1, 2"), std::string::npos)
      << gemma4_layer_pattern(c);
}

// Files whose per-layer arrays or shapes disagree: one Error line naming the problem.
TEST(Gemma4BadFiles, OneLineNamingTheProblem) {
  const std::string src = test::testdata("gemma4-tiny") + "/gemma4-tiny-f32.gguf";
  struct Bad {
    std::vector<test::Kv> kv;
    std::string want;
  };
  const std::vector<Bad> bad = {
      {{{"gemma4.attention.sliding_window_pattern", "ab", "", 0, {true, false, true}}},
       "sliding_window_pattern must list 2 layers"},
      {{{"gemma4.attention.sliding_window_pattern", "ab", "", 0, {false, true}}},
       "layer 0 has the attention of a sliding layer, but attention.sliding_window_pattern makes it global"},
      {{{"gemma4.attention.head_count_kv", "u", "", 3}}, "must be a positive multiple of its head_count_kv (3)"},
      {{{"gemma4.attention.shared_kv_layers", "u", "", 1}}, "shared-KV layer 1 (global) would read layer 0's KV"},
      {{{"gemma4.attention.key_length_swa", "u", "", 32}}, "key_length and value_length must agree"},
      {{{"gemma4.feed_forward_length", "u", "", 128}}, "tensor blk.0.ffn_gate.weight has shape"},
      {{{"gemma4.embedding_length_per_layer_input", "u", "", 256}}, "per-layer input embeddings"},
      {{{"gemma4.expert_count", "u", "", 4}, {"gemma4.expert_used_count", "u", "", 2}}, "missing tensor blk.0.post_ffw_norm_1"},
  };
  for (size_t i = 0; i < bad.size(); ++i) {
    const std::string dst = tmp_path("bad" + std::to_string(i));
    test::write_with(src, dst, bad[i].kv);
    try {
      Model::load(dst);
      ADD_FAILURE() << "loaded: " << bad[i].want;
    } catch (const Error& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find(bad[i].want), std::string::npos) << m;
      EXPECT_EQ(m.find('\n'), std::string::npos) << m;
    }
    std::filesystem::remove(dst);
  }
}

}  // namespace
