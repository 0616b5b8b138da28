// The Llama attention's tensor steps that the model's forward (llama.cpp) and the cached
// generation steps (generation.cpp) share, so that both compute the same numbers. Internal.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>

namespace zt::llama_ops {

// transformers' rotate_half: [x1, x2] -> [-x2, x1] over the last dimension's halves.
at::Tensor rotate_half(const at::Tensor& x);

// Rotary embedding of q or k [B, heads, T, head_dim] with cos and sin [T, head_dim], or
// [B, 1, T, head_dim] for per-token positions (already in x's dtype): x·cos + rotate_half(x)·sin.
at::Tensor apply_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

// transformers' repeat_kv: keys or values [B, kv_heads, S, head_dim] to [B, heads, S, head_dim],
// kv head j serving q heads j·r .. j·r + r - 1 (r = heads / kv_heads); unchanged when r == 1.
at::Tensor repeat_kv(const at::Tensor& x, int64_t heads);

}  // namespace zt::llama_ops
