// Reference BERT encoder with its pre-training heads, ordinary LibTorch modules written the way
// the GPT is (zerotrain/models/gpt.h): nothing here knows about ZeRO; the engine works on the
// parameters and, for stage 3 and activation checkpointing, on the marked blocks (docs/bert.md).
//
// Architecture (Devlin et al. 2019): word + learned position + token-type embeddings -> LayerNorm
// -> dropout -> n_layer encoder layers -> MLM head (and, with next_sentence, the NSP head).
//  - A layer: bidirectional self-attention (separate query, key and value projections, scaled
//    dot-product attention with a key-padding mask) and a feed-forward network Linear(H, I) ->
//    GELU (exact, erf) -> Linear(I, H), each followed by dropout and a residual connection.
//    Post-LayerNorm as BERT: x = LN(x + sublayer(x)). With pre_layer_norm: x = x + sublayer(LN(x))
//    and a final LayerNorm after the last layer (Xiong et al. 2020). The embeddings' LayerNorm
//    is there in both.
//  - MLM head: transform Linear(H, H) -> GELU -> LayerNorm, then the decoder whose weight is TIED
//    to the word embeddings plus an output bias of vocab_size. It is applied to the masked
//    positions only: hidden.view(-1, H).index_select(0, masked_positions), so that the largest
//    matrix multiply ([tokens, H] x [H, V]) runs over ~15% of the rows.
//  - NSP head (next_sentence): pooler Linear(H, H) -> tanh on the [CLS] (first) position, then a
//    2-way classifier. Without next_sentence neither module exists.
//
// Contracts:
//  - Registration order: embeddings (word, position, token type, LayerNorm), layers.0 …
//    layers.{L-1} (attention.query, .key, .value, .output, attention_norm, intermediate, output,
//    output_norm; weight before bias), final_norm (pre-LN only), mlm (bias, then dense and
//    layer_norm: LibTorch lists a module's own parameters before its children's), nsp (pooler,
//    classifier; next_sentence only).
//  - Blocks (zerotrain/zero/blocks.h), marked right after each is initialised so that a
//    ShardedConstruction shards them at once: the embeddings, every layer, the final norm, the
//    MLM head and the NSP head. The embeddings' block runs twice per forward (embedding, tied
//    decoder) and the MLM head's twice (transform, output bias), as the GPT's tied embedding.
//  - Initialisation (BERT): every Linear and Embedding weight ~ N(0, 0.02), biases zero,
//    LayerNorm weight one and bias zero, drawn from torch's global CPU generator in registration
//    order: torch::manual_seed(s) before construction reproduces the weights.
//  - The element count of parameters() equals bert_parameter_count(config) exactly (unsplit).
//  - Tensor parallelism (docs/tensor_parallel.md), as the GPT: built with the communicator of a
//    tensor group of T ranks, each rank keeps n_head / T heads (the rows of query, key and value;
//    the columns of attention.output), I / T features (intermediate rows, output columns) and
//    vocab_size / T rows of the word embeddings and of the MLM output bias (a vocabulary-parallel
//    embedding, decoder and cross-entropy: the logits are never gathered whole); the rest is
//    replicated. The whole values are drawn as the unsplit model draws them and each rank keeps
//    its slice (zt::mark_tensor_split), so with the same seed the split model computes what the
//    unsplit one does. mlm_logits then returns this rank's vocabulary slice [N, V/T]. Throws
//    zt::ConfigError when T does not divide n_head, intermediate or vocab_size.
//  - forward()/losses() throw zt::ConfigError (never abort) on a bad shape, a sequence longer than
//    max_positions, a non-integer index tensor, an id outside its vocabulary, a masked position
//    outside [0, B·T) or a label outside the vocabulary (both checked when on the CPU, where it
//    costs no device synchronisation), or missing NSP labels with next_sentence. Every sequence must attend to at
//    least one position (the sampler's always attend to [CLS]); a row of zeros in attention_mask
//    is not checked (it would cost a device synchronisation) and gives NaN.
//  - Not thread-safe (as any torch::nn::Module): one forward at a time per instance.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include "zerotrain/models/activation_checkpointing.h"
#include "zerotrain/config/bert_config.h"
#include "zerotrain/data/bert_data.h"

namespace zt {

class Communicator;

class BertEmbeddingsImpl : public torch::nn::Module {
 public:
  explicit BertEmbeddingsImpl(const BertConfig& config, std::shared_ptr<Communicator> tensor_group = nullptr);
  // ids, types [B,T] -> LayerNorm(word + position + type) after dropout, [B,T,H]
  torch::Tensor forward(const torch::Tensor& input_ids, const torch::Tensor& token_type_ids);

  torch::nn::Embedding word_embeddings{nullptr};  // also the MLM decoder's weight
  torch::nn::Embedding position_embeddings{nullptr};
  torch::nn::Embedding token_type_embeddings{nullptr};
  torch::nn::LayerNorm layer_norm{nullptr};

 private:
  torch::nn::Dropout dropout_{nullptr};
  std::shared_ptr<Communicator> group_;  // with a tensor group: word_embeddings holds rows
  int64_t vocab_begin_ = 0;              // [vocab_begin_, vocab_begin_ + V/T)
};
TORCH_MODULE(BertEmbeddings);

// Bidirectional self-attention; `keep` is the boolean key mask [B,1,1,T] (true: attend).
class BertSelfAttentionImpl : public torch::nn::Module {
 public:
  explicit BertSelfAttentionImpl(const BertConfig& config, std::shared_ptr<Communicator> tensor_group = nullptr);
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& keep);  // [B,T,H] -> [B,T,H]

  torch::nn::Linear query{nullptr}, key{nullptr}, value{nullptr};
  torch::nn::Linear output{nullptr};

 private:
  friend class BertImpl;
  int64_t n_head_;  // this rank's heads
  int64_t head_dim_;
  double dropout_;
  std::shared_ptr<Communicator> group_;
  // Selective recomputation: the attention core is checkpointed, keeping q, k and v.
  bool recompute_scores_ = false;
  CheckpointOptions checkpoint_options_;
  torch::nn::Dropout output_dropout_{nullptr};
};
TORCH_MODULE(BertSelfAttention);

// One encoder layer: the unit that stage 3 gathers and activation checkpointing recomputes.
class BertLayerImpl : public torch::nn::Module {
 public:
  explicit BertLayerImpl(const BertConfig& config, std::shared_ptr<Communicator> tensor_group = nullptr);
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& keep);

  BertSelfAttention attention{nullptr};
  torch::nn::LayerNorm attention_norm{nullptr};
  torch::nn::Linear intermediate{nullptr};  // H -> I
  torch::nn::Linear output{nullptr};        // I -> H
  torch::nn::LayerNorm output_norm{nullptr};

 private:
  friend class BertImpl;
  bool pre_layer_norm_;
  std::shared_ptr<Communicator> group_;
  // Selective recomputation: GELU's output is freed after `output` reads it.
  bool recompute_activation_ = false;
  torch::nn::Dropout dropout_{nullptr};
};
TORCH_MODULE(BertLayer);

// MLM head: transform (dense, GELU, LayerNorm) and the output bias of the tied decoder.
class BertMlmHeadImpl : public torch::nn::Module {
 public:
  explicit BertMlmHeadImpl(const BertConfig& config);
  torch::Tensor transform(const torch::Tensor& x);  // [N,H] -> [N,H]

  torch::nn::Linear dense{nullptr};
  torch::nn::LayerNorm layer_norm{nullptr};
  torch::Tensor bias;  // [V]
};
TORCH_MODULE(BertMlmHead);

// NSP head: pooler on [CLS] and the 2-way classifier.
class BertNspHeadImpl : public torch::nn::Module {
 public:
  explicit BertNspHeadImpl(const BertConfig& config);
  torch::Tensor forward(const torch::Tensor& cls_hidden);  // [B,H] -> logits [B,2]

  torch::nn::Linear pooler{nullptr};
  torch::nn::Linear classifier{nullptr};
};
TORCH_MODULE(BertNspHead);

// Pre-training losses: total = mlm + nsp (nsp undefined without next_sentence). fp32 scalars.
struct BertLosses {
  torch::Tensor total, mlm, nsp;
};

class BertImpl : public torch::nn::Module {
 public:
  explicit BertImpl(const BertConfig& config, std::shared_ptr<Communicator> tensor_group = nullptr);

  // input_ids, token_type_ids [B,T] integer (token_type_ids undefined: all 0), attention_mask
  // [B,T] integer or bool (undefined: all 1; nonzero: attend) -> the last layer's output [B,T,H]
  // (after the final norm with pre_layer_norm).
  torch::Tensor forward(const torch::Tensor& input_ids, const torch::Tensor& token_type_ids = {},
                        const torch::Tensor& attention_mask = {});

  // The MLM logits of given rows of hidden: transform, tied decoder, output bias. [N,H] -> [N,V]
  // (with a tensor group of T: this rank's vocabulary slice, [N,V/T]; fp32 whatever the model's
  // dtype). Counts its rows in last_projected_rows().
  torch::Tensor mlm_logits(const torch::Tensor& rows);
  // The NSP logits [B,2] from hidden [B,T,H]. Throws zt::ConfigError without next_sentence.
  torch::Tensor nsp_logits(const torch::Tensor& hidden);

  // Pre-training loss of a masked batch (bert_data.h): mean cross-entropy over the masked
  // positions, projecting those rows only, plus (next_sentence) the mean NSP cross-entropy.
  BertLosses losses(const BertBatch& batch);
  torch::Tensor mlm_loss(const BertBatch& batch) { return losses(batch).total; }
  // The same loss computed the straightforward way: every position projected to the vocabulary,
  // labels -100 (ignored) except at the masked positions. Equal to mlm_loss up to rounding;
  // it exists to show that (tests) and costs the full [B·T, V] projection.
  torch::Tensor mlm_loss_full_projection(const BertBatch& batch);

  // Rows the MLM decoder projected in the last mlm_logits call (and so in the last loss).
  int64_t last_projected_rows() const { return last_projected_rows_; }

  // How each layer is run in forward, as GPTImpl::set_block_wrapper.
  using BlockFn = std::function<torch::Tensor(const torch::Tensor&)>;
  using BlockWrapper = std::function<torch::Tensor(int64_t index, const BlockFn& run, const torch::Tensor& x)>;
  void set_block_wrapper(BlockWrapper wrapper) { block_wrapper_ = std::move(wrapper); }

  const BertConfig& config() const { return config_; }
  // The tensor group (null: the unsplit model).
  const std::shared_ptr<Communicator>& tensor_group() const { return tensor_group_; }

  // Activation checkpointing of the encoder layers, with GPTImpl::Checkpointing's meaning
  // (docs/activation_checkpointing.md). Throws ConfigError on a count outside [0, n_layer].
  using Checkpointing = CheckpointingSettings;  // zerotrain/models/activation_checkpointing.h
  void set_checkpointing(const Checkpointing& settings);
  const Checkpointing& checkpointing() const { return checkpointing_; }
  bool is_checkpointed(int64_t layer) const;
  std::vector<CheckpointTimings> checkpoint_timings() const;

  BertEmbeddings embeddings{nullptr};
  std::vector<BertLayer> layers;  // the same modules as the registered ModuleList "layers"
  torch::nn::LayerNorm final_norm{nullptr};  // pre_layer_norm only
  BertMlmHead mlm{nullptr};
  BertNspHead nsp{nullptr};  // next_sentence only

 private:
  void finish_block(const std::shared_ptr<torch::nn::Module>& module);
  void keep_tensor_slices(torch::nn::Module& module);
  torch::Tensor mlm_cross_entropy(const torch::Tensor& logits, const torch::Tensor& labels, int64_t ignore_index);
  torch::Tensor check_and_run(const BertBatch& batch, torch::Tensor& flat_positions, torch::Tensor& labels);

  BertConfig config_;
  std::shared_ptr<Communicator> tensor_group_;
  torch::nn::ModuleList layer_list_{nullptr};
  BlockWrapper block_wrapper_;
  Checkpointing checkpointing_;
  std::vector<char> checkpointed_;
  std::vector<std::shared_ptr<CheckpointTimings>> timings_;
  std::shared_ptr<CheckpointArena> arena_;
  int64_t last_projected_rows_ = 0;
};
TORCH_MODULE(Bert);

}  // namespace zt
