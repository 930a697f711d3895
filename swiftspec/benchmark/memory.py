"""The two sides of the benchmarks' "fraction of the bandwidth limit" (bench/native_forward.py,
bench/device_forward.py): the weight bytes one forward reads, and how fast the device reads."""
from __future__ import annotations

import time

import torch


def read_bandwidth(device: torch.device, threads: int) -> float:
    """Bytes per second the device's memory sustains in one direction: on CUDA a device-to-device
    copy of 1 GiB, bytes read plus written, halved, over its best time of 5; on CPU the best of 5
    ``torch.sum`` passes over a 1 GiB fp32 tensor with ``threads`` threads (sets them)."""
    if device.type == "cuda":
        src = torch.empty(2 ** 30, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        best = float("inf")
        for _ in range(5):
            torch.cuda.synchronize(device)
            t = time.perf_counter()
            dst.copy_(src)
            torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - t)
        return src.numel() * 2 / 2 / best
    torch.set_num_threads(threads)
    big = torch.ones(2 ** 28)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        big.sum()
        best = min(best, time.perf_counter() - t)
    return big.numel() * 4 / best


def weight_read_bytes(model, vocab: int | None) -> int:
    """Bytes of the weights one forward of ``model`` (a :class:`~swiftspec.models.llama.LlamaForCausalLM`)
    reads: its decoder layers' (norms aside, biases included) and the LM-head rows below ``vocab``
    (None: all)."""
    layers = sum(p.numel() * p.element_size() for n, p in model.layers.named_parameters() if "norm" not in n)
    head = sum(p.numel() * p.element_size() for p in model.lm_head.parameters())
    return layers + head * min(vocab or model.cfg.vocab_size, model.cfg.vocab_size) // model.cfg.vocab_size
