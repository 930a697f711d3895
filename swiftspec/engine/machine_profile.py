"""The cached result of ``swiftspec profile``, keyed by machine and model pair, for ``mode="auto"``.

``swiftspec profile`` measures the modes on the user's machine; besides writing its ``--output``
configuration it stores the chosen mode under ``<cache>/profiles/<key>.json``, where the key
names the CPU model (``/proc/cpuinfo``'s model name), the cores the profile ran on, the GPU model
when one is visible, and the two model directories. ``Engine(mode="auto")`` then uses that
measured mode on the same machine and pair instead of the built-in rule
(:func:`swiftspec.engine.mode_selection.choose_mode`). Architecture: docs/architecture.md §5.3.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
from pathlib import Path

from swiftspec.weights.model_cache import atomic_write_text, cache_root


def cpu_model_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what :mod:`platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_id() -> str:
    """``"<cpu model> x<cores>"`` (plus ``"; <gpu model>"`` when CUDA sees one): what a profile's
    measurements depend on besides the models."""
    model = cpu_model_name()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    out = f"{model} x{cores}"
    try:
        import torch

        if torch.cuda.is_available():
            out += f"; {torch.cuda.get_device_name(0)}"
    except Exception:  # no usable CUDA: CPU only
        pass
    return out


def profile_key(target_dir: str | Path, draft_dir: str | Path) -> str:
    """16 hex of sha256 over :func:`machine_id` and both models' resolved directories."""
    text = "\n".join([machine_id(), str(Path(target_dir).resolve()), str(Path(draft_dir).resolve())])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _path(target_dir, draft_dir, cache_dir) -> Path:
    return cache_root(cache_dir) / "profiles" / f"{profile_key(target_dir, draft_dir)}.json"


def save_profile(chosen: dict, target_dir, draft_dir, cache_dir=None) -> Path:
    """Store a profile's chosen configuration (``mode`` and ``_measured`` at least) atomically;
    returns the file."""
    path = _path(target_dir, draft_dir, cache_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"machine": machine_id(), "target": str(Path(target_dir).resolve()),
              "draft": str(Path(draft_dir).resolve()), **chosen}
    atomic_write_text(path, json.dumps(record, indent=1) + "\n")
    return path


def cached_profile(target_dir, draft_dir, cache_dir=None) -> dict | None:
    """The stored profile of this machine and pair, or None (none stored, or unreadable)."""
    try:
        record = json.loads(_path(target_dir, draft_dir, cache_dir).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and "mode" in record else None
