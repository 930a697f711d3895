"""GGUF -> Hugging Face style directory (the engine's one model format).

:func:`convert_gguf` turns a ``llama``/``qwen2`` GGUF file into ``config.json``, float
safetensors (every tensor dequantized by the ``gguf`` library), the tokenizer built by
transformers from the GGUF's metadata, and ``native/blocks.safetensors``: the weights' blocks as
they are in the file, for the quantized kernels (``weights="native"``). The metadata -> config
mapping is :mod:`swiftspec.weights.gguf_metadata`; llama.cpp's RoPE conventions are
:mod:`swiftspec.weights.gguf_rope`.

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

from swiftspec.weights.gguf_metadata import (
    ModelDims,
    block_shapes,
    check_arch,
    generation_config,
    hf_config,
    hf_shape,
    read_dims,
    read_metadata,
    read_rope_scaling,
    token_ids,
)
from swiftspec.weights.gguf_rope import unpermute_rope
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
    arr = np.asarray(arr, dtype=np.float32).reshape(hf_shape(tensor))
    if not arr.flags.writeable or not arr.flags.c_contiguous:
        # F32 tensors come back as a view of the read-only memmap.
        arr = np.array(arr, dtype=np.float32, order="C")
    return torch.from_numpy(arr)


def _from_gguf(t, n_head: int | None) -> Callable[[], torch.Tensor]:
    """A loader of GGUF tensor ``t`` as float32 in HF shape, q/k rows un-permuted over ``n_head``
    heads when given."""
    if n_head is None:
        return lambda: _dequantize(t)
    return lambda: unpermute_rope(_dequantize(t), n_head)


def _tensor_plans(arch: str, tensors: dict, dims: ModelDims, expected: dict[str, tuple[int, ...]],
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
        got = hf_shape(t)
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


def _build_config_and_plan(reader, meta: dict, dtype: torch.dtype) -> tuple[dict, dict, list[_Plan]]:
    """``config.json``, ``generation_config.json`` and the tensor plans for one GGUF.

    Args:
        reader: the ``gguf.GGUFReader`` of the file.
        meta: its metadata (:func:`read_metadata`).
        dtype: the output dtype (recorded as the config's ``torch_dtype``).

    Returns:
        ``(config, generation_config, plans)``: two JSON-able dicts and one :class:`_Plan` per
        HF tensor (dequantized lazily, float32, HF shape).

    Raises:
        ModelLoadError: unsupported architecture or feature, metadata missing, or tensors missing,
            unknown or of a shape the metadata does not give.
    """
    arch = check_arch(meta)
    tensors = {t.name: t for t in reader.tensors}
    dims = read_dims(meta, arch, tensors)
    rope_freqs = (lambda: _dequantize(tensors[_ROPE_FREQS]).numpy()) if _ROPE_FREQS in tensors else None
    rope_scaling = read_rope_scaling(meta, arch, dims, rope_freqs)
    tied = "output.weight" not in tensors
    has_attn_bias = arch == "qwen2" or any(n.endswith("attn_q.bias") for n in tensors)
    tok_ids = token_ids(meta)
    config = hf_config(arch, meta, dims, rope_scaling, tied, has_attn_bias, tok_ids, dtype)
    plans = _tensor_plans(arch, tensors, dims, block_shapes(arch, dims, has_attn_bias), tied)
    return config, generation_config(tok_ids), plans


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
        blocks[p.name] = unpermute_rope(raw, p.n_head).contiguous() if p.n_head else raw
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
    meta = read_metadata(reader)
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
