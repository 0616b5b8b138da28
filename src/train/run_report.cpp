// The training run's report (train/training_run.h): the memory measured against the estimate,
// the block cache and offload figures, the JSON summary (--summary) and the comms logger's files.
#include <fmt/format.h>

#include <filesystem>
#include <fstream>

#include "memory/cpu_block_cache.h"
#include "memory/estimate_report.h"
#include "train/training_run.h"
#include "zerotrain/comm/comms_logger.h"
#include "zerotrain/error.h"
#include "zerotrain/models/model_kind.h"
#include "zerotrain/memory/estimate.h"

namespace zt::training {
namespace {

// The run's memory as measured on every rank, beside what `zerotrain estimate` says of it.
struct MemoryFigures {
  std::vector<RankStats> stats;
  MemoryEstimate estimate;     // empty where no_estimate_reason() gives one
  int64_t measured_peak = 0;   // the largest peak RSS above the pre-model baseline over ranks
  // The two moments apart (zerotrain/memory/estimate.h: construction and step), largest over ranks; -1
  // where the kernel's peak could not be restarted after set-up.
  int64_t measured_setup = -1, measured_steps = -1;
  DevicePeak gpu_peak;         // largest over ranks, on a GPU
  bool heap_retained = false;
};

// Collectives: every rank calls it.
MemoryFigures measure_memory(const TrainingRun& run, const StepLog& log) {
  MemoryFigures m;
  m.stats = gather_rank_stats(*run.comm, *run.engine, run.baseline_rss, log.peak);
  ClusterSpec cluster;
  cluster.device = DeviceKind::Cpu;
  cluster.devices_per_node = run.rendezvous.local_world_size;
  cluster.nodes = run.world / std::max(1, run.rendezvous.local_world_size);
  if (run.device.cuda()) {
    cluster.device = DeviceKind::Cuda;
    cluster.device_memory = run.device.total_memory;
    cluster.host_memory = physical_memory_bytes();
  }
  const int64_t threshold = run.config.zero.stage3_param_persistence_threshold;
  if (std::optional<ModelFigures> figures = run.kind->estimate_figures(run.seq_len, threshold, run.grid.tensor_size)) {
    figures->data_bytes = run.data.bytes;
    m.estimate = estimate_memory(*figures, cluster, run.config);
  }
  for (const auto& s : m.stats) {
    m.measured_peak = std::max(m.measured_peak, s.peak_rss - s.baseline_rss);
    if (s.setup_peak_rss >= 0) m.measured_setup = std::max(m.measured_setup, s.setup_peak_rss - s.baseline_rss);
    if (s.steps_peak_rss >= 0) m.measured_steps = std::max(m.measured_steps, s.steps_peak_rss - s.baseline_rss);
  }
  m.heap_retained = run.runtime.heap_policy == HeapPolicy::RetainedHeap;
  // On a GPU the estimate's per-device figure is the GPU's: set beside the caching allocator's
  // peaks, and the host's beside the peak RSS.
  if (run.device.cuda()) {
    const DevicePeak mine = device_peak(run.device);
    m.gpu_peak.allocated = max_over_ranks(*run.comm, mine.allocated, "device.peak_allocated");
    m.gpu_peak.reserved = max_over_ranks(*run.comm, mine.reserved, "device.peak_reserved");
  }
  return m;
}

// Why the memory estimate does not model the run's model ("" where it does).
std::string no_estimate_reason(const TrainingRun& run) { return run.kind->estimate_gap(); }

void print_memory_line(const TrainingRun& run, const MemoryFigures& m) {
  const RankDevice& device = run.device;
  const std::string no_estimate = no_estimate_reason(run);
  if (!no_estimate.empty() && device.cuda()) {
    fmt::print("memory per rank: measured {} allocated / {} reserved of {} ({}); peak RSS {} above the pre-model "
               "baseline (no estimate: {})\n",
               human_bytes(m.gpu_peak.allocated), human_bytes(m.gpu_peak.reserved), human_bytes(device.total_memory),
               device.name, human_bytes(m.measured_peak), no_estimate);
  } else if (!no_estimate.empty()) {
    fmt::print("memory per rank: measured {} above the pre-model baseline (no estimate: {})\n",
               human_bytes(m.measured_peak), no_estimate);
  } else if (device.cuda()) {
    fmt::print("memory per rank: GPU estimated peak {}, measured {} allocated / {} reserved of {} ({}); host "
               "estimated {} per node, peak RSS {} above the pre-model baseline\n",
               human_bytes(m.estimate.per_device.total()), human_bytes(m.gpu_peak.allocated),
               human_bytes(m.gpu_peak.reserved), human_bytes(device.total_memory), device.name,
               human_bytes(m.estimate.per_host.total()), human_bytes(m.measured_peak));
  } else {
    const std::string moments =
        m.measured_setup >= 0 && m.measured_steps >= 0
            ? fmt::format("; set-up measured {} (estimated {}), the steps {} (estimated {})",
                          human_bytes(m.measured_setup), human_bytes(m.estimate.construction_peak),
                          human_bytes(m.measured_steps), human_bytes(m.estimate.step_peak))
            : "";
    fmt::print("memory per rank: estimated peak {}, measured {} above the pre-model baseline ({:+.1f}%){}{}\n",
               human_bytes(m.estimate.per_device.total()), human_bytes(m.measured_peak),
               m.measured_peak > 0
                   ? 100.0 * double(m.estimate.per_device.total() - m.measured_peak) / double(m.measured_peak)
                   : 0.0,
               moments,
               m.heap_retained ? "; the heap is retained (train.retain_freed_memory), which adds fragmentation the "
                                 "estimate leaves out (docs/memory.md)"
                               : "");
  }
}

void print_cache_and_offload(const TrainingRun& run, double total_seconds) {
  if (const CpuBlockCache* cache = installed_cpu_block_cache()) {
    const CpuBlockCacheStats c = cache->stats();
    if (c.large_allocations > 0)
      fmt::print("tensor block cache (rank 0): {} of {} large allocations served from freed blocks ({:.1f}%; {} "
                 "split from larger ones, {} composed of smaller ones, {} moved), {} newly mapped in all, {} cached "
                 "blocks unmapped to stay near the steps' live peak of {}\n",
                 c.reused + c.split + c.composed, c.large_allocations,
                 100.0 * double(c.reused + c.split + c.composed) / double(c.large_allocations), c.split,
                 c.composed, human_bytes(int64_t(c.moved_bytes)), human_bytes(int64_t(c.mapped_bytes)), c.unmapped,
                 human_bytes(c.high_water_bytes));
  }
  const OffloadReport offload = run.engine->offload_report();
  if (offload.backend.empty()) return;
  fmt::print("offload (rank 0): nvme {} optimizer state + {} parameters{}, host buffers {}; read {:.2f} GB "
             "({:.2f} GB/s), wrote {:.2f} GB ({:.2f} GB/s) with {}; the training thread waited {:.1f} s of {:.1f} s "
             "for the disk\n",
             human_bytes(offload.nvme_optimizer_bytes), human_bytes(offload.nvme_parameter_bytes),
             offload.nvme_gradient_bytes > 0 ? " + " + human_bytes(offload.nvme_gradient_bytes) + " gradients" : "",
             human_bytes(offload.host_buffer_bytes), offload.bytes_read / 1e9,
             offload.read_seconds > 0 ? offload.bytes_read / 1e9 / offload.read_seconds : 0.0,
             offload.bytes_written / 1e9,
             offload.write_seconds > 0 ? offload.bytes_written / 1e9 / offload.write_seconds : 0.0, offload.backend,
             offload.stall_seconds, total_seconds);
}

nlohmann::json offload_json(const OffloadReport& offload) {
  return {{"backend", offload.backend},
          {"nvme_optimizer_bytes", offload.nvme_optimizer_bytes},
          {"nvme_parameter_bytes", offload.nvme_parameter_bytes},
          {"nvme_gradient_bytes", offload.nvme_gradient_bytes},
          {"nvme_load_staging_bytes", offload.nvme_load_staging_bytes},
          {"host_buffer_bytes", offload.host_buffer_bytes},
          {"bytes_read", offload.bytes_read},
          {"bytes_written", offload.bytes_written},
          {"read_seconds", offload.read_seconds},
          {"write_seconds", offload.write_seconds},
          {"stall_seconds", offload.stall_seconds}};
}

nlohmann::json activation_checkpointing_json(const TrainingRun& run) {
  nlohmann::json ac = {{"policy", run.config.activation_checkpointing.policy}};
  nlohmann::json blocks = nlohmann::json::array();
  // The Llama has no per-block profile (activation_checkpointing.profile is refused for it).
  const auto timings = run.trainable->checkpoint_timings();
  for (size_t i = 0; i < timings.size(); ++i)
    blocks.push_back({{"block", i},
                      {"checkpointed", run.is_checkpointed(int64_t(i))},
                      {"forward_calls", timings[i].forward_calls},
                      {"recomputations", timings[i].recomputations},
                      {"forward_seconds", timings[i].forward_seconds},
                      {"recompute_seconds", timings[i].recompute_seconds}});
  if (!timings.empty()) ac["blocks"] = blocks;
  if (auto arena = run.trainable->checkpoint_arena_stats())
    ac["contiguous_buffer"] = {{"slots", arena->slots},
                               {"slot_bytes", arena->slot_bytes},
                               {"buffer_allocations", arena->buffer_allocations},
                               {"stores", arena->stores},
                               {"overflows", arena->overflows}};
  return ac;
}

nlohmann::json ranks_json(const std::vector<RankStats>& stats) {
  nlohmann::json ranks = nlohmann::json::array();
  for (size_t r = 0; r < stats.size(); ++r)
    ranks.push_back({{"rank", r},
                     {"peak_rss_bytes", stats[r].peak_rss},
                     {"setup_peak_rss_bytes", stats[r].setup_peak_rss},
                     {"steps_peak_rss_bytes", stats[r].steps_peak_rss},
                     {"baseline_rss_bytes", stats[r].baseline_rss},
                     {"model_state_bytes",
                      {{"parameters", stats[r].state.parameters},
                       {"gradients", stats[r].state.gradients},
                       {"optimizer_states", stats[r].state.optimizer_states},
                       {"total", stats[r].state.total()}}},
                     {"buffer_bytes", stats[r].buffers}});
  return ranks;
}

nlohmann::json memory_json(const TrainingRun& run, const MemoryFigures& m) {
  nlohmann::json memory = {{"measured_peak_above_baseline_bytes", m.measured_peak},
                           {"measured_setup_peak_above_baseline_bytes", m.measured_setup},
                           {"measured_steps_peak_above_baseline_bytes", m.measured_steps},
                           {"heap_retained", m.heap_retained},
                           {"heap_policy", run.config.train.retain_freed_memory}};
  if (const CpuBlockCache* cache = installed_cpu_block_cache()) {
    const CpuBlockCacheStats c = cache->stats();
    memory["block_cache_rank0"] = {{"large_allocations", c.large_allocations}, {"reused", c.reused},
                                   {"split", c.split},
                                   {"composed", c.composed},
                                   {"moved_bytes", c.moved_bytes},
                                   {"mapped_bytes", c.mapped_bytes},
                                   {"unmapped", c.unmapped},
                                   {"high_water_bytes", c.high_water_bytes}};
  }
  if (no_estimate_reason(run).empty()) memory["estimate"] = estimate_to_json(m.estimate);
  return memory;
}

// The engine's state, the ZeRO switches and the device.
void add_engine_json(nlohmann::json& summary, const TrainingRun& run, const MemoryFigures& m) {
  const TrainConfig& config = run.config;
  const Engine& engine = *run.engine;
  // What this configuration should hold per rank by the formula, without padding
  // (docs/design.md "Memory per parameter").
  const ModelStateBytes formula = model_state_formula(engine.trainable_parameters(), run.data_world, config);
  summary["trainable_parameters"] = engine.trainable_parameters();
  summary["model_state_formula_bytes"] = {{"parameters", formula.parameters},
                                          {"gradients", formula.gradients},
                                          {"optimizer_states", formula.optimizer_states},
                                          {"total", formula.total()}};
  summary["zero"] = {{"stage", config.zero.stage},
                     {"shard_optimizer_states", config.zero.shard_optimizer_states},
                     {"shard_gradients", config.zero.shard_gradients},
                     {"shard_parameters", config.zero.shard_parameters},
                     {"hpz_partition_size", std::max(1, config.zero.hpz_partition_size)},
                     {"block_gathers_rank0", engine.diagnostics().block_gathers},
                     {"secondary_block_gathers_rank0", engine.diagnostics().secondary_block_gathers}};
  // Rank 0's node groups: its node's ranks, and the nodes (one rank 0 of a node each).
  summary["nodes"] = {{"count", engine.node_groups().across_nodes->world_size()},
                      {"ranks_per_node", engine.node_groups().within_node->world_size()}};
  summary["precision"] = to_string(config.precision);
  summary["precision_configured"] = to_string(run.configured_precision);
  summary["memory"] = memory_json(run, m);
  summary["model"] = {{"type", config.model.type}, {"preset", config.model.preset}};
  if (run.device.cuda())
    summary["device"] = {{"type", "cuda"},
                         {"name", run.device.name},
                         {"index", run.device.device.index()},
                         {"total_memory_bytes", run.device.total_memory},
                         {"peak_allocated_bytes", m.gpu_peak.allocated},
                         {"peak_reserved_bytes", m.gpu_peak.reserved}};
  else
    summary["device"] = {{"type", "cpu"}};
  summary["loss_scale"] = engine.loss_scale();
}

nlohmann::json comms_json(const CommsLogger& logger) {
  // Rank 0's collectives up to here (the final barrier comes after).
  nlohmann::json rows = nlohmann::json::array();
  for (const auto& row : logger.rows())
    rows.push_back({{"op", row.op},
                    {"caller", row.caller},
                    {"message_bytes", row.message_bytes},
                    {"count", row.count},
                    {"total_latency_ms", row.total_ms},
                    {"avg_latency_ms", row.avg_ms},
                    {"algbw_gbps", row.algbw_gbps},
                    {"busbw_gbps", row.busbw_gbps}});
  return rows;
}

// Rank 0's --summary file, written whole or not at all.
void write_summary(const TrainingRun& run, const TrainRunOptions& options, const StepLog& log, const MemoryFigures& m) {
  const TrainConfig& config = run.config;
  const int64_t steps = config.train.steps;
  const double tokens_per_step = double(config.train_batch_size) * double(run.seq_len);
  nlohmann::json summary;
  summary["offload"] = offload_json(run.engine->offload_report());
  summary["activation_checkpointing"] = activation_checkpointing_json(run);
  summary["world_size"] = run.world;
  summary["tensor_parallel"] = run.grid.tensor_size;
  summary["data_parallel_size"] = run.data_world;
  if (!run.init_from_summary.is_null()) summary["init_from"] = run.init_from_summary;
  summary["steps"] = steps;
  summary["first_step"] = run.first_step;  // losses[i] is the loss of step first_step + i + 1
  summary["losses"] = log.losses;
  summary["final_loss"] = log.losses.empty() ? 0.0 : log.losses.back();
  summary["skipped_steps"] = run.engine->skipped_steps();
  summary["tokens_per_second"] =
      log.total_seconds > 0 ? tokens_per_step * double(steps - run.first_step) / log.total_seconds : 0.0;
  summary["seconds"] = log.total_seconds;
  summary["parameters"] = run.n_params;
  summary["intra_op_threads"] = run.runtime.intra_op_threads;
  nlohmann::json evals = nlohmann::json::array();
  for (auto& [s, l] : log.eval_losses) evals.push_back({{"step", s}, {"loss", l}});
  summary["eval_losses"] = evals;
  summary["ranks"] = ranks_json(m.stats);
  add_engine_json(summary, run, m);
  if (!log.flops_summary.is_null()) summary["flops_profiler"] = log.flops_summary;
  if (run.comms_logger) summary["comms_logger"] = comms_json(*run.comms_logger);
  summary["skipped"] = log.skipped;
  auto path = std::filesystem::path(options.summary_path);
  if (path.has_parent_path()) std::filesystem::create_directories(path.parent_path());
  auto tmp = path;
  tmp += ".tmp";
  {
    std::ofstream out(tmp);
    if (!out) throw DataError(fmt::format("--summary: cannot write '{}'", options.summary_path));
    out << summary.dump(2) << "\n";
  }
  std::filesystem::rename(tmp, path);  // never leave a half-written summary behind
}

// Each rank's collectives beside the run's log; rank 0's as DeepSpeed's log_summary table.
void write_comms_log(const TrainingRun& run) {
  const auto dir = std::filesystem::path(run.config.train.log_dir);
  std::filesystem::create_directories(dir);
  const auto path = dir / fmt::format("comms_rank{}.csv", run.rank);
  std::ofstream out(path, std::ios::trunc);
  if (!out) throw DataError(fmt::format("comms_logger: cannot write '{}' (train.log_dir)", path.string()));
  out << run.comms_logger->csv();
  if (run.leader)
    fmt::print("communication (rank 0, {} collectives; every rank's in {}/comms_rank<r>.csv):\n{}",
               run.comms_logger->total_count(), dir.string(), run.comms_logger->table());
}

}  // namespace

void report_run(TrainingRun& run, const TrainRunOptions& options, const StepLog& log) {
  const MemoryFigures memory = measure_memory(run, log);
  if (run.leader) {
    print_memory_line(run, memory);
    print_cache_and_offload(run, log.total_seconds);
  }
  if (run.rank == 0 && !options.summary_path.empty()) write_summary(run, options, log, memory);
  run.comm->barrier("train.end");
  if (run.comms_logger) write_comms_log(run);
}

}  // namespace zt::training
