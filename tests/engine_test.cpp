// Engine (stage 0) in one process against the plain LibTorch loop it replaces.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <set>

#include "support/process.h"
#include "zerotrain/comm/comm.h"
#include "zerotrain/config/config.h"
#include "zerotrain/zero/engine.h"
#include "zerotrain/error.h"
#include "zerotrain/layout/layout.h"
#include "zerotrain/optim/lr_schedule.h"

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

// Runs 5 steps of the engine and of a reference update (given the reference net after backward).
template <class Reference>
void run_against(const std::string& json, Reference&& reference_step, double tolerance) {
  auto config = zt::parse_config(json, {}, 1);
  torch::manual_seed(5);
  auto ours = std::make_shared<Net>();
  auto reference = std::make_shared<Net>();
  copy_parameters(*ours, *reference);
  zt::Engine engine(ours, config, single_rank());
  for (int step = 1; step <= 5; ++step) {
    for (auto& p : reference->parameters()) p.mutable_grad() = torch::Tensor();
    auto x = torch::randn({4, 8});
    auto y = torch::randn({4, 4});
    engine.backward(torch::mse_loss(ours->forward(x), y));
    torch::mse_loss(reference->forward(x), y).backward();
    EXPECT_TRUE(engine.step().stepped);
    reference_step(*reference, step);
  }
  auto a = ours->parameters();
  auto b = reference->parameters();
  for (size_t i = 0; i < a.size(); ++i) {
    auto rel = ((a[i] - b[i]).abs().max() / b[i].abs().max().clamp_min(1e-12)).item<double>();
    EXPECT_LT(rel, tolerance) << "parameter " << i;
  }
}

std::vector<torch::Tensor> trainable(Net& net) {
  std::vector<torch::Tensor> out;
  for (auto& p : net.parameters())
    if (p.requires_grad()) out.push_back(p);
  return out;
}

// DeepSpeed's set_gradient_accumulation_boundary(true) before the count: windows of 3, 2 and 3
// micro-steps with gradient_accumulation_steps 3, each loss still divided by 3 (as DeepSpeed
// divides it), against torch's loop doing the same; false where a window ends is refused.
TEST(Engine, ABoundarySetEarlyEndsTheWindowThere) {
  auto config = zt::parse_config(R"({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3,
     "gradient_clipping": 0, "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0}}})", {}, 1);
  torch::manual_seed(7);
  auto ours = std::make_shared<Net>();
  auto reference = std::make_shared<Net>();
  copy_parameters(*ours, *reference);
  torch::optim::AdamW optimizer(trainable(*reference), torch::optim::AdamWOptions(0.01).weight_decay(0));
  zt::Engine engine(ours, config, single_rank());
  const std::vector<bool> boundaries = {false, false, true, false, true, false, false, true};
  for (bool boundary : boundaries) {
    if (boundary) engine.set_gradient_accumulation_boundary(true);
    EXPECT_EQ(engine.next_backward_is_boundary(), boundary);
    auto x = torch::randn({4, 8});
    auto y = torch::randn({4, 4});
    engine.backward(torch::mse_loss(ours->forward(x), y));
    (torch::mse_loss(reference->forward(x), y) / 3.0).backward();
    EXPECT_EQ(engine.step().stepped, boundary);
    if (boundary) {
      optimizer.step();
      optimizer.zero_grad();
    }
  }
  EXPECT_EQ(engine.global_step(), 3);
  auto a = ours->parameters();
  auto b = reference->parameters();
  for (size_t i = 0; i < a.size(); ++i)
    EXPECT_TRUE(torch::allclose(a[i], b[i], 1e-5, 1e-7)) << "parameter " << i;
  engine.backward(torch::mse_loss(ours->forward(torch::randn({4, 8})), torch::randn({4, 4})));
  engine.backward(torch::mse_loss(ours->forward(torch::randn({4, 8})), torch::randn({4, 4})));
  EXPECT_THROW(engine.set_gradient_accumulation_boundary(false), zt::Error);
}

// DeepSpeed's backward(scale_wrt_gas=False): a loss the caller divided by the accumulation count
// itself differentiates to the default's gradients bit for bit, whatever the count: the engine
// leaves it as it is (41: a count whose float reciprocal times the count is not 1).
TEST(Engine, AnAlreadyDividedLossGivesTheDefaultsWeightsBitForBit) {
  for (int accumulation : {3, 41}) {
    auto config = zt::parse_config(R"({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": )" +
                                       std::to_string(accumulation) + R"(, "gradient_clipping": 0,
       "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0}}})",
                                   {}, 1);
    torch::manual_seed(11);
    auto divided_here = std::make_shared<Net>();
    auto divided_by_caller = std::make_shared<Net>();
    copy_parameters(*divided_here, *divided_by_caller);
    zt::Engine a(divided_here, config, single_rank());
    zt::Engine b(divided_by_caller, config, single_rank());
    for (int micro = 0; micro < 2 * accumulation; ++micro) {
      auto x = torch::randn({4, 8});
      auto y = torch::randn({4, 4});
      a.backward(torch::mse_loss(divided_here->forward(x), y));
      b.backward(torch::mse_loss(divided_by_caller->forward(x), y) / double(accumulation),
                 zt::LossDivision::AlreadyDivided);
      const zt::StepResult ra = a.step();
      const zt::StepResult rb = b.step();
      EXPECT_EQ(ra.stepped, rb.stepped);
      // The norm, in double from the float gradients, shows a gradient one ulp off (the weights
      // after AdamW mostly would not).
      EXPECT_EQ(ra.grad_norm, rb.grad_norm) << "accumulation " << accumulation << ", micro-step " << micro;
    }
    EXPECT_EQ(b.global_step(), 2);
    auto p = divided_here->parameters();
    auto q = divided_by_caller->parameters();
    for (size_t i = 0; i < p.size(); ++i)
      EXPECT_TRUE(torch::equal(p[i], q[i])) << "accumulation " << accumulation << ", parameter " << i;
  }
}

TEST(Engine, MatchesTorchSgdWithNesterovMomentum) {
  std::unique_ptr<torch::optim::SGD> opt;
  run_against(R"({"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0,
     "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9, "nesterov": true, "weight_decay": 0.01}}})",
              [&](Net& ref, int) {
                if (!opt)
                  opt = std::make_unique<torch::optim::SGD>(
                      trainable(ref), torch::optim::SGDOptions(0.05).momentum(0.9).nesterov(true).weight_decay(0.01));
                opt->step();
              },
              1e-5);
}

TEST(Engine, MatchesTorchAdamWithL2) {
  std::unique_ptr<torch::optim::Adam> opt;
  run_against(R"({"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0,
     "optimizer": {"type": "Adam", "params": {"lr": 0.01, "adam_w_mode": false, "weight_decay": 0.1}}})",
              [&](Net& ref, int) {
                if (!opt)
                  opt = std::make_unique<torch::optim::Adam>(trainable(ref),
                                                             torch::optim::AdamOptions(0.01).weight_decay(0.1));
                opt->step();
              },
              1e-5);
}

// LAMB against the DeepSpeed FusedLamb formula written with torch ops, per parameter tensor.
TEST(Engine, MatchesLambReferencePerTensor) {
  std::map<const void*, std::pair<torch::Tensor, torch::Tensor>> state;
  const double lr = 0.01, b1 = 0.9, b2 = 0.999, eps = 1e-8, wd = 0.01, lo = 0.01, hi = 10.0;
  run_against(R"({"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0,
     "optimizer": {"type": "Lamb", "params": {"lr": 0.01, "weight_decay": 0.01}}})",
              [&](Net& ref, int step) {
                torch::NoGradGuard g;
                for (auto& p : trainable(ref)) {
                  auto& [m, v] = state[p.unsafeGetTensorImpl()];
                  if (!m.defined()) { m = torch::zeros_like(p); v = torch::zeros_like(p); }
                  m.mul_(b1).add_(p.grad(), 1 - b1);
                  v.mul_(b2).addcmul_(p.grad(), p.grad(), 1 - b2);
                  auto u = m / (v.sqrt() + eps) + wd * p;
                  const double wn = p.norm().item<double>(), un = u.norm().item<double>();
                  const double ratio = (wn == 0 || un == 0) ? 1.0 : std::clamp(wn / un, lo, hi);
                  const double step_size = lr * std::sqrt(1 - std::pow(b2, step)) / (1 - std::pow(b1, step));
                  p.sub_(step_size * ratio * u);
                }
              },
              1e-5);
}

// OneCycle with cycle_momentum sets Adam's betas every step, as DeepSpeed writes them into the
// optimizer's param group: beta1 cycled between cycle_min_mom and cycle_max_mom, beta2 0.99. Bias
// correction uses the current betas, 1 - beta^t, as DeepSpeed's Adam kernels (FusedAdam,
// CPU Adam) do.
TEST(Engine, OneCycleCyclesAdamsBetas) {
  const std::string json = R"({"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0,
     "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
     "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0.002, "cycle_max_lr": 0.01,
                   "cycle_first_step_size": 2, "cycle_min_mom": 0.5, "cycle_max_mom": 0.95}}})";
  const auto config = zt::parse_config(json, {}, 1);
  const zt::LrSchedule schedule(config.scheduler, config.optimizer.lr);
  // The betas of steps 1..5: the constructor's cycle_min_mom, then the cycle 0.725, 0.5 (peak
  // lr), 0.725, 0.95.
  const std::vector<double> beta1 = {0.5, 0.725, 0.5, 0.725, 0.95};
  std::map<const void*, std::pair<torch::Tensor, torch::Tensor>> state;
  run_against(json,
              [&](Net& ref, int step) {
                torch::NoGradGuard g;
                const double lr = schedule.lr_at(step - 1);
                const double b1 = beta1[step - 1], b2 = 0.99, wd = 0.01, eps = 1e-8;
                ASSERT_TRUE(schedule.betas_at(step - 1).has_value());
                EXPECT_NEAR(schedule.betas_at(step - 1)->beta1, b1, 1e-15) << step;
                for (auto& p : trainable(ref)) {
                  auto& [m, v] = state[p.unsafeGetTensorImpl()];
                  if (!m.defined()) { m = torch::zeros_like(p); v = torch::zeros_like(p); }
                  m.mul_(b1).add_(p.grad(), 1 - b1);
                  v.mul_(b2).addcmul_(p.grad(), p.grad(), 1 - b2);
                  const double bias1 = 1 - std::pow(b1, step), bias2 = 1 - std::pow(b2, step);
                  p.mul_(1 - lr * wd);
                  p.sub_(lr / bias1 * m / (v.sqrt() / std::sqrt(bias2) + eps));
                }
              },
              1e-5);
}

// DeepSpeed's OneCycle leaves an optimizer without betas (torch.optim.SGD) its momentum and
// sets only the lr.
TEST(Engine, OneCycleSetsOnlyTheLrOfSgd) {
  const std::string json = R"({"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0,
     "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}},
     "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1,
                   "cycle_first_step_size": 3}}})";
  const auto config = zt::parse_config(json, {}, 1);
  const zt::LrSchedule schedule(config.scheduler, config.optimizer.lr);
  std::unique_ptr<torch::optim::SGD> opt;
  run_against(json,
              [&](Net& ref, int step) {
                if (!opt)
                  opt = std::make_unique<torch::optim::SGD>(trainable(ref), torch::optim::SGDOptions(0.05).momentum(0.9));
                static_cast<torch::optim::SGDOptions&>(opt->param_groups()[0].options()).lr(schedule.lr_at(step - 1));
                opt->step();
              },
              1e-5);
}

TEST(Engine, FrozenParametersGetNoStateAndStayUnchanged) {
  auto config = zt::parse_config("{}", {}, 1);
  auto net = std::make_shared<Net>();
  zt::Engine engine(net, config, single_rank());
  int64_t trainable = 0;
  for (auto& p : net->parameters())
    if (p.requires_grad()) trainable += p.numel();
  // Frozen parameters are not in the layout; the arenas hold the trainable ones plus the
  // alignment padding at the end of the bucket (fewer than 32 elements here).
  EXPECT_EQ(engine.trainable_parameters(), trainable);
  const int64_t padded = engine.layout().total_numel;
  EXPECT_GE(padded, trainable);
  EXPECT_LT(padded, trainable + 32);
  auto bytes = engine.model_state_bytes();
  EXPECT_EQ(bytes.parameters, padded * 4);
  EXPECT_EQ(bytes.gradients, padded * 4);
  EXPECT_EQ(bytes.optimizer_states, padded * 8);
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

// One parameter w with loss sum(c * w) (× inf on the chosen steps): the gradient is c, or
// infinite, so SGD's update w -= lr * c shows the learning rate each step really used.
struct Linear1 : torch::nn::Module {
  torch::Tensor w;
  Linear1() { w = register_parameter("w", torch::ones({4})); }
};

// As DeepSpeed, a step skipped for overflow leaves the schedule where it was: the lr used by
// every step is the schedule at the number of steps applied before it, learning_rate() agrees,
// and a checkpoint resumes on the same point of the curve.
TEST(Engine, SkippedStepsDoNotAdvanceTheSchedule) {
  const std::set<int> overflow_steps{2, 3, 7};
  const std::vector<double> c{0.5, -0.25, 0.125, 0.375};
  for (std::string precision : {"fp32", "fp16"}) {
    const std::string json = R"({"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0,
       "optimizer": {"type": "SGD", "params": {"lr": 0.08}},
       "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.08,
                     "warmup_num_steps": 16, "warmup_type": "linear"}})" +
                             std::string(precision == "fp16" ? R"(, "fp16": {"enabled": true})" : "") + "}";
    const auto config = zt::parse_config(json, {}, 1);
    const zt::LrSchedule schedule(config.scheduler, config.optimizer.lr);
    auto net = std::make_shared<Linear1>();
    zt::Engine engine(net, config, single_rank());
    const torch::Tensor coefficients = torch::tensor(c, torch::kFloat);
    auto run_step = [&](zt::Engine& e, Linear1& n, bool overflow) {
      auto loss = (n.w.to(torch::kFloat) * coefficients).sum() * (overflow ? INFINITY : 1.0);
      e.backward(loss);
      return e.step();
    };
    int64_t applied = 0;
    for (int step = 0; step < 12; ++step) {
      const bool overflow = overflow_steps.count(step) > 0;
      const double expected = schedule.lr_at(applied);
      EXPECT_DOUBLE_EQ(engine.learning_rate(), expected) << precision << " step " << step;
      const torch::Tensor before = net->w.detach().to(torch::kFloat).clone();
      const auto r = run_step(engine, *net, overflow);
      EXPECT_EQ(r.skipped, overflow) << precision << " step " << step;
      EXPECT_DOUBLE_EQ(r.lr, expected) << precision << " step " << step;
      const torch::Tensor moved = net->w.detach().to(torch::kFloat) - before;
      if (overflow) {
        EXPECT_TRUE(torch::equal(moved, torch::zeros({4}))) << precision << " step " << step;
      } else {
        ++applied;
        // fp32: the update itself shows the lr; fp16 rounds the working weights too coarsely.
        if (precision == "fp32")
          EXPECT_TRUE(torch::allclose(moved, -expected * coefficients, 0.0, 1e-6))
              << "step " << step << " moved " << moved << " expected lr " << expected;
      }
    }
    EXPECT_EQ(engine.global_step(), 12);
    EXPECT_EQ(engine.skipped_steps(), int64_t(overflow_steps.size()));
    ASSERT_LT(applied, schedule.warmup_steps()) << "the test must end inside the warm-up to see the difference";

    // A resumed engine continues at the same point of the schedule.
    const std::string dir = zt::testing::make_temp_dir("lr-skipped-" + precision);
    engine.save_checkpoint(dir, "t");
    auto resumed_net = std::make_shared<Linear1>();
    zt::Engine resumed(resumed_net, config, single_rank());
    resumed.load_checkpoint(dir);
    EXPECT_EQ(resumed.skipped_steps(), engine.skipped_steps());
    EXPECT_DOUBLE_EQ(resumed.learning_rate(), schedule.lr_at(applied)) << precision;
    EXPECT_DOUBLE_EQ(run_step(resumed, *resumed_net, false).lr, run_step(engine, *net, false).lr) << precision;
  }
}

}  // namespace

namespace {

// Parameter groups: a.weight in the configuration's group (lr 0.01, weight decay 0.1), the biases
// without weight decay, b.weight with its own lr and weight decay; torch's AdamW with the same
// three groups is the reference.
// torch's AdamW over the groups the engine tests give (weight decay 0.1 for a.weight, 0 for the
// biases, 0.3 for b.weight), with the learning rate `lrs[g]` for group g.
torch::optim::AdamW torch_groups(Net& reference, const std::vector<double>& lrs) {
  std::vector<torch::optim::OptimizerParamGroup> groups;
  const std::vector<std::pair<std::vector<torch::Tensor>, double>> members = {
      {{reference.a->weight}, 0.1}, {{reference.a->bias, reference.b->bias}, 0.0}, {{reference.b->weight}, 0.3}};
  for (size_t g = 0; g < members.size(); ++g)
    groups.emplace_back(members[g].first, std::make_unique<torch::optim::AdamWOptions>(
                                              torch::optim::AdamWOptions(lrs[g]).weight_decay(members[g].second)));
  return torch::optim::AdamW(std::move(groups), torch::optim::AdamWOptions(lrs[0]));
}

void expect_groups_match_torch(int stage) {
  const std::string json = R"({"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0,
     "zero_optimization": {"stage": )" + std::to_string(stage) + R"(, "reduce_bucket_size": 50},
     "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.1}}})";
  auto config = zt::parse_config(json, {}, 1);
  torch::manual_seed(7);
  auto ours = std::make_shared<Net>();
  auto reference = std::make_shared<Net>();
  copy_parameters(*ours, *reference);
  std::vector<zt::ParameterGroup> groups = {{{"a.bias", "b.bias"}, std::nullopt, 0.0}, {{"b.weight"}, 0.02, 0.3}};
  zt::Engine engine(ours, config, single_rank(), groups);
  torch::optim::AdamW optimizer = torch_groups(*reference, {0.01, 0.01, 0.02});
  for (int step = 0; step < 5; ++step) {
    auto x = torch::randn({4, 8});
    auto y = torch::randn({4, 4});
    optimizer.zero_grad();
    engine.backward(torch::mse_loss(ours->forward(x), y));
    torch::mse_loss(reference->forward(x), y).backward();
    EXPECT_TRUE(engine.step().stepped);
    optimizer.step();
  }
  auto a = ours->named_parameters();
  auto b = reference->named_parameters();
  for (const auto& item : a) {
    if (!item.value().requires_grad()) continue;
    const torch::Tensor& want = b[item.key()];
    auto rel = ((item.value() - want).abs().max() / want.abs().max().clamp_min(1e-12)).item<double>();
    EXPECT_LT(rel, 1e-5) << "stage " << stage << " parameter " << item.key();
  }
}

}  // namespace

TEST(Engine, ParameterGroupsHaveTheirOwnLearningRateAndWeightDecayAtEveryStage) {
  for (int stage = 0; stage <= 3; ++stage) expect_groups_match_torch(stage);
}

TEST(Engine, ParameterGroupsNamingNoParameterOrOneTwiceAreRefused) {
  auto config = zt::parse_config(R"({"train_micro_batch_size_per_gpu": 4})", {}, 1);
  auto comm = single_rank();
  auto expect_refused = [&](std::vector<zt::ParameterGroup> groups, const std::string& what) {
    auto net = std::make_shared<Net>();
    torch::Tensor before = net->a->weight.detach().clone();
    try {
      zt::Engine engine(net, config, comm, std::move(groups));
      ADD_FAILURE() << "expected zt::ConfigError for " << what;
    } catch (const zt::ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
    EXPECT_TRUE(torch::equal(net->a->weight.detach(), before)) << "the model changed";
  };
  expect_refused({{{"a.weight", "nope"}, 0.1, std::nullopt}}, "found 'nope'");
  expect_refused({{{"frozen"}, 0.1, std::nullopt}}, "found 'frozen'");
  expect_refused({{{"a.bias"}, std::nullopt, 0.0}, {{"a.bias"}, std::nullopt, 0.1}}, "'a.bias' is in parameter groups 0 and 1");
  expect_refused({{{"a.bias"}, -1.0, std::nullopt}}, "expected lr >= 0");
}

// A client's schedule (a torch lr_scheduler driving DeepSpeed's optimizer from Python): the rates
// given before a step are that step's, per parameter group, in place of the configuration's
// schedule and the groups' own lr, at every stage: equal to torch's AdamW given the same rates.
TEST(Engine, ClientRatesReplaceTheScheduleFromTheNextStep) {
  for (int stage = 0; stage <= 3; ++stage) {
    const std::string json = R"({"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0,
       "zero_optimization": {"stage": )" + std::to_string(stage) + R"(, "reduce_bucket_size": 50},
       "optimizer": {"type": "AdamW", "params": {"lr": 0, "weight_decay": 0.1}},
       "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 0.5, "warmup_num_steps": 3}}})";
    const auto config = zt::parse_config(json, {}, 1);
    torch::manual_seed(7);
    auto ours = std::make_shared<Net>();
    auto reference = std::make_shared<Net>();
    copy_parameters(*ours, *reference);
    std::vector<zt::ParameterGroup> groups = {{{"a.bias", "b.bias"}, std::nullopt, 0.0}, {{"b.weight"}, 0.02, 0.3}};
    zt::Engine engine(ours, config, single_rank(), groups);
    torch::optim::AdamW optimizer = torch_groups(*reference, {0.0, 0.0, 0.0});
    for (int step = 0; step < 6; ++step) {
      // A warm-up from 0 then a decay, each group with its own peak.
      const double shape = std::min(1.0, step / 2.0) * (6 - step) / 6.0;
      const std::vector<double> rates{0.01 * shape, 0.005 * shape, 0.03 * shape};
      engine.set_learning_rates(rates);
      EXPECT_DOUBLE_EQ(engine.learning_rate(), rates[0]) << "stage " << stage << " step " << step;
      for (size_t g = 0; g < rates.size(); ++g)
        static_cast<torch::optim::AdamWOptions&>(optimizer.param_groups()[g].options()).lr(rates[g]);
      auto x = torch::randn({4, 8});
      auto y = torch::randn({4, 4});
      optimizer.zero_grad();
      engine.backward(torch::mse_loss(ours->forward(x), y));
      torch::mse_loss(reference->forward(x), y).backward();
      const zt::StepResult r = engine.step();
      EXPECT_TRUE(r.stepped);
      EXPECT_DOUBLE_EQ(r.lr, rates[0]) << "stage " << stage << " step " << step;
      optimizer.step();
    }
    auto b = reference->named_parameters();
    for (const auto& item : ours->named_parameters()) {
      if (!item.value().requires_grad()) continue;
      const torch::Tensor& want = b[item.key()];
      const double rel = ((item.value() - want).abs().max() / want.abs().max().clamp_min(1e-12)).item<double>();
      EXPECT_LT(rel, 1e-5) << "stage " << stage << " parameter " << item.key();
    }
    EXPECT_THROW(engine.set_learning_rates({0.01}), zt::ConfigError);  // three groups
    EXPECT_THROW(engine.set_learning_rates({0.01, -1.0, 0.02}), zt::ConfigError);
    EXPECT_THROW(engine.set_learning_rates({0.01, std::nan(""), 0.02}), zt::ConfigError);
  }
}
