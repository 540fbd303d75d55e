// Constructors of the architecture families (one per file in src/model/), used by Model::load.
#pragma once
#include <functional>
#include <memory>

#include "model/model.h"

namespace fitmoe {

using ModelFactory = std::function<std::unique_ptr<Model>(std::shared_ptr<gguf::File>, const LoadOptions&)>;

// qwen3 (dense) and qwen3moe: src/model/qwen3.cpp
std::unique_ptr<Model> make_qwen3_model(std::shared_ptr<gguf::File> file, const LoadOptions& opt);
// qwen35 (dense) and qwen35moe (Qwen3.5 / Qwen3.6: Gated DeltaNet + gated attention): src/model/qwen35.cpp
std::unique_ptr<Model> make_qwen35_model(std::shared_ptr<gguf::File> file, const LoadOptions& opt);
// gemma4 (Gemma 4: sliding / global attention, dense or dense + routed GeGLU experts): src/model/gemma4.cpp
std::unique_ptr<Model> make_gemma4_model(std::shared_ptr<gguf::File> file, const LoadOptions& opt);

}  // namespace fitmoe
