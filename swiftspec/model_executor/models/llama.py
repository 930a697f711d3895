"""The Llama and Qwen2 causal LM on one TP rank and its loading: the embedding, the stack of decoder
layers (:mod:`swiftspec.model_executor.models.decoder_layer`: RMSNorm, RoPE, GQA, SwiGLU, optional
QKV bias), the final norm and the (optionally tied) LM head, tensor parallel (nano-vllm layout);
the checkpoint's names mapped onto its parameters, and the model built from a directory.

The model knows nothing of trees, processes or scheduling: ``forward`` takes token ids,
positions, the KV-cache slots to write and the attention mask, and returns hidden states;
``compute_logits`` turns selected rows into float32 logits over the whole vocabulary.
"""
from __future__ import annotations

import glob
import itertools
import json
import os
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from swiftspec import ops
from swiftspec.distributed.parallel import LOCAL, TPContext
from swiftspec.model_executor.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from swiftspec.model_executor.layers.gguf import SHARD_PART, GGUFWeight
from swiftspec.model_executor.layers.norm import RMSNorm
from swiftspec.model_executor.layers.rotary import RotaryEmbedding
from swiftspec.model_executor.models.config import ModelConfig
from swiftspec.model_executor.models.decoder_layer import DecoderLayer, gguf_types
from swiftspec.model_executor.models.kv_cache import KVCache
from swiftspec.ops import quant
from swiftspec.weights import random_weights
from swiftspec.weights.loader import NATIVE_FILE

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
        dtype: activation dtype, and weight dtype of the float weights (torch.float32 or
            torch.bfloat16).
        max_positions: size of the RoPE tables; positions must stay below it.
        native: ggml type of each checkpoint tensor (HF names) kept in GGUF blocks; a layer
            whose tensors all have a quantized kernel keeps them (at TP > 1 this rank's rows or
            whole blocks of them; a row-parallel layer whose shard would cut a block stays float,
            named in its module's ``unsplit``), others are float.
        int8: every linear layer and the LM head that would hold float weights holds int8
            weight-only ones instead (:class:`~swiftspec.model_executor.layers.quant.Int8Weight`, quantized as
            they load; a draft model's option), the embedding stays float.
        stage: the decoder layers this model holds, ``range(start, stop)`` (a pipeline stage);
            default all. The first stage holds the embedding, the last the final norm and the
            LM head (and the embedding when they are tied); other layers are not built.

    Any TP degree works: heads and the intermediate size are zero-padded where the degree does
    not divide them (see :func:`swiftspec.model_executor.layers.linear.gqa_head_layout`), with the same output.

    Raises:
        ValueError: the query head count is not a multiple of the key/value head count.
    """

    def __init__(self, cfg: ModelConfig, tp: TPContext = LOCAL, dtype: torch.dtype = torch.float32,
                 max_positions: int | None = None, native: dict[str, int] | None = None,
                 stage: range | None = None, int8: bool = False):
        super().__init__()
        self.cfg, self.tp, self.dtype = cfg, tp, dtype
        self.stage = stage = range(cfg.num_layers) if stage is None else stage
        if not (0 <= stage.start < stage.stop <= cfg.num_layers and stage.step == 1):
            raise ValueError(f"stage {stage} is not a non-empty range of the {cfg.num_layers} layers")
        self.first, self.last = stage.start == 0, stage.stop == cfg.num_layers
        embed = gguf_types(native, ["model.embed_tokens.weight"])
        self.embed_tokens = None
        if self.first or (self.last and cfg.tie_word_embeddings):
            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, dtype,
                                                       embed[0] if embed else None)
        self.layers = nn.ModuleList(DecoderLayer(cfg, tp, dtype, f"model.layers.{i}", native, int8) if i in stage
                                    else nn.Identity() for i in range(cfg.num_layers))
        # every layer of the stage on GGUF blocks: at TP 1 on the CPU twins, one C++ call runs them all
        self.all_native = all(self.layers[i].all_native for i in stage)
        self._native_layers = None
        self.rope = RotaryEmbedding(cfg.head_dim, max_positions or cfg.max_position_embeddings,
                                    cfg.rope_theta, cfg.rope_scaling)
        self.norm = self.lm_head = None
        if not self.last:
            return
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        head = embed if cfg.tie_word_embeddings else gguf_types(native, ["lm_head.weight"])
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp, dtype, head[0] if head else None, int8)
        if cfg.tie_word_embeddings:
            if embed:
                self.lm_head.native = self.embed_tokens.native
            else:
                self.lm_head.weight = self.embed_tokens.weight

    @property
    def num_kv_heads_local(self) -> int:
        """KV heads this rank stores (padded / replicated ones included): the KV cache's dim 2."""
        return self.layers[self.stage.start].self_attn.num_kv_heads

    def make_kv_cache(self, capacity: int, device: torch.device | str = "cpu",
                      track_positions: bool = False) -> KVCache:
        """A zeroed KV cache for this rank's layers (its stage's) with ``capacity`` token slots on
        ``device`` (``track_positions``: see :class:`KVCache`)."""
        return KVCache(len(self.stage), self.num_kv_heads_local, self.cfg.head_dim, capacity, self.dtype, device,
                       track_positions)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                mask: torch.Tensor, kv: KVCache, kv_len: torch.Tensor | None = None) -> torch.Tensor:
        """Run ``n`` tokens through the whole model; their keys/values land in ``slots`` of ``kv``.

        Shapes: input_ids, positions, slots ``[n]`` int64; mask ``[n, S]`` bool (query i may see
        slot j). Returns hidden states ``[n, hidden]`` in the model dtype. ``kv_len``: ``[1]``
        int64 on the model's device, the slots in use when ``mask`` is padded wider (a CUDA
        graph's step, :class:`swiftspec.model_executor.graphs.PaddedStep`): ``mask[:, kv_len:]`` must be all
        False; on CUDA attention then reads and splits only those slots.
        """
        return self.forward_stage(input_ids, None, positions, slots, mask, kv, kv_len)[0]

    @torch.inference_mode()
    def forward_stage(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                      slots: torch.Tensor, mask: torch.Tensor, kv: KVCache,
                      kv_len: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run this model's stage: ``x`` is token ids ``[n]`` int64 on the first stage, else the
        previous stage's output ``[n, hidden]`` with its residual stream ``[n, hidden]`` (model
        dtype; passing both keeps the split bit-identical to the whole model). Returns ``(x,
        residual)`` for the next stage, or ``(hidden, None)`` after the final norm on the last."""
        if self.first:
            x, residual = self.embed_tokens(x), None
        kv.note_positions(slots, positions)
        if self.tp.size == 1 and self.all_native and ops.native_layer_twin(x):  # one C++ call for every layer
            x, residual = ops.native_layers_forward(self.native_layers(), x, residual, kv.buf, slots, positions,
                                                    self.rope.cos, self.rope.sin, mask, kv.pos)
        else:
            for i in self.stage:
                x, residual = self.layers[i](x, residual, positions, self.rope, slots, mask,
                                             kv.layer(i - self.stage.start), kv_len)
        if self.last:
            return self.norm(x, residual)[0], None
        return x, residual

    def native_layers(self) -> list:
        """The stage's C++ layers in order (:meth:`DecoderLayer.native_layer`), listed once."""
        if self._native_layers is None:
            self._native_layers = [self.layers[i].native_layer() for i in self.stage]
        return self._native_layers

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, vocab_limit: int | None = None) -> torch.Tensor:
        """``[m, hidden] -> [m, vocab]`` float32 logits (all-gathered over the TP group);
        with ``vocab_limit`` only ids ``[0, vocab_limit)``."""
        return self.lm_head(hidden, vocab_limit)

    def _layer_of(self, name: str) -> nn.Module | None:
        """The layer whose weight parameter ``name`` (ours, e.g. ``layers.0.mlp.down_proj.weight``)
        is, or None (not a weight, no such layer). Its ``native`` / ``int8`` holder, where it has one,
        replaces that parameter."""
        if not name.endswith(".weight"):
            return None
        try:
            return self.get_submodule(name.rsplit(".", 1)[0])
        except AttributeError:
            return None

    def native_weight(self, name: str) -> GGUFWeight | None:
        """The GGUF block weight that parameter ``name`` (ours) lives in, or None when that layer
        holds another format or there is no such layer."""
        return getattr(self._layer_of(name), "native", None)

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
            name, shard_id = _param_name(name)
            if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
                continue
            if name == "embed_tokens.weight" and self.cfg.tie_word_embeddings and self.lm_head is not None \
                    and self.lm_head.int8 is not None:  # a tied int8 head quantizes the embedding's rows
                self.lm_head.int8.weight_loader(None, tensor)
            if name not in params:
                prefix = name[:-len("weight")]
                layer = self._layer_of(name)
                native, int8 = getattr(layer, "native", None), getattr(layer, "int8", None)
                if native is not None:
                    native.weight_loader(None, tensor, shard_id)
                    loaded.add(f"{prefix}native.parts.{SHARD_PART[shard_id]}")
                elif int8 is not None:
                    int8.weight_loader(None, tensor, shard_id)
                    loaded.update((f"{prefix}int8.qweight", f"{prefix}int8.scales"))
                else:
                    raise KeyError(f"checkpoint tensor {name!r} has no parameter in the model")
                continue
            param = params[name]
            loader = getattr(param, "weight_loader", None)
            tensor = tensor.to(param.dtype)
            if loader is None:
                param.data.copy_(tensor)
            else:
                loader(param, tensor, shard_id)
            loaded.add(name)
        expected = {n for n in params if not (self.cfg.tie_word_embeddings and n.startswith("lm_head."))}
        missing = sorted(expected - loaded)
        if missing:
            raise KeyError(f"checkpoint has no weight for {len(missing)} parameters, e.g. {missing[:4]}")


def iter_safetensors(model_dir: str | Path, skip=lambda name: False):
    """Yield ``(name, tensor)`` for every tensor of every ``*.safetensors`` file in ``model_dir``
    whose name ``skip`` does not reject."""
    files = sorted(glob.glob(os.path.join(str(model_dir), "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    for f in files:
        with safe_open(f, framework="pt") as st:
            for name in st.keys():
                if not skip(name):
                    yield name, st.get_tensor(name)


def native_types(model_dir: str | Path) -> dict[str, int]:
    """``{hf_name: ggml type}`` of the GGUF blocks the loader kept beside a converted model
    (``native/blocks.safetensors``, see :mod:`swiftspec.weights.loader`); empty when there are none."""
    path = Path(model_dir) / NATIVE_FILE
    if not path.is_file():
        return {}
    with safe_open(str(path), framework="pt") as st:
        meta = st.metadata() or {}
    return {k: int(v) for k, v in json.loads(meta.get("ggml_types", "{}")).items()}


def load_model(model_dir: str | Path, tp: TPContext = LOCAL, dtype: torch.dtype = torch.float32,
               max_positions: int | None = None, weights: str = "native",
               device: torch.device | str = "cpu", stage: range | None = None,
               int8: bool = False) -> LlamaForCausalLM:
    """Build the model described by ``model_dir/config.json`` and load this rank's weight shards.

    ``weights``: "native" keeps GGUF blocks with a quantized kernel as they are (at TP > 1 each
    rank's shard of them); layers without one, and at TP > 1 row-parallel layers whose shard would
    cut a block, are float in ``dtype``, with a one-line notice naming the block types or layers;
    "bfloat16" / "float32": every weight dequantized (as converted) in ``dtype``. ``int8``: the
    layers that would hold float weights hold int8 weight-only ones (see :class:`LlamaForCausalLM`).
    ``stage``: only these decoder layers (a pipeline stage, see :class:`LlamaForCausalLM`); the
    checkpoint's other tensors are not read. The model is built and loaded on the host, then moved to
    ``device``; on CUDA GGUF blocks run dequantized in ``dtype`` (the quantized kernels are CPU
    kernels), with a one-line notice. A random-weights recipe directory
    (:mod:`swiftspec.weights.random_weights`) is built on ``device`` and its weights made there, one
    checkpoint tensor at a time (no host copy; ``weights`` does not apply).

    Raises:
        ModelConfigError: unsupported or broken config.json.
        FileNotFoundError: no safetensors files.
        KeyError: checkpoint and model disagree on parameter names.
        ValueError: unknown ``weights``.
    """
    if weights not in ("native", "bfloat16", "float32"):
        raise ValueError(f"weights must be native, bfloat16 or float32, got {weights!r}")
    cfg = ModelConfig.from_dir(model_dir)
    device = torch.device(device)
    recipe = random_weights.recipe(model_dir)
    if recipe is not None:  # random weights: built and filled on the device itself, nothing read
        with torch.device(device):
            model = LlamaForCausalLM(cfg, tp, dtype, max_positions, None, stage, int8=int8)
        config = json.loads((Path(model_dir) / "config.json").read_text())
        model.load_weights(random_weights.random_state(config, recipe, device,
                                                       skip=lambda n: not _in_stage(model, n)))
        return model.eval()
    native = native_types(model_dir) if weights == "native" else {}
    if native and device.type != "cpu":
        print(f"swiftspec: GGUF blocks are dequantized to {dtype} on {device} (no GPU kernel for them yet)",
              file=sys.stderr)
        native = {}
    with torch.device("cpu"):
        model = LlamaForCausalLM(cfg, tp, dtype, max_positions, native, stage, int8=int8)
    native = {n: t for n, t in native.items() if _in_stage(model, n)}
    kept = {n for n in native if model.native_weight(_param_name(n)[0]) is not None}
    lacking = sorted({quant.ggml_name(t) for n, t in native.items()
                      if n not in kept and not quant.has_kernel(t) and t not in _FLOAT_GGML_TYPES})
    if lacking:
        print(f"swiftspec: no quantized kernel for {', '.join(lacking)}: those layers run dequantized",
              file=sys.stderr)
    unsplit = [n for layer in model.layers if isinstance(layer, DecoderLayer)
               for n in layer.self_attn.unsplit + layer.mlp.unsplit]
    if unsplit:
        print(f"swiftspec: at TP = {tp.size} the shards of {len(unsplit)} layers (e.g. {unsplit[0]}) would cut "
              f"GGUF blocks: those layers run dequantized", file=sys.stderr)

    def blocks():
        if kept:
            with safe_open(str(Path(model_dir) / NATIVE_FILE), framework="pt") as st:
                for n in sorted(kept):
                    yield n, st.get_tensor(n)

    skip = lambda n: n in kept or not _in_stage(model, n)  # noqa: E731
    model.load_weights(itertools.chain(iter_safetensors(model_dir, skip=skip), blocks()))
    return model.to(device).eval()


def _in_stage(model: LlamaForCausalLM, hf_name: str) -> bool:
    """Whether checkpoint tensor ``hf_name`` belongs to a module this model (stage) holds."""
    name = hf_name.removeprefix("model.")
    if name.startswith("layers."):
        return int(name.split(".")[1]) in model.stage
    if name.startswith("embed_tokens."):
        return model.embed_tokens is not None
    if name.startswith(("norm.", "lm_head.")):
        return model.last
    return True


_FLOAT_GGML_TYPES = (0, 1, 30)  # F32, F16, BF16: float tensors in any case


def _param_name(hf_name: str) -> tuple[str, str | int | None]:
    """Checkpoint name -> (our parameter name, shard id): ``model.`` dropped, q/k/v and gate/up
    mapped onto their fused layers."""
    name = hf_name.removeprefix("model.")
    for frag, (ours, sid) in _STACKED.items():
        if f".{frag}." in name:
            return name.replace(frag, ours), sid
    return name, None
