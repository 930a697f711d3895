"""Model configuration for the Llama and Qwen2 families.

The engine reads Hugging Face style ``config.json`` files; :mod:`swiftspec.weights.loader` turns GGUF
files into such directories first, so one parser serves every input format.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ModelConfigError(ValueError):
    """A config.json that is missing keys or describes an unsupported model."""


SUPPORTED_ARCHS = {"llama": "llama", "qwen2": "qwen2", "mistral": "llama"}
SUPPORTED_ROPE_TYPES = {"default", "linear", "llama3"}


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of one decoder-only model.

    Units: every size is a count of elements (not bytes); ``rope_theta`` is the RoPE base.
    ``eos_token_ids`` lists every id that ends generation.
    """

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """Build from a Hugging Face config dict.

        Raises:
            ModelConfigError: unsupported ``model_type`` / rope scaling, or a missing key.
        """
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_ARCHS:
            raise ModelConfigError(
                f"unsupported model_type {model_type!r}; supported: {sorted(SUPPORTED_ARCHS)}")
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            eos = cfg.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
            # transformers >= 5 writes "rope_parameters" (theta inside); older files "rope_scaling"
            rope_params = dict(cfg.get("rope_parameters") or {})
            rope_theta = float(rope_params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
            rope_scaling = cfg.get("rope_scaling") or (rope_params if rope_params else None)
            if rope_scaling is not None and rope_scaling.get("rope_type", rope_scaling.get("type")) == "default":
                rope_scaling = None
            if rope_scaling is not None:
                rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
                if rope_type not in SUPPORTED_ROPE_TYPES:
                    raise ModelConfigError(
                        f"unsupported rope scaling {rope_type!r}; supported: {sorted(SUPPORTED_ROPE_TYPES)}")
            return cls(
                arch=SUPPORTED_ARCHS[model_type],
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                rope_scaling=rope_scaling,
                max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                # Qwen2 always has q/k/v biases; Llama has them only when attention_bias is set.
                attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=tuple(int(e) for e in eos_ids),
            )
        except KeyError as e:
            raise ModelConfigError(f"config.json is missing key {e.args[0]!r}") from None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        """Read ``<model_dir>/config.json``; also folds in ``generation_config.json`` EOS ids.

        Raises:
            ModelConfigError: the file is missing, not JSON, or unsupported.
        """
        path = Path(model_dir) / "config.json"
        try:
            cfg = json.loads(path.read_text())
        except FileNotFoundError:
            raise ModelConfigError(f"no config.json in {model_dir}") from None
        except json.JSONDecodeError as e:
            raise ModelConfigError(f"{path} is not valid JSON: {e}") from None
        gen_path = Path(model_dir) / "generation_config.json"
        if gen_path.exists():
            gen_eos = json.loads(gen_path.read_text()).get("eos_token_id")
            if gen_eos is not None:
                base = cfg.get("eos_token_id")
                base = list(base) if isinstance(base, (list, tuple)) else ([base] if base is not None else [])
                extra = gen_eos if isinstance(gen_eos, list) else [gen_eos]
                cfg = {**cfg, "eos_token_id": base + [e for e in extra if e not in base]}
        return cls.from_dict(cfg)
