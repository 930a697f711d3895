// RMSNorm with the fused residual add (vLLM / nano-vllm's fused_add_rms_norm), the CPU twin of
// swiftspec.ops.reference.rms_norm: one pass per row instead of seven PyTorch ops.
//
//   x = x + residual        (in x's dtype, when a residual is given)
//   y = weight * dtype(x * (1 / sqrt(mean(x^2) + eps)))   (x^2 summed in fp32)
//
// The sum of squares runs in 8 fp32 lanes (lane l takes elements l, l + 8, ...) folded in a fixed
// order, so a row's result depends on that row alone: bit-identical whatever other rows or thread
// count it runs with (batch invariance). Plain C++: the compiler vectorizes the lanes for the CPU
// the extension is built on.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/utils/pybind.h>

#include <cmath>
#include <cstdint>
#include <tuple>

#include "cpu_ops.h"
#include "vec_math.h"

namespace swiftspec {
namespace {

template <class T>
void norm_rows(int64_t begin, int64_t end, int64_t H, T* x, const T* res, T* res_out, const T* w, T* y,
               float eps) {
  constexpr int L = 8;
  float row[8192];
  for (int64_t m = begin; m < end; ++m) {
    T* xr = x + m * H;
    float acc[L] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int64_t i = 0; i < H; ++i) {
      T v = xr[i];
      if (res != nullptr) {
        v = static_cast<T>(static_cast<float>(v) + static_cast<float>(res[m * H + i]));  // rounded to T as x + residual in T
        res_out[m * H + i] = v;
      }
      row[i] = static_cast<float>(v);
    }
    int64_t i = 0;
    for (; i + L <= H; i += L)
      for (int l = 0; l < L; ++l) acc[l] += row[i + l] * row[i + l];
    for (int l = 0; i < H; ++i, ++l) acc[l] += row[i] * row[i];
    const float ss = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
    const float r = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
    T* yr = y + m * H;
    for (int64_t j = 0; j < H; ++j) {
      const float normed = static_cast<float>(static_cast<T>(row[j] * r));  // rounded to T first
      yr[j] = static_cast<T>(static_cast<float>(w[j]) * normed);
    }
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> rms_norm_cpu(const at::Tensor& x_in, const c10::optional<at::Tensor>& residual,
                                                const at::Tensor& weight, double eps) {
  TORCH_CHECK(x_in.device().is_cpu() && weight.device().is_cpu(), "rms_norm: tensors must be on the CPU");
  TORCH_CHECK(x_in.dim() == 2, "rms_norm: x must be [M, H], got ", x_in.sizes());
  TORCH_CHECK(x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16,
              "rms_norm: x must be float32 or bfloat16, got ", x_in.scalar_type());
  const int64_t M = x_in.size(0), H = x_in.size(1);
  TORCH_CHECK(H > 0 && H <= 8192, "rms_norm: hidden size must be in [1, 8192], got ", H);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == H && weight.scalar_type() == x_in.scalar_type(),
              "rms_norm: weight must be [", H, "] of x's dtype, got ", weight.sizes(), " ", weight.scalar_type());
  at::Tensor x = x_in.contiguous();
  at::Tensor res, res_out;
  if (residual.has_value()) {
    res = residual->contiguous();
    TORCH_CHECK(res.sizes() == x.sizes() && res.scalar_type() == x.scalar_type() && res.device().is_cpu(),
                "rms_norm: residual must match x ", x.sizes(), " ", x.scalar_type());
    res_out = at::empty_like(x);
  }
  at::Tensor w = weight.contiguous();
  at::Tensor y = at::empty_like(x);
  const float e = static_cast<float>(eps);
  at::parallel_for(0, M, 16, [&](int64_t b, int64_t en) {
    if (x.scalar_type() == at::kFloat) {
      norm_rows<float>(b, en, H, x.data_ptr<float>(), res.defined() ? res.data_ptr<float>() : nullptr,
                       res_out.defined() ? res_out.data_ptr<float>() : nullptr, w.data_ptr<float>(),
                       y.data_ptr<float>(), e);
    } else {
      using B = c10::BFloat16;
      norm_rows<B>(b, en, H, x.data_ptr<B>(), res.defined() ? res.data_ptr<B>() : nullptr,
                   res_out.defined() ? res_out.data_ptr<B>() : nullptr, w.data_ptr<B>(), y.data_ptr<B>(), e);
    }
  });
  return {y, res.defined() ? res_out : x_in};
}


void register_rms_norm(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("rms_norm", &rms_norm_cpu, py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("eps"),
        R"doc(Fused residual add + RMSNorm, the CPU twin of reference.rms_norm.

x [M, H] and residual [M, H] (or None), weight [H], all float32 or all bfloat16, H <= 8192.
Returns (y, x + residual) with y = weight * (x / sqrt(mean(x^2) + eps)) (fp32 statistics, rounded
to x's dtype before the weight multiply); without a residual, (y, x). Row-wise and batch invariant.
Raises RuntimeError on non-CPU tensors, other dtypes or mismatched shapes.)doc",
        py::call_guard<py::gil_scoped_release>());
}

}  // namespace swiftspec
