"""Kernel microbenchmarks: each latency op against its unfused / library baselines, side by side.

    python bench/kernels.py                       # all ops, CPU twins here, CUDA kernels on a GPU
    python bench/kernels.py --ops allreduce --json out.json

Shapes follow the SwiftSpec paper's Table 7 (Llama-3 1B / 3B / 8B / 70B at TP 1/2/4/8, batch 8,
context 500 and 1000; scaled down where a shape does not fit this machine) plus the default pair's
(Qwen2.5-Coder 1.5B target, 0.5B draft). On CPU:

- ``allreduce``: the shared-memory LL one-shot all-reduce vs ``torch.distributed.all_reduce`` over
  gloo, 2 processes pinned to their own cores, messages of 1 KiB to 1 MiB;
- ``gemm_ar``: the fused GEMM + all-reduce vs ``x @ w.T`` then gloo all-reduce, TP = 2, batch 8;
- ``swiglu``: the fused SwiGLU vs PyTorch's best arrangement (one concatenated gate/up matmul, then
  SiLU * mul) and vs two separate matmuls, batch 1 and 8;
- ``linear``: the skinny-GEMM linear layer (QKV, o_proj, down_proj) vs ``F.linear``;
- ``rms_norm``: the fused residual add + RMSNorm (the C++ twin here, ``norm.cu`` on CUDA) vs the
  PyTorch path (``reference.rms_norm``: add, upcast, square, mean, rsqrt, scale, round, weight),
  1 / 8 / 16 rows of each model's hidden size;
- ``silu_mul``: SwiGLU's activation after the quantized GEMM (``ops.silu_and_mul`` on the fp32
  ``[M, 2I]`` gate | up sums, result in fp32 / bf16) vs the PyTorch path (SiLU of the strided gate
  half, multiply, cast), 1 / 8 / 16 / 512 rows of each model's intermediate size (CPU only);
- ``quant_linear``: the quantized GEMM on GGUF blocks (the default target's Q4_K / Q6_K layers, 1-16
  rows, every kernel this CPU runs, GB/s of weights) vs the kernels-off PyTorch path and ``F.linear``
  on dequantized fp32 / bf16 weights (CPU only);
- ``int8_linear``: the int8 weight-only twin (the draft's layers) vs torch's int8 weight-only kernel
  (``_weight_int8pack_mm``), bf16 activations, 1 / 2 / 4 rows (CPU only);
- ``attention``: the tree attention (RoPE fused) vs the PyTorch path (``swiftspec.ops.attention.torch_tree_attention``:
  RoPE, then row by row over the keys each row sees up to 16 rows, SDPA with a materialized mask
  above), 8 queries over 500 / 1000 cached keys.

On CUDA the same cases compare our kernels with cuBLAS + NCCL and SDPA (and FlashInfer when it is
installed). Every case alternates ours and the baseline for ``--rounds`` rounds, each round timing
``--iters`` calls; the table gives the median per-call time and the spread (10th-90th percentile of
the round medians). Timings here are noisy: read the ratios, measured in the same run.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from swiftspec.benchmark.kernel_cases import (
    attention_cases,
    int8_linear_cases,
    linear_cases,
    rms_norm_cases,
    silu_mul_cases,
    swiglu_cases,
)
from swiftspec.benchmark.kernel_comm import comm_cases
from swiftspec.benchmark.kernel_quant import quant_linear_cases
from swiftspec.benchmark.kernel_timing import MODELS, Case, machine, table


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``bench/kernels.py``: ops, dtypes, intra-op thread counts, rounds and
    calls per round, model shapes, input rows, device and the JSON output file."""
    ap = argparse.ArgumentParser(prog="bench/kernels.py", description=__doc__.splitlines()[0])
    ops_ = ["allreduce", "gemm_ar", "swiglu", "linear", "rms_norm", "silu_mul", "int8_linear", "quant_linear",
            "attention"]
    ap.add_argument("--ops", nargs="+", default=ops_, choices=ops_)
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float32"])
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2], help="intra-op threads (CPU)")
    ap.add_argument("--rounds", type=int, default=9, help="alternating rounds per case")
    ap.add_argument("--iters", type=int, default=20, help="calls per round")
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS),
                    help="model shapes for swiglu / attention")
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 8], help="input rows M of the swiglu cases")
    ap.add_argument("--quant-rows", nargs="+", type=int, default=[1, 2, 4, 8, 16],
                    help="input rows M of the quant_linear cases")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", help="write the records (median and spread per case) to this file")
    return ap


def main(argv=None) -> int:
    """Run the cases ``argv`` selects (the collectives and the CPU-only ops only on ``--device cpu``),
    print the backend, the machine and the table, and with ``--json`` write every case's summary
    with the machine and argv. Returns the exit status (0)."""
    args = build_parser().parse_args(argv)
    dtypes = [getattr(torch, d) for d in args.dtypes]
    from swiftspec import ops

    print(f"# machine: {machine()}", file=sys.stderr)
    cases: list[Case] = []
    if args.device == "cpu" and ({"allreduce", "gemm_ar"} & set(args.ops)):
        cases += comm_cases([o for o in args.ops if o in ("allreduce", "gemm_ar")], dtypes, args.rounds, args.iters)
    if "swiglu" in args.ops:
        cases += swiglu_cases(dtypes, args.threads, args.rounds, args.iters, args.device, args.models, args.rows)
    if "linear" in args.ops:
        cases += linear_cases(dtypes, args.threads, args.rounds, args.iters, args.device, args.models)
    if "rms_norm" in args.ops:
        cases += rms_norm_cases(dtypes, args.threads, args.rounds, args.iters, args.device, args.models)
    if "silu_mul" in args.ops and args.device == "cpu":
        cases += silu_mul_cases(dtypes, args.threads, args.rounds, args.iters, args.models)
    if "int8_linear" in args.ops and args.device == "cpu":
        cases += int8_linear_cases(args.threads, args.rounds, args.iters, args.models)
    if "quant_linear" in args.ops and args.device == "cpu":
        cases += quant_linear_cases(args.threads, args.rounds, args.iters, args.quant_rows)
    if "attention" in args.ops:
        cases += attention_cases(dtypes, args.threads, args.rounds, args.iters, args.device, args.models)
    probe = torch.empty(0, device=args.device)
    print(f"backend: {ops.backend(probe)}; machine: {machine()}")
    print(table(cases))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine(), "argv": sys.argv, "cases": [c.summary() for c in cases]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
