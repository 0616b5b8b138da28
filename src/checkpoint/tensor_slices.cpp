#include "checkpoint/tensor_slices.h"

#include <algorithm>

namespace zt {

bool SliceLayout::same_slices(const SliceLayout& other) const {
  if (whole() || other.whole()) return whole() == other.whole();
  return ranks == other.ranks && dim == other.dim && parts == other.parts && shape == other.shape;
}

SliceLayout slice_layout(const std::vector<int64_t>& shape, int64_t dim, int64_t parts, int64_t ranks,
                         std::string& problem) {
  SliceLayout layout;
  layout.shape = shape;
  problem.clear();
  if (ranks < 1 || parts < 1) {
    problem = "expected at least one part and one rank, found " + std::to_string(parts) + " and " + std::to_string(ranks);
    return layout;
  }
  if (ranks == 1) {
    // The whole tensor: one run (the cut does not matter).
    for (int64_t d : shape) layout.inner *= d;
    return layout;
  }
  if (dim < 0 || dim >= int64_t(shape.size())) {
    problem = "expected a split dimension below " + std::to_string(shape.size()) + ", found " + std::to_string(dim);
    return layout;
  }
  layout.dim = dim, layout.parts = parts, layout.ranks = ranks;
  for (int64_t d = 0; d < int64_t(shape.size()); ++d) {
    if (d < dim) layout.outer *= shape[size_t(d)];
    else if (d > dim) layout.inner *= shape[size_t(d)];
  }
  layout.extent = shape[size_t(dim)];
  if (layout.extent % (parts * ranks) != 0)
    problem = "expected dimension " + std::to_string(dim) + " (" + std::to_string(layout.extent) + ") to split into " +
              std::to_string(parts) + " parts of " + std::to_string(ranks) + " equal slices";
  return layout;
}

void for_each_slice_run(const SliceLayout& layout, int64_t rank, int64_t lo, int64_t hi, const SliceRun& run) {
  if (lo >= hi) return;
  if (layout.whole()) return run(lo, lo, hi - lo);
  const int64_t chunk = layout.extent / (layout.parts * layout.ranks);  // rows of one run
  const int64_t part_rows = layout.extent / layout.parts;
  const int64_t length = chunk * layout.inner;
  for (int64_t q = lo / length; q * length < hi; ++q) {
    const int64_t o = q / layout.parts, part = q % layout.parts;
    const int64_t whole_start = (o * layout.extent + part * part_rows + rank * chunk) * layout.inner;
    const int64_t from = std::max(lo, q * length), to = std::min(hi, (q + 1) * length);
    run(from, whole_start + (from - q * length), to - from);
  }
}

void for_each_whole_run(const SliceLayout& layout, int64_t lo, int64_t hi, const WholeRun& run) {
  if (lo >= hi) return;
  if (layout.whole()) return run(0, lo, lo, hi - lo);
  const int64_t chunk = layout.extent / (layout.parts * layout.ranks);
  const int64_t length = chunk * layout.inner;
  // Whole run g: outer index g / (parts × ranks), then part, then the rank whose chunk it is.
  for (int64_t g = lo / length; g * length < hi; ++g) {
    const int64_t o = g / (layout.parts * layout.ranks), rest = g % (layout.parts * layout.ranks);
    const int64_t part = rest / layout.ranks, rank = rest % layout.ranks;
    const int64_t local_start = (o * (layout.extent / layout.ranks) + part * chunk) * layout.inner;
    const int64_t from = std::max(lo, g * length), to = std::min(hi, (g + 1) * length);
    run(rank, local_start + (from - g * length), from, to - from);
  }
}

}  // namespace zt
