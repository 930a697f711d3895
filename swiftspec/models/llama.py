"""Llama and Qwen2 decoder (DESIGN.md §5): RMSNorm, RoPE, GQA, SwiGLU, optional QKV bias,
tied embeddings, tensor parallel (nano-vllm layout).

The model knows nothing of trees, processes or scheduling: ``forward`` takes token ids,
positions, the KV-cache slots to write and the attention mask, and returns hidden states;
``compute_logits`` turns selected rows into float32 logits over the whole vocabulary.
"""
from __future__ import annotations

import glob
import os
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from swiftspec import ops
from swiftspec.layers.activation import silu_and_mul
from swiftspec.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from swiftspec.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from swiftspec.layers.norm import RMSNorm
from swiftspec.layers.rotary import RotaryEmbedding
from swiftspec.models.config import ModelConfig
from swiftspec.models.kv_cache import KVCache
from swiftspec.parallel import LOCAL, TPContext


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPContext, dtype: torch.dtype):
        super().__init__()
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads,
                                          bias=cfg.attention_bias, tp=tp, dtype=dtype)
        # o_proj's local input columns follow the (possibly padded) local query heads
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False, tp=tp,
                                        dtype=dtype, in_index=self.qkv_proj.q_index)
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim ** -0.5

    def forward(self, x, positions, rope, slots, mask, kv):
        n = x.shape[0]
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        o = ops.tree_attention(q, k, v, kv[0], kv[1], slots, positions, rope.cos, rope.sin, mask, self.scale)
        return self.o_proj(o)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPContext, dtype: torch.dtype):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, tp=tp,
                                                       dtype=dtype)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, tp=tp, dtype=dtype)

    def forward(self, x):
        gate_up = self.gate_up_proj
        w = getattr(gate_up, "weight", None)  # None once quantized to int8
        if w is not None and gate_up.bias is None:
            return self.down_proj(ops.swiglu(x, w))
        return self.down_proj(silu_and_mul(gate_up(x)))  # int8 weights: quantized matmul, then SwiGLU


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPContext, dtype: torch.dtype):
        super().__init__()
        self.self_attn = Attention(cfg, tp, dtype)
        self.mlp = MLP(cfg, tp, dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, x, residual, positions, rope, slots, mask, kv):
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, positions, rope, slots, mask, kv)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


# checkpoint name fragment -> (our parameter name fragment, shard id)
_STACKED = {
    "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


class LlamaForCausalLM(nn.Module):
    """The whole decoder for one TP rank.

    Args:
        cfg: model shape.
        tp: this rank's TP context (LOCAL for one process).
        dtype: weight and activation dtype (torch.float32 or torch.bfloat16).
        max_positions: size of the RoPE tables; positions must stay below it.

    Any TP degree works: heads and the intermediate size are zero-padded where the degree does
    not divide them (see :func:`swiftspec.layers.linear.gqa_head_layout`), with the same output.

    Raises:
        ValueError: the query head count is not a multiple of the key/value head count.
    """

    def __init__(self, cfg: ModelConfig, tp: TPContext = LOCAL, dtype: torch.dtype = torch.float32,
                 max_positions: int | None = None):
        super().__init__()
        self.cfg, self.tp, self.dtype = cfg, tp, dtype
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, tp, dtype) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.rope = RotaryEmbedding(cfg.head_dim, max_positions or cfg.max_position_embeddings,
                                    cfg.rope_theta, cfg.rope_scaling)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp, dtype)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @property
    def num_kv_heads_local(self) -> int:
        """KV heads this rank stores (padded / replicated ones included): the KV cache's dim 2."""
        return self.layers[0].self_attn.num_kv_heads

    def make_kv_cache(self, capacity: int) -> KVCache:
        """A zeroed KV cache for this rank with ``capacity`` token slots."""
        return KVCache(self.cfg.num_layers, self.num_kv_heads_local, self.cfg.head_dim, capacity, self.dtype)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                mask: torch.Tensor, kv: KVCache) -> torch.Tensor:
        """Run ``n`` tokens; their keys/values land in ``slots`` of ``kv``.

        Shapes: input_ids, positions, slots ``[n]`` int64; mask ``[n, S]`` bool (query i may see
        slot j). Returns hidden states ``[n, hidden]`` in the model dtype.
        """
        x = self.embed_tokens(input_ids)
        residual = None
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, positions, self.rope, slots, mask, kv.layer(i))
        x, _ = self.norm(x, residual)
        return x

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, vocab_limit: int | None = None) -> torch.Tensor:
        """``[m, hidden] -> [m, vocab]`` float32 logits (all-gathered over the TP group);
        with ``vocab_limit`` only ids ``[0, vocab_limit)``."""
        return self.lm_head(hidden, vocab_limit)

    def quantize_int8_(self) -> None:
        """Int8 weight-only quantization of every linear layer and the LM head (draft models)."""
        from swiftspec.layers.linear import LinearBase

        for mod in self.modules():
            if isinstance(mod, LinearBase):
                mod.quantize_int8_()
        self.lm_head.quantize_int8_(keep_float=self.cfg.tie_word_embeddings)

    def load_weights(self, weights) -> None:
        """Copy ``(hf_name, full_tensor)`` pairs into this rank's shards.

        Raises:
            KeyError: a checkpoint tensor has no matching parameter, or a parameter got no weight.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            name = name.removeprefix("model.")
            if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
                continue
            shard_id = None
            for frag, (ours, sid) in _STACKED.items():
                if f".{frag}." in name:
                    name, shard_id = name.replace(frag, ours), sid
                    break
            if name not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no parameter in the model")
            param = params[name]
            loader = getattr(param, "weight_loader", None)
            tensor = tensor.to(param.dtype)
            if loader is None:
                param.data.copy_(tensor)
            else:
                loader(param, tensor, shard_id)
            loaded.add(name)
        expected = {n for n in params if not (self.cfg.tie_word_embeddings and n == "lm_head.weight")}
        missing = sorted(expected - loaded)
        if missing:
            raise KeyError(f"checkpoint has no weight for {len(missing)} parameters, e.g. {missing[:4]}")


def iter_safetensors(model_dir: str | Path):
    """Yield ``(name, tensor)`` for every tensor of every ``*.safetensors`` file in ``model_dir``."""
    files = sorted(glob.glob(os.path.join(str(model_dir), "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    for f in files:
        with safe_open(f, framework="pt") as st:
            for name in st.keys():
                yield name, st.get_tensor(name)


def load_model(model_dir: str | Path, tp: TPContext = LOCAL, dtype: torch.dtype = torch.float32,
               max_positions: int | None = None) -> LlamaForCausalLM:
    """Build the model described by ``model_dir/config.json`` and load this rank's weight shards.

    Raises:
        ModelConfigError: unsupported or broken config.json.
        FileNotFoundError: no safetensors files.
        KeyError: checkpoint and model disagree on parameter names.
    """
    cfg = ModelConfig.from_dir(model_dir)
    with torch.device("cpu"):
        model = LlamaForCausalLM(cfg, tp, dtype, max_positions)
    model.load_weights(iter_safetensors(model_dir))
    return model.eval()
