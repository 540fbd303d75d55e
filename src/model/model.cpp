#include "model/model.h"
#include "runtime/cpu_ops.h"

#include <algorithm>
#include <functional>
#include <map>

#include "model/architectures.h"
#include "model/gpu_runner.h"
#include "runtime/machine.h"
#if FITMOE_CUDA
#include "cuda/device.h"
#endif
#include "runtime/error.h"
#include "runtime/thread_pool.h"

namespace fitmoe {

namespace {
// The registry of architecture families: general.architecture -> constructor. A new model is one new
// file in src/model plus one line here.
const std::map<std::string, ModelFactory>& registry() {
  static const std::map<std::string, ModelFactory> r = {
      {"qwen3moe", make_qwen3_model},
      {"qwen3", make_qwen3_model},
      {"qwen35moe", make_qwen35_model},
      {"qwen35", make_qwen35_model},
      {"gemma4", make_gemma4_model},
  };
  return r;
}
}  // namespace

Model::~Model() { gpu_.reset(); }

std::string Model::gpu_memory_report() const { return gpu_ ? gpu_->memory_report() : std::string(); }
uint64_t Model::gpu_bytes_used() const { return gpu_ ? gpu_->memory_used() : 0; }
RoutingGuessStats Model::routing_guess_stats() const { return gpu_ ? gpu_->routing_guess_stats() : RoutingGuessStats{}; }

std::vector<std::string> Model::supported_architectures() {
  std::vector<std::string> out;
  for (auto& [name, f] : registry()) out.push_back(name);
  return out;
}

std::unique_ptr<Model> Model::load(const std::string& path, const LoadOptions& opt) {
  auto file = gguf::File::open(path);
  std::string arch(file->get_string("general.architecture"));
  auto it = registry().find(arch);
  if (it == registry().end()) {
    std::string list;
    for (auto& a : supported_architectures()) list += (list.empty() ? "" : ", ") + a;
    throw Error(path + ": unknown or unsupported architecture '" + arch + "' (fitmoe supports: " + list + ")");
  }
  const ModelFactory& make = it->second;
  auto model = make(file, opt);  // validates names, shapes and types before any weight is read

  // Plan where everything lives (no weight is read for this).
  MachineProfile machine;
  bool gpu_possible = false;
#if FITMOE_CUDA
  gpu_possible = opt.plan.use_gpu;
#endif
  if (opt.machine) {
    machine = *opt.machine;
  } else {
    // (Measured once per machine and cached: the plan's predictions need it on the CPU too.)
    machine = probe_machine(0, gpu_possible);
  }
  if (!opt.plan.use_gpu) machine.gpu_free_bytes = 0;
  if (machine.host_available_bytes == 0) machine.host_available_bytes = host_memory_available();
  PlanOptions plan_opt = opt.plan;
  plan_opt.use_mmap = opt.use_mmap;
  // An architecture without a GPU forward pass is planned for the CPU, so that its plan (memory map,
  // predicted speed) is the one that runs.
  const bool gpu_refused = plan_opt.use_gpu && machine.gpu_free_bytes > 0 && !model->has_gpu_forward();
  if (gpu_refused) plan_opt.use_gpu = false;
  model->plan_ = make_plan(*file, model->cfg_, plan_opt, machine);
  if (gpu_refused)
    for (std::string& n : model->plan_.notes)
      if (n == "--gpu none: everything runs on the CPU") n = model->cfg_.arch + " has no GPU forward pass yet: everything runs on the CPU";
  if (opt.plan_only) return model;
  if (opt.before_weights) opt.before_weights(*model);

  auto progress = [&](uint64_t d, uint64_t t) {
    if (opt.progress)
      opt.progress(model->plan_.use_gpu ? "loading weights into page-locked memory" : "loading weights into memory", d, t);
  };
  bool loaded = false;
#if FITMOE_CUDA
  if (model->plan_.use_gpu) {
    // GPU runs read the weights from page-locked memory: expert uploads during prefill then run at
    // PCIe speed (pageable memory is about 10x slower), and the CPU computes the host-resident experts
    // from the same bytes.
    file->load_into_memory(progress, gpu::alloc_pinned_huge, gpu::free_pinned_huge);
    loaded = true;
  }
#endif
  if (!opt.use_mmap) {
    file->load_into_memory(progress);  // no-op when the GPU path loaded it
    loaded = true;
  }
  if (loaded) {
    // The weights were bound to the file mapping when the model was built; build it again (metadata
    // and tensor lookups only) so that every weight points into the loaded copy, and check that.
    Plan plan = std::move(model->plan_);
    model = make(file, opt);
    model->plan_ = std::move(plan);
    const uint8_t* lo = file->data_begin();
    const uint8_t* hi = lo + file->data_bytes();
    model->visit_weights([&](const Weight& w) {
      if (w.host < lo || w.host >= hi)
        throw Error("internal: weight " + (w.info ? w.info->name : std::string("?")) + " is not in the loaded copy");
    });
  }
  if (model->plan_.use_gpu && !model->init_gpu(opt)) {
    model->plan_.use_gpu = false;
    model->plan_.notes.push_back(model->cfg_.arch + " has no GPU forward pass yet: running on the CPU");
  }
  return model;
}

BatchRows::BatchRows(std::span<const BatchSeq> seqs) {
  for (const BatchSeq& q : seqs) {
    if (q.tokens.empty()) continue;
    parts.push_back({q.state, n_rows(), static_cast<int>(q.tokens.size()), q.state->n_past(), q.n_logits});
    tokens.insert(tokens.end(), q.tokens.begin(), q.tokens.end());
  }
}

int BatchRows::n_logits() const {
  int n = 0;
  for (const BatchPart& p : parts) n += p.n_logits;
  return n;
}

void norm_logit_rows(const BatchRows& batch, const float* x, float* out, int n, float eps, const float* w) {
  int r = 0;
  for (const BatchPart& p : batch.parts) {
    if (!p.n_logits) continue;
    cpu::rms_norm(x + static_cast<int64_t>(p.row0 + p.n - p.n_logits) * n, w, out + static_cast<int64_t>(r) * n, n,
                  p.n_logits, eps, n, n);
    r += p.n_logits;
  }
}

void Model::forward(ModelState& state, ThreadPool& pool, std::span<const int32_t> tokens, int n_logits,
                    float* logits) const {
  const BatchSeq one{&state, tokens, n_logits};
  forward_batch(pool, std::span<const BatchSeq>(&one, 1), logits);
}

void Model::forward_batch(ThreadPool& pool, std::span<const BatchSeq> seqs, float* logits) const {
  for (size_t i = 0; i < seqs.size(); ++i) {
    const BatchSeq& q = seqs[i];
    if (!q.state) throw Error("forward: a sequence of the batch has no state");
    for (size_t j = 0; j < i; ++j)
      if (seqs[j].state == q.state) throw Error("forward: a state appears twice in one batch");
    const int n = static_cast<int>(q.tokens.size());
    if (q.state->n_past() + n > q.state->n_ctx())
      throw Error("context is full: " + std::to_string(q.state->n_past()) + " + " + std::to_string(n) +
                  " tokens exceed the context of " + std::to_string(q.state->n_ctx()));
    if (q.n_logits < 0 || q.n_logits > n) throw Error("forward: n_logits out of range");
    for (int32_t t : q.tokens)
      if (t < 0 || t >= cfg_.n_vocab)
        throw Error("token id " + std::to_string(t) + " is outside the vocabulary (0.." +
                    std::to_string(cfg_.n_vocab - 1) + ")");
  }
  const BatchRows batch(seqs);
  if (batch.parts.empty()) return;
  forward_impl(pool, batch, logits);
  for (const BatchPart& p : batch.parts) p.state->advance(p.n);
}

Weight Model::tensor(const std::string& name, std::vector<int64_t> ne, bool optional) const {
  const gguf::TensorInfo* t = file_->find_tensor(name);
  if (!t) {
    if (optional) return {};
    throw Error(file_->path() + ": missing tensor " + name + " (required by " + cfg_.arch + ")");
  }
  ne.resize(4, 1);
  if (!std::equal(ne.begin(), ne.end(), t->ne.begin())) {
    size_t dims = 4;
    while (dims > 1 && ne[dims - 1] == 1) --dims;
    std::string want = "[";
    for (size_t i = 0; i < dims; ++i) want += (i ? ", " : "") + std::to_string(ne[i]);
    throw Error(file_->path() + ": tensor " + name + " has shape " + t->shape_string() + ", but the " +
                cfg_.arch + " hyperparameters require " + want + "]");
  }
  Weight w;
  w.info = t;
  w.type = t->type;
  for (int d = 0; d < 4; ++d) w.ne[d] = t->ne[d];
  w.row_bytes = t->row_bytes();
  w.host = t->data;
  return w;
}

}  // namespace fitmoe
