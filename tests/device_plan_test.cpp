// Where the engine puts each role (zero/device_plan.h): the decisions for the CPU and for a CUDA
// device (made without touching a GPU), the refusals, ZT_HOST_STAGING, and the CPU's synchronous
// DeviceCopies.
#include <gtest/gtest.h>

#include <cstdlib>

#include "zero/device_plan.h"
#include "zerotrain/config/config.h"
#include "zerotrain/error.h"

namespace {

zt::ZeroConfig zero_with(zt::OffloadDevice optimizer, zt::OffloadDevice param = zt::OffloadDevice::None) {
  zt::ZeroConfig zero;
  zero.stage = 3;
  zero.offload_optimizer.device = optimizer;
  zero.offload_param.device = param;
  return zero;
}

const c10::Device kCuda(c10::kCUDA, 0);

TEST(DevicePlan, OnTheCpuEverythingStaysOnTheHostAndStagingIsOnlyForced) {
  const auto plain = zt::plan_devices(c10::kCPU, zero_with(zt::OffloadDevice::Cpu), false);
  EXPECT_TRUE(plain.compute.is_cpu());
  EXPECT_TRUE(plain.state.is_cpu());
  EXPECT_FALSE(plain.stage_through_host);
  EXPECT_FALSE(plain.device_step());
  EXPECT_TRUE(zt::plan_devices(c10::kCPU, zero_with(zt::OffloadDevice::Cpu), true).stage_through_host);
  EXPECT_TRUE(zt::plan_devices(c10::kCPU, zero_with(zt::OffloadDevice::Nvme), true).stage_through_host);
  // Nothing offloaded: nothing to stage.
  EXPECT_FALSE(zt::plan_devices(c10::kCPU, zero_with(zt::OffloadDevice::None), true).stage_through_host);
  // Parameter offload staged: the partition stays on the host and crosses at each gather.
  auto sharded = zero_with(zt::OffloadDevice::Nvme, zt::OffloadDevice::Nvme);
  sharded.shard_parameters = true;
  const auto crossing = zt::plan_devices(c10::kCPU, sharded, true);
  EXPECT_TRUE(crossing.stage_through_host);
  EXPECT_TRUE(crossing.parameters_on_host);
  EXPECT_FALSE(zt::plan_devices(c10::kCPU, sharded, false).parameters_on_host);
  // Tiers the device path refuses are not mirrored.
  auto gradients = zero_with(zt::OffloadDevice::Nvme);
  gradients.offload_optimizer.nvme_gradients = true;
  EXPECT_FALSE(zt::plan_devices(c10::kCPU, gradients, true).stage_through_host);
}

TEST(DevicePlan, OnCudaTheStateFollowsOffload) {
  const auto resident = zt::plan_devices(kCuda, zero_with(zt::OffloadDevice::None), false);
  EXPECT_EQ(resident.compute, kCuda);
  EXPECT_EQ(resident.state, kCuda);
  EXPECT_TRUE(resident.device_step());
  EXPECT_FALSE(resident.stage_through_host);

  auto offload = zero_with(zt::OffloadDevice::Cpu);
  offload.offload_optimizer.pin_memory = true;
  const auto host = zt::plan_devices(kCuda, offload, false);
  EXPECT_EQ(host.compute, kCuda);
  EXPECT_TRUE(host.state.is_cpu());
  EXPECT_TRUE(host.stage_through_host);
  EXPECT_TRUE(host.pin_host);
  EXPECT_FALSE(host.device_step());
  EXPECT_EQ(host.describe(), "compute on cuda:0, optimizer state on cpu (staged through pinned host memory)");
  offload.offload_optimizer.pin_memory = false;
  EXPECT_FALSE(zt::plan_devices(kCuda, offload, false).pin_host);

  const auto nvme = zt::plan_devices(kCuda, zero_with(zt::OffloadDevice::Nvme), false);
  EXPECT_TRUE(nvme.state.is_cpu());
  EXPECT_TRUE(nvme.stage_through_host);
}

TEST(DevicePlan, OnCudaParameterOffloadKeepsThePartitionOnTheHost) {
  for (auto param : {zt::OffloadDevice::Cpu, zt::OffloadDevice::Nvme}) {
    auto zero = zero_with(zt::OffloadDevice::Cpu, param);
    zero.shard_parameters = true;
    zero.offload_param.pin_memory = true;
    zero.offload_optimizer.pin_memory = false;  // each block pinned on its own
    const auto plan = zt::plan_devices(kCuda, zero, false);
    EXPECT_EQ(plan.compute, kCuda);
    EXPECT_TRUE(plan.state.is_cpu());
    EXPECT_TRUE(plan.stage_through_host);
    EXPECT_TRUE(plan.parameters_on_host);
    EXPECT_TRUE(plan.pin_parameters);
    EXPECT_FALSE(plan.pin_host);
    EXPECT_EQ(plan.describe(),
              "compute on cuda:0, optimizer state on cpu (staged through host memory), parameter shards in pinned "
              "host memory");
  }
  // Below stage 3 the configuration has noted and dropped offload_param already; a plan made
  // anyway keeps the parameters on the device.
  auto replicated = zero_with(zt::OffloadDevice::Cpu, zt::OffloadDevice::Cpu);
  replicated.shard_parameters = false;
  EXPECT_FALSE(zt::plan_devices(kCuda, replicated, false).parameters_on_host);
}

TEST(DevicePlan, WhatTheDevicePathLacksIsRefusedByName) {
  auto alone = zero_with(zt::OffloadDevice::None, zt::OffloadDevice::Cpu);
  alone.shard_parameters = true;
  try {
    zt::plan_devices(kCuda, alone, false);
    FAIL() << "offload_param without optimizer offload on a device was accepted";
  } catch (const zt::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("zero_optimization.offload_param.device"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("offload_optimizer.device"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("cuda:0"), std::string::npos) << e.what();
  }
  auto gradients = zero_with(zt::OffloadDevice::Nvme);
  gradients.offload_optimizer.nvme_gradients = true;
  EXPECT_THROW(zt::plan_devices(kCuda, gradients, false), zt::ConfigError);
  EXPECT_THROW(zt::plan_devices(c10::Device(c10::kMeta), zero_with(zt::OffloadDevice::None), false), zt::ConfigError);
}

TEST(DevicePlan, HostStagingEnvironmentIsCheckedStrictly) {
  ::unsetenv("ZT_HOST_STAGING");
  EXPECT_FALSE(zt::host_staging_forced_by_environment());
  ::setenv("ZT_HOST_STAGING", "1", 1);
  EXPECT_TRUE(zt::host_staging_forced_by_environment());
  ::setenv("ZT_HOST_STAGING", "0", 1);
  EXPECT_FALSE(zt::host_staging_forced_by_environment());
  ::setenv("ZT_HOST_STAGING", "yes", 1);
  try {
    zt::host_staging_forced_by_environment();
    FAIL() << "ZT_HOST_STAGING=yes was accepted";
  } catch (const zt::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("'yes'"), std::string::npos) << e.what();
  }
  ::unsetenv("ZT_HOST_STAGING");
}

TEST(DeviceCopies, OnTheCpuCopiesAreSynchronous) {
  zt::DeviceCopies copies(c10::kCPU);
  EXPECT_FALSE(copies.asynchronous());
  const at::Tensor source = torch::arange(10, torch::kFloat32);
  at::Tensor host = zt::empty_host(10, at::kFloat, /*pinned=*/false);
  copies.to_host(host, source);
  EXPECT_TRUE(torch::equal(host, source));  // before any wait: the CPU copy is done
  at::Tensor back = torch::zeros({10}, torch::kFloat32);
  copies.to_device(back, host * 2);
  copies.wait_host();
  EXPECT_TRUE(torch::equal(back, source * 2));
}

// The emulated copy engine: a result read before wait_host() is stale, and a host copy changed
// after to_device() and before wait_host() reaches the destination, as they may on a GPU.
TEST(DeviceCopies, TheEmulatedCopyEngineShowsAMissingWait) {
  zt::DeviceCopies copies(c10::kCPU, /*emulate=*/true);
  EXPECT_TRUE(copies.asynchronous());
  const at::Tensor source = torch::arange(1, 11, torch::kFloat32);
  at::Tensor host = torch::zeros({10}, torch::kFloat32);
  copies.to_host(host, source);
  EXPECT_TRUE(torch::equal(host, torch::zeros({10}))) << "the copy was made before wait_host()";
  copies.wait_host();
  EXPECT_TRUE(torch::equal(host, source));

  at::Tensor device = torch::zeros({10}, torch::kFloat32);
  copies.to_device(device, host);
  EXPECT_TRUE(torch::equal(device, source)) << "later work on the device must see the copy";
  host.fill_(-1);  // breaks to_device's contract: the host copy must stay until wait_host()
  copies.wait_host();
  EXPECT_TRUE(torch::equal(device, torch::full({10}, -1.0f)));
}

TEST(DeviceCopies, CopyEngineEnvironmentIsCheckedStrictly) {
  ::unsetenv("ZT_EMULATE_COPY_ENGINE");
  EXPECT_FALSE(zt::copy_engine_emulated_by_environment());
  ::setenv("ZT_EMULATE_COPY_ENGINE", "1", 1);
  EXPECT_TRUE(zt::copy_engine_emulated_by_environment());
  ::setenv("ZT_EMULATE_COPY_ENGINE", "0", 1);
  EXPECT_FALSE(zt::copy_engine_emulated_by_environment());
  ::setenv("ZT_EMULATE_COPY_ENGINE", "on", 1);
  EXPECT_THROW(zt::copy_engine_emulated_by_environment(), zt::ConfigError);
  ::unsetenv("ZT_EMULATE_COPY_ENGINE");
}

}  // namespace
