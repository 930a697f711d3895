"""Models on native GGUF blocks: which layers keep their blocks, the kernels against the PyTorch
path, and lossless greedy decoding on them (tiny GGUFs
written by tests/test_loader.py's make_gguf)."""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from swiftspec import ops
from swiftspec.model_executor.models.llama import load_model
from swiftspec.ops import quant
from swiftspec.weights.loader import convert_gguf
from tests.test_loader import make_gguf
from tests.trees import assert_tree_equals_path


@pytest.fixture(scope="module")
def gguf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("native")
    out = []
    for seed, up in ((0, Q.F16), (1, Q.F16), (2, Q.Q8_0)):  # 2: every linear layer on blocks
        path = root / f"tiny-{seed}.gguf"
        make_gguf(path, quant=Q.Q8_0, seed=seed, tied=False, ffn_up=up)
        out.append(convert_gguf(path, root / f"tiny-{seed}", progress=False))
    return out


def _prefill(model, ids, kv):
    n = len(ids)
    pos = torch.arange(n)
    return model.compute_logits(model(torch.tensor(ids), pos, pos.clone(), torch.ones(n, n, dtype=torch.bool).tril(), kv))


def test_layers_keep_the_blocks_they_have_kernels_for(gguf_dirs, capsys):
    m = load_model(gguf_dirs[0], dtype=torch.float32, weights="native")
    layer = m.layers[0]
    qkv = layer.self_attn.qkv_proj.native
    # the blocks stay as they are, interleaved by 16 or 8 rows where the SIMD kernels read that layout
    g = ops.quant_interleave_rows()
    assert [quant.base_type(t) for t in qkv.types] == [int(Q.Q8_0)] * 3
    start = 0
    for t, part in zip(qkv.types, qkv.parts):
        assert t == (quant.interleaved_type(int(Q.Q8_0), part.shape[0], start, g) if g else int(Q.Q8_0))
        start += part.shape[0]
    assert layer.self_attn.qkv_proj.weight is None
    down = layer.mlp.down_proj.native
    assert down.types == [quant.interleaved_type(int(Q.Q4_K), down.out_features, 0, g) if g else int(Q.Q4_K)]
    assert layer.mlp.gate_up_proj.native is None  # ffn_up is F16: the fused layer stays float
    assert m.embed_tokens.native is not None and m.lm_head.native is not None
    f = load_model(gguf_dirs[0], dtype=torch.float32, weights="float32")
    assert f.layers[0].self_attn.qkv_proj.native is None


def test_kernels_equal_pytorch_path_and_dequantized_model(gguf_dirs):
    m = load_model(gguf_dirs[0], dtype=torch.float32, weights="native")
    ids = [5, 9, 77, 3, 41, 8]
    on = _prefill(m, ids, m.make_kv_cache(64))
    ops.set_kernels(False)
    try:
        off = _prefill(m, ids, m.make_kv_cache(64))
    finally:
        ops.set_kernels(True)
    torch.testing.assert_close(on, off, rtol=1e-4, atol=1e-4)
    f = load_model(gguf_dirs[0], dtype=torch.float32, weights="float32")
    ref = _prefill(f, ids, f.make_kv_cache(64))  # bf16-converted weights, fp32 activations: close only
    assert (on.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.8


def test_serial_greedy_equals_autoregressive_on_native_weights(gguf_dirs):
    from swiftspec import Engine, SamplingParams

    params = SamplingParams(max_tokens=24, ignore_eos=True)
    outs = {}
    for mode in ("serial", "autoregressive"):
        with Engine(str(gguf_dirs[0]), str(gguf_dirs[1]), mode=mode, dtype="float32", draft_vocab=None,
                    target_cores=[0], draft_cores=[0]) as e:
            outs[mode] = e.generate([5, 9, 77, 3], params).token_ids
    assert outs["serial"] == outs["autoregressive"]


def test_verification_batch_equals_one_token_forwards(gguf_dirs):
    """With every linear layer on GGUF blocks, each node of a verification tree gives bit for bit
    the logits of its token decoded alone after its ancestors (the quantized GEMM and the
    row-wise attention are batch invariant; masked-out siblings change nothing)."""
    m = load_model(gguf_dirs[2], dtype=torch.float32, max_positions=512, weights="native")
    assert m.layers[0].mlp.gate_up_proj.native is not None
    # the prefix ends below a 256-key attention split: node 2 is verified at slot 256 (position 255)
    # and decoded at slot 255, node 3 at slot 257 and 256
    prompt = [(7 * i + 3) % 200 for i in range(254)]
    # tree: 0 -> {1, 2}, 2 -> 3 (node 1 a sibling of node 2)
    assert_tree_equals_path(m, prompt, [41, 8, 100, 7], [-1, 0, 0, 2], [0, 2, 3], capacity=320)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_layer_in_one_call_equals_the_modules(gguf_dirs, dtype):
    """The C++ decoder layer (one call per layer) gives bit for bit what the module-by-module
    path gives, for 1 to 16 rows, with and without an incoming residual, and writes the same KV."""
    with torch.no_grad():
        twin = ops.native_layer_twin(torch.zeros(1, 8, dtype=dtype))
    if not twin:
        pytest.skip("no CPU twin of RMSNorm / tree attention here")
    m = load_model(gguf_dirs[2], dtype=dtype, weights="native")
    layer = m.layers[0]
    assert layer.all_native
    g = torch.Generator().manual_seed(0)
    for n in (1, 3, 8, 16):
        x = torch.randn(n, m.cfg.hidden_size, generator=g).to(dtype)
        res = torch.randn(n, m.cfg.hidden_size, generator=g).to(dtype)
        pos = torch.arange(20, 20 + n)
        mask = torch.ones(n, 40, dtype=torch.bool).tril(20)
        for residual in (None, res):
            kvs = [m.make_kv_cache(64) for _ in range(2)]
            for kv in kvs:
                kv.layer(0)[0][:, :20].normal_(generator=torch.Generator().manual_seed(n))
            with torch.inference_mode():
                a = layer(x, residual, pos, m.rope, pos.clone(), mask, kvs[0].layer(0))
                b = layer.forward_modules(x, residual, pos, m.rope, pos.clone(), mask, kvs[1].layer(0))
            assert layer._native_layer is not None  # the one-call path ran
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
            assert torch.equal(kvs[0].buf, kvs[1].buf)


def test_all_layers_in_one_call_equal_the_layer_calls(gguf_dirs):
    """The model's forward (every layer in one C++ call) gives bit for bit what calling each
    layer in turn gives, for 1 to 16 rows, and writes the same KV."""
    with torch.no_grad():
        if not ops.native_layer_twin(torch.zeros(1, 8)):
            pytest.skip("no CPU twin of RMSNorm / tree attention here")
    m = load_model(gguf_dirs[2], weights="native")
    assert m.all_native and m.tp.size == 1
    for n in (1, 2, 5, 16):
        ids, pos = torch.arange(3, 3 + n), torch.arange(20, 20 + n)
        mask = torch.ones(n, 40, dtype=torch.bool).tril(20)
        kvs = [m.make_kv_cache(64) for _ in range(2)]
        for kv in kvs:
            kv.buf[:, :, :, :20].normal_(generator=torch.Generator().manual_seed(n))
        with torch.inference_mode():
            a = m(ids, pos, pos.clone(), mask, kvs[0])
            x, res = m.embed_tokens(ids), None
            for i in m.stage:
                x, res = m.layers[i](x, res, pos, m.rope, pos.clone(), mask, kvs[1].layer(i))
            b = m.norm(x, res)[0]
        assert m._native_layers is not None  # the one-call path ran
        assert torch.equal(a, b)
        assert torch.equal(kvs[0].buf, kvs[1].buf)
