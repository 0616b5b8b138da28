// A Hugging Face config.json of LlamaForCausalLM or Qwen2ForCausalLM as the decoder's plain data,
// and back (zerotrain/config/llama_config.h). transformers 5 writes the rotary settings as
// rope_parameters {rope_type, rope_theta, factor, ...}; files written by transformers 4 (and most
// uploads) have rope_theta beside rope_scaling {rope_type or type, factor, ...}: both are read.
// Tested in tests/llama_hf_config_test.cpp and, against transformers, tests/hf_llama_test.cpp.
#include "zerotrain/config/llama_config.h"

#include <nlohmann/json.hpp>

#include <sys/stat.h>

#include <fstream>
#include <iterator>
#include <optional>
#include <string>

#include "zerotrain/error.h"

namespace zt {
namespace {

using json = nlohmann::json;
using ordered_json = nlohmann::ordered_json;

constexpr int64_t kMaxConfigBytes = int64_t(1) << 20;

struct Reader {
  const json& cfg;
  const std::string& where;

  [[noreturn]] void fail(const std::string& key, const std::string& expected, const json& found) const {
    throw ConfigError(where + ": config.json's " + key + ": expected " + expected + ", found " + found.dump());
  }
  bool has(const json& in, const char* key) const { return in.contains(key) && !in[key].is_null(); }
  int64_t integer(const char* key, std::optional<int64_t> fallback = std::nullopt) const {
    if (!has(cfg, key)) {
      if (fallback) return *fallback;
      fail(key, "an integer (the key is required)", nullptr);
    }
    const json& v = cfg[key];
    if (!v.is_number_integer() || (v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(INT64_MAX)))
      fail(key, "an integer", v);
    return v.get<int64_t>();
  }
  double number(const json& in, const std::string& prefix, const char* key, double fallback) const {
    if (!has(in, key)) return fallback;
    if (!in[key].is_number()) fail(prefix + key, "a number", in[key]);
    return in[key].get<double>();
  }
  bool boolean(const char* key, bool fallback) const {
    if (!has(cfg, key)) return fallback;
    if (!cfg[key].is_boolean()) fail(key, "true or false", cfg[key]);
    return cfg[key].get<bool>();
  }
};

// "LlamaForCausalLM" / "Qwen2ForCausalLM" from "architectures", else from "model_type".
bool is_qwen2(const json& cfg, const std::string& where) {
  const std::string supported = "LlamaForCausalLM or Qwen2ForCausalLM";
  if (cfg.contains("architectures") && !cfg["architectures"].is_null()) {
    const json& a = cfg["architectures"];
    if (!a.is_array() || a.size() != 1 || !a[0].is_string())
      throw ConfigError(where + ": config.json's architectures: expected one of [\"LlamaForCausalLM\"], "
                        "[\"Qwen2ForCausalLM\"], found " + a.dump());
    const std::string name = a[0].get<std::string>();
    if (name == "LlamaForCausalLM") return false;
    if (name == "Qwen2ForCausalLM") return true;
    throw ConfigError(where + ": config.json's architecture is " + name + "; model.type \"llama\" reads " + supported);
  }
  const std::string hf_model_type = cfg.value("model_type", std::string());
  if (hf_model_type == "llama") return false;
  if (hf_model_type == "qwen2") return true;
  throw ConfigError(where + ": config.json names no architecture and its model_type is \"" + hf_model_type +
                    "\"; model.type \"llama\" reads " + supported + " (model_type \"llama\" or \"qwen2\")");
}

}  // namespace

LlamaConfig llama_config_from_hf_json(const std::string& text, const std::string& where) {
  json cfg;
  try {
    cfg = json::parse(text);
  } catch (const json::exception& e) {
    throw ConfigError(where + ": config.json is not valid JSON (" + e.what() + ")");
  }
  if (!cfg.is_object()) throw ConfigError(where + ": config.json is not a JSON object");
  const bool qwen2 = is_qwen2(cfg, where);
  const Reader r{cfg, where};
  LlamaConfig c;
  c.vocab_size = r.integer("vocab_size");
  c.hidden_size = r.integer("hidden_size");
  c.intermediate_size = r.integer("intermediate_size");
  c.num_hidden_layers = r.integer("num_hidden_layers");
  c.num_attention_heads = r.integer("num_attention_heads");
  c.num_key_value_heads = r.integer("num_key_value_heads", c.num_attention_heads);
  // Qwen2 has no head_dim key: hidden_size / num_attention_heads, as when Llama's is null.
  c.head_dim = qwen2 ? 0 : r.integer("head_dim", int64_t{0});
  c.max_position_embeddings = r.integer("max_position_embeddings", qwen2 ? 32768 : 2048);
  c.rms_norm_eps = r.number(cfg, "", "rms_norm_eps", 1e-6);
  c.initializer_range = r.number(cfg, "", "initializer_range", 0.02);
  c.tie_word_embeddings = r.boolean("tie_word_embeddings", false);
  if (qwen2) {
    c.qkv_bias = true;  // Qwen2's q, k and v projections always carry a bias, its o_proj none
    if (r.boolean("use_sliding_window", false))
      r.fail("use_sliding_window", "false (sliding-window attention is not implemented)", true);
  } else {
    c.attention_bias = r.boolean("attention_bias", false);
    c.mlp_bias = r.boolean("mlp_bias", false);
  }
  if (r.has(cfg, "hidden_act") && cfg["hidden_act"] != "silu") r.fail("hidden_act", "\"silu\"", cfg["hidden_act"]);
  if (r.number(cfg, "", "attention_dropout", 0.0) != 0.0)
    r.fail("attention_dropout", "0 (the decoder has no dropout)", cfg["attention_dropout"]);

  // The rotary settings: transformers 5's rope_parameters, or 4's rope_theta and rope_scaling.
  const bool v5 = r.has(cfg, "rope_parameters");
  const std::string block = v5 ? "rope_parameters" : "rope_scaling";
  static const json kNone = json::object();
  const json& rope = v5 ? cfg["rope_parameters"] : r.has(cfg, "rope_scaling") ? cfg["rope_scaling"] : kNone;
  if (!rope.is_object()) r.fail(block, "an object", rope);
  c.rope_theta = r.number(v5 ? rope : cfg, v5 ? block + "." : "", "rope_theta", 10000.0);
  const char* kind_key = rope.contains("rope_type") ? "rope_type" : "type";
  if (r.has(rope, kind_key)) {
    if (!rope[kind_key].is_string()) r.fail(block + "." + kind_key, "a string", rope[kind_key]);
    c.rope_scaling.type = rope[kind_key].get<std::string>();
  }
  const std::string p = block + ".";
  c.rope_scaling.factor = r.number(rope, p, "factor", 1.0);
  c.rope_scaling.low_freq_factor = r.number(rope, p, "low_freq_factor", 1.0);
  c.rope_scaling.high_freq_factor = r.number(rope, p, "high_freq_factor", 4.0);
  if (r.has(rope, "original_max_position_embeddings")) {
    const json& v = rope["original_max_position_embeddings"];
    if (!v.is_number_integer()) r.fail(p + "original_max_position_embeddings", "an integer", v);
    c.rope_scaling.original_max_position_embeddings = v.get<int64_t>();
  }
  try {
    c.validate();
  } catch (const ConfigError& e) {
    throw ConfigError(where + ": config.json: " + e.what());
  }
  return c;
}

std::string read_hf_config_text(const std::string& dir, const std::string& key) {
  const std::string where = key + " '" + dir + "'";
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
    throw ConfigError(where + ": expected a Hugging Face model directory, found no directory");
  const std::string path = dir + "/config.json";
  if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode))
    throw ConfigError(where + ": expected a config.json in it, found none");
  if (st.st_size > kMaxConfigBytes)
    throw ConfigError(where + ": config.json has " + std::to_string(st.st_size) + " bytes, expected at most " +
                      std::to_string(kMaxConfigBytes));
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ConfigError(where + ": cannot read its config.json");
  return std::string(std::istreambuf_iterator<char>(in), {});
}

LlamaConfig read_llama_hf_config(const std::string& dir, const std::string& key) {
  return llama_config_from_hf_json(read_hf_config_text(dir, key), key + " '" + dir + "'");
}

std::string llama_hf_architecture(const LlamaConfig& c) { return c.qkv_bias ? "Qwen2ForCausalLM" : "LlamaForCausalLM"; }

std::string llama_config_to_hf_json(const LlamaConfig& c, const std::string& dtype, const std::string& base) {
  const bool qwen2 = c.qkv_bias;
  if (qwen2 && (c.attention_bias || c.mlp_bias))
    throw ConfigError("export --format hf: a model with q/k/v biases (Qwen2) and attention_bias or mlp_bias has no "
                      "transformers class");
  ordered_json j = ordered_json::object();
  if (!base.empty()) {
    try {
      j = ordered_json::parse(base);
    } catch (const ordered_json::exception&) {
      j = ordered_json::object();
    }
    if (!j.is_object()) j = ordered_json::object();
    // Keys of the other class, or of the rotary form this file does not write.
    for (const char* stale : {"rope_scaling", "rope_theta", "torch_dtype", "attention_bias", "mlp_bias", "head_dim",
                              "use_sliding_window", "sliding_window", "max_window_layers", "layer_types", "pretraining_tp"})
      j.erase(stale);
  }
  j["architectures"] = {llama_hf_architecture(c)};
  j["model_type"] = qwen2 ? "qwen2" : "llama";
  j["vocab_size"] = c.vocab_size;
  j["hidden_size"] = c.hidden_size;
  j["intermediate_size"] = c.intermediate_size;
  j["num_hidden_layers"] = c.num_hidden_layers;
  j["num_attention_heads"] = c.num_attention_heads;
  j["num_key_value_heads"] = c.num_key_value_heads;
  j["hidden_act"] = "silu";
  j["max_position_embeddings"] = c.max_position_embeddings;
  j["rms_norm_eps"] = c.rms_norm_eps;
  j["initializer_range"] = c.initializer_range;
  j["tie_word_embeddings"] = c.tie_word_embeddings;
  j["attention_dropout"] = 0.0;
  if (qwen2) {
    // Qwen2 has no head_dim key: its head is hidden_size / num_attention_heads.
    if (c.resolved_head_dim() * c.num_attention_heads != c.hidden_size)
      throw ConfigError("export --format hf: Qwen2ForCausalLM needs head_dim = hidden_size / num_attention_heads, found "
                        "head_dim " + std::to_string(c.resolved_head_dim()));
    j["use_sliding_window"] = false;
    j["sliding_window"] = nullptr;
    j["max_window_layers"] = c.num_hidden_layers;
    j["layer_types"] = std::vector<std::string>(size_t(c.num_hidden_layers), "full_attention");
  } else {
    j["head_dim"] = c.resolved_head_dim();
    j["attention_bias"] = c.attention_bias;
    j["mlp_bias"] = c.mlp_bias;
    j["pretraining_tp"] = 1;
  }
  ordered_json rope = ordered_json::object();
  rope["rope_type"] = c.rope_scaling.type;
  rope["rope_theta"] = c.rope_theta;
  if (c.rope_scaling.type != "default") rope["factor"] = c.rope_scaling.factor;
  if (c.rope_scaling.type == "llama3") {
    rope["low_freq_factor"] = c.rope_scaling.low_freq_factor;
    rope["high_freq_factor"] = c.rope_scaling.high_freq_factor;
    rope["original_max_position_embeddings"] = c.rope_scaling.original_max_position_embeddings;
  }
  j["rope_parameters"] = rope;
  j["dtype"] = dtype;
  return j.dump(2) + "\n";
}

}  // namespace zt
