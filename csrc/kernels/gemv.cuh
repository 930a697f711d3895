// Block-wide skinny GEMM core (M <= 16 input rows against a few weight rows per warp), shared by
// swiglu.cu and the fused GEMM + all-reduce in ll_comm.cu.
//
// Why not CUTLASS / tensor cores: at decode shapes (M <= 16) the op is a bandwidth-bound GEMV.
// Every weight byte is used M times, far below the ~300 FLOP/byte where H100 tensor cores would
// matter, so the kernel's only job is to stream the weights once at full HBM bandwidth with
// 16-byte loads; CUTLASS tiles (M tile >= 64) would waste most of each MMA and add a split-K
// reduction for no gain. Large M (prefill) is left to cuBLAS by the Python wrappers.
//
// Scheme: the block stages the input x[M, K] in shared memory, K chunk by K chunk, as fp32 (each
// weight row is read exactly once from HBM, the input from L2 once per block); every warp owns R
// weight rows, each lane accumulates a strided slice of K for all MT input rows in registers (fp32),
// and a warp butterfly reduction finishes each dot product.
#pragma once

#include "common.cuh"

namespace swiftspec {
namespace cuda {

constexpr int kGemvWarps = 8;
constexpr int kGemvThreads = kGemvWarps * 32;
constexpr int kGemvKChunk = 512;  // multiple of 32 lanes * 8 elements (one bf16 vector per lane)

// acc[r][m] = dot(rows[r][0:K], x[m, 0:K]) for m < M (rows m >= M accumulate zeros), identical
// in every lane of the warp on return. rows[r] == nullptr skips that row (its acc stays 0); every
// thread of the block must call this (it synchronizes the block). xs: shared [MT * kGemvKChunk]
// floats, 16-byte aligned. vec_ok: every row pointer is 16-byte aligned and K * sizeof(T) is a
// multiple of 16, so 16-byte vector loads are legal.
template <typename T, int MT, int R>
__device__ __forceinline__ void block_gemv(const T* __restrict__ x, int M, int K,
                                           const T* const* rows, bool vec_ok, float* xs,
                                           float (&acc)[R][MT]) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int m = 0; m < MT; ++m) acc[r][m] = 0.f;

  for (int k0 = 0; k0 < K; k0 += kGemvKChunk) {
    const int kc = min(kGemvKChunk, K - k0);
    __syncthreads();  // every warp is done with the previous chunk before it is overwritten
    for (int e = threadIdx.x; e < MT * kc; e += blockDim.x) {
      const int m = e / kc;
      const int kk = e - m * kc;
      xs[m * kGemvKChunk + kk] = m < M ? to_float<T>(x[static_cast<int64_t>(m) * K + k0 + kk]) : 0.f;
    }
    __syncthreads();

    if (vec_ok) {
      constexpr int V = Vec16<T>::N;
      for (int kk = lane * V; kk < kc; kk += 32 * V) {
        float wv[R][V];
#pragma unroll
        for (int r = 0; r < R; ++r) {
          if (rows[r] != nullptr) {
            load16_as_float<T>(rows[r] + k0 + kk, wv[r]);
          } else {
#pragma unroll
            for (int v = 0; v < V; ++v) wv[r][v] = 0.f;
          }
        }
#pragma unroll
        for (int m = 0; m < MT; ++m) {
          float xv[V];
#pragma unroll
          for (int v = 0; v < V; v += 4) {
            const float4 t = *reinterpret_cast<const float4*>(xs + m * kGemvKChunk + kk + v);
            xv[v] = t.x;
            xv[v + 1] = t.y;
            xv[v + 2] = t.z;
            xv[v + 3] = t.w;
          }
#pragma unroll
          for (int r = 0; r < R; ++r)
#pragma unroll
            for (int v = 0; v < V; ++v) acc[r][m] = fmaf(wv[r][v], xv[v], acc[r][m]);
        }
      }
    } else {
      // Unaligned rows or K not a multiple of the vector width: one element per lane per step
      // (still coalesced across the warp).
      for (int kk = lane; kk < kc; kk += 32) {
        float wv[R];
#pragma unroll
        for (int r = 0; r < R; ++r) wv[r] = rows[r] != nullptr ? to_float<T>(rows[r][k0 + kk]) : 0.f;
#pragma unroll
        for (int m = 0; m < MT; ++m) {
          const float xv = xs[m * kGemvKChunk + kk];
#pragma unroll
          for (int r = 0; r < R; ++r) acc[r][m] = fmaf(wv[r], xv, acc[r][m]);
        }
      }
    }
  }

#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int m = 0; m < MT; ++m) acc[r][m] = warp_sum(acc[r][m]);
}

}  // namespace cuda
}  // namespace swiftspec
