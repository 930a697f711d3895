"""Shared-memory LL all-reduce and fused GEMM + all-reduce (csrc/cpu/shm_comm.cpp, swiftspec/distributed/comm.py).

TP ranks are real processes (spawned, gloo rendezvous); every rank builds every rank's inputs from
seeds, so it can check its own result against a sum done here in rank order and report a digest
of its bits, and the parent checks the digests agree across ranks. A few checks (argument errors,
attach errors, cleanup) run in this process on size-1 or hand-made segments.
"""
from __future__ import annotations

import dataclasses
import glob
import os
import time
import traceback

import pytest
import torch
from ranks import digest, rank_inputs, rank_sum, report, spawn_ranks

DEADLINE_S = 240.0  # generous: CI machines are shared and slow
SIZES = [1, 7, 1000, 4099]
BIG = 300_000        # more than the default capacity (1 MiB) in fp32: chunked on every comm
SMALL_CAP = 1024     # bytes per rank per epoch: 256 fp32 / 512 bf16 elements, most calls chunk
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
GEMM_SHAPES = [(1, 5, 3), (7, 37, 1001), (33, 64, 130), (5, 300, 517)]  # (M, K, N)


@pytest.fixture(scope="module", autouse=True)
def built():
    """Build both extension variants once here, so the spawned ranks only load them."""
    from swiftspec.ops import cpu

    cpu.load()
    assert cpu.load(flag_bits=2).ll_flag_bits == 2
    assert cpu.load().ll_flag_bits == 32


# ---- helpers shared by parent and ranks ----------------------------------------------------------

def _check_all_reduce(comm, ctx, seed, n, dtype):
    xs = [rank_inputs(seed, r, (n,), dtype) for r in range(ctx.size)]
    y = xs[ctx.rank].clone()
    out = comm.all_reduce(y)
    assert out is y
    return bool(torch.equal(y, rank_sum(xs))), digest(y)


def _check_gemm(comm, ctx, seed, shape, dtype, with_bias, gloo_ctx):
    from swiftspec.ops import reference

    M, K, N = shape
    x = rank_inputs(seed, ctx.rank, (M, K), dtype)
    w = rank_inputs(seed + 1, ctx.rank, (N, K), dtype)
    bias = rank_inputs(seed + 2, 0, (N,), dtype) if with_bias else None
    y = comm.gemm_all_reduce(x, w, bias)
    ref = reference.gemm_all_reduce(x, w, bias, gloo_ctx)
    assert y.shape == (M, N) and y.dtype == dtype
    err = ((y.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6)).item()
    return err, digest(y)


# ---- rank programs ----------------------------------------------------------------------------

def _prog_collectives(ctx, world):
    """all_reduce and gemm_all_reduce on three communicators: init_world's (default capacity),
    a small-capacity one (chunking) and a wrap-around build one (LL flags 1, 2, 3 repeating)."""
    from swiftspec.distributed.comm import ShmCommunicator

    gloo = dataclasses.replace(ctx, shm=None)
    small = ShmCommunicator.create(ctx.group, ctx.rank, ctx.size, capacity_bytes=SMALL_CAP, timeout_s=30.0)
    res = {}
    for cname, comm in (("default", ctx.shm), ("small", small)):
        for dtype in DTYPES:
            for n in SIZES + ([BIG] if cname == "default" else [2 * SMALL_CAP + 3]):
                res[("ar", cname, str(dtype), n)] = _check_all_reduce(comm, ctx, n, n, dtype)
        for shape in GEMM_SHAPES:
            for with_bias in (False, True):
                for dtype in (torch.float32, torch.bfloat16):
                    res[("gemm", cname, shape, with_bias, str(dtype))] = _check_gemm(
                        comm, ctx, sum(shape), shape, dtype, with_bias, gloo)
    # the TPContext entry points: leading dimensions, a non-contiguous all-reduce input
    x = rank_inputs(5, ctx.rank, (2, 3, 40), torch.float32)
    w = rank_inputs(6, ctx.rank, (24, 40), torch.float32)
    y = ctx.gemm_all_reduce(x, w)
    ref = gloo.gemm_all_reduce(x, w)
    res["tp_gemm_3d"] = (float((y - ref).abs().max()), digest(y))
    xs = [rank_inputs(7, r, (40, 6), torch.float32).t() for r in range(ctx.size)]
    y = xs[ctx.rank].clone().t().contiguous().t()  # non-contiguous view
    ctx.all_reduce(y)
    res["tp_ar_noncontig"] = (bool(torch.equal(y, rank_sum(xs))), digest(y))

    # flag wrap-around: consecutive calls of varying sizes; before each call one rank lags
    # behind, so the others read its buffer before it is rewritten (stale words must not match)
    wrap = ShmCommunicator.create(ctx.group, ctx.rank, ctx.size, capacity_bytes=SMALL_CAP, timeout_s=30.0,
                                  flag_bits=2)
    pattern = [3000, 5, 1, 700, 2, 9, 3, 4099, 1, 1, 1, 1, 1, 1, 2500]
    for i in range(30):
        n = pattern[i % len(pattern)]
        dtype = DTYPES[i % 3]
        if i % ctx.size == ctx.rank:
            time.sleep(0.003)
        if i % 7 == 3:
            res[("wrap-gemm", i, str(dtype))] = _check_gemm(wrap, ctx, 100 + i, (9, 23, 2 * n % 300 + 1), dtype, True, gloo)
        else:
            res[("wrap", i)] = _check_all_reduce(wrap, ctx, 100 + i, n, dtype)
    res["wrap_epochs"] = wrap.epoch
    for c in (small, wrap, ctx.shm):
        c.close()
    return res


def _prog_model(ctx, model_dir):
    """The tiny model's logits (float and int8) with the shm communicator and with gloo."""
    from swiftspec import ops
    from swiftspec.model_executor.models import load_model

    ops.set_kernels(False)  # the other ops in PyTorch: this compares the communication paths only
    assert ctx.shm is not None
    ids = [5, 17, 33, 2, 90, 41, 7, 7, 12, 60, 3, 99]
    n = len(ids)
    pos = torch.arange(n)
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    out = {}
    for name, tp in (("shm", ctx), ("gloo", dataclasses.replace(ctx, shm=None))):
        m = load_model(model_dir, tp=tp, dtype=torch.float32)
        before = ctx.shm.epoch
        dense = m.compute_logits(m(torch.tensor(ids), pos, pos, mask, m.make_kv_cache(32)))
        used = ctx.shm.epoch - before
        m = load_model(model_dir, tp=tp, dtype=torch.float32, int8=True)
        q = m.compute_logits(m(torch.tensor(ids), pos, pos, mask, m.make_kv_cache(32)))
        out[name] = (dense, q, used)
    ctx.shm.close()
    return out


def _prog_gather(ctx):
    """all_gather_last_dim with the communicator and over gloo: the same bits (LM-head logits, with
    the -inf of padded vocabulary entries)."""
    gloo = dataclasses.replace(ctx, shm=None)
    out = []
    for rows, n in ((1, 5), (3, 1000), (8, 20000)):
        g = torch.Generator().manual_seed(rows * 31 + ctx.rank)
        x = torch.randn(rows, n, generator=g) * 10
        x[:, -2:] = float("-inf")
        before = ctx.shm.epoch
        a = ctx.all_gather_last_dim(x)
        out.append((torch.equal(a, gloo.all_gather_last_dim(x)), ctx.shm.epoch > before, tuple(a.shape)))
    ctx.shm.close()
    return out


def _prog_failures(ctx, q):
    """A peer that never calls (timeout), that closed its communicator, that exited."""
    from swiftspec.distributed.comm import ShmCommunicator

    res = {}

    def expect_error(comm, key):
        t = time.monotonic()
        try:
            comm.all_reduce(torch.ones(1000))
            res[key] = ("no error", 0.0)
        except RuntimeError as e:
            res[key] = (str(e), time.monotonic() - t)
        try:  # unusable afterwards, and says so at once
            comm.all_reduce(torch.ones(3))
            res[key + "-again"] = "no error"
        except RuntimeError as e:
            res[key + "-again"] = str(e)

    last = ctx.size - 1
    slow = ShmCommunicator.create(ctx.group, ctx.rank, ctx.size, timeout_s=1.0)
    if ctx.rank != last:
        expect_error(slow, "timeout")
    torch.distributed.barrier(group=ctx.group)

    closed = ShmCommunicator.create(ctx.group, ctx.rank, ctx.size, timeout_s=30.0)
    if ctx.rank == last:
        closed.close()
    torch.distributed.barrier(group=ctx.group)
    if ctx.rank != last:
        expect_error(closed, "closed")
    torch.distributed.barrier(group=ctx.group)

    dead = ShmCommunicator.create(ctx.group, ctx.rank, ctx.size, timeout_s=30.0)
    torch.distributed.barrier(group=ctx.group)
    if ctx.rank == last:
        report(q, "ok", ctx.rank, None)
        q.close()
        q.join_thread()
        os._exit(0)  # no cleanup at all: as if killed
    expect_error(dead, "exited")
    return res


def _rank_main(rank, world, port, prog, args, shm_comm, q):
    try:
        torch.set_num_threads(1)
        from swiftspec.distributed.parallel import init_world

        (ctx,) = init_world(rank, world, port, [list(range(world))], timeout_s=60.0, shm_comm=shm_comm)
        if prog == "failures":
            args = (q,)
        result = globals()["_prog_" + prog](ctx, *args)
        report(q, "ok", rank, result)
        if prog != "failures":
            torch.distributed.destroy_process_group()
    except BaseException:
        report(q, "error", rank, traceback.format_exc())


def _run_world(world, prog, args=(), shm_comm=True):
    """Run ``_prog_<prog>`` on ``world`` spawned ranks; {rank: result}. Never leaves a process or
    a shared-memory segment behind."""
    before = set(glob.glob("/dev/shm/swiftspec-*"))
    try:
        return spawn_ranks(_rank_main, world, (prog, args, shm_comm), DEADLINE_S, f"{prog} TP")
    finally:
        leaked = sorted(set(glob.glob("/dev/shm/swiftspec-*")) - before)
        for f in leaked:
            os.unlink(f)
        assert not leaked, f"shared-memory segments left behind: {leaked}"


# ---- tests ------------------------------------------------------------------------------------

@pytest.mark.parametrize("world", [2, 3])
def test_collectives(world):
    replies = _run_world(world, "collectives", (world,))
    keys = replies[0].keys()
    for key in keys:
        vals = [replies[r][key] for r in range(world)]
        if key == "wrap_epochs":
            # several chunks per call: the 3 flags went round many times
            assert vals[0] >= 40 and len(set(vals)) == 1, vals
            continue
        check, digests = zip(*vals)
        assert len(set(digests)) == 1, f"{key}: ranks got different bits"
        if key[0] in ("ar", "wrap") or key == "tp_ar_noncontig":
            assert all(check), f"{key}: all-reduce differs from the rank-order sum"
        elif key[0] in ("gemm", "wrap-gemm"):
            tol = 1e-5 if key[-1] == str(torch.float32) else 2e-2
            assert max(check) < tol, f"{key}: relative error {max(check):.2e} vs the reference"
        else:
            assert max(check) < 1e-5, f"{key}: error {max(check):.2e}"


def test_tp2_model_equals_gloo(tiny_dir):
    replies = _run_world(2, "model", (str(tiny_dir),))
    out = replies[0]
    dense, q, used = out["shm"]
    dense_g, q_g, used_g = out["gloo"]
    assert used >= 4 and used_g == 0, "the shm model must use the communicator, the gloo one must not"
    assert dense.shape == dense_g.shape
    # GEMM tiles may round differently from one whole GEMM; the sums are the same operations
    assert (dense - dense_g).abs().max() < 1e-4 * dense_g.abs().max()
    assert torch.equal(dense.argmax(-1), dense_g.argmax(-1))
    assert (q - q_g).abs().max() < 1e-4 * q_g.abs().max()
    assert torch.equal(replies[1]["shm"][0], dense), "ranks disagree"


@pytest.mark.parametrize("world", [2, 3])
def test_all_gather_over_shm_equals_gloo(world):
    for rank, results in _run_world(world, "gather").items():
        for same, used, shape in results:
            assert same and used, f"rank {rank} {shape}"
            assert shape[1] % world == 0


def test_dead_or_silent_peer_raises():
    replies = _run_world(3, "failures", shm_comm=False)
    for rank in (0, 1):
        r = replies[rank]
        msg, took = r["timeout"]
        assert "rank 2" in msg and "timed out" in msg, msg
        assert 0.9 < took < 10, took
        msg, took = r["closed"]
        assert "rank 2" in msg and "closed" in msg, msg
        assert took < 5, took
        msg, took = r["exited"]
        assert "rank 2" in msg and "exited" in msg, msg
        assert took < 5, took  # the liveness check, long before the 30 s timeout
        for key in ("timeout-again", "closed-again", "exited-again"):
            assert "unusable after an earlier failure" in r[key], r[key]


# ---- in-process checks --------------------------------------------------------------------------

def _name(tag):
    return f"/swiftspec-{os.getpid()}-test{tag}"


def test_size1_and_argument_errors():
    from swiftspec.ops import cpu

    ext = cpu.load()
    c = ext.ShmComm(_name("a"), 0, 1, True, 4096, 5.0)
    try:
        x = torch.randn(33)
        y = x.clone()
        c.all_reduce(y)
        assert torch.equal(x, y)
        a, w, b = torch.randn(4, 10), torch.randn(6, 10), torch.randn(6)
        assert torch.allclose(c.gemm_all_reduce(a, w, b), a @ w.t() + b, atol=1e-5)
        for bad in (lambda: c.all_reduce(torch.ones(4, dtype=torch.int32)),
                    lambda: c.all_reduce(torch.ones(4, 4).t()),
                    lambda: c.gemm_all_reduce(a, torch.randn(6, 9)),
                    lambda: c.gemm_all_reduce(a, w.double()),
                    lambda: c.gemm_all_reduce(a, w, torch.randn(5)),
                    lambda: c.gemm_all_reduce(a, w, b.bfloat16()),
                    lambda: c.gemm_all_reduce(a.t(), w)):
            with pytest.raises(RuntimeError):
                bad()
    finally:
        c.close()
    assert not os.path.exists("/dev/shm" + _name("a")), "close() of the creator removes the name"
    with pytest.raises(RuntimeError, match="closed"):
        c.all_reduce(torch.ones(2))
    for bad_args in ((_name("b"), 2, 2, True, 64, 1.0), (_name("b"), 0, 2, True, 0, 1.0),
                     (_name("b"), 0, 2, True, 64, 0.0), ("no-slash", 0, 2, True, 64, 1.0)):
        with pytest.raises(RuntimeError):
            ext.ShmComm(*bad_args)


def test_attach_errors_and_cleanup():
    from swiftspec.ops import cpu

    ext, ext2 = cpu.load(), cpu.load(flag_bits=2)
    with pytest.raises(RuntimeError, match="attaching"):
        ext.ShmComm(_name("none"), 1, 2, False, 4096, 1.0)
    c = ext.ShmComm(_name("c"), 0, 2, True, 4096, 1.0)
    try:
        with pytest.raises(RuntimeError):  # exists already
            ext.ShmComm(_name("c"), 0, 2, True, 4096, 1.0)
        with pytest.raises(RuntimeError, match="capacity"):
            ext.ShmComm(_name("c"), 1, 2, False, 8192, 1.0)
        with pytest.raises(RuntimeError, match="flag bits"):
            ext2.ShmComm(_name("c"), 1, 2, False, 4096, 1.0)
        with pytest.raises(RuntimeError, match="already attached"):
            ext.ShmComm(_name("c"), 0, 2, False, 4096, 1.0)
        peer = ext.ShmComm(_name("c"), 1, 2, False, 4096, 1.0)
        c.unlink()
        assert not os.path.exists("/dev/shm" + _name("c"))
        # a peer that closed: fail at once, not after the timeout
        peer.close()
        t = time.monotonic()
        with pytest.raises(RuntimeError, match="rank 1 .*closed"):
            c.all_reduce(torch.ones(10))
        assert time.monotonic() - t < 0.9
    finally:
        c.close()
    assert not glob.glob(f"/dev/shm/swiftspec-{os.getpid()}-*")
