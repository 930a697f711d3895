"""The CPU engine's decode speed on the default pair, for a before/after comparison of two source
trees: run it once per tree (``PYTHONPATH=<tree>``), alternating, and collect the lines.

Greedy, 128 tokens, the first prompt of two packaged datasets, ``autoregressive`` and ``serial``
(bs 2, d 1), the kernel the tree picks itself (set ``SWIFTSPEC_KERNEL_TUNING=0`` for the rule's, so
two trees run the same kernel). Prints one JSON line: decode tokens/s per prompt and mode
(``RequestMetrics.tokens_per_s``), the token counts, and a hash of the generated ids (equal
outputs give equal hashes). ``--merge`` joins such lines into one record for bench/tables.py.

    PYTHONPATH=<tree> python bench/engine_speed.py --label before --prompts-root <tree> >> lines.jsonl
    python bench/engine_speed.py --merge lines.jsonl --before e8ab153 --after HEAD --out record.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys

DATASETS = ("humaneval", "gsm8k")
MODES = (("autoregressive", {}), ("serial", {"bs": 2, "d": 1}))


def measure(label: str, prompts_root: str) -> dict:
    """One tree's line: its ``Engine`` on the default pair, each mode on each prompt."""
    from swiftspec import Engine, SamplingParams
    try:
        from swiftspec.weights.loader import fetch_default_pair
    except ImportError:  # the flat layout before the packages
        from swiftspec.loader import fetch_default_pair

    target, draft = fetch_default_pair(progress=False)
    prompts = [json.loads(open(os.path.join(prompts_root, "swiftspec/data/eval_prompts", f"{ds}.jsonl"))
                          .read().splitlines()[0])["turns"][0] for ds in DATASETS]
    res: dict = {"tree": label}
    for mode, tree in MODES:
        with Engine(target, None if mode == "autoregressive" else draft, mode=mode, **tree) as eng:
            outs = [eng.generate([{"role": "user", "content": p}], SamplingParams(max_tokens=128)) for p in prompts]
        res[mode] = [round(o.metrics.tokens_per_s, 3) for o in outs]
        res[mode + "_tokens"] = [len(o.token_ids) for o in outs]
        res[mode + "_ids_hash"] = hash(tuple(t for o in outs for t in o.token_ids)) & 0xffffffff
    return res


def main(argv: list[str] | None = None) -> int:
    """Measure this tree (one JSON line on stdout), or with ``--merge`` join such lines into a
    record; returns the exit status."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", default="tree")
    ap.add_argument("--prompts-root", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ap.add_argument("--merge", metavar="LINES")
    ap.add_argument("--before", default="before")
    ap.add_argument("--after", default="after")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if args.merge:
        runs = [json.loads(line) for line in open(args.merge) if line.startswith("{")]
        rec = {"kind": "engine_speed_before_after", "before": args.before, "after": args.after, "runs": runs}
        text = json.dumps(rec, indent=1) + "\n"
        (open(args.out, "w").write(text) if args.out else sys.stdout.write(text))
        return 0
    print(json.dumps(measure(args.label, args.prompts_root)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
