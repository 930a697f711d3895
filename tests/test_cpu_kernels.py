"""CPU twins of the fused SwiGLU and tree-attention kernels against their PyTorch references
(``swiftspec.ops.reference``). Every SIMD variant compiled into the extension is exercised through
the ``_*_impl`` test hooks, so the scalar fallback used on CPUs without AVX-512 is tested too."""
from __future__ import annotations

import pytest
import torch

from swiftspec.ops import cpu, reference


@pytest.fixture(scope="module")
def ops():
    try:
        return cpu.load()
    except cpu.KernelBuildError as e:  # no compiler here: nothing to test
        pytest.skip(f"CPU kernels unavailable: {e}")


def _swiglu_impls(ops, dtype):
    return [i for i in ["auto", *ops._swiglu_impls()] if not (i == "avx512_bf16" and dtype != torch.bfloat16)]


# ---------------------------------------------------------------------------------------------
# SwiGLU

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M", [1, 3, 8, 16, 33])
@pytest.mark.parametrize("K,I", [(100, 37), (64, 48), (33, 5)])
def test_swiglu_matches_reference(ops, dtype, M, K, I):
    g = torch.Generator().manual_seed(M * 1000 + K + I)
    x = torch.randn(M, K, generator=g).to(dtype)
    w = (torch.randn(2 * I, K, generator=g) / K ** 0.5).to(dtype)
    # The oracle sees the same (rounded) inputs in fp32; the kernel accumulates in fp32 and rounds
    # once, so in bf16 it is within one output rounding (2^-8 relative) of it.
    want = reference.swiglu(x.float(), w.float())
    for impl in _swiglu_impls(ops, dtype):
        got = ops._swiglu_impl(x, w, impl)
        assert got.dtype == dtype and got.shape == (M, I), impl
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=impl)
        else:
            torch.testing.assert_close(got.float(), want, rtol=1.6e-2, atol=1e-2, msg=impl)
    # The public entry point is the "auto" kernel, and agrees with the bf16/fp32 reference itself.
    got = ops.swiglu(x, w)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(got.float(), reference.swiglu(x, w).float(), **tol)


def test_swiglu_noncontiguous_and_threads(ops):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(6, 130, generator=g)[:, ::2]  # [6, 65], non-contiguous rows
    w = torch.randn(2 * 300, 65, generator=g) / 65 ** 0.5
    want = reference.swiglu(x, w)
    old = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            torch.testing.assert_close(ops.swiglu(x, w), want, rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(old)


def test_swiglu_empty_and_k0(ops):
    assert ops.swiglu(torch.randn(0, 8), torch.randn(6, 8)).shape == (0, 3)
    out = ops.swiglu(torch.randn(2, 0), torch.randn(6, 0))
    assert out.shape == (2, 3) and bool((out == 0).all())


def test_swiglu_bad_input(ops):
    x, w = torch.randn(2, 8), torch.randn(6, 8)
    with pytest.raises(RuntimeError, match="dtype"):
        ops.swiglu(x, w.to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.swiglu(x.double(), w.double())
    with pytest.raises(RuntimeError, match="K mismatch"):
        ops.swiglu(x, torch.randn(6, 9))
    with pytest.raises(RuntimeError, match="even"):
        ops.swiglu(x, torch.randn(5, 8))
    with pytest.raises(RuntimeError, match=r"\[M, K\]"):
        ops.swiglu(torch.randn(2, 2, 8), w)
    with pytest.raises(RuntimeError, match="unknown impl"):
        ops._swiglu_impl(x, w, "nope")
    with pytest.raises(RuntimeError, match="needs bfloat16"):
        if "avx512_bf16" not in ops._swiglu_impls():
            raise RuntimeError("needs bfloat16 (not compiled here)")
        ops._swiglu_impl(x, w, "avx512_bf16")
