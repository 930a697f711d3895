"""The per-request draft gate (swiftspec.spec_decode.payback): its arithmetic, and run_serial under it
(lossless both ways; the draft prefilled up to the root when it speculates)."""
import pytest

from swiftspec.model_executor.sampling import SamplingParams
from swiftspec.spec_decode import target_loops, tree_loops
from swiftspec.spec_decode.acceptance import Replay
from swiftspec.spec_decode.payback import MIN_SIGMA, MIN_TOKENS, PaybackGate
from tests.test_scheduler import PROMPT, _collect, _draft, _req, _target, greedy_reference  # noqa: F401 (fixture)


def _measured(rho: float, sigma: float) -> PaybackGate:
    g = PaybackGate()
    g.observe_prefill(20.0, 0.0)  # the first: one-time costs, not used
    g.observe_prefill(2.0, 2.0 * rho)
    g.observe_decode(0.03, 100, 0.03 * 100 / sigma)
    return g


def test_speculates_until_the_prefill_ratio_is_measured():
    g = PaybackGate()
    assert g.decide(100.0, 1.0, 1).speculate  # nothing measured: however unlikely to pay back
    g.observe_prefill(1.0, 0.01)  # a worker's first prefill (one-time costs): not used
    assert g.rho is None and g.decide(100.0, 1.0, 1).speculate
    g.observe_prefill(1.0, 0.4)
    assert g.rho == pytest.approx(0.4) and g.sigma is None
    # no speed-up measured yet: MIN_SIGMA's
    saving = 100 * 0.02 * (1 - 1 / MIN_SIGMA)
    assert g.decide(0.99 * saving / 0.4, 0.02, 100).speculate
    assert not g.decide(1.01 * saving / 0.4, 0.02, 100).speculate
    g.observe_decode(0.03, MIN_TOKENS - 1, 0.01)  # too few tokens to measure a speed
    assert g.sigma is None
    g.observe_decode(0.03, 10, 0.2)
    assert g.sigma == pytest.approx(1.5)


def test_decision_is_the_payback_inequality():
    """Speculate iff budget * t_step * (1 - 1/sigma) > rho * T_prefill."""
    g = _measured(rho=0.4, sigma=1.25)  # saving per token = 0.2 t_step
    # 709-token prompt prefilled in 4.8 s, a 27 ms step: the draft's prefill costs 1.92 s
    assert not g.decide(4.8, 0.027, 127).speculate  # saves 0.69 s
    assert g.decide(4.8, 0.027, 400).speculate  # saves 2.16 s
    d = g.decide(0.25, 0.02, 127)  # a short prompt: 0.1 s against 0.51 s
    assert d.speculate and "pays back" in d.reason and "~0.1 s" in d.reason
    assert "would not pay back" in g.decide(4.8, 0.027, 127).reason


def test_a_slow_measured_speedup_does_not_switch_speculation_off():
    """A measured sigma below MIN_SIGMA counts as MIN_SIGMA (the memory state's noise, not a reason
    to give speculation up): short prompts keep speculating (and measuring)."""
    g = _measured(rho=0.4, sigma=0.8)
    assert g.sigma == pytest.approx(0.8)
    saving = 100 * 0.02 * (1 - 1 / MIN_SIGMA)
    assert g.decide(0.99 * saving / 0.4, 0.02, 100).speculate
    assert not g.decide(1.01 * saving / 0.4, 0.02, 100).speculate


def test_estimates_follow_recent_requests():
    g = _measured(rho=0.4, sigma=1.25)
    for _ in range(50):
        g.observe_prefill(1.0, 0.2)
        g.observe_decode(0.03, 50, 0.03 * 50 / 1.5)
    assert g.rho == pytest.approx(0.2, rel=1e-3) and g.sigma == pytest.approx(1.5, rel=1e-3)


@pytest.mark.parametrize("speculate", [False, True])
def test_serial_under_the_gate_equals_autoregressive(tiny_dir, tiny_draft_dir, greedy_reference, speculate):
    """Gated off, the request runs on the target alone (ran = "autoregressive", one token per
    forward, the draft never runs); gated on, the draft prefills the prompt and the tokens before
    the root, speculation accepts tokens, and the gate measures both costs. Greedy output is the
    target's own either way."""
    g = _measured(rho=1e-9 if speculate else 1e6, sigma=1.25)  # whatever the timings
    draft = _draft(tiny_draft_dir)
    draft.debug = True
    out, emit = _collect()
    rho0, sigma0 = g.rho, g.sigma
    st = tree_loops.run_serial(draft, _target(tiny_dir), _req(d=2), emit, gate=g)
    assert out == greedy_reference
    assert st.step_s > 0 and st.ran_reason
    if speculate:
        assert st.ran is None and "pays back" in st.ran_reason
        assert draft.prompt_len == len(PROMPT) + 1 and sum(st.accepted) > 0
        assert g.rho != rho0 and g.sigma != sigma0
    else:
        assert st.ran == "autoregressive" and "would not pay back" in st.ran_reason
        assert draft.tree is None and st.accepted == [0] * 39 and (g.rho, g.sigma) == (rho0, sigma0)


def test_replayed_requests_are_not_gated(tiny_dir, tiny_draft_dir):
    """A replayed acceptance (benchmarks) shapes the speculative loop itself: with a gate that
    would run the target alone, the request still speculates, with no gated step, and the gate
    learns nothing from it."""
    g = _measured(rho=1e6, sigma=1.25)
    req = _req(d=2)
    req.replay = Replay(tuple([0] * 40))
    out, emit = _collect()
    st = tree_loops.run_serial(_draft(tiny_draft_dir), _target(tiny_dir), req, emit, gate=g)
    assert len(out) == 40 and st.ran is None and st.step_s == 0 and not st.ran_reason
    assert sum(st.accepted) > 0 and g.rho == pytest.approx(1e6) and g.sigma == pytest.approx(1.25)


@pytest.mark.parametrize("speculate", [False, True])
def test_a_seed_gives_the_target_alones_sample_under_the_gate(tiny_dir, tiny_draft_dir, greedy_reference,
                                                             speculate):
    """Sampled requests: the gated step and whichever path follows use the request's uniforms in
    order, so a seed gives autoregressive's tokens either way (not the greedy ones)."""
    params = SamplingParams(max_tokens=30, ignore_eos=True, temperature=2.0, top_p=0.95, seed=7)
    ref, emit = _collect()
    target_loops.run_autoregressive(_target(tiny_dir), _req(n=30, params=params), emit)
    g = _measured(rho=1e-9 if speculate else 1e6, sigma=1.25)  # whatever the timings
    out, emit = _collect()
    st = tree_loops.run_serial(_draft(tiny_draft_dir), _target(tiny_dir), _req(n=30, params=params, d=2), emit, gate=g)
    assert out == ref and len(out) == 30 and (st.ran is None) == speculate
    assert out != greedy_reference[:30]
