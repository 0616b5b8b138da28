// The offload plan (layout/offload_plan.h): sub-groups, per-role tiers and bytes, before anything
// exists.
#include "layout/offload_plan.h"

#include <algorithm>
#include <map>
#include <string>

#include "common/check.h"
#include "zerotrain/error.h"

namespace zt {
namespace {

int64_t ceil_to(int64_t value, int64_t multiple) { return (value + multiple - 1) / multiple * multiple; }

// The ratio rule: the first sub-groups, in partition order, while fewer than ratio × P elements
// have been placed, so a sub-group is on disk whole or not at all.
std::vector<char> optimizer_sub_groups_on_disk(const std::vector<SubGroup>& groups, int64_t partition, double ratio) {
  std::vector<char> on_disk;
  const double limit = ratio * double(partition);
  int64_t placed = 0;
  for (const SubGroup& g : groups) {
    on_disk.push_back(double(placed) < limit);
    placed += g.numel;
  }
  return on_disk;
}

// Per sub-group, the bucket it lies in (sub-groups never straddle a bucket's shard).
std::vector<size_t> bucket_of_sub_groups(const FlatLayout& layout, const std::vector<SubGroup>& groups) {
  std::vector<size_t> bucket_of;
  for (size_t g = 0, b = 0; g < groups.size(); ++g) {
    while (groups[g].begin >= layout.buckets[b].partition_offset + layout.buckets[b].shard_numel) ++b;
    bucket_of.push_back(b);
  }
  return bucket_of;
}

// Stage-3 block shards on NVMe, except whole blocks, the last ones first, whose shards together
// fit in max_in_cpu elements; parameters outside every block stay whole in memory anyway.
std::vector<char> parameter_sub_groups_on_disk(const FlatLayout& layout, const std::vector<SubGroup>& groups,
                                               const std::vector<size_t>& bucket_of, int64_t max_in_cpu) {
  std::vector<char> on_disk(groups.size(), 0);
  std::map<int, std::vector<size_t>> block_groups;
  std::map<int, int64_t> block_shard;
  for (size_t g = 0; g < groups.size(); ++g)
    if (const int block = layout.buckets[bucket_of[g]].group; block >= 0) {
      block_groups[block].push_back(g);
      block_shard[block] += groups[g].numel;
    }
  int64_t kept = 0;
  for (auto it = block_groups.rbegin(); it != block_groups.rend(); ++it) {
    if (kept + block_shard[it->first] <= max_in_cpu) {
      kept += block_shard[it->first];
      continue;
    }
    for (size_t g : it->second) on_disk[g] = 1;
  }
  return on_disk;
}

int64_t elements_on_disk(const std::vector<SubGroup>& groups, const std::vector<char>& on_disk) {
  int64_t n = 0;
  for (size_t g = 0; g < groups.size() && g < on_disk.size(); ++g)
    if (on_disk[g]) n += groups[g].numel;
  return n;
}

bool disk(const std::vector<char>& on_disk, size_t g) { return g < on_disk.size() && on_disk[g]; }

// The aligned buffers the tiers stream through, as the tiers size them (zero/optimizer_stream.cpp,
// zero/parameter_tier.cpp, zero/gradient_reducer.cpp).
void plan_host_buffers(const FlatLayout& layout, const OffloadPlanInput& in, OffloadPlan& plan) {
  const std::vector<SubGroup>& groups = plan.groups;
  const int64_t e = in.working_element_bytes;
  const int64_t partition = layout.partition_numel;
  const bool any_parameters = plan.parameter_elements_on_disk > 0;
  const bool any_gradients = plan.gradient_elements_on_disk > 0;
  HostBufferBytes& h = plan.host;
  // The optimizer's stream: one buffer holds every disk role of a sub-group (masters, moments, the
  // working shard that holds or receives the masters, the gradients), sized for the largest.
  if (!plan.optimizer_on_disk.empty() || any_parameters || any_gradients) {
    int64_t largest = 0;
    for (size_t g = 0; g < groups.size(); ++g) {
      int64_t bytes = 0;
      const int64_t state = swap_page_align(groups[g].numel * 4);
      if (disk(plan.optimizer_on_disk, g)) bytes += (in.fp32_masters ? 1 : 0) * state + int64_t(in.moments) * state;
      if (disk(plan.parameters_on_disk, g)) bytes += swap_page_align(groups[g].numel * e);
      if (disk(plan.gradients_on_disk, g)) bytes += swap_page_align(groups[g].numel * e);
      largest = std::max(largest, bytes);
    }
    h.optimizer_stream = int64_t(std::max(1, in.optimizer_buffer_count)) * largest;
  }
  const std::vector<size_t> bucket_of = groups.empty() ? std::vector<size_t>{} : bucket_of_sub_groups(layout, groups);
  // The parameter tier's read-ahead: one buffer holds a block's disk shards.
  if (any_parameters) {
    std::map<int, int64_t> block_bytes;
    int64_t largest = 0;
    for (size_t g = 0; g < groups.size(); ++g)
      if (const int block = layout.buckets[bucket_of[g]].group; block >= 0 && disk(plan.parameters_on_disk, g))
        largest = std::max(largest, block_bytes[block] += swap_page_align(groups[g].numel * e));
    h.parameter_reads = int64_t(std::max(1, in.parameter_buffer_count)) * largest;
  }
  // The gradient reducer's staging: each reduction buffer holds a bucket's disk sub-groups.
  if (any_gradients) {
    std::map<size_t, int64_t> bucket_bytes;
    int64_t largest = 0;
    for (size_t g = 0; g < groups.size(); ++g)
      if (disk(plan.gradients_on_disk, g))
        largest = std::max(largest, bucket_bytes[bucket_of[g]] += swap_page_align(groups[g].numel * e));
    h.gradient_staging = (in.overlap_comm ? 2 : 1) * largest;
  }
  if (e < 4 && in.host_step) h.conversion_scratch = std::min(partition, kConversionChunkElements) * 4;
  if (in.delayed || in.staged) {
    h.gradient_snapshot = partition * e;
    // The next working copy has the working partition's tiers (staged: host memory); staged with
    // the partition on the host, the undelayed step writes the partition in place.
    if (in.delayed || !in.parameters_on_host)
      h.next_working = (plan.next_working_copy ? partition - plan.parameter_elements_on_disk : partition) * e;
  }
}

}  // namespace

std::vector<SubGroup> plan_sub_groups(const FlatLayout& layout, int64_t sub_group_size) {
  ZT_CHECK_STATE(sub_group_size > 0, "sub_group_size must be positive");
  sub_group_size = ceil_to(sub_group_size, kSubGroupGranule);
  std::vector<SubGroup> groups;
  for (const BucketLayout& b : layout.buckets)
    for (int64_t done = 0; done < b.shard_numel; done += sub_group_size)
      groups.push_back({b.partition_offset + done, std::min(sub_group_size, b.shard_numel - done)});
  return groups;
}

int64_t swap_page_align(int64_t bytes) { return ceil_to(bytes, kSwapPageBytes); }

int64_t swap_file_bytes(const std::vector<SubGroup>& groups, const std::vector<char>& on_disk, int64_t element_size) {
  int64_t bytes = 0;
  for (size_t g = 0; g < groups.size() && g < on_disk.size(); ++g)
    if (on_disk[g]) bytes += swap_page_align(groups[g].numel * element_size);
  return bytes;
}

OffloadPlanInput offload_plan_input(const TrainConfig& config) {
  const ZeroConfig& zero = config.zero;
  OffloadPlanInput in;
  in.optimizer_on_nvme = zero.offload_optimizer.device == OffloadDevice::Nvme;
  in.parameters_on_nvme = zero.offload_param.device == OffloadDevice::Nvme;
  in.shard_parameters = zero.shard_parameters;
  in.shard_gradients = zero.shard_gradients;
  in.ratio = zero.offload_optimizer.ratio;
  in.nvme_gradients = zero.offload_optimizer.nvme_gradients;
  in.sub_group_size = zero.sub_group_size;
  in.optimizer_buffer_count = zero.offload_optimizer.buffer_count;
  in.parameter_buffer_count = zero.offload_param.buffer_count;
  in.max_in_cpu = zero.offload_param.max_in_cpu;
  in.buffer_size = zero.offload_param.buffer_size;
  in.overlap_comm = zero.overlap_comm;
  in.working_element_bytes = config.precision == Precision::FP32 ? 4 : 2;
  in.delayed = zero.offload_optimizer.delayed_update;
  return in;
}

OffloadPlan plan_offload(const FlatLayout& layout, const OffloadPlanInput& in) {
  OffloadPlan plan;
  const bool parameters_nvme = in.parameters_on_nvme && in.shard_parameters;
  if (in.optimizer_on_nvme || parameters_nvme) {
    plan.groups = plan_sub_groups(layout, in.sub_group_size);
    const std::vector<size_t> bucket_of = bucket_of_sub_groups(layout, plan.groups);
    if (in.optimizer_on_nvme) {
      plan.optimizer_on_disk = optimizer_sub_groups_on_disk(plan.groups, layout.partition_numel, in.ratio);
      // The gradients of the sub-groups whose state is on NVMe go there too (stages 2-3).
      if (in.nvme_gradients && in.shard_gradients) plan.gradients_on_disk = plan.optimizer_on_disk;
    }
    if (parameters_nvme) {
      plan.parameters_on_disk = parameter_sub_groups_on_disk(layout, plan.groups, bucket_of, in.max_in_cpu);
      // A parameter buffer holds one block's shard, whether or not that block is on disk.
      std::map<int, int64_t> block_shard;
      int64_t largest_block = 0;
      for (const BucketLayout& b : layout.buckets)
        if (b.group >= 0) largest_block = std::max(largest_block, block_shard[b.group] += b.shard_numel);
      if (largest_block > in.buffer_size)
        throw ConfigError("zero_optimization.offload_param.buffer_size: expected at least the largest block's shard "
                          "per rank (" + std::to_string(largest_block) + " elements), found " +
                          std::to_string(in.buffer_size));
    }
  }
  plan.optimizer_elements_on_disk = elements_on_disk(plan.groups, plan.optimizer_on_disk);
  plan.gradient_elements_on_disk = elements_on_disk(plan.groups, plan.gradients_on_disk);
  plan.parameter_elements_on_disk = elements_on_disk(plan.groups, plan.parameters_on_disk);
  // The delayed update's next working copy has the working partition's tiers (host copies when
  // staged, unless the partition itself is on the host).
  const bool next_copy_tiered = in.delayed && (!in.staged || in.parameters_on_host);
  plan.next_working_copy = next_copy_tiered && plan.parameter_elements_on_disk > 0;

  const int64_t e = in.working_element_bytes;
  const int64_t state = swap_file_bytes(plan.groups, plan.optimizer_on_disk, 4);  // fp32 roles
  const int64_t working = swap_file_bytes(plan.groups, plan.parameters_on_disk, e);
  plan.nvme.masters = in.fp32_masters ? state : 0;
  plan.nvme.moments = int64_t(in.moments) * state;
  plan.nvme.gradients = swap_file_bytes(plan.groups, plan.gradients_on_disk, e);
  plan.nvme.parameters = working;
  plan.nvme.next_parameters = next_copy_tiered ? working : 0;
  plan.load_staging_optimizer = plan.nvme.masters + plan.nvme.moments;
  plan.load_staging_parameters = in.fp32_masters ? 0 : working;
  plan_host_buffers(layout, in, plan);
  return plan;
}

}  // namespace zt
