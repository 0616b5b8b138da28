#include "optim/fused_adam.h"

#include <cmath>

namespace zt::optim {

void adam_step(float* params, const float* grads, float* exp_avg, float* exp_avg_sq, int64_t n,
               const AdamHyperparameters& hp, int64_t step, float grad_scale) {
  const double bias1 = hp.bias_correction ? 1.0 - std::pow(hp.beta1, double(step)) : 1.0;
  const double bias2 = hp.bias_correction ? 1.0 - std::pow(hp.beta2, double(step)) : 1.0;
  // Same algebra as torch::optim::AdamW: p -= lr/bias1 * m / (sqrt(v)/sqrt(bias2) + eps).
  const float step_size = float(hp.lr / bias1);
  const float inv_sqrt_bias2 = float(1.0 / std::sqrt(bias2));
  const float beta1 = float(hp.beta1), beta2 = float(hp.beta2);
  const float one_minus_beta1 = float(1.0 - hp.beta1), one_minus_beta2 = float(1.0 - hp.beta2);
  const float eps = float(hp.eps);
  const float decay = hp.decoupled_weight_decay ? float(1.0 - hp.lr * hp.weight_decay) : 1.0f;
  const float l2 = hp.decoupled_weight_decay ? 0.0f : float(hp.weight_decay);
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    float p = params[i];
    const float g = grads[i] * grad_scale + l2 * p;
    const float m = beta1 * exp_avg[i] + one_minus_beta1 * g;
    const float v = beta2 * exp_avg_sq[i] + one_minus_beta2 * g * g;
    p *= decay;
    p -= step_size * m / (std::sqrt(v) * inv_sqrt_bias2 + eps);
    params[i] = p;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
  }
}

}  // namespace zt::optim
