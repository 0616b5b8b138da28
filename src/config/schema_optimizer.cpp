// The key table's optimizer and learning-rate scheduler.
#include "config/schema_keys.h"

namespace zt::config_detail::keys {

// The "optimizer" block.
void add_optimizer_keys(std::vector<Leaf>& t) {
  auto none = nullptr;
  // --- optimizer. Type names compare case-insensitively, as in DeepSpeed.
  {
    Leaf type = string("optimizer.type", "Adam", ZT_FIELD(optimizer.type),
                       {"Adam", "AdamW", "Lamb", "SGD", "OneBitAdam", "ZeroOneAdam", "OneBitLamb", "Adagrad", "Lion",
                        "Muon", "MuAdam", "MuAdamW", "MuSGD",
                        // Any other torch.optim class DeepSpeed builds by its name (torch 2.11's).
                        "Adadelta", "Adafactor", "Adamax", "ASGD", "LBFGS", "NAdam", "RAdam", "RMSprop", "Rprop",
                        "SparseAdam"});
    type.case_insensitive = true;
    t.push_back(std::move(type));
  }
  t.push_back(non_negative("optimizer.params.lr", 1e-3, ZT_FIELD(optimizer.lr)));  // 0: a warm-up from 0, as torch allows
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
  t.push_back(reserved(boolean("optimizer.params.amsgrad", false, none), "the AMSGrad variant"));
  t.push_back(inert(boolean("optimizer.params.torch_adam", false, none),
                    "it picks torch.optim.AdamW over DeepSpeed's fused kernel; zerotrain always uses its own fused "
                    "kernel, whose math is the same"));
  t.push_back(inert(boolean("optimizer.params.fused", false, none),
                    "it picks torch's fused Adam kernel; zerotrain always uses its own fused kernel, whose math is "
                    "the same"));
  t.push_back(reserved(boolean("optimizer.params.fp32_optimizer_states", true, none),
                       "optimizer states in the working precision (zerotrain keeps them in fp32)"));
  // Lamb (DeepSpeed's FusedLamb): its own clipping before the trust ratio; validate_support.
  t.push_back(non_negative("optimizer.params.max_grad_norm", 0.0, ZT_FIELD(optimizer.lamb_max_grad_norm)));
  t.push_back(reserved(boolean("optimizer.params.eps_inside_sqrt", false, none), "epsilon inside the square root"));
  t.push_back(inert(boolean("optimizer.legacy_fusion", false, none),
                    "it picks DeepSpeed's older fused fp16 optimizer; zerotrain has one implementation"));
}

// The "scheduler" block.
void add_scheduler_keys(std::vector<Leaf>& t) {
  // --- scheduler (DeepSpeed's parameter names and defaults; which ones a type takes:
  // validate_semantics)
  t.push_back(string("scheduler.type", "", ZT_FIELD(scheduler.type),
                     {"", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"}));
  t.push_back(non_negative("scheduler.params.warmup_min_lr", 0.0, ZT_FIELD(scheduler.warmup_min_lr)));
  t.push_back(positive("scheduler.params.warmup_max_lr", 1e-3, ZT_FIELD(scheduler.warmup_max_lr)));
  // DeepSpeed raises for warmup_num_steps <= 0.
  t.push_back(integer("scheduler.params.warmup_num_steps", 1000, 1, std::nullopt,
                      ZT_FIELD(scheduler.warmup_num_steps)));
  // DeepSpeed warns about any other warm-up type and runs "log": accepted, noted (config.cpp).
  t.push_back(string("scheduler.params.warmup_type", "log", ZT_FIELD(scheduler.warmup_type)));
  // 0 until derived: DeepSpeed requires it for WarmupDecayLR / WarmupCosineLR; we derive it
  // from train.steps when absent (and say so in the sources).
  t.push_back(integer("scheduler.params.total_num_steps", 0, 1, std::nullopt, ZT_FIELD(scheduler.total_num_steps)));
  t.push_back(number("scheduler.params.cos_min_ratio", 1e-4, 0.0, false, 1.0, false, ZT_FIELD(scheduler.cos_min_ratio)));
  t.push_back(number("scheduler.params.warmup_min_ratio", 0.0, 0.0, false, 1.0, false,
                     ZT_FIELD(scheduler.warmup_min_ratio)));
  // OneCycle. cycle_min_lr / cycle_max_lr have no default in DeepSpeed (null here; required for
  // OneCycle by validate_semantics); an explicit null is refused as DeepSpeed would fail on it.
  t.push_back(non_negative("scheduler.params.cycle_min_lr", 0.0, [](TrainConfig& c, const json& v) {
    c.scheduler.cycle_min_lr = v.is_null() ? std::nullopt : std::optional<double>(v.get<double>());
  }));
  t.back().def = nullptr;
  t.push_back(non_negative("scheduler.params.cycle_max_lr", 0.0, [](TrainConfig& c, const json& v) {
    c.scheduler.cycle_max_lr = v.is_null() ? std::nullopt : std::optional<double>(v.get<double>());
  }));
  t.back().def = nullptr;
  t.push_back(non_negative("scheduler.params.decay_lr_rate", 0.0, ZT_FIELD(scheduler.decay_lr_rate)));
  // DeepSpeed takes the step sizes as float(...): fractional sizes are valid there.
  t.push_back(positive("scheduler.params.cycle_first_step_size", 2000, ZT_FIELD(scheduler.cycle_first_step_size)));
  t.push_back(nullable(non_negative("scheduler.params.cycle_second_step_size", 0.0, [](TrainConfig& c, const json& v) {
    c.scheduler.cycle_second_step_size = v.is_null() ? std::nullopt : std::optional<double>(v.get<double>());
  })));
  t.back().def = nullptr;
  // A stair count <= 0 is the continuous cycle (DeepSpeed's command-line default is -1).
  t.push_back(integer("scheduler.params.cycle_first_stair_count", 0, std::nullopt, std::nullopt,
                      ZT_FIELD(scheduler.cycle_first_stair_count)));
  t.push_back(nullable(integer("scheduler.params.cycle_second_stair_count", 0, std::nullopt, std::nullopt,
                               [](TrainConfig& c, const json& v) {
                                 c.scheduler.cycle_second_stair_count =
                                     v.is_null() ? std::nullopt : std::optional<int64_t>(v.get<int64_t>());
                               })));
  t.back().def = nullptr;
  t.push_back(integer("scheduler.params.decay_step_size", 0, 0, std::nullopt, ZT_FIELD(scheduler.decay_step_size)));
  t.push_back(boolean("scheduler.params.cycle_momentum", true, ZT_FIELD(scheduler.cycle_momentum)));
  t.push_back(number("scheduler.params.cycle_min_mom", 0.8, 0.0, false, 1.0, true, ZT_FIELD(scheduler.cycle_min_mom)));
  t.push_back(number("scheduler.params.cycle_max_mom", 0.9, 0.0, false, 1.0, true, ZT_FIELD(scheduler.cycle_max_mom)));
  t.push_back(non_negative("scheduler.params.decay_mom_rate", 0.0, ZT_FIELD(scheduler.decay_mom_rate)));
  // LRRangeTest (DeepSpeed raises for a step size <= 0).
  t.push_back(non_negative("scheduler.params.lr_range_test_min_lr", 1e-3, ZT_FIELD(scheduler.lr_range_test_min_lr)));
  t.push_back(integer("scheduler.params.lr_range_test_step_size", 2000, 1, std::nullopt,
                      ZT_FIELD(scheduler.lr_range_test_step_size)));
  t.push_back(non_negative("scheduler.params.lr_range_test_step_rate", 1.0,
                           ZT_FIELD(scheduler.lr_range_test_step_rate)));
  t.push_back(boolean("scheduler.params.lr_range_test_staircase", false, ZT_FIELD(scheduler.lr_range_test_staircase)));
}

}  // namespace zt::config_detail::keys
