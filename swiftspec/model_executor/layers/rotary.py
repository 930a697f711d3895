"""Rotary position embedding (rotate-half convention, as Hugging Face Llama/Qwen2), with the
``linear`` and ``llama3`` rope scalings (transformers' ``modeling_rope_utils``)."""
from __future__ import annotations

import math

import torch
from torch import nn


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` float32, after rope scaling."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if not scaling:
        return inv.float()
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "linear":
        return (inv / float(scaling["factor"])).float()
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_mid, mid, scaled).float()
    return inv.float()


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables ``[max_positions, head_dim]`` float32 (rotate-half layout: the
    frequencies repeated twice). The rotation itself is fused into :func:`swiftspec.ops.tree_attention`."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None = None):
        super().__init__()
        inv = rope_inv_freq(head_dim, theta, scaling)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)
