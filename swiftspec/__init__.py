"""SwiftSpec: latency-first speculative decoding with concurrent draft and target groups.

Public API::

    from swiftspec import Engine, SamplingParams
    with Engine() as engine:                       # the default Qwen2.5-Coder pair
        out = engine.generate([{"role": "user", "content": "Write quicksort"}],
                              SamplingParams(max_tokens=128))
        print(out.text, out.metrics.compression_ratio)
"""
import os as _os

# Large CPU tensors (the weights, a prefill's activations) on transparent huge pages: PyTorch's CPU
# allocator madvises allocations of 2 MB and more when THP_MEM_ALLOC_ENABLE is set, which it reads
# once, at its first allocation, so it is set here, before torch is imported (the engine's worker
# processes inherit it). Measured on AMD Zen 5 (bench/RESULTS.md, run 28): a 512-token prefill ~10 %
# faster, decode steps within the machine's noise. THP_MEM_ALLOC_ENABLE=0 keeps it off.
_os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

from swiftspec.sampling import SamplingParams, TokenLogprob  # noqa: E402

__version__ = "0.1.0"
__all__ = ["Engine", "EngineConfig", "GenerationOutput", "StreamChunk", "SamplingParams", "TokenLogprob",
           "WorkerError", "EngineError", "TokenizerMismatchError"]


def __getattr__(name):
    # the engine pulls in transformers; keep `import swiftspec` light for workers and tools
    if name in __all__:
        from swiftspec import engine

        return getattr(engine, name)
    raise AttributeError(name)
