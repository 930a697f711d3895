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
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError("stop must be a list of non-empty strings")
        object.__setattr__(self, "stop", stop)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class Sampler:
    """Draws tokens from ``[vocab]`` float32 logits according to :class:`SamplingParams`."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.gen = torch.Generator()
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        self.gen.manual_seed(seed)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution actually sampled from (after temperature, top-k, top-p): ``[vocab]``."""
        p = self.params
        x = logits.float() / p.temperature
        if p.top_k and p.top_k < x.numel():
            kth = x.topk(p.top_k).values[-1]
            x = x.masked_fill(x < kth, float("-inf"))
        probs = torch.softmax(x, dim=-1)
        if p.top_p < 1.0:
            sp, si = probs.sort(descending=True)
            before = sp.cumsum(0) - sp  # mass strictly before each token
            sp = sp.masked_fill(before >= p.top_p, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, si, sp)
            probs = probs / probs.sum()
        return probs

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
        """One token id from ``[vocab]`` logits (greedy: argmax, first index on ties)."""
        if self.params.greedy:
            return int(torch.argmax(logits))
        probs = self.probs(logits)
        u = torch.rand((), generator=self.gen, dtype=torch.float64)
        cdf = probs.double().cumsum(0)
        idx = int(torch.searchsorted(cdf, u * cdf[-1], right=True))
        idx = min(idx, probs.numel() - 1)
        while probs[idx] == 0:  # u landed on the edge of a zero-mass run
            idx -= 1
        return idx
