"""The OpenAI API's request parameters and response objects, for :mod:`swiftspec.entrypoints.server`.

Requests are validated here (not by pydantic models), so every bad input gets the OpenAI error
body ``{"error": {"message", "type", "param", "code"}}`` with status 400 instead of a framework's
422. Defaults are the API's documented ones: ``temperature`` 1.0, ``top_p`` 1.0, ``n`` 1, no
``max_tokens`` limit but the context (``/v1/completions``: 16, as the legacy API documents).
Reference read: the OpenAI API reference (chat completions, completions, streaming chunks).
"""
from __future__ import annotations

import itertools
import time
import uuid
from dataclasses import dataclass

from swiftspec.model_executor.sampling import MAX_LOGPROBS, SamplingParams, is_positive_seconds

# Qwen2.5-Coder's fill-in-the-middle tokens (what editors' completion plugins rely on)
FIM_TOKENS = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")
MAX_SEED = 1 << 63  # seeds are in [0, 2^63): torch.Generator.manual_seed takes a 64-bit integer
# temperatures below this decode greedily (vLLM's _SAMPLING_EPS): logits divided by less overflow float32
MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class Limits:
    """Bounds a request is checked against before any tokenization or rendering.

    Attributes:
        max_body_bytes: request body size in bytes (more: 413).
        max_messages: chat messages per request.
        max_stop_chars: characters per stop string (each is searched in the text every chunk, and
            the worker decodes a window of one token per UTF-8 byte of the longest one per token).
        max_model_len: the context in tokens; ``max_tokens`` must be below it.
        request_timeout_s: the deadline of a request that sets none (its ``timeout_s``) and the
            longest one may set, seconds of engine time (``SamplingParams.timeout_s``); None:
            no deadline unless the request sets one.
    Raises:
        ValueError: a ``request_timeout_s`` that is not a positive number.
    """

    max_body_bytes: int = 1 << 20
    max_messages: int = 1024
    max_stop_chars: int = 512
    max_model_len: int = 4096
    request_timeout_s: float | None = None

    def __post_init__(self):
        t = self.request_timeout_s
        if t is not None and not is_positive_seconds(t):
            raise ValueError(f"request_timeout_s must be a positive number of seconds or None, got {t!r}")


class APIError(Exception):
    """An error reply: HTTP ``status``, ``message``, OpenAI error ``type_`` (derived from the
    status when None), the request field ``param`` it concerns, and a ``code``."""

    def __init__(self, status: int, message: str, param: str | None = None, type_: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                              403: "permission_error", 408: "timeout_error", 413: "request_too_large",
                              415: "invalid_request_error", 429: "rate_limit_error",
                              503: "service_unavailable"}.get(status, "server_error")

    def body(self) -> dict:
        """The OpenAI error body: ``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _number(body: dict, key: str, default, lo: float, hi: float, integer: bool = False):
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        raise APIError(400, f"'{key}' must be {'an integer' if integer else 'a number'}, got {v!r}", key)
    if not lo <= v <= hi:
        raise APIError(400, f"'{key}' must be in [{lo}, {hi}], got {v}", key)
    return v


def _logprobs(body: dict, chat: bool) -> int | None:
    """Alternatives per token asked for, or None: chat ``logprobs`` (bool) + ``top_logprobs``
    (0-20); completions ``logprobs`` (0-5), as the OpenAI API documents them."""
    if chat:
        want = body.get("logprobs")
        if want is not None and not isinstance(want, bool):
            raise APIError(400, "'logprobs' must be a boolean", "logprobs")
        top = _number(body, "top_logprobs", None, 0, MAX_LOGPROBS, integer=True)
        if top is not None and not want:
            raise APIError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return (top or 0) if want else None
    return _number(body, "logprobs", None, 0, 5, integer=True)


def _stop(body: dict, max_chars: int) -> tuple[str, ...]:
    """``stop``: a non-empty string or a list of up to 4, each at most ``max_chars`` characters."""
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else (stop or [])
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise APIError(400, "'stop' must be a non-empty string or a list of up to 4 of them", "stop")
    if any(len(s) > max_chars for s in stop):
        raise APIError(400, f"each 'stop' string may have at most {max_chars} characters", "stop")
    return tuple(stop)


def _seed(body: dict) -> int | None:
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < MAX_SEED):
        raise APIError(400, "'seed' must be an integer in [0, 2^63)", "seed")
    return seed


def _timeout(body: dict, limit: float | None) -> float | None:
    """The request's deadline in seconds: its ``timeout_s`` (> 0), at most ``limit``; ``limit`` when unset."""
    t = body.get("timeout_s")
    if t is None:
        return limit
    if not is_positive_seconds(t):
        raise APIError(400, f"'timeout_s' must be a positive number of seconds, got {t!r}", "timeout_s")
    return t if limit is None else min(t, limit)


def sampling_params(body: dict, default_max_tokens: int | None, chat: bool = True,
                    limits: Limits = Limits()) -> tuple[SamplingParams, bool, bool]:
    """``(params, stream, include_usage)`` from a chat (``chat``) or completions request body.

    ``max_tokens`` (or ``max_completion_tokens``) is in [1, ``limits.max_model_len`` - 1]; None
    (``default_max_tokens`` None) means up to the context, which the engine clamps to what the
    prompt leaves. A ``temperature`` below :data:`MIN_TEMPERATURE` decodes greedily. ``timeout_s``
    (an extension: seconds of engine time, then finish reason "timeout") is capped by
    ``limits.request_timeout_s``, which is also its default.

    Raises:
        APIError: 400 for ``n`` other than 1, a bad ``logprobs``/``top_logprobs``,
            ``stop``/``stream_options``/``seed``/``timeout_s`` or any number out of range."""
    if _number(body, "n", 1, 1, 1_000_000, integer=True) != 1:
        raise APIError(400, "only n = 1 is supported (one completion per request)", "n")
    logprobs = _logprobs(body, chat)
    stop = _stop(body, limits.max_stop_chars)
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    context = limits.max_model_len - 1
    max_tokens = _number(body, key, default_max_tokens or context, 1, context, integer=True)
    seed = _seed(body)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise APIError(400, "'stream' must be a boolean", "stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise APIError(400, "'stream_options' must be an object", "stream_options")
    temperature = float(_number(body, "temperature", 1.0, 0.0, 2.0))
    params = SamplingParams(temperature=0.0 if temperature < MIN_TEMPERATURE else temperature,
                            top_p=float(_number(body, "top_p", 1.0, 1e-9, 1.0)), seed=seed,
                            max_tokens=max_tokens, stop=stop, logprobs=logprobs,
                            timeout_s=_timeout(body, limits.request_timeout_s))
    return params, stream, bool(opts.get("include_usage"))


def chat_messages(body: dict, max_messages: int = Limits.max_messages) -> list[dict]:
    """The ``messages`` of a chat request as ``{"role", "content"}`` strings (text parts joined).

    Raises:
        APIError: 400 when missing, empty, malformed or more than ``max_messages``."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise APIError(400, "'messages' must be a non-empty list", "messages")
    if len(msgs) > max_messages:
        raise APIError(400, f"{len(msgs)} messages; at most {max_messages} are served", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "developer", "tool"):
            raise APIError(400, f"messages[{i}] needs a role of system, user, assistant, developer or tool",
                           "messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: only text ones
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise APIError(400, f"messages[{i}]: only text content parts are supported", "messages")
            content = "".join(str(p.get("text", "")) for p in content)
        if not isinstance(content, str):
            raise APIError(400, f"messages[{i}].content must be a string or text parts", "messages")
        out.append({"role": "system" if m["role"] == "developer" else m["role"], "content": content})
    return out


def has_fim_tokens(tokenizer) -> bool:
    """Whether ``tokenizer``'s vocabulary holds the :data:`FIM_TOKENS` (``suffix`` is served)."""
    vocab = tokenizer.get_vocab()
    return all(t in vocab for t in FIM_TOKENS)


def completion_prompt(body: dict, has_fim: bool) -> str | list[int]:
    """The prompt of a ``/v1/completions`` request: a string, one-element list of strings, or
    token ids (passed on untouched: special-token text in it is parsed as such); with ``suffix``,
    the fill-in-the-middle prompt built from the model's FIM tokens (``has_fim``:
    :func:`has_fim_tokens`).

    Raises:
        APIError: 400 for a missing or batched prompt, or a ``suffix`` on a model without FIM
            tokens."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    ids = isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    if not (isinstance(prompt, str) and prompt) and not ids:
        raise APIError(400, "'prompt' must be a non-empty string or a list of token ids (one prompt per request)",
                       "prompt")
    suffix = body.get("suffix")
    if suffix is None:
        return prompt
    if not isinstance(suffix, str) or not isinstance(prompt, str):
        raise APIError(400, "'suffix' must be a string and needs a string prompt", "suffix")
    if not has_fim:
        raise APIError(400, "this model has no fill-in-the-middle tokens; 'suffix' is not supported", "suffix")
    pre, suf, mid = FIM_TOKENS
    return f"{pre}{prompt}{suf}{suffix}{mid}"


def new_id(prefix: str) -> str:
    """A response id: ``prefix`` (``chatcmpl`` / ``cmpl``), a dash and 24 random hex digits."""
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(out) -> dict:
    """The ``usage`` object (token counts) of a finished :class:`~swiftspec.engine.outputs.GenerationOutput`."""
    m = out.metrics
    return {"prompt_tokens": m.prompt_tokens, "completion_tokens": len(out.token_ids),
            "total_tokens": m.prompt_tokens + len(out.token_ids)}


def extension(out) -> dict:
    """The ``swiftspec`` object of a response: how this request decoded."""
    m = out.metrics
    return {"mode": m.mode, "compression_ratio": m.compression_ratio, "tokens_per_s": m.tokens_per_s,
            "ttft_s": m.ttft_s}


def finish_reason(out) -> str:
    """The API's ``finish_reason``: "length" (max_tokens or the context reached), "timeout" (the
    request's deadline passed; not in the OpenAI API, whose clients pass it through), else "stop"."""
    return out.finish_reason if out.finish_reason in ("length", "timeout") else "stop"


class TokenText:
    """Token id -> ``(text, UTF-8 bytes)`` for logprobs. Byte-level BPE vocabularies (GPT-2's byte
    table, as Qwen's) give each token's exact bytes, so a token holding part of a multi-byte
    character still has its bytes (its text shows U+FFFD); other vocabularies: the decoded token."""

    def __init__(self, tokenizer):
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        self.tokenizer = tokenizer
        self.byte_of = {c: b for b, c in bytes_to_unicode().items()}

    def __call__(self, token_id: int) -> tuple[str, bytes]:
        """``(text, raw UTF-8 bytes)`` of one token id."""
        piece = self.tokenizer.convert_ids_to_tokens(token_id) or ""
        if piece and all(ch in self.byte_of for ch in piece):
            raw = bytes(self.byte_of[ch] for ch in piece)
        else:
            raw = self.tokenizer.decode([token_id]).encode()
        return raw.decode("utf-8", errors="replace"), raw


def _lp(v: float) -> float:
    return max(v, -9999.0)  # JSON has no -inf; the OpenAI API reports -9999.0 for "impossible"


def chat_logprobs(lps, token_text: TokenText) -> dict | None:
    """A chat choice's ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}]}``,
    or None when not asked for (``lps`` None)."""
    if lps is None:
        return None

    def entry(tid: int, v: float) -> dict:
        text, raw = token_text(tid)
        return {"token": text, "logprob": _lp(v), "bytes": list(raw)}
    return {"content": [{**entry(x.token_id, x.logprob), "top_logprobs": [entry(t, v) for t, v in x.top]}
                        for x in lps]}


def completion_logprobs(lps, token_text: TokenText, offset: int = 0) -> dict | None:
    """A completion choice's legacy ``logprobs``: ``tokens``, ``token_logprobs``,
    ``top_logprobs`` (token text -> logprob) and ``text_offset`` (characters, from ``offset``)."""
    if lps is None:
        return None
    tokens = [token_text(x.token_id)[0] for x in lps]
    starts = list(itertools.accumulate(map(len, tokens), initial=offset))[:-1]
    return {"tokens": tokens, "token_logprobs": [_lp(x.logprob) for x in lps],
            "top_logprobs": [{token_text(t)[0]: _lp(v) for t, v in x.top} for x in lps], "text_offset": starts}


def chat_response(rid: str, model: str, out, token_text: TokenText | None = None) -> dict:
    """A ``chat.completion`` object for a finished generation ``out`` (logprobs when asked for)."""
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": out.text},
                         "finish_reason": finish_reason(out),
                         "logprobs": chat_logprobs(out.logprobs, token_text)}],
            "usage": usage(out), "swiftspec": extension(out)}


def chat_chunk(rid: str, model: str, delta: dict, reason: str | None = None, logprobs: dict | None = None) -> dict:
    """A ``chat.completion.chunk`` stream event with one choice's ``delta``."""
    return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": reason, "logprobs": logprobs}]}


def completion_response(rid: str, model: str, out, token_text: TokenText | None = None) -> dict:
    """A ``text_completion`` object for a finished generation ``out`` (logprobs when asked for)."""
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": out.text, "finish_reason": finish_reason(out),
                         "logprobs": completion_logprobs(out.logprobs, token_text)}],
            "usage": usage(out), "swiftspec": extension(out)}


def completion_chunk(rid: str, model: str, text: str, reason: str | None = None,
                     logprobs: dict | None = None) -> dict:
    """A ``text_completion`` stream event with one choice's new ``text``."""
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": reason, "logprobs": logprobs}]}
