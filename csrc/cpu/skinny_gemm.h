// Skinny GEMM core of the CPU twins: y_s[m, n] = sum_k x[m, k] * w_s[n, k] for M <= 16 rows of x
// and a range of output columns n, handed to an epilogue one column tile at a time.
//
// Decode-time linear layers are skinny (M = tokens per step, 1..16): the op is bound by streaming
// the weights from memory once, not by arithmetic, so a GEMM library's packing and cache blocking
// only cost time. This core is a fused GEMV-like pass instead (SwiftSpec paper section 3.3; the weight-
// streaming idea of SwiftSpec section 3.3 applied to every linear layer): each thread owns a
// contiguous range of output columns; for each column n it reads the weight row(s) of n exactly
// once and dots them with all M rows of x, keeping the accumulators in registers and blocking K by
// the vector width, with the next columns' rows prefetched in software. A long K is cut into chunks
// whose M rows of x stay in L1 while the column tile streams past (the sums of a tile add up over
// the chunks).
//
// NW weight streams are read side by side with the same x: fused SwiGLU uses NW = 2 (gate row n
// and up row n, swiglu.cpp), a plain linear NW = 1 (linear.cpp, and the tile GEMM of the fused
// GEMM + all-reduce in shm_comm.cpp). The fp32 sums of one column tile (kColTile columns, all M
// rows) go to the epilogue, which applies SiLU * up, or a bias and the store (StoreEpilogue), and
// rounds once to the output dtype.
//
// Kernels (Impl): fp32 uses FMA; bf16 uses vdpbf16ps (AVX512_BF16: exact bf16 products summed in
// fp32) or, on AVX-512 CPUs without it, weights widened to fp32 on load; a scalar kernel for CPUs
// without AVX-512, also selectable so the tests exercise it. All accumulate in fp32.
// Int8 weights (Problem::w_int8, the draft's weight-only layers) are widened exactly to fp32 and
// use the FMA kernel under either SIMD impl, with x in fp32; the scale is the epilogue's. The value of
// y[m, n] depends on M, K and the kernel only, never on the column range or the thread count (the
// blocking is by rows and K, and a column gets the same accumulator layout whether it is dotted
// alone or paired with its neighbour), so tiles of a bigger GEMM give the same bits as the whole.
//
// Everything here is inline or a template: every .cpp that includes it gets the same definitions
// (the extension is compiled with one set of flags, -march=native).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "vec_math.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define SWIFTSPEC_SKINNY_AVX512 1
#include <immintrin.h>
#if defined(__AVX512BF16__)
#define SWIFTSPEC_SKINNY_AVX512BF16 1
#endif
#endif

namespace swiftspec {
namespace skinny {

// Rows up to which the weight-streaming pass is used; above it the weights are reused enough that
// a GEMM library (at::mm / at::linear) wins, and callers fall back to it.
constexpr int64_t kMaxRows = 16;
// Columns whose sums are buffered before the epilogue runs (and the parallel_for grain).
constexpr int64_t kColTile = 64;
// Rows handled by one register-blocked pass (2 streams * 8 rows of accumulators + operands fit the
// 32 zmm registers).
constexpr int kMaxBlockRows = 8;
// Columns swept by both row blocks before moving on when M > 8: their weights stay in L2 for the
// second block (measured on SwiGLU: 4 or fewer columns per sweep hurt the prefetching).
constexpr int64_t kTwoPassCols = 32;
// Bytes of x (all M rows of one K chunk) kept in L1 while a column tile streams past; K is cut
// into chunks above it. L1d is 32 KiB on Zen 4 (48 KiB on recent Intel) and the weight lines pass
// through it too: 24 KiB chunks took the Qwen2.5-1.5B down_proj (M = 8, K = 8960, 28 layers, cold
// weights, 1 thread) from 70 to 46 ms against 32 KiB ones; 16 KiB or less split K = 1536 at M = 8
// and made SwiGLU 1.5x slower (2026-11-23).
constexpr int64_t kXChunkBytes = 24 * 1024;

enum class Impl { kScalar, kAvx512, kAvx512Bf16 };

// The operands. x: [M, K], row m at x + m * ldx elements (elements of a row contiguous); stream s:
// row n at w[s] + n * ldw elements. x and w have one dtype, fp32 or bf16 (raw bits).
template <int NW>
struct Problem {
  const void* x = nullptr;
  int64_t ldx = 0;
  const void* w[NW] = {};
  int64_t ldw = 0;
  int64_t M = 0, K = 0;
  bool bf16 = false;
  // Weights int8 (weight-only quantized draft layers; the per-column scale is the epilogue's):
  // then x is dtype `bf16` as above and the SIMD kernel reads it as fp32 through xf.
  bool w_int8 = false;
  // Set by gemm(): x in fp32, rows ldxf apart (bf16 on Impl::kAvx512, and int8 weights), and the
  // K chunk length.
  const float* xf = nullptr;
  int64_t ldxf = 0;
  int64_t kc = 0;
};

// What an epilogue gets: sums[s][m * kColTile + c] = y_s[m, n0 + c] for m < M, c < ncols (fp32).
template <int NW>
struct Tile {
  const float* sums[NW];
  int64_t M, n0, ncols;
  bool simd;  // an AVX-512 kernel ran; false for Impl::kScalar, so the tests reach the scalar path
};

using vec::bf16_bits_to_float;
using vec::float_to_bf16_bits;

// ----------------------------------------------------------------------------------------------
// Scalar kernel (any CPU).
struct ScalarKernel {
  // NC and KU (columns per pass, accumulator sets) only matter to the SIMD kernels.
  template <int NW, int NC, int MB, int KU>
  static void run(const Problem<NW>& p, int64_t m0, int64_t n0, float* const* sums, int64_t col0, bool add) {
    for (int c = 0; c < NC; ++c) run_column<NW, MB>(p, m0, n0 + c, sums, col0 + c, add);
  }

  template <int NW, int MB>
  static void run_column(const Problem<NW>& p, int64_t m0, int64_t n, float* const* sums, int64_t col, bool add) {
    const int64_t K = p.K;
    for (int m = 0; m < MB; ++m) {
      for (int s = 0; s < NW; ++s) {
        float acc = 0.f;
        if (p.w_int8) {
          const auto* w = static_cast<const int8_t*>(p.w[s]) + n * p.ldw;
          if (p.bf16) {
            const auto* x = static_cast<const uint16_t*>(p.x) + (m0 + m) * p.ldx;
            for (int64_t k = 0; k < K; ++k) acc += static_cast<float>(w[k]) * bf16_bits_to_float(x[k]);
          } else {
            const auto* x = static_cast<const float*>(p.x) + (m0 + m) * p.ldx;
            for (int64_t k = 0; k < K; ++k) acc += static_cast<float>(w[k]) * x[k];
          }
        } else if (p.bf16) {
          const auto* x = static_cast<const uint16_t*>(p.x) + (m0 + m) * p.ldx;
          const auto* w = static_cast<const uint16_t*>(p.w[s]) + n * p.ldw;
          for (int64_t k = 0; k < K; ++k) acc += bf16_bits_to_float(w[k]) * bf16_bits_to_float(x[k]);
        } else {
          const auto* x = static_cast<const float*>(p.x) + (m0 + m) * p.ldx;
          const auto* w = static_cast<const float*>(p.w[s]) + n * p.ldw;
          for (int64_t k = 0; k < K; ++k) acc += w[k] * x[k];
        }
        float& dst = sums[s][(m0 + m) * kColTile + col];
        dst = add ? dst + acc : acc;
      }
    }
  }
};

#ifdef SWIFTSPEC_SKINNY_AVX512
// ----------------------------------------------------------------------------------------------
// AVX-512 kernels. MB rows of one output column: NW * MB * KU accumulators stay in registers while
// the NW weight rows of column n are swept once. KU > 1 interleaves independent accumulator sets
// over K so few rows still keep enough FMA chains in flight. The K tail is a masked load (masked-
// off lanes read nothing and load zeros). The weight rows of the column kPrefetchCols ahead are
// prefetched: the hardware prefetcher alone does not keep up once the per-byte compute grows
// (measured on SwiGLU: M = 8 bf16 went from 16 to 32 GB/s with it). They are prefetched into L2
// (T1), not L1: T0 prefetches of a whole column ahead fill L1's miss buffers and evict the x rows,
// so at 4-8 rows the pass stopped overlapping its loads with its arithmetic. With T1, 4 columns
// ahead, the Qwen2.5-1.5B SwiGLU (28 layers, cold weights, bf16, 1 thread) went from 145 to 73 ms at
// M = 8, 100 to 71 ms at M = 4, 75-90 to 68 ms at M = 1 (2026-11-23; 2 / 8 columns and T0 at 4 / 8
// columns were slower).
constexpr int64_t kPrefetchCols = 4;

inline __mmask16 tail_mask16(int64_t rem) {
  return rem >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << rem) - 1u);
}
inline __mmask32 tail_mask32(int64_t rem) {
  return rem >= 32 ? static_cast<__mmask32>(0xFFFFFFFFu) : static_cast<__mmask32>((1u << rem) - 1u);
}
using vec::bf16x16_to_f32;
using vec::float_to_bf16_avx512;

// fp32 x and weights, fmadd.
struct OpsF32 {
  using W = __m512;
  using X = __m512;
  using Mask = __mmask16;
  using WT = float;
  using XT = float;
  static constexpr int64_t kStep = 16;
  template <int NW>
  static const XT* x_row(const Problem<NW>& p, int64_t m) { return static_cast<const float*>(p.x) + m * p.ldx; }
  static Mask tail(int64_t rem) { return tail_mask16(rem); }
  static W load_w(const WT* p) { return _mm512_loadu_ps(p); }
  static W load_w(const WT* p, Mask t) { return _mm512_maskz_loadu_ps(t, p); }
  static X load_x(const XT* p) { return _mm512_loadu_ps(p); }
  static X load_x(const XT* p, Mask t) { return _mm512_maskz_loadu_ps(t, p); }
  static __m512 fma(__m512 acc, W w, X x) { return _mm512_fmadd_ps(w, x, acc); }
};

// bf16 weights widened to fp32 on load, x converted to fp32 once per call (AVX-512 CPUs without
// AVX512_BF16; selectable for tests).
struct OpsBf16Cvt {
  using W = __m512;
  using X = __m512;
  using Mask = __mmask16;
  using WT = uint16_t;
  using XT = float;
  static constexpr int64_t kStep = 16;
  template <int NW>
  static const XT* x_row(const Problem<NW>& p, int64_t m) { return p.xf + m * p.ldxf; }
  static Mask tail(int64_t rem) { return tail_mask16(rem); }
  static W load_w(const WT* p) { return bf16x16_to_f32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static W load_w(const WT* p, Mask t) { return bf16x16_to_f32(_mm256_maskz_loadu_epi16(t, p)); }
  static X load_x(const XT* p) { return _mm512_loadu_ps(p); }
  static X load_x(const XT* p, Mask t) { return _mm512_maskz_loadu_ps(t, p); }
  static __m512 fma(__m512 acc, W w, X x) { return _mm512_fmadd_ps(w, x, acc); }
};

// int8 weights widened to fp32 on load (sign-extend, convert: exact), x in fp32 (converted once
// per call when bf16). The per-column scale is applied by the epilogue, so the kernel's sums are
// exact dot products with the integer weights up to fp32 summation.
struct OpsI8Cvt {
  using W = __m512;
  using X = __m512;
  using Mask = __mmask16;
  using WT = int8_t;
  using XT = float;
  static constexpr int64_t kStep = 16;
  template <int NW>
  static const XT* x_row(const Problem<NW>& p, int64_t m) { return p.xf + m * p.ldxf; }
  static Mask tail(int64_t rem) { return tail_mask16(rem); }
  static W load_w(const WT* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static W load_w(const WT* p, Mask t) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(t, p))); }
  static X load_x(const XT* p) { return _mm512_loadu_ps(p); }
  static X load_x(const XT* p, Mask t) { return _mm512_maskz_loadu_ps(t, p); }
  static __m512 fma(__m512 acc, W w, X x) { return _mm512_fmadd_ps(w, x, acc); }
};

#ifdef SWIFTSPEC_SKINNY_AVX512BF16
// bf16 x and weights: vdpbf16ps multiplies 16 bf16 pairs exactly and accumulates in fp32, so one
// instruction consumes 32 elements of K; x rows already are in the pair layout it wants.
struct OpsBf16Dp {
  using W = __m512bh;
  using X = __m512bh;
  using Mask = __mmask32;
  using WT = uint16_t;
  using XT = uint16_t;
  static constexpr int64_t kStep = 32;
  template <int NW>
  static const XT* x_row(const Problem<NW>& p, int64_t m) { return static_cast<const uint16_t*>(p.x) + m * p.ldx; }
  static Mask tail(int64_t rem) { return tail_mask32(rem); }
  static W load_w(const WT* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static W load_w(const WT* p, Mask t) { return (__m512bh)_mm512_maskz_loadu_epi16(t, p); }
  static X load_x(const XT* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static X load_x(const XT* p, Mask t) { return (__m512bh)_mm512_maskz_loadu_epi16(t, p); }
  static __m512 fma(__m512 acc, W w, X x) { return _mm512_dpbf16_ps(acc, w, x); }
};
#endif

template <class Ops>
struct Avx512Kernel {
  // NC adjacent columns n..n+NC-1 at once: NW * NC weight rows share each x load (see
  // columns_per_pass). Stream j = s * NC + c is row n + c of weight stream s.
  template <int NW, int NC, int MB, int KU>
  static void run(const Problem<NW>& p, int64_t m0, int64_t n, float* const* sums, int64_t col, bool add) {
    using WT = typename Ops::WT;
    using XT = typename Ops::XT;
    constexpr int64_t W = Ops::kStep;
    constexpr int NS = NW * NC;
    const int64_t K = p.K;
    const XT* x[MB];
    const WT* w[NS];
    uintptr_t pf[NS];
#pragma GCC unroll 16
    for (int m = 0; m < MB; ++m) x[m] = Ops::x_row(p, m0 + m);
#pragma GCC unroll 4
    for (int j = 0; j < NS; ++j) {
      w[j] = static_cast<const WT*>(p.w[j / NC]) + (n + j % NC) * p.ldw;
      // The same rows kPrefetchCols (at least NC) columns ahead; past the last column the address
      // lies in the next stream or past the tensor, which is harmless for a prefetch (it never
      // faults). Computed as integers: pointer arithmetic past the allocation would be undefined.
      pf[j] = reinterpret_cast<uintptr_t>(w[j]) + std::max<int64_t>(kPrefetchCols, NC) * p.ldw * sizeof(WT);
    }
    __m512 acc[KU][NS][MB];
#pragma GCC unroll 4
    for (int u = 0; u < KU; ++u)
#pragma GCC unroll 4
      for (int j = 0; j < NS; ++j)
#pragma GCC unroll 16
        for (int m = 0; m < MB; ++m) acc[u][j][m] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + KU * W <= K; k += KU * W) {
#pragma GCC unroll 4
      for (int u = 0; u < KU; ++u) {
        const int64_t kk = k + u * W;
        typename Ops::W vw[NS];
#pragma GCC unroll 4
        for (int j = 0; j < NS; ++j) {
          vw[j] = Ops::load_w(w[j] + kk);
          _mm_prefetch(reinterpret_cast<const char*>(pf[j] + kk * sizeof(WT)), _MM_HINT_T1);
        }
#pragma GCC unroll 16
        for (int m = 0; m < MB; ++m) {
          const auto xv = Ops::load_x(x[m] + kk);
#pragma GCC unroll 4
          for (int j = 0; j < NS; ++j) acc[u][j][m] = Ops::fma(acc[u][j][m], vw[j], xv);
        }
      }
    }
    for (; k < K; k += W) {  // at most KU - 1 full steps, then the masked tail
      const auto t = Ops::tail(K - k);
      typename Ops::W vw[NS];
#pragma GCC unroll 4
      for (int j = 0; j < NS; ++j) vw[j] = Ops::load_w(w[j] + k, t);
#pragma GCC unroll 16
      for (int m = 0; m < MB; ++m) {
        const auto xv = Ops::load_x(x[m] + k, t);
#pragma GCC unroll 4
        for (int j = 0; j < NS; ++j) acc[0][j][m] = Ops::fma(acc[0][j][m], vw[j], xv);
      }
    }
#pragma GCC unroll 4
    for (int j = 0; j < NS; ++j) {
#pragma GCC unroll 16
      for (int m = 0; m < MB; ++m) {
        __m512 a = acc[0][j][m];
#pragma GCC unroll 4
        for (int u = 1; u < KU; ++u) a = _mm512_add_ps(a, acc[u][j][m]);
        float& dst = sums[j / NC][(m0 + m) * kColTile + col + j % NC];
        dst = add ? dst + _mm512_reduce_add_ps(a) : _mm512_reduce_add_ps(a);
      }
    }
  }
};
#endif  // SWIFTSPEC_SKINNY_AVX512

// ----------------------------------------------------------------------------------------------
// Driver: column tiles of one thread's range; rows in register blocks of <= kMaxBlockRows.

// Independent accumulator sets per row block: enough FMA chains in flight for few rows, within
// the 32 zmm registers for many.
template <int NW>
constexpr int accumulator_sets(int mb) {
  return NW >= 2 ? (mb <= 2 ? 2 : 1) : (mb == 1 ? 4 : mb <= 4 ? 2 : 1);
}

// Columns per pass. With few rows one weight stream is best (the pass is memory-bound and more
// concurrent streams prefetch worse). With 5..8 rows per block one column's x loads outnumber its
// FMAs' needs and the kernel becomes load-bound, so a plain linear (NW = 1) dots two adjacent
// columns per pass, each x load feeding both (measured, 1 thread, bf16, K 1536 / 8960: M = 8 and
// 16 went from 1.0-1.6x to 1.3-2.1x oneDNN's speed; 3 columns were no better; 2 columns at M = 4
// were slower on weights that do not fit the caches). SwiGLU already reads two streams.
template <int NW>
constexpr int columns_per_pass(int mb) {
  return NW == 1 && mb >= 5 ? 2 : 1;
}

template <class Kern, int NW, int MB>
void columns(const Problem<NW>& p, int64_t m0, int64_t n0, int64_t c0, int64_t nc, float* const* sums, bool add) {
  // KU depends on the rows only, so a column gives the same bits in a group or alone.
  constexpr int KU = accumulator_sets<NW>(MB);
  constexpr int NC = columns_per_pass<NW>(MB);
  int64_t c = c0;
  for (; c + NC <= c0 + nc; c += NC) Kern::template run<NW, NC, MB, KU>(p, m0, n0 + c, sums, c, add);
  for (; c < c0 + nc; ++c) Kern::template run<NW, 1, MB, KU>(p, m0, n0 + c, sums, c, add);
}

template <class Kern, int NW>
void columns_rows(const Problem<NW>& p, int64_t m0, int mb, int64_t n0, int64_t c0, int64_t nc,
                  float* const* sums, bool add) {
  switch (mb) {
    case 1: columns<Kern, NW, 1>(p, m0, n0, c0, nc, sums, add); break;
    case 2: columns<Kern, NW, 2>(p, m0, n0, c0, nc, sums, add); break;
    case 3: columns<Kern, NW, 3>(p, m0, n0, c0, nc, sums, add); break;
    case 4: columns<Kern, NW, 4>(p, m0, n0, c0, nc, sums, add); break;
    case 5: columns<Kern, NW, 5>(p, m0, n0, c0, nc, sums, add); break;
    case 6: columns<Kern, NW, 6>(p, m0, n0, c0, nc, sums, add); break;
    case 7: columns<Kern, NW, 7>(p, m0, n0, c0, nc, sums, add); break;
    case 8: columns<Kern, NW, 8>(p, m0, n0, c0, nc, sums, add); break;
    default: TORCH_CHECK(false, "skinny gemm: internal error, row block of ", mb);
  }
}

template <class Kern, int NW, class Epi>
void run_range(const Problem<NW>& p, int64_t begin, int64_t end, bool simd, const Epi& epi) {
  // Sums of one column tile for all rows: NW * 16 * 64 floats, on the stack.
  alignas(64) float buf[NW][kMaxRows * kColTile];
  float* sums[NW];
  Tile<NW> tile;
  for (int s = 0; s < NW; ++s) tile.sums[s] = sums[s] = buf[s];
  tile.M = p.M;
  tile.simd = simd;
  // Rows 9..16 run as two register blocks over the same few columns, so the second pass re-reads
  // those weight rows from L2 instead of memory.
  const int nblk = p.M <= kMaxBlockRows ? 1 : 2;
  const int mb0 = static_cast<int>((p.M + nblk - 1) / nblk);
  const int64_t esize = p.bf16 ? 2 : 4;
  const int64_t wsize = p.w_int8 ? 1 : esize;
  for (int64_t n0 = begin; n0 < end; n0 += kColTile) {
    const int64_t ncols = std::min(kColTile, end - n0);
    // K in chunks whose x rows stay in L1 while a tile's columns stream past them (see gemm());
    // the first chunk stores the sums, the others add to them. K = 0 still runs one (empty) chunk.
    for (int64_t k0 = 0; k0 == 0 || k0 < p.K; k0 += p.kc) {
      Problem<NW> q = p;
      q.K = std::min(p.kc, p.K - k0);
      q.x = static_cast<const char*>(p.x) + k0 * esize;
      for (int s = 0; s < NW; ++s) q.w[s] = static_cast<const char*>(p.w[s]) + k0 * wsize;
      if (p.xf != nullptr) q.xf = p.xf + k0;
      const bool add = k0 > 0;
      if (nblk == 1) {
        columns_rows<Kern>(q, 0, mb0, n0, 0, ncols, sums, add);
      } else {
        for (int64_t c0 = 0; c0 < ncols; c0 += kTwoPassCols) {
          const int64_t nc = std::min(kTwoPassCols, ncols - c0);
          columns_rows<Kern>(q, 0, mb0, n0, c0, nc, sums, add);
          columns_rows<Kern>(q, mb0, static_cast<int>(p.M) - mb0, n0, c0, nc, sums, add);
        }
      }
      if (p.K == 0) break;
    }
    tile.n0 = n0;
    tile.ncols = ncols;
    epi(tile);
  }
}

// ----------------------------------------------------------------------------------------------
// Kernel selection.

inline std::vector<std::string> compiled_impls() {
  std::vector<std::string> v{"scalar"};
#ifdef SWIFTSPEC_SKINNY_AVX512
  v.emplace_back("avx512");
#endif
#ifdef SWIFTSPEC_SKINNY_AVX512BF16
  v.emplace_back("avx512_bf16");
#endif
  return v;
}

// The fastest kernel compiled in for the dtype.
inline Impl best_impl(bool bf16) {
#ifdef SWIFTSPEC_SKINNY_AVX512BF16
  if (bf16) return Impl::kAvx512Bf16;
#endif
  (void)bf16;
#ifdef SWIFTSPEC_SKINNY_AVX512
  return Impl::kAvx512;
#else
  return Impl::kScalar;
#endif
}

// Test hooks' kernel names ("auto", "scalar", "avx512", "avx512_bf16") -> Impl. Raises
// RuntimeError (prefixed by `op`) for an unknown name, a kernel not compiled in this build, or
// avx512_bf16 with fp32 inputs.
inline Impl impl_from_name(const std::string& name, bool bf16, const char* op) {
  if (name == "auto") return best_impl(bf16);
  Impl impl;
  if (name == "scalar") {
    impl = Impl::kScalar;
  } else if (name == "avx512") {
    impl = Impl::kAvx512;
  } else if (name == "avx512_bf16") {
    impl = Impl::kAvx512Bf16;
  } else {
    TORCH_CHECK(false, op, ": unknown impl '", name, "' (auto, scalar, avx512, avx512_bf16)");
  }
  const auto names = compiled_impls();
  TORCH_CHECK(std::find(names.begin(), names.end(), name) != names.end(), op, ": impl '", name,
              "' is not compiled in this build");
  TORCH_CHECK(!(impl == Impl::kAvx512Bf16 && !bf16), op, ": impl avx512_bf16 needs bfloat16 inputs");
  return impl;
}

// Runs the columns [begin, end) of problem p with kernel impl, parallel over columns with
// at::parallel_for (torch's pool: torch.set_num_threads governs it), calling epi(const Tile<NW>&)
// once per column tile from the thread that computed it (tiles never overlap, so an epilogue that
// writes only its own columns needs no locking). p.M must be <= kMaxRows. Raises RuntimeError for
// a kernel not compiled in or avx512_bf16 with fp32 inputs.
template <int NW, class Epi>
void gemm(Impl impl, Problem<NW> p, int64_t begin, int64_t end, const Epi& epi) {
  TORCH_CHECK(p.M >= 0 && p.M <= kMaxRows, "skinny gemm: M = ", p.M, " rows, at most ", kMaxRows);
  TORCH_CHECK(!(impl == Impl::kAvx512Bf16 && !p.bf16), "skinny gemm: impl avx512_bf16 needs bfloat16 inputs");
  if (p.M == 0 || end <= begin) return;
  std::vector<float> xf;
  // int8 weights: one SIMD kernel (fp32 FMA) whatever the x dtype, so both SIMD impls run it
  const bool i8_simd = p.w_int8 && impl != Impl::kScalar;
  if (i8_simd && !p.bf16) {
    p.xf = static_cast<const float*>(p.x);
    p.ldxf = p.ldx;
  } else if (p.bf16 && (impl == Impl::kAvx512 || i8_simd)) {
    // once per call: the kernel then only converts weights
    xf.resize(static_cast<size_t>(p.M * p.K));
    for (int64_t m = 0; m < p.M; ++m) {
      const auto* row = static_cast<const uint16_t*>(p.x) + m * p.ldx;
      for (int64_t k = 0; k < p.K; ++k) xf[m * p.K + k] = bf16_bits_to_float(row[k]);
    }
    p.xf = xf.data();
    p.ldxf = p.K;
  }
  // K chunk: the M rows of x the kernel reads per weight load must stay in L1 while a tile's
  // columns stream past, or every column re-reads them from L2 (which made M = 8, K = 8960 slower
  // than oneDNN). Chunks are a multiple of 128 elements (a whole number of unrolled steps).
  const int64_t x_bytes = p.M * p.K * (p.xf == nullptr && p.bf16 ? 2 : 4);
  const int64_t n_chunks = std::max<int64_t>(1, (x_bytes + kXChunkBytes - 1) / kXChunkBytes);
  p.kc = n_chunks == 1 ? std::max<int64_t>(p.K, 1) : ((p.K + n_chunks - 1) / n_chunks + 127) / 128 * 128;
  at::parallel_for(begin, end, kColTile, [&](int64_t b, int64_t e) {
    switch (impl) {
      case Impl::kScalar: run_range<ScalarKernel>(p, b, e, false, epi); return;
#ifdef SWIFTSPEC_SKINNY_AVX512
      case Impl::kAvx512:
      case Impl::kAvx512Bf16:
        if (p.w_int8) {
          run_range<Avx512Kernel<OpsI8Cvt>>(p, b, e, true, epi);
          return;
        }
        if (impl == Impl::kAvx512Bf16) break;
        if (p.bf16)
          run_range<Avx512Kernel<OpsBf16Cvt>>(p, b, e, true, epi);
        else
          run_range<Avx512Kernel<OpsF32>>(p, b, e, true, epi);
        return;
#endif
      default: break;
    }
#ifdef SWIFTSPEC_SKINNY_AVX512BF16
    if (impl == Impl::kAvx512Bf16) {
      run_range<Avx512Kernel<OpsBf16Dp>>(p, b, e, true, epi);
      return;
    }
#endif
    TORCH_CHECK(false, "skinny gemm: kernel not compiled in this build");
  });
}

// The operands of x [M, K] and w [N, K] (fp32 or bf16 x; elements of a row contiguous, any row
// stride); callers set w_int8 for int8 weights.
inline Problem<1> problem_of(const at::Tensor& x, const at::Tensor& w) {
  Problem<1> p;
  p.x = x.data_ptr();
  p.ldx = x.stride(0);
  p.w[0] = w.data_ptr();
  p.ldw = w.stride(0);
  p.M = x.size(0);
  p.K = x.size(1);
  p.bf16 = x.scalar_type() == at::kBFloat16;
  return p;
}

// ----------------------------------------------------------------------------------------------
// The plain epilogue: out[m, n - col0] = round(y[m, n] * scale[n] + bias[n]) for the tile's columns
// n, the per-column scale (int8 weights) and the bias (if any) applied in fp32 before the one
// rounding to the output dtype.
struct StoreEpilogue {
  void* out;          // [M, >= end - col0], row m at out + m * ldo elements, fp32 or bf16
  int64_t ldo;
  int64_t col0;       // column n of the problem is column n - col0 of out
  const float* bias;  // fp32, indexed by the problem's column n; nullptr: no bias
  bool bf16;          // out dtype
  const float* scale = nullptr;  // fp32, indexed by the problem's column n; nullptr: no scale

  void operator()(const Tile<1>& t) const {
    const float* s = t.sums[0];
#ifdef SWIFTSPEC_SKINNY_AVX512
    if (t.simd) {
      for (int64_t m = 0; m < t.M; ++m) {
        const int64_t o = m * ldo + t.n0 - col0;
        for (int64_t c = 0; c < t.ncols; c += 16) {
          const __mmask16 k = tail_mask16(t.ncols - c);
          __m512 y = _mm512_maskz_loadu_ps(k, s + m * kColTile + c);
          if (scale != nullptr) y = _mm512_mul_ps(y, _mm512_maskz_loadu_ps(k, scale + t.n0 + c));
          if (bias != nullptr) y = _mm512_add_ps(y, _mm512_maskz_loadu_ps(k, bias + t.n0 + c));
          if (bf16)
            _mm256_mask_storeu_epi16(static_cast<uint16_t*>(out) + o + c, k, float_to_bf16_avx512(y));
          else
            _mm512_mask_storeu_ps(static_cast<float*>(out) + o + c, k, y);
        }
      }
      return;
    }
#endif
    for (int64_t m = 0; m < t.M; ++m) {
      const int64_t o = m * ldo + t.n0 - col0;
      for (int64_t c = 0; c < t.ncols; ++c) {
        float y = s[m * kColTile + c];
        if (scale != nullptr) y *= scale[t.n0 + c];
        if (bias != nullptr) y += bias[t.n0 + c];
        if (bf16)
          static_cast<uint16_t*>(out)[o + c] = float_to_bf16_bits(y);
        else
          static_cast<float*>(out)[o + c] = y;
      }
    }
  }
};

}  // namespace skinny
}  // namespace swiftspec
