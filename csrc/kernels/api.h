// C ABI of the CUDA latency kernels (SwiftSpec paper section 3.3).
//
// Everything here is plain C so that swiftspec/ops/cuda.py can call it with ctypes and the .cu files
// never include torch headers (the CI machine has a CPU-only torch and no GPU; the kernels only
// have to compile there). Conventions shared by every function:
//   * pointers are raw device pointers (torch's `tensor.data_ptr()`), row-major and contiguous;
//   * `dtype` is one of the SS_DTYPE_* codes below;
//   * `stream` is a cudaStream_t passed as an opaque pointer (torch.cuda.current_stream().cuda_stream);
//   * the return value is a cudaError_t (0 = success). Launch functions only enqueue work: errors
//     raised while the kernel runs surface at the next synchronizing call, as for any CUDA kernel.
//   * argument errors the host can see (bad sizes, unsupported dtype) return
//     cudaErrorInvalidValue (1) without launching.
#pragma once

#include <stdint.h>

#if defined(__GNUC__)
#define SS_API __attribute__((visibility("default")))
#else
#define SS_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

// dtype codes (same numbering in swiftspec/ops/cuda.py)
#define SS_DTYPE_FLOAT32 0
#define SS_DTYPE_BFLOAT16 1
#define SS_DTYPE_FLOAT16 2

// LL protocol codes for the communicator kernels
#define SS_PROTO_LL16 0  // 16-byte packets, 8 payload bytes (NCCL LL)
#define SS_PROTO_LL8 1   // 8-byte packets, 4 payload bytes (mscclpp LL8)

// Largest M of the skinny GEMM kernels (swiglu, fused GEMM + all-reduce) and the largest number of
// query tokens of tree attention.
#define SS_MAX_M 16
// Largest TP group of the LL communicator (size of the in-kernel peer table).
#define SS_MAX_RANKS 16
// Bytes at the start of every LL buffer reserved for its control block (epoch, arrival counter).
#define SS_LL_HEADER_BYTES 256
// Size of a CUDA IPC memory handle (cudaIpcMemHandle_t).
#define SS_IPC_HANDLE_BYTES 64
// Largest head dim and number of KV splits of tree attention.
#define SS_ATTN_MAX_HEAD_DIM 256
#define SS_ATTN_MAX_SPLITS 64
// Largest row length (hidden size) of the fused RMSNorm.
#define SS_NORM_MAX_H 8192

// ---- runtime.cu -------------------------------------------------------------------------------
// Version of this ABI; bumped whenever a signature below changes.
SS_API int ss_abi_version(void);
// Name and description of a cudaError_t value (static strings; valid without a device).
SS_API const char* ss_error_name(int status);
SS_API const char* ss_error_string(int status);
// Number of visible CUDA devices (cudaGetDeviceCount); no driver / no device gives a nonzero status.
SS_API int ss_device_count(int* count);
// Streaming multiprocessors of the current device (cached per device).
SS_API int ss_sm_count(int* count);

// ---- ll_comm.cu -------------------------------------------------------------------------------
// LL flag width this library was built with (SWIFTSPEC_LL_FLAG_BITS).
SS_API int ss_ll_flag_bits(void);
// Bytes of one LL buffer for `size` ranks and `region_bytes` bytes per (slot, source rank) region:
// SS_LL_HEADER_BYTES + kNumSlots * size * region_bytes.
SS_API int64_t ss_ll_buffer_bytes(int size, int64_t region_bytes);
// cudaMalloc `bytes` on the current device, zero it (synchronously, so peers never see garbage
// flags) and export it: *dev_ptr receives the pointer, handle_out SS_IPC_HANDLE_BYTES bytes.
SS_API int ss_ipc_alloc(int64_t bytes, void** dev_ptr, void* handle_out);
// Map a peer's exported buffer (cudaIpcOpenMemHandle with lazy peer access).
SS_API int ss_ipc_open(const void* handle, void** dev_ptr);
// Unmap a buffer opened with ss_ipc_open.
SS_API int ss_ipc_close(void* dev_ptr);
// cudaFree of a buffer from ss_ipc_alloc.
SS_API int ss_free(void* dev_ptr);
// Synchronously read the epoch counter of the local LL buffer (for tests and diagnostics).
SS_API int ss_ll_read_epoch(const void* local_buffer, uint64_t* epoch);
// In-place capable one-shot all-reduce (sum) of n elements over the group.
//   peer_table: device array of `size` device pointers, entry r = rank r's LL buffer as mapped in
//     this process (own entry = local_buffer);
//   region_bytes: bytes of one (slot, source) inbox region; messages larger than
//     region_bytes / 2 payload bytes are split into several launches (one epoch each);
//   timeout_ns: a spin on a peer's packet longer than this traps the kernel (never hang).
// Result in out (may equal x), sum in rank order 0..size-1 in fp32: identical bits on every rank.
SS_API int ss_ll_all_reduce(const void* x, void* out, int64_t n, int dtype, int protocol,
                            const void* peer_table, void* local_buffer, int rank, int size,
                            int64_t region_bytes, int64_t timeout_ns, void* stream);
// Row-parallel linear fused with the all-reduce: out[M, N] = sum_ranks(x[M, K] @ w[N, K]^T) + bias.
// M <= SS_MAX_M; bias may be NULL; x, w, bias, out share `dtype`; partials are exchanged in fp32.
SS_API int ss_ll_gemm_all_reduce(const void* x, const void* w, const void* bias, void* out, int M,
                                 int N, int K, int dtype, int protocol, const void* peer_table,
                                 void* local_buffer, int rank, int size, int64_t region_bytes,
                                 int64_t timeout_ns, void* stream);

// ---- swiglu.cu --------------------------------------------------------------------------------
// out[M, I] = SiLU(x @ w[:I]^T) * (x @ w[I:]^T); x [M, K], w [2I, K]; 1 <= M <= SS_MAX_M.
SS_API int ss_swiglu(const void* x, const void* w_gate_up, void* out, int M, int K, int I,
                     int dtype, void* stream);

// ---- tree_attention.cu ------------------------------------------------------------------------
// Split-KV plan: number of KV splits and keys per split (a multiple of the key tile) for S keys and
// Hq query heads on the current device; `requested` > 0 forces a split count (clamped to
// [1, SS_ATTN_MAX_SPLITS] and to the number of key tiles).
SS_API int ss_tree_attention_plan(int S, int Hq, int requested, int* num_splits,
                                  int* keys_per_split);
// The auto plan's cap on the split count for Hq query heads on the current device (about two
// blocks per SM over all heads, at most SS_ATTN_MAX_SPLITS): the grid of a launch whose KV length
// is on the device.
SS_API int ss_tree_attention_split_cap(int Hq, int* cap);
// Workspace floats needed for a plan: Hq * num_splits * n * (D + 2); plus Hq int32 counters
// that must be zero before the first launch (the kernel leaves them zero).
SS_API int64_t ss_tree_attention_workspace_floats(int n, int Hq, int D, int num_splits);
// RoPE + KV write + masked split-KV attention with the in-kernel merge (reference.tree_attention).
// q [n, Hq, D]; k_new, v_new [n, Hk, D]; k_cache, v_cache [Hk, C, D]; slots, positions [n] int64;
// cos_table, sin_table [P, D] float32; mask [n, S] bool (1 byte); out [n, Hq * D]. q, k_new, v_new,
// caches and out share `dtype`. Slots outside [0, C) are not written; positions are clamped to
// [0, P). n <= SS_MAX_M, D even and <= SS_ATTN_MAX_HEAD_DIM, Hq % Hk == 0, S <= C.
// kv_len NULL: the plan (num_splits, keys_per_split) is ss_tree_attention_plan's. kv_len a device
// int64 [1] (a CUDA graph's live length, its mask padded to the capacity): keys at or past
// *kv_len are not attended (the caller promises mask[:, *kv_len:] is all false), num_splits is
// the grid's split count and the cap of the plan the kernel makes for *kv_len keys (the auto
// rule of ss_tree_attention_plan; keys_per_split is unused).
SS_API int ss_tree_attention(const void* q, const void* k_new, const void* v_new, void* k_cache,
                             void* v_cache, const int64_t* slots, const int64_t* positions,
                             const float* cos_table, const float* sin_table, const uint8_t* mask,
                             void* out, float* workspace, int* counters, int n, int Hq, int Hk,
                             int D, int C, int S, int P, float scale, int num_splits,
                             int keys_per_split, const int64_t* kv_len, int dtype, void* stream);

// ---- norm.cu ----------------------------------------------------------------------------------
// Fused residual add + RMSNorm (reference.rms_norm): res_out = x + residual (rounded to dtype),
// out = weight * round(res_out * rsqrt(mean(res_out^2) + eps)), statistics in fp32. x, residual,
// out, res_out [rows, H]; weight [H]; one dtype; residual and res_out both NULL for no add.
// 1 <= H <= SS_NORM_MAX_H.
SS_API int ss_rms_norm(const void* x, const void* residual, const void* weight, void* out,
                       void* res_out, int rows, int H, float eps, int dtype, void* stream);

#ifdef __cplusplus
}  // extern "C"
#endif
