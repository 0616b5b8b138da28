// The engine's device-generic paths (docs/gpu.md).
// - On the CPU, every CI run: optimizer offload staged through host copies (ZT_HOST_STAGING=1:
//   the snapshot, the host working copy and the copies the GPU path makes) trains bit for bit as
//   the unstaged run, at stages 1-3, fp32 and bf16, AdamW, LAMB and SGD, with and without the
//   delayed update: on 1 rank through an emulated copy engine as late as the contract allows
//   (ZT_EMULATE_COPY_ENGINE=1, so that a missing wait changes the result), on 2 ranks with the
//   CPU's synchronous copies.
// - With ZT_TEST_DEVICE=cuda on a GPU: stages 0-3, optimizer offload on and off, fp32 and bf16,
//   and offload with page-locked host copies and the delayed update at stages 1-3, one rank, on
//   the device equal the CPU run within the GPU's tolerance (below); so does activation
//   checkpointing with the block inputs kept in page-locked host memory and copied into the
//   contiguous arena (the copy to the host must have landed before the arena reads it); so do
//   stage-3 parameter offload to page-locked host memory and NVMe (each block's shards copied to
//   the device on a copy stream before its gather) and a model built sharded for the device.
//   Elsewhere those tests skip and say why.
// - Parameter offload staged on the CPU (the same slots and copies, synchronous) trains bit for
//   bit as the unstaged run, the model built whole or sharded.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>

#include "support/device.h"
#include "support/multirank.h"
#include "support/parity.h"
#include "zerotrain/blocks.h"
#include "zerotrain/comm.h"
#include "zerotrain/config.h"
#include "zerotrain/engine.h"
#include "zerotrain/models/gpt.h"

namespace {

using zt::testing::is_rank_process;
using zt::testing::run_ranks;

struct RunOptions {
  int stage = 1;
  std::string precision = "fp32";
  std::string optimizer_device = "cpu";
  std::string optimizer_name = "AdamW";
  bool delayed = false;
  bool pinned = false;  // offload_optimizer.pin_memory: page-locked host copies
  bool host_staging = false;
  bool late_copies = false;  // staged copies through an emulated copy engine as late as allowed (ZT_EMULATE_COPY_ENGINE)
  std::string param_device = "none";  // offload_param (stage 3): the working partition on the host or NVMe
  bool sharded_build = false;         // the model built under a ShardedConstruction for the device
  c10::Device device{c10::kCPU};
  int steps = 6;
};

using RunResult = zt::testing::TrainingTrace;  // stages 0-2 fill final_parameters

std::string describe(const RunOptions& o) {
  return "stage " + std::to_string(o.stage) + " " + o.precision + " " + o.optimizer_name + " optimizer->" +
         o.optimizer_device + (o.param_device != "none" ? " params->" + o.param_device : "") +
         (o.delayed ? " delayed" : "") + (o.pinned ? " pinned" : "") + (o.host_staging ? " staged" : "") +
         (o.late_copies ? " (late copies)" : "") + (o.sharded_build ? " built sharded" : "") + " on " + o.device.str();
}

zt::TrainConfig make_config(const RunOptions& o, int world) {
  std::string json = R"({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
    "gradient_clipping": 0.05,
    "optimizer": {"type": ")" + o.optimizer_name + R"(", "params": {"lr": 0.003, "weight_decay": 0.01}},
    "zero_optimization": {"stage": )" + std::to_string(o.stage) +
                     R"(, "reduce_bucket_size": 40000, "overlap_comm": true, "stage3_param_persistence_threshold": 100)";
  if (o.optimizer_device != "none") {
    json += R"(, "offload_optimizer": {"device": ")" + o.optimizer_device + "\"";
    if (o.optimizer_device == "nvme") json += R"(, "nvme_path": ")" + ::testing::TempDir() + "\"";
    if (o.delayed) json += R"(, "delayed_update": true, "delayed_update_after": 2)";
    if (o.pinned) json += R"(, "pin_memory": true)";
    json += "}";
  }
  if (o.param_device != "none") {
    // Two slots and, on NVMe, every block in the file: the tiny model's four blocks take turns.
    json += R"(, "offload_param": {"device": ")" + o.param_device + R"(", "buffer_count": 2, "max_in_cpu": 0)";
    if (o.param_device == "nvme") json += R"(, "nvme_path": ")" + ::testing::TempDir() + "\"";
    if (o.pinned) json += R"(, "pin_memory": true)";
    json += "}";
  }
  json += "}";
  if (o.precision == "bf16") json += R"(, "bf16": {"enabled": true})";
  return zt::parse_config(json + "}", {}, world);
}

RunResult train(std::shared_ptr<zt::Communicator> comm, const RunOptions& o) {
  const int rank = comm->rank(), world = comm->world_size();
  const auto config = make_config(o, world);
  torch::manual_seed(7);
  auto gpt_config = zt::gpt_preset("tiny");
  std::optional<zt::ShardedConstruction> sharded;
  if (o.sharded_build) sharded.emplace(rank, world, o.device);
  auto model = zt::GPT(gpt_config);
  sharded.reset();
  zt::move_model(*model, o.device);
  if (o.host_staging) ::setenv("ZT_HOST_STAGING", "1", 1);
  if (o.late_copies) ::setenv("ZT_EMULATE_COPY_ENGINE", "1", 1);
  std::optional<zt::Engine> engine;
  try {
    engine.emplace(model.ptr(), config, comm);
  } catch (...) {
    ::unsetenv("ZT_HOST_STAGING");
    ::unsetenv("ZT_EMULATE_COPY_ENGINE");
    throw;
  }
  ::unsetenv("ZT_HOST_STAGING");
  ::unsetenv("ZT_EMULATE_COPY_ENGINE");
  RunResult result;
  for (int step = 0; step < o.steps; ++step) {
    double loss_sum = 0;
    zt::StepResult r;
    for (int a = 0; a < 2; ++a) {
      auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 * rank + 10 * step + a);
      auto tokens = torch::randint(0, gpt_config.vocab_size, {2, 17}, gen, torch::kLong).to(o.device);
      auto loss = model->loss(tokens.narrow(1, 0, 16), tokens.narrow(1, 1, 16));
      loss_sum += loss.item<double>();
      engine->backward(loss);
      r = engine->step();
    }
    EXPECT_TRUE(r.stepped) << describe(o);
    result.losses.push_back(loss_sum / 2);
    result.grad_norms.push_back(r.grad_norm);
  }
  engine->apply_pending_update();
  if (o.stage < 3) {
    std::vector<torch::Tensor> flat;
    for (auto& p : model->parameters())
      if (p.requires_grad()) flat.push_back(p.detach().to(torch::kCPU, torch::kFloat).reshape({-1}));
    result.final_parameters = torch::cat(flat);
  }
  return result;
}

std::shared_ptr<zt::Communicator> rank_communicator() {
  at::set_num_threads(1);
  return zt::make_communicator(zt::rendezvous_from_environment(), zt::comm_options_from_environment());
}

void expect_identical(const RunResult& reference, const RunResult& run, const RunOptions& o) {
  zt::testing::expect_bitwise_equal(reference, run, describe(o));
}

// Rank body: each variant staged and unstaged, compared bit for bit.
void staged_equals_unstaged() {
  auto comm = rank_communicator();
  std::vector<RunOptions> variants;
  for (int stage : {1, 2, 3})
    for (const char* precision : {"fp32", "bf16"}) variants.push_back({.stage = stage, .precision = precision});
  variants.push_back({.stage = 2, .precision = "bf16", .delayed = true});
  variants.push_back({.stage = 3, .precision = "fp32", .delayed = true});
  variants.push_back({.stage = 1, .optimizer_name = "Lamb"});
  variants.push_back({.stage = 2, .precision = "bf16", .optimizer_name = "SGD"});
  variants.push_back({.stage = 2, .precision = "bf16", .optimizer_device = "nvme"});
  // Parameter offload: the gathers copy each block's shards from the host partition (or the
  // buffer its NVMe read landed in) into the two slots first.
  variants.push_back({.stage = 3, .precision = "fp32", .param_device = "cpu"});
  variants.push_back({.stage = 3, .precision = "bf16", .param_device = "nvme", .sharded_build = true});
  variants.push_back({.stage = 3, .precision = "bf16", .optimizer_device = "nvme", .delayed = true, .param_device = "nvme"});
  for (RunOptions o : variants) {
    if (o.delayed && o.optimizer_name == "Lamb" && comm->world_size() > 1) continue;
    const RunResult reference = train(comm, o);
    for (double norm : reference.grad_norms) ASSERT_GT(norm, 0.05) << "clipping must be active on every step";
    o.host_staging = true;
    // One rank: through an emulated copy engine as late as the contract allows, so that a missing
    // wait changes the result; two ranks: the CPU's synchronous copies.
    o.late_copies = comm->world_size() == 1;
    expect_identical(reference, train(comm, o), o);
  }
}

TEST(DeviceParity, HostStagingEqualsUnstagedBitwise) {
  if (is_rank_process()) {
    staged_equals_unstaged();
    return;
  }
  for (int world : {1, 2}) {
    auto r = run_ranks(world, "DeviceParity.HostStagingEqualsUnstagedBitwise", {{"ZT_COMM_TIMEOUT_SECONDS", "60"}},
                       std::chrono::seconds(240));
    EXPECT_TRUE(r.all_succeeded()) << world << " ranks:\n" << r.describe();
  }
}

// GPU tolerance: the device's reductions run in another order than the CPU's, and its fp32
// matmuls and attention are other kernels: fp32 losses agree to 1e-4 relative over six steps
// of clipped AdamW (gradient norms to 1e-3, the weights' relative L2 distance to 1e-3); bf16
// rounds differently wherever the order differs, so 3e-2 (3e-1 for norms and weights).
TEST(DeviceParity, StagesAndOffloadOnTheTestDeviceEqualTheCpu) {
  const zt::testing::TestDevice device = zt::testing::test_device();
  if (!device.skip_reason.empty()) GTEST_SKIP() << device.skip_reason;
  if (device.device.is_cpu())
    GTEST_SKIP() << "ZT_TEST_DEVICE is cpu: the CPU run is the reference itself (set ZT_TEST_DEVICE=cuda on a GPU)";
  auto comm = zt::make_communicator(zt::RendezvousInfo{}, zt::CommOptions{});
  std::vector<RunOptions> variants;
  for (int stage : {0, 1, 2, 3})
    for (const char* offload : {"none", "cpu"})
      for (const char* precision : {"fp32", "bf16"}) {
        if (stage == 0 && std::string(offload) != "none") continue;  // offload needs a partition (stage >= 1)
        variants.push_back({.stage = stage, .precision = precision, .optimizer_device = offload});
      }
  // The offload benchmark's settings: page-locked host copies, the CPU step beside the next
  // forward and backward (delayed_update), whose copy-stream waits only a GPU exercises.
  for (int stage : {1, 2, 3})
    for (const char* precision : {"fp32", "bf16"})
      variants.push_back({.stage = stage, .precision = precision, .delayed = true, .pinned = true});
  variants.push_back({.stage = 2, .precision = "bf16", .pinned = true});
  // ZeRO-Infinity: the parameter shards in page-locked host memory or NVMe, copied to the device
  // block by block on a copy stream; and the model built sharded in host memory for the device.
  for (const char* precision : {"fp32", "bf16"})
    variants.push_back({.stage = 3, .precision = precision, .pinned = true, .param_device = "cpu"});
  variants.push_back({.stage = 3, .precision = "bf16", .delayed = true, .pinned = true, .param_device = "nvme"});
  variants.push_back({.stage = 3, .precision = "bf16", .optimizer_device = "none", .sharded_build = true});
  variants.push_back({.stage = 3, .precision = "bf16", .pinned = true, .param_device = "cpu", .sharded_build = true});
  for (RunOptions o : variants) {
    const RunResult reference = train(comm, o);
    o.device = device.device;
    const RunResult run = train(comm, o);
    const double tolerance = o.precision == "fp32" ? 1e-4 : 3e-2;
    for (size_t i = 0; i < run.losses.size(); ++i) {
      EXPECT_NEAR(run.losses[i], reference.losses[i], tolerance * std::abs(reference.losses[i]))
          << describe(o) << " step " << i;
      EXPECT_NEAR(run.grad_norms[i], reference.grad_norms[i], 10 * tolerance * std::abs(reference.grad_norms[i]))
          << describe(o) << " step " << i;
    }
    // The weights as a whole (a relative L2 distance): an element whose gradient is near zero
    // may take Adam's step in the other direction on the other device, by design of Adam.
    if (reference.final_parameters.defined()) {
      const double distance = (run.final_parameters - reference.final_parameters).norm().item<double>() /
                              reference.final_parameters.norm().item<double>();
      EXPECT_LT(distance, 10 * tolerance) << describe(o);
    }
  }
}

// cpu_checkpointing with contiguous_memory_optimization on the device: each checkpointed block's
// input goes to page-locked host memory and is copied into the arena's slot by the CPU, then back
// to the device for the recomputation. Were the arena to copy before the device-to-host copy had
// landed, the recomputation would run on stale bytes and the gradients would differ from the CPU
// run's (no dropout: the devices' generators differ).
TEST(DeviceParity, CpuCheckpointingIntoTheArenaOnTheTestDeviceEqualsTheCpu) {
  const zt::testing::TestDevice device = zt::testing::test_device();
  if (!device.skip_reason.empty()) GTEST_SKIP() << device.skip_reason;
  if (device.device.is_cpu())
    GTEST_SKIP() << "ZT_TEST_DEVICE is cpu: the CPU run is the reference itself (set ZT_TEST_DEVICE=cuda on a GPU)";
  auto gpt = zt::gpt_preset("tiny");
  gpt.dropout = 0.0;
  gpt.n_layer = 4;
  zt::GPTImpl::Checkpointing settings;
  settings.recompute = zt::Recompute::Full;
  settings.contiguous_memory = true;
  settings.keep_inputs_on_host = true;
  struct Run {
    std::vector<double> losses;
    std::vector<torch::Tensor> grads;
  };
  auto run_on = [&](c10::Device d) {
    torch::manual_seed(3);
    zt::GPT model(gpt);
    model->to(d);
    model->set_checkpointing(settings);
    model->train();
    Run r;
    for (int micro = 0; micro < 3; ++micro) {
      auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + micro);
      auto tokens = torch::randint(0, gpt.vocab_size, {8, 65}, gen, torch::kLong).to(d);
      auto loss = model->loss(tokens.narrow(1, 0, 64), tokens.narrow(1, 1, 64));
      loss.backward();
      r.losses.push_back(loss.item<double>());
    }
    for (auto& p : model->parameters()) r.grads.push_back(p.grad().to(torch::kCPU));
    const auto stats = model->checkpoint_arena_stats();
    EXPECT_TRUE(stats.has_value() && stats->stores > 0) << "the arena was not used on " << d.str();
    return r;
  };
  const Run reference = run_on(c10::Device(c10::kCPU));
  const Run run = run_on(device.device);
  ASSERT_EQ(run.losses.size(), reference.losses.size());
  for (size_t i = 0; i < run.losses.size(); ++i)
    EXPECT_NEAR(run.losses[i], reference.losses[i], 1e-4 * std::abs(reference.losses[i])) << "micro-step " << i;
  for (size_t i = 0; i < run.grads.size(); ++i) {
    const double distance = (run.grads[i] - reference.grads[i]).norm().item<double>() /
                            std::max(1e-12, reference.grads[i].norm().item<double>());
    EXPECT_LT(distance, 1e-3) << "parameter " << i;
  }
}

}  // namespace
