// AVX2 kernel of the quantized skinny GEMM: vpmaddubsw / vpmaddwd (quant_gemm_simd.h). Compiled
// for AVX2 + FMA + F16C whatever the build machine; run only where the CPU has them
// (quant_gemm.cpp checks at run time). AVX-512 is switched off even where the build machine has it
// (-march=native): otherwise GCC encodes this kernel with EVEX, 32 vector registers and vpternlog,
// and an AVX-512 machine would test and time different code from what an AVX2-only CPU runs.
#pragma GCC target("avx2,fma,f16c,no-avx512f")
#include <immintrin.h>

#include <cstdint>
#include <type_traits>


#include "quant_blocks.h"

namespace swiftspec {
namespace quant {
namespace {

// the 8 unsigned sub-scales of a super-block as int16, in both 128-bit halves
static inline __m256i scale_table(const uint8_t* sc) {
  return _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc))));
}
// sub-scale j in every int16 lane (one vpshufb; j is a constant after unrolling)
static inline __m256i scale_of(__m256i table, int j) {
  return _mm256_shuffle_epi8(table, _mm256_set1_epi16(static_cast<short>(0x0100 * (2 * j + 1) + 2 * j)));
}
static inline __m256i scale_pair(__m128i s8, int k) {
  // int16 copies of s8[2k] in the low 128 bits, of s8[2k+1] in the high ones
  const __m256i w = _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(s8));
  const __m256i idx = _mm256_set_m128i(_mm_set1_epi16(static_cast<short>(0x0100 * (4 * k + 3) + 4 * k + 2)),
                                       _mm_set1_epi16(static_cast<short>(0x0100 * (4 * k + 1) + 4 * k)));
  return _mm256_shuffle_epi8(w, idx);
}
static inline __m256i dot_k(__m256i q, __m256i x, __m256i s) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(q, x), s);
}
static inline __m256i dot_0(__m256i aq, __m256i sx) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(aq, sx), _mm256_set1_epi16(1));
}

}  // namespace
}  // namespace quant
}  // namespace swiftspec

#define QG_ENTRY gemm_avx2
#define QG_QUANTIZE quantize_avx2
#include "quant_gemm_simd.h"
