"""The forward on block weights held on 2 MiB huge pages (as the engine allocates them,
swiftspec/weights/host_memory.py) against the same weights on ordinary 4 KiB pages, interleaved.

Both copies of the model are loaded; for each row count the two forwards (+ LM head, after a
100-token prefill, as bench/native_forward.py times them) alternate call by call, --calls times
each, the order flipping every call, so the machine's drifts (other tenants, memory state) fall on
both alike. Prints min and median per page kind and their ratios; writes JSON (--out) with the
process's ``AnonHugePages`` bytes after each load (the huge pages the kernel actually gave).

    python bench/huge_pages.py --model target --calls 30 --out bench/results/huge-pages-target.json
    python bench/huge_pages.py --model draft --calls 30 --out bench/results/huge-pages-draft.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from native_forward import step_fn  # the forward native_forward.py times (bench/ is this script's path)


def main() -> None:
    from swiftspec import ops
    from swiftspec.benchmark.records import machine_record
    from swiftspec.model_executor.layers.gguf import GGUFWeight
    from swiftspec.model_executor.models.llama import load_model
    from swiftspec.weights import host_memory
    from swiftspec.weights.loader import fetch_default_pair

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["target", "draft"], default="target")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calls", type=int, default=30, help="forwards per page kind and row count")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = fetch_default_pair(progress=False)[0 if args.model == "target" else 1]
    vocab = None if args.model == "target" else 32768  # EngineConfig.draft_vocab
    huge = load_model(path, dtype=torch.float32, max_positions=528, weights="native")
    huge_bytes = host_memory.huge_page_bytes()
    small = load_model(path, dtype=torch.float32, max_positions=528, weights="native")
    for mod in small.modules():  # the same blocks, copied to torch's allocator (4 KiB pages)
        if isinstance(mod, GGUFWeight):
            for p in mod.parts:
                p.data = p.data.clone()
    results = []
    for rows in args.rows:
        fns = {"huge": step_fn(huge, rows, vocab), "4k": step_fn(small, rows, vocab)}
        times: dict[str, list[float]] = {"huge": [], "4k": []}
        for i in range(args.calls):
            for kind in (("huge", "4k") if i % 2 == 0 else ("4k", "huge")):
                t = time.perf_counter()
                fns[kind]()
                times[kind].append(time.perf_counter() - t)
        r = {"rows": rows, **{f"{k}_{stat}_ms": f(v) * 1e3 for k, v in times.items()
                              for stat, f in (("min", min), ("median", statistics.median))}}
        r["speedup_min"] = r["4k_min_ms"] / r["huge_min_ms"]
        r["speedup_median"] = r["4k_median_ms"] / r["huge_median_ms"]
        results.append(r)
        print(f"{args.model} rows {rows}: huge pages min {r['huge_min_ms']:.1f} / median {r['huge_median_ms']:.1f} ms, "
              f"4 KiB pages {r['4k_min_ms']:.1f} / {r['4k_median_ms']:.1f} ms: "
              f"{r['speedup_min']:.3f}x / {r['speedup_median']:.3f}x", flush=True)
    record = {"command": "python bench/huge_pages.py " + " ".join(
                  f"--{k} {' '.join(map(str, v)) if isinstance(v, list) else v}" for k, v in vars(args).items() if v),
              "model": args.model, **machine_record(), "threads": args.threads, "quant_gemm": ops.cpu_dispatch()["quant_gemm"],
              "huge_pages_available": host_memory.huge_pages_available(), "huge_page_bytes_after_load": huge_bytes,
              "results": results}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
