"""Self-tuning of the quantized GEMM: time every kernel variant this CPU runs on the model's own
weights once per machine, keep the fastest in a profile file, run it from then on.

A *variant* is a quantized-GEMM kernel (``csrc/cpu/quant_gemm.cpp``: "avx512_vnni_512",
"avx512_vnni", "avx2", "scalar"; those :func:`swiftspec.ops.cpu_dispatch` can pick here) and, for
the two kernels of the 8-row layout ("avx512_vnni", "avx2"), whether they prefetch their blocks
ahead ("avx2+prefetch" / "avx2+noprefetch"). Which one is fastest is not a property of the ISA alone: on an
Intel Cascade Lake the rule's 256-bit kernel ran the target's one-row forward in 103.8 ms and the
512-bit one in 78.6 ms (bench/LOG.md). So on the first engine start on a machine,
:func:`choose` times every variant on a few of the model's weights (:class:`TuneWeight`: e.g.
one decoder layer's qkv / o / gate_up / down and the LM head) at the row counts the mode
verifies, a few seconds in all, and picks ONE variant for all of them, the least summed time
(the rule's unless beaten by more than :data:`MARGIN`): the
weights' interleaved layout is fixed when they are loaded (16 rows for "avx512_vnni_512", 8 for
the other SIMD kernels, the file's for "scalar"), so the variant cannot change per row count.

The result is stored as JSON in ``$SWIFTSPEC_CACHE/kernel_tuning/<key>.json`` (default
``~/.cache/swiftspec``; ``SWIFTSPEC_KERNEL_PROFILES`` names another directory), keyed by what the
timings depend on (:func:`profile_key`): the CPU's vendor, family, model, stepping and flags, its
core count, the CPU extension's build hash and the weights' shapes and block types (not the CPU's
model-name string, which virtual machines make generic). Until a measurement exists, or where
``SWIFTSPEC_KERNEL_TUNING=0`` (the test suite) or ``SWIFTSPEC_QUANT_GEMM`` (an explicit kernel)
say so, the rule picks (cpuid and CPU family: ``quant_rule_impls``). An unreadable profile is
ignored with a warning and measured again. One variant serves a whole process (the kernel choice
is process-wide); TP ranks time the full weights, not their shards, and share one profile.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import platform
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

# the 8-row layout's kernels, which prefetch or not (quant_set_prefetch); the 16-row kernel
# always prefetches, the scalar loop never
PREFETCH_IMPLS = ("avx512_vnni", "avx2")
PROFILE_VERSION = 1


@dataclass(frozen=True)
class TuneWeight:
    """One linear layer's GGUF blocks as the model calls them: ``parts[i]`` a ``[N_i, row_bytes]``
    uint8 tensor of plain blocks of ggml type ``types[i]`` (swiftspec.ops.quant), all reading the
    same ``[M, in_features]`` activations (e.g. q, k and v of one fused projection)."""
    name: str
    parts: tuple[torch.Tensor, ...]
    types: tuple[int, ...]
    in_features: int

    def shape(self) -> list:
        """``[name, in_features, [[ggml type, N_i], ...]]``: what the profile key records."""
        return [self.name, self.in_features, [[int(t), int(p.shape[0])] for p, t in zip(self.parts, self.types)]]


@dataclass
class Choice:
    """The variant a process runs and why: ``source`` is "measured here" (a profile of this
    machine), "rule" (cpuid and CPU family, before any measurement) or "environment"
    (``SWIFTSPEC_QUANT_GEMM``); ``times_s``: variant -> summed seconds where measured."""
    variant: str
    source: str
    times_s: dict = field(default_factory=dict)
    profile: str | None = None


def split(variant: str) -> tuple[str, bool | None]:
    """``"avx2+prefetch"`` -> ``("avx2", True)``, ``"avx2+noprefetch"`` -> ``("avx2", False)``, a
    bare kernel name -> ``(impl, None)`` (its prefetch left as it is).

    Raises:
        ValueError: a prefetch suffix on a kernel without that choice.
    """
    impl, _, suffix = variant.partition("+")
    if not suffix:
        return impl, None
    if impl not in PREFETCH_IMPLS or suffix not in ("prefetch", "noprefetch"):
        raise ValueError(f"{variant!r}: only {', '.join(PREFETCH_IMPLS)} take +prefetch / +noprefetch")
    return impl, suffix == "prefetch"


def variants(impls: list[str]) -> list[str]:
    """Every variant of the kernels ``impls`` (those this CPU runs, ``quant_impls()``)."""
    out = []
    for impl in impls:
        out += [impl + "+prefetch", impl + "+noprefetch"] if impl in PREFETCH_IMPLS else [impl]
    return out


def _variant(impl: str, prefetch: bool) -> str:
    if impl not in PREFETCH_IMPLS:
        return impl
    return impl + ("+prefetch" if prefetch else "+noprefetch")


def current_variant(m) -> str:
    """The variant extension module ``m`` runs now ("auto": the first kernel, its prefetch)."""
    return _variant(m.quant_impls()[0], m.quant_prefetch())


def rule_variant(m) -> str:
    """The variant the rule picks on this CPU (before any measurement)."""
    return _variant(m.quant_rule_impls()[0], m.quant_prefetch_rule())


def apply(m, variant: str) -> None:
    """Make extension module ``m`` run ``variant`` in this process (quant_set_impl +
    quant_set_prefetch). Raises RuntimeError where this CPU cannot run it."""
    impl, prefetch = split(variant)
    m.quant_set_impl(impl)
    if prefetch is not None:
        m.quant_set_prefetch(int(prefetch))


# ---- profile key and file -------------------------------------------------------------------
def cpu_identity() -> dict:
    """The CPU's vendor, family, model, stepping and flags (``/proc/cpuinfo``'s first processor,
    else :mod:`platform`) and this machine's core count."""
    want = {"vendor_id": "vendor", "cpu family": "family", "model": "model", "stepping": "stepping",
            "flags": "flags", "Features": "flags", "CPU implementer": "vendor", "CPU part": "model"}
    info: dict = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if not line.strip():
                if info:
                    break
                continue
            k, _, v = line.partition(":")
            if k.strip() in want:
                info.setdefault(want[k.strip()], v.strip())
    except OSError:
        pass
    if not info:
        info = {"vendor": platform.machine(), "model": platform.processor()}
    info["cores"] = os.cpu_count()
    return info


def profile_key(weights: list[TuneWeight], build: str, cpu: dict | None = None) -> tuple[str, dict]:
    """``(key, fields)``: a hash of the CPU's identity (:func:`cpu_identity`), the extension's
    ``build`` hash and the weights' shapes, and those fields themselves (stored in the profile)."""
    fields = {"cpu": cpu_identity() if cpu is None else cpu, "build": build,
              "weights": [w.shape() for w in weights]}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:20], fields


def profile_path(key: str) -> Path:
    """``$SWIFTSPEC_KERNEL_PROFILES/<key>.json``, by default under
    ``$SWIFTSPEC_CACHE/kernel_tuning`` (``~/.cache/swiftspec``)."""
    from swiftspec.ops.cpu import cache_root

    root = os.environ.get("SWIFTSPEC_KERNEL_PROFILES") or cache_root() / "kernel_tuning"
    return Path(root) / f"{key}.json"


def read_profile(path: Path, fields: dict, runs: list[str]) -> dict | None:
    """The stored profile at ``path`` if it is one for ``fields`` whose variant this CPU runs
    (``runs``), else None; a file that cannot be read or parsed as one is reported as a warning."""
    if not path.is_file():
        return None
    try:
        p = json.loads(path.read_text())
        ok = (isinstance(p, dict) and p.get("version") == PROFILE_VERSION and p.get("key") == fields
              and isinstance(p.get("variant"), str) and isinstance(p.get("times_s"), dict))
    except (OSError, ValueError) as e:
        warnings.warn(f"kernel tuning: ignoring the unreadable profile {path}: {e}", RuntimeWarning, stacklevel=3)
        return None
    if not ok:
        warnings.warn(f"kernel tuning: ignoring {path}: not a profile of this machine and build", RuntimeWarning,
                      stacklevel=3)
        return None
    return p if p["variant"] in runs else None


def write_profile(path: Path, fields: dict, variant: str, times_s: dict, rows: list[int]) -> None:
    """Store a measurement atomically (a temporary file renamed over ``path``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"version": PROFILE_VERSION, "variant": variant, "times_s": times_s, "rows": rows,
                               "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "key": fields},
                              indent=1))
    os.replace(tmp, path)


# ---- timing ---------------------------------------------------------------------------------
def layout(weight: TuneWeight, group: int) -> tuple[list[torch.Tensor], list[int]]:
    """``weight``'s parts in the layout the model takes for kernels reading ``group``-row
    interleaved blocks (16, 8, or 0: the file's; :func:`swiftspec.ops.quant.interleaved_type`)."""
    from swiftspec.ops import quant

    parts, types, start = [], [], 0
    for p, t in zip(weight.parts, weight.types):
        xt = quant.interleaved_type(t, p.shape[0], start, group) if group else int(t)
        parts.append(quant.interleave(p, xt) if quant.group_rows(xt) > 1 else p)
        types.append(xt)
        start += p.shape[0]
    return parts, types


def time_variant(m, variant: str, weights: list[TuneWeight], rows: list[int], group: int, reps: int = 3,
                 stop_after: float = float("inf")) -> float:
    """Seconds ``variant`` takes for one call of every weight, in the layout of ``group``-row
    interleaved blocks (:func:`layout`), at every row count (each the best of ``reps`` calls after
    a warm-up), summed; once the sum passes ``stop_after`` it is returned as it is (a lower bound:
    that variant has lost). Leaves ``variant`` applied."""
    apply(m, variant)
    total = 0.0
    gen = torch.Generator().manual_seed(0)
    for w in weights:
        parts, types = layout(w, group)
        for n in rows:
            total += _best_call(m, parts, types, torch.randn(n, w.in_features, generator=gen), reps)
            if total > stop_after:
                return total
    return total


def _best_call(m, parts: list[torch.Tensor], types: list[int], x: torch.Tensor, reps: int) -> float:
    """The least seconds of ``reps`` quantized-GEMM calls on activations ``x``, after a warm-up call."""
    m.quant_linear(x, parts, types, "auto")
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        m.quant_linear(x, parts, types, "auto")
        best = min(best, time.perf_counter() - t0)
    return best


def time_rows(m, weights: list[TuneWeight], rows: list[int], group: int, reps: int = 5) -> list[dict[int, float]]:
    """Per weight, ``{rows: seconds}``: one call of it under the variant applied now, in the layout
    of ``group``-row interleaved blocks (:func:`layout`), at each row count; a model's step cost is
    built from these. The calls cycle through all the weights, one pass per row count and
    repetition, so each weight is called after the others (an LM head: hundreds of MB) have
    evicted it from the caches, as in a decode step, which reads every weight once; each time is
    the least of ``reps`` passes after a warm-up pass (a pass another process preempts only
    raises its own). Raises ValueError for a row count below 1."""
    if any(n < 1 for n in rows):
        raise ValueError(f"row counts must be positive, got {rows}")
    gen = torch.Generator().manual_seed(0)
    laid = [layout(w, group) for w in weights]
    xs = [{n: torch.randn(n, w.in_features, generator=gen) for n in rows} for w in weights]
    best = [{n: float("inf") for n in rows} for _ in weights]
    for rep in range(reps + 1):  # pass 0 warms up
        for n in rows:
            for i, (parts, types) in enumerate(laid):
                t0 = time.perf_counter()
                m.quant_linear(xs[i][n], parts, types, "auto")
                if rep:
                    best[i][n] = min(best[i][n], time.perf_counter() - t0)
    return best


def measure(m, weights: list[TuneWeight], rows: list[int], layout_rows) -> dict[str, float]:
    """``{variant: seconds}`` for every variant this CPU runs (:func:`time_variant`), each in the
    layout ``layout_rows()`` gives once it is applied, the fastest kernels first; a variant is cut
    off at twice the best sum so far (the scalar loop, ~8x slower than AVX2 on the target's
    weights, would take most of the time), its time then a lower bound. The rule's variant is
    applied again afterwards."""
    rule = rule_variant(m)
    times: dict[str, float] = {}
    try:
        for v in variants(m.quant_rule_impls()):  # the rule's order: the scalar loop last
            apply(m, v)
            cut = 2 * min(times.values(), default=float("inf"))
            times[v] = time_variant(m, v, weights, rows, layout_rows(), stop_after=cut)
    finally:
        apply(m, rule)
    return times


# the rule's variant is kept unless another is this much faster: on a shared machine two runs of
# one variant differ by several percent, and a winner by noise is no gain
MARGIN = 0.05


def measuring_enabled() -> bool:
    """Whether this machine's kernels and step costs may be timed: not where
    ``SWIFTSPEC_KERNEL_TUNING=0`` (the test suite: the rule decides instead)."""
    return os.environ.get("SWIFTSPEC_KERNEL_TUNING", "1") != "0"


def pick(times: dict[str, float], rule: str, margin: float = MARGIN) -> str:
    """The variant with the least time, where it beats the rule's by more than ``margin``; else the rule's."""
    best = min(times, key=times.get)
    return best if rule not in times or times[best] < (1 - margin) * times[rule] else rule


def choose(m, weights: list[TuneWeight], rows: list[int], build: str, layout_rows, retune: bool = False) -> Choice:
    """The variant to run for ``weights`` at ``rows`` rows per call, applied to extension module
    ``m``: the stored profile of this machine, else measured now and stored (one process measures
    while the others wait on the profile's lock), else the rule (``SWIFTSPEC_KERNEL_TUNING=0``, no
    GGUF weights) or ``SWIFTSPEC_QUANT_GEMM``'s kernel. ``build``: the extension's build hash;
    ``layout_rows()``: the interleave group the weights take under the variant applied
    (:func:`swiftspec.ops.quant_interleave_rows`); ``retune``: measure even where a profile exists.
    """
    if os.environ.get("SWIFTSPEC_QUANT_GEMM"):
        return Choice(current_variant(m), "environment")
    if not weights or not measuring_enabled():
        apply(m, rule_variant(m))
        return Choice(current_variant(m), "rule")
    key, fields = profile_key(weights, build)
    path = profile_path(key)
    runs = variants(m.quant_impls())
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        p = None if retune else read_profile(path, fields, runs)
        if p is None:
            times = measure(m, weights, sorted(set(rows)), layout_rows)
            best = pick(times, rule_variant(m))
            write_profile(path, fields, best, times, sorted(set(rows)))
            p = {"variant": best, "times_s": times}
    apply(m, p["variant"])
    return Choice(p["variant"], "measured here", dict(p["times_s"]), str(path))
