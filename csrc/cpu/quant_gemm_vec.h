// The register width of the interleaved kernels of quant_gemm_x8.h, one output column per int32
// lane: Vec<__m256i> reads the 8-row interleaved layout (kX8: a group block is a run of 32-byte
// registers, 4 quant bytes of each of 8 rows), Vec<__m512i> (the AVX-512 kernel, QG_ZMM) the
// 16-row one (kX16: the fields of two 8-row group blocks merged, every field twice as wide and at
// twice its 8-row offset, rows 0-7's half first; quant_blocks.h, x16_source). The kernels address a
// field by its 8-row offset times kScale, so one body serves both. Every lane does the same integer
// and float operations at either width: both give the same bits. Included by quant_gemm_x8.h
// under the ISA file's `#pragma GCC target`.

// (the vector types' alignment attributes do not matter for a template argument that only selects)
#pragma GCC diagnostic ignored "-Wignored-attributes"

namespace swiftspec {
namespace quant {
namespace {

template <class V>
struct Vec;

template <>
struct Vec<__m256i> {
  using I = __m256i;
  using F = __m256;
  static constexpr int kCols = 8;   // output columns (interleaved rows) per vector
  static constexpr int kScale = 1;  // byte offsets of this layout per byte of the 8-row one
  static I load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  // a field of 8 fp16 values -> fp32, exact
  static F load_ph(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  // a field of 8 bytes (the first half of a 16-byte header field) -> zero-extended int32 lanes
  static I load_u8(const uint8_t* p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }
  static I zero() { return _mm256_setzero_si256(); }
  static I set8(int v) { return _mm256_set1_epi8(static_cast<char>(v)); }
  static I set16(int v) { return _mm256_set1_epi16(static_cast<short>(v)); }
  static I set32(int v) { return _mm256_set1_epi32(v); }
  static I bcast128(__m128i v) { return _mm256_broadcastsi128_si256(v); }
  static I and_(I a, I b) { return _mm256_and_si256(a, b); }
  static I or_(I a, I b) { return _mm256_or_si256(a, b); }
  static I add8(I a, I b) { return _mm256_add_epi8(a, b); }
  static I add16(I a, I b) { return _mm256_add_epi16(a, b); }
  static I add32(I a, I b) { return _mm256_add_epi32(a, b); }
  static I sub32(I a, I b) { return _mm256_sub_epi32(a, b); }
  static I mullo32(I a, I b) { return _mm256_mullo_epi32(a, b); }
  static I madd16(I a, I b) { return _mm256_madd_epi16(a, b); }
  static I maddubs(I u, I s) { return _mm256_maddubs_epi16(u, s); }
  static I shuffle8(I a, I idx) { return _mm256_shuffle_epi8(a, idx); }
  static I srli16(I a, int n) { return _mm256_srli_epi16(a, n); }
  static I slli16(I a, int n) { return _mm256_slli_epi16(a, n); }
  static I srli32(I a, int n) { return _mm256_srli_epi32(a, n); }
  static I slli32(I a, int n) { return _mm256_slli_epi32(a, n); }
  static I srai16(I a, int n) { return _mm256_srai_epi16(a, n); }
  static I srai32(I a, int n) { return _mm256_srai_epi32(a, n); }
  // a's bytes negated where b < 0, zeroed where b == 0 (vpsignb)
  static I sign8(I a, I b) { return _mm256_sign_epi8(a, b); }
  static F cvt(I a) { return _mm256_cvtepi32_ps(a); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F fnmadd(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F set1(float v) { return _mm256_set1_ps(v); }
  static F loadf(const float* p) { return _mm256_loadu_ps(p); }
  static void storef(float* p, F v) { _mm256_storeu_ps(p, v); }
#ifdef QG_DPBUSD
  static I dpbusd(I h, I u, I x) { return QG_DPBUSD(h, u, x); }
  // h + dpbusd(u, the 4 bytes at x in every lane), the broadcast embedded in the instruction (EVEX)
  static I dpbusd_bcast(I h, I u, const int8_t* x) {
    asm("vpdpbusd %2%{1to8%}, %1, %0" : "+v"(h) : "v"(u), "m"(*reinterpret_cast<const int32_t*>(x)));
    return h;
  }
#endif
};

#ifdef QG_ZMM
template <>
struct Vec<__m512i> {
  using I = __m512i;
  using F = __m512;
  static constexpr int kCols = 16;
  static constexpr int kScale = 2;
  static I load(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static F load_ph(const uint8_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  // the first 8 bytes of each half of a 32-byte header field (rows 0-7 at p, rows 8-15 at p + 16)
  static I load_u8(const uint8_t* p) {
    return _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)),
                                                   _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 16))));
  }
  static I zero() { return _mm512_setzero_si512(); }
  static I set8(int v) { return _mm512_set1_epi8(static_cast<char>(v)); }
  static I set16(int v) { return _mm512_set1_epi16(static_cast<short>(v)); }
  static I set32(int v) { return _mm512_set1_epi32(v); }
  static I bcast128(__m128i v) { return _mm512_broadcast_i32x4(v); }
  static I and_(I a, I b) { return _mm512_and_si512(a, b); }
  static I or_(I a, I b) { return _mm512_or_si512(a, b); }
  static I add8(I a, I b) { return _mm512_add_epi8(a, b); }
  static I add16(I a, I b) { return _mm512_add_epi16(a, b); }
  static I add32(I a, I b) { return _mm512_add_epi32(a, b); }
  static I sub32(I a, I b) { return _mm512_sub_epi32(a, b); }
  static I mullo32(I a, I b) { return _mm512_mullo_epi32(a, b); }
  static I madd16(I a, I b) { return _mm512_madd_epi16(a, b); }
  static I maddubs(I u, I s) { return _mm512_maddubs_epi16(u, s); }
  static I shuffle8(I a, I idx) { return _mm512_shuffle_epi8(a, idx); }
  static I srli16(I a, int n) { return _mm512_srli_epi16(a, static_cast<unsigned>(n)); }
  static I slli16(I a, int n) { return _mm512_slli_epi16(a, static_cast<unsigned>(n)); }
  static I srli32(I a, int n) { return _mm512_srli_epi32(a, static_cast<unsigned>(n)); }
  static I slli32(I a, int n) { return _mm512_slli_epi32(a, static_cast<unsigned>(n)); }
  static I srai16(I a, int n) { return _mm512_srai_epi16(a, static_cast<unsigned>(n)); }
  static I srai32(I a, int n) { return _mm512_srai_epi32(a, static_cast<unsigned>(n)); }
  static I sign8(I a, I b) {  // no vpsignb at 512 bits: negate under b's sign bits, zero where b == 0
    const I neg = _mm512_mask_sub_epi8(a, _mm512_movepi8_mask(b), _mm512_setzero_si512(), a);
    return _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(b, b), neg);
  }
  static F cvt(I a) { return _mm512_cvtepi32_ps(a); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F fnmadd(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F set1(float v) { return _mm512_set1_ps(v); }
  static F loadf(const float* p) { return _mm512_loadu_ps(p); }
  static void storef(float* p, F v) { _mm512_storeu_ps(p, v); }
  static I dpbusd(I h, I u, I x) { return _mm512_dpbusd_epi32(h, u, x); }
  static I dpbusd_bcast(I h, I u, const int8_t* x) {
    asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(h) : "v"(u), "m"(*reinterpret_cast<const int32_t*>(x)));
    return h;
  }
};
#endif

}  // namespace
}  // namespace quant
}  // namespace swiftspec
