"""The engine end to end with worker processes, on tiny models: modes, TP, streaming, errors."""
import os
import signal
import time

import pytest
from conftest import pid_alive, raises_within

from swiftspec import Engine, SamplingParams, TokenizerMismatchError, WorkerError
from swiftspec.engine import outputs
from swiftspec.weights.loader import ModelLoadError

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)
PROMPT = "hello world, this is a test"


@pytest.fixture(scope="module")
def reference(tiny_dir):
    with Engine(tiny_dir, mode="autoregressive", dtype="float32", device="cpu") as eng:
        out = eng.generate(PROMPT, GREEDY)
    assert out.metrics.compression_ratio == 1.0 and len(out.token_ids) == 24
    return out


@pytest.mark.parametrize("mode", ["async", "serial", "colocated"])
def test_modes_equal_autoregressive(tiny_dir, tiny_draft_dir, reference, mode):
    with Engine(tiny_dir, tiny_draft_dir, mode=mode, dtype="float32") as eng:
        out = eng.generate(PROMPT, GREEDY)
        pids = eng.pids
    assert out.token_ids == reference.token_ids and out.text == reference.text
    m = out.metrics
    assert m.mode == mode and m.num_tokens == 24 and m.compression_ratio >= 1.0
    assert m.verifications == sum(m.accepted_hist.values())
    assert m.ttft_s > 0 and m.tokens_per_s > 0 and m.tbt_p50_s <= m.tbt_p99_s
    time.sleep(0.2)
    assert not any(pid_alive(p) for p in pids), "close() must leave no process behind"


def test_groups_sharing_a_core(tiny_dir, tiny_draft_dir, reference):
    """Target and draft both on core 0 (the tests' layout, and a 1-CPU machine's): one process with
    one intra-op thread (two would spin-wait for each other on the core), the target's tokens."""
    with Engine(tiny_dir, tiny_draft_dir, mode="serial", dtype="float32", target_cores=[0], draft_cores=[0]) as eng:
        out = eng.generate(PROMPT, GREEDY)
        (w,) = eng.workers
        assert os.sched_getaffinity(w["pid"]) == {0}
    assert w["threads"] == 1 and w["kind"] == "serial"
    assert out.token_ids == reference.token_ids and out.metrics.mode == "serial"


def test_draft_payback_per_request(tiny_dir, tiny_draft_dir, reference):
    """With the gate on (the default under mode="auto"), a serial engine speculates until it has
    measured the draft's prefill (not from its first request), then runs a request whose budget
    cannot pay the draft's prefill back (a long prompt, one token left after the gate's step) on
    the target alone, saying so in its metrics; both are the target's own tokens. The draft is the
    target itself, so its prefill costs about the target's (rho 0.93 here): the decision does not
    hang on how two tiny models' prefill paths happen to compare (with the perturbed copy as the
    draft rho was 0.02-0.03, and in one CI run a one-token budget then paid it back)."""
    long, three = PROMPT * 20, SamplingParams(max_tokens=3, ignore_eos=True)
    with Engine(tiny_dir, tiny_dir, mode="serial", dtype="float32", draft_payback=True) as eng:
        assert eng.config.draft_payback
        eng.generate(PROMPT, GREEDY)
        first = eng.generate(PROMPT, GREEDY)
        short = eng.generate(long, three)
    with Engine(tiny_dir, mode="autoregressive", dtype="float32") as eng:
        ref = eng.generate(long, three)
    assert first.token_ids == reference.token_ids and short.token_ids == ref.token_ids
    assert first.metrics.mode == "serial" and "speculating until" in first.metrics.mode_reason
    assert first.metrics.compression_ratio > 1.0
    m = short.metrics
    assert m.mode == "autoregressive" and "would not pay back within 1 tokens" in m.mode_reason, m.mode_reason
    assert m.compression_ratio == 1.0 and m.draft.get("forwards", 0) == 0
    with Engine(tiny_dir, tiny_draft_dir, mode="serial", dtype="float32") as eng:
        assert not eng.config.draft_payback  # a configured mode: off unless asked for


def test_tensor_parallel_equals_tp1(tiny_dir, tiny_draft_dir, reference):
    """TP = 2 in both groups (4 processes over gloo) gives the TP = 1 greedy output."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs 2 cores")
    with Engine(tiny_dir, mode="autoregressive", dtype="float32", target_tp=2) as eng:
        assert eng.generate(PROMPT, GREEDY).token_ids == reference.token_ids
    with Engine(tiny_dir, tiny_draft_dir, mode="serial", dtype="float32", target_tp=2) as eng:
        assert eng.generate(PROMPT, GREEDY).token_ids == reference.token_ids
    # TP = 3 does not divide the tiny model's 4 query / 2 KV heads: zero-padded heads (processes share cores)
    with Engine(tiny_dir, tiny_draft_dir, mode="async", dtype="float32", target_cores=[0], draft_cores=[1],
                target_tp=3, draft_tp=1) as eng:
        assert eng.generate(PROMPT, GREEDY).token_ids == reference.token_ids


def test_stream_stop_strings_and_chat(tiny_dir, tiny_draft_dir, reference):
    with Engine(tiny_dir, tiny_draft_dir, mode="async", dtype="float32") as eng:
        chunks = list(eng.stream(PROMPT, GREEDY))
        assert chunks[-1].finished and "".join(c.text for c in chunks) == reference.text
        assert len(chunks) > 2
        stop = reference.text[5:7]
        out = eng.generate(PROMPT, SamplingParams(max_tokens=24, ignore_eos=True, stop=[stop]))
        assert out.finish_reason == "stop" and out.text == reference.text[:reference.text.find(stop)]
        # streamed text equals the final text: the start of a stop string is held back until the
        # stop string completes (text cut) or cannot (text released)
        for stop, final in ((stop, out.text), (reference.text[3:5] + "\x01", reference.text)):
            params = SamplingParams(max_tokens=24, ignore_eos=True, stop=[stop])
            assert "".join(c.text for c in eng.stream(PROMPT, params)) == final
        assert outputs._stop_prefix_len("abcx", ("xyz", "cxq")) == 2
        assert outputs._stop_prefix_len("abc", ("zz",)) == 0
        chat = eng.generate([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=4, ignore_eos=True))
        assert len(chat.token_ids) == 4
        sampled = [eng.generate(PROMPT, SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=16,
                                                       ignore_eos=True)).token_ids for _ in range(2)]
        assert sampled[0] == sampled[1], "a seed makes sampling reproducible"


def test_bad_inputs(tiny_dir, tiny_draft_dir, tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        Engine(tmp_path / "nope", tiny_draft_dir)
    for bad in (dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-2), dict(max_tokens=0),
                dict(seed=-1), dict(stop=[""])):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    with pytest.raises(ValueError, match="mode"):
        Engine(tiny_dir, tiny_draft_dir, mode="fast")
    with Engine(tiny_dir, tiny_draft_dir, mode="async", dtype="float32", max_model_len=32) as eng:
        with pytest.raises(ValueError, match="context"):
            eng.generate("x" * 40)
        out = eng.generate("x" * 20, SamplingParams(max_tokens=100, ignore_eos=True))
        assert out.finish_reason == "length" and len(out.token_ids) == 12  # clamped to the context


@pytest.mark.parametrize("mode", ["serial", "async"])
def test_draft_of_a_smaller_vocabulary(tiny_dir, tmp_path, reference, mode):
    """The target emits ids the draft has no embedding for (as Qwen2.5-32B's 152064 rows over its
    0.5B draft's 151936): the request and the workers live, and greedy output is the target's."""
    from conftest import build_tiny_model

    small = build_tiny_model(tmp_path / "small-vocab", "qwen2", seed=1, vocab=98)
    assert max(reference.token_ids) >= 98, "the target's greedy output must leave the draft's vocabulary"
    with Engine(tiny_dir, small, mode=mode, dtype="float32") as eng:
        assert eng.generate(PROMPT, GREEDY).token_ids == reference.token_ids
        assert eng.generate(PROMPT, GREEDY).token_ids == reference.token_ids  # the workers lived on


def test_mismatched_tokenizers(tiny_dir, tmp_path):
    from conftest import build_tiny_model
    from transformers import AutoTokenizer

    other = build_tiny_model(tmp_path / "other", "qwen2", seed=3)
    tok = AutoTokenizer.from_pretrained(other)
    tok.add_tokens(["<extra>"])
    tok.save_pretrained(other)
    with pytest.raises(TokenizerMismatchError):
        Engine(tiny_dir, other, dtype="float32")


@pytest.mark.parametrize("victim", [0, 1])
def test_killed_worker_raises_quickly(tiny_dir, tiny_draft_dir, victim):
    eng = Engine(tiny_dir, tiny_draft_dir, mode="async", dtype="float32")
    pids = eng.pids
    os.kill(pids[victim], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match="died"):
        eng.generate(PROMPT, SamplingParams(max_tokens=2000, ignore_eos=True))
    assert time.monotonic() - t0 < 10
    time.sleep(0.3)
    assert not any(pid_alive(p) for p in pids)
    eng.close()  # idempotent


def test_frozen_worker_is_found_by_the_progress_deadline(tiny_dir):
    """A worker stopped mid-request (SIGSTOP: alive, silent) fails the request with WorkerError
    once the progress deadline passes, and leaves no process behind; a guard resumes the worker
    after a minute, so without the deadline the stream ends normally and the test fails."""
    import threading

    eng = Engine(tiny_dir, mode="autoregressive", dtype="float32", max_model_len=2048, progress_timeout_s=2)
    pids = eng.pids
    it = eng.stream(PROMPT, SamplingParams(max_tokens=1500, ignore_eos=True))
    next(it)
    os.kill(pids[0], signal.SIGSTOP)
    guard = threading.Timer(60, lambda: pid_alive(pids[0]) and os.kill(pids[0], signal.SIGCONT))
    guard.start()
    try:
        with pytest.raises(WorkerError, match="made no progress"):
            for _ in it:
                pass
    finally:
        guard.cancel()
    time.sleep(0.3)
    assert not any(pid_alive(p) for p in pids)
    with pytest.raises(ValueError, match="progress_timeout_s"):
        Engine(tiny_dir, mode="autoregressive", progress_timeout_s=0)


def test_worker_killed_mid_generation(tiny_dir, tiny_draft_dir):
    eng = Engine(tiny_dir, tiny_draft_dir, mode="async", dtype="float32", max_model_len=2048)
    pids = eng.pids
    it = eng.stream(PROMPT, SamplingParams(max_tokens=1500, ignore_eos=True))
    next(it)
    os.kill(pids[1], signal.SIGKILL)
    raises_within(it)
    time.sleep(0.3)
    assert not any(pid_alive(p) for p in pids)


def test_abandoned_stream_is_cancelled(tiny_dir, tiny_draft_dir, reference):
    """A caller that stops reading a stream cancels the request; the next one is unaffected."""
    with Engine(tiny_dir, tiny_draft_dir, mode="async", dtype="float32", max_model_len=2048) as eng:
        it = eng.stream(PROMPT, SamplingParams(max_tokens=1500, ignore_eos=True))
        next(it)
        t0 = time.monotonic()
        it.close()
        assert time.monotonic() - t0 < 10
        assert eng.generate(PROMPT, GREEDY).token_ids == reference.token_ids


def test_auto_mode_follows_a_stored_profile_else_the_measured_rule(tmp_path, monkeypatch):
    from swiftspec.engine import config, machine_profile, mode_selection

    auto = config.EngineConfig()
    assert mode_selection.choose_mode(config.EngineConfig(mode="serial"), True, {"mode": "async"}) == (
        "serial", "as configured", {})
    mode, why, tree = mode_selection.choose_mode(auto, True, None)  # no profile: the built-in rule says why
    assert mode in config.MODES and why.startswith("auto, rule: ")
    assert tree in ({}, mode_selection.SHALLOW_TREE) and (tree == mode_selection.SHALLOW_TREE) == ("bs 2, d 1" in why)
    # the rule's shallow tree where a SIMD kernel reads the blocks; a shape the user sets wins
    monkeypatch.setattr(mode_selection, "_available_cores", lambda: [0, 1])
    monkeypatch.setattr(mode_selection, "_numa_nodes", lambda: 1)
    from swiftspec import ops
    for isa, want in (("avx512_vnni", ("serial", mode_selection.SHALLOW_TREE)), ("avx512_vnni_512", ("serial", mode_selection.SHALLOW_TREE)),
                      ("avx2", ("ngram", {})), ("scalar", ("autoregressive", {})),
                      ("torch", ("autoregressive", {}))):
        monkeypatch.setattr(ops, "cpu_dispatch", lambda isa=isa: {"quant_gemm": isa})
        mode, why, tree = mode_selection.choose_mode(auto, True, None)
        assert (mode, tree) == want and isa in why
    assert mode_selection.choose_mode(config.EngineConfig(bs=4), True, None)[2] == {}
    assert mode_selection.choose_mode(auto, False, None)[:1] == ("serial",)  # dequantized target: the default tree
    profiled = {"mode": "async", "bs": 6, "w": 2, "topk": 2, "d": 3,
                "_measured": {"date": "2026-11-23 10:00", "tokens_per_s": 12.5}}
    assert mode_selection.choose_mode(auto, True, profiled) == (
        "async", "auto: swiftspec profile of 2026-11-23 10:00 measured it fastest on this machine and model "
        "pair (12.50 tokens/s)", {"bs": 6, "w": 2, "topk": 2, "d": 3})
    assert mode_selection.choose_mode(config.EngineConfig(w=4), True, profiled)[2] == {}
    assert mode_selection.choose_mode(auto, True, {"mode": "warp"})[0] != "warp"  # a broken record is ignored
    # stored per machine and pair, atomically; another pair or a corrupt file has none
    t, d, other = tmp_path / "t", tmp_path / "d", tmp_path / "o"
    path = machine_profile.save_profile(profiled, t, d, tmp_path / "cache")
    assert machine_profile.cached_profile(t, d, tmp_path / "cache")["mode"] == "async"
    assert machine_profile.cached_profile(t, other, tmp_path / "cache") is None
    path.write_text("{not json")
    assert machine_profile.cached_profile(t, d, tmp_path / "cache") is None


def test_a_seed_gives_the_same_sampled_output_in_every_mode(tiny_dir, tiny_draft_dir):
    """The i-th sampled token uses the i-th uniform of the request's generator, whether the row
    was sampled where the target ran (every mode here: only token ids come back) or on the host,
    and whatever the tree: with batch-invariant target logits, a seed gives the autoregressive
    output in every speculative mode, with a draft that differs from the target."""
    from swiftspec.engine.config import EngineConfig

    runs = [SamplingParams(temperature=t, top_p=p, top_k=k, seed=s, max_tokens=20, ignore_eos=True)
            for s in range(3) for (t, p, k) in ((1.0, 1.0, 0), (0.7, 0.9, 0), (1.2, 1.0, 5))]
    outs = {}
    for mode in ("autoregressive", "serial", "async", "colocated"):
        draft = None if mode == "autoregressive" else tiny_draft_dir
        with Engine(tiny_dir, draft, config=EngineConfig(mode=mode, dtype="float32")) as eng:
            outs[mode] = [eng.generate(PROMPT, p).token_ids for p in runs]
    assert len({tuple(map(tuple, o)) for o in outs.values()}) == 1, outs
    assert len({tuple(o) for o in outs["autoregressive"]}) > 1  # the seeds and parameters do differ


def _parent_pid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    return int(stat[stat.rindex(")") + 2:].split()[1])


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_workers_take_the_engines_environment_at_their_start(tiny_dir, monkeypatch, method):
    """Workers forked from the fork server (started by an earlier engine, in another environment)
    read ``SWIFTSPEC_*`` variables as the engine process holds them when it starts them, as
    spawned workers do; ``SWIFTSPEC_WORKER_START_METHOD`` picks the start method, a bad value is
    refused before any process starts."""
    monkeypatch.setenv("SWIFTSPEC_WORKER_START_METHOD", method)
    monkeypatch.delenv("SWIFTSPEC_QUANT_GEMM", raising=False)
    with Engine(tiny_dir, mode="autoregressive", dtype="float32") as eng:
        first = eng.workers[0]
        assert (_parent_pid(first["pid"]) == os.getpid()) == (method == "spawn")  # forked by the fork server
    if first["kernels"] is None:
        pytest.skip("the CPU kernels did not build here")
    assert first["kernels"]["quant_gemm_choice"] != "environment"
    monkeypatch.setenv("SWIFTSPEC_QUANT_GEMM", first["kernels"]["quant_gemm"])
    with Engine(tiny_dir, mode="autoregressive", dtype="float32") as eng:
        assert eng.workers[0]["kernels"]["quant_gemm_choice"] == "environment"
    monkeypatch.setenv("SWIFTSPEC_WORKER_START_METHOD", "fork")
    with pytest.raises(ValueError, match="SWIFTSPEC_WORKER_START_METHOD"):
        Engine(tiny_dir, mode="autoregressive", dtype="float32")


def test_a_script_without_a_main_guard_runs_once(tiny_dir, tmp_path):
    """A user's script that builds an engine at top level (no ``if __name__ == "__main__"``) runs
    its top level once: neither the fork server nor a worker imports the caller's script."""
    import subprocess
    import sys

    script = tmp_path / "script.py"
    script.write_text("from swiftspec import Engine, SamplingParams\nprint('top level ran')\n"
                      f"with Engine({str(tiny_dir)!r}, mode='autoregressive', dtype='float32') as eng:\n"
                      "    print(len(eng.generate([1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True)).token_ids))\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["top", "level", "ran", "5"], out.stdout


def test_a_dead_fork_server_fails_the_request_and_the_next_engine_starts(tiny_dir):
    """The fork server killed mid-request (the workers' exit statuses come through it): the
    request raises WorkerError naming it within seconds, no worker is left, and the next engine
    starts a new fork server and decodes."""
    eng = Engine(tiny_dir, mode="autoregressive", dtype="float32", max_model_len=2048)
    pids = eng.pids
    server = _parent_pid(pids[0])
    if server == os.getpid():
        pytest.skip("workers are spawned here (SWIFTSPEC_WORKER_START_METHOD)")
    it = eng.stream(PROMPT, SamplingParams(max_tokens=1500, ignore_eos=True))
    next(it)
    os.kill(server, signal.SIGKILL)
    raises_within(it, "fork server")
    time.sleep(0.3)
    assert not any(pid_alive(p) for p in pids)
    with Engine(tiny_dir, mode="autoregressive", dtype="float32") as eng2:
        assert len(eng2.generate(PROMPT, SamplingParams(max_tokens=4, ignore_eos=True)).token_ids) == 4
        assert _parent_pid(eng2.pids[0]) != server
