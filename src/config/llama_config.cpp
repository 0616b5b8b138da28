// The Llama decoder's plain data: validation, presets and parameter count. Tested with the model
// in tests/llama_test.cpp. Declared in zerotrain/config/llama_config.h.
#include "zerotrain/config/llama_config.h"

#include <string>
#include <vector>

#include "zerotrain/error.h"

namespace zt {
namespace {

LlamaConfig tiny() { return LlamaConfig{}; }

LlamaConfig llama_1b() {
  LlamaConfig c;
  c.vocab_size = 128256;
  c.hidden_size = 2048;
  c.intermediate_size = 8192;
  c.num_hidden_layers = 16;
  c.num_attention_heads = 32;
  c.num_key_value_heads = 8;
  c.head_dim = 64;
  c.max_position_embeddings = 131072;
  c.rms_norm_eps = 1e-5;
  c.rope_theta = 500000.0;
  c.rope_scaling = RopeScaling{"llama3", 32.0, 1.0, 4.0, 8192};
  c.tie_word_embeddings = true;
  return c;
}

void require(bool ok, const std::string& field, const std::string& expected, const std::string& found) {
  if (!ok) throw ConfigError("llama " + field + ": expected " + expected + ", found " + found);
}

}  // namespace

void LlamaConfig::validate() const {
  const auto positive = [](const char* field, int64_t v) {
    require(v > 0, field, "a positive integer", std::to_string(v));
  };
  positive("vocab_size", vocab_size);
  positive("hidden_size", hidden_size);
  positive("intermediate_size", intermediate_size);
  positive("num_hidden_layers", num_hidden_layers);
  positive("num_attention_heads", num_attention_heads);
  positive("num_key_value_heads", num_key_value_heads);
  positive("max_position_embeddings", max_position_embeddings);
  // The bounds of the model.* keys (src/config/schema_zerotrain.cpp), for every source of a shape:
  // a config.json or a checkpoint's saved keys are untrusted, and within these the parameter count
  // and the estimate's byte arithmetic stay inside 64 bits. Checked before anything multiplies.
  const auto at_most = [](const char* field, int64_t v, int64_t bound, const char* ours) {
    require(v <= bound, field, "at most " + std::to_string(bound) + " (the bound of " + ours + ")", std::to_string(v));
  };
  at_most("vocab_size", vocab_size, kMaxLlamaVocab, "model.vocab_size");
  at_most("hidden_size", hidden_size, kMaxLlamaWidth, "model.n_embd");
  at_most("intermediate_size", intermediate_size, kMaxLlamaIntermediate, "model.intermediate_size");
  at_most("num_hidden_layers", num_hidden_layers, kMaxLlamaLayers, "model.n_layer");
  at_most("num_attention_heads", num_attention_heads, kMaxLlamaHeads, "model.n_head");
  at_most("num_key_value_heads", num_key_value_heads, kMaxLlamaHeads, "model.n_kv_head");
  at_most("max_position_embeddings", max_position_embeddings, kMaxLlamaPositions, "model.context_length");
  // An explicit head_dim makes the attention's width heads x head_dim, which the model.* keys keep
  // at n_embd: the same bound.
  require(head_dim <= kMaxLlamaWidth / num_attention_heads, "head_dim",
          "at most " + std::to_string(kMaxLlamaWidth / num_attention_heads) + " (num_attention_heads x head_dim at most " +
              std::to_string(kMaxLlamaWidth) + ", the bound of model.n_embd)",
          std::to_string(head_dim));
  require(head_dim >= 0, "head_dim", "0 (hidden_size / num_attention_heads) or a positive integer",
          std::to_string(head_dim));
  require(head_dim > 0 || hidden_size % num_attention_heads == 0, "hidden_size",
          "a multiple of num_attention_heads (" + std::to_string(num_attention_heads) + ") when head_dim is not given",
          std::to_string(hidden_size));
  require(num_attention_heads % num_key_value_heads == 0, "num_key_value_heads",
          "a divisor of num_attention_heads (" + std::to_string(num_attention_heads) + ")",
          std::to_string(num_key_value_heads));
  require(resolved_head_dim() % 2 == 0, "head_dim", "an even number (rotary embeddings rotate pairs)",
          std::to_string(resolved_head_dim()));
  require(rms_norm_eps > 0, "rms_norm_eps", "a positive number", std::to_string(rms_norm_eps));
  require(rope_theta > 0, "rope_theta", "a positive number", std::to_string(rope_theta));
  require(initializer_range >= 0, "initializer_range", "a number >= 0", std::to_string(initializer_range));
  const std::string& type = rope_scaling.type;
  require(type == "default" || type == "linear" || type == "llama3", "rope_scaling.rope_type",
          "one of \"default\", \"linear\", \"llama3\"", "\"" + type + "\"");
  if (type != "default")
    require(rope_scaling.factor > 0, "rope_scaling.factor", "a positive number", std::to_string(rope_scaling.factor));
  if (type == "llama3") {
    require(rope_scaling.high_freq_factor > rope_scaling.low_freq_factor && rope_scaling.low_freq_factor > 0,
            "rope_scaling.high_freq_factor", "above low_freq_factor (" + std::to_string(rope_scaling.low_freq_factor) +
                                                 "), both positive",
            std::to_string(rope_scaling.high_freq_factor));
    positive("rope_scaling.original_max_position_embeddings", rope_scaling.original_max_position_embeddings);
  }
}

LlamaConfig llama_preset(const std::string& name) {
  if (name == "llama-tiny") return tiny();
  if (name == "llama-1b") return llama_1b();
  std::string valid;
  for (const std::string& n : llama_preset_names()) valid += (valid.empty() ? "" : ", ") + n;
  throw ConfigError("model.preset: expected one of " + valid + ", found \"" + name + "\"");
}

std::vector<std::string> llama_preset_names() { return {"llama-tiny", "llama-1b"}; }

int64_t llama_parameter_count(const LlamaConfig& c) {
  const int64_t H = c.hidden_size, hd = c.resolved_head_dim();
  const int64_t q = c.num_attention_heads * hd, kv = c.num_key_value_heads * hd;
  const bool qkv_bias = c.attention_bias || c.qkv_bias;
  int64_t layer = H * q + 2 * H * kv + q * H + 3 * H * c.intermediate_size + 2 * H;
  if (qkv_bias) layer += q + 2 * kv;
  if (c.attention_bias) layer += H;
  if (c.mlp_bias) layer += 2 * c.intermediate_size + H;
  const int64_t embeddings = c.vocab_size * H * (c.tie_word_embeddings ? 1 : 2);
  return embeddings + c.num_hidden_layers * layer + H;
}

}  // namespace zt
