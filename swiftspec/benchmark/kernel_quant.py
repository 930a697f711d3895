"""The quantized-GEMM kernel cases (CPU only): our GEMM on GGUF blocks (and AWQ4 blocks) in place,
every kernel this CPU runs and both weight layouts, against the kernels-off PyTorch path,
``F.linear`` on dequantized weights and torch's int4 kernel; random blocks of each type.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from swiftspec.benchmark.kernel_timing import (
    MODELS,
    Case,
    device_sync,
    time_interleaved,
)


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
                t = time_interleaved(fns, rounds, iters, device_sync("cpu"))
                shape = (f"qwen-1.5b (target) {what} {quant.ggml_name(tk)} M={m} K={k} N={n} "
                         f"({w.numel() / 2 ** 20:.1f} MiB; kernel {ext.quant_impls()[0]})")
                cases.append(Case("quant_linear", shape, "float32", threads, t.pop("ours"), t,
                                  weight_bytes=w.numel()))
    return cases
