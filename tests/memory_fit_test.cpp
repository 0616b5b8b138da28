// The memory check before launch (zerotrain/memory/memory_fit.h): a run the estimate knows will not fit
// is refused with the settings that would make it fit, which do; the CLI refuses before any rank
// starts and --skip-memory-check starts it anyway.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "support/process.h"
#include "zerotrain/config/config.h"
#include "zerotrain/error.h"
#include "zerotrain/memory/estimate.h"
#include "zerotrain/memory/memory_fit.h"
#include "zerotrain/models/gpt.h"

namespace {

constexpr int64_t kGiB = int64_t(1) << 30;

struct FitCase {
  zt::TrainConfig config;
  zt::ModelFigures model;
  zt::ClusterSpec cluster;
};

// A GPT run on `ranks` CPU ranks of one node with `available` bytes of host memory.
FitCase cpu_run(int ranks, int64_t available, const std::vector<std::string>& overrides) {
  FitCase r{zt::parse_config("", overrides, ranks), {}, {}};
  const zt::GPTConfig gpt = zt::gpt_config_of(r.config);
  const int64_t seq = r.config.data.sequence_length > 0 ? r.config.data.sequence_length : gpt.context_length;
  r.model = zt::gpt_model_figures(gpt, seq, r.config.zero.stage3_param_persistence_threshold);
  r.cluster.device = zt::DeviceKind::Cpu;
  r.cluster.devices_per_node = ranks;
  r.cluster.host_memory = available;
  return r;
}

// The host estimate of the run `overrides` describe with `changes` applied on top.
int64_t host_need(const std::vector<std::string>& overrides, int64_t available,
                  const std::vector<zt::SettingChange>& changes) {
  std::vector<std::string> all = overrides;
  for (const auto& c : changes) all.push_back(c.key + "=" + c.value);
  const FitCase changed = cpu_run(2, available, all);
  return zt::estimate_memory(changed.model, changed.cluster, changed.config).per_host.total();
}

// The NVMe offload of a 2.7B GPT with DeepSpeed's default sizes (sub-groups of 10^9 elements,
// buckets of 5*10^8, 10^9 parameter elements kept in memory) on 2 ranks of a 23 GiB machine.
const std::vector<std::string> kNvmeDefaults = {
    "model.preset=gpt-2.7b",
    "data.sequence_length=64",
    "zero_optimization.stage=3",
    "zero_optimization.offload_optimizer.device=nvme",
    "zero_optimization.offload_optimizer.nvme_path=/tmp",
    "zero_optimization.offload_param.device=nvme",
    "zero_optimization.offload_param.nvme_path=/tmp",
    "zero_optimization.offload_param.buffer_size=140000000",
};

TEST(MemoryFit, ARunWithinTheAvailableMemoryFits) {
  const FitCase r = cpu_run(2, 16 * kGiB, {});
  const zt::MemoryFit fit = zt::check_memory_fit(r.model, r.cluster, r.config);
  EXPECT_TRUE(fit.fits);
  EXPECT_GT(fit.needed, 0);
  EXPECT_LE(fit.needed, fit.available);
  EXPECT_TRUE(fit.changes.empty());
  EXPECT_TRUE(fit.layout.empty());
}

// The run's own sizes are lowered, and only as far as needed: applying the changes brings the
// estimate within the available memory less the headroom, and each change is needed.
TEST(MemoryFit, DeepSpeedDefaultSizesOnNvmeAreLoweredUntilTheRunFits) {
  const int64_t available = 23 * kGiB;
  const FitCase r = cpu_run(2, available, kNvmeDefaults);
  const zt::MemoryFit fit = zt::check_memory_fit(r.model, r.cluster, r.config);
  ASSERT_FALSE(fit.fits);
  EXPECT_GT(fit.needed, available);
  EXPECT_EQ(fit.needed, zt::estimate_memory(r.model, r.cluster, r.config).per_host.total());
  ASSERT_FALSE(fit.changes.empty());
  EXPECT_TRUE(fit.layout.empty()) << fit.layout;
  const auto target = int64_t(double(available) * (1 - r.cluster.headroom));
  EXPECT_LE(fit.needed_after_changes, target);
  EXPECT_EQ(host_need(kNvmeDefaults, available, fit.changes), fit.needed_after_changes);
  bool names_sub_groups = false;
  for (size_t i = 0; i < fit.changes.size(); ++i) {
    names_sub_groups |= fit.changes[i].key == "zero_optimization.sub_group_size";
    // Without any one of the changes it would not fit.
    auto others = fit.changes;
    others.erase(others.begin() + long(i));
    EXPECT_GT(host_need(kNvmeDefaults, available, others), target) << "the change of " << fit.changes[i].key << " is not needed";
  }
  EXPECT_TRUE(names_sub_groups);
  const std::string line = zt::describe_misfit(fit, "--skip-memory-check");
  EXPECT_NE(line.find("--set zero_optimization.sub_group_size="), std::string::npos) << line;
  EXPECT_NE(line.find("--skip-memory-check"), std::string::npos) << line;
  EXPECT_EQ(line.find('\n'), std::string::npos);
}

// No size of the run fits, another layout does: the planner's pick is named.
TEST(MemoryFit, WhenNoSizeFitsTheLayoutThatDoesIsNamed) {
  const FitCase r = cpu_run(2, 12 * kGiB, {"model.preset=gpt2-774m", "data.sequence_length=64", "zero_optimization.stage=0"});
  const zt::MemoryFit fit = zt::check_memory_fit(r.model, r.cluster, r.config);
  ASSERT_FALSE(fit.fits);
  ASSERT_FALSE(fit.layout.empty());
  EXPECT_NE(fit.layout.find("stage "), std::string::npos) << fit.layout;
  EXPECT_LE(fit.needed_after_changes, int64_t(double(12 * kGiB) * 0.9));
  EXPECT_NE(zt::describe_misfit(fit, "--x").find(fit.layout), std::string::npos);
}

TEST(MemoryFit, WhenNothingFitsItSaysSo) {
  const FitCase r = cpu_run(2, kGiB / 4, {"model.preset=gpt-13b", "data.sequence_length=64"});
  const zt::MemoryFit fit = zt::check_memory_fit(r.model, r.cluster, r.config);
  ASSERT_FALSE(fit.fits);
  EXPECT_TRUE(fit.changes.empty());
  EXPECT_TRUE(fit.layout.empty());
  EXPECT_NE(zt::describe_misfit(fit, "--x").find("no stage, offload or size of this run fits"), std::string::npos);
}

TEST(MemoryFit, AvailableHostMemoryIsTheKernelsFigureOrTheGivenOne) {
  ::unsetenv("ZT_HOST_MEMORY_AVAILABLE");
  const int64_t kernel = zt::available_host_memory();
  EXPECT_GT(kernel, 0);
  ::setenv("ZT_HOST_MEMORY_AVAILABLE", "123456789", 1);
  EXPECT_EQ(zt::available_host_memory(), 123456789);
  ::setenv("ZT_HOST_MEMORY_AVAILABLE", "12GiB", 1);
  EXPECT_THROW(zt::available_host_memory(), zt::ConfigError);
  ::unsetenv("ZT_HOST_MEMORY_AVAILABLE");
}

// Through the CLI: refused in one line before any rank starts; --skip-memory-check trains.
TEST(MemoryFitCli, TrainRefusesARunTheEstimateSaysWillNotFitUnlessTold) {
  const std::string dir = zt::testing::make_temp_dir("memory_fit_cli");
  const std::string config = dir + "/config.json";
  std::ofstream(config) << R"({"train_micro_batch_size_per_gpu": 1, "train": {"steps": 1, "threads": 1}})";
  const std::map<std::string, std::string> tight = {{"ZT_HOST_MEMORY_AVAILABLE", "1000000"}};
  const auto refused = zt::testing::run_process(
      {"/bin/sh", "-c", "exec \"$0\" \"$@\" 2>&1 >/dev/null", zt::testing::cli_path(), "train", config}, tight,
      std::chrono::seconds(60), dir);
  EXPECT_EQ(refused.exit_code, 2) << refused.output;
  EXPECT_EQ(std::count(refused.output.begin(), refused.output.end(), '\n'), 1) << refused.output;
  EXPECT_NE(refused.output.find("zerotrain: error: the memory estimate of this run is"), std::string::npos)
      << refused.output;
  EXPECT_NE(refused.output.find("976.6 KiB is available"), std::string::npos) << refused.output;
  EXPECT_NE(refused.output.find("--skip-memory-check runs it anyway"), std::string::npos) << refused.output;
  EXPECT_FALSE(std::filesystem::exists(dir + "/runs"));  // no rank started

  const auto started = zt::testing::run_process(
      {zt::testing::cli_path(), "train", config, "--skip-memory-check"}, tight, std::chrono::seconds(120), dir);
  EXPECT_EQ(started.exit_code, 0) << started.output;
  EXPECT_NE(started.output.find("step 1/1"), std::string::npos) << started.output;
}

}  // namespace
