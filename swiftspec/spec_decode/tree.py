"""The draft tree: maximum-likelihood expansion, subgraph selection and re-rooting.

Source: SwiftSpec §3.1 (Algorithm 1, maximum-likelihood expansion) and §3.2 (Fig. 5, KV cache
consistency); SwiftSpec paper §3.1-3.2. This module is pure bookkeeping: it says which leaves to run,
which cache slots and positions they use, which mask they need, and which KV slots move where
after a re-root. It never runs a model and knows nothing of processes.

Cache layout it maintains (the draft model's KV cache)::

    [ prefix cache: slots 0 .. prefix_len-1 | tree cache: prefix_len .. prefix_len+num_cached-1 ]

The prefix cache holds the verified tokens whose KV exists, in order (the root is the last of
them once the root has been run). The tree cache holds the KV of every *expanded* non-root node.
Verified tokens without KV yet (``pending``) are run by the next expansion, which is then a
*catch-up* forward over just those tokens, ending at the root.

Architecture: docs/architecture.md §2.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

import torch


@dataclass
class Expansion:
    """One draft forward, as planned by :meth:`DraftTree.plan_expansion`.

    Attributes:
        nodes: tree node ids whose next-token distribution this forward yields (``[m]``), the
            rows of ``logits_rows`` in the same order.
        input_ids, positions, slots: ``[n]`` int64 tensors for the model; ``n >= m``.
        mask: ``[n, S]`` bool, ``S = slots.max() + 1`` (prefix + tree cache + the new entries).
        logits_rows: ``[m]`` indices into the ``n`` inputs whose logits are needed.
        catch_up: True when this forward runs pending verified tokens (the root's KV is missing).
    """

    nodes: list[int]
    input_ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    mask: torch.Tensor
    logits_rows: torch.Tensor
    catch_up: bool


@dataclass
class Subgraph:
    """The verification batch sent to the target (``bs`` nodes, root first, parents first).

    Attributes:
        tokens: ``[bs]`` token ids; ``tokens[0]`` is the root.
        parents: ``[bs]`` index of each node's parent inside the subgraph, -1 for the root.
        depths: ``[bs]`` depth below the root (root 0); a node's position is ``root_pos + depth``.
        weights: ``[bs]`` node weights (draft log-probability of the path from the root); only
            for diagnostics, the target does not need them.
        candidates: ``[bs]`` lists of each node's children tokens in the whole draft tree (inside
            the subgraph or not), most likely first; only for a replayed acceptance trace
            (:func:`swiftspec.spec_decode.verify.replayed_token`), else None.
    """

    tokens: list[int]
    parents: list[int]
    depths: list[int]
    weights: list[float] | None = None
    candidates: list[list[int]] | None = None

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass
class Reroot:
    """What :meth:`DraftTree.reroot` did.

    Attributes:
        src_slots, dst_slots: KV moves to apply to the draft cache (``dst <= src`` elementwise).
        hit: the new root (bonus token) was found in the tree with every verified ancestor.
        kept_nodes: nodes that survived (the new root's subtree).
        reused_kv: number of KV entries kept (moved to the prefix or kept in the tree cache).
    """

    src_slots: list[int]
    dst_slots: list[int]
    hit: bool
    kept_nodes: int
    reused_kv: int


@dataclass
class _Node:
    token: int
    parent: int
    depth: int
    weight: float  # sum of draft log-probabilities from the root (root 0.0)
    slot: int = -1  # tree-cache slot once expanded (root: -1, its KV lives in the prefix)
    expanded: bool = False
    children: dict[int, int] = field(default_factory=dict)  # token -> node id


class DraftTree:
    """Draft tree rooted at the last verified token, plus the prefix/tree cache bookkeeping.

    Args:
        root_token: the first root (the target's first sampled token).
        prefix_len: number of verified tokens whose KV is already in the draft cache (the prompt
            after the draft's prefill).
        pending: verified tokens with no KV yet, ending with ``root_token``.
        max_nodes: cap on the number of tree nodes (expanded or not).
        max_cached: capacity of the tree cache in slots (expanded non-root nodes).
    Raises:
        ValueError: ``pending`` does not end with the root.
    """

    def __init__(self, root_token: int, prefix_len: int, pending: list[int] | None = None,
                 max_nodes: int = 1024, max_cached: int = 256):
        pending = list(pending) if pending is not None else [root_token]
        if not pending or pending[-1] != root_token:
            raise ValueError("pending verified tokens must end with the root")
        self.max_nodes = max_nodes
        self.max_cached = max_cached
        self.prefix_len = prefix_len
        self.pending: list[int] = pending
        self._reset(root_token)

    # ---- state -------------------------------------------------------------------------
    def _reset(self, root_token: int) -> None:
        self.nodes: list[_Node] = [_Node(root_token, -1, 0, 0.0)]
        self.root = 0
        self.num_cached = 0  # expanded non-root nodes = tree-cache slots in use
        self._heap: list[tuple[float, int, int]] = [(-0.0, 0, 0)]  # (-weight, depth, id) of unexpanded

    @property
    def root_token(self) -> int:
        """The token of the root (the last verified token)."""
        return self.nodes[self.root].token

    @property
    def root_position(self) -> int:
        """Sequence position of the root (= its prefix slot once its KV exists)."""
        return self.prefix_len + len(self.pending) - 1

    @property
    def num_nodes(self) -> int:
        """Nodes in the node table (a reroot that keeps the tree rebuilds it from the surviving subtree)."""
        return len(self.nodes)

    @property
    def root_expanded(self) -> bool:
        """Whether the root's children have been drafted."""
        return self.nodes[self.root].expanded

    def token_of(self, node: int) -> int:
        """The token of node id ``node``."""
        return self.nodes[node].token

    def path_ranks(self, node: int) -> list[int]:
        """Sibling rank of each edge from the root down to ``node`` (0: its parent's most likely
        child; children are kept in the order :meth:`add_children` adds them, heaviest first)."""
        out = []
        while node != self.root:
            parent = self.nodes[node].parent
            out.append(list(self.nodes[parent].children.values()).index(node))
            node = parent
        return out[::-1]

    def can_expand(self, width: int) -> bool:
        """True if an expansion of ``width`` leaves fits the node and tree-cache caps."""
        if not self._heap:
            return False
        if not self.root_expanded:
            return True
        return (self.num_cached + min(width, len(self._heap)) <= self.max_cached
                and self.num_nodes < self.max_nodes)

    # ---- expansion ---------------------------------------------------------------------
    def plan_expansion(self, width: int) -> Expansion:
        """Pick the ``width`` heaviest unexpanded leaves (or the catch-up) and lay out the forward.

        A catch-up forward runs the pending verified tokens causally in the prefix slots; it
        yields the root's children. Otherwise the selected leaves go into the next tree-cache
        slots and each sees the prefix, its expanded ancestors and itself (the non-square mask
        of Fig. 4). Raises ``RuntimeError`` if nothing can be expanded.
        """
        if not self.root_expanded:
            n, p0 = len(self.pending), self.prefix_len
            slots = torch.arange(p0, p0 + n)
            mask = torch.ones(n, p0 + n, dtype=torch.bool)
            mask[:, p0:] = torch.ones(n, n, dtype=torch.bool).tril()
            self._heap = []  # the unexpanded root was the only leaf of a fresh tree
            return Expansion([self.root], torch.tensor(self.pending), slots.clone(), slots, mask,
                             torch.tensor([n - 1]), True)
        if not self.can_expand(width):
            raise RuntimeError("draft tree is full or has no unexpanded leaf")
        leaves = []
        while self._heap and len(leaves) < width:
            leaves.append(heapq.heappop(self._heap)[2])
        base = self.prefix_len + self.num_cached
        m = len(leaves)
        S = base + m
        mask = torch.zeros(m, S, dtype=torch.bool)
        mask[:, :self.prefix_len] = True
        rp = self.root_position
        for i, leaf in enumerate(leaves):
            mask[i, base + i] = True
            a = self.nodes[leaf].parent
            while a != self.root:
                mask[i, self.prefix_len + self.nodes[a].slot] = True
                a = self.nodes[a].parent
        for i, leaf in enumerate(leaves):
            self.nodes[leaf].slot = self.num_cached + i
        self.num_cached += m
        ids = torch.tensor([self.nodes[x].token for x in leaves])
        pos = torch.tensor([rp + self.nodes[x].depth for x in leaves])
        return Expansion(leaves, ids, pos, torch.arange(base, S), mask, torch.arange(m), False)

    def add_children(self, exp: Expansion, values: torch.Tensor, ids: torch.Tensor) -> None:
        """Attach the most likely children of every node of ``exp``.

        ``values`` / ``ids``: ``[m, topk]`` float32 draft log-probabilities and int64 token ids
        of each row's ``topk`` most likely tokens, heaviest first, one row per ``exp.nodes``
        (:meth:`swiftspec.model_executor.runner.ModelRunner.forward` with ``head=topk``). Children are added
        heaviest first while the node cap allows.
        """
        if exp.catch_up:
            self.prefix_len += len(self.pending)
            self.pending = []
        vals, idx = values.tolist(), ids.tolist()
        for row, node_id in enumerate(exp.nodes):
            node = self.nodes[node_id]
            node.expanded = True
            for lp, tok in zip(vals[row], idx[row]):
                if len(self.nodes) >= self.max_nodes:
                    break
                if lp == -math.inf:
                    break
                cid = len(self.nodes)
                w = node.weight + lp
                self.nodes.append(_Node(tok, node_id, node.depth + 1, w))
                node.children[tok] = cid
                heapq.heappush(self._heap, (-w, node.depth + 1, cid))

    # ---- verification batch -----------------------------------------------------------
    def subgraph(self, bs: int, candidates: bool = False) -> Subgraph:
        """The root plus the ``bs - 1`` heaviest other nodes, ancestor-closed, parents first
        (with ``candidates``: each node's children in the tree, see :class:`Subgraph`).

        A child never weighs more than its parent (log-probabilities are <= 0); ties are broken
        parent-first by depth, so the top-``bs`` set is ancestor-closed.
        """
        live = self._subtree(self.root)
        chosen = heapq.nsmallest(bs, live, key=lambda i: (-self.nodes[i].weight, self.nodes[i].depth, i))
        chosen.sort()  # node ids grow with creation order, so parents precede children
        index = {nid: j for j, nid in enumerate(chosen)}
        r = self.nodes[self.root]
        tokens, parents, depths, weights = [], [], [], []
        for nid in chosen:
            nd = self.nodes[nid]
            tokens.append(nd.token)
            parents.append(index[nd.parent] if nid != self.root else -1)
            depths.append(nd.depth - r.depth)
            weights.append(nd.weight)
        cands = [list(self.nodes[nid].children) for nid in chosen] if candidates else None
        return Subgraph(tokens, parents, depths, weights, cands)

    def _subtree(self, top: int) -> list[int]:
        out, stack = [], [top]
        while stack:
            nid = stack.pop()
            out.append(nid)
            stack.extend(self.nodes[nid].children.values())
        return out

    # ---- re-root ----------------------------------------------------------------------
    def reroot(self, verified: list[int]) -> Reroot:
        """Walk the verified tokens (accepted path + bonus) down the tree and re-root at the last.

        The KV of every verified node that was expanded moves into the prefix (in order); the
        new root's expanded descendants are compacted right after it; everything else is
        dropped. If the walk leaves the tree, or reaches an unexpanded verified node, the tree
        restarts at the bonus token (a *miss* when the bonus itself is not in the tree) and the
        verified tokens without KV become ``pending``. Returns the KV moves to apply.
        """
        if not verified:
            raise ValueError("reroot needs at least the bonus token")
        if self.pending:
            raise RuntimeError("reroot before the root's KV exists")
        path: list[int] = []  # walked non-root nodes, in order
        cur = self.root
        for tok in verified:
            child = self.nodes[cur].children.get(tok)
            if child is None:
                break
            path.append(child)
            cur = child
        hit = len(path) == len(verified)
        with_kv = [n for n in path if self.nodes[n].expanded]  # a prefix of path: expansion is ancestor-closed
        src = [self.prefix_len + self.nodes[n].slot for n in with_kv]
        new_prefix = self.prefix_len + len(with_kv)
        keep_tree = hit and self.nodes[cur].expanded
        survivors: list[int] = []
        if keep_tree:
            survivors = sorted((n for n in self._subtree(cur) if n != cur and self.nodes[n].expanded),
                               key=lambda n: self.nodes[n].slot)
            src += [self.prefix_len + self.nodes[n].slot for n in survivors]
        dst = list(range(self.prefix_len, self.prefix_len + len(src)))
        reused = len(src)
        if keep_tree:
            self._reroot_subtree(cur, survivors)
            self.prefix_len = new_prefix
            self.pending = []
        else:
            self.prefix_len = new_prefix
            self.pending = list(verified[len(with_kv):])
            self._reset(verified[-1])
        return Reroot(src, dst, hit, self.num_nodes, reused)

    def _reroot_subtree(self, new_root: int, survivors_by_slot: list[int]) -> None:
        """Rebuild the node table from ``new_root``'s subtree with compacted tree-cache slots."""
        old = self.nodes
        keep = sorted(self._subtree(new_root))  # creation order keeps parents first
        remap = {o: i for i, o in enumerate(keep)}
        new_slot = {o: j for j, o in enumerate(survivors_by_slot)}
        base_depth, base_weight = old[new_root].depth, old[new_root].weight
        nodes = []
        for o in keep:
            nd = old[o]
            nodes.append(_Node(nd.token, remap[nd.parent] if o != new_root else -1, nd.depth - base_depth,
                               nd.weight - base_weight, new_slot.get(o, -1), nd.expanded,
                               {t: remap[c] for t, c in nd.children.items()}))
        self.nodes = nodes
        self.root = 0
        self.num_cached = len(survivors_by_slot)
        self._heap = [(-n.weight, n.depth, i) for i, n in enumerate(nodes) if not n.expanded]
        heapq.heapify(self._heap)

    # ---- debug invariants (SwiftSpec paper §3.1) ---------------------------------------------
    def check_invariants(self) -> None:
        """Assert the cache/tree invariants; cheap enough for tests and debug runs."""
        root = self.nodes[self.root]
        assert root.parent == -1 and root.depth == 0
        assert (len(self.pending) > 0) == (not root.expanded), "pending tokens iff the root has no KV"
        slots = sorted(n.slot for i, n in enumerate(self.nodes) if i != self.root and n.expanded)
        assert slots == list(range(self.num_cached)), "tree cache must be contiguous"
        for i, n in enumerate(self.nodes):
            if i != self.root:
                p = self.nodes[n.parent]
                assert p.expanded and p.children.get(n.token) == i and n.depth == p.depth + 1
                assert n.weight <= p.weight + 1e-9
