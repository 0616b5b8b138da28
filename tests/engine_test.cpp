// Engine (stage 0) in one process against the plain LibTorch loop it replaces.
#include <gtest/gtest.h>

#include "support/process.h"
#include "zerotrain/comm.h"
#include "zerotrain/config.h"
#include "zerotrain/engine.h"
#include "zerotrain/error.h"

namespace {

struct Net : torch::nn::Module {
  torch::nn::Linear a{nullptr}, b{nullptr};
  torch::Tensor frozen;
  Net() {
    a = register_module("a", torch::nn::Linear(8, 16));
    b = register_module("b", torch::nn::Linear(16, 4));
    frozen = register_parameter("frozen", torch::ones({16}), /*requires_grad=*/false);
  }
  torch::Tensor forward(torch::Tensor x) { return b(torch::tanh(a(x)) * frozen); }
};

std::shared_ptr<zt::Communicator> single_rank() {
  zt::RendezvousInfo info;
  info.master_port = zt::testing::free_port();
  info.source = "single";
  return zt::make_communicator(info, zt::CommOptions{});
}

void copy_parameters(Net& from, Net& to) {
  torch::NoGradGuard g;
  auto src = from.parameters();
  auto dst = to.parameters();
  for (size_t i = 0; i < src.size(); ++i) dst[i].copy_(src[i]);
}

TEST(Engine, MatchesTorchAdamWWithClippingAndAccumulation) {
  const std::string json = R"({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
     "gradient_clipping": 0.05,
     "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.1, "betas": [0.8, 0.95], "eps": 1e-7}}})";
  auto config = zt::parse_config(json, {}, 1);
  torch::manual_seed(3);
  auto ours = std::make_shared<Net>();
  auto reference = std::make_shared<Net>();
  copy_parameters(*ours, *reference);
  std::vector<torch::Tensor> ref_params;
  for (auto& p : reference->parameters())
    if (p.requires_grad()) ref_params.push_back(p);
  torch::optim::AdamW optimizer(ref_params,
                                torch::optim::AdamWOptions(0.01).betas({0.8, 0.95}).eps(1e-7).weight_decay(0.1));
  zt::Engine engine(ours, config, single_rank());

  int clipped_steps = 0;
  for (int step = 0; step < 6; ++step) {
    optimizer.zero_grad();
    for (int micro = 0; micro < 2; ++micro) {
      auto x = torch::randn({4, 8});
      auto y = torch::randn({4, 4});
      engine.backward(torch::mse_loss(ours->forward(x), y));
      (torch::mse_loss(reference->forward(x), y) / 2.0).backward();
      auto r = engine.step();
      EXPECT_EQ(r.boundary, micro == 1);
      if (r.boundary) clipped_steps += r.grad_norm > 0.05;
    }
    torch::nn::utils::clip_grad_norm_(ref_params, 0.05);
    optimizer.step();
  }
  EXPECT_EQ(clipped_steps, 6) << "clipping must be active in this test";
  auto a = ours->parameters();
  auto b = reference->parameters();
  for (size_t i = 0; i < a.size(); ++i) {
    auto rel = ((a[i] - b[i]).abs().max() / b[i].abs().max().clamp_min(1e-12)).item<double>();
    EXPECT_LT(rel, 1e-5) << "parameter " << i;
  }
  EXPECT_EQ(engine.global_step(), 6);
}

TEST(Engine, FrozenParametersGetNoStateAndStayUnchanged) {
  auto config = zt::parse_config("{}", {}, 1);
  auto net = std::make_shared<Net>();
  zt::Engine engine(net, config, single_rank());
  int64_t trainable = 0;
  for (auto& p : net->parameters())
    if (p.requires_grad()) trainable += p.numel();
  auto bytes = engine.model_state_bytes();
  EXPECT_EQ(bytes.parameters, trainable * 4);
  EXPECT_EQ(bytes.gradients, trainable * 4);
  EXPECT_EQ(bytes.optimizer_states, trainable * 8);
  engine.backward(net->forward(torch::randn({2, 8})).sum());
  engine.step();
  EXPECT_TRUE(torch::equal(net->frozen, torch::ones({16})));
  EXPECT_FALSE(net->frozen.grad().defined());
}

TEST(Engine, ParametersAreViewsOfOneArena) {
  auto config = zt::parse_config("{}", {}, 1);
  auto net = std::make_shared<Net>();
  zt::Engine engine(net, config, single_rank());
  // Trainable parameters share one storage (no per-tensor allocations during training).
  std::set<const void*> storages;
  for (auto& p : net->parameters())
    if (p.requires_grad()) storages.insert(p.storage().data());
  EXPECT_EQ(storages.size(), 1u);
}

TEST(Engine, RejectsModelWithoutTrainableParameters) {
  auto config = zt::parse_config("{}", {}, 1);
  auto net = std::make_shared<Net>();
  for (auto& p : net->parameters()) p.set_requires_grad(false);
  EXPECT_THROW(zt::Engine(net, config, single_rank()), zt::ConfigError);
}

}  // namespace
