"""The decoding loops in one process: losslessness, full acceptance, no KV recomputation, and the
sampled distribution (SwiftSpec paper §3.1; the three checks of the developers' guide)."""
import threading
from collections import Counter
from multiprocessing import Pipe

import pytest
import torch

from swiftspec.model_executor.runner import ModelRunner, RunnerHandle
from swiftspec.model_executor.sampling import Sampler, SamplingParams
from swiftspec.spec_decode import async_loops, target_loops, tree_loops
from swiftspec.spec_decode.draft_state import DraftState, TreeParams
from swiftspec.spec_decode.scheduler import Request
from swiftspec.spec_decode.target_state import TargetState
from swiftspec.spec_decode.tree import DraftTree

PROMPT = [3, 40, 41, 42, 50, 60, 70, 33, 34, 35]


def _target(model_dir):
    return TargetState(RunnerHandle("target", ModelRunner(str(model_dir), capacity=512), []))


def _draft(model_dir, **kw):
    return DraftState(RunnerHandle("draft", ModelRunner(str(model_dir), capacity=1024), []), TreeParams(**kw))


def _collect(logprobs: list | None = None):
    out = []

    def emit(toks, t, lps=()):
        out.extend(toks)
        assert len(lps) in (0, len(toks))
        if logprobs is not None:
            logprobs.extend(lps)
    return out, emit


def _req(n=40, params=None, d=None, trace=False):
    return Request(PROMPT, params or SamplingParams(max_tokens=n, ignore_eos=True), n, (2,), d, trace)


def run_async_threads(draft, target, req):
    """Both async loops, each in its own thread, over a real pipe."""
    a, b = Pipe()
    out, emit = _collect()
    res = {}
    th = threading.Thread(target=lambda: res.setdefault("draft", async_loops.run_async_draft(draft, req, b)))
    th.start()
    res["target"] = async_loops.run_async_target(target, req, a, emit)
    th.join(timeout=60)
    assert not th.is_alive()
    return out, res["target"], res["draft"]


@pytest.fixture(scope="module")
def greedy_reference(tiny_dir):
    out, emit = _collect()
    st = target_loops.run_autoregressive(_target(tiny_dir), _req(), emit)
    assert st.accepted == [0] * 39 and len(out) == 40
    return out


@pytest.mark.parametrize("d", [1, 2, 4])
def test_serial_greedy_equals_autoregressive(tiny_dir, tiny_draft_dir, greedy_reference, d):
    out, emit = _collect()
    draft = _draft(tiny_draft_dir)
    draft.debug = True
    st = tree_loops.run_serial(draft, _target(tiny_dir), _req(d=d), emit)
    assert out == greedy_reference
    assert sum(st.accepted) > 0, "a near-copy draft should get some tokens accepted"


def test_logprobs_are_the_targets_own_in_every_mode(tiny_dir, tiny_draft_dir, greedy_reference):
    """A verified token's log-probability and its alternatives come from the target's logits at
    that position: serial (tree rows) and async give autoregressive's tokens and values (this
    float model runs torch's GEMMs, whose sums depend on the row count: equal within 1e-5; on
    native weights they are bit-identical, tests/test_real_models.py); the greedy token is the
    first alternative; without the option, none."""
    params = SamplingParams(max_tokens=40, ignore_eos=True, logprobs=3)
    runs = {}
    for mode in ("autoregressive", "serial", "async"):
        lps: list = []
        out, emit = _collect(lps)
        req = _req(params=params, d=2)
        if mode == "autoregressive":
            target_loops.run_autoregressive(_target(tiny_dir), req, emit)
        elif mode == "serial":
            tree_loops.run_serial(_draft(tiny_draft_dir), _target(tiny_dir), req, emit)
        else:
            a, b = Pipe()
            th = threading.Thread(target=async_loops.run_async_draft, args=(_draft(tiny_draft_dir), req, b))
            th.start()
            async_loops.run_async_target(_target(tiny_dir), req, a, emit)
            th.join()
        assert out == greedy_reference and [lp.token_id for lp in lps] == out
        runs[mode] = lps
    ref = runs["autoregressive"]
    for mode in ("serial", "async"):
        for a, b in zip(runs[mode], ref, strict=True):
            assert a.token_id == b.token_id and [t for t, _ in a.top] == [t for t, _ in b.top]
            assert abs(a.logprob - b.logprob) < 1e-5
            assert max(abs(x - y) for (_, x), (_, y) in zip(a.top, b.top)) < 1e-5
    for lp in runs["autoregressive"]:
        assert len(lp.top) == 3 and lp.top[0] == (lp.token_id, lp.logprob) and lp.logprob <= 0.0
        assert lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]
        assert sum(torch.tensor([v for _, v in lp.top]).exp()) <= 1.0 + 1e-6
    plain: list = []
    target_loops.run_autoregressive(_target(tiny_dir), _req(), _collect(plain)[1])
    assert plain == []


def test_logprob_values_are_log_softmax_of_the_target_logits():
    logits = torch.tensor([1.0, 3.0, 3.0, -2.0])
    lp = Sampler(SamplingParams(logprobs=2)).logprob(logits, 3)
    ref = torch.log_softmax(logits, -1)
    assert lp.token_id == 3 and lp.logprob == float(ref[3])
    assert lp.top == ((1, float(ref[1])), (2, float(ref[2])))  # ties: lower id first
    assert Sampler(SamplingParams(logprobs=0)).logprob(logits, 0).top == ()
    for bad in (-1, 21, 1.5, True):
        with pytest.raises(ValueError, match="logprobs"):
            SamplingParams(logprobs=bad)


@pytest.mark.parametrize("d", [None, 1, 3])
def test_async_greedy_equals_autoregressive(tiny_dir, tiny_draft_dir, greedy_reference, d):
    draft = _draft(tiny_draft_dir)
    draft.debug = True
    out, tst, dst = run_async_threads(draft, _target(tiny_dir), _req(d=d))
    assert out == greedy_reference
    assert dst.expansions > 0 and tst.verifications == len(tst.accepted)


@pytest.fixture
def slow_device(monkeypatch):
    """A device where each launched forward reports busy for its first ``polls[0]`` done() polls
    (a GPU still verifying), so the colocated loop expands between launch and accept on CPU."""
    from swiftspec.model_executor.runner import Launched

    polls = [0]
    real = Launched.done

    def done(self):
        self._polls = getattr(self, "_polls", 0) + 1
        return self._polls > polls[0] and real(self)

    monkeypatch.setattr(Launched, "done", done)
    return polls


@pytest.mark.parametrize("polls,d", [(0, None), (2, None), (5, None), (5, 2)])
def test_colocated_greedy_equals_autoregressive(tiny_dir, tiny_draft_dir, greedy_reference, slow_device, polls, d):
    """Algorithm 1 in one process: expansions overlapping each verification (as many as the
    verification lasts, at most d), then re-root: the target's own greedy output."""
    slow_device[0] = polls
    draft = _draft(tiny_draft_dir)
    draft.debug = True
    out, emit = _collect()
    st = tree_loops.run_colocated(draft, _target(tiny_dir), _req(d=d), emit)
    assert out == greedy_reference
    assert sum(st.accepted) > 0 and st.verifications == len(st.accepted)
    # fill() alone makes one expansion per iteration here (bs 8 needs it); overlap adds more
    per_iteration = draft.expansions / st.verifications
    assert per_iteration > 1.5 if polls else per_iteration < 1.5


def _greedy_chain(sg):
    """Length of the chain of most probable children (by draft weight) inside the subgraph."""
    node, n = 0, 0
    while True:
        kids = [i for i, p in enumerate(sg.parents) if p == node]
        if not kids:
            return n
        node = max(kids, key=lambda i: sg.weights[i])
        n += 1


@pytest.mark.parametrize("mode", ["serial", "async", "colocated"])
def test_identical_draft_accepts_whole_greedy_chain(tiny_dir, greedy_reference, slow_device, mode):
    target, draft = _target(tiny_dir), _draft(tiny_dir)
    req = _req(trace=True, d=3)
    slow_device[0] = 3
    if mode in ("serial", "colocated"):
        out, emit = _collect()
        st = getattr(tree_loops, f"run_{mode}")(draft, target, req, emit)
    else:
        out, st, _ = run_async_threads(draft, target, req)
    assert out == greedy_reference
    budget_cut = len(st.trace) - 1  # the last verification may be cut by max_tokens
    for i, it in enumerate(st.trace[:budget_cut]):
        assert len(it["accepted"]) == _greedy_chain(it["subgraph"]), f"iteration {i}"
    # the root's most probable child is the heaviest node, so it is always sent and accepted
    assert min(st.accepted[:budget_cut]) >= 1


def test_no_surviving_kv_is_recomputed(tiny_dir, tiny_draft_dir, monkeypatch):
    """Every draft KV entry is computed for a distinct context (prompt + path): nothing twice."""
    seq = list(PROMPT)
    computed = Counter()
    orig = DraftTree.plan_expansion

    def plan(self, width):
        exp = orig(self, width)
        if exp.catch_up:
            for p in exp.positions.tolist():
                computed[tuple(seq[:p + 1])] += 1
        else:
            root_ctx = tuple(seq[:self.root_position + 1])
            for nid in exp.nodes:
                path = []
                while nid != self.root:
                    path.append(self.nodes[nid].token)
                    nid = self.nodes[nid].parent
                computed[root_ctx + tuple(reversed(path))] += 1
        return exp

    monkeypatch.setattr(DraftTree, "plan_expansion", plan)
    draft = _draft(tiny_draft_dir)
    forward_tokens = []
    real_launch = draft.runner.runner.launch

    def counting_launch(ids, *a):
        forward_tokens.append(int(ids.numel()))
        return real_launch(ids, *a)

    monkeypatch.setattr(draft.runner.runner, "launch", counting_launch)
    emit = lambda toks, t, lps=(): seq.extend(toks)  # noqa: E731
    tree_loops.run_serial(draft, _target(tiny_dir), _req(n=60, d=2), emit)
    assert computed and max(computed.values()) == 1
    # every token the draft ran is either the prompt or one of those distinct contexts
    assert sum(forward_tokens) == len(PROMPT) + sum(computed.values())
    assert draft.reused_kv > 0


@pytest.mark.parametrize("mode", ["serial", "colocated"])
def test_sampled_output_follows_target_distribution(tiny_dir, slow_device, mode):
    """Joint distribution of the first three tokens (t0 from prefill, t1 and t2 from one
    verification walk) against the exact target distribution: chi-square test."""
    from distributions import chi_square_pvalue, exact_first_tokens

    from swiftspec.model_executor.models import load_model

    params = dict(temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True)
    exact = exact_first_tokens(load_model(tiny_dir), PROMPT, params)
    target, draft = _target(tiny_dir), _draft(tiny_dir, w=2, topk=2, bs=4)
    n = 1500
    counts = Counter()
    accepted_any = 0
    slow_device[0] = 1
    run = getattr(tree_loops, f"run_{mode}")
    for seed in range(n):
        out, emit = _collect()
        st = run(draft, target, Request(PROMPT, SamplingParams(**params, seed=seed), 3, (), 1), emit)
        counts[tuple(out)] += 1
        accepted_any += sum(st.accepted) > 0
    assert chi_square_pvalue(counts, exact) > 1e-3
    assert accepted_any > n // 4, "the walk must descend into the tree, not only sample bonus tokens"


def test_runner_heads_are_the_host_reductions(tiny_dir):
    """The reductions the runner returns instead of logits (greedy tokens for the target, the
    draft's top-k) are bit for bit the host's reductions of its logits; the walk on argmax rows
    equals the walk on logits, and refuses them for a sampled request or one with logprobs."""
    from swiftspec.spec_decode.verify import target_head, walk

    runner = ModelRunner(str(tiny_dir), capacity=64)
    n = len(PROMPT)
    args = (torch.tensor(PROMPT), torch.arange(n), torch.arange(n), torch.ones(n, n, dtype=torch.bool).tril(),
            torch.arange(n))
    logits = runner.forward(*args)
    for head in ("argmax", 3):
        got = runner.forward(*args, head)
        if head == "argmax":
            assert got.dtype == torch.int64 and torch.equal(got, logits.argmax(-1))
        else:
            vals, ids = torch.log_softmax(logits, -1).topk(3, dim=-1)
            assert torch.equal(got[0], vals) and torch.equal(got[1], ids)
    tokens, parents, depths = PROMPT[:4], [-1, 0, 1, 1], [0, 1, 2, 2]
    greedy = Sampler(SamplingParams())
    assert walk(tokens, parents, logits[:4].argmax(-1), greedy) == walk(tokens, parents, logits[:4], greedy)
    # sampled where the model runs: each row with the uniform of its position, so the walk emits
    # what the host's sequential sampling emits, and the request's position advances the same
    for seed in range(20):
        params = SamplingParams(temperature=1.0 + seed % 3, top_p=0.9 if seed % 2 else 1.0,
                                top_k=5 if seed % 4 == 1 else 0, seed=seed)
        host, device = Sampler(params), Sampler(params)
        for _ in range(seed % 3):  # a request some tokens in
            host.sample(logits[0])
            device.sample(logits[0])
        head = target_head(device, depths)
        rows = runner.forward(*args[:4], torch.arange(4), head)
        assert rows.dtype == torch.int64 and rows.shape == (4,)
        assert walk(tokens, parents, rows, device) == walk(tokens, parents, logits[:4], host)
        assert device.position == host.position
    with pytest.raises(ValueError, match="token rows"):
        walk(tokens, parents, logits[:4].argmax(-1), Sampler(SamplingParams(logprobs=1)))


def test_sample_rows_is_the_sequential_inverse_cdf():
    """The batched sampler (the device path) draws, per row, the token the one-row inverse CDF
    draws with the same uniform: temperature, top-k, top-p, and uniforms on the edge of a
    zero-mass run (top-p zeroes the tail) included."""
    from swiftspec.model_executor.sampling import filtered_probs, sample_rows

    def one(row, params, u):  # the sequential reference: scan the float64 CDF
        probs = filtered_probs(row[None], params)[0].double()
        cdf, target = probs.cumsum(0), u * probs.sum()
        idx = next((i for i, c in enumerate(cdf.tolist()) if c > target), len(cdf) - 1)
        while probs[idx] == 0:
            idx -= 1
        return idx

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=gen) * 3
    for params in (SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, top_k=4),
                   SamplingParams(temperature=1.3, top_p=0.5), SamplingParams(temperature=1.0, top_k=10, top_p=0.8)):
        for u in (torch.rand(6, generator=gen, dtype=torch.float64), torch.full((6,), 0.999999999),
                  torch.zeros(6, dtype=torch.float64)):
            got = sample_rows(logits, params, u)
            assert got.tolist() == [one(logits[i], params, float(u[i])) for i in range(6)], params


def test_staging_buffer_packs_a_step_into_one_copy():
    """The step inputs (any shapes and dtypes, empty ones included) come out equal, in order,
    as views of one buffer, which grows for a bigger step and is reused for a smaller one (the
    CUDA runner's path, here on the host: nothing pinned, the same packing)."""
    from swiftspec.model_executor.runner import StagingBuffer

    buf = StagingBuffer(torch.device("cpu"))
    for n, width in ((3, 10), (40, 700), (2, 5)):
        step = (torch.randint(0, 9, (n,)), torch.arange(n), torch.arange(n) * 7, torch.rand(n, width) > 0.5,
                torch.empty(0, dtype=torch.long), torch.randn(n, 3))
        out = buf.to_device(*step)
        assert all(o.dtype == t.dtype and o.shape == t.shape and torch.equal(o, t) for o, t in zip(out, step))
        assert all(o.untyped_storage().data_ptr() == buf.dev.untyped_storage().data_ptr() for o in out)
    assert buf.dev.numel() >= 40 * 700


@pytest.mark.parametrize("loop", ["serial", "colocated"])
def test_decode_steps_padded_to_graph_buckets_stay_lossless(tiny_dir, tiny_draft_dir, greedy_reference, loop,
                                                            monkeypatch):
    """Decode steps padded to CUDA-graph buckets (the CUDA runner replays them from graphs; on
    CPU the same padded step runs eagerly): the padding rows and mask columns change nothing,
    the prefill (bigger than every bucket) runs as it is."""
    from swiftspec.engine.worker import graph_buckets
    from swiftspec.model_executor.graphs import PaddedStep

    padded = Counter()
    fill = PaddedStep._fill
    monkeypatch.setattr(PaddedStep, "_fill", lambda self, n, *a: padded.update([self.bucket(n)]) or fill(self, n, *a))

    assert graph_buckets(8) == [1, 2, 4, 8] and graph_buckets(5) == [1, 2, 4, 8] and graph_buckets(1) == [1]
    target = TargetState(RunnerHandle("target", ModelRunner(str(tiny_dir), capacity=512,
                                                            graph_sizes=graph_buckets(8)), []))
    draft = DraftState(RunnerHandle("draft", ModelRunner(str(tiny_draft_dir), capacity=1024,
                                                         graph_sizes=graph_buckets(16)), []), TreeParams())
    out, emit = _collect()
    st = getattr(tree_loops, f"run_{loop}")(draft, target, _req(d=2), emit)
    assert out == greedy_reference and sum(st.accepted) > 0
    assert target.runner.runner.step.sizes == [1, 2, 4, 8]
    assert sum(padded.values()) >= st.verifications + draft.expansions and set(padded) <= {1, 2, 4, 8, 16}
