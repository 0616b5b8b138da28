// Whether a training run fits the memory of the node it starts on, held before any rank starts,
// and what would make it fit (docs/memory.md "Before launch").
//
// Contract
// - check_memory_fit is a pure function of plain data (thread-safe); it runs the memory estimate
//   (zerotrain/memory/estimate.h) for the configuration and, when it does not fit, for leaner settings
//   of the same run and then the planner's layouts (zerotrain/memory/step_time.h).
// - available_host_memory reads the kernel's figures (and the cgroup limit the process runs
//   under); ZT_HOST_MEMORY_AVAILABLE (bytes) replaces them, for tests and for a box whose limit
//   the kernel does not show.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "zerotrain/memory/estimate.h"

namespace zt {

struct TrainConfig;

// One configuration value as `--set key=value` takes it.
struct SettingChange {
  std::string key;
  std::string value;
};

struct MemoryFit {
  int64_t needed = 0;     // the estimate's peak for one node's host memory (all its ranks)
  int64_t available = 0;  // what the node has for them
  bool fits = true;       // needed <= available
  // When it does not fit: the fewest of the run's own sizes (sub-groups, buckets, what stays in
  // memory, buffer counts) that bring it within `available` with the cluster's headroom, or
  // empty when no such sizes exist; then `layout`, the planner's pick of a stage, offload and
  // recomputation that fits ("" when nothing does).
  std::vector<SettingChange> changes;
  int64_t needed_after_changes = 0;
  std::string layout;
};

// `cluster.host_memory` is the memory available on the node (not its total); the estimate is
// held against it without headroom (a run is refused only when the estimate itself exceeds it),
// and suggestions are made to fit within it less `cluster.headroom`. NVMe space is not checked
// here (the engine's pre-flight check does that against the file system).
MemoryFit check_memory_fit(const ModelFigures& model, const ClusterSpec& cluster, const TrainConfig& config);

// The one line a refused run prints: what it needs, what there is, what would fit, how to run
// anyway (`override_flag`).
std::string describe_misfit(const MemoryFit& fit, const std::string& override_flag);

// Bytes of memory available to new processes on this machine: MemAvailable, lowered to the
// cgroup's limit less its usage where one applies. -1 when neither can be read.
int64_t available_host_memory();

}  // namespace zt
