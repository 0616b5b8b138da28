#include "zerotrain/models/bert.h"

#include <limits>
#include <string>

#include <torch/torch.h>

#include "zerotrain/zero/blocks.h"
#include "zerotrain/comm/comm.h"
#include "zerotrain/error.h"
#include "zerotrain/models/tensor_parallel.h"

namespace zt {
namespace {

[[noreturn]] void bad_input(const std::string& what) { throw ConfigError("BERT: " + what); }

std::string describe(const torch::Tensor& t) {
  return t.defined() ? c10::str(t.dim(), "-D ", t.scalar_type(), " tensor ", t.sizes())
                     : std::string("an undefined tensor");
}

bool is_integer(const torch::Tensor& t) { return at::isIntegralType(t.scalar_type(), /*includeBool=*/false); }

bool ends_with(const std::string& name, const std::string& suffix) {
  return name.size() >= suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
}

torch::nn::LayerNorm layer_norm(const BertConfig& c) {
  return torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.hidden}).eps(c.layer_norm_eps));
}

// Softmax over the vocabulary in bf16/fp16 loses too much; logits are fp32 whatever the model's dtype.
torch::Tensor to_fp32(torch::Tensor t) {
  if (t.scalar_type() != torch::kFloat && t.scalar_type() != torch::kDouble) t = t.to(torch::kFloat);
  return t;
}

}  // namespace

// ---- modules --------------------------------------------------------------------------------

BertEmbeddingsImpl::BertEmbeddingsImpl(const BertConfig& config, std::shared_ptr<Communicator> tensor_group)
    : group_(std::move(tensor_group)) {
  if (group_) vocab_begin_ = config.vocab_size / group_->world_size() * group_->rank();
  word_embeddings = register_module("word_embeddings", torch::nn::Embedding(config.vocab_size, config.hidden));
  position_embeddings =
      register_module("position_embeddings", torch::nn::Embedding(config.max_positions, config.hidden));
  token_type_embeddings =
      register_module("token_type_embeddings", torch::nn::Embedding(config.type_vocab_size, config.hidden));
  layer_norm = register_module("layer_norm", zt::layer_norm(config));
  dropout_ = register_module("dropout", torch::nn::Dropout(config.dropout));
}

torch::Tensor BertEmbeddingsImpl::forward(const torch::Tensor& input_ids, const torch::Tensor& token_type_ids) {
  const int64_t T = input_ids.size(1);
  auto positions = torch::arange(T, torch::TensorOptions().dtype(torch::kLong).device(input_ids.device()));
  auto words = group_ ? vocab_parallel_lookup(input_ids, word_embeddings->weight, vocab_begin_, group_)
                      : word_embeddings(input_ids);
  auto x = words + position_embeddings(positions) + token_type_embeddings(token_type_ids);
  return dropout_(layer_norm(x));
}

BertSelfAttentionImpl::BertSelfAttentionImpl(const BertConfig& config, std::shared_ptr<Communicator> tensor_group)
    : n_head_(config.n_head / tensor_group_size(tensor_group)), head_dim_(config.hidden / config.n_head),
      dropout_(config.dropout), group_(std::move(tensor_group)) {
  query = register_module("query", torch::nn::Linear(config.hidden, config.hidden));
  key = register_module("key", torch::nn::Linear(config.hidden, config.hidden));
  value = register_module("value", torch::nn::Linear(config.hidden, config.hidden));
  output = register_module("output", torch::nn::Linear(config.hidden, config.hidden));
  output_dropout_ = register_module("output_dropout", torch::nn::Dropout(config.dropout));
}

torch::Tensor BertSelfAttentionImpl::forward(const torch::Tensor& x, const torch::Tensor& keep) {
  const int64_t B = x.size(0), T = x.size(1), hd = head_dim_;
  auto heads = [&](const torch::Tensor& t) { return t.view({B, T, n_head_, hd}).transpose(1, 2); };
  const double dropout_p = is_training() ? dropout_ : 0.0;
  // The boolean key mask [B,1,1,T] (true: attend) broadcasts over heads and queries; padded
  // queries still attend to the tokens, and their outputs are never read by the losses.
  auto attend_here = [dropout_p, keep](const std::vector<torch::Tensor>& qkv) {
    std::optional<torch::Tensor> mask;
    if (qkv[0].is_cpu() && qkv[0].scalar_type() == torch::kBFloat16) {
      // bf16 on the CPU: LibTorch's math path is 1.3-1.6x faster forward + backward than its
      // fused CPU attention kernel at bert-base shapes, with the same error against fp64 (fp32
      // keeps the fused kernel, which is faster there: docs/benchmarks.md, "Fused BERT operations
      // on the CPU"); it keeps the [B, heads, T, T] probabilities for backward. It takes the mask
      // as given, so the key mask becomes additive: the lowest finite value, not -inf, so that a
      // sequence without tokens gets uniform weights rather than NaN.
      if (keep.defined())
        mask = torch::zeros(keep.sizes(), qkv[0].options())
                   .masked_fill_(keep.logical_not(), std::numeric_limits<c10::BFloat16>::lowest());
      return std::get<0>(
          at::_scaled_dot_product_attention_math(qkv[0], qkv[1], qkv[2], mask, dropout_p, /*is_causal=*/false));
    }
    if (keep.defined()) mask = keep;
    return at::scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], mask, dropout_p, /*is_causal=*/false);
  };
  // This rank's heads: their dropout masks must not repeat another rank's (zerotrain/models/tensor_parallel.h).
  auto attend = [attend_here, split = tensor_group_size(group_) > 1 && dropout_p > 0](const std::vector<torch::Tensor>& qkv) {
    return split ? with_tensor_parallel_rng(qkv[0].device(), [&] { return attend_here(qkv); }) : attend_here(qkv);
  };
  const torch::Tensor in = group_ ? copy_to_tensor_group(x, group_) : x;
  std::vector<torch::Tensor> qkv = {heads(query(in)), heads(key(in)), heads(value(in))};
  auto y = recompute_scores_ ? checkpoint(attend, qkv, checkpoint_options_) : attend(qkv);
  y = y.transpose(1, 2).contiguous().view({B, T, n_head_ * hd});
  return output_dropout_(row_parallel_linear(y, output->weight, output->bias, group_));
}

BertLayerImpl::BertLayerImpl(const BertConfig& config, std::shared_ptr<Communicator> tensor_group)
    : pre_layer_norm_(config.pre_layer_norm), group_(std::move(tensor_group)) {
  attention = register_module("attention", BertSelfAttention(config, group_));
  attention_norm = register_module("attention_norm", layer_norm(config));
  intermediate = register_module("intermediate", torch::nn::Linear(config.hidden, config.intermediate));
  output = register_module("output", torch::nn::Linear(config.intermediate, config.hidden));
  output_norm = register_module("output_norm", layer_norm(config));
  dropout_ = register_module("dropout", torch::nn::Dropout(config.dropout));
}

torch::Tensor BertLayerImpl::forward(const torch::Tensor& x, const torch::Tensor& keep) {
  auto feed_forward = [this](const torch::Tensor& in) {
    // BERT's GELU is the exact (erf) one.
    auto h = intermediate(group_ ? copy_to_tensor_group(in, group_) : in);
    auto a = torch::gelu(h, "none");
    // With a tensor group the output's bias is added once, after the sum over the group.
    auto y = group_ ? torch::nn::functional::linear(a, output->weight) : output(a);
    if (recompute_activation_)
      y = recompute_in_backward(y, a, [h](torch::Tensor& into) { at::gelu_out(into, h, "none"); });
    if (group_) y = reduce_from_tensor_group(y, group_) + output->bias;
    return dropout_(y);
  };
  if (pre_layer_norm_) {
    auto h = x + attention(attention_norm(x), keep);
    return h + feed_forward(output_norm(h));
  }
  auto h = attention_norm(x + attention(x, keep));
  return output_norm(h + feed_forward(h));
}

BertMlmHeadImpl::BertMlmHeadImpl(const BertConfig& config) {
  dense = register_module("dense", torch::nn::Linear(config.hidden, config.hidden));
  layer_norm = register_module("layer_norm", zt::layer_norm(config));
  bias = register_parameter("bias", torch::zeros({config.vocab_size}));
}

torch::Tensor BertMlmHeadImpl::transform(const torch::Tensor& x) { return layer_norm(torch::gelu(dense(x), "none")); }

BertNspHeadImpl::BertNspHeadImpl(const BertConfig& config) {
  pooler = register_module("pooler", torch::nn::Linear(config.hidden, config.hidden));
  classifier = register_module("classifier", torch::nn::Linear(config.hidden, 2));
}

torch::Tensor BertNspHeadImpl::forward(const torch::Tensor& cls_hidden) {
  return classifier(torch::tanh(pooler(cls_hidden)));
}

// ---- the model ------------------------------------------------------------------------------

BertImpl::BertImpl(const BertConfig& config, std::shared_ptr<Communicator> tensor_group)
    : config_(config), tensor_group_(std::move(tensor_group)) {
  config_.validate();
  if (const int64_t T = tensor_group_size(tensor_group_); T > 1) {
    for (const auto& [key, value] : {std::pair{"n_head", config_.n_head}, std::pair{"intermediate", config_.intermediate},
                                     std::pair{"vocab_size", config_.vocab_size}})
      if (value % T != 0)
        bad_input(std::string(key) + " " + std::to_string(value) + " is not divisible by the tensor group's " +
                  std::to_string(T) + " ranks; expected a multiple of " + std::to_string(T));
    // Megatron's seed of the split region's generator: the default one's, offset per tensor rank.
    seed_tensor_parallel_rng(at::detail::getDefaultCPUGenerator().current_seed() + 2718 + uint64_t(tensor_group_->rank()));
  } else {
    tensor_group_.reset();  // a group of one is the unsplit model
  }
  // As the GPT: each block is initialised and marked right after it is built, so that under a
  // ShardedConstruction no rank holds more than its shards plus one block.
  embeddings = register_module("embeddings", BertEmbeddings(config_, tensor_group_));
  finish_block(embeddings.ptr());
  layer_list_ = register_module("layers", torch::nn::ModuleList());
  layers.reserve(size_t(config_.n_layer));
  for (int64_t i = 0; i < config_.n_layer; ++i) {
    layers.emplace_back(config_, tensor_group_);
    layer_list_->push_back(layers.back());
    finish_block(layers.back().ptr());
  }
  if (config_.pre_layer_norm) {
    final_norm = register_module("final_norm", layer_norm(config_));
    finish_block(final_norm.ptr());
  }
  mlm = register_module("mlm", BertMlmHead(config_));
  finish_block(mlm.ptr());
  if (config_.next_sentence) {
    nsp = register_module("nsp", BertNspHead(config_));
    finish_block(nsp.ptr());
  }
  checkpointed_.assign(size_t(config_.n_layer), 0);
}

void BertImpl::finish_block(const std::shared_ptr<torch::nn::Module>& module) {
  // The torch::nn constructors already drew (Kaiming-uniform) values; redraw every tensor in
  // registration order so the result depends only on the global seed and BERT's recipe.
  {
    torch::NoGradGuard no_grad;
    const bool whole_norm = std::dynamic_pointer_cast<torch::nn::LayerNormImpl>(module) != nullptr;
    for (auto& item : module->named_parameters(/*recurse=*/true)) {
      const std::string& name = item.key();
      torch::Tensor& p = item.value();
      const bool is_bias = name == "bias" || (name.size() > 5 && name.compare(name.size() - 5, 5, ".bias") == 0);
      if (is_bias)
        p.zero_();
      else if (whole_norm || name.find("norm") != std::string::npos)
        p.fill_(1.0);
      else
        p.normal_(0.0, 0.02);
    }
  }
  if (tensor_group_) keep_tensor_slices(*module);
  mark_block(module);
}

// The whole values were drawn as the unsplit model draws them; each split parameter keeps this
// rank's slice (set_data: the module's member and its registration stay the same tensor).
void BertImpl::keep_tensor_slices(torch::nn::Module& module) {
  const bool head = !mlm.is_empty() && &module == mlm.get();
  for (auto& item : module.named_parameters(/*recurse=*/true)) {
    const std::string& name = item.key();
    torch::Tensor& p = item.value();
    int dim = 0;
    if (name == "word_embeddings.weight" || (head && name == "bias") || ends_with(name, "attention.query.weight") ||
        ends_with(name, "attention.query.bias") || ends_with(name, "attention.key.weight") ||
        ends_with(name, "attention.key.bias") || ends_with(name, "attention.value.weight") ||
        ends_with(name, "attention.value.bias") || name == "intermediate.weight" || name == "intermediate.bias") {
      dim = 0;  // vocabulary rows; the rows of this rank's heads and features
    } else if (name == "attention.output.weight" || name == "output.weight") {
      dim = 1;  // the columns of this rank's heads and features
    } else {
      continue;  // replicated: positions, token types, norms, the row-parallel biases, the heads' dense
    }
    keep_tensor_slice(p, tensor_group_, dim);
  }
}

// The MLM cross-entropy: over this rank's vocabulary slice with a tensor group.
torch::Tensor BertImpl::mlm_cross_entropy(const torch::Tensor& logits, const torch::Tensor& labels,
                                          int64_t ignore_index) {
  if (tensor_group_) return vocab_parallel_cross_entropy(logits, labels, tensor_group_, ignore_index);
  return torch::nn::functional::cross_entropy(
      logits, labels, torch::nn::functional::CrossEntropyFuncOptions().ignore_index(ignore_index));
}

torch::Tensor BertImpl::forward(const torch::Tensor& input_ids, const torch::Tensor& token_type_ids,
                                const torch::Tensor& attention_mask) {
  if (!input_ids.defined() || input_ids.dim() != 2)
    bad_input("forward expects input_ids of shape [B, T], found " + describe(input_ids));
  if (!is_integer(input_ids)) bad_input("forward expects integer input_ids, found " + describe(input_ids));
  const int64_t B = input_ids.size(0), T = input_ids.size(1);
  if (B < 1) bad_input("batch size must be >= 1, found 0");
  if (T < 1 || T > config_.max_positions)
    bad_input("sequence length " + std::to_string(T) + " is outside [1, max_positions=" +
              std::to_string(config_.max_positions) + "]");
  torch::Tensor types = token_type_ids;
  if (!types.defined()) {
    types = torch::zeros_like(input_ids, torch::kLong);
  } else if (types.sizes() != input_ids.sizes() || !is_integer(types)) {
    bad_input("token_type_ids must be integer ids of the shape of input_ids " + c10::str(input_ids.sizes()) +
              ", found " + describe(types));
  }
  torch::Tensor keep;
  if (attention_mask.defined()) {
    if (attention_mask.sizes() != input_ids.sizes() ||
        !(is_integer(attention_mask) || attention_mask.scalar_type() == torch::kBool))
      bad_input("attention_mask must be integer or bool of the shape of input_ids " + c10::str(input_ids.sizes()) +
                ", found " + describe(attention_mask));
    keep = (attention_mask != 0).view({B, 1, 1, T}).to(input_ids.device());
  }

  if (tensor_group_) {
    // Each rank looks up only its rows: an id outside the vocabulary would read as zeros.
    const int64_t lo = input_ids.min().item<int64_t>(), hi = input_ids.max().item<int64_t>();
    if (lo < 0 || hi >= config_.vocab_size)
      bad_input("input_ids must be in [0, vocab_size=" + std::to_string(config_.vocab_size) + "), found range [" +
                std::to_string(lo) + ", " + std::to_string(hi) + "]");
  }
  torch::Tensor x;
  try {
    x = run_block(*embeddings, input_ids, [e = embeddings.ptr(), types](const torch::Tensor& in) {
      return e->forward(in, types);
    });
  } catch (const c10::Error& err) {
    // Out-of-range ids: on the CPU the embedding throws "index out of range"; say which input.
    auto range = [](const torch::Tensor& t) {
      return "[" + std::to_string(t.min().item<int64_t>()) + ", " + std::to_string(t.max().item<int64_t>()) + "]";
    };
    bad_input("input_ids must be in [0, vocab_size=" + std::to_string(config_.vocab_size) +
              ") and token_type_ids in [0, type_vocab_size=" + std::to_string(config_.type_vocab_size) +
              "), found ranges " + range(input_ids) + " and " + range(types) + " (" + err.what_without_backtrace() +
              ")");
  }

  for (int64_t i = 0; i < config_.n_layer; ++i) {
    // Owns what it captures: a checkpointed layer runs it again in backward.
    BlockFn run = [b = layers[size_t(i)].ptr(), wrapper = block_wrapper_, i, keep](const torch::Tensor& in) {
      if (wrapper) return wrapper(i, [b, keep](const torch::Tensor& t) { return b->forward(t, keep); }, in);
      return b->forward(in, keep);
    };
    if (checkpointing_.recompute == Recompute::Full && checkpointed_[size_t(i)]) {
      CheckpointOptions options;
      options.keep_inputs_on_host = checkpointing_.keep_inputs_on_host;
      options.synchronize_boundary = checkpointing_.synchronize_boundary;
      options.arena = arena_;
      // The layer input is the hidden stream, which the tensor group replicates (ZeRO-R).
      if (checkpointing_.partition_activations) options.partition_group = tensor_group_;
      if (!timings_.empty()) options.timings = timings_[size_t(i)];
      x = run_checkpointed_block(*layers[size_t(i)], x, std::move(run), options);
    } else {
      x = run_block(*layers[size_t(i)], x, run);
    }
  }
  if (config_.pre_layer_norm)
    x = run_block(*final_norm, x, [n = final_norm.ptr()](const torch::Tensor& in) { return n->forward(in); });
  return x;
}

torch::Tensor BertImpl::mlm_logits(const torch::Tensor& rows) {
  if (!rows.defined() || rows.dim() != 2 || rows.size(1) != config_.hidden)
    bad_input("mlm_logits expects rows [N, hidden=" + std::to_string(config_.hidden) + "], found " + describe(rows));
  // Three block runs, as the GPT's tied head: the head's transform, the decoder with the word
  // embeddings' weight (stage 3 gathers that block again), then the head's output bias.
  auto t = run_block(*mlm, rows, [m = mlm.ptr()](const torch::Tensor& in) { return m->transform(in); });
  auto logits = run_block(*embeddings, t, [e = embeddings.ptr(), group = tensor_group_](const torch::Tensor& in) {
    // With a tensor group: this rank's vocabulary slice of the logits.
    return torch::nn::functional::linear(group ? copy_to_tensor_group(in, group) : in, e->word_embeddings->weight);
  });
  logits = run_block(*mlm, logits, [m = mlm.ptr()](const torch::Tensor& in) { return in + m->bias; });
  last_projected_rows_ = rows.size(0);
  return to_fp32(logits);
}

torch::Tensor BertImpl::nsp_logits(const torch::Tensor& hidden) {
  if (!config_.next_sentence) bad_input("nsp_logits needs config.next_sentence, which is false");
  if (!hidden.defined() || hidden.dim() != 3 || hidden.size(2) != config_.hidden)
    bad_input("nsp_logits expects hidden [B, T, hidden=" + std::to_string(config_.hidden) + "], found " +
              describe(hidden));
  auto cls = hidden.select(1, 0);
  return to_fp32(run_block(*nsp, cls, [h = nsp.ptr()](const torch::Tensor& in) { return h->forward(in); }));
}

torch::Tensor BertImpl::check_and_run(const BertBatch& batch, torch::Tensor& positions, torch::Tensor& labels) {
  const auto& ids = batch.input_ids;
  if (!ids.defined() || ids.dim() != 2) bad_input("the batch's input_ids must be [B, T], found " + describe(ids));
  const int64_t tokens = ids.size(0) * ids.size(1);
  positions = batch.masked_positions;
  labels = batch.masked_labels;
  if (!positions.defined() || positions.dim() != 1 || !is_integer(positions) || positions.size(0) < 1)
    bad_input("the batch's masked_positions must be a non-empty 1-D integer tensor (MlmMasker::apply sets it), found " +
              describe(positions));
  if (!labels.defined() || labels.sizes() != positions.sizes() || !is_integer(labels))
    bad_input("the batch's masked_labels must be integer ids of the shape of masked_positions " +
              c10::str(positions.sizes()) + ", found " + describe(labels));
  // Checked where it costs no device synchronisation (the sampler's batches are on the CPU).
  if (positions.device().is_cpu()) {
    const int64_t lo = positions.min().item<int64_t>(), hi = positions.max().item<int64_t>();
    if (lo < 0 || hi >= tokens)
      bad_input("masked_positions must be flat indices in [0, B·T=" + std::to_string(tokens) + "), found range [" +
                std::to_string(lo) + ", " + std::to_string(hi) + "]");
  }
  if (labels.device().is_cpu()) {
    const int64_t lo = labels.min().item<int64_t>(), hi = labels.max().item<int64_t>();
    if (lo < 0 || hi >= config_.vocab_size)
      bad_input("masked_labels must be in [0, vocab_size=" + std::to_string(config_.vocab_size) + "), found range [" +
                std::to_string(lo) + ", " + std::to_string(hi) + "]");
  }
  if (config_.next_sentence) {
    const auto& nsp_labels = batch.nsp_labels;
    if (!nsp_labels.defined() || nsp_labels.dim() != 1 || nsp_labels.size(0) != ids.size(0) || !is_integer(nsp_labels))
      bad_input("next_sentence needs the batch's nsp_labels as integer [B=" + std::to_string(ids.size(0)) +
                "], found " + describe(nsp_labels));
    if (nsp_labels.device().is_cpu() && ((nsp_labels < 0) | (nsp_labels > 1)).any().item<bool>())
      bad_input("nsp_labels must be 0 (B follows A) or 1 (B is random), found range [" +
                std::to_string(nsp_labels.min().item<int64_t>()) + ", " +
                std::to_string(nsp_labels.max().item<int64_t>()) + "]");
  }
  auto device = ids.device();
  positions = positions.to(device, torch::kLong);
  labels = labels.to(device, torch::kLong);
  return forward(ids, batch.token_type_ids, batch.attention_mask);
}

BertLosses BertImpl::losses(const BertBatch& batch) {
  torch::Tensor positions, labels;
  auto hidden = check_and_run(batch, positions, labels);
  // Only the masked rows reach the head: the decoder's [rows, V] product is ~15% of the full one.
  auto rows = hidden.reshape({-1, config_.hidden}).index_select(0, positions);
  BertLosses out;
  out.mlm = mlm_cross_entropy(mlm_logits(rows), labels, -100);
  out.total = out.mlm;
  if (config_.next_sentence) {
    out.nsp =
        torch::nn::functional::cross_entropy(nsp_logits(hidden), batch.nsp_labels.to(hidden.device(), torch::kLong));
    out.total = out.mlm + out.nsp;
  }
  return out;
}

torch::Tensor BertImpl::mlm_loss_full_projection(const BertBatch& batch) {
  torch::Tensor positions, labels;
  auto hidden = check_and_run(batch, positions, labels);
  auto logits = mlm_logits(hidden.reshape({-1, config_.hidden}));
  auto full_labels = torch::full({logits.size(0)}, -100, labels.options()).index_copy_(0, positions, labels);
  auto loss = mlm_cross_entropy(logits, full_labels, -100);  // ignore_index -100: mean over masked
  if (config_.next_sentence)
    loss = loss +
           torch::nn::functional::cross_entropy(nsp_logits(hidden), batch.nsp_labels.to(hidden.device(), torch::kLong));
  return loss;
}

// ---- activation checkpointing ------------------------------------------------------------------

void BertImpl::set_checkpointing(const Checkpointing& settings) {
  const int64_t L = config_.n_layer;
  checkpointed_ = checkpointed_blocks(L, settings.number_checkpoints, "layer");
  checkpointing_ = settings;
  const int64_t n = settings.number_checkpoints == 0 ? L : settings.number_checkpoints;
  timings_.clear();
  if (settings.profile && settings.recompute != Recompute::None)
    for (int64_t i = 0; i < L; ++i) timings_.push_back(std::make_shared<CheckpointTimings>());
  arena_.reset();
  if (settings.contiguous_memory && settings.recompute == Recompute::Full)
    arena_ = std::make_shared<CheckpointArena>(int(n));
  for (int64_t i = 0; i < L; ++i) {
    const bool selective = settings.recompute == Recompute::Selective && checkpointed_[size_t(i)];
    auto& attention = *layers[size_t(i)]->attention;
    attention.recompute_scores_ = selective;
    attention.checkpoint_options_ = CheckpointOptions{};
    attention.checkpoint_options_.keep_inputs_on_host = settings.keep_inputs_on_host;
    attention.checkpoint_options_.synchronize_boundary = settings.synchronize_boundary;
    if (selective && !timings_.empty()) attention.checkpoint_options_.timings = timings_[size_t(i)];
    layers[size_t(i)]->recompute_activation_ = selective;
  }
}

bool BertImpl::is_checkpointed(int64_t layer) const {
  return checkpointing_.recompute != Recompute::None && layer >= 0 && layer < int64_t(checkpointed_.size()) &&
         checkpointed_[size_t(layer)] != 0;
}

std::vector<CheckpointTimings> BertImpl::checkpoint_timings() const {
  std::vector<CheckpointTimings> out;
  for (const auto& t : timings_) out.push_back(*t);
  return out;
}

}  // namespace zt
