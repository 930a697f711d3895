"""Tree attention with RoPE fused (SwiftSpec paper section 3.3): the CUDA kernel,
the CPU twin, or the PyTorch path (:func:`torch_tree_attention`, batch invariant up to
``_ROWWISE_MAX_ROWS`` query rows), by :mod:`swiftspec.ops.dispatch`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from swiftspec.ops import dispatch


def tree_attention(q, k_new, v_new, k_cache, v_cache, slots, positions, cos_table, sin_table, mask,
                   scale: float, slot_positions: torch.Tensor | None = None, workspace=None,
                   kv_len: torch.Tensor | None = None) -> torch.Tensor:
    """RoPE + KV write + masked attention over prefix and tree cache; see
    :func:`reference.tree_attention` for shapes, dtypes and semantics (negative slots are not
    written; fully masked rows give zeros). ``slot_positions`` (``[>= S]`` int64, the KV cache's
    record of each slot's position) lets the CPU twin order and split the keys by their true
    positions where cache slots hold keys of other positions (the pipeline modes); the PyTorch
    path attends row by row in slot order, which is position order along every tree path.
    ``workspace``: the CUDA kernel's :class:`swiftspec.ops.cuda.TreeAttentionWorkspace` (the KV
    cache's, see :class:`swiftspec.model_executor.models.kv_cache.KVCache`); None: one shared per device.
    ``kv_len``: ``[1]`` int64 on q's device, the slots in use (a CUDA graph's live length, its
    mask padded to the capacity); the caller promises ``mask[:, kv_len:]`` is all False, so it
    changes no result: the CUDA kernel attends and splits only those slots, the others ignore it."""
    b = dispatch.backend(q)
    args = (q.contiguous(), k_new.contiguous(), v_new.contiguous(), k_cache, v_cache, slots, positions,
            cos_table, sin_table, mask.contiguous(), float(scale))
    if b == "cpu" and dispatch.cpu_twin("tree_attention"):
        return dispatch.cpu_module().tree_attention(*args, slot_positions)
    if b == "cuda":
        return dispatch.cuda_module().tree_attention(*args, workspace=workspace, kv_len=kv_len)
    return torch_tree_attention(*args)


# Query rows up to which the PyTorch path attends row by row (decode: one-token steps, draft
# expansions, verification batches): every row then runs the same kernels on the same shapes
# whatever else is in the batch, so a row's output is bit-identical alone or in a batch (batch
# invariance); bigger batches (prefills) take SDPA.
_ROWWISE_MAX_ROWS = 16


def torch_tree_attention(q, k_new, v_new, k_cache, v_cache, slots, positions, cos_table, sin_table,
                          mask, scale):
    """The PyTorch path (kernels off or no SIMD twin for this CPU): RoPE in q's dtype, KV write,
    then attention over cache slots ``[0, S)``: up to ``_ROWWISE_MAX_ROWS`` query rows one row at
    a time over the keys the row sees (gathered: ``[Hk, G, D] @ [Hk, D, s_i]``, softmax in fp32,
    ``@ [Hk, s_i, D]``), batch invariant; more rows through ``F.scaled_dot_product_attention``
    with the mask materialized. A fully masked row gives zeros row-wise and NaN through SDPA; the
    model never builds one (only padded CUDA-graph batches do, and those run the CUDA kernel)."""
    cos = cos_table[positions].unsqueeze(1).to(q.dtype)
    sin = sin_table[positions].unsqueeze(1).to(q.dtype)
    q, k_new = (t * cos + _rotate_half(t) * sin for t in (q, k_new))
    keep = slots >= 0
    k_cache[:, slots[keep]] = k_new[keep].transpose(0, 1)
    v_cache[:, slots[keep]] = v_new[keep].transpose(0, 1)
    n, hq, d = q.shape
    S = mask.shape[1]
    if n > _ROWWISE_MAX_ROWS:
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), k_cache[:, :S].unsqueeze(0), v_cache[:, :S].unsqueeze(0),
            attn_mask=mask.view(1, 1, *mask.shape), scale=scale, enable_gqa=True)
        return out.squeeze(0).transpose(0, 1).reshape(n, -1)
    hk = k_cache.shape[0]
    qf = q.float()
    out = torch.empty(n, hq * d, dtype=torch.float32, device=q.device)
    for i in range(n):
        # only the keys this row sees, in slot order: a tree node and the same token decoded
        # alone see the same keys with the same values, so every shape and sum is the same
        seen = mask[i].nonzero().squeeze(1)
        keys = k_cache.index_select(1, seen).float()  # [Hk, s_i, D]
        values = v_cache.index_select(1, seen).float()
        scores = torch.bmm(qf[i].reshape(hk, hq // hk, d), keys.transpose(1, 2)).mul_(scale)
        out[i] = torch.bmm(torch.softmax(scores, dim=-1), values).reshape(-1)
    return out.to(q.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)
