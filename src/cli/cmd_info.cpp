// fitmoe info: what a GGUF holds and whether fitmoe can run it.
#include <cstdio>
#include <map>

#include "cli/common.h"
#include "format/gguf.h"
#include "model/gemma4.h"
#include "model/qwen35.h"
#include "runtime/error.h"

namespace fitmoe::cli {

void register_info(CLI::App& app) {
  auto* cmd = app.add_subcommand("info", "show a GGUF's architecture, hyperparameters, tensors and support");
  auto path = std::make_shared<std::string>();
  cmd->add_option("-m,--model", *path, "GGUF model file")->required();
  cmd->callback([path] {
    auto f = gguf::File::open(*path);
    std::printf("file:          %s\n", path->c_str());
    std::printf("format:        GGUF v%u, %s, %zu metadata keys, %zu tensors, alignment %zu\n", f->version(),
                human_bytes(static_cast<double>(f->file_size())).c_str(), f->metadata().size(), f->tensors().size(),
                f->alignment());
    std::string arch(f->opt_string("general.architecture").value_or("(none)"));
    std::printf("architecture:  %s\n", arch.c_str());
    if (auto n = f->opt_string("general.name")) std::printf("name:          %.*s\n", static_cast<int>(n->size()), n->data());
    // Hyperparameters: every scalar key of the architecture's namespace.
    for (auto& [key, v] : f->metadata()) {
      if (key.rfind(arch + ".", 0) != 0) continue;
      std::string val;
      if (v.is_array()) val = "[" + std::to_string(v.count) + " x " + gguf::value_type_name(v.elem_type) + "]";
      else if (v.type == gguf::ValueType::STRING) val = std::string(v.str.substr(0, 60));
      else if (v.is_float()) val = std::to_string(v.f);
      else val = std::to_string(v.i);
      std::printf("  %-44s %s\n", key.c_str(), val.c_str());
    }
    if (auto tm = f->opt_string("tokenizer.ggml.model")) {
      size_t n_tok = f->find("tokenizer.ggml.tokens") ? f->get_string_array("tokenizer.ggml.tokens").size() : 0;
      std::printf("tokenizer:     %.*s, %zu tokens\n", static_cast<int>(tm->size()), tm->data(), n_tok);
    }
    // Type mix.
    std::map<std::string, std::pair<int, uint64_t>> mix;
    uint64_t total = 0, params = 0;
    for (auto& t : f->tensors()) {
      auto& m = mix[dtype_name(t.type)];
      m.first++;
      m.second += t.nbytes;
      total += t.nbytes;
      params += static_cast<uint64_t>(t.n_elements());
    }
    std::printf("parameters:    %.3f B (%s of tensor data, %.2f bits per weight)\n", params / 1e9,
                human_bytes(static_cast<double>(total)).c_str(), params ? total * 8.0 / params : 0.0);
    std::printf("type mix:\n");
    for (auto& [name, m] : mix)
      std::printf("  %-8s %5d tensors %12s\n", name.c_str(), m.first, human_bytes(static_cast<double>(m.second)).c_str());
    // Support: try to build the model (no weights are read beyond the mapping).
    try {
      auto model = Model::load(*path);
      const auto& c = model->config();
      std::printf("supported:     yes (%s: %d layers, n_embd %d, %d/%d heads x %d, vocab %d", c.arch.c_str(),
                  c.n_layer_trunk(), c.n_embd, c.n_head, c.n_head_kv, c.head_dim, c.n_vocab);
      if (c.n_expert) std::printf(", %d experts, %d active, width %d", c.n_expert, c.n_expert_used, c.n_ff_exp);
      std::printf("); %s of weights read per generated token\n", human_bytes(model->bytes_per_token()).c_str());
      if (!c.swa_layers.empty()) {
        // Gemma 4: which layers are sliding / global, K = V, which share KV; the window's ring.
        std::printf("layers:        %s\n", gemma4_layer_pattern(c).c_str());
        std::printf("KV cache:      sliding layers keep their window + %d positions (a ring), global layers the whole context\n",
                    kSlidingMicroBatch);
        std::printf("runs on:       the CPU, the GPU, or both (experts split by the plan)\n");
      }
      if (!c.recurrent_layers.empty()) {
        // Hybrid stacks: which layers are which, and the MTP block the trunk's pass does not run.
        std::printf("layers:        %s\n", qwen35_layer_pattern(c).c_str());
        if (c.n_layer_mtp)
          std::printf("MTP:           %d block (blk.%d: nextn eh_proj, full attention, %s), loaded; drafts are evaluated by "
                      "qwen35_mtp_forward (no speculative decoding in the CLI yet)\n",
                      c.n_layer_mtp, c.n_layer_trunk(), c.n_expert ? "MoE + shared expert" : "dense FFN");
        else
          std::printf("MTP:           none\n");
        std::printf("runs on:       the CPU, the GPU, or both (experts split by the plan); the MTP block on the CPU\n");
      }
    } catch (const Error& e) {
      std::printf("supported:     no\n");
      std::fflush(stdout);
      throw;  // exit code 1 with the reason on stderr, as for every other bad file
    }
  });
}

}  // namespace fitmoe::cli
