"""CI checks of the CUDA kernels that need nvcc but no GPU (csrc/kernels, swiftspec/ops/cuda*.py).

Each ``.cu`` is compiled separately (``nvcc -arch=sm_90a -c -Xcompiler -Wall``, through
``cuda_build.build``, which caches the result keyed by the sources' hash) for the production flags and
for ``-DSWIFTSPEC_LL_FLAG_BITS=2``; the warnings are printed and raised as pytest warnings (the CI log's warnings summary shows them). The
shared library must load with ctypes and export every function of ``api.h``; on a machine
without a GPU a call that needs one must come back as a clear CudaKernelError. The PTX of the LL
file must use the volatile vector loads / stores of the LL protocol.
"""
from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
import sys
import warnings

import pytest
import torch

from swiftspec.ops import cuda, cuda_build, cuda_comm, cuda_lib

pytestmark = pytest.mark.skipif(cuda_build.nvcc_path() is None, reason="nvcc is not on PATH")

FLAG_SETTINGS = [None, 2]


@pytest.fixture(scope="session")
def builds():
    """flag_bits -> BuildResult; every source compiled once per flag setting."""
    return {fb: cuda_build.build(fb) for fb in FLAG_SETTINGS}


@pytest.fixture(scope="session")
def libs(builds):
    return {fb: cuda_lib._open(res.path) for fb, res in builds.items()}


@pytest.fixture(scope="session")
def ll_ptx(tmp_path_factory):
    out = tmp_path_factory.mktemp("ptx") / "ll_comm.ptx"
    cmd = cuda_build.nvcc_command(cuda_build.KERNELS / "ll_comm.cu", out, mode="ptx")
    subprocess.run(cmd, check=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=600)
    return out.read_text()


@pytest.mark.parametrize("flag_bits", FLAG_SETTINGS)
def test_every_source_compiles_separately(builds, flag_bits):
    res = builds[flag_bits]
    names = {p.name for p in cuda_build.sources()}
    assert {"ll_comm.cu", "swiglu.cu", "tree_attention.cu"} <= names
    assert names <= set(res.logs), f"no compile log for {names - set(res.logs)}"
    for name in sorted(names):
        text = res.logs[name].strip()
        print(f"[flag_bits={flag_bits}] {name}: {'no warnings' if not text else 'warnings:'}")
        if text:
            print(text)
            # a pytest warning, so the CI log's warnings summary shows nvcc's warnings
            warnings.warn(f"nvcc warnings in {name} (flag_bits={flag_bits}):\n{text}", UserWarning)
    assert res.path.is_file() and res.path.name == cuda_build.LIB_NAME
    # the atomic write leaves no temporary directories behind
    assert not list(res.path.parent.glob(".tmp-*"))


def test_compile_flags_are_the_ci_flags():
    flags = cuda_build.compile_flags()
    assert "-arch=sm_90a" in flags and "-O3" in flags
    assert "-Wall" in flags and "-fPIC" in flags
    assert "-DSWIFTSPEC_LL_FLAG_BITS=2" in cuda_build.compile_flags(2)
    cmd = cuda_build.nvcc_command(cuda_build.KERNELS / "swiglu.cu", "x.o")
    assert "-c" in cmd
    # a local GPU other than sm_90 gets its own SASS next to sm_90a
    assert cuda_build.arch_flags("sm_80") == ["-arch=sm_90a", "-gencode", "arch=compute_80,code=sm_80"]
    assert cuda_build.arch_flags("sm_90") == ["-arch=sm_90a"]
    assert cuda_build.arch_flags(None) == ["-arch=sm_90a"]


def test_build_hash_changes_with_flags():
    assert cuda_build.build_dir(None) != cuda_build.build_dir(2)
    assert cuda_build.build_dir(None) == cuda_build.build_dir(None)


def test_cached_build_is_reused(builds):
    again = cuda_build.build(None)
    assert not again.built
    assert again.path == builds[None].path
    assert set(again.logs) == set(builds[None].logs)


def _api_functions() -> set[str]:
    text = (cuda_build.KERNELS / "api.h").read_text()
    return set(re.findall(r"^SS_API\s+[\w\s\*]+?\b(ss_\w+)\s*\(", text, flags=re.M))


def test_exports_match_api_header(libs):
    declared = _api_functions()
    assert len(declared) >= 15
    assert declared == set(cuda_lib.EXPORTS), "api.h and cuda_lib.EXPORTS disagree"
    for fb, lib in libs.items():
        for name in declared:
            assert hasattr(lib, name), f"{name} missing (flag_bits={fb})"
        assert lib.ss_abi_version() == cuda_lib.ABI_VERSION


@pytest.mark.skipif(shutil.which("nm") is None, reason="nm not available")
def test_static_cudart_symbols_stay_private(builds):
    out = subprocess.run(["nm", "-D", "--defined-only", str(builds[None].path)],
                         stdout=subprocess.PIPE, text=True, check=True).stdout
    exported = {line.split()[-1] for line in out.splitlines() if line.strip()}
    assert set(cuda_lib.EXPORTS) <= exported
    leaked = sorted(s for s in exported if s.startswith("cuda") or s.startswith("__cuda"))
    assert not leaked, f"cudart symbols exported (would interpose on torch's cudart): {leaked[:5]}"


def test_flag_bits_builds(libs):
    assert libs[None].ss_ll_flag_bits() == 32
    assert libs[2].ss_ll_flag_bits() == 2


def test_ll_ptx_uses_volatile_vector_packets(ll_ptx):
    for insn in ("ld.volatile.global.v4.u32", "st.volatile.global.v4.u32",  # LL16
                 "ld.volatile.global.v2.u32", "st.volatile.global.v2.u32"):  # LL8
        assert insn in ll_ptx, f"{insn} not in the PTX of ll_comm.cu"
    assert "%globaltimer" in ll_ptx  # the spin timeout
    assert "trap" in ll_ptx


# ---- host-side logic that needs no device ---------------------------------------------------

def test_host_side_sizes(libs):
    lib = libs[None]
    assert lib.ss_ll_buffer_bytes(4, 1024) == 256 + 2 * 4 * 1024
    assert lib.ss_ll_buffer_bytes(0, 1024) == -1
    assert lib.ss_tree_attention_workspace_floats(3, 8, 128, 1) == 0
    assert lib.ss_tree_attention_workspace_floats(3, 8, 128, 5) == 8 * 5 * 3 * 130


@pytest.mark.parametrize("S,requested,splits,kps", [
    (0, 4, 1, 16),      # no keys: one (empty) split
    (100, 4, 4, 32),    # 7 tiles of 16 -> 2 tiles per split -> ceil(100/32) = 4 splits
    (100, 64, 7, 16),   # at most one split per key tile
    (1000, 3, 3, 336),  # 63 tiles / 3
    (5000, 200, 63, 80),  # clamped to 64 splits -> 5 tiles each -> 63 non-empty splits
])
def test_tree_attention_plan_forced(libs, S, requested, splits, kps):
    lib = libs[None]
    ns, k = ctypes.c_int(), ctypes.c_int()
    assert lib.ss_tree_attention_plan(S, 8, requested, ctypes.byref(ns), ctypes.byref(k)) == 0
    assert (ns.value, k.value) == (splits, kps)
    assert k.value % 16 == 0 and ns.value * k.value >= S and (ns.value - 1) * k.value < max(S, 1)


def test_invalid_arguments_are_rejected_before_any_device_call(libs):
    lib = libs[None]
    invalid = 1  # cudaErrorInvalidValue
    fake = ctypes.c_void_p(16)
    assert lib.ss_swiglu(fake, fake, fake, 17, 64, 64, 1, None) == invalid  # M > 16
    assert lib.ss_swiglu(fake, fake, fake, 4, 64, 64, 7, None) == invalid   # unknown dtype
    assert lib.ss_rms_norm(fake, None, fake, fake, None, 2, 8193, 1e-6, 1, None) == invalid  # H > max
    assert lib.ss_rms_norm(fake, fake, fake, fake, None, 2, 64, 1e-6, 1, None) == invalid   # residual, no res_out
    assert lib.ss_rms_norm(fake, None, fake, fake, None, 2, 64, -1.0, 1, None) == invalid   # eps < 0
    assert lib.ss_swiglu(fake, fake, fake, 0, 64, 64, 1, None) == 0         # empty: no launch
    assert lib.ss_ll_all_reduce(fake, fake, 10, 0, 0, fake, fake, 0, 0, 1024, 10**9, None) == invalid
    assert lib.ss_ll_all_reduce(fake, fake, 10, 0, 2, fake, fake, 0, 1, 1024, 10**9, None) == invalid
    assert lib.ss_ll_all_reduce(fake, fake, 10, 0, 0, fake, fake, 0, 1, 1000, 10**9, None) == invalid
    assert lib.ss_ll_gemm_all_reduce(fake, fake, None, fake, 17, 8, 8, 0, 0, fake, fake, 0, 1, 1024,
                                     10**9, None) == invalid
    # tree attention: odd head dim, Hq not a multiple of Hk, too few keys per split (planned on
    # the host); with a device-side KV length the split count is still bounded, keys per split unused
    args = [fake] * 13
    assert lib.ss_tree_attention(*args, 2, 4, 2, 63, 32, 32, 8, 1.0, 1, 32, None, 0, None) == invalid
    assert lib.ss_tree_attention(*args, 2, 3, 2, 64, 32, 32, 8, 1.0, 1, 32, None, 0, None) == invalid
    assert lib.ss_tree_attention(*args, 2, 4, 2, 64, 32, 32, 8, 1.0, 2, 8, None, 0, None) == invalid
    assert lib.ss_tree_attention(*args, 2, 4, 2, 64, 32, 32, 8, 1.0, 2, 0, None, 0, None) == invalid
    assert lib.ss_tree_attention(*args, 2, 4, 2, 64, 32, 32, 8, 1.0, 65, 0, fake, 0, None) == invalid
    assert lib.ss_tree_attention(*args, 2, 4, 2, 64, 32, 32, 8, 1.0, 0, 0, fake, 0, None) == invalid
    assert lib.ss_tree_attention_split_cap(0, ctypes.byref(ctypes.c_int())) == invalid
    name, text = cuda_lib.error_name(invalid, lib)
    assert name == "cudaErrorInvalidValue" and text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_calls_without_a_device_raise_clear_errors(libs):
    lib = libs[None]
    n = ctypes.c_int(-1)
    st = lib.ss_device_count(ctypes.byref(n))
    if st == 0 and n.value > 0:
        pytest.skip("the driver sees a GPU although torch does not")
    no_device = {"cudaErrorNoDevice", "cudaErrorInsufficientDriver"}
    assert cuda_lib.device_count() == 0
    assert not cuda_lib.available()
    with pytest.raises(cuda_lib.CudaKernelError) as ei:
        cuda_comm.ipc_alloc(4096)
    assert ei.value.name in no_device and "ss_ipc_alloc" in str(ei.value)
    # a kernel launch with plausible arguments comes back with the same kind of status
    fake = ctypes.c_void_p(256)
    st = lib.ss_swiglu(fake, fake, fake, 2, 64, 64, 1, None)
    assert st != 0
    with pytest.raises(cuda_lib.CudaKernelError) as ei:
        cuda_lib.check(st, "ss_swiglu", lib)
    assert ei.value.name in no_device
    with pytest.raises(cuda_lib.CudaKernelError):
        cuda.tree_attention_plan(100, 8)  # needs the SM count of a device
    with pytest.raises(cuda_lib.CudaKernelError):
        cuda.tree_attention_split_cap(8)


def test_wrappers_reject_cpu_tensors():
    x = torch.randn(2, 8)
    w = torch.randn(6, 8)
    with pytest.raises(ValueError, match="CUDA tensor"):
        cuda.swiglu(x, w)
    q = torch.randn(1, 2, 4)
    with pytest.raises(ValueError, match="CUDA tensor"):
        cuda.tree_attention(q, q, q, q, q, torch.zeros(1, dtype=torch.long),
                            torch.zeros(1, dtype=torch.long), torch.ones(1, 4), torch.ones(1, 4),
                            torch.ones(1, 1, dtype=torch.bool), 1.0)


def test_module_imports_without_building(tmp_path):
    # importing never builds or touches CUDA: the library is compiled on first use only
    env = {**os.environ, "SWIFTSPEC_CACHE": str(tmp_path)}
    code = ("import swiftspec.ops.cuda, swiftspec.ops.cuda_comm, swiftspec.ops.cuda_lib as c; "
            "assert c.DTYPE_CODES and c.PROTOCOLS['ll8'] == 1")
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)
    assert not (tmp_path / "build").exists()
