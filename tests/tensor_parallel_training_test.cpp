// Training on the 2-D grid (zerotrain/comm/comm.h make_process_grid): the GPT split over a tensor group
// of T = 2 and an Engine over the data-parallel group, at ZeRO stages 0-3, gives the losses,
// gradient norms and weights of the unsplit GPT trained with data parallelism alone (T = 1) on the
// same batches, over 10 steps with clipping active, on T = 2 × DP = 1 and T = 2 × DP = 2; LAMB's
// per-tensor norms too. With dropout, the masks of the replicated activations are the same on the
// ranks of a tensor group and those of its heads differ, the replicated weights stay equal, and
// recomputation replays the masks of the first run. Partitioned activations keep 1/T of each
// checkpointed block input per rank (in memory, on the host path and in the arena) with the same
// losses. Bad grids are refused by name.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "support/counting_allocator.h"
#include "support/multirank.h"
#include "support/tensor_split.h"
#include "zerotrain/models/activation_checkpointing.h"
#include "zerotrain/zero/blocks.h"
#include "zerotrain/comm/comm.h"
#include "zerotrain/config/config.h"
#include "zerotrain/zero/engine.h"
#include "zerotrain/error.h"
#include "zerotrain/models/gpt.h"
#include "zerotrain/models/tensor_parallel.h"

namespace {

using zt::testing::is_rank_process;
using zt::testing::run_ranks;
using zt::testing::slice_of;

constexpr int kSteps = 10;
constexpr int64_t kGlobalBatch = 4, kTokens = 16;

zt::TrainConfig config_for(int stage, int data_world, const std::string& optimizer) {
  return zt::parse_config(R"({"train_micro_batch_size_per_gpu": )" + std::to_string(kGlobalBatch / data_world) +
                              R"(, "gradient_accumulation_steps": 1, "gradient_clipping": 0.3,
      "optimizer": {"type": ")" + optimizer + R"(", "params": {"lr": 0.003, "weight_decay": 0.01)" +
                              // LAMB's trust ratios of this tiny model lie below its default clamp, 0.01.
                              (optimizer == "Lamb" ? R"(, "min_coeff": 0.0)" : "") + R"(}},
      "zero_optimization": {"stage": )" + std::to_string(stage) +
                              R"(, "reduce_bucket_size": 20000, "stage3_param_persistence_threshold": 200}})",
                          {}, data_world);
}

struct Trace {
  std::vector<double> losses, norms;
  std::map<std::string, at::Tensor> initial, parameters;  // before the first step, after the last
};

// The same batches whatever the grid: the global batch depends on the step only, and each
// data-parallel rank takes its rows (every rank of a tensor group the same rows).
Trace train(zt::GPT model, const zt::TrainConfig& config, const std::shared_ptr<zt::Communicator>& data) {
  zt::Engine engine(model.ptr(), config, data);
  const int64_t micro = kGlobalBatch / data->world_size();
  Trace trace;
  for (const auto& item : model->named_parameters()) trace.initial[item.key()] = engine.master_parameter(item.key());
  for (int step = 0; step < kSteps; ++step) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(500 + step);
    const at::Tensor tokens = torch::randint(0, 256, {kGlobalBatch, kTokens + 1}, gen, torch::kLong)
                                  .narrow(0, data->rank() * micro, micro);
    const at::Tensor loss = model->loss(tokens.narrow(1, 0, kTokens), tokens.narrow(1, 1, kTokens));
    at::Tensor global = loss.detach().reshape({1}).to(torch::kDouble);
    data->all_reduce(global, zt::ReduceOp::Avg, "test.loss").wait();
    trace.losses.push_back(global.item<double>());
    engine.backward(loss);
    const zt::StepResult result = engine.step();
    EXPECT_TRUE(result.stepped);
    trace.norms.push_back(result.grad_norm);
  }
  for (const auto& item : model->named_parameters()) trace.parameters[item.key()] = engine.master_parameter(item.key());
  return trace;
}

void grid_equals_data_parallel(const zt::ProcessGrid& grid, int stage, const std::string& optimizer) {
  SCOPED_TRACE("stage " + std::to_string(stage) + ", " + optimizer);
  const zt::TrainConfig config = config_for(stage, grid.data->world_size(), optimizer);
  const zt::GPTConfig shape = zt::gpt_preset("small");

  // The reference: T = 1 over the same data-parallel group (each tensor rank runs it alike).
  torch::manual_seed(17);
  Trace reference;
  {
    std::optional<zt::ShardedConstruction> sharded;
    if (config.zero.shard_parameters) sharded.emplace(grid.data->rank(), grid.data->world_size());
    zt::GPT whole(shape);
    sharded.reset();
    reference = train(whole, config, grid.data);
  }
  torch::manual_seed(17);
  std::optional<zt::ShardedConstruction> sharded;
  if (config.zero.shard_parameters) sharded.emplace(grid.data->rank(), grid.data->world_size());
  zt::GPT split(shape, grid.tensor);
  sharded.reset();
  std::map<std::string, std::optional<zt::TensorSplit>> splits;
  for (const auto& item : split->named_parameters()) splits[item.key()] = zt::tensor_split_of(item.value());
  const Trace trace = train(split, config, grid.data);

  for (int step = 0; step < kSteps; ++step) {
    EXPECT_NEAR(trace.losses[step], reference.losses[step], 2e-5 * std::abs(reference.losses[step])) << "step " << step;
    EXPECT_NEAR(trace.norms[step], reference.norms[step], 2e-5 * reference.norms[step]) << "step " << step;
  }
  EXPECT_GT(reference.norms[0], 0.3) << "clipping is active, so the norm decides the update";
  int sliced = 0;
  double worst_update = 0;
  std::string worst;
  for (const auto& [name, value] : trace.parameters) {
    auto mine = [&](const at::Tensor& whole) { return splits[name] ? slice_of(whole, *splits[name]) : whole; };
    const at::Tensor expected = mine(reference.parameters.at(name));
    sliced += splits[name] ? 1 : 0;
    // Each tensor's whole update (LAMB scales it by the tensor's trust ratio), to 1e-3 relative.
    const at::Tensor update = value - trace.initial.at(name), expected_update = expected - mine(reference.initial.at(name));
    const double off = ((update - expected_update).norm() / expected_update.norm()).item<double>();
    if (off > worst_update) {
      worst_update = off;
      worst = name;
    }
    ASSERT_EQ(value.sizes(), expected.sizes()) << name;
    // Adam divides each gradient by its own running scale, so an element whose gradient is near
    // zero moves by a sizeable part of lr on a rounding difference: a tenth of one step's lr.
    EXPECT_TRUE(torch::allclose(value, expected, 1e-4, 3e-4))
        << name << ": largest difference " << (value - expected).abs().max().item<double>();
  }
  EXPECT_LT(worst_update, 1e-3) << worst << ": its update differs from the unsplit model's";
  std::printf("stage %d, %s: largest relative difference of a tensor's update %.2e (%s)\n", stage, optimizer.c_str(),
              worst_update, worst.c_str());
  EXPECT_EQ(sliced, 1 + 6 * shape.n_layer) << "wte; per block c_attn and c_fc weight and bias, both c_proj weights";
}

TEST(TensorParallelTraining, GridEqualsDataParallelAtEveryStage) {
  if (is_rank_process()) {
    at::set_num_threads(1);
    auto world = zt::make_communicator(zt::rendezvous_from_environment(), zt::comm_options_from_environment());
    const zt::ProcessGrid grid = zt::make_process_grid(world, 2);
    for (int stage : {0, 1, 2, 3}) grid_equals_data_parallel(grid, stage, "AdamW");
    grid_equals_data_parallel(grid, 2, "Lamb");
    return;
  }
  for (int world : {2, 4}) {
    auto r = run_ranks(world, "TensorParallelTraining.GridEqualsDataParallelAtEveryStage",
                       {{"ZT_COMM_TIMEOUT_SECONDS", "120"}}, std::chrono::seconds(240));
    EXPECT_TRUE(r.all_succeeded()) << "T = 2 x DP = " << world / 2 << ":\n" << r.describe();
  }
}

// Draws `n` mask values (0 or 2: dropout 0.5 of ones) and gathers every rank's.
at::Tensor gathered_masks(zt::Communicator& group, bool split_region) {
  auto draw = [] { return torch::dropout(torch::ones({256}), 0.5, /*train=*/true); };
  const at::Tensor mine = split_region ? zt::with_tensor_parallel_rng(c10::kCPU, draw) : draw();
  at::Tensor all = torch::empty({group.world_size() * 256});
  group.all_gather(mine, all, "test.masks").wait();
  return all.view({group.world_size(), 256});
}

// Trains the split GPT with dropout for 4 steps, seeding as the trainer does (the default
// generators by data-parallel rank, the split region's per tensor rank); returns the losses.
std::vector<double> train_with_dropout(const zt::ProcessGrid& grid, zt::Recompute recompute,
                                       std::map<std::string, at::Tensor>* replicated, uint64_t split_seed = 900) {
  auto shape = zt::gpt_preset("small");
  shape.dropout = 0.1;
  torch::manual_seed(3);
  zt::GPT model(shape, grid.tensor);
  zt::CheckpointingSettings settings;
  settings.recompute = recompute;
  model->set_checkpointing(settings);
  zt::Engine engine(model.ptr(), config_for(2, grid.data->world_size(), "AdamW"), grid.data);
  std::vector<double> losses;
  for (int step = 0; step < 4; ++step) {
    torch::manual_seed(100 + step);
    zt::seed_tensor_parallel_rng(split_seed + step + 7 * uint64_t(grid.tensor->rank()));
    auto gen = at::make_generator<at::CPUGeneratorImpl>(500 + step);
    const at::Tensor tokens = torch::randint(0, 256, {2, kTokens + 1}, gen, torch::kLong);
    const at::Tensor loss = model->loss(tokens.narrow(1, 0, kTokens), tokens.narrow(1, 1, kTokens));
    losses.push_back(loss.item<double>());
    engine.backward(loss);
    engine.step();
  }
  if (replicated)
    for (const auto& item : model->named_parameters())
      if (!zt::tensor_split_of(item.value())) (*replicated)[item.key()] = item.value().detach().clone();
  return losses;
}

TEST(TensorParallelTraining, DropoutMasksFollowTheRegions) {
  if (is_rank_process()) {
    at::set_num_threads(1);
    auto world = zt::make_communicator(zt::rendezvous_from_environment(), zt::comm_options_from_environment());
    const zt::ProcessGrid grid = zt::make_process_grid(world, 2);
    zt::Communicator& group = *grid.tensor;
    torch::manual_seed(5);
    zt::seed_tensor_parallel_rng(77 + group.rank());
    const at::Tensor replicated = gathered_masks(group, false);
    EXPECT_TRUE(torch::equal(replicated[0], replicated[1])) << "the replicated region's masks";
    const at::Tensor split = gathered_masks(group, true);
    EXPECT_FALSE(torch::equal(split[0], split[1])) << "the split region's masks";
    // The default generator is where it was: its next mask is the one drawn without the split draw.
    const at::Tensor after = gathered_masks(group, false);
    torch::manual_seed(5);
    gathered_masks(group, false);
    EXPECT_TRUE(torch::equal(after, gathered_masks(group, false)));

    std::map<std::string, at::Tensor> kept;
    const std::vector<double> plain = train_with_dropout(grid, zt::Recompute::None, &kept);
    const std::vector<double> recomputed = train_with_dropout(grid, zt::Recompute::Full, nullptr);
    EXPECT_EQ(plain, recomputed) << "recomputation replays the first run's masks, the split region's too";
    // The split region draws from its own generator: other seeds for it, other losses.
    EXPECT_NE(plain, train_with_dropout(grid, zt::Recompute::None, nullptr, 5000));
    for (const auto& [name, value] : kept) {
      at::Tensor all = torch::empty({2, value.numel()});
      group.all_gather(value.reshape({-1}), all.view({-1}), "test.replicated").wait();
      EXPECT_TRUE(torch::equal(all[0], all[1])) << name << " differs across the tensor group";
    }
    EXPECT_GT(kept.size(), 4u);
    return;
  }
  auto r = run_ranks(2, "TensorParallelTraining.DropoutMasksFollowTheRegions", {{"ZT_COMM_TIMEOUT_SECONDS", "60"}},
                     std::chrono::seconds(90));
  EXPECT_TRUE(r.all_succeeded()) << r.describe();
}

// One forward and backward of the split `small` GPT with full recomputation: the loss, the bytes
// held between forward and backward (counting allocator), and the arena's slot size.
struct PartitionRun {
  double loss = 0;
  int64_t held = 0, slot_bytes = 0;
};
PartitionRun run_partitioned(const zt::ProcessGrid& grid, bool partition, bool on_host, bool contiguous) {
  torch::manual_seed(3);
  zt::GPT model(zt::gpt_preset("small"), grid.tensor);
  zt::CheckpointingSettings settings;
  settings.recompute = zt::Recompute::Full;
  settings.contiguous_memory = contiguous;
  settings.keep_inputs_on_host = on_host;
  settings.partition_activations = partition;
  model->set_checkpointing(settings);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(8);
  const at::Tensor tokens = torch::randint(0, 256, {4, 65}, gen, torch::kLong);
  auto& counter = zt::testing::CountingAllocator::instance();
  counter.install();
  PartitionRun run;
  at::Tensor loss = model->loss(tokens.narrow(1, 0, 64), tokens.narrow(1, 1, 64));
  run.held = counter.live();
  loss.backward();
  counter.uninstall();
  run.loss = loss.item<double>();
  if (contiguous) run.slot_bytes = model->checkpoint_arena_stats()->slot_bytes;
  return run;
}

TEST(TensorParallelTraining, PartitionedActivationsKeepOneTthOfTheBlockInputs) {
  if (is_rank_process()) {
    at::set_num_threads(1);
    auto world = zt::make_communicator(zt::rendezvous_from_environment(), zt::comm_options_from_environment());
    const zt::ProcessGrid grid = zt::make_process_grid(world, 2);
    const auto shape = zt::gpt_preset("small");
    // A block input: 4 × 64 tokens × width 128 in fp32; each rank keeps half.
    const int64_t input_bytes = 4 * 64 * shape.n_embd * 4;
    for (const auto& [on_host, contiguous] : {std::pair{false, false}, {true, false}, {false, true}, {true, true}}) {
      SCOPED_TRACE(std::string(on_host ? "cpu_checkpointing" : "in place") + (contiguous ? ", contiguous" : ""));
      const PartitionRun whole = run_partitioned(grid, false, on_host, contiguous);
      const PartitionRun split = run_partitioned(grid, true, on_host, contiguous);
      EXPECT_EQ(whole.loss, split.loss);
      if (contiguous) {
        EXPECT_EQ(whole.slot_bytes, input_bytes);
        EXPECT_EQ(split.slot_bytes, input_bytes / 2);
      }
      // Between forward and backward each of the n_layer checkpoints keeps half an input less.
      const int64_t saved = whole.held - split.held;
      EXPECT_EQ(saved, shape.n_layer * input_bytes / 2) << "held " << whole.held << " whole, " << split.held << " split";
    }
    return;
  }
  auto r = run_ranks(2, "TensorParallelTraining.PartitionedActivationsKeepOneTthOfTheBlockInputs",
                     {{"ZT_COMM_TIMEOUT_SECONDS", "60"}}, std::chrono::seconds(90));
  EXPECT_TRUE(r.all_succeeded()) << r.describe();
}

// The engine over the whole grid (not its data-parallel group) would average different slices
// into each other: refused by name, as are grids T does not divide and tensor_parallel.autotp_size
// with a model that is not split.
TEST(TensorParallelTraining, BadGridsAreRefused) {
  if (is_rank_process()) {
    at::set_num_threads(1);
    auto world = zt::make_communicator(zt::rendezvous_from_environment(), zt::comm_options_from_environment());
    try {
      zt::make_process_grid(world, 3);
      ADD_FAILURE() << "T = 3 on 2 ranks";
    } catch (const zt::ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("tensor_parallel.autotp_size"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("found 3"), std::string::npos) << e.what();
    }
    const zt::ProcessGrid grid = zt::make_process_grid(world, 2);
    torch::manual_seed(1);
    zt::GPT split(zt::gpt_preset("tiny"), grid.tensor);
    try {
      zt::Engine engine(split.ptr(), config_for(0, 2, "AdamW"), world);
      ADD_FAILURE() << "an engine over the whole grid";
    } catch (const zt::ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("tensor ranks 0 to 1"), std::string::npos) << e.what();
    }
    // tensor_parallel.autotp_size with a model that is not split would be a key without effect.
    const zt::TrainConfig with_key = zt::parse_config(R"({"tensor_parallel": {"autotp_size": 2}})", {}, 2);
    zt::GPT whole(zt::gpt_preset("tiny"));
    try {
      zt::Engine engine(whole.ptr(), with_key, grid.data);
      ADD_FAILURE() << "tensor_parallel.autotp_size 2 with an unsplit model";
    } catch (const zt::ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("no tensor-parallel parameter"), std::string::npos) << e.what();
    }
    return;
  }
  auto r = run_ranks(2, "TensorParallelTraining.BadGridsAreRefused", {{"ZT_COMM_TIMEOUT_SECONDS", "60"}},
                     std::chrono::seconds(90));
  EXPECT_TRUE(r.all_succeeded()) << r.describe();
}

}  // namespace
