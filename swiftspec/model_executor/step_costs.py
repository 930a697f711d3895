"""A decode step's cost on this machine, from the kernel self-tuning's timings of the models' own
weights: what ``mode="auto"`` weighs the decode modes by (:mod:`swiftspec.spec_decode.mode_choice`).

For each model, the quantized GEMM variant the workers will run (the self-tuning's choice,
:func:`swiftspec.ops.tune_quant_gemm`) is timed on the weights the self-tuning uses (decoder
layer 0's qkv / o / gate_up / down and the LM head,
:func:`~swiftspec.model_executor.kernel_tuning.model_weights`) at every row count a mode verifies
or expands, each weight cold as in a decode step (:func:`swiftspec.ops.time_quant_gemm`). A
forward's cost is then layer 0's time scaled by the bytes of all decoder layers' projections over
layer 0's (the layer count where every layer has the same block types; a decode step reads its
weights once, so bytes set its time) plus the LM head's. Left out: projections whose blocks have
no quantized kernel, attention, norms and the per-forward host work, small beside the weight
reads of a one-to-four-row forward on a CPU; since every forward lacks them, the estimate
slightly favours the modes with more forwards per token (serial's draft forwards).

The result is stored beside the kernel-tuning profile, as ``<key>.steps.json`` under the same key
(:func:`swiftspec.ops.tuning.profile_key` of the target's then the draft's weights: the CPU, the
extension build, the weights' shapes and block types). Each of the first :data:`SAMPLES` engine
starts on a machine and model pair adds one measurement (about half a second once the kernel
choice is stored), and the costs are the mean of those stored: a shared machine's memory can
change its speed for minutes at a time, and the step costs of one moment then mislead the
choice (measurements minutes apart on one machine put three rows at 1.31x and 1.67x one row:
bench/LOG.md, "Proposals as long as the match"). A mode's seconds per token are linear in the step costs, so
the mean costs give its mean speed over the moments measured. ``SWIFTSPEC_KERNEL_TUNING=0`` (the
test suite) turns it off, as it does the tuning: ``mode="auto"`` then applies its rule.
"""
from __future__ import annotations

import fcntl
import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from safetensors import safe_open

from swiftspec.model_executor.kernel_tuning import _LAYER_WEIGHTS, model_weights
from swiftspec.ops import cpu, tuning
from swiftspec.ops.tuning import TuneWeight
from swiftspec.weights.model_cache import NATIVE_FILE, atomic_write_text

# rows per target forward the decode modes verify (autoregressive 1, ngram and serial trees up to 4)
TARGET_ROWS = (1, 2, 3, 4)
# rows per draft forward: one node expanded per forward in the trees weighed, the catch-up forward
# after a verification over the verified tokens the draft has not run (up to 4 in the shapes weighed)
DRAFT_ROWS = (1, 2, 3, 4)
STEPS_VERSION = 2
# measurements kept per machine and pair, one per engine start until there are this many
SAMPLES = 4


@dataclass(frozen=True)
class StepCosts:
    """Seconds of one forward's linear layers per row count, measured here.

    Attributes:
        target_s / draft_s: rows -> seconds of one target / draft forward (:data:`TARGET_ROWS`,
            :data:`DRAFT_ROWS`).
        variant: the quantized-GEMM variant timed (:mod:`swiftspec.ops.tuning`).
        source: "measured here" (one measurement taken now, averaged with the stored ones) or
            "stored" (earlier measurements on this machine and pair).
        path: the file holding it.
        samples: the measurements averaged (at most :data:`SAMPLES`).
    """

    target_s: dict[int, float]
    draft_s: dict[int, float]
    variant: str
    source: str
    path: str | None = field(default=None, compare=False)
    samples: int = 1


def layer_scale(model_dir: str | Path, weights: tuple[str, ...] = tuple(_LAYER_WEIGHTS)) -> float:
    """The bytes of every decoder layer's projections in ``weights`` (fused names: "qkv", "o",
    "gate_up", "down") over decoder layer 0's, read from the shapes of ``model_dir``'s GGUF blocks
    (``native/blocks.safetensors``; nothing is loaded).

    Raises:
        ValueError: none of them in layer 0 among the blocks.
        OSError / safetensors errors: an unreadable blocks file.
    """
    projections = {p for w in weights for p in _LAYER_WEIGHTS.get(w, ())}
    total = first = 0
    pattern = re.compile(r"model\.layers\.(\d+)\.(.+)\.weight")
    with safe_open(str(Path(model_dir) / NATIVE_FILE), framework="pt") as st:
        for name in st.keys():
            hit = pattern.fullmatch(name)
            if hit is None or hit.group(2) not in projections:
                continue
            shape = st.get_slice(name).get_shape()
            total += shape[0] * shape[1]
            first += shape[0] * shape[1] if hit.group(1) == "0" else 0
    if not first:
        raise ValueError(f"{model_dir}: none of the projections {sorted(weights)} in decoder layer 0's GGUF blocks")
    return total / first


def monotone(times: dict[int, float]) -> dict[int, float]:
    """rows -> seconds with each time lowered to the least time at as many rows or more: a call with
    fewer rows reads the same weights and does less arithmetic, so a larger time at fewer rows is
    another process taking the core, not the call's cost."""
    rows = sorted(times)
    return {n: min(times[m] for m in rows[k:]) for k, n in enumerate(rows)}


def forward_seconds(weights: list[TuneWeight], times: list[dict[int, float]], scale: float) -> dict[int, float]:
    """rows -> seconds of one forward's linear layers: the layer weights' times (``times[i]`` for
    ``weights[i]``, rows -> seconds, each made :func:`monotone`) summed and multiplied by ``scale``
    (:func:`layer_scale`), plus the LM head's. Raises ValueError when the weights lack the LM head
    or a layer weight."""
    names = [w.name for w in weights]
    if "lm_head" not in names or len(names) < 2:
        raise ValueError(f"a forward's cost needs layer weights and the LM head, got {names}")
    times = [monotone(t) for t in times]
    return {n: scale * sum(t[n] for w, t in zip(weights, times) if w.name != "lm_head")
            + sum(t[n] for w, t in zip(weights, times) if w.name == "lm_head") for n in sorted(times[0])}


def _read(path: Path, fields: dict) -> tuple[str, list[dict]] | None:
    """(variant, measurements) stored at ``path`` if they are for ``fields`` and each has every
    row count, else None; a measurement is ``{"target_s": {rows: s}, "draft_s": {rows: s}, ...}``."""
    try:
        p = json.loads(path.read_text())
        if p.get("version") != STEPS_VERSION or p.get("key") != fields:
            return None
        samples = [{"target_s": {int(k): float(v) for k, v in m["target_s"].items()},
                    "draft_s": {int(k): float(v) for k, v in m["draft_s"].items()},
                    "measured_at": str(m.get("measured_at", ""))} for m in p["samples"]]
        variant = str(p["variant"])
    except (OSError, ValueError, KeyError, AttributeError, TypeError):
        return None
    if not samples or any(not set(TARGET_ROWS) <= set(m["target_s"]) or not set(DRAFT_ROWS) <= set(m["draft_s"])
                          for m in samples):
        return None
    return variant, samples


def _mean(samples: list[dict], variant: str, source: str, path: Path) -> StepCosts:
    """The step costs of ``samples`` (measurements as :func:`_read` gives them): each row count's mean."""
    def mean(which: str, rows: tuple[int, ...]) -> dict[int, float]:
        return {n: sum(m[which][n] for m in samples) / len(samples) for n in rows}

    return StepCosts(mean("target_s", TARGET_ROWS), mean("draft_s", DRAFT_ROWS), variant, source, str(path), len(samples))


def measure_step_costs(target_dir: str | Path, draft_dir: str | Path, draft_vocab: int | None = None,
                       remeasure: bool = False) -> StepCosts | None:
    """This machine's step costs for the pair (see the module docstring): the mean of the stored
    measurements taken under the variant the workers will run, with one more measured now and
    stored while there are fewer than :data:`SAMPLES` (one process measures while others wait on
    the file's lock). ``draft_vocab``: the draft's logits rows (``EngineConfig.draft_logits_vocab``);
    ``remeasure``: drop the stored measurements and start again from one taken now.

    Returns None where measuring is off (``SWIFTSPEC_KERNEL_TUNING=0``), the kernels are off or
    unavailable, or either model lacks GGUF blocks with a kernel (float weights).
    Raises OSError / safetensors errors for an unreadable blocks file.
    """
    if not tuning.measuring_enabled():
        return None
    from swiftspec import ops

    target, draft = model_weights(target_dir), model_weights(draft_dir, draft_vocab)
    if not target or not draft:
        return None
    rows = sorted(set(TARGET_ROWS) | set(DRAFT_ROWS))
    key, fields = tuning.profile_key(target + draft, cpu.build_hash())
    path = tuning.profile_path(key).with_name(f"{key}.steps.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(f"{key}.steps.lock"), "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        stored = None if remeasure else _read(path, fields)
        full = stored is not None and len(stored[1]) >= SAMPLES
        timed = ops.time_quant_gemm(target + draft, rows, stored[0] if full else None)
        if timed is None:
            return None
        variant, times = timed
        if times is None:  # enough measurements of the variant the workers will run
            return _mean(stored[1], variant, "stored", path)
        t = forward_seconds(target, times[:len(target)], layer_scale(target_dir, tuple(w.name for w in target)))
        d = forward_seconds(draft, times[len(target):], layer_scale(draft_dir, tuple(w.name for w in draft)))
        # fewer than SAMPLES stored here (else they were returned above), or of another variant
        samples = stored[1] if stored is not None and stored[0] == variant else []
        samples.append({"target_s": {n: t[n] for n in TARGET_ROWS}, "draft_s": {n: d[n] for n in DRAFT_ROWS},
                        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
        atomic_write_text(path, json.dumps({"version": STEPS_VERSION, "variant": variant, "key": fields,
                                            "samples": samples}, indent=1) + "\n")
        return _mean(samples, variant, "measured here", path)
