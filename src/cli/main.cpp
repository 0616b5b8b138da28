// zerotrain command-line program. Every failure becomes one line on stderr and a non-zero exit:
// 2 for bad input (configuration, arguments, data files), 1 for anything else.
#include <fcntl.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <torch/torch.h>
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
#include "zerotrain/comm.h"
#include "zerotrain/config.h"
#include "zerotrain/error.h"
#include "zerotrain/estimate.h"
#include "zerotrain/step_time.h"
#include "zerotrain/launch.h"
#include "zerotrain/memory_fit.h"
#include "zerotrain/models/gpt.h"
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

// Flag ranges. Local ranks are processes on this machine: beyond this it is a typo, not a plan.
constexpr int kMaxLocalRanks = 1024;
constexpr int kMaxNodes = 1 << 16;
// Model shape flags share the configuration's bounds (model.* in the schema), which keep the
// size arithmetic within 64 bits.
constexpr int64_t kMaxLayers = 1 << 16, kMaxWidth = 1 << 20, kMaxHeads = 1 << 16, kMaxTokens = 1 << 24;

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

// A file the run will write at its end must be writable now: refusing afterwards loses the run.
// With `creates_parents` (the summary) missing directories are made at the end, so the nearest
// existing ancestor must be a directory; otherwise the parent itself must exist.
void check_output_file(const std::string& path, const std::string& flag, bool creates_parents = false) {
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

// A configuration's notes and warnings, one line each on stderr; the notes that hold only with
// parameters on the CPU when `cpu_device`.
void print_config_messages(const zt::TrainConfig& config, bool cpu_device) {
  for (const std::string& note : config.notes) std::cerr << "zerotrain: note: " << note << "\n";
  if (cpu_device)
    for (const std::string& note : config.cpu_device_notes) std::cerr << "zerotrain: note: " << note << "\n";
  for (const std::string& warning : config.warnings) std::cerr << "zerotrain: warning: " << warning << "\n";
}

// The run's GPT and this node's ranks as the memory estimate takes them; nullopt for a model the
// estimate does not cover (the BERT) or a configuration it refuses.
struct NodeEstimateInputs {
  zt::ModelFigures model;
  zt::ClusterSpec cluster;
};
std::optional<NodeEstimateInputs> node_estimate_inputs(const zt::TrainConfig& config, int nproc, int nnodes,
                                                       const std::string& device) {
  if (config.model.type != "gpt") return std::nullopt;
  NodeEstimateInputs in;
  in.cluster.device = device == "cuda" ? zt::DeviceKind::Cuda : zt::DeviceKind::Cpu;
  in.cluster.devices_per_node = nproc;
  in.cluster.nodes = nnodes;
  const zt::GPTConfig gpt = zt::gpt_config_of(config);
  const int64_t seq = config.data.sequence_length > 0 ? config.data.sequence_length : gpt.context_length;
  in.model = zt::gpt_model_figures(gpt, seq, config.zero.stage3_param_persistence_threshold);
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

struct EstimateArgs {
  std::string config_path, preset;
  std::string params, largest_block;
  int64_t layers = 0, hidden = 0, heads = 0, seq = 0, vocab = 0;
  int nodes = 1, devices_per_node = 0;  // 0: the cluster preset's, else 1
  std::string device, device_memory, host_memory, nvme, runtime_bytes;  // "": the preset's, else cuda
  std::string cluster;  // a cluster preset (zerotrain/step_time.h)
  std::vector<std::string> rates;  // "name=value" over the preset's (zerotrain/estimate.h ClusterRates)
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

int run_estimate(const EstimateArgs& args) {
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
  const bool raw = !args.params.empty();
  if (!raw) {  // shape flags adjust the configuration's GPT
    if (args.layers > 0) overrides.push_back(fmt::format("model.n_layer={}", args.layers));
    if (args.hidden > 0) overrides.push_back(fmt::format("model.n_embd={}", args.hidden));
    if (args.heads > 0) overrides.push_back(fmt::format("model.n_head={}", args.heads));
    if (args.vocab > 0) overrides.push_back(fmt::format("model.vocab_size={}", args.vocab));
    if (args.seq > 0) overrides.push_back(fmt::format("data.sequence_length={}", args.seq));
  }
  const zt::TrainConfig config = args.config_path.empty()
                                     ? zt::parse_config("", overrides, cluster.world_size())
                                     : zt::load_config(args.config_path, overrides, cluster.world_size());
  // The same notes and warnings as `train` prints (on stderr: --json stays machine-readable).
  print_config_messages(config, /*cpu_device=*/cluster.device == zt::DeviceKind::Cpu);
  zt::ModelFigures model;
  std::string model_text;
  if (raw) {
    for (auto [flag, value] : {std::pair{"--layers", args.layers}, {"--hidden", args.hidden}, {"--heads", args.heads},
                               {"--seq", args.seq}, {"--vocab", args.vocab}})
      if (value < 0) throw zt::ConfigError(fmt::format("{}: expected a positive number, found {}", flag, value));
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
    model_text = fmt::format("{:.3f}B parameters", model.parameters / 1e9);
  } else {
    if (config.model.type == "bert")
      throw zt::ConfigError("model.type: the memory estimate models the GPT; expected \"gpt\", found \"bert\" (estimate "
                            "a BERT with --params and --layers/--hidden/--heads/--seq/--vocab)");
    const zt::GPTConfig gpt = zt::gpt_config_of(config);
    const int64_t seq = config.data.sequence_length > 0 ? config.data.sequence_length : gpt.context_length;
    model = zt::gpt_model_figures(gpt, seq, config.zero.stage3_param_persistence_threshold);
    model_text = fmt::format("gpt '{}' ({} layers, width {}, {} heads, vocab {}, sequence {}), {:.3f}B parameters",
                             config.model.preset, gpt.n_layer, gpt.n_embd, gpt.n_head, gpt.vocab_size, seq,
                             model.parameters / 1e9);
  }
  zt::EstimateOptions options;
  // The flags win over the configuration's zero_optimization.offload_*.device.
  if (!args.offload_optimizer.empty())
    options.offload_optimizer = zt::parse_offload_target(args.offload_optimizer, "--offload-optimizer");
  if (!args.offload_param.empty())
    options.offload_param = zt::parse_offload_target(args.offload_param, "--offload-param");
  if (!args.activation_checkpointing.empty())
    options.recompute = zt::parse_recompute(args.activation_checkpointing, "--activation-checkpointing");
  if (!args.runtime_bytes.empty()) options.runtime_bytes = parse_bytes(args.runtime_bytes, "--runtime-bytes");
  const char* precision = zt::to_string(config.precision);
  const std::string inputs_text =
      fmt::format("model: {}\ncluster: {} node(s) x {} {} device(s); micro-batch {}, {}, optimizer {}\n", model_text,
                  cluster.nodes, cluster.devices_per_node, zt::to_string(cluster.device),
                  config.train_micro_batch_size_per_gpu, precision, config.optimizer.type);
  nlohmann::json inputs = {{"parameters", model.parameters},
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
                           {"precision", precision}};
  if (args.plan && args.time)
    throw zt::ConfigError("--plan and --time: expected one of them (--plan already predicts every candidate's step time)");
  if (args.plan) {
    const zt::Plan plan = zt::plan_configurations(model, cluster, config);
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
    inputs["activation_checkpointing"] = zt::to_string(options.recompute.value_or(zt::recompute_of(config)));
    out["inputs"] = inputs;
    std::cout << out.dump(2) << "\n";
  } else {
    std::cout << inputs_text
              << fmt::format("zero stage {}, optimizer offload {}, parameter offload {}, activation checkpointing {}\n",
                             config.zero.stage, zt::to_string(estimate.offload_optimizer),
                             zt::to_string(estimate.offload_param),
                             zt::to_string(options.recompute.value_or(zt::recompute_of(config))))
              << zt::format_estimate(estimate, cluster);
    if (time) {
      if (args.tensor_parallel > 1)
        std::cout << fmt::format("what-if (the engine does not implement it, and the memory estimate above does not "
                                 "see it): tensor parallel {}\n",
                                 args.tensor_parallel);
      std::cout << zt::format_step_time(*time);
    }
  }
  return 0;
}

struct ExportArgs {
  std::string checkpoint, init_config, out, tag, dtype = "fp32", format = "safetensors", max_shard_size;
  std::vector<std::string> overrides;
};

// The configuration of `export --init`, resolved for the world size its batch keys imply: the
// initial weights do not depend on it (rank 0's values are every rank's), but an explicit batch
// triple only resolves for one world size.
zt::TrainConfig load_init_config(const ExportArgs& args) {
  try {
    return zt::load_config(args.init_config, args.overrides, 1);
  } catch (const zt::ConfigError& first) {
    for (int world = 2; world <= kMaxLocalRanks; ++world) {
      try {
        return zt::load_config(args.init_config, args.overrides, world);
      } catch (const zt::ConfigError&) {
      }
    }
    throw;
  }
}

// `zerotrain export`: a checkpoint's weights (streamed from its rank files) or, with --init, the
// weights a training configuration starts from (built in memory as the trainer builds them).
int run_export(const ExportArgs& args) {
  if (args.checkpoint.empty() == args.init_config.empty())
    throw zt::ConfigError("export: expected a checkpoint directory or --init CONFIG (one of them)");
  if (!args.overrides.empty() && args.init_config.empty())
    throw zt::ConfigError("export: --set applies to --init CONFIG only");
  if (!args.tag.empty() && !args.init_config.empty()) throw zt::ConfigError("export: --tag applies to a checkpoint only");
  const bool hf = args.format == "hf";
  if (!args.max_shard_size.empty() && !hf) throw zt::ConfigError("--max-shard-size: applies to --format hf only");
  const int64_t max_shard = args.max_shard_size.empty() ? zt::hf_default_max_shard_bytes()
                                                         : zt::parse_shard_size(args.max_shard_size);
  if (hf) check_output_dir(args.out, "--out");
  else check_output_file(args.out, "--out");
  const at::ScalarType dtype = args.dtype == "bf16" ? at::kBFloat16 : at::kFloat;
  const auto started = std::chrono::steady_clock::now();
  int64_t bytes = 0;
  bool bert = false;  // the model is the reference BERT (else the GPT)
  std::string source;
  if (!args.init_config.empty()) {
    const zt::TrainConfig config = load_init_config(args);
    for (const std::string& note : config.notes) std::cerr << "zerotrain: note: " << note << "\n";
    bert = config.model.type == "bert";
    // As the trainer: the seed right before construction (rank 0's values are every rank's).
    zt::GPTConfig gpt;
    zt::BertConfig bert_config;
    std::shared_ptr<torch::nn::Module> model;
    if (bert) {
      bert_config = zt::bert_config_of(config);
      torch::manual_seed(config.train.seed);
      model = zt::Bert(bert_config).ptr();
    } else {
      gpt = zt::gpt_config_of(config);
      torch::manual_seed(config.train.seed);
      model = zt::GPT(gpt).ptr();
    }
    torch::NoGradGuard no_grad;
    if (!config.model.init_from.empty()) {
      zt::HfModelReader reader(config.model.init_from, gpt);
      for (auto& named : model->named_parameters(/*recurse=*/true)) {
        torch::Tensor values = torch::empty(named.value().sizes(), torch::kFloat32);
        reader.read(named.key(), named.value().sizes().vec(), 0, values.numel(), values.data_ptr<float>());
        named.value().copy_(values);
      }
      source = fmt::format("the weights of model.init_from '{}'", config.model.init_from);
    } else {
      source = fmt::format("the initial weights of preset '{}' with train.seed {}", config.model.preset,
                           config.train.seed);
    }
    std::vector<zt::HfTensor> tensors;
    for (const auto& named : model->named_parameters(/*recurse=*/true)) {
      torch::Tensor value = named.value();
      tensors.push_back({named.key(), value.sizes().vec(), [value] { return value.detach().to(torch::kFloat32); }});
    }
    for (const auto& named : model->named_buffers(/*recurse=*/true)) {
      if (!named.value().is_floating_point()) continue;
      torch::Tensor value = named.value();
      tensors.push_back({named.key(), value.sizes().vec(), [value] { return value.detach().to(torch::kFloat32); }});
    }
    bytes = hf && bert ? zt::write_hf_bert_model(tensors, bert_config, args.out, dtype, max_shard)
            : hf       ? zt::write_hf_model(tensors, gpt, args.out, dtype, max_shard)
               : zt::write_safetensors_model(tensors, args.out, dtype,
                                             {{"format", "pt"}, {"zerotrain.init", args.init_config}});
  } else if (hf) {
    zt::CheckpointModel checkpoint(args.checkpoint, args.tag);
    bert = zt::model_type_from_resolved(checkpoint.configuration(), checkpoint.where()) == "bert";
    std::vector<zt::HfTensor> tensors;
    for (const auto& p : checkpoint.tensors())
      tensors.push_back({p.name, p.shape, [&checkpoint, name = p.name] { return checkpoint.read(name); }});
    bytes = bert ? zt::write_hf_bert_model(tensors, zt::bert_config_from_resolved(checkpoint.configuration(),
                                                                                   checkpoint.where()),
                                           args.out, dtype, max_shard)
                 : zt::write_hf_model(tensors, zt::gpt_config_from_resolved(checkpoint.configuration(),
                                                                            checkpoint.where()),
                                      args.out, dtype, max_shard);
    source = "checkpoint " + checkpoint.root();
  } else {
    bytes = zt::export_checkpoint(args.checkpoint, args.tag, args.out, dtype);
    source = "checkpoint " + args.checkpoint;
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  std::cout << fmt::format("wrote {} ({}, {:.1f} MB, {}) from {} in {:.2f} s; peak RSS {:.0f} MiB\n", args.out,
                           !hf ? "safetensors" : bert ? "Hugging Face BERT directory" : "Hugging Face GPT-2 directory", bytes / 1e6, args.dtype, source,
                           seconds, zt::peak_rss_bytes() / 1048576.0);
  return 0;
}

// torchrun's node flags, the same for `train` and `launch` (docs/comm.md "Several nodes").
void add_node_options(CLI::App* command, int& nnodes, int& node_rank, std::string& master_addr, int& master_port,
                      const std::string& one_per_node) {
  command->add_option("--nnodes", nnodes, "nodes in the job, one " + one_per_node + " on each (default 1)")
      ->check(CLI::Range(1, kMaxNodes));
  command->add_option("--node-rank", node_rank, "this node, 0..nnodes-1 (default 0)")->check(CLI::Range(0, kMaxNodes - 1));
  command->add_option("--master-addr", master_addr, "node 0's address (default 127.0.0.1)");
  command->add_option("--master-port", master_port,
                      "node 0's port: the rendezvous, or with --nnodes > 1 the launchers' meeting point (default: a "
                      "free one, one node only)")
      ->check(CLI::Range(0, 65535));
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"zerotrain: ZeRO data-parallel training on LibTorch", "zerotrain"};
  app.set_version_flag("--version", zt::version());
  app.require_subcommand(1);

  TrainArgs train_args;
  auto* train = app.add_subcommand("train", "train the reference GPT or BERT (spawns --nproc local ranks)");
  train->add_option("config", train_args.config_path, "JSON configuration (DeepSpeed keys + model/data/train)")
      ->required();
  train->add_option("--nproc,--nproc-per-node", train_args.nproc,
                    "ranks to start on this node (ignored under an external launcher)")
      ->check(CLI::Range(1, kMaxLocalRanks));
  add_node_options(train, train_args.nnodes, train_args.node_rank, train_args.master_addr, train_args.master_port,
                   "`zerotrain train`");
  train->add_option("--steps", train_args.steps, "optimizer steps (same as --set train.steps=S)")
      ->check(CLI::Range(int64_t{1}, int64_t{100'000'000}));  // train.steps' range
  train->add_option("--set", train_args.overrides, "override a configuration value: key.path=value")
      ->take_all()->allow_extra_args(false);
  train->add_option("--summary", train_args.summary, "write a JSON summary of the run to this file");
  train->add_option("--save-dir", train_args.save_dir, "save checkpoints into this directory (at the end, and see --save-every)");
  // Integer ranges name their bounds as integers (CLI::NonNegativeNumber would print DBL_MAX).
  train->add_option("--save-every", train_args.save_every, "also save every K optimizer steps (needs --save-dir)")
      ->check(CLI::Range(int64_t{0}, int64_t{100'000'000}));  // train.steps' range
  train->add_option("--keep-last", train_args.keep_last, "keep the newest K checkpoints in --save-dir (0: all; default 3)")
      ->check(CLI::Range(0, std::numeric_limits<int>::max()));
  train->add_option("--resume", train_args.resume_dir, "continue from the latest checkpoint in this directory");
  train->add_flag("--reset-optimizer", train_args.reset_optimizer,
                  "with --resume: load the weights only and start the optimizer moments afresh (to change the "
                  "optimizer type)");

  train->add_flag("--skip-memory-check", train_args.skip_memory_check,
                  "start even when the memory estimate of this node's ranks exceeds the host memory available");
  train->add_option("--device", train_args.device,
                    "auto (default: cuda when built with CUDA and a GPU is visible, else cpu), cpu or cuda; rank r "
                    "uses cuda:(LOCAL_RANK % GPUs)");

  zt::LaunchOptions launch_options;
  std::string launch_device;
  auto* launch = app.add_subcommand("launch", "start N local ranks of a program with torchrun's variables");
  launch->add_option("--nproc,--nproc-per-node", launch_options.nproc, "ranks on this node")
      ->required()
      ->check(CLI::Range(1, kMaxLocalRanks));
  add_node_options(launch, launch_options.nnodes, launch_options.node_rank, launch_options.master_addr,
                   launch_options.master_port, "launcher");
  launch->add_option("--log-dir", launch_options.log_dir, "directory of the per-rank logs");
  launch->add_option("--device", launch_device,
                     "auto, cpu or cuda: checked here and passed to the ranks as ZT_DEVICE (zerotrain train reads it)");
  launch->add_option("command", launch_options.command, "-- PROGRAM ARGS...")->required();

  ExportArgs export_args;
  auto* export_cmd = app.add_subcommand(
      "export", "write a checkpoint's model weights (or a configuration's initial ones, --init) as safetensors or as "
                "a Hugging Face GPT-2 directory (streamed, tensor by tensor)");
  auto* export_checkpoint_option =
      export_cmd->add_option("checkpoint", export_args.checkpoint, "checkpoint directory (the --save-dir of a run)");
  auto* export_init_option = export_cmd->add_option(
      "--init", export_args.init_config,
      "instead of a checkpoint: the weights this training configuration starts from (its seed, or its model.init_from)");
  export_checkpoint_option->excludes(export_init_option);
  export_cmd->add_option("--set", export_args.overrides, "with --init: override a configuration value: key.path=value")
      ->take_all()->allow_extra_args(false);
  export_cmd->add_option("--out", export_args.out,
                         "the safetensors file (--format safetensors) or directory (--format hf) to write")
      ->required();
  export_cmd->add_option("--format", export_args.format,
                         "safetensors (default: one file, zerotrain's names) or hf (a directory transformers' "
                         "GPT2LMHeadModel.from_pretrained loads)")
      ->check(CLI::IsMember({"safetensors", "hf"}));
  export_cmd->add_option("--max-shard-size", export_args.max_shard_size,
                         "--format hf: shard the weights above this size (bytes, or 50GB, 500MB: transformers' units; "
                         "default 50GB as its save_pretrained)");
  export_cmd->add_option("--tag", export_args.tag, "which checkpoint (default: the one 'latest' names)");
  export_cmd->add_option("--dtype", export_args.dtype, "fp32 or bf16 (rounded to nearest even)")
      ->check(CLI::IsMember({"fp32", "bf16"}));

  EstimateArgs estimate_args;
  auto* estimate = app.add_subcommand(
      "estimate", "memory per device and per host of a training configuration, before it runs (docs/memory.md)");
  estimate->add_option("config", estimate_args.config_path, "JSON configuration (optional; its model and choices)");
  estimate->add_option("--preset", estimate_args.preset, "GPT preset (" + fmt::format("{}", fmt::join(zt::gpt_preset_names(), ", ")) + ")");
  estimate->add_option("--params", estimate_args.params, "raw figures: trainable parameters (350M, 1.5B, 7e9)");
  estimate->add_option("--largest-block", estimate_args.largest_block, "raw figures: elements of the largest block");
  estimate->add_option("--layers", estimate_args.layers, "transformer layers")->check(CLI::Range(int64_t{1}, kMaxLayers));
  estimate->add_option("--hidden", estimate_args.hidden, "hidden size")->check(CLI::Range(int64_t{1}, kMaxWidth));
  estimate->add_option("--heads", estimate_args.heads, "attention heads")->check(CLI::Range(int64_t{1}, kMaxHeads));
  estimate->add_option("--seq", estimate_args.seq, "sequence length")->check(CLI::Range(int64_t{1}, kMaxTokens));
  estimate->add_option("--vocab", estimate_args.vocab, "vocabulary size")->check(CLI::Range(int64_t{1}, kMaxTokens));
  // Bounded so that nodes x devices (the world size, an int) cannot overflow.
  estimate->add_option("--cluster", estimate_args.cluster,
                       "cluster preset: devices per node, memories and rates (" +
                           fmt::format("{}", fmt::join([] {
                             std::vector<std::string> names;
                             for (const auto& p : zt::cluster_presets()) names.push_back(p.name);
                             return names;
                           }(), ", ")) +
                           "; docs/step_time.md)");
  estimate->add_option("--nodes", estimate_args.nodes, "nodes (default 1)")->check(CLI::Range(1, 1 << 16));
  estimate->add_option("--devices-per-node", estimate_args.devices_per_node, "devices per node (default 1)")
      ->check(CLI::Range(1, 1 << 10));
  estimate->add_option("--device", estimate_args.device, "cuda (default) or cpu");
  estimate->add_option("--device-memory", estimate_args.device_memory, "memory per device (80GiB, 40GB, bytes)");
  estimate->add_option("--host-memory", estimate_args.host_memory, "host memory per node");
  estimate->add_option("--nvme", estimate_args.nvme, "NVMe space per node");
  estimate->add_option("--stage", estimate_args.stage, "ZeRO stage 0-3 (sets zero_optimization.stage)")
      ->check(CLI::Range(0, 3));
  estimate->add_option("--precision", estimate_args.precision, "fp32, bf16 or fp16")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16"}));
  estimate->add_option("--micro-batch", estimate_args.micro_batch, "sequences per device per micro-step")
      ->check(CLI::Range(int64_t{1}, kMaxTokens));
  estimate->add_option("--activation-checkpointing", estimate_args.activation_checkpointing,
                       "none, selective or full recomputation in backward (default: the configuration's "
                       "activation_checkpointing.policy)")
      ->check(CLI::IsMember({"none", "selective", "full"}));
  estimate->add_option("--offload-optimizer", estimate_args.offload_optimizer,
                       "none, cpu or nvme (default: the configuration's zero_optimization.offload_optimizer.device)");
  estimate->add_option("--offload-param", estimate_args.offload_param,
                       "none, cpu or nvme, stage 3 (default: the configuration's zero_optimization.offload_param.device)");
  estimate->add_option("--headroom", estimate_args.headroom,
                       "fraction of device and host memory to keep free for a configuration to fit (default 0.1)");
  estimate->add_option("--runtime-bytes", estimate_args.runtime_bytes,
                       "framework memory per process (default: 18MiB on cpu, 512MiB on cuda)");
  estimate->add_option("--set", estimate_args.overrides, "override a configuration value: key.path=value")
      ->take_all()->allow_extra_args(false);
  estimate->add_flag("--json", estimate_args.json, "print JSON (per_device, per_host, ...) instead of a table");
  estimate->add_flag("--plan", estimate_args.plan,
                     "list the configurations that fit, fastest first by the step-time model, and pick one");
  estimate->add_flag("--time", estimate_args.time, "also predict the step time and tokens/s (docs/step_time.md)");
  estimate->add_option("--rate", estimate_args.rates,
                       "with --time or --plan: set one of the cluster's rates, name=value (inter_node_bandwidth=50GB/s, "
                       "device_flops_16bit=600T, overlap=0; docs/step_time.md)");
  estimate->add_option("--tensor-parallel", estimate_args.tensor_parallel,
                       "what-if for --time: Megatron tensor parallelism within a node (not implemented by the engine)")
      ->check(CLI::Range(1, 1024));
  estimate->add_option("--hpz-partition-size", estimate_args.hpz_partition_size,
                       "ZeRO++ secondary partition of stage-3 parameters over K ranks of a node (sets "
                       "zero_optimization.zero_hpz_partition_size: memory and --time see it)")
      ->check(CLI::Range(1, 1024));

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
    if (*launch) {
      if (launch_options.nproc < 1)
        throw zt::ConfigError(fmt::format("--nproc: expected at least 1, found {}", launch_options.nproc));
      if (!launch_device.empty()) {
        // Checked before any rank starts; the ranks inherit the choice through the environment.
        resolve_device(launch_device, "--device");
        ::setenv("ZT_DEVICE", launch_device.c_str(), 1);
      }
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
