// AVX-512F instantiation of the kernel bodies (see cpu_kernels_avx2.cpp for the scheme). Run
// only when cpu_supports(Isa::Avx512).
#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma,f16c")
// GCC 12 reports its own _mm512_undefined_* helpers as maybe-uninitialized; harmless.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include "optim/kernels_impl.h"

namespace zt::optim::detail {
namespace {

struct Avx512V {
  using F = __m512;
  static constexpr int W = 16;
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F x) { _mm512_storeu_ps(p, x); }
  static F set1(float x) { return _mm512_set1_ps(x); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F sqrt(F a) { return _mm512_sqrt_ps(a); }
  static F zero() { return _mm512_setzero_ps(); }
  static double hsum(F a) {
    alignas(64) float t[16];
    _mm512_store_ps(t, a);
    double s = 0;
    for (float x : t) s += x;
    return s;
  }
  static void store_bf16(uint16_t* o, F x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
    const __m512i qnan = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), r, qnan);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), _mm512_cvtepi32_epi16(r));
  }
  static void store_fp16(uint16_t* o, F x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o),
                        _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
};

constexpr KernelTable kTable = make_table<Avx512V>();

}  // namespace

const KernelTable& avx512_table() { return kTable; }

}  // namespace zt::optim::detail
#pragma GCC pop_options
