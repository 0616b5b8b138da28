#include "zerotrain/config/config.h"
#include "zerotrain/memory/memory.h"

namespace zt {

bool keeps_fp32_masters(bool sixteen_bit_working, bool delayed_update, bool staged_through_host) {
  return sixteen_bit_working || delayed_update || staged_through_host;
}

int optimizer_moment_arrays(const TrainConfig& config) {
  const auto& o = config.optimizer;
  return o.type == "SGD" ? (o.momentum != 0.0 ? 1 : 0) : 2;
}

ModelStateBytes model_state_bytes_per_parameter(const TrainConfig& config) {
  const bool mixed = config.precision != Precision::FP32;
  ModelStateBytes bytes;
  bytes.parameters = mixed ? 2 : 4;
  bytes.gradients = bytes.parameters;
  bytes.optimizer_states = (mixed ? 4 : 0) + 4 * optimizer_moment_arrays(config);
  return bytes;
}

ModelStateBytes model_state_formula(int64_t trainable_parameters, int world_size, const TrainConfig& config) {
  const ModelStateBytes per = model_state_bytes_per_parameter(config);
  auto part = [&](int64_t bytes_per_parameter, bool sharded) {
    const int64_t total = bytes_per_parameter * trainable_parameters;
    return sharded ? total / world_size : total;
  };
  ModelStateBytes bytes;
  bytes.parameters = part(per.parameters, config.zero.shard_parameters);
  // hpZ's secondary partition: each parameter once more over the secondary group.
  if (config.zero.shard_parameters && config.zero.hpz_partition_size > 1)
    bytes.parameters += per.parameters * trainable_parameters / config.zero.hpz_partition_size;
  bytes.gradients = part(per.gradients, config.zero.shard_gradients);
  bytes.optimizer_states = part(per.optimizer_states, config.zero.shard_optimizer_states);
  return bytes;
}

}  // namespace zt
