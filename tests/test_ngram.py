"""The ngram mode: prompt-lookup proposals (swiftspec/spec_decode/ngram.py) verified by the target alone."""
from collections import Counter

import pytest

from swiftspec.engine.config import EngineConfig
from swiftspec.model_executor.runner import ModelRunner, RunnerHandle
from swiftspec.model_executor.sampling import SamplingParams
from swiftspec.spec_decode import target_loops
from swiftspec.spec_decode.ngram import NgramParams, NgramProposer
from swiftspec.spec_decode.scheduler import Request
from swiftspec.spec_decode.target_state import TargetState

PROMPT = [3, 40, 41, 42, 50, 60, 70, 33, 34, 35]


def _target(model_dir):
    return TargetState(RunnerHandle("target", ModelRunner(str(model_dir), capacity=512), []))


def _collect():
    out = []
    return out, lambda toks, t, lps=(): out.extend(toks)


def _propose(text, **kw):
    return NgramProposer(NgramParams(**kw), text).propose()


def test_proposal_follows_the_latest_earlier_occurrence():
    text = [7, 1, 2, 3, 9, 5, 1, 2, 3, 8, 6, 2, 3]  # suffix (2, 3): followed by 9, then by 8 (latest)
    assert _propose(text) == [8]
    assert _propose(text, tokens=3) == [8, 6, 2]
    assert _propose(text, tokens=9) == [8, 6, 2, 3]  # as many as follow


def test_the_longest_match_wins_over_a_later_shorter_one():
    text = [1, 2, 3, 4, 9, 3, 4, 7, 1, 2, 3, 4]  # (3, 4) last followed by 7, (1, 2, 3, 4) by 9
    assert _propose(text) == [9]
    assert _propose(text, max_n=2) == [7]


def test_an_adaptive_proposal_is_as_long_as_the_match():
    """adaptive: min(tokens, n) tokens, n the length of the suffix that matched."""
    text = [7, 1, 2, 3, 9, 5, 1, 2, 3, 8, 6, 2, 3]  # (2, 3) matches, (1, 2, 3) does not end the text
    assert _propose(text, min_n=1, tokens=4, adaptive=True) == [8, 6]
    assert _propose(text + [8], min_n=1, tokens=4, adaptive=True) == [6, 2, 3]  # (2, 3, 8) matched
    assert _propose(text + [8], min_n=1, tokens=2, adaptive=True) == [6, 2]  # at most tokens
    assert _propose([5, 1, 4, 5], min_n=1, tokens=4, adaptive=True) == [1]  # a one-token match: one guess
    assert _propose([5, 1, 4, 5], min_n=1, tokens=4) == [1, 4, 5]  # fixed length: as many as follow


def test_no_earlier_occurrence_proposes_nothing():
    assert _propose([1, 2, 3, 4]) == []
    assert _propose([5, 1, 5]) == []  # a one-token match is below min_n = 2
    assert _propose([5, 1, 5], min_n=1) == [1]
    assert _propose([]) == [] and _propose([4]) == []


def test_the_index_grows_with_the_verified_tokens():
    p = NgramProposer(NgramParams(), [10, 11, 12, 13])
    assert p.propose() == []
    p.extend([10, 11])  # (10, 11) occurred at the start, followed by 12
    assert p.propose() == [12]
    p.extend([5])
    assert p.propose() == []


@pytest.mark.parametrize("kw", [dict(min_n=0), dict(tokens=0), dict(min_n=3, max_n=2), dict(max_n=True),
                                dict(tokens=1.5), dict(adaptive="yes")])
def test_invalid_parameters_are_refused(kw):
    with pytest.raises(ValueError):
        NgramParams(**kw)
    names = {"min_n": "ngram_min", "max_n": "ngram_max", "tokens": "ngram_tokens", "adaptive": "ngram_adaptive"}
    with pytest.raises(ValueError):
        EngineConfig(mode="ngram", **{names[k]: v for k, v in kw.items()})


def test_the_engine_config_takes_the_mode():
    c = EngineConfig(mode="ngram", ngram_min=1, ngram_max=3, ngram_tokens=2)
    assert c.ngram_params() == NgramParams(1, 3, 2)
    assert EngineConfig(mode="ngram", ngram_tokens=3, ngram_adaptive=True).ngram_params() == NgramParams(2, 4, 3, True)


@pytest.fixture(scope="module")
def reference(tiny_dir):
    """The target's own greedy tokens after PROMPT."""
    out, emit = _collect()
    st = target_loops.run_autoregressive(_target(tiny_dir), Request(PROMPT, SamplingParams(max_tokens=60, ignore_eos=True),
                                                                 60, (2,)), emit)
    assert len(out) == 60 and st.verifications == 59
    return out


def _oracle(ref, wrong_every=0):
    """A proposer stand-in that proposes the target's true next tokens (from ``ref``), with the
    second token of every ``wrong_every``-th proposal replaced by a wrong one (0: never)."""
    calls = []

    def propose(self):
        i = len(self.text) - len(PROMPT)  # tokens verified so far, the root included
        chain = list(ref[i:i + self.params.tokens])
        calls.append(chain)
        if wrong_every and len(calls) % wrong_every == 0 and len(chain) > 1:
            chain[1] = (chain[1] + 1) % 128
        return chain
    return propose


@pytest.mark.parametrize("tokens,adaptive", [(1, False), (3, False), (3, True)])
def test_real_proposals_keep_the_greedy_output(tiny_dir, reference, tokens, adaptive):
    out, emit = _collect()
    req = Request(PROMPT, SamplingParams(max_tokens=60, ignore_eos=True), 60, (2,), trace=True)
    st = target_loops.run_ngram(_target(tiny_dir), req, emit, NgramParams(min_n=1, tokens=tokens, adaptive=adaptive))
    assert out == reference
    assert any(len(t["subgraph"]) > 1 for t in st.trace), "60 tokens of a 128-token vocabulary repeat some token"
    assert max(len(t["subgraph"]) for t in st.trace) <= tokens + 1
    assert st.verifications == 60 - 1 - sum(st.accepted)


@pytest.mark.parametrize("tokens,wrong_every", [(1, 0), (3, 0), (3, 2)])
def test_true_proposals_are_accepted_and_wrong_ones_cut(tiny_dir, reference, monkeypatch, tokens, wrong_every):
    """An oracle proposer (the target's own next tokens) gets every proposed token accepted, as a
    draft identical to the target does; a wrong token ends the chain there, losslessly."""
    monkeypatch.setattr(NgramProposer, "propose", _oracle(reference, wrong_every))
    out, emit = _collect()
    req = Request(PROMPT, SamplingParams(max_tokens=60, ignore_eos=True), 60, (2,), trace=True)
    st = target_loops.run_ngram(_target(tiny_dir), req, emit, NgramParams(tokens=tokens))
    assert out == reference
    want = [len(t["subgraph"]) - 1 for t in st.trace]  # every proposed token
    if wrong_every:  # the corrupted proposals keep their first token only
        want = [1 if (i + 1) % wrong_every == 0 and w > 1 else w for i, w in enumerate(want)]
    assert st.accepted == want and sum(want) > 0


def test_the_token_budget_caps_the_proposal(tiny_dir, reference, monkeypatch):
    monkeypatch.setattr(NgramProposer, "propose", _oracle(reference))
    for n in (2, 3, 5):
        out, emit = _collect()
        req = Request(PROMPT, SamplingParams(max_tokens=n, ignore_eos=True), n, (2,), trace=True)
        st = target_loops.run_ngram(_target(tiny_dir), req, emit, NgramParams(tokens=4))
        assert out == reference[:n]
        # after the prefill's token n - 1 remain: a chain never verifies more rows than that
        assert st.trace and max(len(t["subgraph"]) for t in st.trace) == min(n - 1, 5)


def test_sampled_output_follows_target_distribution(tiny_dir, reference, monkeypatch):
    """Joint distribution of the first three sampled tokens against the exact target
    distribution (chi-square), with proposals (the greedy tokens) often accepted."""
    from distributions import chi_square_pvalue, exact_first_tokens

    from swiftspec.model_executor.models import load_model

    monkeypatch.setattr(NgramProposer, "propose", _oracle(reference))
    params = dict(temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True)
    exact = exact_first_tokens(load_model(tiny_dir), PROMPT, params)
    target = _target(tiny_dir)
    n, counts, accepted_any = 1500, Counter(), 0
    for seed in range(n):
        out, emit = _collect()
        st = target_loops.run_ngram(target, Request(PROMPT, SamplingParams(**params, seed=seed), 3, ()), emit,
                                 NgramParams(tokens=2))
        counts[tuple(out)] += 1
        accepted_any += sum(st.accepted) > 0
    assert chi_square_pvalue(counts, exact) > 1e-3
    assert accepted_any > n // 10, "the walk must accept proposals, not only sample bonus tokens"
