// Values that follow from other values (derived, printed and named as derived: docs/design.md
// "Lessons from their users"), cross-key checks, and the support matrix (docs/config.md "Policy").
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <set>
#include <tuple>

#include "config/model_rules.h"
#include "config/schema.h"
#include "zerotrain/error.h"
#include "zerotrain/config/bert_config.h"
#include "zerotrain/config/llama_config.h"
#include "zerotrain/config/gpt_config.h"

namespace zt::config_detail {
namespace {

void set_derived(TrainConfig& c, Values& values, const std::string& path, const json& value) {
  values[path] = value;
  c.sources[path] = ValueSource::Derived;
}

// train_batch_size = micro × accumulation × world; any two determine the third. With one given,
// DeepSpeed's rules: only train_batch_size -> accumulation 1; only micro -> accumulation 1; only
// accumulation is not enough. None given: micro 1, accumulation 1 (zerotrain's default).
// a × b, or a ConfigError when the product does not fit in 64 bits (huge batch keys).
int64_t checked_product(int64_t a, int64_t b) {
  int64_t product = 0;
  if (__builtin_mul_overflow(a, b, &product))
    throw ConfigError(fmt::format(
        "batch sizes: train_micro_batch_size_per_gpu × gradient_accumulation_steps × world size overflows "
        "(factors {} and {})",
        a, b));
  return product;
}

void set_auto(TrainConfig& c, Values& values, const std::string& path, const json& value) {
  values[path] = value;
  c.sources[path] = ValueSource::Auto;
}

void derive_batch_triple(TrainConfig& c, Values& values);

void derive_batch(TrainConfig& c, Values& values) {
  const char* kTbs = "train_batch_size";
  const char* kMicro = "train_micro_batch_size_per_gpu";
  const char* kAccum = "gradient_accumulation_steps";
  // A batch key the file gives as "auto" shows that source once its value is found.
  std::vector<std::string> autos;
  for (const char* key : {kTbs, kMicro, kAccum})
    if (values[key] == json("auto") && written_by_user(c, key)) autos.push_back(key);
  derive_batch_triple(c, values);
  for (const std::string& key : autos) c.sources[key] = ValueSource::Auto;
}

void derive_batch_triple(TrainConfig& c, Values& values) {
  // DeepSpeed's batch counts data-parallel ranks: with tensor parallelism a tensor group's ranks
  // share one micro-batch.
  if (c.tensor_parallel < 1 || c.world_size % c.tensor_parallel != 0)
    throw ConfigError(fmt::format("tensor_parallel.autotp_size: expected a divisor of the world size {}, found {}",
                                  c.world_size, c.tensor_parallel));
  const int64_t world = c.data_parallel_size();
  const std::string ranks =
      c.tensor_parallel > 1 ? fmt::format("data-parallel size {} (world size {} / tensor_parallel.autotp_size {})",
                                          world, c.world_size, c.tensor_parallel)
                            : fmt::format("world size {}", world);
  int64_t& tbs = c.train_batch_size;
  int64_t& micro = c.train_micro_batch_size_per_gpu;
  int64_t& accum = c.gradient_accumulation_steps;
  const char* kTbs = "train_batch_size";
  const char* kMicro = "train_micro_batch_size_per_gpu";
  const char* kAccum = "gradient_accumulation_steps";

  if (tbs && micro && accum) {
    if (tbs != checked_product(checked_product(micro, accum), world))
      throw ConfigError(fmt::format(
          "batch size mismatch: train_batch_size {} != train_micro_batch_size_per_gpu {} × "
          "gradient_accumulation_steps {} × {} (= {})",
          tbs, micro, accum, ranks, checked_product(checked_product(micro, accum), world)));
  } else if (tbs && micro) {
    if (tbs % checked_product(micro, world) != 0)
      throw ConfigError(fmt::format(
          "train_batch_size {} is not divisible by train_micro_batch_size_per_gpu {} × {}", tbs, micro, ranks));
    accum = tbs / checked_product(micro, world);
    set_derived(c, values, kAccum, accum);
  } else if (tbs && accum) {
    if (tbs % checked_product(accum, world) != 0)
      throw ConfigError(fmt::format(
          "train_batch_size {} is not divisible by gradient_accumulation_steps {} × {}", tbs, accum, ranks));
    micro = tbs / checked_product(accum, world);
    set_derived(c, values, kMicro, micro);
  } else if (micro && accum) {
    tbs = checked_product(checked_product(micro, accum), world);
    set_derived(c, values, kTbs, tbs);
  } else if (tbs) {
    if (tbs % world != 0)
      throw ConfigError(fmt::format("train_batch_size {} is not divisible by the {}", tbs, ranks));
    accum = 1;
    micro = tbs / world;
    set_derived(c, values, kAccum, accum);
    set_derived(c, values, kMicro, micro);
  } else if (micro) {
    accum = 1;
    tbs = checked_product(micro, world);
    set_derived(c, values, kAccum, accum);
    set_derived(c, values, kTbs, tbs);
  } else if (accum && values[kMicro] == json("auto") && written_by_user(c, kMicro)) {
    // Hugging Face's "auto" micro-batch (accelerate writes it beside a given accumulation): the
    // Trainer's per-device batch, which here is zerotrain's default, 1.
    micro = 1;
    tbs = checked_product(checked_product(micro, accum), world);
    set_auto(c, values, kMicro, micro);
    set_derived(c, values, kTbs, tbs);
  } else if (accum) {
    throw ConfigError(fmt::format(
        "gradient_accumulation_steps {} alone does not determine the batch: also give "
        "train_micro_batch_size_per_gpu or train_batch_size",
        accum));
  } else {
    micro = 1;
    accum = 1;
    tbs = world;
    values[kMicro] = micro;
    values[kAccum] = accum;
    c.sources[kMicro] = c.sources[kAccum] = ValueSource::Default;
    set_derived(c, values, kTbs, tbs);
  }
}

// The parameters each supported optimizer takes (DeepSpeed's names).
const std::map<std::string, std::set<std::string>>& optimizer_params() {
  static const std::map<std::string, std::set<std::string>> params{
      {"Adam", {"lr", "betas", "eps", "weight_decay", "adam_w_mode", "bias_correction", "amsgrad", "torch_adam",
                "fused", "fp32_optimizer_states"}},
      {"AdamW", {"lr", "betas", "eps", "weight_decay", "adam_w_mode", "bias_correction", "amsgrad", "torch_adam",
                 "fused", "fp32_optimizer_states"}},
      {"Lamb", {"lr", "betas", "eps", "weight_decay", "bias_correction", "min_coeff", "max_coeff", "max_grad_norm",
                "eps_inside_sqrt", "amsgrad"}},
      {"SGD", {"lr", "momentum", "dampening", "weight_decay", "nesterov"}},
  };
  return params;
}

// The parameters each DeepSpeed scheduler's constructor takes (lr_schedules.py).
const std::map<std::string, std::set<std::string>>& scheduler_params() {
  static const std::map<std::string, std::set<std::string>> params = {
      {"WarmupLR", {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"}},
      {"WarmupDecayLR", {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "total_num_steps"}},
      {"WarmupCosineLR", {"total_num_steps", "warmup_min_ratio", "warmup_num_steps", "cos_min_ratio", "warmup_type"}},
      {"OneCycle",
       {"cycle_min_lr", "cycle_max_lr", "decay_lr_rate", "cycle_first_step_size", "cycle_second_step_size",
        "cycle_first_stair_count", "cycle_second_stair_count", "decay_step_size", "cycle_momentum", "cycle_min_mom",
        "cycle_max_mom", "decay_mom_rate"}},
      {"LRRangeTest",
       {"lr_range_test_min_lr", "lr_range_test_step_size", "lr_range_test_step_rate", "lr_range_test_staircase"}},
  };
  return params;
}

std::string join(const std::set<std::string>& names) {
  std::string out;
  for (const std::string& n : names) out += (out.empty() ? "" : ", ") + n;
  return out;
}

// ZeRO-Offload / ZeRO-Infinity: the tiers need sharding, and the nvme tier a directory.
// DeepSpeed requires ZeRO for optimizer offload and silently ignores parameter offload below
// stage 3; zerotrain refuses both, since either would leave the key without effect.
void validate_offload(const TrainConfig& c, const Values& values) {
  const OffloadOptimizerConfig& opt = c.zero.offload_optimizer;
  const OffloadParamConfig& param = c.zero.offload_param;
  if (opt.device != OffloadDevice::None && c.zero.stage < 1)
    throw ConfigError(fmt::format(
        "zero_optimization.offload_optimizer.device: expected \"none\" at zero_optimization.stage 0 (offloading "
        "optimizer states needs ZeRO stage 1, 2 or 3), found \"{}\"",
        to_string(opt.device)));
  for (const auto& [block, device, path] :
       {std::tuple{"offload_optimizer", opt.device, &opt.nvme_path}, {"offload_param", param.device, &param.nvme_path}})
    if (device == OffloadDevice::Nvme && path->empty()) {
      const std::string key = fmt::format("zero_optimization.{}.nvme_path", block);
      throw ConfigError(fmt::format("{}: expected a directory for the nvme tier (device is \"nvme\"), found {}", key,
                                    written_by_user(c, key) ? show(values.at(key)) : "nothing (the key is not given)"));
    }
  // DeepSpeed's range starts at 0 (axolotl's stage-3 configurations write 0, without nvme); the
  // nvme tier streams sub-groups and needs them non-empty.
  if (opt.device == OffloadDevice::Nvme && c.zero.sub_group_size < 1)
    throw ConfigError("zero_optimization.sub_group_size: expected a positive integer with offload_optimizer.device "
                      "\"nvme\" (the tier reads, steps and writes one sub-group at a time), found 0");
  // The delayed update overlaps the optimizer step of the offloaded partition with the next
  // step's forward and backward; without a tier there is no such step to move.
  if (opt.delayed_update && opt.device == OffloadDevice::None)
    throw ConfigError(
        "zero_optimization.offload_optimizer.delayed_update: true needs offload_optimizer.device \"cpu\" or "
        "\"nvme\" (it delays the offloaded optimizer step), found \"none\"");
  if (opt.nvme_gradients && opt.device == OffloadDevice::Nvme && !c.zero.shard_gradients)
    throw ConfigError(fmt::format(
        "zero_optimization.offload_optimizer.nvme_gradients: true needs sharded gradients (stage 2 or 3), found "
        "stage {} (whose gradients are whole on every rank until they are reduced)",
        c.zero.stage));
  if (opt.nvme_gradients && opt.device == OffloadDevice::Nvme && opt.delayed_update)
    throw ConfigError(
        "zero_optimization.offload_optimizer.nvme_gradients: true cannot be combined with delayed_update (the "
        "delayed step keeps a snapshot of the gradients in memory, which nvme_gradients exists to avoid)");
}

}  // namespace

bool has_auto_rule(const std::string& path) {
  static const std::set<std::string> rules = {
      "gradient_clipping",
      "optimizer.params.lr",
      "optimizer.params.betas",
      "optimizer.params.eps",
      "optimizer.params.weight_decay",
      "scheduler.params.warmup_min_lr",
      "scheduler.params.warmup_max_lr",
      "scheduler.params.warmup_num_steps",
      "scheduler.params.total_num_steps",
      "fp16.enabled",
      "bf16.enabled",
      "zero_optimization.reduce_bucket_size",
      "zero_optimization.stage3_prefetch_bucket_size",
      "zero_optimization.stage3_param_persistence_threshold",
  };
  return rules.count(path) > 0;
}

// The rules of docs/config.md "auto": Hugging Face's Trainer fills these from its arguments; here
// the rest of the configuration and zerotrain's defaults take the arguments' place.
void resolve_auto(TrainConfig& c, Values& values, const std::vector<std::string>& autos) {
  // A model type's own default preset (the GPT's "tiny" is no BERT preset). First, as the rules
  // below read the model's width.
  const ModelRules& model = model_rules(c.model.type);
  if (!model.default_preset.empty() && !written_by_user(c, "model.preset")) {
    c.model.preset = model.default_preset;
    set_derived(c, values, "model.preset", model.default_preset);
  }
  const std::set<std::string> is_auto(autos.begin(), autos.end());
  auto set = [&](const std::string& path, const json& value) {
    values[path] = value;
    if (const Leaf* leaf = find_leaf(path); leaf && leaf->assign) leaf->assign(c, value);
  };
  // The model's width, for the bucket sizes Hugging Face derives from hidden_size.
  auto hidden = [&]() -> int64_t { return c.model.n_embd > 0 ? c.model.n_embd : model.hidden(c); };
  // lr and warmup_max_lr are both the Trainer's learning rate: one given, the other follows.
  const std::string kLr = "optimizer.params.lr", kMaxLr = "scheduler.params.warmup_max_lr";
  if (is_auto.count(kLr) && !is_auto.count(kMaxLr) && written_by_user(c, kMaxLr)) set(kLr, values[kMaxLr]);
  if (is_auto.count(kMaxLr)) set(kMaxLr, values[kLr]);
  if (is_auto.count("scheduler.params.warmup_min_lr")) set("scheduler.params.warmup_min_lr", 0.0);
  // The Trainer's warm-up by default is 0 steps (warmup_steps and warmup_ratio 0), which
  // DeepSpeed's warm-up schedulers raise to their minimum, 2 (max(2, warmup_num_steps)).
  if (is_auto.count("scheduler.params.warmup_num_steps")) set("scheduler.params.warmup_num_steps", int64_t{2});
  if (is_auto.count("scheduler.params.total_num_steps")) set("scheduler.params.total_num_steps", c.train.steps);
  const std::string Z = "zero_optimization.";
  if (is_auto.count(Z + "reduce_bucket_size") || is_auto.count(Z + "stage3_prefetch_bucket_size") ||
      is_auto.count(Z + "stage3_param_persistence_threshold")) {
    const int64_t h = hidden();
    if (is_auto.count(Z + "reduce_bucket_size")) set(Z + "reduce_bucket_size", std::max<int64_t>(1, h * h));
    if (is_auto.count(Z + "stage3_prefetch_bucket_size"))
      set(Z + "stage3_prefetch_bucket_size", static_cast<int64_t>(0.9 * static_cast<double>(h * h)));
    if (is_auto.count(Z + "stage3_param_persistence_threshold"))
      set(Z + "stage3_param_persistence_threshold", 10 * h);
  }
  // Every other "auto" (gradient_clipping, betas, eps, weight_decay, fp16/bf16 enabled, and any key of
  // a block DeepSpeed validates) keeps the default the loop gave it: the Trainer's own defaults
  // for these equal DeepSpeed's, and DeepSpeed drops "auto" inside its validated blocks.
}

void derive(TrainConfig& c, Values& values) {
  derive_batch(c, values);

  // DeepSpeed: "AdamW" means decoupled weight decay whatever adam_w_mode says (engine.py:
  // effective_adam_w_mode); it accepts adam_w_mode false beside it and ignores it, and so does
  // zerotrain, with a note.
  if (c.optimizer.type == "AdamW") {
    if (written_by_user(c, "optimizer.params.adam_w_mode") && !c.optimizer.adam_w_mode)
      c.notes.push_back(
          "optimizer.params.adam_w_mode has no effect: optimizer.type \"AdamW\" always decays weights decoupled, "
          "as in DeepSpeed (type \"Adam\" with adam_w_mode false is Adam with L2 weight decay)");
    c.optimizer.adam_w_mode = true;
  }
  // DeepSpeed ignores parameter offload below stage 3; zerotrain too, with a note.
  if (c.zero.offload_param.device != OffloadDevice::None && c.zero.stage < 3) {
    c.notes.push_back(fmt::format(
        "zero_optimization.offload_param.device has no effect: zero_optimization.stage is {} (parameters are "
        "offloaded only at stage 3, where they are sharded; DeepSpeed ignores it too)",
        c.zero.stage));
    c.zero.offload_param.device = OffloadDevice::None;
  }

  // DeepSpeed's default: overlap_comm is on for stage 3 only.
  if (!written_by_user(c, "zero_optimization.overlap_comm") && c.zero.stage == 3) {
    c.zero.overlap_comm = true;
    set_derived(c, values, "zero_optimization.overlap_comm", true);
  }

  const std::string& type = c.scheduler.type;
  // DeepSpeed's WarmupLR warms up to the optimizer's lr when warmup_max_lr is absent
  // (WarmupDecayLR keeps its literal default 0.001, as in DeepSpeed).
  if (type == "WarmupLR" && !written_by_user(c, "scheduler.params.warmup_max_lr")) {
    c.scheduler.warmup_max_lr = c.optimizer.lr;
    set_derived(c, values, "scheduler.params.warmup_max_lr", c.optimizer.lr);
  }
  // DeepSpeed requires total_num_steps for the decaying schedules; the natural value is the
  // length of the run, so derive it and say so rather than fail.
  if ((type == "WarmupDecayLR" || type == "WarmupCosineLR") && !written_by_user(c, "scheduler.params.total_num_steps")) {
    c.scheduler.total_num_steps = c.train.steps;
    set_derived(c, values, "scheduler.params.total_num_steps", c.train.steps);
  }

  const bool bf16 = values["bf16.enabled"].get<bool>();
  if (c.fp16.enabled && bf16)
    throw ConfigError("fp16.enabled and bf16.enabled are both true: enable at most one of them");
  c.precision = c.fp16.enabled ? Precision::FP16 : bf16 ? Precision::BF16 : Precision::FP32;

  // The activation_checkpointing block given without a policy asks for DeepSpeed's
  // checkpointing: full recomputation of every checkpointed block.
  if (!written_by_user(c, "activation_checkpointing.policy")) {
    bool block_given = false;
    for (const Leaf& leaf : leaves())
      if (leaf.path.starts_with("activation_checkpointing.") && written_by_user(c, leaf.path)) block_given = true;
    if (block_given) {
      c.activation_checkpointing.policy = "full";
      set_derived(c, values, "activation_checkpointing.policy", "full");
    }
  }

  // The stage only sets the switches the engine composes (docs/design.md "Stages as switches").
  set_zero_stage(c.zero, c.zero.stage);
}

namespace {
// The data keys: each read only by the sources and models that use it, so that none is silently
// ignored.
void validate_data(const TrainConfig& c) {
  if (c.data.source != "embedded" && c.data.path.empty())
    throw ConfigError(fmt::format("data.path: required when data.source is \"{}\"", c.data.source));
  // The tokenizer and what goes with it: read by "text", "jsonl" and "finetune" only.
  const bool tokenized_source = c.data.source == "text" || c.data.source == "jsonl" || c.data.source == "finetune";
  if ((c.data.source == "jsonl" || c.data.source == "finetune") && c.data.tokenizer.empty())
    throw ConfigError(fmt::format("data.tokenizer: required when data.source is \"{}\" (a tokenizer.json or a "
                                  "directory holding one)",
                                  c.data.source));
  if (!tokenized_source && written_by_user(c, "data.tokenizer"))
    throw ConfigError(fmt::format("data.tokenizer: read only when data.source is \"text\", \"jsonl\" or "
                                  "\"finetune\", found \"{}\"",
                                  c.data.source));
  for (const char* key : {"data.cache_dir", "data.eos_token"})
    if (c.data.tokenizer.empty() && written_by_user(c, key))
      throw ConfigError(fmt::format("{}: read only with data.tokenizer, which is not set", key));
  if (c.data.source != "finetune" && written_by_user(c, "data.chat_template"))
    throw ConfigError(fmt::format("data.chat_template: read only when data.source is \"finetune\", found \"{}\"",
                                  c.data.source));
  // Packing changes a decoder's attention and positions per example: fine-tuning examples only.
  if (c.data.pack && c.data.source != "finetune")
    throw ConfigError(fmt::format("data.pack: packs fine-tuning examples, read only when data.source is "
                                  "\"finetune\", found \"{}\"",
                                  c.data.source));
  // Data keys the chosen source never reads would be silently ignored.
  if (c.data.source == "embedded" && written_by_user(c, "data.path"))
    throw ConfigError("data.path: not read when data.source is \"embedded\" (set data.source to \"bin\" or \"text\")");
  if (c.data.source != "bin" && written_by_user(c, "data.val_path"))
    throw ConfigError(fmt::format("data.val_path: read only when data.source is \"bin\", found \"{}\"", c.data.source));
  if (!c.data.val_path.empty() && written_by_user(c, "data.val_fraction"))
    throw ConfigError("data.val_fraction: not used when data.val_path names the held-out file (give one of them)");
}
}  // namespace

void validate_semantics(const TrainConfig& c, const Values& values) {
  // Optimizer parameters that the chosen optimizer does not take would be silently ignored.
  if (auto it = optimizer_params().find(c.optimizer.type); it != optimizer_params().end()) {
    for (const Leaf& leaf : leaves()) {
      if (!leaf.path.starts_with("optimizer.params.") || !written_by_user(c, leaf.path)) continue;
      const std::string p = leaf.path.substr(std::string("optimizer.params.").size());
      if (!it->second.count(p))
        throw ConfigError(fmt::format("optimizer.params.{}: not a parameter of {} (its parameters: {})", p,
                                      c.optimizer.type, join(it->second)));
    }
  }
  if (c.optimizer.type == "Lamb" && c.optimizer.min_coeff > c.optimizer.max_coeff)
    throw ConfigError(fmt::format("optimizer.params.min_coeff {} is greater than max_coeff {}", c.optimizer.min_coeff,
                                  c.optimizer.max_coeff));
  if (c.optimizer.type == "SGD" && c.optimizer.nesterov && (c.optimizer.momentum <= 0 || c.optimizer.dampening != 0))
    throw ConfigError("optimizer.params.nesterov: needs momentum > 0 and dampening 0 (as torch.optim.SGD)");
  const std::string& type = c.scheduler.type;
  std::vector<std::string> given_params;
  for (const Leaf& leaf : leaves())
    if (leaf.path.starts_with("scheduler.params.") && written_by_user(c, leaf.path))
      given_params.push_back(leaf.path.substr(std::string("scheduler.params.").size()));

  if (type.empty() && !given_params.empty())
    throw ConfigError(fmt::format(
        "scheduler.params.{} is given but scheduler.type is not set (expected one of WarmupLR, WarmupDecayLR, "
        "WarmupCosineLR, OneCycle, LRRangeTest)",
        given_params.front()));
  if (auto it = scheduler_params().find(type); it != scheduler_params().end()) {
    for (const std::string& p : given_params)
      if (!it->second.count(p))
        throw ConfigError(fmt::format("scheduler.params.{}: not a parameter of {} (its parameters: {})", p, type,
                                      join(it->second)));
  }
  // DeepSpeed's OneCycle takes both bounds without defaults. (Where DeepSpeed only warns, such
  // as a warm-up longer than total_num_steps, the configuration notes it: config.cpp.)
  if (type == "OneCycle")
    for (const char* bound : {"cycle_min_lr", "cycle_max_lr"})
      if (!written_by_user(c, fmt::format("scheduler.params.{}", bound)))
        throw ConfigError(fmt::format(
            "scheduler.params.{}: required for OneCycle (DeepSpeed's OneCycle has no default for it), found nothing",
            bound));

  validate_offload(c, values);
  validate_process_grid(c);

  const ActivationCheckpointingConfig& ac = c.activation_checkpointing;
  if (ac.contiguous_memory_optimization && ac.policy == "selective")
    throw ConfigError(
        "activation_checkpointing.contiguous_memory_optimization: holds the inputs of fully recomputed blocks; "
        "selective recomputation keeps no block inputs (use policy \"full\" or \"auto\", or set it to false)");

  validate_data(c);
  if (c.model.preset.empty()) throw ConfigError("model.preset: expected a preset name, found \"\"");
  // Keys of another model type would be silently ignored: refused, naming the types that read them.
  refuse_keys_of_other_models(c);
  if (const ModelRules& model = model_rules(c.model.type); model.validate) model.validate(c);
  if (c.train.log_dir.empty()) throw ConfigError("train.log_dir: expected a directory path, found \"\"");
}

// The DeepSpeed optimizers zerotrain does not implement, and what each is.
const std::map<std::string, std::string>& unimplemented_optimizers() {
  static const std::map<std::string, std::string> names = {
      {"OneBitAdam", "1-bit Adam (momentum communicated compressed to one bit)"},
      {"ZeroOneAdam", "0/1 Adam (compressed communication with adaptive variance freezing)"},
      {"OneBitLamb", "1-bit LAMB (compressed communication)"},
      {"Adagrad", "Adagrad"},
      {"Lion", "Lion"},
      {"Muon", "Muon"},
      {"MuAdam", "Adam with muP learning-rate scaling"},
      {"MuAdamW", "AdamW with muP learning-rate scaling"},
      {"MuSGD", "SGD with muP learning-rate scaling"},
      // DeepSpeed builds any other torch.optim class by its name.
      {"Adadelta", "torch.optim.Adadelta"},
      {"Adafactor", "torch.optim.Adafactor"},
      {"Adamax", "torch.optim.Adamax"},
      {"ASGD", "torch.optim.ASGD"},
      {"LBFGS", "torch.optim.LBFGS"},
      {"NAdam", "torch.optim.NAdam"},
      {"RAdam", "torch.optim.RAdam"},
      {"RMSprop", "torch.optim.RMSprop"},
      {"Rprop", "torch.optim.Rprop"},
      {"SparseAdam", "torch.optim.SparseAdam"},
  };
  return names;
}

// A dtype key: null (the working precision's) or that dtype itself is what zerotrain does.
void check_dtype_key(const TrainConfig& c, const Values& values, const std::string& key, const char* what) {
  const json& v = values.at(key);
  if (v.is_null() || v.get<std::string>() == to_string(c.precision)) return;
  throw ConfigError(fmt::format("{} = \"{}\" is not supported: {} in another dtype than the working precision ({}) "
                                "is not implemented (null or \"{}\" is accepted)",
                                key, v.get<std::string>(), what, to_string(c.precision), to_string(c.precision)));
}

void validate_support(const TrainConfig& c, const Values& values) {
  if (auto it = unimplemented_optimizers().find(c.optimizer.type); it != unimplemented_optimizers().end())
    throw ConfigError(fmt::format(
        "optimizer.type \"{}\" is not supported: {} is not implemented (zerotrain implements Adam, AdamW, Lamb, SGD)",
        c.optimizer.type, it->second));
  if (!optimizer_params().count(c.optimizer.type))
    throw ConfigError(fmt::format("optimizer.type \"{}\" is not supported (zerotrain implements Adam, AdamW, Lamb, SGD)",
                                  c.optimizer.type));
  check_dtype_key(c, values, "communication_data_type", "gradient reduction");
  check_dtype_key(c, values, "data_types.grad_accum_dtype", "gradient accumulation");
  check_dtype_key(c, values, "data_types.param_dtype", "keeping the model's parameters");
  // FusedLamb's own clipping. DeepSpeed sets it to 0 with a warning outside fp16 (config.py
  // _do_warning_check), so there it has no effect; in fp16 it would clip, which is not implemented.
  if (c.optimizer.type == "Lamb" && values.at("optimizer.params.max_grad_norm").get<double>() > 0 &&
      c.precision == Precision::FP16)
    throw ConfigError(fmt::format(
        "optimizer.params.max_grad_norm = {} is not supported in fp16: Lamb's own gradient clipping is not "
        "implemented (use gradient_clipping; 0 is accepted)",
        values.at("optimizer.params.max_grad_norm").get<double>()));
  // Recognised DeepSpeed keys without an implementation: the default is harmless, anything else
  // would be silently ignored, so refuse it.
  for (const Leaf& leaf : leaves()) {
    if (leaf.supported) continue;
    const json& value = values.at(leaf.path);
    if (engaged(leaf, value))
      throw ConfigError(fmt::format("{} = {} is not supported: {} is not implemented (only {} is accepted)", leaf.path,
                                    show(value), leaf.about,
                                    leaf.kind == Kind::Object ? std::string("the feature switched off")
                                                              : "the default " + show(leaf.def)));
  }
}

}  // namespace zt::config_detail

namespace zt {

LlamaConfig llama_config_of(const TrainConfig& config) {
  const ModelConfig& m = config.model;
  if (!m.init_from.empty()) return read_llama_hf_config(m.init_from, "model.init_from");
  if (!m.config_from.empty()) return read_llama_hf_config(m.config_from, "model.config_from");
  const std::vector<std::string> names = llama_preset_names();
  if (std::find(names.begin(), names.end(), m.preset) == names.end())
    throw ConfigError(fmt::format("model.preset: expected a Llama preset with model.type \"llama\" ({}), found \"{}\"",
                                  fmt::join(names, ", "), m.preset));
  LlamaConfig llama = llama_preset(m.preset);
  if (m.n_layer > 0) llama.num_hidden_layers = m.n_layer;
  if (m.n_head > 0) llama.num_attention_heads = m.n_head;
  if (m.n_kv_head > 0) llama.num_key_value_heads = m.n_kv_head;
  if (m.n_embd > 0) llama.hidden_size = m.n_embd;
  if (m.intermediate_size > 0) llama.intermediate_size = m.intermediate_size;
  if (m.vocab_size > 0) llama.vocab_size = m.vocab_size;
  if (m.context_length > 0) llama.max_position_embeddings = m.context_length;
  // A preset's explicit head_dim (llama-1b's 64) follows a changed width or head count.
  if (m.n_embd > 0 || m.n_head > 0) llama.head_dim = 0;
  // Without a head count, the preset's kv heads stay (fewer q heads than kv heads is refused).
  try {
    llama.validate();
  } catch (const ConfigError& e) {
    // Name our keys, not transformers'.
    static const std::pair<const char*, const char*> ours[] = {
        {"num_hidden_layers", "model.n_layer"}, {"num_attention_heads", "model.n_head"},
        {"num_key_value_heads", "model.n_kv_head"}, {"hidden_size", "model.n_embd"},
        {"intermediate_size", "model.intermediate_size"}, {"vocab_size", "model.vocab_size"},
        {"max_position_embeddings", "model.context_length"}};
    std::string what = e.what();
    for (const auto& [theirs, key] : ours)
      if (what.rfind(std::string("llama ") + theirs + ":", 0) == 0)
        throw ConfigError(std::string(key) + " (" + theirs + ")" + what.substr(6 + std::string(theirs).size()));
    throw;
  }
  return llama;
}

BertConfig bert_config_of(const TrainConfig& config) {
  const ModelConfig& m = config.model;
  const std::vector<std::string> names = bert_preset_names();
  if (std::find(names.begin(), names.end(), m.preset) == names.end())
    throw ConfigError(fmt::format("model.preset: expected a BERT preset with model.type \"bert\" ({}), found \"{}\"",
                                  [&] {
                                    std::string list;
                                    for (const std::string& n : names) list += (list.empty() ? "" : ", ") + n;
                                    return list;
                                  }(),
                                  m.preset));
  BertConfig bert = bert_preset(m.preset);
  if (m.n_layer > 0) bert.n_layer = m.n_layer;
  if (m.n_head > 0) bert.n_head = m.n_head;
  if (m.n_embd > 0) {
    bert.hidden = m.n_embd;
    bert.intermediate = 4 * m.n_embd;
  }
  if (m.vocab_size > 0) bert.vocab_size = m.vocab_size;
  if (m.context_length > 0) bert.max_positions = m.context_length;
  if (m.dropout >= 0) bert.dropout = m.dropout;
  bert.pre_layer_norm = m.pre_layer_norm;
  if (m.next_sentence) bert.next_sentence = *m.next_sentence;
  if (bert.hidden % bert.n_head != 0)
    throw ConfigError(fmt::format("model.n_embd: expected a multiple of model.n_head ({}), found {}", bert.n_head,
                                  bert.hidden));
  if (bert.vocab_size < 5)
    throw ConfigError(fmt::format("model.vocab_size: expected at least 5 with model.type \"bert\" (content ids and the "
                                  "four special tokens), found {}",
                                  bert.vocab_size));
  bert.validate();
  return bert;
}

}  // namespace zt
