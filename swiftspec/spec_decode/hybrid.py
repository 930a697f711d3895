"""The ``hybrid`` decoding loop: one verification batch fed by two proposers, the draft tree's
subgraph and a chain proposer's tokens (prompt lookup, :mod:`swiftspec.spec_decode.ngram`).

Each iteration runs serial's draft turn (:func:`swiftspec.spec_decode.tree_loops.run_serial`:
``d`` expansions, then fill to a full subgraph), then hangs the chain from the root of the
draft's subgraph (:func:`merge_chain`): where the chain's prefix coincides with subgraph nodes it
walks them, and only its remaining tokens become new rows, each the child of the previous one,
with the position ``root_pos + depth`` and the ancestor mask of any tree node
(:func:`swiftspec.spec_decode.target_state.ancestor_mask`). The rows are bounded by
``max_rows`` (:func:`hybrid_subgraph`): the chain keeps up to ``max_rows - 1`` tokens and the
draft's subgraph takes the largest top-``k`` that fits beside it.

Losslessness: the walk (:func:`swiftspec.spec_decode.verify.walk`) samples the target's own token at each
node and descends only into a child carrying that token, whichever proposer made it. At a node
whose only proposal is one deterministic token ``x`` (an n-gram row, ``q`` = one-hot at ``x``)
this is the standard speculative-sampling rule (Leviathan et al., "Fast Inference from
Transformers via Speculative Decoding", 2023, Algorithm 1 with ``q(x) = 1``): accept ``x`` with
probability ``min(1, p(x)/q(x)) = p(x)``; otherwise sample from the residual
``norm(max(0, p - q))``, which is ``p`` with ``x`` removed and renormalised. Drawing ``t ~ p``
and accepting when ``t == x`` gives the same law: ``P(accept) = p(x)``, and a rejected draw is
``p`` conditioned on ``t != x``, that same residual. With several children (draft and chain
tokens) the draw descends to the child equal to ``t`` or stops with ``t`` as the bonus token, so
every emitted token is distributed as the target's next token given the verified prefix. A chain
token is never a second child with a token already present (it then walks that node instead), so
no path is verified twice.

Draft catch-up: verified tokens the draft tree does not hold (accepted chain rows and the bonus
token) become the tree's ``pending`` tokens on the re-root (:meth:`swiftspec.spec_decode.tree.DraftTree.reroot`),
and the next expansion is a catch-up forward over all of them, ending at the new root.
"""
from __future__ import annotations

import time
from collections.abc import Callable

from swiftspec.model_executor.sampling import Sampler
from swiftspec.spec_decode.draft_state import DraftState
from swiftspec.spec_decode.payback import PaybackGate
from swiftspec.spec_decode.scheduler import Request, StopChecker, TargetStats, prefill_both, verify_step
from swiftspec.spec_decode.target_loops import chain_steps
from swiftspec.spec_decode.target_state import TargetState
from swiftspec.spec_decode.tree import Subgraph
from swiftspec.spec_decode.tree_loops import SERIAL_D, gated_start

# Subgraph weight of a chain row the draft did not propose (no draft probability).
CHAIN_WEIGHT = float("-inf")


def merge_chain(sg: Subgraph, chain: list[int]) -> tuple[Subgraph, list[int]]:
    """Hang ``chain`` (token ids proposed after the root) from ``sg``'s root.

    The chain walks ``sg``'s nodes while its tokens coincide with a child there; from its first
    token that is not a child on, each token is appended as a new row: parent the previous chain
    node, depth one more, weight :data:`CHAIN_WEIGHT`, no candidates. ``sg`` is not modified.

    Args:
        sg: ``bs`` rows, root first, parents first (:class:`~swiftspec.spec_decode.tree.Subgraph`).
        chain: ``[c]`` token ids.
    Returns:
        ``(merged, added)``: the subgraph of ``bs + len(added)`` rows (``sg``'s rows first, in
        their order) and the indices of the rows the chain added (the draft did not send them).
    """
    kids: dict[tuple[int, int], int] = {}
    for i, p in enumerate(sg.parents):
        if p >= 0:
            kids.setdefault((p, sg.tokens[i]), i)
    tokens, parents, depths = list(sg.tokens), list(sg.parents), list(sg.depths)
    weights = list(sg.weights) if sg.weights is not None else None
    cands = [list(c) for c in sg.candidates] if sg.candidates is not None else None
    node, added = 0, []
    for tok in chain:
        child = kids.get((node, tok)) if not added else None
        if child is None:
            child = len(tokens)
            tokens.append(tok)
            parents.append(node)
            depths.append(depths[node] + 1)
            if weights is not None:
                weights.append(CHAIN_WEIGHT)
            if cands is not None:
                cands.append([])
            added.append(child)
        node = child
    return Subgraph(tokens, parents, depths, weights, cands), added


def hybrid_subgraph(subgraph_of: Callable[[int], Subgraph], chain: list[int], bs: int,
                    max_rows: int) -> tuple[Subgraph, list[int]]:
    """The verification batch of one hybrid iteration: the chain cut to ``max_rows - 1`` tokens,
    merged (:func:`merge_chain`) into the largest draft subgraph ``subgraph_of(k)``, ``k <= bs``
    nodes, for which the merged batch has at most ``max_rows`` rows (``k = 1``, the root alone,
    always fits).

    Args:
        subgraph_of: ``k -> `` the draft's top-``k`` subgraph (:meth:`swiftspec.spec_decode.tree.DraftTree.subgraph`).
        chain: token ids proposed after the root.
        bs: the draft subgraph's size when the rows allow it.
        max_rows: the most rows the target verifies (>= 1).
    Returns:
        as :func:`merge_chain`.
    Raises:
        ValueError: ``max_rows`` or ``bs`` below 1.
    """
    if max_rows < 1 or bs < 1:
        raise ValueError(f"hybrid_subgraph: max_rows ({max_rows}) and bs ({bs}) must be positive")
    chain = chain[:max_rows - 1]
    for k in range(min(bs, max_rows), 0, -1):
        merged, added = merge_chain(subgraph_of(k), chain)
        if len(merged) <= max_rows:
            return merged, added
    raise AssertionError("unreachable: the root and a cut chain fit max_rows")


def run_hybrid(draft: DraftState, target: TargetState, req: Request, emit, make_proposer: Callable,
               max_rows: int, stop: StopChecker | None = None, gate: PaybackGate | None = None) -> TargetStats:
    """Serial's loop (``d`` expansions, fill, verify, re-root; ``d`` = ``req.d`` or
    :data:`~swiftspec.spec_decode.tree_loops.SERIAL_D`) verifying the draft's subgraph and the
    proposer's chain together (:func:`hybrid_subgraph`, at most ``max_rows`` rows).

    ``make_proposer(ids)`` builds the chain proposer over the prompt and the first token
    (``propose() -> list[int]``, ``extend(verified tokens)``, as
    :func:`swiftspec.spec_decode.target_loops.run_chain`'s). The chain is cut at the request's budget.
    A replayed acceptance trace records the draft's candidates only: with one, no chain is added
    (the loop is serial's). Returns the ``TargetStats``, with ``chain_rows`` (rows the chain added
    beside the draft's subgraph) and ``chain_accepted`` (those accepted).

    With a ``gate`` (not for replayed requests) the request starts as serial's behind the payback
    gate (:func:`swiftspec.spec_decode.tree_loops.gated_start`); where the draft's prefill would
    not pay back, the draft never runs and the target verifies the proposer's chains alone
    (:func:`swiftspec.spec_decode.target_loops.chain_steps`, ``stats.ran`` = "ngram"): the
    fallback keeps the proposals that cost no draft forward, not only one token a step.
    """
    d = req.d if req.d is not None else SERIAL_D
    sampler, stop, stats = Sampler(req.params), stop or StopChecker(req), TargetStats()
    gated = gate is not None and req.replay is None

    def alone(text):  # the target verifying the proposer's chains, no draft
        chain_steps(target, make_proposer(text), sampler, stop, emit, stats)

    started = (gated_start(draft, target, req, sampler, stop, emit, stats, gate, ("ngram", alone)) if gated
               else prefill_both(draft, target, req, sampler, stop, emit))
    if not started:
        stats.reason = stop.reason
        return stats
    t_spec, n_spec = time.perf_counter(), len(stop.ids)
    proposer = make_proposer(list(req.prompt_ids) + stop.ids)  # the text so far, the root last
    bs = draft.params.bs
    while True:
        for _ in range(d):
            if draft.can_expand():
                draft.expand()
        draft.fill()
        chain = [] if req.replay is not None else proposer.propose()[:max(0, stop.remaining - 1)]
        sg, added = hybrid_subgraph(draft.subgraph, chain, bs, max_rows)
        n_stats = len(stats.trace)
        verified = verify_step(target, sg, sampler, stop, emit, stats)
        stats.chain_rows += len(added)
        stats.chain_accepted += _accepted_rows(stats, sg, verified, set(added))
        if req.trace and len(stats.trace) > n_stats:
            stats.trace[-1]["chain_rows"] = list(added)
        if stop.reason:
            break
        proposer.extend(verified)
        draft.reroot(verified)
    if gated:
        gate.observe_decode(stats.step_s, len(stop.ids) - n_spec, time.perf_counter() - t_spec)
    stats.reason = stop.reason
    return stats


def _accepted_rows(stats: TargetStats, sg: Subgraph, verified: list[int], rows: set[int]) -> int:
    """How many of ``rows`` lie on the accepted path (``verified`` minus its bonus token, walked
    down ``sg`` from the root)."""
    node, n = 0, 0
    for tok in verified[:stats.accepted[-1]]:
        node = next(i for i, p in enumerate(sg.parents) if p == node and sg.tokens[i] == tok)
        n += node in rows
    return n
