// CPU optimizer kernels (src/optim/cpu_kernels.h), each ISA path forced in turn, against a
// double-precision reference checked element by element, against torch's bf16/fp16 rounding and
// against torch::optim.
#include <cpuid.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <string>
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

bool same_bits(const float* a, const float* b, int64_t n) { return std::memcmp(a, b, size_t(n) * sizeof(float)) == 0; }

int lanes(Isa isa) { return isa == Isa::Avx512 ? 16 : isa == Isa::Avx2 ? 8 : 1; }

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

// Max error relative to the largest reference magnitude (used only where two fp32 computations
// that sum in different orders are compared with each other).
double max_rel(const float* a, const std::vector<double>& ref, int64_t n) {
  double worst = 0, scale = 1e-30;
  for (int64_t i = 0; i < n; ++i) {
    scale = std::max(scale, std::abs(ref[i]));
    worst = std::max(worst, std::abs(double(a[i]) - ref[i]));
  }
  return worst / scale;
}

// ---------------------------------------------------------------------------------------------
// Per-element reference with a rigorous error bound.
//
// `Tracked` carries the exact value of a formula (evaluated in double from the kernel's fp32
// inputs and the double hyperparameters) and a bound `e` on how far any fp32 evaluation of it,
// in the kernel's order of operations, can be from that value:
// - each fp32 operation rounds to nearest: error at most u·|result| with u = 2^-24, plus
//   2^-150 (half the subnormal spacing) only where the result can lie below 2^-126, i.e. in
//   fp32's subnormal range, where relative accuracy does not exist;
// - errors of the operands are propagated exactly (|a'b' - ab| <= |a|eb + |b|ea + ea·eb, the
//   quotient and sqrt rules below), so cancellation shows up as a larger bound for that
//   element only: |got - ref| <= bound is "a few u relative" for a well-conditioned element
//   and exactly "equal" for an element whose formula is exactly 0 from exact-zero inputs;
// - an fma is bounded as two roundings, which covers both fused and unfused evaluation (the
//   scalar path has no FMA instruction, the vector paths do);
// - a hyperparameter the kernel converts to float once per step carries its actual conversion
//   error (0 when the value is exactly representable), plus 2^-50 relative for the kernel's own
//   double arithmetic in deriving it (bias corrections, 1 - β).
// Double evaluation error (2^-53 relative per operation) is 2^29 times below every u term, so
// the bound needs no other slack. There is no other absolute floor: where the reference is
// exactly 0 from exact-zero inputs the bound is 0 and the kernel must give exactly ±0; where eps
// dominates the denominator, sqrt(v)·c + eps is a sum of non-negative terms, so its relative
// error stays a few u without one.
// ---------------------------------------------------------------------------------------------
struct Tracked {
  double v = 0, e = 0;
};

constexpr double kU = 0x1p-24;
constexpr double kSubnormalHalfSpacing = 0x1p-150;
constexpr double kMinNormal = 0x1p-126;

Tracked exact(float x) { return {double(x), 0.0}; }
Tracked constant(double x) { return {x, std::abs(double(float(x)) - x) + 0x1p-50 * std::abs(x)}; }

Tracked rounded(Tracked x) {
  const double mag = std::abs(x.v) + x.e;
  double e = x.e + kU * mag;
  if (mag > 0 && std::abs(x.v) - x.e < kMinNormal) e += kSubnormalHalfSpacing;
  return {x.v, e};
}
Tracked add(Tracked a, Tracked b) { return rounded({a.v + b.v, a.e + b.e}); }
Tracked sub(Tracked a, Tracked b) { return rounded({a.v - b.v, a.e + b.e}); }
Tracked mul(Tracked a, Tracked b) {
  return rounded({a.v * b.v, std::abs(a.v) * b.e + std::abs(b.v) * a.e + a.e * b.e});
}
Tracked div(Tracked a, Tracked b) {
  const double q = a.v / b.v, room = std::abs(b.v) - b.e;
  return rounded({q, room > 0 ? (a.e + std::abs(q) * b.e) / room : std::numeric_limits<double>::infinity()});
}
Tracked sqrt(Tracked a) {
  // The computed radicand lies in [v - e, v + e]; sqrt is concave, so the lower end is the far one.
  const double s = std::sqrt(std::max(a.v, 0.0)), lo = a.v - a.e;
  const double e = lo > 0 ? a.e / (s + std::sqrt(lo)) : std::max(s, std::sqrt(a.e));
  return rounded({s, e});
}

// Checks fp32 results against Tracked references and keeps the figures the test prints.
class ElementCheck {
 public:
  explicit ElementCheck(std::string name) : name_(std::move(name)) {}

  template <class Context>
  void expect(int64_t i, double got, const Tracked& ref, Context&& context) {
    ++checked_;
    const double err = std::abs(got - ref.v);
    if (!(err <= ref.e)) {  // also fails on NaN
      if (++failures_ <= 5)
        ADD_FAILURE() << name_ << "[" << i << "] = " << fmt(got) << ", reference " << fmt(ref.v) << " ± "
                      << fmt(ref.e) << " (error " << fmt(err) << ", " << fmt(err / (kU * std::abs(ref.v)))
                      << " u relative); " << context();
      return;
    }
    if (ref.e > 0) worst_of_bound_ = std::max(worst_of_bound_, err / ref.e);
    // Well-conditioned elements (bound within 8 u of the value): the plain relative error.
    if (ref.v != 0 && ref.e <= 8 * kU * std::abs(ref.v)) {
      ++conditioned_;
      worst_rel_u_ = std::max(worst_rel_u_, err / (kU * std::abs(ref.v)));
    }
  }

  // Call once at the end of a test.
  void finish(const std::string& path) {
    EXPECT_EQ(failures_, 0) << name_ << " on " << path << ": elements outside their error bound";
    EXPECT_GT(checked_, 0) << name_;
    std::printf("  %-7s %-22s %8lld elements, worst %.2f of bound; %lld well-conditioned, worst %.2f u relative\n",
                path.c_str(), name_.c_str(), (long long)checked_, worst_of_bound_, (long long)conditioned_,
                worst_rel_u_);
  }

  static std::string fmt(double x) {
    std::ostringstream s;
    s.precision(9);
    s << x;
    return s.str();
  }

 private:
  std::string name_;
  int64_t checked_ = 0, failures_ = 0, conditioned_ = 0;
  double worst_of_bound_ = 0, worst_rel_u_ = 0;
};

// A value from one of many magnitude classes, each sign equally likely unless nonnegative:
// exact zero, fp32 subnormals (~1e-40), 1e-30, 1e-8, 1e-4, 1, 1e4, and log-uniform between
// 1e-30 and 1e4.
float sample(std::mt19937& rng, bool nonnegative = false) {
  std::uniform_int_distribution<int> cls(0, 11);
  std::uniform_real_distribution<float> mant(1.0f, 2.0f), expo(-30.0f, 4.0f);
  float x = 0;
  switch (cls(rng)) {
    case 0: x = 0.0f; break;
    case 1: x = 1e-40f * mant(rng); break;
    case 2: x = 1e-30f * mant(rng); break;
    case 3: x = 1e-8f * mant(rng); break;
    case 4: x = 1e-4f * mant(rng); break;
    case 5: x = mant(rng); break;
    case 6: x = 1e4f * mant(rng); break;
    default: x = std::pow(10.0f, expo(rng)) * mant(rng); break;
  }
  if (!nonnegative && (rng() & 1u)) x = -x;
  return x;
}

// Lengths whose tails are not multiples of any vector width (8, 16), and one above the
// threading threshold (64 Ki) so that chunks split by threads have tails too.
const int64_t kLengths[] = {1, 7, 15, 17, 1023, 70001};
int threads_for(int64_t n) { return n >= (1 << 16) ? 2 : 1; }

// Every test below runs once per path, forced through StepOptions::isa. A path the CPU lacks is
// reported as skipped with the missing flags, never passed silently.
std::string missing_flags(Isa isa) {
  __builtin_cpu_init();
  std::string out;
  if (isa == Isa::Avx512 && !__builtin_cpu_supports("avx512f")) out += " avx512f";
  if (isa != Isa::Scalar && !__builtin_cpu_supports("avx2")) out += " avx2";
  if (isa != Isa::Scalar && !__builtin_cpu_supports("fma")) out += " fma";
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (isa != Isa::Scalar && !(__get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & bit_F16C))) out += " f16c";
  return out;
}

// The lane count of the code that actually ran, read from LAMB's sum of squares, which
// accumulates in fp32 per lane: with p = {4096, 1, 1, ...} (4096² = 2^24), every 1 that lands in
// lane 0 after 2^24 is rounded away, so n = 64 elements lose n/lanes - 1 of them.
int observed_lanes(const StepOptions& o) {
  constexpr int64_t n = 64;
  std::vector<float> p(n, 1.0f), g(n, 0.0f), m(n, 0.0f), v(n, 0.0f);
  p[0] = 4096.0f;
  const int64_t bounds[2] = {0, n};
  double w = 0, u = 0;
  lamb_partial_norms(p.data(), g.data(), m.data(), v.data(), n, bounds, 1, LambHyperparameters{}, o, &w, &u);
  const double lost = double(n - 1) - (w - 0x1p24);
  return int(std::lround(double(n) / (lost + 1)));
}

class PerIsa : public ::testing::TestWithParam<Isa> {
 protected:
  void SetUp() override {
    const std::string missing = missing_flags(GetParam());
    if (!missing.empty()) {
      ASSERT_FALSE(cpu_supports(GetParam())) << "the dispatcher offers " << isa_name(GetParam())
                                             << " on a CPU that lacks" << missing;
      GTEST_SKIP() << "the " << isa_name(GetParam()) << " kernels did not run: this CPU lacks" << missing;
    }
    ASSERT_TRUE(cpu_supports(GetParam())) << "the CPU has the flags of " << isa_name(GetParam())
                                          << " but the dispatcher refuses that path";
  }
  StepOptions options(int64_t n) const {
    StepOptions o;
    o.isa = GetParam();
    o.threads = threads_for(n);
    return o;
  }
  std::string path() const { return isa_name(GetParam()); }
};

INSTANTIATE_TEST_SUITE_P(Path, PerIsa, ::testing::Values(Isa::Scalar, Isa::Avx2, Isa::Avx512),
                         [](const ::testing::TestParamInfo<Isa>& info) { return std::string(isa_name(info.param)); });

TEST_P(PerIsa, RunsCodeOfItsOwnVectorWidth) {
  EXPECT_EQ(observed_lanes(options(64)), lanes(GetParam())) << path();
}

// ------------------------------------------ Adam / AdamW

struct AdamRef {
  Tracked p, m, v;
};

// torch.optim.Adam/AdamW: g' = g·scale (+ wd·p for Adam's L2); m = b1 m + (1-b1) g';
// v = b2 v + (1-b2) g'²; p = p·(1 - lr·wd) for AdamW; p -= lr/bias1 · m / (sqrt(v)/sqrt(bias2) + eps).
AdamRef adam_reference(float p, float g, float m, float v, float scale, const AdamHyperparameters& hp, int64_t step) {
  const double bias1 = hp.bias_correction ? 1 - std::pow(hp.beta1, double(step)) : 1;
  const double bias2 = hp.bias_correction ? 1 - std::pow(hp.beta2, double(step)) : 1;
  const Tracked P = exact(p);
  Tracked G = mul(exact(g), exact(scale));
  if (!hp.decoupled_weight_decay) G = add(G, mul(constant(hp.weight_decay), P));
  const Tracked M = add(mul(constant(hp.beta1), exact(m)), mul(constant(1 - hp.beta1), G));
  const Tracked V = add(mul(constant(hp.beta2), exact(v)), mul(mul(constant(1 - hp.beta2), G), G));
  const Tracked denom = add(mul(sqrt(V), constant(1 / std::sqrt(bias2))), constant(hp.eps));
  const Tracked kept = hp.decoupled_weight_decay ? mul(P, constant(1 - hp.lr * hp.weight_decay)) : P;
  return {sub(kept, div(mul(constant(hp.lr / bias1), M), denom)), M, V};
}

TEST_P(PerIsa, AdamPerElementWithinBoundOfDoubleReference) {
  struct Case {
    bool decoupled, bias;
    int64_t step;
    double beta1, beta2, eps, lr;
  };
  const Case cases[] = {{true, true, 1, 0.9, 0.999, 1e-8, 1e-3},  {true, true, 7, 0.8, 0.95, 1e-6, 3e-2},
                        {false, true, 1, 0.9, 0.999, 1e-8, 1e-3}, {false, true, 7, 0.8, 0.95, 1e-6, 3e-2},
                        {true, false, 3, 0.9, 0.999, 1e-8, 1e-3}, {false, false, 3, 0.9, 0.999, 1e-8, 1e-3}};
  const float scale = 1.0f / 3.0f;  // not a power of two: the unscale multiply rounds
  ElementCheck cp("adam p"), cm("adam exp_avg"), cv("adam exp_avg_sq");
  for (const Case& c : cases)
    for (int64_t n : kLengths) {
      std::mt19937 rng(uint32_t(1000 * n + c.step + 10 * c.decoupled + 100 * c.bias));
      Buf p(n), g(n), m(n), v(n);
      for (int64_t i = 0; i < n; ++i) {
        p.p[i] = sample(rng);
        m.p[i] = sample(rng);
        v.p[i] = sample(rng, true);
      }
      if (n > 1) p.p[n / 2] = m.p[n / 2] = v.p[n / 2] = 0.0f;  // with g = 0 below: exactly 0 out
      AdamHyperparameters hp;
      hp.lr = c.lr;
      hp.beta1 = c.beta1;
      hp.beta2 = c.beta2;
      hp.eps = c.eps;
      hp.weight_decay = 0.1;
      hp.decoupled_weight_decay = c.decoupled;
      hp.bias_correction = c.bias;
      StepOptions o = options(n);
      o.grad_scale = scale;
      // Two steps; each is checked from the fp32 state the kernel started it with.
      for (int64_t step = c.step; step < c.step + 2; ++step) {
        for (int64_t i = 0; i < n; ++i) g.p[i] = sample(rng);
        if (n > 1) g.p[n / 2] = 0.0f;
        const std::vector<float> p0(p.p, p.p + n), m0(m.p, m.p + n), v0(v.p, v.p + n);
        adam_step(p.p, g.p, m.p, v.p, n, hp, step, o);
        for (int64_t i = 0; i < n; ++i) {
          const AdamRef r = adam_reference(p0[i], g.p[i], m0[i], v0[i], scale, hp, step);
          auto ctx = [&] {
            std::ostringstream s;
            s << path() << " n=" << n << " step=" << step << (c.decoupled ? " AdamW" : " Adam(L2)")
              << (c.bias ? "" : " no-bias-correction") << " from p=" << p0[i] << " g=" << g.p[i] << " m=" << m0[i]
              << " v=" << v0[i];
            return s.str();
          };
          cp.expect(i, p.p[i], r.p, ctx);
          cm.expect(i, m.p[i], r.m, ctx);
          cv.expect(i, v.p[i], r.v, ctx);
        }
      }
    }
  cp.finish(path());
  cm.finish(path());
  cv.finish(path());
}

// ------------------------------------------ SGD with momentum

struct SgdRef {
  Tracked p, buf;
};

// torch.optim.SGD: d = g·scale + wd·p; buf = d on the first step, else momentum·buf +
// (1 - dampening)·d; d = d + momentum·buf (Nesterov) or buf; p -= lr·d.
SgdRef sgd_reference(float p, float g, float buf, float scale, const SgdHyperparameters& hp, int64_t step) {
  const Tracked P = exact(p);
  Tracked d = add(mul(exact(g), exact(scale)), mul(constant(hp.weight_decay), P));
  Tracked b{};
  if (hp.momentum != 0) {
    b = step <= 1 ? d : add(mul(constant(hp.momentum), exact(buf)), mul(constant(1 - hp.dampening), d));
    d = hp.nesterov ? add(d, mul(constant(hp.momentum), b)) : b;
  }
  return {sub(P, mul(constant(hp.lr), d)), b};
}

TEST_P(PerIsa, SgdPerElementWithinBoundOfDoubleReference) {
  const SgdHyperparameters cases[] = {{0.05, 0.0, 0.0, 0.01, false},
                                      {0.05, 0.9, 0.1, 0.01, false},
                                      {0.05, 0.9, 0.0, 0.01, true},
                                      {0.3, 0.99, 0.5, 0.0, false}};
  const float scale = 1.0f / 3.0f;
  ElementCheck cp("sgd p"), cb("sgd momentum_buffer");
  for (const SgdHyperparameters& hp : cases)
    for (int64_t n : kLengths) {
      std::mt19937 rng(uint32_t(7 * n + 1000 * hp.momentum + hp.nesterov));
      Buf p(n), g(n), b(n);
      for (int64_t i = 0; i < n; ++i) {
        p.p[i] = sample(rng);
        b.p[i] = sample(rng);  // finite; the first step must overwrite it
      }
      StepOptions o = options(n);
      o.grad_scale = scale;
      for (int64_t step = 1; step <= 3; ++step) {
        for (int64_t i = 0; i < n; ++i) g.p[i] = sample(rng);
        const std::vector<float> p0(p.p, p.p + n), b0(b.p, b.p + n);
        sgd_step(p.p, g.p, b.p, n, hp, step, o);
        if (hp.momentum == 0)
          EXPECT_TRUE(same_bits(b.p, b0.data(), n)) << "SGD without momentum wrote its buffer: " << path() << " n=" << n;
        for (int64_t i = 0; i < n; ++i) {
          const SgdRef r = sgd_reference(p0[i], g.p[i], b0[i], scale, hp, step);
          auto ctx = [&] {
            std::ostringstream s;
            s << path() << " n=" << n << " step=" << step << " momentum=" << hp.momentum
              << " dampening=" << hp.dampening << (hp.nesterov ? " nesterov" : "") << " from p=" << p0[i]
              << " g=" << g.p[i] << " buf=" << b0[i];
            return s.str();
          };
          cp.expect(i, p.p[i], r.p, ctx);
          if (hp.momentum != 0) cb.expect(i, b.p[i], r.buf, ctx);
        }
      }
    }
  cp.finish(path());
  cb.finish(path());
}

// ------------------------------------------ LAMB

struct LambRef {
  Tracked m, v, u;
};

// DeepSpeed FusedLamb, phase 1 for one element: g' = g·scale; m = b1 m + (1-b1) g';
// v = b2 v + (1-b2) g'²; u = m / (sqrt(v) + eps) + wd·p.
LambRef lamb_reference(float p, float g, float m, float v, float scale, const LambHyperparameters& hp) {
  const Tracked G = mul(exact(g), exact(scale));
  const Tracked M = add(mul(constant(hp.beta1), exact(m)), mul(constant(1 - hp.beta1), G));
  const Tracked V = add(mul(constant(hp.beta2), exact(v)), mul(mul(constant(1 - hp.beta2), G), G));
  const Tracked U = add(div(M, add(sqrt(V), constant(hp.eps))), mul(constant(hp.weight_decay), exact(p)));
  return {M, V, U};
}

// The same update from stored (fp32) m and v, as phase 2 re-derives it.
Tracked lamb_update_reference(float p, float m, float v, const LambHyperparameters& hp) {
  return add(div(exact(m), add(sqrt(exact(v)), constant(hp.eps))), mul(constant(hp.weight_decay), exact(p)));
}

// ‖p‖/‖u‖ clamped to [min_coeff, max_coeff]; 1 when either norm is 0.
double reference_ratio(double w_sq, double u_sq, const LambHyperparameters& hp) {
  if (w_sq == 0 || u_sq == 0) return 1;
  return std::min(hp.max_coeff, std::max(hp.min_coeff, std::sqrt(w_sq) / std::sqrt(u_sq)));
}

// A sum of squares over one piece: fp32 accumulation per lane in chains of at most
// min(512, length) terms (then double), each term's error from its operand's bound.
struct SquareSum {
  double v = 0, operand_err = 0, magnitude = 0;
  int64_t count = 0;
  void add(const Tracked& x) {
    v += x.v * x.v;
    operand_err += 2 * std::abs(x.v) * x.e + x.e * x.e;
    magnitude += (std::abs(x.v) + x.e) * (std::abs(x.v) + x.e);
    ++count;
  }
  // A square and an accumulate each round once per term (fused or not): (chain + 1) u of the
  // magnitude to first order (2^-28 more covers the second-order terms, chain² u² <= 2^-30), and
  // twice the subnormal half-spacing per term where they underflow.
  double bound() const {
    const double chain = double(std::min<int64_t>(512, count));
    return operand_err + ((chain + 1) * kU + 0x1p-28) * magnitude + 2 * double(count) * kSubnormalHalfSpacing;
  }
};

enum class Piece { Mixed, ZeroParams, NoMoments, TinyParams, Unit, LargeParams };

void fill_piece(Piece kind, float* p, float* g, float* m, float* v, int64_t len, std::mt19937& rng) {
  std::uniform_real_distribution<float> half_to_one(0.5f, 1.0f), quarter_to_one(0.25f, 1.0f);
  auto pm = [&] { return (rng() & 1u) ? half_to_one(rng) : -half_to_one(rng); };
  for (int64_t i = 0; i < len; ++i) switch (kind) {
      case Piece::Mixed: p[i] = sample(rng), g[i] = sample(rng), m[i] = sample(rng), v[i] = sample(rng, true); break;
      case Piece::ZeroParams: p[i] = 0.0f, g[i] = sample(rng), m[i] = sample(rng), v[i] = sample(rng, true); break;
      case Piece::NoMoments: p[i] = pm(), g[i] = 0.0f, m[i] = 0.0f, v[i] = sample(rng, true); break;
      case Piece::TinyParams: p[i] = 1e-6f * pm(), g[i] = pm(), m[i] = pm(), v[i] = quarter_to_one(rng); break;
      case Piece::Unit: p[i] = pm(), g[i] = pm(), m[i] = pm(), v[i] = quarter_to_one(rng); break;
      case Piece::LargeParams: p[i] = 1e3f * pm(), g[i] = pm(), m[i] = pm(), v[i] = quarter_to_one(rng); break;
    }
}

TEST_P(PerIsa, LambBothPhasesPerElementWithinBoundOfDoubleReference) {
  struct Case {
    double weight_decay;
    bool bias;
    int64_t step;
    double eps, min_coeff, max_coeff;
  };
  const Case cases[] = {{0.01, true, 1, 1e-8, 0.01, 10.0}, {0.0, true, 5, 1e-6, 0.01, 10.0}, {0.01, false, 2, 1e-8, 0.05, 5.0}};
  struct Layout {
    std::vector<std::pair<int64_t, Piece>> pieces;
    bool clamp_cases;  // pieces chosen to reach every branch of the trust ratio
  };
  std::vector<Layout> layouts;
  for (int64_t n : kLengths) layouts.push_back({{{n, Piece::Mixed}}, false});
  layouts.push_back({{{1, Piece::Mixed},
                      {7, Piece::ZeroParams},
                      {15, Piece::NoMoments},
                      {17, Piece::TinyParams},
                      {0, Piece::Mixed},
                      {33, Piece::LargeParams},
                      {1023, Piece::Mixed},
                      {31, Piece::Unit}},
                     true});
  const float scale = 1.0f / 3.0f;
  ElementCheck cm("lamb exp_avg"), cv("lamb exp_avg_sq"), cw("lamb sum p^2"), cu("lamb sum u^2"), cp("lamb p");
  for (const Case& c : cases)
    for (const Layout& layout : layouts) {
      std::vector<int64_t> bounds{0};
      for (auto& [len, kind] : layout.pieces) bounds.push_back(bounds.back() + len);
      const int64_t n = bounds.back();
      const int segs = int(layout.pieces.size());
      std::mt19937 rng(uint32_t(31 * n + c.step + segs));
      Buf p(n), g(n), m(n), v(n);
      for (int s = 0; s < segs; ++s)
        fill_piece(layout.pieces[size_t(s)].second, p.p + bounds[s], g.p + bounds[s], m.p + bounds[s],
                   v.p + bounds[s], layout.pieces[size_t(s)].first, rng);
      LambHyperparameters hp;
      hp.lr = 1e-2;
      hp.weight_decay = c.weight_decay;
      hp.bias_correction = c.bias;
      hp.eps = c.eps;
      hp.min_coeff = c.min_coeff;
      hp.max_coeff = c.max_coeff;
      StepOptions o = options(n);
      o.grad_scale = scale;
      const std::vector<float> p0(p.p, p.p + n), m0(m.p, m.p + n), v0(v.p, v.p + n);
      std::vector<double> w_sq(static_cast<size_t>(segs)), u_sq(static_cast<size_t>(segs));
      lamb_partial_norms(p.p, g.p, m.p, v.p, n, bounds.data(), segs, hp, o, w_sq.data(), u_sq.data());
      auto where = [&](int64_t i) {
        std::ostringstream s;
        s << path() << " n=" << n << " pieces=" << segs << " step=" << c.step << " wd=" << c.weight_decay;
        if (i >= 0) s << " from p=" << p0[size_t(i)] << " g=" << g.p[i] << " m=" << m0[size_t(i)] << " v=" << v0[size_t(i)];
        return s.str();
      };
      // Phase 1: m, v per element; the sums of squares per piece.
      for (int s = 0; s < segs; ++s) {
        SquareSum ws, us;
        for (int64_t i = bounds[s]; i < bounds[s + 1]; ++i) {
          const LambRef r = lamb_reference(p0[size_t(i)], g.p[i], m0[size_t(i)], v0[size_t(i)], scale, hp);
          cm.expect(i, m.p[i], r.m, [&] { return where(i); });
          cv.expect(i, v.p[i], r.v, [&] { return where(i); });
          ws.add(exact(p0[size_t(i)]));
          us.add(r.u);
        }
        cw.expect(s, w_sq[size_t(s)], {ws.v, ws.bound()}, [&] { return where(-1); });
        cu.expect(s, u_sq[size_t(s)], {us.v, us.bound()}, [&] { return where(-1); });
      }
      if (layout.clamp_cases) {
        // The pieces reach every branch of the ratio: ‖p‖ = 0, ‖u‖ = 0 or clamped high (no
        // moments: u = wd·p), clamped low (tiny p), inside the range, clamped high (large p).
        const double r_zero_p = reference_ratio(w_sq[1], u_sq[1], hp), r_no_moments = reference_ratio(w_sq[2], u_sq[2], hp);
        EXPECT_EQ(w_sq[1], 0.0);
        EXPECT_EQ(r_zero_p, 1.0);
        if (c.weight_decay == 0) EXPECT_EQ(u_sq[2], 0.0);
        EXPECT_EQ(r_no_moments, c.weight_decay == 0 ? 1.0 : c.max_coeff);
        EXPECT_EQ(reference_ratio(w_sq[3], u_sq[3], hp), c.min_coeff);
        EXPECT_EQ(reference_ratio(w_sq[5], u_sq[5], hp), c.max_coeff);
        const double inside = reference_ratio(w_sq[7], u_sq[7], hp);
        EXPECT_TRUE(inside > c.min_coeff && inside < c.max_coeff) << inside;
      }
      // Phase 2 with these totals (one rank: the local sums are the tensor totals).
      const std::vector<float> m1(m.p, m.p + n), v1(v.p, v.p + n);
      lamb_apply(p.p, m.p, v.p, n, bounds.data(), segs, w_sq.data(), u_sq.data(), hp, c.step, o);
      EXPECT_EQ(std::vector<float>(m.p, m.p + n), m1) << "phase 2 wrote exp_avg: " << where(-1);
      EXPECT_EQ(std::vector<float>(v.p, v.p + n), v1) << "phase 2 wrote exp_avg_sq: " << where(-1);
      const double step_size =
          c.bias ? hp.lr * std::sqrt(1 - std::pow(hp.beta2, double(c.step))) / (1 - std::pow(hp.beta1, double(c.step)))
                 : hp.lr;
      for (int s = 0; s < segs; ++s) {
        const Tracked coef = constant(step_size * reference_ratio(w_sq[size_t(s)], u_sq[size_t(s)], hp));
        for (int64_t i = bounds[s]; i < bounds[s + 1]; ++i) {
          const Tracked u = lamb_update_reference(p0[size_t(i)], m1[size_t(i)], v1[size_t(i)], hp);
          cp.expect(i, p.p[i], sub(exact(p0[size_t(i)]), mul(coef, u)), [&] { return where(i); });
        }
      }
    }
  cm.finish(path());
  cv.finish(path());
  cw.finish(path());
  cu.finish(path());
  cp.finish(path());
}

// ------------------------------------------ bf16 / fp16 copies written in the same pass

// Values with a known rounding story: zeros, fp32 subnormals, bf16 subnormals, fp16
// subnormals and their ties (2^-25 rounds to 0, 3·2^-25 to 2^-23), the smallest fp16 normal,
// bf16 and fp16 ties around 1 (to even: down and up), fp16's largest value and what overflows
// it to inf (65520 is the tie), fp32's largest (inf in bf16 too), inf and NaN.
std::vector<float> special_values(bool finite_only) {
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> s{0.0f,          -0.0f,          0x1p-149f,       1e-40f,          -1e-39f,       0x1p-126f,
                       0x1p-24f,      0x1p-25f,       0x3p-25f,        -1e-6f,          0x1p-14f,      6.1e-5f,
                       1.0f + 0x1p-8f, 1.0f + 0x3p-8f, 1.0f + 0x1p-11f, -(1.0f + 0x3p-11f), 65504.0f,     65519.0f,
                       65520.0f,      -65536.0f,      1e5f,            3.0e38f,         std::numeric_limits<float>::max(),
                       -std::numeric_limits<float>::max(), 0.1f,       -3.14159265f};
  if (!finite_only) {
    s.push_back(inf);
    s.push_back(-inf);
    s.push_back(std::numeric_limits<float>::quiet_NaN());
  }
  return s;
}

bool half_is_nan(uint16_t h, HalfType t) {
  return t == HalfType::BF16 ? (h & 0x7fffu) > 0x7f80u : (h & 0x7fffu) > 0x7c00u;
}

// Every element of the 16-bit copy equals torch's round-to-nearest-even conversion of the
// fp32 master (a NaN only has to stay a NaN: torch and the kernels choose different payloads).
void expect_half_copy(const float* master, const uint16_t* half, int64_t n, HalfType t, const std::string& what) {
  const torch::Tensor want =
      torch::from_blob(const_cast<float*>(master), {n}, torch::kFloat32).to(t == HalfType::BF16 ? torch::kBFloat16 : torch::kHalf);
  const auto* w = reinterpret_cast<const uint16_t*>(want.data_ptr());
  int64_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const bool ok = std::isnan(master[i]) ? half_is_nan(half[i], t) : half[i] == w[i];
    if (!ok && ++bad <= 5)
      ADD_FAILURE() << what << (t == HalfType::BF16 ? " bf16" : " fp16") << " copy [" << i << "] of "
                    << ElementCheck::fmt(master[i]) << ": 0x" << std::hex << half[i] << ", torch 0x" << w[i] << std::dec;
  }
  EXPECT_EQ(bad, 0) << what << " n=" << n;
}

constexpr uint16_t kSentinel = 0x5a5a;
constexpr int64_t kGuard = 8;

struct HalfBuf {
  std::vector<uint16_t> store;
  uint16_t* p;
  explicit HalfBuf(int64_t n) : store(size_t(n + 2 * kGuard), kSentinel) { p = store.data() + kGuard; }
  bool guards_intact() const {
    for (int64_t i = 0; i < kGuard; ++i)
      if (store[size_t(i)] != kSentinel || store[store.size() - 1 - size_t(i)] != kSentinel) return false;
    return true;
  }
};

TEST_P(PerIsa, HalfCopiesEqualTorchRoundingOfTheUpdatedMaster) {
  for (HalfType ht : {HalfType::BF16, HalfType::FP16})
    for (int64_t n : kLengths) {
      const std::string tag = path() + " n=" + std::to_string(n);
      std::mt19937 rng(uint32_t(97 * n + int(ht)));
      // Even elements: special values with zero gradient and moments, so the update leaves them
      // exactly in place (weight decay 0); odd elements: random values of every magnitude
      // (up to 1e5, past fp16's range) with real updates.
      auto make = [&](bool finite_only, std::vector<float>& p, std::vector<float>& g, std::vector<float>& m,
                      std::vector<float>& v) {
        const std::vector<float> sv = special_values(finite_only);
        p.resize(size_t(n)), g.resize(size_t(n)), m.resize(size_t(n)), v.resize(size_t(n));
        std::uniform_real_distribution<float> big(-1e5f, 1e5f);
        for (int64_t i = 0; i < n; ++i) {
          if (i % 2 == 0) {
            p[size_t(i)] = sv[size_t((i / 2 + n) % int64_t(sv.size()))];
            g[size_t(i)] = m[size_t(i)] = v[size_t(i)] = 0.0f;
          } else {
            p[size_t(i)] = (i % 4 == 1) ? big(rng) : sample(rng);
            g[size_t(i)] = sample(rng);
            m[size_t(i)] = sample(rng);
            v[size_t(i)] = sample(rng, true);
          }
        }
      };
      std::vector<float> p, g, m, v;
      StepOptions with = options(n), without = options(n);
      HalfBuf half(n);
      with.half = ht;
      with.half_out = half.p;

      // Adam
      make(false, p, g, m, v);
      {
        std::vector<float> p2 = p, m2 = m, v2 = v, m1 = m, v1 = v;
        AdamHyperparameters hp;
        hp.weight_decay = 0.0;
        adam_step(p.data(), g.data(), m1.data(), v1.data(), n, hp, 3, with);
        adam_step(p2.data(), g.data(), m2.data(), v2.data(), n, hp, 3, without);
        EXPECT_TRUE(same_bits(p.data(), p2.data(), n)) << "adam master differs with a half copy: " << tag;
        expect_half_copy(p.data(), half.p, n, ht, "adam " + tag);
        EXPECT_TRUE(half.guards_intact()) << "adam wrote outside its half copy: " << tag;
      }
      // SGD with momentum, past the first step
      std::fill(half.p, half.p + n, kSentinel);
      make(false, p, g, m, v);
      {
        std::vector<float> p2 = p, b1 = m, b2 = m;
        const SgdHyperparameters hp{0.05, 0.9, 0.0, 0.0, true};
        sgd_step(p.data(), g.data(), b1.data(), n, hp, 3, with);
        sgd_step(p2.data(), g.data(), b2.data(), n, hp, 3, without);
        EXPECT_TRUE(same_bits(p.data(), p2.data(), n)) << "sgd master differs with a half copy: " << tag;
        expect_half_copy(p.data(), half.p, n, ht, "sgd " + tag);
        EXPECT_TRUE(half.guards_intact()) << "sgd wrote outside its half copy: " << tag;
      }
      // LAMB (finite values only: one inf or NaN would make its tensor's norm, and then every
      // element of the piece, non-finite), three pieces.
      std::fill(half.p, half.p + n, kSentinel);
      make(true, p, g, m, v);
      {
        const std::vector<int64_t> bounds{0, n / 3, n / 3 + n / 5, n};
        std::vector<float> p2 = p, m1 = m, v1 = v;
        LambHyperparameters hp;
        hp.weight_decay = 0.0;
        std::vector<double> w(3), u(3);
        lamb_partial_norms(p.data(), g.data(), m1.data(), v1.data(), n, bounds.data(), 3, hp, without, w.data(), u.data());
        lamb_apply(p.data(), m1.data(), v1.data(), n, bounds.data(), 3, w.data(), u.data(), hp, 3, with);
        lamb_apply(p2.data(), m1.data(), v1.data(), n, bounds.data(), 3, w.data(), u.data(), hp, 3, without);
        EXPECT_TRUE(same_bits(p.data(), p2.data(), n)) << "lamb master differs with a half copy: " << tag;
        expect_half_copy(p.data(), half.p, n, ht, "lamb " + tag);
        EXPECT_TRUE(half.guards_intact()) << "lamb wrote outside its half copy: " << tag;
      }
    }
}

// ------------------------------------------ ISA choice

std::optional<std::set<std::string>> cpuinfo_flags() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("flags", 0) != 0) continue;
    std::istringstream words(line.substr(line.find(':') + 1));
    std::set<std::string> out;
    for (std::string w; words >> w;) out.insert(w);
    return out;
  }
  return std::nullopt;
}

// Sets or clears an environment variable for one scope, restoring the caller's value after.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value) setenv(name, value, 1);
    else unsetenv(name);
  }
  ~ScopedEnv() {
    if (old_) setenv(name_, old_->c_str(), 1);
    else unsetenv(name_);
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

TEST(OptimKernels, DefaultPathIsTheWidestTheCpuHas) {
  const auto flags = cpuinfo_flags();
  if (!flags) GTEST_SKIP() << "no flags line in /proc/cpuinfo to compare the dispatcher with";
  auto has = [&](const char* f) { return flags->count(f) > 0; };
  const Isa widest = has("avx512f") && has("avx2") && has("fma") && has("f16c") ? Isa::Avx512
                     : has("avx2") && has("fma") && has("f16c")                 ? Isa::Avx2
                                                                                 : Isa::Scalar;
  ScopedEnv env("ZT_OPTIM_ISA", nullptr);
  EXPECT_EQ(best_isa(), widest) << "widest by /proc/cpuinfo: " << isa_name(widest);
  EXPECT_EQ(selected_isa(), widest);
  // A step without StepOptions::isa runs the widest path's code.
  EXPECT_EQ(observed_lanes(StepOptions{}), lanes(widest));
  std::printf("paths on this CPU:");
  for (Isa i : paths()) std::printf(" %s", isa_name(i));
  std::printf("; default: %s\n", isa_name(selected_isa()));
}

TEST(OptimKernels, EnvironmentForcesAPath) {
  {
    ScopedEnv env("ZT_OPTIM_ISA", "scalar");
    EXPECT_EQ(selected_isa(), Isa::Scalar);
    EXPECT_EQ(observed_lanes(StepOptions{}), 1);
  }
  {
    ScopedEnv env("ZT_OPTIM_ISA", "sse9");
    EXPECT_THROW(selected_isa(), std::runtime_error);
  }
  for (Isa isa : {Isa::Avx2, Isa::Avx512}) {
    ScopedEnv env("ZT_OPTIM_ISA", isa_name(isa));
    if (cpu_supports(isa)) {
      EXPECT_EQ(selected_isa(), isa);
      EXPECT_EQ(observed_lanes(StepOptions{}), lanes(isa));
    } else {
      EXPECT_THROW(selected_isa(), std::runtime_error);
      StepOptions forced;
      forced.isa = isa;
      EXPECT_THROW(observed_lanes(forced), std::runtime_error);
    }
  }
}

// ------------------------------------------ LAMB across ranks; torch::optim

TEST(OptimKernels, LambTrustRatioIsClampedAsDeepSpeed) {
  LambHyperparameters hp;
  EXPECT_DOUBLE_EQ(lamb_trust_ratio(4.0, 1.0, hp), 2.0);
  EXPECT_DOUBLE_EQ(lamb_trust_ratio(1e6, 1e-6, hp), 10.0);
  EXPECT_DOUBLE_EQ(lamb_trust_ratio(100.0, 1.0, hp), 10.0);
  EXPECT_DOUBLE_EQ(lamb_trust_ratio(1e-8, 1.0, hp), 0.01);
  EXPECT_DOUBLE_EQ(lamb_trust_ratio(1e-4, 1.0, hp), 0.01);
  EXPECT_DOUBLE_EQ(lamb_trust_ratio(0.0, 1.0, hp), 1.0);
  EXPECT_DOUBLE_EQ(lamb_trust_ratio(1.0, 0.0, hp), 1.0);
  hp.min_coeff = 0.5;
  hp.max_coeff = 3.0;
  EXPECT_DOUBLE_EQ(lamb_trust_ratio(100.0, 1.0, hp), 3.0);
  EXPECT_DOUBLE_EQ(lamb_trust_ratio(0.01, 1.0, hp), 0.5);
}

void lamb_local_step(float* p, const float* g, float* m, float* v, int64_t n, const std::vector<int64_t>& bounds,
                     const LambHyperparameters& hp, int64_t step, const StepOptions& o) {
  const int segs = int(bounds.size()) - 1;
  std::vector<double> w(segs), u(segs);
  lamb_partial_norms(p, g, m, v, n, bounds.data(), segs, hp, o, w.data(), u.data());
  lamb_apply(p, m, v, n, bounds.data(), segs, w.data(), u.data(), hp, step, o);
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

}  // namespace
