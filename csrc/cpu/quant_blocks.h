// GGUF block formats read in place by the quantized skinny GEMM (quant_gemm*.cpp).
//
// The kernels read the weights exactly as llama.cpp's GGUF stores them (no repacking): a weight
// row of K values is K / QK blocks of `block_bytes` each (ggml-common.h's block_q4_0, block_q5_0,
// block_q8_0, block_q4_K, block_q5_K, block_q6_K). Activations are quantized once per call to int8,
// paired with the weight type as llama.cpp pairs them: Q8_0 (one fp32 scale per 32 values) for
// the 32-value types, Q8_K (one fp32 scale per 256 values plus the sums of every 16 values, for
// the min term) for the 256-value super-block types.
//
// Every ISA (scalar, AVX2, AVX-512 VNNI) computes the same exact integers and applies the same
// float operations in the same order, so the three give bit-identical results (tested), and a
// row's result depends only on that row's activations and the weights: never on the other rows,
// the column range or the thread count (batch invariance). Per column and row, y starts at 0 and
// takes, block after block, the block's exact int32 sums:
//
//   32-value types: isum = sum_l (q_l - z) * x_l (z: 8 for Q4_0, 16 for Q5_0, 0 for Q8_0, the
//                   block's own for AWQ4), then y = fma(float(isum), d * da, y);
//   K types:        isum = sum_j sc_j * sum_l q * x and msum = sum_i m_i * xsum_i (m: the mins
//                   per 16 or 32 values; Q6_K: its scales, for the -32 offset), then
//                   y = fma(float(isum), d * da, y) and y = fma(-float(msum), dmin * da, y)
//                   (Q6_K: dmin = 32 * d).
//
// Q4_K, Q6_K and the 32-value types also come in an 8-row interleaved layout (type | kX8; and a 16-row one,
// type | kX16, x16_source, for the 512-bit kernel; made once at load by
// interleave_x8): every group of 8 rows is stored as one run of blocks of 8 * block_bytes bytes
// that holds exactly the bytes of the 8 rows' blocks, permuted (x8_source) so that one 32-byte
// load gives 4 consecutive quant bytes of each of the 8 rows. The SIMD kernels then keep one
// output column per int32 lane, with no horizontal sums; the arithmetic above is unchanged, so
// both layouts give the same bits (the layout follows llama.cpp's repack.cpp idea of interleaved
// rows; the byte order is ours).
//
// This header has no ATen dependency: the ISA files include it under their own `#pragma GCC
// target`, so nothing compiled for AVX-512 can leak into code that runs on other CPUs.
#pragma once

#include <cstdint>
#include <cstring>

namespace swiftspec {
namespace quant {

// ggml type ids (ggml.h enum ggml_type) of the formats with a kernel, and kAWQ4, ours (outside
// ggml's range): an AWQ int4 group repacked per 32 values at load (swiftspec/weights/awq.py), 20 bytes:
// fp16 scale d, uint8 zero z (0..15), one reserved byte, then 16 bytes of nibbles in Q4_0's order
// (value l < 16: low nibble of byte l, value 16 + l: its high nibble); w = d * (q - z), exact.
enum GgmlType : int { kQ4_0 = 2, kQ5_0 = 6, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14, kAWQ4 = 200 };

// The 8-row interleaved layout flag (or-ed into a type id: Q4_K | kX8 = 268). Q4_K, Q6_K and the
// 32-value types have it; Q5_K (not in the default pair) stays plain.
constexpr int kX8 = 0x100;
// The 16-row interleaved layout flag (Q4_K | kX16 = 524): the same types, read by the 512-bit
// kernel (gemm_avx512vnni_512) and the scalar one; x16_source says where its bytes come from.
constexpr int kX16 = 0x200;
static inline bool is_x8(int type) { return (type & kX8) != 0; }
static inline bool is_x16(int type) { return (type & kX16) != 0; }
static inline int base_type(int type) { return type & ~(kX8 | kX16); }
// rows per interleaved group: 16, 8, or 1 for the plain layout
static inline int group_rows(int type) { return is_x16(type) ? 16 : (is_x8(type) ? 8 : 1); }

// Values per block: 256 for the K (super-block) types, 32 for the others (either layout).
static inline int block_values(int type) {
  type = base_type(type);
  return type >= kQ4_K && type <= kQ6_K ? 256 : 32;
}

// Bytes per block, 0 for a type without a kernel (in that layout).
static inline int block_bytes(int type) {
  if (group_rows(type) > 1 && base_type(type) == kQ5_K) return 0;  // no interleaved layout (has_x8)
  if (is_x8(type) && is_x16(type)) return 0;
  switch (base_type(type)) {
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

static inline bool is_k_type(int type) { return block_values(type) == 256; }

// Whether a (plain) block type has the interleaved layout.
static inline bool has_x8(int base) { return base != kQ5_K && block_bytes(base) > 0; }

// Interleaved layout of one block of a group of 8 rows (8 * bb bytes): byte i comes from byte
// `off` of row `c`'s plain block, returned as c * bb + off (-1 for a type without the layout).
// 32-byte "registers" hold 4 bytes of each row: bytes 4c..4c+3 are row c's.
//   Q4_K (1152): [0,16) d of rows 0-7 (fp16) | [16,32) dmin | [32,128) the scale bytes as 3
//     registers of 32-bit words (word w of row c: scale bytes 4w..4w+3) | [128,1152) qs as 32
//     registers, register 8 * cc + s = qs[32 cc + 4 s .. +3] (low nibbles: values 64 cc + 4 s + t
//     of sub-block 2 cc, high nibbles: sub-block 2 cc + 1).
//   Q4_0 (144): [0,16) d | [16,144) qs as 4 registers, register s = qs[4 s .. 4 s + 3] (low
//     nibbles: values 4 s + t, high nibbles: values 16 + 4 s + t).
//   AWQ4 (160): [0,16) d | [16,24) the zeros z of rows 0-7 | [24,32) their reserved bytes |
//     [32,160) qs as Q4_0's.
//   Q5_0 (176): [0,16) d | [16,48) qh, one register (row c's 4 bytes at 4c, the 32 bits of its
//     little-endian word permuted by q5_x_bit) | [48,176) qs as Q4_0's.
//   Q8_0 (272): [0,16) d | [16,272) qs as 8 registers, register s = qs[4 s .. 4 s + 3] (values
//     4 s + t).
//   Q6_K (1680): [0,16) d | [16,144) the 16 int8 scales as 4 registers (word w of row c: scales
//     4w..4w+3) | [144,1680) 4 chunks of 384 bytes in the kernel's reading order, chunk 2 h + q
//     (half h, quarter q; e = 0..3): qh[4 k .. 4 k + 3] for k = 8 h + 4 q + e, then ql registers
//     k = 16 h + 4 q + e, then k = 16 h + 8 + 4 q + e (read in one forward pass: the weights
//     stream from DRAM at the rate of the other types; ql and qh in two regions read
//     alternately streamed at less than half of it).
static inline int x8_source(int base, int i) {
  if (base == kQ6_K) {
    constexpr int bb = 210;
    if (i < 16) return i / 2 * bb + 208 + i % 2;
    if (i < 144) return (i - 16) % 32 / 4 * bb + 192 + 4 * ((i - 16) / 32) + (i - 16) % 4;
    const int chunk = (i - 144) / 384, o = (i - 144) % 384, sec = o / 128, r = o % 32;
    const int k = (sec == 0 ? 8 : 16) * (chunk / 2) + (sec == 2 ? 8 : 0) + 4 * (chunk % 2) + o % 128 / 32;
    return r / 4 * bb + (sec == 0 ? 128 : 0) + 4 * k + r % 4;
  }
  if (base == kQ4_K) {
    constexpr int bb = 144;
    if (i < 32) return (i % 16) / 2 * bb + (i < 16 ? 0 : 2) + i % 2;
    if (i < 128) {
      const int r = (i - 32) % 32, w = (i - 32) / 32;
      return r / 4 * bb + 4 + 4 * w + r % 4;
    }
    const int reg = (i - 128) / 32, r = (i - 128) % 32;
    return r / 4 * bb + 16 + 32 * (reg / 8) + 4 * (reg % 8) + r % 4;
  }
  if (base == kQ4_0 || base == kQ5_0 || base == kQ8_0 || base == kAWQ4) {
    const int bb = block_bytes(base);
    const int head = base == kAWQ4 || base == kQ5_0 ? (base == kQ5_0 ? 48 : 32) : 16;  // before qs
    const int qs = base == kAWQ4 ? 4 : (base == kQ5_0 ? 6 : 2);                       // qs in a plain block
    if (i < 16) return i / 2 * bb + i % 2;
    if (i < head && base == kAWQ4) return (i % 8) * bb + (i < 24 ? 2 : 3);
    if (i < head) return (i - 16) / 4 * bb + 2 + (i - 16) % 4;  // Q5_0's qh
    const int reg = (i - head) / 32, r = (i - head) % 32;
    return r / 4 * bb + qs + 4 * reg + r % 4;
  }
  return -1;
}

// Q5_0's fifth bits in the interleaved layouts: the bit of value l = 16 h + 4 u + t (h = 1: the
// high nibbles) moves from bit l of the row's qh word to bit 8 t + 2 u + h, so byte t of the word
// holds the fifth bits of the values in byte t of every quant register u: a kernel moves them to
// bit 4 with one 16-bit shift by 4 - 2 u - h and one mask, with no byte shuffle (the bytes of the
// word are still those x8_source / x16_source place; interleave permutes the bits after them).
static inline int q5_x_bit(int l) { return 8 * (l % 4) + 2 * (l % 16 / 4) + l / 16; }
static inline uint32_t q5_qh_to_x(uint32_t qh) {
  uint32_t r = 0;
  for (int l = 0; l < 32; ++l) r |= ((qh >> l) & 1u) << q5_x_bit(l);
  return r;
}
static inline uint32_t q5_qh_from_x(uint32_t x) {
  uint32_t r = 0;
  for (int l = 0; l < 32; ++l) r |= ((x >> q5_x_bit(l)) & 1u) << l;
  return r;
}
// the little-endian 32-bit word at p (a qh word), through f (q5_qh_to_x or q5_qh_from_x)
static inline void permute_word(uint8_t* p, uint32_t (*f)(uint32_t)) {
  uint32_t v;
  __builtin_memcpy(&v, p, 4);
  v = f(v);
  __builtin_memcpy(p, &v, 4);
}

// Bytes before the first 32-byte register in an 8-row group block: the 16-byte fields of 8 fp16
// (or 8 + 8 bytes) values: d and dmin (Q4_K), d and the zeros (AWQ4), d alone (the others).
static inline int x8_header_bytes(int base) { return base == kQ4_K || base == kAWQ4 ? 32 : 16; }

// 16-row interleaved layout: the 8-row group blocks of rows 0-7 (half h = 0) and 8-15 (h = 1)
// merged field by field, so that every load of the 512-bit kernel is one contiguous read: the
// byte at offset r of a field of u bytes (u = 16 in the header, 32 for the registers) that starts
// at f in half h's 8-row block goes to 2 f + h u + r. A field starting at f in the 8-row block
// starts at 2 f here, rows 0-7's part first.
// Returns the byte's source as row * bb + offset in the rows' plain blocks (16 rows), -1 for a type
// without the layout.
static inline int x16_source(int base, int i) {
  const int hdr = x8_header_bytes(base);
  int h, o;
  if (i < 2 * hdr) {
    h = i % 32 / 16;
    o = i / 32 * 16 + i % 16;
  } else {
    const int j = i - 2 * hdr;
    h = j % 64 / 32;
    o = hdr + j / 64 * 32 + j % 32;
  }
  const int src = x8_source(base, o);
  return src < 0 ? -1 : 8 * h * block_bytes(base) + src;
}

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
// int8 values xq [M, K], their block scales xd [M, K / QK] (QK = block_values(type)), the sums of
// every 32 values xs32 [M, K / 32] and, for the K types, of every 16 values xs [M, K / 16].
struct Problem {
  int type = 0;
  int64_t M = 0, K = 0;
  const uint8_t* w = nullptr;  // [N, row_bytes]
  int64_t row_bytes = 0;
  const int8_t* xq = nullptr;
  const float* xd = nullptr;
  const int16_t* xs = nullptr;
  const int16_t* xs32 = nullptr;
  bool prefetch_x8 = false;  // the 8-row layout's kernels prefetch ahead too (AMD CPUs; quant_gemm_x8.h)
};

// Columns [n0, n1) for all M rows: out[m * ldo + (n - n0)] (fp32). One per ISA; the caller picks
// by the CPU's features at run time (quant_gemm.cpp).
void gemm_scalar(const Problem& p, int64_t n0, int64_t n1, float* out, int64_t ldo);
void gemm_avx2(const Problem& p, int64_t n0, int64_t n1, float* out, int64_t ldo);
void gemm_avx512vnni(const Problem& p, int64_t n0, int64_t n1, float* out, int64_t ldo);
void gemm_avx512vnni_512(const Problem& p, int64_t n0, int64_t n1, float* out, int64_t ldo);  // 512-bit x8

// M rows of x [M, K] fp32 -> int8 blocks of qk (32 or 256) values: q [M, K], the block scales d
// [M, K/qk] (max|x| / 127), the sums of every 16 values s16 [M, K/16] (qk = 256 only; else
// unused) and of every 32, s32 [M, K/32]. Round half to even. One per ISA, the same bits
// (quant_gemm_scalar.cpp, quant_act_simd.h); the caller picks with the GEMM kernel.
void quantize_scalar(const float* x, int64_t M, int64_t K, int qk, int8_t* q, float* d, int16_t* s16, int16_t* s32);
void quantize_avx2(const float* x, int64_t M, int64_t K, int qk, int8_t* q, float* d, int16_t* s16, int16_t* s32);
void quantize_avx512(const float* x, int64_t M, int64_t K, int qk, int8_t* q, float* d, int16_t* s16, int16_t* s32);

}  // namespace quant
}  // namespace swiftspec
