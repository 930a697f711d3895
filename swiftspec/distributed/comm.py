"""Shared-memory communicator of one tensor-parallel group (the CPU twin of SwiftSpec's
latency-optimized all-reduce; paper section 3.3).

:class:`ShmCommunicator` wraps the C++ ``ShmComm`` of ``csrc/cpu/shm_comm.cpp``: the ranks of a
group, all processes on one host, share one POSIX shared-memory segment and exchange LL8 words
(payload and epoch flag in every 8 bytes), so an all-reduce needs no barrier, no socket and no
kernel call on the fast path. Sums run in rank order in float32, so every rank gets identical bits.

Setup is collective over the group's torch.distributed (gloo) process group: rank 0 creates a
segment with a unique name, broadcasts the name (as bytes, :mod:`swiftspec.distributed.wire`), the others attach, a barrier, then rank 0 removes
the name. From then on the segment lives only as long as the processes that map it: a crash can
never leak it.

Architecture: docs/architecture.md §6.
"""
from __future__ import annotations

import atexit
import os
import secrets
import socket

import torch
import torch.distributed as dist

from swiftspec.distributed.wire import (
    all_gather_bytes,
    all_gather_flags,
    broadcast_bytes,
)

DEFAULT_CAPACITY_BYTES = 1 << 20  # payload per rank per epoch; larger messages are chunked
DEFAULT_TIMEOUT_S = 60.0


def same_host(group) -> bool:
    """Whether every rank of the torch.distributed process group ``group`` runs on this host.

    Collective over ``group`` (every member must call it). Compares ``socket.gethostname()``.
    """
    return len(set(all_gather_bytes(socket.gethostname().encode(), group=group))) == 1


class ShmCommunicator:
    """All-reduce and fused GEMM + all-reduce among the ranks of one TP group on one host.

    Build it with :meth:`create` (collective). ``rank`` and ``size`` are this process's index in
    the group and the group size.

    Failures: waiting longer than ``timeout_s`` for a peer, a peer process that exited or closed
    its communicator raise ``RuntimeError`` naming the rank; the communicator is unusable after any
    failure (later calls raise at once).
    """

    backend = "shm"  # what swiftspec.distributed.parallel.TPContext.comm_backend reports for a group on it

    def __init__(self, comm, rank: int, size: int):
        self._comm = comm
        self.rank = rank
        self.size = size

    @classmethod
    def create(cls, group, rank: int, size: int, *, capacity_bytes: int = DEFAULT_CAPACITY_BYTES,
               timeout_s: float = DEFAULT_TIMEOUT_S, flag_bits: int | None = None) -> "ShmCommunicator":
        """Create (rank 0) or attach to (the others) the group's segment. Collective over ``group``.

        Args:
            group: the group's torch.distributed process group (gloo); every member calls this.
            rank: this process's rank inside the group; size: the group size.
            capacity_bytes: payload bytes per rank per epoch; the segment takes about
                ``4 * size * capacity_bytes`` bytes of /dev/shm.
            timeout_s: how long a call waits for a peer before raising.
            flag_bits: build of the CPU extension (None: production; 2: wrap-around test build).
                Every rank must use the same build.

        Raises:
            swiftspec.ops.cpu.KernelBuildError: the CPU extension cannot be built.
            RuntimeError: shared memory cannot be created or attached (e.g. /dev/shm too small).
        """
        from swiftspec.ops import cpu

        ext = cpu.load(flag_bits)
        src = dist.get_global_rank(group, 0)
        comm = None
        unlink_at_exit = None
        try:
            if rank == 0:
                name = f"/swiftspec-{os.getpid()}-{secrets.token_hex(6)}"
                try:
                    comm = ext.ShmComm(name, rank, size, True, capacity_bytes, timeout_s)
                    # a failure between here and unlink() below must not leave the name behind
                    unlink_at_exit = comm.unlink
                    atexit.register(unlink_at_exit)
                    msg = b"name:" + name.encode()
                except RuntimeError as e:
                    msg = b"error:" + str(e).encode()  # the others must learn it, not wait for a name
            else:
                msg = None
            kind, _, text = broadcast_bytes(msg, src, group).decode(errors="replace").partition(":")
            if kind != "name":
                raise RuntimeError(f"shared-memory communicator: rank 0 could not create the segment: {text}")
            name = text
            err = None
            if rank != 0:
                try:
                    comm = ext.ShmComm(name, rank, size, False, capacity_bytes, timeout_s)
                except RuntimeError as e:
                    err = e
            # every rank learns whether every rank attached, so a failed attach cannot leave the
            # others waiting here or, later, in a collective
            oks = all_gather_flags(err is None, group=group)
            if err is not None:
                raise err
            if not all(oks):
                bad = [r for r, o in enumerate(oks) if not o]
                raise RuntimeError(f"shared-memory communicator: ranks {bad} could not attach to {name}")
            if rank == 0:
                comm.unlink()
        except BaseException:
            if comm is not None:
                comm.close()
            raise
        finally:
            if unlink_at_exit is not None:
                atexit.unregister(unlink_at_exit)
        return cls(comm, rank, size)

    @property
    def name(self) -> str:
        """The segment's (already removed) name, ``/swiftspec-<pid>-<random>``."""
        return self._comm.name

    @property
    def epoch(self) -> int:
        """Collective epochs (chunks of at most ``capacity_bytes`` per rank) run so far."""
        return self._comm.epoch

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the group in place and return it; identical bits on every rank.

        ``x``: CPU tensor of float32, bfloat16 or float16, any shape (the same on every rank); a
        non-contiguous ``x`` goes through a contiguous copy. Summed in rank order in float32,
        rounded once to ``x.dtype``.

        Raises:
            RuntimeError: unsupported dtype or device; timeout, or a peer exited (names the rank).
        """
        if x.is_contiguous():
            self._comm.all_reduce(x)
            return x
        y = x.contiguous()
        self._comm.all_reduce(y)
        return x.copy_(y)

    def gemm_all_reduce(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """Row-parallel linear fused with its all-reduce: ``all_reduce(x @ w.T) (+ bias)``.

        Shapes: x ``[M, K_local]``, w ``[N, K_local]``, bias ``[N]`` or None, all of one dtype
        (float32, bfloat16 or float16). Returns a new ``[M, N]`` tensor in that dtype, identical on
        every rank; the bias is added once, after the reduction (as ``y + bias``). Non-contiguous
        inputs are copied.

        Raises:
            RuntimeError: shapes, dtypes or devices that do not fit; timeout, or a peer exited.
        """
        return self._comm.gemm_all_reduce(x.contiguous(), w.contiguous(),
                                          None if bias is None else bias.contiguous())

    def close(self) -> None:
        """Unmap the segment (peers still waiting on this rank then fail at once). Idempotent."""
        self._comm.close()

    def __repr__(self) -> str:
        return f"ShmCommunicator(rank={self.rank}, size={self.size}, name={self.name!r})"
