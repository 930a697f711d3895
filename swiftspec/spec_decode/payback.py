"""Per request, whether the draft's prefill pays back within the request's token budget.

Speculation saves time per token, but a draft model must first run the whole prompt (its
prefill), which grows with the prompt like the target's own prefill. A long prompt with a small
``max_tokens`` can spend more on that than speculation can save in the tokens left, and then the
target alone finishes the request sooner (the summarization prompts at 128 tokens; bench/LOG.md,
"The draft prefills only where that pays back"). vLLM makes the same call with a fixed length
(``speculative_max_model_len``: longer sequences skip speculation); here it comes from what this
engine measures:

- ``rho``: the draft's prefill time over the target's on the same prompt (from the requests that
  prefilled both, except a worker's first: its target prefill also pays one-time costs, the
  first touch of the weights and of the thread pool, which made ``rho`` near 0 on small models);
- ``sigma``: speculative decoding's speed over the target alone, measured per request as one
  target-alone step's time (every gated request takes one before it decides) times the tokens
  verified after the draft's prefill, over the time they took; taken as at least
  :data:`MIN_SIGMA`.

A request speculates unless ``rho`` is known and ``rho * T_prefill >= budget * t_step * (1 - 1 /
sigma)`` (``T_prefill``: this prompt's target prefill, ``t_step``: its target-alone step, both
just measured; ``budget``: the tokens it may still generate).

Why a floor on ``sigma``: the mode that runs here was chosen because it measured faster than the
target alone over many requests (:func:`swiftspec.engine.mode_selection.choose_mode`), while a single request's
measurement swings with the machine's memory state: on a 2-core Zen 5 running the AVX2 code,
speculation ran slower than the target alone while memory was fast and well ahead of it while it
was slow, within minutes. With the measurement alone, a few fast-state requests made later code
prompts, where speculation then gained, run without the draft (bench/LOG.md, "The draft prefills
only where that pays back": a first version with a lower floor).
Below the floor the estimate is noise, not a reason to give speculation up; above it (a better
draft) more prompts speculate. Lossless either way: every token is the target's own.
"""
from __future__ import annotations

from dataclasses import dataclass

# speculation's speed-up over the target alone is taken as at least this (see the module docstring)
MIN_SIGMA = 1.2
# weight of the previous estimate when a request adds its measurement (exponential average)
DECAY = 0.8
# a speculative request measures sigma only with at least this many tokens after the draft's prefill
MIN_TOKENS = 4


@dataclass
class Decision:
    """One request's call: ``speculate``, and why (the estimates, in seconds)."""

    speculate: bool
    reason: str


class PaybackGate:
    """Decides per request whether to prefill the draft (:func:`swiftspec.spec_decode.tree_loops.run_serial`)
    and learns from the requests that did. Not thread-safe; one per serial worker."""

    def __init__(self):
        self._rho_num = self._rho_den = 0.0  # decayed sums: draft prefill s, target prefill s
        self._ar_num = self._spec_den = 0.0  # decayed sums: t_step * tokens, speculative decode s
        self._first = True  # no prefill observed yet (the first one is not used)

    @property
    def rho(self) -> float | None:
        """The draft's prefill time over the target's, or None before one was measured."""
        return self._rho_num / self._rho_den if self._rho_den > 0 else None

    @property
    def sigma(self) -> float | None:
        """Speculative decoding's speed over the target alone, or None before one was measured."""
        return self._ar_num / self._spec_den if self._spec_den > 0 else None

    def decide(self, target_prefill_s: float, step_s: float, budget: int) -> Decision:
        """Whether this request should prefill the draft.

        Args:
            target_prefill_s: the target's prefill of this prompt, seconds.
            step_s: one target-alone decode step right after it, seconds.
            budget: tokens the request may still generate.
        """
        rho = self.rho
        if rho is None:
            return Decision(True, "speculating until the draft's prefill cost is measured")
        sigma = max(self.sigma or MIN_SIGMA, MIN_SIGMA)
        cost = rho * target_prefill_s
        saving = budget * step_s * (1.0 - 1.0 / sigma)
        verdict = "pays back" if saving > cost else "would not pay back"
        return Decision(saving > cost, f"the draft's prefill (~{cost:.3g} s, {rho:.2f}x the target's) {verdict} "
                                       f"within {budget} tokens (speculation saves ~{saving:.3g} s at "
                                       f"{sigma:.2f}x the target alone)")

    def observe_prefill(self, target_prefill_s: float, draft_prefill_s: float) -> None:
        """Record one prompt's prefill times (seconds) on both models (the first call: ignored)."""
        if self._first:
            self._first = False
        elif target_prefill_s > 0:
            self._rho_num = DECAY * self._rho_num + draft_prefill_s
            self._rho_den = DECAY * self._rho_den + target_prefill_s

    def observe_decode(self, step_s: float, tokens: int, spec_s: float) -> None:
        """Record one speculative request: its target-alone step (s), and the ``tokens`` verified
        after the draft's prefill in ``spec_s`` seconds. Ignored below :data:`MIN_TOKENS`."""
        if tokens >= MIN_TOKENS and spec_s > 0:
            self._ar_num = DECAY * self._ar_num + step_s * tokens
            self._spec_den = DECAY * self._spec_den + spec_s
