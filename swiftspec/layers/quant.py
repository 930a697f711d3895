"""Weight-only int8 quantization for the draft model.

The draft only proposes tokens; the target verifies every one of them, so a quantized draft
cannot change the output, only how often its guesses are accepted. Halving the draft's weight
bytes makes an expansion cheaper relative to a target verification, which is what raises the
compression ratio in the asynchronous mode (compression ~ expansions per target
forward). Per-output-channel symmetric scales, as torch's ``_weight_int8pack_mm`` expects; the layers
multiply through :func:`swiftspec.ops.int8_linear`.
"""
from __future__ import annotations

import torch


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, K]`` float weight -> (``[N, K]`` int8, ``[N]`` scales in ``w.dtype``).

    ``w ~= q * scales[:, None]`` with ``|q| <= 127``; all-zero rows get scale 1.
    """
    wf = w.float()
    scales = wf.abs().amax(dim=1) / 127.0
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(wf / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scales.to(w.dtype)
