"""The CUDA latency kernels for torch tensors (``csrc/kernels/*.cu``; SwiftSpec paper section 3.3):
fused SwiGLU, RMSNorm with the residual add, and split-KV tree attention.

Each wrapper checks device / dtype / shape / contiguity, allocates the outputs, passes
``data_ptr()`` and the current stream to the library (:mod:`swiftspec.ops.cuda_lib`, built by
:mod:`swiftspec.ops.cuda_build`), and raises :class:`~swiftspec.ops.cuda_lib.CudaKernelError` with
the CUDA error name on a nonzero status. The IPC buffers and the LL communicator are in
:mod:`swiftspec.ops.cuda_comm`.

Semantics of every op are those of :mod:`swiftspec.ops.reference`.
"""
from __future__ import annotations

import ctypes
import functools

import torch

from swiftspec.ops.cuda_lib import (
    ATTN_MAX_HEAD_DIM,
    ATTN_MAX_SPLITS,
    DTYPE_CODES,
    FLOAT_DTYPES,
    MAX_M,
    NORM_MAX_H,
    check,
    check_tensor,
    load,
    stream_handle,
)


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
    check_tensor("x", x, dtypes=FLOAT_DTYPES, ndim=2)
    check_tensor("w_gate_up", w_gate_up, device=x.device, dtypes=(x.dtype,), ndim=2)
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
                           DTYPE_CODES[x.dtype], stream_handle(x.device))
    check(st, "ss_swiglu", lib)
    return out


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
    check_tensor("x", x, dtypes=FLOAT_DTYPES, ndim=2)
    check_tensor("weight", weight, device=x.device, dtypes=(x.dtype,), ndim=1)
    rows, H = x.shape
    if weight.shape[0] != H or not 1 <= H <= NORM_MAX_H:
        raise ValueError(f"weight must be [{H}] with 1 <= H <= {NORM_MAX_H}, got {tuple(weight.shape)}")
    res_out = None
    if residual is not None:
        check_tensor("residual", residual, device=x.device, dtypes=(x.dtype,), ndim=2)
        if residual.shape != x.shape:
            raise ValueError(f"residual must be {tuple(x.shape)}, got {tuple(residual.shape)}")
        res_out = torch.empty_like(x)
    out = torch.empty_like(x)
    lib = load()
    with torch.cuda.device(x.device):
        st = lib.ss_rms_norm(x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(),
                             out.data_ptr(), None if res_out is None else res_out.data_ptr(), rows, H, float(eps),
                             DTYPE_CODES[x.dtype], stream_handle(x.device))
    check(st, "ss_rms_norm", lib)
    return out, (x if res_out is None else res_out)


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
    check_tensor("q", q, dtypes=FLOAT_DTYPES, ndim=3)
    dev = q.device
    for name, t in (("k_new", k_new), ("v_new", v_new)):
        check_tensor(name, t, device=dev, dtypes=(q.dtype,), ndim=3)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(name, t, device=dev, dtypes=(q.dtype,), ndim=3)
    for name, t in (("slots", slots), ("positions", positions)):
        check_tensor(name, t, device=dev, dtypes=(torch.int64,), ndim=1)
    for name, t in (("cos_table", cos_table), ("sin_table", sin_table)):
        check_tensor(name, t, device=dev, dtypes=(torch.float32,), ndim=2)
    check_tensor("mask", mask, device=dev, dtypes=(torch.bool,), ndim=2)
    if kv_len is not None:
        check_tensor("kv_len", kv_len, device=dev, dtypes=(torch.int64,), ndim=1)
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
            None if kv_len is None else kv_len.data_ptr(), DTYPE_CODES[q.dtype], stream_handle(dev))
    check(st, "ss_tree_attention", lib)
    return out
