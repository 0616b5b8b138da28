#include "zerotrain/engine.h"

#include <ATen/record_function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>

#include <atomic>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>
#include <set>
#include <unordered_set>

#include "checkpoint/checkpoint.h"
#include "zero/device_plan.h"
#include "common/check.h"
#include "io/aio.h"
#include "io/swap_directory.h"
#include "zero/gradient_reducer.h"
#include "zero/loss_scaler.h"
#include "zero/nvme_footprint.h"
#include "zero/optimizer_partition.h"
#include "zero/parameter_gatherer.h"
#include "zero/parameter_tier.h"
#include "zero/partition_store.h"
#include "zero/sharded_blocks.h"
#include "zero/step_monitor.h"
#include "zerotrain/blocks.h"
#include "zerotrain/comm.h"
#include "zerotrain/comms_logger.h"
#include "zerotrain/config.h"
#include "zerotrain/error.h"
#include "zerotrain/layout.h"
#include "zerotrain/lr_schedule.h"
#include "zerotrain/memory.h"

// The engine: construction, the autograd glue and the order of one training step over its parts
// (docs/architecture.md "zero", docs/zero.md):
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

namespace zt {
namespace {

// The most elements of rank 0's initial values a rank holds at once beside the model as built
// (replicated parameters; src/memory/estimate.cpp counts it as kInitialValuesChunkElements).
constexpr int64_t kInitialValuesChunk = int64_t{1} << 20;

torch::ScalarType working_dtype_of(Precision precision) {
  switch (precision) {
    case Precision::BF16: return torch::kBFloat16;
    case Precision::FP16: return torch::kHalf;
    case Precision::FP32: break;
  }
  return torch::kFloat32;
}

class PreHook : public torch::autograd::FunctionPreHook {
 public:
  explicit PreHook(std::function<void()> fn) : fn_(std::move(fn)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    fn_();
    return grads;
  }

 private:
  std::function<void()> fn_;
};

// What the engine leaves in gradient hooks, which may outlive it: the engine clears `impl` in its
// destructor, so that a hook that runs afterwards does nothing instead of using freed memory.
struct Liveness : torch::CustomClassHolder {
  std::atomic<Engine::Impl*> impl{nullptr};
};

}  // namespace

struct Engine::Impl {
  c10::intrusive_ptr<Liveness> liveness = c10::make_intrusive<Liveness>();
  std::shared_ptr<torch::nn::Module> model;
  TrainConfig config;
  std::shared_ptr<Communicator> comm;
  NodeGroups node_groups;  // within and across nodes (zerotrain/comm.h)
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
  std::vector<std::shared_ptr<torch::autograd::Node>> grad_accumulators;  // keep hooks alive

  // Offload tiers (docs/offload.md): the I/O engine and swap directories exist only with NVMe.
  std::unique_ptr<io::AioEngine> io;
  std::vector<std::unique_ptr<io::SwapDirectory>> swap_directories;
  std::vector<SubGroup> groups;  // the partition's sub-groups (one, the whole partition, without NVMe)

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
  int64_t global_step = 0;  // optimizer steps taken
  int64_t skipped = 0;
  // Applied optimizer steps before the moments last started from zero (a load with
  // reset_optimizer): the optimizer's own step count, for bias correction, is counted from there.
  int64_t moments_from = 0;
  bool in_backward = false;

  std::vector<ParameterGroup> parameter_groups;

  Impl(std::shared_ptr<torch::nn::Module> m, const TrainConfig& c, std::shared_ptr<Communicator> cm,
       std::vector<ParameterGroup> g)
      : model(std::move(m)), config(c), comm(std::move(cm)), schedule(c.scheduler, c.optimizer.lr),
        scaler(c.fp16), parameter_groups(std::move(g)) {
    shard_parameters = c.zero.shard_parameters;
    world = comm->world_size();
    rank = comm->rank();
    working_dtype = working_dtype_of(c.precision);
    separate_master = working_dtype != torch::kFloat32;
    if (c.zero.shard_optimizer_states) {
      shard_world = world;
      shard_rank = rank;
    }
    node_groups = make_node_groups(comm);
    build();
    if (gatherer) gatherer->install();
    liveness->impl = this;
  }

  ~Impl() { liveness->impl = nullptr; }

  // ---------------------------------------------------------------- construction

  // The optimizer's parameter groups (Engine's ParameterGroup): group i + 1 of the partition is
  // parameter_groups[i]; every parameter no group names is in group 0, the configuration's.
  void assign_parameter_groups(OptimizerPartition::Options& options) {
    if (parameter_groups.empty()) return;
    std::unordered_map<std::string, int> group_of;
    for (const ParameterSpec& spec : specs) group_of.emplace(spec.name, 0);
    bool lr_given = false;
    for (size_t i = 0; i < parameter_groups.size(); ++i) {
      const ParameterGroup& g = parameter_groups[i];
      if (g.lr && !(std::isfinite(*g.lr) && *g.lr >= 0))
        throw ConfigError("engine: parameter group " + std::to_string(i) + ": expected lr >= 0, found " + fmt_double(*g.lr));
      if (g.weight_decay && !(std::isfinite(*g.weight_decay) && *g.weight_decay >= 0))
        throw ConfigError("engine: parameter group " + std::to_string(i) + ": expected weight_decay >= 0, found " +
                          fmt_double(*g.weight_decay));
      lr_given = lr_given || g.lr.has_value();
      for (const std::string& name : g.parameters) {
        auto it = group_of.find(name);
        if (it == group_of.end())
          throw ConfigError("engine: parameter group " + std::to_string(i) + ": expected the name of a trainable "
                            "parameter of the model, found '" + name + "'");
        if (it->second != 0)
          throw ConfigError("engine: parameter '" + name + "' is in parameter groups " + std::to_string(it->second - 1) +
                            " and " + std::to_string(i) + "; expected one group per parameter");
        it->second = int(i) + 1;
      }
    }
    const bool scheduled = !config.scheduler.type.empty();
    if (lr_given && scheduled && rank == 0)
      std::fprintf(stderr, "zerotrain: note: the scheduler (%s) sets the learning rate of every parameter group, as in "
                   "DeepSpeed; the groups' own lr values are not used\n", config.scheduler.type.c_str());
    options.groups.assign(parameter_groups.size() + 1, {});
    for (size_t i = 0; i < parameter_groups.size(); ++i) {
      if (!scheduled) options.groups[i + 1].lr = parameter_groups[i].lr;
      options.groups[i + 1].weight_decay = parameter_groups[i].weight_decay;
    }
    options.placement_group.resize(layout.placements.size());
    for (size_t p = 0; p < layout.placements.size(); ++p)
      options.placement_group[p] = group_of.at(specs[size_t(layout.placements[p].index)].name);
  }

  void build() {
    // The parameters of another live stage-3 engine's blocks have no data between its gathers.
    for (const auto& item : model->named_modules("model", /*include_self=*/true))
      if (has_block_runner(*item.value()))
        throw Error("engine: block '" + item.key() +
                    "' belongs to another stage-3 engine that is alive; one engine per model at a time");
    std::vector<PendingBlock> pending = adopt_sharded_blocks();
    std::unordered_set<const void*> built_sharded;
    for (const PendingBlock& b : pending)
      for (const auto& p : b.shards.parameters) built_sharded.insert(p.unsafeGetTensorImpl());
    std::vector<torch::Tensor> trainable;
    std::vector<ParameterSpec> specs;
    std::vector<int> owners;                        // per spec: the marked module holding it, or -1
    std::unordered_map<const void*, int> owner_of;  // TensorImpl -> marked module
    std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> owner_modules;
    if (shard_parameters) find_marked_modules(owner_of, owner_modules);
    std::optional<c10::Device> model_device;
    std::string first_name;
    for (auto& named : model->named_parameters(/*recurse=*/true)) {
      const torch::Tensor& p = named.value();
      if (!p.requires_grad()) continue;
      if (p.scalar_type() != torch::kFloat32)
        throw ConfigError("engine: expected fp32 parameters (the engine makes the working copy), found " +
                          std::string(c10::toString(p.scalar_type())) + " on " + p.device().str() + " for '" +
                          named.key() + "'");
      if (!model_device) {
        model_device = p.device();
        first_name = named.key();
      } else if (p.device() != *model_device) {
        throw ConfigError("engine: expected every trainable parameter on one device, found '" + first_name + "' on " +
                          model_device->str() + " and '" + named.key() + "' on " + p.device().str());
      }
      if (p.numel() > 0 && p.storage().nbytes() == 0 && !built_sharded.count(p.unsafeGetTensorImpl()))
        throw ConfigError("engine: parameter '" + named.key() +
                          "' has no data (its block was sharded by a stage-3 engine that has been destroyed)");
      trainable.push_back(p);
      auto owner = owner_of.find(p.unsafeGetTensorImpl());
      owners.push_back(owner == owner_of.end() ? -1 : owner->second);
      specs.push_back({named.key(), p.sizes().vec(), "float32", -1});
    }
    if (trainable.empty())
      throw ConfigError("engine: the model has no trainable parameters (every parameter has requires_grad false)");
    devices = plan_devices(*model_device, config.zero, host_staging_forced_by_environment());
    devices.emulate_copy_engine =
        devices.stage_through_host && devices.compute.is_cpu() && copy_engine_emulated_by_environment();
    if (!devices.compute.is_cpu() && !pending.empty())
      throw ConfigError("engine: block '" + pending.front().name +
                        "' was built under ShardedConstruction, which builds on the CPU; the model's parameters are on " +
                        devices.compute.str() + " (build the model whole and move it to the device instead)");
    if (rank == 0 && (!devices.compute.is_cpu() || devices.stage_through_host))
      std::fprintf(stderr, "zerotrain: engine: %s\n", devices.describe().c_str());
    for (const auto& spec : specs) registered.push_back({spec.name, spec.shape});
    if (shard_parameters) assign_blocks(trainable, specs, owners, owner_modules);
    LayoutOptions options;
    options.world_size = shard_world;
    options.bucket_size = std::max<int64_t>(1, config.zero.reduce_bucket_size);
    layout = compute_layout(specs, options);
    this->specs = specs;

    // The parts, long-lived arenas first (so that the transients of the loop below leave no holes
    // beneath them): working parameters and optimizer state; the gradients follow the loop.
    const OffloadPlan plan = plan_offload();
    auto working = torch::TensorOptions().dtype(working_dtype).device(devices.compute);
    if (shard_parameters) {
      if (plan.parameters_on_disk.empty())
        param_partition = TieredArray("params", working_dtype, layout.partition_numel, devices.compute);
      else
        param_partition = TieredArray("params", working_dtype, groups, plan.parameters_on_disk, *io,
                                      plan.parameter_directory->file("params"));
      parameter_tier = std::make_unique<ParameterTier>(layout, param_partition, groups, io.get(),
                                                       config.zero.offload_param.buffer_count);
    } else {
      flat_params = torch::zeros({layout.total_numel}, working);
    }
    OptimizerPartition::Options optimizer_options;
    optimizer_options.optimizer = config.optimizer;
    optimizer_options.working_dtype = working_dtype;
    optimizer_options.shard_rank = shard_rank;
    optimizer_options.shard_world = shard_world;
    optimizer_options.delayed = config.zero.offload_optimizer.delayed_update;
    optimizer_options.devices = devices;
    assign_parameter_groups(optimizer_options);
    if (io) {
      optimizer_options.tiers.groups = groups;
      optimizer_options.tiers.on_disk = plan.optimizer_on_disk;
      optimizer_options.tiers.io = io.get();
      if (plan.optimizer_directory) optimizer_options.tiers.directory = plan.optimizer_directory->path();
      optimizer_options.tiers.buffer_count = config.zero.offload_optimizer.buffer_count;
      optimizer_options.tiers.pipeline_read = config.zero.offload_optimizer.pipeline_read;
      optimizer_options.tiers.pipeline_write = config.zero.offload_optimizer.pipeline_write;
      // Nothing of the optimizer on disk: the stream still carries parameters that are.
      if (plan.optimizer_on_disk.empty()) optimizer_options.tiers.on_disk.clear();
      optimizer_options.tiers.gradients_on_disk = plan.gradients_on_disk;
    }
    OptimizerPartition::Working optimizer_working;
    if (shard_parameters) optimizer_working.partition = &param_partition;
    else optimizer_working.flat = flat_params;
    optimizer = std::make_unique<OptimizerPartition>(layout, optimizer_options, *comm, optimizer_working);
    if (shard_parameters)
      gatherer = std::make_unique<ParameterGatherer>(layout, std::move(planned_blocks), config.zero, working_dtype,
                                                     devices.compute, *comm, *parameter_tier, secondary_group());

    // Rank 0's initial values, in fp32, for everyone: the master weights are set from them before
    // anything is rounded to the working dtype.
    auto fp32 = torch::TensorOptions().dtype(torch::kFloat32).device(devices.compute);
    torch::NoGradGuard no_grad;
    // A block built sharded is gathered whole just before its first parameter is copied.
    std::unordered_map<const void*, int> pending_of;
    for (int k = 0; k < int(pending.size()); ++k)
      for (const auto& p : pending[k].shards.parameters) pending_of[p.unsafeGetTensorImpl()] = k;
    std::unordered_set<const void*> moved;
    for (const auto& p : trainable) moved.insert(p.unsafeGetTensorImpl());
    auto materialize_for = [&](int placement) {
      if (auto k = pending_of.find(trainable[layout.placements[placement].index].unsafeGetTensorImpl());
          k != pending_of.end())
        materialize(pending[k->second], moved);
    };
    // Masters in swap files are written a sub-group at a time: pieces smaller than a bucket would
    // read and rewrite a sub-group each, so they go a bucket at a time as with sharded parameters.
    const bool masters_on_disk =
        std::any_of(plan.optimizer_on_disk.begin(), plan.optimizer_on_disk.end(), [](char d) { return d != 0; });
    if (!shard_parameters)
      adopt_replicated_initial_values(trainable, fp32, masters_on_disk ? std::numeric_limits<int64_t>::max()
                                                                       : kInitialValuesChunk,
                                      materialize_for);
    // Sharded parameters, bucket by bucket, so that construction holds at most the model as given
    // plus one bucket (a model built under ShardedConstruction: its shards plus about one block):
    // each parameter moves into its bucket (its own storage is freed) and a block's bucket is
    // released at once.
    for (int b = 0; shard_parameters && b < int(layout.buckets.size()); ++b) {
      const BucketLayout& lb = layout.buckets[b];
      for (int pi = lb.first_placement; pi < lb.end_placement; ++pi) materialize_for(pi);
      torch::Tensor initial = torch::zeros({lb.numel}, fp32);
      for (int pi = lb.first_placement; pi < lb.end_placement; ++pi) {
        const ParameterPlacement& placement = layout.placements[pi];
        initial.narrow(0, placement.offset - lb.offset, placement.numel)
            .copy_(trainable[placement.index].detach().reshape({-1}));
      }
      comm->broadcast(initial, 0, "engine.init.params").wait();
      const torch::Tensor owned = initial.narrow(0, int64_t(shard_rank) * lb.shard_numel, lb.shard_numel);
      if (optimizer->separate_master()) optimizer->store_master(lb.partition_offset, owned);
      param_partition.store(lb.partition_offset, owned);
      // An own storage per bucket, so that releasing one block frees exactly its bytes.
      torch::Tensor full = separate_master ? initial.to(working_dtype) : initial;
      for (int pi = lb.first_placement; pi < lb.end_placement; ++pi) {
        const ParameterPlacement& placement = layout.placements[pi];
        torch::Tensor& param = trainable[placement.index];
        // set_data keeps the parameter's autograd identity (and version counter) intact.
        param.set_data(full.narrow(0, placement.offset - lb.offset, placement.numel).view(param.sizes()));
      }
      gatherer->adopt_bucket(b, std::move(full));
    }
    for (PendingBlock& p : pending) materialize(p, moved);  // blocks without trainable parameters

    // The gradient arenas come after the initial values are in place: a model built sharded
    // holds its shards until then, and the two never need to coexist.
    const GradientReduction reduction = config.zero.shard_gradients          ? GradientReduction::ReduceScatterBuckets
                                        : config.zero.shard_optimizer_states ? GradientReduction::ReduceScatterInPlace
                                                                             : GradientReduction::AllReduce;
    GradientReducer::Options reducer_options;
    reducer_options.reduction = reduction;
    reducer_options.shard_rank = shard_rank;
    reducer_options.world = world;
    reducer_options.working_dtype = working_dtype;
    reducer_options.device = devices.compute;
    reducer_options.accumulation_steps = config.gradient_accumulation_steps;
    reducer_options.overlap_comm = config.zero.overlap_comm;
    // DeepSpeed's averaging keys: prescale divides by the world size before the sum, else by the
    // predivide factor before and by world / factor after (docs/zero.md "Gradient averaging").
    reducer_options.pre_divide =
        config.averaging.prescale_gradients ? double(world) : config.averaging.gradient_predivide_factor;
    if (!plan.gradients_on_disk.empty())
      reducer_options.disk = GradientReducer::Options::Disk{groups, plan.gradients_on_disk, io.get(),
                                                            plan.optimizer_directory->file("grads")};
    reducer = std::make_unique<GradientReducer>(layout, reducer_options, *comm);
    if (optimizer->takes_early_gradients())
      reducer->set_on_final([this](int bucket) { optimizer->gradient_final(bucket, *reducer); });

    // Frozen parameters and floating-point buffers follow the working dtype so that the model's
    // operations see one dtype; they get no gradient or optimizer memory.
    if (separate_master) {
      for (auto& p : model->parameters(true))
        if (!p.requires_grad() && p.is_floating_point()) p.set_data(p.detach().to(working_dtype));
      for (auto& buffer : model->buffers(true))
        if (buffer.is_floating_point()) buffer.set_data(buffer.to(working_dtype));
    }

    for (int i = 0; i < int(layout.placements.size()); ++i) {
      const ParameterPlacement& placement = layout.placements[i];
      torch::Tensor& param = trainable[placement.index];
      reducer->attach(i, param);
      auto accumulator = torch::autograd::impl::grad_accumulator(param);
      // The accumulators outlive the engine in any graph built before it was destroyed; a backward
      // through such a graph then accumulates as plain autograd does (stage 3: the gatherer
      // refuses it).
      if (reducer->sharded())
        accumulator->add_pre_hook(std::make_unique<PreHook>([engine = liveness, i] {
          if (Impl* self = engine->impl.load()) self->reducer->before_gradient(i);
        }));
      accumulator->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
          [engine = liveness, i](const torch::autograd::variable_list& outputs, const torch::autograd::variable_list&) {
            if (Impl* self = engine->impl.load()) self->after_gradient(i);
            return outputs;
          }));
      grad_accumulators.push_back(std::move(accumulator));
    }
  }

  // Replicated parameters (stages 0-2): rank 0's values reach every rank in pieces of at most
  // chunk_limit elements (fp32 parameters: in place, a bucket at a time), and each
  // parameter moves into the flat buffer as soon as its last element is copied, freeing its own
  // storage. So construction holds the rest of the model as built plus one chunk beside the
  // arenas, never the whole model beside a bucket-sized fp32 copy of it: with one 500M-element
  // bucket (the default) on GPT-2 124M in bf16 that copy was the peak of the run
  // (docs/memory.md "The peak: two moments").
  template <class BeforeCopy>
  void adopt_replicated_initial_values(std::vector<torch::Tensor>& trainable, const torch::TensorOptions& fp32,
                                       int64_t chunk_limit, BeforeCopy&& before_copy) {
    const bool in_place = !separate_master;
    for (const BucketLayout& lb : layout.buckets) {
      const int64_t chunk = in_place ? lb.numel : std::min<int64_t>(lb.numel, chunk_limit);
      torch::Tensor scratch = in_place ? torch::Tensor() : torch::empty({chunk}, fp32);
      const int64_t owned_begin = int64_t(shard_rank) * lb.shard_numel, owned_end = owned_begin + lb.shard_numel;
      int next = lb.first_placement;  // the first placement not yet moved into the flat buffer
      auto move_into_flat = [&](const ParameterPlacement& placement) {
        torch::Tensor& param = trainable[placement.index];
        // set_data keeps the parameter's autograd identity (and version counter) intact.
        param.set_data(flat_params.narrow(0, placement.offset, placement.numel).view(param.sizes()));
      };
      for (int64_t begin = 0; begin < lb.numel; begin += chunk) {
        const int64_t end = std::min(lb.numel, begin + chunk);
        torch::Tensor values = in_place ? flat_params.narrow(0, lb.offset + begin, end - begin)
                                        : scratch.narrow(0, 0, end - begin).zero_();  // zero: the padding
        for (int pi = next; pi < lb.end_placement; ++pi) {
          const ParameterPlacement& placement = layout.placements[pi];
          const int64_t first = placement.offset - lb.offset, last = first + placement.numel;
          if (first >= end) break;
          if (first >= begin) before_copy(pi);
          const int64_t lo = std::max(first, begin), hi = std::min(last, end);
          if (hi > lo)
            values.narrow(0, lo - begin, hi - lo)
                .copy_(trainable[placement.index].detach().reshape({-1}).narrow(0, lo - first, hi - lo));
          if (last <= end) {
            move_into_flat(placement);
            next = pi + 1;
          }
        }
        comm->broadcast(values, 0, "engine.init.params").wait();
        const int64_t lo = std::max(owned_begin, begin), hi = std::min(owned_end, end);
        if (optimizer->separate_master() && hi > lo)
          optimizer->store_master(lb.partition_offset + (lo - owned_begin), values.narrow(0, lo - begin, hi - lo));
        if (!in_place) flat_params.narrow(0, lb.offset + begin, end - begin).copy_(values);
      }
      for (int pi = next; pi < lb.end_placement; ++pi) {  // empty ones at the end
        before_copy(pi);
        move_into_flat(layout.placements[pi]);
      }
    }
  }

  // ---------------------------------------------------------------- offload (docs/offload.md)
  // The NVMe tiers' bytes as planned: the pre-flight check held them against the disk, the tiers
  // created them, a load's staging is checked against them.
  NvmeFootprint footprint;

  // A load writes staging copies beside the live swap files until it commits: their free space is
  // checked on every rank before anything is read, and all ranks refuse together.
  void preflight_load_staging(bool with_moments) {
    const int64_t optimizer_dir = footprint.masters + (with_moments ? footprint.moments : 0);
    const int64_t parameter_dir = footprint.load_staging_parameters;
    if (optimizer_dir == 0 && parameter_dir == 0) return;
    on_every_rank(*comm, "load.staging_space", [&] {
      // Every rank's staging counts against a shared disk, as at construction.
      std::map<std::string, std::pair<int64_t, std::string>> need;  // path: bytes, the key naming it
      if (optimizer_dir > 0) {
        auto& n = need[config.zero.offload_optimizer.nvme_path];
        n.first += optimizer_dir * world;
        n.second = "zero_optimization.offload_optimizer.nvme_path";
      }
      if (parameter_dir > 0) {
        auto& n = need[config.zero.offload_param.nvme_path];
        n.first += parameter_dir * world;
        if (n.second.empty()) n.second = "zero_optimization.offload_param.nvme_path";
      }
      for (const auto& [path, n] : need)
        io::preflight_swap_path(path, n.first, n.second, "a checkpoint load's staging copies");
    });
  }

  struct OffloadPlan {
    std::vector<char> optimizer_on_disk, parameters_on_disk;  // per sub-group; empty: all in memory
    std::vector<char> gradients_on_disk;                      // nvme_gradients: the optimizer's sub-groups
    io::SwapDirectory* optimizer_directory = nullptr;
    io::SwapDirectory* parameter_directory = nullptr;
  };

  // Decides which sub-groups of which role go to NVMe, checks the swap paths (pre-flight: before
  // anything large is allocated) and opens the I/O engine and the swap directories.
  OffloadPlan plan_offload() {
    OffloadPlan plan;
    const OffloadOptimizerConfig& oo = config.zero.offload_optimizer;
    const OffloadParamConfig& op = config.zero.offload_param;
    if (oo.delayed_update && oo.nvme_gradients && oo.device == OffloadDevice::Nvme && config.zero.shard_gradients)
      throw ConfigError("zero_optimization.offload_optimizer.nvme_gradients: true cannot be combined with "
                        "delayed_update (the delayed step keeps a snapshot of the gradients in memory)");
    if (oo.delayed_update && config.optimizer.type == "Lamb" && shard_world > 1)
      throw ConfigError("zero_optimization.offload_optimizer.delayed_update: expected an optimizer whose step needs no "
                        "collective, found Lamb on " + std::to_string(shard_world) +
                        " ranks (its per-tensor trust ratios need an all-reduce inside the step, which the delayed "
                        "step cannot run beside training's collectives); use Adam/AdamW/SGD or delayed_update false");
    const bool optimizer_nvme = oo.device == OffloadDevice::Nvme;
    const bool parameters_nvme = op.device == OffloadDevice::Nvme && shard_parameters;
    if (!optimizer_nvme && !parameters_nvme) return plan;
    groups = plan_sub_groups(layout, config.zero.sub_group_size);
    const int64_t partition = layout.partition_numel;
    if (optimizer_nvme) {
      // ratio: the first sub-groups up to that fraction of the partition go to NVMe, the rest stay.
      const double limit = oo.ratio * double(partition);
      int64_t placed = 0;
      for (const SubGroup& g : groups) {
        plan.optimizer_on_disk.push_back(double(placed) < limit);
        placed += g.numel;
      }
      // The gradients of the sub-groups whose state is on NVMe go there too (stages 2-3).
      if (oo.nvme_gradients && config.zero.shard_gradients) plan.gradients_on_disk = plan.optimizer_on_disk;
    }
    if (parameters_nvme) {
      // Shards of blocks go to NVMe, except whole blocks (the last ones) within max_in_cpu
      // elements; parameters outside every block stay whole in memory anyway.
      plan.parameters_on_disk.assign(groups.size(), 0);
      std::map<int, std::vector<size_t>> block_groups;
      std::map<int, int64_t> block_shard;
      for (size_t g = 0, b = 0; g < groups.size(); ++g) {
        while (groups[g].begin >= layout.buckets[b].partition_offset + layout.buckets[b].shard_numel) ++b;
        if (const int block = layout.buckets[b].group; block >= 0) {
          block_groups[block].push_back(g);
          block_shard[block] += groups[g].numel;
        }
      }
      int64_t kept = 0;
      for (auto it = block_groups.rbegin(); it != block_groups.rend(); ++it) {
        if (kept + block_shard[it->first] <= op.max_in_cpu) {
          kept += block_shard[it->first];
          continue;
        }
        for (size_t g : it->second) plan.parameters_on_disk[g] = 1;
      }
      int64_t largest_block = 0;
      std::map<int, int64_t> block_numel;
      for (const BucketLayout& lb : layout.buckets)
        if (lb.group >= 0) largest_block = std::max(largest_block, block_numel[lb.group] += lb.shard_numel);
      if (largest_block > op.buffer_size)
        throw ConfigError("zero_optimization.offload_param.buffer_size: expected at least the largest block's shard, " +
                          std::to_string(largest_block) + " elements, found " + std::to_string(op.buffer_size));
    }
    // Pre-flight, on every rank: each rank's swap files, times the ranks that may share the disk.
    const int64_t ranks_sharing = world;
    auto log = [this](const std::string& line) {
      if (rank == 0) std::fprintf(stderr, "zerotrain: note: %s\n", line.c_str());
    };
    NvmeTierPlan tiers;
    tiers.groups = groups;
    tiers.optimizer_on_disk = plan.optimizer_on_disk;
    tiers.gradients_on_disk = plan.gradients_on_disk;
    tiers.parameters_on_disk = plan.parameters_on_disk;
    tiers.fp32_masters = keeps_fp32_masters(separate_master, oo.delayed_update, devices.stage_through_host);
    tiers.moments = optimizer_moment_arrays(config);
    tiers.working_element_bytes = int64_t(c10::elementSize(working_dtype));
    // The delayed update keeps a second working copy with the same tiers (params.next).
    tiers.next_working_copy = oo.delayed_update && !devices.stage_through_host;
    footprint = nvme_footprint(tiers);
    std::map<std::string, int64_t> need;
    if (optimizer_nvme) need[oo.nvme_path] += footprint.optimizer_directory() * ranks_sharing;
    if (parameters_nvme) need[op.nvme_path] += footprint.parameter_directory() * ranks_sharing;
    if (optimizer_nvme)
      io::preflight_swap_path(oo.nvme_path, need[oo.nvme_path], "zero_optimization.offload_optimizer.nvme_path");
    if (parameters_nvme && (!optimizer_nvme || op.nvme_path != oo.nvme_path))
      io::preflight_swap_path(op.nvme_path, need[op.nvme_path], "zero_optimization.offload_param.nvme_path");
    io::AioOptions aio = io::aio_options_from(config.aio);
    aio.log = log;
    io = std::make_unique<io::AioEngine>(aio);
    if (optimizer_nvme) {
      swap_directories.push_back(std::make_unique<io::SwapDirectory>(oo.nvme_path, rank, log));
      plan.optimizer_directory = swap_directories.back().get();
    }
    if (parameters_nvme) {
      if (optimizer_nvme && op.nvme_path == oo.nvme_path) {
        plan.parameter_directory = plan.optimizer_directory;
      } else {
        swap_directories.push_back(std::make_unique<io::SwapDirectory>(op.nvme_path, rank, log));
        plan.parameter_directory = swap_directories.back().get();
      }
    }
    return plan;
  }

  // Stage 3: the marked modules of the model; each trainable parameter under one belongs to it.
  // Nesting or sharing between blocks is refused.
  void find_marked_modules(std::unordered_map<const void*, int>& owner_of,
                           std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>>& modules) {
    for (const auto& item : model->named_modules("model", /*include_self=*/true)) {
      if (!is_marked_block(*item.value())) continue;
      for (const auto& p : item.value()->named_parameters(true)) {
        if (!p.value().requires_grad()) continue;
        auto [it, fresh] = owner_of.emplace(p.value().unsafeGetTensorImpl(), int(modules.size()));
        if (!fresh)
          throw ConfigError("stage 3: parameter '" + item.key() + "." + p.key() + "' belongs to two blocks, '" +
                            modules[it->second].first + "' and '" + item.key() +
                            "' (blocks must not nest or share parameters)");
      }
      modules.emplace_back(item.key(), item.value());
    }
  }

  // Stage 3: a marked module with trainable parameters of at least
  // stage3_param_persistence_threshold elements is a block, and those parameters are its group in
  // the layout; every other parameter is persistent (group -1: kept whole on every rank). Within
  // a module the persistent parameters are moved before the others, so that in the layout's
  // reverse order each block is one contiguous run of buckets followed by its persistent bucket,
  // and both complete during that block's backward.
  void assign_blocks(std::vector<torch::Tensor>& trainable, std::vector<ParameterSpec>& specs,
                     const std::vector<int>& owners,
                     const std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>>& modules) {
    const int64_t threshold = config.zero.stage3_param_persistence_threshold;
    std::vector<int> block_of_module(modules.size(), -1);
    for (size_t i = 0; i < specs.size(); ++i) {
      const int owner = owners[i];
      if (owner < 0 || trainable[i].numel() < threshold) continue;
      if (block_of_module[owner] < 0) {
        block_of_module[owner] = int(planned_blocks.size());
        planned_blocks.push_back({modules[owner].first, modules[owner].second});
      }
      specs[i].group = block_of_module[owner];
    }
    std::vector<size_t> order(specs.size());
    std::iota(order.begin(), order.end(), size_t(0));
    for (size_t begin = 0; begin < order.size();) {
      size_t end = begin + 1;
      while (end < order.size() && owners[end] == owners[begin]) ++end;
      if (owners[begin] >= 0)
        std::stable_partition(order.begin() + begin, order.begin() + end, [&](size_t i) { return specs[i].group < 0; });
      begin = end;
    }
    std::vector<torch::Tensor> sorted_trainable;
    std::vector<ParameterSpec> sorted_specs;
    for (size_t i : order) {
      sorted_trainable.push_back(trainable[i]);
      sorted_specs.push_back(specs[i]);
    }
    trainable = std::move(sorted_trainable);
    specs = std::move(sorted_specs);
  }

  // Blocks built under a ShardedConstruction (zerotrain/blocks.h) hold only this rank's shard
  // until materialize() gathers them.
  struct PendingBlock {
    std::string name;
    ShardedBlock shards;
    bool materialized = false;
  };

  std::vector<PendingBlock> adopt_sharded_blocks() {
    std::vector<PendingBlock> found;
    for (const auto& item : model->named_modules("model", /*include_self=*/true))
      if (auto shards = take_sharded_block(*item.value())) found.push_back({item.key(), std::move(*shards)});
    // Every rank must have built the model the same way: the gathers below are collectives.
    if (world > 1) {
      torch::Tensor mine = torch::tensor({int64_t(found.size())}, torch::kLong);
      torch::Tensor all = torch::empty({int64_t(world)}, torch::kLong);
      comm->all_gather(mine, all, "engine.init.sharded_blocks").wait();
      for (int r = 0; r < world; ++r)
        if (all[r].item<int64_t>() != int64_t(found.size()))
          throw Error("engine: ranks built the model differently: rank " + std::to_string(rank) + " has " +
                      std::to_string(found.size()) + " blocks built under ShardedConstruction, rank " +
                      std::to_string(r) + " has " + std::to_string(all[r].item<int64_t>()) +
                      " (every rank must build the model the same way)");
    }
    for (const PendingBlock& b : found)
      if (b.shards.rank != rank || b.shards.world_size != world)
        throw ConfigError("engine: block '" + b.name + "' was built under ShardedConstruction as rank " +
                          std::to_string(b.shards.rank) + " of " + std::to_string(b.shards.world_size) +
                          ", but this engine is rank " + std::to_string(rank) + " of " + std::to_string(world));
    return found;
  }

  // Gathers a sharded block's parameters whole (one collective). Parameters in `moved` are about
  // to be copied into the engine's arenas and may stay views of the gathered buffer; the others
  // (frozen, persistent) get their own storage so that the buffer is freed with the last move.
  void materialize(PendingBlock& pending, const std::unordered_set<const void*>& moved) {
    if (pending.materialized) return;
    ShardedBlock& s = pending.shards;
    torch::Tensor full = torch::empty({s.shard.numel() * world}, s.shard.options());
    comm->all_gather(s.shard, full, "engine.init.block." + pending.name).wait();
    int64_t offset = 0;
    for (torch::Tensor& p : s.parameters) {
      torch::Tensor view = full.narrow(0, offset, p.numel()).view(p.sizes());
      p.set_data(moved.count(p.unsafeGetTensorImpl()) ? view : view.clone());
      offset += p.numel();
    }
    s = ShardedBlock();
    pending.materialized = true;
  }


  // The stage-3 secondary partition's group (hpZ, docs/zero.md "hpZ"): zero_hpz_partition_size
  // consecutive ranks, as DeepSpeed forms them, which with ranks placed node by node and a size
  // dividing the ranks per node lie within one node. Null without a secondary partition.
  std::shared_ptr<Communicator> secondary_group() {
    const int size = config.zero.hpz_partition_size;
    if (!shard_parameters || size <= 1) return nullptr;
    if (world % size != 0)
      throw ConfigError("zero_optimization.zero_hpz_partition_size: expected a divisor of the world size " +
                        std::to_string(world) + ", found " + std::to_string(size));
    const NodePlacement where = comm->placement();
    if (rank == 0 && where.local_world_size % size != 0)
      std::fprintf(stderr,
                   "zerotrain: engine: zero_hpz_partition_size %d does not divide the %d ranks of a node: secondary "
                   "groups span nodes, so backward's gathers cross them\n",
                   size, where.local_world_size);
    if (size == world) return comm;
    return comm->split(rank / size, "hpz");
  }

  // ---------------------------------------------------------------- backward
  bool boundary_next() const { return micro_step + 1 == config.gradient_accumulation_steps; }

  void backward(const torch::Tensor& loss) {
    ZT_CHECK_STATE(!in_backward, "backward() re-entered");
    reducer->begin_backward(boundary_next());
    if (gatherer) gatherer->begin_backward();
    in_backward = true;
    try {
      (loss * (scaler.scale() / double(config.gradient_accumulation_steps))).backward();
    } catch (...) {
      in_backward = false;
      reducer->abort_backward();
      if (gatherer) gatherer->end_backward(/*release=*/false);
      throw;
    }
    in_backward = false;
    reducer->end_backward();
    // A block some of whose parameters got no gradient is still gathered: release it.
    if (gatherer) gatherer->end_backward();
    ++micro_step;
  }

  void after_gradient(int i) {
    if (reducer->after_gradient(i) && gatherer) gatherer->gradient_arrived(layout.placements[i].bucket);
  }

  // ---------------------------------------------------------------- step
  // Every rank receives the updated working parameters of every other rank's shards.
  void gather_parameters() {
    const int64_t in_flight_limit = std::max<int64_t>(1, config.zero.allgather_bucket_size);
    std::vector<std::pair<CollectiveHandle, int64_t>> in_flight;
    int64_t in_flight_numel = 0;
    for (int b = 0; b < int(layout.buckets.size()); ++b) {
      const BucketLayout& lb = layout.buckets[b];
      // allgather_bucket_size bounds the elements being gathered at once.
      while (!in_flight.empty() && in_flight_numel + lb.numel > in_flight_limit) {
        in_flight.front().first.wait();
        in_flight_numel -= in_flight.front().second;
        in_flight.erase(in_flight.begin());
      }
      in_flight.emplace_back(comm->all_gather(flat_params.narrow(0, layout.shard_offset(b, shard_rank), lb.shard_numel),
                                              flat_params.narrow(0, lb.offset, lb.numel),
                                              "params.bucket" + std::to_string(b)),
                             lb.numel);
      in_flight_numel += lb.numel;
    }
    for (auto& [handle, numel] : in_flight) handle.wait();
  }

  // The updated partition reaches the working parameters every rank uses.
  void publish_parameters() {
    if (shard_parameters) {
      // A block gathered (or read) ahead for a forward that did not come holds old values, and so
      // do the secondary shards.
      gatherer->release_all();
      gatherer->invalidate_secondary();
      parameter_tier->invalidate();
      gatherer->gather_persistent();
    } else if (shard_world > 1) {
      gather_parameters();
    }
  }

  StepResult step() {
    StepResult result;
    if (micro_step < config.gradient_accumulation_steps) return result;
    result.boundary = true;
    micro_step = 0;
    reducer->finish_window();

    // Gradients hold the sum over ranks of loss_scale × the mean micro-batch gradient, divided
    // by the reducer's pre-division; post_divisor() turns that into the mean over ranks.
    double square_sum = reducer->owned_square_sum();
    if (shard_world > 1) {
      torch::Tensor total = torch::full({1}, square_sum, torch::kFloat64);
      comm->all_reduce(total, ReduceOp::Sum, "grads.norm").wait();
      square_sum = total.item<double>();
    }
    const double unscale = 1.0 / (reducer->post_divisor() * scaler.scale());
    const double norm = std::sqrt(square_sum) * unscale;
    result.grad_norm = norm;
    result.loss_scale = scaler.scale();
    // As DeepSpeed, a step skipped for overflow does not advance the schedule (its scheduler
    // steps only with the optimizer), while global_step counts it.
    result.lr = schedule.lr_at(global_step - skipped);
    // OneCycle's momentum: DeepSpeed cycles only optimizers with betas (not SGD).
    const std::optional<Betas> betas =
        config.optimizer.type == "SGD" ? std::nullopt : schedule.betas_at(global_step - skipped);
    ++global_step;
    const bool overflow = !std::isfinite(norm);
    scaler.update(overflow);
    // A delayed update in flight was computed from the step before, whose gradients were finite:
    // it is installed now whether or not this step is skipped (else the next forward would run on
    // weights two steps stale).
    apply_pending_update();
    if (overflow) {
      // The norm is the same on every rank (one all-reduce, or identical all-reduced gradients),
      // so every rank skips together.
      ++skipped;
      result.skipped = true;
      reducer->clear();
      return result;
    }
    double scale = unscale;
    if (config.gradient_clipping > 0 && norm > config.gradient_clipping)
      scale *= config.gradient_clipping / (norm + 1e-6);
    const int64_t optimizer_step = global_step - skipped - moments_from;
    // The delayed parameter update (docs/offload.md "Delayed parameter update"): after the first
    // delayed_update_after steps, this step's update is computed while the next forward and
    // backward run on the weights of the step before; it is installed at the next step.
    const OffloadOptimizerConfig& oo = config.zero.offload_optimizer;
    if (oo.delayed_update && global_step > oo.delayed_update_after) {
      optimizer->launch_step(result.lr, optimizer_step, float(scale), *reducer, betas);
      result.delayed = true;
    } else {
      if (parameter_tier) parameter_tier->invalidate();
      optimizer->step(result.lr, optimizer_step, float(scale), *reducer, betas);
      publish_parameters();
    }
    reducer->clear();
    result.stepped = true;
    return result;
  }

  // Completes a delayed step in flight: its working values replace the working parameters and
  // reach every rank. A collective when one is in flight (on every rank alike: the delay depends
  // only on the step count).
  void apply_pending_update() {
    if (!optimizer->step_in_flight()) return;
    // Shard buffers read ahead hold the old values.
    if (parameter_tier) parameter_tier->invalidate();
    optimizer->finish_step();
    publish_parameters();
  }

  // ---------------------------------------------------------------- checkpoints

  // This rank's pieces of the optimizer state by parameter name and element range. Without
  // sharded optimizer states every rank holds all of it; rank 0 saves it.
  std::vector<StateFragment> owned_state(bool saving, bool with_moments) {
    if (saving && rank >= shard_world) return {};
    return optimizer->fragments(with_moments,
                                [this](int placement) { return specs[layout.placements[placement].index].name; });
  }

  void save_checkpoint(const std::string& dir, const std::string& tag,
                       const std::map<std::string, std::string>& client_state, int keep_last) {
    if (micro_step != 0)
      throw Error("save_checkpoint: expected a call between optimizer steps, found micro-step " +
                  std::to_string(micro_step) + " of an accumulation window of " +
                  std::to_string(config.gradient_accumulation_steps));
    // A checkpoint holds every update so far; the running engine continues from the same state a
    // resumed one starts from, so resuming is exact with the delayed update too.
    apply_pending_update();
    CheckpointContents contents;
    contents.parameters = registered;
    const LossScaler::State s = scaler.state();
    contents.scalars = {{"global_step", std::to_string(global_step)},
                        {"skipped_steps", std::to_string(skipped)},
                        {"optimizer", config.optimizer.type},
                        {"optimizer.moments_from", std::to_string(moments_from)},
                        {"loss_scale", fmt_double(s.scale)},
                        {"loss_scale.hysteresis_left", std::to_string(s.hysteresis_left)},
                        {"loss_scale.iteration", std::to_string(s.iteration)},
                        {"loss_scale.last_overflow_iteration", std::to_string(s.last_overflow_iteration)}};
    for (const auto& [key, value] : client_state) contents.scalars["client." + key] = value;
    contents.configuration = config.resolved;
    std::vector<StateFragment> fragments = owned_state(true, true);
    for (const auto& [name, value] : frozen_values()) {
      contents.frozen.push_back({name, value.sizes().vec()});
      // Every rank holds them whole; rank 0 saves them.
      if (rank == 0) {
        StateFragment f;
        f.parameter = name;
        f.numel = value.numel();
        f.roles["frozen"] = value.detach().reshape({-1}).to(torch::kCPU, torch::kFloat32);
        fragments.push_back(std::move(f));
      }
    }
    save_sharded_checkpoint(*comm, dir, tag, contents, fragments, keep_last);
  }

  // The model's values outside the layout, by name: frozen parameters and floating-point buffers
  // (with 16-bit training, in the working dtype; saved as fp32, exactly). Buffers of other dtypes
  // are left out, said once.
  std::vector<std::pair<std::string, torch::Tensor>> frozen_values() {
    std::vector<std::pair<std::string, torch::Tensor>> out;
    for (const auto& named : model->named_parameters(/*recurse=*/true))
      if (!named.value().requires_grad()) out.emplace_back(named.key(), named.value());
    for (const auto& named : model->named_buffers(/*recurse=*/true)) {
      if (named.value().is_floating_point()) {
        out.emplace_back(named.key(), named.value());
      } else if (!noted_integer_buffers && rank == 0) {
        std::fprintf(stderr, "zerotrain: note: buffer '%s' (%s) and any other non-floating-point buffer are not kept in "
                     "checkpoints or read by load_weights\n", named.key().c_str(), c10::toString(named.value().scalar_type()));
        noted_integer_buffers = true;
      }
    }
    return out;
  }
  bool noted_integer_buffers = false;

  // Staging for the frozen values a load fills: fp32 tensors, copied into the model only when
  // every rank succeeded.
  std::vector<std::pair<torch::Tensor, torch::Tensor>> stage_frozen(std::vector<CheckpointParameter>* list) {
    std::vector<std::pair<torch::Tensor, torch::Tensor>> staged;
    for (const auto& [name, value] : frozen_values()) {
      if (list) list->push_back({name, value.sizes().vec()});
      staged.emplace_back(value, torch::empty(value.sizes(), torch::kFloat32));
    }
    return staged;
  }

  static void commit_frozen(const std::vector<std::pair<torch::Tensor, torch::Tensor>>& staged) {
    torch::NoGradGuard no_grad;
    for (const auto& [target, values] : staged) target.detach().copy_(values);
  }

  void load_weights(WeightReader& reader) {
    if (micro_step != 0)
      throw Error("load_weights: expected a call between optimizer steps, found micro-step " + std::to_string(micro_step));
    apply_pending_update();
    preflight_load_staging(/*with_moments=*/false);
    OptimizerPartition::Staged staged = optimizer->staged_fragments(
        false, [this](int placement) { return specs[layout.placements[placement].index].name; });
    std::map<std::string, std::vector<int64_t>> shapes;
    for (const auto& p : registered) shapes[p.name] = p.shape;
    std::vector<std::pair<std::string, torch::Tensor>> frozen = frozen_values();
    auto staged_frozen = stage_frozen(nullptr);
    std::exception_ptr error;
    try {
      std::vector<float> piece;
      for (StateFragment& f : staged.fragments) {
        const std::vector<int64_t>& shape = shapes.at(f.parameter);
        if (auto t = f.roles.find("master"); t != f.roles.end()) {
          reader.read(f.parameter, shape, f.begin, f.numel, t->second.data_ptr<float>());
          continue;
        }
        // A master partition on NVMe: through its staging file, a chunk at a time.
        const FragmentSink& sink = f.sinks.at("master");
        const int64_t chunk = checkpoint_chunk_bytes() / int64_t(sizeof(float));
        piece.resize(size_t(std::min(chunk, f.numel)));
        for (int64_t done = 0; done < f.numel;) {
          const int64_t n = std::min(chunk, f.numel - done);
          reader.read(f.parameter, shape, f.begin + done, n, piece.data());
          sink(done, n, piece.data());
          done += n;
        }
      }
      for (size_t i = 0; i < frozen.size(); ++i)
        reader.read(frozen[i].first, frozen[i].second.sizes().vec(), 0, frozen[i].second.numel(),
                    staged_frozen[i].second.data_ptr<float>());
    } catch (...) {
      error = std::current_exception();
    }
    // Every rank learns whether all succeeded before anything changes.
    torch::Tensor failed = torch::full({1}, error ? double(rank + 1) : 0.0, torch::kFloat64);
    comm->all_reduce(failed, ReduceOp::Max, "engine.load_weights").wait();
    if (error) std::rethrow_exception(error);
    if (failed.item<double>() > 0)
      throw Error("load_weights: reading failed on rank " + std::to_string(int(failed.item<double>()) - 1) +
                  " (its error names the problem)");
    torch::NoGradGuard no_grad;
    if (parameter_tier) parameter_tier->invalidate();
    optimizer->commit_fragments(staged);
    optimizer->refresh_working_from_masters();
    publish_parameters();
    reducer->clear();
    commit_frozen(staged_frozen);
  }

  // ---------------------------------------------------------------- one parameter's masters

  const CheckpointParameter& trainable_named(const std::string& name, const char* what) const {
    for (const CheckpointParameter& p : registered)
      if (p.name == name) return p;
    throw ConfigError(std::string(what) + ": expected the name of a trainable parameter of the model, found '" + name + "'");
  }

  static int64_t numel_of(const std::vector<int64_t>& shape) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }

  // Every rank adds what it keeps of the masters into zeros; the owners' ranges do not overlap, so
  // the sum is the whole tensor, bit for bit.
  torch::Tensor master_parameter(const std::string& name) {
    const CheckpointParameter& p = trainable_named(name, "master_parameter");
    if (micro_step != 0)
      throw Error("master_parameter: expected a call between optimizer steps, found micro-step " + std::to_string(micro_step));
    apply_pending_update();
    torch::Tensor full = torch::zeros({numel_of(p.shape)}, torch::kFloat32);
    for (StateFragment& f : owned_state(/*saving=*/true, /*with_moments=*/false)) {
      if (f.parameter != name) continue;
      if (auto t = f.roles.find("master"); t != f.roles.end())
        full.narrow(0, f.begin, f.numel).copy_(t->second.reshape({-1}));
      else
        f.sources.at("master")(0, f.numel, full.data_ptr<float>() + f.begin);
    }
    torch::Tensor on_device = full.to(devices.compute);
    comm->all_reduce(on_device, ReduceOp::Sum, "engine.master_parameter").wait();
    return on_device.to(torch::kCPU).view(p.shape);
  }

  // Serves load_weights: the named parameters from `values`, every other value as it is now, so
  // that only those change.
  struct SomeParametersReader : WeightReader {
    std::map<std::string, torch::Tensor> values;  // fp32, contiguous, flat
    std::vector<StateFragment> current;
    std::map<std::string, torch::Tensor> frozen;
    void read(const std::string& n, const std::vector<int64_t>& shape, int64_t begin, int64_t count,
              float* out) override {
      if (auto it = values.find(n); it != values.end()) {
        std::memcpy(out, it->second.data_ptr<float>() + begin, size_t(count) * sizeof(float));
        return;
      }
      if (auto it = frozen.find(n); it != frozen.end()) {
        torch::Tensor v = it->second.detach().reshape({-1}).to(torch::kCPU, torch::kFloat32).contiguous();
        std::memcpy(out, v.data_ptr<float>() + begin, size_t(count) * sizeof(float));
        return;
      }
      for (StateFragment& f : current) {
        if (f.parameter != n || begin < f.begin || begin + count > f.begin + f.numel) continue;
        if (auto t = f.roles.find("master"); t != f.roles.end()) {
          torch::Tensor v = t->second.reshape({-1}).narrow(0, begin - f.begin, count).to(torch::kCPU).contiguous();
          std::memcpy(out, v.data_ptr<float>(), size_t(count) * sizeof(float));
        } else {
          f.sources.at("master")(begin - f.begin, count, out);
        }
        return;
      }
      throw Error("set_master_parameters: no state of '" + n + "' elements [" + std::to_string(begin) + ", " +
                  std::to_string(begin + count) + ") on this rank");
    }
  };

  void set_master_parameters(const std::map<std::string, torch::Tensor>& values) {
    SomeParametersReader reader;
    for (const auto& [name, value] : values) {
      const CheckpointParameter& p = trainable_named(name, "set_master_parameters");
      if (value.numel() != numel_of(p.shape))
        throw ConfigError("set_master_parameters: the value for '" + name + "' has " + std::to_string(value.numel()) +
                          " elements, expected " + std::to_string(numel_of(p.shape)));
      reader.values[name] = value.detach().reshape({-1}).to(torch::kCPU, torch::kFloat32).contiguous();
    }
    if (micro_step != 0)
      throw Error("set_master_parameters: expected a call between optimizer steps, found micro-step " +
                  std::to_string(micro_step));
    apply_pending_update();
    reader.current = owned_state(/*saving=*/false, /*with_moments=*/false);
    for (const auto& [n, v] : frozen_values()) reader.frozen[n] = v;
    load_weights(reader);
  }

  // Adam and AdamW keep the same state; the type names compare case-insensitively.
  static std::string optimizer_family(std::string type) {
    for (char& c : type) c = char(std::tolower(static_cast<unsigned char>(c)));
    return type == "adamw" ? "adam" : type;
  }

  std::map<std::string, std::string> load_checkpoint(const std::string& dir, const std::string& tag,
                                                     const LoadOptions& options) {
    if (micro_step != 0)
      throw Error("load_checkpoint: expected a call between optimizer steps, found micro-step " +
                  std::to_string(micro_step));
    apply_pending_update();
    // Read into staging first (host tensors for what is in memory, staging swap files for what is
    // on NVMe), so that a failure leaves this engine as it was. Resetting the optimizer reads the
    // masters only.
    preflight_load_staging(/*with_moments=*/!options.reset_optimizer);
    OptimizerPartition::Staged staged = optimizer->staged_fragments(
        !options.reset_optimizer, [this](int placement) { return specs[layout.placements[placement].index].name; });
    std::vector<std::string> changes;
    LossScaler::State saved_scaler;
    int64_t step = 0, skipped_steps = 0, saved_moments_from = 0;
    const auto check = [&](const LoadedCheckpoint& saved) {
      // The counters, parsed before anything is read: a malformed one is a DataError on every rank.
      auto number = [&](const std::string& key, double lo, double hi, bool integer) {
        auto it = saved.scalars.find(key);
        if (it == saved.scalars.end()) throw DataError(saved.manifest + ": no '" + key + "' in its scalars");
        size_t used = 0;
        double v = std::nan("");
        try {
          v = std::stod(it->second, &used);
        } catch (const std::exception&) {
        }
        if (used != it->second.size() || !(v >= lo && v <= hi) || (integer && v != std::floor(v)))
          throw DataError(saved.manifest + ": scalar '" + key + "' is '" + it->second + "', expected " +
                          (integer ? "an integer" : "a number") + " in [" + fmt_double(lo) + ", " + fmt_double(hi) + "]");
        return v;
      };
      constexpr double kMaxCount = 9007199254740992.0;  // 2^53: exact in a double
      saved_scaler.scale = number("loss_scale", 0, std::numeric_limits<double>::max(), false);
      saved_scaler.hysteresis_left = int(number("loss_scale.hysteresis_left", 0, std::numeric_limits<int>::max(), true));
      saved_scaler.iteration = int64_t(number("loss_scale.iteration", 0, kMaxCount, true));
      saved_scaler.last_overflow_iteration = int64_t(number("loss_scale.last_overflow_iteration", -1, kMaxCount, true));
      step = int64_t(number("global_step", 0, kMaxCount, true));
      skipped_steps = int64_t(number("skipped_steps", 0, double(step), true));
      // Absent from checkpoints saved before the option existed: the moments started with the run.
      saved_moments_from = saved.scalars.count("optimizer.moments_from")
                               ? int64_t(number("optimizer.moments_from", 0, double(step - skipped_steps), true))
                               : 0;
      auto it = saved.scalars.find("optimizer");
      if (it == saved.scalars.end()) throw DataError(saved.manifest + ": no 'optimizer' in its scalars");
      if (!options.reset_optimizer && optimizer_family(it->second) != optimizer_family(config.optimizer.type))
        throw DataError(saved.manifest + ": saved with optimizer " + it->second + ", this run uses " +
                        config.optimizer.type + "; its optimizer state does not apply (load with reset_optimizer, "
                        "--reset-optimizer, to load the weights only)");
      // Hyper-parameters may change between runs; each change is reported.
      auto tracked = [](const std::string& key) {
        return key.rfind("optimizer.", 0) == 0 || key.rfind("scheduler.", 0) == 0 || key == "gradient_clipping";
      };
      std::set<std::string> keys;
      for (const auto& [key, value] : saved.configuration) if (tracked(key)) keys.insert(key);
      for (const auto& [key, value] : config.resolved) if (tracked(key)) keys.insert(key);
      for (const std::string& key : keys) {
        const auto before = saved.configuration.find(key);
        const auto after = config.resolved.find(key);
        const std::string old_value = before == saved.configuration.end() ? "(unset)" : before->second;
        const std::string new_value = after == config.resolved.end() ? "(unset)" : after->second;
        if (old_value != new_value) changes.push_back(key + ": " + old_value + " -> " + new_value);
      }
    };
    // The frozen values, whole on every rank, staged as the rest.
    std::vector<CheckpointParameter> frozen_list;
    auto staged_frozen = stage_frozen(&frozen_list);
    for (size_t i = 0; i < staged_frozen.size(); ++i) {
      StateFragment f;
      f.parameter = frozen_list[i].name;
      f.numel = staged_frozen[i].second.numel();
      f.roles["frozen"] = staged_frozen[i].second.view({-1});
      staged.fragments.push_back(std::move(f));
    }
    const LoadedCheckpoint loaded =
        load_sharded_checkpoint(*comm, dir, tag, registered, staged.fragments, check, frozen_list);
    const auto& scalars = loaded.scalars;
    const LossScaler::State s = saved_scaler;
    torch::NoGradGuard no_grad;
    if (parameter_tier) parameter_tier->invalidate();
    optimizer->commit_fragments(staged);
    optimizer->refresh_working_from_masters();  // the working copy of the owned region (16-bit)
    publish_parameters();
    if (options.reset_optimizer) optimizer->zero_moments();
    reducer->clear();
    if (loaded.has_frozen) commit_frozen(staged_frozen);
    global_step = step;
    skipped = skipped_steps;
    moments_from = options.reset_optimizer ? step - skipped_steps : saved_moments_from;
    scaler.restore(s);
    if (rank == 0)
      for (const std::string& line : changes) {
        if (options.log) options.log(line);
        else std::printf("checkpoint: %s\n", line.c_str());
      }
    if (rank == 0 && !options.log) std::fflush(stdout);
    std::map<std::string, std::string> client;
    for (const auto& [key, value] : scalars)
      if (key.rfind("client.", 0) == 0) client[key.substr(7)] = value;
    return client;
  }

  static std::string fmt_double(double v) {
    char text[64];
    std::snprintf(text, sizeof text, "%.17g", v);
    return text;
  }

  ModelStateBytes model_state_bytes() const {
    ModelStateBytes bytes;
    if (shard_parameters)
      bytes.parameters = param_partition.memory_bytes() + gatherer->persistent_bytes() + gatherer->secondary_bytes();
    else bytes.parameters = int64_t(flat_params.nbytes());
    bytes.gradients = reducer->gradient_bytes();
    bytes.optimizer_states = optimizer->memory_bytes();
    return bytes;
  }

  int64_t buffer_bytes() const {
    return reducer->buffer_bytes() + optimizer->buffer_bytes() + (parameter_tier ? parameter_tier->buffer_bytes() : 0);
  }

  OffloadReport offload_report() const {
    OffloadReport r;
    r.nvme_optimizer_bytes = optimizer->disk_bytes();
    r.nvme_parameter_bytes = param_partition.disk_bytes() + optimizer->next_working_disk_bytes();
    r.nvme_gradient_bytes = reducer->disk_bytes();
    r.nvme_planned_bytes = footprint.total();
    r.nvme_load_staging_bytes = footprint.load_staging_optimizer + footprint.load_staging_parameters;
    r.host_buffer_bytes = optimizer->buffer_bytes() + (parameter_tier ? parameter_tier->buffer_bytes() : 0);
    if (io) {
      const io::AioEngine::Stats s = io->stats();
      r.bytes_read = s.bytes_read;
      r.bytes_written = s.bytes_written;
      r.requests = s.requests;
      r.read_seconds = s.read_seconds;
      r.write_seconds = s.write_seconds;
      r.backend = io->backend_name();
    }
    r.stall_seconds = optimizer->io_counters().seconds + (parameter_tier ? parameter_tier->stall_seconds() : 0);
    return r;
  }
};

namespace {
// What the monitor reads of the engine between steps.
EngineStepState monitor_state_of(const Engine::Impl& impl) {
  return {impl.global_step, impl.skipped, impl.layout.parameter_numel};
}
// Where the model computes: its first parameter's or buffer's device (the CPU for an empty model).
c10::Device device_of(const torch::nn::Module& model) {
  for (const auto& p : model.parameters()) return p.device();
  for (const auto& b : model.buffers()) return b.device();
  return c10::Device(c10::kCPU);
}
}  // namespace

Engine::Engine(std::shared_ptr<torch::nn::Module> model, const TrainConfig& config,
               std::shared_ptr<Communicator> comm)
    : Engine(std::move(model), config, std::move(comm), {}) {}
Engine::Engine(std::shared_ptr<torch::nn::Module> model, const TrainConfig& config, std::shared_ptr<Communicator> comm,
               std::vector<ParameterGroup> groups)
    // The monitor first: the comms logger it may attach counts the engine's own collectives.
    : monitor_(std::make_unique<StepMonitor>(config, *comm, device_of(*model))) {
  impl_ = std::make_unique<Impl>(std::move(model), config, std::move(comm), std::move(groups));
  monitor_->arm(monitor_state_of(*impl_));
}
Engine::~Engine() = default;
void Engine::backward(const at::Tensor& loss) {
  // The loss's value only when a report needs it: reading it waits for the device.
  monitor_->before_backward(monitor_->wants_loss() ? loss.detach().item<double>() : std::nan(""));
  {
    RECORD_USER_SCOPE("zerotrain::backward");
    impl_->backward(loss);
  }
  monitor_->after_backward();
}
StepResult Engine::step() {
  monitor_->before_step();
  StepResult result;
  {
    RECORD_USER_SCOPE("zerotrain::step");
    result = impl_->step();
  }
  monitor_->after_step(result, monitor_state_of(*impl_));
  if (result.boundary) monitor_->arm(monitor_state_of(*impl_));
  return result;
}
void Engine::note_forward_start() { monitor_->forward_started(); }
void Engine::note_forward_end() { monitor_->forward_ended(); }
void Engine::set_report_sink(std::function<void(const std::string&)> sink) { monitor_->set_sink(std::move(sink)); }
void Engine::disable_reports() { monitor_->disable(); }
PhaseTimes Engine::phase_times() const { return monitor_->phase_times(); }
const FlopsReport* Engine::flops_report() const { return monitor_->flops_report(); }
std::shared_ptr<CommsLogger> Engine::comms_logger() const { return impl_->comm->comms_logger(); }
std::string Engine::comms_summary() const {
  const auto logger = comms_logger();
  return logger ? logger->table() : std::string();
}
void Engine::apply_pending_update() { impl_->apply_pending_update(); }
bool Engine::next_backward_is_boundary() const { return impl_->boundary_next(); }
int64_t Engine::global_step() const { return impl_->global_step; }
int64_t Engine::skipped_steps() const { return impl_->skipped; }
double Engine::learning_rate() const { return impl_->schedule.lr_at(impl_->global_step - impl_->skipped); }
double Engine::loss_scale() const { return impl_->scaler.scale(); }
void Engine::save_checkpoint(const std::string& dir, const std::string& tag,
                             const std::map<std::string, std::string>& client_state, int keep_last) {
  impl_->save_checkpoint(dir, tag, client_state, keep_last);
}
std::map<std::string, std::string> Engine::load_checkpoint(const std::string& dir, const std::string& tag) {
  return load_checkpoint(dir, tag, LoadOptions{});
}
std::map<std::string, std::string> Engine::load_checkpoint(const std::string& dir, const std::string& tag,
                                                           const LoadOptions& options) {
  auto client = impl_->load_checkpoint(dir, tag, options);
  monitor_->arm(monitor_state_of(*impl_));  // the step count changed: the profiled step may be next
  return client;
}
void Engine::load_weights(WeightReader& reader) { impl_->load_weights(reader); }
at::Tensor Engine::master_parameter(const std::string& name) { return impl_->master_parameter(name); }
void Engine::set_master_parameter(const std::string& name, const at::Tensor& value) {
  impl_->set_master_parameters({{name, value}});
}
void Engine::set_master_parameters(const std::map<std::string, at::Tensor>& values) {
  impl_->set_master_parameters(values);
}
void Engine::hold_blocks(const std::vector<const torch::nn::Module*>& modules) {
  if (impl_->micro_step != 0)
    throw Error("hold_blocks: expected a call between optimizer steps, found micro-step " +
                std::to_string(impl_->micro_step));
  if (impl_->gatherer) impl_->gatherer->hold(modules);
}
void Engine::release_held_blocks() {
  if (impl_->gatherer) impl_->gatherer->release_held();
}
Communicator& Engine::communicator() const { return *impl_->comm; }
const TrainConfig& Engine::config() const { return impl_->config; }
ModelStateBytes Engine::model_state_bytes() const { return impl_->model_state_bytes(); }
int64_t Engine::buffer_bytes() const { return impl_->buffer_bytes(); }
int64_t Engine::trainable_parameters() const { return impl_->layout.parameter_numel; }
const FlatLayout& Engine::layout() const { return impl_->layout; }
int64_t Engine::peak_gathered_parameter_bytes() const { return impl_->gatherer ? impl_->gatherer->peak_gathered_bytes() : 0; }
int64_t Engine::prefetched_blocks() const { return impl_->gatherer ? impl_->gatherer->prefetched_blocks() : 0; }
int64_t Engine::block_gathers() const { return impl_->gatherer ? impl_->gatherer->block_gathers() : 0; }
int64_t Engine::secondary_block_gathers() const {
  return impl_->gatherer ? impl_->gatherer->secondary_gathers() : 0;
}
const NodeGroups& Engine::node_groups() const { return impl_->node_groups; }
OffloadReport Engine::offload_report() const { return impl_->offload_report(); }
void Engine::reset_peak_gathered_parameter_bytes() {
  if (impl_->gatherer) impl_->gatherer->reset_peak_gathered_bytes();
}

}  // namespace zt
