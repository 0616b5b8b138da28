// The NVMe tiers' bytes before they exist (zero/nvme_footprint.h): each role's file is the sum of
// its disk sub-groups at 4 KiB-aligned sizes, in the role's dtype; a load stages the masters (or
// the working values that hold them) and the moments.
#include <gtest/gtest.h>

#include "zero/nvme_footprint.h"
#include "zerotrain/memory.h"

namespace {

constexpr int64_t kPage = 4096;

zt::NvmeTierPlan plan_of_three_groups() {
  zt::NvmeTierPlan p;
  // 3000 elements (12000 B fp32 -> 12288), 1024 (4096), 5 (20 -> 4096).
  p.groups = {{0, 3000}, {3000, 1024}, {4024, 5}};
  p.optimizer_on_disk = {1, 1, 0};
  return p;
}

TEST(NvmeFootprint, EachDiskSubGroupIsAlignedInItsRolesDtype) {
  zt::NvmeTierPlan p = plan_of_three_groups();
  const int64_t state = 3 * kPage + kPage;  // groups 0 and 1 in fp32
  zt::NvmeFootprint f = zt::nvme_footprint(p);
  EXPECT_EQ(f.masters, 0);
  EXPECT_EQ(f.moments, 2 * state);
  EXPECT_EQ(f.gradients, 0);
  EXPECT_EQ(f.parameters, 0);
  EXPECT_EQ(f.total(), 2 * state);

  p.fp32_masters = true;
  p.working_element_bytes = 2;  // bf16: 6000 B -> 8192, 2048 -> 4096, 10 -> 4096
  p.gradients_on_disk = p.optimizer_on_disk;
  p.parameters_on_disk = {0, 1, 1};
  p.next_working_copy = true;
  f = zt::nvme_footprint(p);
  EXPECT_EQ(f.masters, state);
  EXPECT_EQ(f.moments, 2 * state);
  EXPECT_EQ(f.gradients, 2 * kPage + kPage);
  EXPECT_EQ(f.parameters, kPage + kPage);
  EXPECT_EQ(f.next_parameters, f.parameters);
  EXPECT_EQ(f.optimizer_directory(), 3 * state + 3 * kPage);
  EXPECT_EQ(f.parameter_directory(), 4 * kPage);
  // A load stages the masters file and the moments; the working values are not the masters here.
  EXPECT_EQ(f.load_staging_optimizer, 3 * state);
  EXPECT_EQ(f.load_staging_parameters, 0);
}

TEST(NvmeFootprint, WithoutMastersALoadStagesTheWorkingValuesThatHoldThem) {
  zt::NvmeTierPlan p = plan_of_three_groups();
  p.moments = 1;  // SGD with momentum
  p.parameters_on_disk = {1, 1, 1};
  const zt::NvmeFootprint f = zt::nvme_footprint(p);
  EXPECT_EQ(f.moments, 4 * kPage);
  EXPECT_EQ(f.parameters, 4 * kPage + kPage);
  EXPECT_EQ(f.next_parameters, 0);
  EXPECT_EQ(f.load_staging_optimizer, 4 * kPage);
  EXPECT_EQ(f.load_staging_parameters, f.parameters);
}

TEST(NvmeFootprint, MastersOfTheirOwnFollowOneRule) {
  EXPECT_FALSE(zt::keeps_fp32_masters(false, false, false));
  EXPECT_TRUE(zt::keeps_fp32_masters(true, false, false));   // 16-bit working values
  EXPECT_TRUE(zt::keeps_fp32_masters(false, true, false));   // the delayed update
  EXPECT_TRUE(zt::keeps_fp32_masters(false, false, true));   // staged through host copies
}

}  // namespace
