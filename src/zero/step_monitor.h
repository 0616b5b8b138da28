// The engine's own reporting (zerotrain/zero/reporting.h): an internal part of zt::Engine, which calls
// it around backward() and step(). Not thread-safe: driven from the training thread, as the engine.
#pragma once
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <chrono>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "zerotrain/config/config.h"
#include "zerotrain/zero/reporting.h"

namespace torch::autograd::profiler {
struct ProfilerResult;
}

namespace zt {

class Communicator;
class CommsLogger;
struct StepResult;

// What the monitor reads of the engine after an optimizer step.
struct EngineStepState {
  int64_t global_step = 0;
  int64_t skipped_steps = 0;
  int64_t trainable_parameters = 0;
};

class StepMonitor {
 public:
  // Attaches a comms logger to `comm` when the configuration enables comms_logger and `comm` has
  // none (before the engine's first collective). Throws zt::ConfigError for a comms_logger.prof_ops
  // name that is not an operation.
  // `device`: where the model computes until set_device() says otherwise (the engine knows it only
  // once it has looked at the parameters: a model built sharded has no data on any device yet).
  StepMonitor(const TrainConfig& config, Communicator& comm, c10::Device device);
  void set_device(c10::Device device) { device_ = device; }
  ~StepMonitor();

  void set_sink(std::function<void(const std::string&)> sink);
  void disable();

  // The engine's state is at `state` before the next step's first micro-step: the flops profiler
  // starts here when that step is the profiled one (after construction, a load, or a step).
  void arm(const EngineStepState& state);
  void forward_started();
  void forward_ended();
  void before_backward(double loss_value_or_nan);
  void after_backward();
  void before_step();
  void after_step(const StepResult& result, const EngineStepState& state);

  PhaseTimes phase_times() const { return times_; }
  const FlopsReport* flops_report() const { return flops_ ? &*flops_ : nullptr; }
  // Whether before_backward needs the loss's value (csv_monitor writes it).
  bool wants_loss() const { return csv_enabled_ && enabled_ && rank_ == 0; }

 private:
  using Clock = std::chrono::steady_clock;
  void print(const std::string& line) const;
  void flush_notes();
  void event(const std::string& name, double value, int64_t samples);
  void finish_profile(const EngineStepState& state);

  TrainConfig config_;
  int rank_ = 0;
  c10::Device device_;
  bool enabled_ = true;
  std::function<void(const std::string&)> sink_;
  bool sink_set_ = false;
  std::vector<std::string> notes_;  // said once, at the first forward or backward (after a sink is set)
  bool csv_enabled_ = false;
  std::string csv_dir_;
  std::map<std::string, std::unique_ptr<std::ofstream>> csv_files_;

  // Wall-clock phases: the end of the last engine call starts the next forward's interval.
  Clock::time_point last_call_end_;
  std::optional<Clock::time_point> forward_start_;
  bool forward_marked_ = false;  // note_forward_* bracketed the forward of this micro-step
  Clock::time_point phase_start_;
  PhaseTimes times_;
  double loss_sum_ = 0;
  int64_t loss_count_ = 0;

  // The flops profiler: running from arm() to the end of the profiled step.
  bool profiling_ = false;
  bool profile_done_ = false;
  Clock::time_point profile_start_;
  PhaseTimes profile_times_;
  std::optional<FlopsReport> flops_;
};

// The sustained rate of a square matrix product in `dtype` on `device` for about `seconds`, in
// FLOP/s: the flops profiler's peak, measured, as no datasheet figure applies to a CPU and a GPU's
// clocks and power limits vary. `how` receives a description for the report.
double measure_matmul_peak(c10::ScalarType dtype, double seconds, c10::Device device, std::string& how);

// Rank 0's report: to standard output when `path` is empty, else written to `path`; throws
// zt::DataError naming `key` when the file cannot be written.
void emit_report(const std::string& text, const std::string& path, const char* key);

}  // namespace zt
