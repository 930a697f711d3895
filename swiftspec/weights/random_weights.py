"""Models of a real checkpoint's shapes with random weights, made where they run.

A decode step's time does not depend on the weights' values, so a machine that takes a few MiB
of project files and no checkpoint (the offline GPU machines this project is measured on) can
time any model from its ``config.json`` alone. :func:`materialize` writes a *recipe directory*:
that ``config.json``, a placeholder tokenizer (:func:`write_tokenizer`) and ``random_weights.json``
(seed, dtype, standard deviation), but no weights. Whoever loads it makes the weights on the
device they run on, one checkpoint tensor at a time (:func:`random_state`): our loader
(:func:`swiftspec.model_executor.models.llama.load_model`) inside each worker process, the Hugging Face peers
with :func:`fill_hf_model`. Nothing of the weights touches the disk or the host, so a 32B model
(65 GB in bf16) loads in seconds where a safetensors copy would not fit a 64 GiB disk.

Values: normal with std ``initializer_range`` (RMSNorm weights 1, biases 0), each tensor from its
own generator on the loading device seeded with ``seed * 100_003 + i`` (``i``: the tensor's
index in transformers' state dict), drawn directly in the weight dtype, so our model and the
transformers model of the same recipe on the same device hold the same bytes. The parameter
names and shapes are transformers' own (its model of the config built on the meta device).

Directories are cached under ``<cache>/random/<name>-<12 hex>/`` (keyed by the config's text,
the seed, the dtype and the tokenizer's size) and built atomically like converted models
(:func:`swiftspec.weights.model_cache.build_model_dir`).
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
from pathlib import Path
from typing import Callable, Iterator

import torch

from swiftspec.weights.model_cache import build_model_dir, cache_root, is_complete

# the shapes (config.json of each model) shipped with the package: the default pair's, and
# larger targets of the same tokenizer family for the GPU benchmarks
PACKAGED_CONFIGS = Path(__file__).resolve().parents[1] / "data" / "model_configs"
DEFAULT_CONFIGS = (PACKAGED_CONFIGS / "qwen2.5-coder-1.5b-instruct.json",
                   PACKAGED_CONFIGS / "qwen2.5-coder-0.5b-instruct.json")
RECIPE_FILE = "random_weights.json"
DTYPES = ("bfloat16", "float16", "float32")


def packaged_config(name: str) -> Path:
    """A shipped config by file name or stem (``"qwen2.5-14b-instruct"``), or ``name`` itself when
    it is a path. Raises FileNotFoundError naming the shipped ones."""
    path = Path(name)
    if path.is_file():
        return path
    for cand in (PACKAGED_CONFIGS / name, PACKAGED_CONFIGS / f"{name}.json"):
        if cand.is_file():
            return cand
    shipped = ", ".join(sorted(p.stem for p in PACKAGED_CONFIGS.glob("*.json")))
    raise FileNotFoundError(f"no config file {name!r} (shipped: {shipped})")


@functools.lru_cache(maxsize=8)
def _entries_cached(text: str) -> tuple[tuple[int, str, tuple[int, ...]], ...]:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = json.loads(text)
    cfg = AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    tied = bool(config.get("tie_word_embeddings", False))
    return tuple((i, name, tuple(t.shape)) for i, (name, t) in enumerate(model.state_dict().items())
                 if not (tied and name == "lm_head.weight"))


def checkpoint_entries(config: dict) -> tuple[tuple[int, str, tuple[int, ...]], ...]:
    """``(seed index, checkpoint name, shape)`` of every tensor transformers' model of ``config``
    holds, in its state-dict order (a tied LM head left out)."""
    return _entries_cached(json.dumps(config, sort_keys=True))


def random_tensor(name: str, shape: tuple[int, ...], index: int, seed: int, std: float, dtype: torch.dtype,
                  device: torch.device | str) -> torch.Tensor:
    """Checkpoint tensor ``name`` of the recipe: ones for RMSNorm weights, zeros for biases, else
    ``N(0, std)`` from a generator on ``device`` seeded ``seed * 100_003 + index``, in ``dtype``."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=dtype, device=device)
    if name.endswith(".bias"):
        return torch.zeros(shape, dtype=dtype, device=device)
    gen = torch.Generator(device=device).manual_seed(seed * 100_003 + index)
    return torch.empty(shape, dtype=dtype, device=device).normal_(0.0, std, generator=gen)


def random_state(config: dict, recipe_: dict, device: torch.device | str,
                 skip: Callable[[str], bool] = lambda name: False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(checkpoint name, tensor on device)`` for every tensor of the recipe whose name
    ``skip`` does not reject, one at a time (the caller copies it into its shard, then it is freed)."""
    dtype = getattr(torch, recipe_["dtype"])
    for i, name, shape in checkpoint_entries(config):
        if not skip(name):
            yield name, random_tensor(name, shape, i, recipe_["seed"], recipe_["std"], dtype, device)


def recipe(model_dir) -> dict | None:
    """The random-weights recipe of a model directory (``{"seed", "dtype", "std"}``), or None for
    a directory that holds real weights."""
    path = Path(model_dir) / RECIPE_FILE
    if not path.is_file():
        return None
    doc = json.loads(path.read_text())
    if not isinstance(doc, dict) or not {"seed", "dtype", "std"} <= set(doc) or doc["dtype"] not in DTYPES:
        raise ValueError(f"{path} is not a random-weights recipe (seed, dtype, std)")
    return doc


def fill_hf_model(model: torch.nn.Module, model_dir) -> None:
    """Overwrite a transformers model of a recipe directory's config (built with
    ``from_config`` on its device) with the recipe's weights, in place: the same bytes as our
    loader makes on that device. Raises KeyError when the model lacks a checkpoint tensor."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    rec = recipe(model_dir)
    if rec is None:
        raise ValueError(f"{model_dir} holds no random-weights recipe")
    state = model.state_dict()
    with torch.no_grad():
        for name, tensor in random_state(config, rec, next(model.parameters()).device):
            state[name].copy_(tensor)


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


def read_config(config_path) -> tuple[Path, str, dict]:
    """``(path, text, parsed)`` of a model ``config.json``. Raises FileNotFoundError, or
    ValueError for a file that is not a JSON object with a ``model_type``."""
    path = Path(config_path)
    text = path.read_text()
    try:
        config = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{path} is not JSON: {e}") from e
    if not isinstance(config, dict) or "model_type" not in config:
        raise ValueError(f"{path} is not a model config.json (no model_type)")
    return path, text, config


def materialize(config_path, dtype: str = "bfloat16", seed: int = 0, cache_dir=None,
                tokenizer_vocab: int | None = None) -> Path:
    """The recipe directory of ``config_path``'s model with random weights in ``dtype`` (built on
    first use, then reused from the cache; a few MiB: config, tokenizer, recipe).

    Args:
        config_path: a ``config.json`` (e.g. :data:`DEFAULT_CONFIGS`, :func:`packaged_config`).
        dtype: "bfloat16", "float16" or "float32" (the weights' dtype).
        seed: the weights' seed.
        cache_dir: cache root (default ``$SWIFTSPEC_CACHE`` or ``~/.cache/swiftspec``).
        tokenizer_vocab: tokens of the placeholder tokenizer (default the config's ``vocab_size``);
            a draft and a target given the same value get the same tokenizer, as real pairs of
            one family share one tokenizer whatever their embedding sizes.
    Raises:
        FileNotFoundError: no such config file.
        ValueError: the file is not a JSON object with a ``model_type``, an unknown dtype, or a
            tokenizer larger than the config's vocabulary.
    """
    path, text, config = read_config(config_path)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    vocab = int(tokenizer_vocab or config["vocab_size"])
    if not 0 < vocab <= int(config["vocab_size"]):
        raise ValueError(f"tokenizer_vocab {vocab} is not in (0, vocab_size {config['vocab_size']}]")
    source = f"random-recipe:{hashlib.sha256(text.encode()).hexdigest()}:{seed}:{dtype}:{vocab}"
    out = cache_root(cache_dir) / "random" / f"{path.stem}-{hashlib.sha256(source.encode()).hexdigest()[:12]}"
    if is_complete(out, source):
        return out

    def fill(tmp: Path) -> dict:
        (tmp / "config.json").write_text(json.dumps({**config, "torch_dtype": dtype}, indent=2) + "\n")
        rec = {"seed": seed, "dtype": dtype, "std": float(config.get("initializer_range", 0.02))}
        (tmp / RECIPE_FILE).write_text(json.dumps(rec) + "\n")
        bos, eos = config.get("bos_token_id"), config.get("eos_token_id")
        write_tokenizer(tmp, vocab, bos, eos[0] if isinstance(eos, list) else eos)
        return {"random_weights": {**rec, "config": str(path)}}

    return build_model_dir(out, source, fill)


def param_count(model_dir) -> int | None:
    """Parameters of a recipe directory's checkpoint (from the shapes; nothing is made), or None
    for a directory of real weights."""
    if recipe(model_dir) is None:
        return None
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return sum(math.prod(shape) for _, _, shape in checkpoint_entries(config))


def weight_bytes(model_dir) -> int | None:
    """Bytes of a recipe directory's weights in its dtype, or None for a directory of real weights."""
    n = param_count(model_dir)
    return None if n is None else n * getattr(torch, recipe(model_dir)["dtype"]).itemsize
