"""End-to-end benchmark against peers (same as ``swiftspec bench``); see swiftspec/benchmark/e2e.py.

    python bench/e2e.py --num-prompts 5 --max-tokens 128
"""
import sys

from swiftspec.benchmark.e2e import main

if __name__ == "__main__":
    sys.exit(main())
