// How a MemoryEstimate and a Plan are shown: JSON (`zerotrain estimate --json`, the run summary)
// and a text table. Internal to the library and the CLI; pure functions.
#pragma once
#include <nlohmann/json.hpp>

#include <string>
#include <utility>
#include <vector>

#include "zerotrain/memory/estimate.h"
#include "zerotrain/memory/step_time.h"

namespace zt {

// {"per_device": {parameters, gradients, optimizer_states, master_weights, optimizer_moments,
//  activations, buffers, gathered_blocks, runtime, construction, step_peak, total}, "per_host": {…},
//  "nvme": {parameters, master_weights, optimizer_moments, optimizer_states (per rank), per_rank,
//  per_node}, "nvme_per_node", "fits", "fits_device", "fits_host", "fits_nvme", "notes"}
nlohmann::json estimate_to_json(const MemoryEstimate& estimate);
nlohmann::json plan_to_json(const Plan& plan);
// {"total_seconds", "tokens_per_second", "model_flops_per_device", "compute", "optimizer",
//  "communication", "offload", "exposed", "micro_batch", "accumulation", "terms": [{name, seconds,
//  exposed, bytes}], "notes"}
nlohmann::json step_time_to_json(const StepTime& time);
// Every field of ClusterRates with its name ("device_flops_fp32", ...): the JSON keys and the
// names `zerotrain estimate --rate name=value` takes.
const std::vector<std::pair<std::string, double ClusterRates::*>>& cluster_rate_fields();
// The cluster's rates ({"device_flops_fp32", ...}) as the step-time model used them.
nlohmann::json rates_to_json(const ClusterRates& rates);

// A table of the roles per device and per host with the total and whether it fits.
std::string format_estimate(const MemoryEstimate& estimate, const ClusterSpec& cluster);
std::string format_plan(const Plan& plan, const ClusterSpec& cluster);
// Every term of the step with its seconds as if alone and as the step waits for it.
std::string format_step_time(const StepTime& time);

// "12.3 GiB", "4.0 MiB", "512 B": binary units, for people.
std::string human_bytes(int64_t bytes);

}  // namespace zt
