// Where Engine::load_weights (zerotrain/zero/engine.h) reads a model's values from: the checkpoint
// layer's readers implement it (the Hugging Face GPT-2 reader of model.init_from is one), and the
// engine only calls it, so the interface lives with the readers.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace zt {

// read() fills out[0, count) with elements [begin, begin + count) of the flattened tensor `name`
// (the model's name for it; `shape`, its shape in the model) as fp32, and throws (zt::DataError,
// zt::ConfigError) when it cannot. Called from one thread at a time.
class WeightReader {
 public:
  virtual ~WeightReader() = default;
  virtual void read(const std::string& name, const std::vector<int64_t>& shape, int64_t begin, int64_t count,
                    float* out) = 0;
};

}  // namespace zt
