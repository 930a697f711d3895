"""The benchmark's bookkeeping (prompt loading, tables, chart) on synthetic records."""
import json

import pytest

from swiftspec.benchmark.records import load_prompts
from swiftspec.benchmark.report import bar_chart, markdown, overall, summarize
from swiftspec.benchmark.weight_memory import (
    InsufficientMemoryError,
    check_memory,
    weight_bytes,
)


def _rec(system, ds, tps, cr=1.0, match=True):
    n = 65
    return {"system": system, "dataset": ds, "num_tokens": n, "decode_s": (n - 1) / tps, "tokens_per_s": tps,
            "compression_ratio": cr, "ttft_s": 0.5, "tbt_mean_s": 1 / tps, "tbt_p50_s": 1 / tps,
            "tbt_p99_s": 2 / tps, "matches_target": match}


def test_load_prompts_from_file_and_errors(tmp_path):
    f = tmp_path / "mine.jsonl"
    f.write_text("\n".join(json.dumps({"question_id": i, "turns": [f"q{i}", "again"]}) for i in range(4)))
    assert load_prompts(str(f), 2) == ("mine", ["q0", "q1"])
    with pytest.raises(FileNotFoundError):
        load_prompts("no-such-dataset", 1)


def test_shipped_prompt_sets(monkeypatch):
    """The six datasets ship with the package: 80 prompts each, the first turn a non-empty string."""
    monkeypatch.delenv("SWIFTSPEC_PROMPTS", raising=False)
    for ds in ("mt_bench", "humaneval", "gsm8k", "alpaca", "sum", "qa"):
        name, prompts = load_prompts(ds, 1000)
        assert name == ds and len(prompts) == 80 and all(isinstance(p, str) and p for p in prompts)


def test_memory_check_counts_every_system_and_refuses_before_loading(tiny_dir, tiny_draft_dir):
    from safetensors import safe_open

    with safe_open(str(tiny_dir / "model.safetensors"), framework="pt") as st:
        n_target = sum(st.get_tensor(k).numel() for k in st.keys())
    systems = ["swiftspec-async", "autoregressive", "hf", "hf-assisted", "llama-cpp"]
    fp32 = weight_bytes(systems, tiny_dir, tiny_draft_dir, "float32")
    bf16 = weight_bytes(systems, tiny_dir, tiny_draft_dir, "bfloat16")
    assert fp32["autoregressive"] == fp32["hf"] == 4 * n_target == 2 * bf16["autoregressive"]
    n_draft = fp32["swiftspec-async"] - fp32["autoregressive"]  # int8 draft: one byte a parameter
    assert n_draft > 0 and fp32["hf-assisted"] == 4 * n_target + 4 * n_draft
    assert fp32["llama-cpp"] == 0
    total = sum(fp32.values())
    check_memory(fp32, total)  # fits exactly
    check_memory(fp32, None)  # unknown: no refusal
    with pytest.raises(InsufficientMemoryError, match=r"hf-assisted .* fewer systems"):
        check_memory(fp32, total - 1)


def test_memory_check_counts_native_blocks_as_stored(tmp_path):
    """A model with native blocks: engines count the blocks file and the other tensors at the
    dtype's size; the -dequantized engines and transformers every parameter."""
    import torch
    from safetensors.torch import save_file

    from swiftspec.model_executor.models.llama import NATIVE_FILE

    for name in ("t", "d"):
        (tmp_path / name / "native").mkdir(parents=True)
        save_file({"w": torch.zeros(64, 64), "norm": torch.zeros(64)}, str(tmp_path / name / "model.safetensors"))
        save_file({"w": torch.zeros(2304, dtype=torch.uint8)}, str(tmp_path / name / NATIVE_FILE),
                  metadata={"ggml_types": json.dumps({"w": 12})})
    blocks = (tmp_path / "t" / NATIVE_FILE).stat().st_size
    got = weight_bytes(["autoregressive", "autoregressive-dequantized", "swiftspec-serial", "hf"],
                       tmp_path / "t", tmp_path / "d", "bfloat16")
    assert got["autoregressive"] == blocks + 2 * 64
    assert got["autoregressive-dequantized"] == got["hf"] == 2 * (64 * 64 + 64)
    assert got["swiftspec-serial"] == got["autoregressive"] + blocks + 64  # the draft's other tensors int8


def test_equals_column_counts_prompts_and_says_na_without_reference():
    from swiftspec.benchmark.report import equals_cell

    assert equals_cell([_rec("a", "qa", 1.0), _rec("a", "qa", 1.0, match=False)]) == "1/2"
    assert equals_cell([_rec("a", "qa", 1.0, match=None)]) == "n/a"  # no autoregressive run: no claim


def test_each_system_is_compared_with_the_target_at_its_tp_degree():
    from types import SimpleNamespace

    from swiftspec.benchmark.systems import reference_system

    eng = lambda mode, tp, w="native": SimpleNamespace(shape={"mode": mode, "target_tp": tp, "weights": w})  # noqa: E731
    systems = {"swiftspec-profiled[ar]": eng("autoregressive", 1), "autoregressive": eng("autoregressive", 1),
               "swiftspec-serial": eng("serial", 1), "swiftspec-profiled[ar-tp2]": eng("autoregressive", 2),
               "swiftspec-profiled[s-tp2]": eng("serial", 2), "swiftspec-profiled[s-tp3]": eng("serial", 3),
               "swiftspec-serial-dequantized": eng("serial", 1, "float32"), "llama-cpp": object()}
    outs = dict.fromkeys(systems)
    assert reference_system("swiftspec-serial", systems, outs) == "autoregressive"
    assert reference_system("swiftspec-profiled[ar]", systems, outs) == "autoregressive"
    assert reference_system("llama-cpp", systems, outs) == "autoregressive"
    assert reference_system("swiftspec-profiled[s-tp2]", systems, outs) == "swiftspec-profiled[ar-tp2]"
    # never its own reference; no target at TP 3 or on dequantized weights ran: n/a
    assert reference_system("autoregressive", systems, outs) == "swiftspec-profiled[ar]"
    assert reference_system("swiftspec-profiled[ar-tp2]", systems, outs) is None
    assert reference_system("swiftspec-profiled[s-tp3]", systems, outs) is None
    assert reference_system("swiftspec-serial-dequantized", systems, outs) is None
    del outs["autoregressive"]
    assert reference_system("swiftspec-serial", systems, outs) == "swiftspec-profiled[ar]"
    assert reference_system("llama-cpp", systems, outs) is None


def test_ceilings_pick_the_fastest_engine_per_run_dataset_and_prompt(tmp_path):
    """report.ceilings: with hindsight, the fastest of our engines over the run, per dataset and
    per prompt (prompts paired by their order); peers never count; the ceiling block names the
    default configuration beside them, each against llama.cpp of the same run."""
    from swiftspec.benchmark.report import ceilings

    def eng(system, ds, tps):
        return {**_rec(system, ds, tps), "engine": {"mode": system}}

    # "ngram" wins prompt 1 of code, "serial" prompt 2 and all of chat; llama.cpp is faster than
    # both on chat but is no engine of ours
    recs = [eng("swiftspec-profiled[auto]", "code", 10.0), eng("swiftspec-profiled[auto]", "code", 10.0),
            eng("swiftspec-profiled[auto]", "chat", 10.0), eng("swiftspec-profiled[auto]", "chat", 10.0),
            eng("serial", "code", 5.0), eng("serial", "code", 20.0), eng("serial", "chat", 12.0),
            eng("serial", "chat", 12.0), _rec("llama-cpp", "code", 8.0), _rec("llama-cpp", "code", 8.0),
            _rec("llama-cpp", "chat", 40.0), _rec("llama-cpp", "chat", 40.0)]
    c = ceilings(recs)
    rate = lambda *tps: 64 * len(tps) / sum(64 / t for t in tps)  # noqa: E731
    assert c["system"] == pytest.approx(rate(10, 10, 10, 10))  # auto over the whole run beats serial
    assert c["dataset"] == pytest.approx(rate(10, 10, 12, 12))
    assert c["prompt"] == pytest.approx(rate(10, 20, 12, 12))
    assert c["system"] <= c["dataset"] <= c["prompt"]
    with pytest.raises(ValueError, match="different prompts"):
        ceilings(recs + [eng("serial", "chat", 12.0)])
    with pytest.raises(ValueError, match="two or more"):
        ceilings([r for r in recs if r["system"] != "serial"])
    tables = _tables()
    (tmp_path / "run.json").write_text(json.dumps({"command": "swiftspec bench", "machine": {}, "records": recs}))
    text = tables.block("ceiling run.json", tmp_path)
    llama = rate(8, 8, 40, 40)
    assert f"| `run.json` | 2 | 10.00 ({10 / llama:.2f}x) |" in text
    assert f"| {c['prompt']:.2f} ({c['prompt'] / llama:.2f}x) |" in text and "`swiftspec bench`" in text


def test_tables_and_chart(tmp_path):
    recs = [_rec("autoregressive", "humaneval", 5.0), _rec("autoregressive", "humaneval", 5.0),
            _rec("swiftspec-async", "humaneval", 10.0, 3.5), _rec("swiftspec-async", "humaneval", 12.5, 3.9),
            _rec("hf", "humaneval", 2.0, match=False)]
    rows = summarize(recs)
    a = next(r for r in rows if r["system"] == "swiftspec-async")
    assert a["prompts"] == 2 and a["tokens_per_s"] == pytest.approx(128 / (64 / 10 + 64 / 12.5))
    assert a["compression_ratio"] == pytest.approx(3.7)
    assert overall(recs)["autoregressive"] == pytest.approx(5.0)
    md = markdown(recs)
    assert "| swiftspec-async | 11.11 |" in md and "2.22x" in md and "paper: swiftspec-async | 3.92" in md
    assert "| hf |" in md and "| 0/1 |" in md and "| 2/2 |" in md
    bar_chart(recs, tmp_path / "c.png", "t")
    assert (tmp_path / "c.png").stat().st_size > 1000
    # the --out file: the records with the command and the machine (CPU family and flags, dispatch)
    import importlib.util
    from pathlib import Path

    from swiftspec.benchmark.records import machine_record
    m = machine_record()
    assert m["cpu"] and m["cores"] >= 1 and set(m["isa"]) >= {"quant_gemm", "tree_attention"}
    assert ("avx2" in m["cpu_flags"]) == ("avx2" in Path("/proc/cpuinfo").read_text())
    # for numbers measured on a GPU the CPU kernels are not asked for (that would build them)
    from swiftspec import ops

    def no_build():
        raise AssertionError("cpu_dispatch called")

    saved_dispatch, ops.cpu_dispatch = ops.cpu_dispatch, no_build
    try:
        assert machine_record(cpu_kernels=False)["isa"] is None
    finally:
        ops.cpu_dispatch = saved_dispatch
    # the llama.cpp build is named where a peer loaded one (here: a stand-in module)
    import sys
    from types import SimpleNamespace
    fake = SimpleNamespace(__version__="0.3.36", __file__="/x/llama_cpp/__init__.py",
                           llama_print_system_info=lambda: b"CPU : AVX2 = 1 | ")
    saved = sys.modules.get("llama_cpp")
    sys.modules["llama_cpp"] = fake
    try:
        assert machine_record()["llama_cpp"] == {"version": "0.3.36", "path": "/x/llama_cpp",
                                                 "system_info": "CPU : AVX2 = 1 |"}
    finally:
        sys.modules.pop("llama_cpp")
        if saved is not None:
            sys.modules["llama_cpp"] = saved
    spec = importlib.util.spec_from_file_location("tables", Path(__file__).resolve().parents[1] / "bench" / "tables.py")
    tables = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tables)
    out = tables.render({"command": "swiftspec bench --num-prompts 1", "machine": m, "records": recs})
    assert out.startswith("`swiftspec bench --num-prompts 1` on ") and md in out


def test_several_configs_run_side_by_side_as_named_systems(tiny_dir, tiny_draft_dir, tmp_path, capsys):
    """`--config a.json b.json`: one swiftspec-profiled system per file, named by its stem, each run
    with its own tree shape (recorded), in one table with the others; a single file keeps the plain
    name; bad combinations are refused before anything loads."""
    from swiftspec.benchmark.e2e import main
    from swiftspec.benchmark.systems import expand_systems

    shallow, deep = tmp_path / "shallow.json", tmp_path / "deep.json"
    shallow.write_text(json.dumps({"mode": "serial", "bs": 2, "d": 1}))
    deep.write_text(json.dumps({"mode": "serial", "bs": 4, "d": 2}))
    assert expand_systems(["autoregressive", "swiftspec-profiled"], [str(shallow)]) == [
        ("autoregressive", None), ("swiftspec-profiled", str(shallow))]
    for systems, configs, msg in ((["swiftspec-profiled"], None, "needs --config"),
                                  (["autoregressive"], [str(deep)], "add it to --systems"),
                                  (["swiftspec-profiled"], [str(deep), str(tmp_path / "x" / "deep.json")], "distinct")):
        with pytest.raises(ValueError, match=msg):
            expand_systems(systems, configs)
    # every file is checked before anything loads: a typo'd field, not JSON, not an object, missing
    for text, msg in (('{"mode": "serial", "bz": 4}', r"unknown field\(s\) bz"), ("{mode: serial", "not JSON"),
                      ("[1, 2]", "a JSON object")):
        (tmp_path / "bad.json").write_text(text)
        with pytest.raises(ValueError, match=msg):
            expand_systems(["swiftspec-profiled"], [str(shallow), str(tmp_path / "bad.json")])
    with pytest.raises(FileNotFoundError):
        expand_systems(["swiftspec-profiled"], [str(shallow), str(tmp_path / "none.json")])
    assert main(["--target", str(tiny_dir), "--draft", str(tiny_draft_dir), "--prompts", "qa", "--num-prompts", "2",
                 "--max-tokens", "12", "--dtype", "float32", "--device", "cpu", "--json", "--systems",
                 "autoregressive", "swiftspec-profiled", "--config", str(shallow), str(deep)]) == 0
    recs = json.loads(capsys.readouterr().out)
    by = {}
    for r in recs:
        by.setdefault(r["system"], []).append(r)
    assert set(by) == {"autoregressive", "swiftspec-profiled[shallow]", "swiftspec-profiled[deep]"}
    assert [(r["engine"]["mode"], r["engine"]["bs"], r["engine"]["d"]) for r in by["swiftspec-profiled[deep]"]] == [
        ("serial", 4, 2)] * 2
    assert {r["engine"]["bs"] for r in by["swiftspec-profiled[shallow]"]} == {2}
    # why the engine ran its mode, and the proposals' shape where a mode has one
    assert all("configured" in r["engine"]["mode_reason"] and "ngram_tokens" not in r["engine"]
               for s, rs in by.items() for r in rs)
    ngram = {"mode": "ngram", "ngram_tokens": 2, "draft_payback": True}
    assert _tables()._what_ran("swiftspec-profiled", [{"engine": ngram}]) == "`ngram` (prompt lookup), 2 n-gram tokens"
    assert _tables()._what_ran("swiftspec-profiled", [{"engine": {**ngram, "ngram_tokens": 3, "ngram_adaptive": True}}]) \
        == "`ngram` (prompt lookup), up to 3 n-gram tokens, as many as matched"
    hybrid = {"mode": "hybrid", "d": 1, "hybrid_rows": 4, "ngram_tokens": 2, "draft_payback": True}
    assert _tables()._what_ran("swiftspec-profiled", [{"engine": hybrid}]) == (
        "`hybrid`, d 1, up to 4 rows, 2 n-gram tokens, payback gate")
    # lossless whatever the shape; the target itself is compared with nothing ("n/a")
    assert all(r["matches_target"] and r["reference"] == "autoregressive"
               for s, rs in by.items() if s != "autoregressive" for r in rs)
    assert all(r["matches_target"] is None and r["reference"] is None for r in by["autoregressive"])
    for r in recs:  # each model's busy time and forwards (the component table's host-overhead column)
        assert r["target_forwards"] >= 1 and 0 < r["target_busy_s"] <= r["decode_s"] + r["ttft_s"]
        assert ("draft_forwards" in r) == (r["system"] != "autoregressive")
        assert r["kernels"]["quant_gemm"]  # what the engine's workers ran (the bench process runs no model)
    md = markdown(recs)
    assert "| autoregressive |" in md and md.index("| swiftspec-profiled[deep] |") < md.index(
        "| swiftspec-profiled[shallow] |")  # rows in SYSTEMS order, a system's configurations by name


def test_pipeline_table():
    from types import SimpleNamespace

    from swiftspec.benchmark.records import pipeline_record

    stage = {"busy_s": 0.5}
    m = SimpleNamespace(prompt_tokens=10, draft={"busy_s": 0.25}, target={
        "stages": [stage, {"busy_s": 0.75}], "wall_s": 1.0, "timesteps": 40, "issued": 50, "pruned": 7,
        "cancelled": 2, "forward_tokens": 60})
    rec = pipeline_record(m)["pipeline"]
    assert rec["stage_busy"] == [0.5, 0.75] and rec["draft_busy"] == 0.25 and rec["recomputed_kv"] == 0
    recs = [{**_rec("pipeinfer", "qa", 20.0), "pipeline": rec}, _rec("autoregressive", "qa", 10.0)]
    assert "| pipeinfer | 1.62 | 50 | 7 | 2 | 50% / 75% | 25% | 0 |" in markdown(recs)
    assert pipeline_record(SimpleNamespace(target={})) == {} and "Pipeline modes" not in markdown(recs[1:])


def test_profile_keeps_defaults_unless_clearly_faster():
    from swiftspec.benchmark.profile import candidate_splits, choose, d_candidates

    default = {"bs": 8, "w": 2, "d": "auto", "tokens_per_s": 10.0}
    close = {"bs": 8, "w": 4, "d": 5, "tokens_per_s": 10.4}
    far = {"bs": 6, "w": 2, "d": 7, "tokens_per_s": 11.0}
    assert choose([default, close], default) is default  # 4 % is within the noise margin
    assert choose([default, close, far], default) is far
    assert choose([default, close], default, margin=0.0) is close
    assert choose([default, {**close, "tokens_per_s": 9.0}], default) is default
    assert d_candidates(0.39, 0.04) == [9, 10] and d_candidates(0.01, 0.04) == [1, 2]
    assert candidate_splits([0, 1], gpu=False) == [([0], [1])]
    assert candidate_splits(list(range(8)), gpu=True) == [([0, 1, 2, 3, 4, 5], [6, 7]), ([0, 1, 2, 3], [4, 5, 6, 7])]


def test_profile_confirms_a_sweep_winner_against_the_defaults():
    from swiftspec.benchmark.profile import choose_confirmed

    default = {"bs": 8, "w": 2, "d": "auto", "tokens_per_s": 10.0}
    lucky = {"bs": 6, "w": 2, "d": 7, "tokens_per_s": 11.0}
    asked = []

    def remeasure(speeds):
        def f(row):
            asked.append((row["bs"], row["d"]))
            return {**row, "round": "confirm", "tokens_per_s": speeds[row["bs"]]}
        return f

    # the winner by noise measures like the defaults again: the defaults are kept
    best, again = choose_confirmed([default, lucky], remeasure({8: 10.2, 6: 10.1}))
    assert best is again[0] and best["bs"] == 8 and asked == [(8, "auto"), (6, 7)]
    # a real winner wins again: its fresh row is chosen
    best, again = choose_confirmed([default, lucky], remeasure({8: 9.8, 6: 11.2}))
    assert best is again[1] and best["bs"] == 6 and best["round"] == "confirm"
    # the defaults win the sweep: nothing is measured again
    asked.clear()
    best, again = choose_confirmed([default, {**lucky, "tokens_per_s": 10.3}], remeasure({}))
    assert best is default and again == [] and asked == []


def test_profile_end_to_end_on_tiny_models(tiny_dir, tiny_draft_dir, tmp_path, capsys, monkeypatch):
    """`swiftspec profile` measures the split, the shared (serial) allocation (default, shallow and
    middle tree) and the target alone (autoregressive and ngram),
    prints every candidate, writes a configuration the engine runs with the target's own greedy
    output, and stores its mode for mode="auto" on this machine and pair."""
    from swiftspec.engine import machine_profile

    monkeypatch.setattr(machine_profile, "cache_root", lambda cache_dir=None: tmp_path / "cache")
    from swiftspec.benchmark.profile import main
    from swiftspec.engine.config import EngineConfig
    from swiftspec.engine.llm_engine import Engine
    from swiftspec.model_executor.sampling import SamplingParams

    prompts = tmp_path / "calib.jsonl"
    prompts.write_text(json.dumps({"question_id": 0, "turns": ["count: 1 2 3 4"]}))
    out = tmp_path / "cfg.json"
    assert main(["--target", str(tiny_dir), "--draft", str(tiny_draft_dir), "--prompts", str(prompts),
                 "--num-prompts", "1", "--max-tokens", "8", "--cores", "0,1", "--dtype", "float32",
                 "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    rows = [line for line in printed.splitlines() if line.startswith("| sweep")]
    modes = [line.split("|")[2].strip() for line in rows]
    # auto d plus two more each; serial also with the shallow tree (bs 2, d 1) and the middle one (bs 4, d 2)
    assert modes.count("async") == 3 and modes.count("serial") == 5, printed
    serial = [line.split("|")[5:8] for line in rows if "| serial |" in line]
    assert [" 2 ", " 2 ", " 1 "] in serial and [" 4 ", " 2 ", " 2 "] in serial, printed
    assert modes.count("autoregressive") == 1 and modes.count("ngram") == 1, printed
    assert printed.count("**chosen**") == 1 and "chosen: " in printed
    cfg = EngineConfig.from_json(out)
    assert cfg.mode in ("async", "serial", "autoregressive", "ngram") and cfg.dtype == "float32"
    assert json.loads(out.read_text())["_measured"]["tokens_per_s"] > 0
    # stored for mode=auto on this machine and pair (in this test's cache)
    with Engine(tiny_dir, tiny_draft_dir, dtype="float32") as eng:
        assert eng.config.mode == cfg.mode and "swiftspec profile" in eng.mode_reason
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    with Engine(tiny_dir, tiny_draft_dir, config=cfg) as eng:
        got = eng.generate("count: 5 6", params).token_ids
    with Engine(tiny_dir, tiny_draft_dir, config=EngineConfig(mode="autoregressive", dtype="float32")) as eng:
        assert got == eng.generate("count: 5 6", params).token_ids


def test_kernel_bench_rms_norm_cases():
    """bench/kernels.py's rms_norm cases: our op against the PyTorch ops, every requested shape."""
    import torch

    from swiftspec.benchmark import kernel_cases

    cases = kernel_cases.rms_norm_cases([torch.float32], [1], rounds=1, iters=1, device="cpu",
                                        models=("qwen-0.5b (draft)",), rows=(1, 8))
    assert [c.shape for c in cases] == ["qwen-0.5b (draft) M=1 H=896", "qwen-0.5b (draft) M=8 H=896"]
    assert all(set(c.summary()["baselines"]) == {"PyTorch ops"} and c.summary()["speedup"]["PyTorch ops"] > 0
               for c in cases)


def test_kernel_bench_quant_cases():
    """bench/kernels.py's quant_linear cases: valid random blocks, every kernel this CPU runs and
    every baseline measured, GB/s from the weight bytes."""
    import torch

    from swiftspec import ops
    from swiftspec.benchmark import kernel_quant, kernel_timing
    from swiftspec.ops import cpu, quant

    try:
        ext = cpu.load()
    except cpu.KernelBuildError as e:
        pytest.skip(f"CPU kernels unavailable: {e}")
    g = torch.Generator().manual_seed(1)
    for t in (12, 14, 8, quant.AWQ4):
        assert torch.isfinite(quant.dequantize(kernel_quant._random_blocks(4, 512, t, g), t)).all()
    w = kernel_quant._random_blocks(16, 256, quant.AWQ4, g)
    packed, sz = kernel_quant._torch_int4(w)  # the int4 baseline computes the same layer (bf16 rounding)
    x = torch.randn(3, 256)
    torch.testing.assert_close(torch.ops.aten._weight_int4pack_mm_for_cpu(x.bfloat16(), packed, 32, sz).float(),
                               x @ quant.dequantize(w, quant.AWQ4).T, rtol=0.05, atol=0.05)
    cases = kernel_quant.quant_linear_cases([1], rounds=1, iters=1, rows=(1,))
    assert len(cases) == 3
    for c in cases:
        s = c.summary()
        int4 = {"torch int4 (bf16, group 32)"} if "AWQ4" in c.shape else set()
        # every type runs interleaved as the engine loads it, with the file's plain layout beside
        inter = "_X8" in c.shape or "_X16" in c.shape
        plain = {"ours, plain layout"} if inter else set()
        assert inter == ops.quant_x8_enabled() and ("_X16" in c.shape) == (ops.quant_interleave_rows() == 16)
        layout = c.shape.split()[3]  # the type name as the engine loads it (Q4_K_X16, Q6_K_X8, ...)
        x8_name = layout.replace("_X16", "_X8")
        assert {f"ours, {i} kernel, {layout if i in ('avx512_vnni_512', 'scalar') else x8_name}"
                for i in ext.quant_impls()[1:]} | {
            "kernels off (int8 x fp32, PyTorch)", "F.linear fp32 dequantized", "F.linear bf16 dequantized"} | int4 \
            | plain == set(s["baselines"])
        assert s["ours_gb_s"] > 0 and s["weight_bytes"] == c.weight_bytes
    assert "GB/s" in kernel_timing.table(cases)


def test_llama_cpp_speculative_peer_is_greedy_lossless(tmp_path):
    """The llama-cpp-spec peer (llama-cpp-python's draft_model hook fed by a second llama.cpp
    context) gives llama.cpp's own greedy tokens; with the target as its own draft every proposal
    is accepted, so each target forward yields several tokens."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python (a test extra) is not installed")
    from swiftspec.benchmark.peers import LlamaCppPeer
    from tests.test_loader import make_gguf

    path = tmp_path / "tiny.gguf"
    make_gguf(path, seed=3)
    prompt = [5, 9, 77, 3, 41]
    plain = LlamaCppPeer(path, threads=1, n_ctx=768)
    ref, _ = plain.generate(prompt, 24)
    spec = LlamaCppPeer(path, threads=1, n_ctx=768, draft_gguf=path, draft_tokens=4)
    assert spec.system == "llama-cpp-spec"
    out, m = spec.generate(prompt, 24)
    assert out == ref and len(out) == 24
    assert m.compression_ratio > 2.0
    long = [(7 * i + 3) % 90 for i in range(600)]  # past llama.cpp's n_batch (512): two prompt batches
    assert spec.generate(long, 8)[0] == plain.generate(long, 8)[0]


def test_llama_cpp_prompt_lookup_peer(tmp_path):
    """The llama-cpp-lookup peer (llama-cpp-python's prompt lookup as its draft_model hook) gives
    llama.cpp's own greedy tokens; on text that repeats its context (the prompt followed by one
    turn of the model's own greedy text) its proposals are accepted, so each target forward
    yields more than one token; its parameters go into the bench's system and its records render."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python (a test extra) is not installed")
    from swiftspec.benchmark import peers
    from swiftspec.benchmark.systems import SYSTEMS
    from tests.test_loader import make_gguf

    path = tmp_path / "tiny.gguf"
    make_gguf(path, seed=3)
    plain = peers.LlamaCppPeer(path, threads=1, n_ctx=768)
    first, _ = plain.generate([5, 9, 77, 3, 41], 32)
    prompt = [5, 9, 77, 3, 41] + first  # the continuation now repeats text the prompt holds
    ref, _ = plain.generate(prompt, 24)
    look = peers.LlamaCppPeer(path, threads=1, n_ctx=768, lookup=True)
    assert look.system == "llama-cpp-lookup" and "llama-cpp-lookup" in SYSTEMS
    assert look.settings == {"max_ngram_size": peers.LOOKUP_MAX_NGRAM, "num_pred_tokens": peers.LOOKUP_TOKENS}
    out, m = look.generate(prompt, 24)
    assert out == ref and len(out) == 24
    assert m.compression_ratio > 1.0, "prompt lookup must propose accepted tokens on repeating text"
    assert look.generate([5, 9, 77, 3, 41], 8)[0] == first[:8]  # a reset context: no state kept between requests
    with pytest.raises(ValueError, match="not both"):
        peers.LlamaCppPeer(path, threads=1, n_ctx=768, draft_gguf=path, lookup=True)
    rec = {"system": "llama-cpp-lookup", "peer": look.settings}
    assert _tables()._what_ran("llama-cpp-lookup", [rec]) == (
        f"llama.cpp prompt lookup on the same GGUF (max_ngram_size {peers.LOOKUP_MAX_NGRAM}, "
        f"num_pred_tokens {peers.LOOKUP_TOKENS})")


def test_setup_builds_the_llama_cpp_peer_as_the_peer_expects(monkeypatch):
    """scripts/setup_env.sh builds llama-cpp-python with the CMake arguments the peer names in its
    error (llama.cpp's AMX matmul compiled out), and the installed build, if any, has no AMX."""
    from pathlib import Path

    from swiftspec.benchmark import peers

    script = (Path(__file__).resolve().parents[1] / "scripts" / "setup_env.sh").read_text()
    assert f'CMAKE_ARGS="${{CMAKE_ARGS:-{peers.LLAMA_CPP_CMAKE_ARGS}}}"' in script
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python (a test extra) is not installed")
    assert "AMX_INT8 = 1" not in llama_cpp.llama_print_system_info().decode()
    monkeypatch.setattr(llama_cpp, "llama_print_system_info", lambda: b"CPU : AVX512 = 1 | AMX_INT8 = 1 |")
    with pytest.raises(RuntimeError, match="AMX matmul"):
        peers._llama_cpp()
    monkeypatch.setenv("SWIFTSPEC_LLAMA_CPP_AMX", "1")
    assert peers._llama_cpp() is llama_cpp


def _tables():
    """bench/tables.py, loaded as a module."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("tables", Path(__file__).resolve().parents[1] / "bench" / "tables.py")
    tables = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tables)
    return tables


def test_every_committed_record_renders():
    """bench/tables.py renders every record under bench/results/ (tables come from the JSON) and
    refuses what is no record of ours."""
    tables = _tables()
    files = sorted(tables.RESULTS.glob("*.json"))
    assert len(files) >= 10
    out = {f.name: tables.render(json.loads(f.read_text())) for f in files}
    assert all(text.strip() for text in out.values())
    with pytest.raises(ValueError):
        tables.render({"something": "else"})


def test_readme_and_results_numbers_are_those_of_their_records():
    """Every generated block of README.md and bench/RESULTS.md (``<!-- tables:begin KIND FILE ... -->``)
    equals what bench/tables.py makes of its committed records now: a number changed in a document
    or in a record fails here. README's measured numbers stand in such blocks only."""
    import re

    tables = _tables()
    for doc, least in (("README.md", 4), ("bench/RESULTS.md", 10)):
        text = (tables.ROOT / doc).read_text()
        blocks = list(tables.BLOCK.finditer(text))
        assert len(blocks) >= least, doc
        for m in blocks:
            assert m["body"] == tables.block(m["spec"]) + "\n", f"{doc}: {m['spec']} (python bench/tables.py --write)"
        assert tables.regenerate(text) == text, doc
    readme = tables.BLOCK.sub("", (tables.ROOT / "README.md").read_text())
    assert not re.findall(r"\d\s?(?:x\b|%|tokens/s|ms\b|GB/s|TB/s|minutes)", readme)
    with pytest.raises(ValueError):  # a block without its end marker is an error, not skipped
        tables.regenerate("<!-- tables:begin record run38-zen3-6x5.json -->\n| 1 |\n")


def test_device_forward_on_cpu_with_random_weights(tmp_path, monkeypatch):
    """bench/device_forward.py (the GPU benchmark's component table) runs on CPU too: the shipped
    configs are the default pair's shapes, a shrunk copy runs here; the record has a time and a
    fraction of the bandwidth limit per row count, and the weight bytes of that shape."""
    import importlib.util
    from pathlib import Path

    bench = Path(__file__).resolve().parent.parent / "bench"
    spec = importlib.util.spec_from_file_location("device_forward", bench / "device_forward.py")
    df = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(df)
    shipped = {p.name: json.loads(p.read_text()) for p in df.DEFAULT_MODELS}
    assert shipped["qwen2.5-coder-1.5b-instruct.json"]["hidden_size"] == 1536
    assert shipped["qwen2.5-coder-0.5b-instruct.json"]["num_hidden_layers"] == 24
    cfg = dict(shipped["qwen2.5-coder-0.5b-instruct.json"], hidden_size=64, intermediate_size=128,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256)
    (tmp_path / "tiny.json").write_text(json.dumps(cfg))
    from swiftspec.weights import random_weights  # the random checkpoint goes to this test's directory

    monkeypatch.setattr(random_weights, "cache_root", lambda cache_dir=None: tmp_path / "cache")
    rec = df.main(["--device", "cpu", "--dtype", "float32", "--rows", "1", "2", "--rounds", "2", "--context", "16",
                   "--models", str(tmp_path / "tiny.json"), "--logits-vocab", "128", "--out", str(tmp_path / "r.json")])
    assert json.loads((tmp_path / "r.json").read_text()) == rec and rec["device"] == "cpu"
    assert [r["rows"] for r in rec["rows"]] == [1, 2]
    assert all(r["eager_s"] > 0 and r["of_limit"] > 0 for r in rec["rows"])
    layer = 4 * (64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128)  # q, o; k, v (2 KV heads x 16); gate, up, down
    biases = 4 * (64 + 32 + 32)  # qwen2's q/k/v biases
    assert rec["rows"][0]["weight_bytes"] == 2 * (layer + biases) + 4 * 128 * 64  # the LM head's first 128 rows
    # the limit is a read-only pass measured in the run; r is each row count over one row
    assert rec["bandwidth_method"].startswith("read-only") and rec["rows"][0]["vs_one_row"] == 1.0
    tables = importlib.util.module_from_spec(importlib.util.spec_from_file_location("tables", bench / "tables.py"))
    tables.__spec__.loader.exec_module(tables)
    assert "| r (vs one row) |" in tables.render(rec) and "read bandwidth" in tables.render(rec)


def test_hf_compile_peer_is_greedy_equal_and_compiles_once(tiny_dir):
    """The static-cache + torch.compile transformers peer: compiled while it starts, the same
    greedy tokens as eager transformers, and no recompilation for prompts of other lengths (the
    static cache is sized once for the run)."""
    from torch._dynamo.utils import counters

    from swiftspec.benchmark.peers import HFPeer

    compiled = HFPeer(tiny_dir, None, "float32", threads=2, compiled=True, max_cache_len=128)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > 0 and compiled.system == "hf-compile"
    eager = HFPeer(tiny_dir, None, "float32", threads=2)
    for prompt in ([5, 6, 7, 8, 9], [10, 11, 12], list(range(20, 60))):
        got, m = compiled.generate(prompt, 16, ignore_eos=True)
        assert len(got) == 16 and got == eager.generate(prompt, 16, ignore_eos=True)[0]
        assert m.num_tokens == 16
    assert counters["stats"]["unique_graphs"] == graphs
