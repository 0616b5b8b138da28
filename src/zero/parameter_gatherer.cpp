#include "zero/parameter_gatherer.h"

#include <c10/core/CPUAllocator.h>
#include <c10/core/DeviceGuard.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/torch.h>

#include <algorithm>
#include <atomic>

#include "common/check.h"
#include "zerotrain/config/config.h"
#include "zerotrain/error.h"
#include "layout/reuse_distance.h"

namespace zt {

c10::DataPtr GatherPool::take(int64_t bytes) {
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
  if (device_.is_cpu()) return c10::GetCPUAllocator()->allocate(size_t(bytes));
  // The device's allocator (CUDA: the caching allocator, on the current stream of the device).
  c10::DeviceGuard on_device(device_);
  return c10::GetAllocator(device_.type())->allocate(size_t(bytes));
}

void GatherPool::give(c10::DataPtr data, int64_t bytes) {
  live_bytes_ -= bytes;
  if (live_bytes_ + kept_bytes_ + bytes > limit_) return;  // freed here
  kept_.emplace_back(std::move(data), bytes);
  kept_bytes_ += bytes;
}

// What the gatherer leaves in autograd graphs, which may outlive it: its destructor clears
// `gatherer`, so that a backward that runs afterwards finds out instead of using freed memory.
struct GathererLiveness : torch::CustomClassHolder {
  std::atomic<ParameterGatherer*> gatherer{nullptr};
};

namespace {

// Identity on a block's output whose backward gathers the block's parameters again before the
// block's own backward runs: it fires before the block's parameter gradients (docs/design.md
// "Platform facts").
struct Regather : public torch::autograd::Function<Regather> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& y,
                               const c10::intrusive_ptr<GathererLiveness>& owner, const std::string& name,
                               int64_t block, int64_t position) {
    ctx->saved_data["owner"] = c10::IValue::make_capsule(owner);
    ctx->saved_data["name"] = name;
    ctx->saved_data["block"] = block;
    ctx->saved_data["position"] = position;
    return y.view_as(y);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto owner = c10::static_intrusive_pointer_cast<GathererLiveness>(ctx->saved_data["owner"].toCapsule());
    ParameterGatherer* gatherer = owner->gatherer.load();
    if (gatherer == nullptr)
      throw Error("stage 3: backward reached block '" + ctx->saved_data["name"].toStringRef() +
                  "' after the engine that owns its parameters was destroyed (keep the engine alive until every "
                  "backward through its model has run)");
    gatherer->gather_for_backward(int(ctx->saved_data["block"].toInt()), ctx->saved_data["position"].toInt());
    return {grads[0], torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

ParameterGatherer::ParameterGatherer(const FlatLayout& layout, std::vector<Block> blocks, const ZeroConfig& zero,
                                     at::ScalarType working_dtype, c10::Device device, Communicator& comm,
                                     ParameterShards& shards, std::shared_ptr<Communicator> secondary)
    : layout_(layout), zero_(zero), working_dtype_(working_dtype), comm_(comm), shards_(shards),
      secondary_(std::move(secondary)), liveness_(c10::make_intrusive<GathererLiveness>()) {
  for (Block& b : blocks) {
    blocks_.emplace_back().name = b.name;
    modules_.push_back(std::move(b.module));
  }
  for (int b = 0; b < int(layout.buckets.size()); ++b)
    if (const BucketLayout& lb = layout.buckets[b]; lb.group >= 0) {
      blocks_[lb.group].buckets.push_back(b);
      blocks_[lb.group].bytes += lb.numel * int64_t(c10::elementSize(working_dtype));
      blocks_[lb.group].numel += lb.numel;
    }
  for (const ParameterPlacement& p : layout.placements)
    if (int g = layout.buckets[p.bucket].group; g >= 0) ++blocks_[g].trainable;
  int64_t largest = 0;
  for (const BlockState& state : blocks_) largest = std::max(largest, state.bytes);
  pool_ = GatherPool(2 * largest, device);
  bucket_params_.resize(layout.buckets.size());
  secondary_shards_.resize(layout.buckets.size());
  if (secondary_) {
    const int64_t size = secondary_->world_size();
    ZT_CHECK_STATE(size >= 1 && comm.world_size() % size == 0, "the secondary group's size must divide the world's");
    const auto options = at::TensorOptions().dtype(working_dtype).device(device);
    for (int b = 0; b < int(layout.buckets.size()); ++b)
      if (layout.buckets[b].group >= 0) secondary_shards_[b] = at::empty({layout.buckets[b].numel / size}, options);
  }
  liveness_->gatherer = this;
}

ParameterGatherer::~ParameterGatherer() {
  liveness_->gatherer = nullptr;
  if (installed_) remove_block_runner(this);
}

void ParameterGatherer::install() {
  install_block_runner(this, modules_);
  installed_ = true;
}

void ParameterGatherer::adopt_bucket(int b, at::Tensor full) {
  bucket_params_[b] = std::move(full);
  if (layout_.buckets[b].group >= 0) {
    // Released from the start: from here on this rank holds only its shards of the block.
    pool_.adopt_live(int64_t(bucket_params_[b].nbytes()));
    release_storage(b);
  }
}

void ParameterGatherer::begin_backward() {
  in_backward_ = true;
  for (auto& block : blocks_) block.remaining = block.trainable;
  if (!order_known_) {
    check_block_call(-1);  // every rank's first forward ends here
    order_known_ = true;
    std::vector<int64_t> numel;
    for (const BlockState& state : blocks_) numel.push_back(state.numel);
    kept_after_use_ = kept_after_forward_use(recorded_order_, numel, zero_.stage3_max_reuse_distance);
  }
  forward_position_ = 0;
}

void ParameterGatherer::gradient_arrived(int bucket) {
  if (int g = layout_.buckets[bucket].group; g >= 0 && --blocks_[g].remaining == 0) release(g);
}

void ParameterGatherer::end_backward(bool release) {
  in_backward_ = false;
  if (release) release_all();
}

void ParameterGatherer::hold(const std::vector<const torch::nn::Module*>& modules) {
  std::vector<int> blocks;
  for (const torch::nn::Module* m : modules) {
    auto it = std::find_if(modules_.begin(), modules_.end(), [&](const auto& own) { return own.get() == m; });
    if (it == modules_.end()) throw Error("stage 3: hold: the module is not one of this engine's blocks");
    blocks.push_back(int(it - modules_.begin()));
  }
  for (int b : blocks) {
    gather(b);
    held_.push_back(b);
  }
}

void ParameterGatherer::release_held() {
  for (int b : held_) release(b);
  held_.clear();
}

void ParameterGatherer::release_all() {
  for (int g = 0; g < int(blocks_.size()); ++g) release(g);
}

// Starts gathering the block's full parameters (one all-gather per bucket, normally one).
void ParameterGatherer::launch_gather(int block) {
  BlockState& state = blocks_[block];
  ZT_CHECK_STATE(state.residence == Residence::Released, "gathering a block that is not released");
  // The secondary shards, within their group, serve every gather after the first since the
  // parameters last changed; the first reads this rank's partition.
  state.from_secondary = reads_secondary(block);
  if (!state.from_secondary) {
    // The shard source's buffers are held by the gathers in flight: complete the oldest ones
    // until this block's shards have a place.
    while (!shards_.can_prepare(block)) {
      ZT_CHECK_STATE(!gathering_order_.empty(), "no shard buffer free and no gather in flight to free one");
      complete_gathering(gathering_order_.front());
    }
    shards_.prepare(block);
  }
  for (int b : state.buckets) {
    torch::Tensor& full = bucket_params_[b];
    c10::StorageImpl* storage = full.storage().unsafeGetStorageImpl();
    storage->set_data_ptr_noswap(pool_.take(int64_t(full.nbytes())));
    storage->set_nbytes(full.nbytes());
    state.gathering.push_back(state.from_secondary
                                  ? secondary_->all_gather(secondary_shards_[b], full, "params.secondary." + state.name)
                                  : comm_.all_gather(shards_.shard(b), full, "params." + state.name));
  }
  state.residence = Residence::Gathering;
  if (!state.buckets.empty()) {
    ++gathers_;
    if (state.from_secondary) ++secondary_gathers_;
  }
  gathering_order_.push_back(block);
  gathered_bytes_ += state.bytes;
  peak_gathered_bytes_ = std::max(peak_gathered_bytes_, gathered_bytes_);
}

void ParameterGatherer::gather(int block) {
  BlockState& state = blocks_[block];
  if (state.residence == Residence::Released) launch_gather(block);
  if (state.residence == Residence::Gathering) complete_gathering(block);
}

void ParameterGatherer::complete_gathering(int block) {
  BlockState& state = blocks_[block];
  for (auto& h : state.gathering) h.wait();
  state.gathering.clear();
  state.residence = Residence::Gathered;
  std::erase(gathering_order_, block);
  if (state.from_secondary) return;
  shards_.done(block);
  if (secondary_) {
    // This rank's piece of the secondary partition: block r of the group's gather is the group's
    // rank r's.
    for (int b : state.buckets) {
      at::Tensor& mine = secondary_shards_[b];
      mine.copy_(bucket_params_[b].narrow(0, secondary_->rank() * mine.numel(), mine.numel()));
    }
    state.secondary_valid = true;
  }
}

void ParameterGatherer::invalidate_secondary() {
  for (BlockState& state : blocks_) state.secondary_valid = false;
}

int64_t ParameterGatherer::secondary_bytes() const {
  int64_t bytes = 0;
  for (const at::Tensor& t : secondary_shards_)
    if (t.defined()) bytes += int64_t(t.nbytes());
  return bytes;
}

// Frees the block's full parameters; their tensors (and views autograd saved) stay valid as
// metadata and see the data again after gather() (docs/design.md "Platform facts").
void ParameterGatherer::release(int block) {
  BlockState& state = blocks_[block];
  if (state.residence == Residence::Released) return;
  gather(block);  // an in-flight gather must land before its buffer goes
  for (int b : state.buckets) release_storage(b);
  state.residence = Residence::Released;
  gathered_bytes_ -= state.bytes;
}

// The bucket's full tensor keeps its shape, and every view of it (the parameters, what autograd
// saved) stays valid, with zero bytes behind it until the next gather.
void ParameterGatherer::release_storage(int b) {
  c10::StorageImpl* storage = bucket_params_[b].storage().unsafeGetStorageImpl();
  const int64_t bytes = int64_t(bucket_params_[b].nbytes());
  pool_.give(storage->set_data_ptr(c10::DataPtr(nullptr, pool_.device())), bytes);
  storage->set_nbytes(0);
}

// Gathers blocks ahead of their use, walking the recorded order from `position` in `direction`
// (+1 in forward, -1 in backward), as DeepSpeed's parameter coordinator does: released blocks
// are gathered while the elements launched by this call stay below the budget
// min(stage3_prefetch_bucket_size, stage3_max_live_parameters - elements already live), so a
// positive budget always prefetches at least the next block, however large; a zero
// stage3_prefetch_bucket_size turns prefetch off. The shards of the blocks after those are
// announced to the shard source, which may read them ahead (an offload tier).
void ParameterGatherer::prefetch(int64_t position, int direction) {
  if (!order_known_) return;
  int64_t live_numel = 0;
  for (const auto& b : blocks_)
    if (b.residence != Residence::Released) live_numel += b.numel;
  const int64_t budget =
      std::min(zero_.stage3_prefetch_bucket_size, zero_.stage3_max_live_parameters - live_numel);
  // The window is the next `budget` elements of the order: blocks in it that are already gathered
  // (or being gathered) count, so that the window does not run further ahead at every use when
  // the blocks are small.
  int64_t launched = 0;
  int64_t p = position;
  for (; launched < budget && p >= 0 && p < int64_t(recorded_order_.size()); p += direction) {
    const int block = recorded_order_[p];
    if (blocks_[block].residence != Residence::Released) {
      launched += blocks_[block].numel;
      continue;
    }
    if (!reads_secondary(block) && !shards_.can_prepare(block)) break;  // a prefetch never waits for a buffer
    launch_gather(block);
    ++prefetched_;
    launched += blocks_[block].numel;
  }
  std::vector<int> upcoming;
  for (int k = 0; k < 8 && p >= 0 && p < int64_t(recorded_order_.size()); p += direction, ++k)
    upcoming.push_back(recorded_order_[p]);
  shards_.expect(upcoming);
}

// First step: every rank must run the same block at every call (or end its forward at the same
// call); checked with one small all-gather per call, so that a mismatch is an error naming the
// ranks and blocks on every rank instead of a hang or silently mixed parameters.
void ParameterGatherer::check_block_call(int block) {
  const int world = comm_.world_size();
  const int64_t call = int64_t(recorded_order_.size());
  torch::Tensor mine = torch::tensor({int64_t(block), call}, torch::kLong);
  torch::Tensor all = torch::empty({2 * int64_t(world)}, torch::kLong);
  comm_.all_gather(mine, all, "blocks.order").wait();
  auto a = all.accessor<int64_t, 1>();
  auto describe = [&](int64_t b) {
    return b < 0 ? std::string("no block (its forward had ended)") : "'" + blocks_[b].name + "'";
  };
  for (int r = 0; r < world; ++r)
    if (a[2 * r] != block)
      throw Error("stage 3: ranks ran different blocks at block call " + std::to_string(call) +
                  " of the first forward: rank " + std::to_string(comm_.rank()) + " ran " + describe(block) +
                  ", rank " + std::to_string(r) + " ran " + describe(a[2 * r]) +
                  " (every rank must run the same blocks in the same order)");
}

torch::Tensor ParameterGatherer::run(int block, const torch::Tensor& x, const BlockFunction& fn) {
  return run_outputs(block, [&] { return std::vector<torch::Tensor>{fn(x)}; })[0];
}

std::vector<torch::Tensor> ParameterGatherer::run_outputs(int block, const BlockOutputsFunction& fn) {
  if (in_backward_) {
    // A recomputation (activation checkpointing around the block): its backward comes next, so the
    // block stays gathered until its gradients are in, and nothing ahead in forward order is
    // prefetched (backward has passed it).
    const int64_t position = std::find(recorded_order_.begin(), recorded_order_.end(), block) - recorded_order_.begin();
    gather(block);
    std::vector<torch::Tensor> outputs = fn();
    if (torch::GradMode::is_enabled())
      for (torch::Tensor& y : outputs)
        if (y.defined() && y.requires_grad()) y = Regather::apply(y, liveness_, blocks_[block].name, int64_t(block), position);
    return outputs;
  }
  int64_t position;
  bool in_order = false;  // at the position the recorded order expects
  if (!order_known_) {
    check_block_call(block);
    position = int64_t(recorded_order_.size());
    recorded_order_.push_back(block);
  } else {
    // Expected next in the recorded order; else (a forward of another shape, e.g. evaluation)
    // the block's first occurrence.
    in_order = forward_position_ < int64_t(recorded_order_.size()) && recorded_order_[forward_position_] == block;
    position = in_order ? forward_position_
                        : std::find(recorded_order_.begin(), recorded_order_.end(), block) - recorded_order_.begin();
  }
  forward_position_ = position + 1;
  gather(block);
  prefetch(position + 1, +1);
  std::vector<torch::Tensor> outputs = fn();
  const bool backward_follows =
      torch::GradMode::is_enabled() &&
      std::any_of(outputs.begin(), outputs.end(), [](const torch::Tensor& y) { return y.defined() && y.requires_grad(); });
  // Kept for a reuse near enough (stage3_max_reuse_distance); a forward without backward, or off
  // the recorded order, releases at once.
  if (!(backward_follows && in_order && kept_after_use_[size_t(position)])) release(block);
  if (backward_follows)
    for (torch::Tensor& y : outputs)
      if (y.defined() && y.requires_grad()) y = Regather::apply(y, liveness_, blocks_[block].name, int64_t(block), position);
  return outputs;
}

// Backward reaches the block's use at `position`: its parameters must be whole again; the use
// before it in forward order is the next to come in backward.
void ParameterGatherer::gather_for_backward(int block, int64_t position) {
  gather(block);
  prefetch(position - 1, -1);
}

void ParameterGatherer::gather_persistent() {
  std::vector<CollectiveHandle> handles;
  for (int b = 0; b < int(layout_.buckets.size()); ++b) {
    if (layout_.buckets[b].group >= 0) continue;
    handles.push_back(comm_.all_gather(shards_.shard(b), bucket_params_[b], "params.persistent" + std::to_string(b)));
  }
  for (auto& h : handles) h.wait();
}

int64_t ParameterGatherer::persistent_bytes() const {
  int64_t bytes = 0;
  for (int b = 0; b < int(layout_.buckets.size()); ++b)
    if (layout_.buckets[b].group < 0) bytes += int64_t(bucket_params_[b].nbytes());
  return bytes;
}

}  // namespace zt
