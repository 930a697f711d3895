"""Decode modes as objects: a proposer defined here, registered through the public factory, runs
through the engine's spawned workers and keeps the target's greedy output (nothing under
swiftspec/ knows of it)."""
import pytest

from swiftspec import Engine, SamplingParams
from swiftspec.engine.config import EngineConfig
from swiftspec.spec_decode.modes import ChainProposerMode, DecodeMode, mode_for, register_mode, registered


class RepeatLast:
    """Guesses that the last verified token repeats twice (often wrong: most steps cut the chain)."""

    def __init__(self, ids):
        self.last = ids[-1]
        self.proposed = 0

    def propose(self):
        self.proposed += 2
        return [self.last, self.last]

    def extend(self, tokens):
        self.last = tokens[-1]


@register_mode
class RepeatLastMode(ChainProposerMode):
    name = "test-repeat-last"

    def make_proposer(self, ids):
        return RepeatLast(ids)


@register_mode
class NeedsTreeOfFour(DecodeMode):
    """A mode that validates its configuration: it needs ``bs`` 4."""

    name = "test-needs-bs4"

    @classmethod
    def check_config(cls, config):
        if config.bs != 4:
            raise ValueError(f"test-needs-bs4 needs bs=4, got {config.bs}")


def test_registry_refuses_bad_modes_and_names_the_registered_ones():
    assert {"autoregressive", "ngram", "serial", "colocated", "target", "draft"} <= set(registered())
    assert mode_for("test-repeat-last") is RepeatLastMode and register_mode(RepeatLastMode) is RepeatLastMode
    with pytest.raises(ValueError, match="already registered"):
        register_mode(type("Other", (ChainProposerMode,), {"name": "ngram"}))
    with pytest.raises(ValueError, match="no mode name"):
        register_mode(type("Nameless", (DecodeMode,), {}))
    with pytest.raises(TypeError):
        register_mode(object)
    with pytest.raises(ValueError, match="test-repeat-last"):
        mode_for("no-such-mode")
    with pytest.raises(ValueError, match="mode must be"):
        EngineConfig(mode="no-such-mode")
    with pytest.raises(ValueError, match="needs bs=4"):  # the mode validates the fields it needs
        EngineConfig(mode="test-needs-bs4", bs=8)
    EngineConfig(mode="test-needs-bs4", bs=4)


def test_a_registered_proposer_runs_in_the_workers_and_keeps_greedy_output(tiny_dir):
    prompt, params = [1, 5, 9, 14, 5, 9], SamplingParams(max_tokens=24, ignore_eos=True)
    with Engine(tiny_dir, mode="autoregressive", dtype="float32", device="cpu") as eng:
        want = eng.generate(prompt, params)
    with Engine(tiny_dir, mode="test-repeat-last", dtype="float32", device="cpu") as eng:
        assert eng.draft_path is None  # a target-alone mode loads no draft
        got = eng.generate(prompt, params)
    assert got.token_ids == want.token_ids
    assert got.metrics.mode == "test-repeat-last"
    # the chains were verified (never more forwards than tokens), not a target-alone loop in disguise
    assert got.metrics.verifications <= len(got.token_ids) - 1
