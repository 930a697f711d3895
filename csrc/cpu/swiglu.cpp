// Fused SwiGLU, the CPU twin of the CUDA kernel (DESIGN.md section 6; SwiftSpec paper section 3.3,
// "Fused SwiGLU": the gate and up tiles of the same input are computed in one pass and
// SiLU(gate) * up is applied in the epilogue, so the intermediate [M, 2I] never reaches memory).
//
// Decode-time calls are skinny (M <= 16 rows): the op is bound by streaming the weights once, so
// the kernel is a fused GEMV-like pass. Each thread owns a contiguous range of output columns n;
// for each n it reads gate row n and up row n once and dots them with all M rows of x, keeping the
// 2 * M accumulators in registers and blocking K by the vector width. For M > 16
// (prefill) the weights are reused enough that a GEMM library wins, so we fall back to at::mm.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/csrc/utils/pybind.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define SWIFTSPEC_SWIGLU_AVX512 1
#include <immintrin.h>
#if defined(__AVX512BF16__)
#define SWIFTSPEC_SWIGLU_AVX512BF16 1
#endif
#endif

namespace swiftspec {
namespace {

// Rows up to which the fused GEMV path is used; above it at::mm reuses weights better.
constexpr int64_t kSkinnyMaxRows = 16;
// Columns whose gate/up sums are buffered before the vectorized SiLU * up epilogue runs.
constexpr int64_t kColTile = 64;
// Rows handled by one register-blocked pass (2 * 8 accumulators + operands fit 32 zmm).
constexpr int kMaxBlockRows = 8;
// Columns swept by both row blocks before moving on when M > 8: their weights stay in L2 for the
// second block (measured: 4 or fewer columns per sweep hurt the prefetching and were slower).
constexpr int64_t kTwoPassCols = 32;

enum class Impl { kScalar, kAvx512, kAvx512Bf16 };

inline float bf16_bits_to_float(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Round-to-nearest-even, NaN -> canonical quiet NaN: the same rule as c10::BFloat16(float), so the
// result is what PyTorch's own .to(torch.bfloat16) of our fp32 value would give.
inline uint16_t float_to_bf16_bits(float f) { return c10::BFloat16(f).x; }

struct Job {
  const void* x;    // [M, K] row-major, fp32 or bf16 bits
  const void* w;    // [2I, K] row-major, same dtype
  const float* xf;  // [M, K] x converted to fp32 (only for the AVX-512 bf16-by-conversion path)
  int64_t M, K, I;
  bool bf16;
  void* out;        // [M, I]
};

// Sums of one register block: g/u are [rows][kColTile] buffers, `col` the column inside the tile.
struct Sums {
  float* g;
  float* u;
};

// ----------------------------------------------------------------------------------------------
// Scalar kernels (any CPU; also the oracle of the SIMD kernels' blocking in the tests).
struct ScalarKernel {
  template <int MB, int KU>  // KU (accumulator sets) only matters to the SIMD kernels
  static void run(const Job& j, int64_t m0, int64_t n, Sums s, int64_t col) {
    const int64_t K = j.K;
    for (int m = 0; m < MB; ++m) {
      float ag = 0.f, au = 0.f;
      if (j.bf16) {
        const auto* x = static_cast<const uint16_t*>(j.x) + (m0 + m) * K;
        const auto* wg = static_cast<const uint16_t*>(j.w) + n * K;
        const auto* wu = static_cast<const uint16_t*>(j.w) + (j.I + n) * K;
        for (int64_t k = 0; k < K; ++k) {
          const float xv = bf16_bits_to_float(x[k]);
          ag += bf16_bits_to_float(wg[k]) * xv;
          au += bf16_bits_to_float(wu[k]) * xv;
        }
      } else {
        const auto* x = static_cast<const float*>(j.x) + (m0 + m) * K;
        const auto* wg = static_cast<const float*>(j.w) + n * K;
        const auto* wu = static_cast<const float*>(j.w) + (j.I + n) * K;
        for (int64_t k = 0; k < K; ++k) {
          ag += wg[k] * x[k];
          au += wu[k] * x[k];
        }
      }
      s.g[(m0 + m) * kColTile + col] = ag;
      s.u[(m0 + m) * kColTile + col] = au;
    }
  }
};

void epilogue_scalar(const Job& j, const Sums& s, int64_t n0, int64_t ncols) {
  for (int64_t m = 0; m < j.M; ++m) {
    for (int64_t c = 0; c < ncols; ++c) {
      const float g = s.g[m * kColTile + c];
      const float y = g / (1.f + std::exp(-g)) * s.u[m * kColTile + c];
      if (j.bf16)
        static_cast<uint16_t*>(j.out)[m * j.I + n0 + c] = float_to_bf16_bits(y);
      else
        static_cast<float*>(j.out)[m * j.I + n0 + c] = y;
    }
  }
}

#ifdef SWIFTSPEC_SWIGLU_AVX512
// ----------------------------------------------------------------------------------------------
// AVX-512 kernels. MB rows of one output column: 2 * MB * KU accumulators stay in registers while
// gate row n and up row n are swept once. KU > 1 interleaves independent accumulator sets over K
// so few rows still keep enough FMA chains in flight. The K tail is a masked load (masked-off
// lanes read nothing and load zeros). The weight rows of the column PF ahead are prefetched: the
// hardware prefetcher alone does not keep up once the per-byte compute grows (measured: M = 8
// bf16 went from 16 to 32 GB/s with it).
constexpr int64_t kPrefetchCols = 2;

inline __mmask16 tail_mask16(int64_t rem) {
  return rem >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << rem) - 1u);
}
inline __mmask32 tail_mask32(int64_t rem) {
  return rem >= 32 ? static_cast<__mmask32>(0xFFFFFFFFu) : static_cast<__mmask32>((1u << rem) - 1u);
}
inline __m512 bf16x16_to_f32(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// fp32 x and weights, fmadd.
struct OpsF32 {
  using W = __m512;
  using X = __m512;
  using Mask = __mmask16;
  using WT = float;
  static constexpr int64_t kStep = 16;
  static const float* x_base(const Job& j) { return static_cast<const float*>(j.x); }
  static Mask tail(int64_t rem) { return tail_mask16(rem); }
  static W load_w(const WT* p) { return _mm512_loadu_ps(p); }
  static W load_w(const WT* p, Mask t) { return _mm512_maskz_loadu_ps(t, p); }
  static X load_x(const float* p) { return _mm512_loadu_ps(p); }
  static X load_x(const float* p, Mask t) { return _mm512_maskz_loadu_ps(t, p); }
  static __m512 fma(__m512 acc, W w, X x) { return _mm512_fmadd_ps(w, x, acc); }
};

// bf16 weights widened to fp32 on load, x converted to fp32 once per call (CPUs without
// AVX512_BF16; selectable for tests).
struct OpsBf16Cvt {
  using W = __m512;
  using X = __m512;
  using Mask = __mmask16;
  using WT = uint16_t;
  static constexpr int64_t kStep = 16;
  static const float* x_base(const Job& j) { return j.xf; }
  static Mask tail(int64_t rem) { return tail_mask16(rem); }
  static W load_w(const WT* p) { return bf16x16_to_f32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static W load_w(const WT* p, Mask t) { return bf16x16_to_f32(_mm256_maskz_loadu_epi16(t, p)); }
  static X load_x(const float* p) { return _mm512_loadu_ps(p); }
  static X load_x(const float* p, Mask t) { return _mm512_maskz_loadu_ps(t, p); }
  static __m512 fma(__m512 acc, W w, X x) { return _mm512_fmadd_ps(w, x, acc); }
};

#ifdef SWIFTSPEC_SWIGLU_AVX512BF16
// bf16 x and weights: vdpbf16ps multiplies 16 bf16 pairs exactly and accumulates in fp32, so one
// instruction consumes 32 elements of K; x rows already are in the pair layout it wants.
struct OpsBf16Dp {
  using W = __m512bh;
  using X = __m512bh;
  using Mask = __mmask32;
  using WT = uint16_t;
  static constexpr int64_t kStep = 32;
  static const uint16_t* x_base(const Job& j) { return static_cast<const uint16_t*>(j.x); }
  static Mask tail(int64_t rem) { return tail_mask32(rem); }
  static W load_w(const WT* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static W load_w(const WT* p, Mask t) { return (__m512bh)_mm512_maskz_loadu_epi16(t, p); }
  static X load_x(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static X load_x(const uint16_t* p, Mask t) { return (__m512bh)_mm512_maskz_loadu_epi16(t, p); }
  static __m512 fma(__m512 acc, W w, X x) { return _mm512_dpbf16_ps(acc, w, x); }
};
#endif

template <class Ops>
struct Avx512Kernel {
  template <int MB, int KU>
  static void run(const Job& j, int64_t m0, int64_t n, Sums s, int64_t col) {
    using WT = typename Ops::WT;
    constexpr int64_t W = Ops::kStep;
    const int64_t K = j.K;
    const auto* x = Ops::x_base(j) + m0 * K;
    const WT* wg = static_cast<const WT*>(j.w) + n * K;
    const WT* wu = static_cast<const WT*>(j.w) + (j.I + n) * K;
    // Same rows kPrefetchCols columns ahead; past the last column the address lies in the up half
    // or past the tensor, which is harmless for a prefetch (it never faults). Computed as integers:
    // pointer arithmetic past the allocation would be undefined behaviour.
    const uintptr_t pg = reinterpret_cast<uintptr_t>(wg) + kPrefetchCols * K * sizeof(WT);
    const uintptr_t pu = reinterpret_cast<uintptr_t>(wu) + kPrefetchCols * K * sizeof(WT);
    __m512 ag[KU][MB], au[KU][MB];
#pragma GCC unroll 2
    for (int u = 0; u < KU; ++u) {
#pragma GCC unroll 8
      for (int m = 0; m < MB; ++m) ag[u][m] = au[u][m] = _mm512_setzero_ps();
    }
    int64_t k = 0;
    for (; k + KU * W <= K; k += KU * W) {
#pragma GCC unroll 2
      for (int u = 0; u < KU; ++u) {
        const int64_t kk = k + u * W;
        const auto vg = Ops::load_w(wg + kk);
        const auto vu = Ops::load_w(wu + kk);
        _mm_prefetch(reinterpret_cast<const char*>(pg + kk * sizeof(WT)), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(pu + kk * sizeof(WT)), _MM_HINT_T0);
#pragma GCC unroll 8
        for (int m = 0; m < MB; ++m) {
          const auto xv = Ops::load_x(x + m * K + kk);
          ag[u][m] = Ops::fma(ag[u][m], vg, xv);
          au[u][m] = Ops::fma(au[u][m], vu, xv);
        }
      }
    }
    for (; k < K; k += W) {  // at most KU - 1 full steps, then the masked tail
      const auto t = Ops::tail(K - k);
      const auto vg = Ops::load_w(wg + k, t);
      const auto vu = Ops::load_w(wu + k, t);
#pragma GCC unroll 8
      for (int m = 0; m < MB; ++m) {
        const auto xv = Ops::load_x(x + m * K + k, t);
        ag[0][m] = Ops::fma(ag[0][m], vg, xv);
        au[0][m] = Ops::fma(au[0][m], vu, xv);
      }
    }
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) {
      __m512 g = ag[0][m], u = au[0][m];
#pragma GCC unroll 2
      for (int v = 1; v < KU; ++v) {
        g = _mm512_add_ps(g, ag[v][m]);
        u = _mm512_add_ps(u, au[v][m]);
      }
      s.g[(m0 + m) * kColTile + col] = _mm512_reduce_add_ps(g);
      s.u[(m0 + m) * kColTile + col] = _mm512_reduce_add_ps(u);
    }
  }
};

// exp(x) for 16 lanes: x = n ln2 + r with |r| <= ln2 / 2, degree-7 Taylor polynomial of e^r
// (truncation error < 6e-9 relative) and the exponent applied by vscalefps, which also yields
// exact 0 / inf-free results at the clamped range ends. NaN propagates.
inline __m512 exp_avx512(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.f)), _mm512_set1_ps(88.7f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);  // ln2 high part
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);    // ln2 low part
  __m512 p = _mm512_set1_ps(1.f / 5040.f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// fp32 -> bf16 bits, round-to-nearest-even with NaN -> 0x7FC0 (c10::BFloat16's rule).
inline __m256i float_to_bf16_avx512(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded =
      _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC0)));
}

void epilogue_avx512(const Job& j, const Sums& s, int64_t n0, int64_t ncols) {
  const __m512 one = _mm512_set1_ps(1.f);
  for (int64_t m = 0; m < j.M; ++m) {
    for (int64_t c = 0; c < ncols; c += 16) {
      const __mmask16 t = tail_mask16(ncols - c);
      const __m512 g = _mm512_maskz_loadu_ps(t, s.g + m * kColTile + c);
      const __m512 u = _mm512_maskz_loadu_ps(t, s.u + m * kColTile + c);
      const __m512 sig_den = _mm512_add_ps(one, exp_avx512(_mm512_sub_ps(_mm512_setzero_ps(), g)));
      const __m512 y = _mm512_mul_ps(_mm512_div_ps(g, sig_den), u);
      if (j.bf16) {
        _mm256_mask_storeu_epi16(static_cast<uint16_t*>(j.out) + m * j.I + n0 + c, t,
                                 float_to_bf16_avx512(y));
      } else {
        _mm512_mask_storeu_ps(static_cast<float*>(j.out) + m * j.I + n0 + c, t, y);
      }
    }
  }
}
#endif  // SWIFTSPEC_SWIGLU_AVX512

// ----------------------------------------------------------------------------------------------
// Driver: column tiles of one thread's range; rows in register blocks of <= 8.

template <class Kern, int MB, int KU>
void cols_block(const Job& j, int64_t m0, int64_t n0, int64_t c0, int64_t ncols, Sums s) {
  for (int64_t c = c0; c < c0 + ncols; ++c) Kern::template run<MB, KU>(j, m0, n0 + c, s, c);
}

// One column at a time (measured: processing 2 or 4 columns together, i.e. more concurrent weight
// streams, was slower); 1 or 2 rows get a second accumulator set so the FMA latency is hidden.
template <class Kern>
void cols_rows(const Job& j, int64_t m0, int mb, int64_t n0, int64_t c0, int64_t ncols, Sums s) {
  switch (mb) {
    case 1: cols_block<Kern, 1, 2>(j, m0, n0, c0, ncols, s); break;
    case 2: cols_block<Kern, 2, 2>(j, m0, n0, c0, ncols, s); break;
    case 3: cols_block<Kern, 3, 1>(j, m0, n0, c0, ncols, s); break;
    case 4: cols_block<Kern, 4, 1>(j, m0, n0, c0, ncols, s); break;
    case 5: cols_block<Kern, 5, 1>(j, m0, n0, c0, ncols, s); break;
    case 6: cols_block<Kern, 6, 1>(j, m0, n0, c0, ncols, s); break;
    case 7: cols_block<Kern, 7, 1>(j, m0, n0, c0, ncols, s); break;
    case 8: cols_block<Kern, 8, 1>(j, m0, n0, c0, ncols, s); break;
    default: TORCH_CHECK(false, "swiglu: internal error, row block ", mb);
  }
}

template <class Kern>
void run_range(const Job& j, int64_t begin, int64_t end, bool simd_epilogue) {
  // Sums of one column tile for all rows: 2 * 16 * 64 floats, on the stack.
  float gbuf[kSkinnyMaxRows * kColTile];
  float ubuf[kSkinnyMaxRows * kColTile];
  const Sums s{gbuf, ubuf};
  // Rows 9..16 run as two register blocks over the same few columns, so the second pass re-reads
  // those weight rows from L2 instead of memory.
  const int nblk = j.M <= kMaxBlockRows ? 1 : 2;
  const int mb0 = static_cast<int>((j.M + nblk - 1) / nblk);
  for (int64_t n0 = begin; n0 < end; n0 += kColTile) {
    const int64_t ncols = std::min(kColTile, end - n0);
    if (nblk == 1) {
      cols_rows<Kern>(j, 0, mb0, n0, 0, ncols, s);
    } else {
      for (int64_t c0 = 0; c0 < ncols; c0 += kTwoPassCols) {
        const int64_t nc = std::min(kTwoPassCols, ncols - c0);
        cols_rows<Kern>(j, 0, mb0, n0, c0, nc, s);
        cols_rows<Kern>(j, mb0, static_cast<int>(j.M) - mb0, n0, c0, nc, s);
      }
    }
#ifdef SWIFTSPEC_SWIGLU_AVX512
    if (simd_epilogue) {
      epilogue_avx512(j, s, n0, ncols);
      continue;
    }
#endif
    (void)simd_epilogue;
    epilogue_scalar(j, s, n0, ncols);
  }
}

void check_inputs(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "swiglu: x and w_gate_up must be CPU tensors");
  TORCH_CHECK(x.dim() == 2, "swiglu: x must be [M, K], got ", x.sizes());
  TORCH_CHECK(w.dim() == 2, "swiglu: w_gate_up must be [2*I, K], got ", w.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "swiglu: x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(w.scalar_type() == x.scalar_type(), "swiglu: w_gate_up dtype ", w.scalar_type(),
              " differs from x dtype ", x.scalar_type());
  TORCH_CHECK(w.size(1) == x.size(1), "swiglu: K mismatch, x is ", x.sizes(), " and w_gate_up is ",
              w.sizes());
  TORCH_CHECK(w.size(0) % 2 == 0, "swiglu: w_gate_up must have an even number of rows (gate then up), got ",
              w.size(0));
}

Impl best_impl(bool bf16) {
#ifdef SWIFTSPEC_SWIGLU_AVX512BF16
  if (bf16) return Impl::kAvx512Bf16;
#endif
#ifdef SWIFTSPEC_SWIGLU_AVX512
  (void)bf16;
  return Impl::kAvx512;
#else
  (void)bf16;
  return Impl::kScalar;
#endif
}

at::Tensor swiglu_impl(const at::Tensor& x_in, const at::Tensor& w_in, Impl impl) {
  check_inputs(x_in, w_in);
  const int64_t M = x_in.size(0), K = x_in.size(1), I = w_in.size(0) / 2;
  if (M > kSkinnyMaxRows) {
    // Prefill: PyTorch's best arrangement (one concatenated GEMM), same as the reference.
    const at::Tensor gu = at::mm(x_in, w_in.t());
    return at::silu(gu.narrow(1, 0, I)) * gu.narrow(1, I, I);
  }
  const at::Tensor x = x_in.contiguous();
  const at::Tensor w = w_in.contiguous();
  at::Tensor out = at::empty({M, I}, x.options());
  if (M == 0 || I == 0) return out;
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(!(impl == Impl::kAvx512Bf16 && !bf16), "swiglu: impl avx512_bf16 needs bfloat16 inputs");

  Job j{x.data_ptr(), w.data_ptr(), nullptr, M, K, I, bf16, out.data_ptr()};
  at::Tensor xf;
  if (bf16 && impl == Impl::kAvx512) {
    xf = x.to(at::kFloat);  // once per call: the kernel then only converts weights
    j.xf = xf.data_ptr<float>();
  }
  at::parallel_for(0, I, kColTile, [&](int64_t begin, int64_t end) {
    switch (impl) {
      case Impl::kScalar: run_range<ScalarKernel>(j, begin, end, false); break;
#ifdef SWIFTSPEC_SWIGLU_AVX512
      case Impl::kAvx512:
        if (bf16)
          run_range<Avx512Kernel<OpsBf16Cvt>>(j, begin, end, true);
        else
          run_range<Avx512Kernel<OpsF32>>(j, begin, end, true);
        break;
#endif
#ifdef SWIFTSPEC_SWIGLU_AVX512BF16
      case Impl::kAvx512Bf16: run_range<Avx512Kernel<OpsBf16Dp>>(j, begin, end, true); break;
#endif
      default: TORCH_CHECK(false, "swiglu: implementation not compiled in this build");
    }
  });
  return out;
}

at::Tensor swiglu(const at::Tensor& x, const at::Tensor& w_gate_up) {
  return swiglu_impl(x, w_gate_up, best_impl(x.scalar_type() == at::kBFloat16));
}

std::vector<std::string> swiglu_impls() {
  std::vector<std::string> v{"scalar"};
#ifdef SWIFTSPEC_SWIGLU_AVX512
  v.emplace_back("avx512");
#endif
#ifdef SWIFTSPEC_SWIGLU_AVX512BF16
  v.emplace_back("avx512_bf16");
#endif
  return v;
}

at::Tensor swiglu_with_impl(const at::Tensor& x, const at::Tensor& w_gate_up, const std::string& name) {
  Impl impl;
  if (name == "auto") {
    impl = best_impl(x.scalar_type() == at::kBFloat16);
  } else if (name == "scalar") {
    impl = Impl::kScalar;
  } else if (name == "avx512") {
    impl = Impl::kAvx512;
  } else if (name == "avx512_bf16") {
    impl = Impl::kAvx512Bf16;
  } else {
    TORCH_CHECK(false, "swiglu: unknown impl '", name, "' (auto, scalar, avx512, avx512_bf16)");
  }
  bool compiled = name == "auto";
  for (const auto& s : swiglu_impls()) compiled = compiled || s == name;
  TORCH_CHECK(compiled, "swiglu: impl '", name, "' is not compiled in this build");
  return swiglu_impl(x, w_gate_up, impl);
}

}  // namespace

void register_swiglu(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("swiglu", &swiglu, py::arg("x"), py::arg("w_gate_up"),
        R"doc(Fused SwiGLU: SiLU(x @ W_gate^T) * (x @ W_up^T), the CPU twin of reference.swiglu.

x: [M, K] float32 or bfloat16; w_gate_up: [2*I, K], same dtype, gate rows 0..I-1 then up rows
I..2I-1. Returns [M, I] in x's dtype. M <= 16 runs the fused weight-streaming kernel (fp32
accumulation, SiLU * up in fp32, one rounding to the output dtype), parallel over output columns
with at::parallel_for; M > 16 uses at::mm then SiLU * up. Releases the GIL.
Raises RuntimeError on non-CPU tensors, wrong ranks, dtypes other than fp32/bf16, mismatched
dtypes or K, or an odd number of weight rows.)doc",
        py::call_guard<py::gil_scoped_release>());
  m.def("_swiglu_impl", &swiglu_with_impl, py::arg("x"), py::arg("w_gate_up"), py::arg("impl"),
        "Test hook: swiglu with a forced inner kernel ('auto', 'scalar', 'avx512', 'avx512_bf16'; "
        "see _swiglu_impls()). Raises RuntimeError for an impl not compiled in this build.",
        py::call_guard<py::gil_scoped_release>());
  m.def("_swiglu_impls", &swiglu_impls, "Test hook: names of the swiglu inner kernels compiled in this build.");
}

}  // namespace swiftspec
