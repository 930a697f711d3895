"""The collective kernel cases (CPU, 2 spawned processes pinned to their own cores): the
shared-memory LL one-shot all-reduce against gloo's ``all_reduce`` and the fused GEMM + all-reduce
against a matmul then gloo.
"""
from __future__ import annotations

import os
import time
from dataclasses import asdict

import torch

from swiftspec.benchmark.kernel_timing import MODELS, Case, time_interleaved


# ---- collectives (2 processes) -----------------------------------------------------------
def _comm_worker(rank: int, size: int, port: str, ops_: list[str], dtypes: list[str], rounds: int, iters: int,
                 conn) -> None:
    from swiftspec.distributed.parallel import init_world

    try:
        if hasattr(os, "sched_setaffinity"):
            cores = sorted(os.sched_getaffinity(0))
            os.sched_setaffinity(0, [cores[rank % len(cores)]])
        torch.set_num_threads(1)
        tp = init_world(rank, size, port, [list(range(size))], shm_comm=True)[0]
        if tp.shm is None:
            raise RuntimeError("the shared-memory communicator was not set up")
        import torch.distributed as dist

        def barrier():
            dist.barrier(group=tp.group)

        cases = []
        for dname in dtypes:
            dtype = getattr(torch, dname)
            if "allreduce" in ops_:
                for nbytes in (1 << 10, 4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20):
                    x = torch.randn(nbytes // dtype.itemsize, dtype=dtype)
                    y = x.float()
                    fns = {"ours": lambda: tp.shm.all_reduce(x),
                           "gloo all_reduce": lambda: dist.all_reduce(y, group=tp.group)}
                    t = time_interleaved(fns, rounds, iters, barrier)
                    cases.append(Case("allreduce", f"{size} ranks, {nbytes // 1024} KiB", dname, 1, t.pop("ours"), t))
            if "gemm_ar" in ops_:
                for name in ("qwen-1.5b (target)", "qwen-0.5b (draft)", "llama3-1b", "llama3-3b", "llama3-8b"):
                    hidden, inter, hq, _, d = MODELS[name]
                    for what, k_full in (("o_proj", hq * d), ("down_proj", inter)):
                        k = -(-k_full // size)
                        w = torch.randn(hidden, k, dtype=dtype) * 0.02
                        x = torch.randn(8, k, dtype=dtype)

                        def unfused():
                            z = (x @ w.t()).float()
                            dist.all_reduce(z, group=tp.group)
                            return z.to(dtype)

                        fns = {"ours": lambda: tp.shm.gemm_all_reduce(x, w, None),
                               "matmul + gloo all_reduce": unfused}
                        t = time_interleaved(fns, rounds, iters, barrier)
                        cases.append(Case("gemm_allreduce", f"{name} {what} TP{size} M=8 K={k} N={hidden}", dname, 1,
                                          t.pop("ours"), t))
        if rank == 0:
            conn.send(("ok", [asdict(c) for c in cases]))
    except Exception as e:  # report instead of hanging the parent
        import traceback
        conn.send(("error", f"rank {rank}: {e}\n{traceback.format_exc()}"))
    finally:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()


def comm_cases(ops_, dtypes, rounds, iters, size=2) -> list[Case]:
    """The collectives in ``ops_`` (``"allreduce"``: the shared-memory LL all-reduce against gloo
    ``all_reduce``, 1 KiB to 1 MiB; ``"gemm_ar"``: the fused GEMM + all-reduce against matmul then
    gloo, M = 8) measured by ``size`` spawned ranks on this host, per dtype; rank 0's
    :class:`Case` list.

    Raises:
        RuntimeError: a rank failed (its traceback in the message) or no reply within an hour.
    """
    import multiprocessing as mp

    import shutil

    from swiftspec.distributed.rendezvous import file_init_method, private_dir

    ctx = mp.get_context("spawn")
    rendezvous = private_dir()  # a file store: no TCP listener while the collectives are timed
    port = file_init_method(rendezvous)
    pipes = [ctx.Pipe(duplex=False) for _ in range(size)]
    procs = [ctx.Process(target=_comm_worker, args=(r, size, port, ops_, [str(d)[6:] for d in dtypes], rounds,
                                                    iters, pipes[r][1]), daemon=True) for r in range(size)]
    for p in procs:
        p.start()
    try:
        from multiprocessing.connection import wait
        deadline = time.monotonic() + 3600
        while True:
            ready = wait([r for r, _ in pipes], timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise RuntimeError("collective benchmark timed out")
            for conn in ready:
                status, payload = conn.recv()
                if status == "error":
                    raise RuntimeError(payload)
                return [Case(**c) for c in payload]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        shutil.rmtree(rendezvous, ignore_errors=True)
