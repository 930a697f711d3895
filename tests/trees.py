"""A verification tree against the same tokens decoded one at a time (the batch-invariance check
of the native-weights tests)."""
from __future__ import annotations

import torch

from swiftspec.spec_decode.target_state import ancestor_mask


def _forward(model, ids, positions, mask, kv, first_slot):
    slots = torch.arange(first_slot, first_slot + len(ids))
    return model.compute_logits(model(torch.tensor(ids), torch.tensor(positions), slots, mask, kv))


def assert_tree_equals_path(model, prompt: list[int], toks: list[int], parents: list[int], path: list[int],
                            capacity: int) -> None:
    """Prefill ``prompt``, verify the tree ``toks``/``parents`` (parents first, root -1) in one
    forward, then decode the nodes of ``path`` (a root-to-leaf chain) one token at a time on a
    fresh cache: each node's logits must be bit-identical in both."""
    L = len(prompt)
    depth = []
    for p in parents:
        depth.append(0 if p < 0 else depth[p] + 1)
    prefill_mask = torch.ones(L, L, dtype=torch.bool).tril()
    kv = model.make_kv_cache(capacity)
    _forward(model, prompt, list(range(L)), prefill_mask, kv, 0)
    batch = _forward(model, toks, [L + d for d in depth], ancestor_mask(parents, L), kv, L)
    kv1 = model.make_kv_cache(capacity)
    _forward(model, prompt, list(range(L)), prefill_mask, kv1, 0)
    for k, node in enumerate(path):
        single = _forward(model, [toks[node]], [L + k], torch.ones(1, L + k + 1, dtype=torch.bool), kv1, L + k)
        assert torch.equal(batch[node], single[0]), f"node {node}"
