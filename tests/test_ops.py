"""The op dispatch (swiftspec.ops): backend choice, the kernels switch, agreement of every backend
on the same inputs, and a CPU-extension build that survives a stale torch build lock."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from swiftspec import ops
from swiftspec.ops import cpu, reference


def _attention_inputs(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    n, hq, hk, d, C, S = 5, 4, 2, 16, 40, 30
    r = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    fr = torch.outer(torch.arange(64).float(), 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)))
    cos, sin = torch.cat((fr, fr), -1).cos(), torch.cat((fr, fr), -1).sin()
    mask = torch.rand(n, S, generator=g) < 0.7
    slots = torch.arange(S - n, S)
    mask[torch.arange(n), slots] = True
    return [r(n, hq, d), r(n, hk, d), r(n, hk, d), r(hk, C, d), r(hk, C, d), slots, slots + 3, cos, sin, mask,
            d ** -0.5]


def test_cpu_backend_is_chosen_and_the_switch_turns_it_off():
    x = torch.zeros(1)
    assert cpu.available()
    assert ops.backend(x) == "cpu"
    ops.set_kernels(False)
    try:
        assert ops.backend(x) == "torch" and not ops.kernels_enabled()
    finally:
        ops.set_kernels(True)


def test_backends_agree_with_the_reference():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(2 * 37, 100, generator=g) / 10  # unit-scale outputs: atol 1e-5 is meaningful
    xs = torch.randn(3, 100, generator=g)
    outs = {}
    for on in (True, False):
        ops.set_kernels(on)
        try:
            outs[on] = ops.swiglu(xs, w)
            a = _attention_inputs()
            attn = ops.tree_attention(*a)
            b = _attention_inputs()
            ref = reference.tree_attention(*b)
            assert torch.allclose(attn, ref, atol=1e-5), on
            assert torch.allclose(a[3], b[3], atol=1e-6) and torch.equal(a[4], b[4])  # cache writes agree
        finally:
            ops.set_kernels(True)
    assert torch.allclose(outs[True], reference.swiglu(xs, w), atol=1e-5)
    assert torch.allclose(outs[False], outs[True], atol=1e-5)


def test_silu_and_mul_takes_the_twin_only_where_it_fits():
    """ops.silu_and_mul runs the C++ twin for 2-D float32 gate | up sums with the kernels on (its
    bits), and the reference otherwise: kernels off, bf16 input, 3-D input; the results agree."""
    m = cpu.load()
    gu = torch.randn(3, 2 * 40) * 3
    if m._silu_mul_impls()[-1] == "scalar":  # a build without AVX2: ATen's ops, never the scalar loop
        assert ops.cpu_dispatch()["silu_mul"] == "torch"
        pytest.skip("no SIMD silu_mul loop in this build")
    assert ops.cpu_dispatch()["silu_mul"] == m._silu_mul_impls()[-1]
    for dtype in (torch.float32, torch.bfloat16):
        on = ops.silu_and_mul(gu, dtype)
        assert on.dtype == dtype and torch.equal(on, m.silu_mul(gu, dtype))
        ops.set_kernels(False)
        try:
            off = ops.silu_and_mul(gu, dtype)
        finally:
            ops.set_kernels(True)
        assert torch.equal(off, reference.silu_and_mul(gu, dtype))
        torch.testing.assert_close(on.float(), off.float(), rtol=8e-3 if dtype == torch.bfloat16 else 2e-6,
                                   atol=1e-5)
    b = gu.to(torch.bfloat16)
    assert torch.equal(ops.silu_and_mul(b), reference.silu_and_mul(b))  # bf16 sums: the reference, in bf16
    assert torch.equal(ops.silu_and_mul(gu[None]), reference.silu_and_mul(gu[None]))


def test_load_survives_a_stale_torch_build_lock():
    """A process killed inside torch's cpp_extension.load leaves its lock file; loading must not
    wait for it forever."""
    cpu.load()
    (cpu.build_dir(cpu.module_name()) / "lock").write_text("")
    code = "from swiftspec.ops import cpu; cpu.load(); print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


def test_each_torch_installation_builds_in_a_directory_of_its_own(monkeypatch, tmp_path):
    """cpp_extension names torch's include and library directories in every compile command, so
    a clean clone's virtual environment and the checkout's must not share a build directory (each
    would rebuild every object the other built); one installation keeps one directory."""
    monkeypatch.setenv("SWIFTSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu, "_torch_dir", lambda: Path("/a/.venv/lib/python3/site-packages/torch"))
    first = cpu.build_dir("swiftspec_cpu")
    assert cpu.build_dir("swiftspec_cpu") == first and first.is_dir() and first.parent == tmp_path / "build"
    (tmp_path.parent / f"{tmp_path.name}-link").symlink_to(tmp_path)
    monkeypatch.setenv("SWIFTSPEC_CACHE", str(tmp_path.parent / f"{tmp_path.name}-link"))
    assert cpu.build_dir("swiftspec_cpu") == first  # the commands name one path, however the cache is reached
    monkeypatch.setattr(cpu, "_torch_dir", lambda: Path("/b/.venv/lib/python3/site-packages/torch"))
    assert cpu.build_dir("swiftspec_cpu") != first


def test_cpu_arch_override_names_its_own_module(monkeypatch):
    """SWIFTSPEC_CPU_ARCH builds for another -march in a module and directory of its own (never
    mixed with the native build); a value that is not an architecture name is refused."""
    monkeypatch.delenv("SWIFTSPEC_CPU_ARCH", raising=False)
    assert cpu.march() == "native" and cpu.module_name() == "swiftspec_cpu"
    monkeypatch.setenv("SWIFTSPEC_CPU_ARCH", "x86-64-v3")
    assert cpu.march() == "x86-64-v3" and cpu.module_name() == "swiftspec_cpu_x86_64_v3"
    assert cpu.module_name(2) == "swiftspec_cpu_llflag2_x86_64_v3"
    monkeypatch.setenv("SWIFTSPEC_CPU_ARCH", "native -DX; rm")
    with pytest.raises(cpu.KernelBuildError, match="not a -march value"):
        cpu.module_name()


def test_the_avx2_only_build_passes_the_kernel_tests_on_this_machine():
    """On an AVX-512 machine, the extension built as an AVX2-only CPU (AMD Zen 3) builds it for
    itself (-march=x86-64-v3: no AVX-512 path compiled) passes the kernel tests too (every twin
    against its reference, the quantized GEMM led by its AVX2 kernel): a change that breaks that
    build or its AVX2 paths fails here, not only on such a CPU."""
    if "avx512f" not in cpu._cpu_flags().split():
        pytest.skip("this CPU's own build is already one without AVX-512")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "SWIFTSPEC_CPU_ARCH": "x86-64-v3", "SWIFTSPEC_QUANT_GEMM": "avx2"}
    code = ("from swiftspec import ops; from swiftspec.ops import cpu; m = cpu.load(); "
            "print(m.__name__, m._tree_attention_impls(), m._linear_impls(), ops.cpu_dispatch())")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True,
                         timeout=1800)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split(" ", 1)[0] == "swiftspec_cpu_x86_64_v3"
    assert "['scalar', 'avx2'] ['scalar'] {'quant_gemm': 'avx2', 'skinny_gemm': 'torch', 'tree_attention': 'avx2'" \
        in out.stdout, out.stdout
    tests = [str(root / "tests" / f) for f in ("test_cpu_kernels.py", "test_quant_gemm.py")]
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests], env=env, cwd=root,
                         capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


def test_cuda_swiglu_cut_over_follows_the_h100_measurements():
    from swiftspec.ops.cuda import fused_swiglu_wins

    MB = 2**20
    bf16, fp32 = torch.bfloat16, torch.float32
    # the decode / verification shapes of the default pair stay on the fused kernel
    assert fused_swiglu_wins(8, 55 * MB, bf16) and fused_swiglu_wins(16, 17 * MB, bf16)
    assert all(fused_swiglu_wins(m, 235 * MB, fp32) for m in (1, 2, 4, 8))
    assert fused_swiglu_wins(1, 470 * MB, bf16) and fused_swiglu_wins(2, 235 * MB, bf16)
    # measured losses go to cuBLAS
    assert not fused_swiglu_wins(8, 100 * MB, bf16) and not fused_swiglu_wins(4, 235 * MB, torch.float16)
    assert not fused_swiglu_wins(16, 50 * MB, fp32) and not fused_swiglu_wins(9, 33 * MB, bf16)
