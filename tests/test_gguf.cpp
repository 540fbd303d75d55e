// GGUF reader and writer: round trips, every metadata type, and corrupt or truncated files that must
// give a clear Error (never a crash), plus the CLI's exit code on them.
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <random>

#include "format/gguf.h"
#include "runtime/error.h"
#include "testdata.h"

using namespace fitmoe;

namespace {

std::string tmp_path(const std::string& name) {
  return ::testing::TempDir() + "/fitmoe_" + std::to_string(::getpid()) + "_" + name;
}

// A small valid file with every value type and two tensors.
std::string write_sample(const std::string& name) {
  gguf::Writer w;
  w.set_string("general.architecture", "test");
  w.set_u32("a.u32", 7);
  w.set_i32("a.i32", -3);
  w.set_u64("a.u64", 1ull << 40);
  w.set_f32("a.f32", 0.5f);
  w.set_bool("a.bool", true);
  w.set_i32_array("a.arr_i32", {1, -2, 3});
  w.set_f32_array("a.arr_f32", {1.5f, 2.5f});
  w.set_bool_array("a.arr_bool", {true, false});
  w.set_string_array("a.arr_str", {"x", "", "hello"});
  w.add_tensor("t.f32", DType::F32, {4, 3});
  w.add_tensor("t.q8", DType::Q8_0, {64, 2});
  std::string p = tmp_path(name);
  w.write(p, [](size_t ti, uint64_t off, uint8_t* buf, size_t len) {
    for (size_t i = 0; i < len; ++i) buf[i] = static_cast<uint8_t>(ti * 31 + off + i);
  });
  return p;
}

std::vector<uint8_t> slurp(const std::string& p) { return test::read_bytes(p); }

void expect_parse_error(const std::vector<uint8_t>& bytes, const std::string& fragment) {
  try {
    gguf::File::parse(bytes.data(), bytes.size(), "mem");
    FAIL() << "expected an error containing '" << fragment << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
  }
}

}  // namespace

TEST(Gguf, RoundTripEveryValueType) {
  auto p = write_sample("rt.gguf");
  auto f = gguf::File::open(p);
  EXPECT_EQ(f->version(), 3u);
  EXPECT_EQ(f->get_string("general.architecture"), "test");
  EXPECT_EQ(f->get_uint("a.u32"), 7u);
  EXPECT_EQ(f->find("a.i32")->i, -3);
  EXPECT_EQ(f->get_uint("a.u64"), 1ull << 40);
  EXPECT_FLOAT_EQ(f->get_float("a.f32"), 0.5f);
  EXPECT_TRUE(f->get_bool("a.bool"));
  EXPECT_EQ(f->get_int_array("a.arr_i32"), (std::vector<int64_t>{1, -2, 3}));
  EXPECT_EQ(f->get_float_array("a.arr_f32"), (std::vector<float>{1.5f, 2.5f}));
  EXPECT_EQ(f->get_int_array("a.arr_bool"), (std::vector<int64_t>{1, 0}));
  auto& s = f->get_string_array("a.arr_str");
  ASSERT_EQ(s.size(), 3u);
  EXPECT_EQ(s[2], "hello");
  EXPECT_EQ(s[1], "");
  ASSERT_EQ(f->tensors().size(), 2u);
  const auto* t = f->find_tensor("t.q8");
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->ne[0], 64);
  EXPECT_EQ(t->ne[1], 2);
  EXPECT_EQ(t->nbytes, 2u * 2 * 34);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(t->data) % 32, 0u);
  for (size_t i = 0; i < t->nbytes; ++i) ASSERT_EQ(t->data[i], static_cast<uint8_t>(31 + i));
  EXPECT_THROW(f->get_uint("missing.key"), Error);
  EXPECT_THROW(f->get_uint("general.architecture"), Error);  // wrong type
  std::remove(p.c_str());
}

TEST(Gguf, ReadsEveryTestdataModel) {
  for (const char* rel : {"qwen3moe-tiny/qwen3moe-tiny-q4_k_m.gguf", "qwen3moe-tiny/qwen3moe-tiny-iq4_xs.gguf",
                          "qwen3-draft/qwen3-draft-q8_0.gguf", "gemma4-tiny/gemma4-tiny-q4_k_m.gguf",
                          "qwen35moe-tiny/qwen35moe-tiny-q4_k_m.gguf", "tokenizers/qwen3-vocab.gguf"}) {
    auto f = gguf::File::open(test::testdata(rel));
    EXPECT_FALSE(f->get_string("general.architecture").empty()) << rel;
  }
  auto f = gguf::File::open(test::testdata("qwen3moe-tiny/qwen3moe-tiny-f32.gguf"));
  EXPECT_EQ(f->get_uint("qwen3moe.expert_count"), 4u);
  EXPECT_EQ(f->get_string_array("tokenizer.ggml.tokens").size(), 1024u);
  EXPECT_EQ(f->find_tensor("blk.0.ffn_gate_exps.weight")->ne[2], 4);
}

TEST(Gguf, BadMagicAndVersion) {
  auto bytes = slurp(write_sample("m.gguf"));
  auto b = bytes;
  b[0] = 'X';
  expect_parse_error(b, "bad magic");
  b = bytes;
  b[4] = 9;
  expect_parse_error(b, "unsupported version 9");
}

TEST(Gguf, EveryTruncationIsAnErrorNotACrash) {
  auto bytes = slurp(write_sample("tr.gguf"));
  // Every prefix that cuts into the header or a tensor's bytes must fail cleanly. (Only the padding
  // after the last tensor may be cut without harm.)
  auto whole = gguf::File::parse(bytes.data(), bytes.size(), "mem");
  size_t end = 0;
  for (auto& t : whole->tensors()) end = std::max<size_t>(end, whole->data_offset() + t.offset + t.nbytes);
  ASSERT_GT(end, 100u);
  for (size_t n = 0; n < end; ++n) {
    std::vector<uint8_t> b(bytes.begin(), bytes.begin() + n);
    EXPECT_THROW(gguf::File::parse(b.data(), b.size(), "mem"), Error) << "prefix " << n;
  }
}

TEST(Gguf, RandomCorruptionNeverCrashes) {
  auto bytes = slurp(write_sample("fz.gguf"));
  std::mt19937 rng(static_cast<unsigned>(::testing::UnitTest::GetInstance()->random_seed()));
  int errors = 0;
  for (int it = 0; it < 3000; ++it) {
    auto b = bytes;
    int flips = 1 + rng() % 4;
    for (int k = 0; k < flips; ++k) b[rng() % b.size()] = static_cast<uint8_t>(rng());
    try {
      auto f = gguf::File::parse(b.data(), b.size(), "mem");
      for (auto& t : f->tensors()) ASSERT_LE(t.data + t.nbytes, b.data() + b.size());
    } catch (const Error&) {
      ++errors;
    }
  }
  EXPECT_GT(errors, 0);
}

TEST(Gguf, OutOfRangeFieldsNameTheProblem) {
  gguf::Writer w;
  w.set_string("general.architecture", "test");
  w.add_tensor("weights", DType::F32, {8, 8});
  std::string p = tmp_path("oor.gguf");
  w.write(p, [](size_t, uint64_t, uint8_t* buf, size_t len) { std::memset(buf, 0, len); });
  auto bytes = slurp(p);
  std::remove(p.c_str());
  // Locate the tensor info: name "weights" then n_dims, ne[2], type, offset.
  std::string name = "weights";
  auto it = std::search(bytes.begin(), bytes.end(), name.begin(), name.end());
  ASSERT_NE(it, bytes.end());
  size_t pos = static_cast<size_t>(it - bytes.begin()) + name.size();
  size_t type_pos = pos + 4 + 16, off_pos = type_pos + 4;

  auto b = bytes;
  uint32_t bad_type = 77;
  std::memcpy(&b[type_pos], &bad_type, 4);
  expect_parse_error(b, "unknown or unsupported tensor type 77");

  b = bytes;
  uint64_t far = 1ull << 40;
  std::memcpy(&b[off_pos], &far, 8);
  expect_parse_error(b, "beyond the end of the file");

  b = bytes;
  uint64_t misaligned = 4;
  std::memcpy(&b[off_pos], &misaligned, 8);
  expect_parse_error(b, "not aligned");

  b = bytes;
  int64_t neg = -5;
  std::memcpy(&b[pos + 4], &neg, 8);
  expect_parse_error(b, "dimension 0 is -5");

  b = bytes;
  uint64_t huge_count = 1ull << 60;
  std::memcpy(&b[8], &huge_count, 8);  // tensor count
  expect_parse_error(b, "tensor count");
}

TEST(Gguf, WriterLeavesNoPartialFileOnFailure) {
  gguf::Writer w;
  w.add_tensor("t", DType::F32, {4});
  std::string p = tmp_path("fail.gguf");
  EXPECT_THROW(w.write(p, [](size_t, uint64_t, uint8_t*, size_t) { throw Error("boom"); }), Error);
  std::ifstream a(p), b(p + ".partial");
  EXPECT_FALSE(a.good());
  EXPECT_FALSE(b.good());
}
