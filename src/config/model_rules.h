// Internal to src/config: what the configuration layer knows of each model.type — the model's side
// of reading a configuration. One ModelRules per type (src/config/<name>_rules.cpp), found by
// model_rules(); derive.cpp, process_grid.cpp and config.cpp ask it rather than the type's name.
// The built model's side is zerotrain/models/model_kind.h, in the models layer.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "zerotrain/config/config.h"

namespace zt::config_detail {

struct ModelRules {
  std::string type;            // model.type
  std::string default_preset;  // model.preset when the user gives none
  // The keys that only some model types read, each with what this type reads of it ("" for
  // nothing to add): given with a type that does not list it, a key is refused, naming the types
  // that read it (refuse_keys_of_other_models).
  std::vector<std::pair<std::string, std::string>> own_keys;
  // Why this type does not read a key another type lists, where there is more to say than that.
  std::map<std::string, std::string> refusal_reasons;
  bool flops_profiled = false;  // the flops profiler's FLOPs model covers it
  // The model's width, for the bucket sizes Hugging Face derives from hidden_size.
  int64_t (*hidden)(const TrainConfig&) = nullptr;
  // The sizes a tensor group splits evenly, as (key, value).
  std::vector<std::pair<const char*, int64_t>> (*tensor_split_sizes)(const TrainConfig&) = nullptr;
  // The type's own cross-key checks (its shape against the data, its refusals).
  void (*validate)(const TrainConfig&) = nullptr;
};

// zt::ConfigError naming the known types for another one.
const ModelRules& model_rules(const std::string& type);
// Refuses a key given that c.model.type does not read and another type does.
void refuse_keys_of_other_models(const TrainConfig& c);

const ModelRules& gpt_rules();
const ModelRules& bert_rules();
const ModelRules& llama_rules();

}  // namespace zt::config_detail
