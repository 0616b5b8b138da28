// Fused optimizer kernels over flat fp32 partitions (docs/optim.md). Plain pointers, no torch.
//
// Contract
// - Every kernel makes one pass over memory per step: Adam/AdamW reads p, g, m, v and writes
//   p, m, v (28 bytes per parameter); SGD with momentum reads p, g, buf and writes p, buf.
//   LAMB needs the norm of each whole parameter tensor before it can update any element, so it
//   has two phases (see lamb_partial_norms / lamb_apply).
// - Optionally, in the same pass, the updated parameter is also written as bf16 or fp16 (round to
//   nearest even, NaN stays NaN) into `StepOptions::half_out` (n elements, same indexing as p).
// - The kernels keep no state: moments, momentum buffers and the 1-based step count are owned
//   by the caller (and saved by checkpoints). The same inputs give the same outputs for a given
//   ISA path and thread count.
// - ISA: AVX-512, AVX2 (+FMA, F16C) or scalar, chosen at run time from the CPU; the environment
//   variable ZT_OPTIM_ISA=scalar|avx2|avx512 forces a path (std::runtime_error if the CPU lacks
//   it or the value is unknown). StepOptions::isa overrides both (tests use it).
// - Threads: partitions of at least 64 Ki elements are split across `StepOptions::threads` OpenMP
//   threads (0: the caller's omp_get_max_threads()). Thread-safe: calls share no mutable state.
#pragma once
#include <cstdint>
#include <optional>

#include "optim/fused_adam.h"  // AdamHyperparameters (shared with the device twins, device_kernels.h)

namespace zt::optim {

enum class Isa { Scalar, Avx2, Avx512 };
enum class HalfType { None, BF16, FP16 };

const char* isa_name(Isa isa);
bool cpu_supports(Isa isa);
Isa best_isa();      // the widest path this CPU supports
Isa selected_isa();  // ZT_OPTIM_ISA if set (checked), else best_isa()

struct StepOptions {
  float grad_scale = 1.0f;     // multiplies every gradient first (unscale + clip in one multiply)
  int threads = 0;             // 0: omp_get_max_threads() of the caller
  std::optional<Isa> isa;      // unset: selected_isa()
  HalfType half = HalfType::None;
  uint16_t* half_out = nullptr;  // n elements when half != None
};

// torch.optim.SGD semantics. The momentum buffer must hold finite values (zero-initialised):
// on step 1 it is overwritten with the gradient, as torch clones it then.
struct SgdHyperparameters {
  double lr = 1e-3;
  double momentum = 0.0;
  double dampening = 0.0;
  double weight_decay = 0.0;  // L2, added to the gradient
  bool nesterov = false;
};

// DeepSpeed FusedLamb semantics (eps outside the sqrt):
//   m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g²;  u = m / (sqrt(v) + eps) + wd p
//   ratio = clamp(‖p‖ / ‖u‖, min_coeff, max_coeff), or 1 when either norm is 0 (per tensor)
//   p -= step_size · ratio · u,  step_size = lr · sqrt(1-b2^t) / (1-b1^t)  (lr without bias correction)
struct LambHyperparameters {
  double lr = 1e-3;
  double beta1 = 0.9, beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool bias_correction = true;
  double min_coeff = 0.01, max_coeff = 10.0;
};

// Adam/AdamW (hp.decoupled_weight_decay chooses), the formula of torch::optim::AdamW / Adam.
void adam_step(float* params, const float* grads, float* exp_avg, float* exp_avg_sq, int64_t n,
               const AdamHyperparameters& hp, int64_t step, const StepOptions& options);

void sgd_step(float* params, const float* grads, float* momentum_buffer, int64_t n, const SgdHyperparameters& hp,
              int64_t step, const StepOptions& options);

// LAMB, phase 1, on a rank's local fragment [0, n) cut into `segments` pieces at `bounds`
// (bounds[0] = 0 < bounds[1] < ... < bounds[segments] = n; each piece is the part of one parameter
// tensor, or padding, that this rank holds). Updates m and v (call it exactly once per step) and
// writes the partial sums of squares of p and of the update u for each piece into w_sq[s], u_sq[s].
// The caller sums these per tensor across ranks (an all-reduce of 2·segments doubles) and passes
// the tensor totals, one per local piece, to lamb_apply.
void lamb_partial_norms(const float* params, const float* grads, float* exp_avg, float* exp_avg_sq, int64_t n,
                        const int64_t* bounds, int segments, const LambHyperparameters& hp, const StepOptions& options,
                        double* w_sq, double* u_sq);
// Phase 2: p -= step_size · ratio(w_sq_total[s], u_sq_total[s]) · u on each piece (m and v read only).
void lamb_apply(float* params, const float* exp_avg, const float* exp_avg_sq, int64_t n, const int64_t* bounds,
                int segments, const double* w_sq_total, const double* u_sq_total, const LambHyperparameters& hp,
                int64_t step, const StepOptions& options);
double lamb_trust_ratio(double w_sq, double u_sq, const LambHyperparameters& hp);

}  // namespace zt::optim
