// Checkpoints across tensor-parallel sizes (docs/checkpoint.md "Tensor-parallel slices"): the
// split GPT trained on the 2-D grid (T = 2) saves, the unsplit GPT on the same ranks (T = 1)
// loads it, trains on and saves, and the split GPT loads both; at stages 1 and 3 and with the
// optimizer states on NVMe, on 2 and 4 ranks. Every loaded master equals the saved one bit for
// bit (the whole tensor at T = 1, the slice at T = 2, the export's whole tensor both ways), and
// the losses of the continued runs stay within 2e-5 of a run that never stopped.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>
#include <filesystem>

#include "checkpoint/checkpoint.h"
#include "support/multirank.h"
#include "support/process.h"
#include "support/tensor_split.h"
#include "zerotrain/zero/blocks.h"
#include "zerotrain/comm/comm.h"
#include "zerotrain/config/config.h"
#include "zerotrain/zero/engine.h"
#include "zerotrain/models/gpt.h"

namespace {

namespace fs = std::filesystem;
using zt::testing::is_rank_process;
using zt::testing::run_ranks;
using zt::testing::slice_of;

constexpr int64_t kGlobalBatch = 4, kTokens = 16;
constexpr int kLeg = 3;  // steps between checkpoints

zt::TrainConfig config_for(int stage, int data_world, const std::string& nvme) {
  const std::string offload =
      nvme.empty() ? "" : R"(, "offload_optimizer": {"device": "nvme", "nvme_path": ")" + nvme + R"("})";
  return zt::parse_config(R"({"train_micro_batch_size_per_gpu": )" + std::to_string(kGlobalBatch / data_world) +
                              R"(, "gradient_accumulation_steps": 1, "gradient_clipping": 0.3,
      "optimizer": {"type": "AdamW", "params": {"lr": 0.003, "weight_decay": 0.01}},
      "zero_optimization": {"stage": )" + std::to_string(stage) +
                              R"(, "reduce_bucket_size": 20000, "stage3_param_persistence_threshold": 200)" + offload +
                              "}}",
                          {}, data_world);
}

// Steps [first, last) on the batches every grid shares (each data-parallel rank its rows).
std::vector<double> train(zt::GPT& model, zt::Engine& engine, zt::Communicator& data, int first, int last) {
  const int64_t micro = kGlobalBatch / data.world_size();
  std::vector<double> losses;
  for (int step = first; step < last; ++step) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(500 + step);
    const at::Tensor tokens = torch::randint(0, 256, {kGlobalBatch, kTokens + 1}, gen, torch::kLong)
                                  .narrow(0, data.rank() * micro, micro);
    const at::Tensor loss = model->loss(tokens.narrow(1, 0, kTokens), tokens.narrow(1, 1, kTokens));
    at::Tensor global = loss.detach().reshape({1}).to(torch::kDouble);
    data.all_reduce(global, zt::ReduceOp::Avg, "test.loss").wait();
    losses.push_back(global.item<double>());
    engine.backward(loss);
    EXPECT_TRUE(engine.step().stepped);
  }
  return losses;
}

// Every master of `engine` equals the checkpoint's whole tensor (its slice for a split one).
void expect_masters_equal_checkpoint(zt::GPT& model, zt::Engine& engine, const fs::path& dir, const std::string& tag) {
  zt::CheckpointModel saved(dir, tag);
  int compared = 0;
  for (const auto& item : model->named_parameters()) {
    const at::Tensor whole = saved.read(item.key());
    const auto split = zt::tensor_split_of(item.value());
    const at::Tensor expected = split ? slice_of(whole, *split) : whole;
    EXPECT_TRUE(torch::equal(engine.master_parameter(item.key()), expected)) << tag << ": " << item.key();
    ++compared;
  }
  EXPECT_EQ(compared, int(saved.tensors().size()));
}

void across_tensor_parallel_sizes(const std::shared_ptr<zt::Communicator>& world, const zt::ProcessGrid& grid,
                                  int stage, bool on_nvme) {
  SCOPED_TRACE("stage " + std::to_string(stage) + (on_nvme ? ", optimizer states on NVMe" : ""));
  const fs::path root = fs::path(std::getenv("ZT_TP_CHECKPOINT_DIR")) /
                        ("stage" + std::to_string(stage) + (on_nvme ? "-nvme" : "") + "-of-" +
                         std::to_string(world->world_size()));
  const fs::path dir = root / "checkpoints";
  auto nvme = [&](const std::string& leg) {
    if (!on_nvme) return std::string();
    const fs::path path = root / ("swap-" + leg + "-" + std::to_string(world->rank()));
    fs::create_directories(path);
    return path.string();
  };
  const zt::GPTConfig shape = zt::gpt_preset("small");
  auto build = [&](uint64_t seed, const std::shared_ptr<zt::Communicator>& tensor, zt::Communicator& data) {
    torch::manual_seed(seed);
    std::optional<zt::ShardedConstruction> sharded;
    if (stage == 3) sharded.emplace(data.rank(), data.world_size());
    return zt::GPT(shape, tensor);
  };

  // The run that never stops: T = 1 over every rank.
  std::vector<double> straight;
  {
    zt::GPT model = build(17, nullptr, *world);
    zt::Engine engine(model.ptr(), config_for(stage, world->world_size(), nvme("straight")), world);
    straight = train(model, engine, *world, 0, 3 * kLeg);
  }
  auto expect_continues = [&](const std::vector<double>& losses, int first, const char* leg) {
    for (size_t i = 0; i < losses.size(); ++i)
      EXPECT_NEAR(losses[i], straight[first + i], 2e-5 * straight[first + i]) << leg << " step " << first + i;
  };
  {  // T = 2 from the start; saves.
    zt::GPT model = build(17, grid.tensor, *grid.data);
    zt::Engine engine(model.ptr(), config_for(stage, grid.data->world_size(), nvme("a")), grid.data);
    expect_continues(train(model, engine, *grid.data, 0, kLeg), 0, "T = 2");
    engine.save_checkpoint(dir.string(), "split");
    expect_masters_equal_checkpoint(model, engine, dir, "split");
  }
  {  // T = 1 (other initial weights, which the load replaces), from the split checkpoint.
    zt::GPT model = build(99, nullptr, *world);
    zt::Engine engine(model.ptr(), config_for(stage, world->world_size(), nvme("b")), world);
    engine.load_checkpoint(dir.string(), "split");
    expect_masters_equal_checkpoint(model, engine, dir, "split");
    expect_continues(train(model, engine, *world, kLeg, 2 * kLeg), kLeg, "T = 1 resumed");
    engine.save_checkpoint(dir.string(), "whole");
  }
  {  // T = 2 again: the split checkpoint as saved, then the whole one.
    zt::GPT model = build(98, grid.tensor, *grid.data);
    zt::Engine engine(model.ptr(), config_for(stage, grid.data->world_size(), nvme("c")), grid.data);
    engine.load_checkpoint(dir.string(), "split");
    expect_masters_equal_checkpoint(model, engine, dir, "split");
    engine.load_checkpoint(dir.string(), "whole");
    expect_masters_equal_checkpoint(model, engine, dir, "whole");
    expect_continues(train(model, engine, *grid.data, 2 * kLeg, 3 * kLeg), 2 * kLeg, "T = 2 resumed");
  }
}

TEST(TensorParallelCheckpoint, ResumesAcrossTensorParallelSizes) {
  if (is_rank_process()) {
    at::set_num_threads(1);
    auto world = zt::make_communicator(zt::rendezvous_from_environment(), zt::comm_options_from_environment());
    const zt::ProcessGrid grid = zt::make_process_grid(world, 2);
    across_tensor_parallel_sizes(world, grid, 1, false);
    across_tensor_parallel_sizes(world, grid, 3, false);
    across_tensor_parallel_sizes(world, grid, 2, true);
    return;
  }
  const std::string dir = zt::testing::make_temp_dir("tp-checkpoint");
  for (int world : {2, 4}) {
    // On 4 ranks the pieces are read in chunks of 1024 elements, so that runs cross the chunks.
    auto r = run_ranks(world, "TensorParallelCheckpoint.ResumesAcrossTensorParallelSizes",
                       {{"ZT_COMM_TIMEOUT_SECONDS", "120"},
                        {"ZT_TP_CHECKPOINT_DIR", dir},
                        {"ZT_CHECKPOINT_CHUNK_BYTES", world == 4 ? "4096" : ""}},
                       std::chrono::seconds(240));
    EXPECT_TRUE(r.all_succeeded()) << "T = 2 x DP = " << world / 2 << " and DP = " << world << ":\n" << r.describe();
  }
}

}  // namespace
