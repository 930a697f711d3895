#!/usr/bin/env python3
"""Probe whether this machine lets several processes share one GPU the way the engine needs.

Records to a JSON file (``--out``, written again after every check, so a killed run keeps what it
learned):

* ``cuda``: torch's view of the machine (from a child process, so this process never makes a
  CUDA context): available, device count, name, compute capability, torch / CUDA versions;
  ``nvidia_smi``: the GPU's compute mode and driver (``nvidia-smi``, when present).
* ``checks.cuda_ipc``: CUDA IPC between two processes on GPU 0. A producer allocates a CUDA tensor
  and sends it through a ``torch.multiprocessing`` queue (torch exports it with
  ``cudaIpcGetMemHandle``); a consumer process maps it (``cudaIpcOpenMemHandle``), checks the
  producer's values and writes its own, which the producer reads back.
* ``checks.ll_same_gpu``: two ranks on GPU 0 over a gloo group run swiftspec's CUDA LL all-reduce
  (:class:`swiftspec.ops.cuda_comm.CudaLLCommunicator`, the engine's path for ranks sharing a GPU):
  correctness, a CUDA-graph replay of it, the per-call latency in microseconds (median of 50
  calls; without MPS the GPU time-slices between the two processes). Needs the swiftspec checkout
  this script lives in and nvcc (its library is built first, ``--build-timeout``); "skipped" when
  either is missing. Only this check imports more than the standard library and torch.
* ``checks.mps``: whether CUDA MPS can be started: ``nvidia-cuda-mps-control -d`` (pipe and log
  directories in a fresh temporary directory), ``echo get_server_list | nvidia-cuda-mps-control``,
  a client capped with ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` (its SM count as torch reports it),
  ``get_server_list`` again, the LL check again under MPS with both ranks capped, and always
  ``echo quit | nvidia-cuda-mps-control`` at the end.

Every step runs as a subprocess in a session of its own, killed (the whole session) after
``--timeout`` seconds; its exact command, added environment, exit status, stdout / stderr tails and
duration are recorded. A failure or time-out is recorded as status "blocked", never raised; without
CUDA every GPU check is "skipped" with reason "no CUDA". Exit status 0 whenever the JSON was written.

Usage: ``python scripts/gpu_probe.py --out probe.json [--timeout 60] [--build-timeout 900]``
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from datetime import datetime, timedelta, timezone

HERE = os.path.abspath(__file__)
REPO = os.path.dirname(os.path.dirname(HERE))
TAIL = 4000  # characters of stdout / stderr kept per step
RESULT = "RESULT "  # a child's last line: RESULT {json}
MPS_PERCENT = 50  # each MPS client's share of the SMs: two LL ranks' grids fit side by side
LL_CALLS = 50


# ---------------------------------------------------------------------------------------------
# steps: subprocesses with a time limit, every outcome recorded
# ---------------------------------------------------------------------------------------------

def _tail(text: str) -> str:
    return text if len(text) <= TAIL else "..." + text[-TAIL:]


def run_step(cmd: list[str], timeout_s: float, *, env: dict[str, str] | None = None,
             stdin: str | None = None) -> dict:
    """Run ``cmd`` (a new session, stdin ``stdin``, ``env`` added to this environment) for at most
    ``timeout_s`` seconds; on time-out its whole session is killed. Output goes to files, not pipes,
    so a daemon that keeps them open cannot stall the wait. Returns the record: ``command`` (shell
    form), ``env``, ``stdin``, ``returncode`` (None if it could not start or timed out), ``timed_out``,
    ``seconds``, ``stdout`` / ``stderr`` tails, ``error`` (could not start) and ``result`` (the
    child's ``RESULT {json}`` line, parsed, or None). Never raises for the command's failure."""
    rec = {"command": shlex.join(cmd), "env": dict(env or {}), "stdin": stdin, "timeout_s": timeout_s,
           "returncode": None, "timed_out": False, "stdout": "", "stderr": "", "result": None}
    t0 = time.monotonic()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        try:
            p = subprocess.Popen(cmd, stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                                 stdout=out, stderr=err, text=True, env={**os.environ, **(env or {})},
                                 start_new_session=True)
        except OSError as e:
            rec.update(error=f"{type(e).__name__}: {e}", seconds=round(time.monotonic() - t0, 3))
            return rec
        try:
            if stdin is not None:
                p.stdin.write(stdin)
                p.stdin.close()
            rec["returncode"] = p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            rec["timed_out"] = True
            try:
                os.killpg(p.pid, signal.SIGKILL)  # the session this step started: it and its children
            except ProcessLookupError:
                pass
            p.wait()
        except OSError as e:  # stdin closed early by the command
            rec["error"] = f"{type(e).__name__}: {e}"
            rec["returncode"] = p.wait(timeout=timeout_s)
        rec["seconds"] = round(time.monotonic() - t0, 3)
        out.seek(0)
        err.seek(0)
        o, e = out.read(), err.read()
    rec["stdout"], rec["stderr"] = _tail(o), _tail(e)
    for line in reversed(o.splitlines()):
        if line.startswith(RESULT):
            try:
                rec["result"] = json.loads(line[len(RESULT):])
            except ValueError:
                pass
            break
    return rec


def _child(mode: str, timeout_s: float, env: dict | None = None, limit: float | None = None) -> dict:
    return run_step([sys.executable, HERE, "--child", mode, "--timeout", str(timeout_s)],
                    limit or timeout_s, env=env)


def _status(step: dict) -> str:
    r = step.get("result") or {}
    if step["returncode"] == 0 and r.get("status") in ("ok", "skipped"):
        return r["status"]
    return "blocked"


# ---------------------------------------------------------------------------------------------
# child modes (each prints RESULT {json} last)
# ---------------------------------------------------------------------------------------------

def _emit(obj: dict) -> None:
    print(RESULT + json.dumps(obj), flush=True)


def child_info() -> dict:
    import torch

    info = {"status": "ok", "torch": torch.__version__, "torch_cuda": torch.version.cuda,
            "available": torch.cuda.is_available(), "pid": os.getpid()}
    if info["available"]:
        p = torch.cuda.get_device_properties(0)
        info.update(device_count=torch.cuda.device_count(), name=p.name, capability=f"{p.major}.{p.minor}",
                    sm_count=p.multi_processor_count, memory_gib=round(p.total_memory / 2**30, 1))
        x = torch.ones(256, 256, device="cuda")
        info["matmul_ok"] = bool(((x @ x) == 256).all())
    return info


def _ipc_consumer(q_in, q_out) -> None:
    import torch

    try:
        y = q_in.get(timeout=60)  # mapped here with cudaIpcOpenMemHandle
        ok = bool(torch.equal(y[:16].cpu(), torch.arange(16, dtype=torch.float32)))
        y[:8] = -1.0
        torch.cuda.synchronize()
        q_out.put({"pid": os.getpid(), "device": str(y.device), "read_ok": ok})
        q_in.get(timeout=60)  # the producer's go-ahead: it no longer needs the mapping
    except BaseException:
        q_out.put({"pid": os.getpid(), "error": traceback.format_exc()})


def child_ipc(timeout_s: float) -> dict:
    import torch
    import torch.multiprocessing as tmp

    ctx = tmp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    x = torch.arange(1024, dtype=torch.float32, device="cuda")
    p = ctx.Process(target=_ipc_consumer, args=(q_in, q_out), daemon=True)
    p.start()
    try:
        q_in.put(x)  # exported with cudaIpcGetMemHandle
        reply = q_out.get(timeout=timeout_s)
        torch.cuda.synchronize()
        wrote = bool(torch.equal(x[:8].cpu(), torch.full((8,), -1.0))) if "error" not in reply else False
        q_in.put(None)
        p.join(timeout=timeout_s)
    finally:
        if p.is_alive():
            p.kill()
    ok = reply.get("read_ok") is True and wrote
    return {"status": "ok" if ok else "blocked", "producer_pid": os.getpid(), "consumer": reply,
            "consumer_wrote_visible_to_producer": wrote, "same_device": reply.get("device") == str(x.device)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ll_rank(rank: int, world: int, port: int, timeout_s: float, q) -> None:
    try:
        import torch
        import torch.distributed as dist

        sys.path.insert(0, REPO)
        from swiftspec.ops.cuda_comm import CudaLLCommunicator

        torch.cuda.set_device(0)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
        comm = CudaLLCommunicator(dist.group.WORLD, rank, world, timeout_s=timeout_s)
        want = float(sum(range(1, world + 1)))
        x = torch.full((1024,), float(rank + 1), device="cuda")
        comm.all_reduce(x)
        torch.cuda.synchronize()
        out = {"rank": rank, "pid": os.getpid(), "device": str(x.device),
               "sm_count": torch.cuda.get_device_properties(0).multi_processor_count,
               "all_reduce_ok": bool((x == want).all())}
        w = torch.full((64, 32), float(rank + 1), device="cuda")
        y = comm.gemm_all_reduce(torch.ones(1, 32, device="cuda"), w)
        out["gemm_all_reduce_ok"] = bool((y == 32 * want).all())
        g = torch.cuda.CUDAGraph()  # the LL kernel captured and replayed (the engine's TP > 1 graphs)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            comm.all_reduce(x.fill_(rank + 1.0))
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            comm.all_reduce(x)
        x.fill_(rank + 1.0)
        g.replay()
        torch.cuda.synchronize()
        out["graph_replay_ok"] = bool((x == want).all())
        lat = []
        for _ in range(LL_CALLS):  # the same count on both ranks: every call is collective
            t = time.perf_counter()
            comm.all_reduce(x)
            torch.cuda.synchronize()
            lat.append(time.perf_counter() - t)
        out["all_reduce_us"] = {"median": round(sorted(lat)[len(lat) // 2] * 1e6, 1),
                                "max": round(max(lat) * 1e6, 1), "calls": len(lat), "bytes": x.numel() * 4}
        comm.close()
        dist.destroy_process_group()
        q.put(json.dumps(out))
    except BaseException:
        q.put(json.dumps({"rank": rank, "error": traceback.format_exc()}))


def _cuda_ops():
    """(swiftspec.ops.cuda_build, None) from this checkout, or (None, the step's "skipped" record)
    where swiftspec is not importable or there is no nvcc to build the LL kernels."""
    sys.path.insert(0, REPO)
    try:
        from swiftspec.ops import cuda_build as sc
    except Exception as e:
        return None, {"status": "skipped", "reason": f"swiftspec is not importable from {REPO}: {e}"}
    if sc.nvcc_path() is None:
        return None, {"status": "skipped", "reason": "no nvcc: the LL kernels cannot be built"}
    return sc, None


def child_ll(timeout_s: float) -> dict:
    _, skipped = _cuda_ops()
    if skipped:
        return skipped
    from swiftspec.ops.cuda_lib import load

    load()  # built by the ll_build step before (cached)
    import torch.multiprocessing as tmp

    ctx = tmp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_ll_rank, args=(r, 2, port, timeout_s, q), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    replies = []
    try:
        for _ in procs:
            replies.append(json.loads(q.get(timeout=timeout_s)))
    except Exception as e:
        replies.append({"error": f"no reply within {timeout_s} s: {type(e).__name__}"})
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    keys = ("all_reduce_ok", "gemm_all_reduce_ok", "graph_replay_ok")
    ok = len(replies) == 2 and all(r.get(k) is True for r in replies for k in keys)
    return {"status": "ok" if ok else "blocked", "ranks": replies,
            "distinct_pids": len({r.get("pid") for r in replies}) == 2}


def child_build() -> dict:
    sc, skipped = _cuda_ops()
    if skipped:
        return skipped
    res = sc.build(verbose=True)
    return {"status": "ok", "library": str(res.path), "built": bool(res.built)}


# ---------------------------------------------------------------------------------------------
# the probe
# ---------------------------------------------------------------------------------------------

def probe_ll(timeout_s: float, env: dict | None = None) -> dict:
    """The LL check (``--child ll``) with ``env`` added; its record."""
    step = _child("ll", timeout_s, env, limit=2 * timeout_s)
    return {"status": _status(step), "reason": (step.get("result") or {}).get("reason"), "step": step}


def probe_mps(timeout_s: float, ll: bool) -> dict:
    """Start an MPS control daemon of our own, run a capped client (and the LL check) under it,
    and quit it whatever happened."""
    ctl = shutil.which("nvidia-cuda-mps-control")
    if ctl is None:
        return {"status": "blocked", "reason": "nvidia-cuda-mps-control is not on PATH", "steps": []}
    root = tempfile.mkdtemp(prefix="swiftspec-mps-")
    env = {"CUDA_MPS_PIPE_DIRECTORY": os.path.join(root, "pipe"), "CUDA_MPS_LOG_DIRECTORY": os.path.join(root, "log")}
    for d in env.values():
        os.makedirs(d, exist_ok=True)
    capped = {**env, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(MPS_PERCENT)}
    out: dict = {"status": "blocked", "dirs": env, "steps": {}}
    steps = out["steps"]
    try:
        steps["start"] = run_step([ctl, "-d"], timeout_s, env=env)
        if steps["start"]["returncode"] != 0:
            out["reason"] = "the MPS control daemon did not start"
            return out
        steps["servers_before"] = run_step([ctl], timeout_s, env=env, stdin="get_server_list\n")
        steps["client"] = _child("info", timeout_s, capped)
        steps["servers_after"] = run_step([ctl], timeout_s, env=env, stdin="get_server_list\n")
        client = steps["client"].get("result") or {}
        servers = steps["servers_after"]["stdout"].split()
        out["client_sm_count"] = client.get("sm_count")
        out["server_pids"] = servers
        if _status(steps["client"]) == "ok" and client.get("available") and servers:
            out["status"] = "ok"
        else:
            out["reason"] = "the capped client did not run under an MPS server"
        if ll and out["status"] == "ok":
            out["ll_same_gpu"] = probe_ll(timeout_s, capped)
    finally:
        steps["quit"] = run_step([ctl], timeout_s, env=env, stdin="quit\n")
        logs = {}
        for name in ("control.log", "server.log"):
            path = os.path.join(env["CUDA_MPS_LOG_DIRECTORY"], name)
            if os.path.exists(path):
                with open(path, errors="replace") as f:
                    logs[name] = _tail(f.read())
        out["logs"] = logs
        shutil.rmtree(root, ignore_errors=True)
    return out


def probe(out_path: str, timeout_s: float, build_timeout_s: float) -> dict:
    """Run every check, writing the report to ``out_path`` after each; returns the report."""
    report = {"probe": "swiftspec scripts/gpu_probe.py", "version": 1,
              "command": shlex.join([sys.executable, *sys.argv]), "started": datetime.now(timezone.utc).isoformat(timespec="seconds"), "host": socket.gethostname(),
              "python": sys.version.split()[0], "timeout_s": timeout_s, "cuda": {}, "nvidia_smi": None,
              "checks": {}, "summary": {}}

    def save():
        report["summary"] = {k: v.get("status") for k, v in report["checks"].items()}
        tmp = out_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(report, f, indent=1)
        os.replace(tmp, out_path)

    info = _child("info", timeout_s)
    report["cuda"] = {**(info.get("result") or {"available": False, "error": info["stderr"] or info.get("error")}),
                      "step": info}
    if shutil.which("nvidia-smi"):
        report["nvidia_smi"] = run_step(["nvidia-smi", "--query-gpu=name,compute_mode,driver_version,memory.used",
                                         "--format=csv"], timeout_s)
    save()
    names = ("cuda_ipc", "ll_build", "ll_same_gpu", "mps")
    if not report["cuda"].get("available"):
        report["cuda"]["reason"] = "no CUDA"
        for name in names:
            report["checks"][name] = {"status": "skipped", "reason": "no CUDA"}
        save()
        return report
    step = _child("ipc", timeout_s, limit=2 * timeout_s)
    report["checks"]["cuda_ipc"] = {"status": _status(step), "step": step}
    save()
    step = _child("build", build_timeout_s)
    report["checks"]["ll_build"] = {"status": _status(step), "reason": (step.get("result") or {}).get("reason"),
                                    "step": step}
    save()
    built = report["checks"]["ll_build"]["status"] == "ok"
    report["checks"]["ll_same_gpu"] = (probe_ll(timeout_s) if built else
                                       {"status": "skipped", "reason": "the LL kernels were not built (ll_build)"})
    save()
    report["checks"]["mps"] = probe_mps(timeout_s, ll=built)
    report["finished"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    save()
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="gpu_probe.json", help="the JSON report (default gpu_probe.json)")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds each step may take (default 60)")
    ap.add_argument("--build-timeout", type=float, default=900.0,
                    help="seconds the LL kernel library's build may take (default 900)")
    ap.add_argument("--child", choices=["info", "ipc", "ll", "build"], help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.timeout <= 0 or a.build_timeout <= 0:
        ap.error("--timeout and --build-timeout must be positive")
    if a.child:
        run = {"info": child_info, "build": child_build,
               "ipc": lambda: child_ipc(a.timeout), "ll": lambda: child_ll(a.timeout)}[a.child]
        try:
            _emit(run())
        except BaseException:
            _emit({"status": "blocked", "error": traceback.format_exc()})
            return 1
        return 0
    report = probe(a.out, a.timeout, a.build_timeout)
    print(json.dumps(report["summary"]), file=sys.stderr)
    print(f"wrote {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
