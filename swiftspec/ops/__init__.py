"""One function per latency op; each call goes to the CUDA kernel, the CPU twin or the PyTorch
path, by the tensors' device and what is available (SwiftSpec paper section 3.3; README.md, "Kernels").

- ``cuda``: ``csrc/kernels/*.cu`` through :mod:`swiftspec.ops.cuda` (tensors on a CUDA device; the library is built by
  :mod:`swiftspec.ops.cuda_build` and loaded by :mod:`swiftspec.ops.cuda_lib`).
- ``cpu``: the C++ twins ``csrc/cpu/*.cpp`` through :mod:`swiftspec.ops.cpu` (CPU tensors).
- ``torch``: plain PyTorch ops (the fallback; :mod:`swiftspec.ops.reference` is the test oracle).

Kernels are on by default (``SWIFTSPEC_KERNELS=0`` turns them off); :func:`set_kernels` turns them off for this process (the engine's
``kernels=False`` does it in every worker, so the output can be compared with kernels on and off).
A kernel that fails to build is reported once as a warning and the op falls back to PyTorch.
The collectives (shared-memory LL all-reduce, fused GEMM + all-reduce) belong to the TP group and
are chosen in :mod:`swiftspec.distributed.parallel`.

The public surface, one module per concern: :mod:`~swiftspec.ops.dispatch` (which implementation
runs, the kernel switch, the quantized GEMM's variant and layout), :mod:`~swiftspec.ops.gemm`
(the weight GEMMs), :mod:`~swiftspec.ops.pointwise` (RMSNorm, SwiGLU's activation),
:mod:`~swiftspec.ops.attention` (tree attention) and :mod:`~swiftspec.ops.native_layer` (the C++
decoder layer).
"""
from swiftspec.ops.attention import tree_attention
from swiftspec.ops.dispatch import (
    CPU_FAMILIES,
    backend,
    cpu_dispatch,
    kernels_enabled,
    quant_interleave_rows,
    quant_x8_enabled,
    set_kernels,
    set_quant_gemm,
    set_quant_variant,
    set_quant_x8,
    time_quant_gemm,
    tune_quant_gemm,
)
from swiftspec.ops.gemm import dequantize, int8_linear, linear, quant_linear, swiglu
from swiftspec.ops.native_layer import (
    native_decoder_layer,
    native_layer_twin,
    native_layers_forward,
)
from swiftspec.ops.pointwise import rms_norm, silu_and_mul

__all__ = [
    "CPU_FAMILIES", "backend", "cpu_dispatch", "dequantize", "int8_linear", "kernels_enabled", "linear",
    "native_decoder_layer", "native_layer_twin", "native_layers_forward", "quant_interleave_rows",
    "quant_linear", "quant_x8_enabled", "rms_norm", "set_kernels", "set_quant_gemm", "set_quant_variant",
    "set_quant_x8", "silu_and_mul", "swiglu", "time_quant_gemm", "tree_attention", "tune_quant_gemm",
]
