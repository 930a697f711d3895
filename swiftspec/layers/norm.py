"""RMSNorm with the fused residual add of vLLM / nano-vllm."""
from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """``y = x / rms(x) * weight``, computed in float32 and cast back to ``x.dtype``.

    ``forward(x, residual)`` first adds the residual and returns ``(y, x + residual)``.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype=torch.float32):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self._norm(x), x
        x = x + residual
        return self._norm(x), x
