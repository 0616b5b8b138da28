// Parsing: JSON text -> overrides -> unknown-key walk -> typed leaves -> derivation -> validation.
// Every step throws ConfigError with one line naming the key; nothing is silently dropped.
#include "zerotrain/config.h"

#include <fmt/format.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
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

const char* to_string(OffloadDevice device) {
  switch (device) {
    case OffloadDevice::None: return "none";
    case OffloadDevice::Cpu: return "cpu";
    case OffloadDevice::Nvme: return "nvme";
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

// Printable ASCII only, shortened: parser messages quote the offending input, which may be
// binary or huge, and the message must stay one readable line.
std::string printable(const std::string& text, size_t limit = 200) {
  std::string out;
  for (unsigned char ch : text) {
    if (out.size() >= limit) {
      out += "...";
      break;
    }
    out += (ch >= 0x20 && ch < 0x7f) ? static_cast<char>(ch) : '?';
  }
  return out;
}

// Tracks where the parser is, so that nesting depth and duplicate keys (which nlohmann would
// silently resolve to the last value) are refused with the key's dotted path.
class StructureCheck {
 public:
  explicit StructureCheck(std::string origin) : origin_(std::move(origin)) {}

  bool operator()(int /*depth*/, json::parse_event_t event, json& parsed) {
    switch (event) {
      case json::parse_event_t::object_start:
      case json::parse_event_t::array_start: {
        if (static_cast<int>(frames_.size()) >= cd::kMaxNestingDepth)
          throw ConfigError(fmt::format("{}: nested more than {} levels deep at '{}' (not a configuration)", origin_,
                                        cd::kMaxNestingDepth, printable(child_path(), 80)));
        Frame frame;
        frame.path = child_path();
        frame.is_object = event == json::parse_event_t::object_start;
        frames_.push_back(std::move(frame));
        break;
      }
      case json::parse_event_t::object_end:
      case json::parse_event_t::array_end:
        if (!frames_.empty()) frames_.pop_back();
        break;
      case json::parse_event_t::key: {
        Frame& frame = frames_.back();
        frame.last_key = parsed.get<std::string>();
        if (!frame.keys.insert(frame.last_key).second)
          throw ConfigError(fmt::format("{}: duplicate key '{}' (each key may appear once)", origin_,
                                        printable(child_path(), 80)));
        break;
      }
      case json::parse_event_t::value:
        break;
    }
    return true;
  }

 private:
  struct Frame {
    std::string path;
    bool is_object = false;
    std::set<std::string> keys;
    std::string last_key;
  };
  std::string child_path() const {
    if (frames_.empty()) return "(top level)";
    const Frame& f = frames_.back();
    if (!f.is_object) return f.path + "[]";
    return f.path.empty() || f.path == "(top level)" ? f.last_key : f.path + "." + f.last_key;
  }
  std::string origin_;
  std::vector<Frame> frames_;
};

void check_size(size_t bytes, const std::string& origin) {
  if (bytes > cd::kMaxConfigBytes)
    throw ConfigError(fmt::format("{}: {} bytes, more than the {} bytes a configuration may have (not a configuration)",
                                  origin, bytes, cd::kMaxConfigBytes));
}

// JSON text -> document. `lenient`: text that is not JSON yields nullopt instead of an error
// (override values, where it then means a plain string); structure errors throw either way.
std::optional<json> parse_json_text(const std::string& text, const std::string& origin, bool lenient) {
  StructureCheck check(origin);
  try {
    // Comments are accepted: example configs explain themselves; plain JSON is unaffected.
    return json::parse(text, std::ref(check), /*allow_exceptions=*/true, /*ignore_comments=*/true);
  } catch (const json::exception& e) {  // parse_error, and out_of_range for 1e999
    if (lenient) return std::nullopt;
    // nlohmann's text carries "parse error at line L, column C: ..."; drop its id prefix.
    std::string what = e.what();
    if (auto pos = what.find("] "); what.starts_with("[json.exception") && pos != std::string::npos)
      what = what.substr(pos + 2);
    throw ConfigError(fmt::format("{}: invalid JSON: {}", origin, printable(what)));
  }
}

json parse_json(const std::string& text, const std::string& origin) {
  check_size(text.size(), origin);
  if (text.find_first_not_of(" \t\r\n") == std::string::npos) return json::object();
  return *parse_json_text(text, origin, false);
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
  check_size(text.size(), fmt::format("override '{}'", printable(text, 60)));
  const auto eq = text.find('=');
  if (eq == std::string::npos || eq == 0)
    throw ConfigError(fmt::format("override '{}': expected key.path=value", printable(text, 60)));
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

  std::optional<json> parsed = parse_json_text(raw, "override '" + printable(path, 60) + "'", /*lenient=*/true);
  json value = parsed ? std::move(*parsed) : json(raw);
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

bool given(const TrainConfig& c, const std::string& path) {
  auto it = c.sources.find(path);
  return it != c.sources.end() && (it->second == ValueSource::File || it->second == ValueSource::CommandLine);
}

// The offload keys that cannot matter in this configuration. zerotrain trains on the CPU (the
// CUDA build compiles GPU kernels but trains on the host), so the "cpu" tier is the memory in
// use already and page-locking it speeds nothing up.
template <typename Note>
void add_offload_notes(const TrainConfig& c, const Note& note_if_given) {
  const OffloadOptimizerConfig& opt = c.zero.offload_optimizer;
  const OffloadParamConfig& param = c.zero.offload_param;
  const std::string O = "zero_optimization.offload_optimizer.", P = "zero_optimization.offload_param.";
  const char* kNoPinning =
      "zerotrain trains on the CPU, whose memory needs no pinning (page-locked buffers only speed copies to a GPU)";
  if (opt.device == OffloadDevice::None) {
    note_if_given({O + "nvme_path", O + "pin_memory", O + "buffer_count", O + "pipeline_read", O + "pipeline_write",
                   O + "fast_init", O + "ratio", O + "delayed_update", O + "delayed_update_after", O + "nvme_gradients"},
                  "zero_optimization.offload_optimizer.device is \"none\"");
  } else {
    if (opt.device == OffloadDevice::Cpu) {
      if (!opt.delayed_update)
        note_if_given({O + "device"},
                      "zerotrain trains on the CPU, so the optimizer state is in host memory already (\"cpu\" moves "
                      "nothing; with delayed_update it still delays the step)");
      note_if_given({O + "nvme_path", O + "buffer_count", O + "pipeline_read", O + "pipeline_write", O + "fast_init",
                     O + "nvme_gradients"},
                    "zero_optimization.offload_optimizer.device is \"cpu\" (it applies to the nvme tier)");
      note_if_given({O + "ratio"},
                    "zero_optimization.offload_optimizer.device is \"cpu\" and zerotrain trains on the CPU: the "
                    "whole optimizer state is in host memory either way (ratio splits it between nvme and host memory)");
    }
    if (opt.device == OffloadDevice::Nvme && opt.fast_init)
      note_if_given({O + "fast_init"},
                    "zerotrain always initialises the nvme tier directly from the model, without a host copy of the "
                    "whole state");
    if (opt.pin_memory) note_if_given({O + "pin_memory"}, kNoPinning);
    if (!opt.delayed_update)
      note_if_given({O + "delayed_update_after"}, "zero_optimization.offload_optimizer.delayed_update is false");
  }
  if (param.device == OffloadDevice::None) {
    note_if_given({P + "nvme_path", P + "pin_memory", P + "buffer_count", P + "buffer_size", P + "max_in_cpu"},
                  "zero_optimization.offload_param.device is \"none\"");
  } else {
    if (param.device == OffloadDevice::Cpu) {
      note_if_given({P + "device"},
                    "zerotrain trains on the CPU, so the parameter shards are in host memory already (\"cpu\" moves "
                    "nothing)");
      note_if_given({P + "nvme_path", P + "buffer_count", P + "buffer_size", P + "max_in_cpu"},
                    "zero_optimization.offload_param.device is \"cpu\" (it applies to the nvme tier)");
    }
    if (param.pin_memory) note_if_given({P + "pin_memory"}, kNoPinning);
  }
  if (opt.device != OffloadDevice::Nvme)
    note_if_given({"zero_optimization.sub_group_size"},
                  "zero_optimization.offload_optimizer.device is not \"nvme\" (sub-groups are the unit the nvme tier "
                  "reads, steps and writes)");
  if (opt.device != OffloadDevice::Nvme && param.device != OffloadDevice::Nvme)
    note_if_given({"aio.block_size", "aio.queue_depth", "aio.thread_count", "aio.single_submit", "aio.overlap_events"},
                  "no tier is on nvme (zero_optimization.offload_optimizer.device and offload_param.device are not "
                  "\"nvme\")");
}

// Keys that are valid but cannot matter in this configuration (see TrainConfig::notes).
void add_notes(TrainConfig& c) {
  auto note_if_given = [&](const std::vector<std::string>& keys, const std::string& why) {
    for (const std::string& key : keys)
      if (given(c, key)) c.notes.push_back(fmt::format("{} has no effect: {}", key, why));
  };
  if (c.precision != Precision::FP16)
    note_if_given({"fp16.loss_scale", "fp16.initial_scale_power", "fp16.loss_scale_window", "fp16.hysteresis",
                   "fp16.min_loss_scale"},
                  "fp16.enabled is false (the loss scaler runs only in fp16)");
  if (c.zero.stage < 3)
    note_if_given({"zero_optimization.stage3_prefetch_bucket_size", "zero_optimization.stage3_max_live_parameters",
                   "zero_optimization.stage3_param_persistence_threshold"},
                  fmt::format("zero_optimization.stage is {} (it applies to stage 3)", c.zero.stage));
  if (c.train.eval_interval == 0)
    note_if_given({"train.eval_iters", "data.val_path"}, "train.eval_interval is 0 (no evaluation runs)");
  if (!c.csv_monitor.enabled)
    note_if_given({"csv_monitor.output_path", "csv_monitor.job_name"}, "csv_monitor.enabled is false");
  add_offload_notes(c, note_if_given);
  const std::string A = "activation_checkpointing.";
  if (c.activation_checkpointing.policy == "none")
    note_if_given({A + "cpu_checkpointing", A + "contiguous_memory_optimization", A + "synchronize_checkpoint_boundary",
                   A + "profile", A + "number_checkpoints"},
                  "activation_checkpointing.policy is \"none\" (nothing is recomputed)");
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
  add_notes(config);
  for (const auto& [path, value] : values) config.resolved[path] = value.dump();
  return config;
}

}  // namespace

TrainConfig parse_config(const std::string& json_text, const std::vector<std::string>& overrides, int world_size) {
  return build(parse_json(json_text, "config"), overrides, world_size, "config");
}

TrainConfig load_config(const std::string& path, const std::vector<std::string>& overrides, int world_size) {
  const std::string shown = printable(path);
  std::error_code ec;
  if (path.empty()) throw ConfigError("config file: expected a path, found \"\"");
  const auto status = std::filesystem::status(path, ec);
  if (!std::filesystem::exists(status)) throw ConfigError(fmt::format("config file '{}' not found", shown));
  if (std::filesystem::is_directory(status))
    throw ConfigError(fmt::format("config file '{}' is a directory, expected a JSON file", shown));
  // A device or pipe (/dev/zero) could be endless: only regular files, and only so much of them.
  if (!std::filesystem::is_regular_file(status))
    throw ConfigError(fmt::format("config file '{}' is not a regular file", shown));
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ConfigError(fmt::format("config file '{}' could not be opened", shown));
  std::string text(cd::kMaxConfigBytes + 1, '\0');
  in.read(text.data(), static_cast<std::streamsize>(text.size()));
  if (in.bad()) throw ConfigError(fmt::format("config file '{}' could not be read", shown));
  text.resize(static_cast<size_t>(in.gcount()));
  const std::string origin = fmt::format("config file '{}'", shown);
  if (text.size() > cd::kMaxConfigBytes) {
    const auto size = std::filesystem::file_size(path, ec);
    check_size(ec ? text.size() : static_cast<size_t>(size), origin);
  }
  if (text.find_first_not_of(" \t\r\n") == std::string::npos)
    throw ConfigError(fmt::format("{} is empty: expected a JSON object (write {{}} for all defaults)", origin));
  return build(parse_json(text, shown), overrides, world_size, shown);
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
