"""Where the engine's groups run: the device kind, each group's devices and cores, each rank's
device, and the collective backend (docs/architecture.md §1).

On CPU a group is a set of cores split among its TP ranks (one process per rank, each running
as many threads as it has cores). On CUDA a group is a list of GPU indices, one entry per rank
(one process each): its TP degree is the number of entries, and an index may repeat, so two
ranks of a group, or the draft group and the target group, can share one GPU as separate
processes. The control backend (the torch.distributed process groups) follows the configured
device, never merely whether CUDA is installed (CPU tensors cannot go through NCCL): gloo on CPU,
NCCL on CUDA, and gloo on CUDA where a group puts two ranks on one GPU (NCCL refuses a GPU used
by two ranks of one communicator); such a group's collectives then run on the LL communicator's
kernels only (:func:`swiftspec.distributed.parallel.init_world`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from swiftspec.distributed.parallel import shares_gpu
from swiftspec.pipeline import MODES as PIPELINE_MODES
from swiftspec.spec_decode.modes import mode_for

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
        """The group's tensor-parallel degree: one rank per device entry."""
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


def uses_draft(mode: str) -> bool:
    """Whether a resolved mode (not "auto") loads the draft model: ``async`` and the draft-tree
    pipeline modes do; every other mode as its registered decode loop says
    (:attr:`swiftspec.spec_decode.modes.DecodeMode.uses_draft`). Raises ValueError for an unknown mode."""
    if mode == "async":
        return True
    if mode in PIPELINE_MODES:
        return mode != "pipeline-autoregressive"
    return mode_for(mode).uses_draft


def split_gpus(n_gpus: int, target: list[int] | None, draft: list[int] | None,
               two_groups: bool) -> tuple[list[int], list[int]]:
    """The GPU index of every rank of the target and draft groups (one entry per rank).

    An index may repeat: ``[0, 0]`` is two ranks on GPU 0 (their collectives on the CUDA LL
    communicator over a gloo control group, see :func:`swiftspec.distributed.parallel.control_backend`), and with ``two_groups``
    (async) the target and draft groups may name the same GPU (each group its own processes).
    By default the draft gets the last ⌈n/4⌉ GPUs (the draft model is the smaller one) and the
    target the others. Otherwise (serial, autoregressive: one group holds every model) the group's
    ranks are ``target + draft`` when either is given, else one per visible GPU; the second list is
    then empty.

    Raises:
        PlacementError: an index outside ``[0, n_gpus)``, an empty list, only one of the two lists
            given for two groups, or fewer than 2 GPUs for two groups by default.
    """
    for name, ids in (("target_devices", target), ("draft_devices", draft)):
        if ids is not None:
            if not ids:
                raise PlacementError(f"{name} is empty")
            bad = [i for i in ids if not 0 <= i < n_gpus]
            if bad:
                raise PlacementError(f"{name} {bad} out of range: this machine shows {n_gpus} CUDA device(s)")
    if not two_groups:
        ids = list(target or []) + list(draft or []) if (target or draft) else list(range(n_gpus))
        return ids, []
    if target is None and draft is None:
        if n_gpus < 2:
            raise PlacementError(
                f"async needs one GPU per group by default and this machine shows {n_gpus}; on one GPU use "
                "mode='colocated' (both models on it, Algorithm 1 with CUDA streams), serial, or name the "
                "GPU for both groups (target_devices=[0], draft_devices=[0]: two processes on it)")
        n_draft = max(1, math.ceil(n_gpus / 4))
        return list(range(n_gpus - n_draft)), list(range(n_gpus - n_draft, n_gpus))
    if target is None or draft is None:
        raise PlacementError("give both target_devices and draft_devices, or neither")
    return list(target), list(draft)


def gpu_group(kind: str, models: dict[str, str], gpus: list[int], cores: list[int], tp: int) -> Group:
    """A CUDA group: one rank per entry of ``gpus`` (GPU indices, repeats allowed).

    ``tp`` is the configured TP degree: 1 (the default: one rank per entry), ``len(gpus)``, or a
    multiple ``k * len(gpus)``, which puts ``k`` consecutive ranks on each listed GPU
    (``gpus=[0], tp=2`` is ``cuda:0, cuda:0``). ``cores``: the group's host cores, split among
    its ranks (shared round-robin when fewer).

    Raises:
        PlacementError: ``tp`` is none of these, or no cores.
    """
    n = len(gpus)
    if tp in (1, n):
        ranks = list(gpus)
    elif tp > n and tp % n == 0:
        ranks = [g for g in gpus for _ in range(tp // n)]
    else:
        raise PlacementError(f"the {kind} group lists {n} GPU(s) {gpus}, one process each, so its TP degree "
                             f"is {n} (or a multiple of {n}: that many ranks per GPU); got TP = {tp}")
    return Group(kind, models, split_cores(cores, len(ranks)), [f"cuda:{g}" for g in ranks])


def check_shared_gpus(groups: list[Group], kernels: bool) -> None:
    """Refuse a layout whose groups put two ranks on one GPU when the LL kernels are off.

    Such a group's control plane is gloo (:func:`swiftspec.distributed.parallel.control_backend`) and its collectives run only on
    the CUDA LL communicator, which ``kernels=False`` turns off.

    Raises:
        PlacementError: some group of two or more ranks shares a GPU and ``kernels`` is False.
    """
    for g in groups:
        if g.tp > 1 and shares_gpu(g.devices) and not kernels:
            raise PlacementError(f"the {g.kind} group puts several ranks on one GPU ({g.devices}): NCCL refuses "
                                 "that, so its collectives need the CUDA LL kernels; set kernels=True")


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


def union_cores(target_cores: list[int] | None, draft_cores: list[int] | None, cores: list[int]) -> list[int]:
    """The cores of a group holding both models' work (serial, colocated, a pipeline's stages, or
    autoregressive given both lists): ``target_cores`` then ``draft_cores``, each core once, in that
    order; ``cores`` (all this process may use) when neither is given.

    A core named in both lists is one core. Counted twice, it would get two intra-op threads (a rank
    runs one per core), and the OpenMP thread that finishes its share of an op spin-waits
    (libgomp's default wait policy) on the core its sibling needs to finish: on one shared core
    an elementwise op measured ~45x slower with two threads than with one (bench/LOG.md).
    """
    if not (target_cores or draft_cores):
        return list(cores)
    return list(dict.fromkeys([*(target_cores or []), *(draft_cores or [])]))


def plan_groups(config, device: str, target: str, draft: str | None, cores: list[int],
                n_gpus: int = 0) -> list[Group]:
    """The engine's device groups for ``config`` (an :class:`swiftspec.engine.config.EngineConfig` whose
    mode is resolved): async has a target group and a draft group, serial and colocated one
    group holding both models, autoregressive one group holding the target. ``device`` is "cpu" or "cuda" (resolved),
    ``cores`` the cores this process may use, ``n_gpus`` the visible GPUs.

    Pipeline modes (``pipeline_stages`` S >= 2): S groups of one process, stage 0 (the leader,
    holding the draft too) then "stage" groups, the cores split among them; CPU only.
    CPU: the async groups get ``target_cores`` / ``draft_cores`` (default: the draft a quarter of
    the cores, at least one), the single group their union (:func:`union_cores`; default all), each
    split among the group's ``*_tp`` ranks. CUDA: the GPUs of :func:`split_gpus`, one rank per
    entry (or ``*_tp`` ranks spread over them, :func:`gpu_group`); the cores are the ranks' host
    cores and may be shared.

    Raises:
        PlacementError: cores or GPUs that cannot hold the groups (see :func:`split_gpus`,
            :func:`gpu_group`), or ranks sharing a GPU with the kernels off (:func:`check_shared_gpus`).
    """
    from swiftspec.model_executor.runner import ROLE_DRAFT, ROLE_TARGET

    c = config
    t_cores, d_cores = c.target_cores, c.draft_cores
    if c.pipeline_stages > 1:  # stage 0 leads (with the draft), each later stage follows it
        if device != "cpu":
            raise PlacementError("pipeline stages run on CPU only (not built for CUDA yet)")
        chosen = union_cores(t_cores, d_cores, cores)
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
        models = {ROLE_TARGET: target, **({ROLE_DRAFT: draft} if uses_draft(c.mode) else {})}
        parts = [(c.mode, models, union_cores(t_cores, d_cores, cores), c.target_tp)]
    if device == "cpu":
        return [Group(kind, m, split_cores(cc, tp), ["cpu"] * tp) for kind, m, cc, tp in parts]
    gpus = split_gpus(n_gpus, c.target_devices, c.draft_devices, c.mode == "async")
    groups = [gpu_group(kind, m, ids, cc, tp) for (kind, m, cc, tp), ids in zip(parts, gpus)]
    check_shared_gpus(groups, c.kernels)
    return groups
