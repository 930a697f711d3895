"""Several processes on one GPU (the machines lent to this project have one): two TP ranks on
cuda:0 with a gloo control group and the CUDA LL communicator (all-reduce fused into the row-parallel
GEMM, the LM head's all-gather as an all-reduce of zero-padded shards), their decode steps captured
in CUDA graphs; and async mode with the draft group and the target group as separate processes on
the same GPU. Tiny random fp32 models, the draft a copy of the target; greedy output must equal
autoregressive TP = 1. Skipped without a CUDA device (tests/test_shared_gpu.py checks the same
layouts' logic on CPU); scripts/gpu_probe.py records whether CUDA IPC and MPS work on a machine."""
from __future__ import annotations

import traceback

import pytest
import torch
from ranks import digest, rank_inputs, rank_sum, report, spawn_ranks

from swiftspec import Engine, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PROMPT = "hello world, this is a test"
GREEDY = SamplingParams(max_tokens=32, ignore_eos=True)
DEADLINE_S = 300.0


def _rank_main(rank, world, port, q):
    """One of two ranks on cuda:0: init_world picks gloo and the LL communicator; every collective
    the model uses, eager and replayed from a CUDA graph, against a rank-order sum."""
    try:
        import torch.distributed as dist

        from swiftspec.distributed.parallel import graph_ban, init_world

        torch.cuda.set_device(0)
        (ctx,) = init_world(rank, world, port, [list(range(world))], timeout_s=60.0, shm_comm=True,
                            device_type="cuda", devices=["cuda:0"] * world)
        res = {"backend": dist.get_backend(), "comm": ctx.comm_backend, "ban": graph_ban(ctx)}
        for it, (n, dtype) in enumerate([(1, torch.float32), (4099, torch.bfloat16), (300000, torch.float32)]):
            xs = [rank_inputs(it, r, (n,), dtype) for r in range(world)]
            y = ctx.all_reduce(xs[rank].cuda())
            res[f"ar{it}"] = (torch.equal(y.cpu(), rank_sum(xs)), digest(y))
        M, K, N = 3, 64, 96
        xs = [rank_inputs(10, r, (M, K), torch.float32) for r in range(world)]
        ws = [rank_inputs(11, r, (N, K), torch.float32) * K ** -0.5 for r in range(world)]
        out = ctx.gemm_all_reduce(xs[rank].cuda(), ws[rank].cuda())
        ref = sum(x @ w.t() for x, w in zip(xs, ws))
        res["gemm"] = (bool(torch.allclose(out.cpu(), ref, atol=1e-4, rtol=1e-4)), digest(out))
        shard = torch.full((2, 5), float(rank + 1), device="cuda")
        shard[:, -1] = float("-inf")  # the LM head pads a short last shard with -inf
        g = ctx.all_gather_last_dim(shard).cpu()
        want = torch.cat([torch.full((2, 5), float(r + 1)) for r in range(world)], dim=1)
        want[:, 4::5] = float("-inf")
        res["gather"] = (torch.equal(g, want), digest(g))
        # captured and replayed, as a TP > 1 decode step is
        x, w = xs[rank].cuda(), ws[rank].cuda()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            ctx.all_reduce(ctx.gemm_all_reduce(x, w))
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static = ctx.all_reduce(ctx.gemm_all_reduce(x, w))
        for it in range(3):
            graph.replay()
            torch.cuda.synchronize()
            res[f"graph{it}"] = (bool(torch.allclose(static.cpu(), 2 * ref, atol=1e-4, rtol=1e-4)), digest(static))
        res["epochs"] = ctx.shm.epoch()
        ctx.shm.close()
        dist.destroy_process_group()
        report(q, "ok", rank, res)
    except BaseException:
        report(q, "error", rank, traceback.format_exc())


@pytest.fixture(scope="module")
def kernels_built():
    """The kernel library built here once (no CUDA context needed), so ranks and workers only load it."""
    from swiftspec.ops import cuda_lib

    cuda_lib.load()


def test_two_ranks_on_one_gpu_run_the_ll_collectives(kernels_built):
    replies = spawn_ranks(_rank_main, 2, (), DEADLINE_S, "LL on one GPU")
    for r in (0, 1):
        assert (replies[r]["backend"], replies[r]["comm"], replies[r]["ban"]) == ("gloo", "ll", None)
        assert replies[r]["epochs"] > 0
    for key in replies[0]:
        if key in ("backend", "comm", "ban", "epochs"):
            continue
        (ok0, d0), (ok1, d1) = replies[0][key], replies[1][key]
        assert ok0 and ok1, f"{key}: wrong result"
        assert d0 == d1, f"{key}: the ranks disagree in the bits"


@pytest.fixture(scope="module")
def cuda_reference(tiny_dir, kernels_built):
    with Engine(tiny_dir, mode="autoregressive", dtype="float32", device="cuda") as eng:
        return eng.generate(PROMPT, GREEDY)


def _assert_processes_share_the_gpu(workers, n):
    assert len(workers) == n
    assert len({w["pid"] for w in workers}) == n, "one process per rank"
    assert {w["device"] for w in workers} == {"cuda:0"}
    for w in workers:
        assert all(k > 0 for k in w["cuda_graphs"].values()) and w["cuda_graphs"], f"no CUDA graphs: {w}"
        assert w["graph_ban"] is None
        if w["tp"] > 1:
            assert (w["comm_backend"], w["control_backend"]) == ("ll", "gloo"), w
            assert w["ll_epochs"] > 0


def test_tp2_on_one_gpu_equals_tp1(tiny_dir, cuda_reference):
    """TP = 2 with both ranks on cuda:0: LL all-reduce fused into the GEMM, graphs captured."""
    with Engine(tiny_dir, mode="autoregressive", dtype="float32", device="cuda", target_devices=[0, 0]) as eng:
        workers = eng.workers
        out = eng.generate(PROMPT, GREEDY)
    _assert_processes_share_the_gpu(workers, 2)
    assert out.token_ids == cuda_reference.token_ids


@pytest.mark.parametrize("target_devices", [[0], [0, 0]])
def test_async_groups_as_processes_on_one_gpu(tiny_dir, cuda_reference, target_devices):
    """The draft group and the target group (TP 1 or 2) as separate processes on cuda:0."""
    with Engine(tiny_dir, tiny_dir, mode="async", dtype="float32", device="cuda", target_devices=target_devices,
                draft_devices=[0]) as eng:
        workers = eng.workers
        out = eng.generate(PROMPT, GREEDY)
    _assert_processes_share_the_gpu(workers, len(target_devices) + 1)
    assert {w["kind"] for w in workers} == {"target", "draft"}
    if len(target_devices) > 1:
        assert {w["comm_backend"] for w in workers if w["kind"] == "target"} == {"ll"}
    assert out.token_ids == cuda_reference.token_ids
    assert out.metrics.compression_ratio > 1.5, "an identical draft must be accepted"
