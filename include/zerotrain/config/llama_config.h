// The Llama-family decoder's plain data (zerotrain/models/llama.h builds the model from it): the
// fields of a Hugging Face LlamaConfig / Qwen2Config that decide the shape and the numbers, named
// as there, without LibTorch's module API. Implemented in src/config/llama_config.cpp.
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

// Upper bounds of a shape, the configuration's for the model.* keys: far beyond any model this
// library can build, low enough that the size arithmetic cannot overflow 64 bits.
inline constexpr int64_t kMaxLlamaVocab = int64_t(1) << 24, kMaxLlamaWidth = int64_t(1) << 20,
                         kMaxLlamaIntermediate = int64_t(1) << 22, kMaxLlamaLayers = int64_t(1) << 16,
                         kMaxLlamaHeads = int64_t(1) << 16, kMaxLlamaPositions = int64_t(1) << 24;

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
  // Throws zt::ConfigError naming the field for a value out of range (each size at most its
  // kMaxLlama* bound, num_attention_heads x head_dim at most kMaxLlamaWidth), heads not divisible by
  // the kv heads, an odd head dimension (RoPE rotates pairs), or an unknown rope_scaling type.
  void validate() const;
};

// `llama-tiny` (tests: 2 layers of 64, GQA 4/2, vocabulary 256) and `llama-1b`, the shape of
// Llama 3.2 1B (16 layers of 2048, GQA 32/8, vocabulary 128256, tied, llama3 rope scaling).
// Throws zt::ConfigError listing the valid names for an unknown one.
LlamaConfig llama_preset(const std::string& name);
std::vector<std::string> llama_preset_names();

// Hugging Face's config.json of a Llama-family model (implemented in src/config/llama_hf_config.cpp).
//
// llama_config_from_hf_json reads the text of a config.json whose "architectures" is
// ["LlamaForCausalLM"] or ["Qwen2ForCausalLM"] (or, without "architectures", whose "model_type" is
// "llama" or "qwen2"), in transformers 5's form (rope_parameters with rope_theta inside) or 4's
// (rope_theta and rope_scaling beside each other, rope_scaling's kind as "rope_type" or "type"):
// vocab_size, hidden_size, intermediate_size, num_hidden_layers and num_attention_heads (required),
// num_key_value_heads (absent: num_attention_heads), head_dim (absent or null, and always for
// Qwen2: hidden_size / num_attention_heads), max_position_embeddings, rms_norm_eps, rope theta
// and scaling, attention_bias and mlp_bias (Llama), Qwen2's q/k/v biases, tie_word_embeddings,
// initializer_range; other absent keys take transformers' defaults of the architecture. What this
// decoder does not compute is refused rather than ignored: hidden_act other than "silu", attention
// dropout, Qwen2's sliding window, another rope_type. Throws zt::ConfigError starting with `where`
// naming the key, the expected and the found (another architecture: naming it and the supported
// ones), then validate()s the result.
LlamaConfig llama_config_from_hf_json(const std::string& text, const std::string& where);
// DIR/config.json read (at most 1 MiB) and parsed so; `key` names the setting that gave DIR
// ("model.init_from") in errors. A missing directory or file is a zt::ConfigError.
LlamaConfig read_llama_hf_config(const std::string& dir, const std::string& key);
// The text of that DIR/config.json, with the same checks and errors, unparsed.
std::string read_hf_config_text(const std::string& dir, const std::string& key);
// transformers' class of a shape: "Qwen2ForCausalLM" for qkv_bias, else "LlamaForCausalLM".
std::string llama_hf_architecture(const LlamaConfig& config);
// config.json of `config` as transformers 5 writes it for llama_hf_architecture(config), with
// "dtype" `dtype` ("float32", "bfloat16"). `base`: the text of the config.json the model came from
// ("" for none): its other keys (token ids, ...) are kept, the shape's replaced.
std::string llama_config_to_hf_json(const LlamaConfig& config, const std::string& dtype, const std::string& base);

// Exact trainable parameter count: embeddings V·H (twice untied), per layer the q/k/v/o
// projections, the three MLP projections, their biases and two norms, and the final norm.
int64_t llama_parameter_count(const LlamaConfig& config);

}  // namespace zt
