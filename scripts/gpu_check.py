"""Every GPU check of a lent machine in one call, each stage bounded by its own time budget.

A lent GPU machine has torch, transformers and nvcc but no network, no checkpoint and a few
minutes: this runs, in order, each stage a subprocess stopped at its budget (or at what is left of
``--budget``), each writing its records as soon as it ends:

1. ``tests``: build the CUDA kernels, run the CUDA tests (junit XML + log);
2. ``steps``: bench/device_forward.py on the big shapes (target one-row step, ``bs``-row
   verification and their ratio r, the draft's expansion rows) against the read bandwidth
   measured in the same run (read-only reduction) and the spec sheet;
3. ``e2e``: ``swiftspec bench --random-weights`` at the largest shape that fits (32B where the GPU
   has 120 GiB or more, else 14B) with the 0.5B draft: autoregressive, ``serial``, ``colocated``
   with and without an SM partition, acceptance replayed from the shipped trace at p = 0, 0.15,
   0.3 (one pass per p on the loaded engine; one system resident at a time);
4. ``multiproc``: the CUDA IPC / MPS probes (scripts/gpu_probe.py) and the multi-process tests
   (two TP ranks on one GPU with the LL all-reduce in CUDA graphs; ``async`` with the draft and
   target groups as two processes on one GPU).

After every stage ``$OUT`` holds ``summary.md`` (each record rendered by bench/tables.py),
``log.txt`` (every stage's output) and ``records.tar.gz`` (the JSON records, logs and junit XML,
to unpack into bench/results/): three files, inside the device tool's limit of eight.

    python scripts/gpu_check.py --budget 470            # the whole run, one call
    python scripts/gpu_check.py --stages e2e multiproc  # a second call for what the first missed
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("tests", "steps", "e2e", "multiproc")
# seconds of each stage at most (the whole run: --budget); e2e at 32B: ~30 s a system to load and
# capture its graphs, ~2 s a prompt, 4 systems, 3 values of p for the 3 speculative ones
BUDGETS = {"tests": 110, "steps": 70, "e2e": 190, "multiproc": 100}
CUDA_TESTS = ["tests/test_cuda_build.py", "tests/test_cuda_kernels.py", "tests/test_graphs.py",
              "tests/test_cuda_engine.py", "tests/test_random_weights.py"]
MULTIPROC_TESTS = ["tests/test_cuda_shared_gpu.py"]
DRAFT = "qwen2.5-coder-0.5b-instruct"


def gpu_memory_gib() -> float:
    """Total memory of GPU 0 in GiB (0 without CUDA)."""
    import torch

    return torch.cuda.get_device_properties(0).total_memory / 2 ** 30 if torch.cuda.is_available() else 0.0


def shapes(memory_gib: float) -> tuple[list[str], str]:
    """(target shapes for the step breakdown, the target of the end-to-end run) for a GPU of
    ``memory_gib``: a 32B target needs 65 GB of bf16 weights plus the draft and the KV caches."""
    if memory_gib >= 120:
        return ["qwen2.5-7b-instruct", "qwen2.5-14b-instruct", "qwen2.5-32b-instruct"], "qwen2.5-32b-instruct"
    if memory_gib >= 40:
        return ["qwen2.5-7b-instruct", "qwen2.5-14b-instruct"], "qwen2.5-14b-instruct"
    return ["qwen2.5-coder-1.5b-instruct"], "qwen2.5-coder-1.5b-instruct"


def stage_commands(stage: str, work: Path, py: str, memory_gib: float, prompts: int,
                   tests: list[str] | None = None) -> list[list[str]]:
    """The commands of one stage, run in order (each gets what is left of the stage's budget);
    ``tests``: the test files of the ``tests`` stage (default: every CUDA test file)."""
    steps, e2e_target = shapes(memory_gib)
    if stage == "tests":
        return [[py, "-m", "pytest", "-q", "-rfEs", *(tests or CUDA_TESTS), "--junitxml",
                 str(work / "cuda-tests.xml"), "--durations", "15"]]
    if stage == "steps":
        return [[py, "bench/device_forward.py", "--device", "cuda", "--capacity", "4104", "--rows", "1", "2", "4", "8",
                 "16", "--rounds", "10", "--models", *steps, DRAFT, "--out", str(work / "gpu-steps.json")]]
    if stage == "e2e":
        return [[py, "-m", "swiftspec", "bench", "--device", "cuda", "--random-weights", "--target-config", e2e_target,
                 "--draft-config", DRAFT, "--num-prompts", str(prompts), "--max-tokens", "128", "--degrade", "0",
                 "0.15", "0.3", "--systems", "autoregressive", "swiftspec-serial", "swiftspec-colocated",
                 "swiftspec-profiled", "--config", "bench/colocated-sm-partition.json", "--out",
                 str(work / "e2e")]]
    if stage == "multiproc":
        cmds = []
        if (ROOT / "scripts" / "gpu_probe.py").is_file():
            cmds.append([py, "scripts/gpu_probe.py", "--out", str(work / "gpu-probe.json"), "--timeout", "30",
                         "--build-timeout", "60"])
        cmds.append([py, "-m", "pytest", "-q", "-rs", *MULTIPROC_TESTS, "--junitxml",
                     str(work / "multiproc-tests.xml")])
        return cmds
    raise ValueError(f"unknown stage {stage!r}; stages: {', '.join(STAGES)}")


def run_bounded(cmd: list[str], seconds: float, log) -> int:
    """Run ``cmd`` in its own process group with output appended to ``log``; kill the whole
    group after ``seconds``. Returns the exit code (124 when stopped at the limit)."""
    log.write(f"\n$ {' '.join(cmd)}  (limit {seconds:.0f} s)\n")
    log.flush()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        return proc.wait(timeout=max(seconds, 1))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        log.write(f"\n(stopped at its limit of {seconds:.0f} s)\n")
        return 124


def render_summary(work: Path, stages: list[dict]) -> str:
    """Markdown: the stages' outcomes, then each JSON record rendered by bench/tables.py."""
    lines = ["| stage | exit codes | seconds |", "|---|---|---|"]
    lines += [f"| {s['stage']} | {', '.join(map(str, s['codes']))} | {s['seconds']:.0f} |" for s in stages]
    try:
        sys.path.insert(0, str(ROOT / "bench"))
        import tables  # noqa: PLC0415  (bench/tables.py)
    except Exception as e:  # a summary without tables beats none
        return "\n".join(lines + ["", f"(bench/tables.py unavailable: {e})"])
    for f in sorted(work.rglob("*.json")):
        try:
            lines += ["", f"## {f.relative_to(work)}", "", tables.render(json.loads(f.read_text()))]
        except Exception as e:
            lines += ["", f"## {f.relative_to(work)}", "", f"(not rendered: {type(e).__name__}: {e})"]
    return "\n".join(lines) + "\n"


def publish(work: Path, out: Path, stages: list[dict]) -> None:
    """Write ``summary.md``, ``records.tar.gz`` and ``log.txt`` to ``out`` (replacing earlier ones)."""
    (work / "stages.json").write_text(json.dumps(stages, indent=1) + "\n")
    (out / "summary.md").write_text(render_summary(work, stages))
    with tarfile.open(out / "records.tar.gz.tmp", "w:gz") as tar:
        for f in sorted(work.rglob("*")):
            if f.is_file() and f.suffix in (".json", ".md", ".xml", ".log", ".png"):
                tar.add(f, arcname=str(f.relative_to(work)))
    os.replace(out / "records.tar.gz.tmp", out / "records.tar.gz")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", nargs="+", choices=STAGES, default=list(STAGES))
    ap.add_argument("--budget", type=float, default=470, help="seconds for the whole run (default 470)")
    ap.add_argument("--prompts", type=int, default=1, help="prompts per dataset in the e2e stage (default 1)")
    ap.add_argument("--stage-budget", nargs="+", default=[], metavar="STAGE=S",
                    help="seconds for a stage instead of its default (tests=110 steps=70 e2e=190 multiproc=100)")
    ap.add_argument("--tests", nargs="+", default=None, metavar="FILE",
                    help="test files of the tests stage (default: every CUDA test file)")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-out")))
    args = ap.parse_args(argv)
    budgets = dict(BUDGETS)
    for item in args.stage_budget:
        stage, _, seconds = item.partition("=")
        if stage not in budgets or not seconds.replace(".", "", 1).isdigit():
            ap.error(f"--stage-budget takes STAGE=SECONDS with a stage of {', '.join(STAGES)}, got {item!r}")
        budgets[stage] = float(seconds)
    start = time.monotonic()
    out = args.out.resolve()
    work = out.parent / f"{out.name}-work"
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    env_py = os.environ.get("PYTHON", sys.executable)
    os.environ["PYTHONPATH"] = str(ROOT) + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")
    os.environ.setdefault("SWIFTSPEC_CACHE", str(ROOT / ".cache-gpu"))
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    memory = gpu_memory_gib()
    done: list[dict] = []
    with open(out / "log.txt", "a") as log:
        log.write(f"GPU memory {memory:.0f} GiB; stages {args.stages}; budget {args.budget:.0f} s\n")
        subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv"], stdout=log,
                       stderr=subprocess.STDOUT, check=False)
        for stage in args.stages:
            t0 = time.monotonic()
            codes = []
            for cmd in stage_commands(stage, work, env_py, memory, args.prompts, args.tests):
                left = min(budgets[stage] - (time.monotonic() - t0), args.budget - (time.monotonic() - start))
                if left < 5:
                    codes.append("skipped")
                    continue
                codes.append(run_bounded(cmd, left, log))
            done.append({"stage": stage, "codes": codes, "seconds": time.monotonic() - t0})
            publish(work, out, done)
    return 0 if all(c == 0 for s in done for c in s["codes"]) else 1


if __name__ == "__main__":
    sys.exit(main())
