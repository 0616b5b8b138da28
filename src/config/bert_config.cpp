// The BERT's plain data (presets, validation, parameter counts), apart from the modules, as
// gpt_config.cpp for the GPT. Tested with the model in tests/bert_test.cpp (BertPreset). Declared
// in zerotrain/config/bert_config.h.
#include "zerotrain/config/bert_config.h"

#include <string>
#include <vector>

#include "zerotrain/error.h"

namespace zt {
namespace {

struct Preset {
  const char* name;
  BertConfig config;
};

BertConfig make(int64_t vocab, int64_t positions, int64_t layers, int64_t heads, int64_t hidden, int64_t intermediate,
                double dropout) {
  BertConfig c;
  c.vocab_size = vocab;
  c.max_positions = positions;
  c.type_vocab_size = 2;
  c.n_layer = layers;
  c.n_head = heads;
  c.hidden = hidden;
  c.intermediate = intermediate;
  c.dropout = dropout;
  c.layer_norm_eps = 1e-12;
  c.pre_layer_norm = false;
  c.next_sentence = true;
  return c;
}

// bert-base and bert-large: Devlin et al. 2019 (BERT_BASE L=12 H=768 A=12, BERT_LARGE L=24
// H=1024 A=16, feed-forward 4H, 512 positions, dropout 0.1) with the uncased WordPiece
// vocabulary of 30522. bert-tiny: the byte tokenizer's vocabulary with its four specials.
const Preset kPresets[] = {
    {"bert-tiny", make(260, 128, 2, 2, 64, 256, 0.0)},
    {"bert-base", make(30522, 512, 12, 12, 768, 3072, 0.1)},
    {"bert-large", make(30522, 512, 24, 16, 1024, 4096, 0.1)},
};

std::string join_names() {
  std::string out;
  for (const auto& p : kPresets) {
    if (!out.empty()) out += ", ";
    out += p.name;
  }
  return out;
}

[[noreturn]] void bad_input(const std::string& what) { throw ConfigError("BERT: " + what); }

}  // namespace

void BertConfig::validate() const {
  auto positive = [](const char* name, int64_t v) {
    if (v <= 0) bad_input(std::string("config.") + name + " must be > 0, found " + std::to_string(v));
  };
  positive("vocab_size", vocab_size);
  positive("max_positions", max_positions);
  positive("type_vocab_size", type_vocab_size);
  positive("n_layer", n_layer);
  positive("n_head", n_head);
  positive("hidden", hidden);
  positive("intermediate", intermediate);
  if (hidden % n_head != 0)
    bad_input("config.hidden (" + std::to_string(hidden) + ") must be divisible by config.n_head (" +
              std::to_string(n_head) + ")");
  if (!(dropout >= 0.0 && dropout < 1.0))
    bad_input("config.dropout must be in [0, 1), found " + std::to_string(dropout));
  if (!(layer_norm_eps > 0.0 && layer_norm_eps < 1.0))
    bad_input("config.layer_norm_eps must be in (0, 1), found " + std::to_string(layer_norm_eps));
}

BertConfig bert_preset(const std::string& name) {
  for (const auto& p : kPresets)
    if (name == p.name) return p.config;
  throw ConfigError("unknown BERT preset '" + name + "'; valid presets: " + join_names());
}

std::vector<std::string> bert_preset_names() {
  std::vector<std::string> names;
  for (const auto& p : kPresets) names.emplace_back(p.name);
  return names;
}

BertParameterCounts bert_parameter_counts(const BertConfig& c) {
  const int64_t H = c.hidden, I = c.intermediate;
  BertParameterCounts n;
  // Word, position and token-type tables, and the embeddings' LayerNorm.
  n.embeddings = c.vocab_size * H + c.max_positions * H + c.type_vocab_size * H + 2 * H;
  // Per layer: query, key, value, output (4H² + 4H), two LayerNorms (4H), intermediate (HI + I),
  // output (IH + H).
  n.layers = c.n_layer * (4 * H * H + 2 * H * I + 9 * H + I);
  n.final_norm = c.pre_layer_norm ? 2 * H : 0;
  // Transform dense (H² + H) and LayerNorm (2H), output bias V; the decoder weight is tied.
  n.mlm_head = H * H + 3 * H + c.vocab_size;
  if (c.next_sentence) {
    n.pooler = H * H + H;
    n.nsp_classifier = 2 * H + 2;
  }
  return n;
}

int64_t bert_parameter_count(const BertConfig& config) { return bert_parameter_counts(config).total(); }

}  // namespace zt
