// The model a training configuration describes, as the memory estimate takes it.
#include <fmt/format.h>

#include "zerotrain/config.h"
#include "zerotrain/error.h"
#include "zerotrain/estimate.h"
#include "zerotrain/models/gpt_config.h"
#include "zerotrain/models/llama_config.h"

namespace zt {

ModelFigures model_figures_of(const TrainConfig& config) {
  const int64_t threshold = config.zero.stage3_param_persistence_threshold, seq = config.data.sequence_length;
  if (config.model.type == "gpt") {
    const GPTConfig gpt = gpt_config_of(config);
    return gpt_model_figures(gpt, seq > 0 ? seq : gpt.context_length, threshold, config.tensor_parallel);
  }
  if (config.model.type == "llama") {
    const LlamaConfig llama = llama_config_of(config);
    return llama_model_figures(llama, seq > 0 ? seq : llama.max_position_embeddings, threshold);
  }
  throw ConfigError(fmt::format("model.type: the memory estimate models the GPT and the Llama; expected \"gpt\" or "
                                "\"llama\", found \"{}\"",
                                config.model.type));
}

}  // namespace zt
