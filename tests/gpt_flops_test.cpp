// The analytic FLOP count of the reference GPT: against a hand count for a tiny shape, and its
// matrix products against a brute-force count of the products the model actually runs (every
// matrix-product operator LibTorch dispatches, read from its operand shapes), in forward and in
// backward, with and without recomputation.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ATen/record_function.h>

#include <atomic>
#include <string_view>

#include "zerotrain/error.h"
#include "zerotrain/models/gpt.h"
#include "zerotrain/config/gpt_flops.h"

namespace {

using zt::FlopsNode;
using zt::GPTConfig;

const FlopsNode* find(const FlopsNode& node, const std::string& name) {
  if (node.name == name) return &node;
  for (const auto& c : node.children)
    if (const FlopsNode* f = find(c, name)) return f;
  return nullptr;
}

TEST(GptFlops, MatchesAHandCount) {
  // C=4, 2 heads, vocabulary 5, one block; one sequence of 3 tokens (N=3).
  GPTConfig c{5, 8, 1, 2, 4, 0.0};
  const FlopsNode root = zt::gpt_forward_flops(c, 1, 3);
  auto flops = [&](const char* name) {
    const FlopsNode* n = find(root, name);
    EXPECT_NE(n, nullptr) << name;
    return n ? n->flops : -1;
  };
  EXPECT_EQ(flops("blocks.0.attn.c_attn"), 2 * 3 * 4 * 12);  // 288
  EXPECT_EQ(flops("blocks.0.attn.scores"), 2 * 3 * 3 * 4);   // 72: 2 heads × 3×3 scores × 2 dims
  EXPECT_EQ(flops("blocks.0.attn.softmax"), 2 * 3 * 3);      // 18
  EXPECT_EQ(flops("blocks.0.attn.weighted_sum"), 72);
  EXPECT_EQ(flops("blocks.0.attn.c_proj"), 2 * 3 * 4 * 4);  // 96
  EXPECT_EQ(flops("blocks.0.attn"), 546);
  EXPECT_EQ(flops("blocks.0.ln_1"), 5 * 3 * 4);  // 60
  EXPECT_EQ(flops("blocks.0.mlp"), 384 + 48 + 384);
  EXPECT_EQ(flops("blocks.0.residual"), 24);
  EXPECT_EQ(flops("blocks.0"), 60 + 546 + 60 + 816 + 24);  // 1506
  EXPECT_EQ(flops("embedding_sum"), 12);
  EXPECT_EQ(flops("wte"), 0);
  EXPECT_EQ(flops("head"), 2 * 3 * 4 * 5);  // 120
  EXPECT_EQ(root.flops, 12 + 1506 + 60 + 120);
  EXPECT_EQ(root.macs, 144 + 36 + 36 + 48 + 192 + 192 + 60);
  // Parameters: the model's exact count, the tied head owning none.
  EXPECT_EQ(root.params, zt::gpt_parameter_count(c));
  EXPECT_EQ(root.params, 304);
  EXPECT_EQ(find(root, "head")->params, 0);

  EXPECT_EQ(zt::gpt_recompute_flops(c, 1, 3, zt::Recompute::None, 1), 0);
  EXPECT_EQ(zt::gpt_recompute_flops(c, 1, 3, zt::Recompute::Full, 1), 1506);
  EXPECT_EQ(zt::gpt_recompute_flops(c, 1, 3, zt::Recompute::Selective, 1), 72 + 18 + 72 + 48);
  c.loss_chunk_tokens = 2;  // 3 tokens in chunks of 2: every chunk's head product again
  EXPECT_EQ(zt::gpt_recompute_flops(c, 1, 3, zt::Recompute::Full, 0), 120);
  const auto step = zt::gpt_micro_batch_flops(c, 1, 3, zt::Recompute::Full, 1);
  EXPECT_EQ(step.forward, 1698);
  EXPECT_EQ(step.backward, 2 * 1698);
  EXPECT_EQ(step.recompute, 1506 + 120);
  EXPECT_EQ(step.model(), 3 * 1698);

  EXPECT_THROW(zt::gpt_forward_flops(c, 0, 3), zt::ConfigError);
  EXPECT_THROW(zt::gpt_recompute_flops(c, 1, 3, zt::Recompute::Full, 2), zt::ConfigError);
}

// Multiply-accumulates of the outermost matrix-product operator running (an inner one, such as
// linear's addmm, is part of it), from the operand shapes as DeepSpeed's profiler reads them.
std::atomic<int64_t> g_macs{0};
thread_local int g_depth = 0;

int64_t product(c10::IntArrayRef sizes, size_t drop_last = 0) {
  int64_t p = 1;
  for (size_t i = 0; i + drop_last < sizes.size(); ++i) p *= sizes[i];
  return p;
}

bool is_matrix_product(std::string_view name) {
  return name == "aten::linear" || name == "aten::matmul" || name == "aten::mm" || name == "aten::addmm" ||
         name == "aten::bmm" || name == "aten::baddbmm" || name.find("scaled_dot_product") != std::string_view::npos;
}

int64_t macs_of(const at::RecordFunction& fn) {
  const std::string_view name = fn.name();
  auto inputs = fn.inputs();
  auto sizes = [&](size_t i) { return inputs[i].toTensor().sizes(); };
  if (name == "aten::linear") return product(sizes(0)) * sizes(1)[0];
  if (name == "aten::matmul" || name == "aten::mm" || name == "aten::bmm") return product(sizes(0)) * sizes(1).back();
  if (name == "aten::addmm" || name == "aten::baddbmm") return product(sizes(1)) * sizes(2).back();
  // Attention: q·kᵀ and the weighted sum; the backward operators (grad_out, q, k, v, ...) four
  // products of the same size.
  const bool backward = name.find("backward") != std::string_view::npos;
  const size_t q = backward ? 1 : 0;
  const auto qs = sizes(q), ks = sizes(q + 1), vs = sizes(q + 2);
  const int64_t forward = product(qs) * ks[ks.size() - 2] + product(qs, 1) * ks[ks.size() - 2] * vs.back();
  return backward ? 2 * forward : forward;
}

struct CountMatrixProducts {
  at::CallbackHandle handle;
  CountMatrixProducts() {
    g_macs = 0;
    handle = at::addGlobalCallback(
        at::RecordFunctionCallback(
            [](const at::RecordFunction& fn) -> std::unique_ptr<at::ObserverContext> {
              if (!is_matrix_product(fn.name())) return nullptr;
              if (g_depth++ == 0) g_macs += macs_of(fn);
              return nullptr;
            },
            [](const at::RecordFunction& fn, at::ObserverContext*) {
              if (is_matrix_product(fn.name())) --g_depth;
            })
            .needsInputs(true)
            .scopes({at::RecordScope::FUNCTION}));
  }
  ~CountMatrixProducts() { at::removeCallback(handle); }
  int64_t take() { return g_macs.exchange(0); }
};

// The analytic multiply-accumulates of a node's matrix products (its macs) against a run.
TEST(GptFlops, MatrixProductsMatchABruteForceCountOfTheOperators) {
  at::set_num_threads(1);
  GPTConfig c = zt::gpt_preset("tiny");
  const int64_t B = 2, T = 16;
  const FlopsNode root = zt::gpt_forward_flops(c, B, T);
  const int64_t block_macs = find(root, "blocks.0")->macs;
  for (zt::Recompute recompute : {zt::Recompute::None, zt::Recompute::Full}) {
    SCOPED_TRACE(zt::to_string(recompute));
    torch::manual_seed(1);
    zt::GPT model(c);
    zt::GPTImpl::Checkpointing settings;
    settings.recompute = recompute;
    model->set_checkpointing(settings);
    auto tokens = torch::randint(0, c.vocab_size, {B, T + 1}, torch::kLong);
    CountMatrixProducts count;
    auto loss = model->loss(tokens.narrow(1, 0, T), tokens.narrow(1, 1, T));
    const int64_t forward = count.take();
    EXPECT_EQ(forward, root.macs);
    loss.backward();
    const int64_t backward = count.take();
    // Backward: two products per forward product (the input's and the weight's gradients), plus
    // the forward of every block again under full recomputation.
    const int64_t recomputed = recompute == zt::Recompute::Full ? c.n_layer * block_macs : 0;
    EXPECT_EQ(backward, 2 * root.macs + recomputed);
  }
}

TEST(GptFlops, ProfileReportsModelAndExecutedFlopsAndUtilisation) {
  GPTConfig c{5, 8, 1, 2, 4, 0.0};
  zt::FlopsProfileInputs in;
  in.profile_step = 3;
  in.world = 2;
  in.micro_batch = 1;
  in.accumulation = 2;
  in.sequence = 3;
  in.recompute = zt::Recompute::Full;
  in.checkpointed_blocks = 1;
  in.recompute_fwd_factor = 1.0;
  in.step_seconds = 0.5;
  in.peak_flops = 1e5;
  in.peak_source = "measured matmul peak";
  in.module_depth = 1;
  in.top_modules = 2;
  const auto p = zt::gpt_flops_profile(c, in);
  EXPECT_DOUBLE_EQ(p.model_flops, 2.0 * 3 * 1698);
  EXPECT_DOUBLE_EQ(p.executed_flops, 2.0 * (3 * 1698 + 1506));
  EXPECT_DOUBLE_EQ(p.deepspeed_flops, 2.0 * 4 * 1698);
  EXPECT_DOUBLE_EQ(p.achieved_flops_per_second, p.executed_flops / 0.5);
  EXPECT_DOUBLE_EQ(p.mfu, p.model_flops / 0.5 / 1e5);
  EXPECT_DOUBLE_EQ(p.hfu, p.executed_flops / 0.5 / 1e5);
  auto has = [&](const std::string& s) { return p.text.find(s) != std::string::npos; };
  EXPECT_TRUE(has("Profile summary at step 3")) << p.text;
  EXPECT_TRUE(has("measured matmul peak")) << p.text;
  EXPECT_TRUE(has("MFU = model FLOPS / peak:")) << p.text;
  EXPECT_TRUE(has("depth 0:")) << p.text;
  EXPECT_FALSE(has("depth 1:")) << p.text;  // module_depth 1: the model only, as DeepSpeed's range(depth)
  EXPECT_TRUE(has("Detailed Profile")) << p.text;
  EXPECT_TRUE(has("  blocks.0 (Block)")) << p.text;
  EXPECT_FALSE(has("blocks.0.attn (")) << p.text;  // deeper than module_depth
  in.detailed = false;
  in.module_depth = -1;
  const auto all = zt::gpt_flops_profile(c, in);
  EXPECT_EQ(all.text.find("Detailed Profile"), std::string::npos);
  EXPECT_NE(all.text.find("depth 3:"), std::string::npos) << all.text;
  in.step_seconds = 0;
  EXPECT_THROW(zt::gpt_flops_profile(c, in), zt::ConfigError);
}

}  // namespace
