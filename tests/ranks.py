"""Run a function on several ranks (a torch.distributed world over a free TCP port), processes
started as the engine starts its workers, and collect what each rank reports; never leaves a
process behind. Used by the TP / collective tests."""
import hashlib
import pickle
import queue
import time

import pytest
import torch


def spawn_ranks(fn, world: int, args: tuple = (), deadline_s: float = 240.0, label: str = "") -> dict:
    """Call ``fn(rank, world, port, *args, q)`` in ``world`` processes, started as the engine's
    workers are (:func:`swiftspec.engine.processes.new_process`: forked from the fork server,
    with this process's environment). Each rank reports
    once with :func:`report` (``"ok"`` and its payload, or ``"error"`` and a traceback). Returns
    {rank: payload}; fails the test on an error or when a rank is silent past ``deadline_s`` seconds."""
    from swiftspec.distributed.parallel import free_tcp_port
    from swiftspec.engine.processes import new_process, start_context

    ctx = start_context()
    q = ctx.Queue()
    port = free_tcp_port()
    procs = [new_process(ctx, fn, r, world, port, *args, q) for r in range(world)]
    deadline = time.monotonic() + deadline_s
    try:
        for p in procs:
            p.start()
        replies = {}
        while len(replies) < world:
            try:
                status, rank, payload = pickle.loads(q.get(timeout=max(0.1, deadline - time.monotonic())))
            except queue.Empty:
                pytest.fail(f"{label} world={world}: ranks {sorted(set(range(world)) - set(replies))} gave no answer")
            if status != "ok":
                pytest.fail(f"{label} world={world} rank {rank} failed:\n{payload}")
            replies[rank] = payload
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
        return replies
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        q.close()


def report(q, status: str, rank: int, payload) -> None:
    """Put a rank's answer on ``q`` as plain pickled bytes. A tensor put on a multiprocessing queue
    as it is travels as a file descriptor that the parent fetches from the sending process, which
    fails when that rank has already exited (ConnectionResetError); bytes carry the values."""
    q.put(pickle.dumps((status, rank, payload)))


def rank_inputs(seed: int, rank: int, shape, dtype):
    """Rank ``rank``'s deterministic all-reduce input (CPU)."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randn(shape, generator=g).to(dtype)


def rank_sum(xs):
    """The expected all-reduce result: float32 sum in rank order, rounded once."""
    acc = xs[0].float()
    for x in xs[1:]:
        acc = acc + x.float()
    return acc.to(xs[0].dtype)


def digest(t) -> str:
    """A hash of a tensor's bits, to check that ranks hold identical results."""
    t = t.detach().cpu().contiguous()
    raw = t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)
    return hashlib.sha1(raw.numpy().tobytes()).hexdigest()
