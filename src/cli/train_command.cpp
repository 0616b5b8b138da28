// `zerotrain train`: checks everything a run needs, then starts this node's ranks (or, started by a
// launcher, runs as one rank).
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

// The device `train` asked for: the flag, else ZT_DEVICE (set by `launch --device`), else auto.
std::string requested_device(const std::string& flag_value, std::string& source) {
  if (!flag_value.empty()) {
    source = "--device";
    return flag_value;
  }
  if (const char* env = std::getenv("ZT_DEVICE"); env != nullptr && *env != '\0') {
    source = "ZT_DEVICE";
    return env;
  }
  source = "--device";
  return "auto";
}

zt::TrainRunOptions run_options(const TrainArgs& args) {
  zt::TrainRunOptions options;
  options.summary_path = args.summary;
  options.save_dir = args.save_dir;
  options.save_every = args.save_every;
  options.keep_last = args.keep_last;
  options.resume_dir = args.resume_dir;
  options.reset_optimizer = args.reset_optimizer;
  std::string source;
  options.device = resolve_device(requested_device(args.device, source), source);
  return options;
}

// The run's model and this node's ranks as the memory estimate takes them; nullopt for a model
// the estimate does not cover (ModelKind::estimate_gap) or a configuration it refuses.
struct NodeEstimateInputs {
  zt::ModelFigures model;
  zt::ClusterSpec cluster;
};

std::optional<NodeEstimateInputs> node_estimate_inputs(const zt::TrainConfig& config, int nproc, int nnodes,
                                                       const std::string& device) {
  std::optional<zt::ModelFigures> model = zt::estimate_figures_of(config, config.tensor_parallel);
  if (!model) return std::nullopt;
  NodeEstimateInputs in;
  in.cluster.device = device == "cuda" ? zt::DeviceKind::Cuda : zt::DeviceKind::Cpu;
  in.cluster.devices_per_node = nproc;
  in.cluster.nodes = nnodes;
  in.model = *model;
  in.model.data_bytes = zt::training_data_bytes(config);
  return in;
}

// What the launcher says beside a rank the out-of-memory killer may have ended: the estimate of
// a rank's peak on the CPU ("" for a model the estimate does not cover, the BERT).
std::string cpu_memory_note(const zt::TrainConfig& config, int nproc, int nnodes) {
  try {
    const auto in = node_estimate_inputs(config, nproc, nnodes, "cpu");
    if (!in) return "";
    const zt::MemoryEstimate e = zt::estimate_memory(in->model, in->cluster, config);
    return fmt::format("the estimate of a rank's peak for this run is {:.2f} GiB, {} ranks on this machine",
                       double(std::max(e.step_peak, e.construction_peak)) / double(int64_t{1} << 30), nproc);
  } catch (const zt::Error&) {
    return "";  // a configuration the estimate does not model: the note goes without a figure
  }
}

// Before launch: the estimate of this node's ranks against the host memory available, refused in
// one line with the settings that would fit (docs/memory.md "Before launch").
void check_host_memory(const zt::TrainConfig& config, int nproc, int nnodes, const std::string& device) {
  const int64_t available = zt::available_host_memory();
  if (available < 0) return;  // no figure to hold the estimate against
  std::optional<NodeEstimateInputs> in;
  try {
    in = node_estimate_inputs(config, nproc, nnodes, device);
  } catch (const zt::ConfigError&) {
    return;  // the estimate does not model this configuration; the ranks check it
  }
  if (!in) return;
  in->cluster.host_memory = available;
  const zt::MemoryFit fit = zt::check_memory_fit(in->model, in->cluster, config);
  if (!fit.fits) throw zt::ConfigError(zt::describe_misfit(fit, "--skip-memory-check"));
}

}  // namespace

int run_train(const TrainArgs& args, const std::vector<std::string>& raw_args) {
  std::vector<std::string> overrides = args.overrides;
  if (args.steps > 0) {
    for (const std::string& o : overrides)
      if (o.rfind("train.steps=", 0) == 0)
        throw zt::ConfigError(fmt::format("--steps {} and --set {}: both set train.steps; expected one of them",
                                          args.steps, o));
    overrides.push_back("train.steps=" + std::to_string(args.steps));
  }
  if (zt::started_by_launcher()) {
    // We are one rank: the world size comes from the launcher's environment.
    const int world_size = zt::rendezvous_from_environment().world_size;
    auto config = zt::load_config(args.config_path, overrides, world_size);
    return zt::run_training_rank(config, run_options(args));
  }
  if (args.nproc < 1) throw zt::ConfigError(fmt::format("--nproc: expected at least 1, found {}", args.nproc));
  if (args.save_every < 0 || args.keep_last < 0)
    throw zt::ConfigError(fmt::format("--save-every and --keep-last: expected >= 0, found {} and {}", args.save_every,
                                      args.keep_last));
  if (args.reset_optimizer && args.resume_dir.empty())
    throw zt::ConfigError("--reset-optimizer: needs --resume DIR (the checkpoint whose weights to load)");
  if (args.save_every > 0 && args.save_dir.empty())
    throw zt::ConfigError("--save-every: needs --save-dir DIR (where to save)");
  if (!args.summary.empty()) check_output_file(args.summary, "--summary", /*creates_parents=*/true);
  if (!args.save_dir.empty()) check_output_dir(args.save_dir, "--save-dir");
  if (!args.resume_dir.empty() && !std::filesystem::exists(std::filesystem::path(args.resume_dir) / "latest"))
    throw zt::DataError(fmt::format("--resume: no checkpoint in '{}' ('{}/latest' is missing)", args.resume_dir,
                                    args.resume_dir));
  // A damaged checkpoint (its manifest, a file's header, a tensor not fully covered) is refused
  // before any rank starts; this reads the headers only.
  if (!args.resume_dir.empty()) zt::CheckpointModel(args.resume_dir, "");
  // Validate everything before any process starts: bad input must not cost a launch.
  std::string device_source;
  const std::string device = resolve_device(requested_device(args.device, device_source), device_source);
  auto config = zt::load_config(args.config_path, overrides, args.nnodes * args.nproc);
  zt::check_training_inputs(config);
  print_config_messages(config, /*cpu_device=*/device == "cpu");
  if (!args.skip_memory_check) check_host_memory(config, args.nproc, args.nnodes, device);
  zt::LaunchOptions launch;
  launch.nproc = args.nproc;
  launch.nnodes = args.nnodes;
  launch.node_rank = args.node_rank;
  launch.master_addr = args.master_addr;
  launch.master_port = args.master_port;
  launch.log_dir = (std::filesystem::path(config.train.log_dir) / "logs").string();
  launch.command.push_back(self_path());
  launch.command.insert(launch.command.end(), raw_args.begin(), raw_args.end());
  if (device == "cpu") launch.memory_note = cpu_memory_note(config, args.nproc, args.nnodes);
  return zt::launch_local(launch);
}

CLI::App* add_train_command(CLI::App& app, TrainArgs& args) {
  auto* train = app.add_subcommand("train", "train the reference GPT or BERT (spawns --nproc local ranks)");
  train->add_option("config", args.config_path, "JSON configuration (DeepSpeed keys + model/data/train)")
      ->required();
  train->add_option("--nproc,--nproc-per-node", args.nproc,
                    "ranks to start on this node (ignored under an external launcher)")
      ->check(CLI::Range(1, kMaxLocalRanks));
  add_node_options(train, args.nnodes, args.node_rank, args.master_addr, args.master_port,
                   "`zerotrain train`");
  train->add_option("--steps", args.steps, "optimizer steps (same as --set train.steps=S)")
      ->check(CLI::Range(int64_t{1}, int64_t{100'000'000}));  // train.steps' range
  train->add_option("--set", args.overrides, "override a configuration value: key.path=value")
      ->take_all()->allow_extra_args(false);
  train->add_option("--summary", args.summary, "write a JSON summary of the run to this file");
  train->add_option("--save-dir", args.save_dir, "save checkpoints into this directory (at the end, and see --save-every)");
  // Integer ranges name their bounds as integers (CLI::NonNegativeNumber would print DBL_MAX).
  train->add_option("--save-every", args.save_every, "also save every K optimizer steps (needs --save-dir)")
      ->check(CLI::Range(int64_t{0}, int64_t{100'000'000}));  // train.steps' range
  train->add_option("--keep-last", args.keep_last, "keep the newest K checkpoints in --save-dir (0: all; default 3)")
      ->check(CLI::Range(0, std::numeric_limits<int>::max()));
  train->add_option("--resume", args.resume_dir, "continue from the latest checkpoint in this directory");
  train->add_flag("--reset-optimizer", args.reset_optimizer,
                  "with --resume: load the weights only and start the optimizer moments afresh (to change the "
                  "optimizer type)");

  train->add_flag("--skip-memory-check", args.skip_memory_check,
                  "start even when the memory estimate of this node's ranks exceeds the host memory available");
  train->add_option("--device", args.device,
                    "auto (default: cuda when built with CUDA and a GPU is visible, else cpu), cpu or cuda; rank r "
                    "uses cuda:(LOCAL_RANK % GPUs)");
  return train;
}

}  // namespace zt::cli
