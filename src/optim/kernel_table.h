// Per-ISA kernel tables (internal to src/optim). Each entry processes one contiguous range on the
// calling thread; cpu_kernels.cpp splits partitions across threads and calls them.
#pragma once
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
