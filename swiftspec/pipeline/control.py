"""The leader's per-timestep control message (docs/architecture.md §10) and its wire layout.

A :class:`Control` crosses the network every timestep, to stages that may run on other hosts, so
it travels as one int64 tensor of fixed layout (never pickled: a peer's bytes are only ever read as
integers). Layout, all int64:

* header ``[op, S, m]``: op (:data:`OPS` index), stages, cache moves (-1: None);
* the moves ``src[m]``, ``dst[m]``;
* per stage a header ``[present, in_rows, k, n, W, has_tokens, l]`` (k = -1: ``keep`` is None),
  then ``keep[k]``, ``positions[n]``, ``slots[n]``, ``tokens[n]`` (if any), ``logit_rows[l]``
  and the ``[n, W]`` mask as bytes packed 8 to a word.

:func:`broadcast_control` sends the length, then the tensor (the two broadcasts the object
collective also made).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

OPS = ("step", "done", "end")
MAX_WORDS = 1 << 26  # 512 MiB: a longer announced control is refused before allocating it
_WORK_HEADER = 7


@dataclass
class Work:
    """One stage's micro-batch in one timestep.

    Attributes:
        in_rows: rows the previous stage sent (0 on stage 0, which takes ``tokens``).
        keep: indices of the received rows that survive (None = all).
        tokens: ``[n]`` int64 token ids (stage 0 only).
        positions, slots: ``[n]`` int64 for the surviving rows; mask ``[n, W]`` bool.
        logit_rows: rows (of the surviving ones) whose logits the last stage returns.
    """

    in_rows: int
    keep: list[int] | None
    positions: torch.Tensor
    slots: torch.Tensor
    mask: torch.Tensor
    tokens: torch.Tensor | None = None
    logit_rows: list[int] = field(default_factory=list)


@dataclass
class Control:
    """What the leader broadcasts at the start of a timestep: ``op`` "step" (run ``work``),
    "done" (end of request: stages report their statistics) or "end" (shut down); ``moves``
    (``(src, dst)`` slot lists) are applied to every KV cache before the step's work."""

    op: str
    work: list[Work | None] = field(default_factory=list)
    moves: tuple[list[int], list[int]] | None = None


def _ints(x) -> torch.Tensor:
    return torch.as_tensor(x, dtype=torch.int64).reshape(-1)


def encode(ctrl: Control) -> torch.Tensor:
    """``ctrl`` as a 1-D int64 tensor (the layout of the module docstring).

    Raises:
        ValueError: an op outside :data:`OPS`, or moves of unequal lengths.
    """
    if ctrl.op not in OPS:
        raise ValueError(f"control op {ctrl.op!r} is not one of {OPS}")
    parts = []
    if ctrl.moves is None:
        parts.append(_ints([OPS.index(ctrl.op), len(ctrl.work), -1]))
    else:
        src, dst = _ints(ctrl.moves[0]), _ints(ctrl.moves[1])
        if src.numel() != dst.numel():
            raise ValueError(f"cache moves of {src.numel()} sources and {dst.numel()} destinations")
        parts += [_ints([OPS.index(ctrl.op), len(ctrl.work), src.numel()]), src, dst]
    for w in ctrl.work:
        if w is None:
            parts.append(torch.zeros(_WORK_HEADER, dtype=torch.int64))
            continue
        n, width = w.mask.shape
        keep = None if w.keep is None else _ints(w.keep)
        parts.append(_ints([1, w.in_rows, -1 if keep is None else keep.numel(), n, width,
                            int(w.tokens is not None), len(w.logit_rows)]))
        parts += [x for x in (keep, _ints(w.positions), _ints(w.slots),
                              None if w.tokens is None else _ints(w.tokens), _ints(w.logit_rows)) if x is not None]
        bits = w.mask.to(torch.uint8).reshape(-1)
        pad = -bits.numel() % 8
        parts.append(torch.cat([bits, bits.new_zeros(pad)]).view(torch.int64))
    return torch.cat(parts)


class _Reader:
    def __init__(self, t: torch.Tensor):
        self.t, self.at = t, 0

    def take(self, n: int) -> torch.Tensor:
        if n < 0 or self.at + n > self.t.numel():
            raise RuntimeError(f"malformed pipeline control: {n} words asked at {self.at} of {self.t.numel()}")
        out = self.t[self.at:self.at + n]
        self.at += n
        return out

    def ints(self, n: int) -> list[int]:
        return self.take(n).tolist()


def decode(t: torch.Tensor) -> Control:
    """The :class:`Control` that :func:`encode` made ``t`` from (``keep`` and ``logit_rows`` as
    lists, ``moves`` as int64 tensors).

    Raises:
        RuntimeError: ``t`` does not follow the layout (an unknown op, a length past its end, or
            words left over).
    """
    r = _Reader(t)
    op, stages, m = r.ints(3)
    if not 0 <= op < len(OPS) or stages < 0:
        raise RuntimeError(f"malformed pipeline control: op {op}, {stages} stages")
    moves = None if m == -1 else (r.take(m).clone(), r.take(m).clone())
    work: list[Work | None] = []
    for _ in range(stages):
        present, in_rows, k, n, width, has_tokens, nl = r.ints(_WORK_HEADER)
        if not present:
            work.append(None)
            continue
        keep = None if k == -1 else r.ints(k)
        positions, slots = r.take(n).clone(), r.take(n).clone()
        tokens = r.take(n).clone() if has_tokens else None
        logit_rows = r.ints(nl)
        if n < 0 or width < 0:
            raise RuntimeError(f"malformed pipeline control: mask [{n}, {width}]")
        bits = r.take((n * width + 7) // 8).view(torch.uint8)[:n * width]
        work.append(Work(in_rows, keep, positions, slots, bits.view(n, width).bool(), tokens, logit_rows))
    if r.at != t.numel():
        raise RuntimeError(f"malformed pipeline control: {t.numel() - r.at} words left over")
    return Control(OPS[op], work, moves)


def broadcast_control(ctrl: Control | None, src: int) -> Control:
    """The leader (global rank ``src``) passes ``ctrl``; the other ranks pass None and get it
    (collective over the default group).

    Raises:
        RuntimeError: the announced length exceeds :data:`MAX_WORDS`, or a malformed control.
    """
    mine = ctrl is not None
    data = encode(ctrl) if mine else None
    n = torch.tensor([data.numel() if mine else 0], dtype=torch.int64)
    dist.broadcast(n, src=src)
    size = int(n.item())
    if not 0 < size <= MAX_WORDS:
        raise RuntimeError(f"pipeline control of {size} words refused (1 to {MAX_WORDS})")
    buf = data if mine else torch.empty(size, dtype=torch.int64)
    dist.broadcast(buf, src=src)
    return ctrl if mine else decode(buf)
