"""The quantized skinny GEMM on GGUF blocks (csrc/cpu/quant_gemm*.cpp, swiftspec.ops.quant).

Every kernel this CPU can run (an AVX-512 VNNI machine also runs the AVX2 one) is checked against
the PyTorch reference (same int8 activations, dequantized weights, fp64 sums) and against the
scalar kernel bit for bit; rows are bit-identical alone or in any batch, at any thread count.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize

from swiftspec import ops
from swiftspec.ops import quant

TYPES = [Q.Q4_0, Q.Q5_0, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]
KERNEL_TYPES = [int(t) for t in TYPES] + [quant.AWQ4]  # AWQ4: AWQ repacked (tests/test_awq.py)
# byte offset of each block's fp16 scale(s)
_D_OFFSETS = {Q.Q4_0: (0,), Q.Q5_0: (0,), Q.Q8_0: (0,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,),
              quant.AWQ4: (0,)}


def random_blocks(t: int, rows: int, k: int, seed: int = 0) -> torch.Tensor:
    """``[rows, row_bytes]`` uint8 of random blocks of type ``t`` with sane fp16 scales (and, for
    AWQ4, zeros 0..15 and the reserved byte 0)."""
    rng = np.random.default_rng(seed)
    _, qk, bb = quant.GGML_TYPES[int(t)]
    raw = rng.integers(0, 256, size=(rows, k // qk, bb), dtype=np.uint8)
    for off in _D_OFFSETS[int(t)]:
        d = rng.uniform(0.001, 0.01, size=(rows, k // qk)).astype(np.float16)
        raw[..., off:off + 2] = d.view(np.uint8).reshape(rows, k // qk, 2)
    if int(t) == quant.AWQ4:
        raw[..., 2] %= 16
        raw[..., 3] = 0
    return torch.from_numpy(raw.reshape(rows, -1))


def _name(t) -> str:
    return quant.ggml_name(int(t))


def _module():
    from swiftspec.ops import cpu
    try:
        return cpu.load()
    except cpu.KernelBuildError as e:
        pytest.skip(f"CPU kernels unavailable: {e}")


def _k(t: Q) -> int:
    return 512 if quant.block_values(t) == 256 else 96


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_dequantize_matches_gguf_library(t):
    raw = random_blocks(t, 5, _k(t))
    want = gguf_dequantize(raw.numpy(), t).reshape(5, -1)
    assert torch.equal(quant.dequantize(raw, int(t)), torch.from_numpy(np.ascontiguousarray(want, dtype=np.float32)))


@pytest.mark.parametrize("t", KERNEL_TYPES, ids=_name)
def test_cpp_dequantize_bit_identical_to_torch(t):
    """The embedding rows' C++ loop (ops.dequantize on the CPU backend) gives the PyTorch
    reference's bits, every type; interleaved and unknown types are refused."""
    m = _module()
    raw = random_blocks(t, 6, _k(t) * 2, seed=3)
    want = quant.dequantize(raw, int(t))
    assert torch.equal(m.quant_dequantize(raw, int(t)), want)
    assert torch.equal(ops.dequantize(raw[[4, 1]], int(t)), want[[4, 1]])
    with pytest.raises(RuntimeError, match="no plain block type"):
        m.quant_dequantize(raw, int(t) | quant.X8)
    with pytest.raises(RuntimeError, match="whole number"):
        m.quant_dequantize(raw[:, 1:], int(t))


@pytest.mark.parametrize("t", KERNEL_TYPES, ids=_name)
def test_activations_bit_identical_to_torch(t):
    """Every ISA's quantizer (each impl brings its own: scalar, AVX2, AVX-512) forms the reference's
    int8 values, scales and sums, ties to even included."""
    m = _module()
    k = _k(t) * 3
    x = torch.randn(5, k) * 3
    x[1, :32] = 0  # an all-zero block
    x[2, 5] = -7.5  # a negative maximum
    x[3] = torch.randint(-254, 255, (k,)).float() / 2  # halves: x * (1 / d) lands on .5 ties
    x[3, ::32] = 127.0  # d = 1 in every block
    x[4] *= 1e-30  # tiny scales
    want = quant.quantize_activations(x, int(t))
    for impl in m.quant_impls():
        for a, b in zip(m.quant_activations(x, int(t), impl), want):
            assert torch.equal(a, b), impl


@pytest.mark.parametrize("t", KERNEL_TYPES, ids=_name)
@pytest.mark.parametrize("rows", [1, 3, 8, 16, 21])
def test_every_impl_matches_reference_and_scalar(t, rows):
    m = _module()
    w = random_blocks(t, 37, _k(t), seed=rows)
    x = torch.randn(rows, _k(t))
    want = quant.reference_linear(x, [w], [int(t)])
    scalar = m.quant_linear(x, [w], [int(t)], "scalar")
    for impl in m.quant_impls():
        y = m.quant_linear(x, [w], [int(t)], impl)
        torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
        assert torch.equal(y, scalar), impl  # the same integer lanes and float operations
    xb = x.to(torch.bfloat16)
    torch.testing.assert_close(m.quant_linear(xb, [w], [int(t)]), quant.reference_linear(xb, [w], [int(t)]),
                               rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("t", [Q.Q5_0, Q.Q4_K, Q.Q6_K, quant.AWQ4], ids=_name)
def test_rows_are_batch_and_thread_invariant(t):
    m = _module()
    w = random_blocks(t, 70, _k(t))
    x = torch.randn(16, _k(t))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([m.quant_linear(x[i:i + 1], [w], [int(t)]) for i in range(16)])
        torch.set_num_threads(max(2, threads))
        for n in (2, 3, 4, 8, 16):
            for start in range(0, 16, n):
                assert torch.equal(m.quant_linear(x[start:start + n], [w], [int(t)]), alone[start:start + n])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("t", [Q.Q5_0, Q.Q4_K], ids=_name)
def test_prefill_batches_equal_rows_alone(t):
    """A prefill-sized batch (its activations quantized by several threads, row ranges split
    among them) gives each row the bits of that row alone on one thread."""
    m = _module()
    k = 2048
    w = random_blocks(t, 48, k)
    x = torch.randn(97, k)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([m.quant_linear(x[i:i + 1], [w], [int(t)]) for i in range(len(x))])
        acts = [torch.cat(a) for a in zip(*(m.quant_activations(x[i:i + 1], int(t), "auto") for i in range(len(x))))]
        torch.set_num_threads(max(2, threads))
        assert torch.equal(m.quant_linear(x, [w], [int(t)]), alone)
        for got, want in zip(m.quant_activations(x, int(t), "auto"), acts):
            assert torch.equal(got, want)
    finally:
        torch.set_num_threads(threads)


def test_parts_of_mixed_types_equal_separate_calls():
    m = _module()
    k = 512
    parts = [random_blocks(Q.Q4_K, 24, k, 1), random_blocks(Q.Q8_0, 8, k, 2), random_blocks(Q.Q6_K, 8, k, 3)]
    types = [int(Q.Q4_K), int(Q.Q8_0), int(Q.Q6_K)]
    x = torch.randn(5, k)
    fused = m.quant_linear(x, parts, types)
    assert torch.equal(fused, torch.cat([m.quant_linear(x, [p], [t]) for p, t in zip(parts, types)], dim=1))


def test_pytorch_path_matches_kernel():
    t = int(Q.Q4_K)
    w = random_blocks(Q.Q4_K, 40, 512)
    x = torch.randn(4, 512)
    want = quant.reference_linear(x, [w], [t])
    ops.set_kernels(False)
    try:
        y = ops.quant_linear(x, [w], [t], lambda: [quant.dequantize(w, t)])
    finally:
        ops.set_kernels(True)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_bad_shapes_raise():
    m = _module()
    w = random_blocks(Q.Q4_K, 4, 512)
    with pytest.raises(RuntimeError, match="multiple of the block size"):
        m.quant_linear(torch.randn(2, 300), [w], [int(Q.Q4_K)])
    with pytest.raises(RuntimeError, match="bytes per row"):
        m.quant_linear(torch.randn(2, 256), [w], [int(Q.Q4_K)])
    with pytest.raises(RuntimeError, match="no kernel"):
        m.quant_linear(torch.randn(2, 512), [w], [int(Q.Q3_K)])
    with pytest.raises(RuntimeError, match="unknown impl"):
        m.quant_linear(torch.randn(2, 512), [w], [int(Q.Q4_K)], "sse9")


def test_dispatch_never_picks_a_scalar_loop_where_simd_exists():
    from swiftspec.ops.cpu import _cpu_flags, march

    if march() != "native":
        pytest.skip("the extension is built for another CPU (SWIFTSPEC_CPU_ARCH), not this one's flags")
    m = _module()
    flags = set(_cpu_flags().split(":", 1)[-1].split())
    d = ops.cpu_dispatch()
    if {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= flags:
        # 512-bit interleaved kernels on AMD family 0x1A (Zen 5), where they measured faster
        info = {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in
                open("/proc/cpuinfo").read().split("\n\n")[0].splitlines() if ":" in line)}
        zen5 = info["vendor_id"] == "AuthenticAMD" and int(info["cpu family"]) >= 0x1A
        assert d["quant_gemm"] == ("avx512_vnni_512" if zen5 else "avx512_vnni")
    elif {"avx2", "fma"} <= flags:
        assert d["quant_gemm"] == "avx2"
    # tree attention has AVX2 and AVX-512 loops: one of them runs wherever the CPU has it
    if {"avx512f", "avx512bw", "avx512vl"} <= flags:
        assert d["tree_attention"] == "avx512"
    elif {"avx2", "fma"} <= flags:
        assert d["tree_attention"] == "avx2"
    # the float GEMM twins have AVX-512 loops only: elsewhere PyTorch runs, never their scalar loop
    for family, compiled in (("skinny_gemm", m._linear_impls()), ("tree_attention", m._tree_attention_impls())):
        assert d[family] != "scalar"
        assert (d[family] == "torch") == (compiled == ["scalar"])


def test_avx2_kernel_is_avx2_code_on_every_build_machine():
    """The AVX2 kernel is built with -march=native: on an AVX-512 machine GCC would encode it with
    EVEX (32 registers, vpternlog, mask registers), and that machine would test and time other code
    than an AVX2-only CPU runs. Its object file must use only VEX-encoded xmm/ymm 0-15."""
    import re
    import shutil
    import subprocess

    from swiftspec.ops import cpu

    _module()
    if shutil.which("objdump") is None:
        pytest.skip("no objdump")
    obj = cpu.build_dir(cpu.module_name()) / "quant_gemm_avx2.o"
    asm = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(obj)], check=True,
                         capture_output=True, text=True).stdout
    assert "vpmaddubsw" in asm and "ymm" in asm  # the kernel is there
    avx512 = re.compile(r"%zmm|%[xy]mm(1[6-9]|2\d|3[01])\b|%k[0-7]\b|\{evex\}|vpternlog|vmovdq[au](32|64)")
    bad = sorted({m.group(0) for m in avx512.finditer(asm)})
    assert not bad, f"AVX-512 instructions or registers in the AVX2 kernel: {bad}"


def test_set_quant_gemm_switches_the_dispatched_kernel():
    m = _module()
    default = ops.cpu_dispatch()["quant_gemm"]
    w = random_blocks(Q.Q4_K, 16, 512)
    x = torch.randn(3, 512)
    want = m.quant_linear(x, [w], [int(Q.Q4_K)], "scalar")
    try:
        for impl in m.quant_impls()[::-1]:
            ops.set_quant_gemm(impl)
            assert ops.cpu_dispatch()["quant_gemm"] == impl == m.quant_impls()[0]
            assert torch.equal(m.quant_linear(x, [w], [int(Q.Q4_K)]), want)
        with pytest.raises(RuntimeError, match="not one this CPU runs"):
            ops.set_quant_gemm("sse9")
    finally:
        ops.set_quant_gemm(default)
    assert ops.cpu_dispatch()["quant_gemm"] == default


X8 = int(Q.Q4_K) | quant.X8  # Q4_K with every 8 rows interleaved (csrc/cpu/quant_blocks.h)
X8_TYPES = [int(Q.Q4_K), int(Q.Q6_K), int(Q.Q4_0), int(Q.Q5_0), int(Q.Q8_0), quant.AWQ4]  # the types with the interleaved layout


@pytest.mark.parametrize("t", X8_TYPES, ids=_name)
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 7, 8, 16, 21])
def test_interleaved_equals_plain_bit_for_bit(t, rows):
    m = _module()
    k = 768
    w = random_blocks(t, 48, k, seed=rows)
    wx = quant.interleave(w, t)
    assert not torch.equal(wx, w) and torch.equal(quant.deinterleave(wx, t), w)
    assert torch.equal(quant.dequantize(wx, t | quant.X8), quant.dequantize(w, t))
    x = torch.randn(rows, k)
    plain = m.quant_linear(x, [w], [t], "scalar")
    torch.testing.assert_close(plain, quant.reference_linear(x, [w], [t]), rtol=1e-4, atol=1e-4)
    try:  # with and without the 8-row kernels' prefetch (a run-time choice): the same bits
        for prefetch in (0, 1):
            m.quant_set_prefetch(prefetch)
            for impl in m.quant_impls():  # the SIMD ones read the interleaved bytes with their own offsets
                assert torch.equal(m.quant_linear(x, [wx], [t | quant.X8], impl), plain), (impl, prefetch)
                assert torch.equal(m.quant_linear(x, [w], [t], impl), plain), (impl, prefetch)
    finally:
        m.quant_set_prefetch(-1)
    # fused with plain parts (a Q6_K or Q8_0 v of a fused QKV), and the bf16 activations path
    tv = int(Q.Q6_K) if quant.block_values(t) == 256 else int(Q.Q8_0)
    wv = random_blocks(tv, 8, k, seed=7)
    fused = m.quant_linear(x, [wx, wv], [t | quant.X8, tv])
    assert torch.equal(fused, torch.cat([plain, m.quant_linear(x, [wv], [tv], "scalar")], dim=1))
    xb = x.to(torch.bfloat16)
    assert torch.equal(m.quant_linear(xb, [wx], [t | quant.X8]), m.quant_linear(xb, [w], [t], "scalar"))


@pytest.mark.parametrize("t", X8_TYPES, ids=_name)
def test_interleaved_rows_are_batch_and_thread_invariant(t):
    m = _module()
    wx = quant.interleave(random_blocks(t, 72, 512), t)
    tx = t | quant.X8
    x = torch.randn(16, 512)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([m.quant_linear(x[i:i + 1], [wx], [tx]) for i in range(16)])
        torch.set_num_threads(max(2, threads))
        for n in (2, 3, 4, 8, 16):
            for start in range(0, 16, n):
                assert torch.equal(m.quant_linear(x[start:start + n], [wx], [tx]), alone[start:start + n])
    finally:
        torch.set_num_threads(threads)


def test_interleaved_bad_shapes_raise():
    m = _module()
    w = random_blocks(Q.Q4_K, 12, 512)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        quant.interleave(w, int(Q.Q4_K))
    with pytest.raises(RuntimeError, match="no interleaved layout"):
        quant.interleave(random_blocks(Q.Q5_K, 8, 512), int(Q.Q5_K))
    wx = quant.interleave(random_blocks(Q.Q4_K, 16, 512), int(Q.Q4_K))
    with pytest.raises(RuntimeError, match="multiple of 8"):
        m.quant_linear(torch.randn(2, 512), [wx[:12]], [X8])
    with pytest.raises(RuntimeError, match="start at a multiple of 8"):
        m.quant_linear(torch.randn(2, 512), [random_blocks(Q.Q4_K, 4, 512), wx], [int(Q.Q4_K), X8])
    assert quant.x8_type(int(Q.Q4_K), 12) is None and quant.x8_type(int(Q.Q6_K), 16) == int(Q.Q6_K) | quant.X8
    assert quant.x8_type(int(Q.Q5_K), 16) is None and quant.x8_type(int(Q.Q8_0), 12) is None
    assert quant.x8_type(int(Q.Q4_K), 16) == X8 and quant.x8_type(quant.AWQ4, 16) == quant.AWQ4 | quant.X8


@pytest.mark.parametrize("t", X8_TYPES, ids=_name)
def test_16_row_layout_equals_plain_bit_for_bit(t):
    """The 16-row layout (read by avx512_vnni_512 and scalar): the same bits as the plain blocks at
    every row count, alone or fused with 8-row and plain parts; the other kernels refuse it."""
    m = _module()
    k = 768
    w = random_blocks(t, 64, k, seed=5)
    tx = t | quant.X16
    wx = quant.interleave(w, tx)
    assert not torch.equal(wx, quant.interleave(w, t | quant.X8)) and torch.equal(quant.deinterleave(wx, tx), w)
    assert torch.equal(quant.dequantize(wx, tx), quant.dequantize(w, t))
    readers = [i for i in m.quant_impls() if i in ("avx512_vnni_512", "scalar")]
    for rows in (1, 2, 3, 5, 8, 16, 21):
        x = torch.randn(rows, k)
        plain = m.quant_linear(x, [w], [t], "scalar")
        for impl in readers:
            assert torch.equal(m.quant_linear(x, [wx], [tx], impl), plain), (impl, rows)
            w8 = quant.interleave(w[:24], t | quant.X8)
            fused = m.quant_linear(x, [wx, w8, w[:8]], [tx, t | quant.X8, t], impl)
            assert torch.equal(fused, torch.cat([plain, plain[:, :24], plain[:, :8]], dim=1)), (impl, rows)
    for impl in set(m.quant_impls()) - set(readers):
        with pytest.raises(RuntimeError, match="16-row interleaved layout"):
            m.quant_linear(torch.randn(2, k), [wx], [tx], impl)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        m.quant_linear(torch.randn(2, k), [wx[:24]], [tx], "scalar")
    assert quant.group_rows(tx) == 16 and quant.base_type(tx) == t
    assert quant.interleaved_type(t, 32, 16, 16) == tx and quant.interleaved_type(t, 24, 0, 16) == t | quant.X8


def test_16_row_layout_rows_are_batch_and_thread_invariant():
    m = _module()
    if "avx512_vnni_512" not in m.quant_impls():
        pytest.skip("this CPU lacks AVX-512 VNNI (the 16-row layout's SIMD reader)")
    for t in (int(Q.Q4_K), int(Q.Q6_K), int(Q.Q5_0), int(Q.Q8_0)):
        wx = quant.interleave(random_blocks(t, 80, 512), t | quant.X16)
        x = torch.randn(16, 512)
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            alone = torch.cat([m.quant_linear(x[i:i + 1], [wx], [t | quant.X16], "avx512_vnni_512") for i in range(16)])
            torch.set_num_threads(max(2, threads))
            for n in (2, 3, 4, 8, 16):
                for start in range(0, 16, n):
                    y = m.quant_linear(x[start:start + n], [wx], [t | quant.X16], "avx512_vnni_512")
                    assert torch.equal(y, alone[start:start + n]), (t, n, start)
        finally:
            torch.set_num_threads(threads)


def test_gguf_weight_interleaves_at_load_and_reads_back():
    from swiftspec.model_executor.layers.gguf import GGUFWeight

    _module()
    k = 512
    q, v = random_blocks(Q.Q4_K, 16, k, 1), random_blocks(Q.Q5_K, 8, k, 2)
    plain = GGUFWeight(k, [16, 8], [int(Q.Q4_K), int(Q.Q5_K)])
    inter = GGUFWeight(k, [16, 8], [int(Q.Q4_K), int(Q.Q5_K)], interleave=8)
    assert inter.types == [X8, int(Q.Q5_K)]  # Q5_K has no interleaved layout
    assert GGUFWeight(k, [16, 8, 16], [int(Q.Q4_K)] * 3, interleave=16).types == [
        int(Q.Q4_K) | quant.X16, X8, X8]  # 8 rows, or a part starting at column 24: the 8-row layout
    for wgt in (plain, inter):
        wgt.weight_loader(wgt.parts[0], q, "q")
        wgt.weight_loader(wgt.parts[1], v, "k")
    x = torch.randn(3, k)
    assert torch.equal(inter.matmul(x), plain.matmul(x))
    ids = torch.tensor([0, 9, 15, 3, 9])
    table = GGUFWeight(k, [16], [int(Q.Q4_K)], interleave=True)
    table.weight_loader(table.parts[0], q)
    assert torch.equal(table.rows(ids), quant.dequantize(q, int(Q.Q4_K))[ids])
    for a, b in zip(inter.dequantized(), plain.dequantized()):
        assert torch.equal(a, b)
    # a part that would start inside a group of 8 output columns keeps the plain layout
    odd = GGUFWeight(k, [12, 16], [int(Q.Q8_0), int(Q.Q4_K)], interleave=True)
    assert odd.types == [int(Q.Q8_0), int(Q.Q4_K)]
    odd.weight_loader(odd.parts[0], random_blocks(Q.Q8_0, 12, k, 3), "q")
    odd.weight_loader(odd.parts[1], q, "k")
    assert torch.equal(odd.matmul(x)[:, 12:], plain.matmul(x)[:, :16])
