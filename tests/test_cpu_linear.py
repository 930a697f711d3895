"""The skinny-GEMM linear twin (``csrc/cpu/linear.cpp`` on the core ``csrc/cpu/skinny_gemm.h``)
against its reference ``F.linear``, the ``ops.linear`` dispatch, and the layers that use it.

Every kernel compiled into the extension (scalar, AVX-512, AVX512_BF16) is exercised through the
``_linear_impl`` test hook, so the scalar fallback of CPUs without AVX-512 is tested here too."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from swiftspec import ops as sops
from swiftspec.ops import cpu, dispatch, reference

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def ext():
    try:
        return cpu.load()
    except cpu.KernelBuildError as e:  # no compiler here: nothing to test
        pytest.skip(f"CPU kernels unavailable: {e}")


def _impls(ext, dtype):
    return [i for i in ["auto", *ext._linear_impls()] if not (i == "avx512_bf16" and dtype != torch.bfloat16)]


def _case(M, K, N, dtype, seed, bias=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(dtype)
    w = (torch.randn(N, K, generator=g) / max(K, 1) ** 0.5).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    return x, w, b


def _check(got, x, w, b, msg=""):
    """fp32: F.linear to fp32 rounding (only the summation order differs). bf16: within one output
    rounding (2^-8 relative) of the fp32 result on the same rounded inputs, and loosely equal to
    torch's own bf16 F.linear."""
    M, N = x.shape[0], w.shape[0]
    assert got.shape == (M, N) and got.dtype == x.dtype, msg
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    if x.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=msg)
    else:
        torch.testing.assert_close(got.float(), want, rtol=1.6e-2, atol=1e-2, msg=msg)
        torch.testing.assert_close(got.float(), reference.linear(x, w, b).float(), rtol=3e-2, atol=3e-2, msg=msg)


# ---------------------------------------------------------------------------------------------
# The C++ op

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 3, 8, 16, 17])
# (2100, 70): K long enough that x is cut into K chunks (skinny_gemm.h kXChunkBytes) for M >= 4
@pytest.mark.parametrize("K,N", [(100, 37), (64, 48), (33, 5), (257, 300), (2100, 70)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_reference(ext, dtype, M, K, N, bias):
    x, w, b = _case(M, K, N, dtype, seed=M * 1000 + K + N, bias=bias)
    for impl in _impls(ext, dtype):
        _check(ext._linear_impl(x, w, b, impl), x, w, b, msg=impl)
    got = ext.linear(x, w, b)
    _check(got, x, w, b)
    if M > 16:  # above the skinny range the op is at::linear itself
        assert torch.equal(got, F.linear(x, w, b))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 2, 5, 9, 16])
@pytest.mark.parametrize("K", [70, 3000])
def test_linear_exact_single_rounding(ext, dtype, M, K):
    """Small integers: every dot product is exact in fp32 whatever the summation order, so each
    kernel must give exactly round(x @ w.T + bias) with ONE rounding. The bias 0.5 on sums that are
    odd integers above 256 makes bf16 double rounding (round the sum, add, round again) differ.
    Odd column counts leave a column outside the column pairs; K = 3000 runs in K chunks."""
    N = 45
    g = torch.Generator().manual_seed(M)
    x = torch.randint(-3, 4, (M, K), generator=g).to(dtype)
    w = torch.randint(-3, 4, (N, K), generator=g).to(dtype)
    w[:, 0] = 40  # sums around 280 + small terms: many odd values above 256 in magnitude
    x[:, 0] = 7
    if K > 1000:  # keep the sums in the same range: mostly zeros elsewhere
        x[:, 1:] *= (torch.rand(M, K - 1, generator=g) < 0.02).to(dtype)
    b = torch.full((N,), 0.5).to(dtype)
    exact = x.double() @ w.double().t() + b.double()
    want = exact.to(dtype)
    if dtype == torch.bfloat16:
        double_rounded = ((x.double() @ w.double().t()).to(dtype).double() + b.double()).to(dtype)
        assert not torch.equal(want, double_rounded), "the case must tell one rounding from two"
    for impl in _impls(ext, dtype):
        assert torch.equal(ext._linear_impl(x, w, b, impl), want), impl
        assert torch.equal(ext._linear_impl(x, w, None, impl), (x.double() @ w.double().t()).to(dtype)), impl


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_strides(ext, dtype):
    g = torch.Generator().manual_seed(3)
    base = torch.randn(6, 130, generator=g).to(dtype)
    wbase = (torch.randn(90, 140, generator=g) / 8).to(dtype)
    b = torch.randn(40, generator=g).to(dtype)
    cases = {
        "x every other column": (base[:, ::2], wbase[:40, :65]),
        "x row stride": (base[:, 3:68], wbase[:40, 10:75]),   # rows 130 apart, w rows 140 apart
        "w row range": (base[:, :65].contiguous(), wbase[10:50, :65].contiguous()),
        "w transposed layout": (base[:, :65], wbase[:65, :40].t()),  # at::linear fallback
        "x transposed": (base[:, :6].t(), wbase[:40, :6]),
        "x expanded rows": (base[0, :65].expand(5, 65), wbase[:40, :65]),
    }
    for name, (x, w) in cases.items():
        for impl in _impls(ext, dtype):
            _check(ext._linear_impl(x, w, b, impl), x, w, b, msg=f"{name} / {impl}")


def test_linear_threads_bitwise(ext):
    """A result depends on M, K and the kernel only, not on how the columns are split over threads."""
    x, w, b = _case(5, 200, 700, torch.bfloat16, seed=11)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ext.linear(x, w, b)
        torch.set_num_threads(2)
        two = ext.linear(x, w, b)
    finally:
        torch.set_num_threads(old)
    assert torch.equal(one, two)
    # and a column slice of the weight gives the same bits as the same columns of the whole
    assert torch.equal(ext.linear(x, w[100:333], b[100:333]), one[:, 100:333])


def test_linear_empty_and_degenerate(ext):
    for dtype in DTYPES:
        w, b = torch.randn(7, 8).to(dtype), torch.randn(7).to(dtype)
        assert ext.linear(torch.randn(0, 8).to(dtype), w, b).shape == (0, 7)
        assert ext.linear(torch.randn(3, 8).to(dtype), w[:0], b[:0]).shape == (3, 0)
        out = ext.linear(torch.randn(3, 0).to(dtype), torch.randn(7, 0).to(dtype), b)  # K = 0: just the bias
        assert out.dtype == dtype and torch.equal(out, b.expand(3, 7))
        assert bool((ext.linear(torch.randn(2, 0).to(dtype), torch.randn(7, 0).to(dtype)) == 0).all())


def test_linear_nan_propagates(ext):
    for dtype in DTYPES:
        x, w, b = _case(4, 50, 33, dtype, seed=5)
        x[1, 7] = float("nan")
        for impl in _impls(ext, dtype):
            y = ext._linear_impl(x, w, b, impl)
            assert y[1].isnan().all() and not y[[0, 2, 3]].isnan().any(), impl


def test_linear_other_dtypes_fall_back(ext):
    for dtype in (torch.float16, torch.float64):
        x, w, b = _case(3, 20, 9, dtype, seed=2)
        assert torch.equal(ext.linear(x, w, b), F.linear(x, w, b))


def test_linear_bad_input(ext):
    x, w, b = torch.randn(2, 8), torch.randn(6, 8), torch.randn(6)
    with pytest.raises(RuntimeError, match="dtype"):
        ext.linear(x, w.to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="bias dtype"):
        ext.linear(x, w, b.to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="K mismatch"):
        ext.linear(x, torch.randn(6, 9))
    with pytest.raises(RuntimeError, match="K mismatch"):
        ext.linear(torch.randn(20, 8), torch.randn(6, 9))  # also above the skinny rows
    with pytest.raises(RuntimeError, match=r"bias must be \[N\]"):
        ext.linear(x, w, torch.randn(5))
    with pytest.raises(RuntimeError, match=r"\[M, K\]"):
        ext.linear(torch.randn(2, 2, 8), w)
    with pytest.raises(RuntimeError, match=r"\[N, K\]"):
        ext.linear(x, torch.randn(8))
    with pytest.raises(RuntimeError, match="CPU"):
        ext.linear(x.to("meta"), w.to("meta"))
    with pytest.raises(RuntimeError, match="unknown impl"):
        ext._linear_impl(x, w, None, "nope")
    with pytest.raises(RuntimeError, match="needs bfloat16"):
        if "avx512_bf16" not in ext._linear_impls():
            raise RuntimeError("needs bfloat16 (not compiled here)")
        ext._linear_impl(x, w, None, "avx512_bf16")


def test_shm_gemm_size1_uses_the_same_kernel(ext):
    """The fused GEMM + all-reduce computes its tiles with the same core: at size 1 (no exchange)
    and without bias its result equals the linear op's bit for bit."""
    c = ext.ShmComm(f"/swiftspec-{os.getpid()}-linear", 0, 1, True, 4096, 5.0)
    try:
        for dtype in DTYPES:
            for M in (1, 7, 16):
                x, w, _ = _case(M, 300, 517, dtype, seed=M)
                assert torch.equal(c.gemm_all_reduce(x, w), ext.linear(x, w)), (dtype, M)
    finally:
        c.close()


# ---------------------------------------------------------------------------------------------
# ops.linear dispatch and the layers

class _Spy:
    """Stands in for the extension module and counts the linear calls."""

    def __init__(self, real):
        self.real, self.calls = real, 0

    def linear(self, *a):
        self.calls += 1
        return self.real.linear(*a)

    def __getattr__(self, name):
        return getattr(self.real, name)


@pytest.fixture
def spy(ext, monkeypatch):
    s = _Spy(ext)
    monkeypatch.setattr(dispatch, "cpu_module", lambda: s)
    monkeypatch.setitem(dispatch._state, "enabled", True)
    # the routing under test, whatever cpu_dispatch() decides for speed on this CPU
    monkeypatch.setattr(dispatch, "cpu_twin", lambda family: True)
    return s


@pytest.mark.parametrize("dtype", DTYPES)
def test_ops_linear_dispatch(spy, dtype):
    x, w, b = _case(6, 40, 24, dtype, seed=9)
    x3 = x.view(2, 3, 40)
    y = sops.linear(x3, w, b)
    assert spy.calls == 1 and y.shape == (2, 3, 24)
    assert torch.equal(y, spy.real.linear(x, w, b).view(2, 3, 24))
    y1 = sops.linear(x[0], w)  # 1-D input, as F.linear allows
    assert spy.calls == 2 and y1.shape == (24,)
    _check(y1[None], x[:1], w, None)
    y0 = sops.linear(torch.randn(2, 3, 0).to(dtype), torch.randn(24, 0).to(dtype), b)  # K = 0
    assert spy.calls == 3 and y0.shape == (2, 3, 24) and torch.equal(y0, b.expand(2, 3, 24))
    # more than 16 rows, fp16, autograd, kernels off: F.linear, the twin is not called
    big = torch.randn(17, 40).to(dtype)
    assert torch.equal(sops.linear(big, w, b), F.linear(big, w, b))
    h = torch.randn(2, 40).half()
    assert torch.equal(sops.linear(h, w.half()), F.linear(h, w.half()))
    xg = x.clone().requires_grad_(True)
    sops.linear(xg, w, b).float().sum().backward()
    assert xg.grad is not None and xg.grad.shape == x.shape
    sops.set_kernels(False)
    try:
        assert torch.equal(sops.linear(x, w, b), F.linear(x, w, b))
    finally:
        sops.set_kernels(True)
    assert spy.calls == 3
    with pytest.raises(RuntimeError):
        sops.linear(x, w.to(torch.float32 if dtype == torch.bfloat16 else torch.bfloat16))


def test_layers_use_the_twin(spy):
    from swiftspec.model_executor.layers.embedding import ParallelLMHead
    from swiftspec.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear

    g = torch.Generator().manual_seed(1)
    col = ColumnParallelLinear(48, 40, bias=True, dtype=torch.bfloat16)
    row = RowParallelLinear(40, 48, bias=True, dtype=torch.bfloat16)
    for layer in (col, row):
        for p in layer.parameters():
            p.data.copy_(torch.randn(p.shape, generator=g))
    x = torch.randn(3, 48, generator=g).to(torch.bfloat16)
    h = col(x)
    _check(h, x, col.weight, col.bias)
    _check(row(h), h, row.weight, row.bias)
    assert spy.calls == 2

    head = ParallelLMHead(300, 48, dtype=torch.float32)
    head.weight.data.copy_(torch.randn(300, 48, generator=g))
    hs = torch.randn(4, 48, generator=g)
    logits = head(hs, limit=123)
    assert spy.calls == 3 and logits.shape == (4, 123) and logits.dtype == torch.float32
    torch.testing.assert_close(logits, F.linear(hs, head.weight[:123]), rtol=1e-5, atol=1e-5)

    col8 = ColumnParallelLinear(48, 40, bias=True, dtype=torch.bfloat16, int8=True)
    col8.int8.weight_loader(None, col.weight.data)
    col8.bias.data.copy_(col.bias.data)
    col8(x)  # int8 weights take the int8 twin (tested below), not linear
    assert spy.calls == 3


# ---------------------------------------------------------------------------------------------
# The int8 weight-only twin (draft layers)

def _int8_case(M, K, N, dtype, seed):
    from swiftspec.model_executor.layers.quant import quantize_int8

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(dtype)
    q, scales = quantize_int8(torch.randn(N, K, generator=g) / K ** 0.5)
    return x, q, scales


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 2, 5, 8, 16])
@pytest.mark.parametrize("K,N", [(100, 37), (33, 5), (2100, 70), (896, 130)])
def test_int8_linear_matches_reference(ext, dtype, M, K, N):
    """Every kernel: the fp32 dot product with the exact integer weights, scaled once, equals the
    float64 result to fp32 (or one bf16 output) rounding, and the dequantizing reference loosely."""
    x, q, scales = _int8_case(M, K, N, dtype, seed=M * 1000 + K + N)
    exact = (x.double() @ q.double().t()) * scales.double()
    for impl in _impls(ext, dtype):
        got = ext._int8_linear_impl(x, q, scales, impl)
        assert got.shape == (M, N) and got.dtype == dtype, impl
        if dtype == torch.float32:
            torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-5, msg=impl)
        else:
            torch.testing.assert_close(got.double(), exact, rtol=1.6e-2, atol=1e-2, msg=impl)
        ref = reference.int8_linear(x, q, scales).float()
        torch.testing.assert_close(got.float(), ref, rtol=3e-2, atol=3e-2, msg=impl)


def test_int8_linear_strided_rows_and_bf16_scales(ext):
    """Rows of a bigger table (the LM head's ``qweight[:limit]``) and bf16 scales (the layers keep
    the model dtype) give the same bits as a contiguous copy with the scales in fp32."""
    x, q, scales = _int8_case(4, 160, 50, torch.bfloat16, seed=7)
    big = torch.cat([q, q], dim=1)[:, :160]  # rows 320 apart
    s16 = scales.to(torch.bfloat16)
    want = ext.int8_linear(x, q.contiguous(), s16.float())
    assert torch.equal(ext.int8_linear(x, big, s16), want)
    assert torch.equal(sops.int8_linear(x[:2], big, s16), want[:2])  # the twin's row range
    torch.testing.assert_close(sops.int8_linear(x, big, s16), want, rtol=3e-2, atol=3e-2)  # torch's kernel


def test_int8_linear_errors(ext):
    x, q, scales = _int8_case(2, 32, 8, torch.float32, seed=3)
    with pytest.raises(RuntimeError, match="at most 16"):
        ext.int8_linear(torch.randn(17, 32), q, scales)
    with pytest.raises(RuntimeError, match="int8"):
        ext.int8_linear(x, q.float(), scales)
    with pytest.raises(RuntimeError, match="K mismatch"):
        ext.int8_linear(torch.randn(2, 31), q, scales)
    with pytest.raises(RuntimeError, match="scales"):
        ext.int8_linear(x, q, scales[:-1])
