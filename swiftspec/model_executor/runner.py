"""One model on one process, and the leader's handle that keeps a TP group in lock step.

Only the group leader runs the scheduling logic. Every model call it makes (forward, KV moves,
resets) is first sent to the group's followers over pipes, then run locally, so all ranks of the
group execute the same sequence of collectives (docs/architecture.md §1).
"""
from __future__ import annotations

import contextlib
import sys
import time
from multiprocessing.connection import Connection

import numpy as np
import torch

from swiftspec.distributed.parallel import LOCAL, TPContext
from swiftspec.model_executor.models.llama import load_model
from swiftspec.model_executor.sampling import SampleHead, sample_rows
from swiftspec.model_executor.sm_partition import green_context_stream

# the two models' roles: the keys of a worker's runners and of its stats
ROLE_TARGET, ROLE_DRAFT = "target", "draft"


class ModelRunner:
    """A model, its KV cache and its busy-time counter on one rank.

    Args:
        model_dir: Hugging Face style directory (see :mod:`swiftspec.weights.loader`).
        tp: this rank's TP context.
        dtype: compute dtype.
        capacity: KV-cache slots (tokens).
        quant: "int8" for int8 weight-only linear layers (draft models), None for none.
        logits_vocab: compute logits for ids ``[0, logits_vocab)`` only (None: all).
        weights: "native" (GGUF blocks kept), "bfloat16" or "float32" (see :func:`load_model`);
            ``quant`` applies to the layers that run float weights.
        stage: only these decoder layers (a pipeline stage; :meth:`forward_stage`), default all.
        track_positions: the KV cache records each slot's position (caches that keep verified
            keys in tree slots: the pipeline modes; see :class:`swiftspec.model_executor.models.kv_cache.KVCache`).
        device: where the weights, the KV cache and the step inputs live (the caller sets the
            current CUDA device first). The scheduler's tensors are built on the host; each
            forward moves them here in one copy (:class:`StagingBuffer`) and returns its result
            (logits or their reduction, see :meth:`forward`) to the host.
        graph_sizes: run steps of up to ``max(graph_sizes)`` rows padded to these bucket sizes
            (:class:`swiftspec.model_executor.graphs.PaddedStep`: on CUDA every bucket is captured here, at
            load, as a CUDA graph and replayed; on CPU the same padded step runs eagerly, for tests);
            bigger steps (the prefill) run as they are. None: no padding.
        stream_priority: on CUDA, run this model's work on a stream of its own with this
            priority (-1 high, 0 low; the colocated mode gives the target -1, the draft 0), so
            a launched forward (:meth:`launch`) overlaps the other model's; None: the current
            stream. Ignored on CPU.
        sm_count: on CUDA, confine this model to that many streaming multiprocessors: its stream
            is made in a CUDA green context of ``sm_count`` SMs (:func:`green_context_stream`;
            the colocated mode's ``draft_sms``), so every kernel it launches, CUDA-graph
            replays included (the graphs are captured on that stream), runs on those SMs only.
            Replaces ``stream_priority`` (the stream has priority 0, the lowest). None: no
            partition. Errors: those of :func:`green_context_stream` (``ValueError`` on CPU).
    """

    def __init__(self, model_dir: str, tp: TPContext = LOCAL, dtype: torch.dtype = torch.float32,
                 capacity: int = 4096, quant: str | None = None, logits_vocab: int | None = None,
                 weights: str = "native", device: torch.device | str = "cpu", stage: range | None = None,
                 track_positions: bool = False, stream_priority: int | None = None,
                 graph_sizes: list[int] | None = None, sm_count: int | None = None):
        self.device = torch.device(device)
        self.staging = StagingBuffer(self.device) if self.device.type == "cuda" else None
        self.stream = None
        if sm_count is not None:  # the green context's stream: every kernel below runs on its SMs
            self.stream = green_context_stream(sm_count, self.device)
        elif self.device.type == "cuda" and stream_priority is not None:
            self.stream = torch.cuda.Stream(self.device, priority=stream_priority)
        # tree nodes sit up to one tree depth past the cache slots they are stored in
        if quant not in (None, "none", "int8"):
            raise ValueError(f"unknown quantization {quant!r}; use 'int8' or None")
        self.model = load_model(model_dir, tp, dtype, max_positions=capacity + 1024, weights=weights,
                                device=self.device, stage=stage, int8=quant == "int8")
        self.logits_vocab = logits_vocab
        self.cfg = self.model.cfg
        self.kv = self.model.make_kv_cache(capacity, self.device, track_positions)
        self.capacity = capacity
        self.step = None
        if graph_sizes:
            from swiftspec.model_executor.graphs import PaddedStep

            self.step = PaddedStep(lambda i, p, s, m, n: self.model(i, p, s, m, self.kv, n), graph_sizes, capacity,
                                   self.device)
            if self.step.use_graphs:  # every bucket now, so no request pays for a capture
                try:
                    with self._on_stream():
                        for n in self.step.sizes:
                            self.step.capture(n)
                except RuntimeError as e:  # an op that cannot be captured: run eagerly, say why once
                    print(f"swiftspec: CUDA graph capture failed, decode steps run eagerly: {e}", file=sys.stderr)
                    self.step = None
        self.busy_s = 0.0
        self.forward_tokens = 0
        self.forwards = 0

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                mask: torch.Tensor, logits_rows: torch.Tensor | None, head: str | int | None = None):
        """Run ``n`` tokens (see :meth:`LlamaForCausalLM.forward`) and return, on the host, for
        the ``k = len(logits_rows)`` selected rows (None when none are asked for): ``head`` None:
        float32 logits ``[k, vocab]``; "argmax": int64 ``[k]`` greedy tokens (first index on
        ties); a :class:`~swiftspec.model_executor.sampling.SampleHead`: int64 ``[k]`` sampled tokens
        (:func:`~swiftspec.model_executor.sampling.sample_rows`, one uniform per row); an int ``t``: the ``t`` most likely tokens of each row, ``(values, ids)``, float32
        log-probabilities and int64 ids ``[k, t]``, heaviest first. The reductions run where the
        model runs, so on a GPU only ids and log-probabilities come back. Inputs may be host
        tensors (moved to the runner's device here)."""
        return self.launch(input_ids, positions, slots, mask, logits_rows, head).result()

    def launch(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
               mask: torch.Tensor, logits_rows: torch.Tensor | None, head: str | int | None = None) -> "Launched":
        """Start :meth:`forward` without waiting for it: on CUDA the work is queued on the
        runner's stream and :meth:`Launched.result` waits for it (the host is free meanwhile);
        on CPU it runs here, to completion."""
        t0 = time.perf_counter()
        dev = self.device
        # A target's token past this model's embedding (a draft of a smaller vocabulary: Qwen2.5's
        # 0.5B has 151936 rows, its 32B 152064) enters as the last row: the draft guesses worse
        # after it, the target still verifies every token; an index past the table would stop a
        # CPU request with IndexError and a GPU process with a device-side assert.
        input_ids = input_ids.clamp(max=self.cfg.vocab_size - 1)
        with self._on_stream():
            timing = None
            if dev.type == "cuda":
                timing = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                timing[0].record()
                input_ids, positions, slots, mask, logits_rows = self.staging.to_device(
                    input_ids, positions, slots, mask, logits_rows)
            h = (self.step(input_ids, positions, slots, mask) if self.step is not None
                 else self.model(input_ids, positions, slots, mask, self.kv))
            out = None
            if logits_rows is not None and logits_rows.numel():
                out = _reduce(self.model.compute_logits(h[logits_rows], self.logits_vocab), head)
            if timing is not None:
                timing[1].record()
        self.forward_tokens += int(input_ids.numel())
        self.forwards += 1
        return Launched(self, out, t0, timing)

    def _on_stream(self):
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

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
        """Apply cache moves ``src[j] -> dst[j]`` (see :meth:`KVCache.move`), on the runner's
        stream (after its forwards)."""
        with self._on_stream():
            self.kv.move(src, dst)

    def reset_stats(self) -> None:
        """Zero the counters :meth:`stats` reports."""
        self.busy_s, self.forward_tokens, self.forwards = 0.0, 0, 0

    def stats(self) -> dict:
        """The counters since the last :meth:`reset_stats`: ``busy_s`` (seconds in forwards: device time
        on CUDA, wall time on CPU), ``forward_tokens`` (tokens run) and ``forwards`` (forward calls)."""
        return {"busy_s": self.busy_s, "forward_tokens": self.forward_tokens, "forwards": self.forwards}


class StagingBuffer:
    """Host tensors to the device in one transfer: packed into one pinned host buffer, copied
    with one non-blocking copy on the current stream, returned as views of one device buffer
    (the step's ids, positions, slots, mask and logits rows: one copy instead of five). Both
    buffers grow as needed. Before the host buffer is rewritten, the previous copy is waited
    for; the device views stay valid until the next :meth:`to_device` on the same stream (which
    runs after the work that read them). On CPU (tests) nothing is pinned; the same packing.
    """

    ALIGN = 8  # every piece starts at a multiple of the widest element (int64)

    def __init__(self, device: torch.device):
        self.device = device
        self.host = self.dev = None
        self._copied = None  # CUDA event after the last copy

    def to_device(self, *tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
        """``tensors`` (host, any shapes and dtypes; None passes through) on the device, in order."""
        present = [t for t in tensors if t is not None]
        if any(t.device.type != "cpu" for t in present):  # not host tensors: no staging
            return [None if t is None else t.to(self.device) for t in tensors]
        offsets, total = [], 0
        for t in present:
            offsets.append(total)
            total += -(-t.numel() * t.element_size() // self.ALIGN) * self.ALIGN
        if self._copied is not None:
            self._copied.synchronize()  # the previous copy still reads the host buffer
        if self.host is None or self.host.numel() < total:
            size = max(total, 2 * (0 if self.host is None else self.host.numel()), 4096)
            self.host = torch.empty(size, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
            self.dev = torch.empty(size, dtype=torch.uint8, device=self.device)
        for t, o in zip(present, offsets):
            self.host[o:o + t.numel() * t.element_size()].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
        self.dev[:total].copy_(self.host[:total], non_blocking=True)
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()
        views = iter(self.dev[o:o + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
                     for t, o in zip(present, offsets))
        return [None if t is None else next(views) for t in tensors]


def _reduce(logits: torch.Tensor, head: str | int | SampleHead | None):
    """The rows' ``head`` (see :meth:`ModelRunner.forward`) from float32 logits ``[k, vocab]``."""
    if head is None:
        return logits
    if isinstance(head, SampleHead):
        return sample_rows(logits, head.params, torch.tensor(head.uniforms, dtype=torch.float64, device=logits.device))
    if head == "argmax":
        return logits.argmax(-1)
    values, ids = torch.log_softmax(logits, dim=-1).topk(min(int(head), logits.shape[-1]), dim=-1)
    return values, ids


class Launched:
    """A forward in flight (:meth:`ModelRunner.launch`): :meth:`done` polls it, :meth:`result`
    waits and returns what :meth:`ModelRunner.forward` returns, adding the forward's device time
    (CUDA events) or wall time (CPU) to the runner's busy time."""

    def __init__(self, runner: ModelRunner, out: torch.Tensor | None, t0: float,
                 timing: tuple[torch.cuda.Event, torch.cuda.Event] | None):
        # timing: the start and end events on CUDA, None once waited for (on CPU: at once, the work is done)
        self.runner, self.out, self.timing = runner, out, timing
        if timing is None:
            runner.busy_s += time.perf_counter() - t0

    def done(self) -> bool:
        """Whether the forward has finished (never blocks; on CPU always True)."""
        return self.timing is None or self.timing[1].query()

    def result(self):
        """Wait for the forward and return what :meth:`ModelRunner.forward` returns (copied to the host
        on CUDA), adding its device time to the runner's ``busy_s`` on the first call."""
        if self.timing is not None:
            start, end = self.timing
            end.synchronize()
            self.timing = None
            self.runner.busy_s += start.elapsed_time(end) / 1e3  # busy time is device time
            if self.out is not None:
                with self.runner._on_stream():  # the stream that produced it
                    self.out = tuple(t.cpu() for t in self.out) if isinstance(self.out, tuple) else self.out.cpu()
        return self.out


class RunnerHandle:
    """The leader's view of one model replicated over its TP group.

    ``followers`` are pipes to the other ranks of the group; each call is mirrored to them as
    ``(role, method, args)`` before it runs here.
    """

    def __init__(self, role: str, runner: ModelRunner, followers: list[Connection]):
        self.role, self.runner, self.followers = role, runner, followers

    def _mirror(self, method: str, *args) -> None:
        if not self.followers:
            return
        msg = (self.role, method, tuple(map(_to_wire, args)))
        for c in self.followers:
            c.send(msg)

    def forward(self, input_ids, positions, slots, mask, logits_rows=None, head=None):
        """:meth:`ModelRunner.forward` on every rank of the group (mirrored to the followers first);
        returns the leader's result."""
        return self.launch(input_ids, positions, slots, mask, logits_rows, head).result()

    def launch(self, input_ids, positions, slots, mask, logits_rows=None, head=None) -> Launched:
        """:meth:`ModelRunner.launch` on the leader (the followers run the forward as usual)."""
        self._mirror("forward", input_ids, positions, slots, mask, logits_rows)
        return self.runner.launch(input_ids, positions, slots, mask, logits_rows, head)

    def move_kv(self, src, dst) -> None:
        """:meth:`ModelRunner.move_kv` (cache slots ``src[j] -> dst[j]``, int64 ``[m]`` each) on every
        rank of the group; nothing is sent when ``src`` is empty."""
        if len(src):
            self._mirror("move_kv", src, dst)
            self.runner.move_kv(src, dst)

    @property
    def cfg(self):
        """The model's configuration (the leader runner's ``cfg``)."""
        return self.runner.cfg

    @property
    def capacity(self) -> int:
        """The KV cache's capacity in token slots."""
        return self.runner.capacity


def _to_wire(a):
    """A host tensor as a numpy array for the pipe: pickling a tensor moves it to a shared-memory
    file (~0.5 ms per message with a step's four tensors), an array is copied into the message
    (~25 us); anything else as it is."""
    return a.numpy() if isinstance(a, torch.Tensor) and a.device.type == "cpu" else a


def _from_wire(a):
    return torch.from_numpy(a) if isinstance(a, np.ndarray) else a


def serve_follower(runners: dict[str, ModelRunner], leader: Connection) -> None:
    """Follower loop: execute the leader's mirrored calls until it sends ``None`` or the pipe
    closes; answer its ``"ping"`` with ``"pong"`` (:func:`swiftspec.engine.worker.ping_followers`)."""
    while True:
        try:
            msg = leader.recv()
        except EOFError:
            return
        if msg is None:
            return
        if msg == "ping":  # the leader passes on the engine's liveness ping between requests
            leader.send("pong")
            continue
        role, method, args = msg
        getattr(runners[role], method)(*map(_from_wire, args))
