// Validating GGUF reader. Every length and offset read from the file is checked against the bytes
// that remain before it is used, so a corrupt or truncated file produces an Error, never a crash.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <set>
#include <sstream>

#include "format/gguf.h"
#include "runtime/error.h"

namespace fitmoe::gguf {

namespace {

constexpr uint64_t kMaxStringBytes = 1ull << 30;   // no key or value string is anywhere near 1 GiB
constexpr int kMaxDims = 4;

size_t scalar_size(ValueType t) {
  switch (t) {
    case ValueType::U8: case ValueType::I8: case ValueType::BOOL: return 1;
    case ValueType::U16: case ValueType::I16: return 2;
    case ValueType::U32: case ValueType::I32: case ValueType::F32: return 4;
    case ValueType::U64: case ValueType::I64: case ValueType::F64: return 8;
    default: return 0;
  }
}

bool valid_value_type(uint32_t t) { return t <= static_cast<uint32_t>(ValueType::F64); }

template <typename T>
T load(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

// Cursor over the header with bounds checks; every failure names the label and what was being read.
class Cursor {
 public:
  Cursor(const uint8_t* data, size_t size, const std::string& label)
      : data_(data), size_(size), label_(label) {}

  [[noreturn]] void fail(const std::string& what) const {
    throw Error(label_ + ": invalid GGUF: " + what);
  }
  size_t pos() const { return pos_; }
  size_t remaining() const { return size_ - pos_; }
  const uint8_t* here() const { return data_ + pos_; }

  const uint8_t* take(uint64_t n, const char* what) {
    if (n > remaining()) {
      std::ostringstream s;
      s << "file truncated while reading " << what << " at byte " << pos_ << " (needs " << n
        << " bytes, " << remaining() << " left)";
      fail(s.str());
    }
    const uint8_t* p = data_ + pos_;
    pos_ += n;
    return p;
  }
  template <typename T>
  T read(const char* what) { return load<T>(take(sizeof(T), what)); }

  std::string_view read_string(const char* what) {
    uint64_t n = read<uint64_t>(what);
    if (n > kMaxStringBytes) fail(std::string(what) + " has an impossible length " + std::to_string(n));
    const uint8_t* p = take(n, what);
    return std::string_view(reinterpret_cast<const char*>(p), n);
  }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
  const std::string& label_;
};

void read_scalar(Cursor& c, ValueType t, Value& v, const char* what) {
  const uint8_t* p = c.take(scalar_size(t), what);
  switch (t) {
    case ValueType::U8: v.u = load<uint8_t>(p); break;
    case ValueType::I8: v.i = load<int8_t>(p); break;
    case ValueType::U16: v.u = load<uint16_t>(p); break;
    case ValueType::I16: v.i = load<int16_t>(p); break;
    case ValueType::U32: v.u = load<uint32_t>(p); break;
    case ValueType::I32: v.i = load<int32_t>(p); break;
    case ValueType::U64: v.u = load<uint64_t>(p); break;
    case ValueType::I64: v.i = load<int64_t>(p); break;
    case ValueType::BOOL: {
      uint8_t b = load<uint8_t>(p);
      if (b > 1) c.fail(std::string(what) + ": bool value " + std::to_string(b) + " is neither 0 nor 1");
      v.u = b;
      break;
    }
    case ValueType::F32: v.f = load<float>(p); break;
    case ValueType::F64: v.f = load<double>(p); break;
    default: break;
  }
  switch (t) {
    case ValueType::U8: case ValueType::U16: case ValueType::U32: case ValueType::U64: case ValueType::BOOL:
      v.i = v.u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) ? -1 : static_cast<int64_t>(v.u);
      v.f = static_cast<double>(v.u);
      break;
    case ValueType::I8: case ValueType::I16: case ValueType::I32: case ValueType::I64:
      v.u = v.i < 0 ? 0 : static_cast<uint64_t>(v.i);
      v.f = static_cast<double>(v.i);
      break;
    default: break;
  }
}

}  // namespace

const char* value_type_name(ValueType t) {
  static const char* names[] = {"u8", "i8", "u16", "i16", "u32", "i32", "f32", "bool",
                                "string", "array", "u64", "i64", "f64"};
  auto i = static_cast<uint32_t>(t);
  return i < 13 ? names[i] : "unknown";
}

bool Value::is_integer() const {
  switch (type) {
    case ValueType::U8: case ValueType::I8: case ValueType::U16: case ValueType::I16:
    case ValueType::U32: case ValueType::I32: case ValueType::U64: case ValueType::I64:
      return true;
    default: return false;
  }
}

std::string TensorInfo::shape_string() const {
  std::string s = "[";
  for (int d = 0; d < n_dims; ++d) s += (d ? ", " : "") + std::to_string(ne[d]);
  return s + "]";
}

std::shared_ptr<File> File::open(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw Error(path + ": cannot open: " + std::strerror(errno));
  struct stat st{};
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    throw Error(path + ": not a regular file");
  }
  size_t size = static_cast<size_t>(st.st_size);
  if (size < 24) {
    ::close(fd);
    throw Error(path + ": invalid GGUF: file too small (" + std::to_string(size) + " bytes)");
  }
  void* map = mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
  if (map == MAP_FAILED) {
    int e = errno;
    ::close(fd);
    throw Error(path + ": cannot map: " + std::strerror(e));
  }
  std::shared_ptr<File> f(new File());
  f->path_ = path;
  f->fd_ = fd;
  f->base_ = static_cast<const uint8_t*>(map);
  f->size_ = size;
  f->owns_mapping_ = true;
  f->parse_all(path);
  return f;
}

std::shared_ptr<File> File::parse(const uint8_t* data, size_t size, const std::string& label) {
  std::shared_ptr<File> f(new File());
  f->path_ = label;
  f->base_ = data;
  f->size_ = size;
  f->parse_all(label);
  return f;
}

File::~File() {
  if (copy_ && copy_free_) copy_free_(copy_);
  else if (copy_) munmap(copy_, copy_bytes_);
  if (owns_mapping_ && base_) munmap(const_cast<uint8_t*>(base_), size_);
  if (fd_ >= 0) ::close(fd_);
}

void File::parse_all(const std::string& label) {
  Cursor c(base_, size_, label);
  const uint8_t* magic = c.take(4, "magic");
  if (std::memcmp(magic, "GGUF", 4) != 0) c.fail("bad magic (not a GGUF file)");
  version_ = c.read<uint32_t>("version");
  if (version_ != 2 && version_ != 3) {
    c.fail("unsupported version " + std::to_string(version_) + " (fitmoe reads 2 and 3)");
  }
  uint64_t n_tensors = c.read<uint64_t>("tensor count");
  uint64_t n_kv = c.read<uint64_t>("metadata count");
  // Each metadata pair needs at least 8 (key length) + 4 (type) + 1 bytes; each tensor info at least
  // 8 + 4 + 8 + 4 + 8. Counts beyond what the file could hold are corrupt, and checking them first
  // keeps a hostile count from making us reserve gigabytes.
  if (n_kv > c.remaining() / 13) c.fail("metadata count " + std::to_string(n_kv) + " exceeds the file size");
  if (n_tensors > c.remaining() / 32) c.fail("tensor count " + std::to_string(n_tensors) + " exceeds the file size");

  kv_.reserve(n_kv);
  for (uint64_t k = 0; k < n_kv; ++k) {
    std::string key(c.read_string("metadata key"));
    if (key.empty()) c.fail("metadata pair " + std::to_string(k) + " has an empty key");
    std::string what = "value of " + key;
    uint32_t t = c.read<uint32_t>(what.c_str());
    if (!valid_value_type(t)) c.fail("key " + key + " has unknown value type " + std::to_string(t));
    Value v;
    v.type = static_cast<ValueType>(t);
    if (v.type == ValueType::STRING) {
      v.str = c.read_string(what.c_str());
    } else if (v.type == ValueType::ARRAY) {
      uint32_t et = c.read<uint32_t>(what.c_str());
      if (!valid_value_type(et)) c.fail("array " + key + " has unknown element type " + std::to_string(et));
      v.elem_type = static_cast<ValueType>(et);
      if (v.elem_type == ValueType::ARRAY) c.fail("array " + key + " nests arrays (unsupported)");
      v.count = c.read<uint64_t>(what.c_str());
      if (v.elem_type == ValueType::STRING) {
        if (v.count > c.remaining() / 8) c.fail("array " + key + " count " + std::to_string(v.count) + " exceeds the file size");
        v.strings.reserve(v.count);
        for (uint64_t j = 0; j < v.count; ++j) v.strings.push_back(c.read_string(what.c_str()));
      } else {
        size_t es = scalar_size(v.elem_type);
        if (v.count > c.remaining() / es) c.fail("array " + key + " count " + std::to_string(v.count) + " exceeds the file size");
        v.raw = c.take(v.count * es, what.c_str());
        if (v.elem_type == ValueType::BOOL) {
          for (uint64_t j = 0; j < v.count; ++j)
            if (v.raw[j] > 1) c.fail("array " + key + " holds a bool that is neither 0 nor 1");
        }
      }
    } else {
      read_scalar(c, v.type, v, what.c_str());
    }
    if (kv_index_.count(key)) c.fail("duplicate metadata key " + key);
    kv_index_.emplace(key, kv_.size());
    kv_.emplace_back(std::move(key), std::move(v));
  }

  if (const Value* a = find("general.alignment")) {
    if (!a->is_integer() || a->u == 0 || (a->u & (a->u - 1)) != 0 || a->u > (1u << 20))
      c.fail("general.alignment must be a power of two integer, got " + std::to_string(a->u));
    alignment_ = a->u;
  }

  tensors_.reserve(n_tensors);
  for (uint64_t k = 0; k < n_tensors; ++k) {
    TensorInfo t;
    t.name = std::string(c.read_string("tensor name"));
    if (t.name.empty()) c.fail("tensor " + std::to_string(k) + " has an empty name");
    std::string what = "tensor info of " + t.name;
    uint32_t n_dims = c.read<uint32_t>(what.c_str());
    if (n_dims == 0 || n_dims > kMaxDims)
      c.fail("tensor " + t.name + " has " + std::to_string(n_dims) + " dimensions (1 to 4 allowed)");
    t.n_dims = static_cast<int>(n_dims);
    t.ne.assign(4, 1);
    for (uint32_t d = 0; d < n_dims; ++d) {
      int64_t ne = c.read<int64_t>(what.c_str());
      if (ne <= 0 || ne > (int64_t(1) << 40))
        c.fail("tensor " + t.name + " dimension " + std::to_string(d) + " is " + std::to_string(ne));
      t.ne[d] = ne;
    }
    uint32_t type = c.read<uint32_t>(what.c_str());
    const DTypeInfo* ti = dtype_info(type);
    if (!ti || !ti->weight_type)
      c.fail("tensor " + t.name + " has unknown or unsupported tensor type " + std::to_string(type));
    t.type = ti->type;
    t.offset = c.read<uint64_t>(what.c_str());
    if (t.ne[0] % ti->block_size != 0)
      c.fail("tensor " + t.name + " row length " + std::to_string(t.ne[0]) + " is not a multiple of the " +
             ti->name + " block size " + std::to_string(ti->block_size));
    // The product of dims fits comfortably: each is <= 2^40 and the total is bounded by the file size below.
    long double elems = static_cast<long double>(t.ne[0]) * t.ne[1] * t.ne[2] * t.ne[3];
    if (elems > static_cast<long double>(size_) * ti->block_size)
      c.fail("tensor " + t.name + " shape " + t.shape_string() + " is larger than the file");
    t.nbytes = row_bytes(t.type, t.ne[0]) * static_cast<uint64_t>(t.n_rows());
    if (t.offset % alignment_ != 0)
      c.fail("tensor " + t.name + " offset " + std::to_string(t.offset) + " is not aligned to " + std::to_string(alignment_));
    if (tensor_index_.count(t.name)) c.fail("duplicate tensor name " + t.name);
    tensor_index_.emplace(t.name, tensors_.size());
    tensors_.push_back(std::move(t));
  }

  size_t pos = c.pos();
  data_offset_ = (pos + alignment_ - 1) / alignment_ * alignment_;
  if (n_tensors > 0 && data_offset_ > size_) c.fail("file truncated before the tensor data section");
  uint64_t data_size = size_ > data_offset_ ? size_ - data_offset_ : 0;

  // Bounds and overlaps: sort by offset and check each tensor ends before the next begins.
  std::vector<const TensorInfo*> by_offset;
  for (auto& t : tensors_) {
    if (t.offset > data_size || t.nbytes > data_size - t.offset) {
      std::ostringstream s;
      s << "tensor " << t.name << " (" << t.nbytes << " bytes at data offset " << t.offset
        << ") lies beyond the end of the file (data section holds " << data_size << " bytes; truncated?)";
      c.fail(s.str());
    }
    t.data = base_ + data_offset_ + t.offset;
    by_offset.push_back(&t);
  }
  std::sort(by_offset.begin(), by_offset.end(),
            [](const TensorInfo* a, const TensorInfo* b) { return a->offset < b->offset; });
  for (size_t k = 1; k < by_offset.size(); ++k) {
    const TensorInfo* a = by_offset[k - 1];
    const TensorInfo* b = by_offset[k];
    if (a->offset + a->nbytes > b->offset) c.fail("tensors " + a->name + " and " + b->name + " overlap");
  }
}

const TensorInfo* File::find_tensor(std::string_view name) const {
  auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

const Value* File::find(std::string_view key) const {
  auto it = kv_index_.find(key);
  return it == kv_index_.end() ? nullptr : &kv_[it->second].second;
}

namespace {
[[noreturn]] void wrong_type(const std::string& path, std::string_view key, const Value& v, const char* want) {
  throw Error(path + ": metadata key " + std::string(key) + " has type " + value_type_name(v.type) +
              ", expected " + want);
}
}  // namespace

std::optional<std::string_view> File::opt_string(std::string_view key) const {
  const Value* v = find(key);
  if (!v) return std::nullopt;
  if (v->type != ValueType::STRING) wrong_type(path_, key, *v, "string");
  return v->str;
}
std::optional<uint64_t> File::opt_uint(std::string_view key) const {
  const Value* v = find(key);
  if (!v) return std::nullopt;
  if (!v->is_integer()) wrong_type(path_, key, *v, "an integer");
  if (v->i < 0 && v->type != ValueType::U64)
    throw Error(path_ + ": metadata key " + std::string(key) + " is negative (" + std::to_string(v->i) + ")");
  return v->u;
}
std::optional<double> File::opt_float(std::string_view key) const {
  const Value* v = find(key);
  if (!v) return std::nullopt;
  if (!v->is_float() && !v->is_integer()) wrong_type(path_, key, *v, "a number");
  return v->f;
}
std::optional<bool> File::opt_bool(std::string_view key) const {
  const Value* v = find(key);
  if (!v) return std::nullopt;
  if (v->type != ValueType::BOOL) wrong_type(path_, key, *v, "bool");
  return v->u != 0;
}

#define FITMOE_REQUIRE(opt_call, key)                                                    \
  do {                                                                                   \
    auto r = opt_call;                                                                   \
    if (!r) throw Error(path_ + ": missing metadata key " + std::string(key));          \
    return *r;                                                                           \
  } while (0)

std::string_view File::get_string(std::string_view key) const { FITMOE_REQUIRE(opt_string(key), key); }
uint64_t File::get_uint(std::string_view key) const { FITMOE_REQUIRE(opt_uint(key), key); }
double File::get_float(std::string_view key) const { FITMOE_REQUIRE(opt_float(key), key); }
bool File::get_bool(std::string_view key) const { FITMOE_REQUIRE(opt_bool(key), key); }
#undef FITMOE_REQUIRE

std::vector<int64_t> File::get_int_array(std::string_view key) const {
  const Value* v = find(key);
  if (!v) throw Error(path_ + ": missing metadata key " + std::string(key));
  if (v->is_integer() || v->type == ValueType::BOOL) return {v->i};
  Value elem;
  elem.type = v->elem_type;
  if (!v->is_array() || !(elem.is_integer() || v->elem_type == ValueType::BOOL))
    wrong_type(path_, key, *v, "an integer array");
  std::vector<int64_t> out(v->count);
  size_t es = scalar_size(v->elem_type);
  for (uint64_t j = 0; j < v->count; ++j) {
    Value e;
    e.type = v->elem_type;
    Cursor c(v->raw + j * es, es, path_);
    read_scalar(c, v->elem_type, e, "array element");
    out[j] = e.i;
  }
  return out;
}

std::vector<float> File::get_float_array(std::string_view key) const {
  const Value* v = find(key);
  if (!v) throw Error(path_ + ": missing metadata key " + std::string(key));
  if (v->is_float() || v->is_integer()) return {static_cast<float>(v->f)};
  if (!v->is_array() || v->elem_type == ValueType::STRING) wrong_type(path_, key, *v, "a numeric array");
  std::vector<float> out(v->count);
  size_t es = scalar_size(v->elem_type);
  for (uint64_t j = 0; j < v->count; ++j) {
    Value e;
    e.type = v->elem_type;
    Cursor c(v->raw + j * es, es, path_);
    read_scalar(c, v->elem_type, e, "array element");
    out[j] = static_cast<float>(e.f);
  }
  return out;
}

const std::vector<std::string_view>& File::get_string_array(std::string_view key) const {
  const Value* v = find(key);
  if (!v) throw Error(path_ + ": missing metadata key " + std::string(key));
  if (!v->is_array() || v->elem_type != ValueType::STRING) wrong_type(path_, key, *v, "a string array");
  return v->strings;
}

void File::load_into_memory(const std::function<void(uint64_t, uint64_t)>& progress) {
  if (copy_) return;
  const size_t n = data_bytes();
  if (n == 0) return;
  constexpr size_t kHuge = 2u << 20;
  copy_bytes_ = (n + kHuge - 1) / kHuge * kHuge;
  void* p = mmap(nullptr, copy_bytes_ + kHuge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw Error(path_ + ": cannot allocate " + std::to_string(n >> 20) + " MiB for the weights");
  // Align to 2 MiB so the huge-page advice can take effect, and give back the slack.
  uintptr_t a = (reinterpret_cast<uintptr_t>(p) + kHuge - 1) & ~(kHuge - 1);
  size_t head = a - reinterpret_cast<uintptr_t>(p);
  if (head) munmap(p, head);
  if (kHuge - head) munmap(reinterpret_cast<uint8_t*>(a) + copy_bytes_, kHuge - head);
  copy_ = reinterpret_cast<uint8_t*>(a);
  madvise(copy_, copy_bytes_, MADV_HUGEPAGE);
  fill_copy(progress);
}

void File::load_into_memory(const std::function<void(uint64_t, uint64_t)>& progress,
                            const std::function<void*(size_t)>& alloc, std::function<void(void*)> free) {
  if (copy_) return;
  const size_t n = data_bytes();
  if (n == 0) return;
  copy_ = static_cast<uint8_t*>(alloc(n));
  if (!copy_) throw Error(path_ + ": cannot allocate " + std::to_string(n >> 20) + " MiB of page-locked memory for the weights");
  copy_bytes_ = n;
  copy_free_ = std::move(free);
  fill_copy(progress);
}

void File::fill_copy(const std::function<void(uint64_t, uint64_t)>& progress) {
  const size_t n = data_bytes();
  constexpr size_t kChunk = 64u << 20;
  for (size_t off = 0; off < n;) {
    size_t len = std::min(kChunk, n - off);
    if (fd_ >= 0) {
      ssize_t r = pread(fd_, copy_ + off, len, static_cast<off_t>(data_offset_ + off));
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) throw Error(path_ + ": read failed while loading weights: " + (r < 0 ? std::strerror(errno) : "file shrank"));
      len = static_cast<size_t>(r);
    } else {
      std::memcpy(copy_ + off, base_ + data_offset_ + off, len);
    }
    off += len;
    if (progress) progress(off, n);
  }
  for (auto& t : tensors_) t.data = copy_ + t.offset;
}

}  // namespace fitmoe::gguf
