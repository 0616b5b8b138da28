// The offload plan (layout/offload_plan.h): sub-groups cut at bucket shards, the placement rules
// (ratio by whole sub-groups, nvme_gradients, max_in_cpu keeping whole last blocks, the
// parameter buffer's size), each role's file as the sum of its disk sub-groups at 4 KiB-aligned
// sizes in the role's dtype, a load's staging, and the host buffers the tiers stream through.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "layout/offload_plan.h"
#include "zerotrain/error.h"
#include "zerotrain/memory/memory.h"

namespace {

constexpr int64_t kPage = 4096;

// A partition of the given bucket shards (elements) with their stage-3 block ids.
zt::FlatLayout shape_of(const std::vector<std::pair<int64_t, int>>& shards) {
  zt::FlatLayout layout;
  for (const auto& [numel, group] : shards) {
    zt::BucketLayout b;
    b.shard_numel = numel;
    b.numel = numel;
    b.partition_offset = layout.partition_numel;
    b.group = group;
    layout.buckets.push_back(b);
    layout.partition_numel += numel;
  }
  layout.total_numel = layout.partition_numel;
  return layout;
}

// Three sub-groups of 3000 elements (12000 B fp32 -> 12288), 1024 (4096) and 5 (20 -> 4096), one
// bucket each; ratio 0.9 puts the first two on NVMe (3000 < 3626, 4024 >= 3626).
zt::OffloadPlanInput optimizer_on_nvme() {
  zt::OffloadPlanInput in;
  in.optimizer_on_nvme = true;
  in.ratio = 0.9;
  in.sub_group_size = 4096;
  return in;
}
const zt::FlatLayout kThreeBuckets = shape_of({{3000, -1}, {1024, -1}, {5, -1}});

TEST(OffloadPlan, SubGroupsAreCutAtBucketShardsAndRoundedSizes) {
  const zt::FlatLayout layout = shape_of({{5000, 0}, {100, -1}});
  const auto groups = zt::plan_sub_groups(layout, 2049);  // rounded up to 4096
  ASSERT_EQ(groups.size(), 3u);
  EXPECT_EQ(groups[0].begin, 0);
  EXPECT_EQ(groups[0].numel, 4096);
  EXPECT_EQ(groups[1].begin, 4096);
  EXPECT_EQ(groups[1].numel, 904);
  EXPECT_EQ(groups[2].begin, 5000);
  EXPECT_EQ(groups[2].numel, 100);
  EXPECT_EQ(zt::swap_file_bytes(groups, {1, 0, 1}, 2), 2 * kPage + kPage);
}

TEST(OffloadPlan, RatioPlacesWholeSubGroups) {
  zt::OffloadPlanInput in = optimizer_on_nvme();
  zt::OffloadPlan p = zt::plan_offload(kThreeBuckets, in);
  EXPECT_EQ(p.optimizer_on_disk, (std::vector<char>{1, 1, 0}));
  EXPECT_EQ(p.optimizer_elements_on_disk, 4024);
  // Any fraction starts the first sub-group; 1.0 takes all; 0 none.
  in.ratio = 0.0001;
  EXPECT_EQ(zt::plan_offload(kThreeBuckets, in).optimizer_on_disk, (std::vector<char>{1, 0, 0}));
  in.ratio = 1.0;
  EXPECT_EQ(zt::plan_offload(kThreeBuckets, in).optimizer_on_disk, (std::vector<char>{1, 1, 1}));
  in.ratio = 0.0;
  p = zt::plan_offload(kThreeBuckets, in);
  EXPECT_EQ(p.optimizer_on_disk, (std::vector<char>{0, 0, 0}));
  EXPECT_EQ(p.nvme.total(), 0);
  // Without an NVMe role there are no sub-groups at all.
  EXPECT_TRUE(zt::plan_offload(kThreeBuckets, zt::OffloadPlanInput{}).groups.empty());
}

TEST(OffloadPlan, NvmeGradientsFollowTheStateOnlyWithShardedGradients) {
  zt::OffloadPlanInput in = optimizer_on_nvme();
  in.nvme_gradients = true;
  EXPECT_TRUE(zt::plan_offload(kThreeBuckets, in).gradients_on_disk.empty()) << "stage 1: gradients are whole";
  in.shard_gradients = true;
  in.working_element_bytes = 2;
  in.overlap_comm = true;
  const zt::OffloadPlan p = zt::plan_offload(kThreeBuckets, in);
  EXPECT_EQ(p.gradients_on_disk, p.optimizer_on_disk);
  EXPECT_EQ(p.nvme.gradients, 2 * kPage + kPage);  // 6000 B -> 8192, 2048 -> 4096
  // Each of the two reduction buffers stages the largest bucket's disk sub-groups.
  EXPECT_EQ(p.host.gradient_staging, 2 * 2 * kPage);
}

// Stage 3: block shards go to NVMe except whole blocks, the last ones first, that fit in
// max_in_cpu; parameters outside every block stay in memory.
TEST(OffloadPlan, MaxInCpuKeepsWholeLastBlocks) {
  const zt::FlatLayout layout = shape_of({{4096, 0}, {2048, 1}, {2048, 1}, {64, -1}, {2048, 2}});
  zt::OffloadPlanInput in;
  in.parameters_on_nvme = true;
  in.shard_parameters = true;
  in.buffer_size = 4096;
  in.max_in_cpu = 2048 + 4096 - 1;  // block 2 fits, block 1 (4096) then does not
  zt::OffloadPlan p = zt::plan_offload(layout, in);
  EXPECT_EQ(p.parameters_on_disk, (std::vector<char>{1, 1, 1, 0, 0}));
  EXPECT_EQ(p.parameter_elements_on_disk, 8192);
  in.max_in_cpu = 2048 + 4096;  // blocks 2 and 1
  p = zt::plan_offload(layout, in);
  EXPECT_EQ(p.parameters_on_disk, (std::vector<char>{1, 0, 0, 0, 0}));
  // The read buffers hold the largest block's disk shards; fp32 working values are the masters,
  // so a load stages them.
  EXPECT_EQ(p.host.parameter_reads, 5 * 4096 * 4);
  EXPECT_EQ(p.load_staging_parameters, 4096 * 4);
  in.parameters_on_nvme = false;
  EXPECT_TRUE(zt::plan_offload(layout, in).parameters_on_disk.empty());
  in.parameters_on_nvme = true;
  in.shard_parameters = false;  // parameters are offloaded only when sharded
  EXPECT_TRUE(zt::plan_offload(layout, in).groups.empty());
}

TEST(OffloadPlan, ABlockShardBeyondTheParameterBufferIsRefusedByName) {
  const zt::FlatLayout layout = shape_of({{2048, 0}, {2048, 0}, {1024, 1}});
  zt::OffloadPlanInput in;
  in.parameters_on_nvme = true;
  in.shard_parameters = true;
  in.buffer_size = 4095;
  try {
    zt::plan_offload(layout, in);
    ADD_FAILURE() << "no ConfigError";
  } catch (const zt::ConfigError& e) {
    EXPECT_STREQ(e.what(), "zero_optimization.offload_param.buffer_size: expected at least the largest block's shard "
                           "per rank (4096 elements), found 4095");
  }
  in.buffer_size = 4096;
  EXPECT_NO_THROW(zt::plan_offload(layout, in));
}

TEST(OffloadPlan, EachDiskSubGroupIsAlignedInItsRolesDtype) {
  zt::OffloadPlanInput in = optimizer_on_nvme();
  const int64_t state = 3 * kPage + kPage;  // groups 0 and 1 in fp32
  zt::OffloadPlan p = zt::plan_offload(kThreeBuckets, in);
  EXPECT_EQ(p.nvme.masters, 0);
  EXPECT_EQ(p.nvme.moments, 2 * state);
  EXPECT_EQ(p.nvme.gradients, 0);
  EXPECT_EQ(p.nvme.parameters, 0);
  EXPECT_EQ(p.nvme.total(), 2 * state);
  // The stream's buffers hold both moments of the largest sub-group.
  EXPECT_EQ(p.host.optimizer_stream, 4 * 2 * 3 * kPage);

  // bf16 with masters, gradients and the delayed update's next working copy.
  const zt::FlatLayout blocks = shape_of({{3000, 0}, {1024, 1}, {5, 2}});
  in.fp32_masters = true;
  in.working_element_bytes = 2;
  in.nvme_gradients = true;
  in.shard_gradients = true;
  in.parameters_on_nvme = true;
  in.shard_parameters = true;
  in.max_in_cpu = 0;
  in.buffer_size = 3000;
  p = zt::plan_offload(blocks, in);
  EXPECT_EQ(p.nvme.masters, state);
  EXPECT_EQ(p.nvme.moments, 2 * state);
  EXPECT_EQ(p.nvme.gradients, 2 * kPage + kPage);
  EXPECT_EQ(p.nvme.parameters, 2 * kPage + kPage + kPage);
  EXPECT_EQ(p.nvme.next_parameters, 0);
  EXPECT_EQ(p.nvme.optimizer_directory(), 3 * state + 3 * kPage);
  // A load stages the masters file and the moments; the working values are not the masters here.
  EXPECT_EQ(p.load_staging_optimizer, 3 * state);
  EXPECT_EQ(p.load_staging_parameters, 0);
}

TEST(OffloadPlan, TheDelayedUpdatesCopiesFollowTheWorkingTiers) {
  const zt::FlatLayout blocks = shape_of({{3000, 0}, {1024, 1}, {5, -1}});
  zt::OffloadPlanInput in;
  in.optimizer_on_nvme = true;
  in.parameters_on_nvme = true;
  in.shard_parameters = true;
  in.max_in_cpu = 0;
  in.buffer_size = 3000;
  in.fp32_masters = true;
  in.delayed = true;
  const zt::OffloadPlan p = zt::plan_offload(blocks, in);
  const int64_t working = 3 * kPage + kPage;  // fp32 shards of blocks 0 and 1
  EXPECT_EQ(p.nvme.parameters, working);
  EXPECT_EQ(p.nvme.next_parameters, working);
  EXPECT_EQ(p.nvme.parameter_directory(), 2 * working);
  // In memory: the snapshot of the owned gradients, and the next copy's memory sub-group.
  EXPECT_EQ(p.host.gradient_snapshot, 4029 * 4);
  EXPECT_EQ(p.host.next_working, 5 * 4);
  // The largest sub-group's masters, moments and working shard in each of 4 stream buffers.
  EXPECT_EQ(p.host.optimizer_stream, 4 * 4 * 3 * kPage);
  // Staged through host copies: both copies whole in memory, nothing next on disk.
  in.staged = true;
  const zt::OffloadPlan staged = zt::plan_offload(blocks, in);
  EXPECT_EQ(staged.nvme.next_parameters, 0);
  EXPECT_EQ(staged.host.next_working, 4029 * 4);
  // Staged with the partition itself on the host (parameter offload from a GPU): the delayed
  // update's next copy has the partition's tiers again, as without staging.
  in.parameters_on_host = true;
  const zt::OffloadPlan on_host = zt::plan_offload(blocks, in);
  EXPECT_EQ(on_host.nvme.next_parameters, working);
  EXPECT_EQ(on_host.host.next_working, 5 * 4);
  EXPECT_EQ(on_host.host.gradient_snapshot, 4029 * 4);
  // Undelayed, the step writes the partition in place: no next copy anywhere.
  in.delayed = false;
  const zt::OffloadPlan in_place = zt::plan_offload(blocks, in);
  EXPECT_EQ(in_place.nvme.next_parameters, 0);
  EXPECT_EQ(in_place.host.next_working, 0);
  EXPECT_EQ(in_place.host.gradient_snapshot, 4029 * 4);
}

TEST(OffloadPlan, WithoutMastersALoadStagesTheWorkingValuesThatHoldThem) {
  const zt::FlatLayout blocks = shape_of({{3000, 0}, {1024, 1}, {5, 2}});
  zt::OffloadPlanInput in;
  in.optimizer_on_nvme = true;
  in.moments = 1;  // SGD with momentum
  in.parameters_on_nvme = true;
  in.shard_parameters = true;
  in.max_in_cpu = 0;
  in.buffer_size = 3000;
  const zt::OffloadPlan p = zt::plan_offload(blocks, in);
  EXPECT_EQ(p.nvme.moments, 3 * kPage + kPage + kPage);
  EXPECT_EQ(p.nvme.parameters, 3 * kPage + kPage + kPage);
  EXPECT_EQ(p.nvme.next_parameters, 0);
  EXPECT_EQ(p.load_staging_optimizer, p.nvme.moments);
  EXPECT_EQ(p.load_staging_parameters, p.nvme.parameters);
}

TEST(OffloadPlan, SixteenBitGradientsOnTheHostStepNeedTheConversionChunk) {
  zt::OffloadPlanInput in;
  in.working_element_bytes = 2;
  EXPECT_EQ(zt::plan_offload(kThreeBuckets, in).host.conversion_scratch, 4029 * 4);
  in.host_step = false;  // the device kernels read 16-bit gradients directly
  EXPECT_EQ(zt::plan_offload(kThreeBuckets, in).host.conversion_scratch, 0);
}

TEST(OffloadPlan, MastersOfTheirOwnFollowOneRule) {
  EXPECT_FALSE(zt::keeps_fp32_masters(false, false, false));
  EXPECT_TRUE(zt::keeps_fp32_masters(true, false, false));   // 16-bit working values
  EXPECT_TRUE(zt::keeps_fp32_masters(false, true, false));   // the delayed update
  EXPECT_TRUE(zt::keeps_fp32_masters(false, false, true));   // staged through host copies
}

}  // namespace
