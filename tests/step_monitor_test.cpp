// The engine's own reporting in a user's loop (zerotrain/zero/reporting.h): DeepSpeed's steps_per_print,
// wall_clock_breakdown, csv_monitor, flops_profiler and comms_logger without the command line.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "support/multirank.h"
#include "support/process.h"
#include "zerotrain/comm/comm.h"
#include "zerotrain/comm/comms_logger.h"
#include "zerotrain/config/config.h"
#include "zerotrain/zero/engine.h"

#include <torch/csrc/autograd/profiler_kineto.h>

namespace {

namespace fs = std::filesystem;

// Two bias-free linear layers: every FLOP LibTorch counts is a matrix product of known size.
struct Net : torch::nn::Module {
  torch::nn::Linear a{nullptr}, b{nullptr};
  Net() {
    a = register_module("a", torch::nn::Linear(torch::nn::LinearOptions(16, 32).bias(false)));
    b = register_module("b", torch::nn::Linear(torch::nn::LinearOptions(32, 8).bias(false)));
  }
  torch::Tensor forward(torch::Tensor x) { return b(a(x)); }
};

std::shared_ptr<zt::Communicator> single_rank() {
  zt::RendezvousInfo info;
  info.master_port = zt::testing::free_port();
  info.source = "single";
  return zt::make_communicator(info, zt::CommOptions{});
}

struct Recorded {
  std::vector<std::string> lines;
  std::vector<double> losses;  // per micro-step, as given to backward
};

// `steps` optimizer steps of 2 micro-steps of batch 4 each.
Recorded train(zt::Engine& engine, Net& net, int steps, bool quiet = false) {
  Recorded run;
  if (!quiet) engine.set_report_sink([&](const std::string& line) { run.lines.push_back(line); });
  torch::manual_seed(5);
  for (int s = 0; s < steps; ++s)
    for (int m = 0; m < 2; ++m) {
      auto loss = net.forward(torch::randn({4, 16})).sum();
      run.losses.push_back(loss.item<double>());
      engine.backward(loss);
      engine.step();
    }
  return run;
}

std::string config_json(const std::string& extra) {
  return R"({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
             "optimizer": {"type": "Adam", "params": {"lr": 0.01}})" +
         (extra.empty() ? std::string() : ", " + extra) + "}";
}

std::vector<std::string> read_lines(const fs::path& path) {
  std::ifstream in(path);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

bool contains(const std::vector<std::string>& lines, const std::string& needle) {
  for (const auto& l : lines)
    if (l.find(needle) != std::string::npos) return true;
  return false;
}

TEST(StepMonitor, PrintsDeepSpeedsProgressLineEveryStepsPerPrintWithTheWallClockBreakdown) {
  auto config = zt::parse_config(config_json(R"("steps_per_print": 2, "wall_clock_breakdown": true)"), {}, 1);
  auto net = std::make_shared<Net>();
  zt::Engine engine(net, config, single_rank());
  const Recorded run = train(engine, *net, 5);
  // Steps 2 and 4 print, each followed by its times; 1, 3 and 5 do not.
  ASSERT_EQ(run.lines.size(), 4u) << ::testing::PrintToString(run.lines);
  EXPECT_EQ(run.lines[0], "[Rank 0] step=2, skipped=0, lr=[0.01], mom=[(0.9, 0.999)]");
  EXPECT_NE(run.lines[1].find("[Rank 0] time (ms) | forward: "), std::string::npos) << run.lines[1];
  EXPECT_NE(run.lines[1].find("(per optimizer step, over the last 2)"), std::string::npos) << run.lines[1];
  EXPECT_EQ(run.lines[2], "[Rank 0] step=4, skipped=0, lr=[0.01], mom=[(0.9, 0.999)]");
  // The counters restart with every line: one step since the last one.
  const zt::PhaseTimes times = engine.phase_times();
  EXPECT_EQ(times.optimizer_steps, 1);
  EXPECT_GT(times.backward_seconds, 0.0);
  EXPECT_GT(times.step_seconds, 0.0);
}

TEST(StepMonitor, CsvMonitorWritesDeepSpeedsEventFilesOnlyWhenTheConfigurationEnablesIt) {
  const fs::path dir = fs::path(::testing::TempDir()) / ("csv_monitor_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  {
    // Not enabled by the configuration: the schema's default (the command line's) does not count.
    auto config = zt::parse_config(config_json(R"("csv_monitor": {"output_path": ")" + dir.string() + R"("})"), {}, 1);
    auto net = std::make_shared<Net>();
    zt::Engine engine(net, config, single_rank());
    train(engine, *net, 2, /*quiet=*/true);
    EXPECT_FALSE(fs::exists(dir));
  }
  auto config = zt::parse_config(
      config_json(R"("wall_clock_breakdown": true, "steps_per_print": 3, "csv_monitor": {"enabled": true, "output_path": ")" +
                  dir.string() + R"(", "job_name": "job"})"),
      {}, 1);
  auto net = std::make_shared<Net>();
  zt::Engine engine(net, config, single_rank());
  const Recorded run = train(engine, *net, 3, /*quiet=*/true);
  const auto loss = read_lines(dir / "job" / "Train_Samples_train_loss.csv");
  ASSERT_EQ(loss.size(), 4u);
  EXPECT_EQ(loss[0], "step,train_loss");
  // Each row: the samples so far (global step x train_batch_size 8) and the window's mean loss.
  for (int s = 0; s < 3; ++s) {
    std::istringstream row(loss[s + 1]);
    std::string samples, value;
    std::getline(row, samples, ',');
    std::getline(row, value);
    EXPECT_EQ(samples, std::to_string(8 * (s + 1)));
    EXPECT_NEAR(std::stod(value), (run.losses[2 * s] + run.losses[2 * s + 1]) / 2, 1e-9);
  }
  EXPECT_EQ(read_lines(dir / "job" / "Train_Samples_lr.csv").size(), 4u);
  // The times are written with the progress line only (step 3), as DeepSpeed's.
  EXPECT_EQ(read_lines(dir / "job" / "Train_Samples_elapsed_time_ms_forward.csv").size(), 2u);
  EXPECT_FALSE(fs::exists(dir / "job" / "Train_Samples_loss_scale.csv"));  // fp16 only
  fs::remove_all(dir);
}

TEST(StepMonitor, FlopsProfilerCountsTheProfiledStepsMatrixProductsByPhase) {
  auto config = zt::parse_config(
      config_json(R"("steps_per_print": 100, "flops_profiler": {"enabled": true, "profile_step": 2, "top_modules": 3})"),
      {}, 1);
  auto net = std::make_shared<Net>();
  zt::Engine engine(net, config, single_rank());
  std::vector<std::string> lines;
  engine.set_report_sink([&](const std::string& line) { lines.push_back(line); });
  torch::manual_seed(5);
  for (int s = 0; s < 3; ++s) {
    EXPECT_EQ(engine.flops_report() == nullptr, s < 2) << "step " << s;
    for (int m = 0; m < 2; ++m) {
      engine.note_forward_start();
      auto loss = net->forward(torch::randn({4, 16})).sum();
      engine.note_forward_end();
      engine.backward(loss);
      engine.step();
    }
  }
  const zt::FlopsReport* report = engine.flops_report();
  ASSERT_NE(report, nullptr);
  EXPECT_EQ(report->step, 2);
  // Per micro-step, batch 4: forward 2·4·16·32 + 2·4·32·8; backward the weight gradients of both
  // layers and the input gradient of the second (the batch needs none).
  const double forward = 2 * (2.0 * 4 * 16 * 32 + 2.0 * 4 * 32 * 8);
  const double backward = 2 * (2.0 * 4 * 16 * 32 + 2 * 2.0 * 4 * 32 * 8);
  EXPECT_DOUBLE_EQ(report->forward_flops, forward);
  // The engine's own scalar arithmetic on the loss (its scaling) may count a few FLOPs.
  EXPECT_NEAR(report->backward_flops, backward, 16);
  ASSERT_FALSE(report->operators.empty());
  EXPECT_EQ(report->operators[0].first, "aten::mm");
  EXPECT_DOUBLE_EQ(report->operators[0].second, forward + backward);
  EXPECT_GT(report->peak_flops_per_second, 0);
  EXPECT_GT(report->mfu, 0);
  // Printed once, after a note that top_modules shapes only the built-in models' breakdown.
  ASSERT_GE(lines.size(), 2u);
  EXPECT_NE(lines[0].find("note: flops_profiler.top_modules"), std::string::npos) << lines[0];
  EXPECT_TRUE(contains(lines, "flops profiler: optimizer step 2 on rank 0")) << ::testing::PrintToString(lines);
}

TEST(StepMonitor, FlopsProfilerStepsAsideWhenTheUsersProfilerRuns) {
  namespace profiler = torch::autograd::profiler;
  const torch::profiler::impl::ProfilerConfig mine(torch::profiler::impl::ProfilerState::KINETO);
  profiler::prepareProfiler(mine, {torch::profiler::impl::ActivityType::CPU});
  profiler::enableProfiler(mine, {torch::profiler::impl::ActivityType::CPU});
  auto config = zt::parse_config(config_json(R"("flops_profiler": {"enabled": true, "profile_step": 1})"), {}, 1);
  auto net = std::make_shared<Net>();
  std::vector<std::string> lines;
  {
    zt::Engine engine(net, config, single_rank());
    engine.set_report_sink([&](const std::string& line) { lines.push_back(line); });
    train(engine, *net, 2, /*quiet=*/true);
    EXPECT_EQ(engine.flops_report(), nullptr);
  }
  ASSERT_EQ(lines.size(), 1u) << ::testing::PrintToString(lines);
  EXPECT_NE(lines[0].find("note: flops_profiler: step 1 is not profiled"), std::string::npos) << lines[0];
  auto result = profiler::disableProfiler();  // the user's profile is intact
  ASSERT_NE(result, nullptr);
  EXPECT_FALSE(result->events().empty());
}

TEST(StepMonitor, CommsLoggerIsAttachedToTheCommunicatorAndCountsTheEnginesCollectives) {
  if (zt::testing::is_rank_process()) {
    auto config = zt::parse_config(config_json(R"("comms_logger": {"enabled": true})"), {}, 2);
    auto comm = zt::make_communicator(zt::rendezvous_from_environment(), zt::CommOptions{});
    ASSERT_EQ(comm->comms_logger(), nullptr);
    auto net = std::make_shared<Net>();
    zt::Engine engine(net, config, comm);
    ASSERT_NE(engine.comms_logger(), nullptr);
    EXPECT_EQ(comm->comms_logger(), engine.comms_logger());
    const int64_t at_construction = engine.comms_logger()->total_count();
    EXPECT_GT(at_construction, 0) << "the broadcast of the initial values";
    train(engine, *net, 2, /*quiet=*/true);
    EXPECT_GT(engine.comms_logger()->total_count(), at_construction) << "the gradients' reduction";
    EXPECT_NE(engine.comms_summary().find("broadcast"), std::string::npos) << engine.comms_summary();
    EXPECT_NE(engine.comms_summary().find("all_reduce"), std::string::npos) << engine.comms_summary();
    return;
  }
  auto r = zt::testing::run_ranks(2, "StepMonitor.CommsLoggerIsAttachedToTheCommunicatorAndCountsTheEnginesCollectives");
  EXPECT_TRUE(r.all_succeeded()) << r.describe();
  // Off: no logger is made.
  auto plain = zt::parse_config(config_json(""), {}, 1);
  zt::Engine quiet(std::make_shared<Net>(), plain, single_rank());
  EXPECT_EQ(quiet.comms_logger(), nullptr);
  EXPECT_EQ(quiet.comms_summary(), "");
}

TEST(StepMonitor, DisabledReportsPrintAndWriteNothing) {
  const fs::path dir = fs::path(::testing::TempDir()) / ("csv_off_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  auto config = zt::parse_config(
      config_json(R"("steps_per_print": 1, "flops_profiler": {"enabled": true}, "csv_monitor": {"enabled": true, "output_path": ")" +
                  dir.string() + R"("})"),
      {}, 1);
  auto net = std::make_shared<Net>();
  zt::Engine engine(net, config, single_rank());
  engine.disable_reports();
  const Recorded run = train(engine, *net, 2);
  EXPECT_TRUE(run.lines.empty()) << ::testing::PrintToString(run.lines);
  EXPECT_FALSE(fs::exists(dir));
  EXPECT_EQ(engine.flops_report(), nullptr);
  EXPECT_EQ(engine.phase_times().optimizer_steps, 2) << "the times still count";
}

}  // namespace
