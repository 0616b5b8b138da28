#include <cstdio>
#include <map>
#include <string>
#include <utility>

#include "zero/engine_impl.h"
#include "zerotrain/error.h"
#include "zerotrain/memory.h"

// The engine's NVMe tiers (docs/offload.md): which sub-groups of which role go to disk, the
// pre-flight checks of the swap paths' free space (at construction and before a load stages its
// copies), the I/O engine and the swap directories, and what the tiers report.

namespace zt {

// A load writes staging copies beside the live swap files until it commits: their free space is
// checked on every rank before anything is read, and all ranks refuse together.
void Engine::Impl::preflight_load_staging(bool with_moments) {
  const int64_t optimizer_dir = footprint.masters + (with_moments ? footprint.moments : 0);
  const int64_t parameter_dir = footprint.load_staging_parameters;
  if (optimizer_dir == 0 && parameter_dir == 0) return;
  on_every_rank(*comm, "load.staging_space", [&] {
    // Every rank's staging counts against a shared disk, as at construction.
    std::map<std::string, std::pair<int64_t, std::string>> need;  // path: bytes, the key naming it
    if (optimizer_dir > 0) {
      auto& n = need[config.zero.offload_optimizer.nvme_path];
      n.first += optimizer_dir * world;
      n.second = "zero_optimization.offload_optimizer.nvme_path";
    }
    if (parameter_dir > 0) {
      auto& n = need[config.zero.offload_param.nvme_path];
      n.first += parameter_dir * world;
      if (n.second.empty()) n.second = "zero_optimization.offload_param.nvme_path";
    }
    for (const auto& [path, n] : need)
      io::preflight_swap_path(path, n.first, n.second, "a checkpoint load's staging copies");
  });
}

// Decides which sub-groups of which role go to NVMe, checks the swap paths (pre-flight: before
// anything large is allocated) and opens the I/O engine and the swap directories.
Engine::Impl::OffloadPlan Engine::Impl::plan_offload() {
  OffloadPlan plan = choose_tiers();
  open_tiers(plan);
  return plan;
}

// The sub-groups of each role that go to NVMe (optimizer ratio, parameters beyond max_in_cpu);
// the partition's sub-groups are planned only when some role has an NVMe device.
Engine::Impl::OffloadPlan Engine::Impl::choose_tiers() {
  OffloadPlan plan;
  const OffloadOptimizerConfig& oo = config.zero.offload_optimizer;
  const OffloadParamConfig& op = config.zero.offload_param;
  if (oo.delayed_update && oo.nvme_gradients && oo.device == OffloadDevice::Nvme && config.zero.shard_gradients)
    throw ConfigError("zero_optimization.offload_optimizer.nvme_gradients: true cannot be combined with "
                      "delayed_update (the delayed step keeps a snapshot of the gradients in memory)");
  if (oo.delayed_update && config.optimizer.type == "Lamb" && shard_world > 1)
    throw ConfigError("zero_optimization.offload_optimizer.delayed_update: expected an optimizer whose step needs no "
                      "collective, found Lamb on " + std::to_string(shard_world) +
                      " ranks (its per-tensor trust ratios need an all-reduce inside the step, which the delayed "
                      "step cannot run beside training's collectives); use Adam/AdamW/SGD or delayed_update false");
  const bool optimizer_nvme = oo.device == OffloadDevice::Nvme;
  const bool parameters_nvme = op.device == OffloadDevice::Nvme && shard_parameters;
  if (!optimizer_nvme && !parameters_nvme) return plan;
  groups = plan_sub_groups(layout, config.zero.sub_group_size);
  const int64_t partition = layout.partition_numel;
  if (optimizer_nvme) {
    // ratio: the first sub-groups up to that fraction of the partition go to NVMe, the rest stay.
    const double limit = oo.ratio * double(partition);
    int64_t placed = 0;
    for (const SubGroup& g : groups) {
      plan.optimizer_on_disk.push_back(double(placed) < limit);
      placed += g.numel;
    }
    // The gradients of the sub-groups whose state is on NVMe go there too (stages 2-3).
    if (oo.nvme_gradients && config.zero.shard_gradients) plan.gradients_on_disk = plan.optimizer_on_disk;
  }
  if (parameters_nvme) {
    // Shards of blocks go to NVMe, except whole blocks (the last ones) within max_in_cpu
    // elements; parameters outside every block stay whole in memory anyway.
    plan.parameters_on_disk.assign(groups.size(), 0);
    std::map<int, std::vector<size_t>> block_groups;
    std::map<int, int64_t> block_shard;
    for (size_t g = 0, b = 0; g < groups.size(); ++g) {
      while (groups[g].begin >= layout.buckets[b].partition_offset + layout.buckets[b].shard_numel) ++b;
      if (const int block = layout.buckets[b].group; block >= 0) {
        block_groups[block].push_back(g);
        block_shard[block] += groups[g].numel;
      }
    }
    int64_t kept = 0;
    for (auto it = block_groups.rbegin(); it != block_groups.rend(); ++it) {
      if (kept + block_shard[it->first] <= op.max_in_cpu) {
        kept += block_shard[it->first];
        continue;
      }
      for (size_t g : it->second) plan.parameters_on_disk[g] = 1;
    }
    int64_t largest_block = 0;
    std::map<int, int64_t> block_numel;
    for (const BucketLayout& lb : layout.buckets)
      if (lb.group >= 0) largest_block = std::max(largest_block, block_numel[lb.group] += lb.shard_numel);
    if (largest_block > op.buffer_size)
      throw ConfigError("zero_optimization.offload_param.buffer_size: expected at least the largest block's shard, " +
                        std::to_string(largest_block) + " elements, found " + std::to_string(op.buffer_size));
  }
  return plan;
}

// Pre-flight, then the I/O engine and the swap directories the plan's tiers use.
void Engine::Impl::open_tiers(OffloadPlan& plan) {
  const OffloadOptimizerConfig& oo = config.zero.offload_optimizer;
  const OffloadParamConfig& op = config.zero.offload_param;
  const bool optimizer_nvme = oo.device == OffloadDevice::Nvme;
  const bool parameters_nvme = op.device == OffloadDevice::Nvme && shard_parameters;
  if (!optimizer_nvme && !parameters_nvme) return;
  // Pre-flight, on every rank: each rank's swap files, times the ranks that may share the disk.
  const int64_t ranks_sharing = world;
  auto log = [this](const std::string& line) {
    if (rank == 0) std::fprintf(stderr, "zerotrain: note: %s\n", line.c_str());
  };
  NvmeTierPlan tiers;
  tiers.groups = groups;
  tiers.optimizer_on_disk = plan.optimizer_on_disk;
  tiers.gradients_on_disk = plan.gradients_on_disk;
  tiers.parameters_on_disk = plan.parameters_on_disk;
  tiers.fp32_masters = keeps_fp32_masters(separate_master, oo.delayed_update, devices.stage_through_host);
  tiers.moments = optimizer_moment_arrays(config);
  tiers.working_element_bytes = int64_t(c10::elementSize(working_dtype));
  // The delayed update keeps a second working copy with the same tiers (params.next).
  tiers.next_working_copy = oo.delayed_update && !devices.stage_through_host;
  footprint = nvme_footprint(tiers);
  std::map<std::string, int64_t> need;
  if (optimizer_nvme) need[oo.nvme_path] += footprint.optimizer_directory() * ranks_sharing;
  if (parameters_nvme) need[op.nvme_path] += footprint.parameter_directory() * ranks_sharing;
  if (optimizer_nvme)
    io::preflight_swap_path(oo.nvme_path, need[oo.nvme_path], "zero_optimization.offload_optimizer.nvme_path");
  if (parameters_nvme && (!optimizer_nvme || op.nvme_path != oo.nvme_path))
    io::preflight_swap_path(op.nvme_path, need[op.nvme_path], "zero_optimization.offload_param.nvme_path");
  io::AioOptions aio = io::aio_options_from(config.aio);
  aio.log = log;
  io = std::make_unique<io::AioEngine>(aio);
  if (optimizer_nvme) {
    swap_directories.push_back(std::make_unique<io::SwapDirectory>(oo.nvme_path, rank, log));
    plan.optimizer_directory = swap_directories.back().get();
  }
  if (parameters_nvme) {
    if (optimizer_nvme && op.nvme_path == oo.nvme_path) {
      plan.parameter_directory = plan.optimizer_directory;
    } else {
      swap_directories.push_back(std::make_unique<io::SwapDirectory>(op.nvme_path, rank, log));
      plan.parameter_directory = swap_directories.back().get();
    }
  }
}

OffloadReport Engine::Impl::offload_report() const {
  OffloadReport r;
  r.nvme_optimizer_bytes = optimizer->disk_bytes();
  r.nvme_parameter_bytes = param_partition.disk_bytes() + optimizer->next_working_disk_bytes();
  r.nvme_gradient_bytes = reducer->disk_bytes();
  r.nvme_planned_bytes = footprint.total();
  r.nvme_load_staging_bytes = footprint.load_staging_optimizer + footprint.load_staging_parameters;
  r.host_buffer_bytes = optimizer->buffer_bytes() + (parameter_tier ? parameter_tier->buffer_bytes() : 0);
  if (io) {
    const io::AioEngine::Stats s = io->stats();
    r.bytes_read = s.bytes_read;
    r.bytes_written = s.bytes_written;
    r.requests = s.requests;
    r.read_seconds = s.read_seconds;
    r.write_seconds = s.write_seconds;
    r.backend = io->backend_name();
  }
  r.stall_seconds = optimizer->io_counters().seconds + (parameter_tier ? parameter_tier->stall_seconds() : 0);
  return r;
}

}  // namespace zt
