// zerotrain command-line program. Every failure becomes one line on stderr and a non-zero exit:
// 2 for bad input (configuration, arguments, data files), 1 for anything else. The subcommands are
// in train_command.cpp, launch_command.cpp, export_command.cpp, estimate_command.cpp and
// generate_command.cpp; what they share is in cli.h.
#include "cli/cli.h"

#include <fcntl.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <torch/torch.h>
#include <fmt/format.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>

#include "zerotrain/error.h"
#include "zerotrain/version.h"

namespace zt::cli {

// The CLI's contract is one line per error; c10 errors carry a multi-line backtrace.
std::string one_line(std::string text) {
  while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.pop_back();
  for (auto& c : text)
    if (c == '\n') c = ' ';
  return text;
}

std::string self_path() { return std::filesystem::read_symlink("/proc/self/exe").string(); }

namespace {

// Creates and removes a file in `dir`: what the run will write there can be written (permissions,
// a read-only or full file system), checked before anything starts.
void probe_writable(const std::filesystem::path& dir, const std::string& flag) {
  const std::filesystem::path probe = dir / fmt::format(".zerotrain-probe-{}", ::getpid());
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0)
    throw zt::ConfigError(fmt::format("{}: cannot write in '{}' ({}); expected a writable directory", flag,
                                      dir.string(), std::strerror(errno)));
  ::close(fd);
  ::unlink(probe.c_str());
}

// The nearest existing ancestor of `path` (itself when it exists); "." for a relative path none of
// whose parts exist.
std::filesystem::path nearest_existing(std::filesystem::path path) {
  std::error_code ec;
  while (!std::filesystem::exists(path, ec)) {
    if (!path.has_parent_path() || path.parent_path() == path) return ".";
    path = path.parent_path();
  }
  return path;
}

}  // namespace

// A file the run will write at its end must be writable now: refusing afterwards loses the run.
// With `creates_parents` (the summary) missing directories are made at the end, so the nearest
// existing ancestor must be a directory; otherwise the parent itself must exist.
void check_output_file(const std::string& path, const std::string& flag, bool creates_parents) {
  if (path.empty()) throw zt::ConfigError(fmt::format("{}: expected a file path, found \"\"", flag));
  std::error_code ec;
  const std::filesystem::path file(path);
  if (std::filesystem::is_directory(file, ec))
    throw zt::ConfigError(fmt::format("{}: expected a file path, found the directory '{}'", flag, path));
  std::filesystem::path parent = file.parent_path().empty() ? "." : file.parent_path();
  if (creates_parents)
    while (!std::filesystem::exists(parent, ec) && parent != ".")
      parent = parent.has_parent_path() && parent.parent_path() != parent ? parent.parent_path() : ".";
  if (!std::filesystem::is_directory(parent, ec))
    throw zt::ConfigError(fmt::format("{}: {} '{}' {}", flag, creates_parents ? "the path" : "the directory",
                                      parent.string(), creates_parents ? "is not a directory" : "does not exist"));
  probe_writable(parent, flag);
}

// A directory the run will create or fill: it may not exist yet, but must not be a file, and it
// (or the nearest existing directory above it, where it will be made) must be writable.
void check_output_dir(const std::string& path, const std::string& flag) {
  std::error_code ec;
  if (path.empty()) throw zt::ConfigError(fmt::format("{}: expected a directory path, found \"\"", flag));
  if (std::filesystem::exists(path, ec) && !std::filesystem::is_directory(path, ec))
    throw zt::ConfigError(fmt::format("{}: expected a directory, found the file '{}'", flag, path));
  const std::filesystem::path existing = nearest_existing(path);
  if (!std::filesystem::is_directory(existing, ec))
    throw zt::ConfigError(fmt::format("{}: the path '{}' is not a directory", flag, existing.string()));
  probe_writable(existing, flag);
}

// --device of `train` and `launch`: "auto" (CUDA when this build has it and a GPU is visible, else
// the CPU), "cpu" or "cuda". Without the flag `train` takes ZT_DEVICE, which `launch --device`
// sets for the ranks it starts. Returns "cpu" or "cuda"; throws ConfigError (one line, exit 2)
// for another value, for cuda in a CPU build and for cuda where no GPU is visible.
std::string resolve_device(const std::string& requested, const std::string& flag) {
  if (requested != "auto" && requested != "cpu" && requested != "cuda")
    throw zt::ConfigError(fmt::format("{}: expected auto, cpu or cuda, found '{}'", flag, requested));
  if (requested == "cpu") return "cpu";
#ifdef ZT_CUDA
  const bool available = torch::cuda::is_available();
  if (requested == "cuda" && !available)
    throw zt::ConfigError(fmt::format("{} cuda: no CUDA device is visible (torch::cuda::is_available() is false; see "
                                      "nvidia-smi and CUDA_VISIBLE_DEVICES)",
                                      flag));
  return available ? "cuda" : "cpu";
#else
  if (requested == "cuda")
    throw zt::ConfigError(
        fmt::format("{} cuda: this zerotrain was built without CUDA (configure with -DZT_CUDA=ON)", flag));
  return "cpu";
#endif
}

// A configuration's notes and warnings, one line each on stderr; the notes that hold only with
// parameters on the CPU when `cpu_device`.
void print_config_messages(const zt::TrainConfig& config, bool cpu_device) {
  for (const std::string& note : config.notes) std::cerr << "zerotrain: note: " << note << "\n";
  if (cpu_device)
    for (const std::string& note : config.cpu_device_notes) std::cerr << "zerotrain: note: " << note << "\n";
  for (const std::string& warning : config.warnings) std::cerr << "zerotrain: warning: " << warning << "\n";
}

// torchrun's node flags, the same for `train` and `launch` (docs/comm.md "Several nodes").
void add_node_options(CLI::App* command, int& nnodes, int& node_rank, std::string& master_addr, int& master_port,
                      const std::string& one_per_node) {
  // DeepSpeed's launcher spells the same options --num_nodes, --node_rank, --master_addr, --master_port.
  command->add_option("--nnodes,--num_nodes", nnodes, "nodes in the job, one " + one_per_node + " on each (default 1)")
      ->check(CLI::Range(1, kMaxNodes));
  command->add_option("--node-rank,--node_rank", node_rank, "this node, 0..nnodes-1 (default 0)")
      ->check(CLI::Range(0, kMaxNodes - 1));
  command->add_option("--master-addr,--master_addr", master_addr, "node 0's address (default 127.0.0.1)");
  command->add_option("--master-port,--master_port", master_port,
                      "node 0's port: the rendezvous, or with --nnodes > 1 the launchers' meeting point (default: a "
                      "free one, one node only)")
      ->check(CLI::Range(0, 65535));
}

}  // namespace zt::cli

int main(int argc, char** argv) {
  using namespace zt::cli;
  CLI::App app{"zerotrain: ZeRO data-parallel training on LibTorch", "zerotrain"};
  app.set_version_flag("--version", zt::version());
  app.require_subcommand(1);

  TrainArgs train_args;
  auto* train = add_train_command(app, train_args);
  LaunchArgs launch_args;
  auto* launch = add_launch_command(app, launch_args);
  ExportArgs export_args;
  auto* export_cmd = add_export_command(app, export_args);
  EstimateArgs estimate_args;
  auto* estimate = add_estimate_command(app, estimate_args);
  GenerateArgs generate_args;
  auto* generate_cmd = add_generate_command(app, generate_args);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);
    std::cerr << "zerotrain: error: " << one_line(e.what()) << " (see zerotrain " << (train->parsed() ? "train " : "")
              << "--help)\n";
    return 2;
  }

  try {
    if (*train) {
      std::vector<std::string> raw(argv + 1, argv + argc);
      return run_train(train_args, raw);
    }
    if (*estimate) return run_estimate(estimate_args);
    if (*export_cmd) return run_export(export_args);
    if (*generate_cmd) return run_generate(generate_args);
    if (*launch) return run_launch(launch_args);
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
