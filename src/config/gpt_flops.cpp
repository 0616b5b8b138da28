#include "zerotrain/config/gpt_flops.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <map>

#include "zerotrain/error.h"
#include "zerotrain/config/gpt_config.h"

namespace zt {
namespace {

FlopsNode leaf(std::string name, std::string kind, int64_t params, int64_t macs, int64_t flops) {
  return FlopsNode{std::move(name), std::move(kind), params, macs, flops, {}};
}

// Linear [N, in] -> [N, out]: N·in·out multiply-accumulates (DeepSpeed counts no bias).
FlopsNode linear(std::string name, int64_t tokens, int64_t in, int64_t out, bool bias = true) {
  const int64_t macs = tokens * in * out;
  return leaf(std::move(name), "Linear", in * out + (bias ? out : 0), macs, 2 * macs);
}

FlopsNode parent(std::string name, std::string kind, std::vector<FlopsNode> children) {
  FlopsNode node{std::move(name), std::move(kind), 0, 0, 0, std::move(children)};
  for (const auto& c : node.children) {
    node.params += c.params;
    node.macs += c.macs;
    node.flops += c.flops;
  }
  return node;
}

struct Shape {
  int64_t B, T, N, C, V, H;
};

Shape shape_of(const GPTConfig& config, int64_t batch, int64_t sequence) {
  config.validate();
  if (batch <= 0 || sequence <= 0)
    throw ConfigError(fmt::format("FLOP count: expected a positive batch and sequence length, found {} and {}", batch,
                                  sequence));
  return Shape{batch, sequence, batch * sequence, config.n_embd, config.vocab_size, config.n_head};
}

// The attention core, DeepSpeed's count of scaled_dot_product_attention: q·kᵀ and the weighted
// sum are B·H·T·T·(C/H) multiply-accumulates each; softmax one FLOP per score.
std::vector<FlopsNode> attention_core(const std::string& prefix, const Shape& s) {
  const int64_t macs = s.B * s.T * s.T * s.C;
  return {leaf(prefix + "scores", "MatMul", 0, macs, 2 * macs),
          leaf(prefix + "softmax", "Softmax", 0, 0, s.B * s.H * s.T * s.T),
          leaf(prefix + "weighted_sum", "MatMul", 0, macs, 2 * macs)};
}

FlopsNode block(const std::string& name, const Shape& s) {
  const std::string p = name + ".";
  const int64_t C = s.C, N = s.N;
  std::vector<FlopsNode> attn = {linear(p + "attn.c_attn", N, C, 3 * C)};
  for (auto& n : attention_core(p + "attn.", s)) attn.push_back(std::move(n));
  attn.push_back(linear(p + "attn.c_proj", N, C, C));
  return parent(name, "Block",
                {leaf(p + "ln_1", "LayerNorm", 2 * C, 0, 5 * N * C),
                 parent(p + "attn", "CausalSelfAttention", std::move(attn)),
                 leaf(p + "ln_2", "LayerNorm", 2 * C, 0, 5 * N * C),
                 parent(p + "mlp", "MLP",
                        {linear(p + "mlp.c_fc", N, C, 4 * C), leaf(p + "mlp.gelu", "GELU", 0, 0, N * 4 * C),
                         linear(p + "mlp.c_proj", N, 4 * C, C)}),
                 leaf(p + "residual", "Add", 0, 0, 2 * N * C)});
}

}  // namespace

FlopsNode gpt_forward_flops(const GPTConfig& config, int64_t batch, int64_t sequence) {
  const Shape s = shape_of(config, batch, sequence);
  std::vector<FlopsNode> children = {leaf("wte", "Embedding", s.V * s.C, 0, 0),
                                     leaf("wpe", "Embedding", config.context_length * s.C, 0, 0),
                                     leaf("embedding_sum", "Add", 0, 0, s.N * s.C)};
  for (int64_t i = 0; i < config.n_layer; ++i) children.push_back(block(fmt::format("blocks.{}", i), s));
  children.push_back(leaf("ln_f", "LayerNorm", 2 * s.C, 0, 5 * s.N * s.C));
  // Tied to wte: its parameters are counted there.
  FlopsNode head = linear("head", s.N, s.C, s.V, false);
  head.params = 0;
  children.push_back(std::move(head));
  return parent("", "GPT", std::move(children));
}

int64_t gpt_recompute_flops(const GPTConfig& config, int64_t batch, int64_t sequence, Recompute recompute,
                            int64_t checkpointed_blocks) {
  const Shape s = shape_of(config, batch, sequence);
  if (checkpointed_blocks < 0 || checkpointed_blocks > config.n_layer)
    throw ConfigError(fmt::format("FLOP count: expected 0 to n_layer={} checkpointed blocks, found {}", config.n_layer,
                                  checkpointed_blocks));
  switch (recompute) {
    case Recompute::None: return 0;
    case Recompute::Selective: {
      int64_t per_block = s.N * 4 * s.C;  // GELU
      for (const auto& n : attention_core("", s)) per_block += n.flops;
      return checkpointed_blocks * per_block;
    }
    case Recompute::Full: {
      int64_t flops = checkpointed_blocks * block("b", s).flops;
      // A chunked loss frees each chunk's log-softmax and recomputes it, head product included.
      if (config.loss_chunk_tokens > 0 && s.N > config.loss_chunk_tokens) flops += 2 * s.N * s.C * s.V;
      return flops;
    }
  }
  return 0;
}

StepFlops gpt_micro_batch_flops(const GPTConfig& config, int64_t batch, int64_t sequence, Recompute recompute,
                                int64_t checkpointed_blocks) {
  StepFlops f;
  f.forward = gpt_forward_flops(config, batch, sequence).flops;
  f.backward = 2 * f.forward;
  f.recompute = gpt_recompute_flops(config, batch, sequence, recompute, checkpointed_blocks);
  return f;
}

}  // namespace zt

namespace zt {
namespace {

// DeepSpeed's number_to_string style: three significant places with a unit prefix.
std::string with_unit(double value, const char* suffix = "") {
  static const char* const kPrefixes[] = {"", " K", " M", " G", " T", " P", " E"};
  int i = 0;
  while (std::abs(value) >= 1000.0 && i < 6) {
    value /= 1000.0;
    ++i;
  }
  return fmt::format("{:.2f}{}{}", value, kPrefixes[i], suffix);
}

void collect(const FlopsNode& node, int depth, std::map<int, std::map<std::string, std::array<int64_t, 3>>>& by_depth) {
  auto& entry = by_depth[depth][node.kind];
  entry[0] += node.params;
  entry[1] += node.macs;
  entry[2] += node.flops;
  for (const auto& c : node.children) collect(c, depth + 1, by_depth);
}

void print_tree(const FlopsNode& node, const FlopsNode& root, int depth, int64_t max_depth, std::string& out) {
  if (max_depth >= 0 && depth > max_depth) return;
  auto share = [](int64_t part, int64_t whole) { return whole > 0 ? 100.0 * double(part) / double(whole) : 0.0; };
  out += fmt::format("{:{}}{} ({}): {} = {:.2f}% params, {} = {:.2f}% MACs, {} = {:.2f}% fwd flops\n", "", 2 * depth,
                     node.name.empty() ? "model" : node.name, node.kind, with_unit(double(node.params)),
                     share(node.params, root.params), with_unit(double(node.macs), "MACs"), share(node.macs, root.macs),
                     with_unit(double(node.flops)), share(node.flops, root.flops));
  for (const auto& c : node.children) print_tree(c, root, depth + 1, max_depth, out);
}

}  // namespace

FlopsProfile gpt_flops_profile(const GPTConfig& config, const FlopsProfileInputs& in) {
  if (!(in.step_seconds > 0))
    throw ConfigError(fmt::format("flops profiler: expected a positive step time, found {}", in.step_seconds));
  if (in.accumulation <= 0 || in.world <= 0)
    throw ConfigError(fmt::format("flops profiler: expected positive accumulation steps and world size, found {} and {}",
                                  in.accumulation, in.world));
  const FlopsNode root = gpt_forward_flops(config, in.micro_batch, in.sequence);
  FlopsProfile p;
  p.micro_batch = gpt_micro_batch_flops(config, in.micro_batch, in.sequence, in.recompute, in.checkpointed_blocks);
  const double accum = double(in.accumulation);
  p.model_flops = double(p.micro_batch.model()) * accum;
  p.executed_flops = double(p.micro_batch.executed()) * accum;
  p.deepspeed_flops = (3.0 + in.recompute_fwd_factor) * double(p.micro_batch.forward) * accum;
  p.achieved_flops_per_second = p.executed_flops / in.step_seconds;
  if (in.peak_flops > 0) {
    p.mfu = p.model_flops / in.step_seconds / in.peak_flops;
    p.hfu = p.executed_flops / in.step_seconds / in.peak_flops;
  }

  std::string& out = p.text;
  auto line = [&](const std::string& label, const std::string& value) { out += fmt::format("{:<72}  {}\n", label, value); };
  out += "\n-------------------------- zerotrain flops profiler --------------------------\n";
  out += fmt::format("Profile summary at step {}:\n", in.profile_step);
  line("world size (data parallel): ", std::to_string(in.world));
  line("batch size per rank (micro-batch x accumulation): ", fmt::format("{} x {}", in.micro_batch, in.accumulation));
  line("sequence length: ", std::to_string(in.sequence));
  line("params of model: ", with_unit(double(root.params)));
  line("fwd MACs per micro-batch: ", with_unit(double(root.macs), "MACs"));
  line("fwd flops per micro-batch: ", with_unit(double(p.micro_batch.forward)));
  line("bwd flops per micro-batch (2 x fwd): ", with_unit(double(p.micro_batch.backward)));
  line(fmt::format("recomputed flops per micro-batch ({}, {} block(s)): ", to_string(in.recompute), in.checkpointed_blocks),
       with_unit(double(p.micro_batch.recompute)));
  line("model flops per step per rank (fwd + bwd): ", with_unit(p.model_flops));
  line("executed flops per step per rank (fwd + bwd + recomputation): ", with_unit(p.executed_flops));
  line("model flops per step, all ranks: ", with_unit(p.model_flops * in.world));
  line("step latency: ", fmt::format("{:.2f} ms", 1e3 * in.step_seconds));
  line("achieved FLOPS per rank = executed flops / step latency: ", with_unit(p.achieved_flops_per_second, "FLOPS"));
  line("model FLOPS per rank = model flops / step latency: ", with_unit(p.model_flops / in.step_seconds, "FLOPS"));
  if (in.recompute_fwd_factor > 0)
    line(fmt::format("FLOPS per rank = {:g} x fwd flops / step latency (recompute_fwd_factor): ",
                     3.0 + in.recompute_fwd_factor),
         with_unit(p.deepspeed_flops / in.step_seconds, "FLOPS"));
  if (in.peak_flops > 0) {
    line(fmt::format("peak per rank ({}): ", in.peak_source), with_unit(in.peak_flops, "FLOPS"));
    line("MFU = model FLOPS / peak: ", fmt::format("{:.2f}%", 100 * p.mfu));
    line("HFU = executed FLOPS / peak: ", fmt::format("{:.2f}%", 100 * p.hfu));
  }

  std::map<int, std::map<std::string, std::array<int64_t, 3>>> by_depth;
  collect(root, 0, by_depth);
  const int deepest = by_depth.empty() ? 0 : by_depth.rbegin()->first;
  const int depths = in.module_depth < 0 ? deepest + 1 : int(std::min<int64_t>(in.module_depth, deepest + 1));
  out += "\n----------------------------- Aggregated Profile per rank -----------------------------\n";
  out += fmt::format("Top {} modules in terms of params, MACs or fwd flops at different model depths:\n", in.top_modules);
  for (int d = 0; d < depths; ++d) {
    const auto& kinds = by_depth[d];
    auto top = [&](int field, const char* unit) {
      std::vector<std::pair<std::string, int64_t>> items;
      for (const auto& [kind, v] : kinds) items.emplace_back(kind, v[size_t(field)]);
      std::stable_sort(items.begin(), items.end(), [](const auto& a, const auto& b) { return a.second > b.second; });
      if (int64_t(items.size()) > in.top_modules) items.resize(size_t(in.top_modules));
      std::string s;
      for (const auto& [kind, v] : items) s += fmt::format("{}'{}': '{}'", s.empty() ? "" : ", ", kind, with_unit(double(v), unit));
      return "{" + s + "}";
    };
    out += fmt::format("depth {}:\n    params      - {}\n    MACs        - {}\n    fwd flops   - {}\n", d, top(0, ""),
                       top(1, "MACs"), top(2, ""));
  }
  if (in.detailed) {
    out += "\n------------------------------ Detailed Profile per rank ------------------------------\n";
    out += "Each module: params, percentage of total params, MACs, percentage of total MACs, fwd flops, percentage of "
           "total fwd flops (per micro-batch; analytic, docs/profiling.md)\n\n";
    print_tree(root, root, 0, in.module_depth, out);
  }
  out += "------------------------------------------------------------------------------\n";
  return p;
}

}  // namespace zt
