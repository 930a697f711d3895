"""The benchmark's bookkeeping (prompt loading, tables, chart) on synthetic records."""
import json

import pytest

from swiftspec.benchmark.e2e import (InsufficientMemoryError, bar_chart, check_memory, load_prompts, markdown,
                                     overall, summarize, weight_bytes)


def _committed(name: str, key: str = "records"):
    """A field of a committed benchmark record under bench/results/."""
    from pathlib import Path

    return json.loads((Path(__file__).resolve().parents[1] / "bench" / "results" / name).read_text())[key]


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
    from swiftspec.benchmark.e2e import _equals

    assert _equals([_rec("a", "qa", 1.0), _rec("a", "qa", 1.0, match=False)]) == "1/2"
    assert _equals([_rec("a", "qa", 1.0, match=None)]) == "n/a"  # no autoregressive run: no claim


def test_each_system_is_compared_with_the_target_at_its_tp_degree():
    from types import SimpleNamespace

    from swiftspec.benchmark.e2e import reference_system

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

    from swiftspec.benchmark.e2e import machine_record
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
    from swiftspec.benchmark.e2e import expand_systems, main

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
    # lossless whatever the shape; the target itself is compared with nothing ("n/a")
    assert all(r["matches_target"] and r["reference"] == "autoregressive"
               for s, rs in by.items() if s != "autoregressive" for r in rs)
    assert all(r["matches_target"] is None and r["reference"] is None for r in by["autoregressive"])
    for r in recs:  # each model's busy time and forwards (the component table's host-overhead column)
        assert r["target_forwards"] >= 1 and 0 < r["target_busy_s"] <= r["decode_s"] + r["ttft_s"]
        assert ("draft_forwards" in r) == (r["system"] != "autoregressive")
    md = markdown(recs)
    assert "| autoregressive |" in md and md.index("| swiftspec-profiled[deep] |") < md.index(
        "| swiftspec-profiled[shallow] |")  # rows in SYSTEMS order, a system's configurations by name


def test_pipeline_table():
    from types import SimpleNamespace

    from swiftspec.benchmark.e2e import _pipeline_record

    stage = {"busy_s": 0.5}
    m = SimpleNamespace(prompt_tokens=10, draft={"busy_s": 0.25}, target={
        "stages": [stage, {"busy_s": 0.75}], "wall_s": 1.0, "timesteps": 40, "issued": 50, "pruned": 7,
        "cancelled": 2, "forward_tokens": 60})
    rec = _pipeline_record(m)["pipeline"]
    assert rec["stage_busy"] == [0.5, 0.75] and rec["draft_busy"] == 0.25 and rec["recomputed_kv"] == 0
    recs = [{**_rec("pipeinfer", "qa", 20.0), "pipeline": rec}, _rec("autoregressive", "qa", 10.0)]
    assert "| pipeinfer | 1.62 | 50 | 7 | 2 | 50% / 75% | 25% | 0 |" in markdown(recs)
    assert _pipeline_record(SimpleNamespace(target={})) == {} and "Pipeline modes" not in markdown(recs[1:])


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
    from swiftspec.engine.llm_engine import Engine, EngineConfig
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

    from swiftspec.benchmark import kernels

    cases = kernels.rms_norm_cases([torch.float32], [1], rounds=1, iters=1, device="cpu",
                                   models=("qwen-0.5b (draft)",), rows=(1, 8))
    assert [c.shape for c in cases] == ["qwen-0.5b (draft) M=1 H=896", "qwen-0.5b (draft) M=8 H=896"]
    assert all(set(c.summary()["baselines"]) == {"PyTorch ops"} and c.summary()["speedup"]["PyTorch ops"] > 0
               for c in cases)


def test_kernel_bench_quant_cases():
    """bench/kernels.py's quant_linear cases: valid random blocks, every kernel this CPU runs and
    every baseline measured, GB/s from the weight bytes."""
    import torch

    from swiftspec import ops
    from swiftspec.benchmark import kernels
    from swiftspec.ops import cpu, quant

    try:
        ext = cpu.load()
    except cpu.KernelBuildError as e:
        pytest.skip(f"CPU kernels unavailable: {e}")
    g = torch.Generator().manual_seed(1)
    for t in (12, 14, 8, quant.AWQ4):
        assert torch.isfinite(quant.dequantize(kernels._random_blocks(4, 512, t, g), t)).all()
    w = kernels._random_blocks(16, 256, quant.AWQ4, g)
    packed, sz = kernels._torch_int4(w)  # the int4 baseline computes the same layer (bf16 rounding)
    x = torch.randn(3, 256)
    torch.testing.assert_close(torch.ops.aten._weight_int4pack_mm_for_cpu(x.bfloat16(), packed, 32, sz).float(),
                               x @ quant.dequantize(w, quant.AWQ4).T, rtol=0.05, atol=0.05)
    cases = kernels.quant_linear_cases([1], rounds=1, iters=1, rows=(1,))
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
    assert "GB/s" in kernels.table(cases)


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


def test_every_committed_record_renders_and_the_readme_quotes_run13():
    """bench/tables.py renders every record under bench/results/ (tables come from the JSON), and
    the README's numbers of runs 13, 15, 16, 20, 24, 26, 27, 28, 29, 30 and 31 are those of their records."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("tables", root / "bench" / "tables.py")
    tables = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tables)
    files = sorted((root / "bench" / "results").glob("*.json"))
    assert len(files) >= 10
    out = {f.name: tables.render(json.loads(f.read_text())) for f in files}
    run13 = next(line for line in out["run13-avx2-6x5.json"].splitlines() if line.startswith("| autoregressive"))
    readme = (root / "README.md").read_text()
    assert run13.split("|")[8].strip() == "13.44" and "| 13.44 | 1.00x |" in readme
    rows15 = {}
    for line in out["run15-avx2-6x1-x8all.json"].splitlines():  # the first table: tokens/s
        if line.startswith("| "):
            rows15.setdefault(line.split("|")[1].strip(), line.split("|")[8].strip())
    assert (rows15["swiftspec-profiled"], rows15["autoregressive"], rows15["llama-cpp"]) == ("23.43", "22.03", "22.18")
    assert "`serial` bs 4 decodes 23.4 tokens/s, 1.06x our `autoregressive` (22.0)" in " ".join(readme.split())
    rows16 = {}
    for line in out["run16-avx512-6x5-shallow.json"].splitlines():
        if line.startswith("| "):
            rows16.setdefault(line.split("|")[1].strip(), line.split("|")[8:10])
    for system in ("swiftspec-profiled", "autoregressive", "llama-cpp"):
        tps, ratio = rows16[system]
        assert f"| {tps.strip()} | {ratio.strip()} |" in readme, system
    rows = {}
    for run in (28, 29):
        for line in out[f"run{run}-zen5-avx512-6x5-shallow.json"].splitlines():  # tokens/s, TTFT
            cells = line.split("|")
            if line.startswith("| ") and len(cells) > 11:
                rows.setdefault((run, cells[1].strip()), (cells[8].strip(), cells[10].strip()))
    for system, label in (("swiftspec-profiled", "SwiftSpec `serial`, bs 2, d 1"), ("autoregressive", "our `autoregressive`"),
                          ("llama-cpp", "llama.cpp on the same GGUF")):
        tps, ttft = rows[29, system]
        assert any(line.startswith(f"| {label}") and f"| {tps} |" in line and f"| {ttft} |" in line
                   for line in readme.splitlines()), system
    flat = " ".join(readme.split())
    assert (f"{rows[28, 'swiftspec-profiled'][0]} tokens/s for the default mode (1.58x llama.cpp's "
            f"{rows[28, 'llama-cpp'][0]}), {rows[28, 'autoregressive'][0]} for `autoregressive` (1.26x), TTFT "
            f"{rows[28, 'swiftspec-profiled'][1]} / {rows[28, 'autoregressive'][1]} / {rows[28, 'llama-cpp'][1]} s") in flat
    # run 29's whole-request ratio: tokens over time to first token plus decode time
    recs29 = json.loads((root / "bench" / "results" / "run29-zen5-avx512-6x5-shallow.json").read_text())["records"]

    def whole(system):
        rs = [r for r in recs29 if r["system"] == system]
        return sum(r["num_tokens"] for r in rs) / sum(r["ttft_s"] + r["decode_s"] for r in rs)

    assert f"the default mode is {whole('swiftspec-profiled') / whole('llama-cpp'):.2f}x llama.cpp in this run" in flat
    rows24 = {}
    for line in out["run24-zen5-avx512-final-6x5-shallow.json"].splitlines():
        if line.startswith("| "):
            rows24.setdefault(line.split("|")[1].strip(), line.split("|")[8].strip())
    assert (f"{rows24['swiftspec-profiled']} tokens/s for the default mode (1.43x llama.cpp's {rows24['llama-cpp']}), "
            f"{rows24['autoregressive']} for `autoregressive`") in " ".join(readme.split())
    rows20 = {}
    for line in out["run20-zen5-pipeline-2stages.json"].splitlines():
        if line.startswith("| "):
            rows20.setdefault(line.split("|")[1].strip(), line.split("|")[8].strip())
    for system in ("pipeline-autoregressive", "pipedec", "pipeinfer"):
        assert any(line.startswith(f"| `{system}`") and f"| {rows20[system]} |" in line
                   for line in readme.splitlines()), system
    # run 26: the AVX2 build's ratios the README quotes, from their records
    from swiftspec.benchmark.e2e import overall

    records = _committed

    def ratio(name, system, ref, dataset=None):
        tot = overall([r for r in records(name) if dataset is None or r["dataset"] == dataset])
        return f"{tot[system] / tot[ref]:.2f}x"

    text = " ".join(readme.split())
    llama = [f"run26-zen5-avx2build-6x5-llamacpp-avx2{s}.json" for s in ("", "-q5bits")]
    assert (f"the default mode {ratio(llama[0], 'swiftspec-profiled', 'llama-cpp')} and "
            f"{ratio(llama[1], 'swiftspec-profiled', 'llama-cpp')}") in text
    assert (f"our `autoregressive` {ratio(llama[0], 'autoregressive', 'llama-cpp')} and "
            f"{ratio(llama[1], 'autoregressive', 'llama-cpp')}") in text
    # run 30: the same comparison with the prefetching AVX2 kernel, and without it, alternating
    run30 = [f"run30-zen5-avx2build-6x5-llamacpp-avx2-{s}.json" for s in ("1", "2", "noprefetch-1", "noprefetch-2")]
    assert (f"the default mode {ratio(run30[0], 'swiftspec-profiled', 'llama-cpp')} and "
            f"{ratio(run30[1], 'swiftspec-profiled', 'llama-cpp')} llama.cpp, our `autoregressive` "
            f"{ratio(run30[0], 'autoregressive', 'llama-cpp')} and {ratio(run30[1], 'autoregressive', 'llama-cpp')}") in text
    assert (f"the code before the prefetch, alternating with them: {ratio(run30[2], 'swiftspec-profiled', 'llama-cpp')} "
            f"and {ratio(run30[3], 'swiftspec-profiled', 'llama-cpp')}") in text
    sum_ratios = [ratio(n, "swiftspec-profiled", "autoregressive", "sum") for n in run30[:2]]
    assert f"the default mode decodes {sum_ratios[0]} and {sum_ratios[1]} our `autoregressive`" in text
    # run 31: the default configuration (the draft's payback gate) beside the same shape without it
    auto, plain = "swiftspec-profiled[auto]", "swiftspec-profiled[serial-bs2-d1]"
    run31 = [f"run31-zen5-avx2build-6x5-payback-{i}.json" for i in (1, 2)]
    assert (f"the default mode {ratio(run31[0], auto, 'llama-cpp')} and {ratio(run31[1], auto, 'llama-cpp')} "
            f"llama.cpp, without the gate {ratio(run31[0], plain, 'llama-cpp')} and {ratio(run31[1], plain, 'llama-cpp')}, "
            f"our `autoregressive` {ratio(run31[0], 'autoregressive', 'llama-cpp')} and "
            f"{ratio(run31[1], 'autoregressive', 'llama-cpp')}, 30/30 equal") in text

    def time_ratio(name, system, ref, dataset):  # requests' time: time to first token plus decode
        t = {k: sum(r["ttft_s"] + r["decode_s"] for r in records(name) if r["system"] == k and r["dataset"] == dataset)
             for k in (system, ref)}
        return f"{t[system] / t[ref]:.2f}x"

    sums = [time_ratio(n, s, "autoregressive", "sum") for s in (auto, plain) for n in run31]
    assert (f"they take {sums[0]} and {sums[1]} the target alone's time against {sums[2]} and {sums[3]} "
            f"without it") in text
    name31 = "run31-zen5-avx512-6x5-payback.json"
    tot31 = overall(records(name31))
    assert (f"the default mode {tot31[auto]:.2f} tokens/s = {tot31[auto] / tot31['llama-cpp']:.2f}x llama.cpp's "
            f"{tot31['llama-cpp']:.2f}, without the gate {tot31[plain] / tot31['llama-cpp']:.2f}x, our `autoregressive` "
            f"{tot31['autoregressive'] / tot31['llama-cpp']:.2f}x, llama.cpp's speculative mode "
            f"{tot31['llama-cpp-spec'] / tot31['llama-cpp']:.2f}x") in text
    assert (f"the summarization requests take {time_ratio(name31, auto, 'autoregressive', 'sum')} the target alone's "
            f"time with the gate and {time_ratio(name31, plain, 'autoregressive', 'sum')} without") in text
    name33 = "run33-zen3-6x5-1.json"
    for name in run31 + [name31, name33, "run34-zen3-6x5-1.json", "run34-zen3-6x5-2.json",
                         "run36-zen3-6x5.json", "run37-zen3-6x5.json",
                         "run37-zen3-6x5-2.json"]:  # every SwiftSpec row equals the target; the gate ran the long prompts alone
        rs = [r for r in records(name) if r["system"] in (auto, plain)]
        assert all(r["matches_target"] for r in rs) and len(rs) == 60
        assert {r["dataset"] for r in rs if r["ran"] == "autoregressive"} == {"sum"}
    cmd = [json.loads((root / "bench" / "results" / f"readme-command-zen5-run31-{i}.json").read_text())["metrics"]
           for i in (1, 2)]
    assert all(m["mode"] == "serial" for m in cmd)
    assert (f"decoded at {cmd[0]['tokens_per_s']:.1f} and {cmd[1]['tokens_per_s']:.1f} tokens/s in two runs, time to "
            f"first token {cmd[0]['ttft_s']:.2f} / {cmd[1]['ttft_s']:.2f} s") in text
    shallow = ratio("run26-zen5-avx2build-6x5-shapes.json", "swiftspec-profiled[serial-bs2-d1]", "autoregressive")
    again = ratio("run26-zen5-avx2build-6x5-shallow.json", "swiftspec-profiled[serial-bs2-d1]", "autoregressive")
    assert f"`serial` bs 2, d 1 decodes {shallow} and {again} our `autoregressive`" in text
    # runs 34 and 33 (a real Zen 3): the README's table, ratios and forward times are those of their records
    name34 = "run34-zen3-6x5-1.json"
    tot34, tot33 = overall(records(name34)), overall(records(name33))
    for system, label in ((auto, "SwiftSpec, default configuration"), (plain, "the same without the gate"),
                          ("autoregressive", "our `autoregressive`"), ("llama-cpp", "llama.cpp on the same GGUF")):
        row = f"{tot34[system]:.2f} | {tot34[system] / tot34['llama-cpp']:.2f}x |"
        assert any(line.startswith(f"| {label}") and row in line for line in readme.splitlines()), system
    assert (f"the default mode decodes {tot34[auto] / tot34['llama-cpp']:.2f}x llama.cpp, our `autoregressive` "
            f"{tot34['autoregressive'] / tot34['llama-cpp']:.2f}x;") in text
    assert (f"the previous run (run 33, the same code but for the huge pages below) {tot33[auto] / tot33['llama-cpp']:.2f}x "
            f"and {tot33['autoregressive'] / tot33['llama-cpp']:.2f}x") in text
    def vs_llama(tot, system):  # a system's overall tokens/s against llama.cpp's, as quoted
        return f"{tot[system] / tot['llama-cpp']:.2f}x"

    def readme_ab(run):  # the README command's before / after tokens/s of a run, as quoted
        ab = {s: " / ".join(f"{records(f'readme-command-zen3-run{run}-{s}-{i}.json', 'metrics')['tokens_per_s']:.2f}"
                            for i in (1, 2, 3)) for s in ("before", "after")}
        return f"{ab['before']} tokens/s before, {ab['after']} after"

    tot36 = overall(records("run36-zen3-6x5.json"))
    assert (f"a later session (run 36, the same command) {vs_llama(tot36, auto)} and "
            f"{vs_llama(tot36, 'autoregressive')}") in text
    results = " ".join((root / "bench" / "RESULTS.md").read_text().split())
    assert (f"The default mode decodes **{vs_llama(tot36, auto)} llama.cpp** (goal 1.3x: not met; "
            f"runs 33-34: 1.09-1.16x), our `autoregressive` {vs_llama(tot36, 'autoregressive')}") in results
    assert f"On QA speculation lost ({ratio('run36-zen3-6x5.json', auto, 'autoregressive', 'qa')} our `autoregressive`" in results
    assert readme_ab(36) in results
    # run 37 (every layer in one C++ call): README and RESULTS quote its record, its forward and README-command A/B
    tot37 = overall(records("run37-zen3-6x5.json"))
    assert (f"(run 37, the same command) the default mode decoded {vs_llama(tot37, auto)} "
            f"llama.cpp and our `autoregressive` {vs_llama(tot37, 'autoregressive')}") in text
    assert (f"The default mode decodes **{vs_llama(tot37, auto)} llama.cpp** (goal 1.3x: not met; "
            f"runs 33-36: 1.09-1.16x), our `autoregressive` {vs_llama(tot37, 'autoregressive')}") in results
    assert (f"without the gate {vs_llama(tot37, plain)}, llama.cpp's speculative mode "
            f"{vs_llama(tot37, 'llama-cpp-spec')}") in results
    assert (f"(default mode {tot37[auto] / tot37['autoregressive']:.2f}x our `autoregressive`; QA "
            f"{ratio('run37-zen3-6x5.json', auto, 'autoregressive', 'qa')}") in results
    tot37b = overall(records("run37-zen3-6x5-2.json"))
    assert (f"measured the default mode at {vs_llama(tot37b, auto)} llama.cpp and our `autoregressive` "
            f"at {vs_llama(tot37b, 'autoregressive')}") in results
    assert f"second run right after it {vs_llama(tot37b, auto)} and {vs_llama(tot37b, 'autoregressive')}" in text
    assert readme_ab(37) in results
    for model, row in (("target", 1), ("target", 2), ("draft", 1), ("draft", 2)):
        ms = {s: " / ".join(f"{records(f'native-forward-{model}-zen3-run37-{s}-{i}.json', 'rows')[row - 1]['ms']:.1f}"
                            for i in (1, 2)) for s in ("before", "after")}
        assert f"| {model} | {row} | {ms['before']} | {ms['after']} |" in results, (model, row)
    share = {s: [f"{100 * records(f'native-forward-target-zen3-run37-{s}-{i}.json', 'rows')[0]['of_bandwidth']:.0f} %"
                 for i in (1, 2)] for s in ("before", "after")}
    assert (f"reached {share['after'][0]} and {share['after'][1]} of the probe's bandwidth in the two after-runs "
            f"({share['before'][0]} and {share['before'][1]} before)") in results
    tot34b = overall(records("run34-zen3-6x5-2.json"))
    assert (f"a second run of the same code right after it measured {tot34b[auto] / tot34b['llama-cpp']:.2f}x and "
            f"{tot34b['autoregressive'] / tot34b['llama-cpp']:.2f}x") in text
    assert (f"(the default mode {ratio(name34, auto, 'autoregressive', 'qa')} our `autoregressive` there in run 34, "
            f"{ratio(name33, auto, 'autoregressive', 'qa')} in run 33)") in text
    for run in (34, 33):
        for model, rows in (("target", (1, 2, 4, 8)), ("draft", (1, 2))):
            rec = {r["rows"]: r for r in records(f"native-forward-{model}-zen3-run{run}.json", "rows")}
            assert " / ".join(f"{rec[n]['ms']:.1f}" for n in rows) in text, (run, model)
            if model == "target":
                assert (f"{100 * rec[1]['of_bandwidth']:.0f} % of {'the read bandwidth at 1 row against that run' + chr(39) + 's probe of ' if run == 34 else ''}"
                        f"{rec[1]['bandwidth_gb_s']:.1f} GB/s") in text, run
    cmd34, cmd33 = ([records(f"readme-command-zen3-run{run}-{i}.json", "metrics") for i in (1, 2)] for run in (34, 33))
    assert all(m["mode"] == "serial" for m in cmd34 + cmd33)
    assert (f"decoded at {cmd34[0]['tokens_per_s']:.1f} and {cmd34[1]['tokens_per_s']:.1f} tokens/s in two runs "
            f"(`bench/results/readme-command-zen3-run34-{{1,2}}.json`; {cmd33[0]['tokens_per_s']:.1f} and "
            f"{cmd33[1]['tokens_per_s']:.1f} in run 33)") in text
    for model, names in (("target", ("-1", "-2")), ("draft", ("",))):  # the huge pages' median speedups
        med = [r["speedup_median"] for s in names for r in records(f"huge-pages-{model}-zen3-run34{s}.json", "results")]
        assert f"was {min(med):.3f}-{max(med):.3f}x for the {model}" in text or \
            f"and {min(med):.3f}-{max(med):.3f}x for the {model}" in text, model
    # run 32 (an H100): the README's GPU numbers are those of their records
    tot = overall(records("gpu-h100-run32-e2e.json"))
    ar = tot["autoregressive"]
    fwd = records("gpu-h100-run32-device-forward.json", "rows")[0]
    before = records("gpu-h100-run32-device-forward-before.json", "rows")[0]
    assert (fwd["rows"], fwd["model"]) == (before["rows"], before["model"]) == (1, "qwen2.5-coder-1.5b-instruct")
    assert (f"takes {1e3 * fwd['graph_s']:.2f} ms at 1 row with a 512-token cache, {100 * fwd['of_limit']:.0f} % of "
            f"the HBM limit ({1e3 * fwd['limit_s']:.2f} ms), {before['graph_s'] / fwd['graph_s']:.2f}x faster") in text
    assert (f"our `autoregressive` decodes {ar:.2f} tokens/s ({100 * fwd['limit_s'] * ar:.0f} % of the HBM limit "
            f"per token), {ar / tot['hf-compile']:.2f}x transformers with a static cache + `torch.compile` "
            f"({tot['hf-compile']:.2f}); `serial` {tot['swiftspec-serial']:.2f} ({tot['swiftspec-serial'] / ar:.2f}x "
            f"ours), `colocated` {tot['swiftspec-colocated']:.2f} ({tot['swiftspec-colocated'] / ar:.2f}x), `colocated` "
            f"with the draft on 32 SMs {tot['swiftspec-profiled']:.2f} ({tot['swiftspec-profiled'] / ar:.2f}x)") in text
    assert {r["engine"]["draft_sms"] for r in records("gpu-h100-run32-e2e.json")
            if r["system"] == "swiftspec-profiled"} == {32}
    # run 35 (an H200): the forward with the slots in use on the device (and over the whole
    # capacity beside it), end to end, and the alternating before / after calls
    fwd35 = {(r["model"].split("-")[2], r["rows"]): r for r in records("gpu-h200-run35-device-forward.json", "rows")}
    t1, t8, d1, d8 = (fwd35[k] for k in (("1.5b", 1), ("1.5b", 8), ("0.5b", 1), ("0.5b", 8)))
    gain = {k: r["graph_unbounded_s"] / r["graph_s"] for k, r in (("t1", t1), ("t8", t8), ("d1", d1), ("d8", d8))}
    assert all(r["capacity"] == 4104 for r in fwd35.values())
    assert (f"takes {1e3 * t1['graph_s']:.2f} ms at 1 row ({100 * t1['of_limit']:.0f} % of the HBM limit, "
            f"{1e3 * t1['limit_s']:.2f} ms), {gain['t1']:.2f}x faster than over the whole capacity, and "
            f"{1e3 * t8['graph_s']:.2f} ms at 8 rows ({gain['t8']:.2f}x); the draft's {gain['d1']:.2f}x / "
            f"{gain['d8']:.2f}x") in text
    tot35, tot35b = (overall(records(f"gpu-h200-run35-{n}.json")) for n in ("e2e", "e2e-colocated-hf-compile"))
    ar35, ar35b = tot35["autoregressive"], tot35b["autoregressive"]
    assert (f"decodes {ar35:.2f} tokens/s, {100 * t1['limit_s'] * ar35:.0f} % of the HBM limit per token (a second call "
            f"on the same machine: {ar35b:.2f}, {100 * t1['limit_s'] * ar35b:.0f} %), {ar35b / tot35b['hf-compile']:.2f}x "
            f"`hf-compile` ({tot35b['hf-compile']:.2f}, its first prompt paying for compilation); `serial` "
            f"{tot35['swiftspec-serial'] / ar35:.2f}x ours, `colocated` {tot35b['swiftspec-colocated'] / ar35b:.2f}x") in text
    ab = {}
    for i, tree in ((1, "old"), (2, "new"), (3, "old"), (4, "new")):
        rec = json.loads((root / "bench" / "results" / f"gpu-h200-run35-e2e-ab-{i}-{tree}.json").read_text())
        ab[i] = {r["system"]: r["all"] for r in rec["table"]}
        if "records" in rec:  # the first call's own JSON: its table is what its records give
            assert {k: f"{v:.2f}" for k, v in overall(rec["records"]).items()} == ab[i]
    for system, label in (("autoregressive", "`autoregressive`"), ("swiftspec-serial", "`serial`")):
        assert (f"{label} {ab[1][system]} -> {ab[2][system]} and {ab[3][system]} -> {ab[4][system]}") in text, system
    with pytest.raises(ValueError):
        tables.render({"something": "else"})


def test_readme_and_results_quote_run38():
    """Run 38 (the ngram mode by default on AVX2, a real Zen 3): README's table and the quoted
    ratios are those of the record; every SwiftSpec request equals the target; the README command's
    records ran the modes they are quoted for."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]

    records = _committed
    readme = (root / "README.md").read_text()
    text = " ".join(readme.split())
    results = " ".join((root / "bench" / "RESULTS.md").read_text().split())
    recs = records("run38-zen3-6x5.json")
    tot = overall(recs)
    auto, prev = "swiftspec-profiled[auto]", "swiftspec-profiled[serial-bs2-d1-payback]"
    for system, label in ((auto, "SwiftSpec, default configuration (`mode=\"auto\"`: `ngram`"),
                          (prev, "SwiftSpec, the previous default"), ("autoregressive", "our `autoregressive`"),
                          ("llama-cpp", "llama.cpp on the same GGUF"), ("llama-cpp-spec", "llama.cpp speculative")):
        row = f"| {tot[system]:.2f} | {tot[system] / tot['llama-cpp']:.2f}x |"
        assert any(line.startswith(f"| {label}") and row in line for line in readme.splitlines()), system
    assert {r["ran"] for r in recs if r["system"] == auto} == {"ngram"}
    assert {r["dataset"] for r in recs if r["system"] == prev and r["ran"] == "autoregressive"} == {"sum"}
    assert all(r["matches_target"] for r in recs if r["system"] in (auto, prev))
    assert len([r for r in recs if r["system"] in (auto, prev)]) == 60

    def vs_ar(system, dataset):
        t = overall([r for r in recs if r["dataset"] == dataset])
        return f"{t[system] / t['autoregressive']:.2f}x"

    ds = ("humaneval", "sum", "gsm8k", "qa", "mt_bench", "alpaca")
    names = ("HumanEval", "SUM", "GSM8K", "QA", "MT-bench", "alpaca")
    assert ", ".join(f"{n} {vs_ar(auto, d)}" for n, d in zip(names, ds)) in results
    assert f"(the previous default: {' / '.join(vs_ar(prev, d) for d in ds)})" in results
    assert (f"The default mode decodes **{tot[auto] / tot['llama-cpp']:.2f}x llama.cpp** (goal 1.3x: met on this CPU "
            f"for the first time; runs 33-37: 1.09-1.27x), the previous default {tot[prev] / tot['llama-cpp']:.2f}x, "
            f"our `autoregressive` {tot['autoregressive'] / tot['llama-cpp']:.2f}x, llama.cpp's speculative mode "
            f"{tot['llama-cpp-spec'] / tot['llama-cpp']:.2f}x") in results
    assert (f"(HumanEval {vs_ar(auto, 'humaneval')} our `autoregressive`, summaries {vs_ar(auto, 'sum')}) and loses "
            f"nothing where it finds no match (alpaca {vs_ar(auto, 'alpaca')})") in text
    recs2 = records("run38-zen3-6x5-2.json")
    assert all(r["matches_target"] for r in recs2 if r["system"] in (auto, prev))
    assert len([r for r in recs2 if r["system"] in (auto, prev)]) == 60
    tot2 = overall(recs2)
    vs = [f"{tot2[s] / tot2['llama-cpp']:.2f}x" for s in (auto, prev, "autoregressive")]
    assert f"a second run right after it: {vs[0]}, {vs[1]} and {vs[2]}," in text
    assert (f"measured the default mode at {vs[0]} llama.cpp, the previous default at {vs[1]} and our "
            f"`autoregressive` at {vs[2]}.") in results
    cmd = {s: [records(f"readme-command-zen3-run38-{s}-{i}.json", "metrics") for i in (1, 2, 3)]
           for s in ("auto", "serial")}
    assert {m["mode"] for m in cmd["auto"]} == {"ngram"} and {m["mode"] for m in cmd["serial"]} == {"serial"}
    tps = {s: " / ".join(f"{m['tokens_per_s']:.2f}" for m in ms) for s, ms in cmd.items()}
    assert f"decoded {tps['auto']} tokens/s with `ngram` and {tps['serial']} with the previous default" in text
    assert f"{tps['serial']} tokens/s with the draft" in results and f"{tps['auto']} with `ngram`" in results


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
