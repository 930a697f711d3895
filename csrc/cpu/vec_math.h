// Scalar bf16 conversions and a 16-lane exp shared by the CPU twins (skinny_gemm.h, swiglu.cpp,
// tree_attention.cpp).
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace swiftspec {
namespace vec {

inline float bf16_bits_to_float(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Round-to-nearest-even, NaN -> canonical quiet NaN: the same rule as c10::BFloat16(float), so the
// result is what PyTorch's own .to(torch.bfloat16) of our fp32 value would give.
inline uint16_t float_to_bf16_bits(float f) { return c10::BFloat16(f).x; }

#if defined(__AVX512F__)
// exp(x) for 16 lanes: x = n ln2 + r with |r| <= ln2 / 2, degree-7 Taylor polynomial of e^r
// (truncation error < 6e-9 relative) and the exponent applied by vscalefps, which also yields
// exact 0 / inf-free results at the clamped range ends. NaN propagates.
inline __m512 exp_avx512(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.f)), _mm512_set1_ps(88.7f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);  // ln2 high part
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);    // ln2 low part
  __m512 p = _mm512_set1_ps(1.f / 5040.f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}
#endif

}  // namespace vec
}  // namespace swiftspec
