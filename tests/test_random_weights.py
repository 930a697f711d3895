"""Random weights made on the device (the big GPU shapes), degraded acceptance replay, the memory
check for one resident system, the read-bandwidth limit and the one-call GPU script."""
import importlib.util
import json
import math
import tarfile
from pathlib import Path

import pytest
import torch

from swiftspec.spec_decode import acceptance
from swiftspec.weights import random_weights
from swiftspec.weights.random_weights import DEFAULT_CONFIGS, materialize, packaged_config

ROOT = Path(__file__).resolve().parents[1]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


def tiny_config(tmp_path, **kw):
    """A config.json of the draft's family shrunk to a few KiB of weights (vocabulary 300)."""
    cfg = dict(json.loads(DEFAULT_CONFIGS[1].read_text()), hidden_size=64, intermediate_size=128,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=300,
               eos_token_id=299, bos_token_id=298, **kw)
    path = tmp_path / f"tiny{len(kw)}.json"
    path.write_text(json.dumps(cfg))
    return path


def test_recipe_directory_holds_no_weights_and_is_cached(tmp_path):
    """A recipe directory is config + tokenizer + recipe (no safetensors); the same config, seed,
    dtype and tokenizer give the same directory in any cache, the cache is reused, another seed or
    tokenizer size is another directory; bad input is refused."""
    from transformers import AutoTokenizer

    from swiftspec.weights.loader import resolve_model

    cfg = tiny_config(tmp_path)
    a = materialize(cfg, "float32", cache_dir=tmp_path / "c1")
    b = materialize(cfg, "float32", cache_dir=tmp_path / "c2")
    assert not list(a.glob("*.safetensors")) and (a / random_weights.RECIPE_FILE).is_file()
    assert a.name == b.name and (a / "random_weights.json").read_text() == (b / "random_weights.json").read_text()
    assert materialize(cfg, "float32", cache_dir=tmp_path / "c1") == a
    assert materialize(cfg, "float32", seed=1, cache_dir=tmp_path / "c1") != a
    small = materialize(cfg, "float32", cache_dir=tmp_path / "c1", tokenizer_vocab=290)
    assert small != a and len(AutoTokenizer.from_pretrained(str(small))) == 290
    tok = AutoTokenizer.from_pretrained(str(a))
    assert len(tok) == 300 and tok.eos_token_id == 299
    assert random_weights.recipe(a) == {"seed": 0, "dtype": "float32", "std": 0.02}
    assert resolve_model(a, "target") == a  # the engine takes it as a model directory
    with pytest.raises(ValueError, match="model_type"):
        (tmp_path / "x.json").write_text("{}")
        materialize(tmp_path / "x.json", cache_dir=tmp_path / "c1")
    with pytest.raises(FileNotFoundError):
        materialize(tmp_path / "none.json", cache_dir=tmp_path / "c1")
    with pytest.raises(ValueError, match="tokenizer_vocab"):
        materialize(cfg, cache_dir=tmp_path / "c1", tokenizer_vocab=301)
    with pytest.raises(ValueError, match="dtype"):
        materialize(cfg, "int8", cache_dir=tmp_path / "c1")


@pytest.mark.parametrize("device", DEVICES)
def test_ours_and_transformers_make_the_same_weights_on_the_device(tmp_path, device):
    """Our loader and the transformers peer build the recipe's model on the device with the same
    bytes (equal logits); loading again gives the same weights; norms are 1, biases 0 and the
    matrices N(0, initializer_range); the weight bytes are those of the shapes."""
    from swiftspec.benchmark.peers import hf_model
    from swiftspec.model_executor.models.llama import load_model

    d = materialize(tiny_config(tmp_path), "float32", cache_dir=tmp_path / "c")
    ours = load_model(d, dtype=torch.float32, max_positions=64, device=device)
    again = load_model(d, dtype=torch.float32, max_positions=64, device=device)
    assert all(p.device.type == device for p in ours.parameters())
    for (name, p), (_, q) in zip(ours.named_parameters(), again.named_parameters()):
        assert torch.equal(p, q), name
    layer = ours.layers[0]
    assert torch.equal(layer.input_layernorm.weight, torch.ones_like(layer.input_layernorm.weight))
    assert not layer.self_attn.qkv_proj.bias.any()
    w = layer.mlp.down_proj.weight
    assert abs(w.std().item() - 0.02) < 0.002 and abs(w.mean().item()) < 0.002
    hf = hf_model(d, torch.float32, torch.device(device))
    assert random_weights.weight_bytes(d) == sum(p.numel() * 4 for p in hf.parameters())
    ids = torch.tensor([[1, 5, 9, 200]], device=device)
    kv = ours.make_kv_cache(16, torch.device(device))
    pos = torch.arange(4, device=device)
    with torch.no_grad():
        want = hf(ids).logits[0]
        got = ours.compute_logits(ours(ids[0], pos, pos, torch.ones(4, 4, dtype=torch.bool, device=device).tril(), kv))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_shipped_big_shapes_have_their_published_sizes():
    """The GPU benchmark's targets: Qwen2.5 7B / 14B / 32B Instruct shapes (parameter counts as
    published: 7.62B, 14.77B, 32.76B), found by name, sharing the draft's tokenizer family."""
    published = {"qwen2.5-7b-instruct": 7.62e9, "qwen2.5-14b-instruct": 14.77e9, "qwen2.5-32b-instruct": 32.76e9}
    for name, count in published.items():
        path = packaged_config(name)
        config = json.loads(path.read_text())
        n = sum(math.prod(shape) for _, _, shape in random_weights.checkpoint_entries(config))
        assert abs(n - count) / count < 0.005, (name, n)
        assert config["vocab_size"] >= json.loads(DEFAULT_CONFIGS[1].read_text())["vocab_size"]
        assert config["eos_token_id"] == 151645 and config["model_type"] == "qwen2"
    with pytest.raises(FileNotFoundError, match="qwen2.5-7b-instruct"):
        packaged_config("no-such-model")


def test_degraded_replay_moves_ranks_down_with_probability_p():
    ranks = (3,) + tuple([0, 1, None, 31] * 500)
    r = acceptance.Replay(ranks)
    assert r.degraded(0.0, seed=1) is r
    all_down = r.degraded(1.0, seed=1).ranks
    assert all_down[0] == 3  # the prefill's token is never replayed: untouched
    assert all_down[1:5] == (1, 2, None, None)  # rank 31 + 1 is past the ranked candidates
    some = r.degraded(0.3, seed=7)
    moved = sum(a != b for a, b in zip(ranks[1:], some.ranks[1:]) if a is not None)
    assert 0.25 < moved / 1500 < 0.35
    assert some == r.degraded(0.3, seed=7) and some != r.degraded(0.3, seed=8)
    assert all(b in (a, None if a == 31 else a + 1) for a, b in zip(ranks, some.ranks) if a is not None)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        r.degraded(1.5, seed=0)


def test_memory_check_for_one_resident_system_at_a_time():
    from swiftspec.benchmark.weight_memory import InsufficientMemoryError, check_memory

    need = {"autoregressive": 60 * 2**30, "swiftspec-serial": 62 * 2**30}
    check_memory(need, 70 * 2**30, together=False, where="cuda")  # the largest fits alone
    with pytest.raises(InsufficientMemoryError, match="together"):
        check_memory(need, 70 * 2**30)
    with pytest.raises(InsufficientMemoryError, match="GPU memory"):
        check_memory(need, 61 * 2**30, together=False, where="cuda")


def test_read_bandwidth_and_spec_sheet():
    from swiftspec.benchmark.memory import read_bandwidth, spec_sheet_bandwidth

    assert spec_sheet_bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12
    assert spec_sheet_bandwidth("NVIDIA H100 PCIe") == 2.0e12
    assert spec_sheet_bandwidth("NVIDIA H200") == 4.8e12
    assert spec_sheet_bandwidth("Some GPU") is None and spec_sheet_bandwidth(None) is None
    assert read_bandwidth(torch.device("cpu"), 1, passes=1) > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_read_bandwidth_on_cuda_reads_four_gib():
    from swiftspec.benchmark.memory import copy_bandwidth, read_bandwidth

    free = torch.cuda.mem_get_info()[0]
    if free < 5 * 2**30:
        pytest.skip("less than 5 GiB free")
    assert read_bandwidth(torch.device("cuda"), 1, passes=2) > 0 and copy_bandwidth(torch.device("cuda")) > 0
    assert torch.cuda.memory_allocated() < 2**30  # the 4 GiB buffer is freed


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_gpu_script_plans_the_shapes_that_fit_and_its_commands_parse(tmp_path):
    """scripts/gpu_check.py: 32B on a GPU of 120 GiB or more, 14B below; every stage's bench
    command parses with the bench's own parser and names shipped shapes."""
    from swiftspec.benchmark.e2e import build_parser

    gc = _gpu_check()
    assert gc.shapes(139)[1] == "qwen2.5-32b-instruct" and gc.shapes(79)[1] == "qwen2.5-14b-instruct"
    assert "qwen2.5-32b-instruct" not in gc.shapes(79)[0]
    (e2e,) = gc.stage_commands("e2e", tmp_path, "python", 139, 1)
    args = build_parser().parse_args(e2e[e2e.index("bench") + 1:])
    assert args.random_weights and args.degrade == [0.0, 0.15, 0.3]
    assert packaged_config(args.target_config) and packaged_config(args.draft_config)
    (steps,) = gc.stage_commands("steps", tmp_path, "python", 79, 1)
    models = steps[steps.index("--models") + 1:steps.index("--out")]
    assert all(packaged_config(m) for m in models)
    assert all((ROOT / t).is_file() for t in gc.CUDA_TESTS)
    with pytest.raises(ValueError, match="stages"):
        gc.stage_commands("nope", tmp_path, "python", 79, 1)


def test_gpu_script_bounds_each_command_and_publishes_three_files(tmp_path):
    gc = _gpu_check()
    with open(tmp_path / "log", "w") as log:
        assert gc.run_bounded(["sleep", "30"], 1, log) == 124
        assert gc.run_bounded(["true"], 10, log) == 0
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    out.mkdir()
    (work / "x.json").write_text(json.dumps([{"unknown": "record"}]))
    gc.publish(work, out, [{"stage": "tests", "codes": [0], "seconds": 1.0}])
    assert sorted(p.name for p in out.iterdir()) == ["records.tar.gz", "summary.md"]
    assert "| tests | 0 | 1 |" in (out / "summary.md").read_text()
    with tarfile.open(out / "records.tar.gz") as tar:
        assert sorted(tar.getnames()) == ["stages.json", "x.json"]
