// The Llama-family decoder (zerotrain/models/llama.h): the numbers follow transformers'
// LlamaForCausalLM operation for operation (RMSNorm in fp32, rotary tables from the same fp32
// frequencies, attention scaled by head_dim^-1/2), so that its logits match transformers' on the
// same weights (tests/llama_test.cpp).
#include "zerotrain/models/llama.h"

#include <cmath>
#include <string>

#include <torch/torch.h>

#include "models/llama_ops.h"
#include "models/packed_rows.h"
#include "zerotrain/zero/blocks.h"
#include "zerotrain/comm/comm.h"
#include "zerotrain/error.h"
#include "zerotrain/models/tensor_parallel.h"

namespace zt {
namespace {

[[noreturn]] void bad_input(const std::string& what) { throw ConfigError("Llama: " + what); }

torch::nn::Linear linear(int64_t in, int64_t out, bool bias) {
  return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(bias));
}


// The inverse frequencies of the rotary embedding after rope_scaling, as transformers computes
// them (its _compute_default_rope_parameters and the linear and llama3 variants), in fp32.
torch::Tensor inverse_frequencies(const LlamaConfig& c) {
  const int64_t dim = c.resolved_head_dim();
  auto exponents = torch::arange(0, dim, 2, torch::kLong).to(torch::kFloat) / double(dim);
  auto inv_freq = 1.0 / torch::pow(c.rope_theta, exponents);
  const RopeScaling& s = c.rope_scaling;
  if (s.type == "linear") return inv_freq / s.factor;
  if (s.type != "llama3") return inv_freq;
  const double old_context = double(s.original_max_position_embeddings);
  const double low_freq_wavelen = old_context / s.low_freq_factor;
  const double high_freq_wavelen = old_context / s.high_freq_factor;
  auto wavelen = 2 * M_PI / inv_freq;
  auto scaled = torch::where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq);
  auto smooth = (old_context / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
  auto smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled;
  auto medium = (wavelen >= high_freq_wavelen).logical_and(wavelen <= low_freq_wavelen);
  return torch::where(medium, smoothed, scaled);
}

}  // namespace

RMSNormImpl::RMSNormImpl(int64_t size, double eps) : eps_(eps) {
  weight = register_parameter("weight", torch::ones({size}));
}

torch::Tensor RMSNormImpl::forward(const torch::Tensor& x) {
  auto h = x.to(torch::kFloat);
  auto variance = h.pow(2).mean(-1, /*keepdim=*/true);
  h = h * torch::rsqrt(variance + eps_);
  return weight * h.to(x.scalar_type());
}

LlamaAttentionImpl::LlamaAttentionImpl(const LlamaConfig& c, std::shared_ptr<Communicator> tensor_group)
    : heads_(c.num_attention_heads), kv_heads_(c.num_key_value_heads), head_dim_(c.resolved_head_dim()),
      group_(std::move(tensor_group)) {
  // Built whole (the values are drawn as the unsplit model draws them, then sliced): this rank's
  // head counts are set after the projections exist.
  const bool qkv_bias = c.attention_bias || c.qkv_bias;
  q_proj = register_module("q_proj", linear(c.hidden_size, heads_ * head_dim_, qkv_bias));
  k_proj = register_module("k_proj", linear(c.hidden_size, kv_heads_ * head_dim_, qkv_bias));
  v_proj = register_module("v_proj", linear(c.hidden_size, kv_heads_ * head_dim_, qkv_bias));
  o_proj = register_module("o_proj", linear(heads_ * head_dim_, c.hidden_size, c.attention_bias));
  heads_ /= tensor_group_size(group_);
  kv_heads_ /= tensor_group_size(group_);
}

torch::Tensor LlamaAttentionImpl::forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                                          const torch::Tensor& allowed) {
  const int64_t B = x.size(0), T = x.size(1);
  auto heads = [&](const torch::Tensor& t, int64_t n) { return t.view({B, T, n, head_dim_}).transpose(1, 2); };
  const torch::Tensor in = group_ ? copy_to_tensor_group(x, group_) : x;
  auto q = heads(q_proj(in), heads_), k = heads(k_proj(in), kv_heads_), v = heads(v_proj(in), kv_heads_);
  const auto c = cos.to(x.scalar_type()), s = sin.to(x.scalar_type());
  q = llama_ops::apply_rotary(q, c, s);
  k = llama_ops::repeat_kv(llama_ops::apply_rotary(k, c, s), heads_);
  v = llama_ops::repeat_kv(v, heads_);
  const double scale = std::pow(double(head_dim_), -0.5);
  // Packed rows pass their block-diagonal causal mask; otherwise the causal-only fast path, which
  // never materialises a [T,T] mask.
  auto y = allowed.defined()
               ? at::scaled_dot_product_attention(q, k, v, allowed, /*dropout_p=*/0.0, /*is_causal=*/false, scale)
               : at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/std::nullopt, /*dropout_p=*/0.0,
                                                  /*is_causal=*/true, scale);
  return row_parallel_linear(y.transpose(1, 2).reshape({B, T, heads_ * head_dim_}), o_proj->weight, o_proj->bias, group_);
}

LlamaMLPImpl::LlamaMLPImpl(const LlamaConfig& c, std::shared_ptr<Communicator> tensor_group)
    : group_(std::move(tensor_group)) {
  gate_proj = register_module("gate_proj", linear(c.hidden_size, c.intermediate_size, c.mlp_bias));
  up_proj = register_module("up_proj", linear(c.hidden_size, c.intermediate_size, c.mlp_bias));
  down_proj = register_module("down_proj", linear(c.intermediate_size, c.hidden_size, c.mlp_bias));
}

torch::Tensor LlamaMLPImpl::forward(const torch::Tensor& x) {
  const torch::Tensor in = group_ ? copy_to_tensor_group(x, group_) : x;
  return row_parallel_linear(torch::silu(gate_proj(in)) * up_proj(in), down_proj->weight, down_proj->bias, group_);
}

LlamaDecoderLayerImpl::LlamaDecoderLayerImpl(const LlamaConfig& c, std::shared_ptr<Communicator> tensor_group) {
  self_attn = register_module("self_attn", LlamaAttention(c, tensor_group));
  mlp = register_module("mlp", LlamaMLP(c, tensor_group));
  input_layernorm = register_module("input_layernorm", RMSNorm(c.hidden_size, c.rms_norm_eps));
  post_attention_layernorm = register_module("post_attention_layernorm", RMSNorm(c.hidden_size, c.rms_norm_eps));
}

torch::Tensor LlamaDecoderLayerImpl::forward(const torch::Tensor& x, const torch::Tensor& cos,
                                             const torch::Tensor& sin, const torch::Tensor& allowed) {
  auto h = x + self_attn->forward(input_layernorm(x), cos, sin, allowed);
  return h + mlp(post_attention_layernorm(h));
}

LlamaImpl::LlamaImpl(const LlamaConfig& config, std::shared_ptr<Communicator> tensor_group)
    : config_(config), tensor_group_(std::move(tensor_group)) {
  config_.validate();
  const LlamaConfig& c = config_;
  if (const int64_t T = tensor_group_size(tensor_group_); T > 1) {
    for (const auto& [key, value] : {std::pair{"num_attention_heads", c.num_attention_heads},
                                     std::pair{"num_key_value_heads", c.num_key_value_heads},
                                     std::pair{"intermediate_size", c.intermediate_size},
                                     std::pair{"vocab_size", c.vocab_size}})
      if (value % T != 0)
        bad_input(std::string(key) + " " + std::to_string(value) + " is not divisible by the tensor group's " +
                  std::to_string(T) + " ranks; expected a multiple of " + std::to_string(T));
    vocab_begin_ = c.vocab_size / T * tensor_group_->rank();
  } else {
    tensor_group_.reset();  // a group of one is the unsplit model
  }
  inv_freq_ = inverse_frequencies(c);
  // Each parameterised module is initialised and marked as a stage-3 block right after it is
  // built, as the GPT does: under a ShardedConstruction no rank holds more than one whole block.
  model = register_module("model", LlamaBody());
  model->embed_tokens = model->register_module("embed_tokens", torch::nn::Embedding(c.vocab_size, c.hidden_size));
  finish_block(model->embed_tokens.ptr());
  model->layers = model->register_module("layers", torch::nn::ModuleList());
  layers.reserve(size_t(c.num_hidden_layers));
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    layers.emplace_back(c, tensor_group_);
    model->layers->push_back(layers.back());
    finish_block(layers.back().ptr());
  }
  model->norm = model->register_module("norm", RMSNorm(c.hidden_size, c.rms_norm_eps));
  finish_block(model->norm.ptr());
  if (!c.tie_word_embeddings) {
    lm_head = register_module("lm_head", linear(c.hidden_size, c.vocab_size, false));
    finish_block(lm_head.ptr());
  }
  checkpointed_.assign(size_t(c.num_hidden_layers), 0);
}

// transformers' _init_weights: N(0, initializer_range) for Linear and Embedding weights, zero
// biases, RMSNorm weights one (as built).
void LlamaImpl::finish_block(const std::shared_ptr<torch::nn::Module>& module) {
  torch::NoGradGuard no_grad;
  for (auto& item : module->named_modules("", /*include_self=*/true)) {
    torch::nn::Module& m = *item.value();
    if (auto* l = m.as<torch::nn::Linear>()) {
      l->weight.normal_(0.0, config_.initializer_range);
      if (l->bias.defined()) l->bias.zero_();
    } else if (auto* e = m.as<torch::nn::Embedding>()) {
      e->weight.normal_(0.0, config_.initializer_range);
    }
  }
  if (tensor_group_) keep_tensor_slices(*module);
  mark_block(module);
}

// The whole values were drawn as the unsplit model draws them; each split parameter keeps this
// rank's slice (set_data: the module's member and its registration stay the same tensor).
void LlamaImpl::keep_tensor_slices(torch::nn::Module& module) {
  auto ends_with = [](const std::string& name, const char* suffix) {
    const std::string s(suffix);
    return name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0;
  };
  const bool vocabulary = &module == model->embed_tokens.get() || (!lm_head.is_empty() && &module == lm_head.get());
  for (auto& item : module.named_parameters(/*recurse=*/true)) {
    const std::string& name = item.key();
    torch::Tensor& p = item.value();
    int dim = 0;
    if (vocabulary || ends_with(name, "q_proj.weight") || ends_with(name, "q_proj.bias") ||
        ends_with(name, "k_proj.weight") || ends_with(name, "k_proj.bias") || ends_with(name, "v_proj.weight") ||
        ends_with(name, "v_proj.bias") || ends_with(name, "gate_proj.weight") || ends_with(name, "gate_proj.bias") ||
        ends_with(name, "up_proj.weight") || ends_with(name, "up_proj.bias")) {
      dim = 0;  // vocabulary rows; the rows of this rank's heads and features
    } else if (ends_with(name, "o_proj.weight") || ends_with(name, "down_proj.weight")) {
      dim = 1;  // their columns
    } else {
      continue;  // replicated: the norms, the row-parallel projections' biases
    }
    keep_tensor_slice(p, tensor_group_, dim);
  }
}

void LlamaImpl::set_checkpointing(const CheckpointingSettings& settings) {
  if (settings.recompute == Recompute::Selective)
    throw ConfigError("activation_checkpointing.policy: expected \"none\" or \"full\" for a Llama model, found "
                      "\"selective\" (its attention core and SwiGLU are not split out for recomputation)");
  checkpointed_ = checkpointed_blocks(config_.num_hidden_layers, settings.number_checkpoints, "layer");
  checkpointing_ = settings;
}

bool LlamaImpl::is_checkpointed(int64_t layer) const {
  return checkpointing_.recompute == Recompute::Full && layer >= 0 && layer < int64_t(checkpointed_.size()) &&
         checkpointed_[size_t(layer)] != 0;
}

std::pair<torch::Tensor, torch::Tensor> LlamaImpl::rotary(int64_t T, const torch::Device& device) const {
  auto positions = torch::arange(T, torch::kLong).to(torch::kFloat);
  auto freqs = torch::outer(positions, inv_freq_);
  auto emb = torch::cat({freqs, freqs}, -1);
  return {emb.cos().to(device), emb.sin().to(device)};
}

torch::Tensor LlamaImpl::forward(const torch::Tensor& ids, const torch::Tensor& segments) {
  if (!ids.defined() || ids.dim() != 2)
    bad_input("forward expects token ids of shape [B, T], found " +
              (ids.defined() ? std::to_string(ids.dim()) + "-D tensor " + c10::str(ids.sizes())
                             : std::string("an undefined tensor")));
  if (!at::isIntegralType(ids.scalar_type(), /*includeBool=*/false))
    bad_input(std::string("forward expects integer token ids, found dtype ") + c10::toString(ids.scalar_type()));
  const int64_t T = ids.size(1);
  if (ids.size(0) < 1) bad_input("batch size must be >= 1, found 0");
  if (T < 1 || T > config_.max_position_embeddings)
    bad_input("sequence length " + std::to_string(T) + " is outside [1, max_position_embeddings=" +
              std::to_string(config_.max_position_embeddings) + "]");
  if (const auto [lo, hi] = std::pair(ids.min().item<int64_t>(), ids.max().item<int64_t>());
      lo < 0 || hi >= config_.vocab_size)
    bad_input("token ids must be in [0, vocab_size=" + std::to_string(config_.vocab_size) + "), found range [" +
              std::to_string(lo) + ", " + std::to_string(hi) + "]");
  auto embed = model->embed_tokens.ptr();
  auto x = run_block(*embed, ids, [embed, group = tensor_group_, begin = vocab_begin_](const torch::Tensor& in) {
    return group ? vocab_parallel_lookup(in, embed->weight, begin, group) : embed->forward(in);
  });
  auto [cos, sin] = rotary(T, ids.device());
  torch::Tensor allowed;  // packed rows: the block-diagonal causal mask [B,1,T,T]
  if (segments.defined()) {
    // Each token's angles are those of its position within its example, read from the same
    // table, so that a packed example rotates exactly as it would alone (as transformers'
    // position_ids restarting per example).
    const PackedRows rows = packed_rows(ids, segments, "Llama");
    allowed = rows.allowed;
    const auto per_token = [&](const torch::Tensor& table) {
      return table.index_select(0, rows.positions.flatten()).view({ids.size(0), 1, T, table.size(1)});
    };
    cos = per_token(cos);
    sin = per_token(sin);
  }
  for (size_t i = 0; i < layers.size(); ++i) {
    // Owns what it captures: a checkpointed layer runs it again in backward.
    BlockFunction run = [layer = layers[i].ptr(), cos, sin, allowed](const torch::Tensor& in) {
      return layer->forward(in, cos, sin, allowed);
    };
    if (checkpointing_.recompute == Recompute::Full && checkpointed_[i]) {
      CheckpointOptions options;
      options.keep_inputs_on_host = checkpointing_.keep_inputs_on_host;
      options.synchronize_boundary = checkpointing_.synchronize_boundary;
      // The layer input is the residual stream, which the tensor group replicates (ZeRO-R).
      if (checkpointing_.partition_activations) options.partition_group = tensor_group_;
      x = run_checkpointed_block(*layers[i], x, std::move(run), options);
    } else {
      x = run_block(*layers[i], x, run);
    }
  }
  auto norm = model->norm.ptr();
  x = run_block(*norm, x, [norm](const torch::Tensor& in) { return norm->forward(in); });
  // With a tensor group: this rank's vocabulary slice of the logits.
  auto logits_of = [group = tensor_group_](const torch::Tensor& in, const torch::Tensor& weight) {
    return torch::nn::functional::linear(group ? copy_to_tensor_group(in, group) : in, weight);
  };
  if (lm_head)
    return run_block(*lm_head, x, [head = lm_head.ptr(), logits_of](const torch::Tensor& in) { return logits_of(in, head->weight); });
  return run_block(*embed, x, [embed, logits_of](const torch::Tensor& in) { return logits_of(in, embed->weight); });
}

torch::Tensor LlamaImpl::loss(const torch::Tensor& ids, const torch::Tensor& targets, const torch::Tensor& segments) {
  if (!targets.defined() || targets.sizes() != ids.sizes())
    bad_input("loss expects targets with the shape of the inputs " + c10::str(ids.sizes()) + ", found " +
              (targets.defined() ? c10::str(targets.sizes()) : std::string("an undefined tensor")));
  auto logits = forward(ids, segments).to(torch::kFloat);
  if (tensor_group_)
    return vocab_parallel_cross_entropy(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}).to(torch::kLong),
                                        tensor_group_, -100);
  return torch::nn::functional::cross_entropy(
      logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}).to(torch::kLong),
      torch::nn::functional::CrossEntropyFuncOptions().ignore_index(-100));
}

namespace llama_ops {

at::Tensor rotate_half(const at::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return torch::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

at::Tensor apply_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  return x * cos + rotate_half(x) * sin;
}

at::Tensor repeat_kv(const at::Tensor& x, int64_t heads) {
  const int64_t B = x.size(0), kv_heads = x.size(1), S = x.size(2), head_dim = x.size(3);
  if (heads == kv_heads) return x;
  const int64_t r = heads / kv_heads;
  return x.unsqueeze(2).expand({B, kv_heads, r, S, head_dim}).reshape({B, heads, S, head_dim});
}

}  // namespace llama_ops

}  // namespace zt
