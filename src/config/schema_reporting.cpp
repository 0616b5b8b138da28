// The key table's precision, activation checkpointing, monitors and reports.
#include "config/schema_keys.h"

#include <limits>

namespace zt::config_detail::keys {

// The "fp16" and "bf16" blocks.
void add_precision_keys(std::vector<Leaf>& t) {
  auto none = nullptr;
  // --- precision. fp16/bf16 "enabled" become TrainConfig::precision in derive().
  t.push_back(boolean("fp16.enabled", false, ZT_FIELD(fp16.enabled)));
  t.push_back(non_negative("fp16.loss_scale", 0.0, ZT_FIELD(fp16.loss_scale)));
  t.push_back(integer("fp16.initial_scale_power", 16, 0, 63, ZT_FIELD(fp16.initial_scale_power)));
  constexpr double kIntMax = std::numeric_limits<int>::max();  // these two are `int` fields
  t.push_back(integer("fp16.loss_scale_window", 1000, 1, kIntMax, ZT_FIELD(fp16.loss_scale_window)));
  t.push_back(integer("fp16.hysteresis", 2, 1, kIntMax, ZT_FIELD(fp16.hysteresis)));
  t.push_back(positive("fp16.min_loss_scale", 1.0, ZT_FIELD(fp16.min_loss_scale)));
  t.push_back(reserved(boolean("fp16.auto_cast", false, none),
                       "autocast of fp16 operations (zerotrain casts the whole model to the working precision)"));
  t.push_back(reserved(boolean("fp16.consecutive_hysteresis", false, none),
                       "a hysteresis refilled by every step without overflow"));
  t.push_back(reserved(boolean("fp16.fp16_master_weights_and_grads", false, none),
                       "fp16 master weights and gradients (zerotrain keeps fp32 masters)"));
  t.push_back(boolean("bf16.enabled", false, none));
  // DeepSpeed's bf16 optimizer (chosen only with data_types.grad_accum_dtype "fp32" below stage 2)
  // adds each micro-step's bf16 gradient into an fp32 accumulator; the flag only chooses whether
  // per parameter during backward or all after it, with the same sums (docs/config.md).
  t.push_back(inert(boolean("bf16.immediate_grad_update", false, none),
                    "it only times when DeepSpeed's bf16 optimizer (data_types.grad_accum_dtype \"fp32\") adds "
                    "gradients into its fp32 accumulator, which zerotrain does not have; the sums are the same"));
  t.push_back(reserved(boolean("bf16.check_grad_overflow", true, none),
                       "stepping over inf/NaN gradients (zerotrain always skips such a step)"));
  t.push_back(reserved(boolean("bf16.bf16_master_weights_and_grads", false, none),
                       "bf16 master weights and gradients (zerotrain keeps fp32 masters)"));
  t.push_back(reserved(boolean("bf16.bf16_optimizer_states", false, none),
                       "bf16 optimizer states (zerotrain keeps them in fp32)"));
}

// The "activation_checkpointing" block.
void add_activation_checkpointing_keys(std::vector<Leaf>& t) {
  // --- activation checkpointing (docs/activation_checkpointing.md)
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
}

// The monitors' blocks.
void add_monitor_keys(std::vector<Leaf>& t) {
  auto none = nullptr;
  // --- monitoring
  t.push_back(boolean("csv_monitor.enabled", true, ZT_FIELD(csv_monitor.enabled)));
  t.push_back(string("csv_monitor.output_path", "", ZT_FIELD(csv_monitor.output_path)));
  t.push_back(string("csv_monitor.job_name", "zerotrain", ZT_FIELD(csv_monitor.job_name)));
  // DeepSpeed's other monitors (deepspeed/monitor/config.py): zerotrain writes only the CSV log.
  const char* kTensorboard = "DeepSpeed's TensorBoard monitor (zerotrain writes the CSV log, csv_monitor)";
  t.push_back(reporting(boolean("tensorboard.enabled", false, none), kTensorboard));
  t.push_back(reporting(string("tensorboard.output_path", "", none), kTensorboard));
  t.push_back(reporting(string("tensorboard.job_name", "DeepSpeedJobName", none), kTensorboard));
  const char* kWandb = "DeepSpeed's Weights & Biases monitor (zerotrain writes the CSV log, csv_monitor)";
  t.push_back(reporting(boolean("wandb.enabled", false, none), kWandb));
  t.push_back(reporting(nullable_string("wandb.group"), kWandb));
  t.push_back(reporting(nullable_string("wandb.team"), kWandb));
  t.push_back(reporting(string("wandb.project", "deepspeed", none), kWandb));
  const char* kComet = "DeepSpeed's Comet monitor (zerotrain writes the CSV log, csv_monitor)";
  t.push_back(reporting(boolean("comet.enabled", false, none), kComet));
  t.push_back(reporting(integer("comet.samples_log_interval", 100, 0, std::nullopt, none), kComet));
  for (const char* key : {"project", "workspace", "api_key", "experiment_name", "experiment_key", "mode"})
    t.push_back(reporting(nullable_string(std::string("comet.") + key), kComet));
  t.push_back(reporting(nullable(boolean("comet.online", false, none)), kComet));
  t.back().def = nullptr;
}

// DeepSpeed's reports: the "flops_profiler" and "comms_logger" blocks.
void add_report_keys(std::vector<Leaf>& t) {
  // --- reporting: DeepSpeed's flops_profiler and comms_logger (docs/config.md "Reporting")
  t.push_back(boolean("flops_profiler.enabled", false, ZT_FIELD(flops_profiler.enabled)));
  t.push_back(non_negative("flops_profiler.recompute_fwd_factor", 0.0, ZT_FIELD(flops_profiler.recompute_fwd_factor)));
  t.push_back(integer("flops_profiler.profile_step", 1, 1, std::nullopt, ZT_FIELD(flops_profiler.profile_step)));
  t.push_back(integer("flops_profiler.module_depth", -1, -1, 1 << 10, ZT_FIELD(flops_profiler.module_depth)));
  t.push_back(integer("flops_profiler.top_modules", 1, 1, 1 << 20, ZT_FIELD(flops_profiler.top_modules)));
  t.push_back(boolean("flops_profiler.detailed", true, ZT_FIELD(flops_profiler.detailed)));
  t.push_back(nullable(string("flops_profiler.output_file", "", [](TrainConfig& c, const json& v) {
    c.flops_profiler.output_file = v.is_null() ? std::string() : v.get<std::string>();
  })));
  t.back().def = nullptr;
  t.push_back(boolean("comms_logger.enabled", false, ZT_FIELD(comms_logger.enabled)));
  t.push_back(boolean("comms_logger.verbose", false, ZT_FIELD(comms_logger.verbose)));
  t.push_back(boolean("comms_logger.prof_all", true, ZT_FIELD(comms_logger.prof_all)));
  t.push_back(boolean("comms_logger.debug", false, ZT_FIELD(comms_logger.debug)));
  t.push_back(make("comms_logger.prof_ops", Kind::StringList, json::array(), ZT_FIELD(comms_logger.prof_ops)));
}

}  // namespace zt::config_detail::keys
