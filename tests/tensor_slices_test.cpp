// Where a tensor-parallel slice's elements lie in the whole tensor (checkpoint/tensor_slices.h):
// for tensors cut along each dimension, in one part or three (QKV), over 1 to 4 ranks, the runs
// of every slice are exactly the elements torch's chunk/narrow/cat give that slice (the cut the
// split models make), the whole tensor's runs name the same places back, and bad cuts are named.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "checkpoint/tensor_slices.h"

namespace {

// Slice `rank` of `whole` cut as the split models cut it (zerotrain/zero/blocks.h TensorSplit).
at::Tensor slice_of(const at::Tensor& whole, int64_t dim, int64_t parts, int64_t ranks, int64_t rank) {
  std::vector<at::Tensor> pieces;
  for (const at::Tensor& part : whole.chunk(parts, dim)) {
    const int64_t n = part.size(dim) / ranks;
    pieces.push_back(part.narrow(dim, n * rank, n));
  }
  return torch::cat(pieces, dim).contiguous();
}

struct Cut {
  std::vector<int64_t> shape;
  int64_t dim, parts, ranks;
};

TEST(TensorSlices, RunsAreTheElementsOfEachSlice) {
  const std::vector<Cut> cuts = {{{12, 5}, 0, 1, 2}, {{12, 5}, 0, 3, 2}, {{5, 12}, 1, 1, 4}, {{6, 4, 6}, 1, 1, 2},
                                 {{6, 4, 6}, 2, 3, 2}, {{24}, 0, 3, 4},    {{12, 5}, 0, 3, 1}, {{7, 3}, 1, 1, 3}};
  for (const Cut& cut : cuts) {
    SCOPED_TRACE(::testing::Message() << "shape " << at::IntArrayRef(cut.shape) << " dim " << cut.dim << " parts "
                                      << cut.parts << " ranks " << cut.ranks);
    std::string problem;
    const zt::SliceLayout layout = zt::slice_layout(cut.shape, cut.dim, cut.parts, cut.ranks, problem);
    ASSERT_EQ(problem, "");
    int64_t numel = 1;
    for (int64_t d : cut.shape) numel *= d;
    const at::Tensor whole = torch::arange(numel, torch::kLong).view(cut.shape);
    std::vector<int> seen(size_t(numel), 0);
    for (int64_t rank = 0; rank < cut.ranks; ++rank) {
      const at::Tensor expected = slice_of(whole, cut.dim, cut.parts, cut.ranks, rank).view({-1});
      ASSERT_EQ(expected.numel(), layout.slice_numel());
      // The slice's runs, from an odd starting element to one before the end: each element once.
      const int64_t lo = expected.numel() > 2 ? 1 : 0, hi = expected.numel() - (expected.numel() > 2 ? 1 : 0);
      int64_t next = lo;
      zt::for_each_slice_run(layout, rank, lo, hi, [&](int64_t local, int64_t at, int64_t count) {
        EXPECT_EQ(local, next);
        next = local + count;
        for (int64_t i = 0; i < count; ++i) EXPECT_EQ(expected[local + i].item<int64_t>(), at + i) << "element " << local + i;
      });
      EXPECT_EQ(next, hi);
      // And back: the whole tensor's runs name this slice's elements where they are.
      for (int64_t local = 0; local < expected.numel(); ++local) ++seen[size_t(expected[local].item<int64_t>())];
    }
    for (int64_t w = 0; w < numel; ++w) ASSERT_EQ(seen[size_t(w)], 1) << "whole element " << w;
    int64_t next = 3;
    zt::for_each_whole_run(layout, 3, numel, [&](int64_t rank, int64_t local, int64_t at, int64_t count) {
      EXPECT_EQ(at, next);
      next = at + count;
      const at::Tensor slice = slice_of(whole, cut.dim, cut.parts, cut.ranks, rank).view({-1});
      for (int64_t i = 0; i < count; ++i) EXPECT_EQ(slice[local + i].item<int64_t>(), at + i);
    });
    EXPECT_EQ(next, numel);
  }
}

TEST(TensorSlices, WholeIsOneRunAndSameSlicesCompareTheCut) {
  std::string problem;
  const zt::SliceLayout whole = zt::slice_layout({4, 6}, 1, 3, 1, problem);
  ASSERT_EQ(problem, "");
  int runs = 0;
  zt::for_each_slice_run(whole, 0, 2, 20, [&](int64_t local, int64_t at, int64_t count) {
    EXPECT_EQ(local, 2);
    EXPECT_EQ(at, 2);
    EXPECT_EQ(count, 18);
    ++runs;
  });
  EXPECT_EQ(runs, 1);
  const zt::SliceLayout rows = zt::slice_layout({4, 6}, 0, 1, 2, problem);
  const zt::SliceLayout columns = zt::slice_layout({4, 6}, 1, 1, 2, problem);
  EXPECT_TRUE(whole.same_slices(zt::slice_layout({4, 6}, 0, 1, 1, problem)));
  EXPECT_FALSE(rows.same_slices(columns));
  EXPECT_FALSE(rows.same_slices(whole));
  EXPECT_TRUE(rows.same_slices(zt::slice_layout({4, 6}, 0, 1, 2, problem)));
}

TEST(TensorSlices, BadCutsAreNamed) {
  std::string problem;
  zt::slice_layout({4, 6}, 2, 1, 2, problem);
  EXPECT_NE(problem.find("expected a split dimension below 2, found 2"), std::string::npos) << problem;
  zt::slice_layout({4, 6}, 1, 3, 4, problem);
  EXPECT_NE(problem.find("expected dimension 1 (6) to split into 3 parts of 4 equal slices"), std::string::npos)
      << problem;
  zt::slice_layout({4, 6}, 0, 0, 2, problem);
  EXPECT_NE(problem.find("expected at least one part and one rank, found 0 and 2"), std::string::npos) << problem;
}

}  // namespace
