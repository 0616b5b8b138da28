// Device (CUDA) twins of the fused optimizer kernels of cpu_kernels.h, and the sum of squares the
// global gradient norm is built from. Plain pointers and no torch or CUDA headers here, so that
// every translation unit can include this whether or not the build has CUDA.
//
// Contract
// - Same formula, same order of operations as the CPU kernels (kernels_impl.h): every fma of the
//   vector paths is an fma here and nothing else is contracted, so a device step should equal the
//   CPU AVX2/AVX-512 step bit for bit on the same inputs (the tests hold it to 1e-6 relative).
//   A partition can thus move between host and device, or be checked on one against the other,
//   without its trajectory changing.
// - Every pointer except `bounds` is a device pointer of one CUDA device, which must be the
//   current device of the calling thread; `stream` (a cudaStream_t as void*; nullptr: the legacy
//   default stream) should be the caller's current CUDA stream, since the kernels are ordered
//   only on it.
// - Asynchronous: the functions enqueue work and return; results are visible to later work on
//   `stream`. No host synchronisation, except that LAMB's piece table is copied with
//   cudaMemcpyAsync from pageable host memory, which CUDA stages before returning: `bounds` may
//   be freed as soon as the call returns. Scratch memory (piece table, per-block partial sums)
//   comes from the stream-ordered allocator (cudaMallocAsync) and is released on the stream.
// - Gradients may be fp32, bf16 or fp16 (DeviceGradType); they are widened exactly to fp32 and
//   multiplied by grad_scale first, as the CPU kernels do with their fp32 gradients.
// - Reductions are deterministic: each block sums a fixed range in a fixed tree, and the block
//   sums are added in block order by one more kernel. Sums of squares accumulate in double, so
//   they are at least as accurate as the CPU kernels' fp32 chains (see docs/optim.md).
// - A failed launch or CUDA call throws zt::Error naming the function and CUDA's error string;
//   inconsistent arguments throw std::invalid_argument, as the CPU kernels do. In a build without
//   ZT_CUDA every function throws zt::Error ("built without CUDA") and device_kernels_built() is
//   false.
#pragma once
#include <cstdint>

#include "optim/cpu_kernels.h"  // HalfType and the hyperparameter structs

namespace zt::optim {

enum class DeviceGradType { F32, BF16, F16 };  // dtype of the gradients the kernels read

struct DeviceStepOptions {
  float grad_scale = 1.0f;  // multiplies every gradient first (unscale + clip in one multiply)
  DeviceGradType grad_type = DeviceGradType::F32;
  HalfType half = HalfType::None;
  uint16_t* half_out = nullptr;  // n elements when half != None: updated p rounded (RNE, NaN stays NaN)
  void* stream = nullptr;        // cudaStream_t
};

bool device_kernels_built();  // true when compiled with ZT_CUDA

void adam_step_device(float* params, const void* grads, float* exp_avg, float* exp_avg_sq, int64_t n,
                      const AdamHyperparameters& hp, int64_t step, const DeviceStepOptions& options);

// momentum_buffer may be nullptr when hp.momentum == 0.
void sgd_step_device(float* params, const void* grads, float* momentum_buffer, int64_t n, const SgdHyperparameters& hp,
                     int64_t step, const DeviceStepOptions& options);

// LAMB phase 1 over [0, n) cut into `segments` pieces at the HOST array `bounds` (as
// lamb_partial_norms): updates m and v and writes each piece's sums of squares of p and of u into
// the device arrays w_sq[s], u_sq[s]. One launch covers all pieces however many there are (a
// launch per tensor would cost more than the arithmetic for small tensors); an empty piece gets 0.
void lamb_partial_norms_device(const float* params, const void* grads, float* exp_avg, float* exp_avg_sq, int64_t n,
                               const int64_t* bounds, int segments, const LambHyperparameters& hp,
                               const DeviceStepOptions& options, double* w_sq, double* u_sq);

// LAMB phase 2: w_sq_total / u_sq_total are DEVICE arrays (one per piece, the per-tensor totals
// after the caller's all-reduce), so the trust ratio is derived on the device with exactly
// lamb_trust_ratio's rule and the host never waits for the norms. options.grad_type is unused.
void lamb_apply_device(float* params, const float* exp_avg, const float* exp_avg_sq, int64_t n, const int64_t* bounds,
                       int segments, const double* w_sq_total, const double* u_sq_total, const LambHyperparameters& hp,
                       int64_t step, const DeviceStepOptions& options);

// Sum of squares of x[0, n), accumulated in double, ADDED to *out (a device double), so that the
// squares of several buffers (or of the buckets of one) collect into one global norm without a
// host round trip.
void square_sum_device(const void* x, DeviceGradType type, int64_t n, double* out, void* stream);

}  // namespace zt::optim
