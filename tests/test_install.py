"""A non-editable install (``pip install .``, as from a wheel) carries the kernel sources and builds
the CPU extension from them, away from the checkout.

The installed ``_csrc`` must equal the checkout's ``csrc/`` file for file (so the full build the
rest of the suite runs from the checkout is the build an install runs); the installed package
loads the shared-memory communicator's module (two sources: the include paths, flags and
registration an install uses), not all of them again, which took ~5 minutes of the suite on 2
cores. The load uses the suite's kernel cache: the compiler reads the copies
:func:`swiftspec.ops.cpu.mirror_sources` keeps in the build directory, so the compile command of
an install is the checkout's, and the test asserts those copies are the installed files byte for
byte; a cache of its own rebuilt that module each run (~40 s on 2 cores). The wheel is built
with the environment's setuptools (``--no-build-isolation``): an isolated build fetched and
installed setuptools into a fresh environment each run (~15 s)."""
import filecmp
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_non_editable_install_carries_the_kernel_sources_and_builds_from_them(tmp_path):
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--target", str(site), str(ROOT)], check=True, cwd=tmp_path)
    installed = site / "swiftspec" / "_csrc"
    kernel_files = sorted(p.relative_to(ROOT / "csrc") for p in (ROOT / "csrc").rglob("*")
                          if p.suffix in (".cpp", ".h", ".cu", ".cuh"))
    assert Path("cpu/quant_gemm.cpp") in kernel_files and Path("kernels/ll_comm.cu") in kernel_files
    _, differ, missing = filecmp.cmpfiles(ROOT / "csrc", installed, [str(p) for p in kernel_files], shallow=False)
    assert not differ and not missing, (differ, missing)
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
            "assert [p.name for p in c.sources()][-1] == 'registration.cpp' and len(c.sources()) > 5\n"
            "m = c.load(flag_bits=2)\n"
            "bdir = c.build_dir(c.module_name(2))\n"
            "assert m.__file__.startswith(bdir.as_posix())\n"
            "built = [p for p in (bdir / 'src').rglob('*') if p.is_file()]\n"
            "assert len(built) > 2 and all(p.read_bytes() == (c.CSRC / p.relative_to(bdir / 'src')).read_bytes()\n"
            "                               for p in built), built\n"
            "print(m.ll_flag_bits, callable(m.ShmComm))\n")
    env = {**os.environ, "PYTHONPATH": str(site)}  # the suite's SWIFTSPEC_CACHE
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=1200)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-2:] == ["2", "True"], out.stdout
