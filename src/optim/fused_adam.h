// Adam hyperparameters and the original single-pass entry point, kept for the CUDA twin
// (fused_adam_cuda.cu) and simple callers. The CPU kernel family is in optim/cpu_kernels.h.
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

// One step over n elements with default options (selected ISA, caller's OpenMP threads), i.e.
// adam_step(..., StepOptions{grad_scale}) from optim/cpu_kernels.h. `step` is 1-based.
// Update: g' = g·grad_scale (+ wd·p if L2); m = b1 m + (1-b1) g'; v = b2 v + (1-b2) g'²;
//         p = p·(1 - lr·wd if decoupled) - lr/(1-b1^t) · m / (sqrt(v)/sqrt(1-b2^t) + eps).
void adam_step(float* params, const float* grads, float* exp_avg, float* exp_avg_sq, int64_t n,
               const AdamHyperparameters& hp, int64_t step, float grad_scale);

#ifdef ZT_CUDA
// The same update on device pointers, enqueued on `stream` (a cudaStream_t; nullptr: default).
void adam_step_cuda(float* params, const float* grads, float* exp_avg, float* exp_avg_sq, int64_t n,
                    const AdamHyperparameters& hp, int64_t step, float grad_scale, void* stream);
#endif

}  // namespace zt::optim
