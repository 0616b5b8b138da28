// The engine's side of ShardedConstruction (zerotrain/blocks.h): the shards a model's blocks
// were built as, waiting for an engine to adopt them. Internal; not installed.
#pragma once
#include <ATen/core/Tensor.h>

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
};

// Removes and returns the sharded state of `module` (nullopt when it was not built sharded).
std::optional<ShardedBlock> take_sharded_block(const torch::nn::Module& module);

}  // namespace zt
