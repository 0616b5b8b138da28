// The planner (zerotrain/memory/step_time.h): every configuration that fits, ordered by the step-time model.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <climits>

#include "memory/estimate_report.h"
#include "zerotrain/config/config.h"
#include "zerotrain/error.h"
#include "zerotrain/memory/step_time.h"

namespace zt {
namespace {

// Micro-batches that keep each rank's sequences per step: the divisors of it.
std::vector<int64_t> micro_batches(int64_t per_rank) {
  std::vector<int64_t> out;
  for (int64_t d = 1; d <= per_rank && d <= 4096; ++d)
    if (per_rank % d == 0) out.push_back(d);
  return out;
}

// Predictions within this fraction of the fastest are a tie: well inside the model's accuracy
// (docs/step_time.md).
constexpr double kTie = 0.03;

}  // namespace

std::string describe_candidate(const PlanCandidate& c) {
  std::string text = fmt::format("stage {}", c.stage);
  if (c.estimate.offload_optimizer != OffloadTarget::None)
    text += fmt::format(", optimizer offloaded to {}", to_string(c.estimate.offload_optimizer));
  if (c.estimate.offload_param != OffloadTarget::None)
    text += fmt::format(", parameters offloaded to {}", to_string(c.estimate.offload_param));
  if (c.options.recompute.value_or(Recompute::None) != Recompute::None)
    text += fmt::format(", {} activation recomputation", to_string(*c.options.recompute));
  if (c.stage < 3 && c.overlap_comm) text += ", overlap_comm";
  if (c.tensor_parallel > 1) text += fmt::format(", tensor-parallel groups of {}", c.tensor_parallel);
  text += fmt::format(", micro-batch {} x {} accumulation", c.micro_batch, c.accumulation);
  return text;
}

TrainConfig candidate_config(const TrainConfig& config, const PlanCandidate& candidate) {
  TrainConfig c = config;
  set_zero_stage(c.zero, candidate.stage);
  c.zero.hpz_partition_size = 1;  // the planner does not propose hpZ (docs/step_time.md)
  c.zero.overlap_comm = candidate.overlap_comm;
  c.train_micro_batch_size_per_gpu = candidate.micro_batch;
  c.gradient_accumulation_steps = candidate.accumulation;
  c.tensor_parallel = candidate.tensor_parallel;
  c.train_batch_size = candidate.micro_batch * candidate.accumulation * c.data_parallel_size();
  return c;
}

namespace {

// The pick: among the predictions the model cannot tell from the fastest, the one with fewer
// offloaded tiers, no recomputation, no parameter sharding and no tensor parallelism (each adds
// fixed costs per block or per step that the model does not see, and offload takes host memory),
// then the smaller tensor-parallel size, then the larger
// micro-batch (the model does not see that small matrix products run less efficiently), then the
// one that leaves more device memory free. It goes first; the rest stay fastest first.
void put_pick_first(std::vector<PlanCandidate>& fastest_first) {
  // Tensor parallelism too: collectives inside every layer, whose latency the model prices
  // only roughly.
  const auto extras = [](const PlanCandidate& c) {
    return int(c.estimate.offload_optimizer != OffloadTarget::None) + int(c.estimate.offload_param != OffloadTarget::None) +
           int(c.options.recompute.value_or(Recompute::None) != Recompute::None) + int(c.stage == 3) +
           int(c.tensor_parallel > 1);
  };
  // A larger T gives each data-parallel rank a larger micro-batch of narrower products: the
  // smaller T first, then the larger micro-batch.
  const auto preferred = [&](const PlanCandidate& a, const PlanCandidate& b) {
    if (extras(a) != extras(b)) return extras(a) < extras(b);
    if (a.tensor_parallel != b.tensor_parallel) return a.tensor_parallel < b.tensor_parallel;
    if (a.micro_batch != b.micro_batch) return a.micro_batch > b.micro_batch;
    return a.estimate.per_device.total() < b.estimate.per_device.total();
  };
  auto& all = fastest_first;
  if (all.empty()) return;
  size_t pick = 0;
  for (size_t i = 1; i < all.size() && all[i].time.total <= all[0].time.total * (1 + kTie); ++i)
    if (preferred(all[i], all[pick])) pick = i;
  std::rotate(all.begin(), all.begin() + long(pick), all.begin() + long(pick) + 1);
}

// When nothing fits: what the leanest candidate lacks.
std::string nothing_fits_advice(const PlanCandidate& leanest, const ClusterSpec& cluster) {
  const MemoryEstimate& e = leanest.estimate;
  std::vector<std::string> short_of;
  if (!e.fits_device)
    short_of.push_back(fmt::format("{} per device against {}", human_bytes(e.per_device.total()), human_bytes(cluster.device_memory)));
  if (!e.fits_host)
    short_of.push_back(fmt::format("{} of host memory per node against {}", human_bytes(e.per_host.total()),
                                   human_bytes(cluster.host_memory)));
  if (!e.fits_nvme)
    short_of.push_back(fmt::format("{} of NVMe per node against {}", human_bytes(e.nvme_per_node), human_bytes(cluster.nvme_bytes)));
  return fmt::format(
      "nothing fits: the configuration that needs the least device memory ({}) needs {} (keeping {:.0f}% free); "
      "add devices, memory or NVMe, or shorten the micro-batch or sequence",
      describe_candidate(leanest), fmt::join(short_of, " and "), 100 * cluster.headroom);
}

// The pick and what its step spends beyond compute, which says why it is fastest.
std::string pick_advice(const std::vector<PlanCandidate>& fitting, const ClusterSpec& cluster) {
  const PlanCandidate& best = fitting.front();
  const StepTime& t = best.time;
  std::string why;
  const double overhead = t.total - t.compute;
  if (fitting.size() > 1) {
    const PlanCandidate& next = fitting[1];
    why = fmt::format("; next: {} at {:.3g} tokens/s", describe_candidate(next), next.time.tokens_per_second);
  }
  return fmt::format(
      "use {}: predicted {:.4g} tokens/s, {:.3g} s per step ({:.0f}% compute, {:.0f}% optimizer, {:.0f}% exposed "
      "communication and offload), {:.3g} TFLOP/s per device; {} per device{}{}",
      describe_candidate(best), t.tokens_per_second, t.total, 100 * t.compute / t.total, 100 * t.optimizer / t.total,
      100 * (overhead - t.optimizer) / t.total, t.model_flops_per_device / 1e12, human_bytes(best.estimate.per_device.total()),
      cluster.device_memory > 0
          ? fmt::format(" of {}, keeping {:.0f}% free", human_bytes(cluster.device_memory), 100 * cluster.headroom)
          : "",
      why);
}

// The tensor-parallel sizes to try and one rank's figures at each: the configuration's own, and
// with `split` every T dividing a node's devices (and so the world) that the model splits into.
std::vector<std::pair<int, ModelFigures>> tensor_parallel_sizes(const ModelFigures& model, const ClusterSpec& cluster,
                                                                const TrainConfig& config, const TensorParallelFigures& split) {
  const int own = std::max(1, config.tensor_parallel);
  std::vector<std::pair<int, ModelFigures>> sizes = {{own, model}};
  if (!split) return sizes;
  for (int T = 1; T <= cluster.devices_per_node; ++T) {
    if (T == own || cluster.devices_per_node % T != 0) continue;
    if (std::optional<ModelFigures> figures = split(T)) sizes.emplace_back(T, std::move(*figures));
  }
  return sizes;
}

}  // namespace

Plan plan_configurations(const ModelFigures& model, const ClusterSpec& given, const TrainConfig& config,
                         const TensorParallelFigures& split) {
  Plan plan;
  ClusterSpec cluster = given;
  if (!(cluster.rates.device_flops_fp32 > 0)) {
    const std::string name = cluster.device == DeviceKind::Cuda ? "dgx-h100" : "cpu-box";
    cluster.rates = cluster_preset(name).rates;
    plan.notes.push_back(fmt::format("no rates given: the step times use the '{}' preset's device and link rates "
                                     "(give --cluster for another)",
                                     name));
  }
  plan.smallest_device_need = INT64_MAX;
  // Sequences per data-parallel rank per step at the configuration's T; at another T the global
  // batch stays and each data-parallel rank takes T / T0 times as many.
  const int own = std::max(1, config.tensor_parallel);
  const int64_t per_rank = config.train_micro_batch_size_per_gpu * std::max<int64_t>(1, config.gradient_accumulation_steps);
  const std::vector<OffloadTarget> targets = {OffloadTarget::None, OffloadTarget::Cpu, OffloadTarget::Nvme};
  const auto source = config.sources.find("zero_optimization.overlap_comm");
  const bool overlap_given = source != config.sources.end() &&
                             (source->second == ValueSource::File || source->second == ValueSource::CommandLine);
  std::vector<PlanCandidate> all;
  PlanCandidate leanest;  // the candidate that needs the least device memory
  for (const auto& [tensor_parallel, figures] : tensor_parallel_sizes(model, cluster, config, split)) {
    if ((per_rank * tensor_parallel) % own != 0) continue;
    if (tensor_parallel != own)
      plan.notes.push_back(fmt::format("tried tensor-parallel groups of {} (tensor_parallel.autotp_size)", tensor_parallel));
  for (int64_t micro : micro_batches(per_rank * tensor_parallel / own))
    for (bool overlap : {false, true})
    for (int stage = 0; stage <= 3; ++stage)
      for (OffloadTarget opt : targets)
        for (OffloadTarget param : targets)
          for (Recompute recompute : {Recompute::None, Recompute::Selective, Recompute::Full}) {
            if (opt != OffloadTarget::None && stage < 1) continue;
            if (param != OffloadTarget::None && stage < 3) continue;
            // The engine offloads parameters from a GPU only with the optimizer state on the host too.
            if (param != OffloadTarget::None && opt == OffloadTarget::None && cluster.device != DeviceKind::Cpu) continue;
            if (recompute != Recompute::None && !figures.has_shape()) continue;
            // On CPU devices offloading to "cpu" changes nothing: skip the duplicate.
            if (cluster.device == DeviceKind::Cpu && (opt == OffloadTarget::Cpu || param == OffloadTarget::Cpu)) continue;
            // overlap_comm is a choice too unless the configuration gave it: it can only hide
            // communication, at the memory of a second bucket buffer.
            if (overlap_given ? overlap != config.zero.overlap_comm : false) continue;
            PlanCandidate candidate;
            candidate.stage = stage;
            candidate.overlap_comm = overlap;
            candidate.micro_batch = micro;
            candidate.accumulation = per_rank * tensor_parallel / own / micro;
            candidate.tensor_parallel = tensor_parallel;
            candidate.options.offload_optimizer = opt;
            candidate.options.offload_param = param;
            candidate.options.recompute = recompute;
            const TrainConfig c = candidate_config(config, candidate);
            try {
              candidate.estimate = estimate_memory(figures, cluster, c, candidate.options);
            } catch (const ConfigError&) {
              continue;  // the configuration's own offload settings refuse this combination
            }
            if (candidate.estimate.per_device.total() < plan.smallest_device_need) {
              plan.smallest_device_need = candidate.estimate.per_device.total();
              leanest = candidate;
            }
            if (!candidate.estimate.fits()) continue;
            candidate.time = estimate_step_time(figures, cluster, c, candidate.options);
            all.push_back(std::move(candidate));
          }
  }
  std::stable_sort(all.begin(), all.end(),
                   [](const PlanCandidate& a, const PlanCandidate& b) { return a.time.total < b.time.total; });
  put_pick_first(all);
  plan.fitting = std::move(all);
  plan.advice = plan.fitting.empty() ? nothing_fits_advice(leanest, cluster) : pick_advice(plan.fitting, cluster);
  return plan;
}

}  // namespace zt
