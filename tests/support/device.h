// The device the device-parity tests train on: ZT_TEST_DEVICE ("cpu", the default, or "cuda";
// a rank uses cuda:LOCAL_RANK). When CUDA is asked for but this build has none or no GPU is
// visible, `skip_reason` says so and the tests that need it skip with that message.
#pragma once
#include <c10/core/Device.h>

#include <string>

namespace zt::testing {

struct TestDevice {
  c10::Device device{c10::kCPU};
  std::string skip_reason;  // non-empty: the requested device is not available here
};

TestDevice test_device();

}  // namespace zt::testing
