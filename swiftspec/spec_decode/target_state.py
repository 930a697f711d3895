"""The target side of one request: prefill, verification forward, walk and KV compaction.

Verify and accept halves of the loop. Invariant (SwiftSpec paper §3.1): before each verification the
target's prefix cache holds the KV of every verified token except the root, in slots
``[0, L)``; the root was sampled, never run.
"""
from __future__ import annotations

import torch

from swiftspec.model_executor.runner import Launched, RunnerHandle
from swiftspec.model_executor.sampling import Sampler
from swiftspec.spec_decode.tree import Subgraph
from swiftspec.spec_decode.verify import VerifyResult, target_head, walk


def ancestor_mask(parents: list[int], prefix_len: int) -> torch.Tensor:
    """Square tree mask over a subgraph plus the whole prefix.

    Shapes: ``parents`` ``[bs]`` (parents first, root -1); returns ``[bs, prefix_len + bs]`` bool
    where node i sees every prefix slot, its ancestors and itself.
    """
    bs = len(parents)
    m = torch.zeros(bs, prefix_len + bs, dtype=torch.bool)
    m[:, :prefix_len] = True
    tree = m[:, prefix_len:]
    for i, p in enumerate(parents):
        tree[i, i] = True
        if p >= 0:
            tree[i] |= tree[p]
    return m


class TargetState:
    """Target-model state for one request."""

    def __init__(self, runner: RunnerHandle):
        self.runner = runner
        self.prefix_len = 0
        self.root: int | None = None

    def prefill(self, prompt_ids: list[int], sampler: Sampler) -> VerifyResult:
        """Run the prompt and sample the first token (the first root): a :class:`VerifyResult`
        with that one token (and its log-probability when the request asked for them)."""
        n = len(prompt_ids)
        pos = torch.arange(n)
        mask = torch.ones(n, n, dtype=torch.bool).tril()
        logits = self.runner.forward(torch.tensor(prompt_ids), pos, pos, mask, torch.tensor([n - 1]),
                                     target_head(sampler, [0]))
        self.prefix_len = n
        res = walk([-1], [-1], logits, sampler)  # a lone node: its sample is the bonus token
        self.root = res.bonus
        return res

    def verify(self, sg: Subgraph, sampler: Sampler, max_new: int | None = None) -> VerifyResult:
        """One target forward over the subgraph, the sampling walk, and KV compaction.

        Raises:
            ValueError: the subgraph's root is not the current root, or it would overflow the cache.
        """
        return self.accept(sg, self.launch(sg, sampler), sampler, max_new)

    def launch(self, sg: Subgraph, sampler: Sampler) -> Launched:
        """The verification forward of :meth:`verify`, started (on CUDA it runs on the target's
        stream while the caller goes on; :meth:`accept` finishes it). Requests without
        log-probabilities get each row's token from the device (argmax, or sampled with the
        uniform of its position: :func:`swiftspec.spec_decode.verify.target_head`), the others the logits.
        Raises as :meth:`verify`."""
        if sg.tokens[0] != self.root:
            raise ValueError(f"subgraph root {sg.tokens[0]} is not the verified root {self.root}")
        L, bs = self.prefix_len, len(sg)
        if L + bs > self.runner.capacity:
            raise ValueError("subgraph does not fit the target KV cache")
        slots = torch.arange(L, L + bs)
        pos = torch.tensor(sg.depths) + L
        return self.runner.launch(torch.tensor(sg.tokens), pos, slots, ancestor_mask(sg.parents, L),
                                  torch.arange(bs), target_head(sampler, sg.depths))

    def accept(self, sg: Subgraph, launched: Launched, sampler: Sampler, max_new: int | None = None,
               replay: list[int | None] | None = None) -> VerifyResult:
        """The rest of :meth:`verify` once its forward (``launched``, from :meth:`launch` of the
        same ``sg``) is done: the sampling walk (``replay``: see :func:`swiftspec.spec_decode.verify.walk`)
        and the KV compaction."""
        L = self.prefix_len
        res = walk(sg.tokens, sg.parents, launched.result(), sampler, max_new, replay, sg.candidates)
        keep = [0] + res.accepted  # root + accepted nodes move to L .. L+k
        self.runner.move_kv([L + i for i in keep], list(range(L, L + len(keep))))
        self.prefix_len = L + len(keep)
        self.root = res.bonus
        return res
