// Internal to src/models: the registry's entries, one factory per model type. A new model adds
// its <name>_kind.cpp beside these and one line to kKinds in model_kinds.cpp.
#pragma once
#include <memory>

#include "zerotrain/models/model_kind.h"

namespace zt {

std::unique_ptr<ModelKind> make_gpt_kind(const TrainConfig& config);
std::unique_ptr<ModelKind> make_bert_kind(const TrainConfig& config);
std::unique_ptr<ModelKind> make_llama_kind(const TrainConfig& config);

}  // namespace zt
