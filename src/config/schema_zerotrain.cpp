// The key table's blocks of zerotrain's own (model, data, training loop, communication).
#include "config/schema_keys.h"

#include <initializer_list>
#include <tuple>

namespace zt::config_detail::keys {

// zerotrain's own blocks: "model", "data", "train" and "comm".
void add_zerotrain_keys(std::vector<Leaf>& t) {
  // --- zerotrain's own blocks
  t.push_back(string("model.type", "gpt", ZT_FIELD(model.type), {"gpt", "bert", "llama"}));
  t.push_back(string("model.preset", "tiny", ZT_FIELD(model.preset)));
  // Upper bounds far beyond any model this library can build, low enough that the size
  // arithmetic of the estimate and the model (layers x 12 x width^2 + (vocab + context) x width)
  // cannot overflow 64 bits.
  for (const auto& shape : std::initializer_list<std::tuple<const char*, int64_t ModelConfig::*, double>>{
           {"n_layer", &ModelConfig::n_layer, 1 << 16},
           {"n_head", &ModelConfig::n_head, 1 << 16},
           {"n_embd", &ModelConfig::n_embd, 1 << 20},
           {"vocab_size", &ModelConfig::vocab_size, 1 << 24},
           {"context_length", &ModelConfig::context_length, 1 << 24}}) {
    // 0 keeps the preset's value. (A named copy, not a structured binding: clang 14, which builds
    // the fuzz targets, cannot capture those.)
    int64_t ModelConfig::*field = std::get<1>(shape);
    t.push_back(integer(std::string("model.") + std::get<0>(shape), 0, 0, std::get<2>(shape),
                        [field](TrainConfig& c, const json& v) { c.model.*field = v.get<int64_t>(); }));
  }
  // Llama only (validate_semantics refuses them with the other types); 0 keeps the preset's.
  t.push_back(integer("model.n_kv_head", 0, 0, 1 << 16, ZT_FIELD(model.n_kv_head)));
  t.push_back(integer("model.intermediate_size", 0, 0, 1 << 22, ZT_FIELD(model.intermediate_size)));
  t.push_back(string("model.config_from", "", ZT_FIELD(model.config_from)));
  // -1 (the default) keeps the preset's dropout; a given value must be a probability.
  t.push_back(number("model.dropout", -1.0, 0.0, false, 1.0, true, ZT_FIELD(model.dropout)));
  t.push_back(integer("model.loss_chunk_tokens", 0, 0, 1LL << 40, ZT_FIELD(model.loss_chunk_tokens)));
  t.push_back(string("model.init_from", "", ZT_FIELD(model.init_from)));
  // BERT only (validate_semantics refuses them with the other types).
  t.push_back(boolean("model.pre_layer_norm", false, ZT_FIELD(model.pre_layer_norm)));
  t.push_back(nullable(boolean("model.next_sentence", false, [](TrainConfig& c, const json& v) {
    c.model.next_sentence = v.is_null() ? std::nullopt : std::optional<bool>(v.get<bool>());
  })));
  t.back().def = nullptr;
  t.push_back(string("data.source", "embedded", ZT_FIELD(data.source), {"embedded", "bin", "text", "jsonl", "finetune"}));
  t.push_back(string("data.path", "", ZT_FIELD(data.path)));
  t.push_back(string("data.val_path", "", ZT_FIELD(data.val_path)));
  t.push_back(number("data.val_fraction", 0.1, 0.0, false, 1.0, true, ZT_FIELD(data.val_fraction)));
  t.push_back(integer("data.sequence_length", 0, 0, std::nullopt, ZT_FIELD(data.sequence_length)));
  t.push_back(number("data.mlm_probability", 0.15, 0.0, true, 1.0, false, ZT_FIELD(data.mlm_probability)));
  t.push_back(integer("data.max_predictions", 0, 0, 1LL << 24, ZT_FIELD(data.max_predictions)));
  t.push_back(string("data.tokenizer", "", ZT_FIELD(data.tokenizer)));
  t.push_back(string("data.cache_dir", "", ZT_FIELD(data.cache_dir)));
  t.push_back(string("data.eos_token", "", ZT_FIELD(data.eos_token)));
  t.push_back(string("data.chat_template", "auto", ZT_FIELD(data.chat_template), {"auto", "chatml", "llama3"}));
  t.push_back(boolean("data.pack", false, ZT_FIELD(data.pack)));
  // The trainer keeps one loss per step; a hundred million steps is beyond any run and its
  // bookkeeping still fits in memory (a value past it is a typo or damage, refused up front).
  t.push_back(integer("train.steps", 200, 1, 100'000'000, ZT_FIELD(train.steps)));
  t.push_back(integer("train.seed", 1234, 0, std::nullopt, ZT_FIELD(train.seed)));
  t.push_back(integer("train.eval_interval", 0, 0, std::nullopt, ZT_FIELD(train.eval_interval)));
  t.push_back(integer("train.eval_iters", 4, 1, std::nullopt, ZT_FIELD(train.eval_iters)));
  t.push_back(integer("train.threads", 0, 0, 4096, ZT_FIELD(train.threads)));
  t.push_back(string("train.log_dir", "runs", ZT_FIELD(train.log_dir)));
  t.push_back(string("train.retain_freed_memory", "bounded", ZT_FIELD(train.retain_freed_memory),
                     {"bounded", "auto", "always", "never"}));
  t.push_back(string("train.cpu_half_precision", "auto", ZT_FIELD(train.cpu_half_precision), {"auto", "always"}));
  t.push_back(positive("comm.timeout_seconds", 300.0, ZT_FIELD(comm.timeout_seconds)));
}

}  // namespace zt::config_detail::keys
