// CPU optimizer step at the memory-bandwidth bound. In one process and one run:
// STREAM triad, an Adam-shaped read-4/write-3 loop (the bound), our fused AdamW, and
// torch::optim::AdamW, each with 1 and 2 threads on fp32 partitions of N parameters.
// Usage: optim_bench [N in millions, default 100] [repetitions, default 5]
#include <omp.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "optim/cpu_kernels.h"

namespace {

double seconds_best(int reps, const std::function<void()>& fn) {
  fn();  // warm-up (page faults, caches)
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    fn();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

// Restrict-qualified free functions so that GCC vectorises them without alias checks.
__attribute__((noinline)) void triad(float* __restrict a, const float* __restrict b, const float* __restrict c,
                                     int64_t n, int threads) {
#pragma omp parallel for simd schedule(static) num_threads(threads)
  for (int64_t i = 0; i < n; ++i) a[i] = b[i] + 0.5f * c[i];
}

__attribute__((noinline)) void read4_write3(float* __restrict p, const float* __restrict g, float* __restrict m,
                                            float* __restrict v, int64_t n, int threads) {
#pragma omp parallel for simd schedule(static) num_threads(threads)
  for (int64_t i = 0; i < n; ++i) {
    const float b = g[i];
    p[i] = p[i] + 1e-3f * b;  // a normal scale: a denormal product would make this loop compute-bound
    m[i] = m[i] * 0.5f + b;
    v[i] = v[i] * 0.5f + b;
  }
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t n = int64_t((argc > 1 ? std::atof(argv[1]) : 100.0) * 1e6);
  const int reps = argc > 2 ? std::atoi(argv[2]) : 5;
  std::printf("optimizer bench: N = %lld fp32 parameters, best of %d, ISA %s\n", (long long)n, reps,
              zt::optim::isa_name(zt::optim::selected_isa()));
  auto p = torch::rand({n}), g = torch::rand({n}) - 0.5, m = torch::zeros({n}), v = torch::zeros({n});
  float *P = p.data_ptr<float>(), *G = g.data_ptr<float>(), *M = m.data_ptr<float>(), *V = v.data_ptr<float>();
  std::printf("| threads | kernel | bytes/param | s/step | GB/s | G params/s | of bound |\n|---|---|---|---|---|---|---|\n");
  for (int threads : {1, 2}) {
    omp_set_num_threads(threads);
    torch::set_num_threads(threads);
    // STREAM triad a = b + s*c over the same three arrays (12 bytes per element).
    const double t_triad = seconds_best(reps, [&] { triad(M, G, V, n, threads); });
    // Adam-shaped: read p, g, m, v; write p, m, v with trivial arithmetic (28 bytes per element).
    const double t_bound = seconds_best(reps, [&] { read4_write3(P, G, M, V, n, threads); });
    m.zero_();
    v.zero_();
    zt::optim::AdamHyperparameters hp;
    hp.weight_decay = 0.01;
    zt::optim::StepOptions o;
    o.threads = threads;
    int64_t step = 0;
    const double t_ours = seconds_best(reps, [&] { zt::optim::adam_step(P, G, M, V, n, hp, ++step, o); });
    auto tp = p.clone().set_requires_grad(true);
    tp.mutable_grad() = g.clone();
    torch::optim::AdamW opt({tp}, torch::optim::AdamWOptions(1e-3).weight_decay(0.01));
    const double t_torch = seconds_best(reps, [&] { opt.step(); });
    const double bound_rate = n / t_bound;
    auto row = [&](const char* name, double bytes, double t) {
      std::printf("| %d | %s | %.0f | %.4f | %.1f | %.3f | %.2f |\n", threads, name, bytes, t, bytes * n / t / 1e9,
                  n / t / 1e9, (n / t) / bound_rate);
    };
    row("STREAM triad", 12, t_triad);
    row("read-4/write-3 bound", 28, t_bound);
    row("zerotrain AdamW", 28, t_ours);
    row("torch::optim::AdamW", 28, t_torch);
    std::printf("| %d | ours / torch | | | | %.2fx | |\n", threads, t_torch / t_ours);
  }
  return 0;
}
