// The registry of model types (zerotrain/models/model_kind.h) and the interface's defaults.
#include "models/model_kinds.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "checkpoint/hf.h"
#include "zerotrain/config/config.h"
#include "zerotrain/error.h"

namespace zt {
namespace {

struct Entry {
  const char* type;
  std::unique_ptr<ModelKind> (*make)(const TrainConfig&);
};
constexpr Entry kKinds[] = {{"gpt", make_gpt_kind}, {"bert", make_bert_kind}, {"llama", make_llama_kind}};

}  // namespace

torch::Tensor TrainableModel::loss(const Batch&) {
  throw Error("this model trains on BERT's sentence pairs; it was handed a batch of token windows");
}

torch::Tensor TrainableModel::loss(const BertBatch&) {
  throw Error("this model trains on token windows; it was handed a batch of BERT's sentence pairs");
}

BertSpecialTokens ModelKind::sentence_pair_specials() const {
  throw Error("sentence_pair_specials: the model does not train on BERT's sentence pairs");
}

std::unique_ptr<HfModelReader> ModelKind::hf_reader(const std::string&) const {
  throw ConfigError("model.init_from: this model.type reads no Hugging Face directory");
}

std::vector<std::string> model_kind_types() {
  std::vector<std::string> types;
  for (const Entry& entry : kKinds) types.push_back(entry.type);
  return types;
}

std::optional<ModelFigures> estimate_figures_of(const TrainConfig& config, int tensor_parallel) {
  const std::unique_ptr<ModelKind> kind = make_model_kind(config);
  const int64_t seq = config.data.sequence_length > 0 ? config.data.sequence_length : kind->context_length();
  return kind->estimate_figures(seq, config.zero.stage3_param_persistence_threshold, tensor_parallel);
}

std::unique_ptr<ModelKind> make_model_kind(const TrainConfig& config) {
  for (const Entry& entry : kKinds)
    if (config.model.type == entry.type) return entry.make(config);
  throw ConfigError(fmt::format("model.type: expected one of {}, found \"{}\"", fmt::join(model_kind_types(), ", "),
                                config.model.type));
}

}  // namespace zt
