// Everyday use of the CLI (issue 18): limits checked before work, named bad values, llama.cpp's flags,
// unknown commands, token lists as tokenize prints them, output paths. Runs the real fitmoe binary.
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "cli_util.h"
#include "reference_check.h"

namespace {

using fitmoe::test::RunResult;

std::string tmp(const std::string& name) { return fitmoe::test::temp_path("fitmoe_everyday", name); }

RunResult run(const std::string& args) {
  const std::string none;
  return fitmoe::test::run_fitmoe(args, &none);  // stdin empty: no command waits for a terminal
}

std::string model() { return fitmoe::test::testdata("qwen3moe-tiny/qwen3moe-tiny-q4_k_m.gguf"); }

bool has(const std::string& s, const std::string& frag) { return s.find(frag) != std::string::npos; }

}  // namespace

TEST(CliEveryday, HostMemoryIsCheckedBeforeAllocating) {
  auto r = run("run -m " + model() + " -p hi -c 1000000000 -n 2 --gpu none");
  EXPECT_EQ(r.code, 1) << r.err;
  EXPECT_TRUE(has(r.err, "not enough host memory")) << r.err;
  EXPECT_TRUE(has(r.err, "available")) << r.err;
  EXPECT_FALSE(has(r.err, "bad_alloc")) << r.err;
}

TEST(CliEveryday, NumericFlagsNameTheirBounds) {
  for (const char* bad : {"--top-p 2", "--repeat-penalty 0", "-c 0", "-n -1", "--temp -1", "--min-p 3", "-t -2"}) {
    auto r = run("run -m " + model() + " -p hi " + bad);
    EXPECT_EQ(r.code, 2) << bad << ": " << r.err;
    EXPECT_TRUE(has(r.err, "must be")) << bad << ": " << r.err;
    EXPECT_FALSE(has(r.err, "e+308")) << bad << ": " << r.err;
  }
}

TEST(CliEveryday, UnknownCommandGetsTheListAndASuggestion) {
  auto r = run("chatt");
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(has(r.err, "unknown command 'chatt'")) << r.err;
  EXPECT_TRUE(has(r.err, "did you mean 'chat'")) << r.err;
  EXPECT_TRUE(has(r.err, "generate")) << r.err;
  auto h = run("help run");
  EXPECT_EQ(h.code, 0);
  EXPECT_TRUE(has(h.out, "--n-predict")) << h.out;
}

TEST(CliEveryday, LlamaCppFlagsAreNotMisparsed) {
  auto r = run("generate -m " + model() + " --tokens 1,2 -n 2 -ngl 99 -fa -ub 64 --ctx-size 128");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(has(r.err, "-ngl 99")) << r.err;
}

TEST(CliEveryday, TokenListsAcceptTokenizesJsonArray) {
  auto a = run("generate -m " + model() + " --tokens \"[1, 2, 3]\" -n 3");
  auto b = run("generate -m " + model() + " --tokens 1,2,3 -n 3");
  EXPECT_EQ(a.code, 0) << a.err;
  EXPECT_EQ(a.out, b.out);
  EXPECT_EQ(run("generate -m " + model() + " --tokens 1,,2 -n 1").code, 1);
}

TEST(CliEveryday, InputCheckedBeforeTheWeightsLoad) {
  auto r = run("generate -m " + model() + " --tokens 999999 -n 2");
  EXPECT_EQ(r.code, 1);
  EXPECT_TRUE(has(r.err, "outside the vocabulary")) << r.err;
  auto p = run("generate -m " + model() + " --tokens 1,2,3,4,5,6,7,8,9,10 -c 4 -n 2");
  EXPECT_EQ(p.code, 1);
  EXPECT_TRUE(has(p.err, "the prompt is 10 tokens")) << p.err;
  EXPECT_TRUE(has(p.err, "context of 4")) << p.err;
}

TEST(CliEveryday, FullContextIsReported) {
  auto r = run("generate -m " + model() + " --tokens 1,2 -c 4 -n 30");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(has(r.err, "context of 4 tokens is full")) << r.err;
}

TEST(CliEveryday, NGeneratedTokensReportN) {
  auto r = run("run -m " + model() + " --tokens 1,2 -n 5 --temp 0");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(has(r.err, "generation: 5 tokens")) << r.err;
  auto z = run("run -m " + model() + " --tokens 1,2 -n 0");
  EXPECT_TRUE(has(z.err, "generation: 0 tokens")) << z.err;
}

TEST(CliEveryday, OutputsAndInputsNameTheProblem) {
  const std::string dir = ::testing::TempDir();
  auto r = run("logits -m " + model() + " --tokens 1,2 -o " + dir);
  EXPECT_EQ(r.code, 1);
  EXPECT_TRUE(has(r.err, "is a directory")) << r.err;
  std::string d = dir;
  while (!d.empty() && d.back() == '/') d.pop_back();
  std::ifstream partial(d + ".partial");
  EXPECT_FALSE(partial.good());
  auto f = run("run -m " + model() + " -f " + dir);
  EXPECT_EQ(f.code, 1);
  EXPECT_TRUE(has(f.err, "is a directory")) << f.err;
  auto t = run("tokenize -m " + model() + " --file " + dir);
  EXPECT_EQ(t.code, 1);
  EXPECT_TRUE(has(t.err, "is a directory")) << t.err;
  auto g = run("gen-model --router-skew abc -o " + tmp("x.gguf"));
  EXPECT_EQ(g.code, 2);
  EXPECT_TRUE(has(g.err, "not a number: 'abc'")) << g.err;
}

TEST(CliEveryday, RandomSeedIsPrintedAndRepeats) {
  auto r = run("run -m " + model() + " --tokens 1,2 -n 4 --temp 1");
  EXPECT_EQ(r.code, 0) << r.err;
  const size_t at = r.err.find("seed:");
  ASSERT_NE(at, std::string::npos) << r.err;
  const unsigned long long seed = std::stoull(r.err.substr(r.err.find_first_of("0123456789", at)));
  auto again = run("run -m " + model() + " --tokens 1,2 -n 4 --temp 1 --seed " + std::to_string(seed));
  EXPECT_EQ(again.out, r.out);
}

TEST(CliEveryday, PlanSaysWhereItsMachineProfileCameFromAndRemeasuresAnother) {
  // The profile is cached per machine; a cache written for another machine (another key) is not used.
  const std::string dir = tmp("cache");
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir + "/fitmoe");
  const char* old = std::getenv("XDG_CACHE_HOME");
  const std::string saved = old ? old : "";
  setenv("XDG_CACHE_HOME", dir.c_str(), 1);
  {
    std::ofstream f(dir + "/fitmoe/machine.json");
    f << R"({"v3|some other cpu|64 threads|avx2|1024 GiB|none": {"host_mem_bw": 1e15, "cpu_decode_bw": 1e15}})";
  }
  auto a = run("plan -m " + model() + " --gpu none");
  auto b = run("plan -m " + model() + " --gpu none");
  if (old) setenv("XDG_CACHE_HOME", saved.c_str(), 1); else unsetenv("XDG_CACHE_HOME");
  ASSERT_EQ(a.code, 0) << a.err;
  EXPECT_TRUE(has(a.out, "[measured now]")) << a.out;
  EXPECT_FALSE(has(a.out, "1000000 GB/s")) << a.out;  // the other machine's figures are not this one's
  EXPECT_TRUE(has(b.out, ", cached in " + dir + "/fitmoe/machine.json]")) << b.out;
  EXPECT_TRUE(has(b.out, "their kernels: decode ")) << b.out;
  std::ifstream f(dir + "/fitmoe/machine.json");
  std::stringstream all;
  all << f.rdbuf();
  EXPECT_TRUE(has(all.str(), "some other cpu")) << "the other machine's entry is kept";
}
