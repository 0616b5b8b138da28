// `zerotrain launch`: starts N local ranks of any program with torchrun's variables.
#include "cli/cli.h"

#include <fmt/format.h>

#include <cstdlib>

#include "zerotrain/error.h"
#include "zerotrain/launch.h"

namespace zt::cli {

CLI::App* add_launch_command(CLI::App& app, LaunchArgs& args) {
  auto* launch = app.add_subcommand("launch", "start N local ranks of a program with torchrun's variables");
  launch->add_option("--nproc,--nproc-per-node", args.options.nproc, "ranks on this node")
      ->required()
      ->check(CLI::Range(1, kMaxLocalRanks));
  add_node_options(launch, args.options.nnodes, args.options.node_rank, args.options.master_addr,
                   args.options.master_port, "launcher");
  launch->add_option("--log-dir", args.options.log_dir, "directory of the per-rank logs");
  launch->add_option("--device", args.device,
                     "auto, cpu or cuda: checked here and passed to the ranks as ZT_DEVICE (zerotrain train reads it)");
  launch->add_option("command", args.options.command, "-- PROGRAM ARGS...")->required();
  return launch;
}

int run_launch(const LaunchArgs& args) {
  if (args.options.nproc < 1)
    throw zt::ConfigError(fmt::format("--nproc: expected at least 1, found {}", args.options.nproc));
  if (!args.device.empty()) {
    // Checked before any rank starts; the ranks inherit the choice through the environment.
    resolve_device(args.device, "--device");
    ::setenv("ZT_DEVICE", args.device.c_str(), 1);
  }
  return zt::launch_local(args.options);
}

}  // namespace zt::cli
