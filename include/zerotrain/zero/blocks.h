// Blocks: the unit whose parameters ZeRO stage 3 gathers and releases together (docs/zero.md
// "Stage 3").
//
// A model marks its blocks once and runs each through run_block; these are the only lines a
// user adds for stage 3 (the built-in GPT does the same, see src/models/gpt.cpp):
//
//   Net() { layer = register_module("layer", Layer(...)); zt::mark_block(layer.ptr()); }
//   Tensor forward(Tensor x) {
//     x = zt::run_block(*layer, x, [&](const at::Tensor& in) { return layer->forward(in); });
//     ...
//   }
//
// Contract
// - mark_block records the module (held weakly; a destroyed module is forgotten). Every
//   trainable parameter under it belongs to that block. Blocks must not nest or share a
//   parameter (the engine rejects that with zt::ConfigError naming both).
// - run_block(module, x, fn) returns fn(x). When a stage-3 engine owns `module`, the block's
//   parameters are gathered before fn runs and released after, and the output carries an
//   identity autograd function that gathers them again before the block's backward. A block may
//   run several times in one step (shared weights; a tied embedding and head): every run
//   gathers, and the parameters are released for good once all their gradients are in.
// - Without such an engine (stages 0–2, or no engine) run_block is just fn(x); a block whose
//   stage-3 engine was destroyed has no parameter data and run_block on it throws zt::Error.
// - Thread-safety: mark_block may be called from any thread; run_block from the thread that
//   drives the engine.
//
// Building a model already sharded (the counterpart of DeepSpeed's zero.Init): while a
// ShardedConstruction is alive, mark_block also shards the block at once, so that no rank ever
// holds more than its shards plus the block being built (docs/zero.md "Sharded construction"):
//
//   torch::manual_seed(seed);                                    // the same seed on every rank
//   std::optional<zt::ShardedConstruction> sharded;
//   if (config.zero.shard_parameters) sharded.emplace(comm->rank(), comm->world_size());
//   auto model = MyNet(...);        // each block marked right after its parameters are initialised
//   sharded.reset();
//   zt::Engine engine(model.ptr(), config, comm);                // adopts the shards (any stage)
//
// - mark_block under a ShardedConstruction keeps this rank's 1/world of the block's parameters
//   (all of them, concatenated in registration order, fp32 or whatever dtype they share) and
//   frees their storage. Values written to those parameters after mark_block are lost, so a
//   model initialises each block before marking it (the GPT does).
// - Until an Engine adopts the model, a sharded block has no data: run_block on it throws
//   zt::Error. The Engine gathers each block once at construction (a collective: every rank must
//   build the same model the same way) and then proceeds as with an unsharded model; with the
//   same seed the values equal those of an unsharded build.
// - One ShardedConstruction at a time per process (a second one throws zt::Error); it affects
//   mark_block on every thread while alive. Shards outlive it until an Engine adopts them.
#pragma once
#include <c10/core/Device.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

namespace at {
class Tensor;
}
namespace torch::nn {
class Module;
}

namespace zt {

class Communicator;

using BlockFunction = std::function<at::Tensor(const at::Tensor&)>;

void mark_block(const std::shared_ptr<torch::nn::Module>& module);
bool is_marked_block(const torch::nn::Module& module);
at::Tensor run_block(torch::nn::Module& module, const at::Tensor& x, const BlockFunction& fn);

// run_block for a block that takes and returns several tensors (the Python package's units: a
// submodule's forward with any arguments and outputs): fn() runs with the block's parameters
// gathered, and each output that requires a gradient carries the identity that gathers them again
// before the block's backward. Without a stage-3 engine it is just fn(). Same contract otherwise.
using BlockOutputsFunction = std::function<std::vector<at::Tensor>()>;
std::vector<at::Tensor> run_block_outputs(torch::nn::Module& module, const BlockOutputsFunction& fn);

class ShardedConstruction {
 public:
  // This process is rank `rank` of `world_size`; throws zt::ConfigError on an impossible pair.
  // `device`: where the model computes. The blocks are built and sharded in host memory either
  // way; an Engine adopting them puts their parameters on `device` (its shards at stage 3, in host
  // memory with offload_param), so a model larger than one GPU starts without ever being whole
  // there. Move the rest of the model with move_model below.
  ShardedConstruction(int rank, int world_size, c10::Device device = c10::kCPU);
  ~ShardedConstruction();
  ShardedConstruction(const ShardedConstruction&) = delete;
  ShardedConstruction& operator=(const ShardedConstruction&) = delete;

  int blocks_sharded() const;
  int64_t shard_bytes() const;          // bytes of the shards this rank kept, all blocks
  int64_t largest_block_bytes() const;  // full bytes of the largest block sharded
  c10::Device device() const { return device_; }

 private:
  int rank_, world_size_;
  c10::Device device_;
  int blocks_ = 0;
  int64_t shard_bytes_ = 0, largest_block_bytes_ = 0;
  friend void mark_block(const std::shared_ptr<torch::nn::Module>& module);
};

// Module::to(device) for a model built under a ShardedConstruction: every parameter and buffer
// with data moves to `device` (keeping its autograd identity); the parameters of blocks not yet
// adopted by an Engine have no data and stay as they are, for the Engine to place.
void move_model(torch::nn::Module& model, c10::Device device);

// Tensor parallelism (docs/tensor_parallel.md): a parameter of which each rank of `group` holds a
// different slice, the rest being replicated over the group. The parameter's whole tensor is cut
// along `dim` into `parts` equal consecutive parts (3 for a fused q, k, v projection; 1 otherwise),
// each part into group-size equal slices; rank r holds slice r of every part, concatenated along
// `dim` in part order. The tensor-parallel layers (zerotrain/models/tensor_parallel.h) and the GPT
// built with a tensor group mark their slices; a model with layers of its own marks them likewise.
//
// An Engine over such a model trains over its data-parallel communicator and takes the tensor
// group from these marks: its gradient norm (clipping, fp16 overflow) counts each slice once and
// each replicated parameter once, and LAMB's per-tensor norms are those of the whole tensors.
// Every split parameter of one model must name the same group. Marks are held weakly (a destroyed
// parameter is forgotten), survive set_data, and may be made from any thread.
struct TensorSplit {
  std::shared_ptr<Communicator> group;
  int dim = 0;
  int parts = 1;
};
// Throws zt::ConfigError for a null group, a dimension the parameter lacks, or a part count < 1.
void mark_tensor_split(const at::Tensor& parameter, TensorSplit split);
std::optional<TensorSplit> tensor_split_of(const at::Tensor& parameter);

}  // namespace zt
