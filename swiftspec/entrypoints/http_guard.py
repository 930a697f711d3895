"""The server's HTTP-level safety: API key, browser (cross-site and DNS-rebinding) checks, bounded
request bodies and JSON, timed writes to slow clients, and a header-read timeout for uvicorn.

Rules, each for a way one client could take the engine or the server from the others:

* A key, when set, is compared in constant time (:func:`hmac.compare_digest`); the scheme word
  ``Bearer`` in any case (RFC 9110 §11.1: auth schemes are case-insensitive).
* Without a key, a web page the user visits could otherwise POST to the server on 127.0.0.1: a
  POST must say ``Content-Type: application/json`` (a cross-site form cannot, and a page's fetch
  with it needs a CORS preflight that this server never grants), the ``Host`` header must name
  the bind address or localhost (a DNS-rebound name does not), and a browser's ``Origin`` must be
  such a host too. ``--allowed-hosts`` / ``--allowed-origins`` add names for deployments behind
  a proxy; bound to every interface (0.0.0.0 / ::) without ``--allowed-hosts``, any Host passes.
* A body is read up to ``max_body_bytes`` (413 past it) within ``body_timeout_s`` (408), and
  parsed as strict JSON (no NaN/Infinity); nesting that exhausts the parser's recursion is a 400.
* A streamed reply's every write must complete within ``write_timeout_s``: a client that stops
  reading is cut off, which cancels its request and frees the engine.
* :class:`HeaderTimeoutH11Protocol`: a connection must deliver a whole request head within
  ``header_timeout_s`` of opening (or of its previous reply), or it is closed (slowloris).
"""
from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from swiftspec.entrypoints.openai_protocol import APIError, Limits

LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")
ANY_INTERFACE = ("0.0.0.0", "::", "")


@dataclass(frozen=True)
class ServerOptions:
    """The server's limits and access rules (``swiftspec serve`` flags).

    Attributes:
        api_key: required as ``Authorization: Bearer <key>`` (also for ``/metrics``); None: no key,
            and the browser checks apply instead.
        bind_host: the address the server listens on (its Host names pass the browser check).
        allowed_hosts, allowed_origins: more Host names (without port) / Origins
            (``scheme://host[:port]``) accepted without a key; ``"*"`` accepts any.
        limits: request bounds (:class:`~swiftspec.entrypoints.openai_protocol.Limits`);
            ``max_model_len`` is taken from the engine.
        body_timeout_s, write_timeout_s, header_timeout_s: seconds to read a body, to write one
            streamed event, and to receive a request head.
        keep_alive_s: an idle keep-alive connection is closed after this many seconds.
        max_connections: open connections (and requests) at once; more get 503 from uvicorn.
        special_tokens_in_messages: parse special-token text inside chat message contents as
            control tokens (False: encode it as plain text, so a user cannot forge a role turn).
    """

    api_key: str | None = None
    bind_host: str = "127.0.0.1"
    allowed_hosts: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()
    limits: Limits = field(default_factory=Limits)
    body_timeout_s: float = 30.0
    write_timeout_s: float = 30.0
    header_timeout_s: float = 10.0
    keep_alive_s: float = 5.0
    max_connections: int = 64
    special_tokens_in_messages: bool = False


def _host_name(host: str) -> str:
    """The host part of a Host header or netloc, lower case, without port or IPv6 brackets."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host[1:]
    if host.count(":") == 1:
        host = host.split(":", 1)[0]
    return host


def _is_loopback(name: str) -> bool:
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return name == "localhost"


class Guard:
    """The access checks of one server (see the module docstring for the rules)."""

    def __init__(self, opts: ServerOptions):
        self.opts = opts
        self._key = None if opts.api_key is None else f"{opts.api_key}".encode()
        self._any_host = "*" in opts.allowed_hosts or (
            _host_name(opts.bind_host) in ANY_INTERFACE and not opts.allowed_hosts)
        self._hosts = {_host_name(h) for h in (*LOCAL_HOSTS, opts.bind_host, *opts.allowed_hosts)}
        self._origins = {o.rstrip("/").lower() for o in opts.allowed_origins}

    def check_key(self, headers) -> None:
        """Raise APIError(401) unless the ``Authorization`` header holds the key (no key: pass)."""
        if self._key is None:
            return
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if not (scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self._key)):
            raise APIError(401, "invalid or missing API key (Authorization: Bearer <key>)")

    def _host_ok(self, name: str) -> bool:
        return self._any_host or name in self._hosts or _is_loopback(name) and _is_loopback(
            _host_name(self.opts.bind_host))

    def check_browser(self, method: str, headers) -> None:
        """Without a key: refuse what a web page could send (see the module docstring).

        Raises:
            APIError: 403 for a Host or Origin not allowed, 415 for a POST without JSON."""
        if self._key is not None:
            return
        if not self._host_ok(_host_name(headers.get("host", ""))):
            raise APIError(403, "the Host header names no address of this server (add it with --allowed-hosts)")
        origin = headers.get("origin")
        if origin is not None and "*" not in self._origins and origin.rstrip("/").lower() not in self._origins:
            parts = urlsplit(origin)
            if parts.scheme not in ("http", "https") or not self._host_ok(_host_name(parts.netloc)):
                raise APIError(403, "cross-site request refused: Origin is not this server (add it with "
                                    "--allowed-origins, or set --api-key)")
        media = headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if method == "POST" and media != "application/json":
            raise APIError(415, "a POST body must be sent as Content-Type: application/json")

    async def read_json(self, request) -> dict:
        """The request's body as a JSON object, read and parsed within this server's bounds.

        Raises:
            APIError: 413 (more than ``max_body_bytes``), 408 (not received within
                ``body_timeout_s``), 400 (not JSON, NaN/Infinity, nested too deeply, or not an object)."""
        limit = self.opts.limits.max_body_bytes
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > limit:
            raise APIError(413, f"the body has {size} bytes; at most {limit} are accepted (--max-body-bytes)")
        data = bytearray()
        try:
            async with asyncio.timeout(self.opts.body_timeout_s):
                async for part in request.stream():
                    data += part
                    if len(data) > limit:
                        raise APIError(413, f"the body exceeds {limit} bytes (--max-body-bytes)")
        except TimeoutError:
            raise APIError(408, f"the body was not received within {self.opts.body_timeout_s:g} s") from None
        return parse_json_object(bytes(data))


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def parse_json_object(data: bytes) -> dict:
    """Strict JSON (no NaN/Infinity) that must be an object.

    Raises:
        APIError: 400 naming why (invalid, nested too deeply, not an object)."""
    try:
        body = json.loads(data, parse_constant=_no_constant)
    except RecursionError:
        raise APIError(400, "the body is nested too deeply") from None
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise APIError(400, f"the body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object")
    return body


class WriteDeadline:
    """A deadline on every write of one reply: a send (an ASGI send callable wrapped by
    :meth:`wrap`) that has not completed ``timeout_s`` seconds after it began cancels the task
    that awaits it (``expired`` is then True), within 1.5 ``timeout_s``.

    One watchdog timer per reply checks the write in progress, so a write costs two clock reads,
    not a timer of its own (``asyncio.timeout`` per write measured ~100 us on this project's CPU
    host, a timer heap operation each). Use as a context manager around the writes, in their task.
    """

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.since: float | None = None  # loop time the write in progress began
        self.expired = False
        self._handle: asyncio.TimerHandle | None = None

    def wrap(self, send):
        """``send`` with its calls watched."""
        loop = asyncio.get_running_loop()

        async def send_watched(message) -> None:
            self.since = loop.time()
            await send(message)
            self.since = None
        return send_watched

    def _check(self) -> None:
        now = self._loop.time()
        if self.since is not None and now - self.since >= self.timeout_s:
            self.expired = True
            self._task.cancel()
            return
        wait = self.timeout_s / 2 if self.since is None else self.since + self.timeout_s - now
        self._handle = self._loop.call_later(wait, self._check)

    def __enter__(self) -> "WriteDeadline":
        self._loop, self._task = asyncio.get_running_loop(), asyncio.current_task()
        self._handle = self._loop.call_later(self.timeout_s / 2, self._check)
        return self

    def __exit__(self, *exc) -> None:
        if self._handle is not None:
            self._handle.cancel()


def header_timeout_protocol(timeout_s: float):
    """A uvicorn h11 protocol class closing connections that send no whole request head within
    ``timeout_s`` seconds of opening or of their previous reply (uvicorn's own keep-alive timer
    stops at the first byte)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderTimeoutH11Protocol(H11Protocol):
        """:class:`uvicorn.protocols.http.h11_impl.H11Protocol` with a request-head deadline."""

        _head_timer: asyncio.TimerHandle | None = None

        def _arm(self) -> None:
            self._disarm()
            self._head_timer = self.loop.call_later(timeout_s, self._head_timeout)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timeout(self) -> None:
            self._head_timer = None
            if (self.cycle is None or self.cycle.response_complete) and not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def handle_events(self) -> None:
            super().handle_events()
            if self.cycle is not None and not self.cycle.response_complete:
                self._disarm()  # a whole head arrived: the request runs

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

    return HeaderTimeoutH11Protocol
