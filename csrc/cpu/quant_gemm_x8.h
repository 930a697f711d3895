// The interleaved (x8) body of the quantized skinny GEMM, included once by quant_gemm_simd.h:
// 8-row interleaved Q4_K, Q6_K and 32-value types (quant_blocks.h, x8_source), int32 lane c =
// output column c, the products at either register width of quant_gemm_vec.h (V = __m256i: one
// 32-byte register of the group block per vector; V = __m512i, AVX-512 only: two consecutive
// ones, folded into 8 lanes before the float scaling). Per row, a Q4_K sub-block's 8
// registers of products are summed in int16 (|q x + q x| <= 2 * 15 * 127, so never saturating)
// before one vpmaddwd by the column's sub-block scale, or with VNNI summed by vpdpbusd in int32
// before one vpmulld (x8_acc below); the same integers either way, at either width.
#include "quant_gemm_vec.h"

namespace swiftspec {
namespace quant {
namespace {

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
template <class V>
static inline V lo_nibbles(V v) { return Vec<V>::and_(v, Vec<V>::set8(0x0F)); }
template <class V>
static inline V hi_nibbles(V v) { return Vec<V>::and_(Vec<V>::srli16(v, 4), Vec<V>::set8(0x0F)); }

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
// widened by one vpmaddwd. x8_acc adds one vector's products (`first`: starting from zero),
// x8_scaled gives the int32 sums times the per-column scale `s` in the form of x8_scale (byte j of
// every column's 32-bit word of scales, unsigned) or x8_sscale (signed), x8_widen
// the plain int32 sums. Both give the same exact integers.
#ifdef QG_DPBUSD
template <class V>
static inline V x8_acc(V h, V u, V x, bool first) {
  return Vec<V>::dpbusd(first ? Vec<V>::zero() : h, u, x);
}
static inline __m256i x8_scale(__m256i t, int j) {  // byte j of each 32-bit lane of t, as int32
  return lane_shuffle(t, 0x80808000u | static_cast<uint32_t>(j));
}
static inline __m256i x8_sscale(__m256i t, int j) {  // signed byte j of each 32-bit lane, as int32
  return _mm256_srai_epi32(lane_shuffle(t, 0x00808080u | (static_cast<uint32_t>(j) << 24)), 24);
}
template <class V>
static inline V x8_scaled(V h, V s) { return Vec<V>::mullo32(h, s); }
template <class V>
static inline V x8_widen(V h) { return h; }
constexpr int kX8Int16Sums = 8;  // registers summed before widening: all of a block
constexpr int kX8Rows = QG_X8_ROWS;  // rows per register set (32 vector registers with AVX-512)
#else
template <class V>
static inline V x8_acc(V h, V u, V x, bool first) {
  const V p = Vec<V>::maddubs(u, x);
  return first ? p : Vec<V>::add16(h, p);
}
static inline __m256i x8_scale(__m256i t, int j) { return bytes16(t, j, j); }
static inline __m256i x8_sscale(__m256i t, int j) { return sbytes16(t, j, j); }
template <class V>
static inline V x8_scaled(V h, V s) { return Vec<V>::madd16(h, s); }
template <class V>
static inline V x8_widen(V h) { return Vec<V>::madd16(h, Vec<V>::dup(_mm256_set1_epi16(1))); }
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
template <class V, int MR>
__attribute__((noinline)) static void q4k_x8_rows(const uint8_t* blk, int64_t b, const Q4KTables& t, const X8Rows& r,
                                                  int i0) {
  using O = Vec<V>;
  V acc[MR];
  for (int i = 0; i < MR; ++i) acc[i] = O::zero();
#pragma GCC unroll 1
  for (int cc = 0; cc < 4; ++cc) {
    const __m256i tab = cc < 2 ? t.sc03 : t.sc47;
    const int j = (2 * cc) & 3;
    const V sa = O::dup(x8_scale(tab, j)), sb = O::dup(x8_scale(tab, j + 1));
    V ha[MR], hb[MR];
#pragma GCC unroll 8
    for (int s = 0; s < 8; s += O::kRegs) {
      const V raw = O::load(blk + 128 + (8 * cc + s) * 32);
      V lo = lo_nibbles(raw), hi = hi_nibbles(raw);
      QG_KEEP(lo);
      QG_KEEP(hi);
      for (int i = 0; i < MR; ++i) {
        const int8_t* x = r.xq[i0 + i] + b * 256 + 64 * cc + 4 * s;
        ha[i] = x8_acc(ha[i], lo, O::xop(x), s == 0);
        hb[i] = x8_acc(hb[i], hi, O::xop(x + 32), s == 0);
        QG_KEEP(ha[i]);
        QG_KEEP(hb[i]);
      }
    }
    for (int i = 0; i < MR; ++i) acc[i] = O::add32(acc[i], O::add32(x8_scaled(ha[i], sa), x8_scaled(hb[i], sb)));
  }
  for (int i = 0; i < MR; ++i) {
    // min term: sub-block pairs (2p, 2p + 1) against the row's sums of 32
    const int16_t* xs = r.xs32[i0 + i] + b * 8;
    __m256i ms = _mm256_madd_epi16(bytes16(t.mn03, 0, 1), bcast32(xs));
    ms = _mm256_add_epi32(ms, _mm256_madd_epi16(bytes16(t.mn03, 2, 3), bcast32(xs + 2)));
    ms = _mm256_add_epi32(ms, _mm256_madd_epi16(bytes16(t.mn47, 0, 1), bcast32(xs + 4)));
    ms = _mm256_add_epi32(ms, _mm256_madd_epi16(bytes16(t.mn47, 2, 3), bcast32(xs + 6)));
    x8_finish(r.f[i0 + i], O::fold(acc[i]), ms, t.d, t.dmin, r.xd[i0 + i][b]);
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
template <class V, int MR>
__attribute__((noinline)) static void q6k_x8_rows(const uint8_t* blk, int64_t b, const Q6KTables& t, const X8Rows& r,
                                                  int i0) {
  using O = Vec<V>;
  constexpr int lim = kX8Int16Sums ? 4 : 2;
  const V k30 = O::set8(0x30);
  V acc[MR];
  for (int i = 0; i < MR; ++i) acc[i] = O::zero();
  // fully unrolled: every offset a constant
#pragma GCC unroll 4
  for (int hq = 0; hq < 4; ++hq) {
    const int h = hq / 2, q = hq % 2;
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) {
      const int j = 8 * h + 2 * v + q;
      const V sc = O::dup(x8_sscale(t.sc[j / 4], j % 4));
      V hs[MR];
#pragma GCC unroll 4
      for (int e = 0; e < 4; e += O::kRegs) {
        const uint8_t* chunk = blk + 144 + 384 * hq;  // quant_blocks.h: qh, ql, ql + 32 registers of (h, q)
        const V ql = O::load(chunk + 128 + 128 * (v & 1) + 32 * e);
        const V qh = O::load(chunk + 32 * e);
        const V hb = v == 0 ? O::slli16(qh, 4) : (v == 1 ? O::slli16(qh, 2) : (v == 2 ? qh : O::srli16(qh, 2)));
        const V u = O::or_(v < 2 ? lo_nibbles(ql) : hi_nibbles(ql), O::and_(hb, k30));
        for (int i = 0; i < MR; ++i) {
          hs[i] = x8_acc(hs[i], u, O::xop(r.xq[i0 + i] + b * 256 + 16 * j + 4 * e), e % lim == 0);
          if (e % lim == lim - O::kRegs) acc[i] = O::add32(acc[i], x8_scaled(hs[i], sc));
        }
      }
    }
  }
  for (int i = 0; i < MR; ++i) {
    const int16_t* xs = r.xs[i0 + i] + b * 16;
    __m256i ms = _mm256_setzero_si256();
    for (int p = 0; p < 8; ++p)
      ms = _mm256_add_epi32(ms, _mm256_madd_epi16(sbytes16(t.sc[p / 2], 2 * (p % 2), 2 * (p % 2) + 1), bcast32(xs + 2 * p)));
    x8_finish(r.f[i0 + i], O::fold(acc[i]), ms, t.d, t.dmin, r.xd[i0 + i][b]);
  }
}

// The 32-value types, one group block (8 rows x 32 values) for rows i0..i0+MR: per row, the
// maddubs of the quant registers (unsigned values x the row's int8 values) summed in int16 as
// far as that cannot overflow (with VNNI: vpdpbusd, all 8 in int32) (Q4_0 / AWQ4: 8 products of |q| <= 15, |sum| <= 8 * 2 * 15 * 127
// < 2^15; Q5_0: 4 of |q| <= 31; Q8_0: 1, its signs moved onto x), then vpmaddwd to int32, minus
// z * (sum of the row's 32 values): exactly sum (q - z) * x per column.
template <class V>
struct Q0Group {
  V v[8];    // unsigned quant bytes: values 4s..4s+3 of row c in lane c of register s (Q8_0: |q|), kRegs per vector
  V sgn[8];  // Q8_0: the signs of q
  __m256i z;  // zero point per column (int32)
  __m256 d;   // block scale per column
};

template <class V, int Base>
static inline void q0_group(const uint8_t* blk, Q0Group<V>& g) {
  using O = Vec<V>;
  constexpr int R = O::kRegs;
  g.d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));
  if (Base == kQ8_0) {
    g.z = _mm256_setzero_si256();
    for (int s = 0; s < 8; s += R) {
      const V q = O::load(blk + 16 + 32 * s);
      g.sgn[s / R] = q;
      g.v[s / R] = O::sign8(q, q);
    }
    return;
  }
  const bool awq = Base == kAWQ4, q5 = Base == kQ5_0;
  g.z = awq ? _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 16)))
            : _mm256_set1_epi32(q5 ? 16 : 8);
  const uint8_t* qs = blk + (awq ? 32 : (q5 ? 48 : 16));
  const V qh = q5 ? O::dup(loadu(blk + 16)) : O::zero();
  // byte t of every 32-bit lane: bit t of that lane's low byte (after the shift) -> 0x10
  const V spread = O::dup(_mm256_setr_epi8(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12, 0, 0, 0, 0, 4, 4, 4,
                                           4, 8, 8, 8, 8, 12, 12, 12, 12));
  const V bit = O::dup(_mm256_set1_epi32(0x08040201));
  for (int s = 0; s < 4; s += R) {
    const V raw = O::load(qs + 32 * s);
    V lo = lo_nibbles(raw), hi = hi_nibbles(raw);
    if (q5) {  // bit 4 s + t (low nibbles) and 16 + 4 s + t (high nibbles) of the row's qh
      const V bl = O::shuffle8(O::srl_regs(qh, 4 * s, 4), spread);
      const V bh = O::shuffle8(O::srl_regs(qh, 16 + 4 * s, 4), spread);
      const V k10 = O::set8(0x10);
      lo = O::or_(lo, O::select_eq8(O::and_(bl, bit), bit, k10));
      hi = O::or_(hi, O::select_eq8(O::and_(bh, bit), bit, k10));
    }
    g.v[s / R] = lo;        // values 4 s + t
    g.v[(4 + s) / R] = hi;  // values 16 + 4 s + t
  }
}

// Every block of one group for rows i0..i0+MR, the rows' results kept in registers from block to
// block (one fma per row and block: a load and a store of them per block cost as much as the
// products of a 4-bit block).
template <class V, int Base, int MR>
__attribute__((noinline)) static void q0_x8_rows(const uint8_t* grp, int64_t nb, int64_t gb, const X8Rows& r, int i0) {
  using O = Vec<V>;
  constexpr int R = O::kRegs;
  // int16 sums of `lim` maddubs before one vpmaddwd (see above)
  constexpr int lim = kX8Int16Sums ? kX8Int16Sums : (Base == kQ8_0 ? 1 : (Base == kQ5_0 ? 4 : 8));
  __m256 y[MR];
  for (int i = 0; i < MR; ++i) y[i] = _mm256_loadu_ps(r.f[i0 + i]);
  for (int64_t b = 0; b < nb; ++b) {
    Q0Group<V> g;
    q0_group<V, Base>(grp + b * gb, g);
    V acc[MR], h[MR];
    for (int i = 0; i < MR; ++i) acc[i] = O::zero();
#pragma GCC unroll 8
    for (int s = 0; s < 8; s += R) {
      // register s holds values 4 s .. 4 s + 3 (Q8_0) or, for the 4-bit types, v[s] (s < 4) values
      // 4 s + t and v[s] (s >= 4) values 16 + 4 (s - 4) + t: the same offsets 4 s within the block
      const int off = Base == kQ8_0 ? 4 * s : (s < 4 ? 4 * s : 16 + 4 * (s - 4));
      for (int i = 0; i < MR; ++i) {
        V x = O::xop(r.xq[i0 + i] + b * 32 + off);
        if (Base == kQ8_0) x = O::sign8(x, g.sgn[s / R]);
        h[i] = x8_acc(h[i], g.v[s / R], x, s % lim == 0);
        if (s % lim == lim - R) acc[i] = O::add32(acc[i], x8_widen(h[i]));
      }
    }
    for (int i = 0; i < MR; ++i) {
      const __m256i zx = _mm256_mullo_epi32(g.z, _mm256_set1_epi32(r.xs32[i0 + i][b]));
      const __m256 a = _mm256_set1_ps(r.xd[i0 + i][b]);
      y[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(O::fold(acc[i]), zx)), _mm256_mul_ps(g.d, a), y[i]);
    }
  }
  for (int i = 0; i < MR; ++i) _mm256_storeu_ps(r.f[i0 + i], y[i]);
}

// rows [0, mr) in register sets of kX8Rows, then 4, 2 and 1 rows: fn(std::integral_constant<int, MR>, i0)
template <class Fn>
static inline void x8_row_tiles(int mr, Fn&& fn) {
  int i0 = 0;
  if constexpr (kX8Rows >= 8)
    for (; i0 + 8 <= mr; i0 += 8) fn(std::integral_constant<int, 8>(), i0);
  for (; i0 + 4 <= mr; i0 += 4) fn(std::integral_constant<int, 4>(), i0);
  for (; i0 + 2 <= mr; i0 += 2) fn(std::integral_constant<int, 2>(), i0);
  for (; i0 < mr; ++i0) fn(std::integral_constant<int, 1>(), i0);
}

template <class V, int Base>
static void q0_x8_group(const uint8_t* grp, int64_t nb, int64_t gb, const X8Rows& r, int mr) {
  x8_row_tiles(mr, [&](auto n, int i0) { q0_x8_rows<V, Base, decltype(n)::value>(grp, nb, gb, r, i0); });
}

// One group of 8 interleaved columns [n, n + 8) for all rows: out[m * ldo + c], c = 0..7; V:
// the vector width of the products (quant_gemm_vec.h).
template <class V>
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
      case kQ4_0: q0_x8_group<V, kQ4_0>(grp, nb, gb, r, mr); break;
      case kQ5_0: q0_x8_group<V, kQ5_0>(grp, nb, gb, r, mr); break;
      case kQ8_0: q0_x8_group<V, kQ8_0>(grp, nb, gb, r, mr); break;
      case kAWQ4: q0_x8_group<V, kAWQ4>(grp, nb, gb, r, mr); break;
      default:
        for (int64_t b = 0; b < nb; ++b) {
          const uint8_t* blk = grp + b * gb;
          if (base == kQ4_K) {
            const Q4KTables t = q4k_tables(blk);
            x8_row_tiles(mr, [&](auto n, int i0) { q4k_x8_rows<V, decltype(n)::value>(blk, b, t, r, i0); });
          } else {
            const Q6KTables t = q6k_tables(blk);
            x8_row_tiles(mr, [&](auto n, int i0) { q6k_x8_rows<V, decltype(n)::value>(blk, b, t, r, i0); });
          }
        }
    }
    for (int i = 0; i < mr; ++i) _mm256_storeu_ps(out + (m0 + i) * ldo, _mm256_load_ps(f + 8 * i));
  }
}

#undef QG_KEEP

}  // namespace
}  // namespace quant
}  // namespace swiftspec
