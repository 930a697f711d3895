"""Command line: ``swiftspec generate``, ``serve``, ``bench``, ``profile``, ``worker`` (a remote
pipeline stage) and the model cache helper ``swiftspec fetch``."""
from __future__ import annotations

import argparse
import json
import os
import sys


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", help="target model: Hugging Face directory, AWQ checkpoint or GGUF file "
                                     "(default: the Qwen2.5-Coder-1.5B-Instruct target of the default pair)")
    p.add_argument("--draft", help="draft model (default: Qwen2.5-Coder-0.5B-Instruct)")
    p.add_argument("--config", help="engine configuration JSON (e.g. written by `swiftspec profile`)")
    p.add_argument("--mode", choices=["auto", "async", "serial", "hybrid", "colocated", "autoregressive", "ngram", "pipedec",
                                      "pipeinfer", "pipeline-autoregressive"], default=None,
                   help="auto = the fastest for this machine (default), async = SwiftSpec, serial = "
                        "SwiftSpec-base, colocated = SwiftSpec on one GPU (CUDA streams), autoregressive = "
                        "target only, ngram = target only verifying prompt-lookup proposals (no draft model), "
                        "hybrid = serial's draft tree and the prompt-lookup chain in one verification; "
                        "with --pipeline-stages: pipedec, pipeinfer, pipeline-autoregressive")
    p.add_argument("--pipeline-stages", type=int, help="split the target's layers into this many pipeline stages")
    p.add_argument("--pipeline-order", choices=["layer", "score"], help="pipedec's micro-batches (default layer)")
    p.add_argument("--remote-stages", type=_int_list, help="pipeline stages started on other hosts by "
                                                            "`swiftspec worker` (needs --master-port)")
    p.add_argument("--master-addr", help="this host's address for the pipeline rendezvous (default 127.0.0.1)")
    p.add_argument("--master-port", type=int, help="the pipeline rendezvous port")
    p.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default=None,
                   help="activations, and weights that run dequantized (auto: bfloat16 where the CPU has native bf16)")
    p.add_argument("--weights", choices=["native", "bfloat16", "float32"], default=None,
                   help="native = GGUF blocks as in the file, on the quantized kernels (default); "
                        "bfloat16/float32 = dequantized")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default=None,
                   help="where the models run (auto: CUDA when torch sees a GPU, else CPU)")
    p.add_argument("--target-devices", type=_int_list,
                   help="comma-separated GPU indices of the target group, one process each "
                        "(repeat an index for several ranks on one GPU)")
    p.add_argument("--draft-devices", type=_int_list,
                   help="comma-separated GPU indices of the draft group, one process each "
                        "(it may name the target's GPUs)")
    p.add_argument("--target-cores", type=_int_list, help="comma-separated CPU cores of the target group")
    p.add_argument("--draft-cores", type=_int_list, help="comma-separated CPU cores of the draft group")
    p.add_argument("--target-tp", type=int, help="TP degree (processes) of the target group")
    p.add_argument("--draft-tp", type=int, help="TP degree (processes) of the draft group")
    p.add_argument("--bs", type=int, help="subgraph size sent to the target (default 8)")
    p.add_argument("--w", type=int, help="leaves per draft expansion (default 2)")
    p.add_argument("--d", type=int, help="expansions per iteration (default: automatic in async, 3 in serial)")
    p.add_argument("--ngram-min", type=int, help="ngram mode: shortest suffix looked up (default 2)")
    p.add_argument("--ngram-max", type=int, help="ngram mode: longest suffix looked up (default 4)")
    p.add_argument("--ngram-tokens", type=int, help="ngram mode: tokens proposed per verification (default 1)")
    p.add_argument("--ngram-adaptive", action=argparse.BooleanOptionalAction, default=None,
                   help="ngram mode: propose only as many tokens as the matched suffix is long (default: off)")
    p.add_argument("--hybrid-rows", type=int, help="hybrid mode: most rows per verification (default 4)")
    p.add_argument("--max-model-len", type=int, help="context length in tokens (default 4096)")
    p.add_argument("--cache-dir", help="model cache (default $SWIFTSPEC_CACHE or ~/.cache/swiftspec)")
    p.add_argument("--kernels", action=argparse.BooleanOptionalAction, default=None,
                   help="use the compiled kernels (CPU twins / CUDA) where available (default: on)")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="on CUDA, replay decode steps from CUDA graphs (default: on)")
    p.add_argument("--draft-payback", action=argparse.BooleanOptionalAction, default=None,
                   help="serial mode: run a request on the target alone where the draft's prefill would not "
                        "pay back within its max tokens (default: on with --mode auto)")
    p.add_argument("--progress-timeout", type=float, dest="progress_timeout_s", metavar="S",
                   help="seconds a running request's workers may send nothing before they count as stuck "
                        "(the engine fails; the server restarts it; default 120)")
    p.add_argument("--liveness-interval", type=float, dest="liveness_interval_s", metavar="S",
                   help="serve: seconds between liveness pings of the idle engine's workers (default 5)")
    p.add_argument("--liveness-timeout", type=float, dest="liveness_timeout_s", metavar="S",
                   help="seconds a worker has to answer a liveness ping (default 10)")
    p.add_argument("--draft-sms", type=int, metavar="N",
                   help="colocated mode on CUDA: run the draft on N SMs of a CUDA green context, the target on "
                        "the whole GPU (default: no partition)")


def _env_int(name: str) -> int | None:
    v = os.environ.get(name)
    return int(v) if v is not None and v.strip().lstrip("-").isdigit() else None


def _str_list(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def _int_list(s: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The engine options the user gave on the command line (those left at None omitted, so a
    ``--config`` file or the engine's defaults decide them), as :class:`EngineConfig` keyword
    arguments."""
    keys = ["mode", "dtype", "weights", "device", "target_devices", "draft_devices", "target_cores", "draft_cores",
            "target_tp", "draft_tp", "bs", "w", "d", "ngram_min", "ngram_max", "ngram_tokens", "ngram_adaptive",
            "hybrid_rows",
            "max_model_len",
            "kernels", "cuda_graphs", "pipeline_stages", "pipeline_order", "remote_stages", "master_addr",
            "master_port", "draft_payback", "draft_sms", "progress_timeout_s", "liveness_interval_s",
            "liveness_timeout_s"]
    return {k: getattr(args, k) for k in keys if getattr(args, k, None) is not None}


def make_engine(args: argparse.Namespace):
    """An :class:`~swiftspec.engine.llm_engine.Engine` for the parsed ``args`` (model pair, ``--config``,
    cache directory and :func:`engine_kwargs`); raises what the engine's start raises
    (``ModelLoadError``, ``EngineError``, ``ValueError``)."""
    from swiftspec.engine.llm_engine import Engine

    return Engine(args.target, args.draft, config=args.config, cache_dir=args.cache_dir, **engine_kwargs(args))


def cmd_generate(args: argparse.Namespace) -> int:
    """``swiftspec generate``: one completion of ``--prompt`` (or stdin), streamed as text with a
    metrics line on stderr, or with ``--json`` one JSON object of the output. Returns 0."""
    from swiftspec.model_executor.sampling import SamplingParams

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                            max_tokens=args.max_tokens, stop=tuple(args.stop or ()), ignore_eos=args.ignore_eos,
                            logprobs=args.logprobs)
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    with make_engine(args) as engine:
        if args.json:
            out = engine.generate(prompt, params, chat=not args.no_chat)
            print(json.dumps(out.to_dict()))
            return 0
        out = None
        for chunk in engine.stream(prompt, params, chat=not args.no_chat):
            print(chunk.text, end="", flush=True)
            out = chunk.output or out
        m = out.metrics
        print(f"\n\n[{m.mode} ({m.mode_reason})] {m.num_tokens} tokens, {m.tokens_per_s:.1f} tokens/s decode, "
              f"TTFT {m.ttft_s:.2f} s, compression ratio {m.compression_ratio:.2f}", file=sys.stderr)
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    """``swiftspec worker``: run a remote pipeline stage (:func:`swiftspec.pipeline.worker.worker_cli`); its exit status."""
    from swiftspec.pipeline.worker import worker_cli

    return worker_cli(args)


def cmd_bench(args: argparse.Namespace) -> int:
    """``swiftspec bench``: the end-to-end benchmark (:func:`swiftspec.benchmark.e2e.main`); its exit status."""
    from swiftspec.benchmark.e2e import main as bench_main

    return bench_main(args=args)


def cmd_profile(args: argparse.Namespace) -> int:
    """``swiftspec profile``: choose this machine's configuration (:func:`swiftspec.benchmark.profile.main`); its exit status."""
    from swiftspec.benchmark.profile import main as profile_main

    return profile_main(args=args)


def cmd_serve(args: argparse.Namespace) -> int:
    """``swiftspec serve``: the OpenAI-compatible HTTP server on ``--host``:``--port``, serving the
    engine under ``--served-model-name`` (default: the target's directory name) until interrupted,
    with the request limits and browser/key checks of its flags. Returns 0."""
    from swiftspec.entrypoints.http_guard import ServerOptions
    from swiftspec.entrypoints.openai_protocol import Limits
    from swiftspec.entrypoints.server import serve
    from swiftspec.weights.loader import resolve_model

    name = args.served_model_name or resolve_model(args.target, "target", args.cache_dir).name
    opts = ServerOptions(api_key=args.api_key or os.environ.get("SWIFTSPEC_API_KEY") or None, bind_host=args.host,
                         allowed_hosts=tuple(args.allowed_hosts), allowed_origins=tuple(args.allowed_origins),
                         limits=Limits(max_body_bytes=args.max_body_bytes, max_messages=args.max_messages,
                                       max_stop_chars=args.max_stop_chars, request_timeout_s=args.request_timeout),
                         write_timeout_s=args.write_timeout, header_timeout_s=args.header_timeout,
                         max_connections=args.max_connections,
                         special_tokens_in_messages=args.special_tokens_in_messages)
    serve(lambda: make_engine(args), name, args.port, args.max_queue, opts)
    return 0


def cmd_fetch(args: argparse.Namespace) -> int:
    """``swiftspec fetch``: download and convert the default model pair into the cache and print
    their directories as JSON. Returns 0; raises ``ModelLoadError`` when a download or conversion
    fails."""
    from swiftspec.weights.loader import fetch_default_pair

    target, draft = fetch_default_pair(args.cache_dir)
    print(json.dumps({"target": str(target), "draft": str(draft)}))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``swiftspec`` command line: the subcommands generate, serve, bench, profile, worker and
    fetch, each with its options and its ``cmd_*`` function as ``func``."""
    parser = argparse.ArgumentParser(prog="swiftspec", description="Latency-first speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate a completion for one prompt")
    g.add_argument("--prompt", help="the user message (read from stdin when omitted)")
    g.add_argument("--no-chat", action="store_true", help="send the prompt raw, without the chat template")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--logprobs", type=int, default=None, metavar="K",
                   help="with --json: each token's log-probability and its K most likely alternatives")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    _add_engine_args(g)
    g.set_defaults(func=cmd_generate)

    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (chat/completions, completions, metrics)")
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--max-queue", type=int, default=16, help="requests that may wait while one decodes; more get 429")
    sv.add_argument("--api-key", help="require 'Authorization: Bearer <key>' (default: $SWIFTSPEC_API_KEY); "
                    "without one, browser requests from other sites are refused")
    sv.add_argument("--allowed-hosts", type=_str_list, default=[], help="comma-separated Host names accepted "
                    "without a key besides the bind address and localhost (behind a proxy; * = any)")
    sv.add_argument("--allowed-origins", type=_str_list, default=[], help="comma-separated browser Origins "
                    "(scheme://host[:port]) accepted without a key (* = any)")
    sv.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger request bodies get 413")
    sv.add_argument("--max-messages", type=int, default=1024, help="chat messages per request")
    sv.add_argument("--max-stop-chars", type=int, default=512, help="characters per stop string")
    sv.add_argument("--write-timeout", type=float, default=30.0,
                    help="seconds a stream's write may wait for a client that stops reading before it is cut off")
    sv.add_argument("--header-timeout", type=float, default=10.0,
                    help="seconds a connection has to send a whole request head (slow clients are closed)")
    sv.add_argument("--request-timeout", type=float, default=None, metavar="S",
                    help="deadline of a request's generation, seconds (a request's 'timeout_s' may ask for less); "
                         "past it the text so far is returned with finish_reason 'timeout' (default: none)")
    sv.add_argument("--max-connections", type=int, default=64, help="open connections; more get 503")
    sv.add_argument("--special-tokens-in-messages", action="store_true",
                    help="parse special-token text in chat message contents as control tokens (default: as text)")
    sv.add_argument("--served-model-name", help="the model id clients send (default: the target's directory name)")
    _add_engine_args(sv)
    sv.set_defaults(func=cmd_serve)

    b = sub.add_parser("bench", help="end-to-end benchmark against peers on the evaluation prompt sets")
    from swiftspec.benchmark.e2e import build_parser as bench_parser

    bench_parser(b)
    b.set_defaults(func=cmd_bench)

    pr = sub.add_parser("profile", help="measure candidate configurations and write the fastest as JSON")
    from swiftspec.benchmark.profile import build_parser as profile_parser

    profile_parser(pr)
    pr.set_defaults(func=cmd_profile)

    w = sub.add_parser("worker", help="one pipeline stage of an engine whose stage 0 runs on another host")
    env = os.environ  # torchrun's variables, where it launched us
    w.add_argument("--stage", "--node-rank", type=int, default=_env_int("RANK"), required="RANK" not in env,
                   help="this stage's index, 1 .. stages-1 (one stage per host; default: $RANK)")
    w.add_argument("--stages", "--nnodes", type=int, default=_env_int("WORLD_SIZE"), required="WORLD_SIZE" not in env,
                   help="the pipeline's length, the engine's pipeline_stages (default: $WORLD_SIZE)")
    w.add_argument("--master-addr", default=env.get("MASTER_ADDR"), required="MASTER_ADDR" not in env,
                   help="host of stage 0, the engine (default: $MASTER_ADDR)")
    w.add_argument("--master-port", type=int, default=_env_int("MASTER_PORT"), required="MASTER_PORT" not in env,
                   help="the engine's master_port (default: $MASTER_PORT)")
    w.add_argument("--target", help="this host's copy of the target model (default: the default pair's); "
                                    "its files must hash like stage 0's")
    w.add_argument("--cores", type=_int_list, help="comma-separated CPU cores (default: all this process may use)")
    w.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the rendezvous")
    w.add_argument("--cache-dir")
    w.set_defaults(func=cmd_worker)

    f = sub.add_parser("fetch", help="download, check and convert the default model pair into the cache")
    f.add_argument("--cache-dir")
    f.set_defaults(func=cmd_fetch)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the subcommand ``argv`` (default ``sys.argv[1:]``) names. Returns its exit status; 2 with
    the message on stderr for a usage, model or engine error (``ValueError``, ``ModelLoadError``,
    ``EngineError``, ``FileNotFoundError``); 130 on Ctrl-C."""
    args = build_parser().parse_args(argv)
    from swiftspec.engine.outputs import EngineError
    from swiftspec.weights.loader import ModelLoadError

    try:
        return args.func(args)
    except (ValueError, ModelLoadError, EngineError, FileNotFoundError) as e:
        print(f"swiftspec: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
