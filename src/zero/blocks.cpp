#include "zerotrain/zero/blocks.h"

#include <ATen/native/Resize.h>
#include <torch/nn/module.h>

#include <atomic>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "zero/block_runner.h"
#include "zero/sharded_blocks.h"
#include "zerotrain/comm/comm.h"
#include "zerotrain/error.h"

namespace zt {
namespace {

std::mutex registry_mutex;
std::vector<std::weak_ptr<torch::nn::Module>> marked;  // expired entries are pruned on use
struct Owner {
  BlockRunner* runner = nullptr;
  int block = -1;
};
std::unordered_map<const torch::nn::Module*, Owner> owners;  // blocks of the installed runners
std::atomic<int> owned_count{0};                              // lets run_block skip the lookup when none
// Blocks whose stage-3 engine was destroyed: their parameters have no data.
std::vector<std::weak_ptr<torch::nn::Module>> orphaned;
std::unordered_map<BlockRunner*, std::vector<std::weak_ptr<torch::nn::Module>>> modules_of;
std::atomic<int> orphaned_count{0};
ShardedConstruction* active_construction = nullptr;

struct PendingShards {
  std::weak_ptr<torch::nn::Module> module;
  ShardedBlock block;
};
std::vector<PendingShards> pending;           // built sharded, not adopted by an engine yet
std::atomic<int> pending_count{0};            // lets run_block skip the lookup when none

// Keeps this rank's slice of the concatenation of `parameters` and frees their storage
// (resized to zero bytes, so every tensor keeps its shape and autograd identity).
ShardedBlock shard_parameters(const std::vector<at::Tensor>& parameters, const std::string& module_name, int rank,
                              int world) {
  ShardedBlock block;
  block.rank = rank;
  block.world_size = world;
  block.parameters = parameters;
  const auto dtype = parameters.front().scalar_type();
  for (const auto& p : parameters) {
    if (p.scalar_type() != dtype || !p.device().is_cpu() || !p.is_contiguous())
      throw ConfigError("mark_block under ShardedConstruction: the parameters of '" + module_name +
                        "' must be contiguous CPU tensors of one dtype, found " + std::string(c10::toString(dtype)) +
                        " and " + c10::toString(p.scalar_type()) + " on " + p.device().str());
    block.total_numel += p.numel();
  }
  const int64_t shard_numel = (block.total_numel + world - 1) / world;
  block.shard = at::zeros({shard_numel}, at::TensorOptions().dtype(dtype));
  const int64_t begin = int64_t(rank) * shard_numel, end = std::min(begin + shard_numel, block.total_numel);
  int64_t offset = 0;
  at::NoGradGuard no_grad;
  for (const auto& p : parameters) {
    const int64_t lo = std::max(begin, offset), hi = std::min(end, offset + p.numel());
    if (lo < hi) block.shard.narrow(0, lo - begin, hi - lo).copy_(p.detach().reshape({-1}).narrow(0, lo - offset, hi - lo));
    offset += p.numel();
  }
  for (const auto& p : parameters) at::native::resize_bytes_cpu(p.storage().unsafeGetStorageImpl(), 0);
  return block;
}

}  // namespace

void mark_block(const std::shared_ptr<torch::nn::Module>& module) {
  if (!module) throw ConfigError("mark_block: expected a module, found a null pointer");
  std::lock_guard lock(registry_mutex);
  std::erase_if(marked, [](const auto& weak) { return weak.expired(); });
  for (const auto& weak : marked)
    if (weak.lock() == module) return;
  if (active_construction != nullptr) {
    std::vector<at::Tensor> parameters;
    std::unordered_set<const void*> seen;
    for (const auto& item : module->named_parameters(/*recurse=*/true)) {
      const at::Tensor& p = item.value();
      if (!seen.insert(p.unsafeGetTensorImpl()).second) continue;
      if (p.numel() > 0 && p.storage().nbytes() == 0)
        throw ConfigError("mark_block: parameter '" + item.key() + "' of '" + module->name() +
                          "' is already sharded as part of another block (blocks must not nest or share parameters)");
      parameters.push_back(p);
    }
    if (!parameters.empty()) {
      ShardedConstruction& c = *active_construction;
      ShardedBlock block = shard_parameters(parameters, module->name(), c.rank_, c.world_size_);
      block.device = c.device_;
      ++c.blocks_;
      c.shard_bytes_ += int64_t(block.shard.nbytes());
      c.largest_block_bytes_ =
          std::max<int64_t>(c.largest_block_bytes_, block.total_numel * int64_t(block.shard.element_size()));
      std::erase_if(pending, [](const auto& entry) { return entry.module.expired(); });
      pending.push_back({module, std::move(block)});
      pending_count = int(pending.size());
    }
  }
  marked.push_back(module);
}

bool is_marked_block(const torch::nn::Module& module) {
  std::lock_guard lock(registry_mutex);
  for (const auto& weak : marked)
    if (auto m = weak.lock(); m.get() == &module) return true;
  return false;
}

namespace {

// The runner of `module` with its block number, or none (run it plainly); throws for a module whose
// parameters are not there to run it with.
Owner owner_of(const torch::nn::Module& module) {
  if (owned_count.load() > 0) {
    std::lock_guard lock(registry_mutex);
    if (auto it = owners.find(&module); it != owners.end() && it->second.runner != nullptr) return it->second;
  }
  if (pending_count.load() > 0 || orphaned_count.load() > 0) {
    std::lock_guard lock(registry_mutex);
    for (const auto& entry : pending)
      if (auto m = entry.module.lock(); m.get() == &module)
        throw Error("run_block: block '" + module.name() +
                    "' was built under ShardedConstruction and holds only this rank's shard; construct the Engine "
                    "on the model before running it");
    for (const auto& weak : orphaned)
      if (auto m = weak.lock(); m.get() == &module)
        throw Error("run_block: the parameters of block '" + module.name() +
                    "' were sharded by a stage-3 engine that has been destroyed and have no data; keep the engine "
                    "alive while the model is used");
  }
  return {};
}

}  // namespace

at::Tensor run_block(torch::nn::Module& module, const at::Tensor& x, const BlockFunction& fn) {
  const Owner owner = owner_of(module);
  return owner.runner != nullptr ? owner.runner->run(owner.block, x, fn) : fn(x);
}

std::vector<at::Tensor> run_block_outputs(torch::nn::Module& module, const BlockOutputsFunction& fn) {
  const Owner owner = owner_of(module);
  return owner.runner != nullptr ? owner.runner->run_outputs(owner.block, fn) : fn();
}

void install_block_runner(BlockRunner* runner, const std::vector<std::shared_ptr<torch::nn::Module>>& modules) {
  std::lock_guard lock(registry_mutex);
  for (const auto& m : modules)
    if (auto it = owners.find(m.get()); it != owners.end() && it->second.runner != runner)
      throw Error("stage 3: block '" + m->name() + "' already belongs to another engine that is alive");
  auto& mine = modules_of[runner];
  for (int i = 0; i < int(modules.size()); ++i) {
    owners[modules[i].get()] = {runner, i};
    mine.push_back(modules[i]);
  }
  owned_count = int(owners.size());
}

void remove_block_runner(BlockRunner* runner) {
  std::lock_guard lock(registry_mutex);
  std::erase_if(owners, [&](const auto& entry) { return entry.second.runner == runner; });
  owned_count = int(owners.size());
  if (auto it = modules_of.find(runner); it != modules_of.end()) {
    std::erase_if(orphaned, [](const auto& weak) { return weak.expired(); });
    for (auto& weak : it->second)
      if (!weak.expired()) orphaned.push_back(weak);
    modules_of.erase(it);
  }
  orphaned_count = int(orphaned.size());
}

bool has_block_runner(const torch::nn::Module& module) {
  std::lock_guard lock(registry_mutex);
  return owners.count(&module) > 0;
}

ShardedConstruction::ShardedConstruction(int rank, int world_size, c10::Device device)
    : rank_(rank), world_size_(world_size), device_(device) {
  if (world_size < 1 || rank < 0 || rank >= world_size)
    throw ConfigError("ShardedConstruction: expected 0 <= rank < world_size, found rank " + std::to_string(rank) +
                      " of world size " + std::to_string(world_size));
  std::lock_guard lock(registry_mutex);
  if (active_construction != nullptr)
    throw Error("ShardedConstruction: another one is already active in this process; one at a time is supported");
  active_construction = this;
}

ShardedConstruction::~ShardedConstruction() {
  std::lock_guard lock(registry_mutex);
  active_construction = nullptr;
}

void move_model(torch::nn::Module& model, c10::Device device) {
  at::NoGradGuard no_grad;
  for (auto& p : model.parameters(/*recurse=*/true))
    if (p.numel() == 0 || p.storage().nbytes() > 0) p.set_data(p.to(device));
  for (auto& b : model.buffers(/*recurse=*/true))
    if (b.defined()) b.set_data(b.to(device));
}

int ShardedConstruction::blocks_sharded() const { return blocks_; }
int64_t ShardedConstruction::shard_bytes() const { return shard_bytes_; }
int64_t ShardedConstruction::largest_block_bytes() const { return largest_block_bytes_; }

namespace {

ShardedBlock pending_block_of(const torch::nn::Module& module, const char* what) {
  std::lock_guard lock(registry_mutex);
  for (const auto& entry : pending)
    if (auto m = entry.module.lock(); m.get() == &module) return entry.block;  // shares the tensors
  throw Error(std::string(what) + ": block '" + module.name() + "' was not built sharded, or an engine adopted it");
}

}  // namespace

void gather_pending_block(const torch::nn::Module& module, Communicator& comm) {
  ShardedBlock block = pending_block_of(module, "gather_pending_block");
  if (comm.world_size() != block.world_size || comm.rank() != block.rank)
    throw Error("gather_pending_block: block '" + module.name() + "' was sharded as rank " + std::to_string(block.rank) +
                " of " + std::to_string(block.world_size) + ", the communicator is rank " + std::to_string(comm.rank()) +
                " of " + std::to_string(comm.world_size()));
  at::Tensor all = at::empty({block.shard.numel() * block.world_size}, block.shard.options());
  comm.all_gather(block.shard, all, "blocks.gather_pending").wait();
  at::NoGradGuard no_grad;
  int64_t offset = 0;
  for (const auto& p : block.parameters) {
    if (p.storage().nbytes() == 0) at::native::resize_bytes_cpu(p.storage().unsafeGetStorageImpl(), p.nbytes());
    p.detach().reshape({-1}).copy_(all.narrow(0, offset, p.numel()));
    offset += p.numel();
  }
}

void reshard_pending_block(const torch::nn::Module& module) {
  ShardedBlock block = pending_block_of(module, "reshard_pending_block");
  const int64_t shard_numel = block.shard.numel();
  const int64_t begin = int64_t(block.rank) * shard_numel, end = std::min(begin + shard_numel, block.total_numel);
  at::NoGradGuard no_grad;
  int64_t offset = 0;
  for (const auto& p : block.parameters) {
    if (p.numel() > 0 && p.storage().nbytes() == 0)
      throw Error("reshard_pending_block: block '" + module.name() + "' is not gathered");
    const int64_t lo = std::max(begin, offset), hi = std::min(end, offset + p.numel());
    if (lo < hi) block.shard.narrow(0, lo - begin, hi - lo).copy_(p.detach().reshape({-1}).narrow(0, lo - offset, hi - lo));
    offset += p.numel();
  }
  for (const auto& p : block.parameters) at::native::resize_bytes_cpu(p.storage().unsafeGetStorageImpl(), 0);
}

std::optional<ShardedBlock> pending_sharded_block(const torch::nn::Module& module) {
  std::lock_guard lock(registry_mutex);
  for (const auto& entry : pending)
    if (auto m = entry.module.lock(); m.get() == &module) return entry.block;
  return std::nullopt;
}

std::optional<ShardedBlock> take_sharded_block(const torch::nn::Module& module) {
  std::lock_guard lock(registry_mutex);
  for (auto it = pending.begin(); it != pending.end(); ++it)
    if (auto m = it->module.lock(); m.get() == &module) {
      ShardedBlock block = std::move(it->block);
      pending.erase(it);
      pending_count = int(pending.size());
      return block;
    }
  return std::nullopt;
}

namespace {

struct SplitMark {
  c10::weak_intrusive_ptr<c10::TensorImpl> parameter;
  TensorSplit split;
};
std::mutex split_mutex;
std::unordered_map<const c10::TensorImpl*, SplitMark> split_marks;

}  // namespace

void mark_tensor_split(const at::Tensor& parameter, TensorSplit split) {
  if (!parameter.defined()) throw ConfigError("mark_tensor_split: expected a parameter, found an undefined tensor");
  if (!split.group)
    throw ConfigError("mark_tensor_split: expected a tensor group, found a null communicator");
  if (split.dim < 0 || split.dim >= parameter.dim())
    throw ConfigError("mark_tensor_split: expected a dimension in [0, " + std::to_string(parameter.dim()) +
                      ") of the parameter of shape " + c10::str(parameter.sizes()) + ", found " +
                      std::to_string(split.dim));
  if (split.parts < 1)
    throw ConfigError("mark_tensor_split: expected parts >= 1, found " + std::to_string(split.parts));
  std::lock_guard lock(split_mutex);
  // A parameter destroyed since its mark may have left its address to this one.
  std::erase_if(split_marks, [](const auto& entry) { return entry.second.parameter.expired(); });
  split_marks.insert_or_assign(
      parameter.unsafeGetTensorImpl(),
      SplitMark{c10::weak_intrusive_ptr<c10::TensorImpl>(parameter.getIntrusivePtr()), std::move(split)});
}

std::optional<TensorSplit> tensor_split_of(const at::Tensor& parameter) {
  if (!parameter.defined()) return std::nullopt;
  std::lock_guard lock(split_mutex);
  auto it = split_marks.find(parameter.unsafeGetTensorImpl());
  if (it == split_marks.end() || it->second.parameter.lock().get() != parameter.unsafeGetTensorImpl())
    return std::nullopt;
  return it->second.split;
}

}  // namespace zt
