"""The engine on CUDA (device="cuda"): models, KV caches and step inputs on the GPU. Tiny random
fp32 models whose draft is the target itself (so the compression ratio is well above 1.5):
serial, colocated (CUDA streams; also with the draft on an SM partition, a CUDA green context)
and async equal autoregressive greedy; sampled output follows the target distribution.
Skipped without a CUDA device (the CPU suite covers the same loops on "cpu")."""
from collections import Counter

import pytest
import torch

from swiftspec import Engine, SamplingParams
from swiftspec.model_executor.runner import ModelRunner, RunnerHandle
from swiftspec.spec_decode import target_loops, tree_loops
from swiftspec.spec_decode.draft_state import DraftState, TreeParams
from swiftspec.spec_decode.scheduler import Request
from swiftspec.spec_decode.target_state import TargetState

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
needs_green = pytest.mark.skipif(not getattr(getattr(torch.cuda, "green_contexts", None), "SUPPORTED", False),
                                 reason="this torch has no CUDA green contexts (draft_sms)")
DRAFT_SMS = 16  # a multiple of Hopper's 8-SM granularity, a small share of any GPU that has green contexts

PROMPT = [3, 40, 41, 42, 50, 60, 70, 33, 34, 35]
GREEDY = SamplingParams(max_tokens=32, ignore_eos=True)


def _states(model_dir, streams: bool = False, draft_sms: int | None = None, **tree):
    """Target and draft on the GPU; ``streams``: each on a stream of its own, as the colocated
    worker runs them (the target's at high priority); ``draft_sms``: the draft's stream in a green
    context of that many SMs."""
    pt, pd = (-1, 0) if streams else (None, None)
    target = TargetState(RunnerHandle("target", ModelRunner(str(model_dir), capacity=512, device="cuda",
                                                            stream_priority=pt), []))
    draft = DraftState(RunnerHandle("draft", ModelRunner(str(model_dir), capacity=1024, device="cuda",
                                                         stream_priority=pd, sm_count=draft_sms), []),
                       TreeParams(**tree))
    return target, draft


def _run(fn, *args):
    out = []
    st = fn(*args, lambda toks, t, lps=(): out.extend(toks))
    return out, st


@pytest.mark.parametrize("kernels", [True, False])
@pytest.mark.parametrize("loop,draft_sms", [("serial", None), ("colocated", None),
                                            pytest.param("colocated", DRAFT_SMS, marks=needs_green)])
def test_runner_on_cuda_equals_autoregressive(tiny_dir, kernels, loop, draft_sms):
    from swiftspec import ops

    ops.set_kernels(kernels)
    try:
        target, draft = _states(tiny_dir, streams=loop == "colocated", draft_sms=draft_sms)
        assert target.runner.runner.kv.buf.is_cuda
        req = Request(PROMPT, SamplingParams(max_tokens=40, ignore_eos=True), 40, (2,), 3, False)
        ref, _ = _run(target_loops.run_autoregressive, target, req)
        out, st = _run(getattr(tree_loops, f"run_{loop}"), draft, target, req)
        assert out == ref
        assert len(out) / (len(st.accepted) + 1) > 1.5, "an identical draft must be accepted"
    finally:
        ops.set_kernels(True)


def test_each_model_keeps_its_own_attention_workspace(tiny_dir):
    """Target and draft never share split-KV partials (they run on concurrent streams in the
    colocated mode), and a workspace never moves once used (CUDA graphs hold its address): on the
    default pair's shapes a shared, growing workspace left the target's graphs writing freed
    memory (an illegal address in serial mode)."""
    target, draft = _states(tiny_dir, streams=True)
    kt, kd = target.runner.runner.kv, draft.runner.runner.kv
    assert kt.workspace is not None and kt.workspace is not kd.workspace
    req = Request(PROMPT, SamplingParams(max_tokens=12, ignore_eos=True), 12, (2,), 3, False)
    _run(tree_loops.run_colocated, draft, target, req)
    addresses = (kt.workspace.partials.data_ptr(), kd.workspace.partials.data_ptr())
    _run(tree_loops.run_serial, draft, target, req)
    assert (kt.workspace.partials.data_ptr(), kd.workspace.partials.data_ptr()) == addresses


@pytest.mark.parametrize("loop", ["serial", "colocated"])
def test_sampled_output_follows_target_distribution_on_cuda(tiny_dir, loop):
    """First three sampled tokens against the exact target distribution (chi-square), as the
    CPU test in test_scheduler.py."""
    from distributions import chi_square_pvalue, exact_first_tokens

    from swiftspec.model_executor.models import load_model

    params = dict(temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True)
    exact = exact_first_tokens(load_model(tiny_dir, device="cuda"), PROMPT, params, device="cuda")
    target, draft = _states(tiny_dir, streams=loop == "colocated", w=2, topk=2, bs=4)
    counts = Counter()
    for seed in range(1000):
        out, _ = _run(getattr(tree_loops, f"run_{loop}"), draft, target,
                      Request(PROMPT, SamplingParams(**params, seed=seed), 3, (), 1, False))
        counts[tuple(out)] += 1
    assert chi_square_pvalue(counts, exact) > 1e-3


@pytest.fixture(scope="module")
def cuda_reference(tiny_dir):
    with Engine(tiny_dir, mode="autoregressive", dtype="float32", device="cuda") as eng:
        return eng.generate("hello world, this is a test", GREEDY)


@pytest.mark.parametrize("mode,draft_sms", [("auto", None), ("serial", None), ("colocated", None),
                                            pytest.param("colocated", DRAFT_SMS, marks=needs_green)])
def test_engine_on_one_gpu(tiny_dir, cuda_reference, mode, draft_sms):
    """draft_sms: the colocated draft on an SM partition (its decode steps' CUDA graphs captured on
    its green-context stream)."""
    with Engine(tiny_dir, tiny_dir, mode=mode, dtype="float32", device="cuda", target_devices=[0],
                draft_sms=draft_sms) as eng:
        # auto on one GPU without a profile of it: autoregressive (docs/gpu.md)
        assert eng.config.mode == ("autoregressive" if mode == "auto" else mode)
        out = eng.generate("hello world, this is a test", GREEDY)
    assert out.token_ids == cuda_reference.token_ids
    assert out.metrics.compression_ratio > (1.5 if mode != "auto" else 0.99)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_engine_async_and_tp_on_two_gpus(tiny_dir, cuda_reference):
    with Engine(tiny_dir, tiny_dir, mode="async", dtype="float32", device="cuda") as eng:
        assert eng.generate("hello world, this is a test", GREEDY).token_ids == cuda_reference.token_ids
    with Engine(tiny_dir, mode="autoregressive", dtype="float32", device="cuda", target_devices=[0, 1]) as eng:
        assert eng.generate("hello world, this is a test", GREEDY).token_ids == cuda_reference.token_ids


@pytest.mark.parametrize("mode", ["serial", "colocated"])
def test_engine_graph_replay_equals_eager(tiny_dir, cuda_reference, mode):
    """Decode steps replayed from CUDA graphs (the default) and run eagerly give the same tokens."""
    outs = {}
    for graphs in (True, False):
        with Engine(tiny_dir, tiny_dir, mode=mode, dtype="float32", device="cuda", target_devices=[0],
                    cuda_graphs=graphs) as eng:
            outs[graphs] = eng.generate("hello world, this is a test", GREEDY).token_ids
    assert outs[True] == outs[False] == cuda_reference.token_ids
