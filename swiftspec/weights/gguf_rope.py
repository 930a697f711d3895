"""llama.cpp's RoPE conventions in a GGUF and their Hugging Face equivalents: the q/k row
permutation (``convert_hf_to_gguf.py`` ``LlamaModel.permute``) and llama3 RoPE scaling, which a
GGUF keeps only as the per-frequency factors of its ``rope_freqs`` tensor.

References read (not copied): llama.cpp ``convert_hf_to_gguf.py`` and transformers'
``_compute_llama3_parameters``.
"""
from __future__ import annotations

import numpy as np
import torch

from swiftspec.weights.model_cache import ModelLoadError


def unpermute_rope(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (``convert_hf_to_gguf.py`` ``LlamaModel.permute``).

    llama.cpp regroups each head's rows from HF's rotate_half layout (first half / second half of
    the head) into interleaved pairs for its GPT-J style RoPE; this restores the HF layout.  Works
    for weights ``[n_head*head_dim, in]`` and biases ``[n_head*head_dim]``.
    """
    shape = w.shape
    half = shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *shape[1:]).transpose(1, 2).reshape(shape)


def permute_rope(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's permutation (HF -> GGUF layout); the inverse of :func:`unpermute_rope`."""
    shape = w.shape
    half = shape[0] // n_head // 2
    return w.reshape(n_head, 2, half, *shape[1:]).transpose(1, 2).reshape(shape)


def llama3_rope_factors(base: float, dim: int, factor: float, low: float, high: float, ctx: int) -> np.ndarray:
    """llama3 RoPE scaling's per-frequency divisors, float64 ``[dim / 2]`` (llama.cpp's
    ``rope_freqs``): 1 for wavelengths below ``ctx / high``, ``factor`` above ``ctx / low``, a
    smooth blend between; ``base`` is the RoPE theta, ``dim`` the head dim, ``ctx`` the original
    context in tokens. Same formula as llama.cpp's converter and transformers'
    ``_compute_llama3_parameters``."""
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    wavelen = 2 * np.pi / freqs
    smooth = (ctx / wavelen - low) / (high - low)
    out = 1.0 / ((1 - smooth) / factor + smooth)
    out = np.where(wavelen < ctx / high, 1.0, out)
    out = np.where(wavelen > ctx / low, factor, out)
    return out


def infer_llama3_rope_scaling(rope_freqs: np.ndarray, base: float, dim: int) -> dict:
    """Recover HF's ``rope_scaling`` (rope_type llama3) from llama.cpp's ``rope_freqs`` tensor.

    GGUF keeps only the per-frequency factors, not the parameters that made them.  In the smooth
    band, ``s = (1/f - 1/factor) / (1 - 1/factor)`` is linear in ``1/wavelen`` with slope
    ``ctx/(high-low)`` and intercept ``-low/(high-low)``, and the band edges follow from the same
    two numbers, so any (ctx, low, high) on that line gives identical HF inverse frequencies.
    Prefer Llama 3's own values (ctx 8192, low 1, high 4) when they fit; every candidate is
    verified by recomputing the factors.
    """
    f = np.asarray(rope_freqs, dtype=np.float64).reshape(-1)
    if f.shape[0] != dim // 2:
        raise ModelLoadError(f"rope_freqs has {f.shape[0]} entries, expected head_dim/2 = {dim // 2}")
    if np.allclose(f, 1.0):
        return {}
    factor = float(np.float32(f.max()))
    wavelen = 2 * np.pi * base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    tol = 1e-5
    ones, full = np.abs(f - 1) < tol, np.abs(f - factor) < tol * factor
    band = ~ones & ~full
    s = (1 / f[band] - 1 / factor) / (1 - 1 / factor)
    pairs = [(1.0, 4.0), (1.0, 2.0), (1.0, 8.0), (0.5, 4.0), (2.0, 8.0)]
    ctx_pref = [8192, 4096, 16384, 32768, 2048, 65536, 131072, 1024]

    candidates: list[tuple[float, float, float]] = []
    if band.sum() >= 2:
        slope, icept = np.polyfit(1 / wavelen[band], s, 1)
        for ctx in ctx_pref:
            low = -icept * ctx / slope
            candidates.append((ctx, low, low + ctx / slope))
        # The ctx that makes low exactly 1, Llama 3's value.
        ctx = -slope / icept if icept < 0 else 8192.0
        candidates.append((ctx, -icept * ctx / slope, -icept * ctx / slope + ctx / slope))
    else:
        for low, high in pairs:
            if band.any():  # one point in the band fixes ctx
                ctx = float(wavelen[band][0] * (s[0] * (high - low) + low))
                candidates.append((ctx, low, high))
            else:  # a step: any ctx putting the edges between the two groups fits
                lo_ctx = high * wavelen[ones].max() if ones.any() else 0.0
                hi_ctx = low * wavelen[full].min() if full.any() else np.inf
                for ctx in ctx_pref:
                    if lo_ctx < ctx < hi_ctx:
                        candidates.append((ctx, low, high))
                if np.isfinite(hi_ctx) and lo_ctx < hi_ctx:
                    candidates.append(((lo_ctx + hi_ctx) / 2, low, high))

    def nice(x: float) -> float:
        r = round(x * 4) / 4  # factors in the wild are multiples of 1/4
        return r if abs(r - x) < 1e-6 * max(1.0, abs(x)) else x

    def rank(c: tuple[float, float, float]) -> tuple[bool, bool]:
        return nice(c[1]) != c[1] or nice(c[2]) != c[2], nice(c[1]) != 1.0

    for ctx, low, high in sorted(candidates, key=rank):  # stable: ctx_pref order within a rank
        low, high = nice(low), nice(high)
        ctx = int(round(ctx)) if abs(ctx - round(ctx)) < 1e-6 * ctx else ctx
        if not (0 < low < high):
            continue
        ref = llama3_rope_factors(base, dim, factor, low, high, ctx)
        if np.allclose(ref, f, rtol=1e-4, atol=1e-5):
            return {
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low,
                "high_freq_factor": high,
                "original_max_position_embeddings": ctx,
            }
    raise ModelLoadError(
        "GGUF has a rope_freqs tensor that matches no llama3 RoPE scaling; "
        "convert the model from its HF checkpoint instead"
    )
