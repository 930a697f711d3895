// GGUF block formats read in place by the quantized skinny GEMM (quant_gemm*.cpp).
//
// The kernels read the weights exactly as llama.cpp's GGUF stores them (no repacking): a weight
// row of K values is K / QK blocks of `block_bytes` each (ggml-common.h's block_q4_0, block_q5_0,
// block_q8_0, block_q4_K, block_q5_K, block_q6_K). Activations are quantized once per call to int8,
// paired with the weight type as llama.cpp pairs them: Q8_0 (one fp32 scale per 32 values) for
// the 32-value types, Q8_K (one fp32 scale per 256 values plus the sums of every 16 values, for
// the min term) for the 256-value super-block types.
//
// Every ISA (scalar, AVX2, AVX-512 VNNI) computes the same integer lanes and applies the same
// float operations in the same order, so the three give bit-identical results (tested), and a
// row's result depends only on that row's activations and the weights: never on the other rows,
// the column range or the thread count (batch invariance). Per column and row:
//
//   lanes[l] (l = 0..7): int32 sums of 4 consecutive products of each 32-value group, times the
//                        group's integer sub-scale, summed over the groups of one (super-)block;
//   mins[l]:             K types: m[2l] * xsum[2l] + m[2l+1] * xsum[2l+1], with m the block's
//                        mins per 16 values and xsum the sums of 16 activations;
//   facc[l] = fma(float(lanes[l]), d * da, facc[l]), then fma(-float(mins[l]), dmin * da, facc[l])
//   y       = hsum8(facc) = ((f0+f4)+(f2+f6)) + ((f1+f5)+(f3+f7)).
//
// This header has no ATen dependency: the ISA files include it under their own `#pragma GCC
// target`, so nothing compiled for AVX-512 can leak into code that runs on other CPUs.
#pragma once

#include <cstdint>
#include <cstring>

namespace swiftspec {
namespace quant {

// ggml type ids (ggml.h enum ggml_type) of the formats with a kernel, and kAWQ4, ours (outside
// ggml's range): an AWQ int4 group repacked per 32 values at load (swiftspec/awq.py), 20 bytes:
// fp16 scale d, uint8 zero z (0..15), one reserved byte, then 16 bytes of nibbles in Q4_0's order
// (value l < 16: low nibble of byte l, value 16 + l: its high nibble); w = d * (q - z), exact.
enum GgmlType : int { kQ4_0 = 2, kQ5_0 = 6, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14, kAWQ4 = 200 };

// Values per block: 256 for the K (super-block) types, 32 for the others.
static inline int block_values(int type) { return type >= kQ4_K && type <= kQ6_K ? 256 : 32; }

// Bytes per block, 0 for a type without a kernel.
static inline int block_bytes(int type) {
  switch (type) {
    case kQ4_0: return 18;
    case kQ5_0: return 22;
    case kQ8_0: return 34;
    case kQ4_K: return 144;
    case kQ5_K: return 176;
    case kQ6_K: return 210;
    case kAWQ4: return 20;
    default: return 0;
  }
}

static inline bool is_k_type(int type) { return type >= kQ4_K && type <= kQ6_K; }

// IEEE half -> float (exact), without F16C so the scalar path runs anywhere.
static inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: normalize
      int e = -1;
      do {
        ++e;
        man <<= 1;
      } while ((man & 0x400u) == 0);
      bits = sign | (static_cast<uint32_t>(127 - 15 - e) << 23) | ((man & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  __builtin_memcpy(&f, &bits, 4);
  return f;
}

static inline float load_f16(const uint8_t* p) {
  uint16_t h;
  __builtin_memcpy(&h, p, 2);
  return f16_to_f32(h);
}

// Q4_K / Q5_K: the 6-bit scale and min of sub-block j (0..7) from the 12 packed bytes
// (llama.cpp's get_scale_min_k4).
static inline void k4_scale_min(const uint8_t* q, int j, int* sc, int* mn) {
  if (j < 4) {
    *sc = q[j] & 63;
    *mn = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// One call's operands. y[m, n] = sum_k dequant(w)[n, k] * x[m, k] for m < M, with x given as
// int8 values xq [M, K], their block scales xd [M, K / QK] (QK = block_values(type)) and, for the
// K types, the sums of every 16 values xs [M, K / 16].
struct Problem {
  int type = 0;
  int64_t M = 0, K = 0;
  const uint8_t* w = nullptr;  // [N, row_bytes]
  int64_t row_bytes = 0;
  const int8_t* xq = nullptr;
  const float* xd = nullptr;
  const int16_t* xs = nullptr;
};

// Columns [n0, n1) for all M rows: out[m * ldo + (n - n0)] (fp32). One per ISA; the caller picks
// by the CPU's features at run time (quant_gemm.cpp).
void gemm_scalar(const Problem& p, int64_t n0, int64_t n1, float* out, int64_t ldo);
void gemm_avx2(const Problem& p, int64_t n0, int64_t n1, float* out, int64_t ldo);
void gemm_avx512vnni(const Problem& p, int64_t n0, int64_t n1, float* out, int64_t ldo);

}  // namespace quant
}  // namespace swiftspec
