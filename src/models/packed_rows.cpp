#include "models/packed_rows.h"

#include <string>

#include <torch/torch.h>

#include "zerotrain/error.h"

namespace zt {

PackedRows packed_rows(const at::Tensor& ids, const at::Tensor& segments, const char* model) {
  if (segments.sizes() != ids.sizes() || !at::isIntegralType(segments.scalar_type(), /*includeBool=*/false))
    throw ConfigError(std::string(model) + ": segments must be integers of the inputs' shape " + c10::str(ids.sizes()) +
                      ", found " + std::string(c10::toString(segments.scalar_type())) + " " + c10::str(segments.sizes()));
  const int64_t T = ids.size(1);
  const auto seg = segments.to(ids.device(), torch::kLong);
  auto pos = torch::arange(T, torch::TensorOptions().dtype(torch::kLong).device(ids.device()));
  // A segment starts where its id differs from the position before; each position's id is its
  // distance from the last start at or before it.
  auto starts = torch::ones_like(seg, torch::kBool);
  if (T > 1) starts.narrow(1, 1, T - 1).copy_(seg.narrow(1, 1, T - 1) != seg.narrow(1, 0, T - 1));
  const auto at_start = torch::where(starts, pos.unsqueeze(0).expand_as(seg), torch::zeros_like(seg));
  PackedRows rows;
  rows.positions = pos.unsqueeze(0) - std::get<0>(at_start.cummax(1));
  rows.allowed = (seg.unsqueeze(2) == seg.unsqueeze(1))
                     .logical_and_(torch::ones({T, T}, torch::TensorOptions().dtype(torch::kBool).device(ids.device())).tril_())
                     .unsqueeze(1);
  return rows;
}

}  // namespace zt
