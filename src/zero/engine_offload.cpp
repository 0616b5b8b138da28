#include <cstdio>
#include <map>
#include <string>
#include <utility>

#include "zero/engine_impl.h"
#include "zerotrain/error.h"
#include "zerotrain/memory/memory.h"

// The engine's NVMe tiers (docs/offload.md): the offload plan (which sub-groups of which role go
// to disk, their bytes), the pre-flight checks of the swap paths' free space (at construction and
// before a load stages its copies), the I/O engine and the swap directories, and what the tiers
// report.

namespace zt {

// A load writes staging copies beside the live swap files until it commits: their free space is
// checked on every rank before anything is read, and all ranks refuse together.
void Engine::Impl::preflight_load_staging(bool with_moments) {
  const int64_t optimizer_dir = offload.nvme.masters + (with_moments ? offload.nvme.moments : 0);
  const int64_t parameter_dir = offload.load_staging_parameters;
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

// Plans the offload (which sub-groups of which role go to NVMe, their bytes), checks the swap
// paths (pre-flight: before anything large is allocated) and opens the I/O engine and the swap
// directories.
Engine::Impl::SwapDirectories Engine::Impl::plan_offload() {
  choose_tiers();
  return open_tiers();
}

// The offload plan of this rank's partition (layout/offload_plan.h): the engine's only source of
// where each role lives and how many bytes its files and buffers take.
void Engine::Impl::choose_tiers() {
  const OffloadOptimizerConfig& oo = config.zero.offload_optimizer;
  if (oo.delayed_update && oo.nvme_gradients && oo.device == OffloadDevice::Nvme && config.zero.shard_gradients)
    throw ConfigError("zero_optimization.offload_optimizer.nvme_gradients: true cannot be combined with "
                      "delayed_update (the delayed step keeps a snapshot of the gradients in memory)");
  if (oo.delayed_update && config.optimizer.type == "Lamb" && shard_world > 1)
    throw ConfigError("zero_optimization.offload_optimizer.delayed_update: expected an optimizer whose step needs no "
                      "collective, found Lamb on " + std::to_string(shard_world) +
                      " ranks (its per-tensor trust ratios need an all-reduce inside the step, which the delayed "
                      "step cannot run beside training's collectives); use Adam/AdamW/SGD or delayed_update false");
  OffloadPlanInput input = offload_plan_input(config);
  input.fp32_masters = keeps_fp32_masters(separate_master, oo.delayed_update, devices.stage_through_host);
  input.moments = optimizer_moment_arrays(config);
  input.working_element_bytes = int64_t(c10::elementSize(working_dtype));
  input.staged = devices.stage_through_host;
  input.parameters_on_host = devices.parameters_on_host;
  input.host_step = !devices.device_step();
  offload = zt::plan_offload(layout, input);
}

// Pre-flight, then the I/O engine and the swap directories the plan's tiers use.
Engine::Impl::SwapDirectories Engine::Impl::open_tiers() {
  SwapDirectories directories;
  const OffloadOptimizerConfig& oo = config.zero.offload_optimizer;
  const OffloadParamConfig& op = config.zero.offload_param;
  const bool optimizer_nvme = oo.device == OffloadDevice::Nvme;
  const bool parameters_nvme = op.device == OffloadDevice::Nvme && shard_parameters;
  if (!optimizer_nvme && !parameters_nvme) return directories;
  // Pre-flight, on every rank: each rank's swap files, times the ranks that may share the disk.
  const int64_t ranks_sharing = world;
  auto log = [this](const std::string& line) {
    if (rank == 0) std::fprintf(stderr, "zerotrain: note: %s\n", line.c_str());
  };
  std::map<std::string, int64_t> need;
  if (optimizer_nvme) need[oo.nvme_path] += offload.nvme.optimizer_directory() * ranks_sharing;
  if (parameters_nvme) need[op.nvme_path] += offload.nvme.parameter_directory() * ranks_sharing;
  if (optimizer_nvme)
    io::preflight_swap_path(oo.nvme_path, need[oo.nvme_path], "zero_optimization.offload_optimizer.nvme_path");
  if (parameters_nvme && (!optimizer_nvme || op.nvme_path != oo.nvme_path))
    io::preflight_swap_path(op.nvme_path, need[op.nvme_path], "zero_optimization.offload_param.nvme_path");
  io::AioOptions aio = io::aio_options_from(config.aio);
  aio.log = log;
  io = std::make_unique<io::AioEngine>(aio);
  if (optimizer_nvme) {
    swap_directories.push_back(std::make_unique<io::SwapDirectory>(oo.nvme_path, rank, log));
    directories.optimizer = swap_directories.back().get();
  }
  if (parameters_nvme) {
    if (optimizer_nvme && op.nvme_path == oo.nvme_path) {
      directories.parameters = directories.optimizer;
    } else {
      swap_directories.push_back(std::make_unique<io::SwapDirectory>(op.nvme_path, rank, log));
      directories.parameters = swap_directories.back().get();
    }
  }
  return directories;
}

OffloadReport Engine::Impl::offload_report() const {
  OffloadReport r;
  r.nvme_optimizer_bytes = optimizer->disk_bytes();
  r.nvme_parameter_bytes = param_partition.disk_bytes() + optimizer->next_working_disk_bytes();
  r.nvme_gradient_bytes = reducer->disk_bytes();
  r.nvme_planned_bytes = offload.nvme.total();
  r.nvme_load_staging_bytes = offload.load_staging_optimizer + offload.load_staging_parameters;
  // What the tiers allocated, which the plan's host.total() predicts.
  r.host_buffer_bytes = optimizer->buffer_bytes() + (parameter_tier ? parameter_tier->buffer_bytes() : 0) +
                        reducer->staging_bytes();
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
