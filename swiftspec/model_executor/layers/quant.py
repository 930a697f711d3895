"""Weight-only int8 quantization for the draft model.

The draft only proposes tokens; the target verifies every one of them, so a quantized draft
cannot change the output, only how often its guesses are accepted. Halving the draft's weight
bytes makes an expansion cheaper relative to a target verification, which is what raises the
compression ratio in the asynchronous mode (compression ~ expansions per target
forward). Per-output-channel symmetric scales, as torch's ``_weight_int8pack_mm`` expects; the layers
multiply through :func:`swiftspec.ops.int8_linear`. Like the GGUF blocks
(:mod:`swiftspec.model_executor.layers.gguf`), the format is chosen when a layer is built (``load_model(...,
int8=True)``, a runner's ``quant="int8"``): the layer then holds an :class:`Int8Weight` and no
float weight.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, K]`` float weight -> (``[N, K]`` int8, ``[N]`` scales in ``w.dtype``).

    ``w ~= q * scales[:, None]`` with ``|q| <= 127``; all-zero rows get scale 1.
    """
    wf = w.float()
    scales = wf.abs().amax(dim=1) / 127.0
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(wf / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scales.to(w.dtype)


class Int8Weight(nn.Module):
    """The int8 weight of one linear layer (or LM head): ``qweight`` ``[out_local, in_local]`` int8
    and ``scales`` ``[out_local]`` in the model's dtype, ``W ~= qweight * scales[:, None]``.

    Args:
        out_local, in_local: this rank's shape of the weight.
        dtype: the model's dtype (the float weight it replaces; the scales').
        shard_loader: the layer's ``weight_loader(param, full_tensor, shard_id)``, which cuts this
            rank's shard of a checkpoint tensor into ``param`` (rows, columns or vocabulary rows;
            a 1-D tensor like a bias).

    :meth:`weight_loader` quantizes each whole checkpoint row before the shard is cut, so a rank's
    values and scales equal the TP = 1 layer's slices bit for bit whatever the TP degree.
    """

    def __init__(self, out_local: int, in_local: int, dtype: torch.dtype,
                 shard_loader: Callable[[nn.Parameter, torch.Tensor, object], None]):
        super().__init__()
        self.dtype = dtype
        self.qweight = nn.Parameter(torch.zeros(out_local, in_local, dtype=torch.int8), requires_grad=False)
        self.scales = nn.Parameter(torch.ones(out_local, dtype=dtype), requires_grad=False)
        self._shard_loader = shard_loader

    def weight_loader(self, param, loaded: torch.Tensor, shard_id=None) -> None:
        """Quantize a float checkpoint tensor ``[N, K]`` (all of it) and load this rank's shard.
        ``param`` is ignored (both of this module's parameters are written)."""
        q, scales = quantize_int8(loaded.to(self.dtype))
        self._shard_loader(self.qweight, q, shard_id)
        self._shard_loader(self.scales, scales, shard_id)
