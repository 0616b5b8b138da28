// The GPT's side of reading a configuration (config/model_rules.h).
#include "config/model_rules.h"
#include "zerotrain/config/gpt_config.h"

namespace zt::config_detail {
namespace {

// The preset with the model block's overrides, as far as the configuration needs it.
GPTConfig shape_of(const TrainConfig& c) {
  GPTConfig g = gpt_preset(c.model.preset);
  if (c.model.n_head > 0) g.n_head = c.model.n_head;
  if (c.model.vocab_size > 0) g.vocab_size = c.model.vocab_size;
  if (c.model.n_embd > 0) g.n_embd = c.model.n_embd;
  return g;
}

}  // namespace

const ModelRules& gpt_rules() {
  static const ModelRules rules = [] {
    ModelRules r;
    r.type = "gpt";
    r.own_keys = {{"model.loss_chunk_tokens", ""},
                  {"model.dropout", ""},
                  {"model.init_from", "Hugging Face GPT-2 directories"},
                  {"data.pack", ""},
                  {"data.tokenizer", ""}};
    r.flops_profiled = true;
    r.hidden = [](const TrainConfig& c) { return shape_of(c).n_embd; };
    r.tensor_split_sizes = [](const TrainConfig& c) {
      const GPTConfig g = shape_of(c);
      return std::vector<std::pair<const char*, int64_t>>{{"model.n_head", g.n_head}, {"model.vocab_size", g.vocab_size}};
    };
    return r;
  }();
  return rules;
}

}  // namespace zt::config_detail
