"""The C++ decoder layer (``csrc/cpu/decoder_layer.cpp``): whether a layer on GGUF blocks runs as
one call (:func:`native_layer_twin`), the layer object over its weights and every layer of a
model in one call.
"""
from __future__ import annotations

import torch

from swiftspec.ops import dispatch


def native_layer_twin(x: torch.Tensor) -> bool:
    """Whether a decoder layer whose linear layers are all GGUF blocks runs as one C++ call
    (:func:`native_decoder_layer`) for activations ``x``: exactly when each of its ops would take its
    CPU twin (quantized GEMM, RMSNorm, tree attention), so the one call is bit-identical to the
    module-by-module path."""
    return (dispatch.backend(x) == "cpu" and dispatch.cpu_twin("rms_norm") and dispatch.cpu_twin("tree_attention") and x.dim() == 2
            and x.dtype in (torch.float32, torch.bfloat16) and x.shape[-1] <= 8192 and not torch.is_grad_enabled())


def native_decoder_layer(ln1: torch.Tensor, ln2: torch.Tensor, eps: float, qkv, qkv_bias: torch.Tensor | None,
                         o, gate_up, down, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
    """The C++ decoder layer (``csrc/cpu/decoder_layer.cpp``) over these weights: RMSNorm, QKV
    (+ bias), tree attention, o_proj, RMSNorm, gate/up, SiLU * up, down, in one call per step.

    ``qkv``, ``o``, ``gate_up``, ``down``: :class:`swiftspec.model_executor.layers.gguf.GGUFWeight` (their parts
    are referenced, not copied). Its ``forward(x [n, H], residual [n, H] | None, k_cache, v_cache,
    slots, positions, cos_table, sin_table, mask, slot_positions=None)`` returns ``(out, x + residual)``
    in x's dtype (``slot_positions``: see :func:`swiftspec.ops.tree_attention`); at TP > 1 its two halves,
    ``attention`` (same arguments) and ``mlp(o, residual)``, return o_proj's and down_proj's float32
    partial sums for the caller to all-reduce and round.
    Use it only where :func:`native_layer_twin` holds. Raises RuntimeError on inconsistent shapes.
    """
    blocks = []
    for w in (qkv, o, gate_up, down):
        blocks += [list(w.parts), list(w.types)]
    return dispatch.cpu_module().NativeDecoderLayer(ln1, ln2, float(eps), blocks[0], blocks[1], qkv_bias, *blocks[2:],
                                            num_heads, num_kv_heads, head_dim, float(scale))


def native_layers_forward(layers: list, x: torch.Tensor, residual: torch.Tensor | None, kv_buf: torch.Tensor,
                          slots: torch.Tensor, positions: torch.Tensor, cos_table: torch.Tensor,
                          sin_table: torch.Tensor, mask: torch.Tensor, slot_positions: torch.Tensor | None):
    """Every decoder layer in one C++ call (``csrc/cpu/decoder_layer.cpp``, ``forward_layers``):
    ``layers`` are :func:`native_decoder_layer` objects in order, layer ``j`` reading and writing
    its keys and values at ``kv_buf[j]`` (``[len(layers), 2, kv_heads, capacity, head_dim]``, a
    :class:`~swiftspec.model_executor.models.kv_cache.KVCache`'s buffer); the other arguments as each layer's
    ``forward``. Returns ``(out, x + residual)`` after the last layer, bit-identical to calling
    the layers one by one (it saves the interpreter between them). Use it only where
    :func:`native_layer_twin` holds. Raises RuntimeError on inconsistent shapes."""
    return dispatch.cpu_module().native_layers_forward(layers, x, residual, kv_buf, slots, positions, cos_table, sin_table,
                                               mask, slot_positions)

