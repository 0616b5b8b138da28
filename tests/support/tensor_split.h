// This rank's slice of a whole tensor, cut as zt::mark_tensor_split describes (zerotrain/zero/blocks.h
// TensorSplit): `parts` equal parts along `dim`, each cut into the group's ranks, slice r being
// every part's r-th piece. For comparing a split model's parameters with an unsplit one's.
#pragma once
#include <ATen/ATen.h>

#include <vector>

#include "zerotrain/zero/blocks.h"
#include "zerotrain/comm/comm.h"

namespace zt::testing {

inline at::Tensor slice_of(const at::Tensor& whole, const TensorSplit& split) {
  const int64_t T = split.group->world_size(), r = split.group->rank();
  std::vector<at::Tensor> pieces;
  for (const at::Tensor& part : whole.chunk(split.parts, split.dim)) {
    const int64_t n = part.size(split.dim) / T;
    pieces.push_back(part.narrow(split.dim, n * r, n));
  }
  return at::cat(pieces, split.dim);
}

}  // namespace zt::testing
