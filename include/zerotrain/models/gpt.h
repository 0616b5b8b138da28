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

#include "zerotrain/activation_checkpointing.h"
#include "zerotrain/models/gpt_config.h"

namespace zt {

// Causal self-attention with a fused qkv projection.
class CausalSelfAttentionImpl : public torch::nn::Module {
 public:
  explicit CausalSelfAttentionImpl(const GPTConfig& config);
  // [B,T,C] -> [B,T,C]. `allowed`, when defined, is a bool [B,1,T,T] mask (true: query t may
  // attend to key s) replacing the causal one; undefined: causal attention.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& allowed = {});

  torch::nn::Linear c_attn{nullptr};  // C -> 3C (q, k, v)
  torch::nn::Linear c_proj{nullptr};  // C -> C, residual projection

 private:
  int64_t n_head_;
  double dropout_;
  friend class GPTImpl;
  // Selective recomputation: the attention core (scores, softmax, dropout, weighted sum) is
  // checkpointed, keeping q, k and v.
  bool recompute_scores_ = false;
  CheckpointOptions checkpoint_options_;
  torch::nn::Dropout resid_drop_{nullptr};
};
TORCH_MODULE(CausalSelfAttention);

class MLPImpl : public torch::nn::Module {
 public:
  explicit MLPImpl(const GPTConfig& config);
  torch::Tensor forward(const torch::Tensor& x);

  torch::nn::Linear c_fc{nullptr};    // C -> 4C
  torch::nn::Linear c_proj{nullptr};  // 4C -> C, residual projection

 private:
  torch::nn::Dropout drop_{nullptr};
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
  explicit BlockImpl(const GPTConfig& config);
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& allowed = {});  // allowed: as the attention's

  torch::nn::LayerNorm ln_1{nullptr};
  CausalSelfAttention attn{nullptr};
  torch::nn::LayerNorm ln_2{nullptr};
  MLP mlp{nullptr};
};
TORCH_MODULE(Block);

class GPTImpl : public torch::nn::Module {
 public:
  explicit GPTImpl(const GPTConfig& config);

  // idx: integer tensor [B,T] with 1 <= T <= context_length -> logits [B,T,vocab_size].
  torch::Tensor forward(const torch::Tensor& idx);
  // forward() in two parts: the final LayerNorm's output [B,T,C], and the tied head on it.
  // `segments` (packed rows, zerotrain/data.h Batch::segments), when defined: integer [B,T]; each
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

  // Activation checkpointing (docs/activation_checkpointing.md): which blocks recompute what in
  // backward. Gradients are bitwise those of the plain model (dropout masks are drawn again from
  // the saved generator states). Throws ConfigError on a count outside [0, n_layer].
  using Checkpointing = CheckpointingSettings;  // zerotrain/activation_checkpointing.h; profile: checkpoint_timings()
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
  // Initialises `module` and marks it as a stage-3 block (zerotrain/blocks.h).
  void finish_block(const std::shared_ptr<torch::nn::Module>& module, bool is_norm);

  GPTConfig config_;
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
