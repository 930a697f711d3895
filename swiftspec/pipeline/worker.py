"""Pipeline stage processes: stage 0 (the leader, started by the engine) and stages 1..S-1,
started by the engine on this host or by ``swiftspec worker`` on others (docs/architecture.md §10).

Every stage: pin cores, join the rendezvous (:func:`swiftspec.pipeline.membership.join`), receive the
leader's :class:`~swiftspec.pipeline.membership.StagePlan` and check the model digest, load only its
layers, wait for all stages, start the heartbeat, then run (leader: one
:class:`~swiftspec.pipeline.decode.PipelineDecoder` request after another; others:
:func:`~swiftspec.pipeline.stages.serve_stage`). A lost stage or host ends every other stage's process
within seconds with a message that names it; a stage's own error is reported the same way.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from multiprocessing.connection import Connection

import torch

from swiftspec.model_executor.runner import ROLE_DRAFT, ROLE_TARGET
from swiftspec.pipeline import MODES
from swiftspec.pipeline.membership import LEADER, Heartbeat, StagePlan, exchange_plan, join, model_digest
from swiftspec.pipeline.stages import PipelineLeader, Stage


def capacity(max_model_len: int, width: int, stages: int) -> int:
    """KV slots of every pipeline cache: the context plus the tree slots between compactions."""
    return max_model_len + 4 * width * (stages + 1)


class LockedConn:
    """The engine pipe shared by the main thread and the heartbeat thread."""

    def __init__(self, conn: Connection):
        self.conn, self.lock = conn, threading.Lock()

    def send(self, msg) -> None:
        """Send ``msg`` (pickled) under the lock, so the two threads' messages never interleave."""
        with self.lock:
            self.conn.send(msg)

    def recv(self):
        """The next message (blocks; only the main thread receives)."""
        return self.conn.recv()

    def poll(self, timeout: float = 0.0) -> bool:
        """Whether a message is waiting, waiting up to ``timeout`` seconds."""
        return self.conn.poll(timeout)


def setup(rank: int, stages: int, master_addr: str, master_port: int, target: str, draft: str | None,
          plan: StagePlan | None, timeout_s: float, draft_quant: str | None = None,
          draft_vocab: int | None = None, *, local_dir: str | None = None, token: str | None = None):
    """Join (``local_dir`` / ``token``: see :func:`~swiftspec.pipeline.membership.join`), agree on the
    plan, load this stage (and the leader's draft). Returns ``(plan, runners, peers, store)``;
    ``plan`` is the leader's (None on the other stages)."""
    from swiftspec import ops
    from swiftspec.distributed.parallel import LOCAL
    from swiftspec.model_executor.kernel_tuning import tune_kernels
    from swiftspec.model_executor.runner import ModelRunner

    store = join(rank, stages, master_addr, master_port, timeout_s, local_dir=local_dir, token=token)
    digest = model_digest(target)
    if plan is not None:
        plan.model_digest = digest
    plan, peers = exchange_plan(plan, digest)
    ops.set_kernels(plan.kernels)
    if plan.kernels:
        ops.cpu_dispatch()  # load (or build) the CPU kernels now: no stage pauses once heartbeats run
        # the quantized GEMM's variant, before the weights take its layout
        tune_kernels([(target, None)] + ([(draft, draft_vocab)] if draft is not None else []), [1, plan.width])
    dtype = getattr(torch, plan.dtype)
    cap = capacity(plan.max_model_len, plan.width, stages)
    # verified keys stay in tree slots between misses: the caches record each slot's position
    runners = {ROLE_TARGET: ModelRunner(target, LOCAL, dtype, cap, weights=plan.weights,
                                        stage=range(*plan.layers[rank]), track_positions=True)}
    if draft is not None:
        runners[ROLE_DRAFT] = ModelRunner(draft, LOCAL, dtype, cap, quant=draft_quant, logits_vocab=draft_vocab,
                                          weights=plan.weights, track_positions=True)
    import torch.distributed as dist

    dist.barrier()  # every stage loaded
    return plan, runners, peers, store


def lead(spec, engine: Connection) -> None:
    """Stage 0 (``spec``: a :class:`swiftspec.engine.worker.WorkerSpec`): serve the engine's requests."""
    from swiftspec import ops
    from swiftspec.pipeline.decode import PipelineDecoder
    from swiftspec.spec_decode import scheduler
    from swiftspec.spec_decode.scheduler import text_decoder

    plan = StagePlan(spec.stage_layers, spec.dtype, spec.config.weights, spec.config.kernels, spec.config.max_model_len, spec.tree.w, "")
    plan, runners, peers, store = setup(LEADER, spec.stages, spec.config.master_addr, spec.port, spec.models[ROLE_TARGET],
                                        spec.models.get(ROLE_DRAFT), plan, spec.config.start_timeout_s, spec.draft_quant,
                                        spec.draft_vocab, **_rendezvous(spec))
    engine = LockedConn(engine)
    beat = Heartbeat(store, LEADER, peers, lambda msg: _die(engine, msg))
    # the quantized GEMM's variant stage 0 tuned to, for the engine's metrics
    engine.send(("ready", os.getpid(), {"pid": os.getpid(), "kernels": ops.cpu_dispatch() if plan.kernels else None}))
    target = runners[ROLE_TARGET]
    pipe = PipelineLeader(Stage(target, LEADER, spec.stages))
    loop = PipelineDecoder(pipe, runners.get(ROLE_DRAFT), spec.kind, spec.tree.w, spec.tree.topk, target.capacity,
                           spec.config.pipeline_order)
    decode = text_decoder(spec.tokenizer_file)
    try:
        while True:
            msg = engine.recv()
            if msg[0] == "shutdown":
                return
            if msg[0] == "cancel":
                continue
            if msg[0] == "ping":  # the engine's liveness check between requests
                engine.send(("pong", spec.kind))
                continue
            req = msg[1]
            for r in runners.values():
                r.reset_stats()
            t0 = time.perf_counter()
            try:
                st = loop.run(req, lambda toks, t, lps: engine.send(("tokens", toks, t, lps)),
                              scheduler.StopChecker(req, decode, cancelled=engine.poll))
            except RuntimeError as e:  # a gloo call failed: name the stage that is gone, if it is
                raise RuntimeError(beat.lost() or str(e)) from e
            stats = {role: r.stats() for role, r in runners.items()}
            stats[ROLE_TARGET].update(timesteps=st.timesteps, issued=st.issued, pruned=st.pruned,
                                      cancelled=st.cancelled, drained=st.drained,
                                      flushes=st.flushes, stages=st.stages, wall_s=time.perf_counter() - t0)
            engine.send(("done", spec.kind, st, stats))
    finally:
        try:
            pipe.shutdown()  # the heartbeat still watches: a stage lost now is reported, not waited on
        except Exception:  # a stage is gone: already reported
            pass
        beat.stop()


def follow(rank: int, stages: int, master_addr: str, master_port: int, target: str, timeout_s: float,
           on_lost, ready=None, *, local_dir: str | None = None, token: str | None = None) -> None:
    """Stages 1..S-1: set up, then follow the leader's timesteps until it ends the pipeline.
    ``on_lost(message)`` is called (from the heartbeat thread) when a peer is gone; ``ready()``
    once the stage is loaded; ``local_dir`` / ``token``: see :func:`~swiftspec.pipeline.membership.join`."""
    from swiftspec.pipeline.stages import leave, serve_stage

    _, runners, peers, store = setup(rank, stages, master_addr, master_port, target, None, None, timeout_s,
                                     local_dir=local_dir, token=token)
    beat = Heartbeat(store, rank, peers, on_lost)
    if ready is not None:
        ready()
    try:
        serve_stage(Stage(runners[ROLE_TARGET], rank, stages))
    except RuntimeError as e:
        raise RuntimeError(beat.lost() or str(e)) from e
    finally:
        beat.stop()
    leave()


def _die(engine, message: str) -> None:
    """A peer is gone while this process may be blocked in a gloo call: report and exit now."""
    try:
        engine.send(("error", message))
    except Exception:
        pass
    print(f"swiftspec: {message}", file=sys.stderr, flush=True)
    os._exit(1)


def worker_cli(args) -> int:
    """``swiftspec worker``: one pipeline stage of an engine whose leader runs on another host."""
    from swiftspec.distributed.rendezvous import pipeline_token
    from swiftspec.weights.loader import resolve_model

    try:
        token = pipeline_token()
    except ValueError as e:
        print(f"swiftspec worker: {e}", file=sys.stderr)
        return 2
    if not 1 <= args.stage < args.stages:
        print(f"swiftspec worker: --stage must be in [1, {args.stages}) (stage 0 is the engine's host)",
              file=sys.stderr)
        return 2
    if args.cores:
        os.sched_setaffinity(0, args.cores)
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    target = str(resolve_model(args.target, "target", args.cache_dir))

    def lost(message: str) -> None:
        print(f"swiftspec worker (stage {args.stage}): {message}", file=sys.stderr, flush=True)
        os._exit(1)

    try:
        follow(args.stage, args.stages, args.master_addr, args.master_port, target, args.timeout, lost,
               ready=lambda: print(f"swiftspec worker: stage {args.stage} of {args.stages} ready", file=sys.stderr,
                                   flush=True), token=token)
    except (RuntimeError, PermissionError) as e:
        print(f"swiftspec worker (stage {args.stage}): {e}", file=sys.stderr)
        return 1
    return 0


def stage_main(spec, engine: Connection, followers: list, leader, peer) -> None:
    """Process entry point of a pipeline stage the engine starts (the engine picks it for the
    pipeline modes; ``spec``: a :class:`swiftspec.engine.worker.WorkerSpec`, the other arguments
    as :func:`swiftspec.engine.worker.worker_main` takes them, unused here: stages talk over the
    rendezvous store). Stage 0 leads (:func:`lead`); the later stages follow it (:func:`follow`).
    A failure is reported to the engine as ``("error", traceback)`` before the process exits."""
    from swiftspec.distributed.parallel import worker_process

    with worker_process(engine, f"{spec.kind} stage {spec.rank}"):
        if spec.cores is not None and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, spec.cores)
        torch.set_num_threads(spec.threads)
        if spec.kind in MODES:
            lead(spec, engine)
        else:
            conn = LockedConn(engine)
            follow(spec.rank, spec.stages, spec.config.master_addr, spec.port, spec.models[ROLE_TARGET], spec.config.start_timeout_s,
                   lambda msg: _die(conn, msg), ready=lambda: conn.send(("ready", os.getpid())), **_rendezvous(spec))


def _rendezvous(spec) -> dict:
    """How a stage the engine started joins: through the engine's private directory when every
    stage runs on this host, else over TCP with the shared secret (inherited from the engine's
    environment)."""
    from swiftspec.distributed.rendezvous import pipeline_token

    if spec.config.remote_stages:
        return {"token": pipeline_token()}
    return {"local_dir": spec.rendezvous_dir}
