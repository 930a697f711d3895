"""Host memory for the weights a CPU forward streams: 2 MiB transparent huge pages.

A one-row decode step reads every weight once, so on a CPU it runs at the rate memory streams
into the cores. With 4 KiB pages that stream crosses a page every 4 KiB: a TLB miss and a
page walk each time, and the hardware prefetchers, which track streams within a page, start
over. :func:`empty` gives a tensor whose pages Linux may back with 2 MiB pages instead
(``madvise(MADV_HUGEPAGE)``, honoured where ``/sys/kernel/mm/transparent_hugepage/enabled``
says ``always`` or ``madvise``). The block-format weights
(:class:`swiftspec.model_executor.layers.gguf.GGUFWeight`) are made by it when their layer is built, so the
loader copies the file's blocks straight into them. bench/huge_pages.py measures a forward on them
against the same weights on 4 KiB pages, call by call (a small gain on an AMD Zen 3; bench/LOG.md,
"Block weights on 2 MiB huge pages").

The memory is an anonymous private mapping owned by the tensor's storage (``torch.frombuffer``
keeps the mapping alive; it is unmapped with the last tensor that views it); a fork's child gets
copy-on-write pages as for any other allocation.
"""
from __future__ import annotations

import math
import mmap
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20  # bytes: the x86-64 transparent huge page
_THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_available() -> bool:
    """Whether this process can ask for transparent huge pages: Linux, ``MADV_HUGEPAGE`` known to
    Python, and the kernel's mode ``always`` or ``madvise`` (not ``never``)."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        mode = _THP_ENABLED.read_text()
    except OSError:
        return False
    return "[never]" not in mode


def empty(shape: tuple[int, ...] | list[int], dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """An uninitialized contiguous CPU tensor of ``shape`` and ``dtype``, starting on a 2 MiB
    boundary of a mapping advised for huge pages, where :func:`huge_pages_available` and the
    tensor is at least one huge page; otherwise (or when the default device is not the CPU, e.g.
    a ``meta`` model) ``torch.empty``. The kernel gives huge pages when it can (it may fall back
    to 4 KiB pages, e.g. with fragmented memory); the contents are the same either way.

    Raises:
        ValueError: a negative dimension.
    """
    if any(int(n) < 0 for n in shape):
        raise ValueError(f"negative dimension in {tuple(shape)}")
    nbytes = math.prod(int(n) for n in shape) * dtype.itemsize
    if nbytes < HUGE_PAGE or torch.get_default_device().type != "cpu" or not huge_pages_available():
        return torch.empty(shape, dtype=dtype)
    # one huge page more than asked, so a 2 MiB-aligned start lies inside (the tail stays untouched
    # and so never takes memory)
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # e.g. a kernel built without THP: plain pages
        pass
    raw = torch.frombuffer(mapping, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE
    return raw[start:start + nbytes].view(dtype).view(*shape)


def huge_page_bytes() -> int | None:
    """Bytes of this process's anonymous memory on transparent huge pages (``AnonHugePages`` of
    ``/proc/self/smaps_rollup``), or None where the kernel does not report it."""
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
