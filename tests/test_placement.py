"""Device placement (swiftspec.engine.placement): device resolution, GPU splits, groups, the collective
backend, and the engine's configuration errors. GPU machines are simulated where only the
count of devices matters; nothing here needs CUDA."""
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from swiftspec import Engine
from swiftspec.distributed.parallel import backend_for, control_backend, shares_gpu
from swiftspec.engine.config import EngineConfig
from swiftspec.engine.mode_selection import choose_mode
from swiftspec.engine.placement import (PlacementError, plan_groups, resolve_device, split_cores, split_gpus,
                                       union_cores)


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
    from swiftspec.distributed.parallel import free_tcp_port, init_world

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
                      ((1, None, None, True), r"target_devices=\[0\], draft_devices=\[0\]"),
                      ((2, [0], None, True), "or neither"),
                      ((2, [0], [2], True), r"out of range.*2 CUDA"),
                      ((2, [0, 0, 2], [1], True), r"target_devices \[2\] out of range"),
                      ((2, [], [1], True), "empty")]:
        with pytest.raises(PlacementError, match=msg):
            split_gpus(*args)


def test_a_gpu_named_twice_is_a_rank_each():
    """Every entry is one rank (one process): a repeated index is several ranks on one GPU, and
    the async groups may name the same GPU (the layouts of a one-GPU machine)."""
    assert split_gpus(1, [0, 0], None, False) == ([0, 0], [])
    assert split_gpus(1, [0], [0], False) == ([0, 0], [])  # one group: target + draft entries
    assert split_gpus(1, [0], [0], True) == ([0], [0])
    assert split_gpus(1, [0, 0], [0], True) == ([0, 0], [0])
    assert split_gpus(2, [0, 1], [1], True) == ([0, 1], [1])


def test_control_backend_is_gloo_where_a_group_shares_a_gpu():
    assert shares_gpu(["cuda:0", "cuda:0"]) and not shares_gpu(["cuda:0", "cuda:1"])
    assert not shares_gpu(["cpu", "cpu"]) and not shares_gpu(["cuda:0"])
    assert control_backend("cpu", [["cpu", "cpu"], ["cpu"]]) == "gloo"
    assert control_backend("cuda", [["cuda:0", "cuda:1"], ["cuda:2"]]) == "nccl"
    assert control_backend("cuda", [["cuda:0", "cuda:0"]]) == "gloo"
    assert control_backend("cuda", [["cuda:0", "cuda:1"], ["cuda:1", "cuda:1"]]) == "gloo"
    # groups that only share a GPU with each other: no collective spans two groups, NCCL stays
    assert control_backend("cuda", [["cuda:0"], ["cuda:0"]]) == "nccl"
    assert control_backend("cuda", [["cuda:0", "cuda:1"], ["cuda:0"]]) == "nccl"


def test_split_cores():
    assert split_cores([0, 1, 2, 3, 4], 2) == [[0, 1, 2], [3, 4]]
    assert split_cores([7], 3) == [[7], [7], [7]]  # processes share the one core
    with pytest.raises(PlacementError):
        split_cores([], 1)


def _cfg(**kw):
    return EngineConfig(**{"mode": "serial", **kw})


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


def test_a_core_named_by_both_groups_is_one_core():
    """serial / colocated / pipeline groups run on the union of the two core lists: a core in both
    is one core, so one intra-op thread (two would spin-wait for each other on it)."""
    assert union_cores([0], [0], [0, 1]) == [0]
    assert union_cores([2, 0], [0, 3], [0, 1, 2, 3]) == [2, 0, 3]
    assert union_cores(None, None, [0, 1]) == [0, 1] and union_cores([1], [], [0, 1]) == [1]
    for mode in ("serial", "colocated", "autoregressive"):
        (g,) = plan_groups(_cfg(mode=mode, target_cores=[0], draft_cores=[0]), "cpu", "T", "D", [0, 1])
        assert g.cores == [[0]], mode
    (g,) = plan_groups(_cfg(target_cores=[0], draft_cores=[0], target_tp=2), "cpu", "T", "D", [0, 1])
    assert g.cores == [[0], [0]]  # two ranks share the core, one thread each
    stages = plan_groups(_cfg(mode="pipedec", pipeline_stages=2, target_cores=[0, 1], draft_cores=[1]),
                         "cpu", "T", "D", [0, 1])
    assert [s.cores for s in stages] == [[[0]], [[1]]]


def _pinned_threads(cores: list[int], threads: int) -> tuple[set[int], int]:
    from swiftspec.engine.config import EngineConfig
    from swiftspec.engine.worker import WorkerSpec, pin

    pin(WorkerSpec(config=EngineConfig(), rank=0, world_size=1, port=0, groups=[[0]], group=0, models={}, kind="serial", cores=cores,
                   threads=threads))
    return os.sched_getaffinity(0), torch.get_num_threads()


def test_pin_runs_no_more_threads_than_cores():
    """A worker asked for more intra-op threads than the cores it may use runs one per core."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        assert pool.submit(_pinned_threads, [0], 2).result(timeout=120) == ({0}, 1)
        assert pool.submit(_pinned_threads, [0], 1).result(timeout=120) == ({0}, 1)


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
    with pytest.raises(PlacementError, match="TP degree is 2"):
        plan_groups(_cfg(mode="autoregressive", target_tp=3, target_devices=[0, 1]), "cuda", "T", None, [0], n_gpus=2)
    with pytest.raises(PlacementError, match="mode='colocated'"):
        plan_groups(_cfg(mode="async"), "cuda", "T", "D", [0, 1], n_gpus=1)
    (g,) = plan_groups(_cfg(mode="colocated"), "cuda", "T", "D", [0, 1], n_gpus=1)
    assert g.kind == "colocated" and g.devices == ["cuda:0"] and g.models == {"target": "T", "draft": "D"}


def test_plan_groups_with_ranks_sharing_a_gpu():
    """TP degree = ranks, not distinct GPUs: a repeated index, or ``*_tp`` a multiple of the GPUs
    listed; the async groups as separate processes on one GPU; ranks sharing a GPU need the kernels
    (their collectives exist only as LL kernels)."""
    (g,) = plan_groups(_cfg(mode="autoregressive", target_devices=[0, 0]), "cuda", "T", None, [0, 1], n_gpus=1)
    assert g.devices == ["cuda:0", "cuda:0"] and g.tp == 2 and g.cores == [[0], [1]]
    (g,) = plan_groups(_cfg(mode="autoregressive", target_devices=[0], target_tp=2), "cuda", "T", None, [0], n_gpus=1)
    assert g.devices == ["cuda:0", "cuda:0"] and g.tp == 2 and g.cores == [[0], [0]]
    (g,) = plan_groups(_cfg(mode="autoregressive", target_devices=[0, 1], target_tp=4), "cuda", "T", None, [0],
                       n_gpus=2)
    assert g.devices == ["cuda:0", "cuda:0", "cuda:1", "cuda:1"]
    t, d = plan_groups(_cfg(mode="async", target_devices=[0], draft_devices=[0]), "cuda", "T", "D", [0, 1], n_gpus=1)
    assert (t.devices, d.devices, t.models, d.models) == (["cuda:0"], ["cuda:0"], {"target": "T"}, {"draft": "D"})
    t, d = plan_groups(_cfg(mode="async", target_devices=[0, 0], draft_devices=[0]), "cuda", "T", "D", [0, 1, 2],
                       n_gpus=1)
    assert (t.tp, d.tp, t.devices + d.devices) == (2, 1, ["cuda:0"] * 3)
    assert control_backend("cuda", [t.devices, d.devices]) == "gloo"
    with pytest.raises(PlacementError, match="several ranks on one GPU.*kernels=True"):
        plan_groups(_cfg(mode="autoregressive", target_devices=[0, 0], kernels=False), "cuda", "T", None, [0],
                    n_gpus=1)
    # kernels off is fine where no group puts two ranks on one GPU
    t, d = plan_groups(_cfg(mode="async", target_devices=[0], draft_devices=[0], kernels=False), "cuda", "T", "D",
                       [0], n_gpus=1)
    assert t.tp == d.tp == 1


def test_devices_from_the_command_line_may_repeat():
    from swiftspec.entrypoints import cli

    args = cli.build_parser().parse_args(["generate", "--device", "cuda", "--mode", "async", "--target-devices",
                                          "0,0", "--draft-devices", "0"])
    cfg = EngineConfig(**cli.engine_kwargs(args))
    assert (cfg.target_devices, cfg.draft_devices) == ([0, 0], [0])
    (g,) = plan_groups(_cfg(mode="autoregressive", target_devices=cfg.target_devices), "cuda", "T", None, [0],
                       n_gpus=1)
    assert g.tp == 2


def test_auto_mode_on_gpus():
    auto = EngineConfig()
    assert choose_mode(auto, True, None, gpus=2)[0] == "async"
    # one GPU without a profile of it: the target alone, and the reason says how to measure
    mode, why, tree = choose_mode(auto, True, None, gpus=1)
    assert mode == "autoregressive" and "one GPU" in why and "swiftspec profile" in why and tree == {}
    # a profile measured on this GPU (its machine id names the GPU) decides, tree shape included
    stored = {"mode": "colocated", "bs": 4, "d": 2, "_measured": {"tokens_per_s": 99.0, "date": "today"}}
    mode, why, tree = choose_mode(auto, True, stored, gpus=1)
    assert (mode, tree) == ("colocated", {"bs": 4, "d": 2}) and "measured it fastest" in why
    assert choose_mode(EngineConfig(mode="colocated"), True, None, gpus=1)[0] == "colocated"
    assert choose_mode(EngineConfig(mode="async"), True, None, gpus=1)[0] == "async"


def test_engine_device_errors(tiny_dir, monkeypatch):
    with pytest.raises(ValueError, match="device must be one of"):
        EngineConfig(device="tpu")
    with pytest.raises(ValueError, match="need device 'cuda'"):
        EngineConfig(device="cpu", target_devices=[0])
    _cuda_visible(monkeypatch, 0)
    with pytest.raises(PlacementError, match="sees no CUDA device"):
        Engine(tiny_dir, mode="autoregressive", device="cuda")
    with pytest.raises(PlacementError, match="GPU indices"):
        Engine(tiny_dir, mode="autoregressive", target_devices=[0])  # device auto -> cpu here


def test_draft_sms_needs_colocated_on_cuda(tiny_dir, monkeypatch):
    """draft_sms (the colocated mode's SM partition) with a value, mode or device it cannot apply to."""
    for bad, match in ((dict(draft_sms=0), "positive"), (dict(draft_sms=-8), "positive"),
                       (dict(draft_sms=8.0), "positive"), (dict(draft_sms=True), "positive"),
                       (dict(draft_sms=8, mode="serial"), "mode='colocated'"),
                       (dict(draft_sms=8, mode="async"), "mode='colocated'"),
                       (dict(draft_sms=8, mode="autoregressive"), "mode='colocated'"),
                       (dict(draft_sms=8, device="cpu"), "device 'cuda'")):
        with pytest.raises(ValueError, match=match):
            EngineConfig(**{"mode": "colocated", **bad})
    assert EngineConfig(mode="colocated", draft_sms=32).draft_sms == 32
    assert EngineConfig(draft_sms=32).mode == "auto"  # decided once the mode is resolved
    _cuda_visible(monkeypatch, 0)
    with pytest.raises(ValueError, match="runs on the CPU"):
        Engine(tiny_dir, tiny_dir, mode="colocated", draft_sms=8)  # device auto -> cpu here
    _cuda_visible(monkeypatch, 1)
    with pytest.raises(ValueError, match="runs 'autoregressive'.*one GPU"):
        Engine(tiny_dir, tiny_dir, draft_sms=8)  # auto on one GPU: autoregressive, no draft stream to confine


def test_draft_sms_from_the_command_line_and_bench_config(tiny_dir, capsys):
    from swiftspec.benchmark.systems import expand_systems
    from swiftspec.entrypoints import cli

    for cmd in ("generate", "serve"):
        args = cli.build_parser().parse_args([cmd, "--mode", "colocated", "--draft-sms", "32", "--device", "cuda"])
        cfg = EngineConfig(**cli.engine_kwargs(args))
        assert (cfg.mode, cfg.device, cfg.draft_sms) == ("colocated", "cuda", 32)
    assert "draft_sms" not in cli.engine_kwargs(cli.build_parser().parse_args(["generate"]))
    # `swiftspec bench --systems swiftspec-profiled --config bench/colocated-sm-partition.json`
    path = str(Path(__file__).resolve().parents[1] / "bench" / "colocated-sm-partition.json")
    assert expand_systems(["autoregressive", "swiftspec-profiled"], [path])[1] == ("swiftspec-profiled", path)
    cfg = EngineConfig.from_json(path, dtype="bfloat16", device="cuda")  # as EngineSystem reads it
    assert (cfg.mode, cfg.draft_sms) == ("colocated", 32)
    # a combination that cannot run is a usage error (exit status 2) before any model loads
    assert cli.main(["generate", "--prompt", "x", "--target", str(tiny_dir), "--draft", str(tiny_dir),
                     "--mode", "serial", "--draft-sms", "8"]) == 2
    assert "draft_sms" in capsys.readouterr().err


def test_green_context_stream_on_simulated_apis(monkeypatch):
    """swiftspec.model_executor.sm_partition.green_context_stream against fakes of torch's green contexts and the CUDA
    driver: either torch API (a context with Stream(), or one with only set_context() /
    pop_context(), where the stream is made in the pushed context), and every failure named,
    a stream the driver does not place in a green context included (no silent whole-GPU stream)."""
    from swiftspec.model_executor import sm_partition
    from swiftspec.model_executor.runner import ModelRunner
    from swiftspec.model_executor.sm_partition import green_context_stream

    with pytest.raises(ValueError, match="CUDA device"):
        ModelRunner("unused", device="cpu", sm_count=8)
    with pytest.raises(ValueError, match="positive"):
        green_context_stream(0, "cuda:0")
    green = torch.cuda.green_contexts
    monkeypatch.setattr(green, "SUPPORTED", False)
    with pytest.raises(RuntimeError, match="SUPPORTED is false"):
        green_context_stream(8, "cuda:0")
    monkeypatch.setattr(green, "SUPPORTED", True)
    monkeypatch.setattr(sm_partition, "_GREEN_CONTEXTS", [])
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(multi_processor_count=132))
    monkeypatch.setattr(torch.cuda, "ExternalStream", lambda handle, device: ("external", handle, device))
    calls = []

    class Driver:  # ctypes.byref(x)._obj is x
        owner = 0x77

        def cuStreamCreateWithPriority(self, ref, flags, priority):
            calls.append(("create", flags, priority))
            ref._obj.value = 0x5000
            return 0

        def cuStreamGetGreenCtx(self, stream, ref):
            calls.append(("owner", stream.value))
            ref._obj.value = self.owner
            return 0

    driver = Driver()
    monkeypatch.setattr(sm_partition, "_cuda_driver", lambda: driver)

    class WithStream:
        def Stream(self):
            return SimpleNamespace(cuda_stream=0x4000)

    class PushPop:
        def set_context(self):
            calls.append("set")

        def pop_context(self):
            calls.append("pop")

    def api(ctx_type, fail=None):
        def create(num_sms, device_id):
            calls.append(("green", num_sms, device_id))
            if fail:
                raise RuntimeError(fail)
            return ctx_type()
        monkeypatch.setattr(green, "GreenContext", SimpleNamespace(create=create))

    with pytest.raises(ValueError, match="has 132 SMs"):
        green_context_stream(200, "cuda:1")
    api(WithStream)
    assert green_context_stream(32, "cuda:1").cuda_stream == 0x4000
    assert calls == [("green", 32, 1), ("owner", 0x4000)] and len(sm_partition._GREEN_CONTEXTS) == 1
    calls.clear()
    api(PushPop)
    assert green_context_stream(16, "cuda:0") == ("external", 0x5000, torch.device("cuda", 0))
    assert calls == [("green", 16, 0), "set", ("create", 1, 0), "pop", ("owner", 0x5000)]
    api(object)
    with pytest.raises(RuntimeError, match="neither Stream"):
        green_context_stream(16, "cuda:0")
    api(WithStream, fail="cuda driver too old to use green context!")
    with pytest.raises(RuntimeError, match="could not create.*16 SMs.*driver too old"):
        green_context_stream(16, "cuda:0")
    api(WithStream)
    driver.owner = 0
    with pytest.raises(RuntimeError, match="does not belong.*whole GPU"):
        green_context_stream(16, "cuda:0")
