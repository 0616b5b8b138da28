// Internal to src/models: the registry's entries, one factory per model type, and the part of a
// TrainableModel every module gives alike. A new model adds its <name>_kind.cpp beside these and
// one line to kKinds in model_kinds.cpp.
#pragma once
#include <memory>

#include "zerotrain/models/model_kind.h"

namespace zt {

// The part of a TrainableModel that every module holder (GPT, Bert, Llama) gives alike.
template <typename Holder>
class TrainableModule : public TrainableModel {
 public:
  template <typename Shape>
  TrainableModule(const Shape& shape, const std::shared_ptr<Communicator>& tensor_group) : model_(shape, tensor_group) {}
  std::shared_ptr<torch::nn::Module> module() const override { return model_.ptr(); }
  void set_checkpointing(const CheckpointingSettings& settings) override { model_->set_checkpointing(settings); }
  bool is_checkpointed(int64_t block) const override { return model_->is_checkpointed(block); }

 protected:
  Holder model_;
};

std::unique_ptr<ModelKind> make_gpt_kind(const TrainConfig& config);
std::unique_ptr<ModelKind> make_bert_kind(const TrainConfig& config);
std::unique_ptr<ModelKind> make_llama_kind(const TrainConfig& config);

}  // namespace zt
