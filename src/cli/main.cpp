// zerotrain command-line program. Every failure becomes one line on stderr and a non-zero exit:
// 2 for bad input (configuration, arguments, data files), 1 for anything else.
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <chrono>
#include <filesystem>
#include <iostream>

#include "checkpoint/checkpoint.h"
#include "zerotrain/comm.h"
#include "zerotrain/config.h"
#include "zerotrain/error.h"
#include "zerotrain/launch.h"
#include "zerotrain/train.h"
#include "zerotrain/version.h"

namespace {

// The CLI's contract is one line per error; c10 errors carry a multi-line backtrace.
std::string one_line(std::string text) {
  while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.pop_back();
  for (auto& c : text)
    if (c == '\n') c = ' ';
  return text;
}

std::string self_path() { return std::filesystem::read_symlink("/proc/self/exe").string(); }

struct TrainArgs {
  std::string config_path;
  int nproc = 1;
  int master_port = 0;
  int64_t steps = 0;
  std::vector<std::string> overrides;
  std::string summary;
  std::string save_dir, resume_dir;
  int64_t save_every = 0;
  int keep_last = 3;
};

zt::TrainRunOptions run_options(const TrainArgs& args) {
  zt::TrainRunOptions options;
  options.summary_path = args.summary;
  options.save_dir = args.save_dir;
  options.save_every = args.save_every;
  options.keep_last = args.keep_last;
  options.resume_dir = args.resume_dir;
  return options;
}

int run_train(const TrainArgs& args, const std::vector<std::string>& raw_args) {
  std::vector<std::string> overrides = args.overrides;
  if (args.steps > 0) overrides.push_back("train.steps=" + std::to_string(args.steps));
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
  if (args.save_every > 0 && args.save_dir.empty())
    throw zt::ConfigError("--save-every: needs --save-dir DIR (where to save)");
  if (!args.resume_dir.empty() && !std::filesystem::exists(std::filesystem::path(args.resume_dir) / "latest"))
    throw zt::DataError(fmt::format("--resume: no checkpoint in '{}' ('{}/latest' is missing)", args.resume_dir,
                                    args.resume_dir));
  // Validate everything before any process starts: bad input must not cost a launch.
  auto config = zt::load_config(args.config_path, overrides, args.nproc);
  zt::check_training_inputs(config);
  zt::LaunchOptions launch;
  launch.nproc = args.nproc;
  launch.master_port = args.master_port;
  launch.log_dir = (std::filesystem::path(config.train.log_dir) / "logs").string();
  launch.command.push_back(self_path());
  launch.command.insert(launch.command.end(), raw_args.begin(), raw_args.end());
  return zt::launch_local(launch);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"zerotrain: ZeRO data-parallel training on LibTorch", "zerotrain"};
  app.set_version_flag("--version", zt::version());
  app.require_subcommand(1);

  TrainArgs train_args;
  auto* train = app.add_subcommand("train", "train the reference GPT (spawns --nproc local ranks)");
  train->add_option("config", train_args.config_path, "JSON configuration (DeepSpeed keys + model/data/train)")
      ->required();
  train->add_option("--nproc", train_args.nproc, "local ranks to start (ignored under an external launcher)");
  train->add_option("--master-port", train_args.master_port, "rendezvous port on 127.0.0.1 (default: a free one)");
  train->add_option("--steps", train_args.steps, "optimizer steps (same as --set train.steps=S)");
  train->add_option("--set", train_args.overrides, "override a configuration value: key.path=value")
      ->take_all()->allow_extra_args(false);
  train->add_option("--summary", train_args.summary, "write a JSON summary of the run to this file");
  train->add_option("--save-dir", train_args.save_dir, "save checkpoints into this directory (at the end, and see --save-every)");
  train->add_option("--save-every", train_args.save_every, "also save every K optimizer steps (needs --save-dir)");
  train->add_option("--keep-last", train_args.keep_last, "keep the newest K checkpoints in --save-dir (0: all; default 3)");
  train->add_option("--resume", train_args.resume_dir, "continue from the latest checkpoint in this directory");

  zt::LaunchOptions launch_options;
  auto* launch = app.add_subcommand("launch", "start N local ranks of a program with torchrun's variables");
  launch->add_option("--nproc", launch_options.nproc, "number of ranks")->required();
  launch->add_option("--master-port", launch_options.master_port, "rendezvous port (default: a free one)");
  launch->add_option("--log-dir", launch_options.log_dir, "directory of the per-rank logs");
  launch->add_option("command", launch_options.command, "-- PROGRAM ARGS...")->required();

  struct {
    std::string checkpoint, out, tag, dtype = "fp32";
  } export_args;
  auto* export_cmd = app.add_subcommand(
      "export", "write a checkpoint's model weights as one safetensors file (streamed, tensor by tensor)");
  export_cmd->add_option("checkpoint", export_args.checkpoint, "checkpoint directory (the --save-dir of a run)")
      ->required();
  export_cmd->add_option("--out", export_args.out, "the safetensors file to write")->required();
  export_cmd->add_option("--tag", export_args.tag, "which checkpoint (default: the one 'latest' names)");
  export_cmd->add_option("--dtype", export_args.dtype, "fp32 or bf16 (rounded to nearest even)")
      ->check(CLI::IsMember({"fp32", "bf16"}));

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);
    std::cerr << "zerotrain: error: " << e.what() << " (see zerotrain " << (train->parsed() ? "train " : "")
              << "--help)\n";
    return 2;
  }

  try {
    if (*train) {
      std::vector<std::string> raw(argv + 1, argv + argc);
      return run_train(train_args, raw);
    }
    if (*export_cmd) {
      const auto started = std::chrono::steady_clock::now();
      const int64_t bytes = zt::export_checkpoint(export_args.checkpoint, export_args.tag, export_args.out,
                                                  export_args.dtype == "bf16" ? at::kBFloat16 : at::kFloat);
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
      std::cout << fmt::format("wrote {} ({:.1f} MB, {}) in {:.2f} s; peak RSS {:.0f} MiB\n", export_args.out,
                               bytes / 1e6, export_args.dtype, seconds, zt::peak_rss_bytes() / 1048576.0);
      return 0;
    }
    if (*launch) {
      if (launch_options.nproc < 1)
        throw zt::ConfigError(fmt::format("--nproc: expected at least 1, found {}", launch_options.nproc));
      return zt::launch_local(launch_options);
    }
  } catch (const zt::Error& e) {
    const bool bad_input = dynamic_cast<const zt::ConfigError*>(&e) || dynamic_cast<const zt::DataError*>(&e);
    std::cerr << "zerotrain: error: " << one_line(e.what()) << "\n";
    return bad_input ? 2 : 1;
  } catch (const c10::Error& e) {
    std::cerr << "zerotrain: error: " << one_line(e.what_without_backtrace()) << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "zerotrain: error: " << one_line(e.what()) << "\n";
    return 1;
  }
  return 0;
}
