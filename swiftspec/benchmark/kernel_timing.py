"""The kernel benchmarks' common ground: the model shapes (:data:`MODELS`), the :class:`Case`
record of one comparison, interleaved timing (:func:`time_interleaved`) and the markdown table
(:func:`table`). The cases: :mod:`swiftspec.benchmark.kernel_cases`,
:mod:`swiftspec.benchmark.kernel_quant`, :mod:`swiftspec.benchmark.kernel_comm`; the command line:
:mod:`swiftspec.benchmark.kernels`.
"""
from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

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


def device_sync(device) -> Callable[[], None]:
    """The call that waits for ``device``'s queued work before a clock is read: ``torch.cuda.synchronize``
    on CUDA, a no-op on the CPU (its ops return when done)."""
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
