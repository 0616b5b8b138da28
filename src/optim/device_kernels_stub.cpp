// The device kernels of a build without CUDA (optim/device_kernels.h): every entry point exists,
// so that callers and tests link in both builds and can choose at run time, and each says why it
// cannot run. With ZT_CUDA the definitions are in device_kernels.cu and this file is empty.
#ifndef ZT_CUDA
#include <string>

#include "optim/device_kernels.h"
#include "zerotrain/error.h"

namespace zt::optim {
namespace {
[[noreturn]] void no_cuda(const char* fn) {
  throw zt::Error(std::string(fn) + ": zerotrain was built without CUDA (configure with -DZT_CUDA=ON)");
}
}  // namespace

bool device_kernels_built() { return false; }

void adam_step_device(float*, const void*, float*, float*, int64_t, const AdamHyperparameters&, int64_t,
                      const DeviceStepOptions&) {
  no_cuda("adam_step_device");
}

void sgd_step_device(float*, const void*, float*, int64_t, const SgdHyperparameters&, int64_t,
                     const DeviceStepOptions&) {
  no_cuda("sgd_step_device");
}

void lamb_partial_norms_device(const float*, const void*, float*, float*, int64_t, const int64_t*, int,
                               const LambHyperparameters&, const DeviceStepOptions&, double*, double*) {
  no_cuda("lamb_partial_norms_device");
}

void lamb_apply_device(float*, const float*, const float*, int64_t, const int64_t*, int, const double*, const double*,
                       const LambHyperparameters&, int64_t, const DeviceStepOptions&) {
  no_cuda("lamb_apply_device");
}

void square_sum_device(const void*, DeviceGradType, int64_t, double*, void*) { no_cuda("square_sum_device"); }

}  // namespace zt::optim
#endif
