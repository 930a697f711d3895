"""Target (or draft) forward time on native GGUF weights against the machine's read bandwidth.

For 1, 2, 4 and 8 rows (a one-token step and verifications; for the draft, expansions) after a
100-token prefill: the time of one forward + LM head (best of --rounds), the weight bytes it
reads (every block of the model's GGUF layers and the LM-head rows it computes: all for the
target, the engine's ``draft_vocab`` = 32768 for the draft) and the fraction of the read bandwidth that is, the bandwidth being the best
of 5 ``torch.sum`` passes over a 1 GiB fp32 tensor with the same thread count, probed right before
and right after each row count's timing (the better of the two; the record's top-level
``bandwidth_gb_s`` is the first probe of the run). Native weights in the kernels' layout (Q4_K, Q6_K and the 32-value types interleaved by
8 rows, or by 16 where the 512-bit kernel runs) and in the file's plain layout, side by side; also the same forward with every weight dequantized
(``weights="float32"``) and with the kernels off (the PyTorch path of the same arithmetic). Prints
a table and writes JSON (--out). ``--quant-gemm`` runs the interleaved forward once per named
quantized-GEMM variant (a kernel, "avx2+prefetch" / "avx2+noprefetch" for the 8-row kernels, or
"all": every variant this CPU runs; default: the one dispatch picks), side by side; ``--repeat N``
runs that list N times over, alternating (a shared machine's noise); ``--tune`` first lets the
self-tuning (swiftspec.ops.tuning) measure this model's weights and records what it chose.

    python bench/native_forward.py --threads 2 --out bench/results/native-forward-avx2.json
    python bench/native_forward.py --model draft --threads 2 --out bench/results/native-forward-draft-avx2.json
    python bench/native_forward.py --only-dispatched --dtype bfloat16 --prefill 128 512 --out r.json
    python bench/native_forward.py --only-dispatched --quant-gemm all --rows 1 2 4 --repeat 3 --tune --out r.json

``--prefill N ...`` also times prompts of N tokens through the dispatched native path (a request's
time to first token, less tokenization), recorded under "prefill".
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def step_fn(model, rows: int, vocab: int | None = None):
    """A closure running one forward of ``rows`` rows (+ LM head) at position 100 of a fresh
    256-slot KV cache, after a 100-token prefill (also used by bench/huge_pages.py)."""
    n = 100
    kv = model.make_kv_cache(256)
    ids = torch.randint(0, 1000, (n,))
    pos = torch.arange(n)
    mask = torch.ones(n, 256, dtype=torch.bool).tril()
    model.compute_logits(model(ids, pos, pos.clone(), mask, kv)[-1:], vocab)
    ids1, pos1, slots = torch.randint(0, 1000, (rows,)), torch.full((rows,), n), torch.arange(n, n + rows)
    mask1 = torch.zeros(rows, 256, dtype=torch.bool)
    mask1[:, : n + rows] = True
    return lambda: model.compute_logits(model(ids1, pos1, slots, mask1, kv), vocab)


def time_forward(model, rows: int, rounds: int, vocab: int | None = None) -> float:
    step = step_fn(model, rows, vocab)
    best = float("inf")
    for _ in range(rounds + 1):
        t = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - t)
    return best


def time_prefill(model, n: int, rounds: int) -> float:
    """Best time of a prefill of ``n`` tokens into an empty KV cache, with the LM head of its last row
    (a request's time to first token, less tokenization and sampling)."""
    kv = model.make_kv_cache(n + 16)
    ids, pos = torch.randint(0, 1000, (n,)), torch.arange(n)
    mask = torch.ones(n, n + 16, dtype=torch.bool).tril()
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        model.compute_logits(model(ids, pos, pos.clone(), mask, kv)[-1:])
        best = min(best, time.perf_counter() - t)
    return best


def tune(path, vocab: int | None) -> dict | None:
    """The self-tuning's choice for this model alone, measured now (swiftspec.ops.tuning; the rows
    of the engine's default verification): ``{"variant", "source", "times_ms", "rows"}``; None
    with the kernels unavailable. It stays applied (the default of the forwards that follow)."""
    from swiftspec.engine.config import EngineConfig
    from swiftspec.model_executor.kernel_tuning import tune_kernels

    rows = [1, EngineConfig().bs]
    choice = tune_kernels([(str(path), vocab)], rows, retune=True)
    if choice is None:
        return None
    print(f"self-tuning chose {choice.variant} ({choice.source}): "
          + ", ".join(f"{v} {t * 1e3:.1f} ms" for v, t in choice.times_s.items()), flush=True)
    return {"variant": choice.variant, "source": choice.source, "rows": rows,
            "times_ms": {v: t * 1e3 for v, t in choice.times_s.items()}}


def main() -> None:
    from swiftspec import ops
    from swiftspec.benchmark.memory import read_bandwidth, weight_read_bytes
    from swiftspec.model_executor.models.llama import load_model
    from swiftspec.weights import host_memory
    from swiftspec.weights.loader import fetch_default_pair

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["target", "draft"], default="target")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quant-gemm", nargs="+", metavar="VARIANT",
                    help="quantized-GEMM variants to time the interleaved layout with (ops.set_quant_gemm; all: "
                         "every variant this CPU runs)")
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 8], help="rows per forward")
    ap.add_argument("--repeat", type=int, default=1, help="time the list of variants this many times, alternating")
    ap.add_argument("--tune", action="store_true",
                    help="first measure the self-tuning's choice for this model (rows 1 and the default "
                         "verification's) and record it")
    ap.add_argument("--prefill", nargs="+", type=int, default=[], metavar="TOKENS",
                    help="also time prefills of these prompt lengths (best of 3), native weights, kernels on")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="activation dtype")
    ap.add_argument("--only-dispatched", action="store_true",
                    help="time the dispatched kernel's layout only (no plain layout, kernels off or float32 rows)")
    ap.add_argument("--out")
    args = ap.parse_args()
    path = fetch_default_pair(progress=False)[0 if args.model == "target" else 1]
    vocab = None if args.model == "target" else 32768  # EngineConfig.draft_vocab
    bw = read_bandwidth(torch.device("cpu"), args.threads)
    rows_out = []
    tuned = tune(path, vocab) if args.tune else None
    default_impl = ops.cpu_dispatch()["quant_gemm_variant"]
    named = args.quant_gemm or [default_impl]
    if named == ["all"]:
        from swiftspec.ops import dispatch, tuning

        named = tuning.variants(dispatch.cpu_module().quant_impls())
    configs = [("native", True, "x8", impl) for impl in named] * args.repeat
    if not args.only_dispatched:
        configs += [("native", True, "plain", default_impl), ("native", False, "plain", "-"),
                    ("float32", True, "-", "-")]
    dtype = getattr(torch, args.dtype)
    prefills = []
    for weights, kernels, layout, impl in configs:
        ops.set_kernels(kernels)
        ops.set_quant_x8(layout == "x8")
        ops.set_quant_gemm(impl if impl != "-" else default_impl)
        if layout != "-":  # the layout this kernel reads: interleaved by 16 or 8 rows, or the file's
            layout = f"x{ops.quant_interleave_rows()}" if ops.quant_interleave_rows() else "plain"
        model = load_model(path, dtype=dtype, max_positions=max(512, *args.prefill, 0) + 16, weights=weights)
        huge_bytes = host_memory.huge_page_bytes()  # the block weights' huge pages (swiftspec.weights.host_memory)
        nbytes = weight_read_bytes(model, vocab)
        before = read_bandwidth(torch.device("cpu"), args.threads)
        for rows in args.rows:
            t = time_forward(model, rows, args.rounds, vocab)
            after = read_bandwidth(torch.device("cpu"), args.threads)
            # this machine's memory state can change within seconds: each row count is set against the
            # better of the two probes taken right before and right after it
            near = max(before, after)
            before = after
            rows_out.append({"weights": weights, "kernels": kernels, "layout": layout, "quant_gemm": impl,
                             "quant_gemm_variant": ops.cpu_dispatch()["quant_gemm_variant"] if kernels else "-",
                             "huge_page_bytes": huge_bytes, "rows": rows,
                             "ms": t * 1e3, "weight_bytes": nbytes, "gb_s": nbytes / t / 1e9,
                             "bandwidth_gb_s": near / 1e9, "of_bandwidth": nbytes / t / near})
            print(f"{weights:8s} kernels={'on ' if kernels else 'off'} {layout:5s} {impl:19s} rows={rows:2d} "
                  f"{t * 1e3:8.1f} ms {nbytes / t / 1e9:6.1f} GB/s  {nbytes / t / near:5.0%} of {near / 1e9:.1f} GB/s",
                  flush=True)
        if weights == "native" and kernels and layout != "plain" and impl == default_impl:
            for n in args.prefill:
                t = time_prefill(model, n, 3)
                prefills.append({"tokens": n, "ms": t * 1e3, "tokens_per_s": n / t})
                print(f"prefill {n:5d} tokens {t * 1e3:8.1f} ms {n / t:7.1f} tokens/s", flush=True)
        del model
    ops.set_quant_gemm(default_impl)
    ops.set_kernels(True)
    ops.set_quant_x8(True)
    argv = " ".join(f"--{k.replace('_', '-')}" + ("" if v is True else " " + (" ".join(map(str, v))
                                                                         if isinstance(v, list) else str(v)))
                    for k, v in vars(args).items() if v)
    from swiftspec.benchmark.records import machine_record

    record = {"command": "python bench/native_forward.py " + argv, "model": args.model,
              **machine_record(),  # cpu, cpu_family, cpu_flags, isa, ...
              "threads": args.threads, "dtype": args.dtype, "bandwidth_gb_s": bw / 1e9, "rows": rows_out,
              "prefill": prefills, "tuning": tuned}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
