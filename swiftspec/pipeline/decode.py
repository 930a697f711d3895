"""The pipeline modes' decoding loop on the leader (rank 0): ``pipedec``, ``pipeinfer`` and
``pipeline-autoregressive`` (docs/architecture.md §10).

Every timestep one micro-batch of new tree nodes enters stage 0 (:mod:`swiftspec.pipeline.stages` moves
the others one stage on) and the draft, in stage 0's process, proposes the next one:

- ``pipedec`` (PipeDec §3.3-3.4; SpecPipe's layout): the micro-batch is one layer of a dynamic
  prediction tree: the ``w`` children with the highest cumulative draft log-probability among the
  top-``topk`` children of every node of the layer before, so every stage holds a different
  layer and at most one token is verified per timestep.
- ``pipeinfer`` (PipeInfer §III, continuous asynchronous speculation): the micro-batch is a *run*
  of ``w`` consecutive draft tokens continuing the newest speculation (after a miss, the first
  run is the one non-speculative token); each run that leaves the pipeline verifies all of its
  tokens, so up to ``w`` tokens per timestep.
- ``pipeline-autoregressive``: no draft; one token traverses every stage before the next starts.

Verification is one walk for all three: the target samples its next token at the *frontier* (the
newest verified node, whose logits arrive with the micro-batch leaving the last stage) with the
request's sampler; if that token is a child of the frontier still in flight (a *hit*) the child is
the new frontier, every node outside its subtree is pruned, in flight or not (each stage drops
the pruned rows of the micro-batch it holds before running it: PipeDec's pruning, PipeInfer's
early inference cancellation), and the walk goes on while the child's logits are in the same
micro-batch; otherwise (a *miss*) the token is a bonus token that roots a new tree. Every
emitted token is the target's own sample given the verified prefix, so the output is exactly
the target's, greedy or sampled.

KV: a node's slot is allocated in creation order (increasing along every path, so a node
attends to its keys in position order as autoregressive decoding does: bit-identical greedy
output); verified nodes' entries are never recomputed, and on each miss (nothing valid in
flight then) they are compacted after the prefix with one move applied by every stage.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from swiftspec.model_executor.sampling import Sampler
from swiftspec.pipeline.control import Work
from swiftspec.pipeline.stages import PipelineLeader
from swiftspec.spec_decode.scheduler import Request, StopChecker, TargetStats

PROMPT_ROW = -1  # row id of the prompt's tokens in the prefill micro-batch


@dataclass
class _Node:
    token: int
    pos: int
    slot: int
    logp: float  # cumulative draft log-probability within its tree
    parent: int  # node id, -1 for a tree's root
    depth: int  # within its tree
    row: torch.Tensor | None  # its attention mask row (the verified prefix, its ancestors, itself)
    children: dict[int, int] = field(default_factory=dict)  # token -> node id


@dataclass
class _Batch:
    """A micro-batch as the last stage that ran it saw it: ``rows`` are node ids (PROMPT_ROW for
    the prompt), ``positions``/``slots``/``mask``/``tokens`` their step inputs."""

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
    """``TargetStats`` (one entry of ``accepted`` per verification walk step: 1 = hit) plus the
    pipeline's counters: timesteps, nodes issued to stage 0, rows pruned (and micro-batches
    cancelled whole) before reaching the last stage,
    rows in flight when the request ended, voluntary flushes (tree slots exhausted), stage stats."""

    timesteps: int = 0
    issued: int = 0
    pruned: int = 0
    cancelled: int = 0  # micro-batches (PipeInfer's runs) dropped whole before the last stage
    drained: int = 0
    flushes: int = 0
    stages: list[dict] = field(default_factory=list)


class PipelineDecoder:
    """The leader's tree and pipeline state for one request at a time (see the module docstring).

    Args:
        pipe: the pipeline (stage 0 runs here).
        draft: the draft's :class:`swiftspec.model_executor.runner.ModelRunner`; None for pipeline-autoregressive.
        mode: "pipedec", "pipeinfer" or "pipeline-autoregressive".
        width: pipedec: nodes per tree layer; pipeinfer: tokens per speculative run.
        topk: pipedec: children proposed per node.
        capacity: KV slots of every cache (target stages and draft).
        order: pipedec: "layer" (PipeDec: each micro-batch is the next tree layer) or "score"
            (FlowSpec §3's score-based ordering: the ``width`` best candidates of any depth not
            yet issued enter first, so the tree grows where the draft's probability mass is).
    Raises:
        ValueError: unknown mode, or a speculative mode without a draft.
    """

    def __init__(self, pipe: PipelineLeader, draft, mode: str, width: int = 2, topk: int = 2, capacity: int = 4096,
                 order: str = "layer"):
        if mode not in ("pipedec", "pipeinfer", "pipeline-autoregressive"):
            raise ValueError(f"unknown pipeline mode {mode!r}")
        if order not in ("layer", "score"):
            raise ValueError(f"order must be 'layer' or 'score', got {order!r}")
        if (draft is None) != (mode == "pipeline-autoregressive"):
            raise ValueError(f"{mode} needs {'a' if draft is None else 'no'} draft model")
        self.pipe, self.draft, self.mode, self.order = pipe, draft, mode, order
        self.width, self.topk, self.capacity = width, topk, capacity
        self.pool: list[tuple[float, int, int]] = []  # score order: candidates not yet issued

    def run(self, req: Request, emit, stop: StopChecker | None = None) -> PipelineStats:
        """Decode ``req`` through the pipeline until ``stop`` (default: a :class:`StopChecker` of the
        request) says so: each timestep issues one micro-batch to stage 0, drafts the next while the
        stages compute, and walks the last stage's logits to verify. Verified tokens go to
        ``emit(tokens, t, logprobs)`` (``t``: ``time.perf_counter()`` seconds). Returns the request's
        :class:`PipelineStats`."""
        sampler, stop, st = Sampler(req.params), stop or StopChecker(req), PipelineStats()
        S, n = self.pipe.stages, len(req.prompt_ids)
        self.nodes: list[_Node] = []
        self.alive: set[int] = set()
        self.pool = []
        self.base = self.next_slot = n  # verified tokens sit in slots [0, base)
        ids, pos = torch.tensor(req.prompt_ids), torch.arange(n)
        prompt = _Batch([PROMPT_ROW] * n, pos, pos.clone(), torch.ones(n, n, dtype=torch.bool).tril(), ids)
        in_pipe: list[_Batch | None] = [None] * S
        issue: _Batch | None = prompt
        self.frontier = PROMPT_ROW  # the node whose logits are awaited
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
                st.pruned += 0 if keep is None else in_rows - len(keep)
                w = Work(0 if s == 0 else in_rows, keep, b.positions, b.slots, b.mask, b.tokens if s == 0 else None)
                if not b.rows:
                    in_pipe[s] = None
                    st.cancelled += 1
                elif s == S - 1:  # the prompt's last row, else every row (the walk may use them all)
                    w.logit_rows = [n - 1] if b is prompt else list(range(len(b.rows)))
                work.append(w)
            self.pipe.launch(work, moves)
            moves = None
            st.timesteps += 1
            st.issued += 0 if issue is None or issue is prompt else len(issue.rows)
            proposal = self._draft(issue, prompt)
            logits = self.pipe.collect()
            if logits is None:
                issue = self._issue(proposal)
                continue
            bonus = self._walk(in_pipe[-1].rows, logits, sampler, stop, emit, st)
            if stop.reason:
                break
            if bonus is None:
                issue = self._issue(proposal)
                continue
            # a miss: the bonus token roots a new tree; everything in flight is pruned
            if self.frontier != PROMPT_ROW:
                moves = self._compact(self.frontier)
            last_pos = n - 1 if self.frontier == PROMPT_ROW else self.nodes[self.frontier].pos
            self.alive, self.pool = set(), []
            self.frontier = self._new_node(bonus, last_pos + 1, 0.0, -1)
            issue = self._batch([self.frontier])
        st.reason = stop.reason
        st.drained = self._drain(in_pipe)
        st.stages = self.pipe.finish()
        return st

    # ---- verification --------------------------------------------------------------------
    def _walk(self, rows: list[int], logits: torch.Tensor, sampler: Sampler, stop: StopChecker, emit,
              st: PipelineStats) -> int | None:
        """Sample at the frontier and walk down while the sampled token is a child whose logits
        are in this micro-batch. Returns the bonus token of a miss, or None when the walk ended
        on a child still in flight (the new frontier) or the request stopped."""
        at = {r: i for i, r in enumerate(rows)}
        if self.frontier != PROMPT_ROW and self.frontier not in at:  # alive nodes all descend from it
            raise RuntimeError(f"pipeline: logits of {rows} arrived before the frontier {self.frontier}'s")
        while True:
            row = logits[0 if self.frontier == PROMPT_ROW else at[self.frontier]]
            x = sampler.sample(row)
            lps = [sampler.logprob(row, x)] if stop.req.params.logprobs is not None else []
            kept = stop.push([x])
            emit(kept, time.perf_counter(), lps[:len(kept)])
            child = None if self.frontier == PROMPT_ROW else self.nodes[self.frontier].children.get(x)
            hit = child is not None and child in self.alive
            if self.frontier != PROMPT_ROW:  # the prefill's token is no verification
                st.verifications += 1
                st.accepted.append(int(hit))
            if stop.reason:
                return None
            if hit and self.next_slot + self.width * (self.pipe.stages + 2) > self.capacity:
                st.flushes += 1  # tree slots exhausted: restart from the verified prefix (lossless)
                hit = False
            if not hit:
                return x
            self._prune_to(child)
            if child not in at:
                return None

    def _prune_to(self, child: int) -> None:
        """``child`` is verified: it becomes the frontier and only its subtree stays alive."""
        self.frontier = child
        depth = self.nodes[child].depth
        keep = set()
        for i in self.alive:
            j = i
            while self.nodes[j].depth > depth:
                j = self.nodes[j].parent
            if j == child:
                keep.add(i)
        self.alive = keep

    # ---- proposals -----------------------------------------------------------------------
    def _draft(self, issued: _Batch | None, prompt: _Batch):
        """The draft's work while the stages compute: pipedec: candidate children of the layer
        just issued; pipeinfer: the next run, as new nodes; pipeline-autoregressive: nothing."""
        if self.draft is None or issued is None:
            return None
        if issued is prompt:
            self.draft.forward(prompt.tokens, prompt.positions, prompt.slots, prompt.mask, None)
            return None
        if self.mode == "pipedec":
            logits = self.draft.forward(issued.tokens, issued.positions, issued.slots, issued.mask,
                                        torch.arange(len(issued.rows)))
            lp, tok = torch.log_softmax(logits, dim=-1).topk(self.topk, dim=-1)
            return [(self.nodes[i].logp + float(lp[r, j]), i, int(tok[r, j]))
                    for r, i in enumerate(issued.rows) for j in range(self.topk)]
        # pipeinfer: continue the chain from the run's last token, one draft token at a time
        run, last = [], issued.rows[-1]
        for _ in range(self.width):
            node = self.nodes[last]
            logits = self.draft.forward(torch.tensor([node.token]), torch.tensor([node.pos]),
                                        torch.tensor([node.slot]), node.row.unsqueeze(0), torch.tensor([0]))
            last = self._new_node(int(logits[0].argmax()), node.pos + 1, 0.0, last)
            run.append(last)
        return run

    def _issue(self, proposal) -> _Batch | None:
        """The next micro-batch: pipedec: the ``width`` best candidates whose parent is still in
        the tree (of the newest layer, or of any depth in score order), as new nodes; pipeinfer:
        the drafted run if it is still alive."""
        proposal = proposal or []
        if not proposal and not self.pool:
            return None
        if self.mode == "pipeinfer":
            run = [i for i in proposal if i in self.alive]
            return self._batch(run) if run else None
        if self.order == "score":  # every candidate not yet issued competes, whatever its depth
            proposal, self.pool = self.pool + proposal, []
        ranked = sorted((c for c in proposal if c[1] in self.alive), key=lambda c: -c[0])
        live, self.pool = ranked[:self.width], ranked[self.width:] if self.order == "score" else []
        if not live:
            return None
        return self._batch([self._new_node(tok, self.nodes[p].pos + 1, lp, p) for lp, p, tok in live])

    # ---- tree and KV ---------------------------------------------------------------------
    def _new_node(self, token: int, pos: int, logp: float, parent: int) -> int:
        i, slot = len(self.nodes), self.next_slot
        if parent < 0:
            row = torch.zeros(slot + 1, dtype=torch.bool)
            row[:self.base] = True
        else:
            prow = self.nodes[parent].row
            row = torch.cat([prow, torch.zeros(slot + 1 - prow.numel(), dtype=torch.bool)])
        row[slot] = True
        depth = 0 if parent < 0 else self.nodes[parent].depth + 1
        self.nodes.append(_Node(token, pos, slot, logp, parent, depth, row))
        self.next_slot += 1
        self.alive.add(i)
        if parent >= 0:
            self.nodes[parent].children.setdefault(token, i)
        return i

    def _batch(self, rows: list[int]) -> _Batch:
        """Step inputs of new nodes (masks padded to the newest slot)."""
        nodes = [self.nodes[i] for i in rows]
        mask = torch.zeros(len(rows), self.next_slot, dtype=torch.bool)
        for r, x in enumerate(nodes):
            mask[r, :x.row.numel()] = x.row
        return _Batch(list(rows), torch.tensor([x.pos for x in nodes]), torch.tensor([x.slot for x in nodes]),
                      mask, torch.tensor([x.token for x in nodes]))

    def _compact(self, frontier: int) -> tuple[list[int], list[int]] | None:
        """After a miss (nothing valid in flight): move the verified nodes' KV (the frontier's
        path) to follow the prefix, in every cache; drop the mask rows of the finished tree.
        Returns the move, None when already in place."""
        path = [frontier]
        while self.nodes[path[-1]].parent >= 0:
            path.append(self.nodes[path[-1]].parent)
        src = [self.nodes[i].slot for i in reversed(path)]
        dst = list(range(self.base, self.base + len(src)))
        self.base += len(src)
        self.next_slot = self.base
        for node in self.nodes[path[-1]:]:  # the tree's root came first: its nodes are the list's tail
            node.row = None
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
