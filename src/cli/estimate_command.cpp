// `zerotrain estimate`: the memory (and with --time the step time) of a training configuration
// before it runs, or with --plan the configurations that fit (docs/memory.md).
#include "cli/cli.h"

#include <fcntl.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cerrno>
#include <cmath>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <limits>

#include "checkpoint/checkpoint.h"
#include "checkpoint/hf.h"
#include "memory/estimate_report.h"
#include "zerotrain/comm/comm.h"
#include "zerotrain/config/config.h"
#include "zerotrain/error.h"
#include "zerotrain/models/model_kind.h"
#include "zerotrain/memory/estimate.h"
#include "zerotrain/memory/step_time.h"
#include "zerotrain/launch/launch.h"
#include "zerotrain/memory/memory_fit.h"
#include "zerotrain/models/gpt.h"
#include "zerotrain/train/train.h"
#include "zerotrain/version.h"

namespace zt::cli {

namespace {

// A number with an optional unit from `units` ("1.5B", "80GiB", "50GB/s"): the value times the
// unit's factor. Throws ConfigError naming `what` and showing `examples` for anything else.
double parse_with_unit(const std::string& text, const std::string& what,
                       const std::vector<std::pair<std::string, double>>& units, bool allow_zero,
                       const char* examples) {
  size_t used = 0;
  double value = 0;
  try {
    value = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  const std::string unit = text.substr(used);
  double scale = 0;
  for (const auto& [name, factor] : units)
    if (unit == name) scale = factor;
  const bool in_range = (allow_zero ? value >= 0 : value > 0) && std::isfinite(value * scale);
  if (used == 0 || scale == 0 || !in_range)
    throw zt::ConfigError(fmt::format("{}: expected {}, found '{}'", what, examples, text));
  return value * scale;
}

// The same, as a whole number of units (counts, bytes).
int64_t parse_scaled(const std::string& text, const std::string& what,
                     const std::vector<std::pair<std::string, double>>& units, bool allow_zero,
                     const char* examples) {
  const double value = parse_with_unit(text, what, units, allow_zero, examples);
  if (value >= 9e18) throw zt::ConfigError(fmt::format("{}: expected {}, found '{}'", what, examples, text));
  return static_cast<int64_t>(std::llround(value));
}

// "1.5B", "350M", "7e9", "124439808" -> a count (K, M, B/G, T are powers of 1000).
int64_t parse_count(const std::string& text, const std::string& what) {
  static const std::vector<std::pair<std::string, double>> units = {
      {"", 1}, {"K", 1e3}, {"k", 1e3}, {"M", 1e6}, {"m", 1e6}, {"B", 1e9}, {"b", 1e9}, {"G", 1e9}, {"g", 1e9},
      {"T", 1e12}, {"t", 1e12}};
  return parse_scaled(text, what, units, false, "a positive count such as 350M, 1.5B or 7e9");
}

// "80GiB", "80GB", "512MiB", "1e9" -> bytes (binary units KiB..TiB, decimal KB..TB, bare bytes).
int64_t parse_bytes(const std::string& text, const std::string& what) {
  static const std::vector<std::pair<std::string, double>> units = {
      {"", 1},     {"B", 1},   {"KiB", 1024.0}, {"MiB", 1048576.0}, {"GiB", 1073741824.0}, {"TiB", 1099511627776.0},
      {"KB", 1e3}, {"MB", 1e6}, {"GB", 1e9},     {"TB", 1e12}};
  return parse_scaled(text, what, units, true, "a size such as 80GiB, 512GB or 1e9 (bytes)");
}

// A rate's value: a number with an optional unit of FLOP/s (K, M, G, T, P) or of bandwidth (MB/s,
// GB/s, TB/s, GiB/s; Gb/s and Tb/s in bits), "1.1e9" as is.
double parse_rate(const std::string& text, const std::string& what) {
  static const std::vector<std::pair<std::string, double>> units = {
      {"", 1},           {"K", 1e3},           {"M", 1e6},           {"G", 1e9},         {"T", 1e12},
      {"P", 1e15},       {"MB/s", 1e6},        {"GB/s", 1e9},        {"TB/s", 1e12},     {"MiB/s", 1048576.0},
      {"GiB/s", 1073741824.0}, {"Mb/s", 1e6 / 8}, {"Gb/s", 1e9 / 8}, {"Tb/s", 1e12 / 8}};
  return parse_with_unit(text, what, units, true, "a non-negative number with an optional unit such as 600T, 50GB/s or 400Gb/s");
}

// "--rate inter_node_bandwidth=50GB/s": one field of ClusterRates by its JSON name.
void set_rate(zt::ClusterRates& rates, const std::string& assignment) {
  const size_t eq = assignment.find('=');
  const std::string name = assignment.substr(0, eq);
  std::vector<std::string> names;
  for (const auto& [field, member] : zt::cluster_rate_fields()) {
    names.push_back(field);
    if (eq != std::string::npos && field == name) {
      const double value = parse_rate(assignment.substr(eq + 1), "--rate " + name);
      if (name == "overlap" && !(value <= 1))
        throw zt::ConfigError(fmt::format("--rate overlap: expected a fraction in [0, 1], found {}", value));
      if (name == "reduce_bandwidth_factor" && !(value > 0))
        throw zt::ConfigError(fmt::format("--rate reduce_bandwidth_factor: expected a positive factor, found {}", value));
      rates.*member = value;
      return;
    }
  }
  throw zt::ConfigError(fmt::format("--rate: expected name=value with a name among {}, found '{}'",
                                    fmt::join(names, ", "), assignment));
}

}  // namespace

namespace {

// The cluster the flags describe: a preset, then the flags that override it.
zt::ClusterSpec cluster_of(const EstimateArgs& args) {
  zt::ClusterSpec cluster;
  if (!args.cluster.empty()) cluster = zt::cluster_preset(args.cluster);
  cluster.nodes = args.nodes;
  if (args.devices_per_node != 0 || args.cluster.empty()) cluster.devices_per_node = std::max(1, args.devices_per_node);
  if (cluster.nodes < 1 || cluster.devices_per_node < 1)
    throw zt::ConfigError(fmt::format("--nodes and --devices-per-node: expected at least 1, found {} and {}",
                                      cluster.nodes, cluster.devices_per_node));
  if (!args.device.empty() || args.cluster.empty())
    cluster.device = zt::parse_device_kind(args.device.empty() ? "cuda" : args.device, "--device");
  for (const std::string& assignment : args.rates) set_rate(cluster.rates, assignment);
  if (args.tensor_parallel != 1 && !args.time)
    throw zt::ConfigError("--tensor-parallel is a what-if input of the step-time model: expected it with --time, "
                          "found it without");
  if (!args.device_memory.empty()) cluster.device_memory = parse_bytes(args.device_memory, "--device-memory");
  if (!args.host_memory.empty()) cluster.host_memory = parse_bytes(args.host_memory, "--host-memory");
  if (!args.nvme.empty()) cluster.nvme_bytes = parse_bytes(args.nvme, "--nvme");
  if (!(args.headroom >= 0 && args.headroom < 1))
    throw zt::ConfigError(fmt::format("--headroom: expected a fraction in [0, 1), found {}", args.headroom));
  cluster.headroom = args.headroom;
  return cluster;
}

// The configuration: the file (or the defaults) with the flags as overrides.
zt::TrainConfig config_of(const EstimateArgs& args, int world_size) {
  std::vector<std::string> overrides = args.overrides;
  if (args.stage >= 0) overrides.push_back(fmt::format("zero_optimization.stage={}", args.stage));
  if (!args.precision.empty()) {
    overrides.push_back(fmt::format("bf16.enabled={}", args.precision == "bf16"));
    overrides.push_back(fmt::format("fp16.enabled={}", args.precision == "fp16"));
  }
  if (args.micro_batch > 0) overrides.push_back(fmt::format("train_micro_batch_size_per_gpu={}", args.micro_batch));
  if (args.hpz_partition_size != 1)
    overrides.push_back(fmt::format("zero_optimization.zero_hpz_partition_size={}", args.hpz_partition_size));
  if (!args.preset.empty()) overrides.push_back("model.preset=" + args.preset);
  if (args.params.empty()) {  // shape flags adjust the configuration's GPT
    if (args.layers > 0) overrides.push_back(fmt::format("model.n_layer={}", args.layers));
    if (args.hidden > 0) overrides.push_back(fmt::format("model.n_embd={}", args.hidden));
    if (args.heads > 0) overrides.push_back(fmt::format("model.n_head={}", args.heads));
    if (args.vocab > 0) overrides.push_back(fmt::format("model.vocab_size={}", args.vocab));
    if (args.seq > 0) overrides.push_back(fmt::format("data.sequence_length={}", args.seq));
  }
  return args.config_path.empty() ? zt::parse_config("", overrides, world_size)
                                  : zt::load_config(args.config_path, overrides, world_size);
}

// The model given by --params and the shape flags (a GPT-2-style shape when layers, width and
// vocabulary are all given, else bare figures).
zt::ModelFigures raw_model_of(const EstimateArgs& args, const zt::TrainConfig& config) {
  for (auto [flag, value] : {std::pair{"--layers", args.layers}, {"--hidden", args.hidden}, {"--heads", args.heads},
                             {"--seq", args.seq}, {"--vocab", args.vocab}})
    if (value < 0) throw zt::ConfigError(fmt::format("{}: expected a positive number, found {}", flag, value));
  zt::ModelFigures model;
  if (args.layers > 0 && args.hidden > 0 && args.vocab > 0) {
    // A GPT-2-style shape: its tensors give the block, tensor and persistent sizes.
    zt::GPTConfig shape;
    shape.n_layer = args.layers;
    shape.n_embd = args.hidden;
    shape.n_head = args.heads > 0 ? args.heads : args.hidden % 64 == 0 ? args.hidden / 64 : 1;
    shape.vocab_size = args.vocab;
    shape.context_length = args.seq > 0 ? args.seq : 1024;
    shape.validate();
    model = zt::gpt_model_figures(shape, shape.context_length, config.zero.stage3_param_persistence_threshold);
    if (args.seq <= 0) model.sequence_length = 0;
  } else {
    model.layers = args.layers;
    model.hidden = args.hidden;
    model.heads = args.heads;
    model.sequence_length = args.seq;
    model.vocabulary = args.vocab;
  }
  model.parameters = parse_count(args.params, "--params");
  if (!args.largest_block.empty()) model.largest_block = parse_count(args.largest_block, "--largest-block");
  else if (model.largest_block == 0) model.largest_block = model.parameters / std::max<int64_t>(1, args.layers);
  if (model.largest_parameter == 0 || model.largest_parameter > model.parameters)
    model.largest_parameter = std::min(model.parameters, model.largest_block);
  return model;
}

// The model estimated, and the line that describes it.
std::pair<zt::ModelFigures, std::string> model_of(const EstimateArgs& args, const zt::TrainConfig& config) {
  if (!args.params.empty()) {
    if (config.tensor_parallel > 1)
      throw zt::ConfigError(fmt::format("--params: a count of the whole model, which tensor_parallel.autotp_size {} "
                                        "splits; expected the configuration's model (its preset and shape keys) "
                                        "instead",
                                        config.tensor_parallel));
    zt::ModelFigures model = raw_model_of(args, config);
    return {model, fmt::format("{:.3f}B parameters", model.parameters / 1e9)};
  }
  const std::unique_ptr<zt::ModelKind> kind = zt::make_model_kind(config);
  const int64_t seq = config.data.sequence_length > 0 ? config.data.sequence_length : kind->context_length();
  const std::optional<zt::ModelFigures> figures =
      kind->estimate_figures(seq, config.zero.stage3_param_persistence_threshold, config.tensor_parallel);
  if (!figures)
    throw zt::ConfigError(fmt::format("model.type: {}; found \"{}\" (estimate it with --params and "
                                      "--layers/--hidden/--heads/--seq/--vocab)",
                                      kind->estimate_gap(), config.model.type));
  const zt::ModelFigures model = *figures;
  if (model.family == zt::ModelFigures::Family::Llama) {
    // Named as the trainer names it: by the directory that gives its shape, else by its preset.
    const zt::ModelConfig& m = config.model;
    const std::string source = !m.init_from.empty()     ? "model.init_from '" + m.init_from + "'"
                               : !m.config_from.empty() ? "model.config_from '" + m.config_from + "'"
                                                        : "preset '" + m.preset + "'";
    return {model, fmt::format("llama from {} ({} layers, {} heads over {} kv heads of {}, width {}, MLP {}, vocab {}{}, "
                               "sequence {}), {:.3f}B parameters",
                               source, model.layers, model.heads, model.kv_heads, model.head_dim, model.hidden,
                               model.intermediate, model.vocabulary, model.tied_head ? ", tied head" : "",
                               model.sequence_length, model.parameters / 1e9)};
  }
  return {model, fmt::format("gpt '{}' ({} layers, width {}, {} heads, vocab {}, sequence {}), {:.3f}B parameters",
                             config.model.preset, model.layers, model.hidden, model.heads, model.vocabulary,
                             model.sequence_length, model.parameters / 1e9)};
}

// The flags that win over the configuration's zero_optimization.offload_*.device and policy.
zt::EstimateOptions options_of(const EstimateArgs& args) {
  zt::EstimateOptions options;
  if (!args.offload_optimizer.empty())
    options.offload_optimizer = zt::parse_offload_target(args.offload_optimizer, "--offload-optimizer");
  if (!args.offload_param.empty())
    options.offload_param = zt::parse_offload_target(args.offload_param, "--offload-param");
  if (!args.activation_checkpointing.empty())
    options.recompute = zt::parse_recompute(args.activation_checkpointing, "--activation-checkpointing");
  if (!args.runtime_bytes.empty()) options.runtime_bytes = parse_bytes(args.runtime_bytes, "--runtime-bytes");
  return options;
}

nlohmann::json inputs_json(const zt::ModelFigures& model, const zt::ClusterSpec& cluster, const zt::TrainConfig& config) {
  return {{"parameters", model.parameters},
          {"largest_block", model.largest_block},
          {"persistent_parameters", model.persistent_parameters},
          {"layers", model.layers},
          {"hidden", model.hidden},
          {"heads", model.heads},
          {"sequence_length", model.sequence_length},
          {"vocabulary", model.vocabulary},
          {"nodes", cluster.nodes},
          {"devices_per_node", cluster.devices_per_node},
          {"device", zt::to_string(cluster.device)},
          {"device_memory", cluster.device_memory},
          {"host_memory", cluster.host_memory},
          {"nvme", cluster.nvme_bytes},
          {"micro_batch", config.train_micro_batch_size_per_gpu},
          {"precision", zt::to_string(config.precision)}};
}

// The estimate (and with --time the step time) as JSON or as text.
void print_estimate(const EstimateArgs& args, const zt::ClusterSpec& cluster, const zt::TrainConfig& config,
                    const zt::EstimateOptions& options, const zt::MemoryEstimate& estimate,
                    const std::optional<zt::StepTime>& time, nlohmann::json inputs, const std::string& inputs_text) {
  const char* recompute = zt::to_string(options.recompute.value_or(zt::recompute_of(config)));
  if (args.json) {
    nlohmann::json out = zt::estimate_to_json(estimate);
    if (time) {
      out["step_time"] = zt::step_time_to_json(*time);
      out["rates"] = zt::rates_to_json(cluster.rates);
      inputs["tensor_parallel"] = args.tensor_parallel;
    }
    inputs["hpz_partition_size"] = std::max(1, config.zero.hpz_partition_size);
    inputs["cluster"] = cluster.name;
    inputs["stage"] = config.zero.stage;
    inputs["offload_optimizer"] = zt::to_string(estimate.offload_optimizer);
    inputs["offload_param"] = zt::to_string(estimate.offload_param);
    inputs["activation_checkpointing"] = recompute;
    out["inputs"] = inputs;
    std::cout << out.dump(2) << "\n";
    return;
  }
  std::cout << inputs_text
            << fmt::format("zero stage {}, optimizer offload {}, parameter offload {}, activation checkpointing {}\n",
                           config.zero.stage, zt::to_string(estimate.offload_optimizer),
                           zt::to_string(estimate.offload_param), recompute)
            << zt::format_estimate(estimate, cluster);
  if (!time) return;
  if (args.tensor_parallel > 1)
    std::cout << fmt::format("what-if of the step-time model: tensor parallel {} (the memory estimate above follows "
                             "the configuration's tensor_parallel.autotp_size, {})\n",
                             args.tensor_parallel, config.tensor_parallel);
  std::cout << zt::format_step_time(*time);
}

}  // namespace

int run_estimate(const EstimateArgs& args) {
  const zt::ClusterSpec cluster = cluster_of(args);
  const zt::TrainConfig config = config_of(args, cluster.world_size());
  // The same notes and warnings as `train` prints (on stderr: --json stays machine-readable).
  print_config_messages(config, /*cpu_device=*/cluster.device == zt::DeviceKind::Cpu);
  const auto [model, model_text] = model_of(args, config);
  const zt::EstimateOptions options = options_of(args);
  if (model.family == zt::ModelFigures::Family::Llama) {
    // The step-time model counts the GPT's FLOPs, and the planner tries selective recomputation,
    // which the Llama refuses.
    if (args.plan || args.time)
      throw zt::ConfigError(fmt::format("{}: the step-time model counts the GPT's FLOPs; expected model.type \"gpt\" "
                                        "with it, found \"llama\" (the memory estimate alone covers the Llama)",
                                        args.plan ? "--plan" : "--time"));
    if (options.recompute == zt::Recompute::Selective)
      throw zt::ConfigError("--activation-checkpointing: expected none or full for model.type \"llama\", found "
                            "selective (its attention core and SwiGLU are not split out for recomputation)");
  }
  const std::string inputs_text =
      fmt::format("model: {}\ncluster: {} node(s) x {} {} device(s); micro-batch {}, {}, optimizer {}\n", model_text,
                  cluster.nodes, cluster.devices_per_node, zt::to_string(cluster.device),
                  config.train_micro_batch_size_per_gpu, zt::to_string(config.precision), config.optimizer.type);
  nlohmann::json inputs = inputs_json(model, cluster, config);
  if (args.plan && args.time)
    throw zt::ConfigError("--plan and --time: expected one of them (--plan already predicts every candidate's step time)");
  if (args.plan) {
    // The configuration's model may be split over tensor groups too; a count (--params) may not.
    zt::TensorParallelFigures split;
    // The planner's step-time model counts the GPT's FLOPs; a Hugging Face directory's shape is
    // not split by the planner.
    if (args.params.empty())
      split = [&config](int T) -> std::optional<zt::ModelFigures> {
        if (!config.model.init_from.empty() || !zt::make_model_kind(config)->profiles_flops(1)) return std::nullopt;
        return zt::estimate_figures_of(config, T);
      };
    const zt::Plan plan = zt::plan_configurations(model, cluster, config, split);
    if (args.json) {
      nlohmann::json out = zt::plan_to_json(plan);
      out["inputs"] = inputs;
      std::cout << out.dump(2) << "\n";
    } else {
      std::cout << inputs_text << zt::format_plan(plan, cluster);
    }
    return 0;
  }
  const zt::MemoryEstimate estimate = zt::estimate_memory(model, cluster, config, options);
  std::optional<zt::StepTime> time;
  if (args.time) {
    zt::StepTimeOptions what_if;
    what_if.tensor_parallel = args.tensor_parallel;
    time = zt::estimate_step_time(model, cluster, config, options, what_if);
  }
  print_estimate(args, cluster, config, options, estimate, time, std::move(inputs), inputs_text);
  return 0;
}

CLI::App* add_estimate_command(CLI::App& app, EstimateArgs& args) {
  auto* estimate = app.add_subcommand(
      "estimate", "memory per device and per host of a training configuration, before it runs (docs/memory.md)");
  estimate->add_option("config", args.config_path, "JSON configuration (optional; its model and choices)");
  estimate->add_option("--preset", args.preset, "GPT preset (" + fmt::format("{}", fmt::join(zt::gpt_preset_names(), ", ")) + ")");
  estimate->add_option("--params", args.params, "raw figures: trainable parameters (350M, 1.5B, 7e9)");
  estimate->add_option("--largest-block", args.largest_block, "raw figures: elements of the largest block");
  estimate->add_option("--layers", args.layers, "transformer layers")->check(CLI::Range(int64_t{1}, kMaxLayers));
  estimate->add_option("--hidden", args.hidden, "hidden size")->check(CLI::Range(int64_t{1}, kMaxWidth));
  estimate->add_option("--heads", args.heads, "attention heads")->check(CLI::Range(int64_t{1}, kMaxHeads));
  estimate->add_option("--seq", args.seq, "sequence length")->check(CLI::Range(int64_t{1}, kMaxTokens));
  estimate->add_option("--vocab", args.vocab, "vocabulary size")->check(CLI::Range(int64_t{1}, kMaxTokens));
  // Bounded so that nodes x devices (the world size, an int) cannot overflow.
  estimate->add_option("--cluster", args.cluster,
                       "cluster preset: devices per node, memories and rates (" +
                           fmt::format("{}", fmt::join([] {
                             std::vector<std::string> names;
                             for (const auto& p : zt::cluster_presets()) names.push_back(p.name);
                             return names;
                           }(), ", ")) +
                           "; docs/step_time.md)");
  estimate->add_option("--nodes", args.nodes, "nodes (default 1)")->check(CLI::Range(1, 1 << 16));
  estimate->add_option("--devices-per-node", args.devices_per_node, "devices per node (default 1)")
      ->check(CLI::Range(1, 1 << 10));
  estimate->add_option("--device", args.device, "cuda (default) or cpu");
  estimate->add_option("--device-memory", args.device_memory, "memory per device (80GiB, 40GB, bytes)");
  estimate->add_option("--host-memory", args.host_memory, "host memory per node");
  estimate->add_option("--nvme", args.nvme, "NVMe space per node");
  estimate->add_option("--stage", args.stage, "ZeRO stage 0-3 (sets zero_optimization.stage)")
      ->check(CLI::Range(0, 3));
  estimate->add_option("--precision", args.precision, "fp32, bf16 or fp16")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16"}));
  estimate->add_option("--micro-batch", args.micro_batch, "sequences per device per micro-step")
      ->check(CLI::Range(int64_t{1}, kMaxTokens));
  estimate->add_option("--activation-checkpointing", args.activation_checkpointing,
                       "none, selective or full recomputation in backward (default: the configuration's "
                       "activation_checkpointing.policy)")
      ->check(CLI::IsMember({"none", "selective", "full"}));
  estimate->add_option("--offload-optimizer", args.offload_optimizer,
                       "none, cpu or nvme (default: the configuration's zero_optimization.offload_optimizer.device)");
  estimate->add_option("--offload-param", args.offload_param,
                       "none, cpu or nvme, stage 3 (default: the configuration's zero_optimization.offload_param.device)");
  estimate->add_option("--headroom", args.headroom,
                       "fraction of device and host memory to keep free for a configuration to fit (default 0.1)");
  estimate->add_option("--runtime-bytes", args.runtime_bytes,
                       "framework memory per process (default: 18MiB on cpu, 512MiB on cuda)");
  estimate->add_option("--set", args.overrides, "override a configuration value: key.path=value")
      ->take_all()->allow_extra_args(false);
  estimate->add_flag("--json", args.json, "print JSON (per_device, per_host, ...) instead of a table");
  estimate->add_flag("--plan", args.plan,
                     "list the configurations that fit, fastest first by the step-time model, and pick one");
  estimate->add_flag("--time", args.time, "also predict the step time and tokens/s (docs/step_time.md)");
  estimate->add_option("--rate", args.rates,
                       "with --time or --plan: set one of the cluster's rates, name=value (inter_node_bandwidth=50GB/s, "
                       "device_flops_16bit=600T, overlap=0; docs/step_time.md)");
  estimate->add_option("--tensor-parallel", args.tensor_parallel,
                       "what-if for --time: Megatron tensor parallelism within a node (not implemented by the engine)")
      ->check(CLI::Range(1, 1024));
  estimate->add_option("--hpz-partition-size", args.hpz_partition_size,
                       "ZeRO++ secondary partition of stage-3 parameters over K ranks of a node (sets "
                       "zero_optimization.zero_hpz_partition_size: memory and --time see it)")
      ->check(CLI::Range(1, 1024));
  return estimate;
}

}  // namespace zt::cli
