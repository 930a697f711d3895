// Device helpers shared by the CUDA kernels: dtype dispatch, fp32 conversions, 16-byte vector
// loads, warp reductions, the SM count cache. Header-only, included by the .cu files.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <atomic>

#include "api.h"

namespace swiftspec {
namespace cuda {

// ---- fp32 conversions ---------------------------------------------------------------------
template <typename T>
__device__ __forceinline__ float to_float(T v);
template <>
__device__ __forceinline__ float to_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <>
__device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }

// Round through T and back: reproduces the references' intermediate casts (e.g. RoPE output and
// the matmul result are materialized in the input dtype before the next op).
template <typename T>
__device__ __forceinline__ float round_to(float v) { return to_float<T>(from_float<T>(v)); }

// Raw 16-bit / 32-bit element bits to fp32 (used on LL payload words).
template <typename T>
__device__ __forceinline__ float bits_to_float(uint32_t bits);
template <>
__device__ __forceinline__ float bits_to_float<float>(uint32_t bits) { return __uint_as_float(bits); }
template <>
__device__ __forceinline__ float bits_to_float<__nv_bfloat16>(uint32_t bits) {
  return __uint_as_float(bits << 16);  // bf16 is the top half of an fp32
}
template <>
__device__ __forceinline__ float bits_to_float<__half>(uint32_t bits) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
}

// 16 bytes of T (4 fp32 or 8 bf16/fp16) from global memory, as fp32. p must be 16-byte aligned.
// __ldg: weights are read-only for the whole kernel, so the non-coherent path is safe.
template <typename T>
struct Vec16 {
  static constexpr int N = 16 / static_cast<int>(sizeof(T));
};

// The raw 16 bytes (a load can be issued early and converted when it is used).
__device__ __forceinline__ uint4 load16_raw(const void* p) {
  return __ldg(reinterpret_cast<const uint4*>(p));
}

// 16 raw bytes holding Vec16<T>::N values of T, as fp32 (all-zero bytes give zeros for every T).
template <typename T>
__device__ __forceinline__ void raw16_to_float(uint4 v, float* out);
template <>
__device__ __forceinline__ void raw16_to_float<float>(uint4 v, float* out) {
  out[0] = __uint_as_float(v.x);
  out[1] = __uint_as_float(v.y);
  out[2] = __uint_as_float(v.z);
  out[3] = __uint_as_float(v.w);
}
template <>
__device__ __forceinline__ void raw16_to_float<__nv_bfloat16>(uint4 v, float* out) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    out[2 * i] = __uint_as_float(w[i] << 16);
    out[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
  }
}
template <>
__device__ __forceinline__ void raw16_to_float<__half>(uint4 v, float* out) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    out[2 * i] = __half2float(__ushort_as_half(static_cast<unsigned short>(w[i] & 0xFFFFu)));
    out[2 * i + 1] = __half2float(__ushort_as_half(static_cast<unsigned short>(w[i] >> 16)));
  }
}

template <typename T>
__device__ __forceinline__ void load16_as_float(const T* p, float* out) {
  raw16_to_float<T>(load16_raw(p), out);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
  return v;
}

// ---- host helpers ------------------------------------------------------------------------------

// Multiprocessor count of the current device. Cached because launchers need it on every call and
// cudaDeviceGetAttribute is not free; a benign race (two threads filling the same entry with the
// same value) is harmless, hence relaxed atomics.
inline cudaError_t current_sm_count(int* count) {
  static std::atomic<int> cache[64];
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  if (dev >= 0 && dev < 64) {
    const int c = cache[dev].load(std::memory_order_relaxed);
    if (c > 0) {
      *count = c;
      return cudaSuccess;
    }
  }
  int c = 0;
  err = cudaDeviceGetAttribute(&c, cudaDevAttrMultiProcessorCount, dev);
  if (err != cudaSuccess) return err;
  if (dev >= 0 && dev < 64) cache[dev].store(c, std::memory_order_relaxed);
  *count = c;
  return cudaSuccess;
}

// Status of the launch just enqueued (configuration errors, no device, ...).
inline int launch_status() { return static_cast<int>(cudaGetLastError()); }

inline int dtype_size(int dtype) {
  switch (dtype) {
    case SS_DTYPE_FLOAT32: return 4;
    case SS_DTYPE_BFLOAT16:
    case SS_DTYPE_FLOAT16: return 2;
    default: return 0;
  }
}

// Calls f(T{}) with T the element type of `dtype`; returns cudaErrorInvalidValue for an unknown code.
template <typename F>
inline int dispatch_dtype(int dtype, F&& f) {
  switch (dtype) {
    case SS_DTYPE_FLOAT32: return f(float{});
    case SS_DTYPE_BFLOAT16: return f(__nv_bfloat16{});
    case SS_DTYPE_FLOAT16: return f(__half{});
    default: return static_cast<int>(cudaErrorInvalidValue);
  }
}

// Calls f(std::integral_constant<int, MT>) with MT the smallest of 1, 2, 4, 8, 16 that is >= M:
// the register-tiled GEMV kernels are instantiated for these row counts only.
template <int MT>
struct IntC {
  static constexpr int value = MT;
};
template <typename F>
inline int dispatch_m(int M, F&& f) {
  if (M <= 1) return f(IntC<1>{});
  if (M <= 2) return f(IntC<2>{});
  if (M <= 4) return f(IntC<4>{});
  if (M <= 8) return f(IntC<8>{});
  if (M <= 16) return f(IntC<16>{});
  return static_cast<int>(cudaErrorInvalidValue);
}

}  // namespace cuda
}  // namespace swiftspec
