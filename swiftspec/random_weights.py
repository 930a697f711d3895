"""Models of a real checkpoint's shapes with random weights, for benchmarks where the weights cannot go.

A decode step's time does not depend on the weights' values, so an offline machine that takes a
few MiB of project files (the GPU machines this project is measured on) can time the default
pair from its ``config.json`` alone: :func:`materialize` writes a Hugging Face directory with
that config, random weights (normal with std ``initializer_range``, RMSNorm weights 1, biases 0;
seeded, the same bytes on every machine) and a placeholder tokenizer of the config's vocabulary
size (:func:`write_tokenizer`), so the engine and the
Hugging Face peers load it like any checkpoint. Acceptance then comes from a recorded trace
(:mod:`swiftspec.acceptance`). The parameter names and shapes are transformers' own (the model
built on the meta device), so whatever transformers loads, our loader reads the same files.

Directories are cached under ``<cache>/random/<name>-<12 hex>/`` (keyed by the config's text,
the seed and the dtype) and built atomically like converted models
(:func:`swiftspec.model_cache.build_model_dir`).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from swiftspec.model_cache import TensorPlan, build_model_dir, cache_root, is_complete, write_float_weights

# the default pair's shapes (config.json of each model), shipped with the package
PACKAGED_CONFIGS = Path(__file__).resolve().parent / "data" / "model_configs"
DEFAULT_CONFIGS = (PACKAGED_CONFIGS / "qwen2.5-coder-1.5b-instruct.json",
                   PACKAGED_CONFIGS / "qwen2.5-coder-0.5b-instruct.json")


def _plans(config: dict, seed: int) -> list[TensorPlan]:
    """One plan per tensor transformers' model of ``config`` loads, in its state-dict order."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    std = float(config.get("initializer_range", 0.02))
    tied = bool(config.get("tie_word_embeddings", False))
    plans = []
    for i, (name, t) in enumerate(model.state_dict().items()):
        if tied and name == "lm_head.weight":
            continue
        shape = tuple(t.shape)

        def produce(name=name, shape=shape, i=i):
            if name.endswith("norm.weight"):
                return torch.ones(shape)
            if name.endswith(".bias"):
                return torch.zeros(shape)
            return torch.randn(shape, generator=torch.Generator().manual_seed(seed * 100_003 + i)) * std

        plans.append(TensorPlan(name, shape, produce))
    return plans


def write_tokenizer(out_dir: Path, vocab_size: int, bos_id: int | None, eos_id: int | None) -> None:
    """A placeholder tokenizer: ``vocab_size`` word-level tokens ``<t{i}>`` (ids only mean
    anything to models with random weights), except ``<|endoftext|>`` at ``bos_id`` and
    ``<|im_end|>`` (the EOS) at ``eos_id`` as in Qwen2's vocabulary, whose tokenizer class
    transformers picks from the config and which would add ``<|endoftext|>`` if it were missing."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    names = [f"<t{i}>" for i in range(vocab_size)]
    specials = {}
    for i, name in ((bos_id, "<|endoftext|>"), (eos_id, "<|im_end|>")):
        if i is not None and 0 <= i < vocab_size:
            names[i] = specials[i] = name
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(names)}, unk_token=names[0]))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(specials.values()))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=specials.get(eos_id), unk_token=names[0],
                            pad_token=specials.get(bos_id)).save_pretrained(out_dir)


def materialize(config_path, dtype: str = "bfloat16", seed: int = 0, cache_dir=None,
                progress: bool = True) -> Path:
    """The Hugging Face directory of ``config_path``'s model with random weights in ``dtype``
    (built on first use, then reused from the cache).

    Args:
        config_path: a ``config.json`` (e.g. :data:`DEFAULT_CONFIGS`).
        dtype: "bfloat16", "float16" or "float32" (the weights' storage dtype).
        seed: the weights' seed.
        cache_dir: cache root (default ``$SWIFTSPEC_CACHE`` or ``~/.cache/swiftspec``).
    Raises:
        FileNotFoundError: no such config file.
        ValueError: the file is not a JSON object with a ``model_type``, or an unknown dtype.
    """
    path = Path(config_path)
    text = path.read_text()
    try:
        config = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{path} is not JSON: {e}") from e
    if not isinstance(config, dict) or "model_type" not in config:
        raise ValueError(f"{path} is not a model config.json (no model_type)")
    if dtype not in ("bfloat16", "float16", "float32"):
        raise ValueError(f"dtype must be bfloat16, float16 or float32, got {dtype!r}")
    source = f"random:{hashlib.sha256(text.encode()).hexdigest()}:{seed}:{dtype}"
    out = cache_root(cache_dir) / "random" / f"{path.stem}-{hashlib.sha256(source.encode()).hexdigest()[:12]}"
    if is_complete(out, source):
        return out

    def fill(tmp: Path) -> dict:
        config_out = {**config, "torch_dtype": dtype}
        (tmp / "config.json").write_text(json.dumps(config_out, indent=2) + "\n")
        write_float_weights(tmp, _plans(config, seed), getattr(torch, dtype), f"random {path.stem}", progress)
        bos, eos = config.get("bos_token_id"), config.get("eos_token_id")
        write_tokenizer(tmp, int(config["vocab_size"]), bos, eos[0] if isinstance(eos, list) else eos)
        return {"random_weights": {"seed": seed, "dtype": dtype, "config": str(path)}}

    return build_model_dir(out, source, fill)
