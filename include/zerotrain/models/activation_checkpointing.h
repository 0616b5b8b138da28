// Activation checkpointing (docs/activation_checkpointing.md): a function or a model's block
// keeps only its inputs from forward and runs again in backward. With the models' layer: the
// reference models (GPT, BERT, Llama) and the Python package's checkpoint() use it, the engine does
// not; at stage 3 a checkpointed block is gathered again for its recomputation through run_block
// (zerotrain/zero/blocks.h).
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "zerotrain/zero/blocks.h"
#include "zerotrain/config/recompute.h"

namespace zt {

// A checkpointed function keeps only its inputs from forward; backward runs it again (with the
// random-number generators of the first run, so dropout draws the same masks) and differentiates
// the recomputation. Parameter gradients are produced once, by the recomputation's backward, so
// the engine's gradient hooks fire once per real gradient at every stage; at stage 3 the block is
// gathered again for the recomputation by the identity that run_block puts on its output.
//
// Contract
// - fn runs twice: in forward (without autograd) and in backward. It must compute the same
//   values from the same inputs: it may draw random numbers from the default generators (their
//   states are saved and restored), but must not depend on state it changes itself. It is kept
//   until backward, so it must own what it captures: capture by value, not references to locals
//   of the forward that called it.
// - Under torch::NoGradGuard, or when neither an input nor a parameter requires a gradient, the
//   function runs once, plainly.
// - One backward per forward: a second backward through the same graph throws zt::Error.
// - Thread-safety: as autograd: the forward from the thread that drives the engine.

class CheckpointArena;
class Communicator;

// How a model checkpoints its blocks (docs/activation_checkpointing.md): the settings the
// `activation_checkpointing` block gives, as the reference models (GPT, BERT) take them.
struct CheckpointingSettings {
  Recompute recompute = Recompute::None;
  int64_t number_checkpoints = 0;     // 0: every block; else this many, spread evenly
  bool keep_inputs_on_host = false;   // cpu_checkpointing
  bool contiguous_memory = false;     // contiguous_memory_optimization (full recomputation)
  bool synchronize_boundary = false;  // synchronize_checkpoint_boundary
  bool profile = false;               // per-block timings
  // partition_activations: a model split over a tensor group keeps 1/T of each fully recomputed
  // block's input per rank (CheckpointOptions::partition_group); without a group, nothing to split.
  bool partition_activations = false;
};

// Which of `blocks` blocks hold a checkpoint when `number` are asked for (0: all): spread evenly,
// block i chosen when the running quota i·n/L crosses an integer (every k-th block when n divides
// L as L/k). Throws zt::ConfigError for a number outside [0, blocks], naming `what` (the model's
// word for its blocks).
std::vector<char> checkpointed_blocks(int64_t blocks, int64_t number, const char* what);

// Per-checkpoint timings (DeepSpeed's activation_checkpointing.profile). Thread-compatible.
struct CheckpointTimings {
  int64_t forward_calls = 0, recomputations = 0;
  double forward_seconds = 0, recompute_seconds = 0;
};

struct CheckpointOptions {
  // cpu_checkpointing: the kept inputs of a function on a CUDA device are copied to pinned host
  // memory (asynchronously) and back for backward; on the CPU they already are in host memory.
  bool keep_inputs_on_host = false;
  // synchronize_checkpoint_boundary: the device is synchronised before and after each run (CUDA;
  // the CPU runs synchronously already).
  bool synchronize_boundary = false;
  // contiguous_memory_optimization: the kept inputs are copied into this arena's slots.
  std::shared_ptr<CheckpointArena> arena;
  // profile: forward and recomputation times are added here.
  std::shared_ptr<CheckpointTimings> timings;
  // partition_activations (ZeRO-R): every rank of this group holds the same inputs (activations a
  // tensor group replicates), and each keeps only its 1/G of every input (flattened, the last
  // piece padded with zeros), on the host with keep_inputs_on_host and in the arena's slots with
  // one; backward all-gathers them over the group before the recomputation (a collective: every
  // rank of the group runs the same checkpoints' backward in the same order). Null or a group of
  // one: inputs kept whole.
  std::shared_ptr<Communicator> partition_group;
};

using CheckpointFunction = std::function<at::Tensor(const std::vector<at::Tensor>&)>;

// Returns fn(inputs), keeping only `inputs` (detached) for backward. `parameters` are the
// trainable tensors fn reads besides its inputs: they decide, with the inputs, whether the output
// requires a gradient (a block whose input needs none still trains its weights).
at::Tensor checkpoint(CheckpointFunction fn, const std::vector<at::Tensor>& inputs,
                      const CheckpointOptions& options = {}, const std::vector<at::Tensor>& parameters = {});

// run_block with the block checkpointed: the module's parameters are the checkpoint's, and at
// stage 3 they are gathered for the first run and again (once) before the recomputation.
at::Tensor run_checkpointed_block(torch::nn::Module& module, const at::Tensor& x, BlockFunction fn,
                                  const CheckpointOptions& options = {});

// Frees the memory of `discard` now and refills it with recompute(into) when backward reaches
// `output`, which is returned through an identity that does so. `discard` must be an output of
// an operation whose backward needs it (a saved tensor, such as an activation function's output
// saved by the next matrix multiply) and nothing else may read it in forward afterwards.
// recompute must write bitwise the values `discard` had (the same kernel on the same input).
// When `discard` does not own its storage alone, or gradients are off, nothing is freed.
at::Tensor recompute_in_backward(const at::Tensor& output, const at::Tensor& discard,
                                 std::function<void(at::Tensor& into)> recompute);

// contiguous_memory_optimization: the kept inputs of up to `slots` checkpoints at a time in one
// buffer, sized by the first input stored (and grown while no slot is in use), so that steady
// training allocates nothing for them. A slot is taken by a checkpoint's forward and given back
// after its backward (or when its graph is dropped); an input that finds no free slot of its
// size is kept on its own and counted as an overflow. Thread-safe.
class CheckpointArena {
 public:
  explicit CheckpointArena(int slots);
  ~CheckpointArena();
  CheckpointArena(const CheckpointArena&) = delete;
  CheckpointArena& operator=(const CheckpointArena&) = delete;

  struct Stats {
    int slots = 0;
    int64_t slot_bytes = 0, buffer_allocations = 0, stores = 0, overflows = 0;
  };
  Stats stats() const;

  // A copy of x in a free slot, with a handle that frees the slot when destroyed; or x itself
  // and no handle when no slot of its size is free.
  std::pair<at::Tensor, std::shared_ptr<void>> store(const at::Tensor& x);

 private:
  struct State;
  std::shared_ptr<State> state_;
};

}  // namespace zt
