"""Where the engine's groups run: the device kind, each group's devices and cores, each rank's
device, and the collective backend (docs/architecture.md §1).

On CPU a group is a set of cores split among its TP ranks (one process per rank, each running
as many threads as it has cores). On CUDA a group is a set of GPUs with one process per GPU:
its TP degree is the number of its GPUs. The collective backend follows the configured device
(gloo on CPU, NCCL on CUDA), never merely whether CUDA is installed: CPU tensors cannot go
through NCCL.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

DEVICES = ("auto", "cpu", "cuda")


class PlacementError(ValueError):
    """The configured devices or cores cannot hold the configured groups."""


@dataclass
class Group:
    """One device group: its job, the models it holds and one entry per TP rank.

    Attributes:
        kind: "target" / "draft" (the two async groups), "serial", "colocated" or "autoregressive".
        models: role -> model path.
        cores: CPU cores of each rank (a rank's threads run there).
        devices: torch device string of each rank ("cpu" or "cuda:K").
    """

    kind: str
    models: dict[str, str]
    cores: list[list[int]]
    devices: list[str]

    @property
    def tp(self) -> int:
        return len(self.devices)


def resolve_device(device: str) -> str:
    """"cpu" or "cuda" for the configured ``device``: "auto" is "cuda" when torch sees a CUDA
    device, else "cpu".

    Raises:
        PlacementError: unknown value, or "cuda" on a machine where torch sees no CUDA device.
    """
    if device not in DEVICES:
        raise PlacementError(f"device must be one of {DEVICES}, got {device!r}")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise PlacementError(f"device='cuda' but torch {torch.__version__} sees no CUDA device "
                             "(CPU-only build, no driver, or CUDA_VISIBLE_DEVICES empty); use device='cpu'")
    return device


def backend_for(device_type: str) -> str:
    """The torch.distributed backend for tensors on ``device_type``: "nccl" for "cuda", else "gloo"."""
    return "nccl" if device_type == "cuda" else "gloo"


def split_gpus(n_gpus: int, target: list[int] | None, draft: list[int] | None,
               two_groups: bool) -> tuple[list[int], list[int]]:
    """GPU indices of the target and draft groups.

    With ``two_groups`` (async) the groups must be disjoint; by default the draft gets the last
    ⌈n/4⌉ GPUs (the draft model is the smaller one) and the target the others. Otherwise
    (serial, autoregressive: one group holds every model) the group uses ``target + draft`` when
    either is given, else every visible GPU; the second list is then empty.

    Raises:
        PlacementError: an index outside ``[0, n_gpus)``, a repeated index, groups that share a
            GPU, only one of the two lists given for two groups, or fewer than 2 GPUs for two groups.
    """
    for name, ids in (("target_devices", target), ("draft_devices", draft)):
        if ids is not None:
            if not ids:
                raise PlacementError(f"{name} is empty")
            bad = [i for i in ids if not 0 <= i < n_gpus]
            if bad:
                raise PlacementError(f"{name} {bad} out of range: this machine shows {n_gpus} CUDA device(s)")
            if len(set(ids)) != len(ids):
                raise PlacementError(f"{name} repeats a GPU: {ids}")
    if not two_groups:
        ids = list(target or []) + list(draft or []) if (target or draft) else list(range(n_gpus))
        if len(set(ids)) != len(ids):
            raise PlacementError(f"target_devices and draft_devices overlap: {target} / {draft}")
        return ids, []
    if target is None and draft is None:
        if n_gpus < 2:
            raise PlacementError(
                f"async needs one GPU per group and this machine shows {n_gpus}; on one GPU use "
                "mode='colocated' (both models on it, Algorithm 1 with CUDA streams) or serial")
        n_draft = max(1, math.ceil(n_gpus / 4))
        return list(range(n_gpus - n_draft)), list(range(n_gpus - n_draft, n_gpus))
    if target is None or draft is None:
        raise PlacementError("give both target_devices and draft_devices, or neither")
    if set(target) & set(draft):
        raise PlacementError(f"target_devices and draft_devices must be disjoint: {target} / {draft}")
    return list(target), list(draft)


def gpu_group(kind: str, models: dict[str, str], gpus: list[int], cores: list[list[int]], tp: int) -> Group:
    """A CUDA group: one rank per GPU. ``tp`` is the configured TP degree, which must be 1 (the
    default: take it from the GPUs) or the number of GPUs. ``cores``: the host cores of each rank.

    Raises:
        PlacementError: ``tp`` is neither 1 nor ``len(gpus)``.
    """
    if tp not in (1, len(gpus)):
        raise PlacementError(f"the {kind} group has {len(gpus)} GPU(s), one process each, so its TP degree "
                             f"is {len(gpus)}; got TP = {tp}")
    return Group(kind, models, cores, [f"cuda:{g}" for g in gpus])


def split_cores(cores: list[int], parts: int) -> list[list[int]]:
    """Split cores evenly among ``parts`` processes; with fewer cores than processes, processes
    share cores round-robin (correct, but slower: for tests and experiments).

    Raises:
        PlacementError: no cores.
    """
    if not cores:
        raise PlacementError("no CPU cores given")
    if len(cores) < parts:
        return [[cores[p % len(cores)]] for p in range(parts)]
    k, r = divmod(len(cores), parts)
    out, i = [], 0
    for p in range(parts):
        n = k + (p < r)
        out.append(cores[i:i + n])
        i += n
    return out


def plan_groups(config, device: str, target: str, draft: str | None, cores: list[int],
                n_gpus: int = 0) -> list[Group]:
    """The engine's device groups for ``config`` (an :class:`swiftspec.engine.llm_engine.EngineConfig` whose
    mode is resolved): async has a target group and a draft group, serial and colocated one
    group holding both models, autoregressive one group holding the target. ``device`` is "cpu" or "cuda" (resolved),
    ``cores`` the cores this process may use, ``n_gpus`` the visible GPUs.

    Pipeline modes (``pipeline_stages`` S >= 2): S groups of one process, stage 0 (the leader,
    holding the draft too) then "stage" groups, the cores split among them; CPU only.
    CPU: the async groups get ``target_cores`` / ``draft_cores`` (default: the draft a quarter of
    the cores, at least one), the single group ``target_cores + draft_cores`` (default all), each
    split among the group's ``*_tp`` ranks. CUDA: the GPUs of :func:`split_gpus`, one rank each;
    the cores are the ranks' host cores and may be shared.

    Raises:
        PlacementError: cores or GPUs that cannot hold the groups (see :func:`split_gpus`).
    """
    from swiftspec.engine.worker import ROLE_DRAFT, ROLE_TARGET

    c = config
    t_cores, d_cores = c.target_cores, c.draft_cores
    if c.pipeline_stages > 1:  # stage 0 leads (with the draft), each later stage follows it
        if device != "cpu":
            raise PlacementError("pipeline stages run on CPU only (not built for CUDA yet)")
        chosen = list(t_cores or []) + list(d_cores or []) if (t_cores or d_cores) else cores
        models = {ROLE_TARGET: target, **({ROLE_DRAFT: draft} if draft is not None else {})}
        return [Group(c.mode if s == 0 else "stage", models if s == 0 else {ROLE_TARGET: target}, [cc], ["cpu"])
                for s, cc in enumerate(split_cores(chosen, c.pipeline_stages))]
    if c.mode == "async":
        if t_cores is None and d_cores is None:
            if len(cores) < 2 and device == "cpu":
                raise PlacementError("async mode needs at least 2 cores (one per group)")
            n_draft = max(1, len(cores) // 4)
            t_cores, d_cores = (cores[:-n_draft], cores[-n_draft:]) if len(cores) > 1 else (cores, cores)
        elif t_cores is None or d_cores is None:
            raise PlacementError("give both target_cores and draft_cores, or neither")
        if set(t_cores) & set(d_cores) and device == "cpu":
            raise PlacementError("target_cores and draft_cores must be disjoint")
        parts = [(ROLE_TARGET, {ROLE_TARGET: target}, list(t_cores), c.target_tp),
                 (ROLE_DRAFT, {ROLE_DRAFT: draft}, list(d_cores), c.draft_tp)]
    else:
        models = {ROLE_TARGET: target, **({ROLE_DRAFT: draft} if c.mode in ("serial", "colocated") else {})}
        parts = [(c.mode, models, list(t_cores or []) + list(d_cores or []) if (t_cores or d_cores) else cores,
                  c.target_tp)]
    if device == "cpu":
        return [Group(kind, m, split_cores(cc, tp), ["cpu"] * tp) for kind, m, cc, tp in parts]
    gpus = split_gpus(n_gpus, c.target_devices, c.draft_devices, c.mode == "async")
    return [gpu_group(kind, m, ids, split_cores(cc, len(ids)), tp) for (kind, m, cc, tp), ids in zip(parts, gpus)]
