// CPU optimizer kernels (src/optim/cpu_kernels.h) on every ISA path this machine has, against a
// double-precision scalar reference of the same formula and against torch::optim.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "optim/cpu_kernels.h"

namespace {

using namespace zt::optim;

std::vector<Isa> paths() {
  std::vector<Isa> out;
  for (Isa i : {Isa::Scalar, Isa::Avx2, Isa::Avx512})
    if (cpu_supports(i)) out.push_back(i);
  return out;
}

const int64_t kLengths[] = {0, 1, 7, 15, 17, 1000003};

// Buffers with an unaligned start (offset by one float from a 64-byte boundary).
struct Buf {
  std::vector<float> store;
  float* p;
  explicit Buf(int64_t n) : store(size_t(n) + 32) { p = store.data() + 1; }
};

void fill(float* x, int64_t n, std::mt19937& rng, float lo, float hi) {
  std::uniform_real_distribution<float> d(lo, hi);
  for (int64_t i = 0; i < n; ++i) x[i] = d(rng);
}

// Max error relative to the largest reference magnitude (element-wise relative error is
// ill-conditioned where a value crosses zero: 1M random values always have some near 0).
double max_rel(const float* a, const std::vector<double>& ref, int64_t n) {
  double worst = 0, scale = 1e-30;
  for (int64_t i = 0; i < n; ++i) {
    scale = std::max(scale, std::abs(ref[i]));
    worst = std::max(worst, std::abs(double(a[i]) - ref[i]));
  }
  return worst / scale;
}

// Reference Adam in double from the same fp32 start values (fp32 gradients).
void adam_ref(std::vector<double>& p, const float* g, std::vector<double>& m, std::vector<double>& v,
              const AdamHyperparameters& hp, int64_t step, double gs) {
  const double b1 = hp.bias_correction ? 1 - std::pow(hp.beta1, step) : 1;
  const double b2 = hp.bias_correction ? 1 - std::pow(hp.beta2, step) : 1;
  for (size_t i = 0; i < p.size(); ++i) {
    double gi = g[i] * gs + (hp.decoupled_weight_decay ? 0 : hp.weight_decay * p[i]);
    m[i] = hp.beta1 * m[i] + (1 - hp.beta1) * gi;
    v[i] = hp.beta2 * v[i] + (1 - hp.beta2) * gi * gi;
    if (hp.decoupled_weight_decay) p[i] *= 1 - hp.lr * hp.weight_decay;
    p[i] -= hp.lr / b1 * m[i] / (std::sqrt(v[i]) / std::sqrt(b2) + hp.eps);
  }
}

struct AdamCase {
  bool decoupled, bias;
};

TEST(OptimKernels, AdamMatchesDoubleReferenceOnEveryPath) {
  for (Isa isa : paths())
    for (AdamCase ac : {AdamCase{true, true}, AdamCase{false, true}, AdamCase{true, false}})
      for (int64_t n : kLengths) {
        std::mt19937 rng(7 + n);
        Buf p(n), m(n), v(n), g(n);
        fill(p.p, n, rng, -1, 1);
        std::vector<double> rp(p.p, p.p + n), rm(n, 0.0), rv(n, 0.0);
        std::fill(m.p, m.p + n, 0.f);
        std::fill(v.p, v.p + n, 0.f);
        AdamHyperparameters hp;
        hp.lr = 1e-2;
        hp.weight_decay = 0.1;
        hp.decoupled_weight_decay = ac.decoupled;
        hp.bias_correction = ac.bias;
        StepOptions o;
        o.isa = isa;
        o.grad_scale = 0.5f;
        o.threads = 2;
        for (int step = 1; step <= 10; ++step) {
          // |g·scale| >= 0.25 > |wd·p|: Adam's m/sqrt(v) is ill-conditioned where the L2 term
          // cancels the gradient (an O(1) change from one rounding), which would test the
          // formula's conditioning rather than the kernel.
          fill(g.p, n, rng, 0.5f, 1.0f);
          for (int64_t i = 0; i < n; i += 2) g.p[i] = -g.p[i];
          adam_step(p.p, g.p, m.p, v.p, n, hp, step, o);
          adam_ref(rp, g.p, rm, rv, hp, step, 0.5);
        }
        EXPECT_LE(max_rel(p.p, rp, n), 1e-6) << isa_name(isa) << " n=" << n << " decoupled=" << ac.decoupled;
        EXPECT_LE(max_rel(m.p, rm, n), 1e-5) << isa_name(isa) << " n=" << n;
      }
}

TEST(OptimKernels, SgdMatchesDoubleReferenceOnEveryPath) {
  struct S { double momentum, dampening; bool nesterov; };
  for (Isa isa : paths())
    for (S sc : {S{0.0, 0.0, false}, S{0.9, 0.1, false}, S{0.9, 0.0, true}})
      for (int64_t n : kLengths) {
        std::mt19937 rng(11 + n);
        Buf p(n), b(n), g(n);
        fill(p.p, n, rng, -1, 1);
        std::fill(b.p, b.p + n, 0.f);
        std::vector<double> rp(p.p, p.p + n), rb(n, 0.0);
        SgdHyperparameters hp{0.05, sc.momentum, sc.dampening, 0.01, sc.nesterov};
        StepOptions o;
        o.isa = isa;
        o.grad_scale = 2.0f;
        for (int step = 1; step <= 10; ++step) {
          fill(g.p, n, rng, -1, 1);
          sgd_step(p.p, g.p, b.p, n, hp, step, o);
          for (int64_t i = 0; i < n; ++i) {
            double d = g.p[i] * 2.0 + hp.weight_decay * rp[i];
            if (hp.momentum != 0) {
              rb[i] = step == 1 ? d : hp.momentum * rb[i] + (1 - hp.dampening) * d;
              d = hp.nesterov ? d + hp.momentum * rb[i] : rb[i];
            }
            rp[i] -= hp.lr * d;
          }
        }
        EXPECT_LE(max_rel(p.p, rp, n), 1e-6) << isa_name(isa) << " n=" << n << " momentum=" << sc.momentum;
      }
}

// Double reference of LAMB (DeepSpeed FusedLamb) on a list of tensors.
void lamb_ref(std::vector<double>& p, const float* g, std::vector<double>& m, std::vector<double>& v,
              const std::vector<int64_t>& bounds, const LambHyperparameters& hp, int64_t step, double gs) {
  const double ss = hp.bias_correction
                        ? hp.lr * std::sqrt(1 - std::pow(hp.beta2, step)) / (1 - std::pow(hp.beta1, step))
                        : hp.lr;
  std::vector<double> u(p.size());
  for (size_t s = 0; s + 1 < bounds.size(); ++s) {
    double w2 = 0, u2 = 0;
    for (int64_t i = bounds[s]; i < bounds[s + 1]; ++i) {
      const double gi = g[i] * gs;
      m[i] = hp.beta1 * m[i] + (1 - hp.beta1) * gi;
      v[i] = hp.beta2 * v[i] + (1 - hp.beta2) * gi * gi;
      u[i] = m[i] / (std::sqrt(v[i]) + hp.eps) + hp.weight_decay * p[i];
      w2 += p[i] * p[i];
      u2 += u[i] * u[i];
    }
    const double r = lamb_trust_ratio(w2, u2, hp);
    for (int64_t i = bounds[s]; i < bounds[s + 1]; ++i) p[i] -= ss * r * u[i];
  }
}

void lamb_local_step(float* p, const float* g, float* m, float* v, int64_t n, const std::vector<int64_t>& bounds,
                     const LambHyperparameters& hp, int64_t step, const StepOptions& o) {
  const int segs = int(bounds.size()) - 1;
  std::vector<double> w(segs), u(segs);
  lamb_partial_norms(p, g, m, v, n, bounds.data(), segs, hp, o, w.data(), u.data());
  lamb_apply(p, m, v, n, bounds.data(), segs, w.data(), u.data(), hp, step, o);
}

TEST(OptimKernels, LambMatchesDoubleReferenceOnEveryPath) {
  for (Isa isa : paths())
    for (int64_t n : kLengths) {
      std::mt19937 rng(13 + n);
      Buf p(n), m(n), v(n), g(n);
      fill(p.p, n, rng, -1, 1);
      std::fill(m.p, m.p + n, 0.f);
      std::fill(v.p, v.p + n, 0.f);
      // Three tensors (one may be empty) covering [0, n).
      std::vector<int64_t> bounds{0, n / 3, n / 3 + n / 5, n};
      std::vector<double> rp(p.p, p.p + n), rm(n, 0.0), rv(n, 0.0);
      LambHyperparameters hp;
      hp.lr = 1e-2;
      hp.weight_decay = 0.01;
      StepOptions o;
      o.isa = isa;
      o.grad_scale = 0.25f;
      for (int step = 1; step <= 10; ++step) {
        fill(g.p, n, rng, -1, 1);
        lamb_local_step(p.p, g.p, m.p, v.p, n, bounds, hp, step, o);
        lamb_ref(rp, g.p, rm, rv, bounds, hp, step, 0.25);
      }
      EXPECT_LE(max_rel(p.p, rp, n), 1e-6) << isa_name(isa) << " n=" << n;
    }
}

TEST(OptimKernels, LambTrustRatioIsClampedAsDeepSpeed) {
  LambHyperparameters hp;
  EXPECT_DOUBLE_EQ(lamb_trust_ratio(4.0, 1.0, hp), 2.0);
  EXPECT_DOUBLE_EQ(lamb_trust_ratio(1e6, 1e-6, hp), 10.0);
  EXPECT_DOUBLE_EQ(lamb_trust_ratio(1e-8, 1.0, hp), 0.01);
  EXPECT_DOUBLE_EQ(lamb_trust_ratio(0.0, 1.0, hp), 1.0);
  EXPECT_DOUBLE_EQ(lamb_trust_ratio(1.0, 0.0, hp), 1.0);
}

// Simulated ranks: the flat buffer of 4 tensors cut into equal rank ranges that split tensors.
TEST(OptimKernels, LambSplitAcrossRanksEqualsWhole) {
  const std::vector<int64_t> tensor_bounds{0, 1000, 1003, 50021, 70001};
  const int64_t n = tensor_bounds.back();
  for (Isa isa : paths())
    for (int ranks : {2, 3}) {
      std::mt19937 rng(5);
      std::vector<float> p0(n), g(n);
      fill(p0.data(), n, rng, -1, 1);
      std::vector<float> pw = p0, mw(n, 0.f), vw(n, 0.f), pr = p0, mr(n, 0.f), vr(n, 0.f);
      LambHyperparameters hp;
      hp.lr = 1e-2;
      hp.weight_decay = 0.01;
      StepOptions o;
      o.isa = isa;
      const int nt = int(tensor_bounds.size()) - 1;
      const int64_t per = (n + ranks - 1) / ranks;
      for (int step = 1; step <= 10; ++step) {
        fill(g.data(), n, rng, -1, 1);
        lamb_local_step(pw.data(), g.data(), mw.data(), vw.data(), n, tensor_bounds, hp, step, o);
        // Phase 1 on each rank's fragment; remember which tensor each local piece belongs to.
        struct Local { int64_t lo, hi; std::vector<int64_t> bounds; std::vector<int> tensor; std::vector<double> w, u; };
        std::vector<Local> locals(ranks);
        std::vector<double> tw(nt, 0.0), tu(nt, 0.0);  // the "all-reduce"
        for (int r = 0; r < ranks; ++r) {
          Local& L = locals[r];
          L.lo = std::min(n, r * per);
          L.hi = std::min(n, L.lo + per);
          L.bounds.push_back(0);
          for (int t = 0; t < nt; ++t) {
            const int64_t a = std::max(L.lo, tensor_bounds[t]), b = std::min(L.hi, tensor_bounds[t + 1]);
            if (a < b) { L.bounds.push_back(b - L.lo); L.tensor.push_back(t); }
          }
          if (L.bounds.size() == 1) continue;  // empty rank
          L.w.resize(L.tensor.size());
          L.u.resize(L.tensor.size());
          lamb_partial_norms(pr.data() + L.lo, g.data() + L.lo, mr.data() + L.lo, vr.data() + L.lo, L.hi - L.lo,
                             L.bounds.data(), int(L.tensor.size()), hp, o, L.w.data(), L.u.data());
          for (size_t s = 0; s < L.tensor.size(); ++s) { tw[L.tensor[s]] += L.w[s]; tu[L.tensor[s]] += L.u[s]; }
        }
        for (Local& L : locals) {
          if (L.tensor.empty()) continue;
          std::vector<double> w, u;
          for (int t : L.tensor) { w.push_back(tw[t]); u.push_back(tu[t]); }
          lamb_apply(pr.data() + L.lo, mr.data() + L.lo, vr.data() + L.lo, L.hi - L.lo, L.bounds.data(),
                     int(L.tensor.size()), w.data(), u.data(), hp, step, o);
        }
      }
      auto as_double = [](const std::vector<float>& x) { return std::vector<double>(x.begin(), x.end()); };
      EXPECT_LE(max_rel(pr.data(), as_double(pw), n), 1e-6) << isa_name(isa) << " ranks=" << ranks;
      EXPECT_LE(max_rel(mr.data(), as_double(mw), n), 1e-6) << isa_name(isa) << " ranks=" << ranks;
      EXPECT_LE(max_rel(vr.data(), as_double(vw), n), 1e-6) << isa_name(isa) << " ranks=" << ranks;
    }
}

TEST(OptimKernels, HalfCopiesAreCorrectlyRoundedOnEveryPath) {
  for (Isa isa : paths())
    for (HalfType ht : {HalfType::BF16, HalfType::FP16})
      for (int64_t n : kLengths) {
        std::mt19937 rng(17 + n);
        Buf p(n), m(n), v(n), g(n), p2(n), m2(n), v2(n);
        std::vector<uint16_t> half(size_t(n) + 8, 0);
        fill(p.p, n, rng, -3, 3);
        fill(g.p, n, rng, -1, 1);
        std::fill(m.p, m.p + n, 0.f);
        std::fill(v.p, v.p + n, 0.f);
        std::copy(p.p, p.p + n, p2.p);
        std::copy(m.p, m.p + n, m2.p);
        std::copy(v.p, v.p + n, v2.p);
        if (n > 3) p.p[3] = p2.p[3] = 1e-39f;  // a subnormal parameter (with lr 0 it stays)
        AdamHyperparameters hp;
        hp.lr = n > 3 ? 1e-3 : 1e-3;
        StepOptions o;
        o.isa = isa;
        o.half = ht;
        o.half_out = half.data() + 1;
        adam_step(p.p, g.p, m.p, v.p, n, hp, 1, o);
        StepOptions plain;
        plain.isa = isa;
        adam_step(p2.p, g.p, m2.p, v2.p, n, hp, 1, plain);
        ASSERT_EQ(std::vector<float>(p.p, p.p + n), std::vector<float>(p2.p, p2.p + n));
        auto f = torch::from_blob(p.p, {n}, torch::kFloat32);
        auto want = f.to(ht == HalfType::BF16 ? torch::kBFloat16 : torch::kFloat16).view(torch::kInt16);
        auto got = torch::from_blob(half.data() + 1, {n}, torch::kInt16);
        EXPECT_TRUE(torch::equal(got, want)) << isa_name(isa) << " n=" << n << (ht == HalfType::BF16 ? " bf16" : " fp16");
        // The same half copy from SGD and LAMB.
        SgdHyperparameters sh{0.0, 0.0, 0.0, 0.0, false};
        sgd_step(p.p, g.p, nullptr, n, sh, 1, o);
        EXPECT_TRUE(torch::equal(got, want)) << "sgd " << isa_name(isa) << " n=" << n;
      }
}

TEST(OptimKernels, AdamWAndAdamMatchTorchOptim) {
  for (bool decoupled : {true, false}) {
    torch::manual_seed(1);
    const int64_t n = 100003;
    auto p = torch::randn({n});
    auto ref = p.clone().set_requires_grad(true);
    auto m = torch::zeros({n}), v = torch::zeros({n});
    AdamHyperparameters hp;
    hp.lr = 1e-2;
    hp.beta1 = 0.8;
    hp.beta2 = 0.95;
    hp.eps = 1e-7;
    hp.weight_decay = 0.1;
    hp.decoupled_weight_decay = decoupled;
    std::unique_ptr<torch::optim::Optimizer> opt;
    if (decoupled)
      opt = std::make_unique<torch::optim::AdamW>(std::vector<torch::Tensor>{ref},
          torch::optim::AdamWOptions(hp.lr).betas({hp.beta1, hp.beta2}).eps(hp.eps).weight_decay(hp.weight_decay));
    else
      opt = std::make_unique<torch::optim::Adam>(std::vector<torch::Tensor>{ref},
          torch::optim::AdamOptions(hp.lr).betas({hp.beta1, hp.beta2}).eps(hp.eps).weight_decay(hp.weight_decay));
    for (int step = 1; step <= 10; ++step) {
      auto g = torch::randn({n});
      ref.mutable_grad() = g.clone();
      opt->step();
      adam_step(p.data_ptr<float>(), g.data_ptr<float>(), m.data_ptr<float>(), v.data_ptr<float>(), n, hp, step, StepOptions{});
    }
    const double rel = ((p - ref.detach()).abs().max() / ref.detach().abs().max()).item<double>();
    EXPECT_LE(rel, 1e-6) << (decoupled ? "AdamW" : "Adam");
  }
}

TEST(OptimKernels, EnvironmentForcesAPath) {
  setenv("ZT_OPTIM_ISA", "scalar", 1);
  EXPECT_EQ(selected_isa(), Isa::Scalar);
  setenv("ZT_OPTIM_ISA", "sse9", 1);
  EXPECT_THROW(selected_isa(), std::runtime_error);
  for (Isa isa : {Isa::Avx2, Isa::Avx512}) {
    setenv("ZT_OPTIM_ISA", isa_name(isa), 1);
    if (cpu_supports(isa)) EXPECT_EQ(selected_isa(), isa);
    else EXPECT_THROW(selected_isa(), std::runtime_error);
  }
  unsetenv("ZT_OPTIM_ISA");
  EXPECT_EQ(selected_isa(), best_isa());
  std::printf("paths on this CPU:");
  for (Isa i : paths()) std::printf(" %s", isa_name(i));
  std::printf("\n");
}

}  // namespace
