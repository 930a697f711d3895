"""The end-to-end benchmark's inputs and the fields of its records: the evaluation prompt sets,
each request's busy and pipeline counters, and the machine the numbers were measured on."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

DATASETS = ["mt_bench", "humaneval", "gsm8k", "alpaca", "sum", "qa"]

# the six evaluation prompt sets, shipped with the package (README.md and license beside them)
PACKAGED_PROMPTS = Path(__file__).resolve().parents[1] / "data" / "eval_prompts"


def prompts_dir() -> Path:
    """The six evaluation prompt sets: ``$SWIFTSPEC_PROMPTS`` if set, else the copies shipped in
    ``swiftspec/data/eval_prompts``."""
    env = os.environ.get("SWIFTSPEC_PROMPTS")
    return Path(env) if env else PACKAGED_PROMPTS


def load_prompts(spec: str, n: int) -> tuple[str, list[str]]:
    """``spec``: a dataset name of the eval prompts, or a JSONL file of that format
    (``{"turns": [user message, ...], ...}`` per line). Returns (name, first ``n`` user messages).

    Raises:
        FileNotFoundError: no such dataset or file.
    """
    path = Path(spec)
    if not path.exists():
        path = prompts_dir() / f"{spec}.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"no prompt file {spec!r} (datasets are looked up in {prompts_dir()})")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return path.stem, [r["turns"][0] for r in rows[:n]]


def busy_record(m) -> dict:
    """Each model's forwards and busy seconds for one request (device time on CUDA, from events;
    wall time on CPU), where the engine reports them: decode time minus the target's busy time is
    the host's share of a step (bench/RESULTS.md, the GPU component table)."""
    return {f"{role}_{k}": stats[k] for role, stats in (("target", m.target), ("draft", m.draft))
            for k in ("busy_s", "forwards") if k in stats}


def pipeline_record(m) -> dict:
    """A pipeline mode's counters for one request: timesteps, nodes issued / pruned mid-pipeline,
    each stage's busy fraction of the request's wall time (stage 0's draft separately) and the
    KV entries computed twice (stage 0's forward tokens beyond the prompt and the issued nodes)."""
    t = m.target
    if "stages" not in t:
        return {}
    wall = t["wall_s"] or float("nan")
    return {"pipeline": {"timesteps": t["timesteps"], "issued": t["issued"], "pruned": t["pruned"],
                         "cancelled": t["cancelled"],
                         "stage_busy": [s["busy_s"] / wall for s in t["stages"]],
                         "draft_busy": m.draft.get("busy_s", 0.0) / wall,
                         "recomputed_kv": t["forward_tokens"] - m.prompt_tokens - t["issued"]}}


def machine_record(cpu_kernels: bool = True) -> dict:
    """What the numbers depend on besides the code: the CPU's model, family and flags (from
    ``/proc/cpuinfo``), the cores this process may use, the kernel each CPU op family dispatches
    to (:func:`swiftspec.ops.cpu_dispatch`; with ``cpu_kernels`` False, for numbers measured on a
    GPU, ``isa`` is None: asking would build the CPU kernels, a minute on a fresh machine), the torch version and the ``SWIFTSPEC_*`` variables
    of the environment (switches such as ``SWIFTSPEC_QUANT_X16``, ``SWIFTSPEC_CPU_ARCH``) with
    ``ATEN_CPU_CAPABILITY`` (torch's own kernels' ISA), the GPU's name where torch sees one
    (``gpu``), and the llama.cpp build where a peer ran."""
    import torch

    from swiftspec import ops
    from swiftspec.engine.machine_profile import cpu_model_name

    info: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().split("\n\n")[0].splitlines():
            if ":" in line:
                k, v = line.split(":", 1)
                info[k.strip()] = v.strip()
    except OSError:
        pass
    return {"cpu": cpu_model_name(), "vendor": info.get("vendor_id"), "cpu_family": info.get("cpu family"),
            "cpu_model": info.get("model"), "cpu_flags": info.get("flags", "").split(),
            "cores": len(os.sched_getaffinity(0)), "isa": ops.cpu_dispatch() if cpu_kernels else None,
            "torch": torch.__version__,
            **({"gpu": torch.cuda.get_device_name()} if torch.cuda.is_available() else {}),
            "env": {k: v for k, v in sorted(os.environ.items())
                    if k.startswith("SWIFTSPEC_") or k == "ATEN_CPU_CAPABILITY"}, **_llama_cpp_build()}


def _llama_cpp_build() -> dict:
    """The llama.cpp build the peers ran, where one was loaded: its version, library path and the
    CPU features it was compiled for (``llama_print_system_info``)."""
    mod = sys.modules.get("llama_cpp")
    if mod is None:
        return {}
    return {"llama_cpp": {"version": getattr(mod, "__version__", "?"), "path": str(Path(mod.__file__).parent),
                          "system_info": mod.llama_print_system_info().decode(errors="replace").strip()}}
