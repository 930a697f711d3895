"""GGUF blocks at TP > 1: each rank keeps its rows (column-parallel layers, the vocabulary) or
whole blocks of its input features (row-parallel layers) as they are in the file, and the model
gives the TP = 1 native model's logits; speculative greedy output at TP = 2 on blocks equals the
target's own."""
from __future__ import annotations

import os
import traceback

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from ranks import report, spawn_ranks

from swiftspec.distributed.parallel import TPContext
from swiftspec.model_executor.layers.gguf import GGUFWeight, block_index
from swiftspec.model_executor.layers.linear import PAD, block_split
from swiftspec.model_executor.models.llama import load_model
from swiftspec.ops import quant
from swiftspec.weights.loader import convert_gguf
from tests.test_loader import make_gguf
from tests.trees import assert_tree_equals_path

IDS = [5, 17, 33, 2, 90, 41, 7, 7, 12, 60, 3, 99]


def test_block_index_takes_whole_blocks_only():
    f = torch.arange(64, 128)
    assert block_index(f, 32).tolist() == [2, 3]
    assert block_index(torch.cat([torch.arange(32), torch.full((32,), PAD)]), 32).tolist() == [0, PAD]
    assert block_index(torch.arange(16, 48), 32) is None  # a block cut between ranks
    assert block_index(torch.arange(0, 48), 32) is None  # not whole blocks
    assert block_index(torch.cat([torch.arange(16), torch.full((16,), PAD)]), 32) is None  # half a block padded
    assert block_index(torch.arange(32).flip(0), 32) is None


def test_block_split_deals_contiguous_whole_blocks():
    tp = lambda r, n: TPContext(rank=r, size=n)  # noqa: E731
    # 8960 = 35 Q4_K blocks over 2 ranks: 17 and 18, nothing padded
    parts = [block_split(8960, tp(r, 2), 256) for r in range(2)]
    assert [p.numel() for p in parts] == [17 * 256, 18 * 256]
    assert torch.equal(torch.cat(parts), torch.arange(8960))
    assert block_split(256, tp(0, 2), 256) is None  # a rank would get no block
    assert block_split(300, tp(0, 1), 256) is None


@pytest.mark.parametrize("ggml_type", [Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.Q5_0])
@pytest.mark.parametrize("tp_size", [2, 3])
def test_a_rank_holds_the_slices_of_the_dequantized_weight(ggml_type, tp_size):
    """Row shards (with padded rows) and K shards in whole blocks dequantize to exactly the
    slices of the whole weight's dequantized values, zero where padded; interleaved or not."""
    qk = quant.block_values(int(ggml_type))
    n, k = 48, 6 * max(qk, 32)
    g = torch.Generator().manual_seed(int(ggml_type))
    raw = torch.randint(0, 256, (n, quant.row_bytes(int(ggml_type), k)), dtype=torch.uint8, generator=g)
    bb = quant.row_bytes(int(ggml_type), qk)
    blocks = raw.view(n, -1, bb)
    blocks[..., :2] = torch.tensor([0x00, 0x2C], dtype=torch.uint8) if ggml_type != Q.Q6_K else blocks[..., :2]
    if ggml_type == Q.Q6_K:  # d (fp16) last: 0.0625 keeps the values finite and moderate
        blocks[..., -2:] = torch.tensor([0x00, 0x2C], dtype=torch.uint8)
    elif ggml_type == Q.Q4_K:
        blocks[..., 2:4] = torch.tensor([0x00, 0x2C], dtype=torch.uint8)
    full = quant.dequantize(raw, int(ggml_type))
    for rank in range(tp_size):
        per = -(-n // tp_size) + 8  # more rows than the weight has: the last ones padded
        rows = torch.arange(rank * per, (rank + 1) * per)
        rows = rows.masked_fill(rows >= n, PAD)
        nb = k // qk
        kb = torch.arange(rank * nb // tp_size, (rank + 1) * nb // tp_size)
        feats = (kb[:, None] * qk + torch.arange(qk)).reshape(-1)
        feats = torch.cat([feats, torch.full((qk,), PAD)])  # and one padded block
        for interleave in (0, 16):
            w = GGUFWeight(feats.numel(), [per], [int(ggml_type)], interleave, row_index=[rows], k_index=feats)
            w.weight_loader(None, raw)
            got = w.dequantized()[0]
            want = torch.zeros(per, feats.numel())
            keep = rows >= 0
            want[keep, : kb.numel() * qk] = full[rows[keep]][:, feats[: kb.numel() * qk]]
            assert torch.equal(got, want)


@pytest.fixture(scope="module")
def tp_ggufs(tmp_path_factory):
    """Every linear layer on blocks: Q8_0 QKV / o_proj / gate / up / LM head, Q4_K down_proj over an
    intermediate size of 3 Q4_K blocks (2 ranks: 1 and 2 blocks; 3 ranks: one each), untied head;
    the last one with an intermediate size of one Q4_K block."""
    root = tmp_path_factory.mktemp("native-tp")
    out = []
    for seed, ffn in ((0, 768), (1, 768), (2, 256)):
        path = root / f"tiny-{seed}.gguf"
        make_gguf(path, quant=Q.Q8_0, seed=seed, tied=False, ffn_up=Q.Q8_0, ffn=ffn)
        out.append(str(convert_gguf(path, root / f"tiny-{seed}", progress=False)))
    return out


def test_a_shard_that_would_cut_a_block_stays_float_with_a_notice(tp_ggufs, capsys):
    # building and loading a rank needs no collective: rank 0 of 2 without a process group
    m = load_model(tp_ggufs[2], tp=TPContext(rank=0, size=2), dtype=torch.float32, weights="native")
    assert "the shards of 2 layers (e.g. model.layers.0.mlp.down_proj) would cut GGUF blocks" in capsys.readouterr().err
    for layer in m.layers:
        assert layer.mlp.down_proj.native is None and layer.mlp.down_proj.weight.shape == (64, 128)
        assert layer.mlp.gate_up_proj.native is not None and layer.self_attn.o_proj.native is not None
    m = load_model(tp_ggufs[0], tp=TPContext(rank=1, size=2), dtype=torch.float32, weights="native")
    assert "would cut" not in capsys.readouterr().err
    down = m.layers[0].mlp.down_proj.native  # rank 1: the second and third of 3 blocks
    assert down.in_features == 512 and m.layers[0].mlp.gate_up_proj.native.out_features == 1024


def _logits(model, ids):
    n = len(ids)
    pos = torch.arange(n)
    h = model(torch.tensor(ids), pos, pos, torch.ones(n, n, dtype=torch.bool).tril(), model.make_kv_cache(32))
    return model.compute_logits(h)


def _native_layers(m):
    return sum(lin.native is not None for layer in m.layers
               for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj))


def _rank_main(rank, world, port, model_dir, dtype, out):
    try:
        torch.set_num_threads(1)
        from swiftspec.distributed.parallel import init_world

        (ctx,) = init_world(rank, world, port, [list(range(world))], timeout_s=30.0, shm_comm=rank >= 0)
        m = load_model(model_dir, tp=ctx, dtype=dtype, weights="native")
        logits = _logits(m, IDS)
        # batch invariance at TP > 1: a verification tree's nodes equal the same tokens decoded alone
        # (every rank runs the same forwards; tree 0 -> {1, 2}, 2 -> 3)
        assert_tree_equals_path(m, IDS, [41, 8, 100, 7], [-1, 0, 0, 2], [0, 2, 3], capacity=64)
        for layer in m.layers:  # the same ops module by module
            layer.all_native = False
        modules = _logits(m, IDS)
        report(out, "ok", rank, (logits.numpy(), modules.numpy(), _native_layers(m), m.lm_head.native is not None,
                                 m.embed_tokens.native is not None))
        torch.distributed.destroy_process_group()
    except BaseException:
        report(out, "error", rank, traceback.format_exc())


@pytest.mark.parametrize("tp_size", [2, 3])
def test_tp_model_on_blocks_gives_the_tp1_logits(tp_ggufs, tp_size):
    """Every rank gets the TP = 1 model's logits (within 1e-5: the row-parallel sums split at other
    points), a verification tree's nodes the bits of their tokens decoded alone, and the C++
    layer's halves with the all-reduces between them the modules' bits."""
    ref_model = load_model(tp_ggufs[0], dtype=torch.float32, weights="native")
    assert _native_layers(ref_model) == 8
    ref = _logits(ref_model, IDS)
    replies = spawn_ranks(_rank_main, tp_size, (tp_ggufs[0], torch.float32), 180.0, "native TP")
    for rank, (logits, modules, n_native, head, embed) in replies.items():
        assert n_native == 8 and head and embed, f"rank {rank} dequantized a layer"
        torch.testing.assert_close(torch.from_numpy(logits), ref, rtol=1e-5, atol=1e-5)
        assert torch.equal(torch.from_numpy(logits), torch.from_numpy(modules))


def test_tp_layer_halves_equal_the_modules_in_bfloat16(tp_ggufs):
    replies = spawn_ranks(_rank_main, 2, (tp_ggufs[1], torch.bfloat16), 180.0, "native TP bf16")
    for rank, (logits, modules, n_native, _, _) in replies.items():
        assert n_native == 8
        assert torch.equal(torch.from_numpy(logits), torch.from_numpy(modules)), f"rank {rank}"


def test_speculative_greedy_at_tp2_on_blocks_equals_the_target(tp_ggufs):
    from swiftspec import Engine, SamplingParams

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 cores")
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    prompt = [5, 9, 77, 3]
    outs = {}
    for mode in ("autoregressive", "serial"):
        with Engine(tp_ggufs[0], tp_ggufs[1], mode=mode, dtype="float32", draft_vocab=None, target_tp=2) as e:
            outs[mode] = e.generate(prompt, params).token_ids
    assert outs["serial"] == outs["autoregressive"]
    assert len(outs["serial"]) == 24


def test_layer_halves_check_their_shapes(tp_ggufs):
    m = load_model(tp_ggufs[0], dtype=torch.float32, weights="native")
    layer = m.layers[0].native_layer()
    with pytest.raises(RuntimeError, match="o and residual must be"):
        layer.mlp(torch.zeros(2, 64), torch.zeros(3, 64))
