"""The server's engine: one :class:`~swiftspec.engine.llm_engine.Engine`, its FIFO admission, the
classification of a request's failure, and the engine's restart after a worker died.

Latency first: one request decodes at a time; the others wait in arrival order (FIFO), at most
``max_queue`` of them, and the next one gets 429. A request's prompt is encoded inside its turn,
off the event loop (a long prompt's tokenization does not stall other clients' streams). The
engine's stream runs on the event loop itself (``Engine.stream(nowait=True)``: it yields None
instead of blocking, and the loop waits for the workers' pipes to become readable), so each chunk
wakes one thread of the server, not an engine thread and then the loop. A client that
disconnects closes the stream, which cancels the request in the workers (the wait for their
acknowledgement runs off the loop).

A failure is the request's own unless the engine cannot serve: a bad prompt or parameter is a
400; a request that raised in a worker that lives on
(:class:`~swiftspec.engine.outputs.RequestError`), or in the server, a 500; only a dead or
stuck worker (:class:`~swiftspec.engine.outputs.WorkerError`) gives 503 and restarts the engine
in the background while holding the slot, so queued requests wait for it (they are not failed)
and ``/health`` answers 503 ``{"status": "restarting", "reason": ...}`` meanwhile.

Between requests the host pings the idle engine every ``liveness_interval_s`` of its configuration
(:meth:`~swiftspec.engine.llm_engine.Engine.ping`, holding the slot for the round trip): a worker
that froze or hung while idle fails the ping and the engine is restarted the same way, before a
request waits on it.
"""

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable

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
        """Count a finished :class:`~swiftspec.engine.outputs.GenerationOutput`'s tokens and timings."""
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
        self.failure: str | None = None  # why the engine last failed (what a restart in progress mends)
        self._liveness_task: asyncio.Task | None = None

    @property
    def restarting(self) -> bool:
        """Whether an engine restart runs now (``/health`` answers 503 meanwhile)."""
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
        """Restart the engine off the loop, then pass the slot to the next request."""
        try:
            await asyncio.get_running_loop().run_in_executor(None, self._restart)
        finally:
            self._lock.release()

    def start_liveness(self) -> None:
        """Start pinging the idle engine every ``config.liveness_interval_s`` seconds (none where
        that is None). Call from the event loop (the application's startup)."""
        interval = getattr(getattr(self.engine, "config", None), "liveness_interval_s", None)
        if interval is not None and self._liveness_task is None:
            self._liveness_task = asyncio.get_running_loop().create_task(self._liveness(interval))

    async def _liveness(self, interval: float) -> None:
        """Every ``interval`` seconds, when no request holds the slot: ping the engine in the slot;
        a failed ping restarts the engine (the slot passes to the restart)."""
        from swiftspec.engine.outputs import EngineError

        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(interval)
            if self._lock.locked() or self.restart_error is not None:
                continue  # a request runs (its progress deadline watches it), or the next one restarts
            await self._lock.acquire()
            try:
                await loop.run_in_executor(None, self.engine.ping)
            except (EngineError, OSError) as e:  # a frozen, hung or dead worker: the engine is closed
                self.failure = f"liveness ping failed: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
                print(f"swiftspec serve: {self.failure}; restarting the engine", flush=True)
                self._restart_task = loop.create_task(self._restart_then_release())
                continue
            except BaseException:
                self._lock.release()
                raise
            self._lock.release()

    async def aclose(self) -> None:
        """Stop the liveness pings and the engine's workers, after a restart in progress (which
        would start new ones)."""
        if self._liveness_task is not None:
            self._liveness_task.cancel()
            with contextlib.suppress(BaseException):
                await self._liveness_task
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

    async def run(self, encode: Callable[[object], list[int]], params,
                  is_gone: Callable[[], Awaitable[bool]] | None = None) -> AsyncIterator:
        """Yield the engine's :class:`~swiftspec.engine.outputs.StreamChunk` s for one request,
        after waiting for its turn. ``encode(engine)`` gives the prompt's token ids (run in a
        thread, in the request's turn). Stopping the iteration (a disconnected client) cancels it.
        ``is_gone()`` (the client disconnected?) is asked when the turn comes and at least every
        second while no chunk arrives (the prefill), so a client that left while queued or before
        its first token costs no more of the engine.

        Raises:
            APIError: 429 (queue full), 400 (the prompt could not be encoded, or the engine refused
                it or the parameters), 499 (the client left before its turn), 500 (the request
                failed; the engine serves on), 503 (a worker died: the engine is restarted before
                the slot is released)."""
        async with self.slot():
            if is_gone is not None and await is_gone():
                raise APIError(499, "the client disconnected while its request waited for the engine")
            loop = asyncio.get_running_loop()
            engine = self.engine
            try:
                ids = await loop.run_in_executor(None, encode, engine)
            except APIError:
                raise
            except Exception as e:  # the template or tokenizer refused this prompt
                raise APIError(400, f"the prompt could not be encoded ({type(e).__name__}: {e})", "messages") from e
            error = None
            try:
                async with contextlib.aclosing(self._chunks(engine, ids, params, is_gone)) as chunks:
                    async for chunk in chunks:
                        yield chunk
            except Exception as e:  # noqa: BLE001 - classified below
                error = e
            if error is not None:
                raise self._classify(error)

    async def _chunks(self, engine, ids: list[int], params,
                      is_gone: Callable[[], Awaitable[bool]] | None = None) -> AsyncIterator:
        """The engine's stream of one request, driven from the event loop (see the module
        docstring); it ends early (the request cancelled) once ``is_gone()`` says the client left."""
        import anyio

        loop = asyncio.get_running_loop()
        gen = engine.stream(ids, params, nowait=True)
        ready = asyncio.Event()  # a worker wrote to its pipe, or exited
        fds = engine.wait_fds()
        asked = time.monotonic()
        for fd in fds:
            loop.add_reader(fd, ready.set)
        try:
            for chunk in gen:  # never blocks: None where it would wait for the workers
                if chunk is not None:
                    yield chunk
                    continue
                ready.clear()
                with anyio.move_on_after(1.0):  # resumed at least every second: a dead worker is noticed
                    await ready.wait()
                if is_gone is not None and time.monotonic() - asked >= 1.0:
                    asked = time.monotonic()
                    if await is_gone():
                        return  # the finally cancels the request in the workers
        finally:
            for fd in fds:
                loop.remove_reader(fd)
            if gen.gi_frame is not None:  # unfinished (client gone): cancel, the engine idle before the next
                with anyio_shield():  # closing cancels the request in the workers and waits for them
                    # (one iteration): off the event loop
                    try:
                        await loop.run_in_executor(None, gen.close)
                    except Exception as e:  # noqa: BLE001 - the workers died meanwhile: restart
                        self._classify(e)

    def _classify(self, error: Exception) -> APIError:
        """The reply to a request that raised ``error``; a dead worker also marks the engine for
        its restart when the slot ends."""
        from swiftspec.engine.outputs import EngineError, RequestError

        if isinstance(error, APIError):
            return error
        if isinstance(error, (ValueError, TypeError)):
            return APIError(400, str(error))
        detail = str(error).splitlines()[0] if str(error) else ""
        if isinstance(error, RequestError):
            return APIError(500, f"the request failed in the engine ({detail}); the engine serves on")
        if isinstance(error, (EngineError, OSError)):  # WorkerError is an EngineError; OSError: a pipe gone
            self._restart_pending = True
            cause = "a worker failed" if isinstance(error, EngineError) else type(error).__name__
            self.failure = f"{cause}: {detail}"
            return APIError(503, f"the engine failed ({cause}: {detail}); it is restarting, retry the request")
        return APIError(500, f"the request failed ({type(error).__name__}: {detail}); the engine serves on")


def anyio_shield():
    """A cancel scope that shields its body from the request's cancellation (client gone)."""
    import anyio

    return anyio.CancelScope(shield=True)
