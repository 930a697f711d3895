"""Peer decoders measured by bench/e2e.py on the same models, dtype and prompts.

- ``hf``: Hugging Face transformers ``generate()`` with the target alone.
- ``hf-assisted``: transformers' assisted generation, the draft as ``assistant_model``.
- ``llama-cpp``: llama.cpp through ``llama-cpp-python`` on the same GGUF file (optional:
  ``pip install llama-cpp-python``, which builds llama.cpp from source).

Each peer's ``generate(prompt_ids, max_tokens)`` returns a record with the same metric
definitions as SwiftSpec's (decode tokens/s excludes the first token; TBT spreads tokens that
arrive together evenly over their interval).
"""
from __future__ import annotations

import time

import torch

from swiftspec.metrics import RequestMetrics


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


class HFPeer:
    """transformers ``generate`` (greedy), optionally with an assistant (draft) model."""

    def __init__(self, target_dir, draft_dir=None, dtype: str = "bfloat16", threads: int | None = None):
        from transformers import AutoModelForCausalLM

        if threads:
            torch.set_num_threads(threads)
        dt = getattr(torch, dtype)
        self.model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=dt).eval()
        self.assistant = None
        if draft_dir is not None:
            self.assistant = AutoModelForCausalLM.from_pretrained(str(draft_dir), dtype=dt).eval()
        self.forwards = 0
        self.model.register_forward_hook(self._count)
        self.system = "hf-assisted" if draft_dir is not None else "hf"

    def _count(self, *_):
        self.forwards += 1

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], max_tokens: int, eos_ids=()) -> tuple[list[int], RequestMetrics]:
        ids = torch.tensor([prompt_ids])
        stamps = _Stamps(len(prompt_ids))
        self.forwards = 0
        kw = dict(max_new_tokens=max_tokens, do_sample=False, streamer=stamps, attention_mask=torch.ones_like(ids),
                  eos_token_id=list(eos_ids) or None, pad_token_id=(list(eos_ids) or [0])[0])
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
        self.model = self.assistant = None


class LlamaCppPeer:
    """llama.cpp (``llama-cpp-python``) on a GGUF file, greedy, target alone."""

    system = "llama-cpp"

    def __init__(self, gguf_path, threads: int, n_ctx: int = 4096):
        try:
            from llama_cpp import Llama
        except ImportError as e:
            raise RuntimeError("llama-cpp-python is not installed (pip install llama-cpp-python)") from e
        self.llm = Llama(model_path=str(gguf_path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                         verbose=False, logits_all=False)

    def generate(self, prompt_ids: list[int], max_tokens: int, eos_ids=()) -> tuple[list[int], RequestMetrics]:
        self.llm.reset()
        events, out = [], []
        t0 = time.perf_counter()
        for tok in self.llm.generate(prompt_ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
            events.append((time.perf_counter(), 1))
            out.append(int(tok))
            if tok in eos_ids or len(out) >= max_tokens:
                break
        m = RequestMetrics.from_events(self.system, len(prompt_ids), t0, events, [0] * max(len(out) - 1, 1), None)
        m.compression_ratio = 1.0
        return out, m

    def close(self):
        self.llm = None
