// Generation with a key/value cache (zerotrain/models/generation.h). The cached forward steps are
// written here beside the models' own forward(): they read the same modules (projections, norms,
// embeddings) and must give the logits forward() gives at every position, which
// tests/generation_test.cpp checks against forward() and against transformers' generate().
#include "zerotrain/models/generation.h"

#include <ATen/CPUGeneratorImpl.h>
#include <fmt/format.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "models/llama_ops.h"
#include "zerotrain/error.h"
#include "zerotrain/models/gpt.h"
#include "zerotrain/models/llama.h"

namespace zt {
namespace {

// One layer's cached keys and values: [1, heads, positions so far, head_dim].
struct LayerCache {
  torch::Tensor keys, values;
  void append(const torch::Tensor& k, const torch::Tensor& v) {
    keys = keys.defined() ? torch::cat({keys, k}, 2) : k;
    values = values.defined() ? torch::cat({values, v}, 2) : v;
  }
};

// Attention of the new positions' queries q [1,h,T,d] over the cache, the new positions included.
// Causal among the new positions; every earlier (cached) position is visible to all of them.
torch::Tensor attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, double scale) {
  const int64_t T = q.size(2), S = k.size(2);
  if (T == 1) return at::scaled_dot_product_attention(q, k, v, std::nullopt, 0.0, false, scale);
  if (T == S) return at::scaled_dot_product_attention(q, k, v, std::nullopt, 0.0, true, scale);
  auto allowed = torch::ones({T, S}, torch::TensorOptions().dtype(torch::kBool).device(q.device())).tril_(S - T);
  return at::scaled_dot_product_attention(q, k, v, allowed, 0.0, false, scale);
}

class TokenChooser {
 public:
  explicit TokenChooser(const GenerationOptions& options)
      : options_(options), generator_(at::make_generator<at::CPUGeneratorImpl>(options.seed)) {}

  // logits: [vocab] of the last position.
  int64_t choose(const torch::Tensor& logits) {
    torch::Tensor scores = logits.to(torch::kCPU, torch::kFloat);
    if (options_.vocab_limit > 0) scores = scores.narrow(0, 0, std::min(options_.vocab_limit, scores.size(0)));
    if (options_.temperature == 0.0) return scores.argmax().item<int64_t>();
    // The largest score is subtracted before the division: every shifted score is <= 0, so a small
    // temperature sends the others to -inf (probability 0) instead of overflowing to inf - inf.
    torch::Tensor probs = torch::softmax((scores - scores.max()) / options_.temperature, 0);
    torch::Tensor ids;
    if (options_.top_p < 1.0) {
      auto [sorted, order] = probs.sort(0, /*descending=*/true);
      // A token stays while the probability of the tokens before it has not reached top_p.
      const torch::Tensor before = sorted.cumsum(0) - sorted;
      probs = sorted * (before < options_.top_p);
      ids = order;
    }
    const int64_t drawn = torch::multinomial(probs, 1, /*replacement=*/false, generator_).item<int64_t>();
    return ids.defined() ? ids[drawn].item<int64_t>() : drawn;
  }

 private:
  const GenerationOptions& options_;
  at::Generator generator_;
};

void check_request(const std::vector<int64_t>& prompt, const GenerationOptions& o, int64_t vocab, int64_t context) {
  check_generation_options(o);
  auto fail = [](const std::string& what) { throw ConfigError("generate: " + what); };
  if (prompt.empty()) fail("the prompt has no tokens");
  for (int64_t id : prompt)
    if (id < 0 || id >= vocab)
      fail("prompt token id " + std::to_string(id) + " is outside the vocabulary [0, " + std::to_string(vocab) + ")");
  if (int64_t(prompt.size()) >= context)
    fail("the prompt's " + std::to_string(prompt.size()) + " tokens fill the model's context of " +
         std::to_string(context) + " positions: nothing can follow");
  if (o.vocab_limit < 0 || o.vocab_limit > vocab)
    fail("vocab_limit: expected 0 (every id) or at most the model's vocabulary of " + std::to_string(vocab) +
         ", found " + std::to_string(o.vocab_limit));
}

// The loop both models share: `step(ids, past)` runs the positions [past, past + ids) and returns
// the logits of the last one.
template <typename Step>
std::vector<int64_t> run(torch::nn::Module& model, const std::vector<int64_t>& prompt, const GenerationOptions& o,
                         int64_t context, const TokenCallback& on_token, Step step) {
  torch::NoGradGuard no_grad;
  const bool was_training = model.is_training();
  model.eval();
  const torch::Device device = model.parameters().front().device();
  TokenChooser chooser(o);
  std::vector<int64_t> out;
  torch::Tensor ids = torch::tensor(prompt, torch::kLong).unsqueeze(0).to(device);
  int64_t past = 0;
  try {
    // The token chosen after `past` positions takes position `past`: the sequence stays within the
    // context as long as past < context.
    while (int64_t(out.size()) < o.max_new_tokens) {
      const torch::Tensor logits = step(ids, past);
      past += ids.size(1);
      const int64_t next = chooser.choose(logits);
      out.push_back(next);
      if (on_token) on_token(next);
      if (std::find(o.stop_ids.begin(), o.stop_ids.end(), next) != o.stop_ids.end() || past + 1 >= context) break;
      ids = torch::full({1, 1}, next, torch::TensorOptions().dtype(torch::kLong).device(device));
    }
  } catch (...) {
    model.train(was_training);
    throw;
  }
  model.train(was_training);
  return out;
}

}  // namespace

void check_generation_options(const GenerationOptions& o) {
  auto fail = [](const std::string& what) { throw ConfigError("generate: " + what); };
  if (o.max_new_tokens < 0) fail("max_new_tokens must be >= 0, found " + std::to_string(o.max_new_tokens));
  if (!(o.temperature >= 0.0) || !std::isfinite(o.temperature) || (o.temperature > 0.0 && o.temperature < kMinTemperature))
    fail(fmt::format("temperature: expected 0 (greedy) or a finite number of at least {:g} (the smallest normal fp32, "
                     "in which the logits are divided by it), found {:g}",
                     kMinTemperature, o.temperature));
  if (!(o.top_p > 0.0 && o.top_p <= 1.0)) fail("top_p must be in (0, 1], found " + std::to_string(o.top_p));
}

std::vector<int64_t> generate(GPTImpl& model, const std::vector<int64_t>& prompt, const GenerationOptions& options,
                              const TokenCallback& on_token) {
  const GPTConfig& c = model.config();
  check_request(prompt, options, c.vocab_size, c.context_length);
  std::vector<LayerCache> cache(model.blocks.size());
  const int64_t heads = c.n_head, head_dim = c.n_embd / c.n_head;
  auto step = [&](const torch::Tensor& ids, int64_t past) {
    const int64_t T = ids.size(1);
    auto pos = torch::arange(past, past + T, torch::TensorOptions().dtype(torch::kLong).device(ids.device()));
    auto x = model.wte(ids) + model.wpe(pos);
    for (size_t i = 0; i < model.blocks.size(); ++i) {
      auto& block = *model.blocks[i];
      auto qkv = block.attn->c_attn(block.ln_1(x)).split(c.n_embd, 2);
      auto split = [&](const torch::Tensor& t) { return t.view({1, T, heads, head_dim}).transpose(1, 2); };
      cache[i].append(split(qkv[1]), split(qkv[2]));
      auto y = attend(split(qkv[0]), cache[i].keys, cache[i].values, 1.0 / std::sqrt(double(head_dim)));
      x = x + block.attn->c_proj(y.transpose(1, 2).reshape({1, T, c.n_embd}));
      x = x + block.mlp->forward(block.ln_2(x));
    }
    return torch::nn::functional::linear(model.ln_f(x.narrow(1, T - 1, 1)), model.wte->weight).reshape({-1});
  };
  return run(model, prompt, options, c.context_length, on_token, step);
}

std::vector<int64_t> generate(LlamaImpl& model, const std::vector<int64_t>& prompt,
                              const GenerationOptions& options, const TokenCallback& on_token) {
  const LlamaConfig& c = model.config();
  check_request(prompt, options, c.vocab_size, c.max_position_embeddings);
  std::vector<LayerCache> cache(model.layers.size());
  const int64_t heads = c.num_attention_heads, kv_heads = c.num_key_value_heads, head_dim = c.resolved_head_dim();
  auto step = [&](const torch::Tensor& ids, int64_t past) {
    const int64_t T = ids.size(1);
    auto x = model.model->embed_tokens(ids);
    auto [cos_all, sin_all] = model.rotary(past + T, ids.device());
    const auto cos = cos_all.narrow(0, past, T).to(x.scalar_type()), sin = sin_all.narrow(0, past, T).to(x.scalar_type());
    for (size_t i = 0; i < model.layers.size(); ++i) {
      auto& layer = *model.layers[i];
      auto& attn = *layer.self_attn;
      auto h = layer.input_layernorm(x);
      auto split = [&](const torch::Tensor& t, int64_t n) { return t.view({1, T, n, head_dim}).transpose(1, 2); };
      auto q = llama_ops::apply_rotary(split(attn.q_proj(h), heads), cos, sin);
      cache[i].append(llama_ops::apply_rotary(split(attn.k_proj(h), kv_heads), cos, sin),
                      split(attn.v_proj(h), kv_heads));
      auto y = attend(q, llama_ops::repeat_kv(cache[i].keys, heads), llama_ops::repeat_kv(cache[i].values, heads),
                      std::pow(double(head_dim), -0.5));
      x = x + attn.o_proj(y.transpose(1, 2).reshape({1, T, heads * head_dim}));
      x = x + layer.mlp->forward(layer.post_attention_layernorm(x));
    }
    auto last = model.model->norm(x.narrow(1, T - 1, 1));
    auto logits = model.lm_head ? model.lm_head(last)
                                : torch::nn::functional::linear(last, model.model->embed_tokens->weight);
    return logits.reshape({-1});
  };
  return run(model, prompt, options, c.max_position_embeddings, on_token, step);
}

}  // namespace zt
