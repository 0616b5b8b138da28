// DeepSpeed's WarmupLR / WarmupDecayLR / WarmupCosineLR as pure functions of the step
// (formulas in lr_schedule.h).
#include "zerotrain/lr_schedule.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numbers>

#include "zerotrain/error.h"

namespace zt {

LrSchedule::LrSchedule(const SchedulerConfig& config, double base_lr)
    : config_(config), base_lr_(base_lr), warmup_(std::max<int64_t>(2, config.warmup_num_steps)) {
  const std::string& type = config_.type;
  if (!type.empty() && type != "WarmupLR" && type != "WarmupDecayLR" && type != "WarmupCosineLR")
    throw ConfigError(fmt::format(
        "scheduler.type: expected one of \"\", \"WarmupLR\", \"WarmupDecayLR\", \"WarmupCosineLR\", found \"{}\"", type));
  if (config_.warmup_type != "log" && config_.warmup_type != "linear")
    throw ConfigError(fmt::format("scheduler.params.warmup_type: expected one of \"log\", \"linear\", found \"{}\"",
                                  config_.warmup_type));
  if (type == "WarmupCosineLR" && config_.total_num_steps <= warmup_)
    throw ConfigError(fmt::format(
        "scheduler.params.total_num_steps: expected more than the warm-up steps ({}) for WarmupCosineLR, found {}",
        warmup_, config_.total_num_steps));
}

double LrSchedule::warmup_fraction(int64_t step) const {
  if (config_.warmup_type == "linear") return static_cast<double>(step) / static_cast<double>(warmup_);
  return std::log(static_cast<double>(step + 1)) / std::log(static_cast<double>(warmup_));
}

double LrSchedule::lr_at(int64_t step) const {
  step = std::max<int64_t>(0, step);
  const SchedulerConfig& c = config_;
  if (c.type.empty()) return base_lr_;

  if (c.type == "WarmupLR" || c.type == "WarmupDecayLR") {
    double gamma = 1.0;
    if (step < warmup_) {
      gamma = warmup_fraction(step);
    } else if (c.type == "WarmupDecayLR") {
      gamma = std::max(0.0, static_cast<double>(c.total_num_steps - step) /
                                std::max(1.0, static_cast<double>(c.total_num_steps - warmup_)));
    }
    return c.warmup_min_lr + (c.warmup_max_lr - c.warmup_min_lr) * gamma;
  }

  // WarmupCosineLR: a ratio of the optimizer's base lr.
  double ratio;
  if (step < warmup_) {
    ratio = c.warmup_min_ratio + (1.0 - c.warmup_min_ratio) * warmup_fraction(step);
  } else {
    // Clamp at the last scheduled step: cos(pi * k / n) turns upward for k > n.
    const int64_t s = std::min(step, c.total_num_steps - 1);
    const double k = static_cast<double>(s - warmup_ + 1);
    const double n = static_cast<double>(c.total_num_steps - warmup_);
    const double cosine = (1.0 + std::cos(std::numbers::pi * k / n)) / 2.0;
    ratio = std::max(0.0, c.cos_min_ratio + (1.0 - c.cos_min_ratio) * cosine);
  }
  return base_lr_ * ratio;
}

}  // namespace zt
