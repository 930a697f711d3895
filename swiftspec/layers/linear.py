"""Megatron-style tensor-parallel linear layers.

Column-parallel layers split the output features across the TP group (no communication);
row-parallel layers split the input features and all-reduce the partial sums. Each parameter
carries a ``weight_loader(param, full_tensor, shard_id=None)`` that slices the full checkpoint
tensor for this rank, so the model never needs to know how it is sharded (nano-vllm's layout).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from swiftspec.layers.quant import int8_linear, quantize_int8
from swiftspec.parallel import LOCAL, TPContext


def _divide(n: int, k: int, what: str) -> int:
    if n % k:
        raise ValueError(f"{what} ({n}) is not divisible by the TP degree ({k})")
    return n // k


class LinearBase(nn.Module):
    """``y = x @ W.T (+ b)`` with ``W`` of shape ``[out_local, in_local]`` (dtype of the model)."""

    def __init__(self, in_local: int, out_local: int, bias: bool, tp: TPContext, dtype: torch.dtype):
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(out_local, in_local, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_local, dtype=dtype), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        raise NotImplementedError

    def quantize_int8_(self) -> None:
        """Replace the weight by int8 values plus per-row scales (weight-only quantization)."""
        q, scales = quantize_int8(self.weight.data)
        del self.weight
        self.register_buffer("qweight", q)
        self.register_buffer("scales", scales)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` with whichever weight this layer holds (no bias, no communication)."""
        if hasattr(self, "qweight"):
            return int8_linear(x, self.qweight, self.scales)
        return F.linear(x, self.weight)

    def forward(self, x):
        y = self.matmul(x)
        return y if self.bias is None else y + self.bias


class ReplicatedLinear(LinearBase):
    """Every rank holds the whole weight."""

    def __init__(self, in_features, out_features, bias=False, tp: TPContext = LOCAL, dtype=torch.float32):
        super().__init__(in_features, out_features, bias, tp, dtype)

    def weight_loader(self, param, loaded, shard_id=None):
        param.data.copy_(loaded)


class ColumnParallelLinear(LinearBase):
    """Output features split over ranks: rank r holds rows ``[r*out/tp, (r+1)*out/tp)``."""

    def __init__(self, in_features, out_features, bias=False, tp: TPContext = LOCAL, dtype=torch.float32):
        super().__init__(in_features, _divide(out_features, tp.size, "output features"), bias, tp, dtype)

    def weight_loader(self, param, loaded, shard_id=None):
        n = param.shape[0]
        param.data.copy_(loaded.narrow(0, self.tp.rank * n, n))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one weight (e.g. gate and up).

    ``output_sizes`` are the full (unsharded) sizes; each rank stores its slice of every part,
    concatenated: ``[part0_local | part1_local | ...]``. ``shard_id`` is the part index.
    """

    def __init__(self, in_features, output_sizes: list[int], bias=False, tp: TPContext = LOCAL,
                 dtype=torch.float32):
        self.output_sizes = [_divide(o, tp.size, "output features") for o in output_sizes]
        super().__init__(in_features, sum(output_sizes), bias, tp, dtype)

    def weight_loader(self, param, loaded, shard_id=None):
        n = self.output_sizes[shard_id]
        off = sum(self.output_sizes[:shard_id])
        param.data.narrow(0, off, n).copy_(loaded.narrow(0, self.tp.rank * n, n))


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection split by attention heads (GQA aware).

    Rank r holds query heads ``[r*H/tp, (r+1)*H/tp)`` and the matching key/value heads.
    ``shard_id`` is one of ``"q"``, ``"k"``, ``"v"``.
    """

    def __init__(self, hidden_size, head_dim, num_heads, num_kv_heads, bias=False, tp: TPContext = LOCAL,
                 dtype=torch.float32):
        self.head_dim = head_dim
        self.num_heads = _divide(num_heads, tp.size, "attention heads")
        self.num_kv_heads = _divide(num_kv_heads, tp.size, "key/value heads")
        out = (num_heads + 2 * num_kv_heads) * head_dim
        super().__init__(hidden_size, out, bias, tp, dtype)

    def weight_loader(self, param, loaded, shard_id=None):
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        off, n = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard_id]
        param.data.narrow(0, off, n).copy_(loaded.narrow(0, self.tp.rank * n, n))


class RowParallelLinear(LinearBase):
    """Input features split over ranks; the partial products are all-reduced.

    The bias (if any) is added once, after the reduction, so the result equals the unsharded layer.
    """

    def __init__(self, in_features, out_features, bias=False, tp: TPContext = LOCAL, dtype=torch.float32):
        super().__init__(_divide(in_features, tp.size, "input features"), out_features, bias, tp, dtype)

    def weight_loader(self, param, loaded, shard_id=None):
        if param.dim() == 1:  # bias: not sharded
            param.data.copy_(loaded)
            return
        n = param.shape[1]
        param.data.copy_(loaded.narrow(1, self.tp.rank * n, n))

    def forward(self, x):
        y = self.tp.all_reduce(self.matmul(x))
        return y if self.bias is None else y + self.bias
