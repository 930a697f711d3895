// Tree attention, the CPU twin of the CUDA kernel (SwiftSpec paper section
// 3.3, "Masked attention"): RoPE, KV-cache write and masked attention of a few query tokens over
// prefix + tree cache with a non-square mask, in one call.
//
// Work split (split-KV, as FlashDecoding / FlashInfer): the keys are cut into splits by their
// token position, at fixed boundaries (split s holds the keys at positions [s * kSplit,
// (s + 1) * kSplit)); one task per (kv head, query tile, split) computes the partial softmax state
// of all Hq/Hk query heads of its group for the queries of its tile: running max m, sum l and the
// unnormalized accumulator, in fp32. Partials are merged with the log-sum-exp rule of FlashInfer's
// merge_state, in split order, by the last task of each (kv head, tile) to finish (an atomic
// arrival counter), the CPU analogue of the paper's last-arriving-block merge: no second pass, no
// barrier.
//
// Key positions: a key written by this call (slots[i]) is at positions[i]; any other cache slot j
// is at slot_positions[j] when the caller gives them (the KV cache records each slot's position:
// the pipeline modes keep verified keys in tree slots), else at position j (the prefix cache
// invariant: verified tokens fill slots [0, L) in order). Within a split, keys run by position, then slot. This is what makes verification lossless
// bit for bit: a tree node at depth t is verified at slot L + i but position L + t, and after
// compaction its key sits at slot L + t; splitting by slot would put a key on either side of a
// split boundary in the tree and in the later one-token decode, and the two merges would round
// differently. A row sees one key per position (its ancestors have distinct depths), so its keys
// run in the same order in both.
//
// Batch invariance: a row's output depends only on its own query, the keys it sees (their values and
// positions), never on the other rows, S or the thread count. Split boundaries do not move with S
// or the threads; every row's scores, exps and sums are computed lane-wise (a row is a lane) in key
// order; keys a row does not see contribute exact zeros (p = 0); splits it does not see are skipped
// by the merge, and a merge of one seen split is exact (weight e^0 = 1). So a tree node verified in
// a batch of 8 and the same token decoded alone after compaction get bit-identical outputs.
//
// Inside a task the queries x heads of the group are the rows of a small GEMM. Row r = g * W + q
// (head g of the group, query q of the tile, W = tile width rounded up to a power of two), so a
// 16-lane vector of rows holds whole heads and the lane mask of key j is simply query-mask(j)
// replicated 16 / W times. Keys no query of the tile sees are dropped while building the list of
// active keys (the draft's expansion mask is dense over the prefix and sparse over the tree), so
// masked keys cost one byte test each. Fully masked rows and splits keep m = -inf, l = 0 and
// contribute nothing; a row masked everywhere returns zeros.
//
// Inner kernels: AVX-512 (16-lane row vectors), AVX2 + FMA (8-lane), and a portable scalar loop,
// chosen by the compile target of this machine's build (ops/cpu.py builds with -march=native, in a
// build directory keyed by the CPU's flags).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include "cpu_ops.h"
#include "vec_math.h"
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define SWIFTSPEC_TREE_ATTN_AVX512 1
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define SWIFTSPEC_TREE_ATTN_AVX2 1
#endif
#if defined(SWIFTSPEC_TREE_ATTN_AVX512) || defined(SWIFTSPEC_TREE_ATTN_AVX2)
#include <immintrin.h>
#endif

namespace swiftspec {
namespace {

constexpr int64_t kSplit = 256;      // key positions per split, fixed boundaries (scores stay in L1/L2)
constexpr int64_t kMaxTileQ = 16;    // queries per tile: one 16-bit query mask per key
constexpr int64_t kKeyPad = 8;       // score blocks run whole; the active-key list is padded
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

enum class Impl { kScalar, kAvx2, kAvx512 };

using vec::bf16_bits_to_float;
using vec::float_to_bf16_bits;

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

// Grow-only, 64-byte aligned scratch; one per thread and role, so repeated calls do not page-fault
// fresh allocations. Size it with reset(bytes) (an upper bound incl. 64 bytes per take), then take.
class Arena {
 public:
  void reset(size_t bytes) {
    if (buf_.size() < bytes + 64) buf_.resize(bytes + 64);
    const auto p = reinterpret_cast<uintptr_t>(buf_.data());
    base_ = buf_.data() + ((64 - p % 64) % 64);
    off_ = 0;
    cap_ = bytes;
  }
  template <class T>
  T* take(size_t count) {
    off_ = (off_ + 63) / 64 * 64;
    T* p = reinterpret_cast<T*>(base_ + off_);
    off_ += count * sizeof(T);
    TORCH_CHECK(off_ <= cap_, "tree_attention: internal error, scratch too small");
    return p;
  }
  static size_t bytes(size_t count, size_t elem) { return count * elem + 64; }

 private:
  std::vector<char> buf_;
  char* base_ = nullptr;
  size_t off_ = 0, cap_ = 0;
};

// ----------------------------------------------------------------------------------------------
// Problem, plan and the per-task view of it.

struct Problem {
  int64_t n, Hq, Hk, G, D, C, S;
  bool bf16;
  float scale;
  const void* q;        // [n, Hq, D]
  const void* k_new;    // [n, Hk, D]
  const void* v_new;    // [n, Hk, D]
  void* k_cache;        // [Hk, C, D]
  void* v_cache;        // [Hk, C, D]
  const int64_t* slots;      // [n]
  const int64_t* positions;  // [n]
  const int64_t* slot_pos;   // [>= S] position of each cache slot not written by this call, or null (slot j at j)
  const float* cos;     // [P, D]
  const float* sin;     // [P, D]
  const bool* mask;     // [n, S]
  void* out;            // [n, Hq, D]
};

struct Plan {
  int64_t qt;      // queries per tile
  int64_t ntile;
  int64_t W;       // lanes per head in a row vector: qt rounded up to a power of two
  int64_t R;       // rows of a (kv head, tile) block that exist: G * W
  int64_t Rp;      // R rounded up to the vector width
  int64_t Dp;      // D rounded up to the vector width
  int64_t nsplit;
  int64_t maxk;    // most keys in one split (kSplit, or more when this call's keys crowd a split)
  uint16_t lane_rep;  // query mask * lane_rep = lane mask of a row vector
};

Plan make_plan(const Problem& p) {
  Plan pl{};
  pl.qt = std::min<int64_t>(p.n, kMaxTileQ);
  pl.ntile = ceil_div(p.n, pl.qt);
  pl.W = 1;
  while (pl.W < pl.qt) pl.W *= 2;
  pl.lane_rep = static_cast<uint16_t>(pl.W == 16 ? 0x0001 : pl.W == 8 ? 0x0101 : pl.W == 4 ? 0x1111
                                      : pl.W == 2 ? 0x5555 : 0xFFFF);
  pl.R = p.G * pl.W;
  pl.Rp = round_up(pl.R, 16);
  pl.Dp = round_up(p.D, 16);
  pl.nsplit = 0;  // set by order_keys
  pl.maxk = kSplit;
  return pl;
}

// The keys [0, S) grouped by split (see "Key positions" above): keys[off[s] .. off[s + 1]) are the
// slots of split s by (position, slot). Boundaries are fixed positions, never chosen from S or the
// thread count. O(S + n log n).
struct KeyOrder {
  std::vector<int32_t> keys;
  std::vector<int64_t> off;
};

KeyOrder order_keys(const Problem& p, Plan& pl) {
  // this call's keys, and the slots whose position is not their index (slot_pos), as (position, slot),
  // by position then slot (a slot written twice: the last)
  std::vector<int64_t> call_pos(p.S, -1);
  if (p.slot_pos != nullptr)
    for (int64_t j = 0; j < p.S; ++j)
      if (p.slot_pos[j] >= 0 && p.slot_pos[j] != j) call_pos[j] = p.slot_pos[j];
  for (int64_t i = 0; i < p.n; ++i)
    if (p.slots[i] >= 0 && p.slots[i] < p.S) call_pos[p.slots[i]] = p.positions[i];
  std::vector<std::pair<int64_t, int32_t>> call;
  for (int64_t j = 0; j < p.S; ++j)
    if (call_pos[j] >= 0) call.emplace_back(call_pos[j], static_cast<int32_t>(j));
  std::stable_sort(call.begin(), call.end(), [](const auto& x, const auto& y) { return x.first < y.first; });

  int64_t nsplit = ceil_div(p.S, kSplit);
  if (!call.empty()) nsplit = std::max<int64_t>(nsplit, call.back().first / kSplit + 1);
  KeyOrder ko;
  ko.keys.resize(p.S);
  ko.off.assign(nsplit + 1, 0);
  pl.maxk = kSplit;
  int32_t* out = ko.keys.data();
  int64_t k = 0;
  size_t c = 0;
  for (int64_t s = 0; s < nsplit; ++s) {
    // merge the other slots of [s * kSplit, (s + 1) * kSplit) (position = slot) with this call's
    // keys at positions in that range, by (position, slot)
    const int64_t j1 = std::min(p.S, (s + 1) * kSplit);
    int64_t j = s * kSplit;
    while (c < call.size() && call[c].first < (s + 1) * kSplit) {
      const int64_t cp = call[c].first, cs = call[c].second;
      for (; j < j1 && (j < cp || (j == cp && j < cs)); ++j)
        if (call_pos[j] < 0) out[k++] = static_cast<int32_t>(j);
      out[k++] = call[c++].second;
    }
    for (; j < j1; ++j)
      if (call_pos[j] < 0) out[k++] = static_cast<int32_t>(j);
    ko.off[s + 1] = k;
    pl.maxk = std::max(pl.maxk, ko.off[s + 1] - ko.off[s]);
  }
  pl.nsplit = nsplit;
  return ko;
}

// Shared buffers of one call (owned by the calling thread's arena).
struct CallBuffers {
  float* qt;       // [Hk, ntile, D, Rp] rotated queries, transposed: row r of column d
  float* part_o;   // [Hk, ntile, nsplit, Rp, Dp] unnormalized partial outputs (nsplit > 1)
  float* part_ml;  // [Hk, ntile, nsplit, Rp, 2] partial (m, l)
  std::atomic<int>* arrived;  // [Hk, ntile] splits done
};

// One (kv head, tile, split) task's scratch.
struct TaskBuffers {
  uint16_t* qmask;       // [split] query mask of each key of the split
  int32_t* act;          // [split] active keys (cache slot)
  uint16_t* lanes;       // [split] lane mask of each active key
  const float** krow;    // [split + kKeyPad] fp32 key rows (cache or staged)
  const float** vrow;    // [split] fp32 value rows (cache or staged)
  float* kstage;         // [split, D]  (bf16 caches)
  float* vstage;         // [split, Dp] (bf16 caches)
  float* zero_row;       // [D]
  float* st;             // [split + kKeyPad, Rp] scores, then probabilities
  float* acc;            // [Rp, Dp]
  float* m;              // [Rp]
  float* l;              // [Rp]
};

size_t task_bytes(const Problem& p, const Plan& pl) {
  const size_t B = static_cast<size_t>(pl.maxk), BP = B + kKeyPad;
  return Arena::bytes(B, 2) + Arena::bytes(B, 4) + Arena::bytes(B, 2) + Arena::bytes(BP, sizeof(void*)) +
         Arena::bytes(B, sizeof(void*)) + Arena::bytes(B * p.D, 4) + Arena::bytes(B * pl.Dp, 4) +
         Arena::bytes(p.D, 4) + Arena::bytes(BP * pl.Rp, 4) + Arena::bytes(pl.Rp * pl.Dp, 4) +
         2 * Arena::bytes(pl.Rp, 4);
}

TaskBuffers take_task_buffers(Arena& a, const Problem& p, const Plan& pl) {
  const int64_t B = pl.maxk, BP = B + kKeyPad;
  TaskBuffers t{};
  t.qmask = a.take<uint16_t>(B);
  t.act = a.take<int32_t>(B);
  t.lanes = a.take<uint16_t>(B);
  t.krow = a.take<const float*>(BP);
  t.vrow = a.take<const float*>(B);
  t.kstage = a.take<float>(B * p.D);
  t.vstage = a.take<float>(B * pl.Dp);
  t.zero_row = a.take<float>(p.D);
  t.st = a.take<float>(BP * pl.Rp);
  t.acc = a.take<float>(pl.Rp * pl.Dp);
  t.m = a.take<float>(pl.Rp);
  t.l = a.take<float>(pl.Rp);
  std::fill(t.zero_row, t.zero_row + p.D, 0.f);
  return t;
}

// ----------------------------------------------------------------------------------------------
// RoPE, rotate-half: out[d] = x[d] cos[d] - x[d + h] sin[d] (d < h), x[d] cos[d] + x[d - h] sin[d]
// (d >= h), each product rounded before the sum exactly as the reference's two multiplies and one
// add in fp32 (no FMA contraction), so the rotated keys written to the cache match bit for bit.

inline float mul_no_contract(float a, float b) {
  float r = a * b;
  __asm__("" : "+x"(r));  // opaque to the optimizer: r cannot be fused into the following add
  return r;
}

void rope_row_scalar(const float* x, const float* c, const float* s, float* out, int64_t D) {
  const int64_t h = D / 2;
  for (int64_t d = 0; d < h; ++d) {
    out[d] = mul_no_contract(x[d], c[d]) - mul_no_contract(x[d + h], s[d]);
    out[d + h] = mul_no_contract(x[d + h], c[d + h]) + mul_no_contract(x[d], s[d + h]);
  }
}

#ifdef SWIFTSPEC_TREE_ATTN_AVX512
inline __mmask16 tail_mask16(int64_t rem) {
  return rem >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << rem) - 1u);
}

constexpr int kRn = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

void rope_row_avx512(const float* x, const float* c, const float* s, float* out, int64_t D) {
  const int64_t h = D / 2;
  for (int64_t d = 0; d < h; d += 16) {
    const __mmask16 t = tail_mask16(h - d);
    const __m512 lo = _mm512_maskz_loadu_ps(t, x + d), hi = _mm512_maskz_loadu_ps(t, x + h + d);
    // The *_round_* forms are opaque builtins, so they are never contracted into an FMA.
    const __m512 olo = _mm512_sub_round_ps(_mm512_mul_round_ps(lo, _mm512_maskz_loadu_ps(t, c + d), kRn),
                                           _mm512_mul_round_ps(hi, _mm512_maskz_loadu_ps(t, s + d), kRn), kRn);
    const __m512 ohi = _mm512_add_round_ps(_mm512_mul_round_ps(hi, _mm512_maskz_loadu_ps(t, c + h + d), kRn),
                                           _mm512_mul_round_ps(lo, _mm512_maskz_loadu_ps(t, s + h + d), kRn), kRn);
    _mm512_mask_storeu_ps(out + d, t, olo);
    _mm512_mask_storeu_ps(out + h + d, t, ohi);
  }
}

using vec::bf16x16_to_f32;
using vec::float_to_bf16_avx512;
using vec::exp_avx512;
#endif  // SWIFTSPEC_TREE_ATTN_AVX512

void load_row_f32(const void* base, int64_t off, bool bf16, int64_t D, float* dst) {
  if (bf16) {
    const auto* s = static_cast<const uint16_t*>(base) + off;
    for (int64_t d = 0; d < D; ++d) dst[d] = bf16_bits_to_float(s[d]);
  } else {
    std::memcpy(dst, static_cast<const float*>(base) + off, D * sizeof(float));
  }
}

void store_row(void* base, int64_t off, bool bf16, int64_t D, const float* src) {
  if (bf16) {
    auto* d = static_cast<uint16_t*>(base) + off;
    for (int64_t i = 0; i < D; ++i) d[i] = float_to_bf16_bits(src[i]);
  } else {
    std::memcpy(static_cast<float*>(base) + off, src, D * sizeof(float));
  }
}

// Stage 1: rotate the queries into the transposed per-(kv head, tile) blocks, rotate the new keys
// and write them and the new values into their cache slots (in query order: with repeated slots
// the last one wins, deterministically).
void stage_rope_and_write(const Problem& p, const Plan& pl, const CallBuffers& cb, Impl impl) {
  const int64_t nq = p.n * p.Hq;
  auto rope = rope_row_scalar;
#ifdef SWIFTSPEC_TREE_ATTN_AVX512
  if (impl == Impl::kAvx512) rope = rope_row_avx512;
#endif
  std::memset(cb.qt, 0, sizeof(float) * p.Hk * pl.ntile * p.D * pl.Rp);
  // Tasks [0, Hk): one kv head each (all n rows, in order); then one task per (query, q head).
  at::parallel_for(0, p.Hk + nq, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> x(p.D), y(p.D);
    for (int64_t t = begin; t < end; ++t) {
      if (t < p.Hk) {
        const int64_t h = t;
        for (int64_t i = 0; i < p.n; ++i) {
          const int64_t slot = p.slots[i];
          if (slot < 0) continue;
          const int64_t pos = p.positions[i];
          load_row_f32(p.k_new, (i * p.Hk + h) * p.D, p.bf16, p.D, x.data());
          rope(x.data(), p.cos + pos * p.D, p.sin + pos * p.D, y.data(), p.D);
          store_row(p.k_cache, (h * p.C + slot) * p.D, p.bf16, p.D, y.data());
          const size_t es = p.bf16 ? 2 : 4;
          std::memcpy(static_cast<char*>(p.v_cache) + (h * p.C + slot) * p.D * es,
                      static_cast<const char*>(p.v_new) + (i * p.Hk + h) * p.D * es, p.D * es);
        }
        continue;
      }
      const int64_t i = (t - p.Hk) / p.Hq, hq = (t - p.Hk) % p.Hq;
      const int64_t pos = p.positions[i];
      load_row_f32(p.q, (i * p.Hq + hq) * p.D, p.bf16, p.D, x.data());
      rope(x.data(), p.cos + pos * p.D, p.sin + pos * p.D, y.data(), p.D);
      if (p.bf16)  // the reference rounds the rotated query to the input dtype
        for (int64_t d = 0; d < p.D; ++d) y[d] = bf16_bits_to_float(float_to_bf16_bits(y[d]));
      const int64_t h = hq / p.G, g = hq % p.G, tile = i / pl.qt, qi = i % pl.qt;
      float* dst = cb.qt + (h * pl.ntile + tile) * p.D * pl.Rp + g * pl.W + qi;
      for (int64_t d = 0; d < p.D; ++d) dst[d * pl.Rp] = y[d];
    }
  });
}

// ----------------------------------------------------------------------------------------------
// Task kernels. Na = active keys, `st` is [Na (+ pad), Rp], rows in lanes.

// Scores st[a][r] = k_a . q_r (unscaled).
void scores_scalar(const TaskBuffers& t, int64_t Na, const float* qt, const Problem& p, const Plan& pl) {
  for (int64_t a = 0; a < Na; ++a) {
    const float* k = t.krow[a];
    float* s = t.st + a * pl.Rp;
    for (int64_t r = 0; r < pl.Rp; ++r) s[r] = 0.f;
    for (int64_t d = 0; d < p.D; ++d) {
      const float kd = k[d];
      const float* qd = qt + d * pl.Rp;
      for (int64_t r = 0; r < pl.Rp; ++r) s[r] += kd * qd[r];
    }
  }
}

// Softmax of each row over the active keys: m, l, and st turned into exp(s * scale - m) (0 where
// masked). Rows that see no key get m = -inf, l = 0, p = 0.
void softmax_scalar(const TaskBuffers& t, int64_t Na, const Problem& p, const Plan& pl) {
  for (int64_t r = 0; r < pl.Rp; ++r) {
    const uint16_t bit = static_cast<uint16_t>(1u << (r % 16));
    float m = kNegInf;
    for (int64_t a = 0; a < Na; ++a)
      if (t.lanes[a] & bit) m = std::max(m, t.st[a * pl.Rp + r] * p.scale);
    float l = 0.f;
    for (int64_t a = 0; a < Na; ++a) {
      float& s = t.st[a * pl.Rp + r];
      s = (t.lanes[a] & bit) ? std::exp(s * p.scale - m) : 0.f;
      l += s;
    }
    t.m[r] = m;
    t.l[r] = l;
  }
}

// acc[r][:] = sum_a p[a][r] v_a
void pv_scalar(const TaskBuffers& t, int64_t Na, const Problem& p, const Plan& pl) {
  for (int64_t r = 0; r < pl.R; ++r) {
    float* o = t.acc + r * pl.Dp;
    for (int64_t d = 0; d < p.D; ++d) o[d] = 0.f;
    for (int64_t a = 0; a < Na; ++a) {
      const float pr = t.st[a * pl.Rp + r];
      if (pr == 0.f) continue;
      const float* v = t.vrow[a];
      for (int64_t d = 0; d < p.D; ++d) o[d] += pr * v[d];
    }
  }
}

#ifdef SWIFTSPEC_TREE_ATTN_AVX2
// The AVX2 kernels: the AVX-512 ones with 8-lane row vectors (Rp is a multiple of 16, so every
// 16-lane group is two whole 8-lane vectors).

// 0xFFFFFFFF in lane i where bit i of `bits` is set.
inline __m256 lane_mask8(unsigned bits) {
  const __m256i sel = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  return _mm256_castsi256_ps(
      _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(static_cast<int>(bits)), sel), sel));
}

template <int RV, int KB>
void scores_pass_avx2(const TaskBuffers& t, int64_t Na, const float* qt, int64_t D, int64_t Rp, int64_t v0) {
  for (int64_t a = 0; a < Na; a += KB) {
    const float* k[KB];
#pragma GCC unroll 8
    for (int b = 0; b < KB; ++b) k[b] = t.krow[a + b];
    __m256 acc[KB][RV];
#pragma GCC unroll 8
    for (int b = 0; b < KB; ++b) {
#pragma GCC unroll 4
      for (int v = 0; v < RV; ++v) acc[b][v] = _mm256_setzero_ps();
    }
    const float* q = qt + v0 * 8;
    for (int64_t d = 0; d < D; ++d, q += Rp) {
      __m256 qv[RV];
#pragma GCC unroll 4
      for (int v = 0; v < RV; ++v) qv[v] = _mm256_loadu_ps(q + 8 * v);
#pragma GCC unroll 8
      for (int b = 0; b < KB; ++b) {
        const __m256 kb = _mm256_broadcast_ss(k[b] + d);
#pragma GCC unroll 4
        for (int v = 0; v < RV; ++v) acc[b][v] = _mm256_fmadd_ps(kb, qv[v], acc[b][v]);
      }
    }
#pragma GCC unroll 8
    for (int b = 0; b < KB; ++b) {
#pragma GCC unroll 4
      for (int v = 0; v < RV; ++v) _mm256_storeu_ps(t.st + (a + b) * Rp + (v0 + v) * 8, acc[b][v]);
    }
  }
}

void scores_avx2(const TaskBuffers& t, int64_t Na, const float* qt, const Problem& p, const Plan& pl) {
  const int64_t nrv = pl.Rp / 8;
  const int64_t passes = ceil_div(nrv, 4);  // <= 4 row vectors a pass, as even as possible
  int64_t v0 = 0;
  for (int64_t i = 0; i < passes; ++i) {
    const int64_t rv = nrv / passes + (i < nrv % passes ? 1 : 0);
    switch (rv) {
      case 1: scores_pass_avx2<1, 8>(t, Na, qt, p.D, pl.Rp, v0); break;
      case 2: scores_pass_avx2<2, 6>(t, Na, qt, p.D, pl.Rp, v0); break;
      case 3: scores_pass_avx2<3, 3>(t, Na, qt, p.D, pl.Rp, v0); break;
      case 4: scores_pass_avx2<4, 2>(t, Na, qt, p.D, pl.Rp, v0); break;
      default: TORCH_CHECK(false, "tree_attention: internal error, row pass ", rv);
    }
    v0 += rv;
  }
}

void softmax_avx2(const TaskBuffers& t, int64_t Na, const Problem& p, const Plan& pl) {
  const __m256 scale = _mm256_set1_ps(p.scale);
  for (int64_t v = 0; v < pl.Rp / 8; ++v) {
    const unsigned shift = static_cast<unsigned>((v % 2) * 8);
    __m256 m = _mm256_set1_ps(kNegInf);
    for (int64_t a = 0; a < Na; ++a) {
      const __m256 s = _mm256_mul_ps(_mm256_loadu_ps(t.st + a * pl.Rp + v * 8), scale);
      m = _mm256_blendv_ps(m, _mm256_max_ps(m, s), lane_mask8((t.lanes[a] >> shift) & 0xFFu));
    }
    // Lanes that saw nothing keep m = -inf; their p are forced to 0 by the lane masks below.
    __m256 l = _mm256_setzero_ps();
    for (int64_t a = 0; a < Na; ++a) {
      float* sp = t.st + a * pl.Rp + v * 8;
      const __m256 s = _mm256_mul_ps(_mm256_loadu_ps(sp), scale);
      const __m256 e = _mm256_and_ps(lane_mask8((t.lanes[a] >> shift) & 0xFFu), vec::exp_avx2(_mm256_sub_ps(s, m)));
      _mm256_storeu_ps(sp, e);
      l = _mm256_add_ps(l, e);
    }
    _mm256_storeu_ps(t.m + v * 8, m);
    _mm256_storeu_ps(t.l + v * 8, l);
  }
}

// RB rows x NV 8-float vectors of D, as pv_block: per key NV loads of v and RB broadcasts of p;
// keys none of the RB rows sees are skipped (their p are 0). `tail`: lane mask of the last vector.
template <int RB, int NV>
void pv_block_avx2(const TaskBuffers& t, int64_t Na, int64_t Rp, int64_t Dp, int64_t r0, int64_t d0, __m256i tail) {
  __m256 o[RB][NV];
#pragma GCC unroll 4
  for (int r = 0; r < RB; ++r) {
#pragma GCC unroll 4
    for (int c = 0; c < NV; ++c) o[r][c] = _mm256_setzero_ps();
  }
  const unsigned shift = static_cast<unsigned>(r0 % 16);
  for (int64_t a = 0; a < Na; ++a) {
    if (((t.lanes[a] >> shift) & ((1u << RB) - 1u)) == 0) continue;
    const float* vr = t.vrow[a] + d0;
    __m256 vv[NV];
#pragma GCC unroll 4
    for (int c = 0; c < NV; ++c)
      vv[c] = c == NV - 1 ? _mm256_maskload_ps(vr + 8 * c, tail) : _mm256_loadu_ps(vr + 8 * c);
    const float* pr = t.st + a * Rp + r0;
#pragma GCC unroll 4
    for (int r = 0; r < RB; ++r) {
      const __m256 pb = _mm256_broadcast_ss(pr + r);
#pragma GCC unroll 4
      for (int c = 0; c < NV; ++c) o[r][c] = _mm256_fmadd_ps(pb, vv[c], o[r][c]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < RB; ++r) {
#pragma GCC unroll 4
    for (int c = 0; c < NV; ++c) _mm256_storeu_ps(t.acc + (r0 + r) * Dp + d0 + 8 * c, o[r][c]);
  }
}

void pv_avx2(const TaskBuffers& t, int64_t Na, const Problem& p, const Plan& pl) {
  constexpr int RB = 4;  // rows r0..r0+3 < Rp exist in st (rows >= R are padding, never output)
  for (int64_t r0 = 0; r0 < pl.R; r0 += RB) {
    for (int64_t d0 = 0; d0 < p.D; d0 += 16) {
      const int64_t rem = std::min<int64_t>(16, p.D - d0);
      const int nv = static_cast<int>(ceil_div(rem, 8));
      const int64_t last = rem - 8 * (nv - 1);
      const __m256i tail = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(last)),
                                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
      if (nv == 1)
        pv_block_avx2<RB, 1>(t, Na, pl.Rp, pl.Dp, r0, d0, tail);
      else
        pv_block_avx2<RB, 2>(t, Na, pl.Rp, pl.Dp, r0, d0, tail);
    }
  }
}
#endif  // SWIFTSPEC_TREE_ATTN_AVX2

#ifdef SWIFTSPEC_TREE_ATTN_AVX512
// KB keys x RV row vectors: KB * RV accumulators; per column d one load per row vector and one
// broadcast per key. The key list is padded to whole blocks (zero rows), so no tail variants.
template <int RV, int KB>
void scores_pass(const TaskBuffers& t, int64_t Na, const float* qt, int64_t D, int64_t Rp, int64_t v0) {
  for (int64_t a = 0; a < Na; a += KB) {
    const float* k[KB];
#pragma GCC unroll 8
    for (int b = 0; b < KB; ++b) k[b] = t.krow[a + b];
    __m512 acc[KB][RV];
#pragma GCC unroll 8
    for (int b = 0; b < KB; ++b) {
#pragma GCC unroll 4
      for (int v = 0; v < RV; ++v) acc[b][v] = _mm512_setzero_ps();
    }
    const float* q = qt + v0 * 16;
    for (int64_t d = 0; d < D; ++d, q += Rp) {
      __m512 qv[RV];
#pragma GCC unroll 4
      for (int v = 0; v < RV; ++v) qv[v] = _mm512_loadu_ps(q + 16 * v);
#pragma GCC unroll 8
      for (int b = 0; b < KB; ++b) {
        const __m512 kb = _mm512_set1_ps(k[b][d]);
#pragma GCC unroll 4
        for (int v = 0; v < RV; ++v) acc[b][v] = _mm512_fmadd_ps(kb, qv[v], acc[b][v]);
      }
    }
#pragma GCC unroll 8
    for (int b = 0; b < KB; ++b) {
#pragma GCC unroll 4
      for (int v = 0; v < RV; ++v) _mm512_storeu_ps(t.st + (a + b) * Rp + (v0 + v) * 16, acc[b][v]);
    }
  }
}

void scores_avx512(const TaskBuffers& t, int64_t Na, const float* qt, const Problem& p, const Plan& pl) {
  const int64_t nrv = pl.Rp / 16;
  // Passes of <= 4 row vectors, as even as possible (e.g. 6 -> 3 + 3, 7 -> 4 + 3).
  const int64_t passes = ceil_div(nrv, 4);
  int64_t v0 = 0;
  for (int64_t i = 0; i < passes; ++i) {
    const int64_t rv = nrv / passes + (i < nrv % passes ? 1 : 0);
    switch (rv) {
      case 1: scores_pass<1, 8>(t, Na, qt, p.D, pl.Rp, v0); break;
      case 2: scores_pass<2, 8>(t, Na, qt, p.D, pl.Rp, v0); break;
      case 3: scores_pass<3, 5>(t, Na, qt, p.D, pl.Rp, v0); break;
      case 4: scores_pass<4, 4>(t, Na, qt, p.D, pl.Rp, v0); break;
      default: TORCH_CHECK(false, "tree_attention: internal error, row pass ", rv);
    }
    v0 += rv;
  }
}

void softmax_avx512(const TaskBuffers& t, int64_t Na, const Problem& p, const Plan& pl) {
  const __m512 scale = _mm512_set1_ps(p.scale);
  for (int64_t v = 0; v < pl.Rp / 16; ++v) {
    __m512 m = _mm512_set1_ps(kNegInf);
    for (int64_t a = 0; a < Na; ++a) {
      const __m512 s = _mm512_mul_ps(_mm512_loadu_ps(t.st + a * pl.Rp + v * 16), scale);
      m = _mm512_mask_max_ps(m, t.lanes[a], m, s);
    }
    // Lanes that saw nothing keep m = -inf; their p are forced to 0 by the lane masks below.
    __m512 l = _mm512_setzero_ps();
    for (int64_t a = 0; a < Na; ++a) {
      float* sp = t.st + a * pl.Rp + v * 16;
      const __m512 s = _mm512_mul_ps(_mm512_loadu_ps(sp), scale);
      const __m512 e = _mm512_maskz_mov_ps(t.lanes[a], exp_avx512(_mm512_sub_ps(s, m)));
      _mm512_storeu_ps(sp, e);
      l = _mm512_add_ps(l, e);
    }
    _mm512_storeu_ps(t.m + v * 16, m);
    _mm512_storeu_ps(t.l + v * 16, l);
  }
}

// RB rows x NV vectors of D: per key NV loads of v and RB broadcasts of p. Keys none of the RB rows
// sees are skipped (their p are 0).
template <int RB, int NV>
void pv_block(const TaskBuffers& t, int64_t Na, int64_t Rp, int64_t Dp, int64_t r0, int64_t d0, __mmask16 last) {
  __m512 o[RB][NV];
#pragma GCC unroll 4
  for (int r = 0; r < RB; ++r) {
#pragma GCC unroll 4
    for (int c = 0; c < NV; ++c) o[r][c] = _mm512_setzero_ps();
  }
  const unsigned shift = static_cast<unsigned>(r0 % 16);
  for (int64_t a = 0; a < Na; ++a) {
    if (((t.lanes[a] >> shift) & ((1u << RB) - 1u)) == 0) continue;
    const float* vr = t.vrow[a] + d0;
    __m512 vv[NV];
#pragma GCC unroll 4
    for (int c = 0; c < NV; ++c)
      vv[c] = c == NV - 1 ? _mm512_maskz_loadu_ps(last, vr + 16 * c) : _mm512_loadu_ps(vr + 16 * c);
    const float* pr = t.st + a * Rp + r0;
#pragma GCC unroll 4
    for (int r = 0; r < RB; ++r) {
      const __m512 pb = _mm512_set1_ps(pr[r]);
#pragma GCC unroll 4
      for (int c = 0; c < NV; ++c) o[r][c] = _mm512_fmadd_ps(pb, vv[c], o[r][c]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < RB; ++r) {
#pragma GCC unroll 4
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(t.acc + (r0 + r) * Dp + d0 + 16 * c, o[r][c]);
  }
}

void pv_avx512(const TaskBuffers& t, int64_t Na, const Problem& p, const Plan& pl) {
  constexpr int RB = 4;
  for (int64_t r0 = 0; r0 < pl.R; r0 += RB) {
    for (int64_t d0 = 0; d0 < p.D; d0 += 64) {
      const int64_t rem = std::min<int64_t>(64, p.D - d0);
      const int nv = static_cast<int>(ceil_div(rem, 16));
      const __mmask16 last = tail_mask16(rem - 16 * (nv - 1));
      switch (nv) {
        case 1: pv_block<RB, 1>(t, Na, pl.Rp, pl.Dp, r0, d0, last); break;
        case 2: pv_block<RB, 2>(t, Na, pl.Rp, pl.Dp, r0, d0, last); break;
        case 3: pv_block<RB, 3>(t, Na, pl.Rp, pl.Dp, r0, d0, last); break;
        default: pv_block<RB, 4>(t, Na, pl.Rp, pl.Dp, r0, d0, last); break;
      }
    }
  }
}
#endif  // SWIFTSPEC_TREE_ATTN_AVX512

// ----------------------------------------------------------------------------------------------
// Output: finalize one row (acc / l, zeros when l = 0) and merge split partials.

void write_out_row(const Problem& p, int64_t i, int64_t hq, const float* acc, float l) {
  float row[1024];  // D <= 1024 checked at entry
  const float inv = l > 0.f ? 1.f / l : 0.f;
  for (int64_t d = 0; d < p.D; ++d) row[d] = l > 0.f ? acc[d] * inv : 0.f;
  store_row(p.out, (i * p.Hq + hq) * p.D, p.bf16, p.D, row);
}

// Rows r = g * W + q that exist: head g < G, query q of the tile.
template <class F>
void for_each_row(const Problem& p, const Plan& pl, int64_t h, int64_t tile, F&& f) {
  const int64_t i0 = tile * pl.qt, nq = std::min(pl.qt, p.n - i0);
  for (int64_t g = 0; g < p.G; ++g)
    for (int64_t q = 0; q < nq; ++q) f(g * pl.W + q, i0 + q, h * p.G + g);
}

// FlashInfer merge_state: M = max_s m_s, out = sum_s e^(m_s - M) o_s / sum_s e^(m_s - M) l_s.
// Splits a row did not see (l_s = 0) are skipped, so their (unwritten) o_s is never read.
void merge_group(const Problem& p, const Plan& pl, const CallBuffers& cb, int64_t h, int64_t tile) {
  const int64_t gbase = (h * pl.ntile + tile) * pl.nsplit;
  std::vector<float> o(p.D);
  for_each_row(p, pl, h, tile, [&](int64_t r, int64_t i, int64_t hq) {
    float M = kNegInf;
    for (int64_t s = 0; s < pl.nsplit; ++s) {
      const float* ml = cb.part_ml + ((gbase + s) * pl.Rp + r) * 2;
      if (ml[1] > 0.f) M = std::max(M, ml[0]);
    }
    std::fill(o.begin(), o.end(), 0.f);
    float L = 0.f;
    if (M != kNegInf) {
      for (int64_t s = 0; s < pl.nsplit; ++s) {
        const float* ml = cb.part_ml + ((gbase + s) * pl.Rp + r) * 2;
        if (!(ml[1] > 0.f)) continue;
        const float w = std::exp(ml[0] - M);
        L += w * ml[1];
        const float* os = cb.part_o + ((gbase + s) * pl.Rp + r) * pl.Dp;
        for (int64_t d = 0; d < p.D; ++d) o[d] += w * os[d];
      }
    }
    write_out_row(p, i, hq, o.data(), L);
  });
}

// Stage 2: one task per (kv head, tile, split).
void stage_attention(const Problem& p, const Plan& pl, const KeyOrder& ko, const CallBuffers& cb, Impl impl) {
  const int64_t ntask = p.Hk * pl.ntile * pl.nsplit;
  const size_t bytes = task_bytes(p, pl);
  at::parallel_for(0, ntask, 1, [&](int64_t begin, int64_t end) {
    static thread_local Arena arena;
    arena.reset(bytes);
    const TaskBuffers t = take_task_buffers(arena, p, pl);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task % pl.nsplit, group = task / pl.nsplit;
      const int64_t h = group / pl.ntile, tile = group % pl.ntile;
      const int64_t i0 = tile * pl.qt, nq = std::min(pl.qt, p.n - i0);
      const int32_t* keys = ko.keys.data() + ko.off[s];
      const int64_t nk = ko.off[s + 1] - ko.off[s];

      // Active keys of this split for this tile's queries, with their lane masks.
      std::fill(t.qmask, t.qmask + nk, 0);
      for (int64_t q = 0; q < nq; ++q) {
        const bool* mrow = p.mask + (i0 + q) * p.S;
        for (int64_t j = 0; j < nk; ++j) t.qmask[j] |= static_cast<uint16_t>(mrow[keys[j]]) << q;
      }
      int64_t Na = 0;
      for (int64_t j = 0; j < nk; ++j) {
        if (t.qmask[j] == 0) continue;
        t.act[Na] = keys[j];
        t.lanes[Na] = static_cast<uint16_t>(t.qmask[j] * pl.lane_rep);
        ++Na;
      }

      if (Na > 0) {
        // fp32 caches are read in place; bf16 rows are widened once here (each is used by all
        // rows of the block, so converting inside the kernels would repeat the work Rp/16 times).
        const int64_t cache0 = h * p.C;
        for (int64_t a = 0; a < Na; ++a) {
          const int64_t row = (cache0 + t.act[a]) * p.D;
          if (p.bf16) {
            float* kd = t.kstage + a * p.D;
            float* vd = t.vstage + a * pl.Dp;
            load_row_f32(p.k_cache, row, true, p.D, kd);
            load_row_f32(p.v_cache, row, true, p.D, vd);
            t.krow[a] = kd;
            t.vrow[a] = vd;
          } else {
            t.krow[a] = static_cast<const float*>(p.k_cache) + row;
            t.vrow[a] = static_cast<const float*>(p.v_cache) + row;
          }
        }
        for (int64_t a = Na; a < Na + kKeyPad; ++a) t.krow[a] = t.zero_row;

        const float* qt = cb.qt + group * p.D * pl.Rp;
#ifdef SWIFTSPEC_TREE_ATTN_AVX512
        if (impl == Impl::kAvx512) {
          scores_avx512(t, Na, qt, p, pl);
          softmax_avx512(t, Na, p, pl);
          pv_avx512(t, Na, p, pl);
        } else
#endif
#ifdef SWIFTSPEC_TREE_ATTN_AVX2
        if (impl == Impl::kAvx2) {
          scores_avx2(t, Na, qt, p, pl);
          softmax_avx2(t, Na, p, pl);
          pv_avx2(t, Na, p, pl);
        } else
#endif
        {
          scores_scalar(t, Na, qt, p, pl);
          softmax_scalar(t, Na, p, pl);
          pv_scalar(t, Na, p, pl);
        }
      } else {
        std::fill(t.m, t.m + pl.Rp, kNegInf);
        std::fill(t.l, t.l + pl.Rp, 0.f);
      }

      if (pl.nsplit == 1) {
        for_each_row(p, pl, h, tile, [&](int64_t r, int64_t i, int64_t hq) {
          write_out_row(p, i, hq, t.acc + r * pl.Dp, t.l[r]);
        });
        continue;
      }
      const int64_t pidx = group * pl.nsplit + s;
      for (int64_t r = 0; r < pl.R; ++r) {
        float* ml = cb.part_ml + (pidx * pl.Rp + r) * 2;
        ml[0] = t.m[r];
        ml[1] = t.l[r];
        if (t.l[r] > 0.f) std::memcpy(cb.part_o + (pidx * pl.Rp + r) * pl.Dp, t.acc + r * pl.Dp, p.D * sizeof(float));
      }
      // The last split of the group to arrive merges (acq_rel: it sees every other split's writes).
      if (cb.arrived[group].fetch_add(1, std::memory_order_acq_rel) == pl.nsplit - 1) merge_group(p, pl, cb, h, tile);
    }
  });
}

// ----------------------------------------------------------------------------------------------
// Entry

void check_inputs(const at::Tensor& q, const at::Tensor& k_new, const at::Tensor& v_new, const at::Tensor& k_cache,
                  const at::Tensor& v_cache, const at::Tensor& slots, const at::Tensor& positions,
                  const at::Tensor& cos_table, const at::Tensor& sin_table, const at::Tensor& mask) {
  for (const at::Tensor* t : {&q, &k_new, &v_new, &k_cache, &v_cache, &slots, &positions, &cos_table, &sin_table, &mask})
    TORCH_CHECK(t->device().is_cpu(), "tree_attention: all tensors must be on the CPU");
  TORCH_CHECK(q.dim() == 3, "tree_attention: q must be [n, Hq, D], got ", q.sizes());
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "tree_attention: q must be float32 or bfloat16, got ", q.scalar_type());
  for (const at::Tensor* t : {&k_new, &v_new, &k_cache, &v_cache})
    TORCH_CHECK(t->scalar_type() == q.scalar_type(), "tree_attention: k_new, v_new, k_cache, v_cache must have q's dtype ",
                q.scalar_type(), ", got ", t->scalar_type());
  const int64_t n = q.size(0), Hq = q.size(1), D = q.size(2);
  TORCH_CHECK(k_new.dim() == 3 && k_new.size(0) == n && k_new.size(2) == D,
              "tree_attention: k_new must be [n, Hk, D] = [", n, ", Hk, ", D, "], got ", k_new.sizes());
  TORCH_CHECK(v_new.sizes() == k_new.sizes(), "tree_attention: v_new ", v_new.sizes(), " must match k_new ", k_new.sizes());
  const int64_t Hk = k_new.size(1);
  TORCH_CHECK(Hk > 0 && Hq % Hk == 0, "tree_attention: Hq (", Hq, ") must be a positive multiple of Hk (", Hk, ")");
  TORCH_CHECK(D > 0 && D % 2 == 0 && D <= 1024, "tree_attention: head dim must be even and in [2, 1024], got ", D);
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.size(0) == Hk && k_cache.size(2) == D,
              "tree_attention: k_cache must be [Hk, C, D] = [", Hk, ", C, ", D, "], got ", k_cache.sizes());
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes(), "tree_attention: v_cache ", v_cache.sizes(), " must match k_cache ",
              k_cache.sizes());
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(),
              "tree_attention: k_cache and v_cache must be contiguous (they are written in place)");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == n,
              "tree_attention: slots must be int64 [n] = [", n, "], got ", slots.scalar_type(), " ", slots.sizes());
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.dim() == 1 && positions.size(0) == n,
              "tree_attention: positions must be int64 [n] = [", n, "], got ", positions.scalar_type(), " ",
              positions.sizes());
  TORCH_CHECK(cos_table.scalar_type() == at::kFloat && sin_table.scalar_type() == at::kFloat,
              "tree_attention: cos_table and sin_table must be float32");
  TORCH_CHECK(cos_table.dim() == 2 && cos_table.size(1) == D && sin_table.sizes() == cos_table.sizes(),
              "tree_attention: cos_table and sin_table must both be [P, D] with D = ", D, ", got ", cos_table.sizes(),
              " and ", sin_table.sizes());
  TORCH_CHECK(mask.scalar_type() == at::kBool && mask.dim() == 2 && mask.size(0) == n,
              "tree_attention: mask must be bool [n, S] with n = ", n, ", got ", mask.scalar_type(), " ", mask.sizes());
  TORCH_CHECK(mask.size(1) <= k_cache.size(1), "tree_attention: mask covers S = ", mask.size(1),
              " keys but the cache holds only C = ", k_cache.size(1));
}

at::Tensor tree_attention_impl(const at::Tensor& q_in, const at::Tensor& k_new_in, const at::Tensor& v_new_in,
                               at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots_in,
                               const at::Tensor& positions_in, const at::Tensor& cos_in, const at::Tensor& sin_in,
                               const at::Tensor& mask_in, double scale, Impl impl,
                               const c10::optional<at::Tensor>& slot_positions) {
  check_inputs(q_in, k_new_in, v_new_in, k_cache, v_cache, slots_in, positions_in, cos_in, sin_in, mask_in);
  at::Tensor slot_pos;
  if (slot_positions.has_value() && slot_positions->defined()) {
    slot_pos = slot_positions->contiguous();
    TORCH_CHECK(slot_pos.device().is_cpu() && slot_pos.scalar_type() == at::kLong && slot_pos.dim() == 1 &&
                    slot_pos.size(0) >= mask_in.size(1),
                "tree_attention: slot_positions must be int64 [>= S] = [>= ", mask_in.size(1), "], got ",
                slot_pos.scalar_type(), " ", slot_pos.sizes());
  }
  const at::Tensor q = q_in.contiguous(), k_new = k_new_in.contiguous(), v_new = v_new_in.contiguous();
  const at::Tensor slots = slots_in.contiguous(), positions = positions_in.contiguous();
  const at::Tensor cos_t = cos_in.contiguous(), sin_t = sin_in.contiguous(), mask = mask_in.contiguous();

  Problem p{};
  p.n = q.size(0);
  p.Hq = q.size(1);
  p.D = q.size(2);
  p.Hk = k_new.size(1);
  p.G = p.Hq / p.Hk;
  p.C = k_cache.size(1);
  p.S = mask.size(1);
  p.bf16 = q.scalar_type() == at::kBFloat16;
  p.scale = static_cast<float>(scale);
  p.slots = slots.data_ptr<int64_t>();
  p.positions = positions.data_ptr<int64_t>();
  p.slot_pos = slot_pos.defined() ? slot_pos.data_ptr<int64_t>() : nullptr;
  const int64_t P = cos_t.size(0);
  for (int64_t i = 0; i < p.n; ++i) {
    TORCH_CHECK(p.positions[i] >= 0 && p.positions[i] < P, "tree_attention: positions[", i, "] = ", p.positions[i],
                " is outside the rotary table [0, ", P, ")");
    TORCH_CHECK(p.slots[i] < p.C, "tree_attention: slots[", i, "] = ", p.slots[i], " is outside the cache [0, ", p.C, ")");
  }
  at::Tensor out = at::empty({p.n, p.Hq * p.D}, q.options());
  if (p.n == 0) return out;
  p.q = q.data_ptr();
  p.k_new = k_new.data_ptr();
  p.v_new = v_new.data_ptr();
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  p.cos = cos_t.data_ptr<float>();
  p.sin = sin_t.data_ptr<float>();
  p.mask = mask.data_ptr<bool>();
  p.out = out.data_ptr();

  if (p.S == 0) {  // nothing to attend to: still rotate and write the new keys
    Plan pl = make_plan(p);
    pl.nsplit = 0;
    static thread_local Arena call_arena0;
    call_arena0.reset(Arena::bytes(p.Hk * pl.ntile * p.D * pl.Rp, 4));
    CallBuffers cb{};
    cb.qt = call_arena0.take<float>(p.Hk * pl.ntile * p.D * pl.Rp);
    stage_rope_and_write(p, pl, cb, impl);
    out.zero_();
    return out;
  }

  Plan pl = make_plan(p);
  const KeyOrder ko = order_keys(p, pl);
  const int64_t groups = p.Hk * pl.ntile;
  const int64_t nqt = groups * p.D * pl.Rp;
  const int64_t npart = pl.nsplit > 1 ? groups * pl.nsplit * pl.Rp : 0;
  static thread_local Arena call_arena;
  call_arena.reset(Arena::bytes(nqt, 4) + Arena::bytes(npart * pl.Dp, 4) + Arena::bytes(npart * 2, 4));
  CallBuffers cb{};
  cb.qt = call_arena.take<float>(nqt);
  cb.part_o = call_arena.take<float>(npart * pl.Dp);
  cb.part_ml = call_arena.take<float>(npart * 2);
  std::unique_ptr<std::atomic<int>[]> arrived(new std::atomic<int>[groups]);
  for (int64_t g = 0; g < groups; ++g) arrived[g].store(0, std::memory_order_relaxed);
  cb.arrived = arrived.get();

  stage_rope_and_write(p, pl, cb, impl);
  stage_attention(p, pl, ko, cb, impl);
  return out;
}

Impl best_impl() {
#if defined(SWIFTSPEC_TREE_ATTN_AVX512)
  return Impl::kAvx512;
#elif defined(SWIFTSPEC_TREE_ATTN_AVX2)
  return Impl::kAvx2;
#else
  return Impl::kScalar;
#endif
}

std::vector<std::string> tree_attention_impls() {
  std::vector<std::string> v{"scalar"};
#ifdef SWIFTSPEC_TREE_ATTN_AVX2
  v.emplace_back("avx2");
#endif
#ifdef SWIFTSPEC_TREE_ATTN_AVX512
  v.emplace_back("avx512");
#endif
  return v;
}

at::Tensor tree_attention_with_impl(const at::Tensor& q, const at::Tensor& k_new, const at::Tensor& v_new,
                                    at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slots,
                                    const at::Tensor& positions, const at::Tensor& cos_table,
                                    const at::Tensor& sin_table, const at::Tensor& mask, double scale,
                                    const std::string& name, const c10::optional<at::Tensor>& slot_positions) {
  Impl impl;
  if (name == "auto") {
    impl = best_impl();
  } else if (name == "scalar") {
    impl = Impl::kScalar;
  } else {
    bool compiled = false;
    for (const auto& s : tree_attention_impls()) compiled = compiled || s == name;
    TORCH_CHECK(name == "avx512" || name == "avx2", "tree_attention: unknown impl '", name,
                "' (auto, scalar, avx2, avx512)");
    TORCH_CHECK(compiled, "tree_attention: impl '", name, "' is not compiled in this build");
    impl = name == "avx512" ? Impl::kAvx512 : Impl::kAvx2;
  }
  return tree_attention_impl(q, k_new, v_new, k_cache, v_cache, slots, positions, cos_table, sin_table, mask, scale,
                             impl, slot_positions);
}

}  // namespace

at::Tensor tree_attention_cpu(const at::Tensor& q, const at::Tensor& k_new, const at::Tensor& v_new, at::Tensor k_cache,
                              at::Tensor v_cache, const at::Tensor& slots, const at::Tensor& positions,
                              const at::Tensor& cos_table, const at::Tensor& sin_table, const at::Tensor& mask,
                              double scale, const c10::optional<at::Tensor>& slot_positions) {
  return tree_attention_impl(q, k_new, v_new, k_cache, v_cache, slots, positions, cos_table, sin_table, mask, scale,
                             best_impl(), slot_positions);
}

void register_tree_attention(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("tree_attention", &tree_attention_cpu, py::arg("q"), py::arg("k_new"), py::arg("v_new"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("slots"), py::arg("positions"), py::arg("cos_table"), py::arg("sin_table"),
        py::arg("mask"), py::arg("scale"), py::arg("slot_positions") = py::none(),
        R"doc(RoPE + KV write + masked split-KV attention, the CPU twin of reference.tree_attention.

q [n, Hq, D]; k_new, v_new [n, Hk, D]; k_cache, v_cache [Hk, C, D] contiguous, written in place
(rotated k_new / v_new at slots[i]; negative slots are not written); all fp32 or all bf16.
slots, positions [n] int64; cos_table, sin_table [P, D] float32 (rotate-half RoPE rows at
positions); mask [n, S] bool, S <= C (query i sees cache slot j < S iff mask[i, j]); Hq % Hk == 0;
D even (64 and 128 are the tuned sizes). Softmax in fp32 with `scale` applied to q.k; a fully
masked row returns zeros. Returns [n, Hq * D] in q's dtype. Releases the GIL; parallel over
(kv head, query tile, key split of 256 positions at fixed boundaries; the key at slots[i] is at
positions[i], any other slot j at slot_positions[j] (int64 [>= S], optional) or else at position
j) with at::parallel_for. Batch invariant: a row's
output is bit-identical whatever other rows, S or thread count it runs with, and a tree node equals
the same token decoded alone after its ancestors' keys are compacted to the slots of their positions.
Raises RuntimeError on non-CPU tensors, wrong dtypes or shapes, non-contiguous caches, S > C,
positions outside [0, P) or slots >= C.)doc",
        py::call_guard<py::gil_scoped_release>());
  m.def("_tree_attention_impl", &tree_attention_with_impl, py::arg("q"), py::arg("k_new"), py::arg("v_new"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("slots"), py::arg("positions"), py::arg("cos_table"),
        py::arg("sin_table"), py::arg("mask"), py::arg("scale"), py::arg("impl"), py::arg("slot_positions") = py::none(),
        "Test hook: tree_attention with a forced inner kernel ('auto', 'scalar', 'avx2', 'avx512'; see "
        "_tree_attention_impls()). Raises RuntimeError for an impl not compiled in this build.",
        py::call_guard<py::gil_scoped_release>());
  m.def("_tree_attention_impls", &tree_attention_impls,
        "Test hook: names of the tree_attention inner kernels compiled in this build.");
}

}  // namespace swiftspec
