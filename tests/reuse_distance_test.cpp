// Stage 3's release rule (layout/reuse_distance.h): DeepSpeed's stage3_max_reuse_distance walk over
// the step's block uses, forward then backward in reverse.
#include "layout/reuse_distance.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

namespace {

// A GPT-like order: block 0 (embedding, also the tied head), 1 and 2 (layers), 3 (final norm).
const std::vector<int> kOrder = {0, 1, 2, 3, 0};
const std::vector<int64_t> kNumel = {100, 40, 40, 2};

TEST(ReuseDistance, ZeroReleasesEveryUse) {
  EXPECT_EQ(zt::kept_after_forward_use(kOrder, kNumel, 0), std::vector<char>(5, 0));
  EXPECT_EQ(zt::kept_at_turn(kOrder, kNumel, 0), 0);
}

// Uses strictly between a use and the next one of the same block, counted in elements:
//   position 0 (block 0): 1, 2, 3 in forward: 82 before the head.
//   position 1 (block 1): 2, 3, 0 (head), then backward 0, 3, 2: 40 + 2 + 100 + 100 + 2 + 40 = 284.
//   position 2 (block 2): 3, 0, 0, 3: 204.   position 3 (block 3): 0, 0: 200.   position 4: 0.
TEST(ReuseDistance, KeepsABlockWhoseNextUseComesWithinTheDistance) {
  EXPECT_EQ(zt::kept_after_forward_use(kOrder, kNumel, 1), (std::vector<char>{0, 0, 0, 0, 1}));
  EXPECT_EQ(zt::kept_after_forward_use(kOrder, kNumel, 82), (std::vector<char>{0, 0, 0, 0, 1}));
  EXPECT_EQ(zt::kept_after_forward_use(kOrder, kNumel, 83), (std::vector<char>{1, 0, 0, 0, 1}));
  EXPECT_EQ(zt::kept_after_forward_use(kOrder, kNumel, 201), (std::vector<char>{1, 0, 0, 1, 1}));
  EXPECT_EQ(zt::kept_after_forward_use(kOrder, kNumel, 205), (std::vector<char>{1, 0, 1, 1, 1}));
  EXPECT_EQ(zt::kept_after_forward_use(kOrder, kNumel, 285), (std::vector<char>(5, 1)));
}

// At the turn only a block's last forward use decides: the embedding is counted once, as the head.
TEST(ReuseDistance, KeptAtTheTurnCountsEachBlockOnceByItsLastUse) {
  EXPECT_EQ(zt::kept_at_turn(kOrder, kNumel, 1), 100);
  EXPECT_EQ(zt::kept_at_turn(kOrder, kNumel, 201), 102);
  EXPECT_EQ(zt::kept_at_turn(kOrder, kNumel, 205), 142);
  EXPECT_EQ(zt::kept_at_turn(kOrder, kNumel, 1'000'000'000), 182);
}

// The closed form for n equal blocks used once each (kept_at_turn_equal_blocks, which the memory
// estimate and the step-time model use when the order is unknown) agrees with the walk.
TEST(ReuseDistance, EqualBlocksKeepTheClosedFormCount) {
  for (int n : {1, 2, 7, 24}) {
    std::vector<int> order;
    for (int b = 0; b < n; ++b) order.push_back(b);
    const std::vector<int64_t> numel(size_t(n), 10);
    for (int64_t distance : {1, 19, 20, 21, 40, 41, 150, 1000}) {
      const int64_t expected = std::min<int64_t>(n, (distance + 19) / 20) * 10;
      EXPECT_EQ(zt::kept_at_turn(order, numel, distance), expected) << n << " blocks, distance " << distance;
      EXPECT_EQ(zt::kept_at_turn_equal_blocks(10 * n, 10, distance), expected) << n << " blocks, distance " << distance;
    }
  }
}

}  // namespace
