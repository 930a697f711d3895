"""Whether the systems of one benchmark run fit in memory, checked before anything loads: each
system's resident weight bytes (estimated from the safetensors headers) against the host's or the
GPU's free memory."""
from __future__ import annotations

import math
from pathlib import Path


class InsufficientMemoryError(ValueError):
    """The systems of one bench run would not fit in memory together (each keeps its own weights)."""


def _param_count(model_dir, skip: frozenset = frozenset()) -> int:
    """Parameters of a model directory's safetensors files, tensors named in ``skip`` left out
    (headers only; nothing is loaded); of a random-weights recipe, from its shapes."""
    from safetensors import safe_open

    from swiftspec.weights import random_weights

    n = random_weights.param_count(model_dir)  # a random-weights recipe: from its shapes (no blocks to skip)
    if n is not None:
        return n
    n = 0
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            n += sum(math.prod(st.get_slice(k).get_shape()) for k in st.keys() if k not in skip)
    return n


def _engine_weight_bytes(model_dir, per: int) -> int:
    """An engine's bytes for one model with native weights: its quantized blocks as stored
    (``native/blocks.safetensors``, kept as they are), every other tensor at ``per`` bytes a
    parameter."""
    from swiftspec.model_executor.models.llama import NATIVE_FILE, native_types

    blocks = Path(model_dir) / NATIVE_FILE
    if not blocks.is_file():
        return _param_count(model_dir) * per
    return blocks.stat().st_size + _param_count(model_dir, frozenset(native_types(model_dir))) * per


def weight_bytes(systems: list[str], target_dir, draft_dir, dtype: str) -> dict[str, int]:
    """Estimated resident weight bytes per system (a lower bound: activations, KV caches and
    runtimes come on top). Engines keep quantized blocks as stored (native weights), the
    ``-dequantized`` ones every target weight at ``dtype``; their draft's other weights are int8
    (the default ``draft_quant``, about 1 byte per parameter); peers keep both models at ``dtype``;
    llama.cpp maps its GGUF file, which the page cache can drop, so it counts 0."""
    per = 4 if dtype == "float32" else 2
    t_float, t_native = _param_count(target_dir) * per, _engine_weight_bytes(target_dir, per)
    d = _engine_weight_bytes(draft_dir, 1)
    out = {}
    for s in systems:
        if s.startswith("swiftspec") or s in ("pipedec", "pipeinfer"):
            out[s] = (t_float if s.endswith("-dequantized") else t_native) + d
        elif s == "hf-assisted":
            out[s] = t_float + _param_count(draft_dir) * per
        elif s.startswith("llama-cpp"):
            out[s] = 0
        elif s.startswith("hf") or s.endswith("-dequantized"):
            out[s] = t_float
        else:  # autoregressive, -nokernels, pipeline-autoregressive: the target alone, native weights
            out[s] = t_native
    return out


def available_memory_bytes(device: str = "cpu") -> int | None:
    """Memory the systems' weights can take: on ``"cuda"`` the current GPU's free bytes
    (``torch.cuda.mem_get_info``), else ``MemAvailable`` from /proc/meminfo; None where unknown."""
    if device == "cuda":
        import torch

        return int(torch.cuda.mem_get_info()[0]) if torch.cuda.is_available() else None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_memory(need: dict[str, int], available: int | None, together: bool = True, where: str = "cpu") -> None:
    """Refuse a run whose systems cannot be resident, before anything is loaded.

    ``together``: every system stays loaded for the whole run (prompts interleaved), so their
    weights add up; else one system is resident at a time and the largest must fit. Past the
    memory the run would end in the OOM killer (host) or an out-of-memory error mid-load (GPU),
    with no results. ``where``: the device whose memory ``available`` is, named in the message.
    Raises :class:`InsufficientMemoryError` naming each system's share.
    """
    total = sum(need.values()) if together else max(need.values(), default=0)
    if available is None or total <= available:
        return
    parts = ", ".join(f"{s} {b / 2**30:.1f}" for s, b in need.items())
    memory = "GPU memory is free" if where == "cuda" else "memory is available"
    if together:
        raise InsufficientMemoryError(
            f"these systems keep about {total / 2**30:.1f} GiB of weights loaded together ({parts} GiB) but "
            f"only {available / 2**30:.1f} GiB of {memory}: run fewer systems per invocation "
            f"(keep autoregressive in each run for the equality column) or use a smaller dtype")
    raise InsufficientMemoryError(
        f"the largest system needs about {total / 2**30:.1f} GiB of weights ({parts} GiB) but only "
        f"{available / 2**30:.1f} GiB of {memory}: use smaller shapes or a larger device")
