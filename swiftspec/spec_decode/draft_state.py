"""The draft side of one request: the draft tree plus the draft model calls that grow it.

Propose half of the propose -> verify -> accept loop (vLLM's separation). All tree bookkeeping is
in :mod:`swiftspec.spec_decode.tree`; this class only turns its plans into model calls and back.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from swiftspec.model_executor.runner import RunnerHandle
from swiftspec.spec_decode.acceptance import Replay
from swiftspec.spec_decode.tree import DraftTree, Reroot, Subgraph


@dataclass(frozen=True)
class TreeParams:
    """Draft-tree shape (SwiftSpec paper §3.1).

    Attributes:
        bs: target batch = subgraph size (nodes, root included).
        w: expansion width = leaves per draft forward.
        topk: children added per expanded node.
        max_nodes: cap on tree nodes.
        max_cached: tree-cache capacity in slots.
    """

    bs: int = 8
    w: int = 8
    topk: int = 8
    max_nodes: int = 1024
    max_cached: int = 256

    def __post_init__(self):
        for name in ("bs", "w", "topk", "max_nodes", "max_cached"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer")
        if self.max_cached < self.w:
            raise ValueError("max_cached must be at least w")


class DraftState:
    """Grows the draft tree with the draft model and keeps its KV cache consistent.

    Counters (``expansions``, ``stall_expansions``, ``reused_kv``, ``misses``) feed the metrics.
    """

    def __init__(self, runner: RunnerHandle, params: TreeParams):
        self.runner = runner
        self.params = params
        self.tree: DraftTree | None = None
        self.prompt_len = 0
        self.debug = False
        self.replay: Replay | None = None  # a replayed acceptance trace (benchmarks; see expand, subgraph)
        self.reset_counters()

    def reset_counters(self) -> None:
        """Zero the counters the metrics report (expansions, stalls, reused KV entries, misses, expansion seconds)."""
        self.expansions = 0
        self.stall_expansions = 0
        self.reused_kv = 0
        self.misses = 0
        self.expansion_s = 0.0

    def prefill(self, prompt_ids: list[int]) -> None:
        """Run the prompt through the draft model (its KV becomes the prefix cache)."""
        n = len(prompt_ids)
        pos = torch.arange(n)
        mask = torch.ones(n, n, dtype=torch.bool).tril()
        self.runner.forward(torch.tensor(prompt_ids), pos, pos, mask, None)
        self.prompt_len = n
        self.tree = None

    def start(self, root_token: int) -> None:
        """Begin the tree at the target's first token (its KV is computed by the next expansion)."""
        p = self.params
        self.tree = DraftTree(root_token, self.prompt_len, [root_token], p.max_nodes, p.max_cached)

    def can_expand(self) -> bool:
        """Whether one more expansion of ``w`` leaves fits the tree's node and cache caps."""
        return self.tree.can_expand(self.params.w)

    def expand(self) -> None:
        """One expansion: a draft forward over the ``w`` heaviest leaves (or the catch-up)."""
        t0 = time.perf_counter()
        exp = self.tree.plan_expansion(self.params.w)
        values, ids = self.runner.forward(exp.input_ids, exp.positions, exp.slots, exp.mask, exp.logits_rows,
                                          self.params.topk)  # reduced to the top-k where the draft runs
        if self.replay is not None and self.replay.shapes_tree:
            values = self._replayed_values(exp, values)
        self.tree.add_children(exp, values, ids)
        self.expansions += 1
        self.expansion_s += time.perf_counter() - t0
        if self.debug:
            self.tree.check_invariants()

    def ready(self) -> bool:
        """The tree can supply a full subgraph (root expanded and at least ``bs`` nodes), or is
        as large as it may get."""
        t = self.tree
        return t.root_expanded and (t.num_nodes >= self.params.bs or not self.can_expand())

    def fill(self) -> int:
        """Expand until :meth:`ready`; returns the number of expansions (stalls when the target waits)."""
        n = 0
        while not self.ready():
            self.expand()
            n += 1
        return n

    def _replayed_values(self, exp, values: torch.Tensor) -> torch.Tensor:
        """The recorded draft's log-probabilities for ``exp``'s rows in place of this draft's
        (:meth:`swiftspec.spec_decode.acceptance.Replay.child_logprobs`), so the tree takes the recorded
        draft's shape."""
        root_index = self.tree.root_position - self.prompt_len
        rows = [self.replay.child_logprobs(root_index, self.tree.path_ranks(n), values.shape[1]) for n in exp.nodes]
        return torch.tensor(rows, dtype=values.dtype).view_as(values)

    def subgraph(self, bs: int | None = None) -> Subgraph:
        """The next verification batch: the root and the ``bs - 1`` heaviest nodes (``bs``: the
        tree's ``params.bs`` unless given), ancestor-closed (:meth:`DraftTree.subgraph`; with a
        replayed trace also each node's children as candidates)."""
        return self.tree.subgraph(bs or self.params.bs, candidates=self.replay is not None)

    def reroot(self, verified: list[int]) -> Reroot:
        """Re-root on the verified tokens and apply the KV moves (SwiftSpec paper §3.2)."""
        r = self.tree.reroot(verified)
        self.runner.move_kv(r.src_slots, r.dst_slots)
        self.reused_kv += r.reused_kv
        self.misses += not r.hit
        if self.debug:
            self.tree.check_invariants()
        return r
