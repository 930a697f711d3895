"""``swiftspec serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn, SSE for streams).

Endpoints: ``GET /v1/models``, ``POST /v1/chat/completions``, ``POST /v1/completions`` (with
``suffix`` for fill-in-the-middle), ``GET /health``, ``GET /metrics`` (Prometheus text format).

Every request is checked before any work (:mod:`swiftspec.entrypoints.http_guard`: key or
browser checks, body size, strict JSON; :mod:`swiftspec.entrypoints.openai_protocol`: fields and
limits), then waits for its turn at the engine (:mod:`swiftspec.entrypoints.engine_host`: FIFO,
429 past ``max_queue``, a failure answered as the request's own, a dead worker's engine
restarted). Chat message contents keep special-token text as text
(:mod:`swiftspec.entrypoints.chat_encoding`); ``/v1/completions`` prompts are encoded untouched.
A stream's every write must complete within ``write_timeout_s``, so a client that stops reading
releases the engine. Prompt text and keys are never logged.
"""

import asyncio
import contextlib
import json
from collections.abc import Callable

from swiftspec.entrypoints import openai_protocol as oai
from swiftspec.entrypoints.chat_encoding import chat_ids, special_texts
from swiftspec.entrypoints.engine_host import EngineHost
from swiftspec.entrypoints.http_guard import Guard, ServerOptions, WriteDeadline, header_timeout_protocol
from swiftspec.entrypoints.openai_protocol import APIError

__all__ = ["EngineHost", "ServerOptions", "build_app", "serve", "sse"]


def sse(obj) -> str:
    """One server-sent event: ``data: <JSON of obj, or obj itself if a str>`` and a blank line."""
    return f"data: {json.dumps(obj) if not isinstance(obj, str) else obj}\n\n"


def timed_stream(events, write_timeout_s: float):
    """A ``text/event-stream`` StreamingResponse of ``events`` (an async iterator of str) whose
    every write must complete within ``write_timeout_s`` seconds: past it the reply is dropped
    unfinished (uvicorn closes the connection) and ``events`` is closed, which cancels the request."""
    from fastapi.responses import StreamingResponse

    class TimedStream(StreamingResponse):
        async def stream_response(self, send) -> None:
            deadline = WriteDeadline(write_timeout_s)
            try:
                with deadline:
                    await super().stream_response(deadline.wrap(send))
            except asyncio.CancelledError:
                if not deadline.expired:
                    raise
                asyncio.current_task().uncancel()  # the client stopped reading: the reply ends here
            finally:
                await self.body_iterator.aclose()

    return TimedStream(events, media_type="text/event-stream")


class _App:
    """The request handlers of one server: ``host``'s engine served as ``model_name``."""

    def __init__(self, host: EngineHost, model_name: str, opts: ServerOptions):
        from dataclasses import replace

        self.host, self.model_name, self.metrics = host, model_name, host.metrics
        self.opts = replace(opts, limits=replace(opts.limits, max_model_len=host.engine.config.max_model_len))
        self.guard = Guard(self.opts)
        self.specials = () if opts.special_tokens_in_messages else special_texts(host.engine.tokenizer)
        self.has_fim = oai.has_fim_tokens(host.engine.tokenizer)

    def admit(self, request, key: bool = True) -> None:
        """Browser checks (without a key) and, where ``key``, the API key. Raises APIError."""
        self.guard.check_browser(request.method, request.headers)
        if key:
            self.guard.check_key(request.headers)

    async def body(self, request) -> dict:
        """An admitted request's JSON object, for this server's model. Raises APIError."""
        self.admit(request)
        body = await self.guard.read_json(request)
        if body.get("model") not in (None, self.model_name):
            raise APIError(400, f"model {str(body.get('model'))[:100]!r} does not exist; this server runs "
                                f"{self.model_name!r}", "model", code="model_not_found")
        return body

    def chat_encoder(self, messages: list[dict]) -> Callable[[object], list[int]]:
        """``engine -> prompt ids`` of chat ``messages`` (special-token text in contents as text,
        unless the server parses it)."""
        def encode(engine) -> list[int]:
            ids = chat_ids(engine.tokenizer, messages, self.specials)
            return ids if ids is not None else engine.encode(messages)
        return encode

    async def generate(self, request, endpoint: str, encode, chat: bool, params, stream: bool,
                       include_usage: bool):
        """Serve one admitted request: a JSON reply, or an SSE stream (its first chunk, or its
        error, before the 200 header goes out)."""
        rid = oai.new_id("chatcmpl" if chat else "cmpl")
        token_text = oai.TokenText(self.host.engine.tokenizer) if params.logprobs is not None else None
        gen = self.host.run(encode, params, request.is_disconnected)
        if not stream:
            return await self.reply(request, endpoint, gen, rid, chat, token_text)
        try:
            first = await gen.__anext__()
        except StopAsyncIteration:  # ended before its first chunk: the client left during the prefill
            raise APIError(499, "the client disconnected before the first token") from None
        return timed_stream(self.events(endpoint, gen, first, rid, chat, token_text, include_usage),
                            self.opts.write_timeout_s)

    async def reply(self, request, endpoint: str, gen, rid: str, chat: bool, token_text):
        """The non-streamed reply: the finished generation as one JSON object (499 and the request
        cancelled when the client disconnects first)."""
        from fastapi.responses import PlainTextResponse

        out = None
        async with contextlib.aclosing(gen):
            async for chunk in gen:
                if chunk.finished:
                    out = chunk.output
                elif await request.is_disconnected():
                    await gen.aclose()  # cancels the request; frees the engine
                    return PlainTextResponse("", status_code=499)
        if out is None:  # ended without its output: the client left during the prefill
            return PlainTextResponse("", status_code=499)
        self.metrics.record(out)
        self.metrics.requests.labels(endpoint, "200").inc()
        make = oai.chat_response if chat else oai.completion_response
        return make(rid, self.model_name, out, token_text)

    def chunk_event(self, chunk, rid: str, chat: bool, token_text, offset: int) -> tuple[str, int]:
        """``(SSE event, new text offset)`` of one engine chunk with text or logprobs."""
        if chat:
            return sse(oai.chat_chunk(rid, self.model_name, {"content": chunk.text}, None,
                                      oai.chat_logprobs(chunk.logprobs, token_text))), offset
        lp = oai.completion_logprobs(chunk.logprobs, token_text, offset)
        offset += sum(map(len, lp["tokens"])) if lp else 0
        return sse(oai.completion_chunk(rid, self.model_name, chunk.text, None, lp)), offset

    def final_events(self, out, rid: str, chat: bool, include_usage: bool):
        """The SSE events after the last text: finish reason, usage (if asked for), ``[DONE]``."""
        reason = oai.finish_reason(out)
        yield sse(oai.chat_chunk(rid, self.model_name, {}, reason) if chat else
                  oai.completion_chunk(rid, self.model_name, "", reason))
        if include_usage:
            final = oai.chat_chunk(rid, self.model_name, {}) if chat else oai.completion_chunk(rid, self.model_name, "")
            final.update(choices=[], usage=oai.usage(out), swiftspec=oai.extension(out))
            yield sse(final)
        yield sse("[DONE]")

    async def events(self, endpoint: str, gen, first, rid: str, chat: bool, token_text, include_usage: bool):
        """The SSE events of a stream whose first engine chunk is ``first``; an error after the
        200 header is sent as an error event (no ``[DONE]``)."""
        chunk, out, offset = first, None, 0
        if chat:
            yield sse(oai.chat_chunk(rid, self.model_name, {"role": "assistant", "content": ""}))
        try:
            while chunk is not None:
                if chunk.text or chunk.logprobs:
                    event, offset = self.chunk_event(chunk, rid, chat, token_text, offset)
                    yield event
                if chunk.finished:
                    out = chunk.output
                chunk = await gen.__anext__()
        except StopAsyncIteration:
            pass
        except APIError as e:
            self.metrics.requests.labels(endpoint, str(e.status)).inc()
            yield sse(e.body())
            return
        finally:
            await gen.aclose()
        for event in self.final_events(out, rid, chat, include_usage):
            yield event
        self.metrics.record(out)
        self.metrics.requests.labels(endpoint, "200").inc()

    async def chat_completions(self, request):
        """``POST /v1/chat/completions``."""
        body = await self.body(request)
        params, stream, include_usage = oai.sampling_params(body, None, True, self.opts.limits)
        messages = oai.chat_messages(body, self.opts.limits.max_messages)
        return await self.generate(request, "/v1/chat/completions", self.chat_encoder(messages), True, params,
                                   stream, include_usage)

    async def completions(self, request):
        """``POST /v1/completions``: the prompt encoded untouched (token ids as given)."""
        body = await self.body(request)
        params, stream, include_usage = oai.sampling_params(body, 16, False, self.opts.limits)
        prompt = oai.completion_prompt(body, self.has_fim)
        encode = (lambda engine: list(prompt)) if isinstance(prompt, list) else (lambda engine: engine.encode(prompt))
        return await self.generate(request, "/v1/completions", encode, False, params, stream, include_usage)


def _add_error_handlers(app, metrics) -> None:
    """APIError -> its OpenAI error body; anything else a handler raised -> 500 with its type
    only (no traceback or input echoed to the client)."""
    from fastapi import Request
    from fastapi.responses import JSONResponse

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        metrics.requests.labels(request.url.path, str(exc.status)).inc()
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        return await _api_error(request, APIError(500, f"internal error ({type(exc).__name__})"))


def _add_routes(app, a: _App) -> None:
    """The endpoints (see the module docstring), each admitted by ``a`` first."""
    from fastapi import Request
    from fastapi.responses import JSONResponse, PlainTextResponse

    @app.get("/health")
    async def health(request: Request):
        a.admit(request, key=False)
        if a.host.restarting:
            return JSONResponse({"status": "restarting", "reason": a.host.failure}, status_code=503)
        if a.host.restart_error is not None:
            return JSONResponse({"status": "failed", "error": a.host.restart_error}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus(request: Request):
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        a.admit(request)
        return PlainTextResponse(generate_latest(a.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request):
        a.admit(request)
        return {"object": "list", "data": [{"id": a.model_name, "object": "model", "created": 0,
                                            "owned_by": "swiftspec"}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await a.chat_completions(request)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await a.completions(request)


def build_app(host: EngineHost, model_name: str, opts: ServerOptions | None = None):
    """The FastAPI application serving ``host``'s engine as ``model_name`` under ``opts``'s
    limits and access rules (None: the defaults). Its shutdown closes the engine."""
    from fastapi import FastAPI

    @contextlib.asynccontextmanager
    async def lifespan(app):
        host.start_liveness()
        yield
        await host.aclose()  # uvicorn's graceful shutdown (SIGINT/SIGTERM): no worker outlives the server

    app = FastAPI(title="SwiftSpec", version="0.1", lifespan=lifespan)
    opts = opts or ServerOptions()
    _add_error_handlers(app, host.metrics)
    _add_routes(app, _App(host, model_name, opts))
    return app


def uvicorn_config(app, opts: ServerOptions, port: int, log_level: str = "info"):
    """A :class:`uvicorn.Config` for ``app`` with ``opts``'s connection limits: at most
    ``max_connections`` (more get 503), keep-alive ``keep_alive_s``, request heads within
    ``header_timeout_s`` (h11, :func:`~swiftspec.entrypoints.http_guard.header_timeout_protocol`)."""
    import uvicorn

    return uvicorn.Config(app, host=opts.bind_host, port=port, log_level=log_level,
                          http=header_timeout_protocol(opts.header_timeout_s),
                          limit_concurrency=opts.max_connections, timeout_keep_alive=opts.keep_alive_s)


def serve(make_engine: Callable[[], object], model_name: str, port: int = 8000, max_queue: int = 16,
          opts: ServerOptions | None = None) -> None:
    """Start the engine and serve it on ``opts.bind_host``:``port`` until SIGINT/SIGTERM: uvicorn
    shuts down gracefully (requests in flight finish), the application's shutdown closes the
    engine (:meth:`Engine.close` stops every worker), then uvicorn re-raises the signal, so the
    exit status is the signal's."""
    import uvicorn

    opts = opts or ServerOptions()
    if opts.api_key is None and opts.bind_host in ("0.0.0.0", "::"):
        print("swiftspec serve: listening on every interface without --api-key: anyone who can reach this "
              "port can use the model", flush=True)
    engine_host = EngineHost(make_engine, max_queue)
    try:
        uvicorn.Server(uvicorn_config(build_app(engine_host, model_name, opts), opts, port)).run()
    finally:
        engine_host.engine.close()
