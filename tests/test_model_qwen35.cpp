// qwen35moe against the reference's logits and greedy tokens (../shared/testdata qwen35moe-tiny and
// qwen35moe-mtp-tiny, f32 and q4_k_m), the MTP head's logits and hidden rows, state checkpoints and
// rewinds, and files whose layer pattern, head counts or shapes disagree.
#include <gtest/gtest.h>

#include <filesystem>

#include "cli_util.h"
#include "gguf_copy.h"
#include "model/qwen35.h"
#include "model/synthetic.h"
#include "reference_check.h"
#include "runtime/error.h"
#include "runtime/thread_pool.h"

using namespace fitmoe;

namespace {

struct Case {
  std::string folder, type;
};

class Qwen35Reference : public ::testing::TestWithParam<Case> {};

TEST_P(Qwen35Reference, LogitsAndGreedyMatch) {
  const Case& c = GetParam();
  const std::string dir = test::testdata(c.folder);
  auto manifest = test::read_json(dir + "/manifest.json");
  auto model = Model::load(dir + "/" + c.folder + "-" + c.type + ".gguf");
  const auto tol = test::tolerance_for(c.type);
  for (const char* p : {"p7", "p33", "p200"}) {
    const auto& ref = manifest["files"][c.type]["refs"][p];
    auto prompt = manifest["prompts"][p]["ids"].get<std::vector<int32_t>>();
    const int row0 = ref["logits_rows"][0].get<int>();
    const std::string label = c.folder + "-" + c.type + " " + p;
    auto logits = test::read_f32(dir + "/" + ref["logits"].get<std::string>());
    std::printf("  %s\n", test::check_logits(*model, prompt, row0, logits, tol, label).c_str());
    // Flash attention on with an f16 cache: the README holds it to the main reference's tolerance.
    if (ref.contains("logits_fa_kv") && ref["logits_fa_kv"].contains("fa-kvf16-f16")) {
      auto fa = test::read_f32(dir + "/" + ref["logits_fa_kv"]["fa-kvf16-f16"].get<std::string>());
      std::printf("  %s\n", test::check_logits(*model, prompt, row0, fa, tol, label + " fa-kvf16-f16").c_str());
    }
    // The reference without its repacked Q4_K kernels (another f32 summation order): the same tolerance.
    if (ref.contains("logits_no_repack")) {
      auto nr = test::read_f32(dir + "/" + ref["logits_no_repack"].get<std::string>());
      std::printf("  %s\n", test::check_logits(*model, prompt, row0, nr, tol, label + " norepack").c_str());
    }
    test::check_greedy(*model, test::read_json(dir + "/" + ref["greedy"].get<std::string>()), tol, label);
  }
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (const char* f : {"qwen35moe-tiny", "qwen35moe-mtp-tiny"})
    for (const char* t : {"f32", "q4_k_m"}) out.push_back({f, t});
  return out;
}

INSTANTIATE_TEST_SUITE_P(AllFiles, Qwen35Reference, ::testing::ValuesIn(cases()), [](const auto& info) {
  std::string n = info.param.folder + "_" + info.param.type;
  std::replace(n.begin(), n.end(), '-', '_');
  return n;
});

// The f32 KV cache against the reference's kvf32 logits: the attention math without f16 rounding.
TEST(Qwen35Reference, F32KvCacheMatchesKvF32Reference) {
  for (const char* folder : {"qwen35moe-tiny", "qwen35moe-mtp-tiny"}) {
    const std::string dir = test::testdata(folder);
    auto manifest = test::read_json(dir + "/manifest.json");
    auto model = Model::load(dir + "/" + folder + "-f32.gguf");
    for (const char* p : {"p7", "p33", "p200"}) {
      const auto& ref = manifest["files"]["f32"]["refs"][p];
      auto prompt = manifest["prompts"][p]["ids"].get<std::vector<int32_t>>();
      auto logits = test::read_f32(dir + "/" + ref["logits_kv_f32"].get<std::string>());
      std::printf("  %s\n", test::check_logits(*model, prompt, ref["logits_rows"][0].get<int>(), logits,
                                              {1e-4, -1, 0, 0.02, 0.05}, std::string(folder) + " kvf32 " + p, KvCacheType{DType::F32, DType::F32})
                                .c_str());
    }
  }
}

double worst_row(const std::vector<float>& a, const std::vector<float>& ref, int n, int rows) {
  double w = 0;
  for (int r = 0; r < rows; ++r) w = std::max(w, test::rel_l2(a.data() + static_cast<size_t>(r) * n, ref.data() + static_cast<size_t>(r) * n, n));
  return w;
}

// The MTP head, teacher-forced on p33 as the README describes: row r takes token x_r (x_33 = the first
// greedy token) and the trunk's hidden row r - 1 (zeros for row 0), all 34 rows in one batch.
TEST(Qwen35Mtp, LogitsAndHiddenMatchReference) {
  const std::string dir = test::testdata("qwen35moe-mtp-tiny");
  auto manifest = test::read_json(dir + "/manifest.json");
  for (const char* type : {"f32", "q4_k_m"}) {
    const bool f32 = std::string(type) == "f32";
    LoadOptions lo;
    lo.plan.use_gpu = false;
    auto model = Model::load(dir + "/qwen35moe-mtp-tiny-" + type + ".gguf", lo);
    ASSERT_TRUE(qwen35_has_mtp(*model));
    const int E = model->config().n_embd, V = model->config().n_vocab;
    auto prompt = manifest["prompts"]["p33"]["ids"].get<std::vector<int32_t>>();
    auto greedy = test::read_json(dir + "/ref/" + type + "/greedy-p33.json");
    const auto h_ref = test::read_f32(dir + "/ref/" + type + "/mtp-p33.h_target.f32");
    const auto logits_ref = test::read_f32(dir + "/ref/" + type + "/mtp-p33.logits.f32");
    const auto hmtp_ref = test::read_f32(dir + "/ref/" + type + "/mtp-p33.h_mtp.f32");
    const int n = static_cast<int>(prompt.size());
    ASSERT_EQ(h_ref.size(), static_cast<size_t>(n) * E);
    ASSERT_EQ(logits_ref.size(), static_cast<size_t>(n + 1) * V);

    ThreadPool pool(2);
    StateOptions so;
    so.n_ctx = 64;
    auto st = model->new_state(so);
    std::vector<float> hidden(static_cast<size_t>(n) * E), logits(static_cast<size_t>(n) * V);
    qwen35_forward_hidden(*model, *st, pool, prompt, n, logits.data(), hidden.data());
    const double h_err = worst_row(hidden, h_ref, E, n);
    std::printf("  %s trunk hidden rows vs h_target: worst rel L2 %.2e\n", type, h_err);
    EXPECT_LE(h_err, f32 ? 1e-3 : 0.2) << type;

    std::vector<int32_t> toks = prompt;
    toks.push_back(greedy["tokens"][0].get<int32_t>());
    std::vector<float> h_in(static_cast<size_t>(n + 1) * E, 0.0f);
    std::copy(h_ref.begin(), h_ref.end(), h_in.begin() + E);
    auto mst = qwen35_new_mtp_state(*model, so);
    std::vector<float> mlog(static_cast<size_t>(n + 1) * V), hout(static_cast<size_t>(n + 1) * E);
    qwen35_mtp_forward(*model, *mst, pool, toks, h_in.data(), mlog.data(), hout.data());
    EXPECT_EQ(mst->n_past(), n + 1);
    const double l_err = worst_row(mlog, logits_ref, V, n + 1), o_err = worst_row(hout, hmtp_ref, E, n + 1);
    std::printf("  %s MTP logits worst rel L2 %.2e, h_mtp %.2e\n", type, l_err, o_err);
    EXPECT_LE(l_err, f32 ? 1e-3 : 0.03) << type;
    EXPECT_LE(o_err, f32 ? 1e-3 : 0.03) << type;
    if (f32) {
      for (int r = 0; r <= n; ++r) {
        if (test::margin(logits_ref.data() + static_cast<size_t>(r) * V, V) > 0.03) {
          EXPECT_EQ(cpu::argmax(mlog.data() + static_cast<size_t>(r) * V, V),
                    cpu::argmax(logits_ref.data() + static_cast<size_t>(r) * V, V)) << "MTP row " << r;
        }
      }
    }
    // The same rows decoded one at a time (each row attends to the MTP K/V of the rows before it).
    auto mst1 = qwen35_new_mtp_state(*model, so);
    std::vector<float> one(static_cast<size_t>(V));
    double step_err = 0;
    for (int r = 0; r <= n; ++r) {
      qwen35_mtp_forward(*model, *mst1, pool, std::span<const int32_t>(&toks[r], 1), h_in.data() + static_cast<size_t>(r) * E,
                         one.data(), nullptr);
      step_err = std::max(step_err, test::rel_l2(one.data(), logits_ref.data() + static_cast<size_t>(r) * V, V));
    }
    EXPECT_LE(step_err, f32 ? 1e-3 : 0.05) << type;
  }
}

// A rewind lands at a checkpoint and re-evaluates from there: the next logits equal a fresh run's.
TEST(Qwen35State, TruncateRestoresFromCheckpointAndReevaluates) {
  const std::string dir = test::testdata("qwen35moe-tiny");
  auto manifest = test::read_json(dir + "/manifest.json");
  LoadOptions lo;
  lo.plan.use_gpu = false;
  auto model = Model::load(dir + "/qwen35moe-tiny-f32.gguf", lo);
  const int V = model->config().n_vocab;
  auto p = manifest["prompts"]["p33"]["ids"].get<std::vector<int32_t>>();
  const std::vector<int32_t> a(p.begin(), p.begin() + 20), extra(p.begin() + 20, p.begin() + 26),
      b(p.begin() + 26, p.end());
  SessionOptions so;
  so.n_threads = 2;
  so.n_ctx = 128;

  // Fresh: a, the first two tokens of extra, then b.
  Session fresh(*model, so);
  std::vector<int32_t> all = a;
  all.insert(all.end(), extra.begin(), extra.begin() + 2);
  fresh.eval(all, 0);
  const std::vector<float> want = fresh.eval(b, 1);

  // Rewound: a (a checkpoint at 20), extra token by token (no checkpoints), back to 22, then b.
  Session s(*model, so);
  s.eval(a, 0);
  for (int32_t t : extra) s.eval(std::span<const int32_t>(&t, 1), 1);
  ASSERT_EQ(s.n_past(), 26);
  s.truncate(22);
  EXPECT_EQ(s.n_past(), 22);
  const std::vector<float> got = s.eval(b, 1);
  EXPECT_LE(test::rel_l2(got.data(), want.data(), V), 1e-6);

  // At the state level: the rewind lands at the nearest checkpoint, never above what was asked.
  auto st = model->new_state({128, KvCacheType{}, 4});
  ThreadPool pool(2);
  EXPECT_TRUE(st->recurrent());
  model->forward(*st, pool, a, 0, nullptr);
  st->checkpoint();
  model->forward(*st, pool, extra, 0, nullptr);
  st->truncate(24);
  EXPECT_EQ(st->n_past(), 20);
  st->truncate(10);  // below every checkpoint: back to the start
  EXPECT_EQ(st->n_past(), 0);
}

// Session::truncate to a position without a checkpoint re-evaluates from the start: same tokens as a
// fresh run for a rewind in the middle of a generated answer (what chat does between turns).
TEST(Qwen35State, ChatRewindGivesTheSameTokensAsAFreshRun) {
  const std::string dir = test::testdata("qwen35moe-tiny");
  auto manifest = test::read_json(dir + "/manifest.json");
  LoadOptions lo;
  lo.plan.use_gpu = false;
  auto model = Model::load(dir + "/qwen35moe-tiny-q4_k_m.gguf", lo);
  auto p7 = manifest["prompts"]["p7"]["ids"].get<std::vector<int32_t>>();
  SessionOptions so;
  so.n_threads = 2;
  so.n_ctx = 256;
  SamplerParams sp;
  sp.temperature = 0;
  Session s(*model, so);
  Sampler sampler(sp);
  auto answer = s.generate(p7, 12, sampler);
  // Next turn: keep the prompt and the first 8 answer tokens, then a new "user" part.
  s.truncate(static_cast<int>(p7.size()) + 8);
  const std::vector<int32_t> turn2 = {1023, 198, 1022, 872, 198, 51};
  Sampler sampler2(sp);
  auto next = s.generate(turn2, 10, sampler2);

  Session f(*model, so);
  std::vector<int32_t> conv = p7;
  conv.insert(conv.end(), answer.begin(), answer.begin() + 8);
  conv.insert(conv.end(), turn2.begin(), turn2.end());
  Sampler sampler3(sp);
  auto want = f.generate(conv, 10, sampler3);
  EXPECT_EQ(next, want);
}

// Files whose hyperparameters disagree with their tensors or layer pattern: one line naming it.
TEST(Qwen35BadFile, OneLineErrorNamingTheProblem) {
  const std::string src = test::testdata("qwen35moe-tiny") + "/qwen35moe-tiny-f32.gguf";
  const std::string tmp = (std::filesystem::temp_directory_path() / "fitmoe-q35-bad.gguf").string();
  struct Bad {
    std::vector<test::Kv> kv;
    std::string expect;
  };
  std::vector<Bad> bad = {
      {{{"qwen35moe.attention.head_count", "u", "", 8}}, "tensor blk.1.attn_q.weight has shape"},
      {{{"qwen35moe.ssm.group_count", "u", "", 3}}, "must be a multiple of key heads"},
      {{{"qwen35moe.ssm.time_step_rank", "u", "", 2}}, "must equal the value width"},
      {{{"qwen35moe.expert_count", "u", "", 8}}, "tensor blk.0.ffn_gate_inp.weight has shape"},
      {{{"qwen35moe.full_attention_interval", "u", "", 1}},
       "layer 0 has DeltaNet tensors, but the layer pattern (full_attention_interval 1) makes it a full-attention layer"},
      {{{"qwen35moe.full_attention_interval", "u", "", 3}},
       "layer 1 has full-attention tensors, but the layer pattern (full_attention_interval 3) makes it a DeltaNet layer"},
      {{{"qwen35moe.ssm.conv_kernel", "u", "", 3}}, "tensor blk.0.ssm_conv1d.weight has shape"},
  };
  test::Kv order{"qwen35moe.attention.recurrent_layers", "ab", "", 0, {false, true}};
  bad.push_back({{order}, "layer 0 has DeltaNet tensors, but the layer pattern (attention.recurrent_layers) makes it a full-attention layer"});
  test::Kv too_short{"qwen35moe.attention.recurrent_layers", "ab", "", 0, {true}};
  bad.push_back({{too_short}, "attention.recurrent_layers must list 2 layers"});
  for (const Bad& b : bad) {
    test::write_with(src, tmp, b.kv);
    try {
      LoadOptions lo;
      lo.plan.use_gpu = false;
      Model::load(tmp, lo);
      ADD_FAILURE() << "loaded a file with " << b.kv[0].key << " = " << b.kv[0].v;
    } catch (const Error& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find(b.expect), std::string::npos) << m;
      EXPECT_EQ(m.find('\n'), std::string::npos) << m;
    }
  }
  // The explicit list, when right, is the same model as the interval.
  test::write_with(src, tmp, {{"qwen35moe.attention.recurrent_layers", "ab", "", 0, {true, false}}});
  LoadOptions lo;
  lo.plan.use_gpu = false;
  auto listed = Model::load(tmp, lo);
  EXPECT_EQ(listed->config().recurrent_layers, (std::vector<bool>{true, false}));
  EXPECT_EQ(listed->config().full_attention_interval, 0);
  std::filesystem::remove(tmp);
}

// gen-model's tiny presets write the fixtures' layout: the same tensor names, shapes and (q4_k_m) the
// types the reference's quantizer chose, metadata the loader reads the same way.
TEST(Qwen35GenModel, TinyPresetsHaveTheFixturesLayoutAndTypes) {
  ThreadPool pool(2);
  struct P {
    const char* preset;
    const char* folder;
  };
  for (const P& p : {P{"tiny", "qwen35moe-tiny"}, P{"tiny-mtp", "qwen35moe-mtp-tiny"}}) {
    for (const char* type : {"f32", "q4_k_m"}) {
      const std::string out = (std::filesystem::temp_directory_path() / (std::string("fitmoe-q35-gen-") + p.preset + type + ".gguf")).string();
      SyntheticSpec spec;
      spec.arch = "qwen35moe";
      spec.preset = p.preset;
      spec.type = type;
      write_synthetic_model(spec, out, pool);
      auto mine = gguf::File::open(out);
      auto ref = gguf::File::open(test::testdata(p.folder) + "/" + p.folder + "-" + type + ".gguf");
      EXPECT_EQ(mine->tensors().size(), ref->tensors().size()) << p.preset << " " << type;
      for (const auto& t : ref->tensors()) {
        const gguf::TensorInfo* m = mine->find_tensor(t.name);
        if (!m) {
          ADD_FAILURE() << p.preset << " " << type << ": no " << t.name;
          continue;
        }
        EXPECT_EQ(m->ne, t.ne) << t.name;
        EXPECT_EQ(dtype_name(m->type), dtype_name(t.type)) << p.preset << " " << type << " " << t.name;
      }
      LoadOptions lo;
      lo.plan.use_gpu = false;
      auto a = Model::load(out, lo), b = Model::load(ref->path(), lo);
      const ModelConfig &ca = a->config(), &cb = b->config();
      EXPECT_EQ(ca.recurrent_layers, cb.recurrent_layers);
      EXPECT_EQ(ca.n_layer_mtp, cb.n_layer_mtp);
      EXPECT_EQ(qwen35_layer_pattern(ca), qwen35_layer_pattern(cb));
      EXPECT_EQ(ca.n_rot, cb.n_rot);
      EXPECT_EQ(std::vector<int>(ca.rope_sections, ca.rope_sections + 4), std::vector<int>(cb.rope_sections, cb.rope_sections + 4));
      // Random weights, but a sane forward: finite logits.
      SessionOptions so;
      so.n_threads = 2;
      so.n_ctx = 64;
      Session s(*a, so);
      const std::vector<int32_t> toks = {1, 2, 3, 4, 5};
      const auto& lg = s.eval(toks, 1);
      for (float v : lg) ASSERT_TRUE(std::isfinite(v));
      std::filesystem::remove(out);
    }
  }
}

// Dense qwen35 (the same layers with one SwiGLU FFN): a prefill batch and token-by-token decoding give
// the same logits, and rewinds work as for the MoE.
TEST(Qwen35Dense, PrefillEqualsDecodeAndRewinds) {
  ThreadPool pool(2);
  const std::string out = (std::filesystem::temp_directory_path() / "fitmoe-q35-dense.gguf").string();
  SyntheticSpec spec;
  spec.arch = "qwen35";
  spec.preset = "tiny";
  spec.type = "f32";
  write_synthetic_model(spec, out, pool);
  LoadOptions lo;
  lo.plan.use_gpu = false;
  auto model = Model::load(out, lo);
  EXPECT_EQ(model->config().arch, "qwen35");
  const int V = model->config().n_vocab;
  std::vector<int32_t> toks;
  for (int i = 0; i < 12; ++i) toks.push_back((i * 37 + 5) % V);
  SessionOptions so;
  so.n_threads = 2;
  so.n_ctx = 64;
  Session a(*model, so), b(*model, so);
  const std::vector<float> all = a.eval(toks, static_cast<int>(toks.size()));
  for (size_t i = 0; i < toks.size(); ++i) {
    const auto& one = b.eval(std::span<const int32_t>(&toks[i], 1), 1);
    EXPECT_LE(test::rel_l2(one.data(), all.data() + i * V, V), 1e-5) << "position " << i;
  }
  b.truncate(5);  // no checkpoint (single-token evals): re-evaluates from 0
  const auto& again = b.eval(std::span<const int32_t>(&toks[5], 1), 1);
  EXPECT_LE(test::rel_l2(again.data(), all.data() + 5 * V, V), 1e-5);
  std::filesystem::remove(out);
}

// fitmoe info names the layer pattern, the MTP block and where it runs; a bad file is one line on
// stderr and exit code 1; gen-model writes the 35B-A3B shape cut to a few layers.
TEST(Qwen35Cli, InfoListsLayersAndMtpAndBadFilesFailInOneLine) {
  const std::string mtp = test::testdata("qwen35moe-mtp-tiny") + "/qwen35moe-mtp-tiny-q4_k_m.gguf";
  auto r = test::run_fitmoe("info -m " + mtp);
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("layers:        1 Gated DeltaNet + 1 gated full attention (one in 2); full attention at 1"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("MTP:           1 block (blk.2"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("supported:     yes (qwen35moe: 2 layers"), std::string::npos) << r.out;

  const std::string bad = test::temp_path("q35cli", "bad.gguf");
  test::write_with(mtp, bad, {{"qwen35moe.attention.head_count_kv", "u", "", 3}});
  r = test::run_fitmoe("info -m " + bad);
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find("head_count (4) must be a multiple of head_count_kv (3)"), std::string::npos) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  std::remove(bad.c_str());

  const std::string big = test::temp_path("q35cli", "35b.gguf");
  r = test::run_fitmoe("gen-model --arch qwen35moe --preset 35b-a3b --type q4_k_m --layers 1 -o " + big);
  EXPECT_EQ(r.code, 0) << r.err;
  r = test::run_fitmoe("info -m " + big);
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("16/2 heads x 256, vocab 248320, 256 experts, 8 active, width 512"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("1 Gated DeltaNet + 0 gated full attention"), std::string::npos) << r.out;
  std::remove(big.c_str());

  // logits --mtp-output dumps the MTP head as the reference's mtp-p33.logits.f32 lays it out.
  const std::string dir = test::testdata("qwen35moe-mtp-tiny");
  auto manifest = test::read_json(dir + "/manifest.json");
  auto toks = manifest["prompts"]["p33"]["ids"].get<std::vector<int32_t>>();
  toks.push_back(test::read_json(dir + "/ref/f32/greedy-p33.json")["tokens"][0].get<int32_t>());
  std::string list;
  for (int32_t t : toks) list += (list.empty() ? "" : ",") + std::to_string(t);
  const std::string lo = test::temp_path("q35cli", "trunk.f32"), mo = test::temp_path("q35cli", "mtp.f32");
  r = test::run_fitmoe("logits -m " + dir + "/qwen35moe-mtp-tiny-f32.gguf -t 2 --tokens " + list + " -o " + lo + " --mtp-output " + mo);
  ASSERT_EQ(r.code, 0) << r.err;
  const auto got = test::read_f32(mo), want = test::read_f32(dir + "/ref/f32/mtp-p33.logits.f32");
  ASSERT_EQ(got.size(), want.size());
  const int V = 1024;
  double worst = 0;
  for (size_t row = 0; row < toks.size(); ++row) worst = std::max(worst, test::rel_l2(got.data() + row * V, want.data() + row * V, V));
  EXPECT_LE(worst, 1e-3);
  std::remove(lo.c_str());
  std::remove(mo.c_str());
  r = test::run_fitmoe("logits -m " + test::testdata("qwen35moe-tiny") + "/qwen35moe-tiny-f32.gguf --tokens 1,2 -o " + lo + " --mtp-output " + mo);
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find("--mtp-output: the model has no MTP (nextn) block"), std::string::npos) << r.err;
}

// The per-sequence memory the plan should charge: KV only for the attention layers, a fixed state for
// the DeltaNets (about 63 MiB for the 35B shape, docs/models.md) kept once more per checkpoint.
TEST(Qwen35State, SequenceMemoryFromLayerSpecs) {
  const std::string dir = test::testdata("qwen35moe-mtp-tiny");
  LoadOptions lo;
  lo.plan.use_gpu = false;
  auto model = Model::load(dir + "/qwen35moe-mtp-tiny-f32.gguf", lo);
  const ModelConfig& c = model->config();
  // One attention layer in the trunk (1 KV head x (64 + 64) x f16) and the MTP block's; one DeltaNet
  // of conv 3 x 512 and 4 heads of 64 x 64 floats.
  const uint64_t kv = 1 * (64 + 64) * 2, rec = (3 * 512 + 4 * 64 * 64) * 4;
  EXPECT_EQ(sequence_memory_bytes(c, 100, KvCacheType{}, 0, false), kv * 100 + rec);
  EXPECT_EQ(sequence_memory_bytes(c, 100, KvCacheType{}, 2, true), 2 * kv * 100 + 3 * rec);
  StateOptions so;
  so.n_ctx = 100;
  auto st = model->new_state(so);
  EXPECT_EQ(st->bytes(), kv * 100 + rec);  // the state allocates what the specs say
  // The 35B-A3B shape.
  ModelConfig big = c;
  big.n_layer = 41;
  big.n_layer_mtp = 1;
  big.n_head = 16;
  big.n_head_kv = 2;
  big.head_dim = big.head_dim_v = 256;
  big.ssm_n_k_heads = 16;
  big.ssm_n_v_heads = 32;
  big.ssm_head_k_dim = big.ssm_head_v_dim = 128;
  big.ssm_conv_kernel = 4;
  big.recurrent_layers.assign(41, false);
  for (int l = 0; l < 40; ++l) big.recurrent_layers[l] = (l + 1) % 4 != 0;
  const double state_mib = static_cast<double>(sequence_memory_bytes(big, 0, KvCacheType{}, 0, false)) / (1 << 20);
  EXPECT_NEAR(state_mib, 62.8, 0.1);
  EXPECT_EQ(sequence_memory_bytes(big, 1, KvCacheType{}, 0, false) - sequence_memory_bytes(big, 0, KvCacheType{}, 0, false),
            10u * 2 * (256 + 256) * 2);  // KV per position: 10 attention layers of 2 KV heads
  // qwen3moe: every layer attention, as plan's kv_cache_bytes counts it.
  auto q3 = Model::load(test::testdata("qwen3moe-tiny") + "/qwen3moe-tiny-f32.gguf", lo);
  EXPECT_EQ(sequence_memory_bytes(q3->config(), 64, KvCacheType{}, 4), kv_cache_bytes(q3->config(), 64, KvCacheType{}));
}

}  // namespace
