// `fitmoe bench` as llama-bench's users expect it: -o md|json|jsonl|csv with llama-bench's field names,
// -t lists (one row per thread count), the quantization type in the model column, range checks that
// name the flag. Runs the real fitmoe binary on the tiny test models, with tiny tests (-p 8 -n 4 -r 1).
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <regex>
#include <sstream>

#include <nlohmann/json.hpp>

#include "cli_util.h"
#include "testdata.h"

namespace {

using fitmoe::test::RunResult;
using fitmoe::test::run_fitmoe;
using fitmoe::test::slurp;

std::string tmp(const std::string& name) { return fitmoe::test::temp_path("fitmoe_bench", name); }

std::string slurp_binary(const std::string& p) {
  std::ifstream f(p, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}


std::vector<std::string> lines(const std::string& s) {
  std::vector<std::string> v;
  std::stringstream ss(s);
  for (std::string l; std::getline(ss, l);)
    if (!l.empty()) v.push_back(l);
  return v;
}

// The fields of a CSV line whose fields are all double-quoted (llama-bench's CSV); "" is a quote.
std::vector<std::string> csv_fields(const std::string& line) {
  std::vector<std::string> out;
  std::string cur;
  bool quoted = false;
  for (size_t i = 0; i < line.size(); ++i) {
    const char c = line[i];
    if (quoted) {
      if (c == '"' && i + 1 < line.size() && line[i + 1] == '"') cur += '"', ++i;
      else if (c == '"') quoted = false;
      else cur += c;
    } else if (c == '"') {
      quoted = true;
    } else if (c == ',') {
      out.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  out.push_back(cur);
  return out;
}

// A markdown table's cells as awk -F'|' numbers them ($2 is the first cell), which the device scripts use.
std::vector<std::string> md_cells(const std::string& line) {
  std::vector<std::string> out;
  std::stringstream ss(line);
  for (std::string c; std::getline(ss, c, '|');) {
    c.erase(0, c.find_first_not_of(' '));
    c.erase(c.find_last_not_of(' ') + 1);
    out.push_back(c);
  }
  return out;
}

std::string tiny(const std::string& type) { return fitmoe::test::testdata("qwen3moe-tiny/qwen3moe-tiny-" + type + ".gguf"); }

// llama-bench's fields with the JSON type each has there.
void expect_llama_bench_fields(const nlohmann::json& r, const std::string& model_path) {
  for (const char* k : {"build_commit", "cpu_info", "gpu_info", "backends", "model_filename", "model_type", "type_k",
                        "type_v", "test_time"})
    EXPECT_TRUE(r.contains(k) && r[k].is_string()) << k << " in " << r.dump();
  for (const char* k : {"build_number", "model_size", "model_n_params", "n_batch", "n_ubatch", "n_threads",
                        "n_gpu_layers", "n_prompt", "n_gen", "avg_ns", "stddev_ns"})
    EXPECT_TRUE(r.contains(k) && r[k].is_number_integer()) << k << " in " << r.dump();
  for (const char* k : {"avg_ts", "stddev_ts"}) EXPECT_TRUE(r.contains(k) && r[k].is_number()) << k;
  for (const char* k : {"samples_ns", "samples_ts"}) EXPECT_TRUE(r.contains(k) && r[k].is_array()) << k;
  if (::testing::Test::HasFailure()) return;
  EXPECT_EQ(r["model_filename"], model_path);
  EXPECT_EQ(r["type_k"], "f16");
  EXPECT_EQ(r["backends"], "CPU");
  EXPECT_GT(r["model_size"].get<uint64_t>(), 0u);
  EXPECT_GT(r["model_n_params"].get<uint64_t>(), 0u);
  EXPECT_GT(r["n_threads"].get<int>(), 0);
  EXPECT_GT(r["avg_ns"].get<uint64_t>(), 0u);
  EXPECT_GT(r["avg_ts"].get<double>(), 0);
  EXPECT_TRUE(std::regex_match(r["test_time"].get<std::string>(), std::regex(R"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ)")))
      << r["test_time"];
  for (auto& v : r["samples_ns"]) EXPECT_TRUE(v.is_number_integer());
  // fitmoe's own keys that scripts read (scripts/device-run.sh) stay.
  for (const char* k : {"test", "backend", "weight_bytes_per_token", "weight_gbps", "tg_bound", "plan", "machine"})
    EXPECT_TRUE(r.contains(k)) << k;
}

}  // namespace

TEST(BenchCli, JsonHasLlamaBenchFields) {
  const std::string m = tiny("q8_0");
  auto r = run_fitmoe("bench -m " + m + " -p 8 -n 4 -r 2 -o json");
  ASSERT_EQ(r.code, 0) << r.err;
  auto j = nlohmann::json::parse(r.out);
  ASSERT_TRUE(j.is_array());
  ASSERT_EQ(j.size(), 2u);
  for (auto& row : j) expect_llama_bench_fields(row, m);
  EXPECT_EQ(j[0]["n_prompt"], 8);
  EXPECT_EQ(j[0]["n_gen"], 0);
  EXPECT_EQ(j[0]["test"], "pp8");
  // tgN is N generated tokens: N decode steps, each sample's rate is N over its time.
  EXPECT_EQ(j[1]["n_prompt"], 0);
  EXPECT_EQ(j[1]["n_gen"], 4);
  EXPECT_EQ(j[1]["test"], "tg4");
  ASSERT_EQ(j[1]["samples_ns"].size(), 2u);
  ASSERT_EQ(j[1]["samples_ts"].size(), 2u);
  for (int i = 0; i < 2; ++i)
    EXPECT_NEAR(j[1]["samples_ts"][i].get<double>() * j[1]["samples_ns"][i].get<double>() / 1e9, 4.0, 1e-6);
  EXPECT_GT(j[1]["tg_bound"].get<double>(), 0);
}

TEST(BenchCli, JsonFlagIsAnAliasOfOutputJson) {
  auto a = run_fitmoe("bench -m " + tiny("q8_0") + " -p 8 -n 0 -r 1 --json");
  ASSERT_EQ(a.code, 0) << a.err;
  auto b = run_fitmoe("bench -m " + tiny("q8_0") + " -p 8 -n 0 -r 1 -o json");
  ASSERT_EQ(b.code, 0) << b.err;
  auto ja = nlohmann::json::parse(a.out), jb = nlohmann::json::parse(b.out);
  ASSERT_EQ(ja.size(), 1u);
  ASSERT_EQ(jb.size(), 1u);
  std::vector<std::string> ka, kb;
  for (auto& [k, v] : ja[0].items()) ka.push_back(k);
  for (auto& [k, v] : jb[0].items()) kb.push_back(k);
  EXPECT_EQ(ka, kb);
  EXPECT_TRUE(ja[0].contains("model_type"));
  // --json together with another format is a contradiction, said as such.
  auto c = run_fitmoe("bench -m " + tiny("q8_0") + " -p 8 -n 0 -r 1 --json -o csv");
  EXPECT_EQ(c.code, 2) << c.err;
  EXPECT_NE(c.err.find("--json"), std::string::npos) << c.err;
}

TEST(BenchCli, JsonlIsOneObjectPerLine) {
  auto r = run_fitmoe("bench -m " + tiny("q8_0") + " -p 8 -n 4 -r 1 -o jsonl");
  ASSERT_EQ(r.code, 0) << r.err;
  auto ls = lines(r.out);
  ASSERT_EQ(ls.size(), 2u) << r.out;
  for (auto& l : ls) {
    auto o = nlohmann::json::parse(l);
    ASSERT_TRUE(o.is_object()) << l;
    expect_llama_bench_fields(o, tiny("q8_0"));
  }
  EXPECT_EQ(nlohmann::json::parse(ls[1])["test"], "tg4");
}

TEST(BenchCli, CsvIsAHeaderAndARowPerResult) {
  auto r = run_fitmoe("bench -m " + tiny("q8_0") + " -p 8 -n 4 -r 1 -o csv");
  ASSERT_EQ(r.code, 0) << r.err;
  auto ls = lines(r.out);
  ASSERT_EQ(ls.size(), 3u) << r.out;
  const auto head = csv_fields(ls[0]);
  auto col = [&](const std::string& name) {
    return static_cast<size_t>(std::find(head.begin(), head.end(), name) - head.begin());
  };
  for (const char* k : {"build_commit", "model_type", "model_size", "n_threads", "n_prompt", "n_gen", "test_time",
                        "avg_ns", "stddev_ns", "avg_ts", "stddev_ts", "tg_bound", "machine_host_mem_bw"})
    EXPECT_LT(col(k), head.size()) << k << " missing from " << ls[0];
  EXPECT_EQ(col("samples_ns"), head.size()) << "arrays stay out of the CSV, as llama-bench's";
  for (size_t i = 1; i < ls.size(); ++i) {
    const auto f = csv_fields(ls[i]);
    ASSERT_EQ(f.size(), head.size()) << ls[i];
    EXPECT_EQ(ls[i].front(), '"');
  }
  EXPECT_EQ(csv_fields(ls[1])[col("n_prompt")], "8");
  EXPECT_EQ(csv_fields(ls[2])[col("n_gen")], "4");
  EXPECT_GT(std::stod(csv_fields(ls[2])[col("avg_ts")]), 0);
}

TEST(BenchCli, ThreadListGivesARowPerCount) {
  auto r = run_fitmoe("bench -m " + tiny("q8_0") + " -t 1,2 -p 8 -n 4 -r 1 -o json");
  ASSERT_EQ(r.code, 0) << r.err;
  auto j = nlohmann::json::parse(r.out);
  ASSERT_EQ(j.size(), 4u);
  // As llama-bench: every test at the first count, then at the next.
  EXPECT_EQ(j[0]["n_threads"], 1);
  EXPECT_EQ(j[1]["n_threads"], 1);
  EXPECT_EQ(j[2]["n_threads"], 2);
  EXPECT_EQ(j[3]["n_threads"], 2);
  EXPECT_EQ(j[2]["test"], "pp8");
  EXPECT_EQ(j[3]["test"], "tg4");
  auto md = run_fitmoe("bench -m " + tiny("q8_0") + " -t 1,2 -p 0 -n 4 -r 1");
  ASSERT_EQ(md.code, 0) << md.err;
  std::vector<std::string> threads;
  for (auto& l : lines(md.out))
    if (l.find("| tg4 |") != std::string::npos) threads.push_back(md_cells(l).at(5));
  EXPECT_EQ(threads, (std::vector<std::string>{"1", "2"})) << md.out;
}

TEST(BenchCli, ModelColumnShowsTheQuantType) {
  // No general.file_type in the reference's quantized tiny files: the type holding most bytes.
  auto q = run_fitmoe("bench -m " + tiny("q8_0") + " -p 0 -n 2 -r 1");
  ASSERT_EQ(q.code, 0) << q.err;
  auto ls = lines(q.out);
  ASSERT_EQ(ls.size(), 3u) << q.out;
  const auto head = md_cells(ls[0]), row = md_cells(ls[2]);
  EXPECT_EQ(head.at(1), "model");
  EXPECT_NE(row.at(1).find("qwen3moe"), std::string::npos) << ls[2];
  EXPECT_NE(row.at(1).find("Q8_0"), std::string::npos) << ls[2];
  // The device scripts read awk's $7 (test), $8 (t/s) and $11 (the bound).
  EXPECT_EQ(head.at(6), "test");
  EXPECT_EQ(head.at(7), "t/s");
  EXPECT_EQ(head.at(10), "bound t/s (reached)");
  EXPECT_EQ(row.at(6), "tg2");
  // Without general.file_type (here renamed to a key of the same length, so the file stays valid): the
  // type holding most of the bytes, said to be that.
  const std::string nf = tmp("no_ftype.gguf");
  {
    std::string bytes = slurp_binary(tiny("q8_0"));
    const size_t at = bytes.find("general.file_type");
    ASSERT_NE(at, std::string::npos);
    bytes[at + 16] = 'X';
    std::ofstream(nf, std::ios::binary) << bytes;
  }
  auto d = run_fitmoe("bench -m " + nf + " -p 0 -n 2 -r 1 -o json");
  std::remove(nf.c_str());
  ASSERT_EQ(d.code, 0) << d.err;
  EXPECT_EQ(nlohmann::json::parse(d.out)[0]["quant_type"], "Q8_0 (most bytes)") << d.out;
  // general.file_type named as the reference names it.
  auto f = run_fitmoe("bench -m " + tiny("f32") + " -p 0 -n 2 -r 1 -o json");
  ASSERT_EQ(f.code, 0) << f.err;
  auto jf = nlohmann::json::parse(f.out);
  EXPECT_NE(jf[0]["model_type"].get<std::string>().find("all F32"), std::string::npos) << jf[0]["model_type"];
  const std::string p = tmp("q4km.gguf");
  auto g = run_fitmoe("gen-model --arch qwen3moe --preset tiny --type q4_k_m -o " + p);
  ASSERT_EQ(g.code, 0) << g.err;
  auto k = run_fitmoe("bench -m " + p + " -p 0 -n 2 -r 1 -o json");
  std::remove(p.c_str());
  ASSERT_EQ(k.code, 0) << k.err;
  auto jk = nlohmann::json::parse(k.out);
  EXPECT_NE(jk[0]["model_type"].get<std::string>().find("Q4_K - Medium"), std::string::npos) << jk[0]["model_type"];
  EXPECT_EQ(jk[0]["quant_type"], "Q4_K - Medium");
}

TEST(BenchCli, BadValuesNameTheFlag) {
  const std::string m = " -m " + tiny("q8_0");
  // The flag, the bound and the value in the message; exit code 2 (usage).
  const std::pair<const char*, const char*> cases[] = {
      {"-r 0", "-r must be at least 1 (got 0)"},
      {"-r -2", "-r must be at least 1 (got -2)"},
      {"-p -1", "-p values must be at least 0 (got -1"},
      {"-p 8,-4", "-p values must be at least 0 (got -4"},
      {"-n -3", "-n values must be at least 0 (got -3"},
      {"-t 0", "-t values must be at least 1 (got 0)"},
      {"-t 1,-2", "-t values must be at least 1 (got -2)"},
      {"-b 0", "-b must be at least 1 (got 0)"},
      {"-o xml", "-o must be md, json, jsonl or csv (got 'xml')"},
      {"-p 0 -n 0", "nothing to measure"},
      {"-p 99999999", "-p values must be at most"},
  };
  for (auto& [args, want] : cases) {
    // Every one is refused before the model loads, so no test runs.
    auto r = run_fitmoe(std::string("bench") + m + " " + args);
    EXPECT_EQ(r.code, 2) << args << ": " << r.err;
    EXPECT_NE(r.err.find(want), std::string::npos) << args << ": " << r.err;
    EXPECT_TRUE(r.out.empty()) << args << ": " << r.out;
  }
}
