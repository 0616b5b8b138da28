// Adam hyperparameters shared by the CPU kernel family (optim/cpu_kernels.h) and its device twin
// (optim/device_kernels.h).
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

// The CPU update (optim/cpu_kernels.h, adam_step) and the device one (optim/device_kernels.h,
// adam_step_device) compute, with `step` 1-based: g' = g·grad_scale (+ wd·p if L2);
// m = b1 m + (1-b1) g'; v = b2 v + (1-b2) g'²;
// p = p·(1 - lr·wd if decoupled) - lr/(1-b1^t) · m / (sqrt(v)/sqrt(1-b2^t) + eps).

}  // namespace zt::optim
