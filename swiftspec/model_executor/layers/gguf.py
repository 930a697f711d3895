"""Weights kept in a quantized block format (the ``"native"`` weight format).

A linear layer whose checkpoint tensors are blocks with a kernel (GGUF's Q4_0, Q5_0, Q8_0, Q4_K,
Q5_K, Q6_K as in the file; AWQ int4 repacked into AWQ4 blocks by :mod:`swiftspec.weights.awq`) holds a
:class:`GGUFWeight` instead of a float ``weight``: one ``[n_i, row_bytes_i]`` uint8 parameter per part (q, k and v of a fused projection may have different block types, as
llama.cpp's Q4_K_M mixes Q4_K and Q6_K), each with its own ``weight_loader``. The format is chosen
when the layer is built (vLLM's ``quant_method``), never by probing a module later. The forward
is :func:`swiftspec.ops.quant_linear`: the CPU kernel reads the blocks in place
(``csrc/cpu/quant_gemm*.cpp``); the PyTorch path (kernels off) multiplies the same int8
activations by a float32 copy of the dequantized weights, made on first use.

Architecture: docs/architecture.md §7.
"""
from __future__ import annotations

import torch
from torch import nn

from swiftspec import ops
from swiftspec.distributed.parallel import PAD, take_shard
from swiftspec.ops import quant
from swiftspec.weights import host_memory

SHARD_PART = {None: 0, "q": 0, "k": 1, "v": 2, 0: 0, 1: 1}


def block_index(features: torch.Tensor, block: int) -> torch.Tensor | None:
    """A rank's input features (``[K_local]`` int64 global indices, :data:`PAD` for padding) as
    whole blocks of ``block`` values: ``[K_local / block]`` global block indices (PAD: a zero
    block), or None where they do not split that way (a block cut between ranks, or K_local not a
    multiple of ``block``): such a row-parallel shard cannot keep the file's blocks."""
    if features.numel() == 0 or features.numel() % block:
        return None
    chunks = features.view(-1, block)
    first = chunks[:, 0]
    padded = (chunks == PAD).all(1)
    whole = (first % block == 0) & (chunks == first[:, None] + torch.arange(block)).all(1)
    if not bool((padded | whole).all()):
        return None
    return torch.where(padded, torch.full_like(first, PAD), first // block)


class GGUFWeight(nn.Module):
    """The block-format weight of one linear layer: ``[N, K]`` as parts of ``part_sizes`` rows.

    Args:
        in_features: K, a multiple of every part's block size (32 or 256 values).
        part_sizes: output rows of each part (e.g. q, k, v sizes), summing to N.
        types: ggml type id of each part (:data:`swiftspec.ops.quant.GGML_TYPES`).
        interleave: rows per interleaved group the kernels want (:func:`swiftspec.ops.quant_interleave_rows`:
            16, 8, or 0 for the file's layout); the parts whose type has the layout (Q4_K, Q6_K, the
            32-value types) take it where their rows and first output column allow
            (:func:`swiftspec.ops.quant.interleaved_type`); ``types`` then holds the interleaved id.
        row_index: a TP rank's shard of output rows, per part: ``[n_i]`` int64 rows of the
            checkpoint's part (:data:`~swiftspec.distributed.parallel.PAD`: a zero row), or None (all rows).
        k_index: a TP rank's shard of input features, ``[in_features]`` int64 global indices (PAD:
            zero), in whole blocks of every part's type (:func:`block_index`), or None (all of K).

    Zero bytes make a zero weight in every block type (all scales 0), so padded rows give 0 and
    padded blocks add 0, as the float layers' zero padding does.

    Raises:
        ValueError: a type without a kernel, K not a multiple of a part's block size, or a
            ``k_index`` that is not whole blocks of some part's type.
    """

    def __init__(self, in_features: int, part_sizes: list[int], types: list[int], interleave: int = 0,
                 row_index: list[torch.Tensor | None] | None = None, k_index: torch.Tensor | None = None):
        super().__init__()
        if len(part_sizes) != len(types):
            raise ValueError("one ggml type per part")
        for t in types:
            if not quant.has_kernel(t):
                raise ValueError(f"ggml type {t} has no quantized kernel")
        self.in_features = in_features
        self.types = [int(t) for t in types]
        self.row_index = row_index or [None] * len(types)
        self.k_blocks = None if k_index is None else [block_index(k_index, quant.block_values(t)) for t in types]
        if self.k_blocks is not None and any(b is None for b in self.k_blocks):
            raise ValueError(f"input features {k_index.tolist()[:8]}... are not whole blocks of {types}")
        if interleave:  # the layout is fixed here, when the layer is built; an interleaved part must
            # start at a multiple of its group's output columns (the kernels take whole groups)
            starts = [sum(part_sizes[:i]) for i in range(len(part_sizes))]
            self.types = [quant.interleaved_type(t, n, s, interleave) for s, n, t in zip(starts, part_sizes, self.types)]
        # on huge pages where the host has them (swiftspec.weights.host_memory): a forward streams these
        self.parts = nn.ParameterList(
            nn.Parameter(host_memory.empty((n, quant.row_bytes(t, in_features))), requires_grad=False)
            for n, t in zip(part_sizes, self.types))
        for p in self.parts:
            p.weight_loader = self.weight_loader
        self._dequantized: list[torch.Tensor] | None = None

    @property
    def out_features(self) -> int:
        """Output features: the rows of all parts together."""
        return sum(p.shape[0] for p in self.parts)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        """Copy a checkpoint part (``[n_i, row_bytes_i]`` uint8 blocks, all of it) into part
        ``shard_id``: this rank's rows and blocks of it (``row_index``, ``k_index``).

        Raises:
            ValueError: the blocks' shape differs from the part's (another type or shape).
        """
        i = SHARD_PART[shard_id]
        part = self.parts[i]
        loaded = self._shard(loaded, i)
        if tuple(loaded.shape) != tuple(part.shape) or loaded.dtype != torch.uint8:
            raise ValueError(f"GGUF part {shard_id!r}: got {loaded.dtype} {tuple(loaded.shape)}, "
                             f"expected uint8 {tuple(part.shape)}")
        part.data.copy_(quant.interleave(loaded, self.types[i]) if quant.group_rows(self.types[i]) > 1 else loaded)
        self._dequantized = None

    def _shard(self, loaded: torch.Tensor, i: int) -> torch.Tensor:
        """This rank's rows and blocks of the checkpoint's part ``i`` (as it is when nothing is sharded)."""
        base = quant.base_type(self.types[i])
        if self.k_blocks is not None:
            bb = quant.row_bytes(base, quant.block_values(base))
            if loaded.shape[1] % bb:
                raise ValueError(f"GGUF part {i}: rows of {loaded.shape[1]} bytes are not whole {quant.ggml_name(base)} blocks")
            loaded = take_shard(loaded.view(loaded.shape[0], -1, bb), self.k_blocks[i], 1).reshape(loaded.shape[0], -1)
        if self.row_index[i] is not None:
            loaded = take_shard(loaded, self.row_index[i], 0)
        return loaded

    def dequantized(self) -> list[torch.Tensor]:
        """float32 ``[n_i, K]`` copies of the parts (made once; the PyTorch path's weights)."""
        if self._dequantized is None:
            self._dequantized = [quant.dequantize(p.data, t) for p, t in zip(self.parts, self.types)]
        return self._dequantized

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., K]`` fp32/bf16 -> ``[..., N]`` float32 (all parts side by side)."""
        x2 = x.reshape(-1, x.shape[-1])
        y = ops.quant_linear(x2, list(self.parts), self.types, self.dequantized)
        return y.view(*x.shape[:-1], y.shape[-1])

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Dequantized rows ``ids`` (one part only: embedding tables), ``[len(ids), K]`` float32."""
        t, raw = self.types[0], self.parts[0].data
        g = quant.group_rows(t)
        if g > 1:  # the rows' interleaved groups, back to plain blocks
            groups = raw.view(-1, g, raw.shape[1])[ids // g].reshape(-1, raw.shape[1])
            plain = quant.deinterleave(groups, t).view(len(ids), g, -1)
            return ops.dequantize(plain[torch.arange(len(ids)), ids % g], quant.base_type(t))
        return ops.dequantize(raw[ids], t)

    def extra_repr(self) -> str:
        """``in_features``, the rows of each part and their ggml type names, for ``repr``."""
        names = [quant.GGML_TYPES[t][0] for t in self.types]
        return f"in_features={self.in_features}, parts={[p.shape[0] for p in self.parts]}, types={names}"
