"""Any TP degree by zero-padding heads and the intermediate size (SwiftSpec paper §4).

The TP > 1 models run in gloo worker processes (spawned, one per rank) and must give the TP = 1
logits; the head layout itself is checked in process.
"""
from __future__ import annotations

import traceback

import pytest
import torch
from conftest import build_tiny_model
from ranks import report, spawn_ranks

from swiftspec.model_executor.layers.linear import PAD, gqa_head_layout
from swiftspec.model_executor.models import load_model

IDS = [5, 17, 33, 2, 90, 41, 7, 7, 12, 60, 3, 99]
DEADLINE_S = 180.0  # generous: CI machines are shared and slow


def _logits(model, ids):
    n = len(ids)
    pos = torch.arange(n)
    h = model(torch.tensor(ids), pos, pos, torch.ones(n, n, dtype=torch.bool).tril(), model.make_kv_cache(32))
    return model.compute_logits(h)


def _rank_main(rank, world, port, jobs, out):
    """One TP rank: for each model dir, float logits then int8 logits (rank 0 reports them)."""
    try:
        torch.set_num_threads(1)
        from swiftspec.distributed.parallel import init_world

        (ctx,) = init_world(rank, world, port, [list(range(world))], timeout_s=30.0)
        results = []
        for model_dir in jobs:
            m = load_model(model_dir, tp=ctx, dtype=torch.float32)
            q = load_model(model_dir, tp=ctx, dtype=torch.float32, int8=True)
            results.append((_logits(m, IDS).numpy(), _logits(q, IDS).numpy(), m.num_kv_heads_local))
        report(out, "ok", rank, results if rank == 0 else None)
        torch.distributed.destroy_process_group()
    except BaseException:
        report(out, "error", rank, traceback.format_exc())


def _run_tp(tp, jobs):
    """Run ``jobs`` (model dirs) on ``tp`` spawned ranks; rank 0's list of
    ``(float logits, int8 logits, kv heads local)``. Never leaves a process behind."""
    replies = spawn_ranks(_rank_main, tp, ([str(j) for j in jobs],), DEADLINE_S, "TP")
    return [(torch.from_numpy(d), torch.from_numpy(q), kv) for d, q, kv in replies[0]]


def _tp1(model_dir):
    m = load_model(model_dir, dtype=torch.float32)
    q = load_model(model_dir, dtype=torch.float32, int8=True)
    return _logits(m, IDS), _logits(q, IDS), m.num_kv_heads_local


@pytest.fixture(scope="module")
def odd_models(tmp_path_factory):
    """Shapes no TP degree of 3 divides; each exercises one kind of padding."""
    root = tmp_path_factory.mktemp("tp-odd")
    return {
        # 10 q / 1 kv: units of 4 q heads, the last one half padding; the KV head on every rank;
        # q/k/v biases; intermediate 100 -> 34 per rank
        "qwen2-mqa": build_tiny_model(root / "qwen2-mqa", "qwen2", seed=4, hidden=80, heads=10, kv_heads=1,
                                      intermediate=100, std=0.1),
        # 4 q / 2 kv: one whole group per rank, rank 2 an all-padding unit; intermediate 128
        "qwen2-4-2": build_tiny_model(root / "qwen2-4-2", "qwen2", seed=5, heads=4, kv_heads=2,
                                      intermediate=128, std=0.1),
        # 12 q / 2 kv: 2 units of 2 q heads per rank, a KV head twice on rank 0; untied LM head
        "llama-12-2": build_tiny_model(root / "llama-12-2", "llama", seed=6, hidden=96, heads=12, kv_heads=2,
                                       intermediate=128, tie=False, std=0.1),
    }


def _check(got, want, name):
    (d, q, kv), (d1, q1, _) = got, want
    assert d.shape == d1.shape
    assert (d - d1).abs().max() < 1e-5, f"{name}: float logits differ from TP=1"
    # int8 layers compute in bf16 (see int8_linear), so sharded sums differ at bf16 rounding
    rel = (q - q1).abs().max() / q1.abs().max()
    assert rel < 2e-2, f"{name}: int8 logits differ from TP=1 int8 by {rel:.2e} (relative)"
    return kv


def test_head_layout_examples():
    q, kv = gqa_head_layout(12, 2, 3)
    assert q.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert kv.tolist() == [[0, 0], [0, 1], [1, 1]]
    q, kv = gqa_head_layout(12, 2, 5)
    assert q.tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11], [PAD] * 3]
    assert kv.tolist() == [[0], [0], [1], [1], [PAD]]
    q, kv = gqa_head_layout(10, 1, 3)
    assert q.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, PAD, PAD]] and kv.tolist() == [[0], [0], [0]]


@pytest.mark.parametrize("heads,kv_heads",
                         [(12, 2), (14, 2), (32, 8), (28, 4), (40, 8), (4, 4), (10, 1), (16, 16)])
@pytest.mark.parametrize("tp", [1, 2, 3, 4, 5, 6, 8])
def test_head_layout_invariants(heads, kv_heads, tp):
    q, kv = gqa_head_layout(heads, kv_heads, tp)
    g = heads // kv_heads
    assert q.shape[0] == kv.shape[0] == tp and q.shape[1] % kv.shape[1] == 0
    g_local = q.shape[1] // kv.shape[1]
    # every real query head exactly once, next to the KV head of its group
    real = q[q >= 0]
    assert sorted(real.tolist()) == list(range(heads))
    kv_of_q = kv.repeat_interleave(g_local, dim=1)
    assert torch.equal(kv_of_q[q >= 0], real // g)
    assert q.shape[1] < -(-heads // tp) + g  # at most one partial unit of padding per rank
    if heads % tp == 0 and kv_heads % tp == 0:  # Megatron's contiguous layout, no padding
        assert torch.equal(q, torch.arange(heads).view(tp, -1))
        assert torch.equal(kv, torch.arange(kv_heads).view(tp, -1))


def test_tp3_padded_equals_tp1(odd_models):
    """TP = 3 on shapes it does not divide: same logits as TP = 1, dense and int8."""
    got = _run_tp(3, list(odd_models.values()))
    kv_local = {name: _check(g, _tp1(d), name) for (name, d), g in zip(odd_models.items(), got)}
    assert kv_local == {"qwen2-mqa": 1, "qwen2-4-2": 1, "llama-12-2": 2}


def test_tp2_divisible_unchanged(tiny_dir):
    """A TP degree that divides everything pads nothing and still equals TP = 1."""
    from swiftspec.distributed.parallel import TPContext

    # the layout TP = 2 rank 1 gets without a process group (loading needs no collective)
    m = load_model(tiny_dir, tp=TPContext(rank=1, size=2), dtype=torch.float32)
    ref = load_model(tiny_dir, dtype=torch.float32)
    attn, attn1 = m.layers[0].self_attn, ref.layers[0].self_attn
    hd, I = m.cfg.head_dim, m.cfg.intermediate_size
    q, kv = m.cfg.num_heads * hd, m.cfg.num_kv_heads * hd
    w1 = attn1.qkv_proj.weight
    rank1 = torch.cat([w1[q // 2:q], w1[q + kv // 2:q + kv], w1[q + kv + kv // 2:]])
    assert torch.equal(attn.qkv_proj.weight, rank1)
    assert torch.equal(attn.o_proj.weight, attn1.o_proj.weight[:, q // 2:])
    gu1 = ref.layers[0].mlp.gate_up_proj.weight
    assert torch.equal(m.layers[0].mlp.gate_up_proj.weight, torch.cat([gu1[I // 2:I], gu1[I + I // 2:]]))
    assert torch.equal(m.layers[0].mlp.down_proj.weight, ref.layers[0].mlp.down_proj.weight[:, I // 2:])
    assert m.num_kv_heads_local == m.cfg.num_kv_heads // 2

    (got,) = _run_tp(2, [tiny_dir])
    assert got[2] == m.num_kv_heads_local
    _check(got, _tp1(tiny_dir), "tiny qwen2")
