// Single-pass Adam/AdamW over flat fp32 partitions (internal; issue 3 widens this into the full
// kernel family with explicit SIMD paths). One pass reads p, g, m, v and writes p, m, v: 28 bytes
// per parameter, the memory-bandwidth bound of design §10. torch::optim::AdamW makes several
// passes (one per elementwise op) and is several times slower on this hardware.
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

// Applies one step to n elements. `step` is the 1-based count of this update (for bias
// correction). `grad_scale` multiplies every gradient first (unscaling and clipping in one
// multiply, design §4). Splits the range across the OpenMP threads of the caller.
void adam_step(float* params, const float* grads, float* exp_avg, float* exp_avg_sq, int64_t n,
               const AdamHyperparameters& hp, int64_t step, float grad_scale);

#ifdef ZT_CUDA
// The same update on device pointers, enqueued on `stream` (a cudaStream_t; nullptr: default).
void adam_step_cuda(float* params, const float* grads, float* exp_avg, float* exp_avg_sq, int64_t n,
                    const AdamHyperparameters& hp, int64_t step, float grad_scale, void* stream);
#endif

}  // namespace zt::optim
