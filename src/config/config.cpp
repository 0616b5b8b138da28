// Parsing: JSON text -> overrides -> unknown-key walk -> typed leaves -> derivation -> validation.
// Every step throws ConfigError with one line naming the key; nothing is silently dropped.
#include "zerotrain/config.h"

#include <fmt/format.h>

#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "config/schema.h"
#include "zerotrain/error.h"

namespace zt {

using config_detail::json;
namespace cd = config_detail;

const char* to_string(Precision precision) {
  switch (precision) {
    case Precision::FP32: return "fp32";
    case Precision::BF16: return "bf16";
    case Precision::FP16: return "fp16";
  }
  return "?";
}

const char* to_string(ValueSource source) {
  switch (source) {
    case ValueSource::Default: return "default";
    case ValueSource::File: return "file";
    case ValueSource::CommandLine: return "command line";
    case ValueSource::Derived: return "derived";
  }
  return "?";
}

namespace {

std::vector<std::string> split_path(const std::string& path) {
  std::vector<std::string> parts;
  std::string part;
  std::istringstream in(path);
  while (std::getline(in, part, '.')) parts.push_back(part);
  if (!path.empty() && path.back() == '.') parts.emplace_back();
  return parts;
}

json parse_json(const std::string& text, const std::string& origin) {
  if (text.find_first_not_of(" \t\r\n") == std::string::npos) return json::object();
  try {
    // Comments are accepted: example configs explain themselves; plain JSON is unaffected.
    return json::parse(text, nullptr, true, /*ignore_comments=*/true);
  } catch (const json::parse_error& e) {
    // nlohmann's text carries "parse error at line L, column C: ..."; drop its id prefix.
    std::string what = e.what();
    if (auto pos = what.find("] "); what.starts_with("[json.exception") && pos != std::string::npos)
      what = what.substr(pos + 2);
    throw ConfigError(fmt::format("{}: invalid JSON: {}", origin, what));
  }
}

// Records the source of every leaf present under `node` (the block at `block`) and rejects
// unknown keys and blocks given as non-objects.
void walk(const json& node, const std::string& block, ValueSource source,
          std::map<std::string, ValueSource>& sources) {
  for (const auto& [key, value] : node.items()) {
    const std::string path = cd::join_path(block, key);
    if (cd::find_leaf(path)) {
      sources[path] = source;
    } else if (cd::is_block(path)) {
      if (!value.is_object())
        throw ConfigError(fmt::format("{}: expected an object (a block of settings), found {}", path, cd::show(value)));
      walk(value, path, source, sources);
    } else {
      cd::throw_unknown_key(block, key);
    }
  }
}

// "key.path=value": the value is JSON when it parses as JSON, else the literal string, so
// `--set scheduler.type=WarmupLR` needs no quoting and `--set optimizer.params.lr=3e-4` is a number.
void apply_override(json& doc, const std::string& text, std::map<std::string, ValueSource>& sources) {
  const auto eq = text.find('=');
  if (eq == std::string::npos || eq == 0)
    throw ConfigError(fmt::format("override '{}': expected key.path=value", text));
  const std::string path = text.substr(0, eq);
  const std::string raw = text.substr(eq + 1);

  const std::vector<std::string> parts = split_path(path);
  std::string block;
  json* node = &doc;
  for (size_t i = 0; i < parts.size(); ++i) {
    const std::string here = cd::join_path(block, parts[i]);
    const bool last = i + 1 == parts.size();
    if (parts[i].empty() || !(cd::find_leaf(here) || cd::is_block(here))) cd::throw_unknown_key(block, parts[i]);
    if (!last) {
      if (cd::find_leaf(here)) cd::throw_unknown_key(here, parts[i + 1]);  // path goes below a leaf
      json& child = (*node)[parts[i]];
      if (child.is_null()) child = json::object();
      if (!child.is_object())
        throw ConfigError(fmt::format("{}: expected an object (a block of settings), found {}", here, cd::show(child)));
      node = &child;
    }
    block = here;
  }

  json value = json::parse(raw, nullptr, /*allow_exceptions=*/false, /*ignore_comments=*/true);
  if (value.is_discarded()) value = raw;
  if (cd::find_leaf(path)) {
    (*node)[parts.back()] = value;
    sources[path] = ValueSource::CommandLine;
    return;
  }
  // A whole block: its object replaces the block's keys one by one (others stay).
  if (!value.is_object())
    throw ConfigError(fmt::format("{}: expected an object (a block of settings), found {}", path, cd::show(value)));
  walk(value, path, ValueSource::CommandLine, sources);
  json& target = (*node)[parts.back()];
  if (!target.is_object()) target = json::object();
  target.merge_patch(value);
}

// A DeepSpeed scheduler we do not implement (OneCycle, ...) has its own parameter names; they
// are not in the table, and reporting them as unknown keys would hide the real problem, which
// validate_support reports: the scheduler type itself.
void drop_params_of_unimplemented_scheduler(json& doc) {
  if (!doc.contains("scheduler") || !doc["scheduler"].is_object()) return;
  json& scheduler = doc["scheduler"];
  if (!scheduler.contains("type") || !scheduler["type"].is_string()) return;
  const std::string type = scheduler["type"].get<std::string>();
  if ((type == "OneCycle" || type == "LRRangeTest") && scheduler.contains("params")) scheduler.erase("params");
}

const json* lookup(const json& doc, const std::string& path) {
  const json* node = &doc;
  for (const std::string& part : split_path(path)) {
    if (!node->is_object()) return nullptr;
    auto it = node->find(part);
    if (it == node->end()) return nullptr;
    node = &*it;
  }
  return node;
}

TrainConfig build(json doc, const std::vector<std::string>& overrides, int world_size, const std::string& origin) {
  if (world_size < 1) throw ConfigError(fmt::format("world size: expected a positive integer, found {}", world_size));
  if (!doc.is_object())
    throw ConfigError(fmt::format("{}: expected a JSON object at the top level, found {}", origin, cd::show(doc)));

  TrainConfig config;
  config.world_size = world_size;
  std::map<std::string, ValueSource> given;
  drop_params_of_unimplemented_scheduler(doc);
  walk(doc, "", ValueSource::File, given);
  for (const std::string& text : overrides) apply_override(doc, text, given);  // before validation
  drop_params_of_unimplemented_scheduler(doc);

  cd::Values values;
  for (const cd::Leaf& leaf : cd::leaves()) {
    const json* raw = lookup(doc, leaf.path);
    if (raw) {
      values[leaf.path] = cd::check_value(leaf, *raw);
      config.sources[leaf.path] = given.count(leaf.path) ? given[leaf.path] : ValueSource::File;
    } else {
      values[leaf.path] = leaf.def;
      config.sources[leaf.path] = ValueSource::Default;
    }
    if (leaf.assign) leaf.assign(config, values[leaf.path]);
  }

  cd::derive(config, values);
  cd::validate_semantics(config, values);
  cd::validate_support(config, values);
  for (const auto& [path, value] : values) config.resolved[path] = value.dump();
  return config;
}

}  // namespace

TrainConfig parse_config(const std::string& json_text, const std::vector<std::string>& overrides, int world_size) {
  return build(parse_json(json_text, "config"), overrides, world_size, "config");
}

TrainConfig load_config(const std::string& path, const std::vector<std::string>& overrides, int world_size) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) throw ConfigError(fmt::format("config file '{}' not found", path));
  if (std::filesystem::is_directory(path, ec))
    throw ConfigError(fmt::format("config file '{}' is a directory, expected a JSON file", path));
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  if (!in.good() && !in.eof()) throw ConfigError(fmt::format("config file '{}' could not be read", path));
  return build(parse_json(text.str(), path), overrides, world_size, path);
}

std::string describe(const TrainConfig& config) {
  size_t key_width = 0, value_width = 0;
  for (const auto& [key, value] : config.resolved) {
    key_width = std::max(key_width, key.size());
    value_width = std::max(value_width, value.size());
  }
  value_width = std::min<size_t>(value_width, 24);  // a long path should not push every source right
  std::string out;
  for (const auto& [key, value] : config.resolved) {
    auto it = config.sources.find(key);
    const char* source = it == config.sources.end() ? "?" : to_string(it->second);
    out += fmt::format("{:<{}} = {:<{}}  ({})\n", key, key_width, value, value_width, source);
  }
  return out;
}

}  // namespace zt
