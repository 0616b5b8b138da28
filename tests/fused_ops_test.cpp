// The fused BERT operations bench/fused_ops_bench.cpp measures (bench/fused_ops.h; not part of
// the library) against the unfused LibTorch composition:
// forward and every gradient in fp32 (outputs and input gradients within 1e-6 relative; parameter
// gradients, column sums taken in another order, within 1e-5 of the gradient's largest element;
// bias_gelu's output and dx bitwise) and bf16 (outputs and input gradients within one bf16
// rounding, 1e-2 relative, of LibTorch's bf16 composition; parameter gradients within 1e-2 of the
// largest element of the fp64 composition on the same bf16 values: the fused sums accumulate in
// fp32, LibTorch's bf16 LayerNorm backward lands several bf16 steps further from it), odd shapes
// (rows not a multiple of the chunk, N not a multiple of 16), analytical gradients against central
// differences in fp64, and bitwise determinism across runs and thread counts. Also the BERT
// attention's bf16 CPU path (LibTorch's math path with an additive mask, chosen by measurement)
// against LibTorch's fused attention kernel with the boolean mask.
#include <functional>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "zerotrain/models/bert.h"
#include "fused_ops.h"  // bench/: measured, not used by the library

namespace {

// Every element within atol + rtol·|expected|.
::testing::AssertionResult close(const torch::Tensor& actual, const torch::Tensor& expected, double rtol,
                                 double atol) {
  if (!actual.defined() || !expected.defined()) return ::testing::AssertionFailure() << "undefined tensor";
  if (actual.sizes() != expected.sizes())
    return ::testing::AssertionFailure() << "sizes " << actual.sizes() << " vs " << expected.sizes();
  if (actual.scalar_type() != expected.scalar_type())
    return ::testing::AssertionFailure() << "dtype " << actual.scalar_type() << " vs " << expected.scalar_type();
  auto a = actual.to(torch::kDouble), e = expected.to(torch::kDouble);
  auto excess = (a - e).abs() - (atol + rtol * e.abs());
  const double worst = excess.max().item<double>();
  if (worst > 0)
    return ::testing::AssertionFailure() << "max excess " << worst << ", max |diff| "
                                         << (a - e).abs().max().item<double>();
  return ::testing::AssertionSuccess();
}

struct Run {
  torch::Tensor out;
  std::vector<torch::Tensor> grads;
};

using Fn = std::function<torch::Tensor(const std::vector<torch::Tensor>&)>;

// Forward and the gradients of sum(out · g) for the given inputs (cloned, so runs are independent).
Run run(const Fn& fn, const std::vector<torch::Tensor>& inputs, const torch::Tensor& g) {
  std::vector<torch::Tensor> leaves;
  for (const auto& t : inputs) leaves.push_back(t.detach().clone().requires_grad_(true));
  Run r;
  r.out = fn(leaves);
  r.grads = torch::autograd::grad({r.out}, leaves, {g});
  r.out = r.out.detach();
  return r;
}

Fn unfused_bias_gelu = [](const auto& v) { return torch::gelu(v[0] + v[1], "none"); };
Fn fused_bias_gelu(int64_t chunk_bytes) {
  return [chunk_bytes](const auto& v) { return zt::bias_gelu(v[0], v[1], chunk_bytes); };
}
Fn unfused_residual_ln = [](const auto& v) {
  return torch::layer_norm(v[0] + v[1], {v[0].size(-1)}, v[2], v[3], 1e-5);
};
Fn fused_residual_ln(int64_t chunk_bytes) {
  return [chunk_bytes](const auto& v) { return zt::residual_layer_norm(v[0], v[1], v[2], v[3], 1e-5, chunk_bytes); };
}

std::vector<torch::Tensor> bias_gelu_inputs(std::vector<int64_t> shape, torch::ScalarType dt) {
  const int64_t n = shape.back();
  return {torch::randn(shape).to(dt), (torch::randn({n}) * 0.5).to(dt)};
}

std::vector<torch::Tensor> residual_ln_inputs(std::vector<int64_t> shape, torch::ScalarType dt) {
  const int64_t n = shape.back();
  return {torch::randn(shape).to(dt), (torch::randn(shape) * 2 + 0.3).to(dt), (1 + torch::randn({n}) * 0.2).to(dt),
          (torch::randn({n}) * 0.2).to(dt)};
}

// Outputs and input gradients (the first `inputs` gradients) within atol + rtol·|ref|; parameter
// gradients within param_tol·max|param_ref| (param_ref: ref unless given, converted to each dtype).
void expect_matches(const Run& fused, const Run& ref, size_t inputs, double rtol, double atol, double param_tol,
                    const Run* param_ref = nullptr) {
  if (!param_ref) param_ref = &ref;
  EXPECT_TRUE(close(fused.out, ref.out, rtol, atol)) << "forward";
  ASSERT_EQ(fused.grads.size(), ref.grads.size());
  for (size_t i = 0; i < ref.grads.size(); ++i) {
    if (i < inputs) {
      EXPECT_TRUE(close(fused.grads[i], ref.grads[i], rtol, atol)) << "gradient " << i;
    } else {
      const auto& expected = param_ref->grads[i];
      const double scale = expected.abs().max().item<double>();
      EXPECT_TRUE(close(fused.grads[i].to(torch::kDouble), expected.to(torch::kDouble), 0, param_tol * scale))
          << "gradient " << i;
    }
  }
}

std::vector<torch::Tensor> to_double(std::vector<torch::Tensor> v) {
  for (auto& t : v) t = t.to(torch::kDouble);
  return v;
}

void expect_bitwise(const Run& a, const Run& b) {
  EXPECT_TRUE(torch::equal(a.out, b.out));
  ASSERT_EQ(a.grads.size(), b.grads.size());
  for (size_t i = 0; i < a.grads.size(); ++i) EXPECT_TRUE(torch::equal(a.grads[i], b.grads[i])) << "gradient " << i;
}

// Central differences of sum(fn(inputs) · g) in fp64 against the analytical gradients.
void expect_gradients_match_finite_differences(const Fn& fn, std::vector<torch::Tensor> inputs) {
  for (auto& t : inputs) t = t.to(torch::kDouble);
  auto g = torch::randn(fn(inputs).sizes(), torch::kDouble);
  auto analytical = run(fn, inputs, g).grads;
  const double h = 1e-6;
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < inputs.size(); ++i) {
    auto flat = inputs[i].view(-1);
    auto numeric = torch::zeros_like(flat);
    for (int64_t k = 0; k < flat.numel(); ++k) {
      const double v = flat[k].item<double>();
      flat[k] = v + h;
      const double up = (fn(inputs) * g).sum().item<double>();
      flat[k] = v - h;
      const double down = (fn(inputs) * g).sum().item<double>();
      flat[k] = v;
      numeric[k] = (up - down) / (2 * h);
    }
    EXPECT_TRUE(close(analytical[i].reshape(-1), numeric, 1e-5, 1e-6)) << "input " << i;
  }
}

// ---- bias + GELU --------------------------------------------------------------------------------

TEST(BiasGelu, MatchesUnfusedFp32OddShapesAndChunks) {
  torch::manual_seed(1);
  // 5·7 = 35 rows of 37: 3 rows per chunk leaves a last chunk of 2 rows.
  auto in = bias_gelu_inputs({5, 7, 37}, torch::kFloat);
  auto g = torch::randn({5, 7, 37});
  auto ref = run(unfused_bias_gelu, in, g);
  for (int64_t chunk : {int64_t(37 * 4 * 3), int64_t(1), zt::kFusedChunkBytes}) {
    auto fused = run(fused_bias_gelu(chunk), in, g);
    expect_matches(fused, ref, 1, 1e-6, 1e-7, 1e-5);
    // The same elementwise kernels on the same values: the output and dx are bitwise LibTorch's.
    EXPECT_TRUE(torch::equal(fused.out, ref.out));
    EXPECT_TRUE(torch::equal(fused.grads[0], ref.grads[0]));
  }
}

TEST(BiasGelu, MatchesUnfusedBf16) {
  torch::manual_seed(2);
  auto in = bias_gelu_inputs({3, 41, 100}, torch::kBFloat16);
  auto g = torch::randn({3, 41, 100}).to(torch::kBFloat16);
  auto ref = run(unfused_bias_gelu, in, g);
  auto fused = run(fused_bias_gelu(100 * 2 * 8), in, g);
  auto exact = run(unfused_bias_gelu, to_double(in), g.to(torch::kDouble));
  expect_matches(fused, ref, 1, 1e-2, 1e-2, 1e-2, &exact);
  EXPECT_EQ(fused.out.scalar_type(), torch::kBFloat16);
  EXPECT_EQ(fused.grads[1].scalar_type(), torch::kBFloat16);
}

TEST(BiasGelu, MatchesUnfusedAtBertShapeOnTwoThreads) {
  torch::manual_seed(3);
  const int threads = torch::get_num_threads();
  torch::set_num_threads(2);
  auto in = bias_gelu_inputs({130, 3072}, torch::kFloat);
  auto g = torch::randn({130, 3072});
  expect_matches(run(fused_bias_gelu(zt::kFusedChunkBytes), in, g), run(unfused_bias_gelu, in, g), 1, 1e-6, 1e-7,
                 1e-5);
  torch::set_num_threads(threads);
}

TEST(BiasGelu, GradientsMatchFiniteDifferencesInDouble) {
  torch::manual_seed(4);
  expect_gradients_match_finite_differences(fused_bias_gelu(5 * 8 * 2), bias_gelu_inputs({3, 5}, torch::kFloat));
}

TEST(BiasGelu, DeterministicAcrossRunsAndThreads) {
  torch::manual_seed(5);
  auto in = bias_gelu_inputs({257, 300}, torch::kFloat);
  auto g = torch::randn({257, 300});
  const int threads = torch::get_num_threads();
  torch::set_num_threads(2);
  auto a = run(fused_bias_gelu(4096), in, g), b = run(fused_bias_gelu(4096), in, g);
  torch::set_num_threads(1);
  auto c = run(fused_bias_gelu(4096), in, g);
  torch::set_num_threads(threads);
  expect_bitwise(a, b);
  expect_bitwise(a, c);
}

TEST(BiasGelu, RejectsABiasOfTheWrongSize) {
  EXPECT_THROW(zt::bias_gelu(torch::randn({4, 8}), torch::randn({7})), c10::Error);
  EXPECT_THROW(zt::bias_gelu(torch::randn({4, 8}), torch::randn({8}, torch::kDouble)), c10::Error);
}

// ---- residual + LayerNorm -------------------------------------------------------------------

TEST(ResidualLayerNorm, MatchesUnfusedFp32OddShapesAndChunks) {
  torch::manual_seed(11);
  auto in = residual_ln_inputs({5, 7, 37}, torch::kFloat);
  auto g = torch::randn({5, 7, 37});
  auto ref = run(unfused_residual_ln, in, g);
  for (int64_t chunk : {int64_t(37 * 4 * 3), int64_t(1), zt::kFusedChunkBytes})
    expect_matches(run(fused_residual_ln(chunk), in, g), ref, 2, 1e-6, 1e-6, 1e-5);
}

TEST(ResidualLayerNorm, MatchesUnfusedBf16) {
  torch::manual_seed(12);
  auto in = residual_ln_inputs({3, 41, 100}, torch::kBFloat16);
  auto g = torch::randn({3, 41, 100}).to(torch::kBFloat16);
  auto ref = run(unfused_residual_ln, in, g);
  auto fused = run(fused_residual_ln(100 * 2 * 8), in, g);
  auto exact = run(unfused_residual_ln, to_double(in), g.to(torch::kDouble));
  expect_matches(fused, ref, 2, 1e-2, 1e-2, 1e-2, &exact);
  for (const auto& t : fused.grads) EXPECT_EQ(t.scalar_type(), torch::kBFloat16);
}

TEST(ResidualLayerNorm, MatchesUnfusedAtBertShapeOnTwoThreads) {
  torch::manual_seed(13);
  const int threads = torch::get_num_threads();
  torch::set_num_threads(2);
  auto in = residual_ln_inputs({2, 131, 768}, torch::kFloat);
  auto g = torch::randn({2, 131, 768});
  expect_matches(run(fused_residual_ln(zt::kFusedChunkBytes), in, g), run(unfused_residual_ln, in, g), 2, 1e-6, 1e-6,
                 1e-5);
  torch::set_num_threads(threads);
}

TEST(ResidualLayerNorm, GradientsMatchFiniteDifferencesInDouble) {
  torch::manual_seed(14);
  expect_gradients_match_finite_differences(fused_residual_ln(6 * 8 * 2), residual_ln_inputs({4, 6}, torch::kFloat));
}

TEST(ResidualLayerNorm, DeterministicAcrossRunsAndThreads) {
  torch::manual_seed(15);
  auto in = residual_ln_inputs({257, 300}, torch::kFloat);
  auto g = torch::randn({257, 300});
  const int threads = torch::get_num_threads();
  torch::set_num_threads(2);
  auto a = run(fused_residual_ln(4096), in, g), b = run(fused_residual_ln(4096), in, g);
  torch::set_num_threads(1);
  auto c = run(fused_residual_ln(4096), in, g);
  torch::set_num_threads(threads);
  expect_bitwise(a, b);
  expect_bitwise(a, c);
}

TEST(ResidualLayerNorm, RejectsMismatchedOperands) {
  auto x = torch::randn({4, 8});
  EXPECT_THROW(zt::residual_layer_norm(x, torch::randn({4, 7}), torch::ones({8}), torch::zeros({8}), 1e-5), c10::Error);
  EXPECT_THROW(zt::residual_layer_norm(x, torch::randn({4, 8}), torch::ones({7}), torch::zeros({8}), 1e-5), c10::Error);
}

// ---- BERT attention in bf16 on the CPU ------------------------------------------------------

TEST(BertAttentionBf16, MathPathMatchesTheFusedKernelWithTheBooleanMask) {
  torch::manual_seed(21);
  zt::BertConfig config;  // hidden 64, 2 heads, no dropout
  zt::BertSelfAttention attention(config);
  attention->to(torch::kBFloat16);
  const int64_t B = 3, T = 20, H = config.hidden, hd = H / config.n_head;
  auto keep = (torch::arange(T).view({1, 1, 1, T}) < torch::tensor({20, 13, 1}).view({B, 1, 1, 1}));
  auto x = torch::randn({B, T, H}).to(torch::kBFloat16);
  auto g = torch::randn({B, T, H}).to(torch::kBFloat16);
  auto reference = [&](const std::vector<torch::Tensor>& v) {
    auto heads = [&](const torch::Tensor& t) { return t.view({B, T, config.n_head, hd}).transpose(1, 2); };
    auto y = at::scaled_dot_product_attention(heads(attention->query(v[0])), heads(attention->key(v[0])),
                                              heads(attention->value(v[0])), keep);
    return attention->output(y.transpose(1, 2).contiguous().view({B, T, H}));
  };
  auto model = [&](const std::vector<torch::Tensor>& v) { return attention->forward(v[0], keep); };
  auto ref = run(reference, {x}, g), got = run(model, {x}, g);
  EXPECT_EQ(got.out.scalar_type(), torch::kBFloat16);
  EXPECT_TRUE(close(got.out, ref.out, 2e-2, 2e-2)) << "forward";
  EXPECT_TRUE(close(got.grads[0], ref.grads[0], 2e-2, 2e-2)) << "dx";
  // The mask is applied: a padded key changes nothing.
  auto x2 = x.clone();
  x2[1].narrow(0, 13, T - 13).normal_();
  torch::NoGradGuard no_grad;
  EXPECT_TRUE(torch::equal(attention->forward(x, keep)[1].narrow(0, 0, 13),
                           attention->forward(x2, keep)[1].narrow(0, 0, 13)));
  // A sequence without tokens: uniform weights, not NaN.
  auto none = torch::zeros({1, 1, 1, T}, torch::kBool);
  EXPECT_TRUE(torch::isfinite(attention->forward(x.narrow(0, 0, 1), none)).all().item<bool>());
}

// The whole encoder in bf16 on the CPU, with attention dropout, padding and recomputation: the
// math path's dropout draws replay under checkpointing like the fused kernel's.
TEST(BertAttentionBf16, CheckpointedLayersGiveThePlainGradientsInBf16) {
  zt::BertConfig config;
  config.dropout = 0.1;
  const int64_t B = 2, T = 24;
  auto ids = torch::randint(0, 256, {B, T}, torch::kLong);
  auto mask = (torch::arange(T).view({1, T}) < torch::tensor({24, 17}).view({B, 1})).to(torch::kLong);
  std::vector<torch::Tensor> plain;
  for (auto recompute : {zt::Recompute::None, zt::Recompute::Full, zt::Recompute::Selective}) {
    torch::manual_seed(2);
    zt::Bert model(config);
    model->to(torch::kBFloat16);
    model->set_checkpointing({.recompute = recompute});
    model->train();
    torch::manual_seed(11);
    auto hidden = model->forward(ids, torch::Tensor(), mask);
    ASSERT_EQ(hidden.scalar_type(), torch::kBFloat16);
    hidden.to(torch::kFloat).pow(2).sum().backward();
    std::vector<torch::Tensor> grads;
    for (const auto& p : model->parameters())
      if (p.grad().defined()) grads.push_back(p.grad().clone());
    ASSERT_FALSE(grads.empty());
    for (const auto& g : grads) EXPECT_TRUE(torch::isfinite(g).all().item<bool>());
    if (plain.empty()) {
      plain = grads;
      continue;
    }
    ASSERT_EQ(grads.size(), plain.size());
    for (size_t i = 0; i < grads.size(); ++i)
      EXPECT_TRUE(torch::equal(grads[i], plain[i])) << zt::to_string(recompute) << " " << i;
  }
}

}  // namespace
