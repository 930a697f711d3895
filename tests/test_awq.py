"""AWQ int4 checkpoints: the fixture is packed by autoawq's own code (tests/fixtures/
make_awq_fixture.py), so the format is not only read through our understanding of it. Unpacking
against autoawq's dequantization, the repack into AWQ4 blocks, the cached conversion, the
engine's logits against the dequantized model, lossless greedy decoding on the blocks, and the
errors for variants without a kernel."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from swiftspec import ops
from swiftspec.model_executor.models.llama import load_model, native_types
from swiftspec.ops import quant
from swiftspec.weights import awq
from swiftspec.weights.loader import ModelLoadError, resolve_model
from swiftspec.weights.model_cache import is_complete
from tests.conftest import build_tokenizer

FIXTURES = Path(__file__).parent / "fixtures"
GROUP = 64


@pytest.fixture(scope="module")
def awq_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("awq") / "awq-tiny-qwen2"
    shutil.copytree(FIXTURES / "awq-tiny-qwen2", d)
    build_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def converted(awq_dir, tmp_path_factory) -> tuple[Path, Path]:
    """(bf16 float copy as resolve_model makes it, fp32 float copy)."""
    cache = tmp_path_factory.mktemp("awq-cache")
    return resolve_model(awq_dir, "target", cache_dir=cache, progress=False), \
        awq.convert_awq(awq_dir, cache / "fp32", torch.float32)


def _layer(st, name):
    return [st[f"{name}.{s}"] for s in ("qweight", "qzeros", "scales")]


def test_unpacking_equals_autoawqs_dequantization():
    st = load_file(str(FIXTURES / "awq-tiny-qwen2" / "model.safetensors"))
    ref = load_file(str(FIXTURES / "awq-tiny-qwen2-reference.safetensors"))
    assert len(ref) == 7
    for name, want in ref.items():  # autoawq's dequantize_gemm: [in, out], computed in fp16
        w = awq.dequantize_awq(*_layer(st, name), GROUP)
        assert w.dtype == torch.float32 and tuple(w.shape) == tuple(want.T.shape)
        assert torch.equal(w.half(), want.T), name  # ours is exact; rounded to fp16 it is theirs
        blocks = awq.repack_awq(*_layer(st, name), GROUP)
        assert blocks.shape == (w.shape[0], w.shape[1] // 32 * 20)
        assert torch.equal(quant.dequantize(blocks, quant.AWQ4), w), name


def test_conversion_is_cached_and_keeps_blocks(awq_dir, converted, monkeypatch):
    out, _ = converted
    assert out.name.startswith("awq-tiny-qwen2-awq-") and is_complete(out, awq.source_id(awq_dir))
    types = native_types(out)
    assert len(types) == 14 and set(types.values()) == {quant.AWQ4}
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in cfg and (out / "tokenizer.json").is_file()
    monkeypatch.setattr(awq, "convert_awq", lambda *a, **k: pytest.fail("converted twice"))
    assert resolve_model(awq_dir, "target", cache_dir=out.parent.parent, progress=False) == out


def _prefill(model, ids):
    n = len(ids)
    pos = torch.arange(n)
    kv = model.make_kv_cache(64)
    return model.compute_logits(model(torch.tensor(ids), pos, pos.clone(), torch.ones(n, n, dtype=torch.bool).tril(), kv))


def test_engine_logits_equal_the_dequantized_reference(awq_dir, converted):
    from transformers import AutoModelForCausalLM

    _, fp32_dir = converted
    ids = [5, 9, 77, 3, 41, 8, 100, 64]
    native = load_model(fp32_dir, dtype=torch.float32, weights="native")
    # AWQ4 blocks, interleaved by 8 rows where the SIMD kernels read that layout
    qkv, down = native.layers[0].self_attn.qkv_proj.native, native.layers[1].mlp.down_proj.native
    g = ops.quant_interleave_rows()
    assert [quant.base_type(t) for t in qkv.types] == [quant.AWQ4] * 3
    assert down.types == [quant.interleaved_type(quant.AWQ4, down.out_features, 0, g) if g else quant.AWQ4]
    assert native.layers[0].all_native
    on = _prefill(native, ids)
    ops.set_kernels(False)
    try:
        off = _prefill(native, ids)  # PyTorch: the same int8 activations, dequantized fp32 weights
    finally:
        ops.set_kernels(True)
    torch.testing.assert_close(on, off, rtol=1e-4, atol=1e-4)
    # the dequantized model: ours on fp32 weights equals transformers' on the same weights
    floats = load_model(fp32_dir, dtype=torch.float32, weights="float32")
    ref = _prefill(floats, ids)
    hf = AutoModelForCausalLM.from_pretrained(fp32_dir, dtype=torch.float32)
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ref, want, rtol=1e-4, atol=1e-4)
    # native (int8 activations) against the dequantized model: the activation rounding only
    assert (on.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.85
    assert (on - ref).abs().max() <= 0.05 * ref.abs().max()


def test_greedy_decoding_on_awq_blocks_is_lossless(converted):
    from swiftspec import Engine, SamplingParams

    out, _ = converted
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    outs, metrics = {}, {}
    for mode in ("serial", "autoregressive"):
        with Engine(str(out), str(out), mode=mode, dtype="float32", draft_vocab=None,
                    target_cores=[0], draft_cores=[0]) as e:
            r = e.generate([5, 9, 77, 3], params)
            outs[mode], metrics[mode] = r.token_ids, r.metrics
    assert outs["serial"] == outs["autoregressive"]
    assert metrics["serial"].compression_ratio > 1.5  # the draft is the target: every node accepted


@pytest.mark.parametrize("change, match", [
    ({"bits": 8}, "only 4-bit GEMM"),
    ({"version": "gemv"}, "only 4-bit GEMM"),
    ({"zero_point": False}, "only 4-bit GEMM"),
    ({"group_size": 48}, "not a multiple of 32"),
])
def test_unsupported_awq_variants_raise(awq_dir, tmp_path, change, match):
    d = tmp_path / "variant"
    shutil.copytree(awq_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"].update(change)
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=match):
        resolve_model(d, "target", cache_dir=tmp_path / "cache", progress=False)
    assert not (tmp_path / "cache" / "models").exists() or not any((tmp_path / "cache" / "models").iterdir())


def test_broken_checkpoints_raise_and_leave_nothing(awq_dir, tmp_path):
    d = tmp_path / "broken"
    shutil.copytree(awq_dir, d)
    st = load_file(str(d / "model.safetensors"))
    del st["model.layers.1.mlp.up_proj.qzeros"]
    save_file(st, str(d / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="up_proj lacks .*qzeros"):
        resolve_model(d, "target", cache_dir=tmp_path / "cache", progress=False)
    cfg = json.loads((awq_dir / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="'gptq' is not supported"):
        resolve_model(d, "target", cache_dir=tmp_path / "cache", progress=False)
    models = tmp_path / "cache" / "models"
    assert not models.exists() or not any(models.iterdir())  # no half-built directory
