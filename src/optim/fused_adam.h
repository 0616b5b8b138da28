// Adam hyperparameters shared by the CPU kernel family (optim/cpu_kernels.h) and the CUDA twin
// (fused_adam_cuda.cu).
#pragma once
#include <cstdint>

namespace zt::optim {

struct AdamHyperparameters {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool decoupled_weight_decay = true;  // AdamW; false: L2 added to the gradient (Adam)
  bool bias_correction = true;
};

// The CPU update (optim/cpu_kernels.h, adam_step) and the CUDA one below compute, with `step`
// 1-based: g' = g·grad_scale (+ wd·p if L2); m = b1 m + (1-b1) g'; v = b2 v + (1-b2) g'²;
//          p = p·(1 - lr·wd if decoupled) - lr/(1-b1^t) · m / (sqrt(v)/sqrt(1-b2^t) + eps).

#ifdef ZT_CUDA
// The same update on device pointers, enqueued on `stream` (a cudaStream_t; nullptr: default).
void adam_step_cuda(float* params, const float* grads, float* exp_avg, float* exp_avg_sq, int64_t n,
                    const AdamHyperparameters& hp, int64_t step, float grad_scale, void* stream);
#endif

}  // namespace zt::optim
