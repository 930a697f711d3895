"""Megatron-style tensor-parallel linear layers, for any TP degree.

Column-parallel layers split the output features across the TP group (no communication);
row-parallel layers split the input features and all-reduce the partial sums. Each parameter
carries a ``weight_loader(param, full_tensor, shard_id=None)`` that slices the full checkpoint
tensor for this rank, so the model never needs to know how it is sharded (nano-vllm's layout).

When a dimension is not divisible by the TP degree it is zero-padded (§4 of the paper): every
rank holds ``ceil(n / tp)`` features and the ones past ``n`` have zero weights (and zero bias).
Padded gate/up rows give ``SiLU(0) * 0 = 0`` and meet zero columns of the row-parallel down
projection, so the all-reduced output equals the unpadded model's. Attention heads follow
:func:`gqa_head_layout`. With divisible dimensions nothing is padded and the layout is plain
Megatron's.

Architecture: docs/architecture.md §6.
"""
from __future__ import annotations

import torch
from torch import nn

from swiftspec import ops
from swiftspec.distributed.parallel import LOCAL, PAD, TPContext, take_shard
from swiftspec.model_executor.layers.gguf import GGUFWeight
from swiftspec.model_executor.layers.quant import Int8Weight


def _even_index(n: int, tp: TPContext) -> torch.Tensor:
    """Global feature held at each of this rank's ``ceil(n / tp)`` local positions (PAD past n)."""
    per = -(-n // tp.size)
    idx = torch.arange(tp.rank * per, (tp.rank + 1) * per)
    return idx.masked_fill(idx >= n, PAD)


def block_split(n: int, tp: TPContext, block: int) -> torch.Tensor | None:
    """This rank's features of a dimension of ``n`` features cut into whole blocks of ``block``
    (GGUF blocks along a row-parallel layer's input): the blocks dealt out in contiguous runs,
    ranks differing by at most one block, nothing padded. None where some rank would get no
    block or ``n`` is not whole blocks (the layers then keep float weights)."""
    if n % block or n // block < tp.size:
        return None
    nb = n // block
    lo, hi = tp.rank * nb // tp.size, (tp.rank + 1) * nb // tp.size
    return torch.arange(lo * block, hi * block)


def _heads_to_features(heads: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``[h]`` head indices -> ``[h * head_dim]`` feature indices (PAD stays PAD)."""
    f = heads[:, None] * head_dim + torch.arange(head_dim)
    return f.masked_fill(heads[:, None] < 0, PAD).reshape(-1)


def _copy_shard(dst: torch.Tensor, src: torch.Tensor, index: torch.Tensor, dim: int) -> None:
    """``dst[..i..] = src[..index[i]..]`` along ``dim``, zero where ``index`` is PAD."""
    dst.copy_(take_shard(src, index, dim))


def gqa_head_layout(num_heads: int, num_kv_heads: int, tp_size: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Which query and key/value heads each TP rank holds, for any TP degree.

    Every rank holds ``kv_local`` *units*; a unit is one KV head plus ``g_local`` of the query
    heads that share it (its group of ``g = num_heads / num_kv_heads``). Each group is cut into
    ``ceil(g / g_local)`` units, the last one padded with zero query heads; the units are dealt
    out in order, ``kv_local`` per rank, and the list is padded with all-zero units. Every rank
    thus has the same ``num_heads_local = kv_local * g_local`` and a uniform GQA group size,
    which is what ``scaled_dot_product_attention(enable_gqa=True)`` needs; a KV head cut into
    several units is replicated (computed on several ranks, or twice on one rank). ``g_local``
    is the value in ``[1, g]`` (a divisor of ``g`` or not) that minimizes the per-rank weight
    bytes, ``num_heads_local + kv_local`` head projections, since the slowest rank sets the step
    time (ties: fewer KV heads, for a smaller KV cache; then larger units).
    Divisible head counts give plain Megatron (``g_local = g``, contiguous heads, no padding).

    A padded query head has zero q weights and bias, so it attends uniformly and yields a finite
    value that meets zero o_proj input columns: it adds exactly 0 after the all-reduce. A padded
    unit's KV head has zero k/v weights as well.

    Example, 12 query heads / 2 KV heads (g = 6)::

        tp=3: g_local=2, kv_local=2 -> 4 query heads per rank, none padded
              rank 0: kv [0, 0]  q [0 1 | 2 3]
              rank 1: kv [0, 1]  q [4 5 | 6 7]
              rank 2: kv [1, 1]  q [8 9 | 10 11]
        tp=5: g_local=3, kv_local=1 -> 3 query heads per rank
              ranks 0-3: kv [0], [0], [1], [1]; q [0 1 2], [3 4 5], [6 7 8], [9 10 11]
              rank 4: one padded unit (all zero)

    Returns:
        ``(q_heads, kv_heads)``: int64 ``[tp_size, num_heads_local]`` and
        ``[tp_size, kv_local]``, global head indices with PAD (-1) for padding.
    Raises:
        ValueError: ``num_heads`` is not a multiple of ``num_kv_heads``.
    """
    if num_heads % num_kv_heads:
        raise ValueError(f"attention heads ({num_heads}) not a multiple of key/value heads ({num_kv_heads})")
    g = num_heads // num_kv_heads

    def cost(g_local):
        units = num_kv_heads * -(-g // g_local)
        kv_local = -(-units // tp_size)
        return kv_local * g_local + kv_local, kv_local, -g_local

    g_local = min(range(1, g + 1), key=cost)
    kv_local = cost(g_local)[1]
    q_units, kv_units = [], []
    for kv in range(num_kv_heads):
        for lo in range(0, g, g_local):
            q = list(range(kv * g + lo, kv * g + min(lo + g_local, g)))
            q_units.append(q + [PAD] * (g_local - len(q)))
            kv_units.append(kv)
    for _ in range(tp_size * kv_local - len(kv_units)):
        q_units.append([PAD] * g_local)
        kv_units.append(PAD)
    q_heads = torch.tensor(q_units).view(tp_size, kv_local * g_local)
    kv_heads = torch.tensor(kv_units).view(tp_size, kv_local)
    return q_heads, kv_heads


class LinearBase(nn.Module):
    """``y = x @ W.T (+ b)`` with ``W`` of shape ``[out_local, in_local]``.

    The weight format is fixed when the layer is built: a float ``weight`` in the model's dtype;
    or, with ``gguf_types`` (one ggml type per part of ``part_sizes`` rows), a
    :class:`GGUFWeight` in ``self.native`` that keeps the checkpoint's blocks (``weight`` is None);
    at TP > 1 it holds this rank's rows (``row_index``, per part) or whole blocks of its input
    features (``k_index``) of them, as :class:`GGUFWeight` describes; or, with ``int8`` (and no
    ``gguf_types``), an :class:`Int8Weight` in ``self.int8`` (``weight`` is None) that quantizes
    the checkpoint's rows as they load.
    """

    def __init__(self, in_local: int, out_local: int, bias: bool, tp: TPContext, dtype: torch.dtype,
                 gguf_types: list[int] | None = None, part_sizes: list[int] | None = None,
                 row_index: list[torch.Tensor | None] | None = None, k_index: torch.Tensor | None = None,
                 int8: bool = False):
        super().__init__()
        self.tp = tp
        self.native: GGUFWeight | None = None
        self.int8: Int8Weight | None = None
        if gguf_types is not None:
            self.native = GGUFWeight(in_local, part_sizes or [out_local], gguf_types, interleave=ops.quant_interleave_rows(),
                                     row_index=row_index if tp.size > 1 else None,
                                     k_index=k_index if tp.size > 1 else None)
            self.register_parameter("weight", None)
        elif int8:
            self.int8 = Int8Weight(out_local, in_local, dtype, self.weight_loader)
            self.register_parameter("weight", None)
        else:
            self.weight = nn.Parameter(torch.empty(out_local, in_local, dtype=dtype), requires_grad=False)
            self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_local, dtype=dtype), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        """Copy this rank's shard of a checkpoint tensor ``loaded`` (full, unsharded shape) into
        ``param``; ``shard_id`` names the part of a merged weight. Each subclass implements its split.

        Raises:
            NotImplementedError: here, on the base class.
        """
        raise NotImplementedError

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W.T (+ bias)`` with whichever weight this layer holds (no communication).

        Float weights go through :func:`swiftspec.ops.linear` (the CPU skinny-GEMM twin at decode
        sizes, which adds ``bias`` before its one rounding); int8 weights through
        :func:`swiftspec.ops.int8_linear`, with ``bias`` added afterwards.
        """
        if self.native is not None:  # float32 sums; the bias before the one rounding
            y = self.native.matmul(x)
            return (y if bias is None else y + bias.float()).to(x.dtype)
        if self.int8 is not None:
            y = ops.int8_linear(x, self.int8.qweight, self.int8.scales)
            return y if bias is None else y + bias
        return ops.linear(x, self.weight, bias)

    def forward(self, x):
        """``x @ W.T + b``: ``x`` ``[n, in_local]`` -> ``[n, out_local]`` in ``x``'s dtype (:meth:`matmul`)."""
        return self.matmul(x, self.bias)


class ColumnParallelLinear(LinearBase):
    """Output features split over ranks: ``[n, in] -> [n, ceil(out / tp)]``.

    Rank r holds rows ``[r*p, (r+1)*p)`` with ``p = ceil(out / tp)``; rows past ``out`` are zero
    (weight and bias), so their outputs are 0.
    """

    def __init__(self, in_features, out_features, bias=False, tp: TPContext = LOCAL, dtype=torch.float32,
                 gguf_types: list[int] | None = None, int8: bool = False):
        self.out_index = _even_index(out_features, tp)
        super().__init__(in_features, self.out_index.numel(), bias, tp, dtype, gguf_types, row_index=[self.out_index],
                         int8=int8)

    def weight_loader(self, param, loaded, shard_id=None):
        """Copy this rank's rows of the full ``[out, in]`` weight (or ``[out]`` bias) into ``param``; padded rows are zero."""
        _copy_shard(param.data, loaded, self.out_index, 0)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one weight (e.g. gate and up).

    ``output_sizes`` are the full (unsharded) sizes; each rank stores its padded slice of every
    part, concatenated: ``[part0_local | part1_local | ...]`` with ``part_local = ceil(size / tp)``,
    or the global rows given for each part by ``part_index`` (e.g. :func:`block_split`).
    ``shard_id`` is the part index.
    """

    def __init__(self, in_features, output_sizes: list[int], bias=False, tp: TPContext = LOCAL,
                 dtype=torch.float32, gguf_types: list[int] | None = None,
                 part_index: list[torch.Tensor] | None = None, int8: bool = False):
        self.part_index = part_index or [_even_index(o, tp) for o in output_sizes]
        self.output_sizes = [i.numel() for i in self.part_index]
        LinearBase.__init__(self, in_features, sum(self.output_sizes), bias, tp, dtype, gguf_types,
                            self.output_sizes, row_index=self.part_index, int8=int8)

    def weight_loader(self, param, loaded, shard_id=None):
        """Copy this rank's rows of part ``shard_id`` (its full ``[size, in]`` weight or ``[size]``
        bias) into that part's slice of ``param``."""
        n = self.output_sizes[shard_id]
        off = sum(self.output_sizes[:shard_id])
        _copy_shard(param.data.narrow(0, off, n), loaded, self.part_index[shard_id], 0)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection split by attention heads (GQA aware, any TP degree).

    ``[n, hidden] -> [n, (num_heads + 2 * num_kv_heads) * head_dim]`` with the *local* head
    counts ``num_heads`` / ``num_kv_heads`` of :func:`gqa_head_layout`; ``q_heads`` /
    ``kv_heads`` are this rank's global head indices (PAD = -1: zero weights and bias). Local
    query head ``i`` uses local KV head ``i // (num_heads // num_kv_heads)``. ``shard_id`` is one
    of ``"q"``, ``"k"``, ``"v"``. Divisible head counts give Megatron's contiguous slices.
    """

    def __init__(self, hidden_size, head_dim, num_heads, num_kv_heads, bias=False, tp: TPContext = LOCAL,
                 dtype=torch.float32, gguf_types: list[int] | None = None, int8: bool = False):
        self.head_dim = head_dim
        q_heads, kv_heads = gqa_head_layout(num_heads, num_kv_heads, tp.size)
        self.q_heads, self.kv_heads = q_heads[tp.rank], kv_heads[tp.rank]
        self.num_heads, self.num_kv_heads = self.q_heads.numel(), self.kv_heads.numel()
        self.q_index = _heads_to_features(self.q_heads, head_dim)
        self.kv_index = _heads_to_features(self.kv_heads, head_dim)
        q, kv = self.num_heads * head_dim, self.num_kv_heads * head_dim
        LinearBase.__init__(self, hidden_size, q + 2 * kv, bias, tp, dtype, gguf_types, [q, kv, kv],
                            row_index=[self.q_index, self.kv_index, self.kv_index], int8=int8)

    def weight_loader(self, param, loaded, shard_id=None):
        """Copy this rank's heads of the full q, k or v projection (``shard_id`` ``"q"``, ``"k"`` or
        ``"v"``; ``[heads * head_dim, hidden]`` weight or bias) into its slice of ``param``; padded
        heads are zero."""
        q = self.q_index.numel()
        kv = self.kv_index.numel()
        off, n, index = {"q": (0, q, self.q_index), "k": (q, kv, self.kv_index),
                         "v": (q + kv, kv, self.kv_index)}[shard_id]
        _copy_shard(param.data.narrow(0, off, n), loaded, index, 0)


class RowParallelLinear(LinearBase):
    """Input features split over ranks; the partial products are all-reduced.

    ``[n, in_local] -> [n, out]``. Rank r holds columns ``[r*p, (r+1)*p)``, ``p = ceil(in / tp)``,
    or, with ``in_index``, the global input feature given for each local column (PAD: a zero
    column, e.g. the padded heads of :class:`QKVParallelLinear` feeding o_proj). Zero columns
    make the padded inputs contribute exactly 0 as long as they are finite. The bias (if any) is
    added once, after the reduction, so the result equals the unsharded layer. GGUF blocks need
    ``in_index`` in whole blocks (:func:`swiftspec.model_executor.layers.gguf.block_index`); their float32
    partial sums are all-reduced, then the bias is added and the sum rounded once to x's dtype.

    Int8 weights take the scales of *whole* checkpoint rows (:class:`Int8Weight` quantizes before
    the shard is cut), so a quantized layer gives the same values at every TP degree.
    """

    def __init__(self, in_features, out_features, bias=False, tp: TPContext = LOCAL, dtype=torch.float32,
                 in_index: torch.Tensor | None = None, gguf_types: list[int] | None = None, int8: bool = False):
        self.in_index = _even_index(in_features, tp) if in_index is None else in_index
        super().__init__(self.in_index.numel(), out_features, bias, tp, dtype, gguf_types, k_index=self.in_index,
                         int8=int8)

    def weight_loader(self, param, loaded, shard_id=None):
        """Copy this rank's input columns of the full ``[out, in]`` weight into ``param``; a 1-D tensor
        (the bias, int8 scales) is copied whole."""
        if param.dim() == 1:  # bias (and int8 scales): not sharded
            param.data.copy_(loaded)
            return
        _copy_shard(param.data, loaded, self.in_index, 1)

    def forward(self, x):
        """``x`` ``[n, in_local]`` -> ``[n, out]`` in ``x``'s dtype, the partial products all-reduced over
        the group and the bias added once: GGUF blocks sum in float32 and round once; int8 weights
        all-reduce their product; float weights use the fused GEMM + all-reduce."""
        if self.native is not None and self.tp.size == 1:  # nothing to reduce
            return self.matmul(x, self.bias)
        if self.native is not None:  # float32 partial sums, summed in rank order; one rounding after the bias
            y = self.tp.all_reduce(self.native.matmul(x))
            return (y if self.bias is None else y + self.bias.float()).to(x.dtype)
        if self.int8 is not None:  # the quantized GEMM, the all-reduce, the bias once
            y = self.tp.all_reduce(self.matmul(x))
            return y if self.bias is None else y + self.bias
        return self.tp.gemm_all_reduce(x, self.weight, self.bias)
