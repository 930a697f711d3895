"""Sampling parameters and the target's token sampler.

The target samples every emitted token itself (docs/architecture.md §3), so the output distribution is the
target's own whatever the draft guessed. The sampler draws exactly one uniform number per
emitted token (inverse-CDF sampling), so a seed gives the same text in every mode.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

MAX_LOGPROBS = 20  # alternatives per token, as the OpenAI API's top_logprobs


def is_positive_seconds(t) -> bool:
    """Whether ``t`` is a duration in seconds a deadline may have: an int or float (not a bool),
    finite and > 0. The one check of a request's ``timeout_s`` (:class:`SamplingParams`, the
    server's limits and the request body); each caller raises its own error."""
    return not isinstance(t, bool) and isinstance(t, (int, float)) and 0 < t < float("inf")


@dataclass(frozen=True)
class TokenLogprob:
    """The target's log-probability of one generated token and of its most likely alternatives.

    Attributes:
        token_id: the generated token.
        logprob: its natural-log probability under the target's own distribution: float32
            log-softmax of the target's logits, before temperature, top-k and top-p (as vLLM's
            default "raw" logprobs). The logits are batch invariant, so the value is the same in
            every mode.
        top: ``(token_id, logprob)`` of the :attr:`SamplingParams.logprobs` most likely tokens,
            most likely first (ties: lower id first).
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    Attributes:
        temperature: 0 means greedy (argmax); otherwise logits are divided by it. Must be >= 0.
        top_k: keep only the k most likely tokens; 0 disables. Must be >= 0.
        top_p: nucleus sampling mass in (0, 1]; 1 disables.
        seed: seed of the sampler's generator; None draws one from the OS.
        max_tokens: maximum number of generated tokens (>= 1).
        stop: strings that end generation; the returned text stops before the first match.
        ignore_eos: keep going past end-of-sequence tokens (benchmarks).
        logprobs: None (default) returns no log-probabilities; 0 to ``MAX_LOGPROBS`` returns a
            :class:`TokenLogprob` per generated token with that many alternatives (one float32
            log-softmax over the vocabulary per verified token).
        timeout_s: the request's deadline, seconds from its start in the engine (the prefill
            included, a server's queue wait not): once it has passed, generation stops at the
            next verification and the request ends with the tokens so far and finish reason
            "timeout". None (default): no deadline.
    Raises:
        ValueError: any parameter out of range (checked at construction).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 256
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None
    timeout_s: float | None = None

    def __post_init__(self):
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0 or self.temperature != self.temperature:
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"seed must be a non-negative integer or None, got {self.seed!r}")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.timeout_s is not None and not is_positive_seconds(self.timeout_s):
            raise ValueError(f"timeout_s must be None or a finite number of seconds > 0, got {self.timeout_s!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError("stop must be a list of non-empty strings")
        object.__setattr__(self, "stop", stop)

    @property
    def greedy(self) -> bool:
        """Whether decoding is greedy (``temperature == 0``)."""
        return self.temperature == 0.0


@dataclass(frozen=True)
class SampleHead:
    """What a forward returns per row for a sampled request without log-probabilities (the
    runner's ``head``, :func:`swiftspec.spec_decode.verify.target_head`): each row's token drawn by
    :func:`sample_rows` with ``params`` and the row's ``uniforms`` entry, where the model runs."""

    params: SamplingParams
    uniforms: tuple[float, ...]


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """``[k, vocab]`` float32 distributions sampled from: softmax of ``logits / temperature``
    after top-k, renormalized after top-p (the smallest set of most likely tokens whose mass
    reaches ``top_p``). Row-wise, on the logits' device."""
    x = logits.float() / params.temperature
    if params.top_k and params.top_k < x.shape[-1]:
        kth = x.topk(params.top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        sp, si = probs.sort(dim=-1, descending=True)
        before = sp.cumsum(-1) - sp  # mass strictly before each token
        sp = sp.masked_fill(before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, si, sp)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_rows(logits: torch.Tensor, params: SamplingParams, u: torch.Tensor) -> torch.Tensor:
    """One token per row by inverse-CDF sampling, on the logits' device (no host round trip).

    :func:`filtered_probs`, then the first token whose cumulative probability (float64) exceeds
    ``u * total``; a ``u`` landing on the edge of a zero-mass run takes the last token with mass
    before it. Rows are independent: a row's token depends on its logits and its ``u`` only.

    Args:
        logits: ``[k, vocab]`` float logits.
        params: a sampled request's parameters (``temperature > 0``).
        u: ``[k]`` float64 uniforms in [0, 1), on the logits' device.
    Returns:
        ``[k]`` int64 token ids.
    """
    probs = filtered_probs(logits, params)
    vocab = probs.shape[-1]
    cdf = probs.double().cumsum(-1)
    idx = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1), right=True).clamp_(max=vocab - 1)
    ids = torch.arange(vocab, device=probs.device).expand_as(probs)
    last_with_mass = torch.where(probs > 0, ids, -1).cummax(-1).values
    return last_with_mass.gather(-1, idx).squeeze(-1)


class Sampler:
    """Draws tokens from ``[vocab]`` float32 logits according to :class:`SamplingParams`.

    The request's ``i``-th sampled token uses the ``i``-th uniform of its seeded generator
    (:meth:`uniform`), whichever mode produced it and whether it was drawn here or where the
    model runs (:class:`SampleHead`): with a seed, the output is the same in every mode.
    """

    def __init__(self, params: SamplingParams):
        self.params = params
        self.gen = torch.Generator()
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        self.gen.manual_seed(seed)
        self.position = 0  # tokens sampled so far (the next one uses uniform(position))
        self._uniforms: list[float] = []

    def uniform(self, i: int) -> float:
        """The request's ``i``-th uniform in [0, 1) (float64; drawn in order, kept once drawn)."""
        while len(self._uniforms) <= i:
            self._uniforms.append(float(torch.rand((), generator=self.gen, dtype=torch.float64)))
        return self._uniforms[i]

    def head(self, depths: list[int]) -> SampleHead:
        """The :class:`SampleHead` of a verification whose rows sit ``depths`` below the root: a
        row at depth ``j`` predicts the token after ``position + j`` sampled ones."""
        return SampleHead(self.params, tuple(self.uniform(self.position + j) for j in depths))

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution actually sampled from (after temperature, top-k, top-p): ``[vocab]``."""
        return filtered_probs(logits[None], self.params)[0]

    def logprob(self, logits: torch.Tensor, token: int) -> TokenLogprob:
        """``token``'s :class:`TokenLogprob` from ``[vocab]`` logits (``params.logprobs`` alternatives)."""
        lp = torch.log_softmax(logits.float(), dim=-1)
        k = self.params.logprobs or 0
        top = ()
        if k:
            # every id at or above the k-th largest value (O(vocab), no full sort), then by value
            # with a stable sort over ascending ids: equal log-probabilities keep the lower id first
            kth = lp.topk(k).values[-1]
            ids = (lp >= kth).nonzero().flatten()
            vals, order = lp[ids].sort(descending=True, stable=True)
            top = tuple((int(i), float(v)) for i, v in zip(ids[order][:k].tolist(), vals[:k].tolist()))
        return TokenLogprob(token, float(lp[token]), top)

    def sample(self, logits: torch.Tensor) -> int:
        """The next token id from ``[vocab]`` logits (greedy: argmax, first index on ties; else
        :func:`sample_rows` with the next uniform)."""
        i = self.position
        self.position += 1
        if self.params.greedy:
            return int(torch.argmax(logits))
        u = torch.tensor([self.uniform(i)], dtype=torch.float64, device=logits.device)
        return int(sample_rows(logits[None], self.params, u)[0])
