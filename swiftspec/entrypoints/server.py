"""``swiftspec serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn, SSE for streams).

Endpoints: ``GET /v1/models``, ``POST /v1/chat/completions``, ``POST /v1/completions`` (with
``suffix`` for fill-in-the-middle), ``GET /health``, ``GET /metrics`` (Prometheus text format).

Latency first: one request decodes at a time; the others wait in arrival order (FIFO), at most
``max_queue`` of them, and the next one gets 429. The engine's stream runs on the event loop
itself (``Engine.stream(nowait=True)``: it yields None instead of blocking, and the loop waits
for the workers' pipes to become readable), so each chunk wakes one thread of the server, not an
engine thread and then the loop: on a machine whose cores all decode, every wake-up takes time
from the workers. A client that disconnects closes the stream, which cancels the request in the
workers (:meth:`swiftspec.engine.llm_engine.Engine.stream`; the wait for their acknowledgement runs off the
loop), so the engine is free for the next request one iteration later. A dead worker (:class:`~swiftspec.engine.llm_engine.WorkerError`)
gives the request in flight 503 at once; the engine is then restarted in the background while
holding the slot, so queued requests wait for it (they are not failed) and ``/health`` answers 503
``{"status": "restarting"}`` meanwhile. The restart takes as long as an engine start (models
already converted in the cache; the ``swiftspec_engine_restart_seconds`` gauge has the last one).
"""

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable

from swiftspec.entrypoints import openai_protocol as oai
from swiftspec.entrypoints.openai_protocol import APIError


class Metrics:
    """The server's Prometheus metrics, in a registry of its own."""

    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry()
        self.requests = Counter("swiftspec_requests", "requests by endpoint and status", ["endpoint", "status"],
                                registry=r)
        self.tokens = Counter("swiftspec_generated_tokens", "generated tokens", registry=r)
        self.prompt_tokens = Counter("swiftspec_prompt_tokens", "prompt tokens", registry=r)
        self.ttft = Histogram("swiftspec_ttft_seconds", "time to first token", registry=r,
                              buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32))
        self.tbt = Histogram("swiftspec_tbt_seconds", "mean time between tokens per request", registry=r,
                             buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.4, 0.8))
        self.compression = Histogram("swiftspec_compression_ratio", "verified tokens per target forward",
                                     registry=r, buckets=(1, 1.5, 2, 2.5, 3, 4, 5, 6, 8))
        self.queue = Gauge("swiftspec_queue_depth", "requests waiting for the engine", registry=r)
        self.restarts = Counter("swiftspec_engine_restarts", "engine restarts after a worker died", registry=r)
        self.restart_s = Gauge("swiftspec_engine_restart_seconds", "duration of the last engine restart",
                               registry=r)

    def record(self, out) -> None:
        m = out.metrics
        self.tokens.inc(len(out.token_ids))
        self.prompt_tokens.inc(m.prompt_tokens)
        self.ttft.observe(m.ttft_s)
        if m.num_tokens > 1:
            self.tbt.observe(m.tbt_mean_s)
        self.compression.observe(m.compression_ratio)


class EngineHost:
    """One engine, its FIFO admission and its restart after a worker died.

    Args:
        make_engine: builds a started :class:`~swiftspec.engine.llm_engine.Engine` (called again to restart).
        max_queue: requests allowed to wait while one runs; more get 429.
    """

    def __init__(self, make_engine: Callable[[], object], max_queue: int = 16):
        self.make_engine = make_engine
        self.engine = make_engine()
        self.max_queue = max_queue
        self.metrics = Metrics()
        self._lock = asyncio.Lock()  # fair: waiters acquire in arrival order
        self._waiting = 0
        self._restart_pending = False  # set by run() when a worker died; handled when the slot ends
        self._restart_task: asyncio.Task | None = None
        self.restart_error: str | None = None  # why the last restart failed (None: the engine is up)

    @property
    def restarting(self) -> bool:
        return self._restart_task is not None and not self._restart_task.done()

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Wait for the engine in arrival order. Raises APIError(429) when ``max_queue`` wait."""
        if self._lock.locked() and self._waiting >= self.max_queue:
            raise APIError(429, f"{self._waiting} requests are already waiting (--max-queue {self.max_queue}); "
                                "retry later")
        self._waiting += 1
        self.metrics.queue.set(self._waiting)
        try:
            await self._lock.acquire()
        finally:
            self._waiting -= 1
            self.metrics.queue.set(self._waiting)
        try:
            if self.restart_error is not None:  # the last restart failed: try again for this request
                await asyncio.get_running_loop().run_in_executor(None, self._restart)
                if self.restart_error is not None:
                    raise APIError(503, f"the engine could not be restarted: {self.restart_error}")
            yield
        finally:
            if self._restart_pending:  # the slot passes to the restart; queued requests wait for it
                self._restart_pending = False
                self._restart_task = asyncio.get_running_loop().create_task(self._restart_then_release())
            else:
                self._lock.release()

    async def _restart_then_release(self) -> None:
        try:
            await asyncio.get_running_loop().run_in_executor(None, self._restart)
        finally:
            self._lock.release()

    async def aclose(self) -> None:
        """Stop the engine's workers, after a restart in progress (which would start new ones)."""
        if self._restart_task is not None:
            with contextlib.suppress(Exception):
                await self._restart_task
        self.engine.close()

    def _restart(self) -> None:
        """Close the engine (every worker stopped) and start a new one; a failure is kept in
        ``restart_error`` (the next request retries) instead of raised."""
        t0 = time.perf_counter()
        with contextlib.suppress(Exception):
            self.engine.close()
        try:
            self.engine = self.make_engine()
        except Exception as e:  # noqa: BLE001 - reported to the next request and in the log
            self.restart_error = f"{type(e).__name__}: {e}"
            print(f"swiftspec serve: engine restart failed: {self.restart_error}", flush=True)
            return
        self.restart_error = None
        dt = time.perf_counter() - t0
        self.metrics.restarts.inc()
        self.metrics.restart_s.set(dt)
        print(f"swiftspec serve: engine restarted after a worker died ({dt:.1f} s)", flush=True)

    async def run(self, prompt, params, chat: bool) -> AsyncIterator:
        """Yield the engine's :class:`~swiftspec.engine.llm_engine.StreamChunk` s for one request, after
        waiting for its turn. Stopping the iteration (a disconnected client) cancels it.

        Raises:
            APIError: 429 (queue full), 400 (the engine refused the prompt or parameters), 503
                (a worker died: the engine is restarted before the slot is released)."""
        import anyio

        from swiftspec.engine.llm_engine import EngineError, WorkerError

        async with self.slot():
            loop = asyncio.get_running_loop()
            gen = self.engine.stream(prompt, params, chat=chat, nowait=True)
            ready = asyncio.Event()  # a worker wrote to its pipe, or exited
            fds = self.engine.wait_fds()
            for fd in fds:
                loop.add_reader(fd, ready.set)
            error = None
            try:
                while True:
                    try:
                        chunk = next(gen)  # never blocks: None where it would wait for the workers
                    except StopIteration:
                        break
                    except Exception as e:  # noqa: BLE001 - reported to the request, below
                        error = e
                        break
                    if chunk is not None:
                        yield chunk
                        continue
                    ready.clear()
                    with anyio.move_on_after(1.0):  # resumed at least every second: a dead worker is noticed
                        await ready.wait()
            finally:
                for fd in fds:
                    loop.remove_reader(fd)
                if gen.gi_frame is not None:  # unfinished (client gone): cancel, the engine idle before the next
                    with anyio_shield():
                        try:  # closing cancels the request in the workers and waits for them (one
                            # iteration): off the event loop
                            await loop.run_in_executor(None, gen.close)
                        except Exception as e:  # noqa: BLE001 - the workers died meanwhile: restart below
                            error = error or e
                # a dead worker (WorkerError), or its pipe gone (OSError): restart when the slot ends
                self._restart_pending = error is not None and not isinstance(error, (ValueError, TypeError))
            if isinstance(error, (ValueError, TypeError)):
                raise APIError(400, str(error))
            if error is not None:
                cause = "a worker died" if isinstance(error, (WorkerError, EngineError)) else type(error).__name__
                detail = str(error).splitlines()[0] if str(error) else ""
                raise APIError(503, f"the engine failed ({cause}: {detail}); it is restarting, retry the request")


def anyio_shield():
    """A cancel scope that shields its body from the request's cancellation (client gone)."""
    import anyio

    return anyio.CancelScope(shield=True)


def sse(obj) -> str:
    return f"data: {json.dumps(obj) if not isinstance(obj, str) else obj}\n\n"


def build_app(host: EngineHost, model_name: str, api_key: str | None = None):
    """The FastAPI application serving ``host``'s engine as ``model_name``."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await host.aclose()  # uvicorn's graceful shutdown (SIGINT/SIGTERM): no worker outlives the server

    app = FastAPI(title="SwiftSpec", version="0.1", lifespan=lifespan)
    metrics = host.metrics

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        metrics.requests.labels(request.url.path, str(exc.status)).inc()
        return JSONResponse(exc.body(), status_code=exc.status)

    def _check_key(request: Request) -> None:
        if api_key is not None and request.headers.get("authorization") != f"Bearer {api_key}":
            raise APIError(401, "invalid or missing API key (Authorization: Bearer <key>)")

    async def _body(request: Request) -> dict:
        _check_key(request)
        try:
            body = await request.json()
        except ValueError as e:
            raise APIError(400, f"the body is not valid JSON: {e}") from e
        if not isinstance(body, dict):
            raise APIError(400, "the body must be a JSON object")
        if body.get("model") not in (None, model_name):
            raise APIError(400, f"model {body.get('model')!r} does not exist; this server runs {model_name!r}",
                           "model", code="model_not_found")
        return body

    @app.get("/health")
    async def health():
        if host.restarting:
            return JSONResponse({"status": "restarting"}, status_code=503)
        if host.restart_error is not None:
            return JSONResponse({"status": "failed", "error": host.restart_error}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request):
        _check_key(request)
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "swiftspec"}]}

    async def _serve(request: Request, endpoint: str, prompt, chat: bool, params, stream: bool, include_usage: bool):
        rid = oai.new_id("chatcmpl" if chat else "cmpl")
        token_text = oai.TokenText(host.engine.tokenizer) if params.logprobs is not None else None
        gen = host.run(prompt, params, chat)
        if not stream:
            out = None
            async for chunk in gen:
                if chunk.finished:
                    out = chunk.output
                elif await request.is_disconnected():
                    await gen.aclose()  # cancels the request; frees the engine
                    return PlainTextResponse("", status_code=499)
            metrics.record(out)
            metrics.requests.labels(endpoint, "200").inc()
            make = oai.chat_response if chat else oai.completion_response
            return make(rid, model_name, out, token_text)
        try:  # the first chunk (or the error) before the 200 header goes out
            first = await gen.__anext__()
        except StopAsyncIteration:
            first = None

        async def events():
            chunk, out, offset = first, None, 0
            if chat:
                yield sse(oai.chat_chunk(rid, model_name, {"role": "assistant", "content": ""}))
            try:
                while chunk is not None:
                    if chunk.text or chunk.logprobs:
                        if chat:
                            yield sse(oai.chat_chunk(rid, model_name, {"content": chunk.text}, None,
                                                     oai.chat_logprobs(chunk.logprobs, token_text)))
                        else:
                            lp = oai.completion_logprobs(chunk.logprobs, token_text, offset)
                            offset += sum(map(len, lp["tokens"])) if lp else 0
                            yield sse(oai.completion_chunk(rid, model_name, chunk.text, None, lp))
                    if chunk.finished:
                        out = chunk.output
                    chunk = await gen.__anext__()
            except StopAsyncIteration:
                pass
            except APIError as e:  # after the 200 header: the error goes in the stream
                metrics.requests.labels(endpoint, str(e.status)).inc()
                yield sse(e.body())
                return
            finally:
                await gen.aclose()
            reason = oai.finish_reason(out)
            yield sse(oai.chat_chunk(rid, model_name, {}, reason) if chat else
                      oai.completion_chunk(rid, model_name, "", reason))
            if include_usage:
                final = oai.chat_chunk(rid, model_name, {}) if chat else oai.completion_chunk(rid, model_name, "")
                final.update(choices=[], usage=oai.usage(out), swiftspec=oai.extension(out))
                yield sse(final)
            yield sse("[DONE]")
            metrics.record(out)
            metrics.requests.labels(endpoint, "200").inc()

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await _body(request)
        params, stream, include_usage = oai.sampling_params(body, host.engine.config.max_model_len)
        return await _serve(request, "/v1/chat/completions", oai.chat_messages(body), True, params, stream,
                            include_usage)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _body(request)
        params, stream, include_usage = oai.sampling_params(body, 16, chat=False)
        prompt = oai.completion_prompt(body, host.engine.tokenizer)
        return await _serve(request, "/v1/completions", prompt, False, params, stream, include_usage)

    return app


def serve(make_engine: Callable[[], object], model_name: str, host: str = "127.0.0.1", port: int = 8000,
          max_queue: int = 16, api_key: str | None = None) -> None:
    """Start the engine and serve it until SIGINT/SIGTERM: uvicorn shuts down gracefully (requests
    in flight finish), the application's shutdown closes the engine (:meth:`Engine.close` stops
    every worker), then uvicorn re-raises the signal, so the exit status is the signal's."""
    import uvicorn

    engine_host = EngineHost(make_engine, max_queue)
    try:
        uvicorn.run(build_app(engine_host, model_name, api_key), host=host, port=port, log_level="info")
    finally:
        engine_host.engine.close()
