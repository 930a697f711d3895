"""Build the CUDA latency kernels (``csrc/kernels/*.cu``) into one shared library.

Every ``csrc/kernels/*.cu`` is compiled with nvcc (``-O3 -arch=sm_90a``, plus ``-gencode`` for the
local GPU's architecture when there is one) into ``$SWIFTSPEC_CACHE/build/cuda-<hash>/libswiftspec_cuda.so``
(default cache ``~/.cache/swiftspec``; the hash covers sources, headers, flags and the nvcc
version; the library is written atomically, so concurrent builders never see a half-written
file), statically linked against cudart. The sources have an ``extern "C"`` API
(``csrc/kernels/api.h``) and no torch headers, so they compile on machines with a CPU-only torch.
"""
from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from swiftspec.ops.cpu import CSRC, cache_root  # the package's _csrc/ (installed) or the checkout's csrc/

KERNELS = CSRC / "kernels"
INCLUDE = CSRC / "include"
LIB_NAME = "libswiftspec_cuda.so"
BASE_ARCH = "sm_90a"
_NVCC_TIMEOUT_S = 900


class KernelBuildError(RuntimeError):
    """nvcc is missing, the sources do not compile, or the library does not load."""


def sources() -> list[Path]:
    """The CUDA sources, one translation unit each (sorted)."""
    return sorted(KERNELS.glob("*.cu"))


def headers() -> list[Path]:
    """Headers the sources include (part of the build hash)."""
    return (sorted(KERNELS.glob("*.h")) + sorted(KERNELS.glob("*.cuh"))
            + sorted((INCLUDE / "swiftspec").glob("*.h")))


def nvcc_path() -> str | None:
    """nvcc from ``$SWIFTSPEC_NVCC``, ``PATH``, ``$CUDA_HOME/bin`` or ``/usr/local/cuda/bin``."""
    env = os.environ.get("SWIFTSPEC_NVCC")
    if env:
        return env if Path(env).is_file() else None
    found = shutil.which("nvcc")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and (Path(root) / "bin" / "nvcc").is_file():
            return str(Path(root) / "bin" / "nvcc")
    return None


def _require_nvcc() -> str:
    nvcc = nvcc_path()
    if nvcc is None:
        raise KernelBuildError("nvcc not found (set SWIFTSPEC_NVCC or put the CUDA toolkit on PATH)")
    return nvcc


def local_arch() -> str | None:
    """``sm_XY`` of the current GPU, or None without a usable CUDA device (CPU torch included)."""
    try:
        if not torch.cuda.is_available():
            return None
        major, minor = torch.cuda.get_device_capability()
    except Exception:  # a broken driver must not break a CPU-only build
        return None
    return f"sm_{major}{minor}"


def arch_flags(local: str | None = None) -> list[str]:
    """``-arch=sm_90a`` plus a ``-gencode`` for ``local`` (an ``sm_XY``) when it is not sm_90.

    sm_90a code runs on compute capability 9.0 only (H100 / H200); any other local GPU gets its own
    SASS so that the tests run wherever CUDA is present.
    """
    flags = [f"-arch={BASE_ARCH}"]
    if local and local not in ("sm_90", "sm_90a"):
        xy = local[3:]
        flags += ["-gencode", f"arch=compute_{xy},code=sm_{xy}"]
    return flags


def compile_flags(flag_bits: int | None = None, local: str | None = None) -> list[str]:
    """nvcc flags of one object file (also used by the CI build test)."""
    defines = [] if flag_bits is None else [f"-DSWIFTSPEC_LL_FLAG_BITS={int(flag_bits)}"]
    return ["-std=c++17", "-O3", *arch_flags(local), "-Xcompiler", "-fPIC", "-Xcompiler", "-Wall",
            "-Xcompiler", "-fvisibility=hidden", "-I", str(INCLUDE), "-I", str(KERNELS), *defines]


def nvcc_command(src: Path, out: Path, *, mode: str = "obj", flag_bits: int | None = None,
                 local: str | None = None) -> list[str]:
    """The nvcc command line that compiles ``src`` to an object (``mode="obj"``) or to PTX
    (``mode="ptx"``, for the base architecture only)."""
    nvcc = _require_nvcc()
    if mode == "obj":
        return [nvcc, *compile_flags(flag_bits, local), "-c", str(src), "-o", str(out)]
    if mode == "ptx":
        defines = [] if flag_bits is None else [f"-DSWIFTSPEC_LL_FLAG_BITS={int(flag_bits)}"]
        return [nvcc, "-std=c++17", "-O3", f"-arch={BASE_ARCH}", "-I", str(INCLUDE), "-I",
                str(KERNELS), *defines, "-ptx", str(src), "-o", str(out)]
    raise ValueError(f"mode must be 'obj' or 'ptx', got {mode!r}")


def link_command(objects: list[Path], out: Path, local: str | None = None) -> list[str]:
    # --exclude-libs: the static cudart's symbols stay private to this library, so they never
    # interpose on (or get interposed by) the libcudart that torch loads into the same process.
    """The nvcc command that links ``objects`` into the shared library ``out`` for the architectures
    of :func:`arch_flags` (``local``: the local GPU's ``sm_XY``). ``--exclude-libs`` keeps the static
    cudart's symbols private, so they never interpose on the libcudart torch loads.

    Raises:
        KernelBuildError: no nvcc.
    """
    return [_require_nvcc(), "-shared", *arch_flags(local), "-Xlinker", "--exclude-libs,ALL",
            *map(str, objects), "-o", str(out)]


def _run(cmd: list[str]) -> str:
    """Run a compiler command; return its output (warnings), raise KernelBuildError on failure."""
    try:
        r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=_NVCC_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        raise KernelBuildError(f"nvcc timed out after {_NVCC_TIMEOUT_S} s: {' '.join(cmd)}") from e
    except OSError as e:
        raise KernelBuildError(f"cannot run {cmd[0]}: {e}") from e
    if r.returncode != 0:
        raise KernelBuildError(f"command failed ({r.returncode}): {' '.join(cmd)}\n{r.stdout}")
    return r.stdout


@functools.lru_cache(maxsize=None)
def _nvcc_version(nvcc: str) -> str:
    return _run([nvcc, "--version"])


def build_dir(flag_bits: int | None = None, *, root: Path | None = None,
              local: str | None = None) -> Path:
    """``<root>/build/cuda-<hash>``: the hash covers every source and header, the flags and the
    nvcc version, so any change gives a new directory (old ones are simply left behind)."""
    h = hashlib.sha256()
    for p in [*sources(), *headers()]:
        h.update(p.name.encode())
        h.update(p.read_bytes())
    h.update(" ".join(compile_flags(flag_bits, local)).encode())
    h.update(_nvcc_version(_require_nvcc()).encode())
    return (root if root is not None else cache_root()) / "build" / f"cuda-{h.hexdigest()[:16]}"


@dataclass
class BuildResult:
    """Outcome of :func:`build`.

    Attributes:
        path: the shared library.
        logs: nvcc output per source file name (warnings; empty string when clean), plus "link".
        built: False when an up-to-date library was found in the cache.
    """

    path: Path
    logs: dict[str, str] = field(default_factory=dict)
    built: bool = False


def build(flag_bits: int | None = None, *, root: Path | None = None, verbose: bool = False,
          jobs: int | None = None) -> BuildResult:
    """Compile (if needed) every ``csrc/kernels/*.cu`` and link ``libswiftspec_cuda.so``.

    Each source is compiled separately (in parallel, ``jobs`` nvcc processes, default the CPU
    count) with ``-Xcompiler -Wall``; their warnings are kept in :attr:`BuildResult.logs` and in
    ``build.log`` next to the library. A file lock in the build directory makes concurrent first
    builds (several worker processes) compile once; the library is moved into place with an
    atomic rename.

    Args:
        flag_bits: build with ``-DSWIFTSPEC_LL_FLAG_BITS=flag_bits`` (tests use 2 so the LL flags
            wrap every 3 calls); None: production 32-bit flags.
        root: cache root instead of ``$SWIFTSPEC_CACHE``.
        verbose: print the nvcc commands and output.
        jobs: parallel nvcc processes.

    Raises:
        KernelBuildError: no nvcc, or a source does not compile / link.
    """
    local = local_arch()
    out_dir = build_dir(flag_bits, root=root, local=local)
    out_dir.mkdir(parents=True, exist_ok=True)
    lib = out_dir / LIB_NAME
    log_file = out_dir / "build.log"
    with open(out_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if lib.is_file():
            return BuildResult(lib, _read_log(log_file), built=False)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=out_dir))
        try:
            srcs = sources()
            objs = [tmp / (s.stem + ".o") for s in srcs]

            def one(pair):
                src, obj = pair
                cmd = nvcc_command(src, obj, flag_bits=flag_bits, local=local)
                if verbose:
                    print(" ".join(cmd), flush=True)
                return src.name, _run(cmd)

            n_jobs = max(1, min(len(srcs), jobs or os.cpu_count() or 1))
            with ThreadPoolExecutor(n_jobs) as pool:
                logs = dict(pool.map(one, zip(srcs, objs)))
            tmp_lib = tmp / LIB_NAME
            logs["link"] = _run(link_command(objs, tmp_lib, local))
            if verbose:
                for name, text in logs.items():
                    if text.strip():
                        print(f"--- {name}\n{text}", flush=True)
            tmp_log = tmp / "build.log"
            tmp_log.write_text("".join(f"=== {k}\n{v}" for k, v in logs.items()))
            os.replace(tmp_log, log_file)
            os.replace(tmp_lib, lib)  # atomic: a reader sees no library or the whole library
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return BuildResult(lib, logs, built=True)


def _read_log(path: Path) -> dict[str, str]:
    logs: dict[str, str] = {}
    if not path.is_file():
        return logs
    name = None
    for line in path.read_text().splitlines(keepends=True):
        if line.startswith("=== "):
            name = line[4:].strip()
            logs[name] = ""
        elif name is not None:
            logs[name] += line
    return logs


if __name__ == "__main__":
    res = build(verbose=True)
    print("built" if res.built else "cached", res.path)
