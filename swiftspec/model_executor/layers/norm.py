"""RMSNorm with the fused residual add of vLLM / nano-vllm."""
from __future__ import annotations

import torch
from torch import nn

from swiftspec import ops


class RMSNorm(nn.Module):
    """``y = x / rms(x) * weight``, statistics in float32, rounded to ``x.dtype`` before the weight
    multiply (:func:`swiftspec.ops.rms_norm`).

    ``forward(x, residual)`` first adds the residual and returns ``(y, x + residual)``; without a
    residual it returns ``(y, x)``.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype=torch.float32):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """``x`` ``[n, hidden]`` (and ``residual`` of the same shape and dtype, or None) -> ``(y, x +
        residual)`` (``(y, x)`` without a residual), both in ``x``'s dtype."""
        return ops.rms_norm(x, residual, self.weight, self.eps)
