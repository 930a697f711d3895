"""Build, load and call the CUDA latency kernels (``csrc/kernels/*.cu``; SwiftSpec paper section 3.3).

The kernels are plain CUDA C++ with an ``extern "C"`` API (``csrc/kernels/api.h``) and no torch
headers, so they compile on machines with a CPU-only torch. This module

* compiles every ``csrc/kernels/*.cu`` with nvcc (``-O3 -arch=sm_90a``, plus ``-gencode`` for the
  local GPU's architecture when there is one) into one shared library
  ``$SWIFTSPEC_CACHE/build/cuda-<hash>/libswiftspec_cuda.so`` (default cache ``~/.cache/swiftspec``;
  the hash covers sources, headers, flags and the nvcc version; the library is written atomically,
  so concurrent builders never see a half-written file), statically linked against cudart;
* loads it with :mod:`ctypes` (only when first needed: importing this module never needs CUDA);
* wraps the kernels for torch tensors: checks device / dtype / shape / contiguity, allocates the
  outputs, passes ``data_ptr()`` and the current stream, and raises :class:`CudaKernelError` with the
  CUDA error name on a nonzero status;
* holds the IPC helpers and :class:`CudaLLCommunicator`, the CUDA counterpart of the CPU
  ``swiftspec.distributed.comm.ShmCommunicator`` (same ``all_reduce`` / ``gemm_all_reduce`` interface).

Semantics of every op are those of :mod:`swiftspec.ops.reference`.
"""
from __future__ import annotations

import ctypes
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

from swiftspec.ops.cpu import CSRC  # the package's _csrc/ (installed) or the checkout's csrc/

KERNELS = CSRC / "kernels"
INCLUDE = CSRC / "include"
LIB_NAME = "libswiftspec_cuda.so"
BASE_ARCH = "sm_90a"
ABI_VERSION = 3  # must match SS_ABI_VERSION in csrc/kernels/runtime.cu

# constants of csrc/kernels/api.h
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
PROTOCOLS = {"ll16": 0, "ll8": 1}
MAX_M = 16
MAX_RANKS = 16
IPC_HANDLE_BYTES = 64
ATTN_MAX_HEAD_DIM = 256
ATTN_MAX_SPLITS = 64
NORM_MAX_H = 8192

_NVCC_TIMEOUT_S = 900


class KernelBuildError(RuntimeError):
    """nvcc is missing, the sources do not compile, or the library does not load."""


class CudaKernelError(RuntimeError):
    """A kernel library call returned a nonzero cudaError_t.

    Attributes:
        status: the cudaError_t value.
        name: its name (e.g. ``cudaErrorNoDevice``).
    """

    def __init__(self, what: str, status: int, name: str, text: str):
        super().__init__(f"{what} failed: CUDA error {status} ({name}: {text})")
        self.status = status
        self.name = name


# ---------------------------------------------------------------------------------------------
# build
# ---------------------------------------------------------------------------------------------

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


def cache_root() -> Path:
    return Path(os.environ.get("SWIFTSPEC_CACHE", Path.home() / ".cache" / "swiftspec"))


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


# ---------------------------------------------------------------------------------------------
# load
# ---------------------------------------------------------------------------------------------

_p, _i, _i64, _f = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float

# every exported function: name -> (restype, argtypes); must match csrc/kernels/api.h
EXPORTS: dict[str, tuple] = {
    "ss_abi_version": (_i, []),
    "ss_error_name": (ctypes.c_char_p, [_i]),
    "ss_error_string": (ctypes.c_char_p, [_i]),
    "ss_device_count": (_i, [ctypes.POINTER(_i)]),
    "ss_sm_count": (_i, [ctypes.POINTER(_i)]),
    "ss_ll_flag_bits": (_i, []),
    "ss_ll_buffer_bytes": (_i64, [_i, _i64]),
    "ss_ipc_alloc": (_i, [_i64, ctypes.POINTER(_p), _p]),
    "ss_ipc_open": (_i, [_p, ctypes.POINTER(_p)]),
    "ss_ipc_close": (_i, [_p]),
    "ss_free": (_i, [_p]),
    "ss_ll_read_epoch": (_i, [_p, ctypes.POINTER(ctypes.c_uint64)]),
    "ss_ll_all_reduce": (_i, [_p, _p, _i64, _i, _i, _p, _p, _i, _i, _i64, _i64, _p]),
    "ss_ll_gemm_all_reduce": (_i, [_p, _p, _p, _p, _i, _i, _i, _i, _i, _p, _p, _i, _i, _i64,
                                   _i64, _p]),
    "ss_swiglu": (_i, [_p, _p, _p, _i, _i, _i, _i, _p]),
    "ss_rms_norm": (_i, [_p, _p, _p, _p, _p, _i, _i, _f, _i, _p]),
    "ss_tree_attention_plan": (_i, [_i, _i, _i, ctypes.POINTER(_i), ctypes.POINTER(_i)]),
    "ss_tree_attention_split_cap": (_i, [_i, ctypes.POINTER(_i)]),
    "ss_tree_attention_workspace_floats": (_i64, [_i, _i, _i, _i]),
    "ss_tree_attention": (_i, [_p, _p, _p, _p, _p, _p, _p, _p, _p, _p, _p, _p, _p, _i, _i, _i, _i,
                               _i, _i, _i, _f, _i, _i, _p, _i, _p]),
}


@functools.lru_cache(maxsize=None)
def load(flag_bits: int | None = None) -> ctypes.CDLL:
    """The kernel library (built on first use), with ctypes signatures set.

    Loading needs no GPU (cudart is linked statically and finds the driver lazily); calls that
    touch a device then fail with a CUDA status that the wrappers turn into CudaKernelError.

    Raises:
        KernelBuildError: build failure, a missing export, or a library of another ABI version.
    """
    path = build(flag_bits).path
    return _open(path)


def _open(path: Path) -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise KernelBuildError(f"cannot load {path}: {e}") from e
    missing = [name for name in EXPORTS if not hasattr(lib, name)]
    if missing:
        raise KernelBuildError(f"{path} lacks the exports {missing}")
    for name, (res, args) in EXPORTS.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
    if lib.ss_abi_version() != ABI_VERSION:
        raise KernelBuildError(f"{path} has ABI {lib.ss_abi_version()}, expected {ABI_VERSION}")
    return lib


def error_name(status: int, lib: ctypes.CDLL | None = None) -> tuple[str, str]:
    """``(name, description)`` of a cudaError_t value."""
    lib = lib or load()
    return lib.ss_error_name(status).decode(), lib.ss_error_string(status).decode()


def check(status: int, what: str, lib: ctypes.CDLL | None = None) -> None:
    """Raise CudaKernelError when ``status`` (a cudaError_t returned by ``what``) is nonzero."""
    if status != 0:
        name, text = error_name(status, lib)
        raise CudaKernelError(what, status, name, text)


def device_count() -> int:
    """CUDA devices visible to the kernel library; 0 without a driver or device."""
    lib = load()
    n = ctypes.c_int(0)
    st = lib.ss_device_count(ctypes.byref(n))
    if st != 0:
        name, _ = error_name(st, lib)
        if name in ("cudaErrorNoDevice", "cudaErrorInsufficientDriver"):
            return 0
        check(st, "cudaGetDeviceCount", lib)
    return n.value


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """Whether the CUDA kernels can run here: torch sees a GPU and the library builds and loads.

    Cached; never raises.
    """
    try:
        if not torch.cuda.is_available():
            return False
        return device_count() > 0
    except (KernelBuildError, CudaKernelError, OSError):
        return False


# ---------------------------------------------------------------------------------------------
# tensor helpers
# ---------------------------------------------------------------------------------------------

def _check_tensor(name: str, t: torch.Tensor, device: torch.device | None = None,
                  dtypes: tuple | None = None, ndim: int | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cuda":
        raise ValueError(f"{name} must be a CUDA tensor, got device {t.device}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(f"{name} has dtype {t.dtype}, expected one of {list(dtypes)}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _stream(device: torch.device) -> ctypes.c_void_p:
    return ctypes.c_void_p(torch.cuda.current_stream(device).cuda_stream)


_FLOATS = tuple(DTYPE_CODES)


# ---------------------------------------------------------------------------------------------
# swiglu
# ---------------------------------------------------------------------------------------------

def fused_swiglu_wins(M: int, weight_bytes: int, dtype: torch.dtype) -> bool:
    """Whether the fused kernel beats cuBLAS (``x @ W^T`` then SiLU * up) for ``M`` input rows
    against ``weight_bytes`` bytes of gate + up weights.

    Measured on an H100 (bench/LOG.md, "CUDA kernels on an H100", M = 1, 2, 4, 8, 16 over
    the Llama-3 / Qwen shapes): the kernel is a GEMV with fp32 FMAs, so it wins while streaming
    the weights is the whole cost and loses once cuBLAS's tensor cores pay off: at M = 9-16
    beyond ~32 MB of weights (0.26-0.96x at 50 MB and more), and in bf16 / fp16 at M = 4-8
    beyond ~96 MB (0.73-0.96x at 100-235 MB). Up to M = 2, and in fp32 up to M = 8, it is at
    least at parity on every measured shape.
    """
    if M > 8:
        return weight_bytes <= 32 * 2**20
    if M >= 4 and dtype in (torch.bfloat16, torch.float16):
        return weight_bytes < 96 * 2**20
    return True


def swiglu(x: torch.Tensor, w_gate_up: torch.Tensor) -> torch.Tensor:
    """Fused SwiGLU ``SiLU(x @ W_gate^T) * (x @ W_up^T)`` (see reference.swiglu).

    Shapes: x ``[M, K]``, w_gate_up ``[2 * I, K]`` (gate rows first), same CUDA device and dtype
    (float32, bfloat16 or float16), contiguous. Returns ``[M, I]`` in x's dtype. The fused skinny
    kernel (fp32 accumulation) runs where :func:`fused_swiglu_wins` says it is faster (M <= 16
    only); other shapes, prefill among them, use cuBLAS through torch.

    Raises:
        TypeError / ValueError: bad device, dtype, shape or layout.
        CudaKernelError: the launch failed.
    """
    _check_tensor("x", x, dtypes=_FLOATS, ndim=2)
    _check_tensor("w_gate_up", w_gate_up, device=x.device, dtypes=(x.dtype,), ndim=2)
    M, K = x.shape
    if w_gate_up.shape[1] != K or w_gate_up.shape[0] % 2 != 0:
        raise ValueError(f"w_gate_up must be [2*I, {K}], got {tuple(w_gate_up.shape)}")
    I = w_gate_up.shape[0] // 2
    if M > MAX_M or not fused_swiglu_wins(M, w_gate_up.numel() * w_gate_up.element_size(), x.dtype):
        from swiftspec.ops import reference
        return reference.swiglu(x, w_gate_up)
    out = torch.empty((M, I), dtype=x.dtype, device=x.device)
    if M == 0 or I == 0:
        return out
    lib = load()
    with torch.cuda.device(x.device):
        st = lib.ss_swiglu(x.data_ptr(), w_gate_up.data_ptr(), out.data_ptr(), M, K, I,
                           DTYPE_CODES[x.dtype], _stream(x.device))
    check(st, "ss_swiglu", lib)
    return out


# ---------------------------------------------------------------------------------------------
# RMSNorm
# ---------------------------------------------------------------------------------------------

def rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
             eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused residual add + RMSNorm in one launch (``csrc/kernels/norm.cu``; semantics of
    reference.rms_norm, fp32 statistics; batch invariant: one block per row, fixed order).

    Shapes: x and residual ``[rows, H]`` (residual may be None), weight ``[H]``; one CUDA device
    and dtype (float32, bfloat16 or float16), contiguous; ``H <= 8192``. Returns ``(y, x +
    residual)`` (``(y, x)`` without a residual), each ``[rows, H]``.

    Raises:
        TypeError / ValueError: bad device, dtype, shape or layout.
        CudaKernelError: the launch failed.
    """
    _check_tensor("x", x, dtypes=_FLOATS, ndim=2)
    _check_tensor("weight", weight, device=x.device, dtypes=(x.dtype,), ndim=1)
    rows, H = x.shape
    if weight.shape[0] != H or not 1 <= H <= NORM_MAX_H:
        raise ValueError(f"weight must be [{H}] with 1 <= H <= {NORM_MAX_H}, got {tuple(weight.shape)}")
    res_out = None
    if residual is not None:
        _check_tensor("residual", residual, device=x.device, dtypes=(x.dtype,), ndim=2)
        if residual.shape != x.shape:
            raise ValueError(f"residual must be {tuple(x.shape)}, got {tuple(residual.shape)}")
        res_out = torch.empty_like(x)
    out = torch.empty_like(x)
    lib = load()
    with torch.cuda.device(x.device):
        st = lib.ss_rms_norm(x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(),
                             out.data_ptr(), None if res_out is None else res_out.data_ptr(), rows, H, float(eps),
                             DTYPE_CODES[x.dtype], _stream(x.device))
    check(st, "ss_rms_norm", lib)
    return out, (x if res_out is None else res_out)


# ---------------------------------------------------------------------------------------------
# tree attention
# ---------------------------------------------------------------------------------------------

class TreeAttentionWorkspace:
    """Split-KV partials and per-head arrival counters of :func:`tree_attention` on one device.

    The counters start at zero and every launch leaves them at zero (the last-arriving block
    resets its head's counter), so one workspace serves any number of launches and CUDA-graph
    replays, as long as launches using it do not run concurrently (one stream at a time; give
    each concurrently used stream its own workspace). Its first use by :func:`tree_attention`
    reserves room for the largest launch of that head count and head dim (16 queries, 64
    splits), so it never grows while the same model uses it and the addresses CUDA graphs
    captured stay valid; a workspace shared by models of other shapes grows, but not while a CUDA
    graph is being captured.
    """

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.partials = torch.empty(0, dtype=torch.float32, device=self.device)
        self.counters = torch.zeros(0, dtype=torch.int32, device=self.device)

    def reserve(self, floats: int, heads: int) -> None:
        """Make room for ``floats`` partial floats and ``heads`` counters.

        Raises:
            RuntimeError: growth would be needed during CUDA-graph capture.
        """
        if self.partials.numel() >= floats and self.counters.numel() >= heads:
            return
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "tree_attention workspace must grow during CUDA-graph capture; run the op once "
                "eagerly with the largest shapes (or pass a reserved TreeAttentionWorkspace) first")
        if self.partials.numel() < floats:
            self.partials = torch.empty(floats, dtype=torch.float32, device=self.device)
        if self.counters.numel() < heads:
            self.counters = torch.zeros(heads, dtype=torch.int32, device=self.device)


_workspaces: dict[torch.device, TreeAttentionWorkspace] = {}


@functools.lru_cache(maxsize=None)
def _max_workspace_floats(Hq: int, D: int) -> int:
    """Partial floats of the largest tree-attention launch of ``Hq`` heads of dim ``D``."""
    return load().ss_tree_attention_workspace_floats(MAX_M, Hq, D, ATTN_MAX_SPLITS)


def tree_attention_plan(S: int, Hq: int, num_splits: int | None = None) -> tuple[int, int]:
    """``(num_splits, keys_per_split)`` of the split-KV launch for S keys and Hq query heads on
    the current device (``num_splits`` forces a count, clamped to [1, 64] and the key tiles)."""
    lib = load()
    ns, kps = ctypes.c_int(0), ctypes.c_int(0)
    check(lib.ss_tree_attention_plan(S, Hq, num_splits or 0, ctypes.byref(ns), ctypes.byref(kps)),
          "ss_tree_attention_plan", lib)
    return ns.value, kps.value


def tree_attention_split_cap(Hq: int) -> int:
    """The auto plan's cap on the KV splits for ``Hq`` query heads on the current device: the
    grid of a launch whose KV length is on the device (``tree_attention(kv_len=...)``)."""
    lib = load()
    cap = ctypes.c_int(0)
    check(lib.ss_tree_attention_split_cap(Hq, ctypes.byref(cap)), "ss_tree_attention_split_cap", lib)
    return cap.value


def tree_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                   positions: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor,
                   mask: torch.Tensor, scale: float, *, num_splits: int | None = None,
                   workspace: TreeAttentionWorkspace | None = None,
                   kv_len: torch.Tensor | None = None) -> torch.Tensor:
    """RoPE + KV write + masked attention over prefix + tree cache in one launch
    (see reference.tree_attention for the exact semantics).

    Shapes / dtypes: q ``[n, Hq, D]``; k_new, v_new ``[n, Hk, D]``; k_cache, v_cache ``[Hk, C, D]``
    (written in place at ``slots``; negative slots are skipped, slots >= C too); q, k_new, v_new and
    the caches share one dtype (float32, bfloat16 or float16); slots, positions ``[n]`` int64
    (positions must be in ``[0, P)``; the kernel clamps out-of-range ones instead of reading out
    of bounds); cos_table, sin_table ``[P, D]`` float32; mask ``[n, S]`` bool with ``S <= C``.
    ``Hq % Hk == 0``, D even and <= 256. Returns ``[n, Hq * D]`` in q's dtype; softmax in fp32;
    fully masked rows give zeros. n <= 16 runs the fused kernel, larger n the reference.

    Args:
        num_splits: force the number of KV splits (default: from the device's SM count).
        workspace: split partials / counters (default: one shared workspace per device; see
            :class:`TreeAttentionWorkspace` for the one-stream-at-a-time rule).
        kv_len: ``[1]`` int64 on q's device, the number of cache slots in use, read by the
            kernel when it runs (a CUDA graph's live length: its mask is padded to the
            capacity). The caller promises ``mask[:, kv_len:]`` is all False; the kernel then
            attends only ``[0, min(S, kv_len))`` and splits those keys as a launch over
            ``mask[:, :kv_len]`` would (the same result, bit for bit), so a replay's work follows
            the context, not the capacity. ``num_splits`` then caps the split count.

    Raises:
        TypeError / ValueError: bad device, dtype, shape or layout.
        RuntimeError: the workspace would have to grow during CUDA-graph capture.
        CudaKernelError: the launch failed.
    """
    _check_tensor("q", q, dtypes=_FLOATS, ndim=3)
    dev = q.device
    for name, t in (("k_new", k_new), ("v_new", v_new)):
        _check_tensor(name, t, device=dev, dtypes=(q.dtype,), ndim=3)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check_tensor(name, t, device=dev, dtypes=(q.dtype,), ndim=3)
    for name, t in (("slots", slots), ("positions", positions)):
        _check_tensor(name, t, device=dev, dtypes=(torch.int64,), ndim=1)
    for name, t in (("cos_table", cos_table), ("sin_table", sin_table)):
        _check_tensor(name, t, device=dev, dtypes=(torch.float32,), ndim=2)
    _check_tensor("mask", mask, device=dev, dtypes=(torch.bool,), ndim=2)
    if kv_len is not None:
        _check_tensor("kv_len", kv_len, device=dev, dtypes=(torch.int64,), ndim=1)
        if kv_len.shape != (1,):
            raise ValueError(f"kv_len must be [1], got {tuple(kv_len.shape)}")
    n, Hq, D = q.shape
    Hk = k_new.shape[1]
    Hkc, C, Dc = k_cache.shape
    S = mask.shape[1]
    P = cos_table.shape[0]
    if k_new.shape != (n, Hk, D) or v_new.shape != (n, Hk, D):
        raise ValueError(f"k_new / v_new must be [{n}, Hk, {D}], got {tuple(k_new.shape)} / "
                         f"{tuple(v_new.shape)}")
    if (Hkc, Dc) != (Hk, D) or v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache / v_cache must be [{Hk}, C, {D}], got {tuple(k_cache.shape)} / "
                         f"{tuple(v_cache.shape)}")
    if Hq % Hk != 0:
        raise ValueError(f"Hq={Hq} is not a multiple of Hk={Hk}")
    if D % 2 != 0 or D > ATTN_MAX_HEAD_DIM:
        raise ValueError(f"head dim must be even and <= {ATTN_MAX_HEAD_DIM}, got {D}")
    if slots.shape != (n,) or positions.shape != (n,):
        raise ValueError(f"slots / positions must be [{n}]")
    if cos_table.shape != (P, D) or sin_table.shape != (P, D) or P < 1:
        raise ValueError(f"cos_table / sin_table must be [P >= 1, {D}], got "
                         f"{tuple(cos_table.shape)} / {tuple(sin_table.shape)}")
    if mask.shape[0] != n or S > C:
        raise ValueError(f"mask must be [{n}, S <= {C}], got {tuple(mask.shape)}")
    if n > MAX_M:
        from swiftspec.ops import reference
        return reference.tree_attention(q, k_new, v_new, k_cache, v_cache, slots, positions,
                                        cos_table, sin_table, mask, scale)
    out = torch.empty((n, Hq * D), dtype=q.dtype, device=dev)
    if n == 0:
        return out
    lib = load()
    with torch.cuda.device(dev):
        if kv_len is None:
            splits, kps = tree_attention_plan(S, Hq, num_splits)
        else:  # the grid holds the most splits any length gets; the kernel plans for kv_len
            splits, kps = min(num_splits or tree_attention_split_cap(Hq), ATTN_MAX_SPLITS), 0
        if workspace is None:
            workspace = _workspaces.get(dev)
            if workspace is None:
                workspace = _workspaces[dev] = TreeAttentionWorkspace(dev)
        elif workspace.device != dev:
            raise ValueError(f"workspace is on {workspace.device}, expected {dev}")
        # room for the largest launch of these heads (any n <= 16, any split count) at once:
        # growing later would leave graphs captured before with a pointer to freed memory
        workspace.reserve(_max_workspace_floats(Hq, D), Hq)
        st = lib.ss_tree_attention(
            q.data_ptr(), k_new.data_ptr(), v_new.data_ptr(), k_cache.data_ptr(),
            v_cache.data_ptr(), slots.data_ptr(), positions.data_ptr(), cos_table.data_ptr(),
            sin_table.data_ptr(), mask.data_ptr(), out.data_ptr(), workspace.partials.data_ptr(),
            workspace.counters.data_ptr(), n, Hq, Hk, D, C, S, P, float(scale), splits, kps,
            None if kv_len is None else kv_len.data_ptr(), DTYPE_CODES[q.dtype], _stream(dev))
    check(st, "ss_tree_attention", lib)
    return out


# ---------------------------------------------------------------------------------------------
# IPC buffers and the LL communicator
# ---------------------------------------------------------------------------------------------
# cupy could make these IPC calls too, but the kernel library already links cudart, so the
# handles come from there and the package needs no extra dependency.

def ipc_alloc(nbytes: int, flag_bits: int | None = None) -> tuple[int, bytes]:
    """cudaMalloc ``nbytes`` on the current device, zero it and export it.

    Returns ``(device pointer, 64-byte IPC handle)``; free with :func:`free`.

    Raises:
        CudaKernelError: no device, out of memory, ...
    """
    lib = load(flag_bits)
    ptr = ctypes.c_void_p(0)
    handle = ctypes.create_string_buffer(IPC_HANDLE_BYTES)
    check(lib.ss_ipc_alloc(int(nbytes), ctypes.byref(ptr), handle), "ss_ipc_alloc", lib)
    return int(ptr.value), handle.raw


def ipc_open(handle: bytes, flag_bits: int | None = None) -> int:
    """Map a peer process's exported buffer; returns its device pointer in this process."""
    if len(handle) != IPC_HANDLE_BYTES:
        raise ValueError(f"an IPC handle has {IPC_HANDLE_BYTES} bytes, got {len(handle)}")
    lib = load(flag_bits)
    ptr = ctypes.c_void_p(0)
    buf = ctypes.create_string_buffer(bytes(handle), IPC_HANDLE_BYTES)
    check(lib.ss_ipc_open(buf, ctypes.byref(ptr)), "ss_ipc_open", lib)
    return int(ptr.value)


def ipc_close(ptr: int, flag_bits: int | None = None) -> None:
    """Unmap a buffer from :func:`ipc_open`."""
    lib = load(flag_bits)
    check(lib.ss_ipc_close(ctypes.c_void_p(ptr)), "ss_ipc_close", lib)


def free(ptr: int, flag_bits: int | None = None) -> None:
    """Free a buffer from :func:`ipc_alloc`."""
    lib = load(flag_bits)
    check(lib.ss_free(ctypes.c_void_p(ptr)), "ss_free", lib)


class CudaLLCommunicator:
    """LL-protocol all-reduce and fused GEMM + all-reduce for one TP group on CUDA IPC buffers.

    Construction is collective over the group (every rank calls it, in the same order relative
    to other collectives): each rank allocates a zeroed buffer of
    ``256 + 2 * size * 2 * capacity_bytes`` bytes on its current device, the 64-byte IPC handles
    are exchanged with ``all_gather_object`` and every rank maps its peers' buffers. All ranks
    must then issue the same sequence of ``all_reduce`` / ``gemm_all_reduce`` calls on one stream
    each (they share the epoch counter in the buffer); calls are stream-ordered and CUDA-graph
    capturable (the epoch advances in device memory).

    Args:
        group: the torch.distributed process group of the TP group (NCCL or gloo; used only
            during construction and :meth:`close`); may be None when ``size == 1``.
        rank: this process's rank inside the group.
        size: group size (<= 16). Every rank is a process of one host, each on its own GPU or
            several on one GPU (CUDA IPC maps a buffer of another process on the same device;
            without MPS the GPU time-slices between the processes, so a collective completes
            once every rank's kernel has had the GPU; under MPS their kernels run side by side,
            each client capped with ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` so the grids of all
            ranks fit at once).
        capacity_bytes: payload bytes per rank per call; larger messages are split into
            several kernel launches (one epoch each).
        device: the CUDA device (default: the current one).
        protocol: ``"ll16"`` (16-byte packets, NCCL LL) or ``"ll8"`` (8-byte packets).
        flag_bits: LL flag width of the library build (2 for the wrap-around tests).
        timeout_s: a kernel waiting longer than this for a peer traps (the CUDA context then
            reports a launch failure) instead of hanging.

    Raises:
        ValueError: bad arguments. CudaKernelError / RuntimeError: allocation or mapping failed on
        some rank (every rank raises).
    """

    backend = "ll"  # what swiftspec.distributed.parallel.TPContext.comm_backend reports for a group on it

    def __init__(self, group, rank: int, size: int, capacity_bytes: int = 1 << 20, *,
                 device: torch.device | int | None = None, protocol: str = "ll16",
                 flag_bits: int | None = None, timeout_s: float = 30.0):
        if not 1 <= size <= MAX_RANKS or not 0 <= rank < size:
            raise ValueError(f"need 0 <= rank < size <= {MAX_RANKS}, got rank={rank} size={size}")
        if protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {list(PROTOCOLS)}, got {protocol!r}")
        if capacity_bytes < 64:
            raise ValueError(f"capacity_bytes must be >= 64, got {capacity_bytes}")
        if size > 1 and group is None:
            raise ValueError("a group of size > 1 needs its torch.distributed process group")
        if timeout_s <= 0:
            raise ValueError("timeout_s must be positive")
        self.group, self.rank, self.size = group, rank, size
        self.protocol, self.flag_bits = protocol, flag_bits
        self.timeout_ns = int(timeout_s * 1e9)
        if device is None:
            index = torch.cuda.current_device()
        elif isinstance(device, int):
            index = device
        else:
            d = torch.device(device)
            index = d.index if d.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", index)
        self._lib = load(flag_bits)
        # region = one (slot, source) inbox: packets carry as many flag bytes as payload bytes
        self.region_bytes = (2 * int(capacity_bytes) + 15) // 16 * 16
        self.capacity_bytes = self.region_bytes // 2
        self._local = 0
        self._peers: list[int] = []
        self._closed = False
        nbytes = self._lib.ss_ll_buffer_bytes(size, self.region_bytes)
        error = None
        with torch.cuda.device(self.device):
            try:
                self._local, handle = ipc_alloc(nbytes, flag_bits)
            except CudaKernelError as e:
                error, handle = e, b""
            handles = [handle]
            if size > 1:
                handles = [None] * size
                torch.distributed.all_gather_object(handles, handle, group=group)
            ptrs = [0] * size
            if error is None and all(h for h in handles):
                for r, h in enumerate(handles):
                    if r == rank:
                        ptrs[r] = self._local
                        continue
                    try:
                        ptrs[r] = ipc_open(h, flag_bits)
                        self._peers.append(ptrs[r])
                    except CudaKernelError as e:
                        error = e
                        break
            elif error is None:
                error = RuntimeError("another rank failed to allocate its LL buffer")
            # every rank learns whether every rank succeeded, so a failure never leaves peers
            # spinning on a buffer nobody writes
            ok = [error is None]
            if size > 1:
                oks = [None] * size
                torch.distributed.all_gather_object(oks, error is None, group=group)
                ok = oks
            if not all(ok):
                self._release()
                if error is not None:
                    raise error
                raise RuntimeError(f"CudaLLCommunicator: ranks {[r for r, o in enumerate(ok) if not o]} "
                                   "failed to set up their IPC buffers")
            self._table = torch.tensor(ptrs, dtype=torch.int64, device=self.device)

    # -- collectives ------------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the group in place and return it.

        x: contiguous CUDA tensor on this communicator's device, float32 / bfloat16 / float16, any
        shape and number of elements. Summed in fp32 in rank order 0..size-1 and rounded once, so
        every rank gets identical bits.

        Raises:
            ValueError: bad tensor. CudaKernelError: the launch failed. RuntimeError: closed.
        """
        self._check_open()
        _check_tensor("x", x, device=self.device, dtypes=_FLOATS)
        if x.numel() == 0:
            return x
        with torch.cuda.device(self.device):
            st = self._lib.ss_ll_all_reduce(
                x.data_ptr(), x.data_ptr(), x.numel(), DTYPE_CODES[x.dtype],
                PROTOCOLS[self.protocol], self._table.data_ptr(), self._local, self.rank,
                self.size, self.region_bytes, self.timeout_ns, _stream(self.device))
        check(st, "ss_ll_all_reduce", self._lib)
        return x

    def gemm_all_reduce(self, x: torch.Tensor, w: torch.Tensor,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
        """Row-parallel linear ``all_reduce(x @ w^T) + bias`` (see reference.gemm_all_reduce).

        Shapes: x ``[M, K_local]``, w ``[N, K_local]``, bias ``[N]`` or None; one dtype (float32,
        bfloat16 or float16), contiguous, on this communicator's device. Returns ``[M, N]`` in x's
        dtype, identical bits on every rank: partials are exchanged and summed in fp32 in rank
        order, the bias is added once after the sum, then rounded. M <= 16 runs the fused kernel
        (tiles are pushed to the peers as soon as they are computed); larger M multiplies with
        cuBLAS and all-reduces the fp32 product.

        Raises:
            ValueError: bad tensors. CudaKernelError: the launch failed (e.g. the capacity cannot
            hold one 32-column tile of partials: capacity_bytes < 32 * M * 4).
        """
        self._check_open()
        _check_tensor("x", x, device=self.device, dtypes=_FLOATS, ndim=2)
        _check_tensor("w", w, device=self.device, dtypes=(x.dtype,), ndim=2)
        M, K = x.shape
        N = w.shape[0]
        if w.shape[1] != K:
            raise ValueError(f"w must be [N, {K}], got {tuple(w.shape)}")
        if bias is not None:
            _check_tensor("bias", bias, device=self.device, dtypes=(x.dtype,), ndim=1)
            if bias.shape[0] != N:
                raise ValueError(f"bias must be [{N}], got {tuple(bias.shape)}")
        if M > MAX_M:
            y = (x @ w.t()).float()
            self.all_reduce(y)
            if bias is not None:
                y += bias.float()
            return y.to(x.dtype)
        out = torch.empty((M, N), dtype=x.dtype, device=self.device)
        if M == 0 or N == 0:
            return out
        with torch.cuda.device(self.device):
            st = self._lib.ss_ll_gemm_all_reduce(
                x.data_ptr(), w.data_ptr(), bias.data_ptr() if bias is not None else None,
                out.data_ptr(), M, N, K, DTYPE_CODES[x.dtype], PROTOCOLS[self.protocol],
                self._table.data_ptr(), self._local, self.rank, self.size, self.region_bytes,
                self.timeout_ns, _stream(self.device))
        check(st, "ss_ll_gemm_all_reduce", self._lib)
        return out

    def epoch(self) -> int:
        """The epoch counter in device memory (synchronizes with the device; for tests)."""
        self._check_open()
        e = ctypes.c_uint64(0)
        with torch.cuda.device(self.device):
            torch.cuda.current_stream(self.device).synchronize()
            check(self._lib.ss_ll_read_epoch(self._local, ctypes.byref(e)), "ss_ll_read_epoch",
                  self._lib)
        return int(e.value)

    # -- lifetime ---------------------------------------------------------------------------
    def close(self) -> None:
        """Collective: wait for all ranks' pending collectives, unmap the peers, free the buffer."""
        if self._closed:
            return
        with torch.cuda.device(self.device):
            torch.cuda.synchronize(self.device)
            if self.size > 1:
                # no peer may still be writing into our buffer when it is freed
                torch.distributed.barrier(group=self.group)
        self._release()

    def _release(self) -> None:
        if self._closed:
            return
        self._closed = True
        lib = self._lib
        with torch.cuda.device(self.device):
            for p in self._peers:
                lib.ss_ipc_close(ctypes.c_void_p(p))
            self._peers = []
            if self._local:
                lib.ss_free(ctypes.c_void_p(self._local))
                self._local = 0

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("CudaLLCommunicator is closed")

    def __enter__(self) -> "CudaLLCommunicator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        # Best effort without collectives (garbage collection cannot run a barrier).
        try:
            if not self._closed:
                torch.cuda.synchronize(self.device)
                self._release()
        except Exception:
            pass


if __name__ == "__main__":
    res = build(verbose=True)
    print("built" if res.built else "cached", res.path)
