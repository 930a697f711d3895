"""What ``mode="auto"`` runs on this machine and model pair, and why (docs/architecture.md §5.3).

:func:`choose_mode` resolves "auto" from a stored ``swiftspec profile``, else from this machine's
measured step costs (:mod:`swiftspec.spec_decode.mode_choice`), else from the rules measured on
this project's machines (bench/RESULTS.md); and the facts of this machine it reads (NUMA nodes,
the cores this process may use, native bf16).
"""
from __future__ import annotations

import os
from pathlib import Path

from swiftspec.engine.config import MODES, EngineConfig
from swiftspec.spec_decode import modes
from swiftspec.spec_decode.ngram import NgramParams

# The tree shape of the built-in rule's shallow serial mode (choose_mode): verify the root and
# the draft's best child, one draft expansion per verification.
SHALLOW_TREE = {"bs": 2, "d": 1}
# the quantized-GEMM kernels (ops.cpu_dispatch()["quant_gemm"]) with which that mode measured fastest
SIMD_QUANT_KERNELS = ("avx512_vnni_512", "avx512_vnni", "avx2")
# ... and those with which the ngram mode measured faster still (AVX2 without VNNI, an AMD Zen 3: ngram
# ahead of both autoregressive and serial bs 2 with the payback gate on the 30 prompts, side by side;
# bench/RESULTS.md)
NGRAM_QUANT_KERNELS = ("avx2",)
_TREE_FIELDS = ("bs", "w", "topk", "d")


def _user_tree(config: EngineConfig) -> bool:
    """Whether the configuration sets a tree field to other than its default (its shape wins)."""
    dflt = EngineConfig()
    return any(getattr(config, k) != getattr(dflt, k) for k in _TREE_FIELDS)


def cpu_has_bf16() -> bool:
    """True if the CPU has native bf16 dot products (AVX-512 BF16 or AMX)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def _numa_nodes() -> int:
    return len(list(Path("/sys/devices/system/node").glob("node[0-9]*"))) or 1


def _available_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def choose_mode(config: EngineConfig, target_native: bool = False, profiled: dict | None = None, gpus: int = 0,
                step_costs=None) -> tuple[str, str, dict]:
    """The mode to run and why: ``config.mode`` unless it is "auto" (a configured ``hybrid``
    without a tree or n-gram shape of its own, on GGUF blocks, takes the hybrid shape the
    ``step_costs`` make fastest, the reason starting "hybrid as configured, its shape, measured
    here"; the tree defaults are sized for a GPU's 8-row verifications).

    "auto" takes the mode that ``swiftspec profile`` measured fastest on this machine and model
    pair when one is stored (``profiled``, :func:`swiftspec.engine.machine_profile.cached_profile`).
    Before a profile exists, with the target on its GGUF blocks and every core on one bus, it
    weighs the modes by ``step_costs`` where given (:class:`swiftspec.model_executor.step_costs.StepCosts`:
    this machine's target and draft forwards, timed by the kernel self-tuning): the most expected
    tokens/s among ``autoregressive``, ``ngram``, shallow ``serial`` trees and ``hybrid`` (a shallow
    draft chain beside the n-gram chain) with the packaged
    acceptance trace's priors (:mod:`swiftspec.spec_decode.mode_choice`; the reason starts
    "auto, measured here" and names the costs). Otherwise (``SWIFTSPEC_KERNEL_TUNING=0``, float
    weights, kernels off) it applies these rules, each the mode measured fastest on that kind of
    machine (the reason starts "auto, rule"; the current tables and their commands in
    bench/RESULTS.md, the measurements behind each rule in bench/LOG.md):

    * Several NUMA nodes: ``async``, each group with a memory bus of its own.
    * Every core on one bus, the target on its GGUF blocks (``target_native``) with the AVX2
      quantized kernel (:data:`NGRAM_QUANT_KERNELS`; no VNNI): ``ngram``. Side by side on the same
      prompts it decoded faster than the shallow ``serial`` tree, which gained little over the
      target alone there: each of its steps adds a draft forward (about a third of a target step)
      and each request a draft prefill, while prompt-lookup proposals cost nothing.
    * The same with an AVX-512 VNNI kernel (:data:`SIMD_QUANT_KERNELS`): ``serial`` with a two-node
      subgraph (:data:`SHALLOW_TREE`: bs 2, one expansion). A two-node verification costs about as
      much as a one-row step there, so one draft expansion per verification pays; a verification
      of n nodes grows with n, so deeper trees were slower or within the margin ``swiftspec
      profile`` asks of a change (``ngram`` has not been measured against it on these CPUs).
    * The scalar kernel or the kernels off: ``autoregressive`` (a verification batch costs more
      than the tokens it saves).
    * Dequantized weights (each forward reads several times the bytes, so several nodes cost little
      more than one): ``serial`` on all cores, which beat ``async`` since splitting the bus slows the
      target more than the overlap saves.

    On CUDA (``gpus``: the GPUs the engine will use, 0 on CPU) a stored profile decides as on the
    CPU (its machine id names the GPU, so a CPU profile never applies there; ``swiftspec profile``
    measures the GPU layouts, ``colocated`` included); the CPU rule does not apply. Without a
    profile: with two GPUs or more ``async`` (one group per GPU set, the paper's layout); on one
    GPU ``autoregressive``, since with the default pair's shapes a draft forward costs about two
    thirds of a target step and no compression the pair reaches pays for it, while with a target
    64 times its draft (32B over 0.5B) ``colocated`` decoded 1.5-1.75x faster than the target alone
    (docs/gpu.md, records ``bench/results/gpu-*``): which side of that line a pair falls on is
    measured by ``swiftspec profile``; ``colocated`` and ``serial`` run when asked for.

    Returns ``(mode, reason, tree)``: ``tree`` holds the tree-shape fields (``bs``, ``w``,
    ``topk``, ``d``) measured with an automatic mode (the profile's, or :data:`SHALLOW_TREE`),
    ``{}`` when the mode was configured or the configuration sets its own shape; a measured
    ``ngram`` choice sets ``ngram_tokens`` unless the configuration sets it, a measured ``hybrid``
    choice its tree, ``ngram_tokens`` and ``hybrid_rows`` unless the configuration sets any of them.
    """
    if config.mode != "auto":
        if _hybrid_shaped_by_costs(config) and step_costs is not None and target_native and config.weights == "native":
            return _measured_mode(config, step_costs, False, only="hybrid")
        return config.mode, "as configured", {}
    if config.pipeline_stages > 1:
        return "pipedec", f"auto: {config.pipeline_stages} pipeline stages", {}
    own = _user_tree(config)
    if profiled is not None and profiled.get("mode") in MODES:
        measured = profiled.get("_measured") or {}
        tree = {} if own else {k: profiled[k] for k in _TREE_FIELDS if k in profiled}
        return profiled["mode"], (f"auto: swiftspec profile of {measured.get('date', '?')} measured it fastest "
                                  f"on this machine and model pair ({measured.get('tokens_per_s', 0):.2f} tokens/s)"), tree
    if gpus:
        if gpus >= 2:
            return "async", f"auto: {gpus} GPUs, a draft group and a target group (run `swiftspec profile` to measure)", {}
        return "autoregressive", ("auto: one GPU and no `swiftspec profile` of this pair on it yet; on the default "
                                  "pair's shapes a draft forward costs about two thirds of a target step, where no "
                                  "speculation pays, while a target many times its draft's size gains from "
                                  "`colocated` (docs/gpu.md): `swiftspec profile` measures it here"), {}
    nodes, cores = _numa_nodes(), len(_available_cores())
    if nodes >= 2 and cores >= 2:
        return "async", f"auto, rule: {cores} cores on {nodes} NUMA nodes, one memory bus per group", {}
    if target_native and config.weights == "native" and step_costs is not None:
        return _measured_mode(config, step_costs, own)
    if target_native and config.weights == "native":
        from swiftspec import ops

        isa = ops.cpu_dispatch()["quant_gemm"] if config.kernels else "torch"
        if isa in NGRAM_QUANT_KERNELS:
            return "ngram", (f"auto, rule: {cores} cores share one memory bus and the target reads its quantized blocks "
                             f"({isa}), where a draft forward costs a third of a target step: the target alone "
                             f"verifying prompt-lookup proposals measured fastest"), {}
        if isa in SIMD_QUANT_KERNELS:
            return "serial", (f"auto, rule: {cores} cores share one memory bus and the target reads its quantized blocks "
                              f"({isa}): serial with a two-node subgraph (bs 2, d 1) measured fastest"), \
                {} if own else dict(SHALLOW_TREE)
        return "autoregressive", (f"auto, rule: {cores} cores share one memory bus and the target reads its quantized "
                                  f"blocks ({isa}), where the draft's expansions cost more than the tokens they save"), {}
    return "serial", f"auto, rule: {cores} cores share one memory bus, where serial measured faster than async", {}


def _user_ngram(config: EngineConfig) -> bool:
    """Whether the configuration sets a field of the proposals' shape beyond the tree (the n-gram
    lookup and chain, hybrid's row budget: :attr:`~swiftspec.spec_decode.modes.Hybrid.shape_fields`)."""
    dflt = EngineConfig()
    return any(getattr(config, f) != getattr(dflt, f) for f in modes.mode_for("hybrid").shape_fields)


def _hybrid_shaped_by_costs(config: EngineConfig) -> bool:
    """Whether ``config`` is a configured ``hybrid`` that leaves its shape (tree, n-gram tokens,
    row budget) to the measured step costs."""
    return config.mode == "hybrid" and not _user_tree(config) and not _user_ngram(config)


def _measured_mode(config: EngineConfig, costs, own_tree: bool, only: str | None = None) -> tuple[str, str, dict]:
    """choose_mode's pick from this machine's step costs (:mod:`swiftspec.spec_decode.mode_choice`);
    a shape the configuration sets wins over the candidate's. ``only``: weigh that mode's shapes
    alone (a configured ``hybrid``: its draft chain and n-gram tokens, budgeted by the row costs
    measured here rather than the tree defaults, which are sized for a GPU)."""
    from swiftspec.spec_decode import mode_choice

    cands = mode_choice.priors(ngram=NgramParams(config.ngram_min, config.ngram_max, 1))
    cands = [c for c in cands if only is None or c.mode == only]
    top, rates = mode_choice.best(cands, costs.target_s, costs.draft_s)
    why = mode_choice.measured_reason(top, rates, costs.target_s, costs.draft_s, costs.variant,
                                      "auto" if only is None else f"{only} as configured, its shape", costs.samples)
    own_ngram = _user_ngram(config)
    own = {"serial": own_tree, "ngram": own_ngram, "hybrid": own_tree or own_ngram}.get(top.mode, False)
    return top.mode, why, {} if own else dict(top.fields)


def resolve_mode(config: EngineConfig, target_path: Path, draft, cache_dir, gpus: int
                 ) -> tuple[str, str, dict, Path | None]:
    """What the engine runs for ``config``: :func:`choose_mode` fed with this machine's stored
    ``swiftspec profile`` of the pair (:func:`swiftspec.engine.machine_profile.cached_profile`,
    keyed by both models: the default draft's directory where ``draft`` is None, not fetched)
    and, where those decide (auto, no profile, CPU, one pipeline stage, native weights, kernels
    on, one NUMA node; or a configured ``hybrid`` on the CPU without a shape of its own), the
    pair's step costs measured here
    (:func:`swiftspec.model_executor.step_costs.measure_step_costs`; None under
    ``SWIFTSPEC_KERNEL_TUNING=0``). ``gpus``: the GPUs the engine uses (0 on the CPU).

    Returns ``(mode, reason, tree fields, the draft's resolved directory or None)``.
    Raises what :func:`swiftspec.weights.loader.resolve_model` raises for a draft it cannot find.
    """
    from swiftspec.model_executor.models.llama import native_types

    profiled = draft_path = step_costs = None
    shaped = _hybrid_shaped_by_costs(config)
    if config.mode == "auto" or shaped:
        from swiftspec.weights.default_pair import default_model_dir
        from swiftspec.weights.loader import resolve_model

        draft_path = resolve_model(draft, "draft", cache_dir) if draft is not None else None
        draft_dir = draft_path or default_model_dir("draft", cache_dir)
        if config.mode == "auto":
            from swiftspec.engine.machine_profile import cached_profile

            profiled = cached_profile(target_path, draft_dir, cache_dir)
        if (not gpus and config.weights == "native" and config.kernels
                and (shaped or (profiled is None and config.pipeline_stages == 1 and _numa_nodes() < 2))):
            from swiftspec.model_executor.step_costs import measure_step_costs

            step_costs = measure_step_costs(target_path, draft_dir, config.draft_vocab)
    mode, reason, tree = choose_mode(config, bool(native_types(target_path)), profiled, gpus, step_costs)
    return mode, reason, tree, draft_path
