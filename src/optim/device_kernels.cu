// CUDA implementation of optim/device_kernels.h (built only with -DZT_CUDA=ON).
//
// Arithmetic: every operation is written with an explicit round-to-nearest intrinsic
// (__fmul_rn, __fdiv_rn, __fmaf_rn, ...) in the order of kernels_impl.h. nvcc contracts a*b+c into
// an fma by default; doing that where the CPU rounds the product would make device and host
// disagree in the last bit, so contraction is ruled out by construction instead of by flags.
// The fp16 conversions are the hardware's IEEE ones (cvt.rn), bf16 rounding is the CPU's bit
// trick, so the half copies are the CPU's bit for bit.
//
// Only cuda_runtime.h is included: LibTorch's headers under nvcc are slow and fragile.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "optim/device_kernels.h"
#include "optim/kernel_table.h"  // AdamConsts, SgdConsts, LambConsts: the CPU's per-step constants
#include "zerotrain/error.h"

namespace zt::optim {
namespace {

using detail::AdamConsts;
using detail::LambConsts;
using detail::SgdConsts;

constexpr int kThreads = 256;  // every kernel; the reductions' shared arrays are sized by it
// LAMB: each block owns at most this many elements of one piece, so a block's partial sums belong
// to one piece and the per-piece reduction is a fixed sum over that piece's blocks.
constexpr int64_t kLambChunk = 16384;
// square_sum: at most this many blocks (grid-stride), fixed by n alone so the sum is reproducible
// across devices with different SM counts.
constexpr int64_t kSquareSumBlocks = 1024;
constexpr int64_t kSquareSumPerBlock = kThreads * 8;

// ---- errors, launch geometry, scratch -------------------------------------------------------

void check(cudaError_t err, const char* fn, const char* what) {
  if (err != cudaSuccess)
    throw zt::Error(std::string(fn) + ": " + what + " failed: " + cudaGetErrorName(err) + ": " +
                    cudaGetErrorString(err));
}

void check_launch(const char* fn) { check(cudaGetLastError(), fn, "kernel launch"); }

// Element-wise kernels are grid-stride loops: a few waves of blocks per SM is enough to saturate
// memory bandwidth, more only adds scheduling work.
int elementwise_blocks(int64_t n, const char* fn) {
  int dev = 0;
  check(cudaGetDevice(&dev), fn, "cudaGetDevice");
  static std::atomic<int> cached[64];
  int sms = dev >= 0 && dev < 64 ? cached[dev].load(std::memory_order_relaxed) : 0;
  if (sms <= 0) {
    check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), fn, "cudaDeviceGetAttribute");
    if (dev >= 0 && dev < 64) cached[dev].store(sms, std::memory_order_relaxed);
  }
  return int(std::max<int64_t>(1, std::min<int64_t>((n + kThreads - 1) / kThreads, int64_t(sms) * 8)));
}

// Stream-ordered scratch: allocated on the stream, freed on it after the work that uses it, also
// when a later step throws.
class Scratch {
 public:
  Scratch(size_t bytes, cudaStream_t stream, const char* fn) : stream_(stream) {
    check(cudaMallocAsync(&ptr_, bytes, stream), fn, "cudaMallocAsync");
  }
  ~Scratch() {
    if (ptr_ != nullptr) cudaFreeAsync(ptr_, stream_);
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  template <class T>
  T* at(size_t byte_offset) const {
    return reinterpret_cast<T*>(static_cast<char*>(ptr_) + byte_offset);
  }

 private:
  void* ptr_ = nullptr;
  cudaStream_t stream_;
};

cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }

void check_half(const DeviceStepOptions& o, int64_t n, const char* fn) {
  if (o.half != HalfType::None && o.half_out == nullptr && n > 0)
    throw std::invalid_argument(std::string(fn) + ": half output requested without a buffer");
}

void check_bounds(const int64_t* bounds, int segments, int64_t n, const char* fn) {
  if (segments < 1 || bounds == nullptr || bounds[0] != 0 || bounds[segments] != n)
    throw std::invalid_argument(std::string(fn) + ": bounds must start at 0 and end at n");
  for (int s = 0; s < segments; ++s)
    if (bounds[s + 1] < bounds[s]) throw std::invalid_argument(std::string(fn) + ": bounds must not decrease");
}

// ---- element access ---------------------------------------------------------------------------

__device__ __forceinline__ float f16_to_f32(uint16_t h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));  // exact widening, subnormals included
  return f;
}

__device__ __forceinline__ uint16_t f32_to_f16_rne(float x) {
  uint16_t h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));  // IEEE: RNE, overflow to inf, NaN stays NaN
  return h;
}

// kernels_impl.h's bf16_rne, bit for bit (quiet NaN with the CPU's payload).
__device__ __forceinline__ uint16_t f32_to_bf16_rne(float x) {
  uint32_t u = __float_as_uint(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

template <DeviceGradType T>
__device__ __forceinline__ float load(const void* x, int64_t i) {
  if constexpr (T == DeviceGradType::F32) {
    return static_cast<const float*>(x)[i];
  } else if constexpr (T == DeviceGradType::BF16) {
    return __uint_as_float(uint32_t(static_cast<const uint16_t*>(x)[i]) << 16);
  } else {
    return f16_to_f32(static_cast<const uint16_t*>(x)[i]);
  }
}

template <HalfType H>
__device__ __forceinline__ void store_half(uint16_t* h, int64_t i, float p) {
  if constexpr (H == HalfType::BF16) h[i] = f32_to_bf16_rne(p);
  if constexpr (H == HalfType::FP16) h[i] = f32_to_f16_rne(p);
}

// ---- kernels (bodies of kernels_impl.h, one element per iteration) --------------------------

template <DeviceGradType T, HalfType H>
__global__ void adam_kernel(float* __restrict__ p, const void* __restrict__ g, float* __restrict__ m,
                            float* __restrict__ v, int64_t n, AdamConsts c, uint16_t* __restrict__ h) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    float P = p[i];
    const float G = __fmaf_rn(c.l2, P, __fmul_rn(load<T>(g, i), c.grad_scale));
    const float M = __fmaf_rn(c.beta1, m[i], __fmul_rn(c.one_minus_beta1, G));
    const float S = __fmaf_rn(c.beta2, v[i], __fmul_rn(__fmul_rn(c.one_minus_beta2, G), G));
    const float D = __fmaf_rn(__fsqrt_rn(S), c.inv_sqrt_bias2, c.eps);
    P = __fsub_rn(__fmul_rn(P, c.decay), __fdiv_rn(__fmul_rn(c.step_size, M), D));
    p[i] = P;
    m[i] = M;
    v[i] = S;
    store_half<H>(h, i, P);
  }
}

template <DeviceGradType T, HalfType H>
__global__ void sgd_kernel(float* __restrict__ p, const void* __restrict__ g, float* __restrict__ buf, int64_t n,
                           SgdConsts c, uint16_t* __restrict__ h) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    float P = p[i];
    float D = __fmaf_rn(c.weight_decay, P, __fmul_rn(load<T>(g, i), c.grad_scale));
    if (c.momentum) {
      const float B = __fmaf_rn(c.buf_keep, buf[i], __fmul_rn(c.buf_grad, D));
      buf[i] = B;
      D = __fmaf_rn(c.nesterov_grad, D, __fmul_rn(c.nesterov_buf, B));
    }
    P = __fsub_rn(P, __fmul_rn(c.lr, D));
    p[i] = P;
    store_half<H>(h, i, P);
  }
}

// Fixed-shape tree sum over the block (blockDim.x == kThreads); thread 0 gets the result.
__device__ __forceinline__ void block_sum2(double* sw, double* su, double& w, double& u) {
  const int t = threadIdx.x;
  sw[t] = w;
  su[t] = u;
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride /= 2) {
    if (t < stride) {
      sw[t] = __dadd_rn(sw[t], sw[t + stride]);
      su[t] = __dadd_rn(su[t], su[t + stride]);
    }
    __syncthreads();
  }
  w = sw[0];
  u = su[0];
}

// Piece table on the device: bounds[0..segments], then chunk_start[0..segments] (the first block
// of each piece; a piece of length L has ceil(L / kLambChunk) blocks, an empty one none).
struct PieceTable {
  const int64_t* bounds;
  const int64_t* chunk_start;
  int segments;
};

// Which piece block `c` belongs to, and its element range.
__device__ __forceinline__ int piece_of(const PieceTable& t, int64_t c, int64_t& begin, int64_t& end) {
  int lo = 0, hi = t.segments;  // the last s with chunk_start[s] <= c
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (t.chunk_start[mid] <= c) lo = mid;
    else hi = mid;
  }
  begin = t.bounds[lo] + (c - t.chunk_start[lo]) * kLambChunk;
  end = min(t.bounds[lo + 1], begin + kLambChunk);
  return lo;
}

template <DeviceGradType T>
__global__ void lamb1_kernel(const float* __restrict__ p, const void* __restrict__ g, float* __restrict__ m,
                             float* __restrict__ v, PieceTable table, LambConsts c, double* __restrict__ partial) {
  __shared__ double sw[kThreads], su[kThreads];
  int64_t begin, end;
  piece_of(table, blockIdx.x, begin, end);
  double w = 0.0, u = 0.0;
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    const float P = p[i];
    const float G = __fmul_rn(load<T>(g, i), c.grad_scale);
    const float M = __fmaf_rn(c.beta1, m[i], __fmul_rn(c.one_minus_beta1, G));
    const float S = __fmaf_rn(c.beta2, v[i], __fmul_rn(__fmul_rn(c.one_minus_beta2, G), G));
    m[i] = M;
    v[i] = S;
    const float U = __fmaf_rn(c.weight_decay, P, __fdiv_rn(M, __fadd_rn(__fsqrt_rn(S), c.eps)));
    // A product of two floats is exact in double: only the additions round.
    w = __dadd_rn(w, __dmul_rn(double(P), double(P)));
    u = __dadd_rn(u, __dmul_rn(double(U), double(U)));
  }
  block_sum2(sw, su, w, u);
  if (threadIdx.x == 0) {
    partial[2 * int64_t(blockIdx.x)] = w;
    partial[2 * int64_t(blockIdx.x) + 1] = u;
  }
}

// One block per piece: the piece's block sums in block order (strided, then the fixed tree).
__global__ void lamb1_reduce_kernel(PieceTable table, const double* __restrict__ partial, double* __restrict__ w_sq,
                                    double* __restrict__ u_sq) {
  __shared__ double sw[kThreads], su[kThreads];
  const int s = blockIdx.x;
  double w = 0.0, u = 0.0;
  for (int64_t c = table.chunk_start[s] + threadIdx.x; c < table.chunk_start[s + 1]; c += blockDim.x) {
    w = __dadd_rn(w, partial[2 * c]);
    u = __dadd_rn(u, partial[2 * c + 1]);
  }
  block_sum2(sw, su, w, u);
  if (threadIdx.x == 0) {
    w_sq[s] = w;
    u_sq[s] = u;
  }
}

// lamb_trust_ratio (cpu_kernels.cpp), operation for operation, in double.
__device__ __forceinline__ double trust_ratio(double w_sq, double u_sq, double min_coeff, double max_coeff) {
  const double w = __dsqrt_rn(w_sq), u = __dsqrt_rn(u_sq);
  if (w == 0.0 || u == 0.0) return 1.0;
  const double r = __ddiv_rn(w, u);
  return r < min_coeff ? min_coeff : (max_coeff < r ? max_coeff : r);  // std::clamp, NaN passes through
}

struct LambApplyScalars {
  double step_size, min_coeff, max_coeff;
};

template <HalfType H>
__global__ void lamb2_kernel(float* __restrict__ p, const float* __restrict__ m, const float* __restrict__ v,
                             PieceTable table, const double* __restrict__ w_sq, const double* __restrict__ u_sq,
                             LambConsts c, LambApplyScalars a, uint16_t* __restrict__ h) {
  __shared__ float coef;
  int64_t begin, end;
  const int s = piece_of(table, blockIdx.x, begin, end);
  if (threadIdx.x == 0)
    coef = __double2float_rn(__dmul_rn(a.step_size, trust_ratio(w_sq[s], u_sq[s], a.min_coeff, a.max_coeff)));
  __syncthreads();
  const float k = coef;
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    float P = p[i];
    const float U = __fmaf_rn(c.weight_decay, P, __fdiv_rn(m[i], __fadd_rn(__fsqrt_rn(v[i]), c.eps)));
    P = __fsub_rn(P, __fmul_rn(k, U));
    p[i] = P;
    store_half<H>(h, i, P);
  }
}

template <DeviceGradType T>
__global__ void square_sum_kernel(const void* __restrict__ x, int64_t n, double* __restrict__ partial) {
  __shared__ double sw[kThreads], su[kThreads];
  double w = 0.0, unused = 0.0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const double e = load<T>(x, i);
    w = __dadd_rn(w, __dmul_rn(e, e));
  }
  block_sum2(sw, su, w, unused);
  if (threadIdx.x == 0) partial[blockIdx.x] = w;
}

__global__ void square_sum_reduce_kernel(const double* __restrict__ partial, int blocks, double* __restrict__ out) {
  __shared__ double sw[kThreads], su[kThreads];
  double w = 0.0, unused = 0.0;
  for (int b = threadIdx.x; b < blocks; b += blockDim.x) w = __dadd_rn(w, partial[b]);
  block_sum2(sw, su, w, unused);
  if (threadIdx.x == 0) *out = __dadd_rn(*out, w);
}

// ---- dispatch over the template parameters ----------------------------------------------------

template <template <DeviceGradType, HalfType> class K, class... Args>
void launch_gh(DeviceGradType t, HalfType h, int blocks, cudaStream_t s, Args... args) {
  auto go = [&](auto kernel) { kernel<<<blocks, kThreads, 0, s>>>(args...); };
  switch (t) {
    case DeviceGradType::F32:
      switch (h) {
        case HalfType::None: return go(K<DeviceGradType::F32, HalfType::None>::kernel);
        case HalfType::BF16: return go(K<DeviceGradType::F32, HalfType::BF16>::kernel);
        case HalfType::FP16: return go(K<DeviceGradType::F32, HalfType::FP16>::kernel);
      }
      break;
    case DeviceGradType::BF16:
      switch (h) {
        case HalfType::None: return go(K<DeviceGradType::BF16, HalfType::None>::kernel);
        case HalfType::BF16: return go(K<DeviceGradType::BF16, HalfType::BF16>::kernel);
        case HalfType::FP16: return go(K<DeviceGradType::BF16, HalfType::FP16>::kernel);
      }
      break;
    case DeviceGradType::F16:
      switch (h) {
        case HalfType::None: return go(K<DeviceGradType::F16, HalfType::None>::kernel);
        case HalfType::BF16: return go(K<DeviceGradType::F16, HalfType::BF16>::kernel);
        case HalfType::FP16: return go(K<DeviceGradType::F16, HalfType::FP16>::kernel);
      }
      break;
  }
  throw std::invalid_argument("optimizer device kernels: unknown gradient or half type");
}

template <DeviceGradType T, HalfType H>
struct AdamK {
  static constexpr auto kernel = &adam_kernel<T, H>;
};
template <DeviceGradType T, HalfType H>
struct SgdK {
  static constexpr auto kernel = &sgd_kernel<T, H>;
};


// The piece table on the device, and room for `partials_per_chunk` doubles per block after it.
// The host copy is a member vector: cudaMemcpyAsync from pageable memory stages it before
// returning, so neither it nor the caller's `bounds` has to outlive the call.
class DevicePieces {
 public:
  DevicePieces(const int64_t* bounds, int segments, int partials_per_chunk, cudaStream_t stream, const char* fn)
      : host_(host_table(bounds, segments, fn)),
        scratch_(host_.size() * sizeof(int64_t) + size_t(std::max<int64_t>(host_.back(), 1)) * partials_per_chunk *
                                                       sizeof(double),
                 stream, fn) {
    check(cudaMemcpyAsync(scratch_.at<int64_t>(0), host_.data(), host_.size() * sizeof(int64_t),
                          cudaMemcpyHostToDevice, stream),
          fn, "cudaMemcpyAsync of the piece table");
    table_ = PieceTable{scratch_.at<int64_t>(0), scratch_.at<int64_t>(sizeof(int64_t) * (segments + 1)), segments};
  }
  const PieceTable& table() const { return table_; }
  int chunks() const { return int(host_.back()); }
  double* partial() const { return scratch_.at<double>(host_.size() * sizeof(int64_t)); }

 private:
  // bounds[0..segments], then chunk_start[0..segments]; the last entry is the number of blocks.
  static std::vector<int64_t> host_table(const int64_t* bounds, int segments, const char* fn) {
    std::vector<int64_t> host(2 * size_t(segments + 1));
    int64_t chunks = 0;
    for (int s = 0; s <= segments; ++s) {
      host[s] = bounds[s];
      host[segments + 1 + s] = chunks;
      if (s < segments) chunks += (bounds[s + 1] - bounds[s] + kLambChunk - 1) / kLambChunk;
    }
    if (chunks > std::numeric_limits<int>::max())
      throw std::invalid_argument(std::string(fn) + ": partition too large for one launch");
    return host;
  }

  std::vector<int64_t> host_;
  Scratch scratch_;
  PieceTable table_{};
};

}  // namespace

bool device_kernels_built() { return true; }

void adam_step_device(float* params, const void* grads, float* exp_avg, float* exp_avg_sq, int64_t n,
                      const AdamHyperparameters& hp, int64_t step, const DeviceStepOptions& o) {
  constexpr const char* fn = "adam_step_device";
  check_half(o, n, fn);
  if (n <= 0) return;
  const AdamConsts c = detail::adam_consts(hp, step, o.grad_scale);  // the CPU's very constants
  const cudaStream_t s = as_stream(o.stream);
  launch_gh<AdamK>(o.grad_type, o.half, elementwise_blocks(n, fn), s, params, grads, exp_avg, exp_avg_sq, n, c,
                   o.half == HalfType::None ? nullptr : o.half_out);
  check_launch(fn);
}

void sgd_step_device(float* params, const void* grads, float* momentum_buffer, int64_t n, const SgdHyperparameters& hp,
                     int64_t step, const DeviceStepOptions& o) {
  constexpr const char* fn = "sgd_step_device";
  check_half(o, n, fn);
  const bool momentum = hp.momentum != 0.0;
  if (momentum && momentum_buffer == nullptr && n > 0)
    throw std::invalid_argument(std::string(fn) + ": momentum without a momentum buffer");
  if (n <= 0) return;
  const SgdConsts c = detail::sgd_consts(hp, step, o.grad_scale);
  launch_gh<SgdK>(o.grad_type, o.half, elementwise_blocks(n, fn), as_stream(o.stream), params, grads,
                  momentum ? momentum_buffer : nullptr, n, c, o.half == HalfType::None ? nullptr : o.half_out);
  check_launch(fn);
}

void lamb_partial_norms_device(const float* params, const void* grads, float* exp_avg, float* exp_avg_sq, int64_t n,
                               const int64_t* bounds, int segments, const LambHyperparameters& hp,
                               const DeviceStepOptions& o, double* w_sq, double* u_sq) {
  constexpr const char* fn = "lamb_partial_norms_device";
  check_bounds(bounds, segments, n, fn);
  const cudaStream_t s = as_stream(o.stream);
  const DevicePieces pieces(bounds, segments, 2, s, fn);
  const LambConsts c = detail::lamb_consts(hp, o.grad_scale);
  if (pieces.chunks() > 0) {
    const int blocks = pieces.chunks();
    switch (o.grad_type) {
      case DeviceGradType::F32:
        lamb1_kernel<DeviceGradType::F32><<<blocks, kThreads, 0, s>>>(params, grads, exp_avg, exp_avg_sq, pieces.table(), c,
                                                                      pieces.partial());
        break;
      case DeviceGradType::BF16:
        lamb1_kernel<DeviceGradType::BF16><<<blocks, kThreads, 0, s>>>(params, grads, exp_avg, exp_avg_sq, pieces.table(),
                                                                       c, pieces.partial());
        break;
      case DeviceGradType::F16:
        lamb1_kernel<DeviceGradType::F16><<<blocks, kThreads, 0, s>>>(params, grads, exp_avg, exp_avg_sq, pieces.table(), c,
                                                                      pieces.partial());
        break;
    }
    check_launch(fn);
  }
  // Also for pieces without elements: their sums are written as 0.
  lamb1_reduce_kernel<<<segments, kThreads, 0, s>>>(pieces.table(), pieces.partial(), w_sq, u_sq);
  check_launch(fn);
}

void lamb_apply_device(float* params, const float* exp_avg, const float* exp_avg_sq, int64_t n, const int64_t* bounds,
                       int segments, const double* w_sq_total, const double* u_sq_total, const LambHyperparameters& hp,
                       int64_t step, const DeviceStepOptions& o) {
  constexpr const char* fn = "lamb_apply_device";
  check_bounds(bounds, segments, n, fn);
  check_half(o, n, fn);
  if (n <= 0) return;
  const cudaStream_t s = as_stream(o.stream);
  // cpu_kernels.cpp's lamb_apply step size, in double.
  double step_size = hp.lr;
  if (hp.bias_correction)
    step_size = hp.lr * std::sqrt(1.0 - std::pow(hp.beta2, double(step))) / (1.0 - std::pow(hp.beta1, double(step)));
  const LambApplyScalars a{step_size, hp.min_coeff, hp.max_coeff};
  const LambConsts c = detail::lamb_consts(hp, o.grad_scale);
  const DevicePieces pieces(bounds, segments, 0, s, fn);
  const int blocks = pieces.chunks();
  uint16_t* h = o.half == HalfType::None ? nullptr : o.half_out;
  switch (o.half) {
    case HalfType::None:
      lamb2_kernel<HalfType::None><<<blocks, kThreads, 0, s>>>(params, exp_avg, exp_avg_sq, pieces.table(), w_sq_total,
                                                               u_sq_total, c, a, h);
      break;
    case HalfType::BF16:
      lamb2_kernel<HalfType::BF16><<<blocks, kThreads, 0, s>>>(params, exp_avg, exp_avg_sq, pieces.table(), w_sq_total,
                                                               u_sq_total, c, a, h);
      break;
    case HalfType::FP16:
      lamb2_kernel<HalfType::FP16><<<blocks, kThreads, 0, s>>>(params, exp_avg, exp_avg_sq, pieces.table(), w_sq_total,
                                                               u_sq_total, c, a, h);
      break;
  }
  check_launch(fn);
}

void square_sum_device(const void* x, DeviceGradType type, int64_t n, double* out, void* stream) {
  constexpr const char* fn = "square_sum_device";
  if (n <= 0) return;
  const cudaStream_t s = as_stream(stream);
  const int blocks = int(std::min<int64_t>(kSquareSumBlocks, (n + kSquareSumPerBlock - 1) / kSquareSumPerBlock));
  Scratch partial(size_t(blocks) * sizeof(double), s, fn);
  switch (type) {
    case DeviceGradType::F32:
      square_sum_kernel<DeviceGradType::F32><<<blocks, kThreads, 0, s>>>(x, n, partial.at<double>(0));
      break;
    case DeviceGradType::BF16:
      square_sum_kernel<DeviceGradType::BF16><<<blocks, kThreads, 0, s>>>(x, n, partial.at<double>(0));
      break;
    case DeviceGradType::F16:
      square_sum_kernel<DeviceGradType::F16><<<blocks, kThreads, 0, s>>>(x, n, partial.at<double>(0));
      break;
  }
  check_launch(fn);
  square_sum_reduce_kernel<<<1, kThreads, 0, s>>>(partial.at<double>(0), blocks, out);
  check_launch(fn);
}

}  // namespace zt::optim
