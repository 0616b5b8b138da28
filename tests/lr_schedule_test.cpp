// LR schedules against values worked out by hand from DeepSpeed's formulas
// (deepspeed/runtime/lr_schedules.py; `step` = DeepSpeed's last_batch_iteration).
#include <gtest/gtest.h>

#include <cmath>

#include "zerotrain/config.h"
#include "zerotrain/error.h"
#include "zerotrain/lr_schedule.h"

namespace {

using zt::LrSchedule;
using zt::SchedulerConfig;

constexpr double kTol = 1e-15;

SchedulerConfig warmup(const std::string& type, const std::string& warmup_type, int64_t warmup_steps) {
  SchedulerConfig c;
  c.type = type;
  c.warmup_type = warmup_type;
  c.warmup_num_steps = warmup_steps;
  return c;
}

TEST(LrSchedule, ConstantWithoutType) {
  const LrSchedule s(SchedulerConfig{}, 3e-4);
  EXPECT_EQ(s.lr_at(0), 3e-4);
  EXPECT_EQ(s.lr_at(12345), 3e-4);
}

TEST(LrSchedule, WarmupLRLog) {
  SchedulerConfig c = warmup("WarmupLR", "log", 10);
  c.warmup_min_lr = 0.0;
  c.warmup_max_lr = 1e-3;
  const LrSchedule s(c, /*base_lr, unused by WarmupLR*/ 5.0);
  EXPECT_NEAR(s.lr_at(0), 0.0, kTol);                     // ln(1)/ln(10) = 0
  EXPECT_NEAR(s.lr_at(1), 3.010299956639812e-4, kTol);    // 1e-3 * ln 2 / ln 10
  EXPECT_NEAR(s.lr_at(4), 6.989700043360187e-4, kTol);    // 1e-3 * ln 5 / ln 10
  EXPECT_NEAR(s.lr_at(9), 1e-3, kTol);                    // ln 10 / ln 10 = 1
  EXPECT_NEAR(s.lr_at(10), 1e-3, kTol);                   // after warm-up: max
  EXPECT_NEAR(s.lr_at(100000), 1e-3, kTol);
}

TEST(LrSchedule, WarmupLRLinear) {
  SchedulerConfig c = warmup("WarmupLR", "linear", 10);
  c.warmup_min_lr = 1e-4;
  c.warmup_max_lr = 1e-3;
  const LrSchedule s(c, 1e-3);
  EXPECT_NEAR(s.lr_at(0), 1e-4, kTol);
  EXPECT_NEAR(s.lr_at(5), 5.5e-4, kTol);  // 1e-4 + 9e-4 * 5/10
  EXPECT_NEAR(s.lr_at(9), 9.1e-4, kTol);  // 1e-4 + 9e-4 * 9/10
  EXPECT_NEAR(s.lr_at(10), 1e-3, kTol);
}

TEST(LrSchedule, WarmupShorterThanTwoStepsIsTwoAsInDeepSpeed) {
  // DeepSpeed: warmup_num_steps = max(2, warmup_num_steps), so log(W) is never 0.
  SchedulerConfig c = warmup("WarmupLR", "linear", 0);
  c.warmup_min_lr = 0.0;
  c.warmup_max_lr = 1e-3;
  const LrSchedule s(c, 1e-3);
  EXPECT_EQ(s.warmup_steps(), 2);
  EXPECT_NEAR(s.lr_at(0), 0.0, kTol);
  EXPECT_NEAR(s.lr_at(1), 5e-4, kTol);  // 1/2
  EXPECT_NEAR(s.lr_at(2), 1e-3, kTol);
  c.warmup_type = "log";
  EXPECT_NEAR(LrSchedule(c, 1e-3).lr_at(1), 1e-3, kTol);  // ln 2 / ln 2
}

TEST(LrSchedule, WarmupDecayLR) {
  SchedulerConfig c = warmup("WarmupDecayLR", "linear", 10);
  c.warmup_min_lr = 0.0;
  c.warmup_max_lr = 1e-3;
  c.total_num_steps = 110;
  const LrSchedule s(c, 1e-3);
  EXPECT_NEAR(s.lr_at(5), 5e-4, kTol);     // warm-up as WarmupLR
  EXPECT_NEAR(s.lr_at(10), 1e-3, kTol);    // (110-10)/(110-10) = 1
  EXPECT_NEAR(s.lr_at(60), 5e-4, kTol);    // (110-60)/100 = 0.5
  EXPECT_NEAR(s.lr_at(109), 1e-5, kTol);   // 1/100
  EXPECT_NEAR(s.lr_at(110), 0.0, kTol);    // max(0, 0)
  EXPECT_NEAR(s.lr_at(500), 0.0, kTol);    // max(0, negative)

  c.warmup_min_lr = 1e-4;  // the decay ends at warmup_min_lr: min + delta * gamma
  const LrSchedule m(c, 1e-3);
  EXPECT_NEAR(m.lr_at(60), 5.5e-4, kTol);  // 1e-4 + 9e-4 * 0.5
  EXPECT_NEAR(m.lr_at(110), 1e-4, kTol);

  c.warmup_type = "log";  // log warm-up then the same decay
  EXPECT_NEAR(LrSchedule(c, 1e-3).lr_at(4), 1e-4 + 9e-4 * std::log(5.0) / std::log(10.0), kTol);
}

TEST(LrSchedule, WarmupCosineLRLinearWarmup) {
  // The demo's schedule: base lr 2e-3, 20 linear warm-up steps, 300 steps, cos_min_ratio 0.1.
  SchedulerConfig c = warmup("WarmupCosineLR", "linear", 20);
  c.total_num_steps = 300;
  c.warmup_min_ratio = 0.0;
  c.cos_min_ratio = 0.1;
  const LrSchedule s(c, 2e-3);
  EXPECT_NEAR(s.lr_at(0), 0.0, kTol);
  EXPECT_NEAR(s.lr_at(10), 1e-3, kTol);    // ratio 10/20
  EXPECT_NEAR(s.lr_at(19), 1.9e-3, kTol);  // ratio 19/20
  // After warm-up k = step - 20 + 1, n = 300 - 20 = 280;
  // ratio = 0.1 + 0.9 * (1 + cos(pi k / n)) / 2.
  EXPECT_NEAR(s.lr_at(20), 1.9999433510792305e-3, kTol);  // k = 1
  EXPECT_NEAR(s.lr_at(89), 1.7363961030678928e-3, kTol);  // k = 70: cos(pi/4)
  EXPECT_NEAR(s.lr_at(159), 1.1e-3, kTol);                // k = 140: cos(pi/2) = 0 -> 0.55
  EXPECT_NEAR(s.lr_at(299), 2e-4, kTol);                  // k = n: cos(pi) = -1 -> 0.1
  EXPECT_NEAR(s.lr_at(1000), 2e-4, kTol);                 // held at cos_min_ratio past the end
}

TEST(LrSchedule, WarmupCosineLRLogWarmupWithMinRatio) {
  SchedulerConfig c = warmup("WarmupCosineLR", "log", 10);
  c.total_num_steps = 100;
  c.warmup_min_ratio = 0.1;
  c.cos_min_ratio = 0.0;
  const LrSchedule s(c, 1.0);
  EXPECT_NEAR(s.lr_at(0), 0.1, kTol);                 // warmup_min_ratio
  EXPECT_NEAR(s.lr_at(4), 0.7290730039024168, 1e-14); // 0.1 + 0.9 * ln 5 / ln 10
  EXPECT_NEAR(s.lr_at(54), 0.5, 1e-14);               // k = 45 of n = 90: cos(pi/2) = 0
  EXPECT_NEAR(s.lr_at(99), 0.0, 1e-14);
}

TEST(LrSchedule, PureFunctionOfStep) {
  SchedulerConfig c = warmup("WarmupCosineLR", "linear", 5);
  c.total_num_steps = 50;
  const LrSchedule a(c, 1e-3);
  const double at30 = a.lr_at(30);
  for (int64_t step = 0; step < 50; ++step) a.lr_at(step);
  EXPECT_EQ(a.lr_at(30), at30);
  EXPECT_EQ(LrSchedule(c, 1e-3).lr_at(30), at30);  // a fresh (resumed) schedule agrees
}

TEST(LrSchedule, RejectsWhatItCannotCompute) {
  EXPECT_THROW(LrSchedule(warmup("OneCycle", "log", 10), 1e-3), zt::ConfigError);
  EXPECT_THROW(LrSchedule(warmup("WarmupLR", "cosine", 10), 1e-3), zt::ConfigError);
  SchedulerConfig c = warmup("WarmupCosineLR", "linear", 10);
  c.total_num_steps = 10;  // no room after warm-up: DeepSpeed would divide by zero
  EXPECT_THROW(LrSchedule(c, 1e-3), zt::ConfigError);
}

TEST(LrSchedule, FromParsedConfig) {
  const zt::TrainConfig config = zt::parse_config(
      R"({"optimizer": {"params": {"lr": 2e-3}}, "scheduler": {"type": "WarmupCosineLR",
          "params": {"warmup_num_steps": 20, "warmup_type": "linear", "cos_min_ratio": 0.1}},
          "train": {"steps": 300}})",
      {}, 1);
  const LrSchedule s(config.scheduler, config.optimizer.lr);
  EXPECT_NEAR(s.lr_at(159), 1.1e-3, kTol);
}

}  // namespace
