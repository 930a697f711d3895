"""The single-op kernel cases, each op against its unfused / library baselines: the fused SwiGLU,
the fused residual add + RMSNorm, SwiGLU's activation after the quantized GEMM, the skinny-GEMM
linear layer, the int8 weight-only linear and the tree attention (shapes and timing:
:mod:`swiftspec.benchmark.kernel_timing`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from swiftspec.benchmark.kernel_timing import (
    MAX_WEIGHT_BYTES,
    MODELS,
    Case,
    device_sync,
    time_interleaved,
)


# ---- SwiGLU ------------------------------------------------------------------------------
def swiglu_cases(dtypes, threads_list, rounds, iters, device, models=tuple(MODELS), rows=(1, 8)) -> list[Case]:
    """Fused SwiGLU (``ops.swiglu``) against one concatenated gate/up matmul + SiLU * mul and against
    two matmuls, for every model in ``models`` at TP 1/2/4/8 (the rank's ``I = ceil(I / TP)``
    rows; shapes over :data:`MAX_WEIGHT_BYTES` and Qwen above TP 2 left out), ``rows`` input rows
    each, every dtype in ``dtypes`` and intra-op thread count in ``threads_list``; weights
    ``[2 * I, hidden]`` on ``device``. ``rounds`` x ``iters`` calls alternate ours and the baselines
    (:func:`time_interleaved`). Returns one :class:`Case` per shape, dtype and thread count."""
    from swiftspec import ops
    from swiftspec.ops import reference

    cases = []
    shapes = [(m, tp) for m in models for tp in (1, 2, 4, 8)]
    for dtype in dtypes:
        for name, tp in shapes:
            hidden, inter = MODELS[name][:2]
            i_local = -(-inter // tp)
            if 2 * i_local * hidden * dtype.itemsize > MAX_WEIGHT_BYTES:
                continue
            if name.startswith("qwen") and tp > 2:
                continue
            w = torch.randn(2 * i_local, hidden, dtype=dtype, device=device) * 0.02
            wg, wu = w[:i_local].contiguous(), w[i_local:].contiguous()
            for m in rows:
                x = torch.randn(m, hidden, dtype=dtype, device=device)
                for threads in threads_list:
                    torch.set_num_threads(threads)
                    fns = {"ours": lambda: ops.swiglu(x, w),
                           "concat matmul + silu*mul": lambda: reference.swiglu(x, w),
                           "two matmuls + silu*mul": lambda: F.silu(x @ wg.t()) * (x @ wu.t())}
                    t = time_interleaved(fns, rounds, iters, device_sync(device))
                    c = Case("swiglu", f"{name} TP{tp} M={m} K={hidden} I={i_local}", str(dtype)[6:], threads,
                             t.pop("ours"), t)
                    cases.append(c)
    return cases


# ---- RMSNorm -----------------------------------------------------------------------------
def rms_norm_cases(dtypes, threads_list, rounds, iters, device, models=tuple(MODELS), rows=(1, 8, 16)) -> list[Case]:
    """Fused residual add + RMSNorm (``ops.rms_norm``, eps 1e-6) against the PyTorch path
    (``reference.rms_norm``) on ``rows`` x hidden inputs of every model in ``models``, per dtype and
    thread count, on ``device``; one :class:`Case` each (per-call seconds)."""
    from swiftspec import ops
    from swiftspec.ops import reference

    cases = []
    for dtype in dtypes:
        for name in models:
            hidden = MODELS[name][0]
            w = torch.randn(hidden, dtype=dtype, device=device)
            for m in rows:
                x, res = (torch.randn(m, hidden, dtype=dtype, device=device) for _ in range(2))
                for threads in threads_list:
                    torch.set_num_threads(threads)
                    fns = {"ours": lambda: ops.rms_norm(x, res, w, 1e-6),
                           "PyTorch ops": lambda: reference.rms_norm(x, res, w, 1e-6)}
                    t = time_interleaved(fns, rounds, iters, device_sync(device))
                    cases.append(Case("rms_norm", f"{name} M={m} H={hidden}", str(dtype)[6:], threads, t.pop("ours"), t))
    return cases


def silu_mul_cases(dtypes, threads_list, rounds, iters, models=tuple(MODELS), rows=(1, 8, 16, 512)) -> list[Case]:
    """SwiGLU's activation on the quantized GEMM's fp32 ``[M, 2 * I]`` gate | up sums
    (``ops.silu_and_mul``, result in each of ``dtypes``) against the PyTorch path, ``rows`` rows of
    every model's intermediate size, per thread count, on the CPU; one :class:`Case` each."""
    from swiftspec import ops
    from swiftspec.ops import reference

    cases = []
    for dtype in dtypes:
        for name in models:
            inter = MODELS[name][1]
            for m in rows:
                gu = torch.randn(m, 2 * inter)
                for threads in threads_list:
                    torch.set_num_threads(threads)
                    fns = {"ours": lambda: ops.silu_and_mul(gu, dtype),
                           "PyTorch ops": lambda: reference.silu_and_mul(gu, dtype)}
                    t = time_interleaved(fns, rounds, iters, device_sync("cpu"))
                    cases.append(Case("silu_mul", f"{name} M={m} I={inter}", str(dtype)[6:], threads,
                                      t.pop("ours"), t))
    return cases


# ---- linear ------------------------------------------------------------------------------
def linear_cases(dtypes, threads_list, rounds, iters, device, models=tuple(MODELS)) -> list[Case]:
    """The decode-time linear layers (skinny GEMM, M <= 16) of each model at TP 1: QKV, o_proj,
    down_proj; ours vs ``F.linear`` (oneDNN on CPU, cuBLAS on CUDA)."""
    from swiftspec import ops

    cases = []
    for dtype in dtypes:
        for name in models:
            hidden, inter, hq, hk, d = MODELS[name]
            for what, k, n in (("qkv", hidden, (hq + 2 * hk) * d), ("o_proj", hq * d, hidden),
                               ("down_proj", inter, hidden)):
                if n * k * dtype.itemsize > MAX_WEIGHT_BYTES:
                    continue
                w = torch.randn(n, k, dtype=dtype, device=device) * 0.02
                for m in (1, 8):
                    x = torch.randn(m, k, dtype=dtype, device=device)
                    for threads in threads_list:
                        torch.set_num_threads(threads)
                        fns = {"ours": lambda: ops.linear(x, w), "F.linear": lambda: F.linear(x, w)}
                        t = time_interleaved(fns, rounds, iters, device_sync(device))
                        cases.append(Case("linear", f"{name} {what} M={m} K={k} N={n}", str(dtype)[6:], threads,
                                          t.pop("ours"), t))
    return cases


def int8_linear_cases(threads_list, rounds, iters, models=tuple(MODELS)) -> list[Case]:
    """The draft's int8 layers (gate/up, down_proj, QKV) at TP 1: the CPU twin (called directly,
    whatever the row cut-over of ``ops.int8_linear``) vs torch's int8 kernel, bf16 activations."""
    from swiftspec.model_executor.layers.quant import quantize_int8
    from swiftspec.ops import cpu

    ext = cpu.load()
    cases = []
    for name in models:
        hidden, inter, hq, hk, d = MODELS[name]
        for what, k, n in (("gate_up", hidden, 2 * inter), ("down_proj", inter, hidden),
                           ("qkv", hidden, (hq + 2 * hk) * d)):
            if n * k > MAX_WEIGHT_BYTES:
                continue
            q, scales = quantize_int8(torch.randn(n, k) * 0.02)
            s16 = scales.to(torch.bfloat16)
            for m in (1, 2, 4):
                x = torch.randn(m, k, dtype=torch.bfloat16)
                for threads in threads_list:
                    torch.set_num_threads(threads)
                    fns = {"ours": lambda: ext.int8_linear(x, q, s16),
                           "torch _weight_int8pack_mm": lambda: torch.ops.aten._weight_int8pack_mm(x, q, s16)}
                    t = time_interleaved(fns, rounds, iters, device_sync("cpu"))
                    cases.append(Case("int8_linear", f"{name} {what} M={m} K={k} N={n}", "int8/bfloat16", threads,
                                      t.pop("ours"), t))
    return cases


# ---- tree attention ----------------------------------------------------------------------
def attention_cases(dtypes, threads_list, rounds, iters, device, models=tuple(MODELS), n_queries=8) -> list[Case]:
    """Tree attention with fused RoPE (``ops.tree_attention``) against the kernels-off PyTorch path
    (``swiftspec.ops.attention.torch_tree_attention``): ``n_queries`` tree queries over 500 and 1000 cached keys, the
    rank's heads of every model in ``models`` at TP 1/2/4/8 (head counts that do not divide, and
    Qwen above TP 1, left out), a draft-tree mask (each query sees the context, itself and a random
    earlier node), per dtype and thread count, on ``device``; one :class:`Case` each."""
    from swiftspec import ops
    from swiftspec.ops.attention import torch_tree_attention

    cases = []
    for dtype in dtypes:
        for name, tp in [(m, tp) for m in models for tp in (1, 2, 4, 8)]:
            _, _, hq, hk, d = MODELS[name]
            if hq % tp or (name.startswith("qwen") and tp > 1):
                continue
            hq_l, hk_l = hq // tp, max(1, hk // tp)
            for ctx in (500, 1000):
                S = ctx + n_queries
                cap = S + 64
                g = torch.Generator().manual_seed(0)
                q = torch.randn(n_queries, hq_l, d, generator=g).to(device, dtype)
                kn = torch.randn(n_queries, hk_l, d, generator=g).to(device, dtype)
                vn = torch.randn(n_queries, hk_l, d, generator=g).to(device, dtype)
                kc = torch.randn(hk_l, cap, d, generator=g).to(device, dtype)
                vc = torch.randn(hk_l, cap, d, generator=g).to(device, dtype)
                slots = torch.arange(ctx, S, device=device)
                pos = slots.clone()
                inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
                fr = torch.outer(torch.arange(cap).float(), inv)
                cos, sin = torch.cat((fr, fr), -1).cos().to(device), torch.cat((fr, fr), -1).sin().to(device)
                mask = torch.zeros(n_queries, S, dtype=torch.bool, device=device)
                mask[:, :ctx] = True
                # a draft-tree mask: each query sees itself and a random earlier tree node chain
                for i in range(n_queries):
                    mask[i, ctx + i] = True
                    if i:
                        mask[i, ctx + int(torch.randint(0, i, (1,), generator=g))] = True
                args = (q, kn, vn, kc, vc, slots, pos, cos, sin, mask, d ** -0.5)
                for threads in threads_list:
                    torch.set_num_threads(threads)
                    fns = {"ours": lambda: ops.tree_attention(*args),
                           "PyTorch path (kernels off)": lambda: torch_tree_attention(*args)}
                    t = time_interleaved(fns, rounds, iters, device_sync(device))
                    cases.append(Case("tree_attention", f"{name} TP{tp} Hq={hq_l} Hk={hk_l} D={d} "
                                      f"q={n_queries} ctx={ctx}", str(dtype)[6:], threads, t.pop("ours"), t))
    return cases
