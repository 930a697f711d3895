"""The CUDA kernels (csrc/kernels via swiftspec/ops/cuda.py, cuda_lib.py, cuda_comm.py) against the PyTorch references.

Runs wherever CUDA is present (skipped as a whole otherwise): SwiGLU and tree attention vs
``swiftspec.ops.reference`` (fp32 / bf16 / fp16, masks with fully masked rows and fully masked
splits, slots -1), the LL all-reduce and fused GEMM + all-reduce on a size-1 group (the whole
packet path, epoch advance over many calls, the flag-bits=2 build so flags wrap) and, with >= 2
peer-capable GPUs, on 2 spawned NCCL ranks (results vs a rank-order sum, identical bits on both
ranks), CUDA-graph capture + replay of tree attention and of the collectives vs eager calls, and a
peer that never answers making the kernel fail instead of hanging.
"""
from __future__ import annotations

import ctypes
import math
import subprocess
import sys
import textwrap
import time
import traceback

import pytest
import torch
from ranks import digest, rank_inputs, rank_sum, report, spawn_ranks

from swiftspec.ops import reference
from swiftspec.ops.cuda_comm import CudaLLCommunicator
from swiftspec.ops.cuda_lib import CudaKernelError

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DEADLINE_S = 300.0
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOL = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (3e-2, 3e-2), torch.float16: (5e-3, 5e-3)}


@pytest.fixture(scope="module")
def cuda():
    from swiftspec.ops import cuda as mod
    from swiftspec.ops import cuda_lib as lib

    lib.load()
    assert lib.load(flag_bits=2).ss_ll_flag_bits() == 2
    if lib.device_count() == 0:
        n = ctypes.c_int()
        st = lib.load().ss_device_count(ctypes.byref(n))
        pytest.fail(f"torch sees a GPU but the kernel library's CUDA runtime does not "
                    f"({lib.error_name(st)}): is the driver older than the nvcc used to build it?")
    assert lib.available()
    return mod


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _randn(shape, seed, dtype, scale=1.0, device="cuda"):
    return (torch.randn(shape, generator=_gen(seed)) * scale).to(dtype).to(device)


# ---- SwiGLU ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,K,I", [(1, 64, 48), (3, 100, 7), (8, 1000, 33), (16, 520, 130),
                                   (16, 4096, 16), (17, 64, 9)])
def test_swiglu_matches_reference(cuda, dtype, M, K, I):
    x = _randn((M, K), 1, dtype)
    w = _randn((2 * I, K), 2, dtype, scale=K ** -0.5)
    out = cuda.swiglu(x, w)
    ref = reference.swiglu(x.float(), w.float())
    assert out.shape == (M, I) and out.dtype == dtype
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.float(), ref, atol=atol, rtol=rtol)


def test_swiglu_unaligned_weights_use_the_scalar_path(cuda):
    # a row offset of 1 with K = 100 bf16 leaves the weights 8-byte aligned: no 16-byte loads
    K, I = 100, 24
    big = _randn((2 * I + 1, K), 3, torch.bfloat16, scale=0.1)
    w = big[1:]
    assert w.is_contiguous() and w.data_ptr() % 16 != 0
    x = _randn((5, K), 4, torch.bfloat16)
    torch.testing.assert_close(cuda.swiglu(x, w).float(), reference.swiglu(x.float(), w.float()),
                               atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("M", [1, 8, 16])
def test_swiglu_unaligned_input_matches_the_aligned_one(cuda, M):
    # x 2 bytes off a 16-byte boundary is staged with scalar loads, aligned x with 16-byte loads;
    # the arithmetic after staging is the same, so they agree bit for bit
    K, I = 1040, 40
    w = _randn((2 * I, K), 5, torch.bfloat16, scale=K ** -0.5)
    x = _randn((M, K), 6, torch.bfloat16)
    buf = torch.empty(M * K + 8, dtype=torch.bfloat16, device="cuda")
    shifted = buf[1:1 + M * K].view(M, K)
    shifted.copy_(x)
    assert shifted.is_contiguous() and shifted.data_ptr() % 16 != 0 and x.data_ptr() % 16 == 0
    scalar, vector = cuda.swiglu(shifted, w), cuda.swiglu(x, w)
    assert torch.equal(scalar, vector)
    torch.testing.assert_close(vector.float(), reference.swiglu(x.float(), w.float()), atol=3e-2, rtol=3e-2)


def test_swiglu_argument_errors(cuda):
    x = _randn((2, 64), 1, torch.float32)
    with pytest.raises(ValueError, match="dtype"):
        cuda.swiglu(x, _randn((8, 64), 2, torch.bfloat16))
    with pytest.raises(ValueError, match="2\\*I"):
        cuda.swiglu(x, _randn((7, 64), 2, torch.float32))
    with pytest.raises(ValueError, match="contiguous"):
        cuda.swiglu(x, _randn((64, 8), 2, torch.float32).t())


# ---- RMSNorm ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,H", [(1, 64), (3, 896), (8, 1536), (16, 8192), (40, 100)])
@pytest.mark.parametrize("with_residual", [True, False])
def test_rms_norm_matches_reference(cuda, dtype, rows, H, with_residual):
    x = _randn((rows, H), 7, dtype, scale=3.0)
    res = _randn((rows, H), 8, dtype) if with_residual else None
    w = _randn((H,), 9, dtype)
    y, r = cuda.rms_norm(x, res, w, 1e-6)
    ref_y, ref_r = reference.rms_norm(x, res, w, 1e-6)
    assert torch.equal(r, ref_r)  # x + residual: one rounding, as torch's add
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(y.float(), ref_y.float(), atol=atol, rtol=rtol)


def test_rms_norm_is_batch_invariant(cuda):
    x = _randn((16, 1536), 10, torch.bfloat16)
    res = _randn((16, 1536), 11, torch.bfloat16)
    w = _randn((1536,), 12, torch.bfloat16)
    full = cuda.rms_norm(x, res, w, 1e-6)[0]
    for i in (0, 5, 15):
        assert torch.equal(cuda.rms_norm(x[i:i + 1], res[i:i + 1], w, 1e-6)[0], full[i:i + 1])


def test_rms_norm_argument_errors(cuda):
    x = _randn((2, 64), 1, torch.float32)
    with pytest.raises(ValueError, match="dtype"):
        cuda.rms_norm(x, None, _randn((64,), 2, torch.bfloat16), 1e-6)
    with pytest.raises(ValueError, match="weight must be"):
        cuda.rms_norm(x, None, _randn((63,), 2, torch.float32), 1e-6)
    with pytest.raises(ValueError, match="residual must be"):
        cuda.rms_norm(x, _randn((3, 64), 2, torch.float32), _randn((64,), 2, torch.float32), 1e-6)
    with pytest.raises(ValueError, match="weight must be"):
        cuda.rms_norm(_randn((1, 8193), 1, torch.float32), None, _randn((8193,), 2, torch.float32), 1e-6)


# ---- tree attention ---------------------------------------------------------------------------

def _attn_inputs(n, Hq, Hk, D, C, S, P, dtype, seed, fully_masked_split=False):
    g = _gen(seed)
    dev = "cuda"
    q = torch.randn(n, Hq, D, generator=g).to(dtype).to(dev)
    k_new = torch.randn(n, Hk, D, generator=g).to(dtype).to(dev)
    v_new = torch.randn(n, Hk, D, generator=g).to(dtype).to(dev)
    k_cache = torch.randn(Hk, C, D, generator=g).to(dtype).to(dev)
    v_cache = torch.randn(Hk, C, D, generator=g).to(dtype).to(dev)
    # distinct slots: about half inside the attended range [0, S) (the kernel must use the new
    # rows there, not the cache), the rest beyond S; every third one -1 (padding: not written)
    perm = torch.randperm(C, generator=g)
    inside, outside = perm[perm < S], perm[perm >= S]
    k_in = min(len(inside), (n + 1) // 2)
    chosen = torch.cat([inside[:k_in], outside[:n - k_in]])
    chosen = torch.cat([chosen, inside[k_in:k_in + n - len(chosen)]])
    assert len(chosen) == n, "C must be >= n"
    slots = chosen[torch.randperm(n, generator=g)]
    slots[2::3] = -1
    positions = torch.randint(0, P, (n,), generator=g)
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    ang = torch.arange(P).float()[:, None] * inv[None, :]
    emb = torch.cat((ang, ang), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    mask = torch.rand(n, S, generator=g) < 0.6
    if n > 1:
        mask[1] = False                      # a fully masked row
    if fully_masked_split and S > 32:
        mask[:, 16:] = False                 # every split but the first is fully masked
        mask[0, :16] = True
    return [t.to(dev) for t in (q, k_new, v_new, k_cache, v_cache, slots, positions, cos, sin, mask)]


ATTN_CASES = [
    # n, Hq, Hk, D, C, S, P, num_splits
    (1, 2, 2, 64, 40, 40, 64, None),
    (5, 4, 2, 128, 300, 250, 512, None),
    (5, 4, 2, 128, 300, 250, 512, 1),
    (16, 8, 2, 64, 200, 200, 256, 3),
    (7, 4, 1, 256, 130, 97, 300, 4),
    (3, 2, 1, 30, 50, 37, 64, 2),
    (4, 2, 2, 64, 20, 0, 64, None),        # no keys at all: zeros, cache still written
    (1, 12, 2, 128, 600, 513, 1024, None),  # the default target's heads, a decode step
    (8, 14, 2, 64, 1100, 1030, 2048, None),  # the default draft's heads, an expansion
    (11, 6, 3, 96, 700, 650, 1024, 1),     # three row groups; lanes past the head dim; 6 key chunks
    (13, 6, 2, 40, 90, 90, 128, None),     # four row groups; D % 8 != 0: element-wise loads
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ATTN_CASES)
def test_tree_attention_matches_reference(cuda, dtype, case):
    n, Hq, Hk, D, C, S, P, splits = case
    args = _attn_inputs(n, Hq, Hk, D, C, S, P, dtype, seed=n * 100 + D)
    scale = D ** -0.5
    ref_args = [a.clone() for a in args]
    out = cuda.tree_attention(*args, scale, num_splits=splits)
    ref = reference.tree_attention(*ref_args, scale)
    atol, rtol = TOL[dtype]
    assert out.shape == (n, Hq * D) and out.dtype == dtype
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)
    # KV write: same caches (rows at slots replaced by the rotated new rows, the rest untouched)
    torch.testing.assert_close(args[3].float(), ref_args[3].float(), atol=atol, rtol=rtol)
    torch.testing.assert_close(args[4], ref_args[4], atol=0, rtol=0)
    if n > 1:
        assert torch.count_nonzero(out[1]) == 0  # fully masked row
    ws = cuda._workspaces.get(out.device)
    if ws is not None:
        assert torch.count_nonzero(ws.counters) == 0  # the last-arriving blocks reset them


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tree_attention_fully_masked_splits(cuda, dtype):
    n, Hq, Hk, D, C, S, P = 4, 4, 2, 64, 200, 200, 256
    args = _attn_inputs(n, Hq, Hk, D, C, S, P, dtype, seed=7, fully_masked_split=True)
    ref_args = [a.clone() for a in args]
    out = cuda.tree_attention(*args, 0.125, num_splits=4)
    ref = reference.tree_attention(*ref_args, 0.125)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)
    assert torch.count_nonzero(out[1]) == 0
    assert out[0].abs().sum() > 0


def test_tree_attention_split_counts_agree(cuda):
    args = _attn_inputs(6, 4, 2, 128, 400, 400, 512, torch.float32, seed=11)
    outs = []
    for splits in (1, 2, 5, 25):
        a = [t.clone() for t in args]
        outs.append(cuda.tree_attention(*a, 0.1, num_splits=splits))
    for o in outs[1:]:
        torch.testing.assert_close(o, outs[0], atol=1e-5, rtol=1e-5)


def test_tree_attention_graph_replay_equals_eager(cuda):
    n, Hq, Hk, D, C, S, P = 5, 4, 2, 128, 300, 260, 512
    dtype = torch.bfloat16
    static = _attn_inputs(n, Hq, Hk, D, C, S, P, dtype, seed=21)
    eager_caches = [static[3].clone(), static[4].clone()]
    # warm up on a side stream (workspace reserved outside the capture), as torch recommends
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        cuda.tree_attention(*[t.clone() for t in static], 0.09, num_splits=4)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_static = cuda.tree_attention(*static, 0.09, num_splits=4)
    for it in range(4):
        fresh = _attn_inputs(n, Hq, Hk, D, C, S, P, dtype, seed=100 + it)
        for i in (0, 1, 2, 5, 6, 9):  # q, k_new, v_new, slots, positions, mask
            static[i].copy_(fresh[i])
        graph.replay()
        eager = cuda.tree_attention(fresh[0], fresh[1], fresh[2], *eager_caches, *fresh[5:], 0.09,
                                    num_splits=4)
        torch.cuda.synchronize()
        assert torch.equal(out_static, eager), f"replay {it} differs from the eager call"
        assert torch.equal(static[3], eager_caches[0]) and torch.equal(static[4], eager_caches[1])
    assert torch.count_nonzero(cuda._workspaces[out_static.device].counters) == 0


def _padded(mask, C):
    """``mask [n, S]`` padded with False columns to ``[n, C]`` (a CUDA graph's static mask)."""
    out = torch.zeros(mask.shape[0], C, dtype=torch.bool, device=mask.device)
    out[:, : mask.shape[1]] = mask
    return out


@pytest.mark.parametrize("case", [
    # n, Hq, Hk, D, C, S, P: the mask padded from S to C columns, kv_len = S
    (1, 12, 2, 128, 4104, 300, 4200),   # the default target's heads, an engine-sized cache
    (8, 12, 2, 128, 4104, 1030, 4200),  # a verification of 8 rows
    (8, 14, 2, 64, 4200, 37, 4300),     # the draft's heads, a short context
    (5, 4, 2, 128, 300, 0, 512),        # no keys in use
])
def test_tree_attention_device_kv_len_equals_unpadded(cuda, case):
    """A launch over a mask padded to the capacity with the live length on the device gives
    bit for bit what a launch over the unpadded mask gives (the same split plan), KV writes too."""
    n, Hq, Hk, D, C, S, P = case
    args = _attn_inputs(n, Hq, Hk, D, C, S, P, torch.bfloat16, seed=S + n)
    plain = [a.clone() for a in args]
    args[9] = _padded(args[9], C)
    kv_len = torch.tensor([S], device="cuda")
    out = cuda.tree_attention(*args, D ** -0.5, kv_len=kv_len)
    ref = cuda.tree_attention(*plain, D ** -0.5)
    assert torch.equal(out, ref)
    assert torch.equal(args[3], plain[3]) and torch.equal(args[4], plain[4])
    assert torch.count_nonzero(cuda._workspaces[out.device].counters) == 0


def test_tree_attention_graph_replay_follows_device_kv_len(cuda):
    """One graph captured over the whole capacity, replayed at several live lengths: each replay
    equals the eager launch over the unpadded mask of that length (its own split plan)."""
    n, Hq, Hk, D, C, P = 4, 12, 2, 128, 2048, 2100
    dtype = torch.bfloat16
    static = _attn_inputs(n, Hq, Hk, D, C, C, P, dtype, seed=5)
    kv_len = torch.tensor([C], device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        cuda.tree_attention(*[t.clone() for t in static], 0.09, kv_len=kv_len)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_static = cuda.tree_attention(*static, 0.09, kv_len=kv_len)
    eager_caches = [static[3].clone(), static[4].clone()]
    for it, S in enumerate([300, 17, 2048, 1, 1500, 0]):
        fresh = _attn_inputs(n, Hq, Hk, D, C, S, P, dtype, seed=200 + it)
        for i in (0, 1, 2, 5, 6):  # q, k_new, v_new, slots, positions
            static[i].copy_(fresh[i])
        static[9].copy_(_padded(fresh[9], C))
        kv_len.fill_(S)
        graph.replay()
        eager = cuda.tree_attention(fresh[0], fresh[1], fresh[2], *eager_caches, *fresh[5:], 0.09)
        torch.cuda.synchronize()
        assert torch.equal(out_static, eager), f"replay at {S} keys differs from the eager call"
        assert torch.equal(static[3], eager_caches[0]) and torch.equal(static[4], eager_caches[1])
    assert torch.count_nonzero(cuda._workspaces[out_static.device].counters) == 0


def test_tree_attention_argument_errors(cuda):
    args = _attn_inputs(2, 4, 2, 64, 40, 40, 64, torch.float32, seed=1)
    bad = list(args)
    bad[9] = torch.ones(2, 41, dtype=torch.bool, device="cuda")  # S > C
    with pytest.raises(ValueError, match="mask"):
        cuda.tree_attention(*bad, 1.0)
    bad = list(args)
    bad[5] = args[5].int()
    with pytest.raises(ValueError, match="slots"):
        cuda.tree_attention(*bad, 1.0)
    bad = list(args)
    bad[1] = _randn((2, 3, 64), 1, torch.float32)  # Hq = 4 not a multiple of Hk = 3
    bad[2] = bad[1].clone()
    bad[3] = _randn((3, 40, 64), 1, torch.float32)
    bad[4] = bad[3].clone()
    with pytest.raises(ValueError, match="multiple"):
        cuda.tree_attention(*bad, 1.0)
    for bad_len, match in ((torch.tensor([4], device="cuda", dtype=torch.int32), "kv_len"),
                           (torch.tensor([4, 4], device="cuda"), "kv_len must be"),
                           (torch.tensor([4]), "kv_len")):
        with pytest.raises(ValueError, match=match):
            cuda.tree_attention(*args, 1.0, kv_len=bad_len)


# ---- LL communicator, one GPU -----------------------------------------------------------------

def _launches(n, dtype, capacity):
    return math.ceil(n * torch.empty(0, dtype=dtype).element_size() / capacity)


@pytest.mark.parametrize("protocol", ["ll16", "ll8"])
def test_size1_all_reduce_packets_and_epochs(cuda, protocol):
    cap = 4096
    comm = CudaLLCommunicator(None, 0, 1, cap, protocol=protocol, flag_bits=2, timeout_s=20)
    try:
        assert comm.epoch() == 0
        launches = 0
        sizes = [1, 7, 1000, 4099, 3, 2048, 1, 5000, 17]
        for it in range(40):  # flags 1, 2, 3 wrap many times; sizes shrink and grow
            n = sizes[it % len(sizes)]
            dtype = DTYPES[it % 3]
            x = _randn((n,), it, dtype)
            y = x.clone()
            assert comm.all_reduce(y) is y
            assert torch.equal(y, x), f"call {it}: n={n} {dtype}"
            launches += _launches(n, dtype, cap)
        assert comm.epoch() == launches
        # multi-dim input, in place
        x = _randn((3, 5, 7), 5, torch.float32)
        y = x.clone()
        comm.all_reduce(y)
        assert torch.equal(y, x)
    finally:
        comm.close()


@pytest.mark.parametrize("protocol", ["ll16", "ll8"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,K,N", [(1, 64, 1), (5, 100, 33), (16, 256, 300), (3, 1000, 97),
                                   (20, 64, 40)])
def test_size1_gemm_all_reduce(cuda, protocol, dtype, M, K, N):
    comm = CudaLLCommunicator(None, 0, 1, 4096, protocol=protocol, flag_bits=2, timeout_s=20)
    try:
        x = _randn((M, K), 1, dtype)
        w = _randn((N, K), 2, dtype, scale=K ** -0.5)
        bias = _randn((N,), 3, dtype)
        for b in (None, bias):
            out = comm.gemm_all_reduce(x, w, b)
            ref = x.float() @ w.float().t() + (b.float() if b is not None else 0)
            atol, rtol = TOL[dtype]
            assert out.shape == (M, N) and out.dtype == dtype
            torch.testing.assert_close(out.float(), ref, atol=atol, rtol=rtol)
    finally:
        comm.close()


def test_size1_collectives_graph_replay(cuda):
    comm = CudaLLCommunicator(None, 0, 1, 1 << 16, flag_bits=2, timeout_s=20)
    try:
        x = _randn((1000,), 1, torch.bfloat16)
        xg = _randn((4, 128), 2, torch.bfloat16)
        w = _randn((200, 128), 3, torch.bfloat16, scale=0.1)
        bias = _randn((200,), 4, torch.bfloat16)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            comm.all_reduce(x.clone())
            comm.gemm_all_reduce(xg, w, bias)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        e0 = comm.epoch()
        with torch.cuda.graph(graph):
            comm.all_reduce(x)
            out = comm.gemm_all_reduce(xg, w, bias)
        assert comm.epoch() == e0  # capture runs nothing
        for it in range(7):  # more replays than flag values (3): the flags must come from memory
            src = _randn((1000,), 10 + it, torch.bfloat16)
            x.copy_(src)
            xg.copy_(_randn((4, 128), 20 + it, torch.bfloat16))
            graph.replay()
            eager = comm.gemm_all_reduce(xg.clone(), w, bias)
            torch.cuda.synchronize()
            assert torch.equal(x, src)
            assert torch.equal(out, eager)
            assert comm.epoch() == e0 + 3 * (it + 1)  # two in the graph, one eager
    finally:
        comm.close()


def test_communicator_argument_errors(cuda):
    with pytest.raises(ValueError):
        CudaLLCommunicator(None, 0, 2, 4096)  # size 2 needs a group
    with pytest.raises(ValueError):
        CudaLLCommunicator(None, 0, 1, 4096, protocol="simple")
    comm = CudaLLCommunicator(None, 0, 1, 64)
    try:
        with pytest.raises(ValueError, match="contiguous"):
            comm.all_reduce(_randn((8, 8), 1, torch.float32).t())
        with pytest.raises(ValueError, match="dtype"):
            comm.gemm_all_reduce(_randn((2, 8), 1, torch.float32), _randn((4, 8), 1, torch.float16))
        # 64 bytes of capacity cannot hold one 32-column tile of fp32 partials
        with pytest.raises(CudaKernelError, match="cudaErrorInvalidValue"):
            comm.gemm_all_reduce(_randn((2, 8), 1, torch.float32), _randn((40, 8), 1, torch.float32))
    finally:
        comm.close()
    with pytest.raises(RuntimeError, match="closed"):
        comm.all_reduce(_randn((4,), 1, torch.float32))


def test_silent_peer_traps_instead_of_hanging(cuda):
    """Rank 0 of a 2-rank table whose peer never writes: the kernel must fail after its timeout.
    Runs in a subprocess because a trapped kernel leaves the CUDA context unusable."""
    code = textwrap.dedent("""
        import ctypes, sys, torch
        from swiftspec.ops import cuda_lib
        lib = cuda_lib.load()
        region = 4096
        buf = torch.zeros(lib.ss_ll_buffer_bytes(2, region), dtype=torch.uint8, device="cuda")
        table = torch.tensor([buf.data_ptr(), buf.data_ptr()], dtype=torch.int64, device="cuda")
        x = torch.ones(100, device="cuda")
        st = lib.ss_ll_all_reduce(x.data_ptr(), x.data_ptr(), 100, 0, 0, table.data_ptr(),
                                  buf.data_ptr(), 0, 2, region, 500_000_000,
                                  ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
        assert st == 0, st
        try:
            torch.cuda.synchronize()
        except Exception as e:
            print("KERNEL FAILED:", e, flush=True)
            sys.exit(3)
        sys.exit(0)
    """)
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, timeout=120)
    assert r.returncode == 3, r.stdout
    assert "KERNEL FAILED" in r.stdout
    assert time.monotonic() - t0 < 110


# ---- LL communicator, two GPUs ----------------------------------------------------------------

def _two_gpus() -> bool:
    return torch.cuda.device_count() >= 2 and torch.cuda.can_device_access_peer(0, 1)


def _rank_main(rank, world, port, q):
    try:
        import torch.distributed as dist

        from swiftspec.ops.cuda_comm import CudaLLCommunicator

        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world)
        group = dist.new_group(list(range(world)))
        results = {}
        for protocol in ("ll16", "ll8"):
            comm = CudaLLCommunicator(group, rank, world, 4096, protocol=protocol,
                                           flag_bits=2, timeout_s=30)
            # all-reduce: many calls, sizes shrink and grow (stale packets of older, larger
            # messages would carry a reused flag with 2-bit flags), chunked above 4096 bytes
            for it, n in enumerate([1, 7, 1000, 4099, 3, 5000, 2, 1000, 64, 1] * 3):
                dtype = DTYPES[it % 3]
                xs = [rank_inputs(it, r, (n,), dtype) for r in range(world)]
                y = xs[rank].cuda()
                comm.all_reduce(y)
                ok = torch.equal(y.cpu(), rank_sum(xs))
                results[f"{protocol}/ar{it}"] = (ok, digest(y))
            # fused GEMM + all-reduce
            for it, (M, K, N) in enumerate([(1, 64, 5), (5, 100, 33), (16, 256, 300), (3, 1000, 97)]):
                dtype = DTYPES[it % 3]
                xs = [rank_inputs(50 + it, r, (M, K), dtype) for r in range(world)]
                ws = [rank_inputs(60 + it, r, (N, K), dtype) * K ** -0.5 for r in range(world)]
                ws = [w.to(dtype) for w in ws]
                bias = rank_inputs(70 + it, 0, (N,), dtype)
                out = comm.gemm_all_reduce(xs[rank].cuda(), ws[rank].cuda(), bias.cuda())
                ref = sum(x.float() @ w.float().t() for x, w in zip(xs, ws)) + bias.float()
                err = ((out.float().cpu() - ref).abs().max() / ref.abs().max()).item()
                results[f"{protocol}/gemm{it}"] = (err < TOL[dtype][0] * 4, digest(out))
            # graph capture + replay of the all-reduce
            x = torch.zeros(777, device="cuda")
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                comm.all_reduce(x.clone())
            torch.cuda.current_stream().wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                comm.all_reduce(x)
            for it in range(5):
                xs = [rank_inputs(90 + it, r, (777,), torch.float32) for r in range(world)]
                x.copy_(xs[rank])
                graph.replay()
                torch.cuda.synchronize()
                results[f"{protocol}/graph{it}"] = (torch.equal(x.cpu(), rank_sum(xs)), digest(x))
            comm.close()
        report(q, "ok", rank, results)
        dist.destroy_process_group()
    except BaseException:
        report(q, "error", rank, traceback.format_exc())


@pytest.mark.skipif(not _two_gpus(), reason="needs 2 GPUs with peer access")
def test_two_rank_ll_collectives(cuda):
    replies = spawn_ranks(_rank_main, 2, (), DEADLINE_S, "LL collectives")
    keys = replies[0].keys()
    assert keys == replies[1].keys()
    for k in keys:
        ok0, d0 = replies[0][k]
        ok1, d1 = replies[1][k]
        assert ok0 and ok1, f"{k}: wrong result (rank 0 ok={ok0}, rank 1 ok={ok1})"
        assert d0 == d1, f"{k}: ranks disagree in the bits"

