"""SwiGLU activation over a merged ``[gate | up]`` projection."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``[n, 2*I] -> [n, I]``: ``SiLU(gate) * up`` where ``x = [gate | up]`` on the last dim."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
