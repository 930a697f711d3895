"""Tensor-parallel process groups and the collectives the TP layers use.

A *group* (draft group or target group, DESIGN.md §1) is a set of processes that shard one model
Megatron style. On CPU the collectives run over torch.distributed with the gloo backend; on CUDA
over NCCL. ``TPContext`` is what a layer sees: its rank inside the group, the group size (the TP
degree) and the two collectives it needs.
"""
from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPContext:
    """Position of this process inside its tensor-parallel group.

    Attributes:
        rank: rank inside the group, 0 is the group leader.
        size: TP degree (number of processes in the group).
        group: the torch.distributed process group, or None when ``size == 1``.
    """

    rank: int = 0
    size: int = 1
    group: object | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the group in place (identity when size is 1). Returns ``x``."""
        if self.size > 1:
            # gloo reduces bf16 poorly and not at all for some ops; reduce in fp32 for identical bits.
            if x.dtype != torch.float32:
                y = x.float()
                dist.all_reduce(y, group=self.group)
                x.copy_(y)
            else:
                dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``x`` along the last dimension, in rank order.

        Shapes: ``x`` is ``[..., n]`` on every rank; the result is ``[..., size * n]``.
        """
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


LOCAL = TPContext()


def free_tcp_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for the rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_world(rank: int, world_size: int, port: int, groups: list[list[int]],
               timeout_s: float = 60.0) -> list[TPContext | None]:
    """Join the torch.distributed world and build one TP group per entry of ``groups``.

    Every process must call this with the same ``groups`` (torch.distributed requires all ranks
    to take part in creating every subgroup). Returns, for each entry, this rank's TPContext, or
    None when this rank is not a member.

    Raises:
        RuntimeError: the rendezvous did not complete within ``timeout_s`` seconds.
    """
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=timeout_s))
    out: list[TPContext | None] = []
    for members in groups:
        pg = dist.new_group(members, backend=backend) if len(members) > 1 else None
        if rank in members:
            out.append(TPContext(rank=members.index(rank), size=len(members), group=pg))
        else:
            out.append(None)
    return out
