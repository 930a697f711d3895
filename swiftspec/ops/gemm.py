"""The weight GEMMs of a layer, each to its CUDA kernel, CPU twin or PyTorch path
(:mod:`swiftspec.ops.dispatch`): the float linear layer, the fused SwiGLU (gate/up GEMM and
activation), the int8 weight-only linear, the GGUF-block linear and the GGUF row dequantization.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from swiftspec.ops import dispatch, reference


def swiglu(x: torch.Tensor, w_gate_up: torch.Tensor) -> torch.Tensor:
    """Fused SwiGLU ``SiLU(x @ W_gate^T) * (x @ W_up^T)``; see :func:`reference.swiglu`.

    Shapes: x ``[M, K]``, w_gate_up ``[2I, K]`` (gate rows, then up rows), same dtype (fp32/bf16/
    fp16 on CUDA). Returns ``[M, I]``.
    """
    b = dispatch.backend(x)
    if (b == "cpu" and dispatch.cpu_twin("skinny_gemm") and x.dtype == w_gate_up.dtype
            and x.dtype in (torch.float32, torch.bfloat16)):
        return dispatch.cpu_module().swiglu(x.contiguous(), w_gate_up)
    if b == "cuda":
        return dispatch.cuda_module().swiglu(x.contiguous(), w_gate_up)
    return reference.swiglu(x, w_gate_up)


# Rows up to which the CPU twin's weight-streaming kernel runs (csrc/cpu/skinny_gemm.h kMaxRows);
# above it F.linear's GEMM reuses the weights better.
_SKINNY_MAX_ROWS = 16


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Linear layer ``x @ w.T (+ bias)``; see :func:`reference.linear` (``F.linear``).

    Shapes: x ``[..., K]`` (any leading dimensions, any strides), w ``[N, K]``, bias ``[N]`` or
    None, one dtype. Returns ``[..., N]`` in x's dtype. On the "cpu" backend, fp32 / bf16 with at
    most 16 rows (decode) run the weight-streaming CPU twin (fp32 accumulation, bias added before
    the one rounding); anything else, and anything that needs autograd, is ``F.linear``.
    Raises RuntimeError (from the twin or F.linear) on mismatched dtypes or shapes.
    """
    if (dispatch.backend(x) == "cpu" and dispatch.cpu_twin("skinny_gemm") and x.dtype in (torch.float32, torch.bfloat16)
            and w.dtype == x.dtype
            and w.dim() == 2 and x.dim() >= 1 and (bias is None or bias.dtype == x.dtype)
            and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad
                                                  or (bias is not None and bias.requires_grad)))):
        x2 = x.unsqueeze(0) if x.dim() == 1 else x.flatten(0, -2)
        if x2.shape[0] <= _SKINNY_MAX_ROWS:
            y = dispatch.cpu_module().linear(x2, w, bias)
            return y.view(*x.shape[:-1], y.shape[-1])
    return F.linear(x, w, bias)


# Rows up to which the int8 twin beats torch's kernel. The twin widens every weight to fp32 and runs
# fp32 FMAs; since its weight prefetches go to L2 (skinny_gemm.h) it overlaps them with that
# arithmetic, and a whole draft forward (Qwen2.5-0.5B, bf16 activations, 1 core) took 27 / 36 / 65 /
# 124 / 226 ms at 1 / 2 / 4 / 8 / 16 rows against torch's 77 / 142 / 230 ms at 4 / 8 / 16 rows
# (2026-11-23; 57 / 62 ms at 1 / 2 rows the day before); at 16 rows they tie, so torch's kernel
# keeps the prefills.
_INT8_TWIN_MAX_ROWS = 8


def int8_linear(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Int8 weight-only linear ``(x @ q.T) * scales``; see :func:`reference.int8_linear`.

    Shapes: x ``[n, K]`` fp32 or bf16, q ``[N, K]`` int8, scales ``[N]`` float. Returns ``[n, N]``
    in x's dtype. On the "cpu" backend up to ``_INT8_TWIN_MAX_ROWS`` rows run the weight-streaming
    CPU twin; bigger batches use torch's int8 weight-only kernel; any other case is the reference.
    """
    if dispatch.backend(x) == "cpu" and dispatch.cpu_twin("skinny_gemm") and x.dim() == 2 and x.shape[0] <= _INT8_TWIN_MAX_ROWS \
            and x.dtype in (torch.float32, torch.bfloat16):
        return dispatch.cpu_module().int8_linear(x, q, scales)
    return _torch_int8_linear(x, q, scales)


def _torch_int8_linear(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """torch's CPU int8 weight-only kernel (``_weight_int8pack_mm``), fast for bf16 activations
    only (fp32 takes a generic path ~60x slower in torch 2.13), so fp32 activations are computed
    in bf16: the op serves the draft model, whose numerics never reach the output. The kernel
    crashes (segfault, torch 2.13) unless K is a multiple of 16, so other shapes (padded TP shards)
    take the reference."""
    if x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float32) and q.shape[1] % 16 == 0:
        y = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16).contiguous(), q.contiguous(),
                                              scales.to(torch.bfloat16))
        return y.to(x.dtype)
    return reference.int8_linear(x, q, scales)


def quant_linear(x: torch.Tensor, parts: list[torch.Tensor], types: list[int], dequantized) -> torch.Tensor:
    """Linear layer on GGUF block weights: ``[M, K]`` fp32/bf16 -> ``[M, sum N_i]`` float32.

    ``parts[i]`` is a ``[N_i, row_bytes]`` uint8 weight of ggml type ``types[i]``; the rows of x
    are quantized to int8 once (see :mod:`swiftspec.ops.quant`). On the "cpu" backend the kernel
    picked for this CPU (AVX-512 VNNI, AVX2 or scalar) reads the blocks in place, for any M; the
    PyTorch path multiplies the same int8 activations by ``dequantized()`` (float32 copies of the
    parts). Raises RuntimeError / ValueError on shapes that do not fit the block format.
    """
    if dispatch.backend(x) == "cpu":
        return dispatch.cpu_module().quant_linear(x.contiguous(), parts, types, "auto")
    from swiftspec.ops import quant

    return quant.torch_linear(x, parts, types, dequantized())


def dequantize(raw: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """``[N, row_bytes]`` uint8 plain GGUF blocks -> ``[N, K]`` float32 (an embedding's rows, a
    few per step): on the "cpu" backend one C++ loop, else :func:`swiftspec.ops.quant.dequantize`
    (~20 PyTorch ops: ~0.3-0.8 ms for one or two rows); the same bits either way. Raises
    RuntimeError / KeyError on a type without a kernel, ValueError / RuntimeError on partial blocks."""
    from swiftspec.ops import quant

    if dispatch.backend(raw) == "cpu" and quant.group_rows(ggml_type) == 1:
        return dispatch.cpu_module().quant_dequantize(raw, int(ggml_type))
    return quant.dequantize(raw, ggml_type)

