"""``swiftspec bench`` where the checkpoints cannot go: random weights and replayed acceptance.

``--record-trace FILE`` (with the real pair, ``autoregressive`` among the systems) writes the
acceptance trace of the run's prompts (:mod:`swiftspec.spec_decode.acceptance`: the target's tokens and their
ranks among the draft's candidates). ``--random-weights`` runs every system on models of the
real shapes with random weights (:mod:`swiftspec.weights.random_weights`), on the prompts of the trace
given by ``--acceptance`` (default: the one shipped with the package, recorded from the default
pair), each SwiftSpec mode replaying the trace's acceptance (``Engine.generate(replay=...)``) for
as many tokens as the trace holds (end-of-sequence ignored). The tokens are then not the
target's, so ``matches_target`` is "n/a"; the compression ratio is the recorded pair's under
this run's tree; the speed is measured end to end on this machine.
"""
from __future__ import annotations

import argparse
from pathlib import Path

# the default pair's trace, recorded with `swiftspec bench --record-trace` (bench/LOG.md: "Replaying the default pair's acceptance")
PACKAGED_TRACE = Path(__file__).resolve().parents[1] / "data" / "traces" / "default-pair.json"
# systems that cannot run on random weights with a replayed trace
NOT_REPLAYABLE = ("hf-assisted", "llama-cpp", "llama-cpp-spec", "llama-cpp-lookup", "pipeline-autoregressive", "pipedec", "pipeinfer")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """Add the acceptance-replay options to a ``swiftspec bench`` parser: ``--record-trace``,
    ``--random-weights``, ``--acceptance``, ``--target-config`` / ``--draft-config`` and
    ``--degrade`` (probabilities in [0, 1]; :func:`check` validates them together)."""
    ap.add_argument("--record-trace", metavar="FILE",
                    help="write the acceptance trace of this run's prompts (needs autoregressive among the systems)")
    ap.add_argument("--random-weights", action="store_true",
                    help="models of the real shapes with random weights (--target-config/--draft-config), "
                         "acceptance replayed from --acceptance")
    ap.add_argument("--acceptance", metavar="TRACE", help=f"acceptance trace to replay (default {PACKAGED_TRACE.name}, "
                                                          "shipped)")
    ap.add_argument("--target-config", help="config.json of the target's shapes for --random-weights, or the "
                                            "name of a shipped one, e.g. qwen2.5-14b-instruct (default: the "
                                            "default pair's)")
    ap.add_argument("--draft-config", help="config.json (or shipped name) of the draft's shapes for --random-weights")
    ap.add_argument("--degrade", type=float, nargs="+", default=[0.0], metavar="P",
                    help="with --random-weights: replay the trace as a pair that agrees less, each recorded rank "
                         "moved one down with probability P (one pass per value on the loaded systems; "
                         "default 0: as recorded)")


def check(args: argparse.Namespace) -> None:
    """Refuse inconsistent flags before anything loads. Raises ValueError."""
    if args.random_weights:
        if args.record_trace:
            raise ValueError("--record-trace needs the real models (not --random-weights)")
        if args.target or args.draft:
            raise ValueError("--random-weights builds its models from --target-config/--draft-config, not --target/--draft")
        bad = [s for s in args.systems if s in NOT_REPLAYABLE]
        if bad:
            raise ValueError(f"{', '.join(bad)} cannot run on random weights with a replayed trace "
                             "(peers with their own draft, GGUF-only peers and the pipeline modes)")
        if any(not 0.0 <= p <= 1.0 for p in args.degrade) or len(set(args.degrade)) != len(args.degrade):
            raise ValueError(f"--degrade takes distinct probabilities in [0, 1], got {args.degrade}")
    elif args.acceptance or args.target_config or args.draft_config or args.degrade != [0.0]:
        raise ValueError("--acceptance, --target-config, --draft-config and --degrade go with --random-weights")
    if args.record_trace and "autoregressive" not in args.systems:
        raise ValueError("--record-trace needs autoregressive among the systems (the target's own tokens)")


def random_pair(args: argparse.Namespace, dtype: str) -> tuple[Path, Path]:
    """The (target, draft) recipe directories of random weights of the configured shapes
    (:func:`swiftspec.weights.random_weights.materialize`; the weights are made on the device at load),
    with one placeholder tokenizer of the smaller vocabulary for both, as a real pair of one
    family shares its tokenizer."""
    from swiftspec.weights.random_weights import DEFAULT_CONFIGS, materialize, packaged_config, read_config

    paths = (packaged_config(args.target_config) if args.target_config else DEFAULT_CONFIGS[0],
             packaged_config(args.draft_config) if args.draft_config else DEFAULT_CONFIGS[1])
    vocab = min(int(read_config(p)[2]["vocab_size"]) for p in paths)
    target, draft = (materialize(p, dtype, tokenizer_vocab=vocab) for p in paths)
    return target, draft


def trace_prompts(args: argparse.Namespace) -> list[tuple[str, list[int], int, "acceptance.Replay"]]:
    """The trace's prompts for this run: (dataset, prompt ids, tokens to generate, its
    :class:`~swiftspec.spec_decode.acceptance.Replay`), the first ``--num-prompts`` of each dataset in
    ``--prompts``, at most ``--max-tokens`` tokens each."""
    from swiftspec.spec_decode import acceptance

    doc = acceptance.load(args.acceptance or PACKAGED_TRACE)
    per: dict[str, int] = {}
    out = []
    for p in doc["prompts"]:
        ds = p["dataset"]
        if ds not in args.prompts or per.get(ds, 0) >= args.num_prompts:
            continue
        per[ds] = per.get(ds, 0) + 1
        n = min(args.max_tokens, len(p["tokens"]))
        out.append((ds, p["prompt_ids"], n, acceptance.Replay.of(doc, p, n)))
    if not out:
        raise ValueError(f"the trace holds no prompt of {args.prompts}")
    return out


def record_trace(args: argparse.Namespace, prompts: list[tuple[str, list[int], list[int]]], target_dir: Path,
                 draft_dir: Path, dtype: str, machine: dict) -> None:
    """Rank the target's tokens among the draft's candidates (the draft built as the engine
    builds it: the first ``--config``'s or the default ``draft_quant`` and ``draft_vocab``) and write the trace."""
    from swiftspec.engine.config import EngineConfig
    from swiftspec.model_executor.models.config import ModelConfig
    from swiftspec.spec_decode import acceptance

    cfg = EngineConfig.from_json(args.config[0]) if args.config else EngineConfig()
    vocab = min(ModelConfig.from_dir(target_dir).vocab_size, ModelConfig.from_dir(draft_dir).vocab_size)
    draft_vocab = cfg.draft_logits_vocab(vocab)
    entries = record(prompts, draft_dir, dtype, cfg.draft_quant_method, draft_vocab)
    acceptance.save(args.record_trace, entries, target=Path(target_dir).name, draft=Path(draft_dir).name,
                    dtype=dtype, machine=machine, draft_vocab=draft_vocab, draft_quant=cfg.draft_quant)
    s = acceptance.summary(acceptance.load(args.record_trace))
    print(f"acceptance trace: {args.record_trace} ({len(entries)} prompts, {s['positions']} positions; the draft's "
          f"first choice {s['top1']:.1%}, among its first 4 {s['top4']:.1%})")


def draft_ranks(runner, prompt_ids: list[int], tokens: list[int],
                k: int | None = None) -> tuple[list[int | None], list[list[float]]]:
    """Rank of each target token among the draft's ``k`` most likely next tokens, teacher-forced,
    and the draft's ``LOGPROBS_K`` highest log-probabilities at each position.

    Args:
        runner: the draft's :class:`swiftspec.model_executor.runner.ModelRunner`, built as the engine builds it
            (same weights, ``draft_quant`` and ``logits_vocab``), KV capacity at least
            ``len(prompt_ids) + len(tokens)``.
        prompt_ids: ``[P]`` prompt token ids.
        tokens: ``[T]`` the target's generated tokens.
        k: candidates per position (default :data:`swiftspec.spec_decode.acceptance.RANKS_K`).
    Returns:
        ``[T]`` ranks (0 = the draft's most likely token; None: not among its first ``k``) and
        ``[T, LOGPROBS_K]`` log-probabilities (rounded to 1e-4), heaviest first.
    """
    import torch

    from swiftspec.spec_decode.acceptance import LOGPROBS_K, RANKS_K

    k = k or RANKS_K
    seq = list(prompt_ids) + list(tokens[:-1])
    n = len(seq)
    pos = torch.arange(n)
    rows = torch.arange(len(prompt_ids) - 1, n)  # row i predicts tokens[i - P + 1]
    values, ids = runner.forward(torch.tensor(seq), pos, pos, torch.ones(n, n, dtype=torch.bool).tril(), rows, k)
    ranks: list[int | None] = [c.index(t) if t in c else None for t, c in zip(tokens, ids.tolist())]
    return ranks, [[round(v, 4) for v in row] for row in values[:, :LOGPROBS_K].tolist()]


def record(prompts: list[tuple[str, list[int], list[int]]], draft_dir, dtype: str, draft_quant: str | None,
           draft_vocab: int | None, k: int | None = None) -> list[dict]:
    """The trace's prompt entries: ``prompts`` = (dataset, prompt ids, the target's tokens) per
    prompt; the draft is loaded here (native weights, as the engine loads it)."""
    import torch

    from swiftspec.model_executor.runner import ModelRunner

    longest = max(len(p) + len(t) for _, p, t in prompts)
    runner = ModelRunner(str(draft_dir), dtype=getattr(torch, dtype), capacity=-(-longest // 256) * 256,
                         quant=draft_quant, logits_vocab=draft_vocab)
    out = []
    with torch.inference_mode():
        for ds, p, t in prompts:
            ranks, lps = draft_ranks(runner, p, t, k)
            out.append({"dataset": ds, "prompt_ids": list(p), "tokens": list(t), "ranks": ranks, "logprobs": lps})
    return out
