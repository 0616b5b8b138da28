#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>

#include <chrono>
#include <exception>
#include <mutex>
#include <thread>
#include <utility>

#include "common/check.h"
#include "zero/optimizer_partition.h"

// The delayed parameter update (docs/offload.md "Delayed parameter update"): the step on a worker
// thread from a snapshot of the gradients, into the next working copy, installed at the next step;
// installing the next working copy serves the step staged through the host too.

namespace zt {

void OptimizerPartition::join_worker() {
  // A step still running owns the buffers and the state: it finishes before they go (its error,
  // if any, has nobody left to hear it).
  if (worker_.joinable()) worker_.join();
}

void OptimizerPartition::launch_step(double lr, int64_t step, float grad_scale, const GradientReducer& gradients,
                                     std::optional<Betas> betas) {
  ZT_CHECK_STATE(options_.delayed, "launch_step without the delayed update");
  ZT_CHECK_STATE(!in_flight_, "launch_step while a step is in flight");
  snapshot_gradients(gradients);
  // The kernels' thread count is the caller's (a new thread would take OpenMP's default).
  const int threads = at::get_num_threads();
  in_flight_ = true;
  worker_ = std::thread([this, lr, betas, step, grad_scale, threads] {
    try {
      at::NoGradGuard no_grad;
      run_step(lr, betas, step, grad_scale, PassTarget{nullptr, true}, threads);
    } catch (...) {
      worker_error_ = std::current_exception();
    }
  });
}

void OptimizerPartition::finish_step() {
  if (!in_flight_) return;
  const auto start = std::chrono::steady_clock::now();
  worker_.join();
  in_flight_ = false;
  {
    std::lock_guard<std::mutex> lock(counters_mutex_);
    io_counters_.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  if (worker_error_) std::rethrow_exception(std::exchange(worker_error_, nullptr));
  install_next_working();
}

// The next working copy becomes the working one: sharded, the two arrays trade places (the old
// values are overwritten by the next step before they are read again); otherwise the owned region
// of the flat buffer is copied from it.
void OptimizerPartition::install_next_working() {
  if (install_by_swap_) {
    std::swap(*working_.partition, next_working_);
    return;
  }
  // Staged: asynchronous on a device, ordered before the compute stream's next use of the
  // parameters; the host copy stays untouched until the next snapshot_gradients() waits.
  for (const Run& r : runs_)
    copies_->to_device(working_.partition ? working_.partition->view(r.partition_offset, r.numel)
                                          : working_.flat.narrow(0, r.flat_offset, r.numel),
                       next_working_.view(r.partition_offset, r.numel));
}

}  // namespace zt
