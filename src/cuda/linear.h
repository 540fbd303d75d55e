// Weight x activation products of the GPU forward passes: on the GPU where the weight is there
// (integer mat-vecs for decode-sized micro-batches, dequantize + cuBLAS for larger ones), else on the
// CPU through pinned buffers (which synchronises with the stream).
#pragma once
#include <cstdint>
#include <initializer_list>

#include "cuda/residency.h"
#include "cuda/workspace.h"

namespace fitmoe::gpu {

// y[t] = W x[t] for nt tokens (ld_x = W.cols, ld_y given), on the GPU when W is there, else on the
// CPU through pinned buffers.
void linear(Step& s, const GWeight& w, const float* x, int nt, float* y, int64_t ld_y);

// The input of the matrix-vector kernels for weights of type `type`: x itself for F32 weights (their
// activation format is plain f32 rows), else x converted into ws.acts (or the Q8_K copy of xn / att
// that an earlier kernel wrote, where valid).
const void* vec_acts(Step& s, DType type, const float* x, int nt, int64_t cols);

// Where residual_norm should also write xn in Q8_K: when the next consumer of xn is a mat-vec on the
// GPU that takes Q8_K activations (then vec_acts hands it out instead of quantizing again).
void* xn_q_for(Step& s, const GWeight& consumer, int nt);

// Several products of one input (q, k, v): on the matrix-vector path the input is converted once
// per activation format, not once per product.
struct Product {
  const GWeight* w;
  float* y;
  int64_t ld_y;
};
void linear_shared(Step& s, std::initializer_list<Product> products, const float* x, int nt);

// Large products through dequantize + cuBLAS (gpu::matmul tiles rows and tokens to the scratch).
void matmul_chunked(Step& s, const DevMatrix& m, int64_t mat, const float* x, int64_t ld_x, int nt, float* y,
                    int64_t ld_y);

}  // namespace fitmoe::gpu
