"""Which decode mode is fastest on this machine, from measured step costs and acceptance priors.

The expected decode speed of a mode is its expected tokens per target verification over the
expected seconds of one iteration (the speculative-decoding speed-up model of Leviathan et al.
and of the SwiftSpec paper's serial baseline): an iteration is the draft's forwards (none for
the target-alone modes) plus one target verification of the proposed rows, and yields the
accepted proposals plus the target's own next token. Step costs are measured on the user's
machine (:class:`swiftspec.model_executor.step_costs.StepCosts`: seconds of a target forward at
1-4 rows, of a draft forward at 1-4 rows); the tokens per verification are the priors of
:func:`priors`, replayed from the acceptance trace the package ships (the default pair's greedy
tokens on the evaluation prompts and the draft's rank of each, :mod:`swiftspec.spec_decode.acceptance`).

Candidates: ``autoregressive``, ``ngram`` proposing 1-3 tokens or adaptive ones (as many as the
suffix that matched, at most 2 or 3: :attr:`~swiftspec.spec_decode.ngram.NgramParams.adaptive`), ``serial`` with the draft trees
of :data:`SERIAL_TREES`: shapes whose subgraph is fixed (a chain of the draft's first choices, or
the root's two best children), so the trace's ranks give their acceptance exactly, and ``hybrid``
with the shapes of :data:`HYBRID_SHAPES`: a chain of the draft's first choices and the n-gram
chain hung from the same root (:func:`hybrid_tokens_per_step`). Left out: the draft's prefill per
request (the payback gate of :mod:`swiftspec.spec_decode.payback` decides it per request) and
``async`` (a layout question: one memory bus per group).
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path

from swiftspec.spec_decode.ngram import NgramParams, NgramProposer

# the acceptance trace the package ships (swiftspec bench --record-trace on the default pair)
PACKAGED_TRACE = Path(__file__).resolve().parents[1] / "data" / "traces" / "default-pair.json"
# serial trees weighed: (label, EngineConfig tree fields, children kept per depth along the
# target's path: a node of draft rank r at depth j is verified iff r < widths[j])
SERIAL_TREES = (
    ("bs 2 d 1", {"bs": 2, "d": 1}, (1,)),
    ("bs 3 d 1 w 2", {"bs": 3, "d": 1, "w": 2, "topk": 2}, (2,)),
    ("bs 3 d 2 chain", {"bs": 3, "d": 2, "w": 1, "topk": 1}, (1, 1)),
    ("bs 4 d 3 chain", {"bs": 4, "d": 3, "w": 1, "topk": 1}, (1, 1, 1)),
)
NGRAM_TOKENS = (1, 2, 3)
# adaptive n-gram shapes weighed (NgramParams.adaptive: a proposal as long as the suffix that
# matched, at most this many tokens, from one-token matches on): at most 4 rows, as above
NGRAM_ADAPTIVE_TOKENS = (2, 3)
# hybrid shapes weighed: (draft chain depth d, n-gram tokens k), at most 1 + d + k = HYBRID_ROWS
# rows (the measured target costs reach 4 rows), so the row budget never cuts either chain
HYBRID_SHAPES = ((1, 1), (1, 2), (2, 1))
HYBRID_ROWS = 4
# the pick is the simplest candidate (the earliest in the list, which runs from the target alone
# through n-gram and the draft trees to hybrid; of the target-alone ones only the fastest) expected
# within this fraction of the fastest one: the estimate leaves out the draft's host time per
# iteration and its attention and norms, which grow with its forwards, and its timings vary by a
# few percent between starts (the kernel self-tuning asks the same of a kernel,
# swiftspec.ops.tuning.MARGIN)
MARGIN = 0.05


@dataclass(frozen=True)
class Candidate:
    """One mode and shape with its acceptance prior.

    Attributes:
        mode: "autoregressive", "ngram", "serial" or "hybrid".
        label: how reasons name it ("serial bs 2 d 1").
        fields: the EngineConfig fields it sets (tree shape, ``ngram_tokens``, ``hybrid_rows``).
        tokens_per_step: expected tokens per target verification (>= 1).
        rows_mix: target rows per verification -> fraction of verifications with that many
            (ngram verifies the root alone where the text offers no proposal; hybrid's varies
            with the n-gram proposal and the rows it shares with the draft chain).
        draft_forwards: draft forwards per verification: the first a catch-up over the verified
            tokens the draft has not run (the bonus token, and accepted proposals it never
            expanded), the others one row each.
        catch_up_mix: rows of that first draft forward -> fraction of verifications (empty for
            the target-alone modes).
    """

    mode: str
    label: str
    fields: dict
    tokens_per_step: float
    rows_mix: dict[int, float]
    draft_forwards: int = 0
    catch_up_mix: dict[int, float] = field(default_factory=dict)


def _mix(counts: dict[int, int], steps: int) -> dict[int, float]:
    return {r: n / steps for r, n in sorted(counts.items())}


def _tree_walk(ranks: list[list[int | None]], widths: tuple[int, ...]) -> list[tuple[int, int]]:
    """``(step, accepted)`` per verification of :func:`tree_tokens_per_step`'s replay: tokens it
    yields and proposals among them. Raises ValueError as :func:`tree_tokens_per_step` does."""
    if not widths:
        raise ValueError("a tree needs at least one depth")
    walk = []
    for seq in ranks:
        i = 0
        while i + 1 < len(seq):
            j = 0
            while j < len(widths) and i + 1 + j < len(seq) and seq[i + 1 + j] is not None and seq[i + 1 + j] < widths[j]:
                j += 1
            step = min(j + 1, len(seq) - 1 - i)
            walk.append((step, j))
            i += step
    if not walk:
        raise ValueError("no positions to decode in the recorded ranks")
    return walk


def catch_up_rows(step: int, accepted: int, depth: int) -> int:
    """Rows of the draft's first forward after a verification that yielded ``step`` tokens, of
    which ``accepted`` followed the draft's chain, with a draft chain ``depth`` deep: the verified
    tokens it has not run, i.e. all but the accepted ones it expanded (the first ``depth - 1``;
    the deepest proposal is never run through the draft), ending at the new root
    (:meth:`swiftspec.spec_decode.tree.DraftTree.reroot`); at least the root."""
    return max(1, step - min(accepted, depth - 1))


def tree_tokens_per_step(ranks: list[list[int | None]], widths: tuple[int, ...]) -> float:
    """Expected tokens per verification of a draft tree keeping ``widths[j]`` children per node at
    depth ``j + 1`` (a chain: all 1), replayed greedily over recorded rank sequences (``ranks[p][i]``:
    the draft's rank of the target's token ``i`` of prompt ``p``, None past the ranks kept; index 0
    is the prefill's token, the first root). Each verification accepts the longest run of tokens
    whose ranks fit the widths, then the target's own token; the next root is that token.
    Raises ValueError without positions to decode or with an empty ``widths``."""
    walk = _tree_walk(ranks, widths)
    return sum(step for step, _ in walk) / len(walk)


def tree_catch_up_mix(ranks: list[list[int | None]], widths: tuple[int, ...]) -> dict[int, float]:
    """Rows of the draft's first forward per verification (:func:`catch_up_rows`) -> fraction of
    verifications, over :func:`tree_tokens_per_step`'s replay (the draft expands ``len(widths)``
    times a verification). Raises ValueError as :func:`tree_tokens_per_step` does."""
    counts: dict[int, int] = {}
    walk = _tree_walk(ranks, widths)
    for step, accepted in walk:
        r = catch_up_rows(step, accepted, len(widths))
        counts[r] = counts.get(r, 0) + 1
    return _mix(counts, len(walk))


def ngram_tokens_per_step(texts: list[tuple[list[int], list[int]]], params: NgramParams) -> tuple[float, dict[int, float]]:
    """Expected tokens per verification of prompt-lookup proposals (:class:`NgramProposer`) and the
    fraction of verifications per target rows (1 + tokens proposed), replayed greedily over
    ``(prompt_ids, tokens)`` pairs (``tokens[0]``: the prefill's). Raises ValueError without
    positions to decode."""
    steps = tokens = 0
    rows: dict[int, int] = {}
    for prompt, out in texts:
        proposer, i = NgramProposer(params, list(prompt) + out[:1]), 0
        while i + 1 < len(out):
            prop = proposer.propose()
            j = 0
            while j < len(prop) and i + 1 + j < len(out) and prop[j] == out[i + 1 + j]:
                j += 1
            step = min(j + 1, len(out) - 1 - i)
            proposer.extend(out[i + 1:i + 1 + step])
            rows[1 + len(prop)] = rows.get(1 + len(prop), 0) + 1
            steps, tokens, i = steps + 1, tokens + step, i + step
    if not steps:
        raise ValueError("no positions to decode in the recorded tokens")
    return tokens / steps, _mix(rows, steps)


def hybrid_tokens_per_step(prompts: list[tuple[list[int], list[int], list[int | None]]], depth: int,
                           params: NgramParams) -> tuple[float, dict[int, float], dict[int, float]]:
    """Expected tokens per verification of ``hybrid`` with a draft chain of its first choices
    ``depth`` deep and prompt-lookup proposals (``params.tokens`` at most) hung from the same root
    (:func:`swiftspec.spec_decode.hybrid.merge_chain`), the fraction of verifications per target
    rows, and per rows of the draft's catch-up forward (:func:`catch_up_rows`: the accepted
    n-gram tokens past the draft chain's run are new to the draft), replayed greedily over
    ``(prompt_ids, tokens, ranks)`` triples (``tokens[0]``: the prefill's; ``ranks[i]``: the
    draft's rank of ``tokens[i]``, None past the ranks kept).

    Exact for the tokens: the walk descends while the target's token is a child, so a verification
    accepts the longer of the draft chain's run of rank-0 tokens (up to ``depth``) and the n-gram
    chain's run of matching tokens, then the target's own token. The rows are an upper bound: the
    two chains share a row where their tokens coincide, which the trace shows only where both are
    the target's token (a wrong draft token is not recorded), so ``1 + depth + proposed - shared``.
    Raises ValueError without positions to decode or with ``depth`` below 1."""
    if depth < 1:
        raise ValueError(f"a hybrid draft chain needs depth >= 1, got {depth}")
    steps = tokens = 0
    rows: dict[int, int] = {}
    catch_up: dict[int, int] = {}
    for prompt, out, ranks in prompts:
        proposer, i = NgramProposer(params, list(prompt) + out[:1]), 0
        while i + 1 < len(out):
            prop = proposer.propose()
            a = b = 0  # runs of the draft chain and the n-gram chain along the target's tokens
            while a < depth and i + 1 + a < len(out) and ranks[i + 1 + a] == 0:
                a += 1
            while b < len(prop) and i + 1 + b < len(out) and prop[b] == out[i + 1 + b]:
                b += 1
            step = min(max(a, b) + 1, len(out) - 1 - i)
            proposer.extend(out[i + 1:i + 1 + step])
            r = 1 + depth + len(prop) - min(a, b)
            rows[r] = rows.get(r, 0) + 1
            c = catch_up_rows(step, a, depth)
            catch_up[c] = catch_up.get(c, 0) + 1
            steps, tokens, i = steps + 1, tokens + step, i + step
    if not steps:
        raise ValueError("no positions to decode in the recorded tokens")
    return tokens / steps, _mix(rows, steps), _mix(catch_up, steps)


def priors_of(doc: dict, ngram: NgramParams = NgramParams()) -> list[Candidate]:
    """The candidates with their priors from an acceptance trace ``doc``
    (:func:`swiftspec.spec_decode.acceptance.load`): autoregressive (1 token a 1-row step), ngram
    with ``ngram``'s lookup lengths proposing each of :data:`NGRAM_TOKENS` tokens, adaptive ngram
    (from one-token matches, as many tokens as matched, at most each of
    :data:`NGRAM_ADAPTIVE_TOKENS`), and serial with
    each tree of :data:`SERIAL_TREES` (``d`` one-row draft forwards a verification), and hybrid with
    each shape of :data:`HYBRID_SHAPES` (``d`` draft forwards a verification, the first a catch-up
    over the verified tokens the draft has not run, :attr:`Candidate.catch_up_mix`)."""
    ranks = [p["ranks"] for p in doc["prompts"]]
    texts = [(p["prompt_ids"], p["tokens"]) for p in doc["prompts"]]
    out = [Candidate("autoregressive", "autoregressive", {}, 1.0, {1: 1.0})]
    for k in NGRAM_TOKENS:
        tps, mix = ngram_tokens_per_step(texts, NgramParams(ngram.min_n, ngram.max_n, k))
        out.append(Candidate("ngram", f"ngram {k}", {"ngram_tokens": k}, tps, mix))
    for k in NGRAM_ADAPTIVE_TOKENS:
        tps, mix = ngram_tokens_per_step(texts, NgramParams(1, ngram.max_n, k, adaptive=True))
        out.append(Candidate("ngram", f"ngram adaptive {k}", {"ngram_min": 1, "ngram_tokens": k,
                                                               "ngram_adaptive": True}, tps, mix))
    for label, fields, widths in SERIAL_TREES:
        out.append(Candidate("serial", f"serial {label}", dict(fields), tree_tokens_per_step(ranks, widths),
                             {fields["bs"]: 1.0}, fields["d"], tree_catch_up_mix(ranks, widths)))
    triples = [(p["prompt_ids"], p["tokens"], p["ranks"]) for p in doc["prompts"]]
    for d, k in HYBRID_SHAPES:
        tps, mix, catch_up = hybrid_tokens_per_step(triples, d, NgramParams(ngram.min_n, ngram.max_n, k))
        fields = {"bs": d + 1, "d": d, "w": 1, "topk": 1, "ngram_tokens": k, "hybrid_rows": HYBRID_ROWS}
        out.append(Candidate("hybrid", f"hybrid d {d} ngram {k}", fields, tps, mix, d, catch_up))
    return out


@functools.lru_cache(maxsize=4)
def priors(path: str = str(PACKAGED_TRACE), ngram: NgramParams = NgramParams()) -> tuple[Candidate, ...]:
    """:func:`priors_of` the trace at ``path`` (default: the packaged one), read once per process.
    Raises :class:`swiftspec.spec_decode.acceptance.TraceError` for a missing or malformed trace."""
    from swiftspec.spec_decode.acceptance import load

    return tuple(priors_of(load(path), ngram))


def iteration_seconds(c: Candidate, target_s: dict[int, float], draft_s: dict[int, float] | float) -> float:
    """Expected seconds of one iteration of ``c``: its target verification (``target_s``: rows ->
    seconds of a target forward, weighted by ``c.rows_mix``) plus its draft forwards (``draft_s``:
    rows -> seconds of a draft forward; the catch-up weighted by ``c.catch_up_mix``, the others
    one row; a number: one row's cost for any rows). Raises ValueError where ``target_s`` or
    ``draft_s`` lacks a row count ``c`` runs."""
    draft = draft_s if isinstance(draft_s, dict) else {r: draft_s for r in set(c.catch_up_mix) | {1}}
    catch_up = c.catch_up_mix or ({1: 1.0} if c.draft_forwards else {})
    for who, need, have in (("verifies", c.rows_mix, target_s), ("catches the draft up on", catch_up, draft)):
        missing = sorted(set(need) - set(have))
        if missing:
            raise ValueError(f"{c.label} {who} {missing} rows, but only {sorted(have)} were measured")
    seconds = sum(f * target_s[r] for r, f in c.rows_mix.items())
    if c.draft_forwards:
        seconds += sum(f * draft[r] for r, f in catch_up.items()) + (c.draft_forwards - 1) * draft[1]
    return seconds


def tokens_per_s(c: Candidate, target_s: dict[int, float], draft_s: dict[int, float] | float) -> float:
    """Expected decode tokens/s of ``c``: tokens per verification over :func:`iteration_seconds`."""
    return c.tokens_per_step / iteration_seconds(c, target_s, draft_s)


def best(candidates: tuple[Candidate, ...] | list[Candidate], target_s: dict[int, float],
         draft_s: dict[int, float] | float, margin: float = MARGIN) -> tuple[Candidate, dict[str, float]]:
    """The pick among ``candidates`` and every candidate's label -> expected tokens/s. Among the
    target-alone ones (no draft forward: autoregressive, ngram) the fastest: what sets them apart,
    the target's rows, is measured whole. Then the simplest candidate (the list runs from the
    simplest mode to the deepest tree) whose expected tokens/s are within ``margin`` (a fraction)
    of the fastest candidate's, so a draft mode is picked only when it beats the target alone, and
    a deeper tree every simpler one, by more than the margin. Raises ValueError for no candidates,
    or a step cost that is not a positive number of seconds."""
    if not candidates:
        raise ValueError("no candidate modes")
    drafts = list(draft_s.values()) if isinstance(draft_s, dict) else [draft_s]
    if not all(v > 0 for v in list(target_s.values()) + drafts):
        raise ValueError(f"step costs must be positive seconds, got target {target_s}, draft {draft_s}")
    rates = {c.label: tokens_per_s(c, target_s, draft_s) for c in candidates}
    alone = [c for c in candidates if not c.draft_forwards]
    lead = max(alone, key=lambda c: rates[c.label]) if alone else None
    walk = [c for c in candidates if c.draft_forwards or c is lead]
    fastest = max(rates[c.label] for c in walk)
    return next(c for c in walk if rates[c.label] * (1 + margin) >= fastest), rates


def measured_reason(top: Candidate, rates: dict[str, float], target_s: dict[int, float],
                    draft_s: dict[int, float], variant: str, chooser: str = "auto", samples: int = 1) -> str:
    """The reason ``mode="auto"`` (``chooser``; a configured mode's shape: e.g. "hybrid as
    configured, its shape") reports for a measured choice: the step costs (ms; the mean of
    ``samples`` measurements), each candidate's expected tokens/s and the pick (:func:`best`)."""
    def costs(times: dict[int, float]) -> str:
        rows = sorted(times)
        return f"{'/'.join(map(str, rows))} rows {'/'.join(f'{times[r] * 1e3:.1f}' for r in rows)} ms"

    rated = ", ".join(f"{label} {v:.1f}" for label, v in rates.items())
    fastest = max(rates, key=rates.get)
    pick = (f"{top.label} fastest" if fastest == top.label else
            f"{top.label} picked, the fastest of the target alone, within {MARGIN:.0%} of the fastest ({fastest})"
            if not top.draft_forwards else
            f"{top.label} picked, the simplest within {MARGIN:.0%} of the fastest ({fastest})")
    mean = f"; mean of {samples} measurements" if samples > 1 else ""
    return (f"{chooser}, measured here: target {costs(target_s)}, draft {costs(draft_s)} (linear layers, {variant}{mean}); "
            f"expected tokens/s with the packaged acceptance trace's priors: {rated}: {pick} "
            f"({top.tokens_per_step:.2f} tokens a verification)")
