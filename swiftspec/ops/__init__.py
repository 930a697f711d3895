"""One function per latency op; each call goes to the CUDA kernel, the CPU twin or the PyTorch
path, by the tensors' device and what is available (SwiftSpec paper section 3.3; README.md, "Kernels").

- ``cuda``: ``csrc/kernels/*.cu`` through :mod:`swiftspec.ops.cuda` (tensors on a CUDA device; the library is built by
  :mod:`swiftspec.ops.cuda_build` and loaded by :mod:`swiftspec.ops.cuda_lib`).
- ``cpu``: the C++ twins ``csrc/cpu/*.cpp`` through :mod:`swiftspec.ops.cpu` (CPU tensors).
- ``torch``: plain PyTorch ops (the fallback; :mod:`swiftspec.ops.reference` is the test oracle).

Kernels are on by default (``SWIFTSPEC_KERNELS=0`` turns them off); :func:`set_kernels` turns them off for this process (the engine's
``kernels=False`` does it in every worker, so the output can be compared with kernels on and off).
A kernel that fails to build is reported once as a warning and the op falls back to PyTorch.
The collectives (shared-memory LL all-reduce, fused GEMM + all-reduce) belong to the TP group and
are chosen in :mod:`swiftspec.distributed.parallel`.
"""
from __future__ import annotations

import functools
import os
import warnings

import torch
import torch.nn.functional as F

from swiftspec.ops import reference

# SWIFTSPEC_KERNELS=0 in the environment turns them off from the start (ablations, debugging)
_state = {"enabled": os.environ.get("SWIFTSPEC_KERNELS", "1") != "0",
          # SWIFTSPEC_QUANT_X8=0: GGUF weights keep the file's plain layout (set_quant_x8)
          "x8": os.environ.get("SWIFTSPEC_QUANT_X8", "1") != "0",
          # SWIFTSPEC_QUANT_X16=0: the 8-row layout even where the 512-bit kernel reads 16 rows
          "x16": os.environ.get("SWIFTSPEC_QUANT_X16", "1") != "0",
          # why the quantized GEMM runs its variant: "rule", "measured here", "environment" or
          # "set" (set_quant_gemm / set_quant_variant); swiftspec.ops.tuning
          "quant_source": "environment" if os.environ.get("SWIFTSPEC_QUANT_GEMM") else "rule"}


def set_kernels(enabled: bool) -> None:
    """Use the compiled kernels (True, the default) or PyTorch ops only (False) in this process."""
    _state["enabled"] = bool(enabled)


def kernels_enabled() -> bool:
    """Whether this process dispatches to the compiled kernels (``SWIFTSPEC_KERNELS``, :func:`set_kernels`)."""
    return _state["enabled"]


@functools.lru_cache(maxsize=None)
def _cpu_module():
    from swiftspec.ops import cpu
    try:
        return cpu.load()
    except cpu.KernelBuildError as e:
        warnings.warn(f"CPU kernels unavailable, using PyTorch ops: {e}", RuntimeWarning, stacklevel=3)
        return None


@functools.lru_cache(maxsize=None)
def _cuda_module():
    from swiftspec.ops import cuda, cuda_lib
    try:
        return cuda if cuda_lib.available() else None
    except Exception as e:  # a failed nvcc build or load: fall back, say why once
        warnings.warn(f"CUDA kernels unavailable, using PyTorch ops: {e}", RuntimeWarning, stacklevel=3)
        return None


CPU_FAMILIES = ("quant_gemm", "skinny_gemm", "tree_attention", "rms_norm", "silu_mul")


@functools.lru_cache(maxsize=None)
def cpu_dispatch() -> dict[str, str]:
    """The one ISA-dispatch point of the CPU kernels: which implementation each op family runs on
    this CPU ("torch" where the twin would only have its scalar loop, which loses to PyTorch).

    Keys (:data:`CPU_FAMILIES`): ``quant_gemm`` (GGUF blocks: "avx512_vnni_512" (weights
    interleaved by 16 rows, read on 512-bit registers: AMD Zen 5, where that measured faster;
    :func:`quant_interleave_rows`), "avx512_vnni", "avx2" or
    "scalar", picked at run time from cpuid; the scalar loop only where no SIMD one exists;
    :func:`set_quant_gemm` overrides), ``skinny_gemm``
    (float/int8 weights: "avx512_bf16", "avx512" or "torch"), ``tree_attention`` ("avx512", "avx2"
    or "torch"), ``rms_norm`` ("cpp": portable C++ the compiler vectorizes) and ``silu_mul``
    (SwiGLU's activation after the quantized GEMM: "avx512", "avx2" or "torch", the widest loop the
    extension was built with), plus ``quant_gemm_variant`` (the kernel and, for the 8-row ones,
    whether it prefetches: e.g. "avx2+prefetch"; :mod:`swiftspec.ops.tuning`) and
    ``quant_gemm_choice`` (why: "measured here", "rule", "environment" or "set"). Recorded in the
    engine's metrics and the benchmark records. All "torch" when the extension is unavailable.
    """
    m = _cpu_module()
    if m is None:
        return {k: "torch" for k in CPU_FAMILIES}
    gemm = [i for i in m._linear_impls() if i != "scalar"]
    attn = [i for i in m._tree_attention_impls() if i != "scalar"]
    act = m._silu_mul_impls()[-1]
    from swiftspec.ops import tuning

    return {"quant_gemm": m.quant_impls()[0], "skinny_gemm": gemm[-1] if gemm else "torch",
            "tree_attention": attn[-1] if attn else "torch", "rms_norm": "cpp",
            "silu_mul": act if act != "scalar" else "torch",
            "quant_gemm_variant": tuning.current_variant(m), "quant_gemm_choice": _state["quant_source"]}


def set_quant_gemm(impl: str) -> None:
    """Make ``impl`` (one of the quantized-GEMM kernels this CPU runs: "avx512_vnni_512",
    "avx512_vnni", "avx2", "scalar") the one every GGUF weight op of this process runs, as
    ``SWIFTSPEC_QUANT_GEMM=impl`` does from the start (benchmarks compare them side by side);
    ``impl + "+prefetch"`` / ``"+noprefetch"`` (the 8-row kernels) also sets whether it prefetches
    (:func:`swiftspec.ops.tuning.split`; a bare name leaves that as it is).

    Raises:
        RuntimeError: this CPU cannot run ``impl``, or the CPU extension is unavailable.
        ValueError: a "+prefetch" on a kernel without that choice.
    """
    set_quant_variant(impl, "set")


def set_quant_variant(variant: str, source: str) -> None:
    """Run quantized-GEMM ``variant`` (:mod:`swiftspec.ops.tuning`) in this process, recording
    ``source`` as why (``cpu_dispatch()["quant_gemm_choice"]``). Raises as :func:`set_quant_gemm`."""
    from swiftspec.ops import tuning

    m = _cpu_module()
    if m is None:
        raise RuntimeError("set_quant_gemm: the CPU kernels are unavailable")
    tuning.apply(m, variant)
    _state["quant_source"] = source
    cpu_dispatch.cache_clear()


def tune_quant_gemm(weights: list, rows: list[int], retune: bool = False):
    """Pick the quantized-GEMM variant of this process for GGUF weights ``weights``
    (:class:`swiftspec.ops.tuning.TuneWeight`) at ``rows`` rows per call: this machine's stored
    measurement, else one taken now (a few seconds, stored), else the rule
    (:func:`swiftspec.ops.tuning.choose`). Call it before building the weights: their layout
    follows the variant. Returns the :class:`~swiftspec.ops.tuning.Choice`, or None with the
    kernels off or the extension unavailable."""
    from swiftspec.ops import cpu, tuning

    m = _cpu_module() if _state["enabled"] else None
    if m is None:
        return None
    choice = tuning.choose(m, weights, rows, cpu.build_hash(), _interleave_rows_now, retune=retune)
    _state["quant_source"] = choice.source
    cpu_dispatch.cache_clear()
    return choice


def _interleave_rows_now() -> int:
    """:func:`quant_interleave_rows` under the variant just applied (dispatch asked afresh)."""
    cpu_dispatch.cache_clear()
    return quant_interleave_rows()


def _cpu_twin(family: str) -> bool:
    return cpu_dispatch()[family] != "torch"


def backend(t: torch.Tensor) -> str:
    """Which implementation an op on tensor ``t`` uses: "cuda", "cpu" or "torch"."""
    if not _state["enabled"]:
        return "torch"
    if t.is_cuda:
        return "cuda" if _cuda_module() is not None else "torch"
    if t.device.type == "cpu":
        return "cpu" if _cpu_module() is not None else "torch"
    return "torch"


def swiglu(x: torch.Tensor, w_gate_up: torch.Tensor) -> torch.Tensor:
    """Fused SwiGLU ``SiLU(x @ W_gate^T) * (x @ W_up^T)``; see :func:`reference.swiglu`.

    Shapes: x ``[M, K]``, w_gate_up ``[2I, K]`` (gate rows, then up rows), same dtype (fp32/bf16/
    fp16 on CUDA). Returns ``[M, I]``.
    """
    b = backend(x)
    if (b == "cpu" and _cpu_twin("skinny_gemm") and x.dtype == w_gate_up.dtype
            and x.dtype in (torch.float32, torch.bfloat16)):
        return _cpu_module().swiglu(x.contiguous(), w_gate_up)
    if b == "cuda":
        return _cuda_module().swiglu(x.contiguous(), w_gate_up)
    return reference.swiglu(x, w_gate_up)


def rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
             eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused residual add + RMSNorm; see :func:`reference.rms_norm` (shapes, dtypes, rounding).

    Returns ``(y, x + residual)`` (``(y, x)`` without a residual). On the "cpu" backend 2-D fp32 /
    bf16 inputs run the C++ twin (``csrc/cpu/rms_norm.cpp``: one pass per row, batch invariant),
    on "cuda" 2-D contiguous ones the fused kernel (``csrc/kernels/norm.cu``, one launch instead of
    eight); anything else, and anything that needs autograd, is the reference.
    """
    b = backend(x)
    fits = (x.dim() == 2 and weight.dtype == x.dtype and x.shape[-1] <= 8192
            and (residual is None or (residual.dtype == x.dtype and residual.shape == x.shape))
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))
    if (b == "cuda" and fits and x.dtype in (torch.float32, torch.bfloat16, torch.float16) and x.is_contiguous()
            and (residual is None or residual.is_contiguous())):
        return _cuda_module().rms_norm(x, residual, weight, eps)
    if b == "cpu" and fits and _cpu_twin("rms_norm") and x.dtype in (torch.float32, torch.bfloat16):
        return _cpu_module().rms_norm(x, residual, weight, float(eps))
    return reference.rms_norm(x, residual, weight, eps)


def silu_and_mul(gate_up: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """SwiGLU's activation over a merged ``[gate | up]`` projection; see :func:`reference.silu_and_mul`.

    ``gate_up [M, 2I]`` -> ``[M, I]`` in ``dtype`` (None: gate_up's). On the "cpu" backend a 2-D
    float32 input (the quantized GEMM's output) with a float32 / bfloat16 result runs the C++ twin
    (``csrc/cpu/swiglu.cpp`` ``silu_mul``: one pass, computed in fp32, one rounding, batch
    invariant) where the extension has a SIMD loop for it (``cpu_dispatch()["silu_mul"]``);
    anything else, and anything that needs autograd, is the reference.
    """
    out = gate_up.dtype if dtype is None else dtype
    if (backend(gate_up) == "cpu" and _cpu_twin("silu_mul") and gate_up.dim() == 2
            and gate_up.dtype == torch.float32 and out in (torch.float32, torch.bfloat16)
            and not (torch.is_grad_enabled() and gate_up.requires_grad)):
        return _cpu_module().silu_mul(gate_up, out)
    return reference.silu_and_mul(gate_up, dtype)


# Rows up to which the CPU twin's weight-streaming kernel runs (csrc/cpu/skinny_gemm.h kMaxRows);
# above it F.linear's GEMM reuses the weights better.
_SKINNY_MAX_ROWS = 16


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Linear layer ``x @ w.T (+ bias)``; see :func:`reference.linear` (``F.linear``).

    Shapes: x ``[..., K]`` (any leading dimensions, any strides), w ``[N, K]``, bias ``[N]`` or
    None, one dtype. Returns ``[..., N]`` in x's dtype. On the "cpu" backend, fp32 / bf16 with at
    most 16 rows (decode) run the weight-streaming CPU twin (fp32 accumulation, bias added before
    the one rounding); anything else, and anything that needs autograd, is ``F.linear``.
    Raises RuntimeError (from the twin or F.linear) on mismatched dtypes or shapes.
    """
    if (backend(x) == "cpu" and _cpu_twin("skinny_gemm") and x.dtype in (torch.float32, torch.bfloat16)
            and w.dtype == x.dtype
            and w.dim() == 2 and x.dim() >= 1 and (bias is None or bias.dtype == x.dtype)
            and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad
                                                  or (bias is not None and bias.requires_grad)))):
        x2 = x.unsqueeze(0) if x.dim() == 1 else x.flatten(0, -2)
        if x2.shape[0] <= _SKINNY_MAX_ROWS:
            y = _cpu_module().linear(x2, w, bias)
            return y.view(*x.shape[:-1], y.shape[-1])
    return F.linear(x, w, bias)


# Rows up to which the int8 twin beats torch's kernel. The twin widens every weight to fp32 and runs
# fp32 FMAs; since its weight prefetches go to L2 (skinny_gemm.h) it overlaps them with that
# arithmetic, and a whole draft forward (Qwen2.5-0.5B, bf16 activations, 1 core) took 27 / 36 / 65 /
# 124 / 226 ms at 1 / 2 / 4 / 8 / 16 rows against torch's 77 / 142 / 230 ms at 4 / 8 / 16 rows
# (2026-11-23; 57 / 62 ms at 1 / 2 rows the day before); at 16 rows they tie, so torch's kernel
# keeps the prefills.
_INT8_TWIN_MAX_ROWS = 8


def int8_linear(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Int8 weight-only linear ``(x @ q.T) * scales``; see :func:`reference.int8_linear`.

    Shapes: x ``[n, K]`` fp32 or bf16, q ``[N, K]`` int8, scales ``[N]`` float. Returns ``[n, N]``
    in x's dtype. On the "cpu" backend up to ``_INT8_TWIN_MAX_ROWS`` rows run the weight-streaming
    CPU twin; bigger batches use torch's int8 weight-only kernel; any other case is the reference.
    """
    if backend(x) == "cpu" and _cpu_twin("skinny_gemm") and x.dim() == 2 and x.shape[0] <= _INT8_TWIN_MAX_ROWS \
            and x.dtype in (torch.float32, torch.bfloat16):
        return _cpu_module().int8_linear(x, q, scales)
    return _torch_int8_linear(x, q, scales)


def _torch_int8_linear(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """torch's CPU int8 weight-only kernel (``_weight_int8pack_mm``), fast for bf16 activations
    only (fp32 takes a generic path ~60x slower in torch 2.13), so fp32 activations are computed
    in bf16: the op serves the draft model, whose numerics never reach the output. The kernel
    crashes (segfault, torch 2.13) unless K is a multiple of 16, so other shapes (padded TP shards)
    take the reference."""
    if x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float32) and q.shape[1] % 16 == 0:
        y = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16).contiguous(), q.contiguous(),
                                              scales.to(torch.bfloat16))
        return y.to(x.dtype)
    return reference.int8_linear(x, q, scales)


def quant_linear(x: torch.Tensor, parts: list[torch.Tensor], types: list[int], dequantized) -> torch.Tensor:
    """Linear layer on GGUF block weights: ``[M, K]`` fp32/bf16 -> ``[M, sum N_i]`` float32.

    ``parts[i]`` is a ``[N_i, row_bytes]`` uint8 weight of ggml type ``types[i]``; the rows of x
    are quantized to int8 once (see :mod:`swiftspec.ops.quant`). On the "cpu" backend the kernel
    picked for this CPU (AVX-512 VNNI, AVX2 or scalar) reads the blocks in place, for any M; the
    PyTorch path multiplies the same int8 activations by ``dequantized()`` (float32 copies of the
    parts). Raises RuntimeError / ValueError on shapes that do not fit the block format.
    """
    if backend(x) == "cpu":
        return _cpu_module().quant_linear(x.contiguous(), parts, types, "auto")
    from swiftspec.ops import quant

    return quant.torch_linear(x, parts, types, dequantized())


def dequantize(raw: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """``[N, row_bytes]`` uint8 plain GGUF blocks -> ``[N, K]`` float32 (an embedding's rows, a
    few per step): on the "cpu" backend one C++ loop, else :func:`swiftspec.ops.quant.dequantize`
    (~20 PyTorch ops: ~0.3-0.8 ms for one or two rows); the same bits either way. Raises
    RuntimeError / KeyError on a type without a kernel, ValueError / RuntimeError on partial blocks."""
    from swiftspec.ops import quant

    if backend(raw) == "cpu" and quant.group_rows(ggml_type) == 1:
        return _cpu_module().quant_dequantize(raw, int(ggml_type))
    return quant.dequantize(raw, ggml_type)


def set_quant_x8(enabled: bool) -> None:
    """Let GGUF weights built from now on take the interleaved layout (True, the default) or keep
    the plain one (False: benchmarks compare the two side by side)."""
    _state["x8"] = bool(enabled)


def quant_interleave_rows() -> int:
    """Rows per interleaved group that GGUF weights built now should take: 16 where the
    dispatched quantized GEMM reads the 16-row layout ("avx512_vnni_512") and
    ``SWIFTSPEC_QUANT_X16`` is not 0, 8 where :func:`quant_x8_enabled`, else 0 (the file's layout)."""
    if not quant_x8_enabled():
        return 0
    return 16 if _state["x16"] and cpu_dispatch()["quant_gemm"] == "avx512_vnni_512" else 8


def quant_x8_enabled() -> bool:
    """Whether GGUF weights built now should take the 8-row interleaved layout: the kernels
    are on, the CPU extension loads and this CPU has a SIMD quantized GEMM (the scalar loop reads
    the plain layout faster). Measured in bench/native_forward.py (both layouts side by side)."""
    return _state["enabled"] and _state["x8"] and cpu_dispatch()["quant_gemm"] != "scalar"


def native_layer_twin(x: torch.Tensor) -> bool:
    """Whether a decoder layer whose linear layers are all GGUF blocks runs as one C++ call
    (:func:`native_decoder_layer`) for activations ``x``: exactly when each of its ops would take its
    CPU twin (quantized GEMM, RMSNorm, tree attention), so the one call is bit-identical to the
    module-by-module path."""
    return (backend(x) == "cpu" and _cpu_twin("rms_norm") and _cpu_twin("tree_attention") and x.dim() == 2
            and x.dtype in (torch.float32, torch.bfloat16) and x.shape[-1] <= 8192 and not torch.is_grad_enabled())


def native_decoder_layer(ln1: torch.Tensor, ln2: torch.Tensor, eps: float, qkv, qkv_bias: torch.Tensor | None,
                         o, gate_up, down, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
    """The C++ decoder layer (``csrc/cpu/decoder_layer.cpp``) over these weights: RMSNorm, QKV
    (+ bias), tree attention, o_proj, RMSNorm, gate/up, SiLU * up, down, in one call per step.

    ``qkv``, ``o``, ``gate_up``, ``down``: :class:`swiftspec.model_executor.layers.gguf.GGUFWeight` (their parts
    are referenced, not copied). Its ``forward(x [n, H], residual [n, H] | None, k_cache, v_cache,
    slots, positions, cos_table, sin_table, mask, slot_positions=None)`` returns ``(out, x + residual)``
    in x's dtype (``slot_positions``: see :func:`tree_attention`); at TP > 1 its two halves,
    ``attention`` (same arguments) and ``mlp(o, residual)``, return o_proj's and down_proj's float32
    partial sums for the caller to all-reduce and round.
    Use it only where :func:`native_layer_twin` holds. Raises RuntimeError on inconsistent shapes.
    """
    blocks = []
    for w in (qkv, o, gate_up, down):
        blocks += [list(w.parts), list(w.types)]
    return _cpu_module().NativeDecoderLayer(ln1, ln2, float(eps), blocks[0], blocks[1], qkv_bias, *blocks[2:],
                                            num_heads, num_kv_heads, head_dim, float(scale))


def native_layers_forward(layers: list, x: torch.Tensor, residual: torch.Tensor | None, kv_buf: torch.Tensor,
                          slots: torch.Tensor, positions: torch.Tensor, cos_table: torch.Tensor,
                          sin_table: torch.Tensor, mask: torch.Tensor, slot_positions: torch.Tensor | None):
    """Every decoder layer in one C++ call (``csrc/cpu/decoder_layer.cpp``, ``forward_layers``):
    ``layers`` are :func:`native_decoder_layer` objects in order, layer ``j`` reading and writing
    its keys and values at ``kv_buf[j]`` (``[len(layers), 2, kv_heads, capacity, head_dim]``, a
    :class:`~swiftspec.model_executor.models.kv_cache.KVCache`'s buffer); the other arguments as each layer's
    ``forward``. Returns ``(out, x + residual)`` after the last layer, bit-identical to calling
    the layers one by one (it saves the interpreter between them). Use it only where
    :func:`native_layer_twin` holds. Raises RuntimeError on inconsistent shapes."""
    return _cpu_module().native_layers_forward(layers, x, residual, kv_buf, slots, positions, cos_table, sin_table,
                                               mask, slot_positions)


def tree_attention(q, k_new, v_new, k_cache, v_cache, slots, positions, cos_table, sin_table, mask,
                   scale: float, slot_positions: torch.Tensor | None = None, workspace=None,
                   kv_len: torch.Tensor | None = None) -> torch.Tensor:
    """RoPE + KV write + masked attention over prefix and tree cache; see
    :func:`reference.tree_attention` for shapes, dtypes and semantics (negative slots are not
    written; fully masked rows give zeros). ``slot_positions`` (``[>= S]`` int64, the KV cache's
    record of each slot's position) lets the CPU twin order and split the keys by their true
    positions where cache slots hold keys of other positions (the pipeline modes); the PyTorch
    path attends row by row in slot order, which is position order along every tree path.
    ``workspace``: the CUDA kernel's :class:`swiftspec.ops.cuda.TreeAttentionWorkspace` (the KV
    cache's, see :class:`swiftspec.model_executor.models.kv_cache.KVCache`); None: one shared per device.
    ``kv_len``: ``[1]`` int64 on q's device, the slots in use (a CUDA graph's live length, its
    mask padded to the capacity); the caller promises ``mask[:, kv_len:]`` is all False, so it
    changes no result: the CUDA kernel attends and splits only those slots, the others ignore it."""
    b = backend(q)
    args = (q.contiguous(), k_new.contiguous(), v_new.contiguous(), k_cache, v_cache, slots, positions,
            cos_table, sin_table, mask.contiguous(), float(scale))
    if b == "cpu" and _cpu_twin("tree_attention"):
        return _cpu_module().tree_attention(*args, slot_positions)
    if b == "cuda":
        return _cuda_module().tree_attention(*args, workspace=workspace, kv_len=kv_len)
    return _torch_tree_attention(*args)


# Query rows up to which the PyTorch path attends row by row (decode: one-token steps, draft
# expansions, verification batches): every row then runs the same kernels on the same shapes
# whatever else is in the batch, so a row's output is bit-identical alone or in a batch (batch
# invariance); bigger batches (prefills) take SDPA.
_ROWWISE_MAX_ROWS = 16


def _torch_tree_attention(q, k_new, v_new, k_cache, v_cache, slots, positions, cos_table, sin_table,
                          mask, scale):
    """The PyTorch path (kernels off or no SIMD twin for this CPU): RoPE in q's dtype, KV write,
    then attention over cache slots ``[0, S)``: up to ``_ROWWISE_MAX_ROWS`` query rows one row at
    a time over the keys the row sees (gathered: ``[Hk, G, D] @ [Hk, D, s_i]``, softmax in fp32,
    ``@ [Hk, s_i, D]``), batch invariant; more rows through ``F.scaled_dot_product_attention``
    with the mask materialized. A fully masked row gives zeros row-wise and NaN through SDPA; the
    model never builds one (only padded CUDA-graph batches do, and those run the CUDA kernel)."""
    cos = cos_table[positions].unsqueeze(1).to(q.dtype)
    sin = sin_table[positions].unsqueeze(1).to(q.dtype)
    q, k_new = (t * cos + _rotate_half(t) * sin for t in (q, k_new))
    keep = slots >= 0
    k_cache[:, slots[keep]] = k_new[keep].transpose(0, 1)
    v_cache[:, slots[keep]] = v_new[keep].transpose(0, 1)
    n, hq, d = q.shape
    S = mask.shape[1]
    if n > _ROWWISE_MAX_ROWS:
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), k_cache[:, :S].unsqueeze(0), v_cache[:, :S].unsqueeze(0),
            attn_mask=mask.view(1, 1, *mask.shape), scale=scale, enable_gqa=True)
        return out.squeeze(0).transpose(0, 1).reshape(n, -1)
    hk = k_cache.shape[0]
    qf = q.float()
    out = torch.empty(n, hq * d, dtype=torch.float32, device=q.device)
    for i in range(n):
        # only the keys this row sees, in slot order: a tree node and the same token decoded
        # alone see the same keys with the same values, so every shape and sum is the same
        seen = mask[i].nonzero().squeeze(1)
        keys = k_cache.index_select(1, seen).float()  # [Hk, s_i, D]
        values = v_cache.index_select(1, seen).float()
        scores = torch.bmm(qf[i].reshape(hk, hq // hk, d), keys.transpose(1, 2)).mul_(scale)
        out[i] = torch.bmm(torch.softmax(scores, dim=-1), values).reshape(-1)
    return out.to(q.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)
