"""``mode="auto"`` weighs the decode modes by step costs measured here: the cost model's priors
(swiftspec/spec_decode/mode_choice.py), the choice under injected costs (nothing timed), the rule
where measuring is off, and the measurement end to end on tiny GGUF models (timed, but no
assertion on a time) with its stored result."""
from __future__ import annotations

import json

import pytest
from gguf import GGMLQuantizationType as Q

from swiftspec.engine import config, mode_selection
from swiftspec.model_executor import step_costs
from swiftspec.model_executor.kernel_tuning import model_weights
from swiftspec.model_executor.step_costs import StepCosts, layer_scale, measure_step_costs
from swiftspec.ops import dispatch, tuning
from swiftspec.spec_decode import mode_choice as mc
from swiftspec.spec_decode.ngram import NgramParams
from swiftspec.weights.loader import convert_gguf
from tests.test_loader import make_gguf


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Two tiny GGUF models (target, draft) whose layer-0 projections and LM head have kernels."""
    root = tmp_path_factory.mktemp("mode-choice")
    dirs = []
    for name, seed in (("target", 0), ("draft", 1)):
        make_gguf(root / f"{name}.gguf", quant=Q.Q8_0, seed=seed, tied=False, ffn_up=Q.Q8_0)
        dirs.append(convert_gguf(root / f"{name}.gguf", root / name, progress=False))
    return dirs


@pytest.fixture
def measuring(monkeypatch, tmp_path):
    """Measurement on (only for this test), its files in a fresh directory."""
    if dispatch.cpu_module() is None:
        pytest.skip("the CPU kernels are unavailable")
    monkeypatch.setenv("SWIFTSPEC_KERNEL_TUNING", "1")
    monkeypatch.setenv("SWIFTSPEC_KERNEL_PROFILES", str(tmp_path / "profiles"))
    monkeypatch.delenv("SWIFTSPEC_QUANT_GEMM", raising=False)
    monkeypatch.setattr(mode_selection, "_numa_nodes", lambda: 1)
    return tmp_path / "profiles"


def test_tree_priors_replay_the_recorded_ranks():
    ranks = [[None, 0, 0, 1, None, 0, 0]]  # 6 positions after the prefill's token
    # one-node chain: [rank 0 + bonus], [rank 1: bonus], [None: bonus], [rank 0 + bonus] -> 6 tokens in 4
    assert mc.tree_tokens_per_step(ranks, (1,)) == 6 / 4
    # two-node chain: [0, 0 + bonus], [None: bonus], [0, 0 (the end)] -> 6 tokens in 3
    assert mc.tree_tokens_per_step(ranks, (1, 1)) == 6 / 3
    # the root's two best children: rank 1 is verified too
    assert mc.tree_tokens_per_step([[None, 1, 1, 1, 1]], (2,)) == 2.0
    assert mc.tree_tokens_per_step([[None, 1, 1, 1, 1]], (1,)) == 1.0
    with pytest.raises(ValueError):
        mc.tree_tokens_per_step([[3]], (1,))


def test_catch_up_rows_replay_what_the_draft_has_not_run():
    """The draft's first forward of an iteration runs the verified tokens it has not run: the
    bonus token, plus an accepted proposal it never expanded (a chain's deepest one)."""
    ranks = [[None, 0, 0, 1, None, 0, 0]]
    # one-node chain: [0 + bonus] 2 rows, [bonus] 1, [bonus] 1, [0 + bonus] 2
    assert mc.tree_catch_up_mix(ranks, (1,)) == {1: 0.5, 2: 0.5}
    # two-node chain: [0, 0 + bonus]: the first proposal was expanded, 2 rows; [bonus] 1; [0, 0]
    # (the end, no bonus) 1
    assert mc.tree_catch_up_mix(ranks, (1, 1)) == {1: 2 / 3, 2: 1 / 3}
    assert mc.catch_up_rows(3, 2, 3) == 1 and mc.catch_up_rows(1, 1, 1) == 1 and mc.catch_up_rows(4, 3, 1) == 4


def test_ngram_priors_replay_the_proposer():
    prompt, out = [1, 2, 3, 4, 1, 2], [3, 4, 1, 2, 9]
    # text ...1 2 | 3: "2 3" seen -> propose 4 (right), bonus 1; "4 1" seen -> 2 (right), bonus 9
    tps, mix = mc.ngram_tokens_per_step([(prompt, out)], NgramParams(2, 2, 1))
    assert tps == 2.0 and mix == {2: 1.0}
    tps, mix = mc.ngram_tokens_per_step([([5, 6], [7, 8, 9])], NgramParams(2, 2, 1))
    assert tps == 1.0 and mix == {1: 1.0}  # nothing repeats: plain one-row steps


def test_hybrid_priors_replay_both_chains():
    """A hybrid verification accepts the longer of the draft chain's rank-0 run and the n-gram
    chain's matching run, then the target's token; its rows count both chains, less the rows
    they provably share (both the target's token)."""
    prompt, out = [1, 2, 3, 4, 1, 2], [3, 4, 1, 2, 9]
    texts = [(prompt, out, [None, 5, 0, 0, 0])]
    # root 3: draft misses (rank 5), n-gram "2 3" -> 4 right: 4 + bonus 1, 3 rows (nothing shared);
    # root 1: draft 2 right, n-gram "4 1" -> 2 right (the same row): 2 + bonus 9, 2 rows
    tps, mix, catch_up = mc.hybrid_tokens_per_step(texts, 1, NgramParams(2, 2, 1))
    assert tps == 2.0 and mix == {2: 0.5, 3: 0.5}
    assert catch_up == {2: 1.0}  # the n-gram's 4 + bonus, then the draft's own 2 (never run) + bonus
    assert mc.tree_tokens_per_step([texts[0][2]], (1,)) == 4 / 3  # the draft chain alone: 3 verifications
    # a deeper draft chain than the n-gram's: root 3: draft 4 1, n-gram 4 (shared): 3 tokens, 3 rows;
    # root 2: n-gram "1 2" -> 3 wrong, draft 9 right: the end, 4 rows (1 + 2 draft + 1 chain)
    tps, mix, catch_up = mc.hybrid_tokens_per_step([(prompt, out, [None, 0, 0, 0, 0])], 2, NgramParams(2, 2, 1))
    assert tps == 2.0 and mix == {3: 0.5, 4: 0.5}
    assert catch_up == {1: 0.5, 2: 0.5}  # 4 (expanded) 1 + bonus 2: two rows; the end: one
    with pytest.raises(ValueError, match="depth"):
        mc.hybrid_tokens_per_step(texts, 0, NgramParams(2, 2, 1))


def test_packaged_priors():
    by = {c.label: c for c in mc.priors()}
    assert by["autoregressive"].tokens_per_step == 1.0
    chains = [by[f"serial bs {n + 1} d {n}{' chain' if n > 1 else ''}"].tokens_per_step for n in (1, 2, 3)]
    assert 1.0 < chains[0] < chains[1] < chains[2] < 4.0
    assert by["serial bs 3 d 1 w 2"].tokens_per_step > chains[0]
    for k in mc.NGRAM_TOKENS:
        c = by[f"ngram {k}"]
        assert 1.0 < c.tokens_per_step < 1 + k and abs(sum(c.rows_mix.values()) - 1) < 1e-9
        assert max(c.rows_mix) == k + 1 and c.draft_forwards == 0
    for k in mc.NGRAM_ADAPTIVE_TOKENS:  # from one-token matches, as long as the match
        c = by[f"ngram adaptive {k}"]
        assert c.fields == {"ngram_min": 1, "ngram_tokens": k, "ngram_adaptive": True} and c.draft_forwards == 0
        assert max(c.rows_mix) == k + 1 and abs(sum(c.rows_mix.values()) - 1) < 1e-9
        # one-token matches propose where a two-token lookup finds nothing; each proposal is at
        # most as long as the fixed one of k tokens
        assert c.rows_mix[1] < by[f"ngram {k}"].rows_mix[1]
        assert by["ngram 1"].tokens_per_step < c.tokens_per_step < 1 + k
    for d, k in mc.HYBRID_SHAPES:  # each verification accepts the longer of both chains' runs
        c = by[f"hybrid d {d} ngram {k}"]
        draft_alone = by[f"serial bs {d + 1} d {d}{' chain' if d > 1 else ''}"]
        assert c.tokens_per_step > max(draft_alone.tokens_per_step, by[f"ngram {k}"].tokens_per_step)
        assert c.tokens_per_step < 1 + max(d, k) and abs(sum(c.rows_mix.values()) - 1) < 1e-9
        assert min(c.rows_mix) == 1 + d and max(c.rows_mix) <= 1 + d + k <= mc.HYBRID_ROWS
        assert c.draft_forwards == d and c.fields["hybrid_rows"] == mc.HYBRID_ROWS
        assert abs(sum(c.catch_up_mix.values()) - 1) < 1e-9 and max(c.catch_up_mix) <= 1 + max(d, k)
    for label in ("serial bs 2 d 1", "serial bs 4 d 3 chain"):
        assert set(by[label].catch_up_mix) == {1, 2}  # the bonus, and the deepest proposal when accepted


def _costs(target_ms, draft_ms):
    """Step costs of the target at 1-4 rows and the draft (one cost for 1-4 rows, or one each)."""
    draft_ms = draft_ms if isinstance(draft_ms, tuple) else (draft_ms,) * 4
    return StepCosts({r: t / 1e3 for r, t in zip((1, 2, 3, 4), target_ms)},
                     {r: t / 1e3 for r, t in zip((1, 2, 3, 4), draft_ms)}, "avx2", "stored")


@pytest.mark.parametrize("target_ms, draft_ms, want", [
    ((10, 20, 30, 40), 5, "autoregressive"),  # a row costs as much as a step: nothing pays
    ((10, 10.5, 11, 11.5), 20, "ngram"),  # rows nearly free, the draft dear: proposals without it
    ((10, 10.5, 11, 11.5), 1, "serial"),  # rows nearly free, the draft cheap: the deepest chain
    # two rows cost one, a third 20 % more, the draft at 2/10 of a step: one draft forward a
    # verification beside n-gram rows beats a deeper draft chain (its third row and second
    # forward) and n-gram alone (fewer tokens) by more than the margin
    ((10, 10, 12, 13), 2, "hybrid"),
    ((10, 10.2, 10.4, 10.6), 6, "ngram"),  # rows nearly free, the draft dear: n-gram alone
    # a Zen 4's measured costs, the draft's catch-up forwards over 2-3 rows dearer than one row:
    # n-gram alone is within the margin of every draft mode
    ((30.5, 33.8, 37.7, 42.8), (8.9, 11.0, 13.0, 15.0), "ngram"),
])
def test_measured_costs_decide_auto(monkeypatch, target_ms, draft_ms, want):
    monkeypatch.setattr(mode_selection, "_numa_nodes", lambda: 1)
    mode, why, fields = mode_selection.choose_mode(config.EngineConfig(), True, None, 0, _costs(target_ms, draft_ms))
    assert mode == want and why.startswith("auto, measured here")
    assert f"target 1/2/3/4 rows {'/'.join(f'{t:.1f}' for t in target_ms)} ms" in why
    costs = _costs(target_ms, draft_ms)
    assert f"draft 1/2/3/4 rows {'/'.join(f'{costs.draft_s[r] * 1e3:.1f}' for r in (1, 2, 3, 4))} ms" in why
    assert "avx2" in why
    top, rates = mc.best(mc.priors(), costs.target_s, costs.draft_s)
    assert top.mode == want and fields == top.fields and (f"{top.label} fastest" in why or f"{top.label} picked" in why)
    assert rates[top.label] * (1 + mc.MARGIN) >= max(rates.values()) and f"{top.label} {rates[top.label]:.1f}" in why
    if want == "serial":
        assert fields == {"bs": 4, "d": 3, "w": 1, "topk": 1}
        assert mode_selection.choose_mode(config.EngineConfig(bs=6), True, None, 0, _costs(target_ms, draft_ms))[2] == {}
    if want == "hybrid":
        assert fields == {"bs": 2, "d": 1, "w": 1, "topk": 1, "ngram_tokens": 2, "hybrid_rows": mc.HYBRID_ROWS}
        for own in ({"bs": 6}, {"ngram_tokens": 3}, {"hybrid_rows": 6}):  # a shape the configuration sets wins
            assert mode_selection.choose_mode(config.EngineConfig(**own), True, None, 0,
                                              _costs(target_ms, draft_ms))[2] == {}
    if want == "ngram":
        assert set(fields) <= {"ngram_min", "ngram_tokens", "ngram_adaptive"} and "ngram_tokens" in fields
        for own in ({"ngram_tokens": 2}, {"ngram_min": 3}, {"ngram_adaptive": True}):  # the user's shape wins
            assert mode_selection.choose_mode(config.EngineConfig(**own), True, None, 0,
                                              _costs(target_ms, draft_ms))[2] == {}
    # a stored profile, a dequantized target or a pipeline still decide before the costs
    assert mode_selection.choose_mode(config.EngineConfig(), True, {"mode": "async"}, 0, _costs(target_ms, draft_ms))[0] == "async"
    assert "rule" in mode_selection.choose_mode(config.EngineConfig(), False, None, 0, _costs(target_ms, draft_ms))[1]


def test_a_deeper_candidate_must_win_by_the_margin():
    """A later (deeper) candidate is picked only when expected faster than every simpler one by
    more than MARGIN, not only than the pick so far."""
    a = mc.Candidate("autoregressive", "autoregressive", {}, 1.0, {1: 1.0})
    b = mc.Candidate("serial", "serial b", {"bs": 2, "d": 1}, 1.0, {2: 1.0}, 1)
    target_s, draft_s = {1: 0.100, 2: 0.050}, 0.0475  # b: 1 / 0.0975 s = 2.6 % faster than a
    top, rates = mc.best([a, b], target_s, draft_s)
    assert rates["serial b"] > rates["autoregressive"] and top is a
    top, _ = mc.best([a, b], target_s, 0.040)  # b: 1 / 0.090 s = 11 % faster
    assert top is b
    assert mc.best([a, b], target_s, draft_s, margin=0.0)[0] is b
    # c is 4 % faster than a, d 7.5 % faster than a but 3.4 % faster than c: c, the simplest
    # within the margin of the fastest (d beat a, the pick a step-by-step walk would hold)
    c = mc.Candidate("ngram", "ngram c", {}, 1.04, {1: 1.0})
    d = mc.Candidate("serial", "serial d", {"bs": 2, "d": 1}, 1.075 * 0.0975 / 0.1, {2: 1.0}, 1)
    top, rates = mc.best([a, c, d], target_s, draft_s)
    assert rates["serial d"] > rates["autoregressive"] * (1 + mc.MARGIN) and top is c


def test_the_fastest_target_alone_candidate_needs_no_margin():
    """Among the target-alone candidates (no draft forward) the fastest expected wins outright:
    their difference, the target's rows, is measured whole; a draft mode still has to beat it by
    the margin."""
    a = mc.Candidate("autoregressive", "autoregressive", {}, 1.0, {1: 1.0})
    c = mc.Candidate("ngram", "ngram c", {"ngram_tokens": 1}, 1.02, {1: 1.0})  # 2 % faster than a
    e = mc.Candidate("ngram", "ngram e", {"ngram_tokens": 2}, 1.01, {1: 1.0})
    d = mc.Candidate("serial", "serial d", {"bs": 2, "d": 1}, 1.05 * 0.0975 / 0.1, {2: 1.0}, 1)  # 5 % over a
    target_s, draft_s = {1: 0.100, 2: 0.050}, 0.0475
    top, rates = mc.best([a, c, e, d], target_s, draft_s)
    assert top is c and rates["serial d"] > rates["ngram c"]
    why = mc.measured_reason(top, rates, target_s, {1: draft_s}, "avx2")
    assert "ngram c picked, the fastest of the target alone, within 5% of the fastest (serial d)" in why
    assert mc.best([a, e], target_s, draft_s)[0] is e
    assert mc.best([a, c, e, d], target_s, 0.030)[0] is d  # the draft far cheaper: beats c by more than 5 %


def test_cost_model_rejects_bad_costs():
    c = mc.priors()[-1]
    with pytest.raises(ValueError, match="rows"):
        mc.iteration_seconds(c, {1: 0.01}, 0.001)
    with pytest.raises(ValueError, match="positive"):
        mc.best(mc.priors(), {1: 0.01, 2: 0.0, 3: 0.01, 4: 0.01}, 0.001)


def test_measuring_off_keeps_the_rule(pair, monkeypatch):
    monkeypatch.setenv("SWIFTSPEC_KERNEL_TUNING", "0")
    monkeypatch.setattr(mode_selection, "_numa_nodes", lambda: 1)
    assert measure_step_costs(*pair) is None
    mode, why, _ = mode_selection.choose_mode(config.EngineConfig(), True, None, 0, None)
    assert why.startswith("auto, rule: ")


def test_step_costs_are_measured_at_the_first_starts_then_stored(pair, measuring, monkeypatch):
    target, draft = pair
    n_layers = json.loads((target / "config.json").read_text())["num_hidden_layers"]
    assert n_layers > 1 and layer_scale(target) == pytest.approx(n_layers)  # every layer alike here
    calls = []
    real = tuning.time_rows
    monkeypatch.setattr(tuning, "time_rows", lambda *a, **k: calls.append(a[2]) or real(*a, **k))
    first = measure_step_costs(target, draft, 48)
    assert first.source == "measured here" and len(calls) == 1 and calls[0] == [1, 2, 3, 4]
    assert set(first.target_s) == set(step_costs.TARGET_ROWS) and set(first.draft_s) == set(step_costs.DRAFT_ROWS)
    assert all(v > 0 for v in list(first.target_s.values()) + list(first.draft_s.values()))
    assert first.variant in tuning.variants(dispatch.cpu_module().quant_impls())
    assert first.samples == 1
    # the next starts each add a measurement, up to SAMPLES, and report their mean; then read back
    seen = [first]
    for k in range(2, step_costs.SAMPLES + 1):
        seen.append(measure_step_costs(target, draft, 48))
        assert seen[-1].source == "measured here" and seen[-1].samples == k and len(calls) == k
    stored = json.loads(next(measuring.glob("*.steps.json")).read_text())["samples"]
    assert len(stored) == step_costs.SAMPLES
    for rows in step_costs.TARGET_ROWS:  # each one's own timings, averaged
        assert seen[-1].target_s[rows] == pytest.approx(sum(m["target_s"][str(rows)] for m in stored) / len(stored))
        assert stored[0]["target_s"][str(rows)] == pytest.approx(first.target_s[rows])
    again = measure_step_costs(target, draft, 48)
    assert again.source == "stored" and again.samples == step_costs.SAMPLES and len(calls) == step_costs.SAMPLES
    assert (again.target_s, again.draft_s, again.variant) == (seen[-1].target_s, seen[-1].draft_s, first.variant)
    assert list(measuring.glob("*.steps.json")) and list(measuring.glob("*[0-9a-f].json"))  # beside the tuning profile
    fresh = measure_step_costs(target, draft, 48, remeasure=True)  # starts again from one measurement
    assert fresh.source == "measured here" and fresh.samples == 1 and len(calls) == step_costs.SAMPLES + 1
    assert measure_step_costs(target, draft, 32).samples == 1 and len(calls) == step_costs.SAMPLES + 2  # other shapes


def test_the_reason_names_the_measurements_averaged():
    costs = _costs((30, 33, 37, 42), 9)
    top, rates = mc.best(mc.priors(), costs.target_s, costs.draft_s)
    assert "(linear layers, avx2)" in mc.measured_reason(top, rates, costs.target_s, costs.draft_s, "avx2")
    assert "(linear layers, avx2; mean of 3 measurements)" in mc.measured_reason(
        top, rates, costs.target_s, costs.draft_s, "avx2", samples=3)


def test_forward_seconds_scale_the_layer_and_add_the_head(pair):
    ws = model_weights(pair[0])
    times = [{1: 1.0 if w.name != "lm_head" else 5.0} for w in ws]
    assert step_costs.forward_seconds(ws, times, 3.0) == {1: 3.0 * (len(ws) - 1) + 5.0}
    with pytest.raises(ValueError, match="LM head"):
        step_costs.forward_seconds(ws[:-1], times[:-1], 3.0)


def test_engine_auto_reports_the_measured_choice(pair, measuring):
    """The engine measures before it spawns its workers and says so in every request's metrics."""
    from swiftspec import Engine, SamplingParams

    target, draft = pair
    with Engine(str(target), str(draft), dtype="float32", target_cores=[0], draft_cores=[0],
                cache_dir=measuring.parent / "cache") as e:
        out = e.generate([5, 9, 77, 3], SamplingParams(max_tokens=3, ignore_eos=True))
    assert e.mode_reason.startswith("auto, measured here: target 1/2/3/4 rows")
    assert out.metrics.mode_reason.startswith(e.mode_reason) and e.config.mode in ("autoregressive", "ngram", "serial", "hybrid")
    assert list(measuring.glob("*.steps.json"))


def test_forward_times_never_fall_with_more_rows():
    assert step_costs.monotone({1: 5.0, 2: 3.0, 3: 4.0, 4: 6.0}) == {1: 3.0, 2: 3.0, 3: 4.0, 4: 6.0}
    assert step_costs.monotone({1: 1.0, 4: 2.0}) == {1: 1.0, 4: 2.0}


def test_time_rows_cycles_through_the_weights(pair):
    """Each pass calls every weight once per row count (a weight is called again only after all
    the others), a warm-up pass first; every time is a positive number of seconds."""
    m = dispatch.cpu_module()
    if m is None:
        pytest.skip("the CPU kernels are unavailable")
    calls = []

    class Counting:
        def quant_linear(self, x, parts, types, impl):
            calls.append((x.shape[0], tuple(p.data_ptr() for p in parts)))
            return m.quant_linear(x, parts, types, impl)

    ws = model_weights(pair[0])
    out = tuning.time_rows(Counting(), ws, [1, 3], 0, reps=2)
    assert len(out) == len(ws) and all(set(t) == {1, 3} and min(t.values()) > 0 for t in out)
    assert len(calls) == 3 * 2 * len(ws)
    weights_seen = [c[1] for c in calls]
    assert weights_seen[:len(ws)] == weights_seen[len(ws):2 * len(ws)] and len(set(weights_seen[:len(ws)])) == len(ws)
    assert [c[0] for c in calls[:2 * len(ws)]] == [1] * len(ws) + [3] * len(ws)
    with pytest.raises(ValueError, match="positive"):
        tuning.time_rows(Counting(), ws, [0], 0)


def test_time_rows_keeps_the_least_pass_after_the_warm_up(pair, monkeypatch):
    """A scripted clock (nothing timed): the warm-up pass's calls are the quickest and ignored,
    each weight's time is its quickest later pass."""
    ws = model_weights(pair[0])
    clock, calls = [0.0], []
    per_pass = (1e-4, 2e-3, 3e-3)  # warm-up, pass 1, pass 2: seconds each call takes

    class Scripted:
        def quant_linear(self, x, parts, types, impl):
            clock[0] += per_pass[len(calls) // (2 * len(ws))]
            calls.append(x.shape[0])

    monkeypatch.setattr(tuning.time, "perf_counter", lambda: clock[0])
    out = tuning.time_rows(Scripted(), ws, [1, 2], 0, reps=2)
    assert out == [{1: pytest.approx(2e-3), 2: pytest.approx(2e-3)}] * len(ws)


def test_the_new_tree_shapes_run_and_keep_the_targets_tokens(pair):
    """The serial trees only the cost model picks (a one-leaf chain, the root's two-child fan) run
    on the engine and give the target's own greedy tokens (the others: tests/test_engine.py, test_ngram.py)."""
    from swiftspec import Engine, SamplingParams

    target, draft = pair
    prompt, params = [5, 9, 77, 3, 5, 9, 77], SamplingParams(max_tokens=12, ignore_eos=True)
    with Engine(str(target), mode="autoregressive", dtype="float32", target_cores=[0]) as e:
        want = e.generate(prompt, params).token_ids
    for c in mc.priors():
        if c.label not in ("serial bs 4 d 3 chain", "serial bs 3 d 1 w 2"):
            continue
        with Engine(str(target), str(draft), mode=c.mode, dtype="float32", target_cores=[0], draft_cores=[0],
                    draft_payback=False, **c.fields) as e:
            assert e.generate(prompt, params).token_ids == want, c.label


def test_a_configured_hybrid_takes_its_shape_from_the_measured_costs():
    """``mode="hybrid"`` without a shape of its own runs the hybrid shape the cost model expects
    fastest here (a draft chain and n-gram tokens within 4 rows), not the tree defaults sized for
    a GPU (bs 8, w 2); with a shape of its own, float weights or no measurement, as configured."""
    hybrid = config.EngineConfig(mode="hybrid")
    for target_ms, draft_ms in (((10, 10, 11, 11), 3), ((30.5, 33.8, 37.7, 42.8), (8.9, 11.0, 13.0, 15.0))):
        costs = _costs(target_ms, draft_ms)  # the second: auto would run ngram; hybrid stays hybrid
        top, _ = mc.best([c for c in mc.priors() if c.mode == "hybrid"], costs.target_s, costs.draft_s)
        mode, why, fields = mode_selection.choose_mode(hybrid, True, None, 0, costs)
        assert mode == "hybrid" and fields == top.fields and fields["hybrid_rows"] == mc.HYBRID_ROWS
        assert why.startswith("hybrid as configured, its shape, measured here") and top.label in why
    costs = _costs((10, 10, 11, 11), 3)
    for cfg, native, c in ((config.EngineConfig(mode="hybrid", bs=6), True, costs),
                           (config.EngineConfig(mode="hybrid", ngram_tokens=3), True, costs),
                           (hybrid, True, None), (hybrid, False, costs),
                           (config.EngineConfig(mode="serial"), True, costs)):
        assert mode_selection.choose_mode(cfg, native, None, 0, c) == (cfg.mode, "as configured", {})
