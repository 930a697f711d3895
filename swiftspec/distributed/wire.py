"""Messages between ranks as tensors of fixed layout: bytes, JSON text and flags; never pickle.

torch.distributed's object collectives (``broadcast_object_list``, ``all_gather_object``,
``gather_object``) unpickle what a peer sends, so any process that reaches a rank's sockets could
run code in it. Everything the engine's ranks exchange outside the model's tensors goes through
these helpers instead: a byte string travels as an int64 length header followed by a ``uint8``
tensor; structured data as UTF-8 JSON text (plain values: no code runs on decoding); flags as an
int64 tensor. Lengths are checked against ``max_bytes`` before any buffer is allocated.

Every function is collective over ``group`` (None: the default world group): every member calls
it, in the same order. On an NCCL group the tensors go through this rank's current CUDA device.
"""
from __future__ import annotations

import json

import torch
import torch.distributed as dist

MAX_BYTES = 1 << 20  # the largest message accepted (the control plane sends hostnames, plans, statistics)


def _device(group) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _check_length(n: int, max_bytes: int) -> int:
    if not 0 <= n <= max_bytes:
        raise RuntimeError(f"peer message of {n} bytes refused (at most {max_bytes})")
    return n


def broadcast_bytes(data: bytes | None, src: int, group=None, max_bytes: int = MAX_BYTES) -> bytes:
    """``data`` from global rank ``src`` (which passes it; the others pass None) on every rank.

    Raises:
        RuntimeError: the announced length exceeds ``max_bytes`` (or is negative).
    """
    dev = _device(group)
    mine = dist.get_rank() == src
    n = torch.tensor([len(data) if mine else 0], dtype=torch.int64, device=dev)
    dist.broadcast(n, src=src, group=group)
    size = _check_length(int(n.item()), max_bytes)
    if size == 0:
        return b""
    if mine:
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev)
    else:
        buf = torch.empty(size, dtype=torch.uint8, device=dev)
    dist.broadcast(buf, src=src, group=group)
    return data if mine else bytes(buf.cpu().numpy())


def all_gather_bytes(data: bytes, group=None, max_bytes: int = MAX_BYTES) -> list[bytes]:
    """Every member's ``data``, in group rank order, on every member.

    Raises:
        RuntimeError: some member's length exceeds ``max_bytes``.
    """
    dev = _device(group)
    size = dist.get_world_size(group)
    n = torch.tensor([len(data)], dtype=torch.int64, device=dev)
    lens = [torch.empty_like(n) for _ in range(size)]
    dist.all_gather(lens, n, group=group)
    lengths = [_check_length(int(x.item()), max_bytes) for x in lens]
    width = max(lengths)
    if width == 0:
        return [b""] * size
    buf = torch.zeros(width, dtype=torch.uint8)
    if data:
        buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    buf = buf.to(dev)
    parts = [torch.empty_like(buf) for _ in range(size)]
    dist.all_gather(parts, buf, group=group)
    return [bytes(p[:k].cpu().numpy()) for p, k in zip(parts, lengths)]


def all_gather_flags(flag: bool, group=None) -> list[bool]:
    """Every member's ``flag``, in group rank order, on every member."""
    dev = _device(group)
    mine = torch.tensor([int(bool(flag))], dtype=torch.int64, device=dev)
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, mine, group=group)
    return [bool(p.item()) for p in parts]


def _decode_json(data: bytes):
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise RuntimeError(f"malformed peer message: {e}") from e


def broadcast_json(value, src: int, group=None, max_bytes: int = MAX_BYTES):
    """``value`` (JSON-serializable: dicts, lists, strings, numbers, booleans, None) from global
    rank ``src`` on every rank; the others pass None. Tuples arrive as lists.

    Raises:
        RuntimeError: the message is too long or not valid UTF-8 JSON.
    """
    data = json.dumps(value).encode() if dist.get_rank() == src else None
    out = broadcast_bytes(data, src, group, max_bytes)
    return value if data is not None else _decode_json(out)


def all_gather_json(value, group=None, max_bytes: int = MAX_BYTES) -> list:
    """Every member's ``value`` (JSON-serializable), in group rank order, on every member.

    Raises:
        RuntimeError: some message is too long or not valid UTF-8 JSON.
    """
    return [_decode_json(d) for d in all_gather_bytes(json.dumps(value).encode(), group, max_bytes)]
