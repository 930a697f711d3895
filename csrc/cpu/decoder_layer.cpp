// One decoder layer on native GGUF weights in one C++ call: the ops the Python modules would
// call one by one (swiftspec/model_executor/models/llama.py DecoderLayer with every linear layer on GGUF blocks),
// in the same order, through the same kernels, so the result is bit-identical to that path.
//
//   h, res   = rms_norm(x, residual, ln1)             (rms_norm.cpp)
//   qkv      = dtype(quant_linear(h, Wqkv) + bias)    (quant_gemm.cpp; the bias added in fp32)
//   o        = tree_attention(q, k, v, ...)           (tree_attention.cpp: RoPE, KV write, attention)
//   h2, res2 = rms_norm(dtype(quant_linear(o, Wo)), res, ln2)
//   gu       = quant_linear(h2, Wgate_up)             (fp32)
//   out      = dtype(quant_linear(silu_mul(gu), Wdown)) (swiglu.cpp: dtype(silu(gate) * up) in one pass;
//                                                       ATen's silu, multiply and cast where no SIMD loop
//                                                       is compiled, as ops.silu_and_mul decides)
//
// What it saves is the interpreter: at one or a few rows a layer's kernels take ~2 ms on a 1.5B
// model and the Python module calls, views, casts and argument checks around them ~0.5 ms more.
// The other glue (bias add, casts) is ATen's, the same kernels PyTorch runs.
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <cstdint>
#include <tuple>
#include <utility>
#include <vector>

#include "cpu_ops.h"

namespace swiftspec {
namespace {

struct BlockWeight {
  std::vector<at::Tensor> parts;  // [N_i, row_bytes_i] uint8, ggml blocks
  std::vector<int64_t> types;     // ggml type of each part
  int64_t rows() const {
    int64_t n = 0;
    for (const auto& p : parts) n += p.size(0);
    return n;
  }
};

class NativeDecoderLayer {
 public:
  NativeDecoderLayer(at::Tensor ln1, at::Tensor ln2, double eps, std::vector<at::Tensor> qkv,
                     std::vector<int64_t> qkv_types, c10::optional<at::Tensor> qkv_bias, std::vector<at::Tensor> o,
                     std::vector<int64_t> o_types, std::vector<at::Tensor> gate_up, std::vector<int64_t> gate_up_types,
                     std::vector<at::Tensor> down, std::vector<int64_t> down_types, int64_t num_heads,
                     int64_t num_kv_heads, int64_t head_dim, double scale)
      : ln1_(std::move(ln1)), ln2_(std::move(ln2)), eps_(eps), qkv_{std::move(qkv), std::move(qkv_types)},
        o_{std::move(o), std::move(o_types)}, gate_up_{std::move(gate_up), std::move(gate_up_types)},
        down_{std::move(down), std::move(down_types)}, num_heads_(num_heads), num_kv_heads_(num_kv_heads),
        head_dim_(head_dim), scale_(scale) {
    for (const BlockWeight* w : {&qkv_, &o_, &gate_up_, &down_}) {
      TORCH_CHECK(!w->parts.empty() && w->parts.size() == w->types.size(),
                  "NativeDecoderLayer: every weight needs one ggml type per part");
    }
    TORCH_CHECK(num_heads > 0 && num_kv_heads > 0 && head_dim > 0 && num_heads % num_kv_heads == 0,
                "NativeDecoderLayer: bad head counts ", num_heads, " / ", num_kv_heads, " x ", head_dim);
    TORCH_CHECK(qkv_.rows() == (num_heads + 2 * num_kv_heads) * head_dim, "NativeDecoderLayer: qkv has ",
                qkv_.rows(), " rows, expected (", num_heads, " + 2 * ", num_kv_heads, ") * ", head_dim);
    TORCH_CHECK(gate_up_.rows() % 2 == 0, "NativeDecoderLayer: gate_up must have an even number of rows");
    if (qkv_bias.has_value()) {
      TORCH_CHECK(qkv_bias->dim() == 1 && qkv_bias->size(0) == qkv_.rows(), "NativeDecoderLayer: qkv bias must be [",
                  qkv_.rows(), "]");
      qkv_bias_ = *qkv_bias;
    }
  }

  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                             at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slots,
                                             const at::Tensor& positions, const at::Tensor& cos_table,
                                             const at::Tensor& sin_table, const at::Tensor& mask,
                                             const c10::optional<at::Tensor>& slot_positions) const {
    const auto dtype = x.scalar_type();
    auto [o, res] = attention(x, residual, std::move(k_cache), std::move(v_cache), slots, positions, cos_table,
                              sin_table, mask, slot_positions);
    auto [down, res2] = mlp(o.to(dtype), res);
    return {down.to(dtype), res2};
  }

  // The layer's first half up to o_proj: (o_proj's fp32 sums [n, hidden], x + residual). At TP > 1
  // these are this rank's partial sums, all-reduced by the caller before the rounding to x's dtype.
  std::tuple<at::Tensor, at::Tensor> attention(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                               at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slots,
                                               const at::Tensor& positions, const at::Tensor& cos_table,
                                               const at::Tensor& sin_table, const at::Tensor& mask,
                                               const c10::optional<at::Tensor>& slot_positions) const {
    TORCH_CHECK(x.dim() == 2, "NativeDecoderLayer: x must be [n, hidden], got ", x.sizes());
    const auto dtype = x.scalar_type();
    const int64_t n = x.size(0), q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
    auto [h, res] = rms_norm_cpu(x, residual, ln1_, eps_);
    at::Tensor qkv = quant_linear_cpu(h, qkv_.parts, qkv_.types);
    if (qkv_bias_.defined()) qkv = qkv + qkv_bias_.to(at::kFloat);
    qkv = qkv.to(dtype);
    const at::Tensor q = qkv.narrow(1, 0, q_size).view({n, num_heads_, head_dim_});
    const at::Tensor k = qkv.narrow(1, q_size, kv_size).view({n, num_kv_heads_, head_dim_});
    const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({n, num_kv_heads_, head_dim_});
    const at::Tensor attn = tree_attention_cpu(q, k, v, std::move(k_cache), std::move(v_cache), slots, positions,
                                               cos_table, sin_table, mask, scale_, slot_positions);
    return {quant_linear_cpu(attn, o_.parts, o_.types), res};
  }

  // The second half from o_proj's output o (rounded to the activation dtype, all-reduced at TP > 1):
  // (down_proj's fp32 sums [n, hidden], o + residual); at TP > 1 partial sums, as above.
  std::tuple<at::Tensor, at::Tensor> mlp(const at::Tensor& o, const at::Tensor& residual) const {
    TORCH_CHECK(o.dim() == 2 && residual.sizes() == o.sizes(), "NativeDecoderLayer: o and residual must be [n, hidden], got ",
                o.sizes(), " and ", residual.sizes());
    const auto dtype = o.scalar_type();
    auto [h2, res2] = rms_norm_cpu(o, residual, ln2_, eps_);
    const at::Tensor gu = quant_linear_cpu(h2, gate_up_.parts, gate_up_.types);
    const int64_t inter = gu.size(1) / 2;
    const at::Tensor act = silu_mul_simd() ? silu_mul_cpu(gu, dtype)
                                           : (at::silu(gu.narrow(1, 0, inter)) * gu.narrow(1, inter, inter)).to(dtype);
    return {quant_linear_cpu(act, down_.parts, down_.types), res2};
  }

 private:
  at::Tensor ln1_, ln2_;
  double eps_;
  BlockWeight qkv_, o_, gate_up_, down_;
  at::Tensor qkv_bias_;
  int64_t num_heads_, num_kv_heads_, head_dim_;
  double scale_;
};

// Every decoder layer of a model (or pipeline stage) in one call: layer j over kv_buf[j] (keys
// kv_buf[j][0], values kv_buf[j][1]), the same calls in the same order as one forward per layer,
// so the same bits. Saves the interpreter between layers: ~50 us a layer for the Python module
// call, its checks and the arguments (the 0.5B draft: ~1.1 ms of a ~15 ms one-row forward).
std::tuple<at::Tensor, at::Tensor> forward_layers(const std::vector<const NativeDecoderLayer*>& layers,
                                                  const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                                  const at::Tensor& kv_buf, const at::Tensor& slots,
                                                  const at::Tensor& positions, const at::Tensor& cos_table,
                                                  const at::Tensor& sin_table, const at::Tensor& mask,
                                                  const c10::optional<at::Tensor>& slot_positions) {
  TORCH_CHECK(!layers.empty(), "forward_layers: no layers");
  TORCH_CHECK(kv_buf.dim() == 5 && kv_buf.size(0) == static_cast<int64_t>(layers.size()) && kv_buf.size(1) == 2,
              "forward_layers: kv_buf must be [", layers.size(), ", 2, kv_heads, capacity, head_dim], got ",
              kv_buf.sizes());
  at::Tensor h = x;
  c10::optional<at::Tensor> res = residual;
  for (size_t j = 0; j < layers.size(); ++j) {
    TORCH_CHECK(layers[j] != nullptr, "forward_layers: layer ", j, " is None");
    const at::Tensor kv = kv_buf.select(0, static_cast<int64_t>(j));
    auto [out, res_out] = layers[j]->forward(h, res, kv.select(0, 0), kv.select(0, 1), slots, positions, cos_table,
                                             sin_table, mask, slot_positions);
    h = std::move(out);
    res = std::move(res_out);
  }
  return {h, *res};
}

}  // namespace

void register_decoder_layer(pybind11::module_& m) {
  namespace py = pybind11;
  py::class_<NativeDecoderLayer>(m, "NativeDecoderLayer", R"doc(A decoder layer whose four linear layers are GGUF
block weights, run in one call (decoder_layer.cpp); bit-identical to the module-by-module path.

Holds references to the weights (no copies): ln1, ln2 [hidden] in the activation dtype; each linear
layer as parts [N_i, row_bytes] uint8 with their ggml types (qkv: q, k, v rows of num_heads,
num_kv_heads, num_kv_heads heads of head_dim; gate_up: gate rows then up rows); qkv_bias [N] or
None. Raises RuntimeError on inconsistent shapes.)doc")
      .def(py::init<at::Tensor, at::Tensor, double, std::vector<at::Tensor>, std::vector<int64_t>,
                    c10::optional<at::Tensor>, std::vector<at::Tensor>, std::vector<int64_t>, std::vector<at::Tensor>,
                    std::vector<int64_t>, std::vector<at::Tensor>, std::vector<int64_t>, int64_t, int64_t, int64_t,
                    double>(),
           py::arg("ln1"), py::arg("ln2"), py::arg("eps"), py::arg("qkv"), py::arg("qkv_types"), py::arg("qkv_bias"),
           py::arg("o"), py::arg("o_types"), py::arg("gate_up"), py::arg("gate_up_types"), py::arg("down"),
           py::arg("down_types"), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("scale"))
      .def("forward", &NativeDecoderLayer::forward, py::arg("x"), py::arg("residual"), py::arg("k_cache"),
           py::arg("v_cache"), py::arg("slots"), py::arg("positions"), py::arg("cos_table"), py::arg("sin_table"),
           py::arg("mask"), py::arg("slot_positions") = py::none(),
           R"doc(x [n, hidden] fp32/bf16, residual [n, hidden] or None, k_cache / v_cache [Hk, C, D] (written at
slots), slots / positions [n] int64, cos_table / sin_table [P, D] fp32, mask [n, S] bool, slot_positions
[>= S] int64 or None (each cache slot's position; see tree_attention) -> (out, x + residual),
both [n, hidden] in x's dtype: the layer's output and the residual stream for the next layer.)doc",
           py::call_guard<py::gil_scoped_release>())
      .def("attention", &NativeDecoderLayer::attention, py::arg("x"), py::arg("residual"), py::arg("k_cache"),
           py::arg("v_cache"), py::arg("slots"), py::arg("positions"), py::arg("cos_table"), py::arg("sin_table"),
           py::arg("mask"), py::arg("slot_positions") = py::none(),
           R"doc(The layer up to o_proj, arguments as forward's -> (o_proj's float32 sums [n, hidden], x + residual
in x's dtype). At TP > 1 the sums are this rank's partial ones: all-reduce them, round to x's dtype, call mlp.)doc",
           py::call_guard<py::gil_scoped_release>())
      .def("mlp", &NativeDecoderLayer::mlp, py::arg("o"), py::arg("residual"),
           R"doc(The rest of the layer from o_proj's output o [n, hidden] (in the activation dtype) and the
residual stream -> (down_proj's float32 sums [n, hidden], o + residual). forward = attention, the rounding,
mlp, the rounding; at TP > 1 an all-reduce before each rounding.)doc",
           py::call_guard<py::gil_scoped_release>());
  m.def("native_layers_forward", &forward_layers, py::arg("layers"), py::arg("x"), py::arg("residual"),
        py::arg("kv_buf"), py::arg("slots"), py::arg("positions"), py::arg("cos_table"), py::arg("sin_table"),
        py::arg("mask"), py::arg("slot_positions") = py::none(),
        R"doc(Every layer in one call: layers (NativeDecoderLayer, in order), x [n, hidden], residual or None,
kv_buf [len(layers), 2, kv_heads, C, head_dim] (layer j's keys and values at kv_buf[j]), the rest as
NativeDecoderLayer.forward's -> (out, x + residual) after the last layer, bit-identical to calling each
layer's forward in turn. Raises RuntimeError on inconsistent shapes.)doc",
        py::call_guard<py::gil_scoped_release>());
}

}  // namespace swiftspec
