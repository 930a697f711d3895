"""Weight-only int8 quantization for the draft model.

The draft only proposes tokens; the target verifies every one of them, so a quantized draft
cannot change the output, only how often its guesses are accepted. Halving the draft's weight
bytes makes an expansion cheaper relative to a target verification, which is what raises the
compression ratio in the asynchronous mode (DESIGN.md §7: compression ~ expansions per target
forward). Per-output-channel symmetric scales, as torch's ``_weight_int8pack_mm`` expects.
"""
from __future__ import annotations

import torch


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, K]`` float weight -> (``[N, K]`` int8, ``[N]`` scales in ``w.dtype``).

    ``w ~= q * scales[:, None]`` with ``|q| <= 127``; all-zero rows get scale 1.
    """
    wf = w.float()
    scales = wf.abs().amax(dim=1) / 127.0
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(wf / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scales.to(w.dtype)


def int8_linear_reference(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """PyTorch reference of :func:`int8_linear`: dequantize, then ``x @ W.T``."""
    return torch.nn.functional.linear(x, q.to(x.dtype) * scales.to(x.dtype)[:, None])


def int8_linear(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``[n, K] x [N, K] int8 -> [n, N]`` in ``x.dtype`` (torch's CPU int8 weight-only kernel).

    The kernel is fast for bf16 activations only (fp32 takes a slow generic path, ~60x slower
    in torch 2.13), so fp32 activations are computed in bf16: this op serves the draft model,
    whose numerics never reach the output. The kernel crashes (segfault, torch 2.13) unless the
    input features are a multiple of 16, so other shapes (padded TP shards) take the reference.
    """
    if x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float32) and q.shape[1] % 16 == 0:
        y = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16).contiguous(), q, scales.to(torch.bfloat16))
        return y.to(x.dtype)
    return int8_linear_reference(x, q, scales)
