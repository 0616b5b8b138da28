// Kernel bodies, written once over a small vector-ops type V and instantiated per ISA by
// cpu_kernels.cpp (scalar), cpu_kernels_avx2.cpp and cpu_kernels_avx512.cpp, each of which sets
// its own `#pragma GCC target` before including this file. Everything here has internal linkage
// (anonymous namespace) so that the linker can never merge an AVX-512 instantiation into the
// scalar path (an ODR trap with per-file ISA flags). Internal; include only from those files.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#include "optim/kernel_table.h"

namespace zt::optim::detail {
namespace {

inline uint16_t bf16_rne(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

inline uint16_t fp16_rne(float x) {
  _Float16 h = static_cast<_Float16>(x);  // IEEE conversion, round to nearest even
  uint16_t r;
  std::memcpy(&r, &h, 2);
  return r;
}

struct ScalarV {
  using F = float;
  static constexpr int W = 1;
  static F load(const float* p) { return *p; }
  static void store(float* p, F x) { *p = x; }
  static F set1(float x) { return x; }
  static F add(F a, F b) { return a + b; }
  static F sub(F a, F b) { return a - b; }
  static F mul(F a, F b) { return a * b; }
  static F div(F a, F b) { return a / b; }
  static F fma(F a, F b, F c) { return a * b + c; }
  static F sqrt(F a) { return std::sqrt(a); }
  static F zero() { return 0.0f; }
  static double hsum(F a) { return a; }
  static void store_bf16(uint16_t* o, F x) { *o = bf16_rne(x); }
  static void store_fp16(uint16_t* o, F x) { *o = fp16_rne(x); }
};

template <class V, HalfType H>
inline void store_half(uint16_t* o, typename V::F x) {
  if constexpr (H == HalfType::BF16) V::store_bf16(o, x);
  if constexpr (H == HalfType::FP16) V::store_fp16(o, x);
}

template <class V, HalfType H>
inline void adam_body(float* p, const float* g, float* m, float* v, int64_t n, const AdamConsts& c, uint16_t* h) {
  using F = typename V::F;
  const F gs = V::set1(c.grad_scale), l2 = V::set1(c.l2), b1 = V::set1(c.beta1), b2 = V::set1(c.beta2),
          omb1 = V::set1(c.one_minus_beta1), omb2 = V::set1(c.one_minus_beta2), eps = V::set1(c.eps),
          isb2 = V::set1(c.inv_sqrt_bias2), ss = V::set1(c.step_size), decay = V::set1(c.decay);
  for (int64_t i = 0; i + V::W <= n; i += V::W) {
    F P = V::load(p + i);
    const F G = V::fma(l2, P, V::mul(V::load(g + i), gs));
    const F M = V::fma(b1, V::load(m + i), V::mul(omb1, G));
    const F S = V::fma(b2, V::load(v + i), V::mul(V::mul(omb2, G), G));
    const F D = V::fma(V::sqrt(S), isb2, eps);
    P = V::sub(V::mul(P, decay), V::div(V::mul(ss, M), D));
    V::store(p + i, P);
    V::store(m + i, M);
    V::store(v + i, S);
    if constexpr (H != HalfType::None) store_half<V, H>(h + i, P);
  }
}

template <class V, HalfType H>
inline void sgd_body(float* p, const float* g, float* buf, int64_t n, const SgdConsts& c, uint16_t* h) {
  using F = typename V::F;
  const F gs = V::set1(c.grad_scale), wd = V::set1(c.weight_decay), bm = V::set1(c.buf_keep),
          bc = V::set1(c.buf_grad), na = V::set1(c.nesterov_grad), nb = V::set1(c.nesterov_buf), lr = V::set1(c.lr);
  for (int64_t i = 0; i + V::W <= n; i += V::W) {
    F P = V::load(p + i);
    F D = V::fma(wd, P, V::mul(V::load(g + i), gs));
    if (c.momentum) {
      const F B = V::fma(bm, V::load(buf + i), V::mul(bc, D));
      V::store(buf + i, B);
      D = V::fma(na, D, V::mul(nb, B));
    }
    P = V::sub(P, V::mul(lr, D));
    V::store(p + i, P);
    if constexpr (H != HalfType::None) store_half<V, H>(h + i, P);
  }
}

// Returns the number of elements done (a multiple of V::W); sums go to w_sq/u_sq in double,
// flushed from fp32 vector accumulators every 512 vectors to keep the sum accurate.
template <class V>
inline int64_t lamb1_body(const float* p, const float* g, float* m, float* v, int64_t n, const LambConsts& c,
                          double* w_sq, double* u_sq) {
  using F = typename V::F;
  const F gs = V::set1(c.grad_scale), b1 = V::set1(c.beta1), b2 = V::set1(c.beta2), omb1 = V::set1(c.one_minus_beta1),
          omb2 = V::set1(c.one_minus_beta2), eps = V::set1(c.eps), wd = V::set1(c.weight_decay);
  const int64_t nv = n / V::W * V::W;
  constexpr int64_t kBlock = 512 * V::W;
  int64_t i = 0;
  while (i < nv) {
    const int64_t end = std::min(nv, i + kBlock);
    F aw = V::zero(), au = V::zero();
    for (; i < end; i += V::W) {
      const F P = V::load(p + i);
      const F G = V::mul(V::load(g + i), gs);
      const F M = V::fma(b1, V::load(m + i), V::mul(omb1, G));
      const F S = V::fma(b2, V::load(v + i), V::mul(V::mul(omb2, G), G));
      V::store(m + i, M);
      V::store(v + i, S);
      const F U = V::fma(wd, P, V::div(M, V::add(V::sqrt(S), eps)));
      aw = V::fma(P, P, aw);
      au = V::fma(U, U, au);
    }
    *w_sq += V::hsum(aw);
    *u_sq += V::hsum(au);
  }
  return nv;
}

template <class V, HalfType H>
inline void lamb2_body(float* p, const float* m, const float* v, int64_t n, const LambConsts& c, float coef,
                       uint16_t* h) {
  using F = typename V::F;
  const F eps = V::set1(c.eps), wd = V::set1(c.weight_decay), k = V::set1(coef);
  for (int64_t i = 0; i + V::W <= n; i += V::W) {
    F P = V::load(p + i);
    const F U = V::fma(wd, P, V::div(V::load(m + i), V::add(V::sqrt(V::load(v + i)), eps)));
    P = V::sub(P, V::mul(k, U));
    V::store(p + i, P);
    if constexpr (H != HalfType::None) store_half<V, H>(h + i, P);
  }
}

// Whole ranges: the vector body, then the scalar tail with the same formula.
template <class V, HalfType H>
void adam_range_h(float* p, const float* g, float* m, float* v, int64_t n, const AdamConsts& c, uint16_t* h) {
  const int64_t nv = n / V::W * V::W;
  adam_body<V, H>(p, g, m, v, nv, c, h);
  adam_body<ScalarV, H>(p + nv, g + nv, m + nv, v + nv, n - nv, c, h ? h + nv : nullptr);
}
template <class V, HalfType H>
void sgd_range_h(float* p, const float* g, float* buf, int64_t n, const SgdConsts& c, uint16_t* h) {
  const int64_t nv = n / V::W * V::W;
  sgd_body<V, H>(p, g, buf, nv, c, h);
  sgd_body<ScalarV, H>(p + nv, g + nv, buf ? buf + nv : nullptr, n - nv, c, h ? h + nv : nullptr);
}
template <class V, HalfType H>
void lamb2_range_h(float* p, const float* m, const float* v, int64_t n, const LambConsts& c, float coef, uint16_t* h) {
  const int64_t nv = n / V::W * V::W;
  lamb2_body<V, H>(p, m, v, nv, c, coef, h);
  lamb2_body<ScalarV, H>(p + nv, m + nv, v + nv, n - nv, c, coef, h ? h + nv : nullptr);
}

template <class V>
void adam_range(float* p, const float* g, float* m, float* v, int64_t n, const AdamConsts& c, HalfType t, uint16_t* h) {
  switch (t) {
    case HalfType::None: return adam_range_h<V, HalfType::None>(p, g, m, v, n, c, h);
    case HalfType::BF16: return adam_range_h<V, HalfType::BF16>(p, g, m, v, n, c, h);
    case HalfType::FP16: return adam_range_h<V, HalfType::FP16>(p, g, m, v, n, c, h);
  }
}
template <class V>
void sgd_range(float* p, const float* g, float* buf, int64_t n, const SgdConsts& c, HalfType t, uint16_t* h) {
  switch (t) {
    case HalfType::None: return sgd_range_h<V, HalfType::None>(p, g, buf, n, c, h);
    case HalfType::BF16: return sgd_range_h<V, HalfType::BF16>(p, g, buf, n, c, h);
    case HalfType::FP16: return sgd_range_h<V, HalfType::FP16>(p, g, buf, n, c, h);
  }
}
template <class V>
void lamb1_range(const float* p, const float* g, float* m, float* v, int64_t n, const LambConsts& c, double* w_sq,
                 double* u_sq) {
  const int64_t nv = lamb1_body<V>(p, g, m, v, n, c, w_sq, u_sq);
  lamb1_body<ScalarV>(p + nv, g + nv, m + nv, v + nv, n - nv, c, w_sq, u_sq);
}
template <class V>
void lamb2_range(float* p, const float* m, const float* v, int64_t n, const LambConsts& c, float coef, HalfType t,
                 uint16_t* h) {
  switch (t) {
    case HalfType::None: return lamb2_range_h<V, HalfType::None>(p, m, v, n, c, coef, h);
    case HalfType::BF16: return lamb2_range_h<V, HalfType::BF16>(p, m, v, n, c, coef, h);
    case HalfType::FP16: return lamb2_range_h<V, HalfType::FP16>(p, m, v, n, c, coef, h);
  }
}

template <class V>
constexpr KernelTable make_table() {
  return KernelTable{&adam_range<V>, &sgd_range<V>, &lamb1_range<V>, &lamb2_range<V>};
}

}  // namespace
}  // namespace zt::optim::detail
