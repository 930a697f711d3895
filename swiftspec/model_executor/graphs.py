"""Fixed-shape model steps for CUDA-graph capture (SwiftSpec paper section 3.3).

A draft expansion runs ``w`` query tokens and a target verification ``bs``; only the number of
cache slots they attend to grows. Padding every step to a few batch sizes, with the mask padded to
``[n_bucket, C]`` (``C`` = KV-cache capacity, the paper's ``(w, max_seq_len)``), makes every tensor
shape static, so one graph per bucket serves every tree shape and context length. Padded rows are
harmless: their slot is -1 (no KV write) and their mask row is all False (the attention kernels
return zeros for a fully masked row), and rows never mix outside attention. The number of slots in
use (the unpadded mask's width) goes to the step as a device-side ``kv_len``, so the CUDA attention
kernel reads and splits the keys in use rather than the whole capacity on every replay.

On CUDA each bucket is captured once with ``torch.cuda.graph`` and replayed; elsewhere the same
static buffers run eagerly, which is how the padding logic is tested on machines without a GPU.
"""
from __future__ import annotations

from typing import Callable

import torch

Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class PaddedStep:
    """Run ``forward(input_ids, positions, slots, mask, kv_len)`` padded to static bucket shapes.

    Args:
        forward: the model step, e.g. ``lambda ids, pos, slots, mask, kv_len: model(ids, pos, slots,
            mask, kv, kv_len)``; it must return ``[n, hidden]`` and write K/V only through
            ``slots`` (``-1`` = skip). ``kv_len`` (``[1]`` int64) holds the unpadded mask's width
            ``S``: the mask's columns from ``S`` on are all False (see
            :meth:`swiftspec.model_executor.models.llama.LlamaForCausalLM.forward`).
        sizes: batch buckets in tokens, e.g. ``[w]`` for the draft, ``[bs]`` for the target, or
            ``[1, 2, 4, 8, 16]``. A call with more tokens than the largest bucket runs unpadded.
        capacity: KV-cache slots ``C``; masks are padded to ``[bucket, C]``.
        device: where the static buffers live.
        use_graphs: capture CUDA graphs (default: when ``device`` is CUDA).

    Raises:
        ValueError: empty or non-positive ``sizes``, or a mask wider than ``capacity``.
    """

    def __init__(self, forward: Forward, sizes: list[int], capacity: int, device: torch.device | str = "cpu",
                 use_graphs: bool | None = None):
        if not sizes or min(sizes) < 1:
            raise ValueError(f"sizes must be positive batch sizes, got {sizes!r}")
        self.forward = forward
        self.sizes = sorted(set(int(s) for s in sizes))
        self.capacity = capacity
        self.device = torch.device(device)
        self.use_graphs = self.device.type == "cuda" if use_graphs is None else use_graphs
        self.buffers = {n: self._static_inputs(n) for n in self.sizes}
        self.graphs: dict[int, tuple[object, torch.Tensor]] = {}
        self.replays = 0

    def _static_inputs(self, n: int) -> dict[str, torch.Tensor]:
        d = self.device
        return {"ids": torch.zeros(n, dtype=torch.long, device=d),
                "pos": torch.zeros(n, dtype=torch.long, device=d),
                "slots": torch.full((n,), -1, dtype=torch.long, device=d),
                "mask": torch.zeros(n, self.capacity, dtype=torch.bool, device=d),
                "kv_len": torch.zeros(1, dtype=torch.long, device=d)}

    def bucket(self, n: int) -> int | None:
        """The smallest bucket holding ``n`` tokens, or None when none does."""
        return next((s for s in self.sizes if s >= n), None)

    def _fill(self, n: int, input_ids, positions, slots, mask) -> dict[str, torch.Tensor]:
        b = self.buffers[self.bucket(n)]
        S = mask.shape[1]
        if S > self.capacity:
            raise ValueError(f"mask covers {S} slots but the cache has {self.capacity}")
        b["ids"].zero_()[:n].copy_(input_ids)
        b["pos"].zero_()[:n].copy_(positions)
        b["slots"].fill_(-1)[:n].copy_(slots)
        b["mask"].zero_()[:n, :S].copy_(mask)
        b["kv_len"].fill_(S)
        return b

    def capture(self, n: int) -> None:
        """Capture the CUDA graph of bucket ``n`` (warm-up on a side stream first, as PyTorch requires).

        The capture runs on the current stream unless that is the default stream (which cannot
        capture; then on PyTorch's capture stream): a runner's own stream, which may belong to a
        CUDA green context (``ModelRunner(sm_count=...)``), so the graph's kernels are recorded
        in that context, the one they replay in."""
        b = self.buffers[n]
        current = torch.cuda.current_stream(self.device)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            self._forward(b)  # slots are -1: writes nothing
        current.wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        own = current if current != torch.cuda.default_stream(self.device) else None
        with torch.cuda.graph(graph, stream=own):
            out = self._forward(b)
        self.graphs[n] = (graph, out)

    def _forward(self, b: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.forward(b["ids"], b["pos"], b["slots"], b["mask"], b["kv_len"])

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                 mask: torch.Tensor) -> torch.Tensor:
        """Shapes: input_ids, positions, slots ``[n]`` int64; mask ``[n, S]`` bool, ``S <= C``.
        Returns ``[n, hidden]`` (a view into the graph's static output on CUDA: use it before the
        next call)."""
        n = input_ids.shape[0]
        size = self.bucket(n)
        if size is None:
            return self.forward(input_ids, positions, slots, mask, None)
        b = self._fill(n, input_ids, positions, slots, mask)
        if not self.use_graphs:
            return self._forward(b)[:n]
        if size not in self.graphs:
            self.capture(size)
        graph, out = self.graphs[size]
        graph.replay()
        self.replays += 1
        return out[:n]
