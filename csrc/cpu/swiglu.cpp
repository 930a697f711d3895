// Fused SwiGLU, the CPU twin of the CUDA kernel (SwiftSpec paper section 3.3,
// "Fused SwiGLU": the gate and up tiles of the same input are computed in one pass and
// SiLU(gate) * up is applied in the epilogue, so the intermediate [M, 2I] never reaches memory).
//
// Decode-time calls are skinny (M <= 16 rows): the op is bound by streaming the weights once, so
// it runs the weight-streaming core of skinny_gemm.h with two weight streams: for each output
// column n, gate row n and up row n are read once, side by side, and dotted with all M rows of x;
// the epilogue turns a column tile of gate/up sums into SiLU(gate) * up. For M > 16 (prefill) the
// weights are reused enough that a GEMM library wins, so we fall back to at::mm.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/utils/pybind.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "skinny_gemm.h"

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
                                 skinny::float_to_bf16_avx512(y));
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
  m.def("_swiglu_impls", &skinny::compiled_impls,
        "Test hook: names of the swiglu inner kernels compiled in this build.");
}

}  // namespace swiftspec
