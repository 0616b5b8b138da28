#include "zero/step_monitor.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/csrc/profiler/orchestration/observer.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <set>

#ifdef ZT_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

#include "zerotrain/comm/comm.h"
#include "zerotrain/comm/comms_logger.h"
#include "zerotrain/zero/engine.h"
#include "zerotrain/error.h"

namespace zt {
namespace {

namespace profiler = torch::autograd::profiler;
using torch::profiler::impl::ActivityType;
using torch::profiler::impl::ProfilerConfig;
using torch::profiler::impl::ProfilerState;

// The names of the engine's own scopes (Engine::backward and Engine::step open them), by which the
// profiled operations are told apart.
constexpr const char* kBackwardScope = "zerotrain::backward";
constexpr const char* kStepScope = "zerotrain::step";

double seconds_between(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

void synchronize_device(c10::Device device) {
#ifdef ZT_CUDA
  if (device.is_cuda()) c10::cuda::device_synchronize();
#else
  (void)device;
#endif
}

std::string human_flops(double flops) {
  if (flops >= 1e12) return fmt::format("{:.2f} T", flops / 1e12);
  if (flops >= 1e9) return fmt::format("{:.2f} G", flops / 1e9);
  if (flops >= 1e6) return fmt::format("{:.2f} M", flops / 1e6);
  return fmt::format("{:.0f} ", flops);
}

ProfilerConfig flops_profiler_config() {
  return ProfilerConfig(ProfilerState::KINETO, /*report_input_shapes=*/true, /*profile_memory=*/false,
                        /*with_stack=*/false, /*with_flops=*/true, /*with_modules=*/false);
}

// The CPU's operator records carry the FLOPs (computed from the input shapes) on a GPU too, so
// the device's own activity, which needs CUPTI, is not traced.
std::set<ActivityType> profiled_activities() { return {ActivityType::CPU}; }

}  // namespace

double measure_matmul_peak(c10::ScalarType dtype, double seconds, c10::Device device, std::string& how) {
  torch::NoGradGuard no_grad;
  using clock = std::chrono::steady_clock;
  // Grows until one product takes a few milliseconds, so that the call overhead does not count.
  const int64_t largest = device.is_cuda() ? 8192 : 2048;
  int64_t n = 256;
  torch::Tensor a, b, c;
  for (;;) {
    a = torch::randn({n, n}).to(device, dtype);
    b = torch::randn({n, n}).to(device, dtype);
    c = torch::empty({n, n}, a.options());
    at::mm_out(c, a, b);  // warm-up: packing buffers, thread pool (cuBLAS handle and workspace)
    synchronize_device(device);
    const auto t0 = clock::now();
    at::mm_out(c, a, b);
    synchronize_device(device);
    if (seconds_between(t0, clock::now()) >= 0.01 || n >= largest) break;
    n *= 2;
  }
  int64_t products = 0;
  const auto start = clock::now();
  double elapsed = 0;
  do {
    at::mm_out(c, a, b);
    synchronize_device(device);
    ++products;
    elapsed = seconds_between(start, clock::now());
  } while (elapsed < seconds);
  const std::string where =
      device.is_cuda() ? device.str() : fmt::format("{} thread(s)", at::get_num_threads());
  how = fmt::format("measured matmul peak: {} {}x{} for {:.2f} s on {}", c10::toString(dtype), n, n, elapsed, where);
  return 2.0 * double(n) * double(n) * double(n) * double(products) / elapsed;
}

void emit_report(const std::string& text, const std::string& path, const char* key) {
  if (path.empty()) {
    fmt::print("{}", text);
    std::fflush(stdout);
    return;
  }
  const auto p = std::filesystem::path(path);
  if (p.has_parent_path()) std::filesystem::create_directories(p.parent_path());
  std::ofstream out(p, std::ios::trunc);
  if (!out) throw DataError(fmt::format("{}: cannot write '{}'", key, path));
  out << text;
}

StepMonitor::StepMonitor(const TrainConfig& config, Communicator& comm, c10::Device device)
    : config_(config), rank_(comm.rank()), device_(device) {
  if (config.comms_logger.enabled && !comm.comms_logger())
    comm.set_comms_logger(std::make_shared<CommsLogger>(config.comms_logger, comm.rank(), comm.world_size()));
  // DeepSpeed writes csv_monitor's files only when the configuration enables it; the schema's
  // default (on) is the command line's, whose trainer writes its own log.
  auto given = [&](const std::string& key) {
    auto it = config.sources.find(key);
    return it != config.sources.end() && it->second != ValueSource::Default;
  };
  csv_enabled_ = config.csv_monitor.enabled && given("csv_monitor.enabled");
  if (csv_enabled_)
    csv_dir_ = (std::filesystem::path(config.csv_monitor.output_path) / config.csv_monitor.job_name).string();
  if (config.flops_profiler.enabled && rank_ == 0) {
    const std::string F = "flops_profiler.";
    std::vector<std::string> breakdown;
    for (const char* key : {"module_depth", "top_modules", "detailed", "recompute_fwd_factor"})
      if (given(F + key)) breakdown.push_back(F + key);
    if (!breakdown.empty())
      notes_.push_back(fmt::format("note: {} shape the analytic profile of the command line's built-in models; "
                                   "in a training loop of your own the engine measures the executed operations "
                                   "(recomputation included) and lists them by operator instead",
                                   fmt::join(breakdown, ", ")));
  }
  last_call_end_ = Clock::now();
}

StepMonitor::~StepMonitor() {
  if (profiling_) {
    try {
      profiler::disableProfiler();
    } catch (...) {  // a destructor must not throw; the profile is lost with the engine
    }
  }
}

void StepMonitor::set_sink(std::function<void(const std::string&)> sink) {
  sink_ = std::move(sink);
  sink_set_ = true;
}

void StepMonitor::disable() {
  enabled_ = false;
  notes_.clear();
  if (profiling_) {
    profiler::disableProfiler();
    profiling_ = false;
  }
}

void StepMonitor::print(const std::string& line) const {
  if (rank_ != 0 || !enabled_) return;
  if (sink_set_) {
    if (sink_) sink_(line);
    return;
  }
  fmt::print("{}\n", line);
  std::fflush(stdout);
}

void StepMonitor::flush_notes() {
  for (const auto& note : notes_) print(note);
  notes_.clear();
}

void StepMonitor::event(const std::string& name, double value, int64_t samples) {
  if (rank_ != 0 || !csv_enabled_ || !enabled_) return;
  auto& file = csv_files_[name];
  if (!file) {
    std::filesystem::create_directories(csv_dir_);
    std::string base = name;
    std::replace(base.begin(), base.end(), '/', '_');
    std::replace(base.begin(), base.end(), ' ', '_');
    const auto path = std::filesystem::path(csv_dir_) / (base + ".csv");
    // Appends, as DeepSpeed's monitor does: a resumed run continues the files of the run it resumes.
    const bool fresh = !std::filesystem::exists(path);
    file = std::make_unique<std::ofstream>(path, std::ios::app);
    if (!*file) throw DataError(fmt::format("csv_monitor.output_path: cannot write '{}'", path.string()));
    if (fresh) *file << "step," << name.substr(name.rfind('/') + 1) << "\n";
  }
  *file << samples << "," << fmt::format("{}", value) << "\n";
  file->flush();
}

void StepMonitor::arm(const EngineStepState& state) {
  last_call_end_ = Clock::now();
  if (!enabled_) return;
  const FlopsProfilerConfig& fp = config_.flops_profiler;
  if (!fp.enabled || profiling_ || profile_done_ || state.global_step + 1 != fp.profile_step) return;
  // Kineto reports a missing GPU driver as an error line on CPU-only machines; quiet unless the
  // user asked for its logging.
  ::setenv("KINETO_LOG_LEVEL", "5", /*overwrite=*/0);
  const auto activities = profiled_activities();
  try {
    // Enabling a second profiler would silently replace the user's own (torch.profiler) and end
    // it with ours: theirs wins.
    if (torch::profiler::impl::profilerEnabled())
      throw Error("another profiler (torch.profiler or LibTorch's) is running on this thread");
    profiler::prepareProfiler(flops_profiler_config(), activities);
    profiler::enableProfiler(flops_profiler_config(), activities);
  } catch (const std::exception& e) {
    // The user's own profiler (torch.profiler) may already run on this thread: their run goes on.
    profile_done_ = true;
    const std::string why = e.what();
    if (rank_ == 0)
      notes_.push_back(fmt::format("note: flops_profiler: step {} is not profiled: {}",
                                   fp.profile_step, why.substr(0, why.find('\n'))));
    return;
  }
  profiling_ = true;
  profile_start_ = Clock::now();
  profile_times_ = {};
}

void StepMonitor::forward_started() {
  if (!notes_.empty()) flush_notes();
  forward_start_ = Clock::now();
  forward_marked_ = true;
}

void StepMonitor::forward_ended() {
  if (!forward_start_) return;
  const double s = seconds_between(*forward_start_, Clock::now());
  times_.forward_seconds += s;
  profile_times_.forward_seconds += s;
  forward_start_.reset();
}

void StepMonitor::before_backward(double loss) {
  if (!notes_.empty()) flush_notes();
  const auto now = Clock::now();
  if (!forward_marked_) {
    const double s = seconds_between(last_call_end_, now);
    times_.forward_seconds += s;
    profile_times_.forward_seconds += s;
  }
  forward_marked_ = false;
  forward_start_.reset();
  if (!std::isnan(loss)) {
    loss_sum_ += loss;
    ++loss_count_;
  }
  phase_start_ = now;
}

void StepMonitor::after_backward() {
  const auto now = Clock::now();
  const double s = seconds_between(phase_start_, now);
  times_.backward_seconds += s;
  profile_times_.backward_seconds += s;
  last_call_end_ = now;
}

void StepMonitor::before_step() { phase_start_ = Clock::now(); }

void StepMonitor::after_step(const StepResult& result, const EngineStepState& state) {
  if (config_.wall_clock_breakdown) synchronize_device(device_);
  auto now = Clock::now();
  const double s = seconds_between(phase_start_, now);
  times_.step_seconds += s;
  profile_times_.step_seconds += s;
  last_call_end_ = now;
  if (!result.boundary) return;
  ++times_.optimizer_steps;
  if (!enabled_) return;
  if (profiling_ && state.global_step == config_.flops_profiler.profile_step) finish_profile(state);

  const int64_t samples = state.global_step * config_.train_batch_size;
  if (loss_count_ > 0) event("Train/Samples/train_loss", loss_sum_ / double(loss_count_), samples);
  loss_sum_ = 0;
  loss_count_ = 0;
  event("Train/Samples/lr", result.lr, samples);
  if (config_.precision == Precision::FP16) event("Train/Samples/loss_scale", result.loss_scale, samples);
  const int64_t every = config_.steps_per_print;
  if (every > 0 && state.global_step % every == 0) {
    const std::string momentum = config_.optimizer.type == "SGD"
                                     ? fmt::format("[{}]", config_.optimizer.momentum)
                                     : fmt::format("[({}, {})]", config_.optimizer.beta1, config_.optimizer.beta2);
    print(fmt::format("[Rank 0] step={}, skipped={}, lr=[{}], mom={}", state.global_step, state.skipped_steps,
                      result.lr, momentum));
    if (config_.wall_clock_breakdown) {
      const double n = double(std::max<int64_t>(1, times_.optimizer_steps));
      const double f = 1e3 * times_.forward_seconds / n, b = 1e3 * times_.backward_seconds / n,
                   st = 1e3 * times_.step_seconds / n;
      print(fmt::format("[Rank 0] time (ms) | forward: {:.2f} | backward: {:.2f} | step: {:.2f} (per optimizer step, "
                        "over the last {})",
                        f, b, st, times_.optimizer_steps));
      event("Train/Samples/elapsed_time_ms_forward", f, samples);
      event("Train/Samples/elapsed_time_ms_backward", b, samples);
      event("Train/Samples/elapsed_time_ms_step", st, samples);
    }
    times_ = {};
  }
}

void StepMonitor::finish_profile(const EngineStepState& state) {
  synchronize_device(device_);
  const double total = seconds_between(profile_start_, Clock::now());
  std::unique_ptr<profiler::ProfilerResult> result = profiler::disableProfiler();
  profiling_ = false;
  profile_done_ = true;

  // The engine's scopes, then each counted operation by the scope it ran in.
  struct Interval {
    uint64_t start, end;
  };
  std::vector<Interval> backward, step;
  const auto& events = result->events();
  for (const auto& e : events) {
    if (e.name() == kBackwardScope) backward.push_back({e.startNs(), e.endNs()});
    else if (e.name() == kStepScope) step.push_back({e.startNs(), e.endNs()});
  }
  auto inside = [](const std::vector<Interval>& spans, uint64_t t) {
    for (const auto& s : spans)
      if (t >= s.start && t <= s.end) return true;
    return false;
  };
  FlopsReport report;
  report.step = state.global_step;
  std::map<std::string, double> by_operator;
  for (const auto& e : events) {
    const double flops = double(e.flops());
    if (flops <= 0) continue;
    by_operator[e.name()] += flops;
    if (inside(backward, e.startNs())) report.backward_flops += flops;
    else if (inside(step, e.startNs())) report.step_flops += flops;
    else report.forward_flops += flops;
  }
  for (const auto& [name, flops] : by_operator) report.operators.emplace_back(name, flops);
  std::sort(report.operators.begin(), report.operators.end(),
            [](const auto& a, const auto& b) { return a.second > b.second; });
  report.forward_seconds = profile_times_.forward_seconds;
  report.backward_seconds = profile_times_.backward_seconds;
  report.step_seconds = profile_times_.step_seconds;
  report.total_seconds = total;
  const double counted = report.forward_flops + report.backward_flops + report.step_flops;
  report.achieved_flops_per_second = total > 0 ? counted / total : 0;
  const c10::ScalarType dtype = config_.precision == Precision::BF16   ? c10::kBFloat16
                                : config_.precision == Precision::FP16 ? c10::kHalf
                                                                       : c10::kFloat;
  report.peak_flops_per_second = measure_matmul_peak(dtype, 0.2, device_, report.peak_source);
  report.mfu = report.peak_flops_per_second > 0 ? report.achieved_flops_per_second / report.peak_flops_per_second : 0;

  auto rate = [](double flops, double seconds) {
    return seconds > 0 ? fmt::format(" ({}FLOP/s)", human_flops(flops / seconds)) : std::string();
  };
  std::string text = fmt::format(
      "flops profiler: optimizer step {} on rank 0, as LibTorch's profiler counts the executed operations "
      "(matrix products, convolutions, element-wise arithmetic; recomputation included)\n",
      report.step);
  text += fmt::format("  trainable parameters      {:.2f}M\n", double(state.trainable_parameters) / 1e6);
  text += fmt::format("  forward                   {}FLOP in {:.3f} s{}\n", human_flops(report.forward_flops),
                      report.forward_seconds, rate(report.forward_flops, report.forward_seconds));
  text += fmt::format("  backward                  {}FLOP in {:.3f} s{}\n", human_flops(report.backward_flops),
                      report.backward_seconds, rate(report.backward_flops, report.backward_seconds));
  text += fmt::format("  optimizer step            {}FLOP in {:.3f} s (fused kernels are not counted)\n",
                      human_flops(report.step_flops), report.step_seconds);
  text += fmt::format("  the whole step            {}FLOP in {:.3f} s: {}FLOP/s achieved\n", human_flops(counted), total,
                      human_flops(report.achieved_flops_per_second));
  text += fmt::format("  peak                      {}FLOP/s ({}): {:.1f}% of it\n",
                      human_flops(report.peak_flops_per_second), report.peak_source, 100 * report.mfu);
  text += "  by operator              ";
  for (size_t i = 0; i < report.operators.size(); ++i)
    text += fmt::format("{} {} {:.1f}%", i == 0 ? "" : ",", report.operators[i].first,
                        counted > 0 ? 100 * report.operators[i].second / counted : 0.0);
  text += "\n";
  report.text = text;
  flops_ = std::move(report);
  if (rank_ == 0) {
    if (!config_.flops_profiler.output_file.empty())
      emit_report(text, config_.flops_profiler.output_file, "flops_profiler.output_file");
    else
      print(text.substr(0, text.size() - 1));
  }
}

}  // namespace zt
