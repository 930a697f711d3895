"""The decoding loops of the modes, sharing every step function (SwiftSpec paper §3.1,
Algorithm 1; the pipeline modes: :mod:`swiftspec.pipeline.decode`).

- ``async`` (SwiftSpec, Algorithm 1): the draft leader and the target leader run
  :func:`run_async_draft` and :func:`run_async_target` in separate processes, exchanging only
  the subgraph and the verified tokens once per iteration.
- ``colocated`` (Algorithm 1 on one GPU): :func:`run_colocated`, both models in one process,
  the draft expanding on its CUDA stream while the target's verification runs on another.
- ``serial`` (SwiftSpec-base): :func:`run_serial`, draft then verify, in one group.
- ``autoregressive``: :func:`run_autoregressive`, the target alone, one token per forward.
- ``ngram``: :func:`run_ngram`, the target alone verifying prompt-lookup proposals
  (:mod:`swiftspec.spec_decode.ngram`): no draft model.

Each loop reports verified tokens through ``emit(tokens, t, logprobs)`` (``t`` =
time.perf_counter(), comparable across processes on Linux; ``logprobs`` one
:class:`~swiftspec.model_executor.sampling.TokenLogprob` per token when the request asked for them, else
empty) and returns its statistics. They are plain functions of
the draft/target state objects and two message channels, so tests run them in one process.

Architecture: docs/architecture.md §5.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

from swiftspec.model_executor.runner import Launched
from swiftspec.model_executor.sampling import Sampler, SamplingParams
from swiftspec.spec_decode.acceptance import Replay
from swiftspec.spec_decode.draft_state import DraftState
from swiftspec.spec_decode.ngram import NgramParams, NgramProposer
from swiftspec.spec_decode.payback import PaybackGate
from swiftspec.spec_decode.target_state import TargetState
from swiftspec.spec_decode.tree import Subgraph
from swiftspec.spec_decode.verify import VerifyResult

STOP = "stop"
# Expansions per verification in serial mode when the request gives none (d = "auto").
SERIAL_D = 3


class Channel(Protocol):
    """The async loops' link between the target and draft leaders (a ``multiprocessing`` pipe end
    or :class:`swiftspec.pipeline.worker.LockedConn`)."""

    def send(self, obj) -> None:
        """Send a picklable ``obj`` to the other leader."""

    def recv(self):
        """The next object from the other leader (blocks)."""

    def poll(self, timeout: float = 0.0) -> bool:
        """Whether an object is waiting, waiting up to ``timeout`` seconds."""


@dataclass
class Request:
    """What the engine sends to the leaders for one generation.

    Attributes:
        prompt_ids: prompt token ids.
        params: sampling and stopping parameters.
        max_new: token budget after clamping ``max_tokens`` to the context length.
        eos_ids: tokens that end generation (unless ``params.ignore_eos``).
        d: expansions per iteration (int) or None for the automatic choice.
        trace: record per-iteration details (tests).
        replay: benchmarks only: a recorded acceptance (:class:`swiftspec.spec_decode.acceptance.Replay`)
            that every verification walk (:func:`swiftspec.spec_decode.verify.walk`) and the draft's tree
            follow, so the output is not the target's own. Greedy only.
    """

    prompt_ids: list[int]
    params: SamplingParams
    max_new: int
    eos_ids: tuple[int, ...] = ()
    d: int | None = None
    trace: bool = False
    replay: Replay | None = None


class StopChecker:
    """Decides how many newly verified tokens to keep and whether the request is finished.

    EOS and the token budget are checked on ids; stop strings on the decoded text (``decode``
    maps ids to text). The token that completes a stop string is kept; the engine cuts the text.
    ``cancelled()`` is polled once per verification: the engine's client stopped listening.
    """

    def __init__(self, req: Request, decode: Callable[[list[int]], str] | None = None,
                 cancelled: Callable[[], bool] | None = None):
        self.req = req
        self.decode = decode
        self.cancelled = cancelled
        self.ids: list[int] = []
        self.reason: str | None = None
        # characters of the text's end a new stop string can lie in, plus a cut first character's
        # replacement characters (up to 3) and a leading space a decoder drops
        self.need = max((len(s) for s in req.params.stop), default=0) + 4

    def push(self, new: list[int]) -> list[int]:
        """Append ``new`` tokens; return the ones kept. Sets ``reason`` ("stop"/"length") when done."""
        kept = []
        for tok in new:
            self.ids.append(tok)
            kept.append(tok)
            if not self.req.params.ignore_eos and tok in self.req.eos_ids:
                self.reason = "stop"
            elif self.req.params.stop and self.decode is not None and self._hit_stop_string():
                self.reason = "stop"
            elif len(self.ids) >= self.req.max_new:
                self.reason = "length"
            if self.reason:
                break
        if not self.reason and self.cancelled is not None and self.cancelled():
            self.reason = "cancelled"
        return kept

    def _hit_stop_string(self) -> bool:
        """Whether the text ends in a stop string: decodes the last 64 tokens, doubled until the
        text holds more than the longest stop string (tokens that decode to nothing, special
        ones, make it short), so the work per token is O(stop length), not O(generated)."""
        n = 64
        tail = self.decode(self.ids[-n:])
        while len(tail) <= self.need and n < len(self.ids):
            n *= 2
            tail = self.decode(self.ids[-n:])
        return any(s in tail for s in self.req.params.stop)

    @property
    def remaining(self) -> int:
        """Tokens the request may still generate (``max_new`` minus those verified so far)."""
        return self.req.max_new - len(self.ids)


@dataclass
class TargetStats:
    """The target loop's counters for one request: ``verifications`` (target forwards that verified),
    ``accepted`` (accepted nodes per verification), ``wait_s`` (seconds waiting for a subgraph),
    ``reason`` (finish reason: "stop", "length" or "cancelled"), ``trace`` (per-step records when
    debugging), ``ran`` / ``ran_reason`` (a gated serial request that ran the target alone, and why)
    and ``step_s`` (that request's target-alone step, seconds)."""

    verifications: int = 0
    accepted: list[int] = field(default_factory=list)
    wait_s: float = 0.0  # time the target leader spent waiting for a subgraph
    reason: str | None = None  # finish reason: "stop", "length" or "cancelled"
    trace: list[dict] = field(default_factory=list)
    # a serial request that ran the target alone (its draft's prefill would not pay back): "autoregressive"
    ran: str | None = None
    ran_reason: str = ""  # the PaybackGate's reasoning, where one decided
    step_s: float = 0.0  # a gated request's target-alone step after its prefill, seconds


def _verify_step(target: TargetState, sg: Subgraph, sampler: Sampler, stop: StopChecker,
                 emit, stats: TargetStats, launched: Launched | None = None, replayed: bool = True) -> list[int]:
    """Verify ``sg`` (its forward already ``launched`` by :meth:`TargetState.launch`, or now),
    emit the kept tokens; returns the verified tokens. ``replayed``: follow the request's replayed
    acceptance trace, if it has one (False: the subgraph is not the draft tree's)."""
    replay = None
    if replayed and stop.req.replay is not None:
        replay = stop.req.replay.ranks[len(stop.ids):]  # from the root's children on
    res = target.accept(sg, launched or target.launch(sg, sampler), sampler, stop.remaining, replay)
    _emit_verified(res, stop, emit)
    stats.verifications += 1
    stats.accepted.append(len(res.accepted))
    if stop.req.trace:
        stats.trace.append({"subgraph": sg, "accepted": list(res.accepted), "tokens": list(res.tokens)})
    return res.tokens


def _prefill_target(target: TargetState, req: Request, sampler: Sampler, stop: StopChecker, emit) -> int:
    res = target.prefill(req.prompt_ids, sampler)
    _emit_verified(res, stop, emit)
    return res.bonus


def _emit_verified(res: VerifyResult, stop: StopChecker, emit) -> None:
    """Report the verified tokens the stop checker keeps, with their log-probabilities."""
    kept = stop.push(res.tokens)
    emit(kept, time.perf_counter(), res.logprobs[:len(kept)])


def run_autoregressive(target: TargetState, req: Request, emit, stop: StopChecker | None = None) -> TargetStats:
    """Target alone: every forward verifies a one-node subgraph (the root) and emits one token."""
    sampler, stop, stats = Sampler(req.params), stop or StopChecker(req), TargetStats()
    _prefill_target(target, req, sampler, stop, emit)
    while not stop.reason:
        _target_step(target, sampler, stop, emit, stats)
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
    first = _prefill_target(target, req, sampler, stop, emit)
    proposer = make_proposer(req.prompt_ids + [first])
    while not stop.reason:
        chain = [target.root] + proposer.propose()[:max(0, stop.remaining - 1)]
        sg = Subgraph(chain, list(range(-1, len(chain) - 1)), list(range(len(chain))))
        proposer.extend(_verify_step(target, sg, sampler, stop, emit, stats, replayed=False))
    stats.reason = stop.reason
    return stats


def _target_step(target: TargetState, sampler: Sampler, stop: StopChecker, emit, stats: TargetStats) -> list[int]:
    """One target-alone step: verify the one-node subgraph (the root), emit its token."""
    return _verify_step(target, Subgraph([target.root], [-1], [0]), sampler, stop, emit, stats)


def _prefill_both(draft: DraftState, target: TargetState, req: Request, sampler: Sampler, stop: StopChecker,
                  emit) -> bool:
    """Prefill the target, emit its first token, then prefill the draft and root its tree at that
    token; False (the draft never prefilled) when that token already ended the request. The
    target goes first so the first token waits for the target's prefill only, not the draft's too
    (both share the cores here: the draft's prefill moves from the time to first token into the
    decode time, the last token comes no later)."""
    first = _prefill_target(target, req, sampler, stop, emit)
    if stop.reason:
        return False
    draft.prefill(req.prompt_ids)
    draft.start(first)
    return True


def run_serial(draft: DraftState, target: TargetState, req: Request, emit,
               stop: StopChecker | None = None, gate: PaybackGate | None = None) -> TargetStats:
    """SwiftSpec-base: ``d`` expansions, then one verification, then re-root; one device group.

    With a ``gate`` (not for replayed requests) the target takes one step alone after its
    prefill, then the gate decides whether the draft's prefill pays back within the token budget
    (:mod:`swiftspec.spec_decode.payback`); if not, the request goes on as :func:`run_autoregressive`
    (``stats.ran`` = "autoregressive"), else the draft prefills up to that step and speculation
    starts, its speed measured for the gate."""
    d = req.d if req.d is not None else SERIAL_D
    sampler, stop, stats = Sampler(req.params), stop or StopChecker(req), TargetStats()
    gated = gate is not None and req.replay is None
    started = (_gated_start(draft, target, req, sampler, stop, emit, stats, gate) if gated
               else _prefill_both(draft, target, req, sampler, stop, emit))
    if not started:
        stats.reason = stop.reason
        return stats
    t_spec, n_spec = time.perf_counter(), len(stop.ids)
    while True:
        for _ in range(d):
            if draft.can_expand():
                draft.expand()
        draft.fill()
        verified = _verify_step(target, draft.subgraph(), sampler, stop, emit, stats)
        if stop.reason:
            break
        draft.reroot(verified)
    if gated:
        gate.observe_decode(stats.step_s, len(stop.ids) - n_spec, time.perf_counter() - t_spec)
    stats.reason = stop.reason
    return stats


def _gated_start(draft: DraftState, target: TargetState, req: Request, sampler: Sampler, stop: StopChecker,
                 emit, stats: TargetStats, gate: PaybackGate) -> bool:
    """run_serial's start with a gate: the target's prefill and one step alone (timed), the
    gate's call, then either the rest of the request on the target alone (False) or the draft's
    prefill of the prompt and the tokens before the root (True: speculation goes on)."""
    t0 = time.perf_counter()
    res = target.prefill(req.prompt_ids, sampler)
    prefill_s = time.perf_counter() - t0  # the forward alone, as the draft's below
    _emit_verified(res, stop, emit)
    first = res.bonus
    if stop.reason:
        return False
    t1 = time.perf_counter()
    step = _target_step(target, sampler, stop, emit, stats)
    stats.step_s = time.perf_counter() - t1
    if stop.reason:
        return False
    decision = gate.decide(prefill_s, stats.step_s, stop.remaining)
    stats.ran_reason = decision.reason
    if not decision.speculate:
        stats.ran = "autoregressive"
        while not stop.reason:
            _target_step(target, sampler, stop, emit, stats)
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
    replace the pipes of :func:`run_async_target` / :func:`run_async_draft`; the tree logic is
    theirs (SwiftSpec paper §3.1). Where a launch runs to completion before it returns (CPU), no
    expansion overlaps a verification and each iteration verifies what the re-rooted tree fills
    (serial with ``d`` = 0). Lossless either way: every token is the target's own sample."""
    sampler, stop, stats = Sampler(req.params), stop or StopChecker(req), TargetStats()
    if not _prefill_both(draft, target, req, sampler, stop, emit):
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
        verified = _verify_step(target, sg, sampler, stop, emit, stats, launched)
        if stop.reason:
            break
        draft.reroot(verified)
        draft.fill()
    stats.reason = stop.reason
    return stats


def run_async_target(target: TargetState, req: Request, to_draft: Channel, emit,
                     stop: StopChecker | None = None) -> TargetStats:
    """Target leader of Algorithm 1: receive subgraph, verify, send verified tokens (or STOP)."""
    sampler, stop, stats = Sampler(req.params), stop or StopChecker(req), TargetStats()
    verified = [_prefill_target(target, req, sampler, stop, emit)]
    while not stop.reason:
        to_draft.send((verified, time.perf_counter()))
        t0 = time.perf_counter()
        sg = to_draft.recv()
        stats.wait_s += time.perf_counter() - t0
        verified = _verify_step(target, sg, sampler, stop, emit, stats)
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

def text_decoder(tokenizer_file: str | None):
    """ids -> text with the target's tokenizer (for stop strings), or None without one."""
    if not tokenizer_file or not os.path.exists(tokenizer_file):
        return None
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_file)
    return lambda ids: tok.decode(ids, skip_special_tokens=True)
