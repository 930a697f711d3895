"""What the engine hands back and raises: a request's output and stream chunks, the engine's errors,
and the engine-side record of a request in flight.

The engine: :mod:`swiftspec.engine.llm_engine`. Architecture: docs/architecture.md §1.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from swiftspec.engine.detokenize import IncrementalText
from swiftspec.engine.metrics import RequestMetrics
from swiftspec.model_executor.sampling import TokenLogprob


class EngineError(RuntimeError):
    """The engine cannot serve (closed, or misconfigured)."""


class WorkerError(EngineError):
    """A worker process raised or died; the engine has been shut down."""


class RequestError(RuntimeError):
    """One request raised in a worker (``"Type: message"``); the workers live on and serve the next."""


class TokenizerMismatchError(ValueError):
    """The draft and target models do not share a tokenizer."""


@dataclass
class GenerationOutput:
    """Result of :meth:`swiftspec.engine.llm_engine.Engine.generate`.

    Attributes:
        text: generated text (special tokens removed, cut before any stop string).
        token_ids: generated token ids (EOS included when it ended the request).
        finish_reason: "stop" (EOS or stop string), "length" (max_tokens or context) or "timeout"
            (``SamplingParams.timeout_s`` passed).
        metrics: timings, compression ratio and histograms (:class:`RequestMetrics`).
        logprobs: one :class:`~swiftspec.model_executor.sampling.TokenLogprob` per token of ``token_ids`` when
            ``SamplingParams.logprobs`` was set, else None.
    """

    text: str
    token_ids: list[int]
    finish_reason: str | None
    metrics: RequestMetrics
    logprobs: list[TokenLogprob] | None = None

    def to_dict(self) -> dict:
        """The output as a JSON-able dict (what ``swiftspec generate --json`` prints): text, token
        ids, finish reason, mode, compression ratio, tokens/s, TTFT and time between tokens in
        seconds, the full metrics, and the log-probabilities (natural log) where they were asked for."""
        m = self.metrics
        return {"text": self.text, "token_ids": self.token_ids, "num_tokens": len(self.token_ids),
                "finish_reason": self.finish_reason, "mode": m.mode, "compression_ratio": m.compression_ratio,
                "tokens_per_s": m.tokens_per_s, "ttft_s": m.ttft_s, "tbt_mean_s": m.tbt_mean_s,
                "tbt_p50_s": m.tbt_p50_s, "tbt_p99_s": m.tbt_p99_s, "metrics": m.to_dict(),
                **({} if self.logprobs is None else {"logprobs": [
                    {"token_id": x.token_id, "logprob": x.logprob, "top": [list(t) for t in x.top]}
                    for x in self.logprobs]})}


@dataclass
class StreamChunk:
    """One piece of a streamed generation: ``text`` is the new text since the previous chunk,
    ``token_ids`` (and ``logprobs``, when asked for) the tokens verified since then (a token whose
    text is held back, e.g. a possible start of a stop string, comes with a later chunk); the last
    chunk has ``finished=True`` and carries the whole :class:`GenerationOutput`."""

    text: str
    token_ids: list[int]
    finished: bool = False
    output: GenerationOutput | None = None
    logprobs: list[TokenLogprob] | None = None


@dataclass
class _Collected:
    """What one request has produced so far (engine side)."""

    events: list[tuple[float, int]] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    done: dict[str, tuple] = field(default_factory=dict)
    expect_done: set[str] = field(default_factory=set)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    sent: int = 0  # tokens handed out in chunks so far
    detok: IncrementalText | None = None  # the streamed text, decoded a window at a time (set by stream)
    timed_out: bool = False  # the request's deadline passed and its leader was told to stop

    def unsent(self, with_logprobs: bool) -> tuple[list[int], list[TokenLogprob] | None]:
        """The tokens (and their log-probabilities, if asked for) not yet in a chunk; marks them sent."""
        n0, self.sent = self.sent, len(self.tokens)
        return self.tokens[n0:], self.logprobs[n0:] if with_logprobs else None


def _stop_prefix_len(text: str, stop: tuple[str, ...]) -> int:
    """Length of the longest end of ``text`` that begins one of the ``stop`` strings: a stream
    holds it back until the next tokens show whether the stop string completes (and the text is
    cut there) or not, so the streamed text always equals the final text."""
    held = 0
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), held, -1):
            if text.endswith(s[:k]):
                held = k
                break
    return held
