// Locating ../shared/testdata (the reference fixtures) and reading its raw files.
#pragma once
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace fitmoe::test {

// FITMOE_TESTDATA overrides the default (../shared/testdata beside the checkout). A missing folder is a
// failure, not a skip: tests that silently skip would let CI pass without checking anything.
inline std::string testdata_dir() {
  const char* env = std::getenv("FITMOE_TESTDATA");
  return env && *env ? std::string(env) : std::string(FITMOE_DEFAULT_TESTDATA);
}
inline std::string testdata(const std::string& rel) { return testdata_dir() + "/" + rel; }

inline std::vector<uint8_t> read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("cannot open test file " + path);
  return std::vector<uint8_t>((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}
inline std::vector<float> read_f32(const std::string& path) {
  auto b = read_bytes(path);
  std::vector<float> v(b.size() / 4);
  std::memcpy(v.data(), b.data(), v.size() * 4);
  return v;
}
inline nlohmann::json read_json(const std::string& path) {
  std::ifstream f(path);
  if (!f) throw std::runtime_error("cannot open test file " + path);
  return nlohmann::json::parse(f);
}

}  // namespace fitmoe::test
