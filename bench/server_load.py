"""`swiftspec serve` under load: a soak, the server's overhead over direct engine calls, a restart.

``soak``: starts ``swiftspec serve`` (engine flags after ``--``), then sends ``--requests``
requests in waves of ``--wave`` concurrent ones: valid chat / completion requests (streamed or
not, greedy or sampled, prompts from the shipped evaluation sets), streams the client closes
after two chunks, and bad requests (malformed JSON, unknown model, a parameter out of range,
``n`` = 2, a prompt longer than the context). Every valid request must be answered in full and
every bad one refused with an OpenAI error body; the resident memory (VmRSS) of the server and of
each of its worker processes is read after request 10 and after the last one. Then one worker is
killed: the request after it must get 503 at once, the next one must be answered once the engine
has restarted, and the restart's duration is read from ``/metrics``.

``overhead``: the same engine twice, one in this process (``Engine.stream``) and one behind
``swiftspec serve``, alternating which goes first per prompt; greedy chat requests on
``--prompts`` prompts (the six sets in turn), both timed by the client: TTFT = request to first
text, decode tokens/s = (tokens - 1) / (last text - first text); the HTTP client is built once
and kept open, as API clients do. Reports medians and the spread
of the paired differences, and whether the texts are equal.

    python bench/server_load.py soak --requests 50 --out bench/results/server-soak-xeon-avx512.json
    python bench/server_load.py overhead --prompts 10 --repeats 3 --max-tokens 64 \\
        --out bench/results/server-overhead-xeon-avx512.json

``attack``: every attack and fault case of the server's tests against one server on the tests'
tiny model (:mod:`server_attacks`; no engine flags needed): per case the status, an engine
restart, ``/health`` after, the memory delta and leftover processes or shared-memory segments.

    python bench/server_load.py attack --out bench/results/server-attacks-skylake-2026-11-28.json

Each prints a summary and writes JSON (``--out``) with the machine, argv and every request or case.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

# ---- the server process ---------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (from /proc), zombies excluded."""
    parent: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            if fields[0] != "Z":
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
        """Every live process the server started (engine workers, multiprocessing's resource tracker)."""
        return children(self.proc.pid)

    def workers(self) -> list[int]:
        """The engine's worker processes (multiprocessing ``spawn`` children)."""
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
        """SIGTERM, wait; returns the descendants still alive afterwards (should be none)."""
        kids = self.descendants() if self.proc.poll() is None else []
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        time.sleep(0.5)
        return [p for p in kids if _alive(p)]


def _role(pid: int) -> str:
    """``worker`` (an engine worker), ``resource_tracker`` or ``other``, from the command line."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "other"
    if "resource_tracker" in cmd:
        return "resource_tracker"
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


# ---- requests ---------------------------------------------------------------------------------

VALID = ("chat", "chat_stream", "completion", "completion_stream")
BAD = ("bad_json", "bad_model", "bad_param", "n_2", "too_long")


def _sse_text(lines, chat: bool, stop_after: int | None = None) -> tuple[str, str | None, bool, int]:
    """(text, finish_reason, saw [DONE], content chunks) of an SSE stream."""
    text, reason, done, n = "", None, False, 0
    for line in lines:
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if data == "[DONE]":
            done = True
            break
        obj = json.loads(data)
        if "error" in obj:
            raise RuntimeError(f"error in the stream: {obj['error']}")
        for ch in obj.get("choices", []):
            piece = (ch.get("delta") or {}).get("content") if chat else ch.get("text")
            if piece:
                text += piece
                n += 1
            reason = ch.get("finish_reason") or reason
        if stop_after is not None and n >= stop_after:
            break
    return text, reason, done, n


def one_request(url: str, kind: str, prompt: str, rng: random.Random, headers: dict) -> dict:
    """Send one request of ``kind``; returns what happened (``ok``: the outcome it must have)."""
    chat = kind.startswith("chat") or kind in BAD or kind == "cancel"
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body: dict = {"max_tokens": rng.randint(4, 32), "temperature": rng.choice([0.0, 0.7]), "seed": rng.randint(0, 99)}
    body.update({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt})
    t0 = time.perf_counter()
    rec: dict = {"kind": kind}
    with httpx.Client(base_url=url, headers=headers, timeout=600) as c:
        if kind in BAD:
            if kind == "bad_json":
                r = c.post(path, content=b'{"messages": [', headers={"content-type": "application/json"})
            else:
                body.update({"bad_model": {"model": "no-such-model"}, "bad_param": {"temperature": 3.5},
                             "n_2": {"n": 2}, "too_long": {"messages": [{"role": "user",
                                                                         "content": "hello " * 6000}]}}[kind])
                r = c.post(path, json=body)
            rec.update(status=r.status_code, ok=r.status_code == 400 and "message" in r.json().get("error", {}))
        elif kind == "cancel":
            body["max_tokens"], body["stream"] = 64, True
            with c.stream("POST", path, json=body) as r:
                text, _, done, n = _sse_text(r.iter_lines(), chat, stop_after=2)
            rec.update(status=r.status_code, ok=r.status_code == 200, chunks_read=n)
        elif kind.endswith("_stream"):
            body["stream"] = True
            with c.stream("POST", path, json=body) as r:
                if r.status_code != 200:
                    r.read()
                    rec.update(status=r.status_code, ok=False, error=r.text[:300])
                    return rec
                text, reason, done, _ = _sse_text(r.iter_lines(), chat)
            rec.update(status=200, ok=done and reason in ("stop", "length"), finish_reason=reason, chars=len(text))
        else:
            r = c.post(path, json=body)
            ok = r.status_code == 200
            if ok:
                ch = r.json()["choices"][0]
                text = ch["message"]["content"] if chat else ch["text"]
                ok = isinstance(text, str) and ch["finish_reason"] in ("stop", "length") and \
                    r.json()["usage"]["completion_tokens"] >= 1
                rec.update(finish_reason=ch["finish_reason"], chars=len(text), mode=r.json()["swiftspec"]["mode"])
            rec.update(status=r.status_code, ok=ok)
    rec["seconds"] = time.perf_counter() - t0
    return rec


def soak(url: str, server: Server | None, prompts: list[str], requests: int = 50, wave: int = 5, seed: int = 0,
         headers: dict | None = None, rss_at: tuple[int, int] = (10, 50)) -> dict:
    """Run the soak against ``url`` (``server``: for memory readings); see the module docstring."""
    rng = random.Random(seed)
    kinds = rng.choices(VALID + ("cancel",) + BAD, weights=[3, 2, 1, 1, 2, 0.4, 0.4, 0.4, 0.4, 0.4], k=requests)
    records: list[dict] = []
    rss: dict[int, dict[str, float]] = {}
    with ThreadPoolExecutor(wave) as pool:
        for w0 in range(0, requests, wave):
            batch = [(kinds[i], rng.choice(prompts), random.Random(rng.random())) for i in range(w0, min(requests, w0 + wave))]
            futures = [pool.submit(one_request, url, k, p, r, headers or {}) for k, p, r in batch]
            for i, f in enumerate(futures):  # submitted at once, so they queue in the server
                rec = f.result()
                rec["index"] = w0 + i + 1
                records.append(rec)
            done = len(records)
            for at in rss_at:
                if server is not None and w0 < at <= done:
                    rss[at] = server.rss()
    valid = [r for r in records if r["kind"] in VALID]
    out = {"requests": requests, "wave": wave, "seed": seed,
           "counts": {k: sum(r["kind"] == k for r in records) for k in VALID + ("cancel",) + BAD},
           "valid": len(valid), "valid_answered": sum(r["ok"] for r in valid),
           "bad": sum(r["kind"] in BAD for r in records),
           "bad_refused_400": sum(r["ok"] for r in records if r["kind"] in BAD),
           "cancelled": sum(r["kind"] == "cancel" for r in records),
           "modes": sorted({r["mode"] for r in records if "mode" in r}),
           "failed": [r for r in records if not r["ok"]], "records": records}
    if len(rss) == 2:
        a, b = (rss[k] for k in sorted(rss))
        out["rss_mib"] = {str(k): v for k, v in rss.items()}
        out["rss_growth"] = {p: b[p] / a[p] - 1 for p in a if p in b}
    return out


def restart(url: str, server: Server, headers: dict | None = None) -> dict:
    """Kill one worker; the next request must get 503 at once, the one after it an answer."""
    body = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, "temperature": 0}
    with httpx.Client(base_url=url, headers=headers or {}, timeout=900) as c:
        # answered only once the engine is idle (streams the clients dropped may still be cancelling,
        # and a worker killed then would fail that cancellation, not the request measured here)
        c.post("/v1/chat/completions", json=body).raise_for_status()
        victim = server.workers()[0]
        os.kill(victim, signal.SIGKILL)
        t0 = time.perf_counter()
        r1 = c.post("/v1/chat/completions", json=body)
        t1 = time.perf_counter()
        health = c.get("/health").json()
        r2 = c.post("/v1/chat/completions", json=body)
        t2 = time.perf_counter()
    return {"killed_pid": victim, "first_status": r1.status_code, "first_s": t1 - t0,
            "health_after_503": health, "next_status": r2.status_code, "next_s": t2 - t1,
            "restart_s": metric(url, "swiftspec_engine_restart_seconds", headers),
            "ok": r1.status_code == 503 and r2.status_code == 200}


# ---- overhead ---------------------------------------------------------------------------------


def _timed(t0: float, stamps: list[float], text: str, n: int, engine_tokens_per_s: float) -> dict:
    """Client-side TTFT (request to first text) and decode tokens/s ((n - 1) / first-to-last text)."""
    first, last = stamps[0], stamps[-1]
    return {"ttft_s": first - t0, "tokens": n, "tokens_per_s": (n - 1) / (last - first) if n > 1 and last > first
            else float("nan"), "text": text, "engine_tokens_per_s": engine_tokens_per_s}


def _direct(engine, prompt: str, params) -> dict:
    t0 = time.perf_counter()
    stamps, text, out = [], "", None
    for chunk in engine.stream(prompt, params, chat=True):
        if chunk.text:
            stamps.append(time.perf_counter())
            text += chunk.text
        out = chunk.output or out
    return _timed(t0, stamps, text, len(out.token_ids), out.metrics.tokens_per_s)


def _http(client: httpx.Client, prompt: str, max_tokens: int) -> dict:
    """One streamed greedy chat request over ``client`` (kept open across requests, as API clients
    do: building an ``httpx.Client`` builds an SSL context, client-side time that is not the server's)."""
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    stamps, text, usage, ext = [], "", None, None
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            for ch in obj.get("choices", []):
                piece = (ch.get("delta") or {}).get("content")
                if piece:
                    stamps.append(time.perf_counter())
                    text += piece
            usage, ext = obj.get("usage") or usage, obj.get("swiftspec") or ext
    return _timed(t0, stamps, text, usage["completion_tokens"], ext["tokens_per_s"])


def _spread(xs: list[float]) -> dict:
    qs = statistics.quantiles(xs, n=10) if len(xs) > 1 else xs * 9
    return {"median": statistics.median(xs), "p10": qs[0], "p90": qs[-1], "min": min(xs), "max": max(xs)}


def overhead(engine, url: str, prompts: list[str], max_tokens: int, repeats: int = 1) -> dict:
    """Paired direct / HTTP runs, ``repeats`` pairs per prompt (see the module docstring)."""
    from swiftspec.model_executor.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    client = httpx.Client(base_url=url, timeout=600)
    _direct(engine, "Hello", SamplingParams(temperature=0.0, max_tokens=4))  # warm both paths
    _http(client, "Hello", 4)
    pairs = []
    for i, prompt in enumerate(p for p in prompts for _ in range(repeats)):
        runs = {}
        for way in (("direct", "http") if i % 2 == 0 else ("http", "direct")):
            runs[way] = _direct(engine, prompt, params) if way == "direct" else _http(client, prompt, max_tokens)
        pairs.append({"prompt": i // repeats, "first": "direct" if i % 2 == 0 else "http", **runs,
                      "ttft_added_ms": 1e3 * (runs["http"]["ttft_s"] - runs["direct"]["ttft_s"]),
                      "tokens_per_s_ratio": runs["http"]["tokens_per_s"] / runs["direct"]["tokens_per_s"],
                      "texts_equal": runs["http"]["text"] == runs["direct"]["text"]})
    client.close()
    return {"prompts": len(prompts), "repeats": repeats, "max_tokens": max_tokens, "pairs": pairs,
            "ttft_added_ms": _spread([p["ttft_added_ms"] for p in pairs]),
            "tokens_per_s_ratio": _spread([p["tokens_per_s_ratio"] for p in pairs]),
            "ttft_direct_s": statistics.median(p["direct"]["ttft_s"] for p in pairs),
            "ttft_http_s": statistics.median(p["http"]["ttft_s"] for p in pairs),
            "tokens_per_s_direct": statistics.median(p["direct"]["tokens_per_s"] for p in pairs),
            "tokens_per_s_http": statistics.median(p["http"]["tokens_per_s"] for p in pairs),
            "texts_equal": sum(p["texts_equal"] for p in pairs)}


# ---- command line -----------------------------------------------------------------------------


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


def _prompts(n: int) -> list[str]:
    from swiftspec.benchmark.records import DATASETS, load_prompts

    per = -(-n // len(DATASETS))
    sets = [load_prompts(ds, per)[1] for ds in DATASETS]
    return [sets[i % len(sets)][i // len(sets)] for i in range(n)]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    engine_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="engine flags (as for `swiftspec serve`) go after --")
    ap.add_argument("what", choices=["soak", "overhead", "attack"])
    ap.add_argument("--cases", help="attack: comma-separated case names (default: all)")
    ap.add_argument("--requests", type=int, default=50, help="soak: requests in all")
    ap.add_argument("--wave", type=int, default=5, help="soak: requests sent at once")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompts", type=int, default=10, help="overhead: prompts (the six sets in turn)")
    ap.add_argument("--max-tokens", type=int, default=64, help="overhead: tokens per request")
    ap.add_argument("--repeats", type=int, default=1, help="overhead: paired runs per prompt")
    ap.add_argument("--out", help="write the JSON record here")
    args = ap.parse_args(argv)

    record = {"machine": machine_info(), "argv": ["bench/server_load.py", *argv,
                                                  *(["--", *engine_args] if engine_args else [])]}
    if args.what == "attack":
        import server_attacks

        res = server_attacks.attack(Server, args.cases.split(",") if args.cases else None, engine_args)
        print(f"{res['passed']}/{res['total']} cases as expected; left after SIGTERM: "
              f"{len(res['leftover_processes_at_exit'])} processes, {len(res['leftover_shm_at_exit'])} segments")
        record["attack"] = res
        if args.out:
            Path(args.out).write_text(json.dumps(record, indent=1))
        return 0 if res["passed"] == res["total"] and not res["leftover_processes_at_exit"] else 1
    server = Server(engine_args)
    try:
        if args.what == "soak":
            res = soak(server.url, server, _prompts(30), args.requests, args.wave, args.seed,
                       rss_at=(10, args.requests))
            res["restart"] = restart(server.url, server)
            print(f"mode {res['modes']}: valid {res['valid_answered']}/{res['valid']} answered, bad {res['bad_refused_400']}/{res['bad']} "
                  f"refused with 400, {res['cancelled']} cancelled; failed: {len(res['failed'])}")
            for p, g in res.get("rss_growth", {}).items():
                print(f"  RSS {p}: {res['rss_mib']['10'].get(p, float('nan')):.0f} -> "
                      f"{res['rss_mib'][str(args.requests)][p]:.0f} MiB ({100 * g:+.1f} %)")
            r = res["restart"]
            print(f"restart: {r['first_status']} after {r['first_s']:.2f} s, next request {r['next_status']} after "
                  f"{r['next_s']:.1f} s, engine restart {r['restart_s']:.1f} s")
        else:
            from swiftspec.entrypoints import cli

            p = argparse.ArgumentParser()
            cli._add_engine_args(p)
            engine = cli.make_engine(p.parse_args(engine_args))
            try:
                res = overhead(engine, server.url, _prompts(args.prompts), args.max_tokens, args.repeats)
            finally:
                engine.close()
            t, s = res["ttft_added_ms"], res["tokens_per_s_ratio"]
            print(f"TTFT direct {res['ttft_direct_s']:.3f} s, HTTP {res['ttft_http_s']:.3f} s; added: median "
                  f"{t['median']:.1f} ms (p10 {t['p10']:.1f}, p90 {t['p90']:.1f})")
            print(f"decode tokens/s direct {res['tokens_per_s_direct']:.2f}, HTTP {res['tokens_per_s_http']:.2f}; "
                  f"ratio median {s['median']:.4f} (p10 {s['p10']:.4f}, p90 {s['p90']:.4f}); "
                  f"texts equal {res['texts_equal']}/{len(res['pairs'])}")
    finally:
        leftovers = server.stop()
    res["leftover_processes"] = leftovers
    record[args.what] = res
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1))
    return 0 if not leftovers else 1


if __name__ == "__main__":
    sys.exit(main())
