// The command-line contract: exit codes and one-line errors on bad files, the logits file layout, and
// generate's last line. Runs the real fitmoe binary.
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <cstdio>
#include <fstream>
#include <sstream>

#include "format/gguf.h"
#include "cli_util.h"
#include "reference_check.h"

using namespace fitmoe;

namespace {

using fitmoe::test::RunResult;
using fitmoe::test::run_fitmoe;

std::string tmp(const std::string& name) { return fitmoe::test::temp_path("fitmoe_cli", name); }

std::string last_line(const std::string& s) {
  std::string t = s;
  while (!t.empty() && t.back() == '\n') t.pop_back();
  size_t p = t.rfind('\n');
  return p == std::string::npos ? t : t.substr(p + 1);
}

int count_lines(const std::string& s) { return static_cast<int>(std::count(s.begin(), s.end(), '\n')); }

void expect_bad_file(const std::string& path, const std::string& fragment) {
  for (const char* cmd : {"info", "generate", "logits", "run", "bench"}) {
    std::string extra = std::string(cmd) == "info" ? "" : std::string(cmd) == "bench" ? " -p 4 -n 2 -r 1" : " --tokens 1,2 -n 2";
    if (std::string(cmd) == "logits") extra = " --tokens 1,2 -o " + tmp("never.f32");
    auto r = run_fitmoe(std::string(cmd) + " -m " + path + extra);
    EXPECT_EQ(r.code, 1) << cmd << ": " << r.err;
    EXPECT_EQ(count_lines(r.err), 1) << cmd << ": " << r.err;
    EXPECT_NE(r.err.find(fragment), std::string::npos) << cmd << ": " << r.err;
    std::ifstream never(tmp("never.f32"));
    EXPECT_FALSE(never.good()) << "a failed command wrote its output file";
  }
}

}  // namespace

TEST(Cli, TruncatedFile) {
  auto bytes = test::read_bytes(test::testdata("qwen3moe-tiny/qwen3moe-tiny-q4_k_m.gguf"));
  std::string p = tmp("trunc.gguf");
  std::ofstream(p, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()), bytes.size() / 2);
  expect_bad_file(p, "beyond the end of the file");
  std::remove(p.c_str());
}

TEST(Cli, BadMagic) {
  std::string p = tmp("magic.gguf");
  std::ofstream(p, std::ios::binary) << "GGML this is not a gguf file at all, just text";
  expect_bad_file(p, "bad magic");
  std::remove(p.c_str());
}

TEST(Cli, MissingFile) {
  auto r = run_fitmoe("info -m /nonexistent/model.gguf");
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find("cannot open"), std::string::npos) << r.err;
}

TEST(Cli, UnknownArchitectureAndBadShapes) {
  auto write = [](const std::string& arch, int64_t norm_width) {
    gguf::Writer w;
    w.set_string("general.architecture", arch);
    w.set_u32(arch + ".block_count", 1);
    w.set_u32(arch + ".embedding_length", 256);
    w.set_u32(arch + ".attention.head_count", 4);
    w.set_u32(arch + ".attention.head_count_kv", 2);
    w.set_u32(arch + ".feed_forward_length", 256);
    w.set_f32(arch + ".attention.layer_norm_rms_epsilon", 1e-6f);
    w.add_tensor("token_embd.weight", DType::F32, {256, 32});
    w.add_tensor("output_norm.weight", DType::F32, {256});
    w.add_tensor("blk.0.attn_norm.weight", DType::F32, {norm_width});
    std::string p = tmp(arch + ".gguf");
    w.write(p, [](size_t, uint64_t, uint8_t* b, size_t n) { std::memset(b, 0, n); });
    return p;
  };
  std::string p = write("llamafoo", 256);
  expect_bad_file(p, "unknown or unsupported architecture 'llamafoo'");
  std::remove(p.c_str());
  p = write("qwen3", 200);
  expect_bad_file(p, "tensor blk.0.attn_norm.weight has shape [200]");
  std::remove(p.c_str());
}

TEST(Cli, BadTokenListIsAnError) {
  auto r = run_fitmoe("generate -m " + test::testdata("qwen3moe-tiny/qwen3moe-tiny-f32.gguf") + " --tokens 1,x,3");
  EXPECT_EQ(r.code, 1);
  auto r2 = run_fitmoe("generate -m " + test::testdata("qwen3moe-tiny/qwen3moe-tiny-f32.gguf") + " --tokens 1,99999");
  EXPECT_EQ(r2.code, 1);
  EXPECT_NE(r2.err.find("outside the vocabulary"), std::string::npos) << r2.err;
}

TEST(Cli, LogitsFileLayoutAndGenerateLastLine) {
  const std::string dir = test::testdata("qwen3moe-tiny");
  auto manifest = test::read_json(dir + "/manifest.json");
  auto prompt = manifest["prompts"]["p7"]["ids"].get<std::vector<int32_t>>();
  std::string ids;
  for (size_t i = 0; i < prompt.size(); ++i) ids += (i ? "," : "") + std::to_string(prompt[i]);
  std::string out = tmp("logits.f32");
  auto r = run_fitmoe("logits -m " + dir + "/qwen3moe-tiny-f32.gguf --tokens " + ids + " -o " + out);
  ASSERT_EQ(r.code, 0) << r.err;
  auto mine = test::read_f32(out);
  auto ref = test::read_f32(dir + "/ref/f32/logits-p7.f32");
  ASSERT_EQ(mine.size(), ref.size());
  for (size_t row = 0; row < prompt.size(); ++row)
    EXPECT_LT(test::rel_l2(mine.data() + row * 1024, ref.data() + row * 1024, 1024), 1e-3);
  std::remove(out.c_str());

  auto g = test::read_json(dir + "/ref/f32/greedy-p7.json");
  auto want = g["tokens"].get<std::vector<int32_t>>();
  auto r2 = run_fitmoe("generate -m " + dir + "/qwen3moe-tiny-f32.gguf --tokens " + ids + " -n 8 --temp 0");
  ASSERT_EQ(r2.code, 0) << r2.err;
  std::string expect;
  for (int i = 0; i < 8; ++i) expect += (i ? "," : "") + std::to_string(want[i]);
  EXPECT_EQ(last_line(r2.out), expect);
}

TEST(Cli, GenModelWritesALoadableModel) {
  std::string p = tmp("gen.gguf");
  auto r = run_fitmoe("gen-model --arch qwen3moe --preset tiny --type q4_k_m --router-skew -o " + p);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("experts receive about"), std::string::npos) << r.out;
  auto info = run_fitmoe("info -m " + p);
  ASSERT_EQ(info.code, 0) << info.err;
  EXPECT_NE(info.out.find("supported:     yes"), std::string::npos) << info.out;
  EXPECT_NE(info.out.find("q6_k"), std::string::npos) << info.out;  // the _M mix's more-bits tensors
  auto g = run_fitmoe("generate -m " + p + " --tokens 1,2,3 -n 4");
  ASSERT_EQ(g.code, 0) << g.err;
  const std::string ids = last_line(g.out);
  EXPECT_EQ(std::count(ids.begin(), ids.end(), ','), 3) << ids;
  auto b = run_fitmoe("bench -m " + p + " -p 8 -n 4 -r 2 --json");
  ASSERT_EQ(b.code, 0) << b.err;
  auto j = nlohmann::json::parse(b.out);
  ASSERT_EQ(j.size(), 2u);
  EXPECT_GT(j[1]["avg_ts"].get<double>(), 0);
  // Generation is reported against its bound: bytes per token over the measured host bandwidth.
  EXPECT_GT(j[1]["tg_bound"].get<double>(), 0);
  auto t = run_fitmoe("bench -m " + p + " -p 0 -n 2 -r 1");
  ASSERT_EQ(t.code, 0) << t.err;
  EXPECT_NE(t.out.find("bound t/s (reached)"), std::string::npos) << t.out;
  EXPECT_NE(t.out.find("%)"), std::string::npos) << t.out;
  std::remove(p.c_str());
}
