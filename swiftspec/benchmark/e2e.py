"""End-to-end decoding benchmark: SwiftSpec modes and peer decoders side by side.

Systems (``--systems``): ``swiftspec-async`` (SwiftSpec), ``swiftspec-serial`` (SwiftSpec-base),
``autoregressive`` (our target alone), ``hf`` (transformers ``generate``, target alone), ``hf-compile``
(the same with a static cache and the decode step compiled),
``hf-assisted`` (transformers assisted generation with the draft), ``swiftspec-profiled``
(the engine as the ``--config`` written by ``swiftspec profile`` sets it up: mode, cores, tree
shape, ``d``; with several ``--config`` files one system per file, ``swiftspec-profiled[<file
stem>]``, so configurations are compared side by side in one run), ``llama-cpp`` (llama.cpp on
the target's GGUF, when ``llama-cpp-python`` is installed and the target came from a GGUF),
``llama-cpp-spec`` (the same with llama-cpp-python's speculative decoding, the draft's GGUF
proposing chains of 4 tokens) and ``llama-cpp-lookup`` (the same with llama-cpp-python's prompt
lookup decoding, no draft model; its parameters in each record's ``peer``).
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
import os
import sys
import time
from pathlib import Path

from swiftspec.benchmark import replay
from swiftspec.benchmark.records import (
    DATASETS,
    busy_record,
    load_prompts,
    machine_record,
    pipeline_record,
)
from swiftspec.benchmark.report import bar_chart, markdown
from swiftspec.benchmark.systems import (
    SYSTEMS,
    EngineSystem,
    expand_systems,
    reference_system,
    start_system,
)
from swiftspec.benchmark.weight_memory import (
    available_memory_bytes,
    check_memory,
    weight_bytes,
)


def build_parser(ap: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The command line of ``swiftspec bench`` (added to ``ap`` when given, e.g. the CLI's
    subcommand): prompt sets, prompts per set, tokens to generate, systems, dtype, ``d``, the
    ``--config`` files of ``swiftspec-profiled``, the model pair and their GGUFs, the device, the
    output directory, ``--json`` and the replay options (:func:`swiftspec.benchmark.replay.add_arguments`)."""
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


def _resolve_device_dtype(args: argparse.Namespace) -> str:
    """Set ``args.device`` from ``"auto"`` (``"cuda"`` when torch sees a GPU, else ``"cpu"``) and
    return the activation dtype's name: ``args.dtype``, or for ``"auto"`` bfloat16 on CUDA and on
    CPUs with bf16 instructions, float32 elsewhere."""
    import torch

    from swiftspec.engine.mode_selection import cpu_has_bf16

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    return args.dtype if args.dtype != "auto" else (
        "bfloat16" if args.device == "cuda" or cpu_has_bf16() else "float32")


def _prompts_and_pair(args: argparse.Namespace, dtype: str) -> tuple[list[tuple], Path, Path, list[int]]:
    """The run's prompts, model pair and EOS ids.

    Returns ``(prompts, target_dir, draft_dir, eos)``: ``prompts`` as (dataset, prompt token ids,
    tokens to generate, the acceptance to replay or None); with ``--random-weights`` the trace's
    prompts on a random-weights pair (no EOS), else ``--num-prompts`` of each ``--prompts`` spec in
    the target's chat template.

    Raises:
        ModelLoadError: a model cannot be resolved. FileNotFoundError: no such prompt set.
    """
    from swiftspec.weights.loader import resolve_model

    prompts: list[tuple] = []
    if args.random_weights:
        prompts = replay.trace_prompts(args)
        target_dir, draft_dir = replay.random_pair(args, dtype)
        return prompts, target_dir, draft_dir, []
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
    return prompts, target_dir, draft_dir, eos


def _run_systems(args: argparse.Namespace, to_start: list[tuple[str, str | None]], prompts: list[tuple],
                 eos: list[int], target_dir: Path, draft_dir: Path, dtype: str) -> tuple[dict, dict]:
    """Start the systems and run every prompt on them (:func:`_run_prompts`): all resident together,
    or with ``--random-weights`` one at a time, each closed and its memory freed before the next.

    Returns ``(started, outs)``: every system started by record name (closed ones kept for their
    ``shape``) and ``outs[(degrade p, prompt index)][system] = (token ids, metrics)``.

    Raises:
        InsufficientMemoryError: the systems' weights do not fit (checked before any loads).
    """
    cores = sorted(os.sched_getaffinity(0))
    alone = bool(args.random_weights)
    check_memory(weight_bytes([s for s, _ in to_start], target_dir, draft_dir, dtype),
                 available_memory_bytes(args.device), together=not alone, where=args.device)
    degrade = getattr(args, "degrade", [0.0]) if args.random_weights else [0.0]
    started: dict = {}
    outs: dict[tuple[float, int], dict] = {}
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
    return started, outs


def _request_record(s: str, out: tuple, p: float, ds: str, ranks, dtype: str, device: str, started: dict,
                    by_system: dict) -> dict:
    """One request's record: system ``s``'s ``out`` (token ids, metrics) on a ``ds`` prompt at
    degradation ``p`` (``ranks``: the replayed acceptance or None); times in seconds.
    ``matches_target`` compares with :func:`reference_system`'s tokens (None when replayed or no
    reference ran); a SwiftSpec engine's record also has its configuration's shape (``engine``)
    and the kernels its workers ran (``kernels``: the quantized GEMM's variant and why)."""
    toks, m = out
    ref = None if ranks is not None else reference_system(s, started, by_system)  # replayed: not the target's
    return {"system": s if p == 0 else f"{s}[p={p:g}]", "dataset": ds, "dtype": dtype,
            "device": device, "replayed": ranks is not None,
            **({"degrade_p": p} if ranks is not None else {}), "num_tokens": m.num_tokens,
            "decode_s": m.decode_s, "tokens_per_s": m.tokens_per_s,
            "compression_ratio": m.compression_ratio, "ttft_s": m.ttft_s,
            "tbt_mean_s": m.tbt_mean_s, "tbt_p50_s": m.tbt_p50_s, "tbt_p99_s": m.tbt_p99_s,
            "matches_target": None if ref is None else toks == by_system[ref][0],
            "reference": ref, "ran": m.mode,
            "draft_stalls": m.draft.get("stall_expansions"),
            "target_wait_s": m.target.get("wait_s"), **busy_record(m), **pipeline_record(m),
            **({"engine": started[s].shape, "kernels": m.kernels} if isinstance(started.get(s), EngineSystem) else {}),
            **({"peer": started[s].settings} if getattr(started.get(s), "settings", None) else {})}


def run(args: argparse.Namespace) -> list[dict]:
    """Run the benchmark ``args`` (:func:`build_parser`) describes and return one record per
    (system, prompt, degradation) (:func:`_request_record`); with ``--record-trace`` also write the
    autoregressive tokens' acceptance trace.

    Raises:
        ValueError: inconsistent options (:func:`swiftspec.benchmark.replay.check`,
            :func:`expand_systems`). InsufficientMemoryError: the systems do not fit.
    """
    replay.check(args)
    dtype = _resolve_device_dtype(args)
    prompts, target_dir, draft_dir, eos = _prompts_and_pair(args, dtype)
    to_start = expand_systems(args.systems, args.config)
    started, outs = _run_systems(args, to_start, prompts, eos, target_dir, draft_dir, dtype)
    records: list[dict] = []
    targets: list[tuple[str, list[int], list[int]]] = []  # (dataset, prompt, the target's tokens) for the trace
    for (p, i), by_system in sorted(outs.items()):
        ds, ids, _, ranks = prompts[i]
        if args.record_trace and "autoregressive" in by_system:
            targets.append((ds, ids, by_system["autoregressive"][0]))
        for s, out in by_system.items():
            records.append(_request_record(s, out, p, ds, ranks, dtype, args.device, started, by_system))
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


def main(argv=None, args: argparse.Namespace | None = None) -> int:
    """Run the benchmark (:func:`run`) from ``argv`` or parsed ``args``; with ``--json`` print the
    records as one JSON list, else print the markdown tables and write ``e2e.md``, ``e2e.json``
    (records, command and :func:`~swiftspec.benchmark.records.machine_record`) and the chart
    ``e2e.png`` (skipped without matplotlib) to ``--out``. Returns the exit status (0); raises what
    :func:`run` raises."""
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
