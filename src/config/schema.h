// Internal to src/config: the table of every configuration key zerotrain knows, with its type,
// range, DeepSpeed default and where it lands in TrainConfig. One table drives parsing, type
// errors, unknown-key suggestions, the resolved/sources maps and the support matrix, so adding a
// key is one line and the error messages stay consistent.
#pragma once
#include <nlohmann/json.hpp>

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "zerotrain/config/config.h"

namespace zt::config_detail {

using json = nlohmann::json;

enum class Kind {
  Bool,
  Int,        // JSON integer, or a float with an integral value (DeepSpeed configs write 5e8)
  Number,
  String,
  Betas,      // [b1, b2], each in [0, 1)
  BatchSize,  // positive integer or "auto" (derived from the other two batch keys)
  StringList, // a JSON array of strings (empty allowed)
  AutoOrStringList,  // "auto" or a JSON array of strings
  Object,     // a whole DeepSpeed feature block zerotrain does not implement, read only for
              // whether it switches the feature on (Leaf::engaged); its inner keys are not checked
};

// What zerotrain does with a key (docs/config.md "Policy").
enum class Status {
  Honoured,   // read by zerotrain
  Reporting,  // a DeepSpeed report zerotrain does not produce: accepted, named in one warning when set
  Inert,      // cannot change a zerotrain run (it picks a DeepSpeed kernel, tunes a DeepSpeed-only
              // mechanism): accepted, a note when set
  Reserved,   // would change the training and is not implemented: only the default is accepted
};

// How DeepSpeed treats a key it does not know inside a block, which zerotrain follows.
enum class Strictness {
  Strict,   // a pydantic model with extra="forbid", a constructor's keyword arguments, or one of
            // zerotrain's own blocks: an error with a suggestion
  Lenient,  // read with dict.get: an unknown key is ignored, so zerotrain warns and goes on
};

struct Leaf {
  std::string path;  // dotted, e.g. "zero_optimization.stage"
  Kind kind = Kind::Number;
  json def;          // DeepSpeed's default (or ours where DeepSpeed has none)
  std::optional<double> lo, hi;  // inclusive unless *_open
  bool lo_open = false, hi_open = false;
  std::vector<std::string> choices;  // allowed strings; empty: any
  bool case_insensitive = false;     // choices compare ignoring case; stored canonical
  bool nullable = false;             // JSON null accepted (DeepSpeed's None)
  // false: a DeepSpeed key we recognise but do not implement yet; only its default is accepted
  // (validate_support). Known, so a DeepSpeed config that spells it out still parses.
  bool supported = true;
  Status status = Status::Honoured;
  // What the DeepSpeed feature is, for the message of a refused, noted or ignored key
  // ("gradient reduction in another dtype").
  std::string about;
  // Whether a value switches on what `about` describes; null: any value but the default does.
  std::function<bool(const json&)> engaged;
  std::function<void(TrainConfig&, const json&)> assign;  // null: handled by derivation code

  std::string expected() const;  // "a positive number", "one of \"log\", \"linear\"", ...
};

// Limits that make any input, however large or damaged, a one-line ConfigError: a configuration
// (file or override) is a few kilobytes; nesting deeper than the schema's three levels plus a
// value is not a configuration; string values are names and paths.
constexpr size_t kMaxConfigBytes = size_t{1} << 20;
constexpr int kMaxNestingDepth = 16;
constexpr size_t kMaxStringBytes = 4096;

const std::vector<Leaf>& leaves();
const Leaf* find_leaf(const std::string& path);
// True for a block path ("optimizer", "optimizer.params"): a proper prefix of some leaf path.
bool is_block(const std::string& path);
// Names valid directly inside a block ("" = top level), in table order.
std::vector<std::string> children(const std::string& block);

// How unknown keys inside `block` are treated ("" is the top level: see config.cpp).
Strictness strictness(const std::string& block);
// True for a block DeepSpeed reads with a pydantic model: "auto" there means the default
// (DeepSpeedConfigModel drops "auto" values).
bool pydantic_block(const std::string& block);
// Whether `value` (checked) switches on the leaf's feature (Leaf::engaged, else value != default).
bool engaged(const Leaf& leaf, const json& value);

// Checks `value` against the leaf and returns it normalised (ints as int64, numbers as double,
// choices in canonical spelling). Throws ConfigError "path: expected ..., found ...".
json check_value(const Leaf& leaf, const json& value);

size_t edit_distance(const std::string& a, const std::string& b);  // Levenshtein
// The nearest candidate by edit distance, when close enough to be a plausible typo.
std::optional<std::string> nearest(const std::string& word, const std::vector<std::string>& candidates);
// "unknown key 'a.b' — did you mean 'a.c'?" (or the list of valid keys at that level).
[[noreturn]] void throw_unknown_key(const std::string& block, const std::string& key);

// Compact JSON text for messages, truncated when long.
std::string show(const json& value);
std::string join_path(const std::string& block, const std::string& key);

using Values = std::map<std::string, json>;  // dotted leaf path -> normalised value

// "auto" values (the Hugging Face convention): `autos` are the keys given as "auto"; each gets
// the value of its rule (docs/config.md "auto"), or DeepSpeed's default.
bool has_auto_rule(const std::string& path);
void resolve_auto(TrainConfig& config, Values& values, const std::vector<std::string>& autos);
// Batch triple, optimizer type, scheduler defaults that depend on other keys, precision.
void derive(TrainConfig& config, Values& values);
// Cross-key checks that are about meaning, not about what is implemented.
void validate_semantics(const TrainConfig& config, const Values& values);
// The grid's keys (tensor groups, the stage-3 secondary partition) against the world, the model
// and the features (process_grid.cpp); part of validate_semantics.
void validate_process_grid(const TrainConfig& config);
// The support matrix: everything zerotrain does not implement yet, in one place, so later work
// widens it here. Throws ConfigError "... is not supported yet (supported: ...)".
void validate_support(const TrainConfig& config, const Values& values);

// Whether the user wrote `key`, in the file or on the command line, "auto" included: a key so
// written is not derived again.
bool written_by_user(const TrainConfig& c, const std::string& key);
// Whether the user chose the value of `key`: written with a value, not "auto".
bool value_chosen_by_user(const TrainConfig& c, const std::string& key);

}  // namespace zt::config_detail
