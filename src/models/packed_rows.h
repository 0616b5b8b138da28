// Packed rows (zerotrain/data/data.h Batch::segments): what a decoder needs to compute every example
// of a row as if it were alone, shared by the GPT and the Llama so that both read segments the
// same way. Internal.
#pragma once
#include <ATen/core/Tensor.h>

namespace zt {

struct PackedRows {
  at::Tensor positions;  // [B,T] int64: each token's distance from the start of its segment
  at::Tensor allowed;    // [B,1,T,T] bool: true where query t may attend to key s (same segment, s <= t)
};

// `segments`: integer [B,T] of `ids`' shape; a segment is a run of equal ids (the padding's -1 is
// one more segment, harmless: nothing is trained on it). Both tensors are on `ids`' device.
// Throws zt::ConfigError, prefixed "<model>: ", when segments are not integers of ids' shape.
PackedRows packed_rows(const at::Tensor& ids, const at::Tensor& segments, const char* model);

}  // namespace zt
