"""Which implementation each op runs: the backend by the tensors' device ("cuda", "cpu" or
"torch"), the switch that turns the compiled kernels off, the CPU extension's ISA-dispatch table
(:func:`cpu_dispatch`), and the quantized GEMM's variant and the GGUF weight layout that follows
from it (:mod:`swiftspec.ops.tuning`). The op wrappers of :mod:`swiftspec.ops` ask here.
"""
from __future__ import annotations

import functools
import os
import warnings

import torch

class _State(dict):
    """This process's dispatch switches, each read from the environment when first asked for (not
    at import: a worker imports this module before it takes the engine's environment,
    :mod:`swiftspec.engine.child_entry`); a value set before that wins."""

    def __missing__(self, key):
        env = os.environ.get
        defaults = {
            # SWIFTSPEC_KERNELS=0 turns them off from the start (ablations, debugging)
            "enabled": env("SWIFTSPEC_KERNELS", "1") != "0",
            # SWIFTSPEC_QUANT_X8=0: GGUF weights keep the file's plain layout (set_quant_x8)
            "x8": env("SWIFTSPEC_QUANT_X8", "1") != "0",
            # SWIFTSPEC_QUANT_X16=0: the 8-row layout even where the 512-bit kernel reads 16 rows
            "x16": env("SWIFTSPEC_QUANT_X16", "1") != "0",
            # why the quantized GEMM runs its variant: "rule", "measured here", "environment" or
            # "set" (set_quant_gemm / set_quant_variant); swiftspec.ops.tuning
            "quant_source": "environment" if env("SWIFTSPEC_QUANT_GEMM") else "rule"}
        for k, v in defaults.items():
            self.setdefault(k, v)
        return self[key]


_state = _State()


def set_kernels(enabled: bool) -> None:
    """Use the compiled kernels (True, the default) or PyTorch ops only (False) in this process."""
    _state["enabled"] = bool(enabled)


def kernels_enabled() -> bool:
    """Whether this process dispatches to the compiled kernels (``SWIFTSPEC_KERNELS``, :func:`set_kernels`)."""
    return _state["enabled"]


@functools.lru_cache(maxsize=None)
def cpu_module():
    """The loaded CPU extension (:func:`swiftspec.ops.cpu.load`), or None where it fails to build or load
    (warned once: the ops then take the PyTorch path)."""
    from swiftspec.ops import cpu
    try:
        return cpu.load()
    except cpu.KernelBuildError as e:
        warnings.warn(f"CPU kernels unavailable, using PyTorch ops: {e}", RuntimeWarning, stacklevel=3)
        return None


@functools.lru_cache(maxsize=None)
def cuda_module():
    """:mod:`swiftspec.ops.cuda` where its library builds and loads on this machine, else None (a failed
    build warned once: the ops then take the PyTorch path)."""
    from swiftspec.ops import cuda, cuda_lib
    try:
        return cuda if cuda_lib.available() else None
    except Exception as e:  # a failed nvcc build or load: fall back, say why once
        warnings.warn(f"CUDA kernels unavailable, using PyTorch ops: {e}", RuntimeWarning, stacklevel=3)
        return None


CPU_FAMILIES = ("quant_gemm", "skinny_gemm", "tree_attention", "rms_norm", "silu_mul")


@functools.lru_cache(maxsize=None)
def cpu_dispatch() -> dict[str, str]:
    """The one ISA-dispatch point of the CPU kernels: which implementation each op family runs on
    this CPU ("torch" where the twin would only have its scalar loop, which loses to PyTorch).

    Keys (:data:`CPU_FAMILIES`): ``quant_gemm`` (GGUF blocks: "avx512_vnni_512" (weights
    interleaved by 16 rows, read on 512-bit registers: AMD Zen 5, where that measured faster;
    :func:`quant_interleave_rows`), "avx512_vnni", "avx2" or
    "scalar", picked at run time from cpuid; the scalar loop only where no SIMD one exists;
    :func:`set_quant_gemm` overrides), ``skinny_gemm``
    (float/int8 weights: "avx512_bf16", "avx512" or "torch"), ``tree_attention`` ("avx512", "avx2"
    or "torch"), ``rms_norm`` ("cpp": portable C++ the compiler vectorizes) and ``silu_mul``
    (SwiGLU's activation after the quantized GEMM: "avx512", "avx2" or "torch", the widest loop the
    extension was built with), plus ``quant_gemm_variant`` (the kernel and, for the 8-row ones,
    whether it prefetches: e.g. "avx2+prefetch"; :mod:`swiftspec.ops.tuning`) and
    ``quant_gemm_choice`` (why: "measured here", "rule", "environment" or "set"). Recorded in the
    engine's metrics and the benchmark records. All "torch" when the extension is unavailable.
    """
    m = cpu_module()
    if m is None:
        return {k: "torch" for k in CPU_FAMILIES}
    gemm = [i for i in m._linear_impls() if i != "scalar"]
    attn = [i for i in m._tree_attention_impls() if i != "scalar"]
    act = m._silu_mul_impls()[-1]
    from swiftspec.ops import tuning

    return {"quant_gemm": m.quant_impls()[0], "skinny_gemm": gemm[-1] if gemm else "torch",
            "tree_attention": attn[-1] if attn else "torch", "rms_norm": "cpp",
            "silu_mul": act if act != "scalar" else "torch",
            "quant_gemm_variant": tuning.current_variant(m), "quant_gemm_choice": _state["quant_source"]}


def set_quant_gemm(impl: str) -> None:
    """Make ``impl`` (one of the quantized-GEMM kernels this CPU runs: "avx512_vnni_512",
    "avx512_vnni", "avx2", "scalar") the one every GGUF weight op of this process runs, as
    ``SWIFTSPEC_QUANT_GEMM=impl`` does from the start (benchmarks compare them side by side);
    ``impl + "+prefetch"`` / ``"+noprefetch"`` (the 8-row kernels) also sets whether it prefetches
    (:func:`swiftspec.ops.tuning.split`; a bare name leaves that as it is).

    Raises:
        RuntimeError: this CPU cannot run ``impl``, or the CPU extension is unavailable.
        ValueError: a "+prefetch" on a kernel without that choice.
    """
    set_quant_variant(impl, "set")


def set_quant_variant(variant: str, source: str) -> None:
    """Run quantized-GEMM ``variant`` (:mod:`swiftspec.ops.tuning`) in this process, recording
    ``source`` as why (``cpu_dispatch()["quant_gemm_choice"]``). Raises as :func:`set_quant_gemm`."""
    from swiftspec.ops import tuning

    m = cpu_module()
    if m is None:
        raise RuntimeError("set_quant_gemm: the CPU kernels are unavailable")
    tuning.apply(m, variant)
    _state["quant_source"] = source
    cpu_dispatch.cache_clear()


def tune_quant_gemm(weights: list, rows: list[int], retune: bool = False):
    """Pick the quantized-GEMM variant of this process for GGUF weights ``weights``
    (:class:`swiftspec.ops.tuning.TuneWeight`) at ``rows`` rows per call: this machine's stored
    measurement, else one taken now (a few seconds, stored), else the rule
    (:func:`swiftspec.ops.tuning.choose`). Call it before building the weights: their layout
    follows the variant. Returns the :class:`~swiftspec.ops.tuning.Choice`, or None with the
    kernels off or the extension unavailable."""
    from swiftspec.ops import cpu, tuning

    m = cpu_module() if _state["enabled"] else None
    if m is None:
        return None
    choice = tuning.choose(m, weights, rows, cpu.build_hash(), _interleave_rows_now, retune=retune)
    _state["quant_source"] = choice.source
    cpu_dispatch.cache_clear()
    return choice


def time_quant_gemm(weights: list, rows: list[int], variant: str | None = None
                    ) -> tuple[str, list[dict[int, float]] | None] | None:
    """Time GGUF weights ``weights`` (:class:`swiftspec.ops.tuning.TuneWeight`) at each of ``rows``
    rows per call under the variant this process's workers will run (:func:`tune_quant_gemm`'s
    choice for them: the stored kernel-tuning profile of this machine, else measured now and
    stored), in that variant's layout. Returns ``(variant, [{rows: seconds} per weight])``
    (:func:`swiftspec.ops.tuning.time_rows`); ``(variant, None)`` without timing where the choice
    is ``variant`` (a caller holding timings of it); None with the kernels off or the extension
    unavailable. This process's own variant and its source are restored afterwards."""
    from swiftspec.ops import cpu, tuning

    m = cpu_module() if _state["enabled"] else None
    if m is None:
        return None
    before = tuning.current_variant(m), _state["quant_source"]
    try:
        chosen = tuning.choose(m, weights, rows, cpu.build_hash(), _interleave_rows_now).variant
        if chosen == variant:
            return chosen, None
        return chosen, tuning.time_rows(m, weights, rows, _interleave_rows_now())
    finally:
        tuning.apply(m, before[0])
        _state["quant_source"] = before[1]
        cpu_dispatch.cache_clear()


def _interleave_rows_now() -> int:
    """:func:`quant_interleave_rows` under the variant just applied (dispatch asked afresh)."""
    cpu_dispatch.cache_clear()
    return quant_interleave_rows()


def cpu_twin(family: str) -> bool:
    """Whether op family ``family`` (one of :data:`CPU_FAMILIES`) runs its C++ twin on this CPU
    (:func:`cpu_dispatch` names an implementation other than "torch")."""
    return cpu_dispatch()[family] != "torch"


def backend(t: torch.Tensor) -> str:
    """Which implementation an op on tensor ``t`` uses: "cuda", "cpu" or "torch"."""
    if not _state["enabled"]:
        return "torch"
    if t.is_cuda:
        return "cuda" if cuda_module() is not None else "torch"
    if t.device.type == "cpu":
        return "cpu" if cpu_module() is not None else "torch"
    return "torch"


def set_quant_x8(enabled: bool) -> None:
    """Let GGUF weights built from now on take the interleaved layout (True, the default) or keep
    the plain one (False: benchmarks compare the two side by side)."""
    _state["x8"] = bool(enabled)


def quant_interleave_rows() -> int:
    """Rows per interleaved group that GGUF weights built now should take: 16 where the
    dispatched quantized GEMM reads the 16-row layout ("avx512_vnni_512") and
    ``SWIFTSPEC_QUANT_X16`` is not 0, 8 where :func:`quant_x8_enabled`, else 0 (the file's layout)."""
    if not quant_x8_enabled():
        return 0
    return 16 if _state["x16"] and cpu_dispatch()["quant_gemm"] == "avx512_vnni_512" else 8


def quant_x8_enabled() -> bool:
    """Whether GGUF weights built now should take the 8-row interleaved layout: the kernels
    are on, the CPU extension loads and this CPU has a SIMD quantized GEMM (the scalar loop reads
    the plain layout faster). Measured in bench/native_forward.py (both layouts side by side)."""
    return _state["enabled"] and _state["x8"] and cpu_dispatch()["quant_gemm"] != "scalar"

