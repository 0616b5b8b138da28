#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <numeric>
#include <optional>
#include <regex>
#include <string_view>
#include <unordered_map>
#include <unordered_set>

#include "zero/block_runner.h"
#include "zero/engine_impl.h"
#include "zerotrain/zero/blocks.h"
#include "zerotrain/error.h"
#include "zerotrain/memory/memory.h"

// The engine's construction (docs/architecture.md "zero"): the trainable parameters and stage 3's
// blocks, the layout, the parts in the order the memory needs them, and rank 0's initial values.

namespace zt {
namespace {
// The most elements of rank 0's initial values a rank holds at once beside the model as built
// (replicated parameters; src/memory/estimate.cpp counts it as kInitialValuesChunkElements).
constexpr int64_t kInitialValuesChunk = int64_t{1} << 20;

}  // namespace

// Construction in the order memory needs: the layout from the parameters as built, the long-lived
// arenas before the transients of taking the initial values, the gradients after them.
void Engine::Impl::build() {
  std::vector<PendingBlock> pending;
  std::vector<torch::Tensor> trainable = collect_trainable(pending);

  // The parts, long-lived arenas first (so that the transients of adopt_initial_values leave no
  // holes beneath them): working parameters and optimizer state; the gradients follow it.
  const SwapDirectories directories = plan_offload();
  create_arenas(directories);
  torch::NoGradGuard no_grad;
  adopt_initial_values(trainable, pending);

  // The gradient arenas come after the initial values are in place: a model built sharded
  // holds its shards until then, and the two never need to coexist.
  create_reducer(directories);

  // Frozen parameters follow the working dtype so that the model's operations see one dtype; they
  // get no gradient or optimizer memory. Buffers follow DeepSpeed's rule (config.h buffer_dtype).
  if (separate_master) {
    for (auto& p : model->parameters(true))
      if (!p.requires_grad() && p.is_floating_point()) p.set_data(p.detach().to(working_dtype));
  }
  if (working_dtype != at::kFloat) cast_buffers();

  install_hooks(trainable);
}

void Engine::Impl::cast_buffers() {
  std::optional<at::ScalarType> wanted;
  if (config.buffer_dtype == "fp32") wanted = at::kFloat;
  if (config.buffer_dtype == "fp16") wanted = at::kHalf;
  if (config.buffer_dtype == "bf16") wanted = at::kBFloat16;
  std::string alternation;
  for (const std::string& pattern : config.keep_in_fp32_buffers) {
    std::string expression;
    for (char ch : pattern) {  // '*' is any characters; everything else is itself
      if (ch == '*') expression += ".*";
      else if (std::string_view("\\^$.|?+()[]{}").find(ch) != std::string_view::npos) (expression += '\\') += ch;
      else expression += ch;
    }
    alternation += (alternation.empty() ? "" : "|") + expression;
  }
  const std::optional<std::regex> keep = alternation.empty() ? std::nullopt : std::optional<std::regex>(alternation);
  for (auto& named : model->named_buffers(/*recurse=*/true)) {
    torch::Tensor& buffer = named.value();
    if (!buffer.defined() || !buffer.is_floating_point()) continue;
    if (keep && std::regex_search(named.key(), *keep)) {
      if (buffer.scalar_type() != at::kFloat) buffer.set_data(buffer.to(at::kFloat));
    } else if (wanted && buffer.scalar_type() != *wanted) {
      buffer.set_data(buffer.to(*wanted));
    }
  }
}

// The model's trainable parameters, checked, in the layout's order (stage 3: by block), with the
// devices planned and the layout computed; `pending` gets the blocks built under
// ShardedConstruction.
std::vector<torch::Tensor> Engine::Impl::collect_trainable(std::vector<PendingBlock>& pending) {
  // The parameters of another live stage-3 engine's blocks have no data between its gathers.
  for (const auto& item : model->named_modules("model", /*include_self=*/true))
    if (has_block_runner(*item.value()))
      throw Error("engine: block '" + item.key() +
                  "' belongs to another stage-3 engine that is alive; one engine per model at a time");
  pending = adopt_sharded_blocks();
  // A parameter built sharded has no data yet; it belongs on its ShardedConstruction's device.
  std::unordered_map<const void*, c10::Device> built_sharded;
  for (const PendingBlock& b : pending)
    for (const auto& p : b.shards.parameters) built_sharded.emplace(p.unsafeGetTensorImpl(), b.shards.device);
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
    const auto sharded_for = built_sharded.find(p.unsafeGetTensorImpl());
    const c10::Device device = sharded_for != built_sharded.end() ? sharded_for->second : p.device();
    if (!model_device) {
      model_device = device;
      first_name = named.key();
    } else if (device != *model_device) {
      throw ConfigError("engine: expected every trainable parameter on one device, found '" + first_name + "' on " +
                        model_device->str() + " and '" + named.key() + "' on " + device.str() +
                        (sharded_for != built_sharded.end() ? " (its block was built under a ShardedConstruction for " +
                                                                  device.str() + ")"
                                                            : std::string()));
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
  const std::unordered_map<std::string, TensorSplit> split_names = find_tensor_group(trainable, specs);
  devices = plan_devices(*model_device, config.zero, host_staging_forced_by_environment());
  devices.emulate_copy_engine =
      devices.stage_through_host && devices.compute.is_cpu() && copy_engine_emulated_by_environment();
  if (rank == 0 && (!devices.compute.is_cpu() || devices.stage_through_host))
    std::fprintf(stderr, "zerotrain: engine: %s\n", devices.describe().c_str());
  for (const auto& spec : specs) registered.push_back({spec.name, spec.shape});
  checkpointed = checkpoint_parameters(registered, split_names);
  if (shard_parameters) assign_blocks(trainable, specs, owners, owner_modules);
  LayoutOptions options;
  options.world_size = shard_world;
  options.bucket_size = std::max<int64_t>(1, config.zero.reduce_bucket_size);
  layout = compute_layout(specs, options);
  this->specs = specs;
  // tensor_parallel.autotp_size names the split the model must have been built with; a model
  // built split needs no key (the marks give its group).
  if (config.tensor_parallel > 1 && (!tensor_group || tensor_group->world_size() != config.tensor_parallel))
    throw ConfigError("tensor_parallel.autotp_size: expected a model split over tensor groups of " +
                      std::to_string(config.tensor_parallel) + " ranks (zt::mark_tensor_split), found " +
                      (tensor_group ? "groups of " + std::to_string(tensor_group->world_size())
                                    : std::string("no tensor-parallel parameter (build the model with a tensor group)")));
  if (tensor_group) {
    tensor_split.assign(layout.placements.size(), 0);
    for (size_t i = 0; i < layout.placements.size(); ++i)
      tensor_split[i] = split_names.count(specs[size_t(layout.placements[i].index)].name) ? 1 : 0;
    check_tensor_group();
  }
  return trainable;
}

// What checkpoints name: a split parameter with its whole shape and this rank's slice of it.
std::vector<CheckpointParameter> Engine::Impl::checkpoint_parameters(
    const std::vector<CheckpointParameter>& parameters, const std::unordered_map<std::string, TensorSplit>& splits) {
  std::vector<CheckpointParameter> named = parameters;
  for (CheckpointParameter& p : named)
    if (auto split = splits.find(p.name); split != splits.end()) {
      const TensorSplit& s = split->second;
      p.shape[size_t(s.dim)] *= s.group->world_size();
      p.split = {s.dim, s.parts, s.group->world_size(), s.group->rank()};
    }
  return named;
}

// The tensor group the model's split parameters name (zerotrain/zero/blocks.h), if any, and their
// names; every split parameter must name the same group.
std::unordered_map<std::string, TensorSplit> Engine::Impl::find_tensor_group(const std::vector<torch::Tensor>& trainable,
                                                                             const std::vector<ParameterSpec>& specs) {
  std::unordered_map<std::string, TensorSplit> names;
  std::string first;
  for (size_t i = 0; i < trainable.size(); ++i) {
    const std::optional<TensorSplit> split = tensor_split_of(trainable[i]);
    if (!split) continue;
    if (!tensor_group) {
      tensor_group = split->group;
      first = specs[i].name;
    } else if (split->group != tensor_group) {
      throw ConfigError("engine: expected every tensor-parallel parameter to name one tensor group, found '" + first +
                        "' split over one group and '" + specs[i].name + "' over another");
    }
    names.emplace(specs[i].name, *split);
  }
  return names;
}

// The engine's ranks must hold the same slices (one tensor rank, a data-parallel group): the
// communicator of the whole grid would average different slices into each other. One collective.
void Engine::Impl::check_tensor_group() {
  if (tensor_group.get() == comm.get())
    throw ConfigError("engine: the communicator is the tensor group itself; expected the data-parallel group (the "
                      "ranks that hold the same slices, e.g. comm->split(rank % T, \"data\"))");
  if (config.optimizer.type == "Lamb" && config.zero.offload_optimizer.delayed_update && tensor_group->world_size() > 1)
    throw ConfigError("offload_optimizer.delayed_update: expected Adam or SGD with tensor parallelism (LAMB's "
                      "per-tensor norms need an all-reduce over the tensor group inside the step, which the delayed "
                      "update runs off the training thread), found Lamb");
  torch::Tensor ranks = torch::tensor({double(tensor_group->rank()), -double(tensor_group->rank())}, torch::kFloat64);
  comm->all_reduce(ranks, ReduceOp::Max, "engine.tensor_ranks").wait();
  const int highest = int(ranks[0].item<double>()), lowest = int(-ranks[1].item<double>());
  if (highest != lowest)
    throw ConfigError("engine: expected the communicator's ranks to hold the same tensor-parallel slices (one tensor "
                      "rank), found tensor ranks " + std::to_string(lowest) + " to " + std::to_string(highest) +
                      "; pass the data-parallel group, e.g. comm->split(rank % T, \"data\")");
  // A checkpoint counts the grid's ranks as data rank × T + tensor rank: a tensor group's ranks
  // share their data rank (zt::make_process_grid's groups do).
  torch::Tensor data_ranks = torch::tensor({double(rank), -double(rank)}, torch::kFloat64);
  tensor_group->all_reduce(data_ranks, ReduceOp::Max, "engine.data_ranks").wait();
  if (int(data_ranks[0].item<double>()) != -int(data_ranks[1].item<double>()))
    throw ConfigError("engine: expected the ranks of a tensor group to have one data-parallel rank each, found data "
                      "ranks " + std::to_string(-int(data_ranks[1].item<double>())) + " to " +
                      std::to_string(int(data_ranks[0].item<double>())) +
                      " in one tensor group (build the groups with zt::make_process_grid)");
}

// The working parameters (the flat buffer, or this rank's partition and its tier) and the
// optimizer partition, on the tiers the offload plan chose.
void Engine::Impl::create_arenas(const SwapDirectories& directories) {
  auto working = torch::TensorOptions().dtype(working_dtype).device(devices.compute);
  if (shard_parameters) {
    // Parameter offload with the model on a GPU: the partition stays on the host and each block's
    // shards cross to the device at its gather.
    const c10::Device home = devices.parameters_on_host ? c10::Device(c10::kCPU) : devices.compute;
    if (offload.parameters_on_disk.empty())
      param_partition =
          TieredArray("params", working_dtype, layout.partition_numel, home, devices.pin_parameters);
    else
      param_partition = TieredArray("params", working_dtype, offload.groups, offload.parameters_on_disk, *io,
                                    directories.parameters->file("params"), devices.pin_parameters);
    std::optional<ParameterTier::Crossing> crossing;
    if (devices.parameters_on_host)
      crossing = ParameterTier::Crossing{devices.compute, config.zero.offload_param.buffer_count, devices.pin_parameters};
    parameter_tier = std::make_unique<ParameterTier>(layout, param_partition, offload.groups, io.get(),
                                                     config.zero.offload_param.buffer_count, crossing);
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
  optimizer_options.tensor_group = tensor_group.get();
  optimizer_options.tensor_split = tensor_split;
  assign_parameter_groups(optimizer_options);
  if (io) {
    optimizer_options.tiers.groups = offload.groups;
    optimizer_options.tiers.on_disk = offload.optimizer_on_disk;
    optimizer_options.tiers.io = io.get();
    if (directories.optimizer) optimizer_options.tiers.directory = directories.optimizer->path();
    optimizer_options.tiers.buffer_count = config.zero.offload_optimizer.buffer_count;
    optimizer_options.tiers.pipeline_read = config.zero.offload_optimizer.pipeline_read;
    optimizer_options.tiers.pipeline_write = config.zero.offload_optimizer.pipeline_write;
    optimizer_options.tiers.gradients_on_disk = offload.gradients_on_disk;
  }
  OptimizerPartition::Working optimizer_working;
  if (shard_parameters) optimizer_working.partition = &param_partition;
  else optimizer_working.flat = flat_params;
  optimizer = std::make_unique<OptimizerPartition>(layout, optimizer_options, *comm, optimizer_working);
  if (shard_parameters)
    gatherer = std::make_unique<ParameterGatherer>(layout, std::move(planned_blocks), config.zero, working_dtype,
                                                   devices.compute, *comm, *parameter_tier, secondary_group());
}

// Replicated parameters (stages 0-2): rank 0's values reach every rank in pieces of at most
// chunk_limit elements (fp32 parameters: in place, a bucket at a time), and each
// parameter moves into the flat buffer as soon as its last element is copied, freeing its own
// storage. So construction holds the rest of the model as built plus one chunk beside the
// arenas, never the whole model beside a bucket-sized fp32 copy of it: with one 500M-element
// bucket (the default) on GPT-2 124M in bf16 that copy was the peak of the run
// (docs/memory.md "The peak: two moments").
template <class BeforeCopy>
void Engine::Impl::adopt_replicated_initial_values(std::vector<torch::Tensor>& trainable,
                                                   const torch::TensorOptions& fp32, int64_t chunk_limit,
                                                   BeforeCopy&& before_copy) {
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

// Rank 0's initial values, in fp32, for everyone: the master weights are set from them before
// anything is rounded to the working dtype.
void Engine::Impl::adopt_initial_values(std::vector<torch::Tensor>& trainable, std::vector<PendingBlock>& pending) {
  auto fp32 = torch::TensorOptions().dtype(torch::kFloat32).device(devices.compute);
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
  const bool masters_on_disk = offload.optimizer_elements_on_disk > 0;
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
}

// The gradient memory and its reduction, as the configuration's sharding switches choose it.
void Engine::Impl::create_reducer(const SwapDirectories& directories) {
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
  reducer_options.tensor_split = tensor_split;
  // DeepSpeed's averaging keys: prescale divides by the world size before the sum, else by the
  // predivide factor before and by world / factor after (docs/zero.md "Gradient averaging").
  reducer_options.pre_divide =
      config.averaging.prescale_gradients ? double(world) : config.averaging.gradient_predivide_factor;
  if (!offload.gradients_on_disk.empty())
    reducer_options.disk = GradientReducer::Options::Disk{offload.groups, offload.gradients_on_disk, io.get(),
                                                          directories.optimizer->file("grads")};
  reducer = std::make_unique<GradientReducer>(layout, reducer_options, *comm);
  if (optimizer->takes_early_gradients())
    reducer->set_on_final([this](int bucket) { optimizer->gradient_final(bucket, *reducer); });
}

// The optimizer's parameter groups (Engine's ParameterGroup): group i + 1 of the partition is
// parameter_groups[i]; every parameter no group names is in group 0, the configuration's.
void Engine::Impl::assign_parameter_groups(OptimizerPartition::Options& options) {
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

// Stage 3: the marked modules of the model; each trainable parameter under one belongs to it.
// Nesting or sharing between blocks is refused.
void Engine::Impl::find_marked_modules(
    std::unordered_map<const void*, int>& owner_of,
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

// Stage 3: the blocks and the layout's order by the layout's rule (assign_stage3_blocks,
// zerotrain/layout/layout.h), which the memory estimate applies to the reference GPT too; a block's
// persistent bucket completes during that block's backward.
void Engine::Impl::assign_blocks(
    std::vector<torch::Tensor>& trainable, std::vector<ParameterSpec>& specs, const std::vector<int>& owners,
    const std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>>& modules) {
  const Stage3Blocks blocks = assign_stage3_blocks(specs, owners, config.zero.stage3_param_persistence_threshold);
  for (int module : blocks.module_of_block)
    planned_blocks.push_back({modules[size_t(module)].first, modules[size_t(module)].second});
  const std::vector<size_t>& order = blocks.order;
  std::vector<torch::Tensor> sorted_trainable;
  std::vector<ParameterSpec> sorted_specs;
  for (size_t i : order) {
    sorted_trainable.push_back(trainable[i]);
    sorted_specs.push_back(specs[i]);
  }
  trainable = std::move(sorted_trainable);
  specs = std::move(sorted_specs);
}

// Takes the blocks built under a ShardedConstruction (zerotrain/zero/blocks.h), which hold only this
// rank's shard until materialize() gathers them.
std::vector<Engine::Impl::PendingBlock> Engine::Impl::adopt_sharded_blocks() {
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
void Engine::Impl::materialize(PendingBlock& pending, const std::unordered_set<const void*>& moved) {
  if (pending.materialized) return;
  ShardedBlock& s = pending.shards;
  // Gathered in host memory, where the shards are; the engine's arenas copy what it adopts to the
  // compute device, and the rest moves there on its own.
  torch::Tensor full = torch::empty({s.shard.numel() * world}, s.shard.options());
  comm->all_gather(s.shard, full, "engine.init.block." + pending.name).wait();
  int64_t offset = 0;
  for (torch::Tensor& p : s.parameters) {
    torch::Tensor view = full.narrow(0, offset, p.numel()).view(p.sizes());
    p.set_data(moved.count(p.unsafeGetTensorImpl()) ? view
                                                    : view.to(devices.compute, /*non_blocking=*/false, /*copy=*/true));
    offset += p.numel();
  }
  s = ShardedBlock();
  pending.materialized = true;
}

// The stage-3 secondary partition's group (hpZ, docs/zero.md "hpZ"): zero_hpz_partition_size
// consecutive ranks, as DeepSpeed forms them, which with ranks placed node by node and a size
// dividing the ranks per node lie within one node. Null without a secondary partition.
std::shared_ptr<Communicator> Engine::Impl::secondary_group() {
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

}  // namespace zt
