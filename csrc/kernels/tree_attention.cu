// Tree attention: RoPE + KV write + masked attention of n <= 16 query tokens over the prefix + tree
// cache, split-KV across blocks with the merge done inside the same kernel by the last-arriving
// block (SwiftSpec paper section 3.3 "Masked attention"; semantics of
// reference.tree_attention; the log-sum-exp merge of split partials is FlashInfer's merge_state /
// flash-decoding's combine step, here fused instead of launched separately; the lane layout of the
// key loop - a key's head dim spread over a group of lanes with 16-byte loads, the score reduced
// with warp shuffles, each lane group keeping its own online-softmax state - follows FlashInfer's
// decode kernel, include/flashinfer/attention/decode.cuh).
//
// Grid (Hq, num_splits), kAttnThreads threads (4 warps) per block. Block (h, s) handles query head
// h and the key range [s * keys_per_split, min(S, (s + 1) * keys_per_split)) for all n queries.
// With a device-side KV length (`kv_len`, a CUDA graph's live length: its mask is padded out to the
// cache's capacity) the grid's split count is only a cap: every block re-plans for the L keys in
// use with the host's rule (split_plan), so a replay over L keys splits them as an eager launch
// over mask[:, :L] would (bit-identical), and blocks past that plan's splits leave at once:
// the work and its balance follow the context length, not the capacity.
//   1. the first query head of each KV group, split 0, writes the rotated k_new / v_new rows into
//      the caches at `slots` (negative or >= C: not written);
//   2. the warps are split into row groups (up to NR query rows each, rotated q in registers) and
//      key warps; a warp takes 32 / G keys at a time, G lanes per key with 8 head-dim elements per
//      lane (G = D / 8 rounded up to a power of two);
//   3. keys are staged in chunks of kChunk: which rows see each key (from the mask) and whether
//      this launch writes it; then in sub-chunks of kStageBytes of keys (and as much of values)
//      copied to shared memory by the whole block, every load in flight at once (one memory
//      latency per sub-chunk); a chunk or sub-chunk no row sees (the padding of a CUDA graph's
//      mask out to the cache's capacity, most of all) is neither staged nor computed, nor is a
//      warp step whose keys none of the warp's rows sees, so the work follows the keys in use;
//   4. per key: scores by shuffle reduction, online softmax (running max m, sum l, unnormalized
//      accumulator in registers) per lane group; then the lane groups, the key warps and - with
//      several splits - the splits are merged by the log-sum-exp rule: a block stores (m, l, acc)
//      to the workspace and the last block of head h to arrive merges all splits and writes the
//      output (no second kernel launch, which matters when a whole decode step is ~100 us).
//
// Keys being written by this very launch: blocks read the cache while the writer blocks of step 1
// may still be storing, so a key j that is one of this launch's slots is never taken from the
// cache; its value is recomputed from k_new / v_new (a few rows, rare). This removes any ordering
// requirement between writer and readers inside the launch.
//
// Why this layout: a decode step's attention has few query rows and a short KV cache, so it is
// bound by latency, not bandwidth. The first version (one thread per (row, key) score over a shared-memory
// tile, one thread per row for the softmax) spent most of a target forward in this kernel on
// serial steps; spreading a key over a lane group, reducing scores with shuffles and staging a
// sub-chunk of keys and values per block made the graph-replayed forward markedly faster at 1 and
// 8 rows, and bounding a CUDA graph's launch by the device-side KV length (instead of the cache's
// whole capacity) faster again (bench/LOG.md: "The tree-attention kernel rebuilt", "CUDA graphs
// attend over the slots in use"; current forward tables in bench/RESULTS.md). The 8-row launch is
// still latency-bound (160 registers a thread and 42 KB of static shared memory allow 3 blocks per
// SM, low achieved occupancy under ncu): the next step.
#include <math.h>

#include "api.h"
#include "common.cuh"

namespace swiftspec {
namespace cuda {
namespace {

constexpr int kAttnThreads = 128;
constexpr int kWarps = kAttnThreads / 32;
constexpr int kKeyTile = 16;  // the split plan's unit: keys_per_split is a multiple of it
constexpr int kChunk = kAttnThreads;  // keys staged per round, one per thread
constexpr int kVec = 8;       // head-dim elements per lane
constexpr int kMaxRowsPerWarp = 4;
constexpr int kStageBytes = 8192;  // shared memory for a sub-chunk's keys (and as much for values)
constexpr int kMaxN = SS_MAX_M;
constexpr int kMaxD = SS_ATTN_MAX_HEAD_DIM;
constexpr int kMaxSplits = SS_ATTN_MAX_SPLITS;
constexpr unsigned kFull = 0xFFFFFFFFu;
// fewer key tiles per split than this cost more in merging than they save
constexpr int kMinTilesPerSplit = 2;

// The split plan for S keys: at most `cap` splits (clamped to [1, kMaxSplits] and to the key
// tiles), with `by_len` also at most one per kMinTilesPerSplit key tiles; keys_per_split a
// multiple of kKeyTile; no empty trailing split. The host plan (ss_tree_attention_plan) and the
// device re-plan of a launch with a device-side KV length both use it.
__host__ __device__ __forceinline__ void split_plan(int S, int cap, bool by_len, int* num_splits,
                                                    int* keys_per_split) {
  const int tiles = S > 0 ? (S + kKeyTile - 1) / kKeyTile : 1;
  int splits = cap;
  if (by_len) {
    const int most = tiles / kMinTilesPerSplit;
    splits = min(splits, most > 1 ? most : 1);
  }
  splits = max(1, min(splits, min(kMaxSplits, tiles)));
  const int kps = ((tiles + splits - 1) / splits) * kKeyTile;
  *keys_per_split = kps;
  *num_splits = S > 0 ? (S + kps - 1) / kps : 1;
}

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
  const int64_t* kv_len;  // nullable: keys in use (device-side); num_splits is then a cap
  void* out;
  float* workspace;
  int* counters;
  int n, Hq, Hk, D, C, S, P;
  float scale;
  int num_splits;
  int keys_per_split;
  int lanes_per_key;  // G: a power of two, G * kVec >= D
  int row_groups;     // warps holding different query rows
  int key_warps;      // warps of one row group, each taking other keys
};

// Rotate-half RoPE of element d of a row (reference.rope_rotate), fp32. Read-only inputs: __ldg.
template <typename T>
__device__ __forceinline__ float rope_at(const T* row, int d, int D, const float* cos_row,
                                         const float* sin_row) {
  const int h = D / 2;
  const float xd = to_float<T>(row[d]);
  const float rot = d < h ? -to_float<T>(row[d + h]) : to_float<T>(row[d - h]);
  return xd * __ldg(cos_row + d) + rot * __ldg(sin_row + d);
}

// kVec elements of T at p as fp32: one (bf16 / fp16) or two (fp32) 16-byte loads when VEC (p
// 16-byte aligned, all kVec in range), else element by element, the first `valid` only. Plain
// loads: the caches are written by this launch (such slots are replaced by the caller).
template <typename T, bool VEC>
__device__ __forceinline__ void load_vec(const T* p, int valid, float* out) {
  if constexpr (VEC) {
    if (valid <= 0) {
#pragma unroll
      for (int u = 0; u < kVec; ++u) out[u] = 0.f;
      return;
    }
    if constexpr (sizeof(T) == 4) {
      raw16_to_float<T>(*reinterpret_cast<const uint4*>(p), out);
      raw16_to_float<T>(*reinterpret_cast<const uint4*>(p + 4), out + 4);
    } else {
      raw16_to_float<T>(*reinterpret_cast<const uint4*>(p), out);
    }
  } else {
#pragma unroll
    for (int u = 0; u < kVec; ++u) out[u] = u < valid ? to_float<T>(p[u]) : 0.f;
  }
}

// Copy `count` elements of E (at most kStageBytes) from global `src` to shared `dst` with the
// whole block, every load issued before any store (one memory latency). Plain loads (see load_vec).
template <typename E>
__device__ __forceinline__ void stage_copy(const E* src, int count, E* dst) {
  constexpr int kPer = kStageBytes / static_cast<int>(sizeof(E)) / kAttnThreads;
  E r[kPer];
#pragma unroll
  for (int u = 0; u < kPer; ++u) {
    const int x = threadIdx.x + u * kAttnThreads;
    if (x < count) r[u] = src[x];
  }
#pragma unroll
  for (int u = 0; u < kPer; ++u) {
    const int x = threadIdx.x + u * kAttnThreads;
    if (x < count) dst[x] = r[u];
  }
}

// `count` elements of T to shared memory: VEC as 16-byte pieces (src 16-byte aligned, count a
// multiple of 16 bytes), else element by element.
template <typename T, bool VEC>
__device__ __forceinline__ void stage_rows(const T* src, int count, T* dst) {
  if constexpr (VEC)
    stage_copy(reinterpret_cast<const uint4*>(src), count * static_cast<int>(sizeof(T)) / 16,
               reinterpret_cast<uint4*>(dst));
  else
    stage_copy(src, count, dst);
}

// Merge online-softmax state (m2, l2, a2) into (m, l, a): the log-sum-exp rule, fully masked
// states (m = -inf, l = 0) contribute nothing.
__device__ __forceinline__ void merge_state(float& m, float& l, float* a, float m2, float l2,
                                            const float* a2) {
  const float M = fmaxf(m, m2);
  const float w1 = m == -INFINITY ? 0.f : expf(m - M);
  const float w2 = m2 == -INFINITY ? 0.f : expf(m2 - M);
  l = l * w1 + l2 * w2;
#pragma unroll
  for (int u = 0; u < kVec; ++u) a[u] = a[u] * w1 + a2[u] * w2;
  m = M;
}

template <typename T, int NR, bool VEC>
__global__ void __launch_bounds__(kAttnThreads) tree_attention_kernel(AttnParams p) {
  __shared__ float pacc[kWarps * kMaxRowsPerWarp * kMaxD];  // per-warp partials [warp][row][D]
  __shared__ float pm[kWarps * kMaxRowsPerWarp], pl[kWarps * kMaxRowsPerWarp];
  __shared__ float mw[kMaxSplits * kMaxN], lw[kMaxSplits * kMaxN];  // split merge: m, l, weights
  __shared__ uint32_t rowbits[kChunk];  // bit i: query row i sees the chunk's key
  __shared__ int srcs[kChunk];          // the chunk's key -> new-token row written here, or -1
  __shared__ __align__(16) unsigned char kbuf[kStageBytes];  // a sub-chunk's keys [sub][D] of T
  __shared__ __align__(16) unsigned char vbuf[kStageBytes];  // and values
  __shared__ int slot_s[kMaxN];
  __shared__ int pos_s[kMaxN];
  __shared__ bool last_block;

  const T* q = static_cast<const T*>(p.q);
  const T* k_new = static_cast<const T*>(p.k_new);
  const T* v_new = static_cast<const T*>(p.v_new);
  T* k_cache = static_cast<T*>(p.k_cache);
  T* v_cache = static_cast<T*>(p.v_cache);
  const int tid = threadIdx.x;
  const int n = p.n, D = p.D, S = p.S, C = p.C;  // S: the mask's row stride
  const int hq = blockIdx.x;
  const int split = blockIdx.y;
  const int group = p.Hq / p.Hk;
  const int hk = hq / group;
  // keys attended [0, S_keys) and this launch's plan: the host's, or re-planned for the
  // device-side KV length (uniform over the block: every thread reads the same value)
  int S_keys = S, splits = p.num_splits, keys_per_split = p.keys_per_split;
  if (p.kv_len != nullptr) {
    const int64_t live = __ldg(p.kv_len);
    S_keys = live < 0 ? 0 : (live > S ? S : static_cast<int>(live));
    split_plan(S_keys, p.num_splits, true, &splits, &keys_per_split);
    if (split >= splits) return;  // not in this length's plan (no KV rows, no counter ticket)
  }

  if (tid < n) {
    const int64_t s = p.slots[tid];
    slot_s[tid] = (s >= 0 && s < C) ? static_cast<int>(s) : -1;
    const int64_t pos = p.positions[tid];
    pos_s[tid] = static_cast<int>(pos < 0 ? 0 : (pos >= p.P ? p.P - 1 : pos));
  }
  __syncthreads();

  // 1. KV write, by the blocks of the first query head of each KV group: row i by split
  //    i % num_splits (a row per block or two, off the critical path of any one block). With
  //    duplicate slots the last row wins (what the reference's index_put does in practice);
  //    readers use the same rule below.
  if (hq % group == 0) {
    const int mine_rows = split < n ? (n - 1 - split) / splits + 1 : 0;
#pragma unroll 4
    for (int e = tid; e < mine_rows * D; e += kAttnThreads) {
      const int i = split + (e / D) * splits, d = e % D;
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

  // 2. this thread's place: warp -> (row group rg, key warp kw), lane -> (key kg, dims d0..)
  const int warp = tid >> 5, lane = tid & 31;
  const int G = p.lanes_per_key, KG = 32 / G, KW = p.key_warps;
  const int rg = warp / KW, kw = warp - rg * KW;
  const bool active = rg < p.row_groups;
  const int kg = lane / G, d0 = (lane - kg * G) * kVec;
  const int valid = min(kVec, D - d0);  // <= 0: a lane past the head dim (holds zeros)
  const int row0 = rg * NR;
  uint32_t warp_rows = 0;  // mask bits of this warp's rows
#pragma unroll
  for (int r = 0; r < NR; ++r)
    if (active && row0 + r < n) warp_rows |= 1u << (row0 + r);

  // rotated queries (rounded to T like the reference's rope_rotate output), this lane's dims
  float qf[NR][kVec];
#pragma unroll
  for (int r = 0; r < NR; ++r) {
    const int i = row0 + r;
    const bool ok = (warp_rows >> i) & 1u;
    const T* qrow = q + (static_cast<int64_t>(ok ? i : 0) * p.Hq + hq) * D;
    const int pos = ok ? pos_s[i] : 0;
#pragma unroll
    for (int u = 0; u < kVec; ++u)
      qf[r][u] = ok && u < valid
                     ? round_to<T>(rope_at<T>(qrow, d0 + u, D,
                                              p.cos_table + static_cast<int64_t>(pos) * D,
                                              p.sin_table + static_cast<int64_t>(pos) * D))
                     : 0.f;
  }

  float m[NR], l[NR], acc[NR][kVec];
#pragma unroll
  for (int r = 0; r < NR; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.f;
#pragma unroll
    for (int u = 0; u < kVec; ++u) acc[r][u] = 0.f;
  }

  const int s0 = split * keys_per_split;
  const int s1 = min(S_keys, s0 + keys_per_split);
  const int64_t head_base = static_cast<int64_t>(hk) * C * D;
  const int sub = min(kChunk, kStageBytes / (D * static_cast<int>(sizeof(T))));  // keys per sub-chunk
  for (int c0 = s0; c0 < s1; c0 += kChunk) {
    const int len = min(kChunk, s1 - c0);
    // 3. stage the chunk: rows seeing each key, and the keys this launch writes
    uint32_t bits = 0;
    int src = -1;
    if (tid < len) {
      const int j = c0 + tid;
#pragma unroll
      for (int i = 0; i < kMaxN; ++i)
        if (i < n) {
          if (p.mask[static_cast<int64_t>(i) * S + j]) bits |= 1u << i;
          if (slot_s[i] == j) src = i;
        }
    }
    __syncthreads();  // the previous chunk's readers are done with rowbits / srcs
    rowbits[tid] = bits;
    srcs[tid] = src;
    if (!__syncthreads_or(bits != 0)) continue;  // uniform: no row sees any key of the chunk
    // 4. the chunk in sub-chunks of `sub` keys: their keys and values copied to shared memory
    //    by the whole block (all loads in flight at once: one memory latency per sub-chunk, not
    //    one per warp step), then KG keys per warp step, the key warps of a row group interleaved
    for (int b0 = 0; b0 < len; b0 += sub) {
      const int cnt = min(sub, len - b0);
      // uniform: a sub-chunk no row sees is not loaded (also the barrier before kbuf is reused)
      if (!__syncthreads_or(tid < cnt && rowbits[b0 + tid] != 0)) continue;
      stage_rows<T, VEC>(k_cache + head_base + static_cast<int64_t>(c0 + b0) * D, cnt * D,
                         reinterpret_cast<T*>(kbuf));
      stage_rows<T, VEC>(v_cache + head_base + static_cast<int64_t>(c0 + b0) * D, cnt * D,
                         reinterpret_cast<T*>(vbuf));
      // keys this launch writes: the rotated k_new / v_new rows, as step 1 writes them (the
      // cache may be mid-write there); a second barrier only in the sub-chunk holding such slots
      bool fix = false;
      for (int i = 0; i < n; ++i) fix = fix || (slot_s[i] >= c0 + b0 && slot_s[i] < c0 + b0 + cnt);
      if (fix) {
        __syncthreads();
        for (int e = tid; e < n * D; e += kAttnThreads) {
          const int i = e / D, d = e - i * D;
          const int jj = slot_s[i] - (c0 + b0);
          if (jj < 0 || jj >= cnt || srcs[b0 + jj] != i) continue;  // elsewhere, or a later row wins
          const int pos = pos_s[i];
          const T* krow = k_new + (static_cast<int64_t>(i) * p.Hk + hk) * D;
          reinterpret_cast<T*>(kbuf)[jj * D + d] = from_float<T>(
              rope_at<T>(krow, d, D, p.cos_table + static_cast<int64_t>(pos) * D,
                         p.sin_table + static_cast<int64_t>(pos) * D));
          reinterpret_cast<T*>(vbuf)[jj * D + d] = v_new[(static_cast<int64_t>(i) * p.Hk + hk) * D + d];
        }
      }
      __syncthreads();
      if (!active) continue;
      for (int base = kw * KG; base < cnt; base += KW * KG) {
        const int jj = base + kg;
        const uint32_t kb = jj < cnt ? rowbits[b0 + jj] & warp_rows : 0u;
        if (!__any_sync(kFull, kb != 0)) continue;  // uniform over the warp
        float kf[kVec], vf[kVec];
        const int nv = kb != 0 ? valid : 0;
        load_vec<T, VEC>(reinterpret_cast<const T*>(kbuf) + jj * D + d0, nv, kf);
        load_vec<T, VEC>(reinterpret_cast<const T*>(vbuf) + jj * D + d0, nv, vf);
#pragma unroll
        for (int r = 0; r < NR; ++r) {
          float dot = 0.f;
#pragma unroll
          for (int u = 0; u < kVec; ++u) dot = fmaf(qf[r][u], kf[u], dot);
          for (int o = G >> 1; o > 0; o >>= 1) dot += __shfl_xor_sync(kFull, dot, o);
          if ((kb >> (row0 + r)) & 1u) {  // the same for the key's lane group
            const float s = dot * p.scale;
            const float m_new = fmaxf(m[r], s);
            const float alpha = expf(m[r] - m_new);  // m = -inf gives 0
            const float pj = expf(s - m_new);
            l[r] = l[r] * alpha + pj;
#pragma unroll
            for (int u = 0; u < kVec; ++u) acc[r][u] = fmaf(acc[r][u], alpha, pj * vf[u]);
            m[r] = m_new;
          }
        }
      }
    }
  }

  // 5. merge the warp's lane groups (each saw other keys), then its key warps via shared memory
  if (active) {
#pragma unroll
    for (int r = 0; r < NR; ++r)
      for (int o = G; o < 32; o <<= 1) {
        const float m2 = __shfl_xor_sync(kFull, m[r], o);
        const float l2 = __shfl_xor_sync(kFull, l[r], o);
        float a2[kVec];
#pragma unroll
        for (int u = 0; u < kVec; ++u) a2[u] = __shfl_xor_sync(kFull, acc[r][u], o);
        merge_state(m[r], l[r], acc[r], m2, l2, a2);
      }
    if (kg == 0) {
#pragma unroll
      for (int r = 0; r < NR; ++r) {
        float* dst = pacc + (warp * kMaxRowsPerWarp + r) * kMaxD + d0;
#pragma unroll
        for (int u = 0; u < kVec; ++u)
          if (u < valid) dst[u] = acc[r][u];
        if (lane == 0) {
          pm[warp * kMaxRowsPerWarp + r] = m[r];
          pl[warp * kMaxRowsPerWarp + r] = l[r];
        }
      }
    }
  }
  __syncthreads();

  T* out = static_cast<T*>(p.out);
  // split partials (splits > 1): workspace = acc [Hq][splits][n][D], then m and l [Hq][splits][n]
  const int64_t parts = static_cast<int64_t>(p.Hq) * splits * n;
  float* ws_acc = p.workspace;
  float* ws_m = splits > 1 ? ws_acc + parts * D : nullptr;
  float* ws_l = splits > 1 ? ws_m + parts : nullptr;
  const int64_t mine = (static_cast<int64_t>(hq) * splits + split) * n;
  for (int e = tid; e < n * D; e += kAttnThreads) {
    const int i = e / D, d = e - i * D;
    const int g = i / NR, r = i - g * NR;
    float M = -INFINITY;
    for (int w = g * KW; w < (g + 1) * KW; ++w) M = fmaxf(M, pm[w * kMaxRowsPerWarp + r]);
    float L = 0.f, a = 0.f;
    if (M != -INFINITY)
      for (int w = g * KW; w < (g + 1) * KW; ++w) {
        const int x = w * kMaxRowsPerWarp + r;
        if (pm[x] == -INFINITY) continue;
        const float f = expf(pm[x] - M);
        L += pl[x] * f;
        a += pacc[x * kMaxD + d] * f;
      }
    if (splits == 1) {
      out[(static_cast<int64_t>(i) * p.Hq + hq) * D + d] = from_float<T>(L > 0.f ? a / L : 0.f);
    } else {  // 6. this split's partial, unnormalized (relative to M)
      ws_acc[mine * D + e] = a;
      if (d == 0) {
        ws_m[mine + i] = M;
        ws_l[mine + i] = L;
      }
    }
  }
  if (splits == 1) return;
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

  // __ldcg: the partials were written by other SMs; read them from L2, never from this SM's L1
  const int64_t head0 = static_cast<int64_t>(hq) * splits * n;
  for (int t = tid; t < splits * n; t += kAttnThreads) {
    mw[t] = __ldcg(ws_m + head0 + t);
    lw[t] = __ldcg(ws_l + head0 + t);
  }
  __syncthreads();
  if (tid < n) {
    float M = -INFINITY;
    for (int s = 0; s < splits; ++s) M = fmaxf(M, mw[s * n + tid]);
    float L = 0.f;
    if (M != -INFINITY)
      for (int s = 0; s < splits; ++s) {
        const float ms = mw[s * n + tid];
        if (ms != -INFINITY) L += lw[s * n + tid] * expf(ms - M);
      }
    for (int s = 0; s < splits; ++s) {
      const float ms = mw[s * n + tid];
      // fully masked split: m = -inf, l = 0 -> weight 0; fully masked row: L = 0 -> zeros
      mw[s * n + tid] = (ms == -INFINITY || !(L > 0.f)) ? 0.f : expf(ms - M) / L;
    }
  }
  __syncthreads();
  for (int e = tid; e < n * D; e += kAttnThreads) {
    const int i = e / D;
    float o = 0.f;
#pragma unroll 8
    for (int s = 0; s < splits; ++s)
      o = fmaf(mw[s * n + i], __ldcg(ws_acc + (head0 + static_cast<int64_t>(s) * n) * D + e), o);
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

extern "C" SS_API int ss_tree_attention_split_cap(int Hq, int* cap) {
  if (Hq < 1 || cap == nullptr) return static_cast<int>(cudaErrorInvalidValue);
  int sms = 0;
  const cudaError_t err = current_sm_count(&sms);
  if (err != cudaSuccess) return static_cast<int>(err);
  *cap = max(1, min((2 * sms + Hq - 1) / Hq, SS_ATTN_MAX_SPLITS));
  return 0;
}

extern "C" SS_API int ss_tree_attention_plan(int S, int Hq, int requested, int* num_splits,
                                             int* keys_per_split) {
  if (S < 0 || Hq < 1 || num_splits == nullptr || keys_per_split == nullptr)
    return static_cast<int>(cudaErrorInvalidValue);
  int cap = requested;
  if (requested <= 0) {
    // about two blocks per SM over all heads, but keep >= kMinTilesPerSplit key tiles per split
    const int err = ss_tree_attention_split_cap(Hq, &cap);
    if (err != 0) return err;
  }
  split_plan(S, cap, requested <= 0, num_splits, keys_per_split);
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
                                        int keys_per_split, const int64_t* kv_len, int dtype,
                                        void* stream) {
  // with kv_len the plan is made on the device (keys_per_split unused, num_splits the cap)
  const bool planned = kv_len == nullptr;
  if (n < 0 || n > kMaxN || Hq < 1 || Hk < 1 || Hq % Hk != 0 || D < 2 || D % 2 != 0 ||
      D > kMaxD || C < 0 || S < 0 || S > C || P < 1 || num_splits < 1 ||
      num_splits > SS_ATTN_MAX_SPLITS ||
      (planned && (keys_per_split < kKeyTile || keys_per_split % kKeyTile != 0 ||
                   static_cast<int64_t>(num_splits) * keys_per_split < S)) ||
      dtype_size(dtype) == 0)
    return static_cast<int>(cudaErrorInvalidValue);
  if (n == 0) return 0;
  if (q == nullptr || k_new == nullptr || v_new == nullptr || k_cache == nullptr ||
      v_cache == nullptr || slots == nullptr || positions == nullptr || cos_table == nullptr ||
      sin_table == nullptr || (mask == nullptr && S > 0) || out == nullptr ||
      (num_splits > 1 && (workspace == nullptr || counters == nullptr)))
    return static_cast<int>(cudaErrorInvalidValue);
  int G = 1;
  while (G * kVec < D) G <<= 1;  // D <= 256: G <= 32
  const int nr = n == 1 ? 1 : kMaxRowsPerWarp;
  const int row_groups = (n + nr - 1) / nr;  // <= kWarps
  AttnParams prm{q,    k_new, v_new,     k_cache,  v_cache, slots, positions,
                 cos_table, sin_table, mask, kv_len, out, workspace, counters, n, Hq, Hk, D, C, S, P,
                 scale, num_splits, keys_per_split, G, row_groups, kWarps / row_groups};
  // 16-byte loads of a key's kVec elements: whole vectors (D % 8 == 0) at aligned addresses
  const bool vec = D % kVec == 0 && reinterpret_cast<uintptr_t>(k_cache) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(v_cache) % 16 == 0;
  auto s = static_cast<cudaStream_t>(stream);
  const dim3 grid(Hq, num_splits);
  return dispatch_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    if (nr == 1) {
      if (vec) tree_attention_kernel<T, 1, true><<<grid, kAttnThreads, 0, s>>>(prm);
      else tree_attention_kernel<T, 1, false><<<grid, kAttnThreads, 0, s>>>(prm);
    } else {
      if (vec) tree_attention_kernel<T, kMaxRowsPerWarp, true><<<grid, kAttnThreads, 0, s>>>(prm);
      else tree_attention_kernel<T, kMaxRowsPerWarp, false><<<grid, kAttnThreads, 0, s>>>(prm);
    }
    return launch_status();
  });
}
