// Random expert stacks of a given type and shape for the CPU benchmarks of hybrid decode's host side
// (bench_moe.cpp, expert_prefetch.cpp): n_experts matrices of `rows` rows of `cols` values, filled with
// well-formed random blocks.
#pragma once
#include <cstdint>
#include <vector>

#include "model/model.h"
#include "quant/dtype.h"
#include "quant/kernels.h"

namespace fitmoe::bench {

// A 3-D expert Weight over `mem` (resized and filled here).
inline Weight random_expert_stack(DType t, int64_t cols, int64_t rows, int64_t n_experts, std::vector<uint8_t>& mem,
                                  uint64_t seed) {
  Weight w;
  w.type = t;
  w.ne[0] = cols;
  w.ne[1] = rows;
  w.ne[2] = n_experts;
  w.row_bytes = row_bytes(t, cols);
  mem.resize(w.row_bytes * rows * n_experts);
  quant::fill_random_rows(t, mem.data(), rows * n_experts, cols, 0.02f, seed);
  w.host = mem.data();
  return w;
}

}  // namespace fitmoe::bench
