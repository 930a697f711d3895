"""Per-request metrics (README.md, "Python API").

Definitions (units: seconds, tokens):
- ``ttft_s``: from the ``generate`` call to the first token's verification.
- ``tokens_per_s``: decode speed, prefill excluded: ``(num_tokens - 1) / (t_last - t_first)``.
- ``tbt_*``: time between tokens. Tokens verified together share their iteration's interval
  evenly, so an iteration of ``n`` tokens ``dt`` after the previous one contributes ``n``
  samples of ``dt / n``.
- ``compression_ratio``: verified tokens per target verification forward (paper Table 6).
- ``accepted_hist``: accepted-length histogram, ``{accepted nodes per verification: count}``.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field

import numpy as np


@dataclass
class RequestMetrics:
    """One request's metrics (definitions and units in the module docstring).

    Attributes:
        mode: the decoding mode that ran. prompt_tokens / num_tokens: prompt and generated tokens.
        ttft_s, decode_s: time to first token and decode time (seconds, prefill excluded).
        tokens_per_s: decode speed. tbt_mean_s / tbt_p50_s / tbt_p99_s: time between tokens (seconds).
        compression_ratio: verified tokens per target verification forward. verifications: those forwards.
        accepted_hist: accepted nodes per verification -> count. finish_reason: "stop" (EOS or stop string), "length" or None.
        target, draft: each model's counters (forwards, busy seconds, ...; mode dependent).
        mode_reason: why this mode ran. kernels: kernel family -> implementation.
    """

    mode: str
    prompt_tokens: int
    num_tokens: int
    ttft_s: float
    decode_s: float
    tokens_per_s: float
    tbt_mean_s: float
    tbt_p50_s: float
    tbt_p99_s: float
    compression_ratio: float
    verifications: int
    accepted_hist: dict[int, int] = field(default_factory=dict)
    finish_reason: str | None = None
    target: dict = field(default_factory=dict)
    draft: dict = field(default_factory=dict)
    mode_reason: str = ""  # why this mode ran (engine.choose_mode)
    kernels: dict = field(default_factory=dict)  # kernel family -> implementation (ops.cpu_dispatch)

    def to_dict(self) -> dict:
        """The metrics as a JSON-able dict (``dataclasses.asdict``)."""
        return asdict(self)

    @classmethod
    def from_events(cls, mode: str, prompt_tokens: int, t_start: float, events: list[tuple[float, int]],
                    accepted: list[int], finish_reason: str | None, target: dict | None = None,
                    draft: dict | None = None) -> "RequestMetrics":
        """Build metrics from ``events`` = ``[(t_verified, n_tokens), ...]`` (first = prefill token)."""
        events = [e for e in events if e[1] > 0]
        num = sum(n for _, n in events)
        ttft = events[0][0] - t_start if events else float("nan")
        gaps: list[float] = []
        for (t_prev, _), (t, n) in zip(events, events[1:]):
            gaps += [(t - t_prev) / n] * n
        decode_s = events[-1][0] - events[0][0] if events else 0.0
        tps = (num - 1) / decode_s if decode_s > 0 else float("nan")
        g = np.asarray(gaps) if gaps else np.asarray([float("nan")])
        verifications = len(accepted)
        ratio = (num - 1) / verifications if verifications else float("nan")
        return cls(mode=mode, prompt_tokens=prompt_tokens, num_tokens=num, ttft_s=ttft, decode_s=decode_s,
                   tokens_per_s=tps, tbt_mean_s=float(g.mean()), tbt_p50_s=float(np.percentile(g, 50)),
                   tbt_p99_s=float(np.percentile(g, 99)), compression_ratio=ratio, verifications=verifications,
                   accepted_hist=dict(sorted(Counter(accepted).items())), finish_reason=finish_reason,
                   target=target or {}, draft=draft or {})
