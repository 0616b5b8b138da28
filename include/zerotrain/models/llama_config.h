// The Llama-family decoder's plain data (zerotrain/models/llama.h builds the model from it): the
// fields of a Hugging Face LlamaConfig / Qwen2Config that decide the shape and the numbers, named
// as there, without LibTorch's module API. Implemented in src/models/llama_config.cpp.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace zt {

// rope_scaling: how the rotary frequencies are stretched for contexts beyond the trained one.
struct RopeScaling {
  std::string type = "default";  // "default" (none), "linear", "llama3"
  double factor = 1.0;
  // llama3: frequencies whose wavelength exceeds original/low_freq_factor are divided by factor,
  // those below original/high_freq_factor kept, the band between interpolated.
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 8192;
};

struct LlamaConfig {
  int64_t vocab_size = 256;
  int64_t hidden_size = 64;
  int64_t intermediate_size = 128;
  int64_t num_hidden_layers = 2;
  int64_t num_attention_heads = 4;
  int64_t num_key_value_heads = 2;  // grouped-query attention: each kv head serves heads/kv q heads
  int64_t head_dim = 0;             // 0: hidden_size / num_attention_heads
  int64_t max_position_embeddings = 128;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;
  bool attention_bias = false;  // bias on q, k, v and o (Llama's attention_bias)
  bool qkv_bias = false;        // bias on q, k and v only (Qwen2)
  bool mlp_bias = false;
  bool tie_word_embeddings = false;
  double initializer_range = 0.02;

  int64_t resolved_head_dim() const { return head_dim > 0 ? head_dim : hidden_size / num_attention_heads; }
  // Throws zt::ConfigError naming the field for a value out of range, heads not divisible by
  // the kv heads, an odd head dimension (RoPE rotates pairs), or an unknown rope_scaling type.
  void validate() const;
};

// `llama-tiny` (tests: 2 layers of 64, GQA 4/2, vocabulary 256) and `llama-1b`, the shape of
// Llama 3.2 1B (16 layers of 2048, GQA 32/8, vocabulary 128256, tied, llama3 rope scaling).
// Throws zt::ConfigError listing the valid names for an unknown one.
LlamaConfig llama_preset(const std::string& name);
std::vector<std::string> llama_preset_names();

// Exact trainable parameter count: embeddings V·H (twice untied), per layer the q/k/v/o
// projections, the three MLP projections, their biases and two norms, and the final norm.
int64_t llama_parameter_count(const LlamaConfig& config);

}  // namespace zt
