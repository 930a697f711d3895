"""Forward time of a model of the real shapes with random weights, on any device, against its memory bandwidth.

The component table of the GPU benchmark, runnable where the checkpoints cannot go: the shapes
come from a ``config.json`` shipped in ``swiftspec/data/model_configs/`` (the default pair's), the weights are
random (a forward's time does not depend on their values), nothing is read from a model hub or
the cache. For each model and row count (1 row: an autoregressive step; ``bs`` rows: a
verification; ``w`` rows: a draft expansion) it times one forward plus the LM head of every row
over a KV cache already holding ``--context`` tokens: eagerly, and on CUDA also as a CUDA-graph
replay (:class:`swiftspec.model_executor.graphs.PaddedStep`, the LM head outside the graph; its mask padded to the
cache's ``--capacity`` slots, as the engine's, and the slots in use passed on the device; with a
capacity beyond the context also a replay without that bound, ``graph_unbounded_s``, the attention
then split over the whole capacity). Each time is set
against the weight bytes one forward reads over the device's read bandwidth, measured in the
same run by a read-only reduction (:func:`swiftspec.benchmark.memory.read_bandwidth`: on CUDA the
best of 10 bf16 ``torch.sum`` passes over 4 GiB; on CPU over 1 GiB fp32 with the forward's thread
count, as bench/native_forward.py); on CUDA the spec sheet's figure and a device-to-device copy's
rate (the limit of older records) are recorded beside it. ``vs_one_row``: a row count's best time
over the model's one-row time (r, the verification's cost in steps). Medians of ``--rounds``
steps, after warm-up.

    python bench/device_forward.py --device cuda --out results.json
    python bench/device_forward.py --device cuda --models qwen2.5-14b-instruct qwen2.5-coder-0.5b-instruct
    python bench/device_forward.py --device cpu --dtype float32 --rows 1 2 \
        --models swiftspec/data/model_configs/qwen2.5-coder-0.5b-instruct.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from swiftspec.benchmark.memory import copy_bandwidth, read_bandwidth, spec_sheet_bandwidth, weight_read_bytes
from swiftspec.weights.random_weights import DEFAULT_CONFIGS, packaged_config

DEFAULT_MODELS = list(DEFAULT_CONFIGS)


def random_model(config: Path, dtype: torch.dtype, device: torch.device, max_positions: int):
    """Our model of ``config``'s shapes with random weights made on ``device`` (the recipe
    :func:`swiftspec.weights.random_weights.materialize` writes, the one ``swiftspec bench --random-weights``
    runs), loaded as the engine loads it."""
    from swiftspec.model_executor.models.llama import load_model
    from swiftspec.weights.random_weights import materialize

    model_dir = materialize(config, str(dtype).removeprefix("torch."))
    return load_model(model_dir, dtype=dtype, max_positions=max_positions, device=device).eval()


def _timed(fn, device: torch.device, rounds: int) -> float:
    """Median seconds of ``fn()`` over ``rounds`` calls after two warm-up calls."""
    times = []
    for i in range(rounds + 2):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= 2:
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def _prefilled_cache(model, device: torch.device, context: int, capacity: int):
    """A KV cache of ``capacity`` slots holding ``context`` random tokens (one causal prefill)."""
    kv = model.make_kv_cache(capacity, device)
    ids = torch.randint(0, min(1000, model.cfg.vocab_size), (context,), device=device)
    pos = torch.arange(context, device=device)
    model(ids, pos, pos, torch.ones(context, context, dtype=torch.bool, device=device).tril(), kv)
    return kv


def _step_inputs(model, device: torch.device, n: int, context: int, capacity: int):
    """``(ids, positions, slots, mask)`` of an ``n``-row step after ``context`` tokens: every row at
    position ``context`` seeing the context and its own slot, the mask ``capacity`` slots wide."""
    ids = torch.randint(0, min(1000, model.cfg.vocab_size), (n,), device=device)
    pos = torch.full((n,), context, device=device)
    slots = torch.arange(context, context + n, device=device)
    mask = torch.zeros(n, capacity, dtype=torch.bool, device=device)
    mask[:, : context + 1] = True
    return ids, pos, slots, mask


def time_model(model, device: torch.device, rows: list[int], context: int, rounds: int, graphs: bool,
               vocab: int | None, capacity: int) -> list[dict]:
    """Eager (and graph-replay) seconds of a forward plus the LM head at each row count, the KV
    cache ``capacity`` slots (at least the context plus the most rows)."""
    from swiftspec.model_executor.graphs import PaddedStep

    with torch.no_grad():
        kv = _prefilled_cache(model, device, context, capacity)
        step = PaddedStep(lambda i, p, s, m, k: model(i, p, s, m, kv, k), rows, capacity, device, use_graphs=graphs)
        unbounded = None
        if graphs and capacity > context + max(rows):
            unbounded = PaddedStep(lambda i, p, s, m, k: model(i, p, s, m, kv), rows, capacity, device)
        out = []
        for n in rows:
            # the step's own inputs are as wide as the slots in use; the steps pad them
            ids, pos, slots, mask = _step_inputs(model, device, n, context, context + n)
            eager = _timed(lambda: model.compute_logits(model(ids, pos, slots, mask, kv), vocab), device, rounds)
            rec = {"rows": n, "eager_s": eager, "capacity": capacity}
            for name, fn in (("graph_s", step if graphs else None), ("graph_unbounded_s", unbounded)):
                if fn is not None:
                    rec[name] = _timed(lambda: model.compute_logits(fn(ids, pos, slots, mask), vocab), device, rounds)
            out.append(rec)
    return out


def kernel_profile(model, device: torch.device, rows: int, context: int, vocab: int | None, top: int = 12) -> list[dict]:
    """Device time per kernel of one eager forward plus LM head at ``rows`` rows (torch.profiler,
    CUDA activity, mean over 5 forwards), heaviest first: ``{"kernel", "us_per_forward", "calls"}``."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        kv = _prefilled_cache(model, device, context, context + rows)
        ids, pos, slots, mask = _step_inputs(model, device, rows, context, context + rows)
        step = lambda: model.compute_logits(model(ids, pos, slots, mask, kv), vocab)  # noqa: E731
        step()
        torch.cuda.synchronize(device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                step()
            torch.cuda.synchronize(device)
    out = [{"kernel": ev.key[:120], "us_per_forward": ev.self_device_time_total / 5, "calls": ev.count // 5}
           for ev in prof.key_averages() if ev.self_device_time_total > 0]
    return sorted(out, key=lambda r: -r["us_per_forward"])[:top]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", type=packaged_config, default=DEFAULT_MODELS,
                    help="config.json files of the shapes, or names of shipped ones (swiftspec/data/model_configs)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    ap.add_argument("--context", type=int, default=512, help="tokens already in the KV cache")
    ap.add_argument("--capacity", type=int, default=None,
                    help="KV-cache slots (the engine's: max_model_len + bs, 4104 by default); "
                         "default the context plus the most rows")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default: all)")
    ap.add_argument("--no-graphs", action="store_true", help="eager only (CPU is always eager)")
    ap.add_argument("--logits-vocab", type=int, nargs="+", default=None,
                    help="LM-head rows per model, in --models order (the draft's restriction); default all")
    ap.add_argument("--profile", type=int, nargs="*", default=[], metavar="ROWS",
                    help="CUDA: also list each model's heaviest kernels at these row counts (torch.profiler)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device")
    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    graphs = device.type == "cuda" and not args.no_graphs
    dtype = getattr(torch, args.dtype)
    capacity = max(args.capacity or 0, args.context + max(args.rows))
    bw = read_bandwidth(device, threads)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    spec = spec_sheet_bandwidth(name)
    copy = copy_bandwidth(device) if device.type == "cuda" else None
    print(f"{device}: read bandwidth {bw / 1e9:.1f} GB/s (read-only torch.sum)"
          + (f", spec sheet {spec / 1e9:.0f} GB/s" if spec else "")
          + (f", d2d copy {copy / 1e9:.1f} GB/s" if copy else ""), flush=True)
    results, profiles = [], []
    for i, config in enumerate(args.models):
        vocab = args.logits_vocab[i] if args.logits_vocab and i < len(args.logits_vocab) else None
        model = random_model(config, dtype, device, capacity + 64)
        nbytes = weight_read_bytes(model, vocab)
        limit = nbytes / bw
        one_row = None
        for rec in time_model(model, device, args.rows, args.context, args.rounds, graphs, vocab, capacity):
            best = min(rec["eager_s"], rec.get("graph_s", float("inf")))
            one_row = best if rec["rows"] == 1 else one_row
            rec.update(model=config.stem, weight_bytes=nbytes, limit_s=limit, of_limit=limit / best,
                       **({"of_spec_sheet": nbytes / spec / best} if spec else {}),
                       **({"vs_one_row": best / one_row} if one_row else {}))
            results.append(rec)
            graph = f"{rec['graph_s'] * 1e3:8.3f} ms graph" if "graph_s" in rec else ""
            if "graph_unbounded_s" in rec:
                graph += f" ({rec['graph_unbounded_s'] * 1e3:.3f} ms unbounded)"
            print(f"{config.stem:32s} rows={rec['rows']:2d} {rec['eager_s'] * 1e3:8.3f} ms eager {graph}  "
                  f"limit {limit * 1e3:.3f} ms: {rec['of_limit']:.0%} of it", flush=True)
        if device.type == "cuda":
            for n in args.profile:
                prof = kernel_profile(model, device, n, args.context, vocab)
                profiles.append({"model": config.stem, "rows": n, "kernels": prof})
                print(f"{config.stem} rows={n}: device time per forward by kernel (us)", flush=True)
                for k in prof:
                    print(f"  {k['us_per_forward']:9.1f}  x{k['calls']:<4d} {k['kernel'][:100]}", flush=True)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    from swiftspec.benchmark.records import machine_record

    record = {"command": "python bench/device_forward.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              **machine_record(cpu_kernels=device.type != "cuda"), "device": str(device),
              "device_name": name, "dtype": args.dtype, "context": args.context, "threads": threads,
              "bandwidth_gb_s": bw / 1e9, "bandwidth_method": "read-only torch.sum (best of 10)",
              "spec_sheet_gb_s": spec / 1e9 if spec else None, "copy_gb_s": copy / 1e9 if copy else None,
              "rows": results, "profiles": profiles}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1) + "\n")
    return record


if __name__ == "__main__":
    main()
