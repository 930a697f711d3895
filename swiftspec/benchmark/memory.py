"""The two sides of the benchmarks' "fraction of the bandwidth limit" (bench/native_forward.py,
bench/device_forward.py, bench/gpu_steps.py): the weight bytes one forward reads, and how fast the
device reads (a read-only reduction, measured in the same run; the spec sheet quoted beside it)."""
from __future__ import annotations

import functools
import time

import torch

# Spec-sheet memory bandwidth (bytes/s) by GPU name, to quote beside the measured read bandwidth;
# the fraction of a limit is always taken against the measurement (read_bandwidth), never these.
SPEC_SHEET_BANDWIDTH = (("H200", 4.8e12), ("H100 PCIe", 2.0e12), ("H100 NVL", 3.9e12), ("H100", 3.35e12),
                        ("A100-SXM4-80GB", 2.039e12), ("A100 80GB PCIe", 1.935e12), ("A100", 1.555e12),
                        ("L40S", 0.864e12), ("L4", 0.3e12))


def spec_sheet_bandwidth(gpu_name: str | None) -> float | None:
    """The vendor's memory bandwidth in bytes/s for a GPU name (``torch.cuda.get_device_name``),
    first match of :data:`SPEC_SHEET_BANDWIDTH` by substring, or None for an unknown GPU."""
    for key, bw in SPEC_SHEET_BANDWIDTH:
        if gpu_name and key in gpu_name:
            return bw
    return None


def _best_cuda_seconds(fn, device: torch.device, passes: int) -> float:
    """Best device time of ``fn()`` in seconds over ``passes`` calls after one warm-up (CUDA events)."""
    fn()
    best = float("inf")
    for _ in range(passes):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize(device)
        best = min(best, start.elapsed_time(end) / 1e3)
    return best


def read_bandwidth(device: torch.device, threads: int, gib: float = 4.0, passes: int = 10) -> float:
    """Bytes per second the device's memory sustains when only read: the best of ``passes``
    read-only reductions (``torch.sum``) over one tensor, after a warm-up pass.

    On CUDA a bf16 tensor of ``gib`` GiB (at least 4 GiB: far past every cache), timed with CUDA
    events; on CPU an fp32 tensor of 1 GiB with ``threads`` threads (sets them), wall time. A
    decode step reads its weights once and writes almost nothing, so this, not a copy (which
    reads and writes), is the limit a forward's time is set against.
    """
    if device.type == "cuda":
        n = int(gib * 2 ** 30) // 2
        big = torch.ones(n, dtype=torch.bfloat16, device=device)
        seconds = _best_cuda_seconds(functools.partial(big.sum, dtype=torch.float32), device, passes)
        del big
        torch.cuda.empty_cache()
        return n * 2 / seconds
    torch.set_num_threads(threads)
    big = torch.ones(2 ** 28)
    best = float("inf")
    for _ in range(passes + 1):
        t = time.perf_counter()
        big.sum()
        best = min(best, time.perf_counter() - t)
    return big.numel() * 4 / best


def copy_bandwidth(device: torch.device, gib: float = 1.0, passes: int = 5) -> float:
    """A CUDA device-to-device copy's bytes read plus written, halved, per second (best of
    ``passes``): the limit the GPU records before the read-only measure used, about half the
    read bandwidth on HBM; kept beside it so old and new records compare."""
    src = torch.empty(int(gib * 2 ** 30), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = _best_cuda_seconds(functools.partial(dst.copy_, src), device, passes)
    n = src.numel()
    del src, dst
    torch.cuda.empty_cache()
    return n / seconds


def weight_read_bytes(model, vocab: int | None) -> int:
    """Bytes of the weights one forward of ``model`` (a :class:`~swiftspec.model_executor.models.llama.LlamaForCausalLM`)
    reads: its decoder layers' (norms aside, biases included) and the LM-head rows below ``vocab``
    (None: all)."""
    layers = sum(p.numel() * p.element_size() for n, p in model.layers.named_parameters() if "norm" not in n)
    head = sum(p.numel() * p.element_size() for p in model.lm_head.parameters())
    return layers + head * min(vocab or model.cfg.vocab_size, model.cfg.vocab_size) // model.cfg.vocab_size
