"""Load the CUDA kernel library with :mod:`ctypes` and check its calls.

The library (:func:`swiftspec.ops.cuda_build.build`) is loaded only when first needed: importing
this module never needs CUDA. Its ABI (the exported functions' signatures and the constants of
``csrc/kernels/api.h``) is declared here; a nonzero cudaError_t from a call becomes
:class:`CudaKernelError` with the CUDA error name. Also the tensor checks every wrapper makes.
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from swiftspec.ops.cuda_build import KernelBuildError, build

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


def check_tensor(name: str, t: torch.Tensor, device: torch.device | None = None,
                 dtypes: tuple | None = None, ndim: int | None = None) -> None:
    """Check a kernel argument: a contiguous CUDA tensor, on ``device``, of one of ``dtypes`` and
    ``ndim`` dimensions where those are given.

    Raises:
        TypeError: not a tensor. ValueError: another device, dtype, rank or a non-contiguous layout
        (the message names ``name``).
    """
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


def stream_handle(device: torch.device) -> ctypes.c_void_p:
    """The current CUDA stream of ``device`` as the ``cudaStream_t`` the library's calls take."""
    return ctypes.c_void_p(torch.cuda.current_stream(device).cuda_stream)


FLOAT_DTYPES = tuple(DTYPE_CODES)
