"""Tensor-parallel process groups and the collectives the TP layers use.

A *group* (draft group or target group, docs/architecture.md §1) is a set of processes that shard one model
Megatron style. On CPU the collectives run over torch.distributed with the gloo backend; on CUDA
over NCCL. ``TPContext`` is what a layer sees: its rank inside the group, the group size (the TP
degree) and the collectives it needs. A group can also carry an LL communicator (the LL all-reduce
of the SwiftSpec paper section 6): on CPU, when every rank runs on one host, the shared-memory one
(:mod:`swiftspec.distributed.comm`); on CUDA the IPC one (:class:`swiftspec.ops.cuda_comm.CudaLLCommunicator`). The
all-reduce, the row-parallel GEMM + all-reduce and (off NCCL) the LM head's all-gather then use it.

Where a group puts two ranks on one GPU, NCCL cannot be used at all: the process groups are gloo
(a CPU control plane that only exchanges the LL buffers' IPC handles and runs barriers), and every
collective on the group's CUDA tensors runs on the LL kernels; :func:`init_world` raises instead of
falling back when those cannot be set up. LL collectives are plain kernels on device buffers, so a
TP > 1 decode step on them can be captured in a CUDA graph (:func:`graph_ban`).
"""
from __future__ import annotations

import contextlib
import socket
import traceback
import warnings
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from swiftspec import ops
from swiftspec.distributed.rendezvous import pin_loopback
from swiftspec.distributed.wire import all_gather_bytes

PROBE = "scripts/gpu_probe.py"  # records whether CUDA IPC (and MPS) work on a GPU machine


def backend_for(device_type: str) -> str:
    """The torch.distributed backend for tensors on ``device_type``: "nccl" for "cuda", else "gloo"."""
    return "nccl" if device_type == "cuda" else "gloo"


def shares_gpu(devices: list[str]) -> bool:
    """Whether two entries of ``devices`` (one group's rank devices, e.g. ``["cuda:0", "cuda:0"]``)
    name the same GPU."""
    gpus = [d for d in devices if d.startswith("cuda")]
    return len(set(gpus)) < len(gpus)


def control_backend(device_type: str, groups: list[list[str]]) -> str:
    """The torch.distributed backend of the world's process groups (their control plane).

    Args:
        device_type: "cpu" or "cuda", where the ranks' tensors live.
        groups: each TP group's rank devices, e.g. ``[["cuda:0", "cuda:0"], ["cuda:0"]]``.

    Returns "gloo" on CPU; on CUDA "gloo" when some group has two ranks on one GPU (NCCL refuses
    such a communicator; those groups' collectives must then run on the CUDA LL communicator),
    else "nccl". Groups that only share a GPU with another group keep NCCL: no collective ever
    spans two groups (the world group is never used for one, so NCCL never builds its communicator).
    """
    if device_type != "cuda":
        return "gloo"
    return "gloo" if any(shares_gpu(g) for g in groups) else "nccl"



@dataclass(frozen=True)
class TPContext:
    """Position of this process inside its tensor-parallel group.

    Attributes:
        rank: rank inside the group, 0 is the group leader.
        size: TP degree (number of processes in the group).
        group: the torch.distributed process group, or None when ``size == 1``.
        shm: the group's LL communicator, or None (gloo / NCCL): a
            :class:`swiftspec.distributed.comm.ShmCommunicator` on CPU, a
            :class:`swiftspec.ops.cuda_comm.CudaLLCommunicator` on CUDA (same interface).
        control: the torch.distributed backend of ``group`` ("gloo" or "nccl"), None without one.
    """

    rank: int = 0
    size: int = 1
    group: object | None = None
    shm: object | None = None
    control: str | None = None

    @property
    def comm_backend(self) -> str:
        """What carries this rank's collectives: "local" (size 1, none), "ll" (the CUDA LL
        communicator), "shm" (the CPU shared-memory one), else the process group's backend
        ("gloo" / "nccl")."""
        if self.size == 1:
            return "local"
        if self.shm is not None:
            return getattr(self.shm, "backend", "shm")
        return self.control or "gloo"

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the group in place (identity when size is 1). Returns ``x``.

        With ``shm`` the sum runs in rank order in float32 (identical bits on every rank);
        otherwise over the process group (bf16 / fp16 reduced in float32).
        """
        if self.size > 1 and self.shm is not None:
            if x.is_contiguous():
                return self.shm.all_reduce(x)
            return x.copy_(self.shm.all_reduce(x.contiguous()))  # the CUDA kernels take contiguous tensors
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
            y = self.shm.gemm_all_reduce(x.reshape(-1, x.shape[-1]).contiguous(), w.contiguous(),
                                         None if bias is None else bias.contiguous())
            return y.view(*lead, y.shape[-1])
        if self.size == 1:  # nothing to reduce: the bias goes into the GEMM (one rounding)
            return ops.linear(x, w, bias)
        y = self.all_reduce(ops.linear(x, w))
        return y if bias is None else y + bias

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``x`` along the last dimension, in rank order.

        Shapes: ``x`` is ``[..., n]`` on every rank; the result is ``[..., size * n]``.
        With ``shm`` and no NCCL group (a CPU group, or a CUDA group of ranks sharing a GPU) it is an
        all-reduce of ``x`` placed in a zero buffer: there is no LL all-gather kernel, and adding
        zeros keeps every value (-0.0 becomes 0.0; -inf stays). On CPU that took 0.2 ms against gloo's
        0.4-0.7 for a 1-row LM head of 2 x 76k logits. With NCCL, NCCL's all-gather.
        """
        if self.size == 1:
            return x
        if self.shm is not None and (x.device.type == "cpu" or self.control != "nccl"):
            n = x.shape[-1]
            out = x.new_zeros(*x.shape[:-1], self.size * n)
            out[..., self.rank * n:(self.rank + 1) * n] = x
            return self.shm.all_reduce(out)
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


LOCAL = TPContext()


def graph_ban(tp: TPContext) -> str | None:
    """Why this rank's decode steps may not be captured in CUDA graphs, or None when they may.

    A capture records every collective of the step. At TP = 1 there is none; the CUDA LL
    communicator's collectives are kernels on device buffers with the epoch in device memory
    (capturable, replayable). NCCL and gloo collectives are not captured here (NCCL could be, on
    recent torch, but this engine has never run it so), nor the CPU shared-memory communicator.
    """
    if tp.size == 1 or tp.comm_backend == "ll":
        return None
    return (f"TP = {tp.size} over {tp.comm_backend}: only the CUDA LL communicator's collectives are captured "
            "in CUDA graphs, so decode steps run eagerly")


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


def leave_world() -> None:
    """Leave the torch.distributed world cleanly, if this process joined one (gloo's threads
    otherwise abort at exit)."""
    if dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def worker_process(engine, label: str):
    """The body of a worker process the engine started: leaves the world when the body returns; a
    peer gone or an interrupt ends the process quietly; any other failure is sent to the engine as
    ``("error", "<label>: <traceback>")`` (``engine``: the process's connection) and the process
    exits with status 1, so the engine raises it instead of waiting."""
    try:
        yield
        leave_world()
    except (KeyboardInterrupt, EOFError, BrokenPipeError):
        pass
    except BaseException:
        try:
            engine.send(("error", f"{label}: {traceback.format_exc()}"))
        except Exception:
            pass
        raise SystemExit(1)


def free_tcp_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago. Another process may take it before the
    caller binds it: the engine's worlds meet through :func:`swiftspec.distributed.rendezvous.file_init_method`
    instead."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_world(rank: int, world_size: int, port: int | str, groups: list[list[int]],
               timeout_s: float = 60.0, *, shm_comm: bool = False,
               device_type: str = "cpu", devices: list[str] | None = None) -> list[TPContext | None]:
    """Join the torch.distributed world and build one TP group per entry of ``groups``.

    ``port``: where the ranks meet, all on this host: a ``file://`` init method (a file in a
    private directory, :mod:`swiftspec.distributed.rendezvous`; no listener) or a TCP port on
    127.0.0.1 (torch's store then listens on every interface until the world is built). The
    group's gloo / NCCL sockets use the loopback interface only.

    Every process must call this with the same ``groups`` and ``devices`` (torch.distributed
    requires all ranks to take part in creating every subgroup). ``device_type`` is where this
    rank's tensors live ("cpu" or "cuda", the same on every rank); a CUDA rank sets its device
    before calling. ``devices``: the device string of every global rank (``world_size`` entries,
    e.g. ``["cuda:0", "cuda:0", "cuda:0"]``), or None (every rank on its own device): with it the
    control backend is :func:`control_backend` (gloo where a group puts two
    ranks on one GPU), without it :func:`backend_for`. Returns, for each entry,
    this rank's TPContext, or None when this rank is not a member.

    With ``shm_comm``, every group of two or more ranks gets an LL communicator (``TPContext.shm``,
    waiting at most ``timeout_s`` for a peer): on CPU the shared-memory one when all its ranks run
    on one host and can load the CPU extension, on CUDA the IPC one; otherwise the group keeps
    gloo / NCCL, with a warning. A CUDA world on gloo has no such fallback: its groups' collectives
    exist only as LL kernels.

    Raises:
        RuntimeError: the rendezvous did not complete within ``timeout_s`` seconds, shared memory
            could not be set up, or a CUDA world on gloo has a group of two or more ranks without
            ``shm_comm`` or whose CUDA LL communicator cannot be set up (the message names
            :data:`PROBE`).
        ValueError: ``devices`` does not have ``world_size`` entries.
    """
    if devices is None:
        backend = backend_for(device_type)
    else:
        if len(devices) != world_size:
            raise ValueError(f"devices names {len(devices)} ranks, the world has {world_size}")
        backend = control_backend(device_type, [[devices[r] for r in members] for members in groups])
    ll_only = device_type == "cuda" and backend == "gloo"
    if ll_only and not shm_comm and any(len(m) > 1 for m in groups):
        # decided alike on every rank, before any of them waits in the rendezvous
        raise RuntimeError("ranks sharing a GPU run their collectives on the CUDA LL communicator only "
                           "(NCCL refuses a GPU used by two ranks); it needs the kernels on (kernels=True)")
    pin_loopback()
    init_method = port if isinstance(port, str) else f"tcp://127.0.0.1:{port}"
    dist.init_process_group(backend, init_method=init_method, rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=timeout_s))
    pgs = [dist.new_group(members, backend=backend) if len(members) > 1 else None for members in groups]
    out: list[TPContext | None] = []
    for members, pg in zip(groups, pgs):
        if rank not in members:
            out.append(None)
            continue
        shm = None
        if shm_comm and len(members) > 1 and device_type == "cuda":
            shm = _group_cuda_ll(pg, members.index(rank), len(members), timeout_s, required=ll_only)
        elif shm_comm and backend == "gloo" and len(members) > 1:
            # collective over the group's members only, in the order of `groups` on every rank
            shm = _group_shm(pg, members.index(rank), len(members), timeout_s)
        out.append(TPContext(rank=members.index(rank), size=len(members), group=pg, shm=shm,
                             control=backend if pg is not None else None))
    return out


def _group_cuda_ll(pg, rank: int, size: int, timeout_s: float, required: bool = False):
    """The CUDA LL communicator (IPC buffers, csrc/kernels/ll_comm.cu) for the group. When it cannot
    be set up (its constructor is collective: every rank fails alike) it returns None and the group
    keeps NCCL, or, with ``required`` (a gloo group on CUDA: nothing else can carry its
    collectives), raises RuntimeError naming :data:`PROBE`."""
    from swiftspec.ops.cuda_comm import CudaLLCommunicator

    try:
        return CudaLLCommunicator(pg, rank, size, timeout_s=timeout_s)
    except Exception as e:  # no peer access, build failure, old driver
        if required:
            raise RuntimeError(
                f"the CUDA LL communicator could not be set up ({type(e).__name__}: {e}); ranks that share a GPU "
                f"have no other collective path (no NCCL, no silent fallback). Run `python {PROBE} --out probe.json` "
                "on this machine: its cuda_ipc check records whether CUDA IPC between processes works here") from e
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
        err = ""
    except cpu.KernelBuildError as e:
        err = str(e).splitlines()[0] or type(e).__name__
    errs = all_gather_bytes(err.encode(), group=pg)
    failed = [(r, e.decode(errors="replace")) for r, e in enumerate(errs) if e]
    if failed:
        warnings.warn(f"shm_comm: the CPU extension is unavailable on ranks {failed}; using gloo", stacklevel=3)
        return None
    return ShmCommunicator.create(pg, rank, size, timeout_s=timeout_s)
