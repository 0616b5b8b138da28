// The Llama-family decoder's side of reading a configuration (config/model_rules.h).
#include <fmt/format.h>

#include "config/model_rules.h"
#include "config/schema.h"
#include "zerotrain/config/llama_config.h"
#include "zerotrain/error.h"

namespace zt::config_detail {
namespace {

// The shape from a preset and its overrides or from a Hugging Face directory, never both. A
// directory's config.json is read where the model is built and before launch (zerotrain train's
// check of its inputs), not here.
void validate_llama(const TrainConfig& c) {
  const ActivationCheckpointingConfig& ac = c.activation_checkpointing;
  if (ac.policy == "auto" || ac.policy == "selective")
    throw ConfigError(fmt::format("activation_checkpointing.policy: expected \"none\" or \"full\" with model.type "
                                  "\"llama\", found \"{}\" ({})",
                                  ac.policy,
                                  ac.policy == "auto" ? "the memory estimate that chooses models the GPT only"
                                                      : "its attention core and SwiGLU are not split out for "
                                                        "recomputation"));
  if (ac.policy != "none")
    for (const auto& [key, on] : {std::pair{"activation_checkpointing.contiguous_memory_optimization",
                                            ac.contiguous_memory_optimization},
                                  std::pair{"activation_checkpointing.profile", ac.profile}})
      if (on) throw ConfigError(fmt::format("{}: not implemented for model.type \"llama\" (expected false, found true)", key));
  const bool init = !c.model.init_from.empty(), shape_only = !c.model.config_from.empty();
  if (init && shape_only)
    throw ConfigError(fmt::format("model.config_from: expected at most one of model.init_from and model.config_from, "
                                  "found both ('{}', '{}'); model.init_from gives the shape too",
                                  c.model.init_from, c.model.config_from));
  if (init || shape_only) {
    const std::string dir_key = init ? "model.init_from" : "model.config_from";
    for (const char* key : {"model.preset", "model.n_layer", "model.n_head", "model.n_kv_head", "model.n_embd",
                            "model.intermediate_size", "model.vocab_size", "model.context_length"})
      if (written_by_user(c, key))
        throw ConfigError(fmt::format("{}: expected no shape beside {} (the directory's config.json is the shape), "
                                      "found it given",
                                      key, dir_key));
    return;
  }
  const LlamaConfig llama = llama_config_of(c);  // the preset (listing the valid ones) and the shape
  if (c.data.sequence_length > llama.max_position_embeddings)
    throw ConfigError(fmt::format("data.sequence_length: expected at most the Llama's max_position_embeddings {} "
                                  "(model.preset \"{}\"{}), found {}",
                                  llama.max_position_embeddings, c.model.preset,
                                  c.model.context_length > 0 ? ", model.context_length" : "", c.data.sequence_length));
}

}  // namespace

const ModelRules& llama_rules() {
  static const ModelRules rules = [] {
    ModelRules r;
    r.type = "llama";
    r.default_preset = "llama-tiny";  // unused when a Hugging Face directory gives the shape
    r.own_keys = {{"model.n_kv_head", ""},
                  {"model.intermediate_size", ""},
                  {"model.config_from", ""},
                  {"model.init_from", "LlamaForCausalLM, Qwen2ForCausalLM"},
                  {"data.pack", ""},
                  {"data.tokenizer", ""}};
    r.refusal_reasons = {{"model.dropout", "the Llama-family decoder has no dropout"}};
    r.hidden = [](const TrainConfig& c) { return c.model.n_embd > 0 ? c.model.n_embd : llama_config_of(c).hidden_size; };
    // From the preset and keys; with model.config_from, its config.json (a tensor-parallel run
    // refuses model.init_from before it asks).
    r.tensor_split_sizes = [](const TrainConfig& c) {
      const LlamaConfig l = llama_config_of(c);
      return std::vector<std::pair<const char*, int64_t>>{{"model.n_head", l.num_attention_heads},
                                                          {"model.n_kv_head", l.num_key_value_heads},
                                                          {"model.intermediate_size", l.intermediate_size},
                                                          {"model.vocab_size", l.vocab_size}};
    };
    r.validate = validate_llama;
    return r;
  }();
  return rules;
}

}  // namespace zt::config_detail
