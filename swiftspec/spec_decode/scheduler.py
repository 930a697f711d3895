"""What every decoding loop shares (SwiftSpec paper §3.1, Algorithm 1): the request the engine
sends (:class:`Request`), its stopping rule (:class:`StopChecker`), the target's counters
(:class:`TargetStats`) and the step functions of the loops (prefill, verify and emit).

The loops, one module per kind: :mod:`swiftspec.spec_decode.target_loops` (``autoregressive``,
``ngram``: the target alone), :mod:`swiftspec.spec_decode.tree_loops` (``serial``, ``colocated``:
both models in one process) and :mod:`swiftspec.spec_decode.async_loops` (``async``: the draft and
target leaders in separate processes); the pipeline modes: :mod:`swiftspec.pipeline.decode`.
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
from typing import Callable

from swiftspec.model_executor.runner import Launched
from swiftspec.model_executor.sampling import Sampler, SamplingParams
from swiftspec.spec_decode.acceptance import Replay
from swiftspec.spec_decode.draft_state import DraftState
from swiftspec.spec_decode.target_state import TargetState
from swiftspec.spec_decode.tree import Subgraph
from swiftspec.spec_decode.verify import VerifyResult


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
    debugging), ``ran`` / ``ran_reason`` (a gated serial request that ran the target alone, and why),
    ``step_s`` (that request's target-alone step, seconds), and ``chain_rows`` / ``chain_accepted``
    (``hybrid``: rows a chain proposer added beside the draft's subgraph, and those accepted)."""

    verifications: int = 0
    accepted: list[int] = field(default_factory=list)
    wait_s: float = 0.0  # time the target leader spent waiting for a subgraph
    reason: str | None = None  # finish reason: "stop", "length" or "cancelled"
    trace: list[dict] = field(default_factory=list)
    # a serial request that ran the target alone (its draft's prefill would not pay back): "autoregressive"
    ran: str | None = None
    ran_reason: str = ""  # the PaybackGate's reasoning, where one decided
    step_s: float = 0.0  # a gated request's target-alone step after its prefill, seconds
    chain_rows: int = 0  # hybrid: verification rows the chain proposer added beside the draft's subgraph
    chain_accepted: int = 0  # ... and those on an accepted path


def verify_step(target: TargetState, sg: Subgraph, sampler: Sampler, stop: StopChecker,
                emit, stats: TargetStats, launched: Launched | None = None, replayed: bool = True) -> list[int]:
    """Verify ``sg`` (its forward already ``launched`` by :meth:`TargetState.launch`, or now),
    emit the kept tokens; returns the verified tokens. ``replayed``: follow the request's replayed
    acceptance trace, if it has one (False: the subgraph is not the draft tree's)."""
    replay = None
    if replayed and stop.req.replay is not None:
        replay = stop.req.replay.ranks[len(stop.ids):]  # from the root's children on
    res = target.accept(sg, launched or target.launch(sg, sampler), sampler, stop.remaining, replay)
    emit_verified(res, stop, emit)
    stats.verifications += 1
    stats.accepted.append(len(res.accepted))
    if stop.req.trace:
        stats.trace.append({"subgraph": sg, "accepted": list(res.accepted), "tokens": list(res.tokens)})
    return res.tokens


def prefill_target(target: TargetState, req: Request, sampler: Sampler, stop: StopChecker, emit) -> int:
    """Prefill the target with the prompt and emit its first token; returns that token."""
    res = target.prefill(req.prompt_ids, sampler)
    emit_verified(res, stop, emit)
    return res.bonus


def emit_verified(res: VerifyResult, stop: StopChecker, emit) -> None:
    """Report the verified tokens the stop checker keeps, with their log-probabilities."""
    kept = stop.push(res.tokens)
    emit(kept, time.perf_counter(), res.logprobs[:len(kept)])


def target_step(target: TargetState, sampler: Sampler, stop: StopChecker, emit, stats: TargetStats) -> list[int]:
    """One target-alone step: verify the one-node subgraph (the root), emit its token."""
    return verify_step(target, Subgraph([target.root], [-1], [0]), sampler, stop, emit, stats)


def prefill_both(draft: DraftState, target: TargetState, req: Request, sampler: Sampler, stop: StopChecker,
                 emit) -> bool:
    """Prefill the target, emit its first token, then prefill the draft and root its tree at that
    token; False (the draft never prefilled) when that token already ended the request. The
    target goes first so the first token waits for the target's prefill only, not the draft's too
    (both share the cores here: the draft's prefill moves from the time to first token into the
    decode time, the last token comes no later)."""
    first = prefill_target(target, req, sampler, stop, emit)
    if stop.reason:
        return False
    draft.prefill(req.prompt_ids)
    draft.start(first)
    return True


def text_decoder(tokenizer_file: str | None):
    """ids -> text with the target's tokenizer (for stop strings), or None without one."""
    if not tokenizer_file or not os.path.exists(tokenizer_file):
        return None
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_file)
    return lambda ids: tok.decode(ids, skip_special_tokens=True)
