// The stage-3 parameter tier (zero/parameter_tier.h): shards read from the partition in memory or
// from NVMe, and, with parameters offloaded from a GPU, crossed block by block into slots on the
// compute device. On the CPU the slots are host tensors filled by synchronous copies: the slot
// bookkeeping (which block each holds, reuse without a copy, the limit on blocks at once, what a
// step invalidates) is the same as on a GPU.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <string>

#include "io/aio.h"
#include "layout/offload_plan.h"
#include "zero/parameter_tier.h"
#include "zero/partition_store.h"
#include "zerotrain/error.h"
#include "zerotrain/layout/layout.h"

namespace {

// Four blocks of `per_block` elements each, one bucket a block, and a persistent parameter.
zt::FlatLayout four_blocks(int64_t per_block, int world) {
  std::vector<zt::ParameterSpec> specs;
  for (int b = 0; b < 4; ++b) specs.push_back({"block" + std::to_string(b) + ".weight", {per_block}, "float32", b});
  specs.push_back({"head.weight", {40}, "float32", -1});
  zt::LayoutOptions options;
  options.world_size = world;
  options.bucket_size = per_block;
  return zt::compute_layout(specs, options);
}

// Partition element i holds i + 1 (this rank's shards, padding included).
void fill(zt::TieredArray& partition) {
  const int64_t n = partition.numel();
  partition.store(0, torch::arange(1, n + 1, torch::kFloat32));
}

at::Tensor expected_shard(const zt::FlatLayout& layout, int bucket) {
  const zt::BucketLayout& lb = layout.buckets[size_t(bucket)];
  return torch::arange(lb.partition_offset + 1, lb.partition_offset + lb.shard_numel + 1, torch::kFloat32);
}

int block_of(const zt::FlatLayout& layout, int block) {
  for (size_t b = 0; b < layout.buckets.size(); ++b)
    if (layout.buckets[b].group == block) return int(b);
  return -1;
}

TEST(ParameterTier, CrossingCopiesEachBlockIntoASlotAndReusesItUntilTheStep) {
  const zt::FlatLayout layout = four_blocks(1000, 2);
  zt::TieredArray partition("params", at::kFloat, layout.partition_numel);
  fill(partition);
  const std::vector<zt::SubGroup> groups{{0, layout.partition_numel}};
  zt::ParameterTier tier(layout, partition, groups, nullptr, 5, zt::ParameterTier::Crossing{c10::kCPU, 2, false});
  // 1000 elements on 2 ranks: shards of 500, aligned to 512.
  const int64_t shard_bytes = layout.buckets[size_t(block_of(layout, 0))].shard_numel * 4;
  ASSERT_EQ(shard_bytes, 512 * 4);
  EXPECT_EQ(tier.slot_bytes(), 2 * shard_bytes);  // two slots of the largest block's shard

  tier.prepare(0);
  const at::Tensor first = tier.shard(block_of(layout, 0));
  EXPECT_TRUE(torch::equal(first, expected_shard(layout, block_of(layout, 0))));
  // The slot is a copy: the gather reads it, not the partition.
  EXPECT_NE(first.data_ptr(), partition.view(layout.buckets[size_t(block_of(layout, 0))].partition_offset, 1).data_ptr());
  EXPECT_EQ(tier.crossed_bytes(), shard_bytes);
  tier.prepare(1);
  EXPECT_TRUE(torch::equal(tier.shard(block_of(layout, 1)), expected_shard(layout, block_of(layout, 1))));
  // Both slots in use: a third block must wait for a done().
  EXPECT_FALSE(tier.can_prepare(2));
  EXPECT_TRUE(tier.can_prepare(0));  // already in its slot
  tier.done(0);
  EXPECT_TRUE(tier.can_prepare(2));
  tier.prepare(2);  // takes block 0's slot
  EXPECT_TRUE(torch::equal(tier.shard(block_of(layout, 2)), expected_shard(layout, block_of(layout, 2))));
  EXPECT_EQ(tier.crossed_bytes(), 3 * shard_bytes);
  tier.done(2);
  // Block 2 is still in its slot: gathered again (backward) without a copy.
  tier.prepare(2);
  EXPECT_EQ(tier.crossed_bytes(), 3 * shard_bytes);
  tier.done(2);
  tier.done(1);

  // A persistent parameter's shard is a copy of its own.
  const int persistent = block_of(layout, -1);
  ASSERT_GE(persistent, 0);
  EXPECT_TRUE(torch::equal(tier.shard(persistent), expected_shard(layout, persistent)));

  // The step rewrites the partition: the slots are stale and every block is copied again.
  partition.store(0, torch::zeros({layout.partition_numel}, torch::kFloat32));
  tier.invalidate();
  tier.prepare(2);
  EXPECT_TRUE(torch::equal(tier.shard(block_of(layout, 2)), torch::zeros({512})));
  EXPECT_EQ(tier.crossed_bytes(), 4 * shard_bytes);
  // A step while a block is prepared is a broken contract.
  EXPECT_THROW(tier.invalidate(), zt::Error);
  tier.done(2);
}

TEST(ParameterTier, CrossingFromNvmeFreesTheReadBufferOnceTheBlockIsInItsSlot) {
  const zt::FlatLayout layout = four_blocks(4096, 1);
  const std::vector<zt::SubGroup> groups = zt::plan_sub_groups(layout, 1 << 20);
  std::vector<char> on_disk(groups.size(), 1);
  for (size_t g = 0; g < groups.size(); ++g)
    for (const zt::BucketLayout& lb : layout.buckets)
      if (lb.group < 0 && groups[g].begin >= lb.partition_offset && groups[g].begin < lb.partition_offset + lb.shard_numel)
        on_disk[g] = 0;  // the persistent parameter stays in memory
  zt::io::AioEngine io(zt::io::AioOptions{});
  const auto file = std::filesystem::path(::testing::TempDir()) / ("parameter_tier_" + std::to_string(::getpid()) + ".swap");
  {
    zt::TieredArray partition("params", at::kFloat, groups, on_disk, io, file);
    for (size_t b = 0; b < layout.buckets.size(); ++b) {
      const zt::BucketLayout& lb = layout.buckets[b];
      partition.store(lb.partition_offset, expected_shard(layout, int(b)));
    }
    // One read buffer: without the crossing, the second block could not be prepared before the
    // first is done; with it, the buffer is free as soon as the block is in its slot.
    zt::ParameterTier tier(layout, partition, groups, &io, 1, zt::ParameterTier::Crossing{c10::kCPU, 3, false});
    for (int block = 0; block < 3; ++block) {
      ASSERT_TRUE(tier.can_prepare(block)) << block;
      tier.prepare(block);
      tier.expect({block + 1});
    }
    for (int block = 0; block < 3; ++block)
      EXPECT_TRUE(torch::equal(tier.shard(block_of(layout, block)), expected_shard(layout, block_of(layout, block))))
          << block;
    EXPECT_FALSE(tier.can_prepare(3));  // three slots in use
    for (int block = 0; block < 3; ++block) tier.done(block);
    tier.prepare(3);
    EXPECT_TRUE(torch::equal(tier.shard(block_of(layout, 3)), expected_shard(layout, block_of(layout, 3))));
    tier.done(3);
    EXPECT_EQ(tier.crossed_bytes(), 4 * 4096 * 4);
  }
  std::filesystem::remove(file);
}

}  // namespace
