// One interface for the models that model.type names, so that the trainer, its reports and the
// command line never ask which model they hold. The GPT, BERT and the Llama-family decoder
// implement it (src/models/gpt_kind.cpp, bert_kind.cpp, llama_kind.cpp) and make_model_kind finds
// them by type (src/models/model_kinds.cpp, the registry).
//
// A ModelKind is what a configuration says of its model before any is built: its shape (with
// model.init_from or model.config_from, the directory's config.json, read once), the data it trains
// on, its figures for the memory estimate, its Hugging Face reader. build() makes the modules; the
// TrainableModel it returns is the built model's side: its module for the engine, the loss of a
// batch, activation checkpointing and what was measured of it.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <torch/nn/module.h>

#include "zerotrain/config/gpt_flops.h"
#include "zerotrain/data/bert_data.h"
#include "zerotrain/data/data.h"
#include "zerotrain/memory/estimate.h"
#include "zerotrain/models/activation_checkpointing.h"

namespace zt {

struct TrainConfig;
class Communicator;
class HfModelReader;

// What a model trains on: the decoders' token windows (or fine-tuning examples), or BERT's masked
// sentence pairs of the same token data.
enum class DataKind { TokenWindows, SentencePairs };

// The built model, as the trainer drives it.
class TrainableModel {
 public:
  virtual ~TrainableModel() = default;
  virtual std::shared_ptr<torch::nn::Module> module() const = 0;
  virtual void set_checkpointing(const CheckpointingSettings& settings) = 0;
  virtual bool is_checkpointed(int64_t block) const = 0;
  // The mean loss of one micro-batch of the model's data kind (DataKind::TokenWindows: `batch`;
  // SentencePairs: `pairs`). Throws zt::Error for a batch of the other kind.
  virtual torch::Tensor loss(const Batch& batch);
  virtual torch::Tensor loss(const BertBatch& pairs);
  // activation_checkpointing.profile's per-block timings (empty where the model keeps none).
  virtual std::vector<CheckpointTimings> checkpoint_timings() const { return {}; }
  // contiguous_memory_optimization's buffer, where the model has one.
  virtual std::optional<CheckpointArena::Stats> checkpoint_arena_stats() const { return std::nullopt; }
  // The flops profiler's report for `inputs` (its recomputation fields filled from this model),
  // or none where the profiler's FLOPs model does not cover the model (then profiles_flops() is
  // false and the trainer never asks).
  virtual std::optional<FlopsProfile> flops_profile(FlopsProfileInputs inputs) const { return std::nullopt; }
};

class ModelKind {
 public:
  virtual ~ModelKind() = default;
  virtual DataKind data_kind() const = 0;
  virtual int64_t context_length() const = 0;   // positions the model holds
  virtual int64_t data_vocabulary() const = 0;  // token ids its training data may hold
  virtual int64_t layers() const = 0;           // its blocks, the unit of activation checkpointing
  virtual int64_t parameters() const = 0;       // elements, unsplit
  // BERT's special tokens after its content vocabulary (DataKind::SentencePairs only).
  virtual BertSpecialTokens sentence_pair_specials() const;
  // The "model: ..." line's account of the model (its type, source and shape), without the data.
  virtual std::string description() const = 0;
  // What a batch holds beyond its tokens, for the same line ("" for nothing more).
  virtual std::string batch_note() const { return ""; }
  // Its figures for the memory estimate, trained on `sequence_length` tokens and split over tensor
  // groups of `tensor_parallel`, or none where the estimate does not model it (estimate_gap()
  // says why).
  virtual std::optional<ModelFigures> estimate_figures(int64_t sequence_length, int64_t persistence_threshold,
                                                       int tensor_parallel) const = 0;
  virtual std::string estimate_gap() const { return ""; }
  // Whether the flops profiler covers this model split over tensor groups of `tensor_parallel`.
  virtual bool profiles_flops(int tensor_parallel) const { return false; }
  // model.init_from's reader of a Hugging Face directory of this model, checked against its shape
  // (zt::DataError naming the file otherwise); zt::ConfigError where the model reads none.
  virtual std::unique_ptr<HfModelReader> hf_reader(const std::string& dir) const;
  // The Hugging Face config.json text that checkpoints carry so that export needs no directory
  // ("" for none).
  virtual std::string carried_hf_config() const { return ""; }
  // The modules, built on the CPU (sharded inside a ShardedConstruction), split over
  // `tensor_group` when it is given.
  virtual std::unique_ptr<TrainableModel> build(const std::shared_ptr<Communicator>& tensor_group) const = 0;
};

// The model `config` describes (model.type), its shape checked; zt::ConfigError for an unknown
// type, naming the known ones.
std::unique_ptr<ModelKind> make_model_kind(const TrainConfig& config);
// The memory estimate's figures of the model `config` describes, trained on data.sequence_length
// tokens (0: its context) and split over tensor groups of `tensor_parallel`; none where the
// estimate does not model it or the model cannot be split so (ModelKind::estimate_gap()).
std::optional<ModelFigures> estimate_figures_of(const TrainConfig& config, int tensor_parallel);
// The types make_model_kind knows, in registration order.
std::vector<std::string> model_kind_types();

}  // namespace zt
