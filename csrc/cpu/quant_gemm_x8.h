// The interleaved body of the quantized skinny GEMM, included once by quant_gemm_simd.h: Q4_K,
// Q6_K and 32-value types interleaved by 8 rows (quant_blocks.h, x8_source; V = __m256i) or by
// 16 (x16_source; V = __m512i, AVX-512 only), int32 lane c = output column c (quant_gemm_vec.h).
// Per row, a Q4_K sub-block's 8 registers of products are summed in int16 (|q x + q x| <= 2 * 15 *
// 127, so never saturating) before one vpmaddwd by the column's sub-block scale, or with VNNI
// summed by vpdpbusd in int32 before one vpmulld (x8_acc below); the same integers either way, at
// either width. The 16-row layout needs half the activation broadcasts per weight byte of the
// 8-row one (one broadcast feeds 16 columns), which is what bounds the kernels at 4-16 rows.
#include "quant_gemm_vec.h"

namespace swiftspec {
namespace quant {
namespace {

template <class V>
static inline V bcast32(const void* p) {
  int32_t v;
  __builtin_memcpy(&v, p, 4);
  return Vec<V>::set32(v);
}
// vpshufb of every 32-bit lane of t by the same 4 byte indices `within` (0x80: a zero byte)
template <class V>
static inline V lane_shuffle(V t, uint32_t within) {
  using O = Vec<V>;
  const V idx = O::add8(O::set32(static_cast<int>(within)),
                        O::bcast128(_mm_setr_epi8(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12)));
  return O::shuffle8(t, idx);
}
// int16 lanes (byte j0, byte j1) of each 32-bit lane of t (bytes zero-extended)
template <class V>
static inline V bytes16(V t, int j0, int j1) {
  return lane_shuffle(t, 0x80008000u | (static_cast<uint32_t>(j1) << 16) | static_cast<uint32_t>(j0));
}
// int16 lanes (byte j0, byte j1) of each 32-bit lane of t, sign-extended
template <class V>
static inline V sbytes16(V t, int j0, int j1) {
  return Vec<V>::srai16(
      lane_shuffle(t, 0x00800080u | (static_cast<uint32_t>(j1) << 24) | (static_cast<uint32_t>(j0) << 8)), 8);
}
template <class V>
static inline V lo_nibbles(V v) { return Vec<V>::and_(v, Vec<V>::set8(0x0F)); }
// every 16-bit lane shifted left by n (right by -n where n < 0); n a constant after unrolling
template <class V>
static inline V shift16(V v, int n) {
  return n > 0 ? Vec<V>::slli16(v, n) : (n < 0 ? Vec<V>::srli16(v, -n) : v);
}
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
// widened by one vpmaddwd. x8_acc adds one register's products (`first`: starting from zero),
// x8_scaled gives the int32 sums times the per-column scale `s` in the form of x8_scale (byte j of
// every column's 32-bit word of scales, unsigned) or x8_sscale (signed), x8_widen
// the plain int32 sums. Both give the same exact integers.
#ifdef QG_DPBUSD
template <class V>
static inline V x8_acc(V h, V u, V x, bool first) {
  return Vec<V>::dpbusd(first ? Vec<V>::zero() : h, u, x);
}
// the same with the 4 activation bytes at x broadcast by the instruction itself (vpdpbusd's
// embedded {1toN} operand: GCC 12 emits a separate vpbroadcastd, one more vector uop per product)
template <class V>
static inline V x8_accm(V h, V u, const int8_t* x, bool first) {
  return Vec<V>::dpbusd_bcast(first ? Vec<V>::zero() : h, u, x);
}
template <class V>
static inline V x8_scale(V t, int j) {  // byte j of each 32-bit lane of t, as int32
  return lane_shuffle(t, 0x80808000u | static_cast<uint32_t>(j));
}
template <class V>
static inline V x8_sscale(V t, int j) {  // signed byte j of each 32-bit lane, as int32
  return Vec<V>::srai32(lane_shuffle(t, 0x00808080u | (static_cast<uint32_t>(j) << 24)), 24);
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
template <class V>
static inline V x8_accm(V h, V u, const int8_t* x, bool first) {
  return x8_acc(h, u, bcast32<V>(x), first);
}
template <class V>
static inline V x8_scale(V t, int j) { return bytes16(t, j, j); }
template <class V>
static inline V x8_sscale(V t, int j) { return sbytes16(t, j, j); }
template <class V>
static inline V x8_scaled(V h, V s) { return Vec<V>::madd16(h, s); }
template <class V>
static inline V x8_widen(V h) { return Vec<V>::madd16(h, Vec<V>::set16(1)); }
constexpr int kX8Int16Sums = 0;  // 0: as far as int16 cannot overflow (q0_x8_rows)
constexpr int kX8Rows = 4;  // rows per register set (16 ymm registers)
#endif

// h + the int16 pair products of a's lanes and the 2 int16 values at x, in every lane (`first`:
// from zero): exact int32 sums
template <class V>
static inline V x8_dot16(V h, V a, const int16_t* x, bool first) {
  const V p = Vec<V>::madd16(a, bcast32<V>(x));
  return first ? p : Vec<V>::add32(h, p);
}

// the rows' float results, column c in lane c, updated once per super-block in the same order as
// quant_blocks.h: fma(float(isum), d * da), then fma(-float(msum), dmin * da)
template <class V, class F>
static inline void x8_finish(float* f, V isum, V msum, F d, F dmin, float da) {
  using O = Vec<V>;
  const F a = O::set1(da);
  const F y = O::fmadd(O::cvt(isum), O::mul(d, a), O::loadf(f));
  O::storef(f, O::fnmadd(O::cvt(msum), O::mul(dmin, a), y));
}

// The 16-row layout streams from DRAM at ~60 % of the 8-row one's rate at one row unless its
// blocks are prefetched (into L1), and the distance that pays is in bytes, not blocks: each group
// block prefetches the one kPrefetchBytes ahead (3 Q4_K blocks, 2 Q6_K, 18 Q5_0), through the end
// of its group into the next group's blocks, which lie right after (x8_group's groups are
// consecutive; past the weight's end a prefetch is a no-op). Measured on AMD Zen 5, a one-thread
// probe of the kernel and the forward (bench/LOG.md, "AMD Zen 5: prefetch distance"): one
// block ahead, stopping at the group's end, left the 32-value types (352-byte blocks) streaming far
// below the read rate and the K types' 4-8 row products waiting on DRAM; 4 KiB and 12 KiB, or into
// L2, or spread through the block's products, were no better. The 8-row kernels do the same on AMD
// CPUs only (Problem::prefetch_x8: faster at 1-4 rows on Zen 5; on an Intel Xeon a prefetch slowed
// their one-row forward; bench/LOG.md, "The 8-row layout prefetches on AMD"). Only a group's first 16 rows
// prefetch (X8Rows::prefetch): a prefill's later rows find the group's blocks in L1/L2, where the
// prefetches only cost issue slots (3-8 % of a 16-row Q4_K block's time, one-thread probe).
constexpr int64_t kPrefetchBytes = 6144;
static inline void prefetch_block(const uint8_t* p, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(reinterpret_cast<const char*>(p + o), _MM_HINT_T0);
}
// A group's prefetch stream (group blocks of gb bytes at grp): block b prefetches the block
// kPrefetchBytes ahead, or nothing where the row tile does not prefetch. The distance in blocks is
// divided once per group, not per block: per block, the division and its setup were ~25 of a
// 2-row Q5_0 block's ~155 instructions (GCC 12 left it in the loop, under the branch).
struct PrefetchAhead {
  const uint8_t* grp;
  int64_t gb, ahead;  // ahead: blocks ahead, 0 = no prefetch
  PrefetchAhead(const uint8_t* g, int64_t bytes, bool enabled)
      : grp(g), gb(bytes), ahead(enabled ? (kPrefetchBytes + bytes - 1) / bytes : 0) {}
  void operator()(int64_t b) const {
    if (ahead > 0) prefetch_block(grp + (b + ahead) * gb, gb);
  }
};

struct X8Rows {
  const int8_t* xq[16];
  const float* xd[16];
  const int16_t* xs[16];
  const int16_t* xs32[16];
  float* f[16];
  bool prefetch;  // the group's first 16 rows (later rows find its blocks cached), where the layout prefetches
};

// Q4_K tables of one group super-block: the 6-bit scales and mins of 8 sub-blocks x the group's
// columns (get_scale_min_k4 on 4 bytes of every column at once), sub-blocks 0-3 / 4-7 as bytes 0-3.
template <class V>
struct Q4KTables {
  typename Vec<V>::F d, dmin;
  V sc03, sc47, mn03, mn47;
};

// (S: the layout's offset scale; every field below is named by its offset in the 8-row block)
template <class V>
static inline Q4KTables<V> q4k_tables(const uint8_t* blk) {
  using O = Vec<V>;
  constexpr int S = O::kScale;
  Q4KTables<V> t;
  t.d = O::load_ph(blk);
  t.dmin = O::load_ph(blk + S * 16);
  const V u0 = O::load(blk + S * 32), u1 = O::load(blk + S * 64), u2 = O::load(blk + S * 96);
  const V k3f = O::set8(0x3f), k0f = O::set8(0x0f), k03 = O::set8(0x03);
  t.sc03 = O::and_(u0, k3f);
  t.sc47 = O::or_(O::and_(u2, k0f), O::slli32(O::and_(O::srli32(u0, 6), k03), 4));
  t.mn03 = O::and_(u1, k3f);
  t.mn47 = O::or_(O::and_(O::srli32(u2, 4), k0f), O::slli32(O::and_(O::srli32(u1, 6), k03), 4));
  return t;
}

// One group super-block for rows i0..i0+MR (inlined into the block loop of k_x8_rows)
template <class V, int MR>
static inline void q4k_x8_rows(const uint8_t* blk, int64_t b, const Q4KTables<V>& t, const X8Rows& r, int i0) {
  using O = Vec<V>;
  constexpr int S = O::kScale;
  V acc[MR];
  const int8_t* xb[MR];  // the rows' activations of this block (constant offsets from here on)
  for (int i = 0; i < MR; ++i) {
    acc[i] = O::zero();
    xb[i] = r.xq[i0 + i] + b * 256;
  }
  // sub-blocks 2 cc and 2 cc + 1: their 8 registers of quants, each row's int16 sums of both, times
  // the columns' two sub-block scales
  const auto sub_block_pair = [&](int cc) __attribute__((always_inline)) {
    const V tab = cc < 2 ? t.sc03 : t.sc47;
    const int j = (2 * cc) & 3;
    const V sa = x8_scale(tab, j), sb = x8_scale(tab, j + 1);
    V ha[MR], hb[MR];
#pragma GCC unroll 8
    for (int s = 0; s < 8; ++s) {
      const V raw = O::load(blk + S * (128 + (8 * cc + s) * 32));
      V lo = lo_nibbles(raw), hi = hi_nibbles(raw);
      QG_KEEP(lo);
      QG_KEEP(hi);
      for (int i = 0; i < MR; ++i) {
        const int8_t* x = xb[i] + 64 * cc + 4 * s;
        ha[i] = x8_accm(ha[i], lo, x, s == 0);
        hb[i] = x8_accm(hb[i], hi, x + 32, s == 0);
        QG_KEEP(ha[i]);
        QG_KEEP(hb[i]);
      }
    }
    for (int i = 0; i < MR; ++i) acc[i] = O::add32(acc[i], O::add32(x8_scaled(ha[i], sa), x8_scaled(hb[i], sb)));
  };
  // At 1-2 rows the four pairs are unrolled, so the scales' shuffle indices are constants: in a
  // loop they are formed from cc in general registers every pass (GCC 12, AVX2: ~520 instructions
  // per one-row block looped, ~417 unrolled; a one-thread in-cache probe on AMD Zen 3 ran 1-2 rows
  // 2-12 % faster). At 4+ rows a loop: the 4-row tile needs it to keep its registers (unrolled it
  // ran ~1.3x slower in the same probe).
  if constexpr (MR <= 2) {
    sub_block_pair(0);
    sub_block_pair(1);
    sub_block_pair(2);
    sub_block_pair(3);
  } else {
#pragma GCC unroll 1
    for (int cc = 0; cc < 4; ++cc) sub_block_pair(cc);
  }
  // min term: sub-block pairs (2p, 2p + 1) against the row's sums of 32, the mins of a pair as the
  // int16 lanes of each column's word: made once for all rows where 8 share them (at 1-4 rows
  // per row, which measured as fast there)
  V m0 = O::zero(), m1 = m0, m2 = m0, m3 = m0;
  if constexpr (MR >= 8) {
    m0 = bytes16(t.mn03, 0, 1), m1 = bytes16(t.mn03, 2, 3), m2 = bytes16(t.mn47, 0, 1), m3 = bytes16(t.mn47, 2, 3);
  }
  for (int i = 0; i < MR; ++i) {
    const int16_t* xs = r.xs32[i0 + i] + b * 8;
    V ms = O::madd16(MR >= 8 ? m0 : bytes16(t.mn03, 0, 1), bcast32<V>(xs));
    ms = O::add32(ms, O::madd16(MR >= 8 ? m1 : bytes16(t.mn03, 2, 3), bcast32<V>(xs + 2)));
    ms = O::add32(ms, O::madd16(MR >= 8 ? m2 : bytes16(t.mn47, 0, 1), bcast32<V>(xs + 4)));
    ms = O::add32(ms, O::madd16(MR >= 8 ? m3 : bytes16(t.mn47, 2, 3), bcast32<V>(xs + 6)));
    x8_finish(r.f[i0 + i], acc[i], ms, t.d, t.dmin, r.xd[i0 + i][b]);
  }
}

// Q6_K tables of one group super-block: d, dmin = 32 d (the -32 offset) and the 16 int8
// sub-block scales of the columns as 4 registers (word w of column c: scales 4w..4w+3).
template <class V>
struct Q6KTables {
  typename Vec<V>::F d, dmin;
  V sc[4];
};

template <class V>
static inline Q6KTables<V> q6k_tables(const uint8_t* blk) {
  using O = Vec<V>;
  constexpr int S = O::kScale;
  Q6KTables<V> t;
  t.d = O::load_ph(blk);
  t.dmin = O::mul(t.d, O::set1(32.f));
  for (int w = 0; w < 4; ++w) t.sc[w] = O::load(blk + S * (16 + 32 * w));
  return t;
}

// Sub-block j (16 values) of half h, quarter q and kind v (ggml's dequantize_row_q6_K: v = 0..3
// take ql's low nibbles, ql + 32's low, ql's high, ql + 32's high, with qh bits 2v, 2v + 1) is
// j = 8 h + 2 v + q; its 4 registers e hold values 16 j + 4 e + t as u = q + 32 (0..63). Per row
// the products go `lim` registers at a time into int16 (2 * 2 * 63 * 127 < 2^15) or, with VNNI,
// all 4 into int32, then times the signed sub-block scale; the min term: sum_j sc_j * xs_j.
// The pinned registers (QG_KEEP) keep each sub-block's scaling where it is written: without them
// GCC 12 kept every sub-block's sums to scale them at the end of the block, spilling ~250 vector
// registers per block at 8 rows, and the kernels ran 7-19 % slower at 4-8 rows (avx512_vnni_512,
// avx512_vnni and avx2; bench/LOG.md, "Q6_K without spills").
template <class V, int MR>
__attribute__((always_inline)) static inline void q6k_x8_rows(const uint8_t* blk, int64_t b,
                                                             const Q6KTables<V>& t, const X8Rows& r, int i0) {
  using O = Vec<V>;
  constexpr int S = O::kScale;
  constexpr int lim = kX8Int16Sums ? 4 : 2;
  const V k30 = O::set8(0x30);
  V acc[MR];
  const int8_t* xb[MR];  // the rows' activations of this block
  for (int i = 0; i < MR; ++i) {
    acc[i] = O::zero();
    xb[i] = r.xq[i0 + i] + b * 256;
  }
  // fully unrolled: every offset a constant
#pragma GCC unroll 4
  for (int hq = 0; hq < 4; ++hq) {
    const int h = hq / 2, q = hq % 2;
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) {
      const int j = 8 * h + 2 * v + q;
      const V sc = x8_sscale(t.sc[j / 4], j % 4);
      V hs[MR];
#pragma GCC unroll 4
      for (int e = 0; e < 4; ++e) {
        const int chunk = 144 + 384 * hq;  // quant_blocks.h: qh, ql, ql + 32 registers of (h, q)
        const V ql = O::load(blk + S * (chunk + 128 + 128 * (v & 1) + 32 * e));
        const V qh = O::load(blk + S * (chunk + 32 * e));
        const V hb = v == 0 ? O::slli16(qh, 4) : (v == 1 ? O::slli16(qh, 2) : (v == 2 ? qh : O::srli16(qh, 2)));
        V u = O::or_(v < 2 ? lo_nibbles(ql) : hi_nibbles(ql), O::and_(hb, k30));
        QG_KEEP(u);
        for (int i = 0; i < MR; ++i) {
          hs[i] = x8_accm(hs[i], u, xb[i] + 16 * j + 4 * e, e % lim == 0);
          QG_KEEP(hs[i]);
          if (e % lim == lim - 1) {
            acc[i] = O::add32(acc[i], x8_scaled(hs[i], sc));
            QG_KEEP(acc[i]);
          }
        }
      }
    }
  }
  V mn[8];  // the scales of sub-blocks (2p, 2p + 1) as the int16 lanes of each column's word, once for all rows
  for (int p = 0; p < 8; ++p) {
    mn[p] = sbytes16(t.sc[p / 2], 2 * (p % 2), 2 * (p % 2) + 1);
    QG_KEEP(mn[p]);
  }
  for (int i = 0; i < MR; ++i) {
    const int16_t* xs = r.xs[i0 + i] + b * 16;
    V ms = O::zero();
    for (int p = 0; p < 8; ++p) ms = x8_dot16(ms, mn[p], xs + 2 * p, p == 0);
    x8_finish(r.f[i0 + i], acc[i], ms, t.d, t.dmin, r.xd[i0 + i][b]);
  }
}

// q6k_x8_rows as a call of its own (see k_x8_rows)
template <class V, int MR>
__attribute__((noinline)) static void q6k_x8_call(const uint8_t* blk, int64_t b, const Q6KTables<V>& t,
                                                  const X8Rows& r, int i0) {
  q6k_x8_rows<V, MR>(blk, b, t, r, i0);
}

// Super-blocks [b0, b1) of one group (Q4_K or Q6_K) for rows i0..i0+MR, in block order: with one
// row tile, all of the group's blocks in one call, not a call per block (whose call and tables
// passed through memory showed at one row, AVX2 and AVX-512; Q6_K's block stays a call of its
// own at 4-8 rows, which its 8-row tile needs to keep its registers, and is inlined at 1-2 rows,
// 5-10 % faster there and 3-8 % slower at 8 rows: one-thread probe on AMD Zen 5, in L2); with
// several tiles, one block for every tile before the next block (each tile's own pass through
// all blocks was slower at 8 rows with AVX2's 4-row tiles; one-thread probe on AMD Zen 5). The
// first tile prefetches ahead for the others (see kPrefetchBytes).
// (not inlined: one register allocation per row count, and none shared with the caller's loops)
template <class V, int Base, int MR>
__attribute__((noinline)) static void k_x8_rows(const uint8_t* grp, int64_t b0, int64_t b1, int64_t gb,
                                                const X8Rows& r, int i0) {
  const PrefetchAhead prefetch(grp, gb, i0 == 0 && r.prefetch);
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* blk = grp + b * gb;
    prefetch(b);
    if constexpr (Base == kQ4_K)
      q4k_x8_rows<V, MR>(blk, b, q4k_tables<V>(blk), r, i0);
    else if constexpr (MR <= 2)
      q6k_x8_rows<V, MR>(blk, b, q6k_tables<V>(blk), r, i0);
    else
      q6k_x8_call<V, MR>(blk, b, q6k_tables<V>(blk), r, i0);
  }
}

// The 32-value types, one group block (the group's rows x 32 values) for rows i0..i0+MR: per row,
// the maddubs of the quant registers (unsigned values x the row's int8 values) summed in int16 as
// far as that cannot overflow (with VNNI: vpdpbusd, all 8 in int32) (Q4_0 / AWQ4: 8 products of |q| <= 15, |sum| <= 8 * 2 * 15 * 127
// < 2^15; Q5_0: 4 of |q| <= 31; Q8_0: 1, its signs moved onto x), then vpmaddwd to int32, minus
// z * (sum of the row's 32 values): exactly sum (q - z) * x per column.
// Register u of the block's quants (u < 4) holds values 4 u + t in its low nibbles and 16 + 4 u + t
// in its high ones (Q8_0: registers u and u + 4, whole bytes); both are decoded where they are
// used, not the whole block up front, which needed 8 registers (Q8_0: 16) beside the rows' sums
// and spilled with AVX2's 16 registers.
template <class V>
struct Q0Header {
  typename Vec<V>::F d;  // block scale per column
  V z;                   // zero point per column (int32; Q8_0 has none)
  V qh;                  // Q5_0: the columns' fifth bits
};

template <class V, int Base>
static inline Q0Header<V> q0_header(const uint8_t* blk) {
  using O = Vec<V>;
  constexpr int S = O::kScale;
  Q0Header<V> g;
  g.d = O::load_ph(blk);
  g.z = Base == kAWQ4 ? O::load_u8(blk + S * 16) : O::set32(Base == kQ5_0 ? 16 : 8);  // (unused for Q8_0)
  g.qh = Base == kQ5_0 ? O::load(blk + S * 16) : O::zero();
  return g;
}

// the quant registers of values 4 u + t (lo) and 16 + 4 u + t (hi): unsigned values, or for Q8_0
// the signed bytes (their magnitudes and signs are taken by the caller)
template <class V, int Base>
static inline void q0_regs(const uint8_t* blk, const Q0Header<V>& g, int u, V& lo, V& hi) {
  using O = Vec<V>;
  constexpr int S = O::kScale;
  if (Base == kQ8_0) {
    lo = O::load(blk + S * (16 + 32 * u));
    hi = O::load(blk + S * (16 + 32 * (u + 4)));
    return;
  }
  const V raw = O::load(blk + S * ((Base == kAWQ4 ? 32 : (Base == kQ5_0 ? 48 : 16)) + 32 * u));
  lo = lo_nibbles(raw);
  hi = hi_nibbles(raw);
  if (Base == kQ5_0) {  // the fifth bits of byte t's values: bits 2 u (low nibbles), 2 u + 1 of byte t of
    // the row's qh word (quant_blocks.h, q5_x_bit) -> bit 4, by one 16-bit shift and the mask
    const V k10 = O::set8(0x10);
    lo = O::or_(lo, O::and_(shift16(g.qh, 4 - 2 * u), k10));
    hi = O::or_(hi, O::and_(shift16(g.qh, 3 - 2 * u), k10));
  }
}

// Every block of one group for rows i0..i0+MR, the rows' results kept in registers from block to
// block (one fma per row and block: a load and a store of them per block cost as much as the
// products of a 4-bit block).
template <class V, int Base, int MR>
__attribute__((noinline)) static void q0_x8_rows(const uint8_t* grp, int64_t nb, int64_t gb, const X8Rows& r, int i0) {
  using O = Vec<V>;
  using F = typename O::F;
  // int16 sums of `lim` maddubs before one vpmaddwd (see above)
  constexpr int lim = kX8Int16Sums ? kX8Int16Sums : (Base == kQ8_0 ? 1 : (Base == kQ5_0 ? 4 : 8));
  F y[MR];
  for (int i = 0; i < MR; ++i) y[i] = O::loadf(r.f[i0 + i]);
  const PrefetchAhead prefetch(grp, gb, i0 == 0 && r.prefetch);
  for (int64_t b = 0; b < nb; ++b) {
    prefetch(b);
    const uint8_t* blk = grp + b * gb;
    const Q0Header<V> g = q0_header<V, Base>(blk);
    const int8_t* xb[MR];
    V acc[MR], h[MR];
    for (int i = 0; i < MR; ++i) xb[i] = r.xq[i0 + i] + b * 32;
#pragma GCC unroll 4
    for (int u = 0; u < 4; ++u) {
      V lo, hi;
      q0_regs<V, Base>(blk, g, u, lo, hi);
      QG_KEEP(lo);
      QG_KEEP(hi);
#pragma GCC unroll 2
      for (int half = 0; half < 2; ++half) {
        const V w = half ? hi : lo;
        const int k = 2 * u + half;  // the block's k-th product register, values 4 u + 16 half + t
        const V mag = Base == kQ8_0 ? O::sign8(w, w) : w;
        for (int i = 0; i < MR; ++i) {
          const int8_t* xp = xb[i] + 4 * u + 16 * half;
          if (Base == kQ8_0)
            h[i] = x8_acc(h[i], mag, O::sign8(bcast32<V>(xp), w), k % lim == 0);
          else
            h[i] = x8_accm(h[i], mag, xp, k % lim == 0);
          QG_KEEP(h[i]);
          if (k % lim == lim - 1) acc[i] = k == lim - 1 ? x8_widen(h[i]) : O::add32(acc[i], x8_widen(h[i]));
        }
      }
    }
    for (int i = 0; i < MR; ++i) {
      // minus z * (sum of the row's 32 values); Q8_0 has no zero point
      const V isum = Base == kQ8_0 ? acc[i] : O::sub32(acc[i], O::mullo32(g.z, O::set32(r.xs32[i0 + i][b])));
      const F a = O::set1(r.xd[i0 + i][b]);
      y[i] = O::fmadd(O::cvt(isum), O::mul(g.d, a), y[i]);
    }
  }
  for (int i = 0; i < MR; ++i) O::storef(r.f[i0 + i], y[i]);
}

// rows [0, mr) in register sets of kX8Rows, then 4 rows, then the rest as one tile of 3, 2 or 1
// rows: fn(std::integral_constant<int, MR>, i0). A rest of 3 as a 2-row and a 1-row tile decodes
// every weight register twice: 3 rows took longer than 4 (the target's Q4_K gate_up, one thread:
// 1016 against 909 us; 846 with the 3-row tile; AMD Zen 4, avx512_vnni; bench/LOG.md, "A 3-row tile").
template <class Fn>
static inline void x8_row_tiles(int mr, Fn&& fn) {
  int i0 = 0;
  if constexpr (kX8Rows >= 8)
    for (; i0 + 8 <= mr; i0 += 8) fn(std::integral_constant<int, 8>(), i0);
  for (; i0 + 4 <= mr; i0 += 4) fn(std::integral_constant<int, 4>(), i0);
  if (mr - i0 == 3) {
    fn(std::integral_constant<int, 3>(), i0);
  } else {
    for (; i0 + 2 <= mr; i0 += 2) fn(std::integral_constant<int, 2>(), i0);
    for (; i0 < mr; ++i0) fn(std::integral_constant<int, 1>(), i0);
  }
}

// whether x8_row_tiles makes one tile of mr rows
static inline bool x8_one_tile(int mr) {
  int tiles = 0;
  x8_row_tiles(mr, [&](auto, int) { ++tiles; });
  return tiles == 1;
}

template <class V, int Base>
static void q0_x8_group(const uint8_t* grp, int64_t nb, int64_t gb, const X8Rows& r, int mr) {
  x8_row_tiles(mr, [&](auto n, int i0) { q0_x8_rows<V, Base, decltype(n)::value>(grp, nb, gb, r, i0); });
}

// Q4_K / Q6_K: all blocks per call where x8_row_tiles makes one tile of the rows (x8_one_tile),
// else block by block over the tiles (k_x8_rows)
template <class V, int Base>
static void k_x8_group(const uint8_t* grp, int64_t nb, int64_t gb, const X8Rows& r, int mr) {
  const int64_t step = x8_one_tile(mr) ? nb : 1;
  for (int64_t b0 = 0; b0 < nb; b0 += step)
    x8_row_tiles(mr, [&](auto n, int i0) { k_x8_rows<V, Base, decltype(n)::value>(grp, b0, b0 + step, gb, r, i0); });
}

// One interleaved group, columns [n, n + C) (C = Vec<V>::kCols: 8 in the 8-row layout, 16 in the
// 16-row one) for all rows: out[m * ldo + c], c < C.
template <class V>
static void x8_group(const Problem& p, int64_t n, float* out, int64_t ldo) {
  using O = Vec<V>;
  constexpr int C = O::kCols;
  const int base = base_type(p.type);
  const int qk = block_values(base);
  const int64_t nb = p.K / qk;
  const int64_t gb = C * block_bytes(base);  // bytes per group block
  const uint8_t* grp = p.w + n * p.row_bytes;
  for (int64_t m0 = 0; m0 < p.M; m0 += 16) {
    const int mr = static_cast<int>(p.M - m0 < 16 ? p.M - m0 : 16);
    alignas(64) float f[16 * C];
    X8Rows r;
    r.prefetch = m0 == 0 && (C == 16 || p.prefetch_x8);
    for (int i = 0; i < mr; ++i) {
      const int64_t m = m0 + i;
      r.xq[i] = p.xq + m * p.K;
      r.xd[i] = p.xd + m * nb;
      r.xs[i] = p.xs != nullptr ? p.xs + m * (p.K / 16) : nullptr;
      r.xs32[i] = p.xs32 + m * (p.K / 32);
      r.f[i] = f + C * i;
      O::storef(f + C * i, O::set1(0.f));
    }
    switch (base) {  // the order in which the row tiles take the blocks: q0_x8_group, k_x8_group
      case kQ4_0: q0_x8_group<V, kQ4_0>(grp, nb, gb, r, mr); break;
      case kQ5_0: q0_x8_group<V, kQ5_0>(grp, nb, gb, r, mr); break;
      case kQ8_0: q0_x8_group<V, kQ8_0>(grp, nb, gb, r, mr); break;
      case kAWQ4: q0_x8_group<V, kAWQ4>(grp, nb, gb, r, mr); break;
      case kQ4_K: k_x8_group<V, kQ4_K>(grp, nb, gb, r, mr); break;
      default: k_x8_group<V, kQ6_K>(grp, nb, gb, r, mr);
    }
    for (int i = 0; i < mr; ++i) O::storef(out + (m0 + i) * ldo, O::loadf(f + C * i));
  }
}

#undef QG_KEEP

}  // namespace
}  // namespace quant
}  // namespace swiftspec
