// CUDA counterpart of the CPU Adam kernel (built only with -DZT_CUDA=ON): the same single-pass
// Adam/AdamW update over flat fp32 partitions on the device. Kept formula-identical to the CPU
// kernel (src/optim/kernels_impl.h), whose reference tests are tests/optim_kernels_test.cpp.
#include <cuda_runtime.h>

#include <cmath>
#include <stdexcept>
#include <string>

#include "optim/fused_adam.h"

namespace zt::optim {
namespace {

struct DeviceAdamScalars {
  float step_size, inv_sqrt_bias2, beta1, beta2, one_minus_beta1, one_minus_beta2, eps, decay, l2, grad_scale;
};

__global__ void adam_kernel(float* __restrict__ params, const float* __restrict__ grads, float* __restrict__ exp_avg,
                            float* __restrict__ exp_avg_sq, int64_t n, DeviceAdamScalars s) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    float p = params[i];
    const float g = grads[i] * s.grad_scale + s.l2 * p;
    const float m = s.beta1 * exp_avg[i] + s.one_minus_beta1 * g;
    const float v = s.beta2 * exp_avg_sq[i] + s.one_minus_beta2 * g * g;
    p *= s.decay;
    p -= s.step_size * m / (sqrtf(v) * s.inv_sqrt_bias2 + s.eps);
    params[i] = p;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
  }
}

}  // namespace

void adam_step_cuda(float* params, const float* grads, float* exp_avg, float* exp_avg_sq, int64_t n,
                    const AdamHyperparameters& hp, int64_t step, float grad_scale, void* stream) {
  if (n == 0) return;
  const double bias1 = hp.bias_correction ? 1.0 - std::pow(hp.beta1, double(step)) : 1.0;
  const double bias2 = hp.bias_correction ? 1.0 - std::pow(hp.beta2, double(step)) : 1.0;
  DeviceAdamScalars s{float(hp.lr / bias1),
                      float(1.0 / std::sqrt(bias2)),
                      float(hp.beta1),
                      float(hp.beta2),
                      float(1.0 - hp.beta1),
                      float(1.0 - hp.beta2),
                      float(hp.eps),
                      hp.decoupled_weight_decay ? float(1.0 - hp.lr * hp.weight_decay) : 1.0f,
                      hp.decoupled_weight_decay ? 0.0f : float(hp.weight_decay),
                      grad_scale};
  const int threads = 256;
  const int blocks = int(std::min<int64_t>((n + threads - 1) / threads, 65535));
  adam_kernel<<<blocks, threads, 0, static_cast<cudaStream_t>(stream)>>>(params, grads, exp_avg, exp_avg_sq, n, s);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) throw std::runtime_error(std::string("adam_step_cuda: kernel launch failed: ") + cudaGetErrorString(err));
}

}  // namespace zt::optim
