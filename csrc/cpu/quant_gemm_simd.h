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
// and QG_ENTRY, the name of the entry point. Both primitives give the same exact integers
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

// ---- 8-row interleaved Q4_K and 32-value types (quant_blocks.h, x8_source): int32 lane c = output
// column c. Per row, a Q4_K sub-block's 8 registers of products are summed in int16 (|q x + q x| <=
// 2 * 15 * 127, so never saturating) before one vpmaddwd by the column's sub-block scale, or with
// VNNI summed by vpdpbusd in int32 before one vpmulld (x8_acc below); the same integers either way.

static inline __m256i bcast32(const void* p) {
  int32_t v;
  __builtin_memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}
// vpshufb of every 32-bit lane of t by the same 4 byte indices `within` (0x80: a zero byte)
static inline __m256i lane_shuffle(__m256i t, uint32_t within) {
  const __m256i idx = _mm256_add_epi8(_mm256_set1_epi32(static_cast<int>(within)),
                                      _mm256_setr_epi8(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12, 0, 0, 0,
                                                       0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12));
  return _mm256_shuffle_epi8(t, idx);
}
// int16 lanes (byte j0, byte j1) of each 32-bit lane of t (bytes zero-extended)
static inline __m256i bytes16(__m256i t, int j0, int j1) {
  return lane_shuffle(t, 0x80008000u | (static_cast<uint32_t>(j1) << 16) | static_cast<uint32_t>(j0));
}
// int16 lanes (byte j0, byte j1) of each 32-bit lane of t, sign-extended
static inline __m256i sbytes16(__m256i t, int j0, int j1) {
  return _mm256_srai_epi16(
      lane_shuffle(t, 0x00800080u | (static_cast<uint32_t>(j1) << 24) | (static_cast<uint32_t>(j0) << 8)), 8);
}
// pins a value in a register at this point of the instruction stream (volatile asm statements
// keep their order): stops the compiler from decoding every weight register of a block up front
// and re-associating the running sums into a tree of spilled temporaries
#ifdef QG_DPBUSD
#define QG_KEEP(v) asm volatile("" : "+v"(v))
#else
#define QG_KEEP(v) asm volatile("" : "+x"(v))
#endif

// Per row and column, running sums of 4 u8 x s8 products: with VNNI (QG_DPBUSD, defined by the
// AVX-512 kernel) one vpdpbusd straight into int32 lanes; otherwise vpmaddubsw summed in int16 lanes,
// widened by one vpmaddwd. x8_acc adds one register's products (`first`: starting from zero),
// x8_scaled gives the int32 sums times the per-column scale `s` in the form of x8_scale (byte j of
// every column's 32-bit word of scales, unsigned) or x8_sscale (signed), x8_widen
// the plain int32 sums. Both give the same exact integers.
#ifdef QG_DPBUSD
static inline __m256i x8_acc(__m256i h, __m256i u, __m256i x, bool first) {
  return QG_DPBUSD(first ? _mm256_setzero_si256() : h, u, x);
}
static inline __m256i x8_scale(__m256i t, int j) {  // byte j of each 32-bit lane of t, as int32
  return lane_shuffle(t, 0x80808000u | static_cast<uint32_t>(j));
}
static inline __m256i x8_sscale(__m256i t, int j) {  // signed byte j of each 32-bit lane, as int32
  return _mm256_srai_epi32(lane_shuffle(t, 0x00808080u | (static_cast<uint32_t>(j) << 24)), 24);
}
static inline __m256i x8_scaled(__m256i h, __m256i s) { return _mm256_mullo_epi32(h, s); }
static inline __m256i x8_widen(__m256i h) { return h; }
constexpr int kX8Int16Sums = 8;  // registers summed before widening: all of a block
constexpr int kX8Rows = QG_X8_ROWS;  // rows per register set (32 ymm registers with AVX-512)
#else
static inline __m256i x8_acc(__m256i h, __m256i u, __m256i x, bool first) {
  const __m256i p = _mm256_maddubs_epi16(u, x);
  return first ? p : _mm256_add_epi16(h, p);
}
static inline __m256i x8_scale(__m256i t, int j) { return bytes16(t, j, j); }
static inline __m256i x8_sscale(__m256i t, int j) { return sbytes16(t, j, j); }
static inline __m256i x8_scaled(__m256i h, __m256i s) { return _mm256_madd_epi16(h, s); }
static inline __m256i x8_widen(__m256i h) { return _mm256_madd_epi16(h, _mm256_set1_epi16(1)); }
constexpr int kX8Int16Sums = 0;  // 0: as far as int16 cannot overflow (q0_x8_rows)
constexpr int kX8Rows = 4;  // rows per register set (16 ymm registers)
#endif

// the rows' float results, column c in lane c, updated once per super-block in the same order as
// quant_blocks.h: fma(float(isum), d * da), then fma(-float(msum), dmin * da)
static inline void x8_finish(float* f, __m256i isum, __m256i msum, __m256 d, __m256 dmin, float da) {
  const __m256 a = _mm256_set1_ps(da);
  __m256 y = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(d, a), _mm256_loadu_ps(f));
  _mm256_storeu_ps(f, _mm256_fnmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_mul_ps(dmin, a), y));
}

struct X8Rows {
  const int8_t* xq[16];
  const float* xd[16];
  const int16_t* xs[16];
  const int16_t* xs32[16];
  float* f[16];
};

// Q4_K tables of one group super-block: the 6-bit scales and mins of 8 sub-blocks x 8 columns
// (get_scale_min_k4 on 4 bytes of every column at once), sub-blocks 0-3 / 4-7 as bytes 0-3.
struct Q4KTables {
  __m256 d, dmin;
  __m256i sc03, sc47, mn03, mn47;
};

static inline Q4KTables q4k_tables(const uint8_t* blk) {
  Q4KTables t;
  t.d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));
  t.dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16)));
  const __m256i u0 = loadu(blk + 32), u1 = loadu(blk + 64), u2 = loadu(blk + 96);
  const __m256i k3f = _mm256_set1_epi8(0x3f), k0f = _mm256_set1_epi8(0x0f), k03 = _mm256_set1_epi8(0x03);
  t.sc03 = _mm256_and_si256(u0, k3f);
  t.sc47 = _mm256_or_si256(_mm256_and_si256(u2, k0f),
                           _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(u0, 6), k03), 4));
  t.mn03 = _mm256_and_si256(u1, k3f);
  t.mn47 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(u2, 4), k0f),
                           _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(u1, 6), k03), 4));
  return t;
}

// (not inlined: one register allocation per row count, and none shared with the caller's loops)
template <int MR>
__attribute__((noinline)) static void q4k_x8_rows(const uint8_t* blk, int64_t b, const Q4KTables& t, const X8Rows& r, int i0) {
  __m256i acc[MR];
  for (int i = 0; i < MR; ++i) acc[i] = _mm256_setzero_si256();
#pragma GCC unroll 1
  for (int cc = 0; cc < 4; ++cc) {
    const __m256i tab = cc < 2 ? t.sc03 : t.sc47;
    const int j = (2 * cc) & 3;
    const __m256i sa = x8_scale(tab, j), sb = x8_scale(tab, j + 1);
    __m256i ha[MR], hb[MR];
#pragma GCC unroll 8
    for (int s = 0; s < 8; ++s) {
      const __m256i raw = loadu(blk + 128 + (8 * cc + s) * 32);
      __m256i lo = nib_lo(raw), hi = nib_hi(raw);
      QG_KEEP(lo);
      QG_KEEP(hi);
      for (int i = 0; i < MR; ++i) {
        const int8_t* x = r.xq[i0 + i] + b * 256 + 64 * cc + 4 * s;
        ha[i] = x8_acc(ha[i], lo, bcast32(x), s == 0);
        hb[i] = x8_acc(hb[i], hi, bcast32(x + 32), s == 0);
        QG_KEEP(ha[i]);
        QG_KEEP(hb[i]);
      }
    }
    for (int i = 0; i < MR; ++i)
      acc[i] = _mm256_add_epi32(acc[i], _mm256_add_epi32(x8_scaled(ha[i], sa), x8_scaled(hb[i], sb)));
  }
  for (int i = 0; i < MR; ++i) {
    // min term: sub-block pairs (2p, 2p + 1) against the row's sums of 32
    const int16_t* xs = r.xs32[i0 + i] + b * 8;
    __m256i ms = _mm256_madd_epi16(bytes16(t.mn03, 0, 1), bcast32(xs));
    ms = _mm256_add_epi32(ms, _mm256_madd_epi16(bytes16(t.mn03, 2, 3), bcast32(xs + 2)));
    ms = _mm256_add_epi32(ms, _mm256_madd_epi16(bytes16(t.mn47, 0, 1), bcast32(xs + 4)));
    ms = _mm256_add_epi32(ms, _mm256_madd_epi16(bytes16(t.mn47, 2, 3), bcast32(xs + 6)));
    x8_finish(r.f[i0 + i], acc[i], ms, t.d, t.dmin, r.xd[i0 + i][b]);
  }
}

// Q6_K tables of one group super-block: d, dmin = 32 d (the -32 offset) and the 16 int8
// sub-block scales of the 8 columns as 4 registers (word w of column c: scales 4w..4w+3).
struct Q6KTables {
  __m256 d, dmin;
  __m256i sc[4];
};

static inline Q6KTables q6k_tables(const uint8_t* blk) {
  Q6KTables t;
  t.d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));
  t.dmin = _mm256_mul_ps(t.d, _mm256_set1_ps(32.f));
  for (int w = 0; w < 4; ++w) t.sc[w] = loadu(blk + 16 + 32 * w);
  return t;
}

// Sub-block j (16 values) of half h, quarter q and kind v (ggml's dequantize_row_q6_K: v = 0..3
// take ql's low nibbles, ql + 32's low, ql's high, ql + 32's high, with qh bits 2v, 2v + 1) is
// j = 8 h + 2 v + q; its 4 registers e hold values 16 j + 4 e + t as u = q + 32 (0..63). Per row
// the products go `lim` registers at a time into int16 (2 * 2 * 63 * 127 < 2^15) or, with VNNI,
// all 4 into int32, then times the signed sub-block scale; the min term: sum_j sc_j * xs_j.
template <int MR>
__attribute__((noinline)) static void q6k_x8_rows(const uint8_t* blk, int64_t b, const Q6KTables& t, const X8Rows& r, int i0) {
  constexpr int lim = kX8Int16Sums ? 4 : 2;
  const __m256i k30 = _mm256_set1_epi8(0x30);
  __m256i acc[MR];
  for (int i = 0; i < MR; ++i) acc[i] = _mm256_setzero_si256();
  // fully unrolled: every offset a constant
#pragma GCC unroll 4
  for (int hq = 0; hq < 4; ++hq) {
    const int h = hq / 2, q = hq % 2;
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) {
      const int j = 8 * h + 2 * v + q;
      const __m256i sc = x8_sscale(t.sc[j / 4], j % 4);
      __m256i hs[MR];
#pragma GCC unroll 4
      for (int e = 0; e < 4; ++e) {
        const uint8_t* chunk = blk + 144 + 384 * hq;  // quant_blocks.h: qh, ql, ql + 32 registers of (h, q)
        const __m256i ql = loadu(chunk + 128 + 128 * (v & 1) + 32 * e);
        const __m256i qh = loadu(chunk + 32 * e);
        const __m256i hb = v == 0 ? _mm256_slli_epi16(qh, 4)
                                  : (v == 1 ? _mm256_slli_epi16(qh, 2) : (v == 2 ? qh : _mm256_srli_epi16(qh, 2)));
        const __m256i u = _mm256_or_si256(v < 2 ? nib_lo(ql) : nib_hi(ql), _mm256_and_si256(hb, k30));
        for (int i = 0; i < MR; ++i) {
          hs[i] = x8_acc(hs[i], u, bcast32(r.xq[i0 + i] + b * 256 + 16 * j + 4 * e), e % lim == 0);
          if (e % lim == lim - 1) acc[i] = _mm256_add_epi32(acc[i], x8_scaled(hs[i], sc));
        }
      }
    }
  }
  for (int i = 0; i < MR; ++i) {
    const int16_t* xs = r.xs[i0 + i] + b * 16;
    __m256i ms = _mm256_setzero_si256();
    for (int p = 0; p < 8; ++p)
      ms = _mm256_add_epi32(ms, _mm256_madd_epi16(sbytes16(t.sc[p / 2], 2 * (p % 2), 2 * (p % 2) + 1), bcast32(xs + 2 * p)));
    x8_finish(r.f[i0 + i], acc[i], ms, t.d, t.dmin, r.xd[i0 + i][b]);
  }
}

// The 32-value types, one group block (8 rows x 32 values) for rows i0..i0+MR: per row, the
// maddubs of the quant registers (unsigned values x the row's int8 values) summed in int16 as
// far as that cannot overflow (with VNNI: vpdpbusd, all 8 in int32) (Q4_0 / AWQ4: 8 products of |q| <= 15, |sum| <= 8 * 2 * 15 * 127
// < 2^15; Q5_0: 4 of |q| <= 31; Q8_0: 1, its signs moved onto x), then vpmaddwd to int32, minus
// z * (sum of the row's 32 values): exactly sum (q - z) * x per column.
struct Q0Group {
  __m256i v[8];  // unsigned quant bytes: values 4s..4s+3 of row c in lane c of v[s] (Q8_0: |q|)
  __m256i sgn[8];  // Q8_0: the signs of q
  __m256i z;     // zero point per column (int32)
  __m256 d;      // block scale per column
};

template <int Base>
static inline void q0_group(const uint8_t* blk, Q0Group& g) {
  g.d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));
  if (Base == kQ8_0) {
    g.z = _mm256_setzero_si256();
    for (int s = 0; s < 8; ++s) {
      const __m256i q = loadu(blk + 16 + 32 * s);
      g.sgn[s] = q;
      g.v[s] = _mm256_sign_epi8(q, q);
    }
    return;
  }
  const bool awq = Base == kAWQ4, q5 = Base == kQ5_0;
  g.z = awq ? _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 16)))
            : _mm256_set1_epi32(q5 ? 16 : 8);
  const uint8_t* qs = blk + (awq ? 32 : (q5 ? 48 : 16));
  const __m256i qh = q5 ? loadu(blk + 16) : _mm256_setzero_si256();
  // byte t of every 32-bit lane: bit t of that lane's low byte (after the shift) -> 0x10
  const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12, 0, 0, 0, 0, 4, 4, 4, 4,
                                          8, 8, 8, 8, 12, 12, 12, 12);
  const __m256i bit = _mm256_set1_epi32(0x08040201);
  for (int s = 0; s < 4; ++s) {
    const __m256i raw = loadu(qs + 32 * s);
    __m256i lo = nib_lo(raw), hi = nib_hi(raw);
    if (q5) {  // bit 4 s + t (low nibbles) and 16 + 4 s + t (high nibbles) of the row's qh
      const __m256i bl = _mm256_shuffle_epi8(_mm256_srli_epi32(qh, 4 * s), spread);
      const __m256i bh = _mm256_shuffle_epi8(_mm256_srli_epi32(qh, 16 + 4 * s), spread);
      const __m256i k10 = _mm256_set1_epi8(0x10);
      lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(bl, bit), bit), k10));
      hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(bh, bit), bit), k10));
    }
    g.v[s] = lo;      // values 4 s + t
    g.v[4 + s] = hi;  // values 16 + 4 s + t
  }
}

// Every block of one group for rows i0..i0+MR, the rows' results kept in registers from block to
// block (one fma per row and block: a load and a store of them per block cost as much as the
// products of a 4-bit block).
template <int Base, int MR>
__attribute__((noinline)) static void q0_x8_rows(const uint8_t* grp, int64_t nb, int64_t gb, const X8Rows& r, int i0) {
  // int16 sums of `lim` maddubs before one vpmaddwd (see above)
  constexpr int lim = kX8Int16Sums ? kX8Int16Sums : (Base == kQ8_0 ? 1 : (Base == kQ5_0 ? 4 : 8));
  __m256 y[MR];
  for (int i = 0; i < MR; ++i) y[i] = _mm256_loadu_ps(r.f[i0 + i]);
  for (int64_t b = 0; b < nb; ++b) {
    Q0Group g;
    q0_group<Base>(grp + b * gb, g);
    __m256i acc[MR], h[MR];
    for (int i = 0; i < MR; ++i) acc[i] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int s = 0; s < 8; ++s) {
      // register s holds values 4 s .. 4 s + 3 (Q8_0) or, for the 4-bit types, v[s] (s < 4) values
      // 4 s + t and v[s] (s >= 4) values 16 + 4 (s - 4) + t: the same offsets 4 s within the block
      const int off = Base == kQ8_0 ? 4 * s : (s < 4 ? 4 * s : 16 + 4 * (s - 4));
      for (int i = 0; i < MR; ++i) {
        __m256i x = bcast32(r.xq[i0 + i] + b * 32 + off);
        if (Base == kQ8_0) x = _mm256_sign_epi8(x, g.sgn[s]);
        h[i] = x8_acc(h[i], g.v[s], x, s % lim == 0);
        if (s % lim == lim - 1) acc[i] = _mm256_add_epi32(acc[i], x8_widen(h[i]));
      }
    }
    for (int i = 0; i < MR; ++i) {
      const __m256i zx = _mm256_mullo_epi32(g.z, _mm256_set1_epi32(r.xs32[i0 + i][b]));
      const __m256 a = _mm256_set1_ps(r.xd[i0 + i][b]);
      y[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(acc[i], zx)), _mm256_mul_ps(g.d, a), y[i]);
    }
  }
  for (int i = 0; i < MR; ++i) _mm256_storeu_ps(r.f[i0 + i], y[i]);
}

// rows [0, mr) in register sets of kX8Rows, then 4, 2 and 1 rows: fn(std::integral_constant<int, MR>, i0)
template <class F>
static inline void x8_row_tiles(int mr, F&& fn) {
  int i0 = 0;
  if constexpr (kX8Rows >= 8)
    for (; i0 + 8 <= mr; i0 += 8) fn(std::integral_constant<int, 8>(), i0);
  for (; i0 + 4 <= mr; i0 += 4) fn(std::integral_constant<int, 4>(), i0);
  for (; i0 + 2 <= mr; i0 += 2) fn(std::integral_constant<int, 2>(), i0);
  for (; i0 < mr; ++i0) fn(std::integral_constant<int, 1>(), i0);
}

template <int Base>
static void q0_x8_group(const uint8_t* grp, int64_t nb, int64_t gb, const X8Rows& r, int mr) {
  x8_row_tiles(mr, [&](auto n, int i0) { q0_x8_rows<Base, decltype(n)::value>(grp, nb, gb, r, i0); });
}

// One group of 8 interleaved columns [n, n + 8) for all rows: out[m * ldo + c], c = 0..7.
static void x8_group(const Problem& p, int64_t n, float* out, int64_t ldo) {
  const int base = base_type(p.type);
  const int qk = block_values(base);
  const int64_t nb = p.K / qk;
  const int64_t gb = 8 * block_bytes(base);  // bytes per group block
  const uint8_t* grp = p.w + n * p.row_bytes;
  for (int64_t m0 = 0; m0 < p.M; m0 += 16) {
    const int mr = static_cast<int>(p.M - m0 < 16 ? p.M - m0 : 16);
    alignas(32) float f[16 * 8];
    X8Rows r;
    for (int i = 0; i < mr; ++i) {
      const int64_t m = m0 + i;
      r.xq[i] = p.xq + m * p.K;
      r.xd[i] = p.xd + m * nb;
      r.xs[i] = p.xs != nullptr ? p.xs + m * (p.K / 16) : nullptr;
      r.xs32[i] = p.xs32 + m * (p.K / 32);
      r.f[i] = f + 8 * i;
      _mm256_store_ps(f + 8 * i, _mm256_setzero_ps());
    }
    switch (base) {  // 32-value types: each row tile through all blocks; K types: each block for all tiles
      case kQ4_0: q0_x8_group<kQ4_0>(grp, nb, gb, r, mr); break;
      case kQ5_0: q0_x8_group<kQ5_0>(grp, nb, gb, r, mr); break;
      case kQ8_0: q0_x8_group<kQ8_0>(grp, nb, gb, r, mr); break;
      case kAWQ4: q0_x8_group<kAWQ4>(grp, nb, gb, r, mr); break;
      default:
        for (int64_t b = 0; b < nb; ++b) {
          const uint8_t* blk = grp + b * gb;
          if (base == kQ4_K) {
            const Q4KTables t = q4k_tables(blk);
            x8_row_tiles(mr, [&](auto n, int i0) { q4k_x8_rows<decltype(n)::value>(blk, b, t, r, i0); });
          } else {
            const Q6KTables t = q6k_tables(blk);
            x8_row_tiles(mr, [&](auto n, int i0) { q6k_x8_rows<decltype(n)::value>(blk, b, t, r, i0); });
          }
        }
    }
    for (int i = 0; i < mr; ++i) _mm256_storeu_ps(out + (m0 + i) * ldo, _mm256_load_ps(f + 8 * i));
  }
}

#undef QG_KEEP

}  // namespace

// Columns in tiles of 16; inside a tile the rows go in groups of up to 8 (one set of
// accumulators in registers), so a column's weights come from memory once and from L1/L2 for
// the following row groups. Interleaved (x8) weights go by groups of 8 columns (n0 and n1 are
// multiples of 8 there).
void QG_ENTRY(const Problem& p, int64_t n0, int64_t n1, float* out, int64_t ldo) {
  if (is_x8(p.type)) {
    for (int64_t n = n0; n < n1; n += 8) x8_group(p, n, out + (n - n0), ldo);
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

}  // namespace quant
}  // namespace swiftspec
