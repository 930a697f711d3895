"""The decoding loops of the target alone: ``autoregressive`` (:func:`run_autoregressive`, one
token per forward) and ``ngram`` (:func:`run_ngram`, prompt-lookup proposals of
:mod:`swiftspec.spec_decode.ngram` verified as a chain: no draft model), both on
:func:`run_chain`'s step. Shared steps: :mod:`swiftspec.spec_decode.scheduler`.
"""
from __future__ import annotations

from collections.abc import Callable

from swiftspec.model_executor.sampling import Sampler
from swiftspec.spec_decode.ngram import NgramParams, NgramProposer
from swiftspec.spec_decode.scheduler import (
    Request,
    StopChecker,
    TargetStats,
    prefill_target,
    target_step,
    verify_step,
)
from swiftspec.spec_decode.target_state import TargetState
from swiftspec.spec_decode.tree import Subgraph


def run_autoregressive(target: TargetState, req: Request, emit, stop: StopChecker | None = None) -> TargetStats:
    """Target alone: every forward verifies a one-node subgraph (the root) and emits one token."""
    sampler, stop, stats = Sampler(req.params), stop or StopChecker(req), TargetStats()
    prefill_target(target, req, sampler, stop, emit)
    while not stop.reason:
        target_step(target, sampler, stop, emit, stats)
    stats.reason = stop.reason
    return stats


def run_ngram(target: TargetState, req: Request, emit, params: NgramParams,
              stop: StopChecker | None = None) -> TargetStats:
    """:func:`run_chain` with the n-gram proposal (:class:`swiftspec.spec_decode.ngram.NgramProposer`
    over the prompt and the verified tokens)."""
    return run_chain(target, req, emit, lambda ids: NgramProposer(params, ids), stop)


def run_chain(target: TargetState, req: Request, emit, make_proposer: Callable,
              stop: StopChecker | None = None) -> TargetStats:
    """The target alone, each forward verifying the root and the chain a proposer offers after it;
    a step without a proposal verifies the root alone (a one-token step, as
    :func:`run_autoregressive`). Lossless as every mode: the walk keeps the target's own tokens.
    A replayed acceptance trace does not apply (no draft tree) and is ignored.

    ``make_proposer(ids)`` builds the proposer over the prompt and the first token (``ids``, a
    list of int): its ``propose()`` returns the token ids it guesses come next (any number; the
    chain is cut at the request's budget), ``extend(tokens)`` takes each step's verified tokens.
    """
    sampler, stop, stats = Sampler(req.params), stop or StopChecker(req), TargetStats()
    first = prefill_target(target, req, sampler, stop, emit)
    chain_steps(target, make_proposer(req.prompt_ids + [first]), sampler, stop, emit, stats)
    stats.reason = stop.reason
    return stats


def chain_steps(target: TargetState, proposer, sampler: Sampler, stop: StopChecker, emit,
                stats: TargetStats) -> None:
    """:func:`run_chain`'s steps from the target's current root to the request's stop:
    ``proposer`` (built over the text so far, the root last) proposes, the target verifies the
    root and the chain, the proposer takes the verified tokens."""
    while not stop.reason:
        chain = [target.root] + proposer.propose()[:max(0, stop.remaining - 1)]
        sg = Subgraph(chain, list(range(-1, len(chain) - 1)), list(range(len(chain))))
        proposer.extend(verify_step(target, sg, sampler, stop, emit, stats, replayed=False))
