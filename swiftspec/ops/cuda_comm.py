"""CUDA IPC buffers and :class:`CudaLLCommunicator`, the CUDA counterpart of the CPU
:class:`swiftspec.distributed.comm.ShmCommunicator` (same ``all_reduce`` / ``gemm_all_reduce``
interface; SwiftSpec paper section 3.3, the LL protocol of NCCL).

cupy could make these IPC calls too, but the kernel library already links cudart, so the
handles come from there and the package needs no extra dependency.
"""
from __future__ import annotations

import ctypes

import torch

from swiftspec.ops.cuda_lib import (
    DTYPE_CODES,
    FLOAT_DTYPES,
    IPC_HANDLE_BYTES,
    MAX_M,
    MAX_RANKS,
    PROTOCOLS,
    CudaKernelError,
    check,
    check_tensor,
    load,
    stream_handle,
)


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


def _all_gather_fixed(data: bytes, group) -> list[bytes]:
    """Every group member's ``data`` (the same length on every member), in rank order: a
    ``uint8`` tensor all-gather, on this rank's CUDA device where ``group`` is NCCL."""
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.distributed.get_backend(group) == "nccl" else "cpu"
    mine = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev)
    parts = [torch.empty_like(mine) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(parts, mine, group=group)
    return [bytes(p.cpu().numpy()) for p in parts]


class CudaLLCommunicator:
    """LL-protocol all-reduce and fused GEMM + all-reduce for one TP group on CUDA IPC buffers.

    Construction is collective over the group (every rank calls it, in the same order relative
    to other collectives): each rank allocates a zeroed buffer of
    ``256 + 2 * size * 2 * capacity_bytes`` bytes on its current device, the 64-byte IPC handles
    are exchanged as fixed-size byte tensors (never pickled) and every rank maps its peers' buffers. All ranks
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
                handles = _all_gather_fixed(handle.ljust(IPC_HANDLE_BYTES, b"\0") + (b"\1" if handle else b"\0"), group)
                handles = [h[:IPC_HANDLE_BYTES] if h[-1] else b"" for h in handles]
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
                ok = [bool(x[0]) for x in _all_gather_fixed(b"\1" if error is None else b"\0", group)]
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
        check_tensor("x", x, device=self.device, dtypes=FLOAT_DTYPES)
        if x.numel() == 0:
            return x
        with torch.cuda.device(self.device):
            st = self._lib.ss_ll_all_reduce(
                x.data_ptr(), x.data_ptr(), x.numel(), DTYPE_CODES[x.dtype],
                PROTOCOLS[self.protocol], self._table.data_ptr(), self._local, self.rank,
                self.size, self.region_bytes, self.timeout_ns, stream_handle(self.device))
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
        check_tensor("x", x, device=self.device, dtypes=FLOAT_DTYPES, ndim=2)
        check_tensor("w", w, device=self.device, dtypes=(x.dtype,), ndim=2)
        M, K = x.shape
        N = w.shape[0]
        if w.shape[1] != K:
            raise ValueError(f"w must be [N, {K}], got {tuple(w.shape)}")
        if bias is not None:
            check_tensor("bias", bias, device=self.device, dtypes=(x.dtype,), ndim=1)
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
                self.timeout_ns, stream_handle(self.device))
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
