// The key table, assembled from its sections (schema_*.cpp: DeepSpeed's names and defaults,
// docs/config.md "Keys"), and the generic value checks.
#include "config/schema.h"
#include "config/schema_keys.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cmath>
#include <limits>
#include <set>
#include <stdexcept>
#include <tuple>
#include <utility>

#include "zerotrain/error.h"

namespace zt::config_detail {
namespace {

// The sections in the table's order: the order of the resolved and sources maps and of the
// support matrix.
std::vector<Leaf> build_table() {
  std::vector<Leaf> t;
  keys::add_top_level_keys(t);
  keys::add_feature_block_keys(t);
  keys::add_optimizer_keys(t);
  keys::add_scheduler_keys(t);
  keys::add_zero_keys(t);
  keys::add_zero_variant_keys(t);
  keys::add_offload_keys(t);
  keys::add_precision_keys(t);
  keys::add_monitor_keys(t);
  keys::add_report_keys(t);
  keys::add_activation_checkpointing_keys(t);
  keys::add_aio_keys(t);
  keys::add_zerotrain_keys(t);
  return t;
}

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char ch) { return std::tolower(ch); });
  return s;
}

std::string fmt_bound(double v) {
  if (std::abs(v) >= 1e15 || v != std::floor(v)) return fmt::format("{}", v);
  return fmt::format("{}", static_cast<int64_t>(v));
}

}  // namespace

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t sub = prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1);
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, sub});
    }
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

const std::vector<Leaf>& leaves() {
  static const std::vector<Leaf> table = build_table();
  return table;
}

const Leaf* find_leaf(const std::string& path) {
  static const std::map<std::string, const Leaf*> index = [] {
    std::map<std::string, const Leaf*> m;
    for (const Leaf& leaf : leaves()) m.emplace(leaf.path, &leaf);
    return m;
  }();
  auto it = index.find(path);
  return it == index.end() ? nullptr : it->second;
}

bool is_block(const std::string& path) {
  if (path.empty()) return true;
  const std::string prefix = path + ".";
  return std::any_of(leaves().begin(), leaves().end(),
                     [&](const Leaf& leaf) { return leaf.path.starts_with(prefix); });
}

std::vector<std::string> children(const std::string& block) {
  const std::string prefix = block.empty() ? "" : block + ".";
  std::vector<std::string> names;
  for (const Leaf& leaf : leaves()) {
    if (!leaf.path.starts_with(prefix)) continue;
    std::string rest = leaf.path.substr(prefix.size());
    std::string name = rest.substr(0, rest.find('.'));
    if (std::find(names.begin(), names.end(), name) == names.end()) names.push_back(name);
  }
  return names;
}

Strictness strictness(const std::string& block) {
  // DeepSpeed reads these with dict.get (get_scalar_param): a key it does not know is ignored.
  static const std::set<std::string> lenient = {"optimizer",  "scheduler", "activation_checkpointing",
                                                "flops_profiler", "aio",    "checkpoint",
                                                "data_types", "timers",    "checkpoint.parallel_write"};
  return lenient.count(block) ? Strictness::Lenient : Strictness::Strict;
}

bool pydantic_block(const std::string& block) {
  static const std::set<std::string> models = {
      "zero_optimization", "zero_optimization.offload_optimizer", "zero_optimization.offload_param",
      "fp16",              "bf16",                                "tensorboard",
      "wandb",             "comet",                               "csv_monitor",
      "comms_logger",      "timers.throughput"};
  return models.count(block) > 0;
}

bool engaged(const Leaf& leaf, const json& value) {
  if (leaf.engaged) return leaf.engaged(value);
  if (value.is_number() && leaf.def.is_number()) return value.get<double>() != leaf.def.get<double>();
  return value != leaf.def;
}

std::string Leaf::expected() const {
  std::string text;
  switch (kind) {
    case Kind::Bool: text = "true or false"; break;
    case Kind::Betas: text = "two numbers in [0, 1)"; break;
    case Kind::BatchSize: text = "a positive integer or \"auto\""; break;
    case Kind::StringList: text = "a list of strings"; break;
    case Kind::AutoOrStringList: text = "\"auto\" or a list of strings"; break;
    case Kind::Object: text = "an object (a block of settings)"; break;
    case Kind::String:
      if (choices.empty()) {
        text = "a string";
      } else {
        text = "one of";
        for (size_t i = 0; i < choices.size(); ++i) text += (i ? ", \"" : " \"") + choices[i] + "\"";
      }
      break;
    case Kind::Int:
    case Kind::Number: {
      const bool is_int = kind == Kind::Int;
      const char* noun = is_int ? "integer" : "number";
      if (lo && hi) {
        text = fmt::format("{} {} in {}{}, {}{}", is_int ? "an" : "a", noun, lo_open ? "(" : "[", fmt_bound(*lo),
                           fmt_bound(*hi), hi_open ? ")" : "]");
      } else if (lo && *lo == 0 && lo_open) {
        text = fmt::format("a positive {}", noun);
      } else if (lo && *lo == 0) {
        text = fmt::format("a non-negative {}", noun);
      } else if (lo && *lo == 1 && is_int) {
        text = "a positive integer";
      } else if (lo) {
        text = fmt::format("{} {} {} {}", is_int ? "an" : "a", noun, lo_open ? ">" : ">=", fmt_bound(*lo));
      } else {
        text = is_int ? "an integer" : "a number";
      }
      break;
    }
  }
  if (nullable) text += " or null";
  return text;
}

json check_value(const Leaf& leaf, const json& value) {
  auto fail = [&](const std::string& extra = "") -> json {
    throw ConfigError(fmt::format("{}: expected {}, found {}{}", leaf.path, leaf.expected(), show(value), extra));
  };
  if (value.is_null() && leaf.nullable) return value;
  auto in_range = [&](double v) {
    if (leaf.lo && (leaf.lo_open ? v <= *leaf.lo : v < *leaf.lo)) return false;
    if (leaf.hi && (leaf.hi_open ? v >= *leaf.hi : v > *leaf.hi)) return false;
    return std::isfinite(v);
  };
  auto as_int = [&](const json& v) -> std::optional<int64_t> {
    if (v.is_number_integer()) {
      if (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) return std::nullopt;
      return v.get<int64_t>();
    }
    if (v.is_number_float()) {
      double d = v.get<double>();
      if (std::isfinite(d) && d == std::floor(d) && std::abs(d) < 9.2e18) return static_cast<int64_t>(d);
    }
    return std::nullopt;
  };
  switch (leaf.kind) {
    case Kind::Bool:
      if (!value.is_boolean()) fail();
      return value;
    case Kind::Int: {
      auto v = as_int(value);
      if (!v || !in_range(static_cast<double>(*v))) fail();
      return *v;
    }
    case Kind::Number:
      if (!value.is_number() || !in_range(value.get<double>())) fail();
      return value.get<double>();
    case Kind::BatchSize: {
      if (value.is_string() && value.get<std::string>() == "auto") return value;
      auto v = as_int(value);
      if (!v || *v < 1) fail();
      return *v;
    }
    case Kind::Object:
      if (!value.is_object()) fail();
      return value;
    case Kind::AutoOrStringList:
    case Kind::StringList: {
      if (leaf.kind == Kind::AutoOrStringList && value.is_string() && value.get<std::string>() == "auto") return value;
      if (!value.is_array()) fail();
      for (const json& item : value) {
        if (!item.is_string() || item.get_ref<const std::string&>().size() > kMaxStringBytes) fail();
        const std::string& s = item.get_ref<const std::string&>();
        if (std::any_of(s.begin(), s.end(), [](unsigned char ch) { return ch < 0x20 || ch == 0x7f; }))
          fail(" (control characters are not allowed)");
      }
      return value;
    }
    case Kind::Betas: {
      if (!value.is_array() || value.size() != 2) fail();
      for (const json& b : value)
        if (!b.is_number() || b.get<double>() < 0 || b.get<double>() >= 1) fail();
      return json::array({value[0].get<double>(), value[1].get<double>()});
    }
    case Kind::String: {
      if (!value.is_string()) fail();
      const std::string& s = value.get_ref<const std::string&>();
      // Names and paths: a control character (a NUL would cut a path short) or a megabyte of
      // text is a damaged file, not a setting.
      if (s.size() > kMaxStringBytes)
        throw ConfigError(fmt::format("{}: expected {} of at most {} bytes, found one of {} bytes", leaf.path,
                                      leaf.expected(), kMaxStringBytes, s.size()));
      if (std::any_of(s.begin(), s.end(), [](unsigned char ch) { return ch < 0x20 || ch == 0x7f; }))
        fail(" (control characters are not allowed)");
      if (leaf.choices.empty()) return value;
      for (const std::string& choice : leaf.choices)
        if (choice == s || (leaf.case_insensitive && lower(choice) == lower(s))) return choice;
      if (auto near = nearest(s, leaf.choices)) return fail(fmt::format(" — did you mean \"{}\"?", *near));
      return fail();
    }
  }
  return fail();
}

std::optional<std::string> nearest(const std::string& word, const std::vector<std::string>& candidates) {
  std::optional<std::string> best;
  size_t best_distance = SIZE_MAX;
  for (const std::string& c : candidates) {
    if (c.empty()) continue;
    size_t d = edit_distance(lower(word), lower(c));
    if (d < best_distance) best_distance = d, best = c;
  }
  if (!best) return std::nullopt;
  // "Reasonably close": about one edit per four characters, at least one; a two-letter word
  // two edits away from another is no evidence of a typo.
  const size_t len = std::max(word.size(), best->size());
  const size_t limit = std::max<size_t>(1, len / 4);
  if (best_distance == 0 || best_distance > limit) return std::nullopt;
  return best;
}

void throw_unknown_key(const std::string& block, const std::string& key_in) {
  // The key is the user's text: escaped and shortened so that the message stays one short line.
  std::string key = show(json(key_in));
  key = key.substr(1, key.size() - (key.ends_with("\"") ? 2 : 1));
  const std::string path = join_path(block, key);
  if (find_leaf(block))
    throw ConfigError(fmt::format("unknown key '{}' ('{}' is a value, not a block of settings)", path, block));
  const std::vector<std::string> valid = children(block);
  if (auto near = key_in.size() <= 64 ? nearest(key_in, valid) : std::nullopt)
    throw ConfigError(fmt::format("unknown key '{}' — did you mean '{}'?", path, join_path(block, *near)));
  // The list stays one readable line: the first names, then how many more (docs/config.md has all).
  std::string list;
  size_t shown = 0;
  for (const std::string& name : valid) {
    if (list.size() + name.size() > 200) break;
    list += (list.empty() ? "" : ", ") + name;
    ++shown;
  }
  if (shown < valid.size()) list += fmt::format(", ... ({} more; docs/config.md lists every key)", valid.size() - shown);
  throw ConfigError(fmt::format("unknown key '{}' (valid keys {}: {})", path,
                                block.empty() ? "at the top level" : "in '" + block + "'", list));
}

std::string show(const json& value) {
  std::string text = value.dump(-1, ' ', false, json::error_handler_t::replace);
  if (text.size() > 60) {
    text.resize(57);
    text += "...";
  }
  return text;
}

std::string join_path(const std::string& block, const std::string& key) {
  return block.empty() ? key : block + "." + key;
}

bool written_by_user(const TrainConfig& c, const std::string& key) {
  auto it = c.sources.find(key);
  return it != c.sources.end() && (it->second == ValueSource::File || it->second == ValueSource::CommandLine ||
                                   it->second == ValueSource::Auto);
}

bool value_chosen_by_user(const TrainConfig& c, const std::string& key) {
  auto it = c.sources.find(key);
  return it != c.sources.end() && (it->second == ValueSource::File || it->second == ValueSource::CommandLine);
}

}  // namespace zt::config_detail
