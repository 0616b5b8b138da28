// Step time of a training configuration on a cluster, before it runs, and the planner that orders
// configurations by it (docs/step_time.md has every formula, its inputs and its validation).
//
// Contract
// - Pure functions of plain data; thread-safe.
// - Compute is the model's FLOPs (zerotrain/config/gpt_flops.h: forward, backward as 2 × forward,
//   recomputation) over the device's sustained rate, plus the elementwise kernels' bytes over its
//   memory bandwidth. The optimizer step is the bytes the fused Adam moves over the memory
//   bandwidth of wherever it runs (device, or the host's CPUs when offloaded).
// - Communication is each stage's collectives as the engine issues them (docs/zero.md):
//   their bytes on a ring over the data-parallel group, at the slower of the intra-node bus
//   bandwidth and the node's network bandwidth, plus a latency per ring step. The engine's overlap
//   (bucket reductions during backward with overlap_comm, stage 3's prefetch) hides communication
//   behind the compute of the same phase, up to ClusterRates::overlap of it; the rest is exposed.
// - Offload adds the host<->device copies (PCIe) and NVMe reads and writes of the tiers involved.
// - Tensor parallelism is an input for what-if comparisons only (published Megatron + ZeRO runs):
//   the engine does not implement it. hpZ (ZeRO++'s secondary partition) follows the
//   configuration's zero_hpz_partition_size, which the engine implements, or a what-if value.
//   The planner proposes neither.
#pragma once
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "zerotrain/memory/estimate.h"

namespace zt {

// A named cluster description: devices, memories and rates (docs/step_time.md "Presets" gives each
// figure's source). `nodes` is 1; the caller sets the node count.
struct ClusterPreset {
  std::string name;
  std::string description;
  ClusterSpec spec;
};
const std::vector<ClusterPreset>& cluster_presets();
// The preset named `name`; ConfigError naming the known ones otherwise.
ClusterSpec cluster_preset(const std::string& name);

struct StepTimeOptions {
  int tensor_parallel = 1;      // what-if: Megatron tensor parallelism within a node (published runs)
  // Stage-3 secondary partition over this many ranks of a node; 1 takes the configuration's
  // zero_optimization.zero_hpz_partition_size (which the engine implements, docs/zero.md "hpZ").
  int hpz_partition_size = 1;
};

// One contribution to the step, in seconds per optimizer step.
struct StepTimeTerm {
  std::string name;       // "forward compute", "all-reduce gradients", ...
  double seconds = 0;     // as if alone
  double exposed = 0;     // what the step waits for after overlap
  double bytes = 0;       // bytes moved per device (communication, copies); 0 for compute
};

struct StepTime {
  double compute = 0;        // forward + backward + recomputation + elementwise, all micro-steps
  double optimizer = 0;      // the optimizer step where it runs
  double communication = 0;  // every collective, as if nothing overlapped
  double offload = 0;        // host<->device copies and NVMe transfers, as if nothing overlapped
  double exposed = 0;        // communication and offload the step waits for
  double total = 0;          // seconds per optimizer step
  double tokens_per_second = 0;           // the whole cluster
  double model_flops_per_device = 0;      // achieved FLOP/s per device, recomputation not counted (MFU's)
  double executed_flops_per_device = 0;   // the same with recomputation counted (what ran)
  int64_t micro_batch = 0, accumulation = 0;
  std::vector<StepTimeTerm> terms;
  std::vector<std::string> notes;  // assumptions, one sentence each
};

// The step time of `config` (stage switches, precision, buckets, overlap_comm, micro-batch,
// accumulation, reuse distance) for `model` on `cluster` (its rates must include the device's
// FLOP/s and the bandwidths its world size uses). ConfigError names a missing rate or a bad option.
StepTime estimate_step_time(const ModelFigures& model, const ClusterSpec& cluster, const TrainConfig& config,
                            const EstimateOptions& options = {}, const StepTimeOptions& what_if = {});

// One configuration the planner considered.
struct PlanCandidate {
  int stage = 0;
  EstimateOptions options;  // both offload targets and the recomputation set
  int64_t micro_batch = 0, accumulation = 0;
  bool overlap_comm = false;  // zero_optimization.overlap_comm
  int tensor_parallel = 1;     // tensor_parallel.autotp_size
  StepTime time;
  MemoryEstimate estimate;
};

// One rank's figures of the same model split over tensor groups of T ranks, or none where the
// model cannot be split so (the command line asks zerotrain/models/model_kind.h estimate_figures_of).
using TensorParallelFigures = std::function<std::optional<ModelFigures>(int tensor_parallel)>;

struct Plan {
  std::vector<PlanCandidate> fitting;  // fastest first
  int64_t smallest_device_need = 0;    // per device, over all candidates (useful when none fits)
  std::string advice;                  // which to use and why, or why nothing fits
  std::vector<std::string> notes;      // assumptions (rates taken from a preset, ...)
};

// Every stage × offload × recomputation × micro-batch × overlap_comm combination (overlap_comm only
// when the configuration did not give it) for `model` on `cluster` that keeps `config`'s global
// batch (micro-batch × accumulation × data-parallel size) and its other choices (its offload
// settings included); those that fit, ordered by predicted step time. With `split` given, each
// tensor-parallel size T that divides the devices of a node and that `split` has figures for is
// tried too (`model` is the configuration's own T). A combination the configuration's settings
// refuse (a block shard beyond offload_param.buffer_size) is left out. Without rates in
// `cluster`, those of the preset for its device kind are used and a note says so.
Plan plan_configurations(const ModelFigures& model, const ClusterSpec& cluster, const TrainConfig& config,
                         const TensorParallelFigures& split = {});

// `config` with a candidate's stage (and its switches), overlap_comm, micro-batch, accumulation
// and tensor-parallel size; the offload targets and recomputation stay in candidate.options.
TrainConfig candidate_config(const TrainConfig& config, const PlanCandidate& candidate);

// "stage 3, optimizer offloaded to nvme, micro-batch 1 x 4 accumulation": a candidate in words.
std::string describe_candidate(const PlanCandidate& candidate);

}  // namespace zt
