// Tree attention: RoPE + KV write + masked attention of n <= 16 query tokens over the prefix + tree
// cache, split-KV across blocks with the merge done inside the same kernel by the last-arriving
// block (SwiftSpec paper section 3.3 "Masked attention"; semantics of
// reference.tree_attention; the log-sum-exp merge of split partials is FlashInfer's merge_state /
// flash-decoding's combine step, here fused instead of launched separately).
//
// Grid (Hq, num_splits), kAttnThreads threads per block. Block (h, s) handles query head h and the
// key range [s * keys_per_split, min(S, (s + 1) * keys_per_split)) for all n queries:
//   1. the first query head of each KV group, split 0, writes the rotated k_new / v_new rows into
//      the caches at `slots` (negative or >= C: not written);
//   2. q rows are rotated (and rounded to T, as the reference materializes them) into shared memory;
//   3. keys are streamed in tiles of kKeyTile (a tile no query row sees is skipped): the tile's
//      keys and values loaded into registers together, scores (fp32) with the mask applied, online
//      softmax (running max m, running sum l, unnormalized accumulator acc in registers);
//   4. with one split the block normalizes and writes the output; otherwise it stores (m, l, acc)
//      to the workspace, and the last block of head h to arrive merges all splits and writes the
//      output - no second kernel launch, which matters when a whole decode step is ~100 us.
//
// Keys being written by this very launch: blocks read the cache while the writer blocks of step 1
// may still be storing, so a key j that is one of this launch's slots is never taken from the
// cache; its value is recomputed from k_new / v_new (a few rows, rare). This removes any ordering
// requirement between writer and readers inside the launch.
#include <math.h>

#include "api.h"
#include "common.cuh"

namespace swiftspec {
namespace cuda {
namespace {

constexpr int kAttnThreads = 128;
constexpr int kKeyTile = 16;
constexpr int kMaxN = SS_MAX_M;
constexpr int kMaxD = SS_ATTN_MAX_HEAD_DIM;
constexpr int kAccPerThread = kMaxN * kMaxD / kAttnThreads;
constexpr int kTileRegs = kKeyTile * kMaxD / kAttnThreads;  // key (and value) elements per thread
// fewer key tiles per split than this cost more in merging than they save (a block's time grows
// with its tiles: 4 -> 2 took the default target's attention from 108 to 66 us per layer at 513
// keys on an H200, run 27, with the loads below)
constexpr int kMinTilesPerSplit = 2;

struct AttnParams {
  const void* q;
  const void* k_new;
  const void* v_new;
  void* k_cache;
  void* v_cache;
  const int64_t* slots;
  const int64_t* positions;
  const float* cos_table;
  const float* sin_table;
  const uint8_t* mask;
  void* out;
  float* workspace;
  int* counters;
  int n, Hq, Hk, D, C, S, P;
  float scale;
  int num_splits;
  int keys_per_split;
};

// Rotate-half RoPE of element d of a row (reference.rope_rotate), fp32.
template <typename T>
__device__ __forceinline__ float rope_at(const T* row, int d, int D, const float* cos_row,
                                         const float* sin_row) {
  const int h = D / 2;
  const float xd = to_float<T>(row[d]);
  const float rot = d < h ? -to_float<T>(row[d + h]) : to_float<T>(row[d - h]);
  return xd * cos_row[d] + rot * sin_row[d];
}

template <typename T>
__global__ void __launch_bounds__(kAttnThreads) tree_attention_kernel(AttnParams p) {
  __shared__ float qs[kMaxN * kMaxD];                 // rotated queries [n][D]
  __shared__ float kv[kKeyTile * (kMaxD + 1)];        // key or value tile [kKeyTile][D + 1]
  __shared__ float sc[kMaxN * kKeyTile];              // scores, then probabilities [n][kKeyTile]
  __shared__ float row_m[kMaxN], row_l[kMaxN], row_alpha[kMaxN];
  __shared__ int srcs[kKeyTile];                      // key tile entry -> new-token row or -1
  __shared__ int slot_s[kMaxN];
  __shared__ int pos_s[kMaxN];
  __shared__ bool last_block;

  const T* q = static_cast<const T*>(p.q);
  const T* k_new = static_cast<const T*>(p.k_new);
  const T* v_new = static_cast<const T*>(p.v_new);
  T* k_cache = static_cast<T*>(p.k_cache);
  T* v_cache = static_cast<T*>(p.v_cache);
  const int tid = threadIdx.x;
  const int n = p.n, D = p.D, S = p.S, C = p.C;
  const int hq = blockIdx.x;
  const int split = blockIdx.y;
  const int group = p.Hq / p.Hk;
  const int hk = hq / group;
  const int ld = D + 1;  // padded row: threads of a warp reading column d of different keys hit different banks

  if (tid < n) {
    const int64_t s = p.slots[tid];
    slot_s[tid] = (s >= 0 && s < C) ? static_cast<int>(s) : -1;
    const int64_t pos = p.positions[tid];
    pos_s[tid] = static_cast<int>(pos < 0 ? 0 : (pos >= p.P ? p.P - 1 : pos));
    row_m[tid] = -INFINITY;
    row_l[tid] = 0.f;
  }
  __syncthreads();

  // 1. KV write, by one block per KV head. With duplicate slots the last row wins (what the
  //    reference's index_put does in practice); readers use the same rule below.
  if (split == 0 && hq % group == 0) {
    for (int e = tid; e < n * D; e += blockDim.x) {
      const int i = e / D, d = e - i * D;
      const int slot = slot_s[i];
      bool last = slot >= 0;
      for (int i2 = i + 1; i2 < n && last; ++i2) last = slot_s[i2] != slot;
      if (!last) continue;
      const int pos = pos_s[i];
      const T* krow = k_new + (static_cast<int64_t>(i) * p.Hk + hk) * D;
      const float kr = rope_at<T>(krow, d, D, p.cos_table + static_cast<int64_t>(pos) * D,
                                  p.sin_table + static_cast<int64_t>(pos) * D);
      const int64_t c = (static_cast<int64_t>(hk) * C + slot) * D + d;
      k_cache[c] = from_float<T>(kr);
      v_cache[c] = v_new[(static_cast<int64_t>(i) * p.Hk + hk) * D + d];
    }
  }

  // 2. rotated queries, rounded to T like the reference's rope_rotate output
  for (int e = tid; e < n * D; e += blockDim.x) {
    const int i = e / D, d = e - i * D;
    const int pos = pos_s[i];
    const T* qrow = q + (static_cast<int64_t>(i) * p.Hq + hq) * D;
    qs[i * D + d] = round_to<T>(rope_at<T>(qrow, d, D, p.cos_table + static_cast<int64_t>(pos) * D,
                                           p.sin_table + static_cast<int64_t>(pos) * D));
  }

  float acc[kAccPerThread];
#pragma unroll
  for (int r = 0; r < kAccPerThread; ++r) acc[r] = 0.f;

  const int s0 = split * p.keys_per_split;
  const int s1 = min(S, s0 + p.keys_per_split);
  for (int t0 = s0; t0 < s1; t0 += kKeyTile) {
    // 3a. which keys of the tile are written by this launch, and whether any row sees one of
    //     them: a tile no row sees (the padding of a CUDA graph's mask out to the cache's
    //     capacity, most of all) is skipped, so the work follows the keys in use, not the capacity
    bool seen = false;
    if (tid < kKeyTile) {
      const int j = t0 + tid;
      int src = -1;
      if (j < s1) {
        for (int i = 0; i < n; ++i) {
          if (slot_s[i] == j) src = i;
          seen = seen || p.mask[static_cast<int64_t>(i) * S + j];
        }
      }
      srcs[tid] = src;
    }
    if (!__syncthreads_or(seen)) continue;  // uniform: every thread gets the same answer
    // 3b. the tile's keys and values from the cache into registers, all loads issued before any
    //     is used, so they can overlap (H200, run 27: a 16-key tile still costs ~20 us per block,
    //     bound by the serial steps below, not by these loads). A slot this launch writes may be
    //     read mid-write here: its value is replaced below.
    float kreg[kTileRegs], vreg[kTileRegs];
#pragma unroll
    for (int r = 0; r < kTileRegs; ++r) {
      const int e = tid + r * kAttnThreads;
      const int jj = e / D, d = e - jj * D;
      float kx = 0.f, vx = 0.f;
      if (e < kKeyTile * D && t0 + jj < s1) {
        const int64_t c = (static_cast<int64_t>(hk) * C + t0 + jj) * D + d;
        kx = to_float<T>(k_cache[c]);
        vx = to_float<T>(v_cache[c]);
      }
      kreg[r] = kx;
      vreg[r] = vx;
    }
#pragma unroll
    for (int r = 0; r < kTileRegs; ++r) {
      const int e = tid + r * kAttnThreads;
      if (e < kKeyTile * D) {
        const int jj = e / D, d = e - jj * D;
        const int src = t0 + jj < s1 ? srcs[jj] : -1;
        float v = kreg[r];
        if (src >= 0) {
          const int pos = pos_s[src];
          const T* krow = k_new + (static_cast<int64_t>(src) * p.Hk + hk) * D;
          v = round_to<T>(rope_at<T>(krow, d, D, p.cos_table + static_cast<int64_t>(pos) * D,
                                     p.sin_table + static_cast<int64_t>(pos) * D));
          vreg[r] = to_float<T>(v_new[(static_cast<int64_t>(src) * p.Hk + hk) * D + d]);
        }
        kv[jj * ld + d] = v;
      }
    }
    __syncthreads();
    // 3c. masked scores
    for (int e = tid; e < n * kKeyTile; e += blockDim.x) {
      const int i = e / kKeyTile, jj = e - i * kKeyTile;
      const int j = t0 + jj;
      float s = -INFINITY;
      if (j < s1 && p.mask[static_cast<int64_t>(i) * S + j]) {
        float dot = 0.f;
        const float* qr = qs + i * D;
        const float* kr = kv + jj * ld;
#pragma unroll 8
        for (int d = 0; d < D; ++d) dot = fmaf(qr[d], kr[d], dot);
        s = dot * p.scale;
      }
      sc[e] = s;
    }
    __syncthreads();
    // 3d. value tile (overwrites the keys, all scores are done) and the online softmax update
#pragma unroll
    for (int r = 0; r < kTileRegs; ++r) {
      const int e = tid + r * kAttnThreads;
      if (e < kKeyTile * D) {
        const int jj = e / D, d = e - jj * D;
        kv[jj * ld + d] = vreg[r];
      }
    }
    if (tid < n) {
      float* srow = sc + tid * kKeyTile;
      float mx = -INFINITY;
      for (int jj = 0; jj < kKeyTile; ++jj) mx = fmaxf(mx, srow[jj]);
      const float m_old = row_m[tid];
      const float m_new = fmaxf(m_old, mx);
      if (m_new == -INFINITY) {
        // everything so far masked: keep m = -inf, l = 0 (exp(-inf - -inf) would be NaN)
        row_alpha[tid] = 1.f;
        for (int jj = 0; jj < kKeyTile; ++jj) srow[jj] = 0.f;
      } else {
        const float alpha = expf(m_old - m_new);  // m_old = -inf gives 0
        float sum = 0.f;
        for (int jj = 0; jj < kKeyTile; ++jj) {
          const float pj = expf(srow[jj] - m_new);  // masked: exp(-inf) = 0
          srow[jj] = pj;
          sum += pj;
        }
        row_alpha[tid] = alpha;
        row_l[tid] = row_l[tid] * alpha + sum;
        row_m[tid] = m_new;
      }
    }
    __syncthreads();
    // 3e. acc[i][d] = alpha_i * acc[i][d] + sum_j p[i][j] * v[j][d]
#pragma unroll
    for (int r = 0; r < kAccPerThread; ++r) {
      const int e = tid + r * kAttnThreads;
      if (e < n * D) {
        const int i = e / D, d = e - i * D;
        float a = acc[r] * row_alpha[i];
        const float* pr = sc + i * kKeyTile;
#pragma unroll
        for (int jj = 0; jj < kKeyTile; ++jj) a = fmaf(pr[jj], kv[jj * ld + d], a);
        acc[r] = a;
      }
    }
  }

  T* out = static_cast<T*>(p.out);
  if (p.num_splits == 1) {
    __syncthreads();  // row_l final (a block with no keys never entered the loop)
#pragma unroll
    for (int r = 0; r < kAccPerThread; ++r) {
      const int e = tid + r * kAttnThreads;
      if (e < n * D) {
        const int i = e / D, d = e - i * D;
        const float l = row_l[i];
        out[(static_cast<int64_t>(i) * p.Hq + hq) * D + d] = from_float<T>(l > 0.f ? acc[r] / l : 0.f);
      }
    }
    return;
  }

  // 4. split partials: workspace = acc [Hq][splits][n][D], then m and l [Hq][splits][n]
  const int splits = p.num_splits;
  const int64_t parts = static_cast<int64_t>(p.Hq) * splits * n;
  float* ws_acc = p.workspace;
  float* ws_m = ws_acc + parts * D;
  float* ws_l = ws_m + parts;
  const int64_t mine = (static_cast<int64_t>(hq) * splits + split) * n;
  __syncthreads();
#pragma unroll
  for (int r = 0; r < kAccPerThread; ++r) {
    const int e = tid + r * kAttnThreads;
    if (e < n * D) ws_acc[mine * D + e] = acc[r];
  }
  if (tid < n) {
    ws_m[mine + tid] = row_m[tid];
    ws_l[mine + tid] = row_l[tid];
  }
  // Release: make this block's partials visible device-wide before it is counted as arrived, so
  // the block that sees the final count also sees every partial (threadFenceReduction pattern).
  __threadfence();
  __syncthreads();
  if (tid == 0) {
    const int ticket = atomicAdd(&p.counters[hq], 1);
    last_block = ticket == splits - 1;
  }
  __syncthreads();
  if (!last_block) return;
  // Only the last block merges: no block ever waits for another, so the merge needs no
  // co-residency of the splits and no second launch. Acquire side of the fence pairing:
  __threadfence();

  const int64_t head0 = static_cast<int64_t>(hq) * splits * n;
  float* wgt = kv;  // [splits][n] merge weights, reusing the tile buffer
  if (tid < n) {
    float M = -INFINITY;
    for (int s = 0; s < splits; ++s) M = fmaxf(M, __ldcg(ws_m + head0 + s * n + tid));
    float L = 0.f;
    if (M != -INFINITY)
      for (int s = 0; s < splits; ++s) {
        const float ms = __ldcg(ws_m + head0 + s * n + tid);
        if (ms != -INFINITY) L += __ldcg(ws_l + head0 + s * n + tid) * expf(ms - M);
      }
    for (int s = 0; s < splits; ++s) {
      const float ms = __ldcg(ws_m + head0 + s * n + tid);
      // fully masked split: m = -inf, l = 0 -> weight 0; fully masked row: L = 0 -> zeros
      wgt[s * n + tid] = (ms == -INFINITY || !(L > 0.f)) ? 0.f : expf(ms - M) / L;
    }
  }
  __syncthreads();
  for (int e = tid; e < n * D; e += blockDim.x) {
    const int i = e / D;
    float o = 0.f;
    // __ldcg: the partials were written by other SMs; read them from L2, never from this SM's L1
    for (int s = 0; s < splits; ++s)
      o = fmaf(wgt[s * n + i], __ldcg(ws_acc + (head0 + static_cast<int64_t>(s) * n) * D + e), o);
    const int d = e - i * D;
    out[(static_cast<int64_t>(i) * p.Hq + hq) * D + d] = from_float<T>(o);
  }
  // Reset for the next launch / CUDA-graph replay: every block of this head has arrived.
  if (tid == 0) p.counters[hq] = 0;
}

}  // namespace
}  // namespace cuda
}  // namespace swiftspec

using namespace swiftspec::cuda;

extern "C" SS_API int ss_tree_attention_plan(int S, int Hq, int requested, int* num_splits,
                                             int* keys_per_split) {
  if (S < 0 || Hq < 1 || num_splits == nullptr || keys_per_split == nullptr)
    return static_cast<int>(cudaErrorInvalidValue);
  const int tiles = S > 0 ? (S + kKeyTile - 1) / kKeyTile : 1;
  int splits;
  if (requested > 0) {
    splits = requested;
  } else {
    int sms = 0;
    const cudaError_t err = current_sm_count(&sms);
    if (err != cudaSuccess) return static_cast<int>(err);
    // about two blocks per SM over all heads, but keep >= kMinTilesPerSplit key tiles per split
    splits = (2 * sms + Hq - 1) / Hq;
    const int by_len = tiles / kMinTilesPerSplit;
    splits = min(splits, by_len > 1 ? by_len : 1);
  }
  splits = max(1, min(splits, min(SS_ATTN_MAX_SPLITS, tiles)));
  const int tiles_per_split = (tiles + splits - 1) / splits;
  const int kps = tiles_per_split * kKeyTile;
  *keys_per_split = kps;
  *num_splits = S > 0 ? (S + kps - 1) / kps : 1;  // no empty trailing split
  return 0;
}

extern "C" SS_API int64_t ss_tree_attention_workspace_floats(int n, int Hq, int D, int num_splits) {
  if (n < 0 || Hq < 0 || D < 0 || num_splits < 1) return -1;
  if (num_splits == 1) return 0;
  return static_cast<int64_t>(Hq) * num_splits * n * (D + 2);
}

extern "C" SS_API int ss_tree_attention(const void* q, const void* k_new, const void* v_new,
                                        void* k_cache, void* v_cache, const int64_t* slots,
                                        const int64_t* positions, const float* cos_table,
                                        const float* sin_table, const uint8_t* mask, void* out,
                                        float* workspace, int* counters, int n, int Hq, int Hk,
                                        int D, int C, int S, int P, float scale, int num_splits,
                                        int keys_per_split, int dtype, void* stream) {
  if (n < 0 || n > kMaxN || Hq < 1 || Hk < 1 || Hq % Hk != 0 || D < 2 || D % 2 != 0 ||
      D > kMaxD || C < 0 || S < 0 || S > C || P < 1 || num_splits < 1 ||
      num_splits > SS_ATTN_MAX_SPLITS || keys_per_split < kKeyTile ||
      keys_per_split % kKeyTile != 0 || static_cast<int64_t>(num_splits) * keys_per_split < S ||
      dtype_size(dtype) == 0)
    return static_cast<int>(cudaErrorInvalidValue);
  if (n == 0) return 0;
  if (q == nullptr || k_new == nullptr || v_new == nullptr || k_cache == nullptr ||
      v_cache == nullptr || slots == nullptr || positions == nullptr || cos_table == nullptr ||
      sin_table == nullptr || (mask == nullptr && S > 0) || out == nullptr ||
      (num_splits > 1 && (workspace == nullptr || counters == nullptr)))
    return static_cast<int>(cudaErrorInvalidValue);
  AttnParams prm{q,   k_new, v_new, k_cache, v_cache, slots, positions, cos_table, sin_table,
                 mask, out,  workspace, counters, n, Hq, Hk, D, C, S, P, scale, num_splits,
                 keys_per_split};
  auto s = static_cast<cudaStream_t>(stream);
  const dim3 grid(Hq, num_splits);
  return dispatch_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    tree_attention_kernel<T><<<grid, kAttnThreads, 0, s>>>(prm);
    return launch_status();
  });
}
