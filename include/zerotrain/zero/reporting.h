// What the engine reports by itself in a user's own training loop: DeepSpeed's reporting keys
// (steps_per_print, wall_clock_breakdown, csv_monitor, flops_profiler, comms_logger) as its engine
// honours them, so that a C++ or Python loop gets them without the command line's trainer
// (docs/config.md "Reporting").
//
// Contract
// - Plain data, filled by zt::Engine (zerotrain/zero/engine.h) on every rank; rank 0 alone prints and
//   writes files.
// - Times are wall-clock seconds on this rank; the forward's is measured between
//   Engine::note_forward_start and note_forward_end when the caller marks it, else it is the time
//   from the end of the previous engine call to the start of backward() (the caller's forward and
//   whatever else its loop does there, such as loading the batch).
// - FLOPs are those LibTorch's profiler counts for the operations it knows (matrix products,
//   convolutions, element-wise arithmetic) on the training thread: what was executed, so a
//   recomputed forward counts twice.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace zt {

// Seconds spent per phase since the counters were last reset (every steps_per_print steps).
struct PhaseTimes {
  double forward_seconds = 0, backward_seconds = 0, step_seconds = 0;
  int64_t optimizer_steps = 0;  // accumulation windows the sums cover
};

// The flops profiler's measurement of one optimizer step (flops_profiler.profile_step) on this
// rank, over all its micro-steps.
struct FlopsReport {
  int64_t step = 0;  // the profiled optimizer step, 1-based
  double forward_flops = 0, backward_flops = 0, step_flops = 0;
  double forward_seconds = 0, backward_seconds = 0, step_seconds = 0;
  double total_seconds = 0;          // from the step's start to the end of its last step() call
  double peak_flops_per_second = 0;  // measured matrix-product rate of this rank (see peak_source)
  std::string peak_source;
  double achieved_flops_per_second = 0;  // (forward + backward + step FLOPs) / total_seconds
  double mfu = 0;                        // achieved / peak
  std::vector<std::pair<std::string, double>> operators;  // FLOPs per operator name, largest first
  std::string text;                                      // the report as printed
};

}  // namespace zt
