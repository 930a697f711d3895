"""End-to-end decoding benchmark: SwiftSpec modes and peer decoders side by side.

Systems (``--systems``): ``swiftspec-async`` (SwiftSpec), ``swiftspec-serial`` (SwiftSpec-base),
``autoregressive`` (our target alone), ``hf`` (transformers ``generate``, target alone), ``hf-compile``
(the same with a static cache and the decode step compiled),
``hf-assisted`` (transformers assisted generation with the draft), ``swiftspec-profiled``
(the engine as the ``--config`` written by ``swiftspec profile`` sets it up: mode, cores, tree
shape, ``d``; with several ``--config`` files one system per file, ``swiftspec-profiled[<file
stem>]``, so configurations are compared side by side in one run), ``llama-cpp`` (llama.cpp on
the target's GGUF, when ``llama-cpp-python`` is installed and the target came from a GGUF) and
``llama-cpp-spec`` (the same with llama-cpp-python's speculative decoding, the draft's GGUF
proposing chains of 4 tokens).
``swiftspec-async-nokernels``, ``swiftspec-serial-nokernels`` and ``autoregressive-nokernels`` are
the same engines with the compiled kernels off (PyTorch ops and gloo only): the kernel ablation.

Every system is started once; prompts are interleaved (prompt i runs on every system before
prompt i+1) and never run concurrently, so all systems see the same machine state. With
``--random-weights`` (large shapes on one GPU) one system is resident at a time instead: each
is loaded, runs every prompt (once per ``--degrade`` value where it replays a draft's
acceptance), and is freed before the next loads; the memory check then asks for the largest
system's weights, on the GPU in a CUDA run. Greedy
decoding; ``matches_target`` says whether a system's tokens equal the ``autoregressive`` ones
(same weights and dtype; peers with their own numerics may differ at near-ties), for an engine
whose target runs at TP > 1 those of an autoregressive engine at that TP degree if one ran
(``reference`` names the system compared with; see :func:`reference_system`). Output: a
markdown table in the layout of the paper's Table 6 (compression ratio per dataset next to the
paper's), a PNG bar chart like its Figure 7, and with ``--json`` one JSON list of records.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

from swiftspec.benchmark import replay

DATASETS = ["mt_bench", "humaneval", "gsm8k", "alpaca", "sum", "qa"]
ABBREV = {"alpaca": "ALP", "gsm8k": "GSM", "humaneval": "HE", "mt_bench": "MT", "qa": "QA", "sum": "SUM"}
# SwiftSpec paper, Table 6 (Qwen2-72B target, Qwen2-1.5B draft, 8 GPUs): compression ratio
PAPER_TABLE6 = {"swiftspec-async": {"ALP": 2.92, "GSM": 3.78, "HE": 3.92, "MT": 3.11, "QA": 2.74, "SUM": 3.56},
                "swiftspec-serial": {"ALP": 3.28, "GSM": 4.2, "HE": 4.04, "MT": 3.42, "QA": 3.12, "SUM": 3.72}}
SYSTEMS = ("swiftspec-async", "swiftspec-async-nokernels", "swiftspec-profiled", "swiftspec-serial",
           "swiftspec-colocated",
           "swiftspec-serial-nokernels", "swiftspec-serial-dequantized", "autoregressive", "autoregressive-nokernels",
           "autoregressive-dequantized", "hf", "hf-compile", "hf-assisted", "llama-cpp", "llama-cpp-spec",
           "pipeline-autoregressive", "pipedec", "pipeinfer")
ENGINE_MODES = {"swiftspec-async": "async", "swiftspec-profiled": "async", "swiftspec-serial": "serial",
                "swiftspec-colocated": "colocated",
                "autoregressive": "autoregressive", "swiftspec-async-nokernels": "async",
                "swiftspec-serial-nokernels": "serial", "autoregressive-nokernels": "autoregressive",
                "swiftspec-serial-dequantized": "serial", "autoregressive-dequantized": "autoregressive",
                "pipeline-autoregressive": "pipeline-autoregressive", "pipedec": "pipedec", "pipeinfer": "pipeinfer"}
# the pipeline modes use 2 stages, each on its own share of the cores (swiftspec.pipeline.stages)
PIPELINE_STAGES = 2
# "-dequantized": every weight dequantized in the activation dtype (the engine before native weights)


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


def base_system(name: str) -> str:
    """The system a record's name is an instance of: ``swiftspec-profiled[serial-bs4]`` ->
    ``swiftspec-profiled``; other names are their own."""
    return name.split("[", 1)[0]


def expand_systems(systems: list[str], configs: list[str] | None) -> list[tuple[str, str | None]]:
    """(record name, configuration file or None) of every system to start: ``swiftspec-profiled``
    once per ``--config`` file, named ``swiftspec-profiled[<file stem>]`` when there are several.

    Every file is read here, before any model loads.

    Raises:
        ValueError: ``swiftspec-profiled`` without a configuration, configurations without
            ``swiftspec-profiled``, two files with the same stem (their rows would merge), or a
            file that is not an engine configuration (:meth:`EngineConfig.from_json`).
        FileNotFoundError: a configuration file that does not exist.
    """
    from swiftspec.engine.config import EngineConfig

    configs = list(configs or [])
    if "swiftspec-profiled" in systems and not configs:
        raise ValueError("swiftspec-profiled needs --config (from `swiftspec profile`)")
    if configs and "swiftspec-profiled" not in systems:
        raise ValueError("--config configures swiftspec-profiled: add it to --systems")
    stems = [Path(c).stem for c in configs]
    if len(set(stems)) != len(stems):
        raise ValueError(f"--config files need distinct names (their rows are named by them): {configs}")
    for c in configs:
        EngineConfig.from_json(c)
    out: list[tuple[str, str | None]] = []
    for s in systems:
        if s != "swiftspec-profiled":
            out.append((s, None))
        elif len(configs) == 1:
            out.append((s, configs[0]))
        else:
            out += [(f"{s}[{stem}]", c) for stem, c in zip(stems, configs)]
    return out


class EngineSystem:
    """A SwiftSpec engine in one of its modes, behind the peers' ``generate`` signature."""

    def __init__(self, system: str, target, draft, dtype: str, cores: list[int], d: int | None,
                 config: str | None = None, device: str = "auto"):
        from swiftspec.engine.config import TARGET_ONLY_MODES
        from swiftspec.engine.llm_engine import Engine, EngineConfig

        if config is not None:  # the file decides mode, cores and tree; the run decides the dtype
            cfg = EngineConfig.from_json(config, dtype=dtype, device=device)
        else:
            mode = ENGINE_MODES[system]
            kw: dict = dict(mode=mode, dtype=dtype, device=device, kernels=not system.endswith("-nokernels"),
                            weights="float32" if system.endswith("-dequantized") else "native")
            if mode == "async":
                n_draft = max(1, len(cores) // 4)
                kw.update(target_cores=cores[:-n_draft], draft_cores=cores[-n_draft:], d=d)
            elif mode.startswith("pipe"):
                kw.update(target_cores=cores, pipeline_stages=PIPELINE_STAGES)
            else:
                kw.update(target_cores=cores)
            cfg = EngineConfig(**kw)
        self.engine = Engine(target, draft if cfg.mode not in TARGET_ONLY_MODES else None,
                             config=cfg)
        self.system = system
        c = self.engine.config  # as resolved (mode="auto" and an automatic d decided)
        t = c.tree_params()
        self.shape = {"mode": c.mode, "bs": t.bs, "w": t.w, "topk": t.topk, "d": c.d, "target_tp": c.target_tp,
                      "weights": c.weights, "draft_payback": c.draft_payback, "draft_sms": c.draft_sms}

    def generate(self, prompt_ids, max_tokens, eos_ids=(), ignore_eos: bool = False, replay=None):
        """Greedy tokens and metrics; ``replay``: an acceptance trace's ranks (see
        :meth:`swiftspec.engine.llm_engine.Engine.generate`)."""
        from swiftspec.model_executor.sampling import SamplingParams

        out = self.engine.generate(prompt_ids, SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos),
                                   replay=replay)
        return out.token_ids, out.metrics

    def close(self):
        self.engine.close()


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


def start_system(system: str, target_dir, draft_dir, dtype: str, cores: list[int], args, n_ctx: int = 4096,
                 config: str | None = None):
    """Load one system of the run. ``n_ctx``: the llama.cpp peers' context (the longest prompt
    plus the tokens to generate; with a draft model llama-cpp-python keeps logits for every
    position of it, 0.6 MB each for the default pair's vocabulary). ``config``: the engine
    configuration file of a ``swiftspec-profiled`` system (:func:`expand_systems`)."""
    from swiftspec.benchmark.peers import HFPeer, LlamaCppPeer

    if base_system(system) == "swiftspec-profiled":
        if config is None:
            raise ValueError("swiftspec-profiled needs --config (from `swiftspec profile`)")
        return EngineSystem(system, target_dir, draft_dir, dtype, cores, None, config, args.device)
    if system in ENGINE_MODES:
        return EngineSystem(system, target_dir, draft_dir, dtype, cores, args.d, device=args.device)
    if system == "hf":
        return HFPeer(target_dir, None, dtype, threads=len(cores), device=args.device)
    if system == "hf-compile":
        return HFPeer(target_dir, None, dtype, threads=len(cores), device=args.device, compiled=True,
                      max_cache_len=n_ctx)
    if system == "hf-assisted":
        return HFPeer(target_dir, draft_dir, dtype, threads=len(cores), device=args.device)
    if system in ("llama-cpp", "llama-cpp-spec"):
        gguf, draft = args.target_gguf, args.draft_gguf
        if args.target is None or args.draft is None:
            from swiftspec.weights.loader import default_gguf_paths

            defaults = default_gguf_paths()
            gguf = gguf or (defaults[0] if args.target is None else None)
            draft = draft or (defaults[1] if args.draft is None else None)
        if gguf is None or not Path(gguf).exists():
            raise RuntimeError(f"{system} needs the target's GGUF file (--target-gguf)")
        if system == "llama-cpp":
            return LlamaCppPeer(gguf, threads=len(cores), n_ctx=n_ctx)
        if draft is None or not Path(draft).exists():
            raise RuntimeError("llama-cpp-spec needs the draft's GGUF file (--draft-gguf)")
        return LlamaCppPeer(gguf, threads=len(cores), n_ctx=n_ctx, draft_gguf=draft, draft_tokens=4)
    raise ValueError(system)


def reference_system(s: str, systems: dict, outs: dict) -> str | None:
    """The system whose tokens are ``s``'s "target": for an engine, an autoregressive engine with
    the same target TP degree and weights (at TP > 1 the row-parallel sums round at other points
    than TP = 1's, so in bf16 greedy output may differ from TP = 1's at near-ties; dequantized
    weights are another model), ``autoregressive`` first; for a peer, ``autoregressive``. None
    (the table's "n/a") where no such system ran, and for the reference itself: no system is
    compared with its own output."""
    shape = getattr(systems.get(s), "shape", None)
    if shape is None:
        return "autoregressive" if "autoregressive" in outs else None
    key = (shape.get("target_tp", 1), shape.get("weights", "native"))
    same = [r for r in outs if r != s and getattr(systems.get(r), "shape", {}).get("mode") == "autoregressive"
            and (systems[r].shape.get("target_tp", 1), systems[r].shape.get("weights", "native")) == key]
    return min(same, key=lambda r: r != "autoregressive", default=None)


def _equals(rs: list[dict]) -> str:
    """The "equals target" cell: how many prompts gave the autoregressive tokens, "n/a" where
    that reference did not run."""
    known = [r["matches_target"] for r in rs if r["matches_target"] is not None]
    return f"{sum(known)}/{len(known)}" if known else "n/a"


def summarize(records: list[dict]) -> list[dict]:
    """One row per (system, dataset): totals over its prompts."""
    out = []
    keys = sorted({(r["system"], r["dataset"]) for r in records},
                  key=lambda k: (SYSTEMS.index(base_system(k[0])), k[0], k[1]))
    for system, ds in keys:
        rs = [r for r in records if r["system"] == system and r["dataset"] == ds]
        toks = sum(r["num_tokens"] - 1 for r in rs)
        secs = sum(r["decode_s"] for r in rs)
        out.append({"system": system, "dataset": ds, "prompts": len(rs),
                    "tokens_per_s": toks / secs if secs else float("nan"),
                    "compression_ratio": statistics.mean(r["compression_ratio"] for r in rs),
                    "ttft_s": statistics.mean(r["ttft_s"] for r in rs),
                    "tbt_mean_s": statistics.mean(r["tbt_mean_s"] for r in rs),
                    "tbt_p50_s": statistics.median(r["tbt_p50_s"] for r in rs),
                    "tbt_p99_s": max(r["tbt_p99_s"] for r in rs),
                    "matches_target": _equals(rs)})
    return out


def overall(records: list[dict]) -> dict[str, float]:
    """Decode tokens/s of each system over all its prompts."""
    res = {}
    for s in dict.fromkeys(r["system"] for r in records):
        rs = [r for r in records if r["system"] == s]
        secs = sum(r["decode_s"] for r in rs)
        res[s] = sum(r["num_tokens"] - 1 for r in rs) / secs if secs else float("nan")
    return res


def markdown(records: list[dict]) -> str:
    """Decode-speed table (systems x datasets) and a Table-6 style compression table."""
    rows = summarize(records)
    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    systems = list(dict.fromkeys(r["system"] for r in rows))
    tot = overall(records)
    base = tot.get("autoregressive")
    get = {(r["system"], r["dataset"]): r for r in rows}
    head = " | ".join(ABBREV.get(d, d) for d in datasets)
    lines = [f"| system | {head} | all | vs autoregressive | TTFT s | TBT p50 ms | TBT p99 ms | equals target |",
             "|" + "---|" * (len(datasets) + 7)]
    for s in systems:
        rs = [get[(s, d)] for d in datasets if (s, d) in get]
        cells = " | ".join(f"{get[(s, d)]['tokens_per_s']:.2f}" if (s, d) in get else "-" for d in datasets)
        rel = f"{tot[s] / base:.2f}x" if base else "-"
        lines.append(f"| {s} | {cells} | {tot[s]:.2f} | {rel} | {statistics.mean(r['ttft_s'] for r in rs):.2f} | "
                     f"{1e3 * statistics.median(r['tbt_p50_s'] for r in rs):.0f} | "
                     f"{1e3 * max(r['tbt_p99_s'] for r in rs):.0f} | {_equals([r for r in records if r['system'] == s])} |")
    lines += ["", "Compression ratio (verified tokens per target forward), with the paper's Table 6 "
              "(Qwen2-72B / Qwen2-1.5B on 8 GPUs) for reference:", "",
              f"| system | {head} |", "|" + "---|" * (len(datasets) + 1)]
    for s in systems:
        if s in ("autoregressive", "hf", "hf-compile", "llama-cpp", "pipeline-autoregressive", "pipedec", "pipeinfer"):
            continue
        lines.append(f"| {s} | " + " | ".join(
            f"{get[(s, d)]['compression_ratio']:.2f}" if (s, d) in get else "-" for d in datasets) + " |")
        if s in PAPER_TABLE6:
            lines.append(f"| paper: {s} | " + " | ".join(
                f"{PAPER_TABLE6[s].get(ABBREV.get(d, ''), float('nan')):.2f}" for d in datasets) + " |")
    if pipeline_table(records):
        lines += ["", "Pipeline modes (busy = a stage's forward time / the request's wall time; stage 0 "
                  "also runs the draft):", "", pipeline_table(records)]
    return "\n".join(lines)


def bar_chart(records: list[dict], path: Path, title: str) -> None:
    """Grouped bars of decode tokens/s per dataset and system (the paper's Figure 7 layout)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summarize(records)
    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    systems = list(dict.fromkeys(r["system"] for r in rows))
    get = {(r["system"], r["dataset"]): r["tokens_per_s"] for r in rows}
    fig, ax = plt.subplots(figsize=(1.6 * len(datasets) + 3, 4))
    width = 0.8 / len(systems)
    for i, s in enumerate(systems):
        xs = [j + i * width for j in range(len(datasets))]
        ax.bar(xs, [get.get((s, d), 0.0) for d in datasets], width, label=s)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(datasets))], [ABBREV.get(d, d) for d in datasets])
    ax.set_ylabel("decode tokens/s")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def build_parser(ap: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    ap = ap or argparse.ArgumentParser(prog="swiftspec bench", description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", nargs="+", default=DATASETS, help="dataset names or JSONL files (default: all six)")
    ap.add_argument("--num-prompts", type=int, default=5, help="prompts per dataset")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--systems", nargs="+", default=["swiftspec-async", "swiftspec-serial", "autoregressive", "hf",
                                                      "hf-assisted"], choices=SYSTEMS)
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    ap.add_argument("--d", type=int, default=None, help="async expansions per iteration (default automatic)")
    ap.add_argument("--config", nargs="+", metavar="FILE",
                    help="engine configuration JSON for swiftspec-profiled (from `swiftspec profile`); with several "
                         "files, one swiftspec-profiled[<file stem>] system per file, side by side")
    ap.add_argument("--target")
    ap.add_argument("--draft")
    ap.add_argument("--target-gguf", help="GGUF of the target for llama-cpp (default: the default pair's)")
    ap.add_argument("--draft-gguf", help="GGUF of the draft for llama-cpp-spec (default: the default pair's)")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                    help="where the engines and the transformers peers run (auto: CUDA when present)")
    ap.add_argument("--out", default="bench/out", help="directory for the table, chart and records")
    ap.add_argument("--json", action="store_true", help="print the per-prompt records as one JSON list")
    replay.add_arguments(ap)
    return ap


def run(args: argparse.Namespace) -> list[dict]:
    import torch

    from swiftspec.engine.llm_engine import cpu_has_bf16
    from swiftspec.weights.loader import resolve_model

    replay.check(args)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = args.dtype if args.dtype != "auto" else (
        "bfloat16" if args.device == "cuda" or cpu_has_bf16() else "float32")
    cores = sorted(os.sched_getaffinity(0))
    # (dataset, prompt ids, tokens to generate, the acceptance to replay or None)
    prompts: list[tuple] = []
    if args.random_weights:
        prompts = replay.trace_prompts(args)
        target_dir, draft_dir = replay.random_pair(args, dtype)
        eos: list[int] = []
    else:
        target_dir = resolve_model(args.target, "target")
        draft_dir = resolve_model(args.draft, "draft")
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(target_dir))
        eos = [t for t in {tok.eos_token_id} if t is not None]
        for spec in args.prompts:
            ds, ps = load_prompts(spec, args.num_prompts)
            for p in ps:
                ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                              tokenize=True)
                prompts.append((ds, list(ids["input_ids"] if hasattr(ids, "keys") else ids), args.max_tokens, None))
    to_start = expand_systems(args.systems, args.config)
    # random weights (large shapes on one GPU): one system resident at a time, each freed before the next
    alone = bool(args.random_weights)
    check_memory(weight_bytes([s for s, _ in to_start], target_dir, draft_dir, dtype),
                 available_memory_bytes(args.device), together=not alone, where=args.device)
    degrade = getattr(args, "degrade", [0.0]) if args.random_weights else [0.0]
    started: dict = {}  # every system started (closed ones kept for their shape)
    outs: dict[tuple[float, int], dict] = {}  # (p, prompt index) -> {system: (tokens, metrics)}
    n_ctx = max(len(ids) + n for _, ids, n, _ in prompts) + 16
    for group in ([[x] for x in to_start] if alone else [to_start]):
        live: dict = {}
        try:
            for s, config in group:
                live[s] = started[s] = start_system(s, target_dir, draft_dir, dtype, cores, args,
                                                    -(-n_ctx // 256) * 256, config)
            _run_prompts(live, prompts, eos, degrade, outs)
        finally:
            for sysm in live.values():
                sysm.close()
            _free_device_memory(args.device)
    records: list[dict] = []
    targets: list[tuple[str, list[int], list[int]]] = []  # (dataset, prompt, the target's tokens) for the trace
    for (p, i), by_system in sorted(outs.items()):
        ds, ids, _, ranks = prompts[i]
        if args.record_trace and "autoregressive" in by_system:
            targets.append((ds, ids, by_system["autoregressive"][0]))
        for s, (toks, m) in by_system.items():
            ref = None if ranks is not None else reference_system(s, started, by_system)  # replayed: not the target's
            records.append({"system": s if p == 0 else f"{s}[p={p:g}]", "dataset": ds, "dtype": dtype,
                            "device": args.device, "replayed": ranks is not None,
                            **({"degrade_p": p} if ranks is not None else {}), "num_tokens": m.num_tokens,
                            "decode_s": m.decode_s, "tokens_per_s": m.tokens_per_s,
                            "compression_ratio": m.compression_ratio, "ttft_s": m.ttft_s,
                            "tbt_mean_s": m.tbt_mean_s, "tbt_p50_s": m.tbt_p50_s, "tbt_p99_s": m.tbt_p99_s,
                            "matches_target": None if ref is None else toks == by_system[ref][0],
                            "reference": ref, "ran": m.mode,
                            "draft_stalls": m.draft.get("stall_expansions"),
                            "target_wait_s": m.target.get("wait_s"), **_busy_record(m), **_pipeline_record(m),
                            **({"engine": started[s].shape} if isinstance(started.get(s), EngineSystem) else {})})
    if args.record_trace:
        replay.record_trace(args, targets, target_dir, draft_dir, dtype, machine_record())
    return records


def _uses_draft(sysm) -> bool:
    """Whether a system's speed depends on the replayed acceptance: an engine whose mode loads a
    draft (:func:`swiftspec.engine.placement.uses_draft`); never a peer."""
    from swiftspec.engine.placement import uses_draft

    return isinstance(sysm, EngineSystem) and uses_draft(sysm.shape["mode"])


def _run_prompts(live: dict, prompts: list[tuple], eos: list[int], degrade: list[float], outs: dict) -> None:
    """Every prompt on every loaded system, prompt by prompt (prompt i on each system before prompt
    i + 1), once per degradation ``p`` (``p`` > 0: only the systems that replay a draft's
    acceptance, :func:`_uses_draft`). Results go to ``outs[(p, prompt index)][system]``. A system
    that fails is closed and dropped from the remaining prompts; the others go on."""
    from tqdm import tqdm

    for p in degrade:
        for i, (ds, ids, max_tokens, ranks) in enumerate(tqdm(prompts, desc="prompts" if p == 0 else f"prompts, p={p:g}",
                                                              file=sys.stderr)):
            for s, sysm in list(live.items()):
                if p > 0 and not _uses_draft(sysm):
                    continue
                try:
                    if ranks is None:
                        out = sysm.generate(ids, max_tokens, eos)
                    elif isinstance(sysm, EngineSystem):  # random weights: EOS ignored, acceptance replayed
                        out = sysm.generate(ids, max_tokens, ignore_eos=True, replay=ranks.degraded(p, seed=i))
                    else:
                        out = sysm.generate(ids, max_tokens, ignore_eos=True)
                except Exception as e:  # one failing system must not cost the others' records
                    print(f"swiftspec bench: {s} failed on a {ds} prompt ({len(ids)} tokens) and is dropped from "
                          f"the remaining prompts: {type(e).__name__}: {e}", file=sys.stderr)
                    live.pop(s).close()
                    continue
                outs.setdefault((p, i), {})[s] = out


def _free_device_memory(device: str) -> None:
    """Return a closed in-process system's GPU memory (the transformers peers live in this process)."""
    import gc

    gc.collect()
    if device == "cuda":
        import torch

        torch.cuda.empty_cache()


def _busy_record(m) -> dict:
    """Each model's forwards and busy seconds for one request (device time on CUDA, from events;
    wall time on CPU), where the engine reports them: decode time minus the target's busy time is
    the host's share of a step (bench/RESULTS.md, the GPU component table)."""
    return {f"{role}_{k}": stats[k] for role, stats in (("target", m.target), ("draft", m.draft))
            for k in ("busy_s", "forwards") if k in stats}


def _pipeline_record(m) -> dict:
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


def pipeline_table(records: list[dict]) -> str:
    """The pipeline modes' utilization: tokens per timestep, nodes pruned mid-pipeline, busy
    fraction of each stage, KV entries recomputed ("" when no pipeline mode ran)."""
    systems = list(dict.fromkeys(r["system"] for r in records if "pipeline" in r))
    if not systems:
        return ""
    lines = ["| system | tokens per timestep | nodes issued | nodes pruned mid-pipeline | runs cancelled mid-pipeline "
             "| stage busy | draft busy | KV recomputed |", "|---|---|---|---|---|---|---|---|"]
    for s in systems:
        ps = [r["pipeline"] for r in records if r["system"] == s]
        steps = sum(p["timesteps"] for p in ps)
        toks = sum(r["num_tokens"] for r in records if r["system"] == s)
        busy = [statistics.mean(p["stage_busy"][k] for p in ps) for k in range(len(ps[0]["stage_busy"]))]
        lines.append(f"| {s} | {toks / steps:.2f} | {sum(p['issued'] for p in ps)} | {sum(p['pruned'] for p in ps)} | "
                     f"{sum(p.get('cancelled', 0) for p in ps)} | "
                     + " / ".join(f"{b:.0%}" for b in busy) + f" | {statistics.mean(p['draft_busy'] for p in ps):.0%} | "
                     f"{sum(p['recomputed_kv'] for p in ps)} |")
    return "\n".join(lines)


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


def main(argv=None, args: argparse.Namespace | None = None) -> int:
    args = args or build_parser().parse_args(argv)
    records = run(args)
    if args.json:
        print(json.dumps(records))
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cores = sorted(os.sched_getaffinity(0))
    title = (f"{records[0]['dtype']}, {args.device}, {len(cores)} cores, {args.max_tokens} tokens, "
             f"{args.num_prompts} prompts/dataset")
    if args.random_weights:
        title += f", random weights, acceptance replayed from {Path(args.acceptance or replay.PACKAGED_TRACE).name}"
    table = markdown(records)
    print(f"{title} ({time.strftime('%Y-%m-%d %H:%M')})\n\n{table}")
    (out / "e2e.md").write_text(f"{title}\n\n{table}\n")
    # the records with the command and the machine they ran on (bench/tables.py renders either form)
    command = "swiftspec bench " + " ".join(sys.argv[2:] if argv is None else argv)
    on_gpu = any(r.get("device") == "cuda" for r in records)
    (out / "e2e.json").write_text(json.dumps({"command": command, "machine": machine_record(cpu_kernels=not on_gpu),
                                              "records": records}, indent=1))
    try:
        bar_chart(records, out / "e2e.png", title)
        print(f"\nchart: {out / 'e2e.png'}")
    except ImportError:
        print("\n(matplotlib not installed: no chart)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
