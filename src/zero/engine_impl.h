// Engine::Impl: the engine's state and its work, which several files implement
// (docs/architecture.md "zero"):
//
//   engine.cpp             the autograd glue and the order of one training step (backward, step,
//                          the delayed update's installation); Engine's members
//   engine_setup.cpp       construction: the trainable parameters, stage 3's blocks, the parts and
//                          rank 0's initial values
//   engine_offload.cpp     the NVMe tiers: the offload plan (layout/offload_plan.h) computed once,
//                          the pre-flight disk checks, the I/O engine and the swap directories
//   engine_publish.cpp     the updated parameters reach every rank (stages 1-2: the all-gather)
//   engine_checkpoint.cpp  checkpoints, load_weights and the masters by name
//
// The engine's parts:
//
//   GradientReducer     gradients, buckets, reductions              zero/gradient_reducer.h
//   ParameterGatherer   stage-3 blocks, gathers, prefetch           zero/parameter_gatherer.h
//   ParameterTier       stage-3 working partition (memory or NVMe)  zero/parameter_tier.h
//   OptimizerPartition  masters, moments, the fused step            zero/optimizer_partition.h
//                       over TieredArrays (memory or NVMe)          zero/partition_store.h
//
// What a stage means is decided once, in the constructor, from the configuration's switches
// (shard optimizer states, shard gradients, shard parameters); nothing below asks for a stage
// number. Without optimizer-state sharding the layout is computed for a world of one, so "this
// rank's partition" is the whole buffer and the same code serves stage 0.
#pragma once
#include <ATen/core/ivalue.h>
#include <torch/csrc/autograd/function.h>
#include <torch/nn/module.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "common/autograd_node.h"
#include "io/aio.h"
#include "io/swap_directory.h"
#include "layout/offload_plan.h"
#include "zero/device_plan.h"
#include "zero/gradient_reducer.h"
#include "zero/loss_scaler.h"
#include "zero/optimizer_partition.h"
#include "zero/parameter_gatherer.h"
#include "zero/parameter_tier.h"
#include "zero/partition_store.h"
#include "zero/sharded_blocks.h"
#include "zerotrain/comm/comm.h"
#include "zerotrain/config/config.h"
#include "zerotrain/zero/engine.h"
#include "zerotrain/layout/layout.h"
#include "zerotrain/optim/lr_schedule.h"

namespace zt {

struct EngineStepState;  // zero/step_monitor.h

struct Engine::Impl {
  // What the engine leaves in gradient hooks, which may outlive it: the engine clears `impl` in its
  // destructor, so that a hook that runs afterwards does nothing instead of using freed memory.
  struct Liveness : torch::CustomClassHolder {
    std::atomic<Impl*> impl{nullptr};
  };

  c10::intrusive_ptr<Liveness> liveness = c10::make_intrusive<Liveness>();
  std::shared_ptr<torch::nn::Module> model;
  TrainConfig config;
  std::shared_ptr<Communicator> comm;
  NodeGroups node_groups;  // within and across nodes (zerotrain/comm/comm.h)
  LrSchedule schedule;
  LossScaler scaler;

  // Composition, fixed at construction.
  DevicePlan devices;  // where each role lives (zero/device_plan.h)
  bool shard_parameters = false;
  torch::ScalarType working_dtype = torch::kFloat32;
  bool separate_master = false;  // 16-bit working parameters
  int world = 1, rank = 0;
  int shard_world = 1, shard_rank = 0;

  FlatLayout layout;
  std::vector<ParameterSpec> specs;             // what the layout was computed from (names, shapes)
  std::vector<CheckpointParameter> registered;  // trainable parameters in registration order
  std::vector<AutogradNodeHandle> grad_accumulators;  // keep hooks alive
  // Tensor parallelism (zerotrain/zero/blocks.h TensorSplit): the group the model's split parameters
  // name (null: none), and per placement (flat order) whether it is such a slice. The gradient
  // norm sums the slices' squares over the group and counts the replicated ones once.
  std::shared_ptr<Communicator> tensor_group;
  std::vector<char> tensor_split;
  // What checkpoints name: `registered` with a split parameter's whole shape and its slice.
  std::vector<CheckpointParameter> checkpointed;
  // The ranks a checkpoint is saved and loaded by: the data-parallel group, and the tensor group.
  CheckpointGroup checkpoint_group() const;

  // Offload tiers (docs/offload.md): the I/O engine and swap directories exist only with NVMe.
  std::unique_ptr<io::AioEngine> io;
  std::vector<std::unique_ptr<io::SwapDirectory>> swap_directories;
  // The offload plan (layout/offload_plan.h), computed before anything is allocated: the
  // partition's sub-groups (empty without NVMe), which of each role are on disk, the swap files'
  // bytes (held against the disk before they exist, a load's staging checked against them) and
  // the host buffers the tiers stream through.
  OffloadPlan offload;

  torch::Tensor flat_params;   // parameters not sharded: the whole flat buffer, working dtype
  TieredArray param_partition; // sharded: this rank's partition, working dtype
  std::unique_ptr<ParameterTier> parameter_tier;
  std::unique_ptr<OptimizerPartition> optimizer;
  std::unique_ptr<GradientReducer> reducer;
  std::unique_ptr<ParameterGatherer> gatherer;
  std::vector<ParameterGatherer::Block> planned_blocks;  // stage 3, until the gatherer exists

  // Declared after every member that owns an I/O buffer, so destroyed before them (also when
  // construction throws): after an IoError the failed step's other transfers are still in flight
  // into those buffers, and the buffers must outlive them. A delayed step still running issues
  // transfers of its own, so it is waited for before the drain.
  struct DrainIoFirst {
    std::unique_ptr<io::AioEngine>* io;
    std::unique_ptr<OptimizerPartition>* optimizer;
    ~DrainIoFirst() {
      if (*optimizer) (*optimizer)->join_worker();
      if (*io) (*io)->drain();
    }
  } drain_io_first{&io, &optimizer};

  int64_t micro_step = 0;   // micro-steps done in the current accumulation window
  bool window_ends_early = false;  // set_gradient_accumulation_boundary(true) for the next backward
  int64_t global_step = 0;  // optimizer steps taken
  int64_t skipped = 0;
  // Applied optimizer steps before the moments last started from zero (a load with
  // reset_optimizer): the optimizer's own step count, for bias correction, is counted from there.
  int64_t moments_from = 0;
  bool in_backward = false;

  std::vector<ParameterGroup> parameter_groups;
  // set_learning_rates: every group's rate, in place of the schedule's (unset: the schedule).
  std::optional<std::vector<double>> client_rates;

  bool noted_integer_buffers = false;  // frozen_values() has said that such buffers are left out

  Impl(std::shared_ptr<torch::nn::Module> m, const TrainConfig& c, std::shared_ptr<Communicator> cm,
       std::vector<ParameterGroup> g);
  ~Impl();

  // What the step monitor reads of the engine between steps.
  EngineStepState step_state() const;

  // Blocks built under a ShardedConstruction (zerotrain/zero/blocks.h) hold only this rank's shard
  // until materialize() gathers them.
  struct PendingBlock {
    std::string name;
    ShardedBlock shards;
    bool materialized = false;
  };

  // Where the tiers of `offload` put their swap files (null: no NVMe role of that kind).
  struct SwapDirectories {
    io::SwapDirectory* optimizer = nullptr;
    io::SwapDirectory* parameters = nullptr;
  };

  // ---------------------------------------------------------------- construction (engine_setup.cpp)

  void build();
  void cast_buffers();  // the model's floating-point buffers by the configuration's rule (config.h)
  std::vector<torch::Tensor> collect_trainable(std::vector<PendingBlock>& pending);
  void create_arenas(const SwapDirectories& directories);
  void adopt_initial_values(std::vector<torch::Tensor>& trainable, std::vector<PendingBlock>& pending);
  template <class BeforeCopy>
  void adopt_replicated_initial_values(std::vector<torch::Tensor>& trainable, const torch::TensorOptions& fp32,
                                       int64_t chunk_limit, BeforeCopy&& before_copy);
  void create_reducer(const SwapDirectories& directories);
  void assign_parameter_groups(OptimizerPartition::Options& options);
  std::unordered_map<std::string, TensorSplit> find_tensor_group(const std::vector<torch::Tensor>& trainable,
                                                                 const std::vector<ParameterSpec>& specs);
  void check_tensor_group();
  static std::vector<CheckpointParameter> checkpoint_parameters(
      const std::vector<CheckpointParameter>& parameters, const std::unordered_map<std::string, TensorSplit>& splits);
  void find_marked_modules(std::unordered_map<const void*, int>& owner_of,
                           std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>>& modules);
  void assign_blocks(std::vector<torch::Tensor>& trainable, std::vector<ParameterSpec>& specs,
                     const std::vector<int>& owners,
                     const std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>>& modules);
  std::vector<PendingBlock> adopt_sharded_blocks();
  void materialize(PendingBlock& pending, const std::unordered_set<const void*>& moved);
  std::shared_ptr<Communicator> secondary_group();

  // ---------------------------------------------------------------- offload (engine_offload.cpp)

  SwapDirectories plan_offload();
  void choose_tiers();
  SwapDirectories open_tiers();
  void preflight_load_staging(bool with_moments);
  OffloadReport offload_report() const;

  // ---------------------------------------------------------------- the step (engine.cpp)

  void install_hooks(std::vector<torch::Tensor>& trainable);
  bool boundary_next() const;
  void reopen_window();
  void backward(const torch::Tensor& loss, LossDivision division);
  void after_gradient(int i);
  StepResult step();
  void apply_pending_update();
  ModelStateBytes model_state_bytes() const;
  int64_t buffer_bytes() const;
  static std::string fmt_double(double v);

  // ---------------------------------------------------------------- publication (engine_publish.cpp)

  void gather_parameters();
  void publish_parameters();
  // Before the partition changes (a step, a delayed update installed, a checkpoint or weights
  // loaded): every block gathered or read ahead is released first, so that nothing prepared for a
  // forward that did not come (a no-grad or interrupted forward's prefetch) still holds a slot or
  // a read buffer, and what was read ahead is forgotten. Stage 3 only; a no-op otherwise.
  void release_read_ahead();

  // ---------------------------------------------------------------- checkpoints (engine_checkpoint.cpp)

  // A checkpoint's counters and what changed, read and checked before anything of it is loaded.
  struct SavedState {
    LossScaler::State scaler;
    int64_t step = 0, skipped_steps = 0, moments_from = 0;
    std::vector<std::string> changes;  // the tracked hyper-parameters that differ, "key: old -> new"
  };

  std::vector<StateFragment> owned_state(bool saving, bool with_moments);
  void save_checkpoint(const std::string& dir, const std::string& tag,
                       const std::map<std::string, std::string>& client_state, int keep_last);
  std::vector<std::pair<std::string, torch::Tensor>> frozen_values();
  std::vector<std::pair<torch::Tensor, torch::Tensor>> stage_frozen(std::vector<CheckpointParameter>* list);
  void load_weights(WeightReader& reader);
  const CheckpointParameter& trainable_named(const std::string& name, const char* what) const;
  torch::Tensor master_parameter(const std::string& name);
  void set_master_parameters(const std::map<std::string, torch::Tensor>& values);
  SavedState read_saved_state(const LoadedCheckpoint& saved, const LoadOptions& options) const;
  std::map<std::string, std::string> load_checkpoint(const std::string& dir, const std::string& tag,
                                                     const LoadOptions& options);
};

}  // namespace zt
