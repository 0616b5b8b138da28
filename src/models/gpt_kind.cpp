// The reference GPT behind the model interface (zerotrain/models/model_kind.h).
#include <fmt/format.h>

#include "checkpoint/hf.h"
#include "models/model_kinds.h"
#include "zerotrain/config/config.h"
#include "zerotrain/config/gpt_config.h"
#include "zerotrain/models/gpt.h"

namespace zt {
namespace {

class TrainableGpt final : public TrainableModule<GPT> {
 public:
  using TrainableModule::TrainableModule;
  using TrainableModel::loss;
  torch::Tensor loss(const Batch& batch) override { return model_->loss(batch.inputs, batch.targets, batch.segments); }
  std::vector<CheckpointTimings> checkpoint_timings() const override { return model_->checkpoint_timings(); }
  std::optional<CheckpointArena::Stats> checkpoint_arena_stats() const override {
    return model_->checkpoint_arena_stats();
  }
  std::optional<FlopsProfile> flops_profile(FlopsProfileInputs inputs) const override {
    inputs.recompute = model_->checkpointing().recompute;
    inputs.checkpointed_blocks = 0;
    for (int64_t i = 0; i < model_->config().n_layer; ++i) inputs.checkpointed_blocks += model_->is_checkpointed(i) ? 1 : 0;
    return gpt_flops_profile(model_->config(), inputs);
  }
};

class GptKind final : public ModelKind {
 public:
  explicit GptKind(const TrainConfig& config) : config_(gpt_config_of(config)), preset_(config.model.preset) {
    config_.validate();
  }
  DataKind data_kind() const override { return DataKind::TokenWindows; }
  int64_t context_length() const override { return config_.context_length; }
  int64_t data_vocabulary() const override { return config_.vocab_size; }
  int64_t layers() const override { return config_.n_layer; }
  int64_t parameters() const override { return gpt_parameter_count(config_); }
  std::string description() const override {
    return fmt::format("gpt preset '{}' ({} layers, {} heads, width {}, vocab {}, context {}), {:.2f}M parameters",
                       preset_, config_.n_layer, config_.n_head, config_.n_embd, config_.vocab_size,
                       config_.context_length, parameters() / 1e6);
  }
  std::optional<ModelFigures> estimate_figures(int64_t sequence_length, int64_t persistence_threshold,
                                               int tensor_parallel) const override {
    // Heads and vocabulary are split evenly or not at all (the planner asks of any size).
    if (tensor_parallel < 1 || config_.n_head % tensor_parallel != 0 || config_.vocab_size % tensor_parallel != 0)
      return std::nullopt;
    return gpt_model_figures(config_, sequence_length, persistence_threshold, tensor_parallel);
  }
  bool profiles_flops(int tensor_parallel) const override { return tensor_parallel == 1; }
  std::unique_ptr<HfModelReader> hf_reader(const std::string& dir) const override {
    return std::make_unique<HfModelReader>(dir, config_);
  }
  std::unique_ptr<TrainableModel> build(const std::shared_ptr<Communicator>& tensor_group) const override {
    return std::make_unique<TrainableGpt>(config_, tensor_group);
  }

 private:
  GPTConfig config_;
  std::string preset_;
};

}  // namespace

std::unique_ptr<ModelKind> make_gpt_kind(const TrainConfig& config) { return std::make_unique<GptKind>(config); }

}  // namespace zt
