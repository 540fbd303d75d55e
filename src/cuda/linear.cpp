#include "cuda/linear.h"

#include <vector>

#include "runtime/thread_pool.h"

namespace fitmoe::gpu {

void linear(Step& s, const GWeight& w, const float* x, int nt, float* y, int64_t ld_y) {
  Workspace& ws = s.ws;
  void* const stream = s.e.stream;
  const Weight& hw = *w.host;
  if (!w.on_gpu()) {
    gpu::copy_d2h(ws.h_xn, x, sizeof(float) * nt * hw.cols(), stream);
    gpu::sync_stream(stream);
    cpu::matmul(s.pool, hw, ws.h_xn, hw.cols(), nt, ws.h_out, ld_y, ws.cpu_scratch, 40);
    gpu::copy_h2d(y, ws.h_out, sizeof(float) * ((nt - 1) * ld_y + hw.rows()), stream);
    gpu::sync_stream(stream);  // h_out is reused by the next host matmul
    return;
  }
  const DevMatrix& m = w.dev;
  if (nt <= gpu::kMaxVecTokens) {
    gpu::matvec(m, vec_acts(s, m.type, x, nt, m.cols), nt, y, ld_y, stream);
    return;
  }
  matmul_chunked(s, m, 0, x, m.cols, nt, y, ld_y);
}

const void* vec_acts(Step& s, DType type, const float* x, int nt, int64_t cols) {
  Workspace& ws = s.ws;
  const DType act = dtype_info(type).act_type;
  if (act == DType::F32) return x;
  if (act == DType::Q8_K && x == ws.xn && ws.xn_q_valid && cols == s.e.c.n_embd) return ws.xn_q;
  if (act == DType::Q8_K && x == ws.att && ws.att_q_valid) return ws.att_q;
  gpu::quantize_acts(act, x, cols, nt, cols, ws.acts, s.e.stream);
  s.e.prof.mark("quantize activations", s.e.stream);
  return ws.acts;
}

void* xn_q_for(Step& s, const GWeight& consumer, int nt) {
  Workspace& ws = s.ws;
  ws.xn_q_valid = ws.xn_q && nt <= gpu::kMaxVecTokens && consumer.on_gpu() &&
                  dtype_info(consumer.dev.type).act_type == DType::Q8_K;
  return ws.xn_q_valid ? ws.xn_q : nullptr;
}

void linear_shared(Step& s, std::initializer_list<Product> products, const float* x, int nt) {
  bool vec = nt <= gpu::kMaxVecTokens;
  for (const Product& p : products) vec = vec && p.w->on_gpu();
  if (!vec) {
    for (const Product& p : products) linear(s, *p.w, x, nt, p.y, p.ld_y);
    return;
  }
  std::vector<const Product*> todo;
  for (const Product& p : products) todo.push_back(&p);
  while (!todo.empty()) {
    const DType act = dtype_info(todo.front()->w->dev.type).act_type;
    const void* acts = vec_acts(s, todo.front()->w->dev.type, x, nt, todo.front()->w->dev.cols);
    std::vector<const Product*> rest, same;
    for (const Product* p : todo) {
      if (dtype_info(p->w->dev.type).act_type == act && p->w->dev.cols == todo.front()->w->dev.cols)
        same.push_back(p);
      else
        rest.push_back(p);
    }
    // One call: one launch for quantized matrices of one type (or a pair of types gpu::matvec_multi
    // mixes, such as Q4_K q and k with a Q6_K v).
    std::vector<const gpu::DevMatrix*> wv;
    std::vector<float*> ys;
    std::vector<int64_t> lds;
    for (const Product* p : same) {
      wv.push_back(&p->w->dev);
      ys.push_back(p->y);
      lds.push_back(p->ld_y);
    }
    gpu::matvec_multi(wv.data(), ys.data(), lds.data(), static_cast<int>(wv.size()), acts, nt, s.e.stream);
    todo.swap(rest);
  }
}

void matmul_chunked(Step& s, const DevMatrix& m, int64_t mat, const float* x, int64_t ld_x, int nt, float* y,
                    int64_t ld_y) {
  gpu::matmul(m, mat, x, ld_x, nt, y, ld_y, s.ws.dequant, s.ws.dequant_bytes, s.e.stream);
}

}  // namespace fitmoe::gpu
