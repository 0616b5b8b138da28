// DeepSpeed's learning-rate schedulers as pure functions of the step (formulas in
// lr_schedule.h). The arithmetic follows lr_schedules.py operation by operation, so the values
// agree with DeepSpeed's to the last bit or so (tests/lr_schedule_test.cpp compares them with
// values computed by DeepSpeed's own classes).
#include "zerotrain/optim/lr_schedule.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numbers>

#include "zerotrain/error.h"

namespace zt {
namespace {

// DeepSpeed sets beta2 to this constant whenever OneCycle cycles the momentum.
constexpr double kOneCycleBeta2 = 0.99;

bool is_warmup_type(const std::string& type) {
  return type == "WarmupLR" || type == "WarmupDecayLR" || type == "WarmupCosineLR";
}

}  // namespace

LrSchedule::LrSchedule(const SchedulerConfig& config, double base_lr)
    : config_(config),
      base_lr_(base_lr),
      warmup_(std::max<int64_t>(2, config.warmup_num_steps)),
      log_warmup_(config.warmup_type != "linear") {
  const SchedulerConfig& c = config_;
  const std::string& type = c.type;
  if (!type.empty() && !is_warmup_type(type) && type != "OneCycle" && type != "LRRangeTest")
    throw ConfigError(fmt::format(
        "scheduler.type: expected one of \"\", \"WarmupLR\", \"WarmupDecayLR\", \"WarmupCosineLR\", \"OneCycle\", "
        "\"LRRangeTest\", found \"{}\"",
        type));
  if (is_warmup_type(type) && c.warmup_num_steps < 1)
    throw ConfigError(fmt::format("scheduler.params.warmup_num_steps: expected a positive integer for {}, found {}",
                                  type, c.warmup_num_steps));
  if (type == "OneCycle") {
    if (!c.cycle_min_lr || !c.cycle_max_lr)
      throw ConfigError(fmt::format("scheduler.params.{}: required for OneCycle (it has no default), found nothing",
                                    c.cycle_min_lr ? "cycle_max_lr" : "cycle_min_lr"));
    first_size_ = c.cycle_first_step_size;
    second_size_ = c.cycle_second_step_size ? *c.cycle_second_step_size : first_size_;
    if (!(first_size_ > 0))
      throw ConfigError(fmt::format("scheduler.params.cycle_first_step_size: expected a positive number, found {}",
                                    first_size_));
    if (!(second_size_ >= 0))
      throw ConfigError(fmt::format(
          "scheduler.params.cycle_second_step_size: expected a non-negative number, found {}", second_size_));
    total_size_ = first_size_ + second_size_;
    step_ratio_ = first_size_ / total_size_;
    first_stairs_ = c.cycle_first_stair_count;
    second_stairs_ = c.cycle_second_stair_count ? *c.cycle_second_stair_count : first_stairs_;
  }
  if (type == "LRRangeTest" && c.lr_range_test_step_size < 1)
    throw ConfigError(fmt::format("scheduler.params.lr_range_test_step_size: expected a positive integer, found {}",
                                  c.lr_range_test_step_size));
}

double LrSchedule::warmup_gamma(int64_t i) const {
  if (log_warmup_) return (1.0 / std::log(static_cast<double>(warmup_))) * std::log(static_cast<double>(i + 1));
  return static_cast<double>(i) / static_cast<double>(warmup_);
}

// OneCycle's _get_scale_factor: where in the cycle batch i + 1 falls, 0 at cycle_min_lr, 1 at
// the peak.
double LrSchedule::cycle_scale(int64_t i) const {
  const double batch = static_cast<double>(i + 1);
  const double cycle = std::floor(1.0 + batch / total_size_);
  const double x = 1.0 + batch / total_size_ - cycle;
  double scale;
  int64_t stairs;
  if (x <= step_ratio_) {
    scale = x / step_ratio_;
    stairs = first_stairs_;
  } else {
    scale = (x - 1.0) / (step_ratio_ - 1.0);
    stairs = second_stairs_;
  }
  // Stairs are counted from the integer offset in the cycle, as DeepSpeed does, so a float scale
  // just under a stair boundary does not drop a whole stair.
  if (stairs > 0) {
    const double in_cycle = std::fmod(batch, total_size_);
    const double position = in_cycle <= first_size_
                                ? in_cycle * static_cast<double>(stairs) / first_size_
                                : (total_size_ - in_cycle) * static_cast<double>(stairs) / second_size_;
    scale = std::floor(position) / static_cast<double>(stairs);
  }
  return scale;
}

double LrSchedule::lr_after(int64_t i) const {
  const SchedulerConfig& c = config_;
  const std::string& type = c.type;
  if (type == "WarmupLR" || type == "WarmupDecayLR") {
    double gamma = 1.0;
    if (i < warmup_) {
      gamma = warmup_gamma(i);
    } else if (type == "WarmupDecayLR") {
      gamma = std::max(0.0, static_cast<double>(c.total_num_steps - i) /
                                std::max(1.0, static_cast<double>(c.total_num_steps - warmup_)));
    }
    return c.warmup_min_lr + (c.warmup_max_lr - c.warmup_min_lr) * gamma;
  }
  if (type == "WarmupCosineLR") {
    double ratio;
    if (i < warmup_) {
      ratio = c.warmup_min_ratio + warmup_gamma(i) * (1.0 - c.warmup_min_ratio);
    } else {
      // Progress clamped to 1: past total_num_steps (or with no room after the warm-up at all)
      // the ratio stays at cos_min_ratio.
      const int64_t done = i - warmup_ + 1;
      const int64_t span = std::max<int64_t>(1, c.total_num_steps - warmup_);
      const double progress = std::min(1.0, static_cast<double>(done) / static_cast<double>(span));
      const double cosine = (1.0 + std::cos(std::numbers::pi * progress)) / 2.0;
      ratio = std::max(0.0, c.cos_min_ratio + (1.0 - c.cos_min_ratio) * cosine);
    }
    return base_lr_ * ratio;
  }
  if (type == "OneCycle") {
    const double min_lr = *c.cycle_min_lr, max_lr = *c.cycle_max_lr;
    if (static_cast<double>(i) < total_size_) return min_lr + (max_lr - min_lr) * cycle_scale(i);
    if (c.decay_step_size == 0 || c.decay_lr_rate == 0.0) return min_lr;
    const double decay_steps = static_cast<double>(i) - total_size_ + 1.0;
    const double interval = decay_steps / static_cast<double>(c.decay_step_size);
    return min_lr / (1.0 + c.decay_lr_rate * interval);
  }
  if (type == "LRRangeTest") {
    double interval = static_cast<double>(i + 1) / static_cast<double>(c.lr_range_test_step_size);
    if (c.lr_range_test_staircase) interval = std::floor(interval);
    return c.lr_range_test_min_lr * (1.0 + c.lr_range_test_step_rate * interval);
  }
  return base_lr_;
}

double LrSchedule::lr_at(int64_t step) const {
  const SchedulerConfig& c = config_;
  if (c.type.empty()) return base_lr_;
  const int64_t i = std::max<int64_t>(0, step) - 1;  // DeepSpeed's last_batch_iteration
  if (i >= 0) return lr_after(i);
  // What the scheduler's constructor puts in the optimizer before its first step().
  if (c.type == "WarmupLR" || c.type == "WarmupDecayLR") return c.warmup_min_lr;
  if (c.type == "WarmupCosineLR") return 0.0;
  if (c.type == "OneCycle") return *c.cycle_min_lr;
  return c.lr_range_test_min_lr;  // LRRangeTest
}

std::optional<Betas> LrSchedule::betas_at(int64_t step) const {
  const SchedulerConfig& c = config_;
  if (c.type != "OneCycle" || !c.cycle_momentum) return std::nullopt;
  const int64_t i = std::max<int64_t>(0, step) - 1;
  // The constructor installs cycle_min_mom, although the cycle itself starts at cycle_max_mom.
  if (i < 0) return Betas{c.cycle_min_mom, kOneCycleBeta2};
  if (static_cast<double>(i) < total_size_)
    return Betas{c.cycle_max_mom - (c.cycle_max_mom - c.cycle_min_mom) * cycle_scale(i), kOneCycleBeta2};
  if (c.decay_step_size == 0 || c.decay_mom_rate == 0.0) return Betas{c.cycle_max_mom, kOneCycleBeta2};
  const double decay_steps = static_cast<double>(i) - total_size_ + 1.0;
  const double interval = decay_steps / static_cast<double>(c.decay_step_size);
  return Betas{c.cycle_max_mom * (1.0 + c.decay_mom_rate * interval), kOneCycleBeta2};
}

}  // namespace zt
