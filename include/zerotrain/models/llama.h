// A Llama-family decoder (Llama 2/3, Qwen2) as ordinary LibTorch modules, with the module and
// parameter names of Hugging Face transformers' LlamaForCausalLM, so that a model.safetensors
// written by transformers fills it by name and its state dict is transformers' own.
//
// Architecture: token embedding -> num_hidden_layers pre-norm blocks [x += attn(rms(x));
// x += mlp(rms(x))] -> RMSNorm -> lm_head. RMSNorm computes in fp32 and scales in the input's
// dtype (as transformers). Attention: q/k/v/o projections, rotary position embeddings (rotate
// half; the "default", "linear" and "llama3" rope_scaling kinds), grouped-query attention (kv head
// j serves q heads j·r .. j·r+r-1), causal scaled-dot-product attention scaled by head_dim^-1/2
// (packed rows: block-diagonal causal, positions restarting per segment).
// MLP: down(silu(gate(x)) · up(x)). lm_head is tied to the embedding when tie_word_embeddings.
//
// Contracts:
//  - Names: model.embed_tokens, model.layers.N.{self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj,
//    input_layernorm, post_attention_layernorm}, model.norm, lm_head (absent when tied: the head
//    reads model.embed_tokens.weight), registered in that order (transformers').
//  - Initialisation (transformers' _init_weights): Linear and Embedding weights ~ N(0,
//    initializer_range), biases zero, norm weights one, drawn from torch's global generator in
//    registration order. Each embedding, layer, the final norm and the head is a stage-3 block
//    (zerotrain/zero/blocks.h), marked right after it is built, so a ShardedConstruction shards it at
//    once.
//  - element count == llama_parameter_count(config) (unsplit).
//  - Tensor parallelism (docs/tensor_parallel.md), as the GPT: built with the communicator of a
//    tensor group of T ranks, each rank keeps num_attention_heads / T query heads and
//    num_key_value_heads / T kv heads (the rows of q, k and v; the columns of o_proj),
//    intermediate_size / T features (gate and up rows, down columns) and vocab_size / T rows of
//    the embedding and of the head (a vocabulary-parallel lookup, logits and cross-entropy); the
//    norms are replicated. Values are drawn whole as the unsplit model draws them and sliced
//    (zt::mark_tensor_split); forward() then returns this rank's vocabulary slice of the logits.
//    Throws zt::ConfigError when T does not divide those counts.
//  - forward()/loss() throw zt::ConfigError on a bad shape, a sequence longer than
//    max_position_embeddings, non-integer ids or ids outside [0, vocab_size).
//  - Not thread-safe (as any torch::nn::Module).
#pragma once
#include <cstdint>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include "zerotrain/models/activation_checkpointing.h"
#include "zerotrain/config/llama_config.h"

namespace zt {

class Communicator;

class RMSNormImpl : public torch::nn::Module {
 public:
  RMSNormImpl(int64_t size, double eps);
  torch::Tensor forward(const torch::Tensor& x);
  torch::Tensor weight;

 private:
  double eps_;
};
TORCH_MODULE(RMSNorm);

class LlamaAttentionImpl : public torch::nn::Module {
 public:
  explicit LlamaAttentionImpl(const LlamaConfig& config, std::shared_ptr<Communicator> tensor_group = nullptr);
  // x [B,T,H]; cos, sin [T, head_dim], or [B,1,T,head_dim] per token (packed rows) -> [B,T,H].
  // `allowed` (packed rows), when defined: bool [B,1,T,T], true where a query may attend to a key,
  // in place of the causal mask.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                        const torch::Tensor& allowed = {});
  torch::nn::Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};

 private:
  int64_t heads_, kv_heads_, head_dim_;  // this rank's heads
  std::shared_ptr<Communicator> group_;
};
TORCH_MODULE(LlamaAttention);

class LlamaMLPImpl : public torch::nn::Module {
 public:
  explicit LlamaMLPImpl(const LlamaConfig& config, std::shared_ptr<Communicator> tensor_group = nullptr);
  torch::Tensor forward(const torch::Tensor& x);
  torch::nn::Linear gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};

 private:
  std::shared_ptr<Communicator> group_;
};
TORCH_MODULE(LlamaMLP);

// One decoder layer: the unit stage 3 gathers and activation checkpointing recomputes.
class LlamaDecoderLayerImpl : public torch::nn::Module {
 public:
  explicit LlamaDecoderLayerImpl(const LlamaConfig& config, std::shared_ptr<Communicator> tensor_group = nullptr);
  // As LlamaAttentionImpl::forward.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                        const torch::Tensor& allowed = {});

  // transformers' registration order.
  LlamaAttention self_attn{nullptr};
  LlamaMLP mlp{nullptr};
  RMSNorm input_layernorm{nullptr};
  RMSNorm post_attention_layernorm{nullptr};
};
TORCH_MODULE(LlamaDecoderLayer);

// transformers' LlamaModel: what LlamaForCausalLM registers as "model".
class LlamaBodyImpl : public torch::nn::Module {
 public:
  LlamaBodyImpl() = default;
  torch::nn::Embedding embed_tokens{nullptr};
  torch::nn::ModuleList layers{nullptr};
  RMSNorm norm{nullptr};
};
TORCH_MODULE(LlamaBody);

class LlamaImpl : public torch::nn::Module {
 public:
  explicit LlamaImpl(const LlamaConfig& config, std::shared_ptr<Communicator> tensor_group = nullptr);

  // ids: integer tensor [B,T], 1 <= T <= max_position_embeddings -> logits [B,T,vocab_size]
  // (with a tensor group of T: this rank's vocabulary slice, [B,T,vocab_size/T]).
  // `segments` (packed rows, zerotrain/data/data.h Batch::segments), when defined: integer [B,T]; each
  // position attends only to the earlier positions of its own segment, and its rotary position
  // restarts at 0 where its segment starts, so each segment's logits are those of its tokens alone
  // (up to float rounding). Undefined: causal attention over the whole row, positions 0..T-1.
  torch::Tensor forward(const torch::Tensor& ids, const torch::Tensor& segments = {});
  // Mean cross-entropy of forward(ids, segments) against targets [B,T] in fp32; targets of -100
  // are ignored (as transformers' labels after the shift the caller does).
  torch::Tensor loss(const torch::Tensor& ids, const torch::Tensor& targets, const torch::Tensor& segments = {});

  // Full recomputation of the checkpointed layers in backward (docs/activation_checkpointing.md);
  // selective recomputation is refused (zt::ConfigError) for this model.
  void set_checkpointing(const CheckpointingSettings& settings);
  const CheckpointingSettings& checkpointing() const { return checkpointing_; }
  // Whether layer `layer` is recomputed in backward under the current settings.
  bool is_checkpointed(int64_t layer) const;

  const LlamaConfig& config() const { return config_; }
  // The tensor group (null: the unsplit model).
  const std::shared_ptr<Communicator>& tensor_group() const { return tensor_group_; }
  // The rotary tables for positions [0, T): cos and sin [T, head_dim] in fp32.
  std::pair<torch::Tensor, torch::Tensor> rotary(int64_t T, const torch::Device& device) const;

  LlamaBody model{nullptr};
  std::vector<LlamaDecoderLayer> layers;  // the modules of model->layers
  torch::nn::Linear lm_head{nullptr};     // null when tied

 private:
  void finish_block(const std::shared_ptr<torch::nn::Module>& module);
  void keep_tensor_slices(torch::nn::Module& module);

  LlamaConfig config_;
  std::shared_ptr<Communicator> tensor_group_;
  int64_t vocab_begin_ = 0;  // with a tensor group: the first token id of this rank's rows
  torch::Tensor inv_freq_;  // [head_dim/2], fp32, after rope_scaling
  CheckpointingSettings checkpointing_;
  std::vector<char> checkpointed_;
};
TORCH_MODULE(Llama);

}  // namespace zt
