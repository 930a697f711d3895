// The 256-bit body of the quantized skinny GEMM, shared by the AVX2 and the AVX-512 VNNI kernels
// (quant_gemm_avx2.cpp, quant_gemm_avx512.cpp). Each of those files sets its `#pragma GCC
// target`, defines the three ISA primitives below and then includes this file once:
//
//   scale_table(sc)    the 8 unsigned sub-scales sc[0..7] of a super-block, kept in a register
//   scale_of(t, j)     sub-scale j of that table in the form dot_k wants, for all 8 lanes
//   scale_pair(s8, k)  int8 scales s8[2k] (lanes 0-3) and s8[2k+1] (lanes 4-7), likewise
//   dot_k(q, x, s)     int32 lanes: s * (sum of 4 consecutive u8 q * s8 x products)
//   dot_0(aq, sx)      int32 lanes: sum of 4 consecutive u8 aq * s8 sx products
//
// and QG_ENTRY, the name of the entry point, and QG_QUANTIZE, that of the activation quantizer
// (quant_act_simd.h). The AVX-512 file also defines QG_ZMM and QG_ENTRY_ZMM: a second entry point
// that also reads the 16-row interleaved layout, on 512-bit registers.
// Both primitives give the same exact integers
// (maddubs never saturates here: |q| <= 63 for the K types and |x| <= 127), so both kernels
// equal the scalar one bit for bit (quant_blocks.h says which operations, in which order).
// Everything is in an anonymous namespace: nothing compiled for one ISA is shared with another.
namespace swiftspec {
namespace quant {
namespace {

// fp16 -> fp32 with F16C (exact, the same value as quant_blocks.h's load_f16)
static inline float load_h(const uint8_t* p) {
  uint16_t h;
  __builtin_memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

static inline __m256i loadu(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
static inline __m256i nib_lo(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
static inline __m256i nib_hi(__m256i v) {
  return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F));
}
// bits (shift, shift+1 ..) of every byte, `mask` wide, moved to bit 4 of the byte
static inline __m256i high_bits(__m256i v, int shift, int mask) {
  const __m256i b = _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(shift)), _mm256_set1_epi8(mask));
  return _mm256_slli_epi16(b, 4);
}
// 0xFF in byte i where bit i of the 32-bit word is set, else 0
static inline __m256i bits_to_bytes(uint32_t bits) {
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL, 0x0101010101010101LL, 0));
  const __m256i others = _mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfeLL));
  return _mm256_cmpeq_epi8(others, _mm256_set1_epi8(-1));
}

// exact: the int32 lanes' sum
static inline int hsum8_epi32(__m256i v) {
  const __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  const __m128i s2 = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  return _mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32(s2, 1)));
}

template <int MR>
struct Rows {
  const int8_t* xq[MR];
  const float* xd[MR];
  const int16_t* xs[MR];
  float y[MR];  // the column's value
};

template <int MR>
static inline void k_group(Rows<MR>& r, __m256i* acc, __m256i q, int64_t xoff, __m256i s) {
  for (int i = 0; i < MR; ++i) acc[i] = _mm256_add_epi32(acc[i], dot_k(q, loadu(r.xq[i] + xoff), s));
}

// End of a super-block: the exact integer sum of the lanes, scaled, into the column's value;
// then the min term sum_j mn16[j] * xs[j] (exact in int32), scaled and subtracted. mn16: the 16
// per-16-value mins as int16 lanes.
template <int MR>
static inline void k_finish(Rows<MR>& r, const __m256i* acc, int64_t b, float d, float dmin, __m256i mn16) {
  for (int i = 0; i < MR; ++i) {
    const float da = r.xd[i][b];
    const int msum = hsum8_epi32(_mm256_madd_epi16(mn16, loadu(r.xs[i] + b * 16)));
    r.y[i] = __builtin_fmaf(static_cast<float>(hsum8_epi32(acc[i])), d * da, r.y[i]);
    r.y[i] = __builtin_fmaf(-static_cast<float>(msum), dmin * da, r.y[i]);
  }
}

template <int MR, bool q5>
static void col_q45k(const uint8_t* wrow, int64_t nb, Rows<MR>& r) {
  const int bb = q5 ? 176 : 144;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = wrow + b * bb;
    const float d = load_h(blk), dmin = load_h(blk + 2);
    // the 6-bit scales and mins of the 8 sub-blocks, 4 per 32-bit word (get_scale_min_k4 on
    // every byte at once)
    uint32_t u[3];
    __builtin_memcpy(u, blk + 4, 12);
    uint32_t sm[4];
    sm[0] = u[0] & 0x3f3f3f3fu;                                               // scales 0-3
    sm[1] = (u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4);        // scales 4-7
    sm[2] = u[1] & 0x3f3f3f3fu;                                               // mins 0-3
    sm[3] = ((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4); // mins 4-7
    const __m256i sct = scale_table(reinterpret_cast<const uint8_t*>(sm));
    const __m128i mn8 = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sm + 2)));
    const __m256i mn16 = _mm256_set_m128i(_mm_unpackhi_epi16(mn8, mn8), _mm_unpacklo_epi16(mn8, mn8));
    const uint8_t* qs = blk + (q5 ? 48 : 16);
    const __m256i hb = q5 ? loadu(blk + 16) : _mm256_setzero_si256();
    __m256i acc[MR];
    for (int i = 0; i < MR; ++i) acc[i] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      const __m256i raw = loadu(qs + 32 * c);
      __m256i q0 = nib_lo(raw), q1 = nib_hi(raw);
      if (q5) {
        q0 = _mm256_or_si256(q0, high_bits(hb, 2 * c, 1));
        q1 = _mm256_or_si256(q1, high_bits(hb, 2 * c + 1, 1));
      }
      k_group<MR>(r, acc, q0, b * 256 + 64 * c, scale_of(sct, 2 * c));
      k_group<MR>(r, acc, q1, b * 256 + 64 * c + 32, scale_of(sct, 2 * c + 1));
    }
    k_finish<MR>(r, acc, b, d, dmin, mn16);
  }
}

template <int MR>
static void col_q6k(const uint8_t* wrow, int64_t nb, Rows<MR>& r) {
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = wrow + b * 210;
    const float d = load_h(blk + 208);
    const __m128i sc16 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192));
    const __m256i mn16 = _mm256_cvtepi8_epi16(sc16);
    __m256i acc[MR];
    for (int i = 0; i < MR; ++i) acc[i] = _mm256_setzero_si256();
    for (int h = 0; h < 2; ++h) {
      const __m256i l0 = loadu(blk + 64 * h), l1 = loadu(blk + 64 * h + 32), hq = loadu(blk + 128 + 32 * h);
      const int64_t base = b * 256 + 128 * h;
      const __m128i s8 = h ? _mm_srli_si128(sc16, 8) : sc16;  // this half's 8 scales, bytes 0-7
      k_group<MR>(r, acc, _mm256_or_si256(nib_lo(l0), high_bits(hq, 0, 3)), base, scale_pair(s8, 0));
      k_group<MR>(r, acc, _mm256_or_si256(nib_lo(l1), high_bits(hq, 2, 3)), base + 32, scale_pair(s8, 1));
      k_group<MR>(r, acc, _mm256_or_si256(nib_hi(l0), high_bits(hq, 4, 3)), base + 64, scale_pair(s8, 2));
      k_group<MR>(r, acc, _mm256_or_si256(nib_hi(l1), high_bits(hq, 6, 3)), base + 96, scale_pair(s8, 3));
    }
    k_finish<MR>(r, acc, b, d, 32.f * d, mn16);
  }
}

// Q4_0 / Q5_0 / Q8_0 / AWQ4: signed values; |q| goes to maddubs' unsigned side, q's sign onto x.
template <int MR>
static void col_q0(int type, const uint8_t* wrow, int64_t nb, Rows<MR>& r) {
  const int bb = block_bytes(type);
  const bool awq = type == kAWQ4;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = wrow + b * bb;
    const float d = load_h(blk);
    __m256i q;
    if (type == kQ8_0) {
      q = loadu(blk + 2);
    } else {
      const bool q5 = type == kQ5_0;
      const int nib_off = q5 ? 6 : (awq ? 4 : 2);  // where the 16 bytes of nibbles start
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + nib_off));
      q = nib_lo(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw));
      if (q5) {
        uint32_t qh;
        __builtin_memcpy(&qh, blk + 2, 4);
        q = _mm256_or_si256(q, _mm256_and_si256(bits_to_bytes(qh), _mm256_set1_epi8(0x10)));
      }
      // the zero point: 16 (Q5_0), 8 (Q4_0) or the block's own (AWQ4)
      q = _mm256_sub_epi8(q, _mm256_set1_epi8(static_cast<char>(awq ? blk[2] : (q5 ? 16 : 8))));
    }
    const __m256i aq = _mm256_sign_epi8(q, q);
    for (int i = 0; i < MR; ++i) {
      const int isum = hsum8_epi32(dot_0(aq, _mm256_sign_epi8(loadu(r.xq[i] + b * 32), q)));
      r.y[i] = __builtin_fmaf(static_cast<float>(isum), d * r.xd[i][b], r.y[i]);
    }
  }
}

template <int MR>
static void column(const Problem& p, int64_t m0, int64_t n, float* out, int64_t ldo, int64_t col) {
  const int qk = block_values(p.type);
  const int64_t nb = p.K / qk;
  Rows<MR> r;
  for (int i = 0; i < MR; ++i) {
    r.xq[i] = p.xq + (m0 + i) * p.K;
    r.xd[i] = p.xd + (m0 + i) * nb;
    r.xs[i] = p.xs != nullptr ? p.xs + (m0 + i) * (p.K / 16) : nullptr;
    r.y[i] = 0.f;
  }
  const uint8_t* wrow = p.w + n * p.row_bytes;
  switch (p.type) {
    case kQ4_K: col_q45k<MR, false>(wrow, nb, r); break;
    case kQ5_K: col_q45k<MR, true>(wrow, nb, r); break;
    case kQ6_K: col_q6k<MR>(wrow, nb, r); break;
    default: col_q0<MR>(p.type, wrow, nb, r); break;
  }
  for (int i = 0; i < MR; ++i) out[(m0 + i) * ldo + col] = r.y[i];
}

}  // namespace
}  // namespace quant
}  // namespace swiftspec

#include "quant_gemm_x8.h"

namespace swiftspec {
namespace quant {

namespace {

// Columns in tiles of 16; inside a tile the rows go in groups of up to 8 (one set of
// accumulators in registers), so a column's weights come from memory once and from L1/L2 for
// the following row groups. Interleaved weights go by their groups of 8 (or, in the AVX-512
// kernel's 512-bit entry point, 16) columns; n0 and n1 are multiples of the group there.
template <bool wide>
void gemm(const Problem& p, int64_t n0, int64_t n1, float* out, int64_t ldo) {
#ifdef QG_ZMM
  if (wide && is_x16(p.type)) {
    for (int64_t n = n0; n < n1; n += 16) x8_group<__m512i>(p, n, out + (n - n0), ldo);
    return;
  }
#endif
  if (is_x8(p.type)) {
    for (int64_t n = n0; n < n1; n += 8) x8_group<__m256i>(p, n, out + (n - n0), ldo);
    return;
  }
  constexpr int64_t kTile = 16;
  for (int64_t t0 = n0; t0 < n1; t0 += kTile) {
    const int64_t t1 = t0 + kTile < n1 ? t0 + kTile : n1;
    for (int64_t m0 = 0; m0 < p.M; m0 += 8) {
      const int64_t mr = p.M - m0 < 8 ? p.M - m0 : 8;
      for (int64_t n = t0; n < t1; ++n) {
        switch (mr) {
          case 1: column<1>(p, m0, n, out, ldo, n - n0); break;
          case 2: column<2>(p, m0, n, out, ldo, n - n0); break;
          case 3: column<3>(p, m0, n, out, ldo, n - n0); break;
          case 4: column<4>(p, m0, n, out, ldo, n - n0); break;
          case 5: column<5>(p, m0, n, out, ldo, n - n0); break;
          case 6: column<6>(p, m0, n, out, ldo, n - n0); break;
          case 7: column<7>(p, m0, n, out, ldo, n - n0); break;
          default: column<8>(p, m0, n, out, ldo, n - n0); break;
        }
      }
    }
  }
}

}  // namespace

void QG_ENTRY(const Problem& p, int64_t n0, int64_t n1, float* out, int64_t ldo) { gemm<false>(p, n0, n1, out, ldo); }
#ifdef QG_ZMM
void QG_ENTRY_ZMM(const Problem& p, int64_t n0, int64_t n1, float* out, int64_t ldo) {
  gemm<true>(p, n0, n1, out, ldo);
}
#endif

}  // namespace quant
}  // namespace swiftspec

#include "quant_act_simd.h"
