// Quantized skinny GEMM on GGUF block weights: the ATen front of quant_gemm_{scalar,avx2,avx512}.cpp
// (the block formats and the arithmetic are in quant_blocks.h).
//
// quant_linear(x, weights, types) computes y = x @ dequant(W).T for a weight given as one or more
// parts (e.g. q, k and v of a fused projection, each with its own block type), all sharing x:
// x's rows are quantized to int8 once per activation format the parts need (Q8_K for the
// 256-value super-block types, Q8_0 for the 32-value ones, llama.cpp's pairing), then each output
// column is one pass over its weight row, dotted with every row of x. Threads split the columns
// (never K), so the result does not depend on the thread count.
//
// The kernel is picked at run time from the CPU's features (cpuid through
// __builtin_cpu_supports), not from the machine that compiled it: AVX-512 VNNI (its 512-bit entry
// point, which also reads the 16-row interleaved layout, where that measured faster:
// cpu_prefers_512), else AVX2 + FMA +
// F16C, else the portable scalar loop; `impl` names one for the tests. That rule, and whether the
// 8-row kernels prefetch (prefetch_rule), hold until set_impl / set_prefetch pick what a
// measurement on this machine chose (swiftspec/ops/tuning.py).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/StringUtil.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif
#include <cstdint>
#include <string>
#include <vector>

#include "cpu_ops.h"
#include "quant_blocks.h"

namespace swiftspec {
namespace quant {
namespace {

bool cpu_has_avx2() {
#if defined(__x86_64__) || defined(__i386__)
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

bool cpu_has_avx512vnni() {
#if defined(__x86_64__) || defined(__i386__)
  return cpu_has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}

// The CPU's family if it is an AMD one (cpuid leaf 1, extended family added), else 0.
unsigned amd_family() {
#if defined(__x86_64__) || defined(__i386__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(0, &a, &b, &c, &d)) return 0;
  const bool amd = b == 0x68747541u && d == 0x69746e65u && c == 0x444d4163u;  // "AuthenticAMD"
  if (!amd || !__get_cpuid(1, &a, &b, &c, &d)) return 0;
  return ((a >> 8) & 0xF) + (((a >> 8) & 0xF) == 0xF ? (a >> 20) & 0xFF : 0);
#else
  return 0;
#endif
}

// AMD family 0x1A and later (Zen 5): 512-bit integer ops at full width, where the 512-bit kernel
// on the 16-row interleaved layout measured faster than the 256-bit one on the 8-row layout at
// every row count of the target's and the draft's forward (bench/LOG.md, "AMD Zen 5, weights
// interleaved by 16 rows"). Elsewhere
// (Zen 4 executes 512-bit ops in two halves; the Intel CPUs were not measured) the 256-bit kernel
// stays first; the engine interleaves by 16 rows only where the dispatched kernel reads that.
bool cpu_prefers_512() { return amd_family() >= 0x1A; }

// Whether the 8-row layout's kernels (avx2, avx512_vnni) prefetch their blocks ahead as the
// 16-row one does, by rule: on AMD CPUs, where that made the AVX2 and the 256-bit VNNI forward
// faster at 1-4 rows on Zen 5; not elsewhere (on an Intel Xeon a prefetch slowed their one-row
// forward; bench/LOG.md, "The 8-row layout prefetches on AMD"). The rule holds until set_prefetch
// (a measurement on this machine: swiftspec/ops/tuning.py) decides.
bool prefetch_rule() {
  static const bool on = amd_family() != 0;
  return on;
}

// -1: the rule, 0: off, 1: on; read once per quant_linear call
std::atomic<int>& prefetch_mode() {
  static std::atomic<int> mode{-1};
  return mode;
}

bool prefetch_x8() {
  const int mode = prefetch_mode().load(std::memory_order_relaxed);
  return mode < 0 ? prefetch_rule() : mode != 0;
}

void set_prefetch(int64_t mode) {
  TORCH_CHECK(mode >= -1 && mode <= 1, "quant_set_prefetch: mode must be -1 (the rule), 0 (off) or 1 (on), got ",
              mode);
  prefetch_mode().store(static_cast<int>(mode), std::memory_order_relaxed);
}

using GemmFn = void (*)(const Problem&, int64_t, int64_t, float*, int64_t);

// The kernels this CPU can run, fastest first (cpuid is read once); "auto" runs the first.
// SWIFTSPEC_QUANT_GEMM=<impl> in the environment, or set_impl, puts another one this CPU runs
// first (ablations; the benchmarks' records say which ran).
// The rule's order alone (no environment, no set_impl): the fallback before a measurement.
const std::vector<std::string>& rule_impls() {
  static const std::vector<std::string> v = [] {
    std::vector<std::string> r;
    if (cpu_has_avx512vnni()) {
      r = {"avx512_vnni", "avx512_vnni_512"};
      if (cpu_prefers_512()) std::swap(r[0], r[1]);
    }
    if (cpu_has_avx2()) r.emplace_back("avx2");
    r.emplace_back("scalar");
    return r;
  }();
  return v;
}

std::vector<std::string>& impls() {
  static std::vector<std::string> v = [] {
    std::vector<std::string> r = rule_impls();
    if (const char* e = std::getenv("SWIFTSPEC_QUANT_GEMM")) {
      const auto it = std::find(r.begin(), r.end(), std::string(e));
      if (it != r.end()) std::rotate(r.begin(), it, it + 1);
    }
    return r;
  }();
  return v;
}

void set_impl(const std::string& name) {
  std::vector<std::string>& r = impls();
  const auto it = std::find(r.begin(), r.end(), name);
  TORCH_CHECK(it != r.end(), "quant_set_impl: '", name, "' is not one this CPU runs (", c10::Join(", ", r), ")");
  std::rotate(r.begin(), it, it + 1);
}

GemmFn kernel(const std::string& name) {
  const std::string n = name == "auto" ? impls().front() : name;
  if (n == "avx512_vnni" || n == "avx512_vnni_512") {
    TORCH_CHECK(cpu_has_avx512vnni(), "quant_linear: this CPU lacks AVX-512 VNNI");
    return n == "avx512_vnni" ? gemm_avx512vnni : gemm_avx512vnni_512;
  }
  if (n == "avx2") {
    TORCH_CHECK(cpu_has_avx2(), "quant_linear: this CPU lacks AVX2/FMA");
    return gemm_avx2;
  }
  TORCH_CHECK(n == "scalar", "quant_linear: unknown impl '", name,
              "' (auto, scalar, avx2, avx512_vnni, avx512_vnni_512)");
  return gemm_scalar;
}

using QuantFn = void (*)(const float*, int64_t, int64_t, int, int8_t*, float*, int16_t*, int16_t*);

// The activation quantizer that goes with GEMM kernel k: the same ISA (the same bits every way).
QuantFn quantizer(GemmFn k) {
  if (k == gemm_avx512vnni || k == gemm_avx512vnni_512) return quantize_avx512;
  return k == gemm_avx2 ? quantize_avx2 : quantize_scalar;
}

// Activations of one format: int8 values, a scale per qk values, sums per 32 and (qk = 256) per 16.
struct QuantX {
  at::Tensor xq, xd, xs, xs32;
};

// x's rows quantized by `fn` (one of quantize_scalar / _avx2 / _avx512, quant_blocks.h); a row's
// result depends on that row alone, so prefills (many rows) split them over the threads, at least
// ~64k values each (a decode step stays on one thread).
QuantX quantize(const at::Tensor& x, int qk, QuantFn fn) {
  const int64_t M = x.size(0), K = x.size(1);
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  QuantX o;
  o.xq = at::empty({M, K}, x.options().dtype(at::kChar));
  o.xd = at::empty({M, K / qk}, x.options().dtype(at::kFloat));
  o.xs = at::empty({M, qk == 256 ? K / 16 : 0}, x.options().dtype(at::kShort));
  o.xs32 = at::empty({M, K / 32}, x.options().dtype(at::kShort));
  const int64_t s16 = qk == 256 ? K / 16 : 0;
  at::parallel_for(0, M, std::max<int64_t>(1, 65536 / std::max<int64_t>(K, 1)), [&](int64_t b, int64_t e) {
    fn(xf.data_ptr<float>() + b * K, e - b, K, qk, o.xq.data_ptr<int8_t>() + b * K,
       o.xd.data_ptr<float>() + b * (K / qk), o.xs.data_ptr<int16_t>() + b * s16,
       o.xs32.data_ptr<int16_t>() + b * (K / 32));
  });
  return o;
}

std::vector<at::Tensor> quantize_activations(const at::Tensor& x, int64_t type, const std::string& impl) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "quantize_activations: x must be a [M, K] CPU tensor");
  TORCH_CHECK(block_bytes(static_cast<int>(type)) > 0, "quantize_activations: no kernel for ggml type ", type);
  const int qk = block_values(static_cast<int>(type));
  TORCH_CHECK(x.size(1) % qk == 0, "quantize_activations: K = ", x.size(1), " is not a multiple of ", qk);
  QuantX o = quantize(x, qk, quantizer(kernel(impl)));
  return {o.xq, o.xd, o.xs};
}

at::Tensor quant_linear(const at::Tensor& x, const std::vector<at::Tensor>& weights,
                        const std::vector<int64_t>& types, const std::string& impl) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "quant_linear: x must be a [M, K] CPU tensor, got ",
              x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "quant_linear: x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(!weights.empty() && weights.size() == types.size(), "quant_linear: one type per weight part");
  const GemmFn fn = kernel(impl);
  const QuantFn qfn = quantizer(fn);
  const bool prefetch = prefetch_x8();
  const int64_t M = x.size(0), K = x.size(1);
  std::vector<Problem> parts(weights.size());
  std::vector<int64_t> col0(weights.size() + 1, 0);
  QuantX qx[2];  // [0]: Q8_0, [1]: Q8_K
  bool have[2] = {false, false};
  for (size_t i = 0; i < weights.size(); ++i) {
    const at::Tensor& w = weights[i];
    const int t = static_cast<int>(types[i]);
    const int bb = block_bytes(t);
    TORCH_CHECK(bb > 0, "quant_linear: no kernel for ggml type ", t);
    const int qk = block_values(t);
    TORCH_CHECK(K % qk == 0, "quant_linear: K = ", K, " is not a multiple of the block size ", qk);
    TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.device().is_cpu() && w.stride(1) == 1,
                "quant_linear: weight part ", i, " must be a [N, row_bytes] uint8 CPU tensor with contiguous rows");
    TORCH_CHECK(w.size(1) == K / qk * bb, "quant_linear: weight part ", i, " has ", w.size(1),
                " bytes per row, expected ", K / qk * bb, " for K = ", K, " and ggml type ", t);
    const int g = group_rows(t);
    TORCH_CHECK(g == 1 || (w.size(0) % g == 0 && w.is_contiguous()), "quant_linear: interleaved weight part ", i,
                " must be contiguous with a multiple of ", g, " rows, got ", w.sizes());
    TORCH_CHECK(!is_x16(t) || fn == gemm_avx512vnni_512 || fn == gemm_scalar, "quant_linear: weight part ", i,
                " is in the 16-row interleaved layout, which only the avx512_vnni_512 and scalar kernels read");
    const int f = is_k_type(t) ? 1 : 0;
    if (!have[f]) {
      qx[f] = quantize(x, qk, qfn);
      have[f] = true;
    }
    Problem& p = parts[i];
    p.type = t;
    p.M = M;
    p.K = K;
    p.w = w.data_ptr<uint8_t>();
    p.row_bytes = w.stride(0);
    p.xq = qx[f].xq.data_ptr<int8_t>();
    p.xd = qx[f].xd.data_ptr<float>();
    p.xs = f ? qx[f].xs.data_ptr<int16_t>() : nullptr;
    p.xs32 = qx[f].xs32.data_ptr<int16_t>();
    p.prefetch_x8 = prefetch;
    TORCH_CHECK(col0[i] % g == 0, "quant_linear: interleaved weight part ", i, " must start at a multiple of ", g,
                " output columns, starts at ", col0[i]);
    col0[i + 1] = col0[i] + w.size(0);
  }
  const int64_t N = col0.back();
  at::Tensor out = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (M == 0 || N == 0) return out;
  float* o = out.data_ptr<float>();
  // threads take whole units of 16 columns (an interleaved part starts at a multiple of its group)
  at::parallel_for(0, (N + 15) / 16, 1, [&](int64_t gbegin, int64_t gend) {
    const int64_t begin = gbegin * 16, end = std::min(gend * 16, N);
    for (size_t i = 0; i < parts.size(); ++i) {
      const int64_t lo = std::max(begin, col0[i]), hi = std::min(end, col0[i + 1]);
      if (lo < hi) fn(parts[i], lo - col0[i], hi - col0[i], o + lo, N);
    }
  });
  return out;
}

// [N, row_bytes] plain blocks <-> the 8- or 16-row interleaved layout of `xtype` (quant_blocks.h).
at::Tensor interleave(const at::Tensor& w, int64_t xtype, bool to_x) {
  const int t = static_cast<int>(xtype);
  const int g = group_rows(t);
  TORCH_CHECK(g > 1 && has_x8(base_type(t)) && block_bytes(t) > 0, "quant_interleave: no interleaved layout for type ",
              xtype);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.device().is_cpu() && w.size(0) % g == 0,
              "quant_interleave: w must be a [N, row_bytes] uint8 CPU tensor with N a multiple of ", g, ", got ",
              w.sizes());
  const int bb = block_bytes(t);
  TORCH_CHECK(w.size(1) % bb == 0, "quant_interleave: ", w.size(1), " bytes per row is not whole ", bb, "-byte blocks");
  const at::Tensor src = w.contiguous();
  at::Tensor dst = at::empty(src.sizes(), src.options());
  const int64_t nb = w.size(1) / bb, gbytes = g * w.size(1);
  std::vector<int> map(g * bb);
  for (int i = 0; i < g * bb; ++i) map[i] = g == 16 ? x16_source(base_type(t), i) : x8_source(base_type(t), i);
  // Q5_0: the interleaved block's qh words (one per row: the 4 bytes from plain offsets 2..5, in
  // order) carry their bits permuted (q5_x_bit)
  std::vector<int> qh_words;
  if (base_type(t) == kQ5_0)
    for (int i = 0; i < g * bb; ++i)
      if (map[i] % bb == 2) qh_words.push_back(i);
  const uint8_t* in = src.data_ptr<uint8_t>();
  uint8_t* o = dst.data_ptr<uint8_t>();
  const int64_t row_bytes = w.size(1);
  at::parallel_for(0, w.size(0) / g, 64, [&](int64_t g0, int64_t g1) {
    std::vector<uint8_t> xblk(g * bb);
    for (int64_t grp = g0; grp < g1; ++grp) {
      const uint8_t* from = in + grp * gbytes;
      uint8_t* to = o + grp * gbytes;
      for (int64_t b = 0; b < nb; ++b) {
        const auto plain = [&](int i) { return map[i] / bb * row_bytes + b * bb + map[i] % bb; };
        if (to_x) {
          uint8_t* xb = to + b * g * bb;
          for (int i = 0; i < g * bb; ++i) xb[i] = from[plain(i)];
          for (int i : qh_words) permute_word(xb + i, q5_qh_to_x);
        } else {
          uint8_t* xb = xblk.data();
          std::copy(from + b * g * bb, from + (b + 1) * g * bb, xb);
          for (int i : qh_words) permute_word(xb + i, q5_qh_from_x);
          for (int i = 0; i < g * bb; ++i) to[plain(i)] = xb[i];
        }
      }
    }
  });
  return dst;
}

// One plain block of type t -> its values y[0, block_values(t)), with the float operations of the
// PyTorch reference (swiftspec/ops/quant.py dequantize) in the same order, never contracted into an
// fma, so the same bits: q * d; Q4_K / Q5_K (d * sc) * q - dmin * m; Q6_K (d * sc) * q.
__attribute__((optimize("fp-contract=off"))) static void dequantize_block(int t, const uint8_t* b, float* y) {
  if (t == kQ4_K || t == kQ5_K) {
    const float d = load_f16(b), dmin = load_f16(b + 2);
    const uint8_t* qs = b + (t == kQ5_K ? 48 : 16);
    for (int g = 0; g < 8; ++g) {
      int sc, mn;
      k4_scale_min(b + 4, g, &sc, &mn);
      const float ds = d * static_cast<float>(sc), dm = dmin * static_cast<float>(mn);
      for (int l = 0; l < 32; ++l) {
        int q = g % 2 ? qs[32 * (g / 2) + l] >> 4 : qs[32 * (g / 2) + l] & 15;
        if (t == kQ5_K) q |= ((b[16 + l] >> g) & 1) << 4;
        y[32 * g + l] = ds * static_cast<float>(q) - dm;
      }
    }
  } else if (t == kQ6_K) {
    const float d = load_f16(b + 208);
    for (int h = 0; h < 2; ++h)
      for (int k = 0; k < 4; ++k)
        for (int r = 0; r < 32; ++r) {
          const uint8_t lo = b[64 * h + 32 * (k % 2) + r];
          const int q = ((k < 2 ? lo & 15 : lo >> 4) | (((b[128 + 32 * h + r] >> (2 * k)) & 3) << 4)) - 32;
          const float sc = static_cast<float>(static_cast<int8_t>(b[192 + 8 * h + 2 * k + r / 16]));
          y[128 * h + 32 * k + r] = d * sc * static_cast<float>(q);
        }
  } else {  // the 32-value types
    const float d = load_f16(b);
    uint32_t qh = 0;
    if (t == kQ5_0) __builtin_memcpy(&qh, b + 2, 4);
    for (int l = 0; l < 32; ++l) {
      int q;
      if (t == kQ8_0) {
        q = static_cast<int8_t>(b[2 + l]);
      } else {
        const uint8_t byte = b[(t == kAWQ4 ? 4 : (t == kQ5_0 ? 6 : 2)) + l % 16];
        q = l < 16 ? byte & 15 : byte >> 4;
        if (t == kQ5_0) q = (q | static_cast<int>(((qh >> l) & 1u) << 4)) - 16;
        if (t == kQ4_0) q -= 8;
        if (t == kAWQ4) q -= b[2];
      }
      y[l] = static_cast<float>(q) * d;
    }
  }
}

}  // namespace

// [N, row_bytes] uint8 plain blocks of ggml type t -> [N, K] float32, bit-identical to the
// PyTorch reference (a model's embedding rows: a lookup of a few rows per step).
at::Tensor dequantize(const at::Tensor& raw, int64_t type) {
  const int t = static_cast<int>(type);
  TORCH_CHECK(!is_x8(t) && !is_x16(t) && block_bytes(t) > 0, "quant_dequantize: no plain block type ", type);
  TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == at::kByte && raw.device().is_cpu(),
              "quant_dequantize: raw must be a [N, row_bytes] uint8 CPU tensor, got ", raw.sizes());
  const int bb = block_bytes(t), qk = block_values(t);
  TORCH_CHECK(raw.size(1) % bb == 0, "quant_dequantize: ", raw.size(1), " bytes per row is not a whole number of ",
              bb, "-byte blocks");
  const at::Tensor w = raw.contiguous();
  const int64_t n = w.size(0), nb = w.size(1) / bb;
  at::Tensor out = at::empty({n, nb * qk}, w.options().dtype(at::kFloat));
  const uint8_t* src = w.data_ptr<uint8_t>();
  float* y = out.data_ptr<float>();
  for (int64_t i = 0; i < n * nb; ++i) dequantize_block(t, src + i * bb, y + i * qk);
  return out;
}

}  // namespace quant

at::Tensor quant_linear_cpu(const at::Tensor& x, const std::vector<at::Tensor>& weights,
                            const std::vector<int64_t>& types) {
  return quant::quant_linear(x, weights, types, "auto");
}

void register_quant_gemm(pybind11::module_& m) {
  m.def("quant_linear", &quant::quant_linear, pybind11::arg("x"), pybind11::arg("weights"),
        pybind11::arg("types"), pybind11::arg("impl") = "auto",
        "y [M, sum N_i] fp32 = x [M, K] (fp32/bf16) @ dequant(W).T for GGUF block weights given as parts "
        "W_i [N_i, row_bytes] uint8 of ggml types types[i]; impl: auto, scalar, avx2, avx512_vnni, avx512_vnni_512");
  m.def("quant_activations", &quant::quantize_activations, pybind11::arg("x"), pybind11::arg("type"),
        pybind11::arg("impl") = "auto",
        "(int8 [M, K], fp32 scales [M, K/QK], int16 sums of 16 [M, K/16] or [M, 0]) as quant_linear forms them "
        "with the kernel `impl` (the quantizer of its ISA)");
  m.def("quant_interleave", [](const at::Tensor& w, int64_t t) { return quant::interleave(w, t, true); },
        pybind11::arg("w"), pybind11::arg("x8_type"),
        "[N, row_bytes] uint8 plain blocks -> the same bytes in the 8- or 16-row interleaved layout of x8_type "
        "(a type | 0x100 or | 0x200; N a multiple of 8 or 16)");
  m.def("quant_deinterleave", [](const at::Tensor& w, int64_t t) { return quant::interleave(w, t, false); },
        pybind11::arg("w"), pybind11::arg("x8_type"), "the inverse of quant_interleave");
  m.def("quant_dequantize", &quant::dequantize, pybind11::arg("raw"), pybind11::arg("type"),
        "[N, row_bytes] uint8 plain blocks of a ggml type -> [N, K] float32, bit-identical to "
        "swiftspec.ops.quant.dequantize; RuntimeError on an interleaved or unknown type");
  m.def("quant_impls", [] { return quant::impls(); },
        "the quantized-GEMM kernels this CPU runs, the one \"auto\" runs first (by default the fastest)");
  m.def("quant_set_impl", &quant::set_impl, pybind11::arg("impl"),
        "make `impl` (one of quant_impls()) the kernel \"auto\" runs in this process");
  m.def("quant_rule_impls", [] { return quant::rule_impls(); },
        "quant_impls() in the rule's order (cpuid and CPU family only), before any environment or set_impl");
  m.def("quant_set_prefetch", &quant::set_prefetch, pybind11::arg("mode"),
        "whether the 8-row layout's kernels (avx2, avx512_vnni) prefetch their blocks ahead in this process: "
        "1 on, 0 off, -1 the rule (on on AMD CPUs); the 16-row kernel always prefetches, scalar never");
  m.def("quant_prefetch", [] { return quant::prefetch_x8(); },
        "whether the 8-row layout's kernels prefetch now (quant_set_prefetch, else the rule)");
  m.def("quant_prefetch_rule", [] { return quant::prefetch_rule(); },
        "whether the rule has the 8-row layout's kernels prefetch on this CPU (AMD CPUs)");
}

}  // namespace swiftspec
