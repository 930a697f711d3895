"""Where a ``hybrid`` iteration's time goes on the default pair, in one process (as a hybrid
worker: the target and the draft on this process's cores), beside ``serial`` and ``ngram`` on the
same prompt: draft expansions, re-roots and KV moves, subgraph selection, each timed around its
call; the rest of the wall time is the target's verifications (forward, walk, KV compaction).

Usage: ``python bench/hybrid_phases.py [--modes hybrid,serial,ngram] [--prompts mt_bench gsm8k]
[--max-tokens 64]`` (the default pair fetched; the engine's defaults for every mode's shape).
Prints one block per prompt and mode. Noisy machines: compare shares within a run.
"""
from __future__ import annotations

import argparse
import collections
import json
import time

import torch
from transformers import AutoTokenizer

from swiftspec.benchmark.records import load_prompts
from swiftspec.engine.config import EngineConfig
from swiftspec.model_executor.kernel_tuning import tune_kernels
from swiftspec.model_executor.runner import ModelRunner, RunnerHandle
from swiftspec.model_executor.sampling import SamplingParams
from swiftspec.spec_decode import hybrid, target_loops, tree_loops
from swiftspec.spec_decode.draft_state import DraftState
from swiftspec.spec_decode.ngram import NgramProposer
from swiftspec.spec_decode.scheduler import Request
from swiftspec.spec_decode.target_state import TargetState
from swiftspec.weights.default_pair import default_model_dir


def _timed(obj, name: str, acc: dict) -> None:
    """Wrap ``obj.name`` so each call adds (1, seconds) to ``acc[name]``."""
    f = getattr(obj, name)

    def wrapper(*a, **k):
        t0 = time.perf_counter()
        r = f(*a, **k)
        acc[name][0] += 1
        acc[name][1] += time.perf_counter() - t0
        return r
    setattr(obj, name, wrapper)


def run(mode: str, cfg: EngineConfig, target: TargetState, draft_runner: ModelRunner, prompt: list[int], n: int):
    """One request in ``mode``; prints its verifications, wall time and the timed phases."""
    acc = collections.defaultdict(lambda: [0, 0.0])
    draft = DraftState(RunnerHandle("draft", draft_runner, []), cfg.tree_params())
    for name in ("expand", "fill", "reroot", "subgraph"):
        _timed(draft, name, acc)
    out: list[int] = []
    req = Request(prompt, SamplingParams(max_tokens=n, ignore_eos=True), n, (), None, False)
    emit = lambda toks, t, lps=(): out.extend(toks)  # noqa: E731
    ng = cfg.ngram_params()
    t0 = time.perf_counter()
    if mode == "hybrid":
        st = hybrid.run_hybrid(draft, target, req, emit, lambda ids: NgramProposer(ng, ids), cfg.hybrid_rows)
    elif mode == "serial":
        st = tree_loops.run_serial(draft, target, req, emit)
    else:
        st = target_loops.run_ngram(target, req, emit, ng)
    wall = time.perf_counter() - t0
    timed = sum(s for _, s in acc.values())
    print(f"== {mode}: {len(out)} tokens, {st.verifications} verifications, {wall:.2f} s, "
          f"{wall / max(st.verifications, 1) * 1e3:.0f} ms a verification, draft misses {draft.misses}")
    for k, (c, s) in sorted(acc.items()):
        print(f"   draft.{k:10s} n={c:4d} {s:7.2f} s ({s / wall:5.1%}), {s / c * 1e3:7.1f} ms each")
    print(f"   target (the rest)       {wall - timed:7.2f} s ({(wall - timed) / wall:5.1%}), "
          f"{(wall - timed) / max(st.verifications, 1) * 1e3:7.1f} ms a verification")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default="hybrid,serial,ngram")
    ap.add_argument("--prompts", nargs="+", default=["mt_bench", "gsm8k"])
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    tdir, ddir = str(default_model_dir("target")), str(default_model_dir("draft"))
    cfg = EngineConfig(mode="hybrid")
    tok = AutoTokenizer.from_pretrained(tdir)
    vocab = min(json.loads((default_model_dir(r) / "config.json").read_text())["vocab_size"] for r in ("target", "draft"))
    dv = cfg.draft_logits_vocab(vocab)
    tune_kernels([(tdir, None), (ddir, dv)], [1, cfg.hybrid_rows])
    target = TargetState(RunnerHandle("target", ModelRunner(tdir, capacity=4096 + 16), []))
    draft_runner = ModelRunner(ddir, capacity=4096 + cfg.max_cached + cfg.w, quant=cfg.draft_quant_method, logits_vocab=dv)
    for ds in args.prompts:
        _, texts = load_prompts(ds, 1)
        text = tok.apply_chat_template([{"role": "user", "content": texts[0]}], add_generation_prompt=True, tokenize=False)
        ids = tok.encode(text, add_special_tokens=False)
        print(f"### {ds}: prompt {len(ids)} tokens, threads {torch.get_num_threads()}")
        for m in args.modes.split(","):
            run(m, cfg, target, draft_runner, ids, args.max_tokens)


if __name__ == "__main__":
    main()
