// Internal to the command-line program: what main.cpp and the subcommands (train_command.cpp,
// launch_command.cpp, export_command.cpp, estimate_command.cpp, generate_command.cpp) share. Each
// subcommand adds its options to the program and runs from the values parsed into its arguments;
// main.cpp turns every error into one line and an exit code.
#pragma once
#include <CLI/CLI.hpp>

#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "zerotrain/config/config.h"
#include "zerotrain/launch/launch.h"

namespace zt::cli {

// The first line of an error's text (c10 errors carry a multi-line backtrace).
std::string one_line(std::string text);

// This program's path, to start it again as the ranks.
std::string self_path();

// Flag ranges. Local ranks are processes on this machine: beyond this it is a typo, not a plan.
constexpr int kMaxLocalRanks = 1024;
constexpr int kMaxNodes = 1 << 16;
// Model shape flags share the configuration's bounds (model.* in the schema), which keep the
// size arithmetic within 64 bits.
constexpr int64_t kMaxLayers = 1 << 16, kMaxWidth = 1 << 20, kMaxHeads = 1 << 16, kMaxTokens = 1 << 24;

// A file the run will write at its end must be writable now: refusing afterwards loses the run.
// With `creates_parents` (the summary) missing directories are made at the end.
void check_output_file(const std::string& path, const std::string& flag, bool creates_parents = false);
// A directory the run will create or fill: it may not exist yet, but must not be a file, and must
// be writable.
void check_output_dir(const std::string& path, const std::string& flag);

// --device of `train` and `launch`: "auto" (CUDA when this build has it and a GPU is visible, else
// the CPU), "cpu" or "cuda". Without the flag `train` takes ZT_DEVICE, which `launch --device`
// sets for the ranks it starts. Returns "cpu" or "cuda"; throws ConfigError (one line, exit 2)
// for another value, for cuda in a CPU build and for cuda where no GPU is visible.
std::string resolve_device(const std::string& requested, const std::string& flag);

// A configuration's notes and warnings, one line each on stderr; the notes that hold only with
// parameters on the CPU when `cpu_device`.
void print_config_messages(const zt::TrainConfig& config, bool cpu_device);

// torchrun's node flags, the same for `train` and `launch` (docs/comm.md "Several nodes").
void add_node_options(CLI::App* command, int& nnodes, int& node_rank, std::string& master_addr, int& master_port,
                      const std::string& one_per_node);

// `zerotrain train`
struct TrainArgs {
  std::string config_path;
  std::string device;  // "": ZT_DEVICE, else auto
  int nproc = 1;
  int nnodes = 1, node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;
  int64_t steps = 0;
  std::vector<std::string> overrides;
  std::string summary;
  std::string save_dir, resume_dir;
  int64_t save_every = 0;
  int keep_last = 3;
  bool reset_optimizer = false;
  bool skip_memory_check = false;
};
CLI::App* add_train_command(CLI::App& app, TrainArgs& args);
// `raw_args`: the program's arguments, passed on to the ranks it starts.
int run_train(const TrainArgs& args, const std::vector<std::string>& raw_args);

// `zerotrain launch`
struct LaunchArgs {
  zt::LaunchOptions options;
  std::string device;  // "": the ranks choose
  // DeepSpeed launcher flags without a meaning here, each refused with the equivalent: flag ->
  // the value given ("" for a switch).
  std::map<std::string, std::string> deepspeed_refused;
};
CLI::App* add_launch_command(CLI::App& app, LaunchArgs& args);
int run_launch(const LaunchArgs& args);

// `zerotrain export`
struct ExportArgs {
  std::string checkpoint, init_config, out, tag, dtype = "fp32", format = "safetensors", max_shard_size;
  std::vector<std::string> overrides;
};
CLI::App* add_export_command(CLI::App& app, ExportArgs& args);
int run_export(const ExportArgs& args);

// `zerotrain generate`
struct GenerateArgs {
  std::string source, prompt, tokenizer, tag, summary;
  int64_t max_new_tokens = 64;
  double temperature = 0.0, top_p = 1.0;
  uint64_t seed = 0;
};
CLI::App* add_generate_command(CLI::App& app, GenerateArgs& args);
int run_generate(const GenerateArgs& args);

// `zerotrain estimate`
struct EstimateArgs {
  std::string config_path, preset;
  std::string params, largest_block;
  int64_t layers = 0, hidden = 0, heads = 0, seq = 0, vocab = 0;
  int nodes = 1, devices_per_node = 0;  // 0: the cluster preset's, else 1
  std::string device, device_memory, host_memory, nvme, runtime_bytes;  // "": the preset's, else cuda
  std::string cluster;  // a cluster preset (zerotrain/memory/step_time.h)
  std::vector<std::string> rates;  // "name=value" over the preset's (zerotrain/memory/estimate.h ClusterRates)
  int tensor_parallel = 1, hpz_partition_size = 1;
  bool time = false;
  double headroom = 0.1;
  int stage = -1;
  std::string precision;
  int64_t micro_batch = 0;
  std::string activation_checkpointing;  // "": the configuration's policy
  std::string offload_optimizer, offload_param;  // "": the configuration's devices
  std::vector<std::string> overrides;
  bool json = false, plan = false;
};
CLI::App* add_estimate_command(CLI::App& app, EstimateArgs& args);
int run_estimate(const EstimateArgs& args);

}  // namespace zt::cli
