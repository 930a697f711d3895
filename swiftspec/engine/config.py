"""The engine's configuration (docs/architecture.md §5.3).

:class:`EngineConfig` validates every field when it is built; what ``mode="auto"`` resolves to is
:func:`swiftspec.engine.mode_selection.choose_mode`'s.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields
from pathlib import Path

from swiftspec.engine.placement import DEVICES
from swiftspec.pipeline import MODES as PIPELINE_MODES
from swiftspec.spec_decode.draft_state import TreeParams
from swiftspec.spec_decode.modes import mode_for, registered
from swiftspec.spec_decode.ngram import NgramParams

MODES = ("async", "serial", "hybrid", "colocated", "autoregressive", "ngram", "pipedec", "pipeinfer", "pipeline-autoregressive")
# the modes that run the target alone (no draft model is loaded)
TARGET_ONLY_MODES = ("autoregressive", "ngram", "pipeline-autoregressive")
WEIGHT_FORMATS = ("native", "bfloat16", "float32")


@dataclass
class EngineConfig:
    """How the engine lays out its groups (every field has a sensible default).

    Attributes:
        mode: "auto" (default: the fastest mode for this machine, :func:`choose_mode`), "async"
            (SwiftSpec), "serial" (SwiftSpec-base), "colocated" (Algorithm 1 in one process: on
            one GPU the draft expands on its CUDA stream while the target verifies on another;
            on CPU it degenerates to serial with no expansion between verifications),
            "autoregressive", "ngram" (the target alone, verifying prompt-lookup proposals: the
            tokens that followed the latest earlier occurrence of the text's last ``ngram_min`` to
            ``ngram_max`` tokens, ``ngram_tokens`` of them per step; no draft model,
            :mod:`swiftspec.spec_decode.ngram`), "hybrid" (serial's draft tree and the ngram
            proposal in one verification batch, at most ``hybrid_rows`` rows;
            :mod:`swiftspec.spec_decode.hybrid`), or a pipeline mode (with
            ``pipeline_stages`` >= 2; :mod:`swiftspec.pipeline.decode`): "pipedec" (PipeDec: the
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
            (:mod:`swiftspec.engine.placement`). On CUDA the weights run dequantized in ``dtype`` (no GPU
            kernel for GGUF blocks yet), the draft unquantized; greedy tokens and the draft's
            top-k are reduced on the device (sampled requests bring logits rows to the host);
            on one GPU auto picks "autoregressive" (measured fastest there; see :func:`choose_mode`).
        target_devices / draft_devices: GPU indices of each group's ranks (async; one process per
            entry, so a group's TP degree is its number of entries); serial and autoregressive use
            ``target_devices + draft_devices``. An index may repeat: ``[0, 0]`` is TP = 2 on GPU 0,
            and async groups may name the same GPU (separate processes on it); a group with two
            ranks on one GPU runs its collectives on the CUDA LL kernels over a gloo control group
            (NCCL refuses it; :func:`swiftspec.distributed.parallel.control_backend`). Default: the draft gets
            the last ⌈n/4⌉ GPUs.
        target_cores / draft_cores: CPU cores of each group (async); serial and autoregressive
            use their union (a core in both lists counts once). Default: the draft gets a quarter (at least one).
            On CUDA the host cores of the group's processes.
        target_tp / draft_tp: TP degree (processes) of each group; a group's cores are split
            evenly among its ranks, each running that many threads. On CUDA 1 (one rank per
            listed GPU), the number of listed GPUs, or a multiple of it (that many ranks per GPU).
        bs, w, topk, max_nodes, max_cached: draft tree (see :class:`TreeParams`); defaults
            8, 2, w, 1024, 256.
        ngram_min / ngram_max / ngram_tokens / ngram_adaptive: the "ngram" mode's lookup lengths,
            proposal length and whether a proposal is only as long as the suffix that matched
            (:class:`swiftspec.spec_decode.ngram.NgramParams`); defaults 2, 4, 1, False: a verification
            of two rows costs little more than one on a CPU, more rows cost more (the forward tables
            in bench/RESULTS.md); ``auto`` weighs longer and adaptive proposals against this
            machine's measured row costs (:mod:`swiftspec.spec_decode.mode_choice`).
        hybrid_rows: "hybrid": the most rows per verification, >= 2 (root, draft subgraph and the
            chain's other rows; the draft's subgraph shrinks below ``bs`` to fit); default 4, the
            most that auto's step costs measure (:mod:`swiftspec.spec_decode.mode_choice`).
        d: expansions per iteration; None = automatic in async, 3 in serial and hybrid; in colocated
            the most that may overlap one verification (None: as many as fit).
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
        cuda_graphs: on CUDA, replay each decode step (not the prefill) from a CUDA graph
            captured per bucket of rows (powers of two up to the tree's ``bs`` / expansion sizes;
            :class:`swiftspec.model_executor.graphs.PaddedStep`); at TP > 1 only where the group's collectives
            run on the CUDA LL communicator (otherwise steps run eagerly;
            :func:`swiftspec.distributed.parallel.graph_ban`); ignored on CPU. TP > 1 capture not yet run on
            GPU hardware.
        draft_payback: serial and hybrid modes: per request, prefill the draft only where that
            pays back within the request's token budget, else run it on the target alone
            (:mod:`swiftspec.spec_decode.payback`; the request's ``metrics.mode`` then says
            "autoregressive", or "ngram" for hybrid, which keeps its prompt-lookup chains); None (default) = on when ``mode`` is "auto", off when a mode is
            configured. Changes speed, never the output.
        draft_sms: colocated mode on CUDA: confine the draft to this many streaming
            multiprocessors (SMs) with a CUDA green context (:func:`swiftspec.model_executor.sm_partition.green_context_stream`;
            the driver rounds it up to its granularity, a multiple of 8 on Hopper), so its
            expansions cannot take SMs beyond that share from the target's verification; the
            target keeps the whole GPU (torch's green contexts each split their SMs off the whole
            device, so two could overlap: only the draft's share is fenced). None (default): no
            partition. Needs mode "colocated" (or "auto" resolving to it) and a CUDA device
            (``ValueError`` otherwise); a torch or driver without green contexts raises
            ``RuntimeError`` when the workers start. Measured on an H100 (bench/RESULTS.md, the
            H100 table): 32 SMs made ``colocated`` 0.90x as fast as without a partition.
        start_timeout_s: seconds to wait for the workers to load their models.
        progress_timeout_s: seconds a running request may go without a message from its workers
            (tokens, its end) before they count as stuck (a frozen or hung process; a dead one is
            seen at once): the engine closes and raises ``WorkerError`` (the server then restarts
            it). Before the first token the allowance grows by one second per
            :data:`PREFILL_TOKENS_PER_S` prompt tokens, so a long prompt's prefill does not trip it.
            None: no deadline.
        liveness_interval_s: seconds an idle server's engine may go between liveness pings
            (:meth:`~swiftspec.engine.llm_engine.Engine.ping`: each group's leader must answer), so
            a worker that froze or hung between requests is found and the engine restarted before
            a request waits on it; None: no pings. A ping costs a pipe round trip (well under a
            millisecond) while the engine is idle.
        liveness_timeout_s: seconds a leader has to answer a liveness ping (an idle process
            answers at once; a frozen one never).
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
    # w = topk = 2, not the paper's 8: on 2 CPU cores (bench/LOG.md) a 2-leaf draft expansion
    # costs about half a 4-leaf one (36 vs 65 ms), so the tree grows deeper per verification (async
    # 9.4 vs 7.2 tokens/s with w = 4, 2026-11-22, before the L2 prefetch; not re-swept since)
    w: int = 2
    topk: int | None = None
    max_nodes: int = 1024
    max_cached: int = 256
    d: int | None = None
    ngram_min: int = 2
    ngram_max: int = 4
    ngram_tokens: int = 1
    ngram_adaptive: bool = False
    hybrid_rows: int = 4
    max_model_len: int = 4096
    pipeline_stages: int = 1
    pipeline_order: str = "layer"
    remote_stages: list[int] = field(default_factory=list)
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    draft_quant: str = "int8"
    draft_vocab: int | None = 32768
    kernels: bool = field(default_factory=lambda: os.environ.get("SWIFTSPEC_KERNELS", "1") != "0")
    cuda_graphs: bool = True
    draft_payback: bool | None = None
    draft_sms: int | None = None
    start_timeout_s: float = 600.0
    progress_timeout_s: float | None = 120.0
    liveness_interval_s: float | None = 5.0
    liveness_timeout_s: float = 10.0

    def __post_init__(self):
        for name in ("progress_timeout_s", "liveness_interval_s", "liveness_timeout_s"):
            v = getattr(self, name)
            if (v is not None or name == "liveness_timeout_s") and not (isinstance(v, (int, float)) and v > 0):
                raise ValueError(f"{name} must be a positive number of seconds"
                                 f"{'' if name == 'liveness_timeout_s' else ' or None'}, got {v!r}")
        custom = tuple(m for m in registered() if m not in MODES and m not in ("target", "draft"))
        if self.mode != "auto" and self.mode not in MODES + custom:
            raise ValueError(f"mode must be auto or one of {MODES + custom}, got {self.mode!r}")
        if self.mode in registered() and self.mode not in ("target", "draft"):  # a decode mode checks its own fields
            mode_for(self.mode).check_config(self)
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
        if self.draft_sms is not None:
            if isinstance(self.draft_sms, bool) or not isinstance(self.draft_sms, int) or self.draft_sms < 1:
                raise ValueError(f"draft_sms must be a positive integer (SMs) or None, got {self.draft_sms!r}")
            if self.mode not in ("colocated", "auto"):
                raise ValueError(f"draft_sms splits one GPU's SMs between the colocated mode's concurrent draft and "
                                 f"target; mode {self.mode!r} has no such pair: use mode='colocated'")
            if self.device == "cpu":
                raise ValueError("draft_sms partitions a GPU's SMs: it needs device 'cuda' (or 'auto' on a GPU)")
        self.tree_params()  # validates bs, w, ...
        self.ngram_params()

    def draft_logits_vocab(self, vocab: int) -> int:
        """The ids the draft proposes, ``[0, result)``, for a pair sharing ``vocab`` ids."""
        return min(vocab, self.draft_vocab or vocab)

    @property
    def draft_quant_method(self) -> str | None:
        """``draft_quant`` as :class:`swiftspec.model_executor.runner.ModelRunner` takes it (None: none)."""
        return None if self.draft_quant == "none" else self.draft_quant

    def tree_params(self) -> TreeParams:
        """The draft tree's shape (:class:`~swiftspec.spec_decode.draft_state.TreeParams`): ``bs``
        (nodes per verification, root included), ``w`` (leaves per draft forward), ``topk`` (children
        per expanded node; ``w`` when unset), ``max_nodes`` (tree nodes) and ``max_cached`` (tree-cache
        slots)."""
        return TreeParams(self.bs, self.w, self.topk or self.w, self.max_nodes, self.max_cached)

    def ngram_params(self) -> NgramParams:
        """The "ngram" mode's proposal shape. Raises ValueError on invalid lengths."""
        return NgramParams(self.ngram_min, self.ngram_max, self.ngram_tokens, self.ngram_adaptive)

    @classmethod
    def from_json(cls, path: str | Path, **overrides) -> "EngineConfig":
        """Load a configuration file (as written by ``swiftspec profile``); ``overrides`` that are
        not None replace its fields.

        Raises:
            FileNotFoundError: no such file.
            ValueError: the file is not a JSON object, names a field EngineConfig does not have
                (all such fields named), or a value is invalid.
        """
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"engine configuration {path}: not JSON ({e})") from None
        if not isinstance(data, dict):
            raise ValueError(f"engine configuration {path}: expected a JSON object, got {type(data).__name__}")
        data = {k: v for k, v in data.items() if k not in ("target", "draft", "_measured")}
        unknown = sorted(set(data) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"engine configuration {path}: unknown field(s) {', '.join(unknown)} "
                             f"(EngineConfig has {', '.join(f.name for f in fields(cls))})")
        data.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**data)


# Prompt tokens per second of prefill the progress deadline allows for before the first token
# (EngineConfig.progress_timeout_s): a tenth of the slowest prefill in bench/RESULTS.md (the 1.5B
# target on two CPU cores prefills a few hundred tokens a second), so only a stuck worker trips it.
PREFILL_TOKENS_PER_S = 16
