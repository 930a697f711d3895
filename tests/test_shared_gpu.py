"""Ranks sharing one GPU, checked without one: the control backend init_world picks and its errors
(gloo where a group puts two ranks on one GPU, the LL communicator required there, no silent
fallback), the CUDA-graph ban lifted only for the CUDA LL communicator, what a worker reports when
ready. The GPU runs of the same paths are in tests/test_cuda_shared_gpu.py."""
from __future__ import annotations

import json
import os
import time
import traceback
from types import SimpleNamespace

import pytest
import torch
from ranks import report, spawn_ranks

from swiftspec.distributed.parallel import PROBE, TPContext, graph_ban
from swiftspec.engine.config import EngineConfig
from swiftspec.engine.worker import WorkerSpec, decode_graph_sizes, graph_buckets, ready_info


class FakeComm:
    """Stands for a communicator: only its ``backend`` name and epoch matter here."""

    def __init__(self, backend, epoch=0):
        self.backend, self._epoch = backend, epoch

    def epoch(self):
        return self._epoch


def test_graph_ban_is_lifted_only_for_the_cuda_ll_communicator():
    assert graph_ban(TPContext()) is None  # TP = 1: no collective to capture
    assert graph_ban(TPContext(rank=1, size=2, shm=FakeComm("ll"), control="gloo")) is None
    assert graph_ban(TPContext(rank=0, size=2, shm=FakeComm("ll"), control="nccl")) is None
    for tp, name in ((TPContext(size=2, control="nccl"), "nccl"), (TPContext(size=2, control="gloo"), "gloo"),
                     (TPContext(size=2, shm=FakeComm("shm"), control="gloo"), "shm")):
        why = graph_ban(tp)
        assert why is not None and f"over {name}" in why and "eagerly" in why
    assert TPContext().comm_backend == "local"
    assert TPContext(size=2, shm=FakeComm("ll"), control="gloo").comm_backend == "ll"
    assert TPContext(size=2, control="nccl").comm_backend == "nccl"


def _spec(cuda_graphs=True, **kw):
    return WorkerSpec(**{"config": EngineConfig(cuda_graphs=cuda_graphs), "rank": 0, "world_size": 2, "port": 1,
                         "groups": [[0, 1]], "group": 0, "models": {"target": "T"}, "kind": "autoregressive",
                         "device": "cuda:0", **kw})


def test_worker_captures_graphs_at_tp2_only_on_ll():
    ll = TPContext(rank=0, size=2, shm=FakeComm("ll"), control="gloo")
    nccl = TPContext(rank=0, size=2, control="nccl")
    spec = _spec()
    assert decode_graph_sizes(spec, ll, "target") == graph_buckets(spec.verify_rows)
    assert decode_graph_sizes(spec, ll, "draft") == graph_buckets(2 * spec.tree.bs)
    assert decode_graph_sizes(spec, TPContext(), "target") == graph_buckets(spec.verify_rows)
    assert decode_graph_sizes(spec, nccl, "target") is None  # the ban kept where collectives are not captured
    assert decode_graph_sizes(_spec(cuda_graphs=False), ll, "target") is None
    assert decode_graph_sizes(_spec(device="cpu"), ll, "target") is None


def test_ready_info_names_the_backend_graphs_and_device():
    step = SimpleNamespace(graphs={1: None, 2: None, 4: None})
    runners = {"target": SimpleNamespace(step=step, model=torch.nn.Module()),
               "draft": SimpleNamespace(step=None, model=torch.nn.Module())}
    info = ready_info(_spec(), TPContext(rank=1, size=2, shm=FakeComm("ll", epoch=7), control="gloo"), runners)
    assert info["pid"] == os.getpid() and info["device"] == "cuda:0" and info["tp"] == 2 and info["group_rank"] == 1
    assert (info["comm_backend"], info["control_backend"], info["ll_epochs"]) == ("ll", "gloo", 7)
    assert info["cuda_graphs"] == {"target": 3, "draft": 0} and info["graph_ban"] is None
    assert info["quant_layout_rows"] == {"target": [], "draft": []} and info["kernels"] is None  # on CUDA
    info = ready_info(_spec(), TPContext(size=2, control="nccl"), {"target": SimpleNamespace(step=None, model=torch.nn.Module())})
    assert info["comm_backend"] == "nccl" and "eagerly" in info["graph_ban"] and info["ll_epochs"] is None
    json.dumps(info)  # it travels to the engine and into reports


def test_init_world_refuses_shared_gpus_without_ll_before_the_rendezvous():
    from swiftspec.distributed.parallel import free_tcp_port, init_world

    t0 = time.monotonic()  # a second rank never comes: the check must not wait for it
    with pytest.raises(RuntimeError, match="kernels=True"):
        init_world(0, 2, free_tcp_port(), [[0, 1]], timeout_s=30.0, device_type="cuda",
                   devices=["cuda:0", "cuda:0"])
    assert time.monotonic() - t0 < 10
    with pytest.raises(ValueError, match="names 1 ranks, the world has 2"):
        init_world(0, 2, free_tcp_port(), [[0, 1]], device_type="cuda", devices=["cuda:0"])


def test_a_required_ll_communicator_that_fails_names_the_probe():
    from swiftspec.distributed.parallel import _group_cuda_ll

    # size 2 without a process group: the constructor raises (as a failed IPC mapping would)
    with pytest.raises(RuntimeError, match=f"no silent fallback.*{PROBE}"):
        _group_cuda_ll(None, 0, 2, 5.0, required=True)
    with pytest.warns(UserWarning, match="using NCCL"):
        assert _group_cuda_ll(None, 0, 2, 5.0) is None


class _ShmAsLL:
    """A CUDA LL communicator double for a CPU world: the shared-memory one, named "ll"."""

    backend = "ll"
    made = []

    def __init__(self, group, rank, size, timeout_s=30.0):
        from swiftspec.distributed.comm import ShmCommunicator

        self._c = ShmCommunicator.create(group, rank, size, timeout_s=timeout_s)
        self.calls = 0
        _ShmAsLL.made.append(self)

    def all_reduce(self, x):
        self.calls += 1
        return self._c.all_reduce(x)

    def epoch(self):
        return self._c.epoch


def _rank_world(rank, world, port, mode, q):
    try:
        import torch.distributed as dist

        from swiftspec.distributed.parallel import init_world
        from swiftspec.ops import cuda_comm

        torch.set_num_threads(1)
        if mode == "fails":
            cuda_comm.CudaLLCommunicator = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("cudaIpcOpenMemHandle: no"))
        else:
            cuda_comm.CudaLLCommunicator = _ShmAsLL
        devices = ["cuda:0"] * world  # every rank on one GPU
        try:
            (ctx,) = init_world(rank, world, port, [list(range(world))], timeout_s=30.0, shm_comm=True,
                                device_type="cuda", devices=devices)
        except RuntimeError as e:
            report(q, "ok", rank, {"error": str(e), "backend": dist.get_backend()})
            dist.destroy_process_group()
            return
        x = torch.full((5,), float(rank + 1))
        ctx.all_reduce(x)
        g = ctx.all_gather_last_dim(torch.full((1, 3), float(rank + 1)))
        out = {"backend": dist.get_backend(), "control": ctx.control, "comm": ctx.comm_backend,
               "sum": x.tolist(), "gather": g.tolist(), "ll_calls": ctx.shm.calls, "graph_ban": graph_ban(ctx)}
        dist.destroy_process_group()
        report(q, "ok", rank, out)
    except BaseException:
        report(q, "error", rank, traceback.format_exc())


@pytest.fixture(scope="module")
def cpu_extension():
    """Built here once, so the spawned ranks (whose LL double is the shared-memory communicator)
    only load it."""
    from swiftspec.ops import cpu

    cpu.load()


def test_ranks_sharing_a_gpu_get_gloo_and_the_ll_communicator(cpu_extension):
    """Two ranks that name one GPU: a gloo world, the LL communicator carries the all-reduce and
    the all-gather (zero-padded shards, no NCCL), graphs allowed."""
    replies = spawn_ranks(_rank_world, 2, ("ok",), 120.0, "shared GPU")
    for r in (0, 1):
        out = replies[r]
        assert (out["backend"], out["control"], out["comm"], out["graph_ban"]) == ("gloo", "gloo", "ll", None)
        assert out["sum"] == [3.0] * 5 and out["gather"] == [[1.0] * 3 + [2.0] * 3]
        assert out["ll_calls"] == 2


def test_an_ll_setup_failure_fails_every_rank_with_the_probe_named():
    replies = spawn_ranks(_rank_world, 2, ("fails",), 120.0, "shared GPU, no IPC")
    for r in (0, 1):
        assert replies[r]["backend"] == "gloo"
        assert "cudaIpcOpenMemHandle: no" in replies[r]["error"] and PROBE in replies[r]["error"]


def test_engine_records_each_workers_backend_and_device(tiny_dir, cpu_extension):
    """Engine.workers: what every worker reported when ready (here TP = 2 on CPU, shared memory)."""
    from swiftspec import Engine

    with Engine(tiny_dir, mode="autoregressive", dtype="float32", device="cpu", target_tp=2, kernels=True) as eng:
        workers = eng.workers
    assert len(workers) == 2 and len({w["pid"] for w in workers}) == 2
    assert [w["group_rank"] for w in workers] == [0, 1]
    for w in workers:
        assert (w["device"], w["tp"], w["comm_backend"], w["control_backend"]) == ("cpu", 2, "shm", "gloo")
        assert w["cuda_graphs"] == {"target": 0} and w["graph_ban"] is None and isinstance(w["ll_epochs"], int)
