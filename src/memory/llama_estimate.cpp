// The Llama-family decoder in the memory estimate: its exact parameter list and its activations,
// tensor by tensor as src/models/llama.cpp computes them (checked against the bytes autograd
// keeps in tests/estimate_test.cpp).
#include "memory/llama_estimate.h"

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "zerotrain/config/llama_config.h"

namespace zt {

ModelFigures llama_model_figures(const LlamaConfig& c, int64_t sequence_length, int64_t persistence_threshold,
                                 int64_t tensor_parallel) {
  // Split over a tensor group (models/llama.h): this rank's heads, features and vocabulary rows.
  const int64_t P = std::max<int64_t>(1, tensor_parallel);
  const int64_t H = c.hidden_size, V = c.vocab_size / P, I = c.intermediate_size / P, L = c.num_hidden_layers;
  const int64_t heads = c.num_attention_heads / P, kv_heads = c.num_key_value_heads / P;
  const int64_t hd = c.resolved_head_dim(), q = heads * hd, kv = kv_heads * hd;
  const bool qkv_bias = c.attention_bias || c.qkv_bias;
  ModelFigures f;
  f.tensor_parallel = P;
  // transformers' registration order (models/llama.h), each tensor under its stage-3 block: the
  // embedding, each layer, the final norm, then the head when it is not tied.
  std::vector<int64_t> gathered, persistent;
  auto add = [&](const std::string& name, std::vector<int64_t> shape, int owner) {
    int64_t numel = 1;
    for (int64_t d : shape) numel *= d;
    f.parameters += numel;
    f.parameter_list.push_back({name, std::move(shape), "float32", -1});
    f.parameter_owner.push_back(owner);
    f.largest_parameter = std::max(f.largest_parameter, numel);
    if (size_t(owner) >= gathered.size()) {
      gathered.resize(size_t(owner) + 1, 0);
      persistent.resize(size_t(owner) + 1, 0);
    }
    (numel < persistence_threshold ? persistent : gathered)[size_t(owner)] += numel;
  };
  auto linear = [&](const std::string& name, int64_t in, int64_t out, bool bias, int owner) {
    add(name + ".weight", {out, in}, owner);
    if (bias) add(name + ".bias", {out}, owner);
  };
  add("model.embed_tokens.weight", {V, H}, 0);
  for (int64_t l = 0; l < L; ++l) {
    const std::string at = "model.layers." + std::to_string(l) + ".";
    const int owner = int(1 + l);
    linear(at + "self_attn.q_proj", H, q, qkv_bias, owner);
    linear(at + "self_attn.k_proj", H, kv, qkv_bias, owner);
    linear(at + "self_attn.v_proj", H, kv, qkv_bias, owner);
    linear(at + "self_attn.o_proj", q, H, c.attention_bias, owner);
    linear(at + "mlp.gate_proj", H, I, c.mlp_bias, owner);
    linear(at + "mlp.up_proj", H, I, c.mlp_bias, owner);
    linear(at + "mlp.down_proj", I, H, c.mlp_bias, owner);
    add(at + "input_layernorm.weight", {H}, owner);
    add(at + "post_attention_layernorm.weight", {H}, owner);
  }
  add("model.norm.weight", {H}, int(1 + L));
  if (!c.tie_word_embeddings) add("lm_head.weight", {V, H}, int(2 + L));
  for (size_t b = 0; b < gathered.size(); ++b) {
    f.persistent_parameters += persistent[b];
    f.largest_block = std::max(f.largest_block, gathered[b]);
    f.block_gathered.push_back(gathered[b]);
  }
  // Forward: the embedding, the layers, the norm, then the head (the embedding again when tied).
  for (int b = 0; b < int(f.block_gathered.size()); ++b) f.forward_block_order.push_back(b);
  if (c.tie_word_embeddings) f.forward_block_order.push_back(0);
  f.family = ModelFigures::Family::Llama;
  f.layers = L;
  f.hidden = H;
  f.heads = heads;
  f.kv_heads = kv_heads;
  f.head_dim = hd;
  f.intermediate = I;
  f.tied_head = c.tie_word_embeddings;
  f.sequence_length = sequence_length > 0 ? sequence_length : c.max_position_embeddings;
  f.vocabulary = V;
  return f;
}

ActivationBytes llama_activation_bytes(const ModelFigures& m, int64_t micro_batch, int element_bytes,
                                       Recompute recompute) {
  ActivationBytes bytes;
  if (!m.has_shape() || micro_batch <= 0) return bytes;
  const int64_t e = element_bytes, tokens = m.sequence_length * micro_batch, h = m.hidden, V = m.vocabulary;
  const int64_t a = m.heads > 0 ? m.heads : std::max<int64_t>(1, h / 64);
  const int64_t hd = m.head_dim > 0 ? m.head_dim : h / a;
  const int64_t q = a * hd, kv = (m.kv_heads > 0 ? m.kv_heads : a) * hd;
  const int64_t I = m.intermediate > 0 ? m.intermediate : 4 * h;
  // RMSNorm computes in fp32: it keeps its input in fp32 (the input itself in fp32, an fp32 copy in
  // 16 bits), the normalised values in the activations' dtype and one fp32 scale per token.
  const int64_t norm = (4 + e) * tokens * h + 4 * tokens;
  // Attention: the norm's output (the projections' input); the rotated q; k and v as the kernel
  // reads them: repeated to every q head under grouped-query attention, a copy, except from a
  // single kv head, which repeats as a view (measured); the fused kernel's output (the same
  // storage as o_proj's input) and a log-sum-exp per head and token. The rotary tables
  // ([T, head_dim]) are negligible.
  const bool repeated_copy = kv < q && kv != hd;
  const int64_t kv_read = repeated_copy ? q : kv;
  const int64_t attention = e * tokens * (h + 2 * q + 2 * kv_read) + 4 * a * tokens;
  // SwiGLU: the norm's output, and four I-wide tensors: gate (silu's input), silu's output, up
  // (both the product's inputs) and the product (down_proj's input).
  const int64_t mlp = e * tokens * (h + 4 * I);
  const int64_t per_layer = 2 * norm + attention + mlp;
  const int64_t generator_state = 5056;  // the CPU generator's state, kept by each checkpoint
  const int64_t log_softmax = 4 * tokens * V;
  // Outside the layers: token ids (int64) for the embedding's backward, the final norm, the head's
  // input, and the fp32 log-softmax of the logits (the loss is fp32).
  const int64_t outside = 8 * tokens + norm + e * tokens * h + log_softmax;
  // Full recomputation keeps each layer's input (the residual stream; with partition_activations
  // 1/P of it per rank of a tensor group of P).
  const int64_t P = std::max<int64_t>(1, m.tensor_parallel);
  const int64_t kept_input = m.partition_activations ? (tokens * h + P - 1) / P : tokens * h;
  bytes.saved = recompute == Recompute::Full ? m.layers * (e * kept_input + generator_state) + outside
                                             : m.layers * per_layer + outside;
  // Backward's working set on top of the saved tensors, as for the GPT (transformer_activation_bytes):
  // the largest of the moment at the loss (the log-softmax's gradient and its input's, fp32, plus a
  // 16-bit copy), at the head (its fresh V·h weight gradient), inside the last layer (the incoming
  // h-wide gradient, two I-wide gradients around SwiGLU and down_proj's fresh I·h weight gradient,
  // by when the final norm, the head's input and the log-softmax are freed), and at the end (the
  // embedding's dense gradient; tied, also the head's waiting to be summed with it).
  const int64_t at_loss = 8 * tokens * V + (e < 4 ? e * tokens * V : 0);
  const int64_t at_head = e * V * h + (e < 4 ? e * tokens * V : 0);
  const int64_t in_layer = e * tokens * (h + 2 * I) + e * I * h - (norm + e * tokens * h + log_softmax);
  const int64_t at_embedding = (m.tied_head ? 3 : 1) * e * V * h - bytes.saved;
  bytes.transient = std::max({at_loss, at_head, in_layer, at_embedding});
  // Full recomputation: inside a layer's backward, that layer's activations recomputed beside its
  // gradients. Unlike the GPT's (added to the largest moment), this moment alone is what the
  // counting allocator measured: the loss's working set is gone by then.
  if (recompute == Recompute::Full) bytes.transient = std::max(bytes.transient, per_layer + in_layer);
  return bytes;
}

}  // namespace zt
