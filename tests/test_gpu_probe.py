"""scripts/gpu_probe.py without a GPU: every step bounded by its time limit and recorded (a
failure is data, not a crash), and the JSON report on a machine without CUDA, where every GPU check
says "no CUDA"."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_probe.py"


def _probe_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_probe", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_probe_steps_record_failures_and_never_hang():
    probe = _probe_module()
    t0 = time.monotonic()
    rec = probe.run_step([sys.executable, "-c", "import time; print('started', flush=True); time.sleep(120)"], 3.0)
    assert rec["timed_out"] and rec["returncode"] is None and "started" in rec["stdout"]
    assert time.monotonic() - t0 < 60
    rec = probe.run_step(["/nonexistent/nvidia-cuda-mps-control", "-d"], 5.0)
    assert rec["returncode"] is None and "FileNotFoundError" in rec["error"]
    rec = probe.run_step([sys.executable, "-c", "import sys; print(sys.stdin.read().strip()); "
                          "print('RESULT {\"status\": \"ok\", \"n\": 1}')"], 30.0, stdin="get_server_list\n",
                         env={"X_PROBE": "1"})
    assert rec["returncode"] == 0 and rec["stdout"].startswith("get_server_list")
    assert rec["result"] == {"status": "ok", "n": 1} and probe._status(rec) == "ok"
    assert rec["env"] == {"X_PROBE": "1"} and "-c" in rec["command"]


def test_probe_without_cuda_says_so(tmp_path):
    out = tmp_path / "probe.json"
    r = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "--timeout", "120"], capture_output=True,
                       text=True, timeout=300, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 0, r.stderr
    rep = json.loads(out.read_text())
    assert {"probe", "version", "command", "started", "host", "timeout_s", "cuda", "checks", "summary"} <= rep.keys()
    assert rep["cuda"]["available"] is False and rep["cuda"]["reason"] == "no CUDA"
    assert rep["cuda"]["torch"] == torch.__version__ and "--child info" in rep["cuda"]["step"]["command"]
    assert set(rep["checks"]) == {"cuda_ipc", "ll_build", "ll_same_gpu", "mps"}
    assert all(c == {"status": "skipped", "reason": "no CUDA"} for c in rep["checks"].values())
    assert rep["summary"] == {k: "skipped" for k in rep["checks"]}
    bad = subprocess.run([sys.executable, str(SCRIPT), "--timeout", "0"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "positive" in bad.stderr
