// Where each role of the engine lives, decided once (docs/gpu.md "What lives where"), and the
// copies between the compute device and host memory. Internal to the engine.
//
// Contract
// - plan_devices() is the one place a device is chosen. The compute device is the model's (all
//   trainable parameters on one device): the working parameters, the gradients, the bucket
//   buffers and the stage-3 gather buffers live there. The optimizer state (masters, moments) and
//   the optimizer step live on the compute device, or in host memory when
//   offload_optimizer.device is "cpu" or "nvme" and the compute device is not the CPU; the step
//   then reads host copies of the owned gradients and writes host copies of the owned working
//   values (`stage_through_host`), moved by DeviceCopies.
// - With stage-3 parameter offload (offload_param "cpu" or "nvme", ZeRO-Infinity) the working
//   partition itself lives in host memory or NVMe (`parameters_on_host`): the gathers copy each
//   block's shards to the compute device first (zero/parameter_tier.h), and the step writes the
//   host partition directly. It needs the optimizer state on the host too (offload_optimizer).
// - On the CPU the same staging can be forced (ZT_HOST_STAGING=1 with an offload device set), so
//   that every CI run executes the copies the GPU path makes; the result is bitwise the same.
// - DeviceCopies on an accelerator issues its copies on a stream of its own, ordered by events
//   after the work already enqueued on the compute stream (to_host) or before the work enqueued
//   after it (to_device); wait_host() is the one point where the host waits for them. On the
//   CPU every copy is a synchronous memcpy and wait_host() returns at once. Not thread-safe.
//   Tensors handed to it are kept alive until wait_host().
// - For tests on the CPU, DeviceCopies can emulate a copy engine that is as late as the contract
//   allows (ZT_EMULATE_COPY_ENGINE=1 with forced staging): to_host copies happen at wait_host(),
//   and to_device copies happen at once (the compute stream's later work would wait for them)
//   and again at wait_host() (a copy engine may read the host copy until then). A host copy read
//   before wait_host(), or changed before it, then changes the results, deterministically, where
//   on a GPU it would only sometimes.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace zt {

struct ZeroConfig;

struct DevicePlan {
  c10::Device compute{c10::kCPU};  // working parameters, gradients, buckets, gather buffers
  c10::Device state{c10::kCPU};    // masters, moments, the optimizer step
  bool stage_through_host = false;  // the step works on host copies of the owned gradients and working values
  bool pin_host = false;            // those host copies are page-locked (offload_optimizer.pin_memory)
  bool emulate_copy_engine = false;  // CPU staging only: copies as late as allowed (tests; ZT_EMULATE_COPY_ENGINE=1)
  // The stage-3 working partition is in host memory (or NVMe), crossing to `compute` at each gather.
  bool parameters_on_host = false;
  bool pin_parameters = false;  // that host partition is page-locked (offload_param.pin_memory)
  // The optimizer step runs device kernels (state on an accelerator).
  bool device_step() const { return !state.is_cpu(); }
  std::string describe() const;
};

// `model_device`: the device of the model's trainable parameters. `force_host_staging`: stage
// through host copies on the CPU too (tests; ZT_HOST_STAGING=1). Throws ConfigError for a
// combination that is not implemented on the device.
DevicePlan plan_devices(c10::Device model_device, const ZeroConfig& zero, bool force_host_staging);
// ZT_HOST_STAGING: "1" forces the staging path on the CPU, "0" or unset leaves it to the plan;
// any other value is a ConfigError.
bool host_staging_forced_by_environment();

// ZT_EMULATE_COPY_ENGINE: "1" emulates a late copy engine where staging is forced on the CPU,
// "0" or unset does not; any other value is a ConfigError.
bool copy_engine_emulated_by_environment();

// Host tensors for the staging copies: page-locked when `pinned` (an accelerator is present). A
// runtime that refuses to page-lock gets pageable memory and one note on stderr.
at::Tensor empty_host(int64_t numel, at::ScalarType dtype, bool pinned);

// The one note (per process) that page-locking was refused and pageable memory is used instead.
void note_pinning_refused(const std::string& what, const std::string& reason);

// Page-locks host memory allocated elsewhere (cudaHostRegister) while it lives, so that copies
// from it to a GPU run asynchronously; a no-op without CUDA or for an empty range, and (with the
// note above) where the runtime refuses. Move-only.
class HostRegistration {
 public:
  HostRegistration() = default;
  HostRegistration(void* data, int64_t bytes);
  HostRegistration(HostRegistration&& other) noexcept : data_(std::exchange(other.data_, nullptr)) {}
  HostRegistration& operator=(HostRegistration&& other) noexcept;
  HostRegistration(const HostRegistration&) = delete;
  HostRegistration& operator=(const HostRegistration&) = delete;
  ~HostRegistration();

 private:
  void* data_ = nullptr;
};

// Tests on a GPU: each copy issued on a copy stream (DeviceCopies', the parameter tier's) is
// preceded there by a kernel that spins `cycles` GPU clock cycles, so that work that should wait
// for the copy and does not reads the old bytes every time rather than now and then. 0, the
// default, everywhere else; a no-op without CUDA.
void set_copy_stream_delay_for_testing(int64_t cycles);
// Called with the copy stream current, right before a copy is enqueued on it.
void delay_copy_stream_for_testing();

class DeviceCopies {
 public:
  // `emulate`: on the CPU, copies as late as the contract allows (see above).
  explicit DeviceCopies(c10::Device compute, bool emulate = false);
  bool asynchronous() const { return copy_stream_.has_value() || emulated_; }
  // host <- device, after what the compute stream has enqueued so far.
  void to_host(const at::Tensor& host, const at::Tensor& device);
  // device <- host; the compute stream's later work waits for it. The host tensor must not
  // change before wait_host().
  void to_device(const at::Tensor& device, const at::Tensor& host);
  // Blocks the host until every copy issued has completed.
  void wait_host();

 private:
  void record_done();
  c10::Device compute_;
  std::optional<c10::Stream> copy_stream_;
  std::optional<c10::Event> done_;
  std::vector<at::Tensor> in_flight_;
  // The emulated copy engine's copies not yet made (destination, source).
  struct PendingCopy {
    at::Tensor destination, source;
  };
  bool emulated_ = false;
  std::vector<PendingCopy> pending_;
};

}  // namespace zt
