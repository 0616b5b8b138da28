// AVX2 (+FMA, F16C) instantiation of the kernel bodies. The pragma applies to every function
// defined below it in this file, so the intrinsics and the templates compile for AVX2 without
// changing the global flags (the precompiled header stays valid). Run only when
// cpu_supports(Isa::Avx2).
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

#include "optim/kernels_impl.h"

namespace zt::optim::detail {
namespace {

struct Avx2V {
  using F = __m256;
  static constexpr int W = 8;
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F x) { _mm256_storeu_ps(p, x); }
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F sqrt(F a) { return _mm256_sqrt_ps(a); }
  static F zero() { return _mm256_setzero_ps(); }
  static double hsum(F a) {
    alignas(32) float t[8];
    _mm256_store_ps(t, a);
    double s = 0;
    for (float x : t) s += x;
    return s;
  }
  static void store_bf16(uint16_t* o, F x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
    const __m256i qnan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    r = _mm256_blendv_epi8(r, qnan, _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
    // Pack 8 x u32 (all < 2^16) to 8 x u16: packus works per 128-bit lane, then gather lanes 0 and 2.
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(o), _mm256_castsi256_si128(packed));
  }
  static void store_fp16(uint16_t* o, F x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(o), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
  }
};

constexpr KernelTable kTable = make_table<Avx2V>();

}  // namespace

const KernelTable& avx2_table() { return kTable; }

}  // namespace zt::optim::detail
#pragma GCC pop_options
