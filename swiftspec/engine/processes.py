"""The engine's worker processes: starting one per rank (forked from a fork server that has torch
loaded, :func:`start_context`), waiting until they are ready, noticing a dead or failing worker,
and stopping them all.

A worker that dies or reports an error makes the engine fail within a fraction of a second with
:class:`~swiftspec.engine.outputs.WorkerError`, after every worker has been stopped. The engine:
:mod:`swiftspec.engine.llm_engine`. Architecture: docs/architecture.md §1.
"""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import shutil
import sys
import time
import weakref
from multiprocessing.connection import Connection, wait
from typing import Iterator

from swiftspec.engine import child_entry
from swiftspec.engine.config import EngineConfig
from swiftspec.engine.outputs import WorkerError
from swiftspec.engine.placement import Group
from swiftspec.engine.worker import WorkerSpec, worker_main
from swiftspec.model_executor.runner import ROLE_DRAFT, ROLE_TARGET
from swiftspec.pipeline.worker import stage_main
from swiftspec.spec_decode.modes import mode_for

# "forkserver" (the default) or "spawn": how worker processes start (start_context)
START_METHOD_ENV = "SWIFTSPEC_WORKER_START_METHOD"

# a worker's error text with one of these only says it lost a peer; the last two are gloo's words
# for a peer rank that died
_LOST_PEER = ("ConnectionResetError", "EOFError", "BrokenPipeError", "Connection reset by peer",
              "Connection closed by peer")


class WorkerProcesses:
    """The worker processes of one engine and the engine's pipe to each.

    Attributes:
        procs: the processes, in rank order (remote pipeline stages excluded).
        conns: the engine's end of each process's pipe, in the order of ``procs``.
        leaders: the pipe to each group's leader by its kind (``"target"``, ``"draft"``, or the mode of
            a one-group mode, pipeline stage 0 included): where requests go and tokens come from.
        dirs: the workers' private rendezvous directories, removed at close.
        ready: one dict per process, as it reported when ready (:meth:`wait_ready`).
        closed: True once :meth:`close` ran (also after a failure).
    """

    def __init__(self) -> None:
        self.procs: list[mp.Process] = []
        self.conns: list[Connection] = []
        self.leaders: dict[str, Connection] = {}
        self.dirs: list[str] = []
        self.ready: list[dict] = []
        self.closed = False
        self._finalizer = weakref.finalize(self, shutdown, self.procs, self.conns, self.dirs)

    # ---- start-up -----------------------------------------------------------------------
    def start(self, layout: list[Group], config: EngineConfig, **spec_fields) -> None:
        """Spawn one process per rank of each group of ``layout`` (the remote pipeline stages are
        started on their hosts by ``swiftspec worker``). ``spec_fields``: the
        :class:`~swiftspec.engine.worker.WorkerSpec` fields every rank shares (dtype, tokenizer
        file, ...). Ranks spawned here meet in a private directory (no listener); remote stages
        over TCP on ``config.master_port``, with the pipeline secret.

        Raises:
            ValueError: remote stages without the pipeline secret set (before any process starts).
        """
        from swiftspec.distributed.rendezvous import pipeline_token, private_dir

        ctx = start_context()
        ranks, first = [], 0
        for g in layout:
            ranks.append(list(range(first, first + g.tp)))
            first += g.tp
        pipelined = config.pipeline_stages > 1
        remote = pipelined and bool(config.remote_stages)
        if remote:
            pipeline_token()  # raises ValueError naming the variable before any process starts
        rendezvous_dir = None
        if not remote and (pipelined or any(len(r) > 1 for r in ranks)):
            rendezvous_dir = private_dir()
            self.dirs.append(rendezvous_dir)
        world = dict(config=config, world_size=first, port=config.master_port if remote else 0,
                     rendezvous_dir=rendezvous_dir, groups=ranks, stages=len(layout) if pipelined else 1,
                     world_devices=[d for g in layout for d in g.devices],  # ranks sharing a GPU: gloo + LL
                     **spec_fields)
        peer_ends = ctx.Pipe() if config.mode == "async" else (None, None)
        handed_over = [c for c in peer_ends if c is not None]  # ends that live in the workers
        for gi, group in enumerate(layout):
            if pipelined and gi in config.remote_stages:
                continue  # started on its host by `swiftspec worker`
            handed_over += self._start_group(ctx, gi, group, peer_ends, world)
        for c in handed_over:  # the workers have their copies; ours would only leak descriptors
            c.close()

    def _start_group(self, ctx, gi: int, group: Group, peer_ends: tuple, world: dict) -> list[Connection]:
        """Spawn the ranks of group ``gi``: rank 0 leads (its pipe is a leader's, except on a later
        pipeline stage, which follows stage 0), each follower is fed by the rank before it. Returns
        the pipe ends now held by the workers."""
        kind, pipelined = group.kind, world["config"].pipeline_stages > 1
        follower_pipes = [ctx.Pipe() for _ in range(group.tp - 1)]
        for j, r in enumerate(world["groups"][gi]):
            spec = WorkerSpec(rank=r, group=gi, models=group.models, kind=kind,
                              decode_mode=None if kind == "stage" or pipelined else mode_for(kind),
                              cores=group.cores[j], threads=len(group.cores[j]), device=group.devices[j], **world)
            if j == 0:
                followers, leader = [p[0] for p in follower_pipes], None
                peer = peer_ends[gi] if kind in (ROLE_TARGET, ROLE_DRAFT) else None
            else:
                followers, leader, peer = [], follower_pipes[j - 1][1], None
            # the engine picks the process entry point: a pipeline stage, or a TP rank of a group
            parent = self._spawn(ctx, stage_main if spec.stages > 1 else worker_main, spec, followers, leader, peer,
                                 name=f"swiftspec-{kind}-{gi if kind == 'stage' else j}")
            if j == 0 and kind != "stage":  # later pipeline stages follow stage 0, not the engine
                self.leaders[kind] = parent
        return [c for pair in follower_pipes for c in pair]

    def _spawn(self, ctx, target, spec: WorkerSpec, *pipes, name: str) -> Connection:
        """Start one worker process running ``target(spec, pipe, *pipes)`` in this process's
        environment (:func:`swiftspec.engine.child_entry.run`); returns the engine's end of its pipe."""
        parent, child = ctx.Pipe()
        p = new_process(ctx, target, spec, child, *pipes, name=name)
        with _main_module_hidden():
            p.start()
        child.close()
        self.procs.append(p)
        self.conns.append(parent)
        return parent

    def wait_ready(self, timeout_s: float) -> None:
        """Wait for every worker's ``("ready", pid[, info])``; ``ready`` gets each worker's info
        (:func:`swiftspec.engine.worker.ready_info`; ``pid`` and ``kernels`` from pipeline stage 0).

        Raises:
            WorkerError: a worker died or raised, or not all were ready within ``timeout_s`` seconds.
        """
        pending = set(range(len(self.procs)))
        self.ready = [{} for _ in self.procs]
        deadline = time.monotonic() + timeout_s
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                self.fail(f"workers did not load their models within {timeout_s:.0f} s")
            for i in list(pending):
                if self.conns[i].poll():
                    msg = self.recv(self.conns[i])
                    if msg[0] == "ready":
                        self.ready[i] = msg[2] if len(msg) > 2 else {"pid": msg[1]}
                        pending.discard(i)
            self.check_alive()
            if pending:
                wait([self.conns[i] for i in pending] + [self.procs[i].sentinel for i in pending],
                     timeout=min(left, 0.5))

    # ---- messages -----------------------------------------------------------------------
    def fds(self) -> list[int]:
        """File descriptors that become readable when a leader has a message or a worker exits."""
        return [c.fileno() for c in self.leaders.values()] + [p.sentinel for p in self.procs]

    def messages(self, conns: list[Connection], nowait: bool = False) -> Iterator[tuple]:
        """Messages from ``conns`` as they arrive, plus a ``("tick",)`` after every wait (at most 1 s)
        so callers can keep time; between waits, a dead worker raises WorkerError. ``nowait``:
        ``("would_block",)`` where it would wait (the caller waits on :meth:`fds`)."""
        while True:
            if not nowait:
                wait(conns + [p.sentinel for p in self.procs], timeout=1.0)
            elif not any(c.poll() for c in conns):
                self.check_alive()
                yield ("would_block",)
            for conn in conns:
                while conn.poll():
                    yield self.recv(conn)
            self.check_alive()
            yield ("tick",)

    def cancel(self, lead: Connection, expect_done: set[str], conns: list[Connection]) -> None:
        """Stop the running request at its leader ``lead`` and drain its messages until every kind
        in ``expect_done`` has answered, so the next request starts clean.

        Raises:
            WorkerError: a worker died, or the workers did not answer within 30 s.
        """
        lead.send(("cancel",))
        deadline = time.monotonic() + 30.0
        for msg in self.messages(conns):
            if msg[0] in ("done", "failed"):
                expect_done.discard(msg[1])
            if not expect_done:
                return
            if time.monotonic() > deadline:
                self.fail("workers did not acknowledge a cancelled request within 30 s")

    def ping(self, timeout_s: float) -> None:
        """Send ``("ping", follower_timeout_s)`` to every idle leader and wait for each one's
        ``("pong", kind[, silent])``: a TP group's leader first pings its followers
        (:func:`swiftspec.engine.worker.ping_followers`, half of ``timeout_s``) and lists in
        ``silent`` the group-local ranks that did not answer.

        Raises:
            WorkerError: a worker died, or a leader (or a follower, through its leader) did not
                answer within ``timeout_s`` seconds (a frozen or hung process); every worker is
                stopped first.
        """
        self.check_alive()
        pending = dict(self.leaders)
        for conn in pending.values():
            try:
                conn.send(("ping", timeout_s / 2))
            except OSError:  # its pipe is gone: the worker is dying
                self.recv(conn)
        deadline = time.monotonic() + timeout_s
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                procs = [self.procs[self.conns.index(c)] for c in pending.values()]
                names = ", ".join(f"{p.name} (pid {p.pid})" for p in procs)
                self.fail(f"{names} did not answer a liveness ping within {timeout_s:g} s: a frozen or hung worker")
            wait(list(pending.values()) + [p.sentinel for p in self.procs], timeout=left)
            for kind, conn in list(pending.items()):
                while conn.poll():
                    msg = self.recv(conn)
                    if msg[0] == "pong":
                        pending.pop(kind)
                        self._check_followers(kind, msg[2] if len(msg) > 2 else [], timeout_s / 2)
                        break
            self.check_alive()

    def _check_followers(self, kind: str, silent: list[int], timeout_s: float) -> None:
        """Fail naming the followers of group ``kind`` (group-local ranks ``silent``) that did not
        answer their leader's liveness ping within ``timeout_s`` seconds."""
        if not silent:
            return
        names = {p.name: p for p in self.procs}
        procs = [names.get(f"swiftspec-{kind}-{j}") for j in silent]
        who = ", ".join(f"{p.name} (pid {p.pid})" if p else f"{kind} follower rank {j}" for p, j in zip(procs, silent))
        self.fail(f"{who} did not answer a liveness ping within {timeout_s:g} s: a frozen or hung worker")

    # ---- failure handling ---------------------------------------------------------------
    def fail(self, why: str):
        """Stop every worker and raise :class:`WorkerError` with ``why``."""
        self.close()
        raise WorkerError(why)

    def recv(self, conn: Connection):
        """The next message on ``conn``.

        Raises:
            WorkerError: the worker reported an error, or its pipe closed (naming the worker that died).
        """
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            # The pipe reports EOF a moment before the dying process can be reaped (its fds close
            # before it turns zombie); wait for that so the error names the worker that died.
            deadline = time.monotonic() + 2.0
            while all(p.is_alive() for p in self.procs) and time.monotonic() < deadline:
                time.sleep(0.01)
            self.check_alive()
            self.fail("a worker closed its pipe unexpectedly")
        if msg[0] == "error":
            self._fail_with_cause(msg[1])
        return msg

    def _fail_with_cause(self, error: str):
        """A worker reported an error; if it only lost a peer, name the peer that died."""
        time.sleep(0.1)
        dead = [p for p in self.procs if not p.is_alive()]
        if dead and any(e in error for e in _LOST_PEER):
            self.fail("; ".join(f"worker process {p.name} (pid {p.pid}) died with exit code {p.exitcode}"
                                for p in dead) + f"\n(a peer noticed: {error.strip().splitlines()[-1]})")
        self.fail(f"worker failed:\n{error}")

    def check_alive(self) -> None:
        """Raise :class:`WorkerError` (after stopping all) if a worker has exited, with its error
        message where it sent one."""
        for p in self.procs:
            if not p.is_alive():
                # give its error message (if it sent one) a moment to arrive
                for c in self.conns:
                    if c.poll(0.05):
                        try:
                            msg = c.recv()
                        except (EOFError, OSError):
                            continue
                        if msg[0] == "error":
                            self._fail_with_cause(msg[1])
                if _running(p.pid):  # its exit status comes through the fork server, which is gone
                    self.fail(f"the fork server that started the workers died; worker process {p.name} "
                              f"(pid {p.pid}) can no longer be watched")
                self.fail(f"worker process {p.name} (pid {p.pid}) died with exit code {p.exitcode}")

    def close(self) -> None:
        """Stop every worker (graceful, then terminate, then kill). Idempotent."""
        if self.closed:
            return
        self.closed = True
        self._finalizer.detach()
        shutdown(self.procs, self.conns, self.dirs)


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (Linux /proc; False elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2:].split()[0] != "Z"


def start_context():
    """The multiprocessing context workers start from: ``forkserver`` with torch imported in the
    server, where the platform has it, else ``spawn``.

    A forked worker skips the interpreter start and ``import torch`` that a spawned one pays (over
    a second of CPU per process), and it leaves without the interpreter's teardown: every engine
    on the default pair started and closed faster, side by side (record
    ``bench/results/engine-start-zen4-2026-11-29.json``, bench/RESULTS.md). The server starts with
    the first engine and serves every later one of this process; it imports torch only, so nothing
    it holds depends on the engine's environment, which each worker puts in place first
    (:mod:`swiftspec.engine.child_entry`). Workers write to the standard output and error this
    process had when the server started.
    This replaces the fork server's preload list (multiprocessing's default preloads the caller's
    ``__main__``, which would run a user's script in the server). ``SWIFTSPEC_WORKER_START_METHOD=spawn``
    starts each worker in a fresh interpreter instead.

    Raises:
        ValueError: ``SWIFTSPEC_WORKER_START_METHOD`` is neither "forkserver" nor "spawn".
    """
    method = os.environ.get(START_METHOD_ENV, "") or "forkserver"
    if method not in ("forkserver", "spawn"):
        raise ValueError(f"{START_METHOD_ENV} must be 'forkserver' or 'spawn', got {method!r}")
    if method == "spawn" or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch"])
    return ctx


def new_process(ctx, target, *args, name: str | None = None):
    """A daemon process of ``ctx`` (:func:`start_context`) that runs ``target(*args)`` in this
    process's environment as it is now (:func:`swiftspec.engine.child_entry.run`); not started."""
    return ctx.Process(target=child_entry.run, args=(dict(os.environ), target, *args), name=name, daemon=True)


def start_fork_server() -> None:
    """Start the fork server of :func:`start_context` now, so its ``import torch`` overlaps the
    engine's own start (model resolution, tokenizer); a no-op where it runs already or workers are
    spawned.

    Raises:
        ValueError: ``SWIFTSPEC_WORKER_START_METHOD`` is neither "forkserver" nor "spawn".
    """
    if start_context().get_start_method() == "forkserver":
        from multiprocessing import forkserver

        forkserver.ensure_running()


@contextlib.contextmanager
def _main_module_hidden():
    """Start workers without re-running the caller's script.

    The ``spawn`` and ``forkserver`` start methods import ``__main__`` by path in every child,
    which runs a user's top-level ``Engine(...)`` again (and fails without an
    ``if __name__ == "__main__"`` guard). Workers need nothing from the caller's script, so hide
    its path while the child starts.
    """
    main = sys.modules.get("__main__")
    saved = {k: getattr(main, k) for k in ("__file__", "__spec__") if hasattr(main, k)}
    try:
        for k in saved:
            setattr(main, k, None)
        yield
    finally:
        for k, v in saved.items():
            setattr(main, k, v)


def shutdown(procs: list[mp.Process], conns: list[Connection], dirs: list[str]) -> None:
    """Ask each worker to shut down over ``conns``, give them 3 s together, then terminate (2 s)
    and kill (1 s) the ones still alive; close the pipes and remove the rendezvous ``dirs``."""
    for c in conns:
        try:
            c.send(("shutdown",))
        except (BrokenPipeError, OSError, EOFError):
            pass
    deadline = time.monotonic() + 3.0
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(2.0)
        if p.is_alive():
            p.kill()
            p.join(1.0)
    for c in conns:
        try:
            c.close()
        except OSError:
            pass
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)
