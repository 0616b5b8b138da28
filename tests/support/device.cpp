#include "support/device.h"

#include <torch/cuda.h>

#include <cstdlib>
#include <stdexcept>

namespace zt::testing {

TestDevice test_device() {
  const char* value = std::getenv("ZT_TEST_DEVICE");
  const std::string requested = value ? value : "cpu";
  TestDevice d;
  if (requested.empty() || requested == "cpu") return d;
  if (requested != "cuda") throw std::invalid_argument("ZT_TEST_DEVICE: expected cpu or cuda, found '" + requested + "'");
#ifndef ZT_CUDA
  d.skip_reason = "ZT_TEST_DEVICE=cuda, but this build has no CUDA (configure with -DZT_CUDA=ON)";
  return d;
#else
  if (!torch::cuda::is_available() || torch::cuda::device_count() == 0) {
    d.skip_reason = "ZT_TEST_DEVICE=cuda, but no CUDA device is visible";
    return d;
  }
  const char* local = std::getenv("LOCAL_RANK");
  const int index = (local ? std::atoi(local) : 0) % int(torch::cuda::device_count());
  d.device = c10::Device(c10::kCUDA, c10::DeviceIndex(index));
  return d;
#endif
}

}  // namespace zt::testing
