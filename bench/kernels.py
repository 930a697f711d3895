"""Kernel microbenchmark suite (our ops vs their unfused / library baselines, side by side);
see swiftspec/benchmark/kernels.py.

    python bench/kernels.py --json bench/kernels-2core.json
"""
import sys

from swiftspec.benchmark.kernels import main

if __name__ == "__main__":
    sys.exit(main())
