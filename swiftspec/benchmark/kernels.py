"""Kernel microbenchmarks: each latency op against its unfused / library baselines, side by side.

    python bench/kernels.py                       # all ops, CPU twins here, CUDA kernels on a GPU
    python bench/kernels.py --ops allreduce --json out.json

Shapes follow the SwiftSpec paper's Table 7 (Llama-3 1B / 3B / 8B / 70B at TP 1/2/4/8, batch 8,
context 500 and 1000; scaled down where a shape does not fit this machine) plus the default pair's
(Qwen2.5-Coder 1.5B target, 0.5B draft). On CPU:

- ``allreduce``: the shared-memory LL one-shot all-reduce vs ``torch.distributed.all_reduce`` over
  gloo, 2 processes pinned to their own cores, messages of 1 KiB to 1 MiB;
- ``gemm_ar``: the fused GEMM + all-reduce vs ``x @ w.T`` then gloo all-reduce, TP = 2, batch 8;
- ``swiglu``: the fused SwiGLU vs PyTorch's best arrangement (one concatenated gate/up matmul, then
  SiLU * mul) and vs two separate matmuls, batch 1 and 8;
- ``linear``: the skinny-GEMM linear layer (QKV, o_proj, down_proj) vs ``F.linear``;
- ``rms_norm``: the fused residual add + RMSNorm (the C++ twin here, ``norm.cu`` on CUDA) vs the
  PyTorch path (``reference.rms_norm``: add, upcast, square, mean, rsqrt, scale, round, weight),
  1 / 8 / 16 rows of each model's hidden size;
- ``silu_mul``: SwiGLU's activation after the quantized GEMM (``ops.silu_and_mul`` on the fp32
  ``[M, 2I]`` gate | up sums, result in fp32 / bf16) vs the PyTorch path (SiLU of the strided gate
  half, multiply, cast), 1 / 8 / 16 / 512 rows of each model's intermediate size (CPU only);
- ``quant_linear``: the quantized GEMM on GGUF blocks (the default target's Q4_K / Q6_K layers, 1-16
  rows, every kernel this CPU runs, GB/s of weights) vs the kernels-off PyTorch path and ``F.linear``
  on dequantized fp32 / bf16 weights (CPU only);
- ``int8_linear``: the int8 weight-only twin (the draft's layers) vs torch's int8 weight-only kernel
  (``_weight_int8pack_mm``), bf16 activations, 1 / 2 / 4 rows (CPU only);
- ``attention``: the tree attention (RoPE fused) vs the PyTorch path (``swiftspec.ops.attention.torch_tree_attention``:
  RoPE, then row by row over the keys each row sees up to 16 rows, SDPA with a materialized mask
  above), 8 queries over 500 / 1000 cached keys.

On CUDA the same cases compare our kernels with cuBLAS + NCCL and SDPA (and FlashInfer when it is
installed). Every case alternates ours and the baseline for ``--rounds`` rounds, each round timing
``--iters`` calls; the table gives the median per-call time and the spread (10th-90th percentile of
the round medians). Timings here are noisy: read the ratios, measured in the same run.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

# (name, hidden, intermediate, q heads, kv heads, head dim)
MODELS = {
    "llama3-1b": (2048, 8192, 32, 8, 64),
    "llama3-3b": (3072, 8192, 24, 8, 128),
    "llama3-8b": (4096, 14336, 32, 8, 128),
    "llama3-70b": (8192, 28672, 64, 8, 128),
    "qwen-1.5b (target)": (1536, 8960, 12, 2, 128),
    "qwen-0.5b (draft)": (896, 4864, 14, 2, 64),
}
# the weight bytes a shape may use on this machine (the 70B MLP at TP 1 is ~940 MB in bf16)
MAX_WEIGHT_BYTES = 600 * 2 ** 20


@dataclass
class Case:
    """One measured comparison: ``ours`` against every baseline, per-call seconds."""

    op: str
    shape: str
    dtype: str
    threads: int
    ours: list[float] = field(default_factory=list)
    baselines: dict[str, list[float]] = field(default_factory=dict)
    weight_bytes: int = 0  # bytes of weights our op reads per call (0: not a weight-streaming op)

    def summary(self) -> dict:
        """The case as a JSON-able record: op, shape, dtype, threads, ``ours`` and each baseline's
        :func:`_stats` (per-call seconds: median and spread), ``speedup`` per baseline (its median /
        ours), and for weight-streaming ops ``weight_bytes`` and ``ours_gb_s`` (weight GB/s, 1e9 bytes)."""
        out = {"op": self.op, "shape": self.shape, "dtype": self.dtype, "threads": self.threads,
               "ours": _stats(self.ours)}
        out["baselines"] = {k: _stats(v) for k, v in self.baselines.items()}
        out["speedup"] = {k: out["baselines"][k]["median_s"] / out["ours"]["median_s"] for k in self.baselines}
        if self.weight_bytes:
            out["weight_bytes"] = self.weight_bytes
            out["ours_gb_s"] = self.weight_bytes / out["ours"]["median_s"] / 1e9
        return out


def _stats(xs: list[float]) -> dict:
    xs = sorted(xs)
    q = statistics.quantiles(xs, n=10, method="inclusive") if len(xs) > 1 else [xs[0]] * 9
    return {"median_s": statistics.median(xs), "p10_s": q[0], "p90_s": q[-1], "rounds": len(xs)}


def time_interleaved(fns: dict[str, Callable[[], object]], rounds: int, iters: int,
                     sync: Callable[[], None] = lambda: None) -> dict[str, list[float]]:
    """Per-call seconds of each function, one entry per round; functions alternate every round so
    drifting machine load hits them alike."""
    out = {k: [] for k in fns}
    for f in fns.values():  # warm-up (JIT loads, allocator, caches)
        f()
    sync()
    for _ in range(rounds):
        for k, f in fns.items():
            sync()
            t0 = time.perf_counter()
            for _ in range(iters):
                f()
            sync()
            out[k].append((time.perf_counter() - t0) / iters)
    return out


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
                    t = time_interleaved(fns, rounds, iters, _sync(device))
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
                    t = time_interleaved(fns, rounds, iters, _sync(device))
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
                    t = time_interleaved(fns, rounds, iters, _sync("cpu"))
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
                        t = time_interleaved(fns, rounds, iters, _sync(device))
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
                    t = time_interleaved(fns, rounds, iters, _sync("cpu"))
                    cases.append(Case("int8_linear", f"{name} {what} M={m} K={k} N={n}", "int8/bfloat16", threads,
                                      t.pop("ours"), t))
    return cases


# ---- quantized linear (GGUF blocks) ------------------------------------------------------
def _random_blocks(n: int, k: int, ggml_type: int, g: torch.Generator) -> torch.Tensor:
    """``[n, row_bytes]`` uint8 GGUF blocks: random quants and scales, fp16 super-block scales set
    to a small normal value (random bytes could be inf / NaN)."""
    from swiftspec.ops import quant

    raw = torch.randint(0, 256, (n, quant.row_bytes(ggml_type, k)), dtype=torch.uint8, generator=g)
    bb = quant.row_bytes(ggml_type, quant.block_values(ggml_type))
    blocks = raw.view(n, -1, bb)
    small = torch.tensor([0x00, 0x10], dtype=torch.uint8)  # fp16 0x1000 = 2^-11
    fields = {12: (0, 2), 13: (0, 2), 14: (208,)}.get(ggml_type, (0,))  # d (and dmin) offsets
    for off in fields:
        blocks[:, :, off:off + 2] = small
    if ggml_type == quant.AWQ4:  # zero 0..15, reserved byte 0
        blocks[:, :, 2] &= 0xF
        blocks[:, :, 3] = 0
    return raw


def _torch_int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """AWQ4 blocks ``[n, row_bytes]`` -> torch's int4 CPU format with one group per block (32):
    ``(packed weight, [K / 32, n, 2] bf16 scale and zero)``, ``w = (q - 8) * scale + zero`` with
    ``zero = (8 - z) * d`` (rounded to bf16: a speed baseline, not an exact one)."""
    n = w.shape[0]
    blk = w.view(n, -1, 20)
    q = torch.cat([blk[..., 4:20] & 0xF, blk[..., 4:20] >> 4], -1).reshape(n, -1).int()
    d = blk[..., 0:2].contiguous().view(torch.float16).float().squeeze(-1)  # [n, K/32]
    z = blk[..., 2].float()
    sz = torch.stack([d.T, ((8 - z) * d).T], -1).to(torch.bfloat16).contiguous()
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1), sz


def quant_linear_cases(threads_list, rounds, iters, rows=(1, 2, 4, 8, 16)) -> list[Case]:
    """The default target's GGUF layers (Q4_K gate+up, Q6_K down_proj, K = 1536 / 8960) and its
    gate+up as an AWQ checkpoint would load (AWQ4 blocks): our quantized GEMM on the blocks in place
    (``auto`` = the ISA dispatch picks; every other kernel this CPU runs is listed beside it; each
    type in the interleaved layout the engine loads, the file's plain layout beside it) vs
    the kernels-off PyTorch path of the same arithmetic (int8 activations x dequantized fp32
    weights) and vs ``F.linear`` on weights dequantized to fp32 and bf16 once. torch's int4 CPU
    kernel (``_weight_int4pack_mm_for_cpu``, bf16 activations) is a baseline for AWQ4 only: its
    format (one asymmetric scale + zero per group) holds AWQ's groups but not Q4_K's 6-bit
    sub-scales and mins or Q6_K without re-quantizing, i.e. a different model."""
    from swiftspec import ops
    from swiftspec.ops import cpu, quant

    ext = cpu.load()
    g = torch.Generator().manual_seed(0)
    hidden, inter = MODELS["qwen-1.5b (target)"][:2]
    cases = []
    for what, ggml_type, k, n in (("gate_up", 12, hidden, 2 * inter), ("down_proj", 14, inter, hidden),
                                  ("gate_up", quant.AWQ4, hidden, 2 * inter)):
        w = _random_blocks(n, k, ggml_type, g)
        group = ops.quant_interleave_rows()
        tk = quant.interleaved_type(ggml_type, n, 0, group) if group else ggml_type  # as the engine loads it
        inter = tk != ggml_type
        wk = quant.interleave(w, tk) if inter else w
        # the other kernels read the 8-row layout where the dispatched one reads 16 rows
        t8 = ggml_type | quant.X8 if quant.group_rows(tk) == 16 else tk
        w8 = quant.interleave(w, t8) if t8 != tk else wk
        int4 = _torch_int4(w) if ggml_type == quant.AWQ4 else None
        w32 = quant.dequantize(w, ggml_type)
        w16 = w32.to(torch.bfloat16)
        others = ext.quant_impls()[1:]  # the kernels this CPU runs besides the dispatched one
        for m in rows:
            x = torch.randn(m, k, generator=g)
            x16 = x.to(torch.bfloat16)
            for threads in threads_list:
                torch.set_num_threads(threads)
                fns = {"ours": lambda: ext.quant_linear(x, [wk], [tk], "auto")}
                if inter:
                    fns["ours, plain layout"] = lambda: ext.quant_linear(x, [w], [ggml_type], "auto")
                for impl in others:
                    wi, ti = (wk, tk) if impl in ("avx512_vnni_512", "scalar") else (w8, t8)
                    fns[f"ours, {impl} kernel, {quant.ggml_name(ti)}"] = \
                        lambda impl=impl, wi=wi, ti=ti: ext.quant_linear(x, [wi], [ti], impl)
                fns["kernels off (int8 x fp32, PyTorch)"] = lambda: quant.torch_linear(x, [w], [ggml_type], [w32])
                fns["F.linear fp32 dequantized"] = lambda: F.linear(x, w32)
                fns["F.linear bf16 dequantized"] = lambda: F.linear(x16, w16)
                if int4 is not None:
                    fns["torch int4 (bf16, group 32)"] = \
                        lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x16, int4[0], 32, int4[1])
                t = time_interleaved(fns, rounds, iters, _sync("cpu"))
                shape = (f"qwen-1.5b (target) {what} {quant.ggml_name(tk)} M={m} K={k} N={n} "
                         f"({w.numel() / 2 ** 20:.1f} MiB; kernel {ext.quant_impls()[0]})")
                cases.append(Case("quant_linear", shape, "float32", threads, t.pop("ours"), t,
                                  weight_bytes=w.numel()))
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
                    t = time_interleaved(fns, rounds, iters, _sync(device))
                    cases.append(Case("tree_attention", f"{name} TP{tp} Hq={hq_l} Hk={hk_l} D={d} "
                                      f"q={n_queries} ctx={ctx}", str(dtype)[6:], threads, t.pop("ours"), t))
    return cases


# ---- collectives (2 processes) -----------------------------------------------------------
def _comm_worker(rank: int, size: int, port: int, ops_: list[str], dtypes: list[str], rounds: int, iters: int,
                 conn) -> None:
    from swiftspec.distributed.parallel import init_world

    try:
        if hasattr(os, "sched_setaffinity"):
            cores = sorted(os.sched_getaffinity(0))
            os.sched_setaffinity(0, [cores[rank % len(cores)]])
        torch.set_num_threads(1)
        tp = init_world(rank, size, port, [list(range(size))], shm_comm=True)[0]
        if tp.shm is None:
            raise RuntimeError("the shared-memory communicator was not set up")
        import torch.distributed as dist

        def barrier():
            dist.barrier(group=tp.group)

        cases = []
        for dname in dtypes:
            dtype = getattr(torch, dname)
            if "allreduce" in ops_:
                for nbytes in (1 << 10, 4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20):
                    x = torch.randn(nbytes // dtype.itemsize, dtype=dtype)
                    y = x.float()
                    fns = {"ours": lambda: tp.shm.all_reduce(x),
                           "gloo all_reduce": lambda: dist.all_reduce(y, group=tp.group)}
                    t = time_interleaved(fns, rounds, iters, barrier)
                    cases.append(Case("allreduce", f"{size} ranks, {nbytes // 1024} KiB", dname, 1, t.pop("ours"), t))
            if "gemm_ar" in ops_:
                for name in ("qwen-1.5b (target)", "qwen-0.5b (draft)", "llama3-1b", "llama3-3b", "llama3-8b"):
                    hidden, inter, hq, _, d = MODELS[name]
                    for what, k_full in (("o_proj", hq * d), ("down_proj", inter)):
                        k = -(-k_full // size)
                        w = torch.randn(hidden, k, dtype=dtype) * 0.02
                        x = torch.randn(8, k, dtype=dtype)

                        def unfused():
                            z = (x @ w.t()).float()
                            dist.all_reduce(z, group=tp.group)
                            return z.to(dtype)

                        fns = {"ours": lambda: tp.shm.gemm_all_reduce(x, w, None),
                               "matmul + gloo all_reduce": unfused}
                        t = time_interleaved(fns, rounds, iters, barrier)
                        cases.append(Case("gemm_allreduce", f"{name} {what} TP{size} M=8 K={k} N={hidden}", dname, 1,
                                          t.pop("ours"), t))
        if rank == 0:
            conn.send(("ok", [asdict(c) for c in cases]))
    except Exception as e:  # report instead of hanging the parent
        import traceback
        conn.send(("error", f"rank {rank}: {e}\n{traceback.format_exc()}"))
    finally:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()


def comm_cases(ops_, dtypes, rounds, iters, size=2) -> list[Case]:
    """The collectives in ``ops_`` (``"allreduce"``: the shared-memory LL all-reduce against gloo
    ``all_reduce``, 1 KiB to 1 MiB; ``"gemm_ar"``: the fused GEMM + all-reduce against matmul then
    gloo, M = 8) measured by ``size`` spawned ranks on this host, per dtype; rank 0's
    :class:`Case` list.

    Raises:
        RuntimeError: a rank failed (its traceback in the message) or no reply within an hour.
    """
    import multiprocessing as mp

    from swiftspec.distributed.parallel import free_tcp_port

    ctx = mp.get_context("spawn")
    port = free_tcp_port()
    pipes = [ctx.Pipe(duplex=False) for _ in range(size)]
    procs = [ctx.Process(target=_comm_worker, args=(r, size, port, ops_, [str(d)[6:] for d in dtypes], rounds,
                                                    iters, pipes[r][1]), daemon=True) for r in range(size)]
    for p in procs:
        p.start()
    try:
        from multiprocessing.connection import wait
        deadline = time.monotonic() + 3600
        while True:
            ready = wait([r for r, _ in pipes], timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise RuntimeError("collective benchmark timed out")
            for conn in ready:
                status, payload = conn.recv()
                if status == "error":
                    raise RuntimeError(payload)
                return [Case(**c) for c in payload]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


def _sync(device) -> Callable[[], None]:
    if torch.device(device).type == "cuda":
        return torch.cuda.synchronize
    return lambda: None


# ---- report ------------------------------------------------------------------------------
def table(cases: list[Case]) -> str:
    """A markdown table in the layout of the paper's Table 7: per case, our median per-call time
    (and the weight bytes it streams per second, for weight-streaming ops), each baseline's, and
    the speedup over it."""
    return summary_table([c.summary() for c in cases])


def summary_table(summaries: list[dict]) -> str:
    """:func:`table` from :meth:`Case.summary` records (as the ``--json`` file stores them)."""
    lines = ["| op | shape | dtype | threads | ours (us) | baseline | baseline (us) | speedup |",
             "|---|---|---|---|---|---|---|---|"]
    for s in summaries:
        o = s["ours"]
        gbs = f" ({s['ours_gb_s']:.1f} GB/s)" if "ours_gb_s" in s else ""
        for k, b in s["baselines"].items():
            lines.append(f"| {s['op']} | {s['shape']} | {s['dtype']} | {s['threads']} | {o['median_s'] * 1e6:.1f} "
                         f"[{o['p10_s'] * 1e6:.0f}-{o['p90_s'] * 1e6:.0f}]{gbs} | {k} | {b['median_s'] * 1e6:.1f} "
                         f"[{b['p10_s'] * 1e6:.0f}-{b['p90_s'] * 1e6:.0f}] | {s['speedup'][k]:.2f}x |")
    return "\n".join(lines)


def machine() -> str:
    """One line naming the machine the cases ran on: CPU model, CPU count, GPU name (or "no GPU")
    and the torch version."""
    from swiftspec.engine.machine_profile import cpu_model_name

    cpu = cpu_model_name()
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return f"{cpu}, {os.cpu_count()} cores, {gpu}, torch {torch.__version__}"


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``bench/kernels.py``: ops, dtypes, intra-op thread counts, rounds and
    calls per round, model shapes, input rows, device and the JSON output file."""
    ap = argparse.ArgumentParser(prog="bench/kernels.py", description=__doc__.splitlines()[0])
    ops_ = ["allreduce", "gemm_ar", "swiglu", "linear", "rms_norm", "silu_mul", "int8_linear", "quant_linear",
            "attention"]
    ap.add_argument("--ops", nargs="+", default=ops_, choices=ops_)
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float32"])
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2], help="intra-op threads (CPU)")
    ap.add_argument("--rounds", type=int, default=9, help="alternating rounds per case")
    ap.add_argument("--iters", type=int, default=20, help="calls per round")
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS),
                    help="model shapes for swiglu / attention")
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 8], help="input rows M of the swiglu cases")
    ap.add_argument("--quant-rows", nargs="+", type=int, default=[1, 2, 4, 8, 16],
                    help="input rows M of the quant_linear cases")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", help="write the records (median and spread per case) to this file")
    return ap


def main(argv=None) -> int:
    """Run the cases ``argv`` selects (the collectives and the CPU-only ops only on ``--device cpu``),
    print the backend, the machine and the table, and with ``--json`` write every case's summary
    with the machine and argv. Returns the exit status (0)."""
    args = build_parser().parse_args(argv)
    dtypes = [getattr(torch, d) for d in args.dtypes]
    from swiftspec import ops

    print(f"# machine: {machine()}", file=sys.stderr)
    cases: list[Case] = []
    if args.device == "cpu" and ({"allreduce", "gemm_ar"} & set(args.ops)):
        cases += comm_cases([o for o in args.ops if o in ("allreduce", "gemm_ar")], dtypes, args.rounds, args.iters)
    if "swiglu" in args.ops:
        cases += swiglu_cases(dtypes, args.threads, args.rounds, args.iters, args.device, args.models, args.rows)
    if "linear" in args.ops:
        cases += linear_cases(dtypes, args.threads, args.rounds, args.iters, args.device, args.models)
    if "rms_norm" in args.ops:
        cases += rms_norm_cases(dtypes, args.threads, args.rounds, args.iters, args.device, args.models)
    if "silu_mul" in args.ops and args.device == "cpu":
        cases += silu_mul_cases(dtypes, args.threads, args.rounds, args.iters, args.models)
    if "int8_linear" in args.ops and args.device == "cpu":
        cases += int8_linear_cases(args.threads, args.rounds, args.iters, args.models)
    if "quant_linear" in args.ops and args.device == "cpu":
        cases += quant_linear_cases(args.threads, args.rounds, args.iters, args.quant_rows)
    if "attention" in args.ops:
        cases += attention_cases(dtypes, args.threads, args.rounds, args.iters, args.device, args.models)
    probe = torch.empty(0, device=args.device)
    print(f"backend: {ops.backend(probe)}; machine: {machine()}")
    print(table(cases))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine(), "argv": sys.argv, "cases": [c.summary() for c in cases]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
