"""Where the engine's ranks meet: local worlds without a network listener, remote pipeline stages
behind a shared secret.

torch's ``TCPStore`` listens on every interface whatever address it is given, and anyone who
reaches it can read, write or delete its keys. So:

* A world whose ranks the engine spawned on this host rendezvous through a ``file://`` store in a
  private directory (:func:`private_dir`, mode 0700, removed when the engine closes), and their
  gloo / NCCL sockets are pinned to the loopback interface (:func:`pin_loopback`).
* A pipeline with stages on other hosts keeps a TCP store, but every key the run uses lives under
  a prefix derived from a shared secret (:data:`TOKEN_ENV`) with HMAC-SHA256 (:func:`token_prefix`):
  a peer without it cannot name those keys, so it can neither take a rank nor touch a heartbeat,
  and :func:`secure_tcp_store` refuses a joining stage whose secret differs from the leader's.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import socket
import tempfile
import time
from datetime import timedelta

import torch.distributed as dist

TOKEN_ENV = "SWIFTSPEC_PIPELINE_TOKEN"
MIN_TOKEN_CHARS = 16
_LEADER_UP = "swiftspec/leader-up"  # unprefixed: tells a joining stage that the leader is there
_LEADER_KEY = "leader"  # prefixed: only a holder of the secret can name it


def private_dir() -> str:
    """A new directory only this user can enter (``tempfile.mkdtemp``: mode 0700)."""
    return tempfile.mkdtemp(prefix="swiftspec-rdzv-")


def file_init_method(directory: str) -> str:
    """The ``file://`` init method of a world rendezvous in ``directory`` (see :func:`private_dir`)."""
    return "file://" + os.path.join(directory, "world")


def loopback_interface() -> str:
    """The name of this host's loopback interface ("lo" on Linux, "lo0" on macOS)."""
    names = [name for _, name in socket.if_nameindex()]
    for name in ("lo", "lo0"):
        if name in names:
            return name
    raise RuntimeError(f"no loopback interface among {names}")


def pin_loopback() -> None:
    """Make gloo and NCCL, in this process, listen and connect on the loopback interface only
    (``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``; gloo otherwise binds the address this host's
    name resolves to). Call before joining a world whose ranks all run on this host."""
    lo = loopback_interface()
    os.environ["GLOO_SOCKET_IFNAME"] = lo
    os.environ["NCCL_SOCKET_IFNAME"] = lo


def pipeline_token(env: dict | None = None) -> str:
    """The shared secret of a pipeline with remote stages, from :data:`TOKEN_ENV`.

    Raises:
        ValueError: unset, or shorter than :data:`MIN_TOKEN_CHARS` characters.
    """
    token = (os.environ if env is None else env).get(TOKEN_ENV, "")
    if len(token) < MIN_TOKEN_CHARS:
        raise ValueError(
            f"pipeline stages on other hosts need a shared secret: set {TOKEN_ENV} to the same value "
            f"(at least {MIN_TOKEN_CHARS} characters, e.g. `python -c \"import secrets; print(secrets.token_hex(16))\"`) "
            "on every host" + ("" if not token else f" (it has {len(token)})"))
    return token


def token_prefix(token: str) -> str:
    """The store key prefix of a run with shared secret ``token``: ``swiftspec/`` + 32 hex digits
    of HMAC-SHA256(token, "swiftspec pipeline store")."""
    return "swiftspec/" + hmac.new(token.encode(), b"swiftspec pipeline store", hashlib.sha256).hexdigest()[:32] + "/"


def secure_tcp_store(is_leader: bool, addr: str, port: int, world: int, token: str, timeout_s: float) -> dist.Store:
    """The run's view of a TCP store on ``addr:port`` (hosted by the leader), all keys under
    :func:`token_prefix`. The leader announces itself; a joining stage waits at most ``timeout_s``
    for the leader and checks that it holds the same secret.

    Raises:
        PermissionError: the leader is up but holds another secret (this stage is refused).
        RuntimeError: no leader within ``timeout_s`` (from torch's store, or here).
    """
    raw = dist.TCPStore(addr, port, world, is_master=is_leader, timeout=timedelta(seconds=timeout_s),
                        wait_for_workers=False)
    store = dist.PrefixStore(token_prefix(token), raw)
    if is_leader:
        store.set(_LEADER_KEY, "1")  # before the announcement: a stage that sees the one finds the other
        raw.set(_LEADER_UP, "1")
        return store
    deadline = time.monotonic() + timeout_s
    while not store.check([_LEADER_KEY]):
        if raw.check([_LEADER_UP]) and not store.check([_LEADER_KEY]):
            raise PermissionError(f"the pipeline leader at {addr}:{port} refused this stage: its {TOKEN_ENV} "
                                  "differs from this host's")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no pipeline leader at {addr}:{port} within {timeout_s:.0f} s")
        time.sleep(0.05)
    return store
