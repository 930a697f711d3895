"""Pipeline stages and the pipeline modes (swiftspec.pipeline.stages, swiftspec.pipeline.decode): the
layer split, a staged forward bit-identical to the whole model, greedy output of pipedec and
pipeinfer equal to autoregressive with 2 and 3 stages, the sampled distribution, pruning and
cancellation without recomputation, a dying stage."""
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter

import pytest
import torch
from conftest import pid_alive, raises_within

from swiftspec import Engine, SamplingParams, WorkerError
from swiftspec.distributed.rendezvous import TOKEN_ENV
from swiftspec.engine.config import EngineConfig
from swiftspec.engine.mode_selection import choose_mode
from swiftspec.model_executor.models.llama import load_model
from swiftspec.pipeline.partition import checkpoint_layer_bytes, partition_layers

PROMPT = "hello world, this is a test"
GREEDY = SamplingParams(max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def target3(tmp_path_factory):
    from conftest import build_tiny_model
    return build_tiny_model(tmp_path_factory.mktemp("tiny-3-layers"), "qwen2", seed=4, layers=3)


@pytest.fixture(scope="module")
def draft3(tmp_path_factory, target3):
    """Mostly agrees with the target: hits, misses and pruning all happen."""
    from conftest import build_tiny_model
    return build_tiny_model(tmp_path_factory.mktemp("tiny-3-draft"), "qwen2", seed=5, layers=3,
                            perturb_from=target3, perturb=0.08)


@pytest.fixture(scope="module")
def reference(target3):
    with Engine(target3, mode="autoregressive", dtype="float32") as eng:
        return eng.generate(PROMPT, GREEDY)


def test_partition_layers():
    assert partition_layers([1] * 4, 2) == [range(0, 2), range(2, 4)]
    assert partition_layers([1] * 4, 2, head_bytes=2) == [range(0, 3), range(3, 4)]  # the LM head weighs
    assert partition_layers([5, 1, 1, 1, 1, 1], 2) == [range(0, 1), range(1, 6)]
    assert partition_layers([1, 2, 3], 3) == [range(0, 1), range(1, 2), range(2, 3)]
    with pytest.raises(ValueError):
        partition_layers([1, 1], 3)


def test_checkpoint_layer_bytes(target3):
    layers, head = checkpoint_layer_bytes(target3, 3)
    model = load_model(target3)
    per_layer = sum(p.numel() * 4 for p in model.layers[0].parameters())
    assert layers == [per_layer] * 3
    assert head == model.embed_tokens.weight.numel() * 4  # tied: the LM head reads the embedding


def test_model_digest(target3, tmp_path):
    import shutil

    from swiftspec.pipeline.membership import model_digest

    copy = shutil.copytree(target3, tmp_path / "copy")
    first = model_digest(copy)
    assert (copy / ".swiftspec-digest.json").is_file() and model_digest(copy) == first  # cached
    cfg = (copy / "config.json").read_text()
    (copy / "config.json").write_text(cfg.replace("}", ', "x": 1}', 1))
    assert model_digest(copy) != first


@pytest.mark.parametrize("cuts", [[0, 1, 3], [0, 2, 3], [0, 1, 2, 3]])
def test_staged_forward_equals_whole_model(target3, cuts):
    full = load_model(target3)
    n = 9
    ids, pos = torch.tensor([3, 4, 5, 6, 8, 9, 10, 11, 12]), torch.arange(n)
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    ref = full(ids, pos, pos, mask, full.make_kv_cache(16))
    x, residual = ids, None
    for a, b in zip(cuts, cuts[1:]):
        part = load_model(target3, stage=range(a, b))
        assert (part.embed_tokens is not None) == (a == 0 or b == 3) and (part.lm_head is not None) == (b == 3)
        assert part.make_kv_cache(4).buf.shape[0] == b - a
        x, residual = part.forward_stage(x, residual, pos, pos, mask, part.make_kv_cache(16))
    assert residual is None and torch.equal(x, ref)
    with pytest.raises(ValueError, match="non-empty range"):
        load_model(target3, stage=range(2, 5))


def test_pipeline_config_errors():
    with pytest.raises(ValueError, match="pipeline_order"):
        EngineConfig(mode="pipedec", pipeline_stages=2, pipeline_order="depth")
    with pytest.raises(ValueError, match="need pipeline_stages >= 2"):
        EngineConfig(mode="pipedec")
    with pytest.raises(ValueError, match="need pipeline_stages >= 2"):
        EngineConfig(mode="serial", pipeline_stages=2)
    with pytest.raises(ValueError, match="TP = 1"):
        EngineConfig(mode="pipedec", pipeline_stages=2, target_tp=2)
    assert choose_mode(EngineConfig(pipeline_stages=3))[0] == "pipedec"


@pytest.mark.parametrize("stages", [2, 3])
def test_pipeline_modes_equal_autoregressive(target3, draft3, reference, stages):
    with Engine(target3, mode="pipeline-autoregressive", dtype="float32", pipeline_stages=stages) as eng:
        out = eng.generate(PROMPT, GREEDY)
        assert out.token_ids == reference.token_ids and out.text == reference.text
        t = out.metrics.target
        assert t["timesteps"] == stages * 40 and t["pruned"] == 0  # one token crosses every stage in turn
        assert [s["layers"] for s in t["stages"]] == [[r.start, r.stop] for r in partition_layers([1] * 3, stages, 1)]
    for mode, extra in (("pipedec", {}), ("pipedec", {"pipeline_order": "score"}), ("pipeinfer", {})):
        with Engine(target3, draft3, mode=mode, dtype="float32", pipeline_stages=stages, w=3, topk=2, **extra) as eng:
            for _ in range(2):  # a second request on the same stages (their KV is simply overwritten)
                out = eng.generate(PROMPT, GREEDY)
                assert out.token_ids == reference.token_ids, mode
            t = out.metrics.target
            hits = out.metrics.accepted_hist.get(1, 0)
            assert hits > 0 and out.metrics.accepted_hist.get(0, 0) > 0, "the draft must both hit and miss"
            assert t["pruned"] > 0 and t["timesteps"] < stages * 40
            # no KV entry is computed twice: stage 0 ran the prompt and every issued node once
            assert t["forward_tokens"] == len(eng.encode(PROMPT)) + t["issued"]
            assert sum(s["cancelled_rows"] for s in t["stages"]) == t["pruned"] + t["drained"]


@pytest.mark.parametrize("mode,steps", [("pipedec", 3 + 2 + 39),  # prefill, the first root, then a token a step
                                        ("pipeinfer", 3 + 2 + 20)])  # then a run of 2 tokens a step
def test_identical_draft_hits_every_node(target3, reference, mode, steps):
    # the draft unquantized and one child per node: the tree is the target's own greedy chain
    with Engine(target3, target3, mode=mode, dtype="float32", pipeline_stages=3, w=2, topk=1,
                draft_quant="none") as eng:
        out = eng.generate(PROMPT, GREEDY)
    assert out.token_ids == reference.token_ids
    assert out.metrics.accepted_hist == {1: 39}  # every token after the first was already in flight
    assert out.metrics.target["timesteps"] == steps


@pytest.mark.parametrize("mode,order", [("pipedec", "layer"), ("pipedec", "score"), ("pipeinfer", "layer")])
def test_sampling_follows_target_distribution(target3, draft3, mode, order):
    """Joint distribution of the first three sampled tokens against the exact target
    distribution (chi-square), with a draft that often proposes the sampled token.

    400 draws: the float32 draft's top-3 triples all lie outside the target's, so a draw from the
    draft fails the support check at any n; at alpha 1e-3 a simulation of this statistic rejects
    a 50/50 mix with the uniform law on the target's triples with power 0.999 (0.94 at 200), one
    uniform reused at all three positions mixed in at 25% with 0.999 (0.98 at 300) and the
    target's law squared and renormalized with 1.0; a 25% uniform mix only with 0.62 (0.82 at 600)."""
    from distributions import chi_square_pvalue, exact_first_tokens

    params = dict(temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True)
    with Engine(target3, draft3, mode=mode, dtype="float32", pipeline_stages=2, w=3, topk=3,
                pipeline_order=order) as eng:
        prompt = eng.encode(PROMPT)
        exact = exact_first_tokens(load_model(target3), prompt, params)
        n, counts, hits = 400, Counter(), 0
        for seed in range(n):
            out = eng.generate(prompt, SamplingParams(**params, seed=seed))
            counts[tuple(out.token_ids)] += 1
            hits += out.metrics.accepted_hist.get(1, 0)
    assert chi_square_pvalue(counts, exact) > 1e-3
    assert hits > n // 5, "sampled tokens must often be found in the tree"


@pytest.mark.parametrize("mode", ["pipedec", "pipeinfer"])
def test_dead_stage_raises_quickly(target3, draft3, mode):
    eng = Engine(target3, draft3, mode=mode, dtype="float32", pipeline_stages=3, max_model_len=2048)
    pids = eng.pids
    it = eng.stream(PROMPT, SamplingParams(max_tokens=1500, ignore_eos=True))
    next(it)
    os.kill(pids[2], signal.SIGKILL)
    raises_within(it, "swiftspec-stage-2 .* died")
    time.sleep(0.3)
    for p in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(p, 0)


TOKEN = "test-pipeline-secret-0123456789"


@pytest.fixture
def token(monkeypatch):
    """The shared secret of the engine's stages (they inherit the environment)."""
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    return TOKEN


def _remote_stage(target, port: int, token: str = TOKEN):
    """A stage in a separate process tree, as `swiftspec worker` runs it on another host."""
    return subprocess.Popen([sys.executable, "-m", "swiftspec", "worker", "--stage", "1", "--stages", "2",
                             "--master-addr", "127.0.0.1", "--master-port", str(port), "--target", str(target),
                             "--timeout", "120"], stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, TOKEN_ENV: token})


def test_two_hosts_joined_over_tcp(target3, draft3, reference, token):
    """Stage 1 in its own process tree joins stage 0 by TCP rendezvous; the output is unchanged;
    killing either side, or freezing the remote one (a host gone without closing its sockets),
    makes the other raise (or exit) within 10 s, naming the lost stage; no process is left."""
    from swiftspec.distributed.parallel import free_tcp_port

    port = free_tcp_port()
    remote = _remote_stage(target3, port)
    try:
        with Engine(target3, draft3, mode="pipeinfer", dtype="float32", pipeline_stages=2, remote_stages=[1],
                    master_port=port, max_model_len=2048) as eng:
            assert len(eng.pids) == 1  # stage 1 is not the engine's process
            assert eng.generate(PROMPT, GREEDY).token_ids == reference.token_ids
        rc = remote.wait(timeout=10)
        assert rc == 0, remote.stderr.read()  # the engine's close ends the remote stage, cleanly
    finally:
        remote.kill()

    # the remote stage dies mid-generation, or its host "goes away" (frozen: its sockets stay open,
    # nothing arrives, its heartbeat stops): the engine raises within 10 s, naming it
    for sig, why in ((signal.SIGKILL, "stage 1 on host"), (signal.SIGSTOP, "stage 1 on host .* stopped responding")):
        remote, eng, it = _remote_pair_streaming(target3, draft3, port)
        try:
            pids = eng.pids
            os.killpg(remote.pid, sig)
            raises_within(it, why)
            time.sleep(0.3)
            assert not [p for p in pids if pid_alive(p)]
        finally:
            remote.kill()

    # stage 0 (the engine's host) dies: the remote stage exits within 10 s, naming it
    remote, eng, it = _remote_pair_streaming(target3, draft3, port)
    try:
        os.kill(eng.pids[0], signal.SIGKILL)
        t0 = time.monotonic()
        assert remote.wait(timeout=10) == 1
        assert time.monotonic() - t0 < 10
        assert "stage 0 on host" in remote.stderr.read()
        with pytest.raises(WorkerError):
            for _ in it:
                pass
    finally:
        remote.kill()


def _remote_pair_streaming(target, draft, port: int):
    """A remote stage 1, the engine with stage 0, and a long stream that has started."""
    remote = _remote_stage(target, port)
    eng = Engine(target, draft, mode="pipeinfer", dtype="float32", pipeline_stages=2, remote_stages=[1],
                 master_port=port, max_model_len=2048)
    it = eng.stream(PROMPT, SamplingParams(max_tokens=1500, ignore_eos=True))
    next(it)
    return remote, eng, it


def test_peer_without_the_secret_cannot_join_or_disturb(target3, draft3, reference, token):
    """A stage with another secret is refused with a clear error while the right one joins; a
    stranger hammering the heartbeat keys it can name (set, delete) for longer than the heartbeat
    limit changes nothing; the secret-less `swiftspec worker` refuses to start."""
    from datetime import timedelta

    import torch.distributed as dist

    from swiftspec.distributed.parallel import free_tcp_port
    from swiftspec.distributed.rendezvous import token_prefix
    from swiftspec.pipeline.membership import HEARTBEAT_LIMIT_S

    port = free_tcp_port()
    intruder = _remote_stage(target3, port, token="not-the-secret-0123456789")
    remote = _remote_stage(target3, port)
    try:
        with Engine(target3, draft3, mode="pipeinfer", dtype="float32", pipeline_stages=2, remote_stages=[1],
                    master_port=port, max_model_len=2048) as eng:
            assert intruder.wait(timeout=30) == 1
            assert "refused this stage" in intruder.stderr.read()
            raw = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
            guesses = [raw, dist.PrefixStore(token_prefix("not-the-secret-0123456789"), raw)]
            t_end = time.monotonic() + HEARTBEAT_LIMIT_S + 1
            while time.monotonic() < t_end:
                for store in guesses:
                    for r in (0, 1):
                        store.set(f"hb/{r}", "0")
                        store.delete_key(f"hb/{r}")
                assert eng.generate(PROMPT, SamplingParams(max_tokens=4, ignore_eos=True)).token_ids == \
                    reference.token_ids[:4]
            assert eng.generate(PROMPT, GREEDY).token_ids == reference.token_ids
        assert remote.wait(timeout=10) == 0, remote.stderr.read()
    finally:
        intruder.kill()
        remote.kill()
    out = subprocess.run([sys.executable, "-m", "swiftspec", "worker", "--stage", "1", "--stages", "2",
                          "--master-addr", "127.0.0.1", "--master-port", str(port), "--target", str(target3)],
                         capture_output=True, text=True, timeout=60, env={k: v for k, v in os.environ.items()
                                                                           if k != TOKEN_ENV})
    assert out.returncode == 2 and TOKEN_ENV in out.stderr
    with pytest.raises(ValueError, match=TOKEN_ENV):
        os.environ.pop(TOKEN_ENV)
        Engine(target3, draft3, mode="pipeinfer", dtype="float32", pipeline_stages=2, remote_stages=[1],
               master_port=port)


def test_remote_stage_config_errors():
    with pytest.raises(ValueError, match="not later stages"):
        EngineConfig(mode="pipedec", pipeline_stages=2, remote_stages=[0], master_port=1234)
    with pytest.raises(ValueError, match="fixed master_port"):
        EngineConfig(mode="pipedec", pipeline_stages=2, remote_stages=[1])


def test_cli_generate_in_a_pipeline_mode(target3, draft3, reference):
    out = subprocess.run([sys.executable, "-m", "swiftspec", "generate", "--target", str(target3), "--draft",
                          str(draft3), "--mode", "pipeinfer", "--pipeline-stages", "2", "--dtype", "float32",
                          "--no-chat", "--prompt", PROMPT, "--max-tokens", "40", "--ignore-eos", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["mode"] == "pipeinfer" and res["token_ids"] == reference.token_ids


def test_tree_slots_exhausted_flush_stays_lossless(target3, reference):
    """A short context fills the tree slots before any miss: the decoder restarts from the verified
    prefix (a flush, compacting its KV) and the output is still the target's."""
    with Engine(target3, target3, mode="pipedec", dtype="float32", pipeline_stages=2, w=2, topk=2,
                draft_quant="none", max_model_len=64) as eng:
        out = eng.generate(PROMPT, GREEDY)
    assert out.token_ids == reference.token_ids[:len(out.token_ids)] and len(out.token_ids) == 40
    assert out.metrics.target["flushes"] > 0
