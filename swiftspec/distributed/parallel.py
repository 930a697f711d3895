"""Tensor-parallel process groups and the collectives the TP layers use.

A *group* (draft group or target group, docs/architecture.md §1) is a set of processes that shard one model
Megatron style. On CPU the collectives run over torch.distributed with the gloo backend; on CUDA
over NCCL. ``TPContext`` is what a layer sees: its rank inside the group, the group size (the TP
degree) and the collectives it needs. On CPU, when every rank of a group runs on one host, a group
can also carry a shared-memory communicator (:mod:`swiftspec.distributed.comm`, the LL all-reduce of the SwiftSpec paper
section 6): the all-reduce and the row-parallel GEMM + all-reduce then use it instead of gloo.
"""
from __future__ import annotations

import socket
import warnings
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from swiftspec import ops
from swiftspec.engine.placement import backend_for


@dataclass(frozen=True)
class TPContext:
    """Position of this process inside its tensor-parallel group.

    Attributes:
        rank: rank inside the group, 0 is the group leader.
        size: TP degree (number of processes in the group).
        group: the torch.distributed process group, or None when ``size == 1``.
        shm: the group's LL communicator, or None (gloo / NCCL): a
            :class:`swiftspec.distributed.comm.ShmCommunicator` on CPU, a
            :class:`swiftspec.ops.cuda.CudaLLCommunicator` on CUDA (same interface).
    """

    rank: int = 0
    size: int = 1
    group: object | None = None
    shm: object | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the group in place (identity when size is 1). Returns ``x``.

        With ``shm`` the sum runs in rank order in float32 (identical bits on every rank);
        otherwise over the process group (bf16 / fp16 reduced in float32).
        """
        if self.size > 1 and self.shm is not None:
            return self.shm.all_reduce(x)
        if self.size > 1:
            # gloo reduces bf16 poorly and not at all for some ops; reduce in fp32 for identical bits.
            if x.dtype != torch.float32:
                y = x.float()
                dist.all_reduce(y, group=self.group)
                x.copy_(y)
            else:
                dist.all_reduce(x, group=self.group)
        return x

    def gemm_all_reduce(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """Row-parallel linear: ``all_reduce(x @ w.T) (+ bias)``, the bias added once after the sum.

        Shapes: x ``[..., K_local]``, w ``[N, K_local]``, bias ``[N]`` or None (one dtype).
        Returns ``[..., N]`` in x's dtype, identical on every rank. With ``shm`` the GEMM is fused
        with the shared-memory all-reduce (tile results are sent as soon as they are computed);
        otherwise :func:`swiftspec.ops.linear` then :meth:`all_reduce` (at size 1 the bias goes into
        the GEMM). Same semantics as
        :func:`swiftspec.ops.reference.gemm_all_reduce`.
        """
        if self.size > 1 and self.shm is not None:
            lead = x.shape[:-1]
            y = self.shm.gemm_all_reduce(x.reshape(-1, x.shape[-1]), w, bias)
            return y.view(*lead, y.shape[-1])
        if self.size == 1:  # nothing to reduce: the bias goes into the GEMM (one rounding)
            return ops.linear(x, w, bias)
        y = self.all_reduce(ops.linear(x, w))
        return y if bias is None else y + bias

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``x`` along the last dimension, in rank order.

        Shapes: ``x`` is ``[..., n]`` on every rank; the result is ``[..., size * n]``.
        With a CPU ``shm`` it is an all-reduce of ``x`` placed in a zero buffer (adding zeros keeps every
        value, -0.0 aside; 0.2 ms against gloo's 0.4-0.7 for a 1-row LM head of 2 x 76k logits).
        """
        if self.size == 1:
            return x
        if self.shm is not None and x.device.type == "cpu":
            n = x.shape[-1]
            out = x.new_zeros(*x.shape[:-1], self.size * n)
            out[..., self.rank * n:(self.rank + 1) * n] = x
            return self.shm.all_reduce(out)
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


LOCAL = TPContext()

PAD = -1  # global index of a padded (all-zero) feature, row or head in a rank's shard


def take_shard(src: torch.Tensor, index: torch.Tensor, dim: int) -> torch.Tensor:
    """``src`` indexed along ``dim`` by ``index`` (``[n]`` int64 global positions, :data:`PAD` for
    a zero slice): a view where ``index`` is one contiguous range, else a new tensor."""
    n = index.numel()
    start = int(index[0]) if n else 0
    if n and start >= 0 and torch.equal(index, torch.arange(start, start + n, device=index.device)):
        return src.narrow(dim, start, n)  # the unpadded Megatron case: one contiguous slice
    shape = list(src.shape)
    shape[dim] = n
    out = src.new_zeros(shape)
    keep = (index >= 0).nonzero().squeeze(1)
    if keep.numel():
        out.index_copy_(dim, keep.to(src.device), src.index_select(dim, index[keep].to(src.device)))
    return out


def free_tcp_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for the rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_world(rank: int, world_size: int, port: int, groups: list[list[int]],
               timeout_s: float = 60.0, *, shm_comm: bool = False,
               device_type: str = "cpu") -> list[TPContext | None]:
    """Join the torch.distributed world and build one TP group per entry of ``groups``.

    Every process must call this with the same ``groups`` (torch.distributed requires all ranks
    to take part in creating every subgroup). ``device_type`` is where this rank's tensors live
    ("cpu" or "cuda", the same on every rank): it picks gloo or NCCL
    (:func:`swiftspec.engine.placement.backend_for`); a CUDA rank sets its device before calling. Returns, for each entry, this rank's TPContext, or
    None when this rank is not a member.

    With ``shm_comm``, every group of two or more ranks gets an LL communicator (``TPContext.shm``,
    waiting at most ``timeout_s`` for a peer): on CPU the shared-memory one when all its ranks run
    on one host and can load the CPU extension, on CUDA the IPC one; otherwise the group keeps
    gloo / NCCL, with a warning.

    Raises:
        RuntimeError: the rendezvous did not complete within ``timeout_s`` seconds, or shared
            memory could not be set up.
    """
    backend = backend_for(device_type)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=timeout_s))
    pgs = [dist.new_group(members, backend=backend) if len(members) > 1 else None for members in groups]
    out: list[TPContext | None] = []
    for members, pg in zip(groups, pgs):
        if rank not in members:
            out.append(None)
            continue
        shm = None
        if shm_comm and backend == "gloo" and len(members) > 1:
            # collective over the group's members only, in the order of `groups` on every rank
            shm = _group_shm(pg, members.index(rank), len(members), timeout_s)
        elif shm_comm and backend == "nccl" and len(members) > 1:
            shm = _group_cuda_ll(pg, members.index(rank), len(members), timeout_s)
        out.append(TPContext(rank=members.index(rank), size=len(members), group=pg, shm=shm))
    return out


def _group_cuda_ll(pg, rank: int, size: int, timeout_s: float):
    """The CUDA LL communicator (IPC buffers, csrc/kernels/ll_comm.cu) for the group, or None when
    it cannot be set up (its constructor is collective: every rank raises alike and keeps NCCL)."""
    from swiftspec.ops.cuda import CudaLLCommunicator

    try:
        return CudaLLCommunicator(pg, rank, size, timeout_s=timeout_s)
    except Exception as e:  # no peer access, build failure, old driver: NCCL still works
        warnings.warn(f"shm_comm: CUDA LL communicator unavailable ({e}); using NCCL", stacklevel=3)
        return None


def _group_shm(pg, rank: int, size: int, timeout_s: float):
    """A ShmCommunicator for the group, or None when its ranks are not all on one host or some
    rank cannot load the CPU extension (every rank reaches the same decision)."""
    from swiftspec.distributed.comm import ShmCommunicator, same_host
    from swiftspec.ops import cpu

    if not same_host(pg):
        warnings.warn("shm_comm: the TP group spans several hosts; using gloo", stacklevel=3)
        return None
    try:
        cpu.load()
        err = None
    except cpu.KernelBuildError as e:
        err = str(e).splitlines()[0]
    errs = [None] * size
    dist.all_gather_object(errs, err, group=pg)
    failed = [(r, e) for r, e in enumerate(errs) if e is not None]
    if failed:
        warnings.warn(f"shm_comm: the CPU extension is unavailable on ranks {failed}; using gloo", stacklevel=3)
        return None
    return ShmCommunicator.create(pg, rank, size, timeout_s=timeout_s)
