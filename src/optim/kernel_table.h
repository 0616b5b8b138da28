// Per-ISA kernel tables (internal to src/optim). Each entry processes one contiguous range on the
// calling thread; cpu_kernels.cpp splits partitions across threads and calls them.
#pragma once
#include <cmath>
#include <cstdint>

#include "optim/cpu_kernels.h"

namespace zt::optim::detail {

struct AdamConsts {
  float grad_scale, l2, beta1, beta2, one_minus_beta1, one_minus_beta2, eps, inv_sqrt_bias2, step_size, decay;
};
struct SgdConsts {
  float grad_scale, weight_decay, buf_keep, buf_grad, nesterov_grad, nesterov_buf, lr;
  bool momentum;
};
struct LambConsts {
  float grad_scale, beta1, beta2, one_minus_beta1, one_minus_beta2, eps, weight_decay;
};

// The per-step constants, computed once in double and rounded to float: shared by the CPU paths
// and the device kernels (device_kernels.cu), so that both step with the very same numbers.
// Same algebra as torch::optim::AdamW: p -= lr/bias1 * m / (sqrt(v)/sqrt(bias2) + eps).
inline AdamConsts adam_consts(const AdamHyperparameters& hp, int64_t step, float grad_scale) {
  const double bias1 = hp.bias_correction ? 1.0 - std::pow(hp.beta1, double(step)) : 1.0;
  const double bias2 = hp.bias_correction ? 1.0 - std::pow(hp.beta2, double(step)) : 1.0;
  return AdamConsts{grad_scale,
                    hp.decoupled_weight_decay ? 0.0f : float(hp.weight_decay),
                    float(hp.beta1),
                    float(hp.beta2),
                    float(1.0 - hp.beta1),
                    float(1.0 - hp.beta2),
                    float(hp.eps),
                    float(1.0 / std::sqrt(bias2)),
                    float(hp.lr / bias1),
                    hp.decoupled_weight_decay ? float(1.0 - hp.lr * hp.weight_decay) : 1.0f};
}

// On step 1 the momentum buffer becomes the gradient (as torch clones it then).
inline SgdConsts sgd_consts(const SgdHyperparameters& hp, int64_t step, float grad_scale) {
  const bool first = step <= 1;
  return SgdConsts{grad_scale,
                   float(hp.weight_decay),
                   first ? 0.0f : float(hp.momentum),
                   first ? 1.0f : float(1.0 - hp.dampening),
                   hp.nesterov ? 1.0f : 0.0f,
                   hp.nesterov ? float(hp.momentum) : 1.0f,
                   float(hp.lr),
                   hp.momentum != 0.0};
}

inline LambConsts lamb_consts(const LambHyperparameters& hp, float grad_scale) {
  return LambConsts{grad_scale,           float(hp.beta1), float(hp.beta2),         float(1.0 - hp.beta1),
                    float(1.0 - hp.beta2), float(hp.eps),   float(hp.weight_decay)};
}

struct KernelTable {
  void (*adam)(float* p, const float* g, float* m, float* v, int64_t n, const AdamConsts& c, HalfType t, uint16_t* h);
  void (*sgd)(float* p, const float* g, float* buf, int64_t n, const SgdConsts& c, HalfType t, uint16_t* h);
  // Adds this range's sums of squares to *w_sq and *u_sq.
  void (*lamb1)(const float* p, const float* g, float* m, float* v, int64_t n, const LambConsts& c, double* w_sq,
                double* u_sq);
  void (*lamb2)(float* p, const float* m, const float* v, int64_t n, const LambConsts& c, float coef, HalfType t,
                uint16_t* h);
};

const KernelTable& scalar_table();
const KernelTable& avx2_table();
const KernelTable& avx512_table();

}  // namespace zt::optim::detail
