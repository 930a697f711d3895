"""``swiftspec serve`` as a subprocess for bench/server_load.py and bench/server_attacks.py: the
server on a free port of 127.0.0.1, its descendants (engine workers, multiprocessing's fork server
and resource tracker) and their resident memory read from /proc, one ``/metrics`` sample, and the
machine a record states."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stat(pid: int) -> list[str]:
    """The fields of ``/proc/<pid>/stat`` after the command name (state, parent pid, ...); [] if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return []
    return stat[stat.rindex(")") + 2:].split()


def children(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (from /proc), zombies excluded."""
    parent: dict[int, int] = {}
    for d in os.listdir("/proc"):
        fields = _stat(int(d)) if d.isdigit() else []
        if fields and fields[0] != "Z":
            parent[int(d)] = int(fields[1])
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += kids
        todo += kids
    return sorted(out)


def rss_mib(pid: int) -> float:
    """Resident memory of one process (VmRSS), MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class Server:
    """``swiftspec serve`` in a subprocess on a free port of 127.0.0.1.

    Args:
        engine_args: the engine's command-line flags (``--target``, ``--mode``, ...).
        timeout_s: how long the start may take (model conversion on a first run included).
        launcher: the command before the flags (default ``python -m swiftspec serve``).
    Raises:
        RuntimeError: the server exited or did not answer ``/health`` in time (its log attached).
    """

    def __init__(self, engine_args: list[str], timeout_s: float = 900.0, api_key: str | None = None,
                 launcher: list[str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile(mode="w+")
        cmd = [*(launcher or [sys.executable, "-m", "swiftspec", "serve"]), "--port", str(self.port), *engine_args]
        if api_key:
            cmd += ["--api-key", api_key]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while not self.healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"swiftspec serve did not start:\n{self.output()[-3000:]}")
            time.sleep(0.3)

    def healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def descendants(self) -> list[int]:
        """Every live process the server started (engine workers, multiprocessing's fork server and
        resource tracker)."""
        return children(self.proc.pid)

    def workers(self) -> list[int]:
        """The engine's worker processes."""
        return [p for p in self.descendants() if _role(p) == "worker"]

    def rss(self) -> dict[str, float]:
        """MiB per process: ``server``, and ``<role> <pid>`` for each descendant."""
        out = {"server": rss_mib(self.proc.pid)}
        for pid in self.descendants():
            try:
                out[f"{_role(pid)} {pid}"] = rss_mib(pid)
            except OSError:  # exited meanwhile
                pass
        return out

    def stop(self) -> list[int]:
        """SIGTERM, wait; returns the descendants still alive 10 s after the server exited (should be
        none: multiprocessing's fork server leaves once the server has, after its interpreter's
        teardown)."""
        kids = self.descendants() if self.proc.poll() is None else []
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        deadline = time.monotonic() + 10.0
        while any(_alive(p) for p in kids) and time.monotonic() < deadline:
            time.sleep(0.1)
        return [p for p in kids if _alive(p)]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _role(pid: int) -> str:
    """``worker`` (an engine worker: forked by multiprocessing's fork server, or spawned),
    ``fork_server``, ``resource_tracker`` or ``other``, from the command lines."""
    cmd = _cmdline(pid)
    if "resource_tracker" in cmd:
        return "resource_tracker"
    if "forkserver" in cmd:  # a forked worker keeps its fork server's command line
        parent = _stat(pid)[1:2]
        return "worker" if parent and "forkserver" in _cmdline(int(parent[0])) else "fork_server"
    return "worker" if "spawn_main" in cmd else "other"


def _alive(pid: int) -> bool:
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()
    except OSError:
        return False


def metric(url: str, name: str, headers: dict | None = None) -> float | None:
    """One sample of the server's Prometheus text (``name`` with no labels); ``headers``: the API
    key's, where the server has one (``/metrics`` is behind it)."""
    for line in httpx.get(f"{url}/metrics", headers=headers or {}, timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None



def machine_info() -> dict:
    """The CPU (model, cores, torch) and its SIMD flags, as every record states them."""
    import re

    from swiftspec.benchmark.kernel_timing import machine

    flags = sorted(set(re.findall(r"avx512[a-z_0-9]*|avx2", Path("/proc/cpuinfo").read_text())))
    versions = {}
    for mod in ("uvicorn", "fastapi", "uvloop", "httptools"):  # uvicorn's loop/parser: uvloop + httptools if present
        try:
            versions[mod] = __import__(mod).__version__
        except ImportError:
            versions[mod] = None
    return {"machine": machine(), "isa": flags, "server": versions}

