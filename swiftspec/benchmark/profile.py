"""``swiftspec profile``: choose the device split, ``d`` and the tree shape for this machine.

The paper's profiling phase (§3.1 "Setting the number of tree expansions", §5.5): for every
candidate split of the devices (target group x devices, the draft group the rest; even x
preferred on GPUs), measure the target's verification time and the draft's expansion time while
both run, set ``d`` to ``r`` or ``r + 1`` with ``r = floor(t_target / t_draft)`` (plus the
engine's automatic choice), optionally sweep the tree shape (``bs``, ``w``), run every candidate end
to end on calibration prompts and write the chosen configuration as JSON for
``Engine(config=...)`` / ``swiftspec generate --config``.

Besides the splits, the shared allocation is a candidate: ``serial`` mode (SwiftSpec-base, §5.4),
where draft and target take turns on every device, with the default tree, the shallow one
(``mode_selection.SHALLOW_TREE``: bs 2, one expansion, the fastest with AVX-512 VNNI) and a middle one
(:data:`MIDDLE_TREE`: bs 4, two expansions, within a few percent of the shallow one on AMD Zen 5,
so a machine where it is clearly faster gets it; bench/LOG.md, "Tree shapes side by side"); and so
is the target alone (``autoregressive``), which wins where a verification batch costs more than it
saves, and the target alone verifying prompt-lookup proposals (``ngram``: no draft forward, no
draft prefill). The paper's GPUs gain from splitting because a group's speed grows slowly with its
size; on a few CPU cores the target's speed is about proportional to its cores (bench/LOG.md,
"Allocation profile": an 8-row verification took nearly twice as long on one core as on two, and
longer still while the draft streamed its weights on the other core), so sharing can win, and the
profile says so instead of assuming the split. The engine's defaults are kept unless a candidate
beats them by more than ``margin`` (run-to-run noise on a shared machine is several percent, and a
winner by noise does worse than the defaults on prompts the profile did not see), both in the sweep
and in a fresh side-by-side measurement of the two (:func:`choose_confirmed`).
The chosen mode is also stored for ``mode="auto"`` on this machine and model pair
(:mod:`swiftspec.engine.machine_profile`).

On a machine where the engine runs on CUDA the same measurement decides between the GPU layouts:
``async`` splits of the GPUs (two or more), ``serial``, ``colocated`` with and without an SM
partition for the draft (a quarter of the SMs), ``autoregressive`` and ``ngram`` (docs/gpu.md
gives the arithmetic of when speculation pays there).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

from swiftspec.spec_decode.tree_loops import SERIAL_D


def candidate_splits(devices: list[int], gpu: bool) -> list[tuple[list[int], list[int]]]:
    """(target devices, draft devices) for every split that leaves the draft at least one device
    and the target at least as many as the draft; on GPUs only even target sizes (§5.5)."""
    n = len(devices)
    out = []
    for x in range(n - 1, 0, -1):
        if x < n - x or (gpu and x % 2 and x != 1):
            continue
        out.append((devices[:x], devices[x:]))
    return out


def d_candidates(t_target: float, t_draft: float) -> list[int]:
    """``{r, r + 1}`` with ``r = floor(t_target / t_draft)`` (at least 1)."""
    r = max(1, math.floor(t_target / t_draft)) if t_draft > 0 else 1
    return [r, r + 1]


# Tree shapes (bs, w) tried by --sweep after the defaults: wider and narrower expansions, smaller and
# bigger subgraphs (a verification costs more per row on CPUs, so bs trades depth for target time).
SWEEP_SHAPES = [(8, 4), (8, 1), (6, 2), (12, 2), (4, 4), (16, 8)]
# the serial tree between the shallow one and the default: bs 4, two expansions (bench/LOG.md, "Tree shapes
# side by side")
MIDDLE_TREE = {"bs": 4, "d": 2}


def choose(rows: list[dict], default: dict, margin: float = 0.05) -> dict:
    """The row to use: the fastest one if it beats the ``default`` row (the engine's defaults) by
    more than ``margin`` (a fraction) in tokens/s, else ``default``."""
    best = max(rows, key=lambda r: r["tokens_per_s"])
    return best if best["tokens_per_s"] > (1.0 + margin) * default["tokens_per_s"] else default


def choose_confirmed(rows: list[dict], remeasure, margin: float = 0.05) -> tuple[dict, list[dict]]:
    """The configuration to write and the extra measurements taken to decide it.

    ``rows[0]`` is the defaults. The sweep's fastest row is the maximum of noisy measurements, so
    its speed is biased upward (taken as is, a sweep winner lost to the defaults on prompts the
    profile did not see): when :func:`choose` picks a row other than the defaults,
    ``remeasure(row)`` measures the defaults and that row again, one after the other, and the
    winner must beat the defaults by ``margin`` in this fresh pair as well. Returns (chosen row,
    the fresh rows: none, or the defaults' and the candidate's)."""
    best = choose(rows, rows[0], margin)
    if best is rows[0]:
        return best, []
    again = [remeasure(rows[0]), remeasure(best)]
    return choose(again, again[0], margin), again


def serial_d_candidates(default: int = SERIAL_D) -> list[int]:
    """``d`` values tried for the shared (serial) allocation besides its default: one fewer and
    one more expansion per verification. Serial drafting is on the critical path, so ``d`` trades
    draft time against tree depth directly, without the async rule's overlap."""
    return [default - 1, default + 1] if default > 1 else [default + 1]


def _measure(engine, prompts, max_tokens) -> dict:
    from swiftspec.model_executor.sampling import SamplingParams

    toks = secs = verifs = 0.0
    t_target, t_draft = [], []
    for ids in prompts:
        m = engine.generate(ids, SamplingParams(max_tokens=max_tokens)).metrics
        toks += m.num_tokens - 1
        secs += m.decode_s
        verifs += m.verifications
        if m.target.get("forwards"):
            t_target.append(m.target["busy_s"] / m.target["forwards"])
        if m.draft.get("expansions"):
            t_draft.append(m.draft["expansion_s"] / m.draft["expansions"])
        elif m.draft.get("forwards"):  # serial: only the draft runner's own counters (prefill included)
            t_draft.append(m.draft["busy_s"] / m.draft["forwards"])
    return {"tokens_per_s": toks / secs if secs else 0.0, "compression_ratio": toks / verifs if verifs else 0.0,
            "t_target_s": sum(t_target) / len(t_target) if t_target else float("nan"),
            "t_draft_s": sum(t_draft) / len(t_draft) if t_draft else float("nan")}


def _calibration_prompts(target_dir: Path, prompts, num_prompts: int) -> list[list[int]]:
    """Token ids of the calibration prompts: ``num_prompts`` from each spec in ``prompts`` (a
    dataset name or a JSONL path, :func:`swiftspec.benchmark.records.load_prompts`), each wrapped
    in the target's chat template as one user turn."""
    from transformers import AutoTokenizer

    from swiftspec.benchmark.records import load_prompts

    tok = AutoTokenizer.from_pretrained(str(target_dir))
    calib = []
    for spec in prompts:
        for p in load_prompts(spec, num_prompts)[1]:
            ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
            calib.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return calib


def _async_splits(pool: list[int], gpu: bool) -> list[tuple[list[int], list[int]]]:
    """:func:`candidate_splits` of ``pool`` (GPU indices, or CPU cores), the engine's default split
    (a quarter of the pool, at least one, for the draft) first."""
    splits = candidate_splits(pool, gpu=gpu)
    n_draft = max(1, len(pool) // 4)  # the engine's default split
    splits.sort(key=lambda sp: len(sp[1]) != n_draft)
    return splits


def _engine_config(row: dict, dtype: str, devices: list[int], gpus: list[int]):
    """The :class:`~swiftspec.engine.config.EngineConfig` a candidate row describes: an ``async``
    row's ``target_cores`` / ``draft_cores`` are GPU indices where ``gpus`` is not empty (the
    processes then run on all ``devices``), else CPU cores; ``d == "auto"`` is the automatic d."""
    from swiftspec.engine.config import EngineConfig

    split = row["mode"] == "async"
    on_gpus = split and gpus
    return EngineConfig(mode=row["mode"], dtype=dtype, target_cores=devices if on_gpus else row["target_cores"],
                        draft_cores=None if not split or on_gpus else row["draft_cores"],
                        target_devices=row["target_cores"] if on_gpus else None,
                        draft_devices=row["draft_cores"] if on_gpus else None, draft_sms=row.get("draft_sms"),
                        bs=row["bs"], w=row["w"], topk=row["w"], d=None if row["d"] == "auto" else row["d"])


def _candidates(splits, shapes, devices: list[int], dflt, gpus: list[int], sms: int) -> list[tuple[dict, bool]]:
    """The sweep's candidate rows in measuring order, each with whether to explore ``d`` around
    its automatic value: every async split x tree shape (``shapes``: (bs, w) pairs), serial with
    the default tree, the shallow and the middle tree, autoregressive, ngram, and on GPUs
    colocated with all SMs and with a quarter (``sms``: the first GPU's SM count) for the draft."""
    from swiftspec.engine.mode_selection import SHALLOW_TREE

    out = []
    for t_dev, d_dev in splits:
        for bs, w in shapes:
            out.append(({"round": "sweep", "mode": "async", "target_cores": t_dev, "draft_cores": d_dev,
                         "bs": bs, "w": w, "d": "auto"}, True))
    out.append(({"round": "sweep", "mode": "serial", "target_cores": devices, "draft_cores": devices,
                 "bs": dflt.bs, "w": dflt.w, "d": "auto"}, True))
    # the shallow tree (root and best child, one expansion): where verifying a node costs nearly a
    # step; the middle one between it and the default
    for tree in (SHALLOW_TREE, MIDDLE_TREE):
        out.append(({"round": "sweep", "mode": "serial", "target_cores": devices, "draft_cores": devices,
                     "bs": tree["bs"], "w": dflt.w, "d": tree["d"]}, False))
    # the target alone: where a verification batch costs more than the tokens it saves, the fastest
    out.append(({"round": "sweep", "mode": "autoregressive", "target_cores": devices, "draft_cores": [],
                 "bs": dflt.bs, "w": dflt.w, "d": "auto"}, False))
    # the target alone verifying prompt-lookup proposals: no draft cost, no draft prefill
    out.append(({"round": "sweep", "mode": "ngram", "target_cores": devices, "draft_cores": [],
                 "bs": dflt.bs, "w": dflt.w, "d": "auto"}, False))
    if gpus:  # one GPU shared by both models, the draft on its own stream: all SMs, then a quarter of them
        for draft_sms in (None, max(1, sms // 4)):
            out.append(({"round": "sweep", "mode": "colocated", "target_cores": devices, "draft_cores": devices,
                         "bs": dflt.bs, "w": dflt.w, "d": "auto", "draft_sms": draft_sms}, False))
    return out


def _run_candidate(row: dict, config, target_dir: Path, draft_dir: Path, calib: list[list[int]],
                   max_tokens: int, bar, explore_d: bool = False) -> list[dict]:
    """Measure ``row``'s configuration (``config``, an EngineConfig) on one engine after an 8-token
    warm-up; with ``explore_d`` (automatic d) the other ``d`` values (async: ``d_candidates`` of
    its measured times; serial: ``serial_d_candidates``) are measured on the same engine.

    Returns one row per ``d`` measured: ``row`` with its ``d`` and :func:`_measure`'s fields
    (tokens/s, compression ratio, per-forward seconds). ``bar`` (tqdm) advances once per row."""
    from swiftspec.engine.llm_engine import Engine
    from swiftspec.model_executor.sampling import SamplingParams

    out = []
    with Engine(target_dir, draft_dir, config=config) as eng:
        eng.generate(calib[0], SamplingParams(max_tokens=8))  # warm-up: first touch of the weights
        ds = [eng.config.d]
        for d in ds:
            eng.config.d = d
            meas = _measure(eng, calib, max_tokens)
            out.append({**row, "d": "auto" if d is None else d, **meas})
            bar.update()
            if explore_d and d is None and row["mode"] == "async":  # the measured times give r
                ds += d_candidates(meas["t_target_s"], meas["t_draft_s"])
            elif explore_d and d is None:
                ds += serial_d_candidates()
    return out


def _chosen_config(best: dict, config, prompts, num_prompts: int, max_tokens: int) -> dict:
    """The JSON-able configuration written for the winner: ``config``'s (EngineConfig) fields and
    ``_measured`` (its tokens/s, compression ratio, per-forward seconds, the calibration used and
    the local date)."""
    out = asdict(config)
    out["_measured"] = {"tokens_per_s": best["tokens_per_s"], "compression_ratio": best["compression_ratio"],
                        "t_target_s": best["t_target_s"], "t_draft_s": best["t_draft_s"],
                        "calibration": list(prompts), "num_prompts": num_prompts, "max_tokens": max_tokens,
                        "date": time.strftime("%Y-%m-%d %H:%M")}
    return out


def profile(target=None, draft=None, prompts=("humaneval", "mt_bench"), num_prompts: int = 2,
            max_tokens: int = 128, sweep: bool = False, dtype: str = "auto", devices: list[int] | None = None,
            progress: bool = True, margin: float = 0.05,
            retune_kernels: bool = False) -> tuple[dict, list[dict], Path]:
    """Measure every candidate; return (chosen configuration dict, all candidate rows, the file
    where the chosen mode is stored for ``mode="auto"``, :func:`swiftspec.engine.machine_profile.save_profile`).

    The first candidate is the engine's defaults (default split, ``bs``, ``w``, automatic ``d``);
    see :func:`choose` for how ``margin`` (a fraction of tokens/s) keeps it. A sweep winner other
    than the defaults is confirmed by measuring it and the defaults once more ("confirm" rows) and
    choosing between those two fresh measurements. Each candidate costs one engine start and
    ``len(prompts) * num_prompts * max_tokens`` generated tokens per ``d`` tried.

    Args:
        target, draft: model paths or names (:func:`swiftspec.weights.loader.resolve_model`;
            None: the default pair).
        prompts: calibration prompt specs (dataset names or JSONL paths).
        num_prompts: prompts taken from each spec.
        max_tokens: tokens generated per prompt.
        sweep: also try the tree shapes in :data:`SWEEP_SHAPES`.
        dtype: the engine's dtype name.
        devices: CPU cores to use (default: this process's affinity).
        progress: a tqdm bar on stderr.
        margin: the fraction by which a candidate must beat the defaults.
        retune_kernels: first measure the quantized GEMM's variants on this machine again
            (:func:`retune`), whatever its stored kernel profile says; the candidates' workers
            then run the new choice.

    Raises:
        ModelLoadError: a model cannot be resolved; whatever an engine start raises.
    """
    from tqdm import tqdm

    from swiftspec.engine.config import EngineConfig
    from swiftspec.engine.machine_profile import save_profile
    from swiftspec.weights.loader import resolve_model

    target_dir, draft_dir = resolve_model(target, "target"), resolve_model(draft, "draft")
    if retune_kernels:
        retune(target_dir, draft_dir, progress)
    calib = _calibration_prompts(target_dir, prompts, num_prompts)
    devices = devices or sorted(os.sched_getaffinity(0))
    dflt = EngineConfig()
    shapes = [(dflt.bs, dflt.w)] + ([s for s in SWEEP_SHAPES if s != (dflt.bs, dflt.w)] if sweep else [])
    gpus, sms = _cuda_devices()
    # async splits: of the GPUs where the engine runs on CUDA (one process per GPU), else of the cores
    splits = _async_splits(gpus or devices, gpu=bool(gpus))
    bar = tqdm(total=(len(splits) * len(shapes) + 1) * 3 + 6, desc="candidates", file=sys.stderr,
               disable=not progress)

    def run(row: dict, explore_d: bool = False) -> list[dict]:
        return _run_candidate(row, _engine_config(row, dtype, devices, gpus), target_dir, draft_dir, calib,
                              max_tokens, bar, explore_d)

    rows: list[dict] = []
    for row, explore_d in _candidates(splits, shapes, devices, dflt, gpus, sms):
        rows += run(row, explore_d)
    best, again = choose_confirmed(rows, lambda r: run({**r, "round": "confirm"})[0], margin)
    rows += again
    bar.close()
    best["chosen"] = True
    out = _chosen_config(best, _engine_config(best, dtype, devices, gpus), prompts, num_prompts, max_tokens)
    return out, rows, save_profile(out, target_dir, draft_dir)


def retune(target_dir, draft_dir, progress: bool = True):
    """Measure the quantized GEMM's variants on the pair's weights again and store the winner for
    this machine (:func:`swiftspec.model_executor.kernel_tuning.tune_kernels` with ``retune``; the
    rows of the default configuration's verification), then the pair's step costs that
    ``mode="auto"`` weighs (:func:`swiftspec.model_executor.step_costs.measure_step_costs`: the
    stored measurements, maybe of a busy moment, are replaced by one taken now, and the next engine
    starts add theirs); returns the
    :class:`~swiftspec.ops.tuning.Choice` (None with the kernels unavailable)."""
    from swiftspec.engine.config import EngineConfig
    from swiftspec.model_executor.kernel_tuning import tune_kernels
    from swiftspec.model_executor.step_costs import measure_step_costs

    cfg = EngineConfig()
    choice = tune_kernels([(str(target_dir), None), (str(draft_dir), cfg.draft_vocab)], [1, cfg.bs], retune=True)
    measure_step_costs(target_dir, draft_dir, cfg.draft_vocab, remeasure=True)
    if progress and choice is not None:
        times = ", ".join(f"{v} {t * 1e3:.1f} ms" for v, t in choice.times_s.items())
        print(f"quantized GEMM: {choice.variant} ({choice.source}: {times or 'no GGUF weights'})", file=sys.stderr)
    return choice


def _cuda_devices() -> tuple[list[int], int]:
    """(the visible GPUs' indices, the first one's streaming multiprocessors): where the engine
    runs on CUDA (``device="auto"``), the profile measures the GPU layouts; ``([], 0)`` without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return [], 0
    return list(range(torch.cuda.device_count())), torch.cuda.get_device_properties(0).multi_processor_count


def table(rows: list[dict]) -> str:
    """The candidate rows as a markdown table: round, mode, cores, bs, w, d, per-forward target and
    draft milliseconds, tokens/s (the chosen row marked **chosen**) and compression ratio."""
    lines = ["| round | mode | target cores | draft cores | bs | w | d | t_target ms | t_draft ms | tokens/s | compression |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mark = " **chosen**" if r.get("chosen") else ""
        lines.append(f"| {r.get('round', 'sweep')} | {r.get('mode', 'async')} | {r['target_cores']} | {r['draft_cores']} | "
                     f"{r['bs']} | {r['w']} | {r['d']} | "
                     f"{1e3 * r['t_target_s']:.0f} | {1e3 * r['t_draft_s']:.0f} | {r['tokens_per_s']:.2f}{mark} | "
                     f"{r['compression_ratio']:.2f} |")
    return "\n".join(lines)


def build_parser(ap: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The command line of ``swiftspec profile`` (added to ``ap`` when given): the model pair,
    calibration prompt sets and counts, tokens per prompt, ``--sweep``, ``--margin``, dtype, the CPU
    cores to split and the output file."""
    ap = ap or argparse.ArgumentParser(prog="swiftspec profile", description=__doc__.splitlines()[0])
    ap.add_argument("--target")
    ap.add_argument("--draft")
    ap.add_argument("--prompts", nargs="+", default=["humaneval", "mt_bench"],
                    help="calibration prompt sets (dataset names or JSONL files)")
    ap.add_argument("--num-prompts", type=int, default=2, help="prompts per calibration set")
    ap.add_argument("--max-tokens", type=int, default=128,
                    help="tokens per calibration prompt (64 were too few: bs = 6 won on them and lost on longer answers)")
    ap.add_argument("--sweep", action="store_true",
                    help="also try (bs, w) = " + ", ".join(map(str, SWEEP_SHAPES)))
    ap.add_argument("--margin", type=float, default=0.05,
                    help="keep the defaults unless a candidate is faster by more than this fraction")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    ap.add_argument("--cores", help="comma-separated CPU cores to split (default: all available)")
    ap.add_argument("--output", default="swiftspec-config.json", help="where to write the chosen configuration")
    ap.add_argument("--retune-kernels", action="store_true",
                    help="measure the quantized GEMM's kernel variants on this machine again first "
                         "(else a stored measurement is kept)")
    return ap


def main(argv=None, args: argparse.Namespace | None = None) -> int:
    """Profile from ``argv`` or parsed ``args`` (:func:`profile`), print every candidate and the
    choice, and write the chosen configuration JSON to ``--output`` atomically (temporary file, then
    ``os.replace``). Returns the exit status (0); raises what :func:`profile` raises."""
    args = args or build_parser().parse_args(argv)
    devices = [int(c) for c in args.cores.split(",")] if args.cores else None
    best, rows, stored = profile(args.target, args.draft, args.prompts, args.num_prompts, args.max_tokens, args.sweep,
                         args.dtype, devices, margin=args.margin, retune_kernels=args.retune_kernels)
    print(table(rows))
    tmp = Path(f"{args.output}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(best, indent=1))
    os.replace(tmp, args.output)
    cores = (f"target cores {best['target_cores']}, draft cores {best['draft_cores']}" if best["mode"] == "async"
             else f"all cores {best['target_cores']}")
    print(f"\nchosen: {best['mode']}, {cores}, bs={best['bs']} "
          f"w={best['w']} d={best['d'] or 'auto'}: {best['_measured']['tokens_per_s']:.2f} tokens/s -> {args.output}\n"
          f"stored for mode=auto on this machine and model pair: {stored}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
