"""One decoder layer of the Llama / Qwen2 model on one TP rank: self-attention (fused QKV, tree
attention with RoPE, o_proj), the SwiGLU MLP and the pre-norm layer around them, with each linear
layer's weight format (float, int8, GGUF blocks) chosen from the checkpoint's tensor types. The
whole model: :mod:`swiftspec.model_executor.models.llama`.
"""
from __future__ import annotations

import torch
from torch import nn

from swiftspec import ops
from swiftspec.distributed.parallel import TPContext
from swiftspec.model_executor.layers.gguf import block_index
from swiftspec.model_executor.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    block_split,
)
from swiftspec.model_executor.layers.norm import RMSNorm
from swiftspec.model_executor.models.config import ModelConfig
from swiftspec.ops import quant


def gguf_types(native: dict[str, int] | None, names: list[str]) -> list[int] | None:
    """The ggml types of a layer's checkpoint tensors ``names`` if all are GGUF blocks with a
    kernel (the layer then keeps them as they are), else None (float weights)."""
    if not native:
        return None
    types = [native.get(n) for n in names]
    return types if all(t is not None and quant.has_kernel(t) for t in types) else None


class Attention(nn.Module):
    """Self-attention of one decoder layer on this TP rank: the fused q/k/v projection (its local
    query and KV heads, :func:`~swiftspec.model_executor.layers.linear.gqa_head_layout`), tree
    attention with RoPE fused over the KV cache (:func:`swiftspec.ops.tree_attention`) and the
    row-parallel o_proj. ``native`` maps weight names to ggml types kept as GGUF blocks; o_proj at
    TP > 1 falls back to float (listed in ``unsplit``) where its input columns are not whole blocks."""

    def __init__(self, cfg: ModelConfig, tp: TPContext, dtype: torch.dtype, prefix: str = "",
                 native: dict[str, int] | None = None, int8: bool = False):
        super().__init__()
        qkv = gguf_types(native, [f"{prefix}.{p}_proj.weight" for p in "qkv"])
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads,
                                          bias=cfg.attention_bias, tp=tp, dtype=dtype, gguf_types=qkv, int8=int8)
        # o_proj's local input columns follow the (possibly padded) local query heads; at TP > 1 its
        # blocks stay only where those are whole blocks (else float, listed in `unsplit`)
        o = gguf_types(native, [f"{prefix}.o_proj.weight"])
        self.unsplit: list[str] = []
        if o and tp.size > 1 and block_index(self.qkv_proj.q_index, quant.block_values(o[0])) is None:
            o, self.unsplit = None, [f"{prefix}.o_proj"]
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False, tp=tp,
                                        dtype=dtype, in_index=self.qkv_proj.q_index, gguf_types=o, int8=int8)
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim ** -0.5

    def forward(self, x, positions, rope, slots, mask, kv, kv_len=None):
        """``x`` ``[n, hidden]`` at int64 ``positions`` ``[n]`` -> ``[n, hidden]`` in ``x``'s dtype; the
        new keys/values are written to int64 ``slots`` ``[n]`` of ``kv`` and each row attends to the
        cached keys bool ``mask`` ``[n, S]`` allows (``rope``: the cos/sin tables; ``kv_len``: see
        :meth:`~swiftspec.model_executor.models.llama.LlamaForCausalLM.forward`)."""
        n = x.shape[0]
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        o = ops.tree_attention(q, k, v, kv.k, kv.v, slots, positions, rope.cos, rope.sin, mask, self.scale, kv.pos,
                               kv.workspace, kv_len)
        return self.o_proj(o)


class MLP(nn.Module):
    """The SwiGLU MLP of one decoder layer on this TP rank: merged gate/up projection (column
    parallel) and down_proj (row parallel). At TP > 1 with down_proj on GGUF blocks, the
    intermediate features split into whole blocks of its type (:func:`~swiftspec.model_executor.layers.linear.block_split`); where that is
    impossible down_proj falls back to float (listed in ``unsplit``)."""

    def __init__(self, cfg: ModelConfig, tp: TPContext, dtype: torch.dtype, prefix: str = "",
                 native: dict[str, int] | None = None, int8: bool = False):
        super().__init__()
        gate_up = gguf_types(native, [f"{prefix}.gate_proj.weight", f"{prefix}.up_proj.weight"])
        down = gguf_types(native, [f"{prefix}.down_proj.weight"])
        # at TP > 1 with down_proj on blocks, gate/up rows and down_proj's input features split
        # alike into whole blocks of down_proj's type (no padding); else the even padded split
        split, self.unsplit = None, []
        if down and tp.size > 1:
            split = block_split(cfg.intermediate_size, tp, quant.block_values(down[0]))
            if split is None:
                down, self.unsplit = None, [f"{prefix}.down_proj"]
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, tp=tp,
                                                       dtype=dtype, gguf_types=gate_up,
                                                       part_index=None if split is None else [split, split], int8=int8)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, tp=tp, dtype=dtype,
                                           in_index=split, gguf_types=down, int8=int8)

    def forward(self, x):
        """``x`` ``[n, hidden]`` -> ``down(SiLU(gate(x)) * up(x))`` ``[n, hidden]`` in ``x``'s dtype: GGUF
        blocks sum in float32 and round once; float weights use the fused SwiGLU; int8 weights the
        quantized matmul then SiLU * up."""
        gate_up = self.gate_up_proj
        if gate_up.native is not None:  # fp32 sums, SiLU * up in fp32, one rounding
            return self.down_proj(ops.silu_and_mul(gate_up.native.matmul(x), x.dtype))
        if gate_up.weight is not None and gate_up.bias is None:  # float weights: the fused SwiGLU
            return self.down_proj(ops.swiglu(x, gate_up.weight))
        return self.down_proj(ops.silu_and_mul(gate_up(x)))  # int8 weights: quantized matmul, then SwiGLU


class DecoderLayer(nn.Module):
    """One pre-norm decoder layer: RMSNorm, :class:`Attention`, RMSNorm, :class:`MLP`, with the
    residual stream carried between layers. Where every linear layer is on GGUF blocks and the CPU
    twin runs, :meth:`forward` runs the layer as one C++ call (two at TP > 1, each followed by its
    all-reduce)."""

    def __init__(self, cfg: ModelConfig, tp: TPContext, dtype: torch.dtype, prefix: str = "",
                 native: dict[str, int] | None = None, int8: bool = False):
        super().__init__()
        self.self_attn = Attention(cfg, tp, dtype, f"{prefix}.self_attn", native, int8)
        self.mlp = MLP(cfg, tp, dtype, f"{prefix}.mlp", native, int8)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        attn, mlp = self.self_attn, self.mlp
        # every linear layer on GGUF blocks: the CPU runs the layer as one C++ call (built on first
        # use); at TP > 1 as two, each followed by its all-reduce
        self.all_native = all(lin.native is not None for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj,
                                                                  mlp.down_proj))
        self.tp = tp
        self._native_layer = None

    def forward(self, x, residual, positions, rope, slots, mask, kv, kv_len=None):
        """``x [n, hidden]`` (and the residual stream, None before the first layer) -> ``(out, x +
        residual)``; keys/values land in ``slots`` of ``kv = (k, v, slot positions or None)``;
        ``kv_len``: see :meth:`~swiftspec.model_executor.models.llama.LlamaForCausalLM.forward`."""
        if not (self.all_native and ops.native_layer_twin(x)):
            return self.forward_modules(x, residual, positions, rope, slots, mask, kv, kv_len)
        layer = self.native_layer()
        args = (kv[0], kv[1], slots, positions, rope.cos, rope.sin, mask, kv[2])
        if self.tp.size == 1:
            return layer.forward(x, residual, *args)
        # the rows' float32 partial sums, summed in rank order, rounded once (as RowParallelLinear)
        o, residual = layer.attention(x, residual, *args)
        out, residual = layer.mlp(self.tp.all_reduce(o).to(x.dtype), residual)
        return self.tp.all_reduce(out).to(x.dtype), residual

    def native_layer(self):
        """The C++ layer over this layer's weights (:func:`swiftspec.ops.native_decoder_layer`). It
        references the parameters, so weights loaded in place later are seen; made once."""
        if self._native_layer is None:
            attn, mlp = self.self_attn, self.mlp
            self._native_layer = ops.native_decoder_layer(
                self.input_layernorm.weight, self.post_attention_layernorm.weight, self.input_layernorm.eps,
                attn.qkv_proj.native, attn.qkv_proj.bias, attn.o_proj.native, mlp.gate_up_proj.native,
                mlp.down_proj.native, attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scale)
        return self._native_layer

    def forward_modules(self, x, residual, positions, rope, slots, mask, kv, kv_len=None):
        """The same layer module by module (the reference of the C++ layer, and every other case)."""
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, positions, rope, slots, mask, kv, kv_len)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual
