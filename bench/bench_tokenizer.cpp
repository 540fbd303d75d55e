// Tokenizer throughput on 1 MB of mixed text (English prose with a long tail of rare words, numbers,
// code, Cyrillic, Greek, CJK, Korean, emoji, markup and chat special tokens), one thread.
// The vocabularies come from ../shared/testdata (FITMOE_TESTDATA overrides). Run:
//   fitmoe_microbench --benchmark_filter=Tokenize
#include <benchmark/benchmark.h>

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "format/gguf.h"
#include "text/tokenizer.h"

namespace {

std::string testdata_dir() {
  const char* env = std::getenv("FITMOE_TESTDATA");
  if (env && *env) return env;
  // ../shared/testdata beside the checkout, found from this file's path (bench/ is one level down).
  std::string here = __FILE__;
  size_t slash = here.rfind('/');
  std::string dir = slash == std::string::npos ? "." : here.substr(0, slash);
  return dir + "/../../shared/testdata";
}

// Deterministic 1 MB mixed text. Rare words are made of random syllables so that the text has a
// realistic number of distinct words (a word cache cannot make everything a hit).
std::string mixed_text(size_t bytes) {
  static const char* common[] = {
      "the", "of", "and", "to", "in", "a", "is", "that", "for", "it", "as", "was", "with", "be", "by", "on",
      "not", "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an", "had", "they",
      "you", "were", "their", "one", "all", "we", "can", "her", "has", "there", "been", "if", "more", "when",
      "will", "would", "who", "so", "no", "model", "token", "memory", "expert", "layer", "weights", "GPU",
      "Transformer", "attention", "inference", "quantization", "throughput", "latency", "benchmark"};
  static const char* syll[] = {"ka", "lo", "mi", "ne", "tra", "vel", "qui", "zor", "an", "ex", "pha", "ri",
                               "ston", "gle", "mo", "du", "ser", "tion", "ing", "ly", "ph", "ough", "str", "y"};
  static const char* other[] = {
      "Привет, как дела? Это тестовый текст на русском языке. ",
      "Καλημέρα κόσμε, η γλώσσα είναι ελληνική. ",
      "你好，世界！我想在北京工作，天气很好。机器学习模型需要大量的数据。",
      "こんにちは世界。カタカナとひらがなのテキストです。",
      "한국어 텍스트입니다. 안녕하세요! ",
      "😀 🚀 ✅ 🦙🦙 👍🏽 🇺🇸 ",
      "Ünïcödé façade naïve Zürich Dvořák Łódź straße. ",
      "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
      "def fibonacci(n: int) -> int:\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n",
      "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }\n",
      "<div class=\"content\"><p>Hello &amp; welcome</p></div>\n",
      "| col A | col B |\n|---|---|\n| 1.5 | 2,000 |\n",
  };
  uint64_t s = 0x9E3779B97F4A7C15ull;
  auto rnd = [&](uint64_t n) {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    return s % n;
  };
  std::string out;
  out.reserve(bytes + 256);
  while (out.size() < bytes) {
    uint64_t r = rnd(100);
    if (r < 12) {
      out += other[rnd(sizeof(other) / sizeof(*other))];
      continue;
    }
    // A sentence.
    int words = 6 + static_cast<int>(rnd(14));
    for (int w = 0; w < words; ++w) {
      uint64_t k = rnd(100);
      std::string word;
      if (k < 72) {
        word = common[rnd(sizeof(common) / sizeof(*common))];
      } else if (k < 92) {
        int n = 2 + static_cast<int>(rnd(3));
        for (int j = 0; j < n; ++j) word += syll[rnd(sizeof(syll) / sizeof(*syll))];
        if (rnd(5) == 0) word[0] = static_cast<char>(word[0] - 32);
      } else {
        word = std::to_string(rnd(100000));
        if (rnd(3) == 0) word += "." + std::to_string(rnd(100));
      }
      if (w == 0 && word[0] >= 'a' && word[0] <= 'z') word[0] = static_cast<char>(word[0] - 32);
      out += word;
      out += w + 1 == words ? (rnd(4) == 0 ? "?\n" : ". ") : (rnd(8) == 0 ? ", " : " ");
    }
  }
  return out;
}

void run(benchmark::State& state, const std::string& rel, bool parse_special) {
  std::shared_ptr<fitmoe::gguf::File> f;
  std::unique_ptr<fitmoe::Tokenizer> tok;
  try {
    f = fitmoe::gguf::File::open(testdata_dir() + "/" + rel);
    tok = fitmoe::Tokenizer::from_gguf(*f);
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
    return;
  }
  const std::string text = mixed_text(1u << 20);
  size_t n_tokens = 0;
  tok->encode("warm-up \xc3\xa9 e\xcc\x81 \xe4\xbd\xa0", false);  // one-time Unicode table set-up is not part of the figure
  for (auto _ : state) {
    auto ids = tok->encode(text, false, parse_special);
    n_tokens = ids.size();
    benchmark::DoNotOptimize(ids.data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * text.size()));
  state.counters["tokens"] = static_cast<double>(n_tokens);
}

void BM_TokenizeQwen3(benchmark::State& st) { run(st, "tokenizers/qwen3-vocab.gguf", true); }
void BM_TokenizeGemma3(benchmark::State& st) { run(st, "tokenizers/gemma3-vocab.gguf", true); }
void BM_TokenizeGemma4Tiny(benchmark::State& st) { run(st, "gemma4-tiny/gemma4-tiny-f32.gguf", true); }

void BM_TokenizerLoadQwen3(benchmark::State& state) {
  auto f = fitmoe::gguf::File::open(testdata_dir() + "/tokenizers/qwen3-vocab.gguf");
  for (auto _ : state) benchmark::DoNotOptimize(fitmoe::Tokenizer::from_gguf(*f));
}

}  // namespace

BENCHMARK(BM_TokenizeQwen3)->Unit(benchmark::kMillisecond)->MinTime(1.0);
BENCHMARK(BM_TokenizeGemma3)->Unit(benchmark::kMillisecond)->MinTime(1.0);
BENCHMARK(BM_TokenizeGemma4Tiny)->Unit(benchmark::kMillisecond)->MinTime(1.0);
BENCHMARK(BM_TokenizerLoadQwen3)->Unit(benchmark::kMillisecond);
