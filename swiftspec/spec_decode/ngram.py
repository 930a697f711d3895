"""Prompt-lookup (n-gram) proposals: the draft tokens of ``mode="ngram"``, with no draft model.

The proposer looks for the request's last ``n`` tokens (``n`` from ``max_n`` down to ``min_n``)
earlier in the request's own text (the prompt and every verified token) and proposes the tokens
that followed their most recent earlier occurrence. The target verifies them as a chain below the
root (:class:`swiftspec.spec_decode.tree.Subgraph`) with the same walk as the draft tree's
(:func:`swiftspec.spec_decode.verify.walk`), so the output is the target's own, greedy or sampled: a proposal
only decides how many of the target's tokens one forward yields.

Where it pays: text that repeats its context (summaries, answers quoting a passage, code that
reuses names), at no draft cost: a step without a match is a plain one-token target step, and no
draft prefill precedes the first proposal. Algorithm: prompt lookup decoding (A. Saxena, 2023);
the same idea as vLLM's ``ngram`` speculative method (``vllm/v1/spec_decode/ngram_proposer.py``)
and llama.cpp's ``lookup`` example. Here the lookup is an index per n-gram length, updated
once per verified token (O(max_n) a token), not a scan of the text per step.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NgramParams:
    """Shape of the n-gram proposals.

    Attributes:
        min_n / max_n: lengths of the suffix looked up (the longest match wins); 1 <= min_n <= max_n.
        tokens: tokens proposed per verification (at most; fewer where the earlier occurrence is
            followed by fewer). The target's verification batch is ``tokens + 1`` rows (the root).
        adaptive: propose ``min(tokens, n)`` tokens, ``n`` the length of the suffix that matched:
            a longer match is stronger evidence that the text repeats here, so it buys a longer
            chain, and a one-token match a single guess. On a Zen 4 (at most 3 tokens, from
            one-token matches) it ran 5 % faster than a fixed 2 tokens on the six evaluation
            datasets and level on held-out ones (bench/RESULTS.md; bench/LOG.md, "Proposals as
            long as the match").
    """

    min_n: int = 2
    max_n: int = 4
    tokens: int = 1
    adaptive: bool = False

    def __post_init__(self):
        for name in ("min_n", "max_n", "tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"ngram {name} must be a positive integer, got {v!r}")
        if self.min_n > self.max_n:
            raise ValueError(f"ngram min_n ({self.min_n}) must not exceed max_n ({self.max_n})")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"ngram adaptive must be a bool, got {self.adaptive!r}")


class NgramProposer:
    """The n-gram index of one request's text and its proposals.

    ``index[n]`` maps each n-gram of the text (a tuple of ``n`` token ids) to the position
    right after its most recent occurrence that has a following token, so a lookup of the text's
    own suffix finds an earlier occurrence, never itself.
    """

    def __init__(self, params: NgramParams, prompt_ids: list[int]):
        self.params = params
        self.text: list[int] = []
        self.index: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(params.min_n, params.max_n + 1)}
        self.extend(prompt_ids)

    def extend(self, tokens: list[int]) -> None:
        """Append verified tokens to the text (each indexed as the follower of the n-grams before it)."""
        text = self.text
        for tok in tokens:
            j = len(text)
            for n, grams in self.index.items():
                if j >= n:
                    grams[tuple(text[j - n:j])] = j
            text.append(int(tok))

    def propose(self) -> list[int]:
        """Up to ``tokens`` ids (``min(tokens, n)`` where ``adaptive``) that followed the longest
        earlier occurrence of the text's last ``n`` tokens (``max_n`` down to ``min_n``); [] where
        none of them occurred before."""
        p, text = self.params, self.text
        for n in range(min(p.max_n, len(text)), p.min_n - 1, -1):
            start = self.index[n].get(tuple(text[len(text) - n:]))
            if start is not None:
                return text[start:start + (min(p.tokens, n) if p.adaptive else p.tokens)]
        return []
