// Tensor parallelism (Megatron's model parallelism): layers whose weights are split across the T
// ranks of a tensor group, so that each rank holds 1/T of them and computes 1/T of the layer
// (docs/tensor_parallel.md).
//
//   ColumnParallelLinear  weight rows split: y_r = x W_r^T (+ b_r); the output stays split along
//                         its last dimension (or is all-gathered whole with gather_output).
//   RowParallelLinear     weight columns split: y = sum_r x_r W_r^T (+ b): one all-reduce in
//                         forward; its input is a column-parallel layer's split output.
//   VocabParallelEmbedding vocabulary rows split: each rank looks up the ids in its range, the
//                         others contribute zeros, one all-reduce in forward.
//   vocab_parallel_cross_entropy  the loss over logits split along the vocabulary, without
//                         gathering them: three all-reduces of one value per row.
// A column-parallel layer followed by a row-parallel one (an MLP, or attention with its heads
// split) costs one all-reduce in forward and one in backward (copy_to_tensor_group's).
//
// Contract
// - Every rank of the group builds the same layers in the same order from the same seed: each
//   layer draws its whole weight as the unsplit LibTorch layer would (torch::nn::Linear,
//   torch::nn::Embedding) and keeps its own slice, so a group of T ranks computes what one rank
//   computes with the unsplit layer, up to the order of floating-point sums.
// - T must divide the split dimension (out_features, in_features, the vocabulary); otherwise
//   the constructor throws zt::ConfigError naming the layer, the size and T.
// - Parameters that are not split (a row-parallel bias) are replicated: their gradients are the
//   same on every rank of the group.
// - The collectives run on the group's communicator in forward and backward, in the same order on
//   every rank (as every collective must). Not thread-safe.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

namespace zt {

class Communicator;

// Identity in forward; the gradient is summed over the group in backward (Megatron's f). The
// input of a column-parallel layer passes through it.
at::Tensor copy_to_tensor_group(const at::Tensor& x, const std::shared_ptr<Communicator>& group);
// Summed over the group in forward; identity in backward (Megatron's g).
at::Tensor reduce_from_tensor_group(const at::Tensor& x, const std::shared_ptr<Communicator>& group);
// Each rank's tensor concatenated along the last dimension in rank order; backward keeps this
// rank's slice of the gradient.
at::Tensor gather_from_tensor_group(const at::Tensor& x, const std::shared_ptr<Communicator>& group);

// For models that split their own layers (the reference GPT, BERT and Llama do):
// - the group's size, 1 for none;
int64_t tensor_group_size(const std::shared_ptr<Communicator>& group);
// - a row-parallel projection from weight [out, in / T]: this rank's partial product summed over
//   the group, then the (replicated, possibly undefined) bias once; with no group, linear(x);
at::Tensor row_parallel_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                               const std::shared_ptr<Communicator>& group);
// - `parameter`, holding the whole value as the unsplit model drew it, keeps this rank's slice:
//   along `dim`, `parts` equal parts each cut into T, the rank's piece of every part (set_data:
//   the module's member stays the same tensor), marked with zt::mark_tensor_split.
void keep_tensor_slice(at::Tensor& parameter, const std::shared_ptr<Communicator>& group, int dim, int parts = 1);

class ColumnParallelLinearImpl : public torch::nn::Module {
 public:
  ColumnParallelLinearImpl(int64_t in_features, int64_t out_features, bool bias,
                           std::shared_ptr<Communicator> group, bool gather_output = false);
  // x: [..., in_features], the same on every rank; returns [..., out_features / T] (this rank's
  // features out_features / T · rank onwards), or [..., out_features] with gather_output.
  at::Tensor forward(const at::Tensor& x);
  // Takes this rank's slice of a whole weight [out, in] (and bias [out]), e.g. a checkpoint's.
  void load_whole(const at::Tensor& weight, const at::Tensor& bias);

  at::Tensor weight;  // [out_features / T, in_features]
  at::Tensor bias;    // [out_features / T], undefined without bias
  int64_t in_features, out_features;

 private:
  std::shared_ptr<Communicator> group_;
  bool gather_output_;
};
TORCH_MODULE(ColumnParallelLinear);

class RowParallelLinearImpl : public torch::nn::Module {
 public:
  RowParallelLinearImpl(int64_t in_features, int64_t out_features, bool bias, std::shared_ptr<Communicator> group);
  // x: [..., in_features / T], this rank's slice of the features (a column-parallel output);
  // returns [..., out_features], the same on every rank.
  at::Tensor forward(const at::Tensor& x);
  void load_whole(const at::Tensor& weight, const at::Tensor& bias);

  at::Tensor weight;  // [out_features, in_features / T]
  at::Tensor bias;    // [out_features], replicated, undefined without bias
  int64_t in_features, out_features;

 private:
  std::shared_ptr<Communicator> group_;
};
TORCH_MODULE(RowParallelLinear);

class VocabParallelEmbeddingImpl : public torch::nn::Module {
 public:
  VocabParallelEmbeddingImpl(int64_t num_embeddings, int64_t embedding_dim, std::shared_ptr<Communicator> group);
  // ids: any shape of int64 ids in [0, num_embeddings); returns [..., embedding_dim] on every rank.
  at::Tensor forward(const at::Tensor& ids);
  void load_whole(const at::Tensor& weight);
  // The ids [begin, end) whose rows this rank holds.
  int64_t vocab_begin() const { return begin_; }
  int64_t vocab_end() const { return end_; }

  at::Tensor weight;  // [num_embeddings / T, embedding_dim]
  int64_t num_embeddings, embedding_dim;

 private:
  std::shared_ptr<Communicator> group_;
  int64_t begin_ = 0, end_ = 0;
};
TORCH_MODULE(VocabParallelEmbedding);

// VocabParallelEmbedding's lookup on rows [vocab_begin, vocab_begin + local_weight.size(0)) held
// in `local_weight` (a tied embedding and head keep that weight in a module of their own).
at::Tensor vocab_parallel_lookup(const at::Tensor& ids, const at::Tensor& local_weight, int64_t vocab_begin,
                                 const std::shared_ptr<Communicator>& group);

// Cross-entropy of logits split along the vocabulary: `local_logits` [N, V / T] holds this rank's
// vocabulary slice (ids V / T · rank onwards) of every row, `targets` [N] the whole-vocabulary ids
// (the same on every rank), rows with `ignore_index` left out. Returns the mean over the rows
// counted, the same on every rank; its gradient reaches only this rank's slice.
at::Tensor vocab_parallel_cross_entropy(const at::Tensor& local_logits, const at::Tensor& targets,
                                        const std::shared_ptr<Communicator>& group, int64_t ignore_index = -100);

// Randomness in the split region (Megatron's model-parallel RNG tracker). Dropout of activations
// the group replicates (the embeddings, a row-parallel layer's output) must draw the same mask on
// every rank of the group: seed the default generators alike on them (the trainer seeds by
// data-parallel rank). Dropout over a rank's own slice (the attention probabilities of its heads)
// must draw independent masks on each rank: it runs under with_tensor_parallel_rng, whose state is
// kept apart from the default generators' and seeded per tensor rank.
// - seed_tensor_parallel_rng(seed): the tracked state of every device starts again from `seed`
//   (Megatron's seed + 2718 + tensor rank). The GPT built with a tensor group seeds it so from the
//   default CPU generator's seed; the trainer reseeds it every step, as the default generators.
// - with_tensor_parallel_rng(device, fn): fn() runs with the default generator of `device` in the
//   tracked state; what fn draws advances the tracked state, and the default generator's own state
//   is back when it returns (or throws).
// - tensor_parallel_rng_states / set_tensor_parallel_rng_states: what activation checkpointing
//   takes before a block's first run and restores for its recomputation, so that the recomputed
//   masks are the first run's.
// Process-wide; used from the training thread.
struct TensorParallelRngStates {
  uint64_t seed = 0;
  std::vector<std::pair<c10::Device, at::Tensor>> states;  // per device used so far
};
void seed_tensor_parallel_rng(uint64_t seed);
at::Tensor with_tensor_parallel_rng(c10::Device device, const std::function<at::Tensor()>& fn);
TensorParallelRngStates tensor_parallel_rng_states();
void set_tensor_parallel_rng_states(const TensorParallelRngStates& states);

}  // namespace zt
