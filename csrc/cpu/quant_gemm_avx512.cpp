// AVX-512 VNNI kernels of the quantized skinny GEMM: vpdpbusd on 256-bit registers (AVX512VL),
// the same lanes as the AVX2 kernel so the results are bit-identical (quant_gemm_simd.h), and a
// second entry point that also reads the 16-row interleaved layout, 16 output columns per 512-bit
// register (quant_gemm_vec.h; again the same bits).
// Compiled for AVX-512 F/BW/VL/VNNI whatever the build machine; run only where the CPU has them
// (quant_gemm.cpp checks at run time).
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")
// GCC 12 reports the undefined pass-through operand inside its own 512-bit intrinsics
// (_mm512_undefined_epi32) as uninitialized once they are inlined: a false positive.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <cstdint>
#include <type_traits>

#include "quant_blocks.h"

namespace swiftspec {
namespace quant {
namespace {

// the 8 unsigned sub-scales of a super-block as int32 lanes
static inline __m256i scale_table(const uint8_t* sc) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc)));
}
// sub-scale j in every int32 lane
static inline __m256i scale_of(__m256i table, int j) { return _mm256_permutevar8x32_epi32(table, _mm256_set1_epi32(j)); }
static inline __m256i scale_pair(__m128i s8, int k) {
  // int32 copies of s8[2k] in lanes 0-3, of s8[2k+1] in lanes 4-7
  const __m256i w = _mm256_cvtepi8_epi32(s8);
  return _mm256_permutevar8x32_epi32(w, _mm256_set_epi32(2 * k + 1, 2 * k + 1, 2 * k + 1, 2 * k + 1, 2 * k, 2 * k, 2 * k, 2 * k));
}
static inline __m256i dot_k(__m256i q, __m256i x, __m256i s) {
  return _mm256_mullo_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), q, x), s);
}
static inline __m256i dot_0(__m256i aq, __m256i sx) {
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), aq, sx);
}

}  // namespace
}  // namespace quant
}  // namespace swiftspec

// the interleaved (x8) kernels accumulate with vpdpbusd, QG_X8_ROWS rows per register set
#define QG_DPBUSD _mm256_dpbusd_epi32
#ifndef QG_X8_ROWS
#define QG_X8_ROWS 8
#endif
#define QG_ENTRY gemm_avx512vnni
#define QG_ZMM
#define QG_ENTRY_ZMM gemm_avx512vnni_512
#define QG_QUANTIZE quantize_avx512
#include "quant_gemm_simd.h"
