// The register width of the interleaved (x8) kernels of quant_gemm_x8.h. An interleaved group
// block is a run of 32-byte registers, each holding 4 consecutive quant bytes of each of the 8
// columns (quant_blocks.h). Vec<__m256i> takes one such register per vector (int32 lane c:
// column c); Vec<__m512i> (the AVX-512 kernel, QG_ZMM) takes two consecutive ones, registers s
// and s + 1, in one 64-byte load (lane c: column c's values of register s, lane 8 + c: of
// register s + 1), so the weights still stream from memory in one forward pass. Its activation
// operand puts the row's 4 values of register s in lanes 0-7 and of register s + 1 in lanes
// 8-15; `fold` adds the two halves. The products are summed as exact int32 integers, so the sum of
// a column comes out the same whatever lanes its terms took: both widths give the same bits.
// Per-column tables (scales, mins, float scales) stay 256-bit; `dup` copies one into both halves.
// Included by quant_gemm_x8.h under the ISA file's `#pragma GCC target`.

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
  static constexpr int kRegs = 1;  // 32-byte registers of a group block per vector
  static I load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  // the row's 4 int8 values x[0..3] in every lane
  static I xop(const int8_t* x) {
    int32_t v;
    __builtin_memcpy(&v, x, 4);
    return _mm256_set1_epi32(v);
  }
  static I dup(__m256i t) { return t; }
  static __m256i fold(I v) { return v; }
  // shift each 32-bit lane right by `base` bits (by base + per_reg in a second register's lanes)
  static I srl_regs(I v, int base, int) { return _mm256_srli_epi32(v, base); }
  static I zero() { return _mm256_setzero_si256(); }
  static I set8(int v) { return _mm256_set1_epi8(static_cast<char>(v)); }
  static I and_(I a, I b) { return _mm256_and_si256(a, b); }
  static I or_(I a, I b) { return _mm256_or_si256(a, b); }
  static I add16(I a, I b) { return _mm256_add_epi16(a, b); }
  static I add32(I a, I b) { return _mm256_add_epi32(a, b); }
  static I mullo32(I a, I b) { return _mm256_mullo_epi32(a, b); }
  static I madd16(I a, I b) { return _mm256_madd_epi16(a, b); }
  static I maddubs(I u, I s) { return _mm256_maddubs_epi16(u, s); }
  static I shuffle8(I a, I idx) { return _mm256_shuffle_epi8(a, idx); }
  static I srli16(I a, int n) { return _mm256_srli_epi16(a, n); }
  static I slli16(I a, int n) { return _mm256_slli_epi16(a, n); }
  // a's bytes negated where b < 0, zeroed where b == 0 (vpsignb)
  static I sign8(I a, I b) { return _mm256_sign_epi8(a, b); }
  // v's bytes where a == b, else 0
  static I select_eq8(I a, I b, I v) { return _mm256_and_si256(_mm256_cmpeq_epi8(a, b), v); }
#ifdef QG_DPBUSD
  static I dpbusd(I h, I u, I x) { return QG_DPBUSD(h, u, x); }
#endif
};

#ifdef QG_ZMM
template <>
struct Vec<__m512i> {
  using I = __m512i;
  static constexpr int kRegs = 2;
  static I load(const uint8_t* p) { return _mm512_loadu_si512(p); }
  // x[0..3] in lanes 0-7, x[4..7] in lanes 8-15
  static I xop(const int8_t* x) {  // two broadcast loads, the second under a mask (no shuffle)
    return _mm512_mask_broadcastd_epi32(_mm512_broadcastd_epi32(_mm_loadu_si32(x)), 0xFF00, _mm_loadu_si32(x + 4));
  }
  static I dup(__m256i t) { return _mm512_broadcast_i64x4(t); }
  static __m256i fold(I v) { return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1)); }
  static I srl_regs(I v, int base, int per_reg) {
    return _mm512_srlv_epi32(v, _mm512_inserti64x4(_mm512_set1_epi32(base), _mm256_set1_epi32(base + per_reg), 1));
  }
  static I zero() { return _mm512_setzero_si512(); }
  static I set8(int v) { return _mm512_set1_epi8(static_cast<char>(v)); }
  static I and_(I a, I b) { return _mm512_and_si512(a, b); }
  static I or_(I a, I b) { return _mm512_or_si512(a, b); }
  static I add16(I a, I b) { return _mm512_add_epi16(a, b); }
  static I add32(I a, I b) { return _mm512_add_epi32(a, b); }
  static I mullo32(I a, I b) { return _mm512_mullo_epi32(a, b); }
  static I madd16(I a, I b) { return _mm512_madd_epi16(a, b); }
  static I maddubs(I u, I s) { return _mm512_maddubs_epi16(u, s); }
  static I shuffle8(I a, I idx) { return _mm512_shuffle_epi8(a, idx); }
  static I srli16(I a, int n) { return _mm512_srli_epi16(a, static_cast<unsigned>(n)); }
  static I slli16(I a, int n) { return _mm512_slli_epi16(a, static_cast<unsigned>(n)); }
  static I sign8(I a, I b) {  // no vpsignb at 512 bits: negate under b's sign bits, zero where b == 0
    const I neg = _mm512_mask_sub_epi8(a, _mm512_movepi8_mask(b), _mm512_setzero_si512(), a);
    return _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(b, b), neg);
  }
  static I select_eq8(I a, I b, I v) { return _mm512_maskz_mov_epi8(_mm512_cmpeq_epi8_mask(a, b), v); }
  static I dpbusd(I h, I u, I x) { return _mm512_dpbusd_epi32(h, u, x); }
};
#endif

}  // namespace
}  // namespace quant
}  // namespace swiftspec
