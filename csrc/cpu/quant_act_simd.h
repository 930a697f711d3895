// Activation rows -> int8 blocks, 8 values per instruction: included once by quant_gemm_simd.h
// (so compiled for AVX2 and again for AVX-512) as QG_QUANTIZE, quant_gemm.cpp's quantize_scalar
// with the same bits for finite x: max |x| is exact in any order, the block scale, its reciprocal
// and each x * (1 / d) are the same float operations, vcvtps2dq rounds half to even as nearbyint
// does in the default rounding mode, and the sums are exact integers.
namespace swiftspec {
namespace quant {

void QG_QUANTIZE(const float* x, int64_t M, int64_t K, int qk, int8_t* q, float* d, int16_t* s16, int16_t* s32) {
  const int64_t nb = K / qk;
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* v = x + m * K + b * qk;
      __m256 mx = _mm256_setzero_ps();
      // (|x|, max) in this order: a NaN x is skipped, as std::max(amax, NaN) skips it
      for (int i = 0; i < qk; i += 8) mx = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(v + i)), mx);
      __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
      h = _mm_max_ps(h, _mm_movehl_ps(h, h));
      h = _mm_max_ss(h, _mm_movehdup_ps(h));
      const float amax = _mm_cvtss_f32(h);
      const float db = amax / 127.f;
      const __m256 id = _mm256_set1_ps(db != 0.f ? 1.f / db : 0.f);
      d[m * nb + b] = db;
      for (int c = 0; c < qk; c += 32) {
        __m256i r[4];
        for (int k = 0; k < 4; ++k) r[k] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + c + 8 * k), id));
        // int32 -> int8 (|r| <= 127, no saturation); the packs interleave 128-bit lanes, `order` undoes it
        const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]), _mm256_packs_epi32(r[2], r[3]));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + m * K + b * qk + c), _mm256_permutevar8x32_epi32(p, order));
        const int lo = hsum8_epi32(_mm256_add_epi32(r[0], r[1])), hi = hsum8_epi32(_mm256_add_epi32(r[2], r[3]));
        s32[m * (K / 32) + (b * qk + c) / 32] = static_cast<int16_t>(lo + hi);
        if (qk == 256) {
          s16[m * (K / 16) + (b * qk + c) / 16] = static_cast<int16_t>(lo);
          s16[m * (K / 16) + (b * qk + c) / 16 + 1] = static_cast<int16_t>(hi);
        }
      }
    }
  }
}

}  // namespace quant
}  // namespace swiftspec
