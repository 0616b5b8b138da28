// Device (CUDA) optimizer kernels (src/optim/device_kernels.h) against the CPU kernels
// (src/optim/cpu_kernels.h) on the same inputs: Adam/AdamW, SGD, LAMB's two phases and the sum of
// squares of the global norm, with fp32/bf16/fp16 gradients and bf16/fp16 copies of the result.
//
// Tolerance, per element: |device − cpu| ≤ 1e-6·(|cpu| + the median |cpu| of that array). The
// device kernels repeat the CPU vector bodies' operations in the same order with the same fmas, so
// those elements should agree bit for bit; the CPU's scalar tails (the last n mod 8 or 16 elements of a
// range) are ordinary C++ that the compiler may contract differently, which moves a result by an
// ulp or two of its largest term. The median term covers such an element where the result
// cancels towards zero (p − update, b1·m + (1−b1)·g of opposite signs); any systematic error
// above 1e-6 relative on the elements of typical size still fails. LAMB's per-piece sums of squares: 1e-6 relative (the CPU
// accumulates chains of at most 512 squares in fp32, typically ~1e-7 off; the device sums in
// double). square_sum: 1e-9 relative of a double-precision sum on the host (both sum in double,
// in different orders). bf16/fp16 copies: bit for bit torch's rounding of the device's own fp32
// result.
//
// Without a CUDA device (every CPU machine, and the CPU build, whose LibTorch has no CUDA) the
// device tests skip. DeviceKernels.BuildFlagAndStubs runs everywhere.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "optim/cpu_kernels.h"
#include "optim/device_kernels.h"
#include "zerotrain/error.h"

namespace {

using namespace zt::optim;

constexpr double kRel = 1e-6;
constexpr double kSquareSumRel = 1e-9;

// Runs whenever LibTorch sees a CUDA device in a ZT_CUDA build (ZT_TEST_DEVICE=cuda is how the GPU
// check asks for one); otherwise skips, as the device-parity tests do (tests/support/device.h).
#define REQUIRE_CUDA_DEVICE()                                                 \
  do {                                                                        \
    if (!device_kernels_built() || !torch::cuda::is_available())              \
      GTEST_SKIP() << "no CUDA device (ZT_TEST_DEVICE=cuda runs this on a GPU)"; \
  } while (0)

const std::vector<int64_t> kSizes = {4099, 300007};
const DeviceGradType kGradTypes[] = {DeviceGradType::F32, DeviceGradType::BF16, DeviceGradType::F16};
const HalfType kHalfTypes[] = {HalfType::None, HalfType::BF16, HalfType::FP16};

const char* name(DeviceGradType t) {
  return t == DeviceGradType::F32 ? "f32" : t == DeviceGradType::BF16 ? "bf16" : "f16";
}
const char* name(HalfType t) { return t == HalfType::None ? "none" : t == HalfType::BF16 ? "bf16" : "fp16"; }

torch::Dtype dtype(DeviceGradType t) {
  return t == DeviceGradType::F32 ? torch::kFloat : t == DeviceGradType::BF16 ? torch::kBFloat16 : torch::kHalf;
}
torch::Dtype dtype(HalfType t) { return t == HalfType::BF16 ? torch::kBFloat16 : torch::kHalf; }

torch::Tensor cuda(const torch::Tensor& t) { return t.to(torch::kCUDA).contiguous(); }

// Gradients in `type`: the device reads them as they are, the CPU kernels their exact fp32 widening.
struct Grads {
  torch::Tensor cpu_f32, device;
};
Grads make_grads(int64_t n, DeviceGradType type, double scale) {
  torch::Tensor g = (torch::randn({n}) * scale).to(dtype(type));
  g[0] = 0.0;  // an exact zero
  return {g.to(torch::kFloat).contiguous(), cuda(g)};
}

// Parameters spanning several magnitudes, with values that overflow fp16 and ones that are fp16
// subnormals, so that the half copies see their edge cases.
torch::Tensor make_params(int64_t n) {
  torch::Tensor p = torch::randn({n});
  p.slice(0, 0, n / 8).mul_(1e-3);
  p.slice(0, n / 8, n / 4).mul_(30.0);
  p[1] = 0.0;
  p[2] = 7.0e4;
  p[3] = -1.0e5;
  p[4] = 3.0e-6;
  return p.contiguous();
}

// relative_only: the bound is 1e-6·|cpu| alone (sums of squares, which do not cancel).
void expect_close(const torch::Tensor& cpu, const torch::Tensor& dev, const std::string& what,
                  bool relative_only = false) {
  const torch::Tensor c = cpu.to(torch::kCPU, torch::kDouble).contiguous();
  const torch::Tensor d = dev.to(torch::kCPU, torch::kDouble).contiguous();
  ASSERT_EQ(c.numel(), d.numel()) << what;
  const double* cp = c.data_ptr<double>();
  const double* dp = d.data_ptr<double>();
  const int64_t n = c.numel();
  const double median = relative_only ? 0.0 : c.abs().median().item<double>();
  int64_t bad = 0, worst_i = -1, identical = 0;
  double worst = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double err = std::abs(dp[i] - cp[i]);
    const double bound = kRel * (std::abs(cp[i]) + median);
    if (dp[i] == cp[i]) ++identical;
    if (!(err <= bound)) {
      ++bad;
      if (worst_i < 0 || !(err / std::max(bound, 1e-300) <= worst)) {
        worst = err / std::max(bound, 1e-300);
        worst_i = i;
      }
    }
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << n << " elements outside the tolerance; worst at " << worst_i
                    << ": cpu " << (worst_i >= 0 ? cp[worst_i] : 0.0) << ", device "
                    << (worst_i >= 0 ? dp[worst_i] : 0.0) << " (" << identical << " bitwise identical)";
}

// The device's half copy must be torch's RNE rounding of the device's own fp32 result.
void expect_half_of(const torch::Tensor& dev_half, const torch::Tensor& dev_p, HalfType h, const std::string& what) {
  const torch::Tensor want = dev_p.to(torch::kCPU).to(dtype(h)).view(torch::kShort);
  const torch::Tensor got = dev_half.to(torch::kCPU).view(torch::kShort);
  const int64_t differ = got.ne(want).sum().item<int64_t>();
  EXPECT_EQ(differ, 0) << what << ": " << differ << " half-copy elements differ from the rounded fp32 result";
}

struct HalfBuffers {
  torch::Tensor cpu, device;
  uint16_t* cpu_ptr() const { return cpu.defined() ? reinterpret_cast<uint16_t*>(cpu.data_ptr()) : nullptr; }
  uint16_t* device_ptr() const {
    return device.defined() ? reinterpret_cast<uint16_t*>(device.data_ptr()) : nullptr;
  }
};
HalfBuffers make_half(int64_t n, HalfType h) {
  if (h == HalfType::None) return {};
  return {torch::zeros({n}, dtype(h)), torch::zeros({n}, torch::TensorOptions().dtype(dtype(h)).device(torch::kCUDA))};
}

StepOptions cpu_options(float grad_scale, HalfType h, uint16_t* out) {
  StepOptions o;
  o.grad_scale = grad_scale;
  o.isa = best_isa();  // the vector paths use FMA like the device
  o.half = h;
  o.half_out = out;
  return o;
}
DeviceStepOptions device_options(float grad_scale, DeviceGradType t, HalfType h, uint16_t* out) {
  DeviceStepOptions o;
  o.grad_scale = grad_scale;
  o.grad_type = t;
  o.half = h;
  o.half_out = out;
  o.stream = nullptr;  // the legacy default stream, which torch's current stream is here
  return o;
}

// ---- Adam / AdamW -----------------------------------------------------------------------------

TEST(DeviceKernels, AdamMatchesCpu) {
  REQUIRE_CUDA_DEVICE();
  torch::manual_seed(1);
  for (const int64_t n : kSizes)
    for (const bool decoupled : {true, false})
      for (const DeviceGradType gt : kGradTypes)
        for (const HalfType ht : kHalfTypes) {
          std::ostringstream label;
          label << "adam n=" << n << (decoupled ? " adamw" : " adam-l2") << " grads=" << name(gt)
                << " half=" << name(ht);
          AdamHyperparameters hp;
          hp.lr = 1e-2;
          hp.weight_decay = 0.05;
          hp.decoupled_weight_decay = decoupled;
          hp.bias_correction = !(gt == DeviceGradType::F16 && ht == HalfType::None);  // both settings seen
          torch::Tensor p = make_params(n), m = torch::zeros({n}), v = torch::zeros({n});
          torch::Tensor dp = cuda(p), dm = cuda(m), dv = cuda(v);
          const HalfBuffers half = make_half(n, ht);
          for (int64_t step = 1; step <= 3; ++step) {
            const Grads g = make_grads(n, gt, 2.0);
            const float gs = 0.5f;
            adam_step(p.data_ptr<float>(), g.cpu_f32.data_ptr<float>(), m.data_ptr<float>(), v.data_ptr<float>(), n,
                      hp, step, cpu_options(gs, ht, half.cpu_ptr()));
            adam_step_device(dp.data_ptr<float>(), g.device.data_ptr(), dm.data_ptr<float>(), dv.data_ptr<float>(), n,
                             hp, step, device_options(gs, gt, ht, half.device_ptr()));
            torch::cuda::synchronize();
            const std::string at = label.str() + " step " + std::to_string(step);
            expect_close(p, dp, at + " p");
            expect_close(m, dm, at + " m");
            expect_close(v, dv, at + " v");
            if (ht != HalfType::None) expect_half_of(half.device, dp, ht, at);
            if (HasFailure()) return;
          }
        }
}

// ---- SGD ----------------------------------------------------------------------------------------

TEST(DeviceKernels, SgdMatchesCpu) {
  REQUIRE_CUDA_DEVICE();
  torch::manual_seed(2);
  struct Case {
    const char* what;
    double momentum, dampening, weight_decay;
    bool nesterov;
  };
  const Case cases[] = {{"plain", 0.0, 0.0, 0.0, false},
                        {"plain+wd", 0.0, 0.0, 1e-2, false},
                        {"momentum+dampening+wd", 0.9, 0.1, 1e-2, false},
                        {"nesterov", 0.9, 0.0, 0.0, true},
                        {"nesterov+wd", 0.8, 0.0, 5e-3, true}};
  int variant = 0;
  for (const int64_t n : kSizes)
    for (const Case& k : cases)
      for (const DeviceGradType gt : kGradTypes) {
        const HalfType ht = kHalfTypes[variant++ % 3];
        std::ostringstream label;
        label << "sgd " << k.what << " n=" << n << " grads=" << name(gt) << " half=" << name(ht);
        SgdHyperparameters hp;
        hp.lr = 0.05;
        hp.momentum = k.momentum;
        hp.dampening = k.dampening;
        hp.weight_decay = k.weight_decay;
        hp.nesterov = k.nesterov;
        torch::Tensor p = make_params(n), buf = torch::zeros({n});
        torch::Tensor dp = cuda(p), dbuf = cuda(buf);
        const bool momentum = k.momentum != 0.0;
        const HalfBuffers half = make_half(n, ht);
        for (int64_t step = 1; step <= 2; ++step) {  // step 1 initialises the buffer, step 2 uses it
          const Grads g = make_grads(n, gt, 1.0);
          const float gs = 0.25f;
          sgd_step(p.data_ptr<float>(), g.cpu_f32.data_ptr<float>(), momentum ? buf.data_ptr<float>() : nullptr, n, hp,
                   step, cpu_options(gs, ht, half.cpu_ptr()));
          sgd_step_device(dp.data_ptr<float>(), g.device.data_ptr(), momentum ? dbuf.data_ptr<float>() : nullptr, n, hp,
                          step, device_options(gs, gt, ht, half.device_ptr()));
          torch::cuda::synchronize();
          const std::string at = label.str() + " step " + std::to_string(step);
          expect_close(p, dp, at + " p");
          if (momentum) expect_close(buf, dbuf, at + " momentum buffer");
          if (ht != HalfType::None) expect_half_of(half.device, dp, ht, at);
          if (HasFailure()) return;
        }
      }
}

// ---- LAMB ---------------------------------------------------------------------------------------

TEST(DeviceKernels, LambMatchesCpu) {
  REQUIRE_CUDA_DEVICE();
  torch::manual_seed(3);
  // Pieces: one element, an empty piece, small, a zero padding piece, a piece of large weights
  // (ratio clamped high), one of tiny weights (clamped low), and the rest; longer pieces span
  // several device blocks.
  const int64_t n = 300007;
  const std::vector<int64_t> bounds = {0, 1, 1, 4099, 24099, 94100, 97433, n};
  const int segments = int(bounds.size()) - 1;
  LambHyperparameters hp;
  hp.lr = 1e-2;
  hp.weight_decay = 0.01;
  hp.min_coeff = 0.05;
  hp.max_coeff = 5.0;
  int variant = 0;
  for (const DeviceGradType gt : kGradTypes) {
    for (const float gs : {1.0f, 0.125f}) {
      const HalfType ht = kHalfTypes[variant++ % 3];
      std::ostringstream label;
      label << "lamb grads=" << name(gt) << " grad_scale=" << gs << " half=" << name(ht);
      torch::Tensor p = make_params(n), m = torch::zeros({n}), v = torch::zeros({n});
      p.slice(0, bounds[3], bounds[4]).zero_();        // padding: ‖p‖ = 0
      p.slice(0, bounds[4], bounds[5]).mul_(1e3);      // ‖p‖/‖u‖ large
      p.slice(0, bounds[5], bounds[6]).mul_(1e-6);     // ‖p‖/‖u‖ small
      torch::Tensor dp = cuda(p), dm = cuda(m), dv = cuda(v);
      const HalfBuffers half = make_half(n, ht);
      for (int64_t step = 1; step <= 2; ++step) {
        Grads g = make_grads(n, gt, 1.0);
        g.cpu_f32.slice(0, bounds[3], bounds[4]).zero_();  // padding has no gradient: ‖u‖ = 0
        g.device.slice(0, bounds[3], bounds[4]).zero_();
        std::vector<double> w(segments), u(segments);
        lamb_partial_norms(p.data_ptr<float>(), g.cpu_f32.data_ptr<float>(), m.data_ptr<float>(), v.data_ptr<float>(),
                           n, bounds.data(), segments, hp, cpu_options(gs, HalfType::None, nullptr), w.data(),
                           u.data());
        torch::Tensor dw = torch::full({segments}, -1.0, torch::TensorOptions().dtype(torch::kDouble).device(torch::kCUDA));
        torch::Tensor du = dw.clone();
        {
          // A copy of the bounds that dies at once: the device must not read the host array later.
          std::vector<int64_t> transient = bounds;
          lamb_partial_norms_device(dp.data_ptr<float>(), g.device.data_ptr(), dm.data_ptr<float>(),
                                    dv.data_ptr<float>(), n, transient.data(), segments, hp,
                                    device_options(gs, gt, HalfType::None, nullptr), dw.data_ptr<double>(),
                                    du.data_ptr<double>());
          std::fill(transient.begin(), transient.end(), int64_t(-7));
        }
        torch::cuda::synchronize();
        const std::string at = label.str() + " step " + std::to_string(step);
        expect_close(m, dm, at + " m");
        expect_close(v, dv, at + " v");
        const torch::Tensor cw = torch::tensor(w, torch::kDouble), cu = torch::tensor(u, torch::kDouble);
        expect_close(cw, dw, at + " sum p²", true);
        expect_close(cu, du, at + " sum u²", true);
        EXPECT_EQ(dw.cpu()[1].item<double>(), 0.0) << at << ": the empty piece";
        EXPECT_EQ(du.cpu()[3].item<double>(), 0.0) << at << ": the padding piece";

        // Every branch of the trust ratio is taken: 1 for a zero norm, both clamps, and inside.
        bool low = false, high = false, one = false, inside = false;
        for (int s = 0; s < segments; ++s) {
          const double r = lamb_trust_ratio(w[s], u[s], hp);
          low |= r == hp.min_coeff;
          high |= r == hp.max_coeff;
          one |= w[s] == 0.0 || u[s] == 0.0;
          inside |= r > hp.min_coeff && r < hp.max_coeff && w[s] != 0.0 && u[s] != 0.0;
        }
        EXPECT_TRUE(low && high && one && inside)
            << at << ": test inputs no longer reach every trust-ratio branch (low " << low << ", high " << high
            << ", zero " << one << ", inside " << inside << ")";

        // Phase 2 from the same totals (the CPU's, as after an all-reduce) on both sides.
        lamb_apply(p.data_ptr<float>(), m.data_ptr<float>(), v.data_ptr<float>(), n, bounds.data(), segments, w.data(),
                   u.data(), hp, step, cpu_options(gs, ht, half.cpu_ptr()));
        const torch::Tensor tw = cuda(cw), tu = cuda(cu);
        lamb_apply_device(dp.data_ptr<float>(), dm.data_ptr<float>(), dv.data_ptr<float>(), n, bounds.data(), segments,
                          tw.data_ptr<double>(), tu.data_ptr<double>(), hp, step,
                          device_options(gs, gt, ht, half.device_ptr()));
        torch::cuda::synchronize();
        expect_close(p, dp, at + " p");
        if (ht != HalfType::None) expect_half_of(half.device, dp, ht, at);
        if (HasFailure()) return;
      }
    }
  }
}

TEST(DeviceKernels, LambSumsAreDeterministic) {
  REQUIRE_CUDA_DEVICE();
  torch::manual_seed(4);
  const int64_t n = 200003;
  const std::vector<int64_t> bounds = {0, 70000, 70000, n};
  const int segments = 3;
  LambHyperparameters hp;
  const torch::Tensor p = cuda(torch::randn({n})), g = cuda(torch::randn({n})), m0 = cuda(torch::randn({n}) * 0.1),
                      v0 = cuda(torch::rand({n}) * 0.01);
  std::vector<torch::Tensor> sums;
  for (int run = 0; run < 2; ++run) {
    torch::Tensor m = m0.clone(), v = v0.clone();
    torch::Tensor w = torch::empty({segments}, torch::TensorOptions().dtype(torch::kDouble).device(torch::kCUDA));
    torch::Tensor u = torch::empty_like(w);
    lamb_partial_norms_device(p.data_ptr<float>(), g.data_ptr(), m.data_ptr<float>(), v.data_ptr<float>(), n,
                              bounds.data(), segments, hp, DeviceStepOptions{}, w.data_ptr<double>(),
                              u.data_ptr<double>());
    sums.push_back(torch::cat({w, u}).cpu());
  }
  EXPECT_TRUE(torch::equal(sums[0], sums[1])) << sums[0] << " vs " << sums[1];
}

// ---- square_sum ---------------------------------------------------------------------------------

TEST(DeviceKernels, SquareSumMatchesHost) {
  REQUIRE_CUDA_DEVICE();
  torch::manual_seed(5);
  for (const int64_t n : {int64_t(1), int64_t(4099), int64_t(300007), int64_t(3000001)})
    for (const DeviceGradType t : kGradTypes) {
      const torch::Tensor x = (torch::randn({n}) * 3.0).to(dtype(t));
      const torch::Tensor xf = x.to(torch::kDouble);
      const double want = 1.5 + 2.0 * (xf * xf).sum().item<double>();
      torch::Tensor out = torch::full({1}, 1.5, torch::TensorOptions().dtype(torch::kDouble).device(torch::kCUDA));
      const torch::Tensor dx = cuda(x);
      // Called twice: each call adds to *out.
      square_sum_device(dx.data_ptr(), t, n, out.data_ptr<double>(), nullptr);
      square_sum_device(dx.data_ptr(), t, n, out.data_ptr<double>(), nullptr);
      torch::cuda::synchronize();
      const double got = out.cpu().item<double>();
      EXPECT_LE(std::abs(got - want), kSquareSumRel * std::abs(want))
          << "square_sum n=" << n << " type=" << name(t) << ": device " << got << ", host " << want;
    }
  // n = 0 adds nothing.
  torch::Tensor out = torch::full({1}, 2.5, torch::TensorOptions().dtype(torch::kDouble).device(torch::kCUDA));
  square_sum_device(nullptr, DeviceGradType::F32, 0, out.data_ptr<double>(), nullptr);
  EXPECT_EQ(out.cpu().item<double>(), 2.5);
}

// ---- everywhere ---------------------------------------------------------------------------------

TEST(DeviceKernels, BuildFlagAndStubs) {
#ifdef ZT_CUDA
  EXPECT_TRUE(device_kernels_built());
  if (!torch::cuda::is_available()) {
    // No device (or driver): the real kernels report CUDA's error as zt::Error before touching memory.
    float x[8] = {};
    EXPECT_THROW(adam_step_device(x, x, x, x, 8, AdamHyperparameters{}, 1, DeviceStepOptions{}), zt::Error);
  }
#else
  EXPECT_FALSE(device_kernels_built());
  float x[8] = {};
  double d[2] = {};
  const int64_t bounds[2] = {0, 8};
  const DeviceStepOptions o;
  auto expect_no_cuda = [](const char* fn, auto&& call) {
    try {
      call();
      ADD_FAILURE() << fn << " did not throw in a build without CUDA";
    } catch (const zt::Error& e) {
      EXPECT_NE(std::string(e.what()).find("built without CUDA"), std::string::npos) << fn << ": " << e.what();
      EXPECT_NE(std::string(e.what()).find(fn), std::string::npos) << e.what();
    }
  };
  expect_no_cuda("adam_step_device", [&] { adam_step_device(x, x, x, x, 8, AdamHyperparameters{}, 1, o); });
  expect_no_cuda("sgd_step_device", [&] { sgd_step_device(x, x, x, 8, SgdHyperparameters{}, 1, o); });
  expect_no_cuda("lamb_partial_norms_device",
                 [&] { lamb_partial_norms_device(x, x, x, x, 8, bounds, 1, LambHyperparameters{}, o, d, d + 1); });
  expect_no_cuda("lamb_apply_device",
                 [&] { lamb_apply_device(x, x, x, 8, bounds, 1, d, d + 1, LambHyperparameters{}, 1, o); });
  expect_no_cuda("square_sum_device", [&] { square_sum_device(x, DeviceGradType::F32, 8, d, nullptr); });
#endif
}

}  // namespace
