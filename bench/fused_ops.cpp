#include "fused_ops.h"  // bench/: measured, not used by the library

#include <algorithm>
#include <array>
#include <vector>

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/torch.h>

namespace zt {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

// Rows per chunk: a chunk of rows × n elements is about chunk_bytes, at least one row.
int64_t rows_per_chunk(int64_t n, const torch::Tensor& t, int64_t chunk_bytes) {
  return std::max<int64_t>(1, chunk_bytes / std::max<int64_t>(1, n * int64_t(t.element_size())));
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Accumulation dtype: fp64 for fp64, fp32 otherwise (bf16 and fp16 sums and statistics in fp32).
torch::ScalarType acc_type(const torch::Tensor& t) {
  return t.scalar_type() == torch::kDouble ? torch::kDouble : torch::kFloat;
}

// Sums the per-chunk partials [chunks, n] in chunk order into a tensor of `like`'s dtype.
torch::Tensor reduce_partials(const torch::Tensor& partials, const torch::Tensor& like) {
  const int64_t chunks = partials.size(0), n = partials.size(1);
  auto total = torch::zeros({n}, partials.options());
  AT_DISPATCH_FLOATING_TYPES(partials.scalar_type(), "reduce_partials", [&] {
    scalar_t* out = total.data_ptr<scalar_t>();
    const scalar_t* p = partials.const_data_ptr<scalar_t>();
    for (int64_t c = 0; c < chunks; ++c)
      for (int64_t j = 0; j < n; ++j) out[j] += p[c * n + j];
  });
  return total.to(like.scalar_type());
}

void check_row_operand(const char* op, const torch::Tensor& x, const torch::Tensor& p, const char* name) {
  TORCH_CHECK(x.defined() && p.defined(), op, ": undefined input");
  TORCH_CHECK(x.dim() >= 1, op, ": expects x of shape [..., N], found a 0-D tensor");
  TORCH_CHECK(p.dim() == 1 && p.size(0) == x.size(-1), op, ": ", name, " must be 1-D of size x.size(-1) = ", x.size(-1),
              ", found ", p.sizes());
  TORCH_CHECK(p.scalar_type() == x.scalar_type(), op, ": ", name, " must have x's dtype ", x.scalar_type(), ", found ",
              p.scalar_type());
  TORCH_CHECK(p.device() == x.device(), op, ": ", name, " must be on x's device");
}

// ---- bias + GELU ------------------------------------------------------------------------------

struct BiasGelu : torch::autograd::Function<BiasGelu> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x_in, const torch::Tensor& bias_in,
                               int64_t chunk_bytes) {
    auto x = x_in.contiguous();
    auto bias = bias_in.contiguous();
    const int64_t n = x.size(-1), rows = n == 0 ? 0 : x.numel() / n;
    auto out = torch::empty_like(x, at::MemoryFormat::Contiguous);
    const int64_t per = rows_per_chunk(n, x, chunk_bytes), chunks = ceil_div(rows, per);
    auto x2 = x.view({rows, n});
    auto out2 = out.view({rows, n});
    at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
      at::NoGradGuard no_grad;  // grad mode is per thread; the chunks' kernels record nothing
      auto scratch = torch::empty({per, n}, x.options());
      for (int64_t c = begin; c < end; ++c) {
        const int64_t r0 = c * per, r = std::min(per, rows - r0);
        auto s = scratch.narrow(0, 0, r);
        at::add_out(s, x2.narrow(0, r0, r), bias);
        auto o = out2.narrow(0, r0, r);
        at::gelu_out(o, s, "none");
      }
    });
    ctx->save_for_backward({x, bias});
    ctx->saved_data["chunk_bytes"] = chunk_bytes;
    return out;
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    auto saved = ctx->get_saved_variables();
    const auto& x = saved[0];
    const auto& bias = saved[1];
    auto grad = grads[0].contiguous();
    const int64_t chunk_bytes = ctx->saved_data["chunk_bytes"].toInt();
    const int64_t n = x.size(-1), rows = n == 0 ? 0 : x.numel() / n;
    const int64_t per = rows_per_chunk(n, x, chunk_bytes), chunks = ceil_div(rows, per);
    auto dx = torch::empty_like(x, at::MemoryFormat::Contiguous);
    const bool want_bias = ctx->needs_input_grad(1);
    auto partials = torch::zeros({want_bias ? chunks : 0, n}, x.options().dtype(acc_type(x)));
    auto x2 = x.view({rows, n}), g2 = grad.view({rows, n}), dx2 = dx.view({rows, n});
    at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
      at::NoGradGuard no_grad;  // grad mode is per thread; the chunks' kernels record nothing
      auto scratch = torch::empty({per, n}, x.options());
      for (int64_t c = begin; c < end; ++c) {
        const int64_t r0 = c * per, r = std::min(per, rows - r0);
        auto s = scratch.narrow(0, 0, r);
        at::add_out(s, x2.narrow(0, r0, r), bias);
        auto d = dx2.narrow(0, r0, r);
        at::gelu_backward_out(d, g2.narrow(0, r0, r), s, "none");
        if (want_bias) {  // LibTorch's vectorised reduction, one thread per chunk: a fixed order
          auto p = partials.select(0, c);
          at::sum_out(p, d, {0}, false, partials.scalar_type());
        }
      }
    });
    torch::Tensor dbias;
    if (want_bias) dbias = reduce_partials(partials, bias);
    return {dx, dbias, torch::Tensor()};
  }
};

// ---- residual + LayerNorm ---------------------------------------------------------------------

struct ResidualLayerNorm : torch::autograd::Function<ResidualLayerNorm> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x_in, const torch::Tensor& residual_in,
                               const torch::Tensor& weight_in, const torch::Tensor& bias_in, double eps,
                               int64_t chunk_bytes) {
    auto x = x_in.contiguous(), residual = residual_in.contiguous();
    auto weight = weight_in.contiguous(), bias = bias_in.contiguous();
    const int64_t n = x.size(-1), rows = n == 0 ? 0 : x.numel() / n;
    const int64_t per = rows_per_chunk(n, x, chunk_bytes), chunks = ceil_div(rows, per);
    auto out = torch::empty_like(x, at::MemoryFormat::Contiguous);
    // Per-row statistics kept in the accumulation dtype (fp32 for bf16: backward runs in fp32).
    auto mean = torch::empty({rows}, x.options().dtype(acc_type(x)));
    auto rstd = torch::empty({rows}, x.options().dtype(acc_type(x)));

    auto x2 = x.view({rows, n}), r2 = residual.view({rows, n}), out2 = out.view({rows, n});
    at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
      at::NoGradGuard no_grad;  // grad mode is per thread; the chunks' kernels record nothing
      auto scratch = torch::empty({per, n}, x.options());
      for (int64_t c = begin; c < end; ++c) {
        const int64_t r0 = c * per, r = std::min(per, rows - r0);
        auto s = scratch.narrow(0, 0, r);
        at::add_out(s, x2.narrow(0, r0, r), r2.narrow(0, r0, r));
        auto [o, m, v] = at::native_layer_norm(s, {n}, weight, bias, eps);
        out2.narrow(0, r0, r).copy_(o);
        mean.narrow(0, r0, r).copy_(m.view({r}));
        rstd.narrow(0, r0, r).copy_(v.view({r}));
      }
    });
    ctx->save_for_backward({x, residual, weight, bias, mean, rstd});
    ctx->saved_data["chunk_bytes"] = chunk_bytes;

    return out;
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    auto saved = ctx->get_saved_variables();
    const auto &x = saved[0], &residual = saved[1], &weight = saved[2], &bias = saved[3];
    const auto &mean = saved[4], &rstd = saved[5];
    auto grad = grads[0].contiguous();
    const int64_t chunk_bytes = ctx->saved_data["chunk_bytes"].toInt();
    const int64_t n = x.size(-1), rows = n == 0 ? 0 : x.numel() / n;
    const int64_t per = rows_per_chunk(n, x, chunk_bytes), chunks = ceil_div(rows, per);
    const bool want_input = ctx->needs_input_grad(0) || ctx->needs_input_grad(1);
    const bool want_params = ctx->needs_input_grad(2) || ctx->needs_input_grad(3);
    auto dx = torch::empty_like(x, at::MemoryFormat::Contiguous);
    auto dw_partials = torch::zeros({want_params ? chunks : 0, n}, x.options().dtype(acc_type(x)));
    auto db_partials = torch::zeros({want_params ? chunks : 0, n}, x.options().dtype(acc_type(x)));
    auto x2 = x.view({rows, n}), r2 = residual.view({rows, n}), g2 = grad.view({rows, n}), dx2 = dx.view({rows, n});
    const auto acc = acc_type(x);
    const bool reduced = x.scalar_type() != acc;
    const auto weight_acc = weight.to(acc), bias_acc = bias.to(acc);
    const std::array<bool, 3> mask = {want_input, want_params, want_params};
    at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
      at::NoGradGuard no_grad;  // grad mode is per thread; the chunks' kernels record nothing
      auto scratch = torch::empty({per, n}, x.options());
      for (int64_t c = begin; c < end; ++c) {
        const int64_t r0 = c * per, r = std::min(per, rows - r0);
        auto s = scratch.narrow(0, 0, r);
        at::add_out(s, x2.narrow(0, r0, r), r2.narrow(0, r0, r));
        auto m = mean.narrow(0, r0, r), v = rstd.narrow(0, r0, r);
        auto g = g2.narrow(0, r0, r);
        // LibTorch's kernel in the accumulation dtype: bf16/fp16 chunks are widened to fp32 (in
        // cache), so that the chunk's parameter gradients are not rounded before the reduction.
        auto [d, dw, db] = reduced ? at::native_layer_norm_backward(g.to(acc), s.to(acc), {n}, m.view({r, 1}),
                                                                    v.view({r, 1}), weight_acc, bias_acc, mask)
                                   : at::native_layer_norm_backward(g, s, {n}, m.view({r, 1}), v.view({r, 1}), weight,
                                                                    bias, mask);
        if (want_input) dx2.narrow(0, r0, r).copy_(d);
        if (want_params) {
          dw_partials.select(0, c).copy_(dw);
          db_partials.select(0, c).copy_(db);
        }
      }
    });
    torch::Tensor dw, db;
    if (want_params) {
      dw = reduce_partials(dw_partials, weight);
      db = reduce_partials(db_partials, bias);
    }
    torch::Tensor dres = want_input && ctx->needs_input_grad(1) ? dx : torch::Tensor();
    return {ctx->needs_input_grad(0) ? dx : torch::Tensor(), dres, dw, db, torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor bias_gelu(const torch::Tensor& x, const torch::Tensor& bias, int64_t chunk_bytes) {
  check_row_operand("bias_gelu", x, bias, "bias");
  if (!x.device().is_cpu()) return torch::gelu(x + bias, "none");
  return BiasGelu::apply(x, bias, chunk_bytes);
}

torch::Tensor residual_layer_norm(const torch::Tensor& x, const torch::Tensor& residual, const torch::Tensor& weight,
                                  const torch::Tensor& bias, double eps, int64_t chunk_bytes) {
  check_row_operand("residual_layer_norm", x, weight, "weight");
  check_row_operand("residual_layer_norm", x, bias, "bias");
  TORCH_CHECK(residual.defined() && residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type() &&
                  residual.device() == x.device(),
              "residual_layer_norm: residual must match x (", x.sizes(), ", ", x.scalar_type(), "), found ",
              residual.sizes(), ", ", residual.scalar_type());
  if (!x.device().is_cpu()) return torch::layer_norm(x + residual, {x.size(-1)}, weight, bias, eps);
  return ResidualLayerNorm::apply(x, residual, weight, bias, eps, chunk_bytes);
}

}  // namespace zt
