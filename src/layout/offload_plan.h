// The offload plan: where each role of one rank's partition lives (memory or NVMe) and how many
// bytes it takes, computed once, before anything is allocated, from the partition's shape (the
// layout's buckets) and the configuration's offload settings and dtypes (docs/offload.md
// "The offload plan"). The single source of those figures:
// - the engine reads it to create its tiers (the sub-groups and, per role, which are on disk), to
//   hold the swap files' bytes against the free space before they exist (pre-flight, and before a
//   checkpoint load stages its copies) and to report them (src/zero/engine_offload.cpp);
// - the memory estimate reads it for the NVMe bytes per role and the host buffers of the streaming
//   pools (src/memory/estimate.cpp), from the exact layout of the reference GPT or an approximate
//   one for other models.
//
// Contract
// - Plain data and pure functions of values; nothing is allocated beyond the returned vectors;
//   thread-safe.
// - Sub-groups (plan_sub_groups) cut the partition at every bucket shard's start and every
//   sub_group_size elements (rounded up to kSubGroupGranule) within a shard, so a stage-3 block
//   (whole buckets) is whole sub-groups. Roles are placed by whole sub-groups.
// - A swap file holds each disk sub-group of its role at a kSwapPageBytes-aligned offset and size
//   (swap_file_bytes): the size the tiers create.
// - The plan reads of the layout only its buckets (partition_offset, shard_numel, group) and
//   partition_numel, so that a shape built without the model (the estimate) serves as well.
#pragma once
#include <cstdint>
#include <vector>

#include "zerotrain/config/config.h"
#include "zerotrain/layout/layout.h"

namespace zt {

struct SubGroup {
  int64_t begin = 0;  // partition offset
  int64_t numel = 0;
};

// A multiple of 2048 elements is whole 4 KiB pages in fp32 and in 16 bits, so the sub-groups of
// one bucket lie back to back in a swap file and a bucket's shard reads as one contiguous run.
constexpr int64_t kSubGroupGranule = 2048;
// O_DIRECT's alignment of offsets and sizes (io::kAlignment; src/zero/partition_store.cpp checks
// that the two agree).
constexpr int64_t kSwapPageBytes = 4096;
// 16-bit gradients reach the CPU kernels through an fp32 scratch of at most this many elements.
constexpr int64_t kConversionChunkElements = int64_t{1} << 20;

// Cuts [0, layout.partition_numel) at every bucket shard's start and every `sub_group_size`
// elements within a shard, sub_group_size rounded up to a multiple of kSubGroupGranule.
std::vector<SubGroup> plan_sub_groups(const FlatLayout& layout, int64_t sub_group_size);

// `bytes` rounded up to a multiple of kSwapPageBytes.
int64_t swap_page_align(int64_t bytes);

// The size of a swap file holding sub-group g where on_disk[g]: each at an aligned offset.
int64_t swap_file_bytes(const std::vector<SubGroup>& groups, const std::vector<char>& on_disk, int64_t element_size);

// What the plan is computed from besides the layout: the configuration's offload settings, and
// what the caller decides of the roles (moments, masters, where the step runs).
struct OffloadPlanInput {
  bool optimizer_on_nvme = false;   // offload_optimizer.device nvme
  bool parameters_on_nvme = false;  // offload_param.device nvme (stage 3 only)
  bool shard_parameters = false;    // stage 3: the working parameters are a partition of their own
  bool shard_gradients = false;     // stages 2-3: the gradients are a partition (nvme_gradients applies)
  double ratio = 1.0;               // offload_optimizer.ratio
  bool nvme_gradients = false;      // offload_optimizer.nvme_gradients
  int64_t sub_group_size = 1'000'000'000;
  int optimizer_buffer_count = 4;   // offload_optimizer.buffer_count
  int parameter_buffer_count = 5;   // offload_param.buffer_count
  int64_t max_in_cpu = 0;           // offload_param.max_in_cpu (elements)
  int64_t buffer_size = 0;          // offload_param.buffer_size (elements)
  bool overlap_comm = false;        // two gradient reduction buffers instead of one
  int64_t working_element_bytes = 4;  // the working parameters' and gradients' dtype
  bool fp32_masters = false;        // keeps_fp32_masters(): masters are a role of their own
  int moments = 2;                  // optimizer_moment_arrays(): Adam/AdamW/LAMB 2, SGD 1 or 0
  bool delayed = false;             // offload_optimizer.delayed_update
  bool staged = false;              // the step works on host copies (optimizer offload from a GPU)
  // Stage-3 parameter offload from a GPU: the working partition stays on the host (only the
  // gradients are staged): the step writes it in place, or with the delayed update into a next
  // working copy with its tiers, as without staging.
  bool parameters_on_host = false;
  bool host_step = true;            // the CPU kernels run the step (not the device kernels)
};

// The configuration's part of the input; the caller sets fp32_masters, moments, staged and
// host_step (which depend on where the model lives) and may override the two devices.
OffloadPlanInput offload_plan_input(const TrainConfig& config);

// Bytes of one rank's swap files, by role.
struct NvmeBytes {
  int64_t masters = 0, moments = 0, gradients = 0;  // files in offload_optimizer.nvme_path
  int64_t parameters = 0, next_parameters = 0;      // files in offload_param.nvme_path
  int64_t optimizer_directory() const { return masters + moments + gradients; }
  int64_t parameter_directory() const { return parameters + next_parameters; }
  int64_t total() const { return optimizer_directory() + parameter_directory(); }
};

// Host memory of one rank that exists for the step's streams and copies, beside the roles' own
// arenas: what OffloadReport::host_buffer_bytes counts.
struct HostBufferBytes {
  int64_t optimizer_stream = 0;    // optimizer_buffer_count × the largest sub-group's disk roles
  int64_t parameter_reads = 0;     // parameter_buffer_count × the largest block's disk shards
  int64_t gradient_staging = 0;    // per reduction buffer: the largest bucket's disk sub-groups
  int64_t conversion_scratch = 0;  // fp32 chunk for 16-bit gradients on the host step
  int64_t gradient_snapshot = 0;   // delayed update / staged step: the owned gradients
  int64_t next_working = 0;        // delayed update / staged step: the next working copy in memory
  int64_t total() const {
    return optimizer_stream + parameter_reads + gradient_staging + conversion_scratch + gradient_snapshot +
           next_working;
  }
};

struct OffloadPlan {
  // The partition's sub-groups; empty when no role is on NVMe (the tiers then hold the whole
  // partition as one sub-group in memory).
  std::vector<SubGroup> groups;
  // Per sub-group, where the role is on disk; empty: none of it.
  std::vector<char> optimizer_on_disk;   // masters and moments (ratio, whole sub-groups)
  std::vector<char> gradients_on_disk;   // nvme_gradients: the optimizer's, at stages 2-3
  std::vector<char> parameters_on_disk;  // stage-3 working shards (and the delayed update's next copy)
  // Partition elements (padding included) in disk sub-groups, per role.
  int64_t optimizer_elements_on_disk = 0, gradient_elements_on_disk = 0, parameter_elements_on_disk = 0;
  bool next_working_copy = false;  // params.next on NVMe (the delayed update, or staged with parameter offload)
  NvmeBytes nvme;
  // A checkpoint load's staging copies beside the live files until it commits: of the masters
  // (or, without a masters file, of the working parameters that hold them) and of the moments.
  int64_t load_staging_optimizer = 0, load_staging_parameters = 0;
  HostBufferBytes host;
};

// The plan for `layout` (only its buckets and partition_numel are read). Throws ConfigError
// naming zero_optimization.offload_param.buffer_size, the expected and the found value, when the
// largest block's shard does not fit a parameter buffer (parameters on NVMe).
OffloadPlan plan_offload(const FlatLayout& layout, const OffloadPlanInput& input);

}  // namespace zt
