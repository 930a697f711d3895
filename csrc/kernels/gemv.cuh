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
// and a warp butterfly reduction finishes each dot product. On the 16-byte vector path each lane
// requests its next step's weights before this step's FMAs (one step of lookahead).
//
// Measured on an H100 (bench/LOG.md, "CUDA kernels on an H100"): staging with scalar loads and
// no lookahead ran M = 8 at 0.44-0.75x of cuBLAS on the larger shapes; vector staging plus the
// lookahead brought that to 0.72-1.0x. Reading x straight from global memory instead of staging
// it (no barriers) was slower still at M = 8 (0.34-0.64x): the streamed weights evict x from L1.
#pragma once

#include "common.cuh"

namespace swiftspec {
namespace cuda {

constexpr int kGemvWarps = 8;
constexpr int kGemvThreads = kGemvWarps * 32;
constexpr int kGemvKChunk = 512;  // multiple of 32 lanes * 8 elements (one bf16 vector per lane)

// xs[m * kGemvKChunk + kk] = x[m, k0 + kk] as fp32 for kk < kc (zeros for rows m >= M). Staging
// sits between two barriers, so its cost is latency: 16-byte loads (x_vec) and an unrolled loop let
// a thread issue all its loads before the first store waits on one.
template <typename T, int MT>
__device__ __forceinline__ void stage_x_chunk(const T* __restrict__ x, int M, int K, int k0, int kc,
                                              bool x_vec, float* xs) {
  if (x_vec) {
    constexpr int V = Vec16<T>::N;
    const int per_row = kc / V;  // kc is a multiple of V: K is, and so is kGemvKChunk
#pragma unroll 4
    for (int e = threadIdx.x; e < MT * per_row; e += blockDim.x) {
      const int m = e / per_row;
      const int kk = (e - m * per_row) * V;
      float v[V];
      if (m < M) {
        load16_as_float<T>(x + static_cast<int64_t>(m) * K + k0 + kk, v);
      } else {
#pragma unroll
        for (int i = 0; i < V; ++i) v[i] = 0.f;
      }
      float4* dst = reinterpret_cast<float4*>(xs + m * kGemvKChunk + kk);
#pragma unroll
      for (int i = 0; i < V; i += 4) dst[i / 4] = make_float4(v[i], v[i + 1], v[i + 2], v[i + 3]);
    }
    return;
  }
#pragma unroll 4
  for (int e = threadIdx.x; e < MT * kc; e += blockDim.x) {
    const int m = e / kc;
    const int kk = e - m * kc;
    xs[m * kGemvKChunk + kk] = m < M ? to_float<T>(x[static_cast<int64_t>(m) * K + k0 + kk]) : 0.f;
  }
}

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

  // uniform across the block; K * sizeof(T) % 16 == 0 (part of vec_ok) keeps every x row aligned
  const bool x_vec = vec_ok && reinterpret_cast<uintptr_t>(x) % 16 == 0;

  // Lookahead of the vector path: next_raw holds the weights of this lane's next step, which may
  // be the first step of the next chunk, so a load stays in flight through the FMAs and through
  // the staging between chunks. Zeros stand in for missing rows and for steps past K.
  uint4 next_raw[R];
  auto request = [&](int k) {
#pragma unroll
    for (int r = 0; r < R; ++r)
      next_raw[r] = (rows[r] != nullptr && k < K) ? load16_raw(rows[r] + k) : make_uint4(0, 0, 0, 0);
  };
  if (vec_ok) request(lane * Vec16<T>::N);

  for (int k0 = 0; k0 < K; k0 += kGemvKChunk) {
    const int kc = min(kGemvKChunk, K - k0);
    __syncthreads();  // every warp is done with the previous chunk before it is overwritten
    stage_x_chunk<T, MT>(x, M, K, k0, kc, x_vec, xs);
    __syncthreads();

    if (vec_ok) {
      constexpr int V = Vec16<T>::N;
      for (int kk = lane * V; kk < kc; kk += 32 * V) {
        float wv[R][V];
#pragma unroll
        for (int r = 0; r < R; ++r) raw16_to_float<T>(next_raw[r], wv[r]);
        request(kk + 32 * V < kc ? k0 + kk + 32 * V : k0 + kc + lane * V);
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
