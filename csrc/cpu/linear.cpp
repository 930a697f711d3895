// Plain linear layer y = x @ w^T (+ bias), the CPU twin every decode-time projection uses (QKV,
// o_proj, down_proj, the LM head; swiftspec.ops.linear, reference.linear = F.linear).
//
// At decode time x has M <= 16 rows, the layer is bound by streaming w once, and the
// weight-streaming core of skinny_gemm.h (one weight stream, the store epilogue) beats a GEMM
// library's packed/blocked GEMM (SwiftSpec paper section 3.3; README.md, "Kernels"). Above 16 rows, or for dtypes other than
// fp32/bf16, or a weight whose rows are not contiguous, at::linear is used unchanged.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <torch/csrc/utils/pybind.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "skinny_gemm.h"

namespace swiftspec {
namespace {

using skinny::Impl;

void check_inputs(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "linear: x and w must be CPU tensors, got ",
              x.device(), " and ", w.device());
  TORCH_CHECK(x.dim() == 2, "linear: x must be [M, K], got ", x.sizes());
  TORCH_CHECK(w.dim() == 2, "linear: w must be [N, K], got ", w.sizes());
  TORCH_CHECK(w.scalar_type() == x.scalar_type(), "linear: w dtype ", w.scalar_type(), " differs from x dtype ",
              x.scalar_type());
  TORCH_CHECK(w.size(1) == x.size(1), "linear: K mismatch, x is ", x.sizes(), " and w is ", w.sizes());
  if (bias.has_value()) {
    const at::Tensor& b = *bias;
    TORCH_CHECK(b.device().is_cpu(), "linear: bias must be a CPU tensor, got ", b.device());
    TORCH_CHECK(b.dim() == 1 && b.size(0) == w.size(0), "linear: bias must be [N] = [", w.size(0), "], got ",
                b.sizes());
    TORCH_CHECK(b.scalar_type() == x.scalar_type(), "linear: bias dtype ", b.scalar_type(),
                " differs from x dtype ", x.scalar_type());
  }
}

at::Tensor linear_impl(const at::Tensor& x_in, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                       Impl impl) {
  check_inputs(x_in, w, bias);
  const int64_t M = x_in.size(0), K = x_in.size(1), N = w.size(0);
  const bool fits = x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16;
  // The kernel reads rows through a row stride, so only the elements inside a row must be
  // contiguous. A weight laid out otherwise (a transposed view) is left to at::linear rather than
  // copied on every call.
  const bool w_rows = K <= 1 || w.stride(1) == 1;
  if (M > skinny::kMaxRows || !fits || !w_rows) return at::linear(x_in, w, bias);
  const bool bf16 = x_in.scalar_type() == at::kBFloat16;
  TORCH_CHECK(!(impl == Impl::kAvx512Bf16 && !bf16), "linear: impl avx512_bf16 needs bfloat16 inputs");

  const at::Tensor x = (K <= 1 || x_in.stride(1) == 1) ? x_in : x_in.contiguous();
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  // The bias is added to the fp32 sums before the one rounding; converted once per call.
  std::vector<float> bias_f;
  if (bias.has_value()) {
    const at::Tensor b = bias->contiguous();
    bias_f.resize(static_cast<size_t>(N));
    if (bf16) {
      const auto* bb = static_cast<const uint16_t*>(b.data_ptr());
      for (int64_t n = 0; n < N; ++n) bias_f[n] = skinny::bf16_bits_to_float(bb[n]);
    } else {
      const auto* bb = static_cast<const float*>(b.data_ptr());
      for (int64_t n = 0; n < N; ++n) bias_f[n] = bb[n];
    }
  }
  const skinny::Problem<1> p = skinny::problem_of(x, w);
  const skinny::StoreEpilogue epi{out.data_ptr(), N, 0, bias_f.empty() ? nullptr : bias_f.data(), bf16};
  skinny::gemm(impl, p, 0, N, epi);
  return out;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  return linear_impl(x, w, bias, skinny::best_impl(x.scalar_type() == at::kBFloat16));
}

at::Tensor linear_with_impl(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                            const std::string& name) {
  return linear_impl(x, w, bias, skinny::impl_from_name(name, x.scalar_type() == at::kBFloat16, "linear"));
}

// y = (x @ q^T) * scales[None, :]: int8 weight-only linear (the draft model's layers, per-output-
// channel symmetric scales of swiftspec.model_executor.layers.quant). Only the decode sizes (M <= 16) come here;
// the Python op sends bigger batches to torch's int8 kernel.
at::Tensor int8_linear_impl(const at::Tensor& x_in, const at::Tensor& q, const at::Tensor& scales, Impl impl) {
  TORCH_CHECK(x_in.device().is_cpu() && q.device().is_cpu() && scales.device().is_cpu(),
              "int8_linear: x, q and scales must be CPU tensors");
  TORCH_CHECK(x_in.dim() == 2 && q.dim() == 2, "int8_linear: x must be [M, K] and q [N, K], got ", x_in.sizes(),
              " and ", q.sizes());
  TORCH_CHECK(x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16,
              "int8_linear: x must be float32 or bfloat16, got ", x_in.scalar_type());
  TORCH_CHECK(q.scalar_type() == at::kChar, "int8_linear: q must be int8, got ", q.scalar_type());
  TORCH_CHECK(q.size(1) == x_in.size(1), "int8_linear: K mismatch, x is ", x_in.sizes(), " and q is ", q.sizes());
  TORCH_CHECK(scales.dim() == 1 && scales.size(0) == q.size(0), "int8_linear: scales must be [N] = [", q.size(0),
              "], got ", scales.sizes());
  const int64_t M = x_in.size(0), K = x_in.size(1), N = q.size(0);
  TORCH_CHECK(M <= skinny::kMaxRows, "int8_linear: M = ", M, " rows, at most ", skinny::kMaxRows);
  const at::Tensor x = (K <= 1 || x_in.stride(1) == 1) ? x_in : x_in.contiguous();
  const at::Tensor w = (K <= 1 || q.stride(1) == 1) ? q : q.contiguous();
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const at::Tensor scale_f = scales.to(at::kFloat).contiguous();
  skinny::Problem<1> p = skinny::problem_of(x, w);
  p.w_int8 = true;
  const skinny::StoreEpilogue epi{out.data_ptr(), N, 0, nullptr, bf16, scale_f.data_ptr<float>()};
  skinny::gemm(impl, p, 0, N, epi);
  return out;
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales) {
  return int8_linear_impl(x, q, scales, skinny::best_impl(x.scalar_type() == at::kBFloat16));
}

at::Tensor int8_linear_with_impl(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                                 const std::string& name) {
  return int8_linear_impl(x, q, scales,
                          skinny::impl_from_name(name, x.scalar_type() == at::kBFloat16, "int8_linear"));
}

}  // namespace

void register_linear(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("linear", &linear, py::arg("x"), py::arg("w"), py::arg("bias") = py::none(),
        R"doc(Linear layer x @ w.T (+ bias), the CPU twin of reference.linear (F.linear).

x: [M, K] float32 or bfloat16 (any strides); w: [N, K], same dtype, elements of a row contiguous
(any row stride, e.g. w[:limit] of a bigger table); bias: [N] of that dtype or None. Returns a new
[M, N] tensor in x's dtype. M <= 16 runs the weight-streaming skinny GEMM (fp32 accumulation, the
bias added in fp32, one rounding to the output dtype), parallel over output columns with
at::parallel_for; M > 16, other dtypes (float16, float64) or a weight with non-contiguous rows use
at::linear. Releases the GIL.
Raises RuntimeError on non-CPU tensors, wrong ranks, mismatched dtypes, K or bias shape.)doc",
        py::call_guard<py::gil_scoped_release>());
  m.def("_linear_impl", &linear_with_impl, py::arg("x"), py::arg("w"), py::arg("bias"), py::arg("impl"),
        "Test hook: linear with a forced inner kernel ('auto', 'scalar', 'avx512', 'avx512_bf16'; "
        "see _linear_impls()). Raises RuntimeError for an impl not compiled in this build.",
        py::call_guard<py::gil_scoped_release>());
  m.def("int8_linear", &int8_linear, py::arg("x"), py::arg("q"), py::arg("scales"),
        R"doc(Int8 weight-only linear (x @ q.T) * scales, the CPU twin of reference.int8_linear.

x: [M, K] float32 or bfloat16 with M <= 16; q: [N, K] int8 (elements of a row contiguous); scales:
[N] float (any float dtype, used in fp32). Returns a new [M, N] tensor in x's dtype: the int8
weights are widened exactly, dotted with x in fp32 (AVX-512 FMA; scalar without AVX-512), and the
scale is applied in fp32 before the one rounding. Releases the GIL.
Raises RuntimeError on non-CPU tensors, wrong dtypes or ranks, M > 16, K or scales shape.)doc",
        py::call_guard<py::gil_scoped_release>());
  m.def("_int8_linear_impl", &int8_linear_with_impl, py::arg("x"), py::arg("q"), py::arg("scales"),
        py::arg("impl"), "Test hook: int8_linear with a forced inner kernel (see _linear_impls()).",
        py::call_guard<py::gil_scoped_release>());
  m.def("_linear_impls", &skinny::compiled_impls,
        "Test hook: names of the linear inner kernels compiled in this build.");
}

}  // namespace swiftspec
