// The training run's set-up phase (train/training_run.h): the communicator and device, the data,
// the model, the engine over it and the weights it starts from.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <chrono>
#include <optional>

#include "checkpoint/hf.h"
#include "memory/estimate_report.h"
#include "train/training_run.h"
#include "zero/start_agreement.h"
#include "zerotrain/models/activation_checkpointing.h"
#include "zerotrain/zero/blocks.h"
#include "zerotrain/comm/comms_logger.h"
#include "zerotrain/error.h"
#include "zerotrain/models/model_kind.h"
#include "zerotrain/memory/estimate.h"

namespace zt::training {
namespace {

// The rendezvous, the process's runtime settings, the communicator and the device; the precision
// this device trains in. Fills the first block of `run`.
void open_communicator(TrainingRun& run, const TrainConfig& config_in, const TrainRunOptions& options) {
  run.rendezvous = rendezvous_from_environment();
  const RendezvousInfo& rendezvous = run.rendezvous;
  run.runtime = apply_runtime_settings(config_in.train.threads, rendezvous.local_world_size,
                                       heap_policy_of(config_in.train.retain_freed_memory,
                                                      config_in.zero.shard_parameters));
  run.config = config_in;
  TrainConfig& config = run.config;
  if (config.world_size != rendezvous.world_size)
    throw ConfigError(fmt::format("world size: the configuration was resolved for {} ranks but this run has {} "
                                  "(WORLD_SIZE from {})",
                                  config.world_size, rendezvous.world_size, rendezvous.source));
  // The configured timeout wins only when someone set it; else ZT_COMM_TIMEOUT_SECONDS, else 5 min.
  std::optional<double> timeout;
  if (auto it = config.sources.find("comm.timeout_seconds"); it != config.sources.end() && it->second != ValueSource::Default)
    timeout = config.comm.timeout_seconds;
  CommOptions comm_options = comm_options_from_environment(timeout);
  // comms_logger: made before the communicator so that the first collective is counted too.
  if (config.comms_logger.enabled)
    run.comms_logger = std::make_shared<CommsLogger>(config.comms_logger, rendezvous.rank, rendezvous.world_size);
  comm_options.comms_logger = run.comms_logger;
  // The GPU first: NCCL's communicator and the caching allocator use the current device.
  run.device = select_device(options.device, rendezvous.local_rank);
  // bf16/fp16 on a CPU without 16-bit units: fp32, unless train.cpu_half_precision says otherwise.
  // Decided before anything reads the precision (the estimate, the engine, the flops profiler).
  run.configured_precision = config.precision;
  std::string precision_note;
  if (!run.device.cuda()) {
    PrecisionChoice choice = cpu_training_precision(config.precision, config.train.cpu_half_precision);
    config.precision = choice.precision;
    precision_note = std::move(choice.note);
  }
  run.comm = make_communicator(rendezvous, comm_options);
  run.rank = run.comm->rank();
  run.world = run.comm->world_size();
  run.leader = run.rank == 0 && !options.quiet;
  // Over the whole world before the grid splits it: the engine checks its data-parallel group again.
  check_ranks_agree(*run.comm, configuration_agreement_lines(config), "configuration");
  run.grid = make_process_grid(run.comm, config.tensor_parallel);
  run.data_rank = run.grid.data->rank();
  run.data_world = run.grid.data->world_size();
  if (run.leader) {
    fmt::print("zerotrain: {} rank(s), {} intra-op thread(s) per rank, rendezvous from {}\n", run.world,
               run.runtime.intra_op_threads, rendezvous.source);
    if (run.grid.tensor_size > 1)
      fmt::print("tensor parallelism: {} data-parallel group(s) of {} rank(s) x tensor groups of {} consecutive "
                 "ranks (each layer split over its tensor group; ZeRO shards over the data-parallel group)\n",
                 run.grid.tensor_size, run.data_world, run.grid.tensor_size);
    const RankDevice& device = run.device;
    if (device.cuda())
      fmt::print("device: {} ({}, {:.1f} GiB); {} GPU(s) visible, rank r on cuda:(LOCAL_RANK % {})\n", device.device.str(),
                 device.name, device.total_memory / 1073741824.0, device.visible, device.visible);
    else
      fmt::print("device: cpu\n");
    if (!precision_note.empty()) fmt::print("{}\n", precision_note);
  }
}

// The model's shape, the sequence length and the data.
void read_model_and_data(TrainingRun& run) {
  const TrainConfig& config = run.config;
  run.kind = make_model_kind(config);  // with model.init_from or model.config_from: its config.json
  run.n_layer = run.kind->layers();
  run.n_params = run.kind->parameters();
  const int64_t context = run.kind->context_length(), vocab = run.kind->data_vocabulary();
  run.seq_len = check_sequence_length(config.data.sequence_length, context);
  // The baseline the memory estimate is compared above: before the data, which the estimate
  // counts (training_data_bytes).
  run.baseline_rss = current_rss_bytes();
  run.data = load_data(config, vocab);
}

// activation_checkpointing.policy "auto": the cheapest recomputation whose estimated peak fits
// this machine's memory shared by its ranks (docs/activation_checkpointing.md). Returns the note
// that says what was chosen ("" when the policy is not "auto").
std::string choose_recomputation(TrainingRun& run) {
  TrainConfig& config = run.config;
  if (config.activation_checkpointing.policy != "auto") return "";
  const RendezvousInfo& rendezvous = run.rendezvous;
  const RankDevice& device = run.device;
  ClusterSpec machine;
  machine.device = DeviceKind::Cpu;
  machine.devices_per_node = rendezvous.local_world_size;
  machine.nodes = run.world / std::max(1, rendezvous.local_world_size);
  machine.device_memory = physical_memory_bytes() / std::max(1, rendezvous.local_world_size);
  if (device.cuda()) {
    // Each GPU's memory, shared by the local ranks placed on it; the host's memory per node.
    const int per_gpu = (rendezvous.local_world_size + device.visible - 1) / std::max(1, device.visible);
    machine.device = DeviceKind::Cuda;
    machine.device_memory = device.total_memory / std::max(1, per_gpu);
    machine.host_memory = physical_memory_bytes();
  }
  // The configuration refuses "auto" for a model the estimate does not model.
  std::optional<ModelFigures> modelled =
      run.kind->estimate_figures(run.seq_len, config.zero.stage3_param_persistence_threshold, config.tensor_parallel);
  if (!modelled) throw ConfigError("activation_checkpointing.policy: \"auto\" needs the memory estimate, and " +
                                   run.kind->estimate_gap());
  ModelFigures figures = *modelled;
  figures.data_bytes = run.data.bytes;
  Recompute chosen = Recompute::Full;
  int64_t need = 0;
  for (Recompute r : {Recompute::None, Recompute::Selective, Recompute::Full}) {
    EstimateOptions o;
    o.recompute = r;
    const MemoryEstimate e = estimate_memory(figures, machine, config, o);
    need = e.per_device.total();
    chosen = r;
    if (e.fits_device) break;
  }
  config.activation_checkpointing.policy = to_string(chosen);
  return fmt::format("activation_checkpointing.policy \"auto\" chose \"{}\": estimated peak {} per rank of {} "
                     "({} over {} local rank(s), keeping {:.0f}% free){}",
                     to_string(chosen), human_bytes(need), human_bytes(machine.device_memory),
                     device.cuda() ? "the GPUs' memory" : "this machine's memory", rendezvous.local_world_size,
                     100 * machine.headroom,
                     need > int64_t(double(machine.device_memory) * (1 - machine.headroom))
                         ? "; even full recomputation does not fit, the run may run out of memory"
                         : "");
}

// The model, built sharded when parameters are sharded (no rank ever holds all of it), on the
// device; activation checkpointing set on it.
void build_model(TrainingRun& run, const std::string& policy_note) {
  const TrainConfig& config = run.config;
  torch::manual_seed(config.train.seed);
  // Stage 3 builds each block in host memory and shards it at once, on a GPU too: the engine then
  // puts the shards where the plan wants them, and the rest of the model moves to the GPU here.
  std::optional<ShardedConstruction> sharded;
  if (config.zero.shard_parameters) sharded.emplace(run.data_rank, run.data_world, run.device.device);
  run.trainable = run.kind->build(run.grid.tensor);
  run.module = run.trainable->module();
  sharded.reset();
  if (run.device.cuda()) move_model(*run.module, run.device.device);
  const ActivationCheckpointingConfig& ac = config.activation_checkpointing;
  CheckpointingSettings settings;
  settings.recompute = recompute_of(config);
  settings.number_checkpoints = ac.number_checkpoints;
  settings.keep_inputs_on_host = ac.cpu_checkpointing;
  settings.contiguous_memory = ac.contiguous_memory_optimization;
  settings.synchronize_boundary = ac.synchronize_checkpoint_boundary;
  settings.profile = ac.profile;
  settings.partition_activations = ac.partition_activations && run.grid.tensor_size > 1;
  run.trainable->set_checkpointing(settings);
  if (run.leader && !policy_note.empty()) fmt::print("{}\n", policy_note);
  if (run.leader && settings.recompute != Recompute::None) {
    int64_t checkpointed = 0;
    for (int64_t i = 0; i < run.n_layer; ++i) checkpointed += run.is_checkpointed(i) ? 1 : 0;
    fmt::print("activation checkpointing: {} recomputation in {} of {} blocks{}{}\n", to_string(settings.recompute),
               checkpointed, run.n_layer, ac.contiguous_memory_optimization ? ", inputs in one contiguous buffer" : "",
               ac.profile ? ", profiled (summary: activation_checkpointing.blocks)" : "");
    if (ac.cpu_checkpointing || ac.synchronize_checkpoint_boundary)
      fmt::print("note: activation_checkpointing.cpu_checkpointing and synchronize_checkpoint_boundary act on CUDA "
                 "devices; on the CPU the kept inputs are in host memory already and every kernel is synchronous\n");
  }
}

// model.init_from: the Hugging Face weights replace the constructor's before the first step; each
// rank reads only what it keeps (docs/checkpoint.md "model.init_from"). With --resume the
// checkpoint's weights win and the directory is not read.
void load_init_from(TrainingRun& run, const TrainRunOptions& options) {
  const TrainConfig& config = run.config;
  if (config.model.init_from.empty()) return;
  if (!options.resume_dir.empty()) {
    if (run.leader)
      fmt::print("note: model.init_from '{}' is not read: --resume loads the checkpoint's weights\n",
                 config.model.init_from);
    return;
  }
  const auto init_start = std::chrono::steady_clock::now();
  const std::unique_ptr<HfModelReader> reader_holder = run.kind->hf_reader(config.model.init_from);
  HfModelReader& reader = *reader_holder;
  run.engine->load_weights(reader);
  // Every rank's bytes read, for the summary: what sharding saved.
  torch::Tensor mine = torch::zeros({run.world}, torch::kLong);
  mine[run.rank] = reader.bytes_read();
  run.comm->all_reduce(mine, ReduceOp::Sum, "init_from.bytes").wait();
  std::vector<int64_t> per_rank(mine.data_ptr<int64_t>(), mine.data_ptr<int64_t>() + run.world);
  run.init_from_summary = {{"path", config.model.init_from},
                           {"bytes_read_per_rank", per_rank},
                           {"tensor_bytes", reader.data_bytes()}};
  if (run.leader)
    fmt::print("model.init_from: loaded '{}' in {:.2f} s; bytes read per rank {} of {} in its files\n",
               config.model.init_from,
               std::chrono::duration<double>(std::chrono::steady_clock::now() - init_start).count(),
               fmt::join(per_rank, "/"), reader.data_bytes());
}

// Resuming: the checkpoint holds the engine's state; the sampler position is the step (batches
// are a function of seed, step and micro-step) and so are the dropout masks (reseeded every step),
// so nothing else is needed for an exact continuation.
void resume(TrainingRun& run, const TrainRunOptions& options) {
  if (options.resume_dir.empty()) return;
  const auto load_start = std::chrono::steady_clock::now();
  LoadOptions load_options;
  load_options.reset_optimizer = options.reset_optimizer;
  load_options.log = [](const std::string& line) { fmt::print("checkpoint: {} (changed since the checkpoint)\n", line); };
  const auto client = run.engine->load_checkpoint(options.resume_dir, "", load_options);
  const double load_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - load_start).count();
  const uint64_t seed = run.config.train.seed;
  if (auto it = client.find("seed"); it != client.end() && it->second != std::to_string(seed) && run.leader)
    fmt::print("note: the checkpoint was saved with train.seed {}; this run uses {}\n", it->second, seed);
  run.first_step = run.engine->global_step();
  if (run.leader)
    fmt::print("resumed from {}: the latest checkpoint, at step {}, loaded in {:.2f} s{}\n", options.resume_dir,
               run.first_step, load_seconds, options.reset_optimizer ? " (weights only: optimizer moments reset)" : "");
}

// The training data as the model line names it: fine-tuning examples or token counts.
std::string data_summary(const TrainingRun& run) {
  if (run.data.finetune())
    return fmt::format("{} train / {} held-out fine-tuning examples (loss on the response tokens)",
                       run.data.finetune_train->count(), run.data.finetune_val->count());
  return fmt::format("{} train / {} held-out tokens", run.data.train.size(), run.data.val.size());
}

void print_model_line(const TrainingRun& run) {
  if (!run.leader) return;
  const std::string note = run.kind->batch_note();
  fmt::print("model: {}; data: {}; global batch {} x {} tokens{}\n", run.kind->description(), data_summary(run),
             run.config.train_batch_size, run.seq_len, note.empty() ? "" : ", " + note);
}

}  // namespace

std::unique_ptr<TrainingRun> set_up_run(const TrainConfig& config, const TrainRunOptions& options) {
  auto run = std::make_unique<TrainingRun>();
  open_communicator(*run, config, options);
  read_model_and_data(*run);
  const std::string policy_note = choose_recomputation(*run);
  if (run->leader) fmt::print("resolved configuration:\n{}", describe(run->config));
  build_model(*run, policy_note);
  run->engine = std::make_unique<Engine>(run->module, run->config, run->grid.data);
  // This trainer prints its own progress line, CSV log and analytic flops profile.
  run->engine->disable_reports();
  load_init_from(*run, options);
  resume(*run, options);
  print_model_line(*run);
  return run;
}

}  // namespace zt::training
