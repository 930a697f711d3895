// Fused residual add + RMSNorm of decode rows (vLLM's fused_add_rms_norm, csrc/layernorm_kernels.cu;
// semantics of reference.rms_norm): one block per row, the row held in registers, so the add, the
// statistics and the normalization read the inputs once and launch once instead of the eight
// elementwise and reduction kernels of the PyTorch path. The sum of squares is reduced in a fixed
// order (each thread's columns, then the warps' shuffles, then the warps in order) that depends on
// nothing but the row length: a row's result is the same whatever other rows are in the launch.
#include "api.h"
#include "common.cuh"

namespace swiftspec {
namespace cuda {
namespace {

constexpr int kNormThreads = 256;
constexpr int kNormPerThread = SS_NORM_MAX_H / kNormThreads;

// x, residual, out, res_out [rows, H]; weight [H]. residual and res_out may be null (no add).
template <typename T>
__global__ void __launch_bounds__(kNormThreads)
    rms_norm_kernel(const T* __restrict__ x, const T* __restrict__ residual,
                    const T* __restrict__ weight, T* __restrict__ out, T* __restrict__ res_out, int H,
                    float eps) {
  __shared__ float warp_sums[kNormThreads / 32];
  __shared__ float total;
  const int64_t base = static_cast<int64_t>(blockIdx.x) * H;
  float v[kNormPerThread];
  // every load issued before any is used
#pragma unroll
  for (int r = 0; r < kNormPerThread; ++r) {
    const int c = threadIdx.x + r * kNormThreads;
    float a = 0.f;
    if (c < H) {
      a = to_float<T>(x[base + c]);
      if (residual != nullptr) a = round_to<T>(a + to_float<T>(residual[base + c]));  // x + residual in T
    }
    v[r] = a;
  }
  float ss = 0.f;
#pragma unroll
  for (int r = 0; r < kNormPerThread; ++r) {
    const int c = threadIdx.x + r * kNormThreads;
    if (c < H) {
      if (res_out != nullptr) res_out[base + c] = from_float<T>(v[r]);
      ss = fmaf(v[r], v[r], ss);
    }
  }
  ss = warp_sum(ss);
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = ss;
  __syncthreads();
  if (threadIdx.x == 0) {
    float t = 0.f;
    for (int w = 0; w < kNormThreads / 32; ++w) t += warp_sums[w];
    total = t;
  }
  __syncthreads();
  const float inv = rsqrtf(total / static_cast<float>(H) + eps);
#pragma unroll
  for (int r = 0; r < kNormPerThread; ++r) {
    const int c = threadIdx.x + r * kNormThreads;
    // the normalized value is rounded to T before the weight multiply, as the reference does
    if (c < H) out[base + c] = from_float<T>(to_float<T>(weight[c]) * round_to<T>(v[r] * inv));
  }
}

}  // namespace
}  // namespace cuda
}  // namespace swiftspec

using namespace swiftspec::cuda;

extern "C" SS_API int ss_rms_norm(const void* x, const void* residual, const void* weight, void* out,
                                  void* res_out, int rows, int H, float eps, int dtype, void* stream) {
  if (rows < 0 || H < 1 || H > SS_NORM_MAX_H || dtype_size(dtype) == 0 || !(eps >= 0.f) ||
      (residual == nullptr) != (res_out == nullptr))
    return static_cast<int>(cudaErrorInvalidValue);
  if (rows == 0) return 0;
  if (x == nullptr || weight == nullptr || out == nullptr)
    return static_cast<int>(cudaErrorInvalidValue);
  auto s = static_cast<cudaStream_t>(stream);
  return dispatch_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    rms_norm_kernel<T><<<rows, kNormThreads, 0, s>>>(
        static_cast<const T*>(x), static_cast<const T*>(residual), static_cast<const T*>(weight),
        static_cast<T*>(out), static_cast<T*>(res_out), H, eps);
    return launch_status();
  });
}
