#include "zerotrain/engine.h"

#include <c10/core/CPUAllocator.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>

#include <atomic>
#include <cctype>
#include <cmath>
#include <limits>
#include <cstdio>
#include <numeric>
#include <set>
#include <unordered_set>

#include "checkpoint/checkpoint.h"
#include "common/check.h"
#include "optim/cpu_kernels.h"
#include "zerotrain/blocks.h"
#include "zero/loss_scaler.h"
#include "zero/sharded_blocks.h"
#include "zerotrain/comm.h"
#include "zerotrain/config.h"
#include "zerotrain/error.h"
#include "zerotrain/layout.h"
#include "zerotrain/lr_schedule.h"

// The engine for stages 0, 1 and 2 (design §3 item 5, §4). What a stage means is decided once,
// in the constructor, from the configuration's switches (shard optimizer states, shard
// gradients); nothing below asks for a stage number. Data flow and memory: docs/zero.md.
//
//   working parameters  flat_params    working dtype, whole flat buffer (every rank)
//   gradients           flat_grads     working dtype, whole flat buffer   (gradients not sharded)
//                       grad_partition working dtype, this rank's shards   (gradients sharded)
//   master weights      master         fp32, this rank's partition        (16-bit working dtype only;
//                                      in fp32 the working parameters are the master weights)
//   optimizer moments   exp_avg/_sq    fp32, this rank's partition
//
// Without optimizer-state sharding the layout is computed for a world of one, so "this rank's
// partition" is the whole buffer and the same code serves stage 0.
//
// With sharded parameters (stage 3) the working parameters are the owned partition
// `param_partition`; each bucket has a full-size tensor `bucket_params[b]` whose storage exists
// only while its block is gathered (docs/zero.md "Stage 3").

namespace zt {
namespace {

// Chunk of 16-bit gradients converted to fp32 before one kernel call; bounds the scratch buffer.
constexpr int64_t kConversionChunk = 1 << 20;

torch::ScalarType working_dtype_of(Precision precision) {
  switch (precision) {
    case Precision::BF16: return torch::kBFloat16;
    case Precision::FP16: return torch::kHalf;
    case Precision::FP32: break;
  }
  return torch::kFloat32;
}

// How gradients travel; chosen once from the switches.
enum class GradientReduction {
  AllReduce,             // optimizer states not sharded: every rank gets the whole sum
  ReduceScatterInPlace,  // optimizer states sharded: the owned shard of the full gradient buffer
  ReduceScatterBuckets,  // gradients sharded too: bucket buffers reduced into the owned partition
};

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

struct Slot {
  torch::Tensor param;
  int bucket = 0;
  int64_t offset = 0;  // in the flat buffer
  int64_t numel = 0;
  torch::Tensor bucket_grad_view[2];  // ReduceScatterBuckets: the gradient's place in each bucket buffer (1 or 2)
};

enum class BucketState { Idle, Filling, InFlight };

// A piece of this rank's partition that one optimizer kernel call updates: contiguous in the flat
// buffer and in the partition; at most kConversionChunk elements in 16-bit training.
struct OptimizerChunk {
  int64_t flat_offset = 0, partition_offset = 0, numel = 0;
  std::vector<int64_t> bounds{0};  // LAMB: piece boundaries relative to the chunk
  std::vector<int> placements;     // LAMB: the placement of each piece, -1 for padding
};

struct BucketBuffer {  // ReduceScatterBuckets only
  torch::Tensor data;     // largest bucket, working dtype
  torch::Tensor scratch;  // largest shard: receives a reduction that must be added, not written
  int bucket = -1;
  bool add_into_partition = false;
  CollectiveHandle handle;
};

struct BucketProgress {
  int remaining = 0;      // gradients of this bucket still to arrive in this backward
  BucketState state = BucketState::Idle;
  int buffer = -1;
  bool received = false;  // its owned partition slice holds a reduction of this window
  std::optional<CollectiveHandle> handle;  // AllReduce / ReduceScatterInPlace
};

// What the engine leaves in autograd graphs and gradient hooks, which may outlive it: the engine
// clears `impl` in its destructor, so that a backward that runs afterwards finds out instead of
// using freed memory.
struct Liveness : torch::CustomClassHolder {
  std::atomic<Engine::Impl*> impl{nullptr};
};

// Identity on a block's output whose backward gathers the block's parameters again before the
// block's own backward runs (design §10: it fires before the block's parameter gradients).
struct Regather : public torch::autograd::Function<Regather> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& y,
                               const c10::intrusive_ptr<Liveness>& engine, const std::string& name, int64_t block,
                               int64_t position) {
    ctx->saved_data["engine"] = c10::IValue::make_capsule(engine);
    ctx->saved_data["name"] = name;
    ctx->saved_data["block"] = block;
    ctx->saved_data["position"] = position;
    return y.view_as(y);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads);
};

// Memory for gathered blocks (stage 3). A released block's buffer is kept for the next gather
// of the same size instead of being freed, so that gathering does not page-fault fresh memory
// every time; what is live plus what is kept stays within `limit` (twice the largest block, which
// holds the largest block plus two others), older kept buffers being freed first. docs/zero.md
// "Stage 3".
class GatherPool {
 public:
  explicit GatherPool(int64_t limit = 0) : limit_(limit) {}
  c10::DataPtr take(int64_t bytes) {
    for (auto it = kept_.begin(); it != kept_.end(); ++it)
      if (it->second == bytes) {
        c10::DataPtr data = std::move(it->first);
        kept_.erase(it);
        kept_bytes_ -= bytes;
        live_bytes_ += bytes;
        return data;
      }
    while (!kept_.empty() && live_bytes_ + kept_bytes_ + bytes > limit_) {
      kept_bytes_ -= kept_.front().second;
      kept_.erase(kept_.begin());
    }
    live_bytes_ += bytes;
    return c10::GetCPUAllocator()->allocate(size_t(bytes));
  }
  void give(c10::DataPtr data, int64_t bytes) {
    live_bytes_ -= bytes;
    if (live_bytes_ + kept_bytes_ + bytes > limit_) return;  // freed here
    kept_.emplace_back(std::move(data), bytes);
    kept_bytes_ += bytes;
  }
  // Counts a buffer allocated elsewhere as live, so that it can be given back.
  void adopt_live(int64_t bytes) { live_bytes_ += bytes; }

 private:
  int64_t limit_ = 0, live_bytes_ = 0, kept_bytes_ = 0;
  std::vector<std::pair<c10::DataPtr, int64_t>> kept_;  // oldest first
};

}  // namespace

struct Engine::Impl : BlockRunner {
  c10::intrusive_ptr<Liveness> liveness = c10::make_intrusive<Liveness>();
  std::shared_ptr<torch::nn::Module> model;
  TrainConfig config;
  std::shared_ptr<Communicator> comm;
  LrSchedule schedule;
  LossScaler scaler;
  enum class OptimizerKind { Adam, Lamb, Sgd } kind = OptimizerKind::Adam;
  optim::AdamHyperparameters adam;
  optim::LambHyperparameters lamb;
  optim::SgdHyperparameters sgd;

  // Composition, fixed at construction.
  GradientReduction reduction = GradientReduction::AllReduce;
  bool shard_parameters = false;
  torch::ScalarType working_dtype = torch::kFloat32;
  bool separate_master = false;  // 16-bit working parameters
  int world = 1, rank = 0;
  int shard_world = 1, shard_rank = 0;

  FlatLayout layout;
  std::vector<ParameterSpec> specs;      // what the layout was computed from (names, shapes)
  std::vector<CheckpointParameter> registered;  // trainable parameters in registration order
  std::vector<OptimizerChunk> chunks;   // this rank's partition, in partition order
  std::vector<Slot> slots;               // in placement order
  std::vector<std::shared_ptr<torch::autograd::Node>> grad_accumulators;  // keep hooks alive
  torch::Tensor flat_params, flat_grads, grad_partition, master, exp_avg, exp_avg_sq, grad_scratch;
  BucketBuffer buffers[2];
  int64_t largest_shard = 0;             // ReduceScatterBuckets: the largest bucket shard
  int buffer_count = 0;
  int next_buffer = 0;
  std::vector<BucketProgress> progress;

  // Sharded parameters (stage 3).
  enum class Residence { Released, Gathering, Gathered };
  struct BlockState {
    std::string name;
    std::vector<int> buckets;
    int trainable = 0;      // trainable parameters in the block
    int remaining = 0;      // their gradients still to come in this backward
    Residence residence = Residence::Released;
    std::vector<CollectiveHandle> gathering;  // while Gathering
    int64_t bytes = 0;      // full size of its buckets in the working dtype
    int64_t numel = 0;
  };
  torch::Tensor param_partition;
  std::vector<torch::Tensor> bucket_params;
  GatherPool gather_pool;
  std::vector<BlockState> blocks;
  std::vector<std::shared_ptr<torch::nn::Module>> block_modules;  // block id -> its module
  int64_t gathered_bytes = 0, peak_gathered_bytes = 0;
  int64_t prefetched = 0;            // gathers launched ahead of their block's use
  // Block order: recorded (and checked across ranks) until the first backward, then used to
  // prefetch. docs/zero.md "Stage 3".
  std::vector<int> recorded_order;
  bool order_known = false;
  int64_t forward_position = 0;

  int64_t micro_step = 0;   // micro-steps done in the current accumulation window
  int64_t global_step = 0;  // optimizer steps taken
  int64_t skipped = 0;
  // Applied optimizer steps before the moments last started from zero (a load with
  // reset_optimizer): the optimizer's own step count, for bias correction, is counted from there.
  int64_t moments_from = 0;
  bool in_backward = false;
  bool reducing = false;    // this window's reductions are launched (from the hooks, or after backward)

  Impl(std::shared_ptr<torch::nn::Module> m, const TrainConfig& c, std::shared_ptr<Communicator> cm)
      : model(std::move(m)), config(c), comm(std::move(cm)), schedule(c.scheduler, c.optimizer.lr),
        scaler(c.fp16) {
    const OptimizerConfig& o = c.optimizer;
    kind = o.type == "Lamb" ? OptimizerKind::Lamb : o.type == "SGD" ? OptimizerKind::Sgd : OptimizerKind::Adam;
    adam = {o.lr, o.beta1, o.beta2, o.eps, o.weight_decay, o.adam_w_mode, o.bias_correction};
    lamb = {o.lr, o.beta1, o.beta2, o.eps, o.weight_decay, o.bias_correction, o.min_coeff, o.max_coeff};
    sgd = {o.lr, o.momentum, o.dampening, o.weight_decay, o.nesterov};
    shard_parameters = c.zero.shard_parameters;
    world = comm->world_size();
    rank = comm->rank();
    working_dtype = working_dtype_of(c.precision);
    separate_master = working_dtype != torch::kFloat32;
    if (c.zero.shard_optimizer_states) {
      shard_world = world;
      shard_rank = rank;
    }
    reduction = c.zero.shard_gradients          ? GradientReduction::ReduceScatterBuckets
                : c.zero.shard_optimizer_states ? GradientReduction::ReduceScatterInPlace
                                                : GradientReduction::AllReduce;
    build();
    if (shard_parameters) install_block_runner(this, block_modules);
    liveness->impl = this;
  }

  ~Impl() override {
    liveness->impl = nullptr;
    if (shard_parameters) remove_block_runner(this);
  }

  // ---------------------------------------------------------------- construction
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
    for (auto& named : model->named_parameters(/*recurse=*/true)) {
      const torch::Tensor& p = named.value();
      if (!p.requires_grad()) continue;
      if (p.scalar_type() != torch::kFloat32 || !p.device().is_cpu())
        throw ConfigError("engine: expected fp32 CPU parameters (the engine makes the working copy), found " +
                          std::string(c10::toString(p.scalar_type())) + " on " + p.device().str() + " for '" +
                          named.key() + "'");
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
    for (const auto& spec : specs) registered.push_back({spec.name, spec.shape});
    if (shard_parameters) assign_blocks(trainable, specs, owners, owner_modules);
    LayoutOptions options;
    options.world_size = shard_world;
    options.bucket_size = std::max<int64_t>(1, config.zero.reduce_bucket_size);
    layout = compute_layout(specs, options);
    this->specs = specs;
    plan_optimizer_chunks(layout.owned_fragments(shard_rank));

    // Rank 0's initial values, in fp32, for everyone: the master weights are set from them before
    // anything is rounded to the working dtype. Bucket by bucket, so that with sharded
    // parameters construction holds at most the model as given plus one bucket (a model built
    // under ShardedConstruction: its shards plus about one block): each parameter moves into its
    // bucket (its own storage is freed) and a block's bucket is released at once.
    auto fp32 = torch::TensorOptions().dtype(torch::kFloat32);
    torch::NoGradGuard no_grad;
    const int64_t partition = layout.partition_numel;
    if (separate_master) {
      master = torch::empty({partition}, fp32);
      grad_scratch = torch::empty({std::min<int64_t>(partition, kConversionChunk)}, fp32);
    }
    if (shard_parameters)
      param_partition = torch::empty({partition}, torch::TensorOptions().dtype(working_dtype));
    else
      flat_params = torch::zeros({layout.total_numel}, torch::TensorOptions().dtype(working_dtype));
    // The long-lived arenas come first, so that the transients of the loop below leave no holes
    // beneath them (with the heap retained, such holes would count in the peak for good).
    const bool first_moment = kind != OptimizerKind::Sgd || sgd.momentum != 0.0;
    exp_avg = torch::zeros({first_moment ? partition : 0}, fp32);
    exp_avg_sq = torch::zeros({kind == OptimizerKind::Sgd ? 0 : partition}, fp32);

    auto working = torch::TensorOptions().dtype(working_dtype);
    if (reduction == GradientReduction::ReduceScatterBuckets) {
      grad_partition = torch::zeros({partition}, working);
      int64_t largest = 0;
      for (const auto& b : layout.buckets) {
        largest = std::max(largest, b.numel);
        largest_shard = std::max(largest_shard, b.shard_numel);
      }
      // The scratch receives the reductions of later micro-steps of a window, which are added;
      // without gradient accumulation there are none (unless a bucket is refilled by a gradient
      // that came after it was launched; then launch() allocates it).
      const int64_t scratch = config.gradient_accumulation_steps > 1 ? largest_shard : 0;
      // Two buffers let one fill while the other is in flight; without overlap_comm a bucket's
      // reduction completes before the next bucket starts, so one is enough.
      buffer_count = config.zero.overlap_comm ? 2 : 1;
      for (int k = 0; k < buffer_count; ++k) {
        buffers[k].data = torch::zeros({largest}, working);
        buffers[k].scratch = torch::empty({scratch}, working);
      }
    } else {
      flat_grads = torch::zeros({layout.total_numel}, working);
    }
    if (shard_parameters) {
      for (int b = 0; b < int(layout.buckets.size()); ++b)
        if (const BucketLayout& lb = layout.buckets[b]; lb.group >= 0) {
          blocks[lb.group].buckets.push_back(b);
          blocks[lb.group].bytes += lb.numel * int64_t(c10::elementSize(working_dtype));
          blocks[lb.group].numel += lb.numel;
        }
      int64_t largest = 0;
      for (const BlockState& state : blocks) largest = std::max(largest, state.bytes);
      gather_pool = GatherPool(2 * largest);
    }
    // A block built sharded is gathered whole just before its first bucket: with sharded
    // parameters construction then holds the shards plus about one block at a time.
    std::unordered_map<const void*, int> pending_of;
    for (int k = 0; k < int(pending.size()); ++k)
      for (const auto& p : pending[k].shards.parameters) pending_of[p.unsafeGetTensorImpl()] = k;
    std::unordered_set<const void*> moved;
    for (const auto& p : trainable) moved.insert(p.unsafeGetTensorImpl());
    for (int b = 0; b < int(layout.buckets.size()); ++b) {
      const BucketLayout& lb = layout.buckets[b];
      for (int pi = lb.first_placement; pi < lb.end_placement; ++pi)
        if (auto k = pending_of.find(trainable[layout.placements[pi].index].unsafeGetTensorImpl()); k != pending_of.end())
          materialize(pending[k->second], moved);
      // fp32 replicated parameters receive the values in place; otherwise a bucket-sized fp32 copy.
      const bool in_place = !shard_parameters && !separate_master;
      torch::Tensor initial = in_place ? flat_params.narrow(0, lb.offset, lb.numel) : torch::zeros({lb.numel}, fp32);
      for (int pi = lb.first_placement; pi < lb.end_placement; ++pi) {
        const ParameterPlacement& placement = layout.placements[pi];
        initial.narrow(0, placement.offset - lb.offset, placement.numel)
            .copy_(trainable[placement.index].detach().reshape({-1}));
      }
      comm->broadcast(initial, 0, "engine.init.params").wait();
      const torch::Tensor owned = initial.narrow(0, int64_t(shard_rank) * lb.shard_numel, lb.shard_numel);
      if (separate_master) master.narrow(0, lb.partition_offset, lb.shard_numel).copy_(owned);
      if (!shard_parameters) {
        if (!in_place) flat_params.narrow(0, lb.offset, lb.numel).copy_(initial);
        continue;
      }
      param_partition.narrow(0, lb.partition_offset, lb.shard_numel).copy_(owned);
      // An own storage per bucket, so that releasing one block frees exactly its bytes.
      bucket_params.push_back(separate_master ? initial.to(working_dtype) : initial);
      for (int pi = lb.first_placement; pi < lb.end_placement; ++pi) {
        const ParameterPlacement& placement = layout.placements[pi];
        torch::Tensor& param = trainable[placement.index];
        param.set_data(bucket_params[b].narrow(0, placement.offset - lb.offset, placement.numel).view(param.sizes()));
      }
      if (lb.group >= 0) {
        // Released from the start: from here on this rank holds only its shards of the block.
        gather_pool.adopt_live(int64_t(bucket_params[b].nbytes()));
        release_storage(b);
      }
    }
    for (PendingBlock& p : pending) materialize(p, moved);  // blocks without trainable parameters
    progress.resize(layout.buckets.size());

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
      Slot slot;
      slot.param = trainable[placement.index];
      slot.bucket = placement.bucket;
      slot.offset = placement.offset;
      slot.numel = placement.numel;
      auto shape = slot.param.sizes();
      // set_data keeps the parameter's autograd identity (and version counter) intact.
      const int64_t in_bucket = slot.offset - layout.buckets[slot.bucket].offset;
      // (With sharded parameters this was done bucket by bucket above.)
      if (!shard_parameters) slot.param.set_data(flat_params.narrow(0, slot.offset, slot.numel).view(shape));
      if (reduction == GradientReduction::ReduceScatterBuckets) {
        for (int k = 0; k < buffer_count; ++k)
          slot.bucket_grad_view[k] = buffers[k].data.narrow(0, in_bucket, slot.numel).view(shape);
        slot.param.mutable_grad() = torch::Tensor();
      } else {
        slot.param.mutable_grad() = flat_grads.narrow(0, slot.offset, slot.numel).view(shape);
      }
      slots.push_back(std::move(slot));
    }
    if (shard_parameters)
      for (const Slot& slot : slots)
        if (int g = layout.buckets[slot.bucket].group; g >= 0) ++blocks[g].trainable;
    for (int i = 0; i < int(slots.size()); ++i) {
      auto accumulator = torch::autograd::impl::grad_accumulator(slots[i].param);
      // The accumulators outlive the engine in any graph built before it was destroyed; a backward
      // through such a graph then accumulates as plain autograd does (stage 3: Regather refuses it).
      if (reduction == GradientReduction::ReduceScatterBuckets)
        accumulator->add_pre_hook(std::make_unique<PreHook>([engine = liveness, i] {
          if (Impl* self = engine->impl.load()) self->before_gradient(i);
        }));
      accumulator->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
          [engine = liveness, i](const torch::autograd::variable_list& outputs, const torch::autograd::variable_list&) {
            if (Impl* self = engine->impl.load()) self->after_gradient(i);
            return outputs;
          }));
      grad_accumulators.push_back(std::move(accumulator));
    }
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
        block_of_module[owner] = int(blocks.size());
        block_modules.push_back(modules[owner].second);
        blocks.emplace_back().name = modules[owner].first;
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

  // Starts gathering the block's full parameters (one all-gather per bucket, normally one).
  void launch_gather(int block) {
    BlockState& state = blocks[block];
    ZT_CHECK_STATE(state.residence == Residence::Released, "gathering a block that is not released");
    for (int b : state.buckets) {
      const BucketLayout& lb = layout.buckets[b];
      torch::Tensor& full = bucket_params[b];
      c10::StorageImpl* storage = full.storage().unsafeGetStorageImpl();
      storage->set_data_ptr_noswap(gather_pool.take(int64_t(full.nbytes())));
      storage->set_nbytes(full.nbytes());
      state.gathering.push_back(comm->all_gather(param_partition.narrow(0, lb.partition_offset, lb.shard_numel),
                                                 full, "params." + state.name));
    }
    state.residence = Residence::Gathering;
    gathered_bytes += state.bytes;
    peak_gathered_bytes = std::max(peak_gathered_bytes, gathered_bytes);
  }

  void gather(int block) {
    BlockState& state = blocks[block];
    if (state.residence == Residence::Released) launch_gather(block);
    if (state.residence == Residence::Gathering) {
      for (auto& h : state.gathering) h.wait();
      state.gathering.clear();
      state.residence = Residence::Gathered;
    }
  }

  // Frees the block's full parameters; their tensors (and views autograd saved) stay valid as
  // metadata and see the data again after gather() (design §10).
  void release(int block) {
    BlockState& state = blocks[block];
    if (state.residence == Residence::Released) return;
    gather(block);  // an in-flight gather must land before its buffer goes
    for (int b : state.buckets) release_storage(b);
    state.residence = Residence::Released;
    gathered_bytes -= state.bytes;
  }

  // The bucket's full tensor keeps its shape, and every view of it (the parameters, what autograd
  // saved) stays valid, with zero bytes behind it until the next gather.
  void release_storage(int b) {
    c10::StorageImpl* storage = bucket_params[b].storage().unsafeGetStorageImpl();
    const int64_t bytes = int64_t(bucket_params[b].nbytes());
    gather_pool.give(storage->set_data_ptr(c10::DataPtr(nullptr, c10::Device(c10::DeviceType::CPU))), bytes);
    storage->set_nbytes(0);
  }

  // Gathers blocks ahead of their use, walking the recorded order from `position` in `direction`
  // (+1 in forward, -1 in backward), as DeepSpeed's parameter coordinator does: released blocks
  // are gathered while the elements launched by this call stay below the budget
  // min(stage3_prefetch_bucket_size, stage3_max_live_parameters - elements already live), so a
  // positive budget always prefetches at least the next block, however large; a zero
  // stage3_prefetch_bucket_size turns prefetch off.
  void prefetch(int64_t position, int direction) {
    if (!order_known) return;
    int64_t live_numel = 0;
    for (const auto& b : blocks)
      if (b.residence != Residence::Released) live_numel += b.numel;
    const int64_t budget =
        std::min(config.zero.stage3_prefetch_bucket_size, config.zero.stage3_max_live_parameters - live_numel);
    int64_t launched = 0;
    for (int64_t p = position; launched < budget && p >= 0 && p < int64_t(recorded_order.size()); p += direction) {
      const int block = recorded_order[p];
      if (blocks[block].residence != Residence::Released) continue;
      launch_gather(block);
      ++prefetched;
      launched += blocks[block].numel;
    }
  }

  // First step: every rank must run the same block at every call (or end its forward at the same
  // call); checked with one small all-gather per call, so that a mismatch is an error naming the
  // ranks and blocks on every rank instead of a hang or silently mixed parameters.
  void check_block_call(int block) {
    const int64_t call = int64_t(recorded_order.size());
    torch::Tensor mine = torch::tensor({int64_t(block), call}, torch::kLong);
    torch::Tensor all = torch::empty({2 * int64_t(world)}, torch::kLong);
    comm->all_gather(mine, all, "blocks.order").wait();
    auto a = all.accessor<int64_t, 1>();
    auto describe = [&](int64_t b) { return b < 0 ? std::string("no block (its forward had ended)") : "'" + blocks[b].name + "'"; };
    for (int r = 0; r < world; ++r)
      if (a[2 * r] != block)
        throw Error("stage 3: ranks ran different blocks at block call " + std::to_string(call) +
                    " of the first forward: rank " + std::to_string(rank) + " ran " + describe(block) + ", rank " +
                    std::to_string(r) + " ran " + describe(a[2 * r]) +
                    " (every rank must run the same blocks in the same order)");
  }

  torch::Tensor run(int block, const torch::Tensor& x, const BlockFunction& fn) override {
    int64_t position;
    if (!order_known) {
      check_block_call(block);
      position = int64_t(recorded_order.size());
      recorded_order.push_back(block);
    } else {
      // Expected next in the recorded order; else (a forward of another shape, e.g. evaluation)
      // the block's first occurrence.
      position = forward_position < int64_t(recorded_order.size()) && recorded_order[forward_position] == block
                     ? forward_position
                     : std::find(recorded_order.begin(), recorded_order.end(), block) - recorded_order.begin();
    }
    forward_position = position + 1;
    gather(block);
    prefetch(position + 1, +1);
    torch::Tensor y = fn(x);
    release(block);
    if (y.requires_grad() && torch::GradMode::is_enabled())
      y = Regather::apply(y, liveness, blocks[block].name, int64_t(block), position);
    return y;
  }

  // Backward reaches the block's use at `position`: its parameters must be whole again; the use
  // before it in forward order is the next to come in backward.
  void gather_for_backward(int block, int64_t position) {
    gather(block);
    prefetch(position - 1, -1);
  }

  void plan_optimizer_chunks(const std::vector<OwnedFragment>& fragments) {
    const int64_t limit = separate_master ? kConversionChunk : std::numeric_limits<int64_t>::max();
    for (const OwnedFragment& f : fragments) {
      for (int64_t done = 0; done < f.numel;) {
        if (chunks.empty() || chunks.back().numel >= limit ||
            chunks.back().flat_offset + chunks.back().numel != f.flat_offset + done ||
            chunks.back().partition_offset + chunks.back().numel != f.partition_offset + done)
          chunks.push_back({f.flat_offset + done, f.partition_offset + done, 0, {0}, {}});
        OptimizerChunk& c = chunks.back();
        const int64_t take = std::min(f.numel - done, limit - c.numel);
        c.numel += take;
        c.bounds.push_back(c.numel);
        c.placements.push_back(f.placement);
        done += take;
      }
    }
  }

  // ---------------------------------------------------------------- backward
  bool boundary_next() const { return micro_step + 1 == config.gradient_accumulation_steps; }

  void backward(const torch::Tensor& loss) {
    ZT_CHECK_STATE(!in_backward, "backward() re-entered");
    const bool boundary = boundary_next();
    // Gradients are reduced on the boundary micro-step only, except when they are sharded: then
    // every micro-step reduces, so that no full-size gradient survives a backward. Unsharded
    // gradients are reduced from the gradient hooks while backward runs with overlap_comm, else
    // once backward has returned (as DeepSpeed's stages 0 and 1 without overlap_comm).
    const bool sharded_gradients = reduction == GradientReduction::ReduceScatterBuckets;
    const bool reduce_whole = !sharded_gradients && boundary && world > 1;
    reducing = sharded_gradients || (reduce_whole && config.zero.overlap_comm);
    if (sharded_gradients || reduce_whole)
      for (size_t i = 0; i < progress.size(); ++i) {
        progress[i].remaining = layout.buckets[i].end_placement - layout.buckets[i].first_placement;
        if (reduction != GradientReduction::ReduceScatterBuckets) {
          progress[i].state = BucketState::Idle;
          progress[i].handle.reset();
        }
      }
    for (auto& block : blocks) block.remaining = block.trainable;
    if (shard_parameters && !order_known) {
      check_block_call(-1);  // every rank's first forward ends here
      order_known = true;
    }
    forward_position = 0;
    in_backward = true;
    try {
      (loss * (scaler.scale() / double(config.gradient_accumulation_steps))).backward();
    } catch (...) {
      in_backward = false;
      throw;
    }
    in_backward = false;
    if (sharded_gradients) flush_buckets();
    if (reduce_whole && !config.zero.overlap_comm) {
      for (int b = 0; b < int(progress.size()); ++b) launch(b);  // step() waits for them
      reducing = true;
    }
    ++micro_step;
  }

  // ReduceScatterBuckets: the gradient of slot i is about to be accumulated; its .grad must be
  // the right place in a zeroed bucket buffer.
  void before_gradient(int i) {
    if (!in_backward) return;
    Slot& slot = slots[i];
    BucketProgress& b = progress[slot.bucket];
    if (b.state != BucketState::Filling) acquire_buffer(slot.bucket);
    slot.param.mutable_grad() = slot.bucket_grad_view[b.buffer];
  }

  void after_gradient(int i) {
    if (!reducing || !in_backward) return;
    const int bucket = slots[i].bucket;
    BucketProgress& b = progress[bucket];
    // A gradient that arrives after its bucket was launched (out-of-order backward) makes its
    // bucket fill again; it is launched from flush_buckets(). remaining then stays below zero.
    if (--b.remaining == 0) launch(bucket);
    if (shard_parameters)
      if (int g = layout.buckets[bucket].group; g >= 0 && --blocks[g].remaining == 0) release(g);
  }

  void acquire_buffer(int bucket) {
    const int k = next_buffer;
    next_buffer = (next_buffer + 1) % buffer_count;
    BucketBuffer& buffer = buffers[k];
    if (buffer.bucket >= 0 && progress[buffer.bucket].buffer == k) {
      BucketProgress& previous = progress[buffer.bucket];
      if (previous.state == BucketState::Filling) launch(buffer.bucket);  // a gradient never came
      complete(k);
    }
    const BucketLayout& layout_bucket = layout.buckets[bucket];
    buffer.data.narrow(0, 0, layout_bucket.numel).zero_();
    buffer.bucket = bucket;
    progress[bucket].state = BucketState::Filling;
    progress[bucket].buffer = k;
  }

  void launch(int bucket) {
    BucketProgress& b = progress[bucket];
    const BucketLayout& lb = layout.buckets[bucket];
    const std::string label = "grads.bucket" + std::to_string(bucket);
    switch (reduction) {
      case GradientReduction::AllReduce:
        b.handle = comm->all_reduce(flat_grads.narrow(0, lb.offset, lb.numel), ReduceOp::Sum, label);
        b.state = BucketState::InFlight;
        return;
      case GradientReduction::ReduceScatterInPlace:
        b.handle = comm->reduce_scatter(flat_grads.narrow(0, lb.offset, lb.numel),
                                        flat_grads.narrow(0, layout.shard_offset(bucket, shard_rank), lb.shard_numel),
                                        ReduceOp::Sum, label, InputUse::Scratch);
        b.state = BucketState::InFlight;
        return;
      case GradientReduction::ReduceScatterBuckets: {
        ZT_CHECK_STATE(b.state == BucketState::Filling, "launching a bucket that is not filling");
        BucketBuffer& buffer = buffers[b.buffer];
        // The first reduction of a window writes the owned slice; later ones are added to it.
        buffer.add_into_partition = b.received;
        // Without accumulation only a bucket refilled by a late gradient needs the scratch.
        if (buffer.add_into_partition && buffer.scratch.numel() < lb.shard_numel)
          buffer.scratch = torch::empty({largest_shard}, buffer.data.options());
        torch::Tensor owned = buffer.add_into_partition ? buffer.scratch.narrow(0, 0, lb.shard_numel)
                                                         : grad_partition.narrow(0, lb.partition_offset, lb.shard_numel);
        buffer.handle =
            comm->reduce_scatter(buffer.data.narrow(0, 0, lb.numel), owned, ReduceOp::Sum, label, InputUse::Scratch);
        b.state = BucketState::InFlight;
        b.received = true;
        if (!config.zero.overlap_comm) complete(b.buffer);
        return;
      }
    }
  }

  void complete(int k) {
    BucketBuffer& buffer = buffers[k];
    if (buffer.bucket < 0) return;
    BucketProgress& b = progress[buffer.bucket];
    // The bucket may have moved on to the other buffer since (a late gradient refilled it).
    if (b.state != BucketState::InFlight || b.buffer != k) return;
    buffer.handle.wait();
    if (buffer.add_into_partition) {
      const BucketLayout& lb = layout.buckets[buffer.bucket];
      grad_partition.narrow(0, lb.partition_offset, lb.shard_numel).add_(buffer.scratch.narrow(0, 0, lb.shard_numel));
    }
    b.state = BucketState::Idle;
  }

  // End of a backward with sharded gradients: launch what is still filling (in bucket order, the
  // same on every rank) and wait, so that only the owned partition holds gradients afterwards.
  void flush_buckets() {
    for (int bucket = 0; bucket < int(progress.size()); ++bucket)
      if (progress[bucket].state == BucketState::Filling) launch(bucket);
    for (int k = 0; k < buffer_count; ++k) complete(k);
    // A block some of whose parameters got no gradient is still gathered: release it.
    for (int g = 0; g < int(blocks.size()); ++g) release(g);
  }

  // ---------------------------------------------------------------- step
  // Sum of squares of this rank's owned gradient region (the whole gradient when not sharded).
  double owned_gradient_square_sum() {
    auto square_sum = [](const torch::Tensor& t) {
      const double norm = torch::linalg_vector_norm(t, 2, c10::nullopt, false, torch::kFloat32).item<double>();
      return norm * norm;
    };
    double sum = 0.0;
    for (int b = 0; b < int(layout.buckets.size()); ++b) {
      const BucketLayout& lb = layout.buckets[b];
      sum += square_sum(reduction == GradientReduction::ReduceScatterBuckets
                            ? grad_partition.narrow(0, lb.partition_offset, lb.shard_numel)
                            : flat_grads.narrow(0, layout.shard_offset(b, shard_rank), lb.shard_numel));
    }
    return sum;
  }

  // Gradients of the owned fragment f, in the working dtype.
  torch::Tensor owned_gradient(int64_t flat_offset, int64_t partition_offset, int64_t n) {
    return reduction == GradientReduction::ReduceScatterBuckets ? grad_partition.narrow(0, partition_offset, n)
                                                                 : flat_grads.narrow(0, flat_offset, n);
  }

  // One optimizer pass over this rank's partition, bucket shard by bucket shard, in chunks that
  // bound the fp32 conversion of 16-bit gradients. LAMB's per-tensor norms are summed across the
  // ranks that hold pieces of each tensor between its two phases.
  void apply_optimizer(double lr, int64_t step, float grad_scale) {
    optim::StepOptions options;
    options.grad_scale = grad_scale;
    if (separate_master) options.half = working_dtype == torch::kBFloat16 ? optim::HalfType::BF16 : optim::HalfType::FP16;
    adam.lr = lr;
    sgd.lr = lr;
    lamb.lr = lr;

    auto run_chunk = [&](const OptimizerChunk& c, auto&& kernel) {
      torch::Tensor g = owned_gradient(c.flat_offset, c.partition_offset, c.numel);
      const float* grads;
      if (separate_master) {
        torch::Tensor converted = grad_scratch.narrow(0, 0, c.numel);
        converted.copy_(g);
        grads = converted.data_ptr<float>();
        options.half_out = shard_parameters
                               ? reinterpret_cast<uint16_t*>(param_partition.data_ptr()) + c.partition_offset
                               : reinterpret_cast<uint16_t*>(flat_params.data_ptr()) + c.flat_offset;
      } else {
        grads = g.data_ptr<float>();
      }
      float* p = separate_master    ? master.data_ptr<float>() + c.partition_offset
                 : shard_parameters ? param_partition.data_ptr<float>() + c.partition_offset
                                    : flat_params.data_ptr<float>() + c.flat_offset;
      float* m = exp_avg.numel() ? exp_avg.data_ptr<float>() + c.partition_offset : nullptr;
      float* v = exp_avg_sq.numel() ? exp_avg_sq.data_ptr<float>() + c.partition_offset : nullptr;
      kernel(c, p, grads, m, v);
    };

    switch (kind) {
      case OptimizerKind::Adam:
        for (const OptimizerChunk& c : chunks)
          run_chunk(c, [&](const OptimizerChunk& ch, float* p, const float* g, float* m, float* v) {
            optim::adam_step(p, g, m, v, ch.numel, adam, step, options);
          });
        break;
      case OptimizerKind::Sgd:
        for (const OptimizerChunk& c : chunks)
          run_chunk(c, [&](const OptimizerChunk& ch, float* p, const float* g, float* m, float*) {
            optim::sgd_step(p, g, m, ch.numel, sgd, step, options);
          });
        break;
      case OptimizerKind::Lamb: {
        const int tensors = int(layout.placements.size());
        // [w_sq of each tensor..., u_sq of each tensor...], summed over this rank's pieces.
        torch::Tensor sums = torch::zeros({2 * tensors}, torch::kFloat64);
        double* s = sums.data_ptr<double>();
        for (const OptimizerChunk& c : chunks)
          run_chunk(c, [&](const OptimizerChunk& ch, float* p, const float* g, float* m, float* v) {
            const int pieces = int(ch.placements.size());
            std::vector<double> w_sq(pieces), u_sq(pieces);
            optim::lamb_partial_norms(p, g, m, v, ch.numel, ch.bounds.data(), pieces, lamb, options, w_sq.data(),
                                      u_sq.data());
            for (int k = 0; k < pieces; ++k)
              if (ch.placements[k] >= 0) {
                s[ch.placements[k]] += w_sq[k];
                s[tensors + ch.placements[k]] += u_sq[k];
              }
          });
        if (shard_world > 1) comm->all_reduce(sums, ReduceOp::Sum, "lamb.tensor_norms").wait();
        for (const OptimizerChunk& c : chunks)
          run_chunk(c, [&](const OptimizerChunk& ch, float* p, const float*, float* m, float* v) {
            const int pieces = int(ch.placements.size());
            std::vector<double> w_sq(pieces, 0.0), u_sq(pieces, 0.0);  // padding: ratio 1, update 0
            for (int k = 0; k < pieces; ++k)
              if (ch.placements[k] >= 0) {
                w_sq[k] = s[ch.placements[k]];
                u_sq[k] = s[tensors + ch.placements[k]];
              }
            optim::lamb_apply(p, m, v, ch.numel, ch.bounds.data(), pieces, w_sq.data(), u_sq.data(), lamb, step,
                              options);
          });
        break;
      }
    }
  }

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

  // Stage 3: parameters outside every block stay whole on every rank; refresh them after a step.
  void gather_persistent_parameters() {
    std::vector<CollectiveHandle> handles;
    for (int b = 0; b < int(layout.buckets.size()); ++b) {
      const BucketLayout& lb = layout.buckets[b];
      if (lb.group >= 0) continue;
      handles.push_back(comm->all_gather(param_partition.narrow(0, lb.partition_offset, lb.shard_numel),
                                         bucket_params[b], "params.persistent" + std::to_string(b)));
    }
    for (auto& h : handles) h.wait();
  }

  void clear_gradients() {
    if (reduction == GradientReduction::ReduceScatterBuckets) {
      for (auto& b : progress) b.received = false;
    } else {
      flat_grads.zero_();
    }
  }

  StepResult step() {
    StepResult result;
    if (micro_step < config.gradient_accumulation_steps) return result;
    result.boundary = true;
    micro_step = 0;
    if (reducing && reduction != GradientReduction::ReduceScatterBuckets) {
      // Buckets whose parameters received no gradient this step (unused in forward) are still
      // reduced, in bucket order, so every rank issues the same collectives.
      for (int b = 0; b < int(progress.size()); ++b)
        if (progress[b].state != BucketState::InFlight) launch(b);
      for (auto& b : progress) b.handle->wait();
    }
    reducing = false;
    if (reduction == GradientReduction::ReduceScatterBuckets)
      // A bucket that no gradient reached in this window holds no reduction: its slice is zero.
      for (int b = 0; b < int(progress.size()); ++b)
        if (!progress[b].received)
          grad_partition.narrow(0, layout.buckets[b].partition_offset, layout.buckets[b].shard_numel).zero_();

    // Gradients hold the sum over ranks of loss_scale × the mean micro-batch gradient.
    double square_sum = owned_gradient_square_sum();
    if (shard_world > 1) {
      torch::Tensor total = torch::full({1}, square_sum, torch::kFloat64);
      comm->all_reduce(total, ReduceOp::Sum, "grads.norm").wait();
      square_sum = total.item<double>();
    }
    const double unscale = 1.0 / (double(world) * scaler.scale());
    const double norm = std::sqrt(square_sum) * unscale;
    result.grad_norm = norm;
    result.loss_scale = scaler.scale();
    // As DeepSpeed, a step skipped for overflow does not advance the schedule (its scheduler
    // steps only with the optimizer), while global_step counts it.
    result.lr = schedule.lr_at(global_step - skipped);
    ++global_step;
    const bool overflow = !std::isfinite(norm);
    scaler.update(overflow);
    if (overflow) {
      // The norm is the same on every rank (one all-reduce, or identical all-reduced gradients),
      // so every rank skips together.
      ++skipped;
      result.skipped = true;
      clear_gradients();
      return result;
    }
    double scale = unscale;
    if (config.gradient_clipping > 0 && norm > config.gradient_clipping)
      scale *= config.gradient_clipping / (norm + 1e-6);
    apply_optimizer(result.lr, global_step - skipped - moments_from, float(scale));
    if (shard_parameters) {
      // A block gathered ahead (prefetched for a forward that did not come) holds old values.
      for (int g = 0; g < int(blocks.size()); ++g) release(g);
      gather_persistent_parameters();
    }
    else if (shard_world > 1)
      gather_parameters();
    clear_gradients();
    result.stepped = true;
    return result;
  }

  // ---------------------------------------------------------------- checkpoints

  // This rank's pieces of the optimizer state as fp32 views into the arenas, by parameter name and
  // element range. Without sharded optimizer states every rank holds all of it; rank 0 saves it.
  std::vector<StateFragment> owned_state(bool saving) {
    std::vector<StateFragment> out;
    if (saving && rank >= shard_world) return out;
    for (const OwnedFragment& f : layout.owned_fragments(shard_rank)) {
      if (f.placement < 0) continue;  // padding
      StateFragment s;
      s.parameter = specs[layout.placements[f.placement].index].name;
      s.begin = f.parameter_offset;
      s.numel = f.numel;
      s.roles["master"] = separate_master    ? master.narrow(0, f.partition_offset, f.numel)
                          : shard_parameters ? param_partition.narrow(0, f.partition_offset, f.numel)
                                             : flat_params.narrow(0, f.flat_offset, f.numel);
      if (exp_avg.numel()) s.roles["exp_avg"] = exp_avg.narrow(0, f.partition_offset, f.numel);
      if (exp_avg_sq.numel()) s.roles["exp_avg_sq"] = exp_avg_sq.narrow(0, f.partition_offset, f.numel);
      out.push_back(std::move(s));
    }
    return out;
  }

  void save_checkpoint(const std::string& dir, const std::string& tag,
                       const std::map<std::string, std::string>& client_state, int keep_last) {
    if (micro_step != 0)
      throw Error("save_checkpoint: expected a call between optimizer steps, found micro-step " +
                  std::to_string(micro_step) + " of an accumulation window of " +
                  std::to_string(config.gradient_accumulation_steps));
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
    save_sharded_checkpoint(*comm, dir, tag, contents, owned_state(true), keep_last);
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
    // Read into copies first, so that a failure leaves this engine as it was. Resetting the
    // optimizer reads the masters only.
    std::vector<StateFragment> fragments = owned_state(false);
    if (options.reset_optimizer)
      for (StateFragment& f : fragments) std::erase_if(f.roles, [](const auto& r) { return r.first != "master"; });
    std::vector<StateFragment> staged = fragments;
    for (StateFragment& f : staged)
      for (auto& [role, tensor] : f.roles) tensor = torch::empty({f.numel}, torch::kFloat32);
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
    const LoadedCheckpoint loaded = load_sharded_checkpoint(*comm, dir, tag, registered, staged, check);
    const auto& scalars = loaded.scalars;
    const LossScaler::State s = saved_scaler;
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < fragments.size(); ++i)
      for (auto& [role, tensor] : fragments[i].roles) tensor.copy_(staged[i].roles.at(role));
    if (separate_master)  // the working copy of the owned region, rounded from the masters
      for (const OwnedFragment& f : layout.owned_fragments(shard_rank)) {
        if (f.placement < 0) continue;
        torch::Tensor working = shard_parameters ? param_partition.narrow(0, f.partition_offset, f.numel)
                                                 : flat_params.narrow(0, f.flat_offset, f.numel);
        working.copy_(master.narrow(0, f.partition_offset, f.numel));
      }
    if (shard_parameters) {
      for (int g = 0; g < int(blocks.size()); ++g) release(g);
      gather_persistent_parameters();
    } else if (shard_world > 1) {
      gather_parameters();
    }
    if (options.reset_optimizer) {
      exp_avg.zero_();
      exp_avg_sq.zero_();
    }
    clear_gradients();
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
    if (shard_parameters) {
      bytes.parameters = param_partition.nbytes();
      for (int b = 0; b < int(layout.buckets.size()); ++b)
        if (layout.buckets[b].group < 0) bytes.parameters += bucket_params[b].nbytes();
    } else {
      bytes.parameters = flat_params.nbytes();
    }
    bytes.gradients = reduction == GradientReduction::ReduceScatterBuckets ? grad_partition.nbytes() : flat_grads.nbytes();
    bytes.optimizer_states = (master.defined() ? master.nbytes() : 0) + exp_avg.nbytes() + exp_avg_sq.nbytes();
    return bytes;
  }

  int64_t buffer_bytes() const {
    int64_t bytes = grad_scratch.defined() ? grad_scratch.nbytes() : 0;
    for (const auto& buffer : buffers)
      if (buffer.data.defined()) bytes += buffer.data.nbytes() + buffer.scratch.nbytes();
    return bytes;
  }
};

namespace {
torch::autograd::variable_list Regather::backward(torch::autograd::AutogradContext* ctx,
                                                  torch::autograd::variable_list grads) {
  auto engine = c10::static_intrusive_pointer_cast<Liveness>(ctx->saved_data["engine"].toCapsule());
  Engine::Impl* impl = engine->impl.load();
  if (impl == nullptr)
    throw Error("stage 3: backward reached block '" + ctx->saved_data["name"].toStringRef() +
                "' after the engine that owns its parameters was destroyed (keep the engine alive until every "
                "backward through its model has run)");
  impl->gather_for_backward(int(ctx->saved_data["block"].toInt()), ctx->saved_data["position"].toInt());
  return {grads[0], torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
}
}  // namespace

Engine::Engine(std::shared_ptr<torch::nn::Module> model, const TrainConfig& config,
               std::shared_ptr<Communicator> comm)
    : impl_(std::make_unique<Impl>(std::move(model), config, std::move(comm))) {}
Engine::~Engine() = default;

void Engine::backward(const at::Tensor& loss) { impl_->backward(loss); }
StepResult Engine::step() { return impl_->step(); }
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
  return impl_->load_checkpoint(dir, tag, LoadOptions{});
}
std::map<std::string, std::string> Engine::load_checkpoint(const std::string& dir, const std::string& tag,
                                                           const LoadOptions& options) {
  return impl_->load_checkpoint(dir, tag, options);
}
Communicator& Engine::communicator() const { return *impl_->comm; }
const TrainConfig& Engine::config() const { return impl_->config; }
ModelStateBytes Engine::model_state_bytes() const { return impl_->model_state_bytes(); }
int64_t Engine::buffer_bytes() const { return impl_->buffer_bytes(); }
int64_t Engine::trainable_parameters() const { return impl_->layout.parameter_numel; }
const FlatLayout& Engine::layout() const { return impl_->layout; }
int64_t Engine::peak_gathered_parameter_bytes() const { return impl_->peak_gathered_bytes; }
int64_t Engine::prefetched_blocks() const { return impl_->prefetched; }
void Engine::reset_peak_gathered_parameter_bytes() { impl_->peak_gathered_bytes = impl_->gathered_bytes; }

}  // namespace zt
