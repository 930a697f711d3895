"""The pipeline modes' decoding loop on the leader (rank 0): ``pipedec`` and ``pipeline-autoregressive``
(docs/architecture.md §10).

``pipedec`` (PipeDec §3.3-3.4; SpecPipe's layout): the draft model sits in stage 0's process.
Every timestep the draft grows the *dynamic prediction tree* by one layer (the ``width`` children
with the highest cumulative draft log-probability among the top-``topk`` children of every node of
the newest layer) and that layer enters stage 0 at once, so every stage holds a different tree
layer. When the last stage returns the logits of the frontier node ``v`` (the newest verified
token, one layer ahead of its children), the target samples its next token ``x`` with the
request's sampler: if ``x`` is a child of ``v`` (a *hit*) the child becomes the frontier and every
node outside its subtree is pruned, in flight or not (each stage drops the pruned rows of the
micro-batch it holds before running it); otherwise (a *miss*) ``x`` is a bonus token that roots a
new tree and the pipeline refills. Each emitted token is the target's own sample given the
verified prefix, so the output is exactly the target's, greedy or sampled.

``pipeline-autoregressive`` is the same loop without a draft: every token is a miss, so one token
traverses all stages before the next starts (the baseline the pipeline papers compare with).

KV: a node's slot is allocated in issue order (increasing along every path, so a node attends to
its keys in position order, as autoregressive decoding does: bit-identical greedy output); the
verified nodes' entries are never recomputed, and on each miss (nothing in flight then) they are
compacted after the prefix with one move applied by every stage.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from swiftspec.pipeline import PipelineLeader, Work
from swiftspec.sampling import Sampler
from swiftspec.scheduler import Request, StopChecker, TargetStats

PROMPT_ROW = -1  # row id of the prompt's tokens in the prefill micro-batch


@dataclass
class _Node:
    token: int
    pos: int
    slot: int
    logp: float
    anc: list[int]  # node ids from this tree's root to this node (itself last)
    children: dict[int, int] = field(default_factory=dict)  # token -> node id


@dataclass
class _Batch:
    """A micro-batch as the last stage that ran it saw it: ``rows`` are node ids (PROMPT_ROW for
    the prompt), ``positions``/``slots``/``mask`` their step inputs."""

    rows: list[int]
    positions: torch.Tensor
    slots: torch.Tensor
    mask: torch.Tensor
    tokens: torch.Tensor

    def prune(self, alive) -> list[int] | None:
        """Drop rows whose node was pruned; return the kept indices (None when all are kept)."""
        keep = [i for i, r in enumerate(self.rows) if r == PROMPT_ROW or alive(r)]
        if len(keep) == len(self.rows):
            return None
        idx = torch.tensor(keep, dtype=torch.long)
        self.rows = [self.rows[i] for i in keep]
        self.positions, self.slots, self.mask = self.positions[idx], self.slots[idx], self.mask[idx]
        return keep


@dataclass
class PipelineStats(TargetStats):
    """``TargetStats`` plus the pipeline's counters: timesteps run, nodes issued and pruned before
    reaching the last stage, voluntary flushes (tree slots exhausted), stage statistics."""

    timesteps: int = 0
    issued: int = 0
    pruned: int = 0
    drained: int = 0  # rows in flight when the request ended, dropped by the stages
    flushes: int = 0
    stages: list[dict] = field(default_factory=list)


class PipeDec:
    """The leader's tree and pipeline state for one request (see the module docstring).

    Args:
        pipe: the pipeline (stage 0 runs here).
        draft: the draft's :class:`swiftspec.runner.ModelRunner`, or None for pipeline-autoregressive.
        width: nodes per tree layer (PipeDec's maximum layer width); topk: children per node.
        capacity: KV slots of every cache (target stages and draft).
    """

    def __init__(self, pipe: PipelineLeader, draft, width: int = 4, topk: int = 2, capacity: int = 4096):
        self.pipe, self.draft, self.width, self.topk, self.capacity = pipe, draft, width, topk, capacity

    def run(self, req: Request, emit, stop: StopChecker | None = None) -> PipelineStats:
        sampler, stop, st = Sampler(req.params), stop or StopChecker(req), PipelineStats()
        S, n = self.pipe.stages, len(req.prompt_ids)
        self.nodes: list[_Node] = []
        self.alive: set[int] = set()
        self.base = n  # verified tokens stored contiguously in slots [0, base)
        self.next_slot = n
        ids, pos = torch.tensor(req.prompt_ids), torch.arange(n)
        prompt = _Batch([PROMPT_ROW] * n, pos, pos.clone(), torch.ones(n, n, dtype=torch.bool).tril(), ids)
        in_pipe: list[_Batch | None] = [None] * S
        issue: _Batch | None = prompt
        frontier = PROMPT_ROW  # the node whose logits are awaited
        moves = None
        while True:
            in_pipe = [issue] + in_pipe[:-1]
            work = []
            for s, b in enumerate(in_pipe):
                if b is None:
                    work.append(None)
                    continue
                in_rows = len(b.rows)
                keep = None if s == 0 else b.prune(self.alive.__contains__)
                if keep is not None:
                    st.pruned += in_rows - len(keep)
                if not b.rows:
                    in_pipe[s] = None
                w = Work(0 if s == 0 else in_rows, keep, b.positions, b.slots, b.mask,
                         b.tokens if s == 0 else None)
                if s == S - 1 and b.rows:
                    w.logit_rows = [len(b.rows) - 1] if frontier == PROMPT_ROW else \
                        [i for i, r in enumerate(b.rows) if r == frontier]
                work.append(w)
            self.pipe.launch(work, moves)
            moves = None
            st.timesteps += 1
            candidates = []  # the draft's proposals for the layer after the one just issued
            if issue is prompt and self.draft is not None:
                self.draft.forward(ids, pos, pos, prompt.mask, None)
            elif issue is not None and self.draft is not None:
                candidates = self._propose(issue)
            issue = None
            logits = self.pipe.collect()
            if logits is None:
                issue = self._next_layer(candidates)
                continue
            x = sampler.sample(logits[0])
            lps = [sampler.logprob(logits[0], x)] if req.params.logprobs is not None else []
            kept = stop.push([x])
            emit(kept, time.perf_counter(), lps[:len(kept)])
            child = self.nodes[frontier].children.get(x) if frontier != PROMPT_ROW else None
            hit = child is not None and child in self.alive
            if frontier != PROMPT_ROW:  # a verification (the prefill's token is not one)
                st.verifications += 1
                st.accepted.append(int(hit))
            if stop.reason:
                break
            overflow = self.next_slot + self.width * (S + 1) > self.capacity
            if hit and not overflow:
                frontier = child
                depth = len(self.nodes[child].anc) - 1
                self.alive = {i for i in self.alive
                              if len(self.nodes[i].anc) > depth and self.nodes[i].anc[depth] == child}
                issue = self._next_layer(candidates)
                continue
            if frontier != PROMPT_ROW:
                st.flushes += hit
                moves = self._compact(frontier)
                last_pos = self.nodes[frontier].pos
            else:
                last_pos = n - 1
            # a miss: x roots a new tree; everything in flight is pruned
            self.alive = set()
            frontier = self._new_node(x, last_pos + 1, 0.0, [])
            issue = self._batch([frontier])
        st.issued = len(self.nodes)
        st.reason = stop.reason
        st.drained = self._drain(in_pipe)
        st.stages = self.pipe.finish()
        return st

    # ---- tree ----------------------------------------------------------------------------
    def _new_node(self, token: int, pos: int, logp: float, parent_anc: list[int]) -> int:
        i = len(self.nodes)
        self.nodes.append(_Node(token, pos, self.next_slot, logp, parent_anc + [i]))
        self.next_slot += 1
        self.alive.add(i)
        if parent_anc:
            self.nodes[parent_anc[-1]].children.setdefault(token, i)
        return i

    def _batch(self, rows: list[int]) -> _Batch:
        """Step inputs of new nodes: each sees the verified prefix ``[0, base)``, its ancestors and itself."""
        mask = torch.zeros(len(rows), self.next_slot, dtype=torch.bool)
        mask[:, :self.base] = True
        for r, i in enumerate(rows):
            mask[r, [self.nodes[a].slot for a in self.nodes[i].anc]] = True
        nodes = [self.nodes[i] for i in rows]
        return _Batch(list(rows), torch.tensor([x.pos for x in nodes]), torch.tensor([x.slot for x in nodes]),
                      mask, torch.tensor([x.token for x in nodes]))

    def _propose(self, b: _Batch) -> list[tuple[float, int, int]]:
        """Draft forward over the layer just issued: the top-``topk`` children of each of its
        nodes, with cumulative log-probabilities."""
        logits = self.draft.forward(b.tokens, b.positions, b.slots, b.mask, torch.arange(len(b.rows)))
        lp, tok = torch.log_softmax(logits, dim=-1).topk(self.topk, dim=-1)
        out = []
        for r, i in enumerate(b.rows):
            base = self.nodes[i].logp
            out += [(base + float(lp[r, j]), i, int(tok[r, j])) for j in range(self.topk)]
        return out

    def _next_layer(self, candidates) -> _Batch | None:
        """The ``width`` best candidates whose parent is still in the tree, as new nodes."""
        live = sorted((c for c in candidates if c[1] in self.alive), key=lambda c: -c[0])[:self.width]
        if not live:
            return None
        return self._batch([self._new_node(tok, self.nodes[p].pos + 1, lp, self.nodes[p].anc)
                            for lp, p, tok in live])

    def _compact(self, frontier: int) -> tuple[list[int], list[int]] | None:
        """After a miss (nothing left in flight): move the verified nodes' KV (the frontier's
        path) to follow the prefix, in every cache. Returns the move, None when already in place."""
        src = [self.nodes[a].slot for a in self.nodes[frontier].anc]
        dst = list(range(self.base, self.base + len(src)))
        self.base += len(src)
        self.next_slot = self.base
        if src == dst:
            return None
        if self.draft is not None:
            self.draft.move_kv(src, dst)
        return src, dst

    def _drain(self, in_pipe: list[_Batch | None]) -> int:
        """End of request: the stages receive (and drop) what is still in flight, so the links
        are empty for the next request. Returns the rows dropped."""
        sent = in_pipe[:-1]  # what stages 0..S-2 ran in the last timestep and sent on
        if not any(b is not None for b in sent):
            return 0
        self.pipe.launch([None] + [Work(len(b.rows), [], b.positions[:0], b.slots[:0], b.mask[:0])
                                   if b is not None else None for b in sent])
        self.pipe.collect()
        return sum(len(b.rows) for b in sent if b is not None)
