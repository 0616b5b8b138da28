// Dispatch for the CPU optimizer kernels: ISA choice, splitting across OpenMP threads, the
// per-step constants (computed in double, once), and LAMB's per-tensor bookkeeping.
#include "optim/cpu_kernels.h"

#include <cpuid.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#include "optim/kernels_impl.h"
#include "zerotrain/error.h"

namespace zt::optim {
namespace detail {
namespace {
constexpr KernelTable kScalarTable = make_table<ScalarV>();
}
const KernelTable& scalar_table() { return kScalarTable; }
}  // namespace detail

namespace {

using detail::KernelTable;

const KernelTable& table_for(Isa isa) {
  switch (isa) {
    case Isa::Avx512: return detail::avx512_table();
    case Isa::Avx2: return detail::avx2_table();
    case Isa::Scalar: break;
  }
  return detail::scalar_table();
}

Isa resolve(const StepOptions& o) {
  if (!o.isa) return selected_isa();
  if (!cpu_supports(*o.isa)) throw zt::ConfigError(std::string("optimizer kernels: this CPU lacks the ") + isa_name(*o.isa) + " path");
  return *o.isa;
}

int thread_count(const StepOptions& o) { return o.threads > 0 ? o.threads : omp_get_max_threads(); }

// Below this many elements a step runs on the calling thread (a parallel region costs a few µs).
constexpr int64_t kParallelMin = 1 << 16;

// Calls fn(begin, end, thread, threads) on contiguous chunks, 64-byte aligned relative to the start.
template <class Fn>
void split(int64_t n, int threads, Fn&& fn) {
  if (threads <= 1 || n < kParallelMin) {
    fn(int64_t(0), n, 0, 1);
    return;
  }
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    int64_t chunk = (n + nt - 1) / nt;
    chunk = (chunk + 15) / 16 * 16;
    const int64_t b = std::min<int64_t>(n, int64_t(t) * chunk), e = std::min<int64_t>(n, b + chunk);
    fn(b, e, t, nt);
  }
}

uint16_t* half_ptr(const StepOptions& o, int64_t offset) {
  return o.half == HalfType::None ? nullptr : o.half_out + offset;
}

void check_half(const StepOptions& o, int64_t n) {
  if (o.half != HalfType::None && o.half_out == nullptr && n > 0)
    throw std::invalid_argument("optimizer kernels: half output requested without a buffer");
}

void check_bounds(const int64_t* bounds, int segments, int64_t n) {
  if (segments < 1 || bounds[0] != 0 || bounds[segments] != n)
    throw std::invalid_argument("lamb: bounds must start at 0 and end at n");
  for (int s = 0; s < segments; ++s)
    if (bounds[s + 1] < bounds[s]) throw std::invalid_argument("lamb: bounds must not decrease");
}

// Runs fn(segment, begin, end) on the part of every piece inside [b, e).
template <class Fn>
void for_pieces(const int64_t* bounds, int segments, int64_t b, int64_t e, Fn&& fn) {
  if (b >= e) return;
  int s = int(std::upper_bound(bounds, bounds + segments + 1, b) - bounds) - 1;
  for (; s < segments && bounds[s] < e; ++s) {
    const int64_t lo = std::max(b, bounds[s]), hi = std::min(e, bounds[s + 1]);
    if (lo < hi) fn(s, lo, hi);
  }
}

}  // namespace

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::Avx512: return "avx512";
    case Isa::Avx2: return "avx2";
    case Isa::Scalar: break;
  }
  return "scalar";
}

// The vector paths convert fp16 with F16C. Every AVX2 CPU sold has it, but a hypervisor may hide
// it, and GCC 12's __builtin_cpu_supports cannot ask for it: read CPUID leaf 1, ECX bit 29.
static bool cpu_has_f16c() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & bit_F16C) != 0;
}

bool cpu_supports(Isa isa) {
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && cpu_has_f16c();
  switch (isa) {
    case Isa::Avx512: return avx2 && __builtin_cpu_supports("avx512f");
    case Isa::Avx2: return avx2;
    case Isa::Scalar: return true;
  }
  return false;
}

Isa best_isa() {
  if (cpu_supports(Isa::Avx512)) return Isa::Avx512;
  if (cpu_supports(Isa::Avx2)) return Isa::Avx2;
  return Isa::Scalar;
}

Isa selected_isa() {
  const char* env = std::getenv("ZT_OPTIM_ISA");
  if (env == nullptr || *env == '\0') return best_isa();
  const std::string want = env;
  for (Isa isa : {Isa::Scalar, Isa::Avx2, Isa::Avx512}) {
    if (want != isa_name(isa)) continue;
    if (!cpu_supports(isa))
      throw zt::ConfigError("ZT_OPTIM_ISA=" + want + ": this CPU lacks that instruction set (best available: " +
                               isa_name(best_isa()) + ")");
    return isa;
  }
  throw zt::ConfigError("ZT_OPTIM_ISA=" + want + ": expected scalar, avx2 or avx512");
}

void adam_step(float* params, const float* grads, float* exp_avg, float* exp_avg_sq, int64_t n,
               const AdamHyperparameters& hp, int64_t step, const StepOptions& o) {
  check_half(o, n);
  const KernelTable& k = table_for(resolve(o));
  const detail::AdamConsts c = detail::adam_consts(hp, step, o.grad_scale);
  split(n, thread_count(o), [&](int64_t b, int64_t e, int, int) {
    k.adam(params + b, grads + b, exp_avg + b, exp_avg_sq + b, e - b, c, o.half, half_ptr(o, b));
  });
}

void sgd_step(float* params, const float* grads, float* buf, int64_t n, const SgdHyperparameters& hp, int64_t step,
              const StepOptions& o) {
  check_half(o, n);
  const KernelTable& k = table_for(resolve(o));
  const bool momentum = hp.momentum != 0.0;
  const detail::SgdConsts c = detail::sgd_consts(hp, step, o.grad_scale);
  split(n, thread_count(o), [&](int64_t b, int64_t e, int, int) {
    k.sgd(params + b, grads + b, momentum ? buf + b : nullptr, e - b, c, o.half, half_ptr(o, b));
  });
}


void lamb_partial_norms(const float* p, const float* g, float* m, float* v, int64_t n, const int64_t* bounds,
                        int segments, const LambHyperparameters& hp, const StepOptions& o, double* w_sq,
                        double* u_sq) {
  check_bounds(bounds, segments, n);
  const KernelTable& k = table_for(resolve(o));
  const auto c = detail::lamb_consts(hp, o.grad_scale);
  const int threads = thread_count(o);
  // One row of partial sums per thread, summed in thread order: deterministic for a thread count.
  std::vector<double> partial(size_t(std::max(threads, 1)) * segments * 2, 0.0);
  int used = 1;
  split(n, threads, [&](int64_t b, int64_t e, int t, int nt) {
    if (t == 0) used = nt;
    double* row = partial.data() + size_t(t) * segments * 2;
    for_pieces(bounds, segments, b, e, [&](int s, int64_t lo, int64_t hi) {
      k.lamb1(p + lo, g + lo, m + lo, v + lo, hi - lo, c, &row[2 * s], &row[2 * s + 1]);
    });
  });
  for (int s = 0; s < segments; ++s) {
    double w = 0, u = 0;
    for (int t = 0; t < used; ++t) {
      w += partial[size_t(t) * segments * 2 + 2 * s];
      u += partial[size_t(t) * segments * 2 + 2 * s + 1];
    }
    w_sq[s] = w;
    u_sq[s] = u;
  }
}

double lamb_trust_ratio(double w_sq, double u_sq, const LambHyperparameters& hp) {
  const double w = std::sqrt(w_sq), u = std::sqrt(u_sq);
  if (w == 0.0 || u == 0.0) return 1.0;  // DeepSpeed FusedLamb: no scaling for an all-zero side
  return std::clamp(w / u, hp.min_coeff, hp.max_coeff);
}

void lamb_apply(float* p, const float* m, const float* v, int64_t n, const int64_t* bounds, int segments,
                const double* w_sq_total, const double* u_sq_total, const LambHyperparameters& hp, int64_t step,
                const StepOptions& o) {
  check_bounds(bounds, segments, n);
  check_half(o, n);
  const KernelTable& k = table_for(resolve(o));
  const auto c = detail::lamb_consts(hp, o.grad_scale);
  double step_size = hp.lr;
  if (hp.bias_correction)
    step_size = hp.lr * std::sqrt(1.0 - std::pow(hp.beta2, double(step))) / (1.0 - std::pow(hp.beta1, double(step)));
  std::vector<float> coef(segments);
  for (int s = 0; s < segments; ++s)
    coef[s] = float(step_size * lamb_trust_ratio(w_sq_total[s], u_sq_total[s], hp));
  split(n, thread_count(o), [&](int64_t b, int64_t e, int, int) {
    for_pieces(bounds, segments, b, e, [&](int s, int64_t lo, int64_t hi) {
      k.lamb2(p + lo, m + lo, v + lo, hi - lo, c, coef[s], o.half, half_ptr(o, lo));
    });
  });
}

}  // namespace zt::optim
