// Where the elements of a tensor-parallel slice lie in the whole tensor, so that a checkpoint
// saved with tensor groups of one size loads with another (docs/checkpoint.md "Tensor-parallel
// slices"). Internal to the checkpoint layer.
//
// A tensor of `shape` split along `dim` into `parts` equal parts (QKV: 3), each part cut into
// `ranks` equal chunks: slice r is the r-th chunk of every part, concatenated along `dim`
// (zerotrain/zero/blocks.h TensorSplit). Viewing the tensor as [outer, extent, inner] around `dim`, a
// slice is outer × parts runs of chunk × inner elements, each contiguous in the slice and in the
// whole tensor. A saved split parameter is the concatenation of its slices' flattened elements
// in rank order; ranks = 1 is the whole tensor.
//
// Plain values; every function is pure and thread-safe.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace zt {

struct SliceLayout {
  std::vector<int64_t> shape;  // the whole tensor's
  int64_t dim = 0, parts = 1, ranks = 1;
  int64_t outer = 1, extent = 1, inner = 1;  // the whole tensor as [outer, extent, inner] around dim

  bool whole() const { return ranks == 1; }
  int64_t numel() const { return outer * extent * inner; }
  int64_t slice_numel() const { return numel() / ranks; }
  bool same_slices(const SliceLayout& other) const;  // the same cut (any two whole layouts are)
};

// The layout, or an empty `problem` saying why there is none (a dimension the shape lacks, a part
// or rank count below 1, an extent that parts × ranks does not divide).
SliceLayout slice_layout(const std::vector<int64_t>& shape, int64_t dim, int64_t parts, int64_t ranks,
                         std::string& problem);

// run(local, whole, count): elements [local, local + count) of slice `rank` are whole elements
// [whole, whole + count); called for [lo, hi) of the slice in increasing order.
using SliceRun = std::function<void(int64_t local, int64_t whole, int64_t count)>;
void for_each_slice_run(const SliceLayout& layout, int64_t rank, int64_t lo, int64_t hi, const SliceRun& run);

// run(rank, local, whole, count): whole elements [whole, whole + count) are elements [local,
// local + count) of slice `rank`; called for whole elements [lo, hi) in increasing order.
using WholeRun = std::function<void(int64_t rank, int64_t local, int64_t whole, int64_t count)>;
void for_each_whole_run(const SliceLayout& layout, int64_t lo, int64_t hi, const WholeRun& run);

}  // namespace zt
