"""`swiftspec serve` under load: a soak (attacks mixed in, or not), a restart, the server's overhead.

``soak``: starts ``swiftspec serve`` (engine flags after ``--``), then sends ``--requests``
requests in waves of ``--wave`` concurrent ones: valid chat / completion requests (streamed or
not, greedy or sampled, prompts from the shipped evaluation sets), streams the client closes
after two chunks, and bad requests (malformed JSON, unknown model, a parameter out of range,
``n`` = 2, a prompt longer than the context). Every valid request must be answered in full and
every bad one refused with an OpenAI error body; the resident memory (VmRSS) of the server and of
each of its worker processes is read after request 10 (``--attacks``: after the first wave) and
after the last one. Then one worker is killed: the request after it must get 503 at once, the
next one must be answered once the engine has restarted, and the restart's duration is read from
``/metrics``.

``soak --attacks``: the same, with the attack and fault cases of :mod:`server_attacks` (``--cases``;
default: every case that does not restart the engine on purpose) run one at a time between the
waves, each checked as ``attack`` checks it (status, restart, ``/health``, leftovers). The server
runs with the attacks' API key and short write / head timeouts (:data:`server_attacks.EDGE_FLAGS`,
before the flags after ``--``, which may override them) through :func:`server_attacks.serve_with_fault`.
Engine restarts over the soak are counted: intended (a case that kills or freezes a worker) or not.

``overhead``: :mod:`server_overhead` (``--prompts`` prompts, the six sets in turn).

    python bench/server_load.py soak --requests 50 --out bench/results/server-soak-xeon-avx512.json
    python bench/server_load.py soak --attacks --requests 40 --out bench/results/server-soak-attacks-skylake-2026-11-28.json
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
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

BENCH = Path(__file__).resolve().parent
if str(BENCH) not in sys.path:  # loaded by path (the tests): its sibling modules
    sys.path.insert(0, str(BENCH))
import server_attacks
import server_overhead
from server_proc import Server, machine_info, metric

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


def _attack_plan(attacks: list[str], waves: int) -> dict[int, list[str]]:
    """Which attack cases run after which wave: each once, spread evenly over the gaps between the
    ``waves`` waves (after the only wave when there is one)."""
    gaps = max(1, waves - 1)
    plan: dict[int, list[str]] = {}
    for j, name in enumerate(attacks):
        plan.setdefault(j * gaps // len(attacks), []).append(name)
    return plan


def soak(url: str, server: Server | None, prompts: list[str], requests: int = 50, wave: int = 5, seed: int = 0,
         headers: dict | None = None, rss_at: tuple[int, int] = (10, 50), attacks: list[str] | None = None) -> dict:
    """Run the soak against ``url`` (``server``: for memory readings); see the module docstring.

    ``attacks``: :data:`server_attacks.CASES` names, run one at a time between the waves
    (:func:`_attack_plan`) through :func:`server_attacks.run_case` (``server`` needed; the server
    started with :data:`server_attacks.EDGE_FLAGS`' key, or the cases that send it fail). The
    engine restarts over the whole soak are counted (``/metrics``); those of cases that restart
    it on purpose are ``restarts_intended``, every other one ``restarts_unintended``.
    """
    rng = random.Random(seed)
    kinds = rng.choices(VALID + ("cancel",) + BAD, weights=[3, 2, 1, 1, 2, 0.4, 0.4, 0.4, 0.4, 0.4], k=requests)
    records: list[dict] = []
    rss: dict[int, dict[str, float]] = {}
    waves = range(0, requests, wave)
    plan = _attack_plan(list(attacks or []), len(waves))
    cases: list[dict] = []
    seen: set[int] = set()
    restarts0 = metric(url, "swiftspec_engine_restarts_total", headers)
    with ThreadPoolExecutor(wave) as pool:
        for w, w0 in enumerate(waves):
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
            for name in plan.get(w, []):
                cases.append(server_attacks.run_case(name, server, seen) | {"after_request": done})
                print(f"after request {done}: {server_attacks.outcome(cases[-1])}", flush=True)
    valid = [r for r in records if r["kind"] in VALID]
    out = {"requests": requests, "wave": wave, "seed": seed,
           "counts": {k: sum(r["kind"] == k for r in records) for k in VALID + ("cancel",) + BAD},
           "valid": len(valid), "valid_answered": sum(r["ok"] for r in valid),
           "bad": sum(r["kind"] in BAD for r in records),
           "bad_refused_400": sum(r["ok"] for r in records if r["kind"] in BAD),
           "cancelled": sum(r["kind"] == "cancel" for r in records),
           "modes": sorted({r["mode"] for r in records if "mode" in r}),
           "failed": [r for r in records if not r["ok"]], "records": records}
    out["valid_lost"] = out["valid"] - out["valid_answered"]
    if attacks:
        restarts = int(metric(url, "swiftspec_engine_restarts_total", headers) - restarts0)
        intended = sum(c["restarted"] for c in cases if c["restart_expected"])
        out["attacks"] = {"cases": cases, "passed": sum(c["ok"] for c in cases), "total": len(cases)}
        out["restarts"] = {"total": restarts, "intended": intended, "unintended": restarts - intended}
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

# ---- command line -----------------------------------------------------------------------------


def _prompts(n: int) -> list[str]:
    from swiftspec.benchmark.records import DATASETS, load_prompts

    per = -(-n // len(DATASETS))
    sets = [load_prompts(ds, per)[1] for ds in DATASETS]
    return [sets[i % len(sets)][i // len(sets)] for i in range(n)]


def _print_soak(res: dict) -> None:
    print(f"mode {res['modes']}: valid {res['valid_answered']}/{res['valid']} answered (lost {res['valid_lost']}), "
          f"bad {res['bad_refused_400']}/{res['bad']} refused with 400, {res['cancelled']} cancelled; "
          f"failed: {len(res['failed'])}")
    if "restarts" in res:
        r = res["restarts"]
        print(f"attacks as expected: {res['attacks']['passed']}/{res['attacks']['total']}; engine restarts "
              f"{r['total']} (intended {r['intended']}, unintended {r['unintended']})")
    first, last = sorted(res.get("rss_mib", {}), key=int) or (None, None)
    for p, g in res.get("rss_growth", {}).items():
        print(f"  RSS {p}: {res['rss_mib'][first][p]:.0f} (request {first}) -> {res['rss_mib'][last][p]:.0f} MiB "
              f"(request {last}) ({100 * g:+.1f} %)")
    r = res["restart"]
    print(f"restart: {r['first_status']} after {r['first_s']:.2f} s, next request {r['next_status']} after "
          f"{r['next_s']:.1f} s, engine restart {r['restart_s']:.1f} s")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    engine_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="engine flags (as for `swiftspec serve`) go after --")
    ap.add_argument("what", choices=["soak", "overhead", "attack"])
    ap.add_argument("--attacks", action="store_true", help="soak: run the attack cases between the waves")
    ap.add_argument("--cases", help="attack, soak --attacks: comma-separated case names (default: all; soak: "
                                    "all that do not restart the engine on purpose)")
    ap.add_argument("--requests", type=int, default=50, help="soak: requests in all")
    ap.add_argument("--wave", type=int, default=5, help="soak: requests sent at once")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompts", type=int, default=10, help="overhead: prompts (the six sets in turn)")
    ap.add_argument("--max-tokens", type=int, default=64, help="overhead: tokens per request")
    ap.add_argument("--repeats", type=int, default=1, help="overhead: paired runs per prompt")
    ap.add_argument("--out", help="write the JSON record here")
    args = ap.parse_args(argv)

    cases = args.cases.split(",") if args.cases else None
    unknown = sorted(set(cases or []) - set(server_attacks.CASES))
    if unknown:
        ap.error(f"unknown cases {unknown}; known: {', '.join(server_attacks.CASES)}")
    record = {"machine": machine_info(), "argv": ["bench/server_load.py", *argv,
                                                  *(["--", *engine_args] if engine_args else [])]}
    if args.what == "attack":
        res = server_attacks.attack(Server, cases, engine_args)
        print(f"{res['passed']}/{res['total']} cases as expected; left after SIGTERM: "
              f"{len(res['leftover_processes_at_exit'])} processes, {len(res['leftover_shm_at_exit'])} segments")
        record["attack"] = res
        if args.out:
            Path(args.out).write_text(json.dumps(record, indent=1))
        return 0 if res["passed"] == res["total"] and not res["leftover_processes_at_exit"] else 1
    headers, attacks = {}, None
    if args.attacks:
        headers, attacks = server_attacks.AUTH, cases or server_attacks.SOAK_CASES
        server = Server([*server_attacks.EDGE_FLAGS, *engine_args], launcher=server_attacks.LAUNCHER)
    else:
        server = Server(engine_args)
    try:
        if args.what == "soak":
            res = soak(server.url, server, _prompts(30), args.requests, args.wave, args.seed, headers,
                       rss_at=(args.wave if args.attacks else 10, args.requests), attacks=attacks)
            res["restart"] = restart(server.url, server, headers)
            _print_soak(res)
        else:
            res = server_overhead.run(server.url, engine_args, _prompts(args.prompts), args.max_tokens, args.repeats)
    finally:
        leftovers = server.stop()
    res["leftover_processes"] = leftovers
    record[args.what] = res
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1))
    ok = not leftovers and (not attacks or (res["valid_lost"] == 0 and res["restarts"]["unintended"] == 0
                                            and res["attacks"]["passed"] == res["attacks"]["total"]))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
