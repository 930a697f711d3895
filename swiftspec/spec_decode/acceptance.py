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
(children are added most likely first, :meth:`swiftspec.spec_decode.tree.DraftTree.add_children`). The
replay (:func:`swiftspec.spec_decode.verify.replayed_token`, driven by ``Engine.generate(replay=...)``)
makes the target pick, at each node, the candidate of the recorded rank, so whatever tree the
timed run builds, a node is accepted exactly when the real pair would have accepted it.

File (JSON): ``{"version": 1, "k": int, "target": str, "draft": str, "dtype": str,
"draft_vocab": int, "draft_quant": str, "machine": {...}, "profile": [float], "prompts":
[{"dataset": str, "prompt_ids": [int], "tokens": [int], "ranks": [int | null], "logprobs":
[[float]]}]}``; ``ranks[i]`` and ``logprobs[i]`` belong to ``tokens[i]`` (``ranks[0]``, the
token the prefill samples, is never replayed); ``profile``: the mean log-probability per rank. Architecture: docs/architecture.md §11.
"""
from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, replace
from pathlib import Path

from swiftspec.weights.model_cache import atomic_write_text

VERSION = 1
RANKS_K = 32  # candidates ranked per position; wider than any tree's expansion width
LOGPROBS_K = 8  # the draft's log-probabilities kept per position (the paper's widest expansion)


@dataclass(frozen=True)
class Replay:
    """One prompt's recorded acceptance, as a request replays it (``Engine.generate(replay=...)``).

    Attributes:
        ranks: per generated position, the rank of the recorded target's token among the recorded
            draft's candidates (None: absent); drives the target's walk
            (:func:`swiftspec.spec_decode.verify.replayed_token`).
        logprobs: per generated position, the recorded draft's ``LOGPROBS_K`` highest
            log-probabilities there (teacher-forced), or None.
        profile: the mean log-probability of each rank over the whole trace, or None.

    With ``logprobs`` and ``profile``, the draft also grows its tree as the recorded draft would
    (:meth:`child_logprobs`): a random draft's near-uniform probabilities would otherwise build
    a wide, shallow tree where the real draft builds deep chains, and accept less.
    """

    ranks: tuple[int | None, ...]
    logprobs: tuple[tuple[float, ...], ...] | None = None
    profile: tuple[float, ...] | None = None

    @property
    def shapes_tree(self) -> bool:
        """Whether the draft grows its tree with the recorded log-probabilities (:meth:`child_logprobs`)."""
        return self.logprobs is not None and self.profile is not None

    def rank(self, i: int) -> int | None:
        """The recorded rank at generated position ``i`` (None: absent, or past the recorded tokens)."""
        return self.ranks[i] if i < len(self.ranks) else None

    def child_logprobs(self, root_index: int, path: list[int], k: int) -> list[float] | None:
        """The log-probabilities a tree node's ``k`` children get instead of the running draft's.

        Args:
            root_index: generated-token index of the tree's root (0: the prefill's token).
            path: sibling ranks of the edges from the root down to the node (``[]``: the root).
            k: children per node (the expansion's top-k).
        Returns:
            ``[k]`` floats, heaviest first: the recorded draft's at the node's position if the node
            lies on the recorded target's path (every edge of ``path`` is the recorded rank), else
            the trace's mean per rank; -inf past what was kept. None without recorded values.
        """
        if not self.shapes_tree:
            return None
        on_path = all(r == self.rank(root_index + 1 + j) for j, r in enumerate(path))
        i = root_index + len(path) + 1  # index of the children's tokens
        row = self.logprobs[i] if on_path and i < len(self.logprobs) else self.profile
        return (list(row) + [-math.inf] * k)[:k]

    def degraded(self, p: float, seed: int) -> "Replay":
        """This replay as a pair that agrees less: each recorded rank after the prefill's moves one
        down (rank r -> r + 1, past ``RANKS_K - 1``: absent) with probability ``p``, independently,
        from ``random.Random(seed)``; log-probabilities (the tree's shape) unchanged. ``p`` 0 gives
        ``self``. The GPU benchmarks' stand-in for a larger target that agrees less with the draft
        than the recorded pair. Raises ValueError for ``p`` outside [0, 1]."""
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"the degradation probability must be in [0, 1], got {p}")
        if p == 0.0:
            return self
        rng = random.Random(seed)
        ranks = list(self.ranks[:1])
        for r in self.ranks[1:]:
            moved = rng.random() < p  # drawn for every position, so the draws do not depend on the ranks
            ranks.append(r if r is None or not moved else (r + 1 if r + 1 < RANKS_K else None))
        return replace(self, ranks=tuple(ranks))

    @classmethod
    def of(cls, doc: dict, entry: dict, n: int | None = None) -> "Replay":
        """The replay of one prompt ``entry`` of a trace ``doc`` (:func:`load`), first ``n`` tokens."""
        lps = entry.get("logprobs")
        prof = doc.get("profile")
        return cls(tuple(entry["ranks"][:n]), None if lps is None else tuple(map(tuple, lps[:n])),
                   None if prof is None else tuple(prof))


class TraceError(ValueError):
    """An acceptance trace file that is missing, not JSON, or not of this format."""


def profile(entries: list[dict]) -> list[float]:
    """The mean recorded log-probability of each rank (``[LOGPROBS_K]``) over every position."""
    rows = [row for e in entries for row in e["logprobs"]]
    return [round(sum(r[j] for r in rows) / len(rows), 4) for j in range(len(rows[0]))]


def save(path, entries: list[dict], k: int = RANKS_K, **meta) -> None:
    """Write a trace atomically (:func:`swiftspec.weights.model_cache.atomic_write_text`); ``meta``: what it was
    recorded with (target, draft, dtype, machine, draft_vocab, ...), kept beside the prompts."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"version": VERSION, "k": k, **meta, "prompts": entries}
    if all("logprobs" in e for e in entries):
        doc["profile"] = profile(entries)
    atomic_write_text(path, json.dumps(doc))


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
                  and all(r is None or (isinstance(r, int) and r >= 0) for r in p["ranks"])
                  and ("logprobs" not in p or (len(p["logprobs"]) == len(p["tokens"]) and "profile" in doc)))
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
