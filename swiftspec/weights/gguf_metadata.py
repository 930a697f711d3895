"""GGUF metadata -> the Hugging Face ``config.json`` / ``generation_config.json`` of a
``llama`` / ``qwen2`` model: reading the key/values, the model's sizes, RoPE scaling and special
tokens, and the shapes every per-layer tensor must have.

References read (not copied): llama.cpp's GGUF key names and transformers'
``modeling_gguf_pytorch_utils.py`` (metadata to config mapping).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from swiftspec.weights.gguf_rope import infer_llama3_rope_scaling
from swiftspec.weights.model_cache import TORCH_DTYPE_NAME, ModelLoadError

SUPPORTED_ARCHS = ("llama", "qwen2")


def read_metadata(reader) -> dict:
    """GGUF key/values as Python values; the tokenizer's big arrays are left out (not needed)."""
    from gguf import GGUFValueType

    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and key not in (
            "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.padding_token_id",
            "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id", "tokenizer.ggml.model",
        ):
            continue
        if not field.types:
            continue
        if field.types[0] == GGUFValueType.ARRAY and len(field.data) > 4096:
            continue
        try:
            meta[key] = field.contents()
        except Exception:  # an exotic value type we do not need must not stop the conversion
            continue
    return meta


def _f32(value) -> float:
    """GGUF stores these floats as float32: 1e-6 reads back as 9.99999997e-07.  Use the
    shortest decimal that round-trips through float32, which is what the HF config said."""
    return float(str(np.float32(value)))


def hf_shape(tensor) -> tuple[int, ...]:
    """A GGUF reader tensor's shape in PyTorch order (``[out, in]`` for a weight): GGUF lists dims
    fastest-varying first (ggml "ne"), PyTorch slowest first."""
    return tuple(int(d) for d in reversed(tensor.shape.tolist()))


def check_arch(meta: dict) -> str:
    """The GGUF's ``general.architecture`` (``"llama"`` or ``"qwen2"``).

    Raises:
        ModelLoadError: another architecture, or a split (multi-file) GGUF.
    """
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ModelLoadError(
            f"GGUF architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHS)}"
        )
    if int(meta.get("split.count", 1) or 1) > 1:
        raise ModelLoadError("split GGUF files are not supported; merge them with llama-gguf-split --merge first")
    return arch


def _arch_value(meta: dict, arch: str, key: str, default=None, required: bool = False):
    """``meta["<arch>.<key>"]``, or ``default`` when absent.

    Raises:
        ModelLoadError: the key is absent and ``required``.
    """
    full = f"{arch}.{key}"
    if full not in meta:
        if required:
            raise ModelLoadError(f"GGUF metadata lacks {full}")
        return default
    return meta[full]


def _single(arch: str, key: str, value):
    """One value from a metadata entry that some files store per layer (e.g. ``head_count_kv``).

    Raises:
        ModelLoadError: a per-layer list that is empty or whose values differ (our models need one).
    """
    if isinstance(value, list):
        if not value or len(set(value)) != 1:
            raise ModelLoadError(f"GGUF {arch}.{key} varies per layer ({value}); not supported")
        return value[0]
    return value


@dataclass(frozen=True)
class ModelDims:
    """The model's sizes read from GGUF metadata: widths in elements, ``eps`` and ``theta`` as in
    the HF config, ``ctx`` in tokens."""

    hidden: int
    n_layers: int
    n_heads: int
    n_kv: int
    ffn: int
    head_dim: int
    vocab: int
    eps: float
    theta: float
    ctx: int


def read_dims(meta: dict, arch: str, tensors: dict) -> ModelDims:
    """The model's sizes from the ``<arch>.*`` metadata; ``vocab`` = rows of ``token_embd.weight``
    (``tensors``: GGUF name -> reader tensor).

    Raises:
        ModelLoadError: a required key is missing, a per-layer value varies, key and value head
            widths differ, partial RoPE, or no ``token_embd.weight``.
    """
    def get(key, default=None, required=False):
        return _arch_value(meta, arch, key, default, required)

    hidden = int(get("embedding_length", required=True))
    n_layers = int(get("block_count", required=True))
    n_heads = int(_single(arch, "attention.head_count", get("attention.head_count", required=True)))
    n_kv = int(_single(arch, "attention.head_count_kv", get("attention.head_count_kv", n_heads)))
    ffn = int(_single(arch, "feed_forward_length", get("feed_forward_length", required=True)))
    eps = _f32(get("attention.layer_norm_rms_epsilon", 1e-6))
    theta = _f32(get("rope.freq_base", 10000.0))
    ctx = int(get("context_length", 4096))
    key_len = get("attention.key_length")
    val_len = get("attention.value_length")
    rot_dim = get("rope.dimension_count")
    head_dim = int(key_len or rot_dim or hidden // n_heads)
    if val_len is not None and int(val_len) != head_dim:
        raise ModelLoadError(f"key_length {head_dim} != value_length {val_len}: not supported")
    if rot_dim is not None and int(rot_dim) != head_dim:
        raise ModelLoadError(f"partial RoPE (rope.dimension_count {rot_dim} < head_dim {head_dim}) is not supported")
    if "token_embd.weight" not in tensors:
        raise ModelLoadError("GGUF has no token_embd.weight")
    vocab = hf_shape(tensors["token_embd.weight"])[0]
    return ModelDims(hidden, n_layers, n_heads, n_kv, ffn, head_dim, vocab, eps, theta, ctx)


def read_rope_scaling(meta: dict, arch: str, dims: ModelDims,
                      rope_freqs: Callable[[], np.ndarray] | None) -> dict | None:
    """HF's ``rope_scaling`` from the ``rope.scaling.*`` / ``rope.scale_linear`` metadata (linear,
    yarn), or recovered from the GGUF's ``rope_freqs`` tensor (llama3,
    :func:`infer_llama3_rope_scaling`); None without scaling. ``rope_freqs``: None when the GGUF
    has no such tensor, else a loader of its float32 ``[head_dim / 2]`` factors (called only
    when the metadata names no other scaling).

    Raises:
        ModelLoadError: an unsupported scaling type, both metadata and a ``rope_freqs`` tensor, or
            a ``rope_freqs`` tensor that matches no llama3 scaling.
    """
    def get(key, default=None):
        return _arch_value(meta, arch, key, default)

    scaling = None
    scaling_type = get("rope.scaling.type")
    if scaling_type in ("linear", "yarn"):
        scaling = {"rope_type": scaling_type, "factor": _f32(get("rope.scaling.factor", 1.0))}
        if scaling_type == "yarn":
            orig = get("rope.scaling.original_context_length")
            if orig is not None:
                scaling["original_max_position_embeddings"] = int(orig)
    elif scaling_type not in (None, "none"):
        raise ModelLoadError(f"RoPE scaling type {scaling_type!r} is not supported")
    elif get("rope.scale_linear") is not None and float(get("rope.scale_linear")) != 1.0:
        scaling = {"rope_type": "linear", "factor": _f32(get("rope.scale_linear"))}
    if rope_freqs is not None:
        if scaling is not None:
            raise ModelLoadError("GGUF has both rope scaling metadata and a rope_freqs tensor")
        inferred = infer_llama3_rope_scaling(rope_freqs(), dims.theta, dims.head_dim)
        scaling = inferred or None
    return scaling


def token_ids(meta: dict) -> dict[str, int]:
    """The special token ids the GGUF names (``bos_token_id``, ``eos_token_id``,
    ``padding_token_id``, ``eot_token_id``, ``eom_token_id``), keyed by those names."""
    return {
        k.rsplit(".", 1)[-1]: int(meta[f"tokenizer.ggml.{k}"])
        for k in ("bos_token_id", "eos_token_id", "padding_token_id", "eot_token_id", "eom_token_id")
        if f"tokenizer.ggml.{k}" in meta
    }


def hf_config(arch: str, meta: dict, dims: ModelDims, rope_scaling: dict | None, tied: bool,
               has_attn_bias: bool, tok_ids: dict[str, int], dtype: torch.dtype) -> dict:
    """The ``config.json`` dict transformers' ``Qwen2ForCausalLM`` / ``LlamaForCausalLM`` reads,
    with ``torch_dtype`` the output ``dtype``'s name."""
    config = {
        "architectures": ["Qwen2ForCausalLM" if arch == "qwen2" else "LlamaForCausalLM"],
        "model_type": arch,
        "hidden_size": dims.hidden,
        "intermediate_size": dims.ffn,
        "num_hidden_layers": dims.n_layers,
        "num_attention_heads": dims.n_heads,
        "num_key_value_heads": dims.n_kv,
        "head_dim": dims.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": dims.eps,
        "rope_theta": dims.theta,
        "rope_scaling": rope_scaling,
        "max_position_embeddings": dims.ctx,
        "vocab_size": dims.vocab,
        "tie_word_embeddings": tied,
        "bos_token_id": tok_ids.get("bos_token_id"),
        "eos_token_id": tok_ids.get("eos_token_id"),
        "torch_dtype": TORCH_DTYPE_NAME[dtype],
        "initializer_range": 0.02,
        "attention_dropout": 0.0,
        "use_cache": True,
    }
    if arch == "qwen2":
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=dims.n_layers)
    else:
        config.update(attention_bias=has_attn_bias, mlp_bias=False, pretraining_tp=1)
    if "general.name" in meta:
        config["_name_or_path"] = str(meta["general.name"])
    return config


def block_shapes(arch: str, dims: ModelDims, has_attn_bias: bool) -> dict[str, tuple[int, ...]]:
    """Each per-layer GGUF tensor suffix (``attn_q.weight`` ...) -> its HF shape (``[out, in]``
    for weights, ``[out]`` for norms and biases)."""
    hidden, ffn = dims.hidden, dims.ffn
    q_out, kv_out = dims.n_heads * dims.head_dim, dims.n_kv * dims.head_dim
    expected = {
        "attn_norm.weight": (hidden,),
        "ffn_norm.weight": (hidden,),
        "attn_q.weight": (q_out, hidden),
        "attn_k.weight": (kv_out, hidden),
        "attn_v.weight": (kv_out, hidden),
        "attn_output.weight": (hidden, q_out),
        "ffn_gate.weight": (ffn, hidden),
        "ffn_up.weight": (ffn, hidden),
        "ffn_down.weight": (hidden, ffn),
    }
    if has_attn_bias:
        expected.update({"attn_q.bias": (q_out,), "attn_k.bias": (kv_out,), "attn_v.bias": (kv_out,)})
        if arch == "llama":  # HF's attention_bias adds o_proj's bias too
            expected["attn_output.bias"] = (hidden,)
    return expected


def generation_config(tok_ids: dict[str, int]) -> dict:
    """``generation_config.json``'s token ids: bos, eos (eos/eot/eom deduplicated; one int or a
    list) and pad; empty when the GGUF names none."""
    gen = {}
    if "bos_token_id" in tok_ids:
        gen["bos_token_id"] = tok_ids["bos_token_id"]
    eos = [tok_ids[k] for k in ("eos_token_id", "eot_token_id", "eom_token_id") if k in tok_ids]
    eos = list(dict.fromkeys(eos))
    if eos:
        gen["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    if "padding_token_id" in tok_ids:
        gen["pad_token_id"] = tok_ids["padding_token_id"]
    return gen
