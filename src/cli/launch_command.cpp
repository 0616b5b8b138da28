// `zerotrain launch`: starts N local ranks of any program with torchrun's variables.
#include "cli/cli.h"

#include <fmt/format.h>

#include <cstdlib>

#include "zerotrain/error.h"
#include "zerotrain/launch/launch.h"

namespace zt::cli {

CLI::App* add_launch_command(CLI::App& app, LaunchArgs& args) {
  auto* launch = app.add_subcommand("launch", "start N local ranks of a program with torchrun's variables");
  launch->add_option("--nproc,--nproc-per-node,--num_gpus,--num_accelerators", args.options.nproc,
                     "ranks on this node (DeepSpeed's --num_gpus)")
      ->required()
      ->check(CLI::Range(1, kMaxLocalRanks));
  add_node_options(launch, args.options.nnodes, args.options.node_rank, args.options.master_addr,
                   args.options.master_port, "launcher");
  launch->add_option("--log-dir", args.options.log_dir, "directory of the per-rank logs");
  launch->add_option("--device", args.device,
                     "auto, cpu or cuda: checked here and passed to the ranks as ZT_DEVICE (zerotrain train reads it)");
  launch->add_option("command", args.options.command, "-- PROGRAM ARGS...")->required();
  // DeepSpeed's launcher flags that mean nothing here or the same as the default: accepted
  // (--no_ssh, --no_python, --no_local_rank describe what zerotrain launch does), or refused in
  // run_launch with the equivalent.
  launch->add_flag("--no_ssh,--no_python,--no_local_rank")
      ->description("DeepSpeed's launcher flags; zerotrain launch never uses ssh, runs PROGRAM as given and passes "
                    "LOCAL_RANK in the environment only");
  for (const char* flag : {"-H,--hostfile", "-i,--include", "-e,--exclude", "--launcher", "--launcher_args"}) {
    const std::string names = flag;
    const std::string name = names.substr(names.rfind(',') + 1);
    launch->add_option_function<std::string>(names, [&args, name](const std::string& v) { args.deepspeed_refused[name] = v; },
                                             "DeepSpeed's launcher flag: refused, naming the equivalent");
  }
  for (const char* flag : {"--module", "--force_multi", "--autotuning", "--bind_cores_to_rank"}) {
    const std::string name = flag;
    launch->add_flag_callback(name, [&args, name] { args.deepspeed_refused[name] = ""; },
                              "DeepSpeed's launcher flag: refused, naming the equivalent");
  }
  return launch;
}

namespace {

// What each refused DeepSpeed launcher flag is in zerotrain launch.
std::string equivalent_of(const std::string& flag) {
  if (flag == "--hostfile" || flag == "--launcher" || flag == "--launcher_args" || flag == "--force_multi")
    return "zerotrain launch starts this node's ranks only, without ssh or MPI: run it on each node with --nnodes N "
           "--node-rank I --master-addr HOST --master-port PORT";
  if (flag == "--include" || flag == "--exclude")
    return "choose the devices with CUDA_VISIBLE_DEVICES (e.g. CUDA_VISIBLE_DEVICES=0,2 zerotrain launch --nproc 2 ...)";
  if (flag == "--module") return "name the module after --: zerotrain launch --nproc N -- python -m MODULE ARGS";
  if (flag == "--bind_cores_to_rank") return "bind cores in the command after --, e.g. with numactl or taskset";
  return "zerotrain has no autotuner";
}

}  // namespace

int run_launch(const LaunchArgs& args) {
  if (!args.deepspeed_refused.empty()) {
    const auto& [flag, value] = *args.deepspeed_refused.begin();
    throw zt::ConfigError(fmt::format("{}{}: DeepSpeed's launcher flag is not supported by zerotrain launch: {}", flag,
                                      value.empty() ? "" : " " + value, equivalent_of(flag)));
  }
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
