// GPT-2 in the Hugging Face layout: transformers' names of the GPT's tensors, its config.json, and
// the GPT's configuration from a checkpoint's resolved keys.
#include "checkpoint/hf.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>

#include "checkpoint/checkpoint.h"
#include "checkpoint/json_bounds.h"
#include "checkpoint/safetensors.h"
#include "zerotrain/config/config.h"
#include "zerotrain/error.h"
#include "checkpoint/hf_files.h"

namespace zt {

// The shared constants and helpers of hf_files.h.
using namespace hf_detail;

namespace hf_detail {

// Every tensor of our GPT of this shape, in registration order.
std::vector<CheckpointParameter> gpt_tensors(const GPTConfig& c) {
  const int64_t C = c.n_embd;
  std::vector<CheckpointParameter> out = {{"wte.weight", {c.vocab_size, C}}, {"wpe.weight", {c.context_length, C}}};
  for (int64_t i = 0; i < c.n_layer; ++i) {
    const std::string b = "blocks." + std::to_string(i) + ".";
    for (auto& [name, shape] : std::vector<std::pair<std::string, std::vector<int64_t>>>{
             {"ln_1.weight", {C}}, {"ln_1.bias", {C}}, {"attn.c_attn.weight", {3 * C, C}}, {"attn.c_attn.bias", {3 * C}},
             {"attn.c_proj.weight", {C, C}}, {"attn.c_proj.bias", {C}}, {"ln_2.weight", {C}}, {"ln_2.bias", {C}},
             {"mlp.c_fc.weight", {4 * C, C}}, {"mlp.c_fc.bias", {4 * C}}, {"mlp.c_proj.weight", {C, 4 * C}},
             {"mlp.c_proj.bias", {C}}})
      out.push_back({b + name, shape});
  }
  out.push_back({"ln_f.weight", {C}});
  out.push_back({"ln_f.bias", {C}});
  return out;
}

}  // namespace hf_detail

std::string hf_gpt2_name(const std::string& name) {
  if (name.rfind("blocks.", 0) == 0) return "transformer.h." + name.substr(7);
  if (name == "wte.weight" || name == "wpe.weight" || name == "ln_f.weight" || name == "ln_f.bias")
    return "transformer." + name;
  return "";
}

bool hf_gpt2_transposed(const std::string& name) {
  return name.rfind("blocks.", 0) == 0 &&
         (ends_with(name, ".attn.c_attn.weight") || ends_with(name, ".attn.c_proj.weight") ||
          ends_with(name, ".mlp.c_fc.weight") || ends_with(name, ".mlp.c_proj.weight"));
}

GPTConfig gpt_config_from_resolved(const std::map<std::string, std::string>& resolved, const std::string& where) {
  auto value = [&](const std::string& key) -> json {
    auto it = resolved.find(key);
    if (it == resolved.end())
      throw DataError(where + ": the saved configuration has no '" + key +
                      "', so the model's shape (n_head) is not known; a Hugging Face export needs it");
    try {
      return json::parse(it->second);
    } catch (const json::exception&) {
      throw DataError(where + ": the saved configuration's '" + key + "' is not JSON: " + it->second);
    }
  };
  try {
    GPTConfig gpt = gpt_preset(value("model.preset").get<std::string>());
    // A saved value is bounded as the configuration bounds the key (src/config/schema_zerotrain.cpp)
    // before the model is built from it: a damaged or hostile checkpoint cannot ask for 2^40 layers.
    auto override_int = [&](const std::string& key, int64_t& field, int64_t bound) {
      if (resolved.count(key) == 0) return;
      const int64_t v = value(key).get<int64_t>();
      if (v > bound)
        throw DataError(where + ": the saved configuration's " + key + ": expected at most " + std::to_string(bound) +
                        ", found " + std::to_string(v));
      if (v > 0) field = v;
    };
    override_int("model.n_layer", gpt.n_layer, int64_t(1) << 16);
    override_int("model.n_head", gpt.n_head, int64_t(1) << 16);
    override_int("model.n_embd", gpt.n_embd, int64_t(1) << 20);
    override_int("model.vocab_size", gpt.vocab_size, int64_t(1) << 24);
    override_int("model.context_length", gpt.context_length, int64_t(1) << 24);
    if (resolved.count("model.dropout") && value("model.dropout").get<double>() >= 0)
      gpt.dropout = value("model.dropout").get<double>();
    gpt.validate();
    return gpt;
  } catch (const json::exception& e) {
    throw DataError(where + ": the saved configuration's model keys are malformed (" + e.what() + ")");
  } catch (const ConfigError& e) {
    throw DataError(where + ": the saved configuration's model is not a GPT this build knows (" + e.what() + ")");
  }
}

namespace {

std::vector<const HfTensor*> ordered_gpt_tensors(const std::vector<HfTensor>& tensors, const GPTConfig& config) {
  for (const HfTensor& t : tensors)
    if (hf_gpt2_name(t.name).empty())
      throw DataError("export --format hf: tensor '" + t.name + "' is not one of the GPT's (a Hugging Face GPT-2 "
                      "export needs the reference GPT model)");
  return order_tensors(tensors, gpt_tensors(config), "GPT",
                       std::to_string(config.n_layer) + " layers, width " + std::to_string(config.n_embd));
}

std::string hf_config_json(const GPTConfig& c, at::ScalarType dtype) {
  ordered_json j;
  j["architectures"] = {"GPT2LMHeadModel"};
  j["model_type"] = "gpt2";
  j["vocab_size"] = c.vocab_size;
  j["n_positions"] = c.context_length;
  j["n_embd"] = c.n_embd;
  j["n_layer"] = c.n_layer;
  j["n_head"] = c.n_head;
  j["n_inner"] = nullptr;  // 4 × n_embd, as ours
  j["activation_function"] = "gelu_new";  // GELU, tanh approximation
  j["layer_norm_epsilon"] = 1e-5;         // LibTorch's LayerNorm default, which the GPT uses
  j["resid_pdrop"] = c.dropout;
  j["embd_pdrop"] = c.dropout;
  j["attn_pdrop"] = c.dropout;
  j["initializer_range"] = 0.02;
  j["scale_attn_weights"] = true;
  j["scale_attn_by_inverse_layer_idx"] = false;
  j["reorder_and_upcast_attn"] = false;
  j["tie_word_embeddings"] = true;
  j["use_cache"] = true;
  // GPT-2's end-of-text token is its last one; for another vocabulary the last id stands in.
  j["bos_token_id"] = c.vocab_size - 1;
  j["eos_token_id"] = c.vocab_size - 1;
  j["dtype"] = dtype_name(dtype);
  j["torch_dtype"] = dtype_name(dtype);
  return j.dump(2) + "\n";
}

}  // namespace

int64_t write_hf_model(const std::vector<HfTensor>& tensors, const GPTConfig& config, const fs::path& dir,
                       at::ScalarType dtype, int64_t max_shard_bytes) {
  check_export_options(dtype, max_shard_bytes);
  return write_hf_layout(ordered_gpt_tensors(tensors, config), hf_gpt2_name, hf_gpt2_transposed,
                         hf_config_json(config, dtype), dir, dtype, max_shard_bytes);
}

}  // namespace zt
