// The Llama-family decoder behind the model interface (zerotrain/models/model_kind.h).
#include <fmt/format.h>

#include "checkpoint/hf.h"
#include "models/model_kinds.h"
#include "zerotrain/config/config.h"
#include "zerotrain/config/llama_config.h"
#include "zerotrain/models/llama.h"

namespace zt {
namespace {

class TrainableLlama final : public TrainableModule<Llama> {
 public:
  using TrainableModule::TrainableModule;
  using TrainableModel::loss;
  torch::Tensor loss(const Batch& batch) override { return model_->loss(batch.inputs, batch.targets, batch.segments); }
};

// The shape comes from a preset and the model block, or from model.init_from's or
// model.config_from's config.json, read here once (and carried by checkpoints for export).
class LlamaKind final : public ModelKind {
 public:
  explicit LlamaKind(const TrainConfig& config) : config_(llama_config_of(config)) {
    const ModelConfig& m = config.model;
    if (!m.init_from.empty()) {
      source_ = "model.init_from '" + m.init_from + "'";
      source_config_ = read_hf_config_text(m.init_from, "model.init_from");
    } else if (!m.config_from.empty()) {
      source_ = "model.config_from '" + m.config_from + "'";
      source_config_ = read_hf_config_text(m.config_from, "model.config_from");
    } else {
      source_ = "preset '" + m.preset + "'";
    }
  }
  DataKind data_kind() const override { return DataKind::TokenWindows; }
  int64_t context_length() const override { return config_.max_position_embeddings; }
  int64_t data_vocabulary() const override { return config_.vocab_size; }
  int64_t layers() const override { return config_.num_hidden_layers; }
  int64_t parameters() const override { return llama_parameter_count(config_); }
  std::string description() const override {
    const LlamaConfig& l = config_;
    return fmt::format("llama from {} ({}; {} layers, {} heads over {} kv heads of {}, width {}, MLP {}, vocab {}, "
                       "context {}{}{}), {:.2f}M parameters",
                       source_, llama_hf_architecture(l), l.num_hidden_layers, l.num_attention_heads,
                       l.num_key_value_heads, l.resolved_head_dim(), l.hidden_size, l.intermediate_size, l.vocab_size,
                       l.max_position_embeddings, l.tie_word_embeddings ? ", tied head" : "",
                       l.rope_scaling.type == "default" ? "" : ", rope scaling " + l.rope_scaling.type,
                       parameters() / 1e6);
  }
  std::optional<ModelFigures> estimate_figures(int64_t sequence_length, int64_t persistence_threshold,
                                               int tensor_parallel) const override {
    return llama_model_figures(config_, sequence_length, persistence_threshold, tensor_parallel);
  }
  std::unique_ptr<HfModelReader> hf_reader(const std::string& dir) const override {
    return std::make_unique<HfModelReader>(dir, config_);
  }
  std::string carried_hf_config() const override { return source_config_; }
  std::unique_ptr<TrainableModel> build(const std::shared_ptr<Communicator>& tensor_group) const override {
    return std::make_unique<TrainableLlama>(config_, tensor_group);
  }

 private:
  LlamaConfig config_;
  std::string source_;         // for the model line
  std::string source_config_;  // the directory's config.json text ("" for a preset)
};

}  // namespace

std::unique_ptr<ModelKind> make_llama_kind(const TrainConfig& config) { return std::make_unique<LlamaKind>(config); }

}  // namespace zt
