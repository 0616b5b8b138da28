// Learning-rate schedules with DeepSpeed's formulas (deepspeed/runtime/lr_schedules.py).
//
// lr_at(step) is a pure function of the step: no state to save or restore, so a resumed run
// continues on the same curve. `step` is the number of optimizer steps already applied (0 for the
// first step; the engine does not count steps skipped for an fp16 overflow, as DeepSpeed) and plays the role of DeepSpeed's `last_batch_iteration`: lr_at(s) is the value
// DeepSpeed's scheduler reports after its (s+1)-th step(). (DeepSpeed steps its scheduler after
// the optimizer, so there the value is applied one optimizer step later and the very first step
// runs at the pre-start lr; zerotrain applies lr_at(s) to step s.)
//
//   ""               constant base_lr.
//   "WarmupLR"       W = max(2, warmup_num_steps); for s < W:
//                      log:    min + (max - min) * ln(s + 1) / ln(W)
//                      linear: min + (max - min) * s / W
//                    then max.  (min, max: warmup_min_lr, warmup_max_lr; base_lr unused)
//   "WarmupDecayLR"  warm-up as WarmupLR, then
//                    min + (max - min) * max(0, (total - s) / max(1, total - W)).
//   "WarmupCosineLR" ratios of base_lr: warm-up ratio r0 + (1 - r0) * (log or linear fraction as
//                    above), r0 = warmup_min_ratio; then with k = s - W + 1, n = total - W:
//                    max(0, c + (1 - c) * (1 + cos(pi * k / n)) / 2), c = cos_min_ratio.
//                    Past total - 1 it stays at c (DeepSpeed's formula would rise again).
#pragma once
#include <cstdint>

#include "zerotrain/config.h"

namespace zt {

class LrSchedule {
 public:
  // Throws ConfigError for an unknown type or warmup_type, or a WarmupCosineLR whose
  // total_num_steps does not exceed the warm-up.
  explicit LrSchedule(const SchedulerConfig& config, double base_lr);

  double lr_at(int64_t step) const;

  const SchedulerConfig& config() const { return config_; }
  double base_lr() const { return base_lr_; }
  // Warm-up length as DeepSpeed uses it: max(2, warmup_num_steps).
  int64_t warmup_steps() const { return warmup_; }

 private:
  double warmup_fraction(int64_t step) const;  // in [0, 1) for step < warmup_

  SchedulerConfig config_;
  double base_lr_;
  int64_t warmup_;
};

}  // namespace zt
