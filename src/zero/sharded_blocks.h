// The engine's side of ShardedConstruction (zerotrain/zero/blocks.h): the shards a model's blocks
// were built as, waiting for an engine to adopt them. Internal; not installed.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <optional>
#include <vector>

namespace torch::nn {
class Module;
}

namespace zt {

struct ShardedBlock {
  int rank = 0, world_size = 1;
  std::vector<at::Tensor> parameters;  // the block's parameters, in concatenation order; no storage
  at::Tensor shard;                    // this rank's ceil(total_numel / world_size) elements, zero-padded
  int64_t total_numel = 0;             // elements of all parameters together
  c10::Device device{c10::kCPU};       // where the Engine puts the parameters (ShardedConstruction's)
};

class Communicator;

// A block built sharded and not adopted yet, made whole for a while (the Python package's
// zero.GatheredParameters before its engine exists): gather_pending_block gives every parameter its
// storage back, filled from all ranks' shards (a collective over the world it was sharded for);
// reshard_pending_block keeps this rank's shard of the values they hold now and frees the storage
// again. zt::Error when the module is not such a block (or, to reshard, not gathered).
void gather_pending_block(const torch::nn::Module& module, Communicator& comm);
void reshard_pending_block(const torch::nn::Module& module);

// Removes and returns the sharded state of `module` (nullopt when it was not built sharded).
std::optional<ShardedBlock> take_sharded_block(const torch::nn::Module& module);
// The sharded state of `module`, left in place and sharing its tensors (nullopt when it was not
// built sharded, or was adopted): the Python package keeps each parameter's shard with the
// parameter, so that a parameter outliving its module can still be gathered.
std::optional<ShardedBlock> pending_sharded_block(const torch::nn::Module& module);

}  // namespace zt
