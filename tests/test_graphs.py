"""Fixed-shape steps for CUDA graphs: padding to bucket sizes and to the cache capacity changes
nothing for the real rows, on CPU (eager twin) and, wherever CUDA exists, with captured graphs."""
import pytest
import torch

from swiftspec import ops
from swiftspec.model_executor.graphs import PaddedStep
from swiftspec.model_executor.models.llama import load_model

CAP = 48


def _tree_inputs():
    """A 5-token prefix, then a 3-node tree step (non-square mask over prefix + tree)."""
    ids = torch.tensor([7, 9, 11])
    pos = torch.tensor([5, 6, 6])
    slots = torch.tensor([5, 6, 7])
    mask = torch.zeros(3, 8, dtype=torch.bool)
    mask[:, :5] = True
    mask[0, 5] = True
    mask[1, [5, 6]] = True
    mask[2, [5, 7]] = True
    return ids, pos, slots, mask


def _run(model, step_fn, kv):
    dev = kv.buf.device  # the prefill goes straight to the model, so it must be on the cache's device
    prefix = torch.tensor([3, 4, 5, 6, 8], device=dev)
    causal = torch.ones(5, 5, dtype=torch.bool, device=dev).tril()
    model(prefix, torch.arange(5, device=dev), torch.arange(5, device=dev), causal, kv)
    return step_fn(*_tree_inputs())


@pytest.mark.parametrize("kernels", [True, False])
def test_padded_step_equals_direct_forward(tiny_dir, kernels):
    ops.set_kernels(kernels)
    try:
        model = load_model(str(tiny_dir), dtype=torch.float32)
        kv_direct, kv_padded = model.make_kv_cache(CAP), model.make_kv_cache(CAP)
        direct = _run(model, lambda *a: model(*a, kv_direct), kv_direct)
        step = PaddedStep(lambda i, p, s, m, n: model(i, p, s, m, kv_padded, n), sizes=[4, 8], capacity=CAP)
        padded = _run(model, step, kv_padded)
        assert step.bucket(3) == 4 and step.bucket(9) is None
        assert padded.shape == direct.shape
        assert torch.allclose(padded, direct, atol=1e-5)
        assert torch.allclose(kv_padded.buf, kv_direct.buf, atol=1e-5)  # batch size changes GEMM rounding
    finally:
        ops.set_kernels(True)


def test_padded_step_rejects_bad_input():
    with pytest.raises(ValueError):
        PaddedStep(lambda *a: None, sizes=[], capacity=8)
    step = PaddedStep(lambda *a: None, sizes=[2], capacity=8)
    with pytest.raises(ValueError, match="slots"):
        step(torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long),
             torch.ones(1, 9, dtype=torch.bool))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (runs wherever CUDA is present)")
def test_cuda_graph_replay_equals_eager(tiny_dir):
    dev = torch.device("cuda")
    model = load_model(str(tiny_dir), dtype=torch.float32).to(dev)
    kv_eager, kv_graph = model.make_kv_cache(CAP, dev), model.make_kv_cache(CAP, dev)
    to = (lambda f: (lambda *a: f(*(t.to(dev) for t in a))))
    eager = _run(model, to(lambda *a: model(*a, kv_eager)), kv_eager)
    step = PaddedStep(lambda i, p, s, m, n: model(i, p, s, m, kv_graph, n), sizes=[4], capacity=CAP, device=dev)
    graphed = _run(model, to(step), kv_graph)
    again = to(step)(*_tree_inputs())  # replay with the same inputs
    assert step.replays == 2
    assert torch.allclose(graphed, eager, atol=1e-4) and torch.allclose(again, eager, atol=1e-4)
