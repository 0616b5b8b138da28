// BERT in the Hugging Face layout: transformers' names of the BERT's tensors, its config.json, and
// the BERT's configuration from a checkpoint's resolved keys.
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

BertConfig bert_config_from_resolved(const std::map<std::string, std::string>& resolved, const std::string& where) {
  // The configuration again, from the saved keys of its model block: bert_config_of applies the
  // preset and the overrides exactly as the run that saved it did.
  std::vector<std::string> overrides = {"model.type=bert"};
  for (const char* key : {"model.preset", "model.n_layer", "model.n_head", "model.n_embd", "model.vocab_size",
                          "model.context_length", "model.dropout", "model.pre_layer_norm", "model.next_sentence"})
    if (auto it = resolved.find(key); it != resolved.end() && it->second != "null") {
      // The sizes' "from the preset" (0, and -1 for dropout) is no value to set.
      const json v = json::parse(it->second, nullptr, /*allow_exceptions=*/false);
      if (v.is_number() && (v.get<double>() < 0 || (v.is_number_integer() && v.get<int64_t>() == 0))) continue;
      overrides.push_back(std::string(key) + "=" + it->second);
    }
  try {
    return bert_config_of(parse_config("{}", overrides, 1));
  } catch (const ConfigError& e) {
    throw DataError(where + ": the saved configuration's model is not a BERT this build knows (" + e.what() + ")");
  }
}

std::string hf_bert_name(const std::string& name) {
  // Prefix rules, checked in order; the layer index is carried over.
  static const std::vector<std::pair<std::string, std::string>> kFixed = {
      {"embeddings.word_embeddings.", "bert.embeddings.word_embeddings."},
      {"embeddings.position_embeddings.", "bert.embeddings.position_embeddings."},
      {"embeddings.token_type_embeddings.", "bert.embeddings.token_type_embeddings."},
      {"embeddings.layer_norm.", "bert.embeddings.LayerNorm."},
      {"mlm.dense.", "cls.predictions.transform.dense."},
      {"mlm.layer_norm.", "cls.predictions.transform.LayerNorm."},
      {"nsp.pooler.", "bert.pooler.dense."},
      {"nsp.classifier.", "cls.seq_relationship."}};
  static const std::vector<std::pair<std::string, std::string>> kLayer = {
      {"attention.query.", "attention.self.query."},   {"attention.key.", "attention.self.key."},
      {"attention.value.", "attention.self.value."},   {"attention.output.", "attention.output.dense."},
      {"attention_norm.", "attention.output.LayerNorm."}, {"intermediate.", "intermediate.dense."},
      {"output.", "output.dense."},                     {"output_norm.", "output.LayerNorm."}};
  if (name == "mlm.bias") return "cls.predictions.bias";
  for (const auto& [ours, theirs] : kFixed)
    if (name.rfind(ours, 0) == 0) return theirs + name.substr(ours.size());
  if (name.rfind("layers.", 0) == 0) {
    const size_t dot = name.find('.', 7);
    if (dot == std::string::npos) return "";
    const std::string index = name.substr(7, dot - 7), rest = name.substr(dot + 1);
    if (index.empty() || index.find_first_not_of("0123456789") != std::string::npos) return "";
    for (const auto& [ours, theirs] : kLayer)
      if (rest.rfind(ours, 0) == 0) return "bert.encoder.layer." + index + "." + theirs + rest.substr(ours.size());
  }
  return "";  // final_norm (pre-LN) has no place in transformers' BERT
}

namespace {

// BertImpl's registration order (models/bert.h), with shapes.
std::vector<CheckpointParameter> bert_tensors(const BertConfig& c) {
  const int64_t H = c.hidden, I = c.intermediate;
  std::vector<CheckpointParameter> t = {{"embeddings.word_embeddings.weight", {c.vocab_size, H}},
                                        {"embeddings.position_embeddings.weight", {c.max_positions, H}},
                                        {"embeddings.token_type_embeddings.weight", {c.type_vocab_size, H}},
                                        {"embeddings.layer_norm.weight", {H}},
                                        {"embeddings.layer_norm.bias", {H}}};
  for (int64_t l = 0; l < c.n_layer; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    for (const char* m : {"attention.query", "attention.key", "attention.value", "attention.output"}) {
      t.push_back({p + m + ".weight", {H, H}});
      t.push_back({p + m + ".bias", {H}});
    }
    t.push_back({p + "attention_norm.weight", {H}});
    t.push_back({p + "attention_norm.bias", {H}});
    t.push_back({p + "intermediate.weight", {I, H}});
    t.push_back({p + "intermediate.bias", {I}});
    t.push_back({p + "output.weight", {H, I}});
    t.push_back({p + "output.bias", {H}});
    t.push_back({p + "output_norm.weight", {H}});
    t.push_back({p + "output_norm.bias", {H}});
  }
  t.push_back({"mlm.bias", {c.vocab_size}});
  t.push_back({"mlm.dense.weight", {H, H}});
  t.push_back({"mlm.dense.bias", {H}});
  t.push_back({"mlm.layer_norm.weight", {H}});
  t.push_back({"mlm.layer_norm.bias", {H}});
  if (c.next_sentence) {
    t.push_back({"nsp.pooler.weight", {H, H}});
    t.push_back({"nsp.pooler.bias", {H}});
    t.push_back({"nsp.classifier.weight", {2, H}});
    t.push_back({"nsp.classifier.bias", {2}});
  }
  return t;
}

std::string hf_bert_config_json(const BertConfig& c, at::ScalarType dtype) {
  ordered_json j;
  // With the NSP head the pre-training model; without it the masked-LM one (no pooler).
  j["architectures"] = {c.next_sentence ? "BertForPreTraining" : "BertForMaskedLM"};
  j["model_type"] = "bert";
  j["vocab_size"] = c.vocab_size;
  j["hidden_size"] = c.hidden;
  j["num_hidden_layers"] = c.n_layer;
  j["num_attention_heads"] = c.n_head;
  j["intermediate_size"] = c.intermediate;
  j["hidden_act"] = "gelu";  // exact (erf), as ours
  j["hidden_dropout_prob"] = c.dropout;
  j["attention_probs_dropout_prob"] = c.dropout;
  j["max_position_embeddings"] = c.max_positions;
  j["type_vocab_size"] = c.type_vocab_size;
  j["initializer_range"] = 0.02;
  j["layer_norm_eps"] = c.layer_norm_eps;
  j["position_embedding_type"] = "absolute";
  j["tie_word_embeddings"] = true;
  j["use_cache"] = true;
  j["dtype"] = dtype_name(dtype);
  j["torch_dtype"] = dtype_name(dtype);
  return j.dump(2) + "\n";
}

}  // namespace

int64_t write_hf_bert_model(const std::vector<HfTensor>& tensors, const BertConfig& config, const fs::path& dir,
                            at::ScalarType dtype, int64_t max_shard_bytes) {
  check_export_options(dtype, max_shard_bytes);
  if (config.pre_layer_norm)
    throw ConfigError("export --format hf: model.pre_layer_norm true has no Hugging Face BERT layout (transformers' "
                      "BERT is post-LayerNorm); expected false, or export --format safetensors");
  for (const HfTensor& t : tensors)
    if (hf_bert_name(t.name).empty())
      throw DataError("export --format hf: tensor '" + t.name + "' is not one of the BERT's (a Hugging Face BERT "
                      "export needs the reference BERT model)");
  const std::vector<const HfTensor*> ordered =
      order_tensors(tensors, bert_tensors(config), "BERT",
                    std::to_string(config.n_layer) + " layers, width " + std::to_string(config.hidden) +
                        (config.next_sentence ? ", with the NSP head" : ", without the NSP head"));
  return write_hf_layout(
      ordered, hf_bert_name, [](const std::string&) { return false; }, hf_bert_config_json(config, dtype), dir, dtype,
      max_shard_bytes);
}

}  // namespace zt
