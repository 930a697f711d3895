"""Pipeline-parallel stages of the target model over torch.distributed (docs/architecture.md §10).

The target's decoder layers are split into ``S`` contiguous stages balanced by the weight bytes a
forward reads (:func:`partition_layers`); rank ``s`` of the pipeline world holds stage ``s``. Rank
0 (the leader) also holds the draft model (PipeDec's layout) and decides everything: stages
1..S-1 only follow it.

Execution is in synchronous *timesteps* (PipeDec §3.4, "synchronization phase"): at the start of
each one the leader broadcasts a :class:`Control` (a fixed-layout tensor, :mod:`swiftspec.pipeline.control`) that says, for every stage, which rows of the
micro-batch it received from the previous stage survive (the others were pruned after it was
sent: PipeDec's pruning, PipeInfer's early cancellation), their positions, KV slots and attention
masks, and which rows' logits the last stage returns. Each stage then receives its input
(activations and residual stream, ``[n, 2 * hidden]``, sent by the previous stage one timestep
earlier), drops the pruned rows, runs its layers (their keys and values land in the given slots
of its own KV cache) and sends the result on; the last stage sends the requested logits to rank
0. Since every stage sees the same ordered sequence of controls, slot moves (KV compaction) are
applied everywhere at the same point of the token stream, and nothing is recomputed.

Stages may run on other hosts (``swiftspec worker``): every rank joins one rendezvous
(:func:`join`: a private file store when every stage runs on this host, else a TCP store hosted by
rank 0 whose keys only holders of the shared secret can name), receives the leader's :class:`StagePlan` (which layers,
dtype, weights), checks that its model files hash like the leader's, and loads only its layers.
Every rank advances a heartbeat counter in the store (:class:`Heartbeat`); a stage that dies (its
sockets close: the peers' pending gloo operation fails at once) or whose host goes away (its
counter stops) is named, with its host, by every other rank within ``HEARTBEAT_LIMIT_S`` seconds,
which then exits instead of waiting on a receive that cannot complete.
"""
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

import torch
import torch.distributed as dist

from swiftspec.distributed.wire import all_gather_json, broadcast_json
from swiftspec.pipeline.control import Control, Work, broadcast_control

LEADER = 0
# a stage whose heartbeat has not advanced for this long is reported gone (seconds: above the scheduling
# delays of a busy 2-core machine, short enough to report a lost host within 10 s)
HEARTBEAT_LIMIT_S = 5.0


def partition_layers(layer_bytes: list[int], stages: int, head_bytes: int = 0, first_bytes: int = 0) -> list[range]:
    """Split layers ``0..L-1`` into ``stages`` contiguous non-empty ranges minimizing the largest
    stage's bytes, the last stage also reading ``head_bytes`` (final norm + LM head), the first
    ``first_bytes`` (the draft model that shares its process, in ``pipedec``).

    Raises:
        ValueError: fewer layers than stages, or fewer than one stage.
    """
    n = len(layer_bytes)
    if stages < 1 or n < stages:
        raise ValueError(f"cannot split {n} layers into {stages} pipeline stages")
    prefix = [0]
    for b in layer_bytes:
        prefix.append(prefix[-1] + b)

    def cost(a: int, b: int) -> int:
        return prefix[b] - prefix[a] + (head_bytes if b == n else 0) + (first_bytes if a == 0 else 0)

    # best[k][i]: the smallest largest-stage cost of layers [0, i) in k stages; cut[k][i]: where the last begins
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                c = max(best[k - 1][j], cost(j, i))
                if c < best[k][i]:
                    best[k][i], cut[k][i] = c, j
    out, i = [], n
    for k in range(stages, 0, -1):
        out.append(range(cut[k][i], i))
        i = cut[k][i]
    return out[::-1]


def checkpoint_layer_bytes(model_dir: str | Path, num_layers: int) -> tuple[list[int], int]:
    """``(bytes of each decoder layer's weights, bytes of the final norm + LM head)`` as stored
    (GGUF blocks where the loader kept them, else the float tensors); read from the file headers."""
    from safetensors import safe_open

    from swiftspec.weights.loader import NATIVE_FILE

    sizes: dict[str, int] = {}
    files = sorted(Path(model_dir).glob("*.safetensors"))
    native = Path(model_dir) / NATIVE_FILE
    for f in files + ([native] if native.is_file() else []):  # native blocks override float copies
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                sl = st.get_slice(name)
                numel = 1
                for d in sl.get_shape():
                    numel *= d
                sizes[name] = numel * _itemsize(sl.get_dtype())
    layers = [0] * num_layers
    head = 0
    for name, b in sizes.items():
        parts = name.removeprefix("model.").split(".")
        if parts[0] == "layers":
            layers[int(parts[1])] += b
        elif parts[0] == "lm_head":
            head += b
    if head == 0:  # tied: the LM head reads the embedding matrix
        head = sizes.get("model.embed_tokens.weight", 0)
    return layers, head


def _itemsize(dtype: str) -> int:
    return {"F64": 8, "F32": 4, "I64": 8, "I32": 4, "F16": 2, "BF16": 2, "I16": 2, "U8": 1, "I8": 1,
            "BOOL": 1}.get(dtype, 4)


class Stage:
    """One stage's model part, KV cache and links to its neighbours (every rank, leader included).

    Args:
        runner: a :class:`swiftspec.model_executor.runner.ModelRunner` holding this stage's layers.
        rank, stages: this stage's index and the pipeline's length.
    """

    def __init__(self, runner, rank: int, stages: int):
        self.runner, self.rank, self.stages = runner, rank, stages
        cfg = runner.cfg
        self.hidden, self.dtype, self.vocab = cfg.hidden_size, runner.model.dtype, runner.logits_vocab or cfg.vocab_size
        self.pending: list = []  # isend handles not yet completed
        self.busy_s = 0.0
        self.steps = 0
        self.cancelled_rows = 0  # rows received, then dropped before running (pruned mid-pipeline)

    def run(self, w: Work, moves) -> torch.Tensor | None:
        """Apply ``moves``, then this stage's part of the timestep; returns the logits on the last
        stage (sent to the leader by the caller), else None."""
        if moves is not None:
            self.runner.move_kv(*moves)
        if w is None:
            return None
        if self.rank == 0:
            x, residual = w.tokens, None
        else:
            buf = torch.empty(w.in_rows, 2 * self.hidden, dtype=self.dtype)
            dist.recv(buf, src=self.rank - 1)
            if w.keep is not None:
                self.cancelled_rows += w.in_rows - len(w.keep)
                buf = buf[w.keep]
            x, residual = buf[:, :self.hidden], buf[:, self.hidden:]
        if x.shape[0] == 0:
            return None
        t0 = time.perf_counter()
        x, residual = self.runner.forward_stage(x, residual, w.positions, w.slots, w.mask)
        out = None
        if self.rank == self.stages - 1:
            if w.logit_rows:
                out = self.runner.model.compute_logits(x[w.logit_rows], self.runner.logits_vocab)
        else:
            for h in self.pending:
                h.wait()
            self.pending = [dist.isend(torch.cat([x, residual], dim=-1).contiguous(), dst=self.rank + 1)]
        self.busy_s += time.perf_counter() - t0
        self.steps += 1
        return out

    def stats(self) -> dict:
        """This stage's counters since :meth:`reset_stats`: ``busy_s`` (seconds computing), ``steps``
        (timesteps with work), ``cancelled_rows`` (rows pruned on arrival) and ``layers`` ([start,
        stop) of the target's layers it holds)."""
        return {"busy_s": self.busy_s, "steps": self.steps, "cancelled_rows": self.cancelled_rows,
                "layers": [self.runner.model.stage.start, self.runner.model.stage.stop]}

    def reset_stats(self) -> None:
        """Zero the counters :meth:`stats` reports."""
        self.busy_s, self.steps, self.cancelled_rows = 0.0, 0, 0


def broadcast(ctrl: Control | None) -> Control:
    """The leader sends ``ctrl``; the other ranks pass None and get it (as a tensor:
    :func:`swiftspec.pipeline.control.broadcast_control`)."""
    return broadcast_control(ctrl, LEADER)


def serve_stage(stage: Stage) -> None:
    """Loop of ranks 1..S-1: follow the leader's controls until "end" (or the leader is gone)."""
    last = stage.rank == stage.stages - 1
    while True:
        ctrl = broadcast(None)
        if ctrl.op == "end":
            return
        if ctrl.op == "done":
            all_gather_json(stage.stats())
            stage.reset_stats()
            continue
        logits = stage.run(ctrl.work[stage.rank], ctrl.moves)
        if last and logits is not None:
            dist.send(logits.float().contiguous(), dst=LEADER)


class PipelineLeader:
    """Rank 0's handle on the pipeline: :meth:`launch` broadcasts a timestep and runs stage 0;
    :meth:`collect` then waits for the last stage's logits when that timestep asked for any
    (the leader runs the draft in between, while the other stages compute)."""

    def __init__(self, stage: Stage):
        self.stage = stage
        self.stages = stage.stages
        self._expect = 0

    def launch(self, work: list[Work | None], moves=None) -> None:
        """Start one timestep: broadcast ``work`` (one :class:`Work` or None per stage) and the cache
        ``moves`` (``(src, dst)`` slot tensors or None) to every stage, then run stage 0's part here.
        :meth:`collect` then returns the last stage's logits, if this timestep asked for any."""
        broadcast(Control("step", work, moves))
        self.stage.run(work[0], moves)
        last = work[-1]
        self._expect = len(last.logit_rows) if last is not None and (last.keep is None or last.keep) else 0

    def collect(self) -> torch.Tensor | None:
        """``[k, vocab]`` float32 logits of the rows the launched timestep asked for, or None."""
        if not self._expect:
            return None
        out = torch.empty(self._expect, self.stage.vocab, dtype=torch.float32)
        dist.recv(out, src=self.stages - 1)
        self._expect = 0
        return out

    def finish(self) -> list[dict]:
        """End of a request: every stage's statistics (index = stage), then reset."""
        broadcast(Control("done"))
        out = all_gather_json(self.stage.stats())
        self.stage.reset_stats()
        return out

    def shutdown(self) -> None:
        """End the pipeline: every other stage stops its heartbeat and answers a barrier (see
        :func:`leave`), so none of them sees the leader's store close as a lost leader."""
        broadcast(Control("end"))
        dist.barrier()


def leave() -> None:
    """A follower's end after "end" (its heartbeat already stopped): the barrier that
    :meth:`PipelineLeader.shutdown` waits on, then leave the world (gloo's threads otherwise
    abort at interpreter exit)."""
    dist.barrier()
    dist.destroy_process_group()


# ---- rendezvous, plan, heartbeat (one host or several) -----------------------------------
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
