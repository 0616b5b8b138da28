// Fused CPU operations for the BERT encoder: each is one autograd function whose forward and
// backward walk the rows in cache-sized chunks, so that the intermediate sum never goes to
// memory, and call LibTorch's own vectorised kernels on each chunk. Results equal the unfused
// LibTorch composition: the outputs and the input gradients to rounding (bitwise in fp32 for
// bias_gelu), the parameter gradients to the order of summation: they are summed per chunk in
// fp32 (fp64 for fp64) and the chunks reduced in a fixed order, so two runs give the same bits
// whatever the thread count.
//
// Measured against the unfused ops (docs/benchmarks.md, "Fused BERT operations on the CPU"):
// bias_gelu is faster than gelu(x + bias) in fp32 only, and not faster than what BERT runs (the
// Linear's bias folded into its matrix multiply, then gelu); residual_layer_norm is slower than
// layer_norm(x + residual). The model (src/models/bert.cpp) therefore uses neither, and they are
// not part of the library: they live beside their benchmark (bench/fused_ops_bench.cpp), and
// tests/fused_ops_test.cpp checks that what the benchmark compares computes the same.
//
// Both take tensors of any shape [..., N] with N = the size of the 1-D parameters, in fp32, fp64,
// bf16 or fp16 (every operand of one dtype), on the CPU; on other devices they run the unfused
// composition.
#pragma once

#include <cstdint>

#include <torch/torch.h>

namespace zt {

// Bytes of one chunk's scratch: the chunk, its scratch and its output stay in L2.
inline constexpr int64_t kFusedChunkBytes = 256 * 1024;

// gelu(x + bias) with the exact (erf) GELU. Saves x and bias (not x + bias) for backward, which
// recomputes the sum chunk by chunk; the bias gradient is the column sum of dx.
torch::Tensor bias_gelu(const torch::Tensor& x, const torch::Tensor& bias, int64_t chunk_bytes = kFusedChunkBytes);

// layer_norm(x + residual) over the last dimension with weight and bias (post-LN BERT:
// LN(x + sublayer(x))). Saves x, residual and the per-row mean and 1/std; backward recomputes the
// sum chunk by chunk. x and residual receive the same gradient.
torch::Tensor residual_layer_norm(const torch::Tensor& x, const torch::Tensor& residual, const torch::Tensor& weight,
                                  const torch::Tensor& bias, double eps, int64_t chunk_bytes = kFusedChunkBytes);

}  // namespace zt
