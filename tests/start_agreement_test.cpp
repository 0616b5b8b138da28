// Ranks that start with different configurations or models are refused when the engine is built,
// naming the first key that differs, instead of training something else on each rank.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "support/multirank.h"
#include "zerotrain/comm/comm.h"
#include "zerotrain/config/config.h"
#include "zerotrain/zero/engine.h"
#include "zerotrain/error.h"

namespace {

using zt::testing::is_rank_process;
using zt::testing::run_ranks;
using zt::testing::test_rank;

std::shared_ptr<zt::Communicator> rank_communicator() {
  return zt::make_communicator(zt::rendezvous_from_environment(), zt::comm_options_from_environment());
}

zt::TrainConfig config_of(const std::string& zero, const std::string& extra = "") {
  return zt::parse_config(R"({"train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
    "zero_optimization": )" + zero + extra + "}",
                          {}, 2);
}

std::shared_ptr<torch::nn::Sequential> model_of(int64_t hidden) {
  torch::manual_seed(0);
  return std::make_shared<torch::nn::Sequential>(torch::nn::Linear(4, hidden), torch::nn::Linear(hidden, 2));
}

// Builds an engine on this rank and returns the ConfigError's message ("" when none was thrown).
std::string engine_error(const zt::TrainConfig& config, int64_t hidden) {
  auto comm = rank_communicator();
  try {
    auto model = model_of(hidden);
    zt::Engine engine(model->ptr(), config, comm);
    return "";
  } catch (const zt::ConfigError& e) {
    return e.what();
  }
}

void one_step(zt::Engine& engine, torch::nn::Sequential& model) {
  auto loss = model->forward(torch::ones({2, 4})).pow(2).sum();
  engine.backward(loss);
  engine.step();
}

}  // namespace

TEST(StartAgreement, RanksWithDifferentStagesAreRefusedNamingTheKey) {
  if (is_rank_process()) {
    const int stage = test_rank() == 0 ? 1 : 2;
    const std::string message = engine_error(config_of(R"({"stage": )" + std::to_string(stage) + "}"), 8);
    // Every rank fails with the same line, which names the key and both values.
    EXPECT_NE(message.find("zero_optimization.stage"), std::string::npos) << message;
    EXPECT_NE(message.find("rank 1 has zero_optimization.stage = 2 where rank 0 has 1"), std::string::npos) << message;
    return;
  }
  auto r = run_ranks(2, "StartAgreement.RanksWithDifferentStagesAreRefusedNamingTheKey");
  EXPECT_TRUE(r.all_succeeded()) << r.describe();
}

TEST(StartAgreement, RanksWithDifferentModelsAreRefusedNamingTheParameter) {
  if (is_rank_process()) {
    const std::string message = engine_error(config_of(R"({"stage": 2})"), test_rank() == 0 ? 8 : 16);
    EXPECT_NE(message.find("ranks started with different models"), std::string::npos) << message;
    EXPECT_NE(message.find("parameter '0.weight' = [16, 4] Float where rank 0 has [8, 4] Float"), std::string::npos)
        << message;
    return;
  }
  auto r = run_ranks(2, "StartAgreement.RanksWithDifferentModelsAreRefusedNamingTheParameter");
  EXPECT_TRUE(r.all_succeeded()) << r.describe();
}

// What names a rank's own files and threads may differ (each node mounts its own disks).
TEST(StartAgreement, RankLocalPathsAndThreadsMayDiffer) {
  if (is_rank_process()) {
    const std::string dir = "/tmp/zt-agreement-rank" + std::to_string(test_rank());
    const auto config =
        config_of(R"({"stage": 1})", R"(, "train": {"threads": )" + std::to_string(test_rank() + 1) +
                                         R"(, "log_dir": ")" + dir + R"("})");
    auto comm = rank_communicator();
    auto model = model_of(8);
    const auto before = (*model)[0]->as<torch::nn::Linear>()->weight.detach().clone();
    zt::Engine engine(model->ptr(), config, comm);
    one_step(engine, *model);
    EXPECT_FALSE(torch::equal(before, (*model)[0]->as<torch::nn::Linear>()->weight.detach()));
    return;
  }
  auto r = run_ranks(2, "StartAgreement.RankLocalPathsAndThreadsMayDiffer");
  EXPECT_TRUE(r.all_succeeded()) << r.describe();
}
