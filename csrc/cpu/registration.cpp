// The one registration file of the CPU twins: every op's Python binding is declared here and
// defined in its domain file (shm_comm.cpp, swiglu.cpp, tree_attention.cpp, linear.cpp,
// quant_gemm.cpp, rms_norm.cpp, decoder_layer.cpp).
#include <torch/extension.h>

#include "swiftspec/ll_protocol.h"

#define SWIFTSPEC_LL_FLAG_BITS_VALUE (static_cast<int>(swiftspec::ll::kFlagBits))

namespace swiftspec {
void register_shm_comm(pybind11::module_& m);       // shm_comm.cpp
void register_swiglu(pybind11::module_& m);         // swiglu.cpp
void register_tree_attention(pybind11::module_& m); // tree_attention.cpp
void register_linear(pybind11::module_& m);         // linear.cpp
void register_quant_gemm(pybind11::module_& m);     // quant_gemm.cpp
void register_rms_norm(pybind11::module_& m);       // rms_norm.cpp
void register_decoder_layer(pybind11::module_& m);  // decoder_layer.cpp
}  // namespace swiftspec

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "SwiftSpec CPU twins of the latency kernels (SwiftSpec paper section 3.3)";
  m.attr("ll_flag_bits") = SWIFTSPEC_LL_FLAG_BITS_VALUE;
  swiftspec::register_shm_comm(m);
#ifndef SWIFTSPEC_SHM_COMM_ONLY  // the LL flag wrap-around test build: the communicator alone
  swiftspec::register_swiglu(m);
  swiftspec::register_tree_attention(m);
  swiftspec::register_linear(m);
  swiftspec::register_quant_gemm(m);
  swiftspec::register_rms_norm(m);
  swiftspec::register_decoder_layer(m);
#endif
}
