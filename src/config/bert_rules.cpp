// The BERT's side of reading a configuration (config/model_rules.h).
#include <fmt/format.h>

#include "config/model_rules.h"
#include "zerotrain/config/bert_config.h"
#include "zerotrain/error.h"

namespace zt::config_detail {
namespace {

void validate_bert(const TrainConfig& c) {
  if (c.activation_checkpointing.policy == "auto")
    throw ConfigError("activation_checkpointing.policy: expected \"none\", \"selective\" or \"full\" with model.type "
                      "\"bert\", found \"auto\" (the memory estimate that chooses models the GPT only)");
  const BertConfig bert = bert_config_of(c);  // the preset (listing the valid ones) and the shape
  const int64_t seq = c.data.sequence_length;
  if (seq > bert.max_positions)
    throw ConfigError(fmt::format("data.sequence_length: expected at most the BERT's max_positions {} (model.preset "
                                  "\"{}\"{}), found {}",
                                  bert.max_positions, c.model.preset,
                                  c.model.context_length > 0 ? ", model.context_length" : "", seq));
  if (seq > 0 && seq < 5)
    throw ConfigError(fmt::format(
        "data.sequence_length: expected at least 5 with model.type \"bert\" ([CLS] A [SEP] B [SEP]), found {}", seq));
}

}  // namespace

const ModelRules& bert_rules() {
  static const ModelRules rules = [] {
    ModelRules r;
    r.type = "bert";
    r.default_preset = "bert-tiny";  // the GPT's default "tiny" is no BERT preset
    r.own_keys = {{"model.pre_layer_norm", ""},
                  {"model.next_sentence", ""},
                  {"data.mlm_probability", ""},
                  {"data.max_predictions", ""},
                  {"model.dropout", ""}};
    r.refusal_reasons = {{"model.loss_chunk_tokens", "the BERT's MLM head projects only the masked positions"},
                         {"data.tokenizer", "the BERT reads bytes or its own uint16 token files"}};
    r.hidden = [](const TrainConfig& c) { return c.model.n_embd > 0 ? c.model.n_embd : bert_config_of(c).hidden; };
    r.tensor_split_sizes = [](const TrainConfig& c) {
      const BertConfig b = bert_config_of(c);
      return std::vector<std::pair<const char*, int64_t>>{{"model.n_head", b.n_head}, {"model.vocab_size", b.vocab_size}};
    };
    r.validate = validate_bert;
    return r;
  }();
  return rules;
}

}  // namespace zt::config_detail
