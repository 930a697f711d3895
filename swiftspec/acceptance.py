"""Acceptance traces: how a real draft/target pair agrees, recorded once and replayed on any models.

A machine that cannot hold the real checkpoints (an offline GPU machine that takes a few MiB of
files) can still time SwiftSpec end to end with random weights of the real shapes, if each
verification accepts what the real pair would accept. The trace records, for every generated
position of every prompt, the real target's greedy token and its **rank** among the real
draft's candidates at that position: the draft's most likely tokens given the verified prefix
(the target's own tokens before it), 0 = most likely, None = not among the first ``k``.

Ranks are taken teacher-forced (one draft forward over prompt + target tokens), so the trace
does not depend on the tree shape, ``bs``, ``w`` or ``d`` of the run that recorded it; a
candidate of rank r is exactly the r-th child the draft tree gives a node on the verified path
(children are added most likely first, :meth:`swiftspec.tree.DraftTree.add_children`). The
replay (:func:`swiftspec.verify.replayed_token`, driven by ``Engine.generate(replay=...)``)
makes the target pick, at each node, the candidate of the recorded rank, so whatever tree the
timed run builds, a node is accepted exactly when the real pair would have accepted it.

File (JSON): ``{"version": 1, "k": int, "target": str, "draft": str, "dtype": str,
"draft_vocab": int, "draft_quant": str, "machine": {...}, "prompts": [{"dataset": str, "prompt_ids": [int], "tokens": [int],
"ranks": [int | null]}]}``; ``ranks[i]`` belongs to ``tokens[i]`` (``ranks[0]``, the token the
prefill samples, is never replayed). Architecture: docs/architecture.md §11.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch

VERSION = 1
RANKS_K = 32  # candidates ranked per position; wider than any tree's expansion width


class TraceError(ValueError):
    """An acceptance trace file that is missing, not JSON, or not of this format."""


def draft_ranks(runner, prompt_ids: list[int], tokens: list[int], k: int = RANKS_K) -> list[int | None]:
    """Rank of each target token among the draft's ``k`` most likely next tokens, teacher-forced.

    Args:
        runner: the draft's :class:`swiftspec.runner.ModelRunner`, built as the engine builds it
            (same weights, ``draft_quant`` and ``logits_vocab``), KV capacity at least
            ``len(prompt_ids) + len(tokens)``.
        prompt_ids: ``[P]`` prompt token ids.
        tokens: ``[T]`` the target's generated tokens.
        k: candidates per position.
    Returns:
        ``[T]`` ranks (0 = the draft's most likely token; None: not among its first ``k``).
    """
    seq = list(prompt_ids) + list(tokens[:-1])
    n = len(seq)
    pos = torch.arange(n)
    rows = torch.arange(len(prompt_ids) - 1, n)  # row i predicts tokens[i - P + 1]
    _, ids = runner.forward(torch.tensor(seq), pos, pos, torch.ones(n, n, dtype=torch.bool).tril(), rows, k)
    out: list[int | None] = []
    for tok, cands in zip(tokens, ids.tolist()):
        out.append(cands.index(tok) if tok in cands else None)
    return out


def record(prompts: list[tuple[str, list[int], list[int]]], draft_dir, dtype: str, draft_quant: str | None,
           draft_vocab: int | None, k: int = RANKS_K) -> list[dict]:
    """The trace's prompt entries: ``prompts`` = (dataset, prompt ids, the target's tokens) per
    prompt; the draft is loaded here (native weights, as the engine loads it)."""
    from swiftspec.runner import ModelRunner

    longest = max(len(p) + len(t) for _, p, t in prompts)
    runner = ModelRunner(str(draft_dir), dtype=getattr(torch, dtype), capacity=-(-longest // 256) * 256,
                         quant=draft_quant, logits_vocab=draft_vocab)
    with torch.inference_mode():
        return [{"dataset": ds, "prompt_ids": list(p), "tokens": list(t), "ranks": draft_ranks(runner, p, t, k)}
                for ds, p, t in prompts]


def save(path, entries: list[dict], k: int = RANKS_K, **meta) -> None:
    """Write a trace atomically (a temporary file renamed over ``path``); ``meta``: what it was
    recorded with (target, draft, dtype, machine, draft_vocab, ...), kept beside the prompts."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"version": VERSION, "k": k, **meta, "prompts": entries}
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load(path) -> dict:
    """Read and check a trace. Raises :class:`TraceError` naming what is wrong."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError as e:
        raise TraceError(f"no acceptance trace at {path} (record one with `swiftspec bench --record-trace`)") from e
    except (OSError, ValueError) as e:
        raise TraceError(f"{path} is not a readable JSON acceptance trace: {e}") from e
    if not isinstance(doc, dict) or doc.get("version") != VERSION:
        raise TraceError(f"{path}: not an acceptance trace of version {VERSION}")
    prompts = doc.get("prompts")
    if not isinstance(prompts, list) or not prompts:
        raise TraceError(f"{path}: the trace has no prompts")
    for i, p in enumerate(prompts):
        try:
            ok = (len(p["prompt_ids"]) > 0 and len(p["tokens"]) == len(p["ranks"]) > 0
                  and all(isinstance(t, int) for t in p["prompt_ids"] + p["tokens"])
                  and all(r is None or (isinstance(r, int) and r >= 0) for r in p["ranks"]))
        except (KeyError, TypeError):
            ok = False
        if not ok:
            raise TraceError(f"{path}: prompt {i} is malformed (needs prompt_ids, and tokens and ranks of one length)")
    return doc


def summary(doc: dict) -> dict:
    """The acceptance a trace implies for chains: the fraction of positions whose token is the
    draft's first choice, and whose token is among its first 4 candidates (prefill tokens excluded)."""
    ranks = [r for p in doc["prompts"] for r in p["ranks"][1:]]
    top = sum(r == 0 for r in ranks)
    return {"positions": len(ranks), "top1": top / len(ranks) if ranks else float("nan"),
            "top4": sum(r is not None and r < 4 for r in ranks) / len(ranks) if ranks else float("nan")}
