"""End-to-end decoding benchmark: SwiftSpec modes side by side on the paper's prompt sets.

Every system is started once; prompts are interleaved (prompt i runs on every system before
prompt i+1), never concurrently, so all systems see the same machine state. Reports decode
tokens/s (prefill excluded), compression ratio, TTFT, TBT, and whether the greedy output equals
the target-only (autoregressive) output. Ratios against autoregressive are computed per run.

    python bench/e2e.py --datasets humaneval --num-prompts 5 --max-tokens 128
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPTS_DIR = ROOT.parent / "shared" / "data" / "eval-prompts"
DATASETS = ["mt_bench", "humaneval", "gsm8k", "alpaca", "sum", "qa"]
SYSTEMS = ("swiftspec-async", "swiftspec-serial", "autoregressive")


def load_prompts(spec: str, n: int) -> tuple[str, list[str]]:
    """``spec`` is a dataset name of eval-prompts or a path to a JSONL file of the same format."""
    path = Path(spec)
    if not path.exists():
        path = PROMPTS_DIR / f"{spec}.jsonl"
    if not path.exists():
        raise SystemExit(f"no prompt file {spec!r} (looked in {PROMPTS_DIR})")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return path.stem, [r["turns"][0] for r in rows[:n]]


def system_kwargs(system: str, cores: list[int], args) -> dict:
    if system == "swiftspec-async":
        split = max(1, len(cores) // 4) if args.draft_cores is None else args.draft_cores
        return dict(mode="async", target_cores=cores[:-split], draft_cores=cores[-split:], d=args.d)
    if system == "swiftspec-serial":
        return dict(mode="serial", target_cores=cores, d=args.serial_d)
    return dict(mode="autoregressive", target_cores=cores)


def summarize(records: list[dict]) -> list[dict]:
    out = []
    keys = sorted({(r["system"], r["dataset"]) for r in records}, key=lambda k: (SYSTEMS.index(k[0]), k[1]))
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
                    "matches_target": all(r["matches_target"] for r in rs)})
    return out


def markdown(rows: list[dict]) -> str:
    ar = {r["dataset"]: r["tokens_per_s"] for r in rows if r["system"] == "autoregressive"}
    lines = ["| system | dataset | prompts | tokens/s | vs autoregressive | compression | TTFT s | TBT mean ms "
             "| TBT p50 ms | TBT p99 ms | equals target |", "|" + "---|" * 11]
    for r in rows:
        base = ar.get(r["dataset"])
        rel = f"{r['tokens_per_s'] / base:.2f}x" if base else "-"
        lines.append(f"| {r['system']} | {r['dataset']} | {r['prompts']} | {r['tokens_per_s']:.2f} | {rel} | "
                     f"{r['compression_ratio']:.2f} | {r['ttft_s']:.2f} | {1e3 * r['tbt_mean_s']:.0f} | "
                     f"{1e3 * r['tbt_p50_s']:.0f} | {1e3 * r['tbt_p99_s']:.0f} | {r['matches_target']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--datasets", nargs="+", default=DATASETS, help="dataset names or JSONL files")
    ap.add_argument("--num-prompts", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    ap.add_argument("--d", type=int, default=None, help="async expansions per iteration (default automatic)")
    ap.add_argument("--serial-d", type=int, default=None)
    ap.add_argument("--draft-cores", type=int, default=None, help="cores given to the async draft group")
    ap.add_argument("--target", default=None)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--json", action="store_true", help="print the per-prompt records as one JSON list")
    args = ap.parse_args(argv)

    import os

    from tqdm import tqdm

    from swiftspec import Engine, SamplingParams

    cores = sorted(os.sched_getaffinity(0))
    prompts = [(ds, p) for spec in args.datasets for ds, ps in [load_prompts(spec, args.num_prompts)] for p in ps]
    engines = {}
    try:
        for s in args.systems:
            engines[s] = Engine(args.target, args.draft, dtype=args.dtype, **system_kwargs(s, cores, args))
        params = SamplingParams(max_tokens=args.max_tokens)  # greedy
        records = []
        for ds, prompt in tqdm(prompts, desc="prompts", file=sys.stderr):
            outs = {}
            for s, eng in engines.items():
                outs[s] = eng.generate([{"role": "user", "content": prompt}], params)
            ref = outs.get("autoregressive")
            for s, o in outs.items():
                m = o.metrics
                records.append({"system": s, "dataset": ds, "num_tokens": m.num_tokens, "decode_s": m.decode_s,
                                "tokens_per_s": m.tokens_per_s, "compression_ratio": m.compression_ratio,
                                "ttft_s": m.ttft_s, "tbt_mean_s": m.tbt_mean_s, "tbt_p50_s": m.tbt_p50_s,
                                "tbt_p99_s": m.tbt_p99_s,
                                "matches_target": ref is None or o.token_ids == ref.token_ids,
                                "draft_stalls": m.draft.get("stall_expansions"),
                                "target_wait_s": m.target.get("wait_s"), "target_busy_s": m.target.get("busy_s"),
                                "draft_busy_s": m.draft.get("busy_s")})
        dtype = next(iter(engines.values())).dtype
    finally:
        for e in engines.values():
            e.close()
    if args.json:
        print(json.dumps(records))
        return 0
    rows = summarize(records)
    print(f"dtype={dtype} cores={cores} max_tokens={args.max_tokens} prompts/dataset={args.num_prompts} "
          f"({time.strftime('%Y-%m-%d %H:%M')})")
    print(markdown(rows))
    total = {s: sum(r["num_tokens"] - 1 for r in records if r["system"] == s) /
             sum(r["decode_s"] for r in records if r["system"] == s) for s in engines}
    if "autoregressive" in total:
        print("\noverall decode tokens/s: " + ", ".join(
            f"{s} {v:.2f} ({v / total['autoregressive']:.2f}x)" for s, v in total.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
