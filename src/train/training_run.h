// The command line's training run (zerotrain/train/train.h run_training_rank) in its phases
// (docs/architecture.md "train"): set-up builds a TrainingRun (communicator, device, data, model,
// engine, initial weights), the step loop trains it and keeps a StepLog, and the report prints and
// writes what both measured. Internal to src/train; one rank's objects, used from one thread.
#pragma once
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "train/runtime.h"
#include "zerotrain/comm/comm.h"
#include "zerotrain/config/config.h"
#include "zerotrain/data/data.h"
#include "zerotrain/zero/engine.h"
#include "zerotrain/memory/memory.h"
#include "zerotrain/models/model_kind.h"
#include "zerotrain/data/tokenized_data.h"
#include "zerotrain/train/train.h"

namespace zt {

class CommsLogger;

namespace training {

// The device this rank trains on (TrainRunOptions::device) and what the run reports of it.
struct RankDevice {
  torch::Device device{torch::kCPU};
  std::string name;          // the GPU's name; "" on the CPU
  int64_t total_memory = 0;  // the GPU's memory in bytes; 0 on the CPU
  int visible = 0;           // GPUs this process sees
  bool cuda() const { return device.is_cuda(); }
};

// "cpu", or "cuda": cuda:(local_rank % visible GPUs), made this thread's current device so that
// NCCL and the caching allocator use it.
RankDevice select_device(const std::string& requested, int local_rank);
// Waits for the work queued on this rank's GPU (nothing on the CPU, whose kernels are synchronous):
// timers read after it measure the work, not its launch.
void synchronize(const RankDevice& d);

// Peak bytes of the CUDA caching allocator on this rank's GPU: handed to tensors, and reserved
// from the driver (what nvidia-smi shows, less the context). Zero on the CPU.
struct DevicePeak {
  int64_t allocated = 0, reserved = 0;
};
DevicePeak device_peak(const RankDevice& d);

int64_t physical_memory_bytes();

// The peak RSS of set-up (the model's construction, loading weights or a checkpoint) and, once
// the kernel's peak was restarted after it, of the steps alone.
struct PeakRss {
  int64_t setup = -1;  // -1 while set-up runs
  bool split = false;  // the kernel's peak was restarted after set-up
  // The steps' peak; -1 before, or where the kernel does not allow the restart.
  int64_t steps() const { return setup >= 0 && split ? int64_t(peak_rss_bytes()) : -1; }
  int64_t run() const { return std::max<int64_t>(setup, peak_rss_bytes()); }
};

// Per-rank figures gathered onto every rank: peak RSS and model-state bytes by role.
struct RankStats {
  int64_t peak_rss = 0;  // the run's
  int64_t baseline_rss = 0;
  ModelStateBytes state;
  int64_t buffers = 0;
  int64_t setup_peak_rss = -1, steps_peak_rss = -1;  // PeakRss
};
// A collective: every rank's figures, in rank order.
std::vector<RankStats> gather_rank_stats(Communicator& comm, const Engine& engine, int64_t baseline_rss,
                                         const PeakRss& peak);
// Mean (largest) of `value` over all ranks: collectives.
double mean_over_ranks(Communicator& comm, double value, const char* label);
int64_t max_over_ranks(Communicator& comm, int64_t value, const char* label);

at::ScalarType working_dtype_of(Precision precision);
std::string human_duration(double seconds);
std::string human_rate(double per_second);

// The token streams, or with data.source "finetune" the examples (then train and val are empty).
struct Splits {
  TokenDataset train, val;
  std::shared_ptr<const FinetuneExamples> finetune_train, finetune_val;
  int64_t bytes = 0;  // what the data holds in this rank from set-up on (training_data_bytes)
  bool finetune() const { return finetune_train != nullptr; }
};

// What set-up made, read by the phases after it. Not movable once made: the step loop's samplers
// refer to its data.
struct TrainingRun {
  TrainConfig config;               // as trained (the precision and recomputation policy resolved)
  Precision configured_precision = Precision::FP32;
  RendezvousInfo rendezvous;
  RuntimeSettings runtime;
  std::shared_ptr<CommsLogger> comms_logger;  // comms_logger.enabled only
  std::shared_ptr<Communicator> comm;
  // Tensor parallelism (config.tensor_parallel): the tensor group and the data-parallel group the
  // engine trains over (zerotrain/comm/comm.h make_process_grid); data_rank and data_world place this
  // rank's batch (equal to rank and world without tensor parallelism).
  ProcessGrid grid;
  RankDevice device;
  int rank = 0, world = 1;
  int data_rank = 0, data_world = 1;
  bool leader = false;  // rank 0 and not quiet: prints the progress

  // The model model.type names, behind one interface (zerotrain/models/model_kind.h): its shape
  // and figures from set-up on, and the built model from build_model on.
  std::unique_ptr<ModelKind> kind;
  std::unique_ptr<TrainableModel> trainable;
  int64_t seq_len = 0, n_layer = 0, n_params = 0;
  Splits data;

  int64_t baseline_rss = 0;  // before the model exists: the memory estimate is compared above it
  std::shared_ptr<torch::nn::Module> module;
  std::unique_ptr<Engine> engine;
  int64_t first_step = 0;            // the step a resumed run continues from
  nlohmann::json init_from_summary;  // model.init_from's bytes read, for the summary

  TrainingRun() = default;
  TrainingRun(const TrainingRun&) = delete;
  TrainingRun& operator=(const TrainingRun&) = delete;

  bool is_checkpointed(int64_t block) const { return trainable->is_checkpointed(block); }
};

// What the step loop measured.
struct StepLog {
  std::vector<double> losses;  // losses[i]: the mean over ranks of step first_step + i + 1
  std::vector<int> skipped;    // 1 where the step was skipped (inf/NaN gradient)
  std::vector<std::pair<int64_t, double>> eval_losses;
  nlohmann::json flops_summary;  // null unless the flops profiler ran
  PeakRss peak;
  double total_seconds = 0;
};

// The phases, in order (run_setup.cpp, run_steps.cpp, run_report.cpp).
std::unique_ptr<TrainingRun> set_up_run(const TrainConfig& config, const TrainRunOptions& options);
StepLog run_steps(TrainingRun& run, const TrainRunOptions& options);
void report_run(TrainingRun& run, const TrainRunOptions& options, const StepLog& log);

// data.sequence_length (0: the model's context) against the model's context; the length used.
int64_t check_sequence_length(int64_t configured, int64_t context);
// The configured data, validated against the model's vocabulary (not when vocab_size <= 0).
// `progress`: print progress lines while tokenizing a large corpus (the launcher's check, which
// builds the token caches).
Splits load_data(const TrainConfig& config, int64_t vocab_size, bool progress = false);
// The size of the file at `path`, 0 when it has none.
int64_t file_bytes(const std::string& path);

}  // namespace training
}  // namespace zt
