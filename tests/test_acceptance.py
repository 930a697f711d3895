"""Acceptance traces (record, replay) and random-weight models: the GPU benchmark's CPU-side parts."""
import json

import pytest
import torch

from swiftspec.model_executor.sampling import Sampler, SamplingParams
from swiftspec.spec_decode import acceptance
from swiftspec.spec_decode.verify import replayed_token, walk

GREEDY = Sampler(SamplingParams(temperature=0.0))


def test_replayed_token_takes_the_recorded_rank_else_a_token_outside_the_candidates():
    assert replayed_token([7, 3, 9], 1, own=5) == 3
    assert replayed_token([7, 3, 9], None, own=5) == 5  # absent: the target's own token, not a candidate
    assert replayed_token([7, 3, 9], 3, own=5) == 5  # the tree holds no candidate of that rank
    assert replayed_token([0, 1, 9], None, own=1) == 2  # own is a candidate: the smallest id that is not
    assert replayed_token([], 0, own=4) == 4


def test_walk_replays_ranks_along_the_accepted_path():
    # root 10 -> children 20 (rank 0), 21 (rank 1); 21 -> 30 (rank 0)
    tokens, parents = [10, 20, 21, 30], [-1, 0, 0, 2]
    argmax = torch.tensor([99, 98, 97, 96])  # the models' own choices: never candidates here
    res = walk(tokens, parents, argmax, GREEDY, replay=[1, 0, 0])
    assert res.accepted == [2, 3] and res.tokens == [21, 30, 96]  # rank 1, rank 0, then nothing below 30
    res = walk(tokens, parents, argmax, GREEDY, replay=[None, 0])
    assert res.accepted == [] and res.tokens == [99]
    # candidates from the whole tree: rank 2 of the root is outside the subgraph, so it is the bonus
    res = walk(tokens, parents, argmax, GREEDY, replay=[2], candidates=[[20, 21, 22], [], [30], []])
    assert res.accepted == [] and res.tokens == [22]
    with pytest.raises(ValueError, match="argmax rows"):
        walk(tokens, parents, torch.zeros(4, 8), GREEDY, replay=[0])


def _trace_of(engine_ar, draft_dir, prompts, n):
    """The acceptance trace of the tiny pair (target tokens from the autoregressive engine)."""
    params = SamplingParams(max_tokens=n, ignore_eos=True)
    runs = [("p", engine_ar.encode(p, False), engine_ar.generate(p, params).token_ids) for p in prompts]
    from swiftspec.benchmark.replay import record

    return record(runs, draft_dir, "float32", "int8", None)


@pytest.mark.parametrize("mode", ["serial", "async", "colocated"])
def test_replaying_a_pairs_own_trace_gives_its_output_and_its_acceptance(tiny_dir, tiny_draft_dir, mode):
    """Ranks recorded teacher-forced from the pair itself: replaying them makes every walk pick
    the target's own token, so the output equals the target's and each verification accepts what
    it accepts without the replay (a mismatch in either would mean the ranks or the candidates'
    order are wrong)."""
    from swiftspec.engine.config import EngineConfig
    from swiftspec.engine.llm_engine import Engine

    prompts = ["count: 1 2 3", "abc abc abc", "hello"]
    with Engine(tiny_dir, None, config=EngineConfig(mode="autoregressive", dtype="float32")) as ar:
        entries = _trace_of(ar, tiny_draft_dir, prompts, 24)
    assert any(r is not None for e in entries for r in e["ranks"][1:])
    doc = {"profile": acceptance.profile(entries)}
    with Engine(tiny_dir, tiny_draft_dir, config=EngineConfig(mode=mode, dtype="float32", d=2)) as eng:
        for e in entries:
            params = SamplingParams(max_tokens=len(e["tokens"]), ignore_eos=True)
            plain = eng.generate(e["prompt_ids"], params, trace=True)
            replayed = eng.generate(e["prompt_ids"], params, replay=e["ranks"], trace=True)
            assert replayed.token_ids == plain.token_ids == e["tokens"]
            if mode != "async":  # async's trees depend on timing; serial and colocated (on CPU) do not
                assert replayed.metrics.compression_ratio == plain.metrics.compression_ratio
            # the tree grown with the recorded log-probabilities (its shape may differ): same tokens
            shaped = eng.generate(e["prompt_ids"], params, replay=acceptance.Replay.of(doc, e))
            assert shaped.token_ids == e["tokens"]


def test_recorded_log_probabilities_shape_the_tree_on_the_recorded_path_only():
    from swiftspec.spec_decode.tree import DraftTree

    r = acceptance.Replay((None, 1, 0, None), ((0.0,), (-0.1, -2.0), (-0.5, -1.0, -3.0), (-0.2, -0.3)),
                          (-1.0, -2.0, -3.0))
    assert r.child_logprobs(0, [], 2) == [-0.1, -2.0]  # the root (index 0): its children are token 1
    assert r.child_logprobs(0, [1], 3) == [-0.5, -1.0, -3.0]  # rank 1 at index 1 is on the path
    assert r.child_logprobs(0, [0], 3) == [-1.0, -2.0, -3.0]  # off the path: the profile
    assert r.child_logprobs(0, [1, 0], 3) == [-0.2, -0.3, float("-inf")]  # kept values end: -inf
    assert r.child_logprobs(0, [1, 0, 0], 2) == [-1.0, -2.0]  # index 3 is absent: nothing on the path
    assert acceptance.Replay((0, 0)).child_logprobs(0, [], 2) is None
    t = DraftTree(5, 3)
    exp = t.plan_expansion(1)
    t.add_children(exp, torch.tensor([[-0.1, -0.5, -0.9]]), torch.tensor([[7, 8, 9]]))
    assert [t.path_ranks(n) for n in range(4)] == [[], [0], [1], [2]]


def test_replay_on_other_models_accepts_exactly_the_recorded_ranks(tiny_dir, tiny_llama_dir):
    """Draft and target unrelated (random tiny models): with every rank 0 recorded, each walk
    accepts the first child at each node down the subgraph and never anything else; with every
    rank absent, nothing is accepted (compression 1)."""
    from swiftspec.engine.config import EngineConfig
    from swiftspec.engine.llm_engine import Engine

    with Engine(tiny_dir, tiny_llama_dir, config=EngineConfig(mode="serial", dtype="float32")) as eng:
        ids = eng.encode("xyz", False)
        params = SamplingParams(max_tokens=30, ignore_eos=True)
        out = eng.generate(ids, params, replay=[0] * 30, trace=True)
        assert len(out.token_ids) == 30 and out.metrics.compression_ratio > 1.5
        steps = out.metrics.target["trace"]
        for k, step in enumerate(steps):
            sg, node = step["subgraph"], 0
            for a in step["accepted"]:
                assert sg.parents[a] == node and a == min(i for i, p in enumerate(sg.parents) if p == node)
                node = a
            if k < len(steps) - 1:  # (the last one stops at the token budget)
                assert not any(p == node for p in sg.parents)  # stopped only where no child remained
        none = eng.generate(ids, params, replay=[None] * 30)
        assert none.metrics.compression_ratio == 1.0 and len(none.token_ids) == 30


def test_replay_refuses_sampled_requests(tiny_dir):
    from swiftspec.engine.config import EngineConfig
    from swiftspec.engine.llm_engine import Engine

    with Engine(tiny_dir, tiny_dir, config=EngineConfig(mode="serial", dtype="float32")) as eng:
        with pytest.raises(ValueError, match="greedy"):
            eng.generate("ab", SamplingParams(temperature=0.7, max_tokens=4), replay=[0, 0, 0, 0])
        assert eng.generate("ab", SamplingParams(max_tokens=3)).token_ids  # the engine still serves


def test_trace_file_round_trip_and_errors(tmp_path):
    entries = [{"dataset": "qa", "prompt_ids": [1, 2], "tokens": [5, 6, 7], "ranks": [None, 0, 3]}]
    path = tmp_path / "t.json"
    acceptance.save(path, entries, target="t", draft="d", dtype="float32")
    doc = acceptance.load(path)
    assert doc["prompts"] == entries and doc["k"] == acceptance.RANKS_K and doc["target"] == "t"
    assert acceptance.summary(doc) == {"positions": 2, "top1": 0.5, "top4": 1.0}
    assert [p.name for p in tmp_path.iterdir()] == ["t.json"]  # no temporary file left
    with pytest.raises(acceptance.TraceError, match="no acceptance trace"):
        acceptance.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(acceptance.TraceError, match="not a readable JSON"):
        acceptance.load(tmp_path / "bad.json")
    (tmp_path / "bad.json").write_text(json.dumps({"version": 1, "prompts": [{**entries[0], "ranks": [0]}]}))
    with pytest.raises(acceptance.TraceError, match="prompt 0 is malformed"):
        acceptance.load(tmp_path / "bad.json")
    (tmp_path / "bad.json").write_text(json.dumps({"version": 99, "prompts": entries}))
    with pytest.raises(acceptance.TraceError, match="version"):
        acceptance.load(tmp_path / "bad.json")


def test_shipped_trace_is_the_default_pairs():
    """The trace the GPU benchmark replays: the six datasets, the default pair, ranks in range."""
    from swiftspec.benchmark.records import DATASETS
    from swiftspec.benchmark.replay import PACKAGED_TRACE

    doc = acceptance.load(PACKAGED_TRACE)
    assert {p["dataset"] for p in doc["prompts"]} == set(DATASETS)
    assert "1.5b" in doc["target"].lower() and "0.5b" in doc["draft"].lower()
    assert all(r is None or r < doc["k"] for p in doc["prompts"] for r in p["ranks"])
    assert len(doc["profile"]) == acceptance.LOGPROBS_K and doc["profile"] == sorted(doc["profile"], reverse=True)
    assert all(len(row) == acceptance.LOGPROBS_K for p in doc["prompts"] for row in p["logprobs"])
    s = acceptance.summary(doc)
    assert s["positions"] > 1000 and 0.3 < s["top1"] < 1.0


def test_bench_records_a_trace_and_replays_it_on_random_weights(tiny_dir, tiny_draft_dir, tmp_path, monkeypatch):
    """`swiftspec bench --record-trace` on a pair, then `--random-weights --acceptance` on models of
    other shapes: every system generates the trace's token count, equality is "n/a" (the tokens
    are not a target's), SwiftSpec's compression follows the trace, the table says so."""
    from swiftspec.benchmark.e2e import main
    from swiftspec.weights import random_weights  # the random checkpoints go to this test's directory

    monkeypatch.setattr(random_weights, "cache_root", lambda cache_dir=None: tmp_path / "cache")
    trace = tmp_path / "trace.json"
    common = ["--prompts", "qa", "humaneval", "--num-prompts", "1", "--max-tokens", "12", "--dtype", "float32",
              "--device", "cpu", "--json"]
    assert main(["--target", str(tiny_dir), "--draft", str(tiny_draft_dir), "--systems", "autoregressive",
                 "swiftspec-serial", "--record-trace", str(trace), *common]) == 0
    doc = acceptance.load(trace)
    assert [p["dataset"] for p in doc["prompts"]] == ["qa", "humaneval"] and doc["draft_vocab"] > 0
    assert all(len(p["tokens"]) == len(p["ranks"]) for p in doc["prompts"])
    from test_random_weights import tiny_config

    cfg = tiny_config(tmp_path)
    out = tmp_path / "out"
    assert main(["--random-weights", "--acceptance", str(trace), "--target-config", str(cfg), "--draft-config",
                 str(cfg), "--systems", "autoregressive", "swiftspec-serial", "hf", "--degrade", "0", "1",
                 "--out", str(out), *[a for a in common if a != "--json"]]) == 0
    recs = json.loads((out / "e2e.json").read_text())["records"]
    # p = 1 runs the one system that replays a draft's acceptance, again on the loaded engine
    degraded = [r for r in recs if r["degrade_p"] == 1]
    assert {r["system"] for r in degraded} == {"swiftspec-serial[p=1]"} and len(degraded) == 2
    recs = [r for r in recs if r["degrade_p"] == 0]
    assert len(recs) == 6 and all(r["replayed"] and r["matches_target"] is None for r in recs)
    # every rank one down: no longer the recorded pair's acceptance, and never more of it
    for r in degraded:
        same = next(x for x in recs if x["system"] == "swiftspec-serial" and x["dataset"] == r["dataset"])
        assert r["num_tokens"] == same["num_tokens"] and r["compression_ratio"] <= same["compression_ratio"]
    by = {(r["system"], r["dataset"]): r for r in recs}
    for p in doc["prompts"]:
        assert all(by[(s, p["dataset"])]["num_tokens"] == len(p["tokens"]) for s in ("autoregressive", "hf",
                                                                                    "swiftspec-serial"))
    assert "acceptance replayed from trace.json" in (out / "e2e.md").read_text()
    assert "| n/a |" in (out / "e2e.md").read_text()
    for bad in (["--random-weights", "--systems", "hf-assisted"], ["--acceptance", str(trace)],
                ["--random-weights", "--record-trace", str(trace)], ["--record-trace", str(trace), "--systems", "hf"],
                ["--degrade", "0.3"], ["--random-weights", "--degrade", "1.5"], ["--random-weights", "--degrade", "0", "0"]):
        with pytest.raises(ValueError):
            main([*bad, *common])
