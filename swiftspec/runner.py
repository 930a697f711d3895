"""One model on one process, and the leader's handle that keeps a TP group in lock step.

Only the group leader runs the scheduling logic. Every model call it makes (forward, KV moves,
resets) is first sent to the group's followers over pipes, then run locally, so all ranks of the
group execute the same sequence of collectives (docs/architecture.md §1).
"""
from __future__ import annotations

import time
from multiprocessing.connection import Connection

import torch

from swiftspec.models.llama import load_model
from swiftspec.parallel import LOCAL, TPContext


class ModelRunner:
    """A model, its KV cache and its busy-time counter on one rank.

    Args:
        model_dir: Hugging Face style directory (see :mod:`swiftspec.loader`).
        tp: this rank's TP context.
        dtype: compute dtype.
        capacity: KV-cache slots (tokens).
        quant: "int8" for int8 weight-only linear layers (draft models), None for none.
        logits_vocab: compute logits for ids ``[0, logits_vocab)`` only (None: all).
        weights: "native" (GGUF blocks kept), "bfloat16" or "float32" (see :func:`load_model`);
            ``quant`` applies to the layers that run float weights.
        stage: only these decoder layers (a pipeline stage; :meth:`forward_stage`), default all.
        track_positions: the KV cache records each slot's position (caches that keep verified
            keys in tree slots: the pipeline modes; see :class:`swiftspec.models.kv_cache.KVCache`).
        device: where the weights, the KV cache and the step inputs live (the caller sets the
            current CUDA device first). The scheduler's tensors are built on the host; each
            forward moves them here and its logits back.
    """

    def __init__(self, model_dir: str, tp: TPContext = LOCAL, dtype: torch.dtype = torch.float32,
                 capacity: int = 4096, quant: str | None = None, logits_vocab: int | None = None,
                 weights: str = "native", device: torch.device | str = "cpu", stage: range | None = None,
                 track_positions: bool = False):
        self.device = torch.device(device)
        # tree nodes sit up to one tree depth past the cache slots they are stored in
        self.model = load_model(model_dir, tp, dtype, max_positions=capacity + 1024, weights=weights,
                                device=self.device, stage=stage)
        if quant == "int8":
            self.model.quantize_int8_()
        elif quant not in (None, "none"):
            raise ValueError(f"unknown quantization {quant!r}; use 'int8' or None")
        self.logits_vocab = logits_vocab
        self.cfg = self.model.cfg
        self.kv = self.model.make_kv_cache(capacity, self.device, track_positions)
        self.capacity = capacity
        self.busy_s = 0.0
        self.forward_tokens = 0
        self.forwards = 0

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                mask: torch.Tensor, logits_rows: torch.Tensor | None) -> torch.Tensor | None:
        """Run ``n`` tokens (see :meth:`LlamaForCausalLM.forward`); return float32 logits
        ``[len(logits_rows), vocab]`` on the host for the selected rows, or None when none are
        asked for. Inputs may be host tensors (moved to the runner's device here)."""
        t0 = time.perf_counter()
        dev = self.device
        if dev.type != "cpu":
            input_ids, positions, slots, mask = (t.to(dev) for t in (input_ids, positions, slots, mask))
        h = self.model(input_ids, positions, slots, mask, self.kv)
        out = None
        if logits_rows is not None and logits_rows.numel():
            out = self.model.compute_logits(h[logits_rows.to(dev)], self.logits_vocab)
        if dev.type == "cuda":
            out = None if out is None else out.cpu()
            torch.cuda.synchronize(dev)  # busy time is device time
        self.busy_s += time.perf_counter() - t0
        self.forward_tokens += int(input_ids.numel())
        self.forwards += 1
        return out

    def forward_stage(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                      slots: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This pipeline stage's layers (see :meth:`LlamaForCausalLM.forward_stage`), host tensors."""
        t0 = time.perf_counter()
        out = self.model.forward_stage(x, residual, positions, slots, mask, self.kv)
        self.busy_s += time.perf_counter() - t0
        self.forward_tokens += int(positions.numel())
        self.forwards += 1
        return out

    def move_kv(self, src, dst) -> None:
        """Apply cache moves ``src[j] -> dst[j]`` (see :meth:`KVCache.move`)."""
        self.kv.move(src, dst)

    def reset_stats(self) -> None:
        self.busy_s, self.forward_tokens, self.forwards = 0.0, 0, 0

    def stats(self) -> dict:
        return {"busy_s": self.busy_s, "forward_tokens": self.forward_tokens, "forwards": self.forwards}


class RunnerHandle:
    """The leader's view of one model replicated over its TP group.

    ``followers`` are pipes to the other ranks of the group; each call is mirrored to them as
    ``(role, method, args)`` before it runs here.
    """

    def __init__(self, role: str, runner: ModelRunner, followers: list[Connection]):
        self.role, self.runner, self.followers = role, runner, followers

    def _mirror(self, method: str, *args) -> None:
        for c in self.followers:
            c.send((self.role, method, args))

    def forward(self, input_ids, positions, slots, mask, logits_rows=None):
        self._mirror("forward", input_ids, positions, slots, mask, logits_rows)
        return self.runner.forward(input_ids, positions, slots, mask, logits_rows)

    def move_kv(self, src, dst) -> None:
        if len(src):
            self._mirror("move_kv", src, dst)
            self.runner.move_kv(src, dst)

    @property
    def cfg(self):
        return self.runner.cfg

    @property
    def capacity(self) -> int:
        return self.runner.capacity


def serve_follower(runners: dict[str, ModelRunner], leader: Connection) -> None:
    """Follower loop: execute the leader's mirrored calls until it sends ``None`` or the pipe closes."""
    while True:
        try:
            msg = leader.recv()
        except EOFError:
            return
        if msg is None:
            return
        role, method, args = msg
        getattr(runners[role], method)(*args)
