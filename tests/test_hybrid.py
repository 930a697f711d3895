"""The hybrid mode (swiftspec/spec_decode/hybrid.py): the draft's subgraph and the n-gram chain in
one verification batch: the merge, the row budget, losslessness (greedy and sampled), the draft's
catch-up after accepted chain rows, and the configuration."""
from collections import Counter

import pytest
import torch

from swiftspec.engine.config import EngineConfig
from swiftspec.model_executor.runner import ModelRunner, RunnerHandle
from swiftspec.model_executor.sampling import SamplingParams
from swiftspec.spec_decode import target_loops
from swiftspec.spec_decode.draft_state import DraftState, TreeParams
from swiftspec.spec_decode.hybrid import CHAIN_WEIGHT, hybrid_subgraph, merge_chain, run_hybrid
from swiftspec.spec_decode.ngram import NgramParams, NgramProposer
from swiftspec.spec_decode.payback import PaybackGate
from swiftspec.spec_decode.scheduler import Request
from swiftspec.spec_decode.target_state import TargetState, ancestor_mask
from swiftspec.spec_decode.tree import Subgraph

PROMPT = [3, 40, 41, 42, 50, 60, 70, 33, 34, 35]
N = 40


def _target(model_dir):
    return TargetState(RunnerHandle("target", ModelRunner(str(model_dir), capacity=512), []))


def _draft(model_dir, **kw):
    d = DraftState(RunnerHandle("draft", ModelRunner(str(model_dir), capacity=1024), []), TreeParams(**kw))
    d.debug = True  # the tree's cache invariants are checked after every expansion and re-root
    return d


def _collect():
    out = []
    return out, lambda toks, t, lps=(): out.extend(toks)


def _req(prompt, n=N, params=None, d=None, trace=False):
    return Request(prompt, params or SamplingParams(max_tokens=n, ignore_eos=True), n, (2,), d, trace)


def _ngram(tokens, min_n=2):
    return lambda ids: NgramProposer(NgramParams(min_n, 4, tokens), ids)


def _greedy(target, prompt, n=N):
    out, emit = _collect()
    target_loops.run_autoregressive(target, _req(prompt, n), emit)
    return out


class _Oracle:
    """A deterministic chain proposer: ``best(generated tokens)`` is its chain (the tokens after
    the prompt so far, the first token included)."""

    def __init__(self, best, prompt_len, ids):
        self.best, self.text, self.prompt_len = best, list(ids), prompt_len

    def propose(self):
        return list(self.best(self.text[self.prompt_len:]))

    def extend(self, toks):
        self.text.extend(toks)


@pytest.fixture(scope="module")
def copying_dir(tmp_path_factory, tiny_dir):
    """The tiny target with its attention outputs zeroed: each next token depends on the last
    token alone, so its greedy text falls into a cycle (the text repeats its context), which
    prompt lookup then proposes."""
    from conftest import build_tokenizer
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("tiny-copying")
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "o_proj" in name:
                p.zero_()
    model.save_pretrained(out, safe_serialization=True)
    build_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def models(tiny_dir, copying_dir):
    """The targets shared by the module: ``plain`` (the tiny model) and ``cycle`` (its copying variant)."""
    return {"plain": _target(tiny_dir), "cycle": _target(copying_dir)}


@pytest.fixture(scope="module")
def prompts(models):
    """``plain``: PROMPT; ``cycle``: PROMPT and the copying target's first 20 greedy tokens after it
    (one turn of its cycle, so prompt lookup finds the continuation in the prompt)."""
    return {"plain": PROMPT, "cycle": PROMPT + _greedy(models["cycle"], PROMPT, 20)}


@pytest.fixture(scope="module")
def references(models, prompts):
    """The target's own greedy output (autoregressive) for each prompt."""
    return {k: _greedy(models[k], prompts[k]) for k in models}


def test_merge_chain_shares_coinciding_nodes_and_adds_the_rest():
    # root r=1; children 5 (row 1), 6 (row 2); 5 -> 7 (row 3)
    sg = Subgraph([1, 5, 6, 7], [-1, 0, 0, 1], [0, 1, 1, 2], [0.0, -0.1, -0.2, -0.3])
    same, added = merge_chain(sg, [5, 7])
    assert added == [] and same.tokens == sg.tokens and same.parents == sg.parents
    merged, added = merge_chain(sg, [5, 7, 9, 5])
    assert added == [4, 5]
    assert merged.tokens == [1, 5, 6, 7, 9, 5] and merged.parents == [-1, 0, 0, 1, 3, 4]
    assert merged.depths == [0, 1, 1, 2, 3, 4] and merged.weights[4:] == [CHAIN_WEIGHT] * 2
    # once off the subgraph the chain never rejoins it (row 5's token 5 is not row 1)
    diverge, added = merge_chain(sg, [6, 7])
    assert added == [4] and diverge.parents[4] == 2 and diverge.depths[4] == 2
    # each chain row sees the prefix, its ancestors and itself, like any tree node
    mask = ancestor_mask(merged.parents, 3)
    assert mask[5].tolist() == [True] * 3 + [True, True, False, True, True, True]
    assert sg.tokens == [1, 5, 6, 7], "the draft's subgraph is not modified"


def test_hybrid_subgraph_keeps_rows_within_the_budget():
    full = Subgraph([1, 5, 7, 8], [-1, 0, 1, 2], [0, 1, 2, 3])  # a draft chain, heaviest first

    def top(k):
        return Subgraph(full.tokens[:k], full.parents[:k], full.depths[:k])

    sg, added = hybrid_subgraph(top, [9, 9, 9, 9, 9], bs=4, max_rows=4)
    assert len(sg) == 4 and sg.tokens == [1, 9, 9, 9] and added == [1, 2, 3]  # chain cut to 3, draft: root
    sg, added = hybrid_subgraph(top, [5, 7, 3], bs=4, max_rows=4)  # shares two draft rows
    assert sg.tokens == [1, 5, 7, 3] and added == [3]
    sg, added = hybrid_subgraph(top, [], bs=4, max_rows=3)
    assert sg.tokens == [1, 5, 7] and added == []
    sg, added = hybrid_subgraph(top, [6], bs=2, max_rows=8)
    assert sg.tokens == [1, 5, 6] and added == [2]
    with pytest.raises(ValueError):
        hybrid_subgraph(top, [6], bs=2, max_rows=0)


@pytest.mark.parametrize("case,bs,tokens,rows", [("plain", 4, 3, 4), ("cycle", 4, 3, 4), ("cycle", 2, 4, 6),
                                                 ("cycle", 8, 1, 4)])
def test_greedy_equals_autoregressive(models, prompts, references, tiny_draft_dir, case, bs, tokens, rows):
    out, emit = _collect()
    st = run_hybrid(_draft(tiny_draft_dir, bs=bs, w=2, topk=2), models[case], _req(prompts[case], trace=True), emit,
                    _ngram(tokens), rows)
    assert out == references[case]
    assert all(len(it["subgraph"]) <= rows for it in st.trace)
    assert st.verifications == len(st.accepted)
    if case == "cycle":
        assert st.chain_rows > 0 and st.chain_accepted > 0, "prompt lookup's chain must be verified and accepted"


def test_greedy_with_accepted_chain_rows_on_an_attending_target(models, references, tiny_draft_dir):
    """Chain rows that attend to the prefix and their ancestors (positions and mask as tree
    nodes): an oracle chain (the target's own continuation, 3 tokens) accepted beside a
    perturbed draft's subgraph leaves the output the target's own."""
    ref = references["plain"]
    out, emit = _collect()
    st = run_hybrid(_draft(tiny_draft_dir, bs=3, w=2, topk=2), models["plain"], _req(PROMPT, trace=True), emit,
                    lambda ids: _Oracle(lambda gen: ref[len(gen):len(gen) + 3], len(PROMPT), ids), 4)
    assert out == ref
    assert st.chain_accepted > st.verifications // 2


def _greedy_draft_chain(sg):
    """Length of the chain of most probable draft children inside the subgraph (chain rows,
    which the draft did not propose, left out)."""
    node, n = 0, 0
    while True:
        kids = [i for i, p in enumerate(sg.parents) if p == node and sg.weights[i] != CHAIN_WEIGHT]
        if not kids:
            return n
        node = max(kids, key=lambda i: sg.weights[i])
        n += 1


def test_identical_draft_accepts_its_chain_and_catches_up(models, references, tiny_dir):
    """With the target as its own draft every draft node on the greedy path is accepted, also
    after iterations whose accepted path ran through chain rows the draft never ran (an oracle
    chain of the target's own next 3 tokens, deeper than the draft's 2-node subgraph): the draft
    caught up on them (its KV holds the verified text), else its next proposals would miss."""
    ref = references["plain"]
    draft = _draft(tiny_dir, bs=2, w=2, topk=2)
    out, emit = _collect()
    roots = []
    real_reroot = draft.reroot

    def reroot(verified):
        r = real_reroot(verified)
        roots.append((draft.tree.root_position, len(PROMPT) + len(out) - 1))
        return r

    draft.reroot = reroot
    st = run_hybrid(draft, models["plain"], _req(PROMPT, d=1, trace=True), emit,
                    lambda ids: _Oracle(lambda gen: ref[len(gen):len(gen) + 3], len(PROMPT), ids), 4)
    assert out == ref
    assert roots and all(a == b for a, b in roots), "the draft's root sits at the last verified token"
    budget_cut = len(st.trace) - 1
    for i, it in enumerate(st.trace[:budget_cut]):
        assert len(it["accepted"]) >= _greedy_draft_chain(it["subgraph"]) >= 1, f"iteration {i}"
    assert st.chain_accepted > 0
    assert draft.misses > 0, "accepted chain rows the tree lacks re-root it on pending tokens (a catch-up)"


def test_sampled_output_follows_target_distribution(models, tiny_dir, tiny_draft_dir):
    """Joint distribution of the first three tokens (t0 from prefill, t1 and t2 from one
    verification over draft and chain rows) against the exact target distribution: chi-square."""
    from distributions import chi_square_pvalue, exact_first_tokens

    from swiftspec.model_executor.models import load_model

    params = dict(temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True)
    exact = exact_first_tokens(load_model(tiny_dir), PROMPT, params)
    best = {}  # t0 -> the most likely (t1, t2) after it
    for (a, b, c), p in exact.items():
        if p > best.get((a,), (None, 0.0))[1]:
            best[(a,)] = ((b, c), p)
    best = {k: v[0] for k, v in best.items()}
    draft = _draft(tiny_draft_dir, w=2, topk=2, bs=2)
    n, counts, chain_hits = 800, Counter(), 0
    for seed in range(n):
        out, emit = _collect()
        st = run_hybrid(draft, models["plain"], Request(PROMPT, SamplingParams(**params, seed=seed), 3, (), 1), emit,
                        lambda ids: _Oracle(lambda gen: best.get(tuple(gen), ()), len(PROMPT), ids), 4)
        counts[tuple(out)] += 1
        chain_hits += st.chain_accepted > 0
    assert chi_square_pvalue(counts, exact) > 1e-3
    assert chain_hits > n // 10, "the walk must descend into chain rows, not only the draft's"


@pytest.mark.parametrize("bad", [1, 0, -3, 2.5, "4", True, None])
def test_bad_hybrid_rows_raise(bad):
    with pytest.raises(ValueError, match="hybrid_rows"):
        EngineConfig(mode="hybrid", hybrid_rows=bad)


def _gate(speculate: bool) -> PaybackGate:
    """A payback gate that speculates (nothing measured yet) or, with a draft prefill measured at
    a million times the target's, finds that the draft never pays back."""
    gate = PaybackGate()
    if not speculate:
        gate.observe_prefill(1.0, 1.0)  # a worker's first prefill: not used
        gate.observe_prefill(1e-3, 1e3)
    return gate


@pytest.mark.parametrize("speculate", [False, True])
def test_payback_gate_falls_back_to_the_ngram_chain(models, prompts, references, tiny_draft_dir, speculate):
    """hybrid behind serial's payback gate: where the draft does not pay, the draft never runs and
    the target verifies prompt-lookup chains alone (ran "ngram", chain tokens accepted); where it
    does, the draft prefills after the target's one step alone; greedy output is the target's either way."""
    runner = ModelRunner(str(tiny_draft_dir), capacity=1024)
    draft = DraftState(RunnerHandle("draft", runner, []), TreeParams(bs=4, w=2, topk=2))
    draft.debug = True
    gate = _gate(speculate)
    out, emit = _collect()
    st = run_hybrid(draft, models["cycle"], _req(prompts["cycle"]), emit, _ngram(3), 4, gate=gate)
    assert out == references["cycle"]
    if speculate:
        assert not st.ran and runner.forwards > 0 and st.chain_rows > 0
        assert gate.sigma is not None, "a speculating request measures its speed for the gate"
    else:
        assert st.ran == "ngram" and "would not pay back" in st.ran_reason
        assert runner.forwards == 0, "the draft must not run where it does not pay"
        assert sum(st.accepted) > 0, "the fallback verifies the n-gram chains, not one token a step"
    EngineConfig(mode="hybrid", draft_payback=True)  # the gate is the hybrid mode's too


def test_config_and_worker_rows():
    from swiftspec.engine.worker import WorkerSpec

    cfg = EngineConfig(mode="hybrid", bs=2, ngram_tokens=5, hybrid_rows=6)
    spec = WorkerSpec(cfg, 0, 1, 0, [[0]], 0, {}, "hybrid")
    assert spec.verify_rows == 6  # bs + chain rows (7) cut to hybrid_rows
    assert WorkerSpec(cfg, 0, 1, 0, [[0]], 0, {}, "serial").verify_rows == 6  # max(bs, tokens + 1)
    cfg = EngineConfig(mode="hybrid", bs=8, ngram_tokens=3, hybrid_rows=16)
    assert WorkerSpec(cfg, 0, 1, 0, [[0]], 0, {}, "hybrid").verify_rows == 11
    # the rows of the mode that runs, not the draft tree's where no tree is verified: the target
    # alone verifies its root, ngram its chain, hybrid at most hybrid_rows (the rows the kernel
    # self-tuning times and the KV cache and CUDA graphs are sized for)
    cfg = EngineConfig(mode="hybrid", ngram_tokens=2)
    assert cfg.tree_params().bs == 8 and cfg.hybrid_rows == 4
    assert WorkerSpec(cfg, 0, 1, 0, [[0]], 0, {}, "hybrid").verify_rows == 4
    assert WorkerSpec(cfg, 0, 1, 0, [[0]], 0, {}, "ngram").verify_rows == 3
    assert WorkerSpec(cfg, 0, 1, 0, [[0]], 0, {}, "autoregressive").verify_rows == 1
    assert WorkerSpec(cfg, 0, 1, 0, [[0]], 0, {}, "pipedec").verify_rows == 8  # not a registered mode: the default
    EngineConfig(mode="serial", hybrid_rows=1)  # only the hybrid mode reads (and checks) the field


def test_cli_sets_the_mode_and_its_rows():
    import argparse

    from swiftspec.entrypoints.cli import _add_engine_args, engine_kwargs

    parser = argparse.ArgumentParser()
    _add_engine_args(parser)
    kw = engine_kwargs(parser.parse_args(["--mode", "hybrid", "--hybrid-rows", "3"]))
    assert kw == {"mode": "hybrid", "hybrid_rows": 3} and EngineConfig(**kw).hybrid_rows == 3


def test_engine_runs_hybrid(copying_dir, tiny_draft_dir, prompts, references):
    """The mode through the engine's worker processes: the target's greedy tokens, and the
    metrics count the chain's accepted rows."""
    from swiftspec import Engine

    with Engine(copying_dir, tiny_draft_dir, mode="hybrid", dtype="float32", ngram_tokens=3) as eng:
        out = eng.generate(prompts["cycle"], SamplingParams(max_tokens=N, ignore_eos=True))
    assert out.token_ids == references["cycle"]
    m = out.metrics
    assert m.mode == "hybrid" and m.target["chain_rows"] > 0 and m.target["chain_accepted"] > 0
    assert m.verifications == sum(m.accepted_hist.values())

