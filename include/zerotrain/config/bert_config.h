// The reference BERT's plain data: its shape (BertConfig), named presets and exact parameter
// counts, without LibTorch's module API, as gpt_config.h for the GPT: the configuration reads
// them without the modules (zerotrain/models/bert.h builds the model from a BertConfig).
// Implemented in src/config/bert_config.cpp.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace zt {

struct BertConfig {
  int64_t vocab_size = 260;  // the byte tokenizer's 256 ids and four specials (bert_data.h)
  int64_t max_positions = 128;
  int64_t type_vocab_size = 2;
  int64_t n_layer = 2;
  int64_t n_head = 2;
  int64_t hidden = 64;
  int64_t intermediate = 256;  // 4·hidden in BERT's sizes
  double dropout = 0.0;        // embedding, attention-probability and residual dropout (training only)
  double layer_norm_eps = 1e-12;
  bool pre_layer_norm = false;  // false: post-LN as BERT
  bool next_sentence = false;   // the NSP head and its loss

  // Throws zt::ConfigError naming the field when a value is out of range or hidden % n_head != 0.
  void validate() const;
};

// Named presets: `bert-tiny` (2 layers, hidden 64, 2 heads, intermediate 256, the byte
// tokenizer's vocabulary of 260, 128 positions, no dropout: a test size, smaller than Google's
// BERT-Tiny of width 128), `bert-base` (12 layers, 768, 12 heads, 3072) and `bert-large` (24,
// 1024, 16 heads, 4096) with BERT's WordPiece vocabulary of 30522, 512 positions and dropout 0.1
// as published. All three are post-LN with next-sentence prediction, as BERT was pre-trained.
// Throws zt::ConfigError listing the valid names for an unknown one.
BertConfig bert_preset(const std::string& name);
std::vector<std::string> bert_preset_names();

// Exact trainable parameter counts, analytically (H hidden, I intermediate, V vocab, P
// positions, Y token types, L layers):
//   embeddings V·H + P·H + Y·H + 2H; per layer 4H² + 2HI + 9H + I; final norm 2H (pre-LN only);
//   MLM head H² + 3H + V (the decoder is tied); NSP head H² + 3H + 2 (pooler and classifier).
// bert-base's embeddings + layers + pooler is 109,482,240 (Hugging Face's BertModel), and with
// both heads 110,106,428 (BertForPreTraining).
struct BertParameterCounts {
  int64_t embeddings = 0, layers = 0, final_norm = 0, mlm_head = 0, pooler = 0, nsp_classifier = 0;
  int64_t total() const { return embeddings + layers + final_norm + mlm_head + pooler + nsp_classifier; }
};
BertParameterCounts bert_parameter_counts(const BertConfig& config);
int64_t bert_parameter_count(const BertConfig& config);  // bert_parameter_counts(config).total()

}  // namespace zt
