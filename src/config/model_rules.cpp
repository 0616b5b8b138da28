// The registry of the configuration layer's model rules (config/model_rules.h): one line per
// model.type.
#include "config/model_rules.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

#include "config/schema.h"
#include "zerotrain/error.h"

namespace zt::config_detail {
namespace {

using RulesOf = const ModelRules& (*)();
constexpr RulesOf kRules[] = {gpt_rules, bert_rules, llama_rules};

}  // namespace

const ModelRules& model_rules(const std::string& type) {
  std::vector<std::string> types;
  for (RulesOf rules : kRules) {
    if (rules().type == type) return rules();
    types.push_back(rules().type);
  }
  throw ConfigError(fmt::format("model.type: expected one of {}, found \"{}\"", fmt::join(types, ", "), type));
}

void refuse_keys_of_other_models(const TrainConfig& c) {
  const ModelRules& mine = model_rules(c.model.type);
  // Every key some type reads, in the registry's order, with the types that read it.
  std::vector<std::pair<std::string, std::vector<std::string>>> readers;
  for (RulesOf rules : kRules)
    for (const auto& own : rules().own_keys) {
      const std::string& key = own.first;
      auto it = std::find_if(readers.begin(), readers.end(), [&key](const auto& r) { return r.first == key; });
      if (it == readers.end()) it = readers.insert(readers.end(), {key, {}});
      it->second.push_back(own.second.empty() ? fmt::format("\"{}\"", rules().type)
                                              : fmt::format("\"{}\" ({})", rules().type, own.second));
    }
  for (const auto& reader : readers) {
    const std::string& key = reader.first;
    const std::vector<std::string>& types = reader.second;
    const bool read = std::any_of(mine.own_keys.begin(), mine.own_keys.end(), [&key](const auto& k) { return k.first == key; });
    if (read || !written_by_user(c, key)) continue;
    const std::string whom = types.size() == 1 ? types[0] + " only"
                                               : fmt::format("{} and {}", fmt::join(types.begin(), types.end() - 1, ", "),
                                                             types.back());
    const auto reason = mine.refusal_reasons.find(key);
    throw ConfigError(fmt::format("{}: applies to model.type {}, found model.type \"{}\"{}", key, whom, c.model.type,
                                  reason == mine.refusal_reasons.end() ? "" : " (" + reason->second + ")"));
  }
}

}  // namespace zt::config_detail
