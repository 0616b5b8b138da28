// The process grid's keys against the world, the model and the features: the tensor groups
// (tensor_parallel.autotp_size; that it divides the world is checked with the batch, which counts
// data-parallel ranks) and the stage-3 secondary partition within the data-parallel groups.
#include <fmt/format.h>

#include <string>
#include <utility>
#include <vector>

#include "config/schema.h"
#include "config/model_rules.h"
#include "zerotrain/error.h"
#include "zerotrain/config/bert_config.h"
#include "zerotrain/config/gpt_config.h"
#include "zerotrain/config/llama_config.h"

namespace zt::config_detail {
namespace {

// ZeRO++'s secondary partition (hpZ): stage-3 parameters only (DeepSpeed ignores it below stage
// 3, which would leave the key without effect), over groups of consecutive ranks that divide the
// world. 0 and 1 both mean none, as in DeepSpeed.
void validate_secondary_partition(const TrainConfig& c) {
  const int size = c.zero.hpz_partition_size;
  if (size <= 1) return;
  if (!c.zero.shard_parameters)
    throw ConfigError(fmt::format(
        "zero_optimization.zero_hpz_partition_size: expected 0 or 1 at zero_optimization.stage {} (the secondary "
        "partition holds stage-3 parameter shards), found {}",
        c.zero.stage, size));
  if (c.data_parallel_size() % size != 0)
    throw ConfigError(fmt::format(
        "zero_optimization.zero_hpz_partition_size: expected a divisor of the {} size {} (groups of consecutive "
        "ranks), found {}",
        c.tensor_parallel > 1 ? "data-parallel" : "world", c.data_parallel_size(), size));
}

// Tensor parallelism splits the GPT, BERT and the Llama (docs/tensor_parallel.md): their heads
// (the Llama's kv heads too), features and vocabulary evenly; what is not implemented for split
// models is refused by name.
void validate_tensor_parallel(const TrainConfig& c) {
  if (c.tensor_parallel <= 1) return;
  const config_detail::ModelRules& model = config_detail::model_rules(c.model.type);
  if (!model.tensor_split_sizes)
    throw ConfigError(fmt::format("tensor_parallel.autotp_size: expected 1 for model.type \"{}\" (its tensor-parallel "
                                  "split is not implemented), found {}",
                                  c.model.type, c.tensor_parallel));
  if (!c.model.init_from.empty())
    throw ConfigError(fmt::format("model.init_from: expected none with tensor_parallel.autotp_size {} (loading whole "
                                  "weights into the tensor-parallel slices is not implemented), found '{}'",
                                  c.tensor_parallel, c.model.init_from));
  {
    // The split: each rank keeps n_head / T heads and vocab_size / T rows of the vocabulary (the
    // GPT's and BERT's 4 × n_embd features follow from the heads; the Llama's are a key).
    const std::vector<std::pair<const char*, int64_t>> sizes = model.tensor_split_sizes(c);
    for (const auto& [key, value] : sizes)
      if (value % c.tensor_parallel != 0)
        throw ConfigError(fmt::format("{}: expected a multiple of tensor_parallel.autotp_size {} (each rank of a tensor "
                                      "group keeps 1/{} of it{}), found {}",
                                      key, c.tensor_parallel, c.tensor_parallel,
                                      std::string(key) == "model.vocab_size" ? "; pad the vocabulary" : "", value));
  }
}

}  // namespace

void validate_process_grid(const TrainConfig& c) {
  validate_tensor_parallel(c);
  validate_secondary_partition(c);
}

}  // namespace zt::config_detail
