"""The end-to-end benchmark's systems: their names, the SwiftSpec engine behind the peers'
``generate`` signature, starting one, and which system's tokens another's are compared with."""
from __future__ import annotations

from pathlib import Path

# "-dequantized": every weight dequantized in the activation dtype (the engine before native weights)
SYSTEMS = ("swiftspec-async", "swiftspec-async-nokernels", "swiftspec-profiled", "swiftspec-serial",
           "swiftspec-colocated",
           "swiftspec-serial-nokernels", "swiftspec-serial-dequantized", "autoregressive", "autoregressive-nokernels",
           "autoregressive-dequantized", "hf", "hf-compile", "hf-assisted", "llama-cpp", "llama-cpp-spec",
           "llama-cpp-lookup", "pipeline-autoregressive", "pipedec", "pipeinfer")
ENGINE_MODES = {"swiftspec-async": "async", "swiftspec-profiled": "async", "swiftspec-serial": "serial",
                "swiftspec-colocated": "colocated",
                "autoregressive": "autoregressive", "swiftspec-async-nokernels": "async",
                "swiftspec-serial-nokernels": "serial", "autoregressive-nokernels": "autoregressive",
                "swiftspec-serial-dequantized": "serial", "autoregressive-dequantized": "autoregressive",
                "pipeline-autoregressive": "pipeline-autoregressive", "pipedec": "pipedec", "pipeinfer": "pipeinfer"}
# the pipeline modes use 2 stages, each on its own share of the cores (swiftspec.pipeline.stages)
PIPELINE_STAGES = 2


def base_system(name: str) -> str:
    """The system a record's name is an instance of: ``swiftspec-profiled[serial-bs4]`` ->
    ``swiftspec-profiled``; other names are their own."""
    return name.split("[", 1)[0]


def expand_systems(systems: list[str], configs: list[str] | None) -> list[tuple[str, str | None]]:
    """(record name, configuration file or None) of every system to start: ``swiftspec-profiled``
    once per ``--config`` file, named ``swiftspec-profiled[<file stem>]`` when there are several.

    Every file is read here, before any model loads.

    Raises:
        ValueError: ``swiftspec-profiled`` without a configuration, configurations without
            ``swiftspec-profiled``, two files with the same stem (their rows would merge), or a
            file that is not an engine configuration (:meth:`EngineConfig.from_json`).
        FileNotFoundError: a configuration file that does not exist.
    """
    from swiftspec.engine.config import EngineConfig

    configs = list(configs or [])
    if "swiftspec-profiled" in systems and not configs:
        raise ValueError("swiftspec-profiled needs --config (from `swiftspec profile`)")
    if configs and "swiftspec-profiled" not in systems:
        raise ValueError("--config configures swiftspec-profiled: add it to --systems")
    stems = [Path(c).stem for c in configs]
    if len(set(stems)) != len(stems):
        raise ValueError(f"--config files need distinct names (their rows are named by them): {configs}")
    for c in configs:
        EngineConfig.from_json(c)
    out: list[tuple[str, str | None]] = []
    for s in systems:
        if s != "swiftspec-profiled":
            out.append((s, None))
        elif len(configs) == 1:
            out.append((s, configs[0]))
        else:
            out += [(f"{s}[{stem}]", c) for stem, c in zip(stems, configs)]
    return out


class EngineSystem:
    """A SwiftSpec engine in one of its modes, behind the peers' ``generate`` signature."""

    def __init__(self, system: str, target, draft, dtype: str, cores: list[int], d: int | None,
                 config: str | None = None, device: str = "auto"):
        from swiftspec.engine.config import TARGET_ONLY_MODES
        from swiftspec.engine.config import EngineConfig
        from swiftspec.engine.llm_engine import Engine
        from swiftspec.spec_decode import modes

        if config is not None:  # the file decides mode, cores and tree; the run decides the dtype
            cfg = EngineConfig.from_json(config, dtype=dtype, device=device)
        else:
            mode = ENGINE_MODES[system]
            kw: dict = dict(mode=mode, dtype=dtype, device=device, kernels=not system.endswith("-nokernels"),
                            weights="float32" if system.endswith("-dequantized") else "native")
            if mode == "async":
                n_draft = max(1, len(cores) // 4)
                kw.update(target_cores=cores[:-n_draft], draft_cores=cores[-n_draft:], d=d)
            elif mode.startswith("pipe"):
                kw.update(target_cores=cores, pipeline_stages=PIPELINE_STAGES)
            else:
                kw.update(target_cores=cores)
            cfg = EngineConfig(**kw)
        self.engine = Engine(target, draft if cfg.mode not in TARGET_ONLY_MODES else None,
                             config=cfg)
        self.system = system
        c = self.engine.config  # as resolved (mode="auto" and an automatic d decided)
        t = c.tree_params()
        self.shape = {"mode": c.mode, "bs": t.bs, "w": t.w, "topk": t.topk, "d": c.d, "target_tp": c.target_tp,
                      "weights": c.weights, "draft_payback": c.draft_payback, "draft_sms": c.draft_sms,
                      "mode_reason": self.engine.mode_reason}
        if c.mode in modes.registered():  # the proposals' shape (pipeline and async modes have none here)
            self.shape.update({f: getattr(c, f) for f in modes.mode_for(c.mode).shape_fields})

    def generate(self, prompt_ids, max_tokens, eos_ids=(), ignore_eos: bool = False, replay=None):
        """Greedy tokens and metrics; ``replay``: an acceptance trace's ranks (see
        :meth:`swiftspec.engine.llm_engine.Engine.generate`)."""
        from swiftspec.model_executor.sampling import SamplingParams

        out = self.engine.generate(prompt_ids, SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos),
                                   replay=replay)
        return out.token_ids, out.metrics

    def close(self):
        """Shut the engine down (its worker processes and their memory)."""
        self.engine.close()


def start_system(system: str, target_dir, draft_dir, dtype: str, cores: list[int], args, n_ctx: int = 4096,
                 config: str | None = None):
    """Load one system of the run. ``n_ctx``: the llama.cpp peers' context (the longest prompt
    plus the tokens to generate; with a draft model llama-cpp-python keeps logits for every
    position of it, 0.6 MB each for the default pair's vocabulary). ``config``: the engine
    configuration file of a ``swiftspec-profiled`` system (:func:`expand_systems`)."""
    from swiftspec.benchmark.peers import HFPeer, LlamaCppPeer

    if base_system(system) == "swiftspec-profiled":
        if config is None:
            raise ValueError("swiftspec-profiled needs --config (from `swiftspec profile`)")
        return EngineSystem(system, target_dir, draft_dir, dtype, cores, None, config, args.device)
    if system in ENGINE_MODES:
        return EngineSystem(system, target_dir, draft_dir, dtype, cores, args.d, device=args.device)
    if system == "hf":
        return HFPeer(target_dir, None, dtype, threads=len(cores), device=args.device)
    if system == "hf-compile":
        return HFPeer(target_dir, None, dtype, threads=len(cores), device=args.device, compiled=True,
                      max_cache_len=n_ctx)
    if system == "hf-assisted":
        return HFPeer(target_dir, draft_dir, dtype, threads=len(cores), device=args.device)
    if system in ("llama-cpp", "llama-cpp-spec", "llama-cpp-lookup"):
        gguf, draft = args.target_gguf, args.draft_gguf
        if args.target is None or args.draft is None:
            from swiftspec.weights.loader import default_gguf_paths

            defaults = default_gguf_paths()
            gguf = gguf or (defaults[0] if args.target is None else None)
            draft = draft or (defaults[1] if args.draft is None else None)
        if gguf is None or not Path(gguf).exists():
            raise RuntimeError(f"{system} needs the target's GGUF file (--target-gguf)")
        if system == "llama-cpp":
            return LlamaCppPeer(gguf, threads=len(cores), n_ctx=n_ctx)
        if system == "llama-cpp-lookup":
            return LlamaCppPeer(gguf, threads=len(cores), n_ctx=n_ctx, lookup=True)
        if draft is None or not Path(draft).exists():
            raise RuntimeError("llama-cpp-spec needs the draft's GGUF file (--draft-gguf)")
        return LlamaCppPeer(gguf, threads=len(cores), n_ctx=n_ctx, draft_gguf=draft, draft_tokens=4)
    raise ValueError(system)


def reference_system(s: str, systems: dict, outs: dict) -> str | None:
    """The system whose tokens are ``s``'s "target": for an engine, an autoregressive engine with
    the same target TP degree and weights (at TP > 1 the row-parallel sums round at other points
    than TP = 1's, so in bf16 greedy output may differ from TP = 1's at near-ties; dequantized
    weights are another model), ``autoregressive`` first; for a peer, ``autoregressive``. None
    (the table's "n/a") where no such system ran, and for the reference itself: no system is
    compared with its own output."""
    shape = getattr(systems.get(s), "shape", None)
    if shape is None:
        return "autoregressive" if "autoregressive" in outs else None
    key = (shape.get("target_tp", 1), shape.get("weights", "native"))
    same = [r for r in outs if r != s and getattr(systems.get(r), "shape", {}).get("mode") == "autoregressive"
            and (systems[r].shape.get("target_tp", 1), systems[r].shape.get("weights", "native")) == key]
    return min(same, key=lambda r: r != "autoregressive", default=None)
