"""Worker processes: one per TP rank of each device group (docs/architecture.md §1).

A worker pins itself to its cores, joins the torch.distributed world when its group has more
than one rank, loads its model shard(s), reports ``("ready", pid, info)`` to the engine
(:func:`ready_info`: its device, collective backend and CUDA graphs), and then
either leads its group (runs a decoding loop of :mod:`swiftspec.spec_decode.modes` per request) or follows
its leader's mirrored model calls. An exception while a lone leader serves a request is that
request's: reported as ``("failed", kind, "Type: message")``, and the leader waits for the next
request. Any other exception is reported as ``("error", traceback)`` before the process exits, so
the engine can raise it instead of hanging.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

import torch

from swiftspec.engine.config import EngineConfig
from swiftspec.model_executor.runner import ROLE_DRAFT, ROLE_TARGET
from swiftspec.spec_decode.draft_state import DraftState, TreeParams
from swiftspec.spec_decode.modes import DecodeMode, mode_for, registered
from swiftspec.spec_decode.ngram import NgramParams


@dataclass
class WorkerSpec:
    """One worker's place in the engine, with the engine's configuration whole (nano-vllm's
    ``ModelRunner(config, rank, event)``); picklable: it reaches the worker through multiprocessing.

    The configuration's own fields (``max_model_len``, ``kernels``, ``cuda_graphs``, ``weights``,
    ``draft_payback``, ``draft_sms``, ``pipeline_order``, ``master_addr``, ``start_timeout_s``, the
    tree and n-gram parameters) are read from ``config``; this class holds only what the engine
    resolved for this rank.

    Attributes:
        config: the engine's :class:`swiftspec.engine.config.EngineConfig`, whole.
        rank, world_size: the torch.distributed world.
        port: the pipeline's TCP rendezvous port on ``config.master_addr`` when some stage runs on
            another host, else 0.
        rendezvous_dir: the private directory (mode 0700) where ranks spawned on this host meet
            through a file store, or None (no world, or a TCP one).
        groups: TP groups as lists of global ranks (the same list in every worker).
        group: index of this worker's group in ``groups``.
        models: role -> model directory for the models this rank holds a shard of.
        kind: this group's job: "target" (async target group), "draft" (async draft group),
            "serial", "hybrid" or "colocated" (both models), "autoregressive" or "ngram" (target only), "pipedec" /
            "pipeinfer" / "pipeline-autoregressive" (pipeline stage 0: the leader, with the draft if any)
            or "stage" (a later pipeline stage, :func:`swiftspec.pipeline.stages.serve_stage`).
        stages: the pipeline's length (pipeline modes; 1 otherwise); stage_layers: the target's
            decoder layers ``(start, stop)`` of every stage (the leader's plan).
        cores: CPU cores to pin to (None = leave the affinity alone); threads: intra-op threads.
        device: where this rank's model shards, KV caches and step inputs live: "cpu" or
            "cuda:K" (:mod:`swiftspec.engine.placement`); it also picks the collective backend.
        decode_mode: the leader's decode loop (a registered
            :class:`swiftspec.spec_decode.modes.DecodeMode` subclass, picked by the engine; pickled
            by reference, so a mode registered by user code runs here too); None: looked up by
            ``kind``.
        world_devices: the device of every global rank (``world_size`` entries; None: each rank
            on its own device): ranks of one group sharing a GPU make the control plane gloo and
            the collectives LL kernels (:func:`swiftspec.distributed.parallel.init_world`).
        dtype: "float32" or "bfloat16" (``config.dtype`` with "auto" resolved).
        draft_vocab: the draft proposes only ids ``[0, draft_vocab)`` (ids the target knows too,
            optionally fewer: the most frequent ones).
        draft_quant: "int8" or None: weight-only quantization of the draft model (None on CUDA,
            which has no int8 kernel).
        tokenizer_file: the target's ``tokenizer.json`` (stop strings are matched on its text).
    """

    config: EngineConfig
    rank: int
    world_size: int
    port: int
    groups: list[list[int]]
    group: int
    models: dict[str, str]
    kind: str
    cores: list[int] | None = None
    threads: int = 1
    device: str = "cpu"
    dtype: str = "float32"
    draft_vocab: int | None = None
    draft_quant: str | None = None
    tokenizer_file: str | None = None
    stages: int = 1
    stage_layers: list[tuple[int, int]] | None = None
    world_devices: list[str] | None = None
    decode_mode: type | None = None
    rendezvous_dir: str | None = None

    @property
    def tree(self) -> TreeParams:
        """The draft tree's shape (``config.tree_params()``)."""
        return self.config.tree_params()

    @property
    def ngram(self) -> NgramParams:
        """The "ngram" mode's proposal shape (``config.ngram_params()``)."""
        return self.config.ngram_params()

    @property
    def verify_rows(self) -> int:
        """The most rows a target verification of this group's job takes: its decode mode's
        (:meth:`swiftspec.spec_decode.modes.DecodeMode.verify_rows`: the target alone 1, ``ngram``
        its chain and root, ``hybrid`` at most ``config.hybrid_rows``); for a job with no
        registered mode (a pipeline stage) the default: the draft tree's ``bs`` or a chain and its
        root, whichever is larger."""
        mode = self.decode_mode or (mode_for(self.kind) if self.kind in registered() else DecodeMode)
        return mode.verify_rows(self.config)

    @property
    def is_leader(self) -> bool:
        """Whether this rank leads its TP group (the group's first global rank)."""
        return self.rank == self.groups[self.group][0]


def graph_buckets(most: int) -> list[int]:
    """CUDA-graph buckets of a model's decode steps: powers of two up to the first one >= ``most``
    (the worker asks for ``bs`` for the target, whose verifications have up to ``bs`` rows, and
    ``2 bs`` for the draft, whose expansions have ``w`` rows and catch-ups the tokens verified
    since; bigger steps, the prefill among them, run eagerly)."""
    sizes = [1]
    while sizes[-1] < most:
        sizes.append(2 * sizes[-1])
    return sizes


def decode_graph_sizes(spec: WorkerSpec, tp, role: str) -> list[int] | None:
    """The CUDA-graph buckets of ``role``'s decode steps on this rank (:func:`graph_buckets`), or
    None (steps run eagerly): graphs are off, the device is not CUDA, or the group's collectives
    cannot be captured (:func:`swiftspec.distributed.parallel.graph_ban`: TP > 1 is captured on the CUDA LL
    communicator only). ``tp``: this rank's :class:`swiftspec.distributed.parallel.TPContext`."""
    from swiftspec.distributed.parallel import graph_ban

    if not spec.config.cuda_graphs or torch.device(spec.device).type != "cuda" or graph_ban(tp) is not None:
        return None
    return graph_buckets(spec.verify_rows if role == ROLE_TARGET else 2 * spec.tree.bs)


def ready_info(spec: WorkerSpec, tp, runners: dict) -> dict:
    """What a worker tells the engine once loaded (``Engine.workers``), so a run can prove which
    collective path and how many CUDA graphs it used.

    Keys: ``pid``; ``kind``, ``rank`` (global), ``group_rank``, ``tp`` (group size); ``device``
    ("cpu" / "cuda:K"); ``threads`` (intra-op threads, :func:`pin`); ``comm_backend``
    (:attr:`swiftspec.distributed.parallel.TPContext.comm_backend`: "local", "ll", "shm", "gloo" or "nccl"); ``control_backend`` (the process group's, or None);
    ``cuda_graphs``: role -> graphs captured; ``graph_ban``: why decode steps run eagerly at
    TP > 1 on CUDA with graphs requested, else None; ``ll_epochs``: collective calls the LL
    communicator has run so far (graph warm-ups included), None without one; ``kernels``: on
    CPU, :func:`swiftspec.ops.cpu_dispatch` in this process (the quantized GEMM's variant it
    tuned to and why), else None; ``quant_layout_rows``: role -> the interleave groups of its GGUF
    weights (:func:`swiftspec.model_executor.kernel_tuning.layout_rows`; [] without any).
    """
    from swiftspec import ops
    from swiftspec.distributed.parallel import graph_ban
    from swiftspec.model_executor.kernel_tuning import layout_rows

    ban = graph_ban(tp) if spec.config.cuda_graphs and torch.device(spec.device).type == "cuda" else None
    epochs = None
    if tp.shm is not None:
        e = tp.shm.epoch  # a method on CUDA (it reads device memory), a property on CPU
        epochs = int(e() if callable(e) else e)
    return {"pid": os.getpid(), "kind": spec.kind, "rank": spec.rank, "group_rank": tp.rank, "tp": tp.size,
            "device": spec.device, "threads": torch.get_num_threads(), "comm_backend": tp.comm_backend,
            "control_backend": tp.control,
            "cuda_graphs": {role: len(r.step.graphs) if r.step is not None else 0 for role, r in runners.items()},
            "graph_ban": ban, "ll_epochs": epochs,
            "kernels": ops.cpu_dispatch() if torch.device(spec.device).type == "cpu" and spec.config.kernels else None,
            "quant_layout_rows": {role: layout_rows(r.model) for role, r in runners.items()}}


def _capacity(spec: WorkerSpec, role: str) -> int:
    if role == ROLE_TARGET:  # room for a verification batch past the context
        return spec.config.max_model_len + spec.verify_rows
    return spec.config.max_model_len + spec.tree.max_cached + spec.tree.w


def _setup(spec: WorkerSpec):
    """Pin, join the world, load the runners; returns ``(runners, tp)``."""
    from swiftspec import ops
    from swiftspec.distributed.parallel import LOCAL, init_world
    from swiftspec.distributed.rendezvous import file_init_method
    from swiftspec.model_executor.kernel_tuning import tune_kernels
    from swiftspec.model_executor.runner import ModelRunner

    pin(spec)
    ops.set_kernels(spec.config.kernels)
    device = torch.device(spec.device)
    if device.type == "cpu":  # the quantized GEMM's variant, before the weights take its layout
        tune_kernels([(p, spec.draft_vocab if r == ROLE_DRAFT else None) for r, p in spec.models.items()],
                     [1, spec.verify_rows])
    if device.type == "cuda":  # before the process group: NCCL binds to the current device
        torch.cuda.set_device(device)
    tp = LOCAL
    if spec.rendezvous_dir is not None:
        tp = init_world(spec.rank, spec.world_size, file_init_method(spec.rendezvous_dir), spec.groups, shm_comm=spec.config.kernels,
                        device_type=device.type, devices=spec.world_devices)[spec.group]
    dtype = getattr(torch, spec.dtype)
    runners = {}
    for role, path in spec.models.items():
        extra = dict(quant=spec.draft_quant, logits_vocab=spec.draft_vocab) if role == ROLE_DRAFT else {}
        if spec.kind == "colocated":  # a CUDA stream per model, the target's verification first
            extra["stream_priority"] = -1 if role == ROLE_TARGET else 0
            if role == ROLE_DRAFT and spec.config.draft_sms is not None:  # the draft on its share of the SMs
                extra["sm_count"] = spec.config.draft_sms
        sizes = decode_graph_sizes(spec, tp, role)  # TP > 1: only LL collectives are captured
        if sizes:
            extra["graph_sizes"] = sizes
        runners[role] = ModelRunner(path, tp, dtype, _capacity(spec, role), weights=spec.config.weights, device=device,
                                    **extra)
    return runners, tp


def ping_followers(followers: list[Connection], timeout_s: float) -> list[int]:
    """Send ``"ping"`` to each TP follower and wait up to ``timeout_s`` seconds in all for its
    ``"pong"`` (:func:`swiftspec.model_executor.runner.serve_follower`), so a follower frozen while
    the engine is idle is found by the engine's liveness ping, not by the next request's progress
    deadline. Returns the group-local ranks (1 = the first follower) that did not answer or whose
    pipe closed."""
    live, silent = {}, []
    for j, c in enumerate(followers, start=1):
        try:
            c.send("ping")
            live[c] = j
        except OSError:  # its pipe is gone: the follower died
            silent.append(j)
    deadline = time.monotonic() + timeout_s
    while live and (left := deadline - time.monotonic()) > 0:
        for c in wait(list(live), timeout=left):
            try:
                answered = c.recv() == "pong"
            except (EOFError, OSError):
                answered = False
            j = live.pop(c)
            if not answered:
                silent.append(j)
    return sorted(silent + list(live.values()))


def pin(spec: WorkerSpec) -> None:
    """Pin this process to ``spec.cores`` (where the OS allows) and set its intra-op threads:
    ``spec.threads``, at most one per core this process may run on, so an OpenMP thread waiting
    for its siblings spins on a core of its own, never on the one a sibling needs
    (:func:`swiftspec.engine.placement.union_cores`)."""
    threads = spec.threads
    if hasattr(os, "sched_setaffinity"):
        if spec.cores is not None:
            os.sched_setaffinity(0, spec.cores)
        threads = min(threads, len(os.sched_getaffinity(0)))
    torch.set_num_threads(max(1, threads))


def worker_main(spec: WorkerSpec, engine: Connection, followers: list[Connection],
                leader: Connection | None, peer: Connection | None) -> None:
    """Process entry point (see the module docstring)."""
    from swiftspec.distributed.parallel import worker_process

    with worker_process(engine, f"{spec.kind} worker rank {spec.rank}"):
        runners, tp = _setup(spec)
        engine.send(("ready", os.getpid(), ready_info(spec, tp, runners)))
        if spec.is_leader:
            _lead(spec, runners, engine, followers, peer)
        else:
            from swiftspec.model_executor.runner import serve_follower
            serve_follower(runners, leader)


def _lead(spec: WorkerSpec, runners, engine: Connection, followers: list[Connection],
          peer: Connection | None) -> None:
    from swiftspec.model_executor.runner import RunnerHandle
    from swiftspec.spec_decode import scheduler
    from swiftspec.spec_decode.target_state import TargetState

    handles = {role: RunnerHandle(role, r, followers) for role, r in runners.items()}
    target = TargetState(handles[ROLE_TARGET]) if ROLE_TARGET in handles else None
    draft = None
    if ROLE_DRAFT in handles:
        draft = DraftState(handles[ROLE_DRAFT], spec.tree)
    decode = scheduler.text_decoder(spec.tokenizer_file) if target is not None else None
    loop = (spec.decode_mode or mode_for(spec.kind))(spec, target, draft, peer)

    def emit(tokens, t, logprobs):
        engine.send(("tokens", tokens, t, logprobs))

    # a request that raises is answered ("failed", kind, "Type: message") and the next one starts
    # with its own prefill, where this leader alone holds the request's state: with followers, a
    # peer group or pipeline stages mid-protocol, the error ends the worker (the engine restarts)
    recoverable = not followers and peer is None and spec.stages == 1

    try:
        while True:
            msg = engine.recv()
            if msg[0] == "shutdown":
                return
            if msg[0] == "cancel":  # arrived after its request had finished
                continue
            if msg[0] == "ping":  # the engine's liveness check between requests, passed on to the followers
                engine.send(("pong", spec.kind, ping_followers(followers, msg[1])))
                continue
            req = msg[1]
            for r in runners.values():
                r.reset_stats()
            if draft is not None:
                draft.debug = req.trace
                draft.replay = req.replay
            # mid-request, the only message the engine sends is a cancel
            stop = scheduler.StopChecker(req, decode, cancelled=engine.poll)
            try:
                st = loop.run(req, emit, stop)
            except Exception as e:  # noqa: BLE001 - this request's error; the worker serves the next one
                if not recoverable:
                    raise
                engine.send(("failed", spec.kind, f"{type(e).__name__}: {e}"))
                continue
            engine.send(("done", spec.kind, st, {role: r.stats() for role, r in runners.items()}))
    finally:
        for c in followers:
            try:
                c.send(None)
            except (BrokenPipeError, OSError):
                pass
