"""Attention of a few query tokens over the KV cache with an arbitrary (non-square) mask.

This is the PyTorch reference path of the tree-attention op (DESIGN.md §3, §6): the new keys and
values are written into their cache slots first, then every query attends to cache slots
``[0, S)`` where ``mask[i, j]`` says whether query ``i`` may see slot ``j``. The draft's
expansion mask is ``[w, prefix + tree + w]``; the target's verification mask is square over its
``bs`` inputs plus the whole prefix.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def cache_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                    mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Write ``k_new``/``v_new`` at ``slots`` and attend ``q`` over cache slots ``[0, S)``.

    Shapes: q ``[n, Hq, D]``; k_new, v_new ``[n, Hk, D]``; k_cache, v_cache ``[Hk, C, D]``;
    slots ``[n]`` int64; mask ``[n, S]`` bool (True = attend), ``S <= C``. Hq is a multiple of
    Hk (grouped-query attention). Returns ``[n, Hq * D]`` in q's dtype. Every row of ``mask``
    must allow at least its own slot.
    """
    k_cache[:, slots] = k_new.transpose(0, 1)
    v_cache[:, slots] = v_new.transpose(0, 1)
    S = mask.shape[1]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), k_cache[:, :S].unsqueeze(0), v_cache[:, :S].unsqueeze(0),
        attn_mask=mask.view(1, 1, *mask.shape), scale=scale, enable_gqa=True)
    n = q.shape[0]
    return out.squeeze(0).transpose(0, 1).reshape(n, -1)
