// The BERT encoder behind the model interface (zerotrain/models/model_kind.h).
#include <fmt/format.h>

#include "models/model_kinds.h"
#include "zerotrain/config/bert_config.h"
#include "zerotrain/config/config.h"
#include "zerotrain/models/bert.h"

namespace zt {
namespace {

class TrainableBert final : public TrainableModule<Bert> {
 public:
  using TrainableModule::TrainableModule;
  using TrainableModel::loss;
  torch::Tensor loss(const BertBatch& pairs) override { return model_->mlm_loss(pairs); }
  std::vector<CheckpointTimings> checkpoint_timings() const override { return model_->checkpoint_timings(); }
};

class BertKind final : public ModelKind {
 public:
  explicit BertKind(const TrainConfig& config)
      : config_(bert_config_of(config)), preset_(config.model.preset), data_(config.data) {
    config_.validate();
  }
  DataKind data_kind() const override { return DataKind::SentencePairs; }
  int64_t context_length() const override { return config_.max_positions; }
  int64_t data_vocabulary() const override { return sentence_pair_specials().content_vocab; }
  int64_t layers() const override { return config_.n_layer; }
  int64_t parameters() const override { return bert_parameter_count(config_); }
  BertSpecialTokens sentence_pair_specials() const override { return BertSpecialTokens{config_.vocab_size - 4}; }
  std::string description() const override {
    return fmt::format("bert preset '{}' ({} layers, {} heads, hidden {}, intermediate {}, vocab {} with 4 specials, "
                       "{} positions, {}, {}), {:.2f}M parameters",
                       preset_, config_.n_layer, config_.n_head, config_.hidden, config_.intermediate,
                       config_.vocab_size, config_.max_positions, config_.pre_layer_norm ? "pre-LN" : "post-LN",
                       config_.next_sentence ? "MLM + NSP loss" : "MLM loss", parameters() / 1e6);
  }
  std::string batch_note() const override {
    return fmt::format("{:.0f}% of the content positions predicted{}", 100 * data_.mlm_probability,
                       data_.max_predictions > 0 ? fmt::format(" (at most {} per sequence)", data_.max_predictions)
                                                 : "");
  }
  std::optional<ModelFigures> estimate_figures(int64_t, int64_t, int) const override { return std::nullopt; }
  std::string estimate_gap() const override { return "the memory estimate models the GPT and the Llama"; }
  std::unique_ptr<TrainableModel> build(const std::shared_ptr<Communicator>& tensor_group) const override {
    return std::make_unique<TrainableBert>(config_, tensor_group);
  }

 private:
  BertConfig config_;
  std::string preset_;
  DataConfig data_;
};

}  // namespace

std::unique_ptr<ModelKind> make_bert_kind(const TrainConfig& config) { return std::make_unique<BertKind>(config); }

}  // namespace zt
