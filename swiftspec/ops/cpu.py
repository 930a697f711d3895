"""Build and load the CPU twins (``csrc/cpu/*.cpp``) as one torch extension.

The extension is compiled on first use with ``torch.utils.cpp_extension.load`` (ninja, pybind11,
OpenMP through ``at::parallel_for``) for the machine it runs on (``-march=native``), into
``$SWIFTSPEC_CACHE/build/`` (default ``~/.cache/swiftspec/build``); later loads only check the
sources' hash. The compiler reads a copy of the sources kept in the build directory
(:func:`mirror_sources`), not the checkout: ninja keys its rebuild decisions on the command lines,
which name the source paths, so two checkouts (a clean clone of the same commit, a worktree)
compiling from their own paths rebuilt every file each time the other had built (minutes on 2
cores); from the copy, identical sources are never rebuilt and a changed file rebuilds only its
own objects. Compiler messages therefore name ``<build dir>/src/cpu/<file>``. ``SWIFTSPEC_CPU_ARCH=<gcc -march value>`` builds for that architecture instead
(a module and build directory of its own): ``x86-64-v3`` is the code an AVX2-only CPU (AMD Zen 3)
builds for itself, so an AVX-512 machine can run and time what such a CPU runs (with
``SWIFTSPEC_QUANT_GEMM=avx2``, the quantized GEMM being picked at run time, and
``ATEN_CPU_CAPABILITY=avx2`` for torch's own kernels). Concurrent first loads (several worker
processes) take an ``flock`` on the build directory: one compiles, the others wait. torch's own
lock file is not enough on its own: a process killed while holding it leaves the file behind and
every later load would wait forever, so it is removed while our kernel-released lock is held.
"""
from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import platform
import re
import time
from pathlib import Path

# the sources shipped inside an installed package (setup.py copies them), else the checkout's csrc/
CSRC = next((d for d in (Path(__file__).resolve().parents[1] / "_csrc", Path(__file__).resolve().parents[2] / "csrc")
             if d.is_dir()), Path(__file__).resolve().parents[2] / "csrc")


class KernelBuildError(RuntimeError):
    """The CPU twins could not be compiled or loaded (the message holds the compiler output)."""


def sources(flag_bits: int | None = None) -> list[Path]:
    """The C++ sources of the CPU extension, registration file last; for a build with
    ``flag_bits`` (the LL flag wrap-around test module) the shared-memory communicator's alone,
    the only code whose behaviour the flag width changes (a full build takes minutes)."""
    cpu = CSRC / "cpu"
    if flag_bits is not None:
        return [cpu / "shm_comm.cpp", cpu / "registration.cpp"]
    files = sorted(p for p in cpu.glob("*.cpp") if p.name != "registration.cpp")
    return files + [cpu / "registration.cpp"]


def build_hash(flag_bits: int | None = None) -> str:
    """A hash of what the compiled extension's code depends on: the C++ sources and headers, the
    module name (``march()``, LL-flag width) and torch's version. Kernel timings stored for one
    build (swiftspec.ops.tuning) do not carry over to another."""
    h = hashlib.sha256(f"{module_name(flag_bits)} {march()} {_torch_version()}".encode())
    for p in sorted((CSRC / "cpu").glob("*")) + sorted((CSRC / "include").rglob("*")):
        if p.is_file():
            h.update(p.name.encode() + p.read_bytes())
    return h.hexdigest()[:16]


def _torch_version() -> str:
    import torch

    return torch.__version__


def march() -> str:
    """The ``-march`` the extension is built for: ``$SWIFTSPEC_CPU_ARCH`` or "native".

    Raises:
        KernelBuildError: the variable holds something that is not an architecture name.
    """
    arch = os.environ.get("SWIFTSPEC_CPU_ARCH", "").strip() or "native"
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", arch):
        raise KernelBuildError(f"SWIFTSPEC_CPU_ARCH={arch!r} is not a -march value (e.g. x86-64-v3, znver3)")
    return arch


def module_name(flag_bits: int | None = None) -> str:
    """The extension's module (and build directory) name: one per LL-flag width and ``march()``."""
    name = "swiftspec_cpu" if flag_bits is None else f"swiftspec_cpu_llflag{flag_bits}"
    arch = march()
    return name if arch == "native" else f"{name}_{re.sub(r'[^A-Za-z0-9]', '_', arch)}"


def cache_root() -> Path:
    """The kernels' cache root (builds, kernel-tuning profiles): ``$SWIFTSPEC_CACHE``, default
    ``~/.cache/swiftspec``."""
    return Path(os.environ.get("SWIFTSPEC_CACHE", Path.home() / ".cache" / "swiftspec"))


def build_dir(tag: str) -> Path:
    """The CPU extension's build directory for ``tag`` (created if missing):
    ``$SWIFTSPEC_CACHE/build/<tag>-<machine>-<hash of the CPU flags>-<hash of torch's directory>``
    (default cache ``~/.cache/swiftspec``). The CPU flags, so ``-march=native`` code is never
    reused on another CPU model; torch's installed directory (symlinks resolved), because
    ``cpp_extension`` writes its include and library paths into every compile command and ninja
    rebuilds every object whose command changed: two virtual environments at two paths (a
    checkout's ``.venv`` and a clean clone's) sharing one directory rebuilt all of it each time
    the other had built (about 5 minutes for the main module on 2 cores). Each keeps its own. The
    cache root is resolved: a cache reached through a symbolic link builds in the same directory,
    named by the same path."""
    root = cache_root().resolve()  # the directory's path is in every command too: one path per directory
    cpu = hashlib.sha256(_cpu_flags().encode()).hexdigest()[:10]
    env = hashlib.sha256(str(_torch_dir()).encode()).hexdigest()[:8]
    d = root / "build" / f"{tag}-{platform.machine()}-{cpu}-{env}"
    d.mkdir(parents=True, exist_ok=True)
    return d


def _torch_dir() -> Path:
    import torch

    return Path(torch.__file__).resolve().parent


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def mirror_sources(bdir: Path, files: list[Path]) -> list[Path]:
    """Copy ``files`` (under :data:`CSRC`) and every header of ``CSRC/include`` and ``CSRC/cpu``
    to ``bdir/src/`` (same relative paths), writing a file only where its bytes differ, so the
    copies of unchanged files keep their modification times and ninja leaves their objects
    alone; copies of files gone from :data:`CSRC` are removed. Returns the copies of ``files``.
    The caller holds the build directory's lock."""
    headers = [p for d in (CSRC / "include", CSRC / "cpu") for p in d.rglob("*") if p.is_file() and p.suffix != ".cpp"]
    wanted = {p.relative_to(CSRC): p for p in [*files, *headers]}
    dst_root = bdir / "src"
    for rel, src in wanted.items():
        dst, data = dst_root / rel, src.read_bytes()
        if not dst.is_file() or dst.read_bytes() != data:
            dst.parent.mkdir(parents=True, exist_ok=True)
            tmp = dst.with_name(dst.name + ".tmp")
            tmp.write_bytes(data)
            os.replace(tmp, dst)
    for old in [p for p in dst_root.rglob("*") if p.is_file()]:
        if old.relative_to(dst_root) not in wanted:
            old.unlink()
    return [dst_root / p.relative_to(CSRC) for p in files]


@functools.lru_cache(maxsize=None)
def load(flag_bits: int | None = None, verbose: bool = False):
    """The compiled extension module.

    Args:
        flag_bits: build with ``-DSWIFTSPEC_LL_FLAG_BITS=flag_bits`` (a separate module holding
            only ``ShmComm``, :func:`sources`; tests use
            2 so LL flags wrap around every 3 calls). None: the production 32-bit flags.
        verbose: show the compiler's output.

    Raises:
        KernelBuildError: no C++ compiler / ninja, or the sources do not compile.
    """
    from torch.utils import cpp_extension

    name = module_name(flag_bits)
    defines = [] if flag_bits is None else [f"-DSWIFTSPEC_LL_FLAG_BITS={flag_bits}", "-DSWIFTSPEC_SHM_COMM_ONLY"]
    cflags = ["-O3", f"-march={march()}", "-fopenmp", "-Wall", "-Wno-unused-function", *defines]
    bdir = build_dir(name)
    try:
        with _exclusive(bdir / "swiftspec.flock", timeout_s=1800):
            (bdir / "lock").unlink(missing_ok=True)  # torch's baton, left by a killed process
            srcs = mirror_sources(bdir, sources(flag_bits))
            return cpp_extension.load(
                name=name, sources=[str(p) for p in srcs],
                extra_include_paths=[str(bdir / "src" / "include")], extra_cflags=cflags,
                extra_ldflags=["-fopenmp", "-lrt"], build_directory=str(bdir), verbose=verbose)
    except Exception as e:  # compiler errors surface as RuntimeError / CalledProcessError / ImportError
        raise KernelBuildError(f"building the CPU kernels ({name}) failed: {e}") from e


class _exclusive:
    """An exclusive ``flock`` on ``path`` (released by the kernel if the holder dies), waiting at
    most ``timeout_s`` seconds."""

    def __init__(self, path: Path, timeout_s: float):
        self.path, self.timeout_s = path, timeout_s

    def __enter__(self):
        self.f = open(self.path, "a+")
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                fcntl.flock(self.f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return self
            except BlockingIOError:
                if time.monotonic() > deadline:
                    self.f.close()
                    raise TimeoutError(f"another process has held {self.path} for {self.timeout_s:.0f} s")
                time.sleep(0.2)

    def __exit__(self, *exc):
        fcntl.flock(self.f, fcntl.LOCK_UN)
        self.f.close()


def available() -> bool:
    """Whether the CPU twins can be built and loaded here (the result is cached)."""
    try:
        load()
        return True
    except KernelBuildError:
        return False


if __name__ == "__main__":
    load(verbose=True)
    print("built", load().__file__)
