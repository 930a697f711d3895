"""AWQ int4 checkpoints (autoawq's GEMM layout) -> a converted model directory with native blocks.

An AWQ checkpoint is a Hugging Face directory whose ``config.json`` has ``quantization_config``
``{"quant_method": "awq", "bits": 4, "group_size": G, "zero_point": true, "version": "gemm"}``
and whose linear layers are stored as three tensors instead of ``weight`` (autoawq
``awq/modules/linear/gemm.py``, ``WQLinear_GEMM``; read, not copied), for K inputs, N outputs:

* ``qweight`` ``[K, N / 8]`` int32: nibble ``i`` (bits ``4i .. 4i+3``) of word ``[k, j]`` is the
  4-bit value of output column ``8j + AWQ_ORDER[i]``;
* ``qzeros`` ``[K / G, N / 8]`` int32, packed the same way: the integer zero of each group;
* ``scales`` ``[K / G, N]`` fp16;

and ``W[n, k] = (q[k, n] - z[k // G, n]) * s[k // G, n]``. :func:`convert_awq` repacks every
such layer once into :data:`~swiftspec.ops.quant.AWQ4` blocks of 32 values (the group's fp16
scale and zero repeated per block, nibbles in Q4_0's order), which the quantized skinny GEMM
reads like a Q4_0 block with its own zero: ``d * (sum q x - z * sum x)`` on the int8
activations, exact integer sums. The blocks go to ``native/blocks.safetensors`` (read with
``weights="native"``), the dequantized weights to the float safetensors (``weights="bfloat16"``
/ ``"float32"``), as for a GGUF. Cost: 20 bytes per 32 weights (5 bits per weight) against
AWQ's ~4.16 at G = 128.
"""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch

from swiftspec.ops.quant import AWQ4
from swiftspec.weights.model_cache import (
    NATIVE_FILE,
    TORCH_DTYPE_NAME,
    TORCH_TO_ST_DTYPE,
    ModelLoadError,
    TensorPlan,
    build_model_dir,
    write_float_weights,
)

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_INVERSE_ORDER = tuple(AWQ_ORDER.index(c) for c in range(8))  # column c of 8 is nibble _INVERSE_ORDER[c]
_QUANT_SUFFIXES = (".qweight", ".qzeros", ".scales")


def awq_group_size(config: dict) -> int | None:
    """The group size of an AWQ checkpoint's ``config.json`` (``quantization_config``), None when
    the checkpoint is not AWQ.

    Raises:
        ModelLoadError: an AWQ variant without a kernel here (bits other than 4, no zero point,
            a layout other than GEMM, a group size that is not a multiple of 32).
    """
    qc = config.get("quantization_config") or {}
    if str(qc.get("quant_method", "")).lower() != "awq":
        return None
    bits = int(qc.get("bits", qc.get("w_bit", 4)))
    version = str(qc.get("version", "gemm")).lower()
    group = int(qc.get("group_size", qc.get("q_group_size", 128)))
    if bits != 4 or not qc.get("zero_point", True) or version != "gemm":
        raise ModelLoadError(f"AWQ checkpoint with bits={bits}, zero_point={qc.get('zero_point', True)}, "
                             f"version={version!r}: only 4-bit GEMM-layout checkpoints with zero points "
                             "(autoawq's default) are supported")
    if group != -1 and group % 32:
        raise ModelLoadError(f"AWQ group size {group} is not a multiple of 32; the kernels need whole 32-value blocks")
    return group


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """``[R, C]`` int32 in AWQ's packing -> ``[R, 8C]`` int32 values 0..15, columns in order."""
    nib = (packed.unsqueeze(-1) >> (4 * torch.arange(8, dtype=torch.int32))) & 0xF  # [R, C, 8]
    return nib[..., list(_INVERSE_ORDER)].reshape(packed.shape[0], -1)


def _unpacked(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q [N, K], z [N, K / G], s [N, K / G] fp16)`` of one layer, shapes checked."""
    k, n = qweight.shape[0], qweight.shape[1] * 8
    g = k if group == -1 else group
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32 or scales.dtype != torch.float16:
        raise ModelLoadError(f"AWQ tensors must be int32 qweight/qzeros and fp16 scales, got "
                             f"{qweight.dtype}/{qzeros.dtype}/{scales.dtype}")
    if k % g or tuple(qzeros.shape) != (k // g, n // 8) or tuple(scales.shape) != (k // g, n):
        raise ModelLoadError(f"AWQ layer with qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)}, "
                             f"scales {tuple(scales.shape)} does not fit group size {g}")
    return unpack_int4(qweight).T, unpack_int4(qzeros).T, scales.T


def dequantize_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """One AWQ layer -> ``[N, K]`` float32 weights ``(q - z) * s`` (exact: fp16 scale times an
    integer of at most 5 bits). ``group`` -1 means one group per column (G = K).

    Raises:
        ModelLoadError: dtypes or shapes that do not fit the format."""
    q, z, s = _unpacked(qweight, qzeros, scales, group)
    g = q.shape[1] // z.shape[1]
    return ((q - z.repeat_interleave(g, dim=1)).float() * s.float().repeat_interleave(g, dim=1)).contiguous()


def repack_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """One AWQ layer -> ``[N, K / 32 * 20]`` uint8 :data:`~swiftspec.ops.quant.AWQ4` blocks.

    Per 32 values of a row: the group's fp16 scale (2 bytes), its zero (1 byte), a zero byte, and
    16 bytes whose low nibbles are values 0-15 and high nibbles values 16-31. Dequantizing them
    (:func:`swiftspec.ops.quant.dequantize`) gives exactly :func:`dequantize_awq`.

    Raises:
        ModelLoadError: dtypes or shapes that do not fit the format, or K not a multiple of 32."""
    q, z, s = _unpacked(qweight, qzeros, scales, group)
    n, k = q.shape
    if k % 32:
        raise ModelLoadError(f"AWQ layer with {k} inputs: not a multiple of 32")
    per = (k // z.shape[1]) // 32  # blocks per group
    zb = z.repeat_interleave(per, dim=1).to(torch.uint8).unsqueeze(-1)  # [N, K/32, 1]
    sb = s.contiguous().repeat_interleave(per, dim=1).unsqueeze(-1).view(torch.uint8)  # [N, K/32, 2]
    qb = q.reshape(n, k // 32, 32).to(torch.uint8)
    nibbles = qb[..., :16] | (qb[..., 16:] << 4)
    blocks = torch.cat([sb, zb, torch.zeros_like(zb), nibbles], dim=-1)
    return blocks.reshape(n, -1).contiguous()


def source_id(src: Path) -> str:
    """Identity of a checkpoint directory for the cache: names, sizes and mtimes of its files."""
    h = hashlib.sha256(str(src.resolve()).encode())
    for p in sorted(src.iterdir()):
        if p.is_file():
            st = p.stat()
            h.update(f"{p.name}:{st.st_size}:{st.st_mtime_ns};".encode())
    return f"awq:{h.hexdigest()}"


def _open_tensors(src: Path) -> dict[str, tuple[Path, str]]:
    from safetensors import safe_open

    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{src} has config.json but no *.safetensors weights")
    where = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    where[name] = (f, name)
        except Exception as exc:
            raise ModelLoadError(f"cannot read {f}: {exc}") from exc
    return where


def _get(where: dict[str, tuple[Path, str]], name: str) -> torch.Tensor:
    from safetensors import safe_open

    f, key = where[name]
    with safe_open(str(f), framework="pt") as st:
        return st.get_tensor(key)


def _shape(where: dict[str, tuple[Path, str]], name: str) -> tuple[int, ...]:
    from safetensors import safe_open

    f, key = where[name]
    with safe_open(str(f), framework="pt") as st:
        return tuple(st.get_slice(key).get_shape())


def convert_awq(src: str | Path, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16, *,
                progress: bool = False, source: str | None = None) -> Path:
    """Convert an AWQ checkpoint directory into a model directory at ``out_dir`` (atomically).

    Writes ``native/blocks.safetensors`` (every AWQ layer repacked by :func:`repack_awq`, metadata
    ``ggml_types`` naming :data:`~swiftspec.ops.quant.AWQ4`), the float safetensors in ``dtype``
    (AWQ layers dequantized, the other tensors cast), ``config.json`` without
    ``quantization_config``, and copies of the checkpoint's other files (tokenizer, chat template,
    generation config). ``source``: recorded in the marker (default :func:`source_id`).

    Raises:
        ModelLoadError: not an AWQ checkpoint, an unsupported AWQ variant, a layer missing one of
            qweight/qzeros/scales, unreadable or ill-shaped tensors, or an unsupported ``dtype``.
    """
    from safetensors.torch import save_file

    src, out_dir = Path(src).expanduser(), Path(out_dir).expanduser()
    if dtype not in TORCH_TO_ST_DTYPE:
        raise ModelLoadError(f"unsupported output dtype {dtype}; use bfloat16, float16 or float32")
    try:
        config = json.loads((src / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {src / 'config.json'}: {exc}") from exc
    group = awq_group_size(config)
    if group is None:
        raise ModelLoadError(f"{src} is not an AWQ checkpoint (no quantization_config with quant_method 'awq')")
    where = _open_tensors(src)
    layers = sorted({n[: -len(".qweight")] for n in where if n.endswith(".qweight")})
    for layer in layers:
        missing = [s for s in _QUANT_SUFFIXES if layer + s not in where]
        if missing:
            raise ModelLoadError(f"AWQ layer {layer} lacks {', '.join(layer + s for s in missing)}")
    quant_names = {layer + s for layer in layers for s in _QUANT_SUFFIXES}

    def awq_parts(layer):
        return [_get(where, layer + s) for s in _QUANT_SUFFIXES]

    plans = []
    for layer in layers:
        k, n8 = _shape(where, layer + ".qweight")
        plans.append(TensorPlan(f"{layer}.weight", (n8 * 8, k),
                                lambda layer=layer: dequantize_awq(*awq_parts(layer), group)))
    for name in sorted(set(where) - quant_names):
        plans.append(TensorPlan(name, _shape(where, name), lambda name=name: _get(where, name).float()))
    config = {k: v for k, v in config.items() if k != "quantization_config"}

    def fill(tmp: Path) -> dict:
        write_float_weights(tmp, plans, dtype, f"convert {src.name}", progress)
        blocks = {f"{layer}.weight": repack_awq(*awq_parts(layer), group) for layer in layers}
        (tmp / NATIVE_FILE).parent.mkdir(parents=True, exist_ok=True)
        save_file(blocks, str(tmp / NATIVE_FILE), metadata={"ggml_types": json.dumps({n: AWQ4 for n in blocks})})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for p in src.iterdir():
            if p.is_file() and p.name != "config.json" and not p.name.endswith((".safetensors", ".safetensors.index.json")):
                shutil.copy2(p, tmp / p.name)
        return {"awq": str(src.resolve()), "group_size": group, "dtype": TORCH_DTYPE_NAME[dtype]}

    return build_model_dir(out_dir, source or source_id(src), fill)

