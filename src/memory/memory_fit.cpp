// The memory check before launch (zerotrain/memory/memory_fit.h).
#include "zerotrain/memory/memory_fit.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <sstream>

#include "memory/estimate_report.h"
#include "zerotrain/config/config.h"
#include "zerotrain/error.h"
#include "zerotrain/memory/step_time.h"

namespace zt {
namespace {

// A size of the run that the estimate prices and a user may lower without changing what is
// trained: its key, where it lives, when it matters, and leaner values to try (largest first).
struct Knob {
  const char* key;
  std::function<int64_t&(TrainConfig&)> field;
  std::function<bool(const TrainConfig&)> applies;
  std::vector<int64_t> leaner;
};

const std::vector<Knob>& knobs() {
  static const std::vector<Knob> all = {
      {"zero_optimization.offload_param.max_in_cpu",
       [](TrainConfig& c) -> int64_t& { return c.zero.offload_param.max_in_cpu; },
       [](const TrainConfig& c) { return c.zero.offload_param.device == OffloadDevice::Nvme; },
       {0}},
      {"zero_optimization.sub_group_size", [](TrainConfig& c) -> int64_t& { return c.zero.sub_group_size; },
       [](const TrainConfig& c) { return c.zero.offload_optimizer.device != OffloadDevice::None; },
       {200'000'000, 100'000'000, 50'000'000, 20'000'000, 10'000'000, 5'000'000}},
      {"zero_optimization.reduce_bucket_size", [](TrainConfig& c) -> int64_t& { return c.zero.reduce_bucket_size; },
       [](const TrainConfig& c) { return c.zero.stage >= 1 || c.world_size > 1; },
       {200'000'000, 100'000'000, 50'000'000, 20'000'000}},
      {"zero_optimization.allgather_bucket_size",
       [](TrainConfig& c) -> int64_t& { return c.zero.allgather_bucket_size; },
       [](const TrainConfig& c) { return c.zero.stage >= 1; }, {200'000'000, 100'000'000, 50'000'000, 20'000'000}},
      {"zero_optimization.stage3_prefetch_bucket_size",
       [](TrainConfig& c) -> int64_t& { return c.zero.stage3_prefetch_bucket_size; },
       [](const TrainConfig& c) { return c.zero.shard_parameters; }, {20'000'000, 0}},
      {"zero_optimization.stage3_max_reuse_distance",
       [](TrainConfig& c) -> int64_t& { return c.zero.stage3_max_reuse_distance; },
       [](const TrainConfig& c) { return c.zero.shard_parameters; }, {0}},
  };
  return all;
}

// The host peak of one node; INT64_MAX for a configuration the estimate refuses.
int64_t host_need(const ModelFigures& model, const ClusterSpec& cluster, const TrainConfig& config,
                  const EstimateOptions& options = {}) {
  try {
    return estimate_memory(model, cluster, config, options).per_host.total();
  } catch (const ConfigError&) {
    return INT64_MAX;
  }
}

struct SizeChanges {
  bool fits = false;
  std::vector<SettingChange> changes;
  int64_t need = 0;
};

// The fewest of `config`'s sizes to lower (each as little as it can) for the host peak to come
// within `target`; fits is false when even every size at its leanest does not.
SizeChanges fewest_size_changes(const ModelFigures& model, const ClusterSpec& cluster, const TrainConfig& config,
                                const EstimateOptions& options, int64_t target) {
  // Every size at its leanest first: if that does not fit, no choice of sizes does.
  TrainConfig lean = config;
  std::vector<std::pair<const Knob*, int64_t>> used;  // with the configuration's value
  for (const Knob& k : knobs()) {
    if (!k.applies(lean)) continue;
    int64_t& value = k.field(lean);
    if (k.leaner.back() < value) {
      used.emplace_back(&k, value);
      value = k.leaner.back();
    }
  }
  SizeChanges out;
  if (host_need(model, cluster, lean, options) > target) return out;
  // Then give each size back as much as the target allows, in order: the fewest changes.
  for (const auto& [k, original] : used) {
    std::vector<int64_t> tries = {original};
    for (int64_t v : k->leaner)
      if (v < original) tries.push_back(v);
    for (int64_t v : tries) {
      TrainConfig candidate = lean;
      k->field(candidate) = v;
      if (host_need(model, cluster, candidate, options) <= target) {
        k->field(lean) = v;
        break;
      }
    }
    if (k->field(lean) != original) out.changes.push_back({k->key, std::to_string(k->field(lean))});
  }
  out.fits = true;
  out.need = host_need(model, cluster, lean, options);
  return out;
}

int64_t read_number_file(const std::string& path) {
  std::ifstream in(path);
  std::string text;
  if (!(in >> text) || text == "max") return -1;
  try {
    return std::stoll(text);
  } catch (const std::exception&) {
    return -1;
  }
}

}  // namespace

MemoryFit check_memory_fit(const ModelFigures& model, const ClusterSpec& cluster, const TrainConfig& config) {
  MemoryFit fit;
  fit.available = cluster.host_memory;
  fit.needed = host_need(model, cluster, config);
  fit.fits = fit.needed <= fit.available;
  if (fit.fits) return fit;

  const auto target = int64_t(double(fit.available) * (1.0 - cluster.headroom));
  if (SizeChanges sizes = fewest_size_changes(model, cluster, config, {}, target); sizes.fits) {
    fit.changes = std::move(sizes.changes);
    fit.needed_after_changes = sizes.need;
    return fit;
  }
  // No sizes suffice: the planner's pick of a stage, offload and recomputation, with every size
  // at its leanest, then the fewest size changes that layout needs.
  TrainConfig lean = config;
  for (const Knob& k : knobs()) k.field(lean) = std::min(k.field(lean), k.leaner.back());
  ClusterSpec planned = cluster;
  planned.nvme_bytes = std::max<int64_t>(planned.nvme_bytes, int64_t{1} << 62);  // checked by the engine
  const Plan plan = plan_configurations(model, planned, lean);
  if (plan.fitting.empty()) return fit;
  const PlanCandidate& pick = plan.fitting.front();
  // The offload targets go into the configuration too: they decide which sizes apply.
  TrainConfig chosen = candidate_config(config, pick);
  chosen.zero.offload_optimizer.device = pick.options.offload_optimizer.value_or(OffloadDevice::None);
  chosen.zero.offload_param.device = pick.options.offload_param.value_or(OffloadDevice::None);
  EstimateOptions recompute;
  recompute.recompute = pick.options.recompute;
  SizeChanges sizes = fewest_size_changes(model, planned, chosen, recompute, target);
  if (!sizes.fits) return fit;  // not reached: the planner found it fits with the leanest sizes
  fit.layout = describe_candidate(pick);
  fit.changes = std::move(sizes.changes);
  fit.needed_after_changes = sizes.need;
  return fit;
}

std::string describe_misfit(const MemoryFit& fit, const std::string& override_flag) {
  std::string text = fmt::format("the memory estimate of this run is {} for this node's ranks, and {} is available",
                                 human_bytes(fit.needed), human_bytes(fit.available));
  std::string sets;
  for (const SettingChange& c : fit.changes) sets += fmt::format(" --set {}={}", c.key, c.value);
  if (!fit.layout.empty())
    text += fmt::format("; {}{}{} would need {}", fit.layout, sets.empty() ? "" : " with", sets,
                        human_bytes(fit.needed_after_changes));
  else if (!fit.changes.empty())
    text += fmt::format(";{} would bring it to {}", sets, human_bytes(fit.needed_after_changes));
  else
    text += "; no stage, offload or size of this run fits it: use more nodes, or a smaller model, micro-batch or sequence";
  text += fmt::format(" (zerotrain estimate shows each role; {} runs it anyway)", override_flag);
  return text;
}

int64_t available_host_memory() {
  if (const char* given = std::getenv("ZT_HOST_MEMORY_AVAILABLE"); given != nullptr && *given != '\0') {
    char* end = nullptr;
    const long long v = std::strtoll(given, &end, 10);
    if (end == nullptr || *end != '\0' || v < 0)
      throw ConfigError(fmt::format("ZT_HOST_MEMORY_AVAILABLE: expected bytes (a non-negative integer), found '{}'",
                                    given));
    return v;
  }
  int64_t available = -1;
  std::ifstream meminfo("/proc/meminfo");
  std::string line;
  while (std::getline(meminfo, line))
    if (line.rfind("MemAvailable:", 0) == 0) {
      std::istringstream fields(line.substr(13));
      int64_t kib = 0;
      if (fields >> kib) available = kib * 1024;
    }
  // cgroup v2: the limit this process's group runs under, less what the group uses beyond the
  // file cache (which the kernel reclaims before it kills).
  const int64_t limit = read_number_file("/sys/fs/cgroup/memory.max");
  int64_t used = read_number_file("/sys/fs/cgroup/memory.current");
  if (limit > 0 && used >= 0) {
    std::ifstream stat("/sys/fs/cgroup/memory.stat");
    std::string key;
    int64_t value = 0;
    while (stat >> key >> value)
      if (key == "file") used = std::max<int64_t>(0, used - value);
    const int64_t left = std::max<int64_t>(0, limit - used);
    available = available < 0 ? left : std::min(available, left);
  }
  return available;
}

}  // namespace zt
