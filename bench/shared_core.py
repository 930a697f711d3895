"""Decode speed of the tests' tiny model pair when the engine's processes share one core.

Layouts, each an :class:`swiftspec.engine.llm_engine.Engine` built once and decoding ``--tokens``
greedy tokens ``--reps`` times (the best and the median of its tokens/s are kept; the layouts
alternate rep by rep so the machine's drifts fall on all alike):

- ``serial-shared``: mode ``serial``, ``target_cores=[0], draft_cores=[0]`` (the tests' layout, and
  the default on a 1-CPU machine);
- ``serial-split``: mode ``serial``, ``target_cores=[0], draft_cores=[1]``;
- ``autoregressive``: the target alone on core 0.

A serial row also gets ``vs_autoregressive_plus_draft`` per rep (:func:`bound_ratio`).

The tiny pair is the tests' (tests/conftest.py ``build_tiny_model``: a 2-layer Qwen2 of hidden
size 64 and its perturbed copy as the draft), built into a temporary directory. Writes a JSON
record (``--out``) with the command, the machine and every rep's tokens/s, compression ratio and
the models' busy seconds and forwards (``RequestMetrics.target`` / ``.draft``).

    python bench/shared_core.py --out bench/results/tiny-shared-core-after-skylake.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

LAYOUTS = {
    "serial-shared": dict(mode="serial", target_cores=[0], draft_cores=[0]),
    "serial-split": dict(mode="serial", target_cores=[0], draft_cores=[1]),
    "autoregressive": dict(mode="autoregressive", target_cores=[0], draft_cores=[]),
}


def bound_ratio(rep: dict, ar: dict) -> float:
    """A serial rep's decode time over "autoregressive plus the draft's cost": the target's
    verifications at the autoregressive layout's median seconds per token, plus the draft's busy
    seconds of that rep (1.0: nothing lost to waiting; the verifications of several rows cost a
    little more than one token's forward, so a little above 1.0 is the floor)."""
    ar_s_per_token = statistics.median(d["decode_s"] / (d["verifications"]) for d in ar["reps_detail"])
    return rep["decode_s"] / (ar_s_per_token * rep["verifications"] + rep["draft"]["busy_s"])


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from conftest import build_tiny_model  # the tests' tiny pair

    from swiftspec.benchmark.e2e import machine_record
    from swiftspec.engine.llm_engine import Engine
    from swiftspec.model_executor.sampling import SamplingParams

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    ap.add_argument("--out")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        target = build_tiny_model(Path(tmp) / "target", "qwen2", seed=0)
        draft = build_tiny_model(Path(tmp) / "draft", "qwen2", seed=1, perturb_from=target, perturb=0.05)
        params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
        engines, rows = {}, {}
        try:
            for name in args.layouts:
                kw = LAYOUTS[name]
                t0 = time.perf_counter()
                engines[name] = Engine(target, draft if kw["mode"] != "autoregressive" else None,
                                       dtype="float32", **kw)
                rows[name] = {"layout": name, **kw, "start_s": time.perf_counter() - t0, "tokens_per_s": [],
                              "workers": [{k: w.get(k) for k in ("kind", "pid")} for w in engines[name].workers]}
            for rep in range(args.reps):
                for name in (args.layouts if rep % 2 == 0 else args.layouts[::-1]):
                    out = engines[name].generate("hello world", params)
                    m = out.metrics
                    rows[name]["tokens_per_s"].append(m.tokens_per_s)
                    rows[name].setdefault("reps_detail", []).append(
                        {"tokens_per_s": m.tokens_per_s, "decode_s": (len(out.token_ids) - 1) / m.tokens_per_s,
                         "compression_ratio": m.compression_ratio, "verifications": m.verifications,
                         "target": m.target, "draft": m.draft})
                    rows[name]["num_tokens"] = len(out.token_ids)
                    print(f"{name:15s} rep {rep}: {out.metrics.tokens_per_s:8.1f} tokens/s", flush=True)
        finally:
            for e in engines.values():
                e.close()
    ar = rows.get("autoregressive")
    for r in rows.values():
        if ar is not None and r["mode"] == "serial" and "reps_detail" in r:
            r["vs_autoregressive_plus_draft"] = [bound_ratio(d, ar) for d in r["reps_detail"]]
        r["best_tokens_per_s"] = max(r["tokens_per_s"])
        r["median_tokens_per_s"] = statistics.median(r["tokens_per_s"])
        print(f"{r['layout']:15s} best {r['best_tokens_per_s']:8.1f}  median {r['median_tokens_per_s']:8.1f} tokens/s",
              *(["vs autoregressive + draft", [round(x, 2) for x in r["vs_autoregressive_plus_draft"]]]
                if "vs_autoregressive_plus_draft" in r else []))
    record = {"command": "python " + " ".join(sys.argv), "machine": machine_record(), "tokens": args.tokens,
              "reps": args.reps, "rows": list(rows.values())}
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
