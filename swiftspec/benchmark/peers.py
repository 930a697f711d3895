"""Peer decoders measured by bench/e2e.py on the same models, dtype and prompts.

- ``hf``: Hugging Face transformers ``generate()`` with the target alone.
- ``hf-compile``: the same with a static KV cache sized once for the whole run and the decode
  step compiled by ``torch.compile`` (transformers' own recipe: ``cache_implementation="static"``
  plus a ``CompileConfig``, mode "reduce-overhead", i.e. CUDA graphs, on CUDA), compiled at start.
- ``hf-assisted``: transformers' assisted generation, the draft as ``assistant_model``.
- ``llama-cpp``: llama.cpp through ``llama-cpp-python`` on the same GGUF file (optional:
  ``pip install llama-cpp-python``, which builds llama.cpp from source).
- ``llama-cpp-spec``: the same with llama-cpp-python's speculative decoding (its ``draft_model``
  hook): the draft's own GGUF in a second llama.cpp context proposes ``draft_tokens`` greedy tokens,
  the target scores them in one batch and keeps the matching prefix plus one (a chain, no tree).
- ``llama-cpp-lookup``: the same hook fed by llama-cpp-python's prompt-lookup decoding
  (``LlamaPromptLookupDecoding``): no draft model, the tokens that followed an earlier occurrence
  of the text's last ``max_ngram_size`` down to 1 tokens, ``num_pred_tokens`` of them
  (:data:`LOOKUP_MAX_NGRAM`, :data:`LOOKUP_TOKENS`): llama.cpp's counterpart of ``mode="ngram"``.

Each peer's ``generate(prompt_ids, max_tokens)`` returns a record with the same metric
definitions as SwiftSpec's (decode tokens/s excludes the first token; TBT spreads tokens that
arrive together evenly over their interval).
"""
from __future__ import annotations

import os
import time

import torch

from swiftspec.engine.metrics import RequestMetrics


class _Stamps:
    """A transformers streamer that timestamps every chunk of new tokens."""

    def __init__(self, prompt_len: int):
        self.prompt_len = prompt_len
        self.events: list[tuple[float, int]] = []
        self._first = True

    def put(self, value):
        if self._first:  # transformers first puts the prompt itself
            self._first = False
            return
        self.events.append((time.perf_counter(), int(value.numel())))

    def end(self):
        pass


def hf_model(model_dir, dtype: torch.dtype, device: torch.device):
    """transformers' model of ``model_dir`` on ``device`` in eval mode: loaded from its weights, or
    for a random-weights recipe (:mod:`swiftspec.weights.random_weights`) built on the device and filled
    with the recipe's bytes (the same our loader makes there)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from swiftspec.weights import random_weights

    if random_weights.recipe(model_dir) is None:
        return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(model_dir)), dtype=dtype)
    random_weights.fill_hf_model(model, model_dir)
    return model.eval()


class HFPeer:
    """transformers ``generate`` (greedy), optionally with an assistant (draft) model."""

    def __init__(self, target_dir, draft_dir=None, dtype: str = "bfloat16", threads: int | None = None,
                 device: str = "cpu", compiled: bool = False, max_cache_len: int = 4096):
        """``compiled``: static cache of ``max_cache_len`` tokens (prompt + generated, every call)
        and the decode step compiled (see the module docstring); one warm-up generation here."""
        if threads:
            torch.set_num_threads(threads)
        dt = getattr(torch, dtype)
        self.device = torch.device(device)
        self.model = hf_model(target_dir, dt, self.device)
        self.assistant = None
        if draft_dir is not None:
            self.assistant = hf_model(draft_dir, dt, self.device)
        self.forwards = 0
        self.model.register_forward_hook(self._count)
        self.system = "hf-assisted" if draft_dir is not None else "hf-compile" if compiled else "hf"
        if compiled:
            from transformers import CompileConfig

            gc = self.model.generation_config
            gc.cache_implementation, gc.max_cache_len = "static", max_cache_len
            gc.compile_config = CompileConfig(fullgraph=True, mode="reduce-overhead" if self.device.type == "cuda"
                                              else "default")
            gc.compile_config._compile_all_devices = True  # transformers compiles on accelerators only otherwise
            self.generate([0] * 8, 4, ignore_eos=True)  # compiles the decode step outside every timing

    def _count(self, *_):
        self.forwards += 1

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], max_tokens: int, eos_ids=(),
                 ignore_eos: bool = False) -> tuple[list[int], RequestMetrics]:
        """Greedy tokens and metrics (``ignore_eos``: exactly ``max_tokens`` tokens, the
        end-of-sequence logits suppressed until then, as ``min_new_tokens`` does)."""
        ids = torch.tensor([prompt_ids], device=self.device)
        stamps = _Stamps(len(prompt_ids))
        self.forwards = 0
        kw = dict(max_new_tokens=max_tokens, do_sample=False, streamer=stamps, attention_mask=torch.ones_like(ids),
                  eos_token_id=list(eos_ids) or None, pad_token_id=(list(eos_ids) or [0])[0])
        if ignore_eos:
            kw["min_new_tokens"] = max_tokens
        if self.assistant is not None:
            kw["assistant_model"] = self.assistant
        t0 = time.perf_counter()
        out = self.model.generate(ids, **kw)[0, len(prompt_ids):].tolist()
        verifications = max(self.forwards - 1, 1)  # the first forward is the prefill
        accepted = [0] * verifications  # per-forward detail is not exposed; the ratio below is exact
        m = RequestMetrics.from_events(self.system, len(prompt_ids), t0, stamps.events, accepted, None)
        m.compression_ratio = (len(out) - 1) / verifications if self.assistant is not None else 1.0
        return out, m

    def close(self):
        """Drop the model and the assistant (their memory is freed when nothing else holds them)."""
        self.model = self.assistant = None


# How scripts/setup_env.sh builds llama-cpp-python: -march=native as llama.cpp's default, but its
# AMX code compiled out (the macro that guards it undefined), so the peer runs its AVX-512/AVX2 path,
# and without the multimodal library (mtmd), which the text-only peers never load: the build takes
# 210 s instead of 250 s on 2 Zen 4 cores (bench/LOG.md, "Workers forked from a fork server").
LLAMA_CPP_CMAKE_ARGS = "-DCMAKE_C_FLAGS=-U__AMX_INT8__ -DCMAKE_CXX_FLAGS=-U__AMX_INT8__ -DLLAVA_BUILD=OFF"


def _llama_cpp():
    try:
        import llama_cpp
    except ImportError as e:
        raise RuntimeError("llama-cpp-python is not installed (pip install llama-cpp-python)") from e
    info = llama_cpp.llama_print_system_info().decode(errors="replace")
    if "AMX_INT8 = 1" in info and os.environ.get("SWIFTSPEC_LLAMA_CPP_AMX") != "1":
        # llama.cpp's AMX matmul (ggml-cpu/amx) segfaults in ggml_backend_amx_mul_mat on Q4_K_M
        # and on the tests' tiny GGUFs on some AMX CPUs (llama.cpp issue 20824, seen on an Intel
        # Xeon with llama-cpp-python 0.3.36); a crash would take the whole benchmark or test run down
        raise RuntimeError(
            "this llama-cpp-python build uses llama.cpp's AMX matmul, which segfaults on some AMX CPUs; "
            f"rebuild it without: CMAKE_ARGS='{LLAMA_CPP_CMAKE_ARGS}' pip install --force-reinstall "
            "--no-cache-dir llama-cpp-python (scripts/setup_env.sh does), or set SWIFTSPEC_LLAMA_CPP_AMX=1 "
            "to use it anyway")
    return llama_cpp


class _GgufDraft:
    """A llama-cpp-python ``LlamaDraftModel``: greedy continuations from a second llama.cpp context
    on the draft's GGUF. Its KV cache keeps the longest common prefix between calls (llama-cpp-
    python's prefix reuse), so each call evaluates only the tokens accepted since the last one."""

    def __init__(self, gguf_path, threads: int, n_ctx: int, draft_tokens: int):
        llama_cpp = _llama_cpp()
        self.llm = llama_cpp.Llama(model_path=str(gguf_path), n_ctx=n_ctx, n_threads=threads,
                                   n_threads_batch=threads, verbose=False)
        self.k = draft_tokens
        self.calls = 0

    def __call__(self, input_ids, /, **kwargs):
        import numpy as np

        self.calls += 1
        out = []
        # reset=True is what makes llama-cpp-python look for the cached prefix (and drop the rest)
        for tok in self.llm.generate(input_ids.tolist(), top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0,
                                     reset=True):
            out.append(int(tok))
            if len(out) >= self.k:
                break
        return np.array(out, dtype=np.intc)


# llama-cpp-lookup's prompt lookup: the longest suffix it looks up, as our ngram mode's
# (EngineConfig.ngram_max; llama-cpp-python then tries every shorter one down to a single token),
# and the tokens it proposes per target forward: 3, the most the auto cost model weighs for our
# ngram mode (swiftspec.spec_decode.mode_choice.NGRAM_TOKENS, NGRAM_ADAPTIVE_TOKENS), since on a CPU each proposed token
# is one more row of the target's batch and costs time even where it is rejected (llama-cpp-python's
# default of 10 is sized for a GPU, where extra rows are nearly free)
LOOKUP_MAX_NGRAM = 4
LOOKUP_TOKENS = 3


class _Counted:
    """A llama-cpp-python draft model that counts its calls (one per target forward)."""

    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def __call__(self, input_ids, /, **kwargs):
        self.calls += 1
        return self.inner(input_ids, **kwargs)


class LlamaCppPeer:
    """llama.cpp (``llama-cpp-python``) on a GGUF file, greedy: the target alone, with
    ``draft_gguf`` its speculative decoding (draft model chain of ``draft_tokens``), or with
    ``lookup`` its prompt-lookup decoding (:data:`LOOKUP_MAX_NGRAM`, :data:`LOOKUP_TOKENS`).
    ``settings``: the proposer's parameters, recorded with every request (``{}`` for the target alone).

    Raises:
        ValueError: both ``draft_gguf`` and ``lookup``.
    """

    def __init__(self, gguf_path, threads: int, n_ctx: int = 4096, draft_gguf=None, draft_tokens: int = 4,
                 lookup: bool = False):
        llama_cpp = _llama_cpp()
        if draft_gguf is not None and lookup:
            raise ValueError("LlamaCppPeer: a draft GGUF or prompt lookup, not both")
        self.draft = None
        self.settings: dict = {}
        if draft_gguf is not None:  # llama-cpp-python calls draft_model(input_ids) -> draft tokens
            self.draft = _GgufDraft(draft_gguf, threads, n_ctx, draft_tokens)
            self.settings = {"draft_tokens": draft_tokens}
        elif lookup:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            self.draft = _Counted(LlamaPromptLookupDecoding(max_ngram_size=LOOKUP_MAX_NGRAM,
                                                            num_pred_tokens=LOOKUP_TOKENS))
            self.settings = {"max_ngram_size": LOOKUP_MAX_NGRAM, "num_pred_tokens": LOOKUP_TOKENS}
        self.system = "llama-cpp-spec" if draft_gguf is not None else "llama-cpp-lookup" if lookup else "llama-cpp"
        # With a draft model llama-cpp-python keeps the logits of every position, but sizes its
        # score buffer from the logits_all argument (n_batch rows when False): a prompt longer than
        # n_batch (512) then fails to copy its second batch. Asking for logits_all sizes it n_ctx.
        self.llm = llama_cpp.Llama(model_path=str(gguf_path), n_ctx=n_ctx, n_threads=threads,
                                   n_threads_batch=threads, verbose=False, logits_all=self.draft is not None,
                                   draft_model=self.draft)

    def generate(self, prompt_ids: list[int], max_tokens: int, eos_ids=()) -> tuple[list[int], RequestMetrics]:
        """Greedy decoding of ``prompt_ids`` (top-k 1, no repeat penalty) from a reset context, until a
        token in ``eos_ids`` or ``max_tokens`` tokens.

        Returns:
            ``(token ids, RequestMetrics)``: times from each token's arrival (seconds); with a draft
            or prompt lookup the compression ratio is generated tokens per target forward (one forward follows each
            proposer call), else 1.
        """
        self.llm.reset()
        if isinstance(self.draft, _GgufDraft):
            self.draft.llm.reset()
        if self.draft is not None:
            self.draft.calls = 0
        events, out = [], []
        t0 = time.perf_counter()
        for tok in self.llm.generate(prompt_ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
            events.append((time.perf_counter(), 1))
            out.append(int(tok))
            if tok in eos_ids or len(out) >= max_tokens:
                break
        m = RequestMetrics.from_events(self.system, len(prompt_ids), t0, events, [0] * max(len(out) - 1, 1), None)
        # llama-cpp-python calls the proposer after every target forward but the last (the generator
        # is closed at the last token), and each call is followed by one forward over its tokens: the
        # calls count the decode forwards (the prefill's call precedes the first)
        m.compression_ratio = (len(out) - 1) / max(self.draft.calls, 1) if self.draft is not None else 1.0
        return out, m

    def close(self):
        """Drop the llama.cpp model and the draft (llama-cpp-python frees them when collected)."""
        self.llm = self.draft = None
