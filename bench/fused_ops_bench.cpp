// Fused BERT operations on the CPU against the unfused LibTorch composition (docs/benchmarks.md,
// "Fused BERT operations on the CPU"). Forward + backward at bert-base shapes (hidden 768,
// intermediate 3072, 12 heads of 64) for tokens = B x 128, in fp32 and, where the CPU has
// avx512_bf16, bf16; 1 and 2 threads. Each row: median seconds of the repetitions after warm-ups.
//  - bias+GELU: gelu(x + b) against zt::bias_gelu(x, b), [tokens, 3072]
//  - Linear+GELU: the feed-forward's first half as BERT runs it (linear with its bias, then gelu)
//    against mm without bias + zt::bias_gelu
//  - residual+LN: layer_norm(x + r) against zt::residual_layer_norm(x, r, w, b), [tokens, 768]
//  - attention: scaled_dot_product_attention with the boolean key-padding mask (as bert.cpp)
//    against an additive float mask and against the math path (at::_scaled_dot_product_attention_math,
//    with the additive mask)
// Usage: fused_ops_bench [repetitions, default 9] [batches, default "16,32"] [rows: all, or one of
// gelu, linear, ln, attention]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "fused_ops.h"  // bench/: measured, not used by the library

namespace {

// Median seconds of each function over the repetitions after two warm-ups; the functions take
// turns within each repetition, so that a change of load on the machine reaches all of them.
std::vector<double> median_seconds(int reps, const std::vector<std::function<void()>>& fns) {
  for (const auto& fn : fns) {
    fn();
    fn();
  }
  std::vector<std::vector<double>> t(fns.size());
  for (int r = 0; r < reps; ++r)
    for (size_t i = 0; i < fns.size(); ++i) {
      auto t0 = std::chrono::steady_clock::now();
      fns[i]();
      t[i].push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
  std::vector<double> out;
  for (auto& v : t) {
    std::sort(v.begin(), v.end());
    out.push_back(v[v.size() / 2]);
  }
  return out;
}

bool cpu_has(const std::string& flag) {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("flags", 0) == 0) {
      std::istringstream words(line);
      std::string w;
      while (words >> w)
        if (w == flag) return true;
      return false;
    }
  return false;
}

std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  return "unknown";
}

// Forward + backward of fn(inputs) with a fixed output gradient; gradients returned, not accumulated.
std::function<void()> fwd_bwd(std::vector<torch::Tensor> inputs,
                              std::function<torch::Tensor(const std::vector<torch::Tensor>&)> fn) {
  return [inputs = std::move(inputs), fn = std::move(fn)] {
    auto y = fn(inputs);
    auto g = torch::ones_like(y);
    auto grads = torch::autograd::grad({y}, inputs, {g});
    (void)grads;
  };
}

void row(int threads, const char* dtype, const std::string& op, const std::string& shape, const char* base_name,
         double base, const char* other_name, double other) {
  std::printf("| %d | %s | %s | %s | %s %.2f | %s %.2f | %.2f |\n", threads, dtype, op.c_str(), shape.c_str(),
              base_name, base * 1e3, other_name, other * 1e3, base / other);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  const int reps = argc > 1 ? std::atoi(argv[1]) : 9;
  std::vector<int64_t> batches = {16, 32};
  if (argc > 2) {
    batches.clear();
    std::stringstream ss(argv[2]);
    std::string b;
    while (std::getline(ss, b, ',')) batches.push_back(std::atoll(b.c_str()));
  }
  const std::string only = argc > 3 ? argv[3] : "all";
  auto wanted = [&](const char* part) { return only == "all" || only == part; };
  const int64_t T = 128, H = 768, I = 3072, heads = 12, hd = 64;
  const bool bf16 = cpu_has("avx512_bf16");
  std::printf("fused ops bench: %s; avx2 %d avx512f %d avx512_bf16 %d amx_tile %d; median of %d (variants interleaved) after 2 warm-ups\n",
              cpu_model().c_str(), cpu_has("avx2"), cpu_has("avx512f"), bf16, cpu_has("amx_tile"), reps);
  if (!bf16) std::printf("no avx512_bf16: bf16 rows skipped\n");
  std::printf("| threads | dtype | op | shape | baseline ms | variant ms | baseline / variant |\n|---|---|---|---|---|---|---|\n");
  torch::manual_seed(0);
  std::vector<torch::ScalarType> dtypes = {torch::kFloat};
  if (bf16) dtypes.push_back(torch::kBFloat16);
  for (int threads : {1, 2}) {
    torch::set_num_threads(threads);
    for (auto dt : dtypes) {
      const char* dn = dt == torch::kFloat ? "fp32" : "bf16";
      auto opt = torch::TensorOptions().dtype(dt);
      auto leaf = [&](std::vector<int64_t> shape, double scale = 1.0) {
        return (torch::randn(shape) * scale).to(dt).requires_grad_(true);
      };
      for (int64_t B : batches) {
        const int64_t N = B * T;
        const std::string tok = std::to_string(B) + "x" + std::to_string(T);
        if (wanted("gelu")) {  // bias + GELU alone
          auto x = leaf({N, I}), b = leaf({I}, 0.1);
          auto t = median_seconds(
              reps, {fwd_bwd({x, b}, [](const auto& in) { return torch::gelu(in[0] + in[1], "none"); }),
                     fwd_bwd({x, b}, [](const auto& in) { return zt::bias_gelu(in[0], in[1]); })});
          row(threads, dn, "bias+GELU", tok + "x3072", "unfused", t[0], "fused", t[1]);
        }
        if (wanted("linear")) {  // the feed-forward's Linear(H, I) + GELU as BERT runs it
          auto in = leaf({N, H}), w = leaf({I, H}, 0.02), b = leaf({I}, 0.1);
          auto t = median_seconds(
              reps, {fwd_bwd({in, w, b},
                             [](const auto& v) {
                               return torch::gelu(torch::nn::functional::linear(v[0], v[1], v[2]), "none");
                             }),
                     fwd_bwd({in, w, b}, [](const auto& v) {
                       return zt::bias_gelu(torch::nn::functional::linear(v[0], v[1]), v[2]);
                     })});
          row(threads, dn, "Linear+GELU", tok + "x768->3072", "linear+gelu", t[0], "mm+bias_gelu", t[1]);
        }
        if (wanted("ln")) {  // residual + LayerNorm
          auto x = leaf({N, H}), r = leaf({N, H}), w = leaf({H}, 0.1), b = leaf({H}, 0.1);
          auto t = median_seconds(
              reps, {fwd_bwd({x, r, w, b},
                             [H](const auto& v) { return torch::layer_norm(v[0] + v[1], {H}, v[2], v[3], 1e-12); }),
                     fwd_bwd({x, r, w, b}, [](const auto& v) {
                       return zt::residual_layer_norm(v[0], v[1], v[2], v[3], 1e-12);
                     })});
          row(threads, dn, "residual+LN", tok + "x768", "unfused", t[0], "fused", t[1]);
        }
        if (wanted("attention")) {  // attention with a key-padding mask: lengths from 64 to 128 tokens
          auto q = leaf({B, heads, T, hd}), k = leaf({B, heads, T, hd}), v = leaf({B, heads, T, hd});
          auto lengths = torch::randint(64, T + 1, {B, 1, 1, 1});
          auto keep = torch::arange(T).view({1, 1, 1, T}) < lengths;  // [B,1,1,T] bool
          auto additive = torch::zeros({B, 1, 1, T}, opt).masked_fill(keep.logical_not(), -INFINITY);
          auto t = median_seconds(
              reps, {fwd_bwd({q, k, v},
                             [keep](const auto& a) { return at::scaled_dot_product_attention(a[0], a[1], a[2], keep); }),
                     fwd_bwd({q, k, v},
                             [additive](const auto& a) {
                               return at::scaled_dot_product_attention(a[0], a[1], a[2], additive);
                             }),
                     // The math kernel takes the mask as given: additive (sdpa converts a bool one).
                     fwd_bwd({q, k, v}, [additive](const auto& a) {
                       return std::get<0>(at::_scaled_dot_product_attention_math(a[0], a[1], a[2], additive));
                     })});
          const std::string shape = std::to_string(B) + "x12x128x64";
          row(threads, dn, "attention", shape, "sdpa bool mask", t[0], "sdpa float mask", t[1]);
          row(threads, dn, "attention", shape, "sdpa bool mask", t[0], "math path", t[2]);
        }
      }
    }
  }
  return 0;
}
