// The model a training configuration describes, as the memory estimate takes it: the GPT's shape
// from its preset and keys, and its exact figures (tensors, blocks; split over a tensor group).
#include <fmt/format.h>

#include <algorithm>
#include <string>
#include <vector>

#include "zerotrain/config/config.h"
#include "zerotrain/error.h"
#include "zerotrain/memory/estimate.h"
#include "zerotrain/config/gpt_config.h"
#include "zerotrain/config/llama_config.h"

namespace zt {

GPTConfig gpt_config_of(const TrainConfig& config) {
  GPTConfig gpt = gpt_preset(config.model.preset);
  const auto& m = config.model;
  if (m.n_layer > 0) gpt.n_layer = m.n_layer;
  if (m.n_head > 0) gpt.n_head = m.n_head;
  if (m.n_embd > 0) gpt.n_embd = m.n_embd;
  if (m.vocab_size > 0) gpt.vocab_size = m.vocab_size;
  if (m.context_length > 0) gpt.context_length = m.context_length;
  if (m.dropout >= 0) gpt.dropout = m.dropout;
  gpt.loss_chunk_tokens = m.loss_chunk_tokens;
  if (gpt.n_embd % gpt.n_head != 0)
    throw ConfigError(fmt::format("model.n_embd: expected a multiple of model.n_head ({}), found {}", gpt.n_head,
                                  gpt.n_embd));
  return gpt;
}

ModelFigures gpt_model_figures(const GPTConfig& gpt, int64_t sequence_length, int64_t persistence_threshold,
                               int64_t tensor_parallel) {
  const int64_t C = gpt.n_embd, T = gpt.context_length, P = std::max<int64_t>(1, tensor_parallel);
  // Split over a tensor group (models/gpt.h): this rank's vocabulary rows, q/k/v rows and MLP
  // features (Cs: the split width of the attention, Fs: of the MLP).
  const int64_t V = gpt.vocab_size / P, Cs = C / P, Fs = 4 * C / P;
  // The GPT's blocks (models/gpt.h): wte, wpe, each transformer layer, ln_f; their tensors.
  const std::vector<std::vector<int64_t>> blocks = {
      {V * C}, {T * C}, {C, C, 3 * Cs * C, 3 * Cs, C * Cs, C, C, C, Fs * C, Fs, C * Fs, C}, {C, C}};
  ModelFigures f;
  f.tensor_parallel = P;
  f.parameters = 0;
  for (size_t b = 0; b < blocks.size(); ++b)
    for (int64_t numel : blocks[b]) f.parameters += (b == 2 ? gpt.n_layer : 1) * numel;
  // The trainable parameters as the GPT registers them (models/gpt.h), each under the marked
  // module (stage-3 block candidate) holding it: wte, wpe, each layer, ln_f.
  auto add = [&f](const std::string& name, std::vector<int64_t> shape, int owner) {
    f.parameter_list.push_back({name, std::move(shape), "float32", -1});
    f.parameter_owner.push_back(owner);
  };
  add("wte.weight", {V, C}, 0);
  add("wpe.weight", {T, C}, 1);
  for (int64_t l = 0; l < gpt.n_layer; ++l) {
    const std::string at = "blocks." + std::to_string(l) + ".";
    const int owner = int(2 + l);
    add(at + "ln_1.weight", {C}, owner);
    add(at + "ln_1.bias", {C}, owner);
    add(at + "attn.c_attn.weight", {3 * Cs, C}, owner);
    add(at + "attn.c_attn.bias", {3 * Cs}, owner);
    add(at + "attn.c_proj.weight", {C, Cs}, owner);
    add(at + "attn.c_proj.bias", {C}, owner);
    add(at + "ln_2.weight", {C}, owner);
    add(at + "ln_2.bias", {C}, owner);
    add(at + "mlp.c_fc.weight", {Fs, C}, owner);
    add(at + "mlp.c_fc.bias", {Fs}, owner);
    add(at + "mlp.c_proj.weight", {C, Fs}, owner);
    add(at + "mlp.c_proj.bias", {C}, owner);
  }
  add("ln_f.weight", {C}, int(2 + gpt.n_layer));
  add("ln_f.bias", {C}, int(2 + gpt.n_layer));
  for (size_t b = 0; b < blocks.size(); ++b) {
    int64_t gathered = 0, persistent = 0;
    for (int64_t numel : blocks[b]) {
      f.largest_parameter = std::max(f.largest_parameter, numel);
      (numel < persistence_threshold ? persistent : gathered) += numel;
    }
    const int64_t copies = b == 2 ? gpt.n_layer : 1;
    f.persistent_parameters += copies * persistent;
    f.largest_block = std::max(f.largest_block, gathered);
    for (int64_t copy = 0; copy < copies; ++copy) f.block_gathered.push_back(gathered);
  }
  // Forward: wte, wpe, the layers, ln_f, then wte again as the tied head (a chunked loss uses it
  // once per chunk, back to back, which keeps the same blocks).
  for (int b = 0; b < int(f.block_gathered.size()); ++b) f.forward_block_order.push_back(b);
  f.forward_block_order.push_back(0);
  f.layers = gpt.n_layer;
  f.hidden = C;
  f.heads = gpt.n_head;
  f.sequence_length = sequence_length > 0 ? sequence_length : T;
  f.vocabulary = V;
  f.dropout = gpt.dropout;
  f.loss_chunk_tokens = gpt.loss_chunk_tokens;
  return f;
}

}  // namespace zt
