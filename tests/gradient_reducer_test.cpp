#include "zero/gradient_reducer.h"

#include "support/counting_allocator.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <iostream>

namespace {

// The global gradient norm's sum of squares over a partition of GPT-2 124M's size. A single fp32
// reduction lost the small squares once its running sum had grown (0.4% low at 124M elements on
// one thread), which changed the clipping and so the training; the sum must be good to double
// precision's use here, whatever the values' spread.
TEST(GradientReducerNorm, SquareSumOfALargePartitionMatchesDoublePrecision) {
  const int threads = at::get_num_threads();
  at::set_num_threads(1);  // as a training rank runs: the whole range in one reduction
  torch::manual_seed(5);
  const int64_t n = (int64_t{1} << 25) + 12345;  // whole rows and a tail
  // Mostly small values with a few large ones, as gradients are: the case that loses precision.
  at::Tensor g = torch::randn({n}) * 1e-3;
  g.narrow(0, 0, 1000).mul_(1e3);
  const double reference = g.to(torch::kFloat64).square().sum().item<double>();
  const double single_fp32 = std::pow(torch::linalg_vector_norm(g, 2, c10::nullopt, false, torch::kFloat32).item<double>(), 2);
  const double got = zt::GradientReducer::square_sum(g);
  at::set_num_threads(threads);
  std::cout << "reference " << reference << ", one fp32 reduction " << single_fp32 << " ("
            << (single_fp32 - reference) / reference << "), square_sum " << got << " (" << (got - reference) / reference
            << ")\n";
  EXPECT_NEAR(got, reference, 1e-6 * reference);
  // bf16 gradients (mixed precision) are read as fp32 the same way.
  const at::Tensor b = g.to(torch::kBFloat16);
  const double reference_b = b.to(torch::kFloat64).square().sum().item<double>();
  EXPECT_NEAR(zt::GradientReducer::square_sum(b), reference_b, 1e-6 * reference_b);
  // Short and empty tensors: the tail alone.
  const at::Tensor short_one = torch::tensor({3.0f, 4.0f});
  EXPECT_DOUBLE_EQ(zt::GradientReducer::square_sum(short_one), 25.0);
  EXPECT_EQ(zt::GradientReducer::square_sum(torch::zeros({0})), 0.0);
}

}  // namespace

// 16-bit gradients are converted to fp32 before LibTorch reduces them; converted whole, a bucket's
// fp32 copy was the step's largest temporary (249 MB per rank for GPT-2 124M's bf16 gradients at
// stage 2). square_sum converts a chunk of rows at a time, and the result is the one a single
// conversion gives, bit for bit (each row's norm is computed alike).
TEST(GradientReducerNorm, SixteenBitGradientsAreNotCopiedWholeToFp32) {
  torch::manual_seed(6);
  const int64_t n = (int64_t{1} << 23) + 777;  // 8 M elements: eight chunks and a tail
  const at::Tensor b = (torch::randn({n}) * 1e-2).to(torch::kBFloat16);
  const int64_t whole = n / 1024 * 1024;
  const at::Tensor one_call_norms =
      torch::linalg_vector_norm(b.narrow(0, 0, whole).view({whole / 1024, 1024}), 2, {1}, false, torch::kFloat32);
  const double tail = torch::linalg_vector_norm(b.narrow(0, whole, n - whole), 2, c10::nullopt, false,
                                                torch::kFloat32)
                          .item<double>();
  const double one_call = one_call_norms.to(torch::kFloat64).square().sum().item<double>() + tail * tail;

  auto& counter = zt::testing::CountingAllocator::instance();
  counter.install();
  const double got = zt::GradientReducer::square_sum(b);
  const int64_t peak = counter.peak();
  counter.uninstall();
  EXPECT_EQ(got, one_call);
  // A whole fp32 copy would be 32 MiB; a chunk of rows is 4 MiB, the rows' norms 32 KiB.
  EXPECT_LT(peak, n * 4 / 4) << "square_sum held " << peak << " bytes for " << n << " bf16 elements";
}
