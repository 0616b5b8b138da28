// Stages 1 and 2 against stage 0 on several ranks (one process per rank): loss parity in fp32,
// a bf16 tolerance, fp16 overflow skipping, and the model-state bytes against design §2.
#include <gtest/gtest.h>

#include <cmath>

#include "support/multirank.h"
#include "zerotrain/comm.h"
#include "zerotrain/config.h"
#include "zerotrain/engine.h"
#include "zerotrain/layout.h"
#include "zerotrain/memory.h"
#include "zerotrain/models/gpt.h"

namespace {

using zt::testing::is_rank_process;
using zt::testing::run_ranks;

std::shared_ptr<zt::Communicator> rank_communicator() {
  return zt::make_communicator(zt::rendezvous_from_environment(), zt::comm_options_from_environment());
}

struct RunOptions {
  int stage = 0;
  std::string precision = "fp32";
  bool overlap_comm = false;
  int64_t bucket_size = 500'000'000;
  int steps = 10;
  int overflow_micro_step = -1;  // on rank 0, make one gradient element overflow (fp16)
  std::string optimizer = "AdamW";
};

struct RunResult {
  std::vector<double> losses;  // this rank's loss, per optimizer step (mean of the window)
  std::vector<int> skipped;
  std::vector<double> scales;
  std::vector<double> grad_norms;
  torch::Tensor final_parameters;  // all trainable parameters, fp32, concatenated
  zt::ModelStateBytes bytes, formula;
};

zt::TrainConfig make_config(const RunOptions& o, int world) {
  std::string json = R"({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
    "gradient_clipping": 0.05,
    "optimizer": {"type": ")" + o.optimizer + R"(", "params": {"lr": 0.003, "weight_decay": 0.01}},
    "zero_optimization": {"stage": )" + std::to_string(o.stage) +
                     R"(, "overlap_comm": )" + (o.overlap_comm ? "true" : "false") +
                     R"(, "reduce_bucket_size": )" + std::to_string(o.bucket_size) + "}";
  if (o.precision == "bf16") json += R"(, "bf16": {"enabled": true})";
  if (o.precision == "fp16") json += R"(, "fp16": {"enabled": true})";
  return zt::parse_config(json + "}", {}, world);
}

// The tiny GPT from a fixed seed with one frozen parameter (the position embedding), trained
// on batches that depend only on (rank, step, micro-step).
RunResult train(std::shared_ptr<zt::Communicator> comm, const RunOptions& o) {
  const int rank = comm->rank(), world = comm->world_size();
  const auto config = make_config(o, world);
  torch::manual_seed(7);
  auto gpt_config = zt::gpt_preset("tiny");
  auto model = zt::GPT(gpt_config);
  model->wpe->weight.set_requires_grad(false);
  zt::Engine engine(model.ptr(), config, comm);
  RunResult result;
  int micro = 0;
  for (int step = 0; step < o.steps; ++step) {
    double loss_sum = 0;
    zt::StepResult r;
    for (int a = 0; a < 2; ++a, ++micro) {
      auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 * rank + 10 * step + a);
      auto tokens = torch::randint(0, gpt_config.vocab_size, {2, 17}, gen, torch::kLong);
      auto loss = model->loss(tokens.narrow(1, 0, 16), tokens.narrow(1, 1, 16));
      loss_sum += loss.item<double>();
      if (micro == o.overflow_micro_step && rank == 0)
        // 1e6 × loss scale 2^16 does not fit in fp16: one gradient element becomes inf.
        loss = loss + model->wte->weight[3][5].to(torch::kFloat) * 1e6;
      engine.backward(loss);
      r = engine.step();
    }
    EXPECT_TRUE(r.boundary);
    result.losses.push_back(loss_sum / 2);
    result.skipped.push_back(r.skipped ? 1 : 0);
    result.scales.push_back(r.loss_scale);
    result.grad_norms.push_back(r.grad_norm);
  }
  std::vector<torch::Tensor> flat;
  for (auto& p : model->parameters())
    if (p.requires_grad()) flat.push_back(p.detach().to(torch::kFloat).reshape({-1}));
  result.final_parameters = torch::cat(flat);
  result.bytes = engine.model_state_bytes();
  result.formula = zt::model_state_formula(engine.trainable_parameters(), world, config);
  return result;
}

void expect_losses_close(const RunResult& a, const RunResult& b, double tolerance, const std::string& what) {
  ASSERT_EQ(a.losses.size(), b.losses.size());
  for (size_t i = 0; i < a.losses.size(); ++i)
    EXPECT_LE(std::abs(a.losses[i] - b.losses[i]) / std::abs(a.losses[i]), tolerance)
        << what << " step " << i << ": " << a.losses[i] << " vs " << b.losses[i];
}

void expect_ranks_pass(const std::string& filter, std::vector<int> worlds) {
  for (int world : worlds) {
    auto r = run_ranks(world, filter, {}, std::chrono::seconds(240));
    EXPECT_TRUE(r.all_succeeded()) << filter << " on " << world << " ranks failed:\n" << r.describe();
  }
}

}  // namespace

// fp32: stages 1 and 2 (one bucket, and small buckets with and without overlap) equal stage 0.
TEST(ZeroParity, Fp32StagesOneAndTwoEqualStageZero) {
  if (is_rank_process()) {
    auto comm = rank_communicator();
    const auto reference = train(comm, {.stage = 0});
    for (double loss : reference.losses) ASSERT_TRUE(std::isfinite(loss));
    for (double norm : reference.grad_norms) ASSERT_GT(norm, 0.05) << "clipping must be active on every step";
    for (int stage : {1, 2}) {
      for (int64_t bucket : {int64_t(500'000'000), int64_t(5000)}) {
        for (bool overlap : {false, true}) {
          if (stage == 1 && overlap) continue;  // overlap_comm only changes stage 2
          const auto run = train(comm, {.stage = stage, .overlap_comm = overlap, .bucket_size = bucket});
          const std::string what = "stage " + std::to_string(stage) + " bucket " + std::to_string(bucket) +
                                   (overlap ? " overlap" : "");
          expect_losses_close(reference, run, 1e-5, what);
          // The global norm from owned shards and one all-reduce equals stage 0's.
          for (size_t i = 0; i < run.grad_norms.size(); ++i)
            EXPECT_NEAR(run.grad_norms[i], reference.grad_norms[i], 1e-5 * reference.grad_norms[i]) << what << " " << i;
          EXPECT_LE((run.final_parameters - reference.final_parameters).abs().max().item<double>(), 1e-5) << what;
        }
      }
    }
    return;
  }
  expect_ranks_pass("ZeroParity.Fp32StagesOneAndTwoEqualStageZero", {1, 2, 3});
}

// LAMB's per-tensor trust ratios need norms summed across the ranks holding pieces of a tensor.
TEST(ZeroParity, LambAndSgdShardedEqualStageZero) {
  if (is_rank_process()) {
    auto comm = rank_communicator();
    for (std::string optimizer : {"Lamb", "SGD"}) {
      const auto reference = train(comm, {.stage = 0, .bucket_size = 5000, .steps = 4, .optimizer = optimizer});
      const auto sharded = train(comm, {.stage = 2, .bucket_size = 5000, .steps = 4, .optimizer = optimizer});
      expect_losses_close(reference, sharded, 1e-5, optimizer);
      EXPECT_LE((sharded.final_parameters - reference.final_parameters).abs().max().item<double>(), 1e-5)
          << optimizer;
    }
    return;
  }
  expect_ranks_pass("ZeroParity.LambAndSgdShardedEqualStageZero", {3});
}

// bf16 working weights with fp32 masters: every stage stays within 2% of fp32 training over 10
// steps, and the stages agree with each other within 0.5%.
TEST(ZeroParity, Bf16StaysWithinTolerance) {
  if (is_rank_process()) {
    auto comm = rank_communicator();
    const auto fp32 = train(comm, {.stage = 0});
    const auto bf16_stage0 = train(comm, {.stage = 0, .precision = "bf16"});
    expect_losses_close(fp32, bf16_stage0, 2e-2, "bf16 stage 0 vs fp32");
    for (int stage : {1, 2}) {
      const auto run = train(comm, {.stage = stage, .precision = "bf16", .bucket_size = 5000});
      expect_losses_close(fp32, run, 2e-2, "bf16 stage " + std::to_string(stage) + " vs fp32");
      expect_losses_close(bf16_stage0, run, 5e-3, "bf16 stage " + std::to_string(stage) + " vs bf16 stage 0");
    }
    return;
  }
  expect_ranks_pass("ZeroParity.Bf16StaysWithinTolerance", {2, 3});
}

// fp16: a gradient overflow on one rank, in one micro-step, skips exactly that optimizer step on
// every rank and at every stage; the loss scale follows the same sequence.
TEST(ZeroParity, Fp16OverflowSkipsTheSameStepEverywhere) {
  if (is_rank_process()) {
    auto comm = rank_communicator();
    const int overflow_micro_step = 7;  // optimizer step 3 (0-based), its second micro-step
    const auto reference = train(comm, {.stage = 0, .precision = "fp16", .steps = 6,
                                        .overflow_micro_step = overflow_micro_step});
    const std::vector<int> expected_skips{0, 0, 0, 1, 0, 0};
    EXPECT_EQ(reference.skipped, expected_skips);
    // Hysteresis 2: the first overflow only uses up one unit of it, the scale stays 2^16.
    EXPECT_EQ(reference.scales, std::vector<double>(6, 65536.0));
    for (int stage : {1, 2}) {
      const auto run = train(comm, {.stage = stage, .precision = "fp16", .bucket_size = 5000, .steps = 6,
                                    .overflow_micro_step = overflow_micro_step});
      EXPECT_EQ(run.skipped, expected_skips) << "stage " << stage;
      EXPECT_EQ(run.scales, reference.scales) << "stage " << stage;
      expect_losses_close(reference, run, 5e-3, "fp16 stage " + std::to_string(stage));
    }
    return;
  }
  expect_ranks_pass("ZeroParity.Fp16OverflowSkipsTheSameStepEverywhere", {2, 3});
}

// Per-rank model-state bytes equal design §2's formula up to the layout's padding (at most 1%).
TEST(ZeroMemory, ModelStateBytesMatchTheFormula) {
  if (is_rank_process()) {
    auto comm = rank_communicator();
    for (std::string precision : {"fp32", "bf16"}) {
      for (int stage : {0, 1, 2}) {
        const auto run = train(comm, {.stage = stage, .precision = precision, .steps = 1});
        const std::string what = precision + " stage " + std::to_string(stage);
        const int64_t measured[3] = {run.bytes.parameters, run.bytes.gradients, run.bytes.optimizer_states};
        const int64_t formula[3] = {run.formula.parameters, run.formula.gradients, run.formula.optimizer_states};
        for (int role = 0; role < 3; ++role) {
          EXPECT_GE(measured[role], formula[role]) << what << " role " << role;
          EXPECT_LE(measured[role], formula[role] * 1.01) << what << " role " << role;
        }
        // Spot-check the formula itself against design §2 for Adam.
        const int64_t psi = run.final_parameters.numel();
        const int world = comm->world_size();
        if (precision == "bf16" && stage == 2)
          EXPECT_EQ(run.formula.total(), 2 * psi + 2 * psi / world + 12 * psi / world);
        if (precision == "fp32" && stage == 1) EXPECT_EQ(run.formula.total(), 4 * psi + 4 * psi + 8 * psi / world);
      }
    }
    return;
  }
  expect_ranks_pass("ZeroMemory.ModelStateBytesMatchTheFormula", {1, 2, 3, 4});
}

namespace {

// Registration order a, b, c, unused, d, but forward runs b, a, c, d (and d again on b's output),
// so backward produces gradients in the order d, c, a, b: with 120-element buckets the layout
// puts b's bias with c's weight and b's weight with a's bias, so those buckets are launched before
// b's gradients come and must be refilled and reduced again; `unused` never gets a gradient.
struct Tangled : torch::nn::Module {
  torch::nn::Linear a{nullptr}, b{nullptr}, c{nullptr}, unused{nullptr}, d{nullptr};
  Tangled() {
    a = register_module("a", torch::nn::Linear(10, 10));
    b = register_module("b", torch::nn::Linear(10, 10));
    c = register_module("c", torch::nn::Linear(10, 10));
    unused = register_module("unused", torch::nn::Linear(10, 10));
    d = register_module("d", torch::nn::Linear(10, 3));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h1 = torch::tanh(b(x));
    auto h3 = torch::tanh(c(torch::tanh(a(h1))));
    return d(h3) + d(h1) * 0.5;
  }
};

torch::Tensor train_tangled(std::shared_ptr<zt::Communicator> comm, int stage, bool overlap, const std::string& type) {
  const int world = comm->world_size(), rank = comm->rank();
  auto config = zt::parse_config(R"({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3,
      "gradient_clipping": 0.5, "optimizer": {"type": ")" + type + R"(", "params": {"lr": 0.01, "weight_decay": 0.1}},
      "zero_optimization": {"stage": )" + std::to_string(stage) + R"(, "reduce_bucket_size": 120, "overlap_comm": )" +
                                     (overlap ? "true" : "false") + "}}",
                                 {}, world);
  torch::manual_seed(5);
  auto net = std::make_shared<Tangled>();
  zt::Engine engine(net, config, comm);
  for (int step = 0; step < 4; ++step)
    for (int micro = 0; micro < 3; ++micro) {
      auto gen = at::make_generator<at::CPUGeneratorImpl>(100 * rank + 10 * step + micro);
      auto x = torch::randn({4, 10}, gen);
      engine.backward(net->forward(x).pow(2).mean());
      engine.step();
    }
  std::vector<torch::Tensor> flat;
  for (auto& p : net->parameters()) flat.push_back(p.detach().reshape({-1}));
  return torch::cat(flat);
}

}  // namespace

// Gradients out of bucket order and a parameter without gradient: buckets are launched early,
// refilled and reduced again, and the result still equals stage 0.
TEST(ZeroParity, OutOfOrderAndUnusedGradientsEqualStageZero) {
  if (is_rank_process()) {
    auto comm = rank_communicator();
    for (std::string type : {"AdamW", "SGD"}) {
      const auto reference = train_tangled(comm, 0, false, type);
      for (auto [stage, overlap] : std::vector<std::pair<int, bool>>{{1, false}, {2, false}, {2, true}}) {
        const auto run = train_tangled(comm, stage, overlap, type);
        EXPECT_LE((run - reference).abs().max().item<double>(), 1e-6)
            << type << " stage " << stage << (overlap ? " overlap" : "");
      }
    }
    return;
  }
  expect_ranks_pass("ZeroParity.OutOfOrderAndUnusedGradientsEqualStageZero", {2, 3});
}
