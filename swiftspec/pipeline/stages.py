"""Pipeline-parallel stages of the target model over torch.distributed (docs/architecture.md §10).

The target's decoder layers are split into ``S`` contiguous stages balanced by the weight bytes a
forward reads (:func:`swiftspec.pipeline.partition.partition_layers`); rank ``s`` of the pipeline world holds stage ``s``. Rank
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
(:func:`swiftspec.pipeline.membership.join`: a private file store when every stage runs on this host, else a TCP store hosted by
rank 0 whose keys only holders of the shared secret can name), receives the leader's :class:`~swiftspec.pipeline.membership.StagePlan` (which layers,
dtype, weights), checks that its model files hash like the leader's, and loads only its layers.
Every rank advances a heartbeat counter in the store (:class:`~swiftspec.pipeline.membership.Heartbeat`); a stage that dies (its
sockets close: the peers' pending gloo operation fails at once) or whose host goes away (its
counter stops) is named, with its host, by every other rank within ``membership.HEARTBEAT_LIMIT_S`` seconds,
which then exits instead of waiting on a receive that cannot complete.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from swiftspec.distributed.wire import all_gather_json
from swiftspec.pipeline.control import Control, Work, broadcast_control
from swiftspec.pipeline.membership import LEADER


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
