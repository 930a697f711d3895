"""PyTorch references of the latency ops: the fallback path and the oracle the kernels are tested
against. Each function has the same signature and semantics as its CPU twin (``csrc/cpu``) and CUDA
kernel (``csrc/kernels``); SwiftSpec paper section 3.3.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu(x: torch.Tensor, w_gate_up: torch.Tensor) -> torch.Tensor:
    """Fused SwiGLU: ``SiLU(x @ W_gate^T) * (x @ W_up^T)``.

    Shapes: x ``[M, K]``; w_gate_up ``[2 * I, K]`` with the gate rows first, then the up rows (the
    layout of ``MergedColumnParallelLinear``). Returns ``[M, I]`` in x's dtype. Computed as PyTorch's
    best arrangement: one concatenated matmul, then SiLU(gate) * up.
    """
    gu = x @ w_gate_up.t()
    gate, up = gu.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(gate_up: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """SwiGLU's activation over a merged projection: ``[..., 2I] -> [..., I]``, ``SiLU(gate) * up``
    with ``gate_up = [gate | up]`` on the last dim, in gate_up's dtype, then cast to ``dtype``
    (None: kept)."""
    gate, up = gate_up.chunk(2, dim=-1)
    y = F.silu(gate) * up
    return y if dtype is None else y.to(dtype)


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Linear layer ``x @ w.T (+ bias)``: exactly ``F.linear``.

    Shapes: x ``[..., K]``; w ``[N, K]``; bias ``[N]`` or None; one dtype. Returns ``[..., N]`` in
    x's dtype. The CPU twin (``csrc/cpu/linear.cpp``) accumulates in float32 and adds the bias
    before its one rounding, so it matches this to float32 rounding (fp32) or one bf16 rounding.
    """
    return F.linear(x, w, bias)


def int8_linear(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Int8 weight-only linear: dequantize ``q * scales[:, None]`` to x's dtype, then ``F.linear``.

    Shapes: x ``[..., K]`` fp32/bf16; q ``[N, K]`` int8; scales ``[N]`` float. Returns ``[..., N]``
    in x's dtype. The CPU twin applies the scale after an fp32 dot product instead (one rounding),
    so the two agree to the weight rounding of the dequantized table.
    """
    return F.linear(x, q.to(x.dtype) * scales.to(x.dtype)[:, None])


def rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
             eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm with the fused residual add (vLLM's ``fused_add_rms_norm``).

    x, residual ``[..., H]`` (residual may be None), weight ``[H]``, one dtype. ``x + residual`` is
    formed in x's dtype; statistics in float32; the normalized value is rounded to x's dtype before
    the weight multiply. Returns ``(weight * norm(x + residual), x + residual)``, or ``(.., x)``
    without a residual.
    """
    if residual is not None:
        x = x + residual
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype), x


def rope_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. x ``[n, H, D]``; cos, sin ``[n, D]`` float32. Returns x's dtype."""
    h = x.shape[-1] // 2
    xf = x.float()
    rot = torch.cat((-xf[..., h:], xf[..., :h]), dim=-1)
    return (xf * cos.unsqueeze(1) + rot * sin.unsqueeze(1)).to(x.dtype)


def tree_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                   positions: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor,
                   mask: torch.Tensor, scale: float) -> torch.Tensor:
    """RoPE, KV write and masked attention of a few query tokens over prefix + tree cache.

    1. RoPE (rotate-half) at ``positions`` is applied to ``q`` and ``k_new``.
    2. The rotated ``k_new`` and ``v_new`` are written into cache slot ``slots[i]``; a negative slot
       is not written (padding rows of a CUDA-graph batch).
    3. Query ``i`` attends to cache slots ``j < S`` with ``mask[i, j]`` True (non-square mask; the
       draft's expansion mask is ``[w, prefix + tree]``, the target's verification mask ``[bs, ...]``).
       A fully masked row returns zeros (FlashInfer's convention: m = -inf, l = 0).

    Shapes / dtypes: q ``[n, Hq, D]``; k_new, v_new ``[n, Hk, D]`` (same dtype as q, fp32 or bf16);
    k_cache, v_cache ``[Hk, C, D]`` (modified in place); slots, positions ``[n]`` int64;
    cos_table, sin_table ``[P, D]`` float32 (rows indexed by position); mask ``[n, S]`` bool with
    ``S <= C``; ``Hq % Hk == 0`` (grouped-query attention). Returns ``[n, Hq * D]`` in q's dtype.
    Softmax is computed in float32.
    """
    n, hq, d = q.shape
    hk = k_new.shape[1]
    cos, sin = cos_table[positions], sin_table[positions]
    q = rope_rotate(q, cos, sin)
    k_new = rope_rotate(k_new, cos, sin)
    keep = slots >= 0
    k_cache[:, slots[keep]] = k_new[keep].transpose(0, 1)
    v_cache[:, slots[keep]] = v_new[keep].transpose(0, 1)
    S = mask.shape[1]
    k = k_cache[:, :S].float().repeat_interleave(hq // hk, dim=0)          # [Hq, S, D]
    v = v_cache[:, :S].float().repeat_interleave(hq // hk, dim=0)
    scores = torch.einsum("nhd,hsd->hns", q.float(), k) * scale            # [Hq, n, S]
    scores = scores.masked_fill(~mask.unsqueeze(0), float("-inf"))
    p = torch.softmax(scores, dim=-1).nan_to_num(0.0)                      # fully masked row -> 0
    out = torch.einsum("hns,hsd->nhd", p, v)
    return out.reshape(n, hq * d).to(q.dtype)


def gemm_all_reduce(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, tp) -> torch.Tensor:
    """Row-parallel linear: ``all_reduce(x @ w^T) (+ bias)`` over the TP group ``tp``.

    Shapes: x ``[M, K_local]``, w ``[N, K_local]``, bias ``[N]`` or None. Returns ``[M, N]`` in x's
    dtype, identical on every rank. ``tp`` is a :class:`swiftspec.distributed.parallel.TPContext`.
    """
    y = tp.all_reduce(x @ w.t())
    return y + bias if bias is not None else y
