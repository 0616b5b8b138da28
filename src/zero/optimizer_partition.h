// The optimizer partition: this rank's fp32 master weights and optimizer moments, and the fused
// step over them (docs/design.md "The order of a step", docs/offload.md "The step"). Where
// the state lives (memory or NVMe) is this part's business alone: the rest of the engine sees a
// step and, for checkpoints, fragments by parameter name.
//
// Contract
// - The roles are TieredArrays over the partition (zero/partition_store.h): "master" (16-bit
//   training only; in fp32 the working parameters are the masters), "exp_avg", "exp_avg_sq"
//   (as the optimizer needs them).
// - step() runs the optimizer kernels over the partition sub-group by sub-group, in partition
//   order. Sub-groups in memory are stepped in place; with sub-groups on NVMe they stream through
//   `buffer_count` aligned buffers: the read of the next ones overlaps the step of this one and
//   the write-back of the previous ones (pipeline_read / pipeline_write false: synchronous).
//   The result is the same, bit for bit, wherever the state lives.
// - Delayed parameter update (Options::delayed; docs/offload.md "Delayed parameter update"): the
//   masters are always a role of their own (fp32 too), launch_step() copies the owned gradients
//   into a snapshot and runs the step on a worker thread that writes the updated working values
//   into a second working copy ("params.next", same tiers as the working partition);
//   finish_step() joins it and makes that copy the working one (a swap of arrays when sharded, a
//   copy into the owned region of the flat buffer otherwise). Meanwhile the caller may run
//   forward and backward: the worker touches only the masters, the moments, the snapshot and the
//   next working copy. A synchronous step() in this mode gives the same values as without it.
// - Staged through the host (Options::devices.stage_through_host: offload with parameters on a
//   device, or forced on the CPU): the masters are a role of their own; every step copies the
//   owned gradients into the host snapshot, runs the CPU kernels into the host next working copy
//   and copies that into the device's working parameters (DeviceCopies: a copy stream, events).
//   The values are those of the unstaged step, bit for bit. With stage-3 parameter offload
//   (devices.parameters_on_host) the working partition is on the host already: only the
//   gradients are staged, and the step writes the partition in place (the delayed update: into
//   the next working copy, installed by a swap) as on the CPU.
// - State on a device (Options::devices.device_step()): the roles live there and the step runs
//   the device kernels (optim/device_kernels.h) on the compute stream, reading the gradients in
//   the working dtype directly.
// - Not thread-safe (one caller thread; the worker is this part's own). Collectives: LAMB's
//   per-tensor norms (one all-reduce per step), so a delayed LAMB step needs shard_world 1.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <string>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "optim/cpu_kernels.h"
#include "optim/device_kernels.h"
#include "zero/device_plan.h"
#include "zero/partition_store.h"
#include "zerotrain/config/config.h"
#include "zerotrain/optim/lr_schedule.h"
#include "zerotrain/layout/layout.h"

namespace zt {

class Communicator;
class GradientReducer;
namespace io {
class AioEngine;
class AlignedBuffer;
}

class OptimizerPartition {
 public:
  enum class Kind { Adam, Lamb, Sgd };
  // The working parameters the step writes: the whole flat buffer (parameters not sharded) or
  // this rank's partition of them (sharded; it may be tiered too).
  struct Working {
    at::Tensor flat;
    TieredArray* partition = nullptr;
  };
  // Where the roles live. Default: every element in memory, one sub-group.
  struct Tiers {
    std::vector<SubGroup> groups;   // empty: one sub-group, the whole partition
    std::vector<char> on_disk;      // per sub-group (empty: none)
    io::AioEngine* io = nullptr;
    std::filesystem::path directory;  // swap files: <directory>/<role>.swap
    int buffer_count = 4;
    bool pipeline_read = true, pipeline_write = true;
    // Per sub-group: the gradient partition keeps it on disk (nvme_gradients); the step streams
    // it in with the state (GradientReducer::partition()).
    std::vector<char> gradients_on_disk;
  };
  struct Options {
    OptimizerConfig optimizer;
    at::ScalarType working_dtype = at::kFloat;
    int shard_rank = 0, shard_world = 1;
    Tiers tiers;
    bool delayed = false;  // launch_step()/finish_step() are available
    // Where the state lives and the step runs (zero/device_plan.h): on the host (the CPU kernels),
    // on the device (the device kernels), or on the host staged through copies of the owned
    // gradients and working values.
    DevicePlan devices;
    // Parameter groups (Engine's ParameterGroup): the group of each layout placement (empty: all in
    // group 0) and each group's learning rate and weight decay where it sets them; unset values
    // and group 0 follow `optimizer` (and the schedule's learning rate).
    struct Group {
      std::optional<double> lr, weight_decay;
    };
    std::vector<int> placement_group;
    std::vector<Group> groups;
    // Tensor parallelism: the group over which the parameters marked in `tensor_split` (per
    // placement) are sliced; LAMB's per-tensor norms of those add over it. Null: none.
    Communicator* tensor_group = nullptr;
    std::vector<char> tensor_split;
  };

  OptimizerPartition(const FlatLayout& layout, const Options& options, Communicator& comm, Working working);
  // The learning rate of groups 1.. from now on (rates[i] for group i; rates[0], group 0's, comes
  // with each step). Not while a delayed step is in flight (its worker reads the groups).
  void set_group_rates(const std::vector<double>& rates);
  ~OptimizerPartition();

  // Masters are a role of their own (16-bit training, or the delayed update); else the fp32
  // working parameters are the masters.
  bool separate_master() const { return separate_master_; }
  Kind kind() const { return kind_; }
  // Initial masters (16-bit training): `values` (fp32) for partition [begin, begin + numel).
  void store_master(int64_t begin, const at::Tensor& values);
  // One optimizer step with learning rate `lr`, the optimizer's own 1-based step count `step`
  // (bias correction) and every gradient multiplied by `grad_scale` first. `betas`, when set,
  // replace the configured (beta1, beta2) of Adam, AdamW and LAMB for this step (a schedule that
  // cycles the momentum); bias correction then uses them as DeepSpeed does, 1 - beta^step.
  void step(double lr, int64_t step, float grad_scale, const GradientReducer& gradients,
            std::optional<Betas> betas = std::nullopt);
  // Delayed update: the same step on the worker thread, from a snapshot of the owned gradients
  // taken before returning (the caller may clear and refill them at once). One at a time.
  void launch_step(double lr, int64_t step, float grad_scale, const GradientReducer& gradients,
                   std::optional<Betas> betas = std::nullopt);
  bool step_in_flight() const { return in_flight_; }
  // Staged without the delayed update: the bucket's owned gradients are final (the reducer says so
  // during the boundary backward), so their copy to the host starts now, overlapping the rest of
  // backward; step() copies only what has not come this way.
  bool takes_early_gradients() const { return staged_ && !options_.delayed; }
  void gradient_final(int bucket, const GradientReducer& gradients);
  // Waits for the launched step (the wait counts as a stall), rethrows what it threw, and installs
  // its working values. A no-op when none is in flight.
  void finish_step();
  // Waits for a launched step's thread without installing its values or rethrowing its error: for
  // teardown, before the I/O it issues is drained and the buffers it uses are freed.
  void join_worker();
  // Rounds the working copy of the owned region from the masters (after a checkpoint load).
  void refresh_working_from_masters();
  void zero_moments();

  // This rank's state by parameter name and range, for saving a checkpoint: views of the state
  // where a range is in memory (no copy), sources that read it piece by piece where it touches
  // sub-groups on NVMe (host memory: one piece, checkpoint_chunk_bytes()).
  std::vector<StateFragment> fragments(bool with_moments, const std::function<std::string(int)>& name_of) const;
  // Loading: the same fragments as destinations. A role kept wholly in memory gets fp32 tensors
  // (host memory: its size); a role with sub-groups on NVMe gets sinks into a TieredStaging of its
  // array (a second swap file, zero host memory beyond one piece). Nothing of the state changes
  // until commit_fragments(), which must follow a load that succeeded on every rank; destroying
  // the Staged instead discards it (its staging files removed).
  struct Staged {
    std::vector<StateFragment> fragments;
    std::vector<std::shared_ptr<TieredStaging>> arrays;
    std::shared_ptr<TransferScratch> scratch;
  };
  Staged staged_fragments(bool with_moments, const std::function<std::string(int)>& name_of);
  void commit_fragments(Staged& staged);

  int64_t memory_bytes() const;   // masters and moments in host memory
  int64_t disk_bytes() const;     // masters and moments in swap files
  // The delayed update's next working copy, where it is on disk (stage-3 parameters on NVMe).
  int64_t next_working_disk_bytes() const { return next_working_.disk_bytes(); }
  int64_t buffer_bytes() const;   // conversion scratch, the stream buffers, the delayed update's copies
  struct IoCounters { int64_t bytes_read = 0, bytes_written = 0; double seconds = 0; };
  IoCounters io_counters() const;

 private:
  struct Chunk {  // contiguous in the flat buffer and the partition, within one sub-group
    int64_t flat_offset = 0, partition_offset = 0, numel = 0;
    std::vector<int64_t> bounds{0};  // LAMB: piece boundaries relative to the chunk
    std::vector<int> placements;     // LAMB: the placement of each piece, -1 for padding
    int group = 0;                   // the parameter group of every piece (Options::groups)
  };
  struct Pointers;  // one sub-group's roles, resident
  class Stream;
  void plan_chunks();
  // The hyperparameters of parameter group `group`: `hyper` with the group's own values.
  template <typename Hyper>
  Hyper for_group(Hyper hyper, int group) const;
  // Where one pass reads gradients and writes the working values.
  struct PassTarget {
    const GradientReducer* gradients = nullptr;  // null: the delayed update's snapshot
    bool to_next = false;                        // the next working copy instead of the working one
  };
  void run_step(double lr, std::optional<Betas> betas, int64_t step, float grad_scale, PassTarget target,
                int threads);
  // LAMB's per-tensor sums [w² of each tensor..., u² of each tensor...] from this rank's pieces to
  // the whole tensors': over the shards, and over the tensor group for the slices.
  void sum_tensor_norms(at::Tensor& sums) const;
  void lamb_on_host(PassTarget target, int64_t step, const optim::StepOptions& options);
  void lamb_on_device(PassTarget target, int64_t step, const optim::DeviceStepOptions& options);
  template <class Kernel>
  void for_each_chunk(PassTarget target, bool writes_params, bool reads_gradients, Kernel&& kernel);
  void install_next_working();
  // The owned gradients into the host snapshot (a device-to-host copy when staged).
  void snapshot_gradients(const GradientReducer& gradients);
  void copy_bucket_to_snapshot(int bucket, const GradientReducer& gradients);
  std::vector<char> snapshot_has_;  // per bucket: copied during backward (takes_early_gradients)
  struct Run {  // a stretch contiguous in both the flat buffer and the partition
    int64_t flat_offset = 0, partition_offset = 0, numel = 0;
  };

  const FlatLayout& layout_;
  Options options_;
  Communicator& comm_;
  Working working_;
  Kind kind_ = Kind::Adam;
  bool separate_master_ = false;
  optim::AdamHyperparameters adam_;
  optim::LambHyperparameters lamb_;
  optim::SgdHyperparameters sgd_;
  std::vector<SubGroup> groups_;
  std::vector<std::vector<Chunk>> chunks_;  // per sub-group
  std::vector<Run> runs_;                   // the chunks merged: the units of the staging copies
  bool staged_ = false;                     // devices.stage_through_host
  // The working partition is where the step runs (host memory or NVMe; staged with parameter
  // offload too): the next working copy has its tiers and installing it is a swap.
  bool install_by_swap_ = false;
  std::unique_ptr<DeviceCopies> copies_;
  TieredArray master_, exp_avg_, exp_avg_sq_;
  at::Tensor grad_scratch_;
  std::unique_ptr<Stream> stream_;
  mutable std::mutex counters_mutex_;  // the worker adds to io_counters_ while the caller reads
  IoCounters io_counters_;
  // Delayed update.
  TieredArray next_working_;
  at::Tensor grad_snapshot_;  // the owned gradients, by partition offset, in the working dtype
  std::thread worker_;
  std::exception_ptr worker_error_;
  bool in_flight_ = false;
};

}  // namespace zt
