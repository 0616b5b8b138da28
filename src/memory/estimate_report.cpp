#include "memory/estimate_report.h"

#include <fmt/format.h>

namespace zt {
namespace {

nlohmann::json roles_to_json(const RoleBytes& r) {
  return {{"parameters", r.parameters},
          {"gradients", r.gradients},
          {"optimizer_states", r.optimizer_states()},
          {"master_weights", r.master_weights},
          {"optimizer_moments", r.optimizer_moments},
          {"activations", r.activations},
          {"buffers", r.buffers},
          {"gathered_blocks", r.gathered_blocks},
          {"runtime", r.runtime},
          {"data", r.data},
          {"construction", r.construction},
          {"step_peak", r.step_peak()},
          {"total", r.total()}};
}

std::string options_text(const PlanCandidate& c) {
  std::string text = fmt::format("stage {}", c.stage);
  const MemoryEstimate& e = c.estimate;
  if (e.offload_optimizer != OffloadTarget::None) text += fmt::format(" +opt->{}", to_string(e.offload_optimizer));
  if (e.offload_param != OffloadTarget::None) text += fmt::format(" +param->{}", to_string(e.offload_param));
  if (c.options.recompute.value_or(Recompute::None) != Recompute::None)
    text += fmt::format(" +ckpt:{}", to_string(*c.options.recompute));
  if (c.stage < 3 && c.overlap_comm) text += " +overlap";
  if (c.tensor_parallel > 1) text += fmt::format(" +tp{}", c.tensor_parallel);
  text += fmt::format(" mb{}x{}", c.micro_batch, c.accumulation);
  return text;
}

}  // namespace

std::string human_bytes(int64_t bytes) {
  const double b = double(bytes);
  if (b >= double(1LL << 30)) return fmt::format("{:.2f} GiB", b / double(1LL << 30));
  if (b >= double(1 << 20)) return fmt::format("{:.1f} MiB", b / double(1 << 20));
  if (b >= 1024) return fmt::format("{:.1f} KiB", b / 1024);
  return fmt::format("{} B", bytes);
}

nlohmann::json estimate_to_json(const MemoryEstimate& e) {
  return {{"per_device", roles_to_json(e.per_device)},
          {"per_host", roles_to_json(e.per_host)},
          {"nvme", {{"parameters", e.nvme_per_rank.parameters},
                    {"master_weights", e.nvme_per_rank.master_weights},
                    {"optimizer_moments", e.nvme_per_rank.optimizer_moments},
                    {"optimizer_states", e.nvme_per_rank.optimizer_states()},
                    {"gradients", e.nvme_per_rank.gradients},
                    {"per_rank", e.nvme_per_rank.total()},
                    {"per_node", e.nvme_per_node},
                    {"load_staging_per_rank", e.nvme_load_staging_per_rank},
                    {"host_buffers_per_rank", e.offload_host_buffers_per_rank},
                    {"exact_partition", e.exact_partition}}},
          {"nvme_per_node", e.nvme_per_node},
          {"construction_peak", e.construction_peak},
          {"step_peak", e.step_peak},
          {"fits", e.fits()},
          {"fits_device", e.fits_device},
          {"fits_host", e.fits_host},
          {"fits_nvme", e.fits_nvme},
          {"notes", e.notes}};
}

nlohmann::json plan_to_json(const Plan& plan) {
  nlohmann::json fitting = nlohmann::json::array();
  for (const PlanCandidate& c : plan.fitting)
    fitting.push_back({{"stage", c.stage},
                       {"offload_optimizer", to_string(c.estimate.offload_optimizer)},
                       {"offload_param", to_string(c.estimate.offload_param)},
                       {"activation_checkpointing", to_string(c.options.recompute.value_or(Recompute::None))},
                       {"micro_batch", c.micro_batch},
                       {"overlap_comm", c.overlap_comm},
                       {"tensor_parallel", c.tensor_parallel},
                       {"gradient_accumulation_steps", c.accumulation},
                       {"step_time", step_time_to_json(c.time)},
                       {"estimate", estimate_to_json(c.estimate)}});
  return {{"fitting", fitting},
          {"choice", plan.fitting.empty() ? nlohmann::json(nullptr) : fitting.front()},
          {"smallest_device_need", plan.smallest_device_need},
          {"advice", plan.advice},
          {"notes", plan.notes}};
}

nlohmann::json step_time_to_json(const StepTime& t) {
  nlohmann::json terms = nlohmann::json::array();
  for (const StepTimeTerm& term : t.terms)
    terms.push_back({{"name", term.name}, {"seconds", term.seconds}, {"exposed", term.exposed}, {"bytes", term.bytes}});
  return {{"total_seconds", t.total},
          {"tokens_per_second", t.tokens_per_second},
          {"model_flops_per_device", t.model_flops_per_device},
          {"executed_flops_per_device", t.executed_flops_per_device},
          {"compute", t.compute},
          {"optimizer", t.optimizer},
          {"communication", t.communication},
          {"offload", t.offload},
          {"exposed", t.exposed},
          {"micro_batch", t.micro_batch},
          {"gradient_accumulation_steps", t.accumulation},
          {"terms", terms},
          {"notes", t.notes}};
}

const std::vector<std::pair<std::string, double ClusterRates::*>>& cluster_rate_fields() {
  static const std::vector<std::pair<std::string, double ClusterRates::*>> fields = {
      {"device_flops_fp32", &ClusterRates::device_flops_fp32},
      {"device_flops_16bit", &ClusterRates::device_flops_16bit},
      {"device_memory_bandwidth", &ClusterRates::device_memory_bandwidth},
      {"intra_node_bandwidth", &ClusterRates::intra_node_bandwidth},
      {"intra_node_latency", &ClusterRates::intra_node_latency},
      {"inter_node_bandwidth", &ClusterRates::inter_node_bandwidth},
      {"inter_node_latency", &ClusterRates::inter_node_latency},
      {"reduce_bandwidth_factor", &ClusterRates::reduce_bandwidth_factor},
      {"host_device_bandwidth", &ClusterRates::host_device_bandwidth},
      {"host_adam_rate", &ClusterRates::host_adam_rate},
      {"nvme_read_bandwidth", &ClusterRates::nvme_read_bandwidth},
      {"nvme_write_bandwidth", &ClusterRates::nvme_write_bandwidth},
      {"overlap", &ClusterRates::overlap}};
  return fields;
}

nlohmann::json rates_to_json(const ClusterRates& r) {
  nlohmann::json out = nlohmann::json::object();
  for (const auto& [name, field] : cluster_rate_fields()) out[name] = r.*field;
  return out;
}

std::string format_step_time(const StepTime& t) {
  std::string out = fmt::format("{:<62}{:>12}{:>12}\n", "step time, per optimizer step", "alone (s)", "waited (s)");
  for (const StepTimeTerm& term : t.terms)
    out += fmt::format("{:<62}{:>12.4g}{:>12.4g}\n", term.name, term.seconds, term.exposed);
  out += fmt::format("{:<62}{:>12}{:>12.4g}\n", "total", "", t.total);
  out += fmt::format("micro-batch {} x {} accumulation: {:.4g} tokens/s over the cluster, {:.3g} TFLOP/s per device",
                     t.micro_batch, t.accumulation, t.tokens_per_second, t.model_flops_per_device / 1e12);
  out += t.executed_flops_per_device > t.model_flops_per_device
             ? fmt::format(" ({:.3g} with the recomputation counted)\n", t.executed_flops_per_device / 1e12)
             : std::string("\n");
  for (const auto& note : t.notes) out += fmt::format("note: {}\n", note);
  return out;
}

std::string format_estimate(const MemoryEstimate& e, const ClusterSpec& cluster) {
  std::string out = fmt::format("{:<34}{:>14}{:>16}\n", "", fmt::format("per {}", to_string(cluster.device)),
                                fmt::format("per host ({})", cluster.devices_per_node));
  auto row = [&](const char* name, int64_t device, int64_t host) {
    out += fmt::format("{:<34}{:>14}{:>16}\n", name, human_bytes(device), human_bytes(host));
  };
  const RoleBytes &d = e.per_device, &h = e.per_host;
  row("working parameters", d.parameters, h.parameters);
  row("gradients", d.gradients, h.gradients);
  row("master weights (fp32)", d.master_weights, h.master_weights);
  row("optimizer moments", d.optimizer_moments, h.optimizer_moments);
  row("activations (saved + backward)", d.activations, h.activations);
  row("buffers", d.buffers, h.buffers);
  row("  of which gathered stage-3 blocks", d.gathered_blocks, h.gathered_blocks);
  row("runtime", d.runtime, h.runtime);
  if (d.data > 0 || h.data > 0) row("training data", d.data, h.data);
  row("construction beyond the step", d.construction, h.construction);
  row("total (peak)", d.total(), h.total());
  if (e.nvme_per_node > 0) {
    const RoleBytes& n = e.nvme_per_rank;
    out += fmt::format("{:<34}{:>14}{:>16}\n", "NVMe (parameters + optimizer)", human_bytes(n.total()),
                       human_bytes(e.nvme_per_node));
    out += fmt::format("  per rank: parameters {}, master weights {}, optimizer moments {}, gradients {}\n",
                       human_bytes(n.parameters), human_bytes(n.master_weights), human_bytes(n.optimizer_moments),
                       human_bytes(n.gradients));
  }
  auto verdict = [&](bool known, bool fits, int64_t need, int64_t have) {
    if (!known) return std::string("not checked (no capacity given)");
    return fmt::format("{} ({} of {}, keeping {:.0f}% free)", fits ? "fits" : "DOES NOT FIT", human_bytes(need),
                       human_bytes(have), 100 * cluster.headroom);
  };
  out += fmt::format("device: {}\n", verdict(cluster.device_memory > 0, e.fits_device, d.total(), cluster.device_memory));
  out += fmt::format("host:   {}\n", verdict(cluster.host_memory > 0, e.fits_host, h.total(), cluster.host_memory));
  if (e.nvme_per_node > 0)
    out += cluster.nvme_bytes > 0
               ? fmt::format("nvme:   {} ({} of {})\n", e.fits_nvme ? "fits" : "DOES NOT FIT",
                             human_bytes(e.nvme_per_node), human_bytes(cluster.nvme_bytes))
               : fmt::format("nvme:   DOES NOT FIT ({} needed per node; no NVMe space given: --nvme)\n",
                             human_bytes(e.nvme_per_node));
  for (const auto& note : e.notes) out += fmt::format("note: {}\n", note);
  return out;
}

std::string format_plan(const Plan& plan, const ClusterSpec& cluster) {
  std::string out;
  if (!plan.fitting.empty()) {
    out += fmt::format("{:<44}{:>12}{:>12}{:>14}{:>14}{:>12}\n", "configurations that fit (fastest first)",
                       "step (s)", "tokens/s", fmt::format("per {}", to_string(cluster.device)), "per host", "nvme");
    constexpr size_t kShown = 20;
    for (size_t i = 0; i < plan.fitting.size() && i < kShown; ++i) {
      const PlanCandidate& c = plan.fitting[i];
      out += fmt::format("{:<44}{:>12.4g}{:>12.4g}{:>14}{:>14}{:>12}\n", options_text(c), c.time.total,
                         c.time.tokens_per_second, human_bytes(c.estimate.per_device.total()),
                         human_bytes(c.estimate.per_host.total()),
                         c.estimate.nvme_per_node > 0 ? human_bytes(c.estimate.nvme_per_node) : "-");
    }
    if (plan.fitting.size() > kShown)
      out += fmt::format("... and {} slower ones (--json lists them all)\n", plan.fitting.size() - kShown);
  }
  for (const auto& note : plan.notes) out += fmt::format("note: {}\n", note);
  out += plan.advice + "\n";
  return out;
}

}  // namespace zt
