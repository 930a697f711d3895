"""Vocabulary-parallel token embedding and LM head.

Rank r holds rows ``[r*Vp, (r+1)*Vp)`` of the ``[V, hidden]`` table, where ``Vp = ceil(V / tp)``;
rows past ``V`` are zero padding so any TP degree works. The LM head computes local logits and
all-gathers them; padded logits are cut off.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from swiftspec import ops
from swiftspec.distributed.parallel import LOCAL, PAD, TPContext
from swiftspec.model_executor.layers.gguf import GGUFWeight
from swiftspec.model_executor.layers.quant import Int8Weight
from swiftspec.ops import quant


class VocabParallelEmbedding(nn.Module):
    """``[n] int64 -> [n, hidden]``; each rank looks up its rows, the group all-reduces.

    With ``gguf_type`` the table (this rank's rows of it) stays in the checkpoint's blocks
    (``self.native``, ``weight`` is None; padded rows are zero blocks) and the looked-up rows are
    dequantized.
    """

    # whether GGUF blocks may take the kernels' interleaved layout: not for a table of row lookups
    # (an embedding, also the table of a tied head); an LM head's matmul reads them (True there)
    interleave_blocks = False

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPContext = LOCAL, dtype=torch.float32,
                 gguf_type: int | None = None, float_table: bool = True):
        super().__init__()
        self.tp = tp
        self.dtype = dtype
        self.vocab_size = vocab_size
        self.shard = -(-vocab_size // tp.size)
        self.start = tp.rank * self.shard
        self.native: GGUFWeight | None = None
        if gguf_type is not None:
            rows = torch.arange(self.start, self.start + self.shard)
            self.native = GGUFWeight(hidden_size, [self.shard], [gguf_type],
                                     interleave=ops.quant_interleave_rows() if self.interleave_blocks else 0,
                                     row_index=[rows.masked_fill(rows >= vocab_size, PAD)] if tp.size > 1 else None)
            self.register_parameter("weight", None)
            return
        if not float_table:  # a head on another format (int8) that keeps no float table of its own
            self.register_parameter("weight", None)
            return
        self.weight = nn.Parameter(torch.zeros(self.shard, hidden_size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param, loaded, shard_id=None):
        """Copy this rank's rows ``[start, start + shard)`` of the full ``[vocab, hidden]`` table into
        ``param``; rows past the vocabulary stay zero."""
        n = max(0, min(self.shard, self.vocab_size - self.start))
        param.data.zero_()
        param.data[:n].copy_(loaded[self.start:self.start + n])

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.native is not None:
            return self.native.rows(ids).to(self.dtype)
        return F.embedding(ids, self.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """int64 token ids ``[n]`` -> ``[n, hidden]`` in the model's dtype; at TP > 1 each rank looks up
        the ids in its rows (zeros elsewhere) and the group all-reduces."""
        if self.tp.size == 1:
            return self._lookup(ids)
        local = ids - self.start
        outside = (local < 0) | (local >= self.shard)
        y = self._lookup(local.masked_fill(outside, 0))
        y = y.masked_fill(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(y)


class ParallelLMHead(VocabParallelEmbedding):
    """``[n, hidden] -> [n, V]`` float32 logits; shares its table with the embedding when tied.
    With ``int8`` (a draft's head on a float checkpoint) it holds an :class:`Int8Weight` instead.

    ``limit`` computes only the logits of ids ``[0, limit)`` (a draft restricted to the most
    frequent tokens, FR-Spec style: BPE vocabularies put frequent merges first), which cuts the
    LM head's weight traffic by ``V / limit``.
    """

    interleave_blocks = True

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPContext = LOCAL, dtype=torch.float32,
                 gguf_type: int | None = None, int8: bool = False):
        super().__init__(vocab_size, hidden_size, tp, dtype, gguf_type, float_table=not int8)
        # int8 (where the table is not GGUF blocks): the head multiplies int8 rows quantized as they
        # load (from the embedding's table when tied: the embedding keeps its float rows)
        self.int8: Int8Weight | None = None
        if int8 and self.native is None:
            self.int8 = Int8Weight(self.shard, hidden_size, dtype, self.weight_loader)

    def forward(self, h: torch.Tensor, limit: int | None = None) -> torch.Tensor:
        """Hidden states ``h`` ``[n, hidden]`` -> float32 logits ``[n, V]``, ``V = min(limit, vocab)``
        (``limit`` None: the whole vocabulary); at TP > 1 each rank computes its rows and the group
        all-gathers them."""
        v = self.vocab_size if limit is None else min(limit, self.vocab_size)
        n_local = max(0, min(self.shard, v - self.start))
        if self.native is not None and n_local == 0:  # a rank past the vocabulary limit
            logits = h.new_empty(h.shape[0], 0, dtype=torch.float32)
        elif self.native is not None:  # local rows [0, n_local) of the block table
            nat = self.native
            # interleaved blocks come in groups of 8 or 16 rows: compute up to the group's end, keep n_local
            g = quant.group_rows(nat.types[0])
            n = min(-(-n_local // g) * g, self.shard)
            y = ops.quant_linear(h, [nat.parts[0][:n]], nat.types, lambda: [nat.dequantized()[0][:n]])
            logits = y if n == n_local else y[:, :n_local]
        elif self.int8 is not None:
            logits = ops.int8_linear(h, self.int8.qweight[:n_local], self.int8.scales[:n_local]).float()
        else:
            # rows [0, n_local) of the row-major [shard, hidden] table: a contiguous weight
            logits = ops.linear(h, self.weight[:n_local]).float()
        if self.tp.size == 1:
            return logits
        if n_local < self.shard:  # equal shapes for the all-gather; padded ids are cut below
            logits = F.pad(logits, (0, self.shard - n_local), value=float("-inf"))
        return self.tp.all_gather_last_dim(logits)[:, :v]
