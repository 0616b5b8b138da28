// Tensor-parallel layers (zerotrain/models/tensor_parallel.h) and the GPT built with a tensor
// group: on T = 1 and T = 2 ranks, each output and every gradient equal the unsplit LibTorch
// layer's or GPT's built from the same seed (this rank's slice of them), within fp32 rounding;
// bad sizes are refused by name.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "support/multirank.h"
#include "zerotrain/comm/comm.h"
#include "zerotrain/error.h"
#include "zerotrain/models/gpt.h"
#include "zerotrain/models/tensor_parallel.h"

namespace {

using zt::testing::is_rank_process;
using zt::testing::run_ranks;

std::shared_ptr<zt::Communicator> rank_communicator() {
  at::set_num_threads(1);
  return zt::make_communicator(zt::rendezvous_from_environment(), zt::comm_options_from_environment());
}

at::Tensor slice(const at::Tensor& whole, int64_t dim, const zt::Communicator& group) {
  const int64_t n = whole.size(dim) / group.world_size();
  return whole.narrow(dim, n * group.rank(), n);
}

void expect_close(const at::Tensor& actual, const at::Tensor& expected, const std::string& what) {
  ASSERT_EQ(actual.sizes(), expected.sizes()) << what;
  EXPECT_TRUE(torch::allclose(actual, expected, 1e-5, 1e-6))
      << what << ": largest difference " << (actual - expected).abs().max().item<double>();
}

// Column-parallel then row-parallel (an MLP): one all-reduce in forward, one in backward.
void mlp_equals_unsplit(const std::shared_ptr<zt::Communicator>& group) {
  torch::manual_seed(5);
  torch::nn::Linear fc1(torch::nn::LinearOptions(8, 12)), fc2(torch::nn::LinearOptions(12, 6));
  torch::manual_seed(5);
  zt::ColumnParallelLinear col(8, 12, true, group);
  zt::RowParallelLinear row(12, 6, true, group);
  EXPECT_TRUE(torch::equal(col->weight, slice(fc1->weight, 0, *group)));
  EXPECT_TRUE(torch::equal(col->bias, slice(fc1->bias, 0, *group)));
  EXPECT_TRUE(torch::equal(row->weight, slice(fc2->weight, 1, *group)));
  EXPECT_TRUE(torch::equal(row->bias, fc2->bias));

  auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
  const at::Tensor x0 = torch::randn({3, 4, 8}, gen);
  at::Tensor x = x0.clone().requires_grad_(true), xr = x0.clone().requires_grad_(true);
  const at::Tensor y = row(torch::gelu(col(x)));
  const at::Tensor yr = fc2(torch::gelu(fc1(xr)));
  expect_close(y, yr, "output");
  (y * y).sum().backward();
  (yr * yr).sum().backward();
  expect_close(x.grad(), xr.grad(), "input gradient");
  expect_close(col->weight.grad(), slice(fc1->weight.grad(), 0, *group), "column weight gradient");
  expect_close(col->bias.grad(), slice(fc1->bias.grad(), 0, *group), "column bias gradient");
  expect_close(row->weight.grad(), slice(fc2->weight.grad(), 1, *group), "row weight gradient");
  expect_close(row->bias.grad(), fc2->bias.grad(), "row bias gradient (replicated)");
}

void gathered_column_equals_unsplit(const std::shared_ptr<zt::Communicator>& group) {
  torch::manual_seed(6);
  torch::nn::Linear fc(torch::nn::LinearOptions(5, 4).bias(false));
  torch::manual_seed(6);
  zt::ColumnParallelLinear col(5, 4, false, group, /*gather_output=*/true);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(12);
  const at::Tensor x0 = torch::randn({7, 5}, gen);
  at::Tensor x = x0.clone().requires_grad_(true), xr = x0.clone().requires_grad_(true);
  const at::Tensor weights = torch::randn({7, 4}, gen);
  const at::Tensor y = col(x), yr = fc(xr);
  expect_close(y, yr, "gathered output");
  (y * weights).sum().backward();
  (yr * weights).sum().backward();
  expect_close(x.grad(), xr.grad(), "input gradient");
  expect_close(col->weight.grad(), slice(fc->weight.grad(), 0, *group), "weight gradient");
}

void embedding_and_cross_entropy_equal_unsplit(const std::shared_ptr<zt::Communicator>& group) {
  torch::manual_seed(7);
  torch::nn::Embedding whole(torch::nn::EmbeddingOptions(10, 3));
  torch::manual_seed(7);
  zt::VocabParallelEmbedding emb(10, 3, group);
  EXPECT_TRUE(torch::equal(emb->weight, slice(whole->weight, 0, *group)));
  const at::Tensor ids = torch::tensor({{0, 9, 4}, {5, 5, 2}}, torch::kLong);
  const at::Tensor weights = torch::arange(18, torch::kFloat32).view({2, 3, 3});
  const at::Tensor y = emb(ids), yr = whole(ids);
  expect_close(y, yr, "embedding output");
  (y * weights).sum().backward();
  (yr * weights).sum().backward();
  expect_close(emb->weight.grad(), slice(whole->weight.grad(), 0, *group), "embedding gradient");

  // Logits [6, 10] split along the vocabulary; one target in each rank's half, one ignored row.
  auto gen = at::make_generator<at::CPUGeneratorImpl>(13);
  const at::Tensor logits = (3 * torch::randn({6, 10}, gen)).requires_grad_(true);
  const at::Tensor targets = torch::tensor({1, 8, 4, -100, 5, 9}, torch::kLong);
  at::Tensor local = slice(logits.detach(), 1, *group).clone().requires_grad_(true);
  const at::Tensor loss = zt::vocab_parallel_cross_entropy(local, targets, group);
  const at::Tensor reference = torch::nn::functional::cross_entropy(
      logits, targets, torch::nn::functional::CrossEntropyFuncOptions().ignore_index(-100));
  expect_close(loss, reference, "loss");
  (2 * loss).backward();
  (2 * reference).backward();
  expect_close(local.grad(), slice(logits.grad(), 1, *group), "logit gradient");
}

// This rank's slice of a whole GPT parameter, by the layout docs/tensor_parallel.md gives.
at::Tensor gpt_slice(const std::string& name, const at::Tensor& whole, const zt::Communicator& group) {
  auto ends_with = [&](const std::string& s) {
    return name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0;
  };
  if (name == "wte.weight" || ends_with("c_fc.weight") || ends_with("c_fc.bias")) return slice(whole, 0, group);
  if (ends_with("c_attn.weight") || ends_with("c_attn.bias")) {
    auto qkv = whole.chunk(3, 0);
    return torch::cat({slice(qkv[0], 0, group), slice(qkv[1], 0, group), slice(qkv[2], 0, group)}, 0);
  }
  if (ends_with("c_proj.weight")) return slice(whole, 1, group);
  return whole;
}

// The GPT with its heads, MLP features and vocabulary split: the same loss and, per rank, the
// slice of every gradient of the unsplit model built from the same seed (the whole loss and the
// chunked one).
void gpt_equals_unsplit(const std::shared_ptr<zt::Communicator>& group) {
  for (int64_t chunk : {0, 24}) {
    auto config = zt::gpt_preset("small");
    config.loss_chunk_tokens = chunk;
    torch::manual_seed(3);
    zt::GPT whole(config);
    torch::manual_seed(3);
    zt::GPT split(config, group);
    const auto whole_parameters = whole->named_parameters();
    for (const auto& item : split->named_parameters())
      ASSERT_TRUE(torch::equal(item.value(), gpt_slice(item.key(), whole_parameters[item.key()], *group)))
          << item.key();
    auto gen = at::make_generator<at::CPUGeneratorImpl>(21);
    const at::Tensor tokens = torch::randint(0, config.vocab_size, {2, 33}, gen, torch::kLong);
    at::Tensor targets = tokens.narrow(1, 1, 32).clone();
    targets.index_put_({0, 3}, -100);  // one ignored target
    const at::Tensor loss = split->loss(tokens.narrow(1, 0, 32), targets);
    const at::Tensor reference = whole->loss(tokens.narrow(1, 0, 32), targets);
    expect_close(loss, reference, "GPT loss, chunk " + std::to_string(chunk));
    loss.backward();
    reference.backward();
    for (const auto& item : split->named_parameters())
      expect_close(item.value().grad(), gpt_slice(item.key(), whole_parameters[item.key()].grad(), *group),
                   item.key() + " gradient, chunk " + std::to_string(chunk));
    // forward() gives this rank's slice of the vocabulary.
    EXPECT_EQ(split->forward(tokens.narrow(1, 0, 4)).size(-1), config.vocab_size / group->world_size());
  }
  if (group->world_size() > 1) {
    auto odd = zt::gpt_preset("small");
    odd.vocab_size = 255;
    try {
      zt::GPT refused(odd, group);
      FAIL() << "a vocabulary of 255 split over " << group->world_size() << " ranks";
    } catch (const zt::ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("vocab_size 255"), std::string::npos) << e.what();
    }
    auto heads = zt::gpt_preset("small");
    heads.n_head = 1;
    heads.n_embd = 128;
    EXPECT_THROW(zt::GPT(heads, group), zt::ConfigError);
  }
}

void bad_sizes_are_refused(const std::shared_ptr<zt::Communicator>& group) {
  if (group->world_size() < 2) return;
  try {
    zt::ColumnParallelLinear(8, 7, true, group);
    FAIL() << "7 output features split over 2 ranks";
  } catch (const zt::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("out_features"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("found 7"), std::string::npos) << e.what();
  }
  EXPECT_THROW(zt::RowParallelLinear(5, 4, true, group), zt::ConfigError);
  EXPECT_THROW(zt::VocabParallelEmbedding(9, 4, group), zt::ConfigError);
  EXPECT_THROW(zt::ColumnParallelLinear(8, 8, true, nullptr), zt::ConfigError);
}

TEST(TensorParallel, LayersEqualTheUnsplitLayersOnOneAndTwoRanks) {
  if (is_rank_process()) {
    auto group = rank_communicator();
    mlp_equals_unsplit(group);
    gathered_column_equals_unsplit(group);
    embedding_and_cross_entropy_equal_unsplit(group);
    gpt_equals_unsplit(group);
    bad_sizes_are_refused(group);
    return;
  }
  for (int world : {1, 2}) {
    auto r = run_ranks(world, "TensorParallel.LayersEqualTheUnsplitLayersOnOneAndTwoRanks",
                       {{"ZT_COMM_TIMEOUT_SECONDS", "60"}}, std::chrono::seconds(90));
    EXPECT_TRUE(r.all_succeeded()) << world << " ranks:\n" << r.describe();
  }
}

}  // namespace
