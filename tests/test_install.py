"""A non-editable install (``pip install .``, as from a wheel) carries the kernel sources and builds
the CPU extension from them, away from the checkout."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_non_editable_install_builds_the_cpu_kernels(tmp_path):
    site = tmp_path / "site"
    # build isolation (pip's default): the build backend comes from the package index, as for a user
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site), str(ROOT)],
                   check=True, cwd=tmp_path)
    assert (site / "swiftspec" / "_csrc" / "cpu" / "quant_gemm.cpp").is_file()
    prompts = site / "swiftspec" / "data" / "eval_prompts"
    assert len(list(prompts.glob("*.jsonl"))) == 6 and (prompts / "LICENSE.EAGLE").is_file()
    # what `swiftspec bench --random-weights` needs from the package: the shapes (the default pair's
    # and the big GPU targets') and the pair's trace
    data = site / "swiftspec" / "data"
    shipped = {p.stem for p in (data / "model_configs").glob("*.json")}
    assert {"qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", "qwen2.5-32b-instruct"} <= shipped
    assert (data / "traces" / "default-pair.json").is_file()
    code = ("import swiftspec.ops.cpu as c, torch\n"
            "assert c.CSRC.parent.name == 'swiftspec' and c.CSRC.name == '_csrc', c.CSRC\n"
            "m = c.load()\n"
            "x = torch.randn(2, 64)\n"
            "y, _ = m.rms_norm(x, None, torch.ones(64), 1e-6)\n"
            "print(m.quant_impls()[0], y.shape[0])\n")
    env = {**os.environ, "PYTHONPATH": str(site), "SWIFTSPEC_CACHE": str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=1200)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-1] == "2"
