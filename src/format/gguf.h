// GGUF v2/v3: a validating reader over mmap and a streaming writer.
//
// The reader checks everything before anyone uses it (magic, version, counts against the file size,
// string and array lengths, value types, tensor shapes, types, offsets, alignment, overlaps) and
// throws fitmoe::Error with one line naming the problem. After open() succeeds every tensor's bytes lie
// inside the mapping, so later code can index them without further checks.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "quant/dtype.h"

namespace fitmoe::gguf {

enum class ValueType : uint32_t {
  U8 = 0, I8 = 1, U16 = 2, I16 = 3, U32 = 4, I32 = 5, F32 = 6, BOOL = 7, STRING = 8, ARRAY = 9,
  U64 = 10, I64 = 11, F64 = 12,
};
const char* value_type_name(ValueType t);

// One metadata value. Strings point into the mapping; numeric arrays are decoded on request.
struct Value {
  ValueType type = ValueType::U8;
  // scalars
  uint64_t u = 0;    // unsigned integers and bool
  int64_t i = 0;     // signed integers (also set for unsigned ones that fit)
  double f = 0;      // floats (also set for every integer type)
  std::string_view str;
  // arrays
  ValueType elem_type = ValueType::U8;
  uint64_t count = 0;
  const uint8_t* raw = nullptr;              // numeric array payload (little-endian, unaligned)
  std::vector<std::string_view> strings;     // string array elements

  bool is_integer() const;
  bool is_float() const { return type == ValueType::F32 || type == ValueType::F64; }
  bool is_array() const { return type == ValueType::ARRAY; }
};

struct TensorInfo {
  std::string name;
  std::vector<int64_t> ne;   // ne[0] is the contiguous row length; always padded to 4 dims with 1s
  int n_dims = 0;
  DType type = DType::F32;
  uint64_t offset = 0;       // relative to the data section
  uint64_t nbytes = 0;
  const uint8_t* data = nullptr;  // inside the mapping

  int64_t n_elements() const { return ne[0] * ne[1] * ne[2] * ne[3]; }
  int64_t n_rows() const { return ne[1] * ne[2] * ne[3]; }
  size_t row_bytes() const { return fitmoe::row_bytes(type, ne[0]); }
  std::string shape_string() const;
};

class File {
 public:
  // Maps and validates the file; throws fitmoe::Error naming the problem. Read-only: the file is
  // never modified.
  static std::shared_ptr<File> open(const std::string& path);
  // Parses a buffer the caller keeps alive (the fuzzer uses this).
  static std::shared_ptr<File> parse(const uint8_t* data, size_t size, const std::string& label);
  ~File();
  File(const File&) = delete;
  File& operator=(const File&) = delete;

  const std::string& path() const { return path_; }
  uint32_t version() const { return version_; }
  size_t file_size() const { return size_; }
  size_t alignment() const { return alignment_; }
  size_t data_offset() const { return data_offset_; }
  const uint8_t* base() const { return base_; }

  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  const TensorInfo* find_tensor(std::string_view name) const;
  const std::vector<std::pair<std::string, Value>>& metadata() const { return kv_; }
  const Value* find(std::string_view key) const;

  // Typed getters. The plain forms throw Error("missing key X" / "key X has type T, expected ...").
  std::string_view get_string(std::string_view key) const;
  uint64_t get_uint(std::string_view key) const;  // any non-negative integer type
  double get_float(std::string_view key) const;   // any float or integer type
  bool get_bool(std::string_view key) const;
  std::optional<std::string_view> opt_string(std::string_view key) const;
  std::optional<uint64_t> opt_uint(std::string_view key) const;
  std::optional<double> opt_float(std::string_view key) const;
  std::optional<bool> opt_bool(std::string_view key) const;
  // Integer / float arrays (a scalar is returned as an array of one).
  std::vector<int64_t> get_int_array(std::string_view key) const;
  std::vector<float> get_float_array(std::string_view key) const;
  const std::vector<std::string_view>& get_string_array(std::string_view key) const;

  // Copies the tensor data section into anonymous memory (2 MiB aligned, transparent huge pages
  // advised) with pread, and points every tensor there. Weights then stream from memory the OS will not
  // page out behind our back, with fewer TLB misses than 4 KiB file pages, and the GPU backend can pin
  // it for fast uploads. progress(done, total) is called as the bytes arrive.
  void load_into_memory(const std::function<void(uint64_t, uint64_t)>& progress = nullptr);
  // The same into memory from a caller's allocator (the GPU engine passes cudaMallocHost: page-locked
  // from the start, which uploads faster than registering an existing range); free is called on destruction.
  void load_into_memory(const std::function<void(uint64_t, uint64_t)>& progress,
                        const std::function<void*(size_t)>& alloc, std::function<void(void*)> free);
  bool in_memory() const { return copy_ != nullptr; }
  // The host buffer holding the tensor data (the copy, or the mapping), for pinning.
  const uint8_t* data_begin() const { return copy_ ? copy_ : base_ + data_offset_; }
  size_t data_bytes() const { return size_ - data_offset_; }

 private:
  File() = default;
  void parse_all(const std::string& label);
  void fill_copy(const std::function<void(uint64_t, uint64_t)>& progress);

  std::string path_;
  int fd_ = -1;
  uint8_t* copy_ = nullptr;
  size_t copy_bytes_ = 0;
  std::function<void(void*)> copy_free_;  // set when copy_ came from a caller's allocator
  const uint8_t* base_ = nullptr;
  size_t size_ = 0;
  bool owns_mapping_ = false;
  uint32_t version_ = 0;
  size_t alignment_ = 32;
  size_t data_offset_ = 0;
  std::vector<std::pair<std::string, Value>> kv_;
  std::map<std::string, size_t, std::less<>> kv_index_;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, size_t, std::less<>> tensor_index_;
};

// Streams a GGUF v3 file: metadata and tensor infos first, then each tensor's bytes produced by a
// callback into a buffer, so multi-GB files are written without holding them in memory. Writes to
// PATH.partial and renames at the end, so a failed run never leaves a half file under the real name.
class Writer {
 public:
  explicit Writer(size_t alignment = 32) : alignment_(alignment) {}

  void set_u32(const std::string& key, uint32_t v);
  void set_i32(const std::string& key, int32_t v);
  void set_u64(const std::string& key, uint64_t v);
  void set_f32(const std::string& key, float v);
  void set_bool(const std::string& key, bool v);
  void set_string(const std::string& key, const std::string& v);
  void set_i32_array(const std::string& key, const std::vector<int32_t>& v);
  void set_f32_array(const std::string& key, const std::vector<float>& v);
  void set_bool_array(const std::string& key, const std::vector<bool>& v);
  void set_string_array(const std::string& key, const std::vector<std::string>& v);

  // ne as in GGUF (ne[0] = row length). Returns the tensor's index.
  size_t add_tensor(const std::string& name, DType type, std::vector<int64_t> ne);
  size_t n_tensors() const { return tensors_.size(); }
  uint64_t tensor_bytes(size_t i) const { return tensors_[i].nbytes; }
  uint64_t total_tensor_bytes() const;

  // fill(i, offset_in_tensor, buf, len) writes bytes [offset, offset+len) of tensor i into buf.
  using FillFn = std::function<void(size_t tensor, uint64_t offset, uint8_t* buf, size_t len)>;
  using ProgressFn = std::function<void(uint64_t done, uint64_t total)>;
  void write(const std::string& path, const FillFn& fill, const ProgressFn& progress = nullptr,
             size_t chunk_bytes = 64u << 20) const;

 private:
  struct KV { std::string key; std::vector<uint8_t> bytes; };  // value type + payload, serialised
  struct T { std::string name; DType type; std::vector<int64_t> ne; uint64_t nbytes; uint64_t offset; };
  void put(const std::string& key, std::vector<uint8_t> bytes);
  size_t alignment_;
  std::vector<KV> kv_;
  std::vector<T> tensors_;
  uint64_t next_offset_ = 0;
};

}  // namespace fitmoe::gguf
