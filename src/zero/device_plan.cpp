#include "zero/device_plan.h"

#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/torch.h>
#ifdef ZT_CUDA
#include <ATen/cuda/Sleep.h>
#include <cuda_runtime_api.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "zerotrain/config/config.h"
#include "zerotrain/error.h"

namespace zt {

std::string DevicePlan::describe() const {
  std::string text = "compute on " + compute.str() + ", optimizer state on " + state.str();
  if (stage_through_host) text += pin_host ? " (staged through pinned host memory)" : " (staged through host memory)";
  if (parameters_on_host)
    text += pin_parameters ? ", parameter shards in pinned host memory" : ", parameter shards in host memory";
  return text;
}

bool host_staging_forced_by_environment() {
  const char* value = std::getenv("ZT_HOST_STAGING");
  if (value == nullptr || std::strcmp(value, "") == 0 || std::strcmp(value, "0") == 0) return false;
  if (std::strcmp(value, "1") == 0) return true;
  throw ConfigError(std::string("ZT_HOST_STAGING: expected 0 or 1, found '") + value + "'");
}

namespace {
std::atomic<int64_t> copy_stream_delay_cycles{0};
}  // namespace

void set_copy_stream_delay_for_testing(int64_t cycles) { copy_stream_delay_cycles = std::max<int64_t>(0, cycles); }

void delay_copy_stream_for_testing() {
#ifdef ZT_CUDA
  if (const int64_t cycles = copy_stream_delay_cycles.load(); cycles > 0) at::cuda::sleep(cycles);
#endif
}

void note_pinning_refused(const std::string& what, const std::string& reason) {
  static std::atomic<bool> noted{false};
  if (noted.exchange(true)) return;
  std::fprintf(stderr,
               "zerotrain: note: pinned host memory: %s failed (%s); this run copies between the GPU and pageable "
               "host memory instead, so that each copy to the GPU blocks the host until it is done (pin_memory: "
               "false chooses this without the note)\n",
               what.c_str(), reason.c_str());
}

DevicePlan plan_devices(c10::Device model_device, const ZeroConfig& zero, bool force_host_staging) {
  DevicePlan plan;
  plan.compute = model_device;
  const bool offload = zero.offload_optimizer.device != OffloadDevice::None;
  const bool offload_parameters = zero.offload_param.device != OffloadDevice::None && zero.shard_parameters;
  if (model_device.is_cpu()) {
    // Host memory is the state's memory already; staging only copies (tests force it). Where the
    // device path refuses a tier (gradients on NVMe), there is nothing to mirror.
    plan.stage_through_host = offload && force_host_staging && !zero.offload_optimizer.nvme_gradients;
    plan.parameters_on_host = plan.stage_through_host && offload_parameters;
    return plan;
  }
  if (!model_device.is_cuda())
    throw ConfigError("engine: expected parameters on the CPU or a CUDA device, found " + model_device.str());
  if (offload_parameters && !offload)
    throw ConfigError(std::string("zero_optimization.offload_param.device: \"") + to_string(zero.offload_param.device) +
                      "\" with parameters on " + model_device.str() +
                      " needs the optimizer state on the host too; expected offload_optimizer.device \"cpu\" or "
                      "\"nvme\", found \"none\"");
  if (zero.offload_optimizer.nvme_gradients)
    throw ConfigError("zero_optimization.offload_optimizer.nvme_gradients: true is not implemented for parameters on " +
                      model_device.str() + "; expected false");
  if (offload) {
    plan.state = c10::Device(c10::kCPU);
    plan.stage_through_host = true;
    plan.pin_host = zero.offload_optimizer.pin_memory;
  } else {
    plan.state = model_device;
  }
  plan.parameters_on_host = offload_parameters;
  plan.pin_parameters = offload_parameters && zero.offload_param.pin_memory;
  return plan;
}

bool copy_engine_emulated_by_environment() {
  const char* value = std::getenv("ZT_EMULATE_COPY_ENGINE");
  if (value == nullptr || std::strcmp(value, "") == 0 || std::strcmp(value, "0") == 0) return false;
  if (std::strcmp(value, "1") == 0) return true;
  throw ConfigError(std::string("ZT_EMULATE_COPY_ENGINE: expected 0 or 1, found '") + value + "'");
}

at::Tensor empty_host(int64_t numel, at::ScalarType dtype, bool pinned) {
  const auto options = torch::TensorOptions().dtype(dtype);
  if (!pinned || numel == 0) return torch::empty({numel}, options);
#ifdef ZT_CUDA
  // LibTorch's pinned allocator rounds every block up to a power of two (a 26 GB copy takes 32 GB
  // of page-locked memory), so these long-lived copies are page-locked at their exact size.
  const size_t bytes = size_t(numel) * c10::elementSize(dtype);
  void* memory = nullptr;
  const cudaError_t status = cudaHostAlloc(&memory, bytes, cudaHostAllocDefault);
  if (status != cudaSuccess) {
    cudaGetLastError();  // clear the sticky error so that later CUDA calls do not report it
    // Some runtimes (restricted containers, a low locked-memory limit) refuse to pin: pageable memory
    // still trains, only its copies to the GPU block the host.
    note_pinning_refused("cudaHostAlloc of " + std::to_string(bytes) + " bytes", cudaGetErrorString(status));
    return torch::empty({numel}, options);
  }
  return torch::from_blob(memory, {numel}, [](void* p) { cudaFreeHost(p); }, options);
#else
  return torch::empty({numel}, options.pinned_memory(true));
#endif
}

HostRegistration::HostRegistration(void* data, int64_t bytes) {
#ifdef ZT_CUDA
  if (data == nullptr || bytes <= 0) return;
  const cudaError_t status = cudaHostRegister(data, size_t(bytes), cudaHostRegisterDefault);
  if (status != cudaSuccess) {
    cudaGetLastError();
    note_pinning_refused("cudaHostRegister of " + std::to_string(bytes) + " bytes", cudaGetErrorString(status));
    return;  // left pageable
  }
  data_ = data;
#else
  (void)data;
  (void)bytes;
#endif
}

HostRegistration& HostRegistration::operator=(HostRegistration&& other) noexcept {
  if (this != &other) {
    HostRegistration gone(std::move(*this));
    data_ = std::exchange(other.data_, nullptr);
  }
  return *this;
}

HostRegistration::~HostRegistration() {
#ifdef ZT_CUDA
  if (data_ != nullptr) cudaHostUnregister(data_);
#endif
}

DeviceCopies::DeviceCopies(c10::Device compute, bool emulate) : compute_(compute), emulated_(emulate && compute.is_cpu()) {
  if (compute.is_cpu()) return;
  c10::impl::VirtualGuardImpl impl(compute.type());
  copy_stream_ = impl.getStreamFromGlobalPool(compute, /*isHighPriority=*/false);
}

void DeviceCopies::to_host(const at::Tensor& host, const at::Tensor& device) {
  if (emulated_) {
    pending_.push_back({host, device});
    return;
  }
  if (!copy_stream_) {
    host.copy_(device);
    return;
  }
  c10::impl::VirtualGuardImpl impl(compute_.type());
  c10::Event ready(compute_.type());
  ready.record(impl.getStream(compute_));
  ready.block(*copy_stream_);
  {
    c10::StreamGuard guard(*copy_stream_);
    delay_copy_stream_for_testing();
    host.copy_(device, /*non_blocking=*/true);
  }
  in_flight_.push_back(host);
  in_flight_.push_back(device);
  record_done();
}

void DeviceCopies::to_device(const at::Tensor& device, const at::Tensor& host) {
  if (emulated_) {
    device.copy_(host);              // the compute stream's later work waits for the copy
    pending_.push_back({device, host});  // and a copy engine may read `host` as late as wait_host()
    return;
  }
  if (!copy_stream_) {
    device.copy_(host);
    return;
  }
  c10::impl::VirtualGuardImpl impl(compute_.type());
  const c10::Stream compute_stream = impl.getStream(compute_);
  // The destination may still be read by work already enqueued (a forward on the old values).
  c10::Event ready(compute_.type());
  ready.record(compute_stream);
  ready.block(*copy_stream_);
  {
    c10::StreamGuard guard(*copy_stream_);
    delay_copy_stream_for_testing();
    device.copy_(host, /*non_blocking=*/true);
  }
  c10::Event copied(compute_.type());
  copied.record(*copy_stream_);
  copied.block(compute_stream);
  in_flight_.push_back(host);
  in_flight_.push_back(device);
  record_done();
}

void DeviceCopies::record_done() {
  if (!done_) done_.emplace(compute_.type());
  done_->record(*copy_stream_);
}

void DeviceCopies::wait_host() {
  for (const PendingCopy& c : pending_) c.destination.copy_(c.source);
  pending_.clear();
  if (done_) done_->synchronize();
  in_flight_.clear();
}

}  // namespace zt
