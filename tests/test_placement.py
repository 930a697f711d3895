"""Device placement (swiftspec.placement): device resolution, GPU splits, groups, the collective
backend, and the engine's configuration errors. GPU machines are simulated where only the
count of devices matters; nothing here needs CUDA."""
import pytest
import torch
import torch.distributed as dist

from swiftspec import Engine, engine
from swiftspec.placement import (PlacementError, backend_for, plan_groups, resolve_device, split_cores,
                                 split_gpus)


def _cuda_visible(monkeypatch, n: int):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)


def test_resolve_device(monkeypatch):
    _cuda_visible(monkeypatch, 0)
    assert resolve_device("auto") == "cpu" and resolve_device("cpu") == "cpu"
    with pytest.raises(PlacementError, match="sees no CUDA device"):
        resolve_device("cuda")
    with pytest.raises(PlacementError, match="device must be one of"):
        resolve_device("gpu")
    _cuda_visible(monkeypatch, 2)
    assert resolve_device("auto") == "cuda" and resolve_device("cpu") == "cpu"


def test_backend_follows_the_device_not_the_install(monkeypatch):
    assert backend_for("cpu") == "gloo" and backend_for("cuda") == "nccl"
    # a CPU world on a machine with CUDA installed is gloo (it was NCCL, which cannot carry CPU tensors)
    _cuda_visible(monkeypatch, 1)
    from swiftspec.parallel import free_tcp_port, init_world

    try:
        (tp,) = init_world(0, 1, free_tcp_port(), [[0]], timeout_s=20.0, device_type="cpu")
        assert dist.get_backend() == "gloo" and tp.size == 1
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("n,target,draft", [(2, [0], [1]), (4, [0, 1, 2], [3]), (5, [0, 1, 2], [3, 4]),
                                            (8, [0, 1, 2, 3, 4, 5], [6, 7])])
def test_default_gpu_split(n, target, draft):
    """The draft (the smaller model) gets the last ceil(n/4) GPUs."""
    assert split_gpus(n, None, None, True) == (target, draft)
    assert split_gpus(n, None, None, False) == (list(range(n)), [])


def test_gpu_split_errors():
    assert split_gpus(4, [2, 3], [0], True) == ([2, 3], [0])
    assert split_gpus(4, [1], [3], False) == ([1, 3], [])
    for args, msg in [((1, None, None, True), "one GPU per group"),
                      ((2, [0], None, True), "or neither"),
                      ((2, [0, 1], [1], True), "disjoint"),
                      ((2, [0], [2], True), r"out of range.*2 CUDA"),
                      ((2, [0, 0], [1], True), "repeats"),
                      ((2, [], [1], True), "empty"),
                      ((2, [0], [0], False), "overlap")]:
        with pytest.raises(PlacementError, match=msg):
            split_gpus(*args)


def test_split_cores():
    assert split_cores([0, 1, 2, 3, 4], 2) == [[0, 1, 2], [3, 4]]
    assert split_cores([7], 3) == [[7], [7], [7]]  # processes share the one core
    with pytest.raises(PlacementError):
        split_cores([], 1)


def _cfg(**kw):
    return engine.EngineConfig(**{"mode": "serial", **kw})


def test_plan_groups_cpu():
    (g,) = plan_groups(_cfg(target_tp=2), "cpu", "T", "D", [0, 1, 2, 3])
    assert (g.kind, g.models, g.cores, g.devices, g.tp) == ("serial", {"target": "T", "draft": "D"},
                                                           [[0, 1], [2, 3]], ["cpu", "cpu"], 2)
    t, d = plan_groups(_cfg(mode="async"), "cpu", "T", "D", [0, 1, 2, 3])
    assert (t.kind, t.cores, d.kind, d.cores, d.models) == ("target", [[0, 1, 2]], "draft", [[3]], {"draft": "D"})
    (g,) = plan_groups(_cfg(mode="autoregressive"), "cpu", "T", None, [0, 1])
    assert g.models == {"target": "T"} and g.cores == [[0, 1]]
    with pytest.raises(PlacementError, match="at least 2 cores"):
        plan_groups(_cfg(mode="async"), "cpu", "T", "D", [0])
    with pytest.raises(PlacementError, match="disjoint"):
        plan_groups(_cfg(mode="async", target_cores=[0], draft_cores=[0]), "cpu", "T", "D", [0, 1])


def test_plan_groups_cuda():
    """One process per GPU: a group's TP degree is its GPU count; host cores may be shared."""
    t, d = plan_groups(_cfg(mode="async"), "cuda", "T", "D", [0, 1], n_gpus=4)
    assert t.devices == ["cuda:0", "cuda:1", "cuda:2"] and t.tp == 3 and t.cores == [[0], [0], [0]]
    assert d.devices == ["cuda:3"] and d.cores == [[1]]
    (g,) = plan_groups(_cfg(target_devices=[1], draft_devices=[3]), "cuda", "T", "D", [0], n_gpus=4)
    assert g.devices == ["cuda:1", "cuda:3"] and g.models == {"target": "T", "draft": "D"}
    (g,) = plan_groups(_cfg(mode="autoregressive"), "cuda", "T", None, [0, 1], n_gpus=1)
    assert g.devices == ["cuda:0"] and g.cores == [[0, 1]]
    t, d = plan_groups(_cfg(mode="async"), "cuda", "T", "D", [5], n_gpus=2)  # one host core for both
    assert t.cores == d.cores == [[5]]
    with pytest.raises(PlacementError, match="TP degree is 3"):
        plan_groups(_cfg(mode="async", target_tp=2), "cuda", "T", "D", [0, 1], n_gpus=4)
    with pytest.raises(PlacementError, match="mode='colocated'"):
        plan_groups(_cfg(mode="async"), "cuda", "T", "D", [0, 1], n_gpus=1)
    (g,) = plan_groups(_cfg(mode="colocated"), "cuda", "T", "D", [0, 1], n_gpus=1)
    assert g.kind == "colocated" and g.devices == ["cuda:0"] and g.models == {"target": "T", "draft": "D"}


def test_auto_mode_on_gpus():
    auto = engine.EngineConfig()
    assert engine.choose_mode(auto, True, None, gpus=2)[0] == "async"
    # one GPU: autoregressive, measured fastest there (run 27); the CPU profile does not apply
    mode, why, tree = engine.choose_mode(auto, True, {"mode": "async"}, gpus=1)
    assert mode == "autoregressive" and "one GPU" in why and "0.84x" in why and tree == {}
    assert engine.choose_mode(engine.EngineConfig(mode="colocated"), True, None, gpus=1)[0] == "colocated"
    assert engine.choose_mode(engine.EngineConfig(mode="async"), True, None, gpus=1)[0] == "async"


def test_engine_device_errors(tiny_dir, monkeypatch):
    with pytest.raises(ValueError, match="device must be one of"):
        engine.EngineConfig(device="tpu")
    with pytest.raises(ValueError, match="need device 'cuda'"):
        engine.EngineConfig(device="cpu", target_devices=[0])
    _cuda_visible(monkeypatch, 0)
    with pytest.raises(PlacementError, match="sees no CUDA device"):
        Engine(tiny_dir, mode="autoregressive", device="cuda")
    with pytest.raises(PlacementError, match="GPU indices"):
        Engine(tiny_dir, mode="autoregressive", target_devices=[0])  # device auto -> cpu here
