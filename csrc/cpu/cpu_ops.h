// The C++ entry points of the CPU twins that other twins call directly (no Python in between):
// the native decoder layer (decoder_layer.cpp) chains them. Each is the function its domain file
// binds to Python under the same name without "_cpu"; shapes, dtypes and errors are documented there.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <tuple>
#include <vector>

namespace swiftspec {

// quant_gemm.cpp: y [M, sum N_i] fp32 = x [M, K] (fp32/bf16) @ dequant(W).T, kernel picked from cpuid
at::Tensor quant_linear_cpu(const at::Tensor& x, const std::vector<at::Tensor>& weights,
                            const std::vector<int64_t>& types);

// rms_norm.cpp: (y, x + residual) of the fused residual add + RMSNorm
std::tuple<at::Tensor, at::Tensor> rms_norm_cpu(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                                const at::Tensor& weight, double eps);

// swiglu.cpp: SiLU(gate) * up of a [M, 2I] fp32 gate | up matrix, [M, I] in out_dtype (fp32/bf16); and
// whether that runs a SIMD loop (false: only the scalar test loop is compiled, and callers use ATen)
at::Tensor silu_mul_cpu(const at::Tensor& gate_up, at::ScalarType out_dtype);
bool silu_mul_simd();

// tree_attention.cpp: RoPE + KV write + masked attention, [n, Hq * D] in q's dtype
at::Tensor tree_attention_cpu(const at::Tensor& q, const at::Tensor& k_new, const at::Tensor& v_new, at::Tensor k_cache,
                              at::Tensor v_cache, const at::Tensor& slots, const at::Tensor& positions,
                              const at::Tensor& cos_table, const at::Tensor& sin_table, const at::Tensor& mask,
                              double scale, const c10::optional<at::Tensor>& slot_positions = c10::nullopt);

}  // namespace swiftspec
