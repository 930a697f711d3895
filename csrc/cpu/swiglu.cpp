// Fused SwiGLU, the CPU twin of the CUDA kernel (SwiftSpec paper section 3.3,
// "Fused SwiGLU": the gate and up tiles of the same input are computed in one pass and
// SiLU(gate) * up is applied in the epilogue, so the intermediate [M, 2I] never reaches memory).
//
// Decode-time calls are skinny (M <= 16 rows): the op is bound by streaming the weights once, so
// it runs the weight-streaming core of skinny_gemm.h with two weight streams: for each output
// column n, gate row n and up row n are read once, side by side, and dotted with all M rows of x;
// the epilogue turns a column tile of gate/up sums into SiLU(gate) * up. For M > 16 (prefill) the
// weights are reused enough that a GEMM library wins, so we fall back to at::mm.
//
// silu_mul is the activation alone, for the layers whose gate/up projection is another kernel (the
// quantized GEMM on GGUF blocks writes [M, 2I] fp32 gate | up sums): SiLU(gate) * up in one pass,
// rounded once to the output dtype, where PyTorch reads the strided gate half for SiLU, multiplies
// in a second pass and casts in a third.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/StringUtil.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "cpu_ops.h"
#include "skinny_gemm.h"
#include "vec_math.h"

namespace swiftspec {
namespace {

using skinny::Impl;
using skinny::kColTile;

// Output of the SwiGLU epilogue: out[m, n] for n in [0, I), row stride I.
struct SwigluEpilogue {
  void* out;  // [M, I], fp32 or bf16
  int64_t I;
  bool bf16;

  void operator()(const skinny::Tile<2>& t) const {
#ifdef SWIFTSPEC_SKINNY_AVX512
    if (t.simd) return simd(t);
#endif
    for (int64_t m = 0; m < t.M; ++m) {
      for (int64_t c = 0; c < t.ncols; ++c) {
        const float g = t.sums[0][m * kColTile + c];
        const float y = g / (1.f + std::exp(-g)) * t.sums[1][m * kColTile + c];
        if (bf16)
          static_cast<uint16_t*>(out)[m * I + t.n0 + c] = skinny::float_to_bf16_bits(y);
        else
          static_cast<float*>(out)[m * I + t.n0 + c] = y;
      }
    }
  }

#ifdef SWIFTSPEC_SKINNY_AVX512
  void simd(const skinny::Tile<2>& t) const;
#endif
};

#ifdef SWIFTSPEC_SKINNY_AVX512
using vec::exp_avx512;

void SwigluEpilogue::simd(const skinny::Tile<2>& t) const {
  const __m512 one = _mm512_set1_ps(1.f);
  for (int64_t m = 0; m < t.M; ++m) {
    for (int64_t c = 0; c < t.ncols; c += 16) {
      const __mmask16 k = skinny::tail_mask16(t.ncols - c);
      const __m512 g = _mm512_maskz_loadu_ps(k, t.sums[0] + m * kColTile + c);
      const __m512 u = _mm512_maskz_loadu_ps(k, t.sums[1] + m * kColTile + c);
      const __m512 sig_den = _mm512_add_ps(one, exp_avx512(_mm512_sub_ps(_mm512_setzero_ps(), g)));
      const __m512 y = _mm512_mul_ps(_mm512_div_ps(g, sig_den), u);
      if (bf16) {
        _mm256_mask_storeu_epi16(static_cast<uint16_t*>(out) + m * I + t.n0 + c, k,
                                 vec::float_to_bf16_avx512(y));
      } else {
        _mm512_mask_storeu_ps(static_cast<float*>(out) + m * I + t.n0 + c, k, y);
      }
    }
  }
}
#endif  // SWIFTSPEC_SKINNY_AVX512

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

at::Tensor swiglu_impl(const at::Tensor& x_in, const at::Tensor& w_in, Impl impl) {
  check_inputs(x_in, w_in);
  const int64_t M = x_in.size(0), K = x_in.size(1), I = w_in.size(0) / 2;
  if (M > skinny::kMaxRows) {
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

  skinny::Problem<2> p;
  p.x = x.data_ptr();
  p.ldx = K;
  p.w[0] = w.data_ptr();                                                 // gate rows 0..I-1
  p.w[1] = static_cast<const char*>(w.data_ptr()) + I * K * w.element_size();  // up rows I..2I-1
  p.ldw = K;
  p.M = M;
  p.K = K;
  p.bf16 = bf16;
  skinny::gemm(impl, p, 0, I, SwigluEpilogue{out.data_ptr(), I, bf16});
  return out;
}

at::Tensor swiglu(const at::Tensor& x, const at::Tensor& w_gate_up) {
  return swiglu_impl(x, w_gate_up, skinny::best_impl(x.scalar_type() == at::kBFloat16));
}

at::Tensor swiglu_with_impl(const at::Tensor& x, const at::Tensor& w_gate_up, const std::string& name) {
  return swiglu_impl(x, w_gate_up, skinny::impl_from_name(name, x.scalar_type() == at::kBFloat16, "swiglu"));
}

// ---- silu_mul ---------------------------------------------------------------------------------
// out[m, c] = g / (1 + exp(-g)) * u with g = gu[m, c], u = gu[m, I + c], in fp32, one rounding to
// the output dtype. Elementwise with every element through the same instructions (the SIMD loops
// take a row's tail through masked or padded lanes), so a row's result does not depend on the
// other rows or the thread count (batch invariance). exp: vec_math.h (degree-7 polynomial,
// < 6e-9 relative); the scalar loop uses std::exp (a test reference, never dispatched).
enum class SiluMul { kScalar, kAvx2, kAvx512 };

std::vector<std::string> silu_mul_impls() {
  std::vector<std::string> r{"scalar"};
#if defined(__AVX2__) && defined(__FMA__)
  r.emplace_back("avx2");
#endif
#ifdef SWIFTSPEC_SKINNY_AVX512
  r.emplace_back("avx512");
#endif
  return r;
}

SiluMul silu_mul_from_name(const std::string& name) {
  const std::vector<std::string> have = silu_mul_impls();
  const std::string pick = name == "auto" ? have.back() : name;
  TORCH_CHECK(std::find(have.begin(), have.end(), pick) != have.end(), "silu_mul: unknown impl '", name,
              "' (this build has: ", c10::Join(", ", have), ")");
  return pick == "avx512" ? SiluMul::kAvx512 : (pick == "avx2" ? SiluMul::kAvx2 : SiluMul::kScalar);
}

void silu_mul_row_scalar(const float* g, const float* u, int64_t n, float* of, uint16_t* ob) {
  for (int64_t c = 0; c < n; ++c) {
    const float y = g[c] / (1.f + std::exp(-g[c])) * u[c];
    if (ob != nullptr)
      ob[c] = vec::float_to_bf16_bits(y);
    else
      of[c] = y;
  }
}

#if defined(__AVX2__) && defined(__FMA__)
inline __m256 silu_mul8(__m256 g, __m256 u) {
  const __m256 den = _mm256_add_ps(_mm256_set1_ps(1.f), vec::exp_avx2(_mm256_sub_ps(_mm256_setzero_ps(), g)));
  return _mm256_mul_ps(_mm256_div_ps(g, den), u);
}

void silu_mul_row_avx2(const float* g, const float* u, int64_t n, float* of, uint16_t* ob) {
  int64_t c = 0;
  for (; c + 8 <= n; c += 8) {
    const __m256 y = silu_mul8(_mm256_loadu_ps(g + c), _mm256_loadu_ps(u + c));
    if (ob != nullptr)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(ob + c), vec::float_to_bf16_avx2(y));
    else
      _mm256_storeu_ps(of + c, y);
  }
  if (c == n) return;
  // the tail through zero-padded lanes: the same instructions as a full vector
  alignas(32) float gt[8] = {}, ut[8] = {}, yt[8];
  alignas(16) uint16_t bt[8];
  const int64_t k = n - c;
  for (int64_t i = 0; i < k; ++i) gt[i] = g[c + i], ut[i] = u[c + i];
  const __m256 y = silu_mul8(_mm256_load_ps(gt), _mm256_load_ps(ut));
  _mm256_store_ps(yt, y);
  _mm_store_si128(reinterpret_cast<__m128i*>(bt), vec::float_to_bf16_avx2(y));
  for (int64_t i = 0; i < k; ++i) {
    if (ob != nullptr)
      ob[c + i] = bt[i];
    else
      of[c + i] = yt[i];
  }
}
#endif

#ifdef SWIFTSPEC_SKINNY_AVX512
inline __m512 silu_mul16(__m512 g, __m512 u) {
  const __m512 den = _mm512_add_ps(_mm512_set1_ps(1.f), vec::exp_avx512(_mm512_sub_ps(_mm512_setzero_ps(), g)));
  return _mm512_mul_ps(_mm512_div_ps(g, den), u);
}

void silu_mul_row_avx512(const float* g, const float* u, int64_t n, float* of, uint16_t* ob) {
  int64_t c = 0;
  for (; c + 16 <= n; c += 16) {  // whole vectors unmasked, the tail through a masked one
    const __m512 y = silu_mul16(_mm512_loadu_ps(g + c), _mm512_loadu_ps(u + c));
    if (ob != nullptr)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(ob + c), vec::float_to_bf16_avx512(y));
    else
      _mm512_storeu_ps(of + c, y);
  }
  if (c < n) {
    const __mmask16 k = skinny::tail_mask16(n - c);
    const __m512 y = silu_mul16(_mm512_maskz_loadu_ps(k, g + c), _mm512_maskz_loadu_ps(k, u + c));
    if (ob != nullptr)
      _mm256_mask_storeu_epi16(ob + c, k, vec::float_to_bf16_avx512(y));
    else
      _mm512_mask_storeu_ps(of + c, k, y);
  }
}
#endif

at::Tensor silu_mul_impl(const at::Tensor& gu_in, at::ScalarType out_dtype, SiluMul impl) {
  TORCH_CHECK(gu_in.device().is_cpu(), "silu_mul: gate_up must be a CPU tensor");
  TORCH_CHECK(gu_in.dim() == 2, "silu_mul: gate_up must be [M, 2*I], got ", gu_in.sizes());
  TORCH_CHECK(gu_in.scalar_type() == at::kFloat, "silu_mul: gate_up must be float32, got ", gu_in.scalar_type());
  TORCH_CHECK(gu_in.size(1) % 2 == 0, "silu_mul: gate_up's last dimension must be even (gate then up), got ",
              gu_in.size(1));
  TORCH_CHECK(out_dtype == at::kFloat || out_dtype == at::kBFloat16,
              "silu_mul: the output dtype must be float32 or bfloat16, got ", out_dtype);
  const at::Tensor gu = gu_in.contiguous();
  const int64_t M = gu.size(0), I = gu.size(1) / 2;
  at::Tensor out = at::empty({M, I}, gu.options().dtype(out_dtype));
  if (M == 0 || I == 0) return out;
  const float* src = gu.data_ptr<float>();
  const bool bf16 = out_dtype == at::kBFloat16;
  auto* of = bf16 ? nullptr : out.data_ptr<float>();
  auto* ob = bf16 ? reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()) : nullptr;
  // a thread takes whole rows, at least ~32k elements of them (a decode step's row stays on one)
  at::parallel_for(0, M, std::max<int64_t>(1, 32768 / I), [&](int64_t b, int64_t e) {
    for (int64_t m = b; m < e; ++m) {
      const float* g = src + m * 2 * I;
      float* ofr = of != nullptr ? of + m * I : nullptr;
      uint16_t* obr = ob != nullptr ? ob + m * I : nullptr;
      switch (impl) {
#ifdef SWIFTSPEC_SKINNY_AVX512
        case SiluMul::kAvx512: silu_mul_row_avx512(g, g + I, I, ofr, obr); break;
#endif
#if defined(__AVX2__) && defined(__FMA__)
        case SiluMul::kAvx2: silu_mul_row_avx2(g, g + I, I, ofr, obr); break;
#endif
        default: silu_mul_row_scalar(g, g + I, I, ofr, obr);
      }
    }
  });
  return out;
}

}  // namespace

bool silu_mul_simd() {
  static const bool simd = silu_mul_impls().back() != "scalar";
  return simd;
}

at::Tensor silu_mul_cpu(const at::Tensor& gate_up, at::ScalarType out_dtype) {
  static const SiluMul best = silu_mul_from_name("auto");
  return silu_mul_impl(gate_up, out_dtype, best);
}

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
  m.def("_swiglu_impls", &skinny::compiled_impls,
        "Test hook: names of the swiglu inner kernels compiled in this build.");
  m.def("silu_mul", [](const at::Tensor& gate_up, at::ScalarType dtype) { return silu_mul_cpu(gate_up, dtype); },
        py::arg("gate_up"), py::arg("dtype"),
        R"doc(SiLU(gate) * up over a merged projection, the CPU twin of reference.silu_and_mul.

gate_up: [M, 2*I] float32 (gate columns 0..I-1, then up); dtype: torch.float32 or torch.bfloat16.
Returns [M, I] in dtype: computed in fp32 (exp: a degree-7 polynomial, < 6e-9 relative), one
rounding; one pass, rows split over at::parallel_for; batch invariant. Runs the widest SIMD loop
compiled (_silu_mul_impls()). Releases the GIL. Raises RuntimeError on a non-CPU or non-float32
input, a rank other than 2, an odd last dimension or another output dtype.)doc",
        py::call_guard<py::gil_scoped_release>());
  m.def("_silu_mul_impl",
        [](const at::Tensor& gate_up, at::ScalarType dtype, const std::string& impl) {
          return silu_mul_impl(gate_up, dtype, silu_mul_from_name(impl));
        },
        py::arg("gate_up"), py::arg("dtype"), py::arg("impl"),
        "Test hook: silu_mul with a forced loop ('auto' or one of _silu_mul_impls()). Raises RuntimeError for "
        "an impl not compiled in this build.",
        py::call_guard<py::gil_scoped_release>());
  m.def("_silu_mul_impls", &silu_mul_impls,
        "Test hook: the silu_mul loops compiled in this build, widest last ('scalar', then 'avx2', 'avx512').");
}

}  // namespace swiftspec
