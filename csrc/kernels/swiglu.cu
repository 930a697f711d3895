// Fused SwiGLU for skinny M (decode / tree verification, M <= 16): SiLU(x @ W_gate^T) * (x @ W_up^T)
// in one pass (SwiftSpec paper section 3.3 "Fused SwiGLU"; semantics of reference.swiglu).
//
// Each warp owns two output columns n, n+1: it streams gate rows n, n+1 and up rows I+n, I+n+1
// (four weight rows, read exactly once) against all M staged input rows, so the input is never
// loaded twice for gate and up, and applies the SiLU(gate) * up epilogue in registers before the
// single store of the output. CUTLASS is not used: see gemv.cuh (bandwidth-bound GEMV at these
// shapes; the Python wrapper sends M > 16 to cuBLAS through torch).
#include "api.h"
#include "common.cuh"
#include "gemv.cuh"

namespace swiftspec {
namespace cuda {
namespace {

constexpr int kColsPerWarp = 2;
constexpr int kColsPerBlock = kGemvWarps * kColsPerWarp;

// x [M, K], w [2I, K] (gate rows then up rows), out [M, I]. Grid: ceil(I / kColsPerBlock) blocks of
// kGemvThreads threads.
template <typename T, int MT>
__global__ void __launch_bounds__(kGemvThreads)
    swiglu_kernel(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ out, int M,
                  int K, int I, bool vec_ok) {
  __shared__ __align__(16) float xs[MT * kGemvKChunk];
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int n0 = (blockIdx.x * kGemvWarps + warp) * kColsPerWarp;

  // rows: gate n0, up n0, gate n0+1, up n0+1
  const T* rows[2 * kColsPerWarp];
#pragma unroll
  for (int c = 0; c < kColsPerWarp; ++c) {
    const int n = n0 + c;
    const bool ok = n < I;
    rows[2 * c] = ok ? w + static_cast<int64_t>(n) * K : nullptr;
    rows[2 * c + 1] = ok ? w + static_cast<int64_t>(I + n) * K : nullptr;
  }
  float acc[2 * kColsPerWarp][MT];
  block_gemv<T, MT, 2 * kColsPerWarp>(x, M, K, rows, vec_ok, xs, acc);

  // Epilogue: lane (c * MT + m) writes out[m, n0 + c]; the reference rounds the matmul result,
  // SiLU(gate) and the product to T, which we reproduce so bf16 outputs agree to the last bit in
  // most elements. Selecting acc with compile-time indices keeps it in registers.
#pragma unroll
  for (int c = 0; c < kColsPerWarp; ++c) {
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      if (lane == ((c * MT + m) & 31) && m < M && n0 + c < I) {
        const float g = round_to<T>(acc[2 * c][m]);
        const float u = round_to<T>(acc[2 * c + 1][m]);
        const float s = round_to<T>(g / (1.f + expf(-g)));
        out[static_cast<int64_t>(m) * I + n0 + c] = from_float<T>(s * u);
      }
    }
  }
}

}  // namespace
}  // namespace cuda
}  // namespace swiftspec

using namespace swiftspec::cuda;

extern "C" SS_API int ss_swiglu(const void* x, const void* w_gate_up, void* out, int M, int K, int I,
                                int dtype, void* stream) {
  if (M < 0 || M > SS_MAX_M || K < 0 || I < 0 || dtype_size(dtype) == 0)
    return static_cast<int>(cudaErrorInvalidValue);
  if (M == 0 || I == 0) return 0;
  if (x == nullptr || w_gate_up == nullptr || out == nullptr)
    return static_cast<int>(cudaErrorInvalidValue);
  const int esize = dtype_size(dtype);
  const bool vec_ok = (reinterpret_cast<uintptr_t>(w_gate_up) % 16 == 0) &&
                      ((static_cast<int64_t>(K) * esize) % 16 == 0);
  const dim3 grid((I + kColsPerBlock - 1) / kColsPerBlock);
  auto s = static_cast<cudaStream_t>(stream);
  return dispatch_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    return dispatch_m(M, [&](auto mt) {
      constexpr int MT = decltype(mt)::value;
      swiglu_kernel<T, MT><<<grid, kGemvThreads, 0, s>>>(static_cast<const T*>(x),
                                                         static_cast<const T*>(w_gate_up),
                                                         static_cast<T*>(out), M, K, I, vec_ok);
      return launch_status();
    });
  });
}
