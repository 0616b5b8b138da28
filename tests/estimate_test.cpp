// The memory estimator (zerotrain/memory/estimate.h): the model-state table of docs/design.md
// "Memory per parameter" for every stage, precision and world size; the GPT's and the Llama's
// figures against the models; activations against the bytes autograd really keeps; the estimate
// against measured runs of `zerotrain train`; the planner's picks for scripted machines; the CLI.
#include <c10/core/CPUAllocator.h>
#include <gtest/gtest.h>

#include <optional>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "support/counting_allocator.h"
#include "support/process.h"
#include "zerotrain/config/config.h"
#include "zerotrain/error.h"
#include "zerotrain/memory/estimate.h"
#include "zerotrain/memory/memory.h"
#include "zerotrain/models/gpt.h"
#include "zerotrain/models/llama.h"
#include "zerotrain/memory/step_time.h"

namespace {

using zt::testing::cli_path;
using zt::testing::make_temp_dir;
using zt::testing::run_process;

constexpr int64_t kGiB = int64_t(1) << 30;

zt::TrainConfig config_for(int world, const std::vector<std::string>& overrides) {
  return zt::parse_config("", overrides, world);
}

zt::ClusterSpec cluster_of(int nodes, int per_node, int64_t device_memory = 0, int64_t host_memory = 0,
                           int64_t nvme = 0) {
  zt::ClusterSpec c;
  c.nodes = nodes;
  c.devices_per_node = per_node;
  c.device_memory = device_memory;
  c.host_memory = host_memory;
  c.nvme_bytes = nvme;
  return c;
}

// docs/design.md "Memory per parameter", written out per role: {parameters, gradients, optimizer
// states} bytes per rank.
struct TableRow {
  int64_t parameters, gradients, optimizer_states;
};
TableRow design_table(int stage, bool mixed, int64_t psi, int64_t n) {
  const int64_t w = mixed ? 2 : 4, g = w, k = mixed ? 12 : 8;  // Adam: fp32 master (mixed) + two moments
  switch (stage) {
    case 0: return {w * psi, g * psi, k * psi};
    case 1: return {w * psi, g * psi, k * psi / n};
    case 2: return {w * psi, g * psi / n, k * psi / n};
    default: return {w * psi / n, g * psi / n, k * psi / n};
  }
}

TEST(EstimateFormula, ModelStatesFollowDesignTableForEveryStagePrecisionAndWorldSize) {
  const int64_t psi = 1'000'000'007;  // divisible by none of the world sizes
  zt::ModelFigures model;
  model.parameters = psi;
  model.largest_block = psi / 10;
  model.persistent_parameters = 0;
  int cases = 0;
  for (const char* precision : {"fp32", "bf16", "fp16"})
    for (int stage = 0; stage <= 3; ++stage)
      for (int n : {1, 2, 3, 8, 64, 1000}) {
        std::vector<std::string> o = {"zero_optimization.stage=" + std::to_string(stage)};
        if (std::string(precision) == "bf16") o.push_back("bf16.enabled=true");
        if (std::string(precision) == "fp16") o.push_back("fp16.enabled=true");
        const zt::TrainConfig config = config_for(n, o);
        const zt::MemoryEstimate e = zt::estimate_memory(model, cluster_of(1, n), config);
        const bool mixed = std::string(precision) != "fp32";
        const TableRow row = design_table(stage, mixed, psi, n);
        SCOPED_TRACE(::testing::Message() << precision << " stage " << stage << " N=" << n);
        EXPECT_EQ(e.per_device.parameters, row.parameters);
        EXPECT_EQ(e.per_device.gradients, row.gradients);
        // The table divides 12Ψ as a whole; the estimate splits it into masters and moments.
        EXPECT_NEAR(double(e.per_device.optimizer_states()), double(row.optimizer_states), 2.0);
        const int64_t opt_n = stage >= 1 ? n : 1;
        EXPECT_EQ(e.per_device.master_weights, mixed ? 4 * psi / opt_n : 0);
        EXPECT_EQ(e.per_device.optimizer_moments, 8 * psi / opt_n);
        if (stage == 0) EXPECT_EQ(e.per_device.parameters + e.per_device.gradients + e.per_device.optimizer_states(),
                                  (mixed ? 16 : 16) * psi);
        ++cases;
      }
  EXPECT_EQ(cases, 72);
}

TEST(EstimateFormula, PersistentParametersAddWholeCopiesOnlyWhenParametersAreSharded) {
  zt::ModelFigures model;
  model.parameters = 1'000'000;
  model.largest_block = 100'000;
  model.persistent_parameters = 12'345;
  for (int stage : {2, 3}) {
    const auto config = config_for(4, {"zero_optimization.stage=" + std::to_string(stage), "bf16.enabled=true"});
    const auto e = zt::estimate_memory(model, cluster_of(1, 4), config);
    EXPECT_EQ(e.per_device.parameters, stage == 3 ? 2 * 1'000'000 / 4 + 2 * 12'345 : 2 * 1'000'000) << stage;
  }
}

// Stage 3 gathers the block computing plus the blocks prefetched ahead within
// min(stage3_prefetch_bucket_size, stage3_max_live_parameters), at least the next one, never more
// than the model; the gather pool's own limit (two largest blocks) is the floor.
TEST(EstimateFormula, GatheredBlocksFollowThePrefetchBudget) {
  zt::ModelFigures model;
  model.parameters = 100'000'000;
  model.largest_block = 1'000'000;
  auto gathered = [&](const std::vector<std::string>& extra) {
    // Every block released after each use: the prefetch alone (the reuse rule: the next test).
    std::vector<std::string> o = {"zero_optimization.stage=3", "zero_optimization.stage3_max_reuse_distance=0"};
    o.insert(o.end(), extra.begin(), extra.end());
    return zt::estimate_memory(model, cluster_of(1, 2), config_for(2, o)).per_device.gathered_blocks;
  };
  EXPECT_EQ(gathered({}), (1'000'000 + 50'000'000) * 4);  // default budget 5e7: fifty blocks ahead
  EXPECT_EQ(gathered({"zero_optimization.stage3_prefetch_bucket_size=0"}), 2 * 1'000'000 * 4);
  EXPECT_EQ(gathered({"zero_optimization.stage3_prefetch_bucket_size=2500000"}), (1'000'000 + 3'000'000) * 4);
  EXPECT_EQ(gathered({"zero_optimization.stage3_max_live_parameters=1"}), 2 * 1'000'000 * 4);
  EXPECT_EQ(gathered({"zero_optimization.stage3_max_live_parameters=3000000"}), 3 * 1'000'000 * 4);
  EXPECT_EQ(gathered({"zero_optimization.stage3_prefetch_bucket_size=1000000000"}), 100'000'000 * 4);
  EXPECT_EQ(zt::estimate_memory(model, cluster_of(1, 2), config_for(2, {"zero_optimization.stage=2"})).per_device.gathered_blocks, 0);
}

// Blocks kept gathered for their next use (stage3_max_reuse_distance) are live together at the
// turn from forward to backward. Without a known block order the blocks are taken as equal and used
// once each: the j-th from the last has 2j blocks' uses before its backward.
TEST(EstimateFormula, GatheredBlocksFollowTheReuseDistance) {
  zt::ModelFigures model;
  model.parameters = 100'000'000;
  model.largest_block = 1'000'000;
  auto gathered = [&](const std::vector<std::string>& extra) {
    std::vector<std::string> o = {"zero_optimization.stage=3", "zero_optimization.stage3_prefetch_bucket_size=0"};
    o.insert(o.end(), extra.begin(), extra.end());
    return zt::estimate_memory(model, cluster_of(1, 2), config_for(2, o)).per_device.gathered_blocks;
  };
  EXPECT_EQ(gathered({}), 100'000'000 * 4) << "the default 1e9 keeps every block of a 100M model";
  EXPECT_EQ(gathered({"zero_optimization.stage3_max_reuse_distance=0"}), 2 * 1'000'000 * 4);
  // 20M: the last ten blocks (2j < 20 blocks of uses), plus the one computing.
  EXPECT_EQ(gathered({"zero_optimization.stage3_max_reuse_distance=20000000"}), 11 * 1'000'000 * 4);
  EXPECT_EQ(gathered({"zero_optimization.stage3_max_reuse_distance=20000001"}), 12 * 1'000'000 * 4);

  // GPT-2 124M in fp32 (its block order known): at 1e9 every block, wte (38.6M) counted once; a
  // distance just above the last layer's keeps it, ln_f and the head, the bounds of the rest.
  const zt::GPTConfig gpt = zt::gpt_preset("gpt2-124m");
  const zt::ModelFigures figures = zt::gpt_model_figures(gpt, 64, 100'000);
  int64_t all_blocks = 0;
  for (int64_t numel : figures.block_gathered) all_blocks += numel;
  EXPECT_EQ(all_blocks, figures.parameters - figures.persistent_parameters);
  auto gathered_gpt = [&](const std::string& distance) {
    return zt::estimate_memory(figures, cluster_of(1, 2),
                               config_for(2, {"zero_optimization.stage=3", "zero_optimization.stage3_prefetch_bucket_size=0",
                                              "zero_optimization.stage3_max_reuse_distance=" + distance}))
        .per_device.gathered_blocks;
  };
  EXPECT_EQ(gathered_gpt("1000000000"), all_blocks * 4);
  const int64_t wte = 50257 * 768, layer = 12 * 768 * 768;  // a layer's matrices; its vectors are persistent
  ASSERT_EQ(figures.largest_block, wte);
  // The last layer's next use comes after the head's two (ln_f is persistent: nothing): kept, with
  // the head, beside the largest block computing.
  EXPECT_EQ(gathered_gpt(std::to_string(2 * wte + 1)), (wte + layer + wte) * 4);
  EXPECT_EQ(gathered_gpt(std::to_string(2 * wte)), (wte + wte) * 4) << "the head alone";
}

TEST(EstimateFormula, OffloadMovesTheShardedTermsToHostOrNvme) {
  zt::ModelFigures model;
  model.parameters = 8'000'000'000;
  model.largest_block = 200'000'000;
  // Every block released after its use (the default reuse distance would keep some: below).
  const auto config = config_for(8, {"zero_optimization.stage=3", "bf16.enabled=true",
                                     "zero_optimization.stage3_max_reuse_distance=0"});
  const auto cluster = cluster_of(1, 8, 80 * kGiB, 1024 * kGiB, 0);
  zt::EstimateOptions cpu;
  cpu.offload_optimizer = zt::OffloadTarget::Cpu;
  cpu.offload_param = zt::OffloadTarget::Cpu;
  const auto e = zt::estimate_memory(model, cluster, config, cpu);
  // With offload, what stays on the device at stage 3 is the live gathered layers, the slots the
  // shards cross through (5 of a block's shard) and, as the engine keeps them, the reduced
  // gradient partition.
  EXPECT_EQ(e.per_device.parameters, 0);
  EXPECT_EQ(e.per_device.gradients, 2 * model.parameters / 8);
  EXPECT_EQ(e.per_device.optimizer_states(), 0);
  EXPECT_EQ(e.per_device.gathered_blocks, 2 * 2 * 200'000'000);
  // At the default 1e9: the last three blocks kept (2j blocks of uses < 5 blocks), the one
  // computing and one prefetched (5e7 elements, at least one block).
  const auto kept = zt::estimate_memory(model, cluster, config_for(8, {"zero_optimization.stage=3", "bf16.enabled=true"}), cpu);
  EXPECT_EQ(kept.per_device.gathered_blocks, 2 * 5 * 200'000'000);
  // Per host: eight ranks' masters + moments (12Ψ/8 each), the 16-bit snapshot of the owned
  // gradients and the 16-bit parameter shards, which the step writes in place (no second copy).
  EXPECT_EQ(e.per_host.optimizer_states(), 8 * (12 * model.parameters / 8));
  EXPECT_EQ(e.per_host.gradients, 8 * (2 * model.parameters / 8));
  EXPECT_EQ(e.per_host.parameters, 8 * (2 * model.parameters / 8));
  EXPECT_EQ(e.per_host.buffers, 8 * (int64_t{1} << 20) * 4);  // the fp32 conversion chunk
  const auto without_param = [&] {
    zt::EstimateOptions o = cpu;
    o.offload_param = zt::OffloadTarget::None;
    return zt::estimate_memory(model, cluster, config, o);
  }();
  EXPECT_EQ(e.per_device.buffers - without_param.per_device.buffers, 5 * (200'000'000 / 8) * 2);  // the slots
  for (const std::string& note : e.notes) EXPECT_EQ(note.find("not implement"), std::string::npos) << note;

  zt::EstimateOptions nvme;
  nvme.offload_optimizer = zt::OffloadTarget::Nvme;
  const auto n = zt::estimate_memory(model, cluster, config, nvme);
  // Each rank's partition is 40 block shards of 25e6 elements, one sub-group each; every role's
  // sub-group lies in its file at a 4 KiB-aligned size (1e8 B is not a multiple of 4096).
  const int64_t aligned_sub_group = (100'000'000 + 4095) / 4096 * 4096;
  EXPECT_EQ(n.nvme_per_node, 8 * 40 * 3 * aligned_sub_group);
  EXPECT_FALSE(n.exact_partition);
  EXPECT_EQ(n.per_host.optimizer_states(), 0);
  EXPECT_GT(n.per_host.buffers, 0);  // sub-groups swapped through host memory

  EXPECT_THROW(zt::estimate_memory(model, cluster, config_for(8, {"zero_optimization.stage=2"}), cpu),
               zt::ConfigError);  // parameters offloaded without sharding them
  zt::EstimateOptions opt_only;
  opt_only.offload_optimizer = zt::OffloadTarget::Cpu;
  EXPECT_THROW(zt::estimate_memory(model, cluster, config_for(8, {}), opt_only), zt::ConfigError);  // stage 0
  EXPECT_THROW(zt::estimate_memory(model, cluster_of(1, 4), config), zt::ConfigError);  // world 8 vs 4
}

// The nvme tiers as the engine keeps them, for a small model whose terms are worked out by hand:
// Ψ = 2^20 on 2 CPU ranks at stage 3, so each rank's partition is P = 524288 elements and its
// largest block shard 65536 / 2 = 32768 elements. Its partition shape is approximated from these
// counts: 16 blocks of one bucket each, so every sub-group is at most one block shard (a
// sub-group never straddles a bucket's shard).
struct NvmeCase {
  zt::ModelFigures model;
  zt::ClusterSpec cluster;
  NvmeCase() {
    model.parameters = 1 << 20;
    model.largest_block = 65536;
    model.largest_parameter = 65536;
    model.persistent_parameters = 0;
    cluster = cluster_of(1, 2);
    cluster.device = zt::DeviceKind::Cpu;
  }
  zt::MemoryEstimate with(std::vector<std::string> overrides, const zt::EstimateOptions& options = {}) const {
    overrides.insert(overrides.begin(), "zero_optimization.stage=3");
    return zt::estimate_memory(model, cluster, config_for(2, overrides), options);
  }
};

const std::vector<std::string> kOptimizerOnNvme = {"zero_optimization.offload_optimizer.device=nvme",
                                                   "zero_optimization.offload_optimizer.nvme_path=d"};
const std::vector<std::string> kParamsOnNvme = {"zero_optimization.offload_param.device=nvme",
                                                "zero_optimization.offload_param.nvme_path=d"};

std::vector<std::string> operator+(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

TEST(EstimateOffload, OptimizerAndParametersOnNvmeInMixedPrecision) {
  const NvmeCase k;
  const int64_t P = 524288;
  const std::vector<std::string> settings = {"bf16.enabled=true", "zero_optimization.sub_group_size=100000",
                                             "zero_optimization.offload_optimizer.buffer_count=3",
                                             "zero_optimization.offload_param.buffer_count=2",
                                             "zero_optimization.offload_param.buffer_size=40000",
                                             "zero_optimization.offload_param.max_in_cpu=10000"};
  const auto base = k.with(settings);
  const auto e = k.with(settings + kOptimizerOnNvme + kParamsOnNvme);
  EXPECT_EQ(e.offload_optimizer, zt::OffloadTarget::Nvme);
  EXPECT_EQ(e.offload_param, zt::OffloadTarget::Nvme);
  // On NVMe: fp32 masters (4 B) and Adam's moments (8 B) of the partition, the 16-bit shard (2 B).
  EXPECT_EQ(e.nvme_per_rank.master_weights, 4 * P);
  EXPECT_EQ(e.nvme_per_rank.optimizer_moments, 8 * P);
  EXPECT_EQ(e.nvme_per_rank.parameters, 2 * P);
  EXPECT_EQ(e.nvme_per_node, 2 * 14 * P);
  // In memory: no optimizer state; no block shard (32768 elements each) fits in max_in_cpu, so
  // none is kept; the gradient partition as before.
  EXPECT_EQ(e.per_device.optimizer_states(), 0);
  EXPECT_EQ(e.per_device.parameters, 0);
  EXPECT_EQ(e.per_device.gradients, base.per_device.gradients);
  EXPECT_EQ(e.per_device.gradients, 2 * P);
  // Buffers: 3 sub-groups of one block shard (32768 elements, below sub_group_size) of 4 + 8 + 2 B
  // (master, moments, the 16-bit result for the parameter tier), and 2 block shards of 32768
  // 16-bit elements; gathered blocks as without offload.
  EXPECT_EQ(e.per_device.gathered_blocks, base.per_device.gathered_blocks);
  EXPECT_EQ(e.per_device.buffers - base.per_device.buffers, 3 * 32768 * 14 + 2 * 32768 * 2);
  EXPECT_EQ(e.offload_host_buffers_per_rank - base.offload_host_buffers_per_rank, 3 * 32768 * 14 + 2 * 32768 * 2);
  for (const std::string& note : e.notes) EXPECT_EQ(note.find("not implement"), std::string::npos) << note;
  // With CPU devices all of it is the devices' memory: nothing is counted twice in host memory.
  EXPECT_EQ(e.per_host.total(), 2 * e.per_device.total());
}

TEST(EstimateOffload, Fp32ReadsTheMasterFromTheParameterTier) {
  const NvmeCase k;
  const int64_t P = 524288;
  const auto base = k.with({});
  // fp32: no separate masters; the working partition (on the parameter tier) is the master, read
  // into the same buffer: 8 B of moments + 4 B per buffer element, sub-groups of one block shard
  // each (sub_group_size 1e9), 4 buffers by default.
  const auto both = k.with(kOptimizerOnNvme + kParamsOnNvme + std::vector<std::string>{"zero_optimization.offload_param.max_in_cpu=0"});
  EXPECT_EQ(both.nvme_per_rank.master_weights, 0);
  EXPECT_EQ(both.nvme_per_rank.optimizer_moments, 8 * P);
  EXPECT_EQ(both.nvme_per_rank.parameters, 4 * P);
  EXPECT_EQ(both.per_device.parameters, 0);
  EXPECT_EQ(both.per_device.buffers - base.per_device.buffers, 4 * 32768 * (8 + 4) + 5 * 32768 * 4);
  // The optimizer tier alone: buffer elements hold the moments only; parameters stay in memory.
  const auto opt = k.with(kOptimizerOnNvme);
  EXPECT_EQ(opt.nvme_per_rank.total(), 8 * P);
  EXPECT_EQ(opt.per_device.parameters, base.per_device.parameters);
  EXPECT_EQ(opt.per_device.buffers - base.per_device.buffers, 4 * 32768 * 8);
  // SGD with momentum: 4 B of moments per element.
  const auto sgd = k.with(kOptimizerOnNvme + std::vector<std::string>{"optimizer.type=SGD", "optimizer.params.momentum=0.9"});
  EXPECT_EQ(sgd.nvme_per_rank.optimizer_moments, 4 * P);
}

// The delayed update (docs/offload.md): fp32 masters of their own, where the optimizer state is;
// a snapshot of the owned gradients in memory; a second working copy beside the working shards.
TEST(EstimateOffload, DelayedUpdateAddsMastersASnapshotAndASecondWorkingCopy) {
  const NvmeCase k;
  const int64_t P = 524288;
  const std::vector<std::string> delayed = {"zero_optimization.offload_optimizer.delayed_update=true"};
  const std::vector<std::string> cpu = {"zero_optimization.offload_optimizer.device=cpu"};
  const auto in_memory = k.with(cpu), in_memory_delayed = k.with(cpu + delayed);
  EXPECT_EQ(in_memory_delayed.per_device.master_weights - in_memory.per_device.master_weights, 4 * P);
  EXPECT_EQ(in_memory_delayed.per_device.buffers - in_memory.per_device.buffers, 2 * 4 * P);
  EXPECT_EQ(in_memory_delayed.nvme_per_node, 0);
  const std::vector<std::string> nvme =
      kOptimizerOnNvme + kParamsOnNvme + std::vector<std::string>{"zero_optimization.offload_param.max_in_cpu=0"};
  const auto on_disk = k.with(nvme), on_disk_delayed = k.with(nvme + delayed);
  EXPECT_EQ(on_disk_delayed.nvme_per_rank.master_weights, 4 * P);
  EXPECT_EQ(on_disk_delayed.nvme_per_rank.optimizer_moments, 8 * P);
  EXPECT_EQ(on_disk_delayed.nvme_per_rank.parameters, 2 * 4 * P);
  EXPECT_EQ(on_disk_delayed.per_device.master_weights, 0);
  // Each of the 4 stream buffers (one block shard's sub-group) holds the master too, and the
  // snapshot is in memory; the next working copy is on NVMe with the working shards.
  EXPECT_EQ(on_disk_delayed.per_device.buffers - on_disk.per_device.buffers, 4 * 32768 * 4 + 4 * P);
}

// nvme_gradients (docs/offload.md "Gradients on NVMe"): the gradient partition of the state on
// NVMe moves there; the stream buffers carry it; each bucket buffer gets a staging shard.
TEST(EstimateOffload, NvmeGradientsMoveTheGradientPartition) {
  const NvmeCase k;
  const int64_t P = 524288;
  const auto base = k.with(kOptimizerOnNvme);
  const auto e = k.with(kOptimizerOnNvme + std::vector<std::string>{"zero_optimization.offload_optimizer.nvme_gradients=true"});
  EXPECT_EQ(e.nvme_per_rank.gradients, 4 * P);
  EXPECT_EQ(base.per_device.gradients, 4 * P);
  EXPECT_EQ(e.per_device.gradients, 0);
  // 4 stream buffers of one block shard's sub-group, 4 B more per element; the largest bucket is
  // the largest block (65536), whose shard (32768 fp32 elements) is staged aligned and added in a
  // scratch.
  const int64_t buffers = config_for(2, {"zero_optimization.stage=3"}).zero.overlap_comm ? 2 : 1;
  EXPECT_EQ(e.per_device.buffers - base.per_device.buffers, 4 * 32768 * 4 + buffers * 2 * 32768 * 4);
  // Refused at stage 1, whose gradients are whole until reduced.
  EXPECT_THROW(config_for(2, kOptimizerOnNvme + std::vector<std::string>{"zero_optimization.stage=1",
                                                                        "zero_optimization.offload_optimizer.nvme_gradients=true"}),
               zt::ConfigError);
}

TEST(EstimateOffload, RatioKeepsThePartOfTheStateInHostMemory) {
  const NvmeCase k;
  const int64_t P = 524288, on_nvme = P / 4, in_memory = P - on_nvme;
  const auto base = k.with({"bf16.enabled=true"});
  const auto e = k.with(kOptimizerOnNvme + std::vector<std::string>{"bf16.enabled=true",
                                                                    "zero_optimization.offload_optimizer.ratio=0.25"});
  EXPECT_EQ(e.nvme_per_rank.master_weights, 4 * on_nvme);
  EXPECT_EQ(e.nvme_per_rank.optimizer_moments, 8 * on_nvme);
  EXPECT_EQ(e.per_device.master_weights, 4 * in_memory);
  EXPECT_EQ(e.per_device.optimizer_moments, 8 * in_memory);
  // Whole sub-groups: the first 4 block shards of 32768 elements are the quarter on NVMe; each
  // stream buffer holds one of them.
  EXPECT_EQ(e.per_device.buffers - base.per_device.buffers, 4 * 32768 * 12);
}

TEST(EstimateOffload, CpuTierOnCpuDevicesIsTheMemoryInUse) {
  const NvmeCase k;
  const auto base = k.with({"bf16.enabled=true"});
  const auto cpu = k.with({"bf16.enabled=true", "zero_optimization.offload_optimizer.device=cpu",
                           "zero_optimization.offload_param.device=cpu"});
  EXPECT_EQ(cpu.per_device.total(), base.per_device.total());
  EXPECT_EQ(cpu.per_host.total(), base.per_host.total());
  EXPECT_EQ(cpu.nvme_per_node, 0);
  EXPECT_EQ(cpu.offload_optimizer, zt::OffloadTarget::Cpu);
}

TEST(EstimateOffload, FlagsWinAndTheParameterBufferMustHoldABlockShard) {
  const NvmeCase k;
  zt::EstimateOptions none;
  none.offload_optimizer = zt::OffloadTarget::None;
  none.offload_param = zt::OffloadTarget::None;
  const auto overridden = k.with(kOptimizerOnNvme + kParamsOnNvme, none);
  EXPECT_EQ(overridden.offload_optimizer, zt::OffloadTarget::None);
  EXPECT_EQ(overridden.nvme_per_node, 0);
  EXPECT_EQ(overridden.per_device.total(), k.with({}).per_device.total());
  // Options name the tier; the configuration still gives its settings (buffer_count 2 here).
  zt::EstimateOptions nvme;
  nvme.offload_optimizer = zt::OffloadTarget::Nvme;
  const auto two = k.with({"zero_optimization.offload_optimizer.buffer_count=2"}, nvme);
  EXPECT_EQ(two.per_device.buffers - k.with({}).per_device.buffers, 2 * 32768 * 8);
  // The largest block shard (32768 elements) does not fit a 30000-element parameter buffer.
  try {
    k.with(kParamsOnNvme + std::vector<std::string>{"zero_optimization.offload_param.buffer_size=30000"});
    ADD_FAILURE() << "no ConfigError";
  } catch (const zt::ConfigError& error) {
    EXPECT_STREQ(error.what(),
                 "zero_optimization.offload_param.buffer_size: expected at least the largest block's shard per rank "
                 "(32768 elements), found 30000");
  }
}

TEST(EstimateOffload, CudaDevicesKeepTheNvmeBuffersInHostMemory) {
  NvmeCase k;
  k.cluster.device = zt::DeviceKind::Cuda;
  const std::vector<std::string> settings = {"bf16.enabled=true", "zero_optimization.offload_param.max_in_cpu=0"};
  const auto e = k.with(settings + kOptimizerOnNvme + kParamsOnNvme);
  // Per host (two ranks): the sub-group buffers (4 × 32768 × 14 B), the block-shard buffers
  // (5 × 32768 × 2 B) and the fp32 conversion chunk, and the 16-bit snapshot of the owned gradients.
  EXPECT_EQ(e.per_host.buffers, 2 * (4 * 32768 * 14 + 5 * 32768 * 2 + 524288 * 4));
  EXPECT_EQ(e.per_host.gradients, 2 * 2 * 524288);
  EXPECT_EQ(e.per_host.parameters, 0);
  EXPECT_EQ(e.per_device.parameters, 0);
  EXPECT_EQ(e.per_device.optimizer_states(), 0);
}

// Optimizer offload with the model on a GPU: the engine reaches the host state through two host
// copies of its partition in the working dtype, each allocated once at its exact size (the
// gradient snapshot and the working values the step writes), the delayed update adds nothing to
// them, the fp32 masters are separate from the working values in fp32 training too, and 16-bit
// gradients reach the CPU kernels through one fp32 chunk.
TEST(EstimateOffload, OnAGpuTheHostHoldsTwoWorkingDtypeCopiesOfThePartition) {
  zt::ModelFigures model;
  model.parameters = int64_t{3} << 20;
  model.largest_block = 65536;
  model.largest_parameter = 65536;
  model.persistent_parameters = 0;
  zt::ClusterSpec cluster = cluster_of(1, 2);
  cluster.device = zt::DeviceKind::Cuda;
  const int64_t P = model.parameters / 2;  // each rank's partition
  for (const bool bf16 : {true, false})
    for (const bool delayed : {false, true}) {
      std::vector<std::string> overrides = {"zero_optimization.stage=2", "zero_optimization.offload_optimizer.device=cpu",
                                            std::string("bf16.enabled=") + (bf16 ? "true" : "false")};
      if (delayed) overrides.push_back("zero_optimization.offload_optimizer.delayed_update=true");
      const auto e = zt::estimate_memory(model, cluster, config_for(2, overrides));
      const std::string label = std::string(bf16 ? "bf16" : "fp32") + (delayed ? " delayed" : "");
      const int64_t w = bf16 ? 2 : 4;
      const int64_t chunk = bf16 ? std::min<int64_t>(P, 1 << 20) * 4 : 0;
      EXPECT_EQ(e.per_host.gradients, 2 * w * P) << label;
      EXPECT_EQ(e.per_host.buffers, 2 * (w * P + chunk)) << label;
      EXPECT_EQ(e.per_host.master_weights, 2 * 4 * P) << label;  // fp32 too: the working values are on the GPU
      EXPECT_EQ(e.per_host.optimizer_moments, 2 * 8 * P) << label;
      EXPECT_EQ(e.per_device.gradients, w * P) << label;  // the reduced partition stays on the GPU too
      EXPECT_EQ(e.per_device.optimizer_states(), 0) << label;
    }
}

zt::GPTConfig gpt_shape(int64_t vocab, int64_t context, int64_t layers, int64_t width, double dropout = 0.0) {
  zt::GPTConfig gpt;
  gpt.vocab_size = vocab;
  gpt.context_length = context;
  gpt.n_layer = layers;
  gpt.n_head = 4;
  gpt.n_embd = width;
  gpt.dropout = dropout;
  return gpt;
}

// The training data (ModelFigures::data_bytes) is host memory held from set-up on: under both
// moments on a CPU device, in each rank's share of the host on a GPU, and in the check before
// launch.
TEST(EstimateData, DataBytesCountInHostMemoryUnderBothMoments) {
  const zt::TrainConfig config = config_for(2, {"model.preset=tiny", "zero_optimization.stage=2"});
  zt::ModelFigures figures = zt::gpt_model_figures(zt::gpt_config_of(config), 64, 0);
  zt::ClusterSpec cpu = cluster_of(1, 2);
  cpu.device = zt::DeviceKind::Cpu;
  const zt::MemoryEstimate without = zt::estimate_memory(figures, cpu, config);
  EXPECT_EQ(without.per_device.data, 0);
  const int64_t data = 48 << 20;
  figures.data_bytes = data;
  const zt::MemoryEstimate with = zt::estimate_memory(figures, cpu, config);
  EXPECT_EQ(with.per_device.data, data);
  EXPECT_EQ(with.per_device.total() - without.per_device.total(), data);
  EXPECT_EQ(with.step_peak - without.step_peak, data);
  EXPECT_EQ(with.construction_peak - without.construction_peak, data);
  EXPECT_EQ(with.per_host.total() - without.per_host.total(), 2 * data);

  zt::ClusterSpec gpu = cluster_of(1, 2);
  gpu.device = zt::DeviceKind::Cuda;
  figures.data_bytes = 0;
  const zt::MemoryEstimate gpu_without = zt::estimate_memory(figures, gpu, config);
  figures.data_bytes = data;
  const zt::MemoryEstimate gpu_with = zt::estimate_memory(figures, gpu, config);
  EXPECT_EQ(gpu_with.per_device.total(), gpu_without.per_device.total()) << "not on the GPU";
  EXPECT_EQ(gpu_with.per_host.data, 2 * data);
  EXPECT_EQ(gpu_with.per_host.total() - gpu_without.per_host.total(), 2 * data);

  // A machine where the run fits without its data and not with it.
  zt::ClusterSpec tight = cpu;
  tight.headroom = 0;
  tight.host_memory = without.per_host.total() + data;
  EXPECT_TRUE(zt::estimate_memory(figures, tight, config).fits_host == false);
  figures.data_bytes = 0;
  EXPECT_TRUE(zt::estimate_memory(figures, tight, config).fits_host);
  figures.data_bytes = -1;
  EXPECT_THROW(zt::estimate_memory(figures, cpu, config), zt::ConfigError);
}

TEST(EstimateFormula, GptFiguresMatchTheModel) {
  const zt::GPTConfig gpt = gpt_shape(300, 40, 3, 64);
  torch::manual_seed(0);
  zt::GPT model(gpt);
  int64_t total = 0, largest = 0, small = 0;
  const int64_t threshold = 5000;
  for (const auto& p : model->parameters()) {
    total += p.numel();
    largest = std::max(largest, p.numel());
    if (p.numel() < threshold) small += p.numel();
  }
  const zt::ModelFigures f = zt::gpt_model_figures(gpt, 32, threshold);
  EXPECT_EQ(f.parameters, total);
  EXPECT_EQ(f.largest_parameter, largest);
  EXPECT_EQ(f.persistent_parameters, small);
  // A layer's gathered part: its weight matrices of 5000 elements or more (c_attn 3C², c_fc and
  // mlp.c_proj 4C² each; attn.c_proj's C² = 4096 stays whole); the embedding is smaller here.
  EXPECT_EQ(f.largest_block, 3 * 64 * 64 + 4 * 64 * 64 + 4 * 64 * 64);
  EXPECT_EQ(f.sequence_length, 32);
}

// A Llama's figures: its parameter list is the model's, name for name and shape for shape in
// registration order (biases, grouped-query k/v widths and an untied head included), and its
// counts follow from it; Llama 3.2 1B's count is the closed form's, without building it.
TEST(EstimateFormula, LlamaFiguresMatchTheModel) {
  zt::LlamaConfig untied = zt::llama_preset("llama-tiny");  // 4 heads, 2 kv heads
  untied.intermediate_size = 96;
  untied.qkv_bias = true;
  zt::LlamaConfig tied = untied;
  tied.qkv_bias = false;
  tied.tie_word_embeddings = true;
  tied.num_key_value_heads = 1;
  const int64_t threshold = 5000;
  for (const zt::LlamaConfig& c : {untied, tied}) {
    SCOPED_TRACE(c.tie_word_embeddings ? "tied" : "untied");
    torch::manual_seed(0);
    zt::Llama model(c);
    const zt::ModelFigures f = zt::llama_model_figures(c, 32, threshold);
    const auto named = model->named_parameters();
    ASSERT_EQ(f.parameter_list.size(), named.size());
    int64_t total = 0, largest = 0, small = 0;
    for (size_t i = 0; i < named.size(); ++i) {
      EXPECT_EQ(f.parameter_list[i].name, named[i].key());
      EXPECT_EQ(f.parameter_list[i].shape, named[i].value().sizes().vec()) << named[i].key();
      const int64_t n = named[i].value().numel();
      total += n;
      largest = std::max(largest, n);
      if (n < threshold) small += n;
    }
    EXPECT_EQ(f.parameters, total);
    EXPECT_EQ(f.largest_parameter, largest);
    EXPECT_EQ(f.persistent_parameters, small);
    // A layer's gathered part: its tensors of 5000 elements or more, the SwiGLU's three 64·96
    // (q and o are 64², k and v 64·32 or 64·16), more than the embedding's 256·64.
    EXPECT_EQ(f.largest_block, 3 * 64 * 96);
    // Blocks: the embedding, 2 layers, the norm (and the untied head); the tied head is the embedding again.
    ASSERT_EQ(f.block_gathered.size(), c.tie_word_embeddings ? 4u : 5u);
    EXPECT_EQ(f.block_gathered[0], 256 * 64);
    EXPECT_EQ(f.block_gathered[1], 3 * 64 * 96);
    EXPECT_EQ(f.forward_block_order.back(), c.tie_word_embeddings ? 0 : 4);
    EXPECT_EQ(f.sequence_length, 32);
    EXPECT_EQ(f.intermediate, 96);
    EXPECT_EQ(f.kv_heads, c.num_key_value_heads);
  }
  // Llama 3.2 1B: V·H (tied) + 16 layers of q and o (2048²), k and v (2048·512), the SwiGLU
  // (3·2048·8192) and two norms, + the final norm.
  const zt::ModelFigures one_b = zt::llama_model_figures(zt::llama_preset("llama-1b"), 2048, 100000);
  const int64_t layer = 2 * 2048 * 2048 + 2 * 2048 * 512 + 3 * 2048 * 8192 + 2 * 2048;
  EXPECT_EQ(one_b.parameters, 128256LL * 2048 + 16 * layer + 2048);
  EXPECT_EQ(one_b.parameters, 1235814400);
  int64_t listed = 0;
  for (const auto& p : one_b.parameter_list) {
    int64_t n = 1;
    for (int64_t d : p.shape) n *= d;
    listed += n;
  }
  EXPECT_EQ(listed, one_b.parameters);
  EXPECT_EQ(one_b.largest_parameter, 128256LL * 2048);
  EXPECT_EQ(one_b.persistent_parameters, 2048LL * (2 * 16 + 1));  // the norms, under the threshold
}

// Activations: the bytes autograd keeps after forward, counted by a stand-in CPU allocator,
// against the formula (docs/memory.md), for the fused and unfused attention and both precisions.
struct ActivationCase {
  const char* name;
  double dropout;
  bool bf16;
  int64_t loss_chunk_tokens = 0;
};

// The counting allocator keeps c10's contract for the raw interface, which oneDNN's bf16 matrix
// multiplies use for their scratch on AMX machines: raw_allocate requires a DataPtr whose context
// is its data pointer, raw_deallocate a raw deleter. Exercised here directly, on any CPU.
TEST(CountingAllocator, RawAllocateAndDeallocateKeepTheAllocatorContract) {
  auto& counter = zt::testing::CountingAllocator::instance();
  counter.install();
  c10::Allocator* allocator = c10::GetCPUAllocator();
  void* raw = nullptr;
  EXPECT_NO_THROW(raw = allocator->raw_allocate(1000));
  if (raw != nullptr) {
    std::memset(raw, 0x5a, 1000);
    EXPECT_EQ(counter.live(), 1000);
    EXPECT_NO_THROW(allocator->raw_deallocate(raw));
    EXPECT_EQ(counter.live(), 0);
  }
  // Tensors, whose storages free through the DataPtr, are counted the same way.
  {
    auto t = torch::empty({256}, torch::kFloat32);
    EXPECT_EQ(counter.live(), 1024);
    EXPECT_EQ(t.storage().data_ptr().get_context(), t.storage().data_ptr().get());
  }
  EXPECT_EQ(counter.live(), 0);
  EXPECT_EQ(counter.peak(), 1024);
  counter.uninstall();
}

// What autograd keeps after model->loss(idx, idx), and the peak through its backward, counted by
// the allocator. Gradients exist before backward, as the engine's arenas do: autograd adds into them.
template <class Model>
std::pair<int64_t, int64_t> saved_and_peak_bytes(Model& model, const torch::Tensor& idx) {
  for (auto& p : model->parameters()) p.mutable_grad() = torch::zeros_like(p);
  auto& counter = zt::testing::CountingAllocator::instance();
  counter.install();
  int64_t saved = 0, peak = 0;
  {
    auto loss = model->loss(idx, idx);
    saved = counter.live();
    loss.backward();
    peak = counter.peak();
  }
  counter.uninstall();
  return {saved, peak};
}

TEST(EstimateActivations, SavedBytesMatchWhatAutogradKeeps) {
  for (const ActivationCase& c : {ActivationCase{"fp32", 0.0, false}, ActivationCase{"bf16", 0.0, true},
                                  ActivationCase{"fp32 dropout", 0.1, false}, ActivationCase{"fp32 chunked", 0.0, false, 64},
                                  ActivationCase{"bf16 chunked", 0.0, true, 100}}) {
    for (zt::Recompute recompute : {zt::Recompute::None, zt::Recompute::Selective, zt::Recompute::Full}) {
      const std::string what = std::string(c.name) + ", recompute " + zt::to_string(recompute);
      SCOPED_TRACE(what);
      zt::GPTConfig gpt = gpt_shape(256, 64, 3, 128, c.dropout);
      gpt.loss_chunk_tokens = c.loss_chunk_tokens;
      torch::manual_seed(1);
      zt::GPT model(gpt);
      if (c.bf16) model->to(torch::kBFloat16);
      zt::GPTImpl::Checkpointing settings;
      settings.recompute = recompute;
      model->set_checkpointing(settings);
      model->train();
      const int64_t batch = 4;
      auto idx = torch::randint(0, gpt.vocab_size, {batch, gpt.context_length}, torch::kLong);
      const auto [saved, peak] = saved_and_peak_bytes(model, idx);
      const zt::ModelFigures f = zt::gpt_model_figures(gpt, gpt.context_length, 0);
      const zt::ActivationBytes a = zt::transformer_activation_bytes(f, batch, c.bf16 ? 2 : 4, recompute);
      // Within 3% (the bound for recomputation is 5%).
      EXPECT_NEAR(double(saved), double(a.saved), 0.03 * double(a.saved)) << "saved " << saved << " formula " << a.saved;
      // The peak of forward and backward: saved tensors and backward's working set.
      // The peak: not for bf16 with the loss in chunks, where a bf16 working set inside a layer's
      // backward the estimate does not model sets it (9-32% above the estimate on this model; a
      // known gap, docs/memory.md). Unchunked it is hidden by the loss's larger working set, and
      // at GPT-2's vocabulary by the chunk's (docs/benchmarks.md "Activation checkpointing").
      // In bf16 the peak also depends on the CPU's bf16 kernels: on AMD EPYC with AVX2 only, the
      // loss and head moments of the recomputing runs measured 11% and 23% below the estimate,
      // within 10% on Intel Xeons. There the estimate may count more than this CPU needs, never
      // more than 10% less (docs/memory.md).
      const double expected = double(a.total());
      const double below = c.bf16 ? 0.25 : 0.10;
      if (!(c.loss_chunk_tokens > 0 && c.bf16)) {
        EXPECT_LE(double(peak), 1.10 * expected) << "peak " << peak << " saved " << saved;
        EXPECT_GE(double(peak), (1.0 - below) * expected) << "peak " << peak << " saved " << saved;
      }
      std::cout << what << ": saved " << saved << " (formula " << a.saved << "), peak " << peak << " (formula "
                << expected << ")\n";
    }
  }
}

TEST(EstimateActivations, CheckpointingKeepsLayerInputsAndOneLayer) {
  zt::ModelFigures f;
  f.parameters = 1;
  f.layers = 24;
  f.hidden = 1024;
  f.heads = 16;
  f.sequence_length = 1024;
  f.vocabulary = 50257;
  const auto full = zt::transformer_activation_bytes(f, 8, 2, zt::Recompute::None);
  const auto ckpt = zt::transformer_activation_bytes(f, 8, 2, zt::Recompute::Full);
  const int64_t sbh = 1024LL * 8 * 1024;
  const int64_t outside = 8 * 1024 * 8 + 2 * 2 * sbh + 4LL * 1024 * 8 * 50257;
  const int64_t per_layer = (full.saved - outside) / 24;
  // Korthikanti et al.: 34sbh per layer less the two 1-byte dropout masks (no dropout, fused attention).
  EXPECT_NEAR(double(per_layer), double(32 * sbh), 0.01 * double(32 * sbh));
  EXPECT_EQ(ckpt.saved, 24 * (2 * sbh + 5056) + outside);  // layer inputs and generator states
  EXPECT_EQ(ckpt.transient, full.transient + per_layer);  // one layer recomputed at a time
  const auto selective = zt::transformer_activation_bytes(f, 8, 2, zt::Recompute::Selective);
  // Korthikanti et al.'s selective recomputation drops the attention internals; ours drops the
  // GELU output too: 12·2·sbh of the 16·2·sbh the fused kernel keeps per layer.
  EXPECT_EQ(selective.saved, 24 * (12 * 2 * sbh + 16 * 1024 * 8 + 5056) + outside);
  EXPECT_LT(selective.saved, full.saved);
  EXPECT_GT(selective.saved, ckpt.saved);
  f.layers = 0;  // shape unknown: nothing is claimed
  EXPECT_EQ(zt::transformer_activation_bytes(f, 8, 2, zt::Recompute::None).total(), 0);
}

// The Llama's activations, counted the same way: grouped-query attention with an untied head and
// one kv head with a tied head, fp32 and bf16, without and with full recomputation (the only kind
// it has). The same bounds as the GPT's.
TEST(EstimateActivations, LlamaSavedBytesMatchWhatAutogradKeeps) {
  zt::LlamaConfig gqa = zt::llama_preset("llama-tiny");
  gqa.hidden_size = 128;
  gqa.intermediate_size = 352;
  zt::LlamaConfig tied = gqa;
  tied.num_key_value_heads = 1;
  tied.tie_word_embeddings = true;
  for (const auto& [name, c] : {std::pair{"gqa untied", gqa}, std::pair{"one kv head, tied", tied}})
    for (bool bf16 : {false, true})
      for (zt::Recompute recompute : {zt::Recompute::None, zt::Recompute::Full}) {
        const std::string what = std::string(name) + (bf16 ? ", bf16" : ", fp32") + ", recompute " + zt::to_string(recompute);
        SCOPED_TRACE(what);
        torch::manual_seed(1);
        zt::Llama model(c);
        if (bf16) model->to(torch::kBFloat16);
        zt::CheckpointingSettings settings;
        settings.recompute = recompute;
        model->set_checkpointing(settings);
        const int64_t batch = 4, seq = 64;
        auto idx = torch::randint(0, c.vocab_size, {batch, seq}, torch::kLong);
        const auto [saved, peak] = saved_and_peak_bytes(model, idx);
        const zt::ModelFigures f = zt::llama_model_figures(c, seq, 0);
        const zt::ActivationBytes a = zt::transformer_activation_bytes(f, batch, bf16 ? 2 : 4, recompute);
        EXPECT_NEAR(double(saved), double(a.saved), 0.03 * double(a.saved)) << "saved " << saved << " formula " << a.saved;
        const double expected = double(a.total());
        EXPECT_LE(double(peak), 1.10 * expected) << "peak " << peak << " saved " << saved;
        EXPECT_GE(double(peak), (1.0 - (bf16 ? 0.25 : 0.10)) * expected) << "peak " << peak << " saved " << saved;
        std::cout << what << ": saved " << saved << " (formula " << a.saved << "), peak " << peak << " (formula "
                  << expected << ")\n";
      }
}

// --- the estimate against measured runs --------------------------------------------------------

std::string write_file(const std::string& dir, const std::string& name, const std::string& text) {
  auto path = std::filesystem::path(dir) / name;
  std::ofstream(path) << text;
  return path.string();
}

// A GPT of 3.3M parameters (or a Llama of 3.1M) whose model states and activations are both tens
// of MiB, so that the estimate is tested on every term; two steps, each rank on one thread, freed
// memory returned to the system (the allocator policy the estimate models; docs/memory.md).
std::string measured_config(const std::string& dir, bool llama) {
  const std::string model =
      llama ? R"({"type": "llama", "preset": "llama-tiny", "n_layer": 4, "n_embd": 256, "n_head": 4, "n_kv_head": 2,
                  "intermediate_size": 704, "vocab_size": 256, "context_length": 128})"
            : R"({"preset": "tiny", "n_layer": 4, "n_embd": 256, "n_head": 4, "vocab_size": 256, "context_length": 128,
                  "dropout": 0.0})";
  return write_file(dir, "config.json", R"({
    "gradient_accumulation_steps": 1, "steps_per_print": 100,
    "optimizer": {"type": "Adam", "params": {"lr": 0.001}},
    "model": )" + model + R"(,
    "data": {"source": "embedded", "sequence_length": 128},
    "train": {"steps": 2, "seed": 7, "threads": 1, "retain_freed_memory": "never", "log_dir": ")" +
                                          dir + R"("}})");
}

struct MeasuredCase {
  int stage;
  int world;
  const char* precision;
  int micro_batch;
  int tensor_parallel = 1;  // tensor_parallel.autotp_size: the world is a grid of world / T data-parallel ranks
};

// Six configurations, model states and peak memory against the estimate, in four tests so that
// each stays well inside its timeout where bf16 runs in plain loops (CPUs without AVX-512).
void expect_measured_matches_estimate(const std::vector<MeasuredCase>& cases, bool llama = false) {
  const std::string dir = make_temp_dir("estimate-measured");
  const std::string config = measured_config(dir, llama);
  // Micro-batches whose per-layer activations are 1 MiB tensors in either precision: smaller ones
  // come from the heap, whose fragmentation the estimate does not model (docs/memory.md).
  for (const MeasuredCase& c : cases) {
    SCOPED_TRACE(::testing::Message() << "stage " << c.stage << " N=" << c.world << " " << c.precision << " micro-batch "
                                    << c.micro_batch << " T=" << c.tensor_parallel);
    const std::string summary_path = dir + "/summary.json";
    std::filesystem::remove(summary_path);
    std::vector<std::string> args{cli_path(), "train", config, "--nproc", std::to_string(c.world), "--summary",
                                  summary_path, "--set", "zero_optimization.stage=" + std::to_string(c.stage)};
    // bf16 on every CPU, also where "auto" would train in fp32 (no 16-bit units).
    if (std::string(c.precision) == "bf16")
      args.insert(args.end(), {"--set", "bf16.enabled=true", "--set", "train.cpu_half_precision=always"});
    args.insert(args.end(), {"--set", "train_micro_batch_size_per_gpu=" + std::to_string(c.micro_batch)});
    if (c.tensor_parallel > 1)
      args.insert(args.end(), {"--set", "tensor_parallel.autotp_size=" + std::to_string(c.tensor_parallel)});
    auto r = run_process(args, {}, std::chrono::seconds(240));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    std::ifstream in(summary_path);
    const auto summary = nlohmann::json::parse(in);
    const auto& estimate = summary["memory"]["estimate"]["per_device"];
    // Model states: the estimate is the formula (+ persistent copies); what the engine allocated
    // exceeds it only by the layout's padding, at most one alignment (32 elements) per rank and
    // bucket in every role (no more buckets than parameter tensors: 2 + 12 × 4 + 2).
    const int64_t bucket_bound = 52;
    const int64_t padding_bound = bucket_bound * c.world * 32 * 16;
    for (const auto& rank : summary["ranks"]) {
      const auto& measured = rank["model_state_bytes"];
      for (const char* role : {"parameters", "gradients", "optimizer_states"}) {
        const int64_t m = measured[role].get<int64_t>(), e = estimate[role].get<int64_t>();
        EXPECT_GE(m, e) << role;
        EXPECT_LE(m - e, padding_bound) << role;
      }
    }
    // Peak memory: within 10% of the largest peak RSS above the pre-model baseline.
    const double measured_peak = summary["memory"]["measured_peak_above_baseline_bytes"].get<double>();
    const double estimated_peak = estimate["total"].get<double>();
    EXPECT_NEAR(estimated_peak, measured_peak, 0.10 * measured_peak)
        << "estimated " << estimated_peak / 1048576 << " MiB, measured " << measured_peak / 1048576 << " MiB";
    std::cout << "stage " << c.stage << " N=" << c.world << " " << c.precision << " micro-batch " << c.micro_batch
              << " T=" << c.tensor_parallel << ": estimated "
              << estimated_peak / 1048576 << " MiB, measured " << measured_peak / 1048576 << " MiB ("
              << 100 * (estimated_peak - measured_peak) / measured_peak << "%)\n";
  }
}

TEST(EstimateMeasured, Fp32StagesZeroOneThreeMatchModelStatesAndPeakMemory) {
  expect_measured_matches_estimate({{0, 1, "fp32", 8}, {1, 2, "fp32", 8}, {3, 3, "fp32", 8}});
}
TEST(EstimateMeasured, Bf16StageZeroMatchesModelStatesAndPeakMemory) {
  expect_measured_matches_estimate({{0, 1, "bf16", 16}});
}
TEST(EstimateMeasured, Bf16StageTwoMatchesModelStatesAndPeakMemory) {
  expect_measured_matches_estimate({{2, 2, "bf16", 16}});
}
TEST(EstimateMeasured, Bf16StageThreeMatchesModelStatesAndPeakMemory) {
  expect_measured_matches_estimate({{3, 2, "bf16", 16}});
}
// Tensor parallelism: each rank's slices of the model states, its share of the split activations
// and the replicated ones whole (T = 2 × DP = 1 at stage 0, T = 2 × DP = 2 at stage 3).
TEST(EstimateMeasured, TensorParallelTwoMatchesModelStatesAndPeakMemory) {
  expect_measured_matches_estimate({{0, 2, "fp32", 8, 2}, {3, 4, "fp32", 8, 2}});
}
// The Llama: grouped-query attention, untied head, RMSNorm in fp32, the SwiGLU.
TEST(EstimateMeasured, LlamaFp32StagesZeroAndThreeMatchModelStatesAndPeakMemory) {
  expect_measured_matches_estimate({{0, 1, "fp32", 8}, {3, 2, "fp32", 8}}, /*llama=*/true);
}
// The Llama split over tensor groups of 2: its slices of the heads (kv heads too), features and
// vocabulary, the residual stream whole (T = 2 × DP = 1 at stage 0, T = 2 × DP = 2 at stage 3).
TEST(EstimateMeasured, LlamaTensorParallelTwoMatchesModelStatesAndPeakMemory) {
  expect_measured_matches_estimate({{0, 2, "fp32", 8, 2}, {3, 4, "fp32", 8, 2}}, /*llama=*/true);
}

// The heap policies at stages 0-2 on three model sizes whose activations are 256-512 KiB tensors.
// "never" returns every freed block of 64 KiB or more: the peak stays within 10% of the estimate
// (a retained heap ran 14-34% above it; returning only blocks of 1 MiB or more left these tensors
// to the heap's fragmentation, 10-16% above). The default, "bounded", keeps freed tensor blocks
// for reuse within the live peak: its peak is at most 10% above the same run under "never"
// (docs/memory.md "The heap policy"; measured within 1%).
TEST(EstimateMeasured, HeapPoliciesMatchTheEstimateAtStagesZeroToTwoOnThreeSizes) {
  struct Case {
    const char* model;
    int64_t sequence_length;
    int stage, world, micro_batch;
  };
  const std::vector<Case> cases = {
      {R"({"preset": "tiny"})", 64, 2, 2, 16},
      {R"({"preset": "small"})", 128, 1, 2, 4},
      {R"({"preset": "tiny", "n_layer": 4, "n_embd": 256, "n_head": 4, "vocab_size": 256, "context_length": 128})",
       128, 0, 1, 4},
  };
  const std::string dir = make_temp_dir("estimate-default-heap");
  for (const Case& c : cases) {
    SCOPED_TRACE(::testing::Message() << c.model << " stage " << c.stage << " N=" << c.world << " micro-batch "
                                    << c.micro_batch);
    const std::string config = write_file(dir, "config.json", std::string(R"({
      "gradient_accumulation_steps": 1, "steps_per_print": 100,
      "optimizer": {"type": "Adam", "params": {"lr": 0.001}},
      "model": )") + c.model + R"(,
      "data": {"source": "embedded", "sequence_length": )" + std::to_string(c.sequence_length) + R"(},
      "train": {"steps": 3, "seed": 7, "threads": 1, "log_dir": ")" + dir + R"("}})");
    const std::string summary_path = dir + "/summary.json";
    auto measure = [&](const std::vector<std::string>& extra) {
      std::filesystem::remove(summary_path);
      std::vector<std::string> args = {cli_path(), "train", config, "--nproc", std::to_string(c.world), "--summary",
                                       summary_path, "--set", "zero_optimization.stage=" + std::to_string(c.stage),
                                       "--set", "train_micro_batch_size_per_gpu=" + std::to_string(c.micro_batch)};
      args.insert(args.end(), extra.begin(), extra.end());
      auto r = run_process(args, {}, std::chrono::seconds(240));
      EXPECT_EQ(r.exit_code, 0) << r.output;
      std::ifstream in(summary_path);
      return nlohmann::json::parse(in);
    };
    const auto returned = measure({"--set", "train.retain_freed_memory=never"});
    const auto bounded = measure({});
    EXPECT_FALSE(returned["memory"]["heap_retained"].get<bool>());
    EXPECT_EQ(bounded["memory"]["heap_policy"].get<std::string>(), "bounded");
    ASSERT_TRUE(bounded["memory"].contains("block_cache_rank0")) << bounded.dump();
    const double measured = returned["memory"]["measured_peak_above_baseline_bytes"].get<double>();
    const double measured_bounded = bounded["memory"]["measured_peak_above_baseline_bytes"].get<double>();
    const double estimated = returned["memory"]["estimate"]["per_device"]["total"].get<double>();
    EXPECT_NEAR(estimated, measured, 0.10 * measured)
        << "estimated " << estimated / 1048576 << " MiB, measured " << measured / 1048576 << " MiB";
    EXPECT_LE(measured_bounded, 1.10 * measured) << measured_bounded / 1048576 << " MiB";
    std::cout << c.model << " stage " << c.stage << " N=" << c.world << " micro-batch " << c.micro_batch
              << ": estimated " << estimated / 1048576 << " MiB, measured " << measured / 1048576 << " MiB ("
              << 100 * (estimated - measured) / measured << "%), bounded " << measured_bounded / 1048576
              << " MiB (" << 100 * (measured_bounded - measured) / measured << "% above)\n";
  }
}

// --- the planner ------------------------------------------------------------------------------

zt::ModelFigures gpt_figures(const std::string& preset, int64_t sequence_length) {
  return zt::gpt_model_figures(zt::gpt_preset(preset), sequence_length, 100'000);
}

bool no_offload(const zt::PlanCandidate& c) {
  return c.options.offload_optimizer == zt::OffloadTarget::None && c.options.offload_param == zt::OffloadTarget::None &&
         c.options.recompute.value_or(zt::Recompute::None) == zt::Recompute::None;
}

TEST(EstimatePlan, NoOffloadNorRecomputationWhenEverythingFits) {
  // GPT-2 124M on eight 80 GiB devices: every stage fits. The step-time model (no rates given: the
  // dgx-h100 preset's) puts a configuration without offload or recomputation first, and orders
  // the rest by predicted step time.
  const auto plan = zt::plan_configurations(gpt_figures("gpt2-124m", 1024), cluster_of(1, 8, 80 * kGiB, 1024 * kGiB),
                                            config_for(8, {"bf16.enabled=true", "train_micro_batch_size_per_gpu=4"}));
  ASSERT_FALSE(plan.fitting.empty());
  EXPECT_TRUE(no_offload(plan.fitting.front()));
  EXPECT_LT(plan.fitting.front().stage, 3) << plan.advice;  // stage 3 gathers more than the others
  EXPECT_NE(plan.advice.find("use stage"), std::string::npos) << plan.advice;
  bool stage0 = false;
  for (const auto& c : plan.fitting) stage0 = stage0 || c.stage == 0;
  EXPECT_TRUE(stage0);
  // The pick first (within 3% of the fastest prediction), then fastest first.
  for (size_t i = 2; i < plan.fitting.size(); ++i) EXPECT_LE(plan.fitting[i - 1].time.total, plan.fitting[i].time.total);
  for (const auto& c : plan.fitting) EXPECT_LE(plan.fitting.front().time.total, 1.03 * c.time.total);
}

TEST(EstimatePlan, ShardingWhenOnlyShardingFitsAndNoOffloadWhenItSuffices) {
  // 6.7B in bf16 on eight 80 GiB devices: 16Ψ = 107 GB does not fit one device; sharding does,
  // without offload. Stages 1, 2 (with overlap_comm) and 3 are predicted within 0.1% of each
  // other on NVLink; stage 2 needs no parameter gathers and leaves more memory than stage 1.
  const auto plan = zt::plan_configurations(gpt_figures("gpt-6.7b", 2048), cluster_of(1, 8, 80 * kGiB, 1024 * kGiB),
                                            config_for(8, {"bf16.enabled=true", "train_micro_batch_size_per_gpu=2"}));
  ASSERT_FALSE(plan.fitting.empty());
  EXPECT_EQ(plan.fitting.front().stage, 2) << plan.advice;
  EXPECT_TRUE(plan.fitting.front().overlap_comm) << plan.advice;
  EXPECT_TRUE(no_offload(plan.fitting.front())) << plan.advice;
  for (const auto& c : plan.fitting) EXPECT_NE(c.stage, 0);
}

TEST(EstimatePlan, StageThreeWithOffloadWhenNothingElseFits) {
  // 13B on one 48 GiB device: no sharding helps on one device; only with optimizer and
  // parameters in host memory does the device hold just the gathered layers, the reduced
  // gradients and the activations.
  const auto plan = zt::plan_configurations(gpt_figures("gpt-13b", 2048), cluster_of(1, 1, 48 * kGiB, 512 * kGiB),
                                            config_for(1, {"bf16.enabled=true", "train_micro_batch_size_per_gpu=1"}));
  ASSERT_FALSE(plan.fitting.empty()) << plan.advice;
  const auto& best = plan.fitting.front();
  EXPECT_EQ(best.stage, 3);
  EXPECT_EQ(best.options.offload_optimizer, zt::OffloadTarget::Cpu);
  EXPECT_EQ(best.options.offload_param, zt::OffloadTarget::Cpu);
  EXPECT_NE(plan.advice.find("use stage 3, optimizer offloaded to cpu, parameters offloaded to cpu"), std::string::npos)
      << plan.advice;
}

TEST(EstimatePlan, NvmeWhenHostMemoryIsShortAndNothingWhenNothingFits) {
  const auto config = config_for(1, {"bf16.enabled=true", "train_micro_batch_size_per_gpu=1"});
  // The same 13B with 192 GiB of host memory: optimizer states (156 GB) beside the gradient
  // snapshot and the parameter shards (26 GB each) do not fit there; they must go to NVMe.
  const auto nvme = zt::plan_configurations(gpt_figures("gpt-13b", 2048),
                                            cluster_of(1, 1, 48 * kGiB, 192 * kGiB, 4000 * kGiB), config);
  ASSERT_FALSE(nvme.fitting.empty()) << nvme.advice;
  EXPECT_EQ(nvme.fitting.front().stage, 3);
  EXPECT_EQ(nvme.fitting.front().options.offload_optimizer, zt::OffloadTarget::Nvme) << nvme.advice;
  EXPECT_EQ(nvme.fitting.front().options.offload_param, zt::OffloadTarget::Cpu) << nvme.advice;  // faster than NVMe
  for (const auto& c : nvme.fitting) EXPECT_NE(c.options.offload_optimizer, zt::OffloadTarget::Cpu);
  // Without NVMe and with 8 GiB devices, nothing fits, and the advice says what is needed.
  const auto none = zt::plan_configurations(gpt_figures("gpt-13b", 2048), cluster_of(1, 1, 8 * kGiB, 64 * kGiB),
                                            config);
  EXPECT_TRUE(none.fitting.empty());
  EXPECT_EQ(none.advice.rfind("nothing fits", 0), 0u) << none.advice;
  EXPECT_GT(none.smallest_device_need, 0);
}

// The planner tries tensor-parallel sizes that divide a node's devices where the model splits
// (heads and vocabulary), keeps the global batch, and picks T > 1 only where it is predicted more
// than the tie margin (3%) faster than the best unsplit configuration.
TEST(EstimatePlan, TensorParallelWhereItPays) {
  auto split_of = [](const std::string& preset, int64_t vocab, int64_t seq) {
    return [=](int T) -> std::optional<zt::ModelFigures> {
      zt::GPTConfig gpt = zt::gpt_preset(preset);
      gpt.vocab_size = vocab;
      if (gpt.n_head % T != 0 || vocab % T != 0) return std::nullopt;
      return zt::gpt_model_figures(gpt, seq, 100'000, T);
    };
  };
  auto best_at = [](const zt::Plan& plan, int T) {
    for (const auto& c : plan.fitting)
      if (c.tensor_parallel == T && &c != &plan.fitting.front()) return c.time.total;
    return 0.0;
  };
  // GPT-2 350M on 4 CPU ranks (the cpu-box rates), global batch 4 of 256 tokens: splitting the
  // layers cuts the gradient traffic that dominates beside the compute; T = 2 x DP = 2 at stage 3
  // was measured at 0.86x of DP = 4 (docs/benchmarks.md), predicted 0.84x.
  zt::ClusterSpec cpu = zt::cluster_preset("cpu-box");
  cpu.devices_per_node = 4;
  cpu.device = zt::DeviceKind::Cpu;
  const auto cpu_config = config_for(4, {"train_micro_batch_size_per_gpu=1"});
  const auto gpt350 = split_of("gpt2-350m", 50304, 256);
  const auto without = zt::plan_configurations(*gpt350(1), cpu, cpu_config);
  for (const auto& c : without.fitting) EXPECT_EQ(c.tensor_parallel, 1) << "no sizes tried without the split figures";
  const auto cpu_plan = zt::plan_configurations(*gpt350(1), cpu, cpu_config, gpt350);
  ASSERT_FALSE(cpu_plan.fitting.empty());
  const zt::PlanCandidate& pick = cpu_plan.fitting.front();
  EXPECT_GT(pick.tensor_parallel, 1) << cpu_plan.advice;
  EXPECT_LT(pick.time.total, 0.97 * best_at(cpu_plan, 1)) << cpu_plan.advice;
  EXPECT_EQ(pick.micro_batch * pick.accumulation * (4 / pick.tensor_parallel), 4) << "the global batch is kept";
  EXPECT_NE(cpu_plan.advice.find("tensor-parallel groups of " + std::to_string(pick.tensor_parallel)), std::string::npos)
      << cpu_plan.advice;
  const zt::TrainConfig chosen = zt::candidate_config(cpu_config, pick);
  EXPECT_EQ(chosen.tensor_parallel, pick.tensor_parallel);
  EXPECT_EQ(chosen.train_batch_size, 4);

  // On eight H100s in bf16: GPT-13B needs stage 3's gathers unsplit; split in two, stage 1 fits and
  // is predicted faster by more than the margin. GPT-2 124M: its layers are too narrow for the
  // split's collectives to pay.
  const auto h100_config = config_for(8, {"bf16.enabled=true", "train_micro_batch_size_per_gpu=2"});
  const zt::ClusterSpec h100 = cluster_of(1, 8, 80 * kGiB, 1024 * kGiB);
  const auto gpt13 = split_of("gpt-13b", 50304, 1024);
  const auto large = zt::plan_configurations(*gpt13(1), h100, h100_config, gpt13);
  ASSERT_FALSE(large.fitting.empty());
  EXPECT_EQ(large.fitting.front().tensor_parallel, 2) << large.advice;
  EXPECT_LT(large.fitting.front().stage, 3) << large.advice;
  EXPECT_LT(large.fitting.front().time.total, 0.97 * best_at(large, 1)) << large.advice;
  const auto gpt124 = split_of("gpt2-124m", 50304, 1024);
  const auto small = zt::plan_configurations(*gpt124(1), h100, h100_config, gpt124);
  ASSERT_FALSE(small.fitting.empty());
  EXPECT_EQ(small.fitting.front().tensor_parallel, 1) << small.advice;
  EXPECT_GT(best_at(small, 2), 0) << "T = 2 was tried";
  // A vocabulary that no T divides: nothing split is tried.
  const auto odd = split_of("gpt2-124m", 50257, 1024);
  for (const auto& c : zt::plan_configurations(*odd(1), h100, h100_config, odd).fitting) EXPECT_EQ(c.tensor_parallel, 1);
  // From a configuration at T = 2, T = 1 is tried with the same global batch.
  const auto at_two = config_for(8, {"bf16.enabled=true", "train_micro_batch_size_per_gpu=2", "tensor_parallel.autotp_size=2"});
  const auto from_two = zt::plan_configurations(*gpt13(2), h100, at_two, gpt13);
  bool unsplit = false;
  for (const auto& c : from_two.fitting)
    if (c.tensor_parallel == 1) {
      unsplit = true;
      EXPECT_EQ(c.micro_batch * c.accumulation * 8, 2 * 4) << "the global batch of 4 data-parallel ranks x 2";
    }
  EXPECT_TRUE(unsplit);
}

TEST(EstimatePlan, ThisMachineTwoCpuRanksIn24GiB) {
  zt::ClusterSpec cpu = cluster_of(1, 2, 0, 24 * kGiB);
  cpu.device = zt::DeviceKind::Cpu;
  const auto config = config_for(2, {"train_micro_batch_size_per_gpu=4", "train.retain_freed_memory=never"});
  // GPT-2 350M: 16Ψ = 5.7 GB per rank, both ranks fit: plain data parallelism, whose one
  // all-reduce costs what stage 1's reduce-scatter (an in-place all-reduce on CPU) does without
  // the all-gather after the step (predicted 8.63 s against 9.02 s, measured 8.58 s against
  // 8.99 s: docs/step_time.md "Calibration").
  const auto small = zt::plan_configurations(gpt_figures("gpt2-350m", 64), cpu, config);
  ASSERT_FALSE(small.fitting.empty());
  EXPECT_EQ(small.fitting.front().stage, 0) << small.advice;
  EXPECT_EQ(small.fitting.front().micro_batch, 4) << small.advice;
  // GPT-2 774M: stage 1 holds 12Ψ = 9.3 GB per rank in the step, and as much at construction (the
  // fp32 model as built, 4Ψ, beside the parameters, 4Ψ, and the optimizer shard, 4Ψ; the gradients
  // come after the model is freed), under 90% of 24 GiB for two: measured 9.68 GiB above the
  // baseline per rank (estimate 9.66; docs/memory.md "The peak: two moments"). Sharding more is
  // not needed; on CPU devices offloading to cpu is never proposed.
  const auto large = zt::plan_configurations(gpt_figures("gpt2-774m", 64), cpu, config);
  ASSERT_FALSE(large.fitting.empty());
  EXPECT_EQ(large.fitting.front().stage, 1) << large.advice;
  EXPECT_TRUE(no_offload(large.fitting.front()));
  for (const auto& c : large.fitting) EXPECT_NE(c.options.offload_optimizer, zt::OffloadTarget::Cpu);
  // With 18 GiB, stage 1 in bf16: its training step alone would fit (10Ψ per rank); its
  // construction (the fp32 model beside the 16-bit parameters and the optimizer shard, 12Ψ) is
  // what does not.
  zt::ClusterSpec smaller = cluster_of(1, 2, 0, 18 * kGiB);
  smaller.device = zt::DeviceKind::Cpu;
  const auto stage1 = config_for(2, {"train_micro_batch_size_per_gpu=4", "train.retain_freed_memory=never",
                                     "zero_optimization.stage=1", "bf16.enabled=true"});
  const auto e = zt::estimate_memory(gpt_figures("gpt2-774m", 64), smaller, stage1);
  EXPECT_FALSE(e.fits_host);
  EXPECT_GT(e.per_device.construction, 0);
  EXPECT_LT(2 * e.step_peak, int64_t(0.9 * double(18 * kGiB)));
}

// --- the command line ---------------------------------------------------------------------------

TEST(EstimateCli, JsonHasEveryRoleAndMatchesTheTable) {
  auto r = run_process({cli_path(), "estimate", "--params", "1.5B", "--nodes", "2", "--devices-per-node", "4",
                        "--stage", "2", "--precision", "bf16", "--device-memory", "40GiB", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto out = nlohmann::json::parse(r.output);
  const int64_t psi = 1'500'000'000;
  for (const char* place : {"per_device", "per_host"})
    for (const char* key : {"parameters", "gradients", "optimizer_states", "activations", "buffers", "total"})
      EXPECT_TRUE(out[place].contains(key)) << place << "." << key;
  EXPECT_EQ(out["per_device"]["parameters"].get<int64_t>(), 2 * psi);
  EXPECT_EQ(out["per_device"]["gradients"].get<int64_t>(), 2 * psi / 8);
  EXPECT_EQ(out["per_device"]["optimizer_states"].get<int64_t>(), 4 * psi / 8 + 8 * psi / 8);
  EXPECT_EQ(out["per_device"]["activations"].get<int64_t>(), 0);  // no shape given: not estimated, and said so
  EXPECT_FALSE(out["notes"].empty());
  EXPECT_TRUE(out["fits"].get<bool>());

  auto text = run_process({cli_path(), "estimate", "--preset", "gpt2-350m", "--devices-per-node", "8", "--plan",
                           "--device-memory", "80GiB", "--precision", "bf16"});
  ASSERT_EQ(text.exit_code, 0) << text.output;
  EXPECT_NE(text.output.find("use stage"), std::string::npos) << text.output;
  EXPECT_NE(text.output.find("tokens/s"), std::string::npos) << text.output;
}

TEST(EstimateCli, OffloadComesFromTheConfigurationUnlessAFlagSaysOtherwise) {
  const std::string dir = make_temp_dir("estimate_offload");
  const std::string path = dir + "/offload.json";
  // Blocks of the tiny model (a persistence threshold below its tensors) and max_in_cpu 0: every
  // block's shard on NVMe (DeepSpeed's defaults keep all of the tiny model in host memory, as the
  // engine does).
  std::ofstream(path) << R"({"model": {"preset": "tiny"}, "zero_optimization": {"stage": 3,
      "stage3_param_persistence_threshold": 100,
      "offload_optimizer": {"device": "nvme", "nvme_path": "swap"},
      "offload_param": {"device": "nvme", "nvme_path": "swap", "max_in_cpu": 0}}})";
  auto r = run_process({cli_path(), "estimate", path, "--devices-per-node", "2", "--device", "cpu", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto out = nlohmann::json::parse(r.output);
  EXPECT_EQ(out["inputs"]["offload_optimizer"], "nvme");
  EXPECT_EQ(out["inputs"]["offload_param"], "nvme");
  const auto& nvme = out["nvme"];
  EXPECT_GT(nvme["parameters"].get<int64_t>(), 0);
  EXPECT_GT(nvme["optimizer_moments"].get<int64_t>(), 0);
  EXPECT_EQ(nvme["per_rank"].get<int64_t>(), nvme["parameters"].get<int64_t>() + nvme["optimizer_states"].get<int64_t>());
  EXPECT_EQ(nvme["per_node"].get<int64_t>(), 2 * nvme["per_rank"].get<int64_t>());
  EXPECT_TRUE(nvme["exact_partition"].get<bool>());
  EXPECT_GT(nvme["host_buffers_per_rank"].get<int64_t>(), 0);
  EXPECT_GT(nvme["load_staging_per_rank"].get<int64_t>(), 0);
  for (const auto& note : out["notes"]) EXPECT_EQ(note.get<std::string>().find("not implement"), std::string::npos) << note;

  r = run_process({cli_path(), "estimate", path, "--devices-per-node", "2", "--device", "cpu", "--json",
                   "--offload-optimizer", "none", "--offload-param", "none"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  out = nlohmann::json::parse(r.output);
  EXPECT_EQ(out["inputs"]["offload_optimizer"], "none");
  EXPECT_EQ(out["nvme"]["per_rank"].get<int64_t>(), 0);

  r = run_process({cli_path(), "estimate", path, "--devices-per-node", "2", "--device", "cpu"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("optimizer offload nvme, parameter offload nvme"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("NVMe (parameters + optimizer)"), std::string::npos) << r.output;
  std::filesystem::remove_all(dir);
}

TEST(EstimateCli, RecomputationComesFromTheConfigurationUnlessTheFlagSaysOtherwise) {
  const std::string dir = make_temp_dir("estimate_recompute");
  const std::string path = dir + "/recompute.json";
  std::ofstream(path) << R"({"model": {"preset": "gpt2-124m", "loss_chunk_tokens": 1024},
      "train_micro_batch_size_per_gpu": 8, "activation_checkpointing": {"policy": "selective"}})";
  auto activations = [&](const std::vector<std::string>& extra, const std::string& expected) {
    std::vector<std::string> args{cli_path(), "estimate", path, "--devices-per-node", "2", "--device", "cpu", "--json"};
    args.insert(args.end(), extra.begin(), extra.end());
    auto r = run_process(args);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    if (r.exit_code != 0) return int64_t(0);
    auto out = nlohmann::json::parse(r.output);
    EXPECT_EQ(out["inputs"]["activation_checkpointing"], expected);
    return out["per_device"]["activations"].get<int64_t>();
  };
  const int64_t selective = activations({}, "selective");
  const int64_t none = activations({"--activation-checkpointing", "none"}, "none");
  const int64_t full = activations({"--activation-checkpointing", "full"}, "full");
  EXPECT_GT(none, selective);
  EXPECT_GT(selective, 4 * full) << "full recomputation with the loss in chunks keeps a small fraction";
  auto r = run_process({cli_path(), "estimate", path, "--activation-checkpointing", "most"});
  EXPECT_EQ(r.exit_code, 2) << r.output;
  std::filesystem::remove_all(dir);
}

// A Llama configuration is estimated from its own shape (the preset, its overrides): the CLI's
// figures are llama_model_figures', activations included. The step-time model (--time, --plan)
// and selective recomputation are refused for it in one line, and the BERT still is.
TEST(EstimateCli, LlamaIsEstimatedFromItsConfiguration) {
  const std::string dir = make_temp_dir("estimate_llama");
  const std::string path = write_file(dir, "llama.json", R"({"train_micro_batch_size_per_gpu": 4,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.001}},
    "model": {"type": "llama", "preset": "llama-tiny", "n_kv_head": 1, "intermediate_size": 160},
    "data": {"sequence_length": 96}})");
  auto r = run_process({cli_path(), "estimate", path, "--stage", "2", "--devices-per-node", "2", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto out = nlohmann::json::parse(r.output);
  zt::LlamaConfig llama = zt::llama_preset("llama-tiny");
  llama.num_key_value_heads = 1;
  llama.intermediate_size = 160;
  const auto config = zt::load_config(path, {"zero_optimization.stage=2"}, 2);
  const zt::ModelFigures f = zt::llama_model_figures(llama, 96, config.zero.stage3_param_persistence_threshold);
  EXPECT_EQ(out["inputs"]["parameters"].get<int64_t>(), zt::llama_parameter_count(llama));
  EXPECT_EQ(out["inputs"]["sequence_length"].get<int64_t>(), 96);
  const zt::MemoryEstimate expected = zt::estimate_memory(f, cluster_of(1, 2), config);
  EXPECT_EQ(out["per_device"]["activations"].get<int64_t>(), expected.per_device.activations);
  EXPECT_GT(expected.per_device.activations, 0);
  EXPECT_EQ(out["per_device"]["total"].get<int64_t>(), expected.per_device.total());

  auto text = run_process({cli_path(), "estimate", path});
  ASSERT_EQ(text.exit_code, 0) << text.output;
  EXPECT_NE(text.output.find("llama from preset 'llama-tiny' (2 layers, 4 heads over 1 kv heads of 16, width 64, MLP 160, vocab 256"),
            std::string::npos)
      << text.output;

  const std::string bert = write_file(dir, "bert.json", R"({"model": {"type": "bert", "preset": "bert-tiny"}})");
  const std::vector<std::pair<std::vector<std::string>, std::string>> refusals = {
      {{path, "--time"}, "--time"},
      {{path, "--plan"}, "--plan"},
      {{path, "--activation-checkpointing", "selective"}, "selective"},
      {{bert}, "models the GPT and the Llama"}};
  for (const auto& [extra, expected_text] : refusals) {
    std::vector<std::string> args{cli_path(), "estimate"};
    args.insert(args.end(), extra.begin(), extra.end());
    auto refused = run_process(args);
    EXPECT_EQ(refused.exit_code, 2) << refused.output;
    EXPECT_EQ(std::count(refused.output.begin(), refused.output.end(), '\n'), 1) << refused.output;
    EXPECT_NE(refused.output.find(expected_text), std::string::npos) << refused.output;
  }
}

TEST(EstimateCli, BadInputIsOneLineAndExitTwo) {
  const std::vector<std::vector<std::string>> bad = {
      {"--params", "lots"},
      {"--params", "1B", "--stage", "2", "--offload-param", "cpu"},
      {"--params", "1B", "--offload-optimizer", "disk", "--stage", "2"},
      {"--params", "1B", "--device-memory", "80XB"},
      {"--params", "1B", "--nodes", "0"},
      {"--preset", "gpt-9000"},
      {"--params", "1B", "--stage", "7"},
      {"--params", "1B", "--headroom", "1.5"},
  };
  for (const auto& extra : bad) {
    std::vector<std::string> args{cli_path(), "estimate"};
    args.insert(args.end(), extra.begin(), extra.end());
    auto r = run_process(args);
    EXPECT_EQ(r.exit_code, 2) << extra[0] << " " << extra[1] << ": " << r.output;
    EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << r.output;
    EXPECT_NE(r.output.find("error"), std::string::npos) << r.output;
  }
}

}  // namespace

// The planner keeps the global batch and chooses the micro-batch, and recomputation only where no
// micro-batch fits without it: GPT-2 124M at context 1024 on two CPU ranks of 11 GiB each (this
// machine kind's RAM over two ranks, docs/benchmarks.md).
TEST(EstimatePlan, RecomputationIsChosenOnlyWhenNothingLighterFits) {
  auto model = zt::gpt_model_figures(zt::gpt_preset("gpt2-124m"), 1024, 100'000);
  model.loss_chunk_tokens = 1024;
  zt::ClusterSpec cluster = cluster_of(1, 2, 11 * kGiB);
  cluster.device = zt::DeviceKind::Cpu;
  auto best = [&](int micro) {
    auto config = config_for(2, {"train_micro_batch_size_per_gpu=" + std::to_string(micro)});
    const zt::Plan plan = zt::plan_configurations(model, cluster, config);
    EXPECT_FALSE(plan.fitting.empty()) << plan.advice;
    return plan.fitting.empty() ? zt::PlanCandidate{} : plan.fitting.front();
  };
  // 4 sequences per rank fit at once: no recomputation, no accumulation.
  auto pick = best(4);
  EXPECT_EQ(pick.options.recompute.value_or(zt::Recompute::None), zt::Recompute::None);
  EXPECT_EQ(pick.micro_batch, 4);
  // 32 do not: the planner accumulates smaller micro-batches rather than recompute a forward
  // (on two ranks a micro-step costs no communication before the boundary).
  pick = best(32);
  EXPECT_EQ(pick.options.recompute.value_or(zt::Recompute::None), zt::Recompute::None);
  EXPECT_LT(pick.micro_batch, 32);
  EXPECT_EQ(pick.micro_batch * pick.accumulation, 32);
  // The estimates behind it: each policy keeps less than the one before.
  auto config = config_for(2, {"train_micro_batch_size_per_gpu=8"});
  int64_t previous = INT64_MAX;
  for (zt::Recompute r : {zt::Recompute::None, zt::Recompute::Selective, zt::Recompute::Full}) {
    zt::EstimateOptions o;
    o.recompute = r;
    const int64_t a = zt::estimate_memory(model, cluster, config, o).per_device.activations;
    EXPECT_LT(a, previous) << zt::to_string(r);
    previous = a;
  }
}
