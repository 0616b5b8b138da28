#include "zero/loss_scaler.h"

#include <algorithm>
#include <cmath>

namespace zt {

LossScaler::LossScaler(const LossScaleConfig& config) {
  if (!config.enabled) return;
  dynamic_ = config.loss_scale == 0.0;
  scale_ = dynamic_ ? std::ldexp(1.0, config.initial_scale_power) : config.loss_scale;
  min_scale_ = config.min_loss_scale;
  window_ = config.loss_scale_window;
  hysteresis_ = hysteresis_left_ = config.hysteresis;
}

void LossScaler::update(bool overflow) {
  if (dynamic_) {
    if (overflow) {
      // DeepSpeed: halve once the hysteresis is used up, else only consume one unit of it.
      if (hysteresis_ == 1 || hysteresis_left_ == 1)
        scale_ = std::max(scale_ / 2.0, min_scale_);
      else
        --hysteresis_left_;
      last_overflow_iteration_ = iteration_;
    } else if ((iteration_ - last_overflow_iteration_) % window_ == 0) {
      hysteresis_left_ = hysteresis_;
      scale_ *= 2.0;
    }
  }
  ++iteration_;
}

void LossScaler::restore(const State& state) {
  scale_ = state.scale;
  hysteresis_left_ = state.hysteresis_left;
  iteration_ = state.iteration;
  last_overflow_iteration_ = state.last_overflow_iteration;
}

}  // namespace zt
