"""SwiftSpec: latency-first speculative decoding with concurrent draft and target groups.

Public API::

    from swiftspec import Engine, SamplingParams
    with Engine() as engine:                       # the default Qwen2.5-Coder pair
        out = engine.generate([{"role": "user", "content": "Write quicksort"}],
                              SamplingParams(max_tokens=128))
        print(out.text, out.metrics.compression_ratio)
"""
from swiftspec.model_executor.sampling import SamplingParams, TokenLogprob

__version__ = "0.1.0"
__all__ = ["Engine", "EngineConfig", "GenerationOutput", "StreamChunk", "SamplingParams", "TokenLogprob",
           "WorkerError", "EngineError", "TokenizerMismatchError"]


def __getattr__(name):
    # the engine pulls in transformers; keep `import swiftspec` light for workers and tools: each
    # name is imported from its module when first asked for
    if name == "Engine":
        from swiftspec.engine.llm_engine import Engine

        return Engine
    if name == "EngineConfig":
        from swiftspec.engine.config import EngineConfig

        return EngineConfig
    if name in __all__:
        from swiftspec.engine import outputs

        return getattr(outputs, name)
    raise AttributeError(name)
