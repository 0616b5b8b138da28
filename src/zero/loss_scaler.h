// Loss scaling for fp16 training (docs/design.md "Loss scaling and overflow skipping"), with
// DeepSpeed's DynamicLossScaler semantics so that a DeepSpeed user's "fp16" block means the same
// thing here:
// - dynamic (loss_scale 0): start at 2^initial_scale_power; an overflowed step consumes one unit
//   of hysteresis, and when none is left halves the scale (never below min_loss_scale); after
//   loss_scale_window consecutive steps since the last overflow the scale doubles and the
//   hysteresis is restored.
// - static (loss_scale > 0): the scale never changes; overflowed steps are still skipped.
// - disabled (bf16, fp32): the scale is 1.
// Plain value type; not thread-safe.
#pragma once
#include <cstdint>

#include "zerotrain/config/config.h"

namespace zt {

class LossScaler {
 public:
  LossScaler() = default;  // disabled: scale 1
  explicit LossScaler(const LossScaleConfig& config);

  double scale() const { return scale_; }
  bool dynamic() const { return dynamic_; }
  // Records the outcome of one optimizer step (overflow: some gradient was inf/NaN).
  void update(bool overflow);

  // The whole state, for checkpoints and tests.
  struct State {
    double scale = 1.0;
    int hysteresis_left = 1;
    int64_t iteration = 0;
    int64_t last_overflow_iteration = -1;
  };
  State state() const { return {scale_, hysteresis_left_, iteration_, last_overflow_iteration_}; }
  void restore(const State& state);

 private:
  bool dynamic_ = false;
  double scale_ = 1.0;
  double min_scale_ = 1.0;
  int window_ = 1000;
  int hysteresis_ = 1;
  int hysteresis_left_ = 1;
  int64_t iteration_ = 0;
  int64_t last_overflow_iteration_ = -1;
};

}  // namespace zt
