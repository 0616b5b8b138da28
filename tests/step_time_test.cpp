// The step-time model and the planner that orders by it (zerotrain/memory/step_time.h): each term against
// its formula written out here, the collective volumes of docs/step_time.md "The formulas",
// overlap, the what-if inputs, the presets, the planner's picks and the CLI. Its calibration
// against measured runs is a benchmark (bench/step_time.sh, docs/step_time.md), not a test.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>

#include "support/process.h"
#include "zerotrain/config/config.h"
#include "zerotrain/error.h"
#include "zerotrain/models/gpt.h"
#include "zerotrain/config/gpt_flops.h"
#include "zerotrain/memory/step_time.h"

namespace {

using zt::testing::cli_path;
using zt::testing::run_process;

constexpr int64_t kGiB = int64_t(1) << 30;

zt::TrainConfig config_for(int world, std::vector<std::string> overrides) {
  return zt::parse_config("", overrides, world);
}

zt::ModelFigures gpt_figures(const std::string& preset, int64_t sequence_length) {
  return zt::gpt_model_figures(zt::gpt_preset(preset), sequence_length, 100'000);
}

// A cluster whose links are the only cost: compute and memory far faster than any collective.
zt::ClusterSpec links_only(int nodes, int per_node, double intra, double inter) {
  zt::ClusterSpec c;
  c.nodes = nodes;
  c.devices_per_node = per_node;
  c.rates.device_flops_fp32 = c.rates.device_flops_16bit = 1e30;
  c.rates.device_memory_bandwidth = 1e30;
  c.rates.intra_node_bandwidth = intra;
  c.rates.inter_node_bandwidth = inter;
  c.rates.overlap = 0;
  return c;
}

double term(const zt::StepTime& t, const std::string& prefix, bool exposed = false) {
  double s = 0;
  for (const auto& x : t.terms)
    if (x.name.rfind(prefix, 0) == 0) s += exposed ? x.exposed : x.seconds;
  return s;
}

double bytes(const zt::StepTime& t) {
  double b = 0;
  for (const auto& x : t.terms) b += x.bytes;
  return b;
}

TEST(StepTime, ComputeIsTheModelsFlopsOverTheDeviceRate) {
  const zt::GPTConfig gpt = zt::gpt_preset("gpt2-124m");
  const auto model = gpt_figures("gpt2-124m", 64);
  zt::ClusterSpec one;
  one.rates.device_flops_fp32 = 1e11;
  one.rates.device_memory_bandwidth = 1e10;
  const auto config = config_for(1, {"train_micro_batch_size_per_gpu=4", "gradient_accumulation_steps=3"});
  const zt::StepTime t = zt::estimate_step_time(model, one, config);
  const zt::StepFlops f = zt::gpt_micro_batch_flops(gpt, 4, 64, zt::Recompute::None, 0);
  // Elementwise kernels: 22 elements of the width per layer and token in forward, twice that in
  // backward, 4 bytes each, over the memory bandwidth.
  const double elementwise = 3 * 22.0 * 768 * 4 * 64 * 12 * 4 / 1e10;
  EXPECT_NEAR(t.compute, 3 * (double(f.model()) / 1e11 + elementwise), 1e-9 * t.compute);
  // Stage 0 on one rank: no communication; the fused Adam moves 28 bytes per parameter.
  EXPECT_EQ(t.communication, 0);
  EXPECT_NEAR(t.optimizer, double(model.parameters) * 28 / 1e10, 1e-12);
  EXPECT_NEAR(t.total, t.compute + t.optimizer, 1e-12);
  EXPECT_NEAR(t.tokens_per_second, 3 * 4 * 64 / t.total, 1e-9);
  EXPECT_NEAR(t.model_flops_per_device, 3 * double(f.model()) / t.total, 1e-3);
  // Full recomputation adds one forward of every block.
  zt::EstimateOptions full;
  full.recompute = zt::Recompute::Full;
  const zt::StepTime r = zt::estimate_step_time(model, one, config, full);
  const double again = double(zt::gpt_recompute_flops(gpt, 4, 64, zt::Recompute::Full, 12)) / 1e11;
  EXPECT_NEAR(r.compute - t.compute, 3 * (again + elementwise / 3), 1e-9 * r.compute);
}

TEST(StepTime, StagesMoveDesignsCommunicationVolumes) {
  // 2 nodes × 4 ranks, links only: per rank and step, stages 0–2 send 2Ψ·(N−1)/N elements, stage 3
  // without reuse 3Ψ·(N−1)/N, stage 3 keeping every block to backward 2Ψ.
  const auto model = gpt_figures("gpt2-124m", 64);
  const auto cluster = links_only(2, 4, 100e9, 10e9);
  const double n = 8, psi = double(model.parameters), persistent = double(model.persistent_parameters);
  for (int stage = 0; stage <= 3; ++stage) {
    for (const char* reuse : {"0", "1000000000"}) {
      const auto config = config_for(8, {"zero_optimization.stage=" + std::to_string(stage), "bf16.enabled=true",
                                         std::string("zero_optimization.stage3_max_reuse_distance=") + reuse});
      const zt::StepTime t = zt::estimate_step_time(model, cluster, config);
      double expected = 2 * psi * (n - 1) / n * 2;
      if (stage == 3) {
        const double sharded = psi - persistent;
        const double kept = std::string(reuse) == "0" ? 0 : sharded;  // 124M: every block fits the distance
        expected = (3 * sharded - kept) * (n - 1) / n * 2 + 2 * persistent * (n - 1) / n * 2;
        const double volume = expected / (2 * psi * (n - 1) / n * 2);
        EXPECT_NEAR(volume, std::string(reuse) == "0" ? 1.5 : 1.0, 0.01) << "stage 3 against stage 2";
      }
      EXPECT_NEAR(bytes(t), expected, 1e-6 * expected) << "stage " << stage << " reuse " << reuse;
      // Across nodes the network (10 GB/s per node) is the slower link: every byte crosses it.
      EXPECT_NEAR(t.communication, expected / 10e9, 0.01 * t.communication);
    }
  }
}

TEST(StepTime, TheSlowerLinkSetsTheRingsPace) {
  const auto model = gpt_figures("gpt2-124m", 64);
  const auto config = config_for(8, {"zero_optimization.stage=2"});
  const double within = zt::estimate_step_time(model, links_only(1, 8, 100e9, 0), config).communication;
  const double fast = zt::estimate_step_time(model, links_only(2, 4, 100e9, 200e9), config).communication;
  const double slow = zt::estimate_step_time(model, links_only(2, 4, 100e9, 25e9), config).communication;
  EXPECT_NEAR(fast, within, 0.01 * within);  // the intra-node bus is the bottleneck either way
  EXPECT_NEAR(slow, 4 * within, 0.01 * slow);
  // One node needs no network figure; two do.
  EXPECT_THROW(zt::estimate_step_time(model, links_only(2, 4, 100e9, 0), config), zt::ConfigError);
}

TEST(StepTime, OverlapHidesWhatTheEngineOverlapsAndNothingElse) {
  const auto model = gpt_figures("gpt2-350m", 1024);
  zt::ClusterSpec cluster = zt::cluster_preset("dgx-h100");
  cluster.nodes = 2;
  const auto stage3 = config_for(16, {"zero_optimization.stage=3", "bf16.enabled=true", "train_micro_batch_size_per_gpu=8"});
  cluster.rates.overlap = 1;
  const zt::StepTime hidden = zt::estimate_step_time(model, cluster, stage3);
  // The compute of each phase is far longer than its gathers: only the first block's gather waits.
  const double first = term(hidden, "all-gather parameters (forward, first block)");
  EXPECT_NEAR(hidden.exposed, first, 1e-9);
  // The preset's overlap (0.8) still pays a fifth of what overlaps.
  cluster.rates.overlap = 0.8;
  const zt::StepTime partly = zt::estimate_step_time(model, cluster, stage3);
  EXPECT_NEAR(partly.exposed, first + 0.2 * (partly.communication - first), 1e-9);
  cluster.rates.overlap = 0;
  const zt::StepTime serial = zt::estimate_step_time(model, cluster, stage3);
  EXPECT_NEAR(serial.exposed, serial.communication, 1e-9);
  EXPECT_NEAR(serial.total, serial.compute + serial.optimizer + serial.communication, 1e-9);
  // Stage 2 without overlap_comm (its default) waits for its reductions even on GPUs; with it, not.
  cluster.rates.overlap = 1;
  const auto stage2 = config_for(16, {"zero_optimization.stage=2", "bf16.enabled=true", "train_micro_batch_size_per_gpu=8"});
  const zt::StepTime plain = zt::estimate_step_time(model, cluster, stage2);
  EXPECT_NEAR(term(plain, "reduce-scatter", true), term(plain, "reduce-scatter"), 1e-12);
  auto overlapped = stage2;
  overlapped.zero.overlap_comm = true;
  EXPECT_EQ(term(zt::estimate_step_time(model, cluster, overlapped), "reduce-scatter", true), 0);
  // The all-gather after the step has nothing to hide behind.
  EXPECT_GT(term(plain, "all-gather updated parameters", true), 0);
  // A reduction issued once per step hides behind the boundary micro-step's backward only, not
  // behind all of them: stage 0 with overlap_comm, 4 micro-steps, on a slow network.
  cluster.rates.inter_node_bandwidth = 2e9;
  auto stage0 = config_for(16, {"bf16.enabled=true", "train_micro_batch_size_per_gpu=8", "gradient_accumulation_steps=4",
                                "zero_optimization.overlap_comm=true"});
  cluster.rates.overlap = 1;
  const zt::StepTime accumulated = zt::estimate_step_time(model, cluster, stage0);
  const double reduce = term(accumulated, "all-reduce gradients");
  const double backward = term(accumulated, "backward compute") / 4;
  ASSERT_GT(reduce, backward);
  EXPECT_NEAR(term(accumulated, "all-reduce gradients", true), reduce - backward, 1e-9);
}

TEST(StepTime, OffloadAddsPcieTrafficAndTheHostStep) {
  const auto model = gpt_figures("gpt-13b", 2048);
  const zt::ClusterSpec cluster = zt::cluster_preset("dgx1-v100");
  const auto config = config_for(8, {"zero_optimization.stage=2", "bf16.enabled=true", "train_micro_batch_size_per_gpu=4"});
  zt::EstimateOptions cpu;
  cpu.offload_optimizer = zt::OffloadTarget::Cpu;
  const zt::StepTime t = zt::estimate_step_time(model, cluster, config, cpu);
  const double shard = double(model.parameters) / 8;
  EXPECT_NEAR(term(t, "optimizer step on the host"), 8 * shard / cluster.rates.host_adam_rate, 1e-9);
  EXPECT_NEAR(term(t, "parameters to the device"), shard * 2 / cluster.rates.host_device_bandwidth, 1e-9);
  EXPECT_NEAR(term(t, "gradients to the host"), shard * 2 / cluster.rates.host_device_bandwidth, 1e-9);
  // The nvme tier reads and writes 12 bytes per parameter of the node's shards each step.
  zt::EstimateOptions nvme;
  nvme.offload_optimizer = zt::OffloadTarget::Nvme;
  const zt::StepTime n = zt::estimate_step_time(model, cluster, config, nvme);
  const double swap = 8 * shard * 12 * (1 / cluster.rates.nvme_read_bandwidth + 1 / cluster.rates.nvme_write_bandwidth);
  EXPECT_NEAR(term(n, "optimizer states through NVMe"), swap, 1e-6 * swap);
  EXPECT_GT(n.total, t.total);
}

TEST(StepTime, WhatIfInputsTensorParallelAndHpz) {
  const auto model = gpt_figures("gpt-13b", 2048);
  zt::ClusterSpec cluster = zt::cluster_preset("dgx-h100");
  cluster.nodes = 4;
  const auto config = config_for(32, {"zero_optimization.stage=3", "bf16.enabled=true", "train_micro_batch_size_per_gpu=1",
                                      "zero_optimization.stage3_max_reuse_distance=0"});
  const zt::StepTime base = zt::estimate_step_time(model, cluster, config);
  zt::StepTimeOptions tp;
  tp.tensor_parallel = 8;
  const zt::StepTime split = zt::estimate_step_time(model, cluster, config, {}, tp);
  EXPECT_NEAR(term(split, "forward compute"), term(base, "forward compute") / 8, 1e-9);
  EXPECT_GT(term(split, "tensor-parallel all-reduces"), 0);
  // hpZ: backward gathers stay within the node; on a slow network that pays.
  cluster.rates.inter_node_bandwidth /= 8;
  const zt::StepTime flat = zt::estimate_step_time(model, cluster, config);
  zt::StepTimeOptions hpz;
  hpz.hpz_partition_size = 8;
  const zt::StepTime secondary = zt::estimate_step_time(model, cluster, config, {}, hpz);
  EXPECT_LT(term(secondary, "all-gather parameters (backward"), term(flat, "all-gather parameters (backward") / 4);
  EXPECT_LT(secondary.total, flat.total);
  tp.tensor_parallel = 3;
  EXPECT_THROW(zt::estimate_step_time(model, cluster, config, {}, tp), zt::ConfigError);
}

// The figures of one rank of a tensor group (what the memory estimate takes for a configuration
// with tensor_parallel.autotp_size) give the step time of the whole model with the what-if, to
// the replicated parameters' share (wpe, norms and biases counted T times); another T is refused.
TEST(StepTime, FiguresOfATensorGroupRankEqualTheWholeModelWithTheWhatIf) {
  zt::GPTConfig gpt = zt::gpt_preset("gpt2-350m");
  gpt.vocab_size = 50304;
  const zt::ModelFigures whole = zt::gpt_model_figures(gpt, 1024, 100'000);
  const zt::ModelFigures split = zt::gpt_model_figures(gpt, 1024, 100'000, 2);
  const zt::ClusterSpec cluster = zt::cluster_preset("dgx-h100");
  const auto config = config_for(8, {"zero_optimization.stage=3", "bf16.enabled=true", "tensor_parallel.autotp_size=2"});
  zt::StepTimeOptions tp;
  tp.tensor_parallel = 2;
  const zt::StepTime expected = zt::estimate_step_time(whole, cluster, config, {}, tp);
  const zt::StepTime from_split = zt::estimate_step_time(split, cluster, config);
  EXPECT_NEAR(from_split.total, expected.total, 0.01 * expected.total);
  EXPECT_NEAR(term(from_split, "forward compute"), term(expected, "forward compute"), 1e-9);
  EXPECT_EQ(zt::estimate_step_time(split, cluster, config, {}, tp).total, from_split.total);
  tp.tensor_parallel = 4;
  EXPECT_THROW(zt::estimate_step_time(split, cluster, config, {}, tp), zt::ConfigError);
}

TEST(StepTime, RefusesMissingRatesAndMismatchedWorlds) {
  const auto model = gpt_figures("gpt2-124m", 64);
  zt::ClusterSpec none;
  none.devices_per_node = 2;
  EXPECT_THROW(zt::estimate_step_time(model, none, config_for(2, {})), zt::ConfigError);
  zt::ClusterSpec box = zt::cluster_preset("cpu-box");
  EXPECT_THROW(zt::estimate_step_time(model, box, config_for(4, {})), zt::ConfigError);
  try {
    zt::cluster_preset("dgx-a100");
    FAIL() << "an unknown preset was accepted";
  } catch (const zt::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("dgx-h100"), std::string::npos) << e.what();
  }
  for (const auto& p : zt::cluster_presets()) {
    EXPECT_GT(p.spec.rates.device_flops_fp32, 0) << p.name;
    EXPECT_GT(p.spec.rates.intra_node_bandwidth, 0) << p.name;
    EXPECT_FALSE(p.description.empty()) << p.name;
  }
}

// --- the planner ------------------------------------------------------------------------------

zt::ModelFigures seventy_b() {
  zt::GPTConfig g;
  g.n_layer = 80;
  g.n_embd = 8192;
  g.n_head = 64;
  g.vocab_size = 32000;
  g.context_length = 4096;
  return zt::gpt_model_figures(g, 4096, 100'000);
}

TEST(StepTimePlan, SeventyBillionOnSixtyFourDgxH100sFollowsTheNetwork) {
  zt::ClusterSpec cluster = zt::cluster_preset("dgx-h100");
  cluster.nodes = 64;
  // 1024 sequences of 4096 tokens per step (4M tokens): 2 per GPU.
  const auto config = config_for(512, {"bf16.enabled=true", "train_batch_size=1024", "train_micro_batch_size_per_gpu=1"});
  const zt::Plan fast = zt::plan_configurations(seventy_b(), cluster, config);
  ASSERT_FALSE(fast.fitting.empty()) << fast.advice;
  const zt::PlanCandidate& a = fast.fitting.front();
  EXPECT_EQ(a.stage, 3) << fast.advice;  // 2Ψ = 140 GB of bf16 weights fit no single 80 GB device
  EXPECT_GT(a.time.tokens_per_second, 0);
  EXPECT_NE(fast.advice.find("tokens/s"), std::string::npos) << fast.advice;
  cluster.rates.inter_node_bandwidth /= 8;
  const zt::Plan slow = zt::plan_configurations(seventy_b(), cluster, config);
  ASSERT_FALSE(slow.fitting.empty()) << slow.advice;
  const zt::PlanCandidate& b = slow.fitting.front();
  std::cout << "fast network: " << fast.advice << "\nslow network: " << slow.advice << "\n";
  // A slower network makes each step's parameter gathers dearer: the pick gathers less often
  // (a larger micro-batch, fewer micro-steps) and pays for it with recomputation.
  EXPECT_LT(b.time.tokens_per_second, a.time.tokens_per_second);
  EXPECT_GT(b.micro_batch, a.micro_batch) << slow.advice;
  EXPECT_LT(b.accumulation, a.accumulation);
}

TEST(StepTimePlan, OrderedByPredictedTimeAndKeepsTheGlobalBatch) {
  zt::ClusterSpec cluster = zt::cluster_preset("dgx-h100");
  const auto config = config_for(8, {"bf16.enabled=true", "train_micro_batch_size_per_gpu=2", "gradient_accumulation_steps=4"});
  const zt::Plan plan = zt::plan_configurations(gpt_figures("gpt-6.7b", 2048), cluster, config);
  ASSERT_GT(plan.fitting.size(), 3u);
  // The pick first, within 3% of the fastest; the rest fastest first.
  for (size_t i = 2; i < plan.fitting.size(); ++i) EXPECT_LE(plan.fitting[i - 1].time.total, plan.fitting[i].time.total);
  for (const auto& c : plan.fitting) EXPECT_LE(plan.fitting.front().time.total, 1.03 * c.time.total);
  for (const auto& c : plan.fitting) {
    EXPECT_EQ(c.micro_batch * c.accumulation, 8);
    EXPECT_NE(c.stage, 0);  // 16Ψ = 107 GB does not fit one 80 GB device
  }
  // Without rates the planner borrows a preset's and says so.
  zt::ClusterSpec bare;
  bare.devices_per_node = 8;
  bare.device_memory = 80 * kGiB;
  const zt::Plan borrowed = zt::plan_configurations(gpt_figures("gpt-6.7b", 2048), bare, config);
  ASSERT_FALSE(borrowed.notes.empty());
  EXPECT_NE(borrowed.notes.front().find("dgx-h100"), std::string::npos);
}

// --- the CLI ----------------------------------------------------------------------------------

TEST(StepTimeCli, TimeAndPlanFromAPreset) {
  auto r = run_process({cli_path(), "estimate", "--cluster", "dgx-h100", "--nodes", "2", "--preset", "gpt2-350m",
                        "--stage", "3", "--precision", "bf16", "--micro-batch", "8", "--seq", "1024", "--time", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto j = nlohmann::json::parse(r.output);
  EXPECT_EQ(j["inputs"]["devices_per_node"], 8);
  EXPECT_EQ(j["inputs"]["cluster"], "dgx-h100");
  EXPECT_GT(j["step_time"]["tokens_per_second"].get<double>(), 0);
  EXPECT_EQ(j["rates"]["inter_node_bandwidth"].get<double>(), 360e9);
  // --hpz-partition-size sets the configuration's secondary partition: the memory estimate holds
  // the second copy (2 bytes per parameter over 8 ranks), the step time gathers within it after the
  // first micro-step's forward (here every block stays gathered through backward, so the second
  // micro-step's forward is what reads it).
  r = run_process({cli_path(), "estimate", "--cluster", "dgx-h100", "--nodes", "2", "--preset", "gpt2-350m", "--stage",
                   "3", "--precision", "bf16", "--micro-batch", "8", "--seq", "1024", "--time", "--json",
                   "--hpz-partition-size", "8", "--set", "gradient_accumulation_steps=2"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto with_hpz = nlohmann::json::parse(r.output);
  EXPECT_EQ(with_hpz["inputs"]["hpz_partition_size"], 8);
  const int64_t psi = j["inputs"]["parameters"].get<int64_t>();
  EXPECT_EQ(with_hpz["per_device"]["parameters"].get<int64_t>() - j["per_device"]["parameters"].get<int64_t>(),
            2 * psi / 8);
  bool within = false;
  for (const auto& term : with_hpz["step_time"]["terms"])
    within = within || term["name"].get<std::string>().find("within the secondary partition") != std::string::npos;
  EXPECT_TRUE(within) << r.output;
  // A bandwidth flag overrides the preset; bits are read as bits.
  r = run_process({cli_path(), "estimate", "--cluster", "dgx-h100", "--nodes", "2", "--preset", "gpt2-350m",
                   "--rate", "inter_node_bandwidth=400Gb/s", "--rate", "overlap=0.5", "--rate", "inter_node_latency=2e-6",
                   "--time", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto rates = nlohmann::json::parse(r.output)["rates"];
  EXPECT_EQ(rates["inter_node_bandwidth"].get<double>(), 50e9);
  EXPECT_EQ(rates["overlap"].get<double>(), 0.5);
  EXPECT_DOUBLE_EQ(rates["inter_node_latency"].get<double>(), 2e-6);  // fractions are not rounded
  EXPECT_EQ(rates["intra_node_bandwidth"].get<double>(), 450e9);  // the rest stay the preset's
  r = run_process({cli_path(), "estimate", "--cluster", "cpu-box", "--preset", "gpt2-124m", "--seq", "64",
                   "--micro-batch", "4", "--plan"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("tokens/s"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("use stage"), std::string::npos) << r.output;
  r = run_process({cli_path(), "estimate", "--cluster", "cpu-box", "--preset", "gpt2-124m", "--time"});
  EXPECT_NE(r.output.find("optimizer step"), std::string::npos) << r.output;
}

TEST(StepTimeCli, BadInputsAreOneLineErrors) {
  for (const std::vector<std::string>& args : std::vector<std::vector<std::string>>{
           {"--cluster", "dgx-a100", "--time"},
           {"--cluster", "dgx-h100", "--rate", "inter_node_bandwidth=fast", "--time"},
           {"--cluster", "dgx-h100", "--rate", "network=50GB/s", "--time"},
           {"--cluster", "dgx-h100", "--rate", "overlap", "--time"},
           {"--cluster", "dgx-h100", "--stage", "2", "--hpz-partition-size", "8"},
           {"--cluster", "dgx-h100", "--stage", "3", "--hpz-partition-size", "3", "--time"},
           {"--cluster", "dgx-h100", "--time", "--plan"},
           {"--cluster", "dgx-h100", "--time", "--tensor-parallel", "3"},
           {"--cluster", "dgx-h100", "--time", "--rate", "overlap=2"},
           {"--device-memory", "80GiB", "--time"}}) {
    std::vector<std::string> argv = {cli_path(), "estimate", "--preset", "gpt2-124m"};
    argv.insert(argv.end(), args.begin(), args.end());
    const auto r = run_process(argv);
    EXPECT_NE(r.exit_code, 0) << args.front() << " " << args.back();
    EXPECT_NE(r.output.find("error"), std::string::npos) << r.output;
  }
}

}  // namespace
