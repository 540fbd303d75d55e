// The public API as another program sees it: only <fitmoe/fitmoe.h> (and the fixtures' path).
#include <gtest/gtest.h>

#include <fitmoe/fitmoe.h>

#include "testdata.h"

namespace {

std::unique_ptr<fitmoe::Engine> tiny_engine() {
  fitmoe::LoadConfig c;
  c.model_path = fitmoe::test::testdata("qwen3moe-tiny/qwen3moe-tiny-f32.gguf");
  c.use_gpu = false;
  c.n_ctx = 256;
  c.n_threads = 2;
  return fitmoe::Engine::load(c);
}

}  // namespace

TEST(PublicApi, LoadTokenizeGenerateAndReuseThePrompt) {
  auto e = tiny_engine();
  EXPECT_EQ(e->architecture(), "qwen3moe");
  EXPECT_NE(e->plan_report().find("KV"), std::string::npos);
  const auto ids = e->tokenize("hello world", false);
  ASSERT_FALSE(ids.empty());
  EXPECT_EQ(e->detokenize(ids), "hello world");
  auto seq = e->new_sequence();
  const auto prompt = e->tokenize(e->apply_chat_template({{"user", "Say something."}}, true), true);
  fitmoe::GenerateOptions o;
  o.max_tokens = 10;
  o.temperature = 0;
  std::string streamed;
  const auto a = seq->generate(prompt, o, [&](const std::string& t) { streamed += t; return true; });
  EXPECT_EQ(streamed, a.text);
  EXPECT_EQ(a.n_reused, 0);
  EXPECT_GT(a.n_generated, 0);
  // The same prompt again: the sequence holds it (only the last token is evaluated), the same answer.
  const auto b = seq->generate(prompt, o);
  EXPECT_EQ(b.text, a.text);
  EXPECT_EQ(b.n_reused, static_cast<int>(prompt.size()) - 1);
  // A fresh sequence agrees too.
  EXPECT_EQ(e->new_sequence()->generate(prompt, o).text, a.text);
  const auto logits = seq->eval(std::vector<int32_t>{1, 2}, 2);
  EXPECT_EQ(logits.size(), 2u * e->n_vocab());
}

TEST(PublicApi, BadInputThrowsApiErrorNamingIt) {
  fitmoe::LoadConfig c;
  c.model_path = "/nonexistent/model.gguf";
  try {
    fitmoe::Engine::load(c);
    FAIL() << "loaded a file that does not exist";
  } catch (const fitmoe::ApiError& err) {
    EXPECT_NE(std::string(err.what()).find("/nonexistent/model.gguf"), std::string::npos) << err.what();
  }
  auto e = tiny_engine();
  auto seq = e->new_sequence();
  EXPECT_THROW(seq->eval(std::vector<int32_t>{-3}), fitmoe::ApiError);
  EXPECT_THROW(seq->generate({}, {}), fitmoe::ApiError);
  EXPECT_THROW(e->detokenize(std::vector<int32_t>{1 << 30}), fitmoe::ApiError);
  fitmoe::LoadConfig bad = c;
  bad.model_path = fitmoe::test::testdata("qwen3moe-tiny/qwen3moe-tiny-f32.gguf");
  bad.cache_type_k = "q5_k";
  try {
    fitmoe::Engine::load(bad);
    FAIL();
  } catch (const fitmoe::ApiError& err) {
    EXPECT_NE(std::string(err.what()).find("q5_k"), std::string::npos);
  }
}
