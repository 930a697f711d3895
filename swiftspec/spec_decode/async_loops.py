"""The ``async`` decoding loops (SwiftSpec, paper §3.1, Algorithm 1): the draft leader
(:func:`run_async_draft`) and the target leader (:func:`run_async_target`) run in separate
processes, exchanging only the subgraph and the verified tokens once per iteration over a
:class:`Channel`; the draft picks its expansions per iteration online (:func:`worth_expanding`).
Shared steps: :mod:`swiftspec.spec_decode.scheduler`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

from swiftspec.model_executor.sampling import Sampler
from swiftspec.spec_decode.draft_state import DraftState
from swiftspec.spec_decode.scheduler import (
    Request,
    StopChecker,
    TargetStats,
    prefill_target,
    verify_step,
)
from swiftspec.spec_decode.target_state import TargetState

STOP = "stop"


class Channel(Protocol):
    """The async loops' link between the target and draft leaders (a ``multiprocessing`` pipe end
    or :class:`swiftspec.pipeline.worker.LockedConn`)."""

    def send(self, obj) -> None:
        """Send a picklable ``obj`` to the other leader."""

    def recv(self):
        """The next object from the other leader (blocks)."""

    def poll(self, timeout: float = 0.0) -> bool:
        """Whether an object is waiting, waiting up to ``timeout`` seconds."""


def run_async_target(target: TargetState, req: Request, to_draft: Channel, emit,
                     stop: StopChecker | None = None) -> TargetStats:
    """Target leader of Algorithm 1: receive subgraph, verify, send verified tokens (or STOP)."""
    sampler, stop, stats = Sampler(req.params), stop or StopChecker(req), TargetStats()
    verified = [prefill_target(target, req, sampler, stop, emit)]
    while not stop.reason:
        to_draft.send((verified, time.perf_counter()))
        t0 = time.perf_counter()
        sg = to_draft.recv()
        stats.wait_s += time.perf_counter() - t0
        verified = verify_step(target, sg, sampler, stop, emit, stats)
    to_draft.send(STOP)
    stats.reason = stop.reason
    return stats


@dataclass
class DraftStats:
    """The draft loop's counters for one request: ``expansions`` (draft forwards growing the tree),
    ``stall_expansions`` (those made after a reroot to refill the tree while the target waited), ``wait_s`` (seconds idle, waiting
    for verified tokens), ``misses`` (verifications whose verified tokens left the tree), ``reused_kv`` (KV entries
    kept across verifications) and ``expansion_s`` (seconds in expansions)."""

    expansions: int = 0
    stall_expansions: int = 0
    wait_s: float = 0.0  # time the draft leader spent idle, waiting for verified tokens
    misses: int = 0
    reused_kv: int = 0
    expansion_s: float = 0.0


def worth_expanding(now: float, arrival: float, exp_s: float, cycle_s: float, tokens_per_iter: float) -> bool:
    """Automatic ``d``: is one more expansion worth delaying the next iteration for?

    An expansion that ends by the predicted ``arrival`` of the verified tokens is free. One that
    ends later delays the next iteration by its overrun ``o`` but adds about one tree level,
    which the target accepts with probability ``a ~= 1 - 1/c`` (``c`` = verified tokens per
    iteration so far). Tokens per second ``c / T`` improve when ``a / c > o / T``. This is the
    paper's "d = r or r + 1" rule (§3.1) decided online from measured times.
    """
    overrun = now + exp_s - max(arrival, now)
    if overrun <= 0:
        return True
    c = max(tokens_per_iter, 1.0)
    return overrun * c < cycle_s * (1.0 - 1.0 / c)


def run_async_draft(draft: DraftState, req: Request, to_target: Channel, max_d: int = 32) -> DraftStats:
    """Draft leader of Algorithm 1.

    Per iteration: expand ``d`` times while the target verifies (``req.d``; None = automatic,
    see :func:`worth_expanding`, from running averages of the target's cycle, the expansion time
    and the verified tokens per iteration), receive the verified tokens, re-root, expand until a
    full subgraph exists (stalls), send the subgraph.
    """
    stats = DraftStats()
    draft.reset_counters()
    draft.prefill(req.prompt_ids)
    msg = to_target.recv()
    if msg == STOP:
        return stats
    draft.start(msg[0][-1])
    draft.fill()  # the first subgraph: the target waits for it whatever we do
    cycle_ema = exp_ema = None
    tokens_ema = 1.0
    while True:
        to_target.send(draft.subgraph())
        t_sent = time.perf_counter()
        n = 0
        while n < (req.d if req.d is not None else max_d) and draft.can_expand():
            if req.d is None:
                if to_target.poll():
                    break
                if cycle_ema is not None and exp_ema is not None and not worth_expanding(
                        time.perf_counter(), t_sent + cycle_ema, exp_ema, cycle_ema, tokens_ema):
                    break
            t0 = time.perf_counter()
            draft.expand()
            dt = time.perf_counter() - t0
            exp_ema = dt if exp_ema is None else 0.8 * exp_ema + 0.2 * dt
            n += 1
        t0 = time.perf_counter()
        msg = to_target.recv()
        stats.wait_s += time.perf_counter() - t0
        if msg == STOP:
            break
        verified, t_verified = msg
        cyc = t_verified - t_sent
        cycle_ema = cyc if cycle_ema is None else 0.8 * cycle_ema + 0.2 * cyc
        tokens_ema = 0.8 * tokens_ema + 0.2 * len(verified)
        draft.reroot(verified)
        stats.stall_expansions += draft.fill()
    stats.expansions = draft.expansions
    stats.misses = draft.misses
    stats.reused_kv = draft.reused_kv
    stats.expansion_s = draft.expansion_s
    return stats
