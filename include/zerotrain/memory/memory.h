// Byte accounting of long-lived model state, and the formula it must match (docs/design.md
// "Memory per parameter").
//
// The engine reports what it allocated (Engine::model_state_bytes); model_state_formula gives what
// the same configuration should hold by that formula, without padding. Tests and the run summary
// put the two side by side; the difference is the layout's alignment padding (docs/zero.md).
// Plain data and pure functions; thread-safe.
#pragma once
#include <cstdint>

namespace zt {

struct TrainConfig;

// Bytes of long-lived model state held by one rank, by role.
struct ModelStateBytes {
  int64_t parameters = 0;        // working parameters (fp32, or the 16-bit copy in mixed precision)
  int64_t gradients = 0;         // gradients kept between backward and step (full or owned shard)
  int64_t optimizer_states = 0;  // fp32 master weights (mixed precision only) and optimizer moments
  int64_t total() const { return parameters + gradients + optimizer_states; }
};

// Bytes per trainable parameter of each role before sharding, for `config`'s precision and
// optimizer: working parameter and gradient 2 (bf16/fp16) or 4 (fp32); optimizer state = fp32
// master (4, mixed precision only) + moments (Adam/AdamW/Lamb 8, SGD with momentum 4, SGD 0).
ModelStateBytes model_state_bytes_per_parameter(const TrainConfig& config);

// Whether the optimizer keeps fp32 master weights apart from the working parameters: with 16-bit
// working parameters; with the delayed update (its step writes new working values while the
// training reads the old); and when the step is staged through host copies of a device's state.
// The one rule the optimizer partition, the NVMe pre-flight check and the estimate follow.
bool keeps_fp32_masters(bool sixteen_bit_working, bool delayed_update, bool staged_through_host);

// Optimizer moment arrays of `config`'s optimizer: Adam, AdamW and LAMB 2, SGD with momentum 1,
// plain SGD 0.
int optimizer_moment_arrays(const TrainConfig& config);

// The formula: per-rank bytes for `trainable_parameters` (Ψ) on `world_size` ranks, each role
// divided by world_size when config.zero's switch for it is on; with a stage-3 secondary partition
// (zero_hpz_partition_size P > 1) the parameters hold Ψ/P more elements of the working dtype.
ModelStateBytes model_state_formula(int64_t trainable_parameters, int world_size, const TrainConfig& config);

}  // namespace zt
