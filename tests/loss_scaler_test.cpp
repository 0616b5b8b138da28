// The fp16 loss scaler against DeepSpeed's DynamicLossScaler sequence for scripted overflows.
#include <gtest/gtest.h>

#include "zero/loss_scaler.h"

namespace {

zt::LossScaleConfig fp16(int window, int hysteresis, double min_scale = 1.0, int power = 16) {
  zt::LossScaleConfig c;
  c.enabled = true;
  c.loss_scale_window = window;
  c.hysteresis = hysteresis;
  c.min_loss_scale = min_scale;
  c.initial_scale_power = power;
  return c;
}

std::vector<double> run(zt::LossScaler scaler, const std::string& pattern) {  // 'x' = overflow
  std::vector<double> scales;
  for (char c : pattern) {
    scaler.update(c == 'x');
    scales.push_back(scaler.scale());
  }
  return scales;
}

TEST(LossScaler, DefaultsDoubleAfterTheWindow) {
  zt::LossScaler scaler(fp16(1000, 2));
  EXPECT_EQ(scaler.scale(), 65536.0);
  for (int i = 0; i < 999; ++i) scaler.update(false);
  EXPECT_EQ(scaler.scale(), 65536.0);
  scaler.update(false);  // the 1000th clean step
  EXPECT_EQ(scaler.scale(), 131072.0);
}

TEST(LossScaler, HysteresisDelaysTheHalving) {
  // Window 3, hysteresis 2. DeepSpeed's sequence, step by step:
  //  x: hysteresis 2 -> 1, scale kept      .: 1 clean since overflow
  //  x: hysteresis used up, halve          .  .  .: 3 clean -> double, hysteresis restored
  //  x: 2 -> 1 kept   x: halve   x: halve
  const auto scales = run(zt::LossScaler(fp16(3, 2, 1.0, 4)), "x.x...xxx..");
  const std::vector<double> expected{16, 16, 8, 8, 8, 16, 16, 8, 4, 4, 4};
  EXPECT_EQ(scales, expected);
}

TEST(LossScaler, HysteresisOneHalvesAtOnceAndStopsAtTheMinimum) {
  const auto scales = run(zt::LossScaler(fp16(2, 1, 2.0, 3)), "xxxx..x.");
  const std::vector<double> expected{4, 2, 2, 2, 2, 4, 2, 2};
  EXPECT_EQ(scales, expected);
}

TEST(LossScaler, StaticAndDisabledNeverChange) {
  auto config = fp16(1, 1);
  config.loss_scale = 128;
  EXPECT_EQ(run(zt::LossScaler(config), "x.x.."), std::vector<double>(5, 128.0));
  EXPECT_EQ(run(zt::LossScaler(), "x.x.."), std::vector<double>(5, 1.0));
}

TEST(LossScaler, StateRoundTrips) {
  zt::LossScaler a(fp16(3, 2, 1.0, 5));
  for (char c : std::string("x..x")) a.update(c == 'x');
  zt::LossScaler b(fp16(3, 2, 1.0, 5));
  b.restore(a.state());
  EXPECT_EQ(run(a, "..x.x..."), run(b, "..x.x..."));
}

}  // namespace
