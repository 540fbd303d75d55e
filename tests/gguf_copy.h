// A copy of a GGUF with metadata added or replaced (tensors copied byte for byte), for tests of how
// metadata is read: the fixtures stay read-only and each test writes its variant to a temp dir.
#pragma once
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "format/gguf.h"

namespace fitmoe::test {

struct Kv {
  std::string key, type;  // type: "s" string, "f" f32, "u" u32, "ab" bool array
  std::string s;
  double v = 0;
  std::vector<bool> bools = {};
};

// A copy of a GGUF with `extra` metadata set (or replaced); the tensors are copied byte for byte.
inline void write_with(const std::string& src, const std::string& dst, const std::vector<Kv>& extra) {
  auto f = gguf::File::open(src);
  gguf::Writer w(f->alignment());
  auto overridden = [&](const std::string& k) {
    for (const Kv& e : extra)
      if (e.key == k) return true;
    return false;
  };
  using gguf::ValueType;
  for (const auto& [key, v] : f->metadata()) {
    if (overridden(key)) continue;
    switch (v.type) {
      case ValueType::U8: case ValueType::U16: case ValueType::U32: w.set_u32(key, static_cast<uint32_t>(v.u)); break;
      case ValueType::I8: case ValueType::I16: case ValueType::I32: w.set_i32(key, static_cast<int32_t>(v.i)); break;
      case ValueType::U64: w.set_u64(key, v.u); break;
      case ValueType::F32: case ValueType::F64: w.set_f32(key, static_cast<float>(v.f)); break;
      case ValueType::BOOL: w.set_bool(key, v.u != 0); break;
      case ValueType::STRING: w.set_string(key, std::string(v.str)); break;
      case ValueType::ARRAY:
        if (v.elem_type == ValueType::STRING) {
          std::vector<std::string> a(v.strings.begin(), v.strings.end());
          w.set_string_array(key, a);
        } else if (v.elem_type == ValueType::F32) {
          w.set_f32_array(key, f->get_float_array(key));
        } else if (v.elem_type == ValueType::BOOL) {
          std::vector<bool> a(v.count);
          for (uint64_t i = 0; i < v.count; ++i) a[i] = v.raw[i] != 0;
          w.set_bool_array(key, a);
        } else {
          auto ints = f->get_int_array(key);
          w.set_i32_array(key, std::vector<int32_t>(ints.begin(), ints.end()));
        }
        break;
      default: throw std::runtime_error("write_with: unhandled metadata type of " + key);
    }
  }
  for (const Kv& e : extra) {
    if (e.type == "s") w.set_string(e.key, e.s);
    else if (e.type == "f") w.set_f32(e.key, static_cast<float>(e.v));
    else if (e.type == "ab") w.set_bool_array(e.key, e.bools);
    else w.set_u32(e.key, static_cast<uint32_t>(e.v));
  }
  for (const auto& t : f->tensors())
    w.add_tensor(t.name, t.type, std::vector<int64_t>(t.ne.begin(), t.ne.begin() + t.n_dims));
  const auto& ts = f->tensors();
  w.write(dst, [&](size_t i, uint64_t off, uint8_t* buf, size_t len) { std::memcpy(buf, ts[i].data + off, len); });
}

}  // namespace fitmoe::test
