// The training engine: what a user adds to an existing LibTorch loop.
//
//   auto comm   = zt::make_communicator(zt::rendezvous_from_environment(), {});
//   auto config = zt::load_config("config.json", {}, comm->world_size());
//   zt::Engine engine(model.ptr(), config, comm);          // replaces the torch::optim optimizer
//   for (...) {
//     auto loss = model->forward(...);
//     engine.backward(loss);                               // replaces loss.backward()
//     engine.step();                                       // replaces optimizer.step()/zero_grad()
//   }
//
// Contract
// - The engine owns the trainable parameters' storage from construction on: every trainable
//   parameter's data and gradient become views into flat arenas (one allocation per role,
//   docs/architecture.md "memory"); the user keeps using the model as before. Frozen
//   parameters (requires_grad false) get neither gradient nor optimizer memory.
// - At construction rank 0's parameter values are broadcast so every rank starts equal. A model
//   built under zt::ShardedConstruction (zerotrain/zero/blocks.h) is adopted at any stage: each block
//   is gathered whole once, just before the engine moves it into its arenas.
// - backward(loss) divides the loss by gradient_accumulation_steps before differentiating (as
//   DeepSpeed does, loss / steps), so the gradient of an optimizer step is the mean over all
//   micro-batches of all ranks; this is the engine's one scaling of the loss (besides fp16's loss
//   scale) and it is stated here so it is never a surprise. LossDivision::AlreadyDivided takes a
//   loss the caller has divided.
// - step() is a no-op (returns stepped=false) except on the last micro-step of an accumulation
//   window, where it completes the gradient reduction, clips by the global norm, applies the
//   optimizer with the learning rate of the schedule, and zeroes the gradients. With
//   offload_optimizer.delayed_update, after the first delayed_update_after steps the update is
//   computed on a worker thread while the next window's forward and backward run on the weights
//   of the step before (one step stale), and installed by the next step() (docs/offload.md).
// - Precision (config "bf16"/"fp16"): the engine converts the model's trainable parameters to a
//   16-bit working copy (frozen parameters and floating buffers follow, so the model sees one
//   dtype) and keeps fp32 master weights for the optimizer. With fp16 the loss is also multiplied
//   by the loss scale (LossScaler, DeepSpeed semantics) and a step with an inf/NaN gradient on
//   any rank is skipped on every rank.
// - Sharding (config zero_optimization.stage, read as switches): optimizer states and master
//   weights exist only for this rank's partition of the layout (stage 1); gradients too, kept as
//   the owned partition only and reduced bucket by bucket during every backward (stage 2). In
//   that case a parameter's .grad is a view into a bucket buffer and is not meaningful after
//   backward() returns. docs/zero.md has the data flow.
// - Every rank must use the same parameters in the same order in every backward (as with
//   plain data parallel); the reductions launched from gradient hooks rely on it.
// - Lifetime: a graph built through the model may outlive the engine. A backward through it
//   after the engine is destroyed throws zt::Error at stage 3 (the blocks' parameters went with
//   the engine; run_block on them throws too) and is plain autograd at stages 0-2. Several
//   engines may be alive in one process, one per model.
// - Gradient reduction at stages 0 and 1 (on the boundary micro-step) is launched from the
//   gradient hooks while backward runs with zero_optimization.overlap_comm, else after it.
// - Not thread-safe: drive one engine from one thread. Every rank must call backward()/step()
//   the same number of times in the same order (they run collectives).
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "zerotrain/memory/memory.h"
#include "zerotrain/zero/reporting.h"
#include "zerotrain/checkpoint/weight_reader.h"

namespace at {
class Tensor;
}
namespace torch::nn {
class Module;
}

namespace zt {

class Communicator;
class CommsLogger;
class StepMonitor;
struct NodeGroups;
struct TrainConfig;
struct FlatLayout;

// How load_checkpoint treats the optimizer state (docs/checkpoint.md "Changing the optimizer").
struct LoadOptions {
  // false: the checkpoint must have been saved with this engine's optimizer type (Adam and AdamW
  // are one type: the same moments); another type is refused with zt::DataError naming both.
  // true: only the weights are loaded (the fp32 masters, and the working parameters from them);
  // the optimizer moments start from zero and the optimizer's own step count (Adam's and LAMB's
  // bias correction) from 0, while the global step (and with it the learning-rate schedule),
  // the skipped-step count, the loss scaler and the client state are restored.
  bool reset_optimizer = false;
  // Called on rank 0 with one line per optimizer, scheduler or clipping setting that differs from
  // the checkpoint's ("optimizer.params.lr: 0.003 -> 0.001"): such changes are allowed. Unset:
  // the lines go to stdout.
  std::function<void(const std::string&)> log;
};

struct StepResult {
  bool boundary = false;     // this call ended an accumulation window
  bool stepped = false;      // the optimizer was applied
  bool skipped = false;      // a non-finite gradient made every rank skip this step
  bool delayed = false;      // the update runs during the next micro-steps (delayed parameter update)
  double grad_norm = 0.0;    // global gradient norm before clipping (boundary only)
  double lr = 0.0;           // learning rate used (boundary only)
  double loss_scale = 1.0;   // loss scale the gradients of this step carried (fp16; else 1)
};

// ZeRO-Offload / ZeRO-Infinity tiers of this rank (docs/offload.md): where the state lives and the
// I/O of the NVMe tier so far.
struct OffloadReport {
  int64_t nvme_optimizer_bytes = 0;   // masters and moments in swap files
  int64_t nvme_parameter_bytes = 0;   // stage-3 parameter shards in swap files
  int64_t nvme_gradient_bytes = 0;    // the gradient partition in swap files (nvme_gradients)
  // What the pre-flight check held against the disk's free space before the tiers were created
  // (equal to the three above), and what a checkpoint load writes beside them until it commits.
  int64_t nvme_planned_bytes = 0;
  int64_t nvme_load_staging_bytes = 0;
  int64_t host_buffer_bytes = 0;      // the aligned buffers the NVMe tiers stream through
  int64_t bytes_read = 0, bytes_written = 0;
  int64_t requests = 0;               // block requests issued to the disk
  double read_seconds = 0, write_seconds = 0;  // wall time with reads (writes) in flight
  double stall_seconds = 0;           // time the training thread waited for the disk
  std::string backend;                // "io_uring", "pread/pwrite", or "" without an NVMe tier
};

// Trainable parameters with optimizer hyperparameters of their own, as DeepSpeed and torch.optim
// take parameter groups (e.g. no weight decay on biases and norms). Parameters no group names use
// the configuration's values.
struct ParameterGroup {
  std::vector<std::string> parameters;  // names as the model's named_parameters() gives them
  // Unset: the configuration's optimizer.params.lr. With a "scheduler" the schedule sets every
  // group's learning rate, as in DeepSpeed (a note says so once when a group sets its own).
  std::optional<double> lr;
  std::optional<double> weight_decay;  // unset: optimizer.params.weight_decay
};

// How backward() scales the loss before differentiating: divided by gradient_accumulation_steps
// (the default, DeepSpeed's), or as given, for a caller that divides it itself (DeepSpeed's
// backward(scale_wrt_gas=False), which the Hugging Face Trainer passes).
enum class LossDivision { ByAccumulationSteps, AlreadyDivided };

// Counters of the engine's stage-3 gathers since construction (all 0 below stage 3).
struct EngineDiagnostics {
  // The most bytes of full (gathered) block parameters held at once; parameters outside every
  // block (kept whole) are not counted.
  int64_t peak_gathered_parameter_bytes = 0;
  // Block gathers launched ahead of the block's use (prefetch).
  int64_t prefetched_blocks = 0;
  // Block gathers launched, prefetched or not (a block kept gathered for its next use,
  // zero_optimization.stage3_max_reuse_distance, is not gathered again).
  int64_t block_gathers = 0;
  // With a secondary partition (zero_hpz_partition_size): of block_gathers, those served within
  // the secondary group from its shards (docs/zero.md "hpZ").
  int64_t secondary_block_gathers = 0;
};

class Engine {
 public:
  Engine(std::shared_ptr<torch::nn::Module> model, const TrainConfig& config,
         std::shared_ptr<Communicator> comm);
  // With parameter groups; a name that is not a trainable parameter, or one in two groups, throws
  // zt::ConfigError.
  Engine(std::shared_ptr<torch::nn::Module> model, const TrainConfig& config, std::shared_ptr<Communicator> comm,
         std::vector<ParameterGroup> groups);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  void backward(const at::Tensor& loss, LossDivision division = LossDivision::ByAccumulationSteps);
  StepResult step();
  // With the delayed parameter update (offload_optimizer.delayed_update): completes the optimizer
  // step still running and publishes its parameters, so that the model holds every update taken
  // so far (step(), save_checkpoint() and load_checkpoint() do this themselves; call it before
  // using the weights outside training, e.g. an export at the end). A no-op otherwise. A
  // collective: every rank calls it at the same point.
  void apply_pending_update();

  // True when the next backward() is the last micro-step of its accumulation window.
  bool next_backward_is_boundary() const;
  // DeepSpeed's set_gradient_accumulation_boundary, for the next backward() only: true ends the
  // window there, before gradient_accumulation_steps backward() calls (Accelerate does at the end
  // of an epoch whose length the count does not divide): that backward reduces the window's
  // gradients, each loss divided by gradient_accumulation_steps as always (as in DeepSpeed), and
  // the next step() applies them. false where the window ends anyway throws zt::Error: a window
  // never grows past the count.
  void set_gradient_accumulation_boundary(bool is_boundary);
  int64_t global_step() const;     // optimizer steps taken (skipped ones included)
  int64_t skipped_steps() const;
  // For the next optimizer step: the schedule at global_step() - skipped_steps(), since (as in
  // DeepSpeed) a step skipped for an fp16 overflow does not advance the schedule; after
  // set_learning_rates, the rate it gave the parameters no group names.
  double learning_rate() const;
  // The learning rate of every optimizer parameter group for the optimizer steps from now on, in
  // place of the configuration's schedule and the groups' own lr, as a client learning-rate
  // scheduler (torch.optim.lr_scheduler) drives DeepSpeed's optimizer: rates[0] for the
  // parameters no ParameterGroup names, rates[i] for group i - 1. Takes effect at the next
  // optimizer step (a delayed update in flight keeps the rate it was launched with); the rates
  // are not saved in checkpoints (the client's scheduler keeps them). Throws zt::ConfigError for
  // another count than the groups + 1, or a rate that is negative or not finite.
  void set_learning_rates(const std::vector<double>& rates);
  double loss_scale() const;       // for the next backward (1 unless fp16)
  // Long-lived model state this rank allocated, by role (compare with model_state_formula).
  ModelStateBytes model_state_bytes() const;
  // Transient buffers the engine keeps besides model state: gradient bucket buffers (sharded
  // gradients) and the fp32 conversion chunk (16-bit training).
  int64_t buffer_bytes() const;
  int64_t trainable_parameters() const;  // Ψ: elements of all parameters with requires_grad
  const FlatLayout& layout() const;
  // What the engine counted of its own stage-3 gathers, for tests, benchmarks and the run's
  // summary; nothing in training reads it.
  EngineDiagnostics diagnostics() const;
  OffloadReport offload_report() const;
  // Checkpoints (docs/checkpoint.md): collectives, called between optimizer steps (not inside an
  // accumulation window). save_checkpoint writes dir/tag — this rank's master weights and
  // optimizer moments by parameter name and element range, the step counters, the loss scaler and
  // `client_state` (saved and returned as is) — atomically, then points dir/latest at it, keeping
  // the newest `keep_last` (0: all). load_checkpoint reads dir/tag (empty: dir/latest), saved at
  // any world size and stage, and returns the client state; throws zt::DataError for a missing,
  // damaged or foreign checkpoint without changing this engine.
  void save_checkpoint(const std::string& dir, const std::string& tag,
                       const std::map<std::string, std::string>& client_state = {}, int keep_last = 0);
  // Checkpoints also hold the model's frozen parameters and floating-point buffers, whole (rank
  // 0 saves them; every rank loads them), so that values not made by the model's constructor
  // survive; a checkpoint saved before they were included leaves them as constructed. Buffers of
  // other dtypes are not saved (a note says so once).
  std::map<std::string, std::string> load_checkpoint(const std::string& dir, const std::string& tag = "");
  std::map<std::string, std::string> load_checkpoint(const std::string& dir, const std::string& tag,
                                                     const LoadOptions& options);
  // Replaces the model's values from `reader` (docs/checkpoint.md "model.init_from"): each rank
  // reads only the elements of the trainable parameters it keeps masters of (its partition with
  // sharded optimizer states, everything otherwise), and every frozen parameter and floating-point
  // buffer whole; the working parameters follow as after an optimizer step. Optimizer moments and
  // counters are untouched: meant before training starts. A collective between optimizer steps;
  // when reading fails on any rank it throws on every rank and the engine's state is unchanged.
  void load_weights(WeightReader& reader);
  // One trainable parameter's fp32 master values, whole, by its name in the model (what DeepSpeed's
  // safe_get_full_fp32_param returns): gathered from the ranks that keep them. set_master_parameter
  // replaces them (and the working copy follows, as after an optimizer step); the optimizer moments
  // are untouched. Both are collectives between optimizer steps, called by every rank with the
  // same name (set: the same value); an unknown name or a value of another size throws
  // zt::ConfigError. set reads and rewrites this rank's whole state once: meant for tests and
  // set-up, not for every step.
  at::Tensor master_parameter(const std::string& name);
  void set_master_parameter(const std::string& name, const at::Tensor& value);
  // Several at once, with one pass over the state.
  void set_master_parameters(const std::map<std::string, at::Tensor>& values);
  // Stage 3: the blocks `modules` (marked blocks of the model, zerotrain/zero/blocks.h) gathered now and
  // kept whole until release_held_blocks(), to read or change parameters between steps (a change
  // lasts only through set_master_parameters). Collectives between optimizer steps; a module that
  // is not a block of this engine throws zt::Error. No-ops below stage 3.
  void hold_blocks(const std::vector<const torch::nn::Module*>& modules);
  void release_held_blocks();
  Communicator& communicator() const;
  // The job's node groups, made at construction (zerotrain/comm/comm.h make_node_groups): one node's
  // ranks, and one rank of each node. For the stages' collectives that follow the nodes.
  const NodeGroups& node_groups() const;
  const TrainConfig& config() const;

  // Reporting (zerotrain/zero/reporting.h, docs/config.md "Reporting"): the engine honours
  // steps_per_print ("[Rank 0] step=N, skipped=S, lr=[...], mom=[...]"), wall_clock_breakdown (the
  // per-phase times with that line), csv_monitor (DeepSpeed's files, one per event, under
  // output_path/job_name; only when the configuration sets csv_monitor.enabled, DeepSpeed's
  // default being off), flops_profiler (LibTorch's profiler over the optimizer step profile_step,
  // printed or written to output_file) and comms_logger (a logger attached to the communicator at
  // construction when it has none; comms_summary()). Rank 0 prints and writes.
  // The forward's bounds, when the caller knows them (the Python engine's engine(...) does);
  // otherwise the forward is timed as the gap before backward() (zerotrain/zero/reporting.h).
  void note_forward_start();
  void note_forward_end();
  // Where the engine's lines go (rank 0): standard output unless set; an empty function silences
  // them. disable_reports(): no lines, no csv_monitor files, no flops profile, for a caller that
  // reports itself (the command line's trainer); wall-clock times and the comms logger still count.
  void set_report_sink(std::function<void(const std::string&)> sink);
  void disable_reports();
  // Per-phase times since the last steps_per_print line (or construction).
  PhaseTimes phase_times() const;
  // The flops profiler's measurement once the profiled step has ended; null before, or when the
  // profiler is off.
  const FlopsReport* flops_report() const;
  // The communicator's logger (comms_logger), null when none; comms_summary() is its table, as
  // DeepSpeed's comm.log_summary() prints it ("" without a logger).
  std::shared_ptr<CommsLogger> comms_logger() const;
  std::string comms_summary() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::unique_ptr<StepMonitor> monitor_;
};

}  // namespace zt
