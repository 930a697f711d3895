"""Accuracy of the target on native GGUF weights against llama.cpp on the same file.

Text: the six evaluation prompt sets shipped with the package, concatenated and tokenized with the
target's tokenizer, cut into ``--chunks`` chunks of ``--chunk`` tokens. Each chunk is one prefill;
at every position the next-token distributions of llama.cpp (``llama-cpp-python``, ``logits_all``)
and of our target are compared: top-1 agreement and mean KL(llama.cpp || ours) in nats. Our target
runs with ``weights="native"`` (kernels on, and kernels off: the PyTorch path of the same
arithmetic) and with ``weights="float32"`` (every weight dequantized), fp32 activations. Prints
a table and writes JSON (``--out``); no timings (it may share the machine).

    python bench/accuracy.py --out bench/results/accuracy-avx2.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def llama_cpp_logits(gguf: Path, chunks: list[list[int]], threads: int) -> list[torch.Tensor]:
    from llama_cpp import Llama

    n = max(len(c) for c in chunks)
    llm = Llama(model_path=str(gguf), n_ctx=n, n_batch=n, n_ubatch=n, n_threads=threads, n_threads_batch=threads,
                logits_all=True, verbose=False)
    out = []
    for c in chunks:
        llm.reset()
        llm.eval(c)
        out.append(torch.from_numpy(llm.scores[: len(c)].copy()).float())
    return out


def our_logits(model, chunk: list[int]) -> torch.Tensor:
    n = len(chunk)
    kv = model.make_kv_cache(n)
    pos = torch.arange(n)
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(chunk), pos, pos.clone(), mask, kv)).float()


def compare(ref: torch.Tensor, ours: torch.Tensor) -> tuple[float, float]:
    """(top-1 agreement, mean KL(ref || ours) in nats) over the rows."""
    lp, lq = torch.log_softmax(ref.double(), -1), torch.log_softmax(ours.double(), -1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    return float((ref.argmax(-1) == ours.argmax(-1)).double().mean()), float(kl.mean())


def main() -> None:
    from transformers import AutoTokenizer

    from swiftspec import ops
    from swiftspec.benchmark.records import DATASETS, load_prompts
    from swiftspec.model_executor.models.llama import load_model
    from swiftspec.weights.loader import default_gguf_paths, fetch_default_pair

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--chunk", type=int, default=512, help="tokens per chunk (one prefill)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target, _ = fetch_default_pair(progress=False)
    gguf = default_gguf_paths()[0]
    tok = AutoTokenizer.from_pretrained(str(target))
    text = "\n\n".join(p for ds in DATASETS for p in load_prompts(ds, 1000)[1])
    ids = tok(text)["input_ids"]
    if len(ids) < args.chunks * args.chunk:
        raise SystemExit(f"only {len(ids)} tokens of text for {args.chunks} x {args.chunk}")
    chunks = [ids[i * args.chunk:(i + 1) * args.chunk] for i in range(args.chunks)]
    ref = llama_cpp_logits(gguf, chunks, args.threads)
    rows = []
    for weights, kernels in (("native", True), ("native", False), ("float32", True)):
        ops.set_kernels(kernels)
        model = load_model(target, dtype=torch.float32, max_positions=args.chunk, weights=weights)
        # chunk by chunk (a few thousand rows of 152k-token distributions do not fit in memory at once)
        parts = [(len(c), *compare(r, our_logits(model, c))) for r, c in zip(ref, chunks)]
        n = sum(p[0] for p in parts)
        top1, kl = sum(p[0] * p[1] for p in parts) / n, sum(p[0] * p[2] for p in parts) / n
        rows.append({"weights": weights, "kernels": kernels, "tokens": sum(map(len, chunks)), "top1_agreement": top1,
                     "mean_kl_nats": kl})
        print(f"{weights:8s} kernels={'on ' if kernels else 'off'}  top-1 agreement {top1:.4f}  "
              f"mean KL {kl:.2e} nats", flush=True)
        del model
    ops.set_kernels(True)
    from swiftspec.engine.machine_profile import cpu_model_name

    cpu = cpu_model_name()
    record = {"command": "python bench/accuracy.py " + " ".join(f"--{k} {v}" for k, v in vars(args).items() if v),
              "cpu": cpu, "isa": ops.cpu_dispatch(), "dtype": "float32", "gguf": gguf.name, "rows": rows}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
