"""GGUF -> Hugging Face style directory (the engine's one model format).

:func:`convert_gguf` turns a ``llama``/``qwen2`` GGUF file into ``config.json``, float
safetensors (every tensor dequantized by the ``gguf`` library), the tokenizer built by
transformers from the GGUF's metadata, and ``native/blocks.safetensors``: the weights' blocks as
they are in the file, for the quantized kernels (``weights="native"``).

References read (not copied): llama.cpp ``convert_hf_to_gguf.py`` (the q/k permutation, the
``rope_freqs`` tensor for llama3 RoPE scaling, GGUF key names) and transformers'
``modeling_gguf_pytorch_utils.py`` / ``integrations/ggml.py`` / ``integrations/gguf`` (metadata
to config mapping, the reverse permutation, building a tokenizer from GGUF metadata).
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from swiftspec.weights.model_cache import (
    NATIVE_FILE,
    TORCH_DTYPE_NAME,
    TORCH_TO_ST_DTYPE,
    ModelLoadError,
    TensorPlan,
    build_model_dir,
    source_fingerprint,
    write_float_weights,
)

_SUPPORTED_ARCHS = ("llama", "qwen2")

_BLOCK_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}

# Consumed into config.json (llama3 RoPE scaling) rather than written as a weight.
_ROPE_FREQS = "rope_freqs.weight"


def _read_metadata(reader) -> dict:
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


def _hf_shape(tensor) -> tuple[int, ...]:
    # GGUF lists dims fastest-varying first (ggml "ne"); PyTorch lists them slowest first.
    return tuple(int(d) for d in reversed(tensor.shape.tolist()))


def _unpermute_rope(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (``convert_hf_to_gguf.py`` ``LlamaModel.permute``).

    llama.cpp regroups each head's rows from HF's rotate_half layout (first half / second half of
    the head) into interleaved pairs for its GPT-J style RoPE; this restores the HF layout.  Works
    for weights ``[n_head*head_dim, in]`` and biases ``[n_head*head_dim]``.
    """
    shape = w.shape
    half = shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *shape[1:]).transpose(1, 2).reshape(shape)


def _permute_rope(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's permutation (HF -> GGUF layout); the inverse of :func:`_unpermute_rope`."""
    shape = w.shape
    half = shape[0] // n_head // 2
    return w.reshape(n_head, 2, half, *shape[1:]).transpose(1, 2).reshape(shape)


def _llama3_rope_factors(base: float, dim: int, factor: float, low: float, high: float, ctx: int) -> np.ndarray:
    # Same formula as llama.cpp's converter and transformers' _compute_llama3_parameters.
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    wavelen = 2 * np.pi / freqs
    smooth = (ctx / wavelen - low) / (high - low)
    out = 1.0 / ((1 - smooth) / factor + smooth)
    out = np.where(wavelen < ctx / high, 1.0, out)
    out = np.where(wavelen > ctx / low, factor, out)
    return out


def _infer_llama3_rope_scaling(rope_freqs: np.ndarray, base: float, dim: int) -> dict:
    """Recover HF's ``rope_scaling`` (rope_type llama3) from llama.cpp's ``rope_freqs`` tensor.

    GGUF keeps only the per-frequency factors, not the parameters that made them.  In the smooth
    band, ``s = (1/f - 1/factor) / (1 - 1/factor)`` is linear in ``1/wavelen`` with slope
    ``ctx/(high-low)`` and intercept ``-low/(high-low)``, and the band edges follow from the same
    two numbers, so any (ctx, low, high) on that line gives identical HF inverse frequencies.
    Prefer Llama 3's own values (ctx 8192, low 1, high 4) when they fit; every candidate is
    verified by recomputing the factors.
    """
    f = np.asarray(rope_freqs, dtype=np.float64).reshape(-1)
    if f.shape[0] != dim // 2:
        raise ModelLoadError(f"rope_freqs has {f.shape[0]} entries, expected head_dim/2 = {dim // 2}")
    if np.allclose(f, 1.0):
        return {}
    factor = float(np.float32(f.max()))
    wavelen = 2 * np.pi * base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    tol = 1e-5
    ones, full = np.abs(f - 1) < tol, np.abs(f - factor) < tol * factor
    band = ~ones & ~full
    s = (1 / f[band] - 1 / factor) / (1 - 1 / factor)
    pairs = [(1.0, 4.0), (1.0, 2.0), (1.0, 8.0), (0.5, 4.0), (2.0, 8.0)]
    ctx_pref = [8192, 4096, 16384, 32768, 2048, 65536, 131072, 1024]

    candidates: list[tuple[float, float, float]] = []
    if band.sum() >= 2:
        slope, icept = np.polyfit(1 / wavelen[band], s, 1)
        for ctx in ctx_pref:
            low = -icept * ctx / slope
            candidates.append((ctx, low, low + ctx / slope))
        # The ctx that makes low exactly 1, Llama 3's value.
        ctx = -slope / icept if icept < 0 else 8192.0
        candidates.append((ctx, -icept * ctx / slope, -icept * ctx / slope + ctx / slope))
    else:
        for low, high in pairs:
            if band.any():  # one point in the band fixes ctx
                ctx = float(wavelen[band][0] * (s[0] * (high - low) + low))
                candidates.append((ctx, low, high))
            else:  # a step: any ctx putting the edges between the two groups fits
                lo_ctx = high * wavelen[ones].max() if ones.any() else 0.0
                hi_ctx = low * wavelen[full].min() if full.any() else np.inf
                for ctx in ctx_pref:
                    if lo_ctx < ctx < hi_ctx:
                        candidates.append((ctx, low, high))
                if np.isfinite(hi_ctx) and lo_ctx < hi_ctx:
                    candidates.append(((lo_ctx + hi_ctx) / 2, low, high))

    def nice(x: float) -> float:
        r = round(x * 4) / 4  # factors in the wild are multiples of 1/4
        return r if abs(r - x) < 1e-6 * max(1.0, abs(x)) else x

    def rank(c: tuple[float, float, float]) -> tuple[bool, bool]:
        return nice(c[1]) != c[1] or nice(c[2]) != c[2], nice(c[1]) != 1.0

    for ctx, low, high in sorted(candidates, key=rank):  # stable: ctx_pref order within a rank
        low, high = nice(low), nice(high)
        ctx = int(round(ctx)) if abs(ctx - round(ctx)) < 1e-6 * ctx else ctx
        if not (0 < low < high):
            continue
        ref = _llama3_rope_factors(base, dim, factor, low, high, ctx)
        if np.allclose(ref, f, rtol=1e-4, atol=1e-5):
            return {
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low,
                "high_freq_factor": high,
                "original_max_position_embeddings": ctx,
            }
    raise ModelLoadError(
        "GGUF has a rope_freqs tensor that matches no llama3 RoPE scaling; "
        "convert the model from its HF checkpoint instead"
    )


@dataclass
class _Plan(TensorPlan):
    """One output tensor (:class:`~swiftspec.weights.model_cache.TensorPlan`) and the GGUF tensor it
    comes from."""

    gguf: object = None  # the GGUF tensor it comes from (None: made up, e.g. a zero bias)
    n_head: int | None = None  # llama q/k: rows to un-permute


def _dequantize(tensor) -> torch.Tensor:
    from gguf.quants import dequantize

    try:
        arr = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as exc:
        raise ModelLoadError(f"cannot dequantize {tensor.name} ({tensor.tensor_type.name}): {exc}") from exc
    arr = np.asarray(arr, dtype=np.float32).reshape(_hf_shape(tensor))
    if not arr.flags.writeable or not arr.flags.c_contiguous:
        # F32 tensors come back as a view of the read-only memmap.
        arr = np.array(arr, dtype=np.float32, order="C")
    return torch.from_numpy(arr)


def _check_arch(meta: dict) -> str:
    """The GGUF's ``general.architecture`` (``"llama"`` or ``"qwen2"``).

    Raises:
        ModelLoadError: another architecture, or a split (multi-file) GGUF.
    """
    arch = meta.get("general.architecture")
    if arch not in _SUPPORTED_ARCHS:
        raise ModelLoadError(
            f"GGUF architecture {arch!r} is not supported; supported: {', '.join(_SUPPORTED_ARCHS)}"
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
class _Dims:
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


def _read_dims(meta: dict, arch: str, tensors: dict) -> _Dims:
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
    vocab = _hf_shape(tensors["token_embd.weight"])[0]
    return _Dims(hidden, n_layers, n_heads, n_kv, ffn, head_dim, vocab, eps, theta, ctx)


def _rope_scaling(meta: dict, arch: str, tensors: dict, dims: _Dims) -> dict | None:
    """HF's ``rope_scaling`` from the ``rope.scaling.*`` / ``rope.scale_linear`` metadata (linear,
    yarn), or recovered from a ``rope_freqs`` tensor (llama3, :func:`_infer_llama3_rope_scaling`);
    None without scaling.

    Raises:
        ModelLoadError: an unsupported scaling type, both metadata and a ``rope_freqs`` tensor, or
            a ``rope_freqs`` tensor that matches no llama3 scaling.
    """
    def get(key, default=None):
        return _arch_value(meta, arch, key, default)

    rope_scaling = None
    scaling_type = get("rope.scaling.type")
    if scaling_type in ("linear", "yarn"):
        rope_scaling = {"rope_type": scaling_type, "factor": _f32(get("rope.scaling.factor", 1.0))}
        if scaling_type == "yarn":
            orig = get("rope.scaling.original_context_length")
            if orig is not None:
                rope_scaling["original_max_position_embeddings"] = int(orig)
    elif scaling_type not in (None, "none"):
        raise ModelLoadError(f"RoPE scaling type {scaling_type!r} is not supported")
    elif get("rope.scale_linear") is not None and float(get("rope.scale_linear")) != 1.0:
        rope_scaling = {"rope_type": "linear", "factor": _f32(get("rope.scale_linear"))}
    if _ROPE_FREQS in tensors:
        if rope_scaling is not None:
            raise ModelLoadError("GGUF has both rope scaling metadata and a rope_freqs tensor")
        inferred = _infer_llama3_rope_scaling(_dequantize(tensors[_ROPE_FREQS]).numpy(), dims.theta, dims.head_dim)
        rope_scaling = inferred or None
    return rope_scaling


def _token_ids(meta: dict) -> dict[str, int]:
    """The special token ids the GGUF names (``bos_token_id``, ``eos_token_id``,
    ``padding_token_id``, ``eot_token_id``, ``eom_token_id``), keyed by those names."""
    return {
        k.rsplit(".", 1)[-1]: int(meta[f"tokenizer.ggml.{k}"])
        for k in ("bos_token_id", "eos_token_id", "padding_token_id", "eot_token_id", "eom_token_id")
        if f"tokenizer.ggml.{k}" in meta
    }


def _hf_config(arch: str, meta: dict, dims: _Dims, rope_scaling: dict | None, tied: bool,
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


def _block_shapes(arch: str, dims: _Dims, has_attn_bias: bool) -> dict[str, tuple[int, ...]]:
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


def _from_gguf(t, n_head: int | None) -> Callable[[], torch.Tensor]:
    """A loader of GGUF tensor ``t`` as float32 in HF shape, q/k rows un-permuted over ``n_head``
    heads when given."""
    if n_head is None:
        return lambda: _dequantize(t)
    return lambda: _unpermute_rope(_dequantize(t), n_head)


def _tensor_plans(arch: str, tensors: dict, dims: _Dims, expected: dict[str, tuple[int, ...]],
                  tied: bool) -> list[_Plan]:
    """One :class:`_Plan` per HF tensor, in HF order (embedding, layers, norm, ``lm_head`` unless
    ``tied``); a missing bias becomes zeros (same as no bias, keeps the module layout the config
    promises).  ``rope_freqs`` is consumed into the config, not planned.

    Raises:
        ModelLoadError: a weight is missing, a tensor's shape differs from the metadata's, or the
            GGUF has tensors this conversion does not know (refused rather than dropped).
    """
    unpermute_heads = {}
    if arch == "llama":  # qwen2 is converted without the permutation
        unpermute_heads = {"attn_q": dims.n_heads, "attn_k": dims.n_kv}
    plans: list[_Plan] = []
    seen = set()

    def add(gguf_name: str, hf_name: str, shape: tuple[int, ...], n_head: int | None = None) -> None:
        t = tensors.get(gguf_name)
        if t is None:
            if gguf_name.endswith(".bias"):
                plans.append(_Plan(hf_name, shape, lambda s=shape: torch.zeros(s, dtype=torch.float32)))
                return
            raise ModelLoadError(f"GGUF lacks tensor {gguf_name}")
        seen.add(gguf_name)
        got = _hf_shape(t)
        if got != shape:
            raise ModelLoadError(f"GGUF tensor {gguf_name} has shape {got}, expected {shape} from the metadata")
        plans.append(_Plan(hf_name, shape, _from_gguf(t, n_head), t, n_head))

    add("token_embd.weight", "model.embed_tokens.weight", (dims.vocab, dims.hidden))
    for i in range(dims.n_layers):
        for suffix, shape in expected.items():
            base = suffix.split(".")[0]
            add(f"blk.{i}.{suffix}", f"model.layers.{i}.{_BLOCK_TENSORS[suffix]}", shape, unpermute_heads.get(base))
    add("output_norm.weight", "model.norm.weight", (dims.hidden,))
    if not tied:
        add("output.weight", "lm_head.weight", (dims.vocab, dims.hidden))
    seen.add(_ROPE_FREQS)
    unknown = sorted(set(tensors) - seen)
    if unknown:
        raise ModelLoadError(
            f"GGUF has tensors this {arch} conversion does not know, refusing to drop them: {unknown[:8]}"
            + (" …" if len(unknown) > 8 else "")
        )
    return plans


def _generation_config(tok_ids: dict[str, int]) -> dict:
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


def _build_config_and_plan(reader, meta: dict, dtype: torch.dtype) -> tuple[dict, dict, list[_Plan]]:
    """``config.json``, ``generation_config.json`` and the tensor plans for one GGUF.

    Args:
        reader: the ``gguf.GGUFReader`` of the file.
        meta: its metadata (:func:`_read_metadata`).
        dtype: the output dtype (recorded as the config's ``torch_dtype``).

    Returns:
        ``(config, generation_config, plans)``: two JSON-able dicts and one :class:`_Plan` per
        HF tensor (dequantized lazily, float32, HF shape).

    Raises:
        ModelLoadError: unsupported architecture or feature, metadata missing, or tensors missing,
            unknown or of a shape the metadata does not give.
    """
    arch = _check_arch(meta)
    tensors = {t.name: t for t in reader.tensors}
    dims = _read_dims(meta, arch, tensors)
    rope_scaling = _rope_scaling(meta, arch, tensors, dims)
    tied = "output.weight" not in tensors
    has_attn_bias = arch == "qwen2" or any(n.endswith("attn_q.bias") for n in tensors)
    tok_ids = _token_ids(meta)
    config = _hf_config(arch, meta, dims, rope_scaling, tied, has_attn_bias, tok_ids, dtype)
    plans = _tensor_plans(arch, tensors, dims, _block_shapes(arch, dims, has_attn_bias), tied)
    return config, _generation_config(tok_ids), plans


def _write_native_blocks(path: Path, plans: list[_Plan]) -> None:
    """Keep the GGUF blocks of every 2-D weight with a quantized kernel, as they are in the file
    (``[rows, row_bytes]`` uint8 under the HF name; llama q/k rows un-permuted, whole rows of
    blocks), in one safetensors file whose metadata ``ggml_types`` maps every 2-D weight's HF name
    to its ggml type (kernel or not, so the engine can name the types it dequantizes). The
    kernels read these bytes in place (``swiftspec.ops.quant``); nothing is repacked."""
    from safetensors.torch import save_file

    from swiftspec.ops import quant

    path.parent.mkdir(parents=True, exist_ok=True)
    types, blocks = {}, {}
    for p in plans:
        if p.gguf is None or len(p.shape) != 2:
            continue
        t = int(p.gguf.tensor_type)
        types[p.name] = t
        if not quant.has_kernel(t) or p.shape[1] % quant.block_values(t):
            continue
        raw = torch.from_numpy(np.array(p.gguf.data, dtype=np.uint8).reshape(p.shape[0], -1))
        if raw.shape[1] != quant.row_bytes(t, p.shape[1]):
            raise ModelLoadError(f"{p.name}: {raw.shape[1]} bytes per row, expected "
                                 f"{quant.row_bytes(t, p.shape[1])} for {quant.ggml_name(t)}")
        blocks[p.name] = _unpermute_rope(raw, p.n_head).contiguous() if p.n_head else raw
    save_file(blocks, str(path), metadata={"ggml_types": json.dumps(types)})


def _save_tokenizer(gguf_path: Path, out_dir: Path) -> None:
    """Build the fast tokenizer + chat template from GGUF metadata with transformers and save it.

    transformers ≥ 4.43 writes the chat template to ``chat_template.jinja``; the engine's
    contract is ``tokenizer_config.json["chat_template"]``, so it is put there too.
    """
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except Exception as exc:
        raise ModelLoadError(f"could not build a tokenizer from {gguf_path}: {exc}") from exc
    tok.save_pretrained(str(out_dir))
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    template = getattr(tok, "chat_template", None)
    if template and not cfg.get("chat_template"):
        cfg["chat_template"] = template
        cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def convert_gguf(
    gguf_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    dtype: torch.dtype = torch.bfloat16,
    *,
    tokenizer: bool = True,
    progress: bool = False,
    source_id: str | None = None,
) -> Path:
    """Convert a ``llama``/``qwen2`` GGUF file into a HF directory at ``out_dir``.

    Every tensor is dequantized with ``gguf.quants.dequantize`` (all quant types), one at a time
    (at most two fp32 tensors alive, plus the cast being written), reshaped from
    GGUF's reversed dims, un-permuted for ``llama`` q/k (llama.cpp's RoPE layout -> HF
    rotate_half), and written as safetensors in ``dtype`` (bf16/fp16/fp32), sharded above 4 GiB.
    config.json comes from the GGUF metadata (``tie_word_embeddings`` when there is no
    ``output.weight``; ``vocab_size`` = rows of ``token_embd``; llama3 RoPE scaling recovered from
    a ``rope_freqs`` tensor).  With ``tokenizer=True`` the tokenizer and chat template are built
    by transformers from the GGUF's metadata.

    The directory is built as ``<out_dir>.tmp-<pid>`` and moved into place with ``os.replace``
    after the ``.complete`` marker (JSON: format version, ``source_id``, dtype, seconds) was
    written inside it, so an interrupted run never leaves a directory that looks valid.  An
    existing ``out_dir`` is replaced.  Takes 43-49 s for the 1.5B Q4_K_M target on 2 CPU cores
    (≈33 s weights, ≈14 s building the tokenizer), peak RSS ≈4.1 GB including the mapped GGUF.

    Args:
        gguf_path: the GGUF file.
        out_dir: destination directory.
        dtype: torch.bfloat16 (default), torch.float16 or torch.float32.
        tokenizer: also write the tokenizer files (needs tokenizer metadata in the GGUF).
        progress: tqdm bar over tensors (stderr).
        source_id: recorded in the marker; default ``file:<size>:<mtime_ns>:<abspath>``.

    Returns:
        ``out_dir`` as a Path.

    Raises:
        ModelLoadError: unreadable GGUF, unsupported architecture/quant type/feature, tensors
            missing, unknown or of unexpected shape, or a tokenizer that cannot be built.
    """
    from gguf import GGUFReader

    gguf_path = Path(gguf_path).expanduser()
    out_dir = Path(out_dir).expanduser()
    if dtype not in TORCH_TO_ST_DTYPE:
        raise ModelLoadError(f"unsupported output dtype {dtype}; use bfloat16, float16 or float32")
    if not gguf_path.is_file():
        raise ModelLoadError(f"model path does not exist: {gguf_path}")
    if source_id is None:
        source_id = source_fingerprint(gguf_path)
    try:
        reader = GGUFReader(gguf_path)
    except Exception as exc:
        raise ModelLoadError(f"cannot read GGUF {gguf_path}: {exc}") from exc
    meta = _read_metadata(reader)
    config, gen_config, plans = _build_config_and_plan(reader, meta, dtype)

    def fill(tmp: Path) -> dict:
        write_float_weights(tmp, plans, dtype, f"convert {gguf_path.name}", progress)
        _write_native_blocks(tmp / NATIVE_FILE, plans)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if gen_config:
            (tmp / "generation_config.json").write_text(json.dumps(gen_config, indent=2) + "\n")
        if tokenizer:
            _save_tokenizer(gguf_path, tmp)
        return {"gguf": str(gguf_path.resolve()), "dtype": TORCH_DTYPE_NAME[dtype], "tokenizer": tokenizer}

    try:
        return build_model_dir(out_dir, source_id, fill)
    finally:
        del reader  # drop the memmap before returning
