"""Self-tuning of the quantized GEMM (swiftspec/ops/tuning.py): the profile's key, a corrupt
profile, and a measured non-rule variant reaching the engine's workers (timings injected: the
timing function is replaced, nothing is timed). Tiny GGUFs written by tests/test_loader.py's
make_gguf."""
from __future__ import annotations

import json

import pytest
from gguf import GGMLQuantizationType as Q

from swiftspec import ops
from swiftspec.model_executor.kernel_tuning import layout_rows, model_weights, tune_kernels
from swiftspec.ops import dispatch, tuning
from swiftspec.weights.loader import convert_gguf
from tests.test_loader import make_gguf


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("tuning")
    make_gguf(root / "tiny.gguf", quant=Q.Q8_0, seed=0, tied=False, ffn_up=Q.Q8_0)
    return convert_gguf(root / "tiny.gguf", root / "tiny", progress=False)


@pytest.fixture
def ext():
    m = dispatch.cpu_module()
    if m is None:
        pytest.skip("the CPU kernels are unavailable")
    before = tuning.current_variant(m), dispatch._state["quant_source"]
    yield m
    ops.set_quant_variant(*before)


@pytest.fixture
def tuning_on(monkeypatch, tmp_path):
    """Tuning enabled, profiles in a fresh directory (the engine's workers inherit both)."""
    monkeypatch.setenv("SWIFTSPEC_KERNEL_TUNING", "1")
    monkeypatch.setenv("SWIFTSPEC_KERNEL_PROFILES", str(tmp_path / "profiles"))
    monkeypatch.delenv("SWIFTSPEC_QUANT_GEMM", raising=False)
    return tmp_path / "profiles"


def _group(variant: str) -> int:
    """The interleave group the model's weights take under ``variant`` (1: the file's layout)."""
    ops.set_quant_variant(variant, "set")
    return ops.quant_interleave_rows() or 1


def _inject(monkeypatch, m, winner: str) -> list[str]:
    """Replace the timing function: ``winner`` takes 1 ms, every other variant 5 ms; returns the
    list of variants timed (grows with each measurement)."""
    timed: list[str] = []

    def fake(mod, variant, weights, rows, group, reps=3, stop_after=float("inf")):
        assert mod is m and weights and rows and group in (0, 8, 16)
        timed.append(variant)
        return 1e-3 if variant == winner else 5e-3

    monkeypatch.setattr(tuning, "time_variant", fake)
    return timed


def _choose(m, weights, rows, build, retune=False):
    return tuning.choose(m, weights, rows, build, dispatch._interleave_rows_now, retune)


def _non_rule_winner(m) -> str:
    """A variant this CPU runs that the rule does not pick, one with another weight layout where
    there is one (so the test sees the layout follow the choice)."""
    rule = tuning.rule_variant(m)
    others = [v for v in tuning.variants(m.quant_impls()) if v != rule]
    rule_group = _group(rule)
    return next((v for v in others if _group(v) != rule_group), others[0])


def test_model_weights_are_one_layer_and_the_head(gguf_dir):
    ws = {w.name: w for w in model_weights(gguf_dir)}
    assert set(ws) == {"qkv", "o", "gate_up", "down", "lm_head"}
    assert len(ws["qkv"].parts) == 3 and len(ws["gate_up"].parts) == 2
    assert ws["lm_head"].in_features == 64 and ws["down"].in_features == 256
    assert model_weights(gguf_dir, logits_vocab=32)[-1].parts[0].shape[0] == 32


def test_pick_keeps_the_rule_within_the_margin():
    times = {"avx2+prefetch": 0.97, "avx2+noprefetch": 1.0, "scalar": 8.0}
    assert tuning.pick(times, "avx2+noprefetch") == "avx2+noprefetch"
    assert tuning.pick(dict(times, **{"avx2+prefetch": 0.9}), "avx2+noprefetch") == "avx2+prefetch"
    assert tuning.pick(times, "scalar") == "avx2+prefetch"


def test_variants_and_their_names():
    assert tuning.variants(["avx512_vnni_512", "avx2", "scalar"]) == [
        "avx512_vnni_512", "avx2+prefetch", "avx2+noprefetch", "scalar"]
    assert tuning.split("avx2+noprefetch") == ("avx2", False) and tuning.split("scalar") == ("scalar", None)
    with pytest.raises(ValueError, match="prefetch"):
        tuning.split("scalar+prefetch")


def test_prefetch_is_a_run_time_choice(ext):
    if "avx2" not in ext.quant_impls():
        pytest.skip("no 8-row kernel on this CPU")
    for on in (True, False):
        ops.set_quant_variant("avx2+prefetch" if on else "avx2+noprefetch", "set")
        assert ext.quant_prefetch() is on and ops.cpu_dispatch()["quant_gemm_variant"].endswith(
            "+prefetch" if on else "+noprefetch")
    ext.quant_set_prefetch(-1)
    assert ext.quant_prefetch() is ext.quant_prefetch_rule()
    with pytest.raises(RuntimeError, match="mode"):
        ext.quant_set_prefetch(2)


def test_profile_is_measured_once_per_key(ext, gguf_dir, tuning_on, monkeypatch):
    winner = _non_rule_winner(ext)
    timed = _inject(monkeypatch, ext, winner)
    weights = model_weights(gguf_dir)
    c = _choose(ext, weights, [1, 4], "build-a")
    assert (c.variant, c.source) == (winner, "measured here") and tuning.current_variant(ext) == winner
    assert timed == tuning.variants(ext.quant_rule_impls())
    stored = json.loads(next(tuning_on.glob("*.json")).read_text())
    assert stored["variant"] == winner and stored["key"]["build"] == "build-a"
    n = len(timed)
    assert _choose(ext, weights, [1, 4], "build-a").variant == winner and len(timed) == n  # read back
    _choose(ext, weights, [1, 4], "build-b")  # another build of the extension: measured again
    assert len(timed) == 2 * n
    cpu = dict(tuning.cpu_identity(), flags="fpu sse2")
    monkeypatch.setattr(tuning, "cpu_identity", lambda: cpu)  # another CPU's flags: measured again
    _choose(ext, weights, [1, 4], "build-a")
    assert len(timed) == 3 * n
    _choose(ext, weights[:2], [1, 4], "build-a")  # other weight shapes: measured again
    assert len(timed) == 4 * n
    _choose(ext, weights[:2], [1, 4], "build-a", retune=True)  # on request: measured again
    assert len(timed) == 5 * n


def test_corrupt_profile_is_ignored_with_a_warning(ext, gguf_dir, tuning_on, monkeypatch):
    winner = _non_rule_winner(ext)
    timed = _inject(monkeypatch, ext, winner)
    weights = model_weights(gguf_dir)
    key, _ = tuning.profile_key(weights, "build-a")
    path = tuning.profile_path(key)
    path.parent.mkdir(parents=True)
    path.write_text('{"version": 1, "variant": ')
    with pytest.warns(RuntimeWarning, match="unreadable profile"):
        c = _choose(ext, weights, [1], "build-a")
    assert c.variant == winner and timed
    assert json.loads(path.read_text())["variant"] == winner  # replaced by the new measurement


def test_tuning_off_keeps_the_rule(ext, gguf_dir, monkeypatch):
    monkeypatch.setenv("SWIFTSPEC_KERNEL_TUNING", "0")
    monkeypatch.delenv("SWIFTSPEC_QUANT_GEMM", raising=False)
    _inject(monkeypatch, ext, "none")
    c = tune_kernels([(str(gguf_dir), None)], [1])
    assert (c.variant, c.source) == (tuning.rule_variant(ext), "rule")
    assert ops.cpu_dispatch()["quant_gemm_choice"] == "rule"


def test_workers_run_the_measured_variant(ext, gguf_dir, tuning_on, monkeypatch):
    """Timings under which a variant the rule does not pick wins: the engine's worker finds the
    stored measurement, runs that variant (its metrics say so) and its weights take its layout."""
    from swiftspec import Engine, SamplingParams

    winner = _non_rule_winner(ext)
    group = _group(winner)
    rule_group = _group(tuning.rule_variant(ext))
    _inject(monkeypatch, ext, winner)
    assert tune_kernels([(str(gguf_dir), None)], [1, 8]).variant == winner  # stored for this machine
    with Engine(str(gguf_dir), mode="autoregressive", dtype="float32", target_cores=[0]) as e:
        out = e.generate([5, 9, 77, 3], SamplingParams(max_tokens=4, ignore_eos=True))
        info = e.workers[0]
    assert info["kernels"]["quant_gemm_variant"] == winner and info["kernels"]["quant_gemm_choice"] == "measured here"
    assert out.metrics.kernels["quant_gemm_variant"] == winner
    assert out.metrics.kernels["quant_gemm_choice"] == "measured here"
    # the weights take the winner's interleave; one its layout cannot take (block type or row
    # count, ops.quant.interleaved_type) keeps the file's layout (1): on a CPU whose rule picks the
    # 8-row kernel, a 16-row winner leaves part of the tiny model plain
    layout = info["quant_layout_rows"]["target"]
    assert group in layout and set(layout) <= {group, 1}, (winner, layout)
    assert group != rule_group or len(tuning.variants(ext.quant_impls())) < 3


def test_profile_retunes_on_request(ext, gguf_dir, tuning_on, monkeypatch):
    """``swiftspec profile --retune-kernels`` measures again where a measurement is stored: the
    kernel variants, then the step costs auto's mode choice weighs."""
    from swiftspec.benchmark import profile
    from swiftspec.model_executor import step_costs

    remeasured = []
    monkeypatch.setattr(step_costs, "measure_step_costs", lambda *a, **k: remeasured.append(k.get("remeasure")))

    assert profile.build_parser().parse_args(["--retune-kernels"]).retune_kernels
    from swiftspec.engine.config import EngineConfig

    timed = _inject(monkeypatch, ext, _non_rule_winner(ext))
    pair = [(str(gguf_dir), None), (str(gguf_dir), EngineConfig().draft_vocab)]  # as profile.retune has it
    tune_kernels(pair, [1])
    n = len(timed)
    assert n and tune_kernels(pair, [1]) and len(timed) == n
    c = profile.retune(gguf_dir, gguf_dir, progress=False)
    assert c.source == "measured here" and len(timed) == 2 * n and remeasured == [True]


def test_time_variant_times_every_weight_and_row_count_until_cut_off(ext, gguf_dir):
    """The real timing function (no assertion on its numbers): one warm-up and ``reps`` calls per
    weight and row count, in the variant's layout; past ``stop_after`` it stops."""
    calls = []

    class Counting:
        def __getattr__(self, name):
            return getattr(ext, name)

        def quant_linear(self, x, parts, types, impl):
            calls.append((x.shape[0], tuple(types)))
            return ext.quant_linear(x, parts, types, impl)

    weights = model_weights(gguf_dir)
    rule = tuning.rule_variant(ext)
    group = _group(rule)
    assert tuning.time_variant(Counting(), rule, weights, [1, 3], group if group > 1 else 0, reps=2) > 0
    assert len(calls) == len(weights) * 2 * 3 and {n for n, _ in calls} == {1, 3}
    groups = {ops.quant.group_rows(t) for _, ts in calls for t in ts}  # parts that cannot interleave stay plain
    assert group in groups and groups <= {group, 1}
    calls.clear()
    tuning.time_variant(Counting(), rule, weights, [1, 3], group if group > 1 else 0, reps=2, stop_after=0.0)
    assert len(calls) == 3  # the first weight at one row count, then cut off
