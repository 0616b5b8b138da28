// Parsing: JSON text -> overrides -> unknown-key walk -> typed leaves -> derivation -> validation.
// Every step throws ConfigError with one line naming the key; nothing is silently dropped.
#include "zerotrain/config/config.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <optional>
#include <set>
#include <sstream>
#include <string_view>

#include "config/non_finite.h"
#include "config/model_rules.h"
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
    case ValueSource::Auto: return "auto";
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
std::optional<json> parse_json_text(const std::string& text, const std::string& origin, bool lenient,
                                    const std::string& path = "") {
  StructureCheck check(origin);
  try {
    // Comments are accepted: example configs explain themselves; plain JSON is unaffected.
    json parsed = json::parse(cd::mark_non_finite(text), std::ref(check), /*allow_exceptions=*/true,
                              /*ignore_comments=*/true);
    cd::resolve_non_finite(parsed, path, origin);
    return parsed;
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

// An unknown key this close to a known one of its block is a typo, not a key of some other tool.
bool near_miss(const std::string& block, const std::string& key) {
  if (key.size() > 64) return false;
  for (const std::string& known : cd::children(block)) {
    // At most two edits and one per four characters: "comment" is not a misspelt "comet".
    const size_t d = cd::edit_distance(key, known);
    if (d > 0 && d <= std::min<size_t>(2, std::max<size_t>(1, std::max(key.size(), known.size()) / 4))) return true;
  }
  return false;
}

// Records the source of every leaf present under `node` (the block at `block`) and rejects
// blocks given as non-objects. An unknown key follows DeepSpeed (docs/config.md "Unknown keys"):
// inside a block it validates, an error with a suggestion; at the top level or in a block it reads
// leniently, DeepSpeed ignores it, so it goes to `ignored` (a near miss of a known key of that
// block is an error all the same: "optimizer.parms" would train with the default lr).
void walk(const json& node, const std::string& block, ValueSource source,
          std::map<std::string, ValueSource>& sources, std::vector<std::string>& ignored) {
  for (const auto& [key, value] : node.items()) {
    const std::string path = cd::join_path(block, key);
    if (cd::find_leaf(path)) {
      sources[path] = source;
    } else if (cd::is_block(path)) {
      if (value.is_null()) continue;  // DeepSpeed's None: the block's defaults
      if (!value.is_object())
        throw ConfigError(fmt::format("{}: expected an object (a block of settings), found {}", path, cd::show(value)));
      walk(value, path, source, sources, ignored);
    } else if ((block.empty() || cd::strictness(block) == cd::Strictness::Lenient) && !near_miss(block, key)) {
      ignored.push_back(path);
    } else {
      cd::throw_unknown_key(block, key);
    }
  }
}

// DeepSpeed's other spellings (docs/config.md "Spellings") rewritten to the canonical keys before
// anything else reads the document; `spelled` maps a canonical path (a leaf or a block) to the
// file's spelling of it.
void rename_key(json& block, const std::string& block_path, const std::string& from, const std::string& to,
                std::map<std::string, std::string>& spelled) {
  if (!block.contains(from)) return;
  const std::string from_path = cd::join_path(block_path, from), to_path = cd::join_path(block_path, to);
  if (block.contains(to))
    throw ConfigError(fmt::format("{} and {} are two spellings of one key: give one of them", from_path, to_path));
  block[to] = std::move(block[from]);
  block.erase(from);
  spelled[to_path] = from_path;
}

void normalise_spellings(json& doc, std::map<std::string, std::string>& spelled) {
  // DeepSpeed reads "bfloat16" when "bf16" is absent (precision_config.py).
  rename_key(doc, "", "bfloat16", "bf16", spelled);
  // DeepSpeed 0.19's aio_config.py reads the I/O threads as "intra_op_parallelism" (older
  // versions, "thread_count", zerotrain's name for them).
  if (doc.contains("aio") && doc["aio"].is_object())
    rename_key(doc["aio"], "aio", "intra_op_parallelism", "thread_count", spelled);
  if (doc.contains("zero_optimization") && doc["zero_optimization"].is_boolean()) {
    // read_zero_config_deprecated: true is stage 1 with the top-level allgather_size; false is off.
    const bool on = doc["zero_optimization"].get<bool>();
    json zero = {{"stage", on ? 1 : 0}};
    spelled["zero_optimization.stage"] = on ? "zero_optimization: true" : "zero_optimization: false";
    if (on && doc.contains("allgather_size")) {
      zero["allgather_bucket_size"] = std::move(doc["allgather_size"]);
      doc.erase("allgather_size");
      spelled["zero_optimization.allgather_bucket_size"] = "allgather_size";
    }
    doc["zero_optimization"] = std::move(zero);
  }
  if (!doc.contains("zero_optimization") || !doc["zero_optimization"].is_object()) return;
  json& zero = doc["zero_optimization"];
  const std::string Z = "zero_optimization";
  // The pydantic field names of zero/config.py, whose aliases are zerotrain's canonical names.
  for (const char* name : {"prefetch_bucket_size", "param_persistence_threshold", "model_persistence_threshold",
                           "max_live_parameters", "max_reuse_distance", "gather_16bit_weights_on_model_save",
                           "module_granularity_threshold", "use_all_reduce_for_fetch_params", "allgather_sequential"})
    rename_key(zero, Z, name, std::string("stage3_") + name, spelled);
  rename_key(zero, Z, "stage3_gather_fp16_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save", spelled);
  // cpu_offload / cpu_offload_param: true means the "cpu" tier, false no tier (as DeepSpeed's
  // new_param_fn); with the block they replace, DeepSpeed refuses both together.
  for (const auto& [old_name, tier] : {std::pair{"cpu_offload", "offload_optimizer"},
                                        std::pair{"cpu_offload_param", "offload_param"}}) {
    if (!zero.contains(old_name)) continue;
    const std::string old_path = Z + "." + old_name;
    json value = std::move(zero[old_name]);
    zero.erase(old_name);
    if (value.is_null()) continue;
    if (!value.is_boolean())
      throw ConfigError(fmt::format("{}: expected true or false or null, found {}", old_path, cd::show(value)));
    if (zero.contains(tier))
      throw ConfigError(fmt::format("{} and {}.{} are two spellings of one setting: give one of them", old_path, Z,
                                    tier));
    zero[tier] = {{"device", value.get<bool>() ? "cpu" : "none"}};
    spelled[Z + "." + tier + ".device"] = old_path;
  }
}

// "key.path=value": the value is JSON when it parses as JSON, else the literal string, so
// `--set scheduler.type=WarmupLR` needs no quoting and `--set optimizer.params.lr=3e-4` is a number.
void apply_override(json& doc, const std::string& text, std::map<std::string, ValueSource>& sources,
                    std::vector<std::string>& ignored) {
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

  std::optional<json> parsed =
      parse_json_text(raw, "override '" + printable(path, 60) + "'", /*lenient=*/true, path);
  json value = parsed ? std::move(*parsed) : json(raw);
  if (cd::find_leaf(path)) {
    (*node)[parts.back()] = value;
    sources[path] = ValueSource::CommandLine;
    return;
  }
  // A whole block: its object replaces the block's keys one by one (others stay).
  if (!value.is_object())
    throw ConfigError(fmt::format("{}: expected an object (a block of settings), found {}", path, cd::show(value)));
  walk(value, path, ValueSource::CommandLine, sources, ignored);
  json& target = (*node)[parts.back()];
  if (!target.is_object()) target = json::object();
  target.merge_patch(value);
}

// An optimizer zerotrain does not implement (1-bit Adam's freeze_step, ...) has its own
// parameter names; validate_support refuses the type itself, in one line.
void drop_params_of_unimplemented_optimizer(json& doc) {
  if (!doc.contains("optimizer") || !doc["optimizer"].is_object()) return;
  json& optimizer = doc["optimizer"];
  if (!optimizer.contains("type") || !optimizer["type"].is_string() || !optimizer.contains("params")) return;
  std::string type = optimizer["type"].get<std::string>();
  std::transform(type.begin(), type.end(), type.begin(), [](unsigned char ch) { return std::tolower(ch); });
  if (type != "adam" && type != "adamw" && type != "lamb" && type != "sgd") optimizer.erase("params");
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

// The offload keys that cannot matter in this configuration. The configuration does not know the
// device the model will be on: what holds only with parameters on the CPU (the "cpu" tier is the
// memory in use already and page-locking it speeds nothing up; on a GPU both matter, docs/gpu.md)
// goes to cpu_device_notes, which the CLI prints for a CPU run only.
template <typename Note, typename CpuNote>
void add_offload_notes(const TrainConfig& c, const Note& note_if_given, const CpuNote& cpu_note_if_given) {
  const OffloadOptimizerConfig& opt = c.zero.offload_optimizer;
  const OffloadParamConfig& param = c.zero.offload_param;
  const std::string O = "zero_optimization.offload_optimizer.", P = "zero_optimization.offload_param.";
  const char* kNoPinning =
      "with parameters on the CPU nothing is copied to a GPU (page-locked buffers only speed those copies)";
  if (opt.device == OffloadDevice::None) {
    note_if_given({O + "nvme_path", O + "pin_memory", O + "buffer_count", O + "pipeline_read", O + "pipeline_write",
                   O + "fast_init", O + "ratio", O + "delayed_update", O + "delayed_update_after", O + "nvme_gradients"},
                  "zero_optimization.offload_optimizer.device is \"none\"");
  } else {
    if (opt.device == OffloadDevice::Cpu) {
      if (!opt.delayed_update)
        cpu_note_if_given({O + "device"},
                      "with parameters on the CPU the optimizer state is in host memory already (\"cpu\" moves "
                      "nothing; with delayed_update it still delays the step; on a GPU it moves the state and the step "
                      "to host memory)");
      note_if_given({O + "nvme_path", O + "buffer_count", O + "pipeline_read", O + "pipeline_write", O + "fast_init",
                     O + "nvme_gradients"},
                    "zero_optimization.offload_optimizer.device is \"cpu\" (it applies to the nvme tier)");
      note_if_given({O + "ratio"},
                    "zero_optimization.offload_optimizer.device is \"cpu\": the whole optimizer state is in host "
                    "memory (ratio splits it between nvme and host memory)");
    }
    if (opt.device == OffloadDevice::Nvme && opt.fast_init)
      note_if_given({O + "fast_init"},
                    "zerotrain always initialises the nvme tier directly from the model, without a host copy of the "
                    "whole state");
    if (opt.pin_memory) cpu_note_if_given({O + "pin_memory"}, kNoPinning);
    if (!opt.delayed_update)
      note_if_given({O + "delayed_update_after"}, "zero_optimization.offload_optimizer.delayed_update is false");
  }
  if (param.device == OffloadDevice::None) {
    note_if_given({P + "nvme_path", P + "pin_memory", P + "buffer_count", P + "buffer_size", P + "max_in_cpu"},
                  "zero_optimization.offload_param.device is \"none\"");
  } else {
    if (param.device == OffloadDevice::Cpu) {
      cpu_note_if_given({P + "device"},
                    "with parameters on the CPU the parameter shards are in host memory already (\"cpu\" moves "
                    "nothing; with parameters on a GPU, the shards stay in host memory and cross at each gather)");
      note_if_given({P + "nvme_path", P + "buffer_count", P + "buffer_size", P + "max_in_cpu"},
                    "zero_optimization.offload_param.device is \"cpu\" (it applies to the nvme tier)");
    }
    if (param.pin_memory) cpu_note_if_given({P + "pin_memory"}, kNoPinning);
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

// What DeepSpeed's schedulers only warn about, or settings the scheduler overrides: noted, and
// run with DeepSpeed's arithmetic (zerotrain/optim/lr_schedule.h).
template <typename Note>
void add_scheduler_notes(TrainConfig& c, const Note& note_if_given) {
  const SchedulerConfig& s = c.scheduler;
  const std::string P = "scheduler.params.";
  const bool warmup = s.type == "WarmupLR" || s.type == "WarmupDecayLR" || s.type == "WarmupCosineLR";
  if (warmup && s.warmup_type != "log" && s.warmup_type != "linear")
    c.notes.push_back(fmt::format(
        "{}warmup_type \"{}\" is neither \"log\" nor \"linear\": the warm-up is \"log\", as DeepSpeed's {} runs it",
        P, s.warmup_type, s.type));
  if ((s.type == "WarmupLR" || s.type == "WarmupDecayLR") && s.warmup_max_lr < s.warmup_min_lr)
    c.notes.push_back(fmt::format("{}warmup_max_lr {} is below warmup_min_lr {}: the warm-up lowers the lr (as in "
                                  "DeepSpeed)",
                                  P, s.warmup_max_lr, s.warmup_min_lr));
  const int64_t warmup_steps = std::max<int64_t>(2, s.warmup_num_steps);
  if ((s.type == "WarmupDecayLR" || s.type == "WarmupCosineLR") && s.total_num_steps <= warmup_steps)
    c.notes.push_back(fmt::format(
        "{}total_num_steps {}{} leaves no steps to decay over after the {}-step warm-up: the lr drops to {} right "
        "after it (DeepSpeed warns and does the same)",
        P, s.total_num_steps, cd::value_chosen_by_user(c, P + "total_num_steps") ? "" : " (from train.steps)", warmup_steps,
        s.type == "WarmupDecayLR" ? "warmup_min_lr" : "cos_min_ratio × lr"));
  if (s.type == "OneCycle" || s.type == "LRRangeTest" || s.type == "WarmupDecayLR")
    note_if_given({"optimizer.params.lr"}, fmt::format("scheduler {} sets the lr of every step", s.type));
  if (s.type == "OneCycle") {
    if (s.cycle_momentum && c.optimizer.type == "SGD") {
      c.notes.push_back(fmt::format(
          "{}cycle_momentum has no effect: optimizer SGD has no betas to cycle (DeepSpeed turns it off with a "
          "warning)",
          P));
    } else if (s.cycle_momentum) {
      note_if_given({"optimizer.params.betas"},
                    "scheduler OneCycle with cycle_momentum sets the betas of every step (beta1 from cycle_min_mom and "
                    "cycle_max_mom, beta2 0.99, as DeepSpeed)");
    }
    if (!s.cycle_momentum || c.optimizer.type == "SGD")
      note_if_given({P + "cycle_min_mom", P + "cycle_max_mom", P + "decay_mom_rate"},
                    "the momentum is not cycled (cycle_momentum is false, or the optimizer has no betas)");
    if (s.decay_step_size == 0)
      note_if_given({P + "decay_lr_rate", P + "decay_mom_rate"},
                    "scheduler.params.decay_step_size is 0 (no decay after the cycle)");
  }
}

// Keys that are valid but cannot matter in this configuration (see TrainConfig::notes).
void add_notes(TrainConfig& c) {
  auto note_if_given = [&](const std::vector<std::string>& keys, const std::string& why) {
    for (const std::string& key : keys)
      if (cd::value_chosen_by_user(c, key)) c.notes.push_back(fmt::format("{} has no effect: {}", key, why));
  };
  if (c.precision != Precision::FP16)
    note_if_given({"fp16.loss_scale", "fp16.initial_scale_power", "fp16.loss_scale_window", "fp16.hysteresis",
                   "fp16.min_loss_scale"},
                  "fp16.enabled is false (the loss scaler runs only in fp16)");
  if (c.zero.stage < 3)
    note_if_given({"zero_optimization.stage3_prefetch_bucket_size", "zero_optimization.stage3_max_live_parameters",
                   "zero_optimization.stage3_max_reuse_distance", "zero_optimization.stage3_param_persistence_threshold"},
                  fmt::format("zero_optimization.stage is {} (it applies to stage 3)", c.zero.stage));
  if (c.train.eval_interval == 0)
    note_if_given({"train.eval_iters", "data.val_path"}, "train.eval_interval is 0 (no evaluation runs)");
  if (!c.csv_monitor.enabled)
    note_if_given({"csv_monitor.output_path", "csv_monitor.job_name"}, "csv_monitor.enabled is false");
  auto cpu_note_if_given = [&](const std::vector<std::string>& keys, const std::string& why) {
    for (const std::string& key : keys)
      if (cd::value_chosen_by_user(c, key)) c.cpu_device_notes.push_back(fmt::format("{} has no effect: {}", key, why));
  };
  add_offload_notes(c, note_if_given, cpu_note_if_given);
  add_scheduler_notes(c, note_if_given);
  if (!c.zero.contiguous_gradients)
    note_if_given({"zero_optimization.contiguous_gradients"},
                  "zerotrain's gradients always live in contiguous buffers (false only changes how DeepSpeed "
                  "stores them; the values are the same)");
  if (c.optimizer.type == "Lamb" && c.optimizer.lamb_max_grad_norm > 0 && c.precision != Precision::FP16)
    note_if_given({"optimizer.params.max_grad_norm"},
                  "DeepSpeed sets Lamb's max_grad_norm to 0 outside fp16 (with a warning), so it clips nothing there "
                  "either; gradient_clipping is the clipping");
  if (c.activation_checkpointing.partition_activations && c.tensor_parallel == 1)
    note_if_given({"activation_checkpointing.partition_activations"},
                  "DeepSpeed splits checkpointed activations across model-parallel ranks only (with "
                  "tensor_parallel.autotp_size 1, as here, nothing is split)");
  else if (c.activation_checkpointing.partition_activations &&
           (c.activation_checkpointing.policy == "none" || c.activation_checkpointing.policy == "selective"))
    note_if_given({"activation_checkpointing.partition_activations"},
                  "it splits the block inputs that full recomputation keeps, and activation_checkpointing.policy \"" +
                      c.activation_checkpointing.policy + "\" keeps none");
  const std::string A = "activation_checkpointing.";
  if (c.activation_checkpointing.policy == "none")
    note_if_given({A + "cpu_checkpointing", A + "contiguous_memory_optimization", A + "synchronize_checkpoint_boundary",
                   A + "profile", A + "number_checkpoints"},
                  "activation_checkpointing.policy is \"none\" (nothing is recomputed)");
  // The flops profiler's FLOPs model is the GPT's (zerotrain/config/gpt_flops.h).
  const std::string F = "flops_profiler.";
  if (c.tensor_parallel > 1 && c.flops_profiler.enabled)
    note_if_given({F + "enabled"}, "the flops profiler's FLOPs model counts the whole GPT on every rank; a "
                                   "tensor-parallel run (tensor_parallel.autotp_size > 1) is not profiled");
  if (!cd::model_rules(c.model.type).flops_profiled && c.flops_profiler.enabled)
    note_if_given({F + "enabled", F + "recompute_fwd_factor", F + "profile_step", F + "module_depth", F + "top_modules",
                   F + "detailed", F + "output_file"},
                  fmt::format("the flops profiler's FLOPs model does not cover model.type \"{}\"; the run is not "
                              "profiled",
                              c.model.type));
}

// The notes of Inert keys and the warning lines of ignored reports and keys (docs/config.md
// "Policy"). A report inside a block switched off ("tensorboard": {"enabled": false, ...}) is not
// ignored by zerotrain any more than by DeepSpeed, so it is not named.
void add_ignored(TrainConfig& c, const cd::Values& values, const std::vector<std::string>& unknown) {
  std::vector<std::string> reports;
  for (const cd::Leaf& leaf : cd::leaves()) {
    if (!cd::value_chosen_by_user(c, leaf.path) || !cd::engaged(leaf, values.at(leaf.path))) continue;
    if (leaf.status == cd::Status::Inert) c.notes.push_back(fmt::format("{} has no effect in zerotrain: {}", leaf.path, leaf.about));
    if (leaf.status != cd::Status::Reporting) continue;
    const auto dot = leaf.path.rfind('.');
    const std::string gate = dot == std::string::npos ? "" : leaf.path.substr(0, dot) + ".enabled";
    if (!gate.empty() && gate != leaf.path && cd::find_leaf(gate) && values.at(gate) == json(false)) continue;
    reports.push_back(leaf.path);
  }
  auto list = [](const std::vector<std::string>& keys) {
    std::string out;
    for (const std::string& k : keys) out += (out.empty() ? "" : ", ") + printable(k, 80);
    return out;
  };
  if (!reports.empty())
    c.warnings.push_back(fmt::format("ignored (DeepSpeed reports zerotrain does not produce): {}", list(reports)));
  if (!unknown.empty())
    c.warnings.push_back(fmt::format("ignored (keys DeepSpeed does not read either): {}", list(unknown)));
  c.ignored_keys = reports;
  c.ignored_keys.insert(c.ignored_keys.end(), unknown.begin(), unknown.end());
}

// The file's spelling of each leaf, from the canonical paths of leaves and blocks it renamed.
void record_spellings(TrainConfig& c, const std::map<std::string, std::string>& spelled) {
  for (const auto& [path, source] : c.sources) {
    if (source != ValueSource::File && source != ValueSource::Auto) continue;
    for (std::string prefix = path;; prefix = prefix.substr(0, prefix.rfind('.'))) {
      if (auto it = spelled.find(prefix); it != spelled.end()) {
        c.spellings.emplace(path, it->second + path.substr(prefix.size()));
        break;
      }
      if (prefix.find('.') == std::string::npos) break;
    }
  }
}

TrainConfig build(json doc, const std::vector<std::string>& overrides, int world_size, const std::string& origin) {
  if (world_size < 1) throw ConfigError(fmt::format("world size: expected a positive integer, found {}", world_size));
  if (!doc.is_object())
    throw ConfigError(fmt::format("{}: expected a JSON object at the top level, found {}", origin, cd::show(doc)));

  TrainConfig config;
  config.world_size = world_size;
  std::map<std::string, ValueSource> given;
  std::map<std::string, std::string> spelled;
  std::vector<std::string> unknown;
  normalise_spellings(doc, spelled);
  drop_params_of_unimplemented_optimizer(doc);
  walk(doc, "", ValueSource::File, given, unknown);
  // Before validation. A key set twice on the command line is refused, as a duplicate key in a
  // file is: the first value would otherwise be dropped unchecked.
  std::map<std::string, std::string> set_by;  // key -> the override that set it
  for (const std::string& text : overrides) {
    std::map<std::string, ValueSource> this_one;
    apply_override(doc, text, this_one, unknown);
    for (const auto& [key, source] : this_one) {
      if (auto [it, inserted] = set_by.emplace(key, text); !inserted)
        throw ConfigError(fmt::format("--set {}: given twice on the command line ('{}' and '{}'); expected each key "
                                      "once",
                                      key, printable(it->second, 60), printable(text, 60)));
      given[key] = source;
    }
  }
  drop_params_of_unimplemented_optimizer(doc);

  cd::Values values;
  std::vector<std::string> autos;
  for (const cd::Leaf& leaf : cd::leaves()) {
    const json* raw = lookup(doc, leaf.path);
    const std::string block = leaf.path.substr(0, leaf.path.rfind('.') == std::string::npos ? 0 : leaf.path.rfind('.'));
    const bool literal_auto = std::find(leaf.choices.begin(), leaf.choices.end(), "auto") != leaf.choices.end();
    if (raw && raw->is_null() && !leaf.nullable && !leaf.def.is_null()) {
      // null: DeepSpeed's None, which for these keys means the default. A key without a default
      // (OneCycle's bounds) has nothing to fall back on: check_value refuses the null.
      values[leaf.path] = leaf.def;
      config.sources[leaf.path] = given.count(leaf.path) ? given[leaf.path] : ValueSource::File;
      spelled.emplace(leaf.path, "null");
    } else if (raw && *raw == json("auto") && leaf.kind != cd::Kind::BatchSize && !literal_auto &&
               (cd::has_auto_rule(leaf.path) || cd::pydantic_block(block))) {
      values[leaf.path] = leaf.def;  // resolve_auto replaces it
      config.sources[leaf.path] = ValueSource::Auto;
      autos.push_back(leaf.path);
    } else if (raw) {
      values[leaf.path] = cd::check_value(leaf, *raw);
      config.sources[leaf.path] = given.count(leaf.path) ? given[leaf.path] : ValueSource::File;
    } else {
      values[leaf.path] = leaf.def;
      config.sources[leaf.path] = ValueSource::Default;
    }
    if (leaf.assign) leaf.assign(config, values[leaf.path]);
  }

  cd::resolve_auto(config, values, autos);
  cd::derive(config, values);
  cd::validate_semantics(config, values);
  cd::validate_support(config, values);
  add_notes(config);
  add_ignored(config, values, unknown);
  record_spellings(config, spelled);
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
    std::string source = it == config.sources.end() ? "?" : to_string(it->second);
    if (auto spelling = config.spellings.find(key); spelling != config.spellings.end())
      source += spelling->second == "null" ? " (null: the default)" : " (as " + spelling->second + ")";
    out += fmt::format("{:<{}} = {:<{}}  ({})\n", key, key_width, value, value_width, source);
  }
  return out;
}

void set_zero_stage(ZeroConfig& zero, int stage) {
  zero.stage = stage;
  zero.shard_optimizer_states = stage >= 1;
  zero.shard_gradients = stage >= 2;
  zero.shard_parameters = stage >= 3;
}

}  // namespace zt
