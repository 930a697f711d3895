"""The weights a process's quantized-GEMM self-tuning times (:mod:`swiftspec.ops.tuning`): a few
of its models' own GGUF block weights, taken before the models are built, whose layout then
follows the variant chosen.

Per model: one decoder layer's fused qkv (q, k, v parts), o, fused gate_up (gate, up parts) and
down projections, and the LM head (the embedding's blocks when tied; its first ``logits_vocab``
rows where logits are computed for those ids only) — the shapes and block types every layer of
the model repeats, and the one big GEMM of a decode step.
"""
from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open

from swiftspec.ops import quant
from swiftspec.ops.tuning import TuneWeight
from swiftspec.weights.model_cache import NATIVE_FILE

# fused projection -> its parts' checkpoint names in layer {i}, in the model's part order
_LAYER_WEIGHTS = {
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o": ("self_attn.o_proj",),
    "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "down": ("mlp.down_proj",),
}


def model_weights(model_dir: str | Path, logits_vocab: int | None = None, layer: int = 0) -> list[TuneWeight]:
    """The GGUF block weights of ``model_dir`` to time (see the module docstring): empty for a
    model without native blocks (``native/blocks.safetensors``) or whose blocks have no kernel.

    Raises:
        OSError / safetensors errors: an unreadable blocks file.
    """
    path = Path(model_dir) / NATIVE_FILE
    if not path.is_file():
        return []
    with safe_open(str(path), framework="pt") as st:
        types = {k: int(v) for k, v in json.loads((st.metadata() or {}).get("ggml_types", "{}")).items()}
        names = set(st.keys())
        config = json.loads((Path(model_dir) / "config.json").read_text())
        wanted = {w: [f"model.layers.{layer}.{p}.weight" for p in parts] for w, parts in _LAYER_WEIGHTS.items()}
        wanted["lm_head"] = ["model.embed_tokens.weight" if config.get("tie_word_embeddings") else "lm_head.weight"]
        out = []
        for name, parts in wanted.items():
            if not all(p in names and quant.has_kernel(types.get(p, -1)) for p in parts):
                continue
            tensors = [st.get_tensor(p) for p in parts]
            if name == "lm_head" and logits_vocab is not None:
                tensors = [tensors[0][:logits_vocab].contiguous()]
            t0 = types[parts[0]]
            k = tensors[0].shape[1] // quant.GGML_TYPES[t0][2] * quant.block_values(t0)
            if any(quant.row_bytes(types[p], k) != t.shape[1] for p, t in zip(parts, tensors)):
                continue  # parts that disagree on in_features: not one fused call
            out.append(TuneWeight(name, tuple(tensors), tuple(types[p] for p in parts), k))
    return out



def tune_kernels(models: list[tuple[str, int | None]], rows: list[int], retune: bool = False):
    """Choose this process's quantized-GEMM variant for its models (``(model_dir, logits_vocab)``
    pairs) at ``rows`` rows per call (:func:`swiftspec.ops.tune_quant_gemm`: this machine's stored
    measurement, else measured now, else the rule). Call it before loading the models: their
    weights take the chosen variant's layout. Returns the :class:`~swiftspec.ops.tuning.Choice`,
    or None with the kernels off or unavailable."""
    from swiftspec import ops

    if not ops.kernels_enabled():
        return None
    weights = [w for path, vocab in models for w in model_weights(path, vocab)]
    return ops.tune_quant_gemm(weights, rows, retune)


def layout_rows(model) -> list[int]:
    """The interleave group sizes (16, 8, or 1 for the file's layout) of ``model``'s GGUF block
    weights, sorted: what its quantized GEMM reads (:func:`swiftspec.ops.quant.group_rows`)."""
    from swiftspec.model_executor.layers.gguf import GGUFWeight

    return sorted({quant.group_rows(t) for m in model.modules() if isinstance(m, GGUFWeight) for t in m.types})
