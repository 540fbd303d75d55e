// Helpers shared by the GPU tests: device buffers poisoned at creation (NaN bytes, so that a value a
// kernel forgot to write, or memory it must not touch, shows up), uploads, random inputs, random
// weight stacks of any type, and a fixture with a fresh stream per test. Skips without a CUDA device.
#pragma once
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "cuda/gpu_ops.h"
#include "quant/dtype.h"
#include "quant/kernels.h"
#include "runtime/error.h"

namespace fitmoe::gpu::test {

inline bool has_device() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return n > 0;
}

constexpr uint8_t kPoison = 0xff;  // NaN as f32 (0xffffffff) and as f16 (0xffff)

// A device buffer, poisoned at creation.
class Dev {
 public:
  explicit Dev(size_t n) : n_(std::max<size_t>(n, 1)) {
    if (cudaMalloc(&p_, n_) != cudaSuccess) throw Error("cudaMalloc failed");
    poison();
  }
  ~Dev() { cudaFree(p_); }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
  void poison() { cudaMemset(p_, kPoison, n_); }
  template <class T = void>
  T* as() const {
    return static_cast<T*>(p_);
  }
  uint8_t* bytes() const { return static_cast<uint8_t*>(p_); }
  size_t size() const { return n_; }
  void up(const void* src, size_t n, size_t off = 0) {
    cudaMemcpy(static_cast<uint8_t*>(p_) + off, src, n, cudaMemcpyHostToDevice);
  }
  template <class T>
  std::vector<T> down(size_t count) const {
    std::vector<T> v(count);
    cudaMemcpy(v.data(), p_, count * sizeof(T), cudaMemcpyDeviceToHost);
    return v;
  }

 private:
  void* p_ = nullptr;
  size_t n_;
};

template <class T>
std::unique_ptr<Dev> upload(const std::vector<T>& v) {
  auto d = std::make_unique<Dev>(v.size() * sizeof(T));
  if (!v.empty()) d->up(v.data(), v.size() * sizeof(T));
  return d;
}

// A fresh stream per test (the ops must honour it).
class GpuTest : public ::testing::Test {
 public:
  Stream s() const { return static_cast<Stream>(stream_); }
  void sync() {
    ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    const cudaError_t e = cudaGetLastError();
    ASSERT_EQ(e, cudaSuccess) << cudaGetErrorString(e);
  }

 protected:
  void SetUp() override {
    if (!has_device()) GTEST_SKIP() << "no CUDA device on this machine";
    ASSERT_EQ(cudaStreamCreate(&stream_), cudaSuccess);
  }
  void TearDown() override {
    if (stream_) cudaStreamDestroy(stream_);
  }
  cudaStream_t stream_ = nullptr;
};

inline std::vector<float> randn(size_t n, uint64_t seed, float sd = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, sd);
  std::vector<float> v(n);
  for (auto& x : v) x = nd(rng);
  return v;
}

inline uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline bool is_poison(float f) { return bits(f) == 0xffffffffu; }

// Every weight type the GPU takes.
inline constexpr DType kWeightTypes[] = {DType::F32,  DType::F16,  DType::BF16, DType::Q4_0,   DType::Q4_1,
                                         DType::Q5_0, DType::Q5_1, DType::Q8_0, DType::Q2_K,   DType::Q3_K,
                                         DType::Q4_K, DType::Q5_K, DType::Q6_K, DType::IQ4_NL, DType::IQ4_XS};

// n_mats stacked matrices of random well-formed blocks, on the host.
struct HostMatrix {
  DType type;
  int64_t rows, cols, n_mats;
  size_t rb;
  std::vector<uint8_t> data;
  const uint8_t* row(int64_t mat, int64_t r) const { return data.data() + (mat * rows + r) * rb; }
};
inline HostMatrix random_matrix(DType t, int64_t rows, int64_t cols, int64_t n_mats, uint64_t seed) {
  HostMatrix m{t, rows, cols, n_mats, row_bytes(t, cols), {}};
  m.data.resize(m.rb * rows * n_mats);
  quant::fill_random_rows(t, m.data.data(), rows * n_mats, cols, 0.05f, seed);
  return m;
}
// The DevMatrix view of a HostMatrix uploaded into d.
inline DevMatrix dev_matrix(const HostMatrix& h, const Dev& d) {
  DevMatrix m;
  m.type = h.type;
  m.cols = h.cols;
  m.rows = h.rows;
  m.n_mats = h.n_mats;
  m.row_bytes = h.rb;
  m.mat_bytes = h.rb * h.rows;
  m.data = d.bytes();
  return m;
}

}  // namespace fitmoe::gpu::test
