// Streaming GGUF v3 writer (used by gen-model and by tests that build small or deliberately broken files).
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <vector>

#include "format/gguf.h"
#include "runtime/error.h"

namespace fitmoe::gguf {

namespace {

void append(std::vector<uint8_t>& b, const void* p, size_t n) {
  // (resize + memcpy rather than insert: GCC 12 warns falsely about insert into an empty vector)
  const size_t at = b.size();
  b.resize(at + n);
  if (n) std::memcpy(b.data() + at, p, n);
}
template <typename T>
void append_pod(std::vector<uint8_t>& b, T v) { append(b, &v, sizeof v); }
void append_string(std::vector<uint8_t>& b, const std::string& s) {
  append_pod<uint64_t>(b, s.size());
  append(b, s.data(), s.size());
}
std::vector<uint8_t> typed(ValueType t) {
  std::vector<uint8_t> b;
  append_pod<uint32_t>(b, static_cast<uint32_t>(t));
  return b;
}

// Writes all of buf or throws; the file is the .partial one, removed by the caller on failure.
void write_all(int fd, const uint8_t* p, size_t n, const std::string& path) {
  while (n > 0) {
    ssize_t w = ::write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      throw Error(path + ": write failed: " + std::strerror(errno));
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
}

}  // namespace

void Writer::put(const std::string& key, std::vector<uint8_t> bytes) {
  for (auto& kv : kv_) {
    if (kv.key == key) {
      kv.bytes = std::move(bytes);
      return;
    }
  }
  kv_.push_back({key, std::move(bytes)});
}

void Writer::set_u32(const std::string& k, uint32_t v) { auto b = typed(ValueType::U32); append_pod(b, v); put(k, b); }
void Writer::set_i32(const std::string& k, int32_t v) { auto b = typed(ValueType::I32); append_pod(b, v); put(k, b); }
void Writer::set_u64(const std::string& k, uint64_t v) { auto b = typed(ValueType::U64); append_pod(b, v); put(k, b); }
void Writer::set_f32(const std::string& k, float v) { auto b = typed(ValueType::F32); append_pod(b, v); put(k, b); }
void Writer::set_bool(const std::string& k, bool v) { auto b = typed(ValueType::BOOL); append_pod<uint8_t>(b, v); put(k, b); }
void Writer::set_string(const std::string& k, const std::string& v) {
  auto b = typed(ValueType::STRING);
  append_string(b, v);
  put(k, b);
}
void Writer::set_i32_array(const std::string& k, const std::vector<int32_t>& v) {
  auto b = typed(ValueType::ARRAY);
  append_pod<uint32_t>(b, static_cast<uint32_t>(ValueType::I32));
  append_pod<uint64_t>(b, v.size());
  for (int32_t x : v) append_pod(b, x);
  put(k, b);
}
void Writer::set_f32_array(const std::string& k, const std::vector<float>& v) {
  auto b = typed(ValueType::ARRAY);
  append_pod<uint32_t>(b, static_cast<uint32_t>(ValueType::F32));
  append_pod<uint64_t>(b, v.size());
  for (float x : v) append_pod(b, x);
  put(k, b);
}
void Writer::set_bool_array(const std::string& k, const std::vector<bool>& v) {
  auto b = typed(ValueType::ARRAY);
  append_pod<uint32_t>(b, static_cast<uint32_t>(ValueType::BOOL));
  append_pod<uint64_t>(b, v.size());
  for (bool x : v) append_pod<uint8_t>(b, x);
  put(k, b);
}
void Writer::set_string_array(const std::string& k, const std::vector<std::string>& v) {
  auto b = typed(ValueType::ARRAY);
  append_pod<uint32_t>(b, static_cast<uint32_t>(ValueType::STRING));
  append_pod<uint64_t>(b, v.size());
  for (auto& s : v) append_string(b, s);
  put(k, b);
}

size_t Writer::add_tensor(const std::string& name, DType type, std::vector<int64_t> ne) {
  const DTypeInfo& ti = dtype_info(type);
  if (ne.empty() || ne.size() > 4 || ne[0] % ti.block_size != 0)
    throw Error("gguf writer: bad shape for tensor " + name);
  uint64_t rows = 1;
  for (size_t d = 1; d < ne.size(); ++d) rows *= static_cast<uint64_t>(ne[d]);
  uint64_t nbytes = row_bytes(type, ne[0]) * rows;
  tensors_.push_back({name, type, std::move(ne), nbytes, next_offset_});
  next_offset_ += (nbytes + alignment_ - 1) / alignment_ * alignment_;
  return tensors_.size() - 1;
}

uint64_t Writer::total_tensor_bytes() const { return next_offset_; }

void Writer::write(const std::string& path, const FillFn& fill, const ProgressFn& progress,
                   size_t chunk_bytes) const {
  std::vector<uint8_t> head;
  head.insert(head.end(), {'G', 'G', 'U', 'F'});
  append_pod<uint32_t>(head, 3);
  append_pod<uint64_t>(head, tensors_.size());
  bool has_alignment = false;
  for (auto& kv : kv_) has_alignment |= kv.key == "general.alignment";
  append_pod<uint64_t>(head, kv_.size() + (alignment_ != 32 && !has_alignment ? 1 : 0));
  for (auto& kv : kv_) {
    append_string(head, kv.key);
    append(head, kv.bytes.data(), kv.bytes.size());
  }
  if (alignment_ != 32 && !has_alignment) {
    append_string(head, "general.alignment");
    append_pod<uint32_t>(head, static_cast<uint32_t>(ValueType::U32));
    append_pod<uint32_t>(head, static_cast<uint32_t>(alignment_));
  }
  for (auto& t : tensors_) {
    append_string(head, t.name);
    append_pod<uint32_t>(head, static_cast<uint32_t>(t.ne.size()));
    for (int64_t n : t.ne) append_pod<int64_t>(head, n);
    append_pod<uint32_t>(head, static_cast<uint32_t>(t.type));
    append_pod<uint64_t>(head, t.offset);
  }
  head.resize((head.size() + alignment_ - 1) / alignment_ * alignment_, 0);

  std::string tmp = path + ".partial";
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw Error(tmp + ": cannot create: " + std::strerror(errno));
  try {
    write_all(fd, head.data(), head.size(), tmp);
    std::vector<uint8_t> buf(chunk_bytes);
    uint64_t total = total_tensor_bytes(), done = 0;
    for (size_t i = 0; i < tensors_.size(); ++i) {
      const T& t = tensors_[i];
      uint64_t padded = (t.nbytes + alignment_ - 1) / alignment_ * alignment_;
      for (uint64_t off = 0; off < padded; off += chunk_bytes) {
        size_t len = static_cast<size_t>(std::min<uint64_t>(chunk_bytes, padded - off));
        size_t data_len = off < t.nbytes ? static_cast<size_t>(std::min<uint64_t>(len, t.nbytes - off)) : 0;
        if (data_len) fill(i, off, buf.data(), data_len);
        std::memset(buf.data() + data_len, 0, len - data_len);
        write_all(fd, buf.data(), len, tmp);
        done += len;
        if (progress) progress(done, total);
      }
    }
    if (::close(fd) != 0) {
      fd = -1;
      throw Error(tmp + ": close failed: " + std::strerror(errno));
    }
    fd = -1;
    if (std::rename(tmp.c_str(), path.c_str()) != 0) throw Error(path + ": rename failed: " + std::strerror(errno));
  } catch (...) {
    if (fd >= 0) ::close(fd);
    std::remove(tmp.c_str());
    throw;
  }
}

}  // namespace fitmoe::gguf
