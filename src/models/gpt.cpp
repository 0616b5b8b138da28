#include "zerotrain/models/gpt.h"

#include <cmath>
#include <sstream>
#include <string_view>

#include <torch/torch.h>

#include "models/packed_rows.h"
#include "zerotrain/zero/blocks.h"
#include "zerotrain/comm/comm.h"
#include "zerotrain/error.h"
#include "zerotrain/models/tensor_parallel.h"

namespace zt {
namespace {

[[noreturn]] void bad_input(const std::string& what) { throw ConfigError("GPT: " + what); }

bool ends_with(std::string_view name, std::string_view suffix) {
  return name.size() >= suffix.size() && name.substr(name.size() - suffix.size()) == suffix;
}

}  // namespace

// ---- modules --------------------------------------------------------------------------------

CausalSelfAttentionImpl::CausalSelfAttentionImpl(const GPTConfig& config, std::shared_ptr<Communicator> tensor_group)
    : n_head_(config.n_head / tensor_group_size(tensor_group)), dropout_(config.dropout), group_(std::move(tensor_group)) {
  c_attn = register_module("c_attn", torch::nn::Linear(config.n_embd, 3 * config.n_embd));
  c_proj = register_module("c_proj", torch::nn::Linear(config.n_embd, config.n_embd));
  resid_drop_ = register_module("resid_drop", torch::nn::Dropout(config.dropout));
}

torch::Tensor CausalSelfAttentionImpl::forward(const torch::Tensor& x, const torch::Tensor& allowed) {
  // C: this rank's width of q, k and v (the whole width without a tensor group).
  const int64_t B = x.size(0), T = x.size(1), C = c_attn->weight.size(0) / 3;
  const int64_t hd = C / n_head_;
  // [B,T,3C] -> three [B,T,C] -> [B,nh,T,hd]
  auto qkv = c_attn(group_ ? copy_to_tensor_group(x, group_) : x).split(C, /*dim=*/2);
  auto heads = [&](const torch::Tensor& t) { return t.view({B, T, n_head_, hd}).transpose(1, 2); };
  // LibTorch 2.x dispatches this to a fused (flash / memory-efficient) kernel where available and
  // never materialises the [T,T] mask; is_causal applies the lower-triangular mask. Packed rows
  // pass their block-diagonal causal mask instead (the only case that builds one).
  const double dropout_p = is_training() ? dropout_ : 0.0;
  auto attend = [dropout_p, allowed, split = tensor_group_size(group_) > 1](const std::vector<torch::Tensor>& qkv_heads) {
    auto run = [&] {
      if (allowed.defined())
        return at::scaled_dot_product_attention(qkv_heads[0], qkv_heads[1], qkv_heads[2], allowed, dropout_p,
                                                /*is_causal=*/false);
      return at::scaled_dot_product_attention(qkv_heads[0], qkv_heads[1], qkv_heads[2], /*attn_mask=*/std::nullopt,
                                              dropout_p, /*is_causal=*/true);
    };
    // This rank's heads: their dropout masks must not repeat another rank's (zerotrain/models/tensor_parallel.h).
    return split && dropout_p > 0 ? with_tensor_parallel_rng(qkv_heads[0].device(), run) : run();
  };
  std::vector<torch::Tensor> qkv_heads = {heads(qkv[0]), heads(qkv[1]), heads(qkv[2])};
  auto y = recompute_scores_ ? checkpoint(attend, qkv_heads, checkpoint_options_) : attend(qkv_heads);
  y = y.transpose(1, 2).contiguous().view({B, T, C});
  return resid_drop_(row_parallel_linear(y, c_proj->weight, c_proj->bias, group_));
}

MLPImpl::MLPImpl(const GPTConfig& config, std::shared_ptr<Communicator> tensor_group) : group_(std::move(tensor_group)) {
  c_fc = register_module("c_fc", torch::nn::Linear(config.n_embd, 4 * config.n_embd));
  c_proj = register_module("c_proj", torch::nn::Linear(4 * config.n_embd, config.n_embd));
  drop_ = register_module("drop", torch::nn::Dropout(config.dropout));
}

torch::Tensor MLPImpl::forward(const torch::Tensor& x) {
  // GPT-2 uses the tanh approximation of GELU.
  auto h = c_fc(group_ ? copy_to_tensor_group(x, group_) : x);
  auto a = torch::gelu(h, "tanh");
  // With a tensor group the projection's bias is added once, after the sum over the group.
  auto y = group_ ? torch::nn::functional::linear(a, c_proj->weight) : c_proj(a);
  if (recompute_activation_) y = recompute_in_backward(y, a, [h](torch::Tensor& into) { at::gelu_out(into, h, "tanh"); });
  if (group_) y = reduce_from_tensor_group(y, group_) + c_proj->bias;
  return drop_(y);
}

BlockImpl::BlockImpl(const GPTConfig& config, std::shared_ptr<Communicator> tensor_group) {
  ln_1 = register_module("ln_1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({config.n_embd})));
  attn = register_module("attn", CausalSelfAttention(config, tensor_group));
  ln_2 = register_module("ln_2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({config.n_embd})));
  mlp = register_module("mlp", MLP(config, tensor_group));
}

torch::Tensor BlockImpl::forward(const torch::Tensor& x, const torch::Tensor& allowed) {
  auto h = x + attn(ln_1(x), allowed);
  return h + mlp(ln_2(h));
}

GPTImpl::GPTImpl(const GPTConfig& config, std::shared_ptr<Communicator> tensor_group)
    : config_(config), tensor_group_(std::move(tensor_group)) {
  config_.validate();
  if (const int64_t T = tensor_group_size(tensor_group_); T > 1) {
    if (config_.n_head % T != 0)
      throw ConfigError("GPT: n_head " + std::to_string(config_.n_head) + " is not divisible by the tensor group's " +
                        std::to_string(T) + " ranks; expected a multiple of " + std::to_string(T));
    if (config_.vocab_size % T != 0)
      throw ConfigError("GPT: vocab_size " + std::to_string(config_.vocab_size) +
                        " is not divisible by the tensor group's " + std::to_string(T) +
                        " ranks; pad the vocabulary to a multiple of " + std::to_string(T));
    vocab_begin_ = config_.vocab_size / T * tensor_group_->rank();
    // Megatron's seed of the split region's generator: the default one's, offset per tensor rank.
    seed_tensor_parallel_rng(at::detail::getDefaultCPUGenerator().current_seed() + 2718 + uint64_t(tensor_group_->rank()));
  }
  // Each parameterised module is initialised and marked as a stage-3 block (zerotrain/zero/blocks.h)
  // right after it is built: under a ShardedConstruction marking shards it at once, so no rank
  // ever holds more than its shards plus one block, and the values drawn do not depend on it.
  wte = register_module("wte", torch::nn::Embedding(config.vocab_size, config.n_embd));
  finish_block(wte.ptr(), false);
  wpe = register_module("wpe", torch::nn::Embedding(config.context_length, config.n_embd));
  finish_block(wpe.ptr(), false);
  drop_ = register_module("drop", torch::nn::Dropout(config.dropout));
  block_list_ = register_module("blocks", torch::nn::ModuleList());
  blocks.reserve(config.n_layer);
  for (int64_t i = 0; i < config.n_layer; ++i) {
    blocks.emplace_back(config, tensor_group_);
    block_list_->push_back(blocks.back());
    finish_block(blocks.back().ptr(), false);
  }
  ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({config.n_embd})));
  finish_block(ln_f.ptr(), true);
  checkpointed_.assign(size_t(config.n_layer), 0);
}

void GPTImpl::finish_block(const std::shared_ptr<torch::nn::Module>& module, bool is_norm) {
  init_parameters(*module, is_norm);
  if (tensor_group_size(tensor_group_) > 1) keep_tensor_slices(*module, module.get() == wte.get());
  mark_block(module);
}

// The whole values were drawn as the unsplit model draws them; each parameter keeps this rank's
// slice (set_data: the module's member and its registration stay the same tensor).
void GPTImpl::keep_tensor_slices(torch::nn::Module& module, bool is_token_embedding) {
  for (auto& item : module.named_parameters(/*recurse=*/true)) {
    const std::string& name = item.key();
    torch::Tensor& p = item.value();
    if (is_token_embedding || ends_with(name, "c_fc.weight") || ends_with(name, "c_fc.bias"))
      keep_tensor_slice(p, tensor_group_, 0);  // vocabulary rows; MLP features
    else if (ends_with(name, "c_attn.weight") || ends_with(name, "c_attn.bias"))
      keep_tensor_slice(p, tensor_group_, 0, 3);  // q, k and v each keep the rows of this rank's heads
    else if (ends_with(name, "c_proj.weight"))
      keep_tensor_slice(p, tensor_group_, 1);  // the columns of this rank's heads or features
    // The rest is replicated: wpe, layer norms, the projections' biases.
  }
}

void GPTImpl::init_parameters(torch::nn::Module& module, bool is_norm_module) {
  // The torch::nn constructors already drew (Kaiming-uniform) values; redraw every tensor in
  // registration order so the result depends only on the global seed and the GPT-2 recipe.
  torch::NoGradGuard no_grad;
  const double std = 0.02;
  const double resid_std = std / std::sqrt(2.0 * static_cast<double>(config_.n_layer));
  for (auto& item : module.named_parameters(/*recurse=*/true)) {
    const std::string& name = item.key();
    torch::Tensor& p = item.value();
    const bool is_norm = is_norm_module || name.find("ln_") != std::string::npos;
    if (ends_with(name, "bias")) {
      p.zero_();
    } else if (is_norm) {
      p.fill_(1.0);
    } else if (ends_with(name, "c_proj.weight")) {
      p.normal_(0.0, resid_std);  // residual projections: keeps the residual stream's variance flat
    } else {
      p.normal_(0.0, std);
    }
  }
}

torch::Tensor GPTImpl::forward(const torch::Tensor& idx) { return head(hidden(idx)); }

torch::Tensor GPTImpl::head(const torch::Tensor& x) {
  // Tied head: the same tensor as the token embedding, used transposed; the embedding's block
  // runs a second time (stage 3 gathers it again).
  return run_block(*wte, x, [this](const torch::Tensor& in) { return head_logits(in, wte->weight); });
}

// The tied head's logits; with a tensor group this rank's vocabulary slice (the input's gradient
// summed over the group, as a column-parallel layer's).
torch::Tensor GPTImpl::head_logits(const torch::Tensor& x, const torch::Tensor& weight) const {
  return torch::nn::functional::linear(tensor_group_ ? copy_to_tensor_group(x, tensor_group_) : x, weight);
}

torch::Tensor GPTImpl::hidden(const torch::Tensor& idx, const torch::Tensor& segments) {
  if (!idx.defined() || idx.dim() != 2)
    bad_input("forward expects token ids of shape [B, T], found " +
              (idx.defined() ? std::to_string(idx.dim()) + "-D tensor " + c10::str(idx.sizes())
                             : std::string("an undefined tensor")));
  if (!at::isIntegralType(idx.scalar_type(), /*includeBool=*/false))
    bad_input(std::string("forward expects integer token ids, found dtype ") + c10::toString(idx.scalar_type()));
  const int64_t T = idx.size(1);
  if (T < 1 || T > config_.context_length)
    bad_input("sequence length " + std::to_string(T) + " is outside [1, context_length=" +
              std::to_string(config_.context_length) + "]");
  if (idx.size(0) < 1) bad_input("batch size must be >= 1, found 0");

  if (tensor_group_) {
    // Each rank looks up only its rows: an id outside the vocabulary would read as zeros.
    auto [lo, hi] = std::pair(idx.min().item<int64_t>(), idx.max().item<int64_t>());
    if (lo < 0 || hi >= config_.vocab_size)
      bad_input("token ids must be in [0, vocab_size=" + std::to_string(config_.vocab_size) + "), found range [" +
                std::to_string(lo) + ", " + std::to_string(hi) + "]");
  }
  torch::Tensor tok;
  try {
    tok = run_block(*wte, idx, [this](const torch::Tensor& in) {
      return tensor_group_ ? vocab_parallel_lookup(in, wte->weight, vocab_begin_, tensor_group_) : wte(in);
    });
  } catch (const c10::Error& e) {
    // Out-of-range ids: on CPU the embedding throws "index out of range"; report it in our terms.
    auto [lo, hi] = std::pair(idx.min().item<int64_t>(), idx.max().item<int64_t>());
    bad_input("token ids must be in [0, vocab_size=" + std::to_string(config_.vocab_size) + "), found range [" +
              std::to_string(lo) + ", " + std::to_string(hi) + "] (" + e.what_without_backtrace() + ")");
  }
  auto pos = torch::arange(T, torch::TensorOptions().dtype(torch::kLong).device(idx.device()));
  torch::Tensor allowed;  // packed rows: the block-diagonal causal mask [B,1,T,T]
  if (segments.defined()) {
    PackedRows rows = packed_rows(idx, segments, "GPT");
    pos = std::move(rows.positions);  // [B,T]
    allowed = std::move(rows.allowed);
  }
  // [B,T,C] + [T,C], or + [B,T,C] for packed rows
  auto x = drop_(tok + run_block(*wpe, pos, [this](const torch::Tensor& in) { return wpe(in); }));

  for (int64_t i = 0; i < static_cast<int64_t>(blocks.size()); ++i) {
    // Owns what it captures: a checkpointed block runs it again in backward.
    BlockFn run = [b = blocks[i].ptr(), wrapper = block_wrapper_, i, allowed](const torch::Tensor& in) {
      if (wrapper) return wrapper(i, [b, allowed](const torch::Tensor& t) { return b->forward(t, allowed); }, in);
      return b->forward(in, allowed);
    };
    if (checkpointing_.recompute == Recompute::Full && checkpointed_[size_t(i)]) {
      CheckpointOptions options;
      options.keep_inputs_on_host = checkpointing_.keep_inputs_on_host;
      options.synchronize_boundary = checkpointing_.synchronize_boundary;
      options.arena = arena_;
      if (!timings_.empty()) options.timings = timings_[size_t(i)];
      // The block input is the residual stream, which the tensor group replicates (ZeRO-R).
      if (checkpointing_.partition_activations) options.partition_group = tensor_group_;
      x = run_checkpointed_block(*blocks[i], x, std::move(run), options);
    } else {
      x = run_block(*blocks[i], x, run);
    }
  }
  return run_block(*ln_f, x, [this](const torch::Tensor& in) { return ln_f(in); });
}

void GPTImpl::set_checkpointing(const Checkpointing& settings) {
  const int64_t L = config_.n_layer;
  checkpointed_ = checkpointed_blocks(L, settings.number_checkpoints, "block");
  checkpointing_ = settings;
  const int64_t n = settings.number_checkpoints == 0 ? L : settings.number_checkpoints;
  timings_.clear();
  if (settings.profile && settings.recompute != Recompute::None)
    for (int64_t i = 0; i < L; ++i) timings_.push_back(std::make_shared<CheckpointTimings>());
  arena_.reset();
  if (settings.contiguous_memory && settings.recompute == Recompute::Full) arena_ = std::make_shared<CheckpointArena>(int(n));
  for (int64_t i = 0; i < L; ++i) {
    const bool selective = settings.recompute == Recompute::Selective && checkpointed_[size_t(i)];
    auto& attn = *blocks[size_t(i)]->attn;
    attn.recompute_scores_ = selective;
    attn.checkpoint_options_ = CheckpointOptions{};
    attn.checkpoint_options_.keep_inputs_on_host = settings.keep_inputs_on_host;
    attn.checkpoint_options_.synchronize_boundary = settings.synchronize_boundary;
    if (selective && !timings_.empty()) attn.checkpoint_options_.timings = timings_[size_t(i)];
    blocks[size_t(i)]->mlp->recompute_activation_ = selective;
  }
}

bool GPTImpl::is_checkpointed(int64_t block) const {
  return checkpointing_.recompute != Recompute::None && block >= 0 && block < int64_t(checkpointed_.size()) &&
         checkpointed_[size_t(block)] != 0;
}

std::vector<CheckpointTimings> GPTImpl::checkpoint_timings() const {
  std::vector<CheckpointTimings> out;
  for (const auto& t : timings_) out.push_back(*t);
  return out;
}

std::optional<CheckpointArena::Stats> GPTImpl::checkpoint_arena_stats() const {
  if (!arena_) return std::nullopt;
  return arena_->stats();
}

torch::Tensor GPTImpl::loss(const torch::Tensor& idx, const torch::Tensor& targets, const torch::Tensor& segments) {
  if (!targets.defined() || targets.sizes() != idx.sizes())
    bad_input("loss expects targets with the shape of the inputs " + c10::str(idx.sizes()) + ", found " +
              (targets.defined() ? c10::str(targets.sizes()) : std::string("an undefined tensor")));
  auto x = hidden(idx, segments);
  const int64_t tokens = x.size(0) * x.size(1), chunk = config_.loss_chunk_tokens;
  if (chunk > 0 && tokens > chunk) {
    // Chunks of the flattened tokens, each with its summed cross-entropy (fp32: log-softmax and
    // NLL, cross_entropy's own decomposition). With full recomputation a chunk's log-softmax is
    // freed after forward and recomputed (head matrix multiply included) when backward reaches
    // the chunk, so that no [tokens, vocab] tensor outlives its chunk; the gradients are those of
    // the chunked loss without recomputation, bitwise.
    auto flat_x = x.reshape({tokens, x.size(2)});
    auto flat_targets = targets.reshape({-1}).to(torch::kLong);
    if (tensor_group_) return tensor_parallel_chunked_loss(flat_x, flat_targets);
    const bool recompute = checkpointing_.recompute == Recompute::Full;
    torch::Tensor total;
    for (int64_t start = 0; start < tokens; start += chunk) {
      const int64_t n = std::min(chunk, tokens - start);
      BlockFn part = [embedding = wte.ptr(), t = flat_targets.narrow(0, start, n), recompute](const torch::Tensor& in) {
        auto logits_of = [](const torch::Tensor& input, const torch::Tensor& weight) {
          auto logits = torch::nn::functional::linear(input, weight);
          if (logits.scalar_type() != torch::kFloat && logits.scalar_type() != torch::kDouble)
            logits = logits.to(torch::kFloat);
          return logits;
        };
        auto log_probabilities = at::log_softmax(logits_of(in, embedding->weight), 1);
        auto sum = at::nll_loss_nd(log_probabilities, t, {}, at::Reduction::Sum, -100);
        if (recompute)
          sum = recompute_in_backward(sum, log_probabilities,
                                      [logits_of, in = in.detach(), weight = embedding->weight](torch::Tensor& into) {
                                        at::_log_softmax_out(into, logits_of(in, weight.detach()), 1, false);
                                      });
        return sum;
      };
      auto sum = run_block(*wte, flat_x.narrow(0, start, n), part);
      total = total.defined() ? total + sum : sum;
    }
    // The mean over the targets that count, as cross_entropy's default reduction (ignore_index -100).
    return total / (flat_targets != -100).sum().to(total.scalar_type());
  }
  auto logits = head(x);
  const int64_t V = logits.size(-1);
  auto flat = logits.reshape({-1, V});
  // Softmax over a 50k vocabulary in bf16/fp16 loses too much; the loss is always computed in fp32.
  if (flat.scalar_type() != torch::kFloat && flat.scalar_type() != torch::kDouble) flat = flat.to(torch::kFloat);
  if (tensor_group_) return vocab_parallel_cross_entropy(flat, targets.reshape({-1}).to(torch::kLong), tensor_group_);
  return torch::nn::functional::cross_entropy(flat, targets.reshape({-1}).to(torch::kLong));
}

// loss_chunk_tokens with a tensor group: each chunk's logits are this rank's vocabulary slice, and
// the chunk's mean times its counted targets sums to the whole mean. (The log-softmax is not
// recomputed in backward here: the vocabulary-parallel loss keeps its slice of the softmax.)
torch::Tensor GPTImpl::tensor_parallel_chunked_loss(const torch::Tensor& flat_x, const torch::Tensor& flat_targets) {
  const int64_t tokens = flat_x.size(0), chunk = config_.loss_chunk_tokens;
  torch::Tensor total;
  for (int64_t start = 0; start < tokens; start += chunk) {
    const int64_t n = std::min(chunk, tokens - start);
    const torch::Tensor t = flat_targets.narrow(0, start, n);
    const int64_t counted = (t != -100).sum().item<int64_t>();
    if (counted == 0) continue;  // a chunk of ignored targets adds nothing (its mean is 0 / 0)
    BlockFn part = [this, t, counted](const torch::Tensor& in) {
      auto logits = head_logits(in, wte->weight);
      if (logits.scalar_type() != torch::kFloat && logits.scalar_type() != torch::kDouble) logits = logits.to(torch::kFloat);
      return vocab_parallel_cross_entropy(logits, t, tensor_group_) * double(counted);
    };
    auto sum = run_block(*wte, flat_x.narrow(0, start, n), part);
    total = total.defined() ? total + sum : sum;
  }
  const double all = double((flat_targets != -100).sum().item<int64_t>());
  return total.defined() ? total / all : flat_x.sum() * 0.0 / all;
}

}  // namespace zt
