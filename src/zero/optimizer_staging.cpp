#include <algorithm>

#include "common/check.h"
#include "zero/gradient_reducer.h"
#include "zero/optimizer_partition.h"

// The step staged through the host (docs/offload.md): the owned gradients reach the host snapshot
// bucket by bucket, during backward where the reducer says they are final, the rest before the step.

namespace zt {

// A bucket's owned slice, padding included (zero, and never read by the kernels).
void OptimizerPartition::copy_bucket_to_snapshot(int bucket, const GradientReducer& gradients) {
  const BucketLayout& lb = layout_.buckets[size_t(bucket)];
  if (lb.shard_numel == 0) return;
  copies_->to_host(grad_snapshot_.narrow(0, lb.partition_offset, lb.shard_numel),
                   gradients.owned_gradient(layout_.shard_offset(bucket, options_.shard_rank), lb.partition_offset,
                                            lb.shard_numel));
}

void OptimizerPartition::gradient_final(int bucket, const GradientReducer& gradients) {
  ZT_CHECK_STATE(takes_early_gradients(), "early gradients without the staged, undelayed step");
  copy_bucket_to_snapshot(bucket, gradients);
  snapshot_has_[size_t(bucket)] = 1;
}

void OptimizerPartition::snapshot_gradients(const GradientReducer& gradients) {
  for (int b = 0; b < int(layout_.buckets.size()); ++b)
    if (!snapshot_has_[size_t(b)]) copy_bucket_to_snapshot(b, gradients);
  std::fill(snapshot_has_.begin(), snapshot_has_.end(), 0);
  // Also completes the copies of the last install, which read the next working copy the step is
  // about to overwrite.
  copies_->wait_host();
}

}  // namespace zt
