// qwen3moe and qwen3 against the reference's logits and greedy tokens, for every file type in
// ../shared/testdata.
#include <gtest/gtest.h>

#include "reference_check.h"

using namespace fitmoe;

namespace {

struct Case {
  std::string folder, type;
};

class Qwen3Reference : public ::testing::TestWithParam<Case> {};

TEST_P(Qwen3Reference, LogitsAndGreedyMatch) {
  const Case& c = GetParam();
  const std::string dir = test::testdata(c.folder);
  auto manifest = test::read_json(dir + "/manifest.json");
  auto model = Model::load(dir + "/" + c.folder + "-" + c.type + ".gguf");
  const auto tol = test::tolerance_for(c.type);
  for (const char* p : {"p7", "p33", "p200"}) {
    const auto& ref = manifest["files"][c.type]["refs"][p];
    auto prompt = manifest["prompts"][p]["ids"].get<std::vector<int32_t>>();
    auto logits = test::read_f32(dir + "/" + ref["logits"].get<std::string>());
    const int row0 = ref["logits_rows"][0].get<int>();
    std::string summary = test::check_logits(*model, prompt, row0, logits, tol, c.folder + "-" + c.type + " " + p);
    std::printf("  %s\n", summary.c_str());
    test::check_greedy(*model, test::read_json(dir + "/" + ref["greedy"].get<std::string>()), tol,
                       c.folder + "-" + c.type + " " + p);
  }
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (const char* t : {"f32", "f16", "bf16", "q8_0", "q6_k", "q5_k_m", "q4_k_m", "q5_1", "q4_0", "iq4_xs", "q3_k_m"})
    out.push_back({"qwen3moe-tiny", t});
  for (const char* t : {"f32", "q8_0"}) out.push_back({"qwen3-draft", t});
  return out;
}

INSTANTIATE_TEST_SUITE_P(AllFiles, Qwen3Reference, ::testing::ValuesIn(cases()), [](const auto& info) {
  std::string n = info.param.folder + "_" + info.param.type;
  std::replace(n.begin(), n.end(), '-', '_');
  return n;
});

// The f32 KV cache against the reference's kvf32 logits: the attention math without f16 rounding.
TEST(Qwen3Reference, F32KvCacheMatchesKvF32Reference) {
  const std::string dir = test::testdata("qwen3moe-tiny");
  auto manifest = test::read_json(dir + "/manifest.json");
  auto model = Model::load(dir + "/qwen3moe-tiny-f32.gguf");
  for (const char* p : {"p7", "p33", "p200"}) {
    const auto& ref = manifest["files"]["f32"]["refs"][p];
    auto prompt = manifest["prompts"][p]["ids"].get<std::vector<int32_t>>();
    auto logits = test::read_f32(dir + "/" + ref["logits_kv_f32"].get<std::string>());
    test::check_logits(*model, prompt, ref["logits_rows"][0].get<int>(), logits, {1e-4, -1, 0, 0.02, 0.05},
                       std::string("kvf32 ") + p, KvCacheType{DType::F32, DType::F32});
  }
}

}  // namespace

// Loading into memory (the default) must leave every weight the forward pass reads pointing into the
// loaded copy, not into the file mapping the model was first built on; with --mmap, into the mapping.
TEST(ModelLoad, WeightsLiveWhereTheDataWasLoaded) {
  const std::string path = test::testdata("qwen3moe-tiny") + "/qwen3moe-tiny-q8_0.gguf";
  for (bool mmap : {false, true}) {
    LoadOptions lo;
    lo.use_mmap = mmap;
    lo.plan.use_gpu = false;
    auto model = Model::load(path, lo);
    const uint8_t* lo_ptr = model->file().data_begin();
    const uint8_t* hi_ptr = lo_ptr + model->file().data_bytes();
    int n = 0;
    model->visit_weights([&](const Weight& w) {
      ++n;
      EXPECT_TRUE(w.host >= lo_ptr && w.host < hi_ptr) << (mmap ? "mmap: " : "in memory: ") << w.info->name;
      EXPECT_EQ(w.host, w.info->data) << w.info->name;
    });
    EXPECT_GT(n, 10);
  }
}
