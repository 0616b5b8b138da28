// The Llama-family decoder in the Hugging Face layout: its tensors (transformers' names, as
// models/llama.h registers them), the export's config.json and tokenizer files, and the shape of
// a checkpoint from its resolved keys. Tested against transformers in tests/hf_llama_test.cpp.
#include "checkpoint/hf.h"

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

#include "checkpoint/hf_files.h"
#include "zerotrain/config/config.h"
#include "zerotrain/error.h"

namespace zt {

using namespace hf_detail;

namespace hf_detail {

std::vector<CheckpointParameter> llama_tensors(const LlamaConfig& c) {
  const int64_t H = c.hidden_size, I = c.intermediate_size, d = c.resolved_head_dim();
  const int64_t q = c.num_attention_heads * d, kv = c.num_key_value_heads * d;
  const bool qkv_bias = c.attention_bias || c.qkv_bias;
  std::vector<CheckpointParameter> t = {{"model.embed_tokens.weight", {c.vocab_size, H}}};
  auto linear = [&](const std::string& name, int64_t out, int64_t in, bool bias) {
    t.push_back({name + ".weight", {out, in}});
    if (bias) t.push_back({name + ".bias", {out}});
  };
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    linear(p + "self_attn.q_proj", q, H, qkv_bias);
    linear(p + "self_attn.k_proj", kv, H, qkv_bias);
    linear(p + "self_attn.v_proj", kv, H, qkv_bias);
    linear(p + "self_attn.o_proj", H, q, c.attention_bias);
    linear(p + "mlp.gate_proj", I, H, c.mlp_bias);
    linear(p + "mlp.up_proj", I, H, c.mlp_bias);
    linear(p + "mlp.down_proj", H, I, c.mlp_bias);
    t.push_back({p + "input_layernorm.weight", {H}});
    t.push_back({p + "post_attention_layernorm.weight", {H}});
  }
  t.push_back({"model.norm.weight", {H}});
  if (!c.tie_word_embeddings) t.push_back({"lm_head.weight", {c.vocab_size, H}});
  return t;
}

}  // namespace hf_detail

int64_t write_hf_llama_model(const std::vector<HfTensor>& tensors, const LlamaConfig& config, const fs::path& dir,
                             at::ScalarType dtype, int64_t max_shard_bytes, const std::string& base_config) {
  check_export_options(dtype, max_shard_bytes);
  const std::string shape = std::to_string(config.num_hidden_layers) + " layers, width " +
                            std::to_string(config.hidden_size) + (config.tie_word_embeddings ? ", tied head" : "");
  const std::vector<const HfTensor*> ordered = order_tensors(tensors, llama_tensors(config), "Llama", shape);
  const std::string text = llama_config_to_hf_json(config, dtype_name(dtype), base_config);
  return write_hf_layout(
      ordered, [](const std::string& name) { return name; }, [](const std::string&) { return false; }, text, dir, dtype,
      max_shard_bytes);
}

std::vector<std::string> copy_hf_tokenizer_files(const fs::path& from, const fs::path& to) {
  std::vector<std::string> copied;
  for (const char* name : {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                           "generation_config.json"}) {
    std::error_code ec;
    if (!fs::is_regular_file(from / name, ec)) continue;
    fs::copy_file(from / name, to / name, fs::copy_options::overwrite_existing, ec);
    if (ec) throw DataError("export: cannot copy '" + (from / name).string() + "' into '" + to.string() + "': " + ec.message());
    copied.push_back(name);
  }
  return copied;
}

std::string carried_hf_config(const std::map<std::string, std::string>& scalars) {
  const auto it = scalars.find(std::string("client.") + kCarriedHfConfigKey);
  return it == scalars.end() ? "" : it->second;
}

LlamaConfig llama_config_from_resolved(const std::map<std::string, std::string>& resolved, const std::string& where,
                                       std::string& source_dir, const std::string& carried) {
  auto value = [&](const std::string& key) -> json {
    auto it = resolved.find(key);
    if (it == resolved.end())
      throw DataError(where + ": the saved configuration has no '" + key + "', so the Llama's shape is not known");
    try {
      return json::parse(it->second);
    } catch (const json::exception&) {
      throw DataError(where + ": the saved configuration's '" + key + "' is not JSON: " + it->second);
    }
  };
  try {
    TrainConfig config;
    ModelConfig& m = config.model;
    m.type = "llama";
    m.init_from = value("model.init_from").get<std::string>();
    m.config_from = value("model.config_from").get<std::string>();
    m.preset = value("model.preset").get<std::string>();
    for (const auto& [key, field] : std::initializer_list<std::pair<const char*, int64_t*>>{
             {"model.n_layer", &m.n_layer}, {"model.n_head", &m.n_head}, {"model.n_kv_head", &m.n_kv_head},
             {"model.n_embd", &m.n_embd}, {"model.intermediate_size", &m.intermediate_size},
             {"model.vocab_size", &m.vocab_size}, {"model.context_length", &m.context_length}})
      *field = value(key).get<int64_t>();
    source_dir = !m.init_from.empty() ? m.init_from : m.config_from;
    const std::string key = !m.init_from.empty() ? "model.init_from" : "model.config_from";
    if (!source_dir.empty() && !carried.empty())
      return llama_config_from_hf_json(carried, where + ": the config.json of " + key + " '" + source_dir + "' it carries");
    std::error_code ec;
    if (!source_dir.empty() && !fs::is_directory(source_dir, ec))
      throw DataError(where + ": the Llama's shape is the config.json of " + key + " '" + source_dir +
                      "', which is gone, and this checkpoint does not carry it (saved before checkpoints did): "
                      "put the directory back to read it");
    return llama_config_of(config);
  } catch (const json::exception& e) {
    throw DataError(where + ": the saved configuration's model keys are malformed (" + e.what() + ")");
  } catch (const ConfigError& e) {
    throw DataError(where + ": the Llama's shape is not known: " + e.what());
  }
}

}  // namespace zt
