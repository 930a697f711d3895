"""The row-local ops around the GEMMs, each to its CUDA kernel, CPU twin or PyTorch path
(:mod:`swiftspec.ops.dispatch`): the fused residual add + RMSNorm and SwiGLU's activation over
a merged gate | up projection.
"""
from __future__ import annotations

import torch

from swiftspec.ops import dispatch, reference


def rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
             eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused residual add + RMSNorm; see :func:`reference.rms_norm` (shapes, dtypes, rounding).

    Returns ``(y, x + residual)`` (``(y, x)`` without a residual). On the "cpu" backend 2-D fp32 /
    bf16 inputs run the C++ twin (``csrc/cpu/rms_norm.cpp``: one pass per row, batch invariant),
    on "cuda" 2-D contiguous ones the fused kernel (``csrc/kernels/norm.cu``, one launch instead of
    eight); anything else, and anything that needs autograd, is the reference.
    """
    b = dispatch.backend(x)
    fits = (x.dim() == 2 and weight.dtype == x.dtype and x.shape[-1] <= 8192
            and (residual is None or (residual.dtype == x.dtype and residual.shape == x.shape))
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))
    if (b == "cuda" and fits and x.dtype in (torch.float32, torch.bfloat16, torch.float16) and x.is_contiguous()
            and (residual is None or residual.is_contiguous())):
        return dispatch.cuda_module().rms_norm(x, residual, weight, eps)
    if b == "cpu" and fits and dispatch.cpu_twin("rms_norm") and x.dtype in (torch.float32, torch.bfloat16):
        return dispatch.cpu_module().rms_norm(x, residual, weight, float(eps))
    return reference.rms_norm(x, residual, weight, eps)


def silu_and_mul(gate_up: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """SwiGLU's activation over a merged ``[gate | up]`` projection; see :func:`reference.silu_and_mul`.

    ``gate_up [M, 2I]`` -> ``[M, I]`` in ``dtype`` (None: gate_up's). On the "cpu" backend a 2-D
    float32 input (the quantized GEMM's output) with a float32 / bfloat16 result runs the C++ twin
    (``csrc/cpu/swiglu.cpp`` ``silu_mul``: one pass, computed in fp32, one rounding, batch
    invariant) where the extension has a SIMD loop for it (``cpu_dispatch()["silu_mul"]``);
    anything else, and anything that needs autograd, is the reference.
    """
    out = gate_up.dtype if dtype is None else dtype
    if (dispatch.backend(gate_up) == "cpu" and dispatch.cpu_twin("silu_mul") and gate_up.dim() == 2
            and gate_up.dtype == torch.float32 and out in (torch.float32, torch.bfloat16)
            and not (torch.is_grad_enabled() and gate_up.requires_grad)):
        return dispatch.cpu_module().silu_mul(gate_up, out)
    return reference.silu_and_mul(gate_up, dtype)

