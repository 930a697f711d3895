"""Host memory on transparent huge pages (swiftspec/weights/host_memory.py) and the block weights made on it."""
from __future__ import annotations

import gc

import pytest
import torch

from swiftspec.model_executor.layers.gguf import GGUFWeight
from swiftspec.ops import quant
from swiftspec.weights import host_memory

HUGE = host_memory.HUGE_PAGE


@pytest.mark.parametrize("shape,dtype", [((3, 5), torch.uint8), ((1024, 4096), torch.uint8),
                                         ((600, 1024), torch.float32), ((0, 4096), torch.uint8)])
def test_empty_has_the_shape_and_keeps_what_is_written(shape, dtype):
    t = host_memory.empty(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous() and t.device.type == "cpu"
    values = torch.arange(t.numel(), dtype=torch.int64).remainder(251).to(dtype).view(shape)
    t.copy_(values)
    gc.collect()  # the mapping is owned by the tensor's storage, not by a Python variable here
    assert torch.equal(t, values)
    big = t.numel() * t.element_size() >= HUGE
    if big and host_memory.huge_pages_available():
        assert t.data_ptr() % HUGE == 0  # the mapping's 2 MiB-aligned part: what the kernel can back with huge pages


def test_views_outlive_the_tensor_they_come_from():
    t = host_memory.empty((4 * HUGE,))
    t.fill_(7)
    tail = t[3 * HUGE:]
    del t
    gc.collect()
    assert int(tail.sum()) == 7 * HUGE


def test_empty_follows_a_non_cpu_default_device_and_rejects_negative_sizes():
    with torch.device("meta"):
        assert host_memory.empty((4096, 1024)).device.type == "meta"
    with pytest.raises(ValueError, match="negative"):
        host_memory.empty((-1, 8))


def test_huge_page_bytes_is_a_count_or_unknown():
    n = host_memory.huge_page_bytes()
    assert n is None or (isinstance(n, int) and n >= 0)


def test_block_weights_are_made_on_huge_page_memory():
    # a Q4_K weight of 4096 x 2048 (4.5 MiB of blocks): built on the mapping, loaded by copy into it
    k, n, t = 2048, 4096, 12
    w = GGUFWeight(k, [n], [t])
    part = w.parts[0]
    assert part.shape == (n, quant.row_bytes(t, k)) and part.dtype == torch.uint8
    if host_memory.huge_pages_available():
        assert part.data_ptr() % HUGE == 0
    raw = torch.randint(0, 256, tuple(part.shape), dtype=torch.uint8)
    before = part.data_ptr()
    w.weight_loader(part, raw)
    assert torch.equal(part.data, raw) and part.data_ptr() == before  # copied into place, not replaced
