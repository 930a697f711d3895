"""Worker liveness between requests, against one live `swiftspec serve` (tiny model): the idle
engine is pinged every ``liveness_interval_s``; a worker frozen (SIGSTOP) while idle fails the
ping, ``/health`` answers 503 with the reason while the engine restarts, then 200, and the next
request is served by new workers."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from swiftspec import Engine, SamplingParams  # noqa: E402
from swiftspec.engine.outputs import WorkerError  # noqa: E402
from swiftspec.entrypoints.server import EngineHost, ServerOptions, build_app, uvicorn_config  # noqa: E402
from tests.test_server import _free_port  # noqa: E402

KEY = "sk-test"
AUTH = {"Authorization": f"Bearer {KEY}"}


def _make(tiny_dir, **kw):
    return Engine(tiny_dir, mode="autoregressive", dtype="float32", target_cores=[0], **kw)


@pytest.fixture(scope="module")
def server(tiny_dir):
    import uvicorn

    host = EngineHost(lambda: _make(tiny_dir, liveness_interval_s=0.2, liveness_timeout_s=3.0))
    port = _free_port()
    opts = ServerOptions(api_key=KEY)
    srv = uvicorn.Server(uvicorn_config(build_app(host, "tiny", opts), opts, port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    while not srv.started:
        time.sleep(0.05)
    yield host, f"http://127.0.0.1:{port}"
    srv.should_exit = True
    thread.join(timeout=30)
    host.engine.close()


def _restarts(url: str) -> float:
    text = httpx.get(f"{url}/metrics", headers=AUTH).text
    return float(next(ln.split()[1] for ln in text.splitlines() if ln.startswith("swiftspec_engine_restarts_total")))


def _complete(url: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"prompt": "abc", "max_tokens": 4, "temperature": 0},
                      headers=AUTH, timeout=120)


def test_idle_engine_is_pinged_without_harm(server):
    host, url = server
    engine, pids = host.engine, list(host.engine.pids)
    time.sleep(1.0)  # several pings
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    assert _complete(url).status_code == 200
    assert host.engine is engine and host.engine.pids == pids and _restarts(url) == 0


def test_worker_frozen_while_idle_is_found_and_the_engine_restarts(server):
    host, url = server
    old = host.engine
    frozen = old.pids[0]
    restarts = _restarts(url)
    os.kill(frozen, signal.SIGSTOP)
    try:
        deadline, seen = time.monotonic() + 60, None
        while seen is None and time.monotonic() < deadline:  # no request sent: only the ping can find it
            r = httpx.get(f"{url}/health")
            if r.status_code != 200:
                seen = r
            time.sleep(0.05)
        assert seen is not None and seen.status_code == 503, "the frozen worker was not found"
        assert seen.json()["status"] == "restarting" and "liveness ping" in seen.json()["reason"]
        assert str(frozen) in seen.json()["reason"]
        while httpx.get(f"{url}/health").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert httpx.get(f"{url}/health").json() == {"status": "ok"}
        assert host.engine is not old and frozen not in host.engine.pids and _restarts(url) == restarts + 1
        assert _complete(url).status_code == 200
    finally:
        try:
            os.kill(frozen, signal.SIGCONT)
        except ProcessLookupError:
            pass  # the restart killed it


def test_ping_refused_while_a_request_runs(tiny_dir):
    with _make(tiny_dir, liveness_interval_s=None) as engine:
        engine.ping(5.0)
        gen = engine.stream("abc", SamplingParams(max_tokens=64))
        next(gen)
        with pytest.raises(RuntimeError, match="request is running"):
            engine.ping()
        gen.close()
        engine.ping(5.0)  # idle again
        os.kill(engine.pids[0], signal.SIGSTOP)
        with pytest.raises(WorkerError, match="liveness ping"):
            engine.ping(0.5)
        assert engine.pids and all(not os.path.exists(f"/proc/{p}") or _zombie(p) for p in engine.pids)


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "zombie" in f.read().lower()
    except FileNotFoundError:
        return True


def test_tp_follower_frozen_while_idle_fails_the_ping(tiny_dir):
    """A TP group's leader passes the engine's liveness ping on to its followers: a follower frozen
    between requests (its leader still answers) fails the ping, named, and the engine is closed."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 cores")
    with Engine(tiny_dir, mode="autoregressive", dtype="float32", target_tp=2, liveness_interval_s=None) as engine:
        engine.ping(5.0)  # both ranks answer
        leader, follower = engine.pids
        os.kill(follower, signal.SIGSTOP)
        try:
            with pytest.raises(WorkerError, match=rf"-1 \(pid {follower}\) did not answer a liveness ping"):
                engine.ping(1.0)
        finally:
            try:
                os.kill(follower, signal.SIGCONT)
            except ProcessLookupError:
                pass
        assert all(not os.path.exists(f"/proc/{p}") or _zombie(p) for p in (leader, follower))
