"""Who is in a pipeline run and whether they are still there: the rendezvous (:func:`join`), the
leader's :class:`StagePlan` and the model digest every stage checks (:func:`exchange_plan`), and the
:class:`Heartbeat` by which a stage whose host went away is named within
:data:`HEARTBEAT_LIMIT_S` seconds. Nothing a peer sends is unpickled: plans and peer triples travel
as JSON in tensors (:mod:`swiftspec.distributed.wire`)."""
from __future__ import annotations

import hashlib
import json
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass, fields
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from swiftspec.distributed.wire import all_gather_json, broadcast_json

LEADER = 0
# a stage whose heartbeat has not advanced for this long is reported gone (seconds: above the scheduling
# delays of a busy 2-core machine, short enough to report a lost host within 10 s)
HEARTBEAT_LIMIT_S = 5.0


@dataclass
class StagePlan:
    """What the leader tells every stage after the rendezvous: the target's layers of each stage,
    and how to load them (the fields of :class:`swiftspec.engine.worker.WorkerSpec` that matter there)."""

    layers: list[tuple[int, int]]
    dtype: str
    weights: str
    kernels: bool
    max_model_len: int
    width: int
    model_digest: str


def join(rank: int, world: int, master_addr: str, master_port: int, timeout_s: float, *,
         local_dir: str | None = None, token: str | None = None) -> dist.Store:
    """Join the pipeline's torch.distributed world (gloo); wait at most ``timeout_s`` for the others.

    With ``local_dir`` (every stage on this host, spawned by the engine) through a file store in
    that private directory, sockets on loopback only; else through a TCP store that rank 0 hosts on
    ``master_port`` (every interface: torch's store binds no single address), all keys under the
    prefix of the shared secret ``token``
    (:func:`swiftspec.distributed.rendezvous.secure_tcp_store`). Returns the run's store.

    Raises:
        PermissionError: the leader holds another ``token`` (this stage is refused).
        RuntimeError: the rendezvous did not complete in time (a stage was never started, a
            wrong address or port, a firewall).
        ValueError: neither ``local_dir`` nor ``token``.
    """
    from swiftspec.distributed.rendezvous import pin_loopback, secure_tcp_store

    if local_dir is None and not token:
        raise ValueError("a pipeline rendezvous over TCP needs the shared secret (token)")
    where = local_dir if local_dir is not None else f"{master_addr}:{master_port}"
    try:
        if local_dir is not None:
            pin_loopback()
            store = dist.FileStore(os.path.join(local_dir, "pipeline"), world)
        else:
            store = secure_tcp_store(rank == LEADER, master_addr, master_port, world, token, timeout_s)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    except PermissionError:
        raise
    except Exception as e:
        raise RuntimeError(f"pipeline rendezvous at {where} (stage {rank} of {world}) failed "
                           f"within {timeout_s:.0f} s: {e}") from e
    return store


def model_digest(model_dir: str | Path) -> str:
    """sha256 over a model directory's config.json and weight files (contents), so stages on
    other hosts can check that they hold the same model; each file's hash is cached beside the
    files per (size, mtime) in ``.swiftspec-digest.json`` when the directory is writable."""
    from swiftspec.weights.default_pair import sha256_file
    from swiftspec.weights.model_cache import atomic_write_text

    root = Path(model_dir)
    files = [root / "config.json"] + sorted(root.glob("*.safetensors")) + sorted(root.glob("native/*.safetensors"))
    cache_file = root / ".swiftspec-digest.json"
    try:
        cache = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        cache = {}
    total, changed = hashlib.sha256(), False
    for f in files:
        st, key = f.stat(), str(f.relative_to(root))
        if cache.get(key, [])[:2] != [st.st_size, st.st_mtime_ns]:
            cache[key], changed = [st.st_size, st.st_mtime_ns, sha256_file(f)], True
        total.update(f"{key}:{cache[key][2]}\n".encode())
    if changed:
        try:
            atomic_write_text(cache_file, json.dumps(cache))
        except OSError:  # a read-only model directory: hash again next time
            pass
    return total.hexdigest()


def exchange_plan(plan: StagePlan | None, digest: str) -> tuple[StagePlan, list[tuple[str, int]]]:
    """The leader passes its plan, the others None; every rank gets the plan and every rank's
    ``(host, pid)``. Every rank checks every digest against the leader's. Both travel as JSON text
    in tensors (:mod:`swiftspec.distributed.wire`), read into fixed fields.

    Raises:
        RuntimeError: a stage's model files differ from the leader's (names the stage and host), or
            a peer's message does not have the fields of a plan / a ``[host, pid, digest]`` triple.
    """
    got = broadcast_json(None if plan is None else asdict(plan), LEADER)
    if plan is None:
        names = {f.name for f in fields(StagePlan)}
        if not isinstance(got, dict) or set(got) != names:
            raise RuntimeError(f"malformed pipeline plan from the leader: {sorted(got) if isinstance(got, dict) else got!r}")
        plan = StagePlan(**got)
        plan.layers = [tuple(x) for x in plan.layers]
    peers = all_gather_json([socket.gethostname(), os.getpid(), digest])
    if not all(isinstance(p, list) and len(p) == 3 and isinstance(p[0], str) and isinstance(p[1], int)
               and isinstance(p[2], str) for p in peers):
        raise RuntimeError("malformed pipeline peer description (want [host, pid, digest])")
    bad = [(r, h, d) for r, (h, _, d) in enumerate(peers) if d != plan.model_digest]
    if bad:
        raise RuntimeError("pipeline stages hold different target models: " + "; ".join(
            f"stage {r} on host {h} has sha256 {d[:16]}..., the leader {plan.model_digest[:16]}..." for r, h, d in bad))
    return plan, [(h, pid) for h, pid, _ in peers]


class Heartbeat:
    """A thread that advances this rank's counter in the store every ``period`` seconds and
    watches the others'; when one stops advancing for ``limit`` seconds (or the store itself,
    in the leader's process, is gone) it calls ``on_lost(message)`` once, naming the stage and
    its host. :meth:`lost` gives that message to a main thread whose gloo call failed."""

    def __init__(self, store: dist.Store, rank: int, peers: list[tuple[str, int]], on_lost,
                 period: float = 0.5, limit: float = HEARTBEAT_LIMIT_S):
        self.store, self.rank, self.peers, self.on_lost = store, rank, peers, on_lost
        self.period, self.limit = period, limit
        self.message: str | None = None
        self._stop = threading.Event()
        self._beat = 0
        store.set(f"hb/{rank}", "0")
        self._thread = threading.Thread(target=self._run, name="swiftspec-heartbeat", daemon=True)
        self._thread.start()

    def _name(self, r: int) -> str:
        host, pid = self.peers[r]
        return f"pipeline stage {r} on host {host} (pid {pid})"

    def _run(self) -> None:
        seen = {r: (None, time.monotonic()) for r in range(len(self.peers)) if r != self.rank}
        prev = time.monotonic()
        while not self._stop.wait(self.period):
            try:
                self._beat += 1
                self.store.set(f"hb/{self.rank}", str(self._beat))
                now = time.monotonic()
                if now - prev > self.limit / 2:  # this process itself stalled: blame no peer for it
                    seen = {r: (last, now) for r, (last, _) in seen.items()}
                prev = now
                for r, (last, since) in seen.items():
                    v = self.store.get(f"hb/{r}") if self.store.check([f"hb/{r}"]) else None
                    if v != last:
                        seen[r] = (v, now)
                    elif now - since > self.limit and not self._stop.is_set():
                        self._report(f"{self._name(r)} stopped responding (no heartbeat for {self.limit:.0f} s)")
                        return
            except Exception as e:  # the store lives in the leader's process
                if self._stop.is_set():  # the pipeline ended normally while we were asking
                    return
                if self.rank == LEADER:
                    self._report(f"pipeline heartbeat store failed: {e}")
                else:
                    self._report(f"{self._name(LEADER)} (the leader) is gone: {type(e).__name__}: {e}")
                return

    def _report(self, message: str) -> None:
        self.message = message
        self.on_lost(message)

    def lost(self, wait_s: float | None = None) -> str | None:
        """The failure message, waiting up to ``wait_s`` (default: the limit plus two periods)
        for the watcher to name the stage after a collective failed."""
        deadline = time.monotonic() + (self.limit + 2 * self.period if wait_s is None else wait_s)
        while self.message is None and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.05)
        return self.message

    def stop(self) -> None:
        """Stop the watcher thread (waits up to 2 s for it); no loss is reported after this."""
        self._stop.set()
        self._thread.join(2.0)
