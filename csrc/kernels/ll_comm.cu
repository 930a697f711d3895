// LL ("low latency") all-reduce and fused GEMM + all-reduce over CUDA IPC buffers
// (SwiftSpec paper section 3.3, Algorithm 2 and Figure 6; the packet format
// is csrc/include/swiftspec/ll_protocol.h, after NCCL's LL16 and mscclpp's LL8).
//
// Buffers. Every rank owns one device buffer, exported with cudaIpcGetMemHandle and mapped by every
// peer with cudaIpcOpenMemHandle (the Python side exchanges the 64-byte handles with
// torch.distributed all_gather_object). Layout:
//   [0, SS_LL_HEADER_BYTES)             control block of this rank (epoch, arrival counter)
//   then kNumSlots x size regions         region (slot, src) = rank src's packets of an epoch with
//                                         slot_of_epoch(epoch) == slot, region_bytes bytes each.
// A rank pushes its packets into region (slot, own rank) of EVERY rank's buffer (its own
// included, so a size-1 group still runs the whole packet path) and reads the `size` regions of
// its own buffer. cupy could do the IPC calls too, but this library already links cudart, so the
// host side below calls it directly and Python needs no further dependency.
//
// Synchronization is the packet itself: every 8-byte word carries a 4-byte flag derived from the
// epoch next to 4 bytes of payload, written and read as one vector access (8-byte halves of a
// v4 access are single-copy atomic), so a reader that sees the epoch's flag in a word also sees
// its payload. No fence, barrier or extra flag write is needed between writer and reader.
//
// Epochs live in device memory (the control block) and advance inside the kernel, never passed as
// launch arguments, so replaying a captured CUDA graph uses fresh flags. The last block to finish
// (found with an atomic arrival counter) increments the epoch and resets the counter; the next
// launch on the stream starts after this one completed and sees the new value.
//
// Double buffering (why kNumSlots = 2 suffices): rank r writes epoch e's packets into slot e % 2
// of peer p only after it finished epoch e-1, i.e. after it read epoch e-1 packets of EVERY peer;
// peer p wrote those inside its epoch e-1 launch, which starts only after p's epoch e-2 launch
// (the last reader of slot e % 2) completed. So stale words in a slot carry the flag of epoch e-2,
// never the current one (flags take >= 3 values; see the header for wrap-around).
//
// Reset after read. Flags wrap (every kFlagSpace epochs, every 3 in the FLAG_BITS=2 test build)
// and message sizes vary between calls, so a word beyond the end of the last few messages could
// still hold a packet of an older epoch whose flag equals the current one. Every reader therefore
// zeroes each packet it consumed (a local store, cheap next to the remote ones): at every epoch
// boundary the inboxes are all-zero again, exactly the state the protocol starts from. The same
// argument as above shows the zeroing (done inside epoch e) completes before any peer writes that
// word again (epoch e+2).
//
// Progress: a block pushes all its packets before it waits on any, and grids never exceed the
// number of SMs (every block is resident, 1 block per SM fits these kernels' resources), so a
// waiting block can only wait for a block that is already running on the peer. A wait longer
// than timeout_ns (dead peer, mismatched call sequence) prints a message and traps the kernel:
// the host sees a launch failure instead of a hang.
#include <stdio.h>
#include <string.h>

#include "api.h"
#include "common.cuh"
#include "gemv.cuh"
#include "swiftspec/ll_protocol.h"

namespace swiftspec {
namespace cuda {
namespace {

static_assert(sizeof(ll::Packet16) == 16, "LL16 packets are one 16-byte vector");

// Control block at the start of every LL buffer (only the owner's is used).
struct LLCtrl {
  unsigned long long epoch;  // epoch of the next collective call
  unsigned int arrived;      // blocks of the running launch that have finished
  unsigned int error;        // set once by the first block that timed out (one message only)
};
static_assert(sizeof(LLCtrl) <= SS_LL_HEADER_BYTES, "control block fits the header");

struct LLArgs {
  void* const* peers;  // [size] device pointers: rank r's buffer as mapped in this process
  char* local;         // own buffer (== peers[rank])
  int rank;
  int size;
  int64_t region_bytes;
  int64_t timeout_ns;
};

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// ---- packet store/load (inline PTX) ----------------------------------------------------------
// Why volatile: the reader polls memory that another GPU (or another SM) writes. ld.volatile is
// never cached in L1 and never merged or hoisted by the compiler, so every poll observes L2 / the
// peer's write; st.volatile is likewise not held back. Why one vector instruction: the flag and
// the payload of a word must become visible together (NCCL LL), which a single 8-byte access of
// the v2/v4 vector guarantees.
template <int W>
struct LL;

// LL16: ll::Packet16 {data0, flag0, data1, flag1}, 8 payload bytes per 16-byte store.
template <>
struct LL<2> {
  using Packet = ll::Packet16;
  __device__ __forceinline__ static void store(Packet* p, const uint32_t (&d)[2], uint32_t flag) {
    asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(d[0]),
                 "r"(flag), "r"(d[1]), "r"(flag)
                 : "memory");
  }
  __device__ __forceinline__ static bool poll(const Packet* p, uint32_t flag, uint32_t (&d)[2]) {
    uint32_t d0, f0, d1, f1;
    asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(d0), "=r"(f0), "=r"(d1), "=r"(f1)
                 : "l"(p)
                 : "memory");
    d[0] = d0;
    d[1] = d1;
    return f0 == flag && f1 == flag;
  }
};

// LL8: one 64-bit word (flag << 32) | payload (ll::pack8), 4 payload bytes per 8-byte store.
// Little endian: the low half (payload) is the first u32 of the v2 vector.
template <>
struct LL<1> {
  using Packet = uint64_t;
  __device__ __forceinline__ static void store(Packet* p, const uint32_t (&d)[1], uint32_t flag) {
    asm volatile("st.volatile.global.v2.u32 [%0], {%1, %2};" ::"l"(p), "r"(d[0]), "r"(flag)
                 : "memory");
  }
  __device__ __forceinline__ static bool poll(const Packet* p, uint32_t flag, uint32_t (&d)[1]) {
    uint32_t d0, f0;
    asm volatile("ld.volatile.global.v2.u32 {%0, %1}, [%2];"
                 : "=r"(d0), "=r"(f0)
                 : "l"(p)
                 : "memory");
    d[0] = d0;
    return f0 == flag;
  }
};

// Zero a consumed packet (flag 0 = never written).
template <int W>
__device__ __forceinline__ void reset_packet(typename LL<W>::Packet* p) {
  uint32_t z[W];
#pragma unroll
  for (int v = 0; v < W; ++v) z[v] = 0u;
  LL<W>::store(p, z, 0u);
}

template <int W>
__device__ __forceinline__ typename LL<W>::Packet* region(void* base, int slot, int src,
                                                          const LLArgs& a) {
  char* p = static_cast<char*>(base) + SS_LL_HEADER_BYTES +
            (static_cast<int64_t>(slot) * a.size + src) * a.region_bytes;
  return reinterpret_cast<typename LL<W>::Packet*>(p);
}

// Spin until packet p carries `flag`; trap after timeout_ns (checked every 1024 polls, so the
// clock read stays off the fast path).
template <int W>
__device__ __forceinline__ void wait_packet(const typename LL<W>::Packet* p, uint32_t flag,
                                            uint32_t (&d)[W], const LLArgs& a, int src,
                                            uint64_t epoch) {
  if (LL<W>::poll(p, flag, d)) return;
  const uint64_t t0 = global_timer_ns();
  for (uint32_t spins = 1;; ++spins) {
    if (LL<W>::poll(p, flag, d)) return;
    if ((spins & 1023u) == 0 && global_timer_ns() - t0 > static_cast<uint64_t>(a.timeout_ns)) {
      LLCtrl* ctrl = reinterpret_cast<LLCtrl*>(a.local);
      if (atomicExch(&ctrl->error, 1u) == 0u)
        printf("swiftspec LL: rank %d timed out after %lld ns waiting for rank %d (epoch %llu); "
               "a peer died or the ranks issued different collectives\n",
               a.rank, static_cast<long long>(a.timeout_ns), src,
               static_cast<unsigned long long>(epoch));
      __trap();
    }
  }
}

__device__ __forceinline__ uint64_t read_epoch(const LLArgs& a) {
  return *reinterpret_cast<volatile unsigned long long*>(&reinterpret_cast<LLCtrl*>(a.local)->epoch);
}

// The last block of the launch to get here advances the epoch. Only the last one may: every block
// reads the epoch when it starts, so it must not change while any block of this launch can still
// be before that read, and exactly one block must increment it.
__device__ __forceinline__ void finish_epoch(const LLArgs& a, uint64_t epoch) {
  __syncthreads();  // every thread of this block has finished its reads of this epoch
  if (threadIdx.x == 0) {
    LLCtrl* ctrl = reinterpret_cast<LLCtrl*>(a.local);
    __threadfence();
    const unsigned prev = atomicAdd(&ctrl->arrived, 1u);
    if (prev == gridDim.x - 1) {
      // No other block of this launch touches the control block any more; plain stores become
      // visible to the next launch at the kernel boundary, the fence orders them for good measure.
      ctrl->arrived = 0u;
      *reinterpret_cast<volatile unsigned long long*>(&ctrl->epoch) = epoch + 1ull;
      __threadfence();
    }
  }
}

// Elements of x in packet q as payload words (zero padded past n).
template <typename T, int W>
__device__ __forceinline__ void pack_elems(const T* x, int64_t n, int64_t q, uint32_t (&d)[W]) {
  if constexpr (sizeof(T) == 4) {
    const uint32_t* xb = reinterpret_cast<const uint32_t*>(x);
#pragma unroll
    for (int v = 0; v < W; ++v) {
      const int64_t i = q * W + v;
      d[v] = i < n ? xb[i] : 0u;
    }
  } else {
    const uint16_t* xb = reinterpret_cast<const uint16_t*>(x);
#pragma unroll
    for (int v = 0; v < W; ++v) {
      const int64_t i = (q * W + v) * 2;
      const uint32_t lo = i < n ? xb[i] : 0u;
      const uint32_t hi = i + 1 < n ? xb[i + 1] : 0u;
      d[v] = lo | (hi << 16);
    }
  }
}

// One-shot all-reduce of one chunk (one epoch). Thread-owned packet indices are the same in the
// push and the reduce loop, so out may alias x (a thread reads its elements before writing them).
template <typename T, int W>
__global__ void __launch_bounds__(512) ll_all_reduce_kernel(const T* x, T* out, int64_t n, LLArgs a) {
  using P = LL<W>;
  using Packet = typename P::Packet;
  constexpr int kElems = W * 4 / static_cast<int>(sizeof(T));  // elements per packet
  __shared__ void* peers[SS_MAX_RANKS];
  if (threadIdx.x < a.size) peers[threadIdx.x] = a.peers[threadIdx.x];
  __syncthreads();

  const uint64_t epoch = read_epoch(a);
  const uint32_t flag = ll::flag_of_epoch(epoch);
  const int slot = ll::slot_of_epoch(epoch);
  const int64_t npk = (n + kElems - 1) / kElems;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;

  for (int64_t q = first; q < npk; q += stride) {
    uint32_t d[W];
    pack_elems<T, W>(x, n, q, d);
    // start with the next rank so that not every rank hammers rank 0's buffer first
    for (int i = 1; i <= a.size; ++i) {
      const int dst = (a.rank + i) % a.size;
      P::store(region<W>(peers[dst], slot, a.rank, a) + q, d, flag);
    }
  }

  for (int64_t q = first; q < npk; q += stride) {
    float acc[kElems];
#pragma unroll
    for (int e = 0; e < kElems; ++e) acc[e] = 0.f;
    // fixed rank order 0..size-1 and fp32: every rank adds the same numbers in the same order
    for (int src = 0; src < a.size; ++src) {
      uint32_t d[W];
      typename LL<W>::Packet* pk = region<W>(a.local, slot, src, a) + q;
      wait_packet<W>(pk, flag, d, a, src, epoch);
      reset_packet<W>(pk);
#pragma unroll
      for (int v = 0; v < W; ++v) {
        if constexpr (sizeof(T) == 4) {
          acc[v] += bits_to_float<T>(d[v]);
        } else {
          acc[2 * v] += bits_to_float<T>(d[v] & 0xFFFFu);
          acc[2 * v + 1] += bits_to_float<T>(d[v] >> 16);
        }
      }
    }
#pragma unroll
    for (int e = 0; e < kElems; ++e) {
      const int64_t i = q * kElems + e;
      if (i < n) out[i] = from_float<T>(acc[e]);
    }
  }
  finish_epoch(a, epoch);
}

// ---- fused GEMM + all-reduce ---------------------------------------------------------------
constexpr int kGemmRowsPerWarp = 4;
constexpr int kGemmTileN = kGemvWarps * kGemmRowsPerWarp;  // output columns per tile

// Partials are exchanged in fp32, column by column: column n of the [M, N] partial occupies
// ceil(M / W) packets (rows padded to Mp = a multiple of W so a packet never straddles columns),
// so a tile of columns is a contiguous run of packets and can be pushed as soon as it is done.
//
// Phase 1 (per tile of this block, grid-stride): staged GEMV of kGemmTileN weight rows against x,
// partial tile to shared memory, then LL-store of the tile into every rank's inbox right away.
// Phase 2: for each of its tiles, wait on every rank's packets of that tile, sum in rank order,
// add the bias once, round once, store. Other blocks' tiles keep computing while a block reduces.
template <typename T, int MT, int W>
__global__ void __launch_bounds__(kGemvThreads)
    ll_gemm_all_reduce_kernel(const T* __restrict__ x, const T* __restrict__ w,
                              const T* __restrict__ bias, T* __restrict__ out, int M, int N, int K,
                              int ld_out, bool vec_ok, LLArgs a) {
  using P = LL<W>;
  __shared__ __align__(16) float xs[MT * kGemvKChunk];
  __shared__ float part[kGemmTileN * SS_MAX_M];
  __shared__ void* peers[SS_MAX_RANKS];
  if (threadIdx.x < a.size) peers[threadIdx.x] = a.peers[threadIdx.x];
  __syncthreads();

  const uint64_t epoch = read_epoch(a);
  const uint32_t flag = ll::flag_of_epoch(epoch);
  const int slot = ll::slot_of_epoch(epoch);
  const int Mp = (M + W - 1) / W * W;
  const int ppc = Mp / W;  // packets per column
  const int ntiles = (N + kGemmTileN - 1) / kGemmTileN;
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;

  for (int tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
    const int n0 = tile * kGemmTileN;
    const T* rows[kGemmRowsPerWarp];
#pragma unroll
    for (int r = 0; r < kGemmRowsPerWarp; ++r) {
      const int n = n0 + warp * kGemmRowsPerWarp + r;
      rows[r] = n < N ? w + static_cast<int64_t>(n) * K : nullptr;
    }
    float acc[kGemmRowsPerWarp][MT];
    block_gemv<T, MT, kGemmRowsPerWarp>(x, M, K, rows, vec_ok, xs, acc);
    if (lane == 0) {
#pragma unroll
      for (int r = 0; r < kGemmRowsPerWarp; ++r) {
        const int col = warp * kGemmRowsPerWarp + r;
#pragma unroll
        for (int m = 0; m < SS_MAX_M; ++m)
          if (m < Mp) part[col * Mp + m] = (m < MT && m < M) ? acc[r][m % MT] : 0.f;
      }
    }
    __syncthreads();
    const int ncols = min(kGemmTileN, N - n0);
    const int64_t base = static_cast<int64_t>(n0) * ppc;
    for (int q = threadIdx.x; q < ncols * ppc; q += blockDim.x) {
      uint32_t d[W];
#pragma unroll
      for (int v = 0; v < W; ++v) d[v] = __float_as_uint(part[q * W + v]);
      for (int i = 1; i <= a.size; ++i) {
        const int dst = (a.rank + i) % a.size;
        P::store(region<W>(peers[dst], slot, a.rank, a) + base + q, d, flag);
      }
    }
    __syncthreads();  // part is rewritten by the next tile
  }

  for (int tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
    const int n0 = tile * kGemmTileN;
    const int ncols = min(kGemmTileN, N - n0);
    const int64_t base = static_cast<int64_t>(n0) * ppc;
    for (int q = threadIdx.x; q < ncols * ppc; q += blockDim.x) {
      float acc[W];
#pragma unroll
      for (int v = 0; v < W; ++v) acc[v] = 0.f;
      for (int src = 0; src < a.size; ++src) {
        uint32_t d[W];
        typename LL<W>::Packet* pk = region<W>(a.local, slot, src, a) + base + q;
        wait_packet<W>(pk, flag, d, a, src, epoch);
        reset_packet<W>(pk);
#pragma unroll
        for (int v = 0; v < W; ++v) acc[v] += __uint_as_float(d[v]);
      }
#pragma unroll
      for (int v = 0; v < W; ++v) {
        const int f = q * W + v;
        const int m = f % Mp;
        const int n = n0 + f / Mp;
        if (m < M) {
          const float b = bias != nullptr ? to_float<T>(bias[n]) : 0.f;
          out[static_cast<int64_t>(m) * ld_out + n] = from_float<T>(acc[v] + b);
        }
      }
    }
  }
  finish_epoch(a, epoch);
}

int check_group(const void* peer_table, const void* local_buffer, int rank, int size,
                int64_t region_bytes, int protocol) {
  if (peer_table == nullptr || local_buffer == nullptr || size < 1 || size > SS_MAX_RANKS ||
      rank < 0 || rank >= size || region_bytes < 16 || region_bytes % 16 != 0 ||
      (protocol != SS_PROTO_LL16 && protocol != SS_PROTO_LL8))
    return static_cast<int>(cudaErrorInvalidValue);
  return 0;
}

template <int W>
int launch_all_reduce(const void* x, void* out, int64_t n, int dtype, const LLArgs& a, int sms,
                      cudaStream_t s) {
  return dispatch_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    using Packet = typename LL<W>::Packet;
    constexpr int64_t kElems = W * 4 / sizeof(T);
    constexpr int kThreads = 512;
    const int64_t per_launch = a.region_bytes / static_cast<int64_t>(sizeof(Packet)) * kElems;
    const T* xs = static_cast<const T*>(x);
    T* os = static_cast<T*>(out);
    for (int64_t off = 0; off < n; off += per_launch) {
      const int64_t cnt = n - off < per_launch ? n - off : per_launch;
      const int64_t npk = (cnt + kElems - 1) / kElems;
      const int64_t want = (npk + kThreads - 1) / kThreads;
      const int grid = static_cast<int>(want < sms ? want : sms);
      ll_all_reduce_kernel<T, W><<<grid, kThreads, 0, s>>>(xs + off, os + off, cnt, a);
      const int st = launch_status();
      if (st != 0) return st;
    }
    return 0;
  });
}

template <int W>
int launch_gemm_all_reduce(const void* x, const void* w, const void* bias, void* out, int M,
                           int N, int K, int dtype, const LLArgs& a, int sms, cudaStream_t s) {
  const int esize = dtype_size(dtype);
  const int ppc = (M + W - 1) / W;
  const int64_t region_packets = a.region_bytes / static_cast<int64_t>(sizeof(typename LL<W>::Packet));
  // columns per launch: whole tiles that fit one inbox region
  const int64_t cols = region_packets / ppc / kGemmTileN * kGemmTileN;
  if (cols < kGemmTileN) return static_cast<int>(cudaErrorInvalidValue);  // capacity too small
  const bool vec_ok = (reinterpret_cast<uintptr_t>(w) % 16 == 0) &&
                      ((static_cast<int64_t>(K) * esize) % 16 == 0);
  return dispatch_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    return dispatch_m(M, [&](auto mt) {
      constexpr int MT = decltype(mt)::value;
      const T* xs = static_cast<const T*>(x);
      const T* ws = static_cast<const T*>(w);
      const T* bs = static_cast<const T*>(bias);
      T* os = static_cast<T*>(out);
      for (int64_t n0 = 0; n0 < N; n0 += cols) {
        const int nc = static_cast<int>(N - n0 < cols ? N - n0 : cols);
        const int tiles = (nc + kGemmTileN - 1) / kGemmTileN;
        const int grid = tiles < sms ? tiles : sms;
        ll_gemm_all_reduce_kernel<T, MT, W><<<grid, kGemvThreads, 0, s>>>(
            xs, ws + n0 * K, bs != nullptr ? bs + n0 : nullptr, os + n0, M, nc, K, N, vec_ok, a);
        const int st = launch_status();
        if (st != 0) return st;
      }
      return 0;
    });
  });
}

}  // namespace
}  // namespace cuda
}  // namespace swiftspec

using namespace swiftspec::cuda;

extern "C" SS_API int ss_ll_flag_bits(void) { return static_cast<int>(swiftspec::ll::kFlagBits); }

extern "C" SS_API int64_t ss_ll_buffer_bytes(int size, int64_t region_bytes) {
  if (size < 1 || region_bytes < 0) return -1;
  return SS_LL_HEADER_BYTES + static_cast<int64_t>(swiftspec::ll::kNumSlots) * size * region_bytes;
}

extern "C" SS_API int ss_ipc_alloc(int64_t bytes, void** dev_ptr, void* handle_out) {
  if (bytes <= 0 || dev_ptr == nullptr || handle_out == nullptr)
    return static_cast<int>(cudaErrorInvalidValue);
  static_assert(sizeof(cudaIpcMemHandle_t) == SS_IPC_HANDLE_BYTES, "IPC handle size");
  *dev_ptr = nullptr;
  void* p = nullptr;
  cudaError_t err = cudaMalloc(&p, static_cast<size_t>(bytes));
  if (err != cudaSuccess) return static_cast<int>(err);
  // Zero flags are "never written" (flag_of_epoch is never 0). Synchronize so the zeros are in
  // memory before the handle leaves this process: a peer may push packets right after opening it.
  err = cudaMemset(p, 0, static_cast<size_t>(bytes));
  if (err == cudaSuccess) err = cudaDeviceSynchronize();
  cudaIpcMemHandle_t h;
  if (err == cudaSuccess) err = cudaIpcGetMemHandle(&h, p);
  if (err != cudaSuccess) {
    cudaFree(p);
    return static_cast<int>(err);
  }
  memcpy(handle_out, &h, sizeof(h));
  *dev_ptr = p;
  return 0;
}

extern "C" SS_API int ss_ipc_open(const void* handle, void** dev_ptr) {
  if (handle == nullptr || dev_ptr == nullptr) return static_cast<int>(cudaErrorInvalidValue);
  cudaIpcMemHandle_t h;
  memcpy(&h, handle, sizeof(h));
  *dev_ptr = nullptr;
  return static_cast<int>(cudaIpcOpenMemHandle(dev_ptr, h, cudaIpcMemLazyEnablePeerAccess));
}

extern "C" SS_API int ss_ipc_close(void* dev_ptr) {
  if (dev_ptr == nullptr) return static_cast<int>(cudaErrorInvalidValue);
  return static_cast<int>(cudaIpcCloseMemHandle(dev_ptr));
}

extern "C" SS_API int ss_free(void* dev_ptr) { return static_cast<int>(cudaFree(dev_ptr)); }

extern "C" SS_API int ss_ll_read_epoch(const void* local_buffer, uint64_t* epoch) {
  if (local_buffer == nullptr || epoch == nullptr) return static_cast<int>(cudaErrorInvalidValue);
  unsigned long long e = 0;
  const cudaError_t err = cudaMemcpy(&e, local_buffer, sizeof(e), cudaMemcpyDeviceToHost);
  *epoch = e;
  return static_cast<int>(err);
}

extern "C" SS_API int ss_ll_all_reduce(const void* x, void* out, int64_t n, int dtype, int protocol,
                                       const void* peer_table, void* local_buffer, int rank,
                                       int size, int64_t region_bytes, int64_t timeout_ns,
                                       void* stream) {
  int st = check_group(peer_table, local_buffer, rank, size, region_bytes, protocol);
  if (st != 0) return st;
  if (n < 0 || dtype_size(dtype) == 0 || timeout_ns <= 0)
    return static_cast<int>(cudaErrorInvalidValue);
  if (n == 0) return 0;  // every rank sees the same n, so skipping keeps the epochs in step
  if (x == nullptr || out == nullptr) return static_cast<int>(cudaErrorInvalidValue);
  int sms = 0;
  const cudaError_t err = current_sm_count(&sms);
  if (err != cudaSuccess) return static_cast<int>(err);
  const LLArgs a{static_cast<void* const*>(peer_table), static_cast<char*>(local_buffer), rank,
                 size, region_bytes, timeout_ns};
  auto s = static_cast<cudaStream_t>(stream);
  return protocol == SS_PROTO_LL16 ? launch_all_reduce<2>(x, out, n, dtype, a, sms, s)
                                   : launch_all_reduce<1>(x, out, n, dtype, a, sms, s);
}

extern "C" SS_API int ss_ll_gemm_all_reduce(const void* x, const void* w, const void* bias,
                                            void* out, int M, int N, int K, int dtype, int protocol,
                                            const void* peer_table, void* local_buffer, int rank,
                                            int size, int64_t region_bytes, int64_t timeout_ns,
                                            void* stream) {
  int st = check_group(peer_table, local_buffer, rank, size, region_bytes, protocol);
  if (st != 0) return st;
  if (M < 0 || M > SS_MAX_M || N < 0 || K < 0 || dtype_size(dtype) == 0 || timeout_ns <= 0)
    return static_cast<int>(cudaErrorInvalidValue);
  if (M == 0 || N == 0) return 0;
  if (x == nullptr || w == nullptr || out == nullptr) return static_cast<int>(cudaErrorInvalidValue);
  int sms = 0;
  const cudaError_t err = current_sm_count(&sms);
  if (err != cudaSuccess) return static_cast<int>(err);
  const LLArgs a{static_cast<void* const*>(peer_table), static_cast<char*>(local_buffer), rank,
                 size, region_bytes, timeout_ns};
  auto s = static_cast<cudaStream_t>(stream);
  return protocol == SS_PROTO_LL16
             ? launch_gemm_all_reduce<2>(x, w, bias, out, M, N, K, dtype, a, sms, s)
             : launch_gemm_all_reduce<1>(x, w, bias, out, M, N, K, dtype, a, sms, s);
}
