// Reference GPT-2-style decoder written as ordinary LibTorch modules, the way a user of the library
// would write their own model. Nothing here knows about ZeRO: the engine works
// on the parameters and (for stage 3 and activation checkpointing) on the `blocks`.
//
// Architecture (GPT-2): token + learned position embeddings -> dropout -> n_layer pre-LayerNorm
// blocks [x += attn(ln_1(x)); x += mlp(ln_2(x))] -> final LayerNorm -> output head. Attention uses
// one fused qkv Linear and causal scaled-dot-product attention; the MLP is Linear(C,4C) -> GELU
// (tanh approximation, as GPT-2) -> Linear(4C,C). The output head is TIED to the token embedding:
// logits = h @ wte.weight^T, so `wte.weight` is the only parameter of both (no separate head).
//
// Contracts:
//  - Parameter registration order is deterministic: wte, wpe, blocks.0 … blocks.{L-1}, ln_f; inside
//    a block: ln_1, attn.c_attn, attn.c_proj, ln_2, mlp.c_fc, mlp.c_proj (weight before bias).
//  - Initialisation (GPT-2 / nanoGPT): every Linear and Embedding weight ~ N(0, 0.02), the two
//    residual projections (attn.c_proj, mlp.c_proj) ~ N(0, 0.02/sqrt(2·n_layer)), biases zero,
//    LayerNorm weight one and bias zero. All draws come from torch's global CPU generator in
//    registration order, so `torch::manual_seed(s)` before construction reproduces the weights.
//  - parameters().size() == 2 + 12·n_layer + 2 and the element count equals
//    gpt_parameter_count(config) exactly.
//  - forward()/loss() throw zt::ConfigError (never abort) on a bad shape, a sequence longer than
//    context_length, a non-integer index tensor, or a token id outside [0, vocab_size).
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
#include "zerotrain/config/gpt_config.h"

namespace zt {

class Communicator;

// Causal self-attention with a fused qkv projection. With a tensor group of T ranks
// (zerotrain/models/tensor_parallel.h) it holds n_head / T heads: c_attn the rows of their q, k
// and v, c_proj the matching columns, and its output is summed over the group.
class CausalSelfAttentionImpl : public torch::nn::Module {
 public:
  explicit CausalSelfAttentionImpl(const GPTConfig& config, std::shared_ptr<Communicator> tensor_group = nullptr);
  // [B,T,C] -> [B,T,C]. `allowed`, when defined, is a bool [B,1,T,T] mask (true: query t may
  // attend to key s) replacing the causal one; undefined: causal attention.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& allowed = {});

  torch::nn::Linear c_attn{nullptr};  // C -> 3C (q, k, v)
  torch::nn::Linear c_proj{nullptr};  // C -> C, residual projection

 private:
  int64_t n_head_;
  double dropout_;
  std::shared_ptr<Communicator> group_;
  friend class GPTImpl;
  // Selective recomputation: the attention core (scores, softmax, dropout, weighted sum) is
  // checkpointed, keeping q, k and v.
  bool recompute_scores_ = false;
  CheckpointOptions checkpoint_options_;
  torch::nn::Dropout resid_drop_{nullptr};
};
TORCH_MODULE(CausalSelfAttention);

// With a tensor group: c_fc column-parallel, c_proj row-parallel (4C / T hidden features each).
class MLPImpl : public torch::nn::Module {
 public:
  explicit MLPImpl(const GPTConfig& config, std::shared_ptr<Communicator> tensor_group = nullptr);
  torch::Tensor forward(const torch::Tensor& x);

  torch::nn::Linear c_fc{nullptr};    // C -> 4C
  torch::nn::Linear c_proj{nullptr};  // 4C -> C, residual projection

 private:
  torch::nn::Dropout drop_{nullptr};
  std::shared_ptr<Communicator> group_;
  friend class GPTImpl;
  // Selective recomputation: GELU's output is freed after the projection reads it and recomputed
  // from c_fc's output (kept anyway by GELU's backward) when backward reaches the projection.
  bool recompute_activation_ = false;
};
TORCH_MODULE(MLP);

// One pre-LayerNorm transformer block: the unit that stage 3 gathers and activation checkpointing
// recomputes.
class BlockImpl : public torch::nn::Module {
 public:
  explicit BlockImpl(const GPTConfig& config, std::shared_ptr<Communicator> tensor_group = nullptr);
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& allowed = {});  // allowed: as the attention's

  torch::nn::LayerNorm ln_1{nullptr};
  CausalSelfAttention attn{nullptr};
  torch::nn::LayerNorm ln_2{nullptr};
  MLP mlp{nullptr};
};
TORCH_MODULE(Block);

// Tensor parallelism (docs/tensor_parallel.md): built with the communicator of a tensor group of
// T ranks, each rank holds its 1/T of every block's attention heads and MLP features and of the
// vocabulary's rows of the tied embedding and head (T must divide n_head and vocab_size; a
// ConfigError names either otherwise); wpe and the layer norms are replicated. Every rank of the
// group draws the same whole values from the same seed and keeps its slice, so the loss equals
// the unsplit model's. forward() and head() then return this rank's vocabulary slice of the
// logits; loss() is the whole loss (vocab_parallel_cross_entropy). Dropout draws the same masks on
// every rank of the group only with the same generator state; use dropout 0 for results equal to
// the unsplit model's.
class GPTImpl : public torch::nn::Module {
 public:
  explicit GPTImpl(const GPTConfig& config, std::shared_ptr<Communicator> tensor_group = nullptr);

  // idx: integer tensor [B,T] with 1 <= T <= context_length -> logits [B,T,vocab_size].
  torch::Tensor forward(const torch::Tensor& idx);
  // forward() in two parts: the final LayerNorm's output [B,T,C], and the tied head on it.
  // `segments` (packed rows, zerotrain/data/data.h Batch::segments), when defined: integer [B,T]; each
  // position attends only to the earlier positions of its own segment, and the learned position
  // ids restart at 0 where a segment starts. Undefined: causal attention over the whole row.
  torch::Tensor hidden(const torch::Tensor& idx, const torch::Tensor& segments = {});
  torch::Tensor head(const torch::Tensor& x);
  // Mean cross-entropy of forward(idx) against targets [B,T] (computed in fp32 whatever the
  // model's dtype). Targets equal to -100 are ignored (torch's default ignore_index).
  torch::Tensor loss(const torch::Tensor& idx, const torch::Tensor& targets, const torch::Tensor& segments = {});

  // How each block is run in forward. The default calls block->forward(x). Later layers (activation
  // checkpointing, stage-3 gather/release hooks) install a wrapper that receives the block index,
  // a callable that runs the block, and the block input; it must return the block output.
  using BlockFn = std::function<torch::Tensor(const torch::Tensor&)>;
  using BlockWrapper = std::function<torch::Tensor(int64_t index, const BlockFn& run, const torch::Tensor& x)>;
  void set_block_wrapper(BlockWrapper wrapper) { block_wrapper_ = std::move(wrapper); }

  const GPTConfig& config() const { return config_; }
  // The tensor group (null: the unsplit model).
  const std::shared_ptr<Communicator>& tensor_group() const { return tensor_group_; }

  // Activation checkpointing (docs/activation_checkpointing.md): which blocks recompute what in
  // backward. Gradients are bitwise those of the plain model (dropout masks are drawn again from
  // the saved generator states). Throws ConfigError on a count outside [0, n_layer].
  using Checkpointing = CheckpointingSettings;  // zerotrain/models/activation_checkpointing.h; profile: checkpoint_timings()
  void set_checkpointing(const Checkpointing& settings);
  const Checkpointing& checkpointing() const { return checkpointing_; }
  bool is_checkpointed(int64_t block) const;
  // With profile: the forward and recomputation times of each block (empty otherwise).
  std::vector<CheckpointTimings> checkpoint_timings() const;
  // With contiguous_memory: the arena's figures.
  std::optional<CheckpointArena::Stats> checkpoint_arena_stats() const;

  torch::nn::Embedding wte{nullptr};  // token embedding, also the (tied) output head
  torch::nn::Embedding wpe{nullptr};  // learned positions
  std::vector<Block> blocks;          // the same modules as the registered ModuleList "blocks"
  torch::nn::LayerNorm ln_f{nullptr};

 private:
  // GPT-2's initial values for one module's parameters, drawn in registration order.
  void init_parameters(torch::nn::Module& module, bool is_norm);
  // Initialises `module` and marks it as a stage-3 block (zerotrain/zero/blocks.h).
  void finish_block(const std::shared_ptr<torch::nn::Module>& module, bool is_norm);
  // With a tensor group: keeps this rank's slice of the module's whole parameters.
  void keep_tensor_slices(torch::nn::Module& module, bool is_token_embedding);
  torch::Tensor head_logits(const torch::Tensor& x, const torch::Tensor& weight) const;
  torch::Tensor tensor_parallel_chunked_loss(const torch::Tensor& flat_x, const torch::Tensor& flat_targets);

  GPTConfig config_;
  std::shared_ptr<Communicator> tensor_group_;
  int64_t vocab_begin_ = 0;  // with a tensor group: the first token id of this rank's rows
  torch::nn::Dropout drop_{nullptr};
  torch::nn::ModuleList block_list_{nullptr};
  BlockWrapper block_wrapper_;
  Checkpointing checkpointing_;
  std::vector<char> checkpointed_;  // per block
  std::vector<std::shared_ptr<CheckpointTimings>> timings_;
  std::shared_ptr<CheckpointArena> arena_;
};
TORCH_MODULE(GPT);

}  // namespace zt
