// Portable scalar kernel of the quantized skinny GEMM (quant_blocks.h): the reference the SIMD
// kernels must match bit for bit, and the path for CPUs without AVX2. It forms the same exact
// integers per block and applies the same float operations in the same order. The 8-row
// interleaved layout is read by gathering a row's plain block back (x8_source).
#include <algorithm>
#include <cmath>

#include "quant_blocks.h"

namespace swiftspec {
namespace quant {
namespace {

// One block of one weight row decoded: up to 8 groups of 32 integer values, and per group the
// scales of its two 16-value halves (32-value types: one group, scale 1, signed values).
struct Decoded {
  int ngroups = 0;
  int q[8][32];
  int s_lo[8], s_hi[8];
  float d = 0.f, dmin = 0.f;  // dmin: the min term's block coefficient (0: none)
  int mn[16];                 // per 16 values (K types)
};

static void decode(int type, const uint8_t* blk, Decoded& o) {
  switch (type) {
    case kQ4_K:
    case kQ5_K: {
      const bool q5 = type == kQ5_K;
      o.ngroups = 8;
      o.d = load_f16(blk);
      o.dmin = load_f16(blk + 2);
      const uint8_t* qh = blk + 16;
      const uint8_t* qs = blk + (q5 ? 48 : 16);
      for (int g = 0; g < 8; ++g) {
        int sc, mn;
        k4_scale_min(blk + 4, g, &sc, &mn);
        o.s_lo[g] = o.s_hi[g] = sc;
        o.mn[2 * g] = o.mn[2 * g + 1] = mn;
        for (int l = 0; l < 32; ++l) {
          const int byte = qs[32 * (g / 2) + l];
          int v = (g & 1) ? (byte >> 4) : (byte & 0xF);
          if (q5) v |= ((qh[l] >> g) & 1) << 4;
          o.q[g][l] = v;
        }
      }
      break;
    }
    case kQ6_K: {
      o.ngroups = 8;
      o.d = load_f16(blk + 208);
      o.dmin = 32.f * o.d;
      const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
      for (int g = 0; g < 8; ++g) {
        const int h = g / 4, k = g % 4;
        const uint8_t* ql = blk + 64 * h + (k & 1) * 32;
        const uint8_t* qh = blk + 128 + 32 * h;
        o.s_lo[g] = sc[8 * h + 2 * k];
        o.s_hi[g] = sc[8 * h + 2 * k + 1];
        for (int l = 0; l < 32; ++l) {
          const int nib = (k >= 2) ? (ql[l] >> 4) : (ql[l] & 0xF);
          o.q[g][l] = nib | (((qh[l] >> (2 * k)) & 3) << 4);
        }
      }
      for (int j = 0; j < 16; ++j) o.mn[j] = sc[j];
      break;
    }
    default: {  // Q4_0, Q5_0, Q8_0, AWQ4: signed values, no min term
      o.ngroups = 1;
      o.d = load_f16(blk);
      o.dmin = 0.f;
      o.s_lo[0] = o.s_hi[0] = 1;
      if (type == kQ8_0) {
        for (int l = 0; l < 32; ++l) o.q[0][l] = static_cast<int8_t>(blk[2 + l]);
      } else {
        const bool q5 = type == kQ5_0, awq = type == kAWQ4;
        const uint8_t* qs = blk + (q5 ? 6 : (awq ? 4 : 2));
        const int zero = awq ? blk[2] : (q5 ? 16 : 8);  // AWQ4: the block's own zero point
        uint32_t qh = 0;
        if (q5) __builtin_memcpy(&qh, blk + 2, 4);
        for (int l = 0; l < 32; ++l) {
          int v = l < 16 ? (qs[l] & 0xF) : (qs[l - 16] >> 4);
          if (q5) v |= ((qh >> l) & 1) << 4;
          o.q[0][l] = v - zero;
        }
      }
    }
  }
}

// Where row c's plain block byte `off` lies in an interleaved group block of `base` blocks
// (`rows` = 8 or 16 rows per group): inverse of x8_source / x16_source, c * bb + off -> index.
static const int* x_inverse(int base, int rows) {
  static constexpr int kTypes[] = {kQ4_0, kQ5_0, kQ8_0, kQ4_K, kQ6_K, kAWQ4};
  static int tables[2][6][16 * 256];
  static const bool ready = [] {
    for (int k = 0; k < 6; ++k)
      for (int i = 0; i < 16 * block_bytes(kTypes[k]); ++i) {
        if (i < 8 * block_bytes(kTypes[k])) tables[0][k][x8_source(kTypes[k], i)] = i;
        tables[1][k][x16_source(kTypes[k], i)] = i;
      }
    return true;
  }();
  (void)ready;
  for (int k = 0; k < 6; ++k)
    if (kTypes[k] == base) return tables[rows == 16 ? 1 : 0][k];
  return nullptr;
}

}  // namespace

void gemm_scalar(const Problem& p, int64_t n0, int64_t n1, float* out, int64_t ldo) {
  const int base = base_type(p.type);
  const int qk = block_values(base);
  const int bb = block_bytes(base);
  const int64_t nb = p.K / qk;
  const bool ktype = is_k_type(base);
  const int gr = group_rows(p.type);  // rows per interleaved group (1: plain)
  const int* inv = gr > 1 ? x_inverse(base, gr) : nullptr;
  Decoded dec;
  uint8_t plain[256];
  for (int64_t n = n0; n < n1; ++n) {
    // the row's blocks: in place, or gathered from its interleaved group
    const uint8_t* wrow = p.w + (n / gr) * gr * p.row_bytes;
    const int c = static_cast<int>(n % gr);
    // every row's value, kept across the blocks of this column
    float y[16];
    for (int64_t m0 = 0; m0 < p.M; m0 += 16) {
      const int64_t mr = p.M - m0 < 16 ? p.M - m0 : 16;
      for (int64_t i = 0; i < mr; ++i) y[i] = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = wrow + b * bb * gr;
        if (inv != nullptr) {
          for (int off = 0; off < bb; ++off) plain[off] = blk[inv[c * bb + off]];
          if (base == kQ5_0) permute_word(plain + 2, q5_qh_from_x);  // the interleaved qh bits (q5_x_bit)
          blk = plain;
        }
        decode(base, blk, dec);
        for (int64_t i = 0; i < mr; ++i) {
          const int64_t m = m0 + i;
          const int8_t* x = p.xq + m * p.K + b * qk;
          const float da = p.xd[m * nb + b];
          int isum = 0;
          for (int g = 0; g < dec.ngroups; ++g) {
            int lo = 0, hi = 0;  // the group's two 16-value halves
            for (int l = 0; l < 16; ++l) lo += dec.q[g][l] * x[32 * g + l];
            for (int l = 16; l < 32; ++l) hi += dec.q[g][l] * x[32 * g + l];
            isum += lo * dec.s_lo[g] + hi * dec.s_hi[g];
          }
          y[i] = __builtin_fmaf(static_cast<float>(isum), dec.d * da, y[i]);
          if (!ktype) continue;
          const int16_t* xs = p.xs + m * (p.K / 16) + b * 16;
          int msum = 0;
          for (int j = 0; j < 16; ++j) msum += dec.mn[j] * xs[j];
          y[i] = __builtin_fmaf(-static_cast<float>(msum), dec.dmin * da, y[i]);
        }
      }
      for (int64_t i = 0; i < mr; ++i) out[(m0 + i) * ldo + (n - n0)] = y[i];
    }
  }
}

// Row-wise: d = max|x| / 127 over each block of qk values, q = round-half-even(x * (1 / d)), 0 for
// an all-zero block. Bit-identical to swiftspec.ops.quant.quantize_activations.
void quantize_scalar(const float* x, int64_t M, int64_t K, int qk, int8_t* q, float* d, int16_t* s16, int16_t* s32) {
  const int64_t nb = K / qk;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* v = x + m * K + b * qk;
      float amax = 0.f;
      for (int i = 0; i < qk; ++i) amax = std::max(amax, std::fabs(v[i]));
      const float db = amax / 127.f;
      const float id = db != 0.f ? 1.f / db : 0.f;
      d[m * nb + b] = db;
      int8_t* qb = q + m * K + b * qk;
      for (int i = 0; i < qk; ++i) qb[i] = static_cast<int8_t>(std::nearbyint(v[i] * id));
      for (int j = 0; j < qk / 32; ++j) {
        int sum32 = 0;
        for (int i = 0; i < 32; ++i) sum32 += qb[32 * j + i];
        s32[m * (K / 32) + b * (qk / 32) + j] = static_cast<int16_t>(sum32);
      }
      if (qk == 256) {
        for (int j = 0; j < 16; ++j) {
          int sum = 0;
          for (int i = 0; i < 16; ++i) sum += qb[16 * j + i];
          s16[m * (K / 16) + b * 16 + j] = static_cast<int16_t>(sum);
        }
      }
    }
  }
}

}  // namespace quant
}  // namespace swiftspec
