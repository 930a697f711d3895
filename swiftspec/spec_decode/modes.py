"""Decode modes as objects: one decode loop per group job behind one interface, chosen by name.

A leader worker serves each request with the decode loop of its group's job (``WorkerSpec.kind``):
``autoregressive`` and ``ngram`` (the target alone), ``serial``, ``hybrid`` and ``colocated`` (draft
and target in one group), and the two groups of ``async`` (``target``: verifies; ``draft``: expands its tree
concurrently). Each is a :class:`DecodeMode` subclass registered under its name
(:func:`register_mode`); the engine looks the class up once (:func:`mode_for`) and hands it to the
leader worker in its spec, so a mode registered by user code (a module the worker can import, as
vLLM's ``spec_decode/`` keeps one proposer per file behind one interface) runs through the spawned
workers without any change here. The loops themselves are plain functions of
:mod:`swiftspec.spec_decode.target_loops`, :mod:`~swiftspec.spec_decode.tree_loops`, :mod:`~swiftspec.spec_decode.hybrid` and
:mod:`~swiftspec.spec_decode.async_loops`, on the step functions of :mod:`swiftspec.spec_decode.scheduler`.
"""
from __future__ import annotations

from typing import Callable, ClassVar

from swiftspec.spec_decode import async_loops, hybrid, scheduler, target_loops, tree_loops
from swiftspec.spec_decode.ngram import NgramProposer
from swiftspec.spec_decode.payback import PaybackGate

_REGISTRY: dict[str, type["DecodeMode"]] = {}


class DecodeMode:
    """One group job's decode loop.

    Class attributes:
        name: the mode (``EngineConfig.mode``) or async group job it serves.
        uses_draft: whether the draft model is loaded beside the target in the leader's group
            (False: the engine loads no draft for this mode).
        shape_fields: the EngineConfig fields beyond the tree that shape this mode's proposals
            (what a benchmark record names beside the tree; ``mode="auto"`` sets them from the
            measured step costs).

    Args:
        spec: the leader's :class:`swiftspec.engine.worker.WorkerSpec` (tree shape, n-gram
            parameters, ``draft_payback``, ...).
        target: the group's :class:`~swiftspec.spec_decode.target_state.TargetState`, or None (the
            async draft group).
        draft: the group's :class:`~swiftspec.spec_decode.draft_state.DraftState`, or None.
        peer: the other async group's channel, or None.
    """

    name: ClassVar[str] = ""
    uses_draft: ClassVar[bool] = True
    shape_fields: ClassVar[tuple[str, ...]] = ()

    def __init__(self, spec, target, draft, peer=None):
        self.spec, self.target, self.draft, self.peer = spec, target, draft, peer

    def run(self, req: scheduler.Request, emit: Callable, stop: scheduler.StopChecker):
        """Serve one request: prefill, then decode until ``stop`` says so, calling
        ``emit(tokens, time, logprobs)`` as tokens are verified. Returns the loop's stats
        (:class:`~swiftspec.spec_decode.scheduler.TargetStats` or ``DraftStats``)."""
        raise NotImplementedError

    @classmethod
    def check_config(cls, config) -> None:
        """Refuse an :class:`~swiftspec.engine.config.EngineConfig` this mode cannot serve (raise
        ValueError naming the field); the default accepts every configuration."""

    @classmethod
    def verify_rows(cls, config) -> int:
        """The most rows one target verification of this mode takes under ``config`` (what the
        target's KV cache leaves room for past the context, its CUDA-graph buckets and the row
        counts the CPU kernel self-tuning times). Default: a draft subgraph of ``bs`` rows or a
        proposer's chain of ``ngram_tokens`` and the root, whichever is larger."""
        return max(config.tree_params().bs, config.ngram_params().tokens + 1)


def register_mode(cls: type[DecodeMode]) -> type[DecodeMode]:
    """Register a :class:`DecodeMode` subclass under ``cls.name`` (usable as a decorator); a mode
    then accepts ``EngineConfig(mode=cls.name)``. Registering the same class again is a no-op.

    Raises:
        TypeError: not a DecodeMode subclass.
        ValueError: no name, or the name is taken by another class.
    """
    if not (isinstance(cls, type) and issubclass(cls, DecodeMode)):
        raise TypeError(f"{cls!r} is not a DecodeMode subclass")
    if not cls.name or not isinstance(cls.name, str):
        raise ValueError(f"{cls.__name__} has no mode name (set its class attribute `name`)")
    other = _REGISTRY.get(cls.name)
    if other is not None and (other.__module__, other.__qualname__) != (cls.__module__, cls.__qualname__):
        raise ValueError(f"mode {cls.name!r} is already registered ({other.__module__}.{other.__qualname__})")
    _REGISTRY[cls.name] = cls
    return cls


def mode_for(name: str) -> type[DecodeMode]:
    """The registered decode loop of mode / group job ``name``. Raises ValueError naming the
    registered ones."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"no decode mode {name!r}; registered: {', '.join(sorted(_REGISTRY))}") from None


def registered() -> tuple[str, ...]:
    """The names of every registered mode and group job."""
    return tuple(_REGISTRY)


@register_mode
class Autoregressive(DecodeMode):
    """The target alone, one token per step."""

    name, uses_draft = "autoregressive", False

    @classmethod
    def verify_rows(cls, config) -> int:
        """One row: the root alone."""
        return 1

    def run(self, req, emit, stop):
        """One token per target forward (:func:`~swiftspec.spec_decode.target_loops.run_autoregressive`); returns its ``TargetStats``."""
        return target_loops.run_autoregressive(self.target, req, emit, stop)


class ChainProposerMode(DecodeMode):
    """Base of the target-alone modes that verify a proposer's chain after the root each step
    (:func:`swiftspec.spec_decode.target_loops.run_chain`): a subclass gives :meth:`make_proposer`."""

    uses_draft = False

    def make_proposer(self, ids: list[int]):
        """The proposer over the prompt and the first token ``ids``: ``propose() -> list[int]``,
        ``extend(verified tokens)``."""
        raise NotImplementedError

    def run(self, req, emit, stop):
        """Verify :meth:`make_proposer`'s chain each step (:func:`~swiftspec.spec_decode.target_loops.run_chain`); returns its ``TargetStats``."""
        return target_loops.run_chain(self.target, req, emit, self.make_proposer, stop)


@register_mode
class Ngram(ChainProposerMode):
    """The target alone verifying prompt-lookup proposals (:mod:`swiftspec.spec_decode.ngram`)."""

    name, shape_fields = "ngram", ("ngram_min", "ngram_tokens", "ngram_adaptive")

    @classmethod
    def verify_rows(cls, config) -> int:
        """The root and at most ``ngram_tokens`` proposed tokens."""
        return config.ngram_params().tokens + 1

    def make_proposer(self, ids):
        """A prompt-lookup proposer (:class:`~swiftspec.spec_decode.ngram.NgramProposer`) over ``ids`` with the request's n-gram parameters."""
        return NgramProposer(self.spec.ngram, ids)


@register_mode
class Serial(DecodeMode):
    """Draft and target take turns on the same devices (SwiftSpec-base), optionally behind the
    payback gate (:class:`~swiftspec.spec_decode.payback.PaybackGate`)."""

    name = "serial"

    def __init__(self, spec, target, draft, peer=None):
        super().__init__(spec, target, draft, peer)
        self.gate = PaybackGate() if spec.config.draft_payback else None

    def run(self, req, emit, stop):
        """Draft and target take turns on every device (:func:`~swiftspec.spec_decode.tree_loops.run_serial`;
        the payback gate may run the target alone); returns its ``TargetStats``."""
        return tree_loops.run_serial(self.draft, self.target, req, emit, stop, self.gate)


@register_mode
class Hybrid(DecodeMode):
    """Serial's draft tree and the n-gram proposer's chain in one verification batch
    (:mod:`swiftspec.spec_decode.hybrid`): the chain hangs from the root beside the draft's
    subgraph, at most ``hybrid_rows`` rows in all; optionally behind serial's payback gate
    (:class:`~swiftspec.spec_decode.payback.PaybackGate`), whose fallback is the n-gram chain alone."""

    name, shape_fields = "hybrid", Ngram.shape_fields + ("hybrid_rows",)

    def __init__(self, spec, target, draft, peer=None):
        super().__init__(spec, target, draft, peer)
        self.gate = PaybackGate() if spec.config.draft_payback else None

    def run(self, req, emit, stop):
        """Serial's loop verifying the draft's subgraph and the prompt-lookup chain together
        (:func:`~swiftspec.spec_decode.hybrid.run_hybrid`; the payback gate may run the target
        alone on the n-gram chains); returns its ``TargetStats``."""
        return hybrid.run_hybrid(self.draft, self.target, req, emit, lambda ids: NgramProposer(self.spec.ngram, ids),
                                 self.spec.config.hybrid_rows, stop, self.gate)

    @classmethod
    def verify_rows(cls, config) -> int:
        """The draft subgraph and the chain cut to ``hybrid_rows`` together
        (:func:`~swiftspec.spec_decode.hybrid.hybrid_subgraph`), or the n-gram chain alone where
        the payback gate refuses the draft."""
        tokens = config.ngram_params().tokens
        return max(tokens + 1, min(config.hybrid_rows, config.tree_params().bs + tokens))

    @classmethod
    def check_config(cls, config) -> None:
        """``hybrid_rows`` (the most rows of one verification: root, draft nodes and chain rows)
        must be an integer of at least 2 (the root and one proposal). Raises ValueError."""
        v = config.hybrid_rows
        if isinstance(v, bool) or not isinstance(v, int) or v < 2:
            raise ValueError(f"hybrid_rows must be an integer >= 2 (the root and one proposed row), got {v!r}")


@register_mode
class Colocated(DecodeMode):
    """Draft and target on one GPU, the draft's work on its own stream under the verification."""

    name = "colocated"

    def run(self, req, emit, stop):
        """Draft and target share one GPU on two streams (:func:`~swiftspec.spec_decode.tree_loops.run_colocated`); returns its ``TargetStats``."""
        return tree_loops.run_colocated(self.draft, self.target, req, emit, stop)


@register_mode
class AsyncTarget(DecodeMode):
    """``async``'s target group: verifies the draft group's subgraphs as they arrive."""

    name, uses_draft = "target", False

    def run(self, req, emit, stop):
        """The target leader of the async loop, exchanging subgraphs and verified tokens with the draft group over ``peer`` (:func:`~swiftspec.spec_decode.async_loops.run_async_target`); returns its ``TargetStats``."""
        return async_loops.run_async_target(self.target, req, self.peer, emit, stop)


@register_mode
class AsyncDraft(DecodeMode):
    """``async``'s draft group: keeps expanding its tree while the target verifies."""

    name = "draft"

    def run(self, req, emit, stop):
        """The draft leader of the async loop, growing the tree while the target verifies (:func:`~swiftspec.spec_decode.async_loops.run_async_draft`; verified tokens reach the user through the target, so ``emit`` and ``stop`` are unused); returns its ``DraftStats``."""
        return async_loops.run_async_draft(self.draft, req, self.peer)
