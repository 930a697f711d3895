"""Models on native GGUF blocks: which layers keep their blocks, the kernels against the PyTorch
path, and lossless greedy decoding on them (tiny GGUFs
written by tests/test_loader.py's make_gguf)."""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from swiftspec import ops
from swiftspec.loader import convert_gguf
from swiftspec.models.llama import load_model
from tests.test_loader import make_gguf


@pytest.fixture(scope="module")
def gguf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("native")
    out = []
    for seed, up in ((0, Q.F16), (1, Q.F16), (2, Q.Q8_0)):  # 2: every linear layer on blocks
        path = root / f"tiny-{seed}.gguf"
        make_gguf(path, quant=Q.Q8_0, seed=seed, tied=False, ffn_up=up)
        out.append(convert_gguf(path, root / f"tiny-{seed}", progress=False))
    return out


def _step(model, ids, start, kv):
    n = len(ids)
    pos = torch.arange(start, start + n)
    mask = torch.zeros(n, kv.capacity if hasattr(kv, "capacity") else 64, dtype=torch.bool)
    for i in range(n):
        mask[i, : start + i + 1] = True
    return model.compute_logits(model(torch.tensor(ids), pos, pos.clone(), mask, kv))


def test_layers_keep_the_blocks_they_have_kernels_for(gguf_dirs, capsys):
    m = load_model(gguf_dirs[0], dtype=torch.float32, weights="native")
    layer = m.layers[0]
    assert layer.self_attn.qkv_proj.native.types == [int(Q.Q8_0)] * 3
    assert layer.self_attn.qkv_proj.weight is None
    assert layer.mlp.down_proj.native.types == [int(Q.Q4_K)]
    assert layer.mlp.gate_up_proj.native is None  # ffn_up is F16: the fused layer stays float
    assert m.embed_tokens.native is not None and m.lm_head.native is not None
    f = load_model(gguf_dirs[0], dtype=torch.float32, weights="float32")
    assert f.layers[0].self_attn.qkv_proj.native is None


def test_kernels_equal_pytorch_path_and_dequantized_model(gguf_dirs):
    m = load_model(gguf_dirs[0], dtype=torch.float32, weights="native")
    ids = [5, 9, 77, 3, 41, 8]
    on = _step(m, ids, 0, m.make_kv_cache(64))
    ops.set_kernels(False)
    try:
        off = _step(m, ids, 0, m.make_kv_cache(64))
    finally:
        ops.set_kernels(True)
    torch.testing.assert_close(on, off, rtol=1e-4, atol=1e-4)
    f = load_model(gguf_dirs[0], dtype=torch.float32, weights="float32")
    ref = _step(f, ids, 0, f.make_kv_cache(64))  # bf16-converted weights, fp32 activations: close only
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


def _tree_step(model, ids, positions, slots, visible, kv):
    mask = torch.zeros(len(ids), 128, dtype=torch.bool)
    for i, v in enumerate(visible):
        mask[i, v] = True
    return model.compute_logits(model(torch.tensor(ids), torch.tensor(positions), torch.tensor(slots), mask, kv))


def test_verification_batch_equals_one_token_forwards(gguf_dirs):
    """With every linear layer on GGUF blocks, each node of a verification tree gives bit for bit
    the logits of its token decoded alone after its ancestors (the quantized GEMM and the
    row-wise attention are batch invariant; masked-out siblings change nothing)."""
    m = load_model(gguf_dirs[2], dtype=torch.float32, weights="native")
    assert m.layers[0].mlp.gate_up_proj.native is not None
    L = 60
    prompt = [(7 * i + 3) % 200 for i in range(L)]
    prefix = list(range(L))
    # tree: 0 -> {1, 2}, 2 -> 3 (node 1 a sibling of node 2), in slots L..L+3
    toks, parents, depth = [41, 8, 100, 7], [-1, 0, 0, 2], [0, 1, 1, 2]
    visible = []
    for i in range(4):
        anc, j = [], i
        while j >= 0:
            anc.append(L + j)
            j = parents[j]
        visible.append(prefix + sorted(anc))
    kv = m.make_kv_cache(128)
    _tree_step(m, prompt, list(range(L)), list(range(L)), [list(range(i + 1)) for i in range(L)], kv)
    batch = _tree_step(m, toks, [L + d for d in depth], list(range(L, L + 4)), visible, kv)
    kv1 = m.make_kv_cache(128)  # the path 0 -> 2 -> 3 decoded one token at a time
    _tree_step(m, prompt, list(range(L)), list(range(L)), [list(range(i + 1)) for i in range(L)], kv1)
    for k, node in enumerate((0, 2, 3)):
        single = _tree_step(m, [toks[node]], [L + k], [L + k], [list(range(L + k + 1))], kv1)
        assert torch.equal(batch[node], single[0]), node
