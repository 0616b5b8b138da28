// The key table (DeepSpeed's names and defaults, design §5) and the generic value checks.
#include "config/schema.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <limits>
#include <set>
#include <stdexcept>
#include <tuple>
#include <utility>

#include "zerotrain/error.h"

namespace zt::config_detail {
namespace {

// Stores a checked value in a field of whatever type the field has. An integer the field cannot
// hold means the table's range is wider than the field: a defect of the table, never stored
// truncated (config_test checks every integer key at its upper bound).
template <typename T>
void store(T& field, const json& v) {
  if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>) {
    const int64_t wide = v.get<int64_t>();
    if (!std::in_range<T>(wide))
      throw std::logic_error(fmt::format("configuration table: {} does not fit its field", wide));
    field = static_cast<T>(wide);
  } else {
    field = v.get<T>();
  }
}
#define ZT_FIELD(member) [](TrainConfig& c, const json& v) { store(c.member, v); }

Leaf make(std::string path, Kind kind, json def, std::function<void(TrainConfig&, const json&)> assign) {
  Leaf leaf;
  leaf.path = std::move(path);
  leaf.kind = kind;
  leaf.def = std::move(def);
  leaf.assign = std::move(assign);
  return leaf;
}
Leaf boolean(std::string path, bool def, std::function<void(TrainConfig&, const json&)> assign) {
  return make(std::move(path), Kind::Bool, def, std::move(assign));
}
Leaf integer(std::string path, int64_t def, std::optional<double> lo, std::optional<double> hi,
             std::function<void(TrainConfig&, const json&)> assign) {
  Leaf leaf = make(std::move(path), Kind::Int, def, std::move(assign));
  leaf.lo = lo;
  leaf.hi = hi;
  return leaf;
}
Leaf number(std::string path, double def, std::optional<double> lo, bool lo_open, std::optional<double> hi,
            bool hi_open, std::function<void(TrainConfig&, const json&)> assign) {
  Leaf leaf = make(std::move(path), Kind::Number, def, std::move(assign));
  leaf.lo = lo;
  leaf.lo_open = lo_open;
  leaf.hi = hi;
  leaf.hi_open = hi_open;
  return leaf;
}
Leaf positive(std::string path, double def, std::function<void(TrainConfig&, const json&)> assign) {
  return number(std::move(path), def, 0.0, true, std::nullopt, false, std::move(assign));
}
Leaf non_negative(std::string path, double def, std::function<void(TrainConfig&, const json&)> assign) {
  return number(std::move(path), def, 0.0, false, std::nullopt, false, std::move(assign));
}
Leaf string(std::string path, std::string def, std::function<void(TrainConfig&, const json&)> assign,
            std::vector<std::string> choices = {}) {
  Leaf leaf = make(std::move(path), Kind::String, std::move(def), std::move(assign));
  leaf.choices = std::move(choices);
  return leaf;
}
Leaf batch(std::string path, std::function<void(TrainConfig&, const json&)> assign) {
  return make(std::move(path), Kind::BatchSize, "auto", std::move(assign));
}
// A DeepSpeed key that zerotrain recognises but does not implement: only the default passes.
Leaf reserved(Leaf leaf) {
  leaf.supported = false;
  leaf.assign = nullptr;
  return leaf;
}
Leaf nullable(Leaf leaf) {
  leaf.nullable = true;
  return leaf;
}

constexpr int64_t k5e8 = 500'000'000, k1e9 = 1'000'000'000;

std::vector<Leaf> build_table() {
  std::vector<Leaf> t;
  auto none = nullptr;
  // --- batch and loop (DeepSpeed top level)
  t.push_back(batch("train_batch_size", [](TrainConfig& c, const json& v) {
    c.train_batch_size = v.is_number() ? v.get<int64_t>() : 0;
  }));
  t.push_back(batch("train_micro_batch_size_per_gpu", [](TrainConfig& c, const json& v) {
    c.train_micro_batch_size_per_gpu = v.is_number() ? v.get<int64_t>() : 0;
  }));
  t.push_back(batch("gradient_accumulation_steps", [](TrainConfig& c, const json& v) {
    c.gradient_accumulation_steps = v.is_number() ? v.get<int64_t>() : 0;
  }));
  t.push_back(non_negative("gradient_clipping", 1.0, ZT_FIELD(gradient_clipping)));
  t.push_back(integer("steps_per_print", 10, 1, std::nullopt, ZT_FIELD(steps_per_print)));
  t.push_back(boolean("wall_clock_breakdown", false, ZT_FIELD(wall_clock_breakdown)));

  // --- optimizer. Type names compare case-insensitively, as in DeepSpeed.
  {
    Leaf type = string("optimizer.type", "Adam", ZT_FIELD(optimizer.type),
                       {"Adam", "AdamW", "Lamb", "OneBitAdam", "ZeroOneAdam", "OneBitLamb", "Adagrad", "SGD"});
    type.case_insensitive = true;
    t.push_back(std::move(type));
  }
  t.push_back(positive("optimizer.params.lr", 1e-3, ZT_FIELD(optimizer.lr)));
  t.push_back(make("optimizer.params.betas", Kind::Betas, json::array({0.9, 0.999}),
                   [](TrainConfig& c, const json& v) {
                     c.optimizer.beta1 = v[0].get<double>();
                     c.optimizer.beta2 = v[1].get<double>();
                   }));
  t.push_back(positive("optimizer.params.eps", 1e-8, ZT_FIELD(optimizer.eps)));
  t.push_back(non_negative("optimizer.params.weight_decay", 0.0, ZT_FIELD(optimizer.weight_decay)));
  t.push_back(boolean("optimizer.params.adam_w_mode", true, ZT_FIELD(optimizer.adam_w_mode)));
  t.push_back(boolean("optimizer.params.bias_correction", true, ZT_FIELD(optimizer.bias_correction)));
  t.push_back(non_negative("optimizer.params.min_coeff", 0.01, ZT_FIELD(optimizer.min_coeff)));
  t.push_back(positive("optimizer.params.max_coeff", 10.0, ZT_FIELD(optimizer.max_coeff)));
  t.push_back(non_negative("optimizer.params.momentum", 0.0, ZT_FIELD(optimizer.momentum)));
  t.push_back(number("optimizer.params.dampening", 0.0, 0.0, false, 1.0, false, ZT_FIELD(optimizer.dampening)));
  t.push_back(boolean("optimizer.params.nesterov", false, ZT_FIELD(optimizer.nesterov)));
  t.push_back(reserved(boolean("optimizer.params.amsgrad", false, none)));

  // --- scheduler (DeepSpeed's parameter names; which ones a type takes: validate_semantics)
  t.push_back(string("scheduler.type", "", ZT_FIELD(scheduler.type),
                     {"", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"}));
  t.push_back(non_negative("scheduler.params.warmup_min_lr", 0.0, ZT_FIELD(scheduler.warmup_min_lr)));
  t.push_back(positive("scheduler.params.warmup_max_lr", 1e-3, ZT_FIELD(scheduler.warmup_max_lr)));
  t.push_back(integer("scheduler.params.warmup_num_steps", 1000, 0, std::nullopt,
                      ZT_FIELD(scheduler.warmup_num_steps)));
  t.push_back(string("scheduler.params.warmup_type", "log", ZT_FIELD(scheduler.warmup_type), {"log", "linear"}));
  // 0 until derived: DeepSpeed requires it for WarmupDecayLR / WarmupCosineLR; we derive it
  // from train.steps when absent (and say so in the sources).
  t.push_back(integer("scheduler.params.total_num_steps", 0, 1, std::nullopt, ZT_FIELD(scheduler.total_num_steps)));
  t.push_back(number("scheduler.params.cos_min_ratio", 1e-4, 0.0, false, 1.0, false, ZT_FIELD(scheduler.cos_min_ratio)));
  t.push_back(number("scheduler.params.warmup_min_ratio", 0.0, 0.0, false, 1.0, false,
                     ZT_FIELD(scheduler.warmup_min_ratio)));

  // --- zero_optimization
  t.push_back(integer("zero_optimization.stage", 0, 0, 3, ZT_FIELD(zero.stage)));
  t.push_back(boolean("zero_optimization.contiguous_gradients", true, ZT_FIELD(zero.contiguous_gradients)));
  t.push_back(integer("zero_optimization.reduce_bucket_size", k5e8, 1, std::nullopt, ZT_FIELD(zero.reduce_bucket_size)));
  t.push_back(integer("zero_optimization.allgather_bucket_size", k5e8, 1, std::nullopt,
                      ZT_FIELD(zero.allgather_bucket_size)));
  // Default depends on the stage (true for 3): derive().
  t.push_back(boolean("zero_optimization.overlap_comm", false, ZT_FIELD(zero.overlap_comm)));
  t.push_back(reserved(boolean("zero_optimization.reduce_scatter", true, none)));
  t.push_back(reserved(boolean("zero_optimization.allgather_partitions", true, none)));
  t.push_back(reserved(boolean("zero_optimization.round_robin_gradients", false, none)));
  t.push_back(integer("zero_optimization.stage3_prefetch_bucket_size", 50'000'000, 0, std::nullopt,
                      ZT_FIELD(zero.stage3_prefetch_bucket_size)));
  t.push_back(integer("zero_optimization.stage3_param_persistence_threshold", 100'000, 0, std::nullopt,
                      ZT_FIELD(zero.stage3_param_persistence_threshold)));
  t.push_back(integer("zero_optimization.stage3_max_live_parameters", k1e9, 0, std::nullopt,
                      ZT_FIELD(zero.stage3_max_live_parameters)));
  t.push_back(reserved(integer("zero_optimization.stage3_max_reuse_distance", k1e9, 0, std::nullopt, none)));
  t.push_back(reserved(boolean("zero_optimization.stage3_gather_16bit_weights_on_model_save", false, none)));
  // ZeRO-Offload / ZeRO-Infinity (docs/offload.md): DeepSpeed's keys and defaults; which ones
  // matter depends on the device (notes in config.cpp), what must hold together: derive.cpp.
  t.push_back(integer("zero_optimization.sub_group_size", k1e9, 1, std::nullopt, ZT_FIELD(zero.sub_group_size)));
  for (std::string block : {"zero_optimization.offload_optimizer", "zero_optimization.offload_param"}) {
    const bool opt = block.ends_with("optimizer");
    auto field = [opt](auto OffloadOptimizerConfig::*o, auto OffloadParamConfig::*p) {
      return [opt, o, p](TrainConfig& c, const json& v) {
        if (opt) store(c.zero.offload_optimizer.*o, v);
        else store(c.zero.offload_param.*p, v);
      };
    };
    t.push_back(string(block + ".device", "none",
                       [opt](TrainConfig& c, const json& v) {
                         const std::string s = v.get<std::string>();
                         const OffloadDevice d = s == "cpu" ? OffloadDevice::Cpu : s == "nvme" ? OffloadDevice::Nvme
                                                                                               : OffloadDevice::None;
                         (opt ? c.zero.offload_optimizer.device : c.zero.offload_param.device) = d;
                       },
                       {"none", "cpu", "nvme"}));
    // DeepSpeed's default is None (no directory); null and "" both mean "not given".
    t.push_back(nullable(string(block + ".nvme_path", "", [opt](TrainConfig& c, const json& v) {
      (opt ? c.zero.offload_optimizer.nvme_path : c.zero.offload_param.nvme_path) =
          v.is_null() ? std::string() : v.get<std::string>();
    })));
    t.back().def = nullptr;
    t.push_back(boolean(block + ".pin_memory", false,
                        field(&OffloadOptimizerConfig::pin_memory, &OffloadParamConfig::pin_memory)));
    t.push_back(integer(block + ".buffer_count", opt ? 4 : 5, 1, 1 << 16,
                        field(&OffloadOptimizerConfig::buffer_count, &OffloadParamConfig::buffer_count)));
    if (opt) {
      t.push_back(boolean(block + ".pipeline_read", false, ZT_FIELD(zero.offload_optimizer.pipeline_read)));
      t.push_back(boolean(block + ".pipeline_write", false, ZT_FIELD(zero.offload_optimizer.pipeline_write)));
      t.push_back(boolean(block + ".fast_init", false, ZT_FIELD(zero.offload_optimizer.fast_init)));
      // The fraction of the optimizer partition on the device's tier; 0 would offload nothing
      // (that is device "none").
      t.push_back(number(block + ".ratio", 1.0, 0.0, true, 1.0, false, ZT_FIELD(zero.offload_optimizer.ratio)));
      // zerotrain's own (the ZeRO-Offload paper's delayed parameter update, §5.2).
      t.push_back(boolean(block + ".delayed_update", false, ZT_FIELD(zero.offload_optimizer.delayed_update)));
      t.push_back(integer(block + ".delayed_update_after", 40, 0, std::nullopt,
                          ZT_FIELD(zero.offload_optimizer.delayed_update_after)));
      // zerotrain's own: the gradient partition beside the state on NVMe (stages 2-3).
      t.push_back(boolean(block + ".nvme_gradients", false, ZT_FIELD(zero.offload_optimizer.nvme_gradients)));
    } else {
      t.push_back(integer(block + ".buffer_size", 100'000'000, 1, std::nullopt, ZT_FIELD(zero.offload_param.buffer_size)));
      t.push_back(integer(block + ".max_in_cpu", k1e9, 0, std::nullopt, ZT_FIELD(zero.offload_param.max_in_cpu)));
    }
  }

  // --- precision. fp16/bf16 "enabled" become TrainConfig::precision in derive().
  t.push_back(boolean("fp16.enabled", false, ZT_FIELD(fp16.enabled)));
  t.push_back(non_negative("fp16.loss_scale", 0.0, ZT_FIELD(fp16.loss_scale)));
  t.push_back(integer("fp16.initial_scale_power", 16, 0, 63, ZT_FIELD(fp16.initial_scale_power)));
  constexpr double kIntMax = std::numeric_limits<int>::max();  // these two are `int` fields
  t.push_back(integer("fp16.loss_scale_window", 1000, 1, kIntMax, ZT_FIELD(fp16.loss_scale_window)));
  t.push_back(integer("fp16.hysteresis", 2, 1, kIntMax, ZT_FIELD(fp16.hysteresis)));
  t.push_back(positive("fp16.min_loss_scale", 1.0, ZT_FIELD(fp16.min_loss_scale)));
  t.push_back(reserved(boolean("fp16.auto_cast", false, none)));
  t.push_back(reserved(boolean("fp16.consecutive_hysteresis", false, none)));
  t.push_back(boolean("bf16.enabled", false, none));

  // --- monitoring
  t.push_back(boolean("csv_monitor.enabled", true, ZT_FIELD(csv_monitor.enabled)));
  t.push_back(string("csv_monitor.output_path", "", ZT_FIELD(csv_monitor.output_path)));
  t.push_back(string("csv_monitor.job_name", "zerotrain", ZT_FIELD(csv_monitor.job_name)));
  t.push_back(reserved(boolean("tensorboard.enabled", false, none)));
  t.push_back(reserved(string("tensorboard.output_path", "", none)));
  t.push_back(reserved(string("tensorboard.job_name", "DeepSpeedJobName", none)));

  // --- activation checkpointing (design §5, docs/activation_checkpointing.md)
  t.push_back(string("activation_checkpointing.policy", "none", ZT_FIELD(activation_checkpointing.policy),
                     {"none", "selective", "full", "auto"}));
  t.push_back(boolean("activation_checkpointing.partition_activations", false,
                      ZT_FIELD(activation_checkpointing.partition_activations)));
  t.push_back(boolean("activation_checkpointing.cpu_checkpointing", false,
                      ZT_FIELD(activation_checkpointing.cpu_checkpointing)));
  t.push_back(boolean("activation_checkpointing.contiguous_memory_optimization", false,
                      ZT_FIELD(activation_checkpointing.contiguous_memory_optimization)));
  t.push_back(boolean("activation_checkpointing.synchronize_checkpoint_boundary", false,
                      ZT_FIELD(activation_checkpointing.synchronize_checkpoint_boundary)));
  t.push_back(boolean("activation_checkpointing.profile", false, ZT_FIELD(activation_checkpointing.profile)));
  t.push_back(nullable(integer("activation_checkpointing.number_checkpoints", 0, 0, std::nullopt,
                               [](TrainConfig& c, const json& v) {
                                 c.activation_checkpointing.number_checkpoints = v.is_null() ? 0 : v.get<int64_t>();
                               })));
  t.back().def = nullptr;
  // The asynchronous I/O engine of the nvme tiers (DeepSpeed's "aio" block and defaults).
  t.push_back(integer("aio.block_size", 1 << 20, 1, 1LL << 30, ZT_FIELD(aio.block_size)));
  t.push_back(integer("aio.queue_depth", 8, 1, 1 << 16, ZT_FIELD(aio.queue_depth)));
  t.push_back(integer("aio.thread_count", 1, 1, 1 << 10, ZT_FIELD(aio.thread_count)));
  t.push_back(boolean("aio.single_submit", false, ZT_FIELD(aio.single_submit)));
  t.push_back(boolean("aio.overlap_events", true, ZT_FIELD(aio.overlap_events)));

  // --- zerotrain's own blocks
  t.push_back(string("model.preset", "tiny", ZT_FIELD(model.preset)));
  // Upper bounds far beyond any model this library can build, low enough that the size
  // arithmetic of the estimate and the model (layers x 12 x width^2 + (vocab + context) x width)
  // cannot overflow 64 bits.
  for (const auto& shape : std::initializer_list<std::tuple<const char*, int64_t ModelConfig::*, double>>{
           {"n_layer", &ModelConfig::n_layer, 1 << 16},
           {"n_head", &ModelConfig::n_head, 1 << 16},
           {"n_embd", &ModelConfig::n_embd, 1 << 20},
           {"vocab_size", &ModelConfig::vocab_size, 1 << 24},
           {"context_length", &ModelConfig::context_length, 1 << 24}}) {
    // 0 keeps the preset's value. (A named copy, not a structured binding: clang 14, which builds
    // the fuzz targets, cannot capture those.)
    int64_t ModelConfig::*field = std::get<1>(shape);
    t.push_back(integer(std::string("model.") + std::get<0>(shape), 0, 0, std::get<2>(shape),
                        [field](TrainConfig& c, const json& v) { c.model.*field = v.get<int64_t>(); }));
  }
  // -1 (the default) keeps the preset's dropout; a given value must be a probability.
  t.push_back(number("model.dropout", -1.0, 0.0, false, 1.0, true, ZT_FIELD(model.dropout)));
  t.push_back(integer("model.loss_chunk_tokens", 0, 0, 1LL << 40, ZT_FIELD(model.loss_chunk_tokens)));
  t.push_back(string("data.source", "embedded", ZT_FIELD(data.source), {"embedded", "bin", "text"}));
  t.push_back(string("data.path", "", ZT_FIELD(data.path)));
  t.push_back(string("data.val_path", "", ZT_FIELD(data.val_path)));
  t.push_back(number("data.val_fraction", 0.1, 0.0, false, 1.0, true, ZT_FIELD(data.val_fraction)));
  t.push_back(integer("data.sequence_length", 0, 0, std::nullopt, ZT_FIELD(data.sequence_length)));
  // The trainer keeps one loss per step; a hundred million steps is beyond any run and its
  // bookkeeping still fits in memory (a value past it is a typo or damage, refused up front).
  t.push_back(integer("train.steps", 200, 1, 100'000'000, ZT_FIELD(train.steps)));
  t.push_back(integer("train.seed", 1234, 0, std::nullopt, ZT_FIELD(train.seed)));
  t.push_back(integer("train.eval_interval", 0, 0, std::nullopt, ZT_FIELD(train.eval_interval)));
  t.push_back(integer("train.eval_iters", 4, 1, std::nullopt, ZT_FIELD(train.eval_iters)));
  t.push_back(integer("train.threads", 0, 0, 4096, ZT_FIELD(train.threads)));
  t.push_back(string("train.log_dir", "runs", ZT_FIELD(train.log_dir)));
  t.push_back(string("train.retain_freed_memory", "never", ZT_FIELD(train.retain_freed_memory),
                     {"auto", "always", "never"}));
  t.push_back(positive("comm.timeout_seconds", 300.0, ZT_FIELD(comm.timeout_seconds)));
  return t;
}
#undef ZT_FIELD

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char ch) { return std::tolower(ch); });
  return s;
}

std::string fmt_bound(double v) {
  if (std::abs(v) >= 1e15 || v != std::floor(v)) return fmt::format("{}", v);
  return fmt::format("{}", static_cast<int64_t>(v));
}

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

}  // namespace

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

std::string Leaf::expected() const {
  std::string text;
  switch (kind) {
    case Kind::Bool: text = "true or false"; break;
    case Kind::Betas: text = "two numbers in [0, 1)"; break;
    case Kind::BatchSize: text = "a positive integer or \"auto\""; break;
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
  std::string list;
  for (const std::string& name : valid) list += (list.empty() ? "" : ", ") + name;
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

}  // namespace zt::config_detail
