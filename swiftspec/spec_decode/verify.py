"""The target's verification walk (SwiftSpec paper §3.1, Algorithm 1, target loop).

Starting at the root, the target samples its own next token from its logits at the current node.
If that token is a child of the node in the subgraph, the child is accepted and the walk goes on
from it; the first sample that is not a child is the *bonus token*. Since every emitted token is
the target's own sample given the verified prefix, the output is exactly the target's.

Architecture: docs/architecture.md §3.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from swiftspec.model_executor.sampling import SampleHead, Sampler, TokenLogprob


@dataclass
class VerifyResult:
    """Outcome of one verification.

    Attributes:
        accepted: subgraph indices of the accepted nodes, in path order (root excluded).
        tokens: the verified tokens: the accepted nodes' tokens followed by the bonus token.
        logprobs: one :class:`~swiftspec.model_executor.sampling.TokenLogprob` per verified token when the
            request asked for them (``SamplingParams.logprobs``), else empty.
    """

    accepted: list[int]
    tokens: list[int]
    logprobs: list[TokenLogprob] = field(default_factory=list)

    @property
    def bonus(self) -> int:
        """The bonus token: the target's own token after the accepted path (the last verified token)."""
        return self.tokens[-1]


def target_head(sampler: Sampler, depths: list[int]) -> str | SampleHead | None:
    """What the target's forward returns per row for this request, whose rows sit ``depths``
    below the root: without log-probabilities only token ids leave the device, each row's
    argmax ("argmax", greedy) or its sample with the uniform of the row's position
    (:class:`~swiftspec.model_executor.sampling.SampleHead`); with log-probabilities None (the full logits)."""
    if sampler.params.logprobs is not None:
        return None
    return "argmax" if sampler.params.greedy else sampler.head(depths)


def replayed_token(candidates: list[int], rank: int | None, own: int) -> int:
    """The token a replayed acceptance trace (:mod:`swiftspec.spec_decode.acceptance`) makes the target pick
    at a node: the draft's candidate of the recorded ``rank`` (``candidates``: the node's children
    in the draft tree, most likely first); where the trace says "absent" (None) or the tree holds
    no candidate of that rank, a token that is none of them: the target's ``own`` choice if it is
    not a candidate, else the smallest id that is not."""
    if rank is not None and rank < len(candidates):
        return candidates[rank]
    if own not in candidates:
        return own
    taken = set(candidates)
    return next(t for t in range(len(candidates) + 1) if t not in taken)


def walk(tokens: list[int], parents: list[int], logits: torch.Tensor, sampler: Sampler,
         max_new: int | None = None, replay: list[int | None] | None = None,
         candidates: list[list[int]] | None = None) -> VerifyResult:
    """Walk the subgraph with the target's samples.

    Args:
        tokens: ``[bs]`` subgraph token ids, root first, parents before children.
        parents: ``[bs]`` parent index of each node (-1 for the root).
        logits: ``[bs, vocab]`` float32 target logits; row i predicts the token after node i.
            Or, for a request without log-probabilities, ``[bs]`` int64: each row's token,
            chosen where the target ran (:meth:`swiftspec.model_executor.runner.ModelRunner.forward` with
            :func:`target_head`: the argmax, or the sample with the uniform of the row's
            position, so the walk emits what sampling here would have).
        sampler: the request's sampler.
        max_new: stop after this many verified tokens (the request's remaining budget).
        replay: benchmarks only: the recorded rank of the real target's token among the real
            draft's candidates for each position from the root's children on (None: absent), from
            an acceptance trace (:mod:`swiftspec.spec_decode.acceptance`); each sample is replaced by
            :func:`replayed_token`, so acceptance follows the recorded pair whatever the models'
            weights (the output is then not the target's). Needs argmax rows.
        candidates: with ``replay``: ``[bs]`` lists, each node's children in the draft tree, most
            likely first (:meth:`swiftspec.spec_decode.tree.DraftTree.subgraph`), which may include nodes
            outside the subgraph; None: the node's children in the subgraph, in index order
            (which is the draft's order).
    Returns:
        :class:`VerifyResult` with ``1 <= len(tokens) <= bs`` verified tokens (and their
        log-probabilities when ``sampler.params.logprobs`` is set).
    """
    children: list[dict[int, int]] = [{} for _ in tokens]
    for i, p in enumerate(parents):
        if p >= 0:
            children[p].setdefault(tokens[i], i)
    limit = max_new if max_new is not None else len(tokens)
    node, accepted, out, lps = 0, [], [], []
    want_lp = sampler.params.logprobs is not None
    rows = logits.tolist() if logits.dim() == 1 else None
    if rows is not None and want_lp:
        raise ValueError("walk: token rows only serve a request without log-probabilities")
    if replay is not None and (rows is None or not sampler.params.greedy):
        raise ValueError("walk: a replayed acceptance trace needs argmax rows (a greedy request)")
    while True:
        if rows is not None:
            tok = rows[node]
            sampler.position += 1  # as sample() counts the tokens it draws
        else:
            tok = sampler.sample(logits[node])
        if replay is not None:
            depth = len(out)
            tok = replayed_token(candidates[node] if candidates is not None else list(children[node]),
                                 replay[depth] if depth < len(replay) else None, tok)
        out.append(tok)
        if want_lp:
            lps.append(sampler.logprob(logits[node], tok))
        child = children[node].get(tok)
        if child is None or len(out) >= limit:
            return VerifyResult(accepted, out, lps)
        accepted.append(child)
        node = child
