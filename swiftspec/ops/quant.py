"""GGUF block formats in PyTorch: the reference and the fallback of the quantized skinny GEMM.

The weights of a GGUF linear layer stay in the file's block format: a ``[N, row_bytes]`` uint8
tensor per weight whose row ``n`` is the ``K / QK`` blocks of output feature ``n`` (llama.cpp's
``block_q4_0`` / ``block_q5_0`` / ``block_q8_0`` with QK = 32, ``block_q4_K`` / ``block_q5_K`` /
``block_q6_K`` with QK = 256; ggml-common.h), or AWQ int4 groups repacked once at load into
:data:`AWQ4` blocks of 32 (:mod:`swiftspec.weights.awq`). The CPU kernel (``csrc/cpu/quant_gemm*.cpp``)
reads those bytes in place; this module has the same arithmetic in PyTorch:

* :func:`interleave` stores every 8 rows of Q4_K, Q6_K or a 32-value type interleaved (made once at load, read by the
  SIMD kernels with one output column per lane), :func:`deinterleave` undoes it;
* :func:`dequantize` turns blocks into float32 values (tested against the ``gguf`` library's
  ``gguf.quants.dequantize``, and for AWQ4 against autoawq's own dequantization), used for
  embedding lookups and by the PyTorch path;
* :func:`quantize_activations` forms exactly the kernel's int8 activations (llama.cpp's Q8_0 /
  Q8_K pairing: one scale per 32 values for the 32-value types, per 256 plus sums of every 16
  for the K types);
* :func:`reference_linear` is the test oracle (fp64 sums of dequantized weights times the same
  int8 activations) and :func:`torch_linear` the PyTorch path with kernels off (fp32 matmul on
  dequantized weights and the same int8 activations).

Architecture: docs/architecture.md §8.
"""
from __future__ import annotations

import torch

# AWQ int4 repacked per 32 values (our own block type, outside ggml's ids; swiftspec/weights/awq.py):
# fp16 scale d, uint8 zero z, a reserved byte, 16 bytes of nibbles in Q4_0's order; w = d * (q - z)
AWQ4 = 200

# or-ed into a type id: the same blocks with every 8 rows interleaved (csrc/cpu/quant_blocks.h,
# x8_source), made once at load for the kernels; Q4_K, Q6_K and the 32-value types
X8 = 0x100
# the same with every 16 rows interleaved (x16_source): read by the 512-bit AVX-512 kernel
# (avx512_vnni_512) and the scalar one, made at load where that kernel is dispatched
X16 = 0x200

# block type id -> (name, values per block, bytes per block), for the types with a kernel
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    2: ("Q4_0", 32, 18),
    6: ("Q5_0", 32, 22),
    8: ("Q8_0", 32, 34),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    AWQ4: ("AWQ4", 32, 20),
}
# the same blocks interleaved by 8 or 16 rows: every type with a kernel but Q5_K
GGML_TYPES.update({t | flag: (f"{name}_X{rows}", qk, bb) for flag, rows in ((X8, 8), (X16, 16))
                   for t, (name, qk, bb) in list(GGML_TYPES.items()) if t != 13})
TYPE_IDS = {name: t for t, (name, _, _) in GGML_TYPES.items()}


def ggml_name(ggml_type: int) -> str:
    """The name of a block type id (e.g. 12 -> "Q4_K", 200 -> "AWQ4"): ours for the types with a
    kernel, else the ``gguf`` library's."""
    from gguf import GGMLQuantizationType

    if int(ggml_type) in GGML_TYPES:
        return GGML_TYPES[int(ggml_type)][0]
    try:
        return GGMLQuantizationType(int(ggml_type)).name
    except ValueError:
        return f"type {ggml_type}"


def has_kernel(ggml_type: int) -> bool:
    """Whether the quantized GEMM reads this ggml type natively."""
    return int(ggml_type) in GGML_TYPES


def block_values(ggml_type: int) -> int:
    """Values per quantization block of a ggml type with a kernel (e.g. 256 for Q4_K, 32 for Q8_0).

    Raises:
        KeyError: a type without a kernel (:func:`has_kernel`).
    """
    return GGML_TYPES[int(ggml_type)][1]


def row_bytes(ggml_type: int, k: int) -> int:
    """Bytes of one weight row of ``k`` values. Raises ValueError if ``k`` is not a multiple of
    the block size, KeyError for a type without a kernel."""
    name, qk, bb = GGML_TYPES[int(ggml_type)]
    if k % qk:
        raise ValueError(f"{name}: {k} values per row is not a multiple of the block size {qk}")
    return k // qk * bb


def x8_type(ggml_type: int, rows: int) -> int | None:
    """The interleaved type id of ``rows`` rows of ``ggml_type`` blocks, None where there is none
    (a type without the layout, or ``rows`` not a multiple of 8)."""
    t = int(ggml_type) | X8
    return t if t in GGML_TYPES and rows % 8 == 0 else None


def group_rows(ggml_type: int) -> int:
    """Rows per interleaved group of a type id: 16 (``| X16``), 8 (``| X8``) or 1 (plain)."""
    return 16 if int(ggml_type) & X16 else (8 if int(ggml_type) & X8 else 1)


def base_type(ggml_type: int) -> int:
    """The plain block type of a (possibly interleaved) type id."""
    return int(ggml_type) & ~(X8 | X16)


def interleaved_type(ggml_type: int, rows: int, start: int, group: int) -> int:
    """The layout a part of ``rows`` rows starting at output column ``start`` takes when the
    kernels want groups of ``group`` (16 or 8) rows: ``| X16`` where both are multiples of 16 and
    16 is wanted, else ``| X8`` where both are multiples of 8, else the plain type."""
    t = int(ggml_type)
    if group >= 16 and rows % 16 == 0 and start % 16 == 0 and t | X16 in GGML_TYPES:
        return t | X16
    return (x8_type(t, rows) if start % 8 == 0 else None) or t


def _layout_op(name: str, raw: torch.Tensor, ggml_type: int) -> torch.Tensor:
    from swiftspec.ops import cpu  # the layout's one definition is the kernel's (x8_source / x16_source)

    t = int(ggml_type) if group_rows(ggml_type) > 1 else int(ggml_type) | X8
    return getattr(cpu.load(), name)(raw.contiguous(), t)


def interleave(raw: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """``[N, row_bytes]`` uint8 blocks -> the same bytes, every 16 rows interleaved for a type id
    ``| X16`` (N % 16 == 0), else every 8 (N % 8 == 0), for the kernels; needs the CPU extension.
    Raises RuntimeError on a type without the layout."""
    return _layout_op("quant_interleave", raw, ggml_type)


def deinterleave(raw: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """The inverse of :func:`interleave`."""
    return _layout_op("quant_deinterleave", raw, ggml_type)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """``[..., 2]`` uint8 (little-endian IEEE half) -> ``[..., 1]`` float32."""
    return b.contiguous().view(torch.float16).float()


def _nibbles_k(qs: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K ``qs [..., 128]`` -> ``[..., 8, 32]`` ints: group 2c is the low nibbles of bytes
    32c..32c+31, group 2c + 1 their high nibbles."""
    qs = qs.reshape(*qs.shape[:-1], 4, 32).int()
    return torch.stack([qs & 0xF, qs >> 4], dim=-2).reshape(*qs.shape[:-2], 8, 32)


def _k4_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12 packed bytes of a Q4_K/Q5_K block -> ``(scales, mins)``, ``[..., 8]`` ints each
    (llama.cpp's get_scale_min_k4)."""
    s = s.int()
    lo_sc, lo_mn = s[..., 0:4] & 63, s[..., 4:8] & 63
    hi_sc = (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)
    hi_mn = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return torch.cat([lo_sc, hi_sc], -1), torch.cat([lo_mn, hi_mn], -1)


def dequantize(raw: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """``[N, row_bytes]`` uint8 blocks -> ``[N, K]`` float32 weights.

    Raises:
        KeyError: a type without a kernel. ValueError: ``row_bytes`` is not whole blocks.
    """
    if group_rows(ggml_type) > 1:
        raw, ggml_type = deinterleave(raw, ggml_type), base_type(ggml_type)
    name, qk, bb = GGML_TYPES[int(ggml_type)]
    n, nbytes = raw.shape
    if nbytes % bb:
        raise ValueError(f"{name}: {nbytes} bytes per row is not a whole number of {bb}-byte blocks")
    blk = raw.reshape(n, nbytes // bb, bb)
    if name == "AWQ4":
        d, z, qs = _f16(blk[..., 0:2]), blk[..., 2:3].int(), blk[..., 4:20]
        return ((torch.cat([qs & 0xF, qs >> 4], -1).int() - z).float() * d).reshape(n, -1)
    if name in ("Q4_0", "Q5_0", "Q8_0"):
        d = _f16(blk[..., 0:2])
        if name == "Q8_0":
            q = blk[..., 2:34].contiguous().view(torch.int8).int()
        else:
            qs = blk[..., 6:22] if name == "Q5_0" else blk[..., 2:18]
            q = torch.cat([qs & 0xF, qs >> 4], -1).int()
            if name == "Q5_0":  # bit i of the little-endian word qh is the 5th bit of value i
                bits = (blk[..., 2:6].int().unsqueeze(-1) >> torch.arange(8)) & 1
                q = q | (bits.reshape(*q.shape) << 4)
            q = q - (16 if name == "Q5_0" else 8)
        return (q.float() * d).reshape(n, -1)
    if name in ("Q4_K", "Q5_K"):
        d, dmin = _f16(blk[..., 0:2]), _f16(blk[..., 2:4])
        sc, mn = _k4_scales(blk[..., 4:16])
        q = _nibbles_k(blk[..., 48:176] if name == "Q5_K" else blk[..., 16:144])
        if name == "Q5_K":  # bit g of qh[l] is the 5th bit of value l of group g
            q = q | (((blk[..., 16:48].int().unsqueeze(-2) >> torch.arange(8)[:, None]) & 1) << 4)
        w = (d * sc.float()).unsqueeze(-1) * q.float() - (dmin * mn.float()).unsqueeze(-1)
        return w.reshape(n, -1)
    # Q6_K: per half of 128 values, groups 0/1 are the low nibbles of ql[0:32] / ql[32:64], groups
    # 2/3 their high nibbles; the 2 high bits come from qh bits (0,1), (2,3), (4,5), (6,7).
    d = _f16(blk[..., 208:210])
    ql = blk[..., 0:128].reshape(n, -1, 2, 2, 32).int()
    qh = blk[..., 128:192].reshape(n, -1, 2, 1, 32).int()
    low = torch.cat([ql & 0xF, ql >> 4], dim=-2)  # [.., half, 4, 32]: k = 0, 1, 2, 3
    high = (qh >> (2 * torch.arange(4)[:, None])) & 3
    q = (low | (high << 4)).reshape(n, -1, 8, 32) - 32
    sc = blk[..., 192:208].contiguous().view(torch.int8).float()
    sc = sc.reshape(n, -1, 8, 2, 1).expand(n, -1, 8, 2, 16).reshape(n, -1, 8, 32)
    return (d.unsqueeze(-1) * sc * q.float()).reshape(n, -1)


def quantize_activations(x: torch.Tensor, ggml_type: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's int8 activations for weights of ``ggml_type``, bit for bit.

    Per block of QK values of a row (QK = 32 or 256, :func:`block_values`): ``d = max|x| / 127``,
    ``q = round_half_even(x * (1 / d))`` (0 for an all-zero block). Shapes: x ``[M, K]`` fp32 or
    bf16 -> (``[M, K]`` int8, ``[M, K / QK]`` fp32 scales, ``[M, K / 16]`` int16 sums of 16 values
    for the K types, ``[M, 0]`` otherwise). Raises ValueError if K is not a multiple of QK.
    """
    qk = block_values(ggml_type)
    m, k = x.shape
    if k % qk:
        raise ValueError(f"K = {k} is not a multiple of the block size {qk}")
    xf = x.float().reshape(m, k // qk, qk)
    d = xf.abs().amax(-1, keepdim=True) / 127.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = (xf * inv).round().to(torch.int8).reshape(m, k)
    sums = q.reshape(m, k // 16, 16).sum(-1, dtype=torch.int16) if qk == 256 else q.new_zeros(m, 0, dtype=torch.int16)
    return q, d.reshape(m, -1), sums


def _dequantized_x(x: torch.Tensor, ggml_type: int, dtype: torch.dtype) -> torch.Tensor:
    q, d, _ = quantize_activations(x, ggml_type)
    qk = block_values(ggml_type)
    return (q.to(dtype).reshape(q.shape[0], -1, qk) * d.to(dtype).unsqueeze(-1)).reshape(q.shape)


def reference_linear(x: torch.Tensor, parts: list[torch.Tensor], types: list[int]) -> torch.Tensor:
    """Test oracle of ``quant_linear``: ``[M, K] -> [M, sum N_i]`` float32, the kernel's int8
    activations times the dequantized weight parts, summed in float64."""
    outs = [_dequantized_x(x, t, torch.float64) @ dequantize(w, t).double().T for w, t in zip(parts, types)]
    return torch.cat(outs, dim=-1).float()


def torch_linear(x: torch.Tensor, parts: list[torch.Tensor], types: list[int],
                 dequantized: list[torch.Tensor]) -> torch.Tensor:
    """The PyTorch path (kernels off): the kernel's int8 activations times the float32 weights
    ``dequantized[i] = dequantize(parts[i], types[i])``, fp32 matmul. ``[M, K] -> [M, sum N_i]``."""
    outs = [_dequantized_x(x, t, torch.float32) @ w.T for w, t in zip(dequantized, types)]
    return torch.cat(outs, dim=-1)
