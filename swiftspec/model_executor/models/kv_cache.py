"""Static, position-indexed KV cache shared by the prefix cache and the tree cache.

One buffer per model, ``[num_layers, 2, kv_heads_local, capacity, head_dim]``. Slots are plain
indices: the caller (draft or target state) decides which slots hold the prefix cache (verified
tokens, contiguous from slot 0) and which hold the tree cache (right after the prefix). Rejected
entries are never rolled back: they are simply overwritten later (gpt-fast's static cache).
Reorganizing after a re-root is :meth:`KVCache.move`, a gather into the same buffer (SwiftSpec paper §3.2).

Architecture: docs/architecture.md §4.
"""
from __future__ import annotations

from typing import NamedTuple

import torch


class LayerKV(NamedTuple):
    """One layer's view of a :class:`KVCache` (what the attention op takes)."""

    k: torch.Tensor  # [kv_heads, capacity, head_dim]
    v: torch.Tensor  # [kv_heads, capacity, head_dim]
    pos: torch.Tensor | None  # [capacity] int64 slot positions, None unless tracked
    workspace: object  # the CUDA attention workspace of this cache's model (None on CPU)


class KVCache:
    """Keys and values of every layer for ``capacity`` token slots.

    Args:
        num_layers, num_kv_heads, head_dim: model shape (``num_kv_heads`` local to this TP rank).
        capacity: number of token slots.
        dtype: storage dtype (the model's compute dtype); device: where the buffer lives.
    Memory: ``2 * num_layers * num_kv_heads * capacity * head_dim * dtype.itemsize`` bytes.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", track_positions: bool = False):
        self.capacity = capacity
        self.buf = torch.zeros(num_layers, 2, num_kv_heads, capacity, head_dim, dtype=dtype, device=device)
        # with track_positions, the token position of each slot's entry (slot j at j until written
        # otherwise), for caches that keep verified keys in tree slots (the pipeline modes):
        # attention orders and splits keys by position (csrc/cpu/tree_attention.cpp, "Key positions").
        # Without, verified keys sit at the slots of their positions (the re-root's compaction).
        self.pos = torch.arange(capacity, device=device) if track_positions else None
        # On CUDA, the split-KV partials and counters of this model's attention launches: one per
        # cache, so two models on concurrent streams (the colocated mode) never share one, and
        # sized once for the largest launch, so pointers captured in CUDA graphs stay valid.
        self.workspace = None
        if self.buf.is_cuda:
            from swiftspec.ops.cuda import TreeAttentionWorkspace

            self.workspace = TreeAttentionWorkspace(self.buf.device)
        # every layer's views, made once: indexing the buffer anew took ~10 us a layer, per forward
        self._layers = [LayerKV(self.buf[i, 0], self.buf[i, 1], self.pos, self.workspace) for i in range(num_layers)]

    def layer(self, i: int) -> LayerKV:
        """Views ``(k, v)`` of layer ``i``, each ``[kv_heads, capacity, head_dim]``, the slots'
        positions ``[capacity]`` int64 (shared by all layers), None unless they are tracked, and
        the cache's attention workspace (all layers share it: they run one after another)."""
        return self._layers[i]

    def note_positions(self, slots: torch.Tensor, positions: torch.Tensor) -> None:
        """Record that ``slots`` (``[n]`` int64, negative = not written) now hold tokens at
        ``positions`` (a no-op unless positions are tracked)."""
        if self.pos is None:
            return
        keep = slots >= 0
        self.pos[slots[keep]] = positions[keep].to(self.pos.device)

    def move(self, src: list[int] | torch.Tensor, dst: list[int] | torch.Tensor) -> None:
        """Copy slots ``src[j] -> dst[j]`` for every layer, keys and values.

        Safe for any overlap: the source slots are gathered into a temporary before the scatter,
        so a permutation with ``dst <= src`` (the re-root compaction) cannot read a slot it has
        already overwritten.

        Raises:
            ValueError: lengths differ or a slot is out of range.
        """
        src = torch.as_tensor(src, dtype=torch.long)
        dst = torch.as_tensor(dst, dtype=torch.long)
        if src.shape != dst.shape:
            raise ValueError(f"move: {src.numel()} sources but {dst.numel()} destinations")
        if src.numel() == 0 or torch.equal(src, dst):
            return
        hi = int(torch.maximum(src.max(), dst.max()))
        if hi >= self.capacity or int(torch.minimum(src.min(), dst.min())) < 0:
            raise ValueError(f"move: slot out of range [0, {self.capacity})")
        dev = self.buf.device
        src, dst = src.to(dev), dst.to(dev)
        self.buf[:, :, :, dst] = self.buf[:, :, :, src]
        if self.pos is not None:
            self.pos[dst] = self.pos[src]
