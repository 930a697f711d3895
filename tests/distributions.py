"""The exact distribution of the first sampled tokens, for the sampling-distribution tests
(speculative output must follow the target's own distribution)."""
from __future__ import annotations

from collections import Counter

import torch

from swiftspec.model_executor.sampling import Sampler, SamplingParams


def exact_first_tokens(model, prompt: list[int], params: dict, device: str = "cpu") -> dict[tuple, float]:
    """``{(t0, t1, t2): probability}`` of the first three tokens the target samples after
    ``prompt`` under ``params`` (a ``SamplingParams`` dict), from full forwards of ``model``."""

    def dist(ids):
        n = len(ids)
        pos = torch.arange(n, device=device)
        mask = torch.ones(n, n, dtype=torch.bool, device=device).tril()
        h = model(torch.tensor(ids, device=device), pos, pos, mask, model.make_kv_cache(64, device))
        return Sampler(SamplingParams(**params)).probs(model.compute_logits(h[-1:])[0].cpu())

    exact = {}
    p0 = dist(prompt)
    for a in p0.nonzero().flatten().tolist():
        p1 = dist(prompt + [a])
        for b in p1.nonzero().flatten().tolist():
            p2 = dist(prompt + [a, b])
            for c in p2.nonzero().flatten().tolist():
                exact[(a, b, c)] = float(p0[a] * p1[b] * p2[c])
    return exact


def chi_square_pvalue(counts: Counter, exact: dict[tuple, float]) -> float:
    """p-value of the observed ``counts`` of first-token triples under ``exact``; every observed
    triple must be possible."""
    from scipy.stats import chisquare

    assert set(counts) <= set(exact), "a sampled sequence the target cannot produce"
    keys = sorted(exact)
    n, total = sum(counts.values()), sum(exact.values())  # total: 1 up to rounding; chisquare wants equal sums
    return float(chisquare([counts[k] for k in keys], [exact[k] / total * n for k in keys]).pvalue)
