"""The decoding loops with both models in one process (SwiftSpec paper §3.1): ``serial``
(SwiftSpec-base, :func:`run_serial`: draft then verify in one group, optionally behind the
payback gate of :mod:`swiftspec.spec_decode.payback`) and ``colocated`` (Algorithm 1 on one GPU,
:func:`run_colocated`: the draft expands on its CUDA stream while the target verifies on
another). Shared steps: :mod:`swiftspec.spec_decode.scheduler`.
"""
from __future__ import annotations

import time
from collections.abc import Callable

from swiftspec.model_executor.sampling import Sampler
from swiftspec.spec_decode.draft_state import DraftState
from swiftspec.spec_decode.payback import PaybackGate
from swiftspec.spec_decode.scheduler import (
    Request,
    StopChecker,
    TargetStats,
    emit_verified,
    prefill_both,
    target_step,
    verify_step,
)
from swiftspec.spec_decode.target_state import TargetState

# Expansions per verification in serial mode when the request gives none (d = "auto").
SERIAL_D = 3


def run_serial(draft: DraftState, target: TargetState, req: Request, emit,
               stop: StopChecker | None = None, gate: PaybackGate | None = None) -> TargetStats:
    """SwiftSpec-base: ``d`` expansions, then one verification, then re-root; one device group.

    With a ``gate`` (not for replayed requests) the target takes one step alone after its
    prefill, then the gate decides whether the draft's prefill pays back within the token budget
    (:mod:`swiftspec.spec_decode.payback`); if not, the request goes on as :func:`~swiftspec.spec_decode.target_loops.run_autoregressive`
    (``stats.ran`` = "autoregressive"), else the draft prefills up to that step and speculation
    starts, its speed measured for the gate."""
    d = req.d if req.d is not None else SERIAL_D
    sampler, stop, stats = Sampler(req.params), stop or StopChecker(req), TargetStats()
    gated = gate is not None and req.replay is None
    started = (gated_start(draft, target, req, sampler, stop, emit, stats, gate) if gated
               else prefill_both(draft, target, req, sampler, stop, emit))
    if not started:
        stats.reason = stop.reason
        return stats
    t_spec, n_spec = time.perf_counter(), len(stop.ids)
    while True:
        for _ in range(d):
            if draft.can_expand():
                draft.expand()
        draft.fill()
        verified = verify_step(target, draft.subgraph(), sampler, stop, emit, stats)
        if stop.reason:
            break
        draft.reroot(verified)
    if gated:
        gate.observe_decode(stats.step_s, len(stop.ids) - n_spec, time.perf_counter() - t_spec)
    stats.reason = stop.reason
    return stats


def gated_start(draft: DraftState, target: TargetState, req: Request, sampler: Sampler, stop: StopChecker,
                emit, stats: TargetStats, gate: PaybackGate, alone: tuple[str, Callable] | None = None) -> bool:
    """A speculative loop's start with a gate: the target's prefill and one step alone (timed),
    the gate's call, then either the rest of the request on the target alone (False) or the
    draft's prefill of the prompt and the tokens before the root (True: speculation goes on).

    ``alone``: ``(mode, finish)``, how the target alone finishes a request the gate turns down:
    ``finish(text)`` (``text``: the prompt and every token so far, the root last) runs it to its
    stop, and ``stats.ran`` says ``mode``; default: one token a step ("autoregressive")."""
    t0 = time.perf_counter()
    res = target.prefill(req.prompt_ids, sampler)
    prefill_s = time.perf_counter() - t0  # the forward alone, as the draft's below
    emit_verified(res, stop, emit)
    first = res.bonus
    if stop.reason:
        return False
    t1 = time.perf_counter()
    step = target_step(target, sampler, stop, emit, stats)
    stats.step_s = time.perf_counter() - t1
    if stop.reason:
        return False
    decision = gate.decide(prefill_s, stats.step_s, stop.remaining)
    stats.ran_reason = decision.reason
    if not decision.speculate:
        stats.ran, finish = alone or ("autoregressive", None)
        if finish is not None:
            finish(req.prompt_ids + [first] + step)
        while not stop.reason:
            target_step(target, sampler, stop, emit, stats)
        return False
    t2 = time.perf_counter()
    draft.prefill(req.prompt_ids + [first] + step[:-1])
    gate.observe_prefill(prefill_s, time.perf_counter() - t2)
    draft.start(step[-1])
    return True


def run_colocated(draft: DraftState, target: TargetState, req: Request, emit,
                  stop: StopChecker | None = None) -> TargetStats:
    """Algorithm 1 in one process holding both models (one GPU): each verification is launched
    on the target's stream and the draft keeps expanding its tree on its own stream until the
    verification's event completes (at most ``req.d`` expansions when set), then the verified
    tokens re-root the tree, which fills to a full subgraph for the next verification. Events
    replace the pipes of :func:`~swiftspec.spec_decode.async_loops.run_async_target` / :func:`~swiftspec.spec_decode.async_loops.run_async_draft`; the tree logic is
    theirs (SwiftSpec paper §3.1). Where a launch runs to completion before it returns (CPU), no
    expansion overlaps a verification and each iteration verifies what the re-rooted tree fills
    (serial with ``d`` = 0). Lossless either way: every token is the target's own sample."""
    sampler, stop, stats = Sampler(req.params), stop or StopChecker(req), TargetStats()
    if not prefill_both(draft, target, req, sampler, stop, emit):
        stats.reason = stop.reason
        return stats
    draft.fill()
    while True:
        sg = draft.subgraph()
        launched = target.launch(sg, sampler)
        n = 0
        while (req.d is None or n < req.d) and draft.can_expand() and not launched.done():
            draft.expand()
            n += 1
        verified = verify_step(target, sg, sampler, stop, emit, stats, launched)
        if stop.reason:
            break
        draft.reroot(verified)
        draft.fill()
    stats.reason = stop.reason
    return stats
