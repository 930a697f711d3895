"""Draft tree bookkeeping: expansion plans, masks, subgraph selection, re-root and KV moves."""

import pytest
import torch

from swiftspec.spec_decode.target_state import ancestor_mask
from swiftspec.spec_decode.tree import DraftTree


def _lp(pairs, vocab=16):
    """log-prob row with the given {token: prob}; the rest share what is left."""
    row = torch.full((vocab,), 1e-6)
    for t, p in pairs.items():
        row[t] = p
    return (row / row.sum()).log()


def _add(tree, exp, logprobs, topk):
    """Attach each row's ``topk`` most likely tokens, as the draft runner's top-k head gives them."""
    tree.add_children(exp, *logprobs.topk(min(topk, logprobs.shape[-1]), dim=-1))


def _grow(tree, rows, topk=2, w=2):
    exp = tree.plan_expansion(w)
    _add(tree, exp, torch.stack([_lp(r) for r in rows[:len(exp.nodes)]]), topk)
    tree.check_invariants()
    return exp


def test_catch_up_then_expansion_mask():
    t = DraftTree(root_token=7, prefix_len=5, pending=[3, 7])
    exp = t.plan_expansion(4)
    assert exp.catch_up and exp.input_ids.tolist() == [3, 7] and exp.slots.tolist() == [5, 6]
    assert exp.mask.shape == (2, 7) and exp.mask[0, 6].item() is False and exp.mask[1].all()
    _add(t, exp, _lp({1: 0.6, 2: 0.3}).unsqueeze(0), 2)
    assert t.prefix_len == 7 and t.pending == [] and t.root_position == 6
    e2 = _grow(t, [{4: 0.9}, {5: 0.9}], topk=1, w=2)  # expands the two children of the root
    assert e2.slots.tolist() == [7, 8] and e2.positions.tolist() == [7, 7]
    assert e2.mask.shape == (2, 9) and e2.mask[:, :7].all()
    assert e2.mask[0, 7:].tolist() == [True, False] and e2.mask[1, 7:].tolist() == [False, True]
    e3 = _grow(t, [{6: 0.9}, {8: 0.9}], topk=1, w=2)  # grandchildren see their parent's slot
    assert e3.positions.tolist() == [8, 8]
    parents_slot = {int(s) for s in e3.mask[:, 7:9].nonzero()[:, 1] + 7}
    assert parents_slot == {7, 8}


def test_expansion_picks_heaviest_leaves():
    t = DraftTree(0, 1, [0])
    _add(t, t.plan_expansion(1), _lp({1: 0.5, 2: 0.3, 3: 0.15}).unsqueeze(0), 3)
    exp = t.plan_expansion(2)
    assert [t.token_of(n) for n in exp.nodes] == [1, 2]


def test_subgraph_is_ancestor_closed_top_bs():
    t = DraftTree(0, 1, [0])
    _add(t, t.plan_expansion(1), _lp({1: 0.9, 2: 0.05}).unsqueeze(0), 2)
    _grow(t, [{3: 0.9, 4: 0.05}, {5: 0.5, 6: 0.5}], topk=2, w=2)
    sg = t.subgraph(4)
    assert sg.tokens[0] == 0 and sg.parents[0] == -1
    # heaviest: 1 (0.9), 3 (0.81), then 2 (0.05) vs 4 (0.045) -> 2
    assert sorted(sg.tokens) == [0, 1, 2, 3]
    for i, p in enumerate(sg.parents):
        assert p < i
        if p >= 0:
            assert sg.depths[i] == sg.depths[p] + 1


def test_reroot_hit_moves_path_and_compacts_subtree():
    t = DraftTree(0, 10, [0])
    _add(t, t.plan_expansion(1), _lp({1: 0.6, 2: 0.3}).unsqueeze(0), 2)   # root -> 1, 2
    _grow(t, [{3: 0.9}, {4: 0.9}], topk=1, w=2)   # 1 (slot 0) -> 3 ; 2 (slot 1) -> 4
    _grow(t, [{5: 0.9}, {6: 0.9}], topk=1, w=2)   # 3 (slot 2) -> 5 ; 4 (slot 3) -> 6
    assert t.prefix_len == 11
    r = t.reroot([1, 3])  # accept 1, bonus 3: path 1 (slot 11), 3 (slot 13) -> prefix 11, 12
    assert r.hit
    assert r.src_slots == [11, 13] and r.dst_slots == [11, 12]
    assert t.prefix_len == 13 and t.root_token == 3 and t.root_expanded and t.num_cached == 0
    assert all(d <= s for s, d in zip(r.src_slots, r.dst_slots))
    t.check_invariants()
    # the surviving child (5) is an unexpanded leaf, so it is the next to expand
    exp = t.plan_expansion(2)
    assert [t.token_of(n) for n in exp.nodes] == [5] and exp.positions.tolist() == [13]


def test_reroot_keeps_expanded_descendants():
    t = DraftTree(0, 4, [0])
    _add(t, t.plan_expansion(1), _lp({1: 0.9}).unsqueeze(0), 1)
    _grow(t, [{2: 0.5, 3: 0.4}], topk=2, w=1)        # 1 slot0 -> 2, 3
    _grow(t, [{4: 0.9}, {5: 0.9}], topk=1, w=2)      # 2 slot1, 3 slot2
    _grow(t, [{6: 0.9}, {7: 0.9}], topk=1, w=2)      # 4 slot3, 5 slot4
    r = t.reroot([1])  # bonus 1: new root 1 keeps 2, 3, 4, 5 expanded
    assert r.hit and t.root_token == 1
    assert r.src_slots == [5, 6, 7, 8, 9] and r.dst_slots == [5, 6, 7, 8, 9]
    assert t.num_cached == 4 and t.prefix_len == 6
    t.check_invariants()


def test_reroot_miss_restarts_with_pending():
    t = DraftTree(0, 4, [0])
    _add(t, t.plan_expansion(1), _lp({1: 0.9}).unsqueeze(0), 1)
    _grow(t, [{2: 0.9}], topk=1, w=1)                 # 1 slot0 -> 2 (unexpanded)
    r = t.reroot([1, 2, 9])                           # 1 has KV, 2 has none, 9 not in the tree
    assert not r.hit and r.src_slots == [5] and r.dst_slots == [5]
    assert t.prefix_len == 6 and t.pending == [2, 9] and t.root_token == 9 and not t.root_expanded
    exp = t.plan_expansion(8)
    assert exp.catch_up and exp.input_ids.tolist() == [2, 9] and exp.positions.tolist() == [6, 7]


def test_caps_stop_expansion():
    t = DraftTree(0, 1, [0], max_nodes=6, max_cached=2)
    _add(t, t.plan_expansion(1), _lp({1: 0.5, 2: 0.3, 3: 0.1}).unsqueeze(0), 3)
    _grow(t, [{4: 0.9}, {5: 0.9}], topk=1, w=2)
    assert t.num_nodes == 6 and not t.can_expand(1)
    with pytest.raises(RuntimeError):
        t.plan_expansion(1)


def test_ancestor_mask():
    m = ancestor_mask([-1, 0, 0, 1], prefix_len=2)
    assert m.shape == (4, 6)
    assert m[:, :2].all()
    assert m[3, 2:].tolist() == [True, True, False, True]
    assert m[2, 2:].tolist() == [True, False, True, False]


def test_pending_must_end_with_root():
    with pytest.raises(ValueError):
        DraftTree(1, 0, [2])
