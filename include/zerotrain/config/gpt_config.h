// The reference GPT's plain data: its shape (GPTConfig), named presets and exact parameter
// count, without LibTorch's module API, so that the configuration resolves "auto" sizes and
// checks presets without the modules (zerotrain/models/gpt.h builds the model from a GPTConfig).
// Implemented in src/config/gpt_config.cpp.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace zt {

struct GPTConfig {
  int64_t vocab_size = 256;
  int64_t context_length = 64;
  int64_t n_layer = 2;
  int64_t n_head = 2;
  int64_t n_embd = 64;
  double dropout = 0.0;  // embedding, attention-probability and residual dropout (training only)
  // loss(): the output head and cross-entropy run over at most this many tokens at a time (0: all
  // at once), so that the [tokens, vocab] logits and their gradient exist one chunk at a time;
  // with full recomputation each chunk is checkpointed too (docs/activation_checkpointing.md).
  // The loss is then a sum of chunk sums: equal to the unchunked one up to rounding.
  int64_t loss_chunk_tokens = 0;

  // Throws zt::ConfigError naming the field when a value is out of range or n_embd % n_head != 0.
  void validate() const;
};

// Named presets. `tiny` (~0.1M parameters, tests), `small` (byte-level demo, ~0.8M),
// gpt2-124m / -350m / -774m / -1.5b (the GPT-2 family, vocab 50257, context 1024), and larger
// shapes for memory work: gpt-2.7b, gpt-6.7b, gpt-13b (context 2048 as GPT-3), and the same
// GPT-3 shapes at context 1024 for GPU benchmarks: gpt3-2.7b, gpt3-6.7b, gpt3-13b.
// Throws zt::ConfigError listing the valid names for an unknown one.
GPTConfig gpt_preset(const std::string& name);
std::vector<std::string> gpt_preset_names();

// Exact trainable parameter count, computed analytically (tied head, learned positions, biases):
//   V·C + T·C + L·(12·C² + 13·C) + 2·C
// e.g. gpt2-124m -> 124,439,808. Usable for memory estimates without building the model.
int64_t gpt_parameter_count(const GPTConfig& config);

}  // namespace zt
