// The engine's device-generic paths (docs/gpu.md).
// - On the CPU, every CI run: optimizer offload staged through host copies (ZT_HOST_STAGING=1:
//   the snapshot, the host working copy and the copies the GPU path makes) trains bit for bit as
//   the unstaged run, at stages 1-3, fp32 and bf16, AdamW, LAMB and SGD, with and without the
//   delayed update: on 1 rank through an emulated copy engine as late as the contract allows
//   (ZT_EMULATE_COPY_ENGINE=1, so that a missing wait changes the result), on 2 ranks with the
//   CPU's synchronous copies. Parameter offload staged on the CPU (the same slots and copies,
//   synchronous) trains bit for bit as the unstaged run, the model built whole or sharded.
// - With ZT_TEST_DEVICE=cuda on a GPU, one test per variant (so that one failure hides none of
//   the others, each with its own time): stages 0-3, optimizer offload on and off, fp32 and bf16,
//   page-locked and pageable host memory, the delayed update, stage-3 parameter offload to host
//   memory, NVMe and both, a model (the GPT, BERT, the Llama) built sharded for the device,
//   activation checkpointing at stage 3 and a checkpoint saved and loaded midway, on the device,
//   equal the CPU run within the GPU's tolerance (below). Every copy on a copy stream is
//   preceded there by a spinning kernel, so that a missing wait for one reads stale bytes every
//   time. So does activation checkpointing with the block inputs kept in page-locked host memory
//   and copied into the contiguous arena. Elsewhere those tests skip and say why.
#include <gtest/gtest.h>

#include <cctype>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <optional>
#include <unistd.h>

#include "support/device.h"
#include "support/multirank.h"
#include "support/parity.h"
#include "zero/device_plan.h"
#include "zerotrain/zero/blocks.h"
#include "zerotrain/comm/comm.h"
#include "zerotrain/config/config.h"
#include "zerotrain/zero/engine.h"
#include "zerotrain/models/bert.h"
#include "zerotrain/models/gpt.h"
#include "zerotrain/models/llama.h"
#include "zerotrain/zero/reporting.h"

namespace {

using zt::testing::is_rank_process;
using zt::testing::run_ranks;

struct RunOptions {
  std::string model = "gpt";  // gpt, bert or llama, each its tiny preset
  int stage = 1;
  std::string precision = "fp32";
  std::string optimizer_device = "cpu";
  std::string optimizer_name = "AdamW";
  bool delayed = false;
  bool pinned = true;  // pin_memory of both offload blocks (DeepSpeed's default); false: pageable host memory
  bool host_staging = false;
  bool late_copies = false;  // staged copies through an emulated copy engine as late as allowed (ZT_EMULATE_COPY_ENGINE)
  std::string param_device = "none";  // offload_param (stage 3): the working partition on the host or NVMe
  int64_t max_in_cpu = 0;             // offload_param nvme: elements kept in host memory (the rest in the file)
  bool sharded_build = false;         // the model built under a ShardedConstruction for the device
  bool checkpointing = false;         // full recomputation of every block in backward
  int resume_at = 0;                  // > 0: a checkpoint saved after this step, loaded into a fresh model and engine
  bool reload = true;                 // false: the checkpoint is only saved (what a resumed run must equal)
  c10::Device device{c10::kCPU};
  int steps = 6;
};

using RunResult = zt::testing::TrainingTrace;  // stages 0-2 fill final_parameters

std::string describe(const RunOptions& o) {
  const bool offload = o.optimizer_device != "none" || o.param_device != "none";
  return o.model + " stage " + std::to_string(o.stage) + " " + o.precision + " " + o.optimizer_name + " optimizer->" +
         o.optimizer_device + (o.param_device != "none" ? " params->" + o.param_device : "") +
         (o.max_in_cpu > 0 ? " (" + std::to_string(o.max_in_cpu) + " in memory)" : "") +
         (o.delayed ? " delayed" : "") + (offload ? (o.pinned ? " pinned" : " pageable") : "") +
         (o.host_staging ? " staged" : "") + (o.late_copies ? " (late copies)" : "") +
         (o.sharded_build ? " built sharded" : "") + (o.checkpointing ? " checkpointed" : "") +
         (o.resume_at > 0 ? " resumed at " + std::to_string(o.resume_at) : "") + " on " + o.device.str();
}

zt::TrainConfig make_config(const RunOptions& o, int world) {
  const std::string pin = std::string(R"(, "pin_memory": )") + (o.pinned ? "true" : "false");
  std::string json = R"({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
    "gradient_clipping": 0.05,
    "optimizer": {"type": ")" + o.optimizer_name + R"(", "params": {"lr": 0.003, "weight_decay": 0.01}},
    "zero_optimization": {"stage": )" + std::to_string(o.stage) +
                     R"(, "reduce_bucket_size": 40000, "overlap_comm": true, "stage3_param_persistence_threshold": 100)";
  if (o.optimizer_device != "none") {
    json += R"(, "offload_optimizer": {"device": ")" + o.optimizer_device + "\"" + pin;
    if (o.optimizer_device == "nvme") json += R"(, "nvme_path": ")" + ::testing::TempDir() + "\"";
    if (o.delayed) json += R"(, "delayed_update": true, "delayed_update_after": 2)";
    json += "}";
  }
  if (o.param_device != "none") {
    // Two slots and, on NVMe, every block beyond max_in_cpu in the file: the tiny model's blocks
    // take turns.
    json += R"(, "offload_param": {"device": ")" + o.param_device + R"(", "buffer_count": 2, "max_in_cpu": )" +
            std::to_string(o.max_in_cpu) + pin;
    if (o.param_device == "nvme") json += R"(, "nvme_path": ")" + ::testing::TempDir() + "\"";
    json += "}";
  }
  json += "}";
  if (o.precision == "bf16") json += R"(, "bf16": {"enabled": true})";
  return zt::parse_config(json + "}", {}, world);
}

// One of the tiny reference models, its loss on a [2, 17] token batch, and its checkpointing.
struct TinyModel {
  std::shared_ptr<torch::nn::Module> module;
  std::function<torch::Tensor(const torch::Tensor&)> loss;
  std::function<void(const zt::CheckpointingSettings&)> set_checkpointing;
};

TinyModel build_model(const RunOptions& o, int rank, int world) {
  torch::manual_seed(7);
  std::optional<zt::ShardedConstruction> sharded;
  if (o.sharded_build) sharded.emplace(rank, world, o.device);
  TinyModel m;
  if (o.model == "gpt") {
    zt::GPT gpt(zt::gpt_preset("tiny"));
    m.module = gpt.ptr();
    m.loss = [gpt](const torch::Tensor& t) mutable { return gpt->loss(t.narrow(1, 0, 16), t.narrow(1, 1, 16)); };
    m.set_checkpointing = [gpt](const zt::CheckpointingSettings& s) mutable { gpt->set_checkpointing(s); };
  } else if (o.model == "llama") {
    zt::Llama llama(zt::llama_preset("llama-tiny"));
    m.module = llama.ptr();
    m.loss = [llama](const torch::Tensor& t) mutable { return llama->loss(t.narrow(1, 0, 16), t.narrow(1, 1, 16)); };
    m.set_checkpointing = [llama](const zt::CheckpointingSettings& s) mutable { llama->set_checkpointing(s); };
  } else {
    zt::Bert bert(zt::bert_preset("bert-tiny"));
    m.module = bert.ptr();
    m.loss = [bert](const torch::Tensor& t) mutable {
      // Every third position predicted, its label the next token: a fixed masked batch.
      zt::BertBatch batch;
      batch.input_ids = t.narrow(1, 0, 16).contiguous();
      batch.token_type_ids = torch::zeros_like(batch.input_ids);
      batch.attention_mask = torch::ones_like(batch.input_ids);
      batch.masked_positions = torch::arange(0, 32, 3, batch.input_ids.options());
      batch.masked_labels = t.narrow(1, 1, 16).reshape({-1}).index_select(0, batch.masked_positions);
      batch.nsp_labels = torch::zeros({t.size(0)}, batch.input_ids.options());
      return bert->mlm_loss(batch);
    };
    m.set_checkpointing = [bert](const zt::CheckpointingSettings& s) mutable { bert->set_checkpointing(s); };
  }
  sharded.reset();
  zt::move_model(*m.module, o.device);
  if (o.checkpointing) {
    zt::CheckpointingSettings settings;
    settings.recompute = zt::Recompute::Full;
    m.set_checkpointing(settings);
  }
  return m;
}

struct Session {
  TinyModel model;
  std::optional<zt::Engine> engine;
};

void open_session(Session& s, std::shared_ptr<zt::Communicator> comm, const RunOptions& o) {
  const auto config = make_config(o, comm->world_size());
  s.engine.reset();
  s.model = build_model(o, comm->rank(), comm->world_size());
  if (o.host_staging) ::setenv("ZT_HOST_STAGING", "1", 1);
  if (o.late_copies) ::setenv("ZT_EMULATE_COPY_ENGINE", "1", 1);
  try {
    s.engine.emplace(s.model.module, config, comm);
  } catch (...) {
    ::unsetenv("ZT_HOST_STAGING");
    ::unsetenv("ZT_EMULATE_COPY_ENGINE");
    throw;
  }
  ::unsetenv("ZT_HOST_STAGING");
  ::unsetenv("ZT_EMULATE_COPY_ENGINE");
}

RunResult train(std::shared_ptr<zt::Communicator> comm, const RunOptions& o) {
  const int rank = comm->rank();
  Session s;
  open_session(s, comm, o);
  const std::filesystem::path checkpoints =
      std::filesystem::path(::testing::TempDir()) / ("parity-resume-" + std::to_string(::getpid()));
  RunResult result;
  // The losses stay on the device until the end: reading one would wait for the device and so
  // hide a missing wait between the copy and compute streams.
  std::vector<torch::Tensor> losses;
  for (int step = 0; step < o.steps; ++step) {
    if (o.resume_at > 0 && step == o.resume_at) {
      // Saving completes a delayed update in flight, so the reference saves too.
      s.engine->save_checkpoint(checkpoints.string(), "resume");
      if (o.reload) {
        open_session(s, comm, o);  // a fresh model and engine
        s.engine->load_checkpoint(checkpoints.string(), "resume");
      }
    }
    torch::Tensor loss_sum;
    zt::StepResult r;
    for (int a = 0; a < 2; ++a) {
      auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 * rank + 10 * step + a);
      auto tokens = torch::randint(0, 256, {2, 17}, gen, torch::kLong).to(o.device);
      auto loss = s.model.loss(tokens);
      const torch::Tensor value = loss.detach().to(torch::kFloat64);
      loss_sum = loss_sum.defined() ? loss_sum + value : value;
      s.engine->backward(loss);
      r = s.engine->step();
    }
    EXPECT_TRUE(r.stepped) << describe(o);
    losses.push_back(loss_sum / 2);
    result.grad_norms.push_back(r.grad_norm);
  }
  for (const torch::Tensor& l : losses) result.losses.push_back(l.item<double>());
  s.engine->apply_pending_update();
  if (o.stage < 3) {
    std::vector<torch::Tensor> flat;
    for (auto& p : s.model.module->parameters())
      if (p.requires_grad()) flat.push_back(p.detach().to(torch::kCPU, torch::kFloat).reshape({-1}));
    result.final_parameters = torch::cat(flat);
  }
  if (o.resume_at > 0 && rank == 0) std::filesystem::remove_all(checkpoints);
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

// The variants run on the device, each its own test.
std::vector<RunOptions> device_variants() {
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
      variants.push_back({.stage = stage, .precision = precision, .delayed = true});
  // Pageable host copies: each copy blocks the host, the results are the same.
  variants.push_back({.stage = 2, .precision = "bf16", .pinned = false});
  variants.push_back({.stage = 2, .precision = "bf16", .delayed = true, .pinned = false});
  // ZeRO-Infinity: the parameter shards in host memory (page-locked or pageable), NVMe, or both
  // (the first blocks in memory, the rest in the file), copied to the device block by block on a
  // copy stream; with the delayed update the step writes a second partition installed later.
  for (const char* precision : {"fp32", "bf16"}) variants.push_back({.stage = 3, .precision = precision, .param_device = "cpu"});
  variants.push_back({.stage = 3, .precision = "bf16", .pinned = false, .param_device = "cpu"});
  variants.push_back({.stage = 3, .precision = "bf16", .delayed = true, .param_device = "cpu"});
  variants.push_back({.stage = 3, .precision = "bf16", .delayed = true, .param_device = "nvme"});
  variants.push_back({.stage = 3, .precision = "fp32", .param_device = "nvme", .max_in_cpu = 40000});
  variants.push_back({.stage = 3, .precision = "bf16", .pinned = false, .param_device = "nvme", .max_in_cpu = 40000});
  // Models built sharded for the device, with and without parameter offload.
  variants.push_back({.stage = 3, .precision = "bf16", .optimizer_device = "none", .sharded_build = true});
  variants.push_back({.stage = 3, .precision = "bf16", .param_device = "cpu", .sharded_build = true});
  for (const char* model : {"bert", "llama"}) {
    variants.push_back({.model = model, .stage = 3, .precision = "bf16", .optimizer_device = "none", .sharded_build = true});
    variants.push_back({.model = model, .stage = 3, .precision = "fp32", .param_device = "cpu", .sharded_build = true});
  }
  // Activation checkpointing at stage 3: the recomputation gathers each block again in backward.
  for (const char* model : {"gpt", "bert", "llama"})
    variants.push_back({.model = model, .stage = 3, .precision = "bf16", .param_device = "cpu", .checkpointing = true});
  // A checkpoint saved and loaded on the device midway (into a fresh model and engine).
  variants.push_back({.stage = 2, .precision = "bf16", .resume_at = 3});
  variants.push_back({.stage = 3, .precision = "bf16", .delayed = true, .param_device = "cpu", .resume_at = 3});
  variants.push_back({.model = "llama", .stage = 3, .precision = "fp32", .param_device = "nvme", .sharded_build = true, .resume_at = 3});
  return variants;
}

// gtest prints a test's parameter with its name.
void PrintTo(const RunOptions& o, std::ostream* os) { *os << describe(o); }

std::string variant_name(const RunOptions& o) {
  std::string name = describe(o);
  name = name.substr(0, name.rfind(" on "));
  std::string id;  // letters and digits, each run of anything else one underscore
  for (char c : name) {
    if (std::isalnum(static_cast<unsigned char>(c))) id += c;
    else if (!id.empty() && id.back() != '_') id += '_';
  }
  while (!id.empty() && id.back() == '_') id.pop_back();
  return id;
}

// Spinning kernels before every copy on a copy stream: about a millisecond at a GPU's clock.
constexpr int64_t kCopyDelayCycles = 2'000'000;

class StagesAndOffloadOnTheTestDevice : public ::testing::TestWithParam<RunOptions> {};

// GPU tolerance: the device's reductions run in another order than the CPU's, and its fp32
// matmuls and attention are other kernels: fp32 losses agree to 1e-4 relative over six steps
// of clipped AdamW (gradient norms to 1e-3, the weights' relative L2 distance to 1e-3); bf16
// rounds differently wherever the order differs, so 3e-2 (3e-1 for norms and weights).
TEST_P(StagesAndOffloadOnTheTestDevice, EqualsTheCpu) {
  const zt::testing::TestDevice device = zt::testing::test_device();
  if (!device.skip_reason.empty()) GTEST_SKIP() << device.skip_reason;
  if (device.device.is_cpu())
    GTEST_SKIP() << "ZT_TEST_DEVICE is cpu: the CPU run is the reference itself (set ZT_TEST_DEVICE=cuda on a GPU)";
  auto comm = zt::make_communicator(zt::RendezvousInfo{}, zt::CommOptions{});
  RunOptions o = GetParam();
  const RunResult reference = train(comm, o);
  o.device = device.device;
  zt::set_copy_stream_delay_for_testing(kCopyDelayCycles);
  RunResult run;
  try {
    run = train(comm, o);
  } catch (...) {
    zt::set_copy_stream_delay_for_testing(0);
    throw;
  }
  zt::set_copy_stream_delay_for_testing(0);
  const double tolerance = o.precision == "fp32" ? 1e-4 : 3e-2;
  ASSERT_EQ(run.losses.size(), reference.losses.size());
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

INSTANTIATE_TEST_SUITE_P(Variants, StagesAndOffloadOnTheTestDevice, ::testing::ValuesIn(device_variants()),
                         [](const ::testing::TestParamInfo<RunOptions>& info) { return variant_name(info.param); });

// On the CPU every variant above runs too, so that each model and configuration the GPU run will
// build is built and trained in every CI run (a variant the CPU refuses would otherwise be found
// only on a lent GPU): staged through host copies as the device path stages them, bit for bit
// equal to the unstaged run; a resumed run equal to one that saved the same checkpoint and went on.
TEST(DeviceParity, EveryDeviceVariantStagedOnTheCpuEqualsTheUnstagedRun) {
  // Tiny models: one intra-op thread, so that a busy machine (ctest's parallel tests) does not
  // leave a second one spinning.
  at::set_num_threads(1);
  auto comm = zt::make_communicator(zt::RendezvousInfo{}, zt::CommOptions{});
  for (RunOptions o : device_variants()) {
    o.steps = 4;
    RunOptions unstaged = o;
    unstaged.reload = false;
    const RunResult reference = train(comm, unstaged);
    for (double norm : reference.grad_norms) ASSERT_GT(norm, 0.0) << describe(o);
    o.host_staging = true;
    zt::testing::expect_bitwise_equal(reference, train(comm, o), describe(o));
  }
}

// A model whose first parameter is in a block built sharded for the device: until the engine
// adopts it that parameter has no data and lies on the host. The engine's reports must still
// synchronise and measure the device it computes on (the flops profiler's peak, measured there).
struct BlocksFirstImpl : torch::nn::Module {
  BlocksFirstImpl() {
    body = register_module("body", torch::nn::Linear(64, 64));
    zt::mark_block(body.ptr());
    head = register_module("head", torch::nn::Linear(64, 8));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return head(zt::run_block(*body, x, [&](const at::Tensor& in) { return torch::relu(body(in)); }));
  }
  torch::nn::Linear body{nullptr}, head{nullptr};
};
TORCH_MODULE(BlocksFirst);

TEST(DeviceParity, AModelBuiltShardedIsProfiledOnTheTestDevice) {
  const zt::testing::TestDevice device = zt::testing::test_device();
  if (!device.skip_reason.empty()) GTEST_SKIP() << device.skip_reason;
  if (device.device.is_cpu())
    GTEST_SKIP() << "ZT_TEST_DEVICE is cpu: the profiler measures the CPU there by design (set ZT_TEST_DEVICE=cuda on a GPU)";
  auto comm = zt::make_communicator(zt::RendezvousInfo{}, zt::CommOptions{});
  const auto config = zt::parse_config(R"({"train_micro_batch_size_per_gpu": 4, "steps_per_print": 1000,
      "optimizer": {"type": "AdamW", "params": {"lr": 0.001}}, "zero_optimization": {"stage": 3},
      "wall_clock_breakdown": true, "flops_profiler": {"enabled": true, "profile_step": 2}})",
                                       {}, 1);
  torch::manual_seed(5);
  std::optional<zt::ShardedConstruction> sharded;
  sharded.emplace(0, 1, device.device);
  BlocksFirst model;
  sharded.reset();
  zt::move_model(*model, device.device);
  ASSERT_TRUE(model->parameters().front().device().is_cpu()) << "the block's parameter should still be on the host";
  zt::Engine engine(model.ptr(), config, comm);
  engine.set_report_sink([](const std::string&) {});  // quiet, the profile still taken
  for (int step = 0; step < 3; ++step) {
    auto x = torch::randn({4, 64}).to(device.device);
    engine.note_forward_start();
    auto loss = model->forward(x).square().mean();
    engine.note_forward_end();
    engine.backward(loss);
    engine.step();
  }
  const zt::FlopsReport* report = engine.flops_report();
  ASSERT_NE(report, nullptr);
  EXPECT_NE(report->peak_source.find(device.device.str()), std::string::npos) << report->peak_source;
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
