"""How long an engine takes to start and to close on the default pair, per worker start method
(``SWIFTSPEC_WORKER_START_METHOD``: ``spawn`` or ``forkserver``), side by side.

Each round runs every method in a fresh interpreter (the order alternates between rounds), so the
first engine of a method pays what a new process pays (the fork server's own start included); the
later cases show what each further engine of the same process costs. Per case: ``start_s`` (the
``Engine`` constructor: processes, model loads, kernel choice), ``first_token_s`` (one greedy
request of 8 tokens) and ``close_s`` (``Engine.close``), wall seconds; ``same_tokens``: every case
of every run gave the same greedy tokens. Writes one record and prints the median of each.

    python bench/engine_start.py --rounds 3 --out bench/results/engine-start-<cpu>-<date>.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

# (name, mode, engine keyword arguments): one worker, two worker groups, a 3-stage pipeline
CASES = (("autoregressive", "autoregressive", {}), ("async", "async", {}),
         ("pipedec-3", "pipedec", {"pipeline_stages": 3}), ("autoregressive again", "autoregressive", {}))
METHODS = ("spawn", "forkserver")


def one(method: str) -> dict:
    """Every case in this interpreter with workers started by ``method``: {case: timings}."""
    os.environ["SWIFTSPEC_WORKER_START_METHOD"] = method
    from swiftspec import Engine, SamplingParams
    from swiftspec.weights.loader import fetch_default_pair

    target, draft = fetch_default_pair(progress=False)
    out = {}
    for name, mode, kw in CASES:
        t0 = time.perf_counter()
        eng = Engine(target, None if mode == "autoregressive" else draft, mode=mode, **kw)
        t1 = time.perf_counter()
        ids = eng.generate("def quicksort(xs):", SamplingParams(max_tokens=8)).token_ids
        t2 = time.perf_counter()
        eng.close()
        t3 = time.perf_counter()
        out[name] = {"start_s": round(t1 - t0, 3), "first_token_s": round(t2 - t1, 3), "close_s": round(t3 - t2, 3),
                     "tokens": ids}
    return out


def table(record: dict) -> str:
    """The markdown of one record (bench/tables.py): per case, the median start, first request
    and close of each method, and the change."""
    med, cases = record["median"], list(record["median"][METHODS[0]])
    lines = ["| case | " + " | ".join(f"{m}: start / 8 tokens / close, s" for m in METHODS) + " | start + close |",
             "|---|" + "---|" * (len(METHODS) + 1)]
    for c in cases:
        cells = [" / ".join(f"{med[m][c][k]:.2f}" for k in ("start_s", "first_token_s", "close_s")) for m in METHODS]
        total = [med[m][c]["start_s"] + med[m][c]["close_s"] for m in METHODS]
        lines.append(f"| {c} | " + " | ".join(cells) + f" | {total[0]:.2f} -> {total[1]:.2f} s |")
    rounds = len(record["runs"]) // len(METHODS)
    return "\n".join(lines + ["", f"median of {rounds} rounds; the same greedy tokens in every case and run: "
                               f"{'yes' if record['same_tokens'] else 'no'}"])


def main(argv: list[str] | None = None) -> int:
    """Run the rounds (or, with ``--one``, one method's cases, a JSON line on stdout); returns the
    exit status."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--one", choices=METHODS, help=argparse.SUPPRESS)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(one(args.one)))
        return 0
    from swiftspec.benchmark.records import machine_record

    runs = []
    for r in range(args.rounds):
        for method in METHODS if r % 2 == 0 else METHODS[::-1]:
            line = subprocess.run([sys.executable, __file__, "--one", method], check=True, capture_output=True,
                                  text=True).stdout.strip().splitlines()[-1]
            runs.append({"round": r, "method": method, "cases": json.loads(line)})
            print(f"round {r} {method}: " + ", ".join(f"{c} {v['start_s']:.2f}+{v['close_s']:.2f} s"
                                                      for c, v in runs[-1]["cases"].items()), file=sys.stderr)
    summary = {m: {c: {k: statistics.median(run["cases"][c][k] for run in runs if run["method"] == m)
                       for k in ("start_s", "first_token_s", "close_s")} for c, _, _ in CASES} for m in METHODS}
    tokens = {json.dumps(run["cases"][c]["tokens"]) for run in runs for c, _, _ in CASES}
    rec = {"kind": "engine_start", "command": "python bench/engine_start.py " + " ".join(argv or sys.argv[1:]),
           "machine": machine_record(), "same_tokens": len(tokens) == 1, "median": summary, "runs": runs}
    text = json.dumps(rec, indent=1) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    for m in METHODS:
        print(m, json.dumps(summary[m]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
