// Learning-rate (and OneCycle momentum) schedules with DeepSpeed's formulas
// (deepspeed/runtime/lr_schedules.py of DeepSpeed 0.19; formulas in docs/optim.md).
//
// Pure functions of the step: no state to save or restore, so a resumed run continues on the
// same curve. `step` is the number of optimizer steps applied before this one (0 for the first;
// steps skipped for an fp16 overflow do not count, as DeepSpeed steps its scheduler only after an
// applied optimizer step). lr_at(step) is the lr DeepSpeed's optimizer uses for that step: the
// scheduler's value after `step` calls of scheduler.step(), that is at DeepSpeed's
// last_batch_iteration = step - 1. The first step therefore runs at the value the scheduler's
// constructor installs (last_batch_iteration -1):
//   WarmupLR, WarmupDecayLR: warmup_min_lr;  WarmupCosineLR: 0;  OneCycle: cycle_min_lr (and
//   beta1 cycle_min_mom);  LRRangeTest: lr_range_test_min_lr.
//
// With i = step - 1 >= 0, W = max(2, warmup_num_steps), T = total_num_steps:
//   ""               constant base_lr.
//   "WarmupLR"       min + (max - min) * g;  g = ln(i + 1) / ln W ("log") or i / W ("linear")
//                    for i < W, then 1.  (min, max: warmup_min_lr, warmup_max_lr)
//   "WarmupDecayLR"  as WarmupLR, then g = max(0, (T - i) / max(1, T - W)).
//   "WarmupCosineLR" base_lr * ratio; warm-up ratio r0 + (1 - r0) * g (r0 = warmup_min_ratio),
//                    then with p = min(1, (i - W + 1) / max(1, T - W)), c = cos_min_ratio:
//                    max(0, c + (1 - c) * (1 + cos(pi p)) / 2)  (held at c past T).
//   "OneCycle"       one cycle of cycle_first_step_size steps up and cycle_second_step_size
//                    steps down between cycle_min_lr and cycle_max_lr (stairs when the stair
//                    counts are > 0), beta1 inversely between cycle_max_mom and cycle_min_mom;
//                    after the cycle lr = cycle_min_lr / (1 + decay_lr_rate * d / decay_step_size)
//                    and beta1 = cycle_max_mom * (1 + decay_mom_rate * d / decay_step_size),
//                    d = steps since the cycle ended.
//   "LRRangeTest"    lr_range_test_min_lr * (1 + step_rate * (i + 1) / step_size)
//                    ((i + 1) / step_size rounded down with lr_range_test_staircase).
// An unknown warmup_type runs "log", as DeepSpeed (the configuration notes it).
#pragma once
#include <cstdint>
#include <optional>

#include "zerotrain/config/config.h"

namespace zt {

// Adam's / LAMB's (beta1, beta2) for one step.
struct Betas {
  double beta1 = 0.9, beta2 = 0.999;
};

class LrSchedule {
 public:
  // Throws ConfigError for an unknown type or a parameter DeepSpeed's constructor rejects
  // (warmup_num_steps < 1, cycle_first_step_size <= 0, cycle_second_step_size < 0,
  // lr_range_test_step_size < 1, OneCycle without cycle_min_lr / cycle_max_lr).
  explicit LrSchedule(const SchedulerConfig& config, double base_lr);

  double lr_at(int64_t step) const;

  // OneCycle with cycle_momentum: the betas DeepSpeed puts in the optimizer's param group for
  // that step, (beta1 cycled, beta2 0.99). Otherwise none: the optimizer keeps its own betas.
  // DeepSpeed cycles only optimizers with betas; the caller leaves SGD alone.
  std::optional<Betas> betas_at(int64_t step) const;

  const SchedulerConfig& config() const { return config_; }
  double base_lr() const { return base_lr_; }
  // Warm-up length as DeepSpeed uses it: max(2, warmup_num_steps).
  int64_t warmup_steps() const { return warmup_; }

 private:
  // DeepSpeed's get_lr() / the warm-up gamma / OneCycle's scale at last_batch_iteration i >= 0.
  double lr_after(int64_t i) const;
  double warmup_gamma(int64_t i) const;
  double cycle_scale(int64_t i) const;

  SchedulerConfig config_;
  double base_lr_;
  int64_t warmup_;
  bool log_warmup_;
  // OneCycle's cycle shape, as DeepSpeed's _initialize_cycle computes it (floats).
  double first_size_ = 0, second_size_ = 0, total_size_ = 0, step_ratio_ = 0;
  int64_t first_stairs_ = 0, second_stairs_ = 0;
};

}  // namespace zt
