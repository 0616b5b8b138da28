// Hugging Face GPT-2 and Llama-family (LlamaForCausalLM, Qwen2ForCausalLM) weights in and out,
// and BERT weights out (docs/checkpoint.md "Hugging Face", docs/llama.md). Internal; the CLI's
// `export --format hf` and `export --init`, and the trainer's model.init_from use it.
//
// The Llama's names are transformers' own (models/llama.h), nothing is transposed, and a tied
// head has no lm_head.weight (transformers ties it on load and does not save it).
//
// Names: zerotrain's GPT (models/gpt.h) and transformers' GPT2LMHeadModel hold the same tensors;
// "wte.weight" is "transformer.wte.weight", "blocks.N.*" is "transformer.h.N.*", "ln_f.*" is
// "transformer.ln_f.*". transformers' GPT-2 keeps its projections (attn.c_attn, attn.c_proj,
// mlp.c_fc, mlp.c_proj) as Conv1D, whose weight is [in, out]: the transpose of our Linear's
// [out, in]. The head is tied to wte in both, so no lm_head.weight is written (transformers ties
// it on load); the causal-mask buffer attn.bias is not persistent in transformers and not written.
//
// Contract
// - write_hf_model writes DIR/config.json and DIR/model.safetensors, or, when the tensors exceed
//   max_shard_bytes, DIR/model-0000K-of-0000N.safetensors and DIR/model.safetensors.index.json
//   (the layout of transformers' save_pretrained: tensors in order, a new shard when the next
//   tensor would take the current one past the limit, a larger tensor alone). Streams tensor by
//   tensor (memory: about one tensor); every file appears when complete (".partial", renamed).
//   A tensor that is not a GPT-2 tensor of `config`'s shape, or a missing one, is a zt::DataError
//   before anything is written.
// - HfModelReader opens a directory written so (or by save_pretrained: model.safetensors, or
//   sharded with the index) and checks its config.json against the model's shape: a mismatch is
//   a zt::ConfigError naming the key, both values and the directory. The safetensors headers are
//   validated as the reader of our own files does (bounds before parsing, byte ranges inside the
//   file), except that files written by others carry no checksums. read() reads exactly the byte
//   ranges holding the elements asked for (for a transposed projection: the owned rows of every
//   column, so a little more at a range's ends) and converts fp32, fp16 or bf16 to fp32.
//   bytes_read() counts the bytes read from the tensors' data (headers not included).
// - Not thread-safe.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "zerotrain/config/bert_config.h"
#include "zerotrain/config/gpt_config.h"
#include "zerotrain/config/llama_config.h"
#include "zerotrain/checkpoint/weight_reader.h"

namespace zt {

// transformers' GPT-2 name of one of our GPT's tensors ("" when it has none), and whether it is
// stored transposed there.
std::string hf_gpt2_name(const std::string& name);
bool hf_gpt2_transposed(const std::string& name);

// transformers' save_pretrained default for max_shard_size (of the pinned version).
int64_t hf_default_max_shard_bytes();
// "5GB", "50MB", "1GiB", "123" (bytes) as transformers reads them; zt::ConfigError otherwise.
int64_t parse_shard_size(const std::string& text);

struct HfTensor {
  std::string name;  // our name
  std::vector<int64_t> shape;
  std::function<at::Tensor()> value;  // the whole tensor, fp32, in our layout
};

// Returns the bytes written (all files).
int64_t write_hf_model(const std::vector<HfTensor>& tensors, const GPTConfig& config,
                       const std::filesystem::path& dir, at::ScalarType dtype, int64_t max_shard_bytes);

// The same for the reference BERT (models/bert.h) as transformers' BertForPreTraining (with the
// NSP head) or BertForMaskedLM (without): "embeddings.*" is "bert.embeddings.*" (layer_norm:
// LayerNorm), "layers.N.attention.{query,key,value}" is "bert.encoder.layer.N.attention.self.*",
// "attention.output" "attention.output.dense", "attention_norm" "attention.output.LayerNorm",
// "intermediate" "intermediate.dense", "output" "output.dense", "output_norm" "output.LayerNorm";
// "mlm.bias" is "cls.predictions.bias", "mlm.{dense,layer_norm}" "cls.predictions.transform.*",
// "nsp.pooler" "bert.pooler.dense", "nsp.classifier" "cls.seq_relationship". Every Linear is
// stored as ours ([out, in]); the decoder is tied to the word embeddings in both, so no
// cls.predictions.decoder.weight is written. A pre-LayerNorm BERT has no transformers layout
// (zt::ConfigError).
std::string hf_bert_name(const std::string& name);
int64_t write_hf_bert_model(const std::vector<HfTensor>& tensors, const BertConfig& config,
                            const std::filesystem::path& dir, at::ScalarType dtype, int64_t max_shard_bytes);

// The same for the Llama-family decoder (models/llama.h): config.json from
// llama_config_to_hf_json(config, dtype, base_config) (`base_config`: the text of the config.json
// the model came from, "" for none), transformers' class by the shape (Qwen2ForCausalLM with q/k/v
// biases, else LlamaForCausalLM). A tensor that is not one of the decoder's of `config`'s shape,
// or a missing one, is a zt::DataError before anything is written.
int64_t write_hf_llama_model(const std::vector<HfTensor>& tensors, const LlamaConfig& config,
                             const std::filesystem::path& dir, at::ScalarType dtype, int64_t max_shard_bytes,
                             const std::string& base_config);
// The tokenizer files of a Hugging Face directory (tokenizer.json, tokenizer_config.json,
// special_tokens_map.json, tokenizer.model, generation_config.json) that exist in `from`, copied
// into `to` (an existing directory); returns their names.
std::vector<std::string> copy_hf_tokenizer_files(const std::filesystem::path& from, const std::filesystem::path& to);

// Plain zerotrain-named single safetensors file of the same tensors (export --format safetensors).
int64_t write_safetensors_model(const std::vector<HfTensor>& tensors, const std::filesystem::path& out,
                                at::ScalarType dtype, const std::map<std::string, std::string>& metadata);

// The GPT shape a checkpoint was trained with, from its saved resolved configuration (model.*
// keys), checked against the saved tensors' shapes. zt::DataError when it cannot be known.
GPTConfig gpt_config_from_resolved(const std::map<std::string, std::string>& resolved, const std::string& where);

// The model type a checkpoint was trained with ("gpt", also when the saved configuration predates
// model.type, "bert" or "llama"), and the BERT shape from its model.* keys; zt::DataError otherwise.
std::string model_type_from_resolved(const std::map<std::string, std::string>& resolved, const std::string& where);
BertConfig bert_config_from_resolved(const std::map<std::string, std::string>& resolved, const std::string& where);
// The client-state key under which a Llama run's checkpoints carry the config.json text of its
// model.init_from or model.config_from directory (saved as the scalar "client.hf_config").
inline constexpr const char* kCarriedHfConfigKey = "hf_config";
// That text among a checkpoint's scalars; "" when it carries none (a preset's run, or a checkpoint
// saved before checkpoints carried it).
std::string carried_hf_config(const std::map<std::string, std::string>& scalars);
// The Llama shape of a checkpoint: with a saved model.init_from or model.config_from directory
// (`source_dir` set to it), the config.json text the checkpoint carries (`carried`), else the
// directory's own, which must then still be there; otherwise its model.preset with the model.*
// overrides (`source_dir` ""). zt::DataError when it cannot be known, in one line naming the
// directory when that is gone.
LlamaConfig llama_config_from_resolved(const std::map<std::string, std::string>& resolved, const std::string& where,
                                       std::string& source_dir, const std::string& carried = "");

class HfModelReader : public WeightReader {
 public:
  // Opens `dir` and checks config.json against `config` (see above).
  HfModelReader(const std::filesystem::path& dir, const GPTConfig& config);
  // A LlamaForCausalLM or Qwen2ForCausalLM directory: `config` is its shape (llama_config_of
  // reads it from DIR/config.json); every tensor of the decoder must be there with its shape.
  // `key` names what gave the directory in errors ("model.init_from", or "generate" for its SOURCE).
  HfModelReader(const std::filesystem::path& dir, const LlamaConfig& config, const std::string& key = "model.init_from");
  ~HfModelReader() override;
  void read(const std::string& name, const std::vector<int64_t>& shape, int64_t begin, int64_t count,
            float* out) override;
  int64_t bytes_read() const;
  int64_t data_bytes() const;  // bytes of the tensors in its files (what a whole read would take)

  struct State;  // hf_reader.cpp's

 private:
  std::unique_ptr<State> state_;
};

}  // namespace zt
